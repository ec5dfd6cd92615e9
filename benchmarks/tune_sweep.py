"""Time every tile configuration of every kernel on given shapes (GPU); prints the best per kernel.

usage: python benchmarks/tune_sweep.py [--shape T,d,n,E,K ...] [--space full|focus] [--kernels a,b] [--json OUT.json]
Used to choose the autotuning spaces (TUNING_SPACE in each op module) and the pinned defaults.
``--space full`` times each module's TUNING_SPACE plus persistent extras; ``--space focus`` times this
session's candidates (see FOCUS): larger dH tiles (epilogue in 32-channel column blocks), TMA
loads of weights (W_TMA) and of contiguous activation rows (A_TMA), larger weight-gradient tiles.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

import sonicmoe
from sonicmoe.ops import aggregation, dh, grouped_gemm, up_proj, weight_grad
from sonicmoe.ops.common import config_dict, tile_config
from sonicmoe.testing import random_problem

EXTRA_M = [tile_config(128, 128, 64, 8, 3, 1, True), tile_config(128, 256, 64, 8, 3, 1, True),
           tile_config(128, 128, 64, 8, 4, 1, True), tile_config(128, 64, 64, 4, 3, 2, True),
           tile_config(64, 128, 64, 4, 3, 2, True), tile_config(128, 128, 64, 4, 2, 2, True)]


def _toggled(cfgs, **toggles):
    """Every config of ``cfgs`` (triton.Config) with every combination of the boolean ``toggles``."""
    out = [config_dict(c) for c in cfgs]
    for name, values in toggles.items():
        out = [{**c, name: v} for c in out for v in values]
    return out


def _m(bm, bn, warps, stages, pps=0, flatten=False, bk=64, **extra):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PROGS_PER_SM": pps, "FLATTEN": flatten,
            "num_warps": warps, "num_stages": stages, **extra}


def _k(bi, bj, warps, stages, br=64):
    return {"BLOCK_I": bi, "BLOCK_J": bj, "BLOCK_R": br, "num_warps": warps, "num_stages": stages}


# session 3 (2026-11-23): larger dH tiles with the epilogue in 32-channel column blocks (no spills
# by the offline resource report), TMA for the contiguous A rows of the down-projection / dX~ (A_TMA),
# larger varlen-K weight-gradient tiles, persistent up-projections
FOCUS = {
    "up_proj": [_m(128, 128, 8, 4, W_TMA=True), _m(128, 128, 8, 3, 1, True, W_TMA=True),
                _m(128, 128, 8, 4, 1, True, W_TMA=True), _m(128, 128, 8, 4, 1, W_TMA=True)],
    "down_proj": _toggled([tile_config(128, 256, 64, 8, 3, 1, True), tile_config(128, 128, 64, 4, 2, 2, True),
                           tile_config(128, 256, 64, 8, 4, 1, True)], W_TMA=(False, True), A_TMA=(False, True)),
    "dxtilde": _toggled([tile_config(128, 256, 64, 8, 3, 1, True), tile_config(128, 256, 64, 8, 4, 1, True)],
                        W_TMA=(False, True), A_TMA=(False, True)),
    "dh": [_m(128, 256, 8, 4, W_TMA=True), _m(128, 256, 8, 3, W_TMA=True), _m(128, 256, 8, 3, 1, True, W_TMA=True),
           _m(128, 128, 8, 3, 1, True, W_TMA=True), _m(128, 128, 8, 4, W_TMA=True)],
    "dw2": [_k(128, 128, 8, 3), _k(128, 128, 8, 4), _k(128, 256, 8, 3), _k(256, 128, 8, 3)],
}
FOCUS["dw1"] = FOCUS["dw2"]


def sweep(shape, space="full", only=None):
    t, d, n, e, k = shape
    p = random_problem(t, d, n, e, dtype=torch.bfloat16, device="cuda", seed=0)
    router = sonicmoe.router_topk(p["x"], p["router_weight"], k)
    routing = sonicmoe.routing_from_topk(router.topk_ids, e)
    s_pair = router.topk_scores.reshape(-1).detach()
    s_row, s_slot = routing.row_scores(s_pair).float(), routing.slot_scores(s_pair).float()
    r = routing.num_rows
    x, w1, w2 = p["x"], p["w1"], p["w2"]
    h, a = up_proj.up_proj(x, w1, None, routing)
    y = grouped_gemm.down_proj(a, w2, None, routing)
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
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
        ("aggregate", aggregation.TUNING_SPACE, lambda c: aggregation.gather_sum(y, routing, s_slot, config=c),
         0),
    ]
    rows = []
    for name, cfgs, fn, flops in kernels:
        if only and name not in only:
            continue
        if space == "focus":
            if name not in FOCUS:
                continue
            cfgs = FOCUS[name]
        for cfg in cfgs:
            c = cfg if isinstance(cfg, dict) else config_dict(cfg)
            try:
                ms = do_bench(lambda fn=fn, c=c: fn(c), warmup=10, rep=40, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
                rows.append({"kernel": name, "config": c, "error": str(exc)[:120]})
                continue
            rows.append({"kernel": name, "config": c, "ms": ms, "tflops": flops / ms / 1e9 if flops else None})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--space", choices=("full", "focus"), default="full")
    ap.add_argument("--kernels", default=None, help="comma-separated subset, e.g. dh,up_proj")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    only = set(args.kernels.split(",")) if args.kernels else None
    shapes = [tuple(int(v) for v in s.split(",")) for s in (args.shape or ["24576,1536,256,128,8"])]
    out = {}
    for shape in shapes:
        rows = sweep(shape, args.space, only)
        out[",".join(map(str, shape))] = rows
        print(f"== {shape}")
        for name in dict.fromkeys(r["kernel"] for r in rows):
            ok = sorted((r for r in rows if r["kernel"] == name and "ms" in r), key=lambda r: r["ms"])
            bad = [r for r in rows if r["kernel"] == name and "error" in r]
            for r in ok[:3]:
                c = r["config"]
                desc = " ".join(f"{k2}={v}" for k2, v in c.items())
                print(f"  {name:<10} {r['ms']:7.3f} ms {r['tflops'] or 0:6.1f} TF  {desc}")
            err = f": {bad[0]['error']}" if bad else ""
            worst = f"worst {ok[-1]['ms']:.3f} ms; " if ok else ""
            print(f"  {name:<10} {worst}{len(bad)} failed{err}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
