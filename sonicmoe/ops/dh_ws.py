"""Warp-specialised dH kernel for Hopper, in Gluon: gather-fused dA′ GEMM with the SwiGLU (or gpt-oss's clamped
SwiGLU) backward, A′ and the dS partials in the epilogue (SPEC §4 kernel 1).

The same outputs as :func:`sonicmoe.ops.dh.dh` — for the rows r of expert e (token t, score s):
dA′[r] = dO_t W2[e]; A = silu(gate(H[r])) · up(H[r]); dS partials of ⟨dA′[r], A[r]⟩; dA = s · dA′;
dH = (dA · up · silu′(gate), dA · silu(gate)); A′ = s · A — for the concat gate/up layout. With
``activation="clamped_swiglu"`` A and dH are gpt-oss's (:func:`sonicmoe.ops.kernel_lib.gated_act_bwd`'s values).

Why a second kernel: the Triton kernel (one 128 × 256 tile per program, 8 warps) spends much of each tile in its
epilogue while the tensor cores idle; on an H100 it runs the 7B shape at 288 TFLOP/s against 450-500 for the layer's
other GEMMs (benchmarks/results/2026-11-25_nvidia-h100_session25/). Here each persistent program splits its warps
by role:

* a **loader** (four warps) walks the program's tiles: per K-block, the tile's BLOCK_M gathered dO rows by 16-byte
  ``cp.async`` (rows past the expert's end zero-filled) and W2[e]'s (BLOCK_K × BLOCK_N) box by TMA, into a ring
  of ``STAGES`` slots (the barriers of :func:`sonicmoe.ops.weight_grad_ws.gather_ring_barriers`), running ahead
  into the next tile while the MMA warps run this one's epilogue;
* the **MMA warps** (two warpgroups, BLOCK_M = 128 rows) start each tile by asking TMA for H's gate and up columns
  of the epilogue's first NBUF EPI-channel blocks, run the asynchronous wgmma chain of the tile, then the epilogue
  on BLOCK_N / EPI column blocks in turn: each block waits for its H block, reads it, hands the buffer back to TMA
  for the block NBUF ahead, computes, adds its dS partial to the rows' running sum (stored once per tile, after
  the last block) and writes dH's gate and up blocks and A′ into one
  of two staging sets in shared memory; full tiles' blocks leave by TMA stores (``TMA_STORE``), which drain while
  the next two blocks compute; an expert's last, partial tile's leave by masked 16-byte stores.

Where the time goes (the ``PART`` config, 7B shape, H100, session 25): the MMAs alone 0.302 ms (512 TFLOP/s), all
but the global stores of dH and A′ 0.412, the whole kernel 0.542-0.553 (the Triton kernel 0.537-0.542). The
epilogue runs after each tile's MMAs, not beside them. Tried and dropped (session 26,
benchmarks/results/2026-11-25_nvidia-h100_session26/): a ping-pong form, two consumer warpgroups on alternate
(128, 128) tiles so that one's epilogue runs beside the other's MMAs: bitwise right, but 0.87 ms at 7B against
0.53 and 5.4 ms against 4.3-4.4 at (32768, 4096, 1024, 128, 8). Its 128-wide tiles gather every dO row twice as
often as the 256-wide ones. Staging the outputs apart from H's buffers (this form) instead of through them, which
let each block wait for its own stores before TMA could refill the buffer, measured 0.530 against 0.534 ms at 7B
and the same at (32768, 4096, 1024, 128, 8). Nsight Compute on that form at 7B: 518 µs, DRAM 62% of peak
(2.08 TB/s), L2 hit rate 60%, SM throughput 32%, no eligible warp in 80% of cycles, 62% of the warps' stall cycles
waiting on global loads. Loading each tile's row scores before its MMAs instead of in every epilogue block (one
load per tile off the epilogue's path) then took 7B to 0.512 ms against 0.538 for the Triton kernel, and all but
the stores (``PART`` 2) measured 0.410 before it: the stores' 120 µs is what remains to hide.
Session 40 (benchmarks/results/2026-11-27_nvidia-h100-h200_session40/, the patch there) handed dA′ to the epilogue
through shared memory as float32 so that the MMA warps could go on to the next tile: an epilogue partition of its own
(16 warps cap every thread at 128 registers, too few for a 256-wide accumulator, so 128-wide tiles: 7B 0.482 against
0.452 ms on an H200), or the epilogue folded into the loader partition (256-wide tiles; the ring starves: 0.76-0.80
against 0.51 ms on an H100). Both were bitwise right and slower, and were dropped. Its Nsight Compute profile at 7B
(same folder, ``call4_*``) puts most warp stall samples on ring waits: the MMA warps on full slots (gathered dO
20.5%, W2 8.2%), the loader on empty ones (24.5%). Six 32-deep slots (``block_k=32``) ran the kernel alone 2% faster
at 7B, level at d = 4096, and level in the layer: the default stays 64.

Session 45 (benchmarks/results/2026-11-27_nvidia-h100-h200_session45/, the patch there) built the epilogue partition
at 256-wide tiles after all: the register limit is one 256-wide wgmma instruction, not the accumulator, so two
128-wide wgmmas on the halves of the W2 box fit once ``setmaxnreg`` gives the MMA warps 176 (the epilogue 112, the
loader 40). Bitwise right, and slower on an H200: 7B 0.462 against 0.432 ms, (32768, 4096, 1024, 128, 8) 4.80 against
4.22. Its MMAs, ring (six 32-deep slots) and hand-over alone took 0.31 ms; the four epilogue warps take about as long
per tile as the MMAs, and a full overlap needs a second 64 KiB dA′ half-buffer, which leaves three ring slots (the
MMAs alone then 0.39 ms). With the second half in the ring slots of the tile's last three K-blocks instead (full
overlap, the ring three slots short while the epilogue reads them) it took 0.530: four warps with 16-byte stores run
the epilogue at about 25 µs per tile, against about 12 for the eight MMA warps with TMA stores here, and the slots
they hold starve the MMAs meanwhile.

Session 60 (benchmarks/results/2026-12-02_nvidia-h200_session60/, the patch there) handed each tile's whole dA′ over
(MMA warps on two 128-wide chains, four epilogue warps with H three steps ahead): as float32 (128 KiB, four 32-deep
ring slots) 4.63 against 4.38 ms at (32768, 4096, 1024, 128, 8); rounded to bf16 (64 KiB, three 64-deep slots, the
main loop under 1% slower) 4.19, but dH then 2.8e-3 from the float32 form's, and still bound by the four warps (about
65 µs per tile against 59 for the MMAs). Half a tile to the partition (the right half as float32, the left half's
epilogue in the MMA warps at EPI 16): the same bits, 4.50 against 4.36 ms, and the layer no faster. Dropped.

Session 41 (benchmarks/results/2026-11-27_nvidia-h100-h200_session41/) put the two staging sets in the ring slot of the
tile's last K-block (``STAGE_IN_RING``): that slot holds them once its MMA is done, and goes back to the loader
once the tile's TMA stores have read it. The 80 KB of H buffers and staging sets then shrink to 32 KB, and a fourth
48 KB slot fits: at 7B on an H100 the kernel alone took 0.475 against 0.508 ms (the MMAs alone 0.283 against 0.292),
with the same bits.

Tiles are (M-tile, N-tile) pairs, N fastest, from the table of :func:`sonicmoe.ops.grouped_gemm_ws.tile_table`
(no host sync); program p takes tiles p, p + P, .... dH and A′ have the Triton kernel's bits (the same dA′
accumulation order and epilogue arithmetic; checked on every probed shape). dS leaves as float32 partial sums, one
row per N-tile, (n / BLOCK_N, R), each the tile's EPI-channel blocks added in block order in registers; the caller
reduces them in a fixed order: no atomics, the same bits on every run (not the Triton kernel's bits: its partials
are per 16 channels, summed in another order; relative difference about 1e-7). Until session 49 each EPI-channel
block stored its own partial row, (n / EPI, R): those stores cost the MMA warps a 40-byte stack at EPI = 32
(``benchmarks/resource_report.py``), gone with one store per tile. Where one tile spans all n channels of its rows
(``BLOCK_N`` = n: n = 256 at the 7B shape, :func:`ds_pairs_in_kernel`), ``ds_pairs`` has the kernel write that sum
as dS itself, in pair order and the scores' dtype (padding pairs 0): the bits of
:func:`sonicmoe.ops.score_grad.score_grad` on the partials, without that launch, the partials' buffer, or the side
stream it ran on beside dW2, whose persistent programs waited for its programs to leave the multiprocessors. Timed
(session 49, 7B, H200s, ``scripts/ds_pairs_probe.py``, medians of 7 alternating rounds whose spread is about ±5%): dH
with the scores' gradient 0.4365 against 0.4585 ms on one machine, 0.4232 against 0.4184 on another (after the
partials went to one row per tile). The layer against session 48's tree (session 50, 7B, one H200, 3 fresh-process
rounds; session 49's own A/Bs had run the new tree in both arms): 3.159 against 3.184 ms, faster in 2 of 3.

Served shapes (:func:`dh_ws_supported`): sm_90, bf16/fp16, the concat layout, d a multiple of BLOCK_K, n a multiple
of 128, contiguous 16-byte aligned operands, and in the layer only where it measured faster (:func:`dh_ws_preferred`:
256-wide tiles, n a multiple of 256, and n = 128); everything else runs the Triton kernel. Gluon kernels do not run
under Triton's interpreter: the kernel is tested on the GPU against the Triton kernel and the float32 reference
(tests/test_dh_ws.py).
"""

from __future__ import annotations

import torch

from ..routing import Routing
from .common import act_code, env_switch, new_output, sm_count
from .fast_launch import launch_kernel
from .grouped_gemm_ws import (
    _GL_DTYPES,
    HAVE_GLUON,
    _descriptor,
    gluon_kernel_switch,
    routing_tile_table,
    shared_layout,
    ws_enabled,
)
from .up_proj_ws import sigmoid_ftz
from .weight_grad_ws import gather_ring_barriers, invalidate_ring_barriers, wait_gathered_slot

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

    from .grouped_gemm_ws import column_halves
    from .up_proj_ws import _tile_of, clamped, gather_loader, sigmoid

BLOCK_M = 128  # two warpgroups of 64 rows
BLOCK_K = 64
EPI = 32  # channels per epilogue block (H's gate and up columns come in (BLOCK_M, EPI) boxes)
NBUF = 2  # H blocks in flight (buffers of a gate and an up box)
LOADER_WARPS = 4
LOADER_REGS = 80
MMA_WARPS = 8
MAXNREG = 168  # 12 warps x 32 x 168 <= 64 K registers; the accumulator (128 x 256 float32) takes 128
MAX_STAGES = 6
TMA_STORE = True  # full tiles' dH and A′ blocks leave by TMA stores (else by 16-byte pointer stores)
SMEM_BUDGET = 227 * 1024 - 1024  # dynamic shared memory of one program on sm_90, less the barriers
# the staging sets in the ring slot of the tile's last K-block (where one slot holds them): 4 ring slots instead of 3
# at 256-wide tiles; 7B on an H100 (session 41): the kernel alone 0.475 against 0.508 ms, the layer's forward+backward
# 3.428 against 3.470 ms (7 of 7 alternating rounds); (32768, 4096, 1024, 128, 8) level (4.016 against 4.026 ms).
# At that shape, staging of its own (3 slots) was 1.2% faster alone in settled 1.5 s windows (session 51: 4.200
# against 4.250 ms), but in session 52's fresh-process layer A/Bs (1000 ms windows) it was faster on one H100
# (34.725 against 34.865 ms, 3 of 4 rounds) and slower on another (35.00 against 34.89, 1 of 7): kept in the ring.
STAGE_IN_RING = True
# SIGMOID_FTZ: the epilogue recomputes A with the sigmoid by ex2.approx.ftz and rcp.approx.ftz
# (up_proj_ws.sigmoid): 4400 SASS instructions against 5424, the same bits but for gates in about (-88.7, -87.3)
# (with gpt-oss's clamped SwiGLU, whose sigmoid takes 1.702 g: gates in about (-52.1, -51.3)).
# Timed in session 58 (H200): alone 4.308 against 4.383 ms at (32768, 4096, 1024, 128, 8) and 0.430 against 0.439 ms
# at the 7B shape. SONICMOE_SIGMOID_FTZ (1 or 0) overrides it (up_proj_ws.sigmoid_ftz)
SIGMOID_FTZ = True


def dh_ws_block_n(n: int) -> int | None:
    """The tile's channel width: 256 where n is a multiple of it (dO rows gathered once per 256 channels), else
    128; None if n is not a multiple of 128."""
    if n % 256 == 0:
        return 256
    return 128 if n % 128 == 0 else None


def dh_ws_smem_bytes(stages: int, block_n: int, epi: int = EPI, nbuf: int = NBUF, elem: int = 2,
                     block_k: int = BLOCK_K, stage_in_ring: bool = False) -> int:
    """Shared memory of one program: the ring (a dO block and a W2 box per slot), the H buffers (a gate and an up
    box each) and two staging sets of the outputs (dH's gate and up blocks and A′'s), which take no bytes of their
    own under ``stage_in_ring`` (they then lie in a ring slot: :func:`stage_fits_slot`)."""
    staging = 0 if stage_in_ring else 2 * 3
    return elem * (stages * block_k * (BLOCK_M + block_n) + (2 * nbuf + staging) * BLOCK_M * epi)


def stage_fits_slot(block_n: int, epi: int = EPI, block_k: int = BLOCK_K) -> bool:
    """Whether one ring slot (a (BLOCK_M, BLOCK_K) dO block and a (BLOCK_K, BLOCK_N) W2 box) holds both staging
    sets, six (BLOCK_M, EPI) blocks: the dO block whole blocks of EPI columns, the W2 box the rest."""
    return block_k % epi == 0 and block_k // epi + (block_k * block_n) // (BLOCK_M * epi) >= 6


def dh_ws_config(n: int, epi: int = EPI, nbuf: int = NBUF, block_n: int | None = None,
                 block_k: int = BLOCK_K, stage_in_ring: bool | None = None) -> dict | None:
    """{"BLOCK_N" (default :func:`dh_ws_block_n`), "BLOCK_K", "EPI", "NBUF", "STAGE_IN_RING", "STAGES": the deepest
    ring that fits beside the H buffers and, unless they lie in a ring slot, the staging sets (at most MAX_STAGES
    slots of BLOCK_K = 64, the same bytes in slots of another depth)}, or None where n does not suit the kernel.

    ``stage_in_ring`` (default: ``SONICMOE_DH_STAGE_IN_RING`` 1 or 0 where set, else STAGE_IN_RING): the epilogue
    stages its outputs in the ring slot of the tile's last K-block, which goes back to the loader once the tile's
    stores have read it; honoured only where :func:`stage_fits_slot` holds. "SIGMOID_FTZ":
    :func:`sonicmoe.ops.up_proj_ws.sigmoid_ftz` of :data:`SIGMOID_FTZ`, the epilogue's sigmoid by the ftz forms."""
    bn = block_n or dh_ws_block_n(n)
    if bn is None or n % bn:
        return None
    if stage_in_ring is None:
        stage_in_ring = env_switch("SONICMOE_DH_STAGE_IN_RING", STAGE_IN_RING)
    alias = stage_in_ring and stage_fits_slot(bn, epi, block_k)
    fixed = dh_ws_smem_bytes(0, bn, epi, nbuf, block_k=block_k, stage_in_ring=alias)
    per_stage = dh_ws_smem_bytes(1, bn, epi, nbuf, block_k=block_k, stage_in_ring=alias) - fixed
    cap = MAX_STAGES * BLOCK_K // block_k
    return {"BLOCK_N": bn, "BLOCK_K": block_k, "EPI": epi, "NBUF": nbuf, "STAGE_IN_RING": alias,
            "STAGES": min(cap, (SMEM_BUDGET - fixed) // per_stage), "SIGMOID_FTZ": sigmoid_ftz(SIGMOID_FTZ)}


def dh_ws_enabled() -> bool:
    """:func:`sonicmoe.ops.grouped_gemm_ws.ws_enabled` (``SONICMOE_GLUON=0`` turns every Gluon kernel off), and
    ``SONICMOE_GLUON_DH`` (default 1) this one alone: 0 off, ``all`` wherever :func:`dh_ws_supported` holds
    (:func:`dh_ws_preferred`; 128-wide tiles too). Read at each call; any other value raises ValueError
    (:func:`sonicmoe.ops.grouped_gemm_ws.gluon_kernel_switch`)."""
    return gluon_kernel_switch("SONICMOE_GLUON_DH") != "0" and ws_enabled()


def dh_ws_preferred(n: int) -> bool:
    """Whether the layer runs this kernel where :func:`dh_ws_supported` holds: with 256-wide tiles (n a multiple of
    256) and at n = 128, where it was measured, or at every n under ``SONICMOE_GLUON_DH=all`` (128-wide tiles at
    n = 384, 640, ..., not measured).

    Measured on H100s, the kernel alone (``scripts/dh_ws_probe.py``, medians of 5 rounds, the Triton kernel's
    autotuned config against ``dh_ws_config(n)``), ms, Triton → Gluon:

    * session 25-26 (benchmarks/results/2026-11-25_nvidia-h100_session26/): (32768, 4096, 1024, 128, 8) 4.58 →
      4.14; 7B (24576, 1536, 256, 128, 8) 0.538 → 0.512. The layer then ran it at d = 4096 only: an earlier form
      gave no gain in a 7B layer A/B with 25 ms warm-ups (3.489 against 3.435 ms, within the rounds' spread);
    * session 37 (benchmarks/results/2026-11-27_nvidia-h100_session37/): 7B 0.535 → 0.512; (40960, 768, n, E, K)
      at n = 256 / 512 / 1024: 0.663 → 0.580, 0.620 → 0.504, 0.615 → 0.479; (24576, 1536, 512, 64, 4) 0.495 → 0.452;
      OLMoE (32768, 2048, 1024, 64, 8) 2.71 → 2.44; Qwen3-30B-A3B (32768, 2048, 768, 128, 8) 2.21 → 1.90;
      Qwen3-Next (32768, 2048, 512, 512, 10) 1.99 → 1.89; (16384, 1536, 256, E, 8), 256 and 512 rows per expert:
      0.391 → 0.379 (E = 256), 0.462 → 0.448 (E = 512); DeepSeek-V3 (32768, 7168, 2048, 256, 8) 16.8 → 14.0.
      In the layer, 9 alternating rounds with 200 ms warm-ups, forward+backward: 7B 3.476 against 3.480 eager,
      3.454 against 3.478 replayed from a CUDA graph; (40960, 768, 256, 128, 8) 3.092 against 3.166 eager, 3.084
      against 3.164 replayed; 7B with 1 s warm-ups (11 rounds) 3.455 against 3.507 eager; replayed (7 rounds)
      (40960, 768, 512, 64, 4) 2.763 against 2.841, (24576, 1536, 512, 64, 4) 3.077 against 3.160, OLMoE 18.37
      against 18.50, Qwen3-30B-A3B 14.59 against 14.76; DeepSeek-V3 eager (5 rounds) 139.4 against 141.9.
    * session 38 (benchmarks/results/2026-11-27_nvidia-h100-h200_session38/), n = 128, in the layer at the iso-FLOPs
      shape (24576, 1536, 128, 256, 16), forward+backward: 4.054 against 4.109 ms eager (an H200, 1 s warm-ups, 5
      rounds), 4.530 against 4.574 replayed from a CUDA graph (an H100, 7 rounds).
    """
    return gluon_kernel_switch("SONICMOE_GLUON_DH") == "all" or n % 256 == 0 or n == 128


def dh_ws_supported(dout: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, gate_up_layout: str) -> bool:
    """Whether :func:`dh_ws` can serve this dH (host checks only, no sync): an sm_90 GPU with Gluon
    (:func:`dh_ws_enabled`), dout (T, d), w2 (E, d, n) and h (R, 2n) bf16/fp16 of one dtype, contiguous and
    16-byte aligned, the concat layout, d a multiple of BLOCK_K and n of 128."""
    if gate_up_layout != "concat" or not dh_ws_enabled() or not dout.is_cuda or dout.dtype not in _GL_DTYPES:
        return False
    if w2.dtype != dout.dtype or h.dtype != dout.dtype or dout.dim() != 2 or w2.dim() != 3 or h.dim() != 2:
        return False
    if not (dout.is_contiguous() and w2.is_contiguous() and h.is_contiguous()):
        return False
    d, n = w2.shape[1], w2.shape[2]
    if d % BLOCK_K or d == 0 or dout.shape[1] != d or h.shape[1] != 2 * n or dh_ws_block_n(n) is None:
        return False
    if torch.cuda.get_device_capability(dout.device) != (9, 0):
        return False
    return all(t.data_ptr() % 16 == 0 for t in (dout, w2, h))


if HAVE_GLUON:

    @gluon.jit
    def _load_h_block(h_desc, h_bufs, h_ready, row_start, col, N, b: gl.constexpr):
        """Ask TMA for H's gate and up (BLOCK_M, EPI) boxes at channel ``col`` into buffer ``b``."""
        mbarrier.expect(h_ready.index(b), 2 * h_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(h_desc, [row_start, col], h_ready.index(b), h_bufs.index(2 * b))
        tma.async_copy_global_to_shared(h_desc, [row_start, N + col], h_ready.index(b), h_bufs.index(2 * b + 1))

    @gluon.jit
    def _staging(ox, ow, i: gl.constexpr, XB: gl.constexpr):
        """Staging block ``i`` (of six (BLOCK_M, EPI) blocks): the i-th of ``ox`` below XB, else of ``ow``."""
        if i < XB:
            r = ox.index(i)
        else:
            r = ow.index(i - XB)
        return r

    @gluon.jit
    def _dh_block(acc, h_desc, dh_desc, ap_desc, h_bufs, ox, ow, XB: gl.constexpr, h_ready, dh_ptr, ap_ptr, ds_ptr,
                  s_rows, row_start, row_end, ch0, tcount, N, R, stride_hr, stride_apr, ds_in, J: gl.constexpr,
                  NB: gl.constexpr, EPI: gl.constexpr, NBUF: gl.constexpr, WARPS: gl.constexpr, PART: gl.constexpr,
                  TMA_STORE: gl.constexpr, SIG_FTZ: gl.constexpr = False, ACT: gl.constexpr = 0):
        """The epilogue of column block J (channels ch0 + J·EPI + [0, EPI)) of the tile; ``acc`` is that block of
        dA′ (BLOCK_M, EPI) float32, ``s_rows`` the tile's row scores (loaded before its MMAs). Its H block is in
        buffer J % NBUF. Once every thread has read the H block, TMA refills the buffer with the block NBUF ahead.
        The outputs go into staging set J % 2 (dH's gate and up blocks and A′'s: blocks 3·(J % 2) + 0, 1, 2 of
        :func:`_staging`; NB is even, so the sets alternate across tiles too), which the TMA stores of
        block J - 2 have finished reading, and leave by TMA stores that drain while the next blocks compute. An
        expert's last, partial tile (rows past its end belong to the next expert), or TMA_STORE off: the staged
        blocks are read back in a row-major layout and leave by masked 16-byte stores (pointer stores straight from
        the accumulator's layout need a 64-bit address per element pair: the MMA warps then spill).

        Returns the tile's dS sum over its blocks up to this one (float32, (BLOCK_M,)): ``ds_in`` (the sum up to
        block J - 1; not read at J = 0) plus this block's partial, in block order. The caller stores the tile's
        sum once (one 64-bit address per row instead of one per block: the per-block stores cost the MMA warps a
        40-byte stack at EPI = 32)."""
        b: gl.constexpr = J % NBUF
        g_buf = h_bufs.index(2 * b)
        u_buf = h_bufs.index(2 * b + 1)
        mbarrier.wait(h_ready.index(b), (tcount * (NB // NBUF) + J // NBUF) & 1)
        lay: gl.constexpr = acc.type.layout
        g = g_buf.load(lay).to(gl.float32)
        u = u_buf.load(lay).to(gl.float32)
        s = gl.convert_layout(s_rows, gl.SliceLayout(1, lay))[:, None]
        if ACT == 0:
            sig = sigmoid(g, SIG_FTZ)
            silu = g * sig
            a = silu * u
        else:  # gpt-oss's clamped SwiGLU: sonicmoe.ops.kernel_lib.gated_act_bwd's values, in its order
            gc, uc = clamped(g, u)
            sig = sigmoid(1.702 * gc, SIG_FTZ)
            glu = gc * sig
            a = (uc + 1.0) * glu
        if dh_ptr.dtype.element_ty == gl.float16:  # A as the forward stored it (dh.py's _dh_epilogue: float16 only)
            a = a.to(gl.float16).to(gl.float32)
        part = gl.sum(acc * a, axis=1)
        if J == 0:
            ds_out = part
        else:
            ds_out = ds_in + part
        dtype: gl.constexpr = dh_ptr.dtype.element_ty
        da = acc * s
        # A, then dS, then dH, as before ACT existed (session 85)
        if ACT == 0:
            d_up = (da * silu).to(dtype)
            d_gate = (da * u * (sig + silu * (1.0 - sig))).to(dtype)
        else:
            d_gate = gl.where(g <= 7.0, da * (uc + 1.0) * (sig + 1.702 * glu * (1.0 - sig)), 0.0).to(dtype)
            d_up = gl.where(uc == u, da * glu, 0.0).to(dtype)  # u inside [−7, 7] (NaN: False), one compare
        refill: gl.constexpr = J + NBUF < NB
        gl.thread_barrier()  # every MMA thread has read buffer b (and, from block J - 2, staging set J % 2)
        if refill:
            _load_h_block(h_desc, h_bufs, h_ready, row_start, ch0 + (J + NBUF) * EPI, N, b)
        q: gl.constexpr = J % 2
        og = _staging(ox, ow, 3 * q, XB)
        ou = _staging(ox, ow, 3 * q + 1, XB)
        oa = _staging(ox, ow, 3 * q + 2, XB)
        if TMA_STORE:
            if row_end - row_start >= acc.shape[0]:
                tma.store_wait(pendings=3)  # block J - 1's three stores may still run; block J - 2's have read set q
            else:
                # a partial tile issues no TMA store, so the three newest pending ones can be the previous (full)
                # tile's last block, still reading set 1 when this tile's block 1 writes it: drain them all (the
                # pendings=3 wait alone raced there; session 83 review, by reading)
                tma.store_wait(pendings=0)
            gl.thread_barrier()
        og.store(d_gate)
        ou.store(d_up)
        oa.store((a * s).to(dtype))
        if TMA_STORE and row_end - row_start >= acc.shape[0]:
            # a full tile: the three blocks leave by TMA stores, which drain while the next block computes
            fence_async_shared()
            gl.thread_barrier()
            col = ch0 + J * EPI
            if PART != 2:
                tma.async_copy_shared_to_global(dh_desc, [row_start, col], og)
                tma.async_copy_shared_to_global(dh_desc, [row_start, N + col], ou)
                tma.async_copy_shared_to_global(ap_desc, [row_start, col], oa)
        else:
            gl.thread_barrier()
            TPN: gl.constexpr = EPI // 8
            st: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPN, TPN], [WARPS, 1], [1, 0])
            rows_s = row_start + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, st))
            cols = ch0 + J * EPI + gl.arange(0, EPI, layout=gl.SliceLayout(0, st))
            mask = (rows_s < row_end)[:, None] & (cols >= 0)[None, :]
            r64 = rows_s.to(gl.int64)[:, None]
            if PART != 2:
                gl.store(dh_ptr + r64 * stride_hr + cols[None, :], og.load(st), mask=mask)
                gl.store(dh_ptr + r64 * stride_hr + (N + cols)[None, :], ou.load(st), mask=mask)
                gl.store(ap_ptr + r64 * stride_apr + cols[None, :], oa.load(st), mask=mask)
        return ds_out

    @gluon.jit
    def _dh_blocks(acc, h_desc, dh_desc, ap_desc, h_bufs, ox, ow, XB: gl.constexpr, h_ready, dh_ptr, ap_ptr, ds_ptr,
                   s_rows, row_start, row_end, ch0, tcount, N, R, stride_hr, stride_apr, ds_in, J0: gl.constexpr,
                   NB: gl.constexpr, EPI: gl.constexpr, NBUF: gl.constexpr, WARPS: gl.constexpr, PART: gl.constexpr,
                   TMA_STORE: gl.constexpr, SIG_FTZ: gl.constexpr = False, ACT: gl.constexpr = 0):
        """The epilogue of the column blocks J0, J0 + 1, ... covered by ``acc`` (its width a power-of-two multiple
        of EPI), halving ``acc`` until one block is left, in block order; returns the tile's running dS sum
        (:func:`_dh_block`)."""
        W: gl.constexpr = acc.shape[1]
        if W == EPI:
            ds_out = _dh_block(acc, h_desc, dh_desc, ap_desc, h_bufs, ox, ow, XB, h_ready, dh_ptr, ap_ptr, ds_ptr,
                               s_rows, row_start, row_end, ch0, tcount, N, R, stride_hr, stride_apr, ds_in, J0, NB,
                               EPI, NBUF, WARPS, PART, TMA_STORE, SIG_FTZ, ACT)
        else:
            lo, hi = column_halves(acc)
            ds_mid = _dh_blocks(lo, h_desc, dh_desc, ap_desc, h_bufs, ox, ow, XB, h_ready, dh_ptr, ap_ptr, ds_ptr,
                                s_rows, row_start, row_end, ch0, tcount, N, R, stride_hr, stride_apr, ds_in, J0, NB,
                                EPI, NBUF, WARPS, PART, TMA_STORE, SIG_FTZ, ACT)
            ds_out = _dh_blocks(hi, h_desc, dh_desc, ap_desc, h_bufs, ox, ow, XB, h_ready, dh_ptr, ap_ptr, ds_ptr,
                                s_rows, row_start, row_end, ch0, tcount, N, R, stride_hr, stride_apr, ds_mid,
                                J0 + W // (2 * EPI), NB, EPI, NBUF, WARPS, PART, TMA_STORE, SIG_FTZ, ACT)
        return ds_out

    @gluon.jit
    def _mma_chain(x_bufs, w_bufs, tma_ready, cp_ready, empty, step, k_tiles, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, acc_layout: gl.constexpr):
        """A tile's dA′ = dO·W2[e] wgmma chain over ring steps ``step`` .. ``step + k_tiles - 1``: one K-block in
        flight, so once a K-block's MMA is issued the previous one is done and its slot goes back to the loader.
        Returns the (BLOCK_M, BLOCK_N) float32 accumulator, with the last MMA possibly still in flight, and the next
        ring step."""
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        for ki in range(k_tiles):
            s = wait_gathered_slot(tma_ready, cp_ready, step, STAGES)
            acc = warpgroup_mma(x_bufs.index(s), w_bufs.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=ki > 0)
            step += 1
        return acc, step

    @gluon.jit
    def _dh_mma(x_bufs, w_bufs, tma_ready, cp_ready, empty, h_bufs, o_bufs, h_ready, h_desc, dh_desc, ap_desc, dh_ptr,
                ap_ptr, ds_ptr, score_ptr, pair_ptr, table_ptr, offsets_ptr, E, num_pid_n, N, D, R, stride_hr,
                stride_apr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, EPI: gl.constexpr,
                NBUF: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, PART: gl.constexpr,
                TMA_STORE: gl.constexpr, STAGE_IN_RING: gl.constexpr, GATHER_S: gl.constexpr,
                DS_PAIRS: gl.constexpr, SIG_FTZ: gl.constexpr = False, ACT: gl.constexpr = 0):
        """MMA partition: per tile, the H loads of the first NBUF epilogue blocks, the wgmma chain over the ring,
        then the epilogue (:func:`_dh_blocks`). Under STAGE_IN_RING the epilogue stages its outputs in the ring slot
        of the tile's last K-block (its dO block, then its W2 box), and that slot goes back to the loader only once
        the tile's stores have read it; else in ``o_bufs``.

        DS_PAIRS (one N-tile per row, scores in pair order): each tile's dS row sums, its blocks' partials added in
        block order, go to ``ds_ptr[row_pair[row]]`` in ``ds_ptr``'s dtype, and the pairs of the padding rows
        (rows expert_offsets[E] .. R - 1, in no tile) get 0 first."""
        NB: gl.constexpr = BLOCK_N // EPI
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        if DS_PAIRS:
            pad_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
            PAD: gl.constexpr = 32 * WARPS
            offs_pad = gl.arange(0, PAD, layout=pad_layout)
            for r0 in range(gl.load(offsets_ptr + E) + gl.program_id(0) * PAD, R, gl.num_programs(0) * PAD):
                pad_rows = r0 + offs_pad
                pad_ok = pad_rows < R
                pad_pairs = gl.load(pair_ptr + pad_rows, mask=pad_ok, other=0)
                gl.store(ds_ptr + pad_pairs, gl.zeros((PAD,), ds_ptr.dtype.element_ty, pad_layout), mask=pad_ok)
        total = gl.load(table_ptr) * num_pid_n
        k_tiles = D // BLOCK_K
        step = 0
        tcount = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            e, row_start, row_end, pid_n = _tile_of(tile, table_ptr, num_pid_n)
            ch0 = pid_n * BLOCK_N
            if PART != 1:
                gl.thread_barrier()  # the previous tile's epilogue has read every H buffer
                for j in gl.static_range(NBUF):
                    _load_h_block(h_desc, h_bufs, h_ready, row_start, ch0 + j * EPI, N, j)
                rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
                # its latency hides behind the MMAs; GATHER_S: scores in pair order, each row's through row_pair
                if GATHER_S:
                    pr = gl.load(pair_ptr + rows, mask=rows < row_end, other=0)
                    s_rows = gl.load(score_ptr + pr, mask=rows < row_end, other=0.0).to(gl.float32)
                else:
                    s_rows = gl.load(score_ptr + rows, mask=rows < row_end, other=0.0).to(gl.float32)
            acc, step = _mma_chain(x_bufs, w_bufs, tma_ready, cp_ready, empty, step, k_tiles, BLOCK_M, BLOCK_N,
                                   STAGES, acc_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            last = (step + STAGES - 1) % STAGES  # the slot of the tile's last K-block
            if not STAGE_IN_RING or PART == 1:
                mbarrier.arrive(empty.index(last), pred=k_tiles > 0)
            if PART == 1:  # the MMAs alone (timing only): the row sums of dA′ keep them from being removed
                rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
                gl.store(ds_ptr + rows, gl.sum(acc, axis=1), mask=rows < row_end)
            else:
                # the six staging blocks: the slot's dO block, then its W2 box; or o_bufs
                XB: gl.constexpr = BLOCK_K // EPI if STAGE_IN_RING else 6
                if STAGE_IN_RING:
                    ox = x_bufs.index(last)._reinterpret(dh_ptr.dtype.element_ty, [XB, BLOCK_M, EPI], h_desc.layout)
                    ow = w_bufs.index(last)._reinterpret(dh_ptr.dtype.element_ty,
                                                         [BLOCK_K * BLOCK_N // (BLOCK_M * EPI), BLOCK_M, EPI],
                                                         h_desc.layout)
                else:
                    ox = o_bufs
                    ow = o_bufs
                ds_sum = _dh_blocks(acc, h_desc, dh_desc, ap_desc, h_bufs, ox, ow, XB, h_ready, dh_ptr, ap_ptr,
                                    ds_ptr, s_rows, row_start, row_end, ch0, tcount, N, R, stride_hr, stride_apr,
                                    s_rows, 0, NB, EPI, NBUF, WARPS, PART, TMA_STORE, SIG_FTZ, ACT)
                ds_rows = row_start + gl.arange(0, BLOCK_M, layout=ds_sum.type.layout)
                if DS_PAIRS:  # the rows' pairs, loaded with the scores before the MMAs (GATHER_S)
                    gl.store(ds_ptr + gl.convert_layout(pr, ds_sum.type.layout), ds_sum.to(ds_ptr.dtype.element_ty),
                             mask=ds_rows < row_end)
                else:  # the tile's partial: row pid_n of the (n / BLOCK_N, R) partials
                    gl.store(ds_ptr + pid_n.to(gl.int64) * R + ds_rows, ds_sum, mask=ds_rows < row_end)
                if STAGE_IN_RING:
                    tma.store_wait(pendings=0)  # the tile's stores have read the slot
                    gl.thread_barrier()  # and every thread is done with it
                    mbarrier.arrive(empty.index(last), pred=k_tiles > 0)
            tcount += 1
        tma.store_wait(pendings=0)

    @gluon.jit
    def _dh_ws_kernel(do_ptr, w_desc, h_desc, dh_desc, ap_desc, dh_ptr, ap_ptr, ds_ptr, score_ptr, pair_ptr,
                      row_token_ptr, table_ptr, offsets_ptr, E, num_pid_n, N, D, R, stride_do, stride_hr, stride_apr,
                      X_LAYOUT: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, EPI: gl.constexpr,
                      NBUF: gl.constexpr, STAGES: gl.constexpr, MMA_WARPS: gl.constexpr, LOADER_WARPS: gl.constexpr,
                      LOADER_REGS: gl.constexpr, PART: gl.constexpr, TMA_STORE: gl.constexpr,
                      STAGE_IN_RING: gl.constexpr, GATHER_S: gl.constexpr = False, DS_PAIRS: gl.constexpr = False,
                      SIG_FTZ: gl.constexpr = False, ACT: gl.constexpr = 0):
        dtype: gl.constexpr = do_ptr.dtype.element_ty
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], X_LAYOUT)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], w_desc.layout)
        h_bufs = gl.allocate_shared_memory(dtype, [2 * NBUF, BLOCK_M, EPI], h_desc.layout)
        if STAGE_IN_RING:
            o_bufs = x_bufs  # not read: the staging sets lie in a ring slot
        else:
            o_bufs = gl.allocate_shared_memory(dtype, [2 * 3, BLOCK_M, EPI], h_desc.layout)
        tma_ready, cp_ready, empty = gather_ring_barriers(STAGES, LOADER_WARPS)
        h_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NBUF):
            mbarrier.init(h_ready.index(i), count=1)
        gl.warp_specialize([
            (_dh_mma, (x_bufs, w_bufs, tma_ready, cp_ready, empty, h_bufs, o_bufs, h_ready, h_desc, dh_desc, ap_desc,
                       dh_ptr, ap_ptr,
                       ds_ptr, score_ptr, pair_ptr, table_ptr, offsets_ptr, E, num_pid_n, N, D, R, stride_hr,
                       stride_apr, BLOCK_M, BLOCK_N, BLOCK_K, EPI, NBUF, STAGES, MMA_WARPS, PART, TMA_STORE,
                       STAGE_IN_RING, GATHER_S, DS_PAIRS, SIG_FTZ, ACT)),
            (gather_loader, (do_ptr, w_desc, row_token_ptr, table_ptr, x_bufs, w_bufs, tma_ready, cp_ready, empty,
                             num_pid_n, N, D, stride_do, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, LOADER_WARPS, False)),
        ], [LOADER_WARPS], [LOADER_REGS])
        invalidate_ring_barriers(tma_ready, cp_ready, empty, STAGES)
        for i in gl.static_range(NBUF):
            mbarrier.invalidate(h_ready.index(i))


_CALLS: dict[tuple, dict] = {}


def dh_ws_calls() -> list[dict]:
    """The shapes this process ran through :func:`dh_ws` (d, n, E, dtype, activation) with their config; benchmarks
    record it next to their timings (host bookkeeping, no sync)."""
    return [{"d": d, "n": n, "E": e, "dtype": dt, "activation": act, "config": cfg}
            for (d, n, e, dt, act), cfg in _CALLS.items()]


def ds_pairs_in_kernel(n: int, config: dict | None = None) -> bool:
    """Whether :func:`dh_ws` can write dS itself, summed and in pair order (``ds_pairs``): where one tile spans
    all n channels of its rows (BLOCK_N = n, e.g. n = 256 at 256-wide tiles), so that one program sees every
    partial of a row. Host values only."""
    cfg = config or dh_ws_config(n)
    return cfg is not None and cfg["BLOCK_N"] == n


def dh_ws(dout: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, row_scores: torch.Tensor, routing: Routing,
          config: dict | None = None, pair_order: bool = False,
          ds_pairs: torch.dtype | None = None,
          activation: str = "swiglu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dH, A′ and the dS partials (or, with ``ds_pairs``, dS itself) by the warp-specialised kernel (see the module
    doc).

    The caller has checked :func:`dh_ws_supported` (concat layout).

    Args:
        dout: (T, d) bf16/fp16, contiguous. w2: (E, d, n). h: (R, 2n) the saved up-projection output, concat
            layout (gate columns [0, n), up columns [n, 2n)). row_scores: (R,) float32 scores S in row order; with
            ``pair_order``, in pair order (any float dtype), gathered through ``routing.row_pair`` in the kernel.
        routing: rows sorted by expert (``row_token``, ``expert_offsets``).
        config: {"BLOCK_N", "EPI", "NBUF", "STAGES"} and optionally "BLOCK_K", "STAGE_IN_RING" (the staging
            sets in a ring slot; only where :func:`stage_fits_slot` holds), "MAXNREG", "LOADER_WARPS" (default
            :func:`dh_ws_config`), "TMA_STORE" (default True; False: every tile's outputs by masked pointer
            stores), and, to time a part of the
            kernel alone, "PART": 1 the MMAs only (no H, no epilogue: dH and A′ are left unwritten, dS holds row
            sums of dA′), 2 all but the global stores of dH and A′ (0, the default: the whole kernel).
        ds_pairs: None, or the dtype of dS written by the kernel in pair order (needs ``pair_order`` and
            :func:`ds_pairs_in_kernel`; the layer's backward passes the scores' dtype). Each row's partials are
            added in channel-block order in float32, then cast: the bits of
            :func:`sonicmoe.ops.score_grad.score_grad` on the partials, without its launch or the partials' buffer.
        activation: ``"swiglu"`` or ``"clamped_swiglu"`` (gpt-oss; :func:`sonicmoe.reference.swiglu_ref`), the
            activation whose A is recomputed from H and whose backward gives dH.
    Returns:
        dH (R, 2n) and A′ = S·A (R, n) in h's dtype, and the dS partials (n / BLOCK_N, R) float32 with
        dS = partials.sum(0) (without the bias term ⟨dO_t, b2[e]⟩); with ``ds_pairs``, dS (R,) of that dtype in
        pair order instead, 0 for padding pairs (rows at or past ``expert_offsets[E]``). No atomics, the same bits
        on every run.
    Raises:
        ValueError: ``ds_pairs`` without ``pair_order``, or where a tile does not span all n channels; an unknown
            ``activation``.
    """
    act = act_code(activation)
    e, d, n = w2.shape
    r = routing.num_rows
    cfg = config or dh_ws_config(n)
    bn, epi = cfg["BLOCK_N"], cfg["EPI"]
    if ds_pairs is not None and not (pair_order and ds_pairs_in_kernel(n, cfg)):
        raise ValueError(f"ds_pairs: needs pair_order=True and BLOCK_N = n = {n} (got pair_order={pair_order}, "
                         f"BLOCK_N={bn})")
    dh_ = new_output(h.shape, device=h.device, dtype=h.dtype)
    a_prime = new_output((r, n), device=h.device, dtype=h.dtype)
    if ds_pairs is not None:
        ds_part = new_output((r,), device=h.device, dtype=ds_pairs)
    else:
        ds_part = new_output((n // bn, r), device=h.device, dtype=torch.float32)
    if r == 0:
        return dh_, a_prime, ds_part
    _CALLS[(d, n, e, str(h.dtype).removeprefix("torch."), activation)] = dict(cfg)
    table = routing_tile_table(routing, BLOCK_M)  # shared with the other kernels of this routing
    bk = cfg.get("BLOCK_K", BLOCK_K)
    args = (dout, _descriptor(w2.view(e * d, n), [bk, bn]), _descriptor(h, [BLOCK_M, epi]),
            _descriptor(dh_, [BLOCK_M, epi]), _descriptor(a_prime, [BLOCK_M, epi]), dh_, a_prime, ds_part,
            row_scores.contiguous() if pair_order else row_scores.float().contiguous(),
            routing.row_pair if pair_order else routing.row_token, routing.row_token, table, routing.expert_offsets,
            e, n // bn, n, d, r, dout.stride(0), h.stride(0), a_prime.stride(0))
    meta = dict(X_LAYOUT=shared_layout((BLOCK_M, bk), h.dtype), BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk,
                EPI=epi, NBUF=cfg["NBUF"], STAGES=cfg["STAGES"], LOADER_WARPS=cfg.get("LOADER_WARPS", LOADER_WARPS),
                LOADER_REGS=LOADER_REGS, TMA_STORE=cfg.get("TMA_STORE", TMA_STORE),
                STAGE_IN_RING=bool(cfg.get("STAGE_IN_RING", False)), GATHER_S=pair_order,
                DS_PAIRS=ds_pairs is not None, SIG_FTZ=cfg.get("SIGMOID_FTZ", sigmoid_ftz(SIGMOID_FTZ)), ACT=act,
                maxnreg=cfg.get("MAXNREG", MAXNREG))
    launch_kernel(_dh_ws_kernel, (sm_count(h.device),), *args, **meta, MMA_WARPS=MMA_WARPS, PART=cfg.get("PART", 0),
                  num_warps=MMA_WARPS)
    return dh_, a_prime, ds_part
