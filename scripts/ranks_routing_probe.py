"""Token rounding's pairs from the rank array: ``ranks_routing`` (two kernels of ours) against ``torch.nonzero_static``
alone, the first step of session 34's path, on the rank arrays token rounding makes.

usage: python scripts/ranks_routing_probe.py [--shape T,E,K ...] [--tile BLOCK_T:BLOCK_E:WARPS ...] [--json F]

Each is timed by CUDA-graph replay (``triton.testing.do_bench_cudagraph``, median), static form (R_max pairs), and
``ranks_routing``'s outputs are compared with its torch twin's. GPU only.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench_cudagraph

from sonicmoe.ops import tr_routing, tr_select
from sonicmoe.routing import router_topk
from sonicmoe.token_rounding import max_pairs


def old_path(ranks, offsets, r_max):
    """The first step of session 34's path alone: ``torch.nonzero_static`` (a lower bound of that path, which then
    ran a pair kernel, about 9 us, and a search for the token offsets, about 4 us, on an H100)."""
    return torch.nonzero_static(ranks, size=r_max, fill_value=-1)


def new_path(ranks, offsets, r_max, tile=None):
    pt, pe, rt = tr_routing.ranks_routing(ranks, offsets, max_pairs=r_max, tile=tile)
    return pt, pe, rt.pair_row, rt.row_pair, rt.row_token, rt.token_offsets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tile", action="append", default=[], help="BLOCK_T:BLOCK_E:warps of ranks_routing's kernels")
    args = ap.parse_args()
    rows = []
    for shape in args.shape or ["16384,512,8", "24576,128,8", "16384,256,4"]:
        t, e, k = (int(v) for v in shape.split(","))
        g = torch.Generator(device="cuda").manual_seed(0)
        router = router_topk(torch.randn(t, 64, device="cuda", generator=g),
                             torch.randn(e, 64, device="cuda", generator=g), k)
        prob_key, score_key, counts = tr_select.candidate_keys(router.probs, router.topk_ids.long(),
                                                               router.topk_scores, block_counts=True)
        f, keep, _, offsets = tr_routing.round_counts(counts, 128, t, "nearest")
        ranks = tr_select.select_routed(prob_key, score_key, f, keep, rank=True)
        r_max = max_pairs(t, e, k, 128, "nearest")
        ref = tr_routing.ranks_routing_ref(ranks, offsets, max_pairs=r_max)
        ref = (ref[0], ref[1], ref[2].pair_row, ref[2].row_pair, ref[2].row_token, ref[2].token_offsets)
        same = all(torch.equal(a, b) for a, b in zip(ref, new_path(ranks, offsets, r_max)))
        rec = {"shape": [t, e, k], "r_max": r_max, "same_outputs": same}
        for name, fn in (("nonzero_static alone", old_path), ("ranks_routing", new_path)):
            rec[name] = do_bench_cudagraph(lambda fn=fn, a=(ranks, offsets, r_max): fn(*a), rep=100,
                                           return_mode="median") * 1e3  # triton's default is the mean
        for tile in args.tile:
            bt, be, w = (int(v) for v in tile.split(":"))
            rec[f"ranks_routing {tile}"] = do_bench_cudagraph(
                lambda a=(ranks, offsets, r_max, (bt, be, w)): new_path(*a), rep=100, return_mode="median") * 1e3
            print(f"  tile {tile}: {rec[f'ranks_routing {tile}']:.1f} us", flush=True)
        rows.append(rec)
        print(f"T={t} E={e} K={k} R_max={r_max}: nonzero_static alone {rec['nonzero_static alone']:.1f} us, "
              f"ranks_routing {rec['ranks_routing']:.1f} us, outputs equal to the torch twin's {same}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
