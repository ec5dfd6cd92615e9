"""TMA multicast between the two CTAs of a cluster from a Gluon kernel, through inline PTX (GPU; --compile-only on CPU).

Triton 3.6's Gluon TMA copy has no multicast argument, and its lowering says "NYI: Support multicast"
(``tma_multicast_probe.py``). The B-box sharing that gives cuBLAS its lower energy per FLOP on Hopper can still be
emitted from Gluon by hand. This toy does it with a kernel compiled with ``num_ctas=2`` and every layout broadcast
over the cluster (``cga_layout`` [[0]] / [[0, 0]]: each CTA holds its own copy, as in a CUTLASS-style cluster):

* each CTA of the pair loads one half of a (64, 64) bf16 box (rows 32·r ... 32·r + 31 for cluster rank r) with
  ``cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster`` and CTA mask
  0b11, into both CTAs' buffers at the half's offset; both CTAs' load barriers expect the whole box's bytes;
* after the load each CTA arrives on its peer's second barrier (``mapa.shared::cluster`` and
  ``mbarrier.arrive.release.cluster.shared::cluster``) and waits on its own: the handshake a multicast ring's
  "slot empty" barriers need;
* ``barrier.cluster`` arrive/wait after the barriers' initialisation and before exit;
* the operands inline PTX cannot get from Gluon come by other routes. The shared-memory addresses are
  ``global_smem`` plus the allocation offsets, read from a first compile's PTX (:func:`smem_offsets`) and passed
  as constexprs to a second compile, which must give the same offsets. The half-box tensor map is a
  ``CUtensorMap`` built by Triton's driver (``fill_tma_descriptor``) and copied into a CUDA tensor; its bytes are read
  at the object's 128-byte aligned field through ctypes.

Session 54, one H100: the kernel ran without a hang (so every CTA's load barrier received both halves and every
remote arrive landed), and each cluster's written copy equalled the source box in all 64 rows. CTA 0 had loaded
only rows 0-31 itself.
Only the rank-0 CTA's copy is written out: Triton predicates a broadcast layout's global stores on
``%cluster_ctarank`` (only rank 0 stores), so a real kernel with different tiles per CTA must store its output by
inline PTX too (e.g. a TMA store of its staged tile). What is left for a multicast varlen-M GEMM, and what is known:
* pairs of M-tiles of one expert per cluster, with a phantom tile where an expert has an odd count;
* the ring's "empty" barriers counting both CTAs' consumers;
* the output's TMA store in inline PTX;
* the streamed-B kernel's structure under ``num_ctas=2`` compiles (:func:`compile_ws_tile`: ``gl.warp_specialize``
  with a TMA loader warp and wgmma warpgroups; Gluon's own TMA loads are issued by every CTA, not only rank 0).

usage: python scripts/tma_multicast_toy.py [--compile-only]
"""
from __future__ import annotations

import argparse
import ctypes
import re

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BOX = 64
HALF = BOX // 2
# inline PTX (OFF*: shared-memory offsets, filled in by asm()); $1 is each thread's index (thread 0 issues)
SYNC = """{
    barrier.cluster.arrive.release.aligned;
    barrier.cluster.wait.acquire.aligned;
    mov.u32 $0, %cluster_ctarank;
}"""
LOAD = """{
    .reg .pred p;
    .reg .u32 base, dst, mb, row;
    .reg .b16 mask;
    setp.eq.u32 p, $1, 0;
    mov.u32 base, global_smem;
    mad.lo.u32 dst, $3, HALFBYTES, base;
    add.u32 dst, dst, OFFBUF;
    add.u32 mb, base, OFFBAR;
    mul.lo.u32 row, $3, HALF;
    mov.b16 mask, 3;
    @p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster
        [dst], [$2, {$4, row}], [mb], mask;
    mov.u32 $0, 0;
}"""
ARRIVE = """{
    .reg .pred p;
    .reg .u32 base, loc, rem, peer;
    setp.eq.u32 p, $1, 0;
    mov.u32 base, global_smem;
    add.u32 loc, base, OFFDONE;
    xor.b32 peer, $2, 1;
    mapa.shared::cluster.u32 rem, loc, peer;
    @p mbarrier.arrive.release.cluster.shared::cluster.b64 _, [rem];
    mov.u32 $0, 0;
}"""


@gluon.jit
def _toy(map_ptr, out_ptr, SMEM: gl.constexpr, REG: gl.constexpr, BAR: gl.constexpr, LAY: gl.constexpr,
         BOX: gl.constexpr, SYNC: gl.constexpr, LOAD: gl.constexpr, ARRIVE: gl.constexpr):
    """One cluster: the multicast half-box loads, the remote-arrive handshake, then the box out (rank 0 only)."""
    buf = gl.allocate_shared_memory(gl.bfloat16, [BOX, BOX], SMEM)
    bar0 = gl.allocate_shared_memory(gl.int64, [1], BAR)
    bar1 = gl.allocate_shared_memory(gl.int64, [1], BAR)
    mbarrier.init(bar0, count=1)
    mbarrier.init(bar1, count=1)
    fence_async_shared(cluster=True)
    lane = gl.arange(0, 128, layout=LAY)
    rank = gl.inline_asm_elementwise(SYNC, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    mbarrier.expect(bar0, BOX * BOX * 2)
    zero = lane * 0
    gl.inline_asm_elementwise(LOAD, "=r,r,l,r,r", [lane, map_ptr + zero, rank + zero, zero], dtype=gl.int32,
                              is_pure=False, pack=1)
    mbarrier.wait(bar0, 0)
    gl.inline_asm_elementwise(ARRIVE, "=r,r,r", [lane, rank + zero], dtype=gl.int32, is_pure=False, pack=1)
    mbarrier.wait(bar1, 0)
    x = buf.load(REG)
    rows = gl.arange(0, BOX, layout=gl.SliceLayout(1, REG))
    cols = gl.arange(0, BOX, layout=gl.SliceLayout(0, REG))
    r2 = gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)
    base = out_ptr + (gl.program_id(0) * 2 + r2) * BOX * BOX
    gl.store(base + rows[:, None] * BOX + cols[None, :], x)
    gl.inline_asm_elementwise(SYNC, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _ws_loader(a_desc, b_desc, a_buf, b_buf, ready):
    mbarrier.expect(ready, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [0, 0], ready, a_buf)
    tma.async_copy_global_to_shared(b_desc, [0, 0], ready, b_buf)


@gluon.jit
def _ws_mma(a_buf, b_buf, ready, out_ptr, ACC: gl.constexpr):
    mbarrier.wait(ready, 0)
    acc = warpgroup_mma(a_buf, b_buf, gl.zeros((128, 256), dtype=gl.float32, layout=ACC), is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    rows = gl.arange(0, 128, layout=gl.SliceLayout(1, ACC))
    cols = gl.arange(0, 256, layout=gl.SliceLayout(0, ACC))
    gl.store(out_ptr + rows[:, None] * 256 + cols[None, :], acc)


@gluon.jit
def _ws_tile(a_desc, b_desc, out_ptr, BAR: gl.constexpr, ACC: gl.constexpr):
    """One 128 × 256 tile as the streamed-B kernel computes it (a TMA loader warp, two wgmma warpgroups)."""
    a_buf = gl.allocate_shared_memory(a_desc.dtype, a_desc.block_type.shape, a_desc.layout)
    b_buf = gl.allocate_shared_memory(b_desc.dtype, b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [1], BAR)
    mbarrier.init(ready, count=1)
    fence_async_shared()
    gl.warp_specialize([(_ws_mma, (a_buf, b_buf, ready, out_ptr, ACC)),
                        (_ws_loader, (a_desc, b_desc, a_buf, b_buf, ready))], [1], [40])


def compile_ws_tile():
    """:func:`_ws_tile` compiled for sm_90 in 2-CTA clusters with broadcast layouts (does the streamed-B kernel's
    structure compile there?)."""
    smem = gl.NVMMASharedLayout(128, 16, 2, cga_layout=[[0, 0]])
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, 256, 16],
                                    cga_layout=[[0, 0]])
    sig = {"a_desc": f"tensordesc<bf16[128, 64],{smem!r}>", "b_desc": f"tensordesc<bf16[64, 256],{smem!r}>",
           "out_ptr": "*fp32", "BAR": "constexpr", "ACC": "constexpr"}
    src = GluonASTSource(_ws_tile, sig, {"BAR": mbarrier.MBarrierLayout(cga_layout=[[0]]), "ACC": acc})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_ctas": 2})


def layouts():
    """The kernel's layouts, each broadcast over the 2-CTA cluster."""
    return dict(SMEM=gl.NVMMASharedLayout(128, 16, 2, cga_layout=[[0, 0]]),
                REG=gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=[[0, 0]]),
                BAR=mbarrier.MBarrierLayout(cga_layout=[[0]]),
                LAY=gl.BlockedLayout([1], [32], [4], [0], cga_layout=[[0]]))


def asm(off_buf, off_bar, off_done):
    """The inline PTX strings with the shared-memory offsets of the box buffer and the two barriers filled in."""
    return dict(SYNC=SYNC,
                LOAD=LOAD.replace("HALFBYTES", str(HALF * BOX * 2)).replace("OFFBUF", str(off_buf))
                .replace("OFFBAR", str(off_bar)).replace("HALF", str(HALF)),
                ARRIVE=ARRIVE.replace("OFFDONE", str(off_done)))


def compile_toy(off_buf, off_bar, off_done):
    """The kernel compiled for sm_90 in 2-CTA clusters with these offsets in its inline PTX."""
    sig = {"map_ptr": "*i8", "out_ptr": "*bf16", **{k: "constexpr" for k in
           ("SMEM", "REG", "BAR", "LAY", "BOX", "SYNC", "LOAD", "ARRIVE")}}
    consts = {**layouts(), "BOX": BOX, **asm(off_buf, off_bar, off_done)}
    return triton.compile(GluonASTSource(_toy, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_ctas": 2})


def smem_offsets(ptx):
    """(buffer offset, load barrier offset, done barrier offset) from the PTX: the barriers in mbarrier.init order."""
    base = re.search(r"mov\.b32\s+(%r\d+), global_smem;", ptx).group(1)
    adds = dict(re.findall(r"add\.s32\s+(%r\d+), " + re.escape(base) + r", (\d+);", ptx))
    inits = re.findall(r"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)(?:\+(\d+))?\]", ptx)
    offs = [int(adds.get(r, 0)) + int(extra or 0) for r, extra in inits]
    return (0, *offs)


def tensormap(x, block):
    """The 128-byte CUtensorMap of a 2-D bf16 tensor with a 128-byte swizzle, in a CUDA uint8 tensor."""
    utils = triton.runtime.driver.active.utils
    obj = utils.fill_tma_descriptor(x.data_ptr(), 3, 2, 9, block, list(x.shape), list(x.stride()), 0)
    raw = ctypes.string_at(id(obj) + 128, 128)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).cuda()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true", help="compile and print the cluster PTX (no GPU)")
    args = ap.parse_args()
    k = compile_toy(0, 8192, 8200)
    off = smem_offsets(k.asm["ptx"])
    print("offsets from the first compile:", off)
    k = compile_toy(*off)
    assert smem_offsets(k.asm["ptx"]) == off
    pattern = "multicast|mapa|barrier.cluster|reqnctaper"
    print("\n".join(ln.strip() for ln in k.asm["ptx"].splitlines() if re.search(pattern, ln)))
    ws = [ln.strip() for ln in compile_ws_tile().asm["ptx"].splitlines()]
    print("warp-specialised wgmma tile in 2-CTA clusters: compiles;",
          sum("wgmma.mma_async" in ln for ln in ws), "wgmmas,",
          sum("cp.async.bulk.tensor" in ln for ln in ws), "TMA loads (not predicated on the cluster rank)")
    if args.compile_only:
        return
    torch.manual_seed(0)
    src = torch.randn(BOX, BOX, device="cuda", dtype=torch.bfloat16)
    tmap = tensormap(src, [HALF, BOX])
    out = torch.full((16, BOX, BOX), float("nan"), device="cuda", dtype=torch.bfloat16)
    _toy[(4,)](tmap, out, num_warps=4, num_ctas=2, **layouts(), BOX=BOX, **asm(*off))
    torch.cuda.synchronize()
    for c in range(16):  # slot 2·program + rank; Triton lets only rank 0 store a broadcast tensor
        o = out[c]
        print("slot", c, "written:", not torch.isnan(o).all().item(), "equal to the box:", torch.equal(o, src),
              "rows equal:", (o == src).all(1).sum().item())
    if not all(torch.equal(out[2 * c], src) for c in range(4)):
        raise SystemExit("a cluster's copy of the box differs from the source")


if __name__ == "__main__":
    main()
