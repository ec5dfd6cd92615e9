"""The float32 ground truth (sonicmoe.reference) and the torch backend.

1. ``moe_ref`` / ``experts_ref`` against an independent per-token, per-expert float64 loop that slices
   gate and up by hand for both W1 layouts.
2. The torch backend (``experts_torch``, ``sonicmoe.experts/moe(backend="torch")``) against the
   reference: outputs and gradients of x, router weight, W1, W2, b1, b2 and the pair scores.
3. float64 ``gradcheck`` of the reference and of the whole layer as the torch backend computes it.
"""

from __future__ import annotations

import math

import pytest
import torch

import sonicmoe
from sonicmoe.ops.torch_experts import experts_torch
from sonicmoe.reference import experts_ref, moe_ref, split_gate_up, swiglu_ref
from sonicmoe.routing import router_topk, routing_from_pairs, routing_from_topk
from sonicmoe.testing import random_problem, rel_err

LAYOUTS = ["concat", "interleaved"]
ORDERS = [("topk_then_softmax", False), ("softmax_then_topk", False), ("softmax_then_topk", True)]


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread():
    """These tests run thousands of tiny CPU ops: use one intra-op thread. torch's CPU softmax wakes an
    OpenMP team on every call, which costs ~10 ms per call when the CPU is shared (CI, parallel jobs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------
# independent float64 loops
# ---------------------------------------------------------------------------------------------


def _silu(v: float) -> float:
    return v / (1.0 + math.exp(-v))


def naive_expert(x_t, w1_e, w2_e, b1_e, b2_e, layout):
    """One expert on one token in float64, gate/up picked by explicit row indices."""
    two_n = w1_e.shape[0]
    n = two_n // 2
    h = w1_e @ x_t
    if b1_e is not None:
        h = h + b1_e
    if layout == "concat":
        gate_rows, up_rows = list(range(0, n)), list(range(n, 2 * n))
    else:
        gate_rows, up_rows = [2 * i for i in range(n)], [2 * i + 1 for i in range(n)]
    a = torch.tensor([_silu(float(h[gi])) * float(h[ui]) for gi, ui in zip(gate_rows, up_rows)],
                     dtype=torch.float64)
    y = w2_e @ a
    if b2_e is not None:
        y = y + b2_e
    return y


def naive_pairs(x, w1, w2, b1, b2, pair_token, pair_expert, pair_scores, layout):
    """O_t = sum over the pairs p of token t of S_p * expert_{e_p}(x_t), float64."""
    x, w1, w2 = x.double(), w1.double(), w2.double()
    b1 = None if b1 is None else b1.double()
    b2 = None if b2 is None else b2.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, e, s in zip(pair_token.tolist(), pair_expert.tolist(), pair_scores.double().tolist()):
        out[t] += s * naive_expert(x[t], w1[e], w2[e], None if b1 is None else b1[e],
                                   None if b2 is None else b2[e], layout)
    return out


def naive_moe(x, wr, w1, w2, b1, b2, k, layout, order, renormalize):
    """The whole layer per token in float64: router by hand, then the chosen experts."""
    xd, wrd = x.double(), wr.double()
    E = wr.shape[0]
    pair_token, pair_expert, pair_scores = [], [], []
    for t in range(x.shape[0]):
        logits = [float(torch.dot(wrd[e], xd[t])) for e in range(E)]
        chosen = sorted(range(E), key=lambda e, lg=logits: -lg[e])[:k]
        if order == "topk_then_softmax":
            m = max(logits[e] for e in chosen)
            ex = [math.exp(logits[e] - m) for e in chosen]
            s = [v / sum(ex) for v in ex]
        else:
            m = max(logits)
            z = sum(math.exp(v - m) for v in logits)
            s = [math.exp(logits[e] - m) / z for e in chosen]
            if renormalize:
                s = [v / sum(s) for v in s]
        pair_token += [t] * k
        pair_expert += chosen
        pair_scores += s
    return naive_pairs(x, w1, w2, b1, b2, torch.tensor(pair_token), torch.tensor(pair_expert),
                       torch.tensor(pair_scores, dtype=torch.float64), layout)


def general_pairs(T, E, seed, p_keep=0.45):
    """Unique pairs with 0..E experts per token, shuffled (not token-major), random positive scores."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(T, E, generator=g) < p_keep
    tok, exp = keep.nonzero(as_tuple=True)
    perm = torch.randperm(tok.numel(), generator=g)
    scores = torch.rand(tok.numel(), generator=g) + 0.1
    return tok[perm], exp[perm], scores


# ---------------------------------------------------------------------------------------------
# the reference against the independent loops
# ---------------------------------------------------------------------------------------------


def test_split_gate_up_layouts():
    h = torch.arange(12.0).reshape(2, 6)
    g, u = split_gate_up(h, "concat")
    assert g.tolist() == [[0, 1, 2], [6, 7, 8]] and u.tolist() == [[3, 4, 5], [9, 10, 11]]
    g, u = split_gate_up(h, "interleaved")
    assert g.tolist() == [[0, 2, 4], [6, 8, 10]] and u.tolist() == [[1, 3, 5], [7, 9, 11]]
    a = swiglu_ref(torch.tensor([[1.0, -2.0, 3.0, 0.5]]), "interleaved")  # gates 1, 3; ups -2, 0.5
    torch.testing.assert_close(a, torch.tensor([[_silu(1.0) * -2.0, _silu(3.0) * 0.5]]))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("order,renorm", ORDERS)
def test_moe_ref_matches_naive_float64(layout, bias, order, renorm):
    T, d, n, E, K = 9, 8, 6, 5, 2
    p = random_problem(T, d, n, E, dtype=torch.float64, bias=bias, seed=1)
    out, router, routing = moe_ref(p["x"], p["router_weight"], p["w1"], p["w2"], p["b1"], p["b2"],
                                   top_k=K, router_order=order, renormalize=renorm, gate_up_layout=layout)
    assert out.dtype == torch.float64 and out.shape == (T, d)
    expected = naive_moe(p["x"], p["router_weight"], p["w1"], p["w2"], p["b1"], p["b2"], K, layout,
                         order, renorm)
    assert rel_err(out, expected) < 1e-12


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("T,d,n,E,K", [(1, 4, 2, 3, 1), (12, 16, 8, 6, 2), (7, 8, 4, 4, 4), (10, 8, 4, 8, 1)])
def test_moe_ref_matches_naive_float32(layout, bias, T, d, n, E, K):
    p = random_problem(T, d, n, E, bias=bias, seed=T + E)
    out, router, routing = moe_ref(p["x"], p["router_weight"], p["w1"], p["w2"], p["b1"], p["b2"],
                                   top_k=K, gate_up_layout=layout)
    assert out.dtype == torch.float32 and out.shape == (T, d)
    expected = naive_moe(p["x"], p["router_weight"], p["w1"], p["w2"], p["b1"], p["b2"], K, layout,
                         "topk_then_softmax", False)
    assert rel_err(out, expected) < 1e-5
    assert routing.num_rows == T * K and router.topk_ids.shape == (T, K)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_experts_ref_general_routing_matches_naive(layout, bias):
    T, d, n, E = 11, 8, 4, 6
    p = random_problem(T, d, n, E, dtype=torch.float64, bias=bias, seed=2)
    tok, exp, scores = general_pairs(T, E, seed=3)
    keep = (tok != 0) & (exp != 3)  # token 0 gets no expert, expert 3 no token
    tok, exp, scores = tok[keep], exp[keep], scores[keep]
    has = torch.bincount(tok, minlength=T)
    assert has[0] == 0 and (has > 1).any() and (has == 1).any()
    routing = routing_from_pairs(tok, exp, T, E)
    out = experts_ref(p["x"], p["w1"], p["w2"], routing, scores.double(), p["b1"], p["b2"],
                      gate_up_layout=layout)
    expected = naive_pairs(p["x"], p["w1"], p["w2"], p["b1"], p["b2"], tok, exp, scores, layout)
    assert rel_err(out, expected) < 1e-12
    # tokens with no expert get exactly zero
    assert bool((out[has == 0] == 0).all())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_experts_ref_keeps_float64_biases_in_float64(layout):
    """float64 inputs drawn in float64 (random_problem draws in float32 and casts, so its float64 tensors are float32
    values: a float32 rounding of any of them would not show): experts_ref computes in float64 throughout, the
    biases included, and matches the float64 loop to 1e-12 where rounding b1 or b2 to float32 errs by ~1e-8."""
    T, d, n, E = 10, 8, 4, 5
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * s

    x, w1, w2 = rnd(T, d), rnd(E, 2 * n, d, s=d**-0.5), rnd(E, d, n, s=n**-0.5)
    b1, b2 = rnd(E, 2 * n), rnd(E, d)
    assert not torch.equal(b1, b1.float().double()) and not torch.equal(b2, b2.float().double())
    tok, exp, scores = general_pairs(T, E, seed=int(torch.randint(0, 2**31, ())))
    routing = routing_from_pairs(tok, exp, T, E)
    out = experts_ref(x, w1, w2, routing, scores.double(), b1, b2, gate_up_layout=layout)
    expected = naive_pairs(x, w1, w2, b1, b2, tok, exp, scores, layout)
    assert out.dtype == torch.float64 and rel_err(out, expected) < 1e-12


def test_experts_ref_zero_expert_tokens_and_empty_experts_exact():
    T, d, n, E = 4, 6, 3, 5
    p = random_problem(T, d, n, E, dtype=torch.float64, bias=True, seed=4)
    tok, exp = torch.tensor([2, 0, 2]), torch.tensor([4, 4, 1])  # tokens 1, 3 none; experts 0, 2, 3 none
    scores = torch.tensor([0.3, 0.9, 0.7], dtype=torch.float64)
    out = experts_ref(p["x"], p["w1"], p["w2"], routing_from_pairs(tok, exp, T, E), scores, p["b1"], p["b2"])
    expected = naive_pairs(p["x"], p["w1"], p["w2"], p["b1"], p["b2"], tok, exp, scores, "concat")
    assert rel_err(out, expected) < 1e-12
    assert bool((out[1] == 0).all() and (out[3] == 0).all())


@pytest.mark.parametrize("bias", [False, True])
def test_interleaved_equals_concat_with_permuted_rows(bias):
    T, d, n, E, K = 10, 8, 4, 4, 2
    p = random_problem(T, d, n, E, bias=bias, seed=5)
    w1c, b1c = p["w1"], p["b1"]
    w1i = torch.empty_like(w1c)
    w1i[:, 0::2], w1i[:, 1::2] = w1c[:, :n], w1c[:, n:]
    b1i = None
    if bias:
        b1i = torch.empty_like(b1c)
        b1i[:, 0::2], b1i[:, 1::2] = b1c[:, :n], b1c[:, n:]
    oc = moe_ref(p["x"], p["router_weight"], w1c, p["w2"], b1c, p["b2"], top_k=K, gate_up_layout="concat")[0]
    oi = moe_ref(p["x"], p["router_weight"], w1i, p["w2"], b1i, p["b2"], top_k=K,
                 gate_up_layout="interleaved")[0]
    torch.testing.assert_close(oi, oc, rtol=0, atol=0)
    # and the layouts really differ: the same W1 read the other way gives another result
    other = moe_ref(p["x"], p["router_weight"], w1c, p["w2"], b1c, p["b2"], top_k=K,
                    gate_up_layout="interleaved")[0]
    assert rel_err(other, oc) > 0.1


def test_reference_low_precision_inputs_compute_in_float32():
    p = random_problem(8, 8, 4, 4, dtype=torch.bfloat16, seed=6)
    out = moe_ref(p["x"], p["router_weight"], p["w1"], p["w2"], top_k=2)[0]
    assert out.dtype == torch.float32
    f = {k: (v.float() if v is not None else None) for k, v in p.items()}
    ref = moe_ref(f["x"], f["router_weight"], f["w1"], f["w2"], top_k=2)[0]
    assert rel_err(out, ref) < 1e-6


def test_reference_computes_in_x_dtype_whatever_the_weights():
    """experts_ref / moe_ref compute in float64 for a float64 x and in float32 for any other, whatever the weights'
    and scores' dtypes (the compute dtype follows x, as the docstrings say, not W1): float32 weights under a float64
    x give the float64 loop's output to 1e-12, and float64 weights under a float32 x a float32 output."""
    T, d, n, E = 7, 8, 4, 3
    p = random_problem(T, d, n, E, bias=True, seed=31)
    x64 = p["x"].double() + 1e-9 * torch.randn(T, d, generator=torch.Generator().manual_seed(32), dtype=torch.float64)
    tok, exp, scores = general_pairs(T, E, seed=33, p_keep=0.6)
    routing = routing_from_pairs(tok, exp, T, E)
    out = experts_ref(x64, p["w1"], p["w2"], routing, scores, p["b1"], p["b2"])
    want = naive_pairs(x64, p["w1"], p["w2"], p["b1"], p["b2"], tok, exp, scores, "concat")
    assert out.dtype == torch.float64 and rel_err(out, want) < 1e-12
    w = {k: p[k].double() for k in ("w1", "w2", "b1", "b2")}
    out32 = experts_ref(p["x"], w["w1"], w["w2"], routing, scores.double(), w["b1"], w["b2"])
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32, experts_ref(p["x"], p["w1"], p["w2"], routing, scores, p["b1"], p["b2"]),
                               rtol=0, atol=0)
    assert moe_ref(p["x"], p["router_weight"].double(), w["w1"], w["w2"], top_k=2)[0].dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# torch backend against the reference: outputs and gradients
# ---------------------------------------------------------------------------------------------


def _leaves(p, names):
    return {k: p[k].detach().clone().requires_grad_() for k in names if p[k] is not None}


def _grads_of(fn, leaves, seed):
    out = fn(leaves)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad(out, list(leaves.values()), dout, allow_unused=False)
    return out, dict(zip(leaves.keys(), grads))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("order,renorm", ORDERS)
@pytest.mark.parametrize("api", ["moe", "experts"])
def test_torch_backend_moe_matches_ref_with_grads(layout, bias, order, renorm, api):
    T, d, n, E, K = 24, 16, 8, 6, 2
    p = random_problem(T, d, n, E, bias=bias, seed=7)
    names = ["x", "router_weight", "w1", "w2", "b1", "b2"]
    kw = {"top_k": K, "router_order": order, "renormalize": renorm, "gate_up_layout": layout}

    def ours(v):
        if api == "moe":
            res = sonicmoe.moe(v["x"], v["router_weight"], v["w1"], v["w2"], v.get("b1"), v.get("b2"),
                               backend="torch", **kw)
            assert isinstance(res, sonicmoe.MoEOutput) and res.routing.num_rows == T * K
            return res.out
        router = router_topk(v["x"], v["router_weight"], K, router_order=order, renormalize=renorm)
        routing = routing_from_topk(router.topk_ids, E)
        return sonicmoe.experts(v["x"], v["w1"], v["w2"], routing, router.topk_scores.reshape(-1),
                                v.get("b1"), v.get("b2"), gate_up_layout=layout, backend="torch")

    def ref(v):
        return moe_ref(v["x"], v["router_weight"], v["w1"], v["w2"], v.get("b1"), v.get("b2"), **kw)[0]

    out, g = _grads_of(ours, _leaves(p, names), seed=8)
    out_ref, g_ref = _grads_of(ref, _leaves(p, names), seed=8)
    assert out.dtype == torch.float32 and out.shape == (T, d)
    assert rel_err(out, out_ref) < 1e-5
    assert set(g) == set(g_ref) == {k for k in names if p[k] is not None}
    for k in g_ref:
        assert g_ref[k].norm() > 0, k
        assert rel_err(g[k], g_ref[k]) < 1e-5, k


def test_torch_backend_moe_takes_every_router_option():
    """sonicmoe.moe hands each router option to the router, the scaling factor to the scores and the activation to
    the experts: with DeepSeek-V3's options (sigmoid, groups, selection bias, renormalised, scaled by 2.5) and gpt-oss's
    router bias and activation it gives moe_ref's output, and without any one of them another (so an option the layer
    drops cannot pass unseen)."""
    T, d, n, E, K = 16, 8, 4, 8, 2
    p = random_problem(T, d, n, E, bias=True, seed=21)
    g = torch.Generator().manual_seed(22)
    opts = dict(top_k=K, router_order="sigmoid_then_topk", renormalize=True, expert_bias=torch.randn(E, generator=g),
                routed_scaling_factor=2.5, n_group=4, topk_group=2, router_bias=torch.randn(E, generator=g),
                activation="clamped_swiglu")
    args = (p["x"], p["router_weight"], p["w1"], p["w2"], p["b1"], p["b2"])
    out = sonicmoe.moe(*args, backend="torch", **opts).out
    assert rel_err(out, moe_ref(*args, **opts)[0]) < 1e-6
    for off in ({"renormalize": False}, {"expert_bias": None}, {"routed_scaling_factor": 1.0},
                {"n_group": 1, "topk_group": 1}, {"router_bias": None}, {"activation": "swiglu"}):
        assert rel_err(out, moe_ref(*args, **{**opts, **off})[0]) > 1e-3, off


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_torch_backend_general_routing_matches_ref(layout, bias):
    T, d, n, E = 14, 8, 8, 5
    p = random_problem(T, d, n, E, bias=bias, seed=9)
    tok, exp, scores = general_pairs(T, E, seed=10)
    routing = routing_from_pairs(tok, exp, T, E)
    names = ["x", "w1", "w2", "b1", "b2"]
    base = _leaves(p, names)
    base["pair_scores"] = scores.clone().requires_grad_()

    def run(fn):
        v = {k: t.detach().clone().requires_grad_() for k, t in base.items()}
        return _grads_of(lambda v: fn(v["x"], v["w1"], v["w2"], routing, v["pair_scores"], v.get("b1"),
                                      v.get("b2"), gate_up_layout=layout), v, seed=11)

    out_ref, g_ref = run(experts_ref)
    for fn in (experts_torch, lambda *a, **k: sonicmoe.experts(*a, backend="torch", **k),
               lambda *a, **k: sonicmoe.experts(*a, backend="auto", **k)):
        out, g = run(fn)
        assert rel_err(out, out_ref) < 1e-5
        for k in g_ref:
            assert g_ref[k].norm() > 0, k
            assert rel_err(g[k], g_ref[k]) < 1e-5, k


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_torch_backend_low_precision(dtype, tol):
    T, d, n, E, K = 32, 32, 16, 8, 2
    p = random_problem(T, d, n, E, dtype=dtype, bias=True, seed=12)
    res = sonicmoe.moe(p["x"], p["router_weight"], p["w1"], p["w2"], p["b1"], p["b2"], top_k=K,
                       backend="torch")
    assert res.out.dtype == dtype
    ref = moe_ref(p["x"], p["router_weight"], p["w1"], p["w2"], p["b1"], p["b2"], top_k=K)[0]
    err = rel_err(res.out, ref)
    assert err < tol
    assert err > 0  # it really ran in low precision


def test_torch_backend_grouped_mm_only_on_hopper_bf16_with_aligned_dims(monkeypatch):
    """The torch backend takes ``torch._grouped_mm`` only for bf16 CUDA inputs on compute capability 9 or newer
    whose weights' last two dimensions are multiples of 8 (its 16-byte leading dimensions), else the per-expert
    loop: a fp16 input, an Ampere device, or an odd 2n (W1's rows) or n (W2's columns) keep the loop (the
    GPU-only choice, tested on CPU tensors that say they live on CUDA)."""
    from sonicmoe.ops.torch_experts import _grouped_mm_ok
    from sonicmoe.testing import OnCuda

    cap = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])

    def on_cuda(*shape, dtype=torch.bfloat16):
        return torch.Tensor._make_subclass(OnCuda, torch.zeros(*shape, dtype=dtype))

    x = on_cuda(16, 64)
    w1, w2 = torch.zeros(4, 32, 64, dtype=torch.bfloat16), torch.zeros(4, 64, 16, dtype=torch.bfloat16)
    assert _grouped_mm_ok(x, w1, w2)
    # multiples of 8 that are not of 16 (2n = 24 and d = 40, n = 24): aligned enough
    assert _grouped_mm_ok(on_cuda(16, 40), torch.zeros(4, 24, 40, dtype=torch.bfloat16),
                          torch.zeros(4, 40, 24, dtype=torch.bfloat16))
    assert not _grouped_mm_ok(x, torch.zeros(4, 36, 64, dtype=torch.bfloat16), w2)  # 2n = 36 rows
    assert not _grouped_mm_ok(x, w1, torch.zeros(4, 64, 12, dtype=torch.bfloat16))  # n = 12 columns
    assert not _grouped_mm_ok(x, torch.zeros(4, 32, 60, dtype=torch.bfloat16), w2)  # d = 60
    assert not _grouped_mm_ok(on_cuda(16, 64, dtype=torch.float16), w1, w2)
    assert not _grouped_mm_ok(torch.zeros(16, 64, dtype=torch.bfloat16), w1, w2)  # a CPU tensor
    cap[0] = (8, 0)
    assert not _grouped_mm_ok(x, w1, w2)
    cap[0] = (10, 0)
    assert _grouped_mm_ok(x, w1, w2)


def test_torch_backend_grouped_mm_asks_the_inputs_device(monkeypatch):
    """The compute capability _grouped_mm_ok checks is that of x's device, not of the current one: x on cuda:1, a
    Hopper, while the current device (cuda:0) is an Ampere, takes torch._grouped_mm, and the reverse does not."""
    from sonicmoe.ops.torch_experts import _grouped_mm_ok
    from sonicmoe.testing import OnCuda

    x = torch.Tensor._make_subclass(OnCuda, torch.zeros(16, 64, dtype=torch.bfloat16))
    w1, w2 = torch.zeros(4, 32, 64, dtype=torch.bfloat16), torch.zeros(4, 64, 16, dtype=torch.bfloat16)
    for on_x, elsewhere, want in (((9, 0), (8, 0), True), ((8, 0), (9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda device=None, a=on_x, b=elsewhere: a if device == x.device else b)
        assert _grouped_mm_ok(x, w1, w2) is want


@pytest.mark.parametrize("padded", [False, True])
def test_torch_backend_grouped_mm_path_on_cpu(padded, monkeypatch):
    """The torch backend's torch._grouped_mm path (taken for bf16 on Hopper) run on the CPU, where _grouped_mm takes
    float32: the same output and gradients as the reference, on a routing with an empty expert and a token without
    one, and with padding rows. _grouped_mm leaves the rows past its last offset unwritten (poisoned with NaN here):
    b1[row_expert] carried their garbage into b1's gradient until H's padding rows were zeroed."""
    from sonicmoe.ops import torch_experts

    T, d, n, E = 6, 8, 8, 4
    p = random_problem(T, d, n, E, bias=True, seed=34)
    tok, exp = torch.tensor([0, 1, 2, 3, 1, 4, 0, 3]), torch.tensor([2, 0, 2, 3, 3, 0, 3, 2])  # expert 1, token 5 none
    if padded:
        tok, exp = torch.cat([tok, torch.full((3,), T)]), torch.cat([exp, torch.full((3,), E)])
    routing = routing_from_pairs(tok, exp, T, E, padding=padded)
    scores = torch.rand(tok.numel(), generator=torch.Generator().manual_seed(35)) + 0.1
    grouped_mm, calls = torch._grouped_mm, []

    def poisoned(a, b, offs):
        calls.append(offs)
        out = grouped_mm(a, b, offs=offs)
        rows = torch.arange(out.shape[0])[:, None]
        return torch.where(rows < offs[-1], out, float("nan"))

    monkeypatch.setattr(torch, "_grouped_mm", poisoned)
    monkeypatch.setattr(torch_experts, "_grouped_mm_ok", lambda x, *mats: True)
    dout = torch.randn(T, d, generator=torch.Generator().manual_seed(36))
    results = []
    for fn in (experts_torch, experts_ref):
        v = {k: t.clone().requires_grad_() for k, t in (*((k, p[k]) for k in ("x", "w1", "w2", "b1", "b2")),
                                                       ("pair_scores", scores))}
        out = fn(v["x"], v["w1"], v["w2"], routing, v["pair_scores"], v["b1"], v["b2"])
        results.append((out, torch.autograd.grad(out, list(v.values()), dout)))
    assert len(calls) == 2  # both GEMMs, neither the per-expert loop's
    (out, grads), (ref, ref_grads) = results
    assert rel_err(out, ref) < 1e-6
    for key, got, want in zip(("x", "w1", "w2", "b1", "b2", "pair_scores"), grads, ref_grads):
        assert want.norm() > 0 and rel_err(got, want) < 1e-6, key


def test_torch_backend_tokens_without_experts_get_zero_and_zero_grad():
    T, d, n, E = 6, 8, 4, 3
    p = random_problem(T, d, n, E, bias=True, seed=13)
    tok, exp = torch.tensor([0, 4, 0]), torch.tensor([2, 2, 0])
    routing = routing_from_pairs(tok, exp, T, E)
    x = p["x"].clone().requires_grad_()
    out = experts_torch(x, p["w1"], p["w2"], routing, torch.tensor([0.5, 1.5, 0.25]), p["b1"], p["b2"])
    assert bool((out[[1, 2, 3, 5]] == 0).all()) and bool((out[[0, 4]] != 0).all())
    out.sum().backward()
    assert bool((x.grad[[1, 2, 3, 5]] == 0).all()) and bool((x.grad[[0, 4]] != 0).any())


@pytest.mark.parametrize("which", ["b1", "b2"])
def test_torch_backend_one_bias_matches_naive(which):
    """Only one of the two biases (an up-projection bias without a down-projection one, or the reverse): the torch
    backend's output is the float64 per-pair loop's, and its gradients the reference's (each bias indexes the rows by
    their expert, whichever of the two is given)."""
    T, d, n, E = 12, 8, 4, 5
    p = random_problem(T, d, n, E, bias=True, seed=23)
    p["b2" if which == "b1" else "b1"] = None
    tok, exp, scores = general_pairs(T, E, seed=24)
    routing = routing_from_pairs(tok, exp, T, E)
    names = ["x", "w1", "w2", which]
    v = {k: p[k].clone().requires_grad_() for k in names}
    v["pair_scores"] = scores.clone().requires_grad_()
    b1, b2 = v.get("b1"), v.get("b2")
    out = experts_torch(v["x"], v["w1"], v["w2"], routing, v["pair_scores"], b1, b2)
    expected = naive_pairs(p["x"], p["w1"], p["w2"], p["b1"], p["b2"], tok, exp, scores, "concat")
    assert rel_err(out, expected) < 1e-5
    dout = torch.randn(T, d, generator=torch.Generator().manual_seed(25))
    grads = torch.autograd.grad(out, list(v.values()), dout)
    ref = experts_ref(v["x"], v["w1"], v["w2"], routing, v["pair_scores"], b1, b2)
    for key, got, want in zip(v, grads, torch.autograd.grad(ref, list(v.values()), dout)):
        assert want.norm() > 0 and rel_err(got, want) < 1e-5, key


@pytest.mark.parametrize("case", ["no_rows", "padding_only"])
@pytest.mark.parametrize("bias", [False, True])
def test_torch_backend_without_tokens_keeps_every_input_in_the_graph(case, bias):
    """T = 0 tokens (an empty batch; an expert-parallel rank that receives none), with no row or with padding rows
    only (a static-length routing): the torch backend's O is (0, d) and in the graph of every input, whose
    gradients are zeros of their shapes (as the Triton kernels give, test_kernels' test_experts_without_rows)."""
    d, n, e = 8, 4, 3
    p = random_problem(1, d, n, e, bias=bias, seed=26)
    if case == "no_rows":
        routing = routing_from_topk(torch.zeros(0, 2, dtype=torch.long), e)
    else:
        routing = routing_from_pairs(torch.zeros(3, dtype=torch.long), torch.full((3,), e), 0, e, padding=True)
    leaves = {"x": p["x"][:0], "w1": p["w1"], "w2": p["w2"], "b1": p["b1"], "b2": p["b2"],
              "pair_scores": torch.rand(routing.num_rows) + 0.1}
    leaves = {k: t.clone().requires_grad_() for k, t in leaves.items() if t is not None}
    out = experts_torch(routing=routing, **leaves)
    assert out.shape == (0, d) and out.dtype == torch.float32
    grads = torch.autograd.grad(out, list(leaves.values()), torch.randn(0, d))
    for (key, leaf), grad in zip(leaves.items(), grads):
        assert grad.shape == leaf.shape and not grad.any(), key


# ---------------------------------------------------------------------------------------------
# float64 gradcheck
# ---------------------------------------------------------------------------------------------


def _separated_problem(T, d, n, E, K, bias, seed):
    """float64 random problem whose K-th and (K+1)-th logits are > 1e-3 apart on every token."""
    for s in range(seed, seed + 50):
        p = random_problem(T, d, n, E, dtype=torch.float64, bias=bias, seed=s)
        if K == E:
            return p
        lg = (p["x"] @ p["router_weight"].t()).sort(-1, descending=True).values
        if float((lg[:, K - 1] - lg[:, K]).min()) > 1e-3:
            return p
    raise AssertionError("no well-separated problem found")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_gradcheck_experts_ref_and_torch_general_routing(layout, bias):
    T, d, n, E = 5, 4, 3, 4
    p = random_problem(T, d, n, E, dtype=torch.float64, bias=bias, seed=14)
    tok, exp, scores = general_pairs(T, E, seed=15, p_keep=0.5)
    routing = routing_from_pairs(tok, exp, T, E)
    names = [k for k in ("x", "w1", "w2", "b1", "b2") if p[k] is not None]
    inputs = tuple(p[k].clone().requires_grad_() for k in names) + (scores.double().requires_grad_(),)

    for fn in (experts_ref, experts_torch):
        def f(*args, fn=fn):
            v = dict(zip(names + ["pair_scores"], args))
            return fn(v["x"], v["w1"], v["w2"], routing, v["pair_scores"], v.get("b1"), v.get("b2"),
                      gate_up_layout=layout)

        assert f(*inputs).dtype == torch.float64
        assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("order,renorm", ORDERS)
def test_gradcheck_whole_layer(layout, bias, order, renorm):
    """The layer as sonicmoe.moe(backend="torch") composes it (router_topk -> routing_from_topk ->
    experts_torch), and moe_ref, in float64 w.r.t. x, router weight, W1, W2, b1, b2."""
    T, d, n, E, K = 4, 4, 3, 4, 2
    p = _separated_problem(T, d, n, E, K, bias, seed=16)
    names = [k for k in ("x", "router_weight", "w1", "w2", "b1", "b2") if p[k] is not None]
    inputs = tuple(p[k].clone().requires_grad_() for k in names)

    def layer_torch(*args):
        v = dict(zip(names, args))
        router = router_topk(v["x"], v["router_weight"], K, router_order=order, renormalize=renorm)
        routing = routing_from_topk(router.topk_ids, E)
        return experts_torch(v["x"], v["w1"], v["w2"], routing, router.topk_scores.reshape(-1),
                             v.get("b1"), v.get("b2"), gate_up_layout=layout)

    def layer_ref(*args):
        v = dict(zip(names, args))
        return moe_ref(v["x"], v["router_weight"], v["w1"], v["w2"], v.get("b1"), v.get("b2"), top_k=K,
                       router_order=order, renormalize=renorm, gate_up_layout=layout)[0]

    assert layer_torch(*inputs).dtype == torch.float64
    assert torch.autograd.gradcheck(layer_torch, inputs)
    assert torch.autograd.gradcheck(layer_ref, inputs)


@pytest.mark.parametrize("bias", [False, True])
def test_moe_float32_grads_match_float64_analytic(bias):
    """sonicmoe.moe(backend="torch") only takes bf16/fp16/fp32: check its float32 gradients against
    the float64 analytic gradients that test_gradcheck_whole_layer validates."""
    T, d, n, E, K = 6, 8, 4, 4, 2
    p64 = _separated_problem(T, d, n, E, K, bias, seed=17)
    names = [k for k in ("x", "router_weight", "w1", "w2", "b1", "b2") if p64[k] is not None]

    def ref64(v):
        return moe_ref(v["x"], v["router_weight"], v["w1"], v["w2"], v.get("b1"), v.get("b2"), top_k=K)[0]

    def ours32(v):
        return sonicmoe.moe(v["x"], v["router_weight"], v["w1"], v["w2"], v.get("b1"), v.get("b2"),
                            top_k=K, backend="torch").out

    out64, g64 = _grads_of(ref64, _leaves(p64, names), seed=18)
    p32 = {k: (v.float() if v is not None else None) for k, v in p64.items()}
    out32, g32 = _grads_of(ours32, _leaves(p32, names), seed=18)
    assert rel_err(out32, out64) < 1e-5
    for k in names:
        assert rel_err(g32[k], g64[k]) < 1e-5, k


@pytest.mark.parametrize("bias", [False, True])
def test_experts_ref_without_pairs_is_differentiable(bias):
    """No routed pair at all (R = 0): O is zero and still in the graph of every input, whose gradients are zeros
    (the kernels' and the torch backend's); it had no graph before session 83, so autograd.grad raised."""
    p = random_problem(3, 8, 4, 2, bias=bias, dtype=torch.float64, seed=1)
    empty = torch.empty(0, dtype=torch.long)
    leaves = [v.requires_grad_(True) for v in (p["x"], p["w1"], p["w2"], p["b1"], p["b2"]) if v is not None]
    s = torch.empty(0, dtype=torch.float64, requires_grad=True)
    out = experts_ref(p["x"], p["w1"], p["w2"], routing_from_pairs(empty, empty, 3, 2), s, p["b1"], p["b2"])
    assert out.shape == (3, 8) and not out.any()
    grads = torch.autograd.grad(out.square().sum() + out.sum(), [*leaves, s])
    assert all(g.shape == v.shape and not g.any() for g, v in zip(grads, [*leaves, s]))


def test_load_balancing_loss_keeps_float64():
    """A float64 router's load-balancing loss is computed in float64 (f_e was float32: a 1e-8 error); and it is 1
    for uniform routing whatever K, transformers' Mixtral loss being K times it."""
    from sonicmoe.routing import load_balancing_loss

    g = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(7, 3, generator=g, dtype=torch.float64), dim=-1)
    routing = routing_from_pairs(torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 1]), torch.tensor([0, 1, 2, 1, 1, 2, 0, 2, 0]),
                                 7, 3)
    got = load_balancing_loss(probs, routing)
    counts = torch.tensor([3, 3, 3], dtype=torch.float64)
    want = 3 * torch.sum(counts / 9 * probs.mean(0))
    assert got.dtype == torch.float64 and abs(float(got - want)) < 1e-15
    t, e, k = 8, 4, 2
    ids = torch.stack([torch.arange(t) % e, (torch.arange(t) + 1) % e], 1)
    uniform = load_balancing_loss(torch.full((t, e), 1 / e, dtype=torch.float64), routing_from_topk(ids, e))
    assert abs(float(uniform) - 1.0) < 1e-15
    mixtral = e * torch.sum(torch.bincount(ids.reshape(-1), minlength=e) / t * torch.full((e,), 1 / e))  # T_e / T
    assert abs(float(mixtral) - k * float(uniform)) < 1e-12


# ---------------------------------------------------------------------------------------------
# the helpers of sonicmoe.testing that the GPU tests judge the kernels with
# ---------------------------------------------------------------------------------------------


def test_testing_helpers_rel_err():
    """rel_err: NaN for a NaN or an Inf in ``out`` (an Inf is no finite error), 0 for two zero tensors (‖ref‖ is
    clamped: a token without experts has a zero output and a zero reference)."""
    ref = torch.ones(3)
    assert rel_err(ref + 1, ref) == pytest.approx(1.0)
    # in float64: an error of 1e-12 is no rounding of float32's (whose epsilon is 1.2e-7)
    ref64 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    err = rel_err(ref64 + torch.tensor([1e-12, 0.0, 0.0], dtype=torch.float64), ref64)
    assert err == pytest.approx(1e-12 / float(ref64.norm()), rel=1e-3, abs=0)
    assert math.isnan(rel_err(torch.tensor([1.0, float("inf"), 1.0]), ref))
    assert math.isnan(rel_err(torch.tensor([1.0, float("nan"), 1.0]), ref))
    assert rel_err(torch.zeros(3), torch.zeros(3)) == 0.0
    # relative to ‖ref‖ however small it is (the clamp only keeps 0 / 0 finite): an output 1.5 times a reference of
    # norm 5e-3 is 50 % off
    small = torch.tensor([3e-3, -4e-3])
    assert rel_err(small * 1.5, small) == pytest.approx(0.5, rel=1e-6)


def test_testing_helpers_on_cuda_says_cuda_one():
    """OnCuda: a CPU tensor whose is_cuda is True and whose device is cuda:1 unless its INDEX says another, so that by
    default it is on a device other than the current one (cuda:0), as the device guards' tests need; its data stay
    the CPU tensor's."""
    from sonicmoe.testing import OnCuda

    base = torch.randn(3, generator=torch.Generator().manual_seed(37))
    t = torch.Tensor._make_subclass(OnCuda, base)
    assert t.is_cuda and t.device == torch.device("cuda", 1) and t.device != torch.device("cuda", 0)
    other = torch.Tensor._make_subclass(OnCuda, base.clone())
    other.INDEX = 3
    assert other.device == torch.device("cuda", 3) and t.device == torch.device("cuda", 1)
    assert torch.equal(t.as_subclass(torch.Tensor), base) and not base.is_cuda


def test_testing_helpers_random_problem_scales_by_fan_in():
    """random_problem's weights have std 1/sqrt(fan_in) (W_r, W1: d; W2: n), so that activations stay O(1), its
    tokens x std 1 (unscaled) and its biases b1, b2 std 0.1 (small next to the products)."""
    d, n = 64, 16
    p = random_problem(64, d, n, 8, seed=7, bias=True)
    assert abs(float(p["x"].std()) - 1) < 0.1
    for key, fan_in in (("router_weight", d), ("w1", d), ("w2", n)):
        assert abs(float(p[key].std()) * fan_in**0.5 - 1) < 0.1, key
    for key in ("b1", "b2"):
        assert abs(float(p[key].std()) / 0.1 - 1) < 0.1, key


def test_testing_helpers_random_problem_draws_float64_in_float64():
    """A float64 problem is drawn in float64: its values are not all float32 numbers, so a float64 test built on it
    sees a computation that drops to float32 (drawn in float32 and cast, they all were, and hid ck22_ref_b1_in_float32).
    Other dtypes keep their float32 draw, cast."""
    p64 = random_problem(16, 8, 4, 3, seed=5, bias=True, dtype=torch.float64)
    for key, v in p64.items():
        assert v.dtype == torch.float64 and not torch.equal(v.float().double(), v), key
    p16 = random_problem(16, 8, 4, 3, seed=5, bias=True, dtype=torch.float16)
    p32 = random_problem(16, 8, 4, 3, seed=5, bias=True)
    assert all(torch.equal(p16[k], p32[k].half()) for k in p32)


def test_testing_helpers_random_problem_follows_seed_scale_and_bias():
    """random_problem: the seed picks the draw (the same seed the same tensors, another seed others), ``scale``
    multiplies every tensor, biases (E, 2n) and (E, d) only with bias=True; random_topk_routing routes K distinct
    experts per token, T·K pairs (mutation probe: bx5_testing_*)."""
    from sonicmoe.testing import random_topk_routing

    T, d, n, E, K = 8, 16, 4, 6, 2
    a = random_problem(T, d, n, E, seed=3, bias=True)
    b = random_problem(T, d, n, E, seed=3, bias=True)
    c = random_problem(T, d, n, E, seed=4, bias=True)
    half = random_problem(T, d, n, E, seed=3, bias=True, scale=0.5)
    shapes = {"x": (T, d), "router_weight": (E, d), "w1": (E, 2 * n, d), "w2": (E, d, n), "b1": (E, 2 * n),
              "b2": (E, d)}
    for key, shape in shapes.items():
        assert tuple(a[key].shape) == shape, key
        assert torch.equal(a[key], b[key]) and not torch.equal(a[key], c[key]), key
        assert torch.equal(half[key], a[key] * 0.5), key  # a power of two: exact
    plain = random_problem(T, d, n, E, seed=3)
    assert plain["b1"] is None and plain["b2"] is None and torch.equal(plain["x"], a["x"])
    # float32 on the CPU unless asked; ``device`` is where every tensor lands
    assert all(a[key].dtype == torch.float32 and a[key].device.type == "cpu" for key in shapes)
    meta = random_problem(T, d, n, E, seed=3, bias=True, device="meta", dtype=torch.float16)
    for key, shape in shapes.items():
        assert meta[key].device.type == "meta" and meta[key].dtype == torch.float16, key
        assert tuple(meta[key].shape) == shape, key
    routing = random_topk_routing(T, E, K, seed=1, device="cpu")
    ids = torch.randn(T, E, generator=torch.Generator().manual_seed(1)).topk(K, dim=1).indices
    assert torch.equal(routing.expert_counts().long().cpu(), torch.bincount(ids.reshape(-1), minlength=E))


def test_testing_helpers_layer_and_reference_grads(monkeypatch):
    """layer_grads runs the layer on the backend it is given (on the CPU "auto" means torch: the GPU tests that
    compare backend="triton" with backend="torch" through it would compare torch with itself), and reference_grads
    rounds its inputs to ``rounded_to`` and computes in ``gate_up_layout``."""
    import sonicmoe.functional as functional
    from sonicmoe.testing import layer_grads, reference_grads

    T, d, n, E, K = 6, 8, 4, 4, 2
    p = random_problem(T, d, n, E, seed=5)
    dout = torch.randn(T, d, generator=torch.Generator().manual_seed(6))
    seen = []
    monkeypatch.setattr(functional, "resolve_backend", lambda backend, x: seen.append(backend) or "torch")
    out, grads = layer_grads(p, dout, K, dtype=torch.float32, backend="triton")
    assert seen[0] == "triton"
    assert set(grads) == {"x", "router_weight", "w1", "w2"}
    # the inputs cast to ``dtype`` first: a bf16 layer, bf16 gradients, the bits of moe on bf16 copies
    out16, grads16 = layer_grads(p, dout, K, dtype=torch.bfloat16, backend="torch")
    ins16 = {key: p[key].bfloat16().requires_grad_(True) for key in ("x", "router_weight", "w1", "w2")}
    res16 = sonicmoe.moe(ins16["x"], ins16["router_weight"], ins16["w1"], ins16["w2"], top_k=K, backend="torch")
    res16.out.backward(dout.bfloat16())
    assert out16.dtype == torch.bfloat16 and torch.equal(out16, res16.out.detach())
    for key, v in ins16.items():
        assert grads16[key].dtype == torch.bfloat16 and torch.equal(grads16[key], v.grad), key
    rounded = {key: p[key].to(torch.bfloat16).double() for key in ("x", "router_weight", "w1", "w2")}
    for layout in LAYOUTS:
        got, got_grads = reference_grads(p, dout, K, rounded_to=torch.bfloat16, gate_up_layout=layout)
        want = moe_ref(rounded["x"], rounded["router_weight"], rounded["w1"], rounded["w2"], top_k=K,
                       gate_up_layout=layout)[0]
        assert got.dtype == torch.float64 and torch.equal(got, want.detach()), layout
    assert rel_err(out, reference_grads(p, dout, K)[0]) < 1e-5


def test_testing_helpers_with_biases():
    """layer_grads and reference_grads hand b1 (E, 2n) and b2 (E, d) to the layer each in its place (d = 2n here,
    so a swap would run, with other numbers) and return their gradients: the bits of moe / moe_ref called directly."""
    from sonicmoe.testing import layer_grads, reference_grads

    T, d, n, E, K = 6, 8, 4, 4, 2
    p = random_problem(T, d, n, E, seed=8, bias=True)
    dout = torch.randn(T, d, generator=torch.Generator().manual_seed(9))
    names = ("x", "router_weight", "w1", "w2", "b1", "b2")
    out, grads = layer_grads(p, dout, K, dtype=torch.float32, backend="torch")
    ins = {key: p[key].clone().requires_grad_(True) for key in names}
    res = sonicmoe.moe(*(ins[key] for key in names), top_k=K, backend="torch")
    res.out.backward(dout)
    assert set(grads) == set(names) and torch.equal(out, res.out.detach())
    for key in names:
        assert torch.equal(grads[key], ins[key].grad), key
    ref_out, ref_grads = reference_grads(p, dout, K)
    ins64 = {key: p[key].double().requires_grad_(True) for key in names}
    want = moe_ref(*(ins64[key] for key in names), top_k=K)[0]
    want.backward(dout.double())
    assert torch.equal(ref_out, want.detach())
    for key in names:
        assert ref_grads[key].dtype == torch.float64 and torch.equal(ref_grads[key], ins64[key].grad), key
    assert float(ref_grads["b1"].abs().max()) > 0 and float(ref_grads["b2"].abs().max()) > 0


def test_testing_helpers_defaults(monkeypatch):
    """The helpers' defaults: layer_grads runs the triton backend in bfloat16; reference_grads keeps float64 inputs
    as they are (rounded to float64: no rounding) in the concat layout."""
    import sonicmoe.functional as functional
    from sonicmoe.testing import layer_grads, reference_grads

    T, d, n, E, K = 6, 8, 4, 4, 2
    g = torch.Generator().manual_seed(10)  # float64 draws (random_problem's are float32 values, widened)
    p64 = {key: torch.randn(*shape, generator=g, dtype=torch.float64) * s for key, shape, s in (
        ("x", (T, d), 1.0), ("router_weight", (E, d), d**-0.5), ("w1", (E, 2 * n, d), d**-0.5),
        ("w2", (E, d, n), n**-0.5))}
    dout = torch.randn(T, d, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    got, _ = reference_grads(p64, dout, K)
    want = moe_ref(p64["x"], p64["router_weight"], p64["w1"], p64["w2"], top_k=K, gate_up_layout="concat")[0]
    assert torch.equal(got, want)
    rounded = {key: v.float().double() for key, v in p64.items()}
    assert not torch.equal(got, moe_ref(rounded["x"], rounded["router_weight"], rounded["w1"], rounded["w2"],
                                        top_k=K)[0])
    seen = []
    monkeypatch.setattr(functional, "resolve_backend", lambda backend, x: seen.append(backend) or "torch")
    out, grads = layer_grads(p64, dout.float(), K)
    assert seen[0] == "triton" and out.dtype == torch.bfloat16
    assert all(g.dtype == torch.bfloat16 for g in grads.values())
