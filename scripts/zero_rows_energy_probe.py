"""GPU diagnostic: how much a dense bf16 GEMM's energy per call depends on its operands' values, under the power cap.

The varlen-M kernels run each expert's last, partial M-tile as a whole tile: the rows past the expert's end are
zeros where the kernel gathers its rows by ``cp.async`` (the up-projection, dH) and the next expert's rows where TMA
loads a contiguous block (the streamed-B kernel: the down-projection and dX̃), about 3% of the tiles' rows at
(32768, 4096, 1024, 128, 8). Under the 700 W cap the settled speed follows the energy a call takes, so whether a
zero row costs the tensor cores less than a random one decides whether zeroing those rows could pay. This probe
times C = A Bᵀ (torch.matmul, cuBLAS) with the last ``f`` of every 128-row block of A zero, for several ``f``, each
in a settled window (:func:`energy_probe.measure_items`: ms, J and W per call, SM clock).

usage (GPU): PYTHONPATH=$PWD python scripts/zero_rows_energy_probe.py [--mnk 262144,4096,1024]
             [--fractions 0,0.03125,0.25,0.5,1] [--warmup 1.0] [--window 1.5] [--json F]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from energy_probe import measure_items, write_rows  # noqa: E402

from sonicmoe.bench.gpu_state import Nvml  # noqa: E402


def zero_tail_rows(a: torch.Tensor, fraction: float, tile: int = 128) -> torch.Tensor:
    """A copy of ``a`` (M, K) with the last round(fraction · tile) rows of every ``tile``-row block zero."""
    out = a.clone()
    zeros = round(fraction * tile)
    if zeros:
        out.view(-1, tile, a.shape[1])[:, tile - zeros:] = 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mnk", default="262144,4096,1024", help="M,N,K of C (M, N) = A (M, K) B (N, K)ᵀ")
    ap.add_argument("--fractions", default="0,0.03125,0.25,0.5,1", help="zero fraction of each 128-row block")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--window", type=float, default=1.5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    m, n, k = (int(v) for v in args.mnk.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    items = []
    for f in (float(v) for v in args.fractions.split(",")):
        af = zero_tail_rows(a, f)
        items.append((f"zero fraction {f:.4f}", lambda af=af: torch.matmul(af, b.t(), out=c), 2 * m * n * k))
    print(f"== {torch.cuda.get_device_name()} C = A Bᵀ, M,N,K = {m},{n},{k}: warm-up {args.warmup} s, "
          f"window {args.window} s")
    rows = measure_items(Nvml(), items, args.warmup, args.window)
    write_rows(args.json, args.mnk, rows)


if __name__ == "__main__":
    main()
