"""Session 87 diagnosis: the layer compiled (aot_eager) against its eager twin, gradient norm of each parameter, with
and without CUDA autocast, float32 and bfloat16 parameters. Run on a GPU machine from the repo root; the session ran
it without SONICMOE_POISON_OUTPUTS (set it to 1 to compare with test_autocast's poisoned run)."""

import copy
import os
import sys

import torch

from sonicmoe import MoE

torch.manual_seed(0)
for autocast in (True, False):
    for dt in (torch.float32, torch.bfloat16):
        layer = MoE(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2, device="cuda", dtype=dt)
        twin = copy.deepcopy(layer)
        compiled = torch.compile(layer, fullgraph=True, backend=sys.argv[1] if len(sys.argv) > 1 else "aot_eager")
        x = torch.randn(384, 256, device="cuda", dtype=dt)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = compiled(x)
            y_ref = twin(x)
        y.float().square().mean().backward()
        y_ref.float().square().mean().backward()
        norms = [(n, round(float(p.grad.norm()), 6), round(float(q.grad.norm()), 6))
                 for (n, p), q in zip(layer.named_parameters(), twin.parameters())]
        print("autocast", autocast, dt, os.environ.get("SONICMOE_ROUTER_KERNEL"), norms, flush=True)
        torch._dynamo.reset()
