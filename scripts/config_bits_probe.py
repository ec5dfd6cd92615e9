"""Which kernel's bits depend on the tile configuration? (GPU diagnostic for test_gpu_bitwise_across_tile_configs)

usage: python scripts/config_bits_probe.py
Runs each kernel of the layer under its pinned GPU config and under the alternative config that test
uses, on the same bf16 inputs, and prints for each output whether the bits agree (and the max difference).
"""

import torch

import sonicmoe
from sonicmoe.ops import dh, grouped_gemm, up_proj, weight_grad
from sonicmoe.testing import random_problem

M = {"PROGS_PER_SM": 0, "FLATTEN": False}
ALT = {
    "up": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, **M, "W_TMA": False, "num_warps": 4, "num_stages": 3},
    "gemm": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, **M, "W_TMA": True, "num_warps": 8, "num_stages": 4},
    "dh": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "PROGS_PER_SM": 1, "FLATTEN": False, "W_TMA": True,
           "num_warps": 8, "num_stages": 3},
    "dh_64": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "PROGS_PER_SM": 0, "FLATTEN": False, "W_TMA": True,
              "num_warps": 4, "num_stages": 4},
    "dw": {"BLOCK_I": 64, "BLOCK_J": 128, "BLOCK_R": 64, "num_warps": 4, "num_stages": 4},
}


def report(name, a, b):
    same = torch.equal(a, b)
    diff = (a.float() - b.float()).abs().max().item() if not same else 0.0
    print(f"{name:28s} {'same bits' if same else 'DIFFERENT'}  max|diff| {diff:.3e}", flush=True)


def main():
    t, d, n, e, k = 4096, 1024, 256, 64, 8
    p = random_problem(t, d, n, e, device="cuda", seed=5, dtype=torch.bfloat16)
    router = sonicmoe.router_topk(p["x"], p["router_weight"], k)
    routing = sonicmoe.routing_from_topk(router.topk_ids, e)
    s_row = routing.row_scores(router.topk_scores.reshape(-1).detach()).float()
    x, w1, w2 = p["x"], p["w1"], p["w2"]
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    g = dict(up=up_proj._GPU_DEFAULT, gemm=grouped_gemm._GPU_DEFAULT, dh=dh._GPU_DEFAULT, dw=weight_grad._GPU_DEFAULT)
    h0, a0 = up_proj.up_proj(x, w1, None, routing, config=g["up"])
    h1, a1 = up_proj.up_proj(x, w1, None, routing, config=ALT["up"])
    report("up_proj H", h0, h1)
    report("up_proj A", a0, a1)
    report("down_proj Y", grouped_gemm.down_proj(a0, w2, None, routing, config=g["gemm"]),
           grouped_gemm.down_proj(a0, w2, None, routing, config=ALT["gemm"]))
    r0 = dh.dh(dout, w2, h0, s_row, routing, config=g["dh"])
    for alt in ("dh", "dh_64"):
        r1 = dh.dh(dout, w2, h0, s_row, routing, config=ALT[alt])
        for name, a, b in zip(("dH", "A'", "dS"), r0, r1):
            report(f"{alt} {name}", a, b)
    dh_, ap_, _ = r0
    report("dX~", grouped_gemm.varlen_m_gemm(dh_, w1, None, routing, transpose_b=False, config=g["gemm"]),
           grouped_gemm.varlen_m_gemm(dh_, w1, None, routing, transpose_b=False, config=ALT["gemm"]))
    for name, args in (("dW2", (dout, ap_, True, False, w2.dtype)), ("dW1", (dh_, x, False, True, w1.dtype))):
        pp, qq, pg, qg, dt = args
        report(name, weight_grad.varlen_k_gemm(pp, qq, routing, p_gather=pg, q_gather=qg, out_dtype=dt,
                                               config=g["dw"]),
               weight_grad.varlen_k_gemm(pp, qq, routing, p_gather=pg, q_gather=qg, out_dtype=dt,
                                         config=ALT["dw"]))


if __name__ == "__main__":
    main()
