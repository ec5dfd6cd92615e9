"""The whole ``MoE`` layer (router + experts) under each router order, and the router alone, on one GPU.

usage: python benchmarks/router_orders.py [--shape T,d,n,E,K ...] [--rounds R] [--json OUT]

For every shape, alternating rounds over the orders ``topk_then_softmax`` (SonicMoE), ``softmax_then_topk``
with renormalisation (Qwen3) and ``sigmoid_then_topk`` with renormalisation, routed_scaling_factor 2.5 and a
nonzero ``e_score_correction_bias`` (DeepSeek-V3), each timed with :func:`sonicmoe.bench.measure.bench_ms`
(do_bench median after the settled warm-up; fresh leaves' gradients reset each call):

* the layer's forward + backward in bf16 on the Triton backend (useful FLOPs 18·TK·n·d, SPEC §6: TFLOP/s);
* the router alone (:func:`sonicmoe.routing.router_topk` forward + backward of the scores: the logits GEMM and the
  fused top-k kernel).

Every order's layer output is first checked against the float32 reference (:func:`sonicmoe.reference.moe_ref` with
the same options) by relative error. The table is printed last; ``--json`` writes every number.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from sonicmoe import MoE
from sonicmoe.bench.measure import bench_ms, fwdbwd_fn
from sonicmoe.reference import moe_ref
from sonicmoe.routing import router_topk
from sonicmoe.testing import rel_err

ORDERS = {
    "topk_then_softmax": {"router_order": "topk_then_softmax"},
    "softmax_then_topk+renorm": {"router_order": "softmax_then_topk", "renormalize": True},
    "sigmoid_then_topk+renorm+2.5+bias": {"router_order": "sigmoid_then_topk", "renormalize": True,
                                          "routed_scaling_factor": 2.5},
}


def _shape(text: str) -> tuple[int, int, int, int, int]:
    try:
        t, d, n, e, k = (int(v) for v in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected T,d,n,E,K (five integers), got {text!r}") from err
    return t, d, n, e, k


def _layer(shape, options: dict, device) -> MoE:
    t, d, n, e, k = shape
    torch.manual_seed(0)
    m = MoE(d, n, e, k, backend="triton", aux_loss_coef=0.0, **options).to(device=device, dtype=torch.bfloat16)
    if m.e_score_correction_bias is not None:
        m.e_score_correction_bias.copy_(torch.randn(e, device=device) * 0.02)
    return m


def _check(m: MoE, x: torch.Tensor) -> float:
    c, ex = m.config, m.experts
    with torch.no_grad():
        out = m(x)
        ref = moe_ref(x.float(), m.gate.weight.float(), ex.gate_up_proj.float(), ex.down_proj.float(),
                      top_k=c.top_k, router_order=c.router_order, renormalize=c.renormalize,
                      expert_bias=m.e_score_correction_bias, routed_scaling_factor=c.routed_scaling_factor)[0]
    return rel_err(out, ref)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=_shape, action="append", default=[], metavar="T,d,n,E,K")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    shapes = args.shape or [(24576, 1536, 256, 128, 8)]
    device = torch.device("cuda")
    results = []
    for shape in shapes:
        t, d, n, e, k = shape
        flops = 18 * t * k * n * d
        x = torch.randn(t, d, device=device, dtype=torch.bfloat16)
        dout = torch.randn(t, d, device=device, dtype=torch.bfloat16)
        layers = {name: _layer(shape, opts, device) for name, opts in ORDERS.items()}
        row = {"shape": list(shape), "useful_flops": flops, "orders": {}}
        for name, m in layers.items():
            row["orders"][name] = {"check_rel_err": _check(m, x[:4096]), "layer_ms": [], "router_ms": []}
        leaf = x.detach().clone().requires_grad_(True)
        dscores = torch.randn(t, k, device=device)
        for _ in range(args.rounds):
            for name, m in layers.items():
                leaves = [leaf, *m.parameters()]
                layer = bench_ms(fwdbwd_fn(lambda m=m, leaf=leaf: m(leaf), leaves, dout), device=device)
                c = m.config

                def router(m=m, c=c, leaf=leaf):
                    return router_topk(leaf, m.gate.weight, c.top_k, router_order=c.router_order,
                                       renormalize=c.renormalize, expert_bias=m.e_score_correction_bias).topk_scores
                routed = bench_ms(fwdbwd_fn(router, [leaf, m.gate.weight], dscores), device=device)
                row["orders"][name]["layer_ms"].append(layer["p50"])
                row["orders"][name]["router_ms"].append(routed["p50"])
        for v in row["orders"].values():
            v["layer_ms_median"] = statistics.median(v["layer_ms"])
            v["router_ms_median"] = statistics.median(v["router_ms"])
            v["tflops"] = flops / v["layer_ms_median"] / 1e9
        results.append(row)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": args.rounds,
            "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)
    print(f"device: {meta['device']}; medians of {args.rounds} alternating rounds (bf16, triton backend)")
    print("| shape | router order | check rel err | layer fwd+bwd ms | TFLOP/s | router fwd+bwd ms |")
    print("|---|---|---|---|---|---|")
    for row in results:
        for name, v in row["orders"].items():
            print(f"| {tuple(row['shape'])} | {name} | {v['check_rel_err']:.2e} | {v['layer_ms_median']:.3f} | "
                  f"{v['tflops']:.1f} | {v['router_ms_median']:.3f} |")


if __name__ == "__main__":
    main()
