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
:func:`ranks_routing` (two kernels over the selection's rank array)
    turns the rank array — at each routed (t, e) the 1-based rank of t among e's routed tokens, 0 elsewhere — into
    the token-major pairs (``torch.nonzero``'s order), the pair arrays and the :class:`~sonicmoe.routing.Routing`.
    The first kernel counts each token's routed experts; the second writes each pair at its token's first pair
    (the counts' exclusive prefix sum, which is ``token_offsets``) plus the routed experts before it in the row. Pair
    p's row is ``expert_offsets[e] + rank − 1``, so no sort is needed; the rows are scattered
    (``row_pair[row] = p``, ``row_token[row] = t``), every row written exactly once (a permutation), so no atomics.
    Padding pairs (static length) keep their index as their row, past ``expert_offsets[E]``. It replaces
    ``torch.nonzero_static`` (three kernels), a pair kernel and a search, about 55 µs at T = 16384, E = 512 on an
    H100 (session 34's layer profile).

The ``*_ref`` twins compute the same results with torch operations; they are the CPU path and the tests' oracles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..routing import INDEX_DTYPE, Routing, routing_from_pairs
from .common import cdiv, new_output, next_pow2
from .fast_launch import launch_kernel

SUBROUTINE_CODES = {"nearest": 0, "up": 1, "down": 2, "stochastic": 3, "balance": 4}


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
        u: (E,) float32 uniform draws for ``"stochastic"``, required there (ignored otherwise).

    Returns:
        f (E,) int32 top-k counts, keep (E,) int32 kept counts, pad (E,) bool (rounded up) and expert_offsets
        (E+1,) int32 (exclusive prefix sum of keep): what :func:`round_counts_ref` returns.

    Raises:
        ValueError: ``"stochastic"`` without (E,) draws ``u`` (the kernel read the counts in their place and never
            padded, where the twin draws them).
    """
    nb, e = block_counts.shape
    dev = block_counts.device
    if subroutine == "stochastic" and (u is None or tuple(u.shape) != (e,)):
        raise ValueError(f"u: the stochastic subroutine needs ({e},) uniform draws, got "
                         f"{None if u is None else tuple(u.shape)}")
    if nb != 1:
        # torch's column sum (integers: any order gives the same bits). The program used to sum the rows itself, and
        # took 103-106 us at NB = 256, E = 512 (H100, session 33, call 4), against about 11 us for this sum
        block_counts = block_counts.sum(0, dtype=torch.int32)
    out = new_output(3 * e + 1, dtype=torch.int32, device=dev)
    f, keep, offsets = out[:e], out[e:2 * e], out[2 * e:]
    pad = torch.empty(e, dtype=torch.bool, device=dev)
    e_p2 = next_pow2(e)
    launch_kernel(_round_counts_kernel, (1,), block_counts.contiguous(), u.contiguous() if u is not None else f, f,
                  keep, pad, offsets, e, num_tokens, m_tile, SUB=SUBROUTINE_CODES[subroutine], E_P2=e_p2,
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


@triton.jit(do_not_specialize=["T"])
def _token_counts_kernel(rank_ptr, count_ptr, block_sum_ptr, T, E, NEB,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Routed experts (nonzero ranks) of each of this program's BLOCK_T tokens among its BLOCK_E experts, (T, NEB)
    with NEB = cdiv(E, BLOCK_E), and their sum, (NTB, NEB)."""
    tb, eb = tl.program_id(0), tl.program_id(1)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    tmask = t < T
    r = tl.load(rank_ptr + t[:, None].to(tl.int64) * E + e[None, :], mask=tmask[:, None] & (e < E)[None, :], other=0)
    cnt = tl.sum((r != 0).to(tl.int32), axis=1)
    tl.store(count_ptr + t * NEB + eb, cnt, mask=tmask)
    tl.store(block_sum_ptr + tb * NEB + eb, tl.sum(cnt, axis=0))


@triton.jit(do_not_specialize=["T", "R"])
def _ranks_pairs_kernel(rank_ptr, count_ptr, block_sum_ptr, off_ptr, token_ptr, expert_ptr, pair_row_ptr,
                        row_pair_ptr, row_token_ptr, tok_off_ptr, T, E, R, NB, NEB,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, SUM_BLOCK: tl.constexpr,
                        NEB_P2: tl.constexpr, PAD_BLOCK: tl.constexpr):
    """The pairs of this program's (BLOCK_T tokens, BLOCK_E experts) block, token-major and by expert within a token
    (the order of ``nonzero``): pair index token_offsets[t] + (routed experts of t before e); the eb = 0 programs
    write token_offsets; each program writes the padding pairs p in [total, R) of its slice of [0, R)."""
    tb, eb = tl.program_id(0), tl.program_id(1)
    before = tb * 0  # pairs of the tokens before this token block
    total = tb * 0
    for b0 in range(0, NB, SUM_BLOCK):  # the (NTB, NEB) block sums, flat, a bounded vector at a time
        b = b0 + tl.arange(0, SUM_BLOCK)
        sums = tl.load(block_sum_ptr + b, mask=b < NB, other=0)
        before += tl.sum(tl.where(b < tb * NEB, sums, 0), axis=0)
        total += tl.sum(sums, axis=0)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    j = tl.arange(0, NEB_P2)
    cnt = tl.load(count_ptr + t[:, None] * NEB + j[None, :], mask=tmask[:, None] & (j < NEB)[None, :], other=0)
    per_token = tl.sum(cnt, axis=1)
    first = before + tl.cumsum(per_token, axis=0) - per_token  # each token's first pair
    tl.store(tok_off_ptr + t, first, mask=tmask & (eb == 0))
    tl.store(tok_off_ptr + T, total, mask=(tb == 0) & (eb == 0))
    pos = first + tl.sum(tl.where(j[None, :] < eb, cnt, 0), axis=1)  # + the token's pairs in earlier expert blocks
    e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < E
    rank = tl.load(rank_ptr + t[:, None].to(tl.int64) * E + e[None, :], mask=tmask[:, None] & emask[None, :],
                   other=0)
    real = rank != 0
    nz = real.to(tl.int32)
    p = pos[:, None] + tl.cumsum(nz, axis=1) - nz
    row = tl.load(off_ptr + e, mask=emask, other=0)[None, :] + rank - 1
    tt = t[:, None] + e[None, :] * 0
    tl.store(token_ptr + p, tt, mask=real)
    tl.store(expert_ptr + p, e[None, :] + tt * 0, mask=real)
    tl.store(pair_row_ptr + p, row, mask=real)
    tl.store(row_pair_ptr + row, p, mask=real)
    tl.store(row_token_ptr + row, tt, mask=real)
    # padding pairs (token T, expert E, row = their index, past expert_offsets[E]) in this program's slice of [0, R)
    pid = tb * tl.num_programs(1) + eb
    for q0 in range(pid * PAD_BLOCK, R, tl.num_programs(0) * tl.num_programs(1) * PAD_BLOCK):
        q = q0 + tl.arange(0, PAD_BLOCK)
        pad = (q >= total) & (q < R)
        tl.store(token_ptr + q, q * 0 + T, mask=pad)
        tl.store(expert_ptr + q, q * 0 + E, mask=pad)
        tl.store(pair_row_ptr + q, q, mask=pad)
        tl.store(row_pair_ptr + q, q, mask=pad)
        tl.store(row_token_ptr + q, q * 0 + tl.maximum(T - 1, 0), mask=pad)


# (tokens, experts, num_warps) per program of ranks_routing's kernels
RANKS_TILE = (32, 128, 4)
_PAD_BLOCK = 1024


def ranks_routing(ranks: torch.Tensor, expert_offsets: torch.Tensor, *, max_pairs: int | None = None,
                  tile: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, Routing]:
    """Token rounding's pairs, pair arrays and routing metadata from the selection's rank array, on two Triton
    kernels (no sort; no host sync with ``max_pairs``).

    Both run one program per block of tokens and experts (:data:`RANKS_TILE`). The first counts each token's routed
    experts in the block (and the counts' sum per block); the second writes the pairs token-major (experts in order
    within a token: ``torch.nonzero``'s order), each at the token's first pair (the exclusive prefix sum of the
    counts: ``token_offsets``) plus the routed experts before it in the token's row, with its row
    ``expert_offsets[e] + rank − 1`` and the scatter ``row_pair[row] = p``, ``row_token[row] = t`` (a permutation:
    every row written once, no atomics).

    Args:
        ranks: (T, E) int32 from :func:`~sonicmoe.ops.tr_select.select_routed` with ``rank=True``: the 1-based
            rank of t among e's routed tokens, 0 where (t, e) is not routed.
        expert_offsets: (E+1,) int32 exclusive prefix sum of the experts' counts (:func:`round_counts`).
        max_pairs: R_max, the static number of pairs (``token_rounding(static=True)``): the pairs past the real
            ones are padding pairs (token T, expert E, row = their index). None: exactly the real pairs, whose
            number is read back to the host (one sync).
        tile: (tokens, experts, num_warps) per program of both kernels, powers of two (tuning; the result does not
            depend on it). None: :data:`RANKS_TILE`.

    Returns:
        (pair_token (R,) int32, pair_expert (R,) int32, the :class:`~sonicmoe.routing.Routing`), equal to
        :func:`ranks_routing_ref`'s, i.e. to ``routing_from_pairs(pair_token, pair_expert, T, E,
        token_major=True, padding=max_pairs is not None)`` of the pairs ``torch.nonzero(ranks)`` lists.
    """
    t, e = ranks.shape
    dev = ranks.device
    block_t, block_e, warps = tile or RANKS_TILE
    ntb, neb = max(cdiv(t, block_t), 1), cdiv(e, block_e)
    counts = new_output(t * neb, dtype=INDEX_DTYPE, device=dev)
    # every program of the count kernel writes its block's sum (zeros when T = 0: no launch)
    block_sums = (new_output(ntb * neb, dtype=INDEX_DTYPE, device=dev) if t
                  else torch.zeros(ntb * neb, dtype=INDEX_DTYPE, device=dev))
    ranks, expert_offsets = ranks.contiguous(), expert_offsets.contiguous()  # read at base + index
    if t:
        launch_kernel(_token_counts_kernel, (ntb, neb), ranks, counts, block_sums, t, e, neb,
                      BLOCK_T=block_t, BLOCK_E=block_e, num_warps=warps)
    r = max_pairs if max_pairs is not None else int(block_sums.sum())  # static: no sync; else the one sync
    pair_token = new_output(r, dtype=INDEX_DTYPE, device=dev)
    pair_expert, pair_row, row_pair, row_token = new_output((4, r), dtype=INDEX_DTYPE, device=dev).unbind(0)
    # the pair kernel writes every token's offset and the end (zeros when it does not run: T = R = 0)
    token_offsets = (new_output((t + 1,), dtype=INDEX_DTYPE, device=dev) if t or r
                     else torch.zeros(t + 1, dtype=INDEX_DTYPE, device=dev))
    if t or r:  # T = 0: padding pairs only
        launch_kernel(_ranks_pairs_kernel, (ntb, neb), ranks, counts, block_sums, expert_offsets, pair_token,
                      pair_expert, pair_row, row_pair, row_token, token_offsets, t, e, r, ntb * neb, neb,
                      BLOCK_T=block_t, BLOCK_E=block_e, SUM_BLOCK=min(next_pow2(ntb * neb), 1024),
                      NEB_P2=next_pow2(neb), PAD_BLOCK=_PAD_BLOCK, num_warps=warps)
    routing = Routing(num_tokens=t, num_experts=e, expert_offsets=expert_offsets, row_token=row_token,
                      row_pair=row_pair, pair_row=pair_row, token_offsets=token_offsets, token_rows=pair_row,
                      slot_pair=None, padded=max_pairs is not None)
    return pair_token, pair_expert, routing


def ranks_routing_ref(ranks: torch.Tensor, expert_offsets: torch.Tensor, *,
                      max_pairs: int | None = None) -> tuple[torch.Tensor, torch.Tensor, Routing]:
    """Torch twin of :func:`ranks_routing` (same arguments and results): ``torch.nonzero_static`` (or
    ``torch.nonzero``, the sync) of the rank array, then :func:`~sonicmoe.routing.routing_from_pairs`."""
    t, e = ranks.shape
    if max_pairs is not None:  # R_max pairs, the padding ones (-1, -1): no sync
        pair = torch.nonzero_static(ranks, size=max_pairs, fill_value=-1)
    else:
        pair = torch.nonzero(ranks)  # the host sync (R is data-dependent); row-major: token-major pairs
    pad_pair = pair[:, 0] < 0
    pair_token = torch.where(pad_pair, t, pair[:, 0]).to(INDEX_DTYPE)
    pair_expert = torch.where(pad_pair, e, pair[:, 1]).to(INDEX_DTYPE)
    routing = routing_from_pairs(pair_token, pair_expert, t, e, token_major=True, padding=max_pairs is not None)
    return pair_token, pair_expert, routing
