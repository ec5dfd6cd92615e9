"""GPU repro (sm_90): d = 0 passes the Gluon dispatch rules but the Gluon launchers assert.

functional.check_expert_inputs accepts x (T, 0), w1 (E, 2n, 0), w2 (E, 0, n); the Triton path handles it (checked
on the CPU under TRITON_INTERPRET=1: O (T, 0), zero dS). But `d % BLOCK_K == 0` holds for d = 0, so
  * up_proj_ws.up_ws_supported (up_proj_ws.py:271) -> _descriptor(w1.view(E*2n, 0)) (up_proj_ws.py:627),
  * dh_ws.dh_ws_supported (dh_ws.py:239)           -> _descriptor(w2.view(E*0, n))  (dh_ws.py:561),
  * grouped_gemm_ws.ws_supported (m = d = 0: (0*2) % 16 == 0, grouped_gemm_ws.py:449) -> _descriptor(b2d (0, k))
    (grouped_gemm_ws.py:513)
build a Gluon TensorDescriptor with a zero extent: AssertionError "shape must be positive".
Expected on an H100/H200: FAIL for the Gluon runs (Triton reference fine). Low severity (degenerate shape).
"""
import os
import sys

import torch

sys.path.insert(0, os.environ.get("SONICMOE_REPO", "/work/main"))
import sonicmoe  # noqa: E402
from sonicmoe.ops import grouped_gemm_ws  # noqa: E402
from sonicmoe.testing import random_topk_routing  # noqa: E402


def run(t, d, n, e, k, env):
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        routing = random_topk_routing(t, e, k, seed=0)
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(t, d, device="cuda", generator=g).bfloat16().requires_grad_(True)
        w1 = torch.randn(e, 2 * n, d, device="cuda", generator=g).bfloat16().requires_grad_(True)
        w2 = torch.randn(e, d, n, device="cuda", generator=g).bfloat16().requires_grad_(True)
        s = torch.rand(routing.num_rows, device="cuda", generator=g).requires_grad_(True)
        out = sonicmoe.experts(x, w1, w2, routing, s, backend="triton")
        out.float().sum().backward()
        torch.cuda.synchronize()
        return "ok", out.shape, s.grad.abs().max().item()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}", None, None
    finally:
        for key, v in saved.items():
            if v is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = v


def main():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0) or not grouped_gemm_ws.HAVE_GLUON:
        print("SKIP: needs an sm_90 GPU with Gluon")
        return
    d, n, e, k = 0, 256, 4, 1
    # T = 4096: R = 4096 >= 1024 E (the ping-pong GEMMs' row rule); T = 1024: R < 1024 E (no ping-pong)
    ref = run(4096, d, n, e, k, {"SONICMOE_GLUON": "0"})
    print("Triton path (SONICMOE_GLUON=0):", ref)
    ok = True
    for name, t, env in (("up-projection alone (SONICMOE_GLUON_UP=all, dH off)", 1024,
                          {"SONICMOE_GLUON_UP": "all", "SONICMOE_GLUON_DH": "0"}),
                         ("down-projection / dX~ ping-pong alone", 4096,
                          {"SONICMOE_GLUON_UP": "0", "SONICMOE_GLUON_DH": "0"}),
                         ("dH alone (n = 256)", 1024, {"SONICMOE_GLUON_UP": "0"}),
                         ("all defaults", 4096, {})):
        got = run(t, d, n, e, k, env)
        print(f"{name}: {got}")
        ok &= got[0] == "ok"
    print("PASS" if ok and ref[0] == "ok" else "FAIL: a Gluon path rejects d = 0 that its dispatch rule admitted")


if __name__ == "__main__":
    main()
