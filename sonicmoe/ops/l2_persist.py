"""L2 persistence for the operand that the gather-fused kernels read row by row (experiment, off by default).

The up-projection and dW1 gather rows of X, dH and dW2 rows of dO, each row once per expert it was routed to (K
times). At the 7B shape X and dO are 75 MB each, more than the 50 MB L2 of an H100/H200, so part of those re-reads
go to DRAM (session 22's Nsight Compute run counted about 1.1 GB crossing DRAM in dH, against the 0.69 GB its floor
counts). Triton 3.6 gives the kernels' ``cp.async`` gathers no cache hint (benchmarks/results/2026-11-26_nvidia-h100_
session30/). The hardware's access-policy window does not need one: with ``SONICMOE_L2_PERSIST=1``, :func:`persisting`
marks the gathered tensor's address range as a stream attribute for the kernels launched inside it, so that a share
of its lines (the hit ratio: the L2 set-aside over the tensor's bytes) stays in L2 as persisting lines, the rest
behaving as before. The set-aside (``cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE)``, at most the device's
``MAX_PERSISTING_L2_CACHE_SIZE``, times ``SONICMOE_L2_PERSIST_FRACTION``, default 1) is reserved once per process
on first use; when no persisting lines use it, other accesses do.

Cache policy only: the kernels, and so the bits of every output, are the same either way. Everything goes through
the CUDA driver (``libcuda.so.1``) by ctypes; where any call is missing or fails, :func:`persisting` does nothing.
Host cost: two ``cuStreamSetAttribute`` calls per wrapped launch. Read at each call.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import torch

_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
_ATTR_MAX_PERSISTING_L2_CACHE_SIZE = 108
_ATTR_MAX_ACCESS_POLICY_WINDOW_SIZE = 109
_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
_NORMAL, _PERSISTING = 0, 2


class _Window(ctypes.Structure):
    """CUaccessPolicyWindow."""

    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hit_ratio", ctypes.c_float),
                ("hit_prop", ctypes.c_int), ("miss_prop", ctypes.c_int)]


class _AttrValue(ctypes.Union):
    """CUstreamAttrValue (CUlaunchAttributeValue: 64 bytes)."""

    _fields_ = [("window", _Window), ("pad", ctypes.c_char * 64)]


_STATE = {"pinned": False}


def l2_persist_enabled() -> bool:
    """``SONICMOE_L2_PERSIST`` is set and not 0 (default off; read at each call)."""
    return os.environ.get("SONICMOE_L2_PERSIST", "0") != "0"


@functools.lru_cache(maxsize=8)
def _setup(device_index: int) -> tuple | None:
    """(driver library, set-aside bytes, largest window bytes) once the set-aside is reserved on ``device_index``'s
    primary context (made current by torch), or None where the driver, the attributes or the limit are missing."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        with torch.cuda.device(device_index):
            torch.cuda.current_stream()  # the primary context is current on this thread
            dev = ctypes.c_int()
            max_persist, max_window = ctypes.c_int(), ctypes.c_int()
            if cuda.cuCtxGetDevice(ctypes.byref(dev)) != 0:
                return None
            if cuda.cuDeviceGetAttribute(ctypes.byref(max_persist), _ATTR_MAX_PERSISTING_L2_CACHE_SIZE, dev) != 0:
                return None
            if cuda.cuDeviceGetAttribute(ctypes.byref(max_window), _ATTR_MAX_ACCESS_POLICY_WINDOW_SIZE, dev) != 0:
                return None
            size = int(max_persist.value * float(os.environ.get("SONICMOE_L2_PERSIST_FRACTION", "1")))
            if size <= 0 or max_window.value <= 0:
                return None
            if cuda.cuCtxSetLimit(_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(size)) != 0:
                return None
    except (OSError, AttributeError):
        return None
    return cuda, size, max_window.value


def _set_window(cuda, stream: int, base: int, nbytes: int, hit_ratio: float) -> None:
    value = _AttrValue()
    value.window = _Window(base or None, nbytes, hit_ratio, _PERSISTING if nbytes else _NORMAL, _NORMAL)
    cuda.cuStreamSetAttribute(ctypes.c_void_p(stream), _STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW, ctypes.byref(value))


@contextlib.contextmanager
def persisting(t: torch.Tensor):
    """Kernels launched in the body on the current CUDA stream keep a share of ``t``'s lines in L2 (its first
    ``MAX_ACCESS_POLICY_WINDOW_SIZE`` bytes; hit ratio: the set-aside over those bytes), under
    ``SONICMOE_L2_PERSIST``; otherwise (and off CUDA) nothing happens. With the switch off after it was on, the
    persisting lines are released first (``cuCtxResetPersistingL2Cache``)."""
    info = _setup(t.device.index if t.device.index is not None else torch.cuda.current_device()) if (
        t.is_cuda and l2_persist_enabled()) else None
    if info is None:
        if _STATE["pinned"] and t.is_cuda:
            ctypes.CDLL("libcuda.so.1").cuCtxResetPersistingL2Cache()
            _STATE["pinned"] = False
        yield
        return
    cuda, size, max_window = info
    stream = torch.cuda.current_stream(t.device).cuda_stream
    nbytes = min(t.numel() * t.element_size(), max_window)
    _set_window(cuda, stream, t.data_ptr(), nbytes, min(1.0, size / max(nbytes, 1)))
    _STATE["pinned"] = True
    try:
        yield
    finally:
        _set_window(cuda, stream, 0, 0, 0.0)
