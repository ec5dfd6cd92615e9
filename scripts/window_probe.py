"""Where does the spread of issue #4's 7B protocol come from: the 100 ms timing window, or the process?

`sonicmoe bench` times forward+backward with one ``do_bench`` window (1000 ms warm-up, ``--rep`` 100 ms, about 30
calls at 7B). Some protocol runs read 10-20% slow (session 49). This probe, in one process on the bench's own problem
and triton case, separates the candidates:

  windows       the bench's measurement (``bench_ms``: warm-up 1000 ms, rep 100 ms) --windows times back to back,
                each with the mean SM clock, board power and clock-event reasons sampled by NVML during it
  long          ``bench_ms`` with rep 1000 ms, --long times
  trace         --trace seconds of forward+backward calls timed one by one with CUDA events (do_bench's L2 flush
                before each), placed on the host clock, so each call's time can be set against the sampled clock
  replaced      --replace times: free the case and problem, empty the caching allocator, hold a pad of a new size
                (other physical pages for everything after), rebuild, then --per-replace windows

If window medians spread inside one process as much as across processes, and a window's time follows its SM clock,
the spread is the power limiter's clock over a short window, not the process or its memory placement.

usage (GPU): PYTHONPATH=$PWD python scripts/window_probe.py [--shape T,d,n,E,K] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sonicmoe.bench.baselines import REGISTRY
from sonicmoe.bench.gpu_state import GpuWatch
from sonicmoe.bench.measure import bench_ms, free_memory, fwdbwd_fn
from sonicmoe.bench.problem import make_problem
from sonicmoe.bench.shapes import Shape


def trace(fn, leaves, seconds: float, sampler: GpuWatch) -> list[dict]:
    """``fn`` called back to back for ``seconds``, each call timed by CUDA events after do_bench's L2 flush; returns
    per call {t (host s, start on the GPU), ms, MHz and C (the nearest NVML sample)}."""
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    n = int(seconds * 1000 / 2) + 16
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    origin = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    origin.record()
    t_host = time.perf_counter()
    calls = 0
    while calls < n and time.perf_counter() - t_host < seconds:
        for t in leaves:
            t.grad = None
        flush.zero_()
        starts[calls].record()
        fn()
        ends[calls].record()
        calls += 1
    torch.cuda.synchronize()
    out = []
    samples = sampler.samples
    j = 0
    for i in range(calls):
        t = t_host + origin.elapsed_time(starts[i]) / 1e3
        while j + 1 < len(samples) and samples[j + 1][0] <= t:
            j += 1
        out.append({"t": t, "ms": starts[i].elapsed_time(ends[i]), "MHz": samples[j][1] if samples else None,
                    "C": samples[j][3] if samples else None})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="24576,1536,256,128,8")
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--trace", type=float, default=6.0)
    ap.add_argument("--replace", type=int, default=3)
    ap.add_argument("--per-replace", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dims = tuple(int(v) for v in args.shape.split(","))
    shape = Shape("probe", *dims)
    dev = torch.device("cuda")
    T, d, n, E, K = dims
    flop = 18 * T * K * n * d
    sampler = GpuWatch(dev, period=0.005).start()  # NVML every 5 ms on its own thread
    if sampler.nvml is None:
        raise SystemExit("NVML (libnvidia-ml.so.1) did not open: the probe needs the GPU's clock")
    res: dict = {"shape": dims, "gpu": torch.cuda.get_device_name(), "windows": [], "long": [], "replaced": []}

    def build():
        problem = make_problem(shape, dtype=torch.bfloat16, device=dev, seed=0)
        return problem, REGISTRY["triton"].factory(problem, {})

    def window(case, problem, rep: float, label: str) -> dict:
        fn = fwdbwd_fn(case.forward, case.leaves, problem.dout)
        t_start = time.perf_counter()
        q = bench_ms(fn, device=dev, rep=rep, grad_to_none=case.leaves)
        t_end = time.perf_counter()
        # the measured part is the last `rep` ms (do_bench runs its warm-up first)
        state = sampler.between(t_end - rep / 1e3 - 0.02, t_end) or {}
        row = {"label": label, **q, "tflops": flop / q["p50"] / 1e9, "MHz": state.get("sm_mhz"),
               "W": state.get("watts"), "reasons": state.get("clock_reasons"), "C": state.get("temp_c")}
        row["warm_s"] = t_end - t_start
        print(f"{label:<14} p20 {q['p20']:.3f} p50 {q['p50']:.3f} p80 {q['p80']:.3f} ms  {row['tflops']:6.1f} TF/s  "
              f"{row['MHz'] or 0:6.0f} MHz {row['W'] or 0:6.0f} W  {row['reasons']}", flush=True)
        return row

    problem, case = build()
    case.forward().backward(problem.dout)  # compile and autotune outside the windows
    torch.cuda.synchronize()
    for i in range(args.windows):
        res["windows"].append(window(case, problem, 100.0, f"w{i}"))
    for i in range(args.long):
        res["long"].append(window(case, problem, 1000.0, f"long{i}"))
    tr = trace(fwdbwd_fn(case.forward, case.leaves, problem.dout), case.leaves, args.trace, sampler)
    res["trace"] = tr
    # slices of the trace (100 ms, or 10 calls where calls are longer than 10 ms): median ms, mean clock, temperature
    res["trace_slices"] = slices = []
    width = max(0.1, 10 * statistics.median(x["ms"] for x in tr) / 1e3)
    t0 = tr[0]["t"]
    for k in range(int((tr[-1]["t"] - t0) / width) + 1):
        part = [x for x in tr if k * width <= x["t"] - t0 < (k + 1) * width]
        if len(part) >= 3:
            slices.append({"t": k * width, "ms": statistics.median(x["ms"] for x in part),
                           "MHz": statistics.fmean(x["MHz"] for x in part), "C": max(x["C"] for x in part)})
    ms = [s["ms"] for s in slices]
    print(f"trace {len(tr)} calls, {len(slices)} slices of {width * 1e3:.0f} ms: slice medians min {min(ms):.3f} "
          f"p50 {statistics.median(ms):.3f} max {max(ms):.3f} ms; all calls median "
          f"{statistics.median(x['ms'] for x in tr):.3f}", flush=True)
    for s in slices:
        print(f"  slice {s['t']:6.2f} s {s['ms']:.3f} ms {s['MHz']:6.0f} MHz {s['C']} C  "
              f"ms*GHz {s['ms'] * s['MHz'] / 1e3:.3f}")
    for r in range(args.replace):
        del case, problem
        free_memory()
        pad = torch.empty((r + 1) * 1536 * 1024 * 1024 + r * 12345 * 512, dtype=torch.uint8, device=dev)
        problem, case = build()
        case.forward().backward(problem.dout)
        for i in range(args.per_replace):
            res["replaced"].append(window(case, problem, 100.0, f"pad{r + 1}-w{i}"))
        del pad
    sampler.stop()
    for key in ("windows", "long", "replaced"):
        v = [x["p50"] for x in res[key]]
        if v:
            print(f"{key:<9} medians of {len(v)}: min {min(v):.3f} median {statistics.median(v):.3f} "
                  f"max {max(v):.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
