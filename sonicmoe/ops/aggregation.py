"""Aggregation: a deterministic gather-and-sum over each token's rows (SPEC §3 kernel 3, §4 kernel 5).

O_t = Σ_{slots j of token t} w_j · Y[token_rows[j]], summed in slot order in float32: no atomics,
bitwise reproducible. The slot loop is unrolled by UNROLL (the mean slots per token, at most 8, set per
launch) so that several rows' loads are in flight at once; the additions keep slot order.
Forward: Y the expert outputs, w the scores S. Backward: dX_t = Σ dX̃ rows
(w = 1). Works for any number of experts per token (general routing, token rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..routing import Routing
from .common import autotuners, check_device, launch, new_output, next_pow2, pdl_prologue


@triton.jit(do_not_specialize=["T"])
def _gather_sum_kernel(
    y_ptr, w_ptr, out_ptr, token_offsets_ptr, token_rows_ptr,
    T, D, stride_yr, stride_ot,
    HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = t < T
    start = tl.load(token_offsets_ptr + t, mask=mask_t, other=0)
    cnt = tl.load(token_offsets_ptr + t + 1, mask=mask_t, other=0) - start
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = cols < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    # UNROLL slots per step: their independent row loads are all in flight at once (the sum is latency-
    # bound otherwise); the adds still run in slot order, so the bits do not depend on UNROLL
    for j0 in range(0, tl.max(cnt, 0), UNROLL):
        for u in tl.static_range(UNROLL):
            j = j0 + u
            valid = mask_t & (j < cnt)
            row = tl.load(token_rows_ptr + start + j, mask=valid, other=0).to(tl.int64)
            y = tl.load(y_ptr + row[:, None] * stride_yr + cols[None, :], mask=valid[:, None] & mask_d[None, :],
                        other=0.0).to(tl.float32)
            if HAS_W:
                y = y * tl.load(w_ptr + start + j, mask=valid, other=0.0).to(tl.float32)[:, None]
            acc += y
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_ot + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_t[:, None] & mask_d[None, :])


# measured on H100 (benchmarks/tune_sweep.py --space focus, 2026-11-24): one token x 1024 channels per program
# with 8 slots unrolled: 7B 0.248 ms (was 0.263 with 4 x 512 one slot at a time), (32768, 4096, 1024, 128, 8)
# 0.819 ms (was 0.908)
_GPU_DEFAULT = {"BLOCK_T": 1, "BLOCK_D": 1024, "num_warps": 4}
TUNING_SPACE = [
    triton.Config({"BLOCK_T": bt, "BLOCK_D": bd}, num_warps=w)
    for bt, bd, w in ((1, 1024, 4), (2, 1024, 4), (4, 512, 4), (1, 512, 4))
]
_tuned = autotuners(_gather_sum_kernel, TUNING_SPACE, ["D", "HAS_W", "UNROLL"])


def gather_sum(y: torch.Tensor, routing: Routing, slot_weights: torch.Tensor | None,
               config: dict | None = None) -> torch.Tensor:
    """O (T, d) with O_t = Σ_j w_j Y[token_rows[j]] over the slots j of token t (w = 1 when None).

    Args:
        y: (R, d) rows sorted by expert. routing: the token CSR (``token_offsets``, ``token_rows``).
        slot_weights: (R,) weights in token-slot order (float32, or bf16/fp16 read as float32), or None.
        config: explicit block configuration (tuning sweeps), else pinned/autotuned.
    Returns:
        (T, d) in y's dtype; tokens with no rows get zeros.
    """
    check_device("y", y)
    y = y.contiguous()
    t, d = routing.num_tokens, y.shape[1]
    out = new_output((t, d), device=y.device, dtype=y.dtype)
    if t == 0:
        return out
    args = dict(
        y_ptr=y, w_ptr=slot_weights if slot_weights is not None else y, out_ptr=out,
        token_offsets_ptr=routing.token_offsets, token_rows_ptr=routing.token_rows, T=t, D=d,
        stride_yr=y.stride(0), stride_ot=out.stride(0), HAS_W=slot_weights is not None,
    )
    grid = lambda m: (triton.cdiv(t, m["BLOCK_T"]), triton.cdiv(d, m["BLOCK_D"]))
    pinned = {"BLOCK_T": 8, "BLOCK_D": min(next_pow2(d), 32)}
    # slots per unrolled step: the mean slots per token (K under top-k; R and T are host ints, no sync), <= 8
    args["UNROLL"] = min(next_pow2(-(-routing.num_rows // t)), 8)
    launch(_gather_sum_kernel, _tuned, grid, args, pinned, _GPU_DEFAULT, config, pdl_device=y.device)
    return out


def gather_sum_ref(y: torch.Tensor, routing: Routing, slot_weights: torch.Tensor | None) -> torch.Tensor:
    """Pure-PyTorch twin of :func:`gather_sum` (float32, per-slot index_add)."""
    t = routing.num_tokens
    slot_token = torch.repeat_interleave(
        torch.arange(t, device=y.device), (routing.token_offsets[1:] - routing.token_offsets[:-1]).long()
    )
    rows = y[routing.token_rows.long()].float()
    if slot_weights is not None:
        rows = rows * slot_weights.float()[:, None]
    out = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device)
    return out.index_add(0, slot_token, rows).to(y.dtype)
