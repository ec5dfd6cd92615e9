"""Token rounding (TR): training-time routing whose per-expert token counts are tile multiples (SPEC §5).

Grouped GEMMs pad every expert's rows up to a multiple of M_tile (the tile height along tokens). When
the number of tokens T_e routed to an expert is small, that padding is wasted work. Token rounding
starts from top-k routing and moves each expert's count f_e to a neighbouring multiple of M_tile:

1. Top-k gives f_e, the number of (token, expert) pairs on expert e. On the M_tile grid, let
   ``lo_e = ⌊f_e⌋`` and ``hi_e = ⌈f_e⌉`` (f_e rounded down / up to a multiple of M_tile).
2. Each expert ranks its candidate tokens: the tokens that chose it (top-k) first, by decreasing
   score S, then all other tokens by decreasing router probability ``probs[t, e]`` (softmax over E; under
   ``"sigmoid_then_topk"`` the sigmoid of the logit, whose order within an expert is its selection key's: the
   expert's bias is the same for every token).
   Ranking compares values rounded to float32 (exact for the usual float32 router; a float64 router's
   values closer than float32 precision count as equal). A NaN score ranks first among the chosen tokens (as
   +inf: an expert rounding down keeps a NaN token, whose output then stays NaN as top-k's would, instead of
   dropping it first and giving it a finite output), a NaN probability last among the others. Ties are broken
   by the lower token index.
3. A *subroutine* decides per expert whether to pad (keep ``hi_e``: all chosen tokens plus the best
   ``hi_e − f_e`` non-chosen ones) or not (keep ``lo_e``: drop the ``f_e − lo_e`` lowest-scored
   chosen tokens). An expert with f_e already a multiple of M_tile keeps exactly its top-k tokens.

   * ``"nearest"`` (default): pad iff ``hi_e − f_e < f_e − lo_e``; an exact tie (f_e − lo_e =
     M_tile/2) rounds **down** (fewer rows, less work; the literal rule of SPEC §5).
   * ``"up"``: always pad. ``"down"``: never pad.
   * ``"stochastic"``: pad with probability ``(f_e − lo_e) / M_tile`` (one uniform draw per expert
     from ``generator``), so the expected count equals f_e.
   * ``"balance"``: walk the experts in index order keeping a running residual
     r = Σ_{j≤e} (rounded_j − f_j) and choose, per expert, the option with the smaller |r| (ties
     round down). This is the same as rounding the prefix sums of f to the nearest multiple of
     M_tile, which is how it is computed (a cumsum, no sequential loop); it guarantees
     ``−M_tile/2 ≤ Σ_e rounded_e − Σ_e f_e < M_tile/2``.

4. The output is *general routing*: R pairs, a variable number of experts per token (a token may end
   with none). Feed it to :func:`sonicmoe.routing.routing_from_pairs`.

Guarantees (for every expert e):
    * ``|count_e − f_e| < M_tile`` (within one tile of top-k);
    * ``count_e`` is a multiple of M_tile — except the *cap edge* below;
    * a padded expert keeps all its chosen tokens and adds the non-chosen ones of highest
      probability; a rounded-down expert keeps its highest-scored chosen tokens and adds none;
    * pairs are unique.

Cap edge: an expert cannot hold more than T distinct tokens. When the padding decision is taken but
``hi_e > T`` (only possible when T is not a multiple of M_tile and ``f_e > M_tile·⌊T/M_tile⌋``, i.e.
nearly every token chose e), the expert keeps all T tokens: a count that is not a tile multiple but
occupies the same ⌈f_e/M_tile⌉ tiles as top-k itself, so no tile is added. Decisions are always taken
on the M_tile grid (uncapped ``hi_e``) and the cap is applied afterwards; ``"balance"``'s bound on the
total therefore holds exactly only when no padded expert is capped (each capped expert lowers the
total by ``hi_e − T``).

Caveat: quality holds when the mean number of tokens per expert, T·K/E, is at least 2·M_tile;
below that, rounding moves a large fraction of each expert's tokens and routing drifts far from
top-k. :func:`token_rounding` warns there. Use it in training only; evaluation/inference uses top-k.

Scores of the output pairs (differentiable w.r.t. the router logits):
    * a kept top-k pair has its top-k score S_{t,k} (``router.topk_scores``, unchanged);
    * an *added* pair (t, e) gets the score top-k would give it with the same normalisation:
      ``"topk_then_softmax"``: ``exp(logits[t, e] − logsumexp_k logits[t, topk_ids[t, k]])`` (the
      softmax over the token's K chosen logits, extended to e); ``"softmax_then_topk"``:
      ``probs[t, e]``, divided by ``Σ_k probs[t, topk_ids[t, k]]`` when ``renormalize``;
      ``"sigmoid_then_topk"`` (DeepSeek-V3): ``sigmoid(logits[t, e])``, divided by
      ``Σ_k sigmoid(logits[t, topk_ids[t, k]]) + 1e-20`` when ``renormalize``. (The layer then multiplies every
      pair's score by ``routed_scaling_factor``.)
    A token's scores are not renormalised over its final expert set. Token rounding ignores group-limited routing
    (an added pair may lie outside the token's groups), so :class:`~sonicmoe.MoEConfig` refuses the two together.

Implementation (:func:`token_rounding`), on the router's device (Triton kernels on CUDA, their torch twins
elsewhere), with no sort and, by default, no host sync:
    * keys (:mod:`sonicmoe.ops.tr_select`): each expert's row of candidates as exact int32 keys — the top-k score of
      its chosen tokens, the router probability of the others — and per-block counts of the chosen ones, which
      torch sums into f_e;
    * the decision (:func:`sonicmoe.ops.tr_routing.round_counts`, one program): f_e, the kept count, the padding
      flag and the experts' row offsets;
    * selection: per expert, the ``count_e`` best chosen tokens (rounded down) or all chosen plus the
      ``count_e − f_e`` best others (rounded up), found by a search for the threshold key (no sort; a bisection of
      the row held in registers for T <= 32768, a 4-way search streaming it beyond); a (T, E) int32 array holds,
      at each routed pair, its token's rank within the expert (its row, plus one);
    * pairs and routing (:func:`sonicmoe.ops.tr_routing.ranks_routing`, two kernels): each token's routed experts
      counted, then R_max token-major pairs listed, padding last (``static=True``, no sync), or exactly R
      (``static=False``: **one host sync**, since R is data-dependent), with the pair arrays and the
      :class:`~sonicmoe.routing.Routing` of the pairs, each pair's row read from its rank (no sort); the torch path
      lists the pairs with ``torch.nonzero_static`` / ``torch.nonzero``;
    * scores (:mod:`sonicmoe.ops.tr_scores`): each pair's top-k slot (if any) and score in one kernel,
      and in the backward the gradients of the router's logits (or probs) and top-k scores in one more
      (per token, dense rows: no scatter, no atomics, no sort).
    * memory: two transient (E, T) int32 key arrays and the (T, E) int32 rank array (12·T·E bytes, 96 MiB at
      T = 16384, E = 512) plus a few (R, K) arrays.

:func:`token_rounding_ref` is a plain Python/PyTorch per-expert loop with the same signature and
output, used as the test oracle.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from ._device import on_device
from .config import ROUNDING_SUBROUTINES, ROUTER_ORDERS, check_flag, check_m_tile
from .routing import INDEX_DTYPE, RouterOutput, Routing, check_size, check_topk_ids, is_integer_dtype


def warn_if_few_tokens(tokens_per_expert: float, m_tile: int) -> None:
    """Token rounding loses quality below 2 tiles of tokens per expert (SPEC §5): warn there.

    ``stacklevel`` points at the caller of :func:`token_rounding` (the ``MoE`` layer's routing step when the layer
    calls it). Silent while
    ``torch.compile`` traces: Dynamo cannot trace ``warnings.warn``, so a warning there would fail a
    ``fullgraph=True`` compile (and break the graph otherwise).
    """
    if 0 < tokens_per_expert < 2 * m_tile and not torch.compiler.is_compiling():  # (no token: nothing to warn of)
        warnings.warn(
            f"token rounding with {tokens_per_expert:.0f} mean tokens per expert < 2·M_tile={2 * m_tile}: "
            "routing drifts far from top-k and quality may drop; use larger batches or plain top-k",
            stacklevel=3,
        )


@dataclasses.dataclass
class TokenRoundingOutput:
    """Routed pairs after token rounding (R pairs over T tokens and E experts).

    Pair order: token-major, sorted by (token, expert) — pass ``token_major=True`` to
    :func:`~sonicmoe.routing.routing_from_pairs`, which skips a sort then.

    Attributes:
        pair_token: (R,) int32 token of each pair, in [0, T).
        pair_expert: (R,) int32 expert of each pair, in [0, E).
        pair_scores: (R,) score S of each pair in ``topk_scores``' dtype, differentiable w.r.t. the
            router logits (see the module docstring for added pairs).
        pair_added: (R,) bool, True for pairs that top-k did not choose (added by padding).
        counts: (E,) int32 tokens kept per expert, T_e (a multiple of M_tile except the cap edge).
        topk_counts: (E,) int32 tokens per expert under plain top-k, f_e.
        padded: (E,) bool, True where the expert was rounded up (tokens added).
        routing: the :class:`~sonicmoe.routing.Routing` of these pairs, equal to
            ``routing_from_pairs(pair_token, pair_expert, T, E, token_major=True, padding=static)``, built without a
            sort (:mod:`sonicmoe.ops.tr_routing`), with ``tile_rows`` = M_tile (the kernels' hint);
            ``None`` from :func:`token_rounding_ref`.
    """

    pair_token: torch.Tensor
    pair_expert: torch.Tensor
    pair_scores: torch.Tensor
    pair_added: torch.Tensor
    counts: torch.Tensor
    topk_counts: torch.Tensor
    padded: torch.Tensor
    routing: Routing | None = None

    @property
    def num_pairs(self) -> int:
        """Length of the pair arrays: R, or R_max with ``static=True`` (then ``counts.sum()`` is R)."""
        return self.pair_token.shape[0]


def max_pairs(num_tokens: int, num_experts: int, top_k: int, m_tile: int, subroutine: str) -> int:
    """R_max: the most pairs token rounding can route (the static length of ``token_rounding(static=True)``).

    Top-k routes T·K pairs; rounding adds per expert at most M_tile − 1 tokens (``"up"``,
    ``"stochastic"``), (M_tile − 1) // 2 (``"nearest"``: it pads only when fewer than M_tile/2 are
    missing) or none (``"down"``); ``"balance"`` keeps the total within (M_tile − 1) // 2 of T·K. An
    expert holds at most T tokens, so R_max ≤ T·E. Examples (M_tile = 128, ``"nearest"``): 7B
    (T = 24576, E = 128, K = 8) 4.1% above T·K; (T = 16384, E = 512, K = 8) 24.6% above.

    Raises:
        ValueError: ``subroutine`` not one of nearest, up, down, stochastic, balance; ``num_tokens`` not an int >= 0,
            ``num_experts`` or ``m_tile`` not an int >= 1, ``top_k`` not an int in [1, E] (ints or torch.SymInts).
    """
    if subroutine not in ROUNDING_SUBROUTINES:  # a misspelt one read as "up"'s bound before
        raise ValueError(f"subroutine must be one of {ROUNDING_SUBROUTINES}, got {subroutine!r}")
    # m_tile = 0 gave a length below T·K, a negative size a negative one, a float m_tile a float; symbolic sizes
    # (torch.SymInt: make_fx's symbolic tracing; Dynamo passes them as ints) are compared symbolically
    for name, v, lo in (("num_tokens", num_tokens, 0), ("num_experts", num_experts, 1), ("m_tile", m_tile, 1),
                        ("top_k", top_k, 1)):
        check_size(name, v, lo)
    if top_k > num_experts:
        raise ValueError(f"top_k must be an int in [1, E={num_experts}], got {top_k!r}")
    tk = num_tokens * top_k
    if subroutine == "down":
        extra = 0
    elif subroutine == "balance":
        extra = (m_tile - 1) // 2
    elif subroutine == "nearest":
        extra = num_experts * ((m_tile - 1) // 2)
    else:  # up, stochastic
        extra = num_experts * (m_tile - 1)
    bound, cap = tk + extra, num_tokens * num_experts
    if isinstance(bound, int) and isinstance(cap, int):  # a static T: Dynamo of torch 2.11 refused torch.sym_min's int
        return min(bound, cap)  # result ("torch.* op returned non-Tensor"; GPU compile test, session 86)
    return torch.sym_min(bound, cap)  # a symbolic T under torch.compile (no guard on T)


def _check_args(router: RouterOutput, m_tile: int, subroutine: str, router_order: str,
                check: bool = False) -> tuple[int, int, int]:
    if not isinstance(router, RouterOutput):
        raise TypeError(f"router must be a sonicmoe.routing.RouterOutput, got {type(router).__name__}")
    check_m_tile(m_tile)
    if subroutine not in ROUNDING_SUBROUTINES:
        raise ValueError(f"subroutine must be one of {ROUNDING_SUBROUTINES}, got {subroutine!r}")
    if router_order not in ROUTER_ORDERS:
        raise ValueError(f"router_order must be one of {ROUTER_ORDERS}, got {router_order!r}")
    if router._sigmoid and router_order != "sigmoid_then_topk":
        raise ValueError(f"router_order must be the router's: this router chose by sigmoid_then_topk, got "
                         f"router_order={router_order!r}")
    # probs as given (None: computed from the logits on first access, which the sigmoid order never needs here)
    logits, probs, ids, scores = router.logits, router._probs, router.topk_ids, router.topk_scores
    for name, v in (("logits", logits), ("probs", probs), ("topk_ids", ids), ("topk_scores", scores)):
        if v is None and name == "probs":
            continue
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"router.{name} must be a tensor, got {type(v).__name__}")
        if not (is_integer_dtype(v.dtype) if name == "topk_ids" else v.dtype.is_floating_point):
            kind = "an integer" if name == "topk_ids" else "a floating-point"
            raise TypeError(f"router.{name} must be {kind} tensor, got {v.dtype}")
        if v.device != logits.device:
            raise ValueError(f"router.{name} is on {v.device} but router.logits is on {logits.device}")
    if logits.dim() != 2 or (probs is not None and probs.shape != logits.shape):
        raise ValueError(f"router.logits and router.probs must both be (T, E), got {tuple(logits.shape)} "
                         f"and {tuple(probs.shape) if probs is not None else 'the same'}")
    t, e = logits.shape
    if ids.dim() != 2 or ids.shape[0] != t or scores.shape != ids.shape or not 1 <= ids.shape[1] <= e:
        raise ValueError(f"router.topk_ids and router.topk_scores must both be (T={t}, K) with 1 <= K <= "
                         f"E={e}, got {tuple(ids.shape)} and {tuple(scores.shape)}")
    check_topk_ids(ids, e, check, name="router.topk_ids")
    return t, e, ids.shape[1]


def _round_half_down(x: torch.Tensor, m: int) -> torch.Tensor:
    """Nearest multiple of m to the integers x, ties to the lower one: m·⌈(2x − m) / 2m⌉."""
    return -m * torch.div(m - 2 * x, 2 * m, rounding_mode="floor")


def _round_counts(f: torch.Tensor, m: int, t: int, subroutine: str, generator,
                  u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert kept count and padding decision (vectorised, no sync). f: (E,) int64 top-k counts; u: the
    (E,) uniform draws of ``"stochastic"`` (drawn from ``generator`` when None)."""
    lo = f - torch.remainder(f, m)
    frac = f - lo  # in [0, m); 0 -> nothing to round
    if subroutine == "nearest":
        pad = 2 * frac > m
    elif subroutine == "up":
        pad = frac > 0
    elif subroutine == "down":
        pad = torch.zeros_like(f, dtype=torch.bool)
    elif subroutine == "stochastic":
        if u is None:
            u = torch.rand(f.shape, generator=generator, device=f.device)
        pad = u * m < frac
    else:  # balance: round the prefix sums of f on the M_tile grid
        grid = _round_half_down(torch.cumsum(f, 0), m)
        rounded = grid - torch.cat([grid.new_zeros(1), grid[:-1]])
        pad = rounded > lo
    keep = torch.where(pad, torch.clamp(lo + m, max=t), lo)
    return keep, pad


def token_rounding(
    router: RouterOutput,
    *,
    m_tile: int,
    subroutine: str = "nearest",
    router_order: str = "topk_then_softmax",
    renormalize: bool = False,
    generator: torch.Generator | None = None,
    warn: bool = True,
    use_kernel: bool | None = None,
    static: bool = False,
    fused_router_grad: bool = False,
    check: bool = False,
) -> TokenRoundingOutput:
    """Token-rounding routing (SPEC §5): each expert's top-k count rounded to a multiple of M_tile.

    See the module docstring for the algorithm, the tie rules and the scores of added pairs.

    Args:
        router: :class:`~sonicmoe.routing.RouterOutput` for T tokens and E experts: ``logits`` (T, E),
            ``probs`` (T, E) softmax over E, ``topk_ids`` (T, K), ``topk_scores`` (T, K).
        m_tile: M_tile, the grouped GEMM's tile height along tokens.
        subroutine: ``"nearest"`` (default), ``"up"``, ``"down"``, ``"stochastic"`` or ``"balance"``.
        router_order: how ``router`` scored the chosen experts (``"topk_then_softmax"``, ``"softmax_then_topk"`` or
            ``"sigmoid_then_topk"``); decides the ranking of non-chosen tokens and the scores of added pairs.
        renormalize: with ``"softmax_then_topk"`` (``"sigmoid_then_topk"``), whether the chosen probabilities
            (sigmoids) were divided by their sum (+ 1e-20) (the same is applied to added pairs).
        generator: ``torch.Generator`` on the router's device for ``"stochastic"`` (one uniform draw
            per expert); ``None`` uses the default generator. Ignored by the other subroutines.
        warn: warn when T·K/E < 2·M_tile (where quality drops).
        use_kernel: rank and select with the Triton kernels of :mod:`sonicmoe.ops.tr_select` and score
            with those of :mod:`sonicmoe.ops.tr_scores` (``None``: on CUDA; ``True``: also on CPU under
            TRITON_INTERPRET=1; ``False``: their torch twins, a sort per expert and advanced indexing).
            Both give the same pairs; the added pairs' scores agree to float32 rounding.
        static: return R_max = :func:`max_pairs` (T, E, K, M_tile, subroutine) pairs instead of R: the
            R real pairs, then R_max − R padding pairs with ``pair_token = T``, ``pair_expert = E``,
            score 0 and ``pair_added`` False. No host sync. Pass ``padding=True`` to
            :func:`~sonicmoe.routing.routing_from_pairs`; the experts then compute no padding row and
            give the padding pairs' scores zero gradients. Costs memory: the layer's (R_max, ·) buffers
            (H is R_max·2n) are up to ``max_pairs − T·K`` rows longer than top-k's.
        fused_router_grad: the kept top-k pairs' score gradient goes straight to ``router.logits`` (or
            ``router.probs``) by :func:`~sonicmoe.routing.router_topk`'s score formula instead of back through
            ``router.topk_scores`` (:func:`sonicmoe.ops.tr_scores.pair_scores`): the same gradient, without the
            router's top-k backward and a (T, E) sum. Only for a router made by ``router_topk`` with this
            ``router_order`` and ``renormalize`` and unmodified ``topk_scores`` (the ``MoE`` layer's case); the torch
            path ignores it.
        check: verify ``router.topk_ids`` from a custom router: every id in [0, E) and K distinct experts per
            token (two host syncs; :func:`~sonicmoe.routing.routing_from_topk`'s ``check``). Without it such ids
            are not verified: an id outside [0, E) fails inside torch's indexing (on CUDA, possibly as a device-side
            assert), and a repeated id passes silently (counted once or twice). ``router_topk``'s ids (the ``MoE``
            layer's) need no check.

    Returns:
        :class:`TokenRoundingOutput` with R (or R_max) pairs in token-major order (sorted by token, then
        expert; padding pairs last: pass ``token_major=True`` to
        :func:`~sonicmoe.routing.routing_from_pairs`). Guarantees: every expert is within one tile of
        top-k (``|count_e − f_e| < M_tile``) and its count is a multiple of M_tile, except a padded
        expert capped at T tokens (module docstring, "Cap edge").

    Host syncs: one with ``static=False`` (``torch.nonzero`` over the (T, E) rank array, as R is
    data-dependent); none with ``static=True``; two more with ``check=True``.
    Memory: two transient (E, T) int32 key arrays and the (T, E) int32 rank array (12·T·E bytes; 96 MiB at
    T = 16384, E = 512), plus (E, T) int64 sort keys on the torch path.

    Raises:
        TypeError: ``router`` not a RouterOutput, or its tensors of the wrong kind (integer ids, floating scores).
        ValueError: bad shapes, ``m_tile`` outside [1, 2^24], an unknown ``subroutine``/``router_order``, non-bool
            flags (``use_kernel``: None or a bool), and with ``check=True`` ids outside [0, E) or repeated within a
            token.
    """
    t, e, k = _check_args(router, m_tile, subroutine, router_order, check)
    for name, flag in (("renormalize", renormalize), ("static", static), ("fused_router_grad", fused_router_grad),
                       ("warn", warn)):
        check_flag(name, flag)
    if use_kernel is not None:
        check_flag("use_kernel", use_kernel)  # None, True or False
    if warn:
        warn_if_few_tokens(t * k / e, m_tile)
    with on_device(router.logits):  # the kernels launch on the router's CUDA device, whichever is current
        return _token_rounding(router, t, e, k, m_tile, subroutine, router_order, renormalize, generator,
                               use_kernel, static, fused_router_grad)


def _token_rounding(router: RouterOutput, t: int, e: int, k: int, m_tile: int, subroutine: str, router_order: str,
                    renormalize: bool, generator: torch.Generator | None, use_kernel: bool | None, static: bool,
                    fused_router_grad: bool) -> TokenRoundingOutput:
    from .ops import tr_scores, tr_select, tr_static

    ids2 = router.topk_ids.long()  # (T, K)
    kernels = tr_select.use_select_kernels(router.logits.device, use_kernel)
    probs = _candidate_probs(router, router_order)
    u = torch.rand(e, generator=generator, device=probs.device) if subroutine == "stochastic" else None
    # static: R_max pairs, padding last, no sync; else exactly R, the one host sync (R is data-dependent)
    r_max = max_pairs(t, e, k, m_tile, subroutine) if static else None
    if kernels and static and torch.compiler.is_compiling():  # one graph node: T stays symbolic (tr_static)
        sel = tr_static.select_static_pairs_compiled(probs, ids2, router.topk_scores, u, m_tile, subroutine, r_max)
    else:
        sel = tr_static.select_pairs(probs, ids2, router.topk_scores, u, m_tile, subroutine, r_max, kernels)
    pair_token, pair_expert, routing = sel.pair_token, sel.pair_expert, sel.routing
    f, keep, pad = sel.f, sel.keep, sel.pad
    routing = dataclasses.replace(routing, tile_rows=m_tile)  # the kernels' hint: whole M_tile-row tiles
    scores = tr_scores.pair_scores if tr_scores.use_score_kernels(router, use_kernel) else tr_scores.pair_scores_ref
    pair_scores, pair_added = scores(router, pair_token, pair_expert, router_order, renormalize, fused_router_grad)
    return TokenRoundingOutput(
        pair_token=pair_token,
        pair_expert=pair_expert,
        pair_scores=pair_scores,
        pair_added=pair_added,
        counts=keep,
        topk_counts=f,
        padded=pad,
        routing=routing,
    )


def _candidate_probs(router: RouterOutput, router_order: str) -> torch.Tensor:
    """(T, E) values by which an expert ranks the tokens that did not choose it: the router's probabilities, or
    under ``"sigmoid_then_topk"`` the sigmoids of the logits (no gradient needed: ranks only)."""
    if router_order == "sigmoid_then_topk":
        return torch.sigmoid(router.logits.detach())
    return router.probs


def token_rounding_ref(
    router: RouterOutput,
    *,
    m_tile: int,
    subroutine: str = "nearest",
    router_order: str = "topk_then_softmax",
    renormalize: bool = False,
    generator: torch.Generator | None = None,
    warn: bool = True,
    check: bool = False,
) -> TokenRoundingOutput:
    """Plain per-expert loop version of :func:`token_rounding` (same signature and output): the oracle.

    Decisions with Python integers (``"balance"`` as the literal sequential running residual),
    rankings with Python ``sorted``, scores of added pairs from a dense (T, E) formula. Slow; tests only.
    ``"stochastic"`` draws the same ``torch.rand(E)`` as the fast version, so equal generators give
    equal results.
    """
    t, e, k = _check_args(router, m_tile, subroutine, router_order, check)
    if warn:
        warn_if_few_tokens(t * k / e, m_tile)
    device = router.logits.device
    m = m_tile
    ids = router.topk_ids.tolist()
    inf = float("inf")  # ±inf kept (nan_to_num's defaults would make them the largest finite floats)
    scores = router.topk_scores.detach().float().nan_to_num(nan=inf, posinf=inf, neginf=-inf).tolist()  # NaN first
    probs = _candidate_probs(router, router_order).detach().float().nan_to_num(nan=-inf, posinf=inf, neginf=-inf)
    probs = probs.tolist()  # NaN last

    chosen: list[list[tuple[int, int]]] = [[] for _ in range(e)]  # (token, slot k) per expert
    for tok in range(t):
        for j in range(k):
            chosen[ids[tok][j]].append((tok, j))
    f = [len(c) for c in chosen]

    u = torch.rand(e, generator=generator, device=device) if subroutine == "stochastic" else None
    keep, pad, residual = [], [], 0
    for x in range(e):
        lo = f[x] // m * m
        frac = f[x] - lo
        hi = lo + m if frac else lo
        if frac == 0 or subroutine == "down":
            p = False
        elif subroutine == "nearest":
            p = hi - f[x] < f[x] - lo
        elif subroutine == "up":
            p = True
        elif subroutine == "stochastic":
            p = bool(u[x] * m < frac)
        else:  # balance
            p = abs(residual + hi - f[x]) < abs(residual + lo - f[x])
        residual += (hi if p else lo) - f[x]
        keep.append(min(hi, t) if p else lo)
        pad.append(p)

    kept_pairs, added_pairs = [], []  # (token, expert, k or -1)
    for x in range(e):
        ranked = sorted(chosen[x], key=lambda tj: (-scores[tj[0]][tj[1]], tj[0]))
        kept_pairs += [(tok, x, j) for tok, j in ranked[: min(keep[x], f[x])]]
        if keep[x] > f[x]:
            taken = {tok for tok, _ in chosen[x]}
            others = sorted((tok for tok in range(t) if tok not in taken),
                            key=lambda tok: (-probs[tok][x], tok))
            added_pairs += [(tok, x, -1) for tok in others[: keep[x] - f[x]]]

    # Dense extended scores: top-k's normalisation applied to every (t, e).
    logits = router.logits
    topk_ids = router.topk_ids.long()
    if router_order == "topk_then_softmax":
        chosen_logits = logits.gather(1, topk_ids)
        mx = chosen_logits.max(dim=1, keepdim=True).values
        ext = torch.exp(logits - mx) / torch.exp(chosen_logits - mx).sum(dim=1, keepdim=True)
    elif router_order == "sigmoid_then_topk":
        ext = torch.sigmoid(logits)
        if renormalize:
            ext = ext / (ext.gather(1, topk_ids).sum(dim=1, keepdim=True) + 1e-20)
    else:
        ext = router.probs
        if renormalize:
            ext = ext / router.probs.gather(1, topk_ids).sum(dim=1, keepdim=True)
    pairs = sorted(kept_pairs + added_pairs, key=lambda p: (p[0], p[1]))  # token-major, as the fast path
    vals = [router.topk_scores[tok, j] if j >= 0 else ext[tok, x] for tok, x, j in pairs]
    pair_scores = torch.stack(vals) if vals else router.topk_scores.new_zeros(0)
    idx = torch.tensor([[tok, x] for tok, x, _ in pairs], dtype=INDEX_DTYPE, device=device).reshape(-1, 2)
    return TokenRoundingOutput(
        pair_token=idx[:, 0].contiguous(),
        pair_expert=idx[:, 1].contiguous(),
        pair_scores=pair_scores,
        pair_added=torch.tensor([j < 0 for _, _, j in pairs], dtype=torch.bool, device=device),
        counts=torch.tensor(keep, dtype=INDEX_DTYPE, device=device),
        topk_counts=torch.tensor(f, dtype=INDEX_DTYPE, device=device),
        padded=torch.tensor(pad, dtype=torch.bool, device=device),
    )
