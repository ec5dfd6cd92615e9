"""The dH kernel (dA′ GEMM + SwiGLU backward + A′ + dS) on the Gluon warp-specialised kernel against the Triton one.

usage: python scripts/dh_ws_probe.py [--shape T,d,n,E,K ...]
                                     [--configs EPI:NBUF[:BLOCK_N[:PART[:TMA_STORE[:BLOCK_K[:RING]]]]],...]
                                     [--rounds 5] [--json F]

Runs ``dh_ws`` with explicit configs, compares dH, A′ and dS with the Triton kernel's (autotuned, or pinned under
SONICMOE_AUTOTUNE=0: bits and relative error; tests/test_dh_ws.py compares both with the float32 reference), then
times both in alternating rounds on the same inputs (do_bench medians). PART 1 times the MMAs alone, 2 all but the
global stores of dH and A′ (``dh_ws``'s config; their outputs are not the kernel's). ``default`` is what ``dh`` picks
now. GPU only.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from dxt_ws_probe import probe_shapes, timing_rows, with_env

from sonicmoe.ops import dh as dh_mod
from sonicmoe.ops import dh_ws
from sonicmoe.testing import random_problem

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from kernel_breakdown import build_routing  # noqa: E402


def dh_problem(shape: str, routing_mode: str = "topk") -> tuple[dict, object, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bf16 problem of ``shape`` ("T,d,n,E,K") on the GPU for the dH kernel: the layer's random problem (x, W1,
    W2, ...), its router's scores routed by ``routing_mode`` (``topk`` or ``token_rounding``:
    ``kernel_breakdown.build_routing``), and fresh dO (T, d), H (R, 2n) and row scores (R,)."""
    t, d, n, e, k = (int(v) for v in shape.split(","))
    p = random_problem(t, d, n, e, device="cuda", dtype=torch.bfloat16, seed=0)
    routing, _ = build_routing(p, k, routing_mode)
    r = routing.num_rows
    g = torch.Generator(device="cuda").manual_seed(1)
    dout = torch.randn(t, d, device="cuda", generator=g).to(torch.bfloat16)
    h = torch.randn(r, 2 * n, device="cuda", generator=g).to(torch.bfloat16)
    return p, routing, dout, h, torch.rand(r, device="cuda", generator=g)


def probe_shape(shape: str, configs: list[tuple[int, ...]], rounds: int) -> list[dict]:
    p, routing, dout, h, s = dh_problem(shape)
    d, n = p["w2"].shape[1:]
    r = routing.num_rows
    w2 = p["w2"]
    flops = 2 * r * n * d
    fns = {"triton": lambda: with_env("SONICMOE_GLUON_DH", "0", dh_mod.dh, dout, w2, h, s, routing),
           "default": lambda: dh_mod.dh(dout, w2, h, s, routing)}
    for epi, nbuf, bn, part, tma_store, bk, ring in configs:
        cfg = {**dh_ws.dh_ws_config(n, epi, nbuf, bn or None, bk or dh_ws.BLOCK_K, None if ring < 0 else bool(ring)),
               "PART": part,
               "TMA_STORE": bool(tma_store)}
        fns[f"gluon BN={cfg['BLOCK_N']} BK={cfg['BLOCK_K']} EPI={epi} NBUF={nbuf} S={cfg['STAGES']} P={part}"
            f" T={tma_store} R={int(cfg['STAGE_IN_RING'])}"] = (
            lambda cfg=cfg: dh_ws.dh_ws(dout, w2, h, s, routing, config=cfg))
    base = fns["triton"]()
    checks = {}
    for name, fn in fns.items():
        out = fn()
        out = out[:2] + (out[2] if out[2].dim() == 1 else out[2].sum(0),)
        again = fn()
        checks[name] = {
            "same_bits_as_triton": all(bool(torch.equal(x, y)) for x, y in zip(out, base)),
            "deterministic": all(bool(torch.equal(x, y)) for x, y in zip(out[:2], again[:2])),
            **{f"{nm}_rel_err_vs_triton": ((x.float() - y.float()).norm() / y.float().norm()).item()
               for nm, x, y in zip(("dh", "ap", "ds"), out, base)},
        }
        print(f"{shape} {name:<36} check {checks[name]}", flush=True)
    return timing_rows(shape, fns, checks, flops, rounds, width=36)


def parse_config(text: str) -> tuple[int, ...]:
    """EPI:NBUF[:BLOCK_N[:PART[:TMA_STORE[:BLOCK_K[:RING]]]]] -> (EPI, NBUF, BLOCK_N or 0 (the default), PART (0),
    TMA_STORE (1), BLOCK_K or 0 (the default), RING: 1 the staging sets in a ring slot, 0 not, -1 (the default) as
    ``dh_ws_config`` decides)."""
    vals = [int(v) for v in text.split(":")]
    return tuple(vals + [0, 0, 1, 0, -1][len(vals) - 2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--configs", default="32:2,16:2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    configs = [parse_config(c) for c in args.configs.split(",")]
    probe_shapes(args.shape, lambda shape: probe_shape(shape, configs, args.rounds), args.json)


if __name__ == "__main__":
    main()
