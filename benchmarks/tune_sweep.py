"""Time every tile configuration of every kernel on given shapes (GPU); prints the best per kernel.

usage: python benchmarks/tune_sweep.py [--shape T,d,n,E,K ...] [--space full|focus|focus2|focus3|focus4]
                                      [--kernels a,b] [--repeat N] [--json OUT.json]
Used to choose the autotuning spaces (TUNING_SPACE in each op module) and the pinned defaults.
``--space full`` times each module's TUNING_SPACE plus persistent extras; ``focus2`` and ``focus3`` time
session 15's rounds 2 and 3 (FOCUS2, FOCUS3), ``focus4`` session 36's pinned configs for few rows per expert
(FOCUS4); ``--space focus`` times the candidates of FOCUS: larger dH
tiles (epilogue in 32-channel column blocks), TMA loads of weights (W_TMA) and of contiguous activation
rows (A_TMA), larger weight-gradient tiles.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from kernel_breakdown import build_routing  # benchmarks/ is on sys.path when run as a script
from triton.testing import do_bench

from sonicmoe.bench.report import env_info
from sonicmoe.ops import aggregation, dh, grouped_gemm, up_proj, weight_grad
from sonicmoe.ops.common import config_dict, tile_config
from sonicmoe.testing import random_problem

EXTRA_M = [tile_config(128, 128, 64, 8, 3, 1, True), tile_config(128, 256, 64, 8, 3, 1, True),
           tile_config(128, 128, 64, 8, 4, 1, True), tile_config(128, 64, 64, 4, 3, 2, True),
           tile_config(64, 128, 64, 4, 3, 2, True), tile_config(128, 128, 64, 4, 2, 2, True)]


# explicit slots per unrolled step (the launcher's: the mean slots per token, at most aggregation.MAX_UNROLL): token
# rounding gives tokens a varying number of slots, so a token with more than the step takes a second, mostly
# masked step
EXTRA_AGG = [{"BLOCK_T": 1, "BLOCK_D": 1024, "num_warps": 4, "UNROLL": u} for u in (4, 8, 16)]


def _m(bm, bn, warps, stages, pps=0, flatten=False, bk=64, **extra):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PROGS_PER_SM": pps, "FLATTEN": flatten,
            "num_warps": warps, "num_stages": stages, **extra}


def _k(bi, bj, warps, stages, br=64, **extra):
    return {"BLOCK_I": bi, "BLOCK_J": bj, "BLOCK_R": br, "num_warps": warps, "num_stages": stages, **extra}


def _agg(bt, bd, warps, unroll):
    return {"BLOCK_T": bt, "BLOCK_D": bd, "num_warps": warps, "UNROLL": unroll}


# the first config of each kernel is the baseline every other config's output is checked against. Session 4
# (2026-11-24, second round): 16-warp up-projection tiles, the new varlen-K space on every shape (round one:
# benchmarks/results/2026-11-24_nvidia-h100_tune/). Session 7: dH with and without H_PREFETCH at 8 and 16 warps,
# the old default first (benchmarks/results/2026-11-24_nvidia-h100_dh-prefetch/).
_GU = dict(W_TMA=True, GU_FUSED=True)
FOCUS = {
    # session 14: the persistent step loop (STEPS) with pipelined X gathers, and 2 programs per SM (128 x 64
    # channels, 4 warps), the current default first
    # (7B: 0.566 ms against 0.584; 2 programs per SM: 0.71), round 2 the three leaders, repeated (--repeat)
    "up_proj": [_m(128, 128, 8, 4, **_GU), _m(128, 128, 8, 4, 1, STEPS=True, **_GU),
                _m(128, 128, 8, 4, 1, C_TMA=True, **_GU)],
    # session 14 also timed dH as a step loop (STEPS, 8 and 16 warps, 3 and 4 stages, H_PREFETCH 0 and 1): slower
    # than the per-tile default on all three shapes (benchmarks/results/2026-11-24_nvidia-h100_session14/)
    "dh": [_m(128, 256, 8, 4, W_TMA=True, H_PREFETCH=1), _m(128, 256, 16, 4, W_TMA=True, H_PREFETCH=1)],
}
_VK = dict(P_TMA=True, Q_TMA=True)
_VK_STEPS = [_k(bi, bj, 8, st, **_VK, STEPS=True, PROGS_PER_SM=1)
             for bi, bj in ((128, 256), (256, 128)) for st in (4, 5)]
FOCUS["dw2"] = [_k(128, 256, 8, 7, **_VK), _k(256, 128, 8, 5, **_VK), *_VK_STEPS]
FOCUS["dw1"] = [_k(256, 128, 8, 5, **_VK), _k(128, 256, 8, 7, **_VK), *_VK_STEPS]
# session 8 (benchmarks/results/2026-11-24_nvidia-h100_steps/): the tile loop as one loop over (tile, K-block)
# steps (STEPS), with TMA stores in column halves (C_TMA, C_SPLIT=2)
_VM = dict(W_TMA=True, A_TMA=True)
# session 9: the varlen-M schedules on token-rounded counts (every tile full), the current default first
# session 10: the aggregation's block per program (d = 1536: 1024 leaves half the second block masked)
FOCUS["aggregate"] = [_agg(1, 1024, 4, 8), _agg(1, 512, 4, 8), _agg(1, 512, 2, 8), _agg(2, 512, 4, 8),
                      _agg(1, 2048, 8, 8), _agg(1, 256, 2, 8), _agg(1, 1024, 4, 4)]
# session 15: TMA stores of the whole tile (C_SPLIT=1) from one buffer, so a tile's store drains during the next
# tile's main loop (with C_SPLIT=2 the two halves share one buffer and the second waits for the first), paid
# for with shallower K-blocks (BLOCK_K=32) or fewer stages; the two current defaults first. Rounds 1-3 and a
# dH epilogue loop (round 4): no candidate led on a second machine (benchmarks/results/
# 2026-11-24_nvidia-h200_session15/)
FOCUS["down_proj"] = FOCUS["dxtilde"] = [
    _m(128, 256, 8, 4, 1, STEPS=True, **_VM), _m(128, 256, 8, 3, 1, STEPS=True, C_TMA=True, C_SPLIT=2, **_VM),
    _m(128, 256, 8, 4, 1, bk=32, STEPS=True, C_TMA=True, C_SPLIT=1, **_VM),
    _m(128, 256, 8, 5, 1, bk=32, STEPS=True, C_TMA=True, C_SPLIT=1, **_VM),
    _m(128, 256, 8, 2, 1, STEPS=True, C_TMA=True, C_SPLIT=1, **_VM),
    _m(128, 256, 8, 6, 1, bk=32, STEPS=True, C_TMA=True, C_SPLIT=2, **_VM)]


# session 15, round 2: two programs per SM (64-row tiles, 4 warps, at most 255 registers, about 82 KB of shared
# memory), so one program's epilogue runs beside the other's main loop; the current pinned configs first
_VM2 = [_m(64, 256, 4, 2, **_VM), _m(64, 256, 4, 4, bk=32, **_VM), _m(64, 256, 4, 2, 2, STEPS=True, **_VM),
        _m(64, 256, 4, 4, 2, bk=32, STEPS=True, **_VM)]
FOCUS2 = {
    "dh": [_m(128, 256, 8, 4, W_TMA=True, H_PREFETCH=1), _m(64, 256, 4, 2, W_TMA=True, H_PREFETCH=1),
           _m(64, 256, 4, 4, bk=32, W_TMA=True, H_PREFETCH=1), _m(64, 256, 4, 3, bk=32, W_TMA=True, H_PREFETCH=1),
           _m(64, 256, 4, 2, W_TMA=True, H_PREFETCH=0), _m(64, 256, 4, 4, bk=32, W_TMA=True, H_PREFETCH=2)],
    "up_proj": [_m(128, 128, 8, 4, 1, STEPS=True, **_GU), _m(64, 128, 4, 2, **_GU), _m(64, 128, 4, 4, bk=32, **_GU),
                _m(64, 128, 4, 2, 2, STEPS=True, **_GU), _m(64, 128, 4, 4, 2, bk=32, STEPS=True, **_GU)],
    "down_proj": [_m(128, 256, 8, 4, 1, STEPS=True, **_VM),
                  _m(128, 256, 8, 6, 1, bk=32, STEPS=True, C_TMA=True, C_SPLIT=2, **_VM), *_VM2],
}
FOCUS2["dxtilde"] = FOCUS2["down_proj"]


# session 15, round 3: half-depth K-blocks (32) with twice the stages (the same bytes in flight, in finer steps);
# the pinned configs first
FOCUS3 = {
    "up_proj": [_m(128, 128, 8, 4, 1, STEPS=True, **_GU), _m(128, 128, 8, 8, 1, bk=32, STEPS=True, **_GU),
                _m(128, 128, 8, 6, 1, bk=32, STEPS=True, **_GU), _m(128, 128, 8, 8, bk=32, **_GU)],
    "dh": [_m(128, 256, 8, 4, W_TMA=True, H_PREFETCH=1), _m(128, 256, 8, 8, bk=32, W_TMA=True, H_PREFETCH=1),
           _m(128, 256, 8, 6, bk=32, W_TMA=True, H_PREFETCH=1)],
    "down_proj": [_m(128, 256, 8, 4, 1, STEPS=True, **_VM), _m(128, 256, 8, 8, 1, bk=32, STEPS=True, **_VM),
                  _m(128, 256, 8, 6, 1, bk=32, STEPS=True, C_TMA=True, C_SPLIT=2, **_VM),
                  _m(128, 256, 8, 5, 1, bk=32, STEPS=True, C_TMA=True, C_SPLIT=1, **_VM)],
    "dw1": [_k(256, 128, 8, 5, **_VK), _k(256, 128, 8, 10, br=32, **_VK), _k(256, 128, 8, 14, br=32, **_VK)],
    "dw2": [_k(128, 256, 8, 7, **_VK), _k(128, 256, 8, 12, br=32, **_VK), _k(128, 256, 8, 14, br=32, **_VK)],
}
FOCUS3["dxtilde"] = FOCUS3["down_proj"]


# session 36: the pinned many-row configs (first) against the few-row ones (the step loop for the weight gradients,
# TMA stores for the varlen-M GEMMs), the 128 x 128 weight-gradient tile, and the aggregation's slots per step
FOCUS4 = {
    "dw1": [_k(256, 128, 8, 5, **_VK), _k(256, 128, 8, 5, **_VK, STEPS=True, PROGS_PER_SM=1),
            _k(128, 128, 8, 5, **_VK)],
    "dw2": [_k(128, 256, 8, 7, **_VK), _k(128, 256, 8, 5, **_VK, STEPS=True, PROGS_PER_SM=1),
            _k(128, 128, 8, 5, **_VK)],
    "dxtilde": [_m(128, 256, 8, 4, 1, STEPS=True, **_VM),
                _m(128, 256, 8, 3, 1, STEPS=True, C_TMA=True, C_SPLIT=2, **_VM)],
    "aggregate": [_agg(1, 1024, 4, 4), _agg(1, 1024, 4, 8)],
}
FOCUS4["down_proj"] = FOCUS4["dxtilde"]


def _rel_err(got, ref) -> float:
    """Largest ‖got − ref‖ / ‖ref‖ over the outputs (inf when got has a NaN)."""
    got, ref = (got, ref) if isinstance(got, tuple) else ((got,), (ref,))
    worst = 0.0
    for g, r in zip(got, ref):
        if g is None:
            continue
        g, r = g.float(), r.float()
        if torch.isnan(g).any():
            return float("inf")
        worst = max(worst, ((g - r).norm() / r.norm().clamp_min(1e-30)).item())
    return worst


def sweep(shape, space="full", only=None, device="cuda", routing_mode="topk", repeat=1):
    t, d, n, e, k = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's dot is wrong on bf16
    p = random_problem(t, d, n, e, dtype=dtype, device=device, seed=0)
    routing, s_pair = build_routing(p, k, routing_mode)
    s_row, s_slot = routing.row_scores(s_pair).float(), routing.slot_scores(s_pair).float()
    r = routing.num_rows
    x, w1, w2 = p["x"], p["w1"], p["w2"]
    h, a = up_proj.up_proj(x, w1, None, routing)
    y = grouped_gemm.down_proj(a, w2, None, routing)
    dout = torch.randn(t, d, device=device, dtype=dtype)
    dh_, ap_, _ = dh.dh(dout, w2, h, s_row, routing)
    gemm = 2 * r * n * d
    kernels = [
        ("up_proj", up_proj.TUNING_SPACE + EXTRA_M, lambda c: up_proj.up_proj(x, w1, None, routing, config=c),
         2 * gemm),
        ("down_proj", grouped_gemm.TUNING_SPACE + EXTRA_M,
         lambda c: grouped_gemm.down_proj(a, w2, None, routing, config=c), gemm),
        ("dxtilde", grouped_gemm.TUNING_SPACE + EXTRA_M,
         lambda c: grouped_gemm.varlen_m_gemm(dh_, w1, None, routing, transpose_b=False, config=c), 2 * gemm),
        ("dh", dh.TUNING_SPACE + EXTRA_M, lambda c: dh.dh(dout, w2, h, s_row, routing, config=c), gemm),
        ("dw2", weight_grad.TUNING_SPACE, lambda c: weight_grad.varlen_k_gemm(
            dout, ap_, routing, p_gather=True, q_gather=False, out_dtype=w2.dtype, config=c), gemm),
        ("dw1", weight_grad.TUNING_SPACE, lambda c: weight_grad.varlen_k_gemm(
            dh_, x, routing, p_gather=False, q_gather=True, out_dtype=w1.dtype, config=c), 2 * gemm),
        ("aggregate", aggregation.TUNING_SPACE + EXTRA_AGG,
         lambda c: aggregation.gather_sum(y, routing, s_slot, config=c), 0),
    ]
    rows = []
    for name, cfgs, fn, flops in kernels:
        if only and name not in only:
            continue
        if space.startswith("focus"):
            table = {"focus": FOCUS, "focus2": FOCUS2, "focus3": FOCUS3, "focus4": FOCUS4}[space]
            if name not in table:
                continue
            cfgs = table[name]
        ref = None
        for cfg in cfgs:
            c = cfg if isinstance(cfg, dict) else config_dict(cfg)
            try:
                out = fn(c)
                ref = out if ref is None else ref
                err = _rel_err(out, ref)
                del out
                if device == "cuda":
                    ms = do_bench(lambda fn=fn, c=c: fn(c), warmup=10, rep=40, return_mode="median")
                else:  # a dry run: one call, wall clock
                    t0 = time.perf_counter()
                    fn(c)
                    ms = (time.perf_counter() - t0) * 1e3
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
                rows.append({"kernel": name, "config": c, "error": str(exc)[:120]})
                continue
            rows.append({"kernel": name, "config": c, "ms": ms, "tflops": flops / ms / 1e9 if flops else None,
                         "rel_err_vs_first": err, "ms_runs": [ms]})
        del ref
        # further rounds over the configs in turn (an A/B that one round's run-to-run spread could decide);
        # "ms" becomes the median over the rounds
        timed = [r for r in rows if r["kernel"] == name and "ms" in r]
        for _ in range(repeat - 1 if device == "cuda" else 0):
            for r in timed:
                ms = do_bench(lambda fn=fn, c=r["config"]: fn(c), warmup=10, rep=40, return_mode="median")
                r["ms_runs"].append(ms)
        for r in timed:
            r["ms"] = statistics.median(r["ms_runs"])
            r["tflops"] = flops / r["ms"] / 1e9 if flops else None
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--space", choices=("full", "focus", "focus2", "focus3", "focus4"), default="full")
    ap.add_argument("--kernels", default=None, help="comma-separated subset, e.g. dh,up_proj")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run through TRITON_INTERPRET=1 (float32)")
    ap.add_argument("--routing", choices=("topk", "token_rounding"), default="topk",
                    help="expert counts of top-k or of token rounding (multiples of its M_tile)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="time every config this many times, round-robin, and report the median")
    args = ap.parse_args()
    only = set(args.kernels.split(",")) if args.kernels else None
    shapes = [tuple(int(v) for v in s.split(",")) for s in (args.shape or ["24576,1536,256,128,8"])]
    # the GPU, driver, torch and triton versions and the commit, next to the timings (env_info is host-side)
    out = {"env": env_info(torch.device(args.device)), "routing": args.routing, "space": args.space,
           "repeat": args.repeat}
    for shape in shapes:
        rows = sweep(shape, args.space, only, args.device, args.routing, args.repeat)
        out[",".join(map(str, shape))] = rows
        if args.json:  # after every shape: a run cut short by a time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        print(f"== {shape}")
        for name in dict.fromkeys(r["kernel"] for r in rows):
            ok = sorted((r for r in rows if r["kernel"] == name and "ms" in r), key=lambda r: r["ms"])
            bad = [r for r in rows if r["kernel"] == name and "error" in r]
            first = next((r for r in rows if r["kernel"] == name), None)
            if first is not None and "ms" in first:
                print(f"  {name:<10} {first['ms']:7.3f} ms  (first config, the baseline)")
            for r in ok[:3]:
                c = r["config"]
                desc = " ".join(f"{k2}={v}" for k2, v in c.items() if v not in (False, 0) or k2 == "PROGS_PER_SM")
                err = r["rel_err_vs_first"]
                print(f"  {name:<10} {r['ms']:7.3f} ms {r['tflops'] or 0:6.1f} TF err {err:.1e}  {desc}")
            wrong = [r for r in ok if not r["rel_err_vs_first"] < 2e-2]
            if wrong:
                print(f"  {name:<10} WRONG vs baseline: {[(r['config'], r['rel_err_vs_first']) for r in wrong]}")
            err = f": {bad[0]['error']}" if bad else ""
            worst = f"worst {ok[-1]['ms']:.3f} ms; " if ok else ""
            print(f"  {name:<10} {worst}{len(bad)} failed{err}")


if __name__ == "__main__":
    main()
