"""A model of the weight gradients' schedule under uneven expert loads (no GPU): how long the slowest program of the
persistent Gluon kernel runs, in chunk steps, with the experts' tiles in index order or busiest first
(sonicmoe/ops/load_order.py), dealt round-robin or serpentine (weight_grad_ws.program_tiles), against an even split
of the work and a greedy deal (a free program takes the next tile, as the hardware does with one program per tile).

A tile of expert e costs ceil(T_e / BLOCK_R) chunk steps plus ``--tile-overhead`` steps (its pipeline fill and
store). Loads: the random router's (top-K of uniform scores), or a training log's per-step sorted load resampled to
E and dealt as ``sonicmoe bench --load-profile`` deals it (``target_load``).

usage: python scripts/wgrad_schedule_model.py [--profile LOG.json] [--shape NAME=T,d,n,E,K ...] [--programs 132]
                                             [--tile-overhead 2] [--json F]

Session 81 measured the loss this models: on an H100 the 7B layer's backward took 2.258 ms on the trained load
against 2.146 ms on the random router's (benchmarks/results/2026-12-05_nvidia-h100_session81/).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math

import torch

from sonicmoe.bench.load_profile import target_load
from sonicmoe.ops.weight_grad_ws import program_tiles, wgrad_ws_config

PROFILE = "benchmarks/results/2026-12-05_nvidia-h100_session81/train_skew_150steps.json"
SHAPES = ["7B=24576,1536,256,128,8", "120b-n1024=32768,4096,1024,128,8"]


def counts_of(kind: str, t: int, e: int, k: int, profile: str) -> list[int]:
    """Rows per expert: ``even`` the random router's, ``trained`` the profile's load."""
    if kind == "even":
        g = torch.Generator().manual_seed(0)
        ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k]
        return torch.bincount(ids.reshape(-1), minlength=e).tolist()
    return (target_load(profile, e, seed=0) * t * k).round().long().tolist()


def makespan(tiles: list[int], programs: int, deal: str) -> int:
    """The slowest program's steps: ``round-robin`` / ``serpentine`` (program_tiles) or ``greedy``."""
    if deal == "greedy":
        heap = [0] * min(programs, len(tiles))
        for cost in tiles:
            heapq.heapreplace(heap, heap[0] + cost)
        return max(heap)
    per = program_tiles(len(tiles), min(programs, len(tiles)), deal == "serpentine")
    return max(sum(tiles[i] for i in mine) for mine in per)


def model(counts: list[int], i_dim: int, j_dim: int, p_gather: bool, programs: int, overhead: int) -> dict:
    cfg = wgrad_ws_config(i_dim, j_dim, p_gather)
    per_e = (i_dim // cfg["BLOCK_I"]) * (j_dim // cfg["BLOCK_J"])
    cost = [math.ceil(c / cfg["BLOCK_R"]) + overhead for c in counts]
    e = len(counts)
    out = {"even_split": sum(cost) * per_e / min(programs, e * per_e)}
    for order in ("expert", "load"):
        experts = range(e) if order == "expert" else sorted(range(e), key=lambda i: (-counts[i], i))
        tiles = [cost[i] for i in experts for _ in range(per_e)]
        for deal in ("round-robin", "serpentine", "greedy"):
            out[f"{order}/{deal}"] = makespan(tiles, programs, deal)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=PROFILE)
    ap.add_argument("--shape", action="append", default=None, help="NAME=T,d,n,E,K")
    ap.add_argument("--programs", type=int, default=132)
    ap.add_argument("--tile-overhead", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for spec in args.shape or SHAPES:
        name, dims = spec.split("=")
        t, d, n, e, k = (int(v) for v in dims.split(","))
        for kind in ("even", "trained"):
            counts = counts_of(kind, t, e, k, args.profile)
            for what, (i_dim, j_dim, pg) in {"dW1": (2 * n, d, False), "dW2": (d, n, True)}.items():
                m = model(counts, i_dim, j_dim, pg, args.programs, args.tile_overhead)
                rows.append({"shape": name, "load": kind, "what": what, **m})
                ideal = m["even_split"]
                print(f"{name:11s} {kind:7s} {what}  even split {ideal:8.0f} | "
                      + " | ".join(f"{key} {v:6d} ({v / ideal - 1:+.1%})" for key, v in m.items()
                                   if key != "even_split"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": args.profile, "programs": args.programs, "tile_overhead": args.tile_overhead,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
