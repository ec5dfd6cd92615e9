"""Token rounding (SPEC §5): invariants, subroutine directions, fast == plain-PyTorch oracle, MoE use."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import sonicmoe
from sonicmoe.config import ROUNDING_SUBROUTINES
from sonicmoe.routing import RouterOutput, router_topk, routing_from_pairs
from sonicmoe.token_rounding import TokenRoundingOutput, token_rounding, token_rounding_ref

# Most cases here are deliberately small (few tokens per tile); the warning has its own test.
pytestmark = pytest.mark.filterwarnings("ignore:token rounding with")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every kernel output poisoned (NaN; int32: int-min) before its kernel writes it: an element no program writes
    fails the comparison with the twin."""
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")


ORDERS = [("topk_then_softmax", False), ("softmax_then_topk", False), ("softmax_then_topk", True),
          ("sigmoid_then_topk", False), ("sigmoid_then_topk", True)]


def make_router(t, e, k, *, seed=0, scale=1.0, router_order="topk_then_softmax", renormalize=False,
                dtype=torch.float32):
    """Fresh random router output from random x (T, 8) and W_r (E, 8); W_r requires grad."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 8, generator=g, dtype=dtype)
    w = (torch.randn(e, 8, generator=g, dtype=dtype) * scale).requires_grad_(True)
    r = router_topk(x, w, k, router_order=router_order, renormalize=renormalize)
    r.logits.retain_grad()
    return r, w


def tr_kwargs(router_order="topk_then_softmax", renormalize=False):
    return {"router_order": router_order, "renormalize": renormalize}


def check_invariants(router: RouterOutput, out: TokenRoundingOutput, m: int, order: str = "topk_then_softmax") -> None:
    """Every SPEC §5 guarantee, checked with plain Python per expert. A padded expert adds the non-chosen tokens of
    highest probability (under ``sigmoid_then_topk``: of highest sigmoid)."""
    t, e = router.logits.shape
    ids = router.topk_ids.tolist()
    scores = router.topk_scores.detach().float()
    probs = (torch.sigmoid(router.logits) if order == "sigmoid_then_topk" else router.probs).detach().float()
    chosen = torch.zeros(t, e, dtype=torch.bool).scatter_(1, router.topk_ids, True)
    f = chosen.sum(0)
    assert out.topk_counts.tolist() == f.tolist()
    pt, pe = out.pair_token.long(), out.pair_expert.long()
    r = pt.shape[0]
    assert out.pair_scores.shape == (r,) and out.pair_added.shape == (r,)
    assert torch.bincount(pe, minlength=e).tolist() == out.counts.tolist()
    assert torch.unique(pt * e + pe).numel() == r, "routed pairs must be unique"
    assert torch.equal(out.pair_added, ~chosen[pt, pe])
    # kept top-k pairs keep their top-k score exactly
    kidx = {(tok, ids[tok][j]): j for tok in range(t) for j in range(len(ids[tok]))}
    for p in torch.nonzero(~out.pair_added).flatten().tolist():
        tok, x = pt[p].item(), pe[p].item()
        assert out.pair_scores[p].item() == router.topk_scores[tok, kidx[(tok, x)]].item()
    for x in range(e):
        fx, cx = int(f[x]), int(out.counts[x])
        lo, hi = fx // m * m, -(-fx // m) * m
        assert abs(cx - fx) < m, "within one tile of top-k"
        assert cx in (lo, min(hi, t))
        capped = hi > t and cx == t
        assert cx % m == 0 or (capped and cx != lo), "tile multiple except the cap edge"
        assert bool(out.padded[x]) == (cx > lo)
        mine = pe == x
        toks = set(pt[mine].tolist())
        chosen_toks = set(torch.nonzero(chosen[:, x]).flatten().tolist())
        if cx <= fx:  # rounded down: only chosen tokens, the highest-scored ones
            assert toks <= chosen_toks
            s_col = {tok: scores[tok, ids[tok].index(x)].item() for tok in chosen_toks}
            dropped = chosen_toks - toks
            if toks and dropped:
                assert min(s_col[tok] for tok in toks) >= max(s_col[tok] for tok in dropped)
        if cx >= fx:  # padded: all chosen tokens, plus the most probable non-chosen ones
            assert chosen_toks <= toks
            added = toks - chosen_toks
            rest = set(range(t)) - toks
            if added and rest:
                assert min(probs[tok, x].item() for tok in added) >= max(probs[tok, x].item() for tok in rest)


def assert_same(a: TokenRoundingOutput, b: TokenRoundingOutput) -> None:
    for name in ("pair_token", "pair_expert", "pair_added", "counts", "topk_counts", "padded"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.pair_scores, b.pair_scores, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("subroutine", ROUNDING_SUBROUTINES)
@pytest.mark.parametrize("order,renorm", ORDERS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_equals_ref_and_invariants(subroutine, order, renorm, seed):
    t, e, k, m = 200 + 37 * seed, 12, 3, 8
    router, _ = make_router(t, e, k, seed=seed, router_order=order, renormalize=renorm)
    kw = dict(m_tile=m, subroutine=subroutine, **tr_kwargs(order, renorm))
    fast = token_rounding(router, generator=torch.Generator().manual_seed(seed), **kw)
    ref = token_rounding_ref(router, generator=torch.Generator().manual_seed(seed), **kw)
    assert_same(fast, ref)
    check_invariants(router, fast, m, order)
    assert fast.pair_token.dtype == torch.int32 and fast.pair_expert.dtype == torch.int32


@settings(max_examples=60, deadline=None)
@given(
    t=st.integers(1, 120),
    e=st.integers(1, 10),
    kfrac=st.floats(0, 1),
    m=st.sampled_from([1, 2, 3, 4, 7, 8, 16, 32]),
    subroutine=st.sampled_from(ROUNDING_SUBROUTINES),
    order=st.sampled_from(ORDERS),
    scale=st.sampled_from([0.1, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_fast_equals_ref(t, e, kfrac, m, subroutine, order, scale, seed):
    k = 1 + int(kfrac * (e - 1))
    router, _ = make_router(t, e, k, seed=seed, scale=scale, router_order=order[0], renormalize=order[1])
    kw = dict(m_tile=m, subroutine=subroutine, **tr_kwargs(*order))
    fast = token_rounding(router, generator=torch.Generator().manual_seed(seed), **kw)
    ref = token_rounding_ref(router, generator=torch.Generator().manual_seed(seed), **kw)
    assert_same(fast, ref)
    check_invariants(router, fast, m, order[0])


@pytest.mark.parametrize("subroutine", ROUNDING_SUBROUTINES)
def test_ref_equals_fast_at_the_cap_edge(subroutine):
    """T below one tile (T = 5, M_tile = 8): every padded count is capped at T, in the torch reference as in the fast
    path (the reference's own cap, ``min(hi, T)``, was checked only when the hypothesis test drew such a case)."""
    for seed in range(3):
        router, _ = make_router(5, 3, 1, seed=seed)
        kw = dict(m_tile=8, subroutine=subroutine, warn=False)
        fast = token_rounding(router, generator=torch.Generator().manual_seed(seed), **kw)
        ref = token_rounding_ref(router, generator=torch.Generator().manual_seed(seed), **kw)
        assert_same(fast, ref)
        assert (ref.counts <= 5).all()


@pytest.mark.parametrize("subroutine", ["down", "up", "nearest"])
def test_ref_equals_fast_on_tied_scores(subroutine):
    """Tokens of identical rows tie exactly on their scores and probabilities: both paths break ties by the lower
    token index, among the chosen tokens a rounded-down expert keeps and among the others a padded one adds."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 8, generator=g).repeat(7, 1)  # 21 tokens, 3 distinct rows: 7-way ties
    router = router_topk(x, torch.randn(4, 8, generator=g), 2)
    kw = dict(m_tile=4, subroutine=subroutine, warn=False)
    fast, ref = token_rounding(router, **kw), token_rounding_ref(router, **kw)
    assert_same(fast, ref)
    assert not torch.equal(ref.counts, ref.topk_counts)  # some expert was rounded


@pytest.mark.parametrize("seed", range(4))
def test_subroutine_directions(seed):
    t, e, k, m = 300, 16, 4, 16
    router, _ = make_router(t, e, k, seed=seed)
    outs = {s: token_rounding(router, m_tile=m, subroutine=s) for s in ("nearest", "up", "down")}
    f = outs["up"].topk_counts.long()
    lo, hi = f // m * m, (f + m - 1) // m * m
    assert (outs["up"].counts >= f).all() and torch.equal(outs["up"].counts.long(), hi)
    assert (outs["down"].counts <= f).all() and torch.equal(outs["down"].counts.long(), lo)
    nearest = torch.where(2 * (f - lo) > m, hi, lo)  # exact ties round down
    assert torch.equal(outs["nearest"].counts.long(), nearest)
    assert ((outs["nearest"].counts.long() - f).abs() <= m // 2).all()


def test_nearest_tie_rounds_down():
    # T=8, E=2, K=1 with M=4: craft logits so expert 0 gets 6 tokens (lo=4, frac=2 = M/2: a tie)
    logits = torch.tensor([[1.0, 0.0]] * 6 + [[0.0, 1.0]] * 2, requires_grad=True)
    probs = logits.softmax(-1)
    top, ids = logits.topk(1, dim=-1)
    router = RouterOutput(logits, probs, ids, top.softmax(-1))
    out = token_rounding(router, m_tile=4, subroutine="nearest")
    assert out.topk_counts.tolist() == [6, 2]
    assert out.counts.tolist() == [4, 0]


@pytest.mark.parametrize("seed", range(5))
def test_balance_keeps_total_within_half_tile(seed):
    t, e, k, m = 512, 32, 4, 16  # T a multiple of M: no expert can hit the cap
    router, _ = make_router(t, e, k, seed=seed)
    out = token_rounding(router, m_tile=m, subroutine="balance")
    diff = int(out.counts.sum()) - int(out.topk_counts.sum())
    assert -m / 2 <= diff < m / 2
    # every prefix too (it is a running residual over experts in index order)
    prefix = torch.cumsum(out.counts.long() - out.topk_counts.long(), 0)
    assert (prefix.abs() <= m / 2).all()


def test_cap_edge_keeps_all_tokens():
    # E == K: every expert is chosen by all T tokens, f_e = T = 11, lo = 8, hi = 12 > T.
    t, m = 11, 4
    router, _ = make_router(t, 2, 2, seed=3)
    up = token_rounding(router, m_tile=m, subroutine="up")
    assert up.counts.tolist() == [11, 11] and up.padded.all() and not up.pair_added.any()
    near = token_rounding(router, m_tile=m, subroutine="nearest")  # frac 3 > M/2: pad, capped at T
    assert near.counts.tolist() == [11, 11]
    down = token_rounding(router, m_tile=m, subroutine="down")
    assert down.counts.tolist() == [8, 8]
    # f = 10 (frac 2 = M/2): nearest ties down to 8; up caps at T = 10
    router, _ = make_router(10, 3, 3, seed=4)
    assert token_rounding(router, m_tile=m).counts.tolist() == [8, 8, 8]
    assert token_rounding(router, m_tile=m, subroutine="up").counts.tolist() == [10, 10, 10]
    # a capped expert next to ordinary ones
    router, _ = make_router(30, 4, 3, seed=5)
    for s in ROUNDING_SUBROUTINES:
        out = token_rounding(router, m_tile=8, subroutine=s, generator=torch.Generator().manual_seed(0))
        assert_same(out, token_rounding_ref(router, m_tile=8, subroutine=s,
                                            generator=torch.Generator().manual_seed(0)))
        check_invariants(router, out, 8)


def test_stochastic_reproducible_and_unbiased():
    t, e, k, m = 256, 32, 4, 16
    router, _ = make_router(t, e, k, seed=7)
    a = token_rounding(router, m_tile=m, subroutine="stochastic", generator=torch.Generator().manual_seed(11))
    b = token_rounding(router, m_tile=m, subroutine="stochastic", generator=torch.Generator().manual_seed(11))
    assert_same(a, b)
    g = torch.Generator().manual_seed(12)
    n = 400
    pads = torch.zeros(e)
    for _ in range(n):
        pads += token_rounding(router, m_tile=m, subroutine="stochastic", generator=g).padded.float()
    f = a.topk_counts.float()
    p = (f - torch.div(f, m, rounding_mode="floor") * m) / m
    freq = pads / n
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-9).all(), (freq, p)
    # experts with f a tile multiple never pad; overall frequency matches the expectation
    assert (freq[p == 0] == 0).all()
    assert abs(float(pads.sum()) - n * float(p.sum())) <= 5 * math.sqrt(n * float((p * (1 - p)).sum())) + 1e-9
    # in expectation the total equals top-k's
    mean_total = (torch.div(f, m, rounding_mode="floor") * m + m * freq).sum()
    assert abs(float(mean_total - f.sum())) < 0.05 * float(f.sum())


@pytest.mark.parametrize("order,renorm", ORDERS)
def test_gradients_flow_to_router(order, renorm):
    t, e, k, m = 96, 8, 2, 16
    router, w = make_router(t, e, k, seed=9, router_order=order, renormalize=renorm)
    out = token_rounding(router, m_tile=m, subroutine="up", **tr_kwargs(order, renorm))
    assert out.pair_added.any(), "this case must add pairs"
    cot = torch.randn(out.num_pairs, generator=torch.Generator().manual_seed(0))
    (out.pair_scores * cot).sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    g_fast = router.logits.grad.clone()
    # added pairs alone receive gradient through the logits
    router2, _ = make_router(t, e, k, seed=9, router_order=order, renormalize=renorm)
    out2 = token_rounding(router2, m_tile=m, subroutine="up", **tr_kwargs(order, renorm))
    (g_added,) = torch.autograd.grad(out2.pair_scores[out2.pair_added].sum(), router2.logits)
    sel = out2.pair_added
    assert g_added[out2.pair_token[sel].long(), out2.pair_expert[sel].long()].abs().min() > 0
    # and equal the oracle's gradients
    router3, _ = make_router(t, e, k, seed=9, router_order=order, renormalize=renorm)
    ref = token_rounding_ref(router3, m_tile=m, subroutine="up", **tr_kwargs(order, renorm))
    (ref.pair_scores * cot).sum().backward()
    torch.testing.assert_close(g_fast, router3.logits.grad, rtol=1e-5, atol=1e-7)


def test_added_scores_follow_router_order():
    t, e, k, m = 64, 8, 2, 16
    for order, renorm in ORDERS:
        router, _ = make_router(t, e, k, seed=2, router_order=order, renormalize=renorm)
        out = token_rounding(router, m_tile=m, subroutine="up", **tr_kwargs(order, renorm))
        sel = out.pair_added
        tok, ex = out.pair_token[sel].long(), out.pair_expert[sel].long()
        lg, pr = router.logits.detach(), router.probs.detach()
        if order == "topk_then_softmax":
            expect = torch.exp(lg[tok, ex] - lg.gather(1, router.topk_ids).logsumexp(1)[tok])
        elif order == "sigmoid_then_topk":  # the sigmoid of the added logit, over the chosen sigmoids' sum + 1e-20
            sig = torch.sigmoid(lg)
            expect = sig[tok, ex] / (sig.gather(1, router.topk_ids).sum(1)[tok] + 1e-20) if renorm else sig[tok, ex]
        else:
            expect = pr[tok, ex]
            if renorm:
                expect = expect / pr.gather(1, router.topk_ids).sum(1)[tok]
        torch.testing.assert_close(out.pair_scores[sel].detach(), expect)
        # an added expert never outscores the token's own chosen experts
        assert (out.pair_scores[sel].detach() <= router.topk_scores.detach().min(1).values[tok] + 1e-6).all()


def test_sigmoid_renormalized_added_scores_keep_the_eps():
    """sigmoid_then_topk with renormalize divides by Σ chosen sigmoids + 1e-20 (the router's own formula), added pairs
    too: with every logit near -70 (sigmoids ~4e-31) the 1e-20 dominates the sum, so an added pair's score is ~1e-10
    times its sigmoid's ratio, not O(1). Every path against a float64 evaluation of the formula."""
    g = torch.Generator().manual_seed(2)
    t, e, k = 16, 4, 1
    x = torch.cat([torch.ones(t, 1), torch.randn(t, 7, generator=g)], 1)
    w = torch.cat([torch.full((e, 1), -70.0), 0.3 * torch.randn(e, 7, generator=g)], 1)
    router = router_topk(x, w, k, router_order="sigmoid_then_topk", renormalize=True)
    sig = torch.sigmoid(router.logits.detach().double())
    assert float(sig.max()) < 1e-28
    want = sig / (sig.gather(1, router.topk_ids).sum(1, keepdim=True) + 1e-20)
    kw = dict(m_tile=8, subroutine="up", router_order="sigmoid_then_topk", renormalize=True, warn=False)
    for fn, extra in ((token_rounding, {"use_kernel": False}), (token_rounding, {"use_kernel": True}),
                      (token_rounding_ref, {})):
        out = fn(router, **kw, **extra)
        added = out.pair_added
        assert int(added.sum()) > 0, fn
        got = out.pair_scores.detach()[added].double()
        torch.testing.assert_close(got, want[out.pair_token[added].long(), out.pair_expert[added].long()], rtol=1e-5,
                                   atol=0)
        assert float(got.max()) < 1e-8, (fn, extra)


def test_sigmoid_order_never_computes_the_softmax_probs():
    """Under sigmoid_then_topk token rounding ranks and scores by the sigmoids: the router's (T, E) probs (the balance
    loss's input, computed on first access) stay uncomputed, on the kernel path (interpreter) and the torch path."""
    from sonicmoe.ops.common import interpreting

    for use_kernel in ((False, True) if interpreting() else (False,)):
        router, _ = make_router(64, 8, 2, seed=4, router_order="sigmoid_then_topk", renormalize=True)
        out = token_rounding(router, m_tile=16, subroutine="up", use_kernel=use_kernel,
                             **tr_kwargs("sigmoid_then_topk", True))
        assert out.pair_added.any() and router._probs is None, use_kernel


def test_float64_router():
    router, _ = make_router(150, 6, 2, seed=1, dtype=torch.float64)
    for s in ROUNDING_SUBROUTINES:
        g = dict(generator=torch.Generator().manual_seed(0))
        out = token_rounding(router, m_tile=8, subroutine=s, **g)
        assert out.pair_scores.dtype == router.topk_scores.dtype
        assert_same(out, token_rounding_ref(router, m_tile=8, subroutine=s,
                                            generator=torch.Generator().manual_seed(0)))
        check_invariants(router, out, 8)


def test_routing_from_pairs_accepts_output():
    router, _ = make_router(128, 8, 2, seed=0)
    out = token_rounding(router, m_tile=8)
    routing = routing_from_pairs(out.pair_token, out.pair_expert, 128, 8)
    assert torch.equal(routing.expert_counts(), out.counts)
    # the output's own routing is the same, with the kernels' hint of whole M_tile tiles (plain routing: none)
    assert out.routing.tile_rows == 8 and routing.tile_rows == 0
    assert torch.equal(out.routing.expert_offsets, routing.expert_offsets)
    assert torch.equal(out.routing.row_token, routing.row_token)
    # the rows of each expert are its pairs (kept and added) in ascending token order
    for x in range(8):
        a, b = routing.expert_offsets[x].item(), routing.expert_offsets[x + 1].item()
        mine = out.pair_expert == x
        assert torch.equal(routing.row_token[a:b], out.pair_token[mine].sort().values)
        assert torch.equal(routing.row_pair[a:b].sort().values.long(), mine.nonzero().squeeze(1))


def test_bad_arguments():
    router, _ = make_router(16, 4, 2)
    for m in (0, 2**24 + 1, 2**31 - 2):  # above 2^24: the kernels' int32 counts would overflow (2·M_tile)
        with pytest.raises(ValueError, match=r"m_tile must be an int in \[1, 16777216\]"):
            token_rounding(router, m_tile=m)
    with pytest.raises(ValueError, match="subroutine"):
        token_rounding(router, m_tile=4, subroutine="sideways")
    with pytest.raises(ValueError, match="router_order"):
        token_rounding(router, m_tile=4, router_order="whatever")
    with pytest.raises(TypeError):
        token_rounding((router.logits, router.topk_ids), m_tile=4)
    # top-k ids and scores of another number of tokens than the logits (a stale or sliced router output)
    ids, scores = router.topk_ids, router.topk_scores
    for bad_ids, bad_scores in ((ids[:15], scores[:15]), (torch.cat([ids, ids[:1]]), torch.cat([scores, scores[:1]]))):
        bad = RouterOutput(router.logits, router.probs, bad_ids, bad_scores)
        for fn in (token_rounding, token_rounding_ref):
            with pytest.raises(ValueError, match=r"router.topk_ids and router.topk_scores must both be \(T=16, K\)"):
                fn(bad, m_tile=4)
    for flag in ("renormalize", "static", "fused_router_grad", "warn", "use_kernel"):  # "no" read as True before
        with pytest.raises(ValueError, match=f"{flag} must be a bool, got 'no'"):
            token_rounding(router, m_tile=4, **{flag: "no"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no token: no "few tokens per expert" warning
        empty, _ = make_router(0, 4, 2)
        assert token_rounding(empty, m_tile=4).pair_token.numel() == 0


@pytest.mark.parametrize("fn", [token_rounding, token_rounding_ref])
def test_bad_router_tensors(fn):
    """A hand-built RouterOutput of the wrong kind or shape is refused by name before anything runs: float, bool or
    complex top-k ids, integer logits, probs of another shape than the logits, logits and probs of three dimensions,
    scores of another shape than the ids, K = 0 experts."""
    router, _ = make_router(16, 4, 2, seed=5)
    logits, probs, ids, scores = router.logits, router.probs, router.topk_ids, router.topk_scores

    def refused(exc, match, *tensors):
        with pytest.raises(exc, match=match):
            fn(RouterOutput(*tensors), m_tile=4, warn=False)

    refused(TypeError, "router.topk_ids must be an integer tensor, got torch.float32", logits, probs, ids.float(),
            scores)
    # bool and complex ids are not integer ids either (bool ids would index as a mask)
    refused(TypeError, "router.topk_ids must be an integer tensor, got torch.bool", logits, probs, ids.bool(), scores)
    refused(TypeError, "router.topk_ids must be an integer tensor, got torch.complex64", logits, probs,
            ids.to(torch.complex64), scores)
    refused(TypeError, "router.logits must be a floating-point tensor, got torch.int64", logits.long(), probs, ids,
            scores)
    refused(TypeError, "router.topk_scores must be a floating-point tensor, got torch.int32", logits, probs, ids,
            scores.int())
    refused(ValueError, r"router.logits and router.probs must both be \(T, E\), got \(16, 4\) and \(16, 3\)", logits,
            probs[:, :3], ids, scores)
    refused(ValueError, r"router.logits and router.probs must both be \(T, E\), got \(16, 4, 1\) and \(16, 4, 1\)",
            logits[..., None], probs[..., None], ids, scores)
    refused(ValueError, r"router.topk_ids and router.topk_scores must both be \(T=16, K\) with 1 <= K <= E=4, got "
            r"\(16, 2\) and \(16, 1\)", logits, probs, ids, scores[:, :1])
    refused(ValueError, r"with 1 <= K <= E=4, got \(16, 0\) and \(16, 0\)", logits, probs, ids[:, :0], scores[:, :0])


@pytest.mark.parametrize("fn", [token_rounding, token_rounding_ref])
def test_check_verifies_custom_topk_ids(fn):
    """check=True refuses ids from a hand-built RouterOutput outside [0, E) or repeated within a token (without it a
    repeated id passes silently), and leaves valid ids' result unchanged."""
    router, _ = make_router(64, 8, 2, seed=3)
    kw = {"m_tile": 8, "warn": False}
    good = fn(router, **kw)
    checked = fn(router, check=True, **kw)
    assert torch.equal(checked.pair_token, good.pair_token) and torch.equal(checked.pair_expert, good.pair_expert)
    for bad_id, match in ((8, r"router.topk_ids must lie in \[0, E=8\), got values in \[0, 8\]"),
                          (-1, r"router.topk_ids must lie in \[0, E=8\), got values in \[-1, 7\]")):
        ids = router.topk_ids.clone()
        ids[5, 0] = bad_id
        with pytest.raises(ValueError, match=match):
            fn(RouterOutput(router.logits, router.probs, ids, router.topk_scores), check=True, **kw)
    ids = router.topk_ids.clone()
    ids[9, 1] = ids[9, 0]
    dup = RouterOutput(router.logits, router.probs, ids, router.topk_scores)
    assert fn(dup, **kw).topk_counts.sum() in (64 * 2 - 1, 64 * 2)  # unchecked: runs, counted once or twice
    with pytest.raises(ValueError, match="router.topk_ids must hold distinct experts per token, token 9 has"):
        fn(dup, check=True, **kw)
    with pytest.raises(ValueError, match="check must be a bool"):
        fn(router, check=1, **kw)


def test_warns_below_two_tiles():
    """The warning names the mean tokens per expert T·K/E and points at the caller of token_rounding (here: this file),
    not at the library's own lines."""
    router, _ = make_router(64, 8, 2, seed=0)  # T·K/E = 16 tokens per expert
    with pytest.warns(UserWarning, match="token rounding with 16 mean tokens per expert < 2·M_tile=32: ") as rec:
        token_rounding(router, m_tile=16)
    with pytest.warns(UserWarning, match="token rounding with 16 mean tokens per expert < 2·M_tile=32: ") as rec_ref:
        token_rounding_ref(router, m_tile=16)
    assert [w.filename for w in (*rec, *rec_ref)] == [__file__, __file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        token_rounding(router, m_tile=8)  # 16 / 8 = 2 tiles: fine
        token_rounding(router, m_tile=16, warn=False)


def test_empty_batch():
    router, _ = make_router(0, 4, 2)
    for s in ROUNDING_SUBROUTINES:
        out = token_rounding(router, m_tile=4, subroutine=s, warn=False)
        assert out.num_pairs == 0 and out.counts.tolist() == [0, 0, 0, 0]


# ---- the MoE layer -------------------------------------------------------------------------------


def _moe_pair(**kw):
    d, n, e, k = 16, 8, 8, 2
    torch.manual_seed(0)
    tr = sonicmoe.MoE(d, n, e, k, routing="token_rounding", backend="torch", **kw)
    top = sonicmoe.MoE(d, n, e, k, routing="topk", backend="torch",
                       **{a: b for a, b in kw.items() if a not in ("m_tile", "rounding")})
    top.load_state_dict(tr.state_dict())
    return tr, top


@pytest.mark.parametrize("rounding", ROUNDING_SUBROUTINES)
@pytest.mark.parametrize("order,renorm", [("topk_then_softmax", False), ("softmax_then_topk", True),
                                          ("sigmoid_then_topk", True)])
def test_moe_train_mode_tile_multiples(rounding, order, renorm):
    m = 16
    tr, _ = _moe_pair(m_tile=m, rounding=rounding, router_order=order, renormalize=renorm)
    tr.train()
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 256·2/8 = 64 tokens per expert = 4 tiles: no warning
        out = tr(x)
    assert out.shape == x.shape and torch.isfinite(out).all()
    counts = tr.expert_counts
    assert (counts % m == 0).all() and int(counts.sum()) > 0  # T = 256 is a tile multiple: no cap edge
    # the layer output equals the experts computed on token_rounding's routing
    router = router_topk(x.detach(), tr.gate.weight, 2, router_order=order, renormalize=renorm)
    ref_tr = token_rounding(router, m_tile=m, subroutine=rounding, router_order=order, renormalize=renorm,
                            warn=False)
    if rounding != "stochastic":  # stochastic draws differ from the layer's (default generator)
        assert torch.equal(counts, ref_tr.counts)
        routing = routing_from_pairs(ref_tr.pair_token, ref_tr.pair_expert, 256, 8)
        ex = tr.experts
        expect = sonicmoe.experts_ref(x.detach(), ex.gate_up_proj, ex.down_proj, routing, ref_tr.pair_scores)
        torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
        # the load-balancing loss counts the rounded pairs (f_e = count_e / R), not the top-k ones
        f = ref_tr.counts.double() / ref_tr.counts.sum()
        assert not torch.equal(ref_tr.counts, ref_tr.topk_counts)
        aux = tr.config.aux_loss_coef * 8 * (f * router.probs.double().mean(0)).sum()
        assert abs(float(tr.aux_loss) - float(aux)) <= 1e-6 * float(aux)
    out.square().sum().backward()
    assert x.grad is not None and tr.gate.weight.grad.abs().sum() > 0
    assert tr.experts.gate_up_proj.grad.abs().sum() > 0


def test_moe_eval_mode_equals_topk():
    tr, top = _moe_pair(m_tile=16)
    tr.eval()
    top.eval()
    x = torch.randn(3, 40, 16, generator=torch.Generator().manual_seed(2))
    out = tr(x)
    torch.testing.assert_close(out, top(x), rtol=0, atol=0)
    assert torch.equal(tr.expert_counts, top.expert_counts)
    ref = sonicmoe.moe(x.reshape(-1, 16), tr.gate.weight, tr.experts.gate_up_proj, tr.experts.down_proj,
                       top_k=2, backend="torch")
    torch.testing.assert_close(out.reshape(-1, 16), ref.out, rtol=0, atol=0)


def test_moe_warns_with_few_tokens():
    tr, _ = _moe_pair(m_tile=64)
    tr.train()
    x = torch.randn(128, 16)  # 128·2/8 = 32 tokens per expert < 2·64
    with pytest.warns(UserWarning, match="token rounding"):
        tr(x)


# ops with a data-dependent output size or a value read back by the host (on CUDA, a sync), and nonzero_static
SYNCING_OPS = {"_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select", "bincount",
               "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "masked_scatter"}


class _OpLog(TorchDispatchMode):
    """Records every aten op and whether any index argument is a boolean mask (which syncs on CUDA)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.bool_index = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops.append(name)
        if name in ("index", "index_put", "index_put_"):
            idx = args[1] if len(args) > 1 else []
            self.bool_index |= any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("subroutine", ROUNDING_SUBROUTINES)
def test_single_host_sync(subroutine):
    """``static=False``: the only data-dependent-size op is the final nonzero; no scalar reads
    (.item/.tolist/bool())."""
    router, _ = make_router(256, 16, 4, seed=0)
    log = _OpLog()
    with log:
        token_rounding(router, m_tile=16, subroutine=subroutine, generator=torch.Generator().manual_seed(0))
    found = [op for op in log.ops if op in SYNCING_OPS]
    assert found == ["nonzero"], found
    assert not log.bool_index
