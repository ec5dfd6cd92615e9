"""Token rounding's pairs from the rank array: ``ranks_routing`` (two kernels of ours) against session 34's path
(``torch.nonzero_static``, a pair kernel, a search for the token offsets), on the rank arrays token rounding makes.

usage: python scripts/ranks_routing_probe.py [--shape T,E,K ...] [--json F]

Each path is timed by CUDA-graph replay (``triton.testing.do_bench_cudagraph``, median), static form (R_max pairs),
and their outputs compared. GPU only.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from sonicmoe.ops import tr_routing, tr_select
from sonicmoe.ops.common import cdiv
from sonicmoe.ops.fast_launch import launch_kernel
from sonicmoe.routing import INDEX_DTYPE, _offsets, router_topk
from sonicmoe.token_rounding import max_pairs


@triton.jit(do_not_specialize=["R", "T"])
def _old_pairs_kernel(pair_ptr, rank_ptr, off_ptr, token_ptr, expert_ptr, pair_row_ptr, row_pair_ptr, row_token_ptr,
                      R, T, E, BLOCK: tl.constexpr):
    """Session 34's pair kernel (over nonzero_static's pairs), for the A/B."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = p < R
    t = tl.load(pair_ptr + 2 * p.to(tl.int64), mask=mask, other=-1)
    e = tl.load(pair_ptr + 2 * p.to(tl.int64) + 1, mask=mask, other=-1)
    real = mask & (t >= 0)
    t = tl.where(real, t, 0)
    e = tl.where(real, e, 0)
    rank = tl.load(rank_ptr + t * E + e, mask=real, other=1)
    row = tl.where(real, tl.load(off_ptr + e, mask=real, other=0) + rank - 1, p)
    tl.store(token_ptr + p, tl.where(real, t, T).to(tl.int32), mask=mask)
    tl.store(expert_ptr + p, tl.where(real, e, E).to(tl.int32), mask=mask)
    tl.store(pair_row_ptr + p, row.to(tl.int32), mask=mask)
    tl.store(row_pair_ptr + row, p.to(tl.int32), mask=mask)
    tl.store(row_token_ptr + row, tl.where(real, t, tl.maximum(T - 1, 0)).to(tl.int32), mask=mask)


def old_path(ranks, offsets, r_max):
    t, e = ranks.shape
    pair = torch.nonzero_static(ranks, size=r_max, fill_value=-1)
    pair_token = torch.empty(r_max, dtype=INDEX_DTYPE, device=ranks.device)
    pair_expert, pair_row, row_pair, row_token = torch.empty(4, r_max, dtype=INDEX_DTYPE, device=ranks.device).unbind(0)
    launch_kernel(_old_pairs_kernel, (cdiv(r_max, 1024),), pair, ranks, offsets, pair_token, pair_expert, pair_row,
                  row_pair, row_token, r_max, t, e, BLOCK=1024, num_warps=4)
    return pair_token, pair_expert, pair_row, row_pair, row_token, _offsets(pair_token, t)


def new_path(ranks, offsets, r_max):
    pt, pe, rt = tr_routing.ranks_routing(ranks, offsets, max_pairs=r_max)
    return pt, pe, rt.pair_row, rt.row_pair, rt.row_token, rt.token_offsets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--json", default=None)
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
        same = all(torch.equal(a, b) for a, b in zip(old_path(ranks, offsets, r_max), new_path(ranks, offsets, r_max)))
        rec = {"shape": [t, e, k], "r_max": r_max, "same_outputs": same}
        for name, fn in (("nonzero_static + pair kernel + search", old_path), ("ranks_routing", new_path)):
            rec[name] = do_bench_cudagraph(lambda fn=fn, a=(ranks, offsets, r_max): fn(*a), rep=100) * 1e3
        rows.append(rec)
        print(f"T={t} E={e} K={k} R_max={r_max}: old {rec['nonzero_static + pair kernel + search']:.1f} us, "
              f"ranks_routing {rec['ranks_routing']:.1f} us, same outputs {same}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
