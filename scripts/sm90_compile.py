"""Compile kernels for Hopper (sm_90) on a machine without a GPU: Triton's NVIDIA backend (its bundled ptxas) behind
a stand-in driver that names an sm_90 target, with each launch replaced by ``warmup`` (compile only). It catches what
only a native compile finds (a Gluon kernel's type errors, layouts, shared memory over the limit) before a GPU is
lent; it runs nothing, so it says nothing of the results.

usage: python scripts/sm90_compile.py [--what wgrad|layer|all] [--json F]

``wgrad``: the warp-specialised weight-gradient kernel (sonicmoe/ops/weight_grad_ws.py) in every config form
(default, the tile's right half through a ring slot, the two MMA warpgroups split with and without SWAP_AB) for dW1
and dW2, each in expert order and in load order with the serpentine schedule. ``layer``: every expert kernel of the
layer's forward and backward as a Hopper GPU runs them (:func:`compile_layer`). ``all`` (default): both; about 30 s
on a CI-kind CPU with an empty Triton cache.
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
from triton.runtime.jit import JITFunction


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


def _op_modules() -> list:
    """Every module of sonicmoe.ops, imported."""
    import importlib
    import pkgutil

    import sonicmoe.ops as ops

    return [importlib.import_module(f"sonicmoe.ops.{m.name}") for m in pkgutil.iter_modules(ops.__path__)]


@contextlib.contextmanager
def compile_only(records: list[dict]):
    """Inside the block every kernel launch of sonicmoe.ops compiles for sm_90 and runs nothing (a record per launch
    in ``records``), and the launchers take their pinned GPU path on CPU tensors: the Triton kernels' ``tma`` tile
    family with programmatic dependent launch, 132 multiprocessors, no autotuning, no device checks. Outputs are
    left unwritten."""
    import os

    def compile_launch(kernel, grid, *args, **kwargs):
        fn = kernel
        while not isinstance(fn, JITFunction):  # through triton.heuristics wrappers
            fn = fn.fn
        if callable(grid):
            grid = grid(dict(zip(fn.arg_names, args)) | kwargs)
        t0 = time.perf_counter()
        ck = kernel.warmup(*args, grid=grid, **kwargs)
        records.append({"kernel": fn.fn.__name__, "grid": list(grid), "seconds": time.perf_counter() - t0,
                        "cubin_bytes": len(ck.asm["cubin"]), "shared_bytes": ck.metadata.shared,
                        **{k: v for k, v in kwargs.items() if k.isupper() and isinstance(v, (bool, int))}})

    values = {"launch_kernel": compile_launch, "sm_count": lambda device: 132, "check_device": lambda name, t: None,
              "interpreting": lambda: False, "ensure_cuda_context": lambda device: None,
              "tile_family": lambda device: "tma", "pdl_enabled": lambda device: True}
    saved = []
    for mod in _op_modules():
        for name, value in values.items():
            if hasattr(mod, name):
                saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, value)
    autotune = os.environ.get("SONICMOE_AUTOTUNE")
    os.environ["SONICMOE_AUTOTUNE"] = "0"
    try:
        with hopper_stand_in():
            yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)
        if autotune is None:
            os.environ.pop("SONICMOE_AUTOTUNE", None)
        else:
            os.environ["SONICMOE_AUTOTUNE"] = autotune


def _problem(t: int, d: int, n: int, e: int, k: int):
    """bf16 CPU operands of one layer shape and a top-k routing of them (built before any patch)."""
    from sonicmoe.routing import routing_from_topk

    g = torch.Generator().manual_seed(0)
    ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].to(torch.int32)
    routing = routing_from_topk(ids, e)
    r = t * k

    def bf(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    ops = {"x": bf(t, d), "w1": bf(e, 2 * n, d), "w2": bf(e, d, n), "dout": bf(t, d), "h": bf(r, 2 * n),
           "a": bf(r, n), "y": bf(r, d), "dh": bf(r, 2 * n), "s": torch.rand(r, generator=g)}
    return routing, ops


def compile_wgrad() -> list[dict]:
    """Every config form of the Gluon weight-gradient kernel, compiled for sm_90: one record per launch."""
    from sonicmoe.ops import weight_grad_ws as ws
    from sonicmoe.ops.load_order import expert_load_order_ref

    records: list[dict] = []
    routing, o = _problem(512, 1536, 256, 8, 2)
    offsets = routing.expert_offsets
    with compile_only(records):
        for p, q, pg in ((o["dh"], o["x"], False), (o["dout"], o["a"], True)):
            i_dim, j_dim = p.shape[1], q.shape[1]
            cfgs = [None, ws.wgrad_ws_config(i_dim, j_dim, pg, stage_in_ring=True, wg_split=False)]
            cfgs += [ws.wgrad_ws_config(i_dim, j_dim, pg, wg_split=True, swap_ab=sw) for sw in (False, True)]
            for cfg in cfgs:
                for by_load in (False, True):
                    order = expert_load_order_ref(offsets) if by_load else None
                    ws.wgrad_ws(p, q, routing.row_token, offsets, p_gather=pg, config=cfg, expert_order=order,
                                serpentine=by_load)
    return records


LAYER_SHAPES = ((512, 1536, 256, 8, 2), (512, 4096, 1024, 8, 2))


def compile_layer() -> list[dict]:
    """The layer's expert kernels as a Hopper GPU runs them, at the 7B shape's d, n and at (4096, 1024): the Gluon
    up-projection, dH, ping-pong and long-row GEMMs and weight gradients (each launcher called directly), the Triton
    kernels in their pinned configs (up- and down-projection, aggregation, dH, dX̃, both weight gradients, the dS
    reduction) and the load order."""
    from sonicmoe.ops import dh_ws, grouped_gemm_ws, load_order, up_proj_ws, varlen_m_ws, weight_grad_ws
    from sonicmoe.ops.aggregation import gather_sum
    from sonicmoe.ops.dh import dh
    from sonicmoe.ops.grouped_gemm import down_proj, varlen_m_gemm
    from sonicmoe.ops.up_proj import up_proj
    from sonicmoe.ops.weight_grad import varlen_k_gemm

    records: list[dict] = []
    for shape in LAYER_SHAPES:
        n = shape[2]
        routing, o = _problem(*shape)
        s_row = o["s"]
        with compile_only(records):
            # each Gluon launcher where its config takes the shape (the layer's *_supported rules, less the device)
            up_proj_ws.up_proj_ws(o["x"], o["w1"], None, routing)
            if dh_ws.dh_ws_block_n(n) is not None:
                dh_ws.dh_ws(o["dout"], o["w2"], o["h"], s_row, routing)
            if grouped_gemm_ws.ws_config(n, True) is not None:
                grouped_gemm_ws.ws_varlen_m_gemm(o["a"], o["w2"], None, routing.expert_offsets, transpose_b=True)
            for a, b, tb in ((o["a"], o["w2"], True), (o["dh"], o["w1"], False)):
                if varlen_m_ws._operand_error(a, b, tb, 0, None) is None and a.shape[1] >= varlen_m_ws.MIN_K:
                    varlen_m_ws.long_gemm(a, b, None, routing, transpose_b=tb)
            order = load_order.expert_load_order(routing.expert_offsets)
            for p, q, pg in ((o["dh"], o["x"], False), (o["dout"], o["a"], True)):
                weight_grad_ws.wgrad_ws(p, q, routing.row_token, routing.expert_offsets, p_gather=pg,
                                        expert_order=order, serpentine=True)
                varlen_k_gemm(p, q, routing, p_gather=pg, q_gather=not pg, out_dtype=p.dtype, gluon=False)
            up_proj(o["x"], o["w1"], None, routing)
            down_proj(o["a"], o["w2"], None, routing)
            gather_sum(o["y"], routing, o["s"])
            dh(o["dout"], o["w2"], o["h"], s_row, routing)
            varlen_m_gemm(o["dh"], o["w1"], None, routing, transpose_b=False)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("wgrad", "layer", "all"), default="all")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    records = (compile_wgrad() if args.what != "layer" else []) + (compile_layer() if args.what != "wgrad" else [])
    for rec in records:
        flags = " ".join(f"{k}={v}" for k, v in rec.items() if k.isupper())
        print(f"{rec['kernel']} grid {rec['grid']} {rec['seconds']:.1f} s cubin {rec['cubin_bytes']} B "
              f"shared {rec['shared_bytes']} B | {flags}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
