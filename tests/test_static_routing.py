"""Static-length routing: token rounding without a host sync (``token_rounding(static=True)``) and routing with
padding pairs (``routing_from_pairs(padding=True)``), through both backends and the ``MoE`` layer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sonicmoe
from sonicmoe.config import ROUNDING_SUBROUTINES
from sonicmoe.functional import experts
from sonicmoe.routing import router_topk, routing_from_pairs
from sonicmoe.testing import rel_err
from sonicmoe.token_rounding import max_pairs, token_rounding

pytestmark = pytest.mark.filterwarnings("ignore:token rounding with")


def _router(t, e, k, seed, d=8, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(device)
    w = torch.randn(e, d, generator=g).to(device).requires_grad_(True)
    return router_topk(x, w, k), w


def _exact_and_static(router, **kw):
    exact = token_rounding(router, warn=False, **kw)
    static = token_rounding(router, warn=False, static=True, **kw)
    return exact, static


@settings(max_examples=60, deadline=None)
@given(t=st.integers(1, 70), e=st.integers(1, 9), kfrac=st.floats(0, 1), m=st.integers(1, 12),
       subroutine=st.sampled_from(ROUNDING_SUBROUTINES), seed=st.integers(0, 10**6))
def test_static_pairs_are_the_exact_pairs_then_padding(t, e, kfrac, m, subroutine, seed):
    """R_max = max_pairs(...) pairs: the exact pairs (same order, scores, flags), then padding pairs (T, E) with
    score 0, not added. R ≤ R_max for every subroutine, so the bound holds on random routers of every size."""
    _assert_static_is_exact_then_padding(t, e, 1 + int(kfrac * (e - 1)), m, subroutine, seed)


def _assert_static_is_exact_then_padding(t, e, k, m, subroutine, seed):
    """The body of the hypothesis test above: static=True's pairs are the exact pairs, then padding pairs (T, E) of
    score 0, not added; returns R and R_max."""
    router, _ = _router(t, e, k, seed)
    g = {"generator": torch.Generator().manual_seed(seed)} if subroutine == "stochastic" else {}
    exact = token_rounding(router, m_tile=m, subroutine=subroutine, warn=False, **g)
    g = {"generator": torch.Generator().manual_seed(seed)} if subroutine == "stochastic" else {}
    static = token_rounding(router, m_tile=m, subroutine=subroutine, warn=False, static=True, **g)
    r, r_max = exact.num_pairs, max_pairs(t, e, k, m, subroutine)
    assert static.num_pairs == r_max >= r
    assert int(static.counts.sum()) == r
    for name in ("pair_token", "pair_expert", "pair_scores", "pair_added"):
        assert torch.equal(getattr(static, name)[:r], getattr(exact, name)), name
    for name in ("counts", "topk_counts", "padded"):
        assert torch.equal(getattr(static, name), getattr(exact, name)), name
    assert (static.pair_token[r:] == t).all() and (static.pair_expert[r:] == e).all()
    assert (static.pair_scores[r:] == 0).all() and not static.pair_added[r:].any()
    return r, r_max


@pytest.mark.parametrize("subroutine", ROUNDING_SUBROUTINES)
def test_static_pairs_exact_then_padding_fixed_cases(subroutine):
    """The hypothesis test's check on fixed cases, each with padding pairs (R < R_max): a padding pair (T, E) read as
    a real one (``pair_token <= T`` in pair_scores_ref) is clamped to token T−1 and expert E−1 and gets a nonzero
    score, or an added flag, which the hypothesis test found only when its draws had padding pairs."""
    padded = 0
    for t, e, k, m, seed in [(7, 4, 1, 4, 0), (13, 5, 2, 3, 1), (30, 6, 3, 8, 2), (5, 3, 2, 2, 3)]:
        r, r_max = _assert_static_is_exact_then_padding(t, e, k, m, subroutine, seed)
        padded += r < r_max
    assert padded >= 1, padded  # balance pads least: (M_tile−1)//2 rows in all


@pytest.mark.parametrize("subroutine,extra", [("down", 0), ("nearest", 3), ("up", 7), ("stochastic", 7)])
def test_max_pairs_formula(subroutine, extra):
    """T·K plus, per expert, what the subroutine may add (M_tile = 8); ``balance`` adds (M_tile−1)//2 in all;
    never more than T·E."""
    assert max_pairs(100, 6, 2, 8, subroutine) == 200 + 6 * extra
    assert max_pairs(100, 6, 2, 8, "balance") == 203
    assert max_pairs(5, 6, 2, 8, "up") == 30  # T·E
    with pytest.raises(ValueError, match="subroutine"):  # a misspelt one read as "up"'s bound before
        max_pairs(100, 6, 2, 8, "neareest")
    # sizes: m_tile = 0 gave 12 < T·K = 16, a negative T a negative length, a float m_tile a float, K > E a bound
    for args, name in [((8, 4, 2, 0), "m_tile"), ((-8, 4, 2, 8), "num_tokens"), ((8, 4, 2, 4.0), "m_tile"),
                       ((8, 4, 5, 8), "top_k"), ((8, 0, 1, 8), "num_experts"), ((8.0, 4, 2, 8), "num_tokens"),
                       ((True, 4, 2, 8), "num_tokens")]:
        with pytest.raises(ValueError, match=name):
            max_pairs(*args, "nearest")
    with pytest.raises(ValueError, match=r"^top_k must be an int in \[1, E=4\], got 5$"):  # K shown, not E
        max_pairs(8, 4, 5, 8, "nearest")
    assert max_pairs(0, 4, 2, 8, "up") == 0


def test_static_reaches_the_bound():
    """"up" with every expert one token past a tile: R = R_max exactly, no padding pair left."""
    t, e, m = 9, 3, 4  # every token chooses every expert: f_e = 9 = 2·4 + 1 -> 12 > T: capped at 9 = T
    router, _ = _router(t, e, e, 0)
    static = token_rounding(router, m_tile=m, subroutine="up", warn=False, static=True)
    assert static.num_pairs == max_pairs(t, e, e, m, "up") == t * e
    assert int(static.counts.sum()) == t * e and (static.pair_token < t).all()


@pytest.mark.parametrize("subroutine", ROUNDING_SUBROUTINES)
def test_static_has_no_data_dependent_size(subroutine):
    """With ``static=True`` no op has a data-dependent output size or reads a value back: the one candidate is
    ``nonzero_static``, which on CUDA runs without a host sync (the GPU test below checks that under
    ``torch.cuda.set_sync_debug_mode("error")``)."""
    from test_token_rounding import SYNCING_OPS, _OpLog

    router, _ = _router(256, 16, 4, 0)
    log = _OpLog()
    with log:
        token_rounding(router, m_tile=16, subroutine=subroutine, generator=torch.Generator().manual_seed(0),
                       static=True)
    assert [op for op in log.ops if op in SYNCING_OPS] == ["nonzero_static"]
    assert not log.bool_index


def test_static_gradients_match_exact():
    """The router's gradients through the pair scores are those of the exact pairs; padding pairs, whatever
    their upstream gradient (NaN here), add nothing."""
    router, w = _router(64, 8, 2, 3)
    exact, static = _exact_and_static(router, m_tile=8, subroutine="up")
    r = exact.num_pairs
    cot = torch.randn(r, generator=torch.Generator().manual_seed(0))
    (g_exact,) = torch.autograd.grad((exact.pair_scores * cot).sum(), w, retain_graph=True)
    cot_static = torch.cat([cot, torch.full((static.num_pairs - r,), float("nan"))])
    (g_static,) = torch.autograd.grad((static.pair_scores * cot_static).nansum(), w)
    assert torch.isfinite(g_static).all()
    torch.testing.assert_close(g_static, g_exact, rtol=1e-6, atol=1e-7)


def test_routing_with_padding_invariants():
    """Padding pairs are in no expert and no token: offsets end at R (the real pairs), the rows and slots past it
    are theirs; row_token stays a valid index (T − 1); ``real_rows`` marks the real rows."""
    t, e = 50, 6
    router, _ = _router(t, e, 2, 1)
    exact, static = _exact_and_static(router, m_tile=4)
    r = exact.num_pairs
    ref = routing_from_pairs(exact.pair_token, exact.pair_expert, t, e, token_major=True)
    rt = routing_from_pairs(static.pair_token, static.pair_expert, t, e, token_major=True, padding=True,
                            check=True)
    assert rt.padded and rt.num_rows == static.num_pairs
    assert torch.equal(rt.expert_offsets, ref.expert_offsets) and torch.equal(rt.token_offsets, ref.token_offsets)
    for name in ("row_token", "row_pair", "pair_row", "token_rows"):
        assert torch.equal(getattr(rt, name)[:r], getattr(ref, name)), name
    assert (rt.row_token[r:] == t - 1).all() and (rt.pair_row[r:] >= r).all()
    assert torch.equal(rt.real_rows(), torch.arange(rt.num_rows) < r)
    assert rt.row_expert().max() < e and ref.real_rows() is None
    # the general (unsorted) path treats them the same way
    perm = torch.randperm(static.num_pairs, generator=torch.Generator().manual_seed(0))
    rg = routing_from_pairs(static.pair_token[perm], static.pair_expert[perm], t, e, padding=True)
    assert torch.equal(rg.expert_offsets, ref.expert_offsets) and torch.equal(rg.row_token[:r], ref.row_token)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bias", [False, True])
def test_experts_on_padded_routing_equal_exact(backend, bias, monkeypatch):
    """The experts on the static routing give the exact routing's output and gradients (float32; the triton backend
    through the interpreter on CPU), with every kernel output poisoned (NaN) first: the padding rows no kernel
    writes reach nothing. The padding pairs' score gradients are 0. Their scores are NaN and inf here, not the
    0 that token_rounding gives them (a user's static buffer may hold anything there): they reach no token (the
    torch backend added 0 · NaN to token T-1, whose index the padding rows carry, before session 89)."""
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")
    t, d, n, e, k, m = 45, 16, 8, 5, 2, 4
    router, _ = _router(t, e, k, 7, d=d)
    exact, static = _exact_and_static(router, m_tile=m, subroutine="nearest")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, d, generator=g)
    w1, w2 = torch.randn(e, 2 * n, d, generator=g) / 4, torch.randn(e, d, n, generator=g) / 3
    b1, b2 = (torch.randn(e, 2 * n, generator=g), torch.randn(e, d, generator=g)) if bias else (None, None)
    dout = torch.randn(t, d, generator=g)
    results = []
    for tr, padding in ((exact, False), (static, True)):
        leaves = [v.clone().requires_grad_(True) for v in (x, w1, w2, b1, b2) if v is not None]
        s = tr.pair_scores.detach().clone()
        s[exact.num_pairs:] = torch.tensor([float("nan"), float("inf")]).repeat(t * k)[:s.shape[0] - exact.num_pairs]
        s.requires_grad_(True)
        rt = routing_from_pairs(tr.pair_token, tr.pair_expert, t, e, token_major=True, padding=padding)
        args = leaves[:3] + [rt, s] + (leaves[3:] if bias else [])
        out = experts(*args, backend=backend)
        grads = torch.autograd.grad(out, leaves + [s], dout)
        results.append((out, *grads))
    r = exact.num_pairs
    assert (results[1][-1][r:] == 0).all()
    for a, b in zip(results[0][:-1], results[1][:-1]):
        assert torch.isfinite(b).all()
        assert rel_err(b, a) < 1e-6
    assert rel_err(results[1][-1][:r], results[0][-1]) < 1e-6


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_experts_on_padded_routing_without_tokens(backend):
    """T = 0 with a static-length routing (every pair padding): an empty output, and zero gradients for the weights
    and the scores (the torch backend gathered x[0] from an empty x before session 82)."""
    x = torch.randn(0, 8, requires_grad=True)
    w1, w2 = torch.randn(3, 12, 8, requires_grad=True), torch.randn(3, 8, 6, requires_grad=True)
    s = torch.rand(4, requires_grad=True)
    rt = routing_from_pairs(torch.zeros(4, dtype=torch.long), torch.full((4,), 3), 0, 3, padding=True, check=True)
    out = experts(x, w1, w2, rt, s, backend=backend)
    assert out.shape == (0, 8)
    grads = torch.autograd.grad(out.sum(), [x, w1, w2, s], allow_unused=True)
    assert grads[0] is None or grads[0].shape == (0, 8)
    assert all(g is None or not g.any() for g in grads[1:])


def test_moe_layer_token_rounding_is_static():
    """The layer in training routes with the static form: its buffers are R_max long, its counts the exact ones,
    and its output and gradients those of the exact pairs."""
    torch.manual_seed(0)
    layer = sonicmoe.MoE(16, 8, 6, 2, routing="token_rounding", m_tile=4, backend="torch", bias=True)
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
    out = layer(x)
    out.square().sum().backward()
    router = router_topk(x.detach(), layer.gate.weight, 2)
    exact = token_rounding(router, m_tile=4, warn=False)
    assert torch.equal(layer.expert_counts, exact.counts)
    rt = routing_from_pairs(exact.pair_token, exact.pair_expert, 40, 6, token_major=True)
    ex = layer.experts
    expect = sonicmoe.experts_ref(x.detach(), ex.gate_up_proj, ex.down_proj, rt, exact.pair_scores,
                                  ex.gate_up_proj_bias, ex.down_proj_bias)
    torch.testing.assert_close(out, expect.to(out.dtype), rtol=1e-5, atol=1e-5)
    assert torch.isfinite(x.grad).all() and layer.gate.weight.grad.abs().sum() > 0


def test_moe_layer_static_pairs_off_is_exact():
    """``static_pairs=False``: the layer routes exactly R pairs (one host sync) and gives the static form's output
    and gradients."""
    outs = []
    for static in (True, False):
        torch.manual_seed(0)
        layer = sonicmoe.MoE(16, 8, 6, 2, routing="token_rounding", m_tile=4, backend="torch", static_pairs=static)
        x = torch.randn(40, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
        out = layer(x)
        out.square().sum().backward()
        outs.append((out.detach(), x.grad, layer.gate.weight.grad, layer.experts.gate_up_proj.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="static_pairs"):
        sonicmoe.MoE(16, 8, 6, 2, static_pairs="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("subroutine", ["nearest", "up", "balance"])
def test_gpu_token_rounding_layer_has_no_host_sync(subroutine):
    """bf16 on CUDA: the token-rounding layer's forward and backward run under ``torch.cuda.set_sync_debug_mode
    ("error")`` (a host sync it detects raises, as the ``static=False`` form's nonzero does), and give the exact
    routing's bits: output and every gradient, the same tiles on the same rows (static vs ``static=False``)."""
    torch.manual_seed(0)
    t, d, n, e, k = 2048, 256, 128, 32, 4
    layer = sonicmoe.MoE(d, n, e, k, routing="token_rounding", rounding=subroutine, m_tile=128,
                         device="cuda", dtype=torch.bfloat16)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    layer(x).backward(dout)  # compile and autotune outside the sync check
    x.grad = None
    layer.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):  # the detector sees the exact form's nonzero
            token_rounding(router_topk(x.detach(), layer.gate.weight, k), m_tile=128, subroutine=subroutine)
        out = layer(x)
        out.backward(dout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    grads = [x.grad, layer.gate.weight.grad, layer.experts.gate_up_proj.grad, layer.experts.down_proj.grad]
    leaves = [v.detach().clone().requires_grad_(True) for v in (x, layer.gate.weight, layer.experts.gate_up_proj,
                                                               layer.experts.down_proj)]
    router = router_topk(leaves[0], leaves[1], k)
    exact = token_rounding(router, m_tile=128, subroutine=subroutine, fused_router_grad=True)  # as the layer calls it
    rt = routing_from_pairs(exact.pair_token, exact.pair_expert, t, e, token_major=True)
    ref = experts(leaves[0], leaves[2], leaves[3], rt, exact.pair_scores, backend="triton")
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    assert torch.equal(out, ref)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_torch_backend_on_padded_routing():
    """The torch backend (``torch._grouped_mm`` in bf16 on Hopper) on a static routing gives the exact routing's
    output and gradients: the padding rows past the last group offset are masked."""
    t, d, n, e, k = 1024, 128, 64, 16, 2
    router, _ = _router(t, e, k, 5, d=d, device="cuda")
    exact, static = _exact_and_static(router, m_tile=64, subroutine="up")
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(t, d, device="cuda", generator=g, dtype=torch.bfloat16)
    w1 = (torch.randn(e, 2 * n, d, device="cuda", generator=g) / 8).bfloat16()
    w2 = (torch.randn(e, d, n, device="cuda", generator=g) / 8).bfloat16()
    dout = torch.randn(t, d, device="cuda", generator=g, dtype=torch.bfloat16)
    results = []
    for tr, padding in ((exact, False), (static, True)):
        leaves = [v.clone().requires_grad_(True) for v in (x, w1, w2)]
        s = tr.pair_scores.detach().float().clone().requires_grad_(True)
        rt = routing_from_pairs(tr.pair_token, tr.pair_expert, t, e, token_major=True, padding=padding)
        out = experts(*leaves, rt, s, backend="torch")
        results.append((out, *torch.autograd.grad(out, leaves + [s], dout)))
    r = exact.num_pairs
    assert (results[1][-1][r:] == 0).all()
    for a, b in zip(results[0][:-1], results[1][:-1]):
        assert torch.isfinite(b).all() and rel_err(b.float(), a.float()) < 1e-2
    assert rel_err(results[1][-1][:r], results[0][-1]) < 1e-2
