"""Warp-specialised ping-pong varlen-M grouped GEMM for Hopper, in Gluon (SPEC §3 kernel 2).

The same product as :func:`sonicmoe.ops.grouped_gemm.varlen_m_gemm` — C[r] = A[r] op(B[e]) (+ bias[e]) over
expert-contiguous rows — for grouped GEMMs with a short reduction, where the output's stores, not the
tensor cores, set the pace. On sm_90 it serves, for shapes whose experts average many rows
(:func:`ws_supported`), the down-projection Y = A W2[e]ᵀ (k = n ≤ 256) and the backward's dX̃ = dH W1[e]
(B not transposed, k = 2n ≤ 512); everything else runs the Triton kernel.

Each persistent program owns one N-tile (BLOCK_N columns of C) and a contiguous range of M-tiles (BLOCK_M rows
of one expert each), and splits its warps by role:

* a **loader** (one warp) copies, by TMA, B[e]'s whole (k × BLOCK_N) block into shared memory at each change
  of expert (it stays resident while the program runs that expert's M-tiles), and the A blocks
  (BLOCK_M × BLOCK_K) of every (M-tile, K-block) step into a ring of ``STAGES`` slots;
* two **consumers** (one warpgroup each) take the M-tiles in turn (ping-pong): while one runs its tile's
  asynchronous wgmma chain, the other runs the previous tile's epilogue (bias, cast, store). A pair of
  ``turn`` mbarriers makes the two alternate their MMA phases, which also keeps the shared ring in step order.
  Full tiles leave by TMA store from a per-consumer staging buffer; an expert's last, partial tile by masked
  16-byte pointer stores.

The measured reason (benchmarks/results/2026-11-24_nvidia-h100_session17/): at the 7B shape the
down-projection's loads and MMAs alone take about half its time and writing Y the other half; DRAM traffic is
at its minimum (ncu: A and W2 read once, Y written once). What helped was overlapping each tile's stores with
the other consumer's MMAs, and a deep A ring (16 slots) that keeps loads in flight while stores load the
memory system. The dX̃ GEMM at the 7B shape (k = 512, B[e] 128 KiB resident, an 8-slot ring), session 23 on
H100s (benchmarks/results/2026-11-25_nvidia-h100_session23/): 0.617 ms against 0.652 for the Triton kernel, 0.504
against 0.523 at (40960, 768, 256, 128, 8); a 6-slot ring 0.662, 4 slots 0.812, BLOCK_N = 64 (16 slots) 0.714:
the deepest ring that fits wins, as for the down-projection. In the 7B layer the gain is within noise there.

The tile schedule is a table built by one small Triton kernel (:func:`tile_table`) from ``expert_offsets``,
with no host sync. B[e] is read through a 2-D TMA view of the weight, (E·m, k) for B (E, m, k) used
transposed, (E·k, m) otherwise, so k must be a multiple of BLOCK_K. Gluon kernels do not run under Triton's
interpreter: the kernel is tested on the GPU against the Triton kernel and the float32 reference
(tests/test_grouped_gemm_ws.py); :func:`tile_table` is tested on CPU too.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..env import env_choice, env_switch
from ..routing import Routing
from .common import cdiv, interpreting, max_m_tiles, new_output, next_pow2, per_expert_gemm_ref, sm_count
from .fast_launch import launch_kernel, major_minor
from .kernel_lib import tile_schedule

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel serves every shape
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

TILE_TABLE_COLS = 4  # (expert, first row, end row, unused) per M-tile; row 0 holds the number of M-tiles
BLOCK_M = 64  # one warpgroup's wgmma M: each consumer's tile height
BLOCK_N = 128
BLOCK_K = 64
MAX_K = 256  # B[e]'s (k × BLOCK_N) block stays resident: k ≤ 256 is 64 KiB
MAX_K_DXT = 512  # the dX̃ form (B not transposed, k = 2n): 128 KiB resident, an 8-slot A ring
MAX_STAGES = 16
# Tried and dropped (session 42, benchmarks/results/2026-11-27_nvidia-h100-h200_session42/; removed in session 68,
# last in e42b581): each consumer staging its tile's two column halves in the ring slots of the tile's last two
# K-blocks instead of a buffer of its own, four more ring slots. The 7B dX̃ alone 0.605 against 0.616 ms on an H100,
# but the 7B layer level there and 0.5% slower on an H200: each consumer waits for its own stores.
# measured on H100 (session 17, benchmarks/results/2026-11-24_nvidia-h100_session17/): against the Triton kernel,
# 7B (1536 rows per expert) 0.337 vs 0.359 ms, 1.4B (2560) 0.294 vs 0.303, (32768, 4096, 256, 256, 16) (2048)
# 2.143 vs 2.634; slower at (16384, 1536, 256, 512, 8) (256 rows: B[e] reloaded every 4 M-tiles) 0.346 vs 0.324
MIN_ROWS_PER_EXPERT = 1024
SMEM_BUDGET = 227 * 1024 - 1024  # dynamic shared memory of one program on sm_90, less the barriers
CONSUMER_REGS = 232
LOADER_REGS = 40


@triton.jit
def _fill_tile_table(offsets_ptr, table_ptr, E, max_tiles, pid, E_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_T: tl.constexpr):
    """Rows 1 + t of the table for M-tiles t in [pid·BLOCK_T, (pid + 1)·BLOCK_T), and row 0 where pid is 0."""
    eidx, lo, hi, ntiles, cum, total = tile_schedule(offsets_ptr, E, E_P2, BLOCK_M)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.sum((cum[None, :] <= t[:, None]).to(tl.int32), 1)
    sel = eidx[None, :] == e[:, None]
    first_tile = tl.sum(tl.where(sel, (cum - ntiles)[None, :], 0), 1)
    row_start = tl.sum(tl.where(sel, lo[None, :], 0), 1) + (t - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(sel, hi[None, :], 0), 1)
    valid = t < total
    rows = table_ptr + (t + 1) * 4
    in_table = t < max_tiles
    tl.store(rows, tl.where(valid, e, 0), mask=in_table)
    tl.store(rows + 1, tl.where(valid, row_start, 0), mask=in_table)
    tl.store(rows + 2, tl.where(valid, row_end, 0), mask=in_table)
    tl.store(rows + 3, tl.zeros_like(e), mask=in_table)
    head = tl.arange(0, 4)
    tl.store(table_ptr + head, tl.where(head == 0, total, 0), mask=(head < 4) & (pid == 0))


@triton.jit
def _tile_table_kernel(offsets_ptr, table_ptr, table2_ptr, E, max_tiles, max_tiles2, progs, E_P2: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_T: tl.constexpr):
    # programs [0, progs) fill the BLOCK_M table, the rest (if any) the BLOCK_M2 one: two tables, one launch
    pid = tl.program_id(0)
    if pid < progs:
        _fill_tile_table(offsets_ptr, table_ptr, E, max_tiles, pid, E_P2, BLOCK_M, BLOCK_T)
    else:
        _fill_tile_table(offsets_ptr, table2_ptr, E, max_tiles2, pid - progs, E_P2, BLOCK_M2, BLOCK_T)


def tile_tables(expert_offsets: torch.Tensor, num_rows: int, block_ms: tuple[int, ...],
                config: dict | None = None) -> list[torch.Tensor]:
    """The varlen-M tile schedule for one or two tile heights, in one launch: a list of (1 + cdiv(R, BLOCK_M) + E,
    4) int32 tables on the offsets' device, one per entry of ``block_ms``.

    Row 0 holds (number of M-tiles, 0, 0, 0); row 1 + t holds (expert, first row, end row, 0) of M-tile t
    (M-tiles numbered expert after expert, expert e's rows [off[e], off[e+1]) cut into cdiv(T_e, BLOCK_M)
    tiles; empty experts have none); rows past the number of M-tiles are zeros. No host sync.

    Args:
        expert_offsets: (E+1,) int32 exclusive prefix sum of the per-expert row counts T_e.
        num_rows: R = off[E] (a host value: the routed rows' count).
        block_ms: one or two tile heights BLOCK_M (powers of two).
        config: {"BLOCK_T": M-tiles per program, "num_warps"} (probes), else the default below.
    Raises:
        ValueError: unless ``block_ms`` holds one or two heights.
    """
    if len(block_ms) not in (1, 2):
        raise ValueError(f"block_ms: expected one or two tile heights, got {block_ms}")
    e = expert_offsets.shape[0] - 1
    # 16 M-tiles per program, one warp per 128 experts: each program's (BLOCK_T, E) compare-and-sum is its time.
    # Session 48 (H100, 7B routing, scripts/tile_table_probe.py): both tables 3.1 us against 6.1 with 64 tiles per
    # program and 4 warps (one table: 2.6 against 5.9)
    cfg = config or {"BLOCK_T": 16, "num_warps": min(8, max(1, next_pow2(e) // 128))}
    block_t, warps = cfg["BLOCK_T"], cfg["num_warps"]
    tiles = [max_m_tiles(num_rows, e, bm) for bm in block_ms]
    tables = [torch.empty((t + 1, TILE_TABLE_COLS), device=expert_offsets.device, dtype=torch.int32) for t in tiles]
    progs = [cdiv(t, block_t) for t in tiles]
    second = len(block_ms) - 1  # the second table's entries repeat the first's when there is one table
    launch_kernel(_tile_table_kernel, (sum(progs),), expert_offsets, tables[0], tables[second], e, tiles[0],
                  tiles[second], progs[0], E_P2=next_pow2(e), BLOCK_M=block_ms[0], BLOCK_M2=block_ms[second],
                  BLOCK_T=block_t, num_warps=warps)
    return tables


def tile_table(expert_offsets: torch.Tensor, num_rows: int, block_m: int) -> torch.Tensor:
    """The varlen-M tile schedule as a table: (1 + cdiv(R, BLOCK_M) + E, 4) int32 on the offsets' device (the
    layout of :func:`tile_tables`, for one tile height). One Triton launch, no host sync.

    Args:
        expert_offsets: (E+1,) int32 exclusive prefix sum of the per-expert row counts T_e.
        num_rows: R = off[E] (a host value: the routed rows' count).
        block_m: BLOCK_M, the tile height.
    """
    return tile_tables(expert_offsets, num_rows, (block_m,))[0]


# the tile heights of the Gluon kernels' tables: this module's ping-pong GEMM (BLOCK_M) and the 128-row tiles of the
# up-projection and dH kernels (up_proj_ws.BLOCK_M, dh_ws.BLOCK_M); routing_tile_table builds both in one launch
TABLE_HEIGHTS = (BLOCK_M, 128)


def routing_tile_table(routing: Routing, block_m: int) -> torch.Tensor:
    """:func:`tile_table` of ``routing`` for ``block_m``, built once per Routing object: the first request builds
    the tables of every height in :data:`TABLE_HEIGHTS` in one launch (the forward's up- and down-projections,
    and the backward's dH and dX̃ GEMMs, each need both), and later requests reuse them. The cache holds while
    ``routing.expert_offsets`` is the same tensor, unmodified (its version counter) — else it is rebuilt.

    Args:
        routing: the expert-sorted rows (``expert_offsets``, ``num_rows``).
        block_m: the tile height.
    """
    hit = routing.cached((block_m, routing.num_rows))
    if hit is not None:
        return hit
    heights = TABLE_HEIGHTS if block_m in TABLE_HEIGHTS else (block_m,)
    for bm, table in zip(heights, tile_tables(routing.expert_offsets, routing.num_rows, heights), strict=True):
        routing.cache((bm, routing.num_rows), table)
    return routing.cached((block_m, routing.num_rows))


def tile_table_ref(expert_offsets: torch.Tensor, num_rows: int, block_m: int) -> torch.Tensor:
    """Pure-PyTorch twin of :func:`tile_table` (a host loop over the experts)."""
    offsets = expert_offsets.tolist()
    e = len(offsets) - 1
    table = torch.zeros((max_m_tiles(num_rows, e, block_m) + 1, TILE_TABLE_COLS), dtype=torch.int32)
    t = 0
    for i in range(e):
        for start in range(offsets[i], offsets[i + 1], block_m):
            t += 1
            table[t, :3] = torch.tensor([i, start, offsets[i + 1]])
    table[0, 0] = t
    return table.to(expert_offsets.device)


if HAVE_GLUON:

    @gluon.jit
    def column_halves(acc):
        """The left and right column halves of the register tile ``acc`` (rows × 2W → two rows × W tiles), for
        epilogues that write a tile in halves (:mod:`.weight_grad_ws` and :mod:`.dh_ws`)."""
        W: gl.constexpr = acc.shape[1] // 2
        return acc.reshape((acc.shape[0], 2, W)).permute((0, 2, 1)).split()

    @gluon.jit
    def _chunk(table_ptr, N, BLOCK_N: gl.constexpr):
        """This program's N-tile and its contiguous range [lo, hi) of M-tiles (the programs of one chunk read
        the same A rows at about the same time, one N-tile each)."""
        num_pid_n = gl.cdiv(N, BLOCK_N)
        pid = gl.program_id(0)
        chunks = gl.num_programs(0) // num_pid_n
        total_m = gl.load(table_ptr)
        chunk = pid // num_pid_n
        return pid - chunk * num_pid_n, chunk * total_m // chunks, (chunk + 1) * total_m // chunks

    @gluon.jit
    def _ws_loader(a_desc, b_desc, a_bufs, b_res, ready, empty, b_ready, b_empty, table_ptr, N, K,
                   B_TRANS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, K_BLOCKS: gl.constexpr,
                   STAGES: gl.constexpr):
        """Loader partition: B[e]'s (k, BLOCK_N) block into the resident buffer at each change of expert (once
        both consumers have released it), and the A block of every (M-tile, K-block) step into the ring."""
        pid_n, lo, hi = _chunk(table_ptr, N, BLOCK_N)
        cur_e = lo * 0 - 1
        loads = 0
        step = 0
        for tile in range(lo, hi):
            entry = table_ptr + (tile + 1) * 4
            e = gl.load(entry)
            row_start = gl.load(entry + 1)
            if e != cur_e:
                mbarrier.wait(b_empty.index(0), (loads & 1) ^ 1)
                mbarrier.expect(b_ready.index(0), K_BLOCKS * b_desc.block_type.nbytes)
                for kb in gl.static_range(K_BLOCKS):
                    if B_TRANS:
                        tma.async_copy_global_to_shared(b_desc, [e * N + pid_n * BLOCK_N, kb * BLOCK_K],
                                                        b_ready.index(0), b_res.index(kb))
                    else:
                        tma.async_copy_global_to_shared(b_desc, [e * K + kb * BLOCK_K, pid_n * BLOCK_N],
                                                        b_ready.index(0), b_res.index(kb))
                loads += 1
                cur_e = e
            for ki in gl.static_range(K_BLOCKS):
                s = step % STAGES
                mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [row_start, ki * BLOCK_K], ready.index(s), a_bufs.index(s))
                step += 1

    @gluon.jit
    def _ws_consumer(a_bufs, b_res, ready, empty, b_ready, b_empty, turn, c_smem, c_desc, c_ptr, bias_ptr,
                     table_ptr, N, stride_cr, ME: gl.constexpr, HAS_BIAS: gl.constexpr, B_TRANS: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_BLOCKS: gl.constexpr, STAGES: gl.constexpr,
                     TPW_N: gl.constexpr):
        """Consumer ``ME`` (0 or 1): the M-tiles at even (0) or odd (1) positions of the program's range.

        Every consumer walks the whole range so that both see each change of expert: at one, it releases
        B[e]'s buffer (b_empty counts two arrivals) and waits for the next expert's block. Its own tiles wait
        for their ``turn`` (the other consumer has issued the previous tile's MMAs, so the ring's slots are
        consumed in step order), run the wgmma chain, pass the turn on, then finish with the epilogue while
        the other consumer's MMAs run."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
        # 8 contiguous elements (16 bytes) per thread for the pointer stores of partial tiles
        st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_N, TPW_N], [4, 1], [1, 0])
        pid_n, lo, hi = _chunk(table_ptr, N, BLOCK_N)
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        cur_e = lo * 0 - 1
        loads = 0
        own = 0
        for tile in range(lo, hi):
            entry = table_ptr + (tile + 1) * 4
            e = gl.load(entry)
            if e != cur_e:
                # this consumer's MMAs on the previous expert are done (each tile waits for its own)
                mbarrier.arrive(b_empty.index(0), pred=cur_e >= 0)
                mbarrier.wait(b_ready.index(0), loads & 1)
                loads += 1
                cur_e = e
            if (tile - lo) % 2 == ME:
                row_start = gl.load(entry + 1)
                row_end = gl.load(entry + 2)
                # consumer 0's first wait passes at once (parity 1 of a fresh barrier)
                mbarrier.wait(turn.index(ME), (own & 1) ^ (1 - ME))
                acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
                for ki in gl.static_range(K_BLOCKS):
                    step = (tile - lo) * K_BLOCKS + ki
                    s = step % STAGES
                    mbarrier.wait(ready.index(s), (step // STAGES) & 1)
                    if B_TRANS:
                        b = b_res.index(ki).permute((1, 0))
                    else:
                        b = b_res.index(ki)
                    acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
                    # one MMA in flight: the one before it is done, so its A slot goes back to the loader
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    if ki > 0:
                        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
                mbarrier.arrive(turn.index(1 - ME))
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index(((tile - lo) * K_BLOCKS + K_BLOCKS - 1) % STAGES))
                own += 1
                if HAS_BIAS:
                    bias = gl.load(bias_ptr + e.to(gl.int64) * N + cols, mask=cols < N, other=0.0)
                    acc = acc + bias.to(gl.float32)[None, :]
                my_c = c_smem.index(ME)
                # the staging buffer's previous TMA store has finished reading it
                tma.store_wait(pendings=0)
                my_c.store(acc.to(c_ptr.dtype.element_ty))
                if row_end - row_start >= BLOCK_M:
                    # a full tile: one asynchronous TMA store (columns past N clipped by the copy engine)
                    fence_async_shared()
                    tma.async_copy_shared_to_global(c_desc, [row_start, pid_n * BLOCK_N], my_c)
                else:
                    # an expert's last tile: the rows past its end belong to the next expert, masked
                    _masked_store(my_c, c_ptr, N, stride_cr, row_start, row_end, pid_n * BLOCK_N, st_layout)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _masked_store(buf, c_ptr, N, stride_cr, row_start, row_end, col0, st_layout: gl.constexpr,
                      COL_MASK: gl.constexpr = True):
        """The staged block ``buf`` (BLOCK_M × W) to C's rows [row_start, row_end) and columns col0 + [0, W) < N by
        16-byte pointer stores (an expert's last, partial tile: the rows past its end belong to the next expert).
        Without ``COL_MASK`` every column is stored (the caller's block lies within C's width; N is unused)."""
        c = buf.load(st_layout)
        rows = row_start + gl.arange(0, buf.shape[0], layout=gl.SliceLayout(1, st_layout))
        cc = col0 + gl.arange(0, buf.shape[1], layout=gl.SliceLayout(0, st_layout))
        ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cr + cc[None, :]
        if COL_MASK:
            gl.store(ptrs, c, mask=(rows < row_end)[:, None] & (cc < N)[None, :])
        else:
            gl.store(ptrs, c, mask=(rows < row_end)[:, None] & (cc >= 0)[None, :])

    @gluon.jit
    def _ws_consumer1(a_bufs, b_res, ready, empty, b_ready, b_empty, turn, c_smem, c_desc, c_ptr, bias_ptr,
                      table_ptr, N, stride_cr, HAS_BIAS: gl.constexpr, B_TRANS: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_BLOCKS: gl.constexpr, STAGES: gl.constexpr,
                      TPW_N: gl.constexpr):
        _ws_consumer(a_bufs, b_res, ready, empty, b_ready, b_empty, turn, c_smem, c_desc, c_ptr, bias_ptr,
                     table_ptr, N, stride_cr, 1, HAS_BIAS, B_TRANS, BLOCK_M, BLOCK_N, K_BLOCKS, STAGES, TPW_N)

    @gluon.jit
    def _ws_varlen_m_kernel(a_desc, b_desc, c_desc, c_ptr, bias_ptr, table_ptr, N, K, stride_cr,
                            HAS_BIAS: gl.constexpr, B_TRANS: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, K_BLOCKS: gl.constexpr,
                            STAGES: gl.constexpr, TPW_N: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            LOADER_REGS: gl.constexpr):
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_res = gl.allocate_shared_memory(b_desc.dtype, [K_BLOCKS] + b_desc.block_type.shape, b_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, BLOCK_M, BLOCK_N], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        b_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        b_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(b_ready.index(0), count=1)
        mbarrier.init(b_empty.index(0), count=2)
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        gl.warp_specialize([
            (_ws_consumer, (a_bufs, b_res, ready, empty, b_ready, b_empty, turn, c_smem, c_desc, c_ptr, bias_ptr,
                            table_ptr, N, stride_cr, 0, HAS_BIAS, B_TRANS, BLOCK_M, BLOCK_N, K_BLOCKS, STAGES,
                            TPW_N)),
            (_ws_consumer1, (a_bufs, b_res, ready, empty, b_ready, b_empty, turn, c_smem, c_desc, c_ptr, bias_ptr,
                             table_ptr, N, stride_cr, HAS_BIAS, B_TRANS, BLOCK_M, BLOCK_N, K_BLOCKS, STAGES,
                             TPW_N)),
            (_ws_loader, (a_desc, b_desc, a_bufs, b_res, ready, empty, b_ready, b_empty, table_ptr, N, K, B_TRANS,
                          BLOCK_N, BLOCK_K, K_BLOCKS, STAGES)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))
        mbarrier.invalidate(b_ready.index(0))
        mbarrier.invalidate(b_empty.index(0))
        mbarrier.invalidate(turn.index(0))
        mbarrier.invalidate(turn.index(1))


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def ws_smem_bytes(k: int, stages: int, block_n: int = BLOCK_N, elem: int = 2) -> int:
    """Shared memory of one program: B[e]'s resident (k × BLOCK_N) block, the A ring, and the consumers' two
    staging buffers."""
    return elem * (k * block_n + stages * BLOCK_M * BLOCK_K + 2 * BLOCK_M * block_n)


def ws_config(k: int, transpose_b: bool = True) -> dict | None:
    """The kernel's config for a reduction of size k: {"BLOCK_N", "STAGES"} (the deepest A ring that fits, at most
    MAX_STAGES), or None where k is not a multiple of BLOCK_K or exceeds MAX_K (MAX_K_DXT for the dX̃ form,
    ``transpose_b`` False)."""
    if k % BLOCK_K or k > (MAX_K if transpose_b else MAX_K_DXT) or k <= 0:
        return None
    free = SMEM_BUDGET - ws_smem_bytes(k, 0)
    return {"BLOCK_N": BLOCK_N, "STAGES": min(MAX_STAGES, free // (2 * BLOCK_M * BLOCK_K))}


GLUON_TRITON = (3, 6)  # the Triton release whose (experimental) Gluon API the kernels are written and measured on


def triton_release() -> tuple[int, ...]:
    """(major, minor) of the installed Triton; () when its version does not parse."""
    return major_minor(triton.__version__)


# the values of SONICMOE_GLUON, and of the switches of one Gluon kernel each (SONICMOE_GLUON_UP, _DH, _WGRAD, _LONG:
# gluon_kernel_switch)
GLUON_VALUES = ("0", "1", "force")
GLUON_KERNEL_VALUES = ("0", "1", "all")


def gluon_kernel_switch(name: str) -> str:
    """The switch ``name`` of one Gluon kernel (``SONICMOE_GLUON_UP``, ``_DH``, ``_WGRAD``, ``_LONG``; read at each
    call): ``1`` (the default: where the layer's rule prefers it), ``0`` (off) or ``all`` (wherever it applies).

    Raises:
        ValueError: any other value.
    """
    return env_choice(name, "1", GLUON_KERNEL_VALUES)


def ws_enabled(transpose_b: bool = True) -> bool:
    """The Gluon kernel is used unless SONICMOE_GLUON=0 (read at each call; SONICMOE_GLUON_DXT=0 turns off the
    dX̃ form alone, ``transpose_b`` False), and never under the interpreter. Gluon is experimental and its API
    changes between Triton releases: only Triton :data:`GLUON_TRITON` runs these kernels (every other release
    runs the Triton kernels, the same results) unless ``SONICMOE_GLUON=force``.

    Raises:
        ValueError: SONICMOE_GLUON set to anything but ``0``, ``1`` or ``force``, or (``transpose_b`` False)
            SONICMOE_GLUON_DXT to anything but ``0`` or ``1`` (on CPU too).
    """
    switch = env_choice("SONICMOE_GLUON", "1", GLUON_VALUES)
    form_on = transpose_b or env_switch("SONICMOE_GLUON_DXT", True)
    if not HAVE_GLUON or interpreting() or switch == "0":
        return False
    if triton_release() != GLUON_TRITON and switch != "force":
        return False
    return form_on


def ws_supported(a: torch.Tensor, b: torch.Tensor, num_rows: int, *, transpose_b: bool) -> bool:
    """Whether :func:`ws_varlen_m_gemm` serves this product (host checks only, no sync).

    True for the down-projection form (``transpose_b``, B (E, m, k)) and the dX̃ form (B (E, k, m)) on an sm_90
    GPU with Gluon (:func:`ws_enabled`), bf16/fp16 contiguous operands of one dtype with 16-byte aligned rows, a
    config (:func:`ws_config`: k a multiple of 64, ≤ 256 for the down-projection form, ≤ 512 for the dX̃ form),
    and experts averaging at least MIN_ROWS_PER_EXPERT rows
    (R = ``num_rows`` over E experts): below that B[e] would be reloaded every few M-tiles and the Triton
    kernel is faster.
    """
    if not ws_enabled(transpose_b) or not a.is_cuda or a.dtype not in _GL_DTYPES or b.dtype != a.dtype:
        return False
    if a.dim() != 2 or b.dim() != 3 or not (a.is_contiguous() and b.is_contiguous()):
        return False
    e, m, k = b.shape if transpose_b else (b.shape[0], b.shape[2], b.shape[1])
    if num_rows < MIN_ROWS_PER_EXPERT * e or ws_config(k, transpose_b) is None or a.shape[1] != k or m == 0:
        return False
    if torch.cuda.get_device_capability(a.device) != (9, 0):
        return False
    return (m * a.element_size()) % 16 == 0 and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0


_CALLS: dict[tuple, dict] = {}


def ws_calls() -> list[dict]:
    """The shapes this process ran through :func:`ws_varlen_m_gemm` (m, k, E, dtype, B transposed) with their
    config; benchmarks record it next to their timings (host bookkeeping, no sync)."""
    return [{"m": m, "k": k, "E": e, "dtype": dt, "transpose_b": tb, "config": cfg}
            for (m, k, e, dt, tb), cfg in _CALLS.items()]


@functools.lru_cache(maxsize=64)
def shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The NVMMA shared-memory layout of a ``block`` tile of ``dtype`` (bf16/fp16), built once per pair: building
    it costs about 9 µs of host time (Python; a descriptor 12-14 µs with it, 3 µs without, on a CI-kind CPU:
    benchmarks/results/2026-11-25_nvidia-h100_session23/layout_host_cpu.txt), three or more times per Gluon
    launch otherwise."""
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, _GL_DTYPES[dtype]))


def _descriptor(t: torch.Tensor, block: list[int]):
    return GluonDescriptor(t, list(t.shape), list(t.stride()), block, shared_layout(tuple(block), t.dtype))


def ws_varlen_m_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, expert_offsets: torch.Tensor,
                     *, transpose_b: bool, config: dict | None = None, table: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """C (R, m) = A (R, k) op(B[e]) (+ bias[e]) by the warp-specialised ping-pong kernel (see the module doc).

    The caller has checked :func:`ws_supported` (or, for tests, that the dtype, alignment and k suit it; both
    ``transpose_b`` forms run).

    Args:
        a: (R, k) bf16/fp16, contiguous, rows sorted by expert.
        b: (E, m, k) with ``transpose_b`` (C = A B[e]ᵀ: the down-projection with W2) or (E, k, m) without
            (C = A B[e]), contiguous, a's dtype.
        bias: (E, m) or None.
        expert_offsets: (E+1,) int32 exclusive prefix sum of the per-expert row counts.
        config: {"BLOCK_N", "STAGES"} (default :func:`ws_config`).
        table: the :func:`tile_table` of ``expert_offsets`` for :data:`BLOCK_M` if the caller has it
            (:func:`routing_tile_table`), else it is built here.
    Returns:
        C (R, m) in a's dtype; no atomics, the same bits on every run.
    """
    e = b.shape[0]
    if transpose_b:
        m, k = b.shape[1], b.shape[2]
    else:
        k, m = b.shape[1], b.shape[2]
    cfg = config or ws_config(k, transpose_b)
    bn = cfg["BLOCK_N"]
    b2d, b_block = (b.view(e * m, k), [bn, BLOCK_K]) if transpose_b else (b.view(e * k, m), [BLOCK_K, bn])
    r = a.shape[0]
    c = new_output((r, m), device=a.device, dtype=a.dtype)
    if r == 0:
        return c
    _CALLS[(m, k, e, str(a.dtype).removeprefix("torch."), transpose_b)] = dict(cfg)
    table = tile_table(expert_offsets, r, BLOCK_M) if table is None else table
    num_pid_n = cdiv(m, bn)
    grid = max(sm_count(a.device) // num_pid_n, 1) * num_pid_n
    launch_kernel(
        _ws_varlen_m_kernel, (grid,),
        _descriptor(a, [BLOCK_M, BLOCK_K]), _descriptor(b2d, b_block), _descriptor(c, [BLOCK_M, bn]), c,
        bias.contiguous() if bias is not None else c, table, m, k, c.stride(0),
        HAS_BIAS=bias is not None, B_TRANS=transpose_b, BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=BLOCK_K,
        K_BLOCKS=k // BLOCK_K, STAGES=cfg["STAGES"], TPW_N=min(32, bn // 8), CONSUMER_REGS=CONSUMER_REGS,
        LOADER_REGS=LOADER_REGS, num_warps=4)
    return c


def ws_varlen_m_gemm_ref(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, expert_offsets: torch.Tensor,
                         *, transpose_b: bool, config: dict | None = None, table: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """Pure-PyTorch twin of :func:`ws_varlen_m_gemm` (float32 per-expert loop, output in a's dtype; runs on
    CPU; ``config`` and ``table`` are ignored)."""
    return per_expert_gemm_ref(a, b, bias, expert_offsets, transpose_b)
