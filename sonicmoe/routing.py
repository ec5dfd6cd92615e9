"""Router (top-k token choice) and the routing metadata every expert kernel reads (SPEC §2, §3).

A *pair* is one routed (token, expert) choice with its score S. Plain top-k gives R = T·K pairs in
token-major order (pair p = t·K + k); general routing (token rounding, users' own routers) gives any
R pairs with a variable number of experts per token.

The kernels work on *rows*: the pairs sorted by expert (stable), so the rows of expert e are the
contiguous range ``expert_offsets[e] : expert_offsets[e+1]`` of every (R, ·) activation (H, A, Y,
dH, ...). :class:`Routing` holds the index arrays that map between pairs, rows and tokens. It is
built with sorts and searches on the device, without any host-device synchronisation.

Invariants (tested in tests/test_routing.py):
    * ``pair_row[row_pair[r]] == r`` and ``row_pair[pair_row[p]] == p`` (inverse permutations);
    * ``expert_offsets[0] == 0``, ``expert_offsets[E] == R``, ``diff(expert_offsets)`` = counts T_e;
    * ``row_token[r]`` is the token of row r; rows of one expert keep the pairs' order;
    * ``token_offsets[T] == R``; ``token_rows[token_offsets[t]:token_offsets[t+1]]`` are the rows of
      token t, in pair order; ``slot_pair`` is the pair behind each of those slots.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .config import ROUTER_ORDERS

INDEX_DTYPE = torch.int32


@dataclasses.dataclass
class Routing:
    """Routing metadata of R pairs over T tokens and E experts (all int32, on the input's device).

    Attributes:
        num_tokens: T.
        num_experts: E.
        expert_offsets: (E+1,) row range of each expert (exclusive prefix sum of the counts T_e).
        row_token: (R,) token index of each row (expert-major order).
        row_pair: (R,) pair index behind each row.
        pair_row: (R,) row of each pair (inverse of ``row_pair``).
        token_offsets: (T+1,) slot range of each token (exclusive prefix sum of experts per token).
        token_rows: (R,) the row of each token slot (token-major order).
        slot_pair: (R,) the pair behind each token slot; ``None`` when it is the identity
            (pairs already token-major, as with plain top-k).
    """

    num_tokens: int
    num_experts: int
    expert_offsets: torch.Tensor
    row_token: torch.Tensor
    row_pair: torch.Tensor
    pair_row: torch.Tensor
    token_offsets: torch.Tensor
    token_rows: torch.Tensor
    slot_pair: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        """R, the number of routed pairs (rows)."""
        return self.row_token.shape[0]

    def expert_counts(self) -> torch.Tensor:
        """(E,) int32 rows per expert, T_e."""
        return self.expert_offsets[1:] - self.expert_offsets[:-1]

    def row_expert(self) -> torch.Tensor:
        """(R,) int64 expert of each row (derived from ``expert_offsets``)."""
        rows = torch.arange(self.num_rows, device=self.row_token.device, dtype=INDEX_DTYPE)
        return torch.searchsorted(self.expert_offsets[1:], rows, right=True)

    def slot_scores(self, pair_scores: torch.Tensor) -> torch.Tensor:
        """Scores in token-slot order from scores in pair order (a gather of R values)."""
        return pair_scores if self.slot_pair is None else pair_scores[self.slot_pair]

    def row_scores(self, pair_scores: torch.Tensor) -> torch.Tensor:
        """Scores in row (expert-major) order from scores in pair order."""
        return pair_scores[self.row_pair]


def _offsets(sorted_keys: torch.Tensor, num_segments: int) -> torch.Tensor:
    bounds = torch.arange(num_segments + 1, device=sorted_keys.device, dtype=sorted_keys.dtype)
    return torch.searchsorted(sorted_keys, bounds).to(INDEX_DTYPE)


def routing_from_pairs(
    pair_token: torch.Tensor,
    pair_expert: torch.Tensor,
    num_tokens: int,
    num_experts: int,
    *,
    token_major: bool = False,
) -> Routing:
    """Build :class:`Routing` for general routing: any R (token, expert) pairs (SPEC §5.4).

    Args:
        pair_token: (R,) integer token index of each pair, in [0, T).
        pair_expert: (R,) integer expert index of each pair, in [0, E).
        num_tokens: T.
        num_experts: E.
        token_major: promise that ``pair_token`` is non-decreasing (skips one sort).

    Pairs must be unique; a token may have any number (0..E) of experts. No host sync; the index
    ranges are checked by :func:`check_pairs` (which does synchronise) at the public entry points.
    """
    if pair_token.dim() != 1 or pair_expert.shape != pair_token.shape:
        raise ValueError(
            f"pair_token and pair_expert must be 1-D of the same length R, got {tuple(pair_token.shape)}"
            f" and {tuple(pair_expert.shape)}"
        )
    device = pair_token.device
    pair_expert = pair_expert.to(INDEX_DTYPE)
    pair_token = pair_token.to(INDEX_DTYPE)
    r = pair_token.shape[0]
    sorted_expert, row_pair = torch.sort(pair_expert, stable=True)
    row_pair = row_pair.to(INDEX_DTYPE)
    pair_row = torch.empty_like(row_pair)
    pair_row[row_pair.long()] = torch.arange(r, device=device, dtype=INDEX_DTYPE)
    if token_major:
        slot_pair = None
        sorted_token = pair_token
        token_rows = pair_row
    else:
        sorted_token, slot_pair = torch.sort(pair_token, stable=True)
        slot_pair = slot_pair.to(INDEX_DTYPE)
        token_rows = pair_row[slot_pair.long()]
    return Routing(
        num_tokens=num_tokens,
        num_experts=num_experts,
        expert_offsets=_offsets(sorted_expert, num_experts),
        row_token=pair_token[row_pair.long()],
        row_pair=row_pair,
        pair_row=pair_row,
        token_offsets=_offsets(sorted_token, num_tokens),
        token_rows=token_rows,
        slot_pair=slot_pair,
    )


def routing_from_topk(topk_ids: torch.Tensor, num_experts: int) -> Routing:
    """Build :class:`Routing` from top-k expert ids (T, K): pairs p = t·K + k, token-major."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must have shape (T, K), got {tuple(topk_ids.shape)}")
    t, k = topk_ids.shape
    pair_token = torch.arange(t, device=topk_ids.device, dtype=INDEX_DTYPE).repeat_interleave(k)
    return routing_from_pairs(pair_token, topk_ids.reshape(-1), t, num_experts, token_major=True)


def check_pairs(pair_token: torch.Tensor, pair_expert: torch.Tensor, num_tokens: int, num_experts: int):
    """Raise ValueError if any pair index is out of range (synchronises; for public entry points)."""
    for name, idx, hi, letter in (
        ("pair_token", pair_token, num_tokens, "T"),
        ("pair_expert", pair_expert, num_experts, "E"),
    ):
        if idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {idx.dtype}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= hi):
            raise ValueError(f"{name} must lie in [0, {letter}={hi}), got values in "
                             f"[{int(idx.min())}, {int(idx.max())}]")


@dataclasses.dataclass
class RouterOutput:
    """What the router returns for T tokens.

    Attributes:
        logits: (T, E) router logits X W_rᵀ (float32).
        probs: (T, E) softmax over all E logits (float32), used by the auxiliary loss.
        topk_ids: (T, K) int64 chosen experts, by decreasing logit.
        topk_scores: (T, K) float32 scores S of the chosen experts (differentiable).
    """

    logits: torch.Tensor
    probs: torch.Tensor
    topk_ids: torch.Tensor
    topk_scores: torch.Tensor


def router_topk(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    top_k: int,
    *,
    router_order: str = "topk_then_softmax",
    renormalize: bool = False,
) -> RouterOutput:
    """Top-k token-choice router (SPEC §2), computed in float32 (float64 inputs stay float64).

    Args:
        x: (T, d) tokens.
        router_weight: (E, d) router weight W_r.
        top_k: K.
        router_order: ``"topk_then_softmax"``: S = softmax over the K chosen logits.
            ``"softmax_then_topk"``: S = the chosen entries of softmax over all E logits, divided by
            their sum when ``renormalize``.
    """
    if router_order not in ROUTER_ORDERS:
        raise ValueError(f"router_order must be one of {ROUTER_ORDERS}, got {router_order!r}")
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    logits = F.linear(x.to(compute_dtype), router_weight.to(compute_dtype))
    probs = torch.softmax(logits, dim=-1)
    top_logits, topk_ids = torch.topk(logits, top_k, dim=-1)
    if router_order == "topk_then_softmax":
        scores = torch.softmax(top_logits, dim=-1)
    else:
        scores = probs.gather(1, topk_ids)
        if renormalize:
            scores = scores / scores.sum(dim=-1, keepdim=True)
    return RouterOutput(logits=logits, probs=probs, topk_ids=topk_ids, topk_scores=scores)


def load_balancing_loss(probs: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Switch-style auxiliary loss E · Σ_e f_e · P_e (SPEC §2).

    f_e = T_e / R (fraction of routed pairs on expert e, not differentiated), P_e = mean_t probs[t, e].
    Equals 1 for perfectly uniform routing and probabilities.
    """
    counts = routing.expert_counts().float()
    f = counts / counts.sum().clamp_min(1.0)
    p = probs.sum(dim=0) / max(probs.shape[0], 1)  # mean over tokens; 0, not NaN, when T = 0
    return routing.num_experts * torch.sum(f * p)


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss mean_t (logsumexp_e logits[t, e])² (ST-MoE)."""
    return torch.logsumexp(logits, dim=-1).square().sum() / max(logits.shape[0], 1)
