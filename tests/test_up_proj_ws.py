"""The warp-specialised Gluon up-projection (sonicmoe/ops/up_proj_ws.py).

The Gluon kernel needs an sm_90 GPU (tests marked ``gpu``); its config, dispatch rule and the dispatch from
``up_proj`` run on CPU too.
"""

from __future__ import annotations

import pytest
import torch

from sonicmoe.ops import common, grouped_gemm_ws, up_proj, up_proj_ws
from sonicmoe.ops.common import interpreting, sized_for_operands
from sonicmoe.ops.up_proj_ws import up_proj_ws as run_ws
from sonicmoe.ops.up_proj_ws import up_ws_config, up_ws_smem_bytes, up_ws_supported
from sonicmoe.routing import routing_from_topk
from sonicmoe.testing import random_topk_routing, rel_err


def test_config_fits_shared_memory(monkeypatch):
    monkeypatch.delenv("SONICMOE_UP_EPI", raising=False)
    cfg = up_ws_config(4096)  # above EPI_MAX_D: no storer partition
    assert cfg["EPI_WARPS"] == 0
    assert 2 <= cfg["STAGES"] <= up_proj_ws.MAX_STAGES
    assert up_ws_smem_bytes(cfg["STAGES"]) <= up_proj_ws.SMEM_BUDGET
    assert up_ws_smem_bytes(cfg["STAGES"] + 1) > up_proj_ws.SMEM_BUDGET or cfg["STAGES"] == up_proj_ws.MAX_STAGES
    # registers at launch: every warp of the program gets MAXNREG
    assert (up_proj_ws.MMA_WARPS + up_proj_ws.LOADER_WARPS) * 32 * up_proj_ws.MAXNREG <= 65536
    # with a storer partition: a ring slot fewer (the gate and up blocks staged), 128 registers per thread at launch
    # and the partitions' own counts within the register file
    epi = up_ws_config(1536)  # the 7B width: the storer partition by default
    assert epi == up_ws_config(epi_warps=4) == up_ws_config(up_proj_ws.EPI_MAX_D)
    assert epi["EPI_WARPS"] == 4 and 2 <= epi["STAGES"] <= cfg["STAGES"]
    monkeypatch.setenv("SONICMOE_UP_EPI", "0")
    assert up_ws_config(1536) == up_ws_config(4096)
    monkeypatch.setenv("SONICMOE_UP_EPI", "1")
    assert up_ws_config(4096) == epi
    assert up_ws_smem_bytes(epi["STAGES"], epi=True) <= up_proj_ws.SMEM_BUDGET < up_ws_smem_bytes(epi["STAGES"] + 1,
                                                                                                  epi=True)
    warps = up_proj_ws.MMA_WARPS + up_proj_ws.LOADER_WARPS + 4
    assert warps * 32 * 128 <= 65536
    assert 32 * (4 * up_proj_ws.LOADER_REGS + 4 * up_proj_ws.EPI_REGS + up_proj_ws.MMA_WARPS * 168) <= 65536


def test_shared_memory_bytes_by_hand(monkeypatch):
    """The sizes behind the configs, counted by hand: a ring slot holds an X block (BLOCK_M x BLOCK_K) and the gate
    and up W1 boxes (BLOCK_N x BLOCK_K each), 48 KiB in bf16; the staging buffer one (BLOCK_M x BLOCK_N) block, 32
    KiB, two with the storer partition. So 4 slots fit without the storer, 3 with it."""
    slot = 2 * (128 * 64 + 2 * 128 * 64)
    assert slot == 48 * 1024 and up_ws_smem_bytes(1) - up_ws_smem_bytes(0) == slot
    assert up_ws_smem_bytes(0) == 2 * 128 * 128 and up_ws_smem_bytes(0, epi=True) == 2 * 2 * 128 * 128
    assert up_ws_smem_bytes(3, epi=True) == 3 * slot + 64 * 1024
    monkeypatch.delenv("SONICMOE_UP_EPI", raising=False)
    assert up_ws_config(4096)["STAGES"] == 4 and up_ws_config(1536)["STAGES"] == 3


@pytest.mark.parametrize("store_h", [True, False])
def test_no_rows_returns_before_any_launch(store_h):
    """No routed rows: up_proj_ws returns an empty H (0, 2n) (None without store_h) and A (0, n) of x's dtype without a
    launch (none can run here)."""
    from sonicmoe.routing import routing_from_pairs

    e, n, d = 3, 256, 128
    none = torch.zeros(0, dtype=torch.int32)
    routing = routing_from_pairs(none, none, 4, e)
    h, a = run_ws(torch.randn(4, d).half(), torch.randn(e, 2 * n, d).half(), None, routing, store_h=store_h)
    assert a.shape == (0, n) and a.dtype == torch.float16
    if store_h:
        assert h.shape == (0, 2 * n) and h.dtype == torch.float16
    else:
        assert h is None


def test_gate_up_fused_config(monkeypatch):
    """SONICMOE_UP_GU_FUSED picks the one-chain form where the MMA warps run the epilogue, never with the storer
    partition (whose 16 warps cannot hold a 256-wide wgmma's registers)."""
    for flag in ("1", "0"):
        monkeypatch.setenv("SONICMOE_UP_GU_FUSED", flag)
        assert up_ws_config(4096, epi_warps=0)["GU_FUSED"] == (flag == "1")
        assert not up_ws_config(1536, epi_warps=4)["GU_FUSED"]
    monkeypatch.delenv("SONICMOE_UP_GU_FUSED")
    assert up_ws_config(4096)["GU_FUSED"] == up_proj_ws.GU_FUSED


@pytest.mark.parametrize("gpu,small_d", [("NVIDIA H200", True), ("NVIDIA H200 NVL", True),
                                         ("NVIDIA H100 80GB HBM3", False), ("NVIDIA GH200 480GB", False)])
def test_preferred_where_measured_faster(monkeypatch, gpu, small_d):
    """d = 4096 (MIN_D = MAX_D), and with the storer partition d ≤ 2048 on an H200 (not on an H100, nor on CPU),
    where it measured faster; not the DeepSeek-V3 width or the unmeasured widths between; every width under
    SONICMOE_GLUON_UP=all."""
    monkeypatch.delenv("SONICMOE_GLUON_UP", raising=False)
    monkeypatch.setattr(up_proj_ws, "_gpu_name", lambda index: gpu)
    cuda = torch.device("cuda", 0)
    assert up_proj_ws.up_ws_preferred(4096, cuda)  # (32768, 4096, 1024, 128, 8), (16384, 4096, 1024, 256, 4)
    assert not up_proj_ws.up_ws_preferred(7168, cuda)  # DeepSeek-V3
    assert up_proj_ws.up_ws_preferred(1536, cuda) == small_d  # 7B, (16384, 1536, 256, 512, 8)
    assert up_proj_ws.up_ws_preferred(768, cuda) == up_proj_ws.up_ws_preferred(2048, cuda) == small_d  # 1.4B, OLMoE
    assert not up_proj_ws.up_ws_preferred(2880, cuda) and not up_proj_ws.up_ws_preferred(3072, cuda)
    assert not up_proj_ws.up_ws_preferred(1536, torch.device("cpu")) and not up_proj_ws.up_ws_preferred(1536)
    monkeypatch.setenv("SONICMOE_GLUON_UP", "all")
    assert all(up_proj_ws.up_ws_preferred(d) for d in (768, 1536, 2048, 4096, 7168))
    assert up_proj_ws.up_ws_enabled() == grouped_gemm_ws.ws_enabled()


def _rows_routing(e, rows_per_expert, tile_rows=0):
    """A K = 1 routing with ``rows_per_expert`` rows in each of ``e`` experts and the tile_rows hint."""
    ids = torch.arange(e, dtype=torch.int32).repeat_interleave(rows_per_expert)[:, None]
    r = routing_from_topk(ids, e)
    r.tile_rows = tile_rows
    return r


@pytest.mark.parametrize("gpu,many,few", [("NVIDIA H100 80GB HBM3", True, False), ("NVIDIA H200", True, True),
                                          ("NVIDIA GH200 480GB", False, False)])
def test_preferred_by_rows_per_expert(monkeypatch, gpu, many, few):
    """With the storer (d ≤ EPI_MAX_D) an H100 takes the kernel where the experts average more than
    FEW_ROWS_PER_EXPERT rows (7B: 1536) and not at or below it (256); an H200 at both; a GH200 (unmeasured) at
    neither; d above EPI_MAX_D (and not MIN_D) never."""
    monkeypatch.delenv("SONICMOE_GLUON_UP", raising=False)
    monkeypatch.setattr(up_proj_ws, "_gpu_name", lambda index: gpu)
    cuda = torch.device("cuda", 0)
    at = common.FEW_ROWS_PER_EXPERT
    for d in (768, 1536, 2048):
        assert up_proj_ws.up_ws_preferred(d, cuda, _rows_routing(4, at + 1)) == many
        assert up_proj_ws.up_ws_preferred(d, cuda, _rows_routing(4, at)) == few
    assert not up_proj_ws.up_ws_preferred(3072, cuda, _rows_routing(4, at + 1))
    assert not up_proj_ws.up_ws_preferred(1536, torch.device("cpu"), _rows_routing(4, at + 1))


def test_not_preferred_for_whole_tiles_and_few_rows(monkeypatch):
    """On an H200 at d ≤ EPI_MAX_D, a routing whose tile_rows hint promises whole BLOCK_M-row tiles (token rounding)
    with at most FEW_ROWS_PER_EXPERT rows per expert goes to the Triton kernel; more rows per expert, another tile
    height, no hint or d = 4096 keep the Gluon kernel; SONICMOE_GLUON_UP=all still forces it."""
    monkeypatch.delenv("SONICMOE_GLUON_UP", raising=False)
    monkeypatch.setattr(up_proj_ws, "_gpu_name", lambda index: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    e, m = 4, up_proj_ws.BLOCK_M

    def routing(rows_per_expert, tile_rows):
        return _rows_routing(e, rows_per_expert, tile_rows)

    few = routing(2 * m, m)  # (16384, 1536, 256, 512, 8) under token rounding: 256 rows per expert
    assert up_proj_ws.whole_tiles_few_rows(few) and not up_proj_ws.up_ws_preferred(1536, cuda, few)
    assert up_proj_ws.whole_tiles_few_rows(routing(2 * m, 2 * m))
    for other in (routing(4 * m, m), routing(2 * m, 0), routing(2 * m, m // 2), None):
        assert not up_proj_ws.whole_tiles_few_rows(other) and up_proj_ws.up_ws_preferred(1536, cuda, other)
    assert up_proj_ws.up_ws_preferred(4096, cuda, few)  # the kernel without the storer partition
    monkeypatch.setenv("SONICMOE_GLUON_UP", "all")
    assert up_proj_ws.up_ws_preferred(1536, cuda, few)


def test_not_supported_off_hopper_or_out_of_range(monkeypatch):
    """CPU tensors, float32, the interleaved layout, n or d off the tile, a bias of another dtype or
    SONICMOE_GLUON_UP=0 / SONICMOE_GLUON=0 never reach the Gluon kernel."""
    e, n, d = 4, 256, 512
    x = torch.zeros(64, d, dtype=torch.bfloat16)
    w1 = torch.zeros(e, 2 * n, d, dtype=torch.bfloat16)
    assert not up_ws_supported(x, w1, None, "concat")  # CPU
    if torch.cuda.is_available():
        x, w1 = x.cuda(), w1.cuda()
        hopper = torch.cuda.get_device_capability() == (9, 0) and grouped_gemm_ws.HAVE_GLUON
        assert up_ws_supported(x, w1, None, "concat") == hopper
        assert not up_ws_supported(x, w1, None, "interleaved")
        assert not up_ws_supported(x.float(), w1.float(), None, "concat")
        assert not up_ws_supported(x, w1, torch.zeros(e, 2 * n, device="cuda"), "concat")  # float32 bias
        assert up_ws_supported(x, w1, torch.zeros(e, 2 * n, device="cuda", dtype=torch.bfloat16), "concat") == hopper
        assert not up_ws_supported(x, torch.zeros(e, 2 * 192, d, dtype=torch.bfloat16, device="cuda"), None,
                                   "concat")  # n = 192
        assert not up_ws_supported(x[:, :480].contiguous(), w1[:, :, :480].contiguous(), None, "concat")  # d = 480
        # d = 512 ≤ EPI_MAX_D: preferred on an H200 only ("H200" a word of the name: not a GH200)
        h200 = "H200" in torch.cuda.get_device_name().split()
        assert up_proj_ws.up_ws_preferred(x.shape[1], x.device) == h200
        monkeypatch.setenv("SONICMOE_GLUON_UP", "0")
        assert not up_ws_supported(x, w1, None, "concat")
        monkeypatch.setenv("SONICMOE_GLUON_UP", "1")
        monkeypatch.setenv("SONICMOE_GLUON", "0")
        assert not up_ws_supported(x, w1, None, "concat")


def test_supported_rule_on_a_faked_sm90(fake_sm90, monkeypatch):
    """The checks above where no GPU is (CPU tensors' stand-ins on a faked sm_90 device): taken on sm_90 only (not on
    sm_80, nor on sm_100 / sm_120, which have no wgmma), not for n off BLOCK_N, d = 0 or a bias of another dtype, nor
    under SONICMOE_GLUON_UP=0."""
    e, n, d = 2, 256, 128
    x, w1 = fake_sm90(torch.zeros(8, d, dtype=torch.bfloat16), torch.zeros(e, 2 * n, d, dtype=torch.bfloat16))
    assert up_ws_supported(x, w1, None, "concat")
    assert up_ws_supported(x, w1, fake_sm90(torch.zeros(e, 2 * n, dtype=torch.bfloat16)), "concat")
    assert not up_ws_supported(x, w1, fake_sm90(torch.zeros(e, 2 * n)), "concat")  # a float32 bias
    assert not up_ws_supported(x, fake_sm90(torch.zeros(e, 2 * 192, d, dtype=torch.bfloat16)), None, "concat")
    # d = 0: no TMA box of zero width (the Triton kernel serves it)
    assert not up_ws_supported(*fake_sm90(torch.zeros(8, 0, dtype=torch.bfloat16),
                                          torch.zeros(e, 2 * n, 0, dtype=torch.bfloat16)), None, "concat")
    # W1 reducing over another width than x's d; a W1 whose first element is not 16-byte aligned (TMA)
    assert not up_ws_supported(x, fake_sm90(torch.zeros(e, 2 * n, 2 * d, dtype=torch.bfloat16)), None, "concat")
    shifted = torch.zeros(e * 2 * n * d + 1, dtype=torch.bfloat16)[1:].view(e, 2 * n, d)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 == 2
    assert not up_ws_supported(x, fake_sm90(shifted), None, "concat")
    monkeypatch.setenv("SONICMOE_GLUON_UP", "0")
    assert not up_ws_supported(x, w1, None, "concat")
    monkeypatch.delenv("SONICMOE_GLUON_UP")
    for cap in ((8, 0), (10, 0), (12, 0)):
        fake_sm90.capability = cap
        assert not up_ws_supported(x, w1, None, "concat"), cap


def test_supported_rule_checks_each_operand_on_a_faked_sm90(fake_sm90):
    """Each operand check of the served-shape rule on its own, the other operands as the kernel takes them (a faked
    sm_90): the interleaved layout (the kernel reads W1's gate rows [0, n) and up rows [n, 2n)), float32 operands of
    one dtype (no wgmma of theirs), a W1 of fp16 beside a bf16 x, a W1 or an x that is not contiguous (W1 is read
    through an (E·2n, d) TMA view), and CPU tensors with Gluon present."""
    e, n, d = 2, 256, 128
    bf = torch.bfloat16
    x_cpu, w1_cpu = torch.zeros(8, d, dtype=bf), torch.zeros(e, 2 * n, d, dtype=bf)
    x, w1 = fake_sm90(x_cpu, w1_cpu)
    assert up_ws_supported(x, w1, None, "concat")
    assert not up_ws_supported(x, w1, None, "interleaved")
    assert not up_ws_supported(*fake_sm90(torch.zeros(8, d), torch.zeros(e, 2 * n, d)), None, "concat")
    assert not up_ws_supported(x, fake_sm90(torch.zeros(e, 2 * n, d, dtype=torch.float16)), None, "concat")
    w1_t = torch.zeros(e, d, 2 * n, dtype=bf).transpose(1, 2)  # (E, 2n, d), d-stride 2n
    x_wide = torch.zeros(8, 2 * d, dtype=bf)[:, :d]  # (8, d), row stride 2d
    assert w1_t.shape == w1.shape and not w1_t.is_contiguous() and x_wide.shape == x.shape
    assert not x_wide.is_contiguous() and x_wide.data_ptr() % 16 == 0 and w1_t.data_ptr() % 16 == 0
    assert not up_ws_supported(x, fake_sm90(w1_t), None, "concat")
    assert not up_ws_supported(fake_sm90(x_wide), w1, None, "concat")
    assert not up_ws_supported(x_cpu, w1_cpu, None, "concat")  # CPU tensors: Gluon "present", capability (9, 0)


def test_gpu_name_read_from_the_device_index(monkeypatch):
    """The storer's GPU rule reads the name of the operands' device: cuda:0 is device 0 even where another device
    is current, and a device without an index ("cuda") is the current one (here device 1)."""
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200"}
    monkeypatch.setattr(up_proj_ws, "_gpu_name", lambda index: names[index])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.delenv("SONICMOE_GLUON_UP", raising=False)
    cuda0, cuda1, current = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda")
    assert not up_proj_ws.epi_preferred_on(cuda0) and up_proj_ws.epi_preferred_on(cuda0, ("H100",))
    assert up_proj_ws.epi_preferred_on(cuda1) and up_proj_ws.epi_preferred_on(current)
    assert not up_proj_ws.epi_preferred_on(current, ("H100",))
    assert not up_proj_ws.up_ws_preferred(1536, cuda0) and up_proj_ws.up_ws_preferred(1536, current)


@pytest.mark.interpreter
def test_dispatch(monkeypatch, device):
    """up_proj hands the product to the Gluon kernel where up_ws_supported says so, and never with an explicit
    Triton config; gpt-oss's clamped SwiGLU too (its activation passed on) with SONICMOE_GLUON_CLAMPED=1, not with 0."""
    calls = []

    def fake(x, w1, b1, routing, store_h=True, activation="swiglu"):
        calls.append((x.shape, store_h))
        return up_proj.up_proj_ref(x, w1, b1, routing, "concat", store_h, activation=activation)

    monkeypatch.setattr(up_proj, "up_ws_supported", lambda x, w1, b1, layout: layout == "concat")
    monkeypatch.setattr(up_proj, "up_ws_preferred", lambda d, device=None, routing=None: d == 16)
    monkeypatch.setattr(up_proj, "up_proj_ws", fake)
    routing = routing_from_topk(torch.tensor([[0, 2], [1, 2], [2, 0]], dtype=torch.int32, device=device), 3)
    x = torch.randn(3, 16, device=device)
    w1 = torch.randn(3, 32, 16, device=device)
    h, a = up_proj.up_proj(x, w1, None, routing, store_h=False)
    assert calls == [(x.shape, False)] and h is None
    h_ref, a_ref = up_proj.up_proj_ref(x, w1, None, routing)
    assert torch.equal(a, a_ref)
    # on the GPU the pinned tile sized for these float32 operands (the bf16-sized one does not fit shared memory)
    cfg = up_proj._PINNED_INTERP if interpreting() else sized_for_operands(up_proj.pinned_gpu_config(6, 3, 16), 4)
    h2, a2 = up_proj.up_proj(x, w1, None, routing, config=cfg)
    assert len(calls) == 1
    assert rel_err(a2, a_ref) < 1e-5 and rel_err(h2, h_ref) < 1e-5
    x6 = 6 * x  # the clamps bind
    _, a_clamped = up_proj.up_proj_ref(x6, w1, None, routing, activation="clamped_swiglu")
    for switch, n_calls in (("1", 2), ("0", 2)):
        monkeypatch.setenv("SONICMOE_GLUON_CLAMPED", switch)
        _, a3 = up_proj.up_proj(x6, w1, None, routing, activation="clamped_swiglu")
        assert len(calls) == n_calls and rel_err(a3, a_clamped) < 1e-5, switch


# (T, d, n, E, K, reason) on the GPU
GPU_CASES = [
    (1, 128, 128, 4, 1, "T=1, K=1"),
    (300, 256, 128, 8, 8, "K=E"),
    (1000, 384, 256, 16, 4, "two N-tiles, partial tiles"),
    (777, 192, 128, 40, 2, "empty experts, three K-blocks"),
    (4096, 1536, 256, 32, 8, "the 7B widths, 1024 rows per expert (full tiles)"),
    (2500, 64, 384, 3, 2, "d=64: one K-block, three N-tiles"),
]
GPU_PARAMS = [(c, torch.bfloat16) for c in GPU_CASES] + [(GPU_CASES[4], torch.float16)]


def _gpu_problem(case, dtype, routing_seed, seed, monkeypatch=None, x_scale=1.0):
    """Skip off sm_90 GPUs; with ``monkeypatch``, poison the outputs (NaN fill). (routing, x, w1, generator) for
    ``case`` = (T, d, n, E, K, ...): top-k routing drawn with ``routing_seed``, x (T, d) of scale ``x_scale`` and
    w1 (E, 2n, d) / sqrt(d) in ``dtype`` from a CUDA generator seeded ``seed`` (which the caller goes on drawing
    from)."""
    if not grouped_gemm_ws.HAVE_GLUON or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel needs an sm_90 GPU")
    if monkeypatch is not None:
        monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")
    t, d, n, e, k = case[:5]
    routing = random_topk_routing(t, e, k, seed=routing_seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (x_scale * torch.randn(t, d, device="cuda", generator=g)).to(dtype)
    w1 = (torch.randn(e, 2 * n, d, device="cuda", generator=g) / d ** 0.5).to(dtype)
    return routing, x, w1, g


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", GPU_PARAMS, ids=[f"{c[-1]}-{str(dt)[6:]}" for c, dt in GPU_PARAMS])
def test_gpu_matches_reference_and_triton(case, dtype, monkeypatch):
    """With and without bias and H: H and A within rounding of the float32 loop, no NaN left by the poison fill,
    A from the rounded H as in the Triton kernel, the same bits on a second run, the inputs untouched."""
    t, d, n, e, k, _ = case
    routing, x, w1, g = _gpu_problem(case, dtype, t, 1, monkeypatch)
    for bias in (None, (0.1 * torch.randn(e, 2 * n, device="cuda", generator=g)).to(dtype)):
        x0, w0 = x.clone(), w1.clone()
        h, a = run_ws(x, w1, bias, routing)
        h_ref, a_ref = up_proj.up_proj_ref(x, w1, bias, routing)
        assert rel_err(h, h_ref) < 5e-3 and rel_err(a, a_ref) < 1e-2, bias is not None
        # A is SwiGLU of the stored (rounded) H, computed in float32
        a_from_h = up_proj.swiglu_ref(h.float()).to(dtype)
        assert rel_err(a, a_from_h) < 2e-3
        h2, a2 = run_ws(x, w1, bias, routing)
        assert torch.equal(h, h2) and torch.equal(a, a2)
        none, a3 = run_ws(x, w1, bias, routing, store_h=False)
        assert none is None and torch.equal(a, a3)
        monkeypatch.setenv("SONICMOE_GLUON_UP", "0")
        h_tri, a_tri = up_proj.up_proj(x, w1, bias, routing)
        monkeypatch.delenv("SONICMOE_GLUON_UP")
        assert rel_err(h, h_tri) < 2e-3 and rel_err(a, a_tri) < 5e-3
        assert torch.equal(x, x0) and torch.equal(w1, w0)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk,h_tma", [(16, False), (32, False), (16, True)])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[-1] for c in GPU_CASES])
def test_gpu_storer_partition_same_bits(case, chunk, h_tma, monkeypatch):
    """With the epilogue in a storer partition (EPI_WARPS 4, a ring slot fewer): H and A within rounding of the
    float32 loop, no NaN left by the poison fill, and the same bits as the MMA warps' own epilogue (EPI_WARPS 0),
    with and without bias and H, full tiles' H by 16-byte stores (the default) or by TMA (EPI_H_TMA)."""
    t, d, n, e, k, _ = case
    routing, x, w1, g = _gpu_problem(case, torch.bfloat16, t + 1, 2, monkeypatch)
    epi = dict(up_ws_config(epi_warps=4), EPI_CHUNK=chunk, EPI_H_TMA=h_tma)
    for bias in (None, (0.1 * torch.randn(e, 2 * n, device="cuda", generator=g)).to(torch.bfloat16)):
        h, a = run_ws(x, w1, bias, routing, config=epi)
        h_ref, a_ref = up_proj.up_proj_ref(x, w1, bias, routing)
        assert rel_err(h, h_ref) < 5e-3 and rel_err(a, a_ref) < 1e-2
        h0, a0 = run_ws(x, w1, bias, routing, config=up_ws_config(epi_warps=0))
        assert torch.equal(h, h0) and torch.equal(a, a0)
        none, a1 = run_ws(x, w1, bias, routing, store_h=False, config=epi)
        assert none is None and torch.equal(a1, a0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[-1] for c in GPU_CASES])
def test_gpu_sigmoid_ftz_same_bits(case, monkeypatch):
    """The SwiGLU's sigmoid by the ftz forms (SIGMOID_FTZ) gives the same H and A as the default forms, with the
    epilogue in the MMA warps and in the storer partition, with and without bias."""
    t, d, n, e, k, _ = case
    # x scaled by 4: gates out to |g| ~ 20
    routing, x, w1, g = _gpu_problem(case, torch.bfloat16, t + 3, 6, monkeypatch, x_scale=4.0)
    for bias in (None, (0.1 * torch.randn(e, 2 * n, device="cuda", generator=g)).to(torch.bfloat16)):
        for epi in (0, 4):
            cfg = up_ws_config(epi_warps=epi)
            h0, a0 = run_ws(x, w1, bias, routing, config={**cfg, "SIGMOID_FTZ": False})
            h1, a1 = run_ws(x, w1, bias, routing, config={**cfg, "SIGMOID_FTZ": True})
            assert torch.equal(h1, h0) and torch.equal(a1, a0), (epi, bias is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[-1] for c in GPU_CASES])
def test_gpu_gate_up_fused_same_bits(case, monkeypatch):
    """One m64 × 256 wgmma chain over the slot's gate and up boxes (GU_FUSED), split after the loop: H and A within
    rounding of the float32 loop, no NaN left by the poison fill, and the same bits as the two 128-wide chains, with
    and without bias; with the storer partition (16 warps: too few registers for a 256-wide wgmma) the launcher runs
    the two chains."""
    t, d, n, e, k, _ = case
    routing, x, w1, g = _gpu_problem(case, torch.bfloat16, t + 5, 7, monkeypatch)
    for bias in (None, (0.1 * torch.randn(e, 2 * n, device="cuda", generator=g)).to(torch.bfloat16)):
        for epi in (0, 4):
            cfg = up_ws_config(epi_warps=epi)
            h1, a1 = run_ws(x, w1, bias, routing, config={**cfg, "GU_FUSED": True})
            h_ref, a_ref = up_proj.up_proj_ref(x, w1, bias, routing)
            assert rel_err(h1, h_ref) < 5e-3 and rel_err(a1, a_ref) < 1e-2
            h0, a0 = run_ws(x, w1, bias, routing, config={**cfg, "GU_FUSED": False})
            assert torch.equal(h1, h0) and torch.equal(a1, a0), (epi, bias is not None)


@pytest.mark.gpu
def test_gpu_part_mmas_alone():
    """PART 1 (timing only) runs the MMAs alone: A's column j holds, for every row, the sum of the gate and up
    products over N-tile j's channels (H unwritten), within float32 rounding of the reference."""
    t, d, n, e, k = 1000, 384, 256, 16, 4
    routing, x, w1, _ = _gpu_problem((t, d, n, e, k), torch.bfloat16, 3, 3)
    _, a = run_ws(x, w1, None, routing, config=dict(up_ws_config(), PART=1))
    h_ref, _ = up_proj.up_proj_ref(x.float(), w1.float(), None, routing)
    nt = n // up_proj_ws.BLOCK_N
    sums = (h_ref[:, :n] + h_ref[:, n:]).reshape(-1, nt, up_proj_ws.BLOCK_N).sum(-1)
    assert rel_err(a[:, :nt], sums) < 1e-2


@pytest.mark.gpu
def test_gpu_layer_uses_gluon_up_projection(monkeypatch):
    """At a shape the rule selects (d = 4096), the layer's forward runs the Gluon up-projection, and its outputs and
    gradients stay within rounding of those with SONICMOE_GLUON_UP=0."""
    from sonicmoe.testing import layer_grads, random_problem

    if not grouped_gemm_ws.HAVE_GLUON or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel needs an sm_90 GPU")
    t, d, n, e, k = 4096, 4096, 256, 32, 8
    p = random_problem(t, d, n, e, device="cuda", bias=True, seed=3)
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    calls = []
    monkeypatch.setattr(up_proj, "up_proj_ws", lambda *a, **kw: calls.append(1) or run_ws(*a, **kw))
    on = layer_grads(p, dout, k)
    assert calls
    monkeypatch.setenv("SONICMOE_GLUON_UP", "0")
    n_calls = len(calls)
    off = layer_grads(p, dout, k)
    assert len(calls) == n_calls
    assert rel_err(on[0], off[0]) < 5e-3
    for name in on[1]:
        assert rel_err(on[1][name], off[1][name]) < 2e-2, name


if grouped_gemm_ws.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def _round_pairs_kernel(src_ptr, dst_ptr, BLOCK: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        offs = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))[:, None] * 64 + \
            gl.arange(0, 64, layout=gl.SliceLayout(0, layout))[None, :]
        v = gl.load(src_ptr + offs)
        gl.store(dst_ptr + offs, up_proj_ws._round_pairs(v, dst_ptr.dtype.element_ty))

    @gluon.jit
    def _sigmoid_kernel(g_ptr, out_ptr, FTZ: gl.constexpr, BLOCK: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
        offs = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
        gl.store(out_ptr + offs, up_proj_ws.sigmoid(gl.load(g_ptr + offs), FTZ))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_round_pairs_matches_to(dtype):
    """The epilogue's packed rounding (two elements per cvt) has the bits of ``.to(dtype)`` (round to nearest even):
    on random values across many exponents, exact ties, values past the format's range, infinities and NaN."""
    if not grouped_gemm_ws.HAVE_GLUON or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel needs an sm_90 GPU")
    g = torch.Generator(device="cuda").manual_seed(5)
    v = torch.randn(128, 64, device="cuda", generator=g) * torch.exp2(torch.randint(-30, 30, (128, 64), device="cuda",
                                                                                    generator=g).float())
    low = torch.randn(16, 64, device="cuda", generator=g).to(dtype)
    above = (low.view(torch.int16) + 1).view(dtype)  # the next value away from zero
    v[:16] = (low.float() + above.float()) / 2  # exact ties (in float32): the even one wins
    v[16, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e30])
    v[17, :2] = torch.finfo(dtype).max * 1.001
    out = torch.full_like(v, float("nan"), dtype=dtype)
    _round_pairs_kernel[(1,)](v, out, BLOCK=128, num_warps=4)
    want = v.to(dtype)
    both_nan = torch.isnan(out) & torch.isnan(want)
    assert torch.equal(out.view(torch.int16)[~both_nan], want.view(torch.int16)[~both_nan])
    assert both_nan.sum() == torch.isnan(v).sum() == 1


@pytest.mark.gpu
def test_gpu_sigmoid_ftz_matches_default_forms():
    """``sigmoid`` by the ftz forms has the bits of the default forms for every gate outside (-88.8, -87.3), and
    inside them the same bits or zero where the default's reciprocal is a denormal, on a dense sweep of [-120, 120],
    infinities and NaN; both are within float32 rounding of the float64 sigmoid."""
    if not grouped_gemm_ws.HAVE_GLUON or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel needs an sm_90 GPU")
    block = 512
    g = torch.linspace(-120, 120, 2 ** 20, device="cuda")
    g = torch.cat([g, torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0], device="cuda")])
    g = torch.cat([g, torch.zeros(-g.numel() % block, device="cuda")])
    outs = []
    for ftz in (False, True):
        out = torch.full_like(g, float("nan"))
        _sigmoid_kernel[(g.numel() // block,)](g, out, FTZ=ftz, BLOCK=block, num_warps=4)
        outs.append(out)
    window = (g > -88.8) & (g < -87.3)
    same = torch.eq(outs[0], outs[1]) | (torch.isnan(outs[0]) & torch.isnan(outs[1]))
    assert same[~window].all()
    assert (same | (outs[1] == 0))[window].all() and (outs[0][window].abs() < 2.0 ** -125).all()
    finite = torch.isfinite(g)
    for out in outs:
        assert rel_err(out[finite & (g > -80)], torch.sigmoid(g[finite & (g > -80)].double()).float()) < 1e-6
