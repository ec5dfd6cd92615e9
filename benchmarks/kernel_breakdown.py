"""Per-kernel timing of the Triton path on one shape (the paper's Fig. 6 breakdown), GPU only.

usage: python benchmarks/kernel_breakdown.py [--shape T,d,n,E,K] [--json OUT.json]
Prints ms and TFLOP/s (useful FLOPs) of each forward and backward kernel, of the whole layer, and of
the torch backend on the same inputs.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

import sonicmoe
from sonicmoe.ops.aggregation import gather_sum
from sonicmoe.ops.dh import dh
from sonicmoe.ops.grouped_gemm import down_proj, varlen_m_gemm
from sonicmoe.ops.up_proj import up_proj
from sonicmoe.ops.weight_grad import varlen_k_gemm
from sonicmoe.testing import random_problem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="24576,1536,256,128,8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t, d, n, e, k = (int(v) for v in args.shape.split(","))
    p = random_problem(t, d, n, e, dtype=torch.bfloat16, device="cuda", seed=0)
    router = sonicmoe.router_topk(p["x"], p["router_weight"], k)
    routing = sonicmoe.routing_from_topk(router.topk_ids, e)
    s_pair = router.topk_scores.reshape(-1).detach()
    s_row = routing.row_scores(s_pair).float()
    s_slot = routing.slot_scores(s_pair).float()
    r = routing.num_rows
    x, w1, w2 = p["x"], p["w1"], p["w2"]
    h, a = up_proj(x, w1, None, routing)
    y = down_proj(a, w2, None, routing)
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    dh_, ap_, _ = dh(dout, w2, h, s_row, routing)
    dxt = varlen_m_gemm(dh_, w1, None, routing, transpose_b=False)
    gemm = 2 * r * n * d  # FLOPs of one (R, n) x (n, d) GEMM
    rows = [
        ("up-proj (gather+SwiGLU)", lambda: up_proj(x, w1, None, routing), 2 * gemm),
        ("down-proj", lambda: down_proj(a, w2, None, routing), gemm),
        ("aggregation", lambda: gather_sum(y, routing, s_slot), 0),
        ("dH (dA', dS, dH, A')", lambda: dh(dout, w2, h, s_row, routing), gemm),
        ("dW2 (varlen-K)", lambda: varlen_k_gemm(dout, ap_, routing, p_gather=True, q_gather=False,
                                                 out_dtype=w2.dtype), gemm),
        ("dX~ = dH W1", lambda: varlen_m_gemm(dh_, w1, None, routing, transpose_b=False), 2 * gemm),
        ("dW1 (varlen-K)", lambda: varlen_k_gemm(dh_, x, routing, p_gather=False, q_gather=True,
                                                 out_dtype=w1.dtype), 2 * gemm),
        ("dX aggregation", lambda: gather_sum(dxt, routing, None), 0),
    ]
    results = []
    for name, fn, flops in rows:
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        results.append({"kernel": name, "ms": ms, "tflops": flops / ms / 1e9 if flops else None})

    def layer(backend, bwd):
        xs = x.detach().requires_grad_(bwd)
        w1s = w1.detach().requires_grad_(bwd)
        w2s = w2.detach().requires_grad_(bwd)
        ss = s_pair.detach().requires_grad_(bwd)

        def f():
            out = sonicmoe.experts(xs, w1s, w2s, routing, ss, backend=backend)
            if bwd:
                out.backward(dout)
        return f, [xs, w1s, w2s, ss]

    for backend in ("triton", "torch"):
        for bwd in (False, True):
            fn, params = layer(backend, bwd)
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median", grad_to_none=params if bwd else None)
            flops = (18 if bwd else 6) * r * n * d
            results.append({"kernel": f"layer {backend} {'fwd+bwd' if bwd else 'fwd'}", "ms": ms,
                            "tflops": flops / ms / 1e9})
    print(f"shape T={t} d={d} n={n} E={e} K={k} on {torch.cuda.get_device_name()}")
    for row in results:
        tf = f"{row['tflops']:7.1f}" if row["tflops"] else "      -"
        print(f"  {row['kernel']:<28} {row['ms']:8.3f} ms  {tf} TFLOP/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [t, d, n, e, k], "device": torch.cuda.get_device_name(), "rows": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
