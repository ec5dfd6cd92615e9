"""Host (Python) time of one layer call against its GPU time, on given shapes (GPU).

usage: python scripts/host_overhead.py [--shape T,d,n,E,K ...] [--profile]

For the Triton layer's forward and forward+backward (routing precomputed, top-k): the host time to
enqueue one call (perf_counter over calls with no synchronisation), the wall time per call once the GPU
has finished them, do_bench's median, and the kernels' summed time per call (torch profiler). When the
enqueue time is the larger, timings of the eager layer measure the host, not the kernels. ``--profile``:
the 30 host functions with the most cumulative time (cProfile) over 20 forward+backward
calls, and torch's CPU-side operator table over 10.
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


def measure(spec: str, profile: bool) -> None:
    """Print the host, wall and do_bench times of one shape ``spec`` = "T,d,n,E,K"."""
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
    # host time of the pieces: the operator through the dispatcher, its implementation called directly,
    # and each kernel launcher on its own (no gradients; enqueue only)
    from sonicmoe.ops import library
    from sonicmoe.ops.aggregation import gather_sum
    from sonicmoe.ops.dh import dh
    from sonicmoe.ops.grouped_gemm import down_proj, varlen_m_gemm
    from sonicmoe.ops.up_proj import up_proj
    from sonicmoe.ops.weight_grad import varlen_k_gemm

    x, w1, w2 = p["x"], p["w1"], p["w2"]
    arrays = [getattr(routing, f) for f in library.FWD_ROUTING_FIELDS]
    h, a = up_proj(x, w1, None, routing)
    s_row = routing.row_scores(s_pair).float()
    s_slot = routing.slot_scores(s_pair).float()
    y = down_proj(a, w2, None, routing)
    pieces = {
        "experts_fwd op": lambda: torch.ops.sonicmoe.experts_fwd(x, w1, w2, None, None, s_pair, *arrays, "concat",
                                                                 True),
        "experts_fwd_impl": lambda: library.experts_fwd_impl(x, w1, w2, None, None, s_pair, *arrays, "concat", True),
        "up_proj": lambda: up_proj(x, w1, None, routing),
        "down_proj": lambda: down_proj(a, w2, None, routing),
        "gather_sum": lambda: gather_sum(y, routing, s_slot),
        "dh": lambda: dh(dout, w2, h, s_row, routing),
        "varlen_m_gemm (dX~)": lambda: varlen_m_gemm(h, w1, None, routing, transpose_b=False),
        "varlen_k_gemm (dW1)": lambda: varlen_k_gemm(h, x, routing, p_gather=False, q_gather=True,
                                                     out_dtype=w1.dtype),
        "row_scores": lambda: routing.row_scores(s_pair),
    }
    with torch.no_grad():
        for name, fn in pieces.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            print(f"{spec}   host {name:22s} {1e3 * (t1 - t0) / 20:7.3f} ms/call")
    if profile:
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(20):
            fwd_bwd()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
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
