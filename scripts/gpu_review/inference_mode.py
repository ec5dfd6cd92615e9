# GPU (sm_90) repro: the layer's forward under torch.inference_mode reaches the Gluon kernels' tile-table cache
# (grouped_gemm_ws.routing_tile_table), which reads offsets._version: inference tensors have none -> RuntimeError.
# Also: a 16-byte-misaligned x (x[1:] of a buffer) under SONICMOE_FAST_LAUNCH=check gives mode 0's bits.
import os

import torch

from sonicmoe import MoE

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
print(torch.cuda.get_device_name(), torch.__version__)
layer = MoE(1536, 256, 64, 8, device=dev, dtype=dt).eval()
x = torch.randn(8192, 1536, device=dev, dtype=dt)
with torch.no_grad():
    ref = layer(x)
print("no_grad ok", tuple(ref.shape))
with torch.inference_mode():
    try:
        out = layer(x)
        print("inference_mode ok, equal:", torch.equal(out, ref))
    except RuntimeError as e:
        print("inference_mode RuntimeError:", e)
# misaligned view through the fast path, checked against Triton's own choice
buf = torch.randn(8192 * 1536 + 1, device=dev, dtype=dt)
xs = buf[1:].view(8192, 1536)
outs = {}
for mode in ("0", "check", "1", "1"):
    os.environ["SONICMOE_FAST_LAUNCH"] = mode
    with torch.no_grad():
        outs.setdefault(mode, []).append(layer(xs).clone())
        outs[mode].append(layer(buf[:-1].view(8192, 1536)).clone())
base = outs["0"]
print("misaligned/aligned views, fast path on/check vs off, same bits:",
      all(torch.equal(a, base[i % 2]) for m in outs for i, a in enumerate(outs[m])))
