"""How much of an eager layer call's time is the host's: the same forward / forward+backward kernels timed
eagerly (do_bench on the autograd layer call, as ``sonicmoe bench`` does) and replayed from a CUDA graph (no
Python between kernels: the kernel-bound time), in alternating rounds (GPU only).

usage: python scripts/graph_bound.py [--shape T,d,n,E,K ...] [--rounds 5] [--profile] [--json FILE]

The graph holds the implementations the autograd Function calls (``experts_fwd_impl``, then
``experts_bwd_impl`` with every gradient asked for), captured after the eager warm-up has autotuned them.
``--profile``: cProfile of 20 eager forward+backward calls, the 40 functions with the most own time.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from host_overhead import enqueue_ms, layer_calls, profile_calls
from triton.testing import do_bench

from sonicmoe.bench.measure import graph_of
from sonicmoe.ops import library


def measure(spec: str, rounds: int, profile: bool) -> dict:
    p, routing, s_pair, leaves, fwd, fwd_bwd = layer_calls(spec)
    x, w1, w2 = p["x"], p["w1"], p["w2"]
    t, d = x.shape
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    fargs = (x, w1, w2, None, None, s_pair, *(getattr(routing, f) for f in library.FWD_ROUTING_FIELDS),
             "concat", True)
    for _ in range(3):
        fwd_bwd()  # autotunes every kernel eagerly first
    torch.cuda.synchronize()
    bwd_routing = [getattr(routing, f) for f in library.BWD_ROUTING_FIELDS]

    def impl_fwd():
        return library.experts_fwd_impl(*fargs)

    def impl_fwd_bwd():
        _, h = library.experts_fwd_impl(*fargs)
        return library.experts_bwd_impl(dout, x, w1, w2, None, None, h, s_pair, *bwd_routing, "concat",
                                        [True] * 6)

    with torch.no_grad():
        g_fwd, g_fb = graph_of(impl_fwd), graph_of(impl_fwd_bwd)
    modes = {"fwd eager": fwd, "fwd graph": g_fwd.replay, "fwd+bwd eager": fwd_bwd, "fwd+bwd graph": g_fb.replay}
    times = {m: [] for m in modes}
    for _ in range(rounds):
        for m, fn in modes.items():
            times[m].append(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    hosts = {m: enqueue_ms(fn) for m, fn in modes.items()}
    tk = routing.row_token.shape[0]
    n = w2.shape[2]
    flops = {"fwd": 6 * tk * n * d, "fwd+bwd": 18 * tk * n * d}
    out = {"shape": spec, "rounds": rounds, "modes": {}}
    for m, ts in times.items():
        med = statistics.median(ts)
        tf = flops[m.split()[0]] / med / 1e9
        out["modes"][m] = {"median_ms": med, "rounds_ms": ts, "tflops": tf, "host_enqueue_ms": hosts[m]}
        print(f"{spec} {m:14s} median {med:7.3f} ms  {tf:6.1f} TFLOP/s  host enqueue {hosts[m]:7.3f} ms  "
              f"rounds {' '.join(f'{v:.3f}' for v in ts)}")
    if profile:
        profile_calls(fwd_bwd, sort="tottime", limit=40)
    del g_fwd, g_fb
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = []
    for spec in args.shape or ["24576,1536,256,128,8"]:
        res.append(measure(spec, args.rounds, args.profile))
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": res}, f,
                      indent=1)


if __name__ == "__main__":
    main()
