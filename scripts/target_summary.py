"""Issue #4's targets from the results files of ``gpu_check.sh targets``: per shape, each round's fwd+bwd
(median ms and TFLOP/s), the median over rounds, the triton/torch ratio where torch ran, and whether the median
meets the target (7B ≥ 440 TFLOP/s and ≥ 3× torch; (32768, 4096, 1024, 128, 8) ≥ 570 TFLOP/s). Also each run's
timing window (``--rep``, ms) and, where the results file has it (since session 50), the SM clock and temperature
over the fwd+bwd window.

usage: python scripts/target_summary.py RESULTS.json [...]
"""

from __future__ import annotations

import argparse
import json
import statistics

TARGETS = {(24576, 1536, 256, 128, 8): 440.0, (32768, 4096, 1024, 128, 8): 570.0}
TORCH_RATIO_TARGET = {(24576, 1536, 256, 128, 8): 3.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    runs: dict[tuple, list[tuple[float, float]]] = {}  # (ms, TFLOP/s) per run
    ratios: dict[tuple, list[float]] = {}
    clocks: dict[tuple, list[str]] = {}  # "MHz/°C" per run, "?" where not recorded
    device, windows = set(), set()
    for path in sorted(args.files):
        with open(path) as f:
            res = json.load(f)
        device.add(res["env"]["device"])
        windows.add(res.get("args", {}).get("rep"))
        for row in res["results"]:
            # one shape's top-k and token-rounding records, or two activations' records, are different runs
            key = ((row["T"], row["d"], row["n"], row["E"], row["K"]), row.get("routing") or "topk",
                   row.get("activation") or "swiglu")
            tri = (row.get("backends") or {}).get("triton", {})
            if tri.get("status") != "ok" or not tri.get("total"):  # --mode fwd: no fwd+bwd timing
                continue
            runs.setdefault(key, []).append((tri["total"]["ms"]["p50"], tri["total"]["tflops"]))
            g = tri["total"].get("gpu")
            clocks.setdefault(key, []).append(f"{g['sm_mhz']:.0f}/{g['temp_c']}" if g else "?")
            if (row.get("ratios") or {}).get("torch", {}).get("total") is not None:
                ratios.setdefault(key, []).append(row["ratios"]["torch"]["total"])
    print(f"device(s): {', '.join(sorted(device))} | timing window (ms): "
          f"{', '.join(str(w) for w in sorted(windows, key=str))}")
    for key, rs in runs.items():
        tf = [r[1] for r in rs]
        med = statistics.median(tf)
        dims, routing, act = key
        target = TARGETS.get(dims) if (routing, act) == ("topk", "swiglu") else None  # issue #4's targets: top-k
        name = f"{dims} {routing}" + ("" if act == "swiglu" else f" {act}")
        verdict = "" if target is None else f"target {target:.0f}: {'met' if med >= target else 'NOT met'}"
        print(f"{name}: {len(rs)} runs, fwd+bwd TFLOP/s {[round(t, 1) for t in tf]} ms {[round(r[0], 3) for r in rs]}"
              f" | median {med:.1f} | {verdict}")
        if any(c != "?" for c in clocks[key]):
            print(f"{name}: SM MHz / °C over each fwd+bwd window {clocks[key]}")
        if key in ratios:
            rt = TORCH_RATIO_TARGET.get(dims) if target is not None else None
            med_r = statistics.median(ratios[key])
            print(f"{name}: vs torch {[round(r, 2) for r in ratios[key]]} | median {med_r:.2f}x" +
                  ("" if rt is None else f" | target {rt:.0f}x: {'met' if med_r >= rt else 'NOT met'}"))


if __name__ == "__main__":
    main()
