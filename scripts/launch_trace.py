"""GPU diagnostic: one forward + backward of a small MoE layer with every Triton launch logged and
synchronised, so a kernel that hangs or fails is named (its config included) before the process stalls.

usage (GPU): PYTHONPATH=$PWD SONICMOE_AUTOTUNE=0 timeout 120 python scripts/launch_trace.py [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import torch

import sonicmoe
from sonicmoe.ops import common


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--shape", default="384,256,128,8,2", help="T,d,n,E,K")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    t, d, n, e, k = (int(v) for v in args.shape.split(","))
    real_launch = common.launch

    def traced(kernel, tuned, grid, kargs, pinned, gpu_default, config=None, desc_blocks=None, flag_descs=None):
        name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
        print(f"launch {name} {config or gpu_default}", flush=True)
        t0 = time.perf_counter()
        real_launch(kernel, tuned, grid, kargs, pinned, gpu_default, config, desc_blocks, flag_descs)
        torch.cuda.synchronize()
        print(f"  done in {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)

    common.launch = traced
    for mod in ("up_proj", "grouped_gemm", "dh", "weight_grad", "aggregation"):
        module = __import__(f"sonicmoe.ops.{mod}", fromlist=["launch"])
        module.launch = traced
    torch.manual_seed(0)
    moe = sonicmoe.MoE(d, n, e, k, backend="triton").to("cuda", dtype)
    x = torch.randn(t, d, device="cuda", dtype=dtype, requires_grad=True)
    out = moe(x)
    out.float().square().mean().backward()
    torch.cuda.synchronize()
    print("ok", args.dtype, tuple(out.shape), flush=True)


if __name__ == "__main__":
    main()
