"""An experimental varlen-M GEMM whose two-CTA clusters share each B box by TMA multicast (inline PTX), against the
streamed-B kernel it is built from (:mod:`sonicmoe.ops.varlen_m_ws`). GPU; ``--compile-only`` on CPU.

Why: at (32768, 4096, 1024, 128, 8) the layer's GEMMs run at the H100's 700 W cap with 7-30% more energy per FLOP
than their cuBLAS twins (session 51), and cuBLAS shares the B operand between the CTAs of a cluster. Each 128 × 256
tile of the streamed-B kernel reads, per 64-deep K-block, A's 128 × 64 block and B's 64 × 256 box (2/3 of its
L2-to-SM bytes). Here the two CTAs of a cluster take the two M-tiles of a pair, which belong to one expert and share
an N-tile. Each CTA loads its own A block, plus one half of the B box by
``cp.async.bulk.tensor ... .multicast::cluster`` into both CTAs' ring slots: B's L2 traffic halves.

How, with Triton 3.6's Gluon (which has no multicast, see ``tma_multicast_toy.py``):

* ``num_ctas=2`` and every layout broadcast over the cluster: each CTA works on its own tile;
* the ring's "empty" barriers count two arrivals, the CTA's own MMA warps and the peer's (``mapa`` and a remote
  ``mbarrier.arrive``), because each loader writes into both CTAs' slots;
* Triton stores a broadcast tensor from cluster rank 0 only, so tiles leave by TMA stores in inline PTX, through a
  tensor map per expert (rows [off[e], off[e+1]) of C): the map clips an expert's last, partial tile;
* an expert with an odd number of M-tiles gets a phantom tile (no rows, loads but no stores) so the pair stays in
  step;
* inline PTX takes shared-memory addresses as ``global_smem`` plus the allocations' offsets, read from the
  ``allocation.offset`` attributes of a first compile's IR dump (``MLIR_ENABLE_DUMP``, in a subprocess);
* the tensor maps are Triton's ``CUtensorMap`` objects copied into CUDA tensors (``tma_multicast_toy.tensormap``);
* a cluster barrier at the start of each partition, after the barriers' initialisation; at the end each CTA waits
  until its "empty" barriers have taken the peer's last arrivals.

Session 54: compiled for sm_90; its one GPU run hung before the first output. The cluster barrier sat before
``gl.warp_specialize``, where the parked loader warp never arrives; it now runs at the start of both partitions, and
the loader partition has four warps (with one, Triton pads the CTA with three idle warps, which never arrive).

Session 55 (one H200, benchmarks/results/2026-12-02_nvidia-h200_session55/): the fix ran, and every variant matched
``long_gemm`` bitwise. With the remote arrive as ``mbarrier.arrive.release.cluster`` the kernel took 10.2 ms for
dX̃ against 7.1-7.2 for ``long_gemm``, and ``--modes`` found the cause: own-B loads with the coupled empties (mode 1)
took 10.7 ms, uncoupled (mode 2) 7.46. With the default semantics (release at CTA scope, as CUTLASS's cluster
barrier arrives) multicast took 7.39 ms against 7.26 (dX̃) and 3.89 against 3.82 (down-projection), at no lower
energy per call. Multicast beats own-B loads in the same clusters by 1-3%, about what the phantom tiles of odd
experts cost (about 3% of the tiles at 120B). With ``--balanced`` (2048 rows per expert: no phantom or partial
tiles) multicast ran dX̃ 1.4% faster than ``long_gemm`` (6.78 against 6.88 ms), at level energy per call: the best
case, under 1% of the layer. This route is parked.

It checks the output bitwise against :func:`sonicmoe.ops.varlen_m_ws.long_gemm` (same K order), then times both in
settled windows with energy (``energy_probe.measure``). Host set-up (tables, maps) is outside the timed call.

usage: PYTHONPATH=$PWD python scripts/multicast_gemm_probe.py [--shape T,d,n,E,K] [--form dxt,down] [--passes 2]
       [--warmup 0.7] [--window 1.0] [--modes 0,1,2] [--programs 132,128] [--balanced] [--json F] [--compile-only]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tma_multicast_toy import tensormap  # noqa: E402

BM, BN, BK = 128, 256, 64
STAGES = 4
MMA_WARPS = 8
LOADER_WARPS = gl.constexpr(4)  # a whole warpgroup: no idle padding warps, which would never reach the cluster barrier
CGA2 = [[0, 0]]
CGA1 = [[0]]
MODES = {0: "multicast", 1: "own B, coupled", 2: "own B, uncoupled"}

RANK = gl.constexpr("mov.u32 $0, %cluster_ctarank;")
# every thread of both CTAs, at the start of each partition (the loader warp is parked until warp_specialize, so a
# cluster barrier before it never completes: session 54's first GPU run of this probe hung there)
SYNC = gl.constexpr("""{
    fence.mbarrier_init.release.cluster;
    barrier.cluster.arrive.release.aligned;
    barrier.cluster.wait.acquire.aligned;
    mov.u32 $0, 0;
}""")
# $1 thread index, $2 tensor map, $3 destination offset in the ring, $4 mbarrier offset, $5 inner coordinate,
# $6 outer coordinate, $7 CTA mask (3: both CTAs of the cluster; 1 << rank: this CTA only)
MCAST = gl.constexpr("""{
    .reg .pred p;
    .reg .u32 base, dst, mb;
    .reg .b16 mask;
    setp.eq.u32 p, $1, 0;
    mov.u32 base, global_smem;
    add.u32 dst, base, $3;
    add.u32 mb, base, $4;
    cvt.u16.u32 mask, $7;
    @p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster
        [dst], [$2, {$5, $6}], [mb], mask;
    mov.u32 $0, 0;
}""")
# $1 thread index, $2 mbarrier offset, $3 peer rank. The default semantics (release at CTA scope), as CUTLASS's
# cluster barrier arrives: the slot's readers (wgmma) are done before the arrive. ``.release.cluster`` here cost
# about 0.4 µs per K-block (H200, session 55: dX̃ with coupled own-B loads 10.74 ms, 7.63 with this form)
REMOTE_ARRIVE = gl.constexpr("""{
    .reg .pred p;
    .reg .u32 base, loc, rem;
    setp.eq.u32 p, $1, 0;
    mov.u32 base, global_smem;
    add.u32 loc, base, $2;
    mapa.shared::cluster.u32 rem, loc, $3;
    @p mbarrier.arrive.shared::cluster.b64 _, [rem];
    mov.u32 $0, 0;
}""")
# $1 predicate (1: this thread stores), $2 tensor map, $3 source offset, $4 inner, $5 outer coordinate
STORE = gl.constexpr("""{
    .reg .pred p;
    .reg .u32 base, src;
    setp.ne.u32 p, $1, 0;
    mov.u32 base, global_smem;
    add.u32 src, base, $3;
    @p cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [$2, {$4, $5}], [src];
    @p cp.async.bulk.commit_group;
    mov.u32 $0, 0;
}""")
# $1 thread index
STORE_READ_WAIT = gl.constexpr("""{
    .reg .pred p;
    setp.eq.u32 p, $1, 0;
    @p cp.async.bulk.wait_group.read 0;
    mov.u32 $0, 0;
}""")
STORE_WAIT = gl.constexpr("""{
    .reg .pred p;
    setp.eq.u32 p, $1, 0;
    @p cp.async.bulk.wait_group 0;
    mov.u32 $0, 0;
}""")


@gluon.jit
def _pair_tile(pt, table_ptr, num_pid_n, rank):
    """(expert, first row, end row, N-tile) of this CTA's tile of pair-tile ``pt`` (M-tile 2·pair + rank)."""
    pair = pt // num_pid_n
    entry = table_ptr + (2 * pair + rank + 1) * 4
    return gl.load(entry), gl.load(entry + 1), gl.load(entry + 2), pt - pair * num_pid_n


@gluon.jit
def _b_part(lane, zero, bmap_ptr, slot, bar, p, ki, e, col, K, M_B, mask, B_TRANS: gl.constexpr):
    """TMA of part ``p`` of the B box of K-block ``ki`` into the ring slot at ``slot`` of the CTAs in ``mask``
    (64 = BK, the K-block's depth)."""
    if B_TRANS:
        dst, inner, outer = slot + p * 16384, ki * 64, e * M_B + col + p * 128
    else:
        dst, inner, outer = slot + p * 8192, col + p * 64, e * K + ki * 64
    gl.inline_asm_elementwise(
        MCAST,
        "=r,r,l,r,r,r,r,r",
        [lane, bmap_ptr + zero, zero + dst, zero + bar, zero + inner, zero + outer, zero + mask],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _mc_loader(a_desc, bmap_ptr, a_bufs, ready, empty, table_ptr, num_pairs, num_pid_n, K, M_B, off_b, off_ready,
               B_TRANS: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, B_SLOT: gl.constexpr,
               MODE: gl.constexpr):
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [LOADER_WARPS], [0], cga_layout=[[0]])
    lane = gl.arange(0, 32 * LOADER_WARPS, layout=lay)
    zero = lane * 0
    gl.inline_asm_elementwise(SYNC, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    rank = gl.inline_asm_elementwise(RANK, "=r", [], dtype=gl.int32, is_pure=True, pack=1)
    total = num_pairs * num_pid_n
    k_tiles = K // BLOCK_K
    nbytes: gl.constexpr = a_desc.block_type.nbytes + B_SLOT
    step = 0
    for pt in range(gl.program_id(0), total, gl.num_programs(0)):
        e, row_start, row_end, pid_n = _pair_tile(pt, table_ptr, num_pid_n, rank)
        col = pid_n * 256
        for ki in range(k_tiles):
            s = step % STAGES
            mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [row_start, ki * BLOCK_K], ready.index(s), a_bufs.index(s))
            bar = off_ready + s * 8
            # B_TRANS: W2 (E·m, k), part p = rows col + 128·p + [0, 128) of the (256, 64) box (2 parts);
            # otherwise W1 (E·k, m), part p = the (64, 64) column chunk p of the (64, 256) box (4 parts)
            PARTS: gl.constexpr = 1 if B_TRANS else 2
            if MODE == 0:  # my half, multicast into both CTAs
                for j in gl.static_range(PARTS):
                    _b_part(lane, zero, bmap_ptr, off_b + s * B_SLOT, bar, rank * PARTS + j, ki, e, col, K, M_B, 3,
                            B_TRANS)
            else:  # the whole box, into this CTA only
                for j in gl.static_range(2 * PARTS):
                    _b_part(lane, zero, bmap_ptr, off_b + s * B_SLOT, bar, j, ki, e, col, K, M_B, 1 << rank,
                            B_TRANS)
            step += 1


@gluon.jit
def _mc_mma(a_bufs, b_bufs, c_smem, ready, empty, cmap_ptr, offsets_ptr, table_ptr, num_pairs, num_pid_n, K, off_c,
            off_empty, B_TRANS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
            STAGES: gl.constexpr, WARPS: gl.constexpr, MODE: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 16], cga_layout=[[0, 0]]
    )
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0], cga_layout=[[0]])
    lane = gl.arange(0, 32 * WARPS, layout=lay)
    zero = lane * 0
    gl.inline_asm_elementwise(SYNC, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    rank = gl.inline_asm_elementwise(RANK, "=r", [], dtype=gl.int32, is_pure=True, pack=1)
    peer = zero + (rank ^ 1)
    total = num_pairs * num_pid_n
    k_tiles = K // BLOCK_K
    step = 0
    for pt in range(gl.program_id(0), total, gl.num_programs(0)):
        e, row_start, row_end, pid_n = _pair_tile(pt, table_ptr, num_pid_n, rank)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        for ki in range(k_tiles):
            s = step % STAGES
            mbarrier.wait(ready.index(s), (step // STAGES) & 1)
            if B_TRANS:
                b = b_bufs.index(s).permute((1, 0))
            else:
                b = b_bufs.index(s)
            acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if ki > 0:
                prev = (step + STAGES - 1) % STAGES
                mbarrier.arrive(empty.index(prev))
                if MODE < 2:
                    gl.inline_asm_elementwise(
                        REMOTE_ARRIVE,
                        "=r,r,r,r",
                        [lane, zero + off_empty + prev * 8, peer],
                        dtype=gl.int32,
                        is_pure=False,
                        pack=1,
                    )
            step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        last = (step + STAGES - 1) % STAGES
        mbarrier.arrive(empty.index(last))
        if MODE < 2:
            gl.inline_asm_elementwise(
                REMOTE_ARRIVE, "=r,r,r,r", [lane, zero + off_empty + last * 8, peer], dtype=gl.int32, is_pure=False,
                pack=1
            )
        c = acc.to(gl.bfloat16)
        c3 = c.reshape((BLOCK_M, 2, BLOCK_N // 2)).permute((0, 2, 1))
        left, right = c3.split()
        live = (lane == 0) & (row_end > row_start)
        row = row_start - gl.load(offsets_ptr + e)
        cmap = cmap_ptr + e * 128 + zero
        for h in gl.static_range(2):
            part = left if h == 0 else right
            gl.inline_asm_elementwise(STORE_READ_WAIT, "=r,r", [lane], dtype=gl.int32, is_pure=False, pack=1)
            gl.thread_barrier()
            c_smem.store(part)
            fence_async_shared()
            gl.thread_barrier()
            for j in gl.static_range(2):
                gl.inline_asm_elementwise(
                    STORE,
                    "=r,r,l,r,r,r",
                    [
                        live.to(gl.int32),
                        cmap,
                        zero + off_c + j * 16384,
                        zero + pid_n * BLOCK_N + h * 128 + j * 64,
                        zero + row,
                    ],
                    dtype=gl.int32,
                    is_pure=False,
                    pack=1,
                )
    gl.inline_asm_elementwise(STORE_WAIT, "=r,r", [lane], dtype=gl.int32, is_pure=False, pack=1)
    for s in gl.static_range(STAGES):  # the peer's last arrivals on this CTA's barriers
        if s < step:
            mbarrier.wait(empty.index(s), ((step - 1 - s) // STAGES) & 1)


@gluon.jit
def _mc_kernel(a_desc, bmap_ptr, cmap_ptr, offsets_ptr, table_ptr, num_pairs, num_pid_n, K, M_B, OFF_B: gl.constexpr,
               OFF_C: gl.constexpr, OFF_READY: gl.constexpr, OFF_EMPTY: gl.constexpr, B_TRANS: gl.constexpr,
               B_LAYOUT: gl.constexpr, C_LAYOUT: gl.constexpr, BAR: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, MMA_WARPS: gl.constexpr,
               MODE: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    if B_TRANS:
        b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K], B_LAYOUT)
    else:
        b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK_N], B_LAYOUT)
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N // 2], C_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BAR)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BAR)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2 if MODE < 2 else 1)
    fence_async_shared(cluster=True)
    gl.warp_specialize([
        (_mc_mma, (a_bufs, b_bufs, c_smem, ready, empty, cmap_ptr, offsets_ptr, table_ptr, num_pairs, num_pid_n, K,
                   OFF_C, OFF_EMPTY, B_TRANS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, MMA_WARPS, MODE)),
        (_mc_loader, (a_desc, bmap_ptr, a_bufs, ready, empty, table_ptr, num_pairs, num_pid_n, K, M_B, OFF_B,
                      OFF_READY, B_TRANS, BLOCK_K, STAGES, BLOCK_K * BLOCK_N * 2, MODE)),
    ], [LOADER_WARPS], [40])


def layouts(trans: bool) -> dict:
    """The kernel's shared layouts, broadcast over the cluster (128-byte swizzle)."""
    sw = gl.NVMMASharedLayout(128, 16, 2, cga_layout=CGA2)
    return {"B_LAYOUT": sw, "C_LAYOUT": sw, "BAR": mbarrier.MBarrierLayout(cga_layout=CGA1)}


def pair_table(offsets: list[int]) -> tuple[torch.Tensor, int]:
    """(table, pairs): row 1 + m = (expert, first row, end row, 0) of M-tile m = 2·pair + rank, an expert's M-tiles
    in pairs, the last pair of an odd count completed by a phantom tile (end row = first row = the expert's end)."""
    rows = [[0, 0, 0, 0]]
    for e in range(len(offsets) - 1):
        lo, hi = offsets[e], offsets[e + 1]
        tiles = -(-(hi - lo) // BM)
        for m in range(tiles + tiles % 2):
            rows.append([e, lo + m * BM, min(lo + (m + 1) * BM, hi)] if m < tiles else [e, hi, hi])
            rows[-1].append(0)
    pairs = (len(rows) - 1) // 2
    rows[0][0] = 2 * pairs
    return torch.tensor(rows, dtype=torch.int32), pairs


def allocation_offsets(trans: bool) -> dict:
    """OFF_B / OFF_C / OFF_READY / OFF_EMPTY: the allocations' offsets from a compile's IR dump (in a subprocess with
    ``MLIR_ENABLE_DUMP=1``; the offsets do not depend on the values passed for them)."""
    env = dict(os.environ, MLIR_ENABLE_DUMP="1", TRITON_ALWAYS_COMPILE="1")
    code = (
        f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
        f"import multicast_gemm_probe as m; m.compile_only({trans})"
    )
    err = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stderr
    found = dict(re.findall(r"%(b_bufs|c_smem|ready|empty)\S* = ttg\.local_alloc \{allocation\.offset = (\d+)", err))
    if len(found) != 4:
        raise RuntimeError(f"allocation offsets not found in the IR dump: {found}; stderr tail {err[-2000:]}")
    return {
        "OFF_B": int(found["b_bufs"]),
        "OFF_C": int(found["c_smem"]),
        "OFF_READY": int(found["ready"]),
        "OFF_EMPTY": int(found["empty"]),
    }


def compile_only(trans: bool, offs: dict | None = None, mode: int = 0):
    """The kernel compiled for sm_90 in 2-CTA clusters (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    a_layout = gl.NVMMASharedLayout(128, 16, 2, cga_layout=CGA2)
    sig = {
        "a_desc": f"tensordesc<bf16[{BM}, {BK}],{a_layout!r}>",
        "bmap_ptr": "*i8",
        "cmap_ptr": "*i8",
        "offsets_ptr": "*i32",
        "table_ptr": "*i32",
        "num_pairs": "i32",
        "num_pid_n": "i32",
        "K": "i32",
        "M_B": "i32",
    }
    consts = {
        **(offs or {"OFF_B": 0, "OFF_C": 0, "OFF_READY": 0, "OFF_EMPTY": 0}),
        "B_TRANS": trans,
        **layouts(trans),
        "BLOCK_M": BM,
        "BLOCK_N": BN,
        "BLOCK_K": BK,
        "STAGES": STAGES,
        "MMA_WARPS": MMA_WARPS,
        "MODE": mode,
    }
    sig.update({k: "constexpr" for k in consts})
    return triton.compile(
        GluonASTSource(_mc_kernel, sig, consts),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": MMA_WARPS, "num_ctas": 2, "maxnreg": 168},
    )


class MulticastGemm:
    """C = A op(B[e]) by :func:`_mc_kernel` for one routing and output buffer (tables and tensor maps built once)."""

    def __init__(self, a, b, routing, trans: bool, offs: dict, programs: int, mode: int = 0):
        self.a, self.b, self.trans, self.offs, self.mode = a, b, trans, offs, mode
        e = b.shape[0]
        k, m = (b.shape[2], b.shape[1]) if trans else (b.shape[1], b.shape[2])
        self.k, self.m, self.e = k, m, e
        offsets = routing.expert_offsets.tolist()
        table, self.pairs = pair_table(offsets)
        self.table = table.to(a.device)
        self.offsets = routing.expert_offsets.to(torch.int32)
        self.out = torch.empty(a.shape[0], m, device=a.device, dtype=a.dtype)
        b2d = b.view(e * m, k) if trans else b.view(e * k, m)
        self.bmap = tensormap(b2d, [128, 64] if trans else [64, 64])
        maps = []
        for x in range(e):
            lo, hi = offsets[x], offsets[x + 1]
            view = self.out[lo:hi] if hi > lo else self.out[:1]  # an empty expert's map is never used
            maps.append(tensormap(view, [BM, 64]))
        self.cmaps = torch.cat(maps)
        a_layout = gl.NVMMASharedLayout(128, 16, 2, cga_layout=CGA2)
        self.a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [BM, BK], a_layout)
        self.grid = (programs // 2,)

    def __call__(self):
        _mc_kernel[self.grid](
            self.a_desc,
            self.bmap,
            self.cmaps,
            self.offsets,
            self.table,
            self.pairs,
            self.m // BN,
            self.k,
            self.m,
            **self.offs,
            B_TRANS=self.trans,
            **layouts(self.trans),
            BLOCK_M=BM,
            BLOCK_N=BN,
            BLOCK_K=BK,
            STAGES=STAGES,
            MMA_WARPS=MMA_WARPS,
            MODE=self.mode,
            num_warps=MMA_WARPS,
            num_ctas=2,
            maxnreg=168,
        )
        return self.out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32768,4096,1024,128,8")
    ap.add_argument("--form", default="dxt,down")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=0.7)
    ap.add_argument("--window", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--modes", default="0", help="0 multicast; 1 own B loads, coupled empties; 2 own B, uncoupled")
    ap.add_argument("--programs", default="", help="CTAs per launch (even), comma-separated; default all SMs")
    ap.add_argument("--balanced", action="store_true",
                    help="every expert gets T·K/E rows (token t's k-th pair to expert (t·K + k) mod E): no phantom "
                         "tiles where T·K/E is a multiple of 256")
    args = ap.parse_args()
    forms = args.form.split(",")
    offs = {form: allocation_offsets(form == "down") for form in forms}
    print("allocation offsets:", offs, flush=True)
    if args.compile_only:
        for form in forms:
            ptx = compile_only(form == "down", offs[form]).asm["ptx"]
            print(
                form,
                "compiles:",
                sum("multicast::cluster" in ln for ln in ptx.splitlines()),
                "multicast loads,",
                sum("bulk_group" in ln and "global.shared" in ln for ln in ptx.splitlines()),
                "TMA stores",
            )
        return
    from energy_probe import measure_passes, probe_problem, write_rows

    from sonicmoe.bench.gpu_state import Nvml
    from sonicmoe.ops import varlen_m_ws
    from sonicmoe.ops.common import sm_count

    nvml = Nvml()
    p, routing, _ = probe_problem(args.shape)
    if args.balanced:
        from sonicmoe.routing import routing_from_topk

        t, _, _, e, k = (int(v) for v in args.shape.split(","))
        ids = (torch.arange(t, device="cuda")[:, None] * k + torch.arange(k, device="cuda")) % e
        routing = routing_from_topk(ids, e)
        print("balanced routing: rows per expert", sorted(set(routing.expert_offsets.diff().tolist())))
    w1, w2 = p["w1"], p["w2"]
    d = w1.shape[2]
    g = torch.Generator(device="cuda").manual_seed(1)
    items = []
    for form in forms:
        trans = form == "down"
        k = w1.shape[1] // 2 if trans else w1.shape[1]
        a = torch.randn(routing.num_rows, k, device="cuda", dtype=w1.dtype, generator=g)
        b = w2 if trans else w1
        ref = varlen_m_ws.long_gemm(a, b, None, routing, transpose_b=trans)
        flops = 2 * a.shape[0] * k * d
        items.append((
            f"{form} streamed-B (long_gemm)",
            lambda a=a, b=b, t=trans: varlen_m_ws.long_gemm(a, b, None, routing, transpose_b=t),
            flops,
        ))
        programs = [int(x) for x in args.programs.split(",") if x] or [sm_count(a.device)]
        for mode in [int(x) for x in args.modes.split(",")]:
            for prog in programs:
                name = f"{form} mode {mode} ({MODES[mode]}), {prog} CTAs"
                mc = MulticastGemm(a, b, routing, trans, offs[form], prog, mode)
                mc.out.fill_(float("nan"))
                print(f"{name}: first launch (compiles first)", flush=True)
                out = mc()
                torch.cuda.synchronize()
                bad = (out != ref).any(1).sum().item()
                print(f"{name}: vs long_gemm: {bad} rows differ of {out.shape[0]}, "
                      f"max |diff| {(out.float() - ref.float()).abs().max().item():.3g}", flush=True)
                if bad:
                    rows_bad = (out != ref).any(1).nonzero().flatten()
                    nan_rows = torch.isnan(out).any(1).sum().item()
                    print(f"{name}: first bad rows {rows_bad[:8].tolist()}, rows with NaN (never written) {nan_rows}")
                    raise SystemExit(f"{name}: the output differs")
                items.append((name, mc, flops))
    rows = measure_passes(nvml, items, args.passes, args.warmup, args.window, args.shape)
    write_rows(args.json, args.shape, rows)


if __name__ == "__main__":
    main()
