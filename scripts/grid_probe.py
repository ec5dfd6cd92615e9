"""Each persistent Gluon GEMM of the layer on fewer multiprocessors than the device has, under the power cap.

Session 53 found dX̃ = dH W1[e] faster on 116 programs of the streamed-B kernel than on all 132 of an H100 (7.61
against 7.75 ms, settled windows): the GEMM is held back by the board's 700 W and by L2-to-SM traffic, not by its
multiprocessors, and fewer of them run at a higher clock. This probe asks the same of every persistent Gluon kernel
the layer runs at a shape: the up-projection (:mod:`sonicmoe.ops.up_proj_ws`), dH (:mod:`~sonicmoe.ops.dh_ws`), the
weight gradients (:mod:`~sonicmoe.ops.weight_grad_ws`), the down-projection and dX̃ on the streamed-B kernel
(:mod:`~sonicmoe.ops.varlen_m_ws`), and the whole layer with every one of them trimmed at once. The grid is set by
replacing the ``sm_count`` each of those modules imported (their launchers read it at each call); the grids of the
Triton kernels and of the column blocks' reserve (:mod:`sonicmoe.ops.library`) are left alone.

Items run kernel by kernel, each at every program count in turn, in ``--passes`` passes (settled windows with energy,
``energy_probe.measure``), so the counts of one kernel are compared within a minute of each other.
Session 54 (one H100, 120B-n1024): every kernel measured was slower on fewer programs, e.g. the up-projection 7.83 /
8.20 / 8.53 ms on 132 / 124 / 116 and dW2 3.96 / 4.11 / 4.29; the setup (compiling, the bitwise checks) takes
about two minutes before the first window.

usage (GPU): PYTHONPATH=$PWD python scripts/grid_probe.py [--shape T,d,n,E,K] [--trim 0,8,16,24] [--passes 1]
             [--warmup 0.7] [--window 1.0] [--json F]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from energy_probe import measure_passes, probe_problem, write_rows  # noqa: E402
from kernel_breakdown import kernel_rows, layer_rows  # noqa: E402

from sonicmoe.bench.gpu_state import Nvml  # noqa: E402
from sonicmoe.ops import common, dh_ws, up_proj_ws, varlen_m_ws, weight_grad_ws  # noqa: E402

TRIMMED = (up_proj_ws, dh_ws, weight_grad_ws, varlen_m_ws)


def with_programs(fn, programs: int):
    """``fn`` run with every module of :data:`TRIMMED` launching ``programs`` persistent programs."""
    def run():
        for mod in TRIMMED:
            mod.sm_count = lambda device: programs
        try:
            return fn()
        finally:
            for mod in TRIMMED:
                mod.sm_count = common.sm_count
    return run


def same(a, b) -> bool:
    """Whether two results (a tensor, a tuple of them, or anything else: not compared) are bitwise equal."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple):
        return all(same(u, v) for u, v in zip(a, b))
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32768,4096,1024,128,8")
    ap.add_argument("--trim", default="0,8,16,24", help="multiprocessors left idle")
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--warmup", type=float, default=0.7)
    ap.add_argument("--window", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    nvml = Nvml()
    p, routing, s_pair = probe_problem(args.shape)
    t, d = p["x"].shape
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    sms = common.sm_count(p["x"].device)
    base = [(name, fn, flops) for name, fn, flops in kernel_rows(p, routing, s_pair, dout)
            if flops and not name.startswith("dX~")]  # the layer's dX~ is the streamed-B row below
    dh_ = torch.randn(routing.num_rows, p["w1"].shape[1], device="cuda", dtype=torch.bfloat16)
    base.append(("dX~ streamed-B", lambda: varlen_m_ws.long_gemm(dh_, p["w1"], None, routing, transpose_b=False),
                 2 * dh_.shape[0] * dh_.shape[1] * d))
    for name, fn, flops, leaves in layer_rows(p, routing, s_pair, dout, ("triton",)):
        if leaves:
            def call(fn=fn, leaves=leaves):
                for v in leaves:
                    v.grad = None
                fn()
            base.append((name, call, flops))
    items = []
    for name, fn, flops in base:
        ref = fn()
        for trim in (int(v) for v in args.trim.split(",")):
            g = with_programs(fn, sms - trim)
            out = g()
            if not same(out, ref):
                raise AssertionError(f"{name} on {sms - trim} programs differs from all {sms}")
            items.append((f"{name} P={sms - trim}", g, flops))
    rows = measure_passes(nvml, items, args.passes, args.warmup, args.window, args.shape)
    write_rows(args.json, args.shape, rows)


if __name__ == "__main__":
    main()
