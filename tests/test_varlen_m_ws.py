"""The warp-specialised varlen-M GEMM with a streamed B (sonicmoe/ops/varlen_m_ws.py).

The Gluon kernel needs an sm_90 GPU (tests marked ``gpu``); its config, dispatch rule and reference run on CPU too.
"""

from __future__ import annotations

import pytest
import torch

from sonicmoe.ops import grouped_gemm_ws, varlen_m_ws
from sonicmoe.ops.grouped_gemm import varlen_m_gemm
from sonicmoe.ops.varlen_m_ws import long_config, long_gemm, long_gemm_ref, long_smem_bytes, long_supported
from sonicmoe.testing import random_topk_routing, rel_err


def test_config_fits_shared_memory():
    """Each staging split gets the deepest ring that fits beside its staging buffer, and one slot more would not."""
    for split in (1, 2):
        cfg = long_config(split)
        assert cfg["C_SPLIT"] == split and 2 <= cfg["STAGES"] <= varlen_m_ws.MAX_STAGES
        assert long_smem_bytes(cfg["STAGES"], split) <= varlen_m_ws.SMEM_BUDGET
        assert (cfg["STAGES"] == varlen_m_ws.MAX_STAGES
                or long_smem_bytes(cfg["STAGES"] + 1, split) > varlen_m_ws.SMEM_BUDGET)
    assert long_config(2)["STAGES"] > long_config(1)["STAGES"]
    assert long_config(1, stages=2)["STAGES"] == 2


def test_supported_rejects_on_cpu_and_bad_operands(monkeypatch):
    """Off an sm_90 GPU (here: CPU tensors), with a bias, or SONICMOE_GLUON_LONG=0, the layer keeps the Triton
    kernel (the operand checks run on the GPU: test_gpu_supported_rule)."""
    a = torch.zeros(16, 1024, dtype=torch.bfloat16)
    b = torch.zeros(4, 1024, 512, dtype=torch.bfloat16)
    assert not long_supported(a, b, None, 4096, transpose_b=False)  # CPU
    assert not long_supported(a, b, torch.zeros(4, 512, dtype=torch.bfloat16), 4096, transpose_b=False)
    monkeypatch.setenv("SONICMOE_GLUON_LONG", "0")
    assert not varlen_m_ws.long_enabled()


def test_supported_rule_on_a_faked_sm90(fake_sm90):
    """long_supported where no GPU is (CPU tensors' stand-ins on a faked sm_90 device): taken on sm_90 only (not on
    sm_80 or sm_100), for k from MIN_K on, experts averaging more than FEW_ROWS_PER_EXPERT rows, and a positive
    width (a zero-width block is no work for a kernel)."""
    from sonicmoe.ops.common import FEW_ROWS_PER_EXPERT

    e, m, k = 2, 256, varlen_m_ws.MIN_K
    many = (FEW_ROWS_PER_EXPERT + 1) * e
    a, b = fake_sm90(torch.zeros(16, k, dtype=torch.bfloat16), torch.zeros(e, m, k, dtype=torch.bfloat16))
    assert long_supported(a, b, None, many, transpose_b=True)
    assert not long_supported(a, b, None, FEW_ROWS_PER_EXPERT * e, transpose_b=True)
    assert not long_supported(a, b, None, many, transpose_b=True, width=0)
    short = k - varlen_m_ws.BLOCK_K
    assert not long_supported(fake_sm90(torch.zeros(16, short, dtype=torch.bfloat16)),
                              fake_sm90(torch.zeros(e, m, short, dtype=torch.bfloat16)), None, many, transpose_b=True)
    for cap in ((8, 0), (10, 0)):
        fake_sm90.capability = cap
        assert not long_supported(a, b, None, many, transpose_b=True), cap


def test_supported_rule_rejects_on_a_faked_sm90(fake_sm90):
    """On a faked sm_90, the rule still refuses what the kernel cannot take: a bias (no bias epilogue), tensors that
    are not on the GPU, and an A or a B whose first element is not 16-byte aligned (TMA)."""
    from sonicmoe.ops.common import FEW_ROWS_PER_EXPERT

    e, m, k = 2, 256, varlen_m_ws.MIN_K
    many = (FEW_ROWS_PER_EXPERT + 1) * e
    bf = torch.bfloat16
    a_cpu, b_cpu = torch.zeros(16, k, dtype=bf), torch.zeros(e, m, k, dtype=bf)
    a, b = fake_sm90(a_cpu, b_cpu)
    assert long_supported(a, b, None, many, transpose_b=True)
    assert not long_supported(a, b, fake_sm90(torch.zeros(e, m, dtype=bf)), many, transpose_b=True)
    assert not long_supported(a_cpu, b_cpu, None, many, transpose_b=True)  # CPU tensors, Gluon "present"

    def shifted(*shape):  # contiguous, one element (2 bytes) past a 16-byte boundary
        t = torch.zeros(torch.Size(shape).numel() + 1, dtype=bf)[1:].view(*shape)
        assert t.is_contiguous() and t.data_ptr() % 16 == 2
        return fake_sm90(t)

    assert not long_supported(shifted(16, k), b, None, many, transpose_b=True)
    assert not long_supported(a, shifted(e, m, k), None, many, transpose_b=True)


@pytest.mark.parametrize("transpose_b", [False, True])
def test_no_rows_returns_before_any_launch(transpose_b):
    """No routed rows: long_gemm checks its operands and returns an empty C of the column block's width (the rest of
    B's columns from col0 where no width is given), or the caller's view, without a launch (none can run here)."""
    from sonicmoe.routing import routing_from_pairs

    e, k, m = 3, 128, 512
    none = torch.zeros(0, dtype=torch.int32)
    routing = routing_from_pairs(none, none, 4, e)
    assert routing.num_rows == 0
    a = torch.zeros(0, k, dtype=torch.float16)
    b = torch.randn(e, m, k).half() if transpose_b else torch.randn(e, k, m).half()
    assert long_gemm(a, b, None, routing, transpose_b=transpose_b).shape == (0, m)
    assert long_gemm(a, b, None, routing, transpose_b=transpose_b, col0=256).shape == (0, 256)
    assert long_gemm(a, b, None, routing, transpose_b=transpose_b, col0=256, width=256).shape == (0, 256)
    wide = torch.zeros(0, 2 * m, dtype=torch.float16)
    out = long_gemm(a, b, None, routing, transpose_b=transpose_b, out=wide[:, 256:512], col0=0, width=256)
    assert out.shape == (0, 256) and out.data_ptr() == wide[:, 256:512].data_ptr()
    with pytest.raises(ValueError, match="col0, width"):
        long_gemm(a, b, None, routing, transpose_b=transpose_b, col0=512)  # nothing left to write


def test_layer_prefers_the_down_projection_form(monkeypatch):
    """The layer's rule takes the down-projection form only, both forms under SONICMOE_GLUON_LONG=all."""
    monkeypatch.delenv("SONICMOE_GLUON_LONG", raising=False)
    assert varlen_m_ws.long_preferred(True) and not varlen_m_ws.long_preferred(False)
    monkeypatch.setenv("SONICMOE_GLUON_LONG", "all")
    assert varlen_m_ws.long_preferred(False)


@pytest.mark.parametrize("transpose_b", [False, True])
def test_reference_column_block(transpose_b):
    """long_gemm_ref's column block equals that block of the whole product, written into ``out`` when given."""
    routing = random_topk_routing(40, 4, 2, seed=0, device="cpu")
    r, k, m = routing.num_rows, 64, 48
    g = torch.Generator().manual_seed(0)
    a = torch.randn(r, k, generator=g)
    b = torch.randn(4, m, k, generator=g) if transpose_b else torch.randn(4, k, m, generator=g)
    full = long_gemm_ref(a, b, None, routing, transpose_b=transpose_b)
    assert full.shape == (r, m)
    block = long_gemm_ref(a, b, None, routing, transpose_b=transpose_b, col0=16, width=16)
    assert torch.equal(block, full[:, 16:32])
    out = torch.full((r, 2 * m), float("nan"))
    long_gemm_ref(a, b, None, routing, transpose_b=transpose_b, out=out[:, m:m + 16], col0=32, width=16)
    assert torch.equal(out[:, m:m + 16], full[:, 32:48]) and out[:, :m].isnan().all()
    with pytest.raises(ValueError, match="bias"):
        long_gemm(a, b, torch.zeros(4, m), routing, transpose_b=transpose_b)


def test_long_gemm_rejects_bad_operands_before_any_launch():
    """long_gemm names the argument and what it expects: float32 operands, a reduction that does not match or is off
    BLOCK_K, non-contiguous operands, and column blocks off BLOCK_N or past B's columns."""
    routing = random_topk_routing(40, 4, 2, seed=0, device="cpu")
    r = routing.num_rows
    a = torch.zeros(r, 128, dtype=torch.bfloat16)
    b = torch.zeros(4, 128, 512, dtype=torch.bfloat16)
    cases = [
        (a.float(), b.float(), {}, "bf16 or fp16"),
        (a[:, :64].contiguous(), b, {}, "reduction"),
        (torch.zeros(r, 96, dtype=torch.bfloat16), torch.zeros(4, 96, 512, dtype=torch.bfloat16), {}, "multiple of 64"),
        (a, b.transpose(1, 2).contiguous().transpose(1, 2), {}, "contiguous"),
        (a, b, {"col0": 0, "width": 128}, "col0, width"),
        (a, b, {"col0": 0, "width": 0}, "col0, width"),
        (a, b, {"col0": 256, "width": 512}, "col0, width"),
        (a, b, {"col0": -256, "width": 256}, "col0, width"),  # inside B's columns by its end, not by its start
        (a, b, {"num_programs": 0}, "num_programs"),
    ]
    for aa, bb, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            long_gemm(aa, bb, None, routing, transpose_b=False, **kw)


def test_long_gemm_messages_give_the_values():
    """The ValueErrors give the numbers they are about: a's columns and B's reduction k in their places, and the
    column block's width as taken (the default width, B's columns from col0, where none is given)."""
    routing = random_topk_routing(40, 4, 2, seed=0, device="cpu")
    r = routing.num_rows
    b = torch.zeros(4, 128, 512, dtype=torch.bfloat16)  # dX̃ form: k = 128, m = 512
    cases = [
        (torch.zeros(r, 64, dtype=torch.bfloat16), {}, "with a's 64 columns = B's reduction k = 128, a multiple of 64"),
        (torch.zeros(r, 128, dtype=torch.bfloat16), {"col0": 512}, "got col0=512, width=0"),
        (torch.zeros(r, 128, dtype=torch.bfloat16), {"col0": 384}, "got col0=384, width=128"),
        (torch.zeros(r, 128, dtype=torch.bfloat16), {"col0": 256, "width": 512}, "got col0=256, width=512"),
    ]
    for a, kw, want in cases:
        with pytest.raises(ValueError) as info:
            long_gemm(a, b, None, routing, transpose_b=False, **kw)
        assert want in str(info.value), (kw, str(info.value))


GPU_CASES = [  # T, d, n, E, K: dX̃ has k = 2n, m = d; the down-projection k = n, m = d
    (2048, 512, 384, 8, 2),  # 2n = 768 (k > 512): experts with uneven counts, partial last tiles
    (1000, 768, 640, 16, 4),  # counts not tile multiples, some experts with under 128 rows
    (300, 256, 512, 64, 8),  # many experts with few or no rows
]


def _gpu_skip():
    if not torch.cuda.is_available() or not grouped_gemm_ws.HAVE_GLUON or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel needs an sm_90 GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}x{c[3]}x{c[4]}" for c in GPU_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_matches_reference_and_triton(case, dtype, monkeypatch):
    """Both B forms (dX̃: B (E, 2n, d) MN-major; the down-projection form: B (E, d, n) K-major), both staging
    splits, whole and in column blocks written into a wider C: within rounding of the float32 loop, bitwise equal
    to the Triton kernel and to a second run, no NaN left by the poison fill, the inputs untouched."""
    _gpu_skip()
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")
    monkeypatch.setenv("SONICMOE_GLUON_LONG", "0")  # the Triton kernel below
    t, d, n, e, k = case
    routing = random_topk_routing(t, e, k, seed=t)
    r = routing.num_rows
    g = torch.Generator(device="cuda").manual_seed(1)
    for tb, kk, b_shape in ((False, 2 * n, (e, 2 * n, d)), (True, n, (e, d, n))):
        a = torch.randn(r, kk, device="cuda", dtype=dtype, generator=g)
        b = (torch.randn(*b_shape, device="cuda", generator=g) / kk ** 0.5).to(dtype)
        a0, b0 = a.clone(), b.clone()
        ref = long_gemm_ref(a, b, None, routing, transpose_b=tb)
        tri = varlen_m_gemm(a, b, None, routing, transpose_b=tb)
        for split in (1, 2):
            cfg = long_config(split)
            got = long_gemm(a, b, None, routing, transpose_b=tb, config=cfg)
            assert not got.isnan().any()
            assert rel_err(got, ref) < 2e-3, (tb, split)
            assert torch.equal(got, tri), (tb, split)
            assert torch.equal(got, long_gemm(a, b, None, routing, transpose_b=tb, config=cfg))
            # column blocks of 256 written into a wider poisoned C, as gemm_then_gather_sum runs them
            wide = torch.full((r, d + 256), float("nan"), device="cuda", dtype=dtype)
            for c0 in range(0, d, 256):
                long_gemm(a, b, None, routing, transpose_b=tb, out=wide[:, 128 + c0:128 + c0 + 256], col0=c0,
                          width=256, config=cfg)
            assert torch.equal(wide[:, 128:128 + d], tri), (tb, split)
            assert wide[:, :128].isnan().all() and wide[:, 128 + d:].isnan().all()
        assert torch.equal(a, a0) and torch.equal(b, b0)


@pytest.mark.gpu
def test_gpu_supported_rule():
    """On an sm_90 GPU the rule takes the dX̃ and down-projection forms with long reductions and many rows per
    expert, and rejects k short or not a multiple of BLOCK_K, a width off BLOCK_N, few rows per expert, a bias,
    non-contiguous or mixed-dtype operands."""
    _gpu_skip()
    dev, bf = "cuda", torch.bfloat16
    a = torch.zeros(4096, 1024, dtype=bf, device=dev)
    b = torch.zeros(4, 1024, 512, dtype=bf, device=dev)
    assert long_supported(a, b, None, 4096, transpose_b=False)
    assert long_supported(a, torch.zeros(4, 512, 1024, dtype=bf, device=dev), None, 4096, transpose_b=True)
    assert long_supported(a, b, None, 4096, transpose_b=False, width=256)
    assert not long_supported(a, b, None, 4096, transpose_b=False, width=128)
    assert not long_supported(a, b, None, 4 * 384, transpose_b=False)  # few rows per expert
    assert not long_supported(a[:, :512], b[:, :512], None, 4096, transpose_b=False)  # k = 512: ping-pong's
    assert not long_supported(a[:, :1000].contiguous(), b[:, :1000].contiguous(), None, 4096, transpose_b=False)
    assert not long_supported(a, b.half(), None, 4096, transpose_b=False)
    assert not long_supported(a, b, torch.zeros(4, 512, dtype=bf, device=dev), 4096, transpose_b=False)
    assert not long_supported(a.t(), b, None, 4096, transpose_b=False)


@pytest.mark.gpu
def test_gpu_empty_and_single_row():
    """No rows at all returns an empty C without a launch; T = 1, K = 1 gives the one row of the float32 loop."""
    _gpu_skip()
    e, n, d = 4, 384, 256
    b = (torch.randn(e, 2 * n, d, device="cuda") / (2 * n) ** 0.5).to(torch.bfloat16)
    routing = random_topk_routing(1, e, 1, seed=0)
    a = torch.randn(routing.num_rows, 2 * n, device="cuda", dtype=torch.bfloat16)
    got = long_gemm(a, b, None, routing, transpose_b=False)
    assert got.shape == (1, d) and rel_err(got, long_gemm_ref(a, b, None, routing, transpose_b=False)) < 2e-3
    empty = long_gemm(a[:0], b, None, _no_rows(e), transpose_b=False)
    assert empty.shape == (0, d)


def _no_rows(e: int):
    from sonicmoe.routing import routing_from_topk

    return routing_from_topk(torch.zeros(0, 1, dtype=torch.int32, device="cuda"), e)


@pytest.mark.gpu
def test_gpu_layer_runs_it_for_the_down_projection(monkeypatch):
    """At a shape the rule selects (n > 256, many rows per expert), the layer's forward runs the down-projection on
    this kernel, its backward keeps dX̃ on the Triton kernel, and the output and every gradient have the same bits as
    with SONICMOE_GLUON_LONG=0 and with dX̃ on this kernel too (``all``)."""
    import sonicmoe
    from sonicmoe.testing import random_problem

    _gpu_skip()
    t, d, n, e, k = 4096, 512, 640, 16, 4  # the down-projection's k = n = 640 >= MIN_K
    p = random_problem(t, d, n, e, device="cuda", seed=5)
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)

    def run():
        ins = {key: v.to(torch.bfloat16).clone().requires_grad_(True) for key, v in p.items() if v is not None}
        res = sonicmoe.moe(ins["x"], ins["router_weight"], ins["w1"], ins["w2"], top_k=k, backend="triton")
        res.out.backward(dout)
        return res.out.detach(), {key: v.grad for key, v in ins.items()}

    varlen_m_ws._CALLS.clear()
    on = run()
    calls = varlen_m_ws.long_calls()
    assert [(c["m"], c["k"], c["transpose_b"]) for c in calls] == [(d, n, True)]
    for value in ("0", "all"):
        monkeypatch.setenv("SONICMOE_GLUON_LONG", value)
        varlen_m_ws._CALLS.clear()
        other = run()
        assert any(not c["transpose_b"] for c in varlen_m_ws.long_calls()) == (value == "all")
        assert torch.equal(on[0], other[0]), value
        for name in on[1]:
            assert torch.equal(on[1][name], other[1][name]), (value, name)


def test_output_or_new_checks_the_callers_view():
    """The launchers' shared output check: a new tensor of the shape without ``out``; the caller's view into a wider
    tensor as given; a wrong shape, dtype, device or inner stride raises a ValueError naming ``out`` and the expected
    shape."""
    from sonicmoe.ops.common import output_or_new

    like = torch.zeros(3, dtype=torch.float16)
    assert output_or_new(None, (4, 8), like).shape == (4, 8)
    wide = torch.zeros(4, 16, dtype=torch.float16)
    assert output_or_new(wide[:, 8:], (4, 8), like).data_ptr() == wide[:, 8:].data_ptr()
    for bad in (torch.zeros(4, 9, dtype=torch.float16), torch.zeros(4, 8), wide[:, ::2],
                torch.zeros(4, 8, dtype=torch.float16, device="meta")):
        with pytest.raises(ValueError, match=r"out: expected a \(4, 8\)"):
            output_or_new(bad, (4, 8), like)
