"""Triton device functions the expert kernels share (called inside ``@triton.jit`` kernels only; host code is in
:mod:`.common`).

- The varlen-M tile schedule (SPEC §3): :func:`tile_schedule` (each expert's M-tile count and their inclusive scan,
  from ``expert_offsets``) and :func:`tile_rows` (expert and rows of one M-tile), and the persistent (tile, K-block)
  step loops built on them, :func:`first_step` and :func:`next_step`.
- Operand loads: :func:`load_weight_block` (an expert's weight block, by pointers or a TMA descriptor) and
  :func:`load_row_block` (a K-block of gathered rows).
- The gated activations (SPEC §2) in float32: :func:`gated_act` (A from gate and up) and :func:`gated_act_bwd` (A,
  dgate, dup), with :func:`sigmoid`; ``ACT`` is :func:`.common.act_code`'s code. The forward's epilogue and the
  backward's recomputation call the same functions, so the backward's A equals the forward's.
- :func:`column_halves` (a block's left and right halves: the concat gate/up layout) and :func:`pdl_prologue`
  (programmatic dependent launch's wait, see :func:`.common.pdl_enabled`).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def tile_schedule(offsets_ptr, E, E_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per-expert tile counts and their inclusive scan; returns (eidx, lo, hi, ntiles, cum, total)."""
    eidx = tl.arange(0, E_P2)
    emask = eidx < E
    lo = tl.load(offsets_ptr + eidx, mask=emask, other=0)
    hi = tl.load(offsets_ptr + eidx + 1, mask=emask, other=0)
    ntiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(ntiles, 0)
    return eidx, lo, hi, ntiles, cum, tl.sum(ntiles, 0)


@triton.jit
def tile_rows(pid_m, eidx, lo, hi, ntiles, cum, BLOCK_M: tl.constexpr):
    """(expert, first row, end row) of M-tile ``pid_m`` (< total) from :func:`tile_schedule`."""
    e = tl.sum((cum <= pid_m).to(tl.int32), 0)
    sel = eidx == e
    first_tile = tl.sum(tl.where(sel, cum - ntiles, 0), 0)
    row_start = tl.sum(tl.where(sel, lo, 0), 0) + (pid_m - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(sel, hi, 0), 0)
    return e, row_start, row_end


@triton.jit
def first_step(num_tiles, K, BLOCK_K: tl.constexpr):
    """The state of a persistent (tile, K-block) step loop before its first :func:`next_step`: (steps of this
    program, K-blocks per tile, ki = -1, tile = program_id - num_programs, expert, row_start, row_end, pid_n)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # K = 0 (a zero-width reduction: d = 0 in the up-projection) still runs one fully masked K-block per tile, so
    # each tile's epilogue stores its (bias-only) output; zero steps would leave the outputs unwritten (session 91)
    k_tiles = tl.maximum(tl.cdiv(K, BLOCK_K), 1)
    zero = pid * 0
    steps = k_tiles * tl.maximum(tl.cdiv(num_tiles - pid, nprog), 0)
    return steps, k_tiles, zero - 1, pid - nprog, zero, zero, zero, zero


@triton.jit
def next_step(ki, tile, e, row_start, row_end, pid_n, k_tiles, num_pid_n, eidx, lo, hi, ntiles, cum,
              BLOCK_M: tl.constexpr):
    """One step of a persistent loop over (tile, K-block) steps (the ``STEPS`` schedules): the K-block index
    ``ki`` advances, and at a tile's first block (``ki`` back to 0) the program's next tile (``tile`` +
    num_programs) with its expert, rows [row_start, row_end) and N-tile. Start from ``ki`` = -1 and
    ``tile`` = program_id - num_programs; a program runs k_tiles · cdiv(tiles - program_id, num_programs) steps."""
    ki = tl.where(ki == k_tiles - 1, 0, ki + 1)
    if ki == 0:
        tile += tl.num_programs(0)
        pid_n = tile % num_pid_n
        e, row_start, row_end = tile_rows(tile // num_pid_n, eidx, lo, hi, ntiles, cum, BLOCK_M)
    return ki, tile, e, row_start, row_end, pid_n


@triton.jit
def load_weight_block(w_base, w_desc, e, k0, c0, K, N, stride_k, stride_n, B_TRANS: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, W_TMA: tl.constexpr):
    """The (BLOCK_K, BLOCK_N) block B[k0:k0+BLOCK_K, c0:c0+BLOCK_N] of expert e's weight, 0 past (K, N).

    Pointer loads: B[k, c] = w_base[k * stride_k + c * stride_n] (``w_base`` already at expert e).
    ``W_TMA``: ``w_desc`` describes the weight as (E, N, K) when ``B_TRANS`` (boxes (1, BLOCK_N, BLOCK_K),
    transposed in registers) or (E, K, N) otherwise; the copy engine zero-fills past the bounds.
    """
    if W_TMA:
        if B_TRANS:
            return tl.reshape(w_desc.load([e, c0, k0]), (BLOCK_N, BLOCK_K)).T
        return tl.reshape(w_desc.load([e, k0, c0]), (BLOCK_K, BLOCK_N))
    kk = k0 + tl.arange(0, BLOCK_K)
    cc = c0 + tl.arange(0, BLOCK_N)
    ptrs = w_base + kk[:, None].to(tl.int64) * stride_k + cc[None, :].to(tl.int64) * stride_n
    return tl.load(ptrs, mask=(kk < K)[:, None] & (cc < N)[None, :], other=0.0)


@triton.jit
def load_row_block(ptrs, offs_k, k, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Block ``k`` along the reduction dimension of (gathered) rows: ``ptrs`` (BLOCK_M, BLOCK_K) already at
    column k·BLOCK_K of each row, 0 past column K (no mask when ``EVEN_K``: K is a multiple of BLOCK_K)."""
    if EVEN_K:
        block = tl.load(ptrs)
    else:
        block = tl.load(ptrs, mask=(offs_k < K - k * BLOCK_K)[None, :], other=0.0)
    return block


@triton.jit
def sigmoid(x):
    """1 / (1 + exp(-x)) with the fast (non-IEEE) division; float32 in and out. The up-projection and the
    dH kernel both use it, so the backward's recomputed A equals the forward's."""
    return tl.math.fdiv(1.0, 1.0 + tl.exp(-x))


@triton.jit
def gated_act(g, u, ACT: tl.constexpr):
    """A = act(gate, up) in float32 from the gate and up values (float32 blocks): ACT 0 silu(g) · u (SwiGLU); ACT 1
    gpt-oss's clamped SwiGLU (:func:`sonicmoe.reference.swiglu_ref`): (clamp(u, −L, L) + 1) · g′ σ(α g′),
    g′ = min(g, L), α = 1.702, L = 7. The forward's epilogue and the dH kernel's recomputation both call it, so the
    backward's A equals the forward's."""
    if ACT == 0:
        a = g * sigmoid(g) * u
    else:
        gc, uc = _clamped(g, u)
        a = (uc + 1.0) * (gc * sigmoid(1.702 * gc))
    return a


@triton.jit
def _clamped(g, u):
    """(min(g, 7), clamp(u, −7, 7)) with NaN kept NaN (torch.clamp's; the default min/max would turn it into a bound,
    and a NaN token would then give a finite output)."""
    nan: tl.constexpr = tl.PropagateNan.ALL
    return (tl.minimum(g, 7.0, propagate_nan=nan),
            tl.minimum(tl.maximum(u, -7.0, propagate_nan=nan), 7.0, propagate_nan=nan))


@triton.jit
def gated_act_bwd(g, u, da, ACT: tl.constexpr):
    """(A, dgate, dup) in float32 for the gate and up values and dA (float32 blocks; :func:`gated_act`'s A).
    ACT 0: dgate = dA · u · σ(g)(1 + g(1 − σ(g))), dup = dA · silu(g). ACT 1: with g′, u′ the clamped values and
    s = σ(α g′), dgate = dA (u′ + 1)(s + α g′ s (1 − s)) where g ≤ L, else 0; dup = dA · g′ s where −L ≤ u ≤ L, else 0
    (torch.clamp's gradient, passed at the bounds)."""
    if ACT == 0:
        sig = sigmoid(g)
        silu = g * sig
        a = silu * u
        d_gate = da * u * (sig + silu * (1.0 - sig))
        d_up = da * silu
    else:
        gc, uc = _clamped(g, u)
        sig = sigmoid(1.702 * gc)
        glu = gc * sig
        a = (uc + 1.0) * glu
        d_gate = tl.where(g <= 7.0, da * (uc + 1.0) * (sig + 1.702 * glu * (1.0 - sig)), 0.0)
        d_up = tl.where(uc == u, da * glu, 0.0)  # u inside [−7, 7]: one compare (NaN: False, as the bounds')
    return a, d_gate, d_up


@triton.jit
def column_halves(x):
    """The left and right column halves of a 2-D block (M, W), W even."""
    M: tl.constexpr = x.shape[0]
    W: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, (M, 2, W // 2)), (0, 2, 1)))


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of a kernel launched by :func:`launch` with ``pdl_device``: under PDL, wait until the
    previous kernel of the stream has finished and its writes are visible (``griddepcontrol.wait``) — before
    any load or store, so neither read-after-write nor write-after-read hazards on reused buffers arise —
    then let the next kernel be scheduled (``griddepcontrol.launch_dependents``; it waits in turn). A no-op
    without PDL (the interpreter, SONICMOE_PDL=0, pre-Hopper GPUs)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
