"""The Gluon kernels' configs in settled windows: do the defaults, chosen from short timings at boost clocks, still
lead at the power-capped clock a training run sees?

Session 51 found the Triton varlen-M kernel's autotuned config for dX̃ 7% slower than another in settled 1.5 s windows
at (32768, 4096, 1024, 128, 8) (``dxt_layout_probe.py``). This probe asks the same of the Gluon kernels' pinned
configs: the up-projection (``up_proj_ws``), dH (``dh_ws``) and the weight gradients (``wgrad_ws``: dW1 with X
gathered, dW2 with dO gathered), each under its default config and a few alternatives, every item run back to back
for a warm-up and timed over a window with its energy per call (``energy_probe.measure``).

usage (GPU): PYTHONPATH=$PWD python scripts/settled_configs.py [--shape T,d,n,E,K] [--warmup 1.0] [--window 1.5]
             [--json F]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from energy_probe import measure_items, probe_problem, write_rows  # noqa: E402

from sonicmoe.bench.gpu_state import Nvml  # noqa: E402
from sonicmoe.ops import dh_ws, up_proj_ws, weight_grad_ws  # noqa: E402


def items(p: dict, routing, s_pair: torch.Tensor) -> list:
    """(name, fn, FLOPs) of each kernel under each config (None: the kernel's default)."""
    x, w1, w2 = p["x"], p["w1"], p["w2"]
    e, d, n = w2.shape
    r = routing.num_rows
    g = torch.Generator(device="cuda").manual_seed(2)
    dout = torch.randn(x.shape[0], d, device="cuda", dtype=x.dtype, generator=g)
    h, _ = up_proj_ws.up_proj_ws(x, w1, None, routing)
    s_row = routing.row_scores(s_pair).float()
    dh_, ap_, _ = dh_ws.dh_ws(dout, w2, h, s_row, routing)
    gemm = 2 * r * n * d
    out = []
    up_cfgs = [None, {"STAGES": 3, "EPI_WARPS": 0}, up_proj_ws.up_ws_config(d, up_proj_ws.EPI_WARPS),
               {**up_proj_ws.up_ws_config(d, 0), "GU_FUSED": True}]
    for cfg in up_cfgs:
        out.append((f"up {cfg}", lambda cfg=cfg: up_proj_ws.up_proj_ws(x, w1, None, routing, config=cfg), 2 * gemm))
    dh_cfgs = [None, dh_ws.dh_ws_config(n, 16, 2), dh_ws.dh_ws_config(n, 32, 2, None, 32),
               dh_ws.dh_ws_config(n, 32, 2, stage_in_ring=False), dh_ws.dh_ws_config(n, 32, 4)]
    for cfg in dh_cfgs:
        out.append((f"dH {cfg}", lambda cfg=cfg: dh_ws.dh_ws(dout, w2, h, s_row, routing, config=cfg), gemm))
    off = routing.expert_offsets
    for name, pp, qq, pg, (i_dim, j_dim) in (("dW1", dh_, x, False, (2 * n, d)), ("dW2", dout, ap_, True, (d, n))):
        cfgs = [None, weight_grad_ws.wgrad_ws_config(i_dim, j_dim, pg, stage_in_ring=False, wg_split=False),
                weight_grad_ws.wgrad_ws_config(i_dim, j_dim, pg, block_r=32)]
        for cfg in cfgs:
            out.append((f"{name} {cfg}", lambda cfg=cfg, pp=pp, qq=qq, pg=pg: weight_grad_ws.wgrad_ws(
                pp, qq, routing.row_token, off, p_gather=pg, config=cfg), gemm * (2 if name == "dW1" else 1)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32768,4096,1024,128,8")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--window", type=float, default=1.5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    nvml = Nvml()
    p, routing, s_pair = probe_problem(args.shape)
    its = items(p, routing, s_pair)
    for _, fn, _ in its:  # compile everything before any window
        fn()
    torch.cuda.synchronize()
    print(f"== {torch.cuda.get_device_name()} shape {args.shape}: warm-up {args.warmup} s, window {args.window} s")
    write_rows(args.json, args.shape, measure_items(nvml, its, args.warmup, args.window))


if __name__ == "__main__":
    main()
