"""Triton kernels against their pure-PyTorch twins and the float32 layer reference.

On CPU the kernels run through Triton's interpreter (float32/float16 only: the interpreter's bf16
tl.dot is wrong, triton-lang/triton#11584); on a GPU the same tests run natively. Every kernel
output is poisoned with NaN before launch (SONICMOE_POISON_OUTPUTS=1), so an unwritten element fails.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest
import torch
import triton

import sonicmoe
from sonicmoe.ops.aggregation import gather_sum, gather_sum_ref
from sonicmoe.ops.common import cdiv, interpreting, next_pow2
from sonicmoe.ops.dh import dh, dh_ref
from sonicmoe.ops.grouped_gemm import down_proj, down_proj_ref, varlen_m_gemm, varlen_m_gemm_ref
from sonicmoe.ops.score_grad import score_grad, score_grad_ref
from sonicmoe.ops.up_proj import up_proj, up_proj_ref
from sonicmoe.ops.weight_grad import varlen_k_gemm, varlen_k_gemm_ref
from sonicmoe.reference import swiglu_ref
from sonicmoe.routing import router_topk, routing_from_pairs, routing_from_topk
from sonicmoe.testing import random_problem, reference_grads, rel_err

pytestmark = pytest.mark.interpreter

# (T, d, n, E, K, reason)
SHAPES = [
    (1, 16, 16, 3, 3, "T=1 and K=E: one token, every expert"),
    (37, 40, 40, 5, 2, "d, n and per-expert counts not multiples of any block"),  # d = 40: a partial K-block of d
    (20, 32, 24, 8, 1, "K=1, more experts than a few tokens fill: empty experts"),  # empty: see _topk_routing
    (64, 32, 32, 4, 4, "K=E with many tokens: every expert gets every token"),
]
IDS = [s[-1].split(":")[0] for s in SHAPES]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 3e-3


def _topk_routing(p, k, device, empty=()):
    """Top-k routing of ``p``'s tokens. Experts in ``empty`` are never chosen, so they get no rows: the sigmoid router
    with a selection bias of -2 on them (sigmoid + bias < -1 < every other expert's), asserted."""
    e = p["w1"].shape[0]
    if not empty:
        r = router_topk(p["x"], p["router_weight"], k)
    else:
        bias = torch.zeros(e, device=device)
        bias[list(empty)] = -2.0
        r = router_topk(p["x"], p["router_weight"], k, router_order="sigmoid_then_topk", expert_bias=bias)
    routing = routing_from_topk(r.topk_ids, e)
    assert all(routing.expert_counts()[i] == 0 for i in empty)
    return r, routing


def _empty_experts(shape):
    """The experts the SHAPES entry ``shape`` promises empty (the first and the last, with K=1): none for the others."""
    e, k = shape[3], shape[4]
    return (0, e - 1) if k == 1 else ()


def _skewed_routing(t, e, device):
    """General routing: variable experts per token, token 0 with none, experts 0 and E-1 empty,
    and expert 1 holding every other token."""
    pairs = [(tok, 1) for tok in range(1, t)]
    pairs += [(tok, 2 + tok % (e - 3)) for tok in range(1, t, 2)]
    tok = torch.tensor([p[0] for p in pairs], device=device)
    exp = torch.tensor([p[1] for p in pairs], device=device)
    perm = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(0)).to(device)
    return routing_from_pairs(tok[perm], exp[perm], t, e)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("bias", [False, True])
def test_up_proj(shape, layout, bias, device):
    t, d, n, e, k, _ = shape
    p = random_problem(t, d, n, e, bias=bias, device=device, seed=t + n)
    _, routing = _topk_routing(p, k, device, _empty_experts(shape))
    h, a = up_proj(p["x"], p["w1"], p["b1"], routing, layout)
    h_ref, a_ref = up_proj_ref(p["x"], p["w1"], p["b1"], routing, layout)
    assert rel_err(h, h_ref) < 1e-5
    assert rel_err(a, a_ref) < 1e-5
    h_none, a2 = up_proj(p["x"], p["w1"], p["b1"], routing, layout, store_h=False)
    assert h_none is None and torch.equal(a2, a)


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_up_proj_a_from_stored_h(layout, device):
    """A is SwiGLU of the stored, rounded H, not of the float32 accumulator: the backward recomputes A from H and
    must get the forward's A. In a 16-bit dtype (float16 here, bf16 on a GPU) A from the accumulator differs in
    about a fifth of the elements (measured when planting that bug, scripts/mutation_probe.py); from H, in none on
    the CPU (a GPU's fast sigmoid may flip a rare last bit)."""
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16
    p = random_problem(37, 48, 40, 5, bias=True, device=device, dtype=dtype, seed=11)
    _, routing = _topk_routing(p, 2, device)
    h, a = up_proj(p["x"], p["w1"], p["b1"], routing, layout)
    a_from_h = swiglu_ref(h.float(), layout).to(dtype)
    assert (a != a_from_h).float().mean().item() < 0.01


@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu"])
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_up_proj_ref_rounds_h_before_a(layout, activation):
    """The twin, the kernels' oracle, computes H per row in float32 (against a float64 product here) and A from H as
    stored, rounded to float16 (the kernel's and the backward's A), not from the float32 H, which differs in many
    elements; with store_h=False it returns no H and the same A."""
    dtype = torch.float16
    p = random_problem(41, 48, 24, 4, bias=True, dtype=dtype, seed=95)
    _, routing = _topk_routing(p, 2, "cpu")
    h, a = up_proj_ref(p["x"], p["w1"], p["b1"], routing, layout, activation=activation)
    assert h.dtype == a.dtype == dtype and h.shape == (routing.num_rows, 48) and a.shape == (routing.num_rows, 24)
    expert = torch.repeat_interleave(torch.arange(4), routing.expert_counts().cpu())
    x64, w64, b64 = p["x"].double(), p["w1"].double(), p["b1"].double()
    h64 = torch.einsum("rd,rcd->rc", x64[routing.row_token.long()], w64[expert]) + b64[expert]
    torch.testing.assert_close(h.double(), h64, rtol=1e-3, atol=1e-3)
    assert torch.equal(a, swiglu_ref(h.float(), layout, activation).to(dtype))
    assert (swiglu_ref(h64.float(), layout, activation).to(dtype) != a).any()  # A of the unrounded H: not the same
    none, a2 = up_proj_ref(p["x"], p["w1"], p["b1"], routing, layout, store_h=False, activation=activation)
    assert none is None and torch.equal(a2, a)


def _guarded(t: torch.Tensor, pad: int = 64) -> torch.Tensor:
    """``t``'s values in a contiguous view with NaN in the ``pad`` elements of storage on either side (64: 16-byte
    aligned in every float dtype), so that a kernel reading past either end of its operand reads NaN."""
    buf = torch.full((t.numel() + 2 * pad,), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[pad:pad + t.numel()].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_kernels_read_nothing_past_their_operands(layout, device):
    """Every float operand of the expert kernels (the inputs, and A and Y between the kernels) in a NaN guard band
    (:func:`_guarded`): the outputs are finite and
    the bits of the unguarded calls. A masked-off element read past an operand's end is multiplied by a zero and
    shows nowhere else; with NaN there it shows, so an over-read past d or n (an off-by-one in a K mask, say) fails
    here. d = 40 and n = 24 are not multiples of the interpreter's 16-wide blocks, so the masked paths run."""
    t, d, n, e, k = 29, 40, 24, 5, 2
    p = random_problem(t, d, n, e, bias=True, device=device, seed=17)
    router, routing = _topk_routing(p, k, device)
    r = routing.num_rows
    dout, dh_, h = (torch.randn(*s, device=device) for s in ((t, d), (r, 2 * n), (r, 2 * n)))
    s = routing.row_scores(router.topk_scores.reshape(-1)).detach()

    def calls(wrap, x, w1, b1, w2, b2, dout, dh_, h, s):
        _, a = up_proj(x, w1, b1, routing, layout)
        a = wrap(a)
        y = wrap(down_proj(a, w2, b2, routing))
        return (a, y, gather_sum(y, routing, s[routing.token_rows.long()]),
                varlen_m_gemm(dh_, w1, None, routing, transpose_b=False), *dh(dout, w2, h, s, routing, layout),
                varlen_k_gemm(dout, a, routing, p_gather=True, q_gather=False, out_dtype=a.dtype),
                varlen_k_gemm(dh_, x, routing, p_gather=False, q_gather=True, out_dtype=x.dtype))

    args = (p["x"], p["w1"], p["b1"], p["w2"], p["b2"], dout, dh_, h, s)
    plain = calls(lambda v: v, *args)
    guarded = calls(_guarded, *(_guarded(v) for v in args))
    for i, (g, want) in enumerate(zip(guarded, plain)):
        assert torch.isfinite(g).all() and torch.equal(g, want), i


def test_kernels_write_nothing_past_their_outputs(device):
    """The kernels that take ``out=`` (the varlen-M GEMM, the aggregation) write only inside it: ``out`` a view in the
    middle of a wider buffer of sentinel values, with guard rows and columns on every side; the guards keep their
    values and the view gets the bits of a fresh call. A store without its row or column mask writes past the
    output's last row or column: into the guard here (past the end of a bare tensor it corrupts the heap instead, a
    crash or a hang). T = 29 and d = 40 are not multiples of the interpreter's tiles (8 tokens; 16 or 32 columns),
    whose overhang the 32-element guards hold."""
    t, d, n, e, k, pad = 29, 40, 24, 5, 2, 32
    p = random_problem(t, d, n, e, bias=True, device=device, seed=23)
    _, routing = _topk_routing(p, k, device)
    r = routing.num_rows
    a = torch.randn(r, n, device=device)
    w = torch.rand(r, device=device)

    def guarded_out(rows):
        buf = torch.full((rows + 2 * pad, d + 2 * pad), 7.0, device=device)
        return buf, buf[pad:pad + rows, pad:pad + d]

    # the guarded calls first: a stray store then lands in a guard and fails here, before a bare output's could
    # corrupt the heap
    buf, y = guarded_out(r)
    assert varlen_m_gemm(a, p["w2"], p["b2"], routing, transpose_b=True, out=y) is y
    buf2, o = guarded_out(t)
    assert gather_sum(y, routing, w, out=o) is o
    for b in (buf, buf2):
        kept = b.clone()
        kept[pad:-pad, pad:-pad] = 7.0
        assert (kept == 7.0).all(), "a kernel wrote outside its output"
    assert torch.equal(y, varlen_m_gemm(a, p["w2"], p["b2"], routing, transpose_b=True))
    assert torch.equal(o, gather_sum(y, routing, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=IDS[1:3])
def test_grouped_gemms(shape, dtype, device):
    """The grouped GEMMs against their twins. With K=1 the first and last experts are empty and get zero weight
    gradients.

    In float16 both the kernels and the twins accumulate in float32 and round once, so their bits differ only where the
    two float32 sums (in different orders) fall on either side of a float16 rounding boundary: measured on the
    interpreter over 9 input seeds, at most 4 of 2960 elements (0.14%), by one unit in the last place. A norm bound
    cannot tell that from a second rounding (one such flip in a large element alone costs up to 4e-5 of rel_err),
    the share of differing elements can: the bias added after the cast to float16 changes 27-30% of them."""
    t, d, n, e, k, _ = shape
    p = random_problem(t, d, n, e, bias=True, device=device, dtype=dtype, seed=3)
    _, routing = _topk_routing(p, k, device, _empty_experts(shape))

    def check(got, ref):
        assert rel_err(got, ref) < _tol(dtype)
        if dtype == torch.float16:
            assert (got != ref).float().mean().item() < 0.01, "float16 results rounded twice?"

    r = routing.num_rows
    g = torch.Generator().manual_seed(4)  # not the global generator, which earlier tests leave in varying states
    a = torch.randn(r, n, generator=g).to(device, dtype)
    check(down_proj(a, p["w2"], p["b2"], routing), down_proj_ref(a, p["w2"], p["b2"], routing))
    dh_ = torch.randn(r, 2 * n, generator=g).to(device, dtype)
    out = varlen_m_gemm(dh_, p["w1"], None, routing, transpose_b=False)
    check(out, varlen_m_gemm_ref(dh_, p["w1"], None, routing, transpose_b=False))
    dout = torch.randn(t, d, generator=g).to(device, dtype)
    empty = routing.expert_counts() == 0
    assert empty.any() == (k == 1)
    for pg, qg, pm, qm in ((True, False, dout, a), (False, True, dh_, p["x"])):
        got = varlen_k_gemm(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=dtype)
        check(got, varlen_k_gemm_ref(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=dtype))
        assert torch.all(got[empty] == 0), "experts with no rows must get zero gradients"


_STEPS3 = {"STEPS": True, "PROGS_PER_SM": 3}


@pytest.mark.parametrize("cfg", [{"BLOCK_I": 16, "BLOCK_J": 32, "BLOCK_R": 16, "P_TMA": True, "Q_TMA": True},
                                 {"BLOCK_I": 32, "BLOCK_J": 16, "BLOCK_R": 32, "P_TMA": True, "Q_TMA": True},
                                 {"BLOCK_I": 16, "BLOCK_J": 16, "BLOCK_R": 16},
                                 {"BLOCK_I": 16, "BLOCK_J": 32, "BLOCK_R": 16, "P_TMA": True, "Q_TMA": True, **_STEPS3},
                                 {"BLOCK_I": 32, "BLOCK_J": 16, "BLOCK_R": 32, "P_TMA": True, "Q_TMA": True, **_STEPS3},
                                 {"BLOCK_I": 16, "BLOCK_J": 16, "BLOCK_R": 16, **_STEPS3},
                                 {"BLOCK_I": 16, "BLOCK_J": 16, "BLOCK_R": 16, "STEPS": True, "PROGS_PER_SM": 0}],
                         ids=["tma-16", "tma-32", "pointer", "steps-tma-16", "steps-tma-32", "steps-pointer",
                              "steps-per-tile"])
def test_varlen_k_chunks_and_tails(cfg, device, monkeypatch):
    """Varlen-K over whole chunks (TMA for the contiguous operand) then the masked tail: equals the
    reference with ragged counts (multiples of BLOCK_R, not, and empty experts) and I, J not block multiples,
    and a non-finite row of one expert never reaches another expert's gradient. The persistent step loop
    (STEPS; 3 programs over the tiles, so each runs tiles of several experts, including the empty one and the
    one with no whole chunk) gives bitwise the per-tile grid's results. The counts are not in descending order,
    so the tiles' load order (SONICMOE_WGRAD_ORDER=load, busiest expert first) differs from expert order (the
    default): the same bits either way."""
    t, d, n, e = 90, 40, 24, 5
    g = torch.Generator().manual_seed(11)
    counts = [32, 0, 45, 16, 3]  # whole chunks; empty; chunks and a tail; exactly one chunk; a tail only
    tok = torch.cat([torch.randperm(t, generator=g)[:c] for c in counts])
    exp = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    routing = routing_from_pairs(tok.to(device), exp.to(device), t, e)
    r = routing.num_rows
    x = torch.randn(t, d, generator=g).to(device)
    dh_ = torch.randn(r, 2 * n, generator=g).to(device)
    dout = torch.randn(t, d, generator=g).to(device)
    ap = torch.randn(r, n, generator=g).to(device)
    for pg, qg, pm, qm in ((True, False, dout, ap), (False, True, dh_, x)):
        got = varlen_k_gemm(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=torch.float32, config=cfg)
        ref = varlen_k_gemm_ref(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=torch.float32)
        assert not torch.isnan(got).any() and rel_err(got, ref) < 1e-5
        assert torch.all(got[1] == 0)
        if cfg.get("STEPS"):
            per_tile = {k: v for k, v in cfg.items() if k not in _STEPS3}
            assert torch.equal(got, varlen_k_gemm(pm, qm, routing, p_gather=pg, q_gather=qg,
                                                  out_dtype=torch.float32, config=per_tile))
        with monkeypatch.context() as m:
            m.setenv("SONICMOE_WGRAD_ORDER", "load")
            assert torch.equal(got, varlen_k_gemm(pm, qm, routing, p_gather=pg, q_gather=qg,
                                                  out_dtype=torch.float32, config=cfg))
    # an Inf in expert 3's first dH row: only expert 3's dW1 may see it
    off = routing.expert_offsets.tolist()
    bad = dh_.clone()
    bad[off[3]] = float("inf")
    got = varlen_k_gemm(bad, x, routing, p_gather=False, q_gather=True, out_dtype=torch.float32, config=cfg)
    others = [i for i in range(e) if i != 3]
    assert torch.isfinite(got[others]).all()


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_dh_kernel(shape, layout, device):
    t, d, n, e, k, _ = shape
    p = random_problem(t, d, n, e, device=device, seed=5)
    router, routing = _topk_routing(p, k, device, _empty_experts(shape))
    assert (routing.expert_counts() == 0).any() == (k == 1)  # K=1: the first and last experts empty
    h = torch.randn(routing.num_rows, 2 * n, device=device)
    dout = torch.randn(t, d, device=device)
    s = routing.row_scores(router.topk_scores.reshape(-1))
    got = dh(dout, p["w2"], h, s, routing, layout)
    ref = dh_ref(dout, p["w2"], h, s, routing, layout)
    for name, g, r in zip(("dH", "A'", "dS"), got, ref):
        assert rel_err(g, r) < 1e-5, name
    # reduce_ds=False hands back the partial sums (one row per 16-channel chunk; one row for the twin) whose
    # fixed-order sum the backward runs on its side stream: the same bits as the kernel's own dS
    parts = dh(dout, p["w2"], h, s, routing, layout, reduce_ds=False)[2]
    assert parts.shape == (triton.cdiv(n, 16), routing.num_rows)
    assert torch.equal(parts.sum(0), got[2])
    assert torch.equal(dh_ref(dout, p["w2"], h, s, routing, layout, reduce_ds=False)[2], ref[2][None])
    # scores in pair order, gathered through row_pair in the kernel (the layer's backward): the same bits, in
    # bf16 too (read as float32)
    pairs = router.topk_scores.reshape(-1)
    for scores, row_order in ((pairs, s), (pairs.bfloat16(), s.bfloat16().float())):
        base = dh(dout, p["w2"], h, row_order, routing, layout)
        gathered = dh(dout, p["w2"], h, scores, routing, layout, pair_order=True)
        assert all(torch.equal(x, y) for x, y in zip(gathered, base))
        twin = dh_ref(dout, p["w2"], h, scores, routing, layout, pair_order=True)
        assert all(torch.equal(x, y) for x, y in zip(twin, dh_ref(dout, p["w2"], h, row_order, routing, layout)))
    no_pairs = dataclasses.replace(routing, row_pair=None)
    with pytest.raises(ValueError, match="row_pair"):
        dh(dout, p["w2"], h, pairs, no_pairs, layout, pair_order=True)
    # ds_pairs: dS summed and in pair order in the scores' dtype (the layer's backward), the bits of score_grad on
    # the partials; dH and A′ unchanged; the twin within rounding
    parts = dh(dout, p["w2"], h, pairs, routing, layout, reduce_ds=False, pair_order=True)
    for dt in (torch.float32, torch.bfloat16):
        got_p = dh(dout, p["w2"], h, pairs, routing, layout, pair_order=True, ds_pairs=dt)
        want = score_grad(parts[2], routing.row_pair, routing.expert_offsets, None, dt)
        assert got_p[2].dtype == dt and torch.equal(got_p[2], want)
        assert torch.equal(got_p[0], parts[0]) and torch.equal(got_p[1], parts[1])
        twin = dh_ref(dout, p["w2"], h, pairs, routing, layout, pair_order=True, ds_pairs=dt)
        assert twin[2].dtype == dt and rel_err(got_p[2].float(), twin[2].float()) < (1e-5 if dt == torch.float32
                                                                                       else 1e-2)
        by_pair = torch.empty_like(ref[2])
        by_pair[routing.row_pair.long()] = ref[2]  # the row-order reference, scattered to pair order
        assert rel_err(twin[2].float(), by_pair) < (1e-6 if dt == torch.float32 else 1e-2)
    for fn in (dh, dh_ref):
        with pytest.raises(ValueError, match="ds_pairs"):
            fn(dout, p["w2"], h, s, routing, layout, ds_pairs=torch.float32)


def test_dh_kernel_and_twin_use_a_as_stored_in_half_precision(device):
    """float16 H: the kernel and dh_ref compute dS = ⟨dA′, A⟩ and A′ = S·A from A rounded to float16, as the forward
    stored it and as Y = A W2ᵀ read it: dS equals the float64 sum over the rounded A (the unrounded A differs by
    about 1e-4 relative here), the kernel and the twin agree to float32 summation."""
    t, d, n, e = 40, 32, 48, 3
    g = torch.Generator().manual_seed(57)
    routing = routing_from_topk(torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)]).to(device), e)
    h = (torch.randn(routing.num_rows, 2 * n, generator=g) * 2).half().to(device)
    dout = torch.randn(t, d, generator=g).half().to(device)
    w2 = (torch.randn(e, d, n, generator=g) * n ** -0.5).half().to(device)
    s = (torch.rand(routing.num_rows, generator=g) + 0.1).to(device)
    got, ref = dh(dout, w2, h, s, routing), dh_ref(dout, w2, h, s, routing)
    hf = h.double()
    a = swiglu_ref(hf, "concat")
    dap = torch.cat([dout[routing.row_token[lo:hi].long()].double() @ w2[i].double()
                     for i, (lo, hi) in enumerate(zip(routing.expert_offsets[:-1].tolist(),
                                                      routing.expert_offsets[1:].tolist()))])
    stored = (dap * a.half().double()).sum(1)
    assert rel_err((dap * a).sum(1), stored) > 3e-5  # the rounding is visible at this size
    for ds in (got[2], ref[2]):
        assert rel_err(ds.double(), stored) < 3e-6
    assert rel_err(got[2], ref[2]) < 3e-6 and torch.equal(got[1], ref[1])


def test_gather_sum(device):
    t, e = 29, 7
    routing = _skewed_routing(t, e, device)
    y = torch.randn(routing.num_rows, 40, device=device)
    w = torch.rand(routing.num_rows, device=device)
    for weights in (w, None):
        out = gather_sum(y, routing, weights)
        assert rel_err(out, gather_sum_ref(y, routing, weights)) < 1e-6
    assert torch.all(out[0] == 0), "a token with no experts aggregates to zero"
    # half-precision weights are read as float32 in the kernel: the same bits as weights cast beforehand
    w16 = w.half()
    assert torch.equal(gather_sum(y, routing, w16), gather_sum(y, routing, w16.float()))
    # float16 rows with float32 weights: the weights stay float32 (not rounded to the rows' dtype), each slot's
    # product and the slot-order sum in float32, rounded once: the twin's bits
    # (the kernel's float32-row results rounded once: valid on a GPU too, where the twin's index_add adds in any order)
    y16 = y.half()
    got16 = gather_sum(y16, routing, w)
    assert torch.equal(got16, gather_sum(y16.float(), routing, w).half())
    if interpreting():
        assert torch.equal(got16, gather_sum_ref(y16, routing, w))


def test_strided_weights_and_row_pairs(device):
    """A strided (R,) view of the slot weights (gather_sum) or of row_pair and expert_offsets (score_grad), rows Y
    stored column-major (gather_sum) and (P, R) partials stored row-major as (R, P) (score_grad) give the same bits as
    their contiguous copies (the kernels index them as contiguous or with a unit inner stride: the launchers copy)."""
    t, e = 29, 7
    routing = _skewed_routing(t, e, device)
    r = routing.num_rows
    y = torch.randn(r, 40, device=device)
    w = torch.rand(2 * r, device=device)[::2]
    assert torch.equal(gather_sum(y, routing, w), gather_sum(y, routing, w.contiguous()))
    y_cols = y.t().contiguous().t()  # (R, 40), inner stride R
    assert torch.equal(gather_sum(y_cols, routing, w), gather_sum(y, routing, w))
    # rows read through their own stride (a block of columns of a wider Y), O written through O's (a block of
    # columns of a wider O, poisoned, whose row stride differs from Y's)
    y_wide = torch.randn(r, 64, device=device)
    y_block = y_wide[:, 8:48]
    o_wide = torch.full((t, 96), float("nan"), device=device)
    assert y_block.stride(0) == 64 and not y_block.is_contiguous()
    gather_sum(y_block, routing, w, out=o_wide[:, 40:80])
    assert torch.equal(o_wide[:, 40:80], gather_sum(y_block.contiguous(), routing, w))
    assert o_wide[:, :40].isnan().all() and o_wide[:, 80:].isnan().all()
    assert torch.equal(gather_sum(y_block, routing, w), o_wide[:, 40:80])
    parts = torch.randn(3, r, device=device)
    row_pair = torch.stack([routing.row_pair, torch.zeros_like(routing.row_pair)], 1)[:, 0]
    offsets = torch.stack([routing.expert_offsets, routing.expert_offsets], 1)[:, 1]
    assert not row_pair.is_contiguous() and not offsets.is_contiguous()
    want = score_grad(parts, routing.row_pair, routing.expert_offsets)
    assert torch.equal(score_grad(parts, row_pair, offsets), want)
    assert torch.equal(want, score_grad_ref(parts, routing.row_pair, routing.expert_offsets))
    assert torch.equal(score_grad(parts.t().contiguous().t(), routing.row_pair, routing.expert_offsets), want)
    # a strided (R,) view of the bias term (a column of a (R, 2) tensor) adds the same row's term as its copy
    extra = torch.randn(r, 2, device=device)[:, 1]
    assert not extra.is_contiguous()
    with_extra = score_grad(parts, routing.row_pair, routing.expert_offsets, extra)
    assert torch.equal(with_extra, score_grad(parts, routing.row_pair, routing.expert_offsets, extra.contiguous()))
    assert torch.equal(with_extra, score_grad_ref(parts, routing.row_pair, routing.expert_offsets, extra.contiguous()))


def test_gemm_operands_with_strided_columns(device):
    """Operands whose inner stride is not 1 (column-major storage: an A, X, W1, W2 or bias built transposed) give the
    bits of their contiguous copies: the varlen-M GEMM (both forms) and the up-projection read rows of A, X, W1 and
    the biases at a unit column stride, so their launchers copy (a launcher that did not: wrong products)."""
    t, d, n, e, k = 29, 40, 24, 5, 2
    p = random_problem(t, d, n, e, bias=True, device=device, seed=21)
    _, routing = _topk_routing(p, k, device)
    r = routing.num_rows
    g = torch.Generator().manual_seed(21)
    a = torch.randn(n, r, generator=g).to(device).t()  # (R, n), column-major
    dh_ = torch.randn(2 * n, r, generator=g).to(device).t()
    x = p["x"].t().contiguous().t()
    assert a.stride(-1) != 1 and dh_.stride(-1) != 1
    y = down_proj(a.contiguous(), p["w2"], p["b2"], routing)
    b2 = p["b2"].t().contiguous().t()  # (E, d), inner stride E
    assert b2.stride(-1) != 1
    assert torch.equal(down_proj(a, p["w2"], p["b2"], routing), y)
    assert torch.equal(down_proj(a.contiguous(), p["w2"], b2, routing), y)
    w2 = p["w2"].transpose(1, 2).contiguous().transpose(1, 2)  # (E, d, n), inner stride d
    assert torch.equal(down_proj(a.contiguous(), w2, p["b2"], routing), y)
    assert torch.equal(varlen_m_gemm(dh_, p["w1"], None, routing, transpose_b=False),
                       varlen_m_gemm(dh_.contiguous(), p["w1"], None, routing, transpose_b=False))
    w1 = p["w1"].transpose(1, 2).contiguous().transpose(1, 2)  # (E, 2n, d), inner stride 2n
    b1 = p["b1"].t().contiguous().t()
    assert x.stride(-1) != 1 and w1.stride(-1) != 1 and b1.stride(-1) != 1
    want = up_proj(p["x"], p["w1"], p["b1"], routing)
    for got in (up_proj(x, p["w1"], p["b1"], routing), up_proj(p["x"], w1, p["b1"], routing),
                up_proj(p["x"], p["w1"], b1, routing)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_reductions_narrower_than_a_k_block(device):
    """d = n = 8, reduction widths that divide the interpreter's BLOCK_K of 16 but are no multiple of it: EVEN_K (a
    nonzero multiple of the block, with_even_flags) stays off, so the K-blocks of X and A are masked past the width.
    The operands are row views into wider tensors whose other columns are NaN: an unmasked block reads them, and NaN
    times the masked weights' zeros is NaN. The up-projection (K = d) and the down-projection (K = n) against their
    references on contiguous copies."""
    from sonicmoe.ops import up_proj as up_mod

    t, d, n, e, k = 24, 8, 8, 3, 2
    assert not up_mod._up_proj_kernel.values["EVEN_K"]({"D": d, "BLOCK_K": 16})
    p = random_problem(t, d, n, e, bias=True, device=device, seed=31)
    _, routing = _topk_routing(p, k, device)
    g = torch.Generator().manual_seed(31)
    x_wide = torch.full((t, 2 * d), float("nan")).to(device)
    x_wide[:, :d] = p["x"]
    h, a = up_proj(x_wide[:, :d], p["w1"], p["b1"], routing)
    h_ref, a_ref = up_proj_ref(p["x"], p["w1"], p["b1"], routing)
    assert rel_err(h, h_ref) < 1e-5 and rel_err(a, a_ref) < 1e-5
    r = routing.num_rows
    a_wide = torch.full((r, 2 * n), float("nan")).to(device)
    a_wide[:, :n] = torch.randn(r, n, generator=g).to(device)
    y = down_proj(a_wide[:, :n], p["w2"], p["b2"], routing)
    assert rel_err(y, down_proj_ref(a_wide[:, :n].contiguous(), p["w2"], p["b2"], routing)) < 1e-5


def test_dh_and_varlen_k_operands_strided(device):
    """Strided views give the bits of their contiguous copies in dH and the varlen-K weight gradients: scores in
    pair order a stride-2 view (the kernel reads them through row_pair at unit stride), dO, H and W2 stored transposed,
    and both varlen-K operands column-major (the kernel reads rows at a unit column stride): the launchers copy."""
    p, routing, h, s, dout = _dh_inputs(29, 40, 24, 5, 2, device, seed=23)
    r = routing.num_rows
    g = torch.Generator().manual_seed(23)
    pairs = torch.randn(2 * r, generator=g).to(device)[::2]
    assert not pairs.is_contiguous()
    want = dh(dout, p["w2"], h, pairs.contiguous(), routing, pair_order=True)
    got = dh(dout, p["w2"], h, pairs, routing, pair_order=True)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    want = dh(dout, p["w2"], h, s, routing)
    got = dh(dout.t().contiguous().t(), p["w2"].transpose(1, 2).contiguous().transpose(1, 2), h.t().contiguous().t(),
             torch.stack([s, s], 1)[:, 1], routing)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    a_prime = torch.randn(24, r, generator=g).to(device).t()  # (R, n), column-major
    dh_ = torch.randn(48, r, generator=g).to(device).t()
    x = p["x"].t().contiguous().t()
    assert a_prime.stride(-1) != 1 and dh_.stride(-1) != 1 and x.stride(-1) != 1
    for pg, qg, pm, qm in ((True, False, dout.t().contiguous().t(), a_prime), (False, True, dh_, x)):
        got = varlen_k_gemm(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=torch.float32)
        want = varlen_k_gemm(pm.contiguous(), qm.contiguous(), routing, p_gather=pg, q_gather=qg,
                             out_dtype=torch.float32)
        assert torch.equal(got, want)
        ref = varlen_k_gemm_ref(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=torch.float32)
        assert rel_err(got, ref) < 1e-5


def test_gather_sum_padded_routing(device):
    """A padded routing (static length; padding pairs (T, E) at the end): the kernel and its twin leave the padding
    slots out, and every token's real slots summed must equal the same routing built without the padding."""
    t, e, pad = 11, 5, 4
    g = torch.Generator().manual_seed(3)
    pairs = sorted({(int(a), int(b)) for a, b in zip(torch.randint(0, t, (17,), generator=g),
                                                       torch.randint(0, e, (17,), generator=g))})
    tok, expert = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
    padded = routing_from_pairs(torch.cat([tok, torch.full((pad,), t)]).to(device),
                                torch.cat([expert, torch.full((pad,), e)]).to(device), t, e, token_major=True,
                                padding=True)
    plain = routing_from_pairs(tok.to(device), expert.to(device), t, e, token_major=True)
    y = torch.randn(padded.num_rows, 24, device=device)
    w = torch.rand(padded.num_rows, device=device)
    r = plain.num_rows  # the real rows come first, in the same order as the plain routing's
    want = gather_sum_ref(y[:r], plain, w[:r])
    for fn in (gather_sum, gather_sum_ref):
        assert rel_err(fn(y, padded, w), want) < 1e-6, fn.__name__


def test_varlen_m_twin_keeps_padding_rows(device):
    """The varlen-M GEMM's twin returns C with A's R rows on a padded (static-length) routing, as the kernel: the real
    rows equal, the padding rows (past expert_offsets[E], which no kernel writes) zero. It returned only the real
    rows before the ops audit of session 90 (long_gemm_ref's ``out`` then failed to broadcast)."""
    t, e, k, m = 6, 3, 24, 40
    tok = torch.tensor([0, 1, 1, 2, 3, 5, 4], device=device)
    ex = torch.tensor([0, 1, 0, 2, 1, 0, 2], device=device)
    routing = routing_from_pairs(torch.cat([tok, torch.full((3,), t, device=device)]),
                                 torch.cat([ex, torch.full((3,), e, device=device)]), t, e, padding=True)
    real = int(routing.expert_offsets[-1])
    assert routing.num_rows == real + 3
    a = torch.randn(routing.num_rows, k, device=device)
    for transpose_b in (True, False):
        b = torch.randn((e, m, k) if transpose_b else (e, k, m), device=device)
        bias = torch.randn(e, m, device=device)
        got = varlen_m_gemm(a, b, bias, routing, transpose_b=transpose_b)
        want = varlen_m_gemm_ref(a, b, bias, routing, transpose_b=transpose_b)
        assert want.shape == got.shape == (routing.num_rows, m)
        assert rel_err(got[:real], want[:real]) < 1e-5 and not want[real:].any()


def test_varlen_m_twin_returns_the_operands_dtype(device):
    """The varlen-M twins' float32 loop returns C in A's dtype: float16 operands give each expert's float32 product
    (bias included) rounded once to float16, both forms."""
    g = torch.Generator().manual_seed(37)
    t, e, k, m = 9, 3, 24, 40
    ex = torch.tensor([2, 0, 1, 0, 2, 2, 1, 0, 2])
    routing = routing_from_pairs(torch.arange(t).to(device), ex.to(device), t, e)
    a = torch.randn(t, k, generator=g).half().to(device)
    bias = torch.randn(e, m, generator=g).half().to(device)
    ends = torch.bincount(ex, minlength=e).cumsum(0).tolist()  # A's rows are sorted by expert: 3, 2 and 4 of them
    for transpose_b in (True, False):
        b = torch.randn((e, m, k) if transpose_b else (e, k, m), generator=g).half().to(device)
        got = varlen_m_gemm_ref(a, b, bias, routing, transpose_b=transpose_b)
        assert got.dtype == torch.float16 and got.shape == (t, m)
        for i, (lo, hi) in enumerate(zip([0, *ends[:-1]], ends)):
            bi = b[i].float().t() if transpose_b else b[i].float()
            want = (a[lo:hi].float() @ bi + bias[i].float()).half()
            assert torch.equal(got[lo:hi], want), (transpose_b, i)


def test_gather_sum_more_slots_than_unrolled(device):
    """Tokens with more slots than one unrolled step (aggregation.MAX_UNROLL) and a ragged last step: every slot
    is summed, in slot order (the sum of each token's slots is checked against the reference)."""
    from sonicmoe.ops import aggregation

    t, e, k = 13, 16, aggregation.MAX_UNROLL * 2 + 1
    tok = torch.arange(t).repeat_interleave(k)
    expert = (torch.arange(t)[:, None] * 3 + torch.arange(k)[None, :]).remainder(e).flatten()
    routing = routing_from_pairs(tok.to(device), expert.to(device), t, e)
    y = torch.randn(routing.num_rows, 24, device=device)
    w = torch.rand(routing.num_rows, device=device)
    out = gather_sum(y, routing, w)
    assert torch.isfinite(out).all()
    assert rel_err(out, gather_sum_ref(y, routing, w)) < 1e-6


def test_gather_sum_config_rule(device, monkeypatch):
    """The aggregation's config: SLICE_CONFIG on a GPU with one program per tile where d is an odd multiple of 512,
    autotuned elsewhere (d a multiple of 1024 or not of 512, persistent grids, CPU) or under SONICMOE_AGG_CONFIG=auto,
    the variable's own config where set (the same bits: slot order does not depend on it), and a malformed value
    refused by name."""
    from sonicmoe.ops import aggregation

    monkeypatch.delenv("SONICMOE_AGG_CONFIG", raising=False)
    slice_cfg = aggregation.SLICE_CONFIG
    assert aggregation.pinned_config(1536, True) == (slice_cfg, aggregation.MAX_UNROLL)
    assert aggregation.pinned_config(1536, True)[0] is not slice_cfg  # a copy: callers cannot change the default
    assert aggregation.pinned_config(2560, True)[0] == slice_cfg
    for d, on_gpu, progs in ((4096, True, 0), (2048, True, 0), (768, True, 0), (1536, False, 0), (1536, True, 2)):
        assert aggregation.pinned_config(d, on_gpu, progs) == (None, aggregation.MAX_UNROLL), (d, on_gpu, progs)
    t, e = 29, 7
    routing = _skewed_routing(t, e, device)
    y = torch.randn(routing.num_rows, 40, device=device)
    w = torch.rand(routing.num_rows, device=device)
    base = gather_sum(y, routing, w)
    monkeypatch.setenv("SONICMOE_AGG_CONFIG", "auto")
    assert aggregation.pinned_config(1536, True) == (None, aggregation.MAX_UNROLL)
    monkeypatch.setenv("SONICMOE_AGG_CONFIG", "2:32:1:2")
    assert aggregation.pinned_config(768, False) == ({"BLOCK_T": 2, "BLOCK_D": 32, "num_warps": 1}, 2)
    assert torch.equal(gather_sum(y, routing, w), base)
    # BLOCK_T too must be a power of two (the kernel's tl.arange over the tile's tokens): 3 passed the check and
    # failed inside Triton ("arange's range must be a power of 2") before the audit of session 90
    # a fifth part (not four values: refused by name, not by the zip into the config)
    # an UNROLL of 0 (the kernel's slot loop then adds no slot: zeros, silently) and an empty value (refused like
    # every other switch's, not read as unset) too; the message names the value as written and the 'auto' choice.
    # Decimal digits only, as sonicmoe.env reads a count: int() took a space, a sign or an underscore before the
    # mutation audit bb11_ (and a superscript digit, which isdigit() calls one, raised int's own ValueError)
    for bad in ("1:512:2", "1:500:2:4", "1:512:3:4", "0:512:2:4", "3:32:1:2", "1:512:2:4:1", "x", "1:512:2:0", "",
                "1:512:2: 4", "+1:512:2:4", "1:5_12:2:4", "1:512:2:\u00b2"):
        monkeypatch.setenv("SONICMOE_AGG_CONFIG", bad)
        why = f"SONICMOE_AGG_CONFIG: expected 'auto' or BLOCK_T:.* got {re.escape(repr(bad))}$"
        with pytest.raises(ValueError, match=why):
            gather_sum(y, routing, w)


def test_reserve_config_switch(device, monkeypatch):
    """The config of the aggregation on reserved multiprocessors: RESERVE_CONFIG (a copy), or
    SONICMOE_AGG_RESERVE_CONFIG's where set, run as a persistent grid of a few programs with the bits of one program
    per tile on tokens with 0 to 7 slots; a malformed value refused by name."""
    from sonicmoe.ops import aggregation

    monkeypatch.delenv("SONICMOE_AGG_RESERVE_CONFIG", raising=False)
    assert aggregation.reserve_config() == aggregation.RESERVE_CONFIG
    assert aggregation.reserve_config() is not aggregation.RESERVE_CONFIG  # a copy: callers cannot change the default
    monkeypatch.setenv("SONICMOE_AGG_RESERVE_CONFIG", "8:1024:16:8")
    assert aggregation.reserve_config() == {"BLOCK_T": 8, "BLOCK_D": 1024, "num_warps": 16, "UNROLL": 8}
    # token i routed to i % 4 experts, token 5 to all 7: slot counts from 0 to past the mean
    pairs = [(tok, ex) for tok in range(29) for ex in range(7 if tok == 5 else tok % 4)]
    perm = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(0)).tolist()
    routing = routing_from_pairs(torch.tensor([pairs[i][0] for i in perm], device=device),
                                 torch.tensor([pairs[i][1] for i in perm], device=device), 29, 7)
    counts = routing.token_offsets[1:] - routing.token_offsets[:-1]
    assert counts.min() == 0 and counts.max() == 7
    y = torch.randn(routing.num_rows, 40, device=device)
    w = torch.rand(routing.num_rows, device=device)
    monkeypatch.setenv("SONICMOE_AGG_RESERVE_CONFIG", "2:32:1:2")
    got = gather_sum(y, routing, w, config=aggregation.reserve_config(), num_programs=3)
    assert torch.equal(got, gather_sum(y, routing, w))
    assert rel_err(got, gather_sum_ref(y, routing, w)) < 1e-6
    for bad in ("8:1024:32", "8:1000:32:4", "8:1024:24:4", "0:1024:32:4", "6:1024:32:4", "8:1024:32:8:1", "x",
                "8:1024:32:0", "", "8:1024:32:8 ", "8:1024:+32:8", "8:1_024:32:8"):
        monkeypatch.setenv("SONICMOE_AGG_RESERVE_CONFIG", bad)
        # no 'auto' here: the reserve config has no autotuned form
        why = f"SONICMOE_AGG_RESERVE_CONFIG: expected BLOCK_T:.* got {re.escape(repr(bad))}$"
        with pytest.raises(ValueError, match=why):
            aggregation.reserve_config()


def _layer_grads(p, k, layout, backend, dtype, dout):
    ins = {key: (v.to(dtype).clone().requires_grad_(True) if v is not None else None) for key, v in p.items()}
    res = sonicmoe.moe(ins["x"], ins["router_weight"], ins["w1"], ins["w2"], ins["b1"], ins["b2"], top_k=k,
                       gate_up_layout=layout, backend=backend)
    res.out.backward(dout.to(dtype))
    return res.out.detach(), {key: v.grad for key, v in ins.items() if v is not None}


def _ref_grads(p, k, layout, dout, dtype=torch.float64):
    """float64 reference on the inputs rounded to ``dtype`` (so routing near-ties choose alike)."""
    return reference_grads(p, dout, k, rounded_to=dtype, gate_up_layout=layout)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("layout,bias,dtype", [("concat", False, torch.float32),
                                               ("interleaved", True, torch.float32),
                                               ("concat", True, torch.float16),
                                               ("interleaved", False, torch.float16)])
def test_layer_forward_backward(shape, layout, bias, dtype, device):
    t, d, n, e, k, _ = shape
    p = random_problem(t, d, n, e, bias=bias, device=device, seed=11)
    # dout from its own generator, not the global one (which earlier tests, hypothesis's among them, leave in
    # varying states): at T = 1, K = E the router-weight gradient is a difference of near-equal terms
    # (softmax over every expert), and about 1 in 200 random dout puts its float32 error above 1e-5
    dout = torch.randn(t, d, generator=torch.Generator().manual_seed(12)).to(device)
    out, grads = _layer_grads(p, k, layout, "triton", dtype, dout)
    ref, ref_grads = _ref_grads(p, k, layout, dout)
    tol = _tol(dtype) * (1 if dtype == torch.float32 else 3)
    assert rel_err(out, ref) < tol
    for key, g in grads.items():
        if key == "router_weight" and k == 1:
            assert torch.all(g == 0)  # softmax over one chosen logit is constant
            continue
        assert rel_err(g, ref_grads[key]) < tol, key


def test_general_routing_layer(device):
    """Variable experts per token (a token with none), empty experts, one expert with every token."""
    t, d, n, e = 23, 32, 24, 7
    p = random_problem(t, d, n, e, device=device, seed=2)
    routing = _skewed_routing(t, e, device)
    scores = torch.rand(routing.num_rows, device=device, requires_grad=True)
    x = p["x"].clone().requires_grad_(True)
    w1 = p["w1"].clone().requires_grad_(True)
    out = sonicmoe.experts(x, w1, p["w2"], routing, scores, backend="triton")
    dout = torch.randn_like(out)
    out.backward(dout)
    xr, w1r, sr = (v.detach().clone().requires_grad_(True) for v in (p["x"], p["w1"], scores))
    ref = sonicmoe.experts_ref(xr, w1r, p["w2"], routing, sr)
    ref.backward(dout)
    assert rel_err(out, ref) < 1e-5
    for g, gr in ((x.grad, xr.grad), (w1.grad, w1r.grad), (scores.grad, sr.grad)):
        assert rel_err(g, gr) < 1e-5


def test_repeated_pairs_each_count(device):
    """A (token, expert) pair given twice is two rows, each computed and added with its own score, on the Triton
    backend as in the float32 reference (a token may then have more pairs than E: here 7 over E = 4); the routing's
    per-token slots and per-expert rows hold every copy."""
    t, d, n, e = 6, 32, 16, 4
    p = random_problem(t, d, n, e, device=device, seed=9)
    tok = torch.tensor([0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 3, 5, 5], device=device)
    exp = torch.tensor([1, 1, 0, 3, 3, 2, 1, 0, 3, 3, 1, 0, 0], device=device)
    routing = routing_from_pairs(tok, exp, t, e, check=True)
    assert routing.token_offsets.tolist() == [0, 2, 3, 10, 11, 11, 13]
    assert routing.expert_offsets.tolist() == [0, 4, 8, 9, 13]
    scores = torch.rand(len(tok), device=device, requires_grad=True)
    x = p["x"].clone().requires_grad_(True)
    out = sonicmoe.experts(x, p["w1"], p["w2"], routing, scores, backend="triton")
    dout = torch.randn_like(out)
    out.backward(dout)
    xr, sr = (v.detach().clone().requires_grad_(True) for v in (p["x"], scores))
    ref = sonicmoe.experts_ref(xr, p["w1"], p["w2"], routing, sr)
    ref.backward(dout)
    assert rel_err(out, ref) < 1e-5 and rel_err(x.grad, xr.grad) < 1e-5 and rel_err(scores.grad, sr.grad) < 1e-5
    assert out[4].abs().max() == 0  # token 4: no pair
    # the repeat counts: the output is not the one with each pair once
    first = [0, 2, 3, 5, 6, 7, 10, 11]
    once = sonicmoe.experts_ref(p["x"], p["w1"], p["w2"], routing_from_pairs(tok[first], exp[first], t, e),
                                scores.detach()[first])
    assert rel_err(out.detach(), once) > 0.1


def test_memory_contract(device):
    """Backward saves X, H, S (the caller's tensors: no copies), weights and int routing metadata: no (R, d)
    tensor, no A.

    Everything any autograd node packs while ``sonicmoe.experts`` runs is recorded through
    ``saved_tensors_hooks`` (the eager autograd Function, like the custom op's autograd formula, saves through
    ``ctx.save_for_backward``, and nothing else in the call may save anything)."""
    t, d, n, e, k = 33, 48, 16, 4, 2  # d != n, 2n so (R, d), (R, n), (R, 2n) are told apart
    p = random_problem(t, d, n, e, device=device, seed=4)
    _, routing = _topk_routing(p, k, device)
    r = routing.num_rows
    x = p["x"].clone().requires_grad_(True)
    scores = torch.rand(r, device=device, requires_grad=True)
    saved = []

    def pack(s):
        saved.append(s)
        return s

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
        out = sonicmoe.experts(x, p["w1"], p["w2"], routing, scores, backend="triton")
    assert out.grad_fn.name() == "ExpertsFunctionBackward"  # eager: the custom op's twin (test_library: the op)
    key = lambda s: (s.data_ptr(), tuple(s.shape), s.dtype)
    assert [key(s) for s in saved] == [key(s) for s in out.grad_fn.saved_tensors if s is not None]
    float_shapes = sorted(tuple(s.shape) for s in saved if s.dtype.is_floating_point)
    assert float_shapes == sorted([(t, d), (r, 2 * n), (r,), (e, 2 * n, d), (e, d, n)])
    assert any(s.data_ptr() == x.data_ptr() for s in saved), "X is saved as the caller's tensor, not a copy"
    assert any(s.data_ptr() == scores.data_ptr() for s in saved), "S is saved as the caller's tensor (pair order)"
    for s in saved:
        if not s.dtype.is_floating_point:
            assert s.dtype == torch.int32 and s.dim() == 1 and s.numel() <= max(r, t + 1, e + 1)
    activation_bytes = sum(s.numel() * s.element_size() for s in saved
                           if s.dtype.is_floating_point and s.dim() < 3)
    assert activation_bytes == (t * d + r * 2 * n + r) * 4  # fp32 here: 2Td + 4TKn bytes in bf16 + S (the caller's)
    out.backward(torch.randn_like(out))  # and the saved tensors suffice for the backward
    assert x.grad is not None and scores.grad is not None


def test_deterministic_and_no_mutation(device):
    t, d, n, e, k = 40, 32, 32, 6, 3
    p = random_problem(t, d, n, e, bias=True, device=device, seed=9)
    before = {key: v.clone() for key, v in p.items()}
    dout = torch.randn(t, d, device=device)
    out1, g1 = _layer_grads(p, k, "concat", "triton", torch.float32, dout)
    out2, g2 = _layer_grads(p, k, "concat", "triton", torch.float32, dout)
    assert torch.equal(out1, out2)
    for key in g1:
        assert torch.equal(g1[key], g2[key]), key
    for key, v in p.items():
        assert torch.equal(v, before[key]), f"{key} was modified"


def test_inference_path_matches_training_path(device):
    t, d, n, e, k = 30, 32, 24, 5, 2
    p = random_problem(t, d, n, e, device=device, seed=8)
    router, routing = _topk_routing(p, k, device)
    s = router.topk_scores.reshape(-1)
    with torch.no_grad():
        o_inf = sonicmoe.experts(p["x"], p["w1"], p["w2"], routing, s, backend="triton")
    o_train = sonicmoe.experts(p["x"].requires_grad_(True), p["w1"], p["w2"], routing, s, backend="triton")
    assert torch.equal(o_inf, o_train.detach())


@pytest.mark.parametrize("made_in_inference", ["routing", "x", "frozen_w2"])
def test_training_on_tensors_made_under_inference_mode(made_in_inference, device):
    """A routing cached, features computed or a frozen weight loaded under torch.inference_mode, then gradients
    taken outside it: autograd cannot save inference tensors, so the triton backend copies them for its backward
    (PyTorch's own RuntimeError, naming no argument, before session 89). Output and gradients are bitwise those of
    the same inputs made outside inference_mode."""
    t, d, n, e, k = 24, 32, 16, 4, 2
    p = random_problem(t, d, n, e, device=device, seed=12)
    router, routing = _topk_routing(p, k, device)
    s = router.topk_scores.reshape(-1).detach()
    plain = {"routing": routing, "x": p["x"], "w2": p["w2"]}
    inf = dict(plain)
    with torch.inference_mode():
        if made_in_inference == "routing":
            inf["routing"] = routing_from_topk(router.topk_ids, e)
        elif made_in_inference == "x":
            inf["x"] = p["x"].clone()
        else:
            inf["w2"] = p["w2"].clone()
    assert (inf["routing"].row_token, inf["x"], inf["w2"])[["routing", "x", "frozen_w2"].index(made_in_inference)
                                                             ].is_inference()
    dout = torch.randn(t, d, device=device)
    got = []
    for args in (inf, plain):
        w1 = p["w1"].clone().requires_grad_(True)
        s_leaf = s.clone().requires_grad_(True)
        out = sonicmoe.experts(args["x"], w1, args["w2"], args["routing"], s_leaf, backend="triton")
        got.append((out.detach(), *torch.autograd.grad(out, [w1, s_leaf], dout)))
    for a, b in zip(*got):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_inference_mode_retry_copies_only_the_inference_inputs(device):
    """The retry for a routing made under torch.inference_mode copies the routing's arrays alone: the backward keeps
    the caller's own X and W1 (the same storage, X's gradient straight to its leaf), not copies of every input."""
    t, d, n, e, k = 24, 32, 16, 4, 2
    p = random_problem(t, d, n, e, device=device, seed=13)
    router, _ = _topk_routing(p, k, device)
    with torch.inference_mode():
        routing = routing_from_topk(router.topk_ids, e)
    x, w1 = p["x"].clone().requires_grad_(True), p["w1"].clone().requires_grad_(True)
    out = sonicmoe.experts(x, w1, p["w2"], routing, router.topk_scores.reshape(-1).detach(), backend="triton")
    ptrs = {s.data_ptr() for s in out.grad_fn.saved_tensors if s is not None}
    assert x.data_ptr() in ptrs and w1.data_ptr() in ptrs
    assert type(out.grad_fn.next_functions[0][0]).__name__ == "AccumulateGrad"  # X's leaf, not a clone


# ---------------------------------------------------------------- GPU only: bf16 at realistic shapes

GPU_SHAPES = [
    (4096, 1024, 256, 64, 8, "fine-grained, G=4"),
    (3000, 768, 384, 32, 4, "T and n not tile multiples"),
    (2048, 512, 1024, 8, 2, "coarse experts, K=2"),
]


@pytest.mark.parametrize("case", ["no_tokens", "no_pairs", "padding_only"])
@pytest.mark.parametrize("bias", [False, True])
def test_experts_without_rows(case, bias, device):
    """R = 0 real rows: no tokens at all (T = 0, an empty batch; an expert-parallel rank that receives no row),
    tokens that chose no expert (general routing), or only padding pairs (a padded routing). Forward and
    backward through the Triton kernels: O is zero, every gradient is zero (x, W1, W2, b1, b2, the scores), in
    bf16 too on the GPU. Session 72: the two-rank expert-parallel GPU test crashed here."""
    d, n, e = 48, 40, 4
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    t = 0 if case == "no_tokens" else 5
    for dtype in dtypes:
        p = random_problem(max(t, 1), d, n, e, bias=bias, device=device, dtype=dtype, seed=11)
        if case == "no_tokens":
            routing = routing_from_topk(torch.zeros(0, 2, dtype=torch.long, device=device), e)
        elif case == "no_pairs":
            none = torch.zeros(0, dtype=torch.long, device=device)
            routing = routing_from_pairs(none, none, t, e)
        else:
            routing = routing_from_pairs(torch.full((3,), t, device=device), torch.full((3,), e, device=device),
                                         t, e, padding=True)
        leaves = {"x": p["x"][:t], "w1": p["w1"], "w2": p["w2"], "b1": p["b1"], "b2": p["b2"],
                  "pair_scores": torch.rand(routing.num_rows, device=device, dtype=dtype) + 0.1}
        leaves = {key: None if v is None else v.clone().requires_grad_(True) for key, v in leaves.items()}
        out = sonicmoe.experts(routing=routing, backend="triton", **leaves)
        assert out.shape == (t, d) and out.dtype == dtype
        assert torch.equal(out, torch.zeros_like(out))
        out.backward(torch.randn_like(out))
        for key, v in leaves.items():
            if v is not None:
                assert v.grad is not None and v.grad.shape == v.shape, key
                assert torch.equal(v.grad, torch.zeros_like(v)), f"{key} ({dtype}): {v.grad.abs().max()}"
    if device.type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_gather_ops_without_tokens(layout, device):
    """The gathering ops on their own with T = 0: a routing of padding rows only (R = 3 static rows, none real) and
    one of no rows. The up-projection gives zero H and A, dH gives zero dH, A′ and dS (row order, the partials, and
    pair order), the aggregation an empty O: nothing is launched on a token that does not exist (the kernels clamp
    masked-off rows to token 0; session 72's crash was that read in the varlen-K GEMM)."""
    d, n, e = 48, 40, 4
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    for dtype in dtypes:
        p = random_problem(1, d, n, e, bias=True, device=device, dtype=dtype, seed=3)
        none = torch.zeros(0, dtype=torch.long, device=device)
        for routing in (routing_from_pairs(torch.zeros(3, dtype=torch.long, device=device),
                                           torch.full((3,), e, device=device), 0, e, padding=True),
                        routing_from_pairs(none, none, 0, e)):
            r = routing.num_rows
            x, dout = p["x"][:0], torch.randn(0, d, device=device, dtype=dtype)
            h, a = up_proj(x, p["w1"], p["b1"], routing, gate_up_layout=layout)
            assert h.shape == (r, 2 * n) and a.shape == (r, n) and not h.any() and not a.any()
            assert up_proj(x, p["w1"], None, routing, gate_up_layout=layout, store_h=False)[0] is None
            h = torch.randn(r, 2 * n, device=device, dtype=dtype)
            scores = torch.rand(r, device=device) + 0.1
            dh_, a_prime, ds = dh(dout, p["w2"], h, scores, routing, gate_up_layout=layout)
            assert dh_.shape == h.shape and a_prime.shape == (r, n) and ds.shape == (r,)
            assert not dh_.any() and not a_prime.any() and not ds.any()
            assert not dh(dout, p["w2"], h, scores, routing, gate_up_layout=layout, reduce_ds=False)[2].any()
            ds_pairs = dh(dout, p["w2"], h, scores, routing, gate_up_layout=layout, pair_order=True,
                          ds_pairs=dtype)[2]
            assert ds_pairs.shape == (r,) and ds_pairs.dtype == dtype and not ds_pairs.any()
            out = gather_sum(torch.randn(r, d, device=device, dtype=dtype), routing, None)
            assert out.shape == (0, d)
    if device.type == "cuda":
        torch.cuda.synchronize()


def test_dh_without_tokens_keeps_h_dtype(device):
    """dH with T = 0 in float16 (no kernel launched, zeros returned on the host): dH and A′ in H's dtype and shape,
    dS in float32, as the kernel path returns them for T > 0 (the caller's dW2 GEMM reads A′ in W2's dtype)."""
    d, n, e = 32, 24, 3
    g = torch.Generator().manual_seed(21)
    w2 = torch.randn(e, d, n, generator=g).half().to(device)
    routing = routing_from_pairs(torch.zeros(3, dtype=torch.long, device=device), torch.full((3,), e, device=device),
                                 0, e, padding=True)
    h = torch.randn(3, 2 * n, generator=g).half().to(device)
    dout = torch.zeros(0, d, device=device, dtype=torch.float16)
    dh_, a_prime, ds = dh(dout, w2, h, torch.rand(3, generator=g).to(device), routing)
    assert dh_.dtype == a_prime.dtype == torch.float16 and ds.dtype == torch.float32
    assert dh_.shape == (3, 2 * n) and a_prime.shape == (3, n) and ds.shape == (3,)
    assert not dh_.any() and not a_prime.any() and not ds.any()
    # reduce_ds=False: the partials' shape of the kernel path, one row per 16-channel chunk (n = 24: 2, the last
    # partial), so the caller's fixed-order sum over them sees the same layout
    parts = dh(dout, w2, h, torch.rand(3, generator=g).to(device), routing, reduce_ds=False)[2]
    assert parts.shape == (2, 3) and parts.dtype == torch.float32 and not parts.any()


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_up_proj_and_dh_of_a_single_row(layout, device):
    """One routed row (R = 1: one token, sent to expert 1 of 3) is still launched and computed: H, A, dH, A′ and dS
    against float64 formulas written out here (a launch bound of R > 1 would leave the poisoned outputs NaN).
    SwiGLU: A = silu(g)·u; dA = s·dA′, dgate = dA·u·σ(g)(1 + g(1 − σ(g))), dup = dA·silu(g), dS = ⟨dA′, A⟩."""
    d, n, e = 24, 20, 3
    p = random_problem(1, d, n, e, bias=True, device=device, seed=113)
    one = torch.ones(1, dtype=torch.long, device=device)
    routing = routing_from_pairs(one * 0, one, 1, e)
    assert routing.num_rows == 1
    gi, ui = ((torch.arange(n), torch.arange(n) + n) if layout == "concat"
              else (2 * torch.arange(n), 2 * torch.arange(n) + 1))
    h, a = up_proj(p["x"], p["w1"], p["b1"], routing, layout)
    h64 = p["w1"][1].double() @ p["x"][0].double() + p["b1"][1].double()
    a64 = torch.nn.functional.silu(h64[gi]) * h64[ui]
    assert rel_err(h[0], h64) < 1e-5 and rel_err(a[0], a64) < 1e-5
    g = torch.Generator().manual_seed(113)
    hin = torch.randn(1, 2 * n, generator=g).to(device)
    dout = torch.randn(1, d, generator=g).to(device)
    s = torch.tensor([0.7], device=device)
    dh_, a_prime, ds = dh(dout, p["w2"], hin, s, routing, layout)
    gate, up = hin[0, gi].double(), hin[0, ui].double()
    dap = dout[0].double() @ p["w2"][1].double()
    sig = torch.sigmoid(gate)
    act = gate * sig * up
    want_dh = torch.empty(2 * n, dtype=torch.float64, device=device)
    want_dh[gi] = 0.7 * dap * up * sig * (1 + gate * (1 - sig))
    want_dh[ui] = 0.7 * dap * gate * sig
    assert rel_err(dh_[0], want_dh) < 1e-5 and rel_err(a_prime[0], 0.7 * act) < 1e-5
    assert rel_err(ds, (dap * act).sum()[None]) < 1e-5


def test_varlen_k_with_an_empty_gathered_operand(device):
    """A gathered operand of no rows (T = 0) beside a routing of padding rows only (R = 3, none real): dW is zero and
    nothing is launched, in the step loop's config too, whose discarded step of a tile without a whole chunk would
    read row 0 of the empty operand (no memory there: the interpreter dies of it; session 72's GPU crash)."""
    d, n, e = 32, 24, 3
    g = torch.Generator().manual_seed(22)
    routing = routing_from_pairs(torch.zeros(3, dtype=torch.long, device=device), torch.full((3,), e, device=device),
                                 0, e, padding=True)
    none = torch.zeros(0, d, device=device)
    a_prime = torch.randn(3, n, generator=g).to(device)
    dh_ = torch.randn(3, 2 * n, generator=g).to(device)
    steps = {"BLOCK_I": 16, "BLOCK_J": 16, "BLOCK_R": 16, "STEPS": True, "PROGS_PER_SM": 3}
    for cfg in (None, steps):
        for pg, qg, pm, qm in ((True, False, none, a_prime), (False, True, dh_, none)):
            got = varlen_k_gemm(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=torch.float32, config=cfg)
            assert got.shape == (e, pm.shape[1], qm.shape[1]) and torch.equal(got, torch.zeros_like(got))
            # in the asked dtype (the weight's), not the operands'
            got = varlen_k_gemm(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=torch.float16, config=cfg)
            assert got.dtype == torch.float16 and not got.any()


@pytest.mark.parametrize("routing", ["topk", "token_rounding"])
def test_layer_empty_batch(routing, device):
    """The MoE layer on T = 0 tokens (router, routing, experts; Triton kernels): an empty output, zero gradients
    for every parameter, nothing launched on rows that do not exist; and no warning of too few tokens per expert
    for token rounding (no token: nothing rounded; it warned before session 90)."""
    torch.manual_seed(0)
    layer = sonicmoe.MoE(48, 40, 4, 2, backend="triton", routing=routing, m_tile=16, bias=True).to(device)
    x = torch.randn(0, 48, device=device, requires_grad=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="token rounding")
        out = layer(x)
    assert out.shape == (0, 48)
    out.sum().backward()
    for name, q in layer.named_parameters():
        assert q.grad is None or torch.equal(q.grad, torch.zeros_like(q)), name
    if device.type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[s[-1] for s in GPU_SHAPES])
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_gpu_bf16_layer(shape, layout):
    """bf16 error of the Triton path is at most 2x the torch backend's bf16 error (+ small eps)."""
    t, d, n, e, k, _ = shape
    p = random_problem(t, d, n, e, bias=layout == "interleaved", device="cuda", seed=1)
    dout = torch.randn(t, d, device="cuda")
    out, grads = _layer_grads(p, k, layout, "triton", torch.bfloat16, dout)
    tout, tgrads = _layer_grads(p, k, layout, "torch", torch.bfloat16, dout)
    ref, rgrads = _ref_grads(p, k, layout, dout, torch.bfloat16)
    assert rel_err(out, ref) <= 2 * rel_err(tout, ref) + 1e-3
    assert rel_err(out, ref) < 1e-2
    for key in grads:
        assert rel_err(grads[key], rgrads[key]) <= 2 * rel_err(tgrads[key], rgrads[key]) + 2e-3, key


@pytest.mark.gpu
def test_gpu_gather_sum_slice_config(monkeypatch):
    """bf16 aggregation at d = 1536 (7B width) under SLICE_CONFIG: near the float32 sum, and bitwise equal to the
    autotuned and to other pinned configs (each token's slots are summed in slot order whatever the tiling)."""
    t, d, e, k = 3000, 1536, 64, 8
    ids = torch.rand(t, e, device="cuda").topk(k, dim=1).indices
    routing = routing_from_topk(ids, e)
    y = torch.randn(routing.num_rows, d, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(routing.num_rows, device="cuda")
    monkeypatch.delenv("SONICMOE_AGG_CONFIG", raising=False)
    base = gather_sum(y, routing, w)
    assert rel_err(base, gather_sum_ref(y.float(), routing, w)) < 4e-3
    for value in ("auto", "1:1024:4:4", "2:512:4:8"):
        monkeypatch.setenv("SONICMOE_AGG_CONFIG", value)
        assert torch.equal(gather_sum(y, routing, w), base), value


@pytest.mark.gpu
def test_gpu_bitwise_deterministic():
    p = random_problem(4096, 1024, 256, 64, device="cuda", seed=3)
    dout = torch.randn(4096, 1024, device="cuda")
    runs = [_layer_grads(p, 8, "concat", "triton", torch.bfloat16, dout) for _ in range(3)]
    for out, grads in runs[1:]:
        assert torch.equal(out, runs[0][0])
        for key in grads:
            assert torch.equal(grads[key], runs[0][1][key]), key


@pytest.mark.gpu
def test_gpu_bitwise_across_tile_configs(monkeypatch):
    """Outputs and gradients do not depend on which tile configuration runs: every config the tuner may
    pick keeps the reduction block (BLOCK_K / BLOCK_R = 64), so only M/N tiling, persistence and the
    weight-load path change here, and the bits must not."""
    from sonicmoe.ops import dh as dh_mod
    from sonicmoe.ops import grouped_gemm, weight_grad
    from sonicmoe.ops import up_proj as up_mod

    p = random_problem(4096, 1024, 256, 64, device="cuda", seed=5)
    dout = torch.randn(4096, 1024, device="cuda")
    first = _layer_grads(p, 8, "concat", "triton", torch.bfloat16, dout)
    m = {"PROGS_PER_SM": 0, "FLATTEN": False}
    monkeypatch.setattr(up_mod, "_GPU_DEFAULT", {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, **m,
                                                 "W_TMA": False, "num_warps": 4, "num_stages": 3})
    gemm_cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, **m, "W_TMA": True, "num_warps": 8, "num_stages": 4}
    monkeypatch.setattr(grouped_gemm, "pinned_gpu_config", lambda rows, experts, width: gemm_cfg)
    monkeypatch.setattr(dh_mod, "_GPU_DEFAULT", {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64,
                                                 "PROGS_PER_SM": 1, "FLATTEN": False, "W_TMA": True,
                                                 "H_PREFETCH": 0, "num_warps": 8, "num_stages": 3})
    monkeypatch.setattr(weight_grad, "_GPU_DEFAULT", {"BLOCK_I": 64, "BLOCK_J": 128, "BLOCK_R": 64,
                                                      "num_warps": 4, "num_stages": 4})
    second = _layer_grads(p, 8, "concat", "triton", torch.bfloat16, dout)
    assert torch.equal(first[0], second[0])
    for key in first[1]:
        assert torch.equal(first[1][key], second[1][key]), key


@pytest.mark.gpu
def test_gpu_varlen_m_env_config_bits(monkeypatch):
    """Each config SONICMOE_VARLEN_M_CONFIG can pin gives the autotuned launch's bits, in both forms (the
    down-projection and dX̃, into a column block of a poisoned wider C too), near the float32 reference."""
    from sonicmoe.ops import grouped_gemm

    t, d, n, e, k = 2048, 1024, 512, 8, 4
    ids = torch.rand(t, e, device="cuda").topk(k, dim=1).indices
    routing = routing_from_topk(ids, e)
    r = routing.num_rows
    g = torch.Generator(device="cuda").manual_seed(7)
    a_dn = torch.randn(r, n, device="cuda", dtype=torch.bfloat16, generator=g)
    w2 = torch.randn(e, d, n, device="cuda", dtype=torch.bfloat16, generator=g) / n**0.5
    a_dx = torch.randn(r, 2 * n, device="cuda", dtype=torch.bfloat16, generator=g)
    w1 = torch.randn(e, 2 * n, d, device="cuda", dtype=torch.bfloat16, generator=g) / (2 * n) ** 0.5
    forms = ((a_dn, w2, True), (a_dx, w1, False))
    monkeypatch.setenv("SONICMOE_GLUON", "0")
    monkeypatch.setenv("SONICMOE_VARLEN_M_CONFIG", "auto")
    base = [varlen_m_gemm(a, b, None, routing, transpose_b=tb) for a, b, tb in forms]
    for (a, b, tb), c in zip(forms, base, strict=True):
        assert rel_err(c, varlen_m_gemm_ref(a.float(), b.float(), None, routing, transpose_b=tb)) < 1e-2
    for i in range(len(grouped_gemm.TUNING_SPACE)):
        monkeypatch.setenv("SONICMOE_VARLEN_M_CONFIG", str(i))
        for (a, b, tb), c in zip(forms, base, strict=True):
            assert torch.equal(varlen_m_gemm(a, b, None, routing, transpose_b=tb), c), (i, tb)
        wide = torch.full((r, d + 256), float("nan"), device="cuda", dtype=torch.bfloat16)
        varlen_m_gemm(a_dx, w1[:, :, 256:768], None, routing, transpose_b=False, out=wide[:, 256:768])
        assert torch.equal(wide[:, 256:768], base[1][:, 256:768]), i
        assert wide[:, :256].isnan().all() and wide[:, 768:].isnan().all(), i


def test_pdl_off_without_a_hopper_gpu(monkeypatch):
    """Programmatic dependent launch is never requested for CPU tensors (the interpreter) nor when
    SONICMOE_PDL=0, so the kernels there run with PDL=False (their griddepcontrol prologue compiled out)."""
    from sonicmoe.ops import common
    from sonicmoe.ops.common import pdl_enabled

    assert not pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("SONICMOE_PDL", "0")
    assert not pdl_enabled(torch.device("cuda", 0))  # the switch is read before any device query
    # under the interpreter none, whatever the GPU (a compute capability 9.0 faked here)
    monkeypatch.delenv("SONICMOE_PDL")
    monkeypatch.setattr(common, "interpreting", lambda: True)
    monkeypatch.setattr(common, "_PDL_OK", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx: (9, 0))
    assert not pdl_enabled(torch.device("cuda", 0))


def test_overlap_off_on_cpu(monkeypatch):
    """The backward's side stream (dX aggregation beside dW1) is never used for CPU tensors (the interpreter);
    on CUDA SONICMOE_OVERLAP sets the aggregation's programs per multiprocessor (read before any device query);
    anything but a small integer turns it off."""
    from sonicmoe.ops.common import overlap_mode

    assert overlap_mode(torch.device("cpu")) == 0
    if interpreting():
        assert overlap_mode(torch.device("cuda", 0)) == 0
        return
    for flag, mode in (("0", 0), ("1", 1), ("4", 4), ("yes", 0), ("-1", 0)):
        monkeypatch.setenv("SONICMOE_OVERLAP", flag)
        assert overlap_mode(torch.device("cuda", 0)) == mode


def test_gather_sum_into_out(device):
    """``out=`` receives exactly the result of a fresh call (poisoned first), as does a persistent grid
    (``progs_per_sm``: on CPU one program looping over every tile), and a wrong ``out`` is refused by name."""
    t, d, n, e, k = 37, 48, 16, 5, 3
    p = random_problem(t, d, n, e, device=device, seed=12)
    _, routing = _topk_routing(p, k, device)
    y = torch.randn(routing.num_rows, d, device=device)
    out = torch.full((t, d), float("nan"), device=device)
    assert gather_sum(y, routing, None, out=out) is out
    assert torch.equal(out, gather_sum(y, routing, None))
    w = torch.rand(routing.num_rows, device=device)
    cfg = {"BLOCK_T": 4, "BLOCK_D": 16}  # several tiles along both T and d, the last ones partial
    assert torch.equal(gather_sum(y, routing, w, config=cfg, progs_per_sm=1), gather_sum(y, routing, w, config=cfg))
    # a persistent grid of a given size (num_programs, winning over progs_per_sm), and the reserved-multiprocessor
    # config of the column-block form (aggregation.RESERVE_CONFIG, 8 tokens x 1024 columns: one partial tile here)
    from sonicmoe.ops.aggregation import RESERVE_CONFIG

    for programs in (1, 3, 1000):
        assert torch.equal(gather_sum(y, routing, w, config=cfg, progs_per_sm=2, num_programs=programs),
                           gather_sum(y, routing, w, config=cfg))
    assert torch.equal(gather_sum(y, routing, w, config=RESERVE_CONFIG, num_programs=2), gather_sum(y, routing, w))
    with pytest.raises(ValueError, match="num_programs"):
        gather_sum(y, routing, w, num_programs=-1)
    # the twin writes into ``out`` too (poisoned first), as the kernel
    out = torch.full((t, d), float("nan"), device=device)
    assert gather_sum_ref(y, routing, w, out=out) is out
    assert rel_err(out, gather_sum(y, routing, w)) < 1e-6
    for bad in (torch.empty(t, d + 1, device=device), torch.empty(t, d, device=device, dtype=torch.float16),
                torch.empty(d, t, device=device).t()):
        with pytest.raises(ValueError, match="out"):
            gather_sum(y, routing, None, out=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("env, flags", [("SONICMOE_PDL", ("1", "0", "1")), ("SONICMOE_OVERLAP", ("2", "0", "1", "2"))])
def test_gpu_launch_switches_same_bits(monkeypatch, env, flags):
    """Launch-level switches leave every bit alone: with programmatic dependent launch (SONICMOE_PDL, the
    default on sm_90+) every kernel waits for its predecessor before touching memory; with the dX aggregation
    on a side stream beside dW1 (SONICMOE_OVERLAP: 1 or 2 programs per multiprocessor) the streams join before
    the gradients are returned. Outputs and gradients are bitwise those of the plain launches (0), with
    outputs poisoned before every launch; T not a tile multiple, bias terms included."""
    from sonicmoe.ops.common import pdl_enabled

    if env == "SONICMOE_PDL" and not pdl_enabled(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0 or newer")
    p = random_problem(3001, 1024, 256, 64, device="cuda", seed=11, bias=True)
    dout = torch.randn(3001, 1024, device="cuda")
    runs = []
    for flag in flags:
        monkeypatch.setenv(env, flag)
        runs.append(_layer_grads(p, 8, "concat", "triton", torch.bfloat16, dout))
    for out, grads in runs[1:]:
        assert torch.equal(out, runs[0][0])
        for key in grads:
            assert torch.equal(grads[key], runs[0][1][key]), key


def test_persistent_schedule_matches(device):
    """Persistent configs (few programs looping over the tiles, as nested loops or as one loop over
    (tile, K-block) steps) compute the same as one program per tile, the up-projection's bias included."""
    t, d, n, e, k = 45, 32, 40, 6, 2
    p = random_problem(t, d, n, e, bias=True, device=device, seed=6)
    router, routing = _topk_routing(p, k, device)
    base = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "FLATTEN": False}
    one, few = {**base, "PROGS_PER_SM": 0}, {**base, "PROGS_PER_SM": 3}
    h1, a1 = up_proj(p["x"], p["w1"], p["b1"], routing, config=one)
    h_ref, a_ref = up_proj_ref(p["x"], p["w1"], p["b1"], routing)
    assert rel_err(h1, h_ref) < 1e-5 and rel_err(a1, a_ref) < 1e-5
    for cfg in (few, {**few, "STEPS": True}, {**one, "STEPS": True}):
        h2, a2 = up_proj(p["x"], p["w1"], p["b1"], routing, config=cfg)
        assert torch.equal(h1, h2) and torch.equal(a1, a2), cfg
    y1 = down_proj(a1, p["w2"], p["b2"], routing, config=one)
    assert torch.equal(y1, down_proj(a1, p["w2"], p["b2"], routing, config=few))
    assert torch.equal(y1, down_proj(a1, p["w2"], p["b2"], routing, config={**few, "STEPS": True}))
    assert rel_err(y1, down_proj_ref(a1, p["w2"], p["b2"], routing)) < 1e-5
    h = torch.randn(routing.num_rows, 2 * n, device=device)
    s = routing.row_scores(router.topk_scores.reshape(-1))
    dout = torch.randn(t, d, device=device)
    for x1, x2 in zip(dh(dout, p["w2"], h, s, routing, config=one), dh(dout, p["w2"], h, s, routing, config=few)):
        assert torch.equal(x1, x2)


def test_step_loops_store_every_tile_at_zero_width_reduction(device):
    """The (tile, K-block) step loops (STEPS) at a zero-width reduction (K = 0: d = 0 in the up-projection, an
    A of no columns in the varlen-M GEMM) still store every tile: H = b1[e], A = SwiGLU(b1[e]), C = b[e] per row.
    Before session 91 they ran zero steps and left the outputs unwritten (NaN here, poisoned; the H100's pinned
    up-projection config is a step loop, so d = 0 gave a NaN scores' gradient on the GPU)."""
    t, n, e = 40, 24, 3
    p = random_problem(t, 16, n, e, bias=True, device=device, seed=91)
    _, routing = _topk_routing(p, 2, device)
    x, w1, w2 = p["x"][:, :0], p["w1"][:, :, :0], p["w2"][:, :0, :]  # (T, 0), (E, 2n, 0), (E, 0, n)
    base = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "FLATTEN": False}
    h_ref, a_ref = up_proj_ref(x, w1, p["b1"], routing)
    c_ref = varlen_m_gemm_ref(a_ref[:, :0], w2, p["b1"][:, :n], routing, transpose_b=False)
    assert h_ref.abs().amin() > 0  # the bias is what a wrong kernel would miss
    for cfg in ({**base, "PROGS_PER_SM": 0}, {**base, "PROGS_PER_SM": 1, "STEPS": True},
                {**base, "PROGS_PER_SM": 0, "STEPS": True}):
        h, a = up_proj(x, w1, p["b1"], routing, config=cfg)
        assert rel_err(h, h_ref) < 1e-6 and rel_err(a, a_ref) < 1e-6, cfg
        c = varlen_m_gemm(a[:, :0], w2, p["b1"][:, :n], routing, config=cfg, transpose_b=False)
        assert rel_err(c, c_ref) < 1e-6, cfg


def _dh_inputs(t, d, n, e, k, device, seed):
    """(problem, routing, H (R, 2n), row scores (R,), dO (T, d)) for the dH kernel's tests."""
    p = random_problem(t, d, n, e, device=device, seed=seed)
    router, routing = _topk_routing(p, k, device)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(routing.num_rows, 2 * n, generator=g).to(device)
    dout = torch.randn(t, d, generator=g).to(device)
    return p, routing, h, routing.row_scores(router.topk_scores.reshape(-1)), dout


def test_ds_independent_of_block_n(device):
    """dS partials live in fixed 16-channel chunks that every config writes in full and sums in one fixed
    order (a config that left rows unwritten, stale rows of another config, or a layout-dependent sum
    order would show as NaN or as differing bits)."""
    p, routing, h, s, dout = _dh_inputs(30, 32, 48, 4, 2, device, seed=12)
    base = {"BLOCK_M": 16, "BLOCK_K": 16, "PROGS_PER_SM": 0, "FLATTEN": False}
    ds16 = dh(dout, p["w2"], h, s, routing, config={**base, "BLOCK_N": 16})[2]
    ds32 = dh(dout, p["w2"], h, s, routing, config={**base, "BLOCK_N": 32})[2]
    ds64 = dh(dout, p["w2"], h, s, routing, config={**base, "BLOCK_N": 64})[2]  # two epilogue blocks
    assert not torch.isnan(ds16).any()
    # the interpreter's dot (numpy) may round differently per block shape: bitwise identity across
    # configurations is tested on the GPU (test_gpu_bitwise_across_tile_configs)
    assert rel_err(ds32, ds16) < 1e-6 and rel_err(ds64, ds16) < 1e-6
    assert rel_err(ds16, dh_ref(dout, p["w2"], h, s, routing)[2]) < 1e-5


def test_ds_partials_summed_in_the_documented_pair_order(device):
    """Each 16-channel dS partial is summed in one fixed pairwise order, ((x0 + x1) + (x2 + x3)) + ... (dh._sum16),
    the order the fixed-bits promise rests on. Here the products x_c = dA′_c · A_c are known exactly: dO and W2 hold
    small integers (dA′ = dO W2 exact in float32, whatever the dot's summation order) and the scores are 1 (A′ = A,
    as the kernel multiplied it). The partials are then the bits of that order written out in float32 below; any
    other pairing (x_i with x_{i+8}, planted by the mutation audit up18_) differs in many of them. On a GPU the
    compiler may fuse a product into an addition (a multiply-add): there within rounding."""
    t, d, n, e = 24, 32, 32, 3
    g = torch.Generator().manual_seed(180)
    routing = routing_from_topk(torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)]).to(device), e)
    r = routing.num_rows
    dout = torch.randint(-3, 4, (t, d), generator=g).float().to(device)
    w2 = torch.randint(-3, 4, (e, d, n), generator=g).float().to(device)
    h = torch.randn(r, 2 * n, generator=g).to(device)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "PROGS_PER_SM": 0, "FLATTEN": False}
    _, a_prime, parts = dh(dout, w2, h, torch.ones(r, device=device), routing, config=cfg, reduce_ds=False)
    off = routing.expert_offsets.tolist()
    dap = torch.cat([dout[routing.row_token[off[i]:off[i + 1]].long()].double() @ w2[i].double() for i in range(e)])
    x = (dap.float() * a_prime).reshape(r, n // 16, 16)  # each product rounded once, as in the kernel
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]  # neighbours first: (x0 + x1), (x2 + x3), ...
    want = x[..., 0].t()  # (chunks, R)
    assert parts.shape == want.shape and want.abs().amin() > 0
    if device.type == "cpu":
        assert torch.equal(parts, want)
    else:
        assert rel_err(parts, want) < 1e-6
    # the pairing matters at these values: x_i + x_{i+8} first gives other bits in some partials
    y = (dap.float() * a_prime).reshape(r, n // 16, 16)
    y = y[..., :8] + y[..., 8:]
    while y.shape[-1] > 1:
        y = y[..., 0::2] + y[..., 1::2]
    assert not torch.equal(y[..., 0].t(), want)


def test_dh_ds_pairs_ignores_reduce_ds(device):
    """With ``ds_pairs``, dS comes back summed and in pair order whatever ``reduce_ds`` says (dh's docstring: it is
    then ignored), in the kernel and in the twin: not the (chunks, R) partials in row order."""
    p, routing, h, _, dout = _dh_inputs(20, 16, 24, 3, 2, device, seed=181)
    pairs = torch.rand(routing.num_rows, generator=torch.Generator().manual_seed(181)).to(device) + 0.1
    for fn in (dh, dh_ref):
        want = fn(dout, p["w2"], h, pairs, routing, pair_order=True, ds_pairs=torch.float32)
        got = fn(dout, p["w2"], h, pairs, routing, pair_order=True, ds_pairs=torch.float32, reduce_ds=False)
        assert got[2].shape == (routing.num_rows,) and torch.equal(got[2], want[2]), fn.__name__
        assert want[2].abs().amin() > 0


@pytest.mark.parametrize("parts", [1, 3, 16])
@pytest.mark.parametrize("with_extra", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_score_grad(device, parts, with_extra, out_dtype):
    """The scores' gradient in pair order from dS partials: the partials summed in order 0..P-1, the bias term
    added after, each row's sum written to its pair (row_pair), and 0 for the pairs of padding rows (rows past
    expert_offsets[E]); the output is poisoned (NaN), so an unwritten pair fails, and the inputs are left as they
    were."""
    g = torch.Generator().manual_seed(parts * 7 + with_extra)
    r, real_rows = 1500, 1400  # 100 padding rows, more than one program of pairs
    part = torch.randn(parts, r, generator=g).to(device)
    part[:, real_rows:] = float("nan")  # what no kernel wrote: must never reach the output
    row_pair = torch.randperm(r, generator=g).to(device=device, dtype=torch.int32)
    offsets = torch.tensor([0, 600, 600, real_rows], device=device, dtype=torch.int32)  # an empty expert too
    extra = torch.randn(r, generator=g).to(device) if with_extra else None
    before = (part.clone(), row_pair.clone())
    got = score_grad(part, row_pair, offsets, extra, out_dtype)
    want = score_grad_ref(part, row_pair, offsets, extra, out_dtype)
    assert got.dtype == out_dtype and got.shape == (r,)
    assert want.dtype == out_dtype and want.shape == (r,)  # the twin casts too (dh's torch path takes its dtype)
    if out_dtype == torch.float32 or not interpreting():
        assert torch.equal(got, want)  # the same additions in the same order: the same bits
    else:  # the interpreter's float32 -> bfloat16 cast truncates where torch rounds to nearest even
        assert rel_err(got.float(), want.float()) < 1e-2
    # against an independent float64 sum, and the padding pairs exactly zero
    rows = torch.argsort(row_pair.long())  # the row of each pair
    ref = part.double().sum(0) + (extra.double() if with_extra else 0.0)
    real = rows < real_rows
    assert (got[~real] == 0).all() and real.sum() == real_rows
    assert rel_err(got[real].float(), ref[rows[real]].float()) < (1e-6 if out_dtype == torch.float32 else 5e-3)
    assert torch.equal(part.nan_to_num(), before[0].nan_to_num()) and torch.equal(row_pair, before[1])


def test_score_grad_rejects_bad_input(device):
    part = torch.randn(2, 8, device=device)
    rows = torch.arange(8, device=device, dtype=torch.int32)
    offsets = torch.tensor([0, 8], device=device, dtype=torch.int32)
    with pytest.raises(ValueError, match="ds_part"):
        score_grad(part.double(), rows, offsets)
    with pytest.raises(ValueError, match="row_pair"):
        score_grad(part, rows.long(), offsets)
    with pytest.raises(ValueError, match="row_pair"):
        score_grad(part, rows[:5], offsets)
    with pytest.raises(ValueError, match="extra"):
        score_grad(part, rows, offsets, torch.randn(5, device=device))
    # no partial sums (P = 0: the kernel reads row 0 of P regardless), an extra term not in float32 (the sum is float32)
    # and int64 offsets (the kernel's contract is int32 routing arrays)
    with pytest.raises(ValueError, match="ds_part"):
        score_grad(part[:0], rows, offsets)
    with pytest.raises(ValueError, match="extra"):
        score_grad(part, rows, offsets, torch.randn(8, device=device, dtype=torch.float64))
    with pytest.raises(ValueError, match="expert_offsets"):
        score_grad(part, rows, offsets.long())
    # no offsets at all (E + 1 = 0: the kernel would read expert_offsets[-1], before the tensor)
    with pytest.raises(ValueError, match="expert_offsets"):
        score_grad(part, rows, offsets[:0])
    # partials of the wrong rank (one row: no P axis; a trailing axis: R read from the wrong dimension) and 2-D offsets
    # (the kernel would read a (1, E+1) tensor's E = 0 and zero every pair)
    for bad in (part[0], part[:, :, None]):
        with pytest.raises(ValueError, match="ds_part"):
            score_grad(bad, rows, offsets)
    with pytest.raises(ValueError, match="expert_offsets"):
        score_grad(part, rows, offsets[None])


def test_score_grad_defaults_no_rows_and_device(device, monkeypatch):
    """out_dtype defaults to float32 (the kernel and its twin); R = 0 gives an empty output without a launch; a CPU
    ds_part outside the interpreter is refused (ValueError naming ds_part), not run."""
    g = torch.Generator().manual_seed(31)
    part = torch.randn(2, 40, generator=g).to(device)
    rows = torch.randperm(40, generator=g).to(device=device, dtype=torch.int32)
    offsets = torch.tensor([0, 25, 33], device=device, dtype=torch.int32)
    got, want = score_grad(part, rows, offsets), score_grad_ref(part, rows, offsets)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    by_row = torch.where(torch.arange(40, device=device) < 33, part[0] + part[1], 0.0)
    assert torch.equal(got[rows.long()], by_row)
    empty = score_grad(part[:, :0], rows[:0], torch.zeros(3, device=device, dtype=torch.int32))
    assert empty.shape == (0,) and empty.dtype == torch.float32
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="ds_part is on cpu"):
            score_grad(part, rows, offsets)


def test_score_grad_reads_no_row_pair_past_r(device):
    """The kernel's last program reaches past row R − 1 and must neither read row_pair there nor store through it:
    row_pair is a view of the first R entries of a longer buffer whose entry R names pair 0's position again (what
    an allocator may leave there), so a program that took row R for a row would overwrite that pair with 0."""
    g = torch.Generator().manual_seed(57)
    r = 1500  # rows 1024..2047 in the second program: row R = 1500 is one of them
    part = torch.randn(2, r, generator=g).to(device)
    perm = torch.randperm(r, generator=g)
    buf = torch.cat([perm, perm[:1]]).to(device=device, dtype=torch.int32)  # buf[R] = row 0's pair
    row_pair = buf[:r]
    assert row_pair.is_contiguous() and row_pair.data_ptr() == buf.data_ptr()  # the launcher passes it as is
    offsets = torch.tensor([0, 700, r], device=device, dtype=torch.int32)  # no padding rows: every pair is written
    got = score_grad(part, row_pair, offsets)
    want = (part[0] + part[1])[torch.argsort(perm)]  # the pair's row's sum, in pair order
    assert torch.equal(got, want.to(device))
    assert got[int(perm[0])] != 0


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("block_n", [32, 64, 128])
def test_dh_h_prefetch_matches(device, block_n, prefetch):
    """H_PREFETCH (1: each column block loads the next block's H; 2: also the first block before the main
    loop; masked past the tile and past n) gives the same bits as loading each block where it is used (0);
    n = 80 leaves the last tile's second block partly and its third/fourth block wholly past n."""
    p, routing, h, s, dout = _dh_inputs(33, 48, 80, 5, 2, device, seed=14)
    base = {"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": 16, "PROGS_PER_SM": 0, "FLATTEN": False}
    on = dh(dout, p["w2"], h, s, routing, config={**base, "H_PREFETCH": prefetch})
    off = dh(dout, p["w2"], h, s, routing, config={**base, "H_PREFETCH": 0})
    for got, want in zip(on, off):
        assert not torch.isnan(got).any()
        assert torch.equal(got, want)
    ref = dh_ref(dout, p["w2"], h, s, routing)
    for got, want in zip(on, ref):
        assert rel_err(got, want) < 1e-5


def _tma_problem(t, d, n, e, k, device, dtype=torch.float32, seed=21, bias=False):
    p = random_problem(t, d, n, e, device=device, dtype=dtype, seed=seed, bias=bias)
    router, routing = _topk_routing(p, k, device)
    s = routing.row_scores(router.topk_scores.reshape(-1)).float()
    dout = torch.randn(t, d, device=device, dtype=dtype)
    return p, routing, s, dout


def _kernel_outputs(p, routing, s, dout, layout, cfg):
    """Every varlen-M kernel that can read its weight through a TMA descriptor, under one config
    (A_TMA and C_SPLIT are the contiguous-row GEMMs' only, STEPS theirs and the up-projection's, GU_FUSED the
    up-projection's)."""
    up_cfg = {k: v for k, v in cfg.items() if k not in ("A_TMA", "C_SPLIT")}
    gemm_cfg = {k: v for k, v in cfg.items() if k != "GU_FUSED"}
    gather_cfg = {k: v for k, v in up_cfg.items() if k not in ("GU_FUSED", "STEPS")}
    h, a = up_proj(p["x"], p["w1"], p["b1"], routing, layout, config=up_cfg)
    y = down_proj(a, p["w2"], p["b2"], routing, config=gemm_cfg)
    dh_, ap_, ds = dh(dout, p["w2"], h, s, routing, layout, config=gather_cfg)
    dxt = varlen_m_gemm(dh_, p["w1"], None, routing, transpose_b=False, config=gemm_cfg)
    return {"h": h, "a": a, "y": y, "dh": dh_, "a_prime": ap_, "ds": ds, "dxt": dxt}


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("shape", [(37, 48, 40, 5, 2), (9, 20, 12, 3, 3)], ids=["aligned", "misaligned"])
def test_tma_weight_loads_match_pointer_loads(device, layout, shape):
    """W_TMA (weights through TMA descriptors, zero-filled past n and d), A_TMA, C_TMA (TMA stores of full
    tiles, masked stores for an expert's last tile; switched off under FLATTEN), dH's epilogue in column
    blocks, the up-projection's one-box gate/up load and one dot (GU_FUSED; n = 40 leaves the second
    64-channel box half past n, zero-filled in both its gate and up halves) give the pointer path's
    results, with the biases b1 and b2 (every path adds them, the persistent step loop too). The misaligned shape
    (fp16, rows of 40 bytes) cannot be described for TMA: the launcher falls back to pointer loads and stores."""
    t, d, n, e, k = shape
    dtype = torch.float32 if shape[1] == 48 else torch.float16
    p, routing, s, dout = _tma_problem(t, d, n, e, k, device, dtype, bias=True)
    base = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "PROGS_PER_SM": 0, "FLATTEN": False}
    plain = _kernel_outputs(p, routing, s, dout, layout, base)
    for extra in ({"W_TMA": True}, {"BLOCK_N": 64}, {"BLOCK_N": 128, "W_TMA": True},
                  {"A_TMA": True}, {"A_TMA": True, "W_TMA": True},
                  {"W_TMA": True, "A_TMA": True, "C_TMA": True, "PROGS_PER_SM": 1},
                  {"W_TMA": True, "C_TMA": True, "PROGS_PER_SM": 1, "FLATTEN": True},
                  {"STEPS": True, "PROGS_PER_SM": 1}, {"STEPS": True, "PROGS_PER_SM": 0, "BLOCK_N": 64},
                  {"STEPS": True, "PROGS_PER_SM": 1, "W_TMA": True, "A_TMA": True, "C_TMA": True},
                  {"STEPS": True, "PROGS_PER_SM": 1, "W_TMA": True, "A_TMA": True, "C_TMA": True, "C_SPLIT": 2},
                  {"W_TMA": True, "GU_FUSED": True}, {"W_TMA": True, "GU_FUSED": True, "BLOCK_N": 64},
                  {"W_TMA": True, "GU_FUSED": True, "C_TMA": True, "PROGS_PER_SM": 1}, {"GU_FUSED": True},
                  {"W_TMA": True, "GU_FUSED": True, "STEPS": True, "PROGS_PER_SM": 1},
                  {"W_TMA": True, "GU_FUSED": True, "C_TMA": True, "STEPS": True, "PROGS_PER_SM": 0, "BLOCK_N": 64}):
        got = _kernel_outputs(p, routing, s, dout, layout, {**base, **extra})
        for key, ref in plain.items():
            assert not torch.isnan(got[key]).any(), (extra, key)
            assert rel_err(got[key], ref) < 1e-6, (extra, key)
    h_ref, a_ref = up_proj_ref(p["x"], p["w1"], p["b1"], routing, layout)
    assert rel_err(plain["h"], h_ref) < _tol(dtype) and rel_err(plain["a"], a_ref) < _tol(dtype)
    assert rel_err(plain["y"], down_proj_ref(plain["a"], p["w2"], p["b2"], routing)) < _tol(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_gpu_tma_configs_bf16(layout):
    """The TMA / early-H variants compile natively and agree with the pointer path in bf16 at a
    realistic shape with n and d not multiples of the blocks."""
    p, routing, s, dout = _tma_problem(3000, 768, 320, 32, 4, "cuda", torch.bfloat16)
    base = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "PROGS_PER_SM": 0, "FLATTEN": False,
            "num_warps": 8, "num_stages": 3}
    plain = _kernel_outputs(p, routing, s, dout, layout, base)
    for extra in ({"W_TMA": True}, {"W_TMA": True, "BLOCK_M": 64, "num_warps": 4},
                  {"W_TMA": True, "PROGS_PER_SM": 1, "FLATTEN": True}, {"BLOCK_N": 256, "W_TMA": True, "num_stages": 2},
                  {"A_TMA": True, "W_TMA": True, "PROGS_PER_SM": 1, "FLATTEN": True},
                  {"A_TMA": True, "W_TMA": True, "C_TMA": True, "PROGS_PER_SM": 1, "num_stages": 4},
                  {"A_TMA": True, "W_TMA": True, "PROGS_PER_SM": 1, "STEPS": True, "num_stages": 4},
                  {"A_TMA": True, "W_TMA": True, "C_TMA": True, "C_SPLIT": 2, "PROGS_PER_SM": 1, "STEPS": True},
                  {"W_TMA": True, "GU_FUSED": True, "num_stages": 4},
                  {"W_TMA": True, "GU_FUSED": True, "C_TMA": True, "PROGS_PER_SM": 1, "num_stages": 4},
                  {"W_TMA": True, "GU_FUSED": True, "STEPS": True, "PROGS_PER_SM": 1, "num_stages": 4},
                  {"W_TMA": True, "GU_FUSED": True, "STEPS": True, "C_TMA": True, "PROGS_PER_SM": 1, "num_stages": 3},
                  {"W_TMA": True, "GU_FUSED": True, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}):
        got = _kernel_outputs(p, routing, s, dout, layout, {**base, **extra})
        for key, ref in plain.items():
            assert not torch.isnan(got[key]).any(), (extra, key)
            assert rel_err(got[key], ref) < 1e-2, (extra, key)


@pytest.mark.parametrize("progs_per_sm", [3, 4])
def test_varlen_k_steps_serpentine_load_order(progs_per_sm, monkeypatch):
    """The persistent step loop under SONICMOE_WGRAD_ORDER=load: one tile per expert (I, J within one block), seven
    experts of distinct whole-chunk counts over 3 or 4 programs, so that each program's steps depend on which
    experts the serpentine deal gives it (a count or a deal that disagreed would leave a tile unwritten or run one
    short). Equal bitwise to expert order and to the per-tile grid, and to the reference."""
    t, d, n = 96, 16, 8
    g = torch.Generator().manual_seed(5)
    counts = [5, 80, 17, 40, 0, 33, 64]
    e = len(counts)
    tok = torch.cat([torch.randperm(t, generator=g)[:c] for c in counts])
    exp = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    routing = routing_from_pairs(tok, exp, t, e)
    r = routing.num_rows
    x = torch.randn(t, d, generator=g)
    dh_ = torch.randn(r, 2 * n, generator=g)
    cfg = {"BLOCK_I": 16, "BLOCK_J": 16, "BLOCK_R": 16}
    ref = varlen_k_gemm_ref(dh_, x, routing, p_gather=False, q_gather=True, out_dtype=torch.float32)
    got = {}
    for order in ("load", "expert"):
        monkeypatch.setenv("SONICMOE_WGRAD_ORDER", order)
        got[order] = varlen_k_gemm(dh_, x, routing, p_gather=False, q_gather=True, out_dtype=torch.float32,
                                   config={**cfg, "STEPS": True, "PROGS_PER_SM": progs_per_sm})
    per_tile = varlen_k_gemm(dh_, x, routing, p_gather=False, q_gather=True, out_dtype=torch.float32, config=cfg)
    assert not torch.isnan(got["load"]).any() and rel_err(got["load"], ref) < 1e-5
    assert torch.equal(got["load"], got["expert"]) and torch.equal(got["load"], per_tile)


@pytest.mark.gpu
def test_gpu_varlen_k_steps_bitwise():
    """The weight gradients' persistent step loop compiles natively and gives bitwise the per-tile grid's
    dW1 and dW2 in bf16, at about 256 rows per expert (where it is the pinned default): top-k counts (ragged,
    with tails) and counts that are multiples of 128 (token rounding's), with an empty expert."""
    from sonicmoe.ops import weight_grad

    t, d, n, e, k = 4096, 768, 320, 64, 4
    p, topk_routing, _, dout = _tma_problem(t, d, n, e, k, "cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    counts = (torch.randint(0, 4, (e,), generator=g) * 128).tolist()
    counts[3] = 0
    tok = torch.cat([torch.randperm(t, generator=g)[:c] for c in counts])
    expert = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    rounded = routing_from_pairs(tok.cuda(), expert.cuda(), t, e)
    for routing in (topk_routing, rounded):
        r = routing.num_rows
        dh_ = torch.randn(r, 2 * n, device="cuda", dtype=torch.bfloat16)
        ap = torch.randn(r, n, device="cuda", dtype=torch.bfloat16)
        for pg, qg, pm, qm, cfg in ((True, False, dout, ap, weight_grad._GPU_DEFAULT_P_GATHERED),
                                    (False, True, dh_, p["x"], weight_grad._GPU_DEFAULT)):
            per_tile = varlen_k_gemm(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=torch.bfloat16, config=cfg)
            steps = varlen_k_gemm(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=torch.bfloat16,
                                  config={**cfg, **weight_grad._STEPS})
            assert torch.equal(per_tile, steps), (pg, routing is rounded)
            ref = varlen_k_gemm_ref(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=torch.float32)
            assert rel_err(steps, ref) < 1e-2


class _RecordingKernel:
    """Stands in for a JIT kernel: records the meta-parameters and descriptor arguments of a launch."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def run(**kwargs):
            self.calls.append({**kwargs, "_grid": grid})
        return run


class _TooBigAt128Kernel(_RecordingKernel):
    """A recording kernel whose BLOCK = 128 configs raise OutOfResources at launch, as a config too big for shared
    memory does on a GPU: the tuner must skip them."""

    def __getitem__(self, grid):
        from triton.runtime.errors import OutOfResources

        def run(**kwargs):
            if kwargs["BLOCK"] == 128:
                raise OutOfResources(300000, 232448, "shared memory")
            self.calls.append({**kwargs, "_grid": grid})
        return run


@pytest.mark.parametrize("dtype,block_k", [(torch.bfloat16, 64), (torch.float32, 32)])
@pytest.mark.parametrize("aligned", [True, False])
def test_launch_pinned_gpu_config(monkeypatch, dtype, block_k, aligned):
    """The pinned GPU path halves the reduction block for 4-byte operands (shared memory), and a W_TMA
    config falls back to pointer loads (descriptor arguments None) when no descriptor exists."""
    from sonicmoe.ops import common

    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setenv("SONICMOE_AUTOTUNE", "0")
    monkeypatch.setattr(common, "ensure_cuda_context", lambda device: None)
    w = torch.randn(2, 32, 64, dtype=dtype)
    desc = common.tma_descriptor(w) if aligned else None
    kern = _RecordingKernel()
    gpu_default = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "W_TMA": True, "num_warps": 8, "num_stages": 4}
    common.launch(kern, None, lambda meta: (1,), {"a_ptr": w, "w_desc": desc}, {"BLOCK_N": 16, "BLOCK_K": 16},
                  gpu_default, None, lambda meta: {"w_desc": (1, meta["BLOCK_N"], meta["BLOCK_K"])},
                  {"W_TMA": ("w_desc",)})
    (call,) = kern.calls
    assert call["BLOCK_K"] == block_k and call["BLOCK_M"] == 128
    assert call["num_stages"] == (4 if dtype == torch.bfloat16 else 3)
    assert call["W_TMA"] is aligned
    if aligned:
        assert call["w_desc"].block_shape == [1, 128, block_k]
    else:
        assert call["w_desc"] is None
    assert gpu_default["BLOCK_K"] == 64  # the module's default is not modified


def test_launch_runs_the_interpreters_pinned_config_as_given(monkeypatch):
    """Under the interpreter the pinned config runs as given, float32 operands included: sized_for_operands adapts
    the GPU's configs (shared memory), not the interpreter's, whose BLOCK_K and stages are not halved or capped."""
    from sonicmoe.ops import common

    monkeypatch.setattr(common, "interpreting", lambda: True)
    kern = _RecordingKernel()
    pinned = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 4}
    gpu_default = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
    common.launch(kern, None, lambda meta: (meta["BLOCK_K"],), {"a_ptr": torch.randn(4, 8)}, pinned, gpu_default)
    (call,) = kern.calls
    assert {k: call[k] for k in pinned} == pinned and call["_grid"] == (32,)


def test_tuner_rounds_choose_least_median(monkeypatch):
    """Autotuning times the configs in TUNE_ROUNDS round-robin rounds and keeps the least median: a config
    whose one slow round (a clock dip) would lose a single pass still wins, one that fails to fit is
    skipped, the launch after tuning uses the choice, and later calls of the key launch it without timing."""
    from sonicmoe.ops import common

    monkeypatch.setattr(common, "_ALL_TUNERS", [])  # the fake stays out of tuned_configs() elsewhere
    times = {16: [1.0, 1.0, 1.0], 32: [5.0, 0.5, 0.5], 64: [0.9, 0.9, 2.0]}

    kern = _TooBigAt128Kernel()
    order = []

    def fake_bench(call):
        call()
        block = kern.calls[-1]["BLOCK"]
        order.append(block)
        return times[block][sum(b == block for b in order) - 1]

    monkeypatch.setattr(common, "_bench_ms", fake_bench)
    space = [triton.Config({"BLOCK": b}, num_warps=4, num_stages=2) for b in (16, 32, 128, 64)]
    tuners = common.Tuners(kern, space, ["N"])
    args = {"x_ptr": torch.empty(4), "N": 4}
    tuners.run(frozenset(), lambda meta: (1,), args)
    assert order == [16, 32, 64] * common.TUNE_ROUNDS
    assert kern.calls[-1]["BLOCK"] == 32
    assert [c.kwargs for c in tuners.chosen()] == [{"BLOCK": 32}]
    assert common.tuned_configs()[type(kern).__name__][0]["config"]["BLOCK"] == 32
    n = len(kern.calls)
    tuners.run(frozenset(), lambda meta: (1,), args)
    assert len(kern.calls) == n + 1 and kern.calls[-1]["BLOCK"] == 32 and len(order) == 3 * common.TUNE_ROUNDS
    # inside CUDA graph capture a tuned key still launches; a new one raises, naming the remedy (timing there
    # invalidated the capture)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    tuners.run(frozenset(), lambda meta: (1,), args)
    assert len(kern.calls) == n + 2 and len(order) == 3 * common.TUNE_ROUNDS
    with pytest.raises(RuntimeError, match="capture.*once eagerly"):
        tuners.run(frozenset(), lambda meta: (1,), {"x_ptr": torch.empty(4), "N": 8})
    assert len(order) == 3 * common.TUNE_ROUNDS


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("gu_fused,c_tma", [(True, False), (True, True), (False, False), (False, True)])
def test_tuned_launch_drops_unused_descriptors(layout, gu_fused, c_tma, monkeypatch):
    """After tuning, a key's launches pass None for the TMA descriptors the chosen config does not read (the
    launcher would encode each one on every launch): the up-projection's gate/up box of the 4-D view of W1
    under GU_FUSED, else its separate gate and up boxes; the store descriptors only under C_TMA. The ones it
    reads get the config's block shapes (the 4-D box follows the gate/up layout)."""
    from sonicmoe.ops import common
    from sonicmoe.ops import up_proj as up_mod

    monkeypatch.setattr(common, "_ALL_TUNERS", [])  # the fake stays out of tuned_configs() in later tests

    w1 = torch.randn(3, 2 * 32, 64, dtype=torch.bfloat16)
    view = w1.view(3, 2, 32, 64) if layout == "concat" else w1.view(3, 32, 2, 64)
    out = torch.empty(40, 32, dtype=torch.bfloat16)
    descs = {"wg_desc": common.tma_descriptor(w1[:, :32]), "wu_desc": common.tma_descriptor(w1[:, 32:]),
             "wgu_desc": common.tma_descriptor(view), "hg_desc": common.tma_descriptor(out),
             "hu_desc": common.tma_descriptor(out), "ao_desc": common.tma_descriptor(out)}
    args = {"x_ptr": out, **descs, "N": 32, "CH_STRIDE": 1 if layout == "concat" else 2}
    kern = _RecordingKernel()
    tuners = common.autotuners(kern, [], ["N"], up_mod._desc_blocks)
    available = common.available_flags(up_mod._FLAG_DESCS, args)
    assert available == {"W_TMA", "C_TMA"}
    meta = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "W_TMA": True, "C_TMA": c_tma, "GU_FUSED": gu_fused}
    tuners._chosen[(available, 32, torch.bfloat16, "tma")] = triton.Config(meta)  # block shapes: from the launch
    tuners.run(available, lambda m: (1,), args, up_mod._FLAG_DESCS)
    (call,) = kern.calls
    read = {"wgu_desc"} if gu_fused else {"wg_desc", "wu_desc"}
    read |= {"hg_desc", "hu_desc", "ao_desc"} if c_tma else set()
    assert {name for name in descs if call[name] is not None} == read
    if gu_fused:
        box = [1, 2, 32, 16] if layout == "concat" else [1, 32, 2, 16]
        assert call["wgu_desc"].block_shape == box
    assert all(args[name] is descs[name] for name in descs)  # the caller's dict is not modified


def test_tuner_without_flag_descriptors_sizes_the_ones_that_exist(monkeypatch):
    """A tuned launch without ``flag_descs`` gives each descriptor that ``desc_blocks`` names its config's block
    shape (a list) and passes a missing one (None: a tensor the copy engine cannot address) on as None."""
    from sonicmoe.ops import common

    monkeypatch.setattr(common, "_ALL_TUNERS", [])
    desc = common.tma_descriptor(torch.randn(2, 32, 64))
    kern = _RecordingKernel()
    blocks = lambda meta: {"w_desc": (1, meta["BLOCK_N"], meta["BLOCK_K"]),
                           "c_desc": (meta["BLOCK_M"], meta["BLOCK_N"])}
    tuners = common.autotuners(kern, [], ["N"], blocks)
    tuners._chosen[(frozenset(), 32, "tma")] = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16})
    tuners.run(frozenset(), lambda m: (1,), {"w_desc": desc, "c_desc": None, "N": 32})
    (call,) = kern.calls
    assert call["w_desc"] is desc and desc.block_shape == [1, 32, 16] and call["c_desc"] is None


def test_tuner_refuses_a_space_where_nothing_fits(monkeypatch):
    """A tuning space none of whose configs fits raises a RuntimeError naming the kernel, with nothing timed or
    chosen (not a bare error from an empty minimum)."""
    from sonicmoe.ops import common

    monkeypatch.setattr(common, "_ALL_TUNERS", [])
    timed = []
    monkeypatch.setattr(common, "_bench_ms", lambda call: timed.append(call) or 1.0)
    space = [triton.Config({"BLOCK": 128}, num_warps=w, num_stages=2) for w in (4, 8)]
    tuners = common.Tuners(_TooBigAt128Kernel(), space, ["N"])
    with pytest.raises(RuntimeError, match="^_TooBigAt128Kernel: no config of the tuning space compiles"):
        tuners.run(frozenset(), lambda meta: (1,), {"x_ptr": torch.empty(4), "N": 4})
    assert timed == [] and tuners.chosen() == []


def test_tuner_times_by_do_bench_median(monkeypatch):
    """Each timing of the autotuner is do_bench's median over the tuner's warm-up and repetition windows (its mean,
    do_bench's default, lets one slow run decide)."""
    import triton.testing

    from sonicmoe.ops import common

    seen, ran = [], []

    def fake_do_bench(fn, **kwargs):
        seen.append(kwargs)
        fn()
        return 0.25

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    assert common._bench_ms(lambda: ran.append(1)) == 0.25
    assert ran == [1]
    assert seen == [{"warmup": common.TUNE_WARMUP_MS, "rep": common.TUNE_REP_MS, "return_mode": "median"}]


def test_tuned_configs_names_each_choice(monkeypatch):
    """tuned_configs() lists each autotuner choice under its kernel's name, with the key arguments, the
    tensors' dtypes, the GPU's tile family, the TMA flags available and the whole config; the choice is then
    launched directly."""
    from sonicmoe.ops import common

    monkeypatch.setattr(common, "_ALL_TUNERS", [])
    common.autotuners(_TooBigAt128Kernel(), [], ["N"])  # a kernel never tuned is not listed
    assert common.tuned_configs() == {}
    kern = _RecordingKernel()
    tuners = common.autotuners(kern, [], ["N", "D"])
    assert tuners.name == "_RecordingKernel"
    cfg = triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=3)
    key = (frozenset({"W_TMA"}), 256, 1536, torch.bfloat16, torch.int32, "tma")
    tuners._chosen[key] = cfg  # as the autotuner's first run of this key leaves it
    assert common.tuned_configs() == {"_RecordingKernel": [{
        "key": {"N": 256, "D": 1536}, "dtypes": ["bfloat16", "int32"], "tile_family": "tma", "tma_available": ["W_TMA"],
        "config": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}}]}
    assert tuners.chosen() == [cfg]
    x = torch.empty(2, dtype=torch.bfloat16)
    idx = torch.empty(2, dtype=torch.int32)
    tuners.run(frozenset({"W_TMA"}), lambda m: (1,), {"N": 256, "D": 1536, "x": x, "idx": idx})
    (call,) = kern.calls
    assert call["BLOCK_M"] == 64 and call["N"] == 256
    # the real kernels' tuners carry their kernels' names
    from sonicmoe.ops import up_proj as up_mod

    assert up_mod._tuned.name == "_up_proj_kernel"
    from sonicmoe.ops import dh as dh_mod

    assert dh_mod._tuned.name == "_dh_kernel"  # two triton.heuristics layers over the JIT function


def _record_pinned_launch(monkeypatch, module, kernel_name: str) -> _RecordingKernel:
    """Make ``module``'s launcher take the pinned GPU path on CPU (no interpreter, SONICMOE_AUTOTUNE=0, no CUDA
    context, 132 multiprocessors) and record its kernel's launches instead of running them."""
    from sonicmoe.ops import common

    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setenv("SONICMOE_AUTOTUNE", "0")
    monkeypatch.setattr(common, "ensure_cuda_context", lambda device: None)
    monkeypatch.setattr(common, "sm_count", lambda device: 132)
    monkeypatch.setattr(module, "check_device", lambda name, t: None)
    kern = _RecordingKernel()
    monkeypatch.setattr(module, kernel_name, kern)
    return kern


@pytest.mark.parametrize("rows_per_expert,steps", [(256, True), (384, True), (385, False), (512, False),
                                                    (1536, False)])
def test_varlen_k_pinned_schedule(monkeypatch, rows_per_expert, steps):
    """The pinned GPU config of the weight gradients runs the persistent step loop (one program per
    multiprocessor) when experts have at most common.FEW_ROWS_PER_EXPERT rows on average, and one program per
    tile otherwise; the choice needs no device sync (row counts are known on the host)."""
    from sonicmoe.ops import weight_grad

    kern = _record_pinned_launch(monkeypatch, weight_grad, "_varlen_k_kernel")
    e, i_dim, j_dim = 2, 2048, 4096
    r = rows_per_expert * e
    routing = routing_from_pairs(torch.arange(r), torch.arange(r) // rows_per_expert, r, e)
    dh_ = torch.empty(r, i_dim, dtype=torch.bfloat16)
    x = torch.empty(r, j_dim, dtype=torch.bfloat16)
    varlen_k_gemm(dh_, x, routing, p_gather=False, q_gather=True, out_dtype=torch.bfloat16)
    (call,) = kern.calls
    tiles = e * (i_dim // call["BLOCK_I"]) * (j_dim // call["BLOCK_J"])
    assert bool(call.get("STEPS")) is steps
    assert call["_grid"] == ((min(tiles, 132),) if steps else (tiles,))
    assert call["LOAD_ORDER"] is False and call["order_ptr"] is routing.expert_offsets  # index order: no order read


def test_varlen_k_pinned_tiles_follow_the_gathered_operand(monkeypatch):
    """The pinned per-tile GPU config of the weight gradients is 256 wide on the operand that is not gathered and 128
    on the gathered one: dW2 (P = dO gathered) 128 x 256 tiles in 7 stages, dW1 (Q = X gathered) 256 x 128 in 5."""
    from sonicmoe.ops import weight_grad

    kern = _record_pinned_launch(monkeypatch, weight_grad, "_varlen_k_kernel")
    e, rows_per_expert, i_dim, j_dim = 2, 1536, 1024, 2048
    r = rows_per_expert * e
    routing = routing_from_pairs(torch.arange(r), torch.arange(r) // rows_per_expert, r, e)
    p = torch.empty(r, i_dim, dtype=torch.bfloat16)
    q = torch.empty(r, j_dim, dtype=torch.bfloat16)
    varlen_k_gemm(p, q, routing, p_gather=True, q_gather=False, out_dtype=torch.bfloat16)
    varlen_k_gemm(p, q, routing, p_gather=False, q_gather=True, out_dtype=torch.bfloat16)
    dw2, dw1 = kern.calls
    assert (dw2["BLOCK_I"], dw2["BLOCK_J"], dw2["num_stages"]) == (128, 256, 7)
    assert (dw1["BLOCK_I"], dw1["BLOCK_J"], dw1["num_stages"]) == (256, 128, 5)
    assert not dw2.get("STEPS") and not dw1.get("STEPS")


@pytest.mark.parametrize("rows_per_expert,width,tma_stores",
                         [(1536, 1536, False), (385, 2048, False), (384, 1536, True), (2048, 4096, True)])
def test_varlen_m_pinned_config(monkeypatch, rows_per_expert, width, tma_stores):
    """The pinned GPU config of the contiguous-row grouped GEMM: the 4-stage step loop with pointer stores for
    many rows per expert and a narrow C, else the 3-stage one with TMA stores in column halves."""
    from sonicmoe.ops import grouped_gemm

    kern = _record_pinned_launch(monkeypatch, grouped_gemm, "_varlen_m_kernel")
    e, k = 2, 256
    r = rows_per_expert * e
    routing = routing_from_pairs(torch.arange(r), torch.arange(r) // rows_per_expert, r, e)
    a = torch.empty(r, k, dtype=torch.bfloat16)
    w2 = torch.empty(e, width, k, dtype=torch.bfloat16)
    down_proj(a, w2, None, routing)
    (call,) = kern.calls
    assert call["STEPS"] and call["PROGS_PER_SM"] == 1
    assert bool(call.get("C_TMA")) is tma_stores and call.get("C_SPLIT", 1) == (2 if tma_stores else 1)
    assert call["num_stages"] == (3 if tma_stores else 4)
    assert (call["c_desc"] is not None) is tma_stores
    # the descriptors' boxes: one expert's (BLOCK_N, BLOCK_K) block of W2 (E, m, k), C stored in C_SPLIT column
    # blocks (a box of the whole tile overran each half's store on a GPU)
    bm, bn, bk = call["BLOCK_M"], call["BLOCK_N"], call["BLOCK_K"]
    assert call["a_desc"].block_shape == [bm, bk] and call["b_desc"].block_shape == [1, bn, bk]
    if tma_stores:
        assert call["c_desc"].block_shape == [bm, bn // 2]


def test_varlen_m_env_config(monkeypatch):
    """SONICMOE_VARLEN_M_CONFIG pins the Triton kernel's config to an entry of TUNING_SPACE for every launch
    without an explicit config (the dX̃ form too), ``auto`` leaves the pinned/autotuned choice, and a value that
    is not an index of the space is refused by name."""
    from sonicmoe.ops import grouped_gemm

    kern = _record_pinned_launch(monkeypatch, grouped_gemm, "_varlen_m_kernel")
    e, k, m, rows = 2, 256, 2048, 1536
    routing = routing_from_pairs(torch.arange(rows * e), torch.arange(rows * e) // rows, rows * e, e)
    a = torch.empty(rows * e, k, dtype=torch.bfloat16)
    w1 = torch.empty(e, k, m, dtype=torch.bfloat16)
    monkeypatch.setenv("SONICMOE_VARLEN_M_CONFIG", "auto")
    varlen_m_gemm(a, w1, None, routing, transpose_b=False)
    assert kern.calls[-1]["num_stages"] == 4 and not kern.calls[-1]["FLATTEN"]  # the pinned default
    for i, cfg in enumerate(grouped_gemm.TUNING_SPACE):
        monkeypatch.setenv("SONICMOE_VARLEN_M_CONFIG", str(i))
        varlen_m_gemm(a, w1, None, routing, transpose_b=False)
        call = kern.calls[-1]
        assert {key: call[key] for key in cfg.kwargs} == cfg.kwargs, i
        assert (call["num_warps"], call["num_stages"]) == (cfg.num_warps, cfg.num_stages), i
        if cfg.kwargs.get("W_TMA"):  # the dX̃ form's W1 (E, k, m): a (BLOCK_K, BLOCK_N) box of one expert
            assert call["b_desc"].block_shape == [1, cfg.kwargs["BLOCK_K"], cfg.kwargs["BLOCK_N"]], i
    # "²" is a digit to str.isdigit (int() refuses it), so it needs the ASCII check to be refused by name; the message
    # names the last valid index
    last = len(grouped_gemm.TUNING_SPACE) - 1
    for bad in (str(last + 1), "-1", "cfg2", "", "\u00b2"):
        monkeypatch.setenv("SONICMOE_VARLEN_M_CONFIG", bad)
        with pytest.raises(ValueError, match=rf"^SONICMOE_VARLEN_M_CONFIG: expected 'auto' or an index 0\.\.{last} of "
                           rf"grouped_gemm\.TUNING_SPACE, got {re.escape(repr(bad))}$"):
            varlen_m_gemm(a, w1, None, routing, transpose_b=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_down_proj_launches_its_explicit_config(monkeypatch, dtype):
    """down_proj hands an explicit ``config`` (tuning sweeps) to the varlen-M launch, which uses it as is instead of the
    pinned GPU default (BLOCK_N 256, 4 stages here); float32 operands included (sized_for_operands adapts the pinned
    configs only: BLOCK_K 32 is not halved)."""
    from sonicmoe.ops import grouped_gemm

    kern = _record_pinned_launch(monkeypatch, grouped_gemm, "_varlen_m_kernel")
    e, k, width, rows = 2, 256, 1536, 1536
    routing = routing_from_pairs(torch.arange(rows * e), torch.arange(rows * e) // rows, rows * e, e)
    a = torch.empty(rows * e, k, dtype=dtype)
    w2 = torch.empty(e, width, k, dtype=dtype)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "PROGS_PER_SM": 0, "FLATTEN": False, "num_warps": 4,
           "num_stages": 2}
    down_proj(a, w2, None, routing, config=cfg)
    (call,) = kern.calls
    assert {key: call[key] for key in cfg} == cfg


def test_gather_sum_pinned_launch(monkeypatch):
    """The aggregation's pinned GPU launch: one program per (token block, column block) tile, UNROLL the mean slots
    per token rounded up to a power of two and capped by MAX_UNROLL or by SONICMOE_AGG_CONFIG's fourth part; the
    config rule is asked with the persistent grid of ``num_programs`` too (SLICE_CONFIG is for one program per
    tile only). The unroll and the grid's size leave the bits alone, so only the launch shows them."""
    from sonicmoe.ops import aggregation

    kern = _record_pinned_launch(monkeypatch, aggregation, "_gather_sum_kernel")
    monkeypatch.delenv("SONICMOE_AGG_CONFIG", raising=False)
    t, d = 6, 2560  # 3 column blocks of the default 1024
    for k, unroll in ((1, 1), (2, 2), (3, 4), (8, aggregation.MAX_UNROLL)):
        routing = routing_from_pairs(torch.arange(t).repeat_interleave(k), torch.arange(t * k) % 8, t, 8)
        gather_sum(torch.empty(t * k, d), routing, None)
        call = kern.calls[-1]
        assert (call["BLOCK_T"], call["BLOCK_D"]) == (1, 1024) and call["_grid"] == (t * 3,), k
        assert call["UNROLL"] == unroll, k
    # 7 rows over 6 tokens: 2 slots per token on average, rounded up
    routing = routing_from_pairs(torch.tensor([0, 0, 1, 2, 3, 4, 5]), torch.tensor([0, 1, 0, 0, 0, 0, 0]), t, 8)
    gather_sum(torch.empty(7, d), routing, None)
    assert kern.calls[-1]["UNROLL"] == 2
    routing = routing_from_pairs(torch.arange(t).repeat_interleave(8), torch.arange(t * 8) % 8, t, 8)
    monkeypatch.setenv("SONICMOE_AGG_CONFIG", "2:512:2:2")
    gather_sum(torch.empty(t * 8, d), routing, None)
    call = kern.calls[-1]
    assert (call["BLOCK_T"], call["BLOCK_D"], call["UNROLL"], call["_grid"]) == (2, 512, 2, (3 * 5,))
    monkeypatch.delenv("SONICMOE_AGG_CONFIG")
    # num_programs = 1: a persistent grid of that one program (not one program per tile)
    gather_sum(torch.empty(t * 8, d), routing, None, num_programs=1)
    assert kern.calls[-1]["_grid"] == (1,)
    asked = []

    def spy(d, on_gpu, progs_per_sm=0):
        asked.append(progs_per_sm)
        return None, aggregation.MAX_UNROLL

    monkeypatch.setattr(aggregation, "pinned_config", spy)
    gather_sum(torch.empty(t * 8, d), routing, None, num_programs=3)
    gather_sum(torch.empty(t * 8, d), routing, None, progs_per_sm=2)
    gather_sum(torch.empty(t * 8, d), routing, None)
    assert [bool(p) for p in asked] == [True, True, False]


@pytest.mark.parametrize("rows_per_expert,d,steps", [(256, 512, False), (384, 512, False), (385, 512, True),
                                                     (1536, 2048, True), (1536, 2112, False)])
def test_up_proj_pinned_config(monkeypatch, rows_per_expert, d, steps):
    """The up-projection's pinned GPU config runs the persistent step loop (one program per multiprocessor)
    when experts average more than common.FEW_ROWS_PER_EXPERT rows and d <= STEPS_MAX_D, one program per tile
    otherwise; the same tiles either way, chosen from host values (no device sync)."""
    from sonicmoe.ops import up_proj as up_mod

    kern = _record_pinned_launch(monkeypatch, up_mod, "_up_proj_kernel")
    e, n = 2, 256
    r = rows_per_expert * e
    routing = routing_from_pairs(torch.arange(r), torch.arange(r) // rows_per_expert, r, e)
    up_proj(torch.empty(r, d, dtype=torch.bfloat16), torch.empty(e, 2 * n, d, dtype=torch.bfloat16), None, routing)
    (call,) = kern.calls
    tiles = (-(-r // 128) + e) * (n // 128)  # the grid bound: cdiv(R, BLOCK_M) + E M-tiles
    assert bool(call.get("STEPS")) is steps
    assert call["_grid"] == ((min(tiles, 132),) if steps else (tiles,))
    assert (call["BLOCK_M"], call["BLOCK_N"], call["num_stages"], call["GU_FUSED"]) == (128, 128, 4, True)


@pytest.mark.parametrize("flatten", [False, True])
def test_launch_switches_flags_off_one_by_one(monkeypatch, flatten):
    """A TMA flag whose descriptor is missing falls back alone: the other flags stay on, the missing and
    unused descriptors are passed as None; C_TMA is never combined with FLATTEN (a Triton 3.6 compile
    failure)."""
    from sonicmoe.ops import common

    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setenv("SONICMOE_AUTOTUNE", "0")
    monkeypatch.setattr(common, "ensure_cuda_context", lambda device: None)
    w = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    c = torch.randn(64, 32, dtype=torch.bfloat16)
    args = {"a_ptr": w, "w_desc": common.tma_descriptor(w), "a_desc": None, "c_desc": common.tma_descriptor(c)}
    kern = _RecordingKernel()
    gpu_default = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64, "W_TMA": True, "A_TMA": True, "C_TMA": True,
                   "FLATTEN": flatten, "num_warps": 4, "num_stages": 3}
    blocks = lambda meta: {"w_desc": (1, meta["BLOCK_N"], meta["BLOCK_K"]), "a_desc": (meta["BLOCK_M"], 64),
                           "c_desc": (meta["BLOCK_M"], meta["BLOCK_N"])}
    common.launch(kern, None, lambda meta: (1,), args, {}, gpu_default, None, blocks,
                  {"W_TMA": ("w_desc",), "A_TMA": ("a_desc",), "C_TMA": ("c_desc",)})
    (call,) = kern.calls
    assert call["W_TMA"] is True and call["A_TMA"] is False and call["C_TMA"] is (not flatten)
    assert call["a_desc"] is None and (call["c_desc"] is None) is flatten
    assert call["w_desc"].block_shape == [1, 32, 64]


def test_host_cdiv_and_next_pow2_match_triton():
    """The plain-Python host helpers give triton.cdiv's and triton.next_power_of_2's values (next_pow2 also maps
    x <= 0 to 1)."""
    for a in range(0, 300):
        assert next_pow2(a) == triton.next_power_of_2(max(a, 1))
        for b in (1, 3, 16, 128):
            assert cdiv(a, b) == triton.cdiv(a, b)
    assert next_pow2(-5) == 1 and next_pow2(2**40 + 1) == 2**41


def test_varlen_m_gemm_of_a_single_row(device):
    """R = 1 (one token routed to the middle one of three experts): the varlen-M GEMM still launches (poisoned output:
    a skipped launch leaves NaN) and gives that row's product with its expert's weight, both forms, the bias included,
    against a float64 product."""
    e, k_dim, m = 3, 24, 40
    g = torch.Generator().manual_seed(131)
    routing = routing_from_pairs(torch.zeros(1, dtype=torch.long, device=device),
                                 torch.ones(1, dtype=torch.long, device=device), 1, e)
    assert routing.num_rows == 1
    a = torch.randn(1, k_dim, generator=g).to(device)
    w = torch.randn(e, m, k_dim, generator=g).to(device)
    bias = torch.randn(e, m, generator=g).to(device)
    want = a.double() @ w[1].double().t() + bias[1].double()
    got = varlen_m_gemm(a, w, bias, routing, transpose_b=True)
    assert got.shape == (1, m) and rel_err(got, want) < 1e-6
    got = varlen_m_gemm(a, w.transpose(1, 2).contiguous(), None, routing, transpose_b=False)
    assert got.shape == (1, m) and rel_err(got, want - bias[1].double()) < 1e-6


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the Inf rows' own experts
def test_varlen_k_tail_masks_the_rows_past_the_expert(device):
    """The tail chunk's row mask holds where the columns need none (I and J multiples of the block: EVEN_I / EVEN_J).
    Experts of 20, 13 and 16 rows (16-row chunks): experts 0 and 1 end in a tail whose masked rows are the next
    expert's rows in the contiguous operand and token 0's row in the gathered one (the masked token index reads row 0).
    An Inf there reaches no other expert's gradient: in A′ (dW2's Q, contiguous) and dH (dW1's P) at expert 1's first
    row, expert 0 keeps the reference's values; in dO (dW2's P, gathered) and X (dW1's Q, gathered) at token 0, which
    only expert 2 (no tail) routes, experts 0 and 1 keep theirs (a row loaded unmasked times the other operand's
    zeroed row is Inf·0 = NaN)."""
    t, d, n, e = 24, 32, 16, 3
    g = torch.Generator().manual_seed(137)
    counts = [20, 13, 16]
    tok = torch.cat([torch.randperm(t - 1, generator=g)[:c] + 1 for c in counts[:2]]
                    + [torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(t - 1, generator=g)[:15] + 1])])
    exp = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    routing = routing_from_pairs(tok.to(device), exp.to(device), t, e)
    r = routing.num_rows
    first1 = routing.expert_offsets[1].item()
    x, dout = (torch.randn(t, c, generator=g).to(device) for c in (d, d))
    ap, dh_ = (torch.randn(r, c, generator=g).to(device) for c in (n, 2 * n))
    cfgs = ({"BLOCK_I": 16, "BLOCK_J": 16, "BLOCK_R": 16}, {"BLOCK_I": 16, "BLOCK_J": 16, "BLOCK_R": 16, **_STEPS3})
    for bad_row, which, clean in ((first1, (ap, dh_), [0]), (0, (dout, x), [0, 1])):
        for v in which:
            v[bad_row] = float("inf")
        for pg, qg, pm, qm in ((True, False, dout, ap), (False, True, dh_, x)):
            ref = varlen_k_gemm_ref(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=torch.float32)
            for cfg in cfgs:
                got = varlen_k_gemm(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=torch.float32, config=cfg)
                assert rel_err(got[clean], ref[clean]) < 1e-5, (bad_row, pg, cfg)
        for v in which:
            v[bad_row] = torch.randn(v.shape[1], generator=g).to(device)


def test_varlen_m_grid_holds_every_tile_of_ragged_experts(device):
    """The varlen-M grid's M-tiles cover Σ_e cdiv(T_e, BLOCK_M), which exceeds cdiv(R, BLOCK_M) by up to E when every
    expert ends in a partial tile: 3 experts of 17 rows (6 tiles of the interpreter's BLOCK_M = 16 against
    cdiv(51, 16) = 4). The up-projection, the varlen-M GEMM and dH give every row (poisoned outputs: a tile no
    program ran is NaN) and their twins' values."""
    from sonicmoe.ops.common import max_m_tiles

    t, d, n, e, per = 51, 16, 16, 3, 17
    assert max_m_tiles(t, e, 16) >= e * cdiv(per, 16) > cdiv(t, 16)
    g = torch.Generator().manual_seed(24)
    routing = routing_from_pairs(torch.arange(t, device=device), (torch.arange(t) // per).to(device), t, e)
    x = torch.randn(t, d, generator=g).to(device)
    w1 = (torch.randn(e, 2 * n, d, generator=g) * d ** -0.5).to(device)
    w2 = (torch.randn(e, d, n, generator=g) * n ** -0.5).to(device)
    h = torch.randn(t, 2 * n, generator=g).to(device)
    s = (torch.rand(t, generator=g) + 0.1).to(device)
    dout = torch.randn(t, d, generator=g).to(device)
    for got, want in zip(up_proj(x, w1, None, routing), up_proj_ref(x, w1, None, routing)):
        assert rel_err(got, want) < 1e-5
    assert rel_err(varlen_m_gemm(h, w1, None, routing, transpose_b=False),
                   varlen_m_gemm_ref(h, w1, None, routing, transpose_b=False)) < 1e-5
    for got, want in zip(dh(dout, w2, h, s, routing), dh_ref(dout, w2, h, s, routing)):
        assert rel_err(got, want) < 1e-5


def test_sized_for_operands_floors_and_stages():
    """The pinned GPU configs for 4-byte operands: BLOCK_K and BLOCK_R halved but never below 16 (the smallest
    tl.dot), at most 3 stages (never raised); 2-byte operands keep the config; the input is not modified."""
    from sonicmoe.ops.common import sized_for_operands

    meta = {"BLOCK_M": 128, "BLOCK_K": 16, "BLOCK_R": 64, "num_stages": 5}
    assert sized_for_operands(meta, 4) == {"BLOCK_M": 128, "BLOCK_K": 16, "BLOCK_R": 32, "num_stages": 3}
    assert sized_for_operands({"BLOCK_K": 32, "num_stages": 2}, 4) == {"BLOCK_K": 16, "num_stages": 2}
    assert sized_for_operands(meta, 2) == meta and meta["BLOCK_K"] == 16 and meta["num_stages"] == 5


def test_dot_precision_exact_for_float32():
    """float32 operands ask the kernels' tl.dot for exact float32 products ("ieee": tf32 would round them to 10-bit
    mantissas on a GPU; the interpreter ignores the flag, so no CPU kernel result shows it); 16-bit ones the tensor
    cores ("tf32", which their products are exact in)."""
    from sonicmoe.ops.common import dot_precision

    assert dot_precision(torch.float32) == "ieee"
    assert dot_precision(torch.bfloat16) == dot_precision(torch.float16) == "tf32"


def test_autotuning_never_under_the_interpreter(monkeypatch):
    """SONICMOE_AUTOTUNE=1 autotunes on a GPU only: under the interpreter (passed in, or read by autotune_enabled
    itself) the pinned config runs, since timing needs CUDA events."""
    from sonicmoe.ops import common

    monkeypatch.setenv("SONICMOE_AUTOTUNE", "1")
    assert common.autotune_enabled(False) is True and common.autotune_enabled(True) is False
    for interp in (True, False):
        monkeypatch.setattr(common, "interpreting", lambda interp=interp: interp)
        assert common.autotune_enabled() is (not interp)
    monkeypatch.setenv("SONICMOE_AUTOTUNE", "0")
    assert common.autotune_enabled() is False
    monkeypatch.delenv("SONICMOE_AUTOTUNE")
    assert common.autotune_enabled(False) is True  # unset: on by default on a GPU


def test_tile_config_flags_only_on_varlen_m_configs():
    """tile_config adds the persistence, FLATTEN and W_TMA meta-parameters to configs named (BLOCK_M, BLOCK_N,
    BLOCK_K) only; a config of other block names (the varlen-K GEMM's) holds its blocks and its extras alone (its
    kernel takes no FLATTEN nor W_TMA)."""
    from sonicmoe.ops import weight_grad
    from sonicmoe.ops.common import tile_config

    cfg = tile_config(64, 128, 32, 4, 3, pps=2, flatten=True, tma=True, C_TMA=True)
    assert cfg.kwargs == {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "PROGS_PER_SM": 2, "FLATTEN": True,
                          "W_TMA": True, "C_TMA": True}
    assert (cfg.num_warps, cfg.num_stages) == (4, 3)
    cfg = tile_config(128, 64, 32, 8, 4, names=("BLOCK_I", "BLOCK_J", "BLOCK_R"), P_TMA=True)
    assert cfg.kwargs == {"BLOCK_I": 128, "BLOCK_J": 64, "BLOCK_R": 32, "P_TMA": True}
    assert (cfg.num_warps, cfg.num_stages) == (8, 4)
    for cfg in weight_grad.PORTABLE_SPACE + weight_grad.TUNING_SPACE:
        assert not {"FLATTEN", "W_TMA"} & set(cfg.kwargs), cfg


def test_tma_descriptor_only_where_the_copy_engine_can_address():
    """tma_descriptor describes a view whose base and leading strides are 16-byte aligned (in bytes, not elements)
    and whose inner stride is 1, with the smallest valid box; else (and for an empty tensor) None."""
    from sonicmoe.ops.common import tma_descriptor

    g = torch.Generator().manual_seed(41)
    w = torch.randn(2, 8, 12, generator=g)  # strides (96, 12, 1): 48 and 384 bytes
    desc = tma_descriptor(w)
    assert desc is not None and desc.base is w and desc.shape == [2, 8, 12] and desc.strides == [96, 12, 1]
    assert desc.block_shape == [1, 1, 4] and desc.padding == "zero"
    assert tma_descriptor(torch.randn(2, 8, 16, generator=g).half()).block_shape == [1, 1, 8]
    assert tma_descriptor(w.to(torch.bfloat16)) is None  # a 24-byte row stride
    wide = torch.randn(8, 32, generator=g)
    assert tma_descriptor(wide) is not None
    assert tma_descriptor(wide[:, ::2]) is None  # inner stride 2; the row stride (128 bytes) aligned
    assert tma_descriptor(torch.randn(65, generator=g)[1:].view(8, 8)) is None  # base 4 bytes past alignment
    assert tma_descriptor(torch.randn(66, generator=g)[2:].view(8, 8)) is None  # 8 bytes past: not 16-aligned
    assert tma_descriptor(torch.empty(0, 8)) is None


def test_available_flags_need_every_descriptor_and_restrict_drops_the_rest():
    """A TMA flag is available only when all of its descriptors exist; restrict_config switches off the flags that are
    not available, removes those the kernel does not take (not in ``known``), keeps the rest and copies ``meta``."""
    from sonicmoe.ops.common import available_flags, restrict_config

    desc = object()
    flag_descs = {"W_TMA": ("wg_desc", "wu_desc"), "C_TMA": ("c_desc",)}
    assert available_flags(flag_descs, {"wg_desc": desc, "wu_desc": None, "c_desc": desc}) == {"C_TMA"}
    assert available_flags(flag_descs, {"wg_desc": desc, "wu_desc": desc}) == {"W_TMA"}
    assert available_flags(flag_descs, {}) == frozenset()
    meta = {"BLOCK_M": 64, "W_TMA": True, "C_TMA": True, "P_TMA": True, "Q_TMA": False, "FLATTEN": False}
    got = restrict_config(meta, frozenset({"C_TMA", "P_TMA"}), known=("W_TMA", "C_TMA"))
    assert got == {"BLOCK_M": 64, "W_TMA": False, "C_TMA": True, "FLATTEN": False}
    assert meta["W_TMA"] is True and "P_TMA" in meta
    # a flag the config does not set stays unset (not added as False, which a kernel without it would refuse)
    assert restrict_config({"BLOCK_M": 64}, frozenset()) == {"BLOCK_M": 64}
    assert restrict_config({"BLOCK_M": 64, "C_TMA": True}, frozenset({"C_TMA"}), known=("W_TMA", "C_TMA")) == {
        "BLOCK_M": 64, "C_TMA": True}


def test_tuner_launches_a_lone_config_untimed(monkeypatch):
    """A space in which one config compiles (the other does not fit) needs no timing: it is chosen and launched
    without a single _bench_ms call."""
    from sonicmoe.ops import common

    monkeypatch.setattr(common, "_ALL_TUNERS", [])

    timed = []
    monkeypatch.setattr(common, "_bench_ms", lambda call: timed.append(call) or 1.0)
    kern = _TooBigAt128Kernel()
    space = [triton.Config({"BLOCK": b}, num_warps=4, num_stages=2) for b in (128, 32)]
    tuners = common.Tuners(kern, space, ["N"])
    tuners.run(frozenset(), lambda meta: (1,), {"x_ptr": torch.empty(4), "N": 4})
    assert timed == [] and [c.kwargs for c in tuners.chosen()] == [{"BLOCK": 32}]
    assert [c["BLOCK"] for c in kern.calls] == [32, 32]  # the compile launch, then the call's


def test_operand_bytes_from_the_first_floating_point_tensor(monkeypatch):
    """The pinned GPU config is sized by the operands' element size: that of the first floating-point tensor argument,
    past integer ones (a routing array before the operands must not halve a 2-byte config's BLOCK_K)."""
    from sonicmoe.ops import common

    offsets = torch.zeros(5, dtype=torch.int32)
    assert common._operand_bytes({"offsets_ptr": offsets, "a_ptr": torch.zeros(2, dtype=torch.float16)}) == 2
    assert common._operand_bytes({"idx": offsets.long(), "N": 3, "a_ptr": torch.zeros(2)}) == 4
    assert common._operand_bytes({"N": 3, "idx": offsets}) == 2
    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setenv("SONICMOE_AUTOTUNE", "0")
    kern = _RecordingKernel()
    gpu_default = {"BLOCK_M": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
    args = {"offsets_ptr": offsets, "a_ptr": torch.zeros(2, 8, dtype=torch.float16)}
    common.launch(kern, None, lambda meta: (1,), args, {}, gpu_default)
    (call,) = kern.calls
    assert (call["BLOCK_K"], call["num_stages"]) == (64, 4)


def test_check_device_names_the_tensor_and_refuses_other_devices(monkeypatch):
    """check_device passes CUDA tensors and, under the interpreter only, CPU tensors; anything else (a meta tensor
    under the interpreter, a CPU tensor without it) raises a ValueError naming the argument and its device."""
    from sonicmoe.ops import common

    monkeypatch.setattr(common, "interpreting", lambda: True)
    common.check_device("x", torch.zeros(1))
    with pytest.raises(ValueError, match="w1 is on meta; the triton backend needs CUDA tensors"):
        common.check_device("w1", torch.zeros(1, device="meta"))
    monkeypatch.setattr(common, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="x is on cpu; the triton backend"):
        common.check_device("x", torch.zeros(1))


def test_dh_and_varlen_k_name_their_operand_off_the_device(monkeypatch):
    """dH and the varlen-K GEMM on CPU tensors outside the interpreter refuse before any launch, naming the argument
    the caller passed (dout; p, the first operand) in the error."""
    from sonicmoe.ops import common

    monkeypatch.setattr(common, "interpreting", lambda: False)
    p, routing, h, s, dout = _dh_inputs(9, 16, 16, 3, 2, torch.device("cpu"), seed=4)
    with pytest.raises(ValueError, match="^dout is on cpu; the triton backend"):
        dh(dout, p["w2"], h, s, routing)
    with pytest.raises(ValueError, match="^p is on cpu; the triton backend"):
        varlen_k_gemm(dout, h, routing, p_gather=True, q_gather=False, out_dtype=torch.float32)


def test_up_proj_names_its_operand_off_the_device(monkeypatch):
    """The up-projection refuses operands off the device before any launch, naming the one at fault: x on the CPU
    outside the interpreter, w1 on the meta device under it (x on the CPU is then accepted)."""
    from sonicmoe.ops import common

    p = random_problem(9, 16, 16, 3, device="cpu", seed=4)
    _, routing = _topk_routing(p, 2, torch.device("cpu"))
    monkeypatch.setattr(common, "interpreting", lambda: True)
    with pytest.raises(ValueError, match="^w1 is on meta; the triton backend"):
        up_proj(p["x"], p["w1"].to("meta"), None, routing)
    monkeypatch.setattr(common, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="^x is on cpu; the triton backend"):
        up_proj(p["x"], p["w1"], None, routing)


def test_varlen_m_grid_counts_m_and_n_tiles(monkeypatch):
    """The varlen-M grid: (cdiv(R, BLOCK_M) + E) M-tiles times cdiv(n, BLOCK_N) N-tiles, one program each, or for a
    persistent config PROGS_PER_SM programs per multiprocessor (never more than the tiles)."""
    from sonicmoe.ops import common

    monkeypatch.setattr(common, "sm_count", lambda device: 4)
    grid = common.varlen_m_grid(100, 3, 200, torch.device("cpu"))
    tiles = (cdiv(100, 64) + 3) * cdiv(200, 32)
    assert tiles == 35
    assert grid({"BLOCK_M": 64, "BLOCK_N": 32}) == (tiles,)
    assert grid({"BLOCK_M": 64, "BLOCK_N": 32, "PROGS_PER_SM": 2}) == (8,)
    assert grid({"BLOCK_M": 64, "BLOCK_N": 32, "PROGS_PER_SM": 16}) == (tiles,)
    assert grid({"BLOCK_M": 16, "BLOCK_N": 128}) == ((cdiv(100, 16) + 3) * 2,)


def test_pdl_from_compute_capability_9(monkeypatch):
    """Programmatic dependent launch on CUDA GPUs of compute capability 9.0 (Hopper) and newer, not before (the
    capability faked; the result cached per device)."""
    from sonicmoe.ops import common

    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.delenv("SONICMOE_PDL", raising=False)
    for cap, want in (((8, 9), False), ((9, 0), True), ((10, 0), True), ((12, 0), True)):
        monkeypatch.setattr(common, "_PDL_OK", {})
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx, cap=cap: cap)
        assert common.pdl_enabled(torch.device("cuda", 0)) is want, cap


@pytest.mark.gpu
def test_gpu_bf16_layer_with_zero_width_hidden():
    """d = 0 (a degenerate width check_expert_inputs accepts) in bf16 on the GPU at shapes whose Gluon dispatch rules
    admit the rest (n = 128, 1024 rows per expert): the Gluon launchers are skipped (d % 64 == 0 held at d = 0 and
    their TMA descriptors asserted "shape must be positive"); O is (T, 0), the weight gradients have their (empty)
    shapes and the scores' gradient is zero."""
    e, n, t = 4, 128, 4096
    x = torch.randn(t, 0, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = torch.randn(e, 2 * n, 0, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(e, 0, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    routing = routing_from_topk(torch.arange(t, device="cuda").remainder(e)[:, None], e)
    scores = torch.rand(t, device="cuda", requires_grad=True)
    out = sonicmoe.experts(x, w1, w2, routing, scores, backend="triton")
    assert out.shape == (t, 0)
    out.sum().backward()
    assert w1.grad.shape == w1.shape and w2.grad.shape == w2.shape and not scores.grad.any()


def _space_configs(*configs) -> list[dict]:
    """The configs (triton.Configs or dicts) once each by meta-parameters (the interpreter ignores warps and stages),
    each pinned GPU dict also as launch() sizes it for float32 operands."""
    from sonicmoe.ops.common import config_dict, sized_for_operands

    out, seen = [], set()
    for cfg in configs:
        cfg = cfg if isinstance(cfg, dict) else config_dict(cfg)
        for c in (cfg, sized_for_operands(cfg, 4)):
            key = tuple(sorted((k, v) for k, v in c.items() if k not in ("num_warps", "num_stages")))
            if key not in seen:
                seen.add(key)
                out.append(c)
    return out


def test_every_tuning_space_config_at_edge_shapes(device, monkeypatch):
    """Autotuning may pick any config of a kernel's tuning space, and the GPU pins its defaults (the step loop that
    stored nothing at d = 0 in session 91 was one): every config of each op's TUNING_SPACE and every pinned GPU
    default (as given, TMA flags included: descriptors the tensors allow are used, the interpreter runs them on CPU,
    and flags whose descriptors do not exist fall back), three programs per persistent grid, on a padded routing
    with the first and last experts empty, one expert with more rows than a 128-row tile, d and n not tile
    multiples, and a zero-width reduction (d = 0, k = 0); outputs NaN before the kernels write them: within 1e-5 of
    the float32 twins on the real rows. On a GPU a space config whose float32 tiles exceed shared memory is skipped,
    as the tuner skips it (the space is sized for 2-byte operands; session 94's H100 run: 294912 bytes against
    232448); every pinned default as launch() sizes it for float32 must fit, and every op runs some config."""
    from triton.runtime.errors import OutOfResources

    from sonicmoe.ops import aggregation, common, grouped_gemm, weight_grad
    from sonicmoe.ops import dh as dh_mod
    from sonicmoe.ops import up_proj as up_mod

    ran, too_big = set(), []

    def fits(op, fn, *args, config, **kwargs):
        """fn(*args, config=config, **kwargs), or None where config does not fit in a GPU's shared memory (never under
        the interpreter)."""
        try:
            out = fn(*args, config=config, **kwargs)
        except OutOfResources:
            if device.type != "cuda":
                raise
            too_big.append((op, config))
            return None
        ran.add(op)
        return out

    monkeypatch.setattr(common, "sm_count", lambda device: 3)
    t, e, n = 140, 6, 72
    tok = [*range(t), *range(0, t, 3), *range(1, t, 7)]
    exp = [1] * t + [2 + i % 3 for i in range(len(tok) - t)]  # expert 1: every token; 0 and e - 1: none
    tok, exp = torch.tensor(tok + [t] * 3), torch.tensor(exp + [e] * 3)  # three padding pairs
    perm = torch.randperm(len(tok), generator=torch.Generator().manual_seed(5))
    routing = routing_from_pairs(tok[perm].to(device), exp[perm].to(device), t, e, padding=True)
    real = int(routing.expert_offsets[-1])
    r = routing.num_rows
    assert r == real + 3 and routing.expert_counts()[0] == 0 and routing.expert_counts()[-1] == 0
    g = torch.Generator().manual_seed(6)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device)

    def close(got, want):
        return rel_err(got[:real], want[:real]) < 1e-5

    for d in (0, 132):
        x, w1, b1 = rnd(t, d), rnd(e, 2 * n, d) / max(d, 1) ** 0.5, rnd(e, 2 * n)
        for cfg in _space_configs(*up_mod.TUNING_SPACE, up_mod._GPU_DEFAULT, up_mod._GPU_DEFAULT_STEPS):
            got = fits("up", up_mod.up_proj, x, w1, b1, routing, config=cfg)
            h_ref, a_ref = up_mod.up_proj_ref(x, w1, b1, routing)
            assert got is None or (close(got[0], h_ref) and close(got[1], a_ref)), (d, cfg)
        dout, w2, hh, s = rnd(t, d), rnd(e, d, n) / n**0.5, rnd(r, 2 * n), torch.rand(r, generator=g).to(device)
        for cfg in _space_configs(*dh_mod.TUNING_SPACE, dh_mod._GPU_DEFAULT):
            got = fits("dh", dh_mod.dh, dout, w2, hh, s, routing, config=cfg)
            want = dh_mod.dh_ref(dout, w2, hh, s, routing)
            assert got is None or all(close(x1, x2) for x1, x2 in zip(got, want)), (d, cfg)
    for k, m in ((0, n), (n, 132)):
        for transpose_b in (True, False):
            a, b = rnd(r, k), rnd(*((e, m, k) if transpose_b else (e, k, m))) / max(k, 1) ** 0.5
            bias = rnd(e, m)
            want = grouped_gemm.varlen_m_gemm_ref(a, b, bias, routing, transpose_b=transpose_b)
            for cfg in _space_configs(*grouped_gemm.TUNING_SPACE, grouped_gemm._GPU_DEFAULT,
                                      grouped_gemm._GPU_DEFAULT_TMA_STORES):
                got = fits("gg", grouped_gemm.varlen_m_gemm, a, b, bias, routing, transpose_b=transpose_b,
                           config=cfg)
                assert got is None or close(got, want), (k, m, transpose_b, cfg)
    for pg, qg, pm, qm in ((True, False, rnd(t, 132), rnd(r, n)), (False, True, rnd(r, 2 * n), rnd(t, 132))):
        want = weight_grad.varlen_k_gemm_ref(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=torch.float32)
        pinned = (weight_grad._GPU_DEFAULT, weight_grad._GPU_DEFAULT_P_GATHERED)
        for cfg in _space_configs(*weight_grad.TUNING_SPACE, *pinned, *({**c, **weight_grad._STEPS} for c in pinned)):
            got = fits("wg", weight_grad.varlen_k_gemm, pm, qm, routing, p_gather=pg, q_gather=qg,
                       out_dtype=torch.float32, config=cfg)
            assert got is None or (rel_err(got, want) < 1e-5 and not got[0].any() and not got[-1].any()), (pg, cfg)
    y, w = rnd(r, 132), torch.rand(r, generator=g).to(device)
    want = gather_sum_ref(y, routing, w)
    for cfg in _space_configs(*aggregation.TUNING_SPACE, aggregation._GPU_DEFAULT, aggregation.SLICE_CONFIG,
                              aggregation.RESERVE_CONFIG):
        for programs in (0, 2):
            got = fits("agg", gather_sum, y, routing, w, config=cfg, num_programs=programs)
            assert got is None or rel_err(got, want) < 1e-5, cfg
    assert ran == {"up", "dh", "gg", "wg", "agg"}
    pinned = {"up": (up_mod._GPU_DEFAULT, up_mod._GPU_DEFAULT_STEPS), "dh": (dh_mod._GPU_DEFAULT,),
              "gg": (grouped_gemm._GPU_DEFAULT, grouped_gemm._GPU_DEFAULT_TMA_STORES),
              "wg": (weight_grad._GPU_DEFAULT, weight_grad._GPU_DEFAULT_P_GATHERED),
              "agg": (aggregation._GPU_DEFAULT,)}
    for op, cfgs in pinned.items():
        for cfg in cfgs:
            sized = common.sized_for_operands(cfg if isinstance(cfg, dict) else common.config_dict(cfg), 4)
            assert (op, sized) not in too_big, (op, sized)
