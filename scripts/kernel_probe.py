"""Run each 7B-shape kernel a few times (for ncu: profile one launch of a named kernel).

usage: ncu --clock-control none -k regex:_dh_kernel -c 1 --section SpeedOfLight python scripts/kernel_probe.py
       [--gluon-dh]   (also the Gluon dH kernel, sonicmoe.ops.dh_ws, with its default config: -k regex:_dh_ws)
"""
import argparse

import torch

import sonicmoe
from sonicmoe.ops import dh, dh_ws, grouped_gemm, up_proj
from sonicmoe.testing import random_problem

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--gluon-dh", action="store_true", help="also run the Gluon dH kernel (sonicmoe.ops.dh_ws)")
args = ap.parse_args()
t, d, n, e, k = 24576, 1536, 256, 128, 8
p = random_problem(t, d, n, e, dtype=torch.bfloat16, device="cuda", seed=0)
router = sonicmoe.router_topk(p["x"], p["router_weight"], k)
routing = sonicmoe.routing_from_topk(router.topk_ids, e)
s_row = routing.row_scores(router.topk_scores.reshape(-1).detach()).float()
dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    h, a = up_proj.up_proj(p["x"], p["w1"], None, routing)
    y = grouped_gemm.down_proj(a, p["w2"], None, routing)
    dh.dh(dout, p["w2"], h, s_row, routing)
    if args.gluon_dh:
        dh_ws.dh_ws(dout, p["w2"], h, s_row, routing)
torch.cuda.synchronize()
print("done")
