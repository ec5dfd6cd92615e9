"""Time token rounding's selection kernel for several search fanouts and tiles on a real router's keys (GPU).

usage: python benchmarks/tr_select_fanout.py [--shape T,d,E,K ...] [--fanout 2 --fanout 16 ...]
       [--select-tile KEYS:WARPS ...] [--resident-warps W ...] [--keys-tile BLOCK_T:BLOCK_E:WARPS ...]
       [--compact C ...] [--json OUT]

For each shape: a random router (float32 logits of random X and W_r, top-k then softmax), its candidate
keys and the ``nearest`` rounding decision (M_tile = 128), then :func:`sonicmoe.ops.tr_select.select_routed`
timed (do_bench median) for each fanout (at the default tile and search: the row held in registers where
T <= RESIDENT_MAX_T), for each ``--select-tile`` (the row streamed from memory each pass, its default fanout), for
each ``--resident-warps`` (the row in registers, that many warps, its default fanout), for each ``--compact`` (the
list capacity of the rounded-down experts' search; 0 searches their whole rows), and
:func:`~sonicmoe.ops.tr_select.candidate_keys` for each ``--keys-tile``. Every mask and key array must equal the
torch twin's.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from sonicmoe.ops import tr_select
from sonicmoe.routing import router_topk
from sonicmoe.token_rounding import _round_counts


def run(t: int, d: int, e: int, k: int, fanouts: list[int], select_tiles: list[tuple[int, int]] = (),
        keys_tiles: list[tuple[int, int, int]] = (), resident_warps: list[int] = (), compacts: list[int] = ()) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, d, device="cuda", generator=g)
    wr = torch.randn(e, d, device="cuda", generator=g) / d**0.5
    router = router_topk(x, wr, k)
    prob_key, score_key, f = tr_select.candidate_keys(router.probs, router.topk_ids.long(), router.topk_scores)
    keep, _ = _round_counts(f.long(), 128, t, "nearest", None)
    expect = tr_select.select_routed_ref(prob_key, score_key, f, keep)
    out = {"T": t, "d": d, "E": e, "K": k, "ms": {}}
    for fan in fanouts:
        got = tr_select.select_routed(prob_key, score_key, f, keep, fanout=fan)
        if not torch.equal(got, expect):
            raise AssertionError(f"fanout {fan}: the mask differs from the torch twin's")
        out["ms"][fan] = do_bench(lambda fan=fan: tr_select.select_routed(prob_key, score_key, f, keep, fanout=fan),
                                  warmup=25, rep=200, return_mode="median")
    variants = {f"select {a}:{b}": {"tile": (a, b), "resident": False} for a, b in select_tiles}
    variants.update({f"resident {w}w": {"tile": (tr_select.SELECT_TILE[0], w), "resident": True}
                     for w in resident_warps})
    variants.update({f"compact {c}": {"compact": c} for c in compacts})
    for name, kw in variants.items():
        if not torch.equal(tr_select.select_routed(prob_key, score_key, f, keep, **kw), expect):
            raise AssertionError(f"{name}: the mask differs from the torch twin's")
        out["ms"][name] = do_bench(lambda kw=kw: tr_select.select_routed(prob_key, score_key, f, keep, **kw),
                                   warmup=25, rep=200, return_mode="median")
    args = (router.probs, router.topk_ids.long(), router.topk_scores)
    ref = tr_select.candidate_keys_ref(*args)
    for tile in keys_tiles:
        got = tr_select.candidate_keys(*args, tile=tile)
        if not all(torch.equal(a, b) for a, b in zip(got, ref)):
            raise AssertionError(f"keys tile {tile}: the keys differ from the torch twin's")
        out["ms"][f"keys {tile[0]}:{tile[1]}:{tile[2]}"] = do_bench(
            lambda tile=tile: tr_select.candidate_keys(*args, tile=tile), warmup=25, rep=200, return_mode="median")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", default=None, help="T,d,E,K (repeatable)")
    ap.add_argument("--fanout", action="append", type=int, default=None)
    ap.add_argument("--select-tile", action="append", default=[], help="KEYS:WARPS of the selection kernel")
    ap.add_argument("--resident-warps", action="append", type=int, default=[],
                    help="warps of the selection kernel holding each row in registers")
    ap.add_argument("--keys-tile", action="append", default=[], help="BLOCK_T:BLOCK_E:WARPS of the keys kernel")
    ap.add_argument("--compact", action="append", type=int, default=[],
                    help="list capacity of the rounded-down experts' search (0: off; the default search otherwise)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    select_tiles = [tuple(int(v) for v in s.split(":")) for s in args.select_tile]
    keys_tiles = [tuple(int(v) for v in s.split(":")) for s in args.keys_tile]
    shapes = [tuple(int(v) for v in s.split(",")) for s in (args.shape or ["16384,1536,512,8", "16384,4096,256,4"])]
    fanouts = args.fanout or [2, 4, 8, 16]
    rows = []
    for shape in shapes:
        row = run(*shape, fanouts, select_tiles, keys_tiles, args.resident_warps, args.compact)
        rows.append(row)
        print(f"T={row['T']} d={row['d']} E={row['E']} K={row['K']}: "
              + "  ".join(f"{'' if isinstance(f, str) else 'fanout '}{f}: {ms * 1e3:.1f} us"
                          for f, ms in row["ms"].items()), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
