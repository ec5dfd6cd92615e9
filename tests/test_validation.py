"""Input contract of the public entry points beyond tests/test_errors.py: float64 and the backends,
strides, routing metadata and index checks, non-finite values.

On CPU the triton backend runs through Triton's interpreter (float32).
"""

from __future__ import annotations

import re

import pytest
import torch

import sonicmoe
from sonicmoe import MoE
from sonicmoe.functional import resolve_backend
from sonicmoe.routing import Routing, router_topk, routing_from_pairs, routing_from_topk
from sonicmoe.testing import OnCuda, random_problem, rel_err

T, D, N, E, K = 9, 16, 8, 4, 2

BACKENDS = ["triton", "torch"]


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    """Every Triton kernel output starts as NaN (SONICMOE_POISON_OUTPUTS=1): an element no program writes fails."""
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")


def names(arg: str) -> str:
    """Regex: the message names ``arg`` as a word."""
    return rf"(?<![\w.]){re.escape(arg)}(?!\w)"


def problem(dtype=torch.float32, bias=True, seed=0, device="cpu"):
    p = random_problem(T, D, N, E, bias=bias, seed=seed, dtype=dtype, device=device)
    router = router_topk(p["x"], p["router_weight"], K)
    p["routing"] = routing_from_topk(router.topk_ids, E)
    p["scores"] = router.topk_scores.reshape(-1).detach()
    return p


def general_routing(device="cpu"):
    """Pairs in no particular order (slot_pair is set): token 0 has experts 0, 1 and 3, token 3 has none,
    expert 2 is empty."""
    tok = torch.tensor([5, 0, 8, 0, 1, 7, 2, 0, 4, 6, 1], device=device)
    exp = torch.tensor([1, 0, 3, 1, 3, 0, 0, 3, 1, 1, 1], device=device)
    return routing_from_pairs(tok, exp, T, E)


def run_experts(p, backend, *, routing=None, scores=None, grad=False, **over):
    """sonicmoe.experts on p (or the overrides); with ``grad`` also the gradients of a fixed loss."""
    a = {k: p[k] for k in ("x", "w1", "w2", "b1", "b2")}
    a.update(over)
    routing = p["routing"] if routing is None else routing
    scores = p["scores"] if scores is None else scores
    if grad:
        a = {k: (v.detach().requires_grad_(True) if v is not None else None) for k, v in a.items()}
        scores = scores.detach().requires_grad_(True)
    out = sonicmoe.experts(a["x"], a["w1"], a["w2"], routing, scores, a["b1"], a["b2"], backend=backend)
    if not grad:
        return out
    g = torch.Generator().manual_seed(3)
    out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
    return out.detach(), {k: v.grad for k, v in {**a, "scores": scores}.items() if v is not None}


# ---------------------------------------------------------------------------------------------
# dtypes: bf16/fp16/fp32 everywhere; float64 only on the torch backend
# ---------------------------------------------------------------------------------------------


def test_float64_runs_on_torch_backend_and_auto():
    p = problem(torch.float64)
    ref = sonicmoe.experts_ref(p["x"], p["w1"], p["w2"], p["routing"], p["scores"], p["b1"], p["b2"])
    for backend in ("torch", "auto"):
        out = run_experts(p, backend)
        assert out.dtype == torch.float64 and rel_err(out, ref) < 1e-12
    res = sonicmoe.moe(p["x"], p["router_weight"], p["w1"], p["w2"], p["b1"], p["b2"], top_k=K, backend="torch")
    assert res.out.dtype == torch.float64
    assert resolve_backend("auto", p["x"]) == "torch"
    # on CUDA too: auto picks the triton kernels only for the dtypes they take
    on_cuda = torch.Tensor._make_subclass(OnCuda, p["x"])
    assert resolve_backend("auto", on_cuda) == "torch"
    assert resolve_backend("auto", torch.Tensor._make_subclass(OnCuda, p["x"].float())) == "triton"


def test_resolve_backend_checks_its_arguments():
    """An unknown backend is a ValueError naming it, and x that is no tensor a TypeError naming x, also under
    "auto" (which asks x for its device and dtype: an AttributeError from a list) and through sonicmoe.experts."""
    p = problem()
    with pytest.raises(ValueError, match="backend") as info:
        resolve_backend("cuda", p["x"])
    assert "'cuda'" in str(info.value)
    rows = p["x"].tolist()
    for backend in ("auto", "torch", "triton"):
        with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
            resolve_backend(backend, rows)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        sonicmoe.experts(rows, p["w1"], p["w2"], p["routing"], p["scores"], backend="auto")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_auto_backend_is_torch_off_cuda(dtype):
    """"auto" picks the triton kernels for CUDA tensors only: tensors on the CPU or on the meta device (shape-only
    tracing) get the torch backend in every dtype the kernels take, not just those on the CPU (a rule of "not on the
    CPU" sent meta tensors to the kernels; mutation audit up18_)."""
    for device in ("cpu", "meta"):
        assert resolve_backend("auto", torch.empty(3, D, device=device, dtype=dtype)) == "torch", device
        assert resolve_backend("triton", torch.empty(3, D, device=device, dtype=dtype)) == "triton", device


@pytest.mark.parametrize("arg", ["x", "pair_scores"])
def test_float64_rejected_by_triton_backend(arg):
    p = problem(torch.float64 if arg == "x" else torch.float32)
    scores = p["scores"].double() if arg == "pair_scores" else p["scores"]
    with pytest.raises(TypeError, match=names(arg)) as info:
        run_experts(p, "triton", scores=scores)
    assert "float64" in str(info.value) and "backend='torch'" in str(info.value)


def test_float64_moe_triton_names_the_argument():
    p = problem(torch.float64)
    with pytest.raises(TypeError, match=names("x")):
        sonicmoe.moe(p["x"], p["router_weight"], p["w1"], p["w2"], top_k=K, backend="triton")
    p32 = problem()
    with pytest.raises(TypeError, match="router_weight") as info:
        sonicmoe.moe(p32["x"], p32["router_weight"].double(), p32["w1"], p32["w2"], top_k=K, backend="triton")
    assert "float64" in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8, torch.complex128])
def test_other_dtypes_rejected(dtype):
    p = problem()
    with pytest.raises(TypeError, match=names("w2")) as info:
        run_experts(p, "torch", w2=p["w2"].to(dtype))
    assert "bfloat16, float16 or float32" in str(info.value)


@pytest.mark.interpreter
def test_module_float64():
    """x of any float dtype is cast to the parameters' dtype; float64 parameters need the torch backend."""
    m = MoE(D, N, E, K, backend="triton")
    x = torch.randn(T, D, dtype=torch.float64)
    y = m(x)
    assert y.dtype == torch.float64 and rel_err(y, m(x.float())) == 0.0
    m64 = MoE(D, N, E, K, backend="triton", dtype=torch.float64)
    with pytest.raises(TypeError, match="parameters") as info:
        m64(x)
    assert "backend='torch'" in str(info.value)
    for backend in ("torch", "auto"):
        assert MoE(D, N, E, K, backend=backend, dtype=torch.float64)(x).dtype == torch.float64


def test_top_k_bool_rejected():
    p = problem()
    with pytest.raises(ValueError, match="top_k"):
        sonicmoe.moe(p["x"], p["router_weight"], p["w1"], p["w2"], top_k=True, backend="torch")


# ---------------------------------------------------------------------------------------------
# strides: any layout is accepted, gives the contiguous result, and nothing passed is modified
# ---------------------------------------------------------------------------------------------


def _non_contiguous(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values in a non-contiguous layout: a transposed view or every other element of a bigger
    buffer."""
    if how == "transposed" and t.dim() >= 2:
        return t.transpose(-2, -1).contiguous().transpose(-2, -1)
    big = torch.stack([t, torch.full_like(t, float("nan"))], dim=-1)  # NaN in the gaps: a stray read shows
    return big[..., 0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["transposed", "strided"])
@pytest.mark.parametrize("routing_kind", ["topk", "general"])
def test_non_contiguous_inputs(backend, how, routing_kind):
    p = problem()
    routing = p["routing"] if routing_kind == "topk" else general_routing()
    g = torch.Generator().manual_seed(5)
    scores = torch.rand(routing.num_rows, generator=g)
    out, grads = run_experts(p, backend, routing=routing, scores=scores, grad=True)
    views = {k: _non_contiguous(p[k], how) for k in ("x", "w1", "w2", "b1", "b2")}
    views_scores = _non_contiguous(scores, "strided")
    if how == "transposed":
        assert not views["x"].is_contiguous() and not views["w1"].is_contiguous()
    assert not views_scores.is_contiguous()
    before = {k: (v.clone(), v.stride()) for k, v in {**views, "scores": views_scores}.items()}
    out_v, grads_v = run_experts(p, backend, routing=routing, scores=views_scores, grad=True, **views)
    # equal up to float32 rounding (BLAS takes other paths for strided operands)
    assert rel_err(out_v, out) < 1e-6
    for k in grads:
        assert rel_err(grads_v[k], grads[k]) < 1e-6, k
    for k, v in {**views, "scores": views_scores}.items():
        assert torch.equal(v, before[k][0]) and v.stride() == before[k][1], f"{k} was modified"


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_non_contiguous_x(backend):
    m = MoE(D, N, E, K, backend=backend)
    x = torch.randn(T, D)
    xt = x.t().contiguous().t()
    x0 = xt.clone()
    assert rel_err(m(xt), m(x)) < 1e-6 and torch.equal(xt, x0) and xt.stride() == (1, T)


# ---------------------------------------------------------------------------------------------
# routing: the metadata's type/shapes/dtypes (checked, no sync) and index ranges (opt-in, syncs)
# ---------------------------------------------------------------------------------------------


def test_experts_routing_type():
    p = problem()
    with pytest.raises(TypeError, match="routing") as info:
        run_experts(p, "torch", routing=(p["routing"].row_token, p["routing"].expert_offsets))
    assert "Routing" in str(info.value)


@pytest.mark.parametrize("field,bad,exc", [
    ("expert_offsets", lambda v: v[:-1], ValueError),
    ("token_offsets", lambda v: torch.cat([v, v[-1:]]), ValueError),
    ("token_rows", lambda v: v[:-1], ValueError),
    ("row_pair", lambda v: v.float(), TypeError),
    ("slot_pair", lambda v: torch.zeros(3, dtype=torch.int32), ValueError),
    ("row_token", lambda v: v[:, None], ValueError),  # (R, 1): the right length first, one dimension too many
    ("pair_row", lambda v: None, TypeError),  # only slot_pair may be None (top-k routing has none)
    ("token_offsets", lambda v: None, TypeError),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_routing_fields(field, bad, exc, backend):
    p = problem()
    routing = general_routing()
    fields = {f: getattr(routing, f) for f in ("expert_offsets", "row_token", "row_pair", "pair_row",
                                               "token_offsets", "token_rows", "slot_pair")}
    fields[field] = bad(fields[field])
    broken = Routing(routing.num_tokens, routing.num_experts, **fields)
    with pytest.raises(exc, match=f"routing.{field}") as info:
        run_experts(p, backend, routing=broken, scores=torch.rand(routing.num_rows))
    if exc is ValueError:
        assert re.search(r"\((E\+1|T\+1|R)=\d+,\)", str(info.value)), "names the expected length"


@pytest.mark.parametrize("arg", ["pair_token", "pair_expert"])
@pytest.mark.parametrize("bad", [torch.tensor([0.0, 1.0]), torch.tensor([True, False]), [0, 1]],
                         ids=["float", "bool", "list"])
def test_routing_from_pairs_index_types(arg, bad):
    good = torch.tensor([0, 1])
    args = {"pair_token": good, "pair_expert": good, arg: bad}
    with pytest.raises(TypeError, match=arg):
        routing_from_pairs(args["pair_token"], args["pair_expert"], 3, 3)


def test_routing_from_pairs_devices_and_sizes():
    tok = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="pair_expert") as info:
        routing_from_pairs(tok, tok.to("meta"), 3, 3)
    assert "meta" in str(info.value)
    for kw, arg in (({"num_tokens": -1}, "num_tokens"), ({"num_experts": 0}, "num_experts"),
                    ({"num_tokens": 3.0}, "num_tokens"), ({"num_experts": True}, "num_experts")):
        args = {"num_tokens": 3, "num_experts": 3, **kw}
        with pytest.raises(ValueError, match=arg):
            routing_from_pairs(tok, tok, args["num_tokens"], args["num_experts"])


@pytest.mark.parametrize("tok,exp,arg,rng", [
    ([0, 1, 9], [0, 1, 2], "pair_token", "[0, T=9)"),
    ([0, -1, 2], [0, 1, 2], "pair_token", "[0, T=9)"),
    ([0, 1, 2], [0, 4, 2], "pair_expert", "[0, E=4)"),
    ([0, 1, 2], [0, 1, -3], "pair_expert", "[0, E=4)"),
])
def test_routing_from_pairs_check(tok, exp, arg, rng):
    """check=True (opt-in, synchronises) rejects out-of-range indices; the default builds without reading
    any value back (the ranges are the caller's promise)."""
    tok, exp = torch.tensor(tok), torch.tensor(exp)
    with pytest.raises(ValueError, match=arg) as info:
        routing_from_pairs(tok, exp, T, E, check=True)
    assert rng in str(info.value)
    routing_from_pairs(tok, exp, T, E)  # no check by default


def test_routing_from_pairs_check_passes_valid_pairs():
    tok = torch.tensor([5, 0, 8, 0, 1])
    exp = torch.tensor([1, 0, 3, 1, 3])
    a, b = routing_from_pairs(tok, exp, T, E, check=True), routing_from_pairs(tok, exp, T, E)
    for f in ("expert_offsets", "row_token", "row_pair", "pair_row", "token_offsets", "token_rows", "slot_pair"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


# ---------------------------------------------------------------------------------------------
# non-finite inputs: NaN/Inf in one token stay in that token
# ---------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy in the interpreter
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("routing_kind", ["topk", "general"])
def test_non_finite_x_stays_in_its_token(backend, value, routing_kind):
    p = problem()
    routing = p["routing"] if routing_kind == "topk" else general_routing()
    scores = torch.rand(routing.num_rows, generator=torch.Generator().manual_seed(6))
    bad_token = 0  # several experts in both routings
    x_bad = p["x"].clone()
    x_bad[bad_token, 3] = value
    out, grads = run_experts(p, backend, routing=routing, scores=scores, grad=True)
    out_b, grads_b = run_experts(p, backend, routing=routing, scores=scores, grad=True, x=x_bad)
    others = torch.arange(T) != bad_token
    assert not torch.isfinite(out_b[bad_token]).all()
    assert torch.isfinite(out_b[others]).all()
    torch.testing.assert_close(out_b[others], out[others], rtol=1e-6, atol=1e-6)
    # backward: dX of the other tokens and dS of their pairs stay finite and unchanged
    pair_token = routing.row_token[routing.pair_row.long()]
    other_pairs = pair_token != bad_token
    torch.testing.assert_close(grads_b["x"][others], grads["x"][others], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads_b["scores"][other_pairs], grads["scores"][other_pairs], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_in_token_without_experts_and_in_a_score(backend):
    p = problem()
    routing = general_routing()  # token 3 has no expert
    scores = torch.rand(routing.num_rows, generator=torch.Generator().manual_seed(7))
    x_bad = p["x"].clone()
    x_bad[3] = float("nan")
    out = run_experts(p, backend, routing=routing, scores=scores, x=x_bad)
    assert torch.isfinite(out).all() and torch.all(out[3] == 0)
    pair_token = routing.row_token[routing.pair_row.long()]
    s_bad = scores.clone()
    s_bad[0] = float("nan")
    out_s = run_experts(p, backend, routing=routing, scores=s_bad)
    bad_token = int(pair_token[0])
    others = torch.arange(T) != bad_token
    assert torch.isnan(out_s[bad_token]).all() and torch.isfinite(out_s[others]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_through_the_router(backend):
    """sonicmoe.moe: a NaN token gets NaN logits and scores, but only its own output is NaN."""
    p = problem()
    x_bad = p["x"].clone()
    x_bad[4] = float("nan")
    res = sonicmoe.moe(x_bad, p["router_weight"], p["w1"], p["w2"], p["b1"], p["b2"], top_k=K, backend=backend)
    others = torch.arange(T) != 4
    assert torch.isnan(res.out[4]).all() and torch.isfinite(res.out[others]).all()
