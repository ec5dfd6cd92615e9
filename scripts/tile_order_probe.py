"""Does the order of the M-tiles change the gather-fused kernels' speed? A GPU probe of the Gluon dH and up-projection
kernels with their tile tables reordered.

usage: python scripts/tile_order_probe.py [--shape T,d,n,E,K ...] [--groups 1,16,32,64,128] [--rounds 5] [--json F]

The varlen-M kernels take M-tiles expert after expert (``grouped_gemm_ws.tile_table``), so an expert's weights stay
in L2 while its tiles run, but the gathered rows (dO in dH, X in the up-projection) do not: a token's K rows sit in
K different experts, met far apart in time, so at the 7B shape nearly every gathered row comes from DRAM (session
26's Nsight Compute: 62% of the dH kernel's stalls wait on global loads). Rows within an expert are in token order,
so tile i of every expert covers about the same window of tokens. Group order G takes the experts in groups of G
and, within a group, tile index first: tiles (i, e) for i = 0, 1, ... and e in the group. The tiles that run at once
then share tokens (each token row is needed by about K·G/E of them) while G experts' weights are in use. G = 1 is
the library's order. Outputs must be bitwise equal under every order (each tile is computed alone); the probe checks
that, then times each order and the Triton kernel in alternating rounds (do_bench medians). GPU only.
"""

from __future__ import annotations

import argparse
import json
import statistics
from unittest import mock

import torch
from triton.testing import do_bench

import sonicmoe
from sonicmoe.ops import dh as dh_mod
from sonicmoe.ops import dh_ws, grouped_gemm_ws, up_proj_ws
from sonicmoe.ops import up_proj as up_mod
from sonicmoe.testing import random_problem


def grouped_order(table: torch.Tensor, expert_offsets: torch.Tensor, block_m: int, group: int) -> torch.Tensor:
    """``table`` (grouped_gemm_ws.tile_table) with its M-tile rows in group order ``group`` (device ops, no sync)."""
    body = table[1:]
    e, start, end = body[:, 0].long(), body[:, 1].long(), body[:, 2].long()
    valid = end > start  # rows past the number of M-tiles are zeros
    i = (start - expert_offsets.long()[e.clamp(max=expert_offsets.shape[0] - 2)]) // block_m
    key = torch.where(valid, (e // group) * (1 << 40) + i * (1 << 20) + e, torch.full_like(e, 1 << 62))
    out = table.clone()
    out[1:] = body[torch.argsort(key, stable=True)]
    return out


def ordered(group: int):
    """A patch of ``routing_tile_table`` in the modules that import it, giving group order ``group`` (built afresh
    at every call: no cache on the routing)."""
    def table(routing, block_m):
        off = routing.expert_offsets
        return grouped_order(grouped_gemm_ws.tile_table(off, routing.num_rows, block_m), off, block_m, group)
    return table


def probe(shape: str, groups: list[int], rounds: int) -> list[dict]:
    t, d, n, e, k = (int(v) for v in shape.split(","))
    p = random_problem(t, d, n, e, device="cuda", dtype=torch.bfloat16, seed=0)
    router = sonicmoe.router_topk(p["x"], p["router_weight"], k)
    routing = sonicmoe.routing_from_topk(router.topk_ids, e)
    r = routing.num_rows
    gen = torch.Generator(device="cuda").manual_seed(1)
    dout = torch.randn(t, d, device="cuda", generator=gen).to(torch.bfloat16)
    h = torch.randn(r, 2 * n, device="cuda", generator=gen).to(torch.bfloat16)
    s = torch.rand(r, device="cuda", generator=gen)
    kernels = {
        "dH": (dh_ws, lambda: dh_ws.dh_ws(dout, p["w2"], h, s, routing)[:2], 2 * r * n * d,
               lambda: dh_mod.dh(dout, p["w2"], h, s, routing)[:2]),
        "up": (up_proj_ws, lambda: up_proj_ws.up_proj_ws(p["x"], p["w1"], None, routing), 4 * r * n * d,
               lambda: up_mod.up_proj(p["x"], p["w1"], None, routing, "concat")),
    }
    rows = []
    print(f"shape {shape} R={r} on {torch.cuda.get_device_name()}", flush=True)
    for name, (mod, fn, flops, triton_fn) in kernels.items():
        fns = {"triton": triton_fn}
        for g in groups:
            fns[f"gluon G={g}"] = (lambda g=g, mod=mod, fn=fn: _with_order(mod, g, fn))
        base = _with_order(mod, 1, fn)
        same = {label: all(torch.equal(a, b) for a, b in zip(base, f()) if a is not None)
                for label, f in fns.items() if label != "triton"}
        times = {label: [] for label in fns}
        for _ in range(rounds):
            for label, f in fns.items():
                times[label].append(do_bench(f, warmup=25, rep=100, return_mode="median"))
        for label, ts in times.items():
            ms = statistics.median(ts)
            rec = {"shape": shape, "kernel": name, "variant": label, "ms": ms, "rounds": ts,
                   "tflops": flops / ms / 1e9, "same_bits_as_library_order": same.get(label)}
            rows.append(rec)
            print(f"  {name:<3} {label:<14} {ms:7.4f} ms {rec['tflops']:6.1f} TFLOP/s  same bits "
                  f"{same.get(label, '-')}  {[round(x, 4) for x in ts]}", flush=True)
    return rows


def _with_order(mod, group: int, fn):
    with mock.patch.object(mod, "routing_tile_table", ordered(group)):
        return fn()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--groups", default="1,16,32,64,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    groups = [int(g) for g in args.groups.split(",")]
    res = {"device": torch.cuda.get_device_name(), "rows": []}
    for shape in args.shape or ["24576,1536,256,128,8"]:
        res["rows"] += probe(shape, groups, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
