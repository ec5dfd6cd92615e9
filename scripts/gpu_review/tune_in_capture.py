# GPU repro (not run: no device time left). The first call of an autotuner key inside CUDA-graph capture runs
# Tuners.tune -> triton.testing.do_bench (synchronize, events) in the capture: the capture is invalidated
# (cudaErrorStreamCaptureUnsupported / "operation not permitted when stream is capturing").
# Expected: eager call works; the same call first seen under capture raises.  ~30 s (compiles the tuning space).
import os

os.environ["SONICMOE_AUTOTUNE"] = "1"
os.environ["SONICMOE_GLUON"] = "0"
import torch

from sonicmoe.ops.grouped_gemm import varlen_m_gemm
from sonicmoe.routing import routing_from_pairs

dev, dt = "cuda", torch.bfloat16
E, T, K, d, n = 8, 512, 2, 256, 128
pt = torch.arange(T, device=dev).repeat_interleave(K)
pe = torch.randint(0, E, (T * K,), device=dev)
routing = routing_from_pairs(pt, pe, T, E)
r = routing.num_rows
a = torch.randn(r, n, device=dev, dtype=dt)
w2 = torch.randn(E, d, n, device=dev, dtype=dt)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
g = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g, stream=s):
        c = varlen_m_gemm(a, w2, None, routing, transpose_b=True)  # first call of this key: tunes in capture
    g.replay()
    torch.cuda.synchronize()
    print("captured and replayed")
except Exception as e:
    print("capture failed:", type(e).__name__, str(e)[:200])
