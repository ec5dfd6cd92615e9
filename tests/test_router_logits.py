"""Router logits from bfloat16 operands on the tensor cores (sonicmoe/ops/router_logits.py, SPEC §2).

On CPU the same arithmetic runs through float32 matmuls: the hi/lo split of d logits and the concatenated GEMMs are
checked against float64 truth. On a GPU (``gpu``-marked) the cuBLAS path is checked against the float32 GEMM of the
upcast operands, through ``sonicmoe.router_topk``.
"""

from __future__ import annotations

import pytest
import torch

from sonicmoe.ops import router_logits as rl
from sonicmoe.routing import router_topk
from sonicmoe.testing import rel_err


def _operands(t: int, d: int, e: int, device="cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(e, d, generator=g) / d**0.5).to(device=device, dtype=torch.bfloat16)
    dlogits = torch.randn(t, e, generator=g).to(device) * torch.logspace(-6, 0, e).to(device)  # spread magnitudes
    return x, w, dlogits


def test_split_bf16_keeps_16_bits():
    g = torch.randn(4096, dtype=torch.float32) * torch.logspace(-20, 20, 4096)
    hi, lo = rl.split_bf16(g)
    assert hi.dtype == lo.dtype == torch.bfloat16
    assert torch.equal(hi, g.to(torch.bfloat16))
    err = ((hi.double() + lo.double() - g.double()).abs() / g.double().abs()).max().item()
    assert err <= 2.0**-16
    # hi alone is only bfloat16's 8 bits: the test above would catch a dropped lo part
    assert ((hi.double() - g.double()).abs() / g.double().abs()).max().item() > 2.0**-12


@pytest.mark.parametrize("t,d,e", [(1, 8, 1), (37, 64, 5), (256, 96, 128)])
def test_grads_match_float64(t, d, e):
    """The float32 gradients before their bfloat16 rounding are float32-accurate (the hi/lo split), for T = 1 and
    E = 1 too."""
    x, w, dlogits = _operands(t, d, e)
    dx, dw = rl.logits_grads_f32(dlogits, x, w)
    assert dx.dtype == dw.dtype == torch.float32 and dx.shape == (t, d) and dw.shape == (e, d)
    truth_dx = dlogits.double() @ w.double()
    truth_dw = dlogits.double().t() @ x.double()
    assert rel_err(dx.double(), truth_dx) < 2e-5
    assert rel_err(dw.double(), truth_dw) < 2e-5
    only_x, none_w = rl.logits_grads_f32(dlogits, x, w, need_w=False)
    assert none_w is None and torch.equal(only_x, dx)


def test_function_forward_backward_and_saved_tensors():
    """Forward: the float32 GEMM of the upcast operands; backward: bfloat16 gradients equal to the float64 truth
    rounded once (up to one bfloat16 step); saved for backward: X and W_r themselves."""
    x, w, dlogits = _operands(64, 32, 16, seed=1)
    xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logits = rl.router_logits(xl, wl)
    assert logits.dtype == torch.float32 and logits.shape == (64, 16)
    assert rel_err(logits.double(), x.double() @ w.double().t()) < 1e-6
    saved = logits.grad_fn.saved_tensors
    assert len(saved) == 2 and saved[0].data_ptr() == xl.data_ptr() and saved[1].data_ptr() == wl.data_ptr()
    logits.backward(dlogits)
    assert xl.grad.dtype == w.dtype == wl.grad.dtype == torch.bfloat16
    g, xd, wd = dlogits.double(), x.double(), w.double()
    for got, truth, mag in ((xl.grad, g @ wd, g.abs() @ wd.abs()), (wl.grad, g.t() @ xd, g.abs().t() @ xd.abs())):
        # one bfloat16 rounding of the result, plus the split's 2^-16 of the summed magnitudes (cancellation)
        bound = truth.abs() * 2.0**-8 + mag * 2.0**-15
        assert ((got.double() - truth).abs() <= bound).all()
        assert rel_err(got.double(), truth) < 4e-3


@pytest.mark.parametrize("grad_of", ["x", "w"])
def test_backward_of_one_operand(grad_of):
    """With only X or only W_r requiring a gradient, that one gets the gradient of the call where both do (the
    backward computes only what ``needs_input_grad`` asks for: flags read in the wrong order left it None)."""
    x, w, dlogits = _operands(37, 24, 6, seed=4)
    both = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    rl.router_logits(*both).backward(dlogits)
    one = [x.clone().requires_grad_(grad_of == "x"), w.clone().requires_grad_(grad_of == "w")]
    rl.router_logits(*one).backward(dlogits)
    i = 0 if grad_of == "x" else 1
    assert one[1 - i].grad is None
    assert one[i].grad is not None and torch.equal(one[i].grad, both[i].grad)


def test_validation():
    x, w, _ = _operands(4, 8, 3)
    with pytest.raises(TypeError, match="bfloat16"):
        rl.router_logits(x.float(), w)
    with pytest.raises(ValueError, match=r"\(T, d\) and router_weight \(E, d\)"):
        rl.router_logits(x, w[:, :4])
    with pytest.raises(ValueError, match="one device"):  # the meta device: a second device on any machine
        rl.router_logits(x, w.to("meta"))
    # a batch of token matrices (T, d) or a weight vector is no (T, d) and (E, d): a 3-D x would pass the width
    # check and multiply batch by batch, a 1-D weight fail with an IndexError
    with pytest.raises(ValueError, match=r"\(T, d\) and router_weight \(E, d\)"):
        rl.router_logits(x.reshape(2, 2, 8), w)
    with pytest.raises(ValueError, match=r"\(T, d\) and router_weight \(E, d\)"):
        rl.router_logits(x, w[0])


def test_ref_dtype_follows_x():
    """router_logits_ref computes in x's dtype promoted to float32: a float64 weight beside float32 (or bfloat16) x
    is rounded to float32 and the logits are float32; float64 x gives float64 logits."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, 12, generator=g)
    w = torch.randn(5, 12, generator=g, dtype=torch.float64)
    got = rl.router_logits_ref(x, w)
    assert got.dtype == torch.float32 and torch.equal(got, x @ w.float().t())
    got_bf16 = rl.router_logits_ref(x.bfloat16(), w)
    assert got_bf16.dtype == torch.float32 and torch.equal(got_bf16, x.bfloat16().float() @ w.float().t())
    got64 = rl.router_logits_ref(x.double(), w.float())
    assert got64.dtype == torch.float64 and torch.equal(got64, x.double() @ w.float().double().t())


def test_router_topk_takes_the_float32_gemm_on_cpu():
    """On CPU (and for non-bfloat16 operands) router_topk's logits are the float32 GEMM of the upcast operands."""
    x, w, _ = _operands(16, 8, 6)
    assert not rl.bf16_gemm_applies(x, w)
    out = router_topk(x, w, 2)
    assert torch.equal(out.logits, rl.router_logits_ref(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("t,d,e,k", [(1, 64, 8, 2), (4096, 1536, 128, 8), (1000, 768, 512, 8)])
def test_gpu_router_topk_bf16_gemm(t, d, e, k, monkeypatch):
    """On CUDA with bfloat16 X and W_r, router_topk computes the logits on the tensor cores: logits within float32
    sums of the float32 GEMM, gradients of X and W_r within a bfloat16 step of it, bitwise reproducible."""
    x, w, _ = _operands(t, d, e, device="cuda", seed=2)
    assert rl.bf16_gemm_applies(x, w)

    def run(env: str):
        monkeypatch.setenv("SONICMOE_ROUTER_BF16_GEMM", env)
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = router_topk(xl, wl, k)
        (out.topk_scores.square().sum() + out.probs.mean()).backward()
        return out.logits.detach(), xl.grad, wl.grad

    # the cuBLAS path's float32 gradients before rounding: float32-accurate (a dropped lo part would be ~2e-3 off,
    # inside the bf16-level bounds below)
    dl = torch.randn(t, e, device="cuda") * torch.logspace(-6, 0, e, device="cuda")
    dx32, dw32 = rl.logits_grads_f32(dl, x, w)
    assert rel_err(dx32.double(), dl.double() @ w.double()) < 2e-5
    assert rel_err(dw32.double(), dl.double().t() @ x.double()) < 2e-5
    fast, fast2, slow = run("1"), run("1"), run("0")
    for a, b in zip(fast, fast2):
        assert torch.equal(a, b)
    assert rel_err(fast[0], slow[0]) < 1e-5
    assert rel_err(fast[1].float(), slow[1].float()) < 4e-3
    assert rel_err(fast[2].float(), slow[2].float()) < 4e-3


@pytest.mark.gpu
def test_gpu_router_logits_compiles():
    """torch.compile (fullgraph, aot_eager) of the tensor-core logits and their backward: the eager bits."""
    x, w, dlogits = _operands(512, 256, 64, device="cuda", seed=3)

    def f(x, w):
        return rl.router_logits(x, w)

    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = fn(xl, wl)
        out.backward(dlogits)
        results.append((out.detach(), xl.grad, wl.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
