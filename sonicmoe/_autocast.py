"""``torch.autocast`` at the layer's boundary: the dtype the experts run in under autocast, and autocast turned off
inside the layer (the router keeps its float32 logits; the kernels and the torch backend see one dtype)."""

from __future__ import annotations

import contextlib

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
