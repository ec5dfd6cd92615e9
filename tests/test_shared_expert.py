"""The shared expert of MoE (``shared_intermediate_size``, ``shared_expert_gate``: DeepSeek-V2/V3, Qwen2-MoE).

Every token passes through one more SwiGLU MLP of width n_s, whose output, times sigmoid(x · w_g) with the gate, is
added to the routed experts'. It runs on the experts' kernels as one expert every token routes to
(``routing_dense``). The reference here is written out by hand in float64 from the layer's parameters.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sonicmoe import MoE, MoEConfig
from sonicmoe.reference import moe_ref, swiglu_ref
from sonicmoe.routing import routing_dense, routing_from_topk
from sonicmoe.testing import rel_err

D, N, E, K, N_S = 16, 8, 6, 2, 12


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    """Every Triton kernel output starts as NaN (SONICMOE_POISON_OUTPUTS=1): an element no program writes fails."""
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")


def make(seed=0, **kw):
    torch.manual_seed(seed)
    opts = {"hidden_size": D, "intermediate_size": N, "num_experts": E, "top_k": K, "backend": "torch",
            "shared_intermediate_size": N_S}
    opts.update(kw)
    return MoE(**opts)


def rand(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def shared_ref(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """The shared expert of ``m`` on x (T, d) in float64, from its parameters (either gate/up layout)."""
    xd = x.double()
    h = xd @ m.shared_experts.gate_up_proj[0].double().T
    y = swiglu_ref(h, m.config.gate_up_layout, m.config.activation) @ m.shared_experts.down_proj[0].double().T
    if m.shared_expert_gate is not None:
        y = y * torch.sigmoid(xd @ m.shared_expert_gate.weight.double().T)
    return y


def layer_ref(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """The routed experts by moe_ref (the per-expert loop) plus the shared expert by hand, x flattened to (T, d)."""
    c, ex = m.config, m.experts
    x2 = x.reshape(-1, c.hidden_size)
    routed = moe_ref(x2, m.gate.weight, ex.gate_up_proj, ex.down_proj, ex.gate_up_proj_bias, ex.down_proj_bias,
                     top_k=c.top_k, router_order=c.router_order, renormalize=c.renormalize,
                     gate_up_layout=c.gate_up_layout, activation=c.activation)[0]
    return (routed.double() + shared_ref(m, x2)).reshape(x.shape)


def _check_against_ref(m: MoE, x: torch.Tensor, dy: torch.Tensor, tol: float) -> None:
    x = x.requires_grad_(True)
    params = dict(m.named_parameters())
    y = m(x)
    grads = torch.autograd.grad(y, [x, *params.values()], dy)
    ref = layer_ref(m, x)
    grads_ref = torch.autograd.grad(ref, [x, *params.values()], dy.double())
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rel_err(y, ref) < tol
    for name, a, b in zip(["x", *params], grads, grads_ref):
        assert b.norm() > 0, name
        assert rel_err(a, b) < tol, name


@pytest.mark.parametrize("kw,match", [
    ({"shared_intermediate_size": -1}, "shared_intermediate_size"),
    ({"shared_intermediate_size": True}, "shared_intermediate_size"),
    ({"shared_intermediate_size": 4.0}, "shared_intermediate_size"),
    ({"shared_intermediate_size": 0, "shared_expert_gate": True}, "shared_expert_gate"),
    ({"shared_intermediate_size": 4, "shared_expert_gate": 1}, "shared_expert_gate"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(D, N, E, K, **kw)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameters(gated, dtype):
    """Names, shapes, dtypes and nn.Linear's init bounds of the shared expert's parameters; without one the layer has
    exactly the parameters it had before the option existed (old checkpoints still load)."""
    m = make(shared_expert_gate=gated, dtype=dtype)
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items() if k.startswith("shared")}
    want = {"shared_experts.gate_up_proj": (1, 2 * N_S, D), "shared_experts.down_proj": (1, D, N_S)}
    if gated:
        want["shared_expert_gate.weight"] = (1, D)
    assert shapes == want
    for name, fan_in in (("shared_experts.gate_up_proj", D), ("shared_experts.down_proj", N_S)):
        p = m.get_parameter(name)
        assert p.dtype == dtype and p.abs().max() <= 1 / math.sqrt(fan_in) and p.std() > 0.1 / math.sqrt(fan_in)
    assert "shared n_s=12" in repr(m) and ("(gated)" in repr(m)) == gated
    plain = MoE(D, N, E, K)
    assert plain.shared_experts is None and plain.shared_expert_gate is None
    assert not any("shared" in k for k in plain.state_dict())


@pytest.mark.parametrize("t", [0, 1, 5])
def test_routing_dense(t):
    """routing_dense(T) is routing_from_topk of every token to expert 0."""
    a, b = routing_dense(t, "cpu"), routing_from_topk(torch.zeros(t, 1, dtype=torch.int64), 1)
    assert (a.num_tokens, a.num_experts, a.num_rows, a.slot_pair, a.padded) == (t, 1, t, None, False)
    for field in ("expert_offsets", "row_token", "row_pair", "pair_row", "token_offsets", "token_rows"):
        u, v = getattr(a, field), getattr(b, field)
        assert u.dtype == v.dtype == torch.int32 and u.is_contiguous() and torch.equal(u, v), field
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="num_tokens"):
            routing_dense(bad)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_torch_backend_matches_reference(gated, layout):
    """float64 parameters on the torch backend: output and the gradients of x and every parameter (the shared
    expert's and its gate's included) against the hand-written float64 reference, at float64 precision."""
    m = make(seed=1, shared_expert_gate=gated, gate_up_layout=layout, bias=True, dtype=torch.float64)
    _check_against_ref(m, rand(3, 5, D, seed=2).double(), rand(3, 5, D, seed=3).double(), 1e-12)


@pytest.mark.interpreter
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_triton_backend_matches_reference(gated, layout, device):
    """The triton backend (natively on CUDA, through the interpreter on CPU), float32, n_s = 20 (not a tile
    multiple) and 33 tokens: output and every gradient against the float64 reference; a second run gives the same
    bits."""
    m = make(seed=4, backend="triton", shared_intermediate_size=20, shared_expert_gate=gated,
             gate_up_layout=layout).to(device)
    x, dy = rand(33, D, seed=5).to(device), rand(33, D, seed=6).to(device)
    _check_against_ref(m, x.clone(), dy, 1e-5)
    runs = []
    for _ in range(2):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        runs.append([y, *torch.autograd.grad(y, [xi, *m.parameters()], dy)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.interpreter
def test_fp16_gate_sigmoid_in_float32(device):
    """float16 parameters on the triton backend: the gate's logit is the fp16 GEMM, its sigmoid float32 (the
    aggregation multiplies by the score in float32): the layer's output is, bit for bit, the routed experts plus the
    shared expert with those float32 scores, not with scores rounded to float16."""
    import sonicmoe
    from sonicmoe.routing import router_topk

    m = make(seed=int(torch.randint(0, 2**31 - 1, ())), backend="triton", shared_expert_gate=True,
             dtype=torch.float16).to(device)
    x = rand(13, D, seed=20).to(device=device, dtype=torch.float16)
    y = m(x)
    ex, se, w_g = m.experts, m.shared_experts, m.shared_expert_gate.weight
    router = router_topk(x, m.gate.weight, K)
    routed = sonicmoe.experts(x, ex.gate_up_proj, ex.down_proj, routing_from_topk(router.topk_ids, E),
                              router.topk_scores.reshape(-1), backend="triton")
    g = torch.sigmoid(F.linear(x, w_g).reshape(-1).float())
    assert g.dtype == torch.float32 and not torch.equal(g, g.half().float())  # the rounding would show
    shared = sonicmoe.experts(x, se.gate_up_proj, se.down_proj, routing_dense(13, device), g, backend="triton")
    assert y.dtype == torch.float16 and torch.equal(y, routed + shared)


@pytest.mark.interpreter
@pytest.mark.parametrize("t", [0, 1])
def test_few_tokens_on_triton(t, device):
    """T = 0 and T = 1 through the shared expert on the triton backend."""
    m = make(seed=7, backend="triton", shared_expert_gate=True).to(device)
    x = rand(t, D, seed=8).to(device).requires_grad_(True)
    y = m(x)
    assert y.shape == (t, D)
    y.backward(rand(t, D, seed=9).to(device))
    assert x.grad.shape == (t, D) and m.shared_experts.gate_up_proj.grad.shape == (1, 2 * N_S, D)
    if t:
        torch.testing.assert_close(y.double(), layer_ref(m, x), rtol=1e-5, atol=1e-6)


@pytest.mark.interpreter
def test_backward_keeps_x_and_h_only(device):
    """The memory contract: the shared expert adds to what backward keeps its H_s (T, 2n_s), the (T,) gate and
    scores, routing metadata and the weights; no (T, n_s) activation and no (T, d) tensor but x itself."""
    t = 7
    x = rand(t, D, seed=10).to(device).requires_grad_(True)
    saved = {}
    for shared in (0, N_S):
        m = make(seed=11, backend="triton", shared_intermediate_size=shared, shared_expert_gate=bool(shared),
                 aux_loss_coef=0.0).to(device)
        saved[shared] = kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda s, kept=kept: kept.append(s) or s, lambda s: s):
            m(x)
    with_shapes = sorted(tuple(s.shape) for s in saved[N_S])
    for s in saved[0]:
        with_shapes.remove(tuple(s.shape))
    assert (t, 2 * N_S) in with_shapes
    assert not any(shape[0] == t and len(shape) == 2 and shape[1] not in (1, 2 * N_S, D) for shape in with_shapes)
    x_sized = [s for s in saved[N_S] if tuple(s.shape) == (t, D)]
    assert x_sized and all(s.data_ptr() == x.data_ptr() for s in x_sized)


def test_out_of_routing_statistics():
    """The shared expert stays out of the router's statistics: the same expert_counts and aux_loss as the layer
    without it (same router weight)."""
    plain, shared = make(seed=12, shared_intermediate_size=0), make(seed=12)
    shared.gate.weight.data.copy_(plain.gate.weight)
    x = rand(9, D, seed=13)
    plain(x), shared(x)
    assert torch.equal(plain.expert_counts, shared.expert_counts) and torch.equal(plain.aux_loss, shared.aux_loss)
    assert int(shared.expert_counts.sum()) == 9 * K


def test_meta_and_does_not_mutate():
    m = make(device="meta", shared_expert_gate=True)
    assert m(torch.empty(4, D, device="meta")).shape == (4, D)
    m = make(seed=14, shared_expert_gate=True)
    x = rand(6, D, seed=15)
    before = x.clone()
    m(x).sum().backward()
    assert torch.equal(x, before)


def test_under_cpu_autocast_matches_cast_by_hand():
    """float32 parameters under torch.autocast(bf16): the shared expert and its gate run in bf16 on bf16 copies of
    their weights, as the routed experts do (the sum is the cast-by-hand layer's, bit for bit); float32 gradients."""
    import sonicmoe
    from sonicmoe.routing import router_topk

    m = make(seed=17, shared_expert_gate=True)
    x = rand(10, D, seed=18).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    xh, ex, se = x.detach().bfloat16(), m.experts, m.shared_experts
    router = router_topk(xh, m.gate.weight.detach(), K)
    routed = sonicmoe.experts(xh, ex.gate_up_proj.detach().bfloat16(), ex.down_proj.detach().bfloat16(),
                              routing_from_topk(router.topk_ids, E), router.topk_scores.reshape(-1), backend="torch")
    g = torch.sigmoid(F.linear(xh, m.shared_expert_gate.weight.detach().bfloat16()).reshape(-1).float())
    shared = sonicmoe.experts(xh, se.gate_up_proj.detach().bfloat16(), se.down_proj.detach().bfloat16(),
                              routing_dense(10), g, backend="torch")
    assert torch.equal(y, routed + shared)
    y.float().square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad.dtype == torch.float32 and p.grad.norm() > 0, name


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_bf16_layer_with_shared_expert(gated):
    """bf16 on the GPU at a modest shape (d = 512, n = 128, E = 16, K = 4, n_s = 256, T = 1000): output and the
    gradients of x and every parameter against the float64 reference built from the same bf16 parameters."""
    torch.manual_seed(16)
    m = MoE(512, 128, 16, 4, shared_intermediate_size=256, shared_expert_gate=gated, backend="triton",
            device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1000, 512, device="cuda").to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(1000, 512, device="cuda").to(torch.bfloat16)
    params = dict(m.named_parameters())
    y = m(x)
    grads = torch.autograd.grad(y, [x, *params.values()], dy)
    ref = layer_ref(m, x)
    grads_ref = torch.autograd.grad(ref, [x, *params.values()], dy.double())
    assert rel_err(y, ref) < 2e-2
    for name, a, b in zip(["x", *params], grads, grads_ref):
        assert rel_err(a, b) < 2e-2, name


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_shared_expert_takes_the_layers_activation(layout):
    """activation="clamped_swiglu" (gpt-oss's) applies to the shared expert as to the routed ones: the layer's output
    and gradients against the float64 reference with that activation in both, with inputs large enough (x·4) that
    the clamp at 7 and the (up + 1)·σ(1.702·gate) form both differ from plain SwiGLU's."""
    m = make(seed=3, activation="clamped_swiglu", gate_up_layout=layout, shared_expert_gate=True)
    with torch.no_grad():
        m.shared_experts.gate_up_proj.mul_(4.0)
    x = rand(20, D, seed=4) * 4
    with torch.no_grad():
        h = x.double() @ m.shared_experts.gate_up_proj[0].double().T
        assert float(h.abs().max()) > 7  # the clamp binds
        plain = swiglu_ref(h, layout) @ m.shared_experts.down_proj[0].double().T
        gate = torch.sigmoid(x.double() @ m.shared_expert_gate.weight.double().T)
        assert rel_err(shared_ref(m, x), plain * gate) > 0.1  # the activations really differ here
    _check_against_ref(m, x, rand(20, D, seed=5), 1e-5)
