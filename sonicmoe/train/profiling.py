"""Time spent inside the MoE layers, measured on a few dedicated "profiled" steps.

Forward: a forward pre-hook and a forward hook on each :class:`sonicmoe.MoE` bracket its forward.
Backward: a tensor hook on the layer's output fires when its gradient arrives (the layer's backward
starts); a tensor hook on the layer's input fires once the input's gradient is complete (the layer's
backward, router included, is done). Both hooks carry the number of the forward call that registered them: an
end closes only the bracket its own call's start opened, not one that an earlier call's start left open (its
input's gradient never came). On CUDA each hook synchronises the device, so the hooks are only armed on profiled
steps and the other steps run without host syncs.
"""

from __future__ import annotations

import time
from functools import partial

import torch
from torch import nn


class MoEProfiler:
    """Sums the wall time of the MoE layers' forward and backward while :attr:`active`.

    Args:
        layers: the MoE modules to time.
        device: where they run (CUDA is synchronised around each measurement).
    """

    def __init__(self, layers: list[nn.Module], device: torch.device):
        self.active = False
        self.forward_s = 0.0
        self.backward_s = 0.0
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self._fwd_t0: dict[int, tuple[int, float]] = {}  # layer -> (its forward call's number, start time)
        self._bwd_t0: dict[int, tuple[int, float]] = {}
        self._calls = 0  # forward calls seen while armed: each one's hooks carry its number
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(partial(self._pre, i)))
            self._handles.append(layer.register_forward_hook(partial(self._post, i)))

    def reset(self) -> None:
        """Zero the sums (call before a profiled step)."""
        self.forward_s = 0.0
        self.backward_s = 0.0
        self._fwd_t0.clear()
        self._bwd_t0.clear()

    def remove(self) -> None:
        """Detach the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _armed(self) -> bool:
        return self.active and torch.is_grad_enabled()

    def _pre(self, i: int, module: nn.Module, args: tuple) -> None:
        if not self._armed():
            return
        self._calls += 1
        x = args[0]
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(partial(self._backward_end, i, self._calls))
        self._sync()
        self._fwd_t0[i] = (self._calls, time.perf_counter())

    def _post(self, i: int, module: nn.Module, args: tuple, out) -> None:
        if not self._armed() or i not in self._fwd_t0:
            return
        if isinstance(out, tuple):  # MoELayerOutput: a layer with return_router_info=True
            out = out[0]
        call, t0 = self._fwd_t0.pop(i)
        self._sync()
        self.forward_s += time.perf_counter() - t0
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(partial(self._backward_start, i, call))

    def _backward_start(self, i: int, call: int, grad: torch.Tensor) -> None:
        self._sync()
        self._bwd_t0[i] = (call, time.perf_counter())

    def _backward_end(self, i: int, call: int, grad: torch.Tensor) -> None:
        # a start of an earlier call whose backward never ended (its input's gradient never came) is not this one's
        if self._bwd_t0.get(i, (None,))[0] == call:
            self._sync()
            self.backward_s += time.perf_counter() - self._bwd_t0.pop(i)[1]
