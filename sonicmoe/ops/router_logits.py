"""Router logits X W_rᵀ in float32 from bfloat16 operands, on the tensor cores (SPEC §2 router; §4 router backward).

The router's logits must be float32 (top-k and the softmax read them). With X and W_r in bfloat16, the product of
two bfloat16 numbers is exact in float32, so a bfloat16 GEMM that accumulates and writes float32
(``torch.mm(..., out_dtype=torch.float32)``, cuBLAS on the tensor cores) gives the float32 GEMM of the upcast
operands up to the order of the float32 sums. Upcasting first instead runs a float32 GEMM on the CUDA cores, at
about a tenth of the speed: 0.5 ms of router forward at (T, d, E) = (16384, 1536, 512) on an H100, where the
expert kernels take 1 ms.

Backward, with G = d logits (T, E) in float32: dX = G W_r (T, d) and dW_r = Gᵀ X (E, d). G is split into two
bfloat16 parts, G ≈ G_hi + G_lo with G_hi = bf16(G) and G_lo = bf16(G − G_hi), which carry 16 of float32's 24
significand bits (relative error ≤ 2⁻¹⁷ per element, far below the bfloat16 rounding of dX and dW_r). Each gradient
is one bfloat16 GEMM with float32 accumulation over the concatenated parts: dX = [G_hi, G_lo] [W_r; W_r] (reduction
length 2E) and dW_r = the sum of the two halves of [G_hi; G_lo]ᵀ X. No atomics: cuBLAS GEMMs are deterministic.

Used by :func:`sonicmoe.router_topk` on CUDA when X and W_r are both bfloat16 (``SONICMOE_ROUTER_BF16_GEMM=0``
turns it off); other dtypes, and CPU, keep the float32 GEMM (:func:`router_logits_ref`). On CPU this module runs
the same arithmetic through float32 matmuls (tests).
"""

from __future__ import annotations

import torch

from ..env import env_switch


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(m, k) @ (k, n) of bfloat16 operands, accumulated and returned in float32. CUDA: one cuBLAS bfloat16 GEMM
    with a float32 output. CPU: the float32 matmul of the upcast operands (the same products, exact in float32)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def split_bf16(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo), both bfloat16 of g's shape, with hi = bf16(g) and lo = bf16(g − hi): hi + lo equals the float32 g
    to a relative 2⁻¹⁷ (16 significand bits)."""
    hi = g.to(torch.bfloat16)
    return hi, (g - hi.float()).to(torch.bfloat16)


class RouterLogitsFunction(torch.autograd.Function):
    """logits = X W_rᵀ (T, E) float32 from X (T, d) and W_r (E, d), both bfloat16.

    Memory contract: backward saves X and W_r themselves (the inputs; no copy, nothing of size T·E).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, router_weight)
        return _mm_f32(x, router_weight.t())

    @staticmethod
    def backward(ctx, dlogits: torch.Tensor):
        x, w = ctx.saved_tensors
        dx, dw = logits_grads_f32(dlogits, x, w, *ctx.needs_input_grad[:2])
        return (None if dx is None else dx.to(x.dtype)), (None if dw is None else dw.to(w.dtype))


def logits_grads_f32(dlogits: torch.Tensor, x: torch.Tensor, router_weight: torch.Tensor, need_x: bool = True,
                     need_w: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """float32 dX = G W_r (T, d) and dW_r = Gᵀ X (E, d) for G = ``dlogits`` (T, E), X and W_r bfloat16: G split into
    bfloat16 hi and lo parts, one float32-accumulating bfloat16 GEMM per gradient (module docstring). None where
    not needed."""
    hi, lo = split_bf16(dlogits.float())
    parts = torch.cat([hi, lo], dim=1)  # (T, 2E)
    dx = _mm_f32(parts, torch.cat([router_weight, router_weight], dim=0)) if need_x else None  # (T, 2E) @ (2E, d)
    dw = None
    if need_w:
        both = _mm_f32(parts.t(), x)  # (2E, T) @ (T, d): G_hiᵀ X over G_loᵀ X
        e = router_weight.shape[0]
        dw = both[:e] + both[e:]
    return dx, dw


def _check(x: torch.Tensor, router_weight: torch.Tensor) -> None:
    if x.device != router_weight.device:
        raise ValueError(f"x and router_weight: expected one device, got {x.device} and {router_weight.device}")
    if x.dim() != 2 or router_weight.dim() != 2 or x.shape[1] != router_weight.shape[1]:
        raise ValueError(f"x: expected (T, d) and router_weight (E, d), got {tuple(x.shape)} and "
                         f"{tuple(router_weight.shape)}")
    if x.dtype != torch.bfloat16 or router_weight.dtype != torch.bfloat16:
        raise TypeError(f"x and router_weight: expected bfloat16, got {x.dtype} and {router_weight.dtype} (other "
                        "dtypes take router_logits_ref)")


def router_logits(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """Router logits X W_rᵀ (T, E) in float32, for X (T, d) and W_r (E, d) in bfloat16 (SPEC §2), with autograd.

    The float32 GEMM of the upcast operands up to the order of the float32 sums, on the tensor cores (module
    docstring); gradients of X and W_r in bfloat16, from float32 sums.

    Raises:
        ValueError: shapes that are not (T, d) and (E, d), or tensors on different devices.
        TypeError: an operand that is not bfloat16.
    """
    _check(x, router_weight)
    return RouterLogitsFunction.apply(x, router_weight)


def router_logits_ref(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch twin of :func:`router_logits`: the float32 GEMM of the upcast operands (any float dtype;
    float64 x stays float64; the weight is cast to that dtype, a float64 one beside float32 x rounded to float32)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    return torch.nn.functional.linear(x.to(dtype), router_weight.to(dtype))


def bf16_gemm_applies(x: torch.Tensor, router_weight: torch.Tensor) -> bool:
    """Whether :func:`sonicmoe.router_topk` computes the logits with :func:`router_logits`: CUDA tensors, both
    bfloat16, and ``SONICMOE_ROUTER_BF16_GEMM`` not 0 (0 or 1, default 1; read at each call, on CPU too: any other
    value raises ValueError)."""
    return (env_switch("SONICMOE_ROUTER_BF16_GEMM", True) and x.is_cuda and x.dtype == torch.bfloat16
            and router_weight.dtype == torch.bfloat16)
