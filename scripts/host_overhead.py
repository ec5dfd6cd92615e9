"""Host (Python) time of one layer call against its GPU time, on given shapes (GPU).

usage: python scripts/host_overhead.py [--shape T,d,n,E,K ...] [--profile]

For the Triton layer's forward and forward+backward (routing precomputed, top-k): the host time to
enqueue one call (perf_counter over calls with no synchronisation), the wall time per call once the GPU
has finished them, do_bench's median, and the kernels' summed time per call (torch profiler); then the
host time of the forward operator against its implementation called directly (per launcher:
``scripts/launch_overhead.py``). When the enqueue time is the larger, timings of the eager layer measure the
host, not the kernels. ``--profile``: the 30 host functions with the most cumulative time (cProfile) over
20 forward+backward calls, and torch's CPU-side operator table over 10.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from triton.testing import do_bench

import sonicmoe
from sonicmoe.testing import random_problem


def layer_calls(spec: str):
    """A random bf16 problem of ``spec`` = "T,d,n,E,K" on the GPU with its top-k routing precomputed: returns
    (problem dict, routing, pair scores S (TK,), grad leaves [x, W1, W2, S], forward call, forward+backward
    call) of the Triton layer (the forward+backward call resets the leaves' gradients first)."""
    t, d, n, e, k = (int(v) for v in spec.split(","))
    p = random_problem(t, d, n, e, dtype=torch.bfloat16, device="cuda", seed=0)
    router = sonicmoe.router_topk(p["x"], p["router_weight"], k)
    routing = sonicmoe.routing_from_topk(router.topk_ids, e)
    s_pair = router.topk_scores.reshape(-1).detach()
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    leaves = [v.detach().requires_grad_(True) for v in (p["x"], p["w1"], p["w2"], s_pair)]

    def fwd():
        return sonicmoe.experts(*leaves[:3], routing, leaves[3], backend="triton")

    def fwd_bwd():
        for v in leaves:
            v.grad = None
        fwd().backward(dout)

    return p, routing, s_pair, leaves, fwd, fwd_bwd


def enqueue_ms(fn, calls: int = 20) -> float:
    """Host time to enqueue one call of ``fn``, ms (the GPU drained before; no sync inside the loop)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e3 * (t1 - t0) / calls


def profile_calls(fn, calls: int = 20, sort: str = "cumulative", limit: int = 30) -> None:
    """cProfile of ``calls`` calls of ``fn`` (the GPU drained before and after): the ``limit`` functions with the
    most ``sort`` time."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats(sort).print_stats(limit)


def measure(spec: str, profile: bool) -> None:
    """Print the host, wall and do_bench times of one shape ``spec`` = "T,d,n,E,K"."""
    p, routing, s_pair, leaves, fwd, fwd_bwd = layer_calls(spec)

    for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        calls = 20
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        bench = do_bench(fn, warmup=25, rep=100, return_mode="median")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        busy = sum(ev.self_device_time_total for ev in prof.key_averages()) / 5e3  # us -> ms per call
        print(f"{spec} {name:8s} host enqueue {1e3 * (t1 - t0) / calls:7.3f} ms/call   wall "
              f"{1e3 * (t2 - t0) / calls:7.3f} ms/call   do_bench {bench:7.3f} ms   kernels {busy:7.3f} ms")
    # the operator through the dispatcher against its implementation called directly (no gradients); each
    # kernel launcher's host time on its own: scripts/launch_overhead.py
    from launch_overhead import host_us

    from sonicmoe.ops import library

    args = (p["x"], p["w1"], p["w2"], None, None, s_pair,
            *(getattr(routing, f) for f in library.FWD_ROUTING_FIELDS), "concat", True)
    with torch.no_grad():
        for name, fn in (("experts_fwd op", lambda: torch.ops.sonicmoe.experts_fwd(*args)),
                         ("experts_fwd_impl", lambda: library.experts_fwd_impl(*args))):
            print(f"{spec}   host {name:22s} {host_us(fn, 20) / 1e3:7.3f} ms/call")
    if profile:
        profile_calls(fwd_bwd)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tprof:
            for _ in range(10):
                fwd_bwd()
            torch.cuda.synchronize()
        print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    for spec in args.shape or ["24576,1536,256,128,8"]:
        measure(spec, args.profile)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
