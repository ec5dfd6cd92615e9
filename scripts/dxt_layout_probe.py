"""The dX̃ GEMM (dX̃ = dH W1[e], varlen-M) under the power cap: W1's layout, the Triton kernel's configs, the
column-block form the layer runs, and cuBLAS twins, each timed in a settled window with its energy per call.

W1 is (E, 2n, d) (SPEC), so dX̃'s B operand is MN-major (d contiguous). The down-projection, whose B (W2, (E, d, n))
is K-major, runs the same Triton kernel at about 585 TFLOP/s at (32768, 4096, 1024, 128, 8) on an H100 while dX̃
runs at about 530 (session 51, ``energy_probe.py``). It times the Triton kernel under explicit configs of
``grouped_gemm.TUNING_SPACE`` (``--kmajor``: also with a K-major copy of W1, (E, d, 2n), ``transpose_b``: the
layout was not the difference, session 51), the streamed-B Gluon kernel (:mod:`sonicmoe.ops.varlen_m_ws`) under its
configs, the forms the layer runs (whole, and in column blocks with the dX aggregation beside), the down-projection
on both kernels, and cuBLAS, checking the dX̃ outputs bitwise against the first.

usage (GPU): PYTHONPATH=$PWD python scripts/dxt_layout_probe.py [--shape T,d,n,E,K] [--warmup 1.0] [--window 1.5]
             [--configs 1,2] [--kmajor] [--json F]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from energy_probe import measure_items, probe_problem, write_rows  # noqa: E402

from sonicmoe.bench.gpu_state import Nvml  # noqa: E402
from sonicmoe.ops import grouped_gemm, varlen_m_ws  # noqa: E402
from sonicmoe.ops.library import gemm_then_gather_sum  # noqa: E402


def items(p: dict, routing, configs: list[int], kmajor: bool) -> list:
    """(name, fn, FLOPs, checked) of every variant; the checked ones' outputs are compared bitwise with the first
    (the Triton kernel with the first of ``configs``)."""
    w1, w2 = p["w1"], p["w2"]
    e, n2, d = w1.shape
    r = routing.num_rows
    g = torch.Generator(device="cuda").manual_seed(1)
    dh = torch.randn(r, n2, device="cuda", dtype=w1.dtype, generator=g)
    a = torch.randn(r, n2 // 2, device="cuda", dtype=w1.dtype, generator=g)
    w1k = w1.transpose(1, 2).contiguous()  # (E, d, 2n): K-major B for C = dH W1kᵀ
    flops = 2 * r * n2 * d
    out = []
    for i in configs:
        c = grouped_gemm.TUNING_SPACE[i]
        cfg = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
        for layout, b, trans in (("MN", w1, False), ("K", w1k, True))[:2 if kmajor else 1]:
            out.append((f"dX~ triton cfg{i} B {layout}-major", lambda cfg=cfg, b=b, trans=trans:
                        grouped_gemm.varlen_m_gemm(dh, b, None, routing, transpose_b=trans, config=cfg), flops, True))
    for split, stages in ((2, None), (1, None), (2, 3)):
        cfg = varlen_m_ws.long_config(split, stages)
        out.append((f"dX~ gluon long C_SPLIT={split} S={cfg['STAGES']}", lambda cfg=cfg: varlen_m_ws.long_gemm(
            dh, w1, None, routing, transpose_b=False, config=cfg), flops, True))
    out.append(("dX~ as the layer runs it (varlen_m_gemm)",
                lambda: grouped_gemm.varlen_m_gemm(dh, w1, None, routing, transpose_b=False), flops, True))
    out.append(("dX~ + dX agg, column blocks (layer)", lambda: gemm_then_gather_sum(
        dh, w1, None, routing, None, transpose_b=False), flops, False))
    out.append(("dX~ + dX agg, column blocks, triton", lambda: _without_long(lambda: gemm_then_gather_sum(
        dh, w1, None, routing, None, transpose_b=False)), flops, False))
    half = flops // 2
    out.append(("down as the layer runs it (varlen_m_gemm)",
                lambda: grouped_gemm.varlen_m_gemm(a, w2, None, routing, transpose_b=True), half, False))
    out.append(("down triton (autotuned)", lambda: _without_long(lambda: grouped_gemm.varlen_m_gemm(
        a, w2, None, routing, transpose_b=True)), half, False))
    out.append(("down gluon long C_SPLIT=2", lambda: varlen_m_ws.long_gemm(a, w2, None, routing, transpose_b=True),
                half, False))
    m = max(1, r // e)
    hb = torch.randn(e, m, n2, device="cuda", dtype=w1.dtype, generator=g)
    out.append(("cuBLAS bmm NN (B MN-major)", lambda: torch.bmm(hb, w1), 2 * e * m * n2 * d, False))
    if kmajor:
        out.append(("cuBLAS bmm NT (B K-major)", lambda: torch.bmm(hb, w1k.transpose(1, 2)), 2 * e * m * n2 * d,
                    False))
    return out


def _without_long(fn):
    """``fn()`` with the streamed-B Gluon kernel switched off (the Triton kernel serves)."""
    old = os.environ.get("SONICMOE_GLUON_LONG")
    os.environ["SONICMOE_GLUON_LONG"] = "0"
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("SONICMOE_GLUON_LONG")
        else:
            os.environ["SONICMOE_GLUON_LONG"] = old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32768,4096,1024,128,8")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--window", type=float, default=1.5)
    ap.add_argument("--configs", default="1,2", help="indices into grouped_gemm.TUNING_SPACE to time explicitly")
    ap.add_argument("--kmajor", action="store_true", help="also a K-major copy of W1 for each Triton config")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    nvml = Nvml()
    p, routing, _ = probe_problem(args.shape)
    its = items(p, routing, [int(c) for c in args.configs.split(",") if c], args.kmajor)
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
    rows = measure_items(nvml, [(name, fn, flops) for name, fn, flops, _ in its], args.warmup, args.window,
                         {name: {"same_bits": ok} for name, ok in checks.items()})
    write_rows(args.json, args.shape, rows)


if __name__ == "__main__":
    main()
