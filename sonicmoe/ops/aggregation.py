"""Aggregation: a deterministic gather-and-sum over each token's rows (SPEC §3 kernel 3, §4 kernel 5).

O_t = Σ_{slots j of token t} w_j · Y[token_rows[j]], summed in slot order in float32: no atomics,
bitwise reproducible. The slot loop is unrolled by UNROLL (the mean slots per token, at most
:data:`MAX_UNROLL`, set per launch) so that several rows' loads are in flight at once; the additions keep slot
order.
Forward: Y the expert outputs, w the scores S. Backward: dX_t = Σ dX̃ rows
(w = 1). Works for any number of experts per token (general routing, token rounding).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..routing import Routing
from .common import autotuners, cdiv, check_device, interpreting, launch, next_pow2, output_or_new, programs
from .kernel_lib import pdl_prologue


@triton.jit
def _add_slot(acc, j, y_ptr, w_ptr, token_rows_ptr, start, cnt, mask_t, cols, mask_d, stride_yr,
              HAS_W: tl.constexpr):
    """``acc`` plus slot ``j`` of each token of the tile (its Y row, times its weight with HAS_W; zeros for tokens
    with fewer slots), in float32."""
    valid = mask_t & (j < cnt)
    row = tl.load(token_rows_ptr + start + j, mask=valid, other=0).to(tl.int64)
    y = tl.load(y_ptr + row[:, None] * stride_yr + cols[None, :], mask=valid[:, None] & mask_d[None, :],
                other=0.0).to(tl.float32)
    if HAS_W:
        y = y * tl.load(w_ptr + start + j, mask=valid, other=0.0).to(tl.float32)[:, None]
    return acc + y


@triton.jit
def _sum_tile(tile, y_ptr, w_ptr, out_ptr, token_offsets_ptr, token_rows_ptr, T, D, num_d, stride_yr, stride_ot,
              HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr):
    """O for one (BLOCK_T tokens, BLOCK_D channels) tile: each token's slots summed in slot order in float32, in steps
    of UNROLL slots up to the tile's largest count."""
    t = (tile // num_d) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = t < T
    start = tl.load(token_offsets_ptr + t, mask=mask_t, other=0)
    cnt = tl.load(token_offsets_ptr + t + 1, mask=mask_t, other=0) - start
    cols = (tile % num_d) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = cols < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    # UNROLL slots per step: their independent row loads are all in flight at once (the sum is latency-bound
    # otherwise); the adds still run in slot order, so the bits do not depend on UNROLL
    for j0 in range(0, tl.max(cnt, 0), UNROLL):
        for u in tl.static_range(UNROLL):
            acc = _add_slot(acc, j0 + u, y_ptr, w_ptr, token_rows_ptr, start, cnt, mask_t, cols, mask_d, stride_yr,
                            HAS_W)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_ot + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_t[:, None] & mask_d[None, :])


@triton.jit(do_not_specialize=["T"])
def _gather_sum_kernel(
    y_ptr, w_ptr, out_ptr, token_offsets_ptr, token_rows_ptr,
    T, D, stride_yr, stride_ot,
    HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    num_d = tl.cdiv(D, BLOCK_D)
    # one (BLOCK_T tokens, BLOCK_D channels) tile per step: a program per tile, or a persistent grid
    # (fewer programs, each looping over tiles in steps of the grid) that stays resident beside another kernel.
    # (Session 65 also let the compiler software-pipeline this loop, tl.range(num_stages=3 or 4), with the slot loop
    # static: no faster than without, benchmarks/results/2026-12-02_nvidia-h200_session65/call3_pipe.)
    for tile in range(tl.program_id(0), tl.cdiv(T, BLOCK_T) * num_d, tl.num_programs(0)):
        _sum_tile(tile, y_ptr, w_ptr, out_ptr, token_offsets_ptr, token_rows_ptr, T, D, num_d, stride_yr,
                  stride_ot, HAS_W, BLOCK_T, BLOCK_D, UNROLL)


# measured on H100 (benchmarks/tune_sweep.py --space focus, 2026-11-24): one token x 1024 channels per program
# with 8 slots unrolled: 7B 0.248 ms (was 0.263 with 4 x 512 one slot at a time), (32768, 4096, 1024, 128, 8)
# 0.819 ms (was 0.908)
_GPU_DEFAULT = {"BLOCK_T": 1, "BLOCK_D": 1024, "num_warps": 4}
# slots per unrolled step at most. Session 36 (benchmarks/results/2026-11-27_nvidia-h200_session36/, H200, medians of
# 5 rounds, that config): 4 against 8 at K = 8, top-k: 7B 0.180 against 0.183 ms, (32768, 4096, 1024, 128, 8)
# 0.573 against 0.575, (16384, 1536, 256, 512, 8) 0.124 against 0.126; token rounding there, whose tokens have
# varying slot counts (a token past 8 took a second, mostly masked step of 8): 0.126 against 0.131. 16: 0.163.
# H100 (..._nvidia-h100_session36/call4_*, 3 rounds), (16384, 1536, 256, E, 8), E = 256 and 512, both routings:
# 0.166-0.168 against 0.168-0.171
MAX_UNROLL = 4
TUNING_SPACE = [
    triton.Config({"BLOCK_T": bt, "BLOCK_D": bd}, num_warps=w)
    for bt, bd, w in ((1, 1024, 4), (2, 1024, 4), (4, 512, 4), (1, 512, 4))
]
_tuned = autotuners(_gather_sum_kernel, TUNING_SPACE, ["D", "HAS_W", "UNROLL"])
# the config a GPU aggregation with one program per tile runs where d is an odd multiple of 512 (not autotuned): one
# token per program, each of 64 threads one 16-byte vector (8 bf16 channels) of each row, no masked lanes where the
# 1024-channel configs leave half of each token's last program masked. Session 46
# (benchmarks/results/2026-11-27_nvidia-h100-h200_session46/), 7B shape, each config run back to back for 1.5 s after
# a 1 s warm-up: on an H200 0.165 ms and 0.117 J per call against 0.173-0.175 ms and 0.125 J for (1, 1024, 4), whose
# second program per token leaves half its lanes masked at d = 1536; on an H100 0.231 against 0.233-0.235 ms; at
# (32768, 4096, 1024, 128, 8) on the H200 level (0.568 against 0.569 ms). Layer A/Bs against the autotuned config
# (7 alternating rounds, 1 s warm-ups), 7B forward: 1.0656 against 1.0828 ms on an H200, 1.1515 against 1.1668 on
# an H100; forward+backward level within the rounds' spread (3.274 against 3.255, 3.455 against 3.444). Not where d is
# a multiple of 1024 or in a persistent grid: pinned at every multiple of 512, the 120B-n1024 layer's forward+backward
# took 37.91 against 36.62 ms on an H100 (5 of 5 rounds slower), its backward's dX aggregation running in 2048-column
# blocks as a persistent grid of 2 programs per multiprocessor (half the loads in flight of the 4-warp configs)
SLICE_CONFIG = {"BLOCK_T": 1, "BLOCK_D": 512, "num_warps": 2}
# the config of an aggregation kept to a few multiprocessors beside a persistent GEMM on the others (``num_programs``
# programs; :func:`sonicmoe.ops.common.agg_reserve`): 1024 threads per program, each one 16-byte vector of each of 8
# rows in flight. Session 53 (benchmarks/results/2026-11-28_nvidia-h100_session53/, one H100, scripts/reserve_probe.py)
# at (32768, 4096, 1024, 128, 8), the former 4-row config, half the columns on 16 / 24 / 32 programs alone:
# 2.09 / 1.43 / 1.11 ms (dX), against 3.68 / 2.47 / 1.87 for (4, 1024, 16 warps, 8 rows); beside the dX̃ GEMM
# 7.67 against 8.53 ms with 16. 8 rows in flight since session 62
# (benchmarks/results/2026-12-02_nvidia-h200_session62/, an H200, half the forward aggregation alone): 1.249 ms on 16
# programs and 2.445 on 8, against 1.694 and 3.318 with 4 rows; fast enough that the reserve (common.AGG_RESERVE)
# went from 16 to 12 multiprocessors
RESERVE_CONFIG = {"BLOCK_T": 8, "BLOCK_D": 1024, "num_warps": 32, "UNROLL": 8}
# (Sessions 65-66 also built a static loop over each token's first ⌈R / T⌉ slots for this config, the same bits:
# half the 120B-n1024 dX aggregation alone 2.155 ms on 8 programs against 3.794, but the layer level with 12 reserved
# (35.58 and 35.42 ms against 35.39 and 35.385) and with 8 (34.88 against 34.87 ms, 10 rounds): it ends before the GEMM
# beside it either way. Removed in session 67; the switch and scripts/agg_slots_probe.py are at commit cf28b31.)


def pinned_config(d: int, on_gpu: bool, progs_per_sm: int = 0) -> tuple[dict | None, int]:
    """(config, most slots per unrolled step) of an aggregation of width d. ``SONICMOE_AGG_CONFIG`` (read at each
    call) = "BLOCK_T:BLOCK_D:num_warps:max UNROLL" (e.g. 1:512:2:4) pins every aggregation to that config; ``auto``
    autotunes every one (as before session 46); unset: :data:`SLICE_CONFIG` on a GPU with one program per tile
    (``progs_per_sm`` 0) where d is an odd multiple of 512 (1536, 2560, ...), else autotuned. Config None means
    autotuned (or the pinned defaults under ``SONICMOE_AUTOTUNE=0`` and the interpreter).

    Raises:
        ValueError: a value that is not ``auto`` or four positive integers, BLOCK_T, BLOCK_D and num_warps powers of
            two.
    """
    value = os.environ.get("SONICMOE_AGG_CONFIG")
    if value is None:
        width = SLICE_CONFIG["BLOCK_D"]
        if on_gpu and not progs_per_sm and d % width == 0 and d % (2 * width):
            return dict(SLICE_CONFIG), MAX_UNROLL
        return None, MAX_UNROLL
    if value == "auto":
        return None, MAX_UNROLL
    *blocks, unroll = _config_parts(value, "SONICMOE_AGG_CONFIG", "'auto' or ")
    return dict(zip(("BLOCK_T", "BLOCK_D", "num_warps"), blocks, strict=True)), unroll


def _config_parts(value: str, name: str, alternatives: str = "") -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps, UNROLL) from the environment value ``value`` of ``name``.

    Raises:
        ValueError: not four positive integers separated by colons, BLOCK_T, BLOCK_D and num_warps powers of two
            (the kernel's ``tl.arange`` over BLOCK_T tokens needs one: BLOCK_T = 3 failed inside Triton instead).
            Decimal digits only, as :func:`sonicmoe.env.env_count` reads a count: ``int`` also took a sign, spaces
            and underscores ("1:512:2: 4", "+1:512:2:4", "1:5_12:2:4").
    """
    texts = value.split(":")
    parts = tuple(int(v) for v in texts) if all(v.isascii() and v.isdigit() for v in texts) else ()
    if len(parts) != 4 or min(parts) < 1 or any(v & (v - 1) for v in parts[:3]):
        raise ValueError(f"{name}: expected {alternatives}BLOCK_T:BLOCK_D:num_warps:UNROLL (positive "
                         f"integers, BLOCK_T, BLOCK_D and num_warps powers of two), got {value!r}")
    return parts


def reserve_config() -> dict:
    """The config of an aggregation kept to a few multiprocessors beside a GEMM (:data:`RESERVE_CONFIG`), or
    ``SONICMOE_AGG_RESERVE_CONFIG`` = "BLOCK_T:BLOCK_D:num_warps:UNROLL" where set (read at each call, for layer
    A/Bs; one program should fill a multiprocessor: BLOCK_T · BLOCK_D / (32 · num_warps) channels per thread and
    slot, UNROLL slots in flight).

    Raises:
        ValueError: a value that is not four positive integers, BLOCK_T, BLOCK_D and num_warps powers of two.
    """
    value = os.environ.get("SONICMOE_AGG_RESERVE_CONFIG")
    if value is None:
        config = dict(RESERVE_CONFIG)
    else:
        config = dict(zip(("BLOCK_T", "BLOCK_D", "num_warps", "UNROLL"),
                          _config_parts(value, "SONICMOE_AGG_RESERVE_CONFIG"), strict=True))
    return config


def gather_sum(y: torch.Tensor, routing: Routing, slot_weights: torch.Tensor | None,
               config: dict | None = None, out: torch.Tensor | None = None, progs_per_sm: int = 0,
               num_programs: int = 0) -> torch.Tensor:
    """O (T, d) with O_t = Σ_j w_j Y[token_rows[j]] over the slots j of token t (w = 1 when None).

    Args:
        y: (R, d) rows sorted by expert; a view with a unit inner stride is read through its row stride (a block
            of columns of a wider Y: :func:`sonicmoe.ops.library.gemm_then_gather_sum`).
        routing: the token CSR (``token_offsets``, ``token_rows``).
        slot_weights: (R,) weights in token-slot order (float32, or bf16/fp16 read as float32), or None.
        config: explicit block configuration (tuning sweeps), else :func:`pinned_config` (on a GPU
            :data:`SLICE_CONFIG` where d is an odd multiple of 512, one program per tile) or autotuned.
        out: a (T, d) tensor or view of y's dtype and device with a unit inner stride to write O into (the
            backward allocates it on its own stream before launching this on a side stream; a block of columns of
            a wider O), else a new one.
        progs_per_sm: 0 (default) launches one program per tile; k > 0 a persistent grid of k programs per
            multiprocessor looping over the tiles, which all become resident at once and leave room for a kernel
            running beside them (the backward's dW1 GEMM; :func:`sonicmoe.ops.library.experts_bwd_impl`).
        num_programs: k > 0 a persistent grid of k programs in all (wins over ``progs_per_sm``): with a config
            whose program fills a multiprocessor, the aggregation then keeps to about k multiprocessors beside a
            persistent GEMM on the others (:func:`sonicmoe.ops.library.gemm_then_gather_sum`).
    Returns:
        (T, d) in y's dtype (``out`` when given); tokens with no rows get zeros.

    Raises:
        ValueError: ``out`` of another shape, dtype or device, or with a non-unit inner stride; a negative
            ``num_programs``.
    """
    check_device("y", y)
    if num_programs < 0:
        raise ValueError(f"num_programs: expected 0 (not persistent) or a positive grid size, got {num_programs}")
    y = y if y.stride(-1) == 1 else y.contiguous()
    t, d = routing.num_tokens, y.shape[1]
    out = output_or_new(out, (t, d), y)
    if t == 0:
        return out
    args = dict(
        y_ptr=y, w_ptr=slot_weights.contiguous() if slot_weights is not None else y, out_ptr=out,
        token_offsets_ptr=routing.token_offsets, token_rows_ptr=routing.token_rows, T=t, D=d,
        stride_yr=y.stride(0), stride_ot=out.stride(0), HAS_W=slot_weights is not None,
    )
    if num_programs:
        grid = lambda m: (min(num_programs, cdiv(t, m["BLOCK_T"]) * cdiv(d, m["BLOCK_D"])),)
    else:
        grid = lambda m: (programs(cdiv(t, m["BLOCK_T"]) * cdiv(d, m["BLOCK_D"]), progs_per_sm, y.device),)
    pinned = {"BLOCK_T": 8, "BLOCK_D": min(next_pow2(d), 32)}
    max_unroll = MAX_UNROLL
    if config is None:
        config, max_unroll = pinned_config(d, y.is_cuda and not interpreting(), progs_per_sm or num_programs)
    # slots per unrolled step: the mean slots per token (K under top-k; R and T are host ints, no sync), capped
    args["UNROLL"] = min(next_pow2(cdiv(routing.num_rows, t)), max_unroll)
    launch(_gather_sum_kernel, _tuned, grid, args, pinned, _GPU_DEFAULT, config, pdl_device=y.device)
    return out


def gather_sum_ref(y: torch.Tensor, routing: Routing, slot_weights: torch.Tensor | None,
                   config: dict | None = None, out: torch.Tensor | None = None, progs_per_sm: int = 0,
                   num_programs: int = 0) -> torch.Tensor:
    """Pure-PyTorch twin of :func:`gather_sum` (float32 sums, float64 for float64 rows, which only this twin takes;
    per-slot index_add; ``config``, ``progs_per_sm`` and ``num_programs`` are ignored). A padded routing's padding
    slots are left out, as the kernel leaves them."""
    t = routing.num_tokens
    # each slot's token; the padding slots of a padded routing (after token_offsets[T]) get T, a row dropped below
    slots = torch.arange(routing.num_rows, device=y.device, dtype=routing.token_offsets.dtype)
    slot_token = torch.searchsorted(routing.token_offsets[1:], slots, right=True)
    acc = torch.promote_types(y.dtype, torch.float32)
    rows = y[routing.token_rows.long()].to(acc)
    if slot_weights is not None:
        rows = rows * slot_weights.to(acc)[:, None]
    res = torch.zeros(t + 1, y.shape[1], dtype=acc, device=y.device).index_add(0, slot_token, rows)[:t]
    return res.to(y.dtype) if out is None else out.copy_(res)
