"""Host time (µs to enqueue one call, no synchronisation) of the router's pieces and of the routing, on the GPU.

Rows: the logits GEMM as ``torch.mm(out_dtype=float32)`` (the bf16 tensor-core path), as the float32 GEMM of the
upcast operands, as a plain bf16 ``torch.mm``; ``router_topk``; the top-k and the static token-rounding routing
(``sonicmoe.bench.problem.route``). Then cProfile's top functions (cumulative) over 20 static token-rounding
routings. A router whose host time exceeds its GPU time makes the eager layer host-bound.

usage: python scripts/router_host_probe.py [--shape T,d,n,E,K ...]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import time

import torch

import sonicmoe
from sonicmoe.bench.measure import host_ms
from sonicmoe.bench.problem import route


def pieces(x, w, k) -> dict:
    """name -> call, for X (T, d) and W_r (E, d) bfloat16 and top-K."""
    return {
        "mm out_dtype=float32": lambda: torch.mm(x, w.t(), out_dtype=torch.float32),
        "float32 linear (upcast)": lambda: torch.nn.functional.linear(x.float(), w.float()),
        "bf16 mm": lambda: torch.mm(x, w.t()),
        "router_topk": lambda: sonicmoe.router_topk(x, w, k),
        "route topk": lambda: route(x, w, k, "topk", pairs=False),  # the layer's routing: no pair list
        "route token_rounding static": lambda: route(x, w, k, "token_rounding", static=True),
        "route token_rounding (sync)": lambda: route(x, w, k, "token_rounding"),
    }


def blocks_host(fn) -> float:
    """ms the host spends in ``fn`` right after queueing ~50 ms of GPU work: about 50 when ``fn`` synchronises, far
    less when it does not."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    fn()
    torch.cuda.synchronize()
    for _ in range(60):  # ~1 ms each on an H100
        a @ a
    t0 = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["24576,1536,256,128,8", "16384,1536,256,512,8"])
    args = ap.parse_args()
    for spec in args.shape:
        t, d, _, e, k = (int(v) for v in spec.split(","))
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(e, d, device="cuda", dtype=torch.bfloat16)
        rows = pieces(x, w, k)
        print(f"shape {spec}", flush=True)
        for name, fn in rows.items():
            print(f"  {name:<30} {host_ms(fn, calls=20) * 1e3:8.1f} us host", flush=True)
        mask = torch.rand(t, e, device="cuda") < k / e
        for name, fn in (("nonzero_static", functools.partial(torch.nonzero_static, mask, size=t * k, fill_value=-1)),
                         ("nonzero", functools.partial(torch.nonzero, mask)),
                         ("route token_rounding static", rows["route token_rounding static"])):
            print(f"  host ms in {name} behind ~50 ms of GPU work: {blocks_host(fn):.2f}", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            route(x, w, k, "token_rounding", static=True)
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
