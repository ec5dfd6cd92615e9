"""Per-kernel timing of the Triton path (the paper's Fig. 6 breakdown), GPU only.

usage: python benchmarks/kernel_breakdown.py [--shape T,d,n,E,K ...] [--routing topk|token_rounding ...]
                                             [--no-layer] [--routing-profile] [--dense] [--json OUT]

For every (shape, routing): ms and TFLOP/s (useful FLOPs) of each forward and backward kernel and of the
whole layer (and of the torch backend on the same inputs unless ``--no-layer``). With several routings the
kernels of one shape are timed in turn on the same inputs, so the comparison is not spread across minutes.

``--routing-profile`` adds the time of the routing itself: router, top-k metadata, token rounding and
its metadata, each on its own (do_bench), and a profiler table of one token-rounding call's kernels.

``--dense`` adds, per kernel, its cuBLAS ceiling on this machine: the same GEMM as ``torch.bmm`` over E
perfectly balanced experts with contiguous operands (no gather, no varlen, no epilogue), and for the two
aggregations a contiguous ``sum`` over K of a (T, K, d) tensor. Same FLOP counts as the kernel rows, so the
two TFLOP/s columns compare directly.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

import sonicmoe
from sonicmoe.bench.measure import SETTLED_REP_MS, SETTLED_WARMUP_MS
from sonicmoe.ops.aggregation import gather_sum
from sonicmoe.ops.dh import dh
from sonicmoe.ops.grouped_gemm import down_proj, varlen_m_gemm
from sonicmoe.ops.library import gluon_wgrad_preferred
from sonicmoe.ops.up_proj import up_proj
from sonicmoe.ops.weight_grad import varlen_k_gemm
from sonicmoe.routing import Routing
from sonicmoe.testing import random_problem
from sonicmoe.token_rounding import token_rounding

M_TILE = 128


def tuned_configs() -> dict[str, list[str]]:
    """The configs the autotuner chose for each kernel in this process (one per key), as text."""
    from sonicmoe.ops import aggregation, dh, grouped_gemm, up_proj, weight_grad

    return {mod.__name__.rsplit(".", 1)[1]: [str(c) for c in mod._tuned.chosen()]
            for mod in (up_proj, grouped_gemm, dh, weight_grad, aggregation)}


def build_routing(p: dict, k: int, mode: str):
    """(routing, pair scores (R,)) of the problem's router under ``mode``."""
    e = p["w1"].shape[0]
    router = sonicmoe.router_topk(p["x"], p["router_weight"], k)
    if mode == "topk":
        return sonicmoe.routing_from_topk(router.topk_ids, e), router.topk_scores.reshape(-1).detach()
    tr = token_rounding(router, m_tile=M_TILE, warn=False)
    return tr.routing, tr.pair_scores.detach()  # the layer's: routing_from_pairs' equal, with the tile_rows hint


def kernel_rows(p: dict, routing: Routing, s_pair: torch.Tensor, dout: torch.Tensor) -> list:
    """(name, fn, useful FLOPs) of every kernel of the Triton path on this routing."""
    s_row = routing.row_scores(s_pair).float()
    s_slot = routing.slot_scores(s_pair).float()
    r = routing.num_rows
    x, w1, w2 = p["x"], p["w1"], p["w2"]
    n, d = w2.shape[2], w2.shape[1]
    h, a = up_proj(x, w1, None, routing)
    y = down_proj(a, w2, None, routing)
    dh_, ap_, _ = dh(dout, w2, h, s_row, routing)
    dxt = varlen_m_gemm(dh_, w1, None, routing, transpose_b=False)
    gemm = 2 * r * n * d  # FLOPs of one (R, n) x (n, d) GEMM
    gluon = gluon_wgrad_preferred(n)  # the weight-gradient kernels the layer runs (library.experts_bwd_impl)
    return [
        ("up-proj (gather+SwiGLU)", lambda: up_proj(x, w1, None, routing), 2 * gemm),
        ("down-proj", lambda: down_proj(a, w2, None, routing), gemm),
        ("aggregation", lambda: gather_sum(y, routing, s_slot), 0),
        ("dH (dA', dS, dH, A')", lambda: dh(dout, w2, h, s_row, routing), gemm),
        ("dW2 (varlen-K)", lambda: varlen_k_gemm(dout, ap_, routing, p_gather=True, q_gather=False,
                                                 out_dtype=w2.dtype, gluon=gluon), gemm),
        ("dX~ = dH W1", lambda: varlen_m_gemm(dh_, w1, None, routing, transpose_b=False), 2 * gemm),
        ("dW1 (varlen-K)", lambda: varlen_k_gemm(dh_, x, routing, p_gather=False, q_gather=True,
                                                 out_dtype=w1.dtype, gluon=gluon), 2 * gemm),
        ("dX aggregation", lambda: gather_sum(dxt, routing, None), 0),
    ]


def dense_rows(t: int, d: int, n: int, e: int, k: int, dtype=torch.bfloat16) -> list:
    """(name, fn, FLOPs) of the cuBLAS ceiling of each row of :func:`kernel_rows` (same order and FLOPs):
    batched GEMMs over E experts of R/E = T·K/E rows each, contiguous, and contiguous K-sums."""
    m = max(1, t * k // e)
    r = m * e

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    xg, w1, h = rand(e, m, d), rand(e, d, 2 * n), rand(e, m, 2 * n)
    a, w2t, w2 = rand(e, m, n), rand(e, n, d), rand(e, d, n)
    at, xt, y = a.transpose(1, 2).contiguous(), xg.transpose(1, 2).contiguous(), rand(t, k, d)
    w1t = w1.transpose(1, 2).contiguous()
    gemm = 2 * r * n * d
    return [
        ("up-proj (gather+SwiGLU)", lambda: torch.bmm(xg, w1), 2 * gemm),
        ("down-proj", lambda: torch.bmm(a, w2t), gemm),
        ("aggregation", lambda: y.sum(1), 0),
        ("dH (dA', dS, dH, A')", lambda: torch.bmm(xg, w2), gemm),
        ("dW2 (varlen-K)", lambda: torch.bmm(at, xg), gemm),
        ("dX~ = dH W1", lambda: torch.bmm(h, w1t), 2 * gemm),
        ("dW1 (varlen-K)", lambda: torch.bmm(xt, h), 2 * gemm),
        ("dX aggregation", lambda: y.sum(1), 0),
    ]


FWD_KERNELS = 3  # the first rows of kernel_rows: up-projection, down-projection, aggregation


def kernel_sums(rows: list[dict], n_kernels: int) -> dict:
    """Kernel time of the layer without host time: the sum of the forward kernels' medians and of all
    ``n_kernels`` kernels' (forward + backward), in ms. The router and the routing metadata are not in it."""
    ms = [row["ms"] for row in rows[:n_kernels]]
    return {"fwd": sum(ms[:FWD_KERNELS]), "fwd+bwd": sum(ms)}


def layer_rows(p: dict, routing: Routing, s_pair: torch.Tensor, dout: torch.Tensor, backends) -> list:
    """(name, fn, FLOPs, grad leaves) of the whole layer, forward and forward+backward, per backend. The forward is
    the training forward (leaves that require grad: H written and kept for the backward), as ``sonicmoe bench`` times
    it and as the kernel rows run; without grad the layer's inference path skips H's store."""
    r = routing.num_rows
    n, d = p["w2"].shape[2], p["w2"].shape[1]
    rows = []
    for backend in backends:
        for bwd in (False, True):
            leaves = [v.detach().requires_grad_(True) for v in (p["x"], p["w1"], p["w2"], s_pair)]

            def f(leaves=leaves, backend=backend, bwd=bwd):
                out = sonicmoe.experts(leaves[0], leaves[1], leaves[2], routing, leaves[3], backend=backend)
                if bwd:
                    out.backward(dout)
            rows.append((f"layer {backend} {'fwd+bwd' if bwd else 'fwd'}", f, (18 if bwd else 6) * r * n * d,
                         leaves if bwd else None))
    return rows


def routing_profile(p: dict, k: int) -> list:
    """(name, fn) of the routing steps on their own: router, top-k metadata, token rounding, its metadata."""
    e, t = p["w1"].shape[0], p["x"].shape[0]
    x, wr = p["x"], p["router_weight"]
    router = sonicmoe.router_topk(x, wr, k)
    tr = token_rounding(router, m_tile=M_TILE, warn=False)
    wg = wr.detach().clone().requires_grad_(True)

    def router_fwd_bwd(rounding: bool):  # the router weight's gradient through the scores the layer uses
        r = sonicmoe.router_topk(x, wg, k)
        scores = token_rounding(r, m_tile=M_TILE, warn=False).pair_scores if rounding else r.topk_scores
        return torch.autograd.grad(scores.float().sum(), wg)

    return [
        ("router (logits, softmax, top-k)", lambda: sonicmoe.router_topk(x, wr, k)),
        ("top-k routing metadata", lambda: sonicmoe.routing_from_topk(router.topk_ids, e)),
        ("token rounding (pairs)", lambda: token_rounding(router, m_tile=M_TILE, warn=False)),
        ("token-rounding routing metadata", lambda: sonicmoe.routing_from_pairs(tr.pair_token, tr.pair_expert, t, e,
                                                                                      token_major=True)),
        ("router fwd+bwd, top-k scores", lambda: router_fwd_bwd(False)),
        ("router + token rounding fwd+bwd", lambda: router_fwd_bwd(True)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None, help="T,d,n,E,K (repeatable; default the 7B shape)")
    ap.add_argument("--routing", action="append", choices=("topk", "token_rounding"), default=None)
    ap.add_argument("--no-layer", action="store_true", help="skip the whole-layer timings")
    ap.add_argument("--routing-profile", action="store_true", help="also time the routing steps")
    ap.add_argument("--dense", action="store_true", help="also time each kernel's dense cuBLAS ceiling")
    ap.add_argument("--rep", type=float, default=SETTLED_REP_MS,
                    help="do_bench rep (ms): a window long enough for the sustained speed under the power cap")
    ap.add_argument("--warmup", type=float, default=SETTLED_WARMUP_MS,
                    help="do_bench warm-up (ms) before each kernel: the GPU clock settles under its power cap")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in (args.shape or ["24576,1536,256,128,8"])]
    modes = args.routing or ["topk"]
    records = []
    for t, d, n, e, k in shapes:
        p = random_problem(t, d, n, e, dtype=torch.bfloat16, device="cuda", seed=0)
        dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        timed = {}
        for mode in modes:
            routing, s_pair = build_routing(p, k, mode)
            rows = [(name, fn, flops, None) for name, fn, flops in kernel_rows(p, routing, s_pair, dout)]
            n_kernels = len(rows)
            if not args.no_layer:
                rows += layer_rows(p, routing, s_pair, dout, ("triton",) if mode != "topk" else ("triton", "torch"))
            timed[mode] = (routing.num_rows, rows)
        if args.dense:
            timed["dense"] = (max(1, t * k // e) * e, [(name, fn, flops, None) for name, fn, flops in
                                                         dense_rows(t, d, n, e, k)])
        if args.routing_profile:
            timed["routing"] = (0, [(name, fn, 0, None) for name, fn in routing_profile(p, k)])
        # the same kernel of every routing back to back, in turn
        length = max(len(rows) for _, rows in timed.values())
        results = {mode: [] for mode in timed}
        for i in range(length):
            for mode, (_, rows) in timed.items():
                if i >= len(rows):
                    continue
                name, fn, flops, leaves = rows[i]
                ms = do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median", grad_to_none=leaves)
                results[mode].append({"kernel": name, "ms": ms, "tflops": flops / ms / 1e9 if flops else None})
        for mode, rows in results.items():
            r = timed[mode][0]
            print(f"shape T={t} d={d} n={n} E={e} K={k} routing={mode} R={r} on {torch.cuda.get_device_name()}")
            for row in rows:
                tf = f"{row['tflops']:7.1f}" if row["tflops"] else "      -"
                print(f"  {row['kernel']:<32} {row['ms']:8.3f} ms  {tf} TFLOP/s")
            rec = {"shape": [t, d, n, e, k], "routing": mode, "R": r, "rows": rows}
            if mode != "routing":
                rec["kernel_sums"] = kernel_sums(rows, n_kernels)
                print(f"  {'kernels fwd (sum)':<32} {rec['kernel_sums']['fwd']:8.3f} ms")
                print(f"  {'kernels fwd+bwd (sum)':<32} {rec['kernel_sums']['fwd+bwd']:8.3f} ms")
            records.append(rec)
        shape_recs = {rec["routing"]: rec for rec in records[-len(results):]}
        if "topk" in shape_recs and "token_rounding" in shape_recs:  # token rounding's speed-up in kernel time
            top, tr = shape_recs["topk"]["kernel_sums"], shape_recs["token_rounding"]["kernel_sums"]
            up = {ph: top[ph] / tr[ph] for ph in ("fwd", "fwd+bwd")}
            shape_recs["token_rounding"]["kernel_speedup_vs_topk"] = up
            print(f"  token rounding kernel-time speed-up vs top-k: fwd {up['fwd']:.3f}x, "
                  f"fwd+bwd {up['fwd+bwd']:.3f}x")
        if args.routing_profile:  # the GPU kernels inside one token-rounding call, by total time
            router = sonicmoe.router_topk(p["x"], p["router_weight"], k)
            token_rounding(router, m_tile=M_TILE, warn=False)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                token_rounding(router, m_tile=M_TILE, warn=False)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
        del p, dout, timed
        torch.cuda.empty_cache()
    chosen = tuned_configs()
    for name, cfgs in chosen.items():
        for cfg in cfgs:
            print(f"  tuned {name}: {cfg}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "records": records, "tuned": chosen,
                       **({"shape": records[0]["shape"], "rows": records[0]["rows"]} if len(records) == 1 else {})},
                      f, indent=1)


if __name__ == "__main__":
    main()
