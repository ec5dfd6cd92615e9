"""Does the GPU wait for the host inside the benchmark's timing loop? The layer's forward+backward timed as
``triton.testing.do_bench`` times it (L2 flush, then start event, call, end event; per-call times, median), with
the host enqueuing the calls as the GPU runs them (``eager``), against the same loop queued entirely while the GPU
is still busy with a filler of large matrix products (``ahead``): there the GPU runs the calls back to back with no
host in between. The filler keeps the GPU at full power, so that both forms run in the same power state (a GPU left
idle first runs its next ~0.3 s at a higher clock: benchmarks/results/2026-11-26_nvidia-h200_session31/).

usage (GPU): PYTHONPATH=$PWD python scripts/host_ahead_probe.py [--shape T,d,n,E,K ...] [--calls 30] [--rounds 5]
             [--json F]

Each round: a settled warm-up (1 s of back-to-back calls, no synchronisation after it), then both forms in turn.
Printed per form: the median per-call ms over the rounds, with every round's median; for ``ahead`` also the host's
enqueue time against the filler's GPU time (the filler must be the longer for the loop to be fully queued ahead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from host_overhead import layer_calls


def timed_loop(fn, calls: int, cache: torch.Tensor, filler: torch.Tensor,
               filler_s: float) -> tuple[float, float, float]:
    """Median per-call ms of ``calls`` do_bench-style iterations queued right behind whatever the GPU still has to
    run (no synchronisation first, as in do_bench after its warm-up), with ``filler_s`` seconds of products of
    ``filler`` queued before them (0: none); also the host's enqueue seconds and the filler's GPU seconds."""
    f0, f1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    f0.record()
    if filler_s > 0:
        for _ in range(max(1, int(filler_s / 1.2e-3))):  # about 1.2 ms per product on an H100/H200
            torch.mm(filler, filler)
    f1.record()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    h0 = time.perf_counter()
    for i in range(calls):
        cache.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    host_s = time.perf_counter() - h0
    torch.cuda.synchronize()
    per_call = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
    return per_call, host_s, f0.elapsed_time(f1) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=float, default=1000.0, help="ms of back-to-back calls before each round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cache = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")  # do_bench's L2 flush buffer
    filler = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": []}
    for shape in args.shape or ["24576,1536,256,128,8"]:
        _, _, _, _, _, fwdbwd = layer_calls(shape)
        fwdbwd()
        torch.cuda.synchronize()
        rows = {"eager": [], "ahead": []}
        notes = []
        for _ in range(args.rounds):
            end = time.perf_counter() + args.warmup / 1e3
            while time.perf_counter() < end:
                fwdbwd()
            ms, _, _ = timed_loop(fwdbwd, args.calls, cache, filler, 0.0)
            rows["eager"].append(ms)
            ms, host_s, filler_s = timed_loop(fwdbwd, args.calls, cache, filler, args.calls * 4e-3)
            rows["ahead"].append(ms)
            notes.append((host_s, filler_s))
        for form, ms in rows.items():
            print(f"{shape} fwd+bwd {form:<6} {statistics.median(ms):.4f} ms per call {[round(v, 4) for v in ms]}",
                  flush=True)
        pairs = [(round(h, 3), round(f, 3)) for h, f in notes]
        print(f"{shape} ahead: host enqueue s / filler GPU s per round {pairs}")
        out["results"].append({"shape": shape, "calls": args.calls, "eager_ms": rows["eager"],
                               "ahead_ms": rows["ahead"], "host_enqueue_s_and_filler_s": notes})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
