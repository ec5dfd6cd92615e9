"""A/B of a library switch in the layer: ``--env`` (default SONICMOE_GLUON, the Gluon ping-pong down-projection;
SONICMOE_PDL, programmatic dependent launch; SONICMOE_OVERLAP, the backward's side stream) at each of --values
(default 1,0), alternating rounds on the same inputs (forward without grad, forward+backward); for SONICMOE_GLUON
also the host time of one ws_varlen_m_gemm call.

A value may also set several switches at once, as NAME=V joined by '+': e.g. --values
SONICMOE_GLUON_WGRAD=0+SONICMOE_OVERLAP=2,SONICMOE_GLUON_WGRAD=1+SONICMOE_OVERLAP=0.

usage: python scripts/ws_ab.py [--env NAME] [--values 1,0] [--shape T,d,n,E,K ...] [--rounds 5] [--graph]
                              [--warmup MS] [--routing topk|token_rounding] [--json F]

--routing token_rounding routes the same router's scores by token rounding (M_tile 128) instead of top-k.

--graph times CUDA-graph replays of the calls captured under each value (no host time between kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from triton.testing import do_bench

import sonicmoe
from sonicmoe.bench.measure import graph_of
from sonicmoe.bench.problem import route
from sonicmoe.ops import grouped_gemm_ws as ws
from sonicmoe.testing import random_problem


def assignments(env: str, value: str) -> dict[str, str]:
    """The switches one --values entry sets: {env: value}, or NAME=V pairs joined by '+'."""
    if "=" not in value:
        return {env: value}
    return dict(item.split("=", 1) for item in value.split("+"))


def fresh_grads(f, leaves):
    """``f`` with the leaves' gradients set to None first: captured in a CUDA graph, each replay then writes them
    afresh (no accumulation kernels)."""
    def call():
        for leaf in leaves or []:
            leaf.grad = None
        f()
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--env", default="SONICMOE_GLUON")
    ap.add_argument("--values", default="1,0")
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays of each value's calls (the GPU alone) instead of eager calls")
    ap.add_argument("--warmup", type=float, default=25, help="do_bench warm-up per timing, ms")
    ap.add_argument("--routing", choices=("topk", "token_rounding"), default="topk")
    args = ap.parse_args()
    env = args.env
    values = args.values.split(",")
    touched = {name for v in values for name in assignments(env, v)}
    original = {name: os.environ.get(name) for name in touched}
    res = {"device": torch.cuda.get_device_name(), "env": env, "results": []}
    for shape in args.shape or ["24576,1536,256,128,8"]:
        t, d, n, e, k = (int(v) for v in shape.split(","))
        p = random_problem(t, d, n, e, device="cuda", dtype=torch.bfloat16, seed=0)
        routed = route(p["x"], p["router_weight"], k, args.routing)  # token rounding: M_tile 128, nearest
        routing, s_pair = routed.routing, routed.pair_scores.detach().to(torch.bfloat16)
        dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        r = routing.num_rows
        fns = {}
        for bwd in (False, True):
            leaves = [v.detach().requires_grad_(bwd) for v in (p["x"], p["w1"], p["w2"], s_pair)]

            def f(leaves=leaves, bwd=bwd, routing=routing, dout=dout):
                out = sonicmoe.experts(leaves[0], leaves[1], leaves[2], routing, leaves[3], backend="triton")
                if bwd:
                    out.backward(dout)
            fns["fwd+bwd" if bwd else "fwd"] = (f, leaves if bwd else None, (18 if bwd else 6) * r * n * d)
        graphs = {}
        if args.graph:  # one graph per (phase, value), captured under that value's switches
            for name, (f, leaves, _fl) in fns.items():
                for g in values:
                    os.environ.update(assignments(env, g))
                    graphs[(name, g)] = graph_of(fresh_grads(f, leaves))
        times = {(name, g): [] for name in fns for g in values}
        for _ in range(args.rounds):
            for name, (f, leaves, _fl) in fns.items():
                for g in values:
                    os.environ.update(assignments(env, g))
                    if args.graph:
                        times[(name, g)].append(do_bench(graphs[(name, g)].replay, warmup=args.warmup, rep=200,
                                                         return_mode="median"))
                    else:
                        times[(name, g)].append(do_bench(f, warmup=args.warmup, rep=200, return_mode="median",
                                                         grad_to_none=leaves))
        for name, value in original.items():  # back to what the caller set (or the library's default)
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for (name, g), ts in times.items():
            ms = statistics.median(ts)
            rec = {"shape": [t, d, n, e, k], "routing": args.routing, "what": name, env: g, "ms": ms, "rounds": ts,
                   "tflops": fns[name][2] / ms / 1e9, "graph": args.graph}
            res["results"].append(rec)
            switch = g if "=" in g else f"{env}={g}"
            print(f"{shape:>22} {args.routing} {name:<8} {switch} {ms:.4f} ms {rec['tflops']:6.1f} TFLOP/s "
                  f"{[round(x, 4) for x in ts]}", flush=True)
        if env != "SONICMOE_GLUON" or any("=" in v for v in values) or ws.ws_config(n) is None:
            continue
        a = torch.randn(r, n, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            ws.ws_varlen_m_gemm(a, p["w2"], None, routing.expert_offsets, transpose_b=True)
        host_us = (time.perf_counter() - t0) / 50 * 1e6
        torch.cuda.synchronize()
        print(f"{shape:>22} host time of one ws_varlen_m_gemm call (queued): {host_us:.0f} us", flush=True)
        res["results"].append({"shape": [t, d, n, e, k], "what": "ws host us per call", "us": host_us})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
