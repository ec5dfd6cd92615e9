"""Up-projection: gather-fused varlen-M grouped GEMM with a SwiGLU epilogue (SPEC §3, kernel 1).

For each row r of expert e (rows sorted by expert): H[r] = W1[e] x_{token(r)} (+ b1[e]) and
A[r] = silu(gate(H[r])) * up(H[r]) (``activation="clamped_swiglu"``: gpt-oss's clamped form,
:func:`~sonicmoe.ops.kernel_lib.gated_act`). The rows of X are gathered by index inside the operand load;
no gathered copy of X exists. Each program computes a (BLOCK_M, BLOCK_N) tile of A from the matching gate
and up channels (two accumulators, or one split in two under ``GU_FUSED``), so the SwiGLU runs in registers.

Gate/up layout of W1 (E, 2n, d) and of H (R, 2n), which follows W1's rows:
``"concat"`` gate channel i is row i, up channel i is row n + i; ``"interleaved"`` gate channel i is
row 2i, up channel i is row 2i + 1. A is computed from the rounded (stored) H, so the backward's
recomputation of A from H gives the same values.

Weight operand: with ``W_TMA`` (the GPU default) the gate and up rows of W1[e] are read through TMA tensor
descriptors over the (E, n, d) gate/up views, which zero-fill past n and d; weights whose strides TMA cannot
address (not 16-byte aligned) fall back to pointer loads. With ``GU_FUSED`` (the GPU default; needs ``W_TMA``)
one box of a 4-D view of W1 — (E, 2, n, d) for concat, (E, n, 2, d) for interleaved — brings a tile's gate and
up rows together, so each K-step is one (BLOCK_M, 2·BLOCK_N) dot (one wide tensor-core instruction chain
instead of two) and the accumulator is split into its gate and up halves in registers afterwards. X rows are
gathered by pointer loads either way. Outputs: masked pointer stores in the pinned GPU config; with ``C_TMA``
(in the tuning space, chosen for long reductions such as d = 4096) full tiles of H (concat layout) and A are
written by TMA stores, which the persistent tile loop overlaps with the next tile's main loop, and an expert's
last, partial tile (and the interleaved layout's H) uses masked pointer stores.

Schedule: one program per (M-tile, N-tile), or with ``STEPS`` (pinned where experts have many rows and d is
short, :func:`pinned_gpu_config`) one program per multiprocessor running its tiles as one loop over (tile,
K-block) steps, so the software pipeline crosses tile boundaries: the next tile's X gathers and W1 boxes are
in flight during this tile's epilogue.
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
    check_device,
    config_dict,
    dot_precision,
    few_rows_per_expert,
    launch,
    new_output,
    next_pow2,
    tile_config,
    tma_descriptor,
    varlen_m_grid,
    with_even_flags,
)
from .kernel_lib import (
    column_halves,
    first_step,
    gated_act,
    load_row_block,
    load_weight_block,
    next_step,
    pdl_prologue,
    tile_rows,
    tile_schedule,
)
from .up_proj_ws import gluon_serves_activation, up_proj_ws, up_ws_preferred, up_ws_supported


def layout_rows(gate_up_layout: str, n: int) -> tuple[int, int, int]:
    """(gate offset, up offset, channel stride) in rows of W1 / columns of H for a gate/up layout."""
    return (0, n, 1) if gate_up_layout == "concat" else (0, 1, 2)


@triton.jit
def _up_proj_kernel(
    x_ptr, w1_ptr, wg_desc, wu_desc, wgu_desc, b1_ptr, h_ptr, a_ptr, hg_desc, hu_desc, ao_desc, row_token_ptr,
    offsets_ptr, E, N, D,
    stride_xt, stride_we, stride_wn, stride_hr, stride_ar,
    GATE_OFF: tl.constexpr, UP_OFF: tl.constexpr, CH_STRIDE: tl.constexpr,
    HAS_BIAS: tl.constexpr, STORE_H: tl.constexpr, E_P2: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PROGS_PER_SM: tl.constexpr, FLATTEN: tl.constexpr, W_TMA: tl.constexpr = False, C_TMA: tl.constexpr = False,
    EVEN_K: tl.constexpr = False, GU_FUSED: tl.constexpr = False, STEPS: tl.constexpr = False,
    PDL: tl.constexpr = False, ACT: tl.constexpr = 0,
):
    pdl_prologue(PDL)
    eidx, lo, hi, ntiles, cum, total_m = tile_schedule(offsets_ptr, E, E_P2, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if STEPS:
        _up_proj_steps(x_ptr, w1_ptr, wg_desc, wu_desc, wgu_desc, b1_ptr, h_ptr, a_ptr, hg_desc, hu_desc, ao_desc,
                       row_token_ptr, eidx, lo, hi, ntiles, cum, total_m * num_pid_n, num_pid_n, N, D, stride_xt,
                       stride_we, stride_wn, stride_hr, stride_ar, GATE_OFF, UP_OFF, CH_STRIDE, HAS_BIAS, STORE_H,
                       DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, C_TMA, EVEN_K, GU_FUSED and W_TMA, ACT)
        return
    for tile in tl.range(tl.program_id(0), total_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m = tile // num_pid_n
        pid_n = tile % num_pid_n
        e, row_start, row_end = tile_rows(pid_m, eidx, lo, hi, ntiles, cum, BLOCK_M)
        _up_proj_tile(x_ptr, w1_ptr, wg_desc, wu_desc, wgu_desc, b1_ptr, h_ptr, a_ptr, hg_desc, hu_desc, ao_desc,
                      row_token_ptr, e, row_start, row_end, pid_n, N, D, stride_xt, stride_we, stride_wn,
                      stride_hr, stride_ar, GATE_OFF, UP_OFF, CH_STRIDE, HAS_BIAS, STORE_H, DOT_PREC, BLOCK_M,
                      BLOCK_N, BLOCK_K, W_TMA, C_TMA, EVEN_K, GU_FUSED and W_TMA, ACT)


@triton.jit
def _up_proj_tile(
    x_ptr, w1_ptr, wg_desc, wu_desc, wgu_desc, b1_ptr, h_ptr, a_ptr, hg_desc, hu_desc, ao_desc, row_token_ptr, e,
    row_start, row_end, pid_n, N, D, stride_xt, stride_we, stride_wn, stride_hr, stride_ar,
    GATE_OFF: tl.constexpr, UP_OFF: tl.constexpr, CH_STRIDE: tl.constexpr,
    HAS_BIAS: tl.constexpr, STORE_H: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_TMA: tl.constexpr,
    C_TMA: tl.constexpr, EVEN_K: tl.constexpr, GU_FUSED: tl.constexpr, ACT: tl.constexpr,
):
    rows = row_start + tl.arange(0, BLOCK_M)
    mask_m = rows < row_end
    # rows past the expert's end read token 0's row of X (tok = 0 there): valid memory, never stored
    tok = tl.load(row_token_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]  # loop-carried: pipelines under FLATTEN too
    w_base = w1_ptr + e.to(tl.int64) * stride_we
    # GU_FUSED: one gate/up box and one dot per K-step, the accumulator split in registers afterwards
    # (:func:`_gate_up_dot`); otherwise two weight blocks and two dots (:func:`_gate_up_dots`)
    if GU_FUSED:
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(D, BLOCK_K)):
        xa = load_row_block(x_ptrs, offs_k, k, D, BLOCK_K, EVEN_K)
        x_ptrs += BLOCK_K
        if GU_FUSED:
            acc = _gate_up_dot(xa, wgu_desc, e, k, pid_n, acc, CH_STRIDE, DOT_PREC, BLOCK_N, BLOCK_K)
        else:
            acc_g, acc_u = _gate_up_dots(xa, w_base, wg_desc, wu_desc, e, k, pid_n, N, D, stride_wn, acc_g, acc_u,
                                         GATE_OFF, UP_OFF, CH_STRIDE, DOT_PREC, BLOCK_N, BLOCK_K, W_TMA)
    if GU_FUSED:
        acc_g, acc_u = _gate_up_halves(acc, CH_STRIDE, BLOCK_M, BLOCK_N)
    _up_proj_epilogue(acc_g, acc_u, b1_ptr, h_ptr, a_ptr, hg_desc, hu_desc, ao_desc, e, rows, mask_m, row_start,
                      row_end, pid_n, N, stride_hr, stride_ar, GATE_OFF, UP_OFF, CH_STRIDE, HAS_BIAS, STORE_H,
                      BLOCK_M, BLOCK_N, C_TMA, ACT)


@triton.jit
def _up_proj_steps(
    x_ptr, w1_ptr, wg_desc, wu_desc, wgu_desc, b1_ptr, h_ptr, a_ptr, hg_desc, hu_desc, ao_desc, row_token_ptr,
    eidx, lo, hi, ntiles, cum, num_tiles, num_pid_n, N, D, stride_xt, stride_we, stride_wn, stride_hr, stride_ar,
    GATE_OFF: tl.constexpr, UP_OFF: tl.constexpr, CH_STRIDE: tl.constexpr,
    HAS_BIAS: tl.constexpr, STORE_H: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_TMA: tl.constexpr,
    C_TMA: tl.constexpr, EVEN_K: tl.constexpr, GU_FUSED: tl.constexpr, ACT: tl.constexpr,
):
    """The persistent tile loop as one loop over (tile, K-block) steps (as the varlen-M GEMM's ``STEPS``): the
    software pipeline crosses tile boundaries, so the next tile's first X gathers and W1 boxes load during this
    tile's SwiGLU epilogue, and the epilogue may end in TMA stores. Each tile's gathered token indices are read
    at its first step and carried (one index per row, not a pointer per loaded element: fewer live registers)."""
    steps, k_tiles, ki, tile, e, row_start, row_end, pid_n = first_step(num_tiles, D, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    tok = tl.zeros((BLOCK_M,), dtype=tl.int64)
    if GU_FUSED:
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, steps):
        ki, tile, e, row_start, row_end, pid_n = next_step(ki, tile, e, row_start, row_end, pid_n, k_tiles,
                                                           num_pid_n, eidx, lo, hi, ntiles, cum, BLOCK_M)
        if ki == 0:
            rows0 = row_start + tl.arange(0, BLOCK_M)
            # rows past the expert's end read token 0's row of X (tok = 0 there): valid memory, never stored
            tok = tl.load(row_token_ptr + rows0, mask=rows0 < row_end, other=0).to(tl.int64)
        # the row offsets are multiplied by the stride here, not carried as pointers: the compiler then knows
        # each row start is 16-byte aligned, and the gather becomes pipelined asynchronous copies
        xa = load_row_block(x_ptr + tok[:, None] * stride_xt + (ki * BLOCK_K + offs_k)[None, :], offs_k, ki, D,
                            BLOCK_K, EVEN_K)
        if GU_FUSED:
            acc = _gate_up_dot(xa, wgu_desc, e, ki, pid_n, acc, CH_STRIDE, DOT_PREC, BLOCK_N, BLOCK_K)
        else:
            acc_g, acc_u = _gate_up_dots(xa, w1_ptr + e.to(tl.int64) * stride_we, wg_desc, wu_desc, e, ki, pid_n,
                                         N, D, stride_wn, acc_g, acc_u, GATE_OFF, UP_OFF, CH_STRIDE, DOT_PREC,
                                         BLOCK_N, BLOCK_K, W_TMA)
        if ki == k_tiles - 1:
            rows = row_start + tl.arange(0, BLOCK_M)
            if GU_FUSED:
                out_g, out_u = _gate_up_halves(acc, CH_STRIDE, BLOCK_M, BLOCK_N)
            else:
                out_g, out_u = acc_g, acc_u
            _up_proj_epilogue(out_g, out_u, b1_ptr, h_ptr, a_ptr, hg_desc, hu_desc, ao_desc, e, rows,
                              rows < row_end, row_start, row_end, pid_n, N, stride_hr, stride_ar, GATE_OFF, UP_OFF,
                              CH_STRIDE, HAS_BIAS, STORE_H, BLOCK_M, BLOCK_N, C_TMA, ACT)
            # the next tile's accumulators, zeroed after the epilogue so the two are never live together
            if GU_FUSED:
                acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
            else:
                acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _gate_up_dot(xa, wgu_desc, e, k, pid_n, acc, CH_STRIDE: tl.constexpr, DOT_PREC: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """GU_FUSED K-step: one (BLOCK_K, 2 BLOCK_N) TMA box holding the gate and the up rows of the tile's
    channels and one dot into the (BLOCK_M, 2 BLOCK_N) accumulator. Concat layout: the (E, 2, n, d) view's box
    (1, 2, BLOCK_N, BLOCK_K) = [gate rows; up rows]; interleaved: the (E, n, 2, d) view's box
    (1, BLOCK_N, 2, BLOCK_K) = gate and up rows alternating."""
    if CH_STRIDE == 1:
        wgu = wgu_desc.load([e, 0, pid_n * BLOCK_N, k * BLOCK_K])
    else:
        wgu = wgu_desc.load([e, pid_n * BLOCK_N, 0, k * BLOCK_K])
    return tl.dot(xa, tl.reshape(wgu, (2 * BLOCK_N, BLOCK_K)).T, acc, input_precision=DOT_PREC)


@triton.jit
def _gate_up_dots(xa, w_base, wg_desc, wu_desc, e, k, pid_n, N, D, stride_wn, acc_g, acc_u,
                  GATE_OFF: tl.constexpr, UP_OFF: tl.constexpr, CH_STRIDE: tl.constexpr, DOT_PREC: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_TMA: tl.constexpr):
    """K-step with two (BLOCK_K, BLOCK_N) weight blocks (through TMA, boxes of the (E, n, d) gate/up views,
    zero-filled past n and d; or pointer loads from ``w_base`` = W1[e]) and two dots."""
    wg = load_weight_block(w_base + GATE_OFF * stride_wn, wg_desc, e, k * BLOCK_K, pid_n * BLOCK_N, D, N, 1,
                           CH_STRIDE * stride_wn, True, BLOCK_K, BLOCK_N, W_TMA)
    wu = load_weight_block(w_base + UP_OFF * stride_wn, wu_desc, e, k * BLOCK_K, pid_n * BLOCK_N, D, N, 1,
                           CH_STRIDE * stride_wn, True, BLOCK_K, BLOCK_N, W_TMA)
    return (tl.dot(xa, wg, acc_g, input_precision=DOT_PREC), tl.dot(xa, wu, acc_u, input_precision=DOT_PREC))


@triton.jit
def _gate_up_halves(acc, CH_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The gate and up accumulators of a GU_FUSED (BLOCK_M, 2 BLOCK_N) accumulator (split in registers)."""
    if CH_STRIDE == 1:
        g, u = column_halves(acc)
    else:
        g, u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    return g, u


@triton.jit
def _up_proj_epilogue(acc_g, acc_u, b1_ptr, h_ptr, a_ptr, hg_desc, hu_desc, ao_desc, e, rows, mask_m, row_start,
                      row_end, pid_n, N, stride_hr, stride_ar, GATE_OFF: tl.constexpr, UP_OFF: tl.constexpr,
                      CH_STRIDE: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_H: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, C_TMA: tl.constexpr, ACT: tl.constexpr):
    """Bias, rounding to H's dtype, the activation (:func:`~sonicmoe.ops.kernel_lib.gated_act`, ``ACT``) from the
    rounded H, and the stores of a tile's H and A."""
    ch = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = ch < N
    g_rows = (GATE_OFF + ch * CH_STRIDE).to(tl.int64)
    u_rows = (UP_OFF + ch * CH_STRIDE).to(tl.int64)
    if HAS_BIAS:
        b_base = b1_ptr + e.to(tl.int64) * (2 * N)
        acc_g += tl.load(b_base + g_rows, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_base + u_rows, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    hg = acc_g.to(h_ptr.dtype.element_ty)
    hu = acc_u.to(h_ptr.dtype.element_ty)
    a = gated_act(hg.to(tl.float32), hu.to(tl.float32), ACT).to(a_ptr.dtype.element_ty)
    if C_TMA and row_end - row_start >= BLOCK_M:
        # a full tile: asynchronous TMA stores of the (BLOCK_M, BLOCK_N) blocks of H's gate and up columns
        # (concat layout) and of A; in the persistent loop they drain during the next tile's main loop
        if STORE_H:
            hg_desc.store([row_start, pid_n * BLOCK_N], hg)
            hu_desc.store([row_start, pid_n * BLOCK_N], hu)
        ao_desc.store([row_start, pid_n * BLOCK_N], a)
    else:
        rows64 = rows.to(tl.int64)
        mask = mask_m[:, None] & mask_n[None, :]
        if STORE_H:
            tl.store(h_ptr + rows64[:, None] * stride_hr + g_rows[None, :], hg, mask=mask)
            tl.store(h_ptr + rows64[:, None] * stride_hr + u_rows[None, :], hu, mask=mask)
        tl.store(a_ptr + rows64[:, None] * stride_ar + ch[None, :], a, mask=mask)


_GPU_DEFAULT = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "PROGS_PER_SM": 0, "FLATTEN": False,
                "W_TMA": True, "GU_FUSED": True, "num_warps": 8, "num_stages": 4}
# session 14 (2026-11-24, H100, benchmarks/results/2026-11-24_nvidia-h100_session14/): the same tiles as a
# persistent step loop (STEPS; the X gathers pipelined across tiles, so the next tile's loads overlap this
# tile's epilogue). 7B: faster in 6 of 6 alternating rounds, median 0.609 ms against 0.619 (first sweep 0.566
# against 0.584). Slower where the epilogue is a smaller share of a tile or experts have few rows: (32768, 4096,
# 1024, 128, 8) median 8.02 against 7.59 ms (5 of 6 rounds), (16384, 1536, 256, 512, 8) 0.646 against 0.557.
# Pinned only for d <= STEPS_MAX_D with more than common.FEW_ROWS_PER_EXPERT rows per expert.
_GPU_DEFAULT_STEPS = {**_GPU_DEFAULT, "PROGS_PER_SM": 1, "STEPS": True}
STEPS_MAX_D = 2048
_PINNED_INTERP = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "PROGS_PER_SM": 0, "FLATTEN": False}
# measured on H100 (benchmarks/tune_sweep.py --space focus): 2026-11-23/24, W1 through TMA descriptors,
# 128x128x64, 8 warps, 4 stages, one program per SM looping over the tiles with full tiles stored by TMA
# (C_TMA): 7B 0.648 ms; on (32768, 4096, 1024, 128, 8) the non-persistent pointer-store config led (7.92 ms).
# 2026-11-24 (session 10): the gate and up rows in one TMA box and one (128 x 256) dot (GU_FUSED): 7B
# 0.584 ms (530 TFLOP/s) non-persistent with pointer stores, 0.608 persistent with C_TMA; (32768, 4096, 1024,
# 128, 8) 7.37 ms (597 TFLOP/s) persistent with C_TMA, 7.47 non-persistent (benchmarks/results/
# 2026-11-24_nvidia-h100_gu-fused/)
TUNING_SPACE = [
    tile_config(128, 128, 64, 8, 4, tma=True, GU_FUSED=True),
    tile_config(128, 128, 64, 8, 4, 1, tma=True, C_TMA=True, GU_FUSED=True),
    tile_config(128, 128, 64, 8, 3, 1, tma=True, C_TMA=True, GU_FUSED=True),
    tile_config(128, 128, 64, 8, 4, 1, tma=True, C_TMA=True), tile_config(128, 128, 64, 8, 4, tma=True),
    tile_config(128, 128, 64, 8, 3), tile_config(128, 64, 64, 4, 4),
    tile_config(128, 128, 64, 8, 4, 1, tma=True, GU_FUSED=True, STEPS=True),
]


def pinned_gpu_config(num_rows: int, num_experts: int, d: int) -> dict:
    """The pinned GPU config for R rows over E experts and a reduction over d (host values only): the step
    loop when experts average more than common.FEW_ROWS_PER_EXPERT rows and d <= STEPS_MAX_D (a short main
    loop, so the epilogue the step loop overlaps is a large share of a tile), one program per tile otherwise."""
    if few_rows_per_expert(num_rows, num_experts) or d > STEPS_MAX_D:
        return _GPU_DEFAULT
    return _GPU_DEFAULT_STEPS


def _desc_blocks(meta: dict) -> dict:
    """Block shapes of the descriptors a config reads: the gate/up box of the 4-D view of W1 (GU_FUSED) or
    the gate and up boxes, and the TMA stores' blocks."""
    bm, bn, bk = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
    if meta.get("GU_FUSED"):
        w = {"wgu_desc": (1, 2, bn, bk) if meta["CH_STRIDE"] == 1 else (1, bn, 2, bk)}
    else:
        w = {"wg_desc": (1, bn, bk), "wu_desc": (1, bn, bk)}
    return {**w, "hg_desc": (bm, bn), "hu_desc": (bm, bn), "ao_desc": (bm, bn)}


_FLAG_DESCS = {"W_TMA": ("wg_desc", "wu_desc", "wgu_desc"), "C_TMA": ("hg_desc", "hu_desc", "ao_desc")}


# the "mma" family's configs, the first pinned there (common.tile_family says how they were chosen)
PORTABLE_SPACE = [tile_config(128, 64, 32, 8, 4), tile_config(64, 64, 64, 4, 4), tile_config(128, 64, 32, 4, 4)]
_up_proj_kernel = with_even_flags(_up_proj_kernel, EVEN_K=("D", "BLOCK_K"))
_tuned = autotuners(_up_proj_kernel, TUNING_SPACE,
                    ["N", "D", "E", "GATE_OFF", "CH_STRIDE", "HAS_BIAS", "STORE_H", "ACT"], _desc_blocks,
                    PORTABLE_SPACE, config_dict(PORTABLE_SPACE[0]))


def up_proj(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    routing: Routing,
    gate_up_layout: str = "concat",
    store_h: bool = True,
    config: dict | None = None,
    activation: str = "swiglu",
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Gather + grouped GEMM + SwiGLU. Returns (H (R, 2n) or None when ``store_h`` is False, A (R, n)).

    Args:
        x: (T, d) contiguous tokens. w1: (E, 2n, d) in ``gate_up_layout``. b1: (E, 2n) or None.
        routing: rows sorted by expert. store_h: False for inference (H is not written).
        config: explicit tile configuration (tuning sweeps), else pinned/autotuned.
        activation: ``"swiglu"`` or ``"clamped_swiglu"`` (gpt-oss; :func:`sonicmoe.reference.swiglu_ref`), A's
            formula in the epilogue.

    With T = 0 nothing is launched and H and A are zero (the routing's rows, if any, are padding).

    On sm_90 with the concat layout, where it measured faster (:func:`sonicmoe.ops.up_proj_ws.up_ws_supported` and
    :func:`~sonicmoe.ops.up_proj_ws.up_ws_preferred`;
    ``SONICMOE_GLUON_UP=0`` turns it off), no explicit ``config`` and an activation it takes
    (:func:`~sonicmoe.ops.up_proj_ws.gluon_serves_activation`), the warp-specialised Gluon kernel of
    :mod:`.up_proj_ws` runs instead.

    Raises:
        ValueError: an unknown ``activation``; ``x`` on the CPU outside the interpreter.
    """
    act = act_code(activation)
    for name, t in (("x", x), ("w1", w1)):
        check_device(name, t)
    if x.shape[0] == 0:  # T = 0: no token to gather (the rows, if any, are padding); the kernels' masked-off rows
        # would read the clamped token 0, which does not exist (session 72)
        a = x.new_zeros(routing.num_rows, w1.shape[1] // 2)
        return (x.new_zeros(routing.num_rows, w1.shape[1]) if store_h else None), a
    x, w1 = x.contiguous(), w1.contiguous()
    if (config is None and gluon_serves_activation(activation) and up_ws_preferred(x.shape[1], x.device, routing)
            and up_ws_supported(x, w1, b1, gate_up_layout)):
        return up_proj_ws(x, w1, b1, routing, store_h, activation=activation)
    e, two_n, d = w1.shape
    n = two_n // 2
    r = routing.num_rows
    a = new_output((r, n), device=x.device, dtype=x.dtype)
    h = new_output((r, two_n), device=x.device, dtype=x.dtype) if store_h else a
    gate_off, up_off, ch_stride = layout_rows(gate_up_layout, n)
    # TMA stores (C_TMA) need H's gate and up columns as boxes (the concat layout); without H (inference)
    # A's descriptor stands in for the unused H ones
    ao_desc = tma_descriptor(a)
    if not store_h:
        hg_desc = hu_desc = ao_desc
    elif gate_up_layout == "concat":
        hg_desc, hu_desc = tma_descriptor(h[:, :n]), tma_descriptor(h[:, n:])
    else:
        hg_desc = hu_desc = None
    args = dict(
        x_ptr=x, w1_ptr=w1, wg_desc=tma_descriptor(w1[:, gate_off::ch_stride][:, :n]),
        wu_desc=tma_descriptor(w1[:, up_off::ch_stride][:, :n]),
        wgu_desc=tma_descriptor(w1.view(e, 2, n, d) if ch_stride == 1 else w1.view(e, n, 2, d)),
        b1_ptr=b1.contiguous() if b1 is not None else w1, h_ptr=h, a_ptr=a,
        hg_desc=hg_desc, hu_desc=hu_desc, ao_desc=ao_desc,
        row_token_ptr=routing.row_token, offsets_ptr=routing.expert_offsets,
        E=e, N=n, D=d, stride_xt=x.stride(0), stride_we=w1.stride(0), stride_wn=w1.stride(1),
        stride_hr=h.stride(0), stride_ar=a.stride(0),
        GATE_OFF=gate_off, UP_OFF=up_off, CH_STRIDE=ch_stride, HAS_BIAS=b1 is not None,
        STORE_H=store_h, E_P2=next_pow2(e), DOT_PREC=dot_precision(x.dtype), ACT=act,
    )
    if r > 0:
        launch(_up_proj_kernel, _tuned, varlen_m_grid(r, e, n, x.device), args, _PINNED_INTERP,
               pinned_gpu_config(r, e, d), config, _desc_blocks, _FLAG_DESCS, pdl_device=x.device)
    return (h if store_h else None), a


def up_proj_ref(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    routing: Routing,
    gate_up_layout: str = "concat",
    store_h: bool = True,
    config: dict | None = None,
    activation: str = "swiglu",
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Pure-PyTorch twin of :func:`up_proj` (float32 math, per-expert loop, outputs in x's dtype)."""
    e, two_n, _ = w1.shape
    h = torch.empty(routing.num_rows, two_n, dtype=torch.float32, device=x.device)
    offsets = routing.expert_offsets.tolist()
    for i in range(e):
        lo, hi = offsets[i], offsets[i + 1]
        rows = x[routing.row_token[lo:hi].long()].float()
        h[lo:hi] = rows @ w1[i].float().t() + (b1[i].float() if b1 is not None else 0.0)
    h = h.to(x.dtype)
    a = swiglu_ref(h.float(), gate_up_layout, activation).to(x.dtype)
    return (h if store_h else None), a
