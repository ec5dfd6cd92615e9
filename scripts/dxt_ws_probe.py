"""The dX̃ GEMM (dX̃ = dH W1[e], varlen-M, B not transposed) on the Gluon ping-pong kernel against the Triton one.

usage: python scripts/dxt_ws_probe.py [--shape T,d,n,E,K ...] [--configs BN:STAGES,...] [--form dxt|down]
           [--rounds 5] [--json F]

``--form down`` probes the down-projection form (Y = A W2[e]ᵀ, k = n) instead.

On sm_90 the layer runs dX̃ on the ping-pong kernel of ``grouped_gemm_ws`` where it applies (``default``; the
Triton kernel with ``SONICMOE_GLUON_DXT=0``). This probe runs ``ws_varlen_m_gemm(transpose_b=False)``
with explicit configs (B[e]'s k × BLOCK_N block resident: k = 2n up to 512), checks its output bitwise against
the Triton kernel's and by relative error against the float32 per-expert reference, and times both in
alternating rounds on the same inputs (do_bench medians); ``default`` is what varlen_m_gemm picks now. GPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from triton.testing import do_bench

import sonicmoe
from sonicmoe.ops import grouped_gemm_ws as ws
from sonicmoe.ops.grouped_gemm import varlen_m_gemm, varlen_m_gemm_ref
from sonicmoe.testing import random_problem


def with_env(name: str, value: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the environment variable ``name`` set to ``value`` (restored afterwards)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn(*args, **kwargs)
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old


def triton_dxt(dh_, w1, routing, transpose_b: bool = False):
    """dX̃ (or, ``transpose_b``, the down-projection) on the Triton kernel as the layer ran it before (pinned/autotuned
    config): SONICMOE_GLUON_DXT=0 (SONICMOE_GLUON=0)."""
    switch = "SONICMOE_GLUON" if transpose_b else "SONICMOE_GLUON_DXT"
    return with_env(switch, "0", varlen_m_gemm, dh_, w1, None, routing, transpose_b=transpose_b)


def probe_shape(shape: str, configs: list[dict], rounds: int, form: str = "dxt") -> list[dict]:
    """The check and timing rows of one shape (printed as they come)."""
    t, d, n, e, k = (int(v) for v in shape.split(","))
    p = random_problem(t, d, n, e, device="cuda", dtype=torch.bfloat16, seed=0)
    router = sonicmoe.router_topk(p["x"], p["router_weight"], k)
    routing = sonicmoe.routing_from_topk(router.topk_ids, e)
    r = routing.num_rows
    tb = form == "down"
    width = n if tb else 2 * n  # the reduction: A (R, n) and W2 (E, d, n), or dH (R, 2n) and W1 (E, 2n, d)
    a = torch.randn(r, width, device="cuda", dtype=torch.bfloat16)
    b = p["w2"] if tb else p["w1"]
    flops = 2 * r * width * d
    ref = varlen_m_gemm_ref(a, b, None, routing, transpose_b=tb).float()
    fns = {"triton": lambda: triton_dxt(a, b, routing, tb),
           "default": lambda: varlen_m_gemm(a, b, None, routing, transpose_b=tb)}
    for cfg in configs:
        fns[f"gluon BN={cfg['BLOCK_N']} S={cfg['STAGES']}"] = (
            lambda cfg=cfg: ws.ws_varlen_m_gemm(a, b, None, routing.expert_offsets, transpose_b=tb, config=cfg))
    base = fns["triton"]()
    checks = {}
    for name, fn in fns.items():
        out = fn()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        checks[name] = {"same_bits_as_triton": torch.equal(out, base), "rel_err": err,
                        "deterministic": torch.equal(out, fn())}
        print(f"{shape} {name:<22} check {checks[name]}", flush=True)
    return timing_rows(shape, fns, checks, flops, rounds)


def timing_rows(shape: str, fns: dict, checks: dict, flops: int, rounds: int, width: int = 22) -> list[dict]:
    """Each of ``fns`` timed in ``rounds`` alternating rounds (do_bench medians, every call in turn within a
    round): one row per name with the median ms, TFLOP/s of ``flops``, the rounds and ``checks[name]`` (printed)."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    rows = []
    for name, ts in times.items():
        ms = statistics.median(ts)
        rows.append({"shape": [int(v) for v in shape.split(",")], "kernel": name, "ms": ms,
                     "tflops": flops / ms / 1e9, "rounds": ts, **checks[name]})
        print(f"{shape} {name:<{width}} {ms:.4f} ms {rows[-1]['tflops']:6.1f} TFLOP/s {[round(x, 4) for x in ts]}",
              flush=True)
    return rows


def probe_shapes(shapes: list[str] | None, probe, json_path: str | None) -> dict:
    """``probe(shape)`` (a list of result rows) for each shape (default: the 7B shape), the GPU's memory cache emptied
    between shapes; the rows with the device and torch version, also written to ``json_path`` if given."""
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": []}
    for shape in shapes or ["24576,1536,256,128,8"]:
        res["results"] += probe(shape)
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--configs", default="128:8,128:6")
    ap.add_argument("--form", choices=("dxt", "down"), default="dxt")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    configs = []
    for c in args.configs.split(","):
        bn, stages = map(int, c.split(":"))
        configs.append({"BLOCK_N": bn, "STAGES": stages})
    probe_shapes(args.shape, lambda shape: probe_shape(shape, configs, args.rounds, args.form), args.json)


if __name__ == "__main__":
    main()
