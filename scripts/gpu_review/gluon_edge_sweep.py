"""GPU coverage check (sm_90), expected PASS: the five Gluon kernels on the edge routings the GPU tests do not pin
down explicitly, each against the Triton kernel (bitwise where the repo claims the same bits: dH/A', the two
varlen-M GEMMs, the weight gradients; by relative error for the up-projection), outputs NaN-poisoned first.

Routings (counts per expert; built with routing_from_pairs): first and last expert empty, all but one empty (first,
middle, last), R below one tile, T = 1, counts 127/128/129/1 around the tile heights, and each of those with 37
padding pairs after expert_offsets[E] (static-length routing; rows past it compared nowhere). Shapes at the smallest
widths the rules admit and a C narrower than the TMA box (ping-pong m = 64 < BLOCK_N = 128).
Compile time dominates (about 10 Gluon + Triton variants); the checks themselves take a few seconds.
"""
import os
import sys

import torch

sys.path.insert(0, os.environ.get("SONICMOE_REPO", "/work/main"))
from sonicmoe.ops import dh as dh_mod  # noqa: E402
from sonicmoe.ops import dh_ws, grouped_gemm, grouped_gemm_ws, up_proj, varlen_m_ws, weight_grad, weight_grad_ws  # noqa: E402
from sonicmoe.ops.load_order import expert_load_order  # noqa: E402
from sonicmoe.ops.up_proj_ws import up_proj_ws, up_ws_config  # noqa: E402
from sonicmoe.routing import routing_from_pairs  # noqa: E402
from sonicmoe.testing import rel_err  # noqa: E402

FAILS = []


def check(name, ok, extra=""):
    print(("ok   " if ok else "FAIL ") + name + (" " + extra if extra else ""))
    if not ok:
        FAILS.append(name)


def with_env(env, fn):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def make_routing(counts, t, padding=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = len(counts)
    tok = (torch.cat([torch.randperm(t, generator=g)[:c] for c in counts]) if sum(counts)
           else torch.zeros(0, dtype=torch.long))
    exp = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    if padding:
        tok = torch.cat([tok, torch.full((padding,), t)])
        exp = torch.cat([exp, torch.full((padding,), e)])
    return routing_from_pairs(tok.cuda(), exp.cuda(), t, e, padding=bool(padding))


ROUTINGS = {
    "first+last empty": ([0, 300, 129, 128, 1, 0], 400),
    "all but first empty": ([777, 0, 0, 0, 0, 0], 800),
    "all but middle empty": ([0, 0, 0, 777, 0, 0], 800),
    "all but last empty": ([0, 0, 0, 0, 0, 777], 800),
    "R < one tile": ([3, 0, 2, 0, 0, 1], 8),
    "T=1": ([0, 1, 0, 0, 0, 0], 1),
    "127/128/129/1": ([127, 128, 129, 1, 255, 257], 300),
}


def real(x, routing):
    return x[: int(routing.expert_offsets[-1])]


def up_checks(name, routing, t):
    d, n, e = 64, 128, routing.num_experts
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(e, 2 * n, d, device="cuda", generator=g) / d ** 0.5).bfloat16()
    b1 = (0.1 * torch.randn(e, 2 * n, device="cuda", generator=g)).bfloat16()
    tri_h, tri_a = with_env({"SONICMOE_GLUON_UP": "0"}, lambda: up_proj.up_proj(x, w1, b1, routing))
    for epi in (4, 0):
        h, a = up_proj_ws(x, w1, b1, routing, config=up_ws_config(d, epi))
        ok = (torch.isfinite(real(h, routing)).all() and torch.isfinite(real(a, routing)).all()
              and rel_err(real(h, routing), real(tri_h, routing)) < 2e-3
              and rel_err(real(a, routing), real(tri_a, routing)) < 5e-3)
        check(f"up_proj_ws EPI={epi} [{name}]", bool(ok) or int(routing.expert_offsets[-1]) == 0)


def dh_checks(name, routing, t):
    d, e = 64, routing.num_experts
    for n in (128, 256):  # 128: staging sets of their own; 256: staging in a ring slot, dS in pair order
        g = torch.Generator(device="cuda").manual_seed(2)
        dout = torch.randn(t, d, device="cuda", generator=g).bfloat16()
        w2 = (torch.randn(e, d, n, device="cuda", generator=g) / d ** 0.5).bfloat16()
        h = torch.randn(routing.num_rows, 2 * n, device="cuda", generator=g).bfloat16()
        s = torch.rand(routing.num_rows, device="cuda", generator=g)
        tri = with_env({"SONICMOE_GLUON_DH": "0"}, lambda: dh_mod.dh(dout, w2, h, s, routing))
        got = dh_ws.dh_ws(dout, w2, h, s, routing)
        ok = (torch.equal(real(got[0], routing), real(tri[0], routing))
              and torch.equal(real(got[1], routing), real(tri[1], routing)))
        ok &= (rel_err(real(got[2].sum(0), routing), real(tri[2], routing)) < 1e-5
               or int(routing.expert_offsets[-1]) == 0)
        pairs = torch.empty_like(s)
        pairs[routing.row_pair.long()] = s
        if dh_ws.ds_pairs_in_kernel(n):
            dsp = dh_ws.dh_ws(dout, w2, h, pairs, routing, pair_order=True, ds_pairs=torch.float32)[2]
            ok &= bool(torch.isfinite(dsp).all())
        check(f"dh_ws n={n} [{name}]", bool(ok))


def pingpong_checks(name, routing, t):
    e, r = routing.num_experts, routing.num_rows
    g = torch.Generator(device="cuda").manual_seed(3)
    for k, m in ((128, 64), (64, 200)):  # m = 64: C (and B's box) narrower than BLOCK_N = 128
        for tb, shape in ((True, (e, m, k)), (False, (e, k, m))):
            a = torch.randn(r, k, device="cuda", generator=g).bfloat16()
            b = (torch.randn(*shape, device="cuda", generator=g) / k ** 0.5).bfloat16()
            bias = torch.randn(e, m, device="cuda", generator=g).bfloat16()
            tri = with_env({"SONICMOE_GLUON": "0"},
                           lambda: grouped_gemm.varlen_m_gemm(a, b, bias, routing, transpose_b=tb))
            got = grouped_gemm_ws.ws_varlen_m_gemm(a, b, bias, routing.expert_offsets, transpose_b=tb)
            check(f"ping-pong k={k} m={m} trans={tb} [{name}]", torch.equal(real(got, routing), real(tri, routing)))


def long_checks(name, routing, t):
    e, r = routing.num_experts, routing.num_rows
    g = torch.Generator(device="cuda").manual_seed(4)
    k, m = 640, 256
    for tb, shape in ((True, (e, m, k)), (False, (e, k, m))):
        a = torch.randn(r, k, device="cuda", generator=g).bfloat16()
        b = (torch.randn(*shape, device="cuda", generator=g) / k ** 0.5).bfloat16()
        tri = with_env({"SONICMOE_GLUON": "0"}, lambda: grouped_gemm.varlen_m_gemm(a, b, None, routing, transpose_b=tb))
        got = varlen_m_ws.long_gemm(a, b, None, routing, transpose_b=tb)
        check(f"long k={k} m={m} trans={tb} [{name}]", torch.equal(real(got, routing), real(tri, routing)))


def wgrad_checks(name, routing, t):
    d, n, r = 256, 128, routing.num_rows
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    dout = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    dh_ = torch.randn(r, 2 * n, device="cuda", generator=g).bfloat16()
    ap = torch.randn(r, n, device="cuda", generator=g).bfloat16()
    order = expert_load_order(routing.expert_offsets)
    for p, q, pg in ((dh_, x, False), (dout, ap, True)):
        tri = weight_grad.varlen_k_gemm(p, q, routing, p_gather=pg, q_gather=not pg, out_dtype=p.dtype, gluon=False)
        for eo in (None, order):
            got = weight_grad_ws.wgrad_ws(p, q, routing.row_token, routing.expert_offsets, p_gather=pg, expert_order=eo)
            check(f"wgrad p_gather={pg} load_order={eo is not None} [{name}]", torch.equal(got, tri))


def main():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0) or not grouped_gemm_ws.HAVE_GLUON:
        print("SKIP: needs an sm_90 GPU with Gluon")
        return
    os.environ["SONICMOE_POISON_OUTPUTS"] = "1"
    for base, (counts, t) in ROUTINGS.items():
        for pad in (0, 37):
            name = base + (" +37 padding" if pad else "")
            routing = make_routing(counts, t, pad)
            for fn in (up_checks, dh_checks, pingpong_checks, long_checks, wgrad_checks):
                fn(name, routing, t)
    print("PASS" if not FAILS else f"FAIL ({len(FAILS)}): {FAILS}")


if __name__ == "__main__":
    main()
