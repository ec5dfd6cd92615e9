"""GPU probe of the warp-specialised varlen-K kernel (sonicmoe/ops/weight_grad_ws.py) against the Triton kernel.

usage: python scripts/wgrad_ws_probe.py [--check] [--time] [--shape T,d,n,E,K ...] [--rounded] [--epilogue]
                                       [--json OUT]

``--check``: edge shapes (empty experts, counts not multiples of BLOCK_R, T = 1, E = 1, K = E), dW1 and dW2, each
compared bitwise with the Triton kernel and by relative error with the float32 reference; two runs compared
bitwise. ``--time``: dW1 and dW2 on the shapes (default 7B and 120B-n1024), the Triton kernel (pinned config and
the autotuner's) against the Gluon kernel in a few configs (do_bench medians); outputs compared bitwise.
``--rounded``: each timed shape also with every expert's count a multiple of 128 (token rounding's counts: the
T·K pairs dealt to the experts as evenly as 128-row tiles allow). ``--epilogue``: the Gluon kernel's epilogue
variant ``PART`` 1 as well, the kernel without writing its tiles (the epilogue's exposed cost is the difference).
Session 35 (benchmarks/results/2026-11-26_nvidia-h200_session35/) also timed two output buffers, so that a tile's
store drains while the next tile's MMAs run: with the ring one slot shorter (or in 32-row chunks) to make room, 7-45%
slower everywhere, so the kernel keeps one.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from triton.testing import do_bench

import sonicmoe
from sonicmoe.ops import weight_grad_ws as ws
from sonicmoe.ops.weight_grad import varlen_k_gemm, varlen_k_gemm_ref
from sonicmoe.routing import Routing

# BLOCK_R, STAGES, loader warps, loader registers (session 21's sweeps, results in
# benchmarks/results/2026-11-25_nvidia-h200_session21/, also tried 1-2 loader warps and stores from registers; both
# slower, and the latter is no longer in the kernel)
# + whether the tile's right half leaves through a ring slot (STAGE_IN_RING, session 41: a fourth 64-row slot)
GLUON_VARIANTS = [(64, 3, 4, 80, 0), (64, 4, 4, 80, 1), (32, 6, 4, 80, 0)]


def routing_of(t: int, e: int, k: int, empty: int = 0, seed: int = 0, rounded: bool = False) -> Routing:
    """Top-k routing of random logits; the first ``empty`` experts get no token. ``rounded``: instead, the T·K
    pairs dealt to the experts in 128-row tiles (every count but the last expert's a multiple of 128), in random
    token order, so that each expert's rows are a random set of tokens as under token rounding."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if rounded:
        tiles = torch.arange(t * k, device="cuda") // 128 % e  # tile j of 128 pairs to expert j mod E
        ids = tiles[torch.randperm(t * k, device="cuda", generator=g)].view(t, k)
        # a token may meet one expert twice here; the weight-gradient kernels only read rows, which is all timed
        return sonicmoe.routing_from_pairs(torch.arange(t, device="cuda").repeat_interleave(k), ids.reshape(-1), t, e,
                                           token_major=True)
    logits = torch.randn(t, e, device="cuda", generator=g)
    logits[:, :empty] = -1e9
    return sonicmoe.routing_from_topk(logits.topk(k, dim=1).indices, e)


def operands(t: int, d: int, n: int, routing: Routing, dtype=torch.bfloat16, seed: int = 1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = routing.num_rows
    x = torch.randn(t, d, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(t, d, device="cuda", dtype=dtype, generator=g)
    dh = torch.randn(r, 2 * n, device="cuda", dtype=dtype, generator=g)
    ap = torch.randn(r, n, device="cuda", dtype=dtype, generator=g)
    return x, dout, dh, ap


def cases(x, dout, dh, ap):
    """(name, p, q, p_gather)"""
    return [("dW1", dh, x, False), ("dW2", dout, ap, True)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def check() -> list[dict]:
    rows = []
    shapes = [  # T, d, n, E, K, empty experts
        (4096, 512, 128, 8, 2, 0), (3000, 768, 256, 16, 4, 3), (1, 256, 128, 4, 1, 0), (777, 512, 128, 1, 1, 0),
        (500, 256, 128, 6, 6, 0), (2048, 1536, 256, 128, 8, 5), (333, 1024, 512, 8, 2, 0),
    ]
    for t, d, n, e, k, empty in shapes:
        routing = routing_of(t, e, k, empty)
        for name, p, q, pg in cases(*operands(t, d, n, routing)):
            ok = ws.wgrad_ws_supported(p, q, p_gather=pg, q_gather=not pg, out_dtype=p.dtype)
            if not ok:
                print(f"  {name} T={t} d={d} n={n} E={e} K={k}: not supported (skipped)")
                continue
            cfgs = [None] + [ws.wgrad_ws_config(p.shape[1], q.shape[1], pg, 64, stage_in_ring=r) for r in (False, True)]
            tri = varlen_k_gemm(p, q, routing, p_gather=pg, q_gather=not pg, out_dtype=p.dtype)
            ref = varlen_k_gemm_ref(p.float(), q.float(), routing, p_gather=pg, q_gather=not pg,
                                    out_dtype=torch.float32)
            for cfg in cfgs:
                a = ws.wgrad_ws(p, q, routing.row_token, routing.expert_offsets, p_gather=pg, config=cfg)
                b = ws.wgrad_ws(p, q, routing.row_token, routing.expert_offsets, p_gather=pg, config=cfg)
                torch.cuda.synchronize()
                rec = {"kernel": name, "shape": [t, d, n, e, k, empty], "config": cfg or "default",
                       "bitwise_vs_triton": torch.equal(a, tri), "deterministic": torch.equal(a, b),
                       "rel_err_vs_fp32": rel(a, ref), "triton_rel_err": rel(tri, ref),
                       "finite": bool(torch.isfinite(a).all())}
                print(f"  {name} T={t} d={d} n={n} E={e} K={k} empty={empty} cfg={cfg or 'default'}: "
                      f"same bits as triton {rec['bitwise_vs_triton']}, deterministic {rec['deterministic']}, "
                      f"rel err {rec['rel_err_vs_fp32']:.2e} (triton {rec['triton_rel_err']:.2e})")
                rows.append(rec)
    return rows


def time_shapes(shapes, rounded: bool = False, epilogue: bool = False) -> list[dict]:
    rows = []
    for (t, d, n, e, k), rnd in [(sh, r) for sh in shapes for r in ((False, True) if rounded else (False,))]:
        routing = routing_of(t, e, k, rounded=rnd)
        x, dout, dh, ap = operands(t, d, n, routing)
        r = routing.num_rows
        print(f"shape T={t} d={d} n={n} E={e} K={k} R={r} {'rounded' if rnd else 'top-k'} on "
              f"{torch.cuda.get_device_name()}")
        for name, p, q, pg in cases(x, dout, dh, ap):
            flops = 2 * r * p.shape[1] * q.shape[1]

            def tri(cfg=None, p=p, q=q, pg=pg, routing=routing):
                return varlen_k_gemm(p, q, routing, p_gather=pg, q_gather=not pg, out_dtype=p.dtype, config=cfg)

            def glu(cfg=None, p=p, q=q, pg=pg, routing=routing):
                return ws.wgrad_ws(p, q, routing.row_token, routing.expert_offsets, p_gather=pg, config=cfg)

            base = tri()
            variants = [("triton (autotuned)", lambda: tri())]
            os.environ["SONICMOE_AUTOTUNE"] = "0"
            variants.append(("triton (pinned)", lambda: tri()))
            i_dim, j_dim = p.shape[1], q.shape[1]
            narrow_i = pg  # the gathered operand's side 128 wide, the other 256
            bi, bj = (128, 256) if narrow_i else (256, 128)
            if i_dim % bi == 0 and j_dim % bj == 0:
                for br, st, lw, lr, ring in GLUON_VARIANTS:
                    cfg = {"BLOCK_I": bi, "BLOCK_J": bj, "BLOCK_R": br, "STAGES": st, "LOADER_WARPS": lw,
                           "LOADER_REGS": lr, "STAGE_IN_RING": bool(ring)}
                    label = f"gluon {bi}x{bj} R{br} S{st} L{lw}{' ring' if ring else ''}"
                    variants.append((label, lambda cfg=cfg: glu(cfg)))
                if epilogue:
                    for st, ring in ((3, False), (4, True)):
                        cfg = {"BLOCK_I": bi, "BLOCK_J": bj, "BLOCK_R": 64, "STAGES": st, "PART": 1,
                               "STAGE_IN_RING": ring}
                        variants.append((f"gluon R64 S{st} PART1 (no stores)", lambda cfg=cfg: glu(cfg)))
            for label, fn in variants:
                try:
                    out = fn()
                    torch.cuda.synchronize()
                except Exception as exc:  # a config that does not compile (registers) is reported and skipped
                    print(f"  {name} {label:<28} failed: {type(exc).__name__}")
                    continue
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                same = torch.equal(out, base)
                print(f"  {name} {label:<28} {ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s  same bits {same}")
                rows.append({"shape": [t, d, n, e, k], "rounded": rnd, "kernel": name, "variant": label, "ms": ms,
                             "tflops": flops / ms / 1e9, "bitwise_equal_triton": same})
            os.environ.pop("SONICMOE_AUTOTUNE", None)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounded", action="store_true")
    ap.add_argument("--epilogue", action="store_true")
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name()}
    if args.check:
        out["check"] = check()
    if args.time:
        shapes = [tuple(int(v) for v in s.split(",")) for s in
                  (args.shape or ["24576,1536,256,128,8", "32768,4096,1024,128,8"])]
        out["time"] = time_shapes(shapes, args.rounded, args.epilogue)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
