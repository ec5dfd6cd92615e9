"""Does a layer timing depend on what the GPU did just before it? One process, one 7B-shaped problem, the
forward+backward timed by do_bench (median) after different histories: right after the autotuning call, back to
back, after the GPU sat idle, and over a long window. Each line carries a wall-clock timestamp, to be read
beside a fast `nvidia-smi -lms 50` log of the SM clock and power (the power cap lowers the clock with some delay).

usage: python scripts/power_probe.py [--shape T,d,n,E,K] [--idle 2.0] [--json F]
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch
from triton.testing import do_bench

import sonicmoe
from sonicmoe.testing import random_problem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="24576,1536,256,128,8")
    ap.add_argument("--idle", type=float, default=2.0, help="seconds the GPU sits idle before an 'after idle' timing")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t, d, n, e, k = (int(v) for v in args.shape.split(","))
    p = random_problem(t, d, n, e, device="cuda", dtype=torch.bfloat16, seed=0)
    router = sonicmoe.router_topk(p["x"], p["router_weight"], k)
    routing = sonicmoe.routing_from_topk(router.topk_ids, e)
    s_pair = router.topk_scores.reshape(-1).to(torch.bfloat16)
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    leaves = [v.detach().requires_grad_(True) for v in (p["x"], p["w1"], p["w2"], s_pair)]
    flops = 18 * routing.num_rows * n * d

    def fwdbwd() -> None:
        sonicmoe.experts(leaves[0], leaves[1], leaves[2], routing, leaves[3], backend="triton").backward(dout)

    rows = []

    def timed(label: str, rep: float = 100) -> None:
        start = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
        ms = do_bench(fwdbwd, warmup=25, rep=rep, return_mode="median", grad_to_none=leaves)
        end = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
        rows.append({"label": label, "rep_ms": rep, "start": start, "end": end, "ms": ms,
                     "tflops": flops / ms / 1e9})
        print(f"{start}-{end}  {label:<28} rep {rep:>6.0f} ms  {ms:.3f} ms  {flops / ms / 1e9:.1f} TFLOP/s",
              flush=True)

    fwdbwd()  # autotuning
    torch.cuda.synchronize()
    timed("right after autotuning")
    for i in range(3):
        timed(f"back to back {i + 1}")
    for i in range(3):
        time.sleep(args.idle)
        timed(f"after {args.idle:g} s idle {i + 1}")
        timed(f"  then back to back {i + 1}")
    time.sleep(args.idle)
    timed("after idle, short window", rep=20)
    timed("long window (sustained)", rep=3000)
    time.sleep(args.idle)
    timed("after idle, long window", rep=3000)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": [t, d, n, e, k], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
