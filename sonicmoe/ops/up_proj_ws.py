"""Warp-specialised up-projection for Hopper, in Gluon: gather-fused varlen-M grouped GEMM with a SwiGLU (or gpt-oss's
clamped SwiGLU) epilogue (SPEC §3 kernel 1).

The same product as :func:`sonicmoe.ops.up_proj.up_proj` — for each row r of expert e, H[r] = W1[e] x_{token(r)}
(+ b1[e]) and A[r] = silu(gate(H[r])) · up(H[r]) (or the clamped form, ``activation="clamped_swiglu"``), A computed
from the rounded H — for the concat gate/up layout.

Why a second kernel: the Triton kernel gathers X rows by ``cp.async`` from its MMA warps, and every K-step ends in
a barrier across the program before the tensor cores may read them; the weight gradients' warp-specialised kernel
(:mod:`.weight_grad_ws`) showed that moving such gathers to loader warps pays on Hopper. Here each persistent
program splits its warps by role:

* a **loader** (four warps) walks the program's tiles: per K-block, the tile's BLOCK_M gathered X rows by 16-byte
  ``cp.async`` (rows past the expert's end zero-filled) and W1[e]'s gate and up (BLOCK_N × BLOCK_K) boxes by TMA,
  into a ring of ``STAGES`` slots. A slot has a ``tma_ready`` mbarrier (the TMA bytes), a ``cp_ready`` one (each
  loader thread arrives once its copies have landed) and an ``empty`` one (the MMAs that read it are done);
* the **MMA warps** (two warpgroups, BLOCK_M = 128 rows) run two asynchronous wgmma chains per tile, gate and up
  (one K-block in flight), add the bias and round to H's dtype;
* with a **storer** (four warps; ``EPI_WARPS``, the default where d ≤ ``EPI_MAX_D``) the MMA warps stage the rounded
  gate and up blocks in shared memory (one 64 KiB set, handed over by a pair of mbarriers) and go on with the next
  tile; the storer stores H's two blocks by 16-byte stores (masked in an expert's last, partial tile; by TMA for a
  full tile with ``EPI_H_TMA``), computes A = SwiGLU from the staged values (the dH kernel recomputes A the same way)
  and stores it by 16-byte stores, then hands the set back. Without a storer the MMA warps run that
  epilogue themselves in registers, the stores of H's gate block, H's up block and A going through one staging
  buffer, each drained before the next is written, while the tensor cores idle.

Tiles are (M-tile, N-tile) pairs, N fastest, M-tiles numbered expert after expert from the table of
:func:`sonicmoe.ops.grouped_gemm_ws.tile_table` (no host sync); program p takes tiles p, p + P, .... K-blocks are
added in order, so H has the Triton kernel's bits where both use 64-wide K-blocks. No atomics.

Served shapes (:func:`up_ws_supported`): sm_90, bf16/fp16, concat layout, d a multiple of BLOCK_K, n a multiple
of BLOCK_N, 16-byte aligned contiguous operands, and in the layer only where it measured faster
(:func:`up_ws_preferred`: d = 4096 without the storer, and d ≤ 2048 with it on H200s, and on H100s where the experts
average more than 384 rows); every other case runs the
Triton kernel.
Where its time goes without the storer (session 43,
an H200, benchmarks/results/2026-11-27_nvidia-h200_session43/, ``PART`` 1): the MMAs alone take 86% of the kernel at 7B
(0.536 against 0.622 ms) and 95% at (32768, 4096, 1024, 128, 8), so the main loop, not the epilogue, sets the pace: at
about 580 TFLOP/s with 128 × 256 tiles it reads about 6.7 TB/s of operands from L2 (85 FLOP per byte). A 2-CTA cluster
that shares W1 boxes by TMA multicast would lower that, but Gluon's Hopper TMA copy in Triton 3.6 takes no multicast
argument, and two warpgroups of 64 × 256 float32 accumulators are already all the registers a wider tile could use.
Staging the outputs in the tile's last two ring slots (four TMA stores issued together instead of three through one
buffer) was slower at both shapes and was dropped (the patch is in that folder). Gluon kernels do not run
under Triton's interpreter: the kernel is tested on the GPU against the Triton kernel and the float32 reference
(tests/test_up_proj_ws.py).
"""

from __future__ import annotations

import functools
import re

import torch

from ..routing import Routing
from .common import act_code, env_switch, few_rows_per_expert, new_output, sm_count
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
from .weight_grad_ws import gather_ring_barriers, invalidate_ring_barriers, wait_gathered_slot

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

    from .grouped_gemm_ws import _masked_store, column_halves

BLOCK_M = 128  # two warpgroups of 64 rows
BLOCK_N = 128  # gate and up channels per tile: two (128 x 128) accumulators
BLOCK_K = 64
LOADER_WARPS = 4  # Gluon pads a partition to whole warpgroups: 2 warps would take 4 anyway
LOADER_REGS = 80
MMA_WARPS = 8
# registers per thread (every warp; no setmaxnreg): 12 warps x 32 x 168 <= 64 K. The MMA warps hold two 128 x 128
# float32 accumulators (128 registers); no stack with H stored since session 43 (16 bytes before the epilogue's stores
# moved into _buffer_stores; the offline report, benchmarks/resource_report.py --kernels up_ws)
MAXNREG = 168
MAX_STAGES = 6
MIN_D = MAX_D = 4096  # the layer runs this kernel for MIN_D <= d <= MAX_D (up_ws_preferred), and for d <= EPI_MAX_D
EPI_MAX_D = 2048  # with the storer partition (EPI_WARPS 4) for d <= EPI_MAX_D (up_ws_config, up_ws_preferred)
# the GPUs (a word of the device name: "H200" matches "NVIDIA H200" and "NVIDIA H200 NVL", not "NVIDIA GH200 480GB",
# an H100-class chip) on which the layer prefers the kernel with its storer at d <= EPI_MAX_D:
# where it measured faster (session 44). On H100s the forward gains but forward+backward does not: session 44 at 7B
# forward 1.144 against 1.155 ms, forward+backward 3.505 against 3.369 (5 noisy rounds); session 45 (7 rounds, 1 s
# warm-ups, benchmarks/results/2026-11-27_nvidia-h100-h200_session45/) forward / forward+backward 7B 1.163 / 3.478
# against 1.168 / 3.468, (16384, 1536, 256, 512, 8) 1.044 / 3.185 against 1.069 / 3.162, (40960, 768, 256, 128, 8)
# 0.994 / 3.081 against 1.028 / 3.082. So the H100 kept the Triton kernel there until session 48.
EPI_PREFERRED_GPUS = ("H200",)
# the GPUs on which the layer prefers the kernel with its storer at d <= EPI_MAX_D only where the experts average more
# than common.FEW_ROWS_PER_EXPERT rows. Session 48 (one H100, fresh-process layer A/Bs against the Triton kernel,
# after session 47's 16-byte H stores; benchmarks/results/2026-11-27_nvidia-h100-h200_session48/, medians, ms):
# * 7B (1536 rows per expert): forward 1.189 against 1.232 (6 of 6 rounds), forward+backward 3.467 against 3.497
#   (4 of 6);
# * (40960, 768, 256, 128, 8) (2560 rows): forward 1.101 against 1.126 (4 of 4), forward+backward 3.052 against
#   3.066 (level);
# * (16384, 1536, 256, 512, 8) (256 rows): forward 1.085 against 1.072 (slower, 4 of 4), forward+backward level.
# On a second H100 (call 11), 7B: forward 1.184 against 1.217 (5 of 5), forward+backward 3.462 against 3.427 (2 of 5);
# on a third (call 12, 3 rounds): OLMoE forward 6.009 against 6.081, forward+backward 17.40 against 17.65; Qwen3-Next
# (32768, 2048, 512, 512, 10) forward 4.721 against 4.890, forward+backward level. So the forward gains and
# forward+backward is level or faster.
EPI_MANY_ROWS_GPUS = ("H100",)
# GU_FUSED: one (128 x 256) wgmma chain per tile, split into gate and up after the loop, instead of two 128-wide
# chains. Off: at the DeepSeek-V3 shape (32768, 7168, 2048, 256, 8) it ran 45.6-51.1 ms in 5 of 5 rounds against
# 27.0-42.1 unfused and 33.1-40.4 for the Triton kernel (session 24, H100, power-capped); elsewhere within noise.
# Session 61 (an H200, settled windows, benchmarks/results/2026-12-02_nvidia-h200_session61/): at (32768, 4096, 1024,
# 128, 8) the kernel alone 7.656 against 7.655 ms (the MMAs alone 7.282 against 7.331), the layer's forward+backward
# 35.46 against 35.53 ms (2 rounds): level. Session 68 (an H200 at about 1410 MHz, fresh-process layer runs,
# benchmarks/results/2026-12-03_nvidia-h200_session68/): at (32768, 4096, 1024, 128, 8) the forward level (12.09
# against 12.10 ms), forward+backward 35.85 against 35.93 (7 rounds), and the protocol run with it on afterwards no
# faster (549.1 against 552.4 TFLOP/s, forwards alike); at the DeepSeek-V3 shape level (133.1 against 133.4 ms, 3
# rounds; session 24's slowdown did not come back). So still off. Not with the storer partition (EPI_WARPS): its 16
# warps compile at 128 registers, and a 256-wide wgmma needs 154 (up_ws_config and the launcher drop it there)
GU_FUSED = False
SMEM_BUDGET = 227 * 1024 - 1024  # dynamic shared memory of one program on sm_90, less the barriers
# EPI_WARPS: warps of a storer partition that takes each tile's epilogue off the MMA warps (0: the MMA warps run it).
# The MMA warps then only round the gate and up blocks and stage them (64 KiB: a ring slot fewer); the storer stores
# H by TMA and computes and stores A, while the MMA warps run the next tile. With 16 warps the kernel is compiled for
# 128 registers per thread and the partitions' setmaxnreg moves them: loader LOADER_REGS, storer EPI_REGS, MMA warps
# the rest (176). The default for d <= EPI_MAX_D (up_ws_config); session 44 (an H200, settled layer A/Bs against the
# Triton kernel, 7 rounds, ms; benchmarks/results/2026-11-27_nvidia-h100-h200_session44/): 7B forward 1.075 against
# 1.092 (fwd+bwd 3.262 against 3.269), (16384, 1536, 256, 512, 8) 0.964 against 1.004 (2.945 against 2.993),
# (40960, 768, 256, 128, 8) 0.919 against 0.948 (2.856 against 2.911), OLMoE (32768, 2048, 1024, 64, 8) 5.978 against
# 6.052 (18.32 against 18.48). At d = 4096 (120B-n1024) level against EPI_WARPS 0: forward 12.23 against 12.24, so
# off there; slower since H_PACKED (session 64, an H200, 3 fresh-process rounds: forward 12.11 against 11.90 ms,
# forward+backward 35.24 against 35.12: the staging set costs a ring slot). Same bits as EPI_WARPS 0 (GPU tests).
EPI_WARPS = 4
EPI_REGS = 80
EPI_CHUNK = 16  # rows of A per step of the storer
# EPI_H_TMA: the storer stores a full tile's H by TMA; off, by 16-byte stores as an expert's last tile. Off since
# session 47 (an H200, kernel alone, medians of 7 alternating rounds, two calls, ms, TMA against 16-byte stores):
# 7B 0.625 / 0.632 against 0.614 / 0.618; (16384, 1536, 256, 512, 8) top-k 0.537 / 0.533 against 0.524 / 0.528, token
# rounding 0.480 / 0.486 against 0.468 / 0.467 (benchmarks/results/2026-11-27_nvidia-h200_session47/). Same bits.
EPI_H_TMA = False
# (Session 57 also ran the two MMA warpgroups as partitions of their own without a storer, each with half the tile's
# rows and its own half-tile staging buffer, sharing the ring, as the weight gradients do (weight_grad_ws.WG_SPLIT):
# the same bits, but slower, the layer's forward+backward 36.13 against 35.67 ms at (32768, 4096, 1024, 128, 8) on an
# H200, each half's three stores taking about as long as the whole tile's. Removed in session 67; the form and its
# switch, SONICMOE_UP_WG_SPLIT, are at commit c32e1de.)
# H_PACKED: the epilogue rounds H's gate and up blocks two elements per cvt (_round_pairs) instead of by ``.to``,
# which the compiler emits one F2F per element for (the rounded values also feed the SwiGLU); the same bits.
# Session 57 (an H200, benchmarks/results/2026-12-02_nvidia-h200_session57/): at (32768, 4096, 1024, 128, 8) the
# kernel alone 7.694 against 7.822 ms (the MMAs alone 7.313), the layer's forward 11.73 against 11.88 ms (3 of 3
# fresh-process rounds), forward+backward level; 7B (the storer's path) level. SONICMOE_UP_H_PACKED (1 or 0)
# overrides it (up_ws_config), for A/Bs
H_PACKED = True
# SIGMOID_FTZ: the SwiGLU's sigmoid by ex2.approx.ftz and rcp.approx.ftz (see sigmoid), here and in the dH kernel
# (dh_ws), which recomputes A: the epilogues of both are bound by instruction issue (nvdisasm of dH: about 33
# instructions per element, 7 of them the range checks of the non-ftz forms). The same bits but for gates in about
# (-88.7, -87.3). Off for the up-projection: timed in session 58 (H200, d = 4096, n = 1024, no storer) level alone
# (7.689 against 7.666 ms) and its layer forward slower (11.87 against 11.73 ms, fresh-process medians), as the 48-byte
# spill it brings costs what the checks saved; dH has its own default (dh_ws.SIGMOID_FTZ). SONICMOE_SIGMOID_FTZ (1 or
# 0) overrides both (sigmoid_ftz)
SIGMOID_FTZ = False
# Tried and dropped (sessions 58-59): an expert's last tile of at most 64 rows as a 64-row product, the warpgroups
# splitting the columns. The same bits, but the layer's forward was slower at 120B-n1024 (12.16 against 11.95 ms).


def up_ws_smem_bytes(stages: int, elem: int = 2, epi: bool = False) -> int:
    """Shared memory of one program: the ring (an X block and the gate and up W1 boxes per slot) and the staging
    buffer for the stores (one block; the gate and up blocks with a storer partition, ``epi``)."""
    return elem * (stages * BLOCK_K * (BLOCK_M + 2 * BLOCK_N) + (2 if epi else 1) * BLOCK_M * BLOCK_N)


def up_ws_config(d: int = 0, epi_warps: int | None = None) -> dict:
    """{"STAGES": the deepest ring that fits shared memory beside the staging buffers (at most MAX_STAGES),
    "EPI_WARPS": the storer partition's warps: ``epi_warps``, else :data:`EPI_WARPS` where the switch
    ``SONICMOE_UP_EPI`` is on (1) and 0 where it is off (0; read at each call, for A/Bs), and where it is unset
    :data:`EPI_WARPS` for a reduction width d ≤ :data:`EPI_MAX_D`, 0 above; "H_PACKED": :data:`H_PACKED`, or
    ``SONICMOE_UP_H_PACKED`` (1 or 0) where set; "SIGMOID_FTZ": :func:`sigmoid_ftz`; "GU_FUSED": :data:`GU_FUSED`, or
    ``SONICMOE_UP_GU_FUSED`` (1 or 0) where set, only without a storer}."""
    if epi_warps is None:
        epi_warps = EPI_WARPS if env_switch("SONICMOE_UP_EPI", d <= EPI_MAX_D) else 0
    epi = epi_warps > 0
    per_stage = up_ws_smem_bytes(1) - up_ws_smem_bytes(0)
    return {"STAGES": min(MAX_STAGES, (SMEM_BUDGET - up_ws_smem_bytes(0, epi=epi)) // per_stage),
            "EPI_WARPS": epi_warps,
            "H_PACKED": env_switch("SONICMOE_UP_H_PACKED", H_PACKED), "SIGMOID_FTZ": sigmoid_ftz(),
            "GU_FUSED": env_switch("SONICMOE_UP_GU_FUSED", GU_FUSED) and not epi}


def sigmoid_ftz(default: bool = SIGMOID_FTZ) -> bool:
    """Whether a Gluon kernel takes the activation's sigmoid by the ftz forms (SwiGLU's σ(g), the clamped one's σ(1.702
    g′), which differs from the default forms' for g′ in about (−52.1, −51.3) instead): ``SONICMOE_SIGMOID_FTZ`` (1 or
    0) where set, for the up-projection and dH alike; else ``default``, the kernel's own (:data:`SIGMOID_FTZ` here,
    :data:`sonicmoe.ops.dh_ws.SIGMOID_FTZ` for dH). Read at each call."""
    return env_switch("SONICMOE_SIGMOID_FTZ", default)


# GLUON_CLAMPED: gpt-oss's clamped SwiGLU (activation="clamped_swiglu") in the epilogues of this kernel and of the dH
# kernel (dh_ws) where the layer would run them for SwiGLU; else the Triton kernels run it (session 84's only form: 7B
# forward+backward 4.96 ms against 3.33 for SwiGLU on these kernels, an H100). Added in session 85 (no spill; the
# SwiGLU kernels' PTX unchanged). On an H100 (benchmarks/results/2026-12-06_session85/h100_call/): its GPU tests passed
# (the up-projection's two epilogue forms; dH bitwise the Triton kernel's), and the 7B experts' forward+backward took
# 3.402 / 3.408 ms against 3.482 / 3.480 with the Triton kernels (two rounds; SwiGLU 3.358 / 3.362), the same outputs
GLUON_CLAMPED = True


def gluon_serves_activation(activation: str) -> bool:
    """Whether the Gluon up-projection and dH kernels take ``activation``: ``"swiglu"`` always, ``"clamped_swiglu"``
    per ``SONICMOE_GLUON_CLAMPED`` (1 or 0; default :data:`GLUON_CLAMPED`; read at each call)."""
    return activation == "swiglu" or (activation == "clamped_swiglu"
                                      and env_switch("SONICMOE_GLUON_CLAMPED", GLUON_CLAMPED))


def up_ws_enabled() -> bool:
    """:func:`sonicmoe.ops.grouped_gemm_ws.ws_enabled` (``SONICMOE_GLUON=0`` turns every Gluon kernel off), and
    ``SONICMOE_GLUON_UP`` (default 1) this one alone: 0 off, ``all`` at every width (:func:`up_ws_preferred`; read at
    each call; any other value raises ValueError: :func:`sonicmoe.ops.grouped_gemm_ws.gluon_kernel_switch`)."""
    return gluon_kernel_switch("SONICMOE_GLUON_UP") != "0" and ws_enabled()


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def epi_preferred_on(device: torch.device | None, gpus: tuple[str, ...] = EPI_PREFERRED_GPUS) -> bool:
    """Whether ``device`` is one of ``gpus`` (default :data:`EPI_PREFERRED_GPUS`; each a whole word of the device
    name, read once per device; False on CPU)."""
    if device is None or device.type != "cuda":
        return False
    name = _gpu_name(device.index if device.index is not None else torch.cuda.current_device())
    return any(re.search(rf"\b{re.escape(g)}\b", name) for g in gpus)


def whole_tiles_few_rows(routing: Routing | None) -> bool:
    """Whether ``routing`` promises whole BLOCK_M-row tiles (its ``tile_rows`` hint a multiple of BLOCK_M: token
    rounding) and its experts average at most ``common.FEW_ROWS_PER_EXPERT`` rows (host values only, no sync)."""
    return (routing is not None and routing.tile_rows > 0 and routing.tile_rows % BLOCK_M == 0
            and few_rows_per_expert(routing.num_rows, routing.num_experts))


def up_ws_preferred(d: int, device: torch.device | None = None, routing: Routing | None = None) -> bool:
    """Where the Gluon kernel measured faster in the layer: MIN_D ≤ d ≤ MAX_D (d: the reduction width, a host
    value), and d ≤ :data:`EPI_MAX_D` on the GPUs of :data:`EPI_PREFERRED_GPUS` (with the storer partition, since
    session 44: see :data:`EPI_WARPS`; ``device``: the operands' device). Without the storer partition, measured on
    H100s (session 24, benchmarks/results/2026-11-25_nvidia-h100_session24/):

    * d = 4096, faster: kernel alone (two-chain form, medians of 5 alternating rounds) (32768, 4096, 1024, 128, 8)
      7.59-7.77 ms against 8.01-8.05 for the Triton kernel, (16384, 4096, 1024, 256, 4) 2.42 against 2.74; the
      120B-n1024 layer's forward 11.61 against 12.47 ms (5 of 5 rounds);
    * d = 7168, slower in the layer: DeepSeek-V3 (32768, 7168, 2048, 256, 8) forward 57.4 against 50.5 ms (3 of 3
      rounds), though alone it timed 33.8-35.1 against 35.2-35.6 ms (power-capped, noisy);
    * d ≤ 1536, not faster: 7B (24576, 1536, 256, 128, 8) 0.635-0.644 against 0.625-0.630 ms, (16384, 1536, 256,
      512, 8) 0.590 against 0.574, (40960, 768, 256, 128, 8) 0.611 against 0.602 (with a short reduction the
      epilogue, which this kernel does not overlap with the next tile's MMAs, is a larger share of a tile).

    Widths between EPI_MAX_D and MIN_D are not measured; the bounds move as they are. ``SONICMOE_GLUON_UP=all`` runs
    it at every width (for layer A/Bs; read at each call).

    With the storer (d ≤ EPI_MAX_D), not where ``routing`` holds whole tiles and few rows per expert
    (:func:`whole_tiles_few_rows`: token rounding at 2-3 tiles per expert). There the Triton kernel, one program
    per tile, measured faster on H200s (session 47, kernel alone, (16384, 1536, 256, 512, 8) under token rounding:
    0.437-0.474 against 0.480-0.506 ms in four calls; under top-k, whose experts end in partial tiles, this kernel
    stays faster, 0.531-0.568 against 0.543-0.575).

    On the GPUs of :data:`EPI_MANY_ROWS_GPUS` (H100s), with the storer only where ``routing``'s experts average more
    than ``common.FEW_ROWS_PER_EXPERT`` rows (session 48; without a routing, not)."""
    if gluon_kernel_switch("SONICMOE_GLUON_UP") == "all" or MIN_D <= d <= MAX_D:
        return True
    if d > EPI_MAX_D or whole_tiles_few_rows(routing):
        return False
    if epi_preferred_on(device):
        return True
    return (routing is not None and epi_preferred_on(device, EPI_MANY_ROWS_GPUS)
            and not few_rows_per_expert(routing.num_rows, routing.num_experts))


def up_ws_supported(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, gate_up_layout: str) -> bool:
    """Whether :func:`up_proj_ws` can serve this up-projection (host checks only, no sync): an sm_90 GPU with Gluon
    (:func:`up_ws_enabled`), x (T, d) and w1 (E, 2n, d) bf16/fp16 of one dtype, contiguous and 16-byte aligned,
    the concat layout, d a multiple of BLOCK_K and n of BLOCK_N, a bias (if any) of x's dtype. The layer also asks
    :func:`up_ws_preferred`."""
    if gate_up_layout != "concat" or not up_ws_enabled() or not x.is_cuda or x.dtype not in _GL_DTYPES:
        return False
    if w1.dtype != x.dtype or x.dim() != 2 or w1.dim() != 3 or not (x.is_contiguous() and w1.is_contiguous()):
        return False
    if b1 is not None and b1.dtype != x.dtype:
        return False
    d, n = x.shape[1], w1.shape[1] // 2
    if d % BLOCK_K or d == 0 or n % BLOCK_N or n == 0 or w1.shape[2] != d:  # d = 0: no TMA box (Triton path)
        return False
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return False
    return x.data_ptr() % 16 == 0 and w1.data_ptr() % 16 == 0


if HAVE_GLUON:

    @gluon.jit
    def _tile_of(tile, table_ptr, num_pid_n):
        """(expert, first row, end row, N-tile) of tile ``tile`` (N-tiles fastest)."""
        mt = tile // num_pid_n
        entry = table_ptr + (mt + 1) * 4
        return gl.load(entry), gl.load(entry + 1), gl.load(entry + 2), tile - mt * num_pid_n

    @gluon.jit
    def gather_loader(x_ptr, w_desc, row_token_ptr, table_ptr, x_bufs, w_bufs, tma_ready, cp_ready, empty,
                      num_pid_n, N, D, stride_x, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                      STAGES: gl.constexpr, WARPS: gl.constexpr, W_UP: gl.constexpr):
        """Loader partition of the gather-fused varlen-M kernels (this one and :mod:`.dh_ws`): for every K-block of
        every tile of this program, the tile's gathered rows of ``x`` (X here, dO for dH) by 16-byte cp.async (rows
        past the expert's end zero-filled) and the weight's boxes by TMA into the next ring slot, once the MMAs that
        read its previous content are done. ``W_UP``: W1[e]'s gate and up (BLOCK_N × BLOCK_K) boxes from the
        (E·2n, d) view; else W2[e]'s (BLOCK_K × BLOCK_N) box from the (E·d, n) view."""
        TPK: gl.constexpr = BLOCK_K // 8  # threads along a row: 16 bytes each
        lx: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPK, TPK], [WARPS, 1], [1, 0])
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lx))
        offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, lx))
        total = gl.load(table_ptr) * num_pid_n
        k_tiles = D // BLOCK_K
        step = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            e, row_start, row_end, pid_n = _tile_of(tile, table_ptr, num_pid_n)
            rows = row_start + offs_m
            ok = rows < row_end
            tok = gl.load(row_token_ptr + rows, mask=ok, other=0).to(gl.int64)
            x_rows = x_ptr + tok * stride_x
            mask = ok[:, None] & (offs_k >= 0)[None, :]
            w_row = e * (2 * N) + pid_n * BLOCK_N
            for ki in range(k_tiles):
                s = step % STAGES
                mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)
                if W_UP:
                    mbarrier.expect(tma_ready.index(s), 2 * w_desc.block_type.nbytes)
                    w_buf = w_bufs.index(s)
                    tma.async_copy_global_to_shared(w_desc, [w_row, ki * BLOCK_K], tma_ready.index(s),
                                                    w_buf.slice(0, BLOCK_N))
                    tma.async_copy_global_to_shared(w_desc, [w_row + N, ki * BLOCK_K], tma_ready.index(s),
                                                    w_buf.slice(BLOCK_N, BLOCK_N))
                else:
                    mbarrier.expect(tma_ready.index(s), w_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(w_desc, [e * D + ki * BLOCK_K, pid_n * BLOCK_N],
                                                    tma_ready.index(s), w_bufs.index(s))
                cols = ki * BLOCK_K + offs_k
                async_copy.async_copy_global_to_shared(x_bufs.index(s), x_rows[:, None] + cols[None, :], mask=mask)
                # fires once this thread's copies have landed (the barrier counts every loader thread)
                async_copy.mbarrier_arrive(cp_ready.index(s), increment_count=False)
                step += 1

    @gluon.jit
    def _store_rows(c_smem, val, out_ptr, row_start, row_end, col0, stride, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, WARPS: gl.constexpr):
        """Rows [row_start, row_end) of the (BLOCK_M, BLOCK_N) block ``val`` to out[row, col0 + j], by masked
        16-byte stores (8 contiguous elements per thread) read back from ``c_smem``."""
        TPN: gl.constexpr = BLOCK_N // 8 if BLOCK_N < 256 else 32
        st: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPN, TPN], [WARPS, 1], [1, 0])
        tma.store_wait(pendings=0)  # the staging buffer's previous TMA store has read it
        c_smem.store(val)
        _masked_store(c_smem, out_ptr, 0, stride, row_start, row_end, col0, st, COL_MASK=False)

    @gluon.jit
    def _round_pairs(acc, dtype: gl.constexpr):
        """``acc`` (float32) rounded to nearest-even in ``dtype`` (bf16 or fp16), two elements per ``cvt`` (the
        packed ``cvt.rn.bf16x2.f32`` / ``cvt.rn.f16x2.f32``): the bits of ``acc.to(dtype)``. Where the rounded values
        also feed the SwiGLU, the compiler keeps ``.to`` per element (one F2F each, ``benchmarks/resource_report.py``
        and nvdisasm: 128 a thread per tile against 32 packed for A): :data:`H_PACKED`."""
        if dtype == gl.bfloat16:
            return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [acc], dtype=gl.bfloat16,
                                             is_pure=True, pack=2)
        else:
            return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [acc], dtype=gl.float16,
                                             is_pure=True, pack=2)

    @gluon.jit
    def sigmoid(g, FTZ: gl.constexpr = False):
        """1 / (1 + exp(−g)) of the float32 tensor ``g``, as ``gl.fdiv(1, 1 + gl.exp(-g))``: ``ex2.approx.f32`` of
        −g·log2(e), then ``div.full.f32``. ``FTZ`` (:data:`SIGMOID_FTZ`): ``ex2.approx.ftz.f32`` and
        ``rcp.approx.ftz.f32`` instead, one MUFU each without the range checks that ptxas wraps around the
        non-ftz forms (per element two FSETP, an FSEL and three or four FMUL fewer, nvdisasm). The same bits
        except where g lies in about (−88.7, −87.3): there 1 + exp(−g) exceeds 2^126, ``div.full`` returns a
        denormal and ``rcp.approx.ftz`` zero. (A denormal exp(−g), g > 87.3, leaves 1 + exp(−g) = 1 either way.)"""
        if FTZ:
            e = gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [g * -1.4426950408889634],
                                          dtype=gl.float32, is_pure=True, pack=1)
            return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=gl.float32,
                                             is_pure=True, pack=1)
        else:
            return gl.fdiv(gl.full_like(g, 1.0), 1.0 + gl.exp(-g))

    @gluon.jit
    def clamped(g, u):
        """gpt-oss's clamps of the float32 gate and up blocks: (min(g, 7), clamp(u, −7, 7)), NaN kept NaN (as
        :func:`sonicmoe.ops.kernel_lib.gated_act`'s, whose values these are)."""
        return gl.where(g > 7.0, 7.0, g), gl.where(u > 7.0, 7.0, gl.where(u < -7.0, -7.0, u))

    @gluon.jit
    def _gated_act(hg, hu, ACT: gl.constexpr = 0, FTZ: gl.constexpr = False):
        """A in H's dtype from the rounded gate and up blocks, float32 arithmetic in the order of the Triton kernels'
        :func:`sonicmoe.ops.kernel_lib.gated_act` (the dH kernels recompute A the same way; ``FTZ``: :func:`sigmoid`'s):
        ACT 0 silu(gate) · up (SwiGLU); ACT 1 gpt-oss's clamped SwiGLU (up′ + 1) · g′ σ(1.702 g′) with
        (g′, up′) = :func:`clamped` (gate, up)."""
        g = hg.to(gl.float32)
        if ACT == 0:
            a = g * sigmoid(g, FTZ) * hu.to(gl.float32)
        else:
            gc, uc = clamped(g, hu.to(gl.float32))
            a = (uc + 1.0) * (gc * sigmoid(1.702 * gc, FTZ))
        return a.to(hg.dtype)

    @gluon.jit
    def _gate_up_mainloop(x_bufs, w_bufs, tma_ready, cp_ready, empty, step, k_tiles, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, GU_FUSED: gl.constexpr):
        """One tile's wgmma chain over the ring from ring step ``step`` (one K-block in flight; the slot before it goes
        back to the loader): the gate and up accumulators (BLOCK_M, BLOCK_N) float32, and the next ring step.
        ``GU_FUSED``: one (BLOCK_M, 2·BLOCK_N) product per K-block (the slot's W box holds the gate rows, then the
        up rows), split in two afterwards; else a gate and an up product."""
        if GU_FUSED:
            acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                                 instr_shape=[16, 2 * BLOCK_N, 16])
            acc = gl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=gl.float32, layout=acc_layout)
            for ki in range(k_tiles):
                s = wait_gathered_slot(tma_ready, cp_ready, step, STAGES)
                acc = warpgroup_mma(x_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=ki > 0)
                step += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            acc_g, acc_u = column_halves(acc)
        else:
            acc_layout2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                                  instr_shape=[16, BLOCK_N, 16])
            acc_g = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout2)
            acc_u = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout2)
            for ki in range(k_tiles):
                s = wait_gathered_slot(tma_ready, cp_ready, step, STAGES)
                w_buf = w_bufs.index(s)
                x_buf = x_bufs.index(s)
                acc_g = warpgroup_mma(x_buf, w_buf.slice(0, BLOCK_N).permute((1, 0)), acc_g, is_async=True)
                acc_u = warpgroup_mma(x_buf, w_buf.slice(BLOCK_N, BLOCK_N).permute((1, 0)), acc_u, is_async=True)
                # this K-block's two MMAs in flight: the previous block's are done, its slot goes back
                acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=ki > 0)
                step += 1
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k_tiles > 0)
        return acc_g, acc_u, step

    @gluon.jit
    def _buffer_stores(c_smem, hg, hu, a, h_desc, a_desc, h_ptr, a_ptr, row_start, row_end, col0, N, stride_hr,
                       stride_ar, STORE_H: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       WARPS: gl.constexpr):
        """The tile's outputs through the staging buffer ``c_smem``: a full tile's H gate block, H up block and A
        block by TMA stores, each drained before the buffer is rewritten; an expert's last tile (the rows past its end
        belong to the next expert) by masked 16-byte stores from a row-major register layout."""
        if row_end - row_start >= BLOCK_M:
            if STORE_H:
                tma.store_wait(pendings=0)
                c_smem.store(hg)
                fence_async_shared()
                tma.async_copy_shared_to_global(h_desc, [row_start, col0], c_smem)
                tma.store_wait(pendings=0)
                c_smem.store(hu)
                fence_async_shared()
                tma.async_copy_shared_to_global(h_desc, [row_start, N + col0], c_smem)
            tma.store_wait(pendings=0)
            c_smem.store(a)
            fence_async_shared()
            tma.async_copy_shared_to_global(a_desc, [row_start, col0], c_smem)
        else:
            if STORE_H:
                _store_rows(c_smem, hg, h_ptr, row_start, row_end, col0, stride_hr, BLOCK_M, BLOCK_N, WARPS)
                _store_rows(c_smem, hu, h_ptr, row_start, row_end, N + col0, stride_hr, BLOCK_M, BLOCK_N, WARPS)
            _store_rows(c_smem, a, a_ptr, row_start, row_end, col0, stride_ar, BLOCK_M, BLOCK_N, WARPS)

    @gluon.jit
    def _up_mma(x_bufs, w_bufs, tma_ready, cp_ready, empty, c_smem, h_smem, h_full, h_empty, h_desc, a_desc, h_ptr,
                a_ptr, b1_ptr, table_ptr, num_pid_n, N, D, stride_hr, stride_ar, HAS_BIAS: gl.constexpr,
                STORE_H: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr, WARPS: gl.constexpr, GU_FUSED: gl.constexpr, PART: gl.constexpr,
                EPI: gl.constexpr, H_PACKED: gl.constexpr = True, SIG_FTZ: gl.constexpr = False,
                ACT: gl.constexpr = 0):
        """MMA partition: each tile's gate and up products over the ring (:func:`_gate_up_mainloop`), then the
        activation's epilogue (:func:`_gated_act`, ``ACT``) and the stores (:func:`_buffer_stores`); with ``EPI`` (a
        storer partition), the rounded gate and up blocks staged in ``h_smem`` for :func:`_up_storer` instead. ``PART``
        1 (timing only): the MMAs alone, the row sums of the gate and up products stored in A's column ``pid_n`` (H
        unwritten)."""
        dtype: gl.constexpr = a_ptr.dtype.element_ty
        total = gl.load(table_ptr) * num_pid_n
        k_tiles = D // BLOCK_K
        step = 0
        i = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            e, row_start, row_end, pid_n = _tile_of(tile, table_ptr, num_pid_n)
            acc_g, acc_u, step = _gate_up_mainloop(x_bufs, w_bufs, tma_ready, cp_ready, empty, step, k_tiles, BLOCK_M,
                                                   BLOCK_N, STAGES, WARPS, GU_FUSED)
            if PART == 1:
                rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_g.type.layout))
                gl.store(a_ptr + rows.to(gl.int64) * stride_ar + pid_n, gl.sum(acc_g + acc_u, axis=1).to(dtype),
                         mask=rows < row_end)
            else:
                cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_g.type.layout))
                if HAS_BIAS:
                    b_base = b1_ptr + e.to(gl.int64) * (2 * N)
                    acc_g = acc_g + gl.load(b_base + cols).to(gl.float32)[None, :]
                    acc_u = acc_u + gl.load(b_base + N + cols).to(gl.float32)[None, :]
                if H_PACKED:
                    hg = _round_pairs(acc_g, dtype)
                    hu = _round_pairs(acc_u, dtype)
                else:
                    hg = acc_g.to(dtype)
                    hu = acc_u.to(dtype)
                if EPI:
                    mbarrier.wait(h_empty.index(0), (i & 1) ^ 1)  # the storer is done with the previous tile
                    h_smem.index(0).store(hg)
                    h_smem.index(1).store(hu)
                    fence_async_shared()
                    gl.thread_barrier()
                    mbarrier.arrive(h_full.index(0))
                else:
                    a = _gated_act(hg, hu, ACT, SIG_FTZ)
                    _buffer_stores(c_smem, hg, hu, a, h_desc, a_desc, h_ptr, a_ptr, row_start, row_end,
                                   pid_n * BLOCK_N, N, stride_hr, stride_ar, STORE_H, BLOCK_M, BLOCK_N, WARPS)
            i += 1
        if not EPI:
            tma.store_wait(pendings=0)

    @gluon.jit
    def _up_storer(h_smem, h_full, h_empty, h_desc, h_ptr, a_ptr, table_ptr, num_pid_n, N, stride_hr, stride_ar,
                   STORE_H: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr,
                   CHUNK: gl.constexpr, H_TMA: gl.constexpr, SIG_FTZ: gl.constexpr = False,
                   ACT: gl.constexpr = 0):
        """Storer partition (``EPI_WARPS`` > 0): per tile, once the MMA warps have staged H's rounded gate and up blocks
        in ``h_smem``, their 16-byte stores (masked in an expert's last tile; with ``H_TMA``, a full tile's by TMA), and
        A = act(gate, up) (:func:`_gated_act`, ``ACT``) from the staged values, ``CHUNK`` rows at a time, by 16-byte
        stores; the staging set goes back to the MMA warps once every storer thread (and any TMA store) is done reading
        it. The MMA warps meanwhile run the next tile."""
        TPN: gl.constexpr = BLOCK_N // 8
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPN, TPN], [WARPS, 1], [1, 0])
        offs_r = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, ld))
        offs_c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ld))
        g_buf = h_smem.index(0)
        u_buf = h_smem.index(1)
        total = gl.load(table_ptr) * num_pid_n
        i = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            e, row_start, row_end, pid_n = _tile_of(tile, table_ptr, num_pid_n)
            col0 = pid_n * BLOCK_N
            full = (row_end - row_start >= BLOCK_M) & H_TMA
            mbarrier.wait(h_full.index(0), i & 1)
            if STORE_H:
                if full:
                    tma.async_copy_shared_to_global(h_desc, [row_start, col0], g_buf)
                    tma.async_copy_shared_to_global(h_desc, [row_start, N + col0], u_buf)
            for r0 in gl.static_range(0, BLOCK_M, CHUNK):
                hg = g_buf.slice(r0, CHUNK).load(ld)
                hu = u_buf.slice(r0, CHUNK).load(ld)
                rows = (row_start + r0 + offs_r).to(gl.int64)
                ok = ((row_start + r0 + offs_r) < row_end)[:, None] & (offs_c >= 0)[None, :]
                cols = col0 + offs_c
                if STORE_H:
                    if not full:
                        h_rows = h_ptr + rows[:, None] * stride_hr + cols[None, :]
                        gl.store(h_rows, hg, mask=ok)
                        gl.store(h_rows + N, hu, mask=ok)
                a = _gated_act(hg, hu, ACT, SIG_FTZ)
                gl.store(a_ptr + rows[:, None] * stride_ar + cols[None, :], a, mask=ok)
            tma.store_wait(pendings=0)  # the TMA stores have read the staging set
            gl.thread_barrier()  # and every storer thread is done with it
            mbarrier.arrive(h_empty.index(0))
            i += 1

    @gluon.jit
    def _up_ws_kernel(x_ptr, w_desc, h_desc, a_desc, h_ptr, a_ptr, b1_ptr, row_token_ptr, table_ptr, num_pid_n, N, D,
                      stride_x, stride_hr, stride_ar, X_LAYOUT: gl.constexpr, HAS_BIAS: gl.constexpr,
                      STORE_H: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                      STAGES: gl.constexpr, MMA_WARPS: gl.constexpr, LOADER_WARPS: gl.constexpr,
                      LOADER_REGS: gl.constexpr, GU_FUSED: gl.constexpr, PART: gl.constexpr, EPI_WARPS: gl.constexpr,
                      EPI_REGS: gl.constexpr, EPI_CHUNK: gl.constexpr, EPI_H_TMA: gl.constexpr,
                      H_PACKED: gl.constexpr = True, SIG_FTZ: gl.constexpr = False,
                      ACT: gl.constexpr = 0):
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], X_LAYOUT)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, 2 * BLOCK_N, BLOCK_K], w_desc.layout)
        tma_ready, cp_ready, empty = gather_ring_barriers(STAGES, LOADER_WARPS)
        if EPI_WARPS > 0:  # a storer partition: H's gate and up blocks handed over through one staging set
            h_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], a_desc.layout)
            h_full = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
            h_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
            mbarrier.init(h_full.index(0), count=1)
            mbarrier.init(h_empty.index(0), count=1)
            gl.warp_specialize([
                (_up_mma, (x_bufs, w_bufs, tma_ready, cp_ready, empty, h_smem.index(0), h_smem, h_full, h_empty,
                           h_desc, a_desc, h_ptr, a_ptr, b1_ptr, table_ptr, num_pid_n, N, D, stride_hr, stride_ar,
                           HAS_BIAS, STORE_H, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, MMA_WARPS, GU_FUSED, PART, True,
                           H_PACKED, SIG_FTZ, ACT)),
                (gather_loader, (x_ptr, w_desc, row_token_ptr, table_ptr, x_bufs, w_bufs, tma_ready, cp_ready,
                                 empty, num_pid_n, N, D, stride_x, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, LOADER_WARPS,
                                 True)),
                (_up_storer, (h_smem, h_full, h_empty, h_desc, h_ptr, a_ptr, table_ptr, num_pid_n, N, stride_hr,
                              stride_ar, STORE_H, BLOCK_M, BLOCK_N, EPI_WARPS, EPI_CHUNK, EPI_H_TMA, SIG_FTZ, ACT)),
            ], [LOADER_WARPS, EPI_WARPS], [LOADER_REGS, EPI_REGS])
            mbarrier.invalidate(h_full.index(0))
            mbarrier.invalidate(h_empty.index(0))
        else:
            c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], a_desc.layout)
            gl.warp_specialize([
                (_up_mma, (x_bufs, w_bufs, tma_ready, cp_ready, empty, c_smem, c_smem, empty, empty, h_desc, a_desc,
                           h_ptr, a_ptr, b1_ptr, table_ptr, num_pid_n, N, D, stride_hr, stride_ar, HAS_BIAS, STORE_H,
                           BLOCK_M, BLOCK_N, BLOCK_K, STAGES, MMA_WARPS, GU_FUSED, PART, False, H_PACKED,
                           SIG_FTZ, ACT)),
                (gather_loader, (x_ptr, w_desc, row_token_ptr, table_ptr, x_bufs, w_bufs, tma_ready, cp_ready,
                                 empty, num_pid_n, N, D, stride_x, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, LOADER_WARPS,
                                 True)),
            ], [LOADER_WARPS], [LOADER_REGS])
        invalidate_ring_barriers(tma_ready, cp_ready, empty, STAGES)


_CALLS: dict[tuple, dict] = {}


def up_ws_calls() -> list[dict]:
    """The shapes this process ran through :func:`up_proj_ws` (d, n, E, dtype, H stored, activation) with their
    config; benchmarks record it next to their timings (host bookkeeping, no sync)."""
    return [{"d": d, "n": n, "E": e, "dtype": dt, "store_h": sh, "activation": act, "config": cfg}
            for (d, n, e, dt, sh, act), cfg in _CALLS.items()]


def up_proj_ws(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, routing: Routing, store_h: bool = True,
               config: dict | None = None, activation: str = "swiglu") -> tuple[torch.Tensor | None, torch.Tensor]:
    """H (R, 2n) (None without ``store_h``) and A (R, n) by the warp-specialised kernel (see the module doc).

    The caller has checked :func:`up_ws_supported` (concat layout).

    Args:
        x: (T, d) bf16/fp16, contiguous. w1: (E, 2n, d) in the concat layout (gate rows [0, n), up rows [n, 2n)).
        b1: (E, 2n) or None. routing: rows sorted by expert (``row_token``, ``expert_offsets``).
        store_h: False for inference (H is not written). config: {"STAGES"} and optionally "LOADER_WARPS",
            "MAXNREG", "GU_FUSED", "EPI_WARPS" (4: the storer partition; then STAGES must leave room for its 64 KiB
            and MAXNREG defaults to 128), "EPI_REGS", "EPI_CHUNK", "EPI_H_TMA" (False: H by 16-byte stores),
            (GU_FUSED is ignored with a storer), "H_PACKED" (:data:`H_PACKED`), "SIGMOID_FTZ"
            (:data:`SIGMOID_FTZ`), and, to time a part alone, "PART": 1 the MMAs only (H unwritten, A holds row
            sums; no storer) (default :func:`up_ws_config` for d).
        activation: ``"swiglu"`` or ``"clamped_swiglu"`` (gpt-oss; :func:`sonicmoe.reference.swiglu_ref`), A's
            formula in the epilogue (the Triton kernel's values: :func:`sonicmoe.ops.kernel_lib.gated_act`).
    Returns:
        (H or None, A) in x's dtype (float32 accumulation); no atomics, the same bits on every run.
    Raises:
        ValueError: an unknown ``activation``.
    """
    act = act_code(activation)
    e, two_n, d = w1.shape
    n = two_n // 2
    r = routing.num_rows
    cfg = config or up_ws_config(d)
    epi_warps = cfg.get("EPI_WARPS", 0) if cfg.get("PART", 0) == 0 else 0
    a = new_output((r, n), device=x.device, dtype=x.dtype)
    h = new_output((r, two_n), device=x.device, dtype=x.dtype) if store_h else a
    if r == 0:
        return (h if store_h else None), a
    _CALLS[(d, n, e, str(x.dtype).removeprefix("torch."), store_h, activation)] = dict(cfg)
    table = routing_tile_table(routing, BLOCK_M)  # shared with the other kernels of this routing
    num_pid_n = n // BLOCK_N
    gu_fused = bool(cfg.get("GU_FUSED", GU_FUSED)) and not epi_warps  # a 256-wide wgmma does not fit 16 warps
    box = [BLOCK_M, BLOCK_N]
    a_desc = _descriptor(a, box)
    launch_kernel(
        _up_ws_kernel, (sm_count(x.device),),
        x, _descriptor(w1.view(e * two_n, d), [BLOCK_N, BLOCK_K]),
        _descriptor(h, box) if store_h else a_desc, a_desc, h, a,
        b1.contiguous() if b1 is not None else a, routing.row_token, table, num_pid_n, n, d, x.stride(0),
        h.stride(0), a.stride(0), X_LAYOUT=shared_layout((BLOCK_M, BLOCK_K), x.dtype), HAS_BIAS=b1 is not None,
        STORE_H=store_h, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, STAGES=cfg["STAGES"],
        MMA_WARPS=MMA_WARPS, LOADER_WARPS=cfg.get("LOADER_WARPS", LOADER_WARPS), LOADER_REGS=LOADER_REGS,
        GU_FUSED=gu_fused, PART=cfg.get("PART", 0), EPI_WARPS=epi_warps,
        EPI_REGS=cfg.get("EPI_REGS", EPI_REGS), EPI_CHUNK=cfg.get("EPI_CHUNK", EPI_CHUNK),
        EPI_H_TMA=cfg.get("EPI_H_TMA", EPI_H_TMA),
        H_PACKED=cfg.get("H_PACKED", H_PACKED), SIG_FTZ=cfg.get("SIGMOID_FTZ", SIGMOID_FTZ), ACT=act,
        num_warps=MMA_WARPS, maxnreg=cfg.get("MAXNREG", MAXNREG if not epi_warps else 128))
    return (h if store_h else None), a
