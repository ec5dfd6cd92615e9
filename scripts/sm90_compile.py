"""Compile kernels for Hopper (sm_90) on a machine without a GPU: Triton's NVIDIA backend (its bundled ptxas) behind
a stand-in driver that names an sm_90 target, with each launch replaced by ``warmup`` (compile only). It catches what
only a native compile finds (a Gluon kernel's type errors, layouts, shared memory over the limit) before a GPU is
lent; it runs nothing, so it says nothing of the results.

usage: python scripts/sm90_compile.py [--what wgrad] [--json F]

``wgrad``: the warp-specialised weight-gradient kernel (sonicmoe/ops/weight_grad_ws.py) in every config form
(default, the tile's right half through a ring slot, the two MMA warpgroups split with and without SWAP_AB) for dW1
and dW2, each in expert order and in load order with the serpentine schedule.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import driver


class HopperStandIn(CudaDriver):
    """The active driver for compiling only: an sm_90 target, device 0, stream 0; nothing touches a GPU."""

    def __init__(self):  # CudaDriver's own loads libcuda
        pass

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def hopper_stand_in():
    """Triton's active driver is :class:`HopperStandIn` inside the block, the previous one after."""
    before = driver._active  # None where no driver was made active yet (none can be on a machine without a GPU)
    driver.set_active(HopperStandIn())
    try:
        yield
    finally:
        driver._active = before


def compile_wgrad() -> list[dict]:
    """Every config form of the Gluon weight-gradient kernel, compiled for sm_90: one record per launch."""
    from sonicmoe.ops import weight_grad_ws as ws
    from sonicmoe.ops.load_order import expert_load_order_ref

    records = []

    def compile_only(kernel, grid, *args, **kwargs):
        t0 = time.perf_counter()
        ck = kernel.warmup(*args, grid=grid, **kwargs)
        records.append({"kernel": kernel.fn.__name__, "grid": list(grid), "seconds": time.perf_counter() - t0,
                        "cubin_bytes": len(ck.asm["cubin"]), "shared_bytes": ck.metadata.shared,
                        **{k: v for k, v in kwargs.items() if k.isupper() and isinstance(v, (bool, int))}})

    t, d, n = 512, 1536, 256
    counts = torch.tensor([100, 0, 30, 200, 64, 50, 60, 8])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).to(torch.int32)])
    r = int(counts.sum())
    row_token = torch.randint(0, t, (r,), dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    x, dout = (torch.randn(t, d, generator=g).to(torch.bfloat16) for _ in range(2))
    dh, ap = torch.randn(r, 2 * n, generator=g).to(torch.bfloat16), torch.randn(r, n, generator=g).to(torch.bfloat16)
    saved = ws.launch_kernel, ws.sm_count
    ws.launch_kernel, ws.sm_count = compile_only, (lambda device: 132)
    try:
        with hopper_stand_in():
            for p, q, pg in ((dh, x, False), (dout, ap, True)):
                i_dim, j_dim = p.shape[1], q.shape[1]
                cfgs = [None, ws.wgrad_ws_config(i_dim, j_dim, pg, stage_in_ring=True, wg_split=False)]
                cfgs += [ws.wgrad_ws_config(i_dim, j_dim, pg, wg_split=True, swap_ab=sw) for sw in (False, True)]
                for cfg in cfgs:
                    for by_load in (False, True):
                        order = expert_load_order_ref(offsets) if by_load else None
                        ws.wgrad_ws(p, q, row_token, offsets, p_gather=pg, config=cfg, expert_order=order,
                                    serpentine=by_load)
    finally:
        ws.launch_kernel, ws.sm_count = saved
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("wgrad",), default="wgrad")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    records = compile_wgrad()
    for rec in records:
        flags = " ".join(f"{k}={v}" for k, v in rec.items() if k.isupper())
        print(f"{rec['kernel']} grid {rec['grid']} {rec['seconds']:.1f} s cubin {rec['cubin_bytes']} B "
              f"shared {rec['shared_bytes']} B | {flags}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
