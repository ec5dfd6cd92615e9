"""Kernel-level A/B of a switch read at launch (``--env``, e.g. SONICMOE_EVICT): the Triton up-projection and dH
kernels alone, each with its pinned GPU config, at each value in alternating rounds on the same inputs; every
value's outputs are checked bit for bit against the first value's.

usage: python scripts/kernel_env_ab.py --env NAME [--shape T,d,n,E,K ...] [--up-values 0,1] [--dh-values 0,1]
       [--rounds 5] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from triton.testing import do_bench

import sonicmoe
from sonicmoe.ops import dh, up_proj
from sonicmoe.testing import random_problem

SHAPES = ["24576,1536,256,128,8", "32768,4096,1024,128,8"]


def run_shape(env: str, shape: tuple[int, ...], up_masks: list[str], dh_masks: list[str], rounds: int) -> dict:
    t, d, n, e, k = shape
    p = random_problem(t, d, n, e, dtype=torch.bfloat16, device="cuda", seed=0)
    router = sonicmoe.router_topk(p["x"], p["router_weight"], k)
    routing = sonicmoe.routing_from_topk(router.topk_ids, e)
    s_row = routing.row_scores(router.topk_scores.reshape(-1).detach()).float()
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    r = routing.num_rows
    up_cfg = up_proj.pinned_gpu_config(r, e, d)
    dh_cfg = dict(dh._GPU_DEFAULT)
    h, _ = up_proj.up_proj(p["x"], p["w1"], None, routing, config=dict(up_cfg))
    kernels = {
        "up_proj": (up_masks, lambda: up_proj.up_proj(p["x"], p["w1"], None, routing, config=dict(up_cfg))),
        "dh": (dh_masks, lambda: dh.dh(dout, p["w2"], h, s_row, routing, config=dict(dh_cfg))),
    }
    out = {"shape": list(shape), "up_config": up_cfg, "dh_config": dh_cfg, "kernels": {}}
    for name, (masks, fn) in kernels.items():
        ref = None
        times = {m: [] for m in masks}
        same = {}
        for m in masks:
            os.environ[env] = m
            res = fn()
            torch.cuda.synchronize()
            if ref is None:
                ref = res
            else:
                same[m] = all(torch.equal(a, b) for a, b in zip(ref, res) if a is not None)
        for _ in range(rounds):
            for m in masks:
                os.environ[env] = m
                times[m].append(do_bench(fn, warmup=25, rep=100))
        os.environ.pop(env, None)
        med = {m: statistics.median(v) for m, v in times.items()}
        out["kernels"][name] = {"ms": {str(m): v for m, v in times.items()},
                                "median_ms": {str(m): v for m, v in med.items()},
                                "bitwise_equal_to_first": {str(m): v for m, v in same.items()}}
        for m in masks:
            print(f"{shape} {name:8s} {env}={m}: median {med[m]:.4f} ms "
                  f"({med[m] / med[masks[0]]:.3f}x of {masks[0]}), rounds "
                  f"{' '.join(f'{x:.4f}' for x in times[m])}"
                  + (f", bitwise equal: {same[m]}" if m in same else ""), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None, help="T,d,n,E,K (repeatable)")
    ap.add_argument("--env", required=True, help="the environment variable the launchers read")
    ap.add_argument("--up-values", default="0,1")
    ap.add_argument("--dh-values", default="0,1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    up_masks = args.up_values.split(",")
    dh_masks = args.dh_values.split(",")
    results = [run_shape(args.env, tuple(int(v) for v in s.split(",")), up_masks, dh_masks, args.rounds)
               for s in (args.shape or SHAPES)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "commit": os.environ.get("SONICMOE_GIT_COMMIT", "unknown"), "env": args.env,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
