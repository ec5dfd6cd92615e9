"""The Triton expert path as PyTorch custom operators (``torch.library``, namespace ``sonicmoe``).

Two operators, both opaque to ``torch.compile`` (dynamo and AOTAutograd see one node each; the Triton
kernels run inside) and capturable in CUDA graphs (no host synchronisation, no data-dependent shapes):

``sonicmoe::experts_fwd(x, w1, w2, b1?, b2?, pair_scores, expert_offsets, row_token, row_pair, pair_row,
token_offsets, token_rows, slot_pair?, gate_up_layout, save_h, tile_rows=0, activation="swiglu") -> (out, h)``
    The forward of SPEC §3: up-projection with the gather and SwiGLU fused (H, A), down-projection
    (Y), aggregation O_t = Σ S · Y. Returns O (T, d) and H (R, 2n) — or an empty (0, 2n) H when
    ``save_h`` is False (inference: the up-projection then never writes H). A and Y are freed inside. With a padded
    (static-length) routing, H's padding rows (past ``expert_offsets[E]``) are left unwritten: no kernel reads them,
    O and every gradient are the same bits, but H itself differs between calls there (opcheck's comparison of H
    fails on such routings for that reason).
    ``tile_rows``: the routing's hint (:attr:`~sonicmoe.routing.Routing.tile_rows`), which may choose a kernel.

``sonicmoe::experts_bwd(dout, x, w1, w2, b1?, b2?, h, pair_scores, expert_offsets, row_token, row_pair, pair_row,
token_offsets, token_rows, gate_up_layout, needs, activation="swiglu") -> (dx, dw1, dw2, db1, db2, dscores)``
    The backward of SPEC §4 (dH kernel, dW2, dX̃, dW1, dX aggregation, bias terms). ``needs`` holds six
    bools, one per output; an output that is not needed (or a bias that does not exist) is returned as
    an empty (0,) tensor and not computed.

Shapes (letters of SPEC §1): x (T, d); w1 (E, 2n, d) with gate/up rows in ``gate_up_layout``
(``"concat"``: rows [0, n) gate, [n, 2n) up; ``"interleaved"``: row 2i gate, 2i+1 up); w2 (E, d, n);
b1 (E, 2n); b2 (E, d); pair_scores (R,) in pair order (dS comes back in their dtype); the int32 routing arrays
of :class:`~sonicmoe.routing.Routing` (expert_offsets (E+1,), token_offsets (T+1,), the others (R,)); H (R, 2n)
in W1's layout; ``activation`` ``"swiglu"`` or ``"clamped_swiglu"`` (gpt-oss; :func:`sonicmoe.reference.swiglu_ref`),
A = act(gate, up). Every output shape follows from the input
shapes, so the fake (meta) implementations need no data.

The autograd formula of ``experts_fwd`` is registered here too (:func:`torch.library.register_autograd`),
with ``experts_bwd`` as its backward; :func:`_setup_context` documents the memory contract.
Users call the operators through :func:`sonicmoe.ops.moe_function.experts_triton` / :func:`sonicmoe.experts`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .._autocast import no_autocast
from .._device import on_device
from ..config import GATE_UP_LAYOUTS
from ..functional import check_activation
from ..routing import Routing
from . import grouped_gemm_ws, varlen_m_ws, weight_grad_ws
from .aggregation import gather_sum, reserve_config
from .common import agg_reserve, gather_chunk_width, kernel_backward, new_output, overlap_mode, side_stream, sm_count
from .dh import dh, ds_pairs_in_dh_kernel
from .grouped_gemm import down_proj, varlen_m_gemm
from .score_grad import score_grad
from .up_proj import up_proj
from .weight_grad import varlen_k_gemm

# the expert width n from which the weight gradients run the warp-specialised Gluon kernel (weight_grad_ws). Session 21
# layer A/Bs (7B: n = 256; 120B-n1024: n = 1024), fwd+bwd against the Triton kernels with the dX aggregation beside
# dW1: at n = 1024 the Gluon kernels are 2.3% (H200) and 13% (H100, noisy) faster; at n = 256 they are not: 0.8% faster
# (H200) and 1.2% slower (H100) without the overlap, 1.5% slower with the aggregation beside the persistent Gluon dW1
# (its tiles are split among the SMs in advance), and the Gluon dW2 alone is 0.8% slower (H100). The aggregation's
# share of dW1's time goes as 1/n. Those A/Bs used 25 ms warm-ups. With the Gluon kernels the dX aggregation runs
# after the dX̃ GEMM (beside its column blocks where d ≥ 4096: SONICMOE_AGG_CHUNK), and session 38's layer A/Bs with
# settled warm-ups (1 s, 5 alternating rounds; benchmarks/results/2026-11-27_nvidia-h100-h200_session38/) found them
# faster anyway at n = 256 and 128: 7B fwd+bwd 3.518 against 3.630 ms (H100) and 3.235 against 3.381 (H200);
# (40960, 768, 256, 128, 8) 2.847 against 3.053 (H200); (24576, 1536, 128, 256, 16) 4.537 against 4.977 (H100). The
# kernel does not serve n = 64 (wgrad_ws_config).
GLUON_WGRAD_MIN_N = 128


def gluon_wgrad_preferred(n: int) -> bool:
    """Whether the layer's backward runs dW1 and dW2 on the Gluon kernel (where it applies): experts of width
    n ≥ :data:`GLUON_WGRAD_MIN_N`, or every n under ``SONICMOE_GLUON_WGRAD=all`` (for layer A/Bs; read at each
    call). ``SONICMOE_GLUON_WGRAD=0`` turns the kernel off everywhere (``weight_grad_ws.wgrad_ws_enabled``)."""
    return grouped_gemm_ws.gluon_kernel_switch("SONICMOE_GLUON_WGRAD") == "all" or n >= GLUON_WGRAD_MIN_N


# the routing arrays experts_fwd takes, in order (slot_pair may be None: the identity)
FWD_ROUTING_FIELDS = ("expert_offsets", "row_token", "row_pair", "pair_row", "token_offsets", "token_rows",
                      "slot_pair")
# the subset the backward reads (slot_pair only maps the forward's scores into slot order; the dH kernel reads S
# through row_pair)
BWD_ROUTING_FIELDS = ("expert_offsets", "row_token", "row_pair", "pair_row", "token_offsets", "token_rows")


def _routing(num_tokens: int, num_experts: int, **arrays: Tensor | None) -> Routing:
    """A :class:`Routing` from the operator's tensors (made contiguous: the kernels index them flat)."""
    fields = {f: (None if v is None else v.contiguous()) for f, v in arrays.items()}
    return Routing(num_tokens=num_tokens, num_experts=num_experts, **fields)


def _check_layout(gate_up_layout: str) -> None:
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up_layout must be one of {GATE_UP_LAYOUTS}, got {gate_up_layout!r}")


def _no_rows(x: Tensor, row_token: Tensor) -> bool:
    """No token (T = 0: an empty batch, an expert-parallel rank that received nothing) or no row (R = 0): O is
    zero and so is every gradient. The kernels are not launched: their gathers clamp masked-off rows to token 0,
    which does not exist when T = 0 (session 72: an illegal memory access in the varlen-K GEMM)."""
    return x.shape[0] == 0 or row_token.shape[0] == 0


def _empty(like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The (0,) placeholder returned for a gradient nobody asked for."""
    return like.new_empty((0,), dtype=dtype if dtype is not None else like.dtype)


def gemm_then_gather_sum(a: Tensor, b: Tensor, bias: Tensor | None, routing: Routing, slot_weights: Tensor | None,
                         *, transpose_b: bool) -> Tensor:
    """O (T, d) = gather_sum(C) for the varlen-M grouped GEMM C (R, d) = A op(B[e]) (+ bias[e]), with optional
    slot weights: the backward's dX̃ GEMM and dX aggregation (A = dH (R, 2n), B = W1 (E, 2n, d), no weights;
    SPEC §4 kernels 3 and 5), or the forward's down-projection and aggregation form (A (R, n), B = W2 (E, d, n),
    ``transpose_b``, weights S; SPEC §3 kernels 2-3), which the forward does not run this way (probes only: in the
    layer it measured no faster on H100s, sessions 27 and 53, and slower on H200s, sessions 62 and 64; the switch that
    ran it, SONICMOE_FWD_AGG_BLOCKS, is at commit 34b4e37).

    Where :func:`~sonicmoe.ops.common.gather_chunk_width` gives a width w (by default on CUDA for d ≥ 2w), the GEMM
    runs in column blocks of C of width w (B's column block read through its strides, C written in place), and the
    memory-bound aggregation of each block runs on the high-priority side stream beside the compute-bound GEMM of
    the next block; only the last block's aggregation is left exposed. Each block's GEMM runs on
    :func:`varlen_m_ws.long_gemm` where :func:`varlen_m_ws.long_supported` holds and either
    :func:`~sonicmoe.ops.common.agg_reserve` leaves S > 0 multiprocessors to the aggregations (the default on
    sm_90; the block after an aggregation then runs on all but S, and that aggregation on S programs of
    :func:`~sonicmoe.ops.aggregation.reserve_config`) or :func:`varlen_m_ws.long_preferred` takes the form; else on
    the Triton kernel, with the aggregation's persistent grid of :func:`~sonicmoe.ops.common.overlap_mode` programs
    per multiprocessor beside it. The streams join before this returns (C, made here and read there, is freed on
    return), and the last block's aggregation, with nothing beside it, runs on one program per tile (as a
    persistent grid it took 0.61 ms at (32768, 4096, 1024, 128, 8) on an H200, session 64). Else (and for the Gluon
    down-projection) one GEMM, then one aggregation. Every output element is computed by the same kernels either way.

    (Running the last block's aggregation beside dW1 instead held dX̃ until dW1 ended: the 120B-n1024 backward's
    peak 7715 against 5667 MiB. It was 0.3 ms faster beside the Triton dW1 on an H100, session 27, but the Gluon
    dW1's programs fill their multiprocessors, and on 16 reserved ones beside it on 116 it was slower, session 53:
    35.21 against 34.88 ms. The switch, SONICMOE_AGG_BESIDE_DW1, is at commit 34b4e37.)

    Args: as :func:`~sonicmoe.ops.grouped_gemm.varlen_m_gemm` and :func:`~sonicmoe.ops.aggregation.gather_sum`.
    Returns: O (T, d) in A's dtype.
    """
    d = b.shape[1] if transpose_b else b.shape[2]
    width = gather_chunk_width(d, a.device)
    if width and grouped_gemm_ws.ws_supported(a, b, a.shape[0], transpose_b=transpose_b):
        width = 0  # the Gluon ping-pong kernel serves the whole GEMM (short reductions, k ≤ 256 / 512)
    if not width:
        return gather_sum(varlen_m_gemm(a, b, bias, routing, transpose_b=transpose_b), routing, slot_weights)
    a = a.contiguous()
    progs_per_sm = overlap_mode(a.device)
    side = side_stream(a.device) if progs_per_sm else None
    reserve = agg_reserve(a.device)
    c = new_output((a.shape[0], d), device=a.device, dtype=a.dtype)
    out = new_output((routing.num_tokens, d), device=a.device, dtype=a.dtype)
    blocks = [slice(c0, min(c0 + width, d)) for c0 in range(0, d, width)]
    # per block: on the streamed-B Gluon kernel (where the layer prefers it, or with multiprocessors reserved for
    # the aggregations), else on the Triton kernel
    on_long = [(varlen_m_ws.long_preferred(transpose_b) or reserve > 0)
               and varlen_m_ws.long_supported(a, b, bias, a.shape[0], transpose_b=transpose_b,
                                              width=cols.stop - cols.start) for cols in blocks]
    # aggregation i on `reserve` multiprocessors beside block i + 1's Gluon GEMM on the others
    reserved = [i + 1 < len(blocks) and reserve > 0 and on_long[i] and on_long[i + 1] for i in range(len(blocks))]
    for i, cols in enumerate(blocks):
        c0, w = cols.start, cols.stop - cols.start
        if on_long[i]:
            varlen_m_ws.long_gemm(a, b, None, routing, transpose_b=transpose_b, out=c[:, cols], col0=c0, width=w,
                                  num_programs=sm_count(a.device) - reserve if i and reserved[i - 1] else None)
        else:
            b_cols = b[:, cols] if transpose_b else b[:, :, cols]
            bias_cols = bias[:, cols].contiguous() if bias is not None else None
            varlen_m_gemm(a, b_cols, bias_cols, routing, transpose_b=transpose_b, out=c[:, cols])
        with _beside(side):
            if reserved[i]:
                gather_sum(c[:, cols], routing, slot_weights, out=out[:, cols], config=reserve_config(),
                           num_programs=reserve)
            else:  # beside the next block's GEMM; the last block alone: one program per tile
                alone = i + 1 == len(blocks)
                gather_sum(c[:, cols], routing, slot_weights, out=out[:, cols],
                           progs_per_sm=0 if alone else progs_per_sm)
    if side is not None:
        torch.cuda.current_stream(a.device).wait_stream(side)
    return out


# ------------------------------------------------------------------------------------------- forward


def experts_fwd_impl(
    x: Tensor,
    w1: Tensor,
    w2: Tensor,
    b1: Tensor | None,
    b2: Tensor | None,
    pair_scores: Tensor,
    expert_offsets: Tensor,
    row_token: Tensor,
    row_pair: Tensor,
    pair_row: Tensor,
    token_offsets: Tensor,
    token_rows: Tensor,
    slot_pair: Tensor | None,
    gate_up_layout: str,
    save_h: bool,
    tile_rows: int = 0,
    activation: str = "swiglu",
) -> tuple[Tensor, Tensor]:
    """Eager implementation of ``sonicmoe::experts_fwd`` (CUDA, or CPU under TRITON_INTERPRET=1):
    O (T, d) and H (R, 2n) — or (0, 2n) without ``save_h`` — on the Triton kernels (SPEC §3). ``tile_rows``:
    the routing's :attr:`~sonicmoe.routing.Routing.tile_rows` hint (a kernel choice; the same results)."""
    _check_layout(gate_up_layout)
    check_activation(activation)
    routing = _routing(x.shape[0], w1.shape[0], expert_offsets=expert_offsets, row_token=row_token,
                       row_pair=row_pair, pair_row=pair_row, token_offsets=token_offsets,
                       token_rows=token_rows, slot_pair=slot_pair)
    routing.tile_rows = tile_rows
    if _no_rows(x, row_token):  # nothing to compute (and no row for a kernel's clamped gather to read)
        return x.new_zeros(x.shape), x.new_zeros((row_token.shape[0] if save_h else 0, w1.shape[1]))
    h, a = up_proj(x, w1, b1, routing, gate_up_layout, store_h=save_h, activation=activation)
    slot_scores = routing.slot_scores(pair_scores).contiguous()  # cast in the kernel
    # one down-projection, then one aggregation (in column blocks beside each other, gemm_then_gather_sum, it
    # measured no faster)
    y = down_proj(a, w2, b2, routing)
    del a
    out = gather_sum(y, routing, slot_scores)
    del y
    if h is None:
        h = x.new_empty((0, w1.shape[1]))
    return out, h


experts_fwd = torch.library.custom_op("sonicmoe::experts_fwd", experts_fwd_impl, mutates_args=())


@experts_fwd.register_fake
def _experts_fwd_fake(x, w1, w2, b1, b2, pair_scores, expert_offsets, row_token, row_pair, pair_row,
                      token_offsets, token_rows, slot_pair, gate_up_layout, save_h, tile_rows=0, activation="swiglu"):
    out = x.new_empty(x.shape)
    h = x.new_empty((row_token.shape[0] if save_h else 0, w1.shape[1]))
    return out, h


# ------------------------------------------------------------------------------------------ backward


def experts_bwd_impl(
    dout: Tensor,
    x: Tensor,
    w1: Tensor,
    w2: Tensor,
    b1: Tensor | None,
    b2: Tensor | None,
    h: Tensor,
    pair_scores: Tensor,
    expert_offsets: Tensor,
    row_token: Tensor,
    row_pair: Tensor,
    pair_row: Tensor,
    token_offsets: Tensor,
    token_rows: Tensor,
    gate_up_layout: str,
    needs: list[bool],
    activation: str = "swiglu",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Eager implementation of ``sonicmoe::experts_bwd`` (SPEC §4): (dX (T, d), dW1 (E, 2n, d),
    dW2 (E, d, n), db1 (E, 2n), db2 (E, d), dS (R,) in pair order and pair_scores' dtype).

    ``needs`` = six bools in that order; an unneeded output is an empty (0,) tensor.
    """
    _check_layout(gate_up_layout)
    check_activation(activation)
    need_x, need_w1, need_w2, need_b1, need_b2, need_s = needs
    need_b1, need_b2 = need_b1 and b1 is not None, need_b2 and b2 is not None
    if _no_rows(x, row_token):  # zeros of exactly the fake's shapes, strides and dtypes (compiled graphs check them)
        return _bwd_outputs(x, w1, w2, b1, b2, pair_scores, pair_row, needs, zeros=True)
    routing = _routing(x.shape[0], w1.shape[0], expert_offsets=expert_offsets, row_token=row_token,
                       row_pair=row_pair, pair_row=pair_row, token_offsets=token_offsets, token_rows=token_rows)
    dout = dout.contiguous()
    # the weight gradients by the Gluon kernel (weight_grad_ws, where it applies) from n = GLUON_WGRAD_MIN_N on (or
    # SONICMOE_GLUON_WGRAD=all: gluon_wgrad_preferred); else by the Triton kernel, dW1 with the dX aggregation beside it
    gluon = gluon_wgrad_preferred(w2.shape[2])
    progs_per_sm = overlap_mode(dout.device)  # of the dX aggregation beside dW1; 0: one stream
    side = side_stream(dout.device) if progs_per_sm else None
    # S read through row_pair inside the dH kernel (no row-order copy); where the Gluon dH kernel's tiles span all
    # n channels (n = 256 at 7B) and there is no b2, dS leaves that kernel summed and in pair order (ds_pairs)
    ds_in_dh = need_s and b2 is None and ds_pairs_in_dh_kernel(dout, w2, h, routing, gate_up_layout, activation)
    dh_, a_prime, ds_part = dh(dout, w2, h, pair_scores, routing, gate_up_layout, reduce_ds=False, pair_order=True,
                               ds_pairs=pair_scores.dtype if ds_in_dh else None, activation=activation)
    dx, dw1, dw2 = _empty(x), _empty(w1), _empty(w2)
    db1 = _empty(b1) if b1 is not None else _empty(x)
    db2 = _empty(b2) if b2 is not None else _empty(x)
    dscores = ds_part if ds_in_dh else _empty(pair_scores)
    side_used = False  # joined below only if used: a wait on an idle side stream breaks CUDA-graph capture
    if need_s and not ds_in_dh:
        side_used = side is not None
        with _beside(side):  # off the GEMMs' stream, beside dW2
            extra = None
            if b2 is not None:  # dS += ⟨dO_t, b2[e]⟩ (padding rows, past expert_offsets[E]: clamped to E - 1)
                dob2 = dout.float() @ b2.float().t()
                extra = dob2[routing.row_token.long(), routing.row_expert().clamp_(max=w1.shape[0] - 1)]
            # the partials summed in a fixed order, gathered into pair order; padding pairs (rows past
            # expert_offsets[E], which no kernel writes: routing_from_pairs(padding=True)) get 0
            dscores = score_grad(ds_part, routing.row_pair, routing.expert_offsets, extra,
                                 pair_scores.dtype)
    if need_w2:
        dw2 = varlen_k_gemm(dout, a_prime, routing, p_gather=True, q_gather=False, out_dtype=w2.dtype, gluon=gluon)
    if need_b2:  # db2[e] = Σ_t S dO_t
        s_col = routing.row_scores(pair_scores).to(dout.dtype)[:, None]
        db2 = varlen_k_gemm(s_col, dout, routing, p_gather=False, q_gather=True, out_dtype=b2.dtype)[:, 0]
    del a_prime
    gluon_dw1 = gluon and weight_grad_ws.wgrad_ws_supported(dh_, x, p_gather=False, q_gather=True,
                                                            out_dtype=w1.dtype)
    if need_x and need_w1 and side is not None and not gluon_dw1:
        dx, dw1 = _dx_beside_dw1(dh_, x, w1, routing, side, progs_per_sm)
    else:
        if need_x:
            dx = gemm_then_gather_sum(dh_, w1, None, routing, None, transpose_b=False)
        if need_w1:
            dw1 = varlen_k_gemm(dh_, x, routing, p_gather=False, q_gather=True, out_dtype=w1.dtype, gluon=gluon)
    if need_b1:  # db1[e] = Σ dH rows of e
        ones = torch.ones(routing.num_rows, 1, device=dh_.device, dtype=dh_.dtype)
        db1 = varlen_k_gemm(ones, dh_, routing, p_gather=False, q_gather=False, out_dtype=b1.dtype)[:, 0]
    if side_used:  # join: the dS partials (made here, read there) and the inputs are freed after this
        torch.cuda.current_stream(dout.device).wait_stream(side)
    return dx, dw1, dw2, db1, db2, dscores


@contextlib.contextmanager
def _beside(side: torch.cuda.Stream | None):
    """Run the body on the side stream ``side`` (after everything queued so far on the current stream), or on
    the current stream when None.

    Memory safety with the caching allocator: a tensor made on the current stream and read on the side stream
    stays referenced until the caller joins the streams (the current stream waits for the side stream) before
    returning. A tensor made on the side stream (returned, e.g. dS) goes back to the side stream's pool when
    freed, and that pool is only written again by a later body, which starts by waiting for everything queued
    on the current stream until then: its readers there included."""
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream(side.device))
    with torch.cuda.stream(side):
        yield


def _dx_beside_dw1(dh_: Tensor, x: Tensor, w1: Tensor, routing: Routing, side: torch.cuda.Stream,
                   progs_per_sm: int) -> tuple[Tensor, Tensor]:
    """dX = Σ_slots dX̃ (dX̃ = dH W1[e]) and dW1, with the memory-bound dX aggregation on the high-priority side
    stream ``side`` beside the compute-bound dW1 GEMM: a persistent grid of ``progs_per_sm`` programs per
    multiprocessor (``common.overlap_mode``), queued before dW1, so that dW1's programs fill the room beside it.

    dX is allocated on the current stream; the side stream waits for dX̃ and for it. The current stream waits
    for the side stream before this returns, since dX̃ (made here, read there) is freed on return. The kernels
    and their inputs are those of the one-stream path: the same bits.
    """
    dxt = varlen_m_gemm(dh_, w1, None, routing, transpose_b=False)
    dx = new_output((routing.num_tokens, dxt.shape[1]), device=dxt.device, dtype=dxt.dtype)
    with _beside(side):
        gather_sum(dxt, routing, None, out=dx, progs_per_sm=progs_per_sm)
    dw1 = varlen_k_gemm(dh_, x, routing, p_gather=False, q_gather=True, out_dtype=w1.dtype, gluon=False)
    torch.cuda.current_stream(dxt.device).wait_stream(side)  # dxt is freed on return, after this join
    return dx, dw1


experts_bwd = torch.library.custom_op("sonicmoe::experts_bwd", experts_bwd_impl, mutates_args=())


def _bwd_outputs(x, w1, w2, b1, b2, pair_scores, pair_row, needs, *, zeros: bool) -> tuple[Tensor, ...]:
    """The six outputs of ``experts_bwd`` as new contiguous tensors (zeros, or uninitialised for the fake): the
    fake and the real no-row branch share them, so a compiled graph's shape/stride/dtype checks agree."""
    need_x, need_w1, need_w2, need_b1, need_b2, need_s = needs

    def new(v: Tensor, shape) -> Tensor:
        return v.new_zeros(shape) if zeros else v.new_empty(shape)

    dx = new(x, x.shape) if need_x else _empty(x)
    dw1 = new(w1, w1.shape) if need_w1 else _empty(w1)
    dw2 = new(w2, w2.shape) if need_w2 else _empty(w2)
    db1 = new(b1, b1.shape) if need_b1 and b1 is not None else _empty(b1 if b1 is not None else x)
    db2 = new(b2, b2.shape) if need_b2 and b2 is not None else _empty(b2 if b2 is not None else x)
    dscores = new(pair_scores, pair_row.shape) if need_s else _empty(pair_scores)
    return dx, dw1, dw2, db1, db2, dscores


@experts_bwd.register_fake
def _experts_bwd_fake(dout, x, w1, w2, b1, b2, h, pair_scores, expert_offsets, row_token, row_pair, pair_row,
                      token_offsets, token_rows, gate_up_layout, needs, activation="swiglu"):
    return _bwd_outputs(x, w1, w2, b1, b2, pair_scores, pair_row, needs, zeros=False)


# ------------------------------------------------------------------------------------------ autograd

# x, w1, w2, b1, b2, pair_scores, the routing arrays, gate_up_layout, save_h, tile_rows, activation
_NUM_FWD_INPUTS = 6 + len(FWD_ROUTING_FIELDS) + 4


def _setup_context(ctx, inputs, output) -> None:
    """Autograd of ``sonicmoe::experts_fwd``: what the backward keeps (the memory contract).

    Saved (``ctx.save_for_backward``), and nothing else:
        * X (T, d) — the layer input as the caller passed it (the caller holds it anyway);
        * H (R, 2n) — the up-projection output before the activation, in W1's gate/up layout (the activation,
          SwiGLU or the clamped one, is recomputed from it);
        * the scores S (R,) as the caller passed them (pair order; the caller holds them anyway: the dH kernel
          reads each row's through row_pair, so no row-order copy is made);
        * the routing metadata the backward reads (int32: expert_offsets (E+1,), row_token (R,), row_pair (R,),
          pair_row (R,), token_offsets (T+1,), token_rows (R,));
        * the weights W1 (E, 2n, d), W2 (E, d, n) and biases b1 (E, 2n), b2 (E, d) — parameters,
          not activations.
    So the activations held are 2Td + 4Rn bytes in bf16 (2Td + 4TKn under top-k; plus the metadata), the
    same as a dense MLP with the same activated parameters; never gathered X, A, Y or any (R, d) tensor. H is a
    non-differentiable output, and its gradient is never materialised.

    Backward (``sonicmoe::experts_bwd``, 5 kernels): dH kernel (dA′ = dO W2[e] with dO rows gathered,
    A recomputed from H, dS = ⟨dA′, A⟩, dH, A′ = S·A); dW2 and dW1 varlen-K GEMMs with row gathers;
    dX̃ = dH W1[e]; dX gather-and-sum. Biases: dS += ⟨dO_t, b2[e]⟩, db2[e] = Σ S dO_t,
    db1[e] = Σ dH rows. Everything is deterministic (no atomics); only the gradients that
    ``ctx.needs_input_grad`` asks for are computed. On CUDA (SONICMOE_OVERLAP, default on) the memory-bound dX
    aggregation runs on a high-priority side stream beside the dW1 GEMM, or, where dX̃ runs in column blocks
    (:func:`gemm_then_gather_sum`, d ≥ 4096), block by block beside the next block's dX̃ GEMM (the last one before
    dW1); the dS reduction and score
    gradient run beside dW2 — unless the Gluon dH kernel's tiles span all n channels and there is no b2 (n = 256 at
    the 7B shape: :func:`sonicmoe.ops.dh.ds_pairs_in_dh_kernel`), where that kernel writes the scores' gradient
    itself, with the same bits; the streams join before the gradients are returned (the same bits either way).
    """
    x, w1, w2, b1, b2, pair_scores = inputs[:6]
    end = 6 + len(FWD_ROUTING_FIELDS)
    arrays = dict(zip(FWD_ROUTING_FIELDS, inputs[6:end], strict=True))
    gate_up_layout, save_h = inputs[end:end + 2]  # then tile_rows, a kernel choice of the forward only
    activation = inputs[end + 3] if len(inputs) > end + 3 else "swiglu"
    _, h = output
    if not save_h:
        raise ValueError("sonicmoe::experts_fwd needs save_h=True when gradients are required "
                         "(the backward reads H)")
    ctx.save_for_backward(x, h, pair_scores, w1, w2, b1, b2, *(arrays[f] for f in BWD_ROUTING_FIELDS))
    ctx.gate_up_layout = gate_up_layout
    ctx.activation = activation
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)  # no zero-filled (R, 2n) gradient for the unused H output


def _backward_through(bwd, ctx, dout):
    """The input gradients of the forward from ``bwd`` (the ``experts_bwd`` operator or its implementation)."""
    needs = [bool(v) for v in ctx.needs_input_grad[:6]]
    if dout is None or not any(needs):
        return (None,) * _NUM_FWD_INPUTS
    x, h, pair_scores, w1, w2, b1, b2, *routing_arrays = ctx.saved_tensors
    # under torch.autocast its few torch GEMMs stay as written; on dout's device whichever is current (the autograd
    # engine's device threads make it current already; a backward called another way may not)
    with no_autocast(dout.device), on_device(dout):
        grads = bwd(dout, x, w1, w2, b1, b2, h, pair_scores, *routing_arrays, ctx.gate_up_layout, needs,
                    ctx.activation)
    # experts_bwd's order is (dx, dw1, dw2, db1, db2, dscores); the inputs' is x, w1, w2, b1, b2, scores
    return (*(g if need else None for g, need in zip(grads, needs)), *((None,) * (_NUM_FWD_INPUTS - 6)))


def _backward(ctx, dout, _dh):
    return _backward_through(torch.ops.sonicmoe.experts_bwd, ctx, dout)


experts_fwd.register_autograd(_backward, setup_context=_setup_context)


class ExpertsFunction(torch.autograd.Function):
    """Eager twin of ``sonicmoe::experts_fwd`` with its autograd formula: the same implementations
    (:func:`experts_fwd_impl`, :func:`experts_bwd_impl`), inputs, outputs and memory contract
    (:func:`_setup_context`), without the custom operators' dispatch, which costs host time on every call
    (about 15% of a layer call's host time, measured on CPU). :func:`sonicmoe.ops.moe_function.experts_triton`
    takes it outside ``torch.compile``; compiled graphs keep the opaque operators.
    """

    @staticmethod
    def forward(*inputs):
        return experts_fwd_impl(*inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)

    @staticmethod
    @kernel_backward("the experts (backend='triton')", "backend='torch' is differentiable twice (the MoE layer on "
                     "CUDA also needs routing='topk' and SONICMOE_ROUTER_KERNEL=0)")
    def backward(ctx, dout, _dh):
        return _backward_through(experts_bwd_impl, ctx, dout)
