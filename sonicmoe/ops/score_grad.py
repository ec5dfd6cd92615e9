"""The router scores' gradient from the dH kernel's dS partial sums, in one launch (SPEC §4, dS = ⟨dA′, A⟩).

The dH kernel leaves dS as float32 partial sums, one row per channel block: ``ds_part`` (P, R) with
dS_row = Σ_j ds_part[j, row] (:func:`sonicmoe.ops.dh.dh` with ``reduce_ds=False``). Row r holds pair
``row_pair[r]``, so the gradient of the scores in pair order is

    dscores[row_pair[r]] = Σ_{j < P} ds_part[j, r]  (+ extra[r])   if r < expert_offsets[E]
                         = 0                                      otherwise (padding rows, which no kernel wrote),

summed in j order in float32, then cast to the scores' dtype. ``extra`` is an optional (R,) float32 addend in row
order (the expert bias's term ⟨dO_t, b2[e]⟩). One program per BLOCK rows: the partials are read in row order
(coalesced), and each pair is written once (``row_pair`` is a permutation): no atomics, the same bits every run.
It replaces five small torch kernels (the partials' sum, the gather, the padding mask, the select and the cast)
that ran beside the dW2 GEMM: at the 7B shape 36 µs against this kernel's 30 µs there (session 48, H100 timeline).
It runs on the side stream beside dW2, though that persistent kernel's programs cannot start on a multiprocessor
until this kernel's programs there have left (H100 timeline: dW2 began 9 µs after dH ended instead of 1.4). Where the
Gluon dH kernel's tiles span all n channels (n = 256 at 7B, no b2), that kernel writes dS itself with these bits
(:func:`sonicmoe.ops.dh.dh` with ``ds_pairs``), and this kernel does not run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv, check_device, new_output
from .fast_launch import launch_kernel

BLOCK = 1024


@triton.jit(do_not_specialize=["R"])
def _score_grad_kernel(part_ptr, row_pair_ptr, offsets_ptr, extra_ptr, out_ptr, R, E,
                       P: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = row < R
    real = mask & (row < tl.load(offsets_ptr + E))
    acc = tl.load(part_ptr + row, mask=real, other=0.0)
    for j in tl.static_range(1, P):
        acc += tl.load(part_ptr + j * R.to(tl.int64) + row, mask=real, other=0.0)
    if HAS_EXTRA:
        acc += tl.load(extra_ptr + row, mask=real, other=0.0)
    pair = tl.load(row_pair_ptr + row, mask=mask, other=0)
    tl.store(out_ptr + pair, tl.where(real, acc, 0.0).to(out_ptr.dtype.element_ty), mask=mask)


def _check(ds_part: torch.Tensor, row_pair: torch.Tensor, expert_offsets: torch.Tensor,
           extra: torch.Tensor | None) -> None:
    if ds_part.dim() != 2 or ds_part.dtype != torch.float32 or ds_part.shape[0] < 1:
        raise ValueError(f"ds_part: expected (P, R) float32 partial sums, got {tuple(ds_part.shape)} {ds_part.dtype}")
    r = ds_part.shape[1]
    if row_pair.shape != (r,) or row_pair.dtype != torch.int32:
        raise ValueError(f"row_pair: expected ({r},) int32, got {tuple(row_pair.shape)} {row_pair.dtype}")
    if expert_offsets.dim() != 1 or expert_offsets.dtype != torch.int32 or expert_offsets.shape[0] < 1:
        raise ValueError(f"expert_offsets: expected (E+1,) int32, got {tuple(expert_offsets.shape)} "
                         f"{expert_offsets.dtype}")
    if extra is not None and (extra.shape != (r,) or extra.dtype != torch.float32):
        raise ValueError(f"extra: expected ({r},) float32 in row order, got {tuple(extra.shape)} {extra.dtype}")


def score_grad(ds_part: torch.Tensor, row_pair: torch.Tensor, expert_offsets: torch.Tensor,
               extra: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gradient of the router scores in pair order from the dH kernel's dS partials (SPEC §4).

    Args:
        ds_part: (P, R) float32 partial sums of dS in row (expert-major) order, P ≥ 1.
        row_pair: (R,) int32 pair of each row, a permutation of 0..R−1 (:attr:`sonicmoe.routing.Routing.row_pair`).
        expert_offsets: (E+1,) int32; the pairs of rows at or past ``expert_offsets[E]`` (padding) get 0.
        extra: None or (R,) float32 added to each row's sum after the partials (the bias term ⟨dO_t, b2[e]⟩).
        out_dtype: the scores' dtype.
    Returns:
        (R,) ``out_dtype``: dS of each pair; the partials summed in order 0..P−1 in float32, then ``extra``.
    Raises:
        ValueError: on a shape or dtype other than the above, or on a CPU ``ds_part`` outside the interpreter.
    """
    check_device("ds_part", ds_part)
    _check(ds_part, row_pair, expert_offsets, extra)
    p, r = ds_part.shape
    out = new_output((r,), device=ds_part.device, dtype=out_dtype)
    if r == 0:
        return out
    ds_part = ds_part.contiguous()
    launch_kernel(_score_grad_kernel, (cdiv(r, BLOCK),), ds_part, row_pair.contiguous(), expert_offsets.contiguous(),
                  extra.contiguous() if extra is not None else ds_part, out, r, expert_offsets.shape[0] - 1,
                  P=p, HAS_EXTRA=extra is not None, BLOCK=BLOCK, num_warps=4)
    return out


def score_grad_ref(ds_part: torch.Tensor, row_pair: torch.Tensor, expert_offsets: torch.Tensor,
                   extra: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pure-PyTorch twin of :func:`score_grad` (runs on CPU)."""
    _check(ds_part, row_pair, expert_offsets, extra)
    acc = ds_part[0].clone()
    for j in range(1, ds_part.shape[0]):
        acc = acc + ds_part[j]
    if extra is not None:
        acc = acc + extra
    real = torch.arange(acc.shape[0], device=acc.device) < expert_offsets[-1].long()
    by_row = torch.where(real, acc, torch.zeros((), dtype=acc.dtype, device=acc.device)).to(out_dtype)
    out = torch.empty_like(by_row)
    out[row_pair.long()] = by_row
    return out
