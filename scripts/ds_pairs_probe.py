"""The Gluon dH kernel writing dS itself in pair order (``ds_pairs``) against its partials summed by ``score_grad``.

usage (GPU): python scripts/ds_pairs_probe.py [--shape T,d,n,E,K] [--rounds 7] [--out FILE.json]

Times, on one top-k routing with bf16 operands and scores in pair order (the layer's backward), in alternating
rounds of ``do_bench`` medians (ms): the kernel alone with its partials (``partials``), the kernel then
``score_grad`` on one stream (``partials+sum``), and the kernel with ``ds_pairs`` (``in_kernel``). Checks first that
dS, dH and A′ have the same bits both ways (``in_kernel`` only where a tile spans all n channels).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from triton.testing import do_bench

from sonicmoe.ops import dh_ws
from sonicmoe.ops.score_grad import score_grad
from sonicmoe.testing import random_topk_routing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="24576,1536,256,128,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=float, default=200.0, help="do_bench warm-up, ms")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t, d, n, e, k = (int(v) for v in args.shape.split(","))
    routing = random_topk_routing(t, e, k, seed=0, device="cuda")
    r = routing.num_rows
    g = torch.Generator(device="cuda").manual_seed(0)
    dout = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    w2 = (torch.randn(e, d, n, device="cuda", generator=g) / d ** 0.5).bfloat16()
    h = torch.randn(r, 2 * n, device="cuda", generator=g).bfloat16()
    scores = torch.rand(r, device="cuda", generator=g).bfloat16()

    def partials():
        return dh_ws.dh_ws(dout, w2, h, scores, routing, pair_order=True)

    def summed():
        dh_, ap_, part = partials()
        return dh_, ap_, score_grad(part, routing.row_pair, routing.expert_offsets, None, scores.dtype)

    def in_kernel():
        return dh_ws.dh_ws(dout, w2, h, scores, routing, pair_order=True, ds_pairs=scores.dtype)

    fns = {"partials": partials, "partials+sum": summed}
    same = None
    if dh_ws.ds_pairs_in_kernel(n):
        a, b = summed(), in_kernel()
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        print(f"shape {args.shape}: dS, dH and A' bitwise equal both ways: {same}")
        fns["in_kernel"] = in_kernel
    times = {name: [] for name in fns}
    for i in range(args.rounds):
        for name in (list(fns) if i % 2 == 0 else list(reversed(fns))):
            times[name].append(do_bench(fns[name], warmup=args.warmup, rep=100, return_mode="median"))
    for name, v in times.items():
        print(f"{name:13s} median {statistics.median(v):.4f} ms  rounds {' '.join(f'{x:.4f}' for x in v)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": args.shape, "bitwise_equal": same,
                       "ms": times}, f, indent=1)


if __name__ == "__main__":
    main()
