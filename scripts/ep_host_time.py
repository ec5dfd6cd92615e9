"""Host against device time of expert parallelism's forward and backward, in a group of one rank (P = 1), bf16.

usage: python scripts/ep_host_time.py [--shape T,d,n,E,K] [--calls N] [--module NAME ...]

For ``expert_parallel_experts`` and ``sonicmoe.experts`` with the same routing: the host time of the forward call
(it includes the one host sync of the expert-parallel forward), the host time of ``backward()``'s call, and the time
to the end of the device work after each; medians over N calls, each started on an idle device. Where a call's host
time is near its total, the host (launches, Python, the sync) bounds it, not the kernels. Then "queued": forward and
backward with the device kept busy for BUSY_MS before the call (as when earlier layers' work is queued), the time
to the end less the busy time: what the call adds to a step. ``--module`` names other modules holding an
``expert_parallel_experts`` to time beside it (an A/B of two versions).
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time

import torch
import torch.distributed as dist

from sonicmoe import experts, routing_from_topk
from sonicmoe.expert_parallel import expert_parallel_experts


def _split_times(fn, x, dout, calls: int) -> dict:
    rows = []
    for i in range(calls + 3):
        x.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        out.backward(dout)
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        if i >= 3:
            rows.append((t1 - t0, t2 - t0, t3 - t2, t4 - t2))
    names = ("forward_host_ms", "forward_total_ms", "backward_host_ms", "backward_total_ms")
    return {name: 1e3 * statistics.median(r[j] for r in rows) for j, name in enumerate(names)}


BUSY_MS = 20.0


def _busy_cycles() -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the device busy about BUSY_MS."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize()
    return int(10_000_000 * BUSY_MS / (1e3 * (time.perf_counter() - t0)))


def _queued_ms(fn, x, dout, calls: int, cycles: int) -> float:
    """Median over calls of (busy, then forward + backward, to the end) less (busy alone)."""
    def run(with_call: bool) -> float:
        x.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(cycles)
        if with_call:
            fn().backward(dout)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    busy = statistics.median(run(False) for _ in range(5))
    return 1e3 * (statistics.median(run(True) for _ in range(calls + 3)) - busy)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="24576,1536,256,128,8")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--module", action="append", default=[], help="another module with expert_parallel_experts")
    args = p.parse_args()
    t, d, n, e, k = (int(v) for v in args.shape.split(","))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(t, d, device=device, generator=g).bfloat16().requires_grad_(True)
    routing = routing_from_topk(torch.randn(t, e, device=device, generator=g).topk(k, dim=1).indices, e)
    scores = torch.rand(t * k, device=device, generator=g)
    w1 = (torch.randn(e, 2 * n, d, device=device, generator=g) * d ** -0.5).bfloat16()
    w2 = (torch.randn(e, d, n, device=device, generator=g) * n ** -0.5).bfloat16()
    dout = torch.randn(t, d, device=device, generator=g).bfloat16()
    cases = [("expert_parallel", expert_parallel_experts)]
    cases += [(name, importlib.import_module(name).expert_parallel_experts) for name in args.module]
    calls = [(name, lambda f=f: f(x, w1, w2, routing, scores, backend="triton")) for name, f in cases]
    calls.append(("experts", lambda: experts(x, w1, w2, routing, scores, backend="triton")))
    cycles = _busy_cycles()
    for name, fn in calls:
        r = _split_times(fn, x, dout, args.calls)
        r["queued_ms"] = _queued_ms(fn, x, dout, args.calls, cycles)
        print(f"{name:24s} " + "  ".join(f"{key} {v:.3f}" for key, v in r.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
