"""The backward's dX aggregation beside the weight-gradient GEMMs (two CUDA streams) or after them (GPU).

usage: python benchmarks/overlap_ab.py [--shape T,d,n,E,K ...] [--rounds 3] [--modes 1,0] [--json OUT]

For each shape: the Triton layer's forward+backward on a precomputed top-k routing (as ``sonicmoe bench``
calls it), timed with do_bench (median, L2 flushed) for each SONICMOE_OVERLAP value of ``--modes`` in turn,
``rounds`` times each, so drifting clocks hit all alike. Each (round, mode) runs in a process of its own
(``--same-process`` runs them in this one): in one process, whichever mode runs second was 13-15% slower at
(32768, 4096, 1024, 128, 8) on an H100 whatever its order, which a training run, one mode throughout, never
sees. The gradients of every mode must be bitwise equal to the first's (compared in ``--same-process`` runs).
Prints and records each mode's rounds, their median and its TFLOP/s (18·TK·n·d, SPEC §7).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
import triton
from triton.testing import do_bench

from sonicmoe import functional
from sonicmoe.bench.problem import make_problem
from sonicmoe.bench.shapes import Shape
from sonicmoe.provenance import git_commit


def run(shape: str, rounds: int, modes: list[str]) -> dict:
    t, d, n, e, k = (int(v) for v in shape.split(","))
    p = make_problem(Shape("ab", t, d, n, e, k), dtype=torch.bfloat16, device="cuda")
    leaves = [p.x, p.w1, p.w2, p.pair_scores]

    def fwdbwd():
        for leaf in leaves:
            leaf.grad = None
        functional.experts(p.x, p.w1, p.w2, p.routing, p.pair_scores, backend="triton").backward(p.dout)

    grads, ms = {}, {m: [] for m in modes}
    for _ in range(rounds):
        for flag in modes:
            os.environ["SONICMOE_OVERLAP"] = flag
            fwdbwd()
            grads[flag] = [leaf.grad.clone() for leaf in leaves]
            ms[flag].append(do_bench(fwdbwd, warmup=25, rep=200, return_mode="median"))
    os.environ.pop("SONICMOE_OVERLAP")
    for flag in modes[1:]:
        if not all(torch.equal(a, b) for a, b in zip(grads[modes[0]], grads[flag])):
            raise AssertionError(f"{shape}: gradients of SONICMOE_OVERLAP={flag} and ={modes[0]} differ")
    flops = 18 * t * k * n * d
    out = {"shape": shape, "ms": ms, "median_ms": {}, "tflops": {}}
    for flag in modes:
        out["median_ms"][flag] = statistics.median(ms[flag])
        out["tflops"][flag] = flops / out["median_ms"][flag] / 1e9
    return out


def isolated(shape: str, rounds: int, modes: list[str]) -> dict:
    """:func:`run` with each (round, mode) in a fresh process (timings only)."""
    ms = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for m in modes:
                path = os.path.join(tmp, "row.json")
                subprocess.run([sys.executable, __file__, "--same-process", "--shape", shape, "--rounds", "1",
                                "--modes", m, "--json", path], check=True, env={**os.environ, "SONICMOE_OVERLAP": m},
                               stdout=subprocess.DEVNULL)
                with open(path) as fh:
                    ms[m] += json.load(fh)["rows"][0]["ms"][m]
    t, d, n, e, k = (int(v) for v in shape.split(","))
    med = {m: statistics.median(v) for m, v in ms.items()}
    tflops = {m: 18 * t * k * n * d / v / 1e9 for m, v in med.items()}
    return {"shape": shape, "ms": ms, "median_ms": med, "tflops": tflops, "isolated": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None, help="T,d,n,E,K (repeatable; default 7B)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="1,0", help="SONICMOE_OVERLAP values, alternated in this order")
    ap.add_argument("--same-process", action="store_true", help="all modes and rounds in this process")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for shape in args.shape or ["24576,1536,256,128,8"]:
        modes = args.modes.split(",")
        row = run(shape, args.rounds, modes) if args.same_process else isolated(shape, args.rounds, modes)
        rows.append(row)
        print(f"{shape} fwd+bwd: " + ", ".join(f"SONICMOE_OVERLAP={m} {ms:.3f} ms ({row['tflops'][m]:.1f} TFLOP/s)"
                                               for m, ms in row["median_ms"].items()), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "commit": git_commit(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
