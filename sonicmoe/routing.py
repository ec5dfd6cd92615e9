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
    * ``row_token[r]`` is the token of row r; rows of one expert are in ascending token order (pairs
      of one token and expert, which ``routing_from_pairs`` forbids, would keep the pairs' order);
    * with padding pairs (``padding=True``: static-length routing, e.g. ``token_rounding(static=True)``)
      the real rows are ``0 : expert_offsets[E]`` and the real slots ``0 : token_offsets[T]``; the rows
      and slots after them belong to no expert and no token, so no kernel computes or reads them.
    * ``token_offsets[T] == R``; ``token_rows[token_offsets[t]:token_offsets[t+1]]`` are the rows of
      token t, in pair order; ``slot_pair`` is the pair behind each of those slots.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ._autocast import no_autocast
from ._device import on_device
from .config import ROUTER_ORDERS, check_flag
from .env import env_switch
from .ops.router_logits import bf16_gemm_applies, router_logits, router_logits_ref

INDEX_DTYPE = torch.int32


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """True for torch's integer dtypes (int8 to int64, the unsigned ones); False for floating-point, complex and bool.

    The one test behind every "must be an integer tensor" TypeError of routing indices (pairs, ``topk_ids``).
    """
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


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
        padded: the pairs may include padding pairs (token T, expert E), whose rows come after
            ``expert_offsets[E]`` (their ``row_token`` reads T − 1, a valid index that nothing adds up; 0 when T = 0,
            which no kernel reads).
        tile_rows: a performance hint, 0 (none) or the M_tile to whose multiples the routing that built it
            rounded every expert's count (token rounding sets it: SPEC §5). Kernels may choose a schedule by
            it (:func:`sonicmoe.ops.up_proj_ws.up_ws_preferred`); their results never depend on it.
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
    padded: bool = False
    tile_rows: int = 0
    # kernel tile tables and the load order of this routing, built once and shared by its kernels
    # (:meth:`cached`); not a field of the metadata
    _tile_tables: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def cached(self, key):
        """What :meth:`cache` stored under ``key`` for this ``expert_offsets`` tensor, unmodified since (its
        version counter; inference tensors have none and cannot change outside inference mode), else None. The
        kernels' derived tables (:func:`sonicmoe.ops.grouped_gemm_ws.routing_tile_table`,
        :func:`sonicmoe.ops.load_order.routing_load_order`) are built once per Routing this way, without a sync."""
        hit = self._tile_tables.get(key)
        if hit is not None and hit[0] is self.expert_offsets and hit[1] == _version_of(self.expert_offsets):
            return hit[2]
        return None

    def cache(self, key, value) -> None:
        """Keep ``value``, derived from the current ``expert_offsets``, under ``key`` (see :meth:`cached`)."""
        self._tile_tables[key] = (self.expert_offsets, _version_of(self.expert_offsets), value)

    @property
    def num_rows(self) -> int:
        """R, the number of routed pairs (rows); with padding, the static length (``expert_offsets[E]``
        is the number of real ones)."""
        return self.row_token.shape[0]

    def expert_counts(self) -> torch.Tensor:
        """(E,) int32 rows per expert, T_e."""
        return self.expert_offsets[1:] - self.expert_offsets[:-1]

    def row_expert(self) -> torch.Tensor:
        """(R,) int64 expert of each row (derived from ``expert_offsets``; padding rows read E − 1)."""
        rows = torch.arange(self.num_rows, device=self.row_token.device, dtype=INDEX_DTYPE)
        found = torch.searchsorted(self.expert_offsets[1:], rows, right=True)
        return found.clamp_(max=self.num_experts - 1) if self.padded else found

    def real_rows(self) -> torch.Tensor | None:
        """(R,) bool, True for the rows of real pairs; ``None`` without padding (all are real)."""
        if not self.padded:
            return None
        rows = torch.arange(self.num_rows, device=self.row_token.device, dtype=INDEX_DTYPE)
        return rows < self.expert_offsets[-1]

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
    check: bool = False,
    padding: bool = False,
) -> Routing:
    """Build :class:`Routing` for general routing: any R (token, expert) pairs (SPEC §5.4).

    Args:
        pair_token: (R,) integer token index of each pair, in [0, T).
        pair_expert: (R,) integer expert index of each pair, in [0, E).
        num_tokens: T.
        num_experts: E.
        token_major: promise that ``pair_token`` is non-decreasing (skips one sort).
        check: also verify the index ranges with :func:`check_pairs` (ValueError naming the argument) and,
            with ``token_major``, that ``pair_token`` is non-decreasing (a broken promise gives the Triton
            backend wrong outputs, the torch backend right ones). This **synchronises** with the device
            (min/max are read back to the host), so it is off by default; leave it off inside
            ``torch.compile`` regions and CUDA-graph captures.
        padding: some pairs are *padding pairs* (token T, expert E; always both): a static-length routing
            (R fixed in advance, the real pairs data-dependent, as ``token_rounding(static=True)``
            returns), built without reading how many are real (no host sync). Padding pairs belong to
            no expert and no token: no row of theirs is computed or added, and their scores get zero
            gradients.

    A token may have any number of pairs, none included; a pair given twice is two rows, each computed and
    added with its own score (as two experts would be). Without ``check`` nothing is
    read back (no host sync) and the ranges are the caller's promise: an out-of-range token index
    makes the kernels read out of bounds, an out-of-range expert index leaves rows that no expert
    computes (their uninitialised values reach the output). Shapes, dtypes and devices are always
    checked (no sync).

    Raises:
        TypeError: non-tensor or non-integer (float, complex, bool) indices.
        ValueError: indices not 1-D of one length R, on different devices, num_tokens < 0 or
            num_experts < 1, ``token_major``, ``check`` or ``padding`` not a bool; with ``check``, an index out of
            range or, with ``token_major``, a token index smaller than the one before it.
    """
    for name, idx in (("pair_token", pair_token), ("pair_expert", pair_expert)):
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"{name} must be a 1-D integer torch.Tensor, got {type(idx).__name__}")
        if not is_integer_dtype(idx.dtype):
            raise TypeError(f"{name} must be an integer tensor (int32 or int64), got {idx.dtype}")
    if pair_token.dim() != 1 or pair_expert.shape != pair_token.shape:
        raise ValueError(
            f"pair_token and pair_expert must be 1-D of the same length R, got {tuple(pair_token.shape)}"
            f" and {tuple(pair_expert.shape)}"
        )
    if pair_expert.device != pair_token.device:
        raise ValueError(f"pair_expert is on {pair_expert.device} but pair_token is on {pair_token.device}; "
                         "put them on one device")
    check_size("num_tokens", num_tokens, 0)
    check_size("num_experts", num_experts, 1)
    for name, flag in (("token_major", token_major), ("check", check), ("padding", padding)):
        check_flag(name, flag)  # a string such as "False" would read as True: token_major's promise, silently
    if check:
        check_pairs(pair_token, pair_expert, num_tokens + padding, num_experts + padding)
        if padding and bool(((pair_token == num_tokens) != (pair_expert == num_experts)).any()):
            raise ValueError(f"padding pairs must be (token T={num_tokens}, expert E={num_experts}), both: a pair has "
                             "one of the two and not the other")
        if token_major and bool((pair_token[1:] < pair_token[:-1]).any()):
            raise ValueError("token_major=True promises a non-decreasing pair_token, but it decreases at some pair: "
                             "sort the pairs by token or pass token_major=False")
    device = pair_token.device
    pair_expert = pair_expert.to(INDEX_DTYPE)
    pair_token = pair_token.to(INDEX_DTYPE)
    r = pair_token.shape[0]
    # Token order first (the slots of each token), then a stable sort of those slots by expert: the rows
    # of each expert come out in ascending token order whatever order the pairs came in, the layout top-k's
    # token-major pairs get from the plain stable sort by expert (with token-rounding pairs, the up-projection
    # timed 4-6% faster this way than with rows in score order: one H100 comparison across two autotuned
    # processes, 2026-11-24).
    if token_major:
        slot_pair = None
        sorted_token = pair_token
        sorted_expert, row_pair64 = torch.sort(pair_expert, stable=True)
    else:
        sorted_token, slot_pair = torch.sort(pair_token, stable=True)
        sorted_expert, row_slot = torch.sort(pair_expert[slot_pair], stable=True)
        row_pair64 = slot_pair[row_slot]
        slot_pair = slot_pair.to(INDEX_DTYPE)
    row_pair = row_pair64.to(INDEX_DTYPE)
    pair_row = torch.empty_like(row_pair)
    pair_row[row_pair64] = torch.arange(r, device=device, dtype=INDEX_DTYPE)  # the sort's int64 indices: no copy
    token_rows = pair_row if token_major else pair_row.index_select(0, slot_pair)
    row_token = pair_token.index_select(0, row_pair)
    if padding and num_tokens:  # the padding rows' token T -> T - 1: in range for gathers; never added up
        row_token = row_token.clamp_(max=num_tokens - 1)
    return Routing(
        num_tokens=num_tokens,
        num_experts=num_experts,
        expert_offsets=_offsets(sorted_expert, num_experts),
        row_token=row_token,
        row_pair=row_pair,
        pair_row=pair_row,
        token_offsets=_offsets(sorted_token, num_tokens),
        token_rows=token_rows,
        slot_pair=slot_pair,
        padded=bool(padding),
    )


def routing_from_topk(topk_ids: torch.Tensor, num_experts: int, *, check: bool = False) -> Routing:
    """Build :class:`Routing` from top-k expert ids (T, K): pairs p = t·K + k, token-major; the same routing as
    ``routing_from_pairs(p // K, topk_ids.reshape(-1), T, E, token_major=True)``, without its general steps. No host
    sync; the ids' values are the caller's promise (in [0, E), distinct per token), as there: without ``check`` an
    id >= E drops its pair and a repeated one counts twice, silently. ``check=True`` verifies them first (host
    syncs; for ids that do not come from :func:`router_topk`, e.g. while debugging a custom router).

    With ``SONICMOE_ROUTING_KERNEL=1`` on CUDA (outside ``torch.compile``, E up to 256) a counting sort in three
    Triton launches (:func:`sonicmoe.ops.topk_routing.topk_routing`; off by default: on an H200 in session 80 the 7B
    layer took the same GPU time either way and showed no host-time saving beyond the run-to-run spread), else the
    torch operations of :func:`routing_from_topk_ref`; the two give the same tensors.

    Raises:
        ValueError: ``topk_ids`` not 2-D; ``num_experts`` not an int >= 1; with ``check``, an id outside [0, E) or
            one repeated within a token's row.
        TypeError: ``topk_ids`` not an integer tensor.
    """
    check_topk_ids(topk_ids, num_experts, check)
    topk_ids = _wide_ids(topk_ids)
    if not torch.compiler.is_compiling() and env_switch("SONICMOE_ROUTING_KERNEL", False) and topk_ids.is_cuda:
        from .ops import topk_routing  # imports triton: lazily, off the CPU path

        if topk_routing.counting_sort_applies(topk_ids, num_experts):
            with on_device(topk_ids):  # the kernels launch on the ids' CUDA device, whichever is current
                return topk_routing.topk_routing(topk_ids, num_experts)
    return _routing_from_topk_torch(topk_ids, num_experts)


def routing_from_topk_ref(topk_ids: torch.Tensor, num_experts: int, *, check: bool = False) -> Routing:
    """Torch twin of :func:`routing_from_topk` (same arguments, checks and results) in torch operations only."""
    check_topk_ids(topk_ids, num_experts, check)
    return _routing_from_topk_torch(_wide_ids(topk_ids), num_experts)


def _wide_ids(ids: torch.Tensor) -> torch.Tensor:
    """int8/uint8/int16 ids as int64: the searches over their sorted values count up to E + 1, which those types
    cannot hold for every E (int8 ids with E = 128 made expert_offsets[E] wrap to 0)."""
    return ids if ids.dtype in (torch.int32, torch.int64) else ids.long()


def routing_dense(num_tokens: int, device: torch.device | str | None = None) -> Routing:
    """The routing of one expert that every token passes through once (a *shared* expert, DeepSeek-V2/V3 and
    Qwen2-MoE): E = 1, R = T pairs, pair, row and slot t all token t. The same tensors as
    ``routing_from_topk(zeros(T, 1), 1)``, from two launches instead of a sort (one arange serves every index
    array, which no kernel writes).

    Args:
        num_tokens: T >= 0.
        device: where the metadata lives (x's device).

    Raises:
        ValueError: ``num_tokens`` not an int >= 0.
    """
    check_size("num_tokens", num_tokens, 0)
    t = num_tokens
    offsets = torch.arange(t + 1, device=device, dtype=INDEX_DTYPE)  # token t's one slot starts at t
    rows = offsets[:t]
    expert = offsets[::t].contiguous() if t else offsets.new_zeros(2)  # [0, T]
    return Routing(num_tokens=t, num_experts=1, expert_offsets=expert, row_token=rows, row_pair=rows, pair_row=rows,
                   token_offsets=offsets, token_rows=rows, slot_pair=None, padded=False)


def check_topk_ids(topk_ids: torch.Tensor, num_experts: int, check: bool = False, *, name: str = "topk_ids") -> None:
    """TypeError/ValueError naming ``name`` unless ``topk_ids`` is a (T, K) integer tensor; with ``check`` (two host
    syncs) also unless every id lies in [0, E) and each token's K ids are distinct."""
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"{name} must be a (T, K) integer tensor, got {type(topk_ids).__name__}")
    if topk_ids.dim() != 2:
        raise ValueError(f"{name} must have shape (T, K), got {tuple(topk_ids.shape)}")
    check_size("num_experts", num_experts, 1)
    if not is_integer_dtype(topk_ids.dtype):
        raise TypeError(f"{name} must be an integer tensor (int32 or int64), got {topk_ids.dtype}")
    check_flag("check", check)
    if check and topk_ids.numel():  # synchronises
        check_index_range(name, topk_ids, num_experts, "E")
        ids = topk_ids.sort(dim=1).values
        repeated = (ids[:, 1:] == ids[:, :-1]).any(dim=1).nonzero()
        if repeated.numel():
            t = int(repeated[0, 0])
            raise ValueError(f"{name} must hold distinct experts per token, token {t} has "
                             f"{topk_ids[t].tolist()}")


def _routing_from_topk_torch(topk_ids: torch.Tensor, num_experts: int) -> Routing:
    t, k = topk_ids.shape
    # routing_from_pairs(t // K, topk_ids, token_major=True) with what top-k's layout gives for free: pair p is
    # token p // K, so row_token = row_pair // K and token t's slots start at t·K (no pair-token array, no index
    # gather, no search over the pairs): 10 torch ops instead of 16
    device, r = topk_ids.device, t * k
    sorted_expert, row_pair64 = torch.sort(topk_ids.reshape(-1), stable=True)  # rows of an expert in token order
    row_pair = row_pair64.to(INDEX_DTYPE)
    pair_row = torch.empty_like(row_pair)
    pair_row[row_pair64] = torch.arange(r, device=device, dtype=INDEX_DTYPE)
    return Routing(
        num_tokens=t,
        num_experts=num_experts,
        expert_offsets=_offsets(sorted_expert, num_experts),
        row_token=torch.div(row_pair, k, rounding_mode="floor"),
        row_pair=row_pair,
        pair_row=pair_row,
        token_offsets=torch.arange(0, r + 1, k, device=device, dtype=INDEX_DTYPE) if k else
        torch.zeros(t + 1, device=device, dtype=INDEX_DTYPE),
        token_rows=pair_row,
        slot_pair=None,
        padded=False,
    )


def check_pairs(pair_token: torch.Tensor, pair_expert: torch.Tensor, num_tokens: int, num_experts: int):
    """Raise ValueError if any pair index is out of range (synchronises; for public entry points)."""
    for name, idx, hi, letter in (
        ("pair_token", pair_token, num_tokens, "T"),
        ("pair_expert", pair_expert, num_experts, "E"),
    ):
        if not is_integer_dtype(idx.dtype):
            raise TypeError(f"{name} must be an integer tensor, got {idx.dtype}")
        check_index_range(name, idx, hi, letter)


def check_index_range(name: str, idx: torch.Tensor, hi: int, letter: str) -> None:
    """ValueError naming ``name`` unless every value of the integer tensor ``idx`` lies in [0, hi) (``letter`` names
    hi, e.g. "E"). Reads min and max back (host syncs)."""
    if idx.numel():
        if idx.dtype not in (torch.int32, torch.int64):  # torch has no min/max of uint16/32/64 on every device
            idx = idx.long()
        lo_v, hi_v = int(idx.min()), int(idx.max())
        if lo_v < 0 or hi_v >= hi:
            raise ValueError(f"{name} must lie in [0, {letter}={hi}), got values in [{lo_v}, {hi_v}]")


class RouterOutput:
    """What the router returns for T tokens.

    Attributes:
        logits: (T, E) router logits X W_rᵀ (float32; float64 for float64 x).
        probs: (T, E) softmax over all E logits (float32), used by the auxiliary loss and token rounding; with
            ``sigmoid_then_topk``, the sigmoids normalised to sum 1 over E (DeepSeek-V3's balance loss). Computed
            from ``logits`` (with autograd) on first access when the router did not need it, then kept: a layer
            without the auxiliary loss or token rounding never runs that (T, E) softmax nor saves its output.
        topk_ids: (T, K) int64 chosen experts, by decreasing logit (``sigmoid_then_topk``: by decreasing
            sigmoid + bias).
        topk_scores: (T, K) scores S of the chosen experts, in the logits' dtype (differentiable).

    ``RouterOutput(logits, probs, topk_ids, topk_scores)``; ``probs=None`` computes it on first access, as the
    softmax of ``logits`` (``sigmoid=True``: the sigmoids normalised to sum 1).
    """

    def __init__(self, logits: torch.Tensor, probs: torch.Tensor | None, topk_ids: torch.Tensor,
                 topk_scores: torch.Tensor, *, sigmoid: bool = False):
        self.logits = logits
        self._probs = probs
        self._sigmoid = sigmoid
        self.topk_ids = topk_ids
        self.topk_scores = topk_scores

    @property
    def probs(self) -> torch.Tensor:
        if self._probs is None:
            self._probs = router_probs(self.logits, sigmoid=self._sigmoid)
        return self._probs

    def __repr__(self) -> str:
        return (f"RouterOutput(logits={tuple(self.logits.shape)}, topk_ids={tuple(self.topk_ids.shape)}, "
                f"probs={'computed' if self._probs is not None else 'on first access'})")


def router_probs(logits: torch.Tensor, sigmoid: bool = False) -> torch.Tensor:
    """(T, E) router probabilities from the logits: the softmax over E, or (``sigmoid``) the sigmoids normalised to
    sum 1 over E (DeepSeek-V3's sequence-wise balance loss reads these)."""
    if sigmoid:
        affinity = torch.sigmoid(logits)
        return affinity / affinity.sum(dim=-1, keepdim=True)
    return torch.softmax(logits, dim=-1)


def _version_of(t: torch.Tensor) -> int | None:
    """``t``'s in-place version counter; None for an inference tensor (made under ``torch.inference_mode``), which
    has none (reading ``_version`` raised: the layer failed under inference_mode on sm_90, session 83)."""
    return None if t.is_inference() else t._version


def take_chosen(values: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``values.gather(1, topk_ids)``: the (T, K) entries of the (T, E) ``values`` at the (T, K) int64 ``topk_ids``.

    Under torch.compile on CPU it is a one-hot select and sum over E instead (the same values, but a −0.0 entry
    reads +0.0, as the sum starts from +0.0; a dense backward, T·K·E elements): Inductor's CPU code (torch 2.13) read
    the scatter-add buffer of gather's backward before writing it where it fused that with a softmax backward, which
    gave token rounding's router wrong gradients without an error (session 86)."""
    if values.device.type == "cpu" and torch.compiler.is_compiling():
        one_hot = topk_ids[:, :, None] == torch.arange(values.shape[1], device=values.device)
        return torch.where(one_hot, values[:, None, :], 0.0).sum(dim=-1)
    return values.gather(1, topk_ids)


def topk_lowest_first(key: torch.Tensor, k: int) -> torch.Tensor:
    """(…, k) int64 indices of the k largest entries of each row of ``key``, in decreasing order, equal entries
    toward the lower index and a NaN first (the router kernel's rule, :mod:`sonicmoe.ops.router`).

    torch.topk leaves the order of equal entries unspecified (an all-zero token, whose E logits are equal,
    picked experts 84, 87, … on CPU where the kernel picks 0, 1, …); a stable descending sort fixes it, so the
    torch path, the kernel and their twin choose the same experts."""
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k].contiguous()


def router_topk(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    top_k: int,
    *,
    router_order: str = "topk_then_softmax",
    renormalize: bool = False,
    expert_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    use_kernel: bool | None = None,
    router_bias: torch.Tensor | None = None,
) -> RouterOutput:
    """Top-k token-choice router (SPEC §2), computed in float32, or float64 for float64 ``x`` (the computing dtype
    follows x: a float64 ``router_weight`` beside float32 x is rounded to float32).

    Args:
        x: (T, d) tokens.
        router_weight: (E, d) router weight W_r.
        top_k: K.
        router_bias: optional (E,) float bias b_r of the router's linear map, logits = X W_rᵀ + b_r (gpt-oss's router;
            differentiable, added in the logits' dtype). Unlike ``expert_bias`` it shifts the logits themselves, so
            it changes the scores and the losses too, under every ``router_order``.
        router_order: ``"topk_then_softmax"``: S = softmax over the K chosen logits.
            ``"softmax_then_topk"``: S = the chosen entries of softmax over all E logits, divided by
            their sum when ``renormalize``.
            ``"sigmoid_then_topk"`` (DeepSeek-V3): the top-K of sigmoid(logits) + ``expert_bias``; S = the
            chosen sigmoids, divided by (their sum + 1e-20) when ``renormalize``.
        expert_bias: optional (E,) float bias for the choice of ``"sigmoid_then_topk"`` only (no gradient:
            auxiliary-loss-free load balancing, :meth:`sonicmoe.MoE.update_expert_bias`).
        n_group, topk_group: group-limited routing of ``"sigmoid_then_topk"`` (DeepSeek-V3: 8 and 4). The E
            experts form ``n_group`` groups of E/n_group consecutive ones; a group scores the sum of its two largest
            sigmoid + bias; each token keeps its ``topk_group`` best groups and picks its K experts in them. 1, 1:
            no groups. The router kernel makes the group-limited choice too (session 75; before, torch ops).
        use_kernel: pick the top-K and compute S (T, K) with the fused Triton router kernel
            (:func:`sonicmoe.ops.router.topk_router`) from the (T, E) logits. ``None`` (default): on
            CUDA unless the environment sets SONICMOE_ROUTER_KERNEL=0 (7B layer with the router, fwd+bwd
            on an H200: 4.15-4.30 ms against 4.40-4.49 with torch.topk + softmax, session 19); on CPU
            torch ops (:func:`topk_lowest_first` + softmax). ``True``: on CUDA, and on CPU under the Triton
            interpreter (TRITON_INTERPRET=1; tests).
            ``False``: always torch ops. float64 logits always take the torch path. Both paths break ties
            between equal keys toward the lower expert index.

    The logits GEMM X W_rᵀ and ``probs`` (softmax over all E, for the load-balancing loss and token rounding;
    computed on first access unless the choice needed it, :class:`RouterOutput`) are torch ops on every path;
    logits, probs and S all carry autograd. The logits are float32: with X and W_r both
    bfloat16 on CUDA, from a bfloat16 tensor-core GEMM with float32 sums (:func:`sonicmoe.ops.router_logits.
    router_logits`, exact products, about 10x the float32 GEMM's speed); otherwise from the float32 GEMM of the
    upcast operands. Under ``torch.autocast`` the logits are still float32 (autocast is off around their GEMM).

    Raises:
        TypeError: ``x`` or ``router_weight`` not a bf16/fp16/fp32/fp64 tensor; ``expert_bias`` or ``router_bias`` not
            a float tensor.
        ValueError: ``x`` not (T, d), ``router_weight`` not (E, d) on x's device, ``router_bias`` not (E,) on x's
            device, ``top_k`` not an int in [1, E], ``renormalize`` not a bool, ``use_kernel`` not None or a bool,
            an unknown ``router_order``, ``expert_bias`` not (E,) on x's device or given without
            ``"sigmoid_then_topk"``, expert groups that cannot hold K experts (:func:`check_expert_groups`).
    """
    check_router_inputs(x, router_weight, top_k)
    check_flag("renormalize", renormalize)
    if use_kernel is not None:
        check_flag("use_kernel", use_kernel)  # None, True or False: 0 or "no" took the kernel on CUDA
    if router_order not in ROUTER_ORDERS:
        raise ValueError(f"router_order must be one of {ROUTER_ORDERS}, got {router_order!r}")
    check_expert_bias(expert_bias, router_weight.shape[0], router_order, x.device)
    check_expert_groups(n_group, topk_group, router_weight.shape[0], top_k, router_order)
    check_router_bias(router_bias, router_weight.shape[0], x.device)
    with on_device(x):  # the kernels launch on x's CUDA device, whichever is current
        return _router_topk(x, router_weight, top_k, router_order, renormalize, expert_bias, (n_group, topk_group),
                            use_kernel, router_bias)


def _router_topk(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, router_order: str, renormalize: bool,
                 expert_bias: torch.Tensor | None, groups: tuple[int, int],
                 use_kernel: bool | None, router_bias: torch.Tensor | None = None) -> RouterOutput:
    with no_autocast(x.device):  # float32 logits under torch.autocast too
        if bf16_gemm_applies(x, router_weight):  # bfloat16 X and W_r on CUDA: the tensor cores, float32 sums
            logits = router_logits(x, router_weight)
        else:
            logits = router_logits_ref(x, router_weight)
        if router_bias is not None:
            logits = logits + router_bias.to(logits.dtype)
    sigmoid = router_order == "sigmoid_then_topk"
    if use_kernel is None:
        use_kernel = env_switch("SONICMOE_ROUTER_KERNEL", True) and logits.is_cuda
    kernel = use_kernel is not False and logits.dtype == torch.float32
    if kernel and not logits.is_cuda:  # CPU: only when asked for, and only under the interpreter
        kernel = use_kernel is True and logits.device.type == "cpu"
        if kernel:
            from .ops.common import interpreting  # imports triton: lazily, off the default CPU path

            kernel = interpreting()
    if kernel:
        from .ops.router import topk_router

        topk_ids, scores = topk_router(logits, top_k, router_order, renormalize, expert_bias, *groups)
        return RouterOutput(logits, None, topk_ids, scores, sigmoid=sigmoid)
    if sigmoid:
        topk_ids, scores = sigmoid_topk(torch.sigmoid(logits), top_k, renormalize, expert_bias, *groups)
        return RouterOutput(logits, None, topk_ids, scores, sigmoid=True)
    topk_ids = topk_lowest_first(logits, top_k)
    top_logits = take_chosen(logits, topk_ids)
    probs = None
    if router_order == "topk_then_softmax":
        scores = torch.softmax(top_logits, dim=-1)
    else:
        probs = router_probs(logits)
        scores = take_chosen(probs, topk_ids)
        if renormalize:
            scores = scores / scores.sum(dim=-1, keepdim=True)
    return RouterOutput(logits, probs, topk_ids, scores)


ROUTER_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_router_inputs(x, router_weight, top_k) -> None:
    """TypeError/ValueError naming the argument unless ``x`` is a (T, d) and ``router_weight`` an (E, d) tensor, each
    bfloat16, float16, float32 or float64 (the router computes in float32, in float64 for float64 x), on one device, and
    ``top_k`` an int in [1, E]. Reads no values (no host sync)."""
    for name, v in (("x", x), ("router_weight", router_weight)):
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
        if v.dtype not in ROUTER_DTYPES:
            raise TypeError(f"{name} must be bfloat16, float16, float32 or float64, got {v.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must have shape (T, d), got {tuple(x.shape)}")
    if router_weight.dim() != 2 or router_weight.shape[0] < 1 or router_weight.shape[1] != x.shape[1]:
        raise ValueError(f"router_weight must have shape (E, d={x.shape[1]}) with E >= 1 to match x {tuple(x.shape)}, "
                         f"got {tuple(router_weight.shape)}")
    if router_weight.device != x.device:
        raise ValueError(f"router_weight is on {router_weight.device} but x is on {x.device}")
    check_top_k(top_k, router_weight.shape[0])


def check_size(name: str, v, lo: int) -> None:
    """ValueError naming ``name`` unless ``v`` is an int (not a bool) or a torch.SymInt (symbolic tracing) >= ``lo``."""
    if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def check_top_k(top_k, num_experts: int) -> None:
    """ValueError naming ``top_k`` unless it is an int (not a bool) in [1, E]."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, E={num_experts}], got {top_k!r}")


def _check_per_expert(name: str, v, num_experts: int, device, where: str) -> None:
    """TypeError/ValueError naming ``name`` unless ``v`` is an (E,) floating tensor on ``device`` (``where`` names what
    it must share a device with)."""
    if not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor of shape (E={num_experts},), got "
                        f"{getattr(v, 'dtype', type(v).__name__)}")
    if tuple(v.shape) != (num_experts,):
        raise ValueError(f"{name} must have shape (E={num_experts},), got {tuple(v.shape)}")
    if v.device != device:
        raise ValueError(f"{name} is on {v.device} but {where} on {device}")


def check_router_bias(router_bias, num_experts: int, device) -> None:
    """TypeError/ValueError naming ``router_bias`` unless it is None or an (E,) floating tensor on ``device``."""
    if router_bias is not None:
        _check_per_expert("router_bias", router_bias, num_experts, device, "x is")


def check_expert_bias(expert_bias, num_experts: int, router_order: str, device) -> None:
    """ValueError/TypeError naming ``expert_bias`` unless it is None or an (E,) floating tensor on ``device`` given
    with ``router_order="sigmoid_then_topk"`` (the only order that selects by a bias)."""
    if expert_bias is None:
        return
    if router_order != "sigmoid_then_topk":
        raise ValueError(f"expert_bias steers the choice of router_order='sigmoid_then_topk' only; got it with "
                         f"router_order={router_order!r}")
    _check_per_expert("expert_bias", expert_bias, num_experts, device, "the logits are")


def sigmoid_topk(probs: torch.Tensor, top_k: int, renormalize: bool, expert_bias: torch.Tensor | None,
                 n_group: int = 1, topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's choice in torch: ``probs`` = sigmoid(logits) (T, E) -> (topk_ids (T, K) int64 by decreasing
    probs + ``expert_bias`` (no gradient through the bias or the choice), topk_scores = the chosen probs, divided by
    (their sum + 1e-20) when ``renormalize``). With ``n_group`` > 1, only the experts of each token's
    ``topk_group`` best groups (E/n_group consecutive experts; a group's score is the sum of its two largest
    probs + bias) can be chosen (:func:`router_topk`)."""
    key = probs.detach()
    if expert_bias is not None:
        key = key + expert_bias.detach().to(key.dtype)
    if n_group > 1:
        t, e = key.shape
        grouped = key.view(t, n_group, e // n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (T, n_group)
        keep = torch.zeros(t, n_group, dtype=torch.bool, device=key.device)
        keep.scatter_(1, topk_lowest_first(group_score, topk_group), True)
        key = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, e)
    topk_ids = topk_lowest_first(key, top_k)
    scores = take_chosen(probs, topk_ids)
    if renormalize:
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_ids, scores


def check_expert_groups(n_group, topk_group, num_experts: int, top_k: int, router_order: str) -> None:
    """ValueError naming ``n_group`` or ``topk_group`` unless they describe a group-limited choice that can pick K
    experts: ``n_group`` a divisor of E with at least two experts per group (or 1: no groups),
    1 <= ``topk_group`` <= ``n_group``, K <= topk_group · E/n_group; groups only under ``"sigmoid_then_topk"``."""
    for name, v in (("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if n_group == 1:
        if topk_group != 1:
            raise ValueError(f"topk_group must be 1 without groups (n_group=1), got {topk_group}")
        return
    if router_order != "sigmoid_then_topk":
        raise ValueError(f"n_group > 1 (group-limited routing) needs router_order='sigmoid_then_topk', got "
                         f"{router_order!r}")
    if num_experts % n_group or num_experts // n_group < 2:
        raise ValueError(f"n_group must divide E={num_experts} into groups of at least two experts, got {n_group}")
    if topk_group > n_group or top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"topk_group must lie in [1, n_group={n_group}] and keep at least K={top_k} experts "
                         f"(topk_group · E/n_group >= K), got {topk_group}")


def scaled_scores(topk_scores: torch.Tensor, routed_scaling_factor: float) -> torch.Tensor:
    """The (R,) pair scores of top-k routing: S (T, K) flattened, times ``routed_scaling_factor`` (a finite float
    > 0; DeepSeek-V3's 2.5) unless it is 1.

    Raises:
        ValueError: ``routed_scaling_factor`` not a finite float > 0.
    """
    check_scaling_factor(routed_scaling_factor)
    scores = topk_scores.reshape(-1)
    return scores if routed_scaling_factor == 1 else scores * routed_scaling_factor


def check_scaling_factor(routed_scaling_factor) -> None:
    """ValueError naming ``routed_scaling_factor`` unless it is a finite float (or int) > 0."""
    f = routed_scaling_factor
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0:
        raise ValueError(f"routed_scaling_factor must be a finite float > 0, got {f!r}")


def _check_float_matrix(name: str, v) -> None:
    """TypeError/ValueError naming ``name`` unless ``v`` is a two-dimensional (T, E) floating-point tensor."""
    if not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point:
        raise TypeError(f"{name} must be a (T, E) floating-point tensor, got "
                        f"{v.dtype if isinstance(v, torch.Tensor) else type(v).__name__}")
    if v.dim() != 2:
        raise ValueError(f"{name} must have shape (T, E), got {tuple(v.shape)}")


def load_balancing_loss(probs: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Switch-style auxiliary loss E · Σ_e f_e · P_e (SPEC §2).

    f_e = T_e / R (fraction of routed pairs on expert e, not differentiated), P_e = mean_t probs[t, e].
    Equals 1 for perfectly uniform routing and probabilities, whatever K (DeepSeek-V3's balance-loss scale, per batch).
    transformers' Mixtral ``load_balancing_loss_func`` divides T_e by T instead of R = T·K: it is K times this one, so
    a coefficient ported from it (Mixtral's ``router_aux_loss_coef`` 0.02) matches when multiplied by K. Under token
    rounding T_e are the rounded counts. Computed and returned in float32, or float64 with float64 probs (float16
    probs summed over more than 65504 tokens would overflow).

    Args:
        probs: (T, E) float router probabilities (:attr:`RouterOutput.probs`), on the routing's device.
        routing: the :class:`Routing` of the same T tokens and E experts.

    Raises:
        TypeError: ``probs`` not a float tensor, ``routing`` not a :class:`Routing`. ValueError: ``probs`` not
        (T, E) for the routing's T and E, or on another device.
    """
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a sonicmoe.Routing, got {type(routing).__name__}")
    _check_float_matrix("probs", probs)
    if tuple(probs.shape) != (routing.num_tokens, routing.num_experts):
        raise ValueError(f"probs must have shape (T={routing.num_tokens}, E={routing.num_experts}) as the routing, "
                         f"got {tuple(probs.shape)}")
    if probs.device != routing.expert_offsets.device:
        raise ValueError(f"probs is on {probs.device} but the routing is on {routing.expert_offsets.device}")
    dtype = torch.promote_types(probs.dtype, torch.float32)
    counts = routing.expert_counts().to(dtype)
    f = counts / counts.sum().clamp_min(1.0)
    p = probs.sum(dim=0, dtype=dtype) / max(probs.shape[0], 1)  # mean over tokens; 0, not NaN, when T = 0
    return routing.num_experts * torch.sum(f * p)


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss mean_t (logsumexp_e logits[t, e])² (ST-MoE) of the (T, E) float ``logits``, computed and
    returned in float32 (float64 for float64 logits): in float16 a logsumexp above 256 squared, or the sum over
    tokens, overflows.

    Raises: TypeError (``logits`` not a float tensor), ValueError (not two-dimensional)."""
    _check_float_matrix("logits", logits)
    lse = torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return lse.square().sum() / max(logits.shape[0], 1)
