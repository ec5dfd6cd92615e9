"""Pieces every expert kernel shares: the varlen-M tile schedule, tile configurations, launch checks.

Tile schedule (varlen-M grouped GEMM, SPEC §3): expert e owns rows [off[e], off[e+1]) and
cdiv(T_e, BLOCK_M) M-tiles; M-tiles are numbered expert after expert. Program ``pid_m`` finds its
expert from an inclusive scan of the tile counts, computed in-kernel from ``expert_offsets`` (E+1
int32) — no host sync, no extra launch, and any BLOCK_M works (autotuning may change it). The grid
holds ``cdiv(R, BLOCK_M) + E`` M-tiles, an upper bound of Σ_e cdiv(T_e, BLOCK_M); the extra
programs exit at once.

Environment (documented in the README):
    SONICMOE_AUTOTUNE=0        use the pinned tile configuration instead of autotuning (the default
                               on GPU is to autotune once per (d, n, E, dtype)); the interpreter pins.
    SONICMOE_POISON_OUTPUTS=1  fill every kernel output with NaN before the kernel writes it (tests),
                               so an element no program writes shows up as NaN.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def autotune_enabled() -> bool:
    """Autotuning is on unless SONICMOE_AUTOTUNE=0 or under the interpreter (read at each launch)."""
    return os.environ.get("SONICMOE_AUTOTUNE", "1") != "0" and not interpreting()


def configs(space: list[dict], warps_stages: list[tuple[int, int]]) -> list[triton.Config]:
    """Cartesian product of block-size dicts and (num_warps, num_stages) pairs."""
    return [triton.Config(dict(s), num_warps=w, num_stages=st) for s in space for (w, st) in warps_stages]


def launch(kernel, tuned_kernel, grid, args: dict, pinned: dict, gpu_default: dict):
    """Launch ``kernel`` with the pinned config (interpreter / SONICMOE_AUTOTUNE=0) or ``tuned_kernel``.

    ``grid`` is a callable of the meta-parameters. ``pinned`` is the interpreter's config (small
    blocks); ``gpu_default`` the pinned GPU config, a dict with block sizes plus num_warps/num_stages.
    """
    if interpreting():
        kernel[grid(pinned)](**args, **pinned)
    elif autotune_enabled():
        tuned_kernel[grid](**args)
    else:
        meta = dict(gpu_default)
        kernel[grid(meta)](**args, **meta)


def new_output(shape, *, device, dtype) -> torch.Tensor:
    """``torch.empty`` for kernel outputs; NaN-filled (or int-min) when SONICMOE_POISON_OUTPUTS=1."""
    out = torch.empty(shape, device=device, dtype=dtype)
    if os.environ.get("SONICMOE_POISON_OUTPUTS", "0") == "1":
        out.fill_(float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min)
    return out


def dot_precision(dtype: torch.dtype) -> str:
    """float32 operands use exact fp32 products ("ieee"); bf16/fp16 use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_device(name: str, t: torch.Tensor) -> None:
    """Kernels need CUDA tensors, or CPU tensors under the interpreter."""
    if t.is_cuda or (interpreting() and t.device.type == "cpu"):
        return
    raise ValueError(
        f"{name} is on {t.device}; the triton backend needs CUDA tensors (or CPU tensors with "
        "TRITON_INTERPRET=1). Use backend='torch' elsewhere."
    )


def next_pow2(x: int) -> int:
    return triton.next_power_of_2(max(int(x), 1))


def max_m_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound of Σ_e cdiv(T_e, BLOCK_M): the M-tiles of the varlen-M grid."""
    return triton.cdiv(num_rows, block_m) + num_experts


@triton.jit
def expert_tile(offsets_ptr, pid_m, E, E_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first row, end row) of varlen-M tile ``pid_m``; expert == E past the last tile."""
    eidx = tl.arange(0, E_P2)
    emask = eidx < E
    lo = tl.load(offsets_ptr + eidx, mask=emask, other=0)
    hi = tl.load(offsets_ptr + eidx + 1, mask=emask, other=0)
    ntiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(ntiles, 0)
    e = tl.sum((cum <= pid_m).to(tl.int32), 0)
    sel = eidx == e
    first_tile = tl.sum(tl.where(sel, cum - ntiles, 0), 0)
    row_start = tl.sum(tl.where(sel, lo, 0), 0) + (pid_m - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(sel, hi, 0), 0)
    return e, row_start, row_end
