"""Token rounding's pair selection (SPEC §5 steps 1-4 and the routing metadata) in one place, and its static-length
form as a PyTorch custom operator for ``torch.compile``.

:func:`select_pairs` runs the selection on the Triton kernels (:mod:`sonicmoe.ops.tr_select`,
:mod:`sonicmoe.ops.tr_routing`) or their torch twins: candidate keys and top-k counts, the rounding decision, the
selection's rank array, then the token-major pairs and their :class:`~sonicmoe.routing.Routing`.

``sonicmoe::tr_static_pairs(probs, topk_ids, topk_scores, u?, m_tile, subroutine, max_pairs)`` is the kernels'
static-length selection as one opaque node. Traced by Dynamo, the launchers' block sizes, which follow T
(``next_pow2(T)``, the selection's register-resident row, the pair kernel's block-sum width), are Triton
constexprs: they fixed T in the graph, so ``MoE(routing="token_rounding")`` under ``torch.compile(dynamic=True)``
compiled again for every token count (seen on an H100 in session 83). Inside the operator they are plain Python
ints; every output's shape follows from the inputs' (R = ``max_pairs``), so the fake implementation needs no data.
Eager calls skip the operator (no dispatch cost); both give the same bits.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..routing import INDEX_DTYPE, Routing


@dataclasses.dataclass
class SelectedPairs:
    """Token rounding's pairs: pair_token, pair_expert (R,) int32 (token-major; padding pairs (T, E) last when
    static), the routing, f (E,) top-k counts, keep (E,) kept counts, pad (E,) bool (rounded up)."""

    pair_token: Tensor
    pair_expert: Tensor
    routing: Routing
    f: Tensor
    keep: Tensor
    pad: Tensor


def select_pairs(probs: Tensor, topk_ids: Tensor, topk_scores: Tensor, u: Tensor | None, m_tile: int,
                 subroutine: str, max_pairs: int | None, kernels: bool) -> SelectedPairs:
    """Token rounding's selection for the (T, E) ``probs`` (ranking values of the candidates), the router's (T, K)
    int64 ``topk_ids`` and ``topk_scores`` and, for ``"stochastic"``, the (E,) float32 draws ``u``.

    ``max_pairs``: R_max (static length, padding pairs last, no host sync) or None (exactly the routed pairs, one
    sync). ``kernels``: the Triton kernels, else the torch twins (same bits). Values only: nothing here carries
    autograd (the scores are computed afterwards from the pairs)."""
    from . import tr_routing, tr_select

    keys = tr_select.candidate_keys if kernels else tr_select.candidate_keys_ref
    decide = tr_routing.round_counts if kernels else tr_routing.round_counts_ref
    select = tr_select.select_routed if kernels else tr_select.select_routed_ref
    to_routing = tr_routing.ranks_routing if kernels else tr_routing.ranks_routing_ref
    prob_key, score_key, counts = keys(probs, topk_ids, topk_scores, block_counts=True)
    f, keep, pad, offsets = decide(counts, m_tile, probs.shape[0], subroutine, u)  # f_e: top-k tokens per expert
    ranks = select(prob_key, score_key, f, keep, rank=True)  # (T, E): row within the expert + 1, 0 if not routed
    del prob_key, score_key
    pair_token, pair_expert, routing = to_routing(ranks, offsets, max_pairs=max_pairs)
    return SelectedPairs(pair_token, pair_expert, routing, f, keep, pad)


def _static_pairs_impl(probs: Tensor, topk_ids: Tensor, topk_scores: Tensor, u: Tensor | None, m_tile: int,
                       subroutine: str, max_pairs: int) -> list[Tensor]:
    """Eager implementation of ``sonicmoe::tr_static_pairs``: the kernels' static-length selection, returned as
    (pair_token, pair_expert, pair_row, row_pair, row_token, token_offsets, expert_offsets, f, keep, pad). Arrays
    the kernels write as views of one buffer are copied (an operator's outputs may not alias)."""
    s = select_pairs(probs, topk_ids, topk_scores, u, m_tile, subroutine, max_pairs, kernels=True)
    r = s.routing
    return [s.pair_token, s.pair_expert.clone(), r.pair_row.clone(), r.row_pair.clone(), r.row_token.clone(),
            r.token_offsets, r.expert_offsets.clone(), s.f.clone(), s.keep.clone(), s.pad]


tr_static_pairs = torch.library.custom_op("sonicmoe::tr_static_pairs", _static_pairs_impl, mutates_args=())


@tr_static_pairs.register_fake
def _static_pairs_fake(probs, topk_ids, topk_scores, u, m_tile, subroutine, max_pairs):
    t, e = probs.shape

    def new(*shape, dtype=INDEX_DTYPE):
        return probs.new_empty(shape, dtype=dtype)

    return [new(max_pairs), new(max_pairs), new(max_pairs), new(max_pairs), new(max_pairs), new(t + 1), new(e + 1),
            new(e), new(e), new(e, dtype=torch.bool)]


def select_static_pairs_compiled(probs: Tensor, topk_ids: Tensor, topk_scores: Tensor, u: Tensor | None,
                                 m_tile: int, subroutine: str, max_pairs: int) -> SelectedPairs:
    """:func:`select_pairs` on the kernels with static length, through ``sonicmoe::tr_static_pairs`` (one node of
    a compiled graph; T stays symbolic)."""
    (pair_token, pair_expert, pair_row, row_pair, row_token, token_offsets, expert_offsets, f, keep,
     pad) = tr_static_pairs(probs.detach(), topk_ids, topk_scores.detach(), u, m_tile, subroutine, max_pairs)
    t, e = probs.shape
    routing = Routing(num_tokens=t, num_experts=e, expert_offsets=expert_offsets, row_token=row_token,
                      row_pair=row_pair, pair_row=pair_row, token_offsets=token_offsets, token_rows=pair_row,
                      slot_pair=None, padded=True)
    return SelectedPairs(pair_token, pair_expert, routing, f, keep, pad)
