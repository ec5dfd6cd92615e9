"""GPU benchmark of the shared expert (``MoE(shared_intermediate_size=n_s)``): what it adds to the layer, and its
kernels against a plain torch SwiGLU MLP (three cuBLAS GEMMs and autograd) of the same width.

For each shape (T, d, n, E, K, n_s), bf16, the triton backend, forward+backward (``bench_ms``: settled warm-up, 1 s
window, median), fresh random inputs:
- ``layer``: the MoE layer without a shared expert, then with one (ungated and gated);
- ``shared alone``: ``sonicmoe.experts`` on ``routing_dense(T)`` (what the layer runs), and the torch MLP;
- held activation memory after the forward (output excluded) of the shared expert alone, ours against torch's.
TFLOP/s count the shared expert's useful FLOPs, 6·T·d·n_s forward and 12·T·d·n_s backward.
The shared expert's output (ours) is checked against the float32 torch MLP (``shared_rel_err``; the bf16 torch MLP's
difference, ``shared_rel_err_vs_torch``, is reported beside it): after printing (and writing) every row the run exits
with status 1 if an error is over ``sonicmoe bench``'s bound for bf16 (:func:`sonicmoe.bench.measure.default_tol`,
2e-2) or NaN, naming the shape.

usage (GPU): PYTHONPATH=$PWD python scripts/shared_expert_bench.py [--shape T,d,n,E,K,n_s ...] [--json F]
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

from sonicmoe import MoE, experts, routing_dense
from sonicmoe.bench.measure import bench_ms, default_tol, fwdbwd_fn
from sonicmoe.testing import rel_err

# DeepSeek-V2-Lite's block at 16k tokens (d 2048, 64 experts of 1408, K 6, two shared: n_s 2816); Qwen1.5-MoE-A2.7B
# (60 experts of 1408, K 4, n_s 5632); the 7B shape with a shared expert of 4n
SHAPES = ("16384,2048,1408,64,6,2816", "16384,2048,1408,60,4,5632", "24576,1536,256,128,8,1024")


def _torch_mlp(x, w1, w2, n_s):
    h = F.linear(x, w1)
    return F.linear(F.silu(h[:, :n_s]) * h[:, n_s:], w2)


def _held_bytes(fn) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
    del out
    return held


def run_shape(spec: str) -> dict:
    t, d, n, e, k, n_s = (int(v) for v in spec.split(","))
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(t, d, device=dev, dtype=dt, requires_grad=True)
    dout = torch.randn(t, d, device=dev, dtype=dt)
    row = {"shape": spec, "T": t, "d": d, "n": n, "E": e, "K": k, "n_s": n_s}
    for name, kw in (("plain", {}), ("shared", {"shared_intermediate_size": n_s}),
                     ("shared_gated", {"shared_intermediate_size": n_s, "shared_expert_gate": True})):
        torch.manual_seed(0)
        layer = MoE(d, n, e, k, backend="triton", device=dev, dtype=dt, aux_loss_coef=0.0, **kw)
        row[f"layer_{name}_ms"] = bench_ms(fwdbwd_fn(lambda layer=layer: layer(x), [x, *layer.parameters()], dout),
                                           device=dev)["p50"]
        del layer
    se = MoE(d, n, e, k, shared_intermediate_size=n_s, device=dev, dtype=dt).shared_experts
    w1, w2 = se.gate_up_proj.detach().clone().requires_grad_(True), se.down_proj.detach().clone().requires_grad_(True)
    ones = torch.ones(t, device=dev)

    def ours():
        return experts(x, w1, w2, routing_dense(t, dev), ones, backend="triton")

    def theirs():
        return _torch_mlp(x, w1[0], w2[0], n_s)

    err = (ours().float() - theirs().float()).norm() / theirs().float().norm()
    row["shared_rel_err_vs_torch"] = float(err)
    with torch.no_grad():  # the float32 reference: the checked error
        ref = _torch_mlp(x.float(), w1[0].float(), w2[0].float(), n_s)
        row["shared_rel_err"] = rel_err(ours(), ref)
    del ref
    flops = 18.0 * t * d * n_s
    for name, fn in (("ours", ours), ("torch", theirs)):
        ms = bench_ms(fwdbwd_fn(fn, [x, w1, w2], dout), device=dev)["p50"]
        row[f"shared_{name}_ms"], row[f"shared_{name}_tflops"] = ms, flops / ms / 1e9
        row[f"shared_{name}_held_bytes"] = _held_bytes(fn)
    return row


def check_failures(rows: list[dict], tol: float) -> list[str]:
    """One line per shape whose shared expert's error against the float32 reference (``shared_rel_err``) is over
    ``tol`` or NaN; empty if all passed."""
    return [f"{r['shape']}: shared expert rel err {r['shared_rel_err']:.2e} over {tol:.1e}" for r in rows
            if not (math.isfinite(r["shared_rel_err"]) and r["shared_rel_err"] <= tol)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs="+", default=list(SHAPES), help="T,d,n,E,K,n_s")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    rows = []
    for spec in args.shape:  # the results file rewritten after each shape: a run cut short keeps what it finished
        rows.append(run_shape(spec))
        print(f"done {spec}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f,
                          indent=1)
    print("shape | layer ms (plain / shared / gated) | shared alone ms, TFLOP/s (ours / torch) | held MiB "
          "(ours / torch)")
    for r in rows:
        layer = " / ".join(f"{r[f'layer_{v}_ms']:.3f}" for v in ("plain", "shared", "shared_gated"))
        alone = " / ".join(f"{r[f'shared_{v}_ms']:.3f} ({r[f'shared_{v}_tflops']:.0f})" for v in ("ours", "torch"))
        held = " / ".join(f"{r[f'shared_{v}_held_bytes'] / 2**20:.0f}" for v in ("ours", "torch"))
        print(f"{r['shape']} | {layer} | {alone} | {held} | rel err {r['shared_rel_err']:.1e} (float32 ref), "
              f"{r['shared_rel_err_vs_torch']:.1e} (bf16 torch)")
    failed = check_failures(rows, default_tol(torch.bfloat16))  # after the table and the JSON: nothing is lost
    for line in failed:
        print(f"check FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
