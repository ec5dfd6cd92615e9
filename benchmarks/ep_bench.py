"""Expert parallelism's speed: forward+backward of the experts split over P ranks against all E on every rank.

usage: torchrun --nproc-per-node P benchmarks/ep_bench.py [--shape T,d,n,E,K ...] [--out FILE.json]
       (or plain ``python benchmarks/ep_bench.py`` for P = 1: the dispatch, exchange and combine's own cost)

Each rank routes its own T tokens (T of the shape is per rank) with a random top-k over E experts, then times
``expert_parallel_experts`` (its E/P experts, the tokens exchanged by all-to-all; NCCL, one GPU per rank) and
``sonicmoe.experts`` with all E experts on the rank (data parallelism's layer), bf16, forward + backward. The same
number of calls on every rank (collectives must match, so no adaptive repeat count): WARMUP calls, then CALLS timed
ones, each between CUDA events; medians. TFLOP/s per rank from the useful FLOPs 18·T·K·n·d (SPEC §6).
Rank 0 prints a table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from sonicmoe import experts, routing_from_topk
from sonicmoe.expert_parallel import expert_parallel_experts

DEFAULT_SHAPES = ["24576,1536,256,128,8", "32768,4096,1024,128,8"]


def _time_ms(fn, calls: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _profile_table(fn, rows: int) -> str:
    """torch.profiler over three calls of fn: the ``rows`` ops with the most GPU time of their own, then the ``rows``
    with the most host time of their own."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    ops = prof.key_averages()
    return "\n".join(ops.table(sort_by=key, row_limit=rows) for key in ("self_cuda_time_total", "self_cpu_time_total"))


def _case(shape, world: int, rank: int, device, calls: int, warmup: int, profile_rows: int = 0) -> dict:
    t, d, n, e, k = shape
    g = torch.Generator(device=device).manual_seed(1 + rank)
    e_loc = e // world
    x = torch.randn(t, d, device=device, generator=g).bfloat16().requires_grad_(True)
    ids = torch.randn(t, e, device=device, generator=g).topk(k, dim=1).indices
    scores = torch.rand(t * k, device=device, generator=g).requires_grad_(True)
    w1 = (torch.randn(e, 2 * n, d, device=device, generator=g) * d ** -0.5).bfloat16().requires_grad_(True)
    w2 = (torch.randn(e, d, n, device=device, generator=g) * n ** -0.5).bfloat16().requires_grad_(True)
    w1_loc = w1.detach()[rank * e_loc:(rank + 1) * e_loc].clone().requires_grad_(True)
    w2_loc = w2.detach()[rank * e_loc:(rank + 1) * e_loc].clone().requires_grad_(True)
    dout = torch.randn(t, d, device=device, generator=g).bfloat16()
    routing = routing_from_topk(ids, e)

    def ep():
        for leaf in (x, scores, w1_loc, w2_loc):
            leaf.grad = None
        expert_parallel_experts(x, w1_loc, w2_loc, routing, scores, backend="triton").backward(dout)

    def local():
        for leaf in (x, scores, w1, w2):
            leaf.grad = None
        experts(x, w1, w2, routing, scores, backend="triton").backward(dout)

    flops = 18 * t * k * n * d
    out = {"shape": list(shape), "ranks": world}
    for name, fn in (("expert_parallel", ep), ("all_experts_local", local)):
        ms = _time_ms(fn, calls, warmup)
        out[name] = {"ms": ms, "tflops_per_rank": flops / ms / 1e9}
    out["expert_parallel_over_local"] = out["expert_parallel"]["ms"] / out["all_experts_local"]["ms"]
    if profile_rows:
        out["profiles"] = {name: _profile_table(fn, profile_rows) for name, fn in (("expert_parallel", ep),
                                                                                  ("all_experts_local", local))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", help="T,d,n,E,K with T per rank (repeatable)")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="also profile three calls of each (torch.profiler): the ROWS ops with the most GPU time, "
                        "printed by rank 0")
    args = p.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    rows = [_case(tuple(int(v) for v in s.split(",")), world, rank, device, args.calls, args.warmup, args.profile)
            for s in (args.shape or DEFAULT_SHAPES)]
    if rank == 0:
        result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "ranks": world,
                  "calls": args.calls, "warmup": args.warmup, "cases": rows}
        for r in rows:
            for name, table in r.get("profiles", {}).items():
                print(f"== {tuple(r['shape'])} {name}: three calls\n{table}")
        for r in rows:
            print(f"{tuple(r['shape'])} P={world}: expert-parallel {r['expert_parallel']['ms']:.3f} ms "
                  f"({r['expert_parallel']['tflops_per_rank']:.0f} TFLOP/s per rank), all experts local "
                  f"{r['all_experts_local']['ms']:.3f} ms ({r['all_experts_local']['tflops_per_rank']:.0f}); "
                  f"ratio {r['expert_parallel_over_local']:.3f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
