"""``MoE``: the drop-in layer (router + SwiGLU experts) with the HF transformers parameter layout."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ._autocast import autocast_dtype
from .config import MoEConfig
from .functional import SUPPORTED_DTYPES, _check_float, experts, resolve_backend
from .routing import Routing, load_balancing_loss, router_topk, routing_dense, routing_from_topk, z_loss


class Experts(nn.Module):
    """E SwiGLU experts. Parameters (HF transformers experts convention):

    * ``gate_up_proj`` (E, 2n, d): W1, layout per ``gate_up_layout`` (``"concat"``: rows [0, n) gate,
      [n, 2n) up; ``"interleaved"``: row 2i gate, 2i+1 up);
    * ``down_proj`` (E, d, n): W2;
    * ``gate_up_proj_bias`` (E, 2n) and ``down_proj_bias`` (E, d) when ``bias``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        e, d, n = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * n, d, **kw))
        self.down_proj = nn.Parameter(torch.empty(e, d, n, **kw))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * n, **kw)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, d, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases."""
        d, n = self.gate_up_proj.shape[2], self.down_proj.shape[2]
        for w, fan_in in ((self.gate_up_proj, d), (self.down_proj, n),
                          (self.gate_up_proj_bias, d), (self.down_proj_bias, n)):
            if w is not None:
                bound = 1.0 / math.sqrt(fan_in)
                nn.init.uniform_(w, -bound, bound)


PARAMETER_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class MoELayerOutput(NamedTuple):
    """What ``MoE.forward`` returns with ``return_router_info=True`` (a tuple: unpack it, or read the fields).

    Fields:
        output: O (..., d), as the plain forward returns it.
        aux_loss: the load-balancing loss times ``aux_loss_coef`` (float32 scalar, float64 with float64 experts,
            whose dtype the router's tokens take; a zero without history when the coefficient is 0).
        z_loss: the router z-loss times ``z_loss_coef`` (likewise).
        expert_counts: (E,) the pairs each expert received in this forward (int, no gradient).
    """

    output: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    expert_counts: torch.Tensor


_STRUCTURAL_OPTIONS = ("hidden_size", "intermediate_size", "num_experts", "gate_up_layout", "bias", "router_bias",
                       "shared_intermediate_size", "shared_expert_gate")
"""The MoEConfig fields the parameters are built for (their shapes, or how w1's rows are read): fixed once built."""


class MoE(nn.Module):
    """Sparse Mixture-of-Experts layer with top-k token-choice routing and SwiGLU experts (SPEC §2).

    ``forward(x)``: x (..., d) -> O (..., d), same dtype; with ``return_router_info=True`` a :class:`MoELayerOutput`
    ``(output, aux_loss, z_loss, expert_counts)`` (for ``torch.cuda.make_graphed_callables``, whose replays give
    outputs only and leave the attributes as they were). After each forward, ``aux_loss``
    (Switch load-balancing, already multiplied by ``aux_loss_coef``), ``z_loss`` (times
    ``z_loss_coef``) and ``expert_counts`` (E,) hold that step's values; add the losses to yours.
    A loss whose coefficient is 0 (``z_loss_coef``'s default) is not computed: it reads as a zero scalar of the
    logits' dtype (float32; float64 with float64 experts) without autograd history, and its (T, E) softmax or
    logsumexp never runs. A computed loss keeps its
    forward's autograd graph (and the parameters' gradient accumulators) alive until the next forward: use it in
    the loss, or set it to None, before capturing a CUDA graph after eager calls on another stream.

    Parameters: ``gate.weight`` (E, d) router; ``experts.gate_up_proj`` (E, 2n, d);
    ``experts.down_proj`` (E, d, n); optional biases — the names and shapes of HF transformers' stacked experts
    (Qwen3-MoE), so those checkpoints map one to one; per-expert checkpoints load with
    :func:`sonicmoe.load_hf_experts`. With ``router_bias=True`` the router has ``gate.bias`` (E,) too. gpt-oss: build
    the layer with ``**sonicmoe.GPT_OSS_OPTIONS`` (router bias, expert biases, ``activation="clamped_swiglu"``, the
    interleaved layout) and load its stacked, transposed weights with :func:`sonicmoe.load_gpt_oss_experts`.

    Shared expert (``shared_intermediate_size`` n_s > 0; DeepSeek-V2/V3, Qwen2-MoE): ``shared_experts.gate_up_proj``
    (1, 2n_s, d) in the layer's ``gate_up_layout`` and ``shared_experts.down_proj`` (1, d, n_s), no biases; with
    ``shared_expert_gate=True`` also ``shared_expert_gate.weight`` (1, d). Every token passes through it:
    O_t = Σ_k S_tk · Expert_{e_tk}(x_t) + g_t · Shared(x_t), g_t = sigmoid(x_t · w_g) with the gate, else 1. It runs
    on the experts' own kernels as one expert that every token routes to (:func:`sonicmoe.routing.routing_dense`),
    so its backward keeps H_s (T, 2n_s) beside the X the routed experts keep: 4T·n_s bytes more in bf16. It is
    replicated under expert parallelism, like the router, and stays out of ``aux_loss`` and ``expert_counts``.

    Backends: ``"triton"`` (our kernels, forward and backward), ``"torch"`` (index gather +
    ``torch._grouped_mm``; a loop off-GPU), ``"auto"`` (triton on CUDA, torch otherwise).

    Routing: ``"topk"``, or ``"token_rounding"`` in training (each expert's count rounded to a
    multiple of ``m_tile``, SPEC §5; eval mode always uses plain top-k).

    DeepSeek-V3 routing: ``router_order="sigmoid_then_topk"`` (usually with ``renormalize=True`` and
    ``routed_scaling_factor=2.5``) adds the float32 buffer ``e_score_correction_bias`` (E,), zeros at first, which
    steers the top-k choice and nothing else; :meth:`update_expert_bias` moves it after a step
    (auxiliary-loss-free load balancing). The buffer stays float32 when the layer is cast, and is ``None`` under
    the other orders. Token rounding works under it too (its added pairs scored by their sigmoid), but not with
    group-limited routing (``n_group`` > 1).

    Args: as :class:`~sonicmoe.config.MoEConfig` (``hidden_size``, ``intermediate_size``,
    ``num_experts``, ``top_k``, ...), plus ``device`` and ``dtype`` of the parameters (``meta`` works).

    Inputs: x of any float dtype the backends know (bf16/fp16/fp32/float64) and any strides; it is
    cast to the expert weights' dtype for the computation and the output cast back. The router's weight may have
    another dtype (e.g. ``layer.gate.float()`` beside bf16 experts: its logits are then the float32 GEMM of the
    upcast operands; a float64 router beside float32 experts is rounded to float32; the shared expert must share
    the routed experts' dtype). Under ``torch.autocast``
    (mixed precision with, e.g., float32 parameters) the experts run in the autocast dtype instead: x and the
    expert weights are cast to it, as ``nn.Linear`` casts its input and weight, the output comes back in it,
    and the parameters' gradients in their own dtype; the router's logits stay float32. The parameters must
    be bf16/fp16/fp32 for the triton backend; float64 parameters need ``backend="torch"`` (``"auto"``
    picks it). NaN/Inf in one token's x reach that token's output only (see :func:`sonicmoe.experts`).
    The forward reads no tensor values (no host sync; the torch backend's per-expert loop, which runs where
    ``torch._grouped_mm`` does not, bf16 on Hopper, reads the expert counts): token rounding returns a static number
    of pairs, R_max = :func:`sonicmoe.token_rounding.max_pairs` (the real ones, then padding pairs that no kernel
    computes), so its (R, ·) buffers are up to that bound long; ``static_pairs=False`` sizes them for the
    exact R instead, at the cost of one host sync per forward.

    Raises:
        ValueError: bad options; x whose last dimension is not hidden_size; x on another device.
        TypeError: an unknown option (a misspelt name); a ``dtype`` that is not floating point; x not floating
            point (bf16/fp16/fp32/float64); float64 parameters with the triton backend.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 *, activation: str = "swiglu", device=None, dtype=None, **options):
        super().__init__()
        self.config = MoEConfig(hidden_size, intermediate_size, num_experts, top_k, activation=activation, **options)
        if dtype is not None and dtype not in PARAMETER_DTYPES:
            raise TypeError(f"dtype must be None or one of the parameter dtypes {PARAMETER_DTYPES}, got {dtype!r}")
        c = self.config  # the sizes as Python ints (numpy integers converted)
        hidden_size, intermediate_size, num_experts = c.hidden_size, c.intermediate_size, c.num_experts
        self.gate = nn.Linear(hidden_size, num_experts, bias=self.config.router_bias, device=device, dtype=dtype)
        if self.gate.bias is not None:
            nn.init.zeros_(self.gate.bias)  # no expert preferred at first (gpt-oss's initialisation)
            # (reset_parameters below repeats this init for a layer built on the meta device, after .to_empty)
        self.experts = Experts(self._num_local_experts(), hidden_size, intermediate_size, self.config.bias,
                               device=device, dtype=dtype)
        n_s = self.config.shared_intermediate_size
        self.shared_experts = Experts(1, hidden_size, n_s, device=device, dtype=dtype) if n_s else None
        self.shared_expert_gate = (nn.Linear(hidden_size, 1, bias=False, device=device, dtype=dtype)
                                   if self.config.shared_expert_gate else None)
        bias = None
        if self.config.router_order == "sigmoid_then_topk":  # the router's, replicated under expert parallelism
            bias = torch.zeros(num_experts, device=device, dtype=torch.float32)
        self.register_buffer("e_score_correction_bias", bias)
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.expert_counts: torch.Tensor | None = None

    @property
    def config(self) -> MoEConfig:
        """The layer's options (a frozen :class:`~sonicmoe.config.MoEConfig`). Another one may be assigned, e.g.
        ``layer.config = dataclasses.replace(layer.config, aux_loss_coef=0.02)``: the next forward follows it.

        Raises:
            TypeError: not a MoEConfig.
            ValueError: a new value of an option the parameters were built for (the sizes, ``gate_up_layout``,
                ``bias``, ``router_bias``, the shared expert's, or ``router_order`` to or from
                ``"sigmoid_then_topk"``)."""
        return self._config

    @config.setter
    def config(self, config: MoEConfig) -> None:
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a sonicmoe.MoEConfig, got {type(config).__name__}")
        old = self.__dict__.get("_config")
        if old is not None:  # the parameters and buffers were built for these: another value would misread them
            changed = [f for f in _STRUCTURAL_OPTIONS if getattr(config, f) != getattr(old, f)]
            if (config.router_order == "sigmoid_then_topk") != (old.router_order == "sigmoid_then_topk"):
                changed.append("router_order (e_score_correction_bias exists only under sigmoid_then_topk)")
            if changed:
                raise ValueError(f"config: {', '.join(changed)} shape(s) the layer's parameters and cannot change "
                                 "on a built layer; build a new MoE")
        self._config = config
        # bools read in forward, derived here so that they follow a replaced config (they were set once in __init__:
        # a coefficient or scaling factor changed from 0 or 1 later was ignored) (torch.compile: a comparison of the
        # float in forward made a second graph at 1.0)
        self._scale_scores = config.routed_scaling_factor != 1
        # likewise: a loss whose coefficient is 0 is not computed (no (T, E) softmax or logsumexp, nothing saved)
        self._losses = (config.aux_loss_coef != 0, config.z_loss_coef != 0)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The initialisation of ``__init__`` again, e.g. after building on ``device="meta"`` and ``.to_empty()``:
        the router weight as nn.Linear's, the router bias (``router_bias=True``) and DeepSeek-V3's selection bias
        ``e_score_correction_bias`` zero, the experts' and the shared expert's weights and biases as
        :meth:`Experts.reset_parameters`, the shared expert's gate as nn.Linear's."""
        self.gate.reset_parameters()
        if self.gate.bias is not None:
            nn.init.zeros_(self.gate.bias)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()
        for module in (self.experts, self.shared_experts, self.shared_expert_gate):
            if module is not None:
                module.reset_parameters()

    def __getstate__(self) -> dict:
        """For copy.deepcopy and pickling: the last forward's ``aux_loss``, ``z_loss`` and ``expert_counts`` are left
        out (None in the copy); a loss computed in training mode is a non-leaf tensor of that forward's graph, which
        deepcopy refuses."""
        state = self.__dict__.copy()
        for name in ("aux_loss", "z_loss", "expert_counts"):
            state[name] = None
        return state

    def _apply(self, fn, recurse=True):
        # the selection bias stays float32 under .to(dtype), .half(), ...: DeepSeek-V3's steps of 1e-3 vanish in bf16.
        # _apply replaces buffers, so the float32 values from before are still here to move (casting back the
        # bf16-rounded buffer would keep its rounding)
        old = self.e_score_correction_bias
        super()._apply(fn, recurse)
        b = self.e_score_correction_bias
        if b is not None and b.dtype != torch.float32:
            keep = old.dtype == torch.float32 and (old.device.type != "meta" or b.device.type == "meta")
            self.e_score_correction_bias = (old if keep else b).to(b.device, torch.float32)
        return self

    @torch.no_grad()
    def update_expert_bias(self, rate: float = 1e-3, counts: torch.Tensor | None = None, group=None) -> None:
        """Auxiliary-loss-free load balancing (DeepSeek-V3, ``router_order="sigmoid_then_topk"``): each expert's
        ``e_score_correction_bias`` moves by ``rate`` toward balance, b_e += rate · sign(mean(c) − c_e), so that
        an overloaded expert is chosen less often in the next steps. No host sync.

        Args:
            rate: the update speed γ (DeepSeek-V3: 1e-3), a float > 0.
            counts: (E,) the tokens each expert received over the step (summed over micro-batches, say); default
                the last forward's ``expert_counts``.
            group: a process group to sum ``counts`` over first (an all-reduce; every rank then makes the same
                update): the data-parallel group, so that replicas of the router stay equal. Default: none.

        Raises:
            RuntimeError: the layer has no bias (another ``router_order``), or no counts yet (no forward).
            ValueError: ``rate`` not a positive float; ``counts`` not of shape (E,).
        """
        b = self.e_score_correction_bias
        if b is None:
            raise RuntimeError("update_expert_bias needs router_order='sigmoid_then_topk' (the only order with "
                               f"a selection bias); this layer has {self.config.router_order!r}")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
            raise ValueError(f"rate must be a finite float > 0, got {rate!r}")
        c = self.expert_counts if counts is None else counts
        if c is None:
            raise RuntimeError("update_expert_bias: no expert counts yet; run a forward first or pass counts=")
        if not isinstance(c, torch.Tensor) or tuple(c.shape) != tuple(b.shape):
            raise ValueError(f"counts must be a tensor of shape (E={b.shape[0]},), got "
                             f"{tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__}")
        c = c.to(device=b.device, dtype=torch.float32, copy=True)
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(c, group=group)
        b.add_(torch.sign(c.mean() - c), alpha=float(rate))

    def extra_repr(self) -> str:
        """The sizes, the options every layer names, then each other option that is not its default: layers
        configured differently print differently."""
        c = self.config
        shared = f", shared n_s={c.shared_intermediate_size}" if c.shared_intermediate_size else ""
        gated = " (gated)" if c.shared_expert_gate else ""
        named = {"hidden_size", "intermediate_size", "num_experts", "top_k", "router_order", "gate_up_layout",
                 "activation", "backend", "routing", "shared_intermediate_size", "shared_expert_gate", "m_tile",
                 "rounding"}
        if c.routing != "token_rounding":  # static_pairs is read under token rounding only
            named.add("static_pairs")
        rounding = f", m_tile={c.m_tile}, rounding={c.rounding}" if c.routing == "token_rounding" else ""
        rest = "".join(f", {f.name}={getattr(c, f.name)!r}" for f in dataclasses.fields(c)
                       if f.name not in named and getattr(c, f.name) != f.default)
        return (f"d={c.hidden_size}, n={c.intermediate_size}, E={c.num_experts}, K={c.top_k}, "
                f"router_order={c.router_order}, layout={c.gate_up_layout}, activation={c.activation}, "
                f"backend={c.backend}, "
                f"routing={c.routing}{rounding}{shared}{gated}{rest}")

    def _num_local_experts(self) -> int:
        """How many of the E experts this layer holds the weights of (all of them; expert parallelism holds E/P)."""
        return self.config.num_experts

    def _route(self, router) -> tuple[Routing, torch.Tensor]:
        """The routing (top-k, or token rounding in training) and the (R,) pair scores from the router's output."""
        c = self.config
        if c.routing == "token_rounding" and self.training:
            from .token_rounding import token_rounding

            # the router is router_topk's with this order: the chosen pairs' score gradient can skip its top-k backward
            tr = token_rounding(router, m_tile=c.m_tile, subroutine=c.rounding, router_order=c.router_order,
                                renormalize=c.renormalize, static=c.static_pairs, fused_router_grad=True)
            routing = tr.routing  # routing_from_pairs(..., token_major=True, padding=c.static_pairs), sort-free
            pair_scores = tr.pair_scores
        else:
            routing = routing_from_topk(router.topk_ids, c.num_experts)
            pair_scores = router.topk_scores.reshape(-1)
        return routing, pair_scores

    def _run_experts(self, x2: torch.Tensor, routing: Routing, pair_scores: torch.Tensor, backend: str):
        """O (T, d): the experts and aggregation for x2 (T, d) under ``routing``."""
        c, ex = self.config, self.experts
        return experts(x2, ex.gate_up_proj, ex.down_proj, routing, pair_scores, ex.gate_up_proj_bias,
                       ex.down_proj_bias, gate_up_layout=c.gate_up_layout, backend=backend, activation=c.activation)

    def _run_shared_expert(self, x2: torch.Tensor, backend: str) -> torch.Tensor:
        """(T, d): the shared expert on every token of x2 (T, d), times its gate sigmoid(x2 · w_g) or 1; one expert
        that every token routes to once, on the same kernels as the routed experts."""
        t, dtype = x2.shape[0], torch.promote_types(x2.dtype, torch.float32)
        if self.shared_expert_gate is None:
            scores = x2.new_ones(t, dtype=dtype)
        else:  # the gate's logit in x2's dtype (a bf16 GEMM under bf16 or autocast), its sigmoid in float32 (or 64)
            w_g = self.shared_expert_gate.weight
            scores = torch.sigmoid(F.linear(x2, w_g.to(x2.dtype)).reshape(t).to(dtype))
        se = self.shared_experts
        return experts(x2, se.gate_up_proj, se.down_proj, routing_dense(t, x2.device), scores,
                       gate_up_layout=self.config.gate_up_layout, backend=backend, activation=self.config.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """O (..., d) = Σ_k S_tk · Expert_{e_tk}(x_t) (+ the shared expert), SPEC §2-§5.

        Args:
            x: (..., d) tokens (T = the product of the leading dimensions; (T, d), (B, S, d), ...), bf16/fp16/fp32
                (float64 with the torch backend), on the parameters' device, any strides; not modified.

        Returns:
            O of x's shape, in x's dtype (under ``torch.autocast``: the autocast dtype); with
            ``return_router_info=True`` a :class:`MoELayerOutput` (output, aux_loss, z_loss, expert_counts).
            Sets ``self.aux_loss`` and ``self.z_loss`` (0-d float32 tensors, float64 with float64 experts, already
            scaled by their coefficients; add them to the training loss) and ``self.expert_counts`` (E,), the pairs
            each expert received (no gradient).

        Raises:
            TypeError: x not a floating tensor of those dtypes; float64 parameters with ``backend="triton"``.
            ValueError: x's last dimension not ``hidden_size``, or x on another device than the parameters.
        """
        c = self.config
        _check_float("x", x, allow_float64=True)
        if x.dim() < 1 or x.shape[-1] != c.hidden_size:
            raise ValueError(f"x must have shape (..., hidden_size={c.hidden_size}), got {tuple(x.shape)}")
        if x.device != self.gate.weight.device:
            raise ValueError(f"x is on {x.device} but the MoE parameters are on {self.gate.weight.device}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, c.hidden_size)
        # the experts run in their weights' dtype, or under torch.autocast in its dtype (float64 parameters excepted,
        # as autocast leaves them); the router may keep float32 weights beside bf16 experts (its logits are a float32
        # GEMM of the upcast operands then)
        w_dtype = self.experts.gate_up_proj.dtype
        amp = autocast_dtype(x.device) if w_dtype != torch.float64 else None
        compute = amp if amp is not None else w_dtype
        if x2.dtype != compute:
            x2 = x2.to(compute, memory_format=torch.contiguous_format)
        x2 = x2.contiguous()  # strides never change the bits (the router GEMM's did); a no-op when contiguous
        router = router_topk(x2, self.gate.weight, c.top_k, router_order=c.router_order,
                             renormalize=c.renormalize, expert_bias=self.e_score_correction_bias, n_group=c.n_group,
                             topk_group=c.topk_group, router_bias=self.gate.bias)
        backend = resolve_backend(c.backend, x2)
        if x2.device.type == "meta":
            backend = "torch"
        if backend == "triton" and x2.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"the MoE parameters are {x2.dtype}, which backend='triton' does not run; use "
                            "bfloat16/float16/float32 parameters or backend='torch'")
        routing, pair_scores = self._route(router)
        if self._scale_scores:
            pair_scores = pair_scores * c.routed_scaling_factor
        out = self._run_experts(x2, routing, pair_scores, backend)
        if self.shared_experts is not None:
            out = out + self._run_shared_expert(x2, backend)
        aux, z = self._losses
        zero = router.logits.new_zeros(()) if not (aux and z) else None
        self.aux_loss = c.aux_loss_coef * load_balancing_loss(router.probs, routing) if aux else zero
        self.z_loss = c.z_loss_coef * z_loss(router.logits) if z else zero
        self.expert_counts = routing.expert_counts().detach()
        out = out.reshape(*lead, c.hidden_size).to(x.dtype if amp is None else amp)
        if c.return_router_info:
            return MoELayerOutput(out, self.aux_loss, self.z_loss, self.expert_counts)
        return out
