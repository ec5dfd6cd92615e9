"""``torch.autocast`` at the layer's boundary: the dtype the experts run in under autocast, and autocast turned off
inside the layer (the router keeps its float32 logits; the kernels and the torch backend see one dtype)."""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

AUTOCAST_DEVICES = ("cuda", "cpu")


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs matrix products in on ``device``'s type when it is enabled there, else
    None (also for devices autocast does not know, such as ``meta``)."""
    if device.type in AUTOCAST_DEVICES and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def no_autocast(device: torch.device):
    """A context with autocast off for ``device``'s type where it is on (a no-op context otherwise)."""
    if autocast_dtype(device) is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def autocast_cast(dtype: torch.dtype, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Each floating tensor cast to ``dtype`` (differentiably: gradients return in the original dtype), except
    float64 ones, which autocast leaves as they are; None and non-floating arguments pass through."""
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in tensors)


CAST_ARGUMENTS = ("x", "w1", "w2", "b1", "b2")


def casts_under_autocast(fn):
    """Decorator for the functional entry points (:func:`sonicmoe.experts`, :func:`sonicmoe.moe` and the
    expert-parallel ones), whose first argument is X: where ``torch.autocast`` is on for X's device, the arguments
    named X, W1, W2, b1, b2 are cast to its dtype (:func:`autocast_cast`) and ``fn`` runs with autocast off; elsewhere
    ``fn`` runs as called."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        x = args[0] if args else kwargs.get("x")
        if not isinstance(x, torch.Tensor) or (dtype := autocast_dtype(x.device)) is None:
            return fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        for name in CAST_ARGUMENTS:
            if name in bound.arguments:
                bound.arguments[name], = autocast_cast(dtype, bound.arguments[name])
        with torch.autocast(x.device.type, enabled=False):
            return fn(*bound.args, **bound.kwargs)

    return wrapper
