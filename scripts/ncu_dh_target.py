"""Nsight Compute target: the Gluon dH kernel (``dh_ws``, its default config) at the 7B shape, three launches.

usage (GPU): PYTHONPATH=$PWD ncu -k regex:_dh_ws_kernel -s 2 -c 1 --set full --import-source yes -o OUT/dh \\
                 python scripts/ncu_dh_target.py
then ``ncu -i OUT/dh.ncu-rep --page details`` and ``--page source --csv --print-source cuda,sass`` (per-line warp stall
samples; session 40's summary by source line is in benchmarks/results/2026-11-27_nvidia-h100-h200_session40/call4_*).
"""

import torch

import sonicmoe
from sonicmoe.ops import dh_ws
from sonicmoe.testing import random_problem

t, d, n, e, k = 24576, 1536, 256, 128, 8
p = random_problem(t, d, n, e, device="cuda", dtype=torch.bfloat16, seed=0)
router = sonicmoe.router_topk(p["x"], p["router_weight"], k)
routing = sonicmoe.routing_from_topk(router.topk_ids, e)
r = routing.num_rows
g = torch.Generator(device="cuda").manual_seed(1)
dout = torch.randn(t, d, device="cuda", generator=g).to(torch.bfloat16)
h = torch.randn(r, 2 * n, device="cuda", generator=g).to(torch.bfloat16)
s = torch.rand(r, device="cuda", generator=g)
for _ in range(3):
    dh_ws.dh_ws(dout, p["w2"], h, s, routing)
torch.cuda.synchronize()
