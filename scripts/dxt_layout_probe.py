"""The dX̃ GEMM (dX̃ = dH W1[e], varlen-M) under the power cap: W1's layout, the Triton kernel's configs, the
column-block form the layer runs, and cuBLAS twins, each timed in a settled window with its energy per call.

W1 is (E, 2n, d) (SPEC), so dX̃'s B operand is MN-major (d contiguous). The down-projection, whose B (W2, (E, d, n))
is K-major, runs the same Triton kernel at about 585 TFLOP/s at (32768, 4096, 1024, 128, 8) on an H100 while dX̃
runs at about 530 (session 51, ``energy_probe.py``). This probe asks whether B's layout is the difference: it times
dX̃ with a K-major copy of W1 ((E, d, 2n), ``transpose_b``) beside the layer's form, checks the outputs bitwise
against the layer's, and times the configs of ``grouped_gemm.TUNING_SPACE`` and the cuBLAS twins (NN and NT).

usage (GPU): PYTHONPATH=$PWD python scripts/dxt_layout_probe.py [--shape T,d,n,E,K] [--warmup 1.0] [--window 1.5]
             [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from energy_probe import measure  # noqa: E402
from kernel_breakdown import build_routing  # noqa: E402

from sonicmoe.bench.gpu_state import Nvml  # noqa: E402
from sonicmoe.ops import grouped_gemm  # noqa: E402
from sonicmoe.ops.library import gemm_then_gather_sum  # noqa: E402
from sonicmoe.testing import random_problem  # noqa: E402


def items(p: dict, routing, k: int) -> list:
    """(name, fn, FLOPs, output-or-None) of every variant; outputs are checked bitwise against the first."""
    w1 = p["w1"]
    e, n2, d = w1.shape
    r = routing.num_rows
    g = torch.Generator(device="cuda").manual_seed(1)
    dh = torch.randn(r, n2, device="cuda", dtype=w1.dtype, generator=g)
    w1k = w1.transpose(1, 2).contiguous()  # (E, d, 2n): K-major B for C = dH W1kᵀ
    flops = 2 * r * n2 * d
    out = [
        ("dX~ layer form (B MN-major)", lambda: grouped_gemm.varlen_m_gemm(dh, w1, None, routing, transpose_b=False),
         flops, True),
        ("dX~ B K-major copy", lambda: grouped_gemm.varlen_m_gemm(dh, w1k, None, routing, transpose_b=True), flops,
         True),
    ]
    for i, c in enumerate(grouped_gemm.TUNING_SPACE):
        cfg = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
        for layout, b, trans in (("MN", w1, False), ("K", w1k, True)):
            out.append((f"dX~ cfg{i} B {layout}-major", lambda cfg=cfg, b=b, trans=trans: grouped_gemm.varlen_m_gemm(
                dh, b, None, routing, transpose_b=trans, config=cfg), flops, True))
    for label, b, trans in (("(layer)", w1, False), ("B K-major", w1k, True)):
        out.append((f"dX~ + dX agg, column blocks {label}", lambda b=b, trans=trans: gemm_then_gather_sum(
            dh, b, None, routing, None, transpose_b=trans), flops, False))
    m = max(1, r // e)
    hb = torch.randn(e, m, n2, device="cuda", dtype=w1.dtype, generator=g)
    out.append(("cuBLAS bmm NN (B MN-major)", lambda: torch.bmm(hb, w1), 2 * e * m * n2 * d, False))
    out.append(("cuBLAS bmm NT (B K-major)", lambda: torch.bmm(hb, w1k.transpose(1, 2)), 2 * e * m * n2 * d, False))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32768,4096,1024,128,8")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--window", type=float, default=1.5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t, d, n, e, k = (int(v) for v in args.shape.split(","))
    nvml = Nvml()
    p = random_problem(t, d, n, e, dtype=torch.bfloat16, device="cuda", seed=0)
    routing, _ = build_routing(p, k, "topk")
    its = items(p, routing, k)
    ref = its[0][1]().clone()
    checks = {}
    for name, fn, _, check in its:
        o = fn()
        if check:
            checks[name] = bool(torch.equal(o, ref))
    torch.cuda.synchronize()
    for key, cfg in grouped_gemm._tuned._chosen.items():  # what the autotuner chose for the untuned calls
        print("autotuned:", [v for v in key if isinstance(v, int)], cfg)
    print(f"== {torch.cuda.get_device_name()} shape {args.shape}: warm-up {args.warmup} s, window {args.window} s")
    print(f"{'item':42s} {'ms':>8s} {'J/call':>8s} {'W':>6s} {'MHz':>6s} {'TFLOP/s':>8s} {'GFLOP/J':>8s} bits")
    rows = []
    for name, fn, flops, _ in its:
        row = measure(nvml, fn, args.warmup, args.window)
        row.update(item=name, tflops=flops / row["ms"] / 1e9, gflop_per_j=flops / row["J"] / 1e9 if row["J"] else 0,
                   same_bits=checks.get(name))
        rows.append(row)
        print(f"{name:42s} {row['ms']:8.3f} {row['J']:8.4f} {row['W']:6.0f} {row['MHz']:6.0f} {row['tflops']:8.1f} "
              f"{row['gflop_per_j']:8.0f} {checks.get(name, '')}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": args.shape, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
