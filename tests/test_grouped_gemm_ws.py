"""The warp-specialised ping-pong varlen-M GEMM (sonicmoe/ops/grouped_gemm_ws.py).

The Gluon kernel needs an sm_90 GPU (tests marked ``gpu``); its tile table, config, dispatch rule and
reference run on CPU too.
"""

from __future__ import annotations

import pytest
import torch
import triton

from sonicmoe.ops import grouped_gemm, grouped_gemm_ws
from sonicmoe.ops.common import interpreting, sized_for_operands
from sonicmoe.ops.grouped_gemm import varlen_m_gemm, varlen_m_gemm_ref
from sonicmoe.ops.grouped_gemm_ws import (
    routing_tile_table,
    tile_table,
    tile_table_ref,
    tile_tables,
    ws_config,
    ws_smem_bytes,
    ws_supported,
    ws_varlen_m_gemm,
    ws_varlen_m_gemm_ref,
)
from sonicmoe.routing import routing_from_pairs, routing_from_topk
from sonicmoe.testing import random_topk_routing, rel_err


def _offsets(counts: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)


@pytest.mark.interpreter
@pytest.mark.parametrize("counts,block_m", [
    ([5, 0, 130, 64, 0, 1], 64),  # empty experts, a count that is a tile multiple, a single row
    ([0, 0, 0], 64),  # no rows at all
    ([200], 16),
    ([(i * 37) % 11 for i in range(300)], 64),  # E > 256: the table kernel's narrower blocks
])
def test_tile_table_matches_reference(counts, block_m, device):
    off = _offsets(counts, device)
    got = tile_table(off, sum(counts), block_m)
    ref = tile_table_ref(off.cpu(), sum(counts), block_m)
    assert got.shape == ref.shape
    assert torch.equal(got.cpu(), ref)
    assert int(ref[0, 0]) == sum((c + block_m - 1) // block_m for c in counts)


@pytest.mark.interpreter
@pytest.mark.parametrize("counts", [[5, 0, 130, 64, 0, 1], [(i * 37) % 300 for i in range(300)]], ids=["small", "E300"])
def test_two_tile_tables_in_one_launch(counts, device):
    """tile_tables fills both heights' tables in one launch (programs split between them), each equal to the one
    built alone, for the heights the Gluon kernels use."""
    off = _offsets(counts, device)
    r = sum(counts)
    tables = tile_tables(off, r, (64, 128))
    for bm, got in zip((64, 128), tables, strict=True):
        assert torch.equal(got.cpu(), tile_table_ref(off.cpu(), r, bm))
    with pytest.raises(ValueError, match="block_ms"):
        tile_tables(off, r, (16, 32, 64))


@pytest.mark.interpreter
def test_routing_tile_table_shared_and_rebuilt(device):
    """routing_tile_table builds every height of TABLE_HEIGHTS at the first request and hands the same tables to
    later ones; an in-place change of expert_offsets (its version counter) or a new offsets tensor rebuilds them.
    The heights are those of the kernels that ask (ping-pong GEMM, up-projection, dH)."""
    from sonicmoe.ops import dh_ws, up_proj_ws

    assert set(grouped_gemm_ws.TABLE_HEIGHTS) == {grouped_gemm_ws.BLOCK_M, up_proj_ws.BLOCK_M, dh_ws.BLOCK_M}
    routing = routing_from_pairs(torch.tensor([0, 1, 1, 2, 3, 3], device=device),
                                 torch.tensor([1, 0, 2, 2, 0, 1], device=device), 4, 3)
    first = routing_tile_table(routing, 128)
    small = routing_tile_table(routing, 64)  # built by the same launch: a cache hit
    assert routing_tile_table(routing, 128) is first and routing_tile_table(routing, 64) is small
    assert torch.equal(first.cpu(), tile_table_ref(routing.expert_offsets.cpu(), 6, 128))
    assert torch.equal(small.cpu(), tile_table_ref(routing.expert_offsets.cpu(), 6, 64))
    odd = routing_tile_table(routing, 32)  # a height outside TABLE_HEIGHTS: built alone
    assert torch.equal(odd.cpu(), tile_table_ref(routing.expert_offsets.cpu(), 6, 32))
    routing.expert_offsets[1:] = torch.tensor([0, 0, 6], device=device, dtype=torch.int32)  # all rows to expert 2
    rebuilt = routing_tile_table(routing, 128)
    assert rebuilt is not first and int(rebuilt[1, 0]) == 2
    routing.expert_offsets = torch.tensor([0, 6, 6, 6], device=device, dtype=torch.int32)
    assert int(routing_tile_table(routing, 64)[1, 0]) == 0


@pytest.mark.interpreter
def test_routing_tile_table_under_inference_mode(device):
    """A routing made under torch.inference_mode (inference tensors have no version counter; reading it raised, and
    every Gluon forward kernel asks for this table): the table is built, cached, and equal to the reference."""
    with torch.inference_mode():
        routing = routing_from_pairs(torch.tensor([0, 1, 1, 2, 3, 3], device=device),
                                     torch.tensor([1, 0, 2, 2, 0, 1], device=device), 4, 3)
        first = routing_tile_table(routing, 128)
        assert routing_tile_table(routing, 128) is first
        assert torch.equal(first.cpu(), tile_table_ref(routing.expert_offsets.cpu(), 6, 128))


@pytest.mark.gpu
def test_gpu_layer_under_inference_mode():
    """MoE.eval() in bf16 under torch.inference_mode on a shape whose forward takes the Gluon kernels (n = 128, 1024
    rows per expert): the same bits as under torch.no_grad (it raised "Inference tensors do not track version
    counter" before session 83)."""
    import sonicmoe

    torch.manual_seed(0)
    m = sonicmoe.MoE(256, 128, 4, 1, backend="triton", device="cuda", dtype=torch.bfloat16).eval()
    x = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = m(x)
    with torch.inference_mode():
        got = m(x)
    assert torch.equal(got, want)


def test_ws_config_fits_shared_memory():
    """The deepest A ring that fits beside B[e]'s resident block and the two staging buffers, at most MAX_STAGES."""
    for k in range(64, grouped_gemm_ws.MAX_K + 1, 64):
        cfg = ws_config(k)
        cap = grouped_gemm_ws.MAX_STAGES
        assert cfg is not None and 1 <= cfg["STAGES"] <= cap
        used = ws_smem_bytes(k, cfg["STAGES"], cfg["BLOCK_N"])
        more = ws_smem_bytes(k, cfg["STAGES"] + 1, cfg["BLOCK_N"])
        assert used <= grouped_gemm_ws.SMEM_BUDGET
        assert more > grouped_gemm_ws.SMEM_BUDGET or cfg["STAGES"] == cap
    # the 7B down-projection (k = n = 256) and every smaller k: 16 slots
    assert all(ws_config(kk)["STAGES"] == 16 for kk in range(64, 257, 64))
    for k in (0, 32, 100, 320, 512):
        assert ws_config(k) is None


@pytest.mark.skipif(not grouped_gemm_ws.HAVE_GLUON, reason="Gluon ships with Triton >= 3.5")
def test_shared_layout_is_built_once_and_equals_the_default():
    """The cached NVMMA layout of the Gluon launches equals Gluon's default for the block and dtype (swizzle
    from the row's bytes: 64 bf16 and 64 fp16 elements 128 B, 32 of them 64 B) and is one object per pair."""
    from triton.experimental.gluon import language as gl

    for block, dtype, gl_dtype in (((64, 64), torch.bfloat16, gl.bfloat16), ((64, 128), torch.float16, gl.float16),
                                   ((128, 32), torch.bfloat16, gl.bfloat16)):
        got = grouped_gemm_ws.shared_layout(block, dtype)
        assert got == gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)
        assert grouped_gemm_ws.shared_layout(block, dtype) is got
    assert grouped_gemm_ws.shared_layout((64, 64), torch.bfloat16).swizzle_byte_width == 128
    assert grouped_gemm_ws.shared_layout((128, 32), torch.bfloat16).swizzle_byte_width == 64


def test_ws_config_dxt_form_fits_shared_memory():
    """The dX̃ form (B not transposed) takes k up to MAX_K_DXT (k = 2n = 512 at the 7B shape: an 8-slot ring)."""
    for k in range(64, grouped_gemm_ws.MAX_K_DXT + 1, 64):
        cfg = ws_config(k, transpose_b=False)
        assert cfg is not None and 1 <= cfg["STAGES"] <= grouped_gemm_ws.MAX_STAGES
        assert ws_smem_bytes(k, cfg["STAGES"], cfg["BLOCK_N"]) <= grouped_gemm_ws.SMEM_BUDGET
        assert ws_smem_bytes(k, cfg["STAGES"] + 1, cfg["BLOCK_N"]) > grouped_gemm_ws.SMEM_BUDGET \
            or cfg["STAGES"] == grouped_gemm_ws.MAX_STAGES
        if k <= grouped_gemm_ws.MAX_K:
            assert cfg == ws_config(k)
    assert ws_config(512, transpose_b=False)["STAGES"] == 8
    for k in (0, 32, 100, 576, 1024):
        assert ws_config(k, transpose_b=False) is None


def test_reference_matches_per_row_products():
    """The twin (the float32 per-expert loop both varlen-M references share) equals row-by-row products with
    each row's expert read off the offsets, with empty experts (0, 2, 5) and a bias."""
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, 30, (90,), generator=g)
    exp = torch.tensor([1, 3, 4] * 30)
    routing = routing_from_pairs(tok, exp, 30, 6)
    r = routing.num_rows
    row_expert = torch.bucketize(torch.arange(r), routing.expert_offsets[1:].long(), right=True)
    for tb, b_shape in ((True, (6, 24, 16)), (False, (6, 16, 24))):
        a = torch.randn(r, 16, generator=g)
        b = torch.randn(*b_shape, generator=g)
        bias = torch.randn(6, 24, generator=g)
        got = ws_varlen_m_gemm_ref(a, b, bias, routing.expert_offsets, transpose_b=tb)
        want = torch.stack([a[i] @ (b[e].t() if tb else b[e]) + bias[e] for i, e in enumerate(row_expert.tolist())])
        assert sorted(set(row_expert.tolist())) == [1, 3, 4]
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got, varlen_m_gemm_ref(a, b, bias, routing, transpose_b=tb))


def test_not_supported_off_hopper_or_out_of_range(monkeypatch):
    """CPU tensors, float32, k outside the config, few rows per expert or SONICMOE_GLUON=0 never reach the Gluon
    kernel; the dX̃ form (B (E, k, m)) does up to k = 512 unless SONICMOE_GLUON_DXT=0."""
    e, m, k = 4, 256, 256
    a = torch.zeros(e * grouped_gemm_ws.MIN_ROWS_PER_EXPERT, k, dtype=torch.bfloat16)
    b = torch.zeros(e, m, k, dtype=torch.bfloat16)
    assert not ws_supported(a, b, a.shape[0], transpose_b=True)  # CPU
    if torch.cuda.is_available():
        a, b = a.cuda(), b.cuda()
        assert not ws_supported(a.float(), b.float(), a.shape[0], transpose_b=True)
        assert not ws_supported(a[:-1], b, a.shape[0] - 1, transpose_b=True)
        wide = torch.zeros(e, m, 320, dtype=torch.bfloat16, device="cuda")
        assert not ws_supported(torch.zeros(a.shape[0], 320, dtype=torch.bfloat16, device="cuda"), wide,
                                a.shape[0], transpose_b=True)
        hopper = torch.cuda.get_device_capability() == (9, 0) and grouped_gemm_ws.HAVE_GLUON
        assert ws_supported(a, b, a.shape[0], transpose_b=True) == hopper
        # the dX̃ form: B (E, k, m), k = 512 taken, 576 not; too few rows per expert not
        a512 = torch.zeros(a.shape[0], 512, dtype=torch.bfloat16, device="cuda")
        b512 = torch.zeros(e, 512, m, dtype=torch.bfloat16, device="cuda")
        assert ws_supported(a512, b512, a.shape[0], transpose_b=False) == hopper
        assert not ws_supported(a512[:-64], b512, a.shape[0] - 64, transpose_b=False)
        assert not ws_supported(torch.zeros(a.shape[0], 576, dtype=torch.bfloat16, device="cuda"),
                                torch.zeros(e, 576, m, dtype=torch.bfloat16, device="cuda"), a.shape[0],
                                transpose_b=False)
        monkeypatch.setenv("SONICMOE_GLUON_DXT", "0")
        assert not ws_supported(a512, b512, a.shape[0], transpose_b=False)
        assert ws_supported(a, b, a.shape[0], transpose_b=True) == hopper
        monkeypatch.setenv("SONICMOE_GLUON_DXT", "1")
        monkeypatch.setenv("SONICMOE_GLUON", "0")
        assert not ws_supported(a, b, a.shape[0], transpose_b=True)
        assert not ws_supported(a512, b512, a.shape[0], transpose_b=False)


def test_supported_rule_on_a_faked_sm90(fake_sm90):
    """The checks above where no GPU is (CPU tensors' stand-ins on a faked sm_90 device): taken on sm_90 only (not on
    sm_80 or sm_100), from MIN_ROWS_PER_EXPERT rows per expert on (not one row fewer), and only for output rows of a
    whole number of 16 bytes (TMA: m = 100 bf16 columns are 200 bytes)."""
    e, m, k = 2, 128, 64
    rows = e * grouped_gemm_ws.MIN_ROWS_PER_EXPERT
    a, b = fake_sm90(torch.zeros(rows, k, dtype=torch.bfloat16), torch.zeros(e, m, k, dtype=torch.bfloat16))
    assert ws_supported(a, b, rows, transpose_b=True)
    assert not ws_supported(a, b, rows - 1, transpose_b=True)
    assert not ws_supported(a, fake_sm90(torch.zeros(e, 100, k, dtype=torch.bfloat16)), rows, transpose_b=True)
    # B of no output columns (no TMA box), A's columns other than B's reduction k, mixed dtypes: both forms
    for tb in (True, False):
        b_of = (lambda m_, k_: (e, m_, k_)) if tb else (lambda m_, k_: (e, k_, m_))
        assert ws_supported(a, fake_sm90(torch.zeros(*b_of(m, k), dtype=torch.bfloat16)), rows, transpose_b=tb)
        assert not ws_supported(a, fake_sm90(torch.zeros(*b_of(0, k), dtype=torch.bfloat16)), rows, transpose_b=tb)
        assert not ws_supported(a, fake_sm90(torch.zeros(*b_of(m, 2 * k), dtype=torch.bfloat16)), rows,
                                transpose_b=tb)
        assert not ws_supported(a, fake_sm90(torch.zeros(*b_of(m, k), dtype=torch.float16)), rows, transpose_b=tb)
    for cap in ((8, 0), (10, 0)):
        fake_sm90.capability = cap
        assert not ws_supported(a, b, rows, transpose_b=True), cap


def test_supported_rule_checks_each_operand_on_a_faked_sm90(fake_sm90):
    """Each operand's own check of the rule (a faked sm_90): an A or a B whose first element is not 16-byte aligned
    (TMA), a B block of columns with a unit inner stride that is not contiguous (what varlen_m_gemm passes on
    uncopied; the kernel reads B through a flat 2-D view), and CPU tensors with Gluon present; both forms."""
    e, m, k = 2, 128, 64
    rows = e * grouped_gemm_ws.MIN_ROWS_PER_EXPERT
    bf = torch.bfloat16

    def shifted(*shape):  # contiguous, one element (2 bytes) past a 16-byte boundary
        t = torch.zeros(torch.Size(shape).numel() + 1, dtype=bf)[1:].view(*shape)
        assert t.is_contiguous() and t.data_ptr() % 16 == 2
        return t

    a_cpu = torch.zeros(rows, k, dtype=bf)
    for tb in (True, False):
        shape = (e, m, k) if tb else (e, k, m)
        b_cpu = torch.zeros(*shape, dtype=bf)
        a, b = fake_sm90(a_cpu, b_cpu)
        assert ws_supported(a, b, rows, transpose_b=tb)
        assert not ws_supported(fake_sm90(shifted(rows, k)), b, rows, transpose_b=tb)
        assert not ws_supported(a, fake_sm90(shifted(*shape)), rows, transpose_b=tb)
        # B's first `shape` of a wider one: unit inner stride, aligned, not contiguous
        wide = torch.zeros(e, 2 * shape[1], shape[2], dtype=bf)[:, :shape[1]]
        assert wide.shape == shape and wide.stride(-1) == 1 and not wide.is_contiguous()
        assert not ws_supported(a, fake_sm90(wide), rows, transpose_b=tb)
        assert not ws_supported(a_cpu, b_cpu, rows, transpose_b=tb)  # CPU tensors, Gluon "present"


@pytest.mark.interpreter
def test_routing_tile_table_builds_both_heights_in_one_launch(monkeypatch, device):
    """The first request of a routing's table builds every height of TABLE_HEIGHTS by one tile_tables call (one
    launch), whichever height it asks for; the other height's request is then a cache hit (no second build)."""
    builds = []
    real = grouped_gemm_ws.tile_tables

    def counting(offsets, num_rows, block_ms, config=None):
        builds.append(tuple(block_ms))
        return real(offsets, num_rows, block_ms, config)

    monkeypatch.setattr(grouped_gemm_ws, "tile_tables", counting)
    for first, second in ((128, 64), (64, 128)):
        routing = routing_from_pairs(torch.tensor([0, 1, 1, 2, 3, 3, 0], device=device),
                                     torch.tensor([1, 0, 2, 2, 0, 1, 2], device=device), 4, 3)
        builds.clear()
        routing_tile_table(routing, first)
        assert builds == [grouped_gemm_ws.TABLE_HEIGHTS]
        got = routing_tile_table(routing, second)
        assert builds == [grouped_gemm_ws.TABLE_HEIGHTS]
        assert torch.equal(got.cpu(), tile_table_ref(routing.expert_offsets.cpu(), 7, second))


@pytest.mark.parametrize("transpose_b", [True, False])
def test_no_rows_returns_before_any_launch(transpose_b):
    """No routed rows: ws_varlen_m_gemm returns an empty (0, m) C of A's dtype without building a table or launching
    (neither can run here)."""
    e, k, m = 3, 128, 256
    offsets = torch.zeros(e + 1, dtype=torch.int32)
    b = torch.randn(e, m, k).half() if transpose_b else torch.randn(e, k, m).half()
    c = ws_varlen_m_gemm(torch.zeros(0, k, dtype=torch.float16), b, None, offsets, transpose_b=transpose_b)
    assert c.shape == (0, m) and c.dtype == torch.float16


@pytest.mark.interpreter
def test_dispatch(monkeypatch, device):
    """varlen_m_gemm hands the product to the Gluon kernel where ws_supported says so, and never with an
    explicit Triton config."""
    calls = []

    def fake(a, b, bias, offsets, *, transpose_b, table=None):
        calls.append((a.shape, offsets, transpose_b))
        return ws_varlen_m_gemm_ref(a, b, bias, offsets, transpose_b=transpose_b)

    monkeypatch.setattr(grouped_gemm_ws, "ws_supported", lambda a, b, r, transpose_b: transpose_b)
    monkeypatch.setattr(grouped_gemm_ws, "ws_varlen_m_gemm", fake)
    routing = routing_from_topk(torch.tensor([[0, 2], [1, 2], [2, 0]], dtype=torch.int32, device=device), 3)
    a = torch.randn(6, 16, device=device)
    b = torch.randn(3, 8, 16, device=device)
    out = varlen_m_gemm(a, b, None, routing, transpose_b=True)
    assert len(calls) == 1 and calls[0][2] is True and calls[0][1] is routing.expert_offsets
    assert torch.equal(out, varlen_m_gemm_ref(a, b, None, routing, transpose_b=True))
    # on the GPU the pinned tile sized for these float32 operands (the bf16-sized one does not fit shared memory)
    cfg = grouped_gemm._PINNED_INTERP if interpreting() else sized_for_operands(grouped_gemm.pinned_gpu_config(6, 3, 8),
                                                                                 4)
    tri = varlen_m_gemm(a, b, None, routing, transpose_b=True, config=cfg)
    assert len(calls) == 1
    assert rel_err(tri, out) < 1e-5


# (T, d, n, E, K, reason) on the GPU
GPU_CASES = [
    (1, 128, 128, 4, 1, "T=1, K=1"),
    (300, 256, 128, 8, 8, "K=E"),
    (1000, 384, 192, 16, 4, "k=192, d=384: three N-tiles, partial tiles"),
    (777, 200, 256, 40, 2, "d=200: a partial N-tile, empty experts"),
    (4096, 1536, 256, 32, 8, "the 7B widths, 1024 rows per expert"),
    (2500, 640, 64, 3, 2, "k=64: one K-block"),
    (3000, 768, 512, 5, 2, "k=512: the dX~ form only (8-slot ring), partial tiles"),
]


# bf16 everywhere, fp16 once (each dtype, B form, bias and k is its own compiled kernel)
GPU_PARAMS = [(c, torch.bfloat16) for c in GPU_CASES] + [(GPU_CASES[4], torch.float16)]


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", GPU_PARAMS, ids=[f"{c[-1]}-{str(dt)[6:]}" for c, dt in GPU_PARAMS])
def test_gpu_matches_reference_and_triton(case, dtype, monkeypatch):
    """Both B forms, with and without bias: within rounding of the float32 loop, no NaN left by the poison
    fill, bitwise equal to the Triton kernel and to a second run."""
    if not grouped_gemm_ws.HAVE_GLUON or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel needs an sm_90 GPU")
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")
    t, d, n, e, k, _ = case
    if d % 8:
        pytest.skip("TMA needs 16-byte rows of C")
    routing = random_topk_routing(t, e, k, seed=t)
    r = routing.num_rows
    g = torch.Generator(device="cuda").manual_seed(1)
    for tb, b_shape in ((True, (e, d, n)), (False, (e, n, d))):
        if ws_config(n, tb) is None:  # k = 512: the dX̃ form only
            continue
        a = torch.randn(r, n, device="cuda", dtype=dtype, generator=g)
        b = (torch.randn(*b_shape, device="cuda", generator=g) / n ** 0.5).to(dtype)
        for bias in (None, torch.randn(e, d, device="cuda", generator=g).to(dtype)):
            a0, b0 = a.clone(), b.clone()
            ref = ws_varlen_m_gemm_ref(a, b, bias, routing.expert_offsets, transpose_b=tb)
            monkeypatch.setenv("SONICMOE_GLUON", "0")
            tri = varlen_m_gemm(a, b, bias, routing, transpose_b=tb)
            monkeypatch.delenv("SONICMOE_GLUON")
            # the default ring and a shallower one (its slots reused more often)
            for cfg in (ws_config(n, tb), {**ws_config(n, tb), "STAGES": 4}):
                got = ws_varlen_m_gemm(a, b, bias, routing.expert_offsets, transpose_b=tb, config=cfg)
                assert rel_err(got, ref) < 2e-3, (tb, bias is not None, cfg)
                assert torch.equal(got, tri), (tb, bias is not None, cfg)
                assert torch.equal(got, ws_varlen_m_gemm(a, b, bias, routing.expert_offsets, transpose_b=tb,
                                                         config=cfg))
            assert torch.equal(a, a0) and torch.equal(b, b0)


@pytest.mark.gpu
def test_gpu_layer_uses_gluon_down_projection(monkeypatch):
    """At a shape the rule selects, the layer's forward and backward run the Gluon down-projection and dX̃
    GEMM and give the same bits as with SONICMOE_GLUON_DXT=0 and with SONICMOE_GLUON=0 (dH on the Triton kernel
    in every run: the Gluon dH kernel, which SONICMOE_GLUON=0 also turns off, sums dS in another order)."""
    import sonicmoe
    from sonicmoe.testing import random_problem

    if not grouped_gemm_ws.HAVE_GLUON or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel needs an sm_90 GPU")
    monkeypatch.setenv("SONICMOE_GLUON_DH", "0")
    t, d, n, e, k = 4096, 1536, 256, 32, 8
    p = random_problem(t, d, n, e, device="cuda", bias=True, seed=3)
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)

    def run():
        ins = {key: v.to(torch.bfloat16).clone().requires_grad_(True) for key, v in p.items() if v is not None}
        res = sonicmoe.moe(ins["x"], ins["router_weight"], ins["w1"], ins["w2"], ins["b1"], ins["b2"], top_k=k,
                           backend="triton")
        res.out.backward(dout)
        return res.out.detach(), {key: v.grad for key, v in ins.items()}

    grouped_gemm_ws._CALLS.clear()
    on = run()
    calls = grouped_gemm_ws.ws_calls()
    assert any(c["m"] == d and c["k"] == n and c["E"] == e and c["transpose_b"] for c in calls)
    # the backward's dX̃ = dH W1[e] (k = 2n = 512)
    assert any(c["m"] == d and c["k"] == 2 * n and c["E"] == e and not c["transpose_b"] for c in calls)
    for switch in ("SONICMOE_GLUON_DXT", "SONICMOE_GLUON"):
        monkeypatch.setenv(switch, "0")
        off = run()
        assert torch.equal(on[0], off[0])
        for name in on[1]:
            assert torch.equal(on[1][name], off[1][name]), (switch, name)


@pytest.mark.skipif(not grouped_gemm_ws.HAVE_GLUON, reason="this Triton has no Gluon")
def test_gluon_kernels_only_on_the_triton_release_they_were_written_for(monkeypatch):
    """Gluon's API is experimental: the Gluon kernels run on Triton GLUON_TRITON only (other releases take the Triton
    kernels, the same results), unless SONICMOE_GLUON=force; SONICMOE_GLUON=0 turns them off on any release."""
    assert grouped_gemm_ws.triton_release() == tuple(int(p) for p in triton.__version__.split(".")[:2])
    monkeypatch.setattr(grouped_gemm_ws, "interpreting", lambda: False)  # as on a GPU
    gluon = grouped_gemm_ws.GLUON_TRITON
    for release, switch, want in [(gluon, "1", True), ((3, 5), "1", False), ((3, 7), "1", False),
                                  ((3, 7), "force", True), ((), "1", False), (gluon, "0", False)]:
        monkeypatch.setattr(grouped_gemm_ws, "triton_release", lambda release=release: release)
        monkeypatch.setenv("SONICMOE_GLUON", switch)
        assert grouped_gemm_ws.ws_enabled() is want, (release, switch)
