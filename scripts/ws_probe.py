"""Probe: Hopper warp specialization (producer warps issue the TMA loads) for the varlen-M GEMMs (GPU).

usage: python scripts/ws_probe.py [--shape T,d,n,E,K ...] [--json OUT.json]

Triton 3.6's Hopper warp-specialization pass only compiles loops whose operands all come through tensor
descriptors and whose enclosing tile loop has no in-register reductions: the varlen-M tile schedule of
:func:`sonicmoe.ops.kernel_lib.tile_rows` (a scan over the experts per tile) makes the pass fail. Here the
tile -> (expert, first row, end row) table is computed beforehand on the GPU (torch ops, no sync) and
the kernel reads three scalars per tile. Times the down-projection (Y = A W2[e]ᵀ) and the dX̃ GEMM
(dX̃ = dH W1[e]) against the library's autotuned kernel on the same inputs, and checks the outputs equal.
Also times dH tiles of 128 x 128 with a register cap (two programs per multiprocessor).
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

import sonicmoe
from sonicmoe.ops import dh, grouped_gemm
from sonicmoe.testing import random_problem


@triton.jit
def _ws_kernel(a_desc, b_desc, c_ptr, table_ptr, total_ptr, MAXT, N, K, stride_cr,
               B_TRANS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               WS_OUTER: tl.constexpr):
    total_m = tl.load(total_ptr)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), total_m * num_n, tl.num_programs(0), warp_specialize=WS_OUTER):
        pm = tile // num_n
        pn = tile % num_n
        e = tl.load(table_ptr + pm)
        rs = tl.load(table_ptr + MAXT + pm)
        re = tl.load(table_ptr + 2 * MAXT + pm)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, tl.cdiv(K, BLOCK_K), warp_specialize=not WS_OUTER):
            a = a_desc.load([rs, k * BLOCK_K])
            if B_TRANS:
                b = tl.reshape(b_desc.load([e, pn * BLOCK_N, k * BLOCK_K]), (BLOCK_N, BLOCK_K)).T
            else:
                b = tl.reshape(b_desc.load([e, k * BLOCK_K, pn * BLOCK_N]), (BLOCK_K, BLOCK_N))
            acc = tl.dot(a, b, acc)
        rows = rs + tl.arange(0, BLOCK_M)
        cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cr + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rows < re)[:, None] & (cols < N)[None, :])


def _ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def tile_table(offsets: torch.Tensor, num_rows: int, block_m: int):
    """(3, MAXT) int32 table of (expert, first row, end row) per M-tile and the (1,) tile count, on the GPU."""
    e = offsets.numel() - 1
    maxt = triton.cdiv(num_rows, block_m) + e
    off = offsets.long()
    nt = (off[1:] - off[:-1] + block_m - 1) // block_m
    cum = torch.cumsum(nt, 0)
    i = torch.arange(maxt, device=offsets.device)
    ex = torch.searchsorted(cum, i, right=True).clamp(max=e - 1)
    rs = off[ex] + (i - (cum[ex] - nt[ex])) * block_m
    table = torch.stack([ex, rs, off[ex + 1]]).to(torch.int32).contiguous()
    return table, cum[-1:].to(torch.int32), maxt


def ws_gemm(a, b, routing, *, transpose_b, bm, bn, bk, warps, stages, outer, table=None):
    k, m = (b.shape[2], b.shape[1]) if transpose_b else (b.shape[1], b.shape[2])
    r = a.shape[0]
    c = torch.empty(r, m, device=a.device, dtype=a.dtype)
    tab, total, maxt = table if table is not None else tile_table(routing.expert_offsets, r, bm)
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [bm, bk])
    b_desc = TensorDescriptor(b, list(b.shape), list(b.stride()), [1, bn, bk] if transpose_b else [1, bk, bn])
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    _ws_kernel[(sms,)](a_desc, b_desc, c, tab, total, maxt, m, k, c.stride(0), transpose_b, bm, bn, bk, outer,
                       num_warps=warps, num_stages=stages)
    return c


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, warp-specialize the tile loop (True) or the K loop (False));
# on H100 (2026-11-24) variant 0 did not finish within 9 minutes on the 7B down-projection: a hang
VARIANTS = ((128, 256, 64, 4, 3, True), (128, 256, 64, 4, 4, True), (128, 256, 64, 4, 3, False),
            (128, 128, 64, 4, 4, True), (128, 128, 64, 4, 5, False), (128, 256, 64, 8, 3, True))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variant", type=int, action="append", default=None,
                    help="index into VARIANTS (default: all); -1: the library kernels only")
    ap.add_argument("--kernels", default="down_proj,dxtilde,dh")
    args = ap.parse_args()
    only = set(args.kernels.split(","))
    shapes = [tuple(int(v) for v in s.split(",")) for s in (args.shape or ["24576,1536,256,128,8",
                                                                          "32768,4096,1024,128,8"])]
    out = {}
    for t, d, n, e, kk in shapes:
        p = random_problem(t, d, n, e, dtype=torch.bfloat16, device="cuda", seed=0)
        router = sonicmoe.router_topk(p["x"], p["router_weight"], kk)
        routing = sonicmoe.routing_from_topk(router.topk_ids, e)
        r = routing.num_rows
        a = torch.randn(r, n, device="cuda", dtype=torch.bfloat16)
        dh_ = torch.randn(r, 2 * n, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(r, 2 * n, device="cuda", dtype=torch.bfloat16)
        dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        s_row = torch.rand(r, device="cuda")
        w1, w2 = p["w1"], p["w2"]
        gemm = 2 * r * n * d
        rows = []
        cases = [("down_proj", a, w2, True, gemm), ("dxtilde", dh_, w1, False, 2 * gemm)]
        for name, lhs, rhs, tb, flops in cases:
            ref = grouped_gemm.varlen_m_gemm(lhs, rhs, None, routing, transpose_b=tb)
            ms = _ms(functools.partial(grouped_gemm.varlen_m_gemm, lhs, rhs, None, routing, transpose_b=tb))
            rows.append({"kernel": name, "variant": "library", "ms": ms, "tflops": flops / ms / 1e9})
            print(f"{(t, d, n, e, kk)} {name:9s} library            {ms:.3f} ms {flops / ms / 1e9:6.1f} TF", flush=True)
            if name not in only:
                continue
            for vi, (bm, bn, bk, warps, stages, outer) in enumerate(VARIANTS):
                if args.variant is not None and vi not in args.variant:
                    continue
                tag = f"ws {bm}x{bn}x{bk} w{warps} s{stages} {'outer' if outer else 'inner'}"
                try:
                    tab = tile_table(routing.expert_offsets, r, bm)
                    got = ws_gemm(lhs, rhs, routing, transpose_b=tb, bm=bm, bn=bn, bk=bk, warps=warps,
                                  stages=stages, outer=outer, table=tab)
                    err = float((got.float() - ref.float()).norm() / ref.float().norm())
                    ms = _ms(functools.partial(ws_gemm, lhs, rhs, routing, transpose_b=tb, bm=bm, bn=bn, bk=bk,
                                               warps=warps, stages=stages, outer=outer, table=tab))
                    ms_tab = _ms(functools.partial(tile_table, routing.expert_offsets, r, bm))
                    rows.append({"kernel": name, "variant": tag, "ms": ms, "tflops": flops / ms / 1e9,
                                 "rel_err": err, "table_ms": ms_tab})
                    print(f"{(t, d, n, e, kk)} {name:9s} {tag:28s} {ms:.3f} ms {flops / ms / 1e9:6.1f} TF "
                          f"err {err:.1e} (table {ms_tab:.3f} ms)", flush=True)
                except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is reported
                    rows.append({"kernel": name, "variant": tag, "error": str(exc)[:200]})
                    print(f"{(t, d, n, e, kk)} {name:9s} {tag:28s} ERROR {str(exc).splitlines()[0][:100]}", flush=True)
        if "dh" not in only:
            out[",".join(map(str, (t, d, n, e, kk)))] = rows
            continue
        # dH: the default against 128 x 128 tiles capped at 128 registers (two programs per multiprocessor)
        ref = dh.dh(dout, w2, h, s_row, routing)
        for tag, cfg in (("default", None),
                         ("128x128 w8 s3 maxnreg128", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, PROGS_PER_SM=0,
                                                           FLATTEN=False, W_TMA=True, num_warps=8, num_stages=3,
                                                           maxnreg=128)),
                         ("128x128 w8 s2 maxnreg128", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, PROGS_PER_SM=0,
                                                           FLATTEN=False, W_TMA=True, num_warps=8, num_stages=2,
                                                           maxnreg=128))):
            try:
                got = dh.dh(dout, w2, h, s_row, routing, config=cfg)
                err = max(float((g.float() - r_.float()).norm() / r_.float().norm()) for g, r_ in zip(got, ref))
                ms = _ms(functools.partial(dh.dh, dout, w2, h, s_row, routing, config=cfg))
                rows.append({"kernel": "dh", "variant": tag, "ms": ms, "tflops": gemm / ms / 1e9, "rel_err": err})
                print(f"{(t, d, n, e, kk)} dh        {tag:28s} {ms:.3f} ms {gemm / ms / 1e9:6.1f} TF err {err:.1e}",
                      flush=True)
            except Exception as exc:  # noqa: BLE001
                rows.append({"kernel": "dh", "variant": tag, "error": str(exc)[:200]})
                print(f"{(t, d, n, e, kk)} dh        {tag:28s} ERROR {str(exc).splitlines()[0][:100]}", flush=True)
        out[",".join(map(str, (t, d, n, e, kk)))] = rows
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
