"""The whole ``MoE`` layer (router + experts) under each router order, and the router alone, on one GPU.

usage: python benchmarks/router_orders.py [--shape T,d,n,E,K ...] [--rounds R] [--graph] [--aux-loss-coef C]
                                          [--routing topk|token_rounding] [--json OUT]

For every shape, alternating rounds over the orders ``topk_then_softmax`` (SonicMoE), ``softmax_then_topk``
with renormalisation (Qwen3) and ``sigmoid_then_topk`` with renormalisation, routed_scaling_factor 2.5 and a
nonzero ``e_score_correction_bias`` (DeepSeek-V3), the same with group-limited routing (E/16 groups of 16 experts,
4 kept; DeepSeek-V3 has 8 groups of 32), each timed with :func:`sonicmoe.bench.measure.bench_ms`
(do_bench median after the settled warm-up; fresh leaves' gradients reset each call):

* the layer's forward + backward in bf16 on the Triton backend (useful FLOPs 18·TK·n·d, SPEC §6: TFLOP/s; TK the
  pairs the layer routed, ``pairs``: T·K under top-k, token rounding's rounded count under it);
* the router alone (:func:`sonicmoe.routing.router_topk` forward + backward of the scores: the logits GEMM and the
  fused top-k kernel).

``--graph`` adds, for both, the host time to enqueue one call (no synchronisation) and the time of the call replayed
from a CUDA graph (no Python between kernels: what the GPU needs). An eager time well above the graph's, with a host
time close to the eager time, is host-bound.

``--routing token_rounding`` times the layers in training mode under token rounding (SPEC §5, ``m_tile`` 128, the
default subroutine) instead of top-k; the group-limited order is left out (token rounding needs n_group = 1), and the
check below runs in eval mode, i.e. on top-k.

Every order's layer output is first checked against the float32 reference (:func:`sonicmoe.reference.moe_ref` with
the same options) by relative error. The table is printed last; ``--json`` writes every number. The run then exits
with status 1 if any order's error is over ``sonicmoe bench``'s bound for bf16
(:func:`sonicmoe.bench.measure.default_tol`, 2e-2; the measured errors are about 4e-3) or NaN, naming each.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch

from sonicmoe import MoE
from sonicmoe.bench.measure import bench_ms, default_tol, fwdbwd_fn, graph_of, host_ms
from sonicmoe.bench.shapes import parse_shape
from sonicmoe.reference import moe_ref
from sonicmoe.routing import router_topk
from sonicmoe.testing import rel_err

ORDERS = {
    "topk_then_softmax": {"router_order": "topk_then_softmax"},
    "softmax_then_topk+renorm": {"router_order": "softmax_then_topk", "renormalize": True},
    "sigmoid_then_topk+renorm+2.5+bias": {"router_order": "sigmoid_then_topk", "renormalize": True,
                                          "routed_scaling_factor": 2.5},
    "sigmoid+renorm+2.5+bias+groups": {"router_order": "sigmoid_then_topk", "renormalize": True,
                                       "routed_scaling_factor": 2.5, "experts_per_group": 16, "topk_group": 4},
}


SERIES = ("layer_ms", "router_ms", "layer_host_ms", "router_host_ms", "layer_graph_ms", "router_graph_ms")


def _shape(text: str) -> tuple[int, int, int, int, int]:
    """(T, d, n, E, K) from ``T,d,n,E,K`` (:func:`sonicmoe.bench.shapes.parse_shape`, the bench CLI's parser)."""
    try:
        s = parse_shape(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return s.T, s.d, s.n, s.E, s.K


def _layer(shape, options: dict, device, aux_loss_coef: float = 0.0, routing: str = "topk") -> MoE:
    t, d, n, e, k = shape
    torch.manual_seed(0)
    if "experts_per_group" in options:  # group-limited routing, n_group = E / experts_per_group (DeepSeek-V3: 256/32)
        options = dict(options)
        n_group = max(e // options.pop("experts_per_group"), 1)
        options.update(n_group=n_group, topk_group=min(options["topk_group"], n_group))
    m = MoE(d, n, e, k, backend="triton", aux_loss_coef=aux_loss_coef, routing=routing, **options)
    m = m.to(device=device, dtype=torch.bfloat16)
    if m.e_score_correction_bias is not None:
        m.e_score_correction_bias.copy_(torch.randn(e, device=device) * 0.02)
    return m


def routed_pairs(m: MoE) -> int:
    """The (token, expert) pairs the layer's last forward routed (SPEC §1's TK): T·K under top-k, the rounded count
    under token rounding (padding pairs of the static form not counted). A host read: call it outside a timing."""
    return int(m.expert_counts.sum())


def summarise(row: dict, shape, graph: bool) -> None:
    """Each order's medians over the rounds, its useful FLOPs 18·TK·n·d (SPEC §6) with TK the pairs its layer routed
    (``pairs``, :func:`routed_pairs`) and its TFLOP/s (eager, and replayed from a CUDA graph with ``graph``)."""
    _, d, n, _, _ = shape
    for v in row["orders"].values():
        for key in SERIES:
            if v[key]:
                v[f"{key}_median"] = statistics.median(v[key])
        v["useful_flops"] = 18 * v["pairs"] * n * d
        v["tflops"] = v["useful_flops"] / v["layer_ms_median"] / 1e9
        if graph:
            v["tflops_graph"] = v["useful_flops"] / v["layer_graph_ms_median"] / 1e9


def _check(m: MoE, x: torch.Tensor) -> float:
    c, ex = m.config, m.experts
    with torch.no_grad():
        m.eval()  # top-k (token rounding is a training-mode routing)
        out = m(x)
        m.train()
        ref = moe_ref(x.float(), m.gate.weight.float(), ex.gate_up_proj.float(), ex.down_proj.float(),
                      top_k=c.top_k, router_order=c.router_order, renormalize=c.renormalize,
                      expert_bias=m.e_score_correction_bias, routed_scaling_factor=c.routed_scaling_factor,
                      n_group=c.n_group, topk_group=c.topk_group)[0]
    return rel_err(out, ref)


def check_failures(results: list[dict], tol: float) -> list[str]:
    """One line per order whose check error (``check_rel_err``) is over ``tol`` or NaN; empty if all passed."""
    return [f"{tuple(row['shape'])} {name}: check rel err {v['check_rel_err']:.2e} over {tol:.1e}"
            for row in results for name, v in row["orders"].items()
            if not (math.isfinite(v["check_rel_err"]) and v["check_rel_err"] <= tol)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=_shape, action="append", default=[], metavar="T,d,n,E,K")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--aux-loss-coef", type=float, default=0.0,
                   help="the layers' aux_loss_coef (default 0: the balance loss is not computed; the library's "
                        "default is 0.01). The timed backward starts from the output only, as before")
    p.add_argument("--graph", action="store_true",
                   help="also each call's host time (enqueue, no sync) and its time replayed from a CUDA graph "
                        "(the GPU-bound time: no Python between kernels)")
    p.add_argument("--routing", choices=("topk", "token_rounding"), default="topk",
                   help="the layers' routing in the timed calls (token_rounding: training mode, no group-limited "
                        "order)")
    args = p.parse_args()
    shapes = args.shape or [(24576, 1536, 256, 128, 8)]
    device = torch.device("cuda")
    results = []
    for shape in shapes:
        t, d, n, e, k = shape
        x = torch.randn(t, d, device=device, dtype=torch.bfloat16)
        dout = torch.randn(t, d, device=device, dtype=torch.bfloat16)
        layers = {name: _layer(shape, opts, device, args.aux_loss_coef, args.routing) for name, opts in ORDERS.items()
                  if args.routing == "topk" or "experts_per_group" not in opts}
        row = {"shape": list(shape), "orders": {}}
        for name, m in layers.items():
            row["orders"][name] = {"check_rel_err": _check(m, x[:4096]), **{key: [] for key in SERIES}}
        leaf = x.detach().clone().requires_grad_(True)
        dscores = torch.randn(t, k, device=device)
        for _ in range(args.rounds):
            for name, m in layers.items():
                leaves = [leaf, *m.parameters()]

                def forward(m=m, leaf=leaf):
                    out = m(leaf)
                    # timed from the output alone: drop the losses, whose autograd graph (and the leaves' gradient
                    # accumulators) would outlive the call and tie a CUDA-graph capture to the default stream
                    m.aux_loss = m.z_loss = None
                    return out
                layer_call = fwdbwd_fn(forward, leaves, dout)
                c = m.config

                def router(m=m, c=c, leaf=leaf):
                    return router_topk(leaf, m.gate.weight, c.top_k, router_order=c.router_order,
                                       renormalize=c.renormalize, expert_bias=m.e_score_correction_bias,
                                       n_group=c.n_group, topk_group=c.topk_group).topk_scores
                router_call = fwdbwd_fn(router, [leaf, m.gate.weight], dscores)
                v = row["orders"][name]
                v["layer_ms"].append(bench_ms(layer_call, device=device)["p50"])
                v["pairs"] = routed_pairs(m)  # the timed calls' TK (the same each call: fixed x, nearest rounding)
                v["router_ms"].append(bench_ms(router_call, device=device)["p50"])
                if args.graph:
                    v["layer_host_ms"].append(host_ms(layer_call))
                    v["router_host_ms"].append(host_ms(router_call))
                    for key, call in (("layer_graph_ms", layer_call), ("router_graph_ms", router_call)):
                        graph = graph_of(call)
                        v[key].append(bench_ms(graph.replay, device=device)["p50"])
                        del graph
        summarise(row, shape, args.graph)
        results.append(row)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": args.rounds,
            "graph": args.graph, "routing": args.routing, "aux_loss_coef": args.aux_loss_coef,
            "check_tol": default_tol(torch.bfloat16), "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)
    print(f"device: {meta['device']}; medians of {args.rounds} alternating rounds (bf16, triton backend, "
          f"aux_loss_coef {args.aux_loss_coef}, routing {args.routing})")
    cols = ["check rel err", "layer fwd+bwd ms", "TFLOP/s", "router fwd+bwd ms"]
    if args.graph:
        cols += ["layer host ms", "layer graph ms", "graph TFLOP/s", "router host ms", "router graph ms"]
    print("| shape | router order | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    for row in results:
        for name, v in row["orders"].items():
            cells = [f"{v['check_rel_err']:.2e}", f"{v['layer_ms_median']:.3f}", f"{v['tflops']:.1f}",
                     f"{v['router_ms_median']:.3f}"]
            if args.graph:
                cells += [f"{v['layer_host_ms_median']:.3f}", f"{v['layer_graph_ms_median']:.3f}",
                          f"{v['tflops_graph']:.1f}", f"{v['router_host_ms_median']:.3f}",
                          f"{v['router_graph_ms_median']:.3f}"]
            print(f"| {tuple(row['shape'])} | {name} | " + " | ".join(cells) + " |")
    failed = check_failures(results, meta["check_tol"])  # after the table and the JSON: nothing is lost
    for line in failed:
        print(f"check FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
