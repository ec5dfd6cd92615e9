"""Token rounding's pair-score kernels (sonicmoe.ops.tr_scores) against their torch twin, values and gradients.

On CPU the kernels run through Triton's interpreter (no tl.dot involved, so float32 and float16 both work).
"""

from __future__ import annotations

import pytest
import torch

from sonicmoe.ops.common import interpreting
from sonicmoe.ops.tr_scores import pair_scores, pair_scores_ref, use_score_kernels
from sonicmoe.routing import router_topk

pytestmark = pytest.mark.interpreter

ORDERS = [("topk_then_softmax", False), ("softmax_then_topk", False), ("softmax_then_topk", True),
          ("sigmoid_then_topk", False), ("sigmoid_then_topk", True)]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every kernel output NaN (int32: int-min) before its kernel writes it: an element no program writes fails."""
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")


def make_case(t, e, k, seed, order, renorm, device, dtype=torch.float32, empty_tokens=True, weight=False):
    """A router with differentiable logits and random token-major unique pairs: for each token a random
    subset of the experts (chosen and not), some tokens with none. ``weight``: also return the router weight (the
    leaf behind the logits)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 16, generator=g)
    w = (torch.randn(e, 16, generator=g) * 2).to(device).requires_grad_(True)
    router = router_topk(x.to(device), w, k, router_order=order, renormalize=renorm)
    if dtype != torch.float32:
        router.topk_scores = router.topk_scores.to(dtype)
    take = torch.rand(t, e, generator=g) < 0.4
    if empty_tokens and t > 2:
        take[1] = False
    take[0] = True  # a token with every expert: all chosen ones and every other
    pairs = take.nonzero()
    case = router, pairs[:, 0].to(device), pairs[:, 1].to(device)
    return (*case, w) if weight else case


def grads(fn, router, pt, pe, order, renorm, cot):
    src = router.probs if order == "softmax_then_topk" else router.logits  # sigmoid: through torch's sigmoid
    scores, added = fn(router, pt, pe, order, renorm)
    d_ts, d_src = torch.autograd.grad(scores, (router.topk_scores, src), cot.to(scores.dtype), allow_unused=True,
                                      retain_graph=True)
    return scores, added, d_ts, d_src


@pytest.mark.parametrize("order,renorm", ORDERS)
@pytest.mark.parametrize("t,e,k,seed", [(1, 4, 2, 0), (37, 6, 1, 1), (50, 5, 5, 2), (200, 33, 4, 3)])
def test_kernel_equals_twin_values_and_gradients(device, order, renorm, t, e, k, seed):
    router, pt, pe = make_case(t, e, k, seed, order, renorm, device)
    cot = torch.randn(pt.shape[0], generator=torch.Generator().manual_seed(seed + 100)).to(device)
    before = [x.detach().clone() for x in (router.logits, router.probs, router.topk_scores, pt, pe)]
    s_k, a_k, dts_k, dsrc_k = grads(pair_scores, router, pt, pe, order, renorm, cot)
    s_r, a_r, dts_r, dsrc_r = grads(pair_scores_ref, router, pt, pe, order, renorm, cot)
    assert torch.equal(a_k, a_r)
    assert (~a_k).any() and (a_k.any() or k == e), "the case has chosen and (unless K = E) added pairs"
    torch.testing.assert_close(s_k, s_r, rtol=1e-6, atol=1e-7)
    assert torch.equal(s_k[~a_k], s_r[~a_r]), "chosen pairs carry their top-k score unchanged"
    torch.testing.assert_close(dts_k, dts_r, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dsrc_k, dsrc_r, rtol=1e-5, atol=1e-7)
    after = (router.logits, router.probs, router.topk_scores, pt, pe)
    assert all(torch.equal(a.detach(), b) for a, b in zip(after, before)), "inputs untouched"
    # the same inputs give the same bits
    s2, _, dts2, dsrc2 = grads(pair_scores, router, pt, pe, order, renorm, cot)
    assert torch.equal(s2, s_k) and torch.equal(dts2, dts_k) and torch.equal(dsrc2, dsrc_k)


@pytest.mark.parametrize("order,renorm", ORDERS[:2])
def test_backward_zeroes_every_block_of_experts(device, order, renorm, monkeypatch):
    """The backward writes each token's row of d src as zeros in blocks of BLOCK_E experts before the pairs' entries;
    with BLOCK_E lowered to 8, E = 33 takes five blocks (at most one at the CPU tests' other sizes, and one up to
    E = 128 on a GPU). The twin's gradients, with the outputs poisoned."""
    from sonicmoe.ops import tr_scores

    meta = tr_scores._bwd_meta
    monkeypatch.setattr(tr_scores, "_bwd_meta", lambda e_p2: {**meta(e_p2), "BLOCK_E": 8})
    router, pt, pe = make_case(60, 33, 3, 4, order, renorm, device)
    cot = torch.randn(pt.shape[0], generator=torch.Generator().manual_seed(9)).to(device)
    _, _, dts_k, dsrc_k = grads(pair_scores, router, pt, pe, order, renorm, cot)
    _, _, dts_r, dsrc_r = grads(pair_scores_ref, router, pt, pe, order, renorm, cot)
    torch.testing.assert_close(dsrc_k, dsrc_r, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dts_k, dts_r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("order,renorm", ORDERS)
def test_padding_pairs_score_zero_not_added_and_get_no_gradient(device, order, renorm):
    """Padding pairs (token T, expert E), what token_rounding(static=True) appends after the real pairs: score 0, not
    added, and no part in any gradient; the real pairs' scores, flags and gradients are bitwise those of the same
    call without the padding, and the kernel's equal the twin's."""
    t, e = 30, 6
    router, pt, pe = make_case(t, e, 2, 5, order, renorm, device)
    r, pad = pt.shape[0], 5
    pt_pad = torch.cat([pt, torch.full((pad,), t, dtype=pt.dtype, device=device)])
    pe_pad = torch.cat([pe, torch.full((pad,), e, dtype=pe.dtype, device=device)])
    cot = torch.randn(r + pad, generator=torch.Generator().manual_seed(6)).to(device)
    got = {}
    for fn in (pair_scores, pair_scores_ref):
        s, a, d_ts, d_src = grads(fn, router, pt_pad, pe_pad, order, renorm, cot)
        s0, a0, d_ts0, d_src0 = grads(fn, router, pt, pe, order, renorm, cot[:r])
        assert s.shape == a.shape == (r + pad,) and a.dtype == torch.bool
        assert not a[r:].any() and (s[r:] == 0).all()
        assert torch.equal(a[:r], a0) and a0.any() and torch.equal(s[:r], s0)
        if fn is pair_scores or device.type == "cpu":
            assert torch.equal(d_ts, d_ts0) and torch.equal(d_src, d_src0)
        else:  # the twin's indexing backward adds a token's pairs with atomics on CUDA: not bitwise reproducible
            torch.testing.assert_close(d_ts, d_ts0, rtol=1e-6, atol=1e-8)
            torch.testing.assert_close(d_src, d_src0, rtol=1e-6, atol=1e-8)
        got[fn] = s, a, d_ts, d_src
    (s_k, a_k, dts_k, dsrc_k), (s_r, a_r, dts_r, dsrc_r) = got.values()
    assert torch.equal(a_k, a_r)
    torch.testing.assert_close(s_k, s_r, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dts_k, dts_r, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dsrc_k, dsrc_r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("order,renorm", ORDERS[:3])
def test_backward_takes_a_strided_gradient(device, order, renorm):
    """The gradient of the scores may come strided (a view of a larger tensor, or a sum's expanded ones, of stride
    0): the backward gives the bits of the same gradient made contiguous."""
    router, pt, pe = make_case(40, 6, 2, 8, order, renorm, device)
    big = torch.randn(2 * pt.shape[0], generator=torch.Generator().manual_seed(10)).to(device)
    for cot in (big[::2], torch.ones(1, device=device).expand(pt.shape[0])):
        assert not cot.is_contiguous()
        _, _, d_ts, d_src = grads(pair_scores, router, pt, pe, order, renorm, cot)
        _, _, d_ts_c, d_src_c = grads(pair_scores, router, pt, pe, order, renorm, cot.contiguous())
        assert torch.equal(d_ts, d_ts_c) and torch.equal(d_src, d_src_c) and d_src.abs().sum() > 0


def check_fused_router_grad(t, e, k, seed, order, renorm, device):
    """fused_router_grad against the twin's path back through topk_scores and the router's top-k backward: the same
    scores, the same gradient of the logits and of the router weight, no gradient edge to topk_scores at all, and
    the same bits on a second run."""
    router, pt, pe, leaf = make_case(t, e, k, seed, order, renorm, device, weight=True)
    cot = torch.randn(pt.shape[0], generator=torch.Generator().manual_seed(seed + 7)).to(device)
    got = {}
    for fused, fn in ((True, pair_scores), (False, pair_scores_ref)):
        scores, added = fn(router, pt, pe, order, renorm, fused_router_grad=fused)
        d_logits, d_w = torch.autograd.grad(scores, (router.logits, leaf), cot, retain_graph=True)
        got[fused] = (scores, added, d_logits, d_w)
    assert torch.equal(got[True][1], got[False][1])
    assert torch.equal(got[True][0][~got[True][1]], got[False][0][~got[False][1]]), "chosen scores unchanged"
    torch.testing.assert_close(got[True][2], got[False][2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[True][3], got[False][3], rtol=1e-5, atol=1e-5)
    assert got[True][2].abs().sum() > 0
    scores, _ = pair_scores(router, pt, pe, order, renorm, fused_router_grad=True)
    (d_ts,) = torch.autograd.grad(scores, router.topk_scores, cot, allow_unused=True, retain_graph=True)
    assert d_ts is None, "the router's top-k backward is not in the graph"
    seen = []
    hook = router.topk_scores.register_hook(seen.append)
    again = torch.autograd.grad(scores, router.logits, cot)[0]
    hook.remove()
    assert not seen, "no edge to topk_scores at all (an edge given no gradient still runs the router's backward)"
    assert torch.equal(again, got[True][2]), "the same bits on every run"


@pytest.mark.parametrize("order,renorm", ORDERS)
@pytest.mark.parametrize("t,e,k,seed", [(1, 4, 2, 0), (50, 5, 5, 2), (200, 33, 4, 3)])
def test_fused_router_grad_equals_the_gradient_through_topk_scores(device, order, renorm, t, e, k, seed):
    check_fused_router_grad(t, e, k, seed, order, renorm, device)


def test_float16_scores_and_no_pairs(device):
    """float16 top-k scores beside float32 logits: the scores come out in float16, the logits' gradient in float32 at
    float32's accuracy (not rounded through float16)."""
    router, pt, pe = make_case(40, 8, 3, 7, "topk_then_softmax", False, device, dtype=torch.float16)
    s_k, a_k = pair_scores(router, pt, pe, "topk_then_softmax", False)
    s_r, a_r = pair_scores_ref(router, pt, pe, "topk_then_softmax", False)
    assert s_k.dtype == torch.float16 and torch.equal(a_k, a_r)
    torch.testing.assert_close(s_k, s_r, rtol=1e-3, atol=1e-4)
    cot = torch.randn(pt.shape[0], generator=torch.Generator().manual_seed(11)).to(device)
    _, _, dts_k, dsrc_k = grads(pair_scores, router, pt, pe, "topk_then_softmax", False, cot)
    _, _, dts_r, dsrc_r = grads(pair_scores_ref, router, pt, pe, "topk_then_softmax", False, cot)
    assert dsrc_k.dtype == torch.float32 and dts_k.dtype == torch.float16
    torch.testing.assert_close(dsrc_k, dsrc_r, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dts_k, dts_r, rtol=0, atol=0)
    none = pt[:0]
    s0, a0 = pair_scores(router, none, none, "topk_then_softmax", False)
    assert s0.shape == (0,) and a0.shape == (0,)
    (d,) = torch.autograd.grad(s0.sum(), router.logits, allow_unused=True)
    assert d is None or not d.any()


def test_bad_arguments(device):
    router, pt, pe = make_case(10, 4, 2, 0, "topk_then_softmax", False, device)
    with pytest.raises(ValueError, match="pair_token and pair_expert"):
        pair_scores(router, pt, pe[:-1], "topk_then_softmax", False)
    with pytest.raises(TypeError, match="pair_expert"):
        pair_scores_ref(router, pt, pe.float(), "topk_then_softmax", False)
    for fn in (pair_scores, pair_scores_ref):
        with pytest.raises(TypeError, match="pair_token must be an integer tensor, got torch.bool"):
            fn(router, pt > 3, pe, "topk_then_softmax", False)  # a mask where the indices were meant
        with pytest.raises(TypeError, match="pair_expert must be an integer tensor, got torch.complex64"):
            fn(router, pt, pe.to(torch.complex64), "topk_then_softmax", False)
        with pytest.raises(ValueError, match=r"both be \(R,\), got \(2, 3\) and \(2, 3\)"):
            fn(router, pt[:6].reshape(2, 3), pe[:6].reshape(2, 3), "topk_then_softmax", False)


def test_float64_router_takes_the_twin():
    router, _, _ = make_case(10, 4, 2, 0, "topk_then_softmax", False, "cpu")
    assert use_score_kernels(router, True) == interpreting()
    assert router._probs is None, "the check computes no (T, E) softmax the layer does not need"
    router.logits = router.logits.double()
    assert not use_score_kernels(router, True)
    # float64 top-k scores with float32 logits, or float64 probabilities (a router assembled by hand)
    router, _, _ = make_case(10, 4, 2, 0, "softmax_then_topk", False, "cpu")
    router.topk_scores = router.topk_scores.double()
    assert not use_score_kernels(router, True)
    router, _, _ = make_case(10, 4, 2, 0, "softmax_then_topk", False, "cpu")
    router._probs = router.probs.double()
    assert router.logits.dtype == router.topk_scores.dtype == torch.float32 and not use_score_kernels(router, True)


def test_saved_tensors_are_the_inputs_and_the_slots(device):
    """The memory contract of the autograd Function: it keeps the router's logits, topk_ids and the pair
    arrays by reference, and allocates only the (R,) int32 slots."""
    router, pt, pe = make_case(30, 6, 2, 4, "topk_then_softmax", False, device)
    pt, pe = pt.to(torch.int32), pe.to(torch.int32)
    scores, _ = pair_scores(router, pt, pe, "topk_then_softmax", False)
    saved = scores.grad_fn.saved_tensors
    assert len(saved) == 5
    for got, want in zip(saved[:4], (router.logits, router.topk_ids, pt, pe)):
        assert got.data_ptr() == want.data_ptr() and got.shape == want.shape
    assert saved[4].shape == pt.shape and saved[4].dtype == torch.int32


def test_saved_tensors_with_fused_router_grad(device):
    """With fused_router_grad the Function also keeps topk_scores, by reference (the router holds it anyway)."""
    router, pt, pe = make_case(30, 6, 2, 4, "topk_then_softmax", False, device)
    scores, _ = pair_scores(router, pt.to(torch.int32), pe.to(torch.int32), "topk_then_softmax", False,
                            fused_router_grad=True)
    saved = scores.grad_fn.saved_tensors
    assert len(saved) == 6 and saved[5].data_ptr() == router.topk_scores.data_ptr()


@pytest.mark.parametrize("order,renorm", ORDERS)
def test_token_rounding_gradients_kernel_path_equal_torch_path(order, renorm):
    """Through token_rounding: the router weight's gradient is the same on the kernel and the torch path."""
    from sonicmoe.token_rounding import token_rounding

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(90, 8, generator=g), torch.randn(7, 8, generator=g)
    cot = torch.randn(400, generator=g)
    out_grads = []
    for use in (True, False):
        wr = w.clone().requires_grad_(True)
        router = router_topk(x, wr, 2, router_order=order, renormalize=renorm)
        out = token_rounding(router, m_tile=16, subroutine="up", router_order=order, renormalize=renorm,
                             use_kernel=use, warn=False)
        assert out.pair_added.any()
        (out.pair_scores * cot[: out.num_pairs]).sum().backward()
        out_grads.append(wr.grad)
    torch.testing.assert_close(out_grads[0], out_grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("order,renorm", ORDERS)
def test_gpu_benchmark_size(order, renorm):
    """T = 16384, E = 512, K = 8 on the GPU: values and gradients against the twin, bits reproducible."""
    router, pt, pe = make_case(16384, 512, 8, 0, order, renorm, "cuda", empty_tokens=True)
    cot = torch.randn(pt.shape[0], device="cuda")
    s_k, a_k, dts_k, dsrc_k = grads(pair_scores, router, pt, pe, order, renorm, cot)
    s_r, a_r, dts_r, dsrc_r = grads(pair_scores_ref, router, pt, pe, order, renorm, cot)
    assert torch.equal(a_k, a_r)
    torch.testing.assert_close(s_k, s_r, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dts_k, dts_r, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dsrc_k, dsrc_r, rtol=1e-5, atol=1e-7)
    s2, _, dts2, dsrc2 = grads(pair_scores, router, pt, pe, order, renorm, cot)
    assert torch.equal(s2, s_k) and torch.equal(dts2, dts_k) and torch.equal(dsrc2, dsrc_k)


@pytest.mark.gpu
@pytest.mark.parametrize("order,renorm", ORDERS)
def test_gpu_fused_router_grad_benchmark_size(order, renorm):
    """fused_router_grad at T = 16384, E = 512, K = 8 on the GPU (what the MoE layer runs)."""
    check_fused_router_grad(16384, 512, 8, 0, order, renorm, "cuda")


def _added_scores_at_shared_direction(fn, device, seed, T, E, K, scale):
    """topk_then_softmax pair scores of every (token, expert) pair of T tokens whose logits share one direction, so
    that they sit near ``scale``·10 and differ by O(1) between the E experts (K chosen). Returns the router, the pairs,
    the scores, the float64 logits and chosen logits, the float64 truth exp(v − logsumexp of the chosen logits) and
    the added pairs whose truth is above 1e-6 (the scores that matter; the smallest underflow alike in float32), at
    least 8 of them."""
    g = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(16, generator=g), dim=0)  # the direction every row shares
    x = torch.randn(T, 16, generator=g) + 10 * u
    w = (scale * u + torch.randn(E, 16, generator=g) * 0.3).to(device).requires_grad_(True)
    router = router_topk(x.to(device), w, K)
    pt = torch.arange(T, device=device).repeat_interleave(E)
    pe = torch.arange(E, device=device).repeat(T)
    scores, added = fn(router, pt, pe, "topk_then_softmax", False)
    l64 = router.logits.detach().double()
    c64 = l64.gather(1, router.topk_ids.long())
    truth = (l64 - torch.logsumexp(c64, dim=1, keepdim=True))[pt, pe].exp()
    keep = added & (truth > 1e-6)
    assert int(keep.sum()) >= 8
    return router, pt, pe, scores, l64, c64, truth, keep


@pytest.mark.parametrize("fn", [pair_scores, pair_scores_ref], ids=["kernel", "twin"])
def test_added_softmax_scores_stay_accurate_at_large_logits(device, fn):
    """topk_then_softmax's added pairs, S = exp(v − logsumexp of the chosen logits), with logits of ~200: within
    2e-6 (relative) of the float64 value, as the reference's exp(v − mx) / Σ exp(c − mx), and their gradients within
    1e-5. Before session 79 the kernel and the twin subtracted a float32 logsumexp of magnitude ~200, whose rounding
    (ε·200) put 3.4e-6 into a score of 0.16 (found by test_hypothesis_fast_equals_ref, scale 30), 7.6e-6 here."""
    router, pt, pe, scores, l64, c64, truth, keep = _added_scores_at_shared_direction(fn, device, 7, 64, 6, 2, 20.0)
    assert float(router.logits.detach().abs().min()) > 100
    assert float(((scores.detach().double() - truth).abs() / truth)[keep].max()) < 2e-6  # seen: 5.9e-7, 7.6e-6 before
    (d_logits,) = torch.autograd.grad((scores * keep).sum(), router.logits)
    truth_grad = torch.zeros_like(l64)  # d/dv of Σ_kept S = Σ S on v; on the chosen logits −Σ S · softmax(chosen)
    soft = (c64 - torch.logsumexp(c64, dim=1, keepdim=True)).exp()
    kept_sum = torch.zeros(64, dtype=torch.float64, device=l64.device).index_add(0, pt[keep], truth[keep])
    truth_grad.index_put_((pt[keep], pe[keep]), truth[keep], accumulate=True)
    truth_grad.scatter_add_(1, router.topk_ids.long(), -kept_sum[:, None] * soft)
    err = (d_logits.double() - truth_grad).norm() / truth_grad.norm()
    assert float(err) < 1e-5, float(err)


@pytest.mark.parametrize("fused", [False, True])
def test_tiny_sigmoid_renormalisation_adds_its_epsilon(device, fused):
    """sigmoid_then_topk with renormalize divides by Σ chosen sigmoids + 1e-20 (as the router's own scores): with
    logits near −42 the sigmoids are ~6e-19, so the 1e-20 moves every score by 0.3% to 3%. Scores and the logits'
    gradient against float64 with that formula (the chosen pairs' by the router's formula)."""
    t, e, k = 24, 6, 2
    g = torch.Generator().manual_seed(13)
    x = torch.randn(t, 8, generator=g)
    w = (torch.randn(e, 8, generator=g) * 0.1).to(device).requires_grad_(True)
    bias = torch.full((e,), -42.0, device=device)
    router = router_topk(x.to(device), w, k, router_order="sigmoid_then_topk", renormalize=True, router_bias=bias)
    assert float(router.logits.detach().max()) < -40
    take = torch.rand(t, e, generator=g) < 0.5
    take[0] = True
    pairs = take.nonzero().to(device)
    pt, pe = pairs[:, 0], pairs[:, 1]
    cot = torch.randn(pt.shape[0], generator=g).to(device)
    scores, added = pair_scores(router, pt, pe, "sigmoid_then_topk", True, fused_router_grad=fused)
    (d_logits,) = torch.autograd.grad(scores, router.logits, cot)

    l64 = router.logits.detach().double().requires_grad_(True)
    sig = torch.sigmoid(l64)
    ids = router.topk_ids.long()
    z = sig.gather(1, ids).sum(dim=1) + 1e-20
    assert float((1e-20 / z.detach()).min()) > 2e-3  # the epsilon matters at these logits
    truth = sig[pt, pe] / z[pt]  # a chosen pair's score by the router's formula is the same expression
    (truth_grad,) = torch.autograd.grad(truth, l64, cot.double())
    assert added.any() and (~added).any()
    assert float(((scores.detach().double() - truth.detach()).abs() / truth.detach()).max()) < 1e-5
    err = (d_logits.double() - truth_grad).norm() / truth_grad.norm()
    assert float(err) < 1e-5, float(err)


@pytest.mark.parametrize("order,renorm", ORDERS)
def test_column_major_logits_and_probs_read_by_rows(device, order, renorm):
    """A router whose logits (and probabilities) are column-major views, as a transposed product leaves them: the
    kernels read rows of ``stride(0)`` contiguous entries, so pair_scores makes the source contiguous first: the
    same scores and gradients, bit for bit, as the row-major router's."""
    from sonicmoe.ops.tr_scores import added_pair_source
    from sonicmoe.routing import RouterOutput

    base, pt, pe = make_case(30, 6, 2, 12, order, renorm, device)
    cot = torch.randn(pt.shape[0], generator=torch.Generator().manual_seed(12)).to(device)

    def leaves(column_major):  # the same values as leaves, row- or column-major
        logits, probs = base.logits.detach().clone(), base.probs.detach().clone()
        if column_major:
            logits, probs = logits.t().contiguous().t(), probs.t().contiguous().t()
        return RouterOutput(logits.requires_grad_(True), probs.requires_grad_(True), base.topk_ids,
                            base.topk_scores.detach().clone().requires_grad_(True),
                            sigmoid=order == "sigmoid_then_topk")

    want = grads(pair_scores, leaves(False), pt, pe, order, renorm, cot)
    router = leaves(True)
    assert added_pair_source(router, order).stride() == (1, 30)
    got = grads(pair_scores, router, pt, pe, order, renorm, cot)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert got[3].abs().sum() > 0


@pytest.mark.parametrize("order,renorm", ORDERS[:3])
def test_row_padded_logits_and_probs_read_by_their_row_stride(device, order, renorm):
    """Logits (and probabilities) that are the first E columns of wider rows (stride(0) = E + 3, stride(1) = 1, as a
    slice of a padded buffer leaves them) are read in place, by their row stride, while the dense gradient is a new
    (T, E) tensor of row stride E: the kernels keep the two strides apart. The same scores and gradients, bit for bit,
    as the contiguous router's. (Under sigmoid_then_topk the kernels read torch.sigmoid's contiguous output, and
    torch's own sigmoid may round a strided input differently.)"""
    from sonicmoe.ops.tr_scores import added_pair_source
    from sonicmoe.routing import RouterOutput

    base, pt, pe = make_case(30, 6, 3, 14, order, renorm, device)
    cot = torch.randn(pt.shape[0], generator=torch.Generator().manual_seed(14)).to(device)

    def leaves(padded):
        def leaf(v):
            v = v.detach().clone()
            if padded:
                wide = torch.full((v.shape[0], v.shape[1] + 3), float("nan"), device=device)
                wide[:, : v.shape[1]] = v
                v = wide[:, : v.shape[1]]
            return v.requires_grad_(True)

        return RouterOutput(leaf(base.logits), leaf(base.probs), base.topk_ids, leaf(base.topk_scores),
                            sigmoid=order == "sigmoid_then_topk")

    want = grads(pair_scores, leaves(False), pt, pe, order, renorm, cot)
    router = leaves(True)
    assert router.logits.stride() == router.probs.stride() == (9, 1)
    got = grads(pair_scores, router, pt, pe, order, renorm, cot)
    assert got[3].stride() == (6, 1)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert got[3].abs().sum() > 0 and added_pair_source(router, order).shape == (30, 6)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the masked slot's, dropped
@pytest.mark.parametrize("fn", [pair_scores, pair_scores_ref], ids=["kernel", "twin"])
def test_added_softmax_scores_at_large_negative_logits_and_odd_k(device, fn):
    """topk_then_softmax with K = 3 (a power-of-two tile of 4 slots, one of them masked) and logits of about −200:
    the largest chosen logit, which stabilises the logsumexp, is taken over the K real slots only (a masked slot
    read as 0 would be the maximum, exp(c − 0) underflow to 0, and every added score be Inf). Added scores within
    2e-6 (relative) of the float64 value exp(v − logsumexp of the chosen logits)."""
    router, _, _, scores, _, _, truth, keep = _added_scores_at_shared_direction(fn, device, 17, 48, 7, 3, -20.0)
    assert float(router.logits.detach().max()) < -100
    assert torch.isfinite(scores).all()
    assert float(((scores.detach().double() - truth).abs() / truth)[keep].max()) < 2e-6


def test_cpu_tensors_without_the_interpreter_are_refused_by_name(monkeypatch):
    """Off the interpreter CPU tensors cannot run the kernels: the error names the tensor an added pair's score is
    read from, router.probs under softmax_then_topk, router.logits otherwise."""
    from sonicmoe.ops import common

    monkeypatch.setattr(common, "interpreting", lambda: False)
    for order, name in (("softmax_then_topk", "router.probs"), ("topk_then_softmax", "router.logits"),
                        ("sigmoid_then_topk", "router.logits")):
        router, pt, pe = make_case(10, 4, 2, 0, order, False, "cpu")
        with pytest.raises(ValueError, match=rf"^{name} is on cpu; the triton backend needs CUDA"):
            pair_scores(router, pt, pe, order, False)
