"""Nsight Compute target: one expert kernel at the 7B shape (24576, 1536, 256, 128, 8), three launches.

usage (GPU): SONICMOE_AUTOTUNE=0 PYTHONPATH=$PWD ncu -k regex:KERNEL -s 2 -c 1 --set full --import-source yes \\
                 -o OUT/rep python scripts/ncu_target.py --op dh|up
  --op dh: the Gluon dH kernel (``dh_ws``, its default config; KERNEL ``_dh_ws_kernel``)
  --op up: the up-projection as the layer runs it (``up_proj``; KERNEL ``_up_proj_kernel`` with the pinned config,
           SONICMOE_AUTOTUNE=0, so that no tuning launch is profiled)
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
args = ap.parse_args()
p, routing, dout, h, s = dh_problem("24576,1536,256,128,8")
for _ in range(3):
    if args.op == "dh":
        dh_ws.dh_ws(dout, p["w2"], h, s, routing)
    else:
        up_proj(p["x"], p["w1"], None, routing)
torch.cuda.synchronize()
