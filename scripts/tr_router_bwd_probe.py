"""Where the bench's router variant spends its forward+backward (kernels, host ops): top-k against token rounding.

The token-rounding sweep (session 33, call 9) timed router + routing + experts forward+backward at (16384, 1536, 256,
128, 8) 1.3 ms slower with token rounding than with top-k, while the forwards differed by 0.22 ms and the experts'
backwards by 0.02 ms. This builds the bench's own problem and case (``sonicmoe.bench``) for each routing, runs its
``forward_with_router`` forward+backward a few times, and prints the profiler's kernel table (CUDA time) and host
table (self CPU time) of a few calls, and the wall time per call with and without a synchronisation per call.

usage: python scripts/tr_router_bwd_probe.py [--shape T,d,n,E,K] [--calls 10]
(CPU smoke run: TRITON_INTERPRET=1 ... --device cpu --dtype fp32 --shape 64,32,16,4,2 --calls 2)
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sonicmoe.bench.baselines import REGISTRY
from sonicmoe.bench.measure import fwdbwd_fn
from sonicmoe.bench.problem import make_problem
from sonicmoe.bench.shapes import Shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="16384,1536,256,128,8")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    shape = Shape("probe", *(int(v) for v in args.shape.split(",")))
    for mode in ("topk", "token_rounding"):
        problem = make_problem(shape, dtype=dtype, device=dev, seed=0, mode=mode, m_tile=8 if shape.T < 1024 else 128)
        case = REGISTRY["triton"].factory(problem, {})
        step = fwdbwd_fn(case.forward_with_router, case.router_leaves, problem.dout)
        for _ in range(5):
            step()
        sync()
        for each in (False, True):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                step()
                if each:
                    sync()
            sync()
            print(f"{mode}: {(time.perf_counter() - t0) * 1e3 / args.calls:.3f} ms per router fwd+bwd call"
                  f"{' (synchronised each call)' if each else ''}", flush=True)
        with profile(activities=activities) as prof:
            for _ in range(3):
                step()
            sync()
        avg = prof.key_averages()
        print(f"{mode}: kernels by CUDA time (3 calls)", flush=True)
        by = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
        print(avg.table(sort_by=by, row_limit=16, max_name_column_width=60), flush=True)
        print(f"{mode}: host ops by self CPU time (3 calls)", flush=True)
        print(avg.table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=50), flush=True)
        del problem, case, step
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
