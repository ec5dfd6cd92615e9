"""GPU diagnostic: the varlen-M tile-table kernel's own time (torch profiler, mean over --calls launches) for one and
two tile heights, over the kernel's BLOCK_T and num_warps, on a top-k routing of --shape; every variant's tables
are checked against the default's.

usage (GPU): PYTHONPATH=$PWD python scripts/tile_table_probe.py [--shape T,d,n,E,K] [--calls 50]
"""

from __future__ import annotations

import argparse

import torch

import sonicmoe
from sonicmoe.ops import grouped_gemm_ws as ws


def kernel_us(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events() if "tile_table" in e.name]
    return sum(times) / max(len(times), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="24576,1536,256,128,8")
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    t, _, _, e, k = (int(v) for v in args.shape.split(","))
    ids = torch.rand(t, e, device="cuda").argsort(1)[:, :k]
    routing = sonicmoe.routing_from_topk(ids, e)
    off, r = routing.expert_offsets, routing.num_rows
    print(f"shape {args.shape} R={r} on {torch.cuda.get_device_name()}")
    for heights in ((128,), (64, 128)):
        ref = ws.tile_tables(off, r, heights)
        for block_t in (16, 32, 64, 128):
            for warps in (1, 2, 4, 8):
                cfg = {"BLOCK_T": block_t, "num_warps": warps}
                got = ws.tile_tables(off, r, heights, cfg)
                same = all(torch.equal(a, b) for a, b in zip(got, ref))
                us = kernel_us(lambda c=cfg, hs=heights: ws.tile_tables(off, r, hs, c), args.calls)
                print(f"  heights {heights!s:<10} BLOCK_T {block_t:>3} warps {warps}: {us:6.2f} us  same {same}",
                      flush=True)


if __name__ == "__main__":
    main()
