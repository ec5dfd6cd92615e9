"""GPU diagnostic: every GPU kernel of the Triton layer's forward and forward+backward, as the benchmark
calls it (``sonicmoe.experts(..., backend="triton")`` on a precomputed top-k routing), with its mean time
per call from the torch profiler, next to do_bench's median of the whole call — so time spent outside the
eight main kernels (small ops, gaps between launches) shows up.

usage (GPU): PYTHONPATH=$PWD python scripts/layer_profile.py [--shape T,d,n,E,K] [--calls 20]
"""

from __future__ import annotations

import argparse
import collections

import torch
from triton.testing import do_bench

from sonicmoe import functional
from sonicmoe.bench.problem import make_problem
from sonicmoe.bench.shapes import Shape


def profile(fn, calls: int) -> tuple[list[tuple[str, float, int]], float]:
    """(kernel name, mean µs per call, launches per call) by total time, and the span of one call in µs."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total, count = collections.Counter(), collections.Counter()
    starts, ends = [], []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time
            count[ev.name] += 1
            starts.append(ev.time_range.start)
            ends.append(ev.time_range.end)
    rows = [(name, us / calls, count[name] // calls) for name, us in total.most_common()]
    span = (max(ends) - min(starts)) / calls if starts else 0.0
    return rows, span


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="24576,1536,256,128,8", help="T,d,n,E,K")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    t, d, n, e, k = (int(v) for v in args.shape.split(","))
    p = make_problem(Shape("profile", t, d, n, e, k), dtype=torch.bfloat16, device="cuda")
    leaves = [p.x, p.w1, p.w2, p.pair_scores]

    def fwd():
        return functional.experts(p.x, p.w1, p.w2, p.routing, p.pair_scores, backend="triton")

    def fwdbwd():
        for leaf in leaves:
            leaf.grad = None
        fwd().backward(p.dout)

    for label, fn in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
        ms = do_bench(fn, warmup=25, rep=100)
        rows, span = profile(fn, args.calls)
        busy = sum(us for _, us, _ in rows)
        print(f"== {label} T,d,n,E,K={args.shape}: do_bench {ms * 1e3:.0f} us, profiler span {span:.0f} us/call, "
              f"kernels busy {busy:.0f} us/call")
        for name, us, launches in rows:
            print(f"  {us:8.1f} us  x{launches}  {name[:110]}")


if __name__ == "__main__":
    main()
