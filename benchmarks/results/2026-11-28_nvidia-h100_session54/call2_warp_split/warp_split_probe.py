"""The streamed-B Gluon GEMM with its two MMA warpgroups splitting the 128 × 256 tile by columns instead of rows.

Each warpgroup of :mod:`sonicmoe.ops.varlen_m_ws` computes 64 rows × 256 columns of the tile (``m64n256k16``
wgmmas): per 64-deep K-block the two read A's 128 rows once between them and B's 256-column box twice, 40 K
elements from shared memory. Split by columns (each 128 rows × 128 columns, ``m64n128k16``, ``WARPS_N`` = 2) they
read A twice and B's box once, 32 K elements: 20% less shared-memory traffic for the same MMAs and the same bits
(each output's K-sum in the same order). At the 700 W cap a GEMM's speed follows its energy per FLOP, so this asks
whether the lighter operand traffic is faster. The column split holds a whole column half per warpgroup, so the tile
leaves through one 128 × 256 staging buffer (``C_SPLIT`` 1): three 64-deep ring slots, or six 32-deep ones.

Every config is checked bitwise against the default, then timed in settled windows with its energy per call
(``energy_probe.measure``), the configs of one form in turn, in ``--passes`` passes.

Session 54 measured it and reverted the kernel's ``WARPS_N`` / ``BLOCK_K`` config keys; to rerun, apply
``warps_n.patch`` (beside this file) to commit 4dfe1b2's tree and copy this file to scripts/.

usage (GPU): PYTHONPATH=$PWD python scripts/warp_split_probe.py [--shape T,d,n,E,K] [--form down,dxt] [--passes 2]
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

from sonicmoe.bench.gpu_state import Nvml  # noqa: E402
from sonicmoe.ops import varlen_m_ws  # noqa: E402

CONFIGS = {
    "default": None,
    "rows BK32 8st": {"C_SPLIT": 2, "STAGES": 8, "BLOCK_K": 32},
    "cols BK64 3st": {"C_SPLIT": 1, "STAGES": 3, "WARPS_N": 2},
    "cols BK32 6st": {"C_SPLIT": 1, "STAGES": 6, "BLOCK_K": 32, "WARPS_N": 2},
}


def items(p: dict, routing, form: str) -> list:
    """(name, fn, FLOPs) of the form's GEMM (``down``: A W2[e]ᵀ; ``dxt``: dH W1[e]) under each of :data:`CONFIGS`."""
    w1, w2 = p["w1"], p["w2"]
    e, n2, d = w1.shape
    g = torch.Generator(device="cuda").manual_seed(1)
    k = n2 // 2 if form == "down" else n2
    a = torch.randn(routing.num_rows, k, device="cuda", dtype=w1.dtype, generator=g)
    b, trans = (w2, True) if form == "down" else (w1, False)
    ref = varlen_m_ws.long_gemm(a, b, None, routing, transpose_b=trans)
    out = []
    for name, cfg in CONFIGS.items():
        def fn(cfg=cfg):
            return varlen_m_ws.long_gemm(a, b, None, routing, transpose_b=trans, config=cfg)
        if not torch.equal(fn(), ref):
            raise AssertionError(f"{form} {name} differs from the default config")
        out.append((f"{form} {name}", fn, 2 * a.shape[0] * k * d))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32768,4096,1024,128,8")
    ap.add_argument("--form", default="down,dxt")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=0.7)
    ap.add_argument("--window", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    nvml = Nvml()
    p, routing, _ = probe_problem(args.shape)
    its = [it for form in args.form.split(",") for it in items(p, routing, form)]
    rows = measure_passes(nvml, its, args.passes, args.warmup, args.window, args.shape)
    write_rows(args.json, args.shape, rows)


if __name__ == "__main__":
    main()
