"""Activations past 2^31 elements: every kernel's offsets must be 64-bit.

At T = 163840, d = 2048, n = 1024, E = K = 8 the layer has R = T·K = 1,310,720 rows, so its (R, 2n) tensors H and dH
and its (R, d) tensors Y and dX̃ hold 2.68e9 elements each, past the int32 range. Rows are grouped by expert and every
token has a row in every expert, so each token's row of expert 7 starts past element 2^31 of those tensors; a 32-bit
offset would wrap into another row (a wrong answer) or out of the buffer (an illegal address).

The check: the output and gradients of a few tokens, the first and the last ones, against the float64 reference
(``sonicmoe.moe_ref``) run on those tokens alone. Each token's output and input gradient depend on that token only
(top-k routing is per token), and the upstream gradient dO is zero on every other token, so the weight and router
gradients come from the checked tokens alone as well (the other tokens' rows add exact zeros to them).
"""

from __future__ import annotations

import pytest
import torch

from sonicmoe.testing import layer_grads, random_problem, reference_grads, rel_err

T, D, N, E, K = 163840, 2048, 1024, 8, 8
CHECKED = torch.cat([torch.arange(64), torch.arange(T - 64, T)])


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("gluon", ["1", "0"], ids=["default", "triton-only"])
def test_layer_past_int32_offsets(gluon, monkeypatch):
    """bf16 on the GPU, with the default kernels (Gluon where they apply on Hopper) and with the Triton kernels alone:
    within 2x the torch backend's bf16 error of the float64 reference, on the checked tokens."""
    monkeypatch.setenv("SONICMOE_GLUON", gluon)
    assert T * K * 2 * N > 2**31 and T * K * D > 2**31
    p = random_problem(T, D, N, E, device="cuda", seed=5)
    rows = CHECKED.cuda()
    dout = torch.zeros(T, D, device="cuda")
    dout[rows] = torch.randn(len(CHECKED), D, generator=torch.Generator().manual_seed(6)).cuda()
    out, grads = layer_grads(p, dout, K)
    out, grads["x"] = out[rows], grads["x"][rows]
    small = {**p, "x": p["x"][rows]}
    ref, ref_grads = reference_grads(small, dout[rows], K, rounded_to=torch.bfloat16)
    tout, tgrads = layer_grads(small, dout[rows], K, backend="torch")
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 2 * rel_err(tout, ref) + 1e-3
    assert rel_err(out, ref) < 1e-2
    assert grads.keys() == ref_grads.keys()
    for key in grads:
        assert rel_err(grads[key], ref_grads[key]) <= 2 * rel_err(tgrads[key], ref_grads[key]) + 2e-3, key
