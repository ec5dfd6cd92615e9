"""Energy per call of each kernel of the Triton layer, of its dense cuBLAS twin, and of the whole layer, under the
GPU's power cap: where the joules go.

An H100 or H200 running these layers sits at its 700 W cap, so the settled speed is set by the energy a call takes
(joules per useful FLOP), not only by how well the kernels overlap their loads with their MMAs. Each item runs back
to back for a settled warm-up, then for a window in which the board's energy counter (NVML
``nvmlDeviceGetTotalEnergyConsumption``, mJ) and CUDA events are read at both ends and the SM clock is sampled: per
call, GPU ms, joules and useful GFLOP per joule; per window, mean board watts and mean SM clock. The "dense twin"
rows are :func:`benchmarks.kernel_breakdown.dense_rows` (the same FLOPs as perfectly balanced contiguous batched
GEMMs, no gather, no epilogue; contiguous K-sums for the aggregations). An idle window gives the board's floor.

usage (GPU): PYTHONPATH=$PWD python scripts/energy_probe.py [--shape T,d,n,E,K] [--warmup 1.0] [--window 1.5]
             [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from kernel_breakdown import build_routing, dense_rows, kernel_rows, layer_rows  # noqa: E402

from sonicmoe.bench.gpu_state import Nvml  # noqa: E402
from sonicmoe.testing import random_problem  # noqa: E402


def probe_problem(shape: str) -> tuple[dict, object, torch.Tensor]:
    """(problem dict of :func:`sonicmoe.testing.random_problem`, top-k routing, pair scores S) of the probes' bf16
    problem at ``shape`` = "T,d,n,E,K" on the GPU (seed 0)."""
    t, d, n, e, k = (int(v) for v in shape.split(","))
    p = random_problem(t, d, n, e, dtype=torch.bfloat16, device="cuda", seed=0)
    routing, s_pair = build_routing(p, k, "topk")
    return p, routing, s_pair


def measure(nvml: Nvml, fn, warmup_s: float, window_s: float) -> dict:
    """Run ``fn`` back to back for ``warmup_s``, then for ``window_s``: GPU ms per call (CUDA events), J per call
    and mean W (energy counter), mean SM MHz (sampled between calls)."""
    end = time.perf_counter() + warmup_s
    while time.perf_counter() < end:
        fn()
    torch.cuda.synchronize()
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    clocks = []
    e0, t0 = nvml.energy_mj(), time.perf_counter()
    start_ev.record()
    calls = 0
    while time.perf_counter() - t0 < window_s:
        fn()
        calls += 1
        if calls % 4 == 0:
            clocks.append(nvml.sm_mhz())
    end_ev.record()
    torch.cuda.synchronize()
    e1, t1 = nvml.energy_mj(), time.perf_counter()
    joules = (e1 - e0) / 1e3
    return {"calls": calls, "ms": start_ev.elapsed_time(end_ev) / calls, "J": joules / calls,
            "W": joules / (t1 - t0), "MHz": sum(clocks) / len(clocks) if clocks else float(nvml.sm_mhz())}


def measure_items(nvml: Nvml, items: list, warmup_s: float, window_s: float, notes: dict | None = None) -> list[dict]:
    """Each (name, fn, useful FLOPs) of ``items`` in turn through :func:`measure`, with TFLOP/s and GFLOP/J added (0
    where the FLOPs are 0), each printed as a table row as soon as it is measured. ``notes``: per name, more fields
    for its row (printed last)."""
    notes = notes or {}
    print(f"{'item':42s} {'ms':>8s} {'J/call':>8s} {'W':>6s} {'MHz':>6s} {'TFLOP/s':>8s} {'GFLOP/J':>8s}")
    rows = []
    for name, fn, flops in items:
        r = measure(nvml, fn, warmup_s, window_s)
        r.update(item=name, flops=flops, tflops=flops / r["ms"] / 1e9 if flops else 0.0,
                 gflop_per_j=flops / r["J"] / 1e9 if flops and r["J"] > 0 else 0.0, **notes.get(name, {}))
        rows.append(r)
        extra = " ".join(f"{k}={v}" for k, v in notes.get(name, {}).items())
        print(f"{name:42s} {r['ms']:8.3f} {r['J']:8.4f} {r['W']:6.0f} {r['MHz']:6.0f} {r['tflops']:8.1f} "
              f"{r['gflop_per_j']:8.0f} {extra}", flush=True)
    return rows


def measure_passes(nvml: Nvml, items: list, passes: int, warmup_s: float, window_s: float, shape: str) -> list[dict]:
    """:func:`measure_items` over ``items`` ``passes`` times in a row (each row tagged with its pass, ``run``), after a
    header line naming the device and ``shape``."""
    torch.cuda.synchronize()
    print(f"== {torch.cuda.get_device_name()} shape {shape}: warm-up {warmup_s} s, window {window_s} s")
    rows = []
    for i in range(passes):
        print(f"-- pass {i + 1}")
        rows += [dict(r, run=i) for r in measure_items(nvml, items, warmup_s, window_s)]
    return rows


def write_rows(path: str | None, shape: str, rows: list[dict], **extra) -> None:
    """The probe's rows as JSON ({"device", "shape", "rows", ...extra}) at ``path`` (nothing without one)."""
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": shape, **extra, "rows": rows}, f, indent=1)


# aggregation variants of --agg: (BLOCK_T, BLOCK_D, num_warps, UNROLL, programs per multiprocessor or 0 for one per
# tile). Session 46, 7B on an H200: every persistent grid of 33-528 programs took 1.5-5x as long as one per tile
AGG_VARIANTS = [
    (1, 1024, 4, 4, 0), (1, 1024, 4, 8, 0), (1, 512, 4, 4, 0), (1, 512, 2, 4, 0), (1, 512, 2, 8, 0),
    (2, 512, 4, 4, 0), (1, 256, 1, 8, 0), (2, 512, 4, 8, 2),
]


def agg_items(p: dict, routing, s_pair: torch.Tensor) -> list:
    """(name, fn, 0) of the forward aggregation (Y of the problem, score-weighted) as the layer runs it, a plain copy
    of Y (the joules per byte of a stream, for scale), and the aggregation under each of :data:`AGG_VARIANTS`
    (``gather_sum`` with that config, whose UNROLL wins over the launcher's), each checked bitwise against the
    layer's."""
    from sonicmoe.ops.aggregation import gather_sum
    from sonicmoe.ops.grouped_gemm import down_proj
    from sonicmoe.ops.up_proj import up_proj

    _, a = up_proj(p["x"], p["w1"], None, routing)
    y = down_proj(a, p["w2"], None, routing)
    w = routing.slot_scores(s_pair).float().contiguous()
    ref = gather_sum(y, routing, w)
    items = [("gather_sum as the layer runs it", lambda: gather_sum(y, routing, w), 0)]
    # the board's floor for moving bytes: a copy of Y (reads and writes Y's bytes, about 1.8 times the
    # aggregation's), for the joules per byte of the aggregations against a plain stream
    y_copy = torch.empty_like(y)
    items.append(("copy of Y (torch, 2 x Y's bytes)", lambda: y_copy.copy_(y), 0))
    for bt, bd, warps, unroll, pps in AGG_VARIANTS:
        cfg = {"BLOCK_T": bt, "BLOCK_D": bd, "num_warps": warps, "UNROLL": unroll}

        def fn(cfg=cfg, pps=pps):
            return gather_sum(y, routing, w, config=cfg, progs_per_sm=pps)
        if not torch.equal(fn(), ref):
            raise AssertionError(f"aggregation variant {cfg} (progs_per_sm {pps}) differs from the layer's")
        items.append((f"agg T{bt} D{bd} w{warps} u{unroll} " + (f"{pps}/SM" if pps else "per tile"), fn, 0))
    return items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="24576,1536,256,128,8")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds of back-to-back calls before each window")
    ap.add_argument("--window", type=float, default=1.5, help="seconds measured per item")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--agg", action="store_true", help="the forward aggregation's launch variants instead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t, d, n, e, k = (int(v) for v in args.shape.split(","))
    nvml = Nvml()
    p, routing, s_pair = probe_problem(args.shape)
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    if args.agg:
        items = agg_items(p, routing, s_pair)
    else:
        items = [(f"triton {name}", fn, flops) for name, fn, flops in kernel_rows(p, routing, s_pair, dout)]
    if not args.no_dense and not args.agg:
        items += [(f"dense  {name}", fn, flops) for name, fn, flops in dense_rows(t, d, n, e, k)]
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        items.append(("dense  GEMM 8192^3", lambda: a @ b, 2 * 8192 ** 3))
    backends = ("triton",) if args.agg else ("triton", "torch")
    for name, fn, flops, leaves in layer_rows(p, routing, s_pair, dout, backends):
        def call(fn=fn, leaves=leaves):
            for v in leaves or ():
                v.grad = None
            fn()
        items.append((name, call, flops))
    for _, fn, _ in items:  # compile and autotune everything before any window
        fn()
    torch.cuda.synchronize()
    print(f"== {torch.cuda.get_device_name()} shape {args.shape}: warm-up {args.warmup} s, window {args.window} s")
    rows = measure_items(nvml, items, args.warmup, args.window)
    torch.cuda.synchronize()
    e0, t0 = nvml.energy_mj(), time.perf_counter()
    time.sleep(2.0)
    idle_w = (nvml.energy_mj() - e0) / 1e3 / (time.perf_counter() - t0)
    print(f"idle board power over 2 s after the load: {idle_w:.0f} W")
    write_rows(args.json, args.shape, rows, idle_W=idle_w)


if __name__ == "__main__":
    main()
