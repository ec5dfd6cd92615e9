"""Token rounding's rounding decision and its routing metadata, each in one kernel (SPEC §5, §3 metadata).

Between the selection kernels of :mod:`sonicmoe.ops.tr_select` the token-rounding path used to run some
twenty small torch operations: the rounding decision (remainders, comparisons, a cumulative sum for
``balance``), then, after the pairs, :func:`sonicmoe.routing.routing_from_pairs` (a sort by expert, an
inverse permutation, two searches). Each costs a launch's worth of host time, and the eager layer is host-bound
at d = 1536 (session 32). Two kernels replace them:

:func:`round_counts` (torch's column sum, then one program)
    sums the candidate-keys kernel's per-block counts into f (E,), takes the rounding decision of
    :func:`sonicmoe.token_rounding._round_counts` (same integers, same subroutines, the same uniform draws for
    ``"stochastic"``) and writes f, keep, pad and the experts' row offsets (exclusive prefix sum of keep).
:func:`pairs_routing` (one program per block of pairs)
    turns the token-major pairs that ``torch.nonzero_static`` (or ``torch.nonzero``) finds in the selection's
    rank array — (t, e) int64 per pair, (−1, −1) for padding — into the pair arrays and the
    :class:`~sonicmoe.routing.Routing` of those pairs. The rank array holds, at each routed (t, e), the 1-based
    rank of t among e's routed tokens, so pair p's row is ``expert_offsets[e] + rank − 1`` and no sort is needed.
    The rows are scattered (``row_pair[row] = p``, ``row_token[row] = t``); every row is written exactly once (a
    permutation), so no atomics. Padding pairs keep their index as their row, past ``expert_offsets[E]``.

The ``*_ref`` twins compute the same results with torch operations; they are the CPU path and the tests' oracles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..routing import INDEX_DTYPE, Routing, _offsets, routing_from_pairs
from .common import cdiv, next_pow2
from .fast_launch import launch_kernel

SUBROUTINE_CODES = {"nearest": 0, "up": 1, "down": 2, "stochastic": 3, "balance": 4}
_PAIR_BLOCK = 1024


@triton.jit
def _floor_div(a, b):
    """floor(a / b) for integers a and b > 0 (Triton's integer division truncates toward zero)."""
    q = a // b
    return tl.where((a % b != 0) & (a < 0), q - 1, q)


@triton.jit(do_not_specialize=["T"])
def _round_counts_kernel(count_ptr, u_ptr, f_ptr, keep_ptr, pad_ptr, off_ptr, E, T, M,
                         SUB: tl.constexpr, E_P2: tl.constexpr):
    e = tl.arange(0, E_P2)
    emask = e < E
    f = tl.load(count_ptr + e, mask=emask, other=0)
    lo = f - f % M
    frac = f - lo
    if SUB == 0:  # nearest (a tie rounds down)
        pad = 2 * frac > M
    elif SUB == 1:  # up
        pad = frac > 0
    elif SUB == 2:  # down
        pad = frac < 0
    elif SUB == 3:  # stochastic: pad with probability frac / M
        u = tl.load(u_ptr + e, mask=emask, other=1.0)
        pad = u * M < frac.to(tl.float32)
    else:  # balance: the prefix sums of f rounded to the nearest multiple of M (ties down)
        x = tl.cumsum(f, axis=0)
        grid = -M * _floor_div(M - 2 * x, 2 * M)
        rounded = grid - (-M * _floor_div(M - 2 * (x - f), 2 * M))  # this expert's share of the rounded sums
        pad = rounded > lo
    keep = tl.where(pad, tl.minimum(lo + M, T), lo)
    keep = tl.where(emask, keep, 0)
    tl.store(f_ptr + e, f, mask=emask)
    tl.store(keep_ptr + e, keep, mask=emask)
    tl.store(pad_ptr + e, pad, mask=emask)  # a bool tensor: no int8 view (which inductor cannot lower)
    ends = tl.cumsum(keep, axis=0)
    tl.store(off_ptr + 1 + e, ends, mask=emask)
    tl.store(off_ptr + e, ends - keep, mask=e == 0)


def round_counts(block_counts: torch.Tensor, m_tile: int, num_tokens: int, subroutine: str,
                 u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rounding's decision per expert, on one Triton program after torch's column sum of the per-block
    counts (SPEC §5 step 3).

    Args:
        block_counts: (NB, E) int32 per-block counts of the tokens that chose each expert
            (:func:`~sonicmoe.ops.tr_select.candidate_keys` with ``block_counts=True``); f = their column sums.
        m_tile: M_tile. num_tokens: T (caps a padded count).
        subroutine: as :func:`sonicmoe.token_rounding.token_rounding`.
        u: (E,) float32 uniform draws for ``"stochastic"`` (ignored otherwise).

    Returns:
        f (E,) int32 top-k counts, keep (E,) int32 kept counts, pad (E,) bool (rounded up) and expert_offsets
        (E+1,) int32 (exclusive prefix sum of keep): what :func:`round_counts_ref` returns.
    """
    nb, e = block_counts.shape
    dev = block_counts.device
    if nb != 1:
        # torch's column sum (integers: any order gives the same bits). The program used to sum the rows itself, and
        # took 103-106 us at NB = 256, E = 512 (H100, session 33, call 4), against about 11 us for this sum
        block_counts = block_counts.sum(0, dtype=torch.int32)
    out = torch.empty(3 * e + 1, dtype=torch.int32, device=dev)
    f, keep, offsets = out[:e], out[e:2 * e], out[2 * e:]
    pad = torch.empty(e, dtype=torch.bool, device=dev)
    e_p2 = next_pow2(e)
    launch_kernel(_round_counts_kernel, (1,), block_counts.contiguous(), u if u is not None else f, f, keep, pad,
                  offsets, e, num_tokens, m_tile, SUB=SUBROUTINE_CODES[subroutine], E_P2=e_p2,
                  num_warps=4 if e_p2 <= 1024 else 8)
    return f, keep, pad, offsets


def round_counts_ref(block_counts: torch.Tensor, m_tile: int, num_tokens: int, subroutine: str,
                     u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`round_counts` (same arguments and results)."""
    from ..token_rounding import _round_counts

    f = block_counts.sum(0, dtype=torch.int64)
    keep, pad = _round_counts(f, m_tile, num_tokens, subroutine, None, u=u)
    offsets = torch.cat([keep.new_zeros(1), torch.cumsum(keep, 0)])
    return f.to(INDEX_DTYPE), keep.to(INDEX_DTYPE), pad, offsets.to(INDEX_DTYPE)


@triton.jit(do_not_specialize=["R", "T"])
def _pairs_kernel(pair_ptr, rank_ptr, off_ptr, token_ptr, expert_ptr, pair_row_ptr, row_pair_ptr, row_token_ptr,
                  R, T, E, BLOCK: tl.constexpr):
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


def pairs_routing(pair: torch.Tensor, ranks: torch.Tensor, expert_offsets: torch.Tensor, *,
                  padding: bool) -> tuple[torch.Tensor, torch.Tensor, Routing]:
    """Pair arrays and routing metadata of token rounding's pairs, on one Triton kernel (no sort, no host sync).

    Args:
        pair: (R, 2) int64 token-major (t, e) pairs, (−1, −1) for padding pairs (``torch.nonzero_static(ranks,
            size=R, fill_value=-1)``; or ``torch.nonzero(ranks)``, without padding).
        ranks: (T, E) int32 from :func:`~sonicmoe.ops.tr_select.select_routed` with ``rank=True``.
        expert_offsets: (E+1,) int32 exclusive prefix sum of the experts' counts (:func:`round_counts`).
        padding: the pairs may end with padding pairs (sets ``Routing.padded``).

    Returns:
        (pair_token (R,) int32 with T for padding, pair_expert (R,) int32 with E for padding, the
        :class:`~sonicmoe.routing.Routing`), equal to :func:`pairs_routing_ref`'s, i.e. to
        ``routing_from_pairs(pair_token, pair_expert, T, E, token_major=True, padding=padding)``.
    """
    t, e = ranks.shape
    r = pair.shape[0]
    dev = pair.device
    # pair_token on its own: searchsorted of a view of a larger buffer fails in inductor's lowering (torch 2.11)
    pair_token = torch.empty(r, dtype=INDEX_DTYPE, device=dev)
    pair_expert, pair_row, row_pair, row_token = torch.empty(4, r, dtype=INDEX_DTYPE, device=dev).unbind(0)
    if r:
        launch_kernel(_pairs_kernel, (cdiv(r, _PAIR_BLOCK),), pair.contiguous(), ranks, expert_offsets, pair_token,
                      pair_expert, pair_row, row_pair, row_token, r, t, e, BLOCK=_PAIR_BLOCK, num_warps=4)
    routing = Routing(num_tokens=t, num_experts=e, expert_offsets=expert_offsets, row_token=row_token,
                      row_pair=row_pair, pair_row=pair_row, token_offsets=_offsets(pair_token, t),
                      token_rows=pair_row, slot_pair=None, padded=bool(padding))
    return pair_token, pair_expert, routing


def pairs_routing_ref(pair: torch.Tensor, ranks: torch.Tensor, expert_offsets: torch.Tensor, *,
                      padding: bool) -> tuple[torch.Tensor, torch.Tensor, Routing]:
    """Torch twin of :func:`pairs_routing` (same arguments and results), through
    :func:`~sonicmoe.routing.routing_from_pairs`."""
    t, e = ranks.shape
    pad_pair = pair[:, 0] < 0
    pair_token = torch.where(pad_pair, t, pair[:, 0]).to(INDEX_DTYPE)
    pair_expert = torch.where(pad_pair, e, pair[:, 1]).to(INDEX_DTYPE)
    routing = routing_from_pairs(pair_token, pair_expert, t, e, token_major=True, padding=padding)
    return pair_token, pair_expert, routing
