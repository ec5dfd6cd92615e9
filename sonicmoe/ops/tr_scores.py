"""Token rounding's pair scores: each routed (token, expert) pair's score S and its gradient (SPEC §5).

After the selection (:mod:`sonicmoe.ops.tr_select`) token rounding holds R token-major pairs
(t_p, e_p), sorted by token, then expert. Each pair needs

    slot_p = k where topk_ids[t_p, k] == e_p, or -1 for a pair top-k did not choose (an *added* pair);
    S_p    = topk_scores[t_p, slot_p]                                     for a chosen pair,
             exp(logits[t_p, e_p] − logsumexp_k logits[t_p, topk_ids[t_p, k]])  (``"topk_then_softmax"``)
             probs[t_p, e_p]  (÷ Σ_k probs[t_p, topk_ids[t_p, k]] with ``renormalize``)  (``"softmax_then_topk"``)
             σ_p = sigmoid(logits[t_p, e_p])  (÷ (Σ_k σ[t_p, topk_ids[t_p, k]] + 1e-20) with ``renormalize``)
                                                                          (``"sigmoid_then_topk"``)
                                                                          for an added pair.

:func:`pair_scores` does this in one Triton kernel (one program per block of pairs), and its backward
in one more (one program per block of tokens, each token's pairs walked in order, the tokens in step: the gradient
of the token's row of ``logits`` (or ``probs``), written as zeros and then its distinct non-zero entries, and of its
K top-k scores — no atomics, no sort, so the bits are reproducible). With ``fused_router_grad`` that
kernel also applies the router's own backward to the chosen pairs' gradient, so the router's top-k backward
kernel and a (T, E) sum of two gradients are skipped (the layer's case). The torch twin
:func:`pair_scores_ref` (advanced indexing, the gradients by autograd) has the same signature and is the path
on CPU and for float64 routers.

Shapes (letters of SPEC §1): topk_ids, topk_scores (T, K); logits, probs (T, E); pair_token,
pair_expert (R,) integer, token-major (pair_token non-decreasing). Scores come out in
``topk_scores``' dtype; the added pairs' are computed in float32. A *padding pair* (token T, expert E; what
``token_rounding(static=True)`` appends) gets score 0, is not added, and receives no gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..routing import is_integer_dtype, take_chosen
from .common import cdiv, check_device, interpreting, kernel_backward, new_output, next_pow2
from .fast_launch import launch_kernel

_BLOCK_PAIRS = 128
SIGMOID_RENORM_EPS = 1e-20  # sigmoid_then_topk renormalises by Σ chosen + this (sonicmoe.ops.router)



@triton.jit
def _chosen_stats(src_ptr, t64, ids, kmask, stride_st, ORDER_LOGITS: tl.constexpr):
    """The token's K chosen logits (or probs) as float32, their largest mx and log Σ exp(c − mx) (or 0 and their
    sum): along the last axis. The logsumexp is kept as the two terms, so that an added pair's exp((v − mx) − red)
    loses only ε·|v − mx|, not ε·|logsumexp| (logits of 200: 2.5e-5 relative before session 79)."""
    cs = tl.load(src_ptr + t64 * stride_st + tl.maximum(ids, 0), mask=kmask, other=0.0).to(tl.float32)
    if ORDER_LOGITS:
        mx = tl.max(tl.where(kmask, cs, float("-inf")), axis=-1)
        red = tl.log(tl.sum(tl.where(kmask, tl.exp(cs - tl.expand_dims(mx, -1)), 0.0), axis=-1))
    else:
        red = tl.sum(tl.where(kmask, cs, 0.0), axis=-1)
        mx = tl.zeros_like(red)
    return cs, mx, red


@triton.jit(do_not_specialize=["R", "T"])
def _pair_scores_fwd_kernel(
    token_ptr, expert_ptr, ids_ptr, ts_ptr, src_ptr, score_ptr, slot_ptr, R, T, stride_st,
    K: tl.constexpr, K_P2: tl.constexpr, ORDER_LOGITS: tl.constexpr, RENORM: tl.constexpr, BLOCK: tl.constexpr,
    EPS: tl.constexpr = 0.0,
):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = p < R
    t64 = tl.load(token_ptr + p, mask=mask, other=0).to(tl.int64)
    real = t64 < T  # padding pairs (token T): score 0, slot -2
    t64 = tl.where(real, t64, 0)
    e = tl.where(real, tl.load(expert_ptr + p, mask=mask, other=0).to(tl.int32), 0)
    kk = tl.arange(0, K_P2)
    # pairs past R and padding pairs read token 0's row (t64 = 0 there): valid memory and finite statistics
    kmask = tl.zeros((BLOCK, K_P2), dtype=tl.int1) | (kk < K)[None, :]
    ids = tl.load(ids_ptr + t64[:, None] * K + kk[None, :], mask=kmask, other=-1).to(tl.int32)
    slot = tl.max(tl.where(ids == e[:, None], kk[None, :], -1), axis=1)
    chosen = tl.load(ts_ptr + t64 * K + tl.maximum(slot, 0), mask=mask, other=0.0)
    _, mx, red = _chosen_stats(src_ptr, t64[:, None], ids, kmask, stride_st, ORDER_LOGITS)
    if EPS != 0.0:  # sigmoid_then_topk's renormalisation: Σ chosen + 1e-20
        red = red + EPS
    v = tl.load(src_ptr + t64 * stride_st + e, mask=mask, other=0.0).to(tl.float32)
    if ORDER_LOGITS:
        added = tl.exp((v - mx) - red)
    elif RENORM:
        added = v / red
    else:
        added = v
    score = tl.where(slot >= 0, chosen, added.to(chosen.dtype))
    tl.store(score_ptr + p, tl.where(real, score, 0.0), mask=mask)
    tl.store(slot_ptr + p, tl.where(real, slot, -2), mask=mask)


@triton.jit
def _load_pair(grad_ptr, expert_ptr, slot_ptr, src_ptr, p, m, t64, stride_st):
    """Pair p of each token of the block where m: (d S, expert, slot, src value); elsewhere a no-op pair (slot -2)."""
    g = tl.load(grad_ptr + p, mask=m, other=0.0).to(tl.float32)
    e = tl.load(expert_ptr + p, mask=m, other=0).to(tl.int32)
    slot = tl.load(slot_ptr + p, mask=m, other=-2)  # k, -1 for an added pair; -2: past the token's pairs
    v = tl.load(src_ptr + t64 * stride_st + e, mask=m, other=0.0).to(tl.float32)
    return g, e, slot, v


@triton.jit
def _pair_step(dsrc_ptr, d_ts, d_red, g, e, slot, v, mx, red, kk, t64, stride_dt, ORDER_LOGITS: tl.constexpr,
               RENORM: tl.constexpr):
    """One pair per token: a chosen pair's d S to its top-k slot; an added pair's d src to its (token, expert) entry
    (stored: no other pair has that entry) and its term of d (logsumexp or sum of the chosen entries)."""
    d_ts = tl.where(kk[None, :] == slot[:, None], g[:, None], d_ts)
    is_added = slot == -1
    if ORDER_LOGITS:  # S = exp(v - lse), lse = mx + red: dS/dv = S, dS/dlse = -S
        sc = tl.exp((v - mx) - red)
        d_v = g * sc
        d_red -= tl.where(is_added, g * sc, 0.0)
    elif RENORM:  # S = v / z: dS/dv = 1/z, dS/dz = -v/z²
        d_v = g / red
        d_red -= tl.where(is_added, g * v / (red * red), 0.0)
    else:
        d_v = g
    tl.store(dsrc_ptr + t64 * stride_dt + e, d_v.to(dsrc_ptr.dtype.element_ty), mask=is_added)
    return d_ts, d_red


@triton.jit(do_not_specialize=["T"])
def _pair_scores_bwd_kernel(
    grad_ptr, expert_ptr, slot_ptr, start_ptr, ids_ptr, src_ptr, ts_ptr, dts_ptr, dsrc_ptr, T, E, stride_st,
    stride_dt, K: tl.constexpr, K_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    ORDER_LOGITS: tl.constexpr, RENORM: tl.constexpr, FOLD: tl.constexpr, EPS: tl.constexpr = 0.0,
):
    """BLOCK_T tokens per program. Their rows of d src are written as zeros first; then the tokens' pairs are taken in
    step (step j reads every token's j-th pair, so each token's sums run in its pair order) and each added pair's
    entry is stored; last, the K chosen entries. The entries a row receives are distinct (pairs are unique, chosen
    and added experts differ), and a barrier orders them after the zeros."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = t < T
    t64 = t.to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    zeros = tl.zeros((BLOCK_T, BLOCK_E), dsrc_ptr.dtype.element_ty)
    for c0 in range(0, E, BLOCK_E):
        c = c0 + cols
        tl.store(dsrc_ptr + t64[:, None] * stride_dt + c[None, :], zeros, mask=mask_t[:, None] & (c < E)[None, :])
    tl.debug_barrier()  # the zeros land before any entry of the same rows
    start = tl.load(start_ptr + t, mask=mask_t, other=0)
    cnt = tl.load(start_ptr + t + 1, mask=mask_t, other=0) - start
    kk = tl.arange(0, K_P2)
    kmask = mask_t[:, None] & (kk < K)[None, :]
    ids = tl.load(ids_ptr + t64[:, None] * K + kk[None, :], mask=kmask, other=-1).to(tl.int32)
    cs = tl.load(src_ptr + t64[:, None] * stride_st + tl.maximum(ids, 0), mask=kmask, other=0.0).to(tl.float32)
    if ORDER_LOGITS:  # the logsumexp of the chosen logits as mx + red (as _chosen_stats; tokens past T: 0 + 0)
        mx = tl.where(mask_t, tl.max(tl.where(kmask, cs, float("-inf")), axis=1), 0.0)
        red = tl.log(tl.sum(tl.where(kmask, tl.exp(cs - mx[:, None]), 0.0), axis=1) + tl.where(mask_t, 0.0, 1.0))
    else:  # the sum of the chosen probabilities (+ EPS: sigmoid_then_topk's renormalisation; tokens past T: 1)
        mx = tl.zeros((BLOCK_T,), dtype=tl.float32)
        red = tl.sum(tl.where(kmask, cs, 0.0), axis=1)
        if EPS != 0.0:
            red = red + EPS
        red = tl.where(mask_t, red, 1.0)
    d_ts = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)  # d topk_scores[t, :] from the chosen pairs
    d_red = tl.zeros((BLOCK_T,), dtype=tl.float32)  # d of the logsumexp (or of the sum) of the chosen entries
    # every token's j-th and (j+1)-th pairs: both steps' loads in flight at once, then the two steps in pair order
    for j in range(0, tl.max(cnt, axis=0), 2):
        p = start + j
        g0, e0, slot0, v0 = _load_pair(grad_ptr, expert_ptr, slot_ptr, src_ptr, p, j < cnt, t64, stride_st)
        g1, e1, slot1, v1 = _load_pair(grad_ptr, expert_ptr, slot_ptr, src_ptr, p + 1, j + 1 < cnt, t64, stride_st)
        d_ts, d_red = _pair_step(dsrc_ptr, d_ts, d_red, g0, e0, slot0, v0, mx, red, kk, t64, stride_dt, ORDER_LOGITS,
                                 RENORM)
        d_ts, d_red = _pair_step(dsrc_ptr, d_ts, d_red, g1, e1, slot1, v1, mx, red, kk, t64, stride_dt, ORDER_LOGITS,
                                 RENORM)
    d_chosen = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)  # d src at the K chosen experts
    if ORDER_LOGITS:  # d lse / d chosen logit k = softmax over the chosen logits
        d_chosen += d_red[:, None] * tl.exp((cs - mx[:, None]) - red[:, None])
    elif RENORM:
        d_chosen += d_red[:, None]
    if FOLD:  # the chosen pairs' own scores by the router's formula (pair_scores' fused_router_grad): no d topk_scores
        s_k = tl.load(ts_ptr + t64[:, None] * K + kk[None, :], mask=kmask, other=0.0).to(tl.float32)
        dot = tl.sum(s_k * d_ts, axis=1)[:, None]
        if ORDER_LOGITS:
            d_chosen += s_k * (d_ts - dot)
        elif RENORM:
            d_chosen += (d_ts - dot) / red[:, None]
        else:
            d_chosen += d_ts
    if ORDER_LOGITS or RENORM or FOLD:  # the K chosen entries (distinct, and never an added pair's)
        tl.store(dsrc_ptr + t64[:, None] * stride_dt + ids, d_chosen.to(dsrc_ptr.dtype.element_ty), mask=kmask)
    if not FOLD:
        tl.store(dts_ptr + t64[:, None] * K + kk[None, :], d_ts.to(dts_ptr.dtype.element_ty), mask=kmask)


def _bwd_meta(e_p2: int) -> dict:
    """Tokens per program, the width of the zero stores and warps of the backward (16 tokens under the interpreter).
    The kernel is bound by the latency of its pair loads, so many tokens per program means few waves of them: with
    the token's row of d src held in registers, 4 tokens per program at E = 512 took 131 µs, one token 53 µs
    (H100, session 34)."""
    return {"BLOCK_T": 16 if interpreting() else 64, "BLOCK_E": min(e_p2, 128), "num_warps": 4}


class _PairScores(torch.autograd.Function):
    """Autograd of the pair scores. Saves (no copies): ``src`` (T, E) — the router's logits (or probs),
    which the router's own graph holds anyway —, topk_ids (T, K), pair_token, pair_expert and the int32
    slots (R,) (k, −1 for an added pair, −2 for a padding pair); with ``fold`` also topk_scores (T, K), which the
    router's graph holds too. Backward: d topk_scores (T, K) and d src (T, E), dense, from one kernel; it reads each
    token's pairs, so padding pairs (token T) are never read. With ``fold`` the chosen pairs' gradient goes into
    d src by the router's own score formula and topk_scores gets none (see :func:`pair_scores`)."""

    @staticmethod
    def forward(ctx, topk_scores, src, topk_ids, pair_token, pair_expert, order_logits, renorm, fold, eps=0.0):
        t, k = topk_ids.shape
        r = pair_token.shape[0]
        scores = new_output(r, dtype=topk_scores.dtype, device=src.device)
        slot = new_output(r, dtype=torch.int32, device=src.device)
        if r:
            grid = (cdiv(r, _BLOCK_PAIRS),)
            launch_kernel(
                _pair_scores_fwd_kernel, grid,
                pair_token, pair_expert, topk_ids, topk_scores, src, scores, slot, r, t, src.stride(0),
                K=k, K_P2=next_pow2(k), ORDER_LOGITS=order_logits, RENORM=renorm, BLOCK=_BLOCK_PAIRS, EPS=eps,
                num_warps=4)
        ctx.save_for_backward(src, topk_ids, pair_token, pair_expert, slot, *((topk_scores,) if fold else ()))
        ctx.order_logits, ctx.renorm, ctx.fold, ctx.eps = order_logits, renorm, fold, eps
        ctx.ts_dtype = topk_scores.dtype
        ctx.mark_non_differentiable(slot)
        return scores, slot

    @staticmethod
    @kernel_backward("token rounding's pair-score kernel", "token_rounding(..., use_kernel=False) scores the pairs "
                     "with torch ops (the MoE layer runs this kernel on CUDA: use routing='topk' there)")
    def backward(ctx, grad, _):
        src, topk_ids, pair_token, pair_expert, slot, *folded = ctx.saved_tensors
        t, k = topk_ids.shape
        e = src.shape[1]
        d_ts = new_output((t, k), dtype=ctx.ts_dtype, device=src.device)
        d_src = new_output((t, e), dtype=src.dtype, device=src.device)
        # each token's pairs [start[t], start[t + 1]) of the token-major list
        start = torch.searchsorted(pair_token, torch.arange(t + 1, device=src.device, dtype=pair_token.dtype))
        if t:
            meta = _bwd_meta(next_pow2(e))
            launch_kernel(
                _pair_scores_bwd_kernel, (cdiv(t, meta["BLOCK_T"]),),
                grad.contiguous(), pair_expert, slot, start, topk_ids, src, folded[0] if ctx.fold else d_ts, d_ts,
                d_src, t, e, src.stride(0), d_src.stride(0), K=k, K_P2=next_pow2(k), ORDER_LOGITS=ctx.order_logits,
                RENORM=ctx.renorm, FOLD=ctx.fold, EPS=ctx.eps, **meta)
        needs = ctx.needs_input_grad
        d_ts = d_ts if needs[0] and not ctx.fold else None
        return d_ts, (d_src if needs[1] else None), None, None, None, None, None, None, None


def _check(pair_token: torch.Tensor, pair_expert: torch.Tensor) -> None:
    if pair_token.dim() != 1 or pair_expert.shape != pair_token.shape:
        raise ValueError(f"pair_token and pair_expert must both be (R,), got {tuple(pair_token.shape)} and "
                         f"{tuple(pair_expert.shape)}")
    for name, x in (("pair_token", pair_token), ("pair_expert", pair_expert)):
        if not is_integer_dtype(x.dtype):
            raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")


def pair_scores(router, pair_token: torch.Tensor, pair_expert: torch.Tensor, router_order: str,
                renormalize: bool, fused_router_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores S (R,) and the added flags (R,) bool of token-major pairs, on the Triton kernels.

    Args:
        router: :class:`~sonicmoe.routing.RouterOutput` — logits, probs (T, E) and topk_ids, topk_scores
            (T, K) of T tokens (float32/bfloat16/float16; float64 routers take :func:`pair_scores_ref`).
        pair_token, pair_expert: (R,) integer pairs, sorted by token (the backward finds each token's
            pairs by a binary search), unique; padding pairs (T, E) last, if any.
        router_order: ``"topk_then_softmax"``, ``"softmax_then_topk"`` or ``"sigmoid_then_topk"`` (the module
            docstring; under sigmoid the (T, E) sigmoids are computed here and kept for the backward).
        renormalize: with ``"softmax_then_topk"`` (``"sigmoid_then_topk"``), divide added pairs' probabilities
            (sigmoids) by the sum of the token's chosen ones (+ 1e-20).
        fused_router_grad: send the chosen pairs' gradient straight to ``logits`` (or ``probs``) by the formula
            that :func:`~sonicmoe.routing.router_topk` computes ``topk_scores`` with (``router_order``,
            ``renormalize``; :mod:`sonicmoe.ops.router`), instead of back through ``topk_scores``:
            ``"topk_then_softmax"`` d logit[e_k] += s_k (g_k − Σ_j s_j g_j); ``"softmax_then_topk"`` d probs[e_k] +=
            g_k, or (g_k − Σ_j s_j g_j) / Σ_j probs[e_j] with ``renormalize`` (the softmax's backward then gives the
            router's d logits); ``"sigmoid_then_topk"`` the same with the sigmoids for probs and Σ_j + 1e-20. The
            router's top-k backward and one (T, E) sum of gradients then do not run. Only
            for a router made by ``router_topk`` with the same order and renormalisation and unmodified
            ``topk_scores`` (as in :class:`~sonicmoe.MoE`): for any other, the gradient would be wrong.

    Returns:
        (S (R,) in topk_scores' dtype, differentiable w.r.t. ``topk_scores`` (not with ``fused_router_grad``) and
        ``logits`` (or ``probs``), 0 for padding pairs; pair_added (R,) bool, True where top-k did not choose the pair,
        False for padding pairs).

    Raises:
        ValueError / TypeError: pair arrays that are not (R,) integer tensors.
    """
    _check(pair_token, pair_expert)
    order_logits = router_order == "topk_then_softmax"
    src = added_pair_source(router, router_order)
    for name, x in (("router.probs" if router_order == "softmax_then_topk" else "router.logits", src),
                    ("pair_token", pair_token)):
        check_device(name, x)
    if src.stride(1) != 1:
        src = src.contiguous()
    ts = router.topk_scores.detach() if fused_router_grad else router.topk_scores  # no edge to the router's top-k
    scores, slot = _PairScores.apply(ts.contiguous(), src, router.topk_ids.contiguous(),
                                     pair_token.contiguous(), pair_expert.contiguous(), order_logits,
                                     bool(renormalize) and not order_logits, bool(fused_router_grad),
                                     _renorm_eps(router_order, renormalize))
    return scores, slot == -1


def added_pair_source(router, router_order: str) -> torch.Tensor:
    """The (T, E) tensor an added pair's score is read from (and its gradient sent to): the logits
    (``"topk_then_softmax"``), the probabilities (``"softmax_then_topk"``) or the sigmoids of the logits
    (``"sigmoid_then_topk"``, computed here with autograd)."""
    if router_order == "topk_then_softmax":
        return router.logits
    if router_order == "sigmoid_then_topk":
        return torch.sigmoid(router.logits)
    return router.probs


def _renorm_eps(router_order: str, renormalize: bool) -> float:
    """What the renormalising sum of the chosen entries gets added: 1e-20 under sigmoid_then_topk (as its router)."""
    return SIGMOID_RENORM_EPS if router_order == "sigmoid_then_topk" and renormalize else 0.0


def pair_scores_ref(router, pair_token: torch.Tensor, pair_expert: torch.Tensor, router_order: str,
                    renormalize: bool, fused_router_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`pair_scores` (same arguments and results; gradients by autograd, always back through
    ``topk_scores``: ``fused_router_grad`` is ignored, and the router's gradient is the same)."""
    _check(pair_token, pair_expert)
    t, e = router.logits.shape
    real = pair_token < t  # padding pairs (T, E): score 0, not added, no gradient (torch.where)
    pair_token = pair_token.long().clamp(max=max(t - 1, 0))
    pair_expert = pair_expert.long().clamp(max=e - 1)
    ids = router.topk_ids.long()
    match = ids[pair_token] == pair_expert[:, None]  # (R, K): which chosen slot, if any
    pair_added = ~match.any(dim=1) & real
    chosen = router.topk_scores[pair_token, match.to(torch.int32).argmax(dim=1)]
    if router_order == "topk_then_softmax":  # exp((v − mx) − log Σ exp(c − mx)), as the kernel (_chosen_stats)
        chosen_logits = take_chosen(router.logits, ids)
        mx = chosen_logits.detach().max(dim=1, keepdim=True).values
        red = torch.exp(chosen_logits - mx).sum(dim=1).log()
        added = torch.exp((router.logits[pair_token, pair_expert] - mx[pair_token, 0]) - red[pair_token])
    else:
        src = added_pair_source(router, router_order)
        added = src[pair_token, pair_expert]
        if renormalize:
            added = added / (take_chosen(src, ids).sum(dim=1) + _renorm_eps(router_order, True))[pair_token]
    score = torch.where(pair_added, added.to(chosen.dtype), chosen)
    return torch.where(real, score, torch.zeros_like(score)), pair_added


def use_score_kernels(router, use_kernel: bool | None) -> bool:
    """Whether :func:`pair_scores` (the kernels) applies: as the selection kernels
    (:func:`~sonicmoe.ops.tr_select.use_select_kernels`), and never for float64 routers."""
    from .tr_select import use_select_kernels

    probs = router._probs  # None until first read (then the logits' dtype): not computed just for this check
    if torch.float64 in (router.logits.dtype, router.topk_scores.dtype) or (
            probs is not None and probs.dtype == torch.float64):
        return False
    return use_select_kernels(router.logits.device, use_kernel)
