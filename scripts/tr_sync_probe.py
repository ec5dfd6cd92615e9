"""Router + routing + experts (the layer's work), top-k against token rounding with and without its host sync.

For each shape, one process times (bench_ms: settled 1000 ms warm-up, median) the forward and the forward+backward
of: the router (logits, softmax, top-k), the routing, and the experts on the triton backend, with
  topk         plain top-k routing;
  tr_sync      token rounding with ``static=False`` (exact R pairs: torch.nonzero, one host sync; the layer until
               session 32);
  tr_static    token rounding with ``static=True`` (R_max pairs, padding pairs last; no sync: the layer now).
Gradients flow to x, the router weight, W1 and W2. Also reported: R, R_max and the kernel-only forward+backward
(routing given) of both token-rounding forms, so the padding rows' cost (empty tiles of the grid) shows apart.

usage: python scripts/tr_sync_probe.py [--shape T,d,n,E,K ...] [--json F]
(CPU smoke run: --device cpu --dtype fp32 --shape 64,32,16,4,2 --m-tile 8 --rep 5 --warmup 5)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import torch

from sonicmoe.bench.measure import SETTLED_WARMUP_MS, bench_ms, fwdbwd_fn, host_ms
from sonicmoe.bench.problem import route
from sonicmoe.functional import experts
from sonicmoe.testing import random_problem
from sonicmoe.token_rounding import max_pairs

MODES = (("topk", "topk", False), ("tr_sync", "token_rounding", False), ("tr_static", "token_rounding", True))


def layer_fn(x, wr, w1, w2, k, mode, m_tile, static):
    """The layer's work: router + routing (``mode``) + experts; or, with ``mode`` a Routed, the experts alone."""
    def run():
        # pairs=False: the layer's routing alone (no top-k pair list, which the layer never builds)
        r = route(x, wr, k, mode, m_tile=m_tile, static=static, pairs=False) if isinstance(mode, str) else mode
        return experts(x, w1, w2, r.routing, r.pair_scores, backend="triton")

    return run


def graph_ms(layer, leaves, dout, dev, args) -> float:
    """Median ms of a CUDA-graph replay of ``layer()`` (and its backward with ``dout`` unless None), captured after
    three eager calls on a side stream (kernel compilation, allocator pools)."""
    def step():
        out = layer()
        if dout is not None:
            out.backward(dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for v in leaves:
                v.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for v in leaves:
        v.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = bench_ms(graph.replay, device=dev, warmup=args.warmup, rep=args.rep)["p50"]
    del graph
    for v in leaves:
        v.grad = None
    return ms


def profile_routing(x, wr, k, m_tile, spec) -> None:
    """The kernels of one router + static token rounding + routing metadata call (warm), by CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        route(x, wr, k, "token_rounding", m_tile=m_tile, static=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        route(x, wr, k, "token_rounding", m_tile=m_tile, static=True)
        torch.cuda.synchronize()
    print(f"profile {spec}: router + static token rounding + routing metadata", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60), flush=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        route(x, wr, k, "token_rounding", m_tile=m_tile, static=True)
        torch.cuda.synchronize()
    print(f"host ops of the same call ({len(prof.key_averages())} kinds)", flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=50), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["24576,1536,256,128,8", "16384,1536,256,512,8",
                                                   "16384,4096,512,512,8", "16384,4096,1024,256,4"])
    ap.add_argument("--m-tile", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--rep", type=float, default=100)
    ap.add_argument("--warmup", type=float, default=SETTLED_WARMUP_MS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="also print the profiler's kernel table of one static token-rounding routing per shape")
    ap.add_argument("--only-profile", action="store_true", help="the kernel tables alone, no timings")
    ap.add_argument("--graph", action="store_true",
                    help="also time top-k and static token rounding (router + routing + experts) as CUDA-graph "
                         "replays: the GPU time without the host's (the sync form cannot be captured)")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    dev = torch.device(args.device)
    rows = []
    for spec in args.shape:
        t, d, n, e, k = (int(v) for v in spec.split(","))
        p = random_problem(t, d, n, e, dtype=dtype, device=dev, seed=0)
        x = p["x"].detach().requires_grad_(True)
        wr = p["router_weight"].detach().requires_grad_(True)
        w1, w2 = p["w1"].detach().requires_grad_(True), p["w2"].detach().requires_grad_(True)
        dout = torch.randn(t, d, device=dev, dtype=dtype)
        leaves = [x, wr, w1, w2]
        if args.profile or args.only_profile:
            profile_routing(x, wr, k, args.m_tile, spec)
            if args.only_profile:
                continue
        row = {"shape": [t, d, n, e, k], "m_tile": args.m_tile,
               "R_max": max_pairs(t, e, k, args.m_tile, "nearest"), "TK": t * k}
        for name, mode, static in MODES:
            layer = layer_fn(x, wr, w1, w2, k, mode, args.m_tile, static)
            fwd = bench_ms(layer, device=dev, warmup=args.warmup, rep=args.rep, grad_to_none=leaves)["p50"]
            tot = bench_ms(fwdbwd_fn(layer, leaves, dout), device=dev, warmup=args.warmup, rep=args.rep,
                           grad_to_none=leaves)["p50"]
            row[name] = {"fwd_ms": fwd, "fwdbwd_ms": tot, "host_fwd_ms": host_ms(layer),
                         "host_route_ms": host_ms(functools.partial(route, x, wr, k, mode, m_tile=args.m_tile,
                                                                   static=static, pairs=False))}
            if mode == "token_rounding":  # the experts alone on the routing given
                with torch.no_grad():
                    r = route(x, wr, k, mode, m_tile=args.m_tile, static=static)
                s = r.pair_scores.detach().requires_grad_(True)
                row[name]["R" if not static else "R_rows"] = r.routing.num_rows
                given = dataclasses.replace(r, pair_scores=s)
                alone = layer_fn(x, None, w1, w2, k, given, args.m_tile, static)
                kern = bench_ms(fwdbwd_fn(alone, [x, w1, w2, s], dout), device=dev, warmup=args.warmup,
                                rep=args.rep, grad_to_none=[x, w1, w2, s])["p50"]
                row[name]["experts_fwdbwd_ms"] = kern
        if args.graph:
            for name in ("topk", "tr_static"):
                mode, static = ("topk", False) if name == "topk" else ("token_rounding", True)
                layer = layer_fn(x, wr, w1, w2, k, mode, args.m_tile, static)
                row[name]["graph_fwd_ms"] = graph_ms(layer, leaves, None, dev, args)
                row[name]["graph_fwdbwd_ms"] = graph_ms(layer, leaves, dout, dev, args)
        rows.append(row)
        top, sync, stat = row["topk"], row["tr_sync"], row["tr_static"]
        print(f"shape {spec}  R={sync['R']} R_max={row['R_max']} TK={t * k}", flush=True)
        for name in ("topk", "tr_sync", "tr_static"):
            v = row[name]
            extra = f"  experts only fwd+bwd {v['experts_fwdbwd_ms']:.3f}" if "experts_fwdbwd_ms" in v else ""
            print(f"  {name:<10} fwd {v['fwd_ms']:.3f} ms  fwd+bwd {v['fwdbwd_ms']:.3f} ms{extra}  host: fwd "
                  f"{v['host_fwd_ms']:.3f}, routing {v['host_route_ms']:.3f} ms", flush=True)
        if args.graph:
            print(f"  CUDA-graph replay: top-k fwd {top['graph_fwd_ms']:.3f} fwd+bwd {top['graph_fwdbwd_ms']:.3f} ms; "
                  f"token rounding fwd {stat['graph_fwd_ms']:.3f} fwd+bwd {stat['graph_fwdbwd_ms']:.3f} ms; speed-up "
                  f"fwd {top['graph_fwd_ms'] / stat['graph_fwd_ms']:.3f}x fwd+bwd "
                  f"{top['graph_fwdbwd_ms'] / stat['graph_fwdbwd_ms']:.3f}x", flush=True)
        print(f"  speed-up vs top-k, fwd+bwd with routing: sync {top['fwdbwd_ms'] / sync['fwdbwd_ms']:.3f}x  "
              f"static {top['fwdbwd_ms'] / stat['fwdbwd_ms']:.3f}x; fwd: sync {top['fwd_ms'] / sync['fwd_ms']:.3f}x  "
              f"static {top['fwd_ms'] / stat['fwd_ms']:.3f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                       "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
