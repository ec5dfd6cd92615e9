"""The up-projection (gather + grouped GEMM + SwiGLU) on the Gluon warp-specialised kernel against the Triton one.

usage: python scripts/up_ws_probe.py [--shape T,d,n,E,K ...] [--routing topk|token_rounding]
                                     [--configs S:LW:MAXNREG:GU_FUSED[:PART[:EPI_WARPS[:EPI_CHUNK[:EPI_H_TMA]]]],...]
                                     [--rounds 5] [--json F]

Runs ``up_proj_ws`` with explicit configs (S: STAGES, LW: LOADER_WARPS), checks H and A bitwise against the Triton
kernel's (autotuned, or pinned under SONICMOE_AUTOTUNE=0) and by relative error against the float32 per-expert
reference, then times both in alternating rounds on the same inputs (do_bench medians). ``default`` is what
``up_proj`` picks now.
``--routing token_rounding`` routes the router's scores by token rounding (M_tile 128,
``kernel_breakdown.build_routing``) instead of top-k: every expert then holds whole 128-row tiles.
PART 1 times the MMAs alone (its outputs are not H and A: its check fails by design). EPI_WARPS 4 moves the
epilogue to a storer partition (with MAXNREG 128: the partitions set their own counts), EPI_CHUNK rows of A at a
time, EPI_H_TMA 1 storing full tiles' H by TMA instead of 16-byte stores (unset: up_proj_ws.EPI_H_TMA, 0 since
session 47). GPU only.
"""

from __future__ import annotations

import argparse

import torch
from dh_ws_probe import build_routing  # benchmarks/kernel_breakdown.py's (dh_ws_probe puts benchmarks/ on the path)
from dxt_ws_probe import probe_shapes, timing_rows, with_env

from sonicmoe.ops import up_proj as up
from sonicmoe.ops import up_proj_ws as uw
from sonicmoe.testing import random_problem


def triton_up(x, w1, routing):
    """The Triton kernel (SONICMOE_GLUON_UP=0)."""
    return with_env("SONICMOE_GLUON_UP", "0", up.up_proj, x, w1, None, routing)


def probe_shape(shape: str, configs: list[dict], rounds: int, routing_mode: str = "topk") -> list[dict]:
    t, d, n, e, k = (int(v) for v in shape.split(","))
    p = random_problem(t, d, n, e, device="cuda", dtype=torch.bfloat16, seed=0)
    routing, _ = build_routing(p, k, routing_mode)
    x, w1 = p["x"], p["w1"]
    r = routing.num_rows
    flops = 2 * r * 2 * n * d
    sub = torch.arange(0, r, max(r // 4096, 1), device="cuda")  # reference on a subset of rows (memory)
    h_ref, a_ref = up.up_proj_ref(x, w1, None, routing)
    h_ref, a_ref = h_ref[sub].float(), a_ref[sub].float()
    fns = {"triton": lambda: triton_up(x, w1, routing), "default": lambda: up.up_proj(x, w1, None, routing)}
    for cfg in configs:
        name = f"gluon S={cfg['STAGES']} LW={cfg['LOADER_WARPS']} R={cfg['MAXNREG']} F={int(cfg['GU_FUSED'])}"
        name += f" part{cfg['PART']}" * (cfg["PART"] != 0)
        name += f" epi{cfg['EPI_WARPS']}/{cfg.get('EPI_CHUNK', uw.EPI_CHUNK)}" * (cfg.get("EPI_WARPS", 0) != 0)
        name += " h-tma" * cfg["EPI_H_TMA"]
        fns[name] = lambda cfg=cfg: uw.up_proj_ws(x, w1, None, routing, config=cfg)
    hb, ab = fns["triton"]()
    checks = {}
    for name, fn in fns.items():
        h, a = fn()
        h2, a2 = fn()
        checks[name] = {"same_bits_as_triton": bool(torch.equal(h, hb) and torch.equal(a, ab)),
                        "h_rel_err": ((h[sub].float() - h_ref).norm() / h_ref.norm()).item(),
                        "a_rel_err": ((a[sub].float() - a_ref).norm() / a_ref.norm()).item(),
                        "deterministic": bool(torch.equal(h, h2) and torch.equal(a, a2)),
                        "a_max_diff_vs_triton": (a.float() - ab.float()).abs().max().item()}
        print(f"{shape} {name:<28} check {checks[name]}", flush=True)
    return timing_rows(shape, fns, checks, flops, rounds, width=40)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--configs", default="4:4:168:1,4:4:168:0")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--routing", choices=("topk", "token_rounding"), default="topk")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = ("STAGES", "LOADER_WARPS", "MAXNREG", "GU_FUSED", "PART", "EPI_WARPS", "EPI_CHUNK", "EPI_H_TMA")
    configs = [dict(zip(names, map(int, c.split(":")))) for c in args.configs.split(",")]
    for c in configs:
        c["GU_FUSED"] = bool(c.get("GU_FUSED", 1))
        c.setdefault("PART", 0)
        c.setdefault("EPI_WARPS", 0)
        c["EPI_H_TMA"] = bool(c.get("EPI_H_TMA", uw.EPI_H_TMA))
    probe_shapes(args.shape, lambda shape: probe_shape(shape, configs, args.rounds, args.routing), args.json)


if __name__ == "__main__":
    main()
