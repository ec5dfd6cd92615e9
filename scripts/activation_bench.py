"""GPU benchmark of gpt-oss's clamped SwiGLU (``activation="clamped_swiglu"``) against SwiGLU on the expert path.

For each shape (T, d, n, E, K), bf16, top-k routing of the random router, fresh random inputs scaled so that part of H
passes the clamps (W1 times ``--w1-scale``, default 3: H's spread about 3):
- a check of O and the gradients of x, W1, W2 and the scores against the float32 reference on the first 1024 tokens
  (relative errors, per activation);
- forward+backward of ``sonicmoe.experts`` (``bench_ms``: settled warm-up, median), triton backend, each activation
  (on sm_90 both take the Gluon up-projection and dH kernels where they serve: ``SONICMOE_GLUON_CLAMPED=1``), the
  clamped one also with ``SONICMOE_GLUON_CLAMPED=0`` (the Triton kernels' epilogues:
  ``triton_clamped_swiglu_nogluon``), and the torch backend with the clamped activation; TFLOP/s at 18·T·K·n·d
  useful FLOPs (SPEC);
- the share of H's gate and up values that the clamps bind.

usage (GPU): PYTHONPATH=$PWD python scripts/activation_bench.py [--shape T,d,n,E,K ...] [--json F]
smoke run (CPU): TRITON_INTERPRET=1 python scripts/activation_bench.py --device cpu --dtype fp32 --shape 64,32,32,4,2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from unittest import mock

import torch
import triton

from sonicmoe import experts, experts_ref
from sonicmoe.bench.measure import bench_ms, fwdbwd_fn
from sonicmoe.bench.problem import make_problem
from sonicmoe.bench.shapes import parse_shape
from sonicmoe.ops import dh_ws, up_proj_ws
from sonicmoe.provenance import git_commit
from sonicmoe.reference import split_gate_up

# the 7B shape and gpt-oss-120b's (../shared/configs.json "models")
SHAPES = ("24576,1536,256,128,8", "32768,2880,2880,128,4")
ACTIVATIONS = ("swiglu", "clamped_swiglu")
# (result key, backend, activation, SONICMOE_GLUON_CLAMPED or None)
VARIANTS = (("triton_swiglu", "triton", "swiglu", None), ("triton_clamped_swiglu", "triton", "clamped_swiglu", "1"),
            ("triton_clamped_swiglu_nogluon", "triton", "clamped_swiglu", "0"),
            ("torch_clamped_swiglu", "torch", "clamped_swiglu", None))


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """:func:`sonicmoe.testing.rel_err` a slice of the leading dimension at a time (float64 copies of whole weight
    gradients do not fit beside the problem at gpt-oss's shape)."""
    num = den = 0.0
    for a, b in zip(out.split(1), ref.split(1)):
        a, b = a.double(), b.double()
        num += float((a - b).detach().square().sum())
        den += float(b.detach().square().sum())
    return (num / max(den, 1e-60)) ** 0.5


def _check(p, activation: str, rows: int = 1024) -> dict[str, float]:
    """Relative errors of O and the gradients on the first ``rows`` tokens against the float32 reference, whose H is
    rounded to the layer's dtype as the kernels store it (``experts_ref(h_dtype=)``: the clamped activation's gradient
    jumps at the clamps' bounds). With ``SONICMOE_GLUON_UP=all``: at 1024 tokens the experts have too few rows for the
    layer's rule to pick the Gluon up-projection on H100s, whose epilogue is then checked all the same."""
    with mock.patch.dict(os.environ, {"SONICMOE_GLUON_UP": "all"}):
        return _check_rows(p, activation, rows)


def _check_rows(p, activation: str, rows: int) -> dict[str, float]:
    q = p.head(rows)
    leaves = [q.x, q.w1, q.w2, q.pair_scores]
    for t in leaves:
        t.grad = None
    out = experts(q.x, q.w1, q.w2, q.routing, q.pair_scores, activation=activation, backend="triton")
    grads = torch.autograd.grad(out, leaves, q.dout)
    ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]
    ref = experts_ref(*ref_leaves[:3], q.routing, ref_leaves[3], activation=activation, h_dtype=q.dtype)
    ref_grads = torch.autograd.grad(ref, ref_leaves, q.dout.float())
    errs = {"out": _rel_err(out, ref)}
    errs.update({f"d{name}": _rel_err(g, r) for name, g, r in zip(("x", "w1", "w2", "s"), grads, ref_grads)})
    if not all(v < 2e-2 for v in errs.values()):
        raise SystemExit(f"{activation}: errors against the float32 reference too large: {errs}")
    return errs


def run_shape(spec: str, w1_scale: float, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    shape = parse_shape(spec)
    t, d, n, e, k = shape.dims
    p = make_problem(shape, dtype=dtype, device=device, seed=0)
    with torch.no_grad():
        p.w1.mul_(w1_scale)
    row = {"shape": spec, "T": t, "d": d, "n": n, "E": e, "K": k, "w1_scale": w1_scale}
    with torch.no_grad():
        h = p.x[:2048].float() @ p.w1[0].float().t()
        g, u = split_gate_up(h)
        row["share_gate_clamped"] = float((g > 7).float().mean())
        row["share_up_clamped"] = float((u.abs() > 7).float().mean())
    flops = 18 * t * k * n * d
    leaves = [p.x, p.w1, p.w2, p.pair_scores]
    for key, backend, act, switch in VARIANTS:
        with mock.patch.dict(os.environ, {} if switch is None else {"SONICMOE_GLUON_CLAMPED": switch}):
            if backend == "triton":
                row[f"{key}_errors"] = _check(p, act)

            def fwd(backend=backend, act=act):
                return experts(p.x, p.w1, p.w2, p.routing, p.pair_scores, backend=backend, activation=act)

            up_proj_ws._CALLS.clear()
            dh_ws._CALLS.clear()
            ms = bench_ms(fwdbwd_fn(fwd, leaves, p.dout), device=p.device)["p50"]
            # the Gluon kernels the timed runs took (none: the Triton kernels)
            row[f"{key}_gluon"] = {"up": up_proj_ws.up_ws_calls(), "dh": dh_ws.dh_ws_calls()}
        row[f"{key}_ms"] = ms
        row[f"{key}_tflops"] = flops / ms / 1e9
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="*", default=list(SHAPES), metavar="T,d,n,E,K")
    ap.add_argument("--w1-scale", type=float, default=3.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run under TRITON_INTERPRET=1")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
    result = {"device": name, "dtype": args.dtype, "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "commit": git_commit(), "rows": []}
    for spec in args.shape:
        row = run_shape(spec, args.w1_scale, args.device, dtype)
        result["rows"].append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    print(f"{'shape':26s} {'clamped %g/u':>12s} " + " ".join(f"{a:>20s}" for a in
                                                           ("swiglu ms/TF", "clamped ms/TF", "clamped no-Gluon",
                                                            "torch clamped")) + "  max err clamped")
    for r in result["rows"]:
        cells = [f"{r[f'{key}_ms']:7.3f} / {r[f'{key}_tflops']:4.0f}" for key, *_ in VARIANTS]
        err = max(r["triton_clamped_swiglu_errors"].values())
        print(f"{r['shape']:26s} {100 * r['share_gate_clamped']:5.1f}/{100 * r['share_up_clamped']:4.1f}% "
              + " ".join(f"{c:>20s}" for c in cells) + f"  {err:.2e}")


if __name__ == "__main__":
    main()
