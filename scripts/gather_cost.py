"""What the row gather costs the weight-gradient (varlen-K) GEMMs and the dH kernel, GPU only.

usage: python scripts/gather_cost.py [--shape T,d,n,E,K ...] [--kernels up,dH,dW1,dW2] [--json OUT]

For dW1 = dHᵀ X[tok] and dW2 = dO[tok]ᵀ A′, each on the same routing: the kernel as the layer runs it (gathered
operand, pointer loads) and the same kernel on a pre-gathered, contiguous copy of that operand (both operands
through TMA descriptors), over a few tile configs each, against ``torch.bmm`` over E balanced experts (the
cuBLAS ceiling). Every config's output is checked bitwise against the first config's of its kind.

The dH kernel (dA′ = dO[tok] W2[e] and its epilogue) the same way: as the layer runs it, and on dO[tok] made
contiguous beforehand with the identity as row tokens (the rows then come in order; the same bits). The
up-projection (``up``: H = X[tok] W1[e]ᵀ with the SwiGLU epilogue) likewise, on X[tok] made contiguous.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from triton.testing import do_bench

import sonicmoe
from sonicmoe.ops.dh import dh
from sonicmoe.ops.up_proj import up_proj
from sonicmoe.ops.weight_grad import varlen_k_gemm
from sonicmoe.testing import random_problem

CONFIGS = [  # BLOCK_I, BLOCK_J, BLOCK_R, warps, stages
    (256, 128, 64, 8, 5), (128, 256, 64, 8, 5), (256, 128, 64, 8, 4), (128, 256, 64, 8, 4),
    (128, 256, 64, 8, 7), (256, 128, 32, 8, 8), (128, 256, 32, 8, 8), (128, 128, 64, 8, 6),
]


def config(c) -> dict:
    i, j, r, w, s = c
    return {"BLOCK_I": i, "BLOCK_J": j, "BLOCK_R": r, "P_TMA": True, "Q_TMA": True, "num_warps": w, "num_stages": s}


KERNELS = ("up", "dH", "dW1", "dW2")


def time_shape(t: int, d: int, n: int, e: int, k: int, kernels=KERNELS) -> list[dict]:
    """The rows of one shape (printed as they come)."""
    p = random_problem(t, d, n, e, dtype=torch.bfloat16, device="cuda", seed=0)
    x, w1, w2 = p["x"], p["w1"], p["w2"]
    router = sonicmoe.router_topk(x, p["router_weight"], k)
    routing = sonicmoe.routing_from_topk(router.topk_ids, e)
    s_row = routing.row_scores(router.topk_scores.reshape(-1).detach()).float()
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    h, _ = up_proj(x, w1, None, routing)
    dh_, ap_, _ = dh(dout, w2, h, s_row, routing)
    tok = routing.row_token.long()
    xg, dog = x[tok].contiguous(), dout[tok].contiguous()
    r = routing.num_rows
    m = r // e
    gemm = 2 * r * n * d
    flops = {"dW1": 2 * gemm, "dW2": gemm}
    a1, b1 = dh_[: m * e].view(e, m, 2 * n).transpose(1, 2).contiguous(), xg[: m * e].view(e, m, d)
    a2, b2 = dog[: m * e].view(e, m, d).transpose(1, 2).contiguous(), ap_[: m * e].view(e, m, n)
    bmm = {"dW1": lambda: torch.bmm(a1, b1), "dW2": lambda: torch.bmm(a2, b2)}

    def wgrad(kern: str, gathered: bool, cfg):
        if kern == "dW1":
            return varlen_k_gemm(dh_, x if gathered else xg, routing, p_gather=False, q_gather=gathered,
                                 out_dtype=w1.dtype, config=cfg)
        return varlen_k_gemm(dout if gathered else dog, ap_, routing, p_gather=gathered, q_gather=False,
                             out_dtype=w2.dtype, config=cfg)

    rows = []
    shape = [t, d, n, e, k]
    print(f"shape T={t} d={d} n={n} E={e} K={k} R={r} on {torch.cuda.get_device_name()}")
    in_order = dataclasses.replace(routing, row_token=torch.arange(r, device="cuda", dtype=routing.row_token.dtype))
    # "same bits": against a first run on the gathered rows (also run-to-run determinism)
    row_kernels = {"up": (2 * gemm, lambda: up_proj(x, w1, None, routing), lambda: up_proj(xg, w1, None, in_order)),
                   "dH": (gemm, lambda: dh(dout, w2, h, s_row, routing), lambda: dh(dog, w2, h, s_row, in_order))}
    for kern, (fl, gathered_fn, contiguous_fn) in row_kernels.items():
        if kern not in kernels:
            continue
        ref = gathered_fn()
        for kind, fn in (("gathered", gathered_fn), ("pre-gathered", contiguous_fn)):
            same = all(torch.equal(a, b) for a, b in zip(fn(), ref))
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            print(f"  {kern:<4} {kind:<12} {'pinned/autotuned':<26} {ms:7.3f} ms {fl / ms / 1e9:6.1f} TFLOP/s"
                  f"  same bits {same}")
            rows.append({"shape": shape, "kernel": kern, "kind": kind, "config": "pinned/autotuned", "ms": ms,
                         "bitwise_equal_first": same})
    for kern, fn in bmm.items():
        if kern not in kernels:
            continue
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        print(f"  {kern:<4} cuBLAS bmm (balanced)        {ms:7.3f} ms {flops[kern] / ms / 1e9:6.1f} TFLOP/s")
        rows.append({"shape": shape, "kernel": kern, "kind": "bmm", "ms": ms})
    for kern in [kn for kn in ("dW1", "dW2") if kn in kernels]:
        for gathered in (True, False):
            kind = "gathered" if gathered else "pre-gathered"
            first = None
            for name, cfg in [("pinned/autotuned", None)] + [(str(c), config(c)) for c in CONFIGS]:
                try:
                    res = wgrad(kern, gathered, cfg)
                    torch.cuda.synchronize()
                except Exception as exc:  # a config that does not fit (shared memory) is reported and skipped
                    print(f"  {kern:<4} {kind:<12} {name:<26} failed: {type(exc).__name__}")
                    continue
                same = first is None or torch.equal(res, first)
                first = res if first is None else first
                ms = do_bench(lambda cfg=cfg, kern=kern, gathered=gathered: wgrad(kern, gathered, cfg), warmup=25,
                              rep=100, return_mode="median")
                print(f"  {kern:<4} {kind:<12} {name:<26} {ms:7.3f} ms {flops[kern] / ms / 1e9:6.1f} TFLOP/s"
                      f"{'' if same else '  (other bits: other reduction order)'}")
                rows.append({"shape": shape, "kernel": kern, "kind": kind, "config": name, "ms": ms,
                             "bitwise_equal_first": same})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None, help="T,d,n,E,K (default: 7B and 120B-n1024)")
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated subset of " + ", ".join(KERNELS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kernels = tuple(args.kernels.split(","))
    if not set(kernels) <= set(KERNELS):
        ap.error(f"--kernels: expected a subset of {','.join(KERNELS)}, got {args.kernels}")
    shapes = [tuple(int(v) for v in s.split(",")) for s in
              (args.shape or ["24576,1536,256,128,8", "32768,4096,1024,128,8"])]
    out = []
    for shape in shapes:
        out += time_shape(*shape, kernels=kernels)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
