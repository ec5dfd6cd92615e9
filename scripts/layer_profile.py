"""GPU diagnostic: every GPU kernel of the Triton layer's forward and forward+backward, as the benchmark
calls it (``sonicmoe.experts(..., backend="triton")`` on a precomputed top-k routing), with its mean time
per call from the torch profiler, next to do_bench's median of the whole call — so time spent outside the
eight main kernels (small ops, gaps between launches) shows up.

``--timeline``: after a settled warm-up (``--warmup`` ms of back-to-back calls, as the benchmark's), one
forward+backward call's kernels in launch order from a Chrome trace of the profiler: stream, start and duration
(µs from the call's first kernel), and the time the GPU had no kernel running before each one, so that what lies
on the critical path and where the GPU idles show up.

``--load-profile LOG.json``: the router re-scaled to a trained model's expert load (as ``sonicmoe bench
--load-profile``), so that each kernel's share of what an uneven load costs shows up.

usage (GPU): PYTHONPATH=$PWD python scripts/layer_profile.py [--shape T,d,n,E,K] [--calls 20]
             [--load-profile LOG.json] [--timeline [--warmup 1000] [--trace F.json]]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import torch
from triton.testing import do_bench

from sonicmoe import functional
from sonicmoe.bench.problem import make_problem
from sonicmoe.bench.shapes import Shape


def _profiled(fn, calls: int) -> torch.profiler.profile:
    """The profiler (CUDA activity) after ``calls`` back-to-back calls of ``fn``, the GPU drained at the end."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def profile(fn, calls: int) -> tuple[list[tuple[str, float, int]], float]:
    """(kernel name, mean µs per call, launches per call) by total time, and the span of one call in µs."""
    fn()
    torch.cuda.synchronize()
    prof = _profiled(fn, calls)
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


def timeline(fn, warmup_ms: float, calls: int, trace_path: str | None) -> None:
    """Print the kernels of the middle one of ``calls`` profiled calls, after ``warmup_ms`` of back-to-back calls."""
    end = time.perf_counter() + warmup_ms / 1e3
    while time.perf_counter() < end:
        fn()
    torch.cuda.synchronize()
    prof = _profiled(fn, calls)
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_path or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    # every call launches the same kernels: split by count
    per_call = len(kernels) // calls
    mid = kernels[per_call * (calls // 2): per_call * (calls // 2 + 1)]
    t0 = mid[0]["ts"]
    busy_until = t0
    idle_total = 0.0
    print(f"== timeline: {per_call} kernels per call, call {calls // 2} of {calls}")
    print(f"{'start':>8} {'dur':>7} {'idle':>6} stream  kernel")
    for e in mid:
        idle = max(0.0, e["ts"] - busy_until)
        idle_total += idle
        busy_until = max(busy_until, e["ts"] + e["dur"])
        print(f"{e['ts'] - t0:8.1f} {e['dur']:7.1f} {idle:6.1f} {e['args'].get('stream', '?'):>6}  {e['name'][:90]}")
    print(f"== span {busy_until - t0:.1f} us, GPU idle inside it {idle_total:.1f} us, "
          f"kernel time {sum(e['dur'] for e in mid):.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="24576,1536,256,128,8", help="T,d,n,E,K")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--timeline", action="store_true", help="one forward+backward call's kernels in order")
    ap.add_argument("--warmup", type=float, default=1000.0, help="ms of back-to-back calls before --timeline")
    ap.add_argument("--trace", default=None, help="where --timeline writes the Chrome trace")
    ap.add_argument("--load-profile", default=None, help="a training log's expert load (sonicmoe bench's option)")
    args = ap.parse_args()
    t, d, n, e, k = (int(v) for v in args.shape.split(","))
    load = None
    if args.load_profile:
        from sonicmoe.bench.load_profile import target_load

        load = target_load(args.load_profile, e)
        print(f"load profile {args.load_profile}: busiest expert {float(load.max()) * e:.2f}x the mean, idlest "
              f"{float(load.min()) * e:.2f}x")
    p = make_problem(Shape("profile", t, d, n, e, k), dtype=torch.bfloat16, device="cuda", load=load)
    leaves = [p.x, p.w1, p.w2, p.pair_scores]

    def fwd():
        return functional.experts(p.x, p.w1, p.w2, p.routing, p.pair_scores, backend="triton")

    def fwdbwd():
        for leaf in leaves:
            leaf.grad = None
        fwd().backward(p.dout)

    if args.timeline:
        fwdbwd()
        timeline(fwdbwd, args.warmup, 5, args.trace)
        return
    for label, fn in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")  # triton's default is the mean
        rows, span = profile(fn, args.calls)
        busy = sum(us for _, us, _ in rows)
        print(f"== {label} T,d,n,E,K={args.shape}: do_bench {ms * 1e3:.0f} us, profiler span {span:.0f} us/call, "
              f"kernels busy {busy:.0f} us/call")
        for name, us, launches in rows:
            print(f"  {us:8.1f} us  x{launches}  {name[:110]}")


if __name__ == "__main__":
    main()
