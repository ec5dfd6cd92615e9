"""Varlen-M grouped GEMM on expert-contiguous rows (SPEC §3 kernel 2, §4 kernel 3).

C[r] = A[r] B[e] (+ bias[e]) for the rows r of expert e; A (R, k) rows are already contiguous by
expert, C (R, m) is written contiguously expert by expert (no scatter, no atomics). B[e] is read
through strides, so one kernel serves

* the down-projection  Y = A W2[e]ᵀ + b2[e]   (A (R, n), W2 (E, d, n)  -> Y (R, d)), and
* the dX̃ GEMM          dX̃ = dH W1[e]         (dH (R, 2n), W1 (E, 2n, d) -> dX̃ (R, d)).

Configs with ``W_TMA`` read B[e] through a TMA descriptor over B's (E, ·, ·) shape (zero-filled past
its bounds), and configs with ``A_TMA`` read the rows of A through a descriptor over (R, k) (rows past
an expert's end are the next expert's or zeros, and their results are never stored); configs with
``C_TMA`` (persistent, without FLATTEN) write full tiles of C by TMA stores (in ``C_SPLIT`` column
blocks: less shared memory) and an expert's last tile by masked stores. ``STEPS`` runs a program's tiles as
one loop over (tile, K-block) steps written out in the kernel, so the software pipeline crosses tile
boundaries (as Triton's ``FLATTEN`` does) and TMA stores are allowed (which ``FLATTEN`` cannot compile in
Triton 3.6). The pinned default is that step loop: with pointer stores where experts have many rows and C
is narrow (the 7B shape), with TMA stores in column halves elsewhere (:func:`pinned_gpu_config`); the
autotuner chooses among the configs.

On Hopper (sm_90) the down-projection of shapes with a short reduction (k ≤ 256) and many rows per expert runs
instead the warp-specialised ping-pong kernel of :mod:`sonicmoe.ops.grouped_gemm_ws` (Gluon), which overlaps
each tile's stores with the next tile's MMAs and gives the same bits (:func:`varlen_m_gemm`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..routing import Routing
from . import grouped_gemm_ws, varlen_m_ws
from .common import (
    autotuners,
    check_device,
    config_dict,
    dot_precision,
    few_rows_per_expert,
    launch,
    next_pow2,
    output_or_new,
    per_expert_gemm_ref,
    tile_config,
    tma_descriptor,
    varlen_m_grid,
    with_even_flags,
)
from .kernel_lib import column_halves, first_step, load_weight_block, next_step, pdl_prologue, tile_rows, tile_schedule


@triton.jit
def _varlen_m_kernel(
    a_ptr, a_desc, b_ptr, b_desc, bias_ptr, c_ptr, c_desc, offsets_ptr,
    E, N, K,
    stride_ar, stride_be, stride_bk, stride_bn, stride_cr,
    HAS_BIAS: tl.constexpr, B_TRANS: tl.constexpr, E_P2: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PROGS_PER_SM: tl.constexpr, FLATTEN: tl.constexpr, W_TMA: tl.constexpr = False, A_TMA: tl.constexpr = False,
    C_TMA: tl.constexpr = False, EVEN_K: tl.constexpr = False, STEPS: tl.constexpr = False,
    C_SPLIT: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    eidx, lo, hi, ntiles, cum, total_m = tile_schedule(offsets_ptr, E, E_P2, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if STEPS:
        _varlen_m_steps(a_ptr, a_desc, b_ptr, b_desc, bias_ptr, c_ptr, c_desc, eidx, lo, hi, ntiles, cum,
                        total_m * num_pid_n, num_pid_n, N, K, stride_ar, stride_be, stride_bk, stride_bn, stride_cr,
                        HAS_BIAS, B_TRANS, DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, A_TMA, C_TMA, EVEN_K, C_SPLIT)
        return
    for tile in tl.range(tl.program_id(0), total_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m = tile // num_pid_n
        pid_n = tile % num_pid_n
        e, row_start, row_end = tile_rows(pid_m, eidx, lo, hi, ntiles, cum, BLOCK_M)
        rows = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask_m = rows < row_end
        # rows past the expert's end: masked (pointer loads) or the next expert's rows / zeros past R
        # (TMA); their results are never stored
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None] * stride_ar + offs_k[None, :]
        b_base = b_ptr + e.to(tl.int64) * stride_be
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = _a_block(a_desc, a_ptrs, row_start, k, mask_m, offs_k, K, BLOCK_K, A_TMA, EVEN_K)
            a_ptrs += BLOCK_K
            b = load_weight_block(b_base, b_desc, e, k * BLOCK_K, pid_n * BLOCK_N, K, N, stride_bk, stride_bn, B_TRANS,
                                  BLOCK_K, BLOCK_N, W_TMA)
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        _c_epilogue(acc, bias_ptr, c_ptr, c_desc, e, rows, mask_m, row_start, row_end, pid_n, N, stride_cr, HAS_BIAS,
                    BLOCK_M, BLOCK_N, C_TMA, C_SPLIT)


@triton.jit
def _varlen_m_steps(
    a_ptr, a_desc, b_ptr, b_desc, bias_ptr, c_ptr, c_desc, eidx, lo, hi, ntiles, cum, num_tiles, num_pid_n, N, K,
    stride_ar, stride_be, stride_bk, stride_bn, stride_cr,
    HAS_BIAS: tl.constexpr, B_TRANS: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_TMA: tl.constexpr, A_TMA: tl.constexpr, C_TMA: tl.constexpr, EVEN_K: tl.constexpr, C_SPLIT: tl.constexpr,
):
    """The persistent tile loop written as one loop over (tile, K-block) steps: the software pipeline
    runs across tile boundaries (the next tile's first blocks load during this tile's epilogue), and the
    epilogue may end in a TMA store (which Triton 3.6's own loop flattening, ``FLATTEN``, cannot compile)."""
    steps, k_tiles, ki, tile, e, row_start, row_end, pid_n = first_step(num_tiles, K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, steps):
        ki, tile, e, row_start, row_end, pid_n = next_step(ki, tile, e, row_start, row_end, pid_n, k_tiles,
                                                           num_pid_n, eidx, lo, hi, ntiles, cum, BLOCK_M)
        rows = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask_m = rows < row_end
        a_ptrs = a_ptr + rows[:, None] * stride_ar + (ki * BLOCK_K + offs_k)[None, :]
        a = _a_block(a_desc, a_ptrs, row_start, ki, mask_m, offs_k, K, BLOCK_K, A_TMA, EVEN_K)
        b = load_weight_block(b_ptr + e.to(tl.int64) * stride_be, b_desc, e, ki * BLOCK_K, pid_n * BLOCK_N, K, N,
                              stride_bk, stride_bn, B_TRANS, BLOCK_K, BLOCK_N, W_TMA)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        if ki == k_tiles - 1:
            _c_epilogue(acc, bias_ptr, c_ptr, c_desc, e, rows, mask_m, row_start, row_end, pid_n, N, stride_cr,
                        HAS_BIAS, BLOCK_M, BLOCK_N, C_TMA, C_SPLIT)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _a_block(a_desc, a_ptrs, row_start, k, mask_m, offs_k, K, BLOCK_K: tl.constexpr, A_TMA: tl.constexpr,
             EVEN_K: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) block k of the tile's A rows (rows past the expert's end: masked to 0 by
    pointer loads, the next expert's rows or zeros past R through TMA; never stored)."""
    if A_TMA:
        return a_desc.load([row_start, k * BLOCK_K])
    if EVEN_K:
        return tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
    return tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k < K - k * BLOCK_K)[None, :], other=0.0)


@triton.jit
def _c_epilogue(acc, bias_ptr, c_ptr, c_desc, e, rows, mask_m, row_start, row_end, pid_n, N, stride_cr,
                HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, C_TMA: tl.constexpr,
                C_SPLIT: tl.constexpr):
    """Bias, cast and store of a (BLOCK_M, BLOCK_N) tile of C."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e.to(tl.int64) * N + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c = acc.to(c_ptr.dtype.element_ty)
    if C_TMA and row_end - row_start >= BLOCK_M:
        # a full tile: asynchronous TMA stores, of the whole tile or of its C_SPLIT column halves (the copy
        # engine clips columns past N); inside the persistent loop they drain while the next tile's main loop runs
        if C_SPLIT == 2:
            c0, c1 = column_halves(c)
            c_desc.store([row_start, pid_n * BLOCK_N], c0)
            c_desc.store([row_start, pid_n * BLOCK_N + BLOCK_N // 2], c1)
        else:
            c_desc.store([row_start, pid_n * BLOCK_N], c)
    else:
        tl.store(c_ptr + rows[:, None] * stride_cr + cols[None, :], c, mask=mask_m[:, None] & mask_n[None, :])


# measured on H100 (benchmarks/tune_sweep.py --space focus, 2026-11-24 session 8, results in
# benchmarks/results/2026-11-24_nvidia-h100_steps/): a persistent grid (one program per SM) running its tiles
# as one loop over (tile, K-block) steps (STEPS), both operands through TMA descriptors (A_TMA, W_TMA),
# 4 stages, pointer stores: 7B down-projection 0.349 ms (443 TFLOP/s) against 0.415 for the previous
# default (Triton's own flattening, FLATTEN, 3 stages), dX~ 0.546 against 0.578. On (32768, 4096, 1024,
# 128, 8) the 3-stage step loop with TMA stores in two column halves (C_TMA, C_SPLIT=2) leads: down-projection
# 3.49 ms (629 TFLOP/s; previous default 3.72), dX~ 7.25 ms (7.31).
_GPU_DEFAULT = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "PROGS_PER_SM": 1, "FLATTEN": False,
                "STEPS": True, "W_TMA": True, "A_TMA": True, "num_warps": 8, "num_stages": 4}
# Session 9 (benchmarks/results/2026-11-24_nvidia-h100_varlen-k-steps/tune_vm*): the 4-stage pointer-store default
# above leads only where experts have many rows and C is narrow (the 7B shape: 1536 rows per expert, m = 1536).
# With few rows per expert or a wide C the 3-stage step loop with TMA stores in halves leads or is within 3% of
# the best: (16384, 4096, 512, 512, 8) down-projection 1.54 -> 1.26 ms with token-rounded counts, 1.73 -> 1.41
# top-k; dX~ 2.74 -> 2.30 and 3.32 -> 2.49; (16384, 1536, 256, 512, 8) token rounding: down-projection 0.372 ->
# 0.353, dX~ 0.574 -> 0.476 (top-k: 0.350 -> 0.325 and 0.484 -> 0.519).
_GPU_DEFAULT_TMA_STORES = {**_GPU_DEFAULT, "num_stages": 3, "C_TMA": True, "C_SPLIT": 2}
POINTER_STORES_MAX_WIDTH = 2048


def pinned_gpu_config(num_rows: int, num_experts: int, width: int) -> dict:
    """The pinned GPU config for R rows over E experts writing C (R, m = ``width``): host values only."""
    if not few_rows_per_expert(num_rows, num_experts) and width <= POINTER_STORES_MAX_WIDTH:
        return _GPU_DEFAULT
    return _GPU_DEFAULT_TMA_STORES

_PINNED_INTERP = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "PROGS_PER_SM": 0, "FLATTEN": False}
TUNING_SPACE = [
    tile_config(128, 256, 64, 8, 4, 1, tma=True, A_TMA=True, STEPS=True),
    tile_config(128, 256, 64, 8, 3, 1, tma=True, A_TMA=True, STEPS=True, C_TMA=True, C_SPLIT=2),
    tile_config(128, 256, 64, 8, 3, 1, True, tma=True, A_TMA=True),
    tile_config(128, 128, 64, 4, 2, 2, True, tma=True, A_TMA=True),
    tile_config(128, 256, 64, 8, 3, 1, True), tile_config(128, 128, 64, 4, 2, 2, True),
]


def env_config() -> dict | None:
    """The Triton kernel's config pinned by ``SONICMOE_VARLEN_M_CONFIG`` (read at each call): an index into
    :data:`TUNING_SPACE` pins that config for every launch without an explicit ``config`` (for A/Bs of the configs
    in the layer; the config is used as is, so 2-byte operands); unset or ``auto``: None (autotuned or pinned as
    usual).

    Raises:
        ValueError: a value that is neither ``auto`` nor an index of :data:`TUNING_SPACE`.
    """
    value = os.environ.get("SONICMOE_VARLEN_M_CONFIG", "auto")
    if value == "auto":
        return None
    if not (value.isascii() and value.isdigit()) or int(value) >= len(TUNING_SPACE):  # "²".isdigit(), int fails
        raise ValueError(f"SONICMOE_VARLEN_M_CONFIG: expected 'auto' or an index 0..{len(TUNING_SPACE) - 1} of "
                         f"grouped_gemm.TUNING_SPACE, got {value!r}")
    return config_dict(TUNING_SPACE[int(value)])


def _desc_blocks(meta: dict) -> dict:
    bn, bk = meta["BLOCK_N"], meta["BLOCK_K"]
    return {"a_desc": (meta["BLOCK_M"], bk), "b_desc": (1, bn, bk) if meta.get("B_TRANS", True) else (1, bk, bn),
            "c_desc": (meta["BLOCK_M"], bn // meta.get("C_SPLIT", 1))}


_FLAG_DESCS = {"W_TMA": ("b_desc",), "A_TMA": ("a_desc",), "C_TMA": ("c_desc",)}
_varlen_m_kernel = with_even_flags(_varlen_m_kernel, EVEN_K=("K", "BLOCK_K"))
# the "mma" family's configs, the first pinned there (common.tile_family says how they were chosen)
PORTABLE_SPACE = [tile_config(128, 128, 32, 8, 4), tile_config(128, 128, 64, 8, 3), tile_config(128, 64, 64, 4, 4)]
_tuned = autotuners(_varlen_m_kernel, TUNING_SPACE, ["N", "K", "E", "stride_bk", "HAS_BIAS", "B_TRANS"],
                    _desc_blocks, PORTABLE_SPACE, config_dict(PORTABLE_SPACE[0]))


def varlen_m_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, routing: Routing,
                  *, transpose_b: bool, config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped GEMM over expert-contiguous rows: C[r] = A[r] op(B[e]) (+ bias[e]).

    Args:
        a: (R, k) rows sorted by expert. b: (E, m, k) with ``transpose_b`` (C = A B[e]ᵀ, the
            down-projection with W2) or (E, k, m) without (C = A B[e], the dX̃ GEMM with W1); a view with a unit
            inner stride is read through its strides (a block of B's m columns: the column-chunked GEMM of
            :func:`sonicmoe.ops.library.gemm_then_gather_sum`).
        bias: (E, m) or None. config: explicit tile configuration of the Triton kernel (tuning sweeps), else
            pinned/autotuned.
        out: an (R, m) view of a's dtype and device with a unit inner stride to write C into (a block of columns
            of a wider C), else a new tensor.
    Returns:
        C (R, m) in a's dtype (``out`` when given).

    Raises:
        ValueError: ``out`` of another shape, dtype or device, or with a non-unit inner stride.

    Without ``config``, on sm_90 the down-projection form with k ≤ 256 and the dX̃ form with k ≤ 512, of shapes
    whose experts average at least :data:`grouped_gemm_ws.MIN_ROWS_PER_EXPERT` rows, run the warp-specialised
    ping-pong Gluon kernel (:func:`grouped_gemm_ws.ws_supported`; ``SONICMOE_GLUON=0`` turns it off,
    ``SONICMOE_GLUON_DXT=0`` the dX̃ form alone); it gives the same bits. The down-projection form with a longer
    reduction, of shapes whose experts average many rows, runs the warp-specialised kernel with a streamed B
    (:func:`varlen_m_ws.long_preferred`, :func:`varlen_m_ws.long_supported`; ``SONICMOE_GLUON_LONG=0`` turns it off),
    with the same bits too.
    """
    check_device("a", a)
    a = a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    e = b.shape[0]
    if transpose_b:
        m, k = b.shape[1], b.shape[2]
        stride_bk, stride_bn = b.stride(2), b.stride(1)
    else:
        k, m = b.shape[1], b.shape[2]
        stride_bk, stride_bn = b.stride(1), b.stride(2)
    r = a.shape[0]
    if out is None and config is None and grouped_gemm_ws.ws_supported(a, b, r, transpose_b=transpose_b):
        table = grouped_gemm_ws.routing_tile_table(routing, grouped_gemm_ws.BLOCK_M)  # shared with the routing's
        return grouped_gemm_ws.ws_varlen_m_gemm(a, b, bias, routing.expert_offsets, transpose_b=transpose_b,
                                                table=table)  # other kernels (one launch)
    if (out is None and config is None and varlen_m_ws.long_preferred(transpose_b)
            and varlen_m_ws.long_supported(a, b, bias, r, transpose_b=transpose_b)):
        return varlen_m_ws.long_gemm(a, b, bias, routing, transpose_b=transpose_b)
    c = output_or_new(out, (r, m), a)
    args = dict(
        a_ptr=a, a_desc=tma_descriptor(a), b_ptr=b, b_desc=tma_descriptor(b),
        bias_ptr=bias.contiguous() if bias is not None else b, c_ptr=c, c_desc=tma_descriptor(c),
        offsets_ptr=routing.expert_offsets, E=e, N=m, K=k, stride_ar=a.stride(0), stride_be=b.stride(0),
        stride_bk=stride_bk, stride_bn=stride_bn, stride_cr=c.stride(0), HAS_BIAS=bias is not None,
        B_TRANS=transpose_b, E_P2=next_pow2(e), DOT_PREC=dot_precision(a.dtype),
    )
    if r > 0:
        launch(_varlen_m_kernel, _tuned, varlen_m_grid(r, e, m, a.device), args, _PINNED_INTERP,
               pinned_gpu_config(r, e, m), config if config is not None else env_config(), _desc_blocks,
               _FLAG_DESCS, pdl_device=a.device)
    return c


def varlen_m_gemm_ref(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, routing: Routing,
                      *, transpose_b: bool) -> torch.Tensor:
    """Pure-PyTorch twin of :func:`varlen_m_gemm` (float32 per-expert loop, output in a's dtype)."""
    return per_expert_gemm_ref(a, b, bias, routing.expert_offsets, transpose_b)


def down_proj(a: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor | None, routing: Routing,
              config: dict | None = None) -> torch.Tensor:
    """Down-projection Y (R, d) = A (R, n) W2[e]ᵀ (+ b2[e]); W2 (E, d, n)."""
    return varlen_m_gemm(a, w2, b2, routing, transpose_b=True, config=config)


def down_proj_ref(a: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor | None, routing: Routing,
                  config: dict | None = None) -> torch.Tensor:
    """Pure-PyTorch twin of :func:`down_proj`."""
    return varlen_m_gemm_ref(a, w2, b2, routing, transpose_b=True)
