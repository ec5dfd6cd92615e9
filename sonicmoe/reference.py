"""Pure-PyTorch ground truth (float32, per-expert loop). Runs on CPU; every test compares with it.

SPEC §2: h = W1[e] x_t (+ b1[e]); a = silu(gate(h)) * up(h); y = W2[e] a (+ b2[e]);
O_t = Σ_k S_{t,k} y_{t,e_k}. With ``activation="clamped_swiglu"`` (gpt-oss) a = (clamp(up, -7, 7) + 1) ·
g · sigmoid(1.702 g), g = min(gate, 7) (:func:`swiglu_ref`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT
from .functional import check_activation, check_expert_inputs, check_router_weight, require_routing_and_scores
from .routing import RouterOutput, Routing, router_topk, routing_from_topk, scaled_scores


def split_gate_up(h: torch.Tensor, gate_up_layout: str = "concat") -> tuple[torch.Tensor, torch.Tensor]:
    """Split (..., 2n) into gate and up halves (..., n) each.

    ``"concat"``: [gate; up] (columns [0, n) gate, [n, 2n) up). ``"interleaved"``: column 2i gate
    channel i, column 2i+1 up channel i.
    """
    if gate_up_layout == "concat":
        n = h.shape[-1] // 2
        return h[..., :n], h[..., n:]
    if gate_up_layout == "interleaved":
        return h[..., 0::2], h[..., 1::2]
    raise ValueError(f"gate_up_layout must be 'concat' or 'interleaved', got {gate_up_layout!r}")


def swiglu_ref(h: torch.Tensor, gate_up_layout: str = "concat", activation: str = "swiglu") -> torch.Tensor:
    """A = act(gate, up) for H (..., 2n) in the given gate/up layout; returns (..., n) (SPEC §2).

    ``activation``: ``"swiglu"``: silu(gate) · up. ``"clamped_swiglu"`` (gpt-oss, transformers' GptOssExperts):
    g = min(gate, L), u = clamp(up, −L, L), A = (u + 1) · g · sigmoid(α g) with α = 1.702, L = 7
    (:data:`sonicmoe.config.CLAMPED_SWIGLU_ALPHA`, ``CLAMPED_SWIGLU_LIMIT``); differentiable (torch.clamp's gradient:
    zero where a clamp binds, passed at the bounds themselves).

    Raises:
        ValueError: an unknown ``gate_up_layout`` or ``activation``.
    """
    check_activation(activation)
    g, u = split_gate_up(h, gate_up_layout)
    if activation == "swiglu":
        return F.silu(g) * u
    g = g.clamp(max=CLAMPED_SWIGLU_LIMIT)
    u = u.clamp(-CLAMPED_SWIGLU_LIMIT, CLAMPED_SWIGLU_LIMIT)
    return (u + 1) * (g * torch.sigmoid(CLAMPED_SWIGLU_ALPHA * g))


def experts_ref(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    routing: Routing,
    pair_scores: torch.Tensor,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    *,
    gate_up_layout: str = "concat",
    activation: str = "swiglu",
    h_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Expert computation and weighted aggregation, a float32 loop over experts (SPEC §2).

    Args:
        x: (T, d) tokens.
        w1: (E, 2n, d) gate/up projection in ``gate_up_layout``.
        w2: (E, d, n) down projection.
        routing: :class:`~sonicmoe.routing.Routing` of R pairs.
        pair_scores: (R,) score S of each pair.
        b1, b2: optional biases (E, 2n) and (E, d).
        activation: ``"swiglu"`` or ``"clamped_swiglu"`` (:func:`swiglu_ref`).
        h_dtype: None, or the dtype H (bias included) is rounded to before the activation, as the kernels store it
            (bf16 layers); the rounding passes gradients straight through. The clamped activation's gradient jumps
            at the clamps' bounds, so a bf16 layer's gradients match a reference that rounds H as it does, and differ
            by about 1e-2 from one that does not (the elements whose rounding crosses a bound).

    Returns:
        O (T, d) float32 (float64 for float64 inputs). Differentiable with respect to every floating input.

    Raises:
        TypeError, ValueError: as :func:`sonicmoe.experts` (shapes, devices, a missing routing or scores), except
        that each tensor may have its own float dtype (float64 included); TypeError for an ``h_dtype`` that is not
        a floating dtype (an integer one truncated H, silently).
    """
    require_routing_and_scores(routing, pair_scores)
    check_expert_inputs(x, w1, w2, b1, b2, pair_scores, routing, allow_float64=True, one_dtype=False)
    check_activation(activation)
    if h_dtype is not None and not (isinstance(h_dtype, torch.dtype) and h_dtype.is_floating_point):
        raise TypeError(f"h_dtype must be None or a floating torch.dtype (the one H is stored in), got {h_dtype!r}")
    t, d = x.shape
    ct = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for float64 inputs
    xf, w1f, w2f, sf = x.to(ct), w1.to(ct), w2.to(ct), pair_scores.to(ct)
    out = torch.zeros(t, d, dtype=ct, device=x.device)
    offsets = routing.expert_offsets.tolist()
    computed = False
    for e in range(routing.num_experts):
        lo, hi = offsets[e], offsets[e + 1]
        if hi == lo and (computed or e < routing.num_experts - 1):
            continue  # an empty expert; the last one still runs (on no row) when none had a row, so that O stays in
            # the graph of every input (zero gradients, as the kernels give)
        computed = True
        tokens = routing.row_token[lo:hi].long()
        s = sf[routing.row_pair[lo:hi].long()]
        h = xf[tokens] @ w1f[e].t()
        if b1 is not None:
            h = h + b1[e].to(ct)
        if h_dtype is not None:  # rounded as the kernels store H; the gradient passes straight through
            h = h + (h.to(h_dtype).to(ct) - h).detach()
        y = swiglu_ref(h, gate_up_layout, activation) @ w2f[e].t()
        if b2 is not None:
            y = y + b2[e].to(ct)
        out = out.index_add(0, tokens, s[:, None] * y)
    return out


def moe_ref(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    *,
    top_k: int,
    router_order: str = "topk_then_softmax",
    renormalize: bool = False,
    expert_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
    gate_up_layout: str = "concat",
    activation: str = "swiglu",
    router_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, RouterOutput, Routing]:
    """The whole MoE layer in float32 (float64 for float64 x): router, top-k, experts, aggregation (SPEC §2).

    Args:
        x: (T, d). router_weight: (E, d). w1: (E, 2n, d) in ``gate_up_layout``. w2: (E, d, n).
        router_order, renormalize, expert_bias, n_group, topk_group, routed_scaling_factor, activation, router_bias:
        as :func:`sonicmoe.moe`.

    Returns:
        (O (T, d) float32 (float64 for float64 x), the router's output, the routing metadata).

    Raises:
        TypeError, ValueError: as :func:`sonicmoe.moe`, except that each tensor may have its own float dtype.
    """
    check_expert_inputs(x, w1, w2, b1, b2, allow_float64=True, one_dtype=False)
    check_router_weight(router_weight, x, w1.shape[0], allow_float64=True)
    router = router_topk(x, router_weight, top_k, router_order=router_order, renormalize=renormalize,
                         expert_bias=expert_bias, n_group=n_group, topk_group=topk_group, router_bias=router_bias)
    routing = routing_from_topk(router.topk_ids, w1.shape[0])
    out = experts_ref(x, w1, w2, routing, scaled_scores(router.topk_scores, routed_scaling_factor), b1, b2,
                      gate_up_layout=gate_up_layout, activation=activation)
    return out, router, routing
