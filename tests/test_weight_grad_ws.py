"""The warp-specialised varlen-K weight-gradient GEMM (sonicmoe/ops/weight_grad_ws.py).

The Gluon kernel needs an sm_90 GPU (tests marked ``gpu``); its config, dispatch rule and the launcher's hand-off
run on CPU too.
"""

from __future__ import annotations

import pytest
import torch

from sonicmoe.ops import weight_grad, weight_grad_ws
from sonicmoe.ops.common import interpreting, sized_for_operands
from sonicmoe.ops.load_order import expert_load_order
from sonicmoe.ops.weight_grad import varlen_k_gemm, varlen_k_gemm_ref
from sonicmoe.ops.weight_grad_ws import (
    wgrad_ws,
    wgrad_ws_calls,
    wgrad_ws_config,
    wgrad_ws_smem_bytes,
    wgrad_ws_supported,
)
from sonicmoe.routing import routing_from_topk
from sonicmoe.testing import rel_err


def _hopper_gluon() -> bool:
    return (weight_grad_ws.HAVE_GLUON and torch.cuda.is_available()
            and torch.cuda.get_device_capability() == (9, 0))


def test_config_fits_shared_memory():
    """Every config fits the budget with its ring, one more slot would not (or it is at MAX_STAGES), the
    gathered operand's side is the 128-wide one where both tiles fit, and shapes that are no tile multiple
    get none."""
    for i_dim, j_dim in ((512, 1536), (1536, 256), (2048, 4096), (4096, 1024), (256, 256), (128, 512)):
        for p_gather in (False, True):
            cfg = wgrad_ws_config(i_dim, j_dim, p_gather)
            assert cfg is not None, (i_dim, j_dim, p_gather)
            bi, bj, br, st = cfg["BLOCK_I"], cfg["BLOCK_J"], cfg["BLOCK_R"], cfg["STAGES"]
            assert i_dim % bi == 0 and j_dim % bj == 0 and {bi, bj} == {128, 256}
            assert 2 <= st <= weight_grad_ws.MAX_STAGES
            # half a tile of output buffers: the tile's right half in a ring slot, or two warpgroups' pieces
            half = cfg["STAGE_IN_RING"] or cfg["WG_SPLIT"]
            assert not (cfg["STAGE_IN_RING"] and cfg["WG_SPLIT"])
            assert wgrad_ws_smem_bytes(bi, bj, br, st, stage_in_ring=half) <= weight_grad_ws.SMEM_BUDGET
            assert (wgrad_ws_smem_bytes(bi, bj, br, st + 1, stage_in_ring=half) > weight_grad_ws.SMEM_BUDGET
                    or st == weight_grad_ws.MAX_STAGES)
            if i_dim % 256 == 0 and j_dim % 256 == 0:
                assert (bi == 128) == p_gather
    for i_dim, j_dim in ((100, 256), (256, 200), (64, 512), (0, 256)):
        assert wgrad_ws_config(i_dim, j_dim, False) is None


def test_staging_in_a_ring_slot():
    """With the tile's right half in a ring slot: half the tile fits the slot's wider chunk at both tile shapes,
    the output buffer is half the tile, and the ring is one slot deeper (4) within the same shared memory."""
    for i_dim, j_dim in ((512, 1536), (1536, 256), (2048, 4096), (4096, 1024)):
        for p_gather in (False, True):
            own = wgrad_ws_config(i_dim, j_dim, p_gather, stage_in_ring=False, wg_split=False)
            ring = wgrad_ws_config(i_dim, j_dim, p_gather, stage_in_ring=True, wg_split=False)
            bi, bj, br = ring["BLOCK_I"], ring["BLOCK_J"], ring["BLOCK_R"]
            assert not own["STAGE_IN_RING"] and ring["STAGE_IN_RING"] and (bi, bj) == (own["BLOCK_I"], own["BLOCK_J"])
            assert weight_grad_ws.half_tile_fits_slot(bi, bj, br) and br * max(bi, bj) == bi * bj // 2
            assert ring["STAGES"] == own["STAGES"] + 1 == 4
            assert wgrad_ws_smem_bytes(bi, bj, br, 4, stage_in_ring=True) <= weight_grad_ws.SMEM_BUDGET
            assert wgrad_ws_smem_bytes(bi, bj, br, 5, stage_in_ring=True) > weight_grad_ws.SMEM_BUDGET
    assert not weight_grad_ws.half_tile_fits_slot(256, 128, 32)  # 32-row chunks: half a tile is two slots' worth


def test_warpgroup_split_config():
    """With the two MMA warpgroups as partitions of their own: no staging in the ring, the same tile and the same
    4-slot ring as the staging in a ring slot (their store buffers are half a tile between them), whatever
    SONICMOE_WGRAD_STAGE_IN_RING says; the switch SONICMOE_WGRAD_WG_SPLIT picks the form where unset."""
    for i_dim, j_dim in ((512, 1536), (1536, 256), (2048, 4096), (4096, 1024)):
        for p_gather in (False, True):
            ring = wgrad_ws_config(i_dim, j_dim, p_gather, stage_in_ring=True, wg_split=False)
            split = wgrad_ws_config(i_dim, j_dim, p_gather, stage_in_ring=True, wg_split=True)
            assert split["WG_SPLIT"] and not split["STAGE_IN_RING"] and not ring["WG_SPLIT"]
            assert {k: split[k] for k in ("BLOCK_I", "BLOCK_J", "STAGES")} == {
                k: ring[k] for k in ("BLOCK_I", "BLOCK_J", "STAGES")}
            assert split["BLOCK_I"] // 2 >= 64  # each warpgroup's half: whole m64 wgmma rows


def test_warpgroup_split_switch(monkeypatch):
    """SONICMOE_WGRAD_WG_SPLIT 1 / 0 turns the split form on / off in the default config (read at each call); unset,
    WG_SPLIT decides; an explicit argument wins."""
    monkeypatch.delenv("SONICMOE_WGRAD_WG_SPLIT", raising=False)
    assert wgrad_ws_config(2048, 4096, False)["WG_SPLIT"] == weight_grad_ws.WG_SPLIT
    monkeypatch.setenv("SONICMOE_WGRAD_WG_SPLIT", "1")
    assert wgrad_ws_config(2048, 4096, False)["WG_SPLIT"]
    assert wgrad_ws_config(2048, 4096, False)["STAGES"] == 4
    monkeypatch.setenv("SONICMOE_WGRAD_WG_SPLIT", "0")
    assert not wgrad_ws_config(2048, 4096, False)["WG_SPLIT"]
    assert wgrad_ws_config(2048, 4096, False, wg_split=True)["WG_SPLIT"]


def test_swap_ab_config(monkeypatch):
    """The transposed warpgroup products (SWAP_AB) apply only to the split form's 256 x 128 tiles (dW1, X
    gathered), keep that form's tile and ring, and take the 256-wide wgmma's registers;
    SONICMOE_WGRAD_SWAP_AB picks the default."""
    for i_dim, j_dim in ((512, 1536), (2048, 4096)):
        two = wgrad_ws_config(i_dim, j_dim, False, wg_split=True, swap_ab=False)
        one = wgrad_ws_config(i_dim, j_dim, False, wg_split=True, swap_ab=True)
        assert (one["BLOCK_I"], one["BLOCK_J"]) == (256, 128) and one["SWAP_AB"] and not two["SWAP_AB"]
        assert {k: v for k, v in one.items() if k not in ("SWAP_AB", "MAXNREG")} == {
            k: v for k, v in two.items() if k not in ("SWAP_AB", "MAXNREG")}
        assert one["MAXNREG"] == weight_grad_ws.MAXNREG[256] >= 154  # a 256-wide wgmma compiles from 154
        assert not wgrad_ws_config(i_dim, j_dim, False, wg_split=False, swap_ab=True)["SWAP_AB"]
    assert not wgrad_ws_config(4096, 1024, True, wg_split=True, swap_ab=True)["SWAP_AB"]  # dW2: 128 x 256 tiles
    for flag in ("1", "0"):
        monkeypatch.setenv("SONICMOE_WGRAD_SWAP_AB", flag)
        assert wgrad_ws_config(2048, 4096, False, wg_split=True)["SWAP_AB"] == (flag == "1")


def test_config_takes_a_two_slot_ring():
    """Two ring slots are the fewest the kernel runs with (one chunk loading while the MMAs read the other): with
    128-row chunks (98304 bytes a slot at both tile shapes) two slots fit beside the half tile of store buffers
    (32768 bytes), and the config takes them; with 192-row chunks only one fits and there is none."""
    for i_dim, j_dim, p_gather in ((512, 1536, False), (1536, 256, True)):
        cfg = wgrad_ws_config(i_dim, j_dim, p_gather, block_r=128, stage_in_ring=False, wg_split=True)
        assert cfg is not None and cfg["BLOCK_R"] == 128 and cfg["STAGES"] == 2
        assert {cfg["BLOCK_I"], cfg["BLOCK_J"]} == {128, 256}
        assert 2 * (2 * 128 * 384 + 128 * 128) <= weight_grad_ws.SMEM_BUDGET < 2 * (3 * 128 * 384 + 128 * 128)
        assert wgrad_ws_config(i_dim, j_dim, p_gather, block_r=192, stage_in_ring=False, wg_split=True) is None


@pytest.mark.parametrize("p_gather", [False, True], ids=["dW1", "dW2"])
def test_no_rows_gives_zeros_before_any_launch(p_gather, monkeypatch):
    """No routed rows (the routed operand has none while the gathered one has T rows): every expert's gradient is
    exactly zero (outputs poisoned with NaN first), returned before any TMA descriptor or launch (none can run
    here)."""
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")
    e, t, i_dim, j_dim = 3, 5, 256, 128
    routed = torch.zeros(0, j_dim if p_gather else i_dim, dtype=torch.float16)
    gathered = torch.randn(t, i_dim if p_gather else j_dim).half()
    p, q = (gathered, routed) if p_gather else (routed, gathered)
    tok = torch.zeros(0, dtype=torch.int32)
    got = wgrad_ws(p, q, tok, torch.zeros(e + 1, dtype=torch.int32), p_gather=p_gather)
    assert got.shape == (e, i_dim, j_dim) and got.dtype == torch.float16 and (got == 0).all()


def test_layer_prefers_gluon_for_wide_experts(monkeypatch):
    """The layer's backward asks for the Gluon weight gradients from library.GLUON_WGRAD_MIN_N = 128 on (n = 64:
    the Triton kernels), at every n under SONICMOE_GLUON_WGRAD=all."""
    from sonicmoe.ops import library

    monkeypatch.delenv("SONICMOE_GLUON_WGRAD", raising=False)
    assert library.gluon_wgrad_preferred(library.GLUON_WGRAD_MIN_N) and library.gluon_wgrad_preferred(2048)
    assert library.GLUON_WGRAD_MIN_N == 128
    assert library.gluon_wgrad_preferred(128) and library.gluon_wgrad_preferred(256)
    assert not library.gluon_wgrad_preferred(64) and not library.gluon_wgrad_preferred(library.GLUON_WGRAD_MIN_N - 8)
    monkeypatch.setenv("SONICMOE_GLUON_WGRAD", "all")
    assert library.gluon_wgrad_preferred(64) and library.gluon_wgrad_preferred(8)
    assert weight_grad_ws.wgrad_ws_enabled() == weight_grad_ws.ws_enabled()


def test_not_supported_off_hopper_or_out_of_range(monkeypatch):
    """CPU tensors, float32, both or neither operand gathered, another output dtype, no tile multiple, or
    SONICMOE_GLUON(_WGRAD)=0 never reach the Gluon kernel."""
    p = torch.zeros(64, 256, dtype=torch.bfloat16)
    q = torch.zeros(64, 512, dtype=torch.bfloat16)
    kw = {"p_gather": False, "q_gather": True, "out_dtype": torch.bfloat16}
    assert not wgrad_ws_supported(p, q, **kw)  # CPU
    if torch.cuda.is_available():
        p, q = p.cuda(), q.cuda()
        assert not wgrad_ws_supported(p.float(), q.float(), **{**kw, "out_dtype": torch.float32})
        assert not wgrad_ws_supported(p, q, **{**kw, "p_gather": True})
        assert not wgrad_ws_supported(p, q, **{**kw, "q_gather": False})
        assert not wgrad_ws_supported(p, q, **{**kw, "out_dtype": torch.float32})
        assert not wgrad_ws_supported(p[:, :200], q, **kw)
        assert wgrad_ws_supported(p, q, **kw) == _hopper_gluon()
        monkeypatch.setenv("SONICMOE_GLUON_WGRAD", "0")
        assert not wgrad_ws_supported(p, q, **kw)
        monkeypatch.delenv("SONICMOE_GLUON_WGRAD")
        monkeypatch.setenv("SONICMOE_GLUON", "0")
        assert not wgrad_ws_supported(p, q, **kw)


def test_supported_rule_on_a_faked_sm90(fake_sm90):
    """The checks above where no GPU is (CPU tensors' stand-ins on a faked sm_90 device): taken on sm_90 only (not on
    sm_80 or sm_100), with exactly one operand gathered (not both, not neither) and an output of the operands'
    dtype."""
    p, q = fake_sm90(torch.zeros(64, 256, dtype=torch.bfloat16), torch.zeros(64, 512, dtype=torch.bfloat16))
    kw = {"p_gather": False, "q_gather": True, "out_dtype": torch.bfloat16}
    assert wgrad_ws_supported(p, q, **kw) and wgrad_ws_supported(p, q, **{**kw, "p_gather": True, "q_gather": False})
    assert not wgrad_ws_supported(p, q, **{**kw, "q_gather": False})
    assert not wgrad_ws_supported(p, q, **{**kw, "p_gather": True})
    assert not wgrad_ws_supported(p, q, **{**kw, "out_dtype": torch.float32})
    # an operand whose first element is not 16-byte aligned (TMA, cp.async): either one
    def shifted(rows, cols):  # contiguous, one element (2 bytes) past a 16-byte boundary
        t = torch.zeros(rows * cols + 1, dtype=torch.bfloat16)[1:].view(rows, cols)
        assert t.is_contiguous() and t.data_ptr() % 16 == 2
        return fake_sm90(t)

    assert not wgrad_ws_supported(shifted(64, 256), q, **kw)
    assert not wgrad_ws_supported(p, shifted(64, 512), **kw)
    for cap in ((8, 0), (10, 0)):
        fake_sm90.capability = cap
        assert not wgrad_ws_supported(p, q, **kw), cap


def test_supported_rule_checks_each_operand_on_a_faked_sm90(fake_sm90):
    """Each operand's own check of the rule (a faked sm_90): float32 operands and output of one dtype (no wgmma of
    theirs), a P or a Q that is not contiguous (the routed operand is read through TMA, the gathered one by row
    copies of a unit-stride row), and CPU tensors with Gluon present; both gathered sides."""
    bf = torch.bfloat16
    p_cpu, q_cpu = torch.zeros(64, 256, dtype=bf), torch.zeros(64, 512, dtype=bf)
    p, q = fake_sm90(p_cpu, q_cpu)
    p_wide = torch.zeros(64, 512, dtype=bf)[:, :256]  # (64, 256), row stride 512: aligned, not contiguous
    q_wide = torch.zeros(64, 1024, dtype=bf)[:, :512]
    assert not p_wide.is_contiguous() and not q_wide.is_contiguous()
    for pg in (False, True):
        kw = {"p_gather": pg, "q_gather": not pg, "out_dtype": bf}
        assert wgrad_ws_supported(p, q, **kw)
        assert not wgrad_ws_supported(*fake_sm90(p_cpu.float(), q_cpu.float()), **{**kw, "out_dtype": torch.float32})
        assert not wgrad_ws_supported(fake_sm90(p_wide), q, **kw)
        assert not wgrad_ws_supported(p, fake_sm90(q_wide), **kw)
        assert not wgrad_ws_supported(p_cpu, q_cpu, **kw)  # CPU tensors, Gluon "present"


@pytest.mark.interpreter
def test_dispatch(monkeypatch, device):
    """varlen_k_gemm hands the product to the Gluon kernel where wgrad_ws_supported says so (with the routing's
    row tokens and offsets, the gathered side and the experts' load order), and never with an explicit Triton
    config."""
    calls = []

    def fake(p, q, row_token, offsets, *, p_gather, expert_order):
        calls.append((row_token, offsets, p_gather))
        assert expert_order.tolist() == [2, 0, 1, 1, 2, 0]  # counts 2, 1, 3: expert 2 first
        return varlen_k_gemm_ref(p, q, routing, p_gather=p_gather, q_gather=not p_gather, out_dtype=p.dtype)

    monkeypatch.setattr(weight_grad_ws, "wgrad_ws_supported", lambda p, q, **kw: True)
    monkeypatch.setattr(weight_grad_ws, "wgrad_ws", fake)
    monkeypatch.setenv("SONICMOE_WGRAD_ORDER", "load")
    routing = routing_from_topk(torch.tensor([[0, 2], [1, 2], [2, 0]], dtype=torch.int32, device=device), 3)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, 16, device=device, generator=g)
    dh = torch.randn(6, 32, device=device, generator=g)
    out = varlen_k_gemm(dh, x, routing, p_gather=False, q_gather=True, out_dtype=x.dtype)
    assert len(calls) == 1 and calls[0] == (routing.row_token, routing.expert_offsets, False)
    assert torch.equal(out, varlen_k_gemm_ref(dh, x, routing, p_gather=False, q_gather=True, out_dtype=x.dtype))
    # on the GPU the pinned tile sized for these float32 operands (the bf16-sized one does not fit shared memory)
    cfg = weight_grad._PINNED_INTERP if interpreting() else sized_for_operands(weight_grad._GPU_DEFAULT, 4)
    tri = varlen_k_gemm(dh, x, routing, p_gather=False, q_gather=True, out_dtype=x.dtype, config=cfg)
    assert len(calls) == 1
    assert rel_err(tri, out) < 1e-5


# (T, d, n, E, K, experts left without tokens, reason) on the GPU
GPU_CASES = [
    (1, 256, 128, 4, 1, 0, "T=1, K=1: one row, a partial chunk only"),
    (500, 256, 128, 6, 6, 0, "K=E: every token in every expert"),
    (3000, 768, 256, 16, 4, 3, "empty experts, counts no chunk multiple"),
    (777, 512, 128, 1, 1, 0, "E=1"),
    (333, 1024, 512, 8, 2, 0, "n=512"),
    (4096, 1536, 256, 128, 8, 5, "the 7B widths, 256 rows per expert, empty experts"),
]
GPU_PARAMS = [(c, torch.bfloat16) for c in GPU_CASES] + [(GPU_CASES[2], torch.float16)]


def _routing(t, e, k, empty, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(t, e, device="cuda", generator=g)
    logits[:, :empty] = -1e9
    return routing_from_topk(logits.topk(k, dim=1).indices.to(torch.int32), e)


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", GPU_PARAMS, ids=[f"{c[-1]}-{str(dt)[6:]}" for c, dt in GPU_PARAMS])
def test_gpu_matches_reference_and_triton(case, dtype, monkeypatch):
    """dW1 (X gathered) and dW2 (dO gathered): within rounding of the float32 loop, no NaN left by the poison
    fill, empty experts exactly zero, bitwise equal to the Triton kernel and to a second run, inputs untouched."""
    if not _hopper_gluon():
        pytest.skip("the Gluon kernel needs an sm_90 GPU")
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")
    t, d, n, e, k, empty, _ = case
    routing = _routing(t, e, k, empty, seed=t)
    r = routing.num_rows
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(t, d, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(t, d, device="cuda", dtype=dtype, generator=g)
    dh = torch.randn(r, 2 * n, device="cuda", dtype=dtype, generator=g)
    ap = torch.randn(r, n, device="cuda", dtype=dtype, generator=g)
    for p, q, pg in ((dh, x, False), (dout, ap, True)):
        assert wgrad_ws_supported(p, q, p_gather=pg, q_gather=not pg, out_dtype=dtype)
        p0, q0 = p.clone(), q.clone()
        ref = varlen_k_gemm_ref(p.float(), q.float(), routing, p_gather=pg, q_gather=not pg, out_dtype=torch.float32)
        monkeypatch.setenv("SONICMOE_GLUON_WGRAD", "0")
        tri = varlen_k_gemm(p, q, routing, p_gather=pg, q_gather=not pg, out_dtype=dtype)
        monkeypatch.delenv("SONICMOE_GLUON_WGRAD")
        # the default config, the output tile through a buffer of its own / its right half through a ring slot, and
        # the two MMA warpgroups as partitions of their own (WG_SPLIT), each warpgroup's product transposed or not
        # (SWAP_AB: dW1's 256 x 128 tiles)
        cfgs = [wgrad_ws_config(p.shape[1], q.shape[1], pg, stage_in_ring=r, wg_split=False) for r in (False, True)]
        cfgs += [wgrad_ws_config(p.shape[1], q.shape[1], pg, wg_split=True, swap_ab=sw) for sw in (False, True)]
        for cfg in [None, *cfgs]:
            got = wgrad_ws(p, q, routing.row_token, routing.expert_offsets, p_gather=pg, config=cfg)
            assert torch.isfinite(got).all(), cfg
            assert rel_err(got, ref) < 4e-3, (pg, cfg)
            assert (got[:empty] == 0).all(), cfg
            assert torch.equal(got, tri), (pg, cfg)
            assert torch.equal(got, wgrad_ws(p, q, routing.row_token, routing.expert_offsets, p_gather=pg,
                                             config=cfg))
            assert torch.equal(got, wgrad_ws(p, q, routing.row_token, routing.expert_offsets, p_gather=pg,
                                             config=cfg, expert_order=expert_load_order(routing.expert_offsets)))
        assert torch.equal(p, p0) and torch.equal(q, q0)


def test_wrong_expert_order_is_refused():
    """An expert order of the wrong shape (shorter or longer than 2·E, or not one-dimensional), dtype or device is a
    ValueError naming it and the (2·E,) shape it expects (the kernel would read past a short one, and a longer one is
    not an order of these experts), raised before anything is launched: on any machine."""
    offsets = torch.tensor([0, 2, 5, 5], dtype=torch.int32)
    p, q = torch.zeros(5, 128, dtype=torch.bfloat16), torch.zeros(4, 256, dtype=torch.bfloat16)
    tok = torch.tensor([0, 1, 2, 3, 0], dtype=torch.int32)
    for bad in (torch.zeros(3, dtype=torch.int32), torch.zeros(6, dtype=torch.int64),
                torch.zeros(6, dtype=torch.int32, device="meta"), torch.zeros(7, dtype=torch.int32),
                torch.zeros(2, 6, dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"expert_order: expected a \(6,\) int32 tensor on cpu"):
            wgrad_ws(p, q, tok, offsets, p_gather=False, expert_order=bad)


@pytest.mark.parametrize("total,programs", [(1, 1), (7, 7), (8, 3), (9, 3), (10, 3), (3072, 132), (1540, 132),
                                             (1600, 132)])
def test_program_tiles_partition_the_tiles(total, programs):
    """The persistent kernel's schedule (host twin): each tile runs on exactly one program, each program's tiles
    ascend one per wave, and the serpentine deal gives a program slot p of the even waves and P − 1 − p of the odd
    ones, the last partial wave included (odd and even wave counts, a full last wave, one program per tile)."""
    for serpentine in (False, True):
        per = weight_grad_ws.program_tiles(total, programs, serpentine)
        assert sorted(t for tiles in per for t in tiles) == list(range(total))
        for p, tiles in enumerate(per):
            assert [t // programs for t in tiles] == list(range(len(tiles)))
            for w, t in enumerate(tiles):
                assert t % programs == (programs - 1 - p if serpentine and w % 2 else p)
    # a descending run of tile lengths dealt serpentine evens out the programs' sums that round-robin leaves apart
    lengths = list(range(total, 0, -1))
    spans = {s: max(sum(lengths[t] for t in tiles) for tiles in weight_grad_ws.program_tiles(total, programs, s))
             - min(sum(lengths[t] for t in tiles) for tiles in weight_grad_ws.program_tiles(total, programs, s))
             for s in (False, True)}
    if total >= 2 * programs > 2:
        assert spans[True] < spans[False]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_load_order_same_bits_under_skew(dtype, monkeypatch):
    """Under a skewed load (two experts with most rows, empty ones, counts not chunk multiples), dW1 and dW2 with
    the tiles taken busiest expert first (SONICMOE_WGRAD_ORDER=load) equal bitwise those in expert order (the
    default): by the Gluon kernel, by the Triton kernel's per-tile grid and by its persistent
    step loop; each within rounding of the float32 loop."""
    from sonicmoe.routing import routing_from_pairs

    if not _hopper_gluon():
        pytest.skip("the Gluon kernel needs an sm_90 GPU")
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")
    t, d, n = 2048, 256, 128
    counts = [0, 1900, 17, 300, 0, 64, 1500, 5, 129, 0, 2, 700]
    e = len(counts)
    g = torch.Generator().manual_seed(5)
    tok = torch.cat([torch.randperm(t, generator=g)[:c] for c in counts]).cuda()
    exp = torch.repeat_interleave(torch.arange(e), torch.tensor(counts)).cuda()
    routing = routing_from_pairs(tok, exp, t, e)
    r = routing.num_rows
    x = torch.randn(t, d, device="cuda", dtype=dtype)
    dout = torch.randn(t, d, device="cuda", dtype=dtype)
    dh = torch.randn(r, 2 * n, device="cuda", dtype=dtype)
    ap = torch.randn(r, n, device="cuda", dtype=dtype)
    for p, q, pg, pinned in ((dh, x, False, weight_grad._GPU_DEFAULT), (dout, ap, True,
                                                                         weight_grad._GPU_DEFAULT_P_GATHERED)):
        assert wgrad_ws_supported(p, q, p_gather=pg, q_gather=not pg, out_dtype=dtype)
        ref = varlen_k_gemm_ref(p.float(), q.float(), routing, p_gather=pg, q_gather=not pg, out_dtype=torch.float32)
        for cfg in (None, pinned, {**pinned, **weight_grad._STEPS}):
            runs = []
            for order in ("load", "expert"):
                monkeypatch.setenv("SONICMOE_WGRAD_ORDER", order)
                runs.append(varlen_k_gemm(p, q, routing, p_gather=pg, q_gather=not pg, out_dtype=dtype, config=cfg))
            assert torch.equal(runs[0], runs[1]), (pg, cfg)
            assert rel_err(runs[0], ref) < 4e-3, (pg, cfg)
            assert (runs[0][[0, 4, 9]] == 0).all()


@pytest.mark.gpu
def test_gpu_no_routed_rows_gives_zeros(monkeypatch):
    """No routed rows (R = 0: general routing that kept no pair; the bf16 fuzz found it once the layer used this
    kernel at n = 128): every expert's gradient is exactly zero, where a TMA descriptor of zero rows would fail."""
    from sonicmoe.routing import routing_from_pairs

    if not _hopper_gluon():
        pytest.skip("the Gluon kernel needs an sm_90 GPU")
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")
    t, d, n, e = 4, 128, 128, 3
    empty = torch.zeros(0, device="cuda", dtype=torch.int32)
    routing = routing_from_pairs(empty, empty, t, e)
    assert routing.num_rows == 0
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(0, 2 * n, device="cuda", dtype=torch.bfloat16)
    assert wgrad_ws_supported(dh, x, p_gather=False, q_gather=True, out_dtype=torch.bfloat16)
    got = varlen_k_gemm(dh, x, routing, p_gather=False, q_gather=True, out_dtype=torch.bfloat16)
    assert got.shape == (e, 2 * n, d) and (got == 0).all()


@pytest.mark.gpu
def test_gpu_layer_uses_gluon_weight_gradients(monkeypatch):
    """For experts of width n >= library.GLUON_WGRAD_MIN_N the layer's backward runs both weight gradients through
    the Gluon kernel and gives the same bits as with SONICMOE_GLUON_WGRAD=0; for narrower ones it does not."""
    import sonicmoe
    from sonicmoe.testing import random_problem

    if not _hopper_gluon():
        pytest.skip("the Gluon kernel needs an sm_90 GPU")
    from sonicmoe.ops.library import GLUON_WGRAD_MIN_N

    t, d, n, e, k = 2048, 1024, GLUON_WGRAD_MIN_N, 16, 4
    p = random_problem(t, d, n, e, device="cuda", seed=3)
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)

    def run(p=p, dout=dout, k=k):
        ins = {key: v.to(torch.bfloat16).clone().requires_grad_(True) for key, v in p.items() if v is not None}
        res = sonicmoe.moe(ins["x"], ins["router_weight"], ins["w1"], ins["w2"], top_k=k, backend="triton")
        res.out.backward(dout)
        return {key: v.grad for key, v in ins.items()}

    weight_grad_ws._CALLS.clear()
    on = run()
    seen = {(c["I"], c["J"], c["p_gather"]) for c in wgrad_ws_calls()}
    assert (2 * n, d, False) in seen and (d, n, True) in seen
    monkeypatch.setenv("SONICMOE_GLUON_WGRAD", "0")
    off = run()
    for key in on:
        assert torch.equal(on[key], off[key]), key
    monkeypatch.delenv("SONICMOE_GLUON_WGRAD")
    weight_grad_ws._CALLS.clear()
    narrow = random_problem(512, 1024, 64, 8, device="cuda", seed=4)  # below GLUON_WGRAD_MIN_N
    run(narrow, torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16), 2)
    assert wgrad_ws_calls() == []
