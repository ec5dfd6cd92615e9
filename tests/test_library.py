"""The Triton path as torch.library custom ops: registration, torch.compile, and no host syncs.

On CPU the ops run their Triton kernels through the interpreter (float32/float16); the tests marked
``gpu`` compile a model with inductor and capture a whole training step in a CUDA graph.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sonicmoe
from sonicmoe.bench.measure import graph_of
from sonicmoe.ops import grouped_gemm_ws, library
from sonicmoe.ops.aggregation import gather_sum, gather_sum_ref
from sonicmoe.ops.grouped_gemm import varlen_m_gemm_ref
from sonicmoe.ops.library import BWD_ROUTING_FIELDS, FWD_ROUTING_FIELDS
from sonicmoe.routing import router_topk, routing_from_pairs, routing_from_topk
from sonicmoe.testing import random_problem, rel_err

pytestmark = pytest.mark.interpreter

T, D, N, E, K = 7, 16, 8, 3, 2


def _topk_routing(p, k=K):
    return routing_from_topk(router_topk(p["x"], p["router_weight"], k).topk_ids, p["w1"].shape[0])


def _general_routing(device):
    """Pairs not token-major (slot_pair is set): tokens 1, 3 and 4 have no expert, token 6 has all E = 3."""
    tok = torch.tensor([6, 0, 2, 6, 5, 2, 6], device=device)
    exp = torch.tensor([2, 1, 0, 0, 1, 2, 1], device=device)
    return routing_from_pairs(tok, exp, T, E)


ROUTINGS = {"topk": lambda p, device: _topk_routing(p), "general": lambda p, device: _general_routing(device)}


def _fwd_args(p, routing, layout, requires_grad, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)

    def leaf(v):
        return None if v is None else v.to(dtype).clone().requires_grad_(requires_grad)

    scores = torch.rand(routing.num_rows, generator=g).to(p["x"].device).requires_grad_(requires_grad)
    return (leaf(p["x"]), leaf(p["w1"]), leaf(p["w2"]), leaf(p["b1"]), leaf(p["b2"]), scores,
            *(getattr(routing, f) for f in FWD_ROUTING_FIELDS), layout, requires_grad)


# ---------------------------------------------------------------------------------------------
# registration: opcheck (schema, autograd registration, fake tensors, AOT dispatch with dynamic shapes)
# ---------------------------------------------------------------------------------------------


def test_ops_registered():
    assert torch.ops.sonicmoe.experts_fwd.default is not None
    assert torch.ops.sonicmoe.experts_bwd.default is not None
    schema = str(torch.ops.sonicmoe.experts_fwd.default._schema)
    assert "Tensor? b1" in schema and "Tensor? slot_pair" in schema and "-> (Tensor, Tensor)" in schema


@pytest.mark.parametrize("routing_kind", ["topk", "general"])
@pytest.mark.parametrize("bias,layout", [(True, "interleaved"), (False, "concat")])
@pytest.mark.parametrize("requires_grad", [True, False], ids=["train", "inference"])
def test_opcheck_experts_fwd(routing_kind, bias, layout, requires_grad, device):
    """With requires_grad the AOT test also runs the registered backward (experts_bwd) and compares
    the gradients of the compiled and the eager op."""
    p = random_problem(T, D, N, E, bias=bias, device=device, seed=4)
    routing = ROUTINGS[routing_kind](p, device)
    torch.library.opcheck(library.experts_fwd, _fwd_args(p, routing, layout, requires_grad))


def test_opcheck_experts_fwd_float16(device):
    p = random_problem(T, D, N, E, bias=True, device=device, seed=5)
    torch.library.opcheck(library.experts_fwd, _fwd_args(p, _topk_routing(p), "concat", True, torch.float16),
                          atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("tokens", [T, 0], ids=["no_rows", "no_tokens"])
@pytest.mark.parametrize("needs", [[True] * 6, [True, True, True, False, False, False]], ids=["all", "no_ds"])
def test_opcheck_experts_bwd_without_rows(tokens, needs, device):
    """R = 0 (or T = 0) with transposed views of x and W1 and float16 x beside float32 scores: the backward's zeros
    have the fake's contiguous strides and dtypes (a compiled backward with inductor checked them and failed on the
    transposed W1's strides before session 83)."""
    p = random_problem(T, D, N, E, bias=True, device=device, seed=6)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    routing = routing_from_pairs(empty, empty, tokens, E)
    for dtype in (torch.float32, torch.float16):
        x = p["x"][:tokens].to(dtype).t().contiguous().t()
        w1 = p["w1"].to(dtype).transpose(1, 2).contiguous().transpose(1, 2)
        assert not w1.is_contiguous() and (tokens == 0 or not x.is_contiguous())
        args = (torch.randn(tokens, D, device=device, dtype=dtype), x, w1, p["w2"].to(dtype), p["b1"].to(dtype),
                p["b2"].to(dtype), torch.empty(0, 2 * N, device=device, dtype=dtype),
                torch.empty(0, device=device), *(getattr(routing, f) for f in BWD_ROUTING_FIELDS), "concat", needs)
        torch.library.opcheck(library.experts_bwd, args)
        grads = library.experts_bwd(*args)
        assert all(g.is_contiguous() and not g.any() for g in grads)
        assert grads[5].dtype == torch.float32


@pytest.mark.parametrize("needs", [[True] * 6, [False, True, False, False, True, True], [True, False] * 3],
                         ids=["all", "w1,b2,scores", "x,w2,b2"])
@pytest.mark.parametrize("bias", [True, False])
def test_opcheck_experts_bwd(needs, bias, device):
    p = random_problem(T, D, N, E, bias=bias, device=device, seed=6)
    routing = _general_routing(device)
    g = torch.Generator().manual_seed(2)
    r = routing.num_rows
    h = torch.randn(r, 2 * N, generator=g).to(device)
    pair_scores = torch.rand(r, generator=g).to(device=device, dtype=torch.float16)  # float16 scores: float16 dS
    dout = torch.randn(T, D, generator=g).to(device)
    args = (dout, p["x"], p["w1"], p["w2"], p["b1"], p["b2"], h, pair_scores,
            *(getattr(routing, f) for f in BWD_ROUTING_FIELDS), "concat", needs)
    torch.library.opcheck(library.experts_bwd, args)
    grads = library.experts_bwd(*args)
    for g_, need, full in zip(grads, needs, (p["x"], p["w1"], p["w2"], p["b1"], p["b2"], pair_scores)):
        expected = tuple(full.shape) if need and full is not None else (0,)
        assert tuple(g_.shape) == expected
    assert grads[5].dtype == torch.float16  # dS comes back in the scores' dtype


def test_experts_bwd_placeholders_keep_their_inputs_dtypes(device):
    """The (0,) placeholders of gradients nobody asked for carry the dtype of the input they stand for (db1 b1's, db2
    b2's, dS the scores'), as the fake's do: here float16 biases and scores beside float32 x and weights, so a
    placeholder made from x would differ in dtype from the fake (a compiled graph checks them)."""
    p = random_problem(T, D, N, E, bias=True, device=device, seed=int(torch.randint(0, 2**31 - 1, ())))
    routing = _general_routing(device)
    r = routing.num_rows
    h = torch.randn(r, 2 * N, device=device)
    pair_scores = torch.rand(r, device=device, dtype=torch.float16)
    needs = [True, False, True, False, False, False]
    args = (torch.randn(T, D, device=device), p["x"], p["w1"], p["w2"], p["b1"].half(), p["b2"].half(), h,
            pair_scores, *(getattr(routing, f) for f in BWD_ROUTING_FIELDS), "concat", needs)
    grads = library.experts_bwd(*args)
    assert [tuple(g_.shape) for g_ in grads] == [(T, D), (0,), tuple(p["w2"].shape), (0,), (0,), (0,)]
    assert [g_.dtype for g_ in grads] == [torch.float32] * 3 + [torch.float16] * 3


def test_experts_bwd_bias_and_score_gradients_in_their_inputs_dtypes(device):
    """Asked for, db1, db2 and dS come back in the dtypes of b1, b2 and the scores (the fake's): float16 here beside
    float32 x and weights, each the float32 call's value on the same (float16) inputs rounded once to float16; dX,
    dW1 and dW2 the float32 call's bits."""
    p = random_problem(T, D, N, E, bias=True, device=device, seed=18)
    routing = _general_routing(device)
    r = routing.num_rows
    g = torch.Generator().manual_seed(19)
    h = torch.randn(r, 2 * N, generator=g).to(device)
    dout = torch.randn(T, D, generator=g).to(device)
    b1, b2, s = p["b1"].half(), p["b2"].half(), torch.rand(r, generator=g).half().to(device)
    arrays = [getattr(routing, f) for f in BWD_ROUTING_FIELDS]
    half = library.experts_bwd(dout, p["x"], p["w1"], p["w2"], b1, b2, h, s, *arrays, "concat", [True] * 6)
    full = library.experts_bwd(dout, p["x"], p["w1"], p["w2"], b1.float(), b2.float(), h, s.float(), *arrays,
                               "concat", [True] * 6)
    assert [g_.dtype for g_ in half] == [torch.float32] * 3 + [torch.float16] * 3
    assert all(torch.equal(a, b) for a, b in zip(half[:3], full[:3]))
    for a, b in zip(half[3:], full[3:]):
        assert b.abs().max() > 0 and torch.equal(a, b.half())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("needs", [[False, False, False, False, False, True], [True, False, False, False, False, True],
                                   [False, True, True, False, False, False], [True] * 6],
                         ids=["scores", "x,scores", "w1,w2", "all"])
def test_gpu_overlap_joins_for_every_subset(needs, dtype, monkeypatch):
    """With the backward's side stream (SONICMOE_OVERLAP) every requested gradient is complete when the op
    returns, whichever subset is asked for: each result is compared on the current stream right away (no
    synchronisation in between; a missing join would let the comparison read a buffer the side stream is still
    writing) against the one-stream run. In bf16 the experts average 1024 rows, so on sm_90 dX̃ runs on the Gluon
    ping-pong kernel, whose output the side stream's dX aggregation reads."""
    p = random_problem(4099, 512, 256, 8, bias=True, device="cuda", dtype=dtype, seed=7)
    routing = routing_from_topk(torch.rand(4099, 8, device="cuda").argsort(1)[:, :2], 8)
    g = torch.Generator(device="cuda").manual_seed(3)
    r = routing.num_rows
    h = torch.randn(r, 2 * 256, device="cuda", generator=g).to(dtype)
    pair_scores = torch.rand(r, device="cuda", generator=g).to(dtype)
    dout = torch.randn(4099, 512, device="cuda", generator=g).to(dtype)
    args = (dout, p["x"], p["w1"], p["w2"], p["b1"], p["b2"], h, pair_scores,
            *(getattr(routing, f) for f in BWD_ROUTING_FIELDS), "concat", needs)
    monkeypatch.setenv("SONICMOE_OVERLAP", "0")
    grouped_gemm_ws._CALLS.clear()
    ref = library.experts_bwd_impl(*args)
    if dtype == torch.bfloat16 and needs[0] and grouped_gemm_ws.ws_supported(h, p["w1"], r, transpose_b=False):
        assert any(not c["transpose_b"] for c in grouped_gemm_ws.ws_calls())  # dX̃ ran on the Gluon kernel
    monkeypatch.setenv("SONICMOE_OVERLAP", "2")
    for _ in range(3):
        got = library.experts_bwd_impl(*args)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert not any(g_.isnan().any() for g_ in ref)


def test_agg_reserve_rule(monkeypatch):
    """Multiprocessors left to the column blocks' aggregations: none off CUDA or without the side stream
    (SONICMOE_OVERLAP=0); on CUDA the default, or SONICMOE_AGG_RESERVE's count below the device's multiprocessors
    (0 turns it off), read at each call; another count there, or a value that is no count anywhere, raises."""
    from sonicmoe.ops import common

    monkeypatch.delenv("SONICMOE_AGG_RESERVE", raising=False)
    assert common.agg_reserve(torch.device("cpu")) == 0
    monkeypatch.setenv("SONICMOE_AGG_RESERVE", "x")
    with pytest.raises(ValueError, match="SONICMOE_AGG_RESERVE='x'"):  # on CPU too, where it is not used
        common.agg_reserve(torch.device("cpu"))
    monkeypatch.delenv("SONICMOE_AGG_RESERVE")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(common, "overlap_mode", lambda device: 2)
    monkeypatch.setattr(common, "sm_count", lambda device: 132)
    assert common.agg_reserve(cuda) == common.AGG_RESERVE > 0
    for value, want in (("0", 0), ("8", 8), ("131", 131), ("012", 12)):
        monkeypatch.setenv("SONICMOE_AGG_RESERVE", value)
        assert common.agg_reserve(cuda) == want, value
    for value in ("132", "x", "-4", " 8", ""):  # silently the default before
        monkeypatch.setenv("SONICMOE_AGG_RESERVE", value)
        with pytest.raises(ValueError, match="SONICMOE_AGG_RESERVE"):
            common.agg_reserve(cuda)
    monkeypatch.setenv("SONICMOE_AGG_RESERVE", "200")
    with pytest.raises(ValueError, match=rf"^SONICMOE_AGG_RESERVE='200': expected a count below the device's 132 "
                                         rf"multiprocessors \(unset for the default, {common.AGG_RESERVE}\)$"):
        common.agg_reserve(cuda)
    monkeypatch.setenv("SONICMOE_AGG_RESERVE", "8")
    monkeypatch.setattr(common, "overlap_mode", lambda device: 0)
    assert common.agg_reserve(cuda) == 0


def test_gather_chunk_width_rule(monkeypatch):
    """Column blocks only for an explicit width on CPU (the default needs the CUDA side stream), a multiple of 8
    of at most half of d, and d a multiple of 8 (16-byte aligned blocks for the TMA descriptors)."""
    cpu = torch.device("cpu")
    monkeypatch.delenv("SONICMOE_AGG_CHUNK", raising=False)
    assert library.gather_chunk_width(4096, cpu) == 0
    for value in ("off", "12", "-8", "8 ", ""):  # not 0 or a multiple of 8: as unset (off, 12) or 0 (12) before
        monkeypatch.setenv("SONICMOE_AGG_CHUNK", value)
        with pytest.raises(ValueError, match="SONICMOE_AGG_CHUNK"):
            library.gather_chunk_width(4096, cpu)
    monkeypatch.setenv("SONICMOE_AGG_CHUNK", "16")
    assert [library.gather_chunk_width(d, cpu) for d in (40, 32, 24, 36)] == [16, 16, 0, 0]
    monkeypatch.setenv("SONICMOE_AGG_CHUNK", "0")
    assert library.gather_chunk_width(4096, cpu) == 0


def test_gather_chunk_width_default_with_the_side_stream(monkeypatch):
    """With the side stream (SONICMOE_OVERLAP > 0, faked on the CPU): unset, the default width AGG_CHUNK for d of two
    chunks or more; SONICMOE_AGG_CHUNK=0 turns the blocks off (it is not "unset"); an explicit width applies; without
    the side stream only an explicit width does."""
    from sonicmoe.ops import common

    cpu = torch.device("cpu")
    monkeypatch.setattr(common, "overlap_mode", lambda device: 2)
    monkeypatch.delenv("SONICMOE_AGG_CHUNK", raising=False)
    w = common.AGG_CHUNK
    assert [library.gather_chunk_width(d, cpu) for d in (2 * w, 2 * w - 8, 3 * w + 8, 2 * w + 4)] == [w, 0, w, 0]
    monkeypatch.setenv("SONICMOE_AGG_CHUNK", "0")
    assert library.gather_chunk_width(4 * w, cpu) == 0
    monkeypatch.setenv("SONICMOE_AGG_CHUNK", "1024")
    assert library.gather_chunk_width(4096, cpu) == 1024
    monkeypatch.setattr(common, "overlap_mode", lambda device: 0)
    assert library.gather_chunk_width(4096, cpu) == 1024
    monkeypatch.delenv("SONICMOE_AGG_CHUNK")
    assert library.gather_chunk_width(4096, cpu) == 0


@pytest.mark.parametrize("d,width", [(16, 8), (40, 16)], ids=["even", "ragged"])
@pytest.mark.parametrize("bias,layout", [(True, "interleaved"), (False, "concat")])
def test_column_chunked_gemm_and_aggregation_match_one_pass(d, width, bias, layout, device, monkeypatch):
    """A varlen-M GEMM and its aggregation in column blocks of C (SONICMOE_AGG_CHUNK; on CUDA each block's
    aggregation runs on the side stream beside the next block's GEMM) give the one-pass bits: the down-projection
    form with bias and slot weights (against the float32 reference too), and the whole backward, whose dX̃ GEMM
    and dX aggregation run so. Outputs are poisoned (NaN) first, so a column block no kernel wrote shows up;
    ragged: d = 40 in blocks of 16, 16 and 8 columns."""
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")
    monkeypatch.setenv("SONICMOE_AUTOTUNE", "0")
    p = random_problem(T, d, N, E, bias=True, device=device, seed=11)
    routing = _topk_routing(p)
    r = routing.num_rows
    g = torch.Generator().manual_seed(5)
    a = torch.randn(r, N, generator=g).to(device)
    weights = torch.rand(r, generator=g).to(device)
    dout = torch.randn(T, d, generator=g).to(device)
    h = torch.randn(r, 2 * N, generator=g).to(device)
    pair_scores = torch.rand(r, generator=g).to(device)
    b1, b2 = (p["b1"], p["b2"]) if bias else (None, None)
    runs = []
    for w in ("0", str(width)):
        monkeypatch.setenv("SONICMOE_AGG_CHUNK", w)
        out = library.gemm_then_gather_sum(a, p["w2"], b2, routing, weights, transpose_b=True)
        grads = library.experts_bwd_impl(dout, p["x"], p["w1"], p["w2"], b1, b2, h, pair_scores,
                                         *(getattr(routing, f) for f in BWD_ROUTING_FIELDS), layout, [True] * 6)
        runs.append((out, *grads))
    assert library.gather_chunk_width(d, torch.device(device)) == width
    for one, chunked in zip(*runs):
        assert not chunked.isnan().any()
        assert torch.equal(one, chunked)
    y_ref = varlen_m_gemm_ref(a, p["w2"], b2, routing, transpose_b=True)
    assert rel_err(runs[1][0], gather_sum_ref(y_ref, routing, weights)) < 1e-5


def test_column_blocks_last_aggregation_grid(monkeypatch):
    """In column blocks with a side stream (SONICMOE_OVERLAP's persistent grid of k programs per multiprocessor,
    faked here on the CPU), each block's aggregation but the last runs on that persistent grid (beside the next
    block's GEMM); the last, with nothing beside it, runs on one program per tile (progs_per_sm 0: as a persistent
    grid it took 0.61 ms at 120B-n1024 on an H200, session 64). The output has the one-pass bits."""
    monkeypatch.setenv("SONICMOE_AUTOTUNE", "0")
    monkeypatch.setenv("SONICMOE_AGG_CHUNK", "16")
    d = 40  # blocks of 16, 16 and 8 columns
    p = random_problem(T, d, N, E, bias=False, device="cpu", seed=13)
    routing = _topk_routing(p)
    a = torch.randn(routing.num_rows, N, generator=torch.Generator().manual_seed(6))
    one = library.gemm_then_gather_sum(a, p["w2"], None, routing, None, transpose_b=True)
    grids = []

    def spy(*args, **kwargs):
        grids.append((kwargs.get("progs_per_sm", 0), kwargs.get("num_programs", 0)))
        return gather_sum(*args, **kwargs)

    monkeypatch.setattr(library, "overlap_mode", lambda device: 2)
    monkeypatch.setattr(library, "side_stream", lambda device: None)  # _beside(None): the current stream
    monkeypatch.setattr(library, "gather_sum", spy)
    out = library.gemm_then_gather_sum(a, p["w2"], None, routing, None, transpose_b=True)
    assert grids == [(2, 0), (2, 0), (0, 0)]
    assert torch.equal(out, one)


@pytest.mark.parametrize("transpose_b", [True, False], ids=["down_proj", "dxt"])
def test_column_blocks_on_the_streamed_gemm_leave_the_reserve(transpose_b, monkeypatch):
    """The column blocks' host schedule on the streamed-B Gluon GEMM (varlen_m_ws.long_gemm, faked on the CPU by the
    Triton GEMM of the block), with S = 4 of 10 multiprocessors reserved: each block's GEMM gets its first column
    and width (the last block ragged: 8 of 40 columns) and, after a block whose aggregation runs beside it, 10 - 4
    programs; the aggregations but the last run on the S reserved ones with the reserve config, the last on one
    program per tile. The output has the one-pass bits."""
    monkeypatch.setenv("SONICMOE_AUTOTUNE", "0")
    monkeypatch.setenv("SONICMOE_AGG_CHUNK", "16")
    d = 40  # blocks of 16, 16 and 8 columns
    p = random_problem(T, d, N, E, bias=False, device="cpu", seed=21)
    routing = _topk_routing(p)
    g = torch.Generator().manual_seed(22)
    a, b = ((torch.randn(routing.num_rows, N, generator=g), p["w2"]) if transpose_b
            else (torch.randn(routing.num_rows, 2 * N, generator=g), p["w1"]))
    weights = torch.rand(routing.num_rows, generator=g) if transpose_b else None
    monkeypatch.setenv("SONICMOE_AGG_CHUNK", "0")
    one = library.gemm_then_gather_sum(a, b, None, routing, weights, transpose_b=transpose_b)
    monkeypatch.setenv("SONICMOE_AGG_CHUNK", "16")
    gemms, aggs = [], []

    def long_gemm(a, b, bias, routing, *, transpose_b, out, col0, width, num_programs):
        gemms.append((col0, width, num_programs))
        cols = slice(col0, col0 + width)
        return library.varlen_m_gemm(a, b[:, cols] if transpose_b else b[:, :, cols], bias, routing,
                                     transpose_b=transpose_b, out=out)

    def spy(*args, **kwargs):
        aggs.append((kwargs.get("progs_per_sm", 0), kwargs.get("num_programs", 0), kwargs.get("config")))
        return gather_sum(*args, **kwargs)

    monkeypatch.setattr(library.varlen_m_ws, "long_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(library.varlen_m_ws, "long_gemm", long_gemm)
    monkeypatch.setattr(library, "agg_reserve", lambda device: 4)
    monkeypatch.setattr(library, "sm_count", lambda device: 10)
    monkeypatch.setattr(library, "overlap_mode", lambda device: 2)
    monkeypatch.setattr(library, "side_stream", lambda device: None)  # _beside(None): the current stream
    monkeypatch.setattr(library, "gather_sum", spy)
    out = library.gemm_then_gather_sum(a, b, None, routing, weights, transpose_b=transpose_b)
    assert gemms == [(0, 16, None), (16, 16, 6), (32, 8, 6)]
    assert aggs == [(0, 4, library.reserve_config()), (0, 4, library.reserve_config()), (0, 0, None)]
    assert torch.equal(out, one)


@pytest.mark.gpu
@pytest.mark.parametrize("reserve", ["default", "0"])
def test_gpu_column_chunked_default_matches_one_pass(reserve, monkeypatch):
    """bf16 at d = 4096, n = 1024 (dW1 on the Gluon kernel): by default the backward's dX̃ GEMM runs in two
    column blocks on the streamed-B Gluon kernel, the first block's dX aggregation on agg_reserve multiprocessors
    beside the second block's GEMM on the others (SONICMOE_AGG_RESERVE=0: both blocks on the Triton kernel, the
    aggregation's persistent grid beside), and the last one joined before dW1; O and every gradient equal the
    one-pass run's bits (SONICMOE_AGG_CHUNK=0), twice over (deterministic), each read on the current stream right
    away."""
    from sonicmoe.ops import common, varlen_m_ws

    monkeypatch.setenv("SONICMOE_AUTOTUNE", "0")
    monkeypatch.delenv("SONICMOE_AGG_CHUNK", raising=False)
    if reserve == "default":
        monkeypatch.delenv("SONICMOE_AGG_RESERVE", raising=False)
    else:
        monkeypatch.setenv("SONICMOE_AGG_RESERVE", reserve)
    dxt_blocks = [c for c in varlen_m_ws.long_calls() if not c["transpose_b"] and c["width"] == 2048]
    t, d, n, e = 3000, 4096, 1024, 8
    assert library.gather_chunk_width(d, torch.device("cuda")) == 2048
    p = random_problem(t, d, n, e, bias=True, device="cuda", dtype=torch.bfloat16, seed=2)
    routing = _topk_routing(p, 2)
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)

    def run():
        leaves = [v.detach().clone().requires_grad_(True) for v in (p["x"], p["w1"], p["w2"], p["b1"], p["b2"])]
        scores = torch.rand(routing.num_rows, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        scores.requires_grad_(True)
        out = sonicmoe.experts(leaves[0], leaves[1], leaves[2], routing, scores, leaves[3], leaves[4],
                               backend="triton")
        out.backward(dout)  # the comparison below reads every result on the current stream right away
        return [out.detach()] + [v.grad for v in leaves] + [scores.grad]

    first, second = run(), run()
    dxt_after = [c for c in varlen_m_ws.long_calls() if not c["transpose_b"] and c["width"] == 2048]
    if reserve == "default" and common.agg_reserve(torch.device("cuda")) and varlen_m_ws.long_enabled():
        assert dxt_after, "the dX̃ column blocks did not run on the Gluon kernel"
    elif reserve == "0" and not dxt_blocks:
        assert not dxt_after, "SONICMOE_AGG_RESERVE=0 ran the dX̃ column blocks on the Gluon kernel"
    monkeypatch.setenv("SONICMOE_AGG_CHUNK", "0")
    one_pass = run()
    for a, b, c in zip(first, second, one_pass):
        assert not a.isnan().any()
        assert torch.equal(a, b) and torch.equal(a, c)


def test_fake_shapes_without_data():
    """The fake implementations give every output shape from the input shapes alone (meta tensors)."""
    p = random_problem(T, D, N, E, bias=True, device="meta")
    routing = routing_from_topk(torch.zeros(T, K, dtype=torch.long, device="meta"), E)
    r = routing.num_rows
    args = _fwd_args(p, routing, "concat", False)
    for save_h, h_rows in ((True, r), (False, 0)):
        out, h = library.experts_fwd(*args[:-1], save_h)
        assert out.shape == (T, D) and h.shape == (h_rows, 2 * N) and out.device.type == "meta"
    grads = library.experts_bwd(torch.empty(T, D, device="meta"), p["x"], p["w1"], p["w2"], None, p["b2"],
                                torch.empty(r, 2 * N, device="meta"), torch.empty(r, device="meta"),
                                *(getattr(routing, f) for f in BWD_ROUTING_FIELDS), "concat", [True] * 6)
    assert [tuple(g.shape) for g in grads] == [(T, D), (E, 2 * N, D), (E, D, N), (0,), (E, D), (r,)]
    # a bias whose gradient nobody asks for: its (0,) placeholder, as the real implementation returns
    grads = library.experts_bwd(torch.empty(T, D, device="meta"), p["x"], p["w1"], p["w2"], p["b1"], p["b2"],
                                torch.empty(r, 2 * N, device="meta"), torch.empty(r, device="meta"),
                                *(getattr(routing, f) for f in BWD_ROUTING_FIELDS), "concat",
                                [True, True, True, False, False, True])
    assert [tuple(g.shape) for g in grads] == [(T, D), (E, 2 * N, D), (E, D, N), (0,), (0,), (r,)]


def test_forward_without_h_returns_the_fakes_empty_h(device):
    """save_h=False (inference): the real forward returns an empty (0, 2n) H, the shape its fake gives (a compiled
    graph checks the real outputs against the fake's), and the O of the forward that keeps H."""
    p = random_problem(T, D, N, E, bias=True, device=device, seed=12)
    routing = _topk_routing(p)
    args = _fwd_args(p, routing, "concat", False)
    out, h = library.experts_fwd_impl(*args[:-1], True)
    out0, h0 = library.experts_fwd_impl(*args[:-1], False)
    assert h.shape == (routing.num_rows, 2 * N) and h0.shape == (0, 2 * N) and h0.dtype == h.dtype
    assert torch.equal(out0, out)


def test_forward_without_tokens_gives_the_fakes_h(device):
    """T = 0 with a padded routing's R = 3 static rows (none real): no kernel runs, O is (0, d), and H has the fake's
    shape, (R, 2n) with save_h and (0, 2n) without; the padding rows of a kept H are zero."""
    p = random_problem(1, D, N, E, bias=True, device=device, seed=14)
    p["x"] = p["x"][:0]
    routing = routing_from_pairs(torch.zeros(3, dtype=torch.long, device=device),
                                 torch.full((3,), E, device=device), 0, E, padding=True)
    assert routing.num_rows == 3
    args = _fwd_args(p, routing, "concat", False)
    meta = [v.to("meta") if isinstance(v, torch.Tensor) else v for v in args[:-1]]
    for save_h, rows in ((True, 3), (False, 0)):
        out, h = library.experts_fwd_impl(*args[:-1], save_h)
        fake_out, fake_h = library.experts_fwd(*meta, save_h)
        assert out.shape == fake_out.shape == (0, D)
        assert h.shape == fake_h.shape == (rows, 2 * N) and h.dtype == fake_h.dtype and not h.any()


def test_operators_read_strided_routing_arrays(device):
    """The operators take routing arrays that are strided views (every other element of a wider tensor): they are
    made contiguous before the kernels index them flat, so O, H and every gradient equal the contiguous call's."""
    p = random_problem(T, D, N, E, bias=True, device=device, seed=15)
    routing = _general_routing(device)

    def strided(v):
        if v is None:
            return None
        view = v.repeat_interleave(2)[::2]
        assert torch.equal(view, v) and view.stride() == (2,)
        return view

    args = list(_fwd_args(p, routing, "interleaved", False))
    sl = slice(6, 6 + len(FWD_ROUTING_FIELDS))
    assert all(v is getattr(routing, f) for v, f in zip(args[sl], FWD_ROUTING_FIELDS))
    assert routing.slot_pair is not None
    strided_args = args[:6] + [strided(v) for v in args[sl]] + args[sl.stop:]
    want = library.experts_fwd_impl(*args[:-1], True)
    got = library.experts_fwd_impl(*strided_args[:-1], True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(T, D, generator=g).to(device)
    bwd = [dout, *args[:3], args[3], args[4], want[1], args[5]]
    routing_bwd = [getattr(routing, f) for f in BWD_ROUTING_FIELDS]
    want_g = library.experts_bwd_impl(*bwd, *routing_bwd, "interleaved", [True] * 6)
    got_g = library.experts_bwd_impl(*bwd, *(strided(v) for v in routing_bwd), "interleaved", [True] * 6)
    assert all(torch.equal(a, b) for a, b in zip(want_g, got_g))
    assert rel_err(got[0], sonicmoe.experts(p["x"], p["w1"], p["w2"], routing, args[5], b1=p["b1"], b2=p["b2"],
                                            gate_up_layout="interleaved", backend="torch")) < 1e-5


def test_experts_triton_eager_paths(device):
    """Eager: with gradients through ExpertsFunction (the operator's twin), without as a plain forward (no
    autograd node); compiled graphs call the operator (test_compile_* below)."""
    p = random_problem(T, D, N, E, device=device, seed=7)
    x = p["x"].clone().requires_grad_(True)
    routing = _topk_routing(p)
    out = sonicmoe.experts(x, p["w1"], p["w2"], routing, torch.rand(routing.num_rows, device=device),
                           backend="triton")
    assert out.grad_fn.name() == "ExpertsFunctionBackward"
    with torch.no_grad():
        again = sonicmoe.experts(x, p["w1"], p["w2"], routing, torch.rand(routing.num_rows, device=device),
                                 backend="triton")
    assert again.grad_fn is None and again.shape == out.shape


def test_experts_triton_grad_of_the_scores_alone_and_no_h_under_no_grad(monkeypatch, device):
    """The scores alone needing a gradient (frozen experts, a router being trained) take the autograd path: dS is
    the torch backend's. Under torch.no_grad, inputs that require grad take the plain forward, which writes no H."""
    from sonicmoe.ops import moe_function

    p = random_problem(T, D, N, E, device=device, seed=10)
    routing = _topk_routing(p)
    scores = torch.rand(routing.num_rows, device=device)
    ds = {}
    for backend in ("triton", "torch"):
        s = scores.clone().requires_grad_(True)
        out = sonicmoe.experts(p["x"], p["w1"], p["w2"], routing, s, backend=backend)
        out.sum().backward()
        ds[backend] = s.grad
    assert ds["triton"] is not None and rel_err(ds["triton"], ds["torch"]) < 1e-5
    seen = []
    plain = moe_function.experts_fwd_impl
    monkeypatch.setattr(moe_function, "experts_fwd_impl", lambda *a: seen.append(a[-3]) or plain(*a))
    x = p["x"].clone().requires_grad_(True)
    with torch.no_grad():
        sonicmoe.experts(x, p["w1"], p["w2"], routing, scores, backend="triton")
    assert seen == [False]  # needs_grad False: the up-projection stores no H


def test_experts_triton_grad_of_x_alone(device):
    """x alone needing a gradient (frozen experts and scores under a trained encoder, or an input attribution) takes
    the autograd path: dX is the torch backend's."""
    p = random_problem(T, D, N, E, device=device, bias=True, seed=11)
    routing = _topk_routing(p)
    scores = torch.rand(routing.num_rows, device=device) + 0.1
    dout = torch.randn(T, D, generator=torch.Generator().manual_seed(12)).to(device)
    dx = {}
    for backend in ("triton", "torch"):
        x = p["x"].clone().requires_grad_(True)
        out = sonicmoe.experts(x, p["w1"], p["w2"], routing, scores, p["b1"], p["b2"], backend=backend)
        assert out.grad_fn is not None, backend
        (dx[backend],) = torch.autograd.grad(out, x, dout)
    assert dx["torch"].norm() > 0 and rel_err(dx["triton"], dx["torch"]) < 1e-5


@pytest.mark.parametrize("which", ["w1", "w2", "b1", "b2", "all"])
def test_experts_triton_grad_of_each_weight_alone_or_all(which, device):
    """One weight alone needing a gradient (a fine-tuned projection or bias, the rest frozen), or every input: the
    autograd path, with the output and gradients the torch backend's (interleaved W1: the layout reaches the
    kernels too)."""
    p = random_problem(T, D, N, E, device=device, bias=True, seed=13)
    routing = _topk_routing(p)
    names = ["x", "w1", "w2", "b1", "b2", "pair_scores"] if which == "all" else [which]
    base = {**{k: p[k] for k in ("x", "w1", "w2", "b1", "b2")},
            "pair_scores": torch.rand(routing.num_rows, generator=torch.Generator().manual_seed(14)).to(device) + 0.1}
    dout = torch.randn(T, D, generator=torch.Generator().manual_seed(15)).to(device)
    res = {}
    for backend in ("triton", "torch"):
        a = {k: v.clone().requires_grad_(k in names) for k, v in base.items()}
        out = sonicmoe.experts(a["x"], a["w1"], a["w2"], routing, a["pair_scores"], a["b1"], a["b2"],
                               gate_up_layout="interleaved", backend=backend)
        assert out.grad_fn is not None, backend
        res[backend] = (out.detach(), torch.autograd.grad(out, [a[k] for k in names], dout))
    assert rel_err(res["triton"][0], res["torch"][0]) < 1e-5
    for name, g_t, g_ref in zip(names, res["triton"][1], res["torch"][1]):
        assert g_ref.norm() > 0 and rel_err(g_t, g_ref) < 1e-5, name


@pytest.mark.parametrize("d,n,gluon", [(16, 8, False), (8, 16, True)])
def test_weight_gradients_ask_for_the_gluon_kernel_by_expert_width(d, n, gluon, monkeypatch, device):
    """The backward asks for the Gluon weight-gradient kernel by the experts' width n (W2's last dimension), not by d:
    with the threshold moved between the two (12), dW1 and dW2 ask for it exactly when n >= 12 (on the CPU the
    request falls back to the Triton kernel), and come out as the torch backend's."""
    monkeypatch.delenv("SONICMOE_GLUON_WGRAD", raising=False)
    monkeypatch.setattr(library, "GLUON_WGRAD_MIN_N", 12)
    seen = []
    real = library.varlen_k_gemm

    def spy(*args, **kwargs):
        seen.append(kwargs.get("gluon", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(library, "varlen_k_gemm", spy)
    p = random_problem(T, d, n, E, device=device, seed=20)
    routing = _topk_routing(p)
    scores = torch.rand(routing.num_rows, generator=torch.Generator().manual_seed(21)).to(device)
    dout = torch.randn(T, d, generator=torch.Generator().manual_seed(22)).to(device)
    grads = {}
    for backend in ("triton", "torch"):
        w1, w2 = p["w1"].clone().requires_grad_(True), p["w2"].clone().requires_grad_(True)
        out = sonicmoe.experts(p["x"], w1, w2, routing, scores, backend=backend)
        grads[backend] = torch.autograd.grad(out, [w1, w2], dout)
    assert seen == [gluon, gluon]
    for g_t, g_ref in zip(grads["triton"], grads["torch"]):
        assert g_ref.norm() > 0 and rel_err(g_t, g_ref) < 1e-5


def test_h_is_not_differentiable(device):
    """H, the forward's second output, is marked non-differentiable (the backward ignores a gradient of H, so one
    would be dropped silently), through the operator and its eager twin; O carries the graph."""
    p = random_problem(T, D, N, E, device=device, seed=16)
    args = _fwd_args(p, _topk_routing(p), "concat", True)
    for fwd in (library.experts_fwd, library.ExpertsFunction.apply):
        out, h = fwd(*args)
        assert out.requires_grad and out.grad_fn is not None
        assert h.shape == (args[6 + 1].shape[0], 2 * N) and not h.requires_grad and h.grad_fn is None


def test_tile_rows_hint_reaches_the_up_projection(monkeypatch, device):
    """The routing's tile_rows hint (token rounding's M_tile) crosses the operator to the up-projection's kernel
    choice, eager and through the op; the output does not depend on it."""
    p = random_problem(T, D, N, E, device=device, seed=9)
    seen = []

    def spy(x, w1, b1, routing, *args, **kwargs):
        seen.append(routing.tile_rows)
        return up_proj(x, w1, b1, routing, *args, **kwargs)

    up_proj = library.up_proj
    monkeypatch.setattr(library, "up_proj", spy)
    routing = _topk_routing(p)
    scores = torch.rand(routing.num_rows, device=device)
    plain = sonicmoe.experts(p["x"], p["w1"], p["w2"], routing, scores, backend="triton")
    routing.tile_rows = 128
    hinted = sonicmoe.experts(p["x"], p["w1"], p["w2"], routing, scores, backend="triton")
    args = _fwd_args(p, routing, "concat", False)
    library.experts_fwd(*args, 128)
    assert seen == [0, 128, 128] and torch.equal(plain, hinted)


def test_op_rejects_bad_layout_and_missing_h(device):
    p = random_problem(T, D, N, E, device=device, seed=8)
    args = list(_fwd_args(p, _topk_routing(p), "concat", True))
    args[-2] = "gate_up"
    with pytest.raises(ValueError, match="gate_up_layout"):
        library.experts_fwd(*args)
    args[-2], args[-1] = "concat", False  # gradients needed but H not saved
    with pytest.raises(ValueError, match="save_h"):
        library.experts_fwd(*args)
    # the backward checks its layout and activation too, before its branch for R = 0 (which launches no kernel
    # that would refuse them)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    for routing in (_general_routing(device), routing_from_pairs(empty, empty, T, E)):
        bwd_args = [torch.randn(T, D, device=device), p["x"], p["w1"], p["w2"], None, None,
                    torch.randn(routing.num_rows, 2 * N, device=device), torch.rand(routing.num_rows, device=device),
                    *(getattr(routing, f) for f in BWD_ROUTING_FIELDS), "concat", [True] * 6, "gelu"]
        with pytest.raises(ValueError, match="activation must be one of .* got 'gelu'"):
            library.experts_bwd(*bwd_args)
        bwd_args[-3], bwd_args[-1] = "gate_up", "swiglu"
        with pytest.raises(ValueError, match="gate_up_layout must be one of .* got 'gate_up'"):
            library.experts_bwd(*bwd_args)


# ---------------------------------------------------------------------------------------------
# torch.compile on CPU (the ops are opaque to dynamo; aot_eager runs AOTAutograd without inductor)
# ---------------------------------------------------------------------------------------------


class _GraphRecorder:
    """A torch.compile backend that records the dynamo graphs and runs them through aot_eager."""

    def __init__(self):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs = []
        self._aot = lookup_backend("aot_eager")

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self._aot(gm, example_inputs)

    def calls_op(self, name: str) -> bool:
        """Whether a recorded graph calls ``torch.ops.sonicmoe.<name>`` (as one opaque node)."""
        targets = [n.target for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function"]
        return any(str(t).split(".")[:2] == ["sonicmoe", name] for t in targets)


def test_compile_fullgraph_experts_and_moe(device):
    """sonicmoe.moe(backend="triton") under torch.compile(fullgraph=True): one graph holding the custom op;
    outputs and gradients bitwise equal to eager (the same kernels run)."""
    p = random_problem(9, D, N, 4, bias=True, device=device, seed=9)

    def f(x, wr, w1, w2, b1, b2):
        res = sonicmoe.moe(x, wr, w1, w2, b1, b2, top_k=2, backend="triton")
        return res.out, res.router.logits

    rec = _GraphRecorder()
    compiled = torch.compile(f, fullgraph=True, backend=rec)
    results = []
    for fn in (compiled, f):
        leaves = [v.clone().requires_grad_(True) for v in p.values()]
        out, logits = fn(*leaves)
        (out.square().sum() + logits.sum()).backward()
        results.append((out.detach(), [v.grad for v in leaves]))
    assert len(rec.graphs) == 1 and rec.calls_op("experts_fwd")
    assert torch.equal(results[0][0], results[1][0])
    for g_c, g_e in zip(results[0][1], results[1][1]):
        assert torch.equal(g_c, g_e)


@pytest.mark.filterwarnings("ignore:token rounding with")  # the eager calls warn: few tokens per expert
@pytest.mark.parametrize("options", [{}, {"router_order": "sigmoid_then_topk", "renormalize": True,
                                      "routed_scaling_factor": 2.5}, {"routing": "token_rounding", "m_tile": 4},
                                     {"shared_intermediate_size": 6, "shared_expert_gate": True}],
                         ids=["default", "deepseek_v3", "token_rounding", "shared_expert"])
def test_compile_fullgraph_module_dynamic_shapes(device, options):
    """sonicmoe.MoE(backend="triton") compiled with fullgraph=True and dynamic shapes: three token counts,
    one compilation (Routing sizes are SymInts from shapes; nothing is data-dependent). With DeepSeek-V3's router
    too (its selection bias a buffer, moved between calls: still one compilation), and with static-length token
    rounding in training at under 2·M_tile tokens per expert (its warning, which Dynamo cannot trace, silent while
    compiling: a fullgraph compile failed there before session 79), and with a gated shared expert (a second
    experts call, on ``routing_dense``)."""
    torch._dynamo.reset()  # MoE.forward's compiled variants from earlier tests count toward Dynamo's recompile limit
    torch.manual_seed(0)
    m = sonicmoe.MoE(D, N, 4, 2, backend="triton", bias=True, device=device, **options)
    rec = _GraphRecorder()
    cm = torch.compile(m, fullgraph=True, backend=rec, dynamic=True)
    for t in (5, 8, 11):
        x = torch.randn(t, D, device=device)
        y = cm(x)
        (y.square().sum() + m.aux_loss).backward()
        assert rel_err(y, m(x)) == 0.0
        if m.e_score_correction_bias is not None:
            m.update_expert_bias(0.05)
    assert len(rec.graphs) == 1 and rec.calls_op("experts_fwd")


@pytest.mark.filterwarnings("ignore:token rounding with")
def test_compile_token_rounding_selection_is_one_node(device, monkeypatch):
    """Token rounding's selection kernels under torch.compile(fullgraph, dynamic): one sonicmoe::tr_static_pairs node,
    one graph for three token counts (traced launchers fixed T through their T-dependent block sizes: a compile per
    T on an H100, session 83), outputs and gradients equal to eager. On CPU the selection kernels run through the
    interpreter inside the operator (the score kernels, traced by Dynamo, are left to their torch twin there)."""
    from sonicmoe.ops import tr_scores, tr_select

    if device.type == "cpu":
        monkeypatch.setattr(tr_select, "use_select_kernels", lambda dev, use_kernel: use_kernel is not False)
        monkeypatch.setattr(tr_scores, "use_score_kernels", lambda router, use_kernel: False)
    torch._dynamo.reset()  # MoE.forward's compiled variants from earlier tests count toward Dynamo's recompile limit
    torch.manual_seed(0)
    m = sonicmoe.MoE(D, N, 4, 2, backend="triton", bias=True, routing="token_rounding", m_tile=4, device=device)
    rec = _GraphRecorder()
    cm = torch.compile(m, fullgraph=True, backend=rec, dynamic=True)
    for t in (5, 8, 11):
        x = torch.randn(t, D, device=device)
        got = []
        for fn in (cm, m):
            xi = x.clone().requires_grad_(True)
            y = fn(xi)
            (y.square().sum() + m.aux_loss).backward()
            got.append((y.detach(), xi.grad, m.gate.weight.grad.clone(), m.experts.gate_up_proj.grad.clone()))
            m.zero_grad()
        for a, b in zip(*got):
            assert torch.equal(a, b)
    assert len(rec.graphs) == 1 and rec.calls_op("tr_static_pairs") and rec.calls_op("experts_fwd")


@pytest.mark.parametrize("subroutine", ["nearest", "stochastic"])
def test_opcheck_tr_static_pairs(subroutine, device):
    """sonicmoe::tr_static_pairs: schema, fake shapes (R = max_pairs, T + 1, E + 1, E) and AOT dispatch with dynamic
    shapes; its outputs equal select_pairs' on the kernels and on the torch twins."""
    from sonicmoe.ops import tr_static
    from sonicmoe.token_rounding import max_pairs

    t, e, k, m_tile = 40, 6, 2, 8
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(t, e, generator=g).to(device)
    router = router_topk(logits, torch.eye(e, device=device), k, use_kernel=False)
    u = torch.rand(e, generator=g).to(device) if subroutine == "stochastic" else None
    r_max = max_pairs(t, e, k, m_tile, subroutine)
    args = (router.probs.detach(), router.topk_ids, router.topk_scores.detach(), u, m_tile, subroutine, r_max)
    torch.library.opcheck(tr_static.tr_static_pairs, args)
    op = tr_static.select_static_pairs_compiled(*args)
    for kernels in (True, False):
        want = tr_static.select_pairs(*args, kernels=kernels)
        for name in ("pair_token", "pair_expert", "f", "keep", "pad"):
            assert torch.equal(getattr(op, name), getattr(want, name)), name
        for name in ("expert_offsets", "row_token", "row_pair", "pair_row", "token_offsets", "token_rows"):
            assert torch.equal(getattr(op.routing, name), getattr(want.routing, name)), name
        # a padded routing: the torch backend zeroes its padding rows (real_rows), row_expert clamps them to E - 1
        assert op.routing.padded and want.routing.padded
        assert torch.equal(op.routing.real_rows(), want.routing.real_rows())
        assert torch.equal(op.routing.row_expert(), want.routing.row_expert())
    assert op.pair_token.shape == (r_max,) and bool((op.pair_token == t).any())  # padding pairs last


def test_compile_fullgraph_router_info(device):
    """MoE(return_router_info=True) under torch.compile(fullgraph=True): one graph, and the MoELayerOutput comes
    back with the eager values (output, both losses, the expert counts)."""
    torch.manual_seed(0)
    m = sonicmoe.MoE(D, N, 4, 2, backend="triton", z_loss_coef=1e-3, return_router_info=True, device=device)
    rec = _GraphRecorder()
    cm = torch.compile(m, fullgraph=True, backend=rec)
    x = torch.randn(9, D, device=device)
    res, ref = cm(x), m(x)
    assert isinstance(res, sonicmoe.MoELayerOutput) and len(rec.graphs) == 1 and rec.calls_op("experts_fwd")
    for name, a, b in zip(res._fields, res, ref):
        assert torch.equal(a, b), name
    assert res.aux_loss.requires_grad and res.z_loss.requires_grad


def test_eager_function_matches_operator(device):
    """Eager calls go through ``ExpertsFunction``, the operator's twin without its dispatch: the same
    implementations, so the output and every gradient are bit-identical to the custom operator's."""
    t, d, n, e, k = 29, 32, 24, 4, 2
    p = random_problem(t, d, n, e, device=device, seed=8)
    routing = _topk_routing(p, k)
    arrays = [getattr(routing, f) for f in FWD_ROUTING_FIELDS]
    scores0 = torch.rand(routing.num_rows, device=device)
    dout = torch.randn(t, d, device=device)
    results = []
    for via_op in (False, True):
        x, w1, w2, scores = (v.detach().clone().requires_grad_(True) for v in (p["x"], p["w1"], p["w2"], scores0))
        if via_op:
            out, _ = torch.ops.sonicmoe.experts_fwd(x, w1, w2, None, None, scores, *arrays, "concat", True)
            assert out.grad_fn.name().startswith("GeneratedBackwardFor_sonicmoe_experts_fwd")
        else:
            out = sonicmoe.experts(x, w1, w2, routing, scores, backend="triton")
            assert out.grad_fn.name() == "ExpertsFunctionBackward"
        out.backward(dout)
        results.append((out, x.grad, w1.grad, w2.grad, scores.grad))
    for eager, op in zip(*results):
        assert not torch.isnan(eager).any()
        assert torch.equal(eager, op)


def test_memory_contract_under_compile(device):
    """Compiled (AOTAutograd partitions forward and backward itself), the backward still keeps only X, H,
    S (pair order), the weights and int32 routing metadata: the custom op cannot be recomputed or split."""
    t, d, n, e, k = 33, 48, 16, 4, 2
    p = random_problem(t, d, n, e, device=device, seed=4)
    routing = _topk_routing(p, k)
    r = routing.num_rows
    arrays = [getattr(routing, f) for f in FWD_ROUTING_FIELDS[:-1]]

    def f(x, w1, w2, scores, *arrays):
        return sonicmoe.experts(x, w1, w2, sonicmoe.Routing(t, e, *arrays), scores, backend="triton")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = p["x"].clone().requires_grad_(True)
    scores = torch.rand(r, device=device, requires_grad=True)
    saved = []

    def pack(s):
        saved.append(s)
        return s

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
        out = compiled(x, p["w1"], p["w2"], scores, *arrays)
    float_shapes = sorted(tuple(s.shape) for s in saved if s.dtype.is_floating_point)
    assert float_shapes == sorted([(t, d), (r, 2 * n), (r,), (e, 2 * n, d), (e, d, n)])
    for s in saved:
        if not s.dtype.is_floating_point:
            assert s.dtype == torch.int32 and s.dim() == 1 and s.numel() <= max(r, t + 1, e + 1)
    out.backward(torch.ones_like(out))
    assert x.grad is not None and scores.grad is not None


# ---------------------------------------------------------------------------------------------
# no host synchronisation in forward or backward (top-k path)
# ---------------------------------------------------------------------------------------------


class _SyncRecorder(TorchDispatchMode):
    """Records the aten/custom ops that run; ``syncs()`` lists those that read device values back to the
    host or whose output shape depends on data (both a host sync on CUDA and a CUDA-graph breaker)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append((func, args))
        return func(*args, **kwargs)

    def syncs(self):
        bad = []
        for func, args in self.ops:
            tags = func.tags
            if torch.Tag.data_dependent_output not in tags and torch.Tag.dynamic_output_shape not in tags:
                continue
            if func is torch.ops.aten.index.Tensor:  # data-dependent only with boolean masks
                indices = args[1]
                if not any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                    continue
            bad.append(str(func))
        return bad


def test_no_host_sync_forward_backward(device):
    p = random_problem(9, D, N, 4, bias=True, device=device, seed=10)
    leaves = [v.clone().requires_grad_(True) for v in p.values()]
    with _SyncRecorder() as rec:
        res = sonicmoe.moe(*leaves, top_k=2, backend="triton")
        (res.out.square().sum() + sonicmoe.load_balancing_loss(res.router.probs, res.routing)).backward()
        general = _general_routing(device)
        scores = torch.rand(general.num_rows, device=device, requires_grad=True)
        out = sonicmoe.experts(p["x"][:T], p["w1"][:E], p["w2"][:E], general, scores, backend="triton")
        out.sum().backward()
    names = {str(f) for f, _ in rec.ops}
    assert "aten.empty.memory_format" in names  # eager: the recorder sees inside the layer (its outputs)
    assert rec.syncs() == []
    # the operators' implementations on their own (dispatch modes do not see into an operator)
    routing = res.routing
    args = _fwd_args(p, routing, "concat", False)
    with _SyncRecorder() as rec:
        out, h = library.experts_fwd_impl(*args[:-1], True)
        library.experts_bwd_impl(torch.ones_like(out), p["x"], p["w1"], p["w2"], p["b1"], p["b2"], h,
                                 torch.rand(routing.num_rows, device=device),
                                 *(getattr(routing, f) for f in BWD_ROUTING_FIELDS), "interleaved",
                                 [True] * 6)
    assert rec.ops and rec.syncs() == []


def test_sync_recorder_sees_syncs():
    """The recorder above does flag syncs: check_pairs reads min/max back; token rounding compacts."""
    tok, exp = torch.tensor([0, 1, 2]), torch.tensor([0, 1, 0])
    with _SyncRecorder() as rec:
        routing_from_pairs(tok, exp, 3, 2)
    assert rec.syncs() == []
    with _SyncRecorder() as rec:
        routing_from_pairs(tok, exp, 3, 2, check=True)
    assert "aten._local_scalar_dense.default" in rec.syncs()


# ---------------------------------------------------------------------------------------------
# GPU: inductor and CUDA graphs
# ---------------------------------------------------------------------------------------------


class _Block(torch.nn.Module):
    """A small residual block around sonicmoe.MoE (what a model would contain)."""

    def __init__(self, d, n, e, k, dtype, bias=True, **moe_options):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d, device="cuda", dtype=dtype)
        self.moe = sonicmoe.MoE(d, n, e, k, backend="triton", bias=bias, device="cuda", dtype=dtype, **moe_options)
        self.head = torch.nn.Linear(d, d, device="cuda", dtype=dtype)

    def forward(self, x):
        h = x + self.moe(self.norm(x))
        return self.head(h), self.moe.aux_loss


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["topk", "token_rounding"])
def test_gpu_compile_fullgraph_model(routing):
    """torch.compile(fullgraph=True) (inductor) of a model using sonicmoe.MoE on CUDA: one graph, no
    recompilation for new data, outputs and gradients equal to eager within float32 rounding; with token rounding
    too (static pairs: no data-dependent shape; its Triton kernels are traced as user-defined kernels)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    options = {"routing": "token_rounding", "m_tile": 32} if routing == "token_rounding" else {}
    model = _Block(256, 128, 8, 2, torch.float32, **options)
    twin = copy.deepcopy(model)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    for step in range(2):
        x = torch.randn(4, 96, 256, device="cuda")
        y, aux = compiled(x)
        (y.float().square().mean() + aux).backward()
        y_ref, aux_ref = twin(x)
        (y_ref.float().square().mean() + aux_ref).backward()
        assert rel_err(y, y_ref) < 1e-4, step
        for (name, p), p_ref in zip(model.named_parameters(), twin.parameters()):
            assert rel_err(p.grad, p_ref.grad) < 1e-3, (step, name)
    assert counter.frame_count == 1


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [True, False])
def test_gpu_no_sync_forward_backward(bias):
    """torch.cuda sync debug mode "error": any synchronising CUDA call in forward or backward raises. Without
    biases, on sm_90, the scores' gradient comes from the Gluon dH kernel itself (n = 128: one tile spans every
    channel); with them, from the dH partials summed on the side stream."""
    torch.manual_seed(0)
    model = _Block(256, 128, 8, 2, torch.bfloat16, bias=bias)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    y, aux = model(x)  # warm-up: compile the kernels (and autotune, if enabled) outside the check
    (y.float().square().mean() + aux).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, aux = model(x)
        (y.float().square().mean() + aux).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_cuda_graph_layer_bf16(bias):
    """The layer's forward + backward in bfloat16 at a 7B-like shape (n = 256, E = 128: the Gluon dH kernel sums dS
    itself, so the backward's side stream goes unused without biases; with them the dS partials are summed on it)
    captured in a CUDA graph and replayed on new data gives the eager bits. Session 75: without biases the capture
    failed (the backward joined a side stream it had not used)."""
    torch.manual_seed(0)
    t, d, n, e, k = 2048, 1536, 256, 128, 8
    m = sonicmoe.MoE(d, n, e, k, backend="triton", bias=bias, aux_loss_coef=0.0, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    leaves = [x, *m.parameters()]

    last = {}

    def step():
        for v in leaves:
            v.grad = None
        y = m(x)
        y.backward(dout)
        last["y"] = y
        return y

    graph = graph_of(step)  # three eager calls on a side stream, then the capture: its output stays in last
    y_static = last["y"]
    grads_static = [v.grad for v in leaves]
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        dout.copy_(torch.randn_like(dout))
    graph.replay()
    torch.cuda.synchronize()
    y_graph, grads_graph = y_static.clone(), [g.clone() for g in grads_static]
    y_eager = step()
    assert torch.equal(y_graph, y_eager) and torch.isfinite(y_eager).all()
    for g, v in zip(grads_graph, leaves):
        assert torch.equal(g, v.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("losses", [True, False], ids=["losses", "no_losses"])
@pytest.mark.parametrize("routing", ["topk", "token_rounding", "stochastic"])
def test_gpu_make_graphed_callables(routing, losses):
    """``torch.cuda.make_graphed_callables`` on the layer with ``return_router_info=True`` (bf16, a 7B-like width):
    each call replays the captured forward and its backward the captured backward. On new inputs the output, both
    losses, the expert counts and the gradients of x and of every parameter have the bits of an eager twin with the
    same weights; with the losses on (aux 0.01, z 1e-3) their gradients reach the router weight through the returned
    losses. Stochastic token rounding: with the CUDA generator seeded alike before each call, the replay draws the
    eager twin's uniforms; under other seeds the same input gets other rounded counts (the draws are not frozen
    into the graph)."""
    torch.manual_seed(0)
    t, d, n, e, k = 2048, 1536, 256, 128, 8
    coefs = (0.01, 1e-3) if losses else (0.0, 0.0)
    options = {"routing": routing}
    if routing == "stochastic":
        options = {"routing": "token_rounding", "rounding": "stochastic"}
    m = sonicmoe.MoE(d, n, e, k, backend="triton", aux_loss_coef=coefs[0], z_loss_coef=coefs[1], **options,
                     return_router_info=True, device="cuda", dtype=torch.bfloat16)
    twin = copy.deepcopy(m)
    sample = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(m, (sample,))
    one = torch.ones((), device="cuda")
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, generator=g)
        dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, generator=g)
        res = []
        for layer in (graphed, twin):
            layer.zero_grad(set_to_none=True)
            leaf = x.clone().requires_grad_(True)
            torch.cuda.manual_seed(100 + seed)  # stochastic rounding's uniforms; the other routings draw none
            y, aux, z, counts = layer(leaf)
            torch.autograd.backward([y, aux, z] if losses else [y], [dout, one, one] if losses else [dout])
            # clones: a graphed layer's outputs and gradients live in its static buffers, rewritten by each replay
            res.append([v.detach().clone() for v in (y, aux, z, counts, leaf.grad,
                                                     *(p.grad for p in layer.parameters()))])
        torch.cuda.synchronize()
        assert torch.isfinite(res[1][0]).all() and (res[1][1] > 0).item() == losses
        counts = res[1][3]  # top-k's T·K pairs, or token rounding's counts rounded to M_tile = 128
        assert int(counts.sum()) == t * k if routing == "topk" else (counts % 128 == 0).all()
        for name, a, b in zip(["y", "aux", "z", "counts", "x"] + [pn for pn, _ in m.named_parameters()], *res):
            assert torch.equal(a, b), name
    if routing == "stochastic":  # the last x again, under other seeds: other draws, so other rounded counts
        drawn = []
        for seed in (7, 8, 7):
            torch.cuda.manual_seed(seed)
            drawn.append(graphed(x.clone().requires_grad_(True))[3].clone())
        assert torch.equal(drawn[0], drawn[2]) and not torch.equal(drawn[0], drawn[1])
        assert not torch.equal(drawn[0], counts)


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["topk", "token_rounding"])
def test_gpu_cuda_graph_training_step(routing):
    """A whole training step (forward + backward + Adam(capturable=True) step) through the triton backend,
    captured in one CUDA graph and replayed, matches the same steps run eagerly; with token rounding too, whose
    static-length routing (no host sync) makes it capturable."""
    torch.manual_seed(0)
    options = {"routing": "token_rounding", "m_tile": 32} if routing == "token_rounding" else {}
    model = _Block(256, 128, 8, 2, torch.float32, **options)
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    opt_twin = torch.optim.Adam(twin.parameters(), lr=1e-3, capturable=True)
    batches = [torch.randn(384, 256, device="cuda") for _ in range(6)]
    static_x = torch.zeros(384, 256, device="cuda")

    def step(m, o, x):
        y, aux = m(x)
        loss = y.square().mean() + aux
        loss.backward()
        o.step()
        return loss

    # warm-up on a side stream (kernel compilation, optimizer state, allocator pools), as torch.cuda.graphs
    # requires; the twin takes the same steps eagerly
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in batches[:3]:
            static_x.copy_(x)
            opt.zero_grad(set_to_none=True)
            step(model, opt, static_x)
    torch.cuda.current_stream().wait_stream(side)
    for x in batches[:3]:
        opt_twin.zero_grad(set_to_none=True)
        step(twin, opt_twin, x)

    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = step(model, opt, static_x)

    for x in batches[3:]:
        static_x.copy_(x)
        graph.replay()
        opt_twin.zero_grad(set_to_none=True)
        loss_ref = step(twin, opt_twin, x)
        torch.cuda.synchronize()
        assert rel_err(static_loss, loss_ref) < 1e-4
    for (name, p), p_ref in zip(model.named_parameters(), twin.parameters()):
        assert rel_err(p, p_ref) < 1e-4, name
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _small_case(t, d, n, e, seed, device="cpu"):
    p = random_problem(t, d, n, e, seed=seed)
    ids = torch.rand(t, e, generator=torch.Generator().manual_seed(seed)).topk(2, dim=1).indices
    return ({k: v.to(device) for k, v in p.items() if v is not None}, routing_from_topk(ids.to(device), e),
            torch.rand(2 * t, generator=torch.Generator().manual_seed(seed + 1)).to(device))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int64])
@pytest.mark.parametrize("field", ["row_token", "pair_row", "expert_offsets"])
def test_routing_arrays_must_be_int32(dtype, field):
    """A hand-built Routing whose arrays are not int32 is refused, naming the field: uint8 indexed the scores as a
    boolean mask (a silently wrong output, before session 82), int64 failed only in the backward's score gradient."""
    import dataclasses

    p, r, scores = _small_case(7, 8, 4, 3, seed=1)
    bad = dataclasses.replace(r, **{field: getattr(r, field).to(dtype)})
    for backend in ("torch", "triton"):
        with pytest.raises(TypeError, match=f"routing.{field} must be an int32 tensor"):
            sonicmoe.experts(p["x"], p["w1"], p["w2"], bad, scores, backend=backend)


def test_zero_width_experts_are_refused():
    p, r, scores = _small_case(5, 8, 4, 3, seed=2)
    with pytest.raises(ValueError, match=r"w1 must have shape \(E, 2n, d=8\) with n >= 1"):
        sonicmoe.experts(p["x"], p["w1"][:, :0], p["w2"][:, :, :0], r, scores, backend="torch")


@pytest.mark.interpreter
def test_create_graph_through_the_kernels_raises(device):
    """The Triton backwards' gradients come from kernels, with no graph of their own: asking for one
    (create_graph=True: a gradient penalty, a Hessian-vector product, torch.func.grad) raises at once. Before session
    87 only a later ``.backward()`` raised; ``torch.autograd.grad`` with explicit inputs silently returned the
    first-order terms (the experts'), and the pair-score kernel's gradient had no guard at all."""
    from sonicmoe.token_rounding import token_rounding

    p, r, scores = _small_case(9, 16, 8, 3, seed=3, device=device)
    x, w1 = p["x"].requires_grad_(True), p["w1"].requires_grad_(True)

    def experts(x_, backend="triton"):
        return sonicmoe.experts(x_, w1, p["w2"], r, scores, backend=backend)

    with pytest.raises(RuntimeError, match=r"the experts \(backend='triton'\).*create_graph=True"):
        torch.autograd.grad(experts(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="create_graph=True"):  # torch.func.grad always asks for a graph
        torch.func.grad(lambda x_: experts(x_).float().square().sum())(x.detach())
    (dx,) = torch.autograd.grad(experts(x).square().sum(), x)  # first order: as before
    assert torch.isfinite(dx).all() and dx.abs().sum() > 0
    # the torch backend is differentiable twice: the second-order term the kernels' backward cannot give
    (dx,) = torch.autograd.grad(experts(x, "torch").square().sum(), x, create_graph=True)
    (dw1,) = torch.autograd.grad(dx.square().sum(), w1)
    assert dw1.abs().sum() > 0
    # the fused router's backward kernel, and token rounding's pair-score kernel
    g = torch.Generator().manual_seed(5)
    xr = torch.randn(16, 8, generator=g).to(device).requires_grad_(True)
    wr = torch.randn(4, 8, generator=g).to(device).requires_grad_(True)
    router = router_topk(xr, wr, 2, use_kernel=True)
    with pytest.raises(RuntimeError, match="fused router kernel.*create_graph=True"):
        torch.autograd.grad(router.topk_scores.square().sum(), xr, create_graph=True)
    tr = token_rounding(router_topk(xr, wr, 2, use_kernel=False), m_tile=4, use_kernel=True, warn=False)
    with pytest.raises(RuntimeError, match="pair-score kernel.*create_graph=True"):
        torch.autograd.grad(tr.pair_scores.square().sum(), xr, create_graph=True)
    tr = token_rounding(router_topk(xr, wr, 2, use_kernel=False), m_tile=4, use_kernel=False, warn=False)
    (dxr,) = torch.autograd.grad(tr.pair_scores.square().sum(), xr, create_graph=True)  # torch ops: fine
    assert dxr.requires_grad


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp16_overflow_of_a_shows_in_the_gradients(backend, device):
    """float16: A = silu(gate)·up above 65504 overflows where the forward stores it, so the output is not finite;
    the backward differentiates that forward, so dS and dW2 are not finite either (a GradScaler then skips the step).
    The dH kernel recomputes A from H in float32; before it rounded A to the stored dtype as the forward did, its dS
    and dW2 came out finite (finite problems' values: test_kernels.py's dH tests against dh_ref)."""
    t, d, n, e = 3, 16, 16, 4
    g = torch.Generator().manual_seed(31)
    x = torch.randn(t, d, generator=g) * 0.01
    x[:, 0] = 1.0
    w1 = torch.randn(e, 2 * n, d, generator=g) * 0.01
    w1[:, 0, 0] = w1[:, n, 0] = 300.0  # gate and up channel 0 = 300: A ≈ 9e4 > 65504 on every row
    w2 = torch.randn(e, d, n, generator=g) * 0.01
    routing = routing_from_topk(torch.arange(e).repeat(t, 1).to(device), e)  # K = E
    scores = torch.rand(t * e, generator=g) + 0.1
    leaves = [v.to(device=device, dtype=torch.float16).requires_grad_(True) for v in (x, w1, w2, scores)]
    out = sonicmoe.experts(leaves[0], leaves[1], leaves[2], routing, leaves[3], backend=backend)
    assert not torch.isfinite(out).all()
    out.float().sum().backward()
    assert not torch.isfinite(leaves[3].grad).all(), "dS finite for a forward whose A overflowed"
    assert not torch.isfinite(leaves[2].grad).all(), "dW2 finite for a forward whose A overflowed"
