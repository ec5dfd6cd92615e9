"""Registers, spills and shared memory of every kernel config, compiled offline for Hopper or ``--arch`` (no GPU).

usage: python benchmarks/resource_report.py [--kernels up_proj,dh,...] [--arch 90] [--space tune|focus|default|portable]
       [--ptx DIR] [--check-sass]

Each op's launcher runs on small CPU tensors with a stand-in Triton driver whose target is ``cuda:<arch>``; kernels
are compiled (``warmup``), never launched, and the cubin's resource usage is read with the ``cuobjdump`` that Triton's
package carries. A config whose STACK or LOCAL (spill) bytes are not zero, or whose shared memory passes the limit,
will be slow or fail on the GPU: this screens tile sweeps before they cost device time. Shapes only need the real
shapes' divisibility (d, n multiples of 16), so the problem is tiny. The Gluon kernels (``up_ws``, ``down_ws``,
``dxtilde_ws``, ``long_down``, ``long_dxt``, ``dh_ws``, ``dw1_ws``, ``dw2_ws``, and ``dw1_ws_load``, ``dw2_ws_load``:
the weight gradients in load order with the serpentine schedule; ``up_ws_clamped``, ``dh_ws_clamped``: gpt-oss's
clamped SwiGLU) are compiled too, with their explicit configs. ``--ptx DIR`` writes each kernel's PTX without debug
line info: a refactor after which ``diff -r`` of two such folders shows nothing leaves every kernel as it was.
``--check-sass`` flags every HGMMA that reads a descriptor register some path through the kernel leaves unset
(``sass_check.py``). ``--space portable --arch 80`` (or 86, 89, 120) compiles the Triton kernels' configs for the GPUs
of :func:`sonicmoe.ops.common.tile_family`'s ``"mma"`` family, against that architecture's shared-memory limit
(``SMEM_LIMITS``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

SMEM_LIMIT = 232448  # bytes per block on sm_90
# the most shared memory a block may opt into, by compute capability (CUDA's feature tables); sm_90's for the others
SMEM_LIMITS = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
# the weight-gradient kernel's forms: (stage in ring, warpgroups split)
WGRAD_FORMS = ((False, False), (True, False), (False, True))


class _OfflineDriver:
    """Just enough of a Triton driver to compile for a target without a GPU."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


_COMPILED: list = []


def _install(arch: int) -> None:
    # Triton's own launch path (the one patched below), not the library's fast path, which asks CUDA for the device
    os.environ["SONICMOE_FAST_LAUNCH"] = "0"
    driver.set_active(_OfflineDriver(arch))
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        _COMPILED.append(run(self, *args, grid=grid, warmup=True, **kwargs))

    JITFunction.run = compile_only
    from sonicmoe.ops import aggregation, common, dh, grouped_gemm, load_order, up_proj, weight_grad

    for mod in (aggregation, common, dh, grouped_gemm, load_order, up_proj, weight_grad):
        if hasattr(mod, "check_device"):
            mod.check_device = lambda *a: None


def _tool(name: str) -> str:
    """A binary of the CUDA tools Triton's package carries (cuobjdump, nvdisasm)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _cuobjdump() -> str:
    return _tool("cuobjdump")


def sass(kernel) -> str:
    """A compiled kernel's SASS (``nvdisasm -c``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout


def resources(kernel) -> dict:
    """REG / STACK / SHARED / LOCAL of a compiled kernel's cubin (cuobjdump -res-usage); a non-zero
    STACK (spilled registers live in the stack frame) or LOCAL means spills."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    res = dict(zip(("reg", "stack", "shared_static", "local"), map(int, m.groups()))) if m else {"raw": out}
    res["shared"] = kernel.metadata.shared
    return res


def strip_line_info(ptx: str) -> str:
    """PTX without its debug line information (``.loc``/``.file`` directives, ``$L__tmp`` labels, debug sections),
    which changes whenever the source moves even if the code does not."""
    ptx = ptx.split(".section\t.debug")[0]
    lines = [ln for ln in ptx.splitlines()
             if not re.match(r"\s*\.(loc|file)\b", ln) and not re.match(r"\$L__tmp\d+:", ln)]
    return re.sub(r"\$L__tmp\d+", "$L__tmp", "\n".join(lines)) + "\n"


def write_ptx(kernel, folder: str, stem: str) -> None:
    """``kernel``'s PTX (:func:`strip_line_info`) to ``folder/stem.ptx``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{stem}.ptx"), "w") as f:
        f.write(strip_line_info(kernel.asm["ptx"]))


def problem(dtype=torch.bfloat16, t=64, d=1536, n=256, e=4, k=2):
    import sonicmoe
    from sonicmoe.testing import random_problem

    p = random_problem(t, d, n, e, dtype=dtype, device="cpu", seed=0)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    routing = sonicmoe.routing_from_topk(ids, e)
    return p, routing


def launchers(p, routing):
    """name -> function of a config dict that launches the kernel (the Gluon kernels' names end in ``_ws``)."""
    from sonicmoe.ops import (
        aggregation,
        dh,
        dh_ws,
        grouped_gemm,
        grouped_gemm_ws,
        load_order,
        up_proj,
        up_proj_ws,
        varlen_m_ws,
        weight_grad,
        weight_grad_ws,
    )

    x, w1, w2 = p["x"], p["w1"], p["w2"]
    r, n = routing.num_rows, w2.shape[2]
    t, d = x.shape
    h = torch.randn(r, 2 * n, dtype=x.dtype)
    a = torch.randn(r, n, dtype=x.dtype)
    dout = torch.randn(t, d, dtype=x.dtype)
    s_row = torch.rand(r)
    order = load_order.expert_load_order_ref(routing.expert_offsets)
    return {
        "up_proj": lambda c: up_proj.up_proj(x, w1, None, routing, config=c),
        "down_proj": lambda c: grouped_gemm.down_proj(a, w2, None, routing, config=c),
        "dxtilde": lambda c: grouped_gemm.varlen_m_gemm(h, w1, None, routing, transpose_b=False, config=c),
        "dh": lambda c: dh.dh(dout, w2, h, s_row, routing, config=c),
        "dw2": lambda c: weight_grad.varlen_k_gemm(dout, a, routing, p_gather=True, q_gather=False,
                                                   out_dtype=w2.dtype, config=c),
        "dw1": lambda c: weight_grad.varlen_k_gemm(h, x, routing, p_gather=False, q_gather=True,
                                                   out_dtype=w1.dtype, config=c),
        "aggregate": lambda c: aggregation.gather_sum(torch.randn(r, d, dtype=x.dtype), routing, None, config=c),
        # the Gluon (warp-specialised, sm_90) kernels, with their explicit configs
        "up_ws": lambda c: up_proj_ws.up_proj_ws(x, w1, None, routing, config=c),
        "down_ws": lambda c: grouped_gemm_ws.ws_varlen_m_gemm(a, w2, None, routing.expert_offsets, transpose_b=True,
                                                              config=c),
        "dxtilde_ws": lambda c: grouped_gemm_ws.ws_varlen_m_gemm(h, w1, None, routing.expert_offsets,
                                                                 transpose_b=False, config=c),
        "long_down": lambda c: varlen_m_ws.long_gemm(a, w2, None, routing, transpose_b=True, config=c),
        "long_dxt": lambda c: varlen_m_ws.long_gemm(h, w1, None, routing, transpose_b=False, config=c),
        "dh_ws": lambda c: dh_ws.dh_ws(dout, w2, h, s_row, routing, config=c),
        # the layer's form: scores in pair order; and with dS written by the kernel in pair order (ds_pairs)
        "dh_ws_pair": lambda c: dh_ws.dh_ws(dout, w2, h, s_row, routing, config=c, pair_order=True),
        "dh_ws_ds_pairs": lambda c: dh_ws.dh_ws(dout, w2, h, s_row, routing, config=c, pair_order=True,
                                                ds_pairs=x.dtype),
        # gpt-oss's clamped SwiGLU in the up-projection's and dH's epilogues (ACT 1)
        "up_ws_clamped": lambda c: up_proj_ws.up_proj_ws(x, w1, None, routing, config=c, activation="clamped_swiglu"),
        "dh_ws_clamped": lambda c: dh_ws.dh_ws(dout, w2, h, s_row, routing, config=c, pair_order=True,
                                               ds_pairs=x.dtype, activation="clamped_swiglu"),
        "dw1_ws": lambda c: weight_grad_ws.wgrad_ws(h, x, routing.row_token, routing.expert_offsets, p_gather=False,
                                                    config=c),
        "dw2_ws": lambda c: weight_grad_ws.wgrad_ws(dout, a, routing.row_token, routing.expert_offsets,
                                                    p_gather=True, config=c),
        # SONICMOE_WGRAD_ORDER=load: the experts' tiles busiest first, the waves dealt serpentine; and the order's
        # own (Triton) kernel
        "dw1_ws_load": lambda c: weight_grad_ws.wgrad_ws(h, x, routing.row_token, routing.expert_offsets,
                                                         p_gather=False, config=c, expert_order=order),
        "dw2_ws_load": lambda c: weight_grad_ws.wgrad_ws(dout, a, routing.row_token, routing.expert_offsets,
                                                         p_gather=True, config=c, expert_order=order),
        "load_order": lambda c: load_order.expert_load_order(routing.expert_offsets),
    }


def spaces(which: str) -> dict:
    from sonicmoe.ops import aggregation, dh, grouped_gemm, up_proj, weight_grad
    from sonicmoe.ops.common import config_dict

    tune = {
        "up_proj": up_proj.TUNING_SPACE, "down_proj": grouped_gemm.TUNING_SPACE,
        "dxtilde": grouped_gemm.TUNING_SPACE, "dh": dh.TUNING_SPACE, "dw2": weight_grad.TUNING_SPACE,
        "dw1": weight_grad.TUNING_SPACE, "aggregate": aggregation.TUNING_SPACE,
    }
    out = {k: [config_dict(c) for c in v] for k, v in tune.items()}
    from sonicmoe.ops import dh_ws, grouped_gemm_ws, up_proj_ws, varlen_m_ws, weight_grad_ws

    n, d = 256, 1536  # problem()'s widths
    out.update({
        "up_ws": [{"STAGES": s, "GU_FUSED": f} for s in (up_proj_ws.up_ws_config(4096)["STAGES"], 3)
                  for f in (False, True)]
                 + [{"STAGES": 4, "PART": 1}]
                 + [{"STAGES": up_proj_ws.up_ws_config(4096)["STAGES"], "H_PACKED": False}]
                 + [{**up_proj_ws.up_ws_config(w), "SIGMOID_FTZ": True} for w in (4096, 1536)]
                 + [{"STAGES": 3, "EPI_WARPS": 4, "EPI_CHUNK": c, "EPI_REGS": r} for c in (16, 32) for r in (80, 96)],
        "down_ws": [grouped_gemm_ws.ws_config(n)],
        "dxtilde_ws": [grouped_gemm_ws.ws_config(2 * n, transpose_b=False)],
        "dh_ws": [dh_ws.dh_ws_config(n, epi, nbuf, bn) for bn in (256, 128) for epi in (16, 32, 64) for nbuf in (2, 4)
                  if dh_ws.dh_ws_config(n, epi, nbuf, bn)["STAGES"] >= 2]
                 + [dh_ws.dh_ws_config(n, epi, 2, 256, stage_in_ring=False) for epi in (16, 32)]
                 + [{**dh_ws.dh_ws_config(n), "SIGMOID_FTZ": True}],
        "long_down": [varlen_m_ws.long_config()],
        "long_dxt": [varlen_m_ws.long_config()],
        "dh_ws_pair": [dh_ws.dh_ws_config(n)],
        "dh_ws_ds_pairs": [dh_ws.dh_ws_config(n)],
        "up_ws_clamped": [up_proj_ws.up_ws_config(w) for w in (4096, 1536)],
        "dh_ws_clamped": [dh_ws.dh_ws_config(n), {**dh_ws.dh_ws_config(n), "SIGMOID_FTZ": False}],
        "dw1_ws": [weight_grad_ws.wgrad_ws_config(2 * n, d, False, stage_in_ring=r, wg_split=w)
                   for r, w in WGRAD_FORMS],
        "dw2_ws": [weight_grad_ws.wgrad_ws_config(d, n, True, stage_in_ring=r, wg_split=w) for r, w in WGRAD_FORMS],
        "dw1_ws_load": [weight_grad_ws.wgrad_ws_config(2 * n, d, False, stage_in_ring=r, wg_split=w)
                        for r, w in WGRAD_FORMS],
        "dw2_ws_load": [weight_grad_ws.wgrad_ws_config(d, n, True, stage_in_ring=r, wg_split=w)
                        for r, w in WGRAD_FORMS],
        "load_order": [{}],
    })
    if which == "portable":
        # the "mma" family's configs (common.tile_family) of the Triton kernels: for --arch 80, 86, 89, 120
        out = {k: [config_dict(c) for c in v] for k, v in {
            "up_proj": up_proj.PORTABLE_SPACE, "down_proj": grouped_gemm.PORTABLE_SPACE,
            "dxtilde": grouped_gemm.PORTABLE_SPACE, "dh": dh.PORTABLE_SPACE, "dw2": weight_grad.PORTABLE_SPACE,
            "dw1": weight_grad.PORTABLE_SPACE, "aggregate": aggregation.TUNING_SPACE}.items()}
    if which == "default":
        # the configs the layer runs: each Gluon kernel's default at the problem's widths (and the up-projection's
        # at both of its epilogue forms)
        out = {"up_ws": [up_proj_ws.up_ws_config(w) for w in (4096, 1536)],
               "down_ws": [grouped_gemm_ws.ws_config(n)],
               "dxtilde_ws": [grouped_gemm_ws.ws_config(2 * n, transpose_b=False)],
               "long_down": [varlen_m_ws.long_config()], "long_dxt": [varlen_m_ws.long_config()],
               "dh_ws_pair": [dh_ws.dh_ws_config(n)],
               "up_ws_clamped": [up_proj_ws.up_ws_config(w) for w in (4096, 1536)],
               "dh_ws_clamped": [dh_ws.dh_ws_config(n)],
               "dw1_ws": [weight_grad_ws.wgrad_ws_config(2 * n, d, False)],
               "dw2_ws": [weight_grad_ws.wgrad_ws_config(d, n, True)],
               "dw1_ws_load": [weight_grad_ws.wgrad_ws_config(2 * n, d, False)],
               "dw2_ws_load": [weight_grad_ws.wgrad_ws_config(d, n, True)]}
    if which == "focus":
        import importlib.util
        import pathlib

        spec = importlib.util.spec_from_file_location(
            "tune_sweep", pathlib.Path(__file__).with_name("tune_sweep.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out.update(mod.FOCUS)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default=None, help="comma-separated subset")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--space", choices=("tune", "focus", "default", "portable"), default="tune",
                    help="default: only the configs the layer runs, one or two per Gluon kernel; portable: the "
                         "Triton kernels' configs for GPUs other than Hopper and datacenter Blackwell")
    ap.add_argument("--ptx", default=None, metavar="DIR",
                    help="also write each kernel's PTX, without debug line info, to DIR (a refactor that leaves "
                         "every file unchanged leaves the kernels unchanged: diff two such folders)")
    ap.add_argument("--check-sass", action="store_true",
                    help="also flag every HGMMA that reads a descriptor register some path leaves unset "
                         "(benchmarks/sass_check.py: a ptxas miscompile seen in session 59)")
    args = ap.parse_args()
    if args.check_sass:
        from sass_check import unset_descriptor_reads
    _install(args.arch)
    p, routing = problem()
    fns = launchers(p, routing)
    only = set(args.kernels.split(",")) if args.kernels else None
    done = 0
    for name, cfgs in spaces(args.space).items():
        if only and name not in only:
            continue
        for cfg in cfgs:
            _COMPILED.clear()
            try:
                fns[name](dict(cfg))
                done += 1
                res = resources(_COMPILED[-1])
                if args.ptx:
                    write_ptx(_COMPILED[-1], args.ptx, f"{done:03d}_{name}")
                flag = "  SPILLS" if res.get("local") or res.get("stack") else ""
                flag += "  SMEM>LIMIT" if res.get("shared", 0) > SMEM_LIMITS.get(args.arch, SMEM_LIMIT) else ""
                if args.check_sass:
                    unset = unset_descriptor_reads(sass(_COMPILED[-1]))
                    flag += f"  HGMMA-DESC-UNSET x{len(unset)} (first at {unset[0][0]})" if unset else ""
                print(f"{name:10s} reg {res.get('reg'):>3} stack {res.get('stack'):>5} smem {res['shared']:>6}"
                      f"{flag}  {cfg}", flush=True)
            except Exception as exc:  # noqa: BLE001 - report and go on with the sweep
                print(f"{name:10s} ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:150]}  {cfg}", flush=True)


if __name__ == "__main__":
    main()
