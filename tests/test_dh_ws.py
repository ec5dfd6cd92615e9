"""The warp-specialised Gluon dH kernel (sonicmoe/ops/dh_ws.py).

The Gluon kernel needs an sm_90 GPU (tests marked ``gpu``); its config, the served shapes and the dispatch from
``dh`` run on CPU too.
"""

from __future__ import annotations

import pytest
import torch

from sonicmoe.ops import dh as dh_mod
from sonicmoe.ops import dh_ws, grouped_gemm_ws
from sonicmoe.ops.common import interpreting, sized_for_operands
from sonicmoe.ops.dh_ws import dh_ws_config, dh_ws_smem_bytes, dh_ws_supported, stage_fits_slot
from sonicmoe.ops.score_grad import score_grad
from sonicmoe.routing import routing_from_topk
from sonicmoe.testing import random_topk_routing, rel_err


@pytest.mark.parametrize("n", [128, 256, 384, 512, 1024, 2048])
def test_config_fits_shared_memory(n):
    cfg = dh_ws_config(n)
    assert cfg["BLOCK_N"] == (256 if n % 256 == 0 else 128)
    assert 3 <= cfg["STAGES"] <= dh_ws.MAX_STAGES
    ring = cfg["STAGE_IN_RING"]
    assert dh_ws_smem_bytes(cfg["STAGES"], cfg["BLOCK_N"], stage_in_ring=ring) <= dh_ws.SMEM_BUDGET
    assert (dh_ws_smem_bytes(cfg["STAGES"] + 1, cfg["BLOCK_N"], stage_in_ring=ring) > dh_ws.SMEM_BUDGET
            or cfg["STAGES"] == dh_ws.MAX_STAGES)
    # the epilogue's column blocks: a power of two per tile, a whole number of H buffer rounds, an even number (the
    # two output staging sets alternate across tiles)
    nb = cfg["BLOCK_N"] // cfg["EPI"]
    assert nb & (nb - 1) == 0 and nb % cfg["NBUF"] == 0 and nb % 2 == 0 and cfg["EPI"] % 8 == 0
    assert (dh_ws.MMA_WARPS + dh_ws.LOADER_WARPS) * 32 * dh_ws.MAXNREG <= 65536
    assert dh_ws_config(192) is None and dh_ws_config(64) is None
    # 32-deep K-blocks: the same ring bytes in twice the slots (at most 2·MAX_STAGES), still within shared memory;
    # a 32-deep slot is too small for the staging sets, so compare with 64-deep slots beside staging of its own
    deep = dh_ws_config(n, block_k=32)
    own = dh_ws_config(n, stage_in_ring=False)
    assert deep["BLOCK_K"] == 32 and deep["STAGES"] <= 2 * dh_ws.MAX_STAGES and not deep["STAGE_IN_RING"]
    assert deep["STAGES"] >= 2 * own["STAGES"] - 1
    assert dh_ws_smem_bytes(deep["STAGES"], deep["BLOCK_N"], block_k=32, stage_in_ring=deep["STAGE_IN_RING"]) \
        <= dh_ws.SMEM_BUDGET


@pytest.mark.parametrize("n", [128, 256, 512, 1024])
@pytest.mark.parametrize("epi", [16, 32])
def test_staging_in_a_ring_slot(n, epi):
    """With the staging sets in a ring slot: only where one slot holds all six (BLOCK_M, EPI) blocks (at EPI = 32,
    256-wide tiles, not 128-wide ones; at EPI = 16 both), and then the ring is one slot deeper than with staging
    of its own, within the same shared memory."""
    own = dh_ws_config(n, epi, stage_in_ring=False)
    ring = dh_ws_config(n, epi, stage_in_ring=True)
    bn = own["BLOCK_N"]
    assert ring["STAGE_IN_RING"] == stage_fits_slot(bn, epi) == (bn == 256 or epi == 16)
    assert not own["STAGE_IN_RING"]
    if ring["STAGE_IN_RING"]:
        # six blocks of BLOCK_M x EPI in one slot's dO block and W2 box
        assert dh_ws.BLOCK_K * (dh_ws.BLOCK_M + bn) >= 6 * dh_ws.BLOCK_M * epi
        assert ring["STAGES"] == min(own["STAGES"] + 1, dh_ws.MAX_STAGES)
        assert dh_ws_smem_bytes(ring["STAGES"], bn, epi, stage_in_ring=True) <= dh_ws.SMEM_BUDGET
        assert dh_ws_smem_bytes(ring["STAGES"] + 1, bn, epi, stage_in_ring=True) > dh_ws.SMEM_BUDGET
    else:
        assert ring == {**own, "STAGE_IN_RING": False}


def test_stage_in_ring_switch(monkeypatch):
    """SONICMOE_DH_STAGE_IN_RING / SONICMOE_WGRAD_STAGE_IN_RING turn the ring staging off and on (read per call);
    unset, the module defaults hold; an explicit argument wins over the environment. (The weight gradients stage
    in the ring only with their MMA warpgroups in one partition: SONICMOE_WGRAD_WG_SPLIT=0 here.)"""
    from sonicmoe.ops import weight_grad_ws

    monkeypatch.delenv("SONICMOE_DH_STAGE_IN_RING", raising=False)
    monkeypatch.delenv("SONICMOE_WGRAD_STAGE_IN_RING", raising=False)
    monkeypatch.setenv("SONICMOE_WGRAD_WG_SPLIT", "0")
    assert dh_ws_config(256)["STAGE_IN_RING"] == dh_ws.STAGE_IN_RING
    assert weight_grad_ws.wgrad_ws_config(512, 1536, False)["STAGE_IN_RING"] == weight_grad_ws.STAGE_IN_RING
    for value, on in (("0", False), ("1", True)):
        monkeypatch.setenv("SONICMOE_DH_STAGE_IN_RING", value)
        monkeypatch.setenv("SONICMOE_WGRAD_STAGE_IN_RING", value)
        assert dh_ws_config(256)["STAGE_IN_RING"] is on and dh_ws_config(256)["STAGES"] == (4 if on else 3)
        assert weight_grad_ws.wgrad_ws_config(512, 1536, False)["STAGE_IN_RING"] is on
        assert dh_ws_config(256, stage_in_ring=not on)["STAGE_IN_RING"] is (not on)


def test_preferred_where_measured_faster(monkeypatch):
    """256-wide tiles (n a multiple of 256: every width measured faster, session 37) and n = 128 (session 38), not
    n = 384 or 640 (128-wide tiles, not measured); every n under SONICMOE_GLUON_DH=all, none of them under 0
    (dh_ws_enabled)."""
    monkeypatch.delenv("SONICMOE_GLUON_DH", raising=False)
    assert all(dh_ws.dh_ws_preferred(n) for n in (256, 512, 768, 1024, 2048))
    assert dh_ws.dh_ws_preferred(128) and not dh_ws.dh_ws_preferred(384) and not dh_ws.dh_ws_preferred(640)
    monkeypatch.setenv("SONICMOE_GLUON_DH", "all")
    assert all(dh_ws.dh_ws_preferred(n) for n in (128, 256, 384, 1024))
    assert dh_ws.dh_ws_enabled() == grouped_gemm_ws.ws_enabled()
    monkeypatch.setenv("SONICMOE_GLUON_DH", "0")
    assert not dh_ws.dh_ws_enabled()


def test_not_supported_off_hopper_or_out_of_range(monkeypatch):
    """CPU tensors, float32, the interleaved layout, n or d off the tile, or SONICMOE_GLUON_DH=0 /
    SONICMOE_GLUON=0 never reach the Gluon kernel."""
    e, n, d, r = 4, 256, 512, 96
    dout = torch.zeros(64, d, dtype=torch.bfloat16)
    w2 = torch.zeros(e, d, n, dtype=torch.bfloat16)
    h = torch.zeros(r, 2 * n, dtype=torch.bfloat16)
    assert not dh_ws_supported(dout, w2, h, "concat")  # CPU
    if torch.cuda.is_available():
        dout, w2, h = dout.cuda(), w2.cuda(), h.cuda()
        hopper = torch.cuda.get_device_capability() == (9, 0) and grouped_gemm_ws.HAVE_GLUON
        assert dh_ws_supported(dout, w2, h, "concat") == hopper
        assert not dh_ws_supported(dout, w2, h, "interleaved")
        assert not dh_ws_supported(dout.float(), w2.float(), h.float(), "concat")
        assert not dh_ws_supported(dout, w2, h.half(), "concat")  # mixed dtypes
        n2 = 192
        assert not dh_ws_supported(dout, w2[:, :, :n2].contiguous(), h[:, :2 * n2].contiguous(), "concat")
        assert not dh_ws_supported(dout[:, :480].contiguous(), w2[:, :480].contiguous(), h, "concat")  # d = 480
        monkeypatch.setenv("SONICMOE_GLUON_DH", "0")
        assert not dh_ws_supported(dout, w2, h, "concat")
        monkeypatch.setenv("SONICMOE_GLUON_DH", "1")
        monkeypatch.setenv("SONICMOE_GLUON", "0")
        assert not dh_ws_supported(dout, w2, h, "concat")


def test_supported_rule_on_a_faked_sm90(fake_sm90):
    """The checks above where no GPU is (CPU tensors' stand-ins on a faked sm_90 device): taken on sm_90 only (not on
    sm_80 or sm_100), not for an H of another width than 2n or of another dtype, nor for d = 0 (no TMA box)."""
    e, n, d, r = 2, 256, 128, 16
    dout, w2, h = fake_sm90(torch.zeros(8, d, dtype=torch.bfloat16), torch.zeros(e, d, n, dtype=torch.bfloat16),
                            torch.zeros(r, 2 * n, dtype=torch.bfloat16))
    assert dh_ws_supported(dout, w2, h, "concat")
    assert not dh_ws_supported(dout, w2, fake_sm90(torch.zeros(r, n, dtype=torch.bfloat16)), "concat")  # (R, n)
    assert not dh_ws_supported(dout, w2, fake_sm90(torch.zeros(r, 2 * n, dtype=torch.float16)), "concat")
    assert not dh_ws_supported(*fake_sm90(torch.zeros(8, 0, dtype=torch.bfloat16),
                                          torch.zeros(e, 0, n, dtype=torch.bfloat16)), h, "concat")  # d = 0
    assert not dh_ws_supported(dout, w2, h, "interleaved")  # the kernel reads gate | up halves of H
    assert not dh_ws_supported(fake_sm90(torch.zeros(8, 2 * d, dtype=torch.bfloat16)), w2, h, "concat")  # dO (T, 2d)
    shifted = torch.zeros(r * 2 * n + 1, dtype=torch.bfloat16)[1:].view(r, 2 * n)  # 2 bytes past a 16-byte boundary
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 == 2
    assert not dh_ws_supported(dout, w2, fake_sm90(shifted), "concat")
    for cap in ((8, 0), (10, 0)):
        fake_sm90.capability = cap
        assert not dh_ws_supported(dout, w2, h, "concat"), cap


def test_supported_rule_checks_each_operand_on_a_faked_sm90(fake_sm90):
    """Each operand's own check of the rule (a faked sm_90): float32 operands of one dtype (no wgmma of theirs), a W2
    of fp16 beside bf16 dO and H, an H that is not contiguous (read through TMA boxes), a W2 whose first element is
    not 16-byte aligned, n off the 128-wide tile (n = 192, 64: dh_ws_block_n has none), and CPU tensors with Gluon
    present."""
    e, n, d, r = 2, 256, 128, 16
    bf = torch.bfloat16
    cpu = (torch.zeros(8, d, dtype=bf), torch.zeros(e, d, n, dtype=bf), torch.zeros(r, 2 * n, dtype=bf))
    dout, w2, h = fake_sm90(*cpu)
    assert dh_ws_supported(dout, w2, h, "concat")
    assert not dh_ws_supported(*fake_sm90(*(t.float() for t in cpu)), "concat")
    assert not dh_ws_supported(dout, fake_sm90(torch.zeros(e, d, n, dtype=torch.float16)), h, "concat")
    h_wide = torch.zeros(r, 4 * n, dtype=bf)[:, :2 * n]  # (R, 2n), row stride 4n: aligned, not contiguous
    assert not h_wide.is_contiguous() and h_wide.data_ptr() % 16 == 0
    assert not dh_ws_supported(dout, w2, fake_sm90(h_wide), "concat")
    shifted = torch.zeros(e * d * n + 1, dtype=bf)[1:].view(e, d, n)  # 2 bytes past a 16-byte boundary
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 == 2
    assert not dh_ws_supported(dout, fake_sm90(shifted), h, "concat")
    for odd in (192, 64):
        assert dh_ws.dh_ws_block_n(odd) is None
        assert not dh_ws_supported(dout, fake_sm90(torch.zeros(e, d, odd, dtype=bf)),
                                   fake_sm90(torch.zeros(r, 2 * odd, dtype=bf)), "concat"), odd
    assert [dh_ws.dh_ws_block_n(nn) for nn in (128, 256, 384, 512, 640, 768)] == [128, 256, 128, 256, 128, 256]
    assert not dh_ws_supported(*cpu, "concat")  # CPU tensors, Gluon "present"


def test_config_tile_must_divide_n(monkeypatch):
    """An explicit tile width is taken only where it divides n (each program's tile is BLOCK_N whole channels);
    the epilogue's sigmoid form defaults to this kernel's SIGMOID_FTZ, not the up-projection's, where
    SONICMOE_SIGMOID_FTZ is unset."""
    from sonicmoe.ops import up_proj_ws

    assert dh_ws_config(384, block_n=256) is None and dh_ws_config(128, block_n=256) is None
    assert dh_ws_config(512, block_n=128)["BLOCK_N"] == 128 and dh_ws_config(384, block_n=128)["BLOCK_N"] == 128
    monkeypatch.delenv("SONICMOE_SIGMOID_FTZ", raising=False)
    assert dh_ws.SIGMOID_FTZ != up_proj_ws.SIGMOID_FTZ  # the two defaults differ: the check below tells them apart
    assert dh_ws_config(256)["SIGMOID_FTZ"] is dh_ws.SIGMOID_FTZ


def _no_rows_inputs(n):
    from sonicmoe.routing import routing_from_pairs

    e, d, t = 3, 128, 4
    none = torch.zeros(0, dtype=torch.int32)
    routing = routing_from_pairs(none, none, t, e)
    dout = torch.randn(t, d).half()
    w2 = torch.randn(e, d, n).half()
    return dout, w2, torch.zeros(0, 2 * n, dtype=torch.float16), torch.zeros(0), routing


@pytest.mark.parametrize("n", [256, 512])
def test_no_rows_returns_before_any_launch(n):
    """No routed rows: dh_ws returns empty dH (0, 2n) and A′ (0, n) of H's dtype and the dS partials, one row per
    N-tile (n / BLOCK_N, 0) float32 (with ds_pairs, an empty dS of that dtype), without a launch (none can run
    here)."""
    dout, w2, h, s, routing = _no_rows_inputs(n)
    dh_, ap, parts = dh_ws.dh_ws(dout, w2, h, s, routing)
    assert dh_.shape == (0, 2 * n) and ap.shape == (0, n) and dh_.dtype == ap.dtype == torch.float16
    assert parts.shape == (n // dh_ws_config(n)["BLOCK_N"], 0) == (n // 256, 0) and parts.dtype == torch.float32
    if dh_ws.ds_pairs_in_kernel(n):
        ds = dh_ws.dh_ws(dout, w2, h, s, routing, pair_order=True, ds_pairs=torch.bfloat16)[2]
        assert ds.shape == (0,) and ds.dtype == torch.bfloat16


def test_ds_pairs_needs_pair_order_before_any_launch():
    """ds_pairs (dS in pair order) without pair_order is a ValueError naming it, raised before anything is launched,
    also where the tiles span all n channels."""
    routing = random_topk_routing(8, 3, 2, seed=0, device="cpu")
    r, n, d = routing.num_rows, 256, 128
    assert dh_ws.ds_pairs_in_kernel(n)
    g = torch.Generator().manual_seed(0)
    dout = torch.randn(8, d, generator=g).half()
    w2 = torch.randn(3, d, n, generator=g).half()
    h = torch.randn(r, 2 * n, generator=g).half()
    with pytest.raises(ValueError, match="ds_pairs: needs pair_order=True"):
        dh_ws.dh_ws(dout, w2, h, torch.rand(r, generator=g), routing, ds_pairs=torch.float32)


def test_ds_pairs_message_gives_the_tile_width():
    """ds_pairs where a tile does not span n (n = 512: 256-wide tiles) is refused naming n and the tile width found,
    before anything is launched."""
    routing = random_topk_routing(8, 3, 2, seed=0, device="cpu")
    r, n, d = routing.num_rows, 512, 128
    g = torch.Generator().manual_seed(0)
    dout = torch.randn(8, d, generator=g).half()
    w2 = torch.randn(3, d, n, generator=g).half()
    h = torch.randn(r, 2 * n, generator=g).half()
    assert not dh_ws.ds_pairs_in_kernel(n)
    with pytest.raises(ValueError) as info:
        dh_ws.dh_ws(dout, w2, h, torch.rand(r, generator=g), routing, pair_order=True, ds_pairs=torch.float32)
    assert "BLOCK_N = n = 512 (got pair_order=True, BLOCK_N=256)" in str(info.value), str(info.value)


def test_ds_pairs_only_where_one_tile_spans_n():
    """The kernel writes dS in pair order only where one tile holds all n channels of its rows (n = 128, 256), not
    where a row's partials come from several tiles (n = 384, 512, 1024), nor where the kernel does not apply."""
    assert dh_ws.ds_pairs_in_kernel(128) and dh_ws.ds_pairs_in_kernel(256)
    assert not any(dh_ws.ds_pairs_in_kernel(n) for n in (384, 512, 1024, 192))


@pytest.mark.interpreter
def test_dispatch(monkeypatch, device):
    """dh hands the product to the Gluon kernel where dh_ws_supported says so (reducing its partials, or handing
    them back with reduce_ds=False; with ds_pairs, asking the kernel for dS in pair order where its tiles span all n
    channels, else summing its partials with score_grad), and never with an explicit Triton config; gpt-oss's
    clamped SwiGLU too (its activation passed on) with SONICMOE_GLUON_CLAMPED=1, not with 0."""
    calls = []

    def fake(dout, w2, h, s, routing, pair_order=False, ds_pairs=None, activation="swiglu"):
        calls.append(h.shape)
        if activation != "swiglu":
            dh_, ap, ds = dh_mod.dh_ref(dout, w2, h, s, routing, pair_order=pair_order, activation=activation)
            return dh_, ap, ds[None]  # one partial row
        if ds_pairs is not None:  # the kernel's own dS, marked so that the test can tell it from score_grad's
            dh_, ap, ds = dh_mod.dh_ref(dout, w2, h, s, routing, pair_order=pair_order, ds_pairs=ds_pairs)
            return dh_, ap, ds + 1000
        dh_, ap, ds = dh_mod.dh_ref(dout, w2, h, s, routing, pair_order=pair_order)
        return dh_, ap, torch.stack([ds / 2, ds / 2])  # two partial rows

    monkeypatch.setattr(dh_mod, "dh_ws_supported", lambda dout, w2, h, layout: layout == "concat")
    monkeypatch.setattr(dh_mod, "dh_ws_preferred", lambda n: n == 16)
    monkeypatch.setattr(dh_mod, "dh_ws", fake)
    routing = routing_from_topk(torch.tensor([[0, 2], [1, 2], [2, 0]], dtype=torch.int32, device=device), 3)
    dout = torch.randn(3, 16, device=device)
    w2 = torch.randn(3, 16, 16, device=device)
    h = torch.randn(routing.num_rows, 32, device=device)
    s = torch.rand(routing.num_rows, device=device)
    ref = dh_mod.dh_ref(dout, w2, h, s, routing)
    got = dh_mod.dh(dout, w2, h, s, routing)
    assert calls == [h.shape]
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and rel_err(got[2], ref[2]) < 1e-6
    parts = dh_mod.dh(dout, w2, h, s, routing, reduce_ds=False)[2]
    assert parts.shape == (2, routing.num_rows) and len(calls) == 2
    # on the GPU the pinned tile sized for these float32 operands (the bf16-sized one does not fit shared memory)
    cfg = dh_mod._PINNED_INTERP if interpreting() else sized_for_operands(dh_mod._GPU_DEFAULT, 4)
    got2 = dh_mod.dh(dout, w2, h, s, routing, config=cfg)
    assert len(calls) == 2
    for name, g, r in zip(("dH", "A'", "dS"), got2, ref):
        assert rel_err(g, r) < 1e-5, name
    # ds_pairs: from the kernel where its tiles span all n channels, else its partials summed by score_grad
    pairs = torch.empty_like(s)
    pairs[routing.row_pair.long()] = s
    want = dh_mod.dh_ref(dout, w2, h, pairs, routing, pair_order=True, ds_pairs=torch.float32)[2]
    for in_kernel in (False, True):
        monkeypatch.setattr(dh_mod, "ds_pairs_in_kernel", lambda n, in_kernel=in_kernel: in_kernel)
        assert dh_mod.ds_pairs_in_dh_kernel(dout, w2, h, routing) is in_kernel
        got3 = dh_mod.dh(dout, w2, h, pairs, routing, pair_order=True, ds_pairs=torch.float32)[2]
        assert rel_err(got3, want + (1000 if in_kernel else 0)) < 1e-6
    assert len(calls) == 4
    # gpt-oss's clamped SwiGLU: to the kernel with its activation under SONICMOE_GLUON_CLAMPED=1, not under 0
    h6 = 6 * h
    want = dh_mod.dh_ref(dout, w2, h6, s, routing, activation="clamped_swiglu")
    for switch, n_calls in (("1", 5), ("0", 5)):
        monkeypatch.setenv("SONICMOE_GLUON_CLAMPED", switch)
        got4 = dh_mod.dh(dout, w2, h6, s, routing, activation="clamped_swiglu")
        assert len(calls) == n_calls, switch
        for name, g, r in zip(("dH", "A'", "dS"), got4, want):
            assert rel_err(g, r) < 1e-5, (name, switch)


# (T, d, n, E, K, reason) on the GPU
GPU_CASES = [
    (1, 128, 128, 4, 1, "T=1, K=1"),
    (300, 256, 128, 8, 8, "K=E"),
    (1000, 384, 256, 16, 4, "one 256-wide N-tile, partial tiles"),
    (777, 192, 384, 40, 2, "empty experts, three K-blocks, three 128-wide N-tiles"),
    (4096, 1536, 256, 32, 8, "the 7B widths, 1024 rows per expert (full tiles)"),
    (2500, 64, 512, 3, 2, "d=64: one K-block, two N-tiles"),
]
GPU_PARAMS = [(c, torch.bfloat16) for c in GPU_CASES] + [(GPU_CASES[4], torch.float16)]


def _need_gluon():
    """Skip the test off an sm_90 GPU with Gluon."""
    if not grouped_gemm_ws.HAVE_GLUON or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel needs an sm_90 GPU")


def _layer_problem(d, n, bias, seed):
    """A bf16 layer's problem at T = 2048, E = 16 (for K = 4) and a dO (T, d); skips off sm_90."""
    from sonicmoe.testing import random_problem

    _need_gluon()
    p = random_problem(2048, d, n, 16, device="cuda", bias=bias, seed=seed)
    return p, torch.randn(2048, d, device="cuda", dtype=torch.bfloat16)


def _gpu_inputs(case, dtype, seed, monkeypatch):
    """Routing, dO, W2, H and row scores of a GPU case (fresh random values; outputs poisoned with NaN before the
    kernels write them); skips off sm_90."""
    _need_gluon()
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")
    t, d, n, e, k, _ = case
    routing = random_topk_routing(t, e, k, seed=t)
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = routing.num_rows
    dout = torch.randn(t, d, device="cuda", generator=g).to(dtype)
    w2 = (torch.randn(e, d, n, device="cuda", generator=g) / d ** 0.5).to(dtype)
    h = torch.randn(r, 2 * n, device="cuda", generator=g).to(dtype)
    return routing, dout, w2, h, torch.rand(r, device="cuda", generator=g)


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", GPU_PARAMS, ids=[f"{c[-1]}-{str(dt)[6:]}" for c, dt in GPU_PARAMS])
def test_gpu_matches_reference_and_triton(case, dtype, monkeypatch):
    """dH, A′ and dS within rounding of the float32 loop and of the Triton kernel, no NaN left by the poison fill,
    the same bits on a second run, the inputs untouched; dH and A′ bitwise the Triton kernel's (the same dA′
    accumulation order and epilogue arithmetic); the default config, pointer stores instead of TMA stores, 128-wide
    tiles with every H block prefetched, 16-channel blocks (16 per 256-wide tile), and 32-deep K-blocks in a deeper
    ring, and the sigmoid by the ftz forms (SIGMOID_FTZ)."""
    routing, dout, w2, h, s = _gpu_inputs(case, dtype, 1, monkeypatch)
    n = w2.shape[2]
    ins = [v.clone() for v in (dout, w2, h, s)]
    ref = dh_mod.dh_ref(dout, w2, h, s, routing)
    monkeypatch.setenv("SONICMOE_GLUON_DH", "0")
    tri = dh_mod.dh(dout, w2, h, s, routing)
    monkeypatch.delenv("SONICMOE_GLUON_DH")
    runs, bitwise = {}, {}
    for cfg in (None, {**dh_ws_config(n, 16, 2), "TMA_STORE": False}, dh_ws_config(n, 32, 4, 128),
                dh_ws_config(n, 16, 2), dh_ws_config(n, 32, 2, None, 32), dh_ws_config(n, 16, 2, None, 32),
                dh_ws_config(n, 32, 2, stage_in_ring=False), dh_ws_config(n, 16, 2, stage_in_ring=False),
                {**dh_ws_config(n, 32, 2, stage_in_ring=True), "TMA_STORE": False},
                {**dh_ws_config(n), "SIGMOID_FTZ": True}):
        got = dh_ws.dh_ws(dout, w2, h, s, routing, config=cfg)
        ds = got[2].sum(0)
        for name, x, y, z in zip(("dH", "A'", "dS"), (got[0], got[1], ds), ref, tri):
            assert not torch.isnan(x).any(), name
            assert rel_err(x, y) < 1e-2, name
            assert rel_err(x, z) < 3e-3, name
        again = dh_ws.dh_ws(dout, w2, h, s, routing, config=cfg)
        assert all(torch.equal(x, y) for x, y in zip(got, again))
        bitwise[str(cfg)] = torch.equal(got[0], tri[0]) and torch.equal(got[1], tri[1])
        runs[cfg is None] = got
    assert all(bitwise.values()), bitwise
    assert all(torch.equal(x, y) for x, y in zip(ins, (dout, w2, h, s)))
    # scores in pair order, each row's read through row_pair in the kernel: the same bits (bf16 scores too)
    pairs = torch.empty_like(s)
    pairs[routing.row_pair.long()] = s
    for scores, row_order in ((pairs, s), (pairs.bfloat16(), s.bfloat16().float())):
        base = dh_ws.dh_ws(dout, w2, h, row_order, routing)
        gathered = dh_ws.dh_ws(dout, w2, h, scores, routing, pair_order=True)
        assert all(torch.equal(x, y) for x, y in zip(gathered, base))
    # dh() runs this kernel where dh_ws_preferred says so (its partials reduced there)
    monkeypatch.setattr(dh_mod, "dh_ws_preferred", lambda n: True)
    via = dh_mod.dh(dout, w2, h, s, routing)
    assert torch.equal(via[0], runs[True][0]) and torch.equal(via[2], runs[True][2].sum(0))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[-1] for c in GPU_CASES])
@pytest.mark.parametrize("padding", [False, True], ids=["", "padding"])
def test_gpu_ds_pairs(case, padding, monkeypatch):
    """``ds_pairs``: where a tile spans all n channels the kernel writes dS itself, each row's block partials added
    in block order, in pair order and the scores' dtype — the bits of ``score_grad`` on the kernel's own partials,
    with dH and A′ unchanged, every poisoned element overwritten (padding pairs: 0) and the same bits again; where
    it does not, ``dh_ws`` refuses and ``dh`` sums the partials after it."""
    from sonicmoe.routing import routing_from_pairs

    routing, dout, w2, h, s = _gpu_inputs(case, torch.bfloat16, 2, monkeypatch)
    t, e, n = dout.shape[0], w2.shape[0], w2.shape[2]
    real = routing.num_rows  # dH and A′ rows past it (padding) are left unwritten: poisoned NaN, compared up to it
    if padding:  # 37 padding pairs (token T, expert E) after the real ones: rows past expert_offsets[E]
        pad = torch.full((37,), t, device="cuda", dtype=torch.int64)
        pair_token = torch.cat([routing.row_token.long()[routing.pair_row.long()], pad])
        pair_expert = torch.cat([routing.row_expert()[routing.pair_row.long()], pad * 0 + e])
        routing = routing_from_pairs(pair_token, pair_expert, t, e, padding=True)
        assert routing.num_rows == real + 37 and routing.padded
        h = torch.cat([h, torch.randn(37, 2 * n, device="cuda").to(h.dtype)])
        s = torch.cat([s, torch.rand(37, device="cuda")])
    pairs = torch.empty_like(s)
    pairs[routing.row_pair.long()] = s
    monkeypatch.setattr(dh_mod, "dh_ws_preferred", lambda n: True)
    for scores in (pairs, pairs.bfloat16()):
        base = dh_ws.dh_ws(dout, w2, h, scores, routing, pair_order=True)
        want = score_grad(base[2], routing.row_pair, routing.expert_offsets, None, scores.dtype)
        via = dh_mod.dh(dout, w2, h, scores, routing, pair_order=True, ds_pairs=scores.dtype)
        assert torch.equal(via[2], want) and not torch.isnan(want).any()
        assert torch.equal(via[0][:real], base[0][:real]) and torch.equal(via[1][:real], base[1][:real])
        if not dh_ws.ds_pairs_in_kernel(n):
            with pytest.raises(ValueError, match="ds_pairs"):
                dh_ws.dh_ws(dout, w2, h, scores, routing, pair_order=True, ds_pairs=scores.dtype)
            assert not dh_mod.ds_pairs_in_dh_kernel(dout, w2, h, routing)
            continue
        assert dh_mod.ds_pairs_in_dh_kernel(dout, w2, h, routing)
        got = dh_ws.dh_ws(dout, w2, h, scores, routing, pair_order=True, ds_pairs=scores.dtype)
        assert got[2].dtype == scores.dtype and got[2].shape == (routing.num_rows,)
        assert not torch.isnan(got[2]).any()
        assert torch.equal(got[2], want)
        assert torch.equal(got[0][:real], base[0][:real]) and torch.equal(got[1][:real], base[1][:real])
        if padding:
            assert torch.all(got[2][routing.row_pair[real:].long()] == 0)
        again = dh_ws.dh_ws(dout, w2, h, scores, routing, pair_order=True, ds_pairs=scores.dtype)
        assert torch.equal(got[2], again[2])
        assert all(torch.equal(x[:real], y[:real]) for x, y in zip(got[:2], again[:2]))
    with pytest.raises(ValueError, match="ds_pairs"):
        dh_ws.dh_ws(dout, w2, h, s, routing, ds_pairs=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [256, 512])
def test_gpu_layer_ds_in_dh_kernel(monkeypatch, n):
    """Without expert biases, where the Gluon dH kernel's tiles span all n channels (n = 256), the layer's backward
    takes dS from that kernel and launches no ``score_grad``; at n = 512 (two 256-wide tiles per row) it sums the
    partials with ``score_grad``. The router's and X's gradients stay within rounding of SONICMOE_GLUON_DH=0's."""
    from sonicmoe.ops import library
    from sonicmoe.testing import layer_grads

    p, dout = _layer_problem(1536, n, False, 6)
    k = 4
    sums = []
    monkeypatch.setattr(library, "score_grad", lambda *a, **kw: sums.append(1) or score_grad(*a, **kw))
    on = layer_grads(p, dout, k)
    assert (not sums) == (n == 256), sums
    again = layer_grads(p, dout, k)
    assert all(torch.equal(on[1][name], again[1][name]) for name in on[1])
    monkeypatch.setenv("SONICMOE_GLUON_DH", "0")
    off = layer_grads(p, dout, k)
    assert torch.equal(on[0], off[0])
    for name in on[1]:
        assert rel_err(on[1][name], off[1][name]) < 1e-3, name


@pytest.mark.gpu
@pytest.mark.parametrize("d", [1536, 4096])
def test_gpu_layer_uses_gluon_dh(monkeypatch, d):
    """At shapes the rule selects (n = 256), the layer's backward runs the Gluon dH kernel, and its gradients stay
    within rounding of those with SONICMOE_GLUON_DH=0 (bias terms included: dS gains ⟨dO, b2⟩ outside the kernel)."""
    from sonicmoe.testing import layer_grads

    p, dout = _layer_problem(d, 256, True, 4)
    k = 4
    calls = []
    monkeypatch.setattr(dh_mod, "dh_ws", lambda *a, **kw: calls.append(1) or dh_ws.dh_ws(*a, **kw))
    on = layer_grads(p, dout, k)
    assert calls
    monkeypatch.setenv("SONICMOE_GLUON_DH", "0")
    n_calls = len(calls)
    off = layer_grads(p, dout, k)
    assert len(calls) == n_calls
    assert torch.equal(on[0], off[0])
    for name in on[1]:
        assert rel_err(on[1][name], off[1][name]) < 1e-3, name
