"""Functional API: input checks and the backend seam where kernels plug in.

``experts`` runs the expert computation and aggregation for given routing (SPEC §3-§4);
``moe`` is the whole layer (router + experts) used by :class:`sonicmoe.MoE`.
"""

from __future__ import annotations

import dataclasses

import torch

from ._autocast import casts_under_autocast
from ._device import on_device
from .config import ACTIVATIONS, BACKENDS, GATE_UP_LAYOUTS
from .routing import RouterOutput, Routing, router_topk, routing_from_topk, scaled_scores

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # every backend; torch also runs float64

# Routing's index arrays and their expected lengths, by letter: E+1, T+1 or R
_ROUTING_SHAPES = (("expert_offsets", "E+1"), ("token_offsets", "T+1"), ("row_token", "R"), ("row_pair", "R"),
                   ("pair_row", "R"), ("token_rows", "R"), ("slot_pair", "R"))


def _check_float(name: str, t: torch.Tensor, allow_float64: bool = False) -> None:
    """TypeError naming ``name`` unless ``t`` is a bf16/fp16/fp32 tensor (or float64 when allowed)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype in SUPPORTED_DTYPES or (allow_float64 and t.dtype == torch.float64):
        return
    if t.dtype == torch.float64:
        raise TypeError(f"{name} is float64, which only backend='torch' runs; the triton kernels take "
                        "bfloat16, float16 or float32")
    raise TypeError(f"{name} must be bfloat16, float16 or float32 (float64 with backend='torch'), got {t.dtype}")


def _check_routing(routing: Routing, t: int, e: int, device: torch.device) -> None:
    """Type, sizes, dtypes, shapes and device of the routing metadata (no values read: no sync)."""
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a sonicmoe.Routing (from routing_from_topk or routing_from_pairs), "
                        f"got {type(routing).__name__}")
    if routing.num_tokens != t:
        raise ValueError(f"routing is for T={routing.num_tokens} tokens but x has T={t}")
    if routing.num_experts != e:
        raise ValueError(f"routing is for E={routing.num_experts} experts but w1 has E={e}")
    hint = routing.tile_rows
    if isinstance(hint, bool) or not isinstance(hint, int) or hint < 0:
        raise ValueError(f"routing.tile_rows must be an int >= 0 (0: no hint; else the M_tile every expert's count "
                         f"is a multiple of), got {hint!r}")
    r = routing.num_rows
    sizes = {"E+1": e + 1, "T+1": t + 1, "R": r}
    for field, letter in _ROUTING_SHAPES:
        v = getattr(routing, field)
        if v is None and field == "slot_pair":
            continue
        if not isinstance(v, torch.Tensor) or v.dtype != torch.int32:
            # the kernels and the score gradients read int32; a uint8 array would even index as a boolean mask
            what = v.dtype if isinstance(v, torch.Tensor) else type(v).__name__
            raise TypeError(f"routing.{field} must be an int32 tensor (as routing_from_topk and routing_from_pairs "
                            f"build it), got {what}")
        if v.device != device:
            raise ValueError(f"routing is on {v.device} (routing.{field}) but x is on {device}")
        if tuple(v.shape) != (sizes[letter],):
            raise ValueError(f"routing.{field} must have shape ({letter}={sizes[letter]},), got {tuple(v.shape)}")


def require_routing_and_scores(routing, pair_scores) -> None:
    """TypeError naming ``routing`` or ``pair_scores`` when it is None (:func:`check_expert_inputs` skips them then,
    for callers that have neither yet)."""
    for name, v, what in (("routing", routing, "a sonicmoe.Routing"), ("pair_scores", pair_scores, "an (R,) tensor")):
        if v is None:
            raise TypeError(f"{name} is required ({what}), got None")


def check_router_weight(router_weight, x: torch.Tensor, num_experts: int, allow_float64: bool) -> None:
    """TypeError/ValueError naming ``router_weight`` unless it is an (E, d) float tensor matching w1's E and x's d
    (the device and top_k are :func:`~sonicmoe.routing.router_topk`'s checks)."""
    _check_float("router_weight", router_weight, allow_float64)
    if router_weight.dim() != 2 or tuple(router_weight.shape) != (num_experts, x.shape[1]):
        raise ValueError(f"router_weight must have shape (E={num_experts}, d={x.shape[-1]}) to match w1 and x, got "
                         f"{tuple(router_weight.shape)}")


def check_expert_inputs(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    pair_scores: torch.Tensor | None = None,
    routing: Routing | None = None,
    *,
    allow_float64: bool = False,
    one_dtype: bool = True,
) -> None:
    """Validate types, shapes, dtypes and devices; raise TypeError/ValueError naming the argument.

    Reads no tensor values (no host sync). Shapes: x (T, d); w1 (E, 2n, d); w2 (E, d, n); b1 (E, 2n);
    b2 (E, d); pair_scores (R,); ``routing`` for T tokens and E experts with arrays of E+1, T+1 and R
    entries. x, w1, w2 and the biases share one dtype (bf16/fp16/fp32, or float64 when
    ``allow_float64``); pair_scores may have any of those dtypes. ``one_dtype=False`` (the references, which compute
    in float32 whatever they are given) lets each have its own.
    """
    _check_float("x", x, allow_float64)
    if x.dim() != 2:
        raise ValueError(f"x must have shape (T, d), got {tuple(x.shape)}")
    t, d = x.shape
    _check_float("w1", w1, allow_float64)
    if w1.dim() != 3 or w1.shape[2] != d or w1.shape[1] % 2 or w1.shape[1] == 0:
        raise ValueError(
            f"w1 must have shape (E, 2n, d={d}) with n >= 1 to match x {tuple(x.shape)}, got {tuple(w1.shape)}"
        )
    e, two_n, _ = w1.shape
    _check_float("w2", w2, allow_float64)
    if tuple(w2.shape) != (e, d, two_n // 2):
        raise ValueError(f"w2 must have shape (E={e}, d={d}, n={two_n // 2}) to match w1 {tuple(w1.shape)} and x "
                         f"{tuple(x.shape)}, got {tuple(w2.shape)}")
    for name, b, shape in (("b1", b1, (e, two_n)), ("b2", b2, (e, d))):
        if b is not None:
            _check_float(name, b, allow_float64)
            if tuple(b.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(b.shape)}")
    for name, p in (("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2), ("pair_scores", pair_scores)):
        if isinstance(p, torch.Tensor) and p.device != x.device:
            raise ValueError(f"{name} is on {p.device} but x is on {x.device}; put them on one device")
    for name, p in (("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2)) if one_dtype else ():
        if p is not None and p.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {p.dtype} but x has {x.dtype}; use one dtype")
    if routing is not None:
        _check_routing(routing, t, e, x.device)
    if pair_scores is not None:
        _check_float("pair_scores", pair_scores, allow_float64)
        r = routing.num_rows if routing is not None else pair_scores.shape[0]
        if pair_scores.dim() != 1 or pair_scores.shape[0] != r:
            raise ValueError(f"pair_scores must have shape (R={r},), got {tuple(pair_scores.shape)}")


def check_activation(activation) -> None:
    """ValueError unless ``activation`` is one of :data:`sonicmoe.config.ACTIVATIONS`."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """``auto`` -> ``triton`` for CUDA tensors in bf16/fp16/fp32, ``torch`` otherwise (CPU, meta, float64)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if backend == "auto":
        return "triton" if x.is_cuda and x.dtype in SUPPORTED_DTYPES else "torch"
    return backend


@casts_under_autocast
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
    activation: str = "swiglu",
) -> torch.Tensor:
    """Expert SwiGLU MLPs and weighted aggregation for given routing (SPEC §3-§4).

    O_t = Σ_{pairs p of token t} S_p · (W2[e_p] SwiGLU(W1[e_p] x_t + b1[e_p]) + b2[e_p]).

    Args:
        x: (T, d) bf16/fp16/fp32 (float64 with ``backend="torch"``).
        w1: (E, 2n, d) gate/up projection; ``gate_up_layout`` ``"concat"`` ([gate; up] rows) or
            ``"interleaved"`` (row 2i gate, 2i+1 up).
        w2: (E, d, n) down projection.
        routing: :class:`~sonicmoe.routing.Routing` of R pairs (top-k or general routing).
        pair_scores: (R,) score S of each pair, differentiable; any of the float dtypes above.
        b1, b2: optional expert biases (E, 2n), (E, d).
        backend: ``"triton"``, ``"torch"`` or ``"auto"`` (triton for CUDA tensors in bf16/fp16/fp32,
            torch otherwise: CPU, meta, float64).
        activation: ``"swiglu"`` (silu(gate) · up) or ``"clamped_swiglu"`` (gpt-oss: (clamp(up, -7, 7) + 1) ·
            g · sigmoid(1.702 g), g = min(gate, 7); :func:`sonicmoe.reference.swiglu_ref`). On sm_90 the
            warp-specialised Gluon kernels of the up-projection and dH serve both (the clamped form since session
            85; ``SONICMOE_GLUON_CLAMPED=0`` runs it on their Triton twins), in the concat layout.

    Returns:
        O (T, d) in x's dtype (under ``torch.autocast``: in the autocast dtype).

    Mixed precision: under ``torch.autocast`` on x's device (CUDA, or CPU), x, w1, w2 and the biases are cast
    to the autocast dtype (bf16/fp16) first, as ``F.linear`` casts its input and weight, and the experts run in
    it with autocast turned off inside; gradients return to each input in its own dtype (float32 master
    weights get float32 gradients). float64 tensors are left as they are, as autocast leaves them.

    Input contract:
        * dtypes: x, w1, w2, b1, b2 share one of bf16/fp16/fp32; float64 only with the torch backend
          (the Triton kernels have no float64 path; ``auto`` picks torch for float64).
        * device: every tensor on x's device, whichever CUDA device is current: the kernels launch on x's
          device and its current stream (no ``torch.cuda.set_device`` needed for a layer on ``cuda:1``).
        * strides: any; non-contiguous inputs (e.g. a transposed view of W1) are read through
          contiguous copies made internally. Nothing the caller passes is modified.
        * routing: validated for type, sizes, shapes, dtypes and device without reading values
          (no host sync). Index *values* are not checked here — build it with
          ``routing_from_pairs(..., check=True)`` (which synchronises) to have them checked.
        * non-finite values are not checked (that would sync): NaN/Inf in x_t, or in the score of a
          pair of token t, propagate to O_t only; every other token's output stays as without them.
          In the backward they reach dX_t and dS of token t's pairs, and the weight gradients of the
          experts token t was routed to.

    Raises:
        TypeError: unsupported or mixed dtypes, non-tensor arguments, a ``routing`` of the wrong type.
        ValueError: a shape, size or device mismatch, an unknown ``backend``, ``gate_up_layout`` or ``activation``.
    """
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up_layout must be one of {GATE_UP_LAYOUTS}, got {gate_up_layout!r}")
    check_activation(activation)
    backend = resolve_backend(backend, x)
    require_routing_and_scores(routing, pair_scores)
    check_expert_inputs(x, w1, w2, b1, b2, pair_scores, routing, allow_float64=backend == "torch")
    if backend == "torch":
        from .ops.torch_experts import experts_torch

        return experts_torch(x, w1, w2, routing, pair_scores, b1, b2, gate_up_layout=gate_up_layout,
                             activation=activation)
    from .ops.moe_function import experts_triton

    with on_device(x):  # Triton launches on the current device: make it x's
        return experts_triton(x, w1, w2, routing, pair_scores, b1, b2, gate_up_layout=gate_up_layout,
                              activation=activation)


@dataclasses.dataclass
class MoEOutput:
    """Output of :func:`moe`: O (T, d), the router's output and the routing metadata."""

    out: torch.Tensor
    router: RouterOutput
    routing: Routing


@casts_under_autocast
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
    expert_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
    gate_up_layout: str = "concat",
    backend: str = "auto",
    activation: str = "swiglu",
    router_bias: torch.Tensor | None = None,
) -> MoEOutput:
    """The MoE layer with top-k routing: router, experts, aggregation (SPEC §2).

    Args:
        x: (T, d). router_weight: (E, d). w1: (E, 2n, d) in ``gate_up_layout`` (``"concat"``: rows
        [0, n) gate, [n, 2n) up; ``"interleaved"``: row 2i gate, 2i+1 up). w2: (E, d, n).
        b1, b2: optional (E, 2n), (E, d). top_k: K in [1, E].
        router_order, renormalize, expert_bias, n_group, topk_group: the router's
        (:func:`~sonicmoe.routing.router_topk`; ``expert_bias`` (E,) and the groups shape the choice of
        ``"sigmoid_then_topk"`` only). routed_scaling_factor: every score S times this
        constant (DeepSeek-V3: 2.5). activation: ``"swiglu"`` or ``"clamped_swiglu"`` (gpt-oss), as :func:`experts`.
        router_bias: optional (E,) bias of the router's logits, X W_rᵀ + b_r (gpt-oss), differentiable.

    Same input contract as :func:`experts` (dtypes, strides, non-finite values, ``torch.autocast``: the experts
    run in the autocast dtype); router_weight may have any of the float dtypes the backend takes, and the router
    computes in float32 whatever autocast says (:func:`~sonicmoe.routing.router_topk`). No host sync: the routing
    comes from the router, so its indices are in range by construction.

    Raises:
        TypeError, ValueError: as :func:`experts`; ValueError for top_k out of range (or not an int).
    """
    backend = resolve_backend(backend, x)
    allow_float64 = backend == "torch"
    # x, w1, w2, biases first: the messages name the culprit
    check_expert_inputs(x, w1, w2, b1, b2, allow_float64=allow_float64)
    e = w1.shape[0]
    check_router_weight(router_weight, x, e, allow_float64)
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up_layout must be one of {GATE_UP_LAYOUTS}, got {gate_up_layout!r}")
    check_activation(activation)
    # router_topk checks router_weight's device and top_k in [1, E]
    router = router_topk(x, router_weight, top_k, router_order=router_order, renormalize=renormalize,
                         expert_bias=expert_bias, n_group=n_group, topk_group=topk_group, router_bias=router_bias)
    routing = routing_from_topk(router.topk_ids, e)
    out = experts(x, w1, w2, routing, scaled_scores(router.topk_scores, routed_scaling_factor), b1, b2,
                  gate_up_layout=gate_up_layout, backend=backend, activation=activation)
    return MoEOutput(out=out, router=router, routing=routing)
