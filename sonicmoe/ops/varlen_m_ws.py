"""Warp-specialised varlen-M grouped GEMM with a streamed B, for Hopper, in Gluon: the backward's dX̃ = dH W1[e]
(SPEC §4 kernel 3) and the down-projection Y = A W2[e]ᵀ (SPEC §3 kernel 2) where their reductions are too long for
the ping-pong kernel of :mod:`.grouped_gemm_ws` (which keeps B[e]'s whole k × BLOCK_N block resident: k = 2n ≤ 512,
n ≤ 256).

The same product as :func:`sonicmoe.ops.grouped_gemm.varlen_m_gemm`: C[r] = A[r] op(B[e]) over expert-contiguous
rows, written into columns [col0, col0 + w) of C (the column blocks of
:func:`sonicmoe.ops.library.gemm_then_gather_sum`) or all of them.

Why a third kernel: at (32768, 4096, 1024, 128, 8) on an H100 under the power cap (session 51, settled 1.5 s windows,
scripts/dxt_layout_probe.py, benchmarks/results/2026-11-27_nvidia-h100_session51/) the Triton kernel ran dX̃ at 530
TFLOP/s (8.29 ms) with the config its autotuner chose and 566-569 with the best of its space, while cuBLAS ran the
same FLOPs as a balanced batched GEMM at 653. This kernel ran it at 588 (7.48 ms) and the down-projection at 589
against 576. Each persistent program splits its warps by role:

* a **loader** (one warp) walks the program's tiles and, per K-block, asks TMA for A's (BLOCK_M × BLOCK_K) block of
  the tile's rows (rows past the expert's end are the next expert's or, past R, zeros: their products are never
  stored; zeroing them would not save energy: a dense GEMM with 1/32 of each 128-row block zero took the same
  joules per call as with none, session 64, scripts/zero_rows_energy_probe.py) and B[e]'s box, into a ring of
  ``STAGES`` slots (a ``ready`` mbarrier with the bytes, an ``empty`` one the MMAs arrive on once they have read
  the slot);
* the **MMA warps** (two warpgroups, BLOCK_M = 128) run the tile's asynchronous wgmma chain over the ring (one
  K-block in flight), round to C's dtype and stage the tile in shared memory (in ``C_SPLIT`` column parts through
  one buffer), from where a full tile leaves by TMA stores, which drain while the next tile's MMAs run, and an
  expert's last, partial tile by masked 16-byte stores.

Tiles are (M-tile, N-tile) pairs, N fastest, M-tiles numbered expert after expert from the table of
:func:`sonicmoe.ops.grouped_gemm_ws.tile_table` (no host sync); program p takes tiles p, p + P, .... K-blocks are
added in order with BLOCK_K = 64, as in the Triton kernel. No atomics: the same bits on every run.

Served shapes (:func:`long_supported`): sm_90, bf16/fp16, no bias, k a multiple of BLOCK_K (at least MIN_K in the
layer), the written width a multiple of BLOCK_N, contiguous 16-byte aligned operands, experts averaging many rows.
The layer runs it for the down-projection (:func:`long_preferred`) and, since session 53, for the backward's
dX̃ column blocks with multiprocessors left to the dX aggregation beside them (``num_programs``;
:func:`sonicmoe.ops.common.agg_reserve`, :func:`sonicmoe.ops.library.gemm_then_gather_sum`).
Gluon kernels do not run under Triton's interpreter: the kernel is tested on the GPU against the Triton kernel
and the float32 reference (tests/test_varlen_m_ws.py).
"""

from __future__ import annotations

import torch

from ..routing import Routing
from .common import few_rows_per_expert, output_or_new, per_expert_gemm_ref, sm_count
from .fast_launch import launch_kernel
from .grouped_gemm_ws import _GL_DTYPES, HAVE_GLUON, _descriptor, gluon_kernel_switch, routing_tile_table, ws_enabled

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .grouped_gemm_ws import _masked_store, column_halves
    from .up_proj_ws import _tile_of

BLOCK_M = 128  # two warpgroups of 64 rows
BLOCK_N = 256
BLOCK_K = 64
MMA_WARPS = 8
LOADER_REGS = 40
MAXNREG = 168  # the accumulator (128 x 256 float32) takes 128 registers of each MMA thread
MAX_STAGES = 6
C_SPLIT = 2  # the tile is staged and stored in this many column parts through one buffer (1 or 2)
MIN_K = 576  # the layer runs this kernel for reductions longer than the ping-pong kernel's (k > 512)
SMEM_BUDGET = 227 * 1024 - 1024  # dynamic shared memory of one program on sm_90, less the barriers
# Tried and dropped (sessions 58-59): an expert's last tile of at most 64 rows as a 64-row product (HGMMA 64x128),
# left by masked stores. The same bits, but the 120B-n1024 layer was slower (35.97 against 35.72 ms).


def long_smem_bytes(stages: int, c_split: int = C_SPLIT, elem: int = 2) -> int:
    """Shared memory of one program: the ring (an A block and a B box per slot) and the staging buffer (one column
    part of the tile)."""
    return elem * (stages * BLOCK_K * (BLOCK_M + BLOCK_N) + BLOCK_M * BLOCK_N // c_split)


def long_config(c_split: int = C_SPLIT, stages: int | None = None) -> dict:
    """{"C_SPLIT", "STAGES": the deepest ring that fits beside the staging buffer, at most MAX_STAGES, unless
    given}."""
    fit = (SMEM_BUDGET - long_smem_bytes(0, c_split)) // (long_smem_bytes(1, c_split) - long_smem_bytes(0, c_split))
    return {"C_SPLIT": c_split, "STAGES": min(MAX_STAGES, fit) if stages is None else stages}


def long_enabled() -> bool:
    """:func:`sonicmoe.ops.grouped_gemm_ws.ws_enabled` (``SONICMOE_GLUON=0`` turns every Gluon kernel off) and
    ``SONICMOE_GLUON_LONG`` (default 1) this one alone. Read at each call; a value other than ``0``, ``1`` or ``all``
    raises ValueError (:func:`sonicmoe.ops.grouped_gemm_ws.gluon_kernel_switch`)."""
    return gluon_kernel_switch("SONICMOE_GLUON_LONG") != "0" and ws_enabled()


def long_preferred(transpose_b: bool) -> bool:
    """Whether the layer runs this kernel where :func:`long_supported` holds: for the down-projection form
    (``transpose_b``), or for both forms under ``SONICMOE_GLUON_LONG=all`` (for layer A/Bs; read at each call).

    Measured on H100s at (32768, 4096, 1024, 128, 8) (session 51, benchmarks/results/2026-11-27_nvidia-h100_session51/):
    alone, in settled 1.5 s windows, the down-projection 3.733 ms against 3.821 for the Triton kernel as autotuned,
    dX̃ 7.48 against 7.85-7.86 for the Triton kernel's best configs and 8.29 for the one its autotuner chose. In the
    layer (fresh-process A/B of whole trees, 1000 ms windows, 6 rounds) the forward ran 11.83 against 11.96 ms (6 of
    6 rounds), but forward+backward with dX̃ on this kernel too 35.38 against 35.19 (slower in 4 of 6): the backward
    runs dX̃ in 2048-column blocks with each block's dX aggregation beside the next block's GEMM, and that form was
    no faster on this kernel (8.22 against 8.23 ms with the aggregation, alone). So this rule keeps the Triton
    kernel for dX̃; the column-block form takes this kernel anyway where it leaves multiprocessors to the
    aggregation (:func:`sonicmoe.ops.common.agg_reserve`, session 53: 7.67 against 8.05 ms)."""
    return gluon_kernel_switch("SONICMOE_GLUON_LONG") == "all" or transpose_b


def long_supported(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, num_rows: int, *,
                   transpose_b: bool, width: int | None = None) -> bool:
    """Whether :func:`long_gemm` serves C = A op(B[e]) in the layer (host checks only, no sync): an sm_90 GPU with
    Gluon (:func:`long_enabled`), a (R, k) and b (E, m, k) with ``transpose_b`` or (E, k, m) without, bf16/fp16 of
    one dtype, contiguous and 16-byte aligned, no bias, k a multiple of BLOCK_K and at least MIN_K, the written
    width (``width``, default m) a multiple of BLOCK_N, and experts averaging more than
    :data:`~sonicmoe.ops.common.FEW_ROWS_PER_EXPERT` rows (R = ``num_rows`` over E; where it was measured)."""
    if bias is not None or not long_enabled() or not a.is_cuda or _operand_error(a, b, transpose_b, 0, width):
        return False
    if few_rows_per_expert(num_rows, b.shape[0]) or a.shape[1] < MIN_K:
        return False
    if torch.cuda.get_device_capability(a.device) != (9, 0):
        return False
    return a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0


def _operand_error(a: torch.Tensor, b: torch.Tensor, transpose_b: bool, col0: int, width: int | None) -> str | None:
    """What :func:`long_gemm` cannot take in these operands and column block (the message of its ValueError), or
    None: ranks, dtypes (bf16/fp16, one dtype), a's columns against B's reduction k (a multiple of BLOCK_K),
    contiguity, and the block [col0, col0 + width) of B's m columns (width default m - col0, a multiple of
    BLOCK_N)."""
    if a.dim() != 2 or b.dim() != 3 or a.dtype not in _GL_DTYPES or b.dtype != a.dtype:
        return (f"a, b: expected a (R, k) and b (E, m, k) / (E, k, m) of one dtype, bf16 or fp16, got "
                f"{tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}")
    k, m = (b.shape[2], b.shape[1]) if transpose_b else (b.shape[1], b.shape[2])
    if a.shape[1] != k or k % BLOCK_K or not (a.is_contiguous() and b.is_contiguous()):
        return (f"a, b: expected contiguous operands with a's {a.shape[1]} columns = B's reduction k = {k}, a multiple "
                f"of {BLOCK_K}")
    w = m - col0 if width is None else width
    if w <= 0 or w % BLOCK_N or col0 < 0 or col0 + w > m:
        return (f"col0, width: expected a block of B's {m} columns of a positive width that is a multiple of "
                f"{BLOCK_N}, got col0={col0}, width={w}")
    return None


if HAVE_GLUON:

    @gluon.jit
    def _long_loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, table_ptr, num_pid_n, K, M_B, col0,
                     B_TRANS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
        """Loader partition: per K-block of every tile of this program, A's block of the tile's rows and B[e]'s
        box (columns col0 + pid_n·BLOCK_N + [0, BLOCK_N) of B[e]: from the (E·m, k) view, M_B = m, with
        ``B_TRANS``; from the (E·k, m) view otherwise) by TMA into the next ring slot, once the MMAs that read its
        previous content are done."""
        total = gl.load(table_ptr) * num_pid_n
        k_tiles = K // BLOCK_K
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        step = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            e, row_start, row_end, pid_n = _tile_of(tile, table_ptr, num_pid_n)
            col = col0 + pid_n * BLOCK_N
            for ki in range(k_tiles):
                s = step % STAGES
                mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                tma.async_copy_global_to_shared(a_desc, [row_start, ki * BLOCK_K], ready.index(s), a_bufs.index(s))
                if B_TRANS:
                    tma.async_copy_global_to_shared(b_desc, [e * M_B + col, ki * BLOCK_K], ready.index(s),
                                                    b_bufs.index(s))
                else:
                    tma.async_copy_global_to_shared(b_desc, [e * K + ki * BLOCK_K, col], ready.index(s),
                                                    b_bufs.index(s))
                step += 1

    @gluon.jit
    def _long_store(part, c_smem, c_desc, c_ptr, row_start, row_end, col, stride_cr, WARPS: gl.constexpr):
        """Stage one column part (BLOCK_M, W) of the rounded tile in ``c_smem`` once the previous TMA store has
        read it, then store it at C's rows [row_start, row_end) and columns col + [0, W): by TMA for a full tile
        (left to drain), by masked 16-byte stores otherwise."""
        tma.store_wait(pendings=0)
        gl.thread_barrier()  # no thread writes the buffer before the store that read it is done
        c_smem.store(part)
        fence_async_shared()
        gl.thread_barrier()
        if row_end - row_start >= part.shape[0]:
            tma.async_copy_shared_to_global(c_desc, [row_start, col], c_smem)
        else:
            W: gl.constexpr = part.shape[1]
            TPN: gl.constexpr = W // 8 if W < 256 else 32
            st: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPN, TPN], [WARPS, 1], [1, 0])
            _masked_store(c_smem, c_ptr, 0, stride_cr, row_start, row_end, col, st, COL_MASK=False)

    @gluon.jit
    def _long_mma(a_bufs, b_bufs, ready, empty, c_smem, c_desc, c_ptr, table_ptr, num_pid_n, K, stride_cr,
                  B_TRANS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  STAGES: gl.constexpr, WARPS: gl.constexpr, C_SPLIT: gl.constexpr):
        """MMA partition: per tile, the wgmma chain over the ring (one K-block in flight: once a K-block's MMA is
        issued the previous one is done and its slot goes back to the loader), then the rounded tile out through
        the staging buffer (:func:`_long_store`) at C's columns pid_n·BLOCK_N + [0, BLOCK_N) (C the written block
        of columns)."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        dtype: gl.constexpr = c_ptr.dtype.element_ty
        total = gl.load(table_ptr) * num_pid_n
        k_tiles = K // BLOCK_K
        step = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            e, row_start, row_end, pid_n = _tile_of(tile, table_ptr, num_pid_n)
            acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
            for ki in range(k_tiles):
                s = step % STAGES
                mbarrier.wait(ready.index(s), (step // STAGES) & 1)
                if B_TRANS:
                    b = b_bufs.index(s).permute((1, 0))
                else:
                    b = b_bufs.index(s)
                acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=ki > 0)
                step += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k_tiles > 0)
            c = acc.to(dtype)
            col = pid_n * BLOCK_N
            if C_SPLIT == 2:
                left, right = column_halves(c)
                _long_store(left, c_smem, c_desc, c_ptr, row_start, row_end, col, stride_cr, WARPS)
                _long_store(right, c_smem, c_desc, c_ptr, row_start, row_end, col + BLOCK_N // 2, stride_cr, WARPS)
            else:
                _long_store(c, c_smem, c_desc, c_ptr, row_start, row_end, col, stride_cr, WARPS)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _long_kernel(a_desc, b_desc, c_desc, c_ptr, table_ptr, num_pid_n, K, M_B, col0, stride_cr,
                     B_TRANS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                     STAGES: gl.constexpr, MMA_WARPS: gl.constexpr, C_SPLIT: gl.constexpr,
                     LOADER_REGS: gl.constexpr):
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_long_mma, (a_bufs, b_bufs, ready, empty, c_smem, c_desc, c_ptr, table_ptr, num_pid_n, K, stride_cr,
                         B_TRANS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, MMA_WARPS, C_SPLIT)),
            (_long_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, table_ptr, num_pid_n, K, M_B, col0,
                            B_TRANS, BLOCK_N, BLOCK_K, STAGES)),
        ], [1], [LOADER_REGS])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


_CALLS: dict[tuple, dict] = {}


def long_calls() -> list[dict]:
    """The shapes this process ran through :func:`long_gemm` (m, k, E, dtype, transpose_b, width) with their
    config; benchmarks record it next to their timings (host bookkeeping, no sync)."""
    return [{"m": m, "k": k, "E": e, "dtype": dt, "transpose_b": tb, "width": w, "config": cfg}
            for (m, k, e, dt, tb, w), cfg in _CALLS.items()]


def long_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, routing: Routing, *, transpose_b: bool,
              out: torch.Tensor | None = None, col0: int = 0, width: int | None = None,
              config: dict | None = None, num_programs: int | None = None) -> torch.Tensor:
    """Columns [col0, col0 + width) of C = A op(B[e]) by the warp-specialised kernel (see the module doc).

    The caller has checked :func:`long_supported` (for tests: dtype, alignment, k and width).

    Args:
        a: (R, k) bf16/fp16, contiguous, rows sorted by expert (dH for dX̃, A for the down-projection).
        b: (E, m, k) with ``transpose_b`` (C = A B[e]ᵀ: W2 (E, d, n) for the down-projection) or (E, k, m)
            without (C = A B[e]: W1 (E, 2n, d), either gate/up layout, for dX̃), contiguous, a's dtype.
        bias: must be None (no bias epilogue).
        routing: rows sorted by expert (``expert_offsets``).
        out: an (R, width) view of a's dtype with a unit inner stride and 16-byte aligned rows to write into (a
            column block of a wider C), else a new (R, width) tensor.
        col0, width: the block of C's columns to compute (default: all m).
        config: {"C_SPLIT", "STAGES"} (default :func:`long_config`).
        num_programs: the persistent grid's size (default one program per multiprocessor); fewer leave
            multiprocessors to a kernel running beside this one (each program takes a whole multiprocessor).
    Returns:
        C[:, col0:col0 + width] (R, width) in a's dtype; no atomics, the same bits on every run (any ``num_programs``).
    Raises:
        ValueError: a bias; operands of other ranks, dtypes or reduction sizes, not contiguous, or k not a multiple
            of BLOCK_K; a column block off BLOCK_N or outside B's columns; an ``out`` of another shape, dtype or
            device or with a non-unit inner stride; ``num_programs`` below 1.
    """
    if bias is not None:
        raise ValueError("bias: long_gemm has no bias epilogue; expected None")
    problem = _operand_error(a, b, transpose_b, col0, width)
    if problem:
        raise ValueError(problem)
    if num_programs is not None and num_programs < 1:
        raise ValueError(f"num_programs: expected a positive grid size or None, got {num_programs}")
    e = b.shape[0]
    k, m = (b.shape[2], b.shape[1]) if transpose_b else (b.shape[1], b.shape[2])
    w = m - col0 if width is None else width
    r = a.shape[0]
    out = output_or_new(out, (r, w), a)
    if r == 0:
        return out
    cfg = config or long_config()
    split = cfg["C_SPLIT"]
    _CALLS[(m, k, e, str(a.dtype).removeprefix("torch."), transpose_b, w)] = dict(cfg)
    b2d, b_block = (b.view(e * m, k), [BLOCK_N, BLOCK_K]) if transpose_b else (b.view(e * k, m), [BLOCK_K, BLOCK_N])
    table = routing_tile_table(routing, BLOCK_M)
    launch_kernel(
        _long_kernel, (num_programs or sm_count(a.device),),
        _descriptor(a, [BLOCK_M, BLOCK_K]), _descriptor(b2d, b_block), _descriptor(out, [BLOCK_M, BLOCK_N // split]),
        out, table, w // BLOCK_N, k, m, col0, out.stride(0),
        B_TRANS=transpose_b, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, STAGES=cfg["STAGES"],
        MMA_WARPS=MMA_WARPS, C_SPLIT=split, LOADER_REGS=LOADER_REGS, maxnreg=cfg.get("MAXNREG", MAXNREG),
        num_warps=MMA_WARPS)
    return out


def long_gemm_ref(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, routing: Routing, *,
                  transpose_b: bool, out: torch.Tensor | None = None, col0: int = 0, width: int | None = None,
                  config: dict | None = None, num_programs: int | None = None) -> torch.Tensor:
    """Pure-PyTorch twin of :func:`long_gemm` (float32 per-expert loop, output in a's dtype; runs on CPU; ``config``
    and ``num_programs`` are ignored)."""
    full = per_expert_gemm_ref(a, b, bias, routing.expert_offsets, transpose_b)
    m = full.shape[1]
    c = full[:, col0:col0 + (m - col0 if width is None else width)]
    if out is None:
        return c.contiguous()
    out.copy_(c)
    return out
