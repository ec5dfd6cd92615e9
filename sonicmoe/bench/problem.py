"""One benchmark problem: fresh random inputs, a random router and its routing (SPEC §7).

Every backend of one shape runs on the same :class:`Problem`. Tensors are generated directly on the
target device (the DeepSeek-V3 shape has 22.5 GB of bf16 weights: no CPU round trip).
"""

from __future__ import annotations

import dataclasses

import torch

from ..routing import Routing, router_topk, routing_from_pairs, routing_from_topk
from .shapes import Shape


class TokenRoundingUnavailable(RuntimeError):
    """``sonicmoe.token_rounding`` cannot be imported (or has an unexpected interface)."""


def load_token_rounding():
    """Return ``sonicmoe.token_rounding.token_rounding`` or raise :class:`TokenRoundingUnavailable`."""
    try:
        from ..token_rounding import token_rounding
    except ImportError as exc:
        raise TokenRoundingUnavailable(f"sonicmoe.token_rounding is not importable ({exc})") from exc
    return token_rounding


def _unpack_pairs(result) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair_token, pair_expert, pair_scores) from token_rounding's result (object or tuple)."""
    if all(hasattr(result, a) for a in ("pair_token", "pair_expert", "pair_scores")):
        return result.pair_token, result.pair_expert, result.pair_scores
    if isinstance(result, (tuple, list)) and len(result) >= 3:
        return result[0], result[1], result[2]
    raise TokenRoundingUnavailable(
        f"token_rounding returned {type(result).__name__}; expected pair_token/pair_expert/pair_scores"
    )


@dataclasses.dataclass
class Routed:
    """Routing of T tokens: metadata, per-pair score S (R,) and the pairs themselves.

    ``topk_ids`` (T, K) is set for plain top-k (pairs token-major, p = t·K + k), ``None`` otherwise.
    ``pair_token`` and ``pair_expert`` are None for top-k routed with ``pairs=False`` (a timed call: the layer builds
    neither).
    ``router_ids`` (T, K) is the router's top-k choice under either mode (under token rounding, the set a token's
    scores are normalised over: S_{t,e} = exp(l_{t,e}) / Σ_{k} exp(l_{t,ids[t,k]}); the router variant's check).
    """

    routing: Routing
    pair_scores: torch.Tensor
    pair_token: torch.Tensor | None
    pair_expert: torch.Tensor | None
    topk_ids: torch.Tensor | None
    router_ids: torch.Tensor | None = None


def route(x: torch.Tensor, router_weight: torch.Tensor, K: int, mode: str, *, m_tile: int = 128,
          rounding: str = "nearest", static: bool = False, generator: torch.Generator | None = None,
          pairs: bool = True) -> Routed:
    """Router + routing metadata for x (T, d) with router weight W_r (E, d).

    ``mode`` ``"topk"``: :func:`sonicmoe.router_topk` then :func:`sonicmoe.routing_from_topk`.
    ``"token_rounding"``: the same router, then ``sonicmoe.token_rounding.token_rounding(router,
    m_tile=M_tile, subroutine=rounding)`` (SPEC §5) and :func:`sonicmoe.routing_from_pairs`; with
    ``static``, the static-length, sync-free form the ``MoE`` layer runs (``static=True``, padding pairs, and
    ``fused_router_grad=True``). ``generator``: the uniform draws of ``rounding="stochastic"`` (None: torch's
    global RNG). ``pairs`` False: top-k's ``pair_token`` and ``pair_expert`` are not built (None) — a timed call must
    run the layer's routing alone, and the MoE layer builds neither (an arange and a copy of T·K rows per call).
    Scores are differentiable with respect to x and W_r.
    """
    T, E = x.shape[0], router_weight.shape[0]
    router = router_topk(x, router_weight, K)
    if mode == "topk":
        routing, scores = routing_from_topk(router.topk_ids, E), router.topk_scores.reshape(-1)
        if not pairs:
            return Routed(routing, scores, None, None, router.topk_ids, router.topk_ids)
        pair_token = torch.arange(T, device=x.device, dtype=torch.int32).repeat_interleave(K)
        return Routed(routing, scores, pair_token, router.topk_ids.reshape(-1), router.topk_ids, router.topk_ids)
    if mode == "token_rounding":
        token_rounding = load_token_rounding()
        kw = {"static": True, "fused_router_grad": True} if static else {}  # static: as the MoE layer calls it
        if rounding == "stochastic":
            kw["generator"] = generator
        result = token_rounding(router, m_tile=m_tile, subroutine=rounding, **kw)
        pt, pe, ps = _unpack_pairs(result)
        routing = getattr(result, "routing", None)  # the library's own, as the MoE layer uses it
        if routing is None:  # valid by construction, token-major
            routing = routing_from_pairs(pt, pe, T, E, token_major=True, check=False, padding=static)
        return Routed(routing, ps, pt, pe, None, router.topk_ids)
    raise ValueError(f"routing must be 'topk' or 'token_rounding', got {mode!r}")


@dataclasses.dataclass
class Problem:
    """Inputs of one shape on one device (SPEC §1 letters).

    Attributes:
        shape: the (T, d, n, E, K) shape. mode: routing mode (``topk`` / ``token_rounding``).
        x: (T, d) input, leaf with requires_grad. router_weight: (E, d), requires_grad (router variant).
        w1: (E, 2n, d) gate/up projection, ``concat`` layout (rows [0, n) gate, [n, 2n) up), leaf.
        w2: (E, d, n) down projection, leaf.
        pair_scores: (R,) float32 scores S, a detached leaf with requires_grad (experts-only timing).
        routing, pair_token, pair_expert, topk_ids: see :class:`Routed`.
        dout: (T, d) fixed random upstream gradient dO for the backward.
        m_tile, rounding: token-rounding options (used again by the router variant).
        generator: the seeded generator of ``rounding="stochastic"``'s draws (reproducible per seed), or None.
    """

    shape: Shape
    mode: str
    x: torch.Tensor
    router_weight: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    pair_scores: torch.Tensor
    routing: Routing
    pair_token: torch.Tensor
    pair_expert: torch.Tensor
    topk_ids: torch.Tensor | None
    dout: torch.Tensor
    m_tile: int = 128
    rounding: str = "nearest"
    generator: torch.Generator | None = None

    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def T(self) -> int:
        return self.x.shape[0]

    @property
    def R(self) -> int:
        """Routed pairs actually present (T·K for top-k, the rounded count for token rounding)."""
        return int(self.pair_scores.shape[0])

    def route(self, x: torch.Tensor, pairs: bool = True) -> Routed:
        """Route ``x`` with this problem's router and mode as the ``MoE`` layer does (for timings that include
        the router): token rounding in its static-length form, without a host sync. ``pairs`` False (timed calls):
        no top-k ``pair_token`` / ``pair_expert``, which the layer does not build (:func:`route`)."""
        return route(x, self.router_weight, self.shape.K, self.mode, m_tile=self.m_tile,
                     rounding=self.rounding, static=True, generator=self.generator, pairs=pairs)

    def leaves(self) -> list[torch.Tensor]:
        return [self.x, self.router_weight, self.w1, self.w2, self.pair_scores]

    def head(self, T: int) -> Problem:
        """The same problem on the first ``T`` tokens (same weights). Top-k: routing recomputed. Token rounding: this
        problem's own pairs of those tokens (rounding T tokens again could round every expert down to no pair,
        and a check on no pair passes anything); their counts are then no longer M_tile multiples."""
        if T >= self.T:
            return self
        x = self.x.detach()[:T].clone().requires_grad_(True)
        if self.mode == "token_rounding":
            keep = (self.pair_token < T).nonzero().squeeze(1)
            pt, pe = self.pair_token[keep], self.pair_expert[keep]
            routing, scores = routing_from_pairs(pt, pe, T, self.shape.E), self.pair_scores.detach()[keep]
            topk_ids = None if self.topk_ids is None else self.topk_ids[:T]
        else:
            with torch.no_grad():
                r = route(x, self.router_weight, self.shape.K, self.mode, m_tile=self.m_tile,
                          rounding=self.rounding)
            pt, pe, routing, scores, topk_ids = r.pair_token, r.pair_expert, r.routing, r.pair_scores, r.topk_ids
        return dataclasses.replace(
            self, shape=self.shape.with_max_T(T), x=x, pair_scores=scores.detach().clone().requires_grad_(True),
            routing=routing, pair_token=pt, pair_expert=pe, topk_ids=topk_ids, dout=self.dout[:T].clone(),
        )


def _randn(shape, scale: float, dtype, device, gen) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype, generator=gen).mul_(scale)


def make_problem(shape: Shape, *, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
                 mode: str = "topk", m_tile: int = 128, rounding: str = "nearest",
                 load: torch.Tensor | None = None) -> Problem:
    """Fresh random bf16/fp16/fp32 problem for ``shape`` on ``device``.

    x ~ N(0, 1) (T, d); W_r, W1 scaled by 1/sqrt(d), W2 by 1/sqrt(n) (fan-in), so activations stay O(1);
    routing from the random router. dO ~ N(0, 1) (T, d). Deterministic for a given seed and device, stochastic
    token rounding included (its draws come from the same seeded generator, kept for :meth:`Problem.route`).
    ``load``: (E,) target fractions of the pairs per expert (:func:`sonicmoe.bench.load_profile.target_load`, a
    trained model's imbalance): W_r's rows are scaled until the router gives them
    (:func:`~sonicmoe.bench.load_profile.calibrate_router`); None: the random router's near-even load.

    Raises:
        TokenRoundingUnavailable: ``mode == "token_rounding"`` and the module is missing.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    T, d, n, E, K = shape.dims
    x = _randn((T, d), 1.0, dtype, device, gen).requires_grad_(True)
    router_weight = _randn((E, d), d**-0.5, dtype, device, gen)
    if load is not None:
        from .load_profile import calibrate_router

        router_weight = calibrate_router(x, router_weight, K, load)[0]
    router_weight.requires_grad_(True)
    w1 = _randn((E, 2 * n, d), d**-0.5, dtype, device, gen).requires_grad_(True)
    w2 = _randn((E, d, n), n**-0.5, dtype, device, gen).requires_grad_(True)
    dout = _randn((T, d), 1.0, dtype, device, gen)
    with torch.no_grad():
        r = route(x, router_weight, K, mode, m_tile=m_tile, rounding=rounding, generator=gen)
    return Problem(
        shape=shape, mode=mode, x=x, router_weight=router_weight, w1=w1, w2=w2,
        pair_scores=r.pair_scores.detach().float().clone().requires_grad_(True), routing=r.routing,
        pair_token=r.pair_token, pair_expert=r.pair_expert, topk_ids=r.topk_ids, dout=dout,
        m_tile=m_tile, rounding=rounding, generator=gen,
    )
