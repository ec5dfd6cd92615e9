"""sonicmoe.MoE: construction (CPU, meta), HF parameter layout, forward shapes/dtypes, losses,
state_dict, options. Runs on the torch backend off-GPU."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import shutil

import pytest
import torch

import sonicmoe
from sonicmoe import MoE, MoEConfig
from sonicmoe.functional import resolve_backend
from sonicmoe.reference import moe_ref
from sonicmoe.routing import load_balancing_loss, routing_from_topk
from sonicmoe.testing import rel_err

D, N, E, K = 16, 8, 6, 2


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    """Every Triton kernel output starts as NaN (SONICMOE_POISON_OUTPUTS=1): an element no program writes fails."""
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread():
    """These tests run thousands of tiny CPU ops: use one intra-op thread. torch's CPU softmax wakes an
    OpenMP team on every call, which costs ~10 ms per call when the CPU is shared (CI, parallel jobs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    opts = {"hidden_size": D, "intermediate_size": N, "num_experts": E, "top_k": K, "backend": "torch"}
    opts.update(kw)
    return MoE(**opts)


def module_ref(m: MoE, x: torch.Tensor):
    """moe_ref on the module's own parameters and options, x flattened to (T, d)."""
    c, ex = m.config, m.experts
    return moe_ref(x.reshape(-1, c.hidden_size), m.gate.weight, ex.gate_up_proj, ex.down_proj,
                   ex.gate_up_proj_bias, ex.down_proj_bias, top_k=c.top_k, router_order=c.router_order,
                   renormalize=c.renormalize, expert_bias=m.e_score_correction_bias,
                   routed_scaling_factor=c.routed_scaling_factor, n_group=c.n_group, topk_group=c.topk_group,
                   gate_up_layout=c.gate_up_layout)


def rand_x(*shape, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# ---------------------------------------------------------------------------------------------
# construction and parameters
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_parameters_follow_hf_convention(bias, device):
    m = MoE(D, N, E, K, bias=bias, device=device)
    shapes = {k: tuple(v.shape) for k, v in m.named_parameters()}
    expected = {"gate.weight": (E, D), "experts.gate_up_proj": (E, 2 * N, D), "experts.down_proj": (E, D, N)}
    if bias:
        expected.update({"experts.gate_up_proj_bias": (E, 2 * N), "experts.down_proj_bias": (E, D)})
    assert shapes == expected
    assert set(m.state_dict()) == set(expected)
    assert all(p.device.type == device for p in m.parameters())
    assert all(p.dtype == torch.float32 and p.requires_grad for p in m.parameters())
    assert m.aux_loss is None and m.z_loss is None and m.expert_counts is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_parameter_dtype_and_init_bounds(dtype):
    m = MoE(64, 32, 4, 2, bias=True, dtype=dtype)
    assert all(p.dtype == dtype for p in m.parameters())
    ex = m.experts
    for w, fan_in in ((ex.gate_up_proj, 64), (ex.down_proj, 32), (ex.gate_up_proj_bias, 64),
                      (ex.down_proj_bias, 32)):
        bound = 1 / math.sqrt(fan_in)
        wf = w.detach().float()
        assert float(wf.abs().max()) <= bound * (1 + 1e-2)
        # really initialised to this bound, not zeros or a smaller one (of d's fan-in where n's is meant): of ≥ 256
        # uniform draws the largest lies within 10% of the bound but with probability 0.9^256 < 1e-11
        assert float(wf.abs().max()) > bound * 0.9
        assert float(wf.min()) < -bound / 2 and float(wf.max()) > bound / 2  # both signs: U(-bound, bound)
        assert float(wf.std()) > bound / 4
    # experts are distinct, not one copy
    assert not torch.equal(ex.gate_up_proj[0], ex.gate_up_proj[1])


def test_meta_forward_and_materialise():
    m = MoE(D, N, E, K, bias=True, device="meta")
    y = m(torch.empty(3, 5, D, device="meta"))
    assert y.shape == (3, 5, D) and y.device.type == "meta"
    # a layer built for the Triton kernels infers shapes on the meta device too (the torch backend's ops run there)
    meta_triton = MoE(D, N, E, K, bias=True, backend="triton", shared_intermediate_size=4, device="meta")
    y = meta_triton(torch.empty(3, 5, D, device="meta"))
    assert y.shape == (3, 5, D) and y.device.type == "meta" and meta_triton.expert_counts.shape == (E,)
    assert m.expert_counts.shape == (E,) and m.aux_loss.shape == ()
    # meta-init flow: materialise, then load real weights
    src = make(seed=3, bias=True)
    m.to_empty(device="cpu")
    m.load_state_dict(src.state_dict())
    x = rand_x(7, D)
    torch.testing.assert_close(m(x), src(x), rtol=0, atol=0)


def test_config_and_repr():
    m = make(router_order="softmax_then_topk", renormalize=True, gate_up_layout="interleaved", bias=True,
             aux_loss_coef=0.5, z_loss_coef=0.25)
    c = m.config
    assert isinstance(c, MoEConfig)
    assert (c.hidden_size, c.intermediate_size, c.num_experts, c.top_k) == (D, N, E, K)
    assert (c.router_order, c.renormalize, c.gate_up_layout, c.bias) == ("softmax_then_topk", True,
                                                                          "interleaved", True)
    assert (c.aux_loss_coef, c.z_loss_coef, c.backend) == (0.5, 0.25, "torch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.top_k = 3
    r = repr(m)
    assert f"E={E}" in r and f"K={K}" in r and "interleaved" in r
    assert "renormalize=True" in r and "aux_loss_coef=0.5" in r and "z_loss_coef=0.25" in r and "bias=True" in r
    assert "m_tile" not in r and "static_pairs" not in r  # read under token rounding only
    # layers that differ in any option print differently; the defaults are not spelt out
    assert "renormalize" not in repr(make()) and "routed_scaling_factor=2.5" in repr(make(routed_scaling_factor=2.5))
    tr = repr(make(routing="token_rounding", m_tile=16, rounding="up", static_pairs=False))
    assert "m_tile=16, rounding=up" in tr and "static_pairs=False" in tr


def test_repr_names_each_option_once_and_the_shared_width():
    """Each option appears once in the repr (the named ones are not repeated among the non-default rest, whatever
    their values), and the shared expert's width is its own n_s, not the routed experts' n."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    n_s = N + 1 + int(torch.randint(1, 9, (), generator=g))
    layers = (make(backend="torch", activation="clamped_swiglu", gate_up_layout="interleaved",
                   router_order="softmax_then_topk", routing="token_rounding", m_tile=16, rounding="up"),
              make(backend="auto", shared_intermediate_size=n_s, shared_expert_gate=True, z_loss_coef=0.5))
    for m in layers:
        r = m.extra_repr()
        for f in dataclasses.fields(m.config):
            assert r.count(f"{f.name}=") <= 1, (f.name, r)
        assert r.count("backend=") == 1 and f"backend={m.config.backend}" in r
    r = layers[1].extra_repr()
    assert f"shared n_s={n_s} (gated)" in r and f"n={N}," in r and "z_loss_coef=0.5" in r


def test_config_defaults():
    c = MoEConfig(8, 4, 4, 2)
    assert (c.router_order, c.renormalize, c.gate_up_layout, c.bias, c.backend, c.routing) == (
        "topk_then_softmax", False, "concat", False, "auto", "topk")
    # token rounding's documented defaults: nearest, M_tile 128, the static-length (CUDA-graph capturable) form
    assert (c.rounding, c.m_tile, c.static_pairs, c.aux_loss_coef, c.z_loss_coef) == ("nearest", 128, True, 0.01, 0.0)
    # SwiGLU, no scaling, groups, shared expert or router bias, and O alone returned, unless asked for
    assert (c.activation, c.routed_scaling_factor, c.n_group, c.topk_group) == ("swiglu", 1.0, 1, 1)
    assert (c.shared_intermediate_size, c.shared_expert_gate, c.router_bias, c.return_router_info) == (0, False, False,
                                                                                                       False)


@pytest.mark.parametrize("kw,name", [
    ({"top_k": 0}, "top_k"), ({"top_k": E + 1}, "top_k"), ({"hidden_size": 0}, "hidden_size"),
    ({"intermediate_size": -1}, "intermediate_size"), ({"num_experts": 0}, "num_experts"),
    ({"router_order": "softmax"}, "router_order"), ({"gate_up_layout": "split"}, "gate_up_layout"),
    ({"backend": "cuda"}, "backend"), ({"routing": "expert_choice"}, "routing"),
    ({"rounding": "floor"}, "rounding"), ({"m_tile": 0}, "m_tile"), ({"m_tile": 2**24 + 1}, "m_tile"),
    ({"activation": "gelu"}, "activation"),
    ({"routed_scaling_factor": 0.0}, "routed_scaling_factor"),
    ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor"),
    ({"router_order": "sigmoid_then_topk", "routing": "token_rounding", "n_group": 3}, "n_group"),  # TR ignores groups
    ({"router_order": "sigmoid_then_topk", "n_group": 4}, "n_group"),  # 4 does not divide E = 6
    ({"router_order": "sigmoid_then_topk", "n_group": 6}, "n_group"),  # groups of one expert
    ({"n_group": 3}, "n_group"),  # groups need the sigmoid order
    ({"router_order": "sigmoid_then_topk", "n_group": 3, "topk_group": 4}, "topk_group"),
    ({"router_order": "sigmoid_then_topk", "n_group": 3, "topk_group": 1, "top_k": 3}, "topk_group"),  # 2 < K
    ({"topk_group": 2}, "topk_group"),  # without groups
    ({"return_router_info": 1}, "return_router_info"), ({"static_pairs": "no"}, "static_pairs"),
    ({"bias": "False"}, "bias"), ({"renormalize": "False"}, "renormalize"),  # truthy strings: refused
    ({"top_k": True}, "top_k"), ({"hidden_size": True}, "hidden_size"), ({"m_tile": True}, "m_tile"),
    ({"m_tile": 4.0}, "m_tile"),  # a whole float is no int: the kernels' counts need one
    ({"aux_loss_coef": None}, "aux_loss_coef"), ({"aux_loss_coef": float("nan")}, "aux_loss_coef"),
    ({"aux_loss_coef": -0.1}, "aux_loss_coef"), ({"z_loss_coef": "0.1"}, "z_loss_coef"),
    ({"z_loss_coef": True}, "z_loss_coef"),
    ({"aux_loss_coef": float("inf")}, "aux_loss_coef"), ({"z_loss_coef": float("inf")}, "z_loss_coef"),  # finite
    ({"router_bias": "False"}, "router_bias"),
])
def test_config_validation(kw, name):
    with pytest.raises(ValueError, match=name):
        make(**kw)
    if name != "activation":
        base = {"hidden_size": D, "intermediate_size": N, "num_experts": E, "top_k": K}
        base.update(kw)
        with pytest.raises(ValueError, match=name):
            MoEConfig(**base)


def test_config_accepts_its_bounds_and_names_them():
    """The ranges are closed: M_tile = 2^24 (MAX_M_TILE, the kernels' int32 counts still fit) and K = E are taken;
    one past either is refused with a message that states the range, E's value in it."""
    from sonicmoe.config import MAX_M_TILE, check_m_tile

    assert MAX_M_TILE == 2**24
    check_m_tile(2**24)
    c = MoEConfig(D, N, E, E, routing="token_rounding", m_tile=2**24)
    assert (c.top_k, c.m_tile) == (E, 2**24)
    with pytest.raises(ValueError) as info:
        MoEConfig(D, N, 5, 7)
    assert str(info.value) == "top_k must be an int in [1, num_experts=5], got 7"
    with pytest.raises(ValueError) as info:
        check_m_tile(2**24 + 1)
    assert str(info.value) == "m_tile must be an int in [1, 16777216] (rows of a tile), got 16777217"


@pytest.mark.parametrize("kw,message", [
    ({"intermediate_size": -3}, "intermediate_size must be a positive int, got -3"),
    ({"num_experts": True}, "num_experts must be a positive int, got True"),
    ({"shared_intermediate_size": -2}, "shared_intermediate_size must be an int >= 0 (0: no shared expert), got -2"),
    ({"static_pairs": "no"}, "static_pairs must be a bool, got 'no'"),
    ({"router_bias": 0}, "router_bias must be a bool, got 0"),
    ({"m_tile": 4.0}, "m_tile must be an int in [1, 16777216] (rows of a tile), got 4.0"),
    ({"router_order": "sigmoid_then_topk", "routing": "token_rounding", "n_group": 3},
     "routing='token_rounding' adds pairs regardless of expert groups: it needs n_group=1 (no group-limited "
     "routing), got n_group=3"),
])
def test_config_errors_quote_the_value_given(kw, message):
    """Each refusal ends with the value the caller gave (its repr, or the group count), not the option's name or
    another option's value (a message that matched the option's name alone let a wrong value through)."""
    sizes = {"hidden_size": D, "intermediate_size": N, "num_experts": E, "top_k": K}
    with pytest.raises(ValueError) as info:
        MoEConfig(**{**sizes, **kw})
    assert str(info.value) == message


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(D,), (5, D), (1, D), (2, 3, D), (2, 1, 4, D)])
def test_forward_shapes_and_matches_ref(shape):
    m = make(bias=True)
    x = rand_x(*shape)
    y = m(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    ref = module_ref(m, x)[0]
    assert rel_err(y.reshape(-1, D), ref) < 1e-6
    assert m.expert_counts.sum().item() == K * x.numel() // D


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_forward_low_precision(dtype, tol):
    m = make(bias=True).to(dtype)
    x = rand_x(4, 8, D, dtype=dtype)
    y = m(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.isfinite(y).all()
    ref = module_ref(m, x)[0]  # float32 on the same low-precision values
    err = rel_err(y.reshape(-1, D), ref)
    assert 0 < err < tol


def test_forward_casts_x_to_parameter_dtype_and_back():
    m = make().to(torch.bfloat16)
    x = rand_x(6, D)
    y = m(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, m(x.bfloat16()).float(), rtol=0, atol=0)


@pytest.mark.parametrize("order,renorm", [("topk_then_softmax", False), ("topk_then_softmax", True),
                                          ("softmax_then_topk", False), ("softmax_then_topk", True),
                                          ("sigmoid_then_topk", False), ("sigmoid_then_topk", True)])
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_router_orders_and_layouts_match_ref(order, renorm, layout):
    m = make(router_order=order, renormalize=renorm, gate_up_layout=layout, bias=True)
    x = rand_x(20, D)
    assert rel_err(m(x), module_ref(m, x)[0]) < 1e-6


def test_router_order_semantics():
    x = rand_x(20, D)
    a = make(seed=5, router_order="topk_then_softmax")(x)
    a_renorm = make(seed=5, router_order="topk_then_softmax", renormalize=True)(x)
    s = make(seed=5, router_order="softmax_then_topk")(x)
    s_renorm = make(seed=5, router_order="softmax_then_topk", renormalize=True)(x)
    torch.testing.assert_close(a_renorm, a, rtol=0, atol=0)  # renormalize ignored
    torch.testing.assert_close(s_renorm, a, rtol=1e-5, atol=1e-6)  # same scores, other formula
    assert rel_err(s, a) > 0.05  # without renormalisation the K scores sum to < 1


def _swiglu_expert(x, w1, w2):
    """One expert on rows x (concat layout: W1's first n rows the gate)."""
    h = x @ w1.t()
    n = w1.shape[0] // 2
    return (torch.nn.functional.silu(h[:, :n]) * h[:, n:]) @ w2.t()


def test_deepseek_v3_routing_by_hand():
    """router_order="sigmoid_then_topk" with renormalize, routed_scaling_factor 2.5 and a nonzero
    e_score_correction_bias, against the formula written out here in float64: the experts are the top-K of
    sigmoid(x W_rᵀ) + b; O = Σ_k 2.5 · p_k / (Σ_j p_j + 1e-20) · Expert_{e_k}(x), p the chosen sigmoids.
    The bias changes the choice of some tokens, and gets no gradient; the router weight does get one."""
    m = make(seed=3, top_k=3, router_order="sigmoid_then_topk", renormalize=True, routed_scaling_factor=2.5)
    assert m.e_score_correction_bias.dtype == torch.float32 and not m.e_score_correction_bias.any()
    m.e_score_correction_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(9)) * 0.3)
    x = rand_x(40, D, seed=4)
    y = m(x)
    xd, wg = x.double(), m.gate.weight.detach().double()
    p_all = torch.sigmoid(xd @ wg.t())
    ids = (p_all + m.e_score_correction_bias.double()).topk(3, dim=1).indices
    assert not torch.equal(ids, p_all.topk(3, dim=1).indices)  # the bias moved some choices
    p = p_all.gather(1, ids)
    s = 2.5 * p / (p.sum(1, keepdim=True) + 1e-20)
    w1, w2 = m.experts.gate_up_proj.detach().double(), m.experts.down_proj.detach().double()
    ref = torch.zeros_like(xd)
    for t in range(x.shape[0]):
        for j in range(3):
            ref[t] += s[t, j] * _swiglu_expert(xd[t:t + 1], w1[ids[t, j]], w2[ids[t, j]])[0]
    assert rel_err(y, ref) < 1e-6
    assert torch.equal(m.expert_counts, torch.bincount(ids.flatten(), minlength=E).to(m.expert_counts.dtype))
    y.square().sum().backward()
    assert m.gate.weight.grad.abs().sum() > 0
    assert not m.e_score_correction_bias.requires_grad


def test_group_limited_routing_by_hand():
    """n_group = 4 groups of 3 experts, topk_group = 2 (DeepSeek-V3's group-limited choice): per token, by hand in
    float64, the two groups with the largest sums of their two best sigmoid + bias; the K = 3 experts are the best
    within those groups. The groups change some tokens' choices; output and counts follow the choice."""
    e, k = 12, 3
    m = make(seed=7, num_experts=e, top_k=k, router_order="sigmoid_then_topk", renormalize=True, n_group=4,
             topk_group=2)
    m.e_score_correction_bias.copy_(torch.randn(e, generator=torch.Generator().manual_seed(1)) * 0.2)
    x = rand_x(50, D, seed=3)
    y = m(x)
    p_all = torch.sigmoid(x.double() @ m.gate.weight.detach().double().t())
    key = p_all + m.e_score_correction_bias.double()
    ids = torch.empty(x.shape[0], k, dtype=torch.long)
    for t in range(x.shape[0]):
        groups = key[t].view(4, 3)
        best = groups.sort(dim=1, descending=True).values[:, :2].sum(1).argsort(descending=True)[:2]
        allowed = torch.cat([torch.arange(3 * g, 3 * g + 3) for g in best.tolist()])
        ids[t] = allowed[key[t, allowed].argsort(descending=True)[:k]]
    ungrouped = key.topk(k, dim=1).indices
    assert not torch.equal(ids.sort(1).values, ungrouped.sort(1).values)  # the groups matter here
    assert torch.equal(m.expert_counts, torch.bincount(ids.flatten(), minlength=e).to(m.expert_counts.dtype))
    ref = module_ref(m, x)
    assert torch.equal(ref[1].topk_ids.sort(1).values, ids.sort(1).values)
    assert rel_err(y, ref[0]) < 1e-6


def test_update_expert_bias():
    """b_e += rate · sign(mean(c) − c_e) from the last forward's counts or given ones; a bias pushed far enough
    empties an overloaded expert; the bias stays float32 under .to(bfloat16) and travels in the state dict;
    the errors name what is wrong."""
    m = make(seed=1, router_order="sigmoid_then_topk", renormalize=True)
    x = rand_x(64, D, seed=2)
    m(x)
    c = m.expert_counts.float()
    m.update_expert_bias(0.01)
    torch.testing.assert_close(m.e_score_correction_bias, 0.01 * torch.sign(c.mean() - c), rtol=0, atol=0)
    busiest = int(c.argmax())
    counts = torch.zeros(E)
    counts[busiest] = 100.0
    m.update_expert_bias(1.0, counts=counts)  # the busiest expert's bias drops by 1: below any other's sigmoid
    m(x)
    assert m.expert_counts[busiest] == 0
    exact = m.e_score_correction_bias.clone()
    half = m.to(torch.bfloat16)
    assert half.e_score_correction_bias.dtype == torch.float32 and half.gate.weight.dtype == torch.bfloat16
    assert torch.equal(half.e_score_correction_bias, exact)  # not rounded through bf16 on the way
    state = half.state_dict()
    assert torch.equal(state["e_score_correction_bias"], m.e_score_correction_bias)
    fresh = make(seed=5, router_order="sigmoid_then_topk").to(torch.bfloat16)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.e_score_correction_bias, m.e_score_correction_bias)
    with pytest.raises(ValueError, match="rate"):
        m.update_expert_bias(0.0)
    with pytest.raises(ValueError, match="rate"):
        m.update_expert_bias(float("inf"))
    with pytest.raises(ValueError, match="rate"):
        m.update_expert_bias(True)  # a flag passed where the rate goes, not a rate of 1
    with pytest.raises(ValueError, match="counts"):
        m.update_expert_bias(0.01, counts=torch.ones(E + 1))
    with pytest.raises(RuntimeError, match="no expert counts"):
        make(router_order="sigmoid_then_topk").update_expert_bias()
    plain = make()
    assert plain.e_score_correction_bias is None and "e_score_correction_bias" not in plain.state_dict()
    with pytest.raises(RuntimeError, match="sigmoid_then_topk"):
        plain.update_expert_bias()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_selection_bias_float32_when_built_in_another_dtype(dtype):
    """A layer built with dtype= (not cast afterwards) makes DeepSeek-V3's e_score_correction_bias float32 all the
    same, zeros: updates of 1e-3 must not round away (in bf16 1 + 1e-3 is 1)."""
    m = make(router_order="sigmoid_then_topk", renormalize=True, dtype=dtype)
    assert m.gate.weight.dtype == dtype
    b = m.e_score_correction_bias
    assert b.dtype == torch.float32 and b.shape == (E,) and not b.any()


def test_selection_bias_follows_a_move_and_cast_in_one_call():
    """.to(device, dtype) in one call moves e_score_correction_bias with the parameters and keeps it float32 (the
    float32 values from before the cast are moved, not left on the old device)."""
    m = make(router_order="sigmoid_then_topk")
    moved = m.to("meta", torch.bfloat16)
    assert moved.gate.weight.device.type == "meta" and moved.gate.weight.dtype == torch.bfloat16
    b = moved.e_score_correction_bias
    assert b.device.type == "meta" and b.dtype == torch.float32 and b.shape == (E,)
    back = make(router_order="sigmoid_then_topk")
    back.e_score_correction_bias.copy_(torch.linspace(-1e-3, 1e-3, E))
    want = back.e_score_correction_bias.clone()
    back.to("cpu", torch.float16)
    assert back.e_score_correction_bias.device.type == "cpu" and torch.equal(back.e_score_correction_bias, want)


def test_update_expert_bias_counts_past_float16_integers():
    """Counts summed over a step pass 2048 (float16's last exact integer): each is compared with the mean exactly, so
    an expert one token above the mean gets -rate and one token below +rate (float16 counts would round 4097 and
    4096 together and 4099 up to 4100)."""
    m = make(router_order="sigmoid_then_topk")
    counts = torch.tensor([4097, 4096, 4096, 4099, 4097, 4097], dtype=torch.int64)  # mean 4097
    m.update_expert_bias(0.125, counts=counts)
    expected = 0.125 * torch.tensor([0.0, 1.0, 1.0, -1.0, 0.0, 0.0])
    assert m.e_score_correction_bias.dtype == torch.float32
    torch.testing.assert_close(m.e_score_correction_bias, expected, rtol=0, atol=0)
    assert counts.dtype == torch.int64 and counts.tolist() == [4097, 4096, 4096, 4099, 4097, 4097]


def test_update_expert_bias_sums_counts_over_the_group_first(monkeypatch):
    """With group=, the counts are all-reduced over that group before the update (every replica of the router makes
    the same step from the summed counts), on a float32 copy: the caller's counts are left as they were. The
    all-reduce is stood in for by one that adds another rank's counts, chosen so that the summed counts order the
    experts differently from this rank's alone."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    mine = torch.randint(0, 50, (E,), generator=g).float()
    other = torch.randint(0, 50, (E,), generator=g).float()
    other[int(mine.argmin())] += 1000.0  # this rank's least loaded expert is the busiest of the group
    group = object()
    seen = []

    def all_reduce(t, group=None):
        seen.append(group)
        t.add_(other)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    m = make(router_order="sigmoid_then_topk")
    counts = mine.clone()
    m.update_expert_bias(0.25, counts=counts, group=group)
    total = mine + other
    assert seen == [group]
    torch.testing.assert_close(m.e_score_correction_bias, 0.25 * torch.sign(total.mean() - total), rtol=0, atol=0)
    assert torch.equal(counts, mine)  # the caller's tensor is not reduced in place
    assert m.e_score_correction_bias[int(mine.argmin())] == -0.25


def test_update_expert_bias_rate_and_counts_checks():
    """The mean, not the median, splits the experts: one overloaded expert steps down and every other up. An int rate
    is a rate (1 moves by 1.0); NaN is no rate. Counts that are no tensor (a list) or hold E values in another shape
    are refused with a ValueError naming the shape found; a layer without a bias names its router_order."""
    m = make(router_order="sigmoid_then_topk")
    counts = torch.randint(10, 20, (E,))
    busy = int(torch.randint(0, E, ()))
    counts[busy] += 1000  # the mean is above every other count, the median is not
    m.update_expert_bias(1, counts=counts)
    want = torch.ones(E)
    want[busy] = -1.0
    assert m.e_score_correction_bias.dtype == torch.float32
    torch.testing.assert_close(m.e_score_correction_bias, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="rate must be a finite float > 0, got nan"):
        m.update_expert_bias(float("nan"), counts=counts)
    with pytest.raises(ValueError, match=rf"counts must be a tensor of shape \(E={E},\), got list"):
        m.update_expert_bias(0.01, counts=[1.0] * E)
    with pytest.raises(ValueError, match=rf"got \({E}, 1\)"):
        m.update_expert_bias(0.01, counts=torch.ones(E, 1))
    with pytest.raises(ValueError, match=rf"got \({E + 2},\)"):
        m.update_expert_bias(0.01, counts=torch.ones(E + 2))
    torch.testing.assert_close(m.e_score_correction_bias, want, rtol=0, atol=0)  # no refused call moved it
    with pytest.raises(RuntimeError, match="this layer has 'softmax_then_topk'"):
        make(router_order="softmax_then_topk").update_expert_bias(0.01, counts=counts)


@pytest.mark.parametrize("factor", [0.5, 0.4, 3.0])
def test_routed_scaling_factor_below_and_above_one(factor):
    """Every score times routed_scaling_factor, whichever side of 1 it is (a factor below 1 scales too): the layer
    matches the reference, and with 0.5 (a power of two: every rounding commutes with it) equals half the unscaled
    layer's output bit for bit."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    x = rand_x(17, D, seed=seed % 1000)
    scaled = make(seed=seed, bias=True, routed_scaling_factor=factor)
    plain = make(seed=seed, bias=True)
    out = scaled(x)
    assert rel_err(out, module_ref(scaled, x)[0]) < 1e-6
    assert rel_err(out, factor * plain(x)) < 1e-6
    if factor == 0.5:
        assert torch.equal(out, 0.5 * plain(x))


@pytest.mark.parametrize("k", [1, E])
def test_extreme_top_k(k):
    m = make(top_k=k)
    x = rand_x(9, D)
    y = m(x)
    assert rel_err(y, module_ref(m, x)[0]) < 1e-6
    assert m.expert_counts.sum().item() == 9 * k
    if k == E:
        assert m.expert_counts.tolist() == [9] * E


def test_backend_values():
    x = rand_x(10, D)
    assert resolve_backend("auto", x) == "torch"
    assert resolve_backend("torch", x) == "torch" and resolve_backend("triton", x) == "triton"
    y_torch = make(seed=2, backend="torch")(x)
    y_auto = make(seed=2, backend="auto")(x)
    torch.testing.assert_close(y_auto, y_torch, rtol=0, atol=0)
    assert make(seed=2).config.backend == "torch"
    assert MoE(D, N, E, K).config.backend == "auto"


@pytest.mark.interpreter
def test_triton_backend_matches_torch():
    if importlib.util.find_spec("sonicmoe.ops.moe_function") is None:
        pytest.skip("triton backend (sonicmoe.ops.moe_function) not present")
    mt = make(seed=4, backend="triton", bias=True)
    mr = make(seed=4, backend="torch", bias=True)
    x = rand_x(8, D)
    yt, yr = mt(x), mr(x)
    assert rel_err(yt, yr) < 1e-6  # float32: 4e-8 measured (session 83)


def test_token_rounding_eval_uses_topk():
    m = make(routing="token_rounding", m_tile=4, bias=True).eval()
    x = rand_x(12, D)
    assert rel_err(m(x), module_ref(m, x)[0]) < 1e-6
    assert m.expert_counts.sum().item() == 12 * K


@pytest.mark.filterwarnings("ignore:token rounding with")
@pytest.mark.parametrize("static", [True, False])
def test_token_rounding_layer_follows_static_pairs(static, monkeypatch):
    """In training the layer routes by token_rounding with its config's static_pairs: R_max pairs (the real ones, then
    padding) with the default True, exactly R = Σ counts with False (the same output either way)."""
    from sonicmoe import token_rounding as tr_module

    seen, real = [], tr_module.token_rounding
    monkeypatch.setattr(tr_module, "token_rounding", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    m = make(routing="token_rounding", m_tile=8, rounding="up", static_pairs=static).train()
    t = 24
    m(rand_x(t, D, seed=3))
    (out,) = seen
    r = int(out.counts.sum())
    assert int(m.expert_counts.sum()) == r and r % 8 == 0
    bound = tr_module.max_pairs(t, E, K, 8, "up")
    assert r < bound and out.num_pairs == (bound if static else r)


def test_deterministic():
    m = make(bias=True)
    x = rand_x(16, D)
    assert torch.equal(m(x), m(x))


# ---------------------------------------------------------------------------------------------
# losses, counts, gradients
# ---------------------------------------------------------------------------------------------


def test_aux_losses_and_counts_after_forward():
    m = make(aux_loss_coef=0.3, z_loss_coef=0.02)
    x = rand_x(3, 7, D)
    m(x)
    x2 = x.reshape(-1, D)
    logits = x2.double() @ m.gate.weight.double().t()
    probs = torch.softmax(logits, -1)
    ids = logits.topk(K, -1).indices
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    assert m.expert_counts.dtype == torch.int32 and m.expert_counts.tolist() == counts.tolist()
    assert not m.expert_counts.requires_grad
    f = counts.double() / counts.sum()
    aux = 0.3 * E * (f * probs.mean(0)).sum()
    zl = 0.02 * (torch.logsumexp(logits, -1) ** 2).mean()
    assert abs(m.aux_loss.item() - aux.item()) < 1e-6 * aux.item()
    assert abs(m.z_loss.item() - zl.item()) < 1e-5 * zl.item()
    # the values of this step: another input changes them
    old = m.aux_loss.item()
    m(rand_x(5, D, seed=9))
    assert m.aux_loss.item() != old and m.expert_counts.sum().item() == 5 * K


def test_aux_loss_gradient_wrt_gate():
    m = make(aux_loss_coef=1.0, z_loss_coef=0.1)
    x = rand_x(30, D)
    m(x)
    (gw,) = torch.autograd.grad(m.aux_loss, m.gate.weight)
    assert torch.isfinite(gw).all() and gw.norm() > 0
    # expected: d/dW of E * sum_e f_e * mean_t softmax(x W^T)[t, e], f fixed
    w = m.gate.weight.detach().clone().requires_grad_()
    probs = torch.softmax(x @ w.t(), -1)
    f = (m.expert_counts.float() / m.expert_counts.sum()).detach()
    (E * (f * probs.mean(0)).sum()).backward()
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-7)
    m(x)
    (gz,) = torch.autograd.grad(m.z_loss, m.gate.weight)
    assert torch.isfinite(gz).all() and gz.norm() > 0
    m2 = make(z_loss_coef=0.0)
    m2(x)
    assert m2.z_loss.item() == 0.0


def _saved_shapes(m: MoE, x: torch.Tensor) -> list[tuple[int, ...]]:
    """Shapes of the tensors autograd saves during one forward of ``m`` (what backward would keep)."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x)
    return shapes


@pytest.mark.parametrize("order", ["topk_then_softmax", "sigmoid_then_topk"])
def test_losses_with_zero_coefficient_are_not_computed(order):
    """A loss whose coefficient is 0 is a constant zero without history, and its (T, E) softmax (or logsumexp) is
    neither run nor saved; with nonzero coefficients each loss saves one more (T, E) tensor and has a gradient."""
    x = rand_x(13, D)
    off = make(aux_loss_coef=0.0, z_loss_coef=0.0, router_order=order)
    saved_off = _saved_shapes(off, x)
    for loss in (off.aux_loss, off.z_loss):
        assert loss.shape == () and loss.dtype == torch.float32 and loss.item() == 0.0 and loss.grad_fn is None
    on = make(aux_loss_coef=0.1, z_loss_coef=0.1, router_order=order)
    saved_on = _saved_shapes(on, x)
    assert on.aux_loss.grad_fn is not None and on.z_loss.grad_fn is not None and on.aux_loss.item() > 0
    te = (13, E)
    assert saved_on.count(te) > saved_off.count(te)
    aux_only = make(aux_loss_coef=0.1, z_loss_coef=0.0, router_order=order)
    saved_aux = _saved_shapes(aux_only, x)
    assert saved_off.count(te) < saved_aux.count(te) < saved_on.count(te)
    assert aux_only.z_loss.item() == 0.0 and aux_only.aux_loss.grad_fn is not None
    # the output does not depend on the losses being computed
    torch.testing.assert_close(off(x), on(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_losses_with_zero_coefficient_are_float32_beside_low_precision_experts(dtype):
    """The zero that stands for an uncomputed loss has the computed losses' dtype, the router logits' float32, also
    when the experts (and x) are bf16/fp16: a z_loss of 0 beside a computed aux_loss adds to it without a cast."""
    m = make(aux_loss_coef=0.1, z_loss_coef=0.0, dtype=dtype)
    y = m(rand_x(13, D, dtype=dtype))
    assert y.dtype == dtype
    assert m.aux_loss.dtype == m.z_loss.dtype == torch.float32 and m.z_loss.item() == 0.0
    off = make(aux_loss_coef=0.0, z_loss_coef=0.0, dtype=dtype)
    off(rand_x(13, D, dtype=dtype))
    assert off.aux_loss.dtype == off.z_loss.dtype == torch.float32 and off.aux_loss.grad_fn is None


def test_replaced_config_takes_effect():
    """A config assigned after construction (dataclasses.replace: an aux-loss warm-up from 0, DeepSeek-V3's scaling
    factor set later) is the one the next forward follows, as a layer built with it: the loss and scaling switches
    were derived once in __init__, so a coefficient raised from 0 left the loss at zero and a factor changed from 1
    scaled nothing, silently."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    x = rand_x(11, D, seed=seed)
    late = make(seed=seed, aux_loss_coef=0.0, z_loss_coef=0.0)
    late.config = dataclasses.replace(late.config, aux_loss_coef=0.05, z_loss_coef=0.1, routed_scaling_factor=2.5)
    built = make(seed=seed, aux_loss_coef=0.05, z_loss_coef=0.1, routed_scaling_factor=2.5)
    torch.testing.assert_close(late(x), built(x), rtol=0, atol=0)
    torch.testing.assert_close(late(x), module_ref(late, x)[0], rtol=1e-5, atol=1e-6)
    for name in ("aux_loss", "z_loss"):
        assert getattr(late, name).item() > 0
        torch.testing.assert_close(getattr(late, name), getattr(built, name), rtol=0, atol=0)
    late.config = dataclasses.replace(late.config, aux_loss_coef=0.0, routed_scaling_factor=1.0)
    late(x)
    assert late.aux_loss.item() == 0.0 and late.aux_loss.grad_fn is None
    with pytest.raises(TypeError, match="config must be a sonicmoe.MoEConfig"):
        late.config = {"aux_loss_coef": 0.1}
    before = late.config
    for change in ({"intermediate_size": 2 * late.config.intermediate_size}, {"gate_up_layout": "interleaved"},
                   {"bias": True}, {"router_order": "sigmoid_then_topk"}):
        with pytest.raises(ValueError, match=f"config: {next(iter(change))}.*cannot change on a built layer"):
            late.config = dataclasses.replace(late.config, **change)
        assert late.config is before  # refused: the layer keeps its config
    late.config = dataclasses.replace(late.config, router_order="softmax_then_topk", top_k=1)  # no parameter's
    assert late(x).shape == x.shape


def test_replaced_config_keeps_the_shared_expert_and_router_bias():
    """The shared expert's gate and the router bias are parameters too: a replaced config that adds or drops either is
    refused, naming the option, and the layer keeps its config (the gate's weight would be missing, or left unused)."""
    m = make(shared_intermediate_size=4, shared_expert_gate=True)
    before = m.config
    for change in ({"shared_expert_gate": False}, {"router_bias": True}, {"shared_intermediate_size": 8}):
        with pytest.raises(ValueError, match=f"config: {next(iter(change))} shape"):
            m.config = dataclasses.replace(m.config, **change)
        assert m.config is before


def test_router_and_selection_biases_start_and_reset_to_zero():
    """The router bias (router_bias=True, gpt-oss) starts at zero, not at nn.Linear's random init, so that no expert
    is preferred; reset_parameters sets it and DeepSeek-V3's selection bias back to zero after they moved, and draws
    the weights again."""
    m = make(seed=int(torch.randint(0, 2**31 - 1, ())), router_bias=True, router_order="sigmoid_then_topk")
    assert m.gate.bias.shape == (E,) and not m.gate.bias.any() and not m.e_score_correction_bias.any()
    m(rand_x(16, D))
    m.update_expert_bias(0.25)
    with torch.no_grad():
        m.gate.bias.uniform_(0.5, 1.0)
    assert m.e_score_correction_bias.abs().min() == 0.25 and m.gate.bias.abs().min() >= 0.5
    w = m.gate.weight.detach().clone()
    m.reset_parameters()
    assert not m.gate.bias.any() and not m.e_score_correction_bias.any()
    assert m.e_score_correction_bias.dtype == torch.float32 and not torch.equal(m.gate.weight, w)


def test_copies_leave_the_last_forward_out():
    """copy.deepcopy and pickling leave out the last forward's aux_loss, z_loss and expert_counts (None in the copy,
    as in a fresh layer: a copy has run no forward), keep them on the original, and copy the weights."""
    import copy
    import pickle

    m = make(z_loss_coef=0.1)
    x = rand_x(9, D)
    m(x)
    counts = m.expert_counts.clone()
    for twin in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert twin.aux_loss is None and twin.z_loss is None and twin.expert_counts is None
        assert torch.equal(m.expert_counts, counts) and m.aux_loss is not None and m.z_loss is not None
        torch.testing.assert_close(twin(x), m(x), rtol=0, atol=0)
        assert torch.equal(twin.expert_counts, counts)


@pytest.mark.parametrize("order,renorm", [("topk_then_softmax", False), ("softmax_then_topk", True),
                                          ("sigmoid_then_topk", True)])
def test_router_probs_on_first_access(order, renorm):
    """RouterOutput.probs: computed from the logits on first access when the choice did not need it (then kept),
    equal to the softmax (sigmoid: the normalised sigmoids) of the logits, and differentiable."""
    x = rand_x(9, D)
    w = rand_x(E, D, seed=3).requires_grad_()
    r = sonicmoe.router_topk(x, w, K, router_order=order, renormalize=renorm)
    lazy = order != "softmax_then_topk"  # softmax_then_topk picks from the probabilities themselves
    assert (r._probs is None) == lazy and ("first access" in repr(r)) == lazy
    p = r.probs
    assert p is r.probs  # kept
    logits = x.double() @ w.detach().double().t()
    want = torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True) if order == "sigmoid_then_topk" \
        else torch.softmax(logits, -1)
    assert rel_err(p, want) < 1e-6
    (g,) = torch.autograd.grad((p * rand_x(9, E, seed=4)).sum(), w)
    assert g.norm() > 0


def test_module_gradients_match_ref():
    m = make(bias=True, gate_up_layout="interleaved")
    x = rand_x(2, 9, D).requires_grad_()
    g = torch.Generator().manual_seed(0)
    dy = torch.randn(2, 9, D, generator=g)
    params = [x] + list(m.parameters())
    grads = torch.autograd.grad(m(x), params, dy)
    ref = module_ref(m, x)[0]
    grads_ref = torch.autograd.grad(ref, params, dy.reshape(-1, D))
    names = ["x"] + [k for k, _ in m.named_parameters()]
    for name, a, b in zip(names, grads, grads_ref):
        assert b.norm() > 0, name
        assert rel_err(a, b) < 1e-5, name


# ---------------------------------------------------------------------------------------------
# state_dict
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_state_dict_round_trip(bias, tmp_path):
    src = make(seed=1, bias=bias)
    dst = make(seed=2, bias=bias)
    x = rand_x(11, D)
    assert not torch.equal(src(x), dst(x))
    path = tmp_path / "moe.pt"
    torch.save(src.state_dict(), path)
    missing, unexpected = dst.load_state_dict(torch.load(path, weights_only=True))
    assert missing == [] and unexpected == []
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)


def test_state_dict_hf_style_keys_load():
    """A checkpoint written with the HF experts names (plain tensors) loads one to one."""
    g = torch.Generator().manual_seed(6)
    sd = {"gate.weight": torch.randn(E, D, generator=g),
          "experts.gate_up_proj": torch.randn(E, 2 * N, D, generator=g) * 0.2,
          "experts.down_proj": torch.randn(E, D, N, generator=g) * 0.3}
    m = make()
    m.load_state_dict(sd)
    assert torch.equal(m.experts.gate_up_proj, sd["experts.gate_up_proj"])
    x = rand_x(5, D)
    ref = moe_ref(x, sd["gate.weight"], sd["experts.gate_up_proj"], sd["experts.down_proj"], top_k=K)[0]
    assert rel_err(m(x), ref) < 1e-6
    with pytest.raises(RuntimeError):
        make(bias=True).load_state_dict(sd)  # biases missing


def test_forward_does_not_mutate():
    m = make(bias=True)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = rand_x(4, D)
    x0 = x.clone()
    m(x).sum().backward()
    assert torch.equal(x, x0)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_public_api_exports():
    for name in ("MoE", "MoEConfig", "moe", "experts", "moe_ref", "experts_ref", "router_topk",
                 "routing_from_topk", "routing_from_pairs", "routing_dense", "load_balancing_loss", "z_loss",
                 "Routing"):
        assert hasattr(sonicmoe, name), name
    assert sonicmoe.load_balancing_loss is load_balancing_loss
    assert sonicmoe.routing_from_topk is routing_from_topk


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kw", [{}, {"routing": "token_rounding", "m_tile": 4, "rounding": "stochastic"}],
                         ids=["topk", "token_rounding"])
def test_activation_checkpointing(backend, kw, device):
    """torch.utils.checkpoint around the layer (non-reentrant): the forward re-run in the backward routes the same
    way (top-k; token rounding's stochastic draws too, the RNG state being restored), so output and every gradient
    equal the plain run's bit for bit (to 1e-5 for the torch baseline on CUDA, whose index_add is not bitwise
    reproducible). On CUDA the kernels run natively; on CPU through the interpreter."""
    import copy

    from torch.utils.checkpoint import checkpoint

    dev = device
    m = make(seed=5, backend=backend, bias=True, **kw).to(dev)
    twin = copy.deepcopy(m)
    x = rand_x(24, D).to(dev).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    torch.manual_seed(11)
    y = checkpoint(m, x, use_reentrant=False)
    (y.square().mean() + m.aux_loss).backward()
    torch.manual_seed(11)
    y2 = twin(x2)
    (y2.square().mean() + twin.aux_loss).backward()
    if backend == "torch" and x.is_cuda:
        # the torch baseline reduces with index_add on CUDA (atomics): its bits vary from run to run
        assert rel_err(y, y2) < 1e-5 and rel_err(x.grad, x2.grad) < 1e-5
        for (name, p), p2 in zip(m.named_parameters(), twin.parameters()):
            assert rel_err(p.grad, p2.grad) < 1e-5, name
        return
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
    for (name, p), p2 in zip(m.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, p2.grad), name


def test_reentrant_checkpointing_takes_the_losses_from_router_info():
    """The README's note: under checkpoint(use_reentrant=True) the ``aux_loss`` attribute is computed in the
    checkpoint's no-grad forward and carries no gradient; with ``return_router_info=True`` the returned aux loss does,
    and the router's gradient equals the plain run's bit for bit."""
    import copy

    from torch.utils.checkpoint import checkpoint

    m = make(seed=6, aux_loss_coef=0.1)
    twin = copy.deepcopy(m)
    x = rand_x(24, D).requires_grad_(True)
    checkpoint(m, x, use_reentrant=True)
    assert m.aux_loss is not None and not m.aux_loss.requires_grad
    info = make(seed=6, aux_loss_coef=0.1, return_router_info=True)
    y, aux, *_ = checkpoint(info, x, use_reentrant=True)
    assert aux.requires_grad
    (y.square().mean() + aux).backward()
    y2 = twin(x.detach())
    (y2.square().mean() + twin.aux_loss).backward()
    assert torch.equal(y, y2) and torch.equal(info.gate.weight.grad, twin.gate.weight.grad)


@pytest.mark.interpreter
def test_deepseek_v3_token_rounding_on_triton(device):
    """Token rounding under DeepSeek-V3's router (sigmoid, renormalised, bias, 2.5) on the triton backend in training:
    output and the gradients of x and every parameter against the float32 oracle (router in torch, token_rounding_ref,
    the experts' per-expert loop on its pairs, scores times 2.5); every expert's count a multiple of M_tile."""
    from sonicmoe.routing import router_topk, routing_from_pairs
    from sonicmoe.token_rounding import token_rounding_ref

    m = make(seed=6, backend="triton", top_k=2, router_order="sigmoid_then_topk", renormalize=True,
             routed_scaling_factor=2.5, routing="token_rounding", m_tile=4, rounding="up").to(device)
    m.e_score_correction_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(2)).to(device) * 0.3)
    m.train()
    x = rand_x(48, D, seed=8).to(device).requires_grad_(True)
    dy = rand_x(48, D, seed=9).to(device)
    params = [x] + list(m.parameters())
    y = m(x)
    grads = torch.autograd.grad(y, params, dy)
    assert (m.expert_counts % 4 == 0).all()
    ex = m.experts
    router = router_topk(x, m.gate.weight, 2, router_order="sigmoid_then_topk", renormalize=True,
                         expert_bias=m.e_score_correction_bias, use_kernel=False)
    tr = token_rounding_ref(router, m_tile=4, subroutine="up", router_order="sigmoid_then_topk", renormalize=True)
    assert tr.pair_added.any(), "the case must add pairs"
    routing = routing_from_pairs(tr.pair_token, tr.pair_expert, 48, E)
    ref = sonicmoe.experts_ref(x, ex.gate_up_proj, ex.down_proj, routing, tr.pair_scores * 2.5)
    grads_ref = torch.autograd.grad(ref, params, dy)
    assert rel_err(y, ref) < 1e-5
    for name, a, b in zip(["x"] + [k for k, _ in m.named_parameters()], grads, grads_ref):
        assert b.norm() > 0, name
        assert rel_err(a, b) < 1e-5, name


@pytest.mark.interpreter
@pytest.mark.parametrize("groups", [(1, 1), (3, 2)], ids=["no_groups", "groups"])
def test_deepseek_v3_routing_on_triton(device, groups):
    """The DeepSeek-V3 options on the triton backend, without and with groups (the router kernel's sigmoid path with
    the bias on CUDA without groups, the torch router with groups and on CPU; the experts on our kernels, natively
    or through the interpreter), float32: output and the gradients of x and every parameter against the float32
    reference (moe_ref: the per-expert loop)."""
    m = make(seed=6, backend="triton", bias=True, top_k=3, router_order="sigmoid_then_topk", renormalize=True,
             routed_scaling_factor=2.5, n_group=groups[0], topk_group=groups[1]).to(device)
    m.e_score_correction_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(2)).to(device) * 0.3)
    x = rand_x(33, D, seed=8).to(device).requires_grad_(True)
    dy = rand_x(33, D, seed=9).to(device)
    params = [x] + list(m.parameters())
    grads = torch.autograd.grad(m(x), params, dy)
    ref = module_ref(m, x)[0]
    grads_ref = torch.autograd.grad(ref, params, dy)
    assert rel_err(m(x), ref) < 1e-5
    for name, a, b in zip(["x"] + [k for k, _ in m.named_parameters()], grads, grads_ref):
        assert b.norm() > 0, name
        assert rel_err(a, b) < 1e-5, name


@pytest.mark.parametrize("routing", ["topk", "token_rounding"])
def test_return_router_info(routing):
    """return_router_info=True: forward returns a MoELayerOutput (output, aux_loss, z_loss, expert_counts), the
    output the plain layer's bits and the rest the attributes' tensors; a loss built from the returned losses gives
    every parameter (and x) the gradient the plain layer gives through its attributes. Both coefficients nonzero,
    then both zero (constant zeros, no history)."""
    for aux, z in ((0.01, 1e-3), (0.0, 0.0)):
        kw = {"aux_loss_coef": aux, "z_loss_coef": z, "routing": routing, "m_tile": 4, "bias": True}
        plain, tupled = make(seed=3, **kw), make(seed=3, return_router_info=True, **kw)
        x = rand_x(2, 11, D, seed=4)
        x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        y1 = plain(x1)
        res = tupled(x2)
        assert isinstance(res, sonicmoe.MoELayerOutput) and len(res) == 4 and res.output is res[0]
        y2, aux_loss, z_loss, counts = res
        assert aux_loss is tupled.aux_loss and z_loss is tupled.z_loss and counts is tupled.expert_counts
        assert torch.equal(counts, plain.expert_counts) and counts.shape == (E,)
        if routing == "topk":
            assert int(counts.sum()) == 22 * K
        else:
            assert (counts % 4 == 0).all()
        assert torch.equal(y1, y2) and torch.equal(plain.aux_loss, aux_loss) and torch.equal(plain.z_loss, z_loss)
        assert (aux_loss.requires_grad, z_loss.requires_grad) == (aux != 0, z != 0)
        dy = rand_x(2, 11, D, seed=5)
        ((y1 * dy).sum() + plain.aux_loss + plain.z_loss).backward()
        ((y2 * dy).sum() + aux_loss + z_loss).backward()
        assert torch.equal(x1.grad, x2.grad)
        for (name, a), b in zip(plain.named_parameters(), tupled.parameters()):
            assert torch.equal(a.grad, b.grad), name
    assert plain.gate.weight.grad.norm() > 0


EXPERT_PARAMS = ["experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_bias", "experts.down_proj_bias"]


@pytest.mark.interpreter
@pytest.mark.parametrize("routing", ["topk", "token_rounding"])
@pytest.mark.parametrize("frozen,x_grad", [
    (["gate.weight"], True), (EXPERT_PARAMS, False), (EXPERT_PARAMS, True), (["experts.down_proj"], False),
    (["experts.gate_up_proj", "gate.weight"], True),
    (["gate.weight", "experts.down_proj", "experts.gate_up_proj_bias", "experts.down_proj_bias"], False)],
    ids=["router", "experts-no-x", "experts", "w2-no-x", "w1-router", "w1-only"])
def test_frozen_parameters_train_the_rest(routing, frozen, x_grad, device):
    """Fine-tuning a part of the layer (the router alone, the experts alone, one projection; x with or without a
    gradient): the frozen parameters get no gradient, and the output and every other gradient, aux loss included,
    equal those of the run where everything trains, bit for bit (the backward leaves out what is not asked for and
    changes nothing else)."""
    import copy

    kw = {"routing": "token_rounding", "m_tile": 4} if routing == "token_rounding" else {}
    m = make(seed=3, backend="triton", bias=True, aux_loss_coef=0.01, **kw).to(device)
    full = copy.deepcopy(m)
    for name, p in m.named_parameters():
        p.requires_grad_(name not in frozen)
    x = rand_x(40, D, seed=4).to(device)
    xa, xb = x.clone().requires_grad_(x_grad), x.clone().requires_grad_(True)
    ya, yb = m(xa), full(xb)
    dout = torch.randn_like(ya)
    ((ya * dout).sum() + m.aux_loss).backward()
    ((yb * dout).sum() + full.aux_loss).backward()
    assert torch.equal(ya, yb)
    assert (xa.grad is None) if not x_grad else torch.equal(xa.grad, xb.grad)
    for (name, p), q in zip(m.named_parameters(), full.parameters(), strict=True):
        if name in frozen:
            assert p.grad is None, name
        else:
            assert p.grad is not None and torch.equal(p.grad, q.grad), name


@pytest.mark.filterwarnings("ignore:token rounding with")
@pytest.mark.parametrize("options", [{}, {"routing": "token_rounding", "m_tile": 4}], ids=["topk", "token_rounding"])
def test_torch_backend_compiles_with_an_empty_batch(options):
    """torch.compile(fullgraph, dynamic) of the torch backend (MoE's default on CPU) through T = 3, 0, 5: an empty
    batch compiled (its per-expert slices of no row left unbacked sizes pending: an internal Dynamo error before
    session 83), and every call gives the eager output and gradients."""
    torch.manual_seed(0)
    _compiled_matches_eager(MoE(16, 8, 4, 2, backend="torch", **options), (3, 0, 5), 1e-6,
                            backend="aot_eager", dynamic=True)


@pytest.mark.filterwarnings("ignore:token rounding with")
def test_torch_backend_compiles_exact_token_rounding():
    """torch.compile(fullgraph) of the torch backend under token rounding with ``static_pairs=False``: R comes from
    nonzero (an unbacked size), and the no-row test on it raised Dynamo's "Could not guard on data-dependent
    expression" (the triton backend compiled); T = 2 routes no pair at all (every expert rounds down), T = 24 some."""
    torch.manual_seed(0)
    m = MoE(16, 8, 4, 1, backend="torch", routing="token_rounding", m_tile=8, static_pairs=False)
    _compiled_matches_eager(m, (24, 2), 1e-6, backend="aot_eager")


def _compiled_matches_eager(m: MoE, tokens, rtol: float, **compile_options) -> None:
    """torch.compile(m, fullgraph=True, **compile_options) against m eager at each T of ``tokens``: the output and the
    gradients of x, W1 and W_r within ``rtol`` (atol 1e-6), after a Dynamo reset (MoE.forward's compiled variants from
    earlier tests count toward Dynamo's recompile limit)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cm = torch.compile(m, fullgraph=True, **compile_options)
    d = m.config.hidden_size
    for t in tokens:
        x = torch.randn(t, d)
        got = []
        for fn in (cm, m):
            xi = x.clone().requires_grad_(True)
            y = fn(xi)
            (y.square().sum() + m.aux_loss).backward()
            got.append((y.detach(), xi.grad, m.experts.gate_up_proj.grad.clone(), m.gate.weight.grad.clone()))
            m.zero_grad()
        assert got[0][0].shape == (t, d) and got[0][1].shape == (t, d)
        for a, b in zip(*got):
            torch.testing.assert_close(a, b, rtol=rtol, atol=1e-6)


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="Inductor on CPU needs $CXX or g++")
@pytest.mark.filterwarnings("ignore:token rounding with")
@pytest.mark.parametrize("options", [{}, {"routing": "token_rounding", "m_tile": 4},
                                     {"routing": "token_rounding", "m_tile": 4, "router_order": "softmax_then_topk",
                                      "renormalize": True}], ids=["topk", "token_rounding", "tr_softmax_renorm"])
def test_torch_backend_compiles_with_inductor(options):
    """torch.compile(fullgraph=True) with its default backend (Inductor) of the torch backend on CPU, as a user
    compiles MoE: forward and backward through T = 16, 16, 24, 1 (a static then a dynamic-shape compile) give the
    eager output and gradients. Before session 86 Inductor's generated code read one expert's unbacked row count
    before defining it (UnboundLocalError at the first call; the torch backend now splits the rows by size), and
    under token rounding read gather's backward buffer before writing it: x and the router weight got gradients
    off by 10-100 % (:func:`sonicmoe.routing.take_chosen`). Of the three cases, "token_rounding" is the one that
    fails without take_chosen in the router; the other uses of take_chosen are kept for the same pattern and checked
    against gather in tests/test_routing.py."""
    torch.manual_seed(0)
    _compiled_matches_eager(MoE(32, 16, 4, 2, backend="torch", **options), (16, 16, 24, 1), 1e-5)


def test_float32_router_beside_bf16_experts():
    """layer.gate.float() beside bfloat16 experts (a common recipe): the experts run in bf16, the router's logits are
    the float32 GEMM of the bf16 input and the float32 weight (the same choice as router_topk's), the output comes
    back in x's dtype close to an all-float32 copy's, and each parameter gets its gradient in its own dtype (this
    raised a dtype error naming w1 before session 83, which took the compute dtype from the router)."""
    torch.manual_seed(0)
    m = MoE(32, 16, 4, 2, backend="torch", aux_loss_coef=0.01).to(torch.bfloat16)
    m.gate.float()
    m32 = MoE(32, 16, 4, 2, backend="torch", aux_loss_coef=0.01)
    m32.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    x = torch.randn(64, 32)
    y = m(x)
    assert y.dtype == torch.float32
    want = sonicmoe.router_topk(x.bfloat16(), m.gate.weight, 2).topk_ids
    assert torch.equal(m.expert_counts, torch.bincount(want.reshape(-1), minlength=4).to(m.expert_counts.dtype))
    ref = m32(x.bfloat16().float())
    assert rel_err(y, ref) < 2e-2
    (y.square().sum() + m.aux_loss).backward()
    assert m.gate.weight.grad.dtype == torch.float32 and m.experts.gate_up_proj.grad.dtype == torch.bfloat16


def test_integral_sizes_and_parameter_dtype_checked():
    """numpy integers are taken as Python ints, by the config and the layers built from it (sizes read from configs or
    arrays); a parameter dtype other than bf16/fp16/fp32/fp64 raises a TypeError naming ``dtype`` (torch's
    requires-grad error, or a float8 sampling error, before session 86); bools stay rejected as sizes."""
    np = pytest.importorskip("numpy")
    m = MoE(np.int64(32), np.int32(16), 4, np.int64(2), m_tile=np.int64(4))
    assert all(type(getattr(m.config, f)) is int for f in ("hidden_size", "intermediate_size", "top_k", "m_tile"))
    assert m(torch.randn(3, 32)).shape == (3, 32)
    for dtype in (torch.int32, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="dtype must be None or one of the parameter dtypes"):
            MoE(32, 16, 4, 2, dtype=dtype)
    assert type(m.gate.in_features) is int and type(m.experts.gate_up_proj.shape[1]) is int
    # every integral option: the expert groups and the shared expert's width too
    c = MoEConfig(32, 16, 4, 2, router_order="sigmoid_then_topk", n_group=np.int64(2), topk_group=np.int32(1),
                  shared_intermediate_size=np.int64(8))
    assert (c.n_group, c.topk_group, c.shared_intermediate_size) == (2, 1, 8)
    assert all(type(getattr(c, f)) is int for f in ("n_group", "topk_group", "shared_intermediate_size"))
    with pytest.raises(ValueError, match="top_k"):
        MoE(32, 16, 4, True)
    # numpy floats (np.float32 is no Python float) for the coefficients, as Python floats; NaN and bools still refused
    c = MoEConfig(32, 16, 4, 2, aux_loss_coef=np.float32(0.5), z_loss_coef=np.float16(0.25),
                  routed_scaling_factor=np.float32(2.5))
    assert (c.aux_loss_coef, c.z_loss_coef, c.routed_scaling_factor) == (0.5, 0.25, 2.5)
    assert all(type(getattr(c, f)) is float for f in ("aux_loss_coef", "z_loss_coef", "routed_scaling_factor"))
    for bad in ({"aux_loss_coef": np.float32("nan")}, {"routed_scaling_factor": np.float32(-1)},
                {"z_loss_coef": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            MoEConfig(32, 16, 4, 2, **bad)


def test_strides_do_not_change_the_bits():
    """A transposed (non-contiguous) x gives the same output and gradients, bit for bit, as its contiguous copy (the
    router's logits GEMM differed in the last bit before session 86)."""
    torch.manual_seed(0)
    m = MoE(32, 16, 4, 2, backend="torch")
    base = torch.randn(32, 24)
    got = []
    for x in (base.t(), base.t().contiguous()):
        x = x.detach().requires_grad_(True)
        y = m(x)
        (y.square().sum() + m.aux_loss).backward()
        got.append((y.detach(), x.grad, m.gate.weight.grad.clone()))
        m.zero_grad()
    assert not base.t().is_contiguous()
    for a, b in zip(*got):
        assert torch.equal(a, b)
