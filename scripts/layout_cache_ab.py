"""A/B of the cached Gluon shared-memory layouts (``grouped_gemm_ws.shared_layout``) against layouts built at
every launch, in the Triton layer on the GPU: host enqueue time per call and do_bench median, alternating rounds.

usage: python scripts/layout_cache_ab.py [--shape T,d,n,E,K ...] [--rounds 5] [--json F]

The "per-call" variant swaps ``shared_layout`` for its uncached function (what the launches did before); both give
the same layouts, so the same kernels and bits. Host time matters where the layer is host-bound (the 7B shape on
some H100 hosts: benchmarks/results/2026-11-25_nvidia-h100_session23/).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from host_overhead import enqueue_ms, layer_calls
from triton.testing import do_bench

from sonicmoe.ops import grouped_gemm_ws, weight_grad_ws


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cached = grouped_gemm_ws.shared_layout
    variants = {"cached": cached, "per-call": cached.__wrapped__}
    res = {"device": torch.cuda.get_device_name(), "results": []}
    for spec in args.shape or ["24576,1536,256,128,8"]:
        _p, _routing, _s, _leaves, fwd, fwd_bwd = layer_calls(spec)
        times = {(what, v): {"enqueue": [], "bench": []} for what in ("fwd", "fwd+bwd") for v in variants}
        for _ in range(args.rounds):
            for what, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                for v, layout in variants.items():
                    grouped_gemm_ws.shared_layout = weight_grad_ws.shared_layout = layout
                    fn()
                    times[(what, v)]["enqueue"].append(enqueue_ms(fn))
                    times[(what, v)]["bench"].append(do_bench(fn, warmup=25, rep=100, return_mode="median"))
        grouped_gemm_ws.shared_layout = weight_grad_ws.shared_layout = cached
        for (what, v), t in times.items():
            row = {"shape": spec, "what": what, "layouts": v, **{k: statistics.median(x) for k, x in t.items()},
                   "rounds": t}
            res["results"].append(row)
            print(f"{spec} {what:<8} {v:<9} host enqueue {row['enqueue']:.3f} ms/call   do_bench {row['bench']:.3f} ms",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
