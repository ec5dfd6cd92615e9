"""The aggregation with its slot loop static (``SLOTS``) against the layer's dynamic loop, on a few multiprocessors
and on the full grid, under the power cap. GPU only.

Session 65's ``reserve_probe.py --pipe`` (now ``--static-slots``) found a config with a static loop of 8 slots
moving half the 120B-n1024 dX aggregation 1.6 times as fast on 8 programs as the reserve config the layer ran (its
call 4 also timed the tile loop as ``tl.range``, an option since removed: 2.364 ms, the same as without). This probe
separates the causes and checks the full-grid forms: each item back to back for a settled warm-up, then a window
with its energy per call (``energy_probe.measure_items``); every form's output is checked bitwise against the
layer's.

* half the dX aggregation (no weights) on S programs: the layer's reserve config (a dynamic loop of UNROLL-slot
  steps up to the tile's largest count), the static loop of 8 slots alone (``EXACT``), with the dynamic remainder
  loop after it (always correct);
* the reserve form (the dX̃ GEMM in two column blocks, the first block's aggregation on S programs beside the
  second's GEMM) with the layer's config and with the static one;
* the forward aggregation (score-weighted) and half the dX aggregation on the full grid: the layer's config and the
  same with the static loop.

usage (GPU): PYTHONPATH=$PWD python scripts/agg_slots_probe.py [--shape T,d,n,E,K] [--reserve 8,12] [--warmup 0.5]
             [--window 0.8] [--json F]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from energy_probe import measure_items, probe_problem, write_rows  # noqa: E402
from reserve_probe import reserve_fn  # noqa: E402

from sonicmoe.bench.gpu_state import Nvml  # noqa: E402
from sonicmoe.ops import varlen_m_ws  # noqa: E402
from sonicmoe.ops.aggregation import RESERVE_CONFIG, gather_sum  # noqa: E402


def items(p: dict, routing, s_pair, reserves: list[int]) -> list:
    """(name, fn, FLOPs) of every form; each checked bitwise against the layer's."""
    w1, w2 = p["w1"], p["w2"]
    e, n2, d = w1.shape
    r = routing.num_rows
    k = -(-r // routing.num_tokens)
    g = torch.Generator(device="cuda").manual_seed(1)
    dh = torch.randn(r, n2, device="cuda", dtype=w1.dtype, generator=g)
    a = torch.randn(r, n2 // 2, device="cuda", dtype=w1.dtype, generator=g)
    dxt = varlen_m_ws.long_gemm(dh, w1, None, routing, transpose_b=False)
    y = varlen_m_ws.long_gemm(a, w2, None, routing, transpose_b=True)
    weights = routing.slot_scores(s_pair).float().contiguous()
    half = dxt[:, : d // 2]
    out = []

    def add(name, fn, ref, flops=0):
        if not torch.equal(fn(), ref):
            raise AssertionError(f"{name}: differs from the layer's form")
        out.append((name, fn, flops))

    static = {**RESERVE_CONFIG, "SLOTS": k}
    half_ref = gather_sum(half, routing, None)
    for s in reserves:
        for name, cfg in (("layer reserve config", RESERVE_CONFIG), ("static, exact", {**static, "EXACT": True}),
                          ("static + remainder", static)):
            add(f"dX agg 1/2 on {s}: {name}", lambda cfg=cfg, s=s: gather_sum(half, routing, None, config=cfg,
                                                                               num_programs=s), half_ref)
    flops = 2 * r * n2 * d
    ref = gather_sum(dxt, routing, None)
    for s in reserves:
        for name, cfg in (("layer reserve config", RESERVE_CONFIG), ("static + remainder", static)):
            add(f"dX̃ + dX agg, reserve {s}: {name}", reserve_fn(dh, w1, routing, None, False, 2, s, cfg), ref, flops)
    full = {"BLOCK_T": 1, "BLOCK_D": 1024, "num_warps": 4, "UNROLL": min(k, 4)}
    y_ref = gather_sum(y, routing, weights)
    add("fwd agg, full grid: layer", lambda: gather_sum(y, routing, weights), y_ref)
    add("fwd agg, full grid: 1x1024x4", lambda: gather_sum(y, routing, weights, config=full), y_ref)
    add("fwd agg, full grid: 1x1024x4 static + remainder",
        lambda: gather_sum(y, routing, weights, config={**full, "SLOTS": k}), y_ref)
    add("dX agg 1/2, full grid: layer", lambda: gather_sum(half, routing, None), half_ref)
    add("dX agg 1/2, full grid: 1x1024x4 static + remainder",
        lambda: gather_sum(half, routing, None, config={**full, "SLOTS": k}), half_ref)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32768,4096,1024,128,8")
    ap.add_argument("--reserve", default="8,12")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--window", type=float, default=0.8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    nvml = Nvml()
    p, routing, s_pair = probe_problem(args.shape)
    its = items(p, routing, s_pair, [int(v) for v in args.reserve.split(",")])
    torch.cuda.synchronize()
    print(f"== {torch.cuda.get_device_name()} shape {args.shape}: warm-up {args.warmup} s, window {args.window} s")
    write_rows(args.json, args.shape, measure_items(nvml, its, args.warmup, args.window))


if __name__ == "__main__":
    main()
