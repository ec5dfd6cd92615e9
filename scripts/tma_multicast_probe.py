"""Does the installed Triton give a Gluon kernel multicast TMA loads on Hopper? (compile only: runs on a CPU machine)

Sessions 51-52 traced most of the gap to cuBLAS at 120B-n1024 to energy per FLOP at the 700 W cap; cuBLAS's Hopper
GEMMs share each B box between the two CTAs of a cluster (one TMA load, ``multicast::cluster``, delivered to both),
which halves B's L2 traffic. Gluon's ``tma.async_copy_global_to_shared`` has no multicast argument in Triton 3.6, and
its shared layouts carry a ``cga_layout`` (how a cluster's CTAs tile a buffer). This probe compiles a small TMA load
for sm_90 with ``num_ctas=2`` under three layouts of the destination buffer: none (one CTA), the two CTAs splitting
its rows (``[[1, 0]]``) and both holding all of it (``[[0, 0]]``, a broadcast), and prints each variant's TMA
instruction and cluster directives. Session 52 on Triton 3.6.0: the broadcast compiles, but each CTA issues its own
load of the whole box (no ``multicast``); no cluster barrier or remote mbarrier is emitted either. Rerun it after a
Triton upgrade: a ``multicast::cluster`` line under ``broadcast`` means the 2-CTA B sharing can be built from Gluon.
Until then, ``tma_multicast_toy.py`` (session 54) issues the multicast load from Gluon by inline PTX.

usage: python scripts/tma_multicast_probe.py
"""

from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

BOX = 64
PTX_LINES = r"cp\.async\.bulk\.tensor|multicast|reqnctapercluster|explicitcluster|barrier\.cluster|mapa"


@gluon.jit
def _box_copy(desc, out_ptr, SMEM: gl.constexpr, BAR: gl.constexpr, REG: gl.constexpr, BOX: gl.constexpr):
    """One TMA load of a (BOX, BOX) box into shared memory, then out through registers."""
    buf = gl.allocate_shared_memory(gl.bfloat16, [BOX, BOX], SMEM)
    bar = gl.allocate_shared_memory(gl.int64, [1], BAR)
    mbarrier.init(bar, count=1)
    fence_async_shared()
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [0, 0], bar, buf)
    mbarrier.wait(bar, 0)
    mbarrier.invalidate(bar)
    x = buf.load(REG)
    rows = gl.arange(0, BOX, layout=gl.SliceLayout(1, REG))
    cols = gl.arange(0, BOX, layout=gl.SliceLayout(0, REG))
    gl.store(out_ptr + rows[:, None] * BOX + cols[None, :], x)


def compile_variant(cga: list, num_ctas: int):
    """The compiled kernel for a destination buffer (and register tile) tiled over the cluster by ``cga``."""
    smem = gl.NVMMASharedLayout(128, 16, 2, cga_layout=cga)
    bar = mbarrier.MBarrierLayout(cga_layout=[[0]] if cga else [])
    reg = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=cga)
    signature = {"desc": f"tensordesc<bf16[{BOX}, {BOX}],{smem!r}>", "out_ptr": "*bf16", "SMEM": "constexpr",
                 "BAR": "constexpr", "REG": "constexpr", "BOX": "constexpr"}
    src = GluonASTSource(_box_copy, signature, {"SMEM": smem, "BAR": bar, "REG": reg, "BOX": BOX})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_ctas": num_ctas})


def main() -> None:
    print(f"triton {triton.__version__}, target sm_90")
    multicast = False
    for name, cga, ctas in (("one CTA", [], 1), ("rows split", [[1, 0]], 2), ("broadcast", [[0, 0]], 2)):
        try:
            kernel = compile_variant(cga, ctas)
        except Exception as err:  # noqa: BLE001 - the probe reports any compiler error and goes on
            print(f"== {name}: does not compile: {type(err).__name__}: {str(err)[-400:]}")
            continue
        lines = [ln.strip() for ln in kernel.asm["ptx"].splitlines()
                 if re.search(PTX_LINES, ln) and not ln.lstrip().startswith((".loc", ".file"))]  # not this file's name
        multicast |= name == "broadcast" and any("multicast" in ln for ln in lines)
        print(f"== {name} (num_ctas={ctas}, host box {kernel.metadata.tensordesc_meta}):")
        for ln in lines:
            print("   ", ln)
    print("multicast TMA from a broadcast cga_layout:", "yes" if multicast else "no")


if __name__ == "__main__":
    main()
