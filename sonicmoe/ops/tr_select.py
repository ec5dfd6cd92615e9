"""Token rounding's selection kernels: which (token, expert) pairs each expert keeps (SPEC §5).

Token rounding moves each expert's top-k count f_e to ``keep[e]``, a neighbouring multiple of M_tile
(the decision itself is in :mod:`sonicmoe.token_rounding`). An expert rounded down keeps its ``keep[e]``
best chosen tokens by top-k score; an expert rounded up keeps all its chosen tokens and adds its
``keep[e] − f_e`` best non-chosen tokens by router probability. Ties go to the lower token index.

Both steps work on per-(expert, token) int32 *keys* that compare exactly as the float32 values behind
them (the bits, with the magnitude bits of negative values flipped; a NaN probability counts as −inf, a NaN
score as +inf; −0.0 counts as +0.0, which it equals). ``NO_KEY`` = −2^31 marks "not a candidate" and is below every
real key.

:func:`candidate_keys` (kernel: one program per block of tokens and block of experts)
    reads probs (T, E), topk_ids (T, K) and topk_scores (T, K) once and writes, transposed so each
    expert's row is contiguous: ``prob_key`` (E, T) — the probability key of non-chosen pairs, NO_KEY
    for chosen ones; ``score_key`` (E, T) — the score key of chosen pairs, NO_KEY elsewhere; and the
    per-block counts of chosen pairs, summed (in a fixed order) into f (E,).
:func:`select_routed` (kernel: one program per expert, no sort, no atomics)
    finds the n-th largest key of a row by a search over the key values that counts the keys at or above
    a few thresholds per pass, takes every key above it and the lowest-indexed keys equal to it, and
    writes ``routed[t, e]`` (True, or the pair's 1-based rank within its expert) for the kept and added pairs.
    Rows of T <= RESIDENT_MAX_T keys are loaded once and searched in registers: a bisection (32 passes at most,
    one block-wide sum each) from the row's range of real keys, stopping once that range holds one value or a
    threshold has exactly n keys at or above it. Longer rows are streamed from L2 once per pass (16 passes, 4
    thresholds counted in each). Then one more pass over the rows takes the pairs. With the row in registers, an
    expert rounded down with f <= :data:`COMPACT_MAX` chosen tokens first gathers its f chosen keys and tokens into a
    list (one pass over its score row, where the other T - f keys are NO_KEY) and searches and takes over that list.
    H100 (``benchmarks/tr_select_fanout.py``, session 33): 80 µs at T = 16384, E = 512 against 193 µs streamed (219 µs
    in session 12, 294 µs for its first bisection).

No host synchronisation in either. ``*_ref`` twins (torch sorts, no sync) have the same signatures and
results; they are the path on CPU and the oracles of the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv, check_device, interpreting, new_output, next_pow2, sm_count
from .fast_launch import launch_kernel

NO_KEY = -(2**31)  # "not a candidate": below the key of every float
_NO_KEY = tl.constexpr(NO_KEY)  # the same, for the kernels
# (keys per load, warps) of the selection kernel (its counting passes compare (keys, FANOUT) blocks): with more
# experts than multiprocessors, and with at most one program per multiprocessor (longer loads, fewer passes' worth
# of latency). H100 (benchmarks/results/2026-11-26_nvidia-h100_session32/call10_tiles_113d2db), us at (T, E):
# (16384, 512) 218 -> 200, (16384, 256) 135 -> 115, (24576, 128) 148 -> 100, (16384, 64) 100 -> 71 (from 1024:4)
SELECT_TILE = (2048, 4)
SELECT_TILE_FEW_EXPERTS = (4096, 8)
# (BLOCK_T, BLOCK_E, warps) of the candidate-keys kernel (one program per tile). H100
# (benchmarks/results/2026-11-26_nvidia-h100_session33/call3_keys_tiles_419c67f), us at (T, E) against 128:32:8, the
# best tile of the earlier loop over expert blocks (106 us at (16384, 512)): (16384, 512) 128 -> 81, (24576, 128)
# 62 -> 49, (16384, 64) 30 -> 25, (16384, 256, K = 4) 44 -> 45
KEYS_TILE = (64, 64, 8)
# thresholds per counting pass of the selection (a power of two; 2 = bisection). H100, T = 16384, E = 512
# (benchmarks/results/2026-11-24_nvidia-h100_session12/tr_select_fanout*): 2: 270 us, 4: 219, 8: 233 (with
# 512-key loads: 254), 16: 300
SELECT_FANOUT = 4
# rows of up to this many keys are held in registers by the selection's search (one load per row instead of one per
# counting pass), at about RESIDENT_KEYS_PER_THREAD keys per thread; there each threshold costs a block-wide sum
# (no memory traffic), so a bisection is fastest. H100 (benchmarks/results/2026-11-26_nvidia-h100_session33/
# call1_trsel_trsync_8a487ab), us at (T, E) for fanout 2 / 4 / 8, against the streamed search's 193 / 109 / 100 / 71:
# (16384, 512) 110 / 145 / 191, (16384, 256) 65 / 80 / 104, (24576, 128) 65 / 78 / 101, (16384, 64) 40 / 46 / 58.
# That searched all 2^32 key values; from the row's range of real keys, stopping once it holds one value (call6_...):
# (16384, 512) 107, (24576, 128) 60, (16384, 64) 37, (16384, 256, K = 4) 63; stopping also at a threshold with
# exactly n keys at or above it (call13_exact_exit_9c1d818): 80, 52 (8 warps; 87 in the shape's first timing), 33, 49
RESIDENT_MAX_T = 32768
RESIDENT_KEYS_PER_THREAD = 64
RESIDENT_FANOUT = 2
# a rounded-down expert (it keeps its best chosen tokens) whose f chosen tokens number at most this is searched over a
# list of just those f keys, gathered from its row in one pass, instead of over all T keys of the row (where T - f
# are NO_KEY: at T = 16384, E = 512, K = 8 about 98%); with the row held in registers only
COMPACT_MAX = 4096


# ------------------------------------------------------------------------------------------- keys


@triton.jit
def _float_key(x, NAN_FIRST: tl.constexpr):
    """Order-preserving int32 key of float32 ``x``; NaN -> the key of +inf (``NAN_FIRST``) or of -inf; -0.0 -> the key
    of +0.0 (equal floats, equal keys: the tie goes to the lower token)."""
    x = tl.where(x != x, float("inf") if NAN_FIRST else float("-inf"), tl.where(x == 0.0, 0.0, x))
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit(do_not_specialize=["T"])
def _candidate_keys_kernel(
    probs_ptr, ids_ptr, scores_ptr, prob_key_ptr, score_key_ptr, count_ptr,
    T, E, stride_pt,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Program (i, j): tokens [i·BLOCK_T, (i+1)·BLOCK_T) x experts [j·BLOCK_E, (j+1)·BLOCK_E)."""
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = t < T
    t64 = t.to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    mask = mask_t[:, None] & (e < E)[None, :]
    p = tl.load(probs_ptr + t64[:, None] * stride_pt + e[None, :], mask=mask, other=0.0).to(tl.float32)
    chosen = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
    skey = tl.full((BLOCK_T, BLOCK_E), _NO_KEY, tl.int32)
    for k in tl.static_range(K):
        idk = tl.load(ids_ptr + t64 * K + k, mask=mask_t, other=-1).to(tl.int32)
        sk = _float_key(tl.load(scores_ptr + t64 * K + k, mask=mask_t, other=0.0).to(tl.float32), True)
        hit = e[None, :] == idk[:, None]
        chosen = chosen | hit
        skey = tl.where(hit, sk[:, None], skey)
    pkey = tl.where(chosen, _NO_KEY, _float_key(p, False))
    out = e[None, :].to(tl.int64) * T + t64[:, None]  # (E, T) layout: each expert's row contiguous
    tl.store(prob_key_ptr + out, pkey, mask=mask)
    tl.store(score_key_ptr + out, skey, mask=mask)
    tl.store(count_ptr + pid * E + e, tl.sum((chosen & mask).to(tl.int32), axis=0), mask=e < E)


def _check_router(probs: torch.Tensor, topk_ids: torch.Tensor, topk_scores: torch.Tensor) -> tuple[int, int, int]:
    if probs.dim() != 2:
        raise ValueError(f"probs must be (T, E), got {tuple(probs.shape)}")
    t, e = probs.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_scores.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_scores must both be (T={t}, K), got {tuple(topk_ids.shape)} and "
                         f"{tuple(topk_scores.shape)}")
    return t, e, topk_ids.shape[1]


def candidate_keys(probs: torch.Tensor, topk_ids: torch.Tensor, topk_scores: torch.Tensor, *,
                   tile: tuple[int, int, int] | None = None, block_counts: bool = False):
    """Keys of the candidates of every expert and the top-k counts, on the Triton kernel.

    Args:
        probs: (T, E) router probabilities (any float dtype; ranked as float32).
        topk_ids: (T, K) integer chosen experts (distinct per token, in [0, E)).
        topk_scores: (T, K) float scores S of the chosen experts.
        tile: (BLOCK_T, BLOCK_E, num_warps) of the kernel, powers of two (tuning; the result does not depend
            on it). None: :data:`KEYS_TILE` (BLOCK_E capped at next_pow2(E), BLOCK_T at next_pow2(T)).

        block_counts: return the kernel's per-block counts (blocks of BLOCK_T tokens, (⌈T/BLOCK_T⌉, E) int32)
            instead of their sum f (for :func:`sonicmoe.ops.tr_routing.round_counts`, which sums them).

    Returns:
        ``prob_key`` (E, T) int32, ``score_key`` (E, T) int32 (see the module docstring) and f (E,)
        int64, the number of tokens that chose each expert (or the per-block counts).

    Raises:
        ValueError: shapes that do not match the above.
    """
    t, e, k = _check_router(probs, topk_ids, topk_scores)
    for name, x in (("probs", probs), ("topk_ids", topk_ids), ("topk_scores", topk_scores)):
        check_device(name, x)
    probs = probs.detach()
    if probs.stride(1) != 1:
        probs = probs.contiguous()
    prob_key = new_output((e, t), dtype=torch.int32, device=probs.device)
    score_key = new_output((e, t), dtype=torch.int32, device=probs.device)
    block_t, block_e, warps = tile or KEYS_TILE
    block_e = min(next_pow2(e), block_e)
    block_t = max(1, min(block_t, next_pow2(t)))
    grid = (cdiv(t, block_t), cdiv(e, block_e))
    counts = new_output((grid[0], e), dtype=torch.int32, device=probs.device)
    if t > 0:
        launch_kernel(
            _candidate_keys_kernel, grid,
            probs, topk_ids.contiguous(), topk_scores.detach().contiguous(), prob_key, score_key, counts,
            t, e, probs.stride(0), K=k, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=warps)
    return prob_key, score_key, (counts if block_counts else counts.sum(0, dtype=torch.int64))


def _float_key_torch(x: torch.Tensor, nan_first: bool) -> torch.Tensor:
    """Torch twin of the kernels' ``_float_key`` (int32, same order)."""
    inf = float("inf")  # posinf/neginf as well: nan_to_num's defaults turn ±inf into the largest finite floats
    bits = torch.nan_to_num(x.detach().float(), nan=inf if nan_first else -inf, posinf=inf, neginf=-inf)
    bits = torch.where(bits == 0, 0.0, bits)  # -0.0 as +0.0 (equal floats: a tie)
    bits = bits.contiguous().view(torch.int32)
    return torch.bitwise_xor(bits, torch.bitwise_and(torch.bitwise_right_shift(bits, 31), 0x7FFFFFFF))


def candidate_keys_ref(probs: torch.Tensor, topk_ids: torch.Tensor, topk_scores: torch.Tensor, *,
                       tile: tuple[int, int, int] | None = None, block_counts: bool = False):
    """Torch twin of :func:`candidate_keys` (same arguments and results; ``tile`` is ignored, and the per-block
    counts are those of a single block, (1, E))."""
    t, e, _ = _check_router(probs, topk_ids, topk_scores)
    ids = topk_ids.long()
    tokens = torch.arange(t, device=probs.device)[:, None]
    prob_key = _float_key_torch(probs, False).t().contiguous()
    prob_key[ids, tokens] = NO_KEY
    score_key = torch.full((e, t), NO_KEY, dtype=torch.int32, device=probs.device)
    score_key[ids, tokens] = _float_key_torch(topk_scores, True)
    f = (score_key != NO_KEY).sum(1)
    return prob_key, score_key, (f.to(torch.int32)[None, :] if block_counts else f)


# -------------------------------------------------------------------------------------- selection


@triton.jit(do_not_specialize=["T"])
def _count_keys(row_ptr, thresholds, T, BLOCK: tl.constexpr, ABOVE: tl.constexpr = False):
    """#{t : key[t] >= thresholds[j]} (``> thresholds[j]`` with ABOVE) for every j, over a row of T int32
    keys (int32 thresholds).

    Counts accumulate per lane and are summed across the block once, after the loop (a block-wide sum per
    load would cost a shared-memory round trip and a barrier each time)."""
    acc = tl.zeros((BLOCK, thresholds.shape[0]), dtype=tl.int32)
    for start in range(0, T, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        k = tl.load(row_ptr + offs, mask=offs < T, other=_NO_KEY)[:, None]
        if ABOVE:
            acc += (k > thresholds[None, :]).to(tl.int32)
        else:
            acc += (k >= thresholds[None, :]).to(tl.int32)
    return tl.sum(acc, axis=0)


@triton.jit(do_not_specialize=["T"])
def _threshold(row_ptr, n, T, BLOCK: tl.constexpr, FANOUT: tl.constexpr, PASSES: tl.constexpr):
    """(lo, ties) for the n largest keys of the row (n <= #real keys): lo is the n-th largest key; every key above
    it is taken, and the ``ties`` lowest-indexed keys equal to it. n = 0 gives lo = 2^31 (no key is taken)."""
    # invariant: count(key >= lo) >= n > count(key >= hi); every real key is >= NO_KEY + 1. Each pass counts
    # the keys at or above FANOUT evenly spaced thresholds of [lo, hi) at once and keeps the sub-range
    # holding the n-th largest key: the range shrinks FANOUT-fold per pass over the row (PASSES =
    # ceil(32 / log2 FANOUT) passes for the 2^32 key values: 16 with FANOUT = 4, 32 for a bisection)
    lo = tl.full((), _NO_KEY + 1, tl.int64)
    hi = tl.full((), 2**31, tl.int64)
    ties = tl.zeros((), dtype=tl.int32)
    if n > 0:
        j = tl.arange(0, FANOUT).to(tl.int64)
        for _ in range(PASSES):
            step = (hi - lo + FANOUT - 1) // FANOUT  # >= 1
            thr = lo + j * step  # thr[0] = lo; thresholds >= hi are not counted
            valid = thr < hi
            # every threshold is in [lo, hi) subset of [NO_KEY + 1, 2^31): it fits int32
            cnt = _count_keys(row_ptr, tl.where(valid, thr, lo).to(tl.int32), T, BLOCK)
            # counts fall with j: the last threshold with >= n keys at or above it is the new lo
            best = tl.max(tl.where((cnt >= n) & valid, j, 0), axis=0)
            lo_next = lo + best * step
            hi = tl.minimum(hi, lo_next + step)
            lo = lo_next
        above = _count_keys(row_ptr, tl.full((1,), 0, tl.int32) + lo.to(tl.int32), T, BLOCK, ABOVE=True)
        ties = n - tl.sum(above, axis=0)
    else:
        lo = hi
    return lo, ties


@triton.jit(do_not_specialize=["T"])
def _threshold_resident(row_ptr, n, T, FANOUT: tl.constexpr, ROW: tl.constexpr):
    """:func:`_threshold` with the row (T <= ROW keys, ROW a power of two) loaded once into registers: every count
    is taken there, with no memory traffic per pass. The search starts from the row's range of real keys
    [min, max + 1) (it keeps the invariant) and stops as soon as that range holds one value, or as soon as a threshold
    has exactly n keys at or above it."""
    lo = tl.full((), 2**31, tl.int64)
    ties = tl.zeros((), dtype=tl.int32)
    if n > 0:
        offs = tl.arange(0, ROW)
        row = tl.load(row_ptr + offs, mask=offs < T, other=_NO_KEY)
        hi = tl.max(row, axis=0).to(tl.int64) + 1
        lo = tl.min(tl.where(row != _NO_KEY, row, 2**31 - 1), axis=0).to(tl.int64)
        while hi - lo > 1:
            step = (hi - lo + FANOUT - 1) // FANOUT  # >= 1
            # one scalar count per threshold lo + i·step, i >= 1 (a 2-D compare of the row against all of them at once
            # costs registers; thr 0 = lo needs none): the last with >= n keys at or above it is the new lo
            best = tl.zeros((), dtype=tl.int64)
            best_cnt = tl.zeros((), dtype=tl.int32)
            for i in tl.static_range(1, FANOUT):
                thr = lo + i * step
                cnt = tl.sum((row >= tl.where(thr < hi, thr, lo).to(tl.int32)).to(tl.int32), axis=0)
                ok = (thr < hi) & (cnt >= n)
                best = tl.where(ok, i, best)
                best_cnt = tl.where(ok, cnt, best_cnt)
            lo_next = lo + best * step
            # exactly n keys at or above the new lo: they are the n largest, so stop with lo just below it (the take
            # is then key > lo, no ties); with distinct keys this ends the search long before the range is one value
            exact = (best > 0) & (best_cnt == n)
            hi = tl.where(exact, lo_next, tl.minimum(hi, lo_next + step))
            lo = tl.where(exact, lo_next - 1, lo_next)
        ties = n - tl.sum((row > lo.to(tl.int32)).to(tl.int32), axis=0)
    return lo, ties


@triton.jit
def _take(k, lo, ties, seen):
    """The keys of a block (int64, in token order) that the threshold (lo, ties) takes, and the count of keys
    equal to lo seen so far (with this block's)."""
    eq = (k == lo).to(tl.int32)
    take = (k > lo) | ((eq > 0) & (tl.cumsum(eq, axis=0) + seen <= ties))
    return take, seen + tl.sum(eq, axis=0)


@triton.jit(do_not_specialize=["T"])
def _select_listed(score_row_ptr, list_key_ptr, list_tok_ptr, routed_ptr, e, f, keep, T, E, BLOCK: tl.constexpr,
                   FANOUT: tl.constexpr, RANK: tl.constexpr, CAP: tl.constexpr):
    """A rounded-down expert with f <= CAP chosen tokens: one pass over its score row writes the chosen tokens' keys
    and token indices, in token order, into a list of CAP slots; the search (in registers, :func:`_threshold_resident`)
    and the take then run over the f listed keys instead of the row's T."""
    n = tl.zeros((), dtype=tl.int32)
    for start in range(0, T, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        s = tl.load(score_row_ptr + offs, mask=offs < T, other=_NO_KEY)
        real = s != _NO_KEY
        pos = n + tl.cumsum(real.to(tl.int32), axis=0) - 1
        inside = real & (pos < CAP)  # a row with more real keys than its f says never writes past its list
        tl.store(list_key_ptr + pos, s, mask=inside)
        tl.store(list_tok_ptr + pos, offs, mask=inside)
        n += tl.sum(real.to(tl.int32), axis=0)
    tl.debug_barrier()  # the list is whole before any thread reads it
    lo, ties = _threshold_resident(list_key_ptr, keep, f, FANOUT, CAP)
    i = tl.arange(0, CAP)
    k = tl.load(list_key_ptr + i, mask=i < f, other=_NO_KEY).to(tl.int64)
    tok = tl.load(list_tok_ptr + i, mask=i < f, other=0)
    take, _ = _take(k, lo, ties, tl.zeros((), dtype=tl.int32))
    dst = routed_ptr + tok.to(tl.int64) * E + e
    if RANK:
        tl.store(dst, tl.cumsum(take.to(tl.int32), axis=0), mask=take)
    else:
        tl.store(dst, tl.full((CAP,), 1, tl.int8), mask=take)


@triton.jit(do_not_specialize=["T"])
def _select_row(prob_key_ptr, score_key_ptr, routed_ptr, e, f, keep, row, T, E, BLOCK: tl.constexpr,
                FANOUT: tl.constexpr, PASSES: tl.constexpr, RANK: tl.constexpr, ROW: tl.constexpr):
    """The search over the expert's whole row of T keys, and the take: a pass over the row that writes each routed
    token's rank (or flag). A rounded-up expert's chosen tokens are where its probability key is NO_KEY, so its take
    reads that row alone."""
    down = keep < f
    if down:
        if ROW > 0:
            lo, ties = _threshold_resident(score_key_ptr + row, keep, T, FANOUT, ROW)
        else:
            lo, ties = _threshold(score_key_ptr + row, keep, T, BLOCK, FANOUT, PASSES)
    else:
        if ROW > 0:
            lo, ties = _threshold_resident(prob_key_ptr + row, keep - f, T, FANOUT, ROW)
        else:
            lo, ties = _threshold(prob_key_ptr + row, keep - f, T, BLOCK, FANOUT, PASSES)
    seen = tl.zeros((), dtype=tl.int32)
    done = tl.zeros((), dtype=tl.int32)  # tokens routed so far (RANK)
    for start in range(0, T, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        if down:
            s = tl.load(score_key_ptr + row + offs, mask=offs < T, other=_NO_KEY).to(tl.int64)
            take, seen = _take(s, lo, ties, seen)
        else:
            p = tl.load(prob_key_ptr + row + offs, mask=offs < T, other=_NO_KEY).to(tl.int64)
            added, seen = _take(p, lo, ties, seen)
            take = ((p == _NO_KEY) & (offs < T)) | added  # chosen, or added
        dst = routed_ptr + offs.to(tl.int64) * E + e
        if RANK:
            ranks = done + tl.cumsum(take.to(tl.int32), axis=0)
            tl.store(dst, ranks, mask=take)
            done += tl.sum(take.to(tl.int32), axis=0)
        else:
            tl.store(dst, tl.full((BLOCK,), 1, tl.int8), mask=take)


@triton.jit(do_not_specialize=["T"])
def _select_kernel(prob_key_ptr, score_key_ptr, count_ptr, keep_ptr, routed_ptr, list_key_ptr, list_tok_ptr, T, E,
                   BLOCK: tl.constexpr, FANOUT: tl.constexpr, PASSES: tl.constexpr, RANK: tl.constexpr,
                   ROW: tl.constexpr, CAP: tl.constexpr):
    """Expert e = program: rounded down (keep < f), the ``keep`` best chosen tokens by score; else every chosen
    token and the ``keep - f`` best others by probability. Writes routed[t, e] = 1 (int8), or with RANK the
    1-based rank of t among the expert's routed tokens in token order (int32), where t is routed. ROW = 0: the
    search streams the row each pass (:func:`_threshold`); else it holds it in registers
    (:func:`_threshold_resident`). CAP > 0: a rounded-down expert with f <= CAP searches a list of its f chosen keys
    (:func:`_select_listed`; list_key/list_tok (E, CAP) int32 scratch)."""
    e = tl.program_id(0)
    f = tl.load(count_ptr + e).to(tl.int32)
    keep = tl.load(keep_ptr + e).to(tl.int32)
    row = e.to(tl.int64) * T
    down = keep < f
    listed = False
    if CAP > 0:
        listed = down & (f <= CAP)
    if listed:
        if CAP > 0:
            at = e.to(tl.int64) * CAP
            _select_listed(score_key_ptr + row, list_key_ptr + at, list_tok_ptr + at, routed_ptr, e, f, keep, T, E,
                           BLOCK, FANOUT, RANK, CAP)
    else:
        _select_row(prob_key_ptr, score_key_ptr, routed_ptr, e, f, keep, row, T, E, BLOCK, FANOUT, PASSES, RANK, ROW)


def _check_select(prob_key, score_key, f, keep) -> tuple[int, int]:
    e, t = prob_key.shape
    for name, x in (("prob_key", prob_key), ("score_key", score_key)):
        if x.shape != (e, t) or x.dtype != torch.int32 or not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous (E={e}, T={t}) int32 tensor, got {x.dtype} "
                             f"{tuple(x.shape)}")
    for name, x in (("f", f), ("keep", keep)):
        if x.shape != (e,) or x.dtype.is_floating_point:
            raise ValueError(f"{name} must be an (E={e},) integer tensor, got {x.dtype} {tuple(x.shape)}")
    return e, t


def resident_warps(t: int) -> int:
    """Warps of the selection kernel when it holds a row of ``t`` keys in registers: about
    :data:`RESIDENT_KEYS_PER_THREAD` keys per thread, 4 to 16 warps."""
    return max(4, min(16, next_pow2(max(t, 1)) // (32 * RESIDENT_KEYS_PER_THREAD)))


def select_routed(prob_key: torch.Tensor, score_key: torch.Tensor, f: torch.Tensor,
                  keep: torch.Tensor, *, fanout: int | None = None,
                  tile: tuple[int, int] | None = None, rank: bool = False,
                  resident: bool | None = None, compact: int | None = None) -> torch.Tensor:
    """The (T, E) bool mask of the pairs token rounding routes, on the Triton kernel; with ``rank``, (T, E) int32
    holding, where (t, e) is routed, the 1-based rank of t among the tokens routed to e in token order (0
    elsewhere): the row of the pair within its expert, plus one.

    Args:
        prob_key, score_key: (E, T) int32 from :func:`candidate_keys`.
        f: (E,) integer top-k counts. keep: (E,) integer tokens each expert keeps, in
            [0, T] (below f: the best chosen by score; above: all chosen plus the best others by probability).
        fanout: thresholds per counting pass of the search for each row's n-th largest key, a power of
            two >= 2 (2: a bisection, 32 passes; 4: 16 passes). None: :data:`RESIDENT_FANOUT` or, with the
            row streamed, :data:`SELECT_FANOUT`. The result does not depend on it.
        tile: (keys per load, num_warps) of the kernel, powers of two (tuning; the result does not depend on
            it). None: :data:`SELECT_TILE`, or :data:`SELECT_TILE_FEW_EXPERTS` when E is at most the number of
            multiprocessors (keys per load capped at next_pow2(T)); with ``resident``, the warps of
            :func:`resident_warps`.
        resident: whether the search holds each row in registers (one load of the row, every counting pass in
            registers) instead of streaming it from memory once per pass. None: when T <= :data:`RESIDENT_MAX_T`.
            The result does not depend on it.
        compact: with ``resident``, a rounded-down expert (keep < f) with f <= ``compact`` searches a list of its f
            chosen keys, gathered from its row in one pass, instead of its whole row; a power of two, 0 turns it
            off. None: min(next_pow2(T), :data:`COMPACT_MAX`). Scratch: two (E, compact) int32 arrays. The result does
            not depend on it.

    Raises:
        ValueError: shapes or dtypes that do not match the above, a fanout that is not a power of two >= 2, a
            compact that is not 0 or a power of two, or ``resident=True`` with T > :data:`RESIDENT_MAX_T`.
    """
    e, t = _check_select(prob_key, score_key, f, keep)
    if resident is None:
        resident = t <= RESIDENT_MAX_T
    elif resident and t > RESIDENT_MAX_T:
        raise ValueError(f"resident=True holds a row of T keys in registers: T must be <= {RESIDENT_MAX_T}, got {t}")
    if fanout is None:
        fanout = RESIDENT_FANOUT if resident else SELECT_FANOUT
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 2 or fanout & (fanout - 1):
        raise ValueError(f"fanout must be a power of two >= 2, got {fanout!r}")
    bits = fanout.bit_length() - 1
    if compact is None:
        compact = min(next_pow2(t), COMPACT_MAX)
    if isinstance(compact, bool) or not isinstance(compact, int) or compact < 0 or compact & (compact - 1):
        raise ValueError(f"compact must be 0 or a power of two, got {compact!r}")
    cap = compact if resident else 0
    for name, x in (("prob_key", prob_key), ("score_key", score_key), ("f", f), ("keep", keep)):
        check_device(name, x)
    routed = torch.zeros(t, e, dtype=torch.int32 if rank else torch.bool, device=prob_key.device)
    if tile is None:
        few = prob_key.is_cuda and e <= sm_count(prob_key.device)
        tile = SELECT_TILE_FEW_EXPERTS if few else SELECT_TILE
        if resident:
            tile = (tile[0], resident_warps(t))
    block, warps = tile
    if e and t:
        # scratch lists of the rounded-down experts' chosen keys and tokens (a placeholder pointer when off)
        lists = new_output((2, e, cap), dtype=torch.int32, device=prob_key.device) if cap else prob_key
        launch_kernel(_select_kernel, (e,), prob_key, score_key, f.contiguous(), keep.contiguous(),
                      routed if rank else routed.view(torch.int8), lists[0] if cap else lists,
                      lists[1] if cap else lists, t, e, BLOCK=min(block, next_pow2(t)), FANOUT=fanout,
                      PASSES=cdiv(32, bits), RANK=rank, ROW=next_pow2(t) if resident else 0, CAP=cap, num_warps=warps)
    return routed


def _best_mask(key: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """(E, T) bool: the n[e] largest real keys of each row (ties: lower token first)."""
    t = key.shape[1]
    tokens = torch.arange(t, device=key.device)
    exact = (key.long() - NO_KEY).mul_(2**31).add_((2**31 - 1) - tokens)  # unique per row; NO_KEY lowest
    order = torch.argsort(exact, dim=1, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, tokens.expand_as(order).contiguous())
    return (rank < n[:, None]) & (key != NO_KEY)


def select_routed_ref(prob_key: torch.Tensor, score_key: torch.Tensor, f: torch.Tensor,
                      keep: torch.Tensor, *, rank: bool = False) -> torch.Tensor:
    """Torch twin of :func:`select_routed` (same arguments and result): a sort of each row by an exact
    int64 key (value, then lower token). Memory: transient (E, T) int64 arrays."""
    e, t = _check_select(prob_key, score_key, f, keep)
    f, keep = f.long(), keep.long()
    down = (keep < f)[:, None]
    kept = torch.where(down, _best_mask(score_key, keep), score_key != NO_KEY)
    added = _best_mask(prob_key, (keep - f).clamp_min(0)) & ~down
    routed = (kept | added).t().contiguous()
    if not rank:
        return routed
    return torch.where(routed, torch.cumsum(routed, dim=0, dtype=torch.int32), 0).to(torch.int32)


def use_select_kernels(device: torch.device, use_kernel: bool | None) -> bool:
    """Whether token rounding runs the kernels of this module: on CUDA unless ``use_kernel`` is False;
    on CPU only when ``use_kernel`` is True and the Triton interpreter is on (tests)."""
    if use_kernel is False:
        return False
    if device.type == "cuda":
        return True
    return use_kernel is True and interpreting()
