"""The CUDA device a call runs on: the inputs', not whichever device happens to be current.

Triton launches every kernel on the *current* CUDA device and its current stream, whereas PyTorch runs an op on its
tensors' device. A layer placed with ``model.to("cuda:1")`` while device 0 is current (no ``torch.cuda.set_device``,
as in a notebook, or a data-parallel script that only moves its model) would otherwise have its kernels launched on
device 0 with pointers into device 1's memory, and on a stream the rest of its step does not wait for. Each public
entry point that launches kernels makes its inputs' device current for the call (:func:`on_device`).
"""

from __future__ import annotations

import contextlib

import torch


def on_device(t: torch.Tensor):
    """A context that makes ``t``'s CUDA device current for its body, or a no-op context when it already is, when
    ``t`` is not a CUDA tensor, or while ``torch.compile`` traces (the compiled code guards its device itself).

    No host-device sync: reading and setting the current device are host-side calls.
    """
    if (isinstance(t, torch.Tensor) and t.is_cuda and not torch.compiler.is_compiling()
            and t.device.index != torch.cuda.current_device()):
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
