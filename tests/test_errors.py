"""Bad input raises ValueError/TypeError naming the argument, and nothing the caller passes is mutated.

Devices: no GPU on CI, so a device mismatch is simulated with the meta device against the CPU.
"""

from __future__ import annotations

import re

import pytest
import torch

import sonicmoe
from sonicmoe import MoE, MoEConfig
from sonicmoe.ops.torch_experts import experts_torch
from sonicmoe.reference import moe_ref
from sonicmoe.routing import RouterOutput, check_pairs, router_topk, routing_from_pairs, routing_from_topk
from sonicmoe.testing import random_problem
from sonicmoe.token_rounding import token_rounding

T, D, N, E, K = 6, 8, 4, 4, 2


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread():
    """These tests run thousands of tiny CPU ops: use one intra-op thread. torch's CPU softmax wakes an
    OpenMP team on every call, which costs ~10 ms per call when the CPU is shared (CI, parallel jobs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def names(arg: str) -> str:
    """Regex: the message names ``arg`` as a word."""
    return rf"(?<![\w.]){re.escape(arg)}(?!\w)"


@pytest.fixture
def prob():
    return random_problem(T, D, N, E, bias=True, seed=0)


def routing_and_scores(p):
    router = router_topk(p["x"], p["router_weight"], K)
    return routing_from_topk(router.topk_ids, E), router.topk_scores.reshape(-1).detach()


def call_experts(p, **over):
    routing, scores = routing_and_scores(p)
    a = {"x": p["x"], "w1": p["w1"], "w2": p["w2"], "routing": routing, "pair_scores": scores,
         "b1": p["b1"], "b2": p["b2"]}
    kw = {"gate_up_layout": over.pop("gate_up_layout", "concat"), "backend": over.pop("backend", "torch")}
    a.update(over)
    return sonicmoe.experts(a["x"], a["w1"], a["w2"], a["routing"], a["pair_scores"], a["b1"], a["b2"], **kw)


def call_moe(p, **over):
    a = {"x": p["x"], "router_weight": p["router_weight"], "w1": p["w1"], "w2": p["w2"], "b1": p["b1"],
         "b2": p["b2"]}
    kw = {"top_k": K, "backend": "torch"}
    for k in list(over):
        if k in a:
            a[k] = over.pop(k)
    kw.update(over)
    return sonicmoe.moe(a["x"], a["router_weight"], a["w1"], a["w2"], a["b1"], a["b2"], **kw)


def snapshot(p):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in p.items()}


def assert_unchanged(p, before):
    for k, v in before.items():
        if isinstance(v, torch.Tensor):
            assert p[k].dtype == v.dtype and p[k].shape == v.shape, k
            if p[k].device.type != "meta":
                assert torch.equal(p[k], v), f"{k} was mutated"


# ---------------------------------------------------------------------------------------------
# the MoE module
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(5, D + 1), (D - 1,), (2, 3, 2 * D)])
def test_module_wrong_hidden_size(shape):
    m = MoE(D, N, E, K, backend="torch")
    with pytest.raises(ValueError, match="hidden_size") as info:
        m(torch.randn(*shape))
    assert str(tuple(shape)) in str(info.value)


def test_module_scalar_input():
    with pytest.raises(ValueError, match="hidden_size"):
        MoE(D, N, E, K)(torch.tensor(1.0))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_module_non_float_x(dtype):
    m = MoE(D, N, E, K)
    with pytest.raises(TypeError, match=names("x")):
        m(torch.ones(3, D, dtype=dtype))


def test_module_non_tensor_x():
    with pytest.raises(TypeError, match=names("x")):
        MoE(D, N, E, K)([[0.0] * D])


def test_module_device_mismatch():
    """The layer's own message, naming x and the parameters' device (the router's, from router_topk, would name
    router_weight, which the layer's caller never passed)."""
    m = MoE(D, N, E, K, device="meta")
    with pytest.raises(ValueError, match=names("x")) as info:
        m(torch.randn(3, D))
    assert "x is on cpu but the MoE parameters are on meta" in str(info.value)
    m_cpu = MoE(D, N, E, K)
    with pytest.raises(ValueError, match="x is on meta but the MoE parameters are on cpu"):
        m_cpu(torch.empty(3, D, device="meta"))


@pytest.mark.parametrize("top_k", [0, -1, E + 1, 100])
def test_module_top_k_out_of_range(top_k):
    with pytest.raises(ValueError, match="top_k"):
        MoE(D, N, E, top_k)


@pytest.mark.parametrize("opt,val", [("backend", "cuda"), ("backend", "Torch"), ("gate_up_layout", "split"),
                                     ("router_order", "softmax"), ("routing", "expert_choice"),
                                     ("rounding", "floor")])
def test_module_bad_strings(opt, val):
    with pytest.raises(ValueError, match=opt) as info:
        MoE(D, N, E, K, **{opt: val})
    assert repr(val) in str(info.value)


def test_module_unknown_option_and_activation():
    with pytest.raises(TypeError, match="num_expert"):
        MoE(D, N, E, K, num_expert=3)
    with pytest.raises(ValueError, match="activation"):
        MoE(D, N, E, K, activation="gelu")


@pytest.mark.parametrize("field,val", [("hidden_size", 0), ("intermediate_size", -2), ("num_experts", 0),
                                       ("hidden_size", 2.5), ("top_k", 1.0), ("m_tile", 0)])
def test_config_bad_numbers(field, val):
    kw = {"hidden_size": D, "intermediate_size": N, "num_experts": E, "top_k": K}
    kw[field] = val
    with pytest.raises(ValueError, match=field):
        MoEConfig(**kw)


# ---------------------------------------------------------------------------------------------
# functional: sonicmoe.moe / sonicmoe.experts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [0, -2, E + 1])
def test_moe_top_k_out_of_range(prob, top_k):
    with pytest.raises(ValueError, match="top_k"):
        call_moe(prob, top_k=top_k)


def test_moe_top_k_not_int(prob):
    with pytest.raises(ValueError, match="top_k"):
        call_moe(prob, top_k=2.0)


def test_moe_x_last_dim_mismatch(prob):
    x = torch.randn(T, D + 3)
    with pytest.raises(ValueError, match=names("x")) as info:
        call_moe(prob, x=x)
    assert re.search(names("w1"), str(info.value))  # the mismatch is between x and w1: both named


def test_moe_x_wrong_rank(prob):
    for x in (torch.randn(D), torch.randn(2, T, D)):
        with pytest.raises(ValueError, match=names("x")):
            call_moe(prob, x=x)


@pytest.mark.parametrize("shape", [(E + 1, D), (E, D + 1), (E * D,), (1, E, D)])
def test_moe_router_weight_shape(prob, shape):
    with pytest.raises(ValueError, match="router_weight"):
        call_moe(prob, router_weight=torch.randn(*shape))


def test_moe_integer_x_and_router_weight(prob):
    with pytest.raises(TypeError, match=names("x")):
        call_moe(prob, x=torch.ones(T, D, dtype=torch.int64))
    with pytest.raises(TypeError, match="router_weight"):
        call_moe(prob, router_weight=torch.ones(E, D, dtype=torch.int32))


@pytest.mark.parametrize("arg", ["router_weight", "w1", "w2", "b1", "b2"])
def test_moe_device_mismatch(prob, arg):
    meta = prob[arg].to("meta")
    with pytest.raises(ValueError, match=names(arg)) as info:
        call_moe(prob, **{arg: meta})
    assert "meta" in str(info.value)


def test_moe_x_on_other_device(prob):
    with pytest.raises(ValueError, match="meta"):
        call_moe(prob, x=prob["x"].to("meta"))


@pytest.mark.parametrize("opt,val", [("backend", "cuda"), ("gate_up_layout", "split"),
                                     ("router_order", "topk")])
def test_moe_bad_strings(prob, opt, val):
    with pytest.raises(ValueError, match=opt):
        call_moe(prob, **{opt: val})


@pytest.mark.parametrize("arg,shape", [
    ("w1", (E, 2 * N + 1, D)), ("w1", (E, 2 * N, D + 1)), ("w1", (2 * N, D)),
    ("w2", (E, D, N + 1)), ("w2", (E + 1, D, N)), ("w2", (E, N, D)),
    ("b1", (E, N)), ("b1", (E + 1, 2 * N)), ("b2", (E, D, 1)), ("b2", (D,)),
])
@pytest.mark.parametrize("api", ["experts", "moe"])
def test_wrong_weight_shapes(prob, arg, shape, api):
    bad = torch.randn(*shape)
    with pytest.raises(ValueError, match=names(arg)):
        (call_experts if api == "experts" else call_moe)(prob, **{arg: bad})


@pytest.mark.parametrize("api", ["experts", "moe"])
def test_weights_without_intermediate_channels(prob, api):
    """n = 0: w1 (E, 0, d), w2 (E, d, 0) and b1 (E, 0) agree with each other, but an expert without channels is no
    MLP (its output would be the bias alone): a ValueError naming w1 and asking for n >= 1."""
    empty = {"w1": torch.randn(E, 0, D), "w2": torch.randn(E, D, 0), "b1": torch.randn(E, 0)}
    with pytest.raises(ValueError, match=names("w1")) as info:
        (call_experts if api == "experts" else call_moe)(prob, **empty)
    assert "n >= 1" in str(info.value) and f"{(E, 0, D)}" in str(info.value)


@pytest.mark.parametrize("arg", ["w1", "w2", "b1", "b2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_dtypes(prob, arg, dtype):
    with pytest.raises(TypeError, match=names(arg)):
        call_experts(prob, **{arg: prob[arg].to(dtype)})
    with pytest.raises(TypeError, match=names(arg)):
        call_moe(prob, **{arg: prob[arg].to(dtype)})


@pytest.mark.parametrize("arg", ["x", "w1", "w2", "b1", "b2"])
def test_integer_tensors(prob, arg):
    with pytest.raises(TypeError, match=names(arg)):
        call_experts(prob, **{arg: prob[arg].long()})


@pytest.mark.parametrize("arg", ["w1", "w2", "b1", "b2", "pair_scores"])
def test_experts_device_mismatch(prob, arg):
    if arg == "pair_scores":
        bad = routing_and_scores(prob)[1].to("meta")
    else:
        bad = prob[arg].to("meta")
    with pytest.raises(ValueError, match=names(arg)) as info:
        call_experts(prob, **{arg: bad})
    assert "meta" in str(info.value) and "cpu" in str(info.value)


def test_experts_routing_mismatch(prob):
    other_t = routing_from_topk(torch.zeros(T + 1, 1, dtype=torch.long), E)
    with pytest.raises(ValueError, match=f"routing is for T={T + 1} tokens but x has T={T}"):
        call_experts(prob, routing=other_t, pair_scores=torch.rand(T + 1))
    other_e = routing_from_topk(torch.zeros(T, K, dtype=torch.long), E + 2)
    with pytest.raises(ValueError, match=f"routing is for E={E + 2} experts but w1 has E={E}"):  # not its arrays' size
        call_experts(prob, routing=other_e)
    meta_routing = routing_from_topk(torch.zeros(T, K, dtype=torch.long, device="meta"), E)
    with pytest.raises(ValueError, match="routing"):
        call_experts(prob, routing=meta_routing)


@pytest.mark.parametrize("hint", [-128, -1, 128.0, "128", True])
def test_experts_bad_tile_rows_hint(prob, hint):
    """routing.tile_rows, the kernels' hint, must be an int >= 0; the routing is left as it was."""
    routing = routing_from_topk(torch.zeros(T, K, dtype=torch.long), E)
    routing.tile_rows = hint
    with pytest.raises(ValueError, match="tile_rows"):
        call_experts(prob, routing=routing)
    assert routing.tile_rows is hint


def test_experts_pair_scores(prob):
    with pytest.raises(ValueError, match="pair_scores"):
        call_experts(prob, pair_scores=torch.rand(T * K + 1))
    with pytest.raises(ValueError, match="pair_scores"):
        call_experts(prob, pair_scores=torch.rand(T, K))
    # a column (R, 1): the right length first, but not (R,) (it broadcast against the (R, d) rows)
    with pytest.raises(ValueError, match="pair_scores") as info:
        call_experts(prob, pair_scores=torch.rand(T * K, 1))
    assert f"(R={T * K},)" in str(info.value) and f"{(T * K, 1)}" in str(info.value)
    with pytest.raises(TypeError, match="pair_scores"):
        call_experts(prob, pair_scores=torch.ones(T * K, dtype=torch.int64))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("opt,val", [("backend", "gpu"), ("gate_up_layout", "gate_up")])
def test_experts_bad_strings(prob, opt, val, backend):
    """An unknown string is refused up front on either backend (the triton up-projection reads any layout but
    "concat" as interleaved, and the torch backend's SwiGLU refuses it only after the up-projection ran)."""
    with pytest.raises(ValueError, match=opt) as info:
        call_experts(prob, **{"backend": backend, opt: val})
    assert repr(val) in str(info.value)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("val", ["gelu", ["swiglu"]])
def test_experts_bad_activation_refused_up_front(prob, val, backend, monkeypatch):
    """An unknown activation is refused by sonicmoe.experts itself, before either backend runs (both are stubbed to
    fail here): the torch backend's SwiGLU would refuse it only after the up-projection, and the kernels' lookup of a
    list (unhashable) raised a TypeError; a ValueError naming the argument and the value either way."""
    from sonicmoe.ops import moe_function, torch_experts

    def ran(*args, **kwargs):
        raise AssertionError("a backend ran with an unknown activation")

    monkeypatch.setattr(torch_experts, "experts_torch", ran)
    monkeypatch.setattr(moe_function, "experts_triton", ran)
    routing, scores = routing_and_scores(prob)
    with pytest.raises(ValueError, match=names("activation")) as info:
        sonicmoe.experts(prob["x"], prob["w1"], prob["w2"], routing, scores, prob["b1"], prob["b2"], backend=backend,
                         activation=val)
    assert repr(val) in str(info.value)


def test_router_topk_bad_order(prob):
    with pytest.raises(ValueError, match="router_order"):
        router_topk(prob["x"], prob["router_weight"], K, router_order="softmax_topk")
    with pytest.raises(ValueError, match="router_order"):
        moe_ref(prob["x"], prob["router_weight"], prob["w1"], prob["w2"], top_k=K, router_order="x")
    with pytest.raises(ValueError, match="gate_up_layout"):
        moe_ref(prob["x"], prob["router_weight"], prob["w1"], prob["w2"], top_k=K, gate_up_layout="x")


# ---------------------------------------------------------------------------------------------
# routing constructors and check_pairs
# ---------------------------------------------------------------------------------------------


def test_routing_from_pairs_mismatched_shapes():
    with pytest.raises(ValueError, match="pair_token") as info:
        routing_from_pairs(torch.arange(4), torch.arange(3), 4, 4)
    assert "pair_expert" in str(info.value)
    with pytest.raises(ValueError, match="pair_token"):
        routing_from_pairs(torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long), 2, 2)


@pytest.mark.parametrize("arg", ["pair_token", "pair_expert"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.complex64])
def test_routing_from_pairs_non_integer_indices(arg, dtype):
    """Bool, float or complex indices are a TypeError naming the argument, without ``check`` too (bools read as
    tokens/experts 0 and 1, silently, where the check was missed); the same indices as integers are taken."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    a = {"pair_token": torch.randint(0, 2, (6,), generator=g), "pair_expert": torch.randint(0, 2, (6,), generator=g)}
    assert routing_from_pairs(a["pair_token"], a["pair_expert"], 2, 2).num_rows == 6
    a[arg] = a[arg].to(dtype)
    with pytest.raises(TypeError, match=f"{arg} must be an integer tensor") as info:
        routing_from_pairs(a["pair_token"], a["pair_expert"], 2, 2)
    assert str(dtype) in str(info.value)


def test_routing_from_topk_bad_rank():
    with pytest.raises(ValueError, match="topk_ids"):
        routing_from_topk(torch.arange(4), 4)
    with pytest.raises(ValueError, match="topk_ids"):
        routing_from_topk(torch.zeros(2, 2, 2, dtype=torch.long), 4)


@pytest.mark.parametrize("tok,exp,arg", [
    ([0, 1, 4], [0, 1, 2], "pair_token"),     # token 4 >= T = 4
    ([0, -1, 2], [0, 1, 2], "pair_token"),
    ([0, 1, 2], [0, 3, 2], "pair_expert"),    # expert 3 >= E = 3
    ([0, 1, 2], [-1, 1, 2], "pair_expert"),
])
def test_check_pairs_out_of_range(tok, exp, arg):
    """The message names the argument, the bound by its letter and value (T for tokens, E for experts) and the range
    of the values given."""
    tok, exp = torch.tensor(tok), torch.tensor(exp)
    tok0, exp0 = tok.clone(), exp.clone()
    with pytest.raises(ValueError, match=arg) as info:
        check_pairs(tok, exp, 4, 3)
    assert torch.equal(tok, tok0) and torch.equal(exp, exp0)
    idx, bound = (tok, "T=4") if arg == "pair_token" else (exp, "E=3")
    assert str(info.value) == f"{arg} must lie in [0, {bound}), got values in [{int(idx.min())}, {int(idx.max())}]"


def test_check_pairs_non_integer():
    """Float, bool and complex indices are a TypeError naming the argument (complex ones were cast to their real
    part with a warning, session 99)."""
    with pytest.raises(TypeError, match="pair_token"):
        check_pairs(torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), 4, 4)
    with pytest.raises(TypeError, match="pair_expert"):
        check_pairs(torch.tensor([0, 1]), torch.tensor([True, False]), 4, 4)
    with pytest.raises(TypeError, match="pair_expert must be an integer tensor, got torch.complex64"):
        check_pairs(torch.tensor([0, 1]), torch.tensor([0, 1], dtype=torch.complex64), 4, 4)


# ---------------------------------------------------------------------------------------------
# nothing the caller passed is mutated
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["moe", "experts", "experts_torch", "moe_ref", "router_topk"])
def test_inputs_not_mutated_forward_backward(api):
    p = {k: v.requires_grad_() for k, v in random_problem(T, D, N, E, bias=True, seed=1).items()}
    tok = torch.tensor([0, 3, 1, 3, 5, 0])
    exp = torch.tensor([1, 1, 0, 2, 3, 3])
    scores = torch.rand(6).requires_grad_()
    aux = {"tok": tok, "exp": exp, "scores": scores}
    before, before_aux = snapshot(p), snapshot(aux)
    routing = routing_from_pairs(tok, exp, T, E)
    routing_before = {k: v.clone() for k, v in vars(routing).items() if isinstance(v, torch.Tensor)}
    if api == "moe":
        out = call_moe(p).out
    elif api == "experts":
        out = sonicmoe.experts(p["x"], p["w1"], p["w2"], routing, scores, p["b1"], p["b2"], backend="torch")
    elif api == "experts_torch":
        out = experts_torch(p["x"], p["w1"], p["w2"], routing, scores, p["b1"], p["b2"],
                            gate_up_layout="interleaved")
    elif api == "moe_ref":
        out = moe_ref(p["x"], p["router_weight"], p["w1"], p["w2"], p["b1"], p["b2"], top_k=K)[0]
    else:
        out = router_topk(p["x"], p["router_weight"], K, router_order="softmax_then_topk",
                          renormalize=True).topk_scores
    out.square().sum().backward()
    assert_unchanged(p, before)
    assert_unchanged(aux, before_aux)
    for k, v in routing_before.items():
        assert torch.equal(getattr(routing, k), v), k
    assert all(v.requires_grad for v in p.values())


def test_inputs_not_mutated_on_error(prob):
    before = snapshot(prob)
    with pytest.raises(TypeError):
        call_experts(prob, w2=prob["w2"].half())
    with pytest.raises(ValueError):
        call_moe(prob, top_k=E + 1)
    with pytest.raises(ValueError):
        call_moe(prob, b1=torch.randn(E, 2 * N + 2))
    assert_unchanged(prob, before)


def test_module_does_not_mutate_x_in_low_precision():
    m = MoE(D, N, E, K, dtype=torch.bfloat16, backend="torch")
    x = torch.randn(T, D)
    x0 = x.clone()
    m(x)
    assert torch.equal(x, x0) and x.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# every argument, corrupted one way at a time
# ---------------------------------------------------------------------------------------------

# the tensor arguments of each public call and their ranks (the sweep grows or empties each dimension)
SWEPT = {
    "experts": {"x": 2, "w1": 3, "w2": 3, "pair_scores": 1, "b1": 2, "b2": 2},
    "moe": {"x": 2, "router_weight": 2, "w1": 3, "w2": 3, "b1": 2, "b2": 2},
    "router_topk": {"x": 2, "router_weight": 2, "expert_bias": 1},
    "routing_from_topk": {"topk_ids": 2},
    "experts_ref": {"x": 2, "w1": 3, "w2": 3, "pair_scores": 1, "b1": 2, "b2": 2},
    "moe_ref": {"x": 2, "router_weight": 2, "w1": 3, "w2": 3, "b1": 2, "b2": 2},
    "token_rounding": {"router.logits": 2, "router.probs": 2, "router.topk_ids": 2, "router.topk_scores": 2},
    "load_balancing_loss": {"probs": 2},
    "z_loss": {"logits": 2},
}
FLAT = ("list", "none", "meta", "int_or_float", "bool", "complex64", "float64", "float16", "extra_dim", "first_row")
# valid inputs among the corruptions (the call must then succeed): optional biases, another T or E, the float dtypes
# the call takes, and for routing_from_topk anything integer of shape (T', K') (its ids' values are the caller's
# promise, unchecked so as not to sync)
ACCEPTED = {
    "experts": {("pair_scores", "float16"), ("pair_scores", "float64/torch"), ("b1", "none"), ("b2", "none")},
    "moe": {("x", "grow0"), ("x", "empty0"), ("router_weight", "float16"), ("router_weight", "float64/torch"),
            ("b1", "none"), ("b2", "none")},
    "router_topk": {("x", "float16"), ("x", "float64"), ("x", "grow0"), ("x", "empty0"), ("router_weight", "float16"),
                    ("router_weight", "float64"), ("expert_bias", "float16"),
                    ("expert_bias", "float64"), ("expert_bias", "none")},
    "routing_from_topk": {("topk_ids", "meta"), ("topk_ids", "grow0"), ("topk_ids", "empty0"), ("topk_ids", "grow1"),
                          ("topk_ids", "empty1")},
    # the references compute in float32 (float64) whatever float dtype each input has
    "experts_ref": {(a, f) for a in SWEPT["experts"] for f in ("float16", "float64")}
    | {("b1", "none"), ("b2", "none")},
    "moe_ref": {(a, f) for a in SWEPT["moe"] for f in ("float16", "float64")}
    | {("x", "grow0"), ("x", "empty0"), ("b1", "none"), ("b2", "none")},
    "token_rounding": {(a, f) for a in ("router.logits", "router.probs", "router.topk_scores")
                       for f in ("float16", "float64")} | {("router.probs", "none")},  # probs: computed when None
    "load_balancing_loss": {("probs", "float16"), ("probs", "float64")},
    # z-loss needs only (T', E') float logits, on any device
    "z_loss": {("logits", f) for f in ("meta", "float16", "float64", "grow0", "empty0", "grow1", "empty1")},
}
PARTNER = {("router_topk", "router_weight", "grow0"): "expert_bias"}  # a new E that the (E,) bias no longer matches


def _corrupt(v: torch.Tensor, how: str):
    if how in ("list", "none"):
        return v.tolist() if how == "list" else None
    if how in ("meta", "bool", "complex64", "float64", "float16"):
        return v.to({"meta": "meta", "bool": torch.bool, "complex64": torch.complex64, "float64": torch.float64,
                     "float16": torch.float16}[how])
    if how == "int_or_float":
        return v.to(torch.int32) if v.dtype.is_floating_point else v.float()
    if how == "extra_dim":
        return v.unsqueeze(0)
    if how == "first_row":
        return v[0]
    shape = list(v.shape)
    shape[int(how[-1])] = 0 if how.startswith("empty") else shape[int(how[-1])] + 1
    return torch.randn(shape).to(v.dtype) if v.dtype.is_floating_point else torch.zeros(shape, dtype=v.dtype)


def _sweep_cases():
    for api, args in SWEPT.items():
        for backend in (("torch", "triton") if api in ("experts", "moe", "token_rounding") else ("-",)):
            for arg, rank in args.items():
                for how in FLAT + tuple(f"{g}{i}" for g in ("grow", "empty") for i in range(rank)):
                    yield pytest.param(api, backend, arg, how, id=f"{api}-{backend}-{arg}-{how}",
                                       marks=pytest.mark.interpreter if backend == "triton" else ())


@pytest.mark.parametrize("api,backend,arg,how", list(_sweep_cases()))
def test_each_argument_corrupted(prob, api, backend, arg, how):
    """One tensor argument of a public call (the layer's functions, the router, the routing, token rounding's router
    fields, the references and the losses; "triton": the kernels, through the interpreter on CPU) replaced by a
    corruption of it (a list, None, the meta device, an integer, bool, complex or other float dtype, one dimension
    more or less, one dimension one longer or empty): the call succeeds where that is a valid input (ACCEPTED), else
    raises TypeError/ValueError whose message names the argument — never AttributeError, IndexError or torch's
    RuntimeError from inside."""
    router = router_topk(prob["x"], prob["router_weight"], K, router_order="sigmoid_then_topk")
    routing, scores = routing_from_topk(router.topk_ids, E), router.topk_scores.reshape(-1).detach()
    values = {**prob, "pair_scores": scores, "expert_bias": torch.randn(E), "topk_ids": router.topk_ids,
              "probs": router.probs.detach(), "logits": router.logits.detach()}
    values.update({f"router.{k}": values[k] for k in ("logits", "probs", "topk_ids")}, **{
        "router.topk_scores": scores.reshape(T, K)})
    a = {name: values[name] for name in SWEPT[api]}
    a[arg] = _corrupt(a[arg], how)
    calls = {
        "experts": lambda: sonicmoe.experts(a["x"], a["w1"], a["w2"], routing, a["pair_scores"], a["b1"], a["b2"],
                                            backend=backend),
        "moe": lambda: sonicmoe.moe(a["x"], a["router_weight"], a["w1"], a["w2"], a["b1"], a["b2"], top_k=K,
                                    backend=backend),
        "router_topk": lambda: router_topk(a["x"], a["router_weight"], K, router_order="sigmoid_then_topk",
                                           expert_bias=a["expert_bias"]),
        "routing_from_topk": lambda: routing_from_topk(a["topk_ids"], E),
        "experts_ref": lambda: sonicmoe.experts_ref(a["x"], a["w1"], a["w2"], routing, a["pair_scores"], a["b1"],
                                                    a["b2"]),
        "moe_ref": lambda: moe_ref(a["x"], a["router_weight"], a["w1"], a["w2"], a["b1"], a["b2"], top_k=K),
        "token_rounding": lambda: token_rounding(
            RouterOutput(a["router.logits"], a["router.probs"], a["router.topk_ids"], a["router.topk_scores"],
                         sigmoid=True), m_tile=2, router_order="sigmoid_then_topk", use_kernel=backend == "triton",
            warn=False),
        "load_balancing_loss": lambda: sonicmoe.load_balancing_loss(a["probs"], routing),
        "z_loss": lambda: sonicmoe.z_loss(a["logits"]),
    }
    accepted = ACCEPTED[api]
    if (arg, how) in accepted or (backend == "torch" and (arg, f"{how}/torch") in accepted):
        calls[api]()
        return
    with pytest.raises((TypeError, ValueError), match=names(PARTNER.get((api, arg, how), arg))):
        calls[api]()


@pytest.mark.parametrize("top_k", [0, E + 1, 2.0, True, None])
def test_router_top_k_out_of_range(prob, top_k):
    """router_topk's K: an int in [1, E], else a ValueError naming top_k (not torch.topk's RuntimeError)."""
    with pytest.raises(ValueError, match=names("top_k")):
        router_topk(prob["x"], prob["router_weight"], top_k)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arg", ["routing", "pair_scores"])
def test_experts_requires_routing_and_scores(prob, backend, arg):
    """experts without its routing or its pair scores: a TypeError naming the argument, on either backend."""
    with pytest.raises(TypeError, match=names(arg)):
        call_experts(prob, backend=backend, **{arg: None})


@pytest.mark.parametrize("arg", ["routing", "pair_scores"])
def test_experts_ref_requires_routing_and_scores(prob, arg):
    """The reference without its routing or its pair scores: the same TypeError naming the argument as the layer's
    (not an AttributeError from inside its loop; check_expert_inputs skips a None routing or scores)."""
    routing, scores = routing_and_scores(prob)
    a = {"routing": routing, "pair_scores": scores, arg: None}
    with pytest.raises(TypeError, match=names(arg)):
        sonicmoe.experts_ref(prob["x"], prob["w1"], prob["w2"], a["routing"], a["pair_scores"], prob["b1"],
                             prob["b2"])


def test_token_rounding_order_must_be_the_routers(prob):
    """A router that chose by sigmoid_then_topk, handed to token rounding under another order (whose added pairs'
    scores would then come from the softmax formula): a ValueError naming router_order."""
    router = router_topk(prob["x"], prob["router_weight"], K, router_order="sigmoid_then_topk")
    for order in ("topk_then_softmax", "softmax_then_topk"):
        with pytest.raises(ValueError, match=names("router_order")):
            token_rounding(router, m_tile=2, router_order=order, warn=False)
    token_rounding(router, m_tile=2, router_order="sigmoid_then_topk", warn=False)
