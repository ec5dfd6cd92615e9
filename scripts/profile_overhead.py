"""GPU diagnostic: host (launch) overhead against kernel time, and the cost of each routing step.

For each shape and routing mode, prints
* ``issue ms``: host time to issue one call (perf_counter over 20 calls, no sync inside);
* ``bench ms``: ``triton.testing.do_bench`` median (what ``sonicmoe bench`` reports);
* ``graph ms``: ``triton.testing.do_bench_cudagraph`` median (kernel time, no host overhead);
for the experts' forward and forward+backward, then the routing steps (router, token rounding,
metadata) timed alone, and a profiler table of the token-rounding routing's kernels.

usage (GPU): PYTHONPATH=$PWD SONICMOE_AUTOTUNE=0 python scripts/profile_overhead.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

from sonicmoe import functional
from sonicmoe.bench.problem import make_problem
from sonicmoe.bench.shapes import Shape
from sonicmoe.routing import router_topk, routing_from_pairs, routing_from_topk
from sonicmoe.token_rounding import token_rounding

SHAPES = [Shape("7b", 24576, 1536, 256, 128, 8), Shape("tr-d1536-E512", 16384, 1536, 256, 512, 8),
          Shape("tr-d1536-E64", 16384, 1536, 256, 64, 8), Shape("tr-d4096-n1024-E256", 16384, 4096, 1024, 256, 4)]


def issue_ms(fn, n=20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / n


def graph_ms(fn) -> float | None:
    try:
        return do_bench_cudagraph(fn, rep=50)
    except Exception as exc:  # noqa: BLE001 - a diagnostic: report and go on
        print(f"  (cuda graph failed: {type(exc).__name__}: {str(exc)[:120]})")
        return None


def measure(shape: Shape, mode: str) -> dict:
    """One shape and routing mode: the experts' timings and the routing steps' (see the module doc)."""
    p = make_problem(shape, dtype=torch.bfloat16, device="cuda", mode=mode)
    leaves = [p.x, p.w1, p.w2, p.pair_scores]

    def fwd():
        return functional.experts(p.x, p.w1, p.w2, p.routing, p.pair_scores, backend="triton")

    def fwdbwd():
        for t in leaves:
            t.grad = None
        fwd().backward(p.dout)

    row = {"shape": shape.name, "routing": mode}
    for name, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        row[name] = {"issue_ms": issue_ms(fn), "bench_ms": do_bench(fn, return_mode="median"),
                     "graph_ms": graph_ms(fn)}
    x, w_r, K, E, T = p.x.detach(), p.router_weight.detach(), shape.K, shape.E, shape.T
    router = router_topk(x, w_r, K)
    steps = {"router_topk": lambda: router_topk(x, w_r, K),
             "routing_from_topk": lambda: routing_from_topk(router.topk_ids, E)}
    if mode == "token_rounding":
        tr = token_rounding(router, m_tile=128, warn=False)
        steps["token_rounding"] = lambda: token_rounding(router, m_tile=128, warn=False)
        steps["routing_from_pairs"] = lambda: routing_from_pairs(tr.pair_token, tr.pair_expert, T, E)
    row["routing_steps"] = {}
    with torch.no_grad():
        for name, fn in steps.items():
            row["routing_steps"][name] = {"issue_ms": issue_ms(fn), "bench_ms": do_bench(fn, return_mode="median")}
        if mode == "token_rounding" and shape.name == "tr-d1536-E512":
            acts = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(5):
                    token_rounding(router, m_tile=128, warn=False)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for shape in SHAPES:
        for mode in ("topk",) if shape.name == "7b" else ("topk", "token_rounding"):
            row = measure(shape, mode)
            rows.append(row)
            f, fb = row["fwd"], row["fwdbwd"]
            print(f"{shape.name:22s} {mode:15s} fwd issue {f['issue_ms']:.3f} bench {f['bench_ms']:.3f} graph "
                  f"{f['graph_ms'] or float('nan'):.3f} | f+b issue {fb['issue_ms']:.3f} bench {fb['bench_ms']:.3f} "
                  f"graph {fb['graph_ms'] or float('nan'):.3f}", flush=True)
            print("   routing: " + ", ".join(f"{k} {v['bench_ms']:.3f} (issue {v['issue_ms']:.3f})"
                                             for k, v in row["routing_steps"].items()), flush=True)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
