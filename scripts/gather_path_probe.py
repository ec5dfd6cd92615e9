"""Is it the row gather that makes the gather-fused Gluon kernels spend more energy per FLOP than cuBLAS? GPU only.

Session 55's energy table at (32768, 4096, 1024, 128, 8) split the GEMMs in two: the kernels that gather rows by
``cp.async`` (the up-projection, dH, dW1, dW2) spent 16-33% more joules per FLOP than their dense cuBLAS twins, the
two that load every operand by TMA (the down-projection and dX̃ on :mod:`sonicmoe.ops.varlen_m_ws`) 7%. This probe
runs each gather-fused kernel

* as the layer runs it (rows of X or dO gathered in token order),
* on the gathered operand made contiguous beforehand, with the identity as row tokens (the same ``cp.async`` path,
  rows in order: the same bits),
* with ``PART`` 1 where the kernel has it (the MMAs alone),

beside :func:`sonicmoe.ops.varlen_m_ws.long_gemm` on that contiguous copy (the same product with A by TMA, one
128 × 256 chain, no epilogue math) and the dense cuBLAS twin, every item back to back for a settled warm-up and
timed over a window with its energy per call (``energy_probe.measure_items``). Outputs of the contiguous runs are
checked bitwise against the gathered ones.

usage (GPU): PYTHONPATH=$PWD python scripts/gather_path_probe.py [--shape T,d,n,E,K]
             [--kernels up,dH,dW1,dW2,wg,wgsplit,upsplit,ftz,ring,chains] [--warmup 1.0] [--window 1.5]
             [--passes 1] [--json F]

``wg``: the weight gradients with their output skipped, the other tile shape, balanced contiguous operands and the dense
twin with either operand order; ``wgsplit``: the weight-gradient kernel's MMA warpgroups as one partition or two
(``WG_SPLIT``); ``upsplit``: the up-projection's H rounded by packed cvts or by ``.to``
(``H_PACKED``), whole and MMAs alone (session 57's other form, its MMA warpgroups as two partitions, was removed in
session 67); ``ftz``: the up-projection and dH with the sigmoid by the default or the ftz forms (``SIGMOID_FTZ``);
``ring``: the MMAs alone of dH and the up-projection at several ring depths (``RING_DEPTHS``), and the up-projection
with its storer;
``chains``: the up-projection and dW1 with two m64 × 128 wgmma chains per warpgroup or one m64 × 256 chain;
``fence``: the four gather-fused kernels as the layer runs them (and the MMAs alone), to run with and without
``--no-fence``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from energy_probe import measure_passes, probe_problem, write_rows  # noqa: E402
from kernel_breakdown import dense_rows  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier  # noqa: E402

from sonicmoe.bench.gpu_state import Nvml  # noqa: E402
from sonicmoe.ops import dh_ws, up_proj_ws, weight_grad_ws  # noqa: E402
from sonicmoe.ops.varlen_m_ws import long_gemm  # noqa: E402


def identity_routing(routing):
    """``routing`` with row r reading token r: the rows of a contiguous, pre-gathered operand in order."""
    r = routing.num_rows
    ident = torch.arange(r, device=routing.row_token.device, dtype=routing.row_token.dtype)
    return dataclasses.replace(routing, num_tokens=r, row_token=ident)


def same(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Raise unless ``a`` (a variant's output) has the bits of ``b`` (the form the layer runs)."""
    if not torch.equal(a, b):
        raise AssertionError(f"{name}: the output differs from the reference form's")


def items(shape: str, kernels: list[str]) -> list:
    """(name, fn, FLOPs) of each kernel in each form."""
    p, routing, s_pair = probe_problem(shape)
    t, d, n, e, k = (int(v) for v in shape.split(","))
    x, w1, w2 = p["x"], p["w1"], p["w2"]
    r = routing.num_rows
    gemm = 2 * r * n * d
    ident = identity_routing(routing)
    tok = routing.row_token.long()
    g = torch.Generator(device="cuda").manual_seed(2)
    dout = torch.randn(t, d, device="cuda", dtype=x.dtype, generator=g)
    h, _ = up_proj_ws.up_proj_ws(x, w1, None, routing)
    s_row = routing.row_scores(s_pair).float()
    dh_, ap_, _ = dh_ws.dh_ws(dout, w2, h, s_row, routing)
    # the pre-gathered copies and the dense twins (several GB at d = 4096) only where a gather comparison needs them
    gather_kernels = {"up", "dH", "dW1", "dW2"} & set(kernels)
    xg, dog = (x[tok].contiguous(), dout[tok].contiguous()) if gather_kernels else (None, None)
    twins = {name: (fn, fl) for name, fn, fl in dense_rows(t, d, n, e, k)} if gather_kernels else {}
    off = routing.expert_offsets
    out = []
    if "up" in kernels:
        same("up", up_proj_ws.up_proj_ws(xg, w1, None, ident)[0], h)
        part1 = {**up_proj_ws.up_ws_config(d), "PART": 1}
        out += [
            ("up gathered (layer)", lambda: up_proj_ws.up_proj_ws(x, w1, None, routing), 2 * gemm),
            ("up contiguous rows", lambda: up_proj_ws.up_proj_ws(xg, w1, None, ident), 2 * gemm),
            ("up gathered, MMAs alone", lambda: up_proj_ws.up_proj_ws(x, w1, None, routing, config=part1), 2 * gemm),
            ("up contiguous, MMAs alone", lambda: up_proj_ws.up_proj_ws(xg, w1, None, ident, config=part1),
             2 * gemm),
            ("up product by long_gemm (TMA A)", lambda: long_gemm(xg, w1, None, routing, transpose_b=True), 2 * gemm),
            ("up dense twin", *twins["up-proj (gather+SwiGLU)"]),
        ]
    if "dH" in kernels:
        same("dH", dh_ws.dh_ws(dog, w2, h, s_row, ident)[0], dh_)
        part1 = {**dh_ws.dh_ws_config(n), "PART": 1}
        out += [
            ("dH gathered (layer)", lambda: dh_ws.dh_ws(dout, w2, h, s_row, routing), gemm),
            ("dH contiguous rows", lambda: dh_ws.dh_ws(dog, w2, h, s_row, ident), gemm),
            ("dH gathered, MMAs alone", lambda: dh_ws.dh_ws(dout, w2, h, s_row, routing, config=part1), gemm),
            ("dH contiguous, MMAs alone", lambda: dh_ws.dh_ws(dog, w2, h, s_row, ident, config=part1), gemm),
            ("dA' by long_gemm (TMA A)", lambda: long_gemm(dog, w2, None, routing, transpose_b=False), gemm),
            ("dH dense twin", *twins["dH (dA', dS, dH, A')"]),
        ]
    if "dW1" in kernels:
        ref = weight_grad_ws.wgrad_ws(dh_, x, routing.row_token, off, p_gather=False)
        same("dW1", weight_grad_ws.wgrad_ws(dh_, xg, ident.row_token, off, p_gather=False), ref)
        out += [
            ("dW1 gathered (layer)", lambda: weight_grad_ws.wgrad_ws(dh_, x, routing.row_token, off, p_gather=False),
             2 * gemm),
            ("dW1 contiguous rows", lambda: weight_grad_ws.wgrad_ws(dh_, xg, ident.row_token, off, p_gather=False),
             2 * gemm),
            ("dW1 dense twin", *twins["dW1 (varlen-K)"]),
        ]
    if "dW2" in kernels:
        ref = weight_grad_ws.wgrad_ws(dout, ap_, routing.row_token, off, p_gather=True)
        same("dW2", weight_grad_ws.wgrad_ws(dog, ap_, ident.row_token, off, p_gather=True), ref)
        out += [
            ("dW2 gathered (layer)", lambda: weight_grad_ws.wgrad_ws(dout, ap_, routing.row_token, off,
                                                                     p_gather=True), gemm),
            ("dW2 contiguous rows", lambda: weight_grad_ws.wgrad_ws(dog, ap_, ident.row_token, off, p_gather=True),
             gemm),
            ("dW2 dense twin", *twins["dW2 (varlen-K)"]),
        ]
    if "wg" in kernels:
        out += wgrad_forms(x, dout, dh_, ap_, routing, ident, n, d)
    if "wgsplit" in kernels:
        out += wgrad_split_forms(x, dout, dh_, ap_, routing, n, d)
    if "upsplit" in kernels:
        out += up_split_forms(x, w1, routing, d, 2 * gemm)
    if "ftz" in kernels:
        out += sigmoid_ftz_forms(x, w1, w2, dout, h, s_row, routing, d, n, gemm)
    if "ring" in kernels:
        out += ring_depth_forms(x, w1, w2, dout, h, s_row, routing, d, n, gemm)
    if "chains" in kernels:
        out += one_chain_forms(x, w1, dh_, routing, d, n, 2 * gemm)
    if "fence" in kernels:
        off, tok = routing.expert_offsets, routing.row_token
        up1, dh1 = {**up_proj_ws.up_ws_config(d), "PART": 1}, {**dh_ws.dh_ws_config(n), "PART": 1}
        out += [("up (layer)", lambda: up_proj_ws.up_proj_ws(x, w1, None, routing), 2 * gemm),
                ("up MMAs alone", lambda: up_proj_ws.up_proj_ws(x, w1, None, routing, config=up1), 2 * gemm),
                ("dH (layer)", lambda: dh_ws.dh_ws(dout, w2, h, s_row, routing), gemm),
                ("dH MMAs alone", lambda: dh_ws.dh_ws(dout, w2, h, s_row, routing, config=dh1), gemm),
                ("dW1 (layer)", lambda: weight_grad_ws.wgrad_ws(dh_, x, tok, off, p_gather=False), 2 * gemm),
                ("dW2 (layer)", lambda: weight_grad_ws.wgrad_ws(dout, ap_, tok, off, p_gather=True), gemm)]
    return out


@gluon.jit
def wait_slot_no_fence(tma_ready, cp_ready, step, STAGES: gl.constexpr):
    """``weight_grad_ws.wait_gathered_slot`` without its ``fence.proxy.async`` (``--no-fence``)."""
    s = step % STAGES
    ph = (step // STAGES) & 1
    mbarrier.wait(tma_ready.index(s), ph)
    mbarrier.wait(cp_ready.index(s), ph)
    return s


def drop_proxy_fence() -> None:
    """Timing only (``--no-fence``): the gather-fused kernels' MMA warps wait for a ring slot without the
    ``fence.proxy.async`` that makes the loader's ``cp.async`` writes visible to the wgmma (a race: the outputs may be
    wrong). Patched into the kernels' modules before their first compile, so that a process of the probe with it and
    one without time what the fence costs the MMA warps."""
    for mod in (up_proj_ws, dh_ws, weight_grad_ws):
        mod.wait_gathered_slot = wait_slot_no_fence


def one_chain_forms(x, w1, dh_, routing, d, n, flops) -> list:
    """The up-projection and dW1 with each MMA warpgroup's two m64 × 128 wgmma chains and with one m64 × 256 chain
    (``--kernels chains``): the up-projection's gate and up boxes as one B operand (``GU_FUSED``), dW1's product
    transposed (``weight_grad_ws.SWAP_AB``), whole and MMAs alone; the one-chain outputs checked bitwise against the
    two-chain ones."""
    tok, off = routing.row_token, routing.expert_offsets
    out = []
    base = up_proj_ws.up_ws_config(d)
    ref = up_proj_ws.up_proj_ws(x, w1, None, routing, config={**base, "GU_FUSED": False})
    got = up_proj_ws.up_proj_ws(x, w1, None, routing, config={**base, "GU_FUSED": True})
    same("up GU_FUSED H", got[0], ref[0])
    same("up GU_FUSED A", got[1], ref[1])
    wg = {fused: weight_grad_ws.wgrad_ws_config(2 * n, d, False, swap_ab=fused) for fused in (False, True)}
    same("dW1 SWAP_AB", weight_grad_ws.wgrad_ws(dh_, x, tok, off, p_gather=False, config=wg[True]),
         weight_grad_ws.wgrad_ws(dh_, x, tok, off, p_gather=False, config=wg[False]))
    for part, part_name in ((0, ""), (1, ", MMAs alone")):
        for fused in (False, True):
            tag = "one chain" if fused else "two chains"
            out += [(f"up {tag}{part_name}", lambda c={**base, "GU_FUSED": fused, "PART": part}:
                     up_proj_ws.up_proj_ws(x, w1, None, routing, config=c), flops),
                    (f"dW1 {tag}{part_name}", lambda c={**wg[fused], "PART": part}:
                     weight_grad_ws.wgrad_ws(dh_, x, tok, off, p_gather=False, config=c), flops)]
    return out


# (BLOCK_K, STAGES) of the ring-depth items (``--kernels ring``): dH's 64-deep slots as now and fewer, and 32-deep
# ones; and the up-projection's (64-deep) STAGES
RING_DEPTHS = ((64, 4), (64, 3), (64, 2), (32, 8), (32, 6), (32, 5), (32, 4))
UP_RING_DEPTHS = (4, 3)


def ring_depth_forms(x, w1, w2, dout, h, s_row, routing, d, n, gemm) -> list:
    """The MMAs alone (``PART`` 1) of dH at each ring depth of :data:`RING_DEPTHS` and of the up-projection at each of
    :data:`UP_RING_DEPTHS` (``--kernels ring``), with dH whole as the layer runs it first: what the main loop would
    cost if a buffer of the epilogue's (a tile's dA′ handed to an epilogue partition) took ring slots; and the
    up-projection whole as the layer runs it and with its storer partition (``EPI_WARPS``; checked bitwise against
    it). Session 60 (benchmarks/results/2026-12-02_nvidia-h200_session60/) also timed dH with such a partition."""
    out = [("dH (layer)", lambda: dh_ws.dh_ws(dout, w2, h, s_row, routing), gemm)]
    for bk, stages in RING_DEPTHS:
        cfg = {**dh_ws.dh_ws_config(n, block_k=bk), "STAGES": stages, "PART": 1}
        out.append((f"dH MMAs alone, BK {bk} x {stages}",
                    lambda c=cfg: dh_ws.dh_ws(dout, w2, h, s_row, routing, config=c), gemm))
    up_layer = up_proj_ws.up_proj_ws(x, w1, None, routing)
    storer = up_proj_ws.up_ws_config(d, epi_warps=up_proj_ws.EPI_WARPS)
    got = up_proj_ws.up_proj_ws(x, w1, None, routing, config=storer)
    same("up storer H", got[0], up_layer[0])
    same("up storer A", got[1], up_layer[1])
    out += [("up (layer)", lambda: up_proj_ws.up_proj_ws(x, w1, None, routing), 2 * gemm),
            (f"up with its storer ({storer['STAGES']} slots)",
             lambda: up_proj_ws.up_proj_ws(x, w1, None, routing, config=storer), 2 * gemm)]
    for stages in UP_RING_DEPTHS:
        cfg = {**up_proj_ws.up_ws_config(d), "STAGES": stages, "PART": 1}
        out.append((f"up MMAs alone, BK 64 x {stages}",
                    lambda c=cfg: up_proj_ws.up_proj_ws(x, w1, None, routing, config=c), 2 * gemm))
    return out


def sigmoid_ftz_forms(x, w1, w2, dout, h, s_row, routing, d, n, gemm) -> list:
    """The up-projection and dH with the SwiGLU's sigmoid by the default and the ftz forms (``SIGMOID_FTZ``;
    ``--kernels ftz``), each as the layer runs it; the ftz outputs checked bitwise against the default's."""
    out, runs = [], []
    for ftz in (False, True):
        up_cfg = {**up_proj_ws.up_ws_config(d), "SIGMOID_FTZ": ftz}
        dh_cfg = {**dh_ws.dh_ws_config(n), "SIGMOID_FTZ": ftz}
        runs.append(up_proj_ws.up_proj_ws(x, w1, None, routing, config=up_cfg)
                    + dh_ws.dh_ws(dout, w2, h, s_row, routing, config=dh_cfg))
        tag = "ftz" if ftz else "default"
        out += [(f"up, sigmoid {tag}", lambda c=up_cfg: up_proj_ws.up_proj_ws(x, w1, None, routing, config=c),
                 2 * gemm),
                (f"dH, sigmoid {tag}", lambda c=dh_cfg: dh_ws.dh_ws(dout, w2, h, s_row, routing, config=c), gemm)]
    for name, a, b in zip(("up H", "up A", "dH", "A'", "dS"), runs[1], runs[0]):
        same(f"SIGMOID_FTZ {name}", a, b)
    return out


def up_split_forms(x, w1, routing, d, flops) -> list:
    """The up-projection without a storer: H rounded by packed cvts (``H_PACKED``) or by ``.to``, whole, and the
    MMAs alone (``--kernels upsplit``); the second form's H and A checked bitwise against the first's."""
    base = up_proj_ws.up_ws_config(d, epi_warps=0)
    forms = (("8-warp MMA partition", base), ("8-warp, H by .to", {**base, "H_PACKED": False}))
    ref = up_proj_ws.up_proj_ws(x, w1, None, routing, config=base)
    for name, cfg in forms[1:]:
        got = up_proj_ws.up_proj_ws(x, w1, None, routing, config=cfg)
        same(f"up {name} H", got[0], ref[0])
        same(f"up {name} A", got[1], ref[1])
    return [(f"up {name}{part_name}", lambda c={**cfg, "PART": part}: up_proj_ws.up_proj_ws(x, w1, None, routing,
                                                                                          config=c), flops)
            for part, part_name in ((0, ""), (1, ", MMAs alone"))
            for name, cfg in (forms if part == 0 else forms[:1])]


# (name, WG_SPLIT) of the weight-gradient kernel's forms under ``--kernels wgsplit`` (the split form's one-piece
# stores and epilogues in turns, which session 56 also timed, were removed in session 68)
SPLIT_FORMS = (("8-warp MMA partition", False), ("split", True))


def wgrad_split_forms(x, dout, dh_, ap_, routing, n, d) -> list:
    """dW1 and dW2 as the layer runs them under each of :data:`SPLIT_FORMS` (the MMA warpgroups as one partition or
    two), each checked bitwise against the first."""
    gemm = 2 * routing.num_rows * n * d
    tok, off = routing.row_token, routing.expert_offsets
    out = []
    for name, pp, qq, pg, (i_dim, j_dim), fl in (("dW1", dh_, x, False, (2 * n, d), 2 * gemm),
                                                 ("dW2", dout, ap_, True, (d, n), gemm)):
        ref = None
        for form, split in SPLIT_FORMS:
            cfg = weight_grad_ws.wgrad_ws_config(i_dim, j_dim, pg, wg_split=split)

            def fn(pp=pp, qq=qq, pg=pg, cfg=cfg):
                return weight_grad_ws.wgrad_ws(pp, qq, tok, off, p_gather=pg, config=cfg)
            got = fn()
            if ref is None:
                ref = got
            same(f"{name} {form}", got, ref)
            out.append((f"{name} {form} ({cfg['STAGES']} slots)", fn, fl))
    return out


def wgrad_forms(x, dout, dh_, ap_, routing, ident, n, d) -> list:
    """The weight gradients beyond the gather (``--kernels wg``): the output skipped (``PART`` 1), the other tile
    shape, contiguous operands with every expert at exactly R / E rows (no partial chunk, the dense twin's
    problem), and the dense twin with its first operand K-major (as ``dense_rows`` has it) and MN-major (as the
    kernel reads it)."""
    e = routing.num_experts
    r = routing.num_rows
    gemm = 2 * r * n * d
    m = r // e
    bal = torch.arange(e + 1, device="cuda", dtype=routing.expert_offsets.dtype) * m
    off, tok, itok = routing.expert_offsets, routing.row_token, ident.row_token
    g = torch.Generator(device="cuda").manual_seed(3)
    xb = torch.randn(e, m, d, device="cuda", dtype=x.dtype, generator=g)
    hb = torch.randn(e, m, 2 * n, device="cuda", dtype=x.dtype, generator=g)
    ab = torch.randn(e, m, n, device="cuda", dtype=x.dtype, generator=g)
    out = []
    # balanced operands (pb, qb): dW1 = dHᵀ X, dW2 = dOᵀ A′, with xb standing in for dO's rows too ((e, m, d) both)
    for name, pp, qq, pg, (i_dim, j_dim), fl, (pb, qb) in (
            ("dW1", dh_, x, False, (2 * n, d), 2 * gemm, (hb, xb)),
            ("dW2", dout, ap_, True, (d, n), gemm, (xb, ab))):
        cfg = weight_grad_ws.wgrad_ws_config(i_dim, j_dim, pg, wg_split=False)
        alt = weight_grad_ws.wgrad_ws_config(i_dim, j_dim, not pg, wg_split=False)
        split = weight_grad_ws.wgrad_ws_config(i_dim, j_dim, pg, wg_split=True)
        same(f"{name} WG_SPLIT", weight_grad_ws.wgrad_ws(pp, qq, tok, off, p_gather=pg, config=split),
             weight_grad_ws.wgrad_ws(pp, qq, tok, off, p_gather=pg, config=cfg))
        shape = f"{cfg['BLOCK_I']}x{cfg['BLOCK_J']}"
        alt_shape = f"{alt['BLOCK_I']}x{alt['BLOCK_J']}"
        p2, q2, pt = pb.view(r, -1), qb.view(r, -1), pb.transpose(1, 2).contiguous()
        out += [
            (f"{name} layer ({shape})", lambda pp=pp, qq=qq, pg=pg: weight_grad_ws.wgrad_ws(pp, qq, tok, off,
                                                                                          p_gather=pg), fl),
            (f"{name} output skipped", lambda pp=pp, qq=qq, pg=pg, c={**cfg, "PART": 1}: weight_grad_ws.wgrad_ws(
                pp, qq, tok, off, p_gather=pg, config=c), fl),
            (f"{name} warpgroups split", lambda pp=pp, qq=qq, pg=pg, c=split: weight_grad_ws.wgrad_ws(
                pp, qq, tok, off, p_gather=pg, config=c), fl),
            (f"{name} warpgroups split, output skipped", lambda pp=pp, qq=qq, pg=pg, c={**split, "PART": 1}:
             weight_grad_ws.wgrad_ws(pp, qq, tok, off, p_gather=pg, config=c), fl),
            (f"{name} tile {alt_shape}", lambda pp=pp, qq=qq, pg=pg, c=alt: weight_grad_ws.wgrad_ws(
                pp, qq, tok, off, p_gather=pg, config=c), fl),
            (f"{name} balanced contiguous ({shape})", lambda p2=p2, q2=q2, pg=pg: weight_grad_ws.wgrad_ws(
                p2, q2, itok, bal, p_gather=pg), fl),
            (f"{name} twin, P K-major", lambda pt=pt, qb=qb: torch.bmm(pt, qb), fl),
            (f"{name} twin, P MN-major", lambda pb=pb, qb=qb: torch.bmm(pb.transpose(1, 2), qb), fl),
        ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="32768,4096,1024,128,8")
    ap.add_argument("--kernels", default="up,dH,dW1,dW2",
                    help="any of up,dH,dW1,dW2,wg,wgsplit,upsplit,ftz,ring,chains,fence")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--window", type=float, default=1.5)
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-fence", action="store_true", help="time the kernels without the MMA warps' proxy fence "
                    "(drop_proxy_fence; outputs may be wrong)")
    args = ap.parse_args()
    if args.no_fence:
        drop_proxy_fence()
    its = items(args.shape, args.kernels.split(","))
    rows = measure_passes(Nvml(), its, args.passes, args.warmup, args.window, args.shape)
    write_rows(args.json, args.shape, rows)


if __name__ == "__main__":
    main()
