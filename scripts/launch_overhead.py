"""Host (CPU) time per call of each Triton launcher on the 7B shape, against a no-op Triton launch and a
small torch op (GPU only). A launcher whose host time nears its GPU time makes the layer CPU-bound.

usage: python scripts/launch_overhead.py [--breakdown]

``--breakdown``: per launcher, where its host time goes (perf_counter around Triton's ``JITFunction.run``, the
CUDA launcher object, the TMA descriptor encoding and the C launch itself): the rest is the launcher's own Python.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict

import torch
import triton

import sonicmoe
from sonicmoe.ops import common
from sonicmoe.ops.aggregation import gather_sum
from sonicmoe.ops.dh import dh
from sonicmoe.ops.grouped_gemm import down_proj, varlen_m_gemm
from sonicmoe.ops.up_proj import up_proj
from sonicmoe.ops.weight_grad import varlen_k_gemm
from sonicmoe.testing import random_problem


@triton.jit
def _nop(x_ptr, n):
    pass


def host_us(fn, calls: int) -> float:
    """Best of three: host microseconds per call, calls queued without synchronising."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    torch.cuda.synchronize()
    return best * 1e6


class Timers:
    """perf_counter accumulators wrapped around Triton's launch path (installed by :meth:`install`)."""

    def __init__(self):
        self.total = defaultdict(float)

    def wrap(self, owner, attr: str, name: str) -> None:
        orig = getattr(owner, attr)
        total = self.total

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                total[name] += time.perf_counter() - t0

        setattr(owner, attr, timed)

    def install(self) -> None:
        from triton.backends.nvidia import driver as nv
        from triton.runtime import jit

        self.wrap(jit.JITFunction, "run", "JITFunction.run")
        self.wrap(nv.CudaLauncher, "__call__", "CudaLauncher")
        self.wrap(nv, "make_tensordesc_arg", "TMA encode")


def breakdown(ops: dict, calls: int = 50) -> None:
    """Host microseconds per call of each launcher, split into Triton's parts (nested: the launcher includes
    the TMA encode, which JITFunction.run includes)."""
    timers = Timers()
    timers.install()
    for name, fn in ops.items():
        fn()
        torch.cuda.synchronize()
        timers.total.clear()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        wall = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
        parts = {k: v / calls * 1e6 for k, v in timers.total.items()}
        own = wall - parts.get("JITFunction.run", 0.0)
        print(f"{name:12s} total {wall:7.1f} us | launcher Python {own:6.1f} | "
              + " | ".join(f"{k} {v:6.1f}" for k, v in sorted(parts.items())))


def main() -> None:
    t, d, n, e, k = 24576, 1536, 256, 128, 8
    p = random_problem(t, d, n, e, dtype=torch.bfloat16, device="cuda", seed=0)
    r = sonicmoe.router_topk(p["x"], p["router_weight"], k)
    routing = sonicmoe.routing_from_topk(r.topk_ids, e)
    s = r.topk_scores.reshape(-1).detach()
    s_row, s_slot = routing.row_scores(s).float(), routing.slot_scores(s).float()
    x, w1, w2 = p["x"], p["w1"], p["w2"]
    h, a = up_proj(x, w1, None, routing)
    y = down_proj(a, w2, None, routing)
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    dh_, _, _ = dh(dout, w2, h, s_row, routing)
    z = torch.empty(1, device="cuda")
    small = {"triton no-op": lambda: _nop[(1,)](z, 1), "torch.empty": lambda: torch.empty(1000, device="cuda"),
             "torch add": lambda: z + 1, "tma_descriptor": lambda: common.tma_descriptor(w1)}
    ops = {"up-proj": lambda: up_proj(x, w1, None, routing), "down-proj": lambda: down_proj(a, w2, None, routing),
           "aggregation": lambda: gather_sum(y, routing, s_slot), "dH": lambda: dh(dout, w2, h, s_row, routing),
           "dX~": lambda: varlen_m_gemm(dh_, w1, None, routing, transpose_b=False),
           "dW1": lambda: varlen_k_gemm(dh_, x, routing, p_gather=False, q_gather=True, out_dtype=w1.dtype)}
    if "--breakdown" in sys.argv:
        breakdown({"triton no-op": small["triton no-op"], **ops})
        return
    for name, fn in small.items():
        print(f"{name:16s} host {host_us(fn, 300):8.1f} us/call")
    for mode in ("1", "0"):
        os.environ["SONICMOE_AUTOTUNE"] = mode
        for name, fn in ops.items():
            print(f"{name:16s} host {host_us(fn, 30):8.1f} us/call  (SONICMOE_AUTOTUNE={mode})")


if __name__ == "__main__":
    main()
