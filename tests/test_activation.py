"""gpt-oss's clamped SwiGLU (``activation="clamped_swiglu"``) on every path: the reference's formula and its
gradient at the clamps' bounds, the Triton kernels (the interpreter on CPU; bf16 on a GPU) and the torch backend
against the float64 reference, the layer, the custom ops and the errors.

Inputs are scaled so that the clamps bind on a sizeable share of H (checked), or the tests could not tell the
clamped activation from SwiGLU. Kernel outputs are poisoned with NaN before launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sonicmoe
from sonicmoe.config import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT, MoEConfig
from sonicmoe.ops import library
from sonicmoe.ops.dh import dh, dh_ref
from sonicmoe.ops.library import BWD_ROUTING_FIELDS
from sonicmoe.ops.up_proj import up_proj, up_proj_ref
from sonicmoe.reference import experts_ref, moe_ref, split_gate_up, swiglu_ref
from sonicmoe.routing import routing_from_pairs, routing_from_topk
from sonicmoe.testing import random_problem, rel_err

LAYOUTS = ("concat", "interleaved")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")


def _gpt_oss_glu(h: torch.Tensor, layout: str) -> torch.Tensor:
    """transformers' GptOssExperts activation written out with torch.where (not the reference's clamp calls)."""
    gate, up = split_gate_up(h, layout)
    gate = torch.where(gate > 7.0, torch.full_like(gate, 7.0), gate)
    up = torch.where(up > 7.0, torch.full_like(up, 7.0), torch.where(up < -7.0, torch.full_like(up, -7.0), up))
    return (up + 1) * gate * torch.sigmoid(gate * 1.702)


def _clamp_shares(h: torch.Tensor, layout: str) -> tuple[float, float]:
    g, u = split_gate_up(h.float(), layout)
    return (g > 7).float().mean().item(), (u.abs() > 7).float().mean().item()


def test_constants_are_gpt_oss():
    assert (CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT) == (1.702, 7.0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_formula_and_gradient_at_the_bounds(layout):
    g = torch.tensor([-9.0, -7.0, -1.5, 0.0, 2.0, 7.0, 7.5, 30.0], dtype=torch.float64)
    u = torch.tensor([-30.0, -7.5, -7.0, -0.5, 0.0, 6.9, 7.0, 7.5], dtype=torch.float64)
    gg, uu = torch.meshgrid(g, u, indexing="ij")
    gg, uu = gg.reshape(-1, 1), uu.reshape(-1, 1)
    h = torch.cat([gg, uu], 1) if layout == "concat" else torch.stack([gg, uu], 2).reshape(-1, 2)
    h.requires_grad_(True)
    a = swiglu_ref(h, layout, "clamped_swiglu")
    torch.testing.assert_close(a, _gpt_oss_glu(h, layout), rtol=0, atol=1e-15)
    (dh_,) = torch.autograd.grad(a.sum(), h)
    dg, du = split_gate_up(dh_, layout)
    dg, du = dg.reshape(-1), du.reshape(-1)
    gf, uf = gg.reshape(-1), uu.reshape(-1)
    # no gradient where a clamp binds; at the bounds themselves torch.clamp passes it
    assert (dg[gf > 7] == 0).all() and (dg[(gf <= 7) & (uf > -8)] != 0).all()
    assert (du[uf.abs() > 7] == 0).all() and (du[(uf.abs() <= 7) & (gf != 0)] != 0).all()
    # the closed forms the kernels use (sonicmoe.ops.kernel_lib.gated_act_bwd)
    gc, uc = gf.clamp(max=7), uf.clamp(-7, 7)
    s = torch.sigmoid(1.702 * gc)
    torch.testing.assert_close(dg, torch.where(gf <= 7, (uc + 1) * (s + 1.702 * gc * s * (1 - s)), 0.0))
    torch.testing.assert_close(du, torch.where(uf.abs() <= 7, gc * s, 0.0))
    # below the bounds it is not SwiGLU (the + 1 and the 1.702)
    assert (swiglu_ref(h, layout, "swiglu") - a).abs().max() > 1


def test_reference_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation"):
        swiglu_ref(torch.randn(2, 4), "concat", "gelu")


def _problem(device, bias, seed, t=37, d=24, n=40, e=4, dtype=torch.float32):
    """T, n not tile multiples; scale 2.5 makes H's spread about 6, so both clamps bind often."""
    return random_problem(t, d, n, e, bias=bias, device=device, seed=seed, scale=2.5, dtype=dtype)


def _routing(p, k, device, empty_expert=True):
    t, e = p["x"].shape[0], p["w1"].shape[0]
    g = torch.Generator().manual_seed(11)
    ids = torch.stack([torch.randperm(e - int(empty_expert), generator=g)[:k] for _ in range(t)])
    return routing_from_topk(ids.to(device), e)  # with empty_expert, expert E - 1 gets no token


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_kernels_match_reference(layout, bias, device):
    """up_proj's A and dh's dH, A′, dS against their float32 twins with the clamped activation (and not SwiGLU's)."""
    p = _problem(device, bias, seed=1)
    routing = _routing(p, 2, device)
    h, a = up_proj(p["x"], p["w1"], p["b1"], routing, layout, activation="clamped_swiglu")
    h_ref, a_ref = up_proj_ref(p["x"], p["w1"], p["b1"], routing, layout, activation="clamped_swiglu")
    shares = _clamp_shares(h, layout)
    assert min(shares) > 0.05, shares
    assert rel_err(h, h_ref) < 1e-5 and rel_err(a, a_ref) < 1e-5
    _, a_swiglu = up_proj_ref(p["x"], p["w1"], p["b1"], routing, layout)
    assert rel_err(a, a_swiglu) > 0.1
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(p["x"].shape, generator=g).to(device)
    scores = torch.rand(routing.num_rows, generator=g).to(device)
    got = dh(dout, p["w2"], h, scores, routing, layout, activation="clamped_swiglu")
    ref = dh_ref(dout, p["w2"], h, scores, routing, layout, activation="clamped_swiglu")
    for x, y in zip(got, ref):
        assert rel_err(x, y) < 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dh_kernel_at_the_clamp_bounds(layout, device):
    """H holding the bounds exactly (gate 7, up ±7: gradient passed) and values just past them (none passed):
    the dH kernel's masks agree with torch.clamp's, element for element."""
    p = _problem(device, False, seed=12, t=16, d=16, n=32, e=2)
    routing = _routing(p, 1, device, empty_expert=False)
    vals = torch.tensor([7.0, -7.0, 7.0078125, -7.0078125, 6.9921875, 0.5, -3.0, 12.0])
    h = vals[torch.randint(0, 8, (routing.num_rows, 64), generator=torch.Generator().manual_seed(13))].to(device)
    dout = torch.randn(16, 16, generator=torch.Generator().manual_seed(14)).to(device)
    scores = torch.rand(routing.num_rows, generator=torch.Generator().manual_seed(15)).to(device)
    got = dh(dout, p["w2"], h, scores, routing, layout, activation="clamped_swiglu")
    ref = dh_ref(dout, p["w2"], h, scores, routing, layout, activation="clamped_swiglu")
    g, u = split_gate_up(h, layout)
    dg, du = split_gate_up(got[0], layout)
    assert ((dg == 0) == (g > 7)).all() and ((du == 0) == (u.abs() > 7)).all()
    for x, y in zip(got, ref):
        assert rel_err(x, y) < 1e-5


def _grads(fn, leaves, dout):
    leaves = [v.detach().clone().requires_grad_(True) for v in leaves]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return out.detach(), grads


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_experts_match_reference(layout, bias, backend, device):
    """sonicmoe.experts with the clamped activation: O and the gradients of x, W1, W2, the scores and the biases
    against the float64 reference; two runs bitwise equal."""
    p = _problem(device, bias, seed=2)
    routing = _routing(p, 2, device)
    scores = torch.rand(routing.num_rows, generator=torch.Generator().manual_seed(4)).to(device)
    dout = torch.randn(p["x"].shape, generator=torch.Generator().manual_seed(5)).to(device)
    leaves = [p["x"], p["w1"], p["w2"], scores] + ([p["b1"], p["b2"]] if bias else [])

    def ours(x, w1, w2, s, b1=None, b2=None):
        return sonicmoe.experts(x, w1, w2, routing, s, b1, b2, gate_up_layout=layout, backend=backend,
                                activation="clamped_swiglu")

    def ref(x, w1, w2, s, b1=None, b2=None):
        return experts_ref(x, w1, w2, routing, s, b1, b2, gate_up_layout=layout, activation="clamped_swiglu")

    out, grads = _grads(ours, leaves, dout)
    out_ref, grads_ref = _grads(ref, [v.double() for v in leaves], dout.double())
    tol = 1e-5 if device.type == "cpu" else 1e-4
    assert rel_err(out, out_ref) < tol
    for name, g_, g_ref in zip(("x", "w1", "w2", "scores", "b1", "b2"), grads, grads_ref):
        assert rel_err(g_, g_ref) < tol, name
    out2, grads2 = _grads(ours, leaves, dout)
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


def test_reference_rounding_of_h_is_straight_through():
    """experts_ref(h_dtype=bf16) rounds H before the activation and passes gradients straight through: its output is
    the activation of the rounded H, and with a float32 h_dtype it equals the plain reference bit for bit."""
    p = _problem("cpu", True, seed=18, t=9, e=3)
    routing = _routing(p, 2, "cpu")
    s = torch.rand(routing.num_rows, generator=torch.Generator().manual_seed(19))
    args = (p["x"], p["w1"], p["w2"], routing, s, p["b1"], p["b2"])
    plain = experts_ref(*args, activation="clamped_swiglu")
    assert torch.equal(experts_ref(*args, activation="clamped_swiglu", h_dtype=torch.float32), plain)
    rounded = experts_ref(*args, activation="clamped_swiglu", h_dtype=torch.bfloat16)
    assert 1e-4 < rel_err(rounded, plain) < 2e-2
    w1 = p["w1"].clone().requires_grad_(True)
    experts_ref(p["x"], w1, *args[2:], activation="swiglu", h_dtype=torch.bfloat16).sum().backward()
    assert w1.grad is not None and w1.grad.abs().sum() > 0
    for bad in (torch.int32, "bfloat16"):  # an integer dtype truncated H, silently
        with pytest.raises(TypeError, match="h_dtype must be None or a floating torch.dtype"):
            experts_ref(*args, h_dtype=bad)


def test_reference_rounds_h_after_its_bias():
    """experts_ref(h_dtype=bf16) rounds H = x W1ᵀ + b1, bias included (the H the kernels store), to bf16: a per-pair
    loop written out here in float64 from that rounded H gives its output, and one that rounds x W1ᵀ before adding
    b1 does not. x and W1 are multiples of 1/4 and 1/8, so x W1ᵀ is exact in float32 in any summation order and H
    (after the one float32 rounding of + b1) is the same float32 in both: the bf16 roundings agree bit for bit."""
    t, d, n, e, k = 9, 24, 8, 3, 2
    g = torch.Generator().manual_seed(20)
    x = torch.randint(-4, 5, (t, d), generator=g).float() / 4
    w1 = torch.randint(-4, 5, (e, 2 * n, d), generator=g).float() / 8
    w2 = torch.randn(e, d, n, generator=g) / n**0.5
    b1, b2 = torch.randn(e, 2 * n, generator=g) * 2, torch.randn(e, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    s = torch.rand(t * k, generator=g) + 0.1  # pair t·K + j: (token t, expert ids[t, j])
    got = experts_ref(x, w1, w2, routing_from_topk(ids, e), s, b1, b2, activation="clamped_swiglu",
                      h_dtype=torch.bfloat16)

    def loop(bias_first: bool) -> torch.Tensor:
        out = torch.zeros(t, d, dtype=torch.float64)
        for tok in range(t):
            for j in range(k):
                ex = int(ids[tok, j])
                h = x[tok] @ w1[ex].t()  # exact
                h = (h + b1[ex]).bfloat16() if bias_first else h.bfloat16().double() + b1[ex].double()
                a = _gpt_oss_glu(h.double()[None], "concat")[0]
                out[tok] += float(s[tok * k + j]) * (w2[ex].double() @ a + b2[ex].double())
        return out

    assert rel_err(got, loop(bias_first=True)) < 1e-6
    assert rel_err(got, loop(bias_first=False)) > 1e-4  # the order is visible at these sizes


@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu"])
def test_reference_rounding_gradient_is_straight_through_exactly(activation):
    """experts_ref(h_dtype=bf16)'s gradients are the straight-through ones, exactly: dH at the rounded H passed to H
    unrounded (a gradient that went back through the cast would be rounded to bf16 itself, about 4e-3 off). A float64
    per-pair loop here takes dH from the rounded H as a leaf and builds dx, dW1 and db1 from it by hand."""
    t, d, n, e, k = 7, 12, 6, 3, 2
    p = _problem("cpu", True, seed=23, t=t, d=d, n=n, e=e, dtype=torch.float64)
    g = torch.Generator().manual_seed(24)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    s = torch.rand(t * k, generator=g, dtype=torch.float64) + 0.1  # pair t·K + j: (token t, expert ids[t, j])
    dout = torch.randn(t, d, generator=g, dtype=torch.float64)
    names = ("x", "w1", "b1")
    leaves = [p[k_].clone().requires_grad_(True) for k_ in names]
    out = experts_ref(leaves[0], leaves[1], p["w2"], routing_from_topk(ids, e), s, leaves[2], p["b2"],
                      gate_up_layout="interleaved", activation=activation, h_dtype=torch.bfloat16)
    got = torch.autograd.grad(out, leaves, dout)
    want = [torch.zeros_like(p[k_]) for k_ in names]
    h_moved = 0
    for tok in range(t):
        for j in range(k):
            ex = int(ids[tok, j])
            h = p["w1"][ex] @ p["x"][tok] + p["b1"][ex]
            hr = h.bfloat16().double().requires_grad_(True)
            h_moved += int((hr != h).sum())
            y = p["w2"][ex] @ swiglu_ref(hr[None], "interleaved", activation)[0] + p["b2"][ex]
            (dh_,) = torch.autograd.grad(float(s[tok * k + j]) * (y * dout[tok]).sum(), hr)
            want[0][tok] += p["w1"][ex].t() @ dh_
            want[1][ex] += torch.outer(dh_, p["x"][tok])
            want[2][ex] += dh_
    assert h_moved > t * k * n  # the rounding is not a no-op
    for name, a, b in zip(names, got, want):
        assert b.norm() > 0 and rel_err(a, b) < 1e-12, name


def test_experts_with_no_rows_and_padding_pairs(device):
    """A general routing whose token 0 has no pair and whose last pairs are padding: the clamped activation of the
    zero padding rows is 0 (as SwiGLU's), and the reference agrees."""
    p = _problem(device, True, seed=6, t=9, e=3)
    tok = torch.tensor([3, 1, 8, 2, 2, 5, 9, 9], device=device)  # the last two: padding pairs (token T, expert E)
    exp = torch.tensor([0, 2, 2, 1, 0, 0, 3, 3], device=device)
    routing = routing_from_pairs(tok, exp, 9, 3, padding=True)
    s = torch.rand(routing.num_rows, generator=torch.Generator().manual_seed(7)).to(device)
    for backend in ("triton", "torch"):
        out = sonicmoe.experts(p["x"], p["w1"], p["w2"], routing, s, p["b1"], p["b2"], backend=backend,
                               activation="clamped_swiglu")
        ref = experts_ref(p["x"], p["w1"], p["w2"], routing, s, p["b1"], p["b2"], activation="clamped_swiglu")
        assert rel_err(out, ref) < 1e-5, backend
        assert not out[[0, 4, 6, 7]].any()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_nan_token_stays_nan(backend, device):
    """A NaN in one token's x reaches that token's output only, NaN (the clamps keep NaN, as torch.clamp does: the
    GPU's default min/max would return the bound and give a finite output there); the other tokens match the
    reference."""
    p = _problem(device, True, seed=16, t=12, e=3)
    x = p["x"].clone()
    x[3, 5] = float("nan")
    routing = _routing(p, 2, device, empty_expert=False)
    s = torch.rand(routing.num_rows, generator=torch.Generator().manual_seed(17)).to(device)
    out = sonicmoe.experts(x, p["w1"], p["w2"], routing, s, p["b1"], p["b2"], backend=backend,
                           activation="clamped_swiglu")
    assert torch.isnan(out[3]).all()
    keep = [i for i in range(12) if i != 3]
    ref = experts_ref(p["x"], p["w1"], p["w2"], routing, s, p["b1"], p["b2"], activation="clamped_swiglu")
    assert rel_err(out[keep], ref[keep]) < 1e-5


def test_layer_matches_reference_and_backends_agree(device):
    """MoE(activation="clamped_swiglu") with expert biases and the interleaved layout (gpt-oss's), both backends,
    against moe_ref; the option is kept in the config and the repr."""
    torch.manual_seed(0)
    layer = sonicmoe.MoE(24, 40, 4, 2, activation="clamped_swiglu", bias=True, gate_up_layout="interleaved",
                         aux_loss_coef=0.0, device=device)
    assert layer.config.activation == "clamped_swiglu" and "activation=clamped_swiglu" in repr(layer)
    with torch.no_grad():
        for prm in layer.experts.parameters():
            prm.mul_(2.5)
    x = 2.5 * torch.randn(33, 24, device=device)
    ex = layer.experts
    ref, _, _ = moe_ref(x, layer.gate.weight, ex.gate_up_proj, ex.down_proj, ex.gate_up_proj_bias,
                        ex.down_proj_bias, top_k=2, gate_up_layout="interleaved", activation="clamped_swiglu")
    outs = {}
    for backend in ("triton", "torch"):
        object.__setattr__(layer.config, "backend", backend)
        outs[backend] = layer(x)
        assert rel_err(outs[backend], ref) < 1e-5, backend
    swiglu = sonicmoe.MoE(24, 40, 4, 2, bias=True, gate_up_layout="interleaved", aux_loss_coef=0.0, device=device)
    swiglu.load_state_dict(layer.state_dict())
    assert rel_err(swiglu(x), ref) > 0.1


def test_bad_activation_is_named():
    with pytest.raises(ValueError, match="activation must be one of"):
        sonicmoe.MoE(8, 8, 2, 1, activation="gelu")
    with pytest.raises(ValueError, match="activation must be one of"):
        MoEConfig(8, 8, 2, 1, activation="relu")
    p = random_problem(4, 8, 8, 2, seed=0)
    routing = routing_from_topk(torch.zeros(4, 1, dtype=torch.long), 2)
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match="activation must be one of"):
            sonicmoe.experts(p["x"], p["w1"], p["w2"], routing, torch.ones(4), backend=backend, activation="silu")
    with pytest.raises(ValueError, match="activation must be one of"):
        sonicmoe.moe(p["x"], p["router_weight"], p["w1"], p["w2"], top_k=1, activation=None)


def test_kernel_ops_name_an_unknown_activation():
    """The kernels' ACT codes (0 SwiGLU, 1 clamped); the up-projection and dH ops called directly (no layer check
    before them) refuse another activation with a ValueError naming it, not a KeyError, before any launch; a list
    too (unhashable: the lookup's TypeError before the mutation audit up18_)."""
    from sonicmoe.ops.common import act_code

    assert (act_code("swiglu"), act_code("clamped_swiglu")) == (0, 1)
    p = random_problem(4, 8, 8, 2, seed=0)
    routing = routing_from_topk(torch.zeros(4, 1, dtype=torch.long), 2)
    h = torch.randn(4, 16)
    calls = {"act_code": lambda: act_code("gelu"),
             "up_proj": lambda: up_proj(p["x"], p["w1"], None, routing, activation="gelu"),
             "dh": lambda: dh(torch.randn(4, 8), p["w2"], h, torch.ones(4), routing, activation="gelu")}
    for call in calls.values():
        with pytest.raises(ValueError, match=r"activation must be one of \('swiglu', 'clamped_swiglu'\), got 'gelu'"):
            call()
    listed = {"act_code": lambda: act_code(["swiglu"]),
              "up_proj": lambda: up_proj(p["x"], p["w1"], None, routing, activation=["swiglu"]),
              "dh": lambda: dh(torch.randn(4, 8), p["w2"], h, torch.ones(4), routing, activation=["swiglu"])}
    for call in listed.values():
        with pytest.raises(ValueError, match=r"activation must be one of .*, got \['swiglu'\]"):
            call()


@pytest.mark.interpreter
def test_opcheck_with_the_clamped_activation(device):
    """The custom ops take the activation as their last argument (schema, fake, autograd with it)."""
    from tests.test_library import _fwd_args, _topk_routing

    p = _problem(device, True, seed=8, t=7, d=16, n=8, e=3)
    args = (*_fwd_args(p, _topk_routing(p), "interleaved", True), 0, "clamped_swiglu")
    torch.library.opcheck(library.experts_fwd, args)
    out, _ = library.experts_fwd(*args)
    plain, _ = library.experts_fwd(*args[:-1])
    assert rel_err(out, plain) > 0.05  # the argument reaches the kernels
    routing = _topk_routing(p)
    g = torch.Generator().manual_seed(2)
    h = 6 * torch.randn(routing.num_rows, 2 * 8, generator=g).to(device)
    bwd = (torch.randn(7, 16, generator=g).to(device), p["x"], p["w1"], p["w2"], p["b1"], p["b2"], h,
           torch.rand(routing.num_rows, generator=g).to(device), *(getattr(routing, f) for f in BWD_ROUTING_FIELDS),
           "concat", [True] * 6, "clamped_swiglu")
    torch.library.opcheck(library.experts_bwd, bwd)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,gluon", [("concat", "1"), ("concat", "0"), ("interleaved", "1")])
def test_gpu_bf16_layer_clamped(layout, gluon, monkeypatch):
    """bf16 on the GPU at a shape where sm_90 runs the Gluon up-projection and dH kernels (SONICMOE_GLUON_UP=all):
    the clamped activation in their epilogues (SONICMOE_GLUON_CLAMPED=1 and the concat layout: checked that both
    ran) or in the Triton kernels' (=0, or the interleaved layout, which the Gluon kernels do not take): O and the
    gradients against the float64 reference of the bf16 weights with H rounded as the kernels store it; a NaN
    token's output NaN, the others finite."""
    from sonicmoe.ops import dh as dh_module
    from sonicmoe.ops import dh_ws, grouped_gemm_ws, up_proj_ws
    from sonicmoe.ops import up_proj as up_module

    monkeypatch.setenv("SONICMOE_GLUON_UP", "all")
    monkeypatch.setenv("SONICMOE_GLUON_CLAMPED", gluon)
    for switch in ("SONICMOE_GLUON", "SONICMOE_GLUON_DH"):
        monkeypatch.delenv(switch, raising=False)
    calls = {"up": 0, "dh": 0}

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            assert kwargs.get("activation") == "clamped_swiglu"
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(up_module, "up_proj_ws", count("up", up_proj_ws.up_proj_ws))
    monkeypatch.setattr(dh_module, "dh_ws", count("dh", dh_ws.dh_ws))
    device = torch.device("cuda")
    p = _problem(device, False, seed=9, t=1024, d=512, n=256, e=8, dtype=torch.bfloat16)
    routing = _routing(p, 2, device, empty_expert=False)
    scores = torch.rand(routing.num_rows, generator=torch.Generator().manual_seed(4)).to(device)
    dout = torch.randn(p["x"].shape, generator=torch.Generator().manual_seed(5)).to(device, torch.bfloat16)
    leaves = [p["x"], p["w1"], p["w2"], scores]
    out, grads = _grads(lambda x, w1, w2, s: sonicmoe.experts(x, w1, w2, routing, s, gate_up_layout=layout,
                                                                activation="clamped_swiglu"), leaves, dout)
    out_ref, grads_ref = _grads(lambda x, w1, w2, s: experts_ref(x, w1, w2, routing, s, gate_up_layout=layout,
                                                                 activation="clamped_swiglu", h_dtype=torch.bfloat16),
                                [v.double() for v in leaves], dout.double())
    assert rel_err(out, out_ref) < 1e-2
    for name, g_, g_ref in zip(("x", "w1", "w2", "scores"), grads, grads_ref):
        assert rel_err(g_, g_ref) < 1e-2, name
    x_nan = p["x"].clone()
    x_nan[7, 3] = float("nan")  # the GPU's clamps keep NaN (propagate_nan): token 7's output only is NaN
    out_nan = sonicmoe.experts(x_nan, p["w1"], p["w2"], routing, scores, gate_up_layout=layout,
                               activation="clamped_swiglu")
    assert torch.isnan(out_nan[7]).all() and torch.isfinite(out_nan[:7]).all() and torch.isfinite(out_nan[8:]).all()
    h = F.linear(p["x"].float(), p["w1"][0].float())
    assert min(_clamp_shares(h, layout)) > 0.02
    sm90 = grouped_gemm_ws.HAVE_GLUON and torch.cuda.get_device_capability() == (9, 0)
    gluon_ran = sm90 and gluon == "1" and layout == "concat"
    assert (calls["up"] > 0, calls["dh"] > 0) == (gluon_ran, gluon_ran), calls


def _need_gluon():
    from sonicmoe.ops import grouped_gemm_ws

    if not grouped_gemm_ws.HAVE_GLUON or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels need an sm_90 GPU")


# (T, d, n, E, K): two N-tiles and partial tiles; empty experts and three K-blocks; the 7B widths
GLUON_CASES = [(1000, 384, 256, 16, 4), (777, 192, 128, 40, 2), (4096, 1536, 256, 32, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GLUON_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_gluon_up_projection_clamped(case, dtype, monkeypatch):
    """The Gluon up-projection's clamped epilogue, in the MMA warps (EPI_WARPS 0) and in the storer partition (4),
    with bias: H within rounding of the float32 loop, A the clamped activation of the stored H (and not SwiGLU's),
    both within rounding of the Triton kernel's, no NaN left by the poison fill, the same bits from both epilogue
    forms, on a second run and without H stored; a NaN in one token's x leaves that token's rows NaN only."""
    from sonicmoe.ops.up_proj_ws import up_proj_ws, up_ws_config
    from sonicmoe.testing import random_topk_routing

    _need_gluon()
    t, d, n, e, k = case
    routing = random_topk_routing(t, e, k, seed=t + 1)
    g = torch.Generator(device="cuda").manual_seed(21)
    x = (6 * torch.randn(t, d, device="cuda", generator=g)).to(dtype)  # H's spread about 6: the clamps bind
    w1 = (torch.randn(e, 2 * n, d, device="cuda", generator=g) / d ** 0.5).to(dtype)
    b1 = (0.1 * torch.randn(e, 2 * n, device="cuda", generator=g)).to(dtype)
    act = "clamped_swiglu"
    h_ref, a_ref = up_proj_ref(x, w1, b1, routing, activation=act)
    outs = []
    for epi in (0, 4):
        cfg = up_ws_config(epi_warps=epi)
        h, a = up_proj_ws(x, w1, b1, routing, config=cfg, activation=act)
        assert not torch.isnan(h).any() and not torch.isnan(a).any(), epi
        assert min(_clamp_shares(h, "concat")) > 0.05
        assert rel_err(h, h_ref) < 5e-3 and rel_err(a, a_ref) < 1e-2, epi
        assert rel_err(a, swiglu_ref(h.float(), activation=act).to(dtype)) < 2e-3, epi
        assert rel_err(a, swiglu_ref(h.float()).to(dtype)) > 0.1, epi
        h2, a2 = up_proj_ws(x, w1, b1, routing, config=cfg, activation=act)
        none, a3 = up_proj_ws(x, w1, b1, routing, store_h=False, config=cfg, activation=act)
        assert torch.equal(h, h2) and torch.equal(a, a2) and none is None and torch.equal(a, a3), epi
        outs.append((h, a))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    monkeypatch.setenv("SONICMOE_GLUON_UP", "0")
    h_tri, a_tri = up_proj(x, w1, b1, routing, activation=act)
    monkeypatch.delenv("SONICMOE_GLUON_UP")
    assert rel_err(outs[0][0], h_tri) < 2e-3 and rel_err(outs[0][1], a_tri) < 5e-3
    # where the two kernels' H agree (their K-blocks summed alike), A agrees bit for bit: the same arithmetic
    same = (outs[0][0] == h_tri).view(-1, 2, n).all(1)  # (R, n): gate and up both equal
    assert same.float().mean() > 0.5
    assert torch.equal(outs[0][1][same], a_tri[same])
    x_nan = x.clone()
    x_nan[7, 3] = float("nan")
    token7 = routing.row_token == 7
    for epi in (0, 4):
        _, a_nan = up_proj_ws(x_nan, w1, b1, routing, config=up_ws_config(epi_warps=epi), activation=act)
        assert torch.isnan(a_nan[token7]).all() and torch.isfinite(a_nan[~token7]).all(), epi


@pytest.mark.gpu
@pytest.mark.parametrize("case", GLUON_CASES, ids=lambda c: "x".join(map(str, c)))
def test_gpu_gluon_dh_clamped(case, monkeypatch):
    """The Gluon dH kernel's clamped epilogue, H holding values past and at the bounds (gate 7, up ±7): dH and A′
    bitwise the Triton kernel's (the same dA′ accumulation order and epilogue arithmetic), dS within rounding of
    its, all within rounding of the float32 loop, no NaN left by the poison fill, the same bits on a second run; the
    default config (sigmoid by the ftz forms), the default forms, 16-channel blocks and 128-wide tiles; where a tile
    spans all n channels, dS written by the kernel in pair order equal to the partials' sum."""
    from sonicmoe.ops import dh_ws
    from sonicmoe.testing import random_topk_routing

    _need_gluon()
    t, d, n, e, k = case
    routing = random_topk_routing(t, e, k, seed=t + 2)
    r = routing.num_rows
    g = torch.Generator(device="cuda").manual_seed(22)
    dout = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    w2 = (torch.randn(e, d, n, device="cuda", generator=g) / d ** 0.5).bfloat16()
    h = 6 * torch.randn(r, 2 * n, device="cuda", generator=g)
    bounds = torch.tensor([7.0, -7.0, 7.0625, -7.0625], device="cuda")
    pick = torch.rand(r, 2 * n, device="cuda", generator=g) < 0.05
    h = torch.where(pick, bounds[torch.randint(0, 4, (r, 2 * n), device="cuda", generator=g)], h).bfloat16()
    s = torch.rand(r, device="cuda", generator=g)
    act = "clamped_swiglu"
    ref = dh_ref(dout, w2, h, s, routing, activation=act)
    monkeypatch.setenv("SONICMOE_GLUON_DH", "0")
    tri = dh(dout, w2, h, s, routing, activation=act)
    monkeypatch.delenv("SONICMOE_GLUON_DH")
    for cfg in (None, {**dh_ws.dh_ws_config(n), "SIGMOID_FTZ": False}, dh_ws.dh_ws_config(n, 16, 2),
                dh_ws.dh_ws_config(n, 32, 4, 128)):
        got = dh_ws.dh_ws(dout, w2, h, s, routing, config=cfg, activation=act)
        ds = got[2].sum(0)
        for name, x, y, z in zip(("dH", "A'", "dS"), (got[0], got[1], ds), ref, tri):
            assert not torch.isnan(x).any(), (name, cfg)
            assert rel_err(x, y) < 1e-2 and rel_err(x, z) < 3e-3, (name, cfg)
        assert torch.equal(got[0], tri[0]) and torch.equal(got[1], tri[1]), cfg
        again = dh_ws.dh_ws(dout, w2, h, s, routing, config=cfg, activation=act)
        assert all(torch.equal(x, y) for x, y in zip(got, again)), cfg
    if dh_ws.ds_pairs_in_kernel(n):
        pairs = torch.empty_like(s)
        pairs[routing.row_pair.long()] = s
        partial = dh_ws.dh_ws(dout, w2, h, pairs, routing, pair_order=True, activation=act)
        fused = dh_ws.dh_ws(dout, w2, h, pairs, routing, pair_order=True, ds_pairs=torch.float32, activation=act)
        assert torch.equal(fused[0], partial[0]) and torch.equal(fused[1], partial[1])
        want = torch.zeros_like(s)
        rows = routing.row_pair.long()[: partial[2].shape[1]]
        want[rows] = partial[2].sum(0)
        assert torch.equal(fused[2], want)
