"""Where the host time of one whole ``MoE`` layer call (router + routing + experts, forward + backward) goes (GPU).

usage: python scripts/layer_host_profile.py [--shape T,d,n,E,K] [--calls N] [--routing topk|token_rounding]
                                            [--sections-only]

Prints the eager call's time, its host time to enqueue one call (no synchronisation) and its CUDA-graph replay time,
then the same layer (``return_router_info=True``) through ``torch.cuda.make_graphed_callables`` called eagerly (forward
and backward each one graph replay); then cProfile's top functions by own time and by cumulative time over N eager
calls, and torch's CPU-side operator table (self CPU time).

Then (and alone with ``--sections-only``) each kernel's launch time through the fast path and the compiled
launcher's share of it, the host time of the forward alone and of forward + backward, and where it
goes with little probe overhead: every function of the ``sonicmoe`` package, and the forward and backward of its
autograd Functions, wrapped in a perf_counter timer (inclusive times, µs per call, with the calls per layer call).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import inspect
import pstats
import sys
import time

import torch

from sonicmoe import MoE
from sonicmoe.bench.measure import bench_ms, fwdbwd_fn, graph_of, host_ms
from sonicmoe.bench.shapes import parse_shape


def _instrument() -> dict[str, list]:
    """Wrap every function defined in a loaded ``sonicmoe`` module (in each module namespace that holds it) and the
    static forward/backward of its autograd Functions in an inclusive perf_counter timer; returns the live totals,
    name -> [calls, seconds]."""
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    wrappers: dict[int, object] = {}

    def wrap(name, f):
        if id(f) not in wrappers:
            @functools.wraps(f)
            def timed(*a, **k):
                t = time.perf_counter()
                try:
                    return f(*a, **k)
                finally:
                    entry = totals[name]
                    entry[0] += 1
                    entry[1] += time.perf_counter() - t
            wrappers[id(f)] = timed
            wrappers[id(timed)] = timed
        return wrappers[id(f)]

    done = set()
    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("sonicmoe") or modname == __name__:
            continue
        for attr, v in list(vars(mod).items()):
            if inspect.isfunction(v) and (v.__module__ or "").startswith("sonicmoe"):
                setattr(mod, attr, wrap(f"{v.__module__}.{v.__qualname__}", v))
            elif (inspect.isclass(v) and issubclass(v, torch.autograd.Function) and v not in done
                  and v.__module__.startswith("sonicmoe")):
                done.add(v)
                for meth in ("forward", "backward"):
                    f = v.__dict__.get(meth)
                    if isinstance(f, staticmethod):
                        setattr(v, meth, staticmethod(wrap(f"{v.__module__}.{v.__qualname__}.{meth}", f.__func__)))
    return totals


def sections(m: torch.nn.Module, x: torch.Tensor, dout: torch.Tensor, calls: int) -> None:
    """The forward's and forward + backward's host times, then the instrumented breakdown (see the module doc)."""
    fwd = lambda: m(x)  # noqa: E731
    call = fwdbwd_fn(fwd, [x, *m.parameters()], dout)
    print(f"host ms per call: forward {host_ms(fwd):.3f}, forward+backward {host_ms(call):.3f} (uninstrumented)")
    totals = _instrument()
    host_ms(call)  # warm the wrappers
    totals.clear()
    wall = host_ms(call, calls) * 1e3
    runs = calls + 3  # host_ms's three warm calls are instrumented too
    print(f"--- instrumented: {wall:.0f} µs host per forward+backward; inclusive µs per call (calls per call)")
    for name, (n, sec) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:60]:
        print(f"{sec * 1e6 / runs:9.1f}  {n / runs:6.1f}  {name}")


def launches(m: torch.nn.Module, x: torch.Tensor, dout: torch.Tensor, calls: int) -> None:
    """Per kernel: the fast path's launches per layer call, its µs each, the compiled launcher's (CudaLauncher)
    µs each inside it, Triton's own path (JITFunction.run) when taken, and the fast path's cached keys."""
    from triton.backends.nvidia import driver as nv_driver
    from triton.runtime.jit import JITFunction

    from sonicmoe.ops import fast_launch

    call = fwdbwd_fn(lambda: m(x), [x, *m.parameters()], dout)
    host_ms(call)
    stats: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0, 0.0])
    current = [None]

    def timer(orig, slot, count_slot=None):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                if current[0] is not None:
                    e = stats[current[0]]
                    e[slot] += time.perf_counter() - t
                    if count_slot is not None:
                        e[count_slot] += 1
        return timed

    fast = fast_launch.launch_kernel

    def launch(kernel, grid, *a, **k):
        fn = kernel
        while not isinstance(fn, JITFunction) and hasattr(fn, "fn"):
            fn = fn.fn
        current[0] = getattr(fn, "__name__", str(fn))
        t = time.perf_counter()
        try:
            return fast(kernel, grid, *a, **k)
        finally:
            e = stats[current[0]]
            e[0] += 1
            e[1] += time.perf_counter() - t
            current[0] = None

    patched = [(nv_driver.CudaLauncher, "__call__", nv_driver.CudaLauncher.__call__),
               (JITFunction, "run", JITFunction.run)]
    nv_driver.CudaLauncher.__call__ = timer(patched[0][2], 2)
    JITFunction.run = timer(patched[1][2], 4, 3)
    users = [mod for mod in list(sys.modules.values())
             if getattr(mod, "__name__", "").startswith("sonicmoe") and getattr(mod, "launch_kernel", None) is fast]
    for mod in users:
        mod.launch_kernel = launch
    host_ms(call)
    stats.clear()
    for _ in range(calls):
        call()
    if x.is_cuda:
        torch.cuda.synchronize()
    print(f"--- launches per layer call ({calls} calls): kernel, launches, µs each (fast path incl.), "
          "CudaLauncher µs each, Triton-path runs, their µs each, cached keys")
    keys = {e.fn.__name__: len(e.kernels) for e in fast_launch._LAUNCHES.values()}
    for name, (n, tot, run, slow, slow_t) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:40s} {n / calls:5.1f} {tot * 1e6 / max(n, 1):8.1f} {run * 1e6 / max(n, 1):8.1f} "
              f"{slow / calls:5.1f} {slow_t * 1e6 / max(slow, 1):8.1f} {keys.get(name, '-')}")
    for owner, attr, orig in patched:
        setattr(owner, attr, orig)
    for mod in users:
        mod.launch_kernel = fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=parse_shape, default=parse_shape("24576,1536,256,128,8"))
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--routing", choices=("topk", "token_rounding"), default="topk")
    ap.add_argument("--sections-only", action="store_true",
                    help="only the per-kernel launch times, the host times and the instrumented breakdown")
    args = ap.parse_args()
    s = args.shape
    torch.manual_seed(0)
    m = MoE(s.d, s.n, s.E, s.K, backend="triton", aux_loss_coef=0.0, routing=args.routing)
    m = m.to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(s.T, s.d, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    dout = torch.randn_like(x)
    if args.sections_only:
        launches(m, x, dout, args.calls)
        sections(m, x, dout, args.calls)
        return
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
    sections(m, x, dout, args.calls)


if __name__ == "__main__":
    main()
