"""Warp-specialised varlen-K grouped GEMM for the expert weight gradients on Hopper, in Gluon (SPEC §4 kernels 2, 4).

The same product as :func:`sonicmoe.ops.weight_grad.varlen_k_gemm` — dW[e] (I, J) = Σ_{rows r of e} P[p(r)]ᵀ Q[q(r)],
with exactly one operand gathered by token inside its load:

* dW1[e] (2n, d) = Σ_r dH[r]ᵀ X[token(r)]      (Q = X gathered; P = dH by TMA)
* dW2[e] (d, n)  = Σ_r dO[token(r)]ᵀ A′[r]     (P = dO gathered; Q = A′ by TMA)

Why a second kernel (benchmarks/results/2026-11-25_nvidia-h200_session21/): the Triton kernel brings the gathered
rows in by ``cp.async`` from the MMA warps themselves, and every K-step then ends in a barrier across the whole
program before the tensor cores may read them. On an H200 the same Triton kernel on a pre-gathered, contiguous copy
of X (both operands by TMA) takes 0.50-0.57 ms for the 7B dW1 against 0.65 ms gathered, and 7.6 against 8.8 ms at
(32768, 4096, 1024, 128, 8). This kernel: 0.57-0.59 and 7.7-8.0 ms; dW2 0.28 against 0.30-0.31 and 3.7 against
4.1. The layer uses it where the expert width n ≥ ``library.GLUON_WGRAD_MIN_N`` (128 since session 38; until then 512,
while the dX aggregation overlapped the Triton dW1, which it cannot do beside this persistent kernel, whose tiles are
split among the SMs in advance).

Here each persistent program splits its warps by role:

* a **loader** (one warp) walks the program's tiles and their BLOCK_R-row chunks: the contiguous operand's chunk by
  TMA, the gathered operand's rows by 16-byte ``cp.async`` (row index from ``row_token``, loaded one chunk ahead),
  into a ring of ``STAGES`` slots. A slot has a ``tma_ready`` mbarrier (TMA bytes), a ``cp_ready`` one (each loader
  thread arrives once its copies have landed) and an ``empty`` one (the MMA that read it is done). An expert's
  last, partial chunk comes by masked ``cp.async`` in both operands (rows past the expert's end are zeros in both,
  so they add exactly nothing, as in the Triton kernel);
* the **MMA warps** (two warpgroups) run the asynchronous wgmma chain of each tile over the ring, one chunk in
  flight, then write the tile (cast to the output dtype) through shared memory by TMA stores, while the loader
  already fills the ring with the next tile's chunks. By default (``WG_SPLIT``, session 56) each warpgroup is a
  partition of its own with half the tile's I rows: the two share the ring (a slot goes back to the loader once
  both have read it), and while one stores its half tile in two pieces through a quarter-tile buffer, the other
  runs ahead on the next chunks, so the tensor cores no longer stop for every tile's store. In the one-partition
  form the tile's left half goes through a buffer of its own, its right half through the ring slot of the tile's
  last chunk (``STAGE_IN_RING``, session 41), which goes back to the loader once that store has read it. Either way
  the buffers are half a tile, and the ring has a fourth slot. With 256 × 128 tiles (dW1) each warpgroup of the
  split form computes the transposed product of its half of the J columns instead (``SWAP_AB``, session 61): one
  m64 × 256 wgmma per k16 step in place of two m64 × 128, its pieces stored transposed.

Tiles are numbered expert by expert, (BLOCK_I, BLOCK_J) output blocks within an expert, J fastest; program p takes
tiles p, p + P, ... Chunks are added in row order, BLOCK_R rows at a time, so the result is bitwise that of the
Triton kernel (which adds the same chunks in the same order; the wgmma k-steps do not depend on BLOCK_R). No
atomics; experts with no rows get zeros. I and J must be multiples of the tile (:func:`wgrad_ws_supported`); other
shapes run the Triton kernel. Gluon kernels do not run under Triton's interpreter: the kernel is tested on the GPU
against the Triton kernel and the float32 reference (tests/test_weight_grad_ws.py).
"""

from __future__ import annotations

import torch

from .common import env_switch, new_output, sm_count
from .fast_launch import launch_kernel
from .grouped_gemm_ws import _GL_DTYPES, HAVE_GLUON, _descriptor, gluon_kernel_switch, shared_layout, ws_enabled

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .grouped_gemm_ws import column_halves

# measured on an H200 (session 21, benchmarks/results/2026-11-25_nvidia-h200_session21/): 4 loader warps against
# 1-2 (one warp cannot issue a 64-row chunk's copies in the time of its MMAs: 0.78-0.81 ms for the 7B dW1, 2 warps
# 0.70), 64-row chunks in 3 slots against 32-row chunks in 6 (0.66) or stores from registers with a 4th slot (0.63)
LOADER_WARPS = 4
LOADER_REGS = 80
MMA_WARPS = 8  # two warpgroups
MAX_STAGES = 8
BLOCK_R = 64
# registers per thread at launch (the MMA warps get more inside the warp-specialised region, the loader's 80 less):
# 144 × 384 threads leaves room on an SM for small kernels of another stream (it was sized for the dX aggregation's
# two 4-warp programs, which the layer no longer runs beside this kernel: library.GLUON_WGRAD_MIN_N); every timing of
# session 21 from f31550a on is with these values; a 256-wide wgmma (BLOCK_J = 256) does not compile below 154
MAXNREG = {128: 144, 256: 160}
SMEM_BUDGET = 227 * 1024 - 1024  # dynamic shared memory of one program on sm_90, less the barriers


# the output tile's right half staged in the ring slot of the tile's last chunk, the left half in a buffer of half the
# tile's size: 4 ring slots instead of 3 (wgrad_ws_config). Session 41, one H100, the kernel alone (do_bench medians,
# benchmarks/results/2026-11-27_nvidia-h100-h200_session41/call2_*): 7B dW1 0.569 against 0.589 ms, dW2 0.307 against
# 0.314; (16384, 1536, 256, 512, 8) dW1 0.589 against 0.639, dW2 0.323 against 0.332; (32768, 4096, 1024, 128, 8)
# dW1 7.286 against 7.569, dW2 3.675 against 3.634; the same bits
STAGE_IN_RING = True
# WG_SPLIT: the two MMA warpgroups as two partitions of four warps, each with half the tile's I rows (the same wgmma
# instructions: m64 × BLOCK_J per warpgroup) and its own (BLOCK_I / 2, BLOCK_J / 2) store buffer; they share the
# ring (each slot's ``empty`` barrier counts both). At the end of a tile one warpgroup's stores run while the other,
# up to STAGES − 1 chunks ahead, keeps the tensor cores busy, instead of both stopping for the tile's epilogue.
# Session 56 (an H200, the kernel alone in settled 1.5 s windows, scripts/gather_path_probe.py): with the 8-warp
# partition the output's store costs dW1 6% and dW2 7.5% at (32768, 4096, 1024, 128, 8) (7.81 against 7.31 ms and
# 4.01 against 3.71 with the store skipped) and 9% at 7B. Split (2 pieces, no turns): dW1 7.760 against 7.950 ms,
# dW2 3.841 against 4.059; 7B 0.589 against 0.599 and 0.303 against 0.306. The same bits (GPU tests).
WG_SPLIT = True
# registers of each MMA partition under WG_SPLIT (setmaxnreg): the loader's LOADER_REGS and twice this fit the
# launch's 12 warps at MAXNREG (the first partition takes what is left, the same)
WG_REGS = {128: 176, 256: 200}
# Under WG_SPLIT each warpgroup stores its half tile in two pieces through a quarter-tile buffer, which leaves the
# 4-slot ring of STAGE_IN_RING. Tried and dropped (session 56; removed in session 68, last in e42b581): one piece
# through a half-tile buffer (a 3-slot ring), and the two warpgroups' epilogues taking turns through a pair of
# mbarriers; both measured slower (scripts/gather_path_probe.py --kernels wgsplit).
# SWAP_AB: under WG_SPLIT with 256 × 128 tiles (dW1: I = 2n from dH by TMA, J = d gathered), each warpgroup computes
# its half of the J columns against all 256 I rows, dW[e]ᵀ = Q-chunkᵀ · P-chunk, one m64 × 256 wgmma per k16 step
# instead of two m64 × 128 (each reading its A block and half the B box), and stores its pieces transposed. The
# loader, the ring and the store buffers are those of the default form; the same bits (GPU tests). Session 61 (H200s,
# benchmarks/results/2026-12-02_nvidia-h200_session61/): dW1 alone at (32768, 4096, 1024, 128, 8) 7.568 against 7.662
# ms in settled windows; the layer's forward+backward 35.33 against 35.53 ms (2 fresh-process rounds) and 35.78
# against 35.84 (5 rounds, faster in 3) on another machine; 7B 3.077 against 3.303 (3 rounds, noisy). dW2's tiles are
# 128 x 256 and already run one m64 x 256 chain per warpgroup. SONICMOE_WGRAD_SWAP_AB (1 or 0) overrides it
SWAP_AB = True
# Tried and dropped (sessions 58-59): an expert's last, partial chunk over its rows rounded up to 16 (one to four
# k16 steps under runtime branches). ptxas 12.8 reused descriptor registers set in a sibling branch (an out-of-bounds
# shared read on the GPU), and the 120B-n1024 layer was no faster (35.88 against 35.72 ms).


def wgrad_ws_smem_bytes(block_i: int, block_j: int, block_r: int, stages: int, elem: int = 2,
                        stage_in_ring: bool = False) -> int:
    """Shared memory of one program: the ring (a P chunk and a Q chunk per slot) and the output tile's buffer (its
    left half only under ``stage_in_ring``: the right half then lies in a ring slot)."""
    out = block_i * block_j // (2 if stage_in_ring else 1)
    return elem * (stages * block_r * (block_i + block_j) + out)


def swap_ab_applies(swap_ab: bool, wg_split: bool, block_i: int, block_j: int) -> bool:
    """Whether the warpgroups compute transposed products (:data:`SWAP_AB`): asked for, and the form that has them,
    the split warpgroups with 256 × 128 (I × J) tiles (dW1)."""
    return bool(swap_ab) and bool(wg_split) and (block_i, block_j) == (256, 128)


def half_tile_fits_slot(block_i: int, block_j: int, block_r: int) -> bool:
    """Whether half the output tile, (BLOCK_I, BLOCK_J / 2), fits the wider of a ring slot's two chunks (BLOCK_R
    rows of max(BLOCK_I, BLOCK_J))."""
    return block_j % 2 == 0 and block_r * max(block_i, block_j) >= block_i * block_j // 2


def wgrad_ws_config(i_dim: int, j_dim: int, p_gather: bool, block_r: int = BLOCK_R,
                    stage_in_ring: bool | None = None, wg_split: bool | None = None,
                    swap_ab: bool | None = None) -> dict | None:
    """{"BLOCK_I", "BLOCK_J", "BLOCK_R", "STAGE_IN_RING", "WG_SPLIT", "SWAP_AB", "STAGES", "MAXNREG"} for dW (E, I, J),
    or None where the kernel does not apply.

    ``swap_ab`` (default ``SONICMOE_WGRAD_SWAP_AB`` 1 or 0 where set, else :data:`SWAP_AB`): the warpgroups' transposed
    products, only in the split form with 256 × 128 tiles.

    The tile is 128 × 256 (I × J) or 256 × 128, the gathered operand's side 128 wide where both fit (its rows
    are the loader's work); STAGES is the deepest ring that fits shared memory beside the output buffer (at most
    MAX_STAGES). ``wg_split`` (default: ``SONICMOE_WGRAD_WG_SPLIT`` 1 or 0 where set, else :data:`WG_SPLIT`): the two
    MMA warpgroups as partitions of their own, each with half the tile's I rows and a store buffer for one of its
    two pieces (see :data:`WG_SPLIT`); then no staging in the ring. ``stage_in_ring`` (default:
    ``SONICMOE_WGRAD_STAGE_IN_RING`` 1 or 0 where set, else STAGE_IN_RING; only where :func:`half_tile_fits_slot`,
    and not with ``wg_split``): the tile's right half leaves through the ring slot of its last chunk, so the output
    buffer is half the tile. Both forms leave half a tile of buffers, so both have the same ring."""
    if wg_split is None:
        wg_split = env_switch("SONICMOE_WGRAD_WG_SPLIT", WG_SPLIT)
    if swap_ab is None:
        swap_ab = env_switch("SONICMOE_WGRAD_SWAP_AB", SWAP_AB)
    if stage_in_ring is None:
        stage_in_ring = env_switch("SONICMOE_WGRAD_STAGE_IN_RING", STAGE_IN_RING)
    shapes = ((256, 128), (128, 256)) if not p_gather else ((128, 256), (256, 128))
    for bi, bj in shapes:
        if i_dim > 0 and j_dim > 0 and i_dim % bi == 0 and j_dim % bj == 0:
            ring = stage_in_ring and half_tile_fits_slot(bi, bj, block_r) and not wg_split
            half = ring or wg_split
            base = wgrad_ws_smem_bytes(bi, bj, block_r, 0, stage_in_ring=half)
            per_stage = wgrad_ws_smem_bytes(bi, bj, block_r, 1, stage_in_ring=half) - base
            stages = min(MAX_STAGES, (SMEM_BUDGET - base) // per_stage)
            if stages >= 2:
                swap = swap_ab_applies(swap_ab, wg_split, bi, bj)
                return {"BLOCK_I": bi, "BLOCK_J": bj, "BLOCK_R": block_r, "STAGE_IN_RING": ring,
                        "WG_SPLIT": wg_split, "SWAP_AB": swap,
                        "STAGES": stages, "MAXNREG": MAXNREG[bi if swap else bj]}
    return None


if HAVE_GLUON:

    @gluon.jit
    def gather_ring_barriers(STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, CONSUMERS: gl.constexpr = 1):
        """The mbarriers of a ring of ``STAGES`` slots filled partly by TMA and partly by the ``cp.async`` of
        ``LOADER_WARPS`` loader warps (the Gluon kernels whose loaders gather rows): per slot ``tma_ready`` (one
        arrival plus the TMA bytes), ``cp_ready`` (every loader thread arrives once its copies have landed) and
        ``empty`` (the MMAs that read the slot are done: one arrival from each of ``CONSUMERS`` MMA partitions)."""
        tma_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        cp_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(tma_ready.index(i), count=1)
            mbarrier.init(cp_ready.index(i), count=LOADER_WARPS * 32)
            mbarrier.init(empty.index(i), count=CONSUMERS)
        return tma_ready, cp_ready, empty

    @gluon.jit
    def invalidate_ring_barriers(tma_ready, cp_ready, empty, STAGES: gl.constexpr):
        """Invalidate the barriers of :func:`gather_ring_barriers` at the kernel's end."""
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(tma_ready.index(i))
            mbarrier.invalidate(cp_ready.index(i))
            mbarrier.invalidate(empty.index(i))

    @gluon.jit
    def wait_gathered_slot(tma_ready, cp_ready, step, STAGES: gl.constexpr):
        """Wait until ring step ``step``'s slot is full (its TMA bytes and every loader thread's copies), make the
        ``cp.async`` writes (generic proxy) visible to the wgmma's reads (async proxy), and return the slot."""
        s = step % STAGES
        ph = (step // STAGES) & 1
        mbarrier.wait(tma_ready.index(s), ph)
        mbarrier.wait(cp_ready.index(s), ph)
        fence_async_shared()
        return s

    @gluon.jit
    def _tile(tile, offsets_ptr, order_ptr, tiles_j, tiles_per_e, BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr,
              LOAD_ORDER: gl.constexpr = False):
        """(expert, first row, end row, I offset, J offset) of tile ``tile``: the experts' tiles in index order, or
        under ``LOAD_ORDER`` in the order of ``order_ptr`` (:func:`sonicmoe.ops.load_order.expert_load_order`:
        busiest expert first; one more dependent load per tile, which index order does without)."""
        q = tile // tiles_per_e
        if LOAD_ORDER:
            e = gl.load(order_ptr + q)
        else:
            e = q
        t = tile - q * tiles_per_e
        ti = t // tiles_j
        return (e, gl.load(offsets_ptr + e), gl.load(offsets_ptr + e + 1), ti * BLOCK_I,
                (t - ti * tiles_j) * BLOCK_J)

    @gluon.jit
    def _tile_range(total_tiles, LOAD_ORDER: gl.constexpr):
        """(start, end, step) of the loop over this program's tiles, whose ``it``-th value :func:`_nth_tile` maps to
        a tile: in index order the tiles pid, pid + P, ... themselves (P programs); under ``LOAD_ORDER``
        0 .. the program's tile count (:func:`program_tiles`, serpentine): one per wave of P tiles, and one of the
        last, partial wave where its slot there is one."""
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        if LOAD_ORDER:
            full = total_tiles // nprog
            rem = total_tiles - full * nprog
            odd = full % 2
            in_last = ((odd == 0) & (pid < rem)) | ((odd == 1) & (pid >= nprog - rem))
            return 0, full + in_last.to(gl.int32), 1
        else:
            return pid, total_tiles, nprog

    @gluon.jit
    def _nth_tile(it, LOAD_ORDER: gl.constexpr):
        """The tile of loop value ``it`` (:func:`_tile_range`): ``it`` itself in index order; under ``LOAD_ORDER``
        wave it's slot pid, or in the odd waves slot P − 1 − pid (dealt serpentine)."""
        if LOAD_ORDER:
            pid = gl.program_id(0)
            nprog = gl.num_programs(0)
            return it * nprog + pid + (it % 2) * (nprog - 1 - 2 * pid)
        else:
            return it

    @gluon.jit
    def _copy_rows(buf, base_ptr, rows, row_ok, col0, stride, layout: gl.constexpr):
        """cp.async of rows ``rows`` (int64 row indices, (BLOCK_R,) in ``layout``'s row slice) of a row-major
        operand, columns [col0, col0 + buf's width), into ``buf``; rows where ``row_ok`` is False are zero-filled."""
        W: gl.constexpr = buf.shape[1]
        cols = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, layout))
        ptrs = base_ptr + rows[:, None] * stride + cols[None, :]
        async_copy.async_copy_global_to_shared(buf, ptrs, mask=row_ok[:, None] & (cols >= 0)[None, :])

    @gluon.jit
    def _loader(p_ptr, p_desc, q_ptr, q_desc, row_token_ptr, offsets_ptr, order_ptr, p_bufs, q_bufs, tma_ready,
                cp_ready, empty, total_tiles, tiles_j, tiles_per_e, stride_p, stride_q, P_GATHER: gl.constexpr,
                BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr, BLOCK_R: gl.constexpr, STAGES: gl.constexpr,
                WARPS: gl.constexpr, MIN_CHUNKS: gl.constexpr = 0, LOAD_ORDER: gl.constexpr = False):
        """Loader partition: every chunk of every tile of this program into the next ring slot, once the MMA
        that read the slot's previous chunk is done. A tile has at least MIN_CHUNKS chunks (an expert with no rows
        then gets one chunk of zeros)."""
        TPI: gl.constexpr = BLOCK_I // 8 if BLOCK_I < 256 else 32  # threads along a row: 16 bytes each
        TPJ: gl.constexpr = BLOCK_J // 8 if BLOCK_J < 256 else 32
        lp: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPI, TPI], [WARPS, 1], [1, 0])
        lq: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPJ, TPJ], [WARPS, 1], [1, 0])
        lg: gl.constexpr = lp if P_GATHER else lq
        offs_g = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, lg))
        offs_p = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, lp))
        offs_q = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, lq))
        CHUNK_BYTES: gl.constexpr = BLOCK_R * (BLOCK_J if P_GATHER else BLOCK_I) * 2
        step = 0
        start, end, stride = _tile_range(total_tiles, LOAD_ORDER)
        for it in range(start, end, stride):
            tile = _nth_tile(it, LOAD_ORDER)
            e, lo, hi, i0, j0 = _tile(tile, offsets_ptr, order_ptr, tiles_j, tiles_per_e, BLOCK_I, BLOCK_J, LOAD_ORDER)
            full = (hi - lo) // BLOCK_R
            chunks = gl.maximum((hi - lo + BLOCK_R - 1) // BLOCK_R, MIN_CHUNKS)
            rg = lo + offs_g
            tok_next = gl.load(row_token_ptr + rg, mask=rg < hi, other=0)
            for c in range(chunks):
                r0 = lo + c * BLOCK_R
                rg = r0 + offs_g
                tok = tok_next.to(gl.int64)
                rn = rg + BLOCK_R
                tok_next = gl.load(row_token_ptr + rn, mask=rn < hi, other=0)  # the next chunk's, in flight
                s = step % STAGES
                mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)
                if c < full:  # a whole chunk: the contiguous operand by TMA
                    mbarrier.expect(tma_ready.index(s), CHUNK_BYTES)
                    if P_GATHER:
                        tma.async_copy_global_to_shared(q_desc, [r0, j0], tma_ready.index(s), q_bufs.index(s))
                    else:
                        tma.async_copy_global_to_shared(p_desc, [r0, i0], tma_ready.index(s), p_bufs.index(s))
                else:  # the expert's last, partial chunk: rows past its end zero-filled in both operands
                    if P_GATHER:
                        rq = r0 + offs_q
                        _copy_rows(q_bufs.index(s), q_ptr, rq.to(gl.int64), rq < hi, j0, stride_q, lq)
                    else:
                        rp = r0 + offs_p
                        _copy_rows(p_bufs.index(s), p_ptr, rp.to(gl.int64), rp < hi, i0, stride_p, lp)
                    mbarrier.arrive(tma_ready.index(s))
                if P_GATHER:
                    _copy_rows(p_bufs.index(s), p_ptr, tok, rg < hi, i0, stride_p, lp)
                else:
                    _copy_rows(q_bufs.index(s), q_ptr, tok, rg < hi, j0, stride_q, lq)
                # fires once this thread's copies have landed (the barrier counts every loader thread)
                async_copy.mbarrier_arrive(cp_ready.index(s), increment_count=False)
                step += 1

    @gluon.jit
    def _mma(p_bufs, q_bufs, tma_ready, cp_ready, empty, out_smem, out_desc, offsets_ptr, order_ptr, total_tiles,
             tiles_j, tiles_per_e, I, BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr, BLOCK_R: gl.constexpr,
             STAGES: gl.constexpr, WARPS: gl.constexpr, PART: gl.constexpr, STAGE_IN_RING: gl.constexpr,
             LOAD_ORDER: gl.constexpr = False):
        """MMA partition: each tile's wgmma chain over the ring (one MMA in flight; the slot before it goes back
        to the loader), then the tile by TMA store from ``out_smem``. Under STAGE_IN_RING every tile has at least
        one chunk (zeros for an expert with no rows), ``out_smem`` holds the tile's left half, the right half goes
        through the slot of the tile's last chunk (the wider of its two chunks), and that slot goes back to the
        loader once the right half's store has read it. ``PART`` 1 (probes only): the tile is not
        written, which times the kernel without its epilogue (the store stays behind a condition that never holds,
        so the MMAs stay)."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BLOCK_J, 16])
        MIN_CHUNKS: gl.constexpr = 1 if STAGE_IN_RING else 0
        step = 0
        start, end, stride = _tile_range(total_tiles, LOAD_ORDER)
        for it in range(start, end, stride):
            tile = _nth_tile(it, LOAD_ORDER)
            e, lo, hi, i0, j0 = _tile(tile, offsets_ptr, order_ptr, tiles_j, tiles_per_e, BLOCK_I, BLOCK_J, LOAD_ORDER)
            chunks = gl.maximum((hi - lo + BLOCK_R - 1) // BLOCK_R, MIN_CHUNKS)
            acc = gl.zeros((BLOCK_I, BLOCK_J), dtype=gl.float32, layout=acc_layout)
            for c in range(chunks):
                s = wait_gathered_slot(tma_ready, cp_ready, step, STAGES)
                acc = warpgroup_mma(p_bufs.index(s).permute((1, 0)), q_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=c > 0)
                step += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            last = (step + STAGES - 1) % STAGES  # the slot of the tile's last chunk
            if not STAGE_IN_RING:
                mbarrier.arrive(empty.index(last), pred=chunks > 0)
                if PART == 0:
                    _store_tile(acc, out_smem, out_desc, e * I + i0, j0)
                elif I < 0:
                    _store_tile(acc, out_smem, out_desc, e * I + i0, j0)
            else:
                if BLOCK_I >= BLOCK_J:
                    wide = p_bufs.index(last)
                else:
                    wide = q_bufs.index(last)
                stage = wide._reinterpret(out_desc.dtype, [BLOCK_I, BLOCK_J // 2], out_desc.layout)
                if PART == 0:
                    _store_halves(acc, out_smem, stage, out_desc, e * I + i0, j0)
                elif I < 0:
                    _store_halves(acc, out_smem, stage, out_desc, e * I + i0, j0)
                mbarrier.arrive(empty.index(last))
        tma.store_wait(pendings=0)

    @gluon.jit
    def _mma_half(p_bufs, q_bufs, tma_ready, cp_ready, empty, out_smem, out_desc, offsets_ptr, order_ptr, total_tiles,
                  tiles_j, tiles_per_e, I, BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr, BLOCK_R: gl.constexpr,
                  STAGES: gl.constexpr, HALF: gl.constexpr, PART: gl.constexpr, SWAP_AB: gl.constexpr = False,
                  LOAD_ORDER: gl.constexpr = False):
        """MMA partition of one warpgroup (``WG_SPLIT``): rows [HALF·BLOCK_I/2, (HALF+1)·BLOCK_I/2) of every tile
        of this program, over the ring the other warpgroup reads too (each slot goes back to the loader once both
        have arrived on its ``empty`` barrier), then that half tile by two TMA stores through
        ``out_smem.index(HALF)`` (a (BLOCK_I/2, BLOCK_J/2) buffer).
        The two warpgroups are in step only through the ring: while one writes its half tile, the other can run up
        to STAGES − 1 chunks ahead at the whole tensor-core rate. The same k-steps in the same order as :func:`_mma`:
        the same bits.
        ``SWAP_AB`` (:data:`SWAP_AB`; BLOCK_I = 256, BLOCK_J = 128): the warpgroup computes the
        transposed half tile instead, dW[e]ᵀ for its half of the J columns, (BLOCK_J/2, BLOCK_I) = Q-chunkᵀ · P-chunk,
        one m64 × 256 wgmma per k16 step in place of two m64 × 128 ones (a sixth less shared memory read per FLOP),
        and stores its two (BLOCK_I/2, BLOCK_J/2) pieces transposed."""
        HI: gl.constexpr = BLOCK_I // 2
        HJ: gl.constexpr = BLOCK_J // 2
        if SWAP_AB:
            acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                 instr_shape=[16, BLOCK_I, 16])
            ACC_M: gl.constexpr = HJ
            ACC_N: gl.constexpr = BLOCK_I
        else:
            acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                 instr_shape=[16, BLOCK_J, 16])
            ACC_M: gl.constexpr = HI
            ACC_N: gl.constexpr = BLOCK_J
        buf = out_smem.index(HALF)
        step = 0
        start, end, stride = _tile_range(total_tiles, LOAD_ORDER)
        for it in range(start, end, stride):
            tile = _nth_tile(it, LOAD_ORDER)
            e, lo, hi, i0, j0 = _tile(tile, offsets_ptr, order_ptr, tiles_j, tiles_per_e, BLOCK_I, BLOCK_J, LOAD_ORDER)
            chunks = (hi - lo + BLOCK_R - 1) // BLOCK_R
            acc = gl.zeros((ACC_M, ACC_N), dtype=gl.float32, layout=acc_layout)
            for c in range(chunks):
                s = wait_gathered_slot(tma_ready, cp_ready, step, STAGES)
                if SWAP_AB:
                    a = q_bufs.index(s).slice(HALF * HJ, HJ, dim=1).permute((1, 0))
                    acc = warpgroup_mma(a, p_bufs.index(s), acc, is_async=True)
                else:
                    a = p_bufs.index(s).slice(HALF * HI, HI, dim=1).permute((1, 0))
                    acc = warpgroup_mma(a, q_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=c > 0)
                step += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=chunks > 0)
            if SWAP_AB:
                row = e * I + i0
                col = j0 + HALF * HJ
            else:
                row = e * I + i0 + HALF * HI
                col = j0
            if PART == 0:
                _store_pieces(acc, buf, out_desc, row, col, SWAP_AB)
            elif I < 0:
                _store_pieces(acc, buf, out_desc, row, col, SWAP_AB)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _store_pieces(acc, buf, out_desc, row, col, TRANS: gl.constexpr = False):
        """The register tile ``acc`` to ``out_desc`` at (row, col) by TMA stores through the one buffer ``buf``: its
        two column halves in turn, each written once the buffer's previous store has read it. ``TRANS``: ``acc`` is
        the transposed tile; each column half is written transposed, the second at (row + its width, col)."""
        W: gl.constexpr = acc.shape[1] // 2
        tma.store_wait(pendings=0)
        gl.thread_barrier()
        left, right = column_halves(acc)
        _store_piece(left, buf, out_desc, row, col, TRANS)
        tma.store_wait(pendings=0)
        gl.thread_barrier()
        if TRANS:
            _store_piece(right, buf, out_desc, row + W, col, TRANS)
        else:
            _store_piece(right, buf, out_desc, row, col + W, TRANS)

    @gluon.jit
    def _store_piece(piece, buf, out_desc, row, col, TRANS: gl.constexpr):
        """One piece (transposed with ``TRANS``) into ``buf``, whose previous store has read it, then its TMA store
        to ``out_desc`` at (row, col), once every thread's writes are visible to the async proxy."""
        if TRANS:
            buf.store(piece.to(out_desc.dtype).permute((1, 0)))
        else:
            buf.store(piece.to(out_desc.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(out_desc, [row, col], buf)

    @gluon.jit
    def _store_halves(acc, out_smem, stage, out_desc, row, col):
        """The tile ``acc`` to ``out_desc`` (whose box is half the tile, (BLOCK_I, BLOCK_J / 2)) at (row, col) by two
        TMA stores: the right half from ``stage`` (a ring slot), then the left half from ``out_smem`` once its
        previous store has read it; returns once the right half's store has read ``stage`` and every thread is past
        its writes, so the slot can go back to the loader."""
        W: gl.constexpr = acc.shape[1] // 2
        left, right = column_halves(acc)
        stage.store(right.to(out_desc.dtype))
        tma.store_wait(pendings=0)
        out_smem.store(left.to(out_desc.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(out_desc, [row, col + W], stage)
        tma.async_copy_shared_to_global(out_desc, [row, col], out_smem)
        tma.store_wait(pendings=1)
        gl.thread_barrier()

    @gluon.jit
    def _store_tile(acc, out_smem, out_desc, row, col):
        """The tile ``acc`` to ``out_desc`` at (row, col) by TMA store from ``out_smem``, once the buffer's previous
        store has finished reading it."""
        tma.store_wait(pendings=0)
        out_smem.store(acc.to(out_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [row, col], out_smem)

    @gluon.jit
    def _wgrad_ws_kernel(p_ptr, p_desc, q_ptr, q_desc, out_desc, row_token_ptr, offsets_ptr, order_ptr, total_tiles,
                         tiles_j, tiles_per_e, I, stride_p, stride_q, P_GATHER: gl.constexpr, P_LAYOUT: gl.constexpr,
                         Q_LAYOUT: gl.constexpr, BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr,
                         BLOCK_R: gl.constexpr, STAGES: gl.constexpr, MMA_WARPS: gl.constexpr,
                         LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, PART: gl.constexpr,
                         STAGE_IN_RING: gl.constexpr, WG_SPLIT: gl.constexpr = False, WG_REGS: gl.constexpr = 0,
                         SWAP_AB: gl.constexpr = False, LOAD_ORDER: gl.constexpr = False):
        dtype: gl.constexpr = p_ptr.dtype.element_ty
        p_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_R, BLOCK_I], P_LAYOUT)
        q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_R, BLOCK_J], Q_LAYOUT)
        tma_ready, cp_ready, empty = gather_ring_barriers(STAGES, LOADER_WARPS, 2 if WG_SPLIT else 1)
        if WG_SPLIT:
            out_smem = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout)
            gl.warp_specialize([
                (_mma_half, (p_bufs, q_bufs, tma_ready, cp_ready, empty, out_smem, out_desc, offsets_ptr, order_ptr,
                             total_tiles, tiles_j, tiles_per_e, I, BLOCK_I, BLOCK_J, BLOCK_R, STAGES, 0, PART,
                             SWAP_AB, LOAD_ORDER)),
                (_mma_half, (p_bufs, q_bufs, tma_ready, cp_ready, empty, out_smem, out_desc, offsets_ptr, order_ptr,
                             total_tiles, tiles_j, tiles_per_e, I, BLOCK_I, BLOCK_J, BLOCK_R, STAGES, 1, PART,
                             SWAP_AB, LOAD_ORDER)),
                (_loader, (p_ptr, p_desc, q_ptr, q_desc, row_token_ptr, offsets_ptr, order_ptr, p_bufs, q_bufs,
                           tma_ready, cp_ready, empty, total_tiles, tiles_j, tiles_per_e, stride_p, stride_q, P_GATHER,
                           BLOCK_I, BLOCK_J, BLOCK_R, STAGES, LOADER_WARPS, 0, LOAD_ORDER)),
            ], [4, LOADER_WARPS], [WG_REGS, LOADER_REGS])
        else:
            out_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
            gl.warp_specialize([
                (_mma, (p_bufs, q_bufs, tma_ready, cp_ready, empty, out_smem, out_desc, offsets_ptr, order_ptr,
                        total_tiles, tiles_j, tiles_per_e, I, BLOCK_I, BLOCK_J, BLOCK_R, STAGES, MMA_WARPS, PART,
                        STAGE_IN_RING, LOAD_ORDER)),
                (_loader, (p_ptr, p_desc, q_ptr, q_desc, row_token_ptr, offsets_ptr, order_ptr, p_bufs, q_bufs,
                           tma_ready, cp_ready, empty, total_tiles, tiles_j, tiles_per_e, stride_p, stride_q, P_GATHER,
                           BLOCK_I, BLOCK_J, BLOCK_R, STAGES, LOADER_WARPS, 1 if STAGE_IN_RING else 0,
                           LOAD_ORDER)),
            ], [LOADER_WARPS], [LOADER_REGS])
        invalidate_ring_barriers(tma_ready, cp_ready, empty, STAGES)


_CALLS: dict[tuple, dict] = {}


def wgrad_ws_calls() -> list[dict]:
    """The shapes this process ran through :func:`wgrad_ws` (I, J, E, dtype, which operand gathered) with their
    config; benchmarks and tests read it (host bookkeeping, no sync)."""
    return [{"I": i, "J": j, "E": e, "dtype": dt, "p_gather": pg, "config": cfg}
            for (i, j, e, dt, pg), cfg in _CALLS.items()]


def wgrad_ws_enabled() -> bool:
    """:func:`sonicmoe.ops.grouped_gemm_ws.ws_enabled` (``SONICMOE_GLUON=0`` turns every Gluon kernel off), and
    ``SONICMOE_GLUON_WGRAD=0`` turns off this one alone; ``all`` keeps it on and has the layer use it at every expert
    width (``library.gluon_wgrad_preferred``). Read at each call; any other value raises ValueError
    (:func:`sonicmoe.ops.grouped_gemm_ws.gluon_kernel_switch`)."""
    return gluon_kernel_switch("SONICMOE_GLUON_WGRAD") != "0" and ws_enabled()


def wgrad_ws_supported(p: torch.Tensor, q: torch.Tensor, *, p_gather: bool, q_gather: bool,
                       out_dtype: torch.dtype) -> bool:
    """Whether :func:`wgrad_ws` serves this weight gradient (host checks only, no sync).

    True on an sm_90 GPU with Gluon (:func:`wgrad_ws_enabled`) for bf16/fp16 contiguous, 16-byte aligned
    operands of one dtype and an output of that dtype, exactly one operand gathered, and I, J multiples of a tile
    (:func:`wgrad_ws_config`).
    """
    if p_gather == q_gather or not wgrad_ws_enabled() or not p.is_cuda or p.dtype not in _GL_DTYPES:
        return False
    if q.dtype != p.dtype or out_dtype != p.dtype or p.dim() != 2 or q.dim() != 2:
        return False
    if not (p.is_contiguous() and q.is_contiguous()) or wgrad_ws_config(p.shape[1], q.shape[1], p_gather) is None:
        return False
    if torch.cuda.get_device_capability(p.device) != (9, 0):
        return False
    return p.data_ptr() % 16 == 0 and q.data_ptr() % 16 == 0


def program_tiles(total_tiles: int, num_programs: int, serpentine: bool) -> list[list[int]]:
    """The tiles each program of the persistent kernel runs, in its order (the host twin of the kernel's
    ``_tile_count`` / ``_nth_tile``; 0 < num_programs <= total_tiles). Wave w holds tiles [w·P, (w+1)·P), P the
    programs; program p runs slot p of every wave, or with ``serpentine`` slot P − 1 − p of the odd waves, so that a
    program that drew one of the longest tiles of a wave draws one of the shortest of the next (the experts' tiles
    run in load order, longest first: :func:`sonicmoe.ops.load_order.expert_load_order`)."""
    out = [[] for _ in range(num_programs)]
    for tile in range(total_tiles):
        w, slot = divmod(tile, num_programs)
        out[num_programs - 1 - slot if serpentine and w % 2 else slot].append(tile)
    return out


def wgrad_ws(p: torch.Tensor, q: torch.Tensor, row_token: torch.Tensor, expert_offsets: torch.Tensor, *,
             p_gather: bool, config: dict | None = None, expert_order: torch.Tensor | None = None) -> torch.Tensor:
    """dW (E, I, J) = Σ_{rows r of e} P[p(r)]ᵀ Q[q(r)] by the warp-specialised kernel (see the module doc).

    The caller has checked :func:`wgrad_ws_supported` (exactly one operand gathered: Q when not ``p_gather``).

    Args:
        p: (T or R, I) bf16/fp16, contiguous; rows gathered by ``row_token`` when ``p_gather``.
        q: (T or R, J), p's dtype; rows gathered when not ``p_gather``.
        row_token: (R,) int32 token of each routed row. expert_offsets: (E+1,) int32 exclusive prefix sum of the
            per-expert row counts.
        config: {"BLOCK_I", "BLOCK_J", "BLOCK_R", "STAGES"} and optionally "STAGE_IN_RING" (the tile's right half
            through a ring slot; only where :func:`half_tile_fits_slot` holds), "WG_SPLIT" with "SWAP_AB"
            and "WG_REGS" (the two MMA warpgroups as partitions of their own; :data:`WG_SPLIT`,
            :data:`SWAP_AB`),
            "MAXNREG", "LOADER_WARPS", "LOADER_REGS", "PART" (probes: 1 skips the output) (default
            :func:`wgrad_ws_config`).
        expert_order: (2·E,) int32, the order the experts' tiles run in and each expert's place in it
            (:func:`sonicmoe.ops.load_order.expert_load_order`, busiest first: the layer's
            ``SONICMOE_WGRAD_ORDER=load``), the waves of tiles then dealt to the programs alternately forwards and
            backwards (:func:`program_tiles`); ``None``: expert index order, dealt round-robin. The bits do not
            depend on it.
    Returns:
        (E, I, J) in p's dtype (float32 accumulation); experts with no rows get zeros; no atomics, the same bits
        on every run.
    Raises:
        ValueError: ``expert_order`` not a (2·E,) int32 tensor on p's device.
    """
    e = expert_offsets.shape[0] - 1
    if expert_order is not None and (expert_order.shape != (2 * e,) or expert_order.dtype != torch.int32
                                     or expert_order.device != p.device):
        raise ValueError(f"expert_order: expected a ({2 * e},) int32 tensor on {p.device} "
                         f"(sonicmoe.ops.load_order.expert_load_order), got {tuple(expert_order.shape)} "
                         f"{expert_order.dtype} on {expert_order.device}")
    i_dim, j_dim = p.shape[1], q.shape[1]
    cfg = config or wgrad_ws_config(i_dim, j_dim, p_gather)
    bi, bj, br = cfg["BLOCK_I"], cfg["BLOCK_J"], cfg["BLOCK_R"]
    out = new_output((e, i_dim, j_dim), device=p.device, dtype=p.dtype)
    tiles_j = j_dim // bj
    tiles_per_e = (i_dim // bi) * tiles_j
    total = e * tiles_per_e
    if total == 0:
        return out
    if p.shape[0] == 0 or q.shape[0] == 0:  # no routed rows (a TMA descriptor needs one): every expert gets zeros
        return out.zero_()
    _CALLS[(i_dim, j_dim, e, str(p.dtype).removeprefix("torch."), p_gather)] = dict(cfg)
    p_layout, q_layout = shared_layout((br, bi), p.dtype), shared_layout((br, bj), p.dtype)
    ring = bool(cfg.get("STAGE_IN_RING", False))
    split = bool(cfg.get("WG_SPLIT", False))
    # the warpgroups' transposed products where the config asks for them and the form has them (wgrad_ws_config)
    swap = swap_ab_applies(cfg.get("SWAP_AB", False), split, bi, bj)
    wide = bi if swap else bj  # the wgmma's N: the accumulator's width
    # the output descriptor's box: a store piece of a warpgroup's half tile, half the tile, or the whole tile
    box = [bi // 2, bj // 2] if split else [bi, bj // 2 if ring else bj]
    launch_kernel(
        _wgrad_ws_kernel, (min(total, sm_count(p.device)),),
        p, None if p_gather else _descriptor(p, [br, bi]), q, _descriptor(q, [br, bj]) if p_gather else None,
        _descriptor(out.view(e * i_dim, j_dim), box), row_token, expert_offsets,
        expert_offsets if expert_order is None else expert_order, total, tiles_j,
        tiles_per_e, i_dim, p.stride(0), q.stride(0), P_GATHER=p_gather, P_LAYOUT=p_layout,
        Q_LAYOUT=q_layout, BLOCK_I=bi, BLOCK_J=bj, BLOCK_R=br, STAGES=cfg["STAGES"], MMA_WARPS=MMA_WARPS,
        LOADER_WARPS=cfg.get("LOADER_WARPS", LOADER_WARPS), LOADER_REGS=cfg.get("LOADER_REGS", LOADER_REGS),
        PART=cfg.get("PART", 0), STAGE_IN_RING=ring, WG_SPLIT=split, WG_REGS=cfg.get("WG_REGS", WG_REGS[wide]),
        SWAP_AB=swap, LOAD_ORDER=expert_order is not None, num_warps=4 if split else MMA_WARPS,
        maxnreg=cfg.get("MAXNREG", MAXNREG[wide]))
    return out
