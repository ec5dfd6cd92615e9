"""The Python cost of one hit of the kernel-launch fast path (sonicmoe.ops.fast_launch.launch_kernel), without a GPU.

usage: python scripts/fast_launch_overhead.py [--launches N] [--rounds R]

A kernel of the expert GEMMs' size of signature (16 runtime arguments: 8 tensors, 8 ints; 16 constexprs; two launch
options, as ``_varlen_m_kernel`` has) is launched through ``launch_kernel`` with the device stubbed and every key a
hit on a stand-in compiled kernel whose ``run`` does nothing. What is timed is what the fast path adds before the
driver call: the checks, the arguments in the kernel's order, the key and its lookup. The median over rounds of the
mean µs per launch is printed. It runs on any machine with Triton 3.6 (on a GPU host too, where the number is
what each of the layer's launches pays before Triton's compiled launcher).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton
import triton.language as tl

from sonicmoe.ops import fast_launch


@triton.jit
def _signature_kernel(a, b, c, d, e, f, g, h, i0, i1, i2, i3, i4, i5, i6, i7,
                      C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                      C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr, C9: tl.constexpr,
                      C10: tl.constexpr, C11: tl.constexpr, C12: tl.constexpr, C13: tl.constexpr, C14: tl.constexpr,
                      C15: tl.constexpr):
    pass


class _Compiled:
    """Stands in for a compiled kernel: its launcher does nothing."""

    function = None
    packed_metadata = None

    def run(self, *args):
        pass


class _EveryKeyHits(dict):
    def get(self, key, default=None):
        return _COMPILED


_COMPILED = _Compiled()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if not fast_launch.SUPPORTED:
        raise SystemExit(f"the fast path is off on Triton {triton.__version__} (checked: {fast_launch.CHECKED_TRITON})")
    torch.cuda.current_device = lambda: 0  # this process launches nothing: the device and stream are stubbed
    fast_launch._raw_stream = lambda device: 0
    fn = _signature_kernel
    while not isinstance(fn, triton.runtime.jit.JITFunction):  # the interpreter's wrapper, were it set
        fn = fn.fn
    fast_launch._launches(fn).kernels = _EveryKeyHits()
    tensors = [torch.empty(1024) for _ in range(8)]
    pos = [*tensors, 4096, 1536, 256, 128, 7, 1, 33, 64]
    kw = dict(C0=True, C1=False, C2=128, C3="ieee", C4=128, C5=128, C6=64, C7=1, C8=True, C9=True, C10=False,
              C11=True, C12=True, C13=3, C14=False, C15=True, num_warps=8, num_stages=3)
    launch = fast_launch.launch_kernel
    for _ in range(1000):
        launch(fn, (132, 1, 1), *pos, **kw)
    per_launch = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(args.launches):
            launch(fn, (132, 1, 1), *pos, **kw)
        per_launch.append((time.perf_counter() - t0) / args.launches * 1e6)
    print(f"fast path, Python per launch (hit): median {statistics.median(per_launch):.2f} µs over {args.rounds} "
          f"rounds of {args.launches} (min {min(per_launch):.2f}, max {max(per_launch):.2f})")


if __name__ == "__main__":
    main()
