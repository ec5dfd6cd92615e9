"""Layer options in one dataclass (SPEC §2, §5).

Letters (SPEC §1): T tokens, d hidden size, n expert intermediate size, E experts, K top-k.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal

RouterOrder = Literal["topk_then_softmax", "softmax_then_topk", "sigmoid_then_topk"]
GateUpLayout = Literal["concat", "interleaved"]
Activation = Literal["swiglu", "clamped_swiglu"]
Backend = Literal["auto", "triton", "torch"]
RoutingMode = Literal["topk", "token_rounding"]
RoundingSubroutine = Literal["nearest", "up", "down", "stochastic", "balance"]

ROUTER_ORDERS = ("topk_then_softmax", "softmax_then_topk", "sigmoid_then_topk")
GATE_UP_LAYOUTS = ("concat", "interleaved")
ACTIVATIONS = ("swiglu", "clamped_swiglu")
# gpt-oss's clamped SwiGLU (transformers' GptOssExperts): A = (clamp(up, -L, L) + 1) · g σ(α g), g = min(gate, L)
CLAMPED_SWIGLU_ALPHA = 1.702
CLAMPED_SWIGLU_LIMIT = 7.0
BACKENDS = ("auto", "triton", "torch")
ROUTING_MODES = ("topk", "token_rounding")
ROUNDING_SUBROUTINES = ("nearest", "up", "down", "stochastic", "balance")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Options of one MoE layer.

    Attributes:
        hidden_size: d, the model width.
        intermediate_size: n, each expert's SwiGLU width (W1 has 2n rows, W2 has n columns).
        num_experts: E.
        top_k: K, experts chosen per token (1 <= K <= E).
        router_order: ``"topk_then_softmax"`` (scores = softmax over the K chosen logits; SonicMoE,
            Mixtral) or ``"softmax_then_topk"`` (softmax over all E logits, then top-k; Qwen3-MoE, OLMoE).
            ``"sigmoid_then_topk"``: sigmoid of each logit, top-k of the sigmoid plus the layer's
            ``e_score_correction_bias`` (E,) (selection only: auxiliary-loss-free load balancing,
            :meth:`sonicmoe.MoE.update_expert_bias`), S = the chosen sigmoids (DeepSeek-V3).
        renormalize: with ``softmax_then_topk`` or ``sigmoid_then_topk``, divide the K chosen
            probabilities by their sum (Qwen3 and DeepSeek-V3 ``norm_topk_prob``; with sigmoid, by the sum
            + 1e-20). Ignored for ``topk_then_softmax`` (already normalised).
        routed_scaling_factor: a constant every score S is multiplied by (DeepSeek-V3: 2.5); 1.0 by default.
        n_group, topk_group: group-limited routing under ``sigmoid_then_topk`` (DeepSeek-V3: 8 and 4): each token
            picks its K experts within its ``topk_group`` best of ``n_group`` groups of consecutive experts
            (:func:`sonicmoe.routing.router_topk`); 1, 1 (default): no groups.
        gate_up_layout: row layout of W1 (E, 2n, d). ``"concat"``: rows [0, n) are the gate projection
            and rows [n, 2n) the up projection (HF transformers / torchtitan convention).
            ``"interleaved"``: row 2i is gate channel i and row 2i+1 up channel i.
        activation: the experts' gated activation A = act(gate, up) of H's two halves (SPEC §2). ``"swiglu"``:
            silu(gate) · up. ``"clamped_swiglu"`` (gpt-oss): g = min(gate, 7), u = clamp(up, -7, 7),
            A = (u + 1) · g · sigmoid(1.702 g); the clamps pass no gradient where they bind (as torch.clamp's, which
            passes it at the bounds themselves). The shared expert, if any, uses the same activation.
        router_bias: the router's linear map has a bias, ``gate.bias`` (E,), zeros at first: logits = x W_rᵀ + b_r
            (gpt-oss).
        bias: expert biases b1 (E, 2n) and b2 (E, d).
        aux_loss_coef: weight of the Switch load-balancing loss E·Σ_e f_e·P_e (SPEC §2).
        z_loss_coef: weight of the router z-loss mean_t (logsumexp_e logits)^2.
        backend: ``"triton"`` (our kernels), ``"torch"`` (index gather + ``torch._grouped_mm``) or
            ``"auto"`` (triton on CUDA, torch elsewhere).
        routing: ``"topk"`` or ``"token_rounding"`` (SPEC §5; training only, eval uses top-k).
        rounding: token-rounding subroutine (``nearest``, ``up``, ``down``, ``stochastic``, ``balance``).
        m_tile: M_tile, the tile height token rounding rounds each expert's count to (tokens; 1 to 2^24).
        static_pairs: token rounding in its static-length form (``token_rounding(static=True)``): no host
            sync, CUDA-graph capturable, but the (R, ·) activations (H is R·2n) are sized for R_max =
            :func:`sonicmoe.token_rounding.max_pairs` pairs, up to E·(M_tile−1)/2 rows above T·K with
            ``nearest``. False: exactly R pairs, one host sync per forward.
        return_router_info: ``MoE.forward`` returns a :class:`sonicmoe.MoELayerOutput` ``(output, aux_loss,
            z_loss, expert_counts)`` instead of O alone (the values also left in the layer's attributes). For
            wrappers that see only a callable's outputs, such as ``torch.cuda.make_graphed_callables``: a replay of
            a graphed layer updates none of its attributes (and an eval-mode forward in between replaces them), the
            returned values are the replay's.
        shared_intermediate_size: n_s, the width of a *shared expert*: one more SwiGLU MLP that every token passes
            through, its output added to the routed experts' (DeepSeek-V2/V3: ``n_shared_experts`` ×
            ``moe_intermediate_size``; Qwen2-MoE: ``shared_expert_intermediate_size``). 0 (default): none.
        shared_expert_gate: scale the shared expert's output per token by sigmoid(x · w_g), w_g the (1, d)
            ``shared_expert_gate.weight`` (Qwen2-MoE); needs ``shared_intermediate_size`` > 0. False: scale 1
            (DeepSeek-V2/V3).
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    router_order: RouterOrder = "topk_then_softmax"
    renormalize: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    gate_up_layout: GateUpLayout = "concat"
    bias: bool = False
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    backend: Backend = "auto"
    routing: RoutingMode = "topk"
    rounding: RoundingSubroutine = "nearest"
    m_tile: int = 128
    static_pairs: bool = True
    return_router_info: bool = False
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    activation: Activation = "swiglu"
    router_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k", "n_group", "topk_group", "m_tile",
                     "shared_intermediate_size"):  # numpy and other integral scalars (not bools) as Python ints
            v = getattr(self, name)
            if isinstance(v, numbers.Integral) and not isinstance(v, (bool, int)):
                object.__setattr__(self, name, int(v))
        for name in ("hidden_size", "intermediate_size", "num_experts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k must be an int in [1, num_experts={self.num_experts}], got {self.top_k!r}"
            )
        check_m_tile(self.m_tile)
        n_s = self.shared_intermediate_size
        if isinstance(n_s, bool) or not isinstance(n_s, int) or n_s < 0:
            raise ValueError(f"shared_intermediate_size must be an int >= 0 (0: no shared expert), got {n_s!r}")
        for name in ("renormalize", "bias", "static_pairs", "shared_expert_gate", "return_router_info", "router_bias"):
            check_flag(name, getattr(self, name))
        for name in ("aux_loss_coef", "z_loss_coef", "routed_scaling_factor"):  # numpy and other real scalars
            v = getattr(self, name)  # (np.float32 is no float) as Python floats, as the sizes above
            if isinstance(v, numbers.Real) and not isinstance(v, (bool, int, float)):
                object.__setattr__(self, name, float(v))
        for name in ("aux_loss_coef", "z_loss_coef"):  # a string or None would fail only in the forward, NaN silently
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.shared_expert_gate and not n_s:
            raise ValueError("shared_expert_gate=True gates a shared expert: it needs shared_intermediate_size > 0")
        _check_choice("router_order", self.router_order, ROUTER_ORDERS)
        from .routing import check_expert_groups, check_scaling_factor  # (routing imports this module)

        check_scaling_factor(self.routed_scaling_factor)
        check_expert_groups(self.n_group, self.topk_group, self.num_experts, self.top_k, self.router_order)
        if self.routing == "token_rounding" and self.n_group > 1:
            raise ValueError(f"routing='token_rounding' adds pairs regardless of expert groups: it needs n_group=1 "
                             f"(no group-limited routing), got n_group={self.n_group}")
        _check_choice("gate_up_layout", self.gate_up_layout, GATE_UP_LAYOUTS)
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("routing", self.routing, ROUTING_MODES)
        _check_choice("rounding", self.rounding, ROUNDING_SUBROUTINES)


def check_flag(name: str, v) -> None:
    """ValueError naming ``name`` unless ``v`` is a bool (a string such as ``"no"`` would otherwise read as True)."""
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be a bool, got {v!r}")


MAX_M_TILE = 1 << 24  # the token-rounding kernels count in int32 (2·M_tile among their terms)


def check_m_tile(m_tile) -> None:
    """ValueError naming ``m_tile`` unless it is an int (not a bool) in [1, 2^24] (token rounding's M_tile)."""
    if isinstance(m_tile, bool) or not isinstance(m_tile, int) or not 1 <= m_tile <= MAX_M_TILE:
        raise ValueError(f"m_tile must be an int in [1, {MAX_M_TILE}] (rows of a tile), got {m_tile!r}")
