"""A small decoder-only transformer language model whose MLPs are :class:`sonicmoe.MoE` layers.

Block: x += Attn(RMSNorm(x)); x += MoE(RMSNorm(x)). Attention is causal multi-head self-attention
with rotary position embeddings through ``F.scaled_dot_product_attention``. The byte embedding is
tied to the output head. Each MoE layer sees its batch as T = B·L tokens of width d.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..modules import MoE


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of :class:`MoETransformer` and the options of its MoE layers.

    Attributes:
        vocab_size: 256 for bytes.
        d_model: d. layers: number of blocks. heads: attention heads (head size d/heads, even).
        experts: E. top_k: K. expert_size: n (each expert's SwiGLU width; W1 is (E, 2n, d), W2 (E, d, n)).
        backend, routing, rounding, m_tile, aux_loss_coef, z_loss_coef, router_order, renormalize,
        routed_scaling_factor, n_group, topk_group: passed to :class:`sonicmoe.MoE`.
        shared_expert_size, shared_expert_gate: the MoE layers' ``shared_intermediate_size`` (0: none) and
            ``shared_expert_gate``.
        activation: the experts' gated activation, ``"swiglu"`` or ``"clamped_swiglu"`` (gpt-oss's clamped SwiGLU).
        router_bias: the router ``gate`` (nn.Linear d -> E) has a bias (gpt-oss).
        expert_bias: the MoE layers' ``bias``: expert biases b1 (E, 2n) and b2 (E, d) (gpt-oss).
    """

    vocab_size: int = 256
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    experts: int = 8
    top_k: int = 2
    expert_size: int = 64
    backend: str = "auto"
    routing: str = "topk"
    rounding: str = "nearest"
    m_tile: int = 128
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    router_order: str = "topk_then_softmax"
    renormalize: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_expert_size: int = 0
    shared_expert_gate: bool = False
    activation: str = "swiglu"
    router_bias: bool = False
    expert_bias: bool = False


def rotary_tables(seq_len: int, head_dim: int, device: torch.device,
                  base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (L, head_dim/2), float32, for rotary position embeddings."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head of x (B, H, L, hd) by the position's angles (in float32)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with rotary embeddings: (B, L, d) -> (B, L, d)."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, l, d = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, l, d))


class Block(nn.Module):
    """Pre-norm transformer block with an MoE MLP: (B, L, d) -> (B, L, d)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.attn_norm = nn.RMSNorm(d, eps=1e-6)
        self.attn = CausalSelfAttention(d, cfg.heads)
        self.mlp_norm = nn.RMSNorm(d, eps=1e-6)
        self.moe = MoE(d, cfg.expert_size, cfg.experts, cfg.top_k, backend=cfg.backend, routing=cfg.routing,
                       rounding=cfg.rounding, m_tile=cfg.m_tile, aux_loss_coef=cfg.aux_loss_coef,
                       z_loss_coef=cfg.z_loss_coef, router_order=cfg.router_order, renormalize=cfg.renormalize,
                       routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.n_group,
                       topk_group=cfg.topk_group, shared_intermediate_size=cfg.shared_expert_size,
                       shared_expert_gate=cfg.shared_expert_gate, activation=cfg.activation,
                       router_bias=cfg.router_bias, bias=cfg.expert_bias, return_router_info=True)
        # the MoE layer's aux_loss + z_loss and expert_counts (E,) of the last forward, as the layer returned them
        self.router_losses: torch.Tensor | None = None
        self.expert_counts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        # the layer's returned values (not its attributes): right under make_graphed_callables too
        y, aux_loss, z_loss, self.expert_counts = self.moe(self.mlp_norm(x))
        self.router_losses = aux_loss + z_loss
        return x + y


class MoETransformer(nn.Module):
    """Decoder-only byte-level language model with MoE MLPs.

    ``forward(idx)`` maps tokens (B, L) int64 to logits (B, L, vocab) float32; ``forward(idx, targets)``
    returns the mean next-token cross-entropy instead. After a forward, :meth:`router_loss` is the sum
    of every MoE layer's ``aux_loss`` and ``z_loss`` (add it to the LM loss when training) and
    :meth:`expert_counts` the (layers, E) pairs per expert, as the layers returned them
    (``return_router_info=True``), so that both stay right when the layers are graphed
    (:func:`sonicmoe.train.loop.graph_moe_layers`).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-6)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) embeddings and attention weights; residual-branch outputs (attention ``proj``, the experts'
        W2 (and b2 with ``expert_bias``) and the shared expert's) scaled by 1/sqrt(2·layers); the MoE layers otherwise
        keep their own init (the router bias zero, b1 as :meth:`sonicmoe.modules.Experts.reset_parameters`)."""
        residual_scale = 1.0 / math.sqrt(2 * self.cfg.layers)
        nn.init.normal_(self.embed.weight, std=0.02)
        for blk in self.blocks:
            nn.init.normal_(blk.attn.qkv.weight, std=0.02)
            nn.init.normal_(blk.attn.proj.weight, std=0.02 * residual_scale)
            for ex in (blk.moe.experts, blk.moe.shared_experts):
                if ex is not None:
                    ex.reset_parameters()
                    with torch.no_grad():
                        for w in (ex.down_proj, ex.down_proj_bias):
                            if w is not None:
                                w.mul_(residual_scale)

    def moe_layers(self) -> list[MoE]:
        """The MoE layer of each block, in order."""
        return [blk.moe for blk in self.blocks]

    def router_loss(self) -> torch.Tensor:
        """Σ over MoE layers of ``aux_loss + z_loss`` from the latest forward (scalar)."""
        return sum(blk.router_losses for blk in self.blocks)

    def expert_counts(self) -> torch.Tensor:
        """(layers, E): the pairs each MoE layer routed to each expert in the latest forward."""
        return torch.stack([blk.expert_counts for blk in self.blocks])

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        _, l = idx.shape
        x = self.embed(idx)
        cos, sin = rotary_tables(l, self.cfg.d_model // self.cfg.heads, idx.device)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        logits = F.linear(self.norm(x), self.embed.weight).float()
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params(self) -> dict[str, int]:
        """Parameter counts: ``total``, ``experts`` (all E experts' W1 and W2) and ``active`` per token
        (total minus the (E − K)/E share of the expert weights)."""
        total = sum(p.numel() for p in self.parameters())
        experts = sum(p.numel() for m in self.moe_layers() for p in m.experts.parameters())
        active = total - experts + experts * self.cfg.top_k // self.cfg.experts
        return {"total": total, "experts": experts, "active": active}
