"""Fused top-k router kernel: top-k with softmax or sigmoid scores (SPEC §2 router; §4 router backward).

The router GEMM logits = X W_rᵀ stays in torch; this op takes the (T, E) float32 logits and, per
token, picks the top-K experts and computes their scores S (T, K) in one pass over the logits:

* ``"topk_then_softmax"`` (SonicMoE): S = softmax over the K chosen logits;
* ``"softmax_then_topk"`` (Qwen3/OLMoE/Mixtral): S = the chosen entries of the softmax over all E
  logits, divided by their sum when ``renormalize``;
* ``"sigmoid_then_topk"`` (DeepSeek-V3): p = sigmoid(logits); the experts are the top-K of p + b, with b an optional
  (E,) bias that steers the choice only (auxiliary-loss-free load balancing; no gradient); S = p at the chosen
  experts, divided by (their sum + 1e-20) when ``renormalize``; with ``n_group`` > 1 (DeepSeek-V3's group-limited
  routing) only the experts of each token's ``topk_group`` best groups (a group of E/n_group consecutive experts
  scores the sum of its two largest p + b) are candidates.

Forward kernel: one program owns BLOCK_T tokens and holds all E logits of each in registers (E_P2 =
next power of two of E, padded with -inf); K rounds of argmax-and-mask pick the experts by
decreasing logit (sigmoid: decreasing p + b), ties broken toward the lower expert index
(:func:`sonicmoe.routing.topk_lowest_first`, the torch path's rule too); a NaN logit ranks first, tied with a +inf
one (the lower index first; torch ranks the NaN first). Outputs: ids (T, K) int64, S (T, K) float32, and for
sigmoid with ``renormalize`` the chosen p (T, K) float32, which the backward needs.

Backward kernel (d S (T, K) -> d logits (T, E), zero outside the chosen experts except where noted),
with g = d S, s = S and dot_t = Σ_k s_k g_k:

* topk_then_softmax: d logit[e_k] = s_k (g_k − dot);
* softmax_then_topk: d logits = p ⊙ (G − dot) over all E, p = softmax over all E (recomputed from
  the logits), G = g scattered to the chosen experts (Σ_e p_e G_e = dot because s_k = p[e_k]);
* softmax_then_topk with renormalize: s_k = p[e_k] / P, P = Σ_chosen p. Through the renormalisation,
  ∂L/∂p[e_j] = (g_j − dot) / P at the chosen experts (0 elsewhere); through the softmax,
  d logits = p ⊙ (∂L/∂p − Σ_e p_e ∂L/∂p_e), and Σ_e p_e ∂L/∂p_e = Σ_j s_j (g_j − dot) = 0 since
  Σ_j s_j = 1, so d logit[e_j] = s_j (g_j − dot): the topk_then_softmax formula (the two orders are
  the same function of the logits when renormalising);
* sigmoid_then_topk: d logit[e_k] = g_k p_k (1 − p_k) with s = p; with renormalize, s_k = p_k / (P + ε),
  P = Σ_chosen p, so ∂L/∂p_j = (g_j − dot) / (P + ε) and d logit[e_j] = s_j (1 − p_j) (g_j − dot).

Everything is deterministic (no atomics) and free of host synchronisation. E > 1024 falls back to
the torch twin :func:`topk_router_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import ROUTER_ORDERS
from ..routing import check_expert_bias, check_expert_groups, check_top_k, sigmoid_topk, topk_lowest_first
from .common import cdiv, check_device, interpreting, kernel_backward, new_output, next_pow2
from .fast_launch import launch_kernel

MAX_KERNEL_EXPERTS = 1024  # above this the launcher falls back to torch (registers hold all E logits)


@triton.jit
def _kept_groups(key, e, mask_e, group_size, N_GROUP: tl.constexpr, NG_P2: tl.constexpr, TOPK_GROUP: tl.constexpr):
    """(BLOCK_T, E_P2) bool: the experts of each token's TOPK_GROUP best groups, a group scoring the sum of its two
    largest keys (ties: the lower index within a group, the lower group among groups)."""
    g_of_e = e // group_size
    gg = tl.arange(0, NG_P2)  # groups padded to a power of two: the padded ones score -inf and come last
    score = tl.full((key.shape[0], NG_P2), float("-inf"), tl.float32)
    for g in tl.static_range(N_GROUP):
        in_g = (mask_e & (g_of_e == g))[None, :]
        m1 = tl.max(tl.where(in_g, key, float("-inf")), axis=1)
        i1 = tl.min(tl.where(in_g & (key == m1[:, None]), e[None, :], e.shape[0]), axis=1)
        m2 = tl.max(tl.where(in_g & (e[None, :] != i1[:, None]), key, float("-inf")), axis=1)
        score = tl.where(gg[None, :] == g, (m1 + m2)[:, None], score)
    kept_g = tl.zeros((key.shape[0], NG_P2), dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        cand = tl.where(kept_g == 0, score, float("-inf"))
        m = tl.max(cand, axis=1)
        gi = tl.min(tl.where((kept_g == 0) & (cand == m[:, None]), gg[None, :], NG_P2), axis=1)
        kept_g = tl.where(gg[None, :] == gi[:, None], 1, kept_g)
    kept = tl.zeros(key.shape, dtype=tl.int32)
    for g in tl.static_range(N_GROUP):
        col = tl.sum(tl.where(gg[None, :] == g, kept_g, 0), axis=1)  # (BLOCK_T,) 1 if group g is kept
        kept = tl.where((g_of_e == g)[None, :], col[:, None], kept)
    return kept != 0


@triton.jit(do_not_specialize=["T"])
def _topk_router_fwd_kernel(
    logits_ptr, bias_ptr, ids_ptr, scores_ptr, probs_ptr,
    T, E, stride_lt, stride_it, stride_st,
    K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, BLOCK_T: tl.constexpr,
    ORDER: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr = 1, NG_P2: tl.constexpr = 1, TOPK_GROUP: tl.constexpr = 1,
):
    # ORDER: 0 topk_then_softmax, 1 softmax_then_topk, 2 sigmoid_then_topk (_ORDER_CODES); N_GROUP > 1: group-limited
    # choice (sigmoid only), the E experts in N_GROUP groups of E / N_GROUP consecutive ones
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = t < T
    t64 = t.to(tl.int64)
    e = tl.arange(0, E_P2)
    mask_e = e < E
    x = tl.load(logits_ptr + t64[:, None] * stride_lt + e[None, :], mask=mask_t[:, None] & mask_e[None, :],
                other=0.0).to(tl.float32)
    x = tl.where(mask_e[None, :], x, float("-inf"))  # (BLOCK_T, E_P2), padded experts at -inf
    key = x
    if ORDER == 2:
        p = tl.sigmoid(x)  # padded experts: 0 (never chosen: `avail` below)
        key = p
        if HAS_BIAS:
            key = p + tl.load(bias_ptr + e, mask=mask_e, other=0.0).to(tl.float32)[None, :]
    key = tl.where(x != x, float("inf"), key)  # selection key: NaN ranks first (tied with +inf)
    kk = tl.arange(0, K_P2)
    avail = tl.broadcast_to(mask_e[None, :], (BLOCK_T, E_P2))
    if N_GROUP > 1:
        avail = avail & _kept_groups(key, e, mask_e, E // N_GROUP, N_GROUP, NG_P2, TOPK_GROUP)
    top_val = tl.full((BLOCK_T, K_P2), float("-inf"), tl.float32)
    top_p = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)  # sigmoid: p of the chosen experts
    top_idx = tl.zeros((BLOCK_T, K_P2), dtype=tl.int32)
    for k in range(K):
        # argmax over the experts not yet chosen; ties -> lowest index. `avail` (not a -inf mark) keeps
        # chosen experts out even when the remaining logits are all -inf.
        cand = tl.where(avail, key, float("-inf"))
        m = tl.max(cand, axis=1)
        idx = tl.min(tl.where(avail & (cand == m[:, None]), e[None, :], E_P2), axis=1)
        top_val = tl.where(kk[None, :] == k, m[:, None], top_val)
        top_idx = tl.where(kk[None, :] == k, idx[:, None], top_idx)
        if ORDER == 2:  # the chosen expert's p (adding zeros: exactly p)
            pk = tl.sum(tl.where(e[None, :] == idx[:, None], p, 0.0), axis=1)
            top_p = tl.where(kk[None, :] == k, pk[:, None], top_p)
        avail = avail & (e[None, :] != idx[:, None])
    valid_k = kk[None, :] < K
    out_mask = mask_t[:, None] & valid_k
    if ORDER == 2:
        s = top_p
        if RENORMALIZE:
            s = s / (tl.sum(tl.where(valid_k, s, 0.0), axis=1)[:, None] + 1e-20)
            tl.store(probs_ptr + t64[:, None] * stride_st + kk[None, :], top_p, mask=out_mask)
    else:
        row_max = tl.max(top_val, axis=1)  # the first choice: the max over all E logits
        ex = tl.exp(top_val - row_max[:, None])  # padded slots: exp(-inf) = 0
        if ORDER == 1:
            z = tl.sum(tl.exp(x - row_max[:, None]), axis=1)  # padded experts contribute exp(-inf) = 0
            s = ex / z[:, None]
            if RENORMALIZE:
                s = s / tl.sum(tl.where(valid_k, s, 0.0), axis=1)[:, None]
        else:
            s = ex / tl.sum(ex, axis=1)[:, None]
    tl.store(ids_ptr + t64[:, None] * stride_it + kk[None, :], top_idx.to(tl.int64), mask=out_mask)
    tl.store(scores_ptr + t64[:, None] * stride_st + kk[None, :], s, mask=out_mask)


@triton.jit(do_not_specialize=["T"])
def _topk_router_bwd_kernel(
    logits_ptr, ids_ptr, scores_ptr, probs_ptr, dscores_ptr, dlogits_ptr,
    T, E, stride_lt, stride_it, stride_st, stride_gt, stride_dt,
    K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, BLOCK_T: tl.constexpr,
    DENSE: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = t < T
    t64 = t.to(tl.int64)
    kk = tl.arange(0, K_P2)
    mask_tk = mask_t[:, None] & (kk[None, :] < K)
    s = tl.load(scores_ptr + t64[:, None] * stride_st + kk[None, :], mask=mask_tk, other=0.0)
    g = tl.load(dscores_ptr + t64[:, None] * stride_gt + kk[None, :], mask=mask_tk, other=0.0).to(tl.float32)
    ids = tl.load(ids_ptr + t64[:, None] * stride_it + kk[None, :], mask=mask_tk, other=0).to(tl.int32)
    dot = tl.sum(s * g, axis=1)  # (BLOCK_T,) Σ_k s_k g_k
    e = tl.arange(0, E_P2)
    mask_e = e < E
    # per-slot values scattered to their experts: g (DENSE), s (g − dot) (softmax orders), through the sigmoid
    if DENSE:
        slot = g
    elif SIGMOID:
        if RENORMALIZE:  # s (1 − p) (g − dot), p the chosen sigmoids
            p = tl.load(probs_ptr + t64[:, None] * stride_st + kk[None, :], mask=mask_tk, other=0.0)
            slot = s * (1.0 - p) * (g - dot[:, None])
        else:  # s = p: g p (1 − p)
            slot = g * s * (1.0 - s)
    else:
        slot = s * (g - dot[:, None])
    scat = tl.zeros((BLOCK_T, E_P2), dtype=tl.float32)
    for k in range(K):
        sel = kk[None, :] == k
        v = tl.sum(tl.where(sel, slot, 0.0), axis=1)
        ek = tl.sum(tl.where(sel, ids, 0), axis=1)
        scat = tl.where(e[None, :] == ek[:, None], v[:, None], scat)
    mask_te = mask_t[:, None] & mask_e[None, :]
    if DENSE:
        # softmax_then_topk without renormalisation: d logits = p ⊙ (G − dot), p over all E
        x = tl.load(logits_ptr + t64[:, None] * stride_lt + e[None, :], mask=mask_te, other=0.0)
        x = tl.where(mask_e[None, :], x, float("-inf"))
        ex = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = ex / tl.sum(ex, axis=1)[:, None]
        dl = p * (scat - dot[:, None])
    else:
        dl = scat
    tl.store(dlogits_ptr + t64[:, None] * stride_dt + e[None, :], dl, mask=mask_te)


def _meta(e_p2: int) -> dict:
    """Tokens per program and warps: 2048 logits per program on GPU, which ptxas (sm_90) fits in
    registers without spills for E_P2 = 128..1024 and K up to 32 (not autotuned or timed on a GPU yet;
    the router is a small share of the layer). The interpreter takes 16 tokens per program."""
    if interpreting():
        return {"BLOCK_T": 16}
    return {"BLOCK_T": max(1, min(32, 2048 // e_p2)), "num_warps": 4 if e_p2 <= 256 else 8}


def _launch(kernel, t: int, e: int, args: dict, **const):
    meta = _meta(next_pow2(e))
    grid = (cdiv(t, meta["BLOCK_T"]),)
    launch_kernel(kernel, grid, **args, T=t, E=e, E_P2=next_pow2(e), **const, **meta)


_ORDER_CODES = {"topk_then_softmax": 0, "softmax_then_topk": 1, "sigmoid_then_topk": 2}


def _forward(logits: torch.Tensor, top_k: int, order: str, renormalize: bool, bias: torch.Tensor | None,
             groups: tuple[int, int] = (1, 1)):
    """(ids (T, K) int64, S (T, K) float32, the chosen sigmoids (T, K) float32 or None): those only for
    sigmoid_then_topk with renormalize (the backward's p)."""
    t, e = logits.shape
    code = _ORDER_CODES[order]
    renormalize = renormalize and code != 0  # topk_then_softmax: already normalised
    ids = new_output((t, top_k), device=logits.device, dtype=torch.int64)
    scores = new_output((t, top_k), device=logits.device, dtype=torch.float32)
    probs = new_output((t, top_k), device=logits.device, dtype=torch.float32) if code == 2 and renormalize else None
    if t > 0:
        args = dict(logits_ptr=logits, bias_ptr=bias if bias is not None else logits, ids_ptr=ids,
                    scores_ptr=scores, probs_ptr=probs if probs is not None else scores,
                    stride_lt=logits.stride(0), stride_it=ids.stride(0), stride_st=scores.stride(0))
        _launch(_topk_router_fwd_kernel, t, e, args, K=top_k, K_P2=next_pow2(top_k), ORDER=code,
                RENORMALIZE=renormalize, HAS_BIAS=bias is not None, N_GROUP=groups[0], NG_P2=next_pow2(groups[0]),
                TOPK_GROUP=groups[1])
    return ids, scores, probs


def _backward(logits, ids, scores, probs, dscores, num_experts: int, sigmoid: bool) -> torch.Tensor:
    """d logits (T, E) from d S (T, K). ``logits`` is needed (not None) only for the dense case
    (softmax_then_topk without renormalisation), ``probs`` (the chosen sigmoids) only for sigmoid_then_topk with
    renormalisation."""
    t, k = ids.shape
    e = num_experts
    dscores = dscores.contiguous()
    dlogits = new_output((t, e), device=ids.device, dtype=torch.float32)
    dense = logits is not None
    if t > 0:
        args = dict(logits_ptr=logits if dense else scores, ids_ptr=ids, scores_ptr=scores,
                    probs_ptr=probs if probs is not None else scores, dscores_ptr=dscores, dlogits_ptr=dlogits,
                    stride_lt=logits.stride(0) if dense else 0, stride_it=ids.stride(0), stride_st=scores.stride(0),
                    stride_gt=dscores.stride(0), stride_dt=dlogits.stride(0))
        _launch(_topk_router_bwd_kernel, t, e, args, K=k, K_P2=next_pow2(k), DENSE=dense, SIGMOID=sigmoid,
                RENORMALIZE=probs is not None)
    return dlogits


class TopKRouterFunction(torch.autograd.Function):
    """(T, E) float32 logits -> (ids (T, K) int64, S (T, K) float32) on the fused kernel; backward
    d S -> d logits (T, E) on the backward kernel (formulas in the module docstring).

    Saves ids and S, plus the logits for softmax_then_topk without renormalisation (p over all E is
    recomputed from them) and the chosen sigmoids (T, K) for sigmoid_then_topk with renormalisation. The
    selection bias gets no gradient. Not twice differentiable: under create_graph=True backward raises
    (:func:`~sonicmoe.ops.common.kernel_backward`).
    """

    @staticmethod
    def forward(ctx, logits, top_k: int, router_order: str, renormalize: bool, bias=None, groups=(1, 1)):
        ids, scores, probs = _forward(logits, top_k, router_order, renormalize, bias, groups)
        ctx.mark_non_differentiable(ids)
        dense = router_order == "softmax_then_topk" and not renormalize
        ctx.save_for_backward(logits if dense else None, ids, scores, probs)
        ctx.num_experts, ctx.sigmoid = logits.shape[1], router_order == "sigmoid_then_topk"
        return ids, scores

    @staticmethod
    @kernel_backward("router_topk's fused router kernel", "router_topk(..., use_kernel=False) computes S with torch "
                     "ops (SONICMOE_ROUTER_KERNEL=0 for the MoE layer)")
    def backward(ctx, _dids, dscores):
        logits, ids, scores, probs = ctx.saved_tensors
        dlogits = _backward(logits, ids, scores, probs, dscores, ctx.num_experts, ctx.sigmoid)
        return dlogits, None, None, None, None, None


def _check(logits: torch.Tensor, top_k: int, router_order: str, expert_bias: torch.Tensor | None,
           n_group: int, topk_group: int) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-D (T, E) tensor, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if logits.dtype != torch.float32:
        raise TypeError(f"logits must be float32, got {logits.dtype}")
    e = logits.shape[1]
    check_top_k(top_k, e)
    if router_order not in ROUTER_ORDERS:
        raise ValueError(f"router_order must be one of {ROUTER_ORDERS}, got {router_order!r}")
    check_expert_bias(expert_bias, e, router_order, logits.device)
    check_expert_groups(n_group, topk_group, e, top_k, router_order)


def topk_router(
    logits: torch.Tensor,
    top_k: int,
    router_order: str = "topk_then_softmax",
    renormalize: bool = False,
    expert_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K expert ids and scores S from router logits on the fused Triton kernel (SPEC §2).

    Args:
        logits: (T, E) float32 router logits X W_rᵀ, on CUDA (or CPU under TRITON_INTERPRET=1).
        top_k: K in [1, E].
        router_order: ``"topk_then_softmax"`` (S = softmax over the K chosen logits),
            ``"softmax_then_topk"`` (S = chosen entries of the softmax over all E) or ``"sigmoid_then_topk"``
            (DeepSeek-V3: the top-K of sigmoid(logits) + ``expert_bias``, S = the chosen sigmoids).
        renormalize: with ``"softmax_then_topk"``, divide S by its sum over the K chosen experts; with
            ``"sigmoid_then_topk"``, by that sum + 1e-20 (ignored by ``"topk_then_softmax"``, whose scores
            already sum to 1).
        expert_bias: optional (E,) float bias added to the sigmoids for the choice only (no gradient; the
            auxiliary-loss-free load balancing of DeepSeek-V3); ``"sigmoid_then_topk"`` only.
        n_group, topk_group: group-limited choice of ``"sigmoid_then_topk"`` (DeepSeek-V3: 8, 4): the experts of
            each token's ``topk_group`` best of ``n_group`` groups of E/n_group consecutive experts (a group scores
            the sum of its two largest sigmoid + bias) are the only candidates. 1, 1: no groups.
    Returns:
        topk_ids (T, K) int64, experts by decreasing logit (sigmoid: by decreasing sigmoid + bias; ties toward
        the lower index);
        topk_scores (T, K) float32, differentiable with respect to ``logits``.
    Raises:
        ValueError / TypeError naming the argument. E > 1024 runs :func:`topk_router_ref` instead.
    """
    _check(logits, top_k, router_order, expert_bias, n_group, topk_group)
    if logits.shape[1] > MAX_KERNEL_EXPERTS:
        return topk_router_ref(logits, top_k, router_order, renormalize, expert_bias, n_group, topk_group)
    check_device("logits", logits)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if expert_bias is not None:
        expert_bias = expert_bias.detach().to(torch.float32).contiguous()
    return TopKRouterFunction.apply(logits, top_k, router_order, bool(renormalize), expert_bias,
                                    (n_group, topk_group))


def topk_router_ref(
    logits: torch.Tensor,
    top_k: int,
    router_order: str = "topk_then_softmax",
    renormalize: bool = False,
    expert_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch twin of :func:`topk_router` (top-k + softmax or sigmoid, as :func:`router_topk`'s torch
    path): (T, E) logits -> (topk_ids (T, K) int64, topk_scores (T, K)), autograd through torch."""
    if router_order == "sigmoid_then_topk":
        return sigmoid_topk(torch.sigmoid(logits), top_k, renormalize, expert_bias, n_group, topk_group)
    topk_ids = topk_lowest_first(logits, top_k)
    top_logits = logits.gather(1, topk_ids)
    if router_order == "topk_then_softmax":
        return topk_ids, torch.softmax(top_logits, dim=-1)
    scores = torch.softmax(logits, dim=-1).gather(1, topk_ids)
    if renormalize:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return topk_ids, scores

