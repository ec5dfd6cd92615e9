"""Top-k routing metadata by a counting sort in three small kernels (SPEC §3 metadata; no kernel of the experts).

:func:`sonicmoe.routing.routing_from_topk` builds the :class:`~sonicmoe.routing.Routing` of top-k's T·K pairs
(pair p = t·K + k, token-major) from the ids (T, K): the rows of expert e are its pairs in pair order, at
``expert_offsets[e]``. As torch operations that is a stable sort of the R = T·K ids (a radix sort of 64-bit keys:
many launches), a cast, an inverse-permutation scatter, a search for the offsets and two index computations, about
0.37 ms of host time per layer call at T = 8192 on an H200 (session 77's host profile), more than its GPU time.
The ids lie in [0, E), so a counting sort does it in three launches, deterministic and without atomics:

1. :func:`_block_counts_kernel`: the R pairs in blocks of BLOCK; each program counts its block's pairs per
   expert (a (BLOCK, E) one-hot summed over the block), with column E counting ids outside [0, E).
2. :func:`_column_scan_kernel`: per column (expert), the exclusive prefix sum of the block counts over the blocks
   (each block's first row within the expert), and the column's total.
3. :func:`_scatter_rows_kernel`: each program again takes its block's one-hot, ranks each pair among the block's
   pairs of its expert (a cumulative sum down the block: the pair order, so the sort is stable), and writes pair p
   at row ``expert_offsets[e] + (its block's first row in e) + rank``: ``row_pair[row] = p``,
   ``row_token[row] = p // K``, ``pair_row[p] = row``; every row written once (a permutation). The first program
   writes ``expert_offsets`` (the exclusive prefix sum of the totals, which every program recomputes from the
   E + 1 totals), each program the ``token_offsets`` t·K of its block's tokens, the last one T·K at T.

Ids outside [0, E) break the caller's promise; they still get rows, after every expert's (in pair order), so each
index the routing holds stays in bounds, and ``expert_offsets[E]`` counts only the valid pairs. The torch twin is
:func:`sonicmoe.routing.routing_from_topk_ref`: equal results on valid ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..routing import INDEX_DTYPE, Routing
from .common import cdiv, next_pow2
from .fast_launch import launch_kernel

# the one-hot (BLOCK, E_P2) of a program holds at most this many elements (64 registers a thread at 4 warps, for its
# cumulative sum; BLOCK = 64 pairs at E = 128); E_P2 above MAX_E_P2 (blocks of fewer than 32 pairs, a block-count
# matrix of more than R/32 · E entries) takes the torch twin
ONE_HOT_ELEMENTS = 8192
MAX_E_P2 = 256
MAX_BLOCK = 4096
SCAN_ROWS = 256
SCAN_COLS = 16


@triton.jit(do_not_specialize=["R"])
def _block_counts_kernel(ids_ptr, count_ptr, R, E, BLOCK: tl.constexpr, E_P2: tl.constexpr):
    """count[b, e] = the pairs of block b with id e, e < E; count[b, E] = those with an id outside [0, E)."""
    b = tl.program_id(0)
    p = b * BLOCK + tl.arange(0, BLOCK)
    inside = p < R
    ids = tl.load(ids_ptr + p, mask=inside, other=-1).to(tl.int32)
    e = tl.arange(0, E_P2)
    hit = (ids[:, None] == e[None, :]) & (e < E)[None, :]
    counts = tl.sum(hit.to(tl.int32), axis=0)
    tl.store(count_ptr + b * (E + 1) + e, counts, mask=e < E)
    valid = tl.sum(counts, axis=0)
    tl.store(count_ptr + b * (E + 1) + E, tl.sum(inside.to(tl.int32), axis=0) - valid)


@triton.jit
def _column_scan_kernel(count_ptr, first_ptr, total_ptr, NB, C, ROWS: tl.constexpr, COLS: tl.constexpr):
    """For COLS columns of the (NB, C) block counts: first[b, c] = Σ_{b' < b} count[b', c] and total[c]."""
    c = tl.program_id(0) * COLS + tl.arange(0, COLS)
    cmask = c < C
    carry = tl.zeros([COLS], dtype=tl.int32)
    for r0 in range(0, NB, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        m = (rows < NB)[:, None] & cmask[None, :]
        cnt = tl.load(count_ptr + rows[:, None] * C + c[None, :], mask=m, other=0)
        tl.store(first_ptr + rows[:, None] * C + c[None, :], carry[None, :] + tl.cumsum(cnt, axis=0) - cnt, mask=m)
        carry += tl.sum(cnt, axis=0)
    tl.store(total_ptr + c, carry, mask=cmask)


@triton.jit(do_not_specialize=["R", "T"])
def _scatter_rows_kernel(ids_ptr, first_ptr, total_ptr, off_ptr, row_pair_ptr, row_token_ptr, pair_row_ptr,
                         tok_off_ptr, R, T, E, K, BLOCK: tl.constexpr, E_P2: tl.constexpr):
    """Each pair of block b at its row (see the module doc); expert_offsets by program 0, token_offsets."""
    b = tl.program_id(0)
    e = tl.arange(0, E_P2)
    emask = e < E
    totals = tl.load(total_ptr + e, mask=emask, other=0)
    offsets = tl.cumsum(totals, axis=0) - totals  # expert_offsets[e], e < E
    valid_total = tl.sum(totals, axis=0)  # expert_offsets[E]: the outside ids' rows start here
    tl.store(off_ptr + e, offsets, mask=emask & (b == 0))
    tl.store(off_ptr + E, valid_total, mask=b == 0)
    p = b * BLOCK + tl.arange(0, BLOCK)
    inside = p < R
    ids = tl.load(ids_ptr + p, mask=inside, other=-1).to(tl.int32)
    hit = (ids[:, None] == e[None, :]) & emask[None, :]
    hit32 = hit.to(tl.int32)
    rank = tl.sum(tl.where(hit, tl.cumsum(hit32, axis=0), 0), axis=1) - 1  # among the block's pairs of its expert
    first = tl.load(first_ptr + b * (E + 1) + e, mask=emask, other=0)
    row = tl.sum(tl.where(hit, (offsets + first)[None, :], 0), axis=1) + rank
    outside = inside & (tl.sum(hit32, axis=1) == 0)  # an id outside [0, E): after every expert's rows
    out32 = outside.to(tl.int32)
    out_first = tl.load(first_ptr + b * (E + 1) + E)
    row = tl.where(outside, valid_total + out_first + tl.cumsum(out32, axis=0) - 1, row)
    tl.store(row_pair_ptr + row, p, mask=inside)
    tl.store(row_token_ptr + row, p // K, mask=inside)
    tl.store(pair_row_ptr + p, row, mask=inside)
    tl.store(tok_off_ptr + p // K, p, mask=inside & (p % K == 0))
    tl.store(tok_off_ptr + T, R, mask=b == tl.num_programs(0) - 1)


def counting_sort_applies(topk_ids: torch.Tensor, num_experts: int) -> bool:
    """Whether :func:`topk_routing` takes these ids: at least one pair, E up to :data:`MAX_E_P2`, and R below 2²⁷
    (the block counts, at most R/32 + 1 blocks × 257 columns, and every index then fit in int32)."""
    return 0 < topk_ids.numel() < 2**27 and next_pow2(num_experts) <= MAX_E_P2


def topk_routing(topk_ids: torch.Tensor, num_experts: int) -> Routing:
    """The :class:`~sonicmoe.routing.Routing` of top-k's pairs by the counting sort of the module doc: the same
    tensors as :func:`sonicmoe.routing.routing_from_topk_ref` on ids in [0, E), in three launches, no host sync.

    Args:
        topk_ids: (T, K) int32 or int64 expert ids, contiguous or not (read as a copy then), on the GPU (or the CPU
            under the interpreter); :func:`counting_sort_applies` must hold. The caller has checked shape and dtype.
        num_experts: E.

    Returns:
        Routing with ``expert_offsets`` (E+1,), ``row_token``, ``row_pair``, ``pair_row`` = ``token_rows`` (R,)
        and ``token_offsets`` (T+1,) = t·K, all int32; ``slot_pair`` None, not padded.
    """
    t, k = topk_ids.shape
    r, e = t * k, num_experts
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).contiguous()  # a view when (T, K) is contiguous, else a copy
    e_p2 = next_pow2(e)
    block = max(16, min(MAX_BLOCK, ONE_HOT_ELEMENTS // e_p2, next_pow2(r)))
    nb = cdiv(r, block)
    counts, first = torch.empty(2, nb * (e + 1), dtype=INDEX_DTYPE, device=dev).unbind(0)
    totals = torch.empty(e + 1, dtype=INDEX_DTYPE, device=dev)
    expert_offsets = torch.empty(e + 1, dtype=INDEX_DTYPE, device=dev)
    row_pair, row_token, pair_row = torch.empty(3, r, dtype=INDEX_DTYPE, device=dev).unbind(0)
    token_offsets = torch.empty(t + 1, dtype=INDEX_DTYPE, device=dev)
    launch_kernel(_block_counts_kernel, (nb,), ids, counts, r, e, BLOCK=block, E_P2=e_p2, num_warps=4)
    launch_kernel(_column_scan_kernel, (cdiv(e + 1, SCAN_COLS),), counts, first, totals, nb, e + 1,
                  ROWS=SCAN_ROWS, COLS=SCAN_COLS, num_warps=4)
    launch_kernel(_scatter_rows_kernel, (nb,), ids, first, totals, expert_offsets, row_pair, row_token, pair_row,
                  token_offsets, r, t, e, k, BLOCK=block, E_P2=e_p2, num_warps=4)
    return Routing(num_tokens=t, num_experts=e, expert_offsets=expert_offsets, row_token=row_token,
                   row_pair=row_pair, pair_row=pair_row, token_offsets=token_offsets, token_rows=pair_row,
                   slot_pair=None, padded=False)
