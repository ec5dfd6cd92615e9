"""The expert layer on the Triton kernels (SPEC §3 forward, §4 backward).

Under ``torch.compile``, :func:`experts_triton` calls the custom operator ``torch.ops.sonicmoe.experts_fwd``,
whose autograd formula (backward ``sonicmoe::experts_bwd``) and memory contract live in
:mod:`sonicmoe.ops.library` (:func:`sonicmoe.ops.library._setup_context`): forward and backward are single
opaque nodes to the compiler (``fullgraph=True`` works). In eager mode it calls the same implementations
through :class:`sonicmoe.ops.library.ExpertsFunction` (same saved tensors, less host time per call), or, when
no gradient is needed, the forward implementation alone. Neither path synchronises with the host, so a
training step through them can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from ..routing import Routing
from .library import FWD_ROUTING_FIELDS, ExpertsFunction, experts_fwd_impl  # also registers the sonicmoe:: ops


def experts_triton(
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
) -> torch.Tensor:
    """Experts + aggregation on the Triton kernels; same signature as :func:`sonicmoe.experts`.

    With gradients enabled (some input requires grad) the forward writes H (R, 2n) and the autograd
    formula of ``sonicmoe::experts_fwd`` keeps the memory contract. Without (``torch.no_grad``,
    inference) the up-projection skips writing H. Inputs of any strides are accepted; the kernels read
    contiguous copies of the non-contiguous ones, and the backward keeps the caller's X, not a copy (except for
    inputs made under ``torch.inference_mode``, which autograd cannot save: they are copied).

    Args:
        x: (T, d). w1: (E, 2n, d), gate/up layout ``gate_up_layout`` (``"concat"``: rows [0, n) gate,
            [n, 2n) up; ``"interleaved"``: row 2i gate, 2i+1 up). w2: (E, d, n).
        routing: R pairs. pair_scores: (R,). b1: (E, 2n) or None. b2: (E, d) or None.
        activation: ``"swiglu"`` or ``"clamped_swiglu"`` (:func:`sonicmoe.reference.swiglu_ref`), fused into the
            up-projection's epilogue and recomputed in the dH kernel's.
    Returns:
        O (T, d) in x's dtype.
    """
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, w1, w2, b1, b2, pair_scores)
    )
    arrays = [getattr(routing, f) for f in FWD_ROUTING_FIELDS]
    inputs = (x, w1, w2, b1, b2, pair_scores, *arrays, gate_up_layout, needs_grad, routing.tile_rows, activation)
    if torch.compiler.is_compiling():
        out, _ = torch.ops.sonicmoe.experts_fwd(*inputs)
    elif needs_grad:
        try:
            out, _ = ExpertsFunction.apply(*inputs)
        except RuntimeError:
            # tensors made under torch.inference_mode (frozen features, a cached routing) cannot be saved for the
            # backward: it keeps copies of them (as the torch backend, which saves no X, works). Looked at only
            # here, off the hot path (the check costs about 2 us a call)
            n = 6 + len(arrays)
            if not any(t is not None and t.is_inference() for t in inputs[:n]):
                raise
            copies = [t.clone() if t is not None and t.is_inference() else t for t in inputs[:n]]
            out, _ = ExpertsFunction.apply(*copies, *inputs[n:])
    else:
        out, _ = experts_fwd_impl(*inputs)
    return out
