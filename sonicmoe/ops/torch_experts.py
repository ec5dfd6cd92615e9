"""The ``torch`` backend: what a user would write in plain PyTorch (SPEC §7 baseline).

Index gather of X rows, ``torch._grouped_mm`` over the expert-sorted rows on CUDA (bf16, Hopper or
newer), a per-expert loop elsewhere, SwiGLU, and ``index_add`` aggregation. Autograd comes from
PyTorch, so it keeps what PyTorch keeps (gathered X, H, A, Y: far more than the Triton path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import guard_or_false

from ..reference import swiglu_ref
from ..routing import Routing


def _grouped_mm_ok(x: torch.Tensor, *mats: torch.Tensor) -> bool:
    if not (x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    # _grouped_mm needs 16-byte aligned leading dimensions
    return all(m.shape[-1] % 8 == 0 and m.shape[-2] % 8 == 0 for m in mats)


def _grouped_linear(a: torch.Tensor, w: torch.Tensor, routing: Routing, use_grouped_mm: bool):
    """Rows of expert e times w[e]ᵀ: (R, k) x (E, m, k) -> (R, m)."""
    if use_grouped_mm:
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=routing.expert_offsets[1:])
    if a.device.type == "meta":
        return a.new_empty(a.shape[0], w.shape[1])
    # guard_or_false: R is an unbacked size under torch.compile where token rounding's pairs come from nonzero
    # (static_pairs=False): a plain == 0 failed the compile there (the split below handles no row too)
    if guard_or_false(routing.row_token.shape[0] == 0):  # no row: no per-expert slices (under torch.compile their
        # bounds are unbacked sizes, which slices that are never used leave pending); (0, m), still in w's graph (zero
        # gradient)
        return F.linear(a[:0], w[0])
    # rows per expert, then the padding rows (routing.padded), if any: one host read. torch.split by these sizes,
    # not slices at the offsets: under torch.compile(fullgraph=True) on CPU, Inductor (torch 2.13) allocated the
    # concatenated output of sliced GEMMs before the last slice's unbacked size was defined (UnboundLocalError)
    offs = routing.expert_offsets
    sizes = torch.cat([offs, offs.new_full((1,), a.shape[0])]).diff().tolist()
    for size in sizes:
        torch._check(size >= 0)
    torch._check(sum(sizes) == a.shape[0])
    parts = torch.split(a, sizes)
    # one unbind, not w[e] per expert: each w[e]'s backward adds a zero-filled (E, m, k) gradient, E² work in all
    ws = w.unbind(0)
    outs = [F.linear(parts[e], ws[e]) for e in range(routing.num_experts)]
    outs.append(parts[-1].new_zeros(parts[-1].shape[0], w.shape[1]))
    return torch.cat(outs, dim=0)


def experts_torch(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    routing: Routing,
    pair_scores: torch.Tensor,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    *,
    gate_up_layout: str = "concat",
    activation: str = "swiglu",
) -> torch.Tensor:
    """Experts + aggregation in plain PyTorch; same signature as :func:`sonicmoe.experts`.

    Args:
        x: (T, d). w1: (E, 2n, d) in ``gate_up_layout``. w2: (E, d, n). routing: R pairs.
        pair_scores: (R,) scores S per pair. b1: (E, 2n) or None. b2: (E, d) or None.
        activation: ``"swiglu"`` or ``"clamped_swiglu"`` (:func:`sonicmoe.reference.swiglu_ref`).

    Returns:
        O (T, d) in x's dtype.
    """
    use_gmm = _grouped_mm_ok(x, w1, w2)
    token = routing.row_token.long()
    if x.shape[0]:
        xg = x[token]
    else:  # no token: every pair is padding (a static-length routing's), and there is no row to gather; zeros,
        # still in x's graph so that x gets its (0, d) gradient
        xg = x.new_zeros(token.shape[0], x.shape[1]) + x.sum(0, keepdim=True)
    real = routing.real_rows()  # padding rows (routing.padded): zero in, zero out, zero gradients
    if real is not None:
        real = real[:, None]
        xg = torch.where(real, xg, 0)
    h = _grouped_linear(xg, w1, routing, use_gmm)
    row_expert = routing.row_expert() if (b1 is not None or b2 is not None) else None
    if b1 is not None:
        h = h + b1[row_expert]
    if real is not None:  # torch._grouped_mm leaves the padding rows (past the last offset) unwritten: garbage, whose
        # A's gradient, through b1[row_expert], reached b1's gradient (and a NaN there, 0 · NaN); zero, out of the graph
        h = torch.where(real, h, 0)
    a = swiglu_ref(h, gate_up_layout, activation)
    y = _grouped_linear(a, w2, routing, use_gmm)
    if b2 is not None:
        y = y + b2[row_expert]
    s = routing.row_scores(pair_scores).to(y.dtype)[:, None]
    if real is not None:  # both factors: a padding pair's score may be anything (a NaN or inf there, times the
        # zero row, would reach token T-1, whose index the padding rows carry, and, in the backward, b2's gradient)
        y, s = torch.where(real, y, 0), torch.where(real, s, 0)
    ys = y * s
    out = torch.zeros(routing.num_tokens, x.shape[1], dtype=y.dtype, device=x.device)
    if not x.shape[0]:  # no token (every pair padding): nothing to add; an empty output, still in the graph
        return out + ys.sum(0, keepdim=True)[:0]
    return out.index_add(0, token, ys)
