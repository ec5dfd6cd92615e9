"""What gets timed: our kernels, the baselines and the upper bound, as a small pluggable registry.

Each entry of :data:`REGISTRY` is a :class:`BaselineSpec` whose ``factory(problem, options)`` returns
a :class:`Case` (the backend bound to one problem's tensors) or raises :class:`Unavailable` with the
reason (missing library, no GPU, shape too large for a Python loop, ...). Competing libraries are
tried by import and never required; add one with :func:`register_baseline`.

Built in:

Every built-in backend takes the experts' gated activation (``options["activation"]``, ``sonicmoe bench
--activation``): ``"swiglu"`` or gpt-oss's ``"clamped_swiglu"`` (:data:`sonicmoe.config.ACTIVATIONS`). A registered
backend declares the ones it takes in :attr:`BaselineSpec.activations` (default SwiGLU only); the runner skips it,
with the reason in its row, under any other.

* ``triton`` (ours): ``sonicmoe.experts(..., backend="triton")``.
* ``torch``: ``sonicmoe.experts(..., backend="torch")``, index gather + ``torch._grouped_mm`` +
  ``index_add`` (what a user would write, SPEC §7).
* ``loop``: a per-expert Python loop of ``F.linear`` calls (affordable for E ≤ ``loop_max_E``).
* ``upper``: the cuBLAS upper bound: dense batched GEMM with perfectly balanced experts
  (TK/E contiguous rows per expert, no gather), SwiGLU as torch ops, and the weighted sum of the
  K rows of each token; backward through autograd. The activation runs as torch ops between the GEMMs, so the bound
  computes the same activation as the layer it bounds.
* ``scattermoe``: ScatterMoE's ``parallel_linear`` (if installed; CUDA and top-k only). ScatterMoE's kernels are the
  two grouped GEMMs; the activation between them is ours, as torch ops (as ScatterMoE's own MLP applies its
  activation), so it takes either.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import functional
from ..config import ACTIVATIONS
from ..env import interpreting
from ..reference import swiglu_ref
from ..routing import Routing
from .problem import Problem


class Unavailable(Exception):
    """The backend cannot run here (reason in the message); the row is reported as skipped."""


def ref_h_dtype(activation: str, dtype: torch.dtype) -> torch.dtype | None:
    """The ``h_dtype`` of a backend's float32 reference (:func:`sonicmoe.experts_ref`): None (H unrounded, as the
    check has always run) for SwiGLU; the layer's dtype for the clamped activation, whose gradient jumps at the clamps'
    bounds: every backend here stores H in the layer's dtype, and an element whose rounding crosses a bound would
    otherwise differ by the whole jump."""
    return None if activation == "swiglu" else dtype


@dataclasses.dataclass
class RefSpec:
    """How to compute a case's float32 reference with :func:`sonicmoe.experts_ref`.

    The case's output must equal ``post(experts_ref(x, w1, w2, routing(pairs), pair_scores))``
    (``post`` None: identity). Tensors are the case's own leaves (gradients are compared too).

    Attributes:
        x: (T_x, d) rows fed to the experts. w1: (E, 2n, d), concat layout. w2: (E, d, n).
        pair_token: (P,) row of x of each pair. pair_expert: (P,) expert of each pair.
        pair_scores: (P,) score of each pair (a leaf, or a view of one).
        num_tokens: T_x. post: maps the (T_x, d) reference to the case's output shape.
        router_weight: (E, d) W_r when the case ran the router itself (the router variant), else None. The
            reference then recomputes each pair's score from float32 logits l = X W_rᵀ as
            S_{t,e} = exp(l_{t,e}) / Σ_k exp(l_{t,router_ids[t,k]}) (top-k's softmax over the K chosen logits, SPEC §2,
            extended to token rounding's added pairs), differentiable in x and W_r; ``pair_scores`` is then unused.
        router_ids: (T_x, K) the router's top-k choice the case made (its own selection: near-tied logits may pick
            other experts in another precision). Pairs with expert E (static-length padding) are left out.
        activation: the experts' gated activation the case ran (``"swiglu"`` or ``"clamped_swiglu"``).
        h_dtype: the dtype the reference rounds H to before the activation (:func:`ref_h_dtype`), or None.
    """

    x: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    pair_token: torch.Tensor
    pair_expert: torch.Tensor
    pair_scores: torch.Tensor
    num_tokens: int
    post: Callable[[torch.Tensor], torch.Tensor] | None = None
    score_leaf: torch.Tensor | None = None
    router_weight: torch.Tensor | None = None
    router_ids: torch.Tensor | None = None
    activation: str = "swiglu"
    h_dtype: torch.dtype | None = None


class Case:
    """A backend bound to one problem. ``forward()`` returns O (T, d) in the problem's dtype."""

    name: str = "?"
    leaves: list[torch.Tensor]
    info: dict

    def forward(self) -> torch.Tensor:
        raise NotImplementedError

    def forward_with_router(self) -> torch.Tensor | None:
        """Router + routing metadata + experts, or None when it makes no sense for this case."""
        return None

    router_leaves: list[torch.Tensor] = []

    def ref_spec(self) -> RefSpec:
        raise NotImplementedError

    def router_check(self) -> tuple[torch.Tensor, RefSpec]:
        """One :meth:`forward_with_router` call's output and the :class:`RefSpec` of the routing it chose
        (``router_weight`` and ``router_ids`` set), for checking the router variant."""
        raise NotImplementedError


ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Routing, torch.Tensor], torch.Tensor]


class ExpertsCase(Case):
    """A backend with the signature of :func:`sonicmoe.experts`: ``fn(x, w1, w2, routing, pair_scores)``.

    Leaves: x (T, d), W1 (E, 2n, d) [gate; up] rows, W2 (E, d, n), S (R,) float32. ``activation``: the one ``fn``
    computes (the reference computes it too).
    """

    def __init__(self, name: str, problem: Problem, fn: ExpertsFn, *, activation: str = "swiglu", **info):
        self.name, self.problem, self.fn = name, problem, fn
        self.activation = activation
        p = problem
        self.leaves = [p.x, p.w1, p.w2, p.pair_scores]
        self.router_leaves = [p.x, p.router_weight, p.w1, p.w2]
        self.info = dict(info)

    def forward(self) -> torch.Tensor:
        p = self.problem
        return self.fn(p.x, p.w1, p.w2, p.routing, p.pair_scores)

    def forward_with_router(self) -> torch.Tensor:
        p = self.problem
        r = p.route(p.x, pairs=False)  # timed: only what the layer runs
        return self.fn(p.x, p.w1, p.w2, r.routing, r.pair_scores)

    def router_check(self) -> tuple[torch.Tensor, RefSpec]:
        p = self.problem
        r = p.route(p.x)
        out = self.fn(p.x, p.w1, p.w2, r.routing, r.pair_scores)
        real = (r.pair_expert < p.shape.E).nonzero().squeeze(1)  # static-length padding pairs left out
        return out, RefSpec(p.x, p.w1, p.w2, r.pair_token[real], r.pair_expert[real], r.pair_scores.detach()[real],
                            p.T, router_weight=p.router_weight, router_ids=r.router_ids, **self._act())

    def ref_spec(self) -> RefSpec:
        p = self.problem
        return RefSpec(p.x, p.w1, p.w2, p.pair_token, p.pair_expert, p.pair_scores, p.T,
                       score_leaf=p.pair_scores, **self._act())

    def _act(self) -> dict:
        return {"activation": self.activation, "h_dtype": ref_h_dtype(self.activation, self.problem.dtype)}


# ---------------------------------------------------------------------------------------------------
# built-in backends


def experts_loop(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, routing: Routing,
                 pair_scores: torch.Tensor, activation: str = "swiglu") -> torch.Tensor:
    """Per-expert Python loop in the input dtype (the naive baseline; HF-Mixtral style).

    x (T, d), W1 (E, 2n, d) [gate; up] rows, W2 (E, d, n), S (R,); ``activation``: A's formula
    (:func:`sonicmoe.reference.swiglu_ref`). Returns O (T, d).
    """
    # zeros in the graph of x, the weights and the scores: with no pair routed the output still has a backward
    out = torch.zeros_like(x) + 0 * (x.sum() + w1.sum() + w2.sum() + pair_scores.sum())
    offsets = routing.expert_offsets.tolist()
    w1s, w2s = w1.unbind(0), w2.unbind(0)  # as separate modules' weights: w1[e]'s backward would fill all of dW1 per e
    for e in range(routing.num_experts):
        lo, hi = offsets[e], offsets[e + 1]
        if hi == lo:
            continue
        tok = routing.row_token[lo:hi].long()
        h = F.linear(x[tok], w1s[e])
        a = swiglu_ref(h, "concat", activation)
        y = F.linear(a, w2s[e])
        s = pair_scores[routing.row_pair[lo:hi].long()].to(y.dtype)
        out.index_add_(0, tok, y * s[:, None])
    return out


def _triton_factory(problem: Problem, options: dict) -> Case:
    if problem.device.type != "cuda":
        if not interpreting():
            raise Unavailable("needs a CUDA GPU (or TRITON_INTERPRET=1 on CPU, slow)")
        if problem.dtype == torch.bfloat16:
            raise Unavailable("Triton's interpreter multiplies bf16 wrongly (triton#11584); use --dtype fp32")
    try:
        from ..ops import moe_function  # noqa: F401
    except ImportError as exc:
        raise Unavailable(f"sonicmoe.ops.moe_function is not importable ({exc})") from exc

    activation = options.get("activation", "swiglu")

    def fn(x, w1, w2, routing, pair_scores):
        return functional.experts(x, w1, w2, routing, pair_scores, backend="triton", activation=activation)

    return ExpertsCase("triton", problem, fn, activation=activation)


def _torch_factory(problem: Problem, options: dict) -> Case:
    from ..ops.torch_experts import _grouped_mm_ok

    activation = options.get("activation", "swiglu")

    def fn(x, w1, w2, routing, pair_scores):
        return functional.experts(x, w1, w2, routing, pair_scores, backend="torch", activation=activation)

    try:
        gmm = bool(_grouped_mm_ok(problem.x, problem.w1, problem.w2))
    except (RuntimeError, AssertionError):
        gmm = False
    return ExpertsCase("torch", problem, fn, activation=activation, grouped_mm=gmm)


def _loop_factory(problem: Problem, options: dict) -> Case:
    max_e = options.get("loop_max_E", 128)
    if max_e is not None and problem.shape.E > max_e:
        raise Unavailable(f"E={problem.shape.E} > --loop-max-E={max_e} (a Python loop over experts)")
    activation = options.get("activation", "swiglu")
    return ExpertsCase("loop", problem, functools.partial(experts_loop, activation=activation), activation=activation)


class UpperBoundCase(Case):
    """cuBLAS upper bound (SPEC §6): perfectly balanced experts, contiguous rows, no gather.

    m = ⌈T·K'/E⌉ rows per expert (K' = round(R/T) = K under top-k), X_up (E·m, d) holding copies of
    the input rows (row r = x[r mod T]); ``torch.bmm`` (E, m, d)·(E, d, 2n) → the gated activation (SwiGLU,
    silu(gate)·up, or ``activation="clamped_swiglu"``, as torch ops: :func:`sonicmoe.reference.swiglu_ref`) →
    ``torch.bmm`` (E, m, n)·(E, n, d) → weighted sum of the K' rows of each token over a contiguous (T, K', d)
    view. Backward through autograd. Scores S_up (T, K') in the input dtype.
    """

    name = "upper"

    def __init__(self, problem: Problem, activation: str = "swiglu"):
        self.activation = activation
        T, d, n, E, _ = problem.shape.dims
        T = problem.T
        k_up = max(1, round(problem.R / T))
        m = math.ceil(T * k_up / E)
        rows = E * m
        self.T, self.d, self.n, self.E, self.k_up, self.m, self.rows = T, d, n, E, k_up, m, rows
        self.problem = problem
        with torch.no_grad():
            idx = torch.arange(rows, device=problem.device) % T
            self.x_up = problem.x.detach()[idx].contiguous().requires_grad_(True)
            if problem.R == T * k_up and problem.topk_ids is not None:
                s = problem.pair_scores.detach().view(T, k_up)
            else:
                s = torch.full((T, k_up), 1.0 / k_up, device=problem.device)
            self.s_up = s.to(problem.dtype).contiguous().requires_grad_(True)
        self.leaves = [self.x_up, problem.w1, problem.w2, self.s_up]
        self.info = {"rows_per_expert": m, "K_up": k_up, "rows": rows}

    def forward(self) -> torch.Tensor:
        E, m, d, T, k = self.E, self.m, self.d, self.T, self.k_up
        w1, w2 = self.problem.w1, self.problem.w2
        h = torch.bmm(self.x_up.view(E, m, d), w1.transpose(1, 2))  # (E, m, 2n)
        a = swiglu_ref(h, "concat", self.activation)  # (E, m, n)
        y = torch.bmm(a, w2.transpose(1, 2))  # (E, m, d)
        y = y.view(E * m, d)[: T * k].view(T, k, d)
        return (y * self.s_up[..., None]).sum(1)

    def ref_spec(self) -> RefSpec:
        p, T, k = self.problem, self.T, self.k_up
        rows = torch.arange(T * k, device=p.device)
        d = self.d
        return RefSpec(self.x_up, p.w1, p.w2, rows, rows // self.m, self.s_up.view(-1), self.rows,
                       post=lambda o: o[: T * k].view(T, k, d).sum(1), score_leaf=self.s_up,
                       activation=self.activation, h_dtype=ref_h_dtype(self.activation, p.dtype))


def _upper_factory(problem: Problem, options: dict) -> Case:
    return UpperBoundCase(problem, options.get("activation", "swiglu"))


def _scattermoe_factory(problem: Problem, options: dict) -> Case:
    """ScatterMoE (Tan et al. 2024) through its ``parallel_linear``, adapted to our W1/W2 layout."""
    if problem.device.type != "cuda":
        raise Unavailable("ScatterMoE needs a CUDA GPU")
    if problem.topk_ids is None:
        raise Unavailable("ScatterMoE needs plain top-k routing (K experts per token)")
    try:
        from scattermoe.parallel_experts import parallel_linear
    except ImportError as exc:
        raise Unavailable(f"scattermoe is not installed ({exc})") from exc
    params = inspect.signature(parallel_linear).parameters
    padded = "padded_block_idxs" in params
    if padded:
        try:
            from scattermoe.kernels.ops import padded_block_indices
        except ImportError as exc:
            raise Unavailable(f"this scattermoe version is not supported ({exc})") from exc
    E, K = problem.shape.E, problem.shape.K
    activation = options.get("activation", "swiglu")

    def fn(x, w1, w2, routing, pair_scores):
        T = x.shape[0]
        with torch.no_grad():
            # pairs p = t·K + k sorted by expert: exactly our rows (row_pair = sorted_scattered_idxs)
            kw = {"sorted_expert_idxs": routing.row_expert().long(),
                  "sorted_scattered_idxs": routing.row_pair.long()}
            if padded:
                kw["padded_block_idxs"], kw["expert_offsets"] = padded_block_indices(
                    kw["sorted_expert_idxs"], E)
            else:
                kw["expert_offsets"] = routing.expert_offsets[1:].long()
        h = parallel_linear(x, w1.transpose(1, 2), K, grouped_out=True, **kw)  # (TK, 2n) grouped
        a = swiglu_ref(h, "concat", activation)
        gates = pair_scores.view(T, K).to(x.dtype)
        return parallel_linear(a, w2.transpose(1, 2), 1, gates=gates, grouped_in=True, **kw)

    return ExpertsCase("scattermoe", problem, fn, activation=activation)


# ---------------------------------------------------------------------------------------------------
# registry


@dataclasses.dataclass
class BaselineSpec:
    """One timed backend.

    Attributes:
        name: ``--backends`` name. factory: ``(problem, options) -> Case``; raises Unavailable.
        description: one line for ``--list``.
        kind: ``"ours"``, ``"baseline"``, ``"bound"`` (the upper bound) or ``"library"`` (competitor).
        default: part of ``--backends default`` (libraries join when importable).
        router_variant: also time router + metadata + experts.
        check_max_T: check correctness on at most this many tokens (None: the whole problem).
        activations: the gated activations the factory builds (``options["activation"]``, and the case's
            :class:`RefSpec` names it); under any other ``--activation`` the backend is skipped, never run with
            SwiGLU in its place. The default, SwiGLU only, fits a factory that does not read the option.
    """

    name: str
    factory: Callable[[Problem, dict], Case]
    description: str
    kind: str = "baseline"
    default: bool = True
    router_variant: bool = False
    check_max_T: int | None = None
    activations: tuple[str, ...] = ("swiglu",)


REGISTRY: dict[str, BaselineSpec] = {}


def register_baseline(spec: BaselineSpec) -> BaselineSpec:
    """Add (or replace) a backend in :data:`REGISTRY`; returns it."""
    REGISTRY[spec.name] = spec
    return spec


register_baseline(BaselineSpec("triton", _triton_factory, "ours: sonicmoe.experts(backend='triton')",
                               kind="ours", router_variant=True, activations=ACTIVATIONS))
register_baseline(BaselineSpec("torch", _torch_factory,
                               "sonicmoe.experts(backend='torch'): gather + torch._grouped_mm + index_add",
                               router_variant=True, activations=ACTIVATIONS))
register_baseline(BaselineSpec("loop", _loop_factory, "per-expert Python loop of F.linear (E <= --loop-max-E)",
                               activations=ACTIVATIONS))
register_baseline(BaselineSpec("upper", _upper_factory,
                               "cuBLAS upper bound: balanced bmm + SwiGLU + bmm + weighted sum, no gather",
                               kind="bound", check_max_T=8192, activations=ACTIVATIONS))
register_baseline(BaselineSpec("scattermoe", _scattermoe_factory, "ScatterMoE parallel_linear (if installed)",
                               kind="library", default=False, activations=ACTIVATIONS))

DEFAULT_BACKENDS = ("triton", "torch", "loop", "upper")


def library_installed(name: str) -> bool:
    """Whether a competitor library's top-level module can be found (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def resolve_backends(text: str) -> list[str]:
    """Parse ``--backends``: comma list of registry names; ``default`` expands to the default four plus
    installed competitor libraries; ``all`` to every registered backend. ValueError on unknown names."""
    out: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if item == "default":
            names = [n for n, s in REGISTRY.items() if s.default]
            names += [n for n, s in REGISTRY.items() if s.kind == "library" and library_installed(n)]
        elif item == "all":
            names = list(REGISTRY)
        elif item in REGISTRY:
            names = [item]
        else:
            raise ValueError(f"unknown backend {item!r}; choose from {', '.join(REGISTRY)}, default, all")
        out += [n for n in names if n not in out]
    return out
