"""Varlen-K grouped GEMM for the expert weight gradients (SPEC §4 kernels 2 and 4).

dW[e] = Σ_{rows r of e} P[p(r)]ᵀ Q[q(r)] — the reduction runs over each expert's rows, whose number
varies by expert (varlen-K). Either operand may be gathered by token inside its load:

* dW2[e] (d, n)  = Σ_r dO_{token(r)}ᵀ A′[r]      (P = dO gathered, Q = A′)
* dW1[e] (2n, d) = Σ_r dH[r]ᵀ x_{token(r)}       (P = dH, Q = X gathered)

One program owns one output tile of one expert and loops over that expert's rows: deterministic,
no atomics; experts with no rows get zero gradients. The loop runs over whole BLOCK_R-row chunks with no
row masks, then over the expert's last, partial chunk with rows past its end masked in both operands.
The operand that is not gathered (dH for dW1, A′ for dW2) is read through a TMA descriptor in full chunks
(P_TMA / Q_TMA). Columns are masked only where I or J is not a multiple of the block (EVEN_I / EVEN_J, set
per launch).

Two schedules. By default the grid is one program per tile. With ``STEPS`` (the default when an expert has
at most ``common.FEW_ROWS_PER_EXPERT`` rows on average) one program per multiprocessor runs its tiles as one
loop over (tile, whole chunk) steps, so the software pipeline crosses tile boundaries: the next tile's
chunks load while this tile finishes and stores. That pays where the reduction is short (few chunks per
tile: fine-grained experts, token rounding's sparse points) and costs where it is long (its stages hold
fewer chunks). Its results are bitwise those of the per-tile grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..routing import Routing
from . import weight_grad_ws
from .common import (
    autotuners,
    cdiv,
    check_device,
    config_dict,
    dot_precision,
    few_rows_per_expert,
    launch,
    new_output,
    next_pow2,
    programs,
    tile_config,
    tma_descriptor,
    with_even_flags,
)
from .kernel_lib import pdl_prologue, tile_schedule
from .load_order import routing_load_order, wgrad_order_by_load


@triton.jit
def _load_chunk(p_ptr, p_desc, q_ptr, q_desc, row_token_ptr, r0, hi, i0, j0, I, J, stride_p, stride_q,
                P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
                BLOCK_R: tl.constexpr, P_TMA: tl.constexpr, Q_TMA: tl.constexpr, TAIL: tl.constexpr,
                EVEN_I: tl.constexpr, EVEN_J: tl.constexpr, IN_BOUNDS: tl.constexpr = False):
    """The operands of rows [r0, r0 + BLOCK_R): Pᵀ (BLOCK_I, BLOCK_R) and Q (BLOCK_R, BLOCK_J).

    A full chunk (``TAIL`` False) lies inside the expert: no row mask, and a contiguous operand may come
    through its TMA descriptor (P_TMA / Q_TMA; the copy engine zero-fills columns past I / J). The tail
    chunk masks rows past the expert's end (``hi``) in both operands, so they add exactly nothing.
    ``IN_BOUNDS`` (a step whose chunk may not lie inside the expert, its product then discarded) masks the
    row indices and the contiguous operand's pointer loads only, so every address is valid; rows inside
    the expert load as in a full chunk.
    """
    rr = r0 + tl.arange(0, BLOCK_R)
    mask_r = rr < hi
    if P_GATHER or Q_GATHER:
        if TAIL or IN_BOUNDS:
            tok = tl.load(row_token_ptr + rr, mask=mask_r, other=0).to(tl.int64)
        else:
            tok = tl.load(row_token_ptr + rr).to(tl.int64)
    ii = i0 + tl.arange(0, BLOCK_I)
    jj = j0 + tl.arange(0, BLOCK_J)
    if P_TMA and not TAIL:
        pb = p_desc.load([r0, i0]).T
    else:
        if P_GATHER:
            pr = tok
        else:
            pr = rr.to(tl.int64)
        p_ptrs = p_ptr + pr[None, :] * stride_p + ii[:, None]
        if IN_BOUNDS and not P_GATHER:
            pb = tl.load(p_ptrs, mask=(ii < I)[:, None] & mask_r[None, :], other=0.0)
        elif TAIL and EVEN_I:
            pb = tl.load(p_ptrs, mask=mask_r[None, :], other=0.0)
        elif TAIL:
            pb = tl.load(p_ptrs, mask=(ii < I)[:, None] & mask_r[None, :], other=0.0)
        elif EVEN_I:
            pb = tl.load(p_ptrs)
        else:
            pb = tl.load(p_ptrs, mask=(ii < I)[:, None], other=0.0)
    if Q_TMA and not TAIL:
        qb = q_desc.load([r0, j0])
    else:
        if Q_GATHER:
            qr = tok
        else:
            qr = rr.to(tl.int64)
        q_ptrs = q_ptr + qr[:, None] * stride_q + jj[None, :]
        if IN_BOUNDS and not Q_GATHER:
            qb = tl.load(q_ptrs, mask=mask_r[:, None] & (jj < J)[None, :], other=0.0)
        elif TAIL and EVEN_J:
            qb = tl.load(q_ptrs, mask=mask_r[:, None], other=0.0)
        elif TAIL:
            qb = tl.load(q_ptrs, mask=mask_r[:, None] & (jj < J)[None, :], other=0.0)
        elif EVEN_J:
            qb = tl.load(q_ptrs)
        else:
            qb = tl.load(q_ptrs, mask=(jj < J)[None, :], other=0.0)
    return pb, qb


@triton.jit
def _varlen_k_kernel(
    p_ptr, p_desc, q_ptr, q_desc, out_ptr, row_token_ptr, offsets_ptr, order_ptr,
    E, I, J, stride_p, stride_q, stride_oe, stride_oi,
    P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr, DOT_PREC: tl.constexpr, E_P2: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr,
    P_TMA: tl.constexpr = False, Q_TMA: tl.constexpr = False,
    EVEN_I: tl.constexpr = False, EVEN_J: tl.constexpr = False, STEPS: tl.constexpr = False,
    PROGS_PER_SM: tl.constexpr = 0, PDL: tl.constexpr = False, LOAD_ORDER: tl.constexpr = False,
):
    pdl_prologue(PDL)
    tiles_j = tl.cdiv(J, BLOCK_J)
    tiles = tl.cdiv(I, BLOCK_I) * tiles_j
    if STEPS:
        _varlen_k_steps(p_ptr, p_desc, q_ptr, q_desc, out_ptr, row_token_ptr, offsets_ptr, order_ptr, E, I, J, tiles,
                        tiles_j, stride_p, stride_q, stride_oe, stride_oi, P_GATHER, Q_GATHER, DOT_PREC, E_P2,
                        BLOCK_I, BLOCK_J, BLOCK_R, P_TMA, Q_TMA, EVEN_I, EVEN_J, LOAD_ORDER)
        return
    pid = tl.program_id(0)
    if LOAD_ORDER:  # the experts' tiles busiest expert first (load_order.py)
        e = tl.load(order_ptr + pid // tiles)
    else:
        e = pid // tiles
    tile = pid % tiles
    i0 = (tile // tiles_j) * BLOCK_I
    j0 = (tile % tiles_j) * BLOCK_J
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)
    full = (hi - lo) // BLOCK_R
    acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    for c in range(0, full):  # whole chunks of the expert's rows: no row masks
        pb, qb = _load_chunk(p_ptr, p_desc, q_ptr, q_desc, row_token_ptr, lo + c * BLOCK_R, hi, i0, j0, I, J,
                             stride_p, stride_q, P_GATHER, Q_GATHER, BLOCK_I, BLOCK_J, BLOCK_R, P_TMA, Q_TMA, False,
                             EVEN_I, EVEN_J)
        acc = tl.dot(pb, qb, acc, input_precision=DOT_PREC)
    _tail_and_store(acc, p_ptr, q_ptr, out_ptr, row_token_ptr, e, lo, hi, full, i0, j0, I, J, stride_p, stride_q,
                    stride_oe, stride_oi, P_GATHER, Q_GATHER, DOT_PREC, BLOCK_I, BLOCK_J, BLOCK_R, EVEN_I, EVEN_J)


@triton.jit
def _tail_and_store(acc, p_ptr, q_ptr, out_ptr, row_token_ptr, e, lo, hi, full, i0, j0, I, J, stride_p, stride_q,
                    stride_oe, stride_oi, P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr, DOT_PREC: tl.constexpr,
                    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr, EVEN_I: tl.constexpr,
                    EVEN_J: tl.constexpr):
    """Adds the expert's last, partial chunk (rows past ``hi`` masked in both operands, pointer loads) to
    ``acc`` and stores the (BLOCK_I, BLOCK_J) tile of dW[e]; returns a zeroed accumulator."""
    if lo + full * BLOCK_R < hi:
        pb, qb = _load_chunk(p_ptr, None, q_ptr, None, row_token_ptr, lo + full * BLOCK_R, hi, i0, j0, I, J,
                             stride_p, stride_q, P_GATHER, Q_GATHER, BLOCK_I, BLOCK_J, BLOCK_R, False, False, True,
                             EVEN_I, EVEN_J)
        acc = tl.dot(pb, qb, acc, input_precision=DOT_PREC)
    ii = i0 + tl.arange(0, BLOCK_I)
    jj = j0 + tl.arange(0, BLOCK_J)
    out = out_ptr + e.to(tl.int64) * stride_oe + ii[:, None].to(tl.int64) * stride_oi + jj[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(ii < I)[:, None] & (jj < J)[None, :])
    return tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)


@triton.jit
def _varlen_k_steps(
    p_ptr, p_desc, q_ptr, q_desc, out_ptr, row_token_ptr, offsets_ptr, order_ptr, E, I, J, tiles, tiles_j,
    stride_p, stride_q, stride_oe, stride_oi,
    P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr, DOT_PREC: tl.constexpr, E_P2: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr, P_TMA: tl.constexpr, Q_TMA: tl.constexpr,
    EVEN_I: tl.constexpr, EVEN_J: tl.constexpr, LOAD_ORDER: tl.constexpr,
):
    """Persistent varlen-K: program ``pid`` owns tiles pid, pid + nprog, ... (tile t: expert t // tiles) and runs
    them as one loop over (tile, whole chunk) steps, so the software pipeline crosses tile boundaries. Under
    ``LOAD_ORDER`` tile t is expert order[t // tiles] (``order_ptr`` as
    :func:`sonicmoe.ops.load_order.expert_load_order` gives it, busiest first), and the waves of nprog tiles are
    dealt serpentine: program ``pid`` owns slot pid of the even waves and slot nprog − 1 − pid of the odd ones
    (:func:`sonicmoe.ops.weight_grad_ws.program_tiles`, as the Gluon kernel deals them).
    A tile takes max(whole chunks, 1) steps; a tile without a whole chunk (fewer than BLOCK_R rows, or none)
    discards its one step's product. The expert's last, partial chunk is added before the store, with
    masked loads of both operands, as in the one-program-per-tile kernel: results are bitwise the same."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # this program's steps: sum over experts of (its tiles of expert e) * max(whole chunks of e, 1). Its tiles of e
    # are those pid + w * nprog in [e * tiles, (e + 1) * tiles); under LOAD_ORDER those w * nprog + pid (w even) or
    # w * nprog + nprog - 1 - pid (w odd) in [rank_e * tiles, (rank_e + 1) * tiles), rank_e e's place in the order:
    # the waves w of each parity in a range [ceil((a - slot) / nprog), ceil((b - slot) / nprog)), counted in closed
    # form (evens in [L, H): (H + 1) // 2 - (L + 1) // 2; odds: H // 2 - L // 2)
    eidx, lo_v, hi_v, _, _, _ = tile_schedule(offsets_ptr, E, E_P2, BLOCK_R)
    emask = eidx < E
    steps_v = tl.maximum((hi_v - lo_v) // BLOCK_R, 1)
    if LOAD_ORDER:
        a = tl.load(order_ptr + E + eidx, mask=emask, other=0) * tiles
        mirror = nprog - 1 - pid
        even_lo = (tl.maximum(a - pid, 0) + nprog - 1) // nprog
        even_hi = (tl.maximum(a + tiles - pid, 0) + nprog - 1) // nprog
        odd_lo = (tl.maximum(a - mirror, 0) + nprog - 1) // nprog
        odd_hi = (tl.maximum(a + tiles - mirror, 0) + nprog - 1) // nprog
        mine = (even_hi + 1) // 2 - (even_lo + 1) // 2 + odd_hi // 2 - odd_lo // 2
    else:
        below_hi = (tl.maximum((eidx + 1) * tiles - pid, 0) + nprog - 1) // nprog
        below_lo = (tl.maximum(eidx * tiles - pid, 0) + nprog - 1) // nprog
        mine = below_hi - below_lo
    total = tl.sum(tl.where(emask, mine * steps_v, 0), 0)
    tile = pid - nprog
    wave = -1
    ci = -1
    nsteps = 0
    e = 0
    lo = 0
    hi = 0
    i0 = 0
    j0 = 0
    acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    for _ in range(0, total):
        ci = tl.where(ci == nsteps - 1, 0, ci + 1)
        if ci == 0:
            if LOAD_ORDER:
                wave += 1
                tile = wave * nprog + pid + (wave % 2) * (nprog - 1 - 2 * pid)
                e = tl.load(order_ptr + tile // tiles)
            else:
                tile += nprog
                e = tile // tiles
            sel = eidx == e
            lo = tl.sum(tl.where(sel, lo_v, 0), 0)
            hi = tl.sum(tl.where(sel, hi_v, 0), 0)
            nsteps = tl.maximum((hi - lo) // BLOCK_R, 1)
            t = tile % tiles
            i0 = (t // tiles_j) * BLOCK_I
            j0 = (t % tiles_j) * BLOCK_J
        # a whole chunk (or, in a tile without one, a step whose product is discarded; its row indices are
        # masked, so the loads stay in bounds)
        pb, qb = _load_chunk(p_ptr, p_desc, q_ptr, q_desc, row_token_ptr, lo + ci * BLOCK_R, hi, i0, j0, I, J,
                             stride_p, stride_q, P_GATHER, Q_GATHER, BLOCK_I, BLOCK_J, BLOCK_R, P_TMA, Q_TMA, False,
                             EVEN_I, EVEN_J, True)
        acc = tl.dot(pb, qb, acc, input_precision=DOT_PREC)
        if ci == nsteps - 1:
            full = (hi - lo) // BLOCK_R
            if full == 0:
                acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
            acc = _tail_and_store(acc, p_ptr, q_ptr, out_ptr, row_token_ptr, e, lo, hi, full, i0, j0, I, J,
                                  stride_p, stride_q, stride_oe, stride_oi, P_GATHER, Q_GATHER, DOT_PREC, BLOCK_I,
                                  BLOCK_J, BLOCK_R, EVEN_I, EVEN_J)


# measured on H100 (benchmarks/tune_sweep.py --space focus, 2026-11-24): the index load of the gathered
# operand takes pipeline stages, so num_stages 5 / 7 prefetch 2 / 3 chunks ahead (3-4 prefetched one:
# ~380 TFLOP/s); tiles 256 wide on the contiguous (TMA-loaded) operand, 128 on the gathered one: 7B dW1
# 0.58 ms (530 TFLOP/s, was 0.763), dW2 (7 stages) 0.297 ms (520, was 0.434); (32768, 4096, 1024, 128, 8)
# dW2 3.5-3.8 ms (575-633)
_GPU_DEFAULT_P_GATHERED = {"BLOCK_I": 128, "BLOCK_J": 256, "BLOCK_R": 64, "P_TMA": True, "Q_TMA": True,
                           "num_warps": 8, "num_stages": 7}
_GPU_DEFAULT = {"BLOCK_I": 256, "BLOCK_J": 128, "BLOCK_R": 64, "P_TMA": True, "Q_TMA": True, "num_warps": 8,
                "num_stages": 5}
# Few rows per expert (short reduction loops, where a tile's pipeline fill and store are a large share of its
# time): the persistent step loop, 5 stages (session 9, benchmarks/results/2026-11-24_nvidia-h100_varlen-k-steps/:
# (16384, 1536, 256, 512, 8) with token-rounded counts, 256 rows per expert: dW1 0.715 -> 0.640 ms, dW2 0.361 ->
# 0.340; on the 7B shape, 1536 rows per expert, it is slower: dW1 0.59 -> 0.71, dW2 0.30 -> 0.37); pinned for
# few rows per expert (common.few_rows_per_expert)
_STEPS = {"STEPS": True, "PROGS_PER_SM": 1, "num_stages": 5}
_PINNED_INTERP = {"BLOCK_I": 16, "BLOCK_J": 16, "BLOCK_R": 16}
_NAMES = ("BLOCK_I", "BLOCK_J", "BLOCK_R")
TUNING_SPACE = [
    tile_config(*c, names=_NAMES, P_TMA=True, Q_TMA=True) for c in
    ((256, 128, 64, 8, 5), (128, 256, 64, 8, 5), (256, 128, 64, 8, 7), (128, 256, 64, 8, 7), (128, 128, 64, 8, 5),
     (128, 128, 64, 4, 5))
] + [tile_config(128, 128, 64, 8, 5, names=_NAMES)] + [
    tile_config(*c, names=_NAMES, P_TMA=True, Q_TMA=True, STEPS=True, PROGS_PER_SM=1) for c in
    ((256, 128, 64, 8, 5), (128, 256, 64, 8, 5))
]

def _desc_blocks(meta: dict) -> dict:
    return {"p_desc": (meta["BLOCK_R"], meta["BLOCK_I"]), "q_desc": (meta["BLOCK_R"], meta["BLOCK_J"])}


_FLAG_DESCS = {"P_TMA": ("p_desc",), "Q_TMA": ("q_desc",)}
_varlen_k_kernel = with_even_flags(_varlen_k_kernel, EVEN_I=("I", "BLOCK_I"), EVEN_J=("J", "BLOCK_J"))
# the "mma" family's configs, the first pinned there (common.tile_family says how they were chosen)
PORTABLE_SPACE = [tile_config(*c, names=_NAMES) for c in
                  ((128, 128, 64, 8, 4), (128, 128, 32, 8, 4), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4))]
_tuned = autotuners(_varlen_k_kernel, TUNING_SPACE, ["E", "I", "J", "P_GATHER", "Q_GATHER"], _desc_blocks,
                    PORTABLE_SPACE, config_dict(PORTABLE_SPACE[0]))


def varlen_k_gemm(p: torch.Tensor, q: torch.Tensor, routing: Routing, *, p_gather: bool, q_gather: bool,
                  out_dtype: torch.dtype, config: dict | None = None, gluon: bool = True) -> torch.Tensor:
    """dW (E, I, J) with dW[e] = Σ_{rows r of e} P[p(r)]ᵀ Q[q(r)] (varlen-K grouped GEMM, SPEC §4 kernels 2, 4).

    Args:
        p: (T or R, I); rows gathered by ``routing.row_token`` when ``p_gather``.
        q: (T or R, J); likewise with ``q_gather``.
        out_dtype: dtype of the gradient (the weight's); accumulation is float32.
        gluon: False keeps the Triton kernel where the Gluon one would serve (see below).
        config: explicit tile configuration (tuning sweeps), else pinned/autotuned. The pinned GPU tiles
            are 256 wide on the operand that is not gathered (read through a TMA descriptor when its
            rows are 16-byte aligned, pointer loads otherwise) and 128 on the gathered one.
    Returns:
        (E, I, J) in ``out_dtype``; experts with no rows get zeros. Deterministic (no atomics).

    The experts' tiles run in expert order, or busiest expert first with ``SONICMOE_WGRAD_ORDER=load``
    (:func:`sonicmoe.ops.load_order.routing_load_order`): the same bits either way.

    On Hopper (sm_90), without an explicit ``config``, bf16/fp16 products whose I and J are tile multiples run
    the warp-specialised Gluon kernel (:func:`sonicmoe.ops.weight_grad_ws.wgrad_ws`, a loader warpgroup for
    the gathered rows); it gives the same bits. ``SONICMOE_GLUON=0`` or ``SONICMOE_GLUON_WGRAD=0`` turns it off.
    """
    check_device("p", p)
    p, q = p.contiguous(), q.contiguous()
    if routing.num_rows == 0 or (p_gather and p.shape[0] == 0) or (q_gather and q.shape[0] == 0):
        # no real row (a gathered operand without rows has none to point at): dW = 0, and no launch, whose
        # steps without a whole chunk would load the clamped row 0 of an empty operand
        return torch.zeros((routing.num_experts, p.shape[1], q.shape[1]), device=p.device, dtype=out_dtype)
    use_gluon = gluon and config is None
    # SONICMOE_WGRAD_ORDER=load: the experts' tiles busiest first (load_order.py); else index order, no order read
    order = routing_load_order(routing) if wgrad_order_by_load() else None
    if use_gluon and weight_grad_ws.wgrad_ws_supported(p, q, p_gather=p_gather, q_gather=q_gather, out_dtype=out_dtype):
        return weight_grad_ws.wgrad_ws(p, q, routing.row_token, routing.expert_offsets, p_gather=p_gather,
                                       expert_order=order)
    e = routing.num_experts
    i_dim, j_dim = p.shape[1], q.shape[1]
    out = new_output((e, i_dim, j_dim), device=p.device, dtype=out_dtype)
    # the operand that is not gathered is read through a TMA descriptor in configs with P_TMA / Q_TMA
    args = dict(
        p_ptr=p, p_desc=None if p_gather else tma_descriptor(p), q_ptr=q,
        q_desc=None if q_gather else tma_descriptor(q), out_ptr=out, row_token_ptr=routing.row_token,
        offsets_ptr=routing.expert_offsets, order_ptr=routing.expert_offsets if order is None else order,
        E=e, I=i_dim, J=j_dim, stride_p=p.stride(0), stride_q=q.stride(0), stride_oe=out.stride(0),
        stride_oi=out.stride(1), P_GATHER=p_gather, Q_GATHER=q_gather, DOT_PREC=dot_precision(p.dtype),
        E_P2=next_pow2(e), LOAD_ORDER=order is not None,
    )

    def grid(meta):
        tiles = e * cdiv(i_dim, meta["BLOCK_I"]) * cdiv(j_dim, meta["BLOCK_J"])
        return (programs(tiles, meta.get("PROGS_PER_SM", 0) if meta.get("STEPS") else 0, p.device),)

    # pinned tiles: 256 wide on the operand that is not gathered; the step loop for few rows per expert
    gpu_default = _GPU_DEFAULT_P_GATHERED if p_gather else _GPU_DEFAULT
    if few_rows_per_expert(routing.num_rows, e):
        gpu_default = {**gpu_default, **_STEPS}
    launch(_varlen_k_kernel, _tuned, grid, args, _PINNED_INTERP, gpu_default, config, _desc_blocks, _FLAG_DESCS,
           pdl_device=p.device)
    return out


def varlen_k_gemm_ref(p: torch.Tensor, q: torch.Tensor, routing: Routing, *, p_gather: bool, q_gather: bool,
                      out_dtype: torch.dtype, config: dict | None = None, gluon: bool = True) -> torch.Tensor:
    """Pure-PyTorch twin of :func:`varlen_k_gemm` (float32 per-expert loop)."""
    offsets = routing.expert_offsets.tolist()
    out = torch.zeros(routing.num_experts, p.shape[1], q.shape[1], dtype=torch.float32, device=p.device)
    for i in range(routing.num_experts):
        lo, hi = offsets[i], offsets[i + 1]
        tok = routing.row_token[lo:hi].long()
        pi = p[tok] if p_gather else p[lo:hi]
        qi = q[tok] if q_gather else q[lo:hi]
        out[i] = pi.float().t() @ qi.float()
    return out.to(out_dtype)
