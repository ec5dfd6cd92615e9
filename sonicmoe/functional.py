"""Functional API: input checks and the backend seam where kernels plug in.

``experts`` runs the expert computation and aggregation for given routing (SPEC §3-§4);
``moe`` is the whole layer (router + experts) used by :class:`sonicmoe.MoE`.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import BACKENDS, GATE_UP_LAYOUTS
from .routing import RouterOutput, Routing, router_topk, routing_from_topk

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")


def check_expert_inputs(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    pair_scores: torch.Tensor | None = None,
    routing: Routing | None = None,
) -> None:
    """Validate shapes, dtypes and devices; raise ValueError/TypeError naming the argument."""
    _check_float("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must have shape (T, d), got {tuple(x.shape)}")
    t, d = x.shape
    _check_float("w1", w1)
    if w1.dim() != 3 or w1.shape[2] != d or w1.shape[1] % 2:
        raise ValueError(
            f"w1 must have shape (E, 2n, d={d}) to match x {tuple(x.shape)}, got {tuple(w1.shape)}"
        )
    e, two_n, _ = w1.shape
    _check_float("w2", w2)
    if tuple(w2.shape) != (e, d, two_n // 2):
        raise ValueError(f"w2 must have shape (E={e}, d={d}, n={two_n // 2}), got {tuple(w2.shape)}")
    for name, b, shape in (("b1", b1, (e, two_n)), ("b2", b2, (e, d))):
        if b is not None:
            _check_float(name, b)
            if tuple(b.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(b.shape)}")
    for name, p in (("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2), ("pair_scores", pair_scores)):
        if p is not None and p.device != x.device:
            raise ValueError(f"{name} is on {p.device} but x is on {x.device}; put them on one device")
    for name, p in (("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2)):
        if p is not None and p.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {p.dtype} but x has {x.dtype}; use one dtype")
    if routing is not None:
        if routing.num_tokens != t:
            raise ValueError(f"routing is for T={routing.num_tokens} tokens but x has T={t}")
        if routing.num_experts != e:
            raise ValueError(f"routing is for E={routing.num_experts} experts but w1 has E={e}")
        if routing.expert_offsets.device != x.device:
            raise ValueError(f"routing is on {routing.expert_offsets.device} but x is on {x.device}")
    if pair_scores is not None:
        _check_float("pair_scores", pair_scores)
        r = routing.num_rows if routing is not None else pair_scores.shape[0]
        if pair_scores.dim() != 1 or pair_scores.shape[0] != r:
            raise ValueError(f"pair_scores must have shape (R={r},), got {tuple(pair_scores.shape)}")


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """``auto`` -> ``triton`` on CUDA, ``torch`` elsewhere (and under torch.func/meta)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if x.is_cuda else "torch"
    return backend


def experts(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    routing: Routing,
    pair_scores: torch.Tensor,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    *,
    gate_up_layout: str = "concat",
    backend: str = "auto",
) -> torch.Tensor:
    """Expert SwiGLU MLPs and weighted aggregation for given routing (SPEC §3-§4).

    O_t = Σ_{pairs p of token t} S_p · (W2[e_p] SwiGLU(W1[e_p] x_t + b1[e_p]) + b2[e_p]).

    Args:
        x: (T, d) bf16/fp16/fp32.
        w1: (E, 2n, d) gate/up projection; ``gate_up_layout`` ``"concat"`` ([gate; up] rows) or
            ``"interleaved"`` (row 2i gate, 2i+1 up).
        w2: (E, d, n) down projection.
        routing: :class:`~sonicmoe.routing.Routing` of R pairs (top-k or general routing).
        pair_scores: (R,) score S of each pair, differentiable.
        b1, b2: optional expert biases (E, 2n), (E, d).
        backend: ``"triton"``, ``"torch"`` or ``"auto"``.

    Returns:
        O (T, d) in x's dtype.

    Raises:
        TypeError: unsupported dtype or mixed dtypes. ValueError: a shape or device mismatch.
    """
    check_expert_inputs(x, w1, w2, b1, b2, pair_scores, routing)
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up_layout must be one of {GATE_UP_LAYOUTS}, got {gate_up_layout!r}")
    backend = resolve_backend(backend, x)
    if backend == "torch":
        from .ops.torch_experts import experts_torch

        return experts_torch(x, w1, w2, routing, pair_scores, b1, b2, gate_up_layout=gate_up_layout)
    from .ops.moe_function import experts_triton

    return experts_triton(x, w1, w2, routing, pair_scores, b1, b2, gate_up_layout=gate_up_layout)


@dataclasses.dataclass
class MoEOutput:
    """Output of :func:`moe`: O (T, d), the router's output and the routing metadata."""

    out: torch.Tensor
    router: RouterOutput
    routing: Routing


def moe(
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
    gate_up_layout: str = "concat",
    backend: str = "auto",
) -> MoEOutput:
    """The MoE layer with top-k routing: router, experts, aggregation (SPEC §2).

    Args:
        x: (T, d). router_weight: (E, d). w1: (E, 2n, d) in ``gate_up_layout``. w2: (E, d, n).
        top_k: K in [1, E].

    Raises:
        TypeError, ValueError: as :func:`experts`; ValueError for top_k out of range.
    """
    check_expert_inputs(x, w1, w2, b1, b2)  # x, w1, w2, biases first: the messages name the culprit
    _check_float("router_weight", router_weight)
    e = w1.shape[0]
    if router_weight.dim() != 2 or tuple(router_weight.shape) != (e, x.shape[1]):
        raise ValueError(
            f"router_weight must have shape (E={e}, d={x.shape[-1]}), got {tuple(router_weight.shape)}"
        )
    if router_weight.device != x.device:
        raise ValueError(f"router_weight is on {router_weight.device} but x is on {x.device}")
    if not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(f"top_k must be an int in [1, E={e}], got {top_k!r}")
    router = router_topk(x, router_weight, top_k, router_order=router_order, renormalize=renormalize)
    routing = routing_from_topk(router.topk_ids, e)
    out = experts(x, w1, w2, routing, router.topk_scores.reshape(-1), b1, b2,
                  gate_up_layout=gate_up_layout, backend=backend)
    return MoEOutput(out=out, router=router, routing=routing)
