"""Pure-PyTorch repro of the Inductor CPU miscompile found in session 86 (torch 2.13.0+cpu).

A router-like graph: logits = X W_rᵀ, a stable top-2, softmax over the chosen logits, scores of token rounding's
pairs picked by index, and a second output that sums the full softmax. torch.compile(fullgraph=True) with Inductor
gives the forward's values but wrong gradients of X and W_r: the generated C++ reads the buffer that gather's
backward scatter-adds into before the loop that writes it. Usage: python gather_backward_repro.py [chosen|plain|one]
("one" drops the `probs.sum(0).sum() * 0` term of the second output, which hides the bug).
"""
import sys

import torch

torch.manual_seed(0)
E, D, T = 4, 32, 16
w = torch.randn(E, D, requires_grad=True)
x = torch.randn(T, D)
pt = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14,
                   15, 15, 16, 16, 16, 16], dtype=torch.int32)  # T marks a padding pair
pe = torch.randint(0, E, (pt.shape[0],), dtype=torch.int32)
mode = sys.argv[1] if len(sys.argv) > 1 else "chosen"


def f(x, pt, pe):
    logits = torch.nn.functional.linear(x, w)
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :2].contiguous()
    scores = torch.softmax(logits.gather(1, ids), dim=-1)
    real = pt < T
    ptl = pt.long().clamp(max=T - 1)
    pel = pe.long()
    match = ids[ptl] == pel[:, None]
    chosen = scores[ptl, match.to(torch.int32).argmax(dim=1)]
    if mode == "chosen" or mode == "one":
        s = chosen
    else:
        cl = logits.gather(1, ids)
        mx = cl.detach().max(dim=1, keepdim=True).values
        red = torch.exp(cl - mx).sum(dim=1).log()
        added = torch.exp((logits[ptl, pel] - mx[ptl, 0]) - red[ptl])
        s = torch.where(~match.any(dim=1) & real, added, chosen)
    s = torch.where(real, s, torch.zeros_like(s))
    loss = (s * torch.arange(s.shape[0], dtype=s.dtype)).sum()
    probs = torch.softmax(logits, dim=-1)
    second = (probs.sum(0) * torch.arange(float(E))).sum()
    return loss, second if mode == "one" else probs.sum(0).sum() * 0 + second


out = []
for fn in (torch.compile(f, fullgraph=True), f):
    xi = x.clone().requires_grad_(True)
    w.grad = None
    loss, _ = fn(xi, pt, pe)
    loss.backward()
    out.append((loss.detach(), xi.grad, w.grad.clone()))
dl, dx, dw = ((a - b).abs().max().item() for a, b in zip(*out))
print(torch.__version__, mode, f"compiled - eager, max abs: loss {dl:.2e}, dX {dx:.2e}, dW_r {dw:.2e}")
