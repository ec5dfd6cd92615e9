"""Nsight Compute target: one expert kernel at the 7B shape (24576, 1536, 256, 128, 8) or ``--shape``, three launches.

usage (GPU): SONICMOE_AUTOTUNE=0 PYTHONPATH=$PWD ncu -k regex:KERNEL -s 2 -c 1 --set full --import-source yes \\
                 -o OUT/rep python scripts/ncu_target.py --op dh|up [--shape T,d,n,E,K] [--routing token_rounding]
  --op dh: the Gluon dH kernel (``dh_ws``, its default config; KERNEL ``_dh_ws_kernel``)
  --op up: the up-projection as the layer runs it (``up_proj``; KERNEL ``_up_proj_kernel`` with the pinned config,
           SONICMOE_AUTOTUNE=0, so that no tuning launch is profiled, or ``_up_ws_kernel`` where the layer runs the
           Gluon kernel: d = 4096, and d <= 2048 on H200s)
  --routing token_rounding: the problem's router scores routed by token rounding (M_tile 128) instead of top-k
           (session 46: at (16384, 1536, 256, 512, 8) the H200's Gluon up-projection is faster than Triton's under
           top-k and slower under token rounding)
then ``ncu -i OUT/rep.ncu-rep --page details`` and ``--page source --csv --print-source cuda,sass`` (warp stall samples
per source line). Session 40's profiles are in benchmarks/results/2026-11-27_nvidia-h100-h200_session40/.
"""

import argparse

import torch
from dh_ws_probe import dh_problem

from sonicmoe.ops import dh_ws
from sonicmoe.ops.up_proj import up_proj

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--op", choices=("dh", "up"), default="dh")
ap.add_argument("--shape", default="24576,1536,256,128,8", help="T,d,n,E,K")
ap.add_argument("--routing", choices=("topk", "token_rounding"), default="topk")
args = ap.parse_args()
p, routing, dout, h, s = dh_problem(args.shape, args.routing)
for _ in range(3):
    if args.op == "dh":
        dh_ws.dh_ws(dout, p["w2"], h, s, routing)
    else:
        up_proj(p["x"], p["w1"], None, routing)
torch.cuda.synchronize()
