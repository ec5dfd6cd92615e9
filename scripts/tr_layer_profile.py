"""GPU diagnostic: every GPU kernel of router + routing + experts, forward+backward, under top-k and under static
token rounding, side by side (mean µs per call from the torch profiler), so that what token rounding adds or saves
shows kernel by kernel. Kernels are matched by name; a name that runs under one routing only shows "-" for the other.

usage (GPU): PYTHONPATH=$PWD python scripts/tr_layer_profile.py [--shape T,d,n,E,K ...] [--calls 20]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib

import torch
from triton.testing import do_bench

from sonicmoe.bench.measure import fwdbwd_fn
from sonicmoe.testing import random_problem


def _load(name: str):
    """A sibling script as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["16384,1536,256,512,8", "24576,1536,256,128,8"])
    ap.add_argument("--m-tile", type=int, default=128)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=40, help="rows printed per shape (largest |difference| first)")
    args = ap.parse_args()
    profile = _load("layer_profile").profile
    layer_fn = _load("tr_sync_probe").layer_fn
    for spec in args.shape:
        t, d, n, e, k = (int(v) for v in spec.split(","))
        p = random_problem(t, d, n, e, dtype=torch.bfloat16, device="cuda", seed=0)
        leaves = [p[name].detach().requires_grad_(True) for name in ("x", "router_weight", "w1", "w2")]
        x, wr, w1, w2 = leaves
        dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        tables, totals = {}, {}
        for name, mode, static in (("topk", "topk", False), ("tr", "token_rounding", True)):
            layer = layer_fn(x, wr, w1, w2, k, mode, args.m_tile, static)

            step = fwdbwd_fn(layer, leaves, dout)
            ms = do_bench(step, warmup=100, rep=200, return_mode="median")  # triton's default is the mean
            rows, span = profile(step, args.calls)
            tables[name] = {row[0]: row[1:] for row in rows}
            totals[name] = (ms * 1e3, span, sum(us for _, us, _ in rows))
        print(f"== {spec}: fwd+bwd do_bench top-k {totals['topk'][0]:.0f} us, token rounding {totals['tr'][0]:.0f} us; "
              f"profiler span {totals['topk'][1]:.0f} / {totals['tr'][1]:.0f} us; kernels busy "
              f"{totals['topk'][2]:.0f} / {totals['tr'][2]:.0f} us", flush=True)
        names = set(tables["topk"]) | set(tables["tr"])

        def us(name, which, tables=tables):
            return tables[which].get(name, (0.0, 0))[0]

        order = sorted(names, key=lambda nm: -abs(us(nm, "tr") - us(nm, "topk")))
        print(f"  {'top-k us':>9} {'TR us':>9} {'TR-topk':>9}  kernel (launches top-k/TR)")
        for nm in order[: args.top]:
            a, b = tables["topk"].get(nm), tables["tr"].get(nm)
            fa = f"{a[0]:9.1f}" if a else f"{'-':>9}"
            fb = f"{b[0]:9.1f}" if b else f"{'-':>9}"
            la, lb = (a[1] if a else 0), (b[1] if b else 0)
            print(f"  {fa} {fb} {us(nm, 'tr') - us(nm, 'topk'):9.1f}  ({la}/{lb}) {nm[:100]}", flush=True)


if __name__ == "__main__":
    main()
