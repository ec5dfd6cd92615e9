"""The L2 access-policy window around the gather-fused kernels (sonicmoe/ops/l2_persist.py): off by default and a
no-op off CUDA. Its effect on the GPU (the same bits either way) is tested in tests/test_kernels.py
(test_gpu_launch_switches_same_bits)."""

from __future__ import annotations

import ctypes

import torch

from sonicmoe.ops import l2_persist


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("SONICMOE_L2_PERSIST", raising=False)
    assert not l2_persist.l2_persist_enabled()
    monkeypatch.setenv("SONICMOE_L2_PERSIST", "0")
    assert not l2_persist.l2_persist_enabled()
    monkeypatch.setenv("SONICMOE_L2_PERSIST", "1")
    assert l2_persist.l2_persist_enabled()


def test_noop_off_cuda(monkeypatch):
    """On a CPU tensor the window is never set, even with the switch on, and the body runs once."""
    monkeypatch.setenv("SONICMOE_L2_PERSIST", "1")
    x = torch.randn(4, 8)
    ran = []
    with l2_persist.persisting(x):
        ran.append(1)
    assert ran == [1] and not l2_persist._STATE["pinned"]


def test_window_struct_layout():
    """CUaccessPolicyWindow: pointer, size_t, float, two enums (32 bytes with padding); the stream attribute value
    is the 64-byte CUlaunchAttributeValue union."""
    assert (ctypes.sizeof(l2_persist._Window), ctypes.sizeof(l2_persist._AttrValue)) == (32, 64)
