"""GPU probe (session 91): test_gpu_bf16_layer_with_zero_width_hidden's NaN scores' gradient at d = 0 (H100, "tma"
tile family). Wraps each op the layer's forward and backward call (sonicmoe.ops.library's names) and prints the NaN
count of every floating output, in call order, with outputs NaN-poisoned and the pinned configs (as under pytest).

Session 91 found the up-projection's output all NaN here: its pinned H100 config is the (tile, K-block) step loop,
which ran zero steps at d = 0 and stored nothing (fixed in kernel_lib.first_step). Expected now: no NaN anywhere, "ok".
"""
import os
import sys

os.environ.setdefault("SONICMOE_POISON_OUTPUTS", "1")
os.environ.setdefault("SONICMOE_AUTOTUNE", "0")

import torch

sys.path.insert(0, os.environ.get("SONICMOE_REPO", "."))
import sonicmoe  # noqa: E402
from sonicmoe.ops import library  # noqa: E402
from sonicmoe.routing import routing_from_topk  # noqa: E402


def wrap(name):
    fn = getattr(library, name)

    def inner(*args, **kw):
        out = fn(*args, **kw)
        torch.cuda.synchronize()
        outs = out if isinstance(out, tuple) else (out,)
        ins = [f"{tuple(a.shape)}:{a.isnan().sum().item()}" for a in args if isinstance(a, torch.Tensor)
               and a.is_floating_point()]
        print(name, "in", ins, "out nan", [(tuple(o.shape), o.isnan().sum().item()) for o in outs
                                           if isinstance(o, torch.Tensor) and o.is_floating_point()], flush=True)
        return out
    setattr(library, name, inner)


for name in ("up_proj", "down_proj", "dh", "score_grad", "varlen_k_gemm", "varlen_m_gemm", "gather_sum",
             "gemm_then_gather_sum", "_dx_beside_dw1"):
    if hasattr(library, name):
        wrap(name)
e, n, t = 4, 128, 4096
torch.manual_seed(0)
x = torch.randn(t, 0, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w1 = torch.randn(e, 2 * n, 0, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w2 = torch.randn(e, 0, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
routing = routing_from_topk(torch.arange(t, device="cuda").remainder(e)[:, None], e)
scores = torch.rand(t, device="cuda", requires_grad=True)
out = sonicmoe.experts(x, w1, w2, routing, scores, backend="triton")
out.sum().backward()
bad = scores.grad.isnan().sum().item()
print("scores.grad nan", bad, "absmax", scores.grad.nan_to_num().abs().max().item())
print("ok" if bad == 0 else "FAIL: NaN in the scores' gradient at d = 0")
