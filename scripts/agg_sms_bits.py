"""Bits of the layer's gradients with the dX aggregation on multiprocessors of its own (SONICMOE_AGG_SMS=k) against
the default (0), at one shape: every gradient must be bitwise equal.

usage: python scripts/agg_sms_bits.py [--shape T,d,n,E,K] [--sms 16]
"""

from __future__ import annotations

import argparse
import os

import torch

import sonicmoe
from sonicmoe.testing import random_problem


def grads(p: dict, routing, s_pair: torch.Tensor, dout: torch.Tensor) -> list[torch.Tensor]:
    leaves = [v.detach().requires_grad_(True) for v in (p["x"], p["w1"], p["w2"], s_pair)]
    sonicmoe.experts(leaves[0], leaves[1], leaves[2], routing, leaves[3], backend="triton").backward(dout)
    return [v.grad.clone() for v in leaves]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="24576,1536,256,128,8")
    ap.add_argument("--sms", default="16")
    args = ap.parse_args()
    t, d, n, e, k = (int(v) for v in args.shape.split(","))
    p = random_problem(t, d, n, e, device="cuda", dtype=torch.bfloat16, seed=0)
    router = sonicmoe.router_topk(p["x"], p["router_weight"], k)
    routing = sonicmoe.routing_from_topk(router.topk_ids, e)
    s_pair = router.topk_scores.reshape(-1).to(torch.bfloat16)
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    os.environ["SONICMOE_AGG_SMS"] = "0"
    base = grads(p, routing, s_pair, dout)
    os.environ["SONICMOE_AGG_SMS"] = args.sms
    other = grads(p, routing, s_pair, dout)
    for name, a, b in zip(("dX", "dW1", "dW2", "dS"), base, other):
        print(f"{args.shape} SONICMOE_AGG_SMS={args.sms} {name}: {'equal' if torch.equal(a, b) else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
