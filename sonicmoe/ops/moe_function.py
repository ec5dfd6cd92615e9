"""The expert layer as one autograd Function on the Triton kernels (SPEC §3 forward, §4 backward)."""

from __future__ import annotations

import torch

from ..routing import Routing
from .aggregation import gather_sum
from .dh import dh
from .grouped_gemm import down_proj, varlen_m_gemm
from .up_proj import up_proj
from .weight_grad import varlen_k_gemm

_ROUTING_FIELDS = ("expert_offsets", "row_token", "row_pair", "pair_row", "token_offsets", "token_rows",
                   "slot_pair")


class MoEExpertsFunction(torch.autograd.Function):
    """Experts + aggregation with the memory-lean backward.

    Forward (3 kernels): up-projection (gather X rows in the load, SwiGLU epilogue) -> H, A;
    down-projection -> Y; aggregation O_t = Σ S · Y. A and Y are freed before returning.

    Memory contract — what backward saves (``ctx.saved_tensors``), and nothing else:
        * X (T, d) — the layer input (the caller holds it anyway);
        * H (R, 2n) — the up-projection output before the activation, in W1's gate/up layout;
        * S in row order (R,) float32;
        * the routing metadata (int32: E+1, 5·R-ish and T+1 entries);
        * the weights W1, W2 (and biases), which are parameters, not activations.
    So the activations held are 2Td + 4TKn bytes in bf16 (plus metadata), the same as a dense MLP
    with the same activated parameters; never gathered X, A, Y or any (R, d) tensor.

    Backward (5 kernels): dH kernel (dA′ = dO W2[e] with dO rows gathered, A recomputed from H,
    dS = ⟨dA′, A⟩, dH, A′ = S·A); dW2 and dW1 varlen-K GEMMs with row gathers; dX̃ = dH W1[e];
    dX gather-and-sum. Biases: dS += ⟨dO_t, b2[e]⟩, db2[e] = Σ S dO_t, db1[e] = Σ dH rows.
    Everything is deterministic (no atomics).
    """

    @staticmethod
    def forward(ctx, x, w1, w2, b1, b2, pair_scores, routing: Routing, gate_up_layout: str):
        row_scores = routing.row_scores(pair_scores).float()
        h, a = up_proj(x, w1, b1, routing, gate_up_layout, store_h=True)
        y = down_proj(a, w2, b2, routing)
        del a
        out = gather_sum(y, routing, routing.slot_scores(pair_scores).float())
        del y
        ctx.save_for_backward(x, h, row_scores, w1, w2, b1, b2,
                              *(getattr(routing, f) for f in _ROUTING_FIELDS))
        ctx.routing_sizes = (routing.num_tokens, routing.num_experts)
        ctx.gate_up_layout = gate_up_layout
        ctx.scores_dtype = pair_scores.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        x, h, row_scores, w1, w2, b1, b2, *rt = ctx.saved_tensors
        routing = Routing(*ctx.routing_sizes, **dict(zip(_ROUTING_FIELDS, rt, strict=True)))
        need_x, need_w1, need_w2, need_b1, need_b2, need_s = ctx.needs_input_grad[:6]
        dout = dout.contiguous()
        dh_, a_prime, ds = dh(dout, w2, h, row_scores, routing, ctx.gate_up_layout)
        dx = dw1 = dw2 = db1 = db2 = dscores = None
        if need_s:
            if b2 is not None:
                dob2 = dout.float() @ b2.float().t()
                ds = ds + dob2[routing.row_token.long(), routing.row_expert()]
            dscores = ds[routing.pair_row.long()].to(ctx.scores_dtype)
        if need_w2:
            dw2 = varlen_k_gemm(dout, a_prime, routing, p_gather=True, q_gather=False, out_dtype=w2.dtype)
        if need_b2:
            s_col = row_scores.to(dout.dtype)[:, None]
            db2 = varlen_k_gemm(s_col, dout, routing, p_gather=False, q_gather=True, out_dtype=b2.dtype)[:, 0]
        del a_prime
        if need_x:
            dx = gather_sum(varlen_m_gemm(dh_, w1, None, routing, transpose_b=False), routing, None)
        if need_w1:
            dw1 = varlen_k_gemm(dh_, x, routing, p_gather=False, q_gather=True, out_dtype=w1.dtype)
        if need_b1:
            ones = torch.ones(routing.num_rows, 1, device=dh_.device, dtype=dh_.dtype)
            db1 = varlen_k_gemm(ones, dh_, routing, p_gather=False, q_gather=False, out_dtype=b1.dtype)[:, 0]
        return dx, dw1, dw2, db1, db2, dscores, None, None


def experts_triton(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    routing: Routing,
    pair_scores: torch.Tensor,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    *,
    gate_up_layout: str = "concat",
) -> torch.Tensor:
    """Experts + aggregation on the Triton kernels; same signature as :func:`sonicmoe.experts`.

    With gradients enabled this is :class:`MoEExpertsFunction` (memory contract there). Without
    (``torch.no_grad``/inference), the up-projection skips writing H.

    Args:
        x: (T, d). w1: (E, 2n, d), gate/up layout ``gate_up_layout``. w2: (E, d, n).
        routing: R pairs. pair_scores: (R,). b1: (E, 2n) or None. b2: (E, d) or None.
    Returns:
        O (T, d) in x's dtype.
    """
    x = x.contiguous()
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, w1, w2, b1, b2, pair_scores)
    )
    if needs_grad:
        return MoEExpertsFunction.apply(x, w1, w2, b1, b2, pair_scores, routing, gate_up_layout)
    _, a = up_proj(x, w1, b1, routing, gate_up_layout, store_h=False)
    y = down_proj(a, w2, b2, routing)
    del a
    return gather_sum(y, routing, routing.slot_scores(pair_scores).float())
