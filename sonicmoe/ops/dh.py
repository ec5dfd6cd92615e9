"""dH kernel: gather-fused dA′ GEMM with the SwiGLU backward and dS in the epilogue (SPEC §4 kernel 1).

For the rows r of expert e (token t = token(r), score s = S_r):
    dA′[r] = dO_t W2[e]                              (varlen-M grouped GEMM, dO rows gathered in the load)
    A[r]   = silu(gate(H[r])) · up(H[r])           (recomputed from H in registers; or gpt-oss's clamped form)
    dS_r   = ⟨dA′[r], A[r]⟩                         (= ⟨dO_t, Y[r]⟩ without Y; plus ⟨dO_t, b2[e]⟩ outside)
    dA     = s · dA′;  dgate = dA · up · silu′(gate);  dup = dA · silu(gate)
    A′[r]  = s · A[r]                               (the operand of dW2)
Each program owns a (BLOCK_M, BLOCK_N) tile of the n channels, so dS is written as partial sums per
16-channel chunk (cdiv(n, 16), R) and reduced afterwards in a fixed order: no atomics, deterministic,
and the same bits whatever BLOCK_N the tuner picks.
dH follows W1's gate/up layout (see :mod:`sonicmoe.ops.up_proj`). With ``activation="clamped_swiglu"`` (gpt-oss) A and
its derivatives are those of :func:`sonicmoe.ops.kernel_lib.gated_act_bwd`.
Options of the tile config: ``W_TMA`` reads W2 through a TMA descriptor over (E, d, n). The epilogue
always runs on column blocks of EPI_WIDTH = 32 channels in turn (EPI_SPLIT = BLOCK_N / 32 blocks, set
per launch), loading their H columns block by block: full-width 128 x 256 tiles fit in registers without
spills (benchmarks/resource_report.py), and every tile shape runs the same block code, so the dS bits do
not depend on the configuration (a whole-tile epilogue let the compiler fuse the products of the dS sums
into multiply-adds differently per tile shape). ``H_PREFETCH=1`` (the default) has each block load the next
block's H columns before its own arithmetic and stores, so a load is always in flight (the compiler cannot
move a load of H above a store of dH: the two might alias); ``2`` also loads the first block before the
main loop; ``0`` loads each block where it is used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import swiglu_ref
from ..routing import Routing
from .common import (
    act_code,
    autotuners,
    cdiv,
    check_device,
    config_dict,
    dot_precision,
    launch,
    new_output,
    next_pow2,
    tile_config,
    tma_descriptor,
    varlen_m_grid,
    with_even_flags,
)
from .dh_ws import dh_ws, dh_ws_preferred, dh_ws_supported, ds_pairs_in_kernel
from .kernel_lib import (
    column_halves,
    gated_act_bwd,
    load_row_block,
    load_weight_block,
    pdl_prologue,
    tile_rows,
    tile_schedule,
)
from .score_grad import score_grad, score_grad_ref
from .up_proj import layout_rows
from .up_proj_ws import gluon_serves_activation


@triton.jit
def _dh_kernel(
    do_ptr, w2_ptr, w2_desc, h_ptr, score_ptr, pair_ptr, row_token_ptr, offsets_ptr, dh_ptr, ap_ptr, ds_ptr,
    E, N, D, R,
    stride_dot, stride_we, stride_wd, stride_hr, stride_apr,
    GATE_OFF: tl.constexpr, UP_OFF: tl.constexpr, CH_STRIDE: tl.constexpr,
    E_P2: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PROGS_PER_SM: tl.constexpr, FLATTEN: tl.constexpr, W_TMA: tl.constexpr = False,
    H_PREFETCH: tl.constexpr = 1, EPI_SPLIT: tl.constexpr = 1, EVEN_K: tl.constexpr = False,
    PDL: tl.constexpr = False, GATHER_S: tl.constexpr = False, ACT: tl.constexpr = 0,
):
    pdl_prologue(PDL)
    eidx, lo, hi, ntiles, cum, total_m = tile_schedule(offsets_ptr, E, E_P2, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), total_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m = tile // num_pid_n
        pid_n = tile % num_pid_n
        e, row_start, row_end = tile_rows(pid_m, eidx, lo, hi, ntiles, cum, BLOCK_M)
        _dh_tile(do_ptr, w2_ptr, w2_desc, h_ptr, score_ptr, pair_ptr, row_token_ptr, dh_ptr, ap_ptr, ds_ptr, e,
                 row_start, row_end, pid_n, N, D, R, stride_dot, stride_we, stride_wd, stride_hr, stride_apr, GATE_OFF,
                 UP_OFF, CH_STRIDE, DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, H_PREFETCH, EPI_SPLIT, EVEN_K,
                 GATHER_S, ACT)


@triton.jit
def _dh_tile(
    do_ptr, w2_ptr, w2_desc, h_ptr, score_ptr, pair_ptr, row_token_ptr, dh_ptr, ap_ptr, ds_ptr, e, row_start, row_end,
    pid_n, N, D, R, stride_dot, stride_we, stride_wd, stride_hr, stride_apr,
    GATE_OFF: tl.constexpr, UP_OFF: tl.constexpr, CH_STRIDE: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_TMA: tl.constexpr,
    H_PREFETCH: tl.constexpr, EPI_SPLIT: tl.constexpr, EVEN_K: tl.constexpr, GATHER_S: tl.constexpr,
    ACT: tl.constexpr,
):
    rows = row_start + tl.arange(0, BLOCK_M)
    mask_m = rows < row_end
    tok = tl.load(row_token_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    rows64 = rows.to(tl.int64)
    # rows past the expert's end read token 0's dO (tok = 0 there): valid memory, results never stored
    offs_k = tl.arange(0, BLOCK_K)
    do_ptrs = do_ptr + tok[:, None] * stride_dot + offs_k[None, :]  # loop-carried: pipelines under FLATTEN too
    w_base = w2_ptr + e.to(tl.int64) * stride_we
    ch_start = pid_n * BLOCK_N
    ch_end = tl.minimum(N, ch_start + BLOCK_N)  # the tile's channels: [ch_start, ch_end)
    if GATHER_S:  # scores in pair order: each row's through row_pair
        s = tl.load(score_ptr + tl.load(pair_ptr + rows, mask=mask_m, other=0), mask=mask_m, other=0.0)
    else:
        s = tl.load(score_ptr + rows, mask=mask_m, other=0.0)
    s = s.to(tl.float32)[:, None]
    PART: tl.constexpr = BLOCK_N // EPI_SPLIT
    if H_PREFETCH == 2:
        # H of the epilogue's first column block, loaded before the main loop: the GEMM hides its latency
        g0, u0 = _load_gate_up(h_ptr, rows64, mask_m, ch_start + tl.arange(0, PART), ch_end, stride_hr, GATE_OFF,
                               UP_OFF, CH_STRIDE)
    else:
        g0 = tl.zeros((BLOCK_M, PART), dtype=h_ptr.dtype.element_ty)  # unused: each block loads its own
        u0 = g0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(D, BLOCK_K)):
        dob = load_row_block(do_ptrs, offs_k, k, D, BLOCK_K, EVEN_K)
        do_ptrs += BLOCK_K
        wb = load_weight_block(w_base, w2_desc, e, k * BLOCK_K, pid_n * BLOCK_N, D, N, stride_wd, 1, False,
                               BLOCK_K, BLOCK_N, W_TMA)
        acc = tl.dot(dob, wb, acc, input_precision=DOT_PREC)
    if H_PREFETCH == 1:
        g0, u0 = _load_gate_up(h_ptr, rows64, mask_m, ch_start + tl.arange(0, PART), ch_end, stride_hr, GATE_OFF,
                               UP_OFF, CH_STRIDE)
    # the epilogue on EPI_SPLIT column blocks of EPI_WIDTH channels in turn: few (BLOCK_M, ·) tensors live at
    # once, and the same code for every tile shape (the dS bits do not depend on the configuration)
    _dh_epilogue_split(acc, g0, u0, s, rows64, mask_m, ch_start, ch_end, N, R, h_ptr, dh_ptr, ap_ptr, ds_ptr,
                       stride_hr, stride_apr, GATE_OFF, UP_OFF, CH_STRIDE, H_PREFETCH, BLOCK_N, EPI_SPLIT, ACT)


@triton.jit
def _dh_epilogue_split(acc, g, u, s, rows64, mask_m, ch_start, ch_end, N, R, h_ptr, dh_ptr, ap_ptr, ds_ptr, stride_hr,
                       stride_apr, GATE_OFF: tl.constexpr, UP_OFF: tl.constexpr, CH_STRIDE: tl.constexpr,
                       H_PREFETCH: tl.constexpr, WIDTH: tl.constexpr, PARTS: tl.constexpr, ACT: tl.constexpr):
    """The epilogue of channels [ch_start, ch_start + WIDTH) on PARTS (a power of two) column blocks of
    ``acc``, one after the other, halving recursively (each block goes to the store layout on its own).

    ``H_PREFETCH``: ``g``, ``u`` are H's gate and up columns of the first block (loaded earlier), and each
    block loads the next block's columns before its own arithmetic and stores, so one load is in flight
    while a block computes (the compiler keeps loads behind earlier stores: H and dH might alias); the
    columns after the last block (masked past ``ch_end``: no memory traffic) are returned. Otherwise each
    block loads its own columns and ``g``, ``u`` pass through unused.
    """
    if PARTS == 1:
        ch = ch_start + tl.arange(0, WIDTH)
        if H_PREFETCH:
            g_next, u_next = _load_gate_up(h_ptr, rows64, mask_m, ch + WIDTH, ch_end, stride_hr, GATE_OFF, UP_OFF,
                                           CH_STRIDE)
            _dh_epilogue(acc, g, u, s, rows64, mask_m, ch, ch_start, N, R, dh_ptr, ap_ptr, ds_ptr, stride_hr,
                         stride_apr, GATE_OFF, UP_OFF, CH_STRIDE, WIDTH, ACT)
        else:
            g_cur, u_cur = _load_gate_up(h_ptr, rows64, mask_m, ch, ch_end, stride_hr, GATE_OFF, UP_OFF, CH_STRIDE)
            _dh_epilogue(acc, g_cur, u_cur, s, rows64, mask_m, ch, ch_start, N, R, dh_ptr, ap_ptr, ds_ptr, stride_hr,
                         stride_apr, GATE_OFF, UP_OFF, CH_STRIDE, WIDTH, ACT)
            g_next, u_next = g, u
    else:
        HALF: tl.constexpr = WIDTH // 2
        lo, hi = column_halves(acc)
        g_mid, u_mid = _dh_epilogue_split(lo, g, u, s, rows64, mask_m, ch_start, ch_end, N, R, h_ptr, dh_ptr, ap_ptr,
                                          ds_ptr, stride_hr, stride_apr, GATE_OFF, UP_OFF, CH_STRIDE, H_PREFETCH,
                                          HALF, PARTS // 2, ACT)
        g_next, u_next = _dh_epilogue_split(hi, g_mid, u_mid, s, rows64, mask_m, ch_start + HALF, ch_end, N, R, h_ptr,
                                            dh_ptr, ap_ptr, ds_ptr, stride_hr, stride_apr, GATE_OFF, UP_OFF,
                                            CH_STRIDE, H_PREFETCH, HALF, PARTS // 2, ACT)
    return g_next, u_next


@triton.jit
def _load_gate_up(h_ptr, rows64, mask_m, ch, ch_end, stride_hr,
                  GATE_OFF: tl.constexpr, UP_OFF: tl.constexpr, CH_STRIDE: tl.constexpr):
    """The gate and up columns of H for channels ``ch`` (those < ``ch_end``) of the given rows (H's dtype, 0
    when masked)."""
    mask = mask_m[:, None] & (ch < ch_end)[None, :]
    base = h_ptr + rows64[:, None] * stride_hr
    g = tl.load(base + (GATE_OFF + ch * CH_STRIDE).to(tl.int64)[None, :], mask=mask, other=0.0)
    u = tl.load(base + (UP_OFF + ch * CH_STRIDE).to(tl.int64)[None, :], mask=mask, other=0.0)
    return g, u


@triton.jit
def _sum16(x):
    """(M, C, 16) -> (M, C): each row of 16 summed in one fixed pairwise order, ((x0 + x1) + (x2 + x3)) + ...,
    whatever the register layout (tl.sum's order follows the layout, which changes with the tile shape:
    the dS bits would then depend on the tile configuration)."""
    M: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    lo, hi = tl.split(tl.reshape(x, (M, C, 8, 2)))
    lo, hi = tl.split(tl.reshape(lo + hi, (M, C, 4, 2)))
    lo, hi = tl.split(tl.reshape(lo + hi, (M, C, 2, 2)))
    lo, hi = tl.split(lo + hi)
    return lo + hi


@triton.jit
def _dh_epilogue(acc, g_raw, u_raw, s, rows64, mask_m, ch, ch_start, N, R, dh_ptr, ap_ptr, ds_ptr, stride_hr,
                 stride_apr, GATE_OFF: tl.constexpr, UP_OFF: tl.constexpr, CH_STRIDE: tl.constexpr,
                 WIDTH: tl.constexpr, ACT: tl.constexpr):
    """The activation's backward (:func:`~sonicmoe.ops.kernel_lib.gated_act_bwd`, ``ACT``), A′ and the dS partials of a
    block of dA′ = ``acc``: the given rows and the WIDTH
    channels ``ch`` = ch_start + [0, WIDTH) (ch_start a multiple of 16)."""
    mask = mask_m[:, None] & (ch < N)[None, :]
    a, d_gate, d_up = gated_act_bwd(g_raw.to(tl.float32), u_raw.to(tl.float32), acc * s, ACT)
    # in float16, A as the forward stored it and Y = A W2ᵀ read it (rounded): dS and A′ are then the gradient of the
    # forward that ran, and an A that overflowed there gives a non-finite dS here too. Not in bf16, whose range is
    # float32's: there it would change only the last bits, and it cost the sm_80/86 configs spilled registers
    if ap_ptr.dtype.element_ty == tl.float16:
        a = a.to(tl.float16).to(tl.float32)
    # dS partial sums per 16-channel chunk: row c of the (cdiv(n, 16), R) buffer holds channels
    # [16c, 16c + 16). Every config writes every row (no leftovers from autotuning runs), and the
    # fixed-order sum over chunks afterwards does not depend on BLOCK_N.
    CHUNKS: tl.constexpr = WIDTH // 16
    part = _sum16(tl.reshape(acc * a, (acc.shape[0], CHUNKS, 16)))
    chunk = ch_start // 16 + tl.arange(0, CHUNKS)
    tl.store(ds_ptr + chunk[None, :].to(tl.int64) * R + rows64[:, None], part,
             mask=mask_m[:, None] & (chunk[None, :] < tl.cdiv(N, 16)))
    tl.store(ap_ptr + rows64[:, None] * stride_apr + ch[None, :], (a * s).to(ap_ptr.dtype.element_ty), mask=mask)
    dh_ty = dh_ptr.dtype.element_ty
    g_cols = (GATE_OFF + ch * CH_STRIDE).to(tl.int64)
    u_cols = (UP_OFF + ch * CH_STRIDE).to(tl.int64)
    tl.store(dh_ptr + rows64[:, None] * stride_hr + u_cols[None, :], d_up.to(dh_ty), mask=mask)
    tl.store(dh_ptr + rows64[:, None] * stride_hr + g_cols[None, :], d_gate.to(dh_ty), mask=mask)


# measured on H100 (benchmarks/tune_sweep.py --space focus): full-width tiles (128 x 256, the gathered dO rows
# read once per n = 256) with the epilogue in 8 column blocks of 32: 7B 0.635 ms against 0.77-0.81 for 64 x 64
# tiles (2026-11-23); 16 warps (more threads for the latency-bound epilogue): 0.606 ms. 2026-11-24 (later): each
# block loading the next block's H before its own arithmetic and stores (H_PREFETCH=1) brings 8 warps to
# 0.536 ms against 0.586 ms for the 16-warp config without it (16 warps with it: 0.554; the first block also
# loaded before the main loop, H_PREFETCH=2: 0.555). Two programs per SM (64 x 256, 4 warps) and persistent
# tiles were slower.
_GPU_DEFAULT = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "PROGS_PER_SM": 0, "FLATTEN": False,
                "W_TMA": True, "H_PREFETCH": 1, "num_warps": 8, "num_stages": 4}
_PINNED_INTERP = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "PROGS_PER_SM": 0, "FLATTEN": False}
TUNING_SPACE = [
    tile_config(128, 256, 64, 8, 4, tma=True, H_PREFETCH=1), tile_config(128, 256, 64, 16, 4, tma=True, H_PREFETCH=1),
    tile_config(128, 256, 64, 16, 4, tma=True, H_PREFETCH=0), tile_config(128, 256, 64, 8, 4, tma=True, H_PREFETCH=2),
    tile_config(128, 256, 64, 8, 3, tma=True, H_PREFETCH=1), tile_config(128, 128, 64, 8, 4, tma=True, H_PREFETCH=1),
]
EPI_WIDTH = 32  # channels per epilogue block (a multiple of 16; the GPU configs' BLOCK_N are multiples of it)


def _epi_split(args: dict) -> int:
    """EPI_SPLIT = BLOCK_N / EPI_WIDTH column blocks (1 for narrower tiles, as the interpreter's)."""
    return max(1, args["BLOCK_N"] // EPI_WIDTH)


def _desc_blocks(meta: dict) -> dict:
    return {"w2_desc": (1, meta["BLOCK_K"], meta["BLOCK_N"])}


_dh_kernel = triton.heuristics({"EPI_SPLIT": _epi_split})(with_even_flags(_dh_kernel, EVEN_K=("D", "BLOCK_K")))
# the "mma" family's configs, the first pinned there (common.tile_family says how they were chosen)
PORTABLE_SPACE = [tile_config(128, 128, 32, 8, 4), tile_config(128, 128, 32, 8, 3), tile_config(64, 128, 32, 4, 4),
                  tile_config(64, 64, 64, 4, 4)]
_tuned = autotuners(_dh_kernel, TUNING_SPACE, ["N", "D", "E", "GATE_OFF", "CH_STRIDE", "ACT"], _desc_blocks,
                    PORTABLE_SPACE, config_dict(PORTABLE_SPACE[0]))


def dh(
    dout: torch.Tensor,
    w2: torch.Tensor,
    h: torch.Tensor,
    row_scores: torch.Tensor,
    routing: Routing,
    gate_up_layout: str = "concat",
    config: dict | None = None,
    reduce_ds: bool = True,
    pair_order: bool = False,
    ds_pairs: torch.dtype | None = None,
    activation: str = "swiglu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dH, A′ and dS from dO, W2, H and the scores (SPEC §4 kernel 1).

    Args:
        dout: (T, d) gradient of O. w2: (E, d, n). h: (R, 2n) saved up-projection output (layout of W1).
        row_scores: (R,) scores S in row order, float32; or, with ``pair_order``, in pair order (any float dtype,
            read as float32), each row's gathered through ``routing.row_pair`` inside the kernel.
        routing: the expert-sorted rows.
        config: explicit tile configuration of the Triton kernel (tuning sweeps), else pinned/autotuned; without
            one, shapes that :func:`sonicmoe.ops.dh_ws.dh_ws_preferred` and ``dh_ws_supported`` accept run the Gluon
            kernel.
        reduce_ds: False returns dS as float32 partial sums (P, R) with dS = partials.sum(0) (the fixed-order
            reduction left to the caller: the backward runs it on a side stream).
        pair_order: see ``row_scores`` (the layer's backward: no gathered copy of S is made or kept).
        ds_pairs: None, or a dtype: dS comes back in pair order in that dtype (needs ``pair_order``; 0 for padding
            pairs), the partials summed in a fixed order in float32 (:func:`sonicmoe.ops.score_grad.score_grad`'s
            bits) — by the dH kernel itself where :func:`ds_pairs_in_dh_kernel` holds, else by ``score_grad`` after
            it. ``reduce_ds`` is then ignored.
        activation: ``"swiglu"`` or ``"clamped_swiglu"`` (gpt-oss; :func:`sonicmoe.reference.swiglu_ref`): the
            activation whose A is recomputed from H and whose backward gives dH (the clamped one in the Gluon kernel
            too where :func:`sonicmoe.ops.up_proj_ws.gluon_serves_activation` says so: ``SONICMOE_GLUON_CLAMPED``).
    Returns:
        dH (R, 2n) in h's layout and dtype, A′ = S·A (R, n) in h's dtype, dS (R,) float32 in row order (without
        the bias term ⟨dO_t, b2[e]⟩), or as ``reduce_ds`` and ``ds_pairs`` say. With T = 0 (``dout`` of no rows)
        all are zero and no gathering kernel is launched (with ``ds_pairs``, score_grad still orders the zeros).
    Raises:
        ValueError: ``pair_order`` with a routing whose ``row_pair`` is None, or ``ds_pairs`` without
        ``pair_order``; ``dout`` on the CPU outside the interpreter; an unknown ``activation``.
    """
    check_device("dout", dout)
    act = act_code(activation)
    if pair_order and routing.row_pair is None:
        raise ValueError("routing.row_pair: pair_order=True reads each row's score through it; got None")
    if ds_pairs is not None and not pair_order:
        raise ValueError(f"ds_pairs={ds_pairs}: dS in pair order needs pair_order=True")
    dout, w2, h = dout.contiguous(), w2.contiguous(), h.contiguous()
    e, d, n = w2.shape
    r = routing.num_rows
    if dout.shape[0] == 0:  # T = 0: no token's dO to gather (the rows, if any, are padding): zeros, no gathering launch
        ds_part = torch.zeros(cdiv(n, 16), r, device=h.device, dtype=torch.float32)
        return torch.zeros_like(h), h.new_zeros(r, n), _reduced_ds(ds_part, routing, reduce_ds, ds_pairs)
    if config is None and _gluon_serves(dout, w2, h, routing, gate_up_layout, activation):
        # the warp-specialised Gluon kernel (sm_90, concat layout): its dS partials are per N-tile (128 or 256), or,
        # where a tile spans all n channels, dS itself in pair order
        fused = ds_pairs is not None and ds_pairs_in_kernel(n)
        dh_, a_prime, ds_part = dh_ws(dout, w2, h, row_scores, routing, pair_order=pair_order,
                                      ds_pairs=ds_pairs if fused else None, activation=activation)
        return dh_, a_prime, ds_part if fused else _reduced_ds(ds_part, routing, reduce_ds, ds_pairs)
    dh_ = new_output(h.shape, device=h.device, dtype=h.dtype)
    a_prime = new_output((r, n), device=h.device, dtype=h.dtype)
    ds_part = new_output((cdiv(n, 16), r), device=h.device, dtype=torch.float32)  # 16-channel chunks
    gate_off, up_off, ch_stride = layout_rows(gate_up_layout, n)
    args = dict(
        do_ptr=dout, w2_ptr=w2, w2_desc=tma_descriptor(w2), h_ptr=h,
        score_ptr=row_scores.contiguous() if pair_order else row_scores.float().contiguous(),
        pair_ptr=routing.row_pair if pair_order else routing.row_token, GATHER_S=pair_order,
        row_token_ptr=routing.row_token,
        offsets_ptr=routing.expert_offsets, dh_ptr=dh_, ap_ptr=a_prime,
        ds_ptr=ds_part, E=e, N=n, D=d, R=r, stride_dot=dout.stride(0), stride_we=w2.stride(0),
        stride_wd=w2.stride(1), stride_hr=h.stride(0), stride_apr=a_prime.stride(0),
        GATE_OFF=gate_off, UP_OFF=up_off, CH_STRIDE=ch_stride, E_P2=next_pow2(e),
        DOT_PREC=dot_precision(h.dtype), ACT=act,
    )
    if r > 0:
        launch(_dh_kernel, _tuned, varlen_m_grid(r, e, n, h.device), args, _PINNED_INTERP, _GPU_DEFAULT, config,
               _desc_blocks, {"W_TMA": ("w2_desc",)}, pdl_device=h.device)
    return dh_, a_prime, _reduced_ds(ds_part, routing, reduce_ds, ds_pairs)


def _gluon_serves(dout: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, routing: Routing,
                  gate_up_layout: str, activation: str = "swiglu") -> bool:
    """Whether :func:`dh` without a ``config`` runs the Gluon kernel (host checks only; the activations of
    :func:`sonicmoe.ops.up_proj_ws.gluon_serves_activation`)."""
    return (gluon_serves_activation(activation) and routing.num_rows > 0 and dh_ws_preferred(w2.shape[-1])
            and dh_ws_supported(dout, w2, h, gate_up_layout))


def _reduced_ds(ds_part: torch.Tensor, routing: Routing, reduce_ds: bool,
                ds_pairs: torch.dtype | None) -> torch.Tensor:
    """dS from the kernels' float32 partials (P, R), as :func:`dh`'s ``reduce_ds`` and ``ds_pairs`` ask."""
    if ds_pairs is not None:
        return score_grad(ds_part, routing.row_pair, routing.expert_offsets, None, ds_pairs)
    return ds_part.sum(0) if reduce_ds else ds_part


def ds_pairs_in_dh_kernel(dout: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, routing: Routing,
                          gate_up_layout: str = "concat", activation: str = "swiglu") -> bool:
    """Whether :func:`dh` with ``ds_pairs`` (and no ``config``) writes dS from inside the dH kernel: the Gluon kernel
    serves the shape (:func:`~sonicmoe.ops.dh_ws.dh_ws_preferred`, :func:`~sonicmoe.ops.dh_ws.dh_ws_supported`)
    and its tiles span all n channels (:func:`~sonicmoe.ops.dh_ws.ds_pairs_in_kernel`; n = 256 at the 7B shape).
    Host checks only, no sync; operands that are not contiguous answer False (:func:`dh` runs on contiguous
    copies of them, so the answer then errs towards the partials)."""
    return ds_pairs_in_kernel(w2.shape[-1]) and _gluon_serves(dout, w2, h, routing, gate_up_layout, activation)


def dh_ref(
    dout: torch.Tensor,
    w2: torch.Tensor,
    h: torch.Tensor,
    row_scores: torch.Tensor,
    routing: Routing,
    gate_up_layout: str = "concat",
    config: dict | None = None,
    reduce_ds: bool = True,
    pair_order: bool = False,
    ds_pairs: torch.dtype | None = None,
    activation: str = "swiglu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-PyTorch twin of :func:`dh` (float32 math, per-expert loop; without ``reduce_ds`` dS is returned
    as one row of partials, (1, R); with ``ds_pairs``, in pair order in that dtype, 0 for padding pairs)."""
    if ds_pairs is not None and not pair_order:
        raise ValueError(f"ds_pairs={ds_pairs}: dS in pair order needs pair_order=True")
    if pair_order:
        row_scores = routing.row_scores(row_scores)
    e = w2.shape[0]
    offsets = routing.expert_offsets.tolist()
    dap = torch.empty(routing.num_rows, w2.shape[2], dtype=torch.float32, device=h.device)
    for i in range(e):
        lo, hi = offsets[i], offsets[i + 1]
        dap[lo:hi] = dout[routing.row_token[lo:hi].long()].float() @ w2[i].float()
    hf = h.float().detach().requires_grad_(True)
    a = swiglu_ref(hf, gate_up_layout, activation)
    s = row_scores.float()[:, None]
    (dhf,) = torch.autograd.grad(a, hf, grad_outputs=dap * s)
    a = a.detach()
    if h.dtype == torch.float16:  # as the forward stored it (the kernel's rounding, float16 only)
        a = a.half().float()
    ds = (dap * a).sum(1)
    if ds_pairs is not None:
        ds = score_grad_ref(ds[None], routing.row_pair, routing.expert_offsets, None, ds_pairs)
        return dhf.to(h.dtype), (a * s).to(h.dtype), ds
    return dhf.to(h.dtype), (a * s).to(h.dtype), ds if reduce_ds else ds[None]
