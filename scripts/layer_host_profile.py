"""Where the host time of one whole ``MoE`` layer call (router + routing + experts, forward + backward) goes (GPU).

usage: python scripts/layer_host_profile.py [--shape T,d,n,E,K] [--calls N] [--routing topk|token_rounding]

Prints the eager call's time, its host time to enqueue one call (no synchronisation) and its CUDA-graph replay time,
then the same layer (``return_router_info=True``) through ``torch.cuda.make_graphed_callables`` called eagerly (forward
and backward each one graph replay); then cProfile's top functions by own time and by cumulative time over N eager
calls, and torch's CPU-side operator table (self CPU time).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from sonicmoe import MoE
from sonicmoe.bench.measure import bench_ms, fwdbwd_fn, graph_of, host_ms
from sonicmoe.bench.shapes import parse_shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=parse_shape, default=parse_shape("24576,1536,256,128,8"))
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--routing", choices=("topk", "token_rounding"), default="topk")
    args = ap.parse_args()
    s = args.shape
    torch.manual_seed(0)
    m = MoE(s.d, s.n, s.E, s.K, backend="triton", aux_loss_coef=0.0, routing=args.routing)
    m = m.to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(s.T, s.d, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    dout = torch.randn_like(x)
    call = fwdbwd_fn(lambda: m(x), [x, *m.parameters()], dout)
    eager = bench_ms(call, device=x.device)["p50"]
    host = host_ms(call)
    graph = graph_of(call)
    replay = bench_ms(graph.replay, device=x.device)["p50"]
    del graph
    torch.manual_seed(0)
    gm = MoE(s.d, s.n, s.E, s.K, backend="triton", aux_loss_coef=0.0, routing=args.routing,
             return_router_info=True)
    gm = torch.cuda.make_graphed_callables(gm.to(device="cuda", dtype=torch.bfloat16), (x,))
    gcall = fwdbwd_fn(lambda: gm(x)[0], [x, *gm.parameters()], dout)
    graphed, graphed_host = bench_ms(gcall, device=x.device)["p50"], host_ms(gcall)
    print(f"{(s.T, s.d, s.n, s.E, s.K)} {args.routing}: eager {eager:.3f} ms, host {host:.3f} ms, "
          f"graph replay {replay:.3f} ms; make_graphed_callables {graphed:.3f} ms, host {graphed_host:.3f} ms")
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        print(f"--- cProfile, {args.calls} calls, by {key}")
        pstats.Stats(prof).sort_stats(key).print_stats(35)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        for _ in range(10):
            call()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
