"""A varlen-M GEMM and its aggregation side by side on separate multiprocessors, under the power cap.

The layer's down-projection (Y = A W2[e]ᵀ, then O = Σ s·Y) and its backward's dX̃ (dX̃ = dH W1[e], then dX = Σ dX̃)
each end in a memory-bound aggregation that leaves the tensor cores idle: about 0.8 ms of a 34.8 ms forward+backward
at (32768, 4096, 1024, 128, 8) on an H100, twice. The streamed-B Gluon GEMM (:mod:`sonicmoe.ops.varlen_m_ws`) is
persistent and fills every multiprocessor (its shared memory and registers), so an aggregation queued beside it
does not run beside it but between its programs (session 51: its column-block form level with one GEMM, then one
aggregation). Under the 700 W cap, though, a GEMM on fewer multiprocessors runs at a higher clock and loses less
than their share. This probe times, in settled windows with their energy per call (``energy_probe.measure``):

* the GEMM alone on P = all, and fewer, multiprocessors (``long_gemm(num_programs=P)``): what a multiprocessor is worth;
* the aggregation alone as the layer runs it, and on S multiprocessors (``gather_sum(num_programs=S)`` with a
  config whose program fills one);
* one GEMM, then one aggregation (the layer's forward);
* the backward's column-block form as the layer runs it (dX̃ only);
* ``reserve``: the GEMM in column blocks, each block after the first on all but S multiprocessors while the
  previous block's aggregation runs on the other S, the last block's aggregation alone; checked bitwise against
  one GEMM, then one aggregation.

usage (GPU): PYTHONPATH=$PWD python scripts/reserve_probe.py [--shape T,d,n,E,K] [--form fwd,bwd]
             [--reserve 16,24,32] [--blocks 2] [--warmup 0.7] [--window 1.0] [--json F]
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
from sonicmoe.ops import varlen_m_ws  # noqa: E402
from sonicmoe.ops.aggregation import gather_sum  # noqa: E402
from sonicmoe.ops.common import side_stream, sm_count  # noqa: E402
from sonicmoe.ops.library import gemm_then_gather_sum  # noqa: E402

# aggregation configs whose one program fills a multiprocessor's threads (BLOCK_T, BLOCK_D, num_warps, UNROLL)
# (t8w32u4 was aggregation.RESERVE_CONFIG until session 62, t8w32u8 since; the last two keep twice t8w32u4's bytes in
# flight, 128 KiB a multiprocessor)
FAT_CONFIGS = {"t8w32u4": (8, 1024, 32, 4), "t4w16u8": (4, 1024, 16, 8), "t8w16u8": (8, 1024, 16, 8),
               "t8w32u8": (8, 1024, 32, 8)}
# Session 65's call 3 also timed the tile loop software-pipelined by the compiler (tl.range num_stages 3-4, an option
# since removed): t4w16 3 stages, t2w8 4 stages and t4w8 3 stages took 2.68, 3.19 and 2.50 ms on 12 programs, against
# 1.61 for t8w32 with a static slot loop (``--static-slots``, removed with that loop in session 67; both at cf28b31;
# benchmarks/results/2026-12-02_nvidia-h200_session65/call3_pipe)


def config_of(values: tuple) -> dict:
    """A gather_sum config from a FAT_CONFIGS entry."""
    return dict(zip(("BLOCK_T", "BLOCK_D", "num_warps", "UNROLL"), values))


def reserve_fn(a, b, routing, weights, transpose_b: bool, blocks: int, reserve: int, cfg: dict):
    """The GEMM in ``blocks`` column blocks, each block's aggregation on ``reserve`` programs of ``cfg`` on the
    high-priority side stream beside the next block's GEMM on all but ``reserve`` multiprocessors; the last block's
    aggregation on the current stream with the layer's config."""
    d = b.shape[1] if transpose_b else b.shape[2]
    width = d // blocks
    sms = sm_count(a.device)
    side = side_stream(a.device)

    def fn():
        cur = torch.cuda.current_stream()
        c = torch.empty(a.shape[0], d, device=a.device, dtype=a.dtype)
        out = torch.empty(routing.num_tokens, d, device=a.device, dtype=a.dtype)
        for i in range(blocks):
            cols = slice(i * width, (i + 1) * width)
            varlen_m_ws.long_gemm(a, b, None, routing, transpose_b=transpose_b, out=c[:, cols], col0=i * width,
                                  width=width, num_programs=sms - reserve if i else None)
            if i < blocks - 1:
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    gather_sum(c[:, cols], routing, weights, out=out[:, cols], config=cfg, num_programs=reserve)
            else:
                gather_sum(c[:, cols], routing, weights, out=out[:, cols])
        cur.wait_stream(side)
        return out
    return fn


def items(p: dict, routing, s_pair, form: str, reserves: list[int], blocks: int) -> list:
    """(name, fn, FLOPs) of every variant of ``form`` (``fwd``: the down-projection and the score-weighted
    aggregation; ``bwd``: dX̃ and the dX aggregation); the combined ones checked bitwise against one GEMM, then one
    aggregation."""
    w1, w2 = p["w1"], p["w2"]
    e, n2, d = w1.shape
    r = routing.num_rows
    g = torch.Generator(device="cuda").manual_seed(1)
    if form == "fwd":
        a, b, trans = torch.randn(r, n2 // 2, device="cuda", dtype=w1.dtype, generator=g), w2, True
        weights = routing.slot_scores(s_pair).float().contiguous()
    else:
        a, b, trans, weights = torch.randn(r, n2, device="cuda", dtype=w1.dtype, generator=g), w1, False, None
    flops = 2 * r * a.shape[1] * d
    sms = sm_count(a.device)
    c = varlen_m_ws.long_gemm(a, b, None, routing, transpose_b=trans)
    half = c[:, : d // blocks]

    def serial():
        return gather_sum(varlen_m_ws.long_gemm(a, b, None, routing, transpose_b=trans), routing, weights)
    ref = serial()
    out = []
    for programs in (sms, sms - 8, sms - 16, sms - 32, sms - 48):
        out.append((f"{form} gemm P={programs}", lambda programs=programs: varlen_m_ws.long_gemm(
            a, b, None, routing, transpose_b=trans, num_programs=programs), flops))
    out.append((f"{form} agg whole (layer config)", lambda: gather_sum(c, routing, weights), 0))
    out.append((f"{form} agg 1/{blocks} (layer config)", lambda: gather_sum(half, routing, weights), 0))
    half_ref = gather_sum(half, routing, weights)
    for name, values in FAT_CONFIGS.items():
        cfg = config_of(values)
        if not torch.equal(gather_sum(half, routing, weights, config=cfg, num_programs=reserves[0]), half_ref):
            raise AssertionError(f"{form} agg {name} differs from the layer's aggregation")
        for s in reserves:
            out.append((f"{form} agg 1/{blocks} {name} on {s}", lambda cfg=cfg, s=s: gather_sum(
                half, routing, weights, config=cfg, num_programs=s), 0))
    out.append((f"{form} serial (gemm, then agg)", serial, flops))
    if form == "bwd":
        layer = lambda: gemm_then_gather_sum(a, b, None, routing, None, transpose_b=False)  # noqa: E731
        if not torch.equal(layer(), ref):
            raise AssertionError("bwd: the layer's column-block form differs from one GEMM, then one aggregation")
        out.append((f"{form} layer (column blocks)", layer, flops))
    for name, values in FAT_CONFIGS.items():
        cfg = config_of(values)
        for s in reserves:
            for nb in sorted({blocks, 2 * blocks}):
                fn = reserve_fn(a, b, routing, weights, trans, nb, s, cfg)
                if not torch.equal(fn(), ref):
                    raise AssertionError(f"{form} reserve {s} {name} {nb} blocks differs from the serial form")
                out.append((f"{form} reserve {s} {name} {nb} blocks", fn, flops))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32768,4096,1024,128,8")
    ap.add_argument("--form", default="fwd,bwd")
    ap.add_argument("--reserve", default="16,24,32", help="multiprocessors left to the aggregation")
    ap.add_argument("--blocks", type=int, default=2, help="column blocks (also twice as many)")
    ap.add_argument("--warmup", type=float, default=0.7)
    ap.add_argument("--window", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    nvml = Nvml()
    p, routing, s_pair = probe_problem(args.shape)
    reserves = [int(v) for v in args.reserve.split(",")]
    rows = []
    for form in args.form.split(","):
        its = items(p, routing, s_pair, form, reserves, args.blocks)
        for _, fn, _ in its:
            fn()
        torch.cuda.synchronize()
        print(f"== {torch.cuda.get_device_name()} {form} shape {args.shape}: warm-up {args.warmup} s, "
              f"window {args.window} s")
        rows += measure_items(nvml, its, args.warmup, args.window)
    write_rows(args.json, args.shape, rows)


if __name__ == "__main__":
    main()
