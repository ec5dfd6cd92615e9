"""Expert parallelism: the E experts split over the P ranks of a process group, tokens sent to their experts' owners.

Rank r holds the weights of experts [r·E/P, (r+1)·E/P) (E_loc = E/P of them) and routes its own tokens over all E
with a router replicated on every rank. One forward step, for any routing (top-k, general, token rounding):

1. **plan**: each routed pair goes to its expert's owner; a token goes to a rank once, however many of its pairs
   go there. The counts are exchanged (1 + E_loc integers per rank pair: the tokens, and the rows for each of the
   destination's experts), then read to the host (the all-to-all's split sizes);
2. **dispatch and all-to-all**: rank r gathers the rows of x it sends (rank-major, in token order within a
   destination rank; the send buffer) and sends them; each pair's score and the index of its token among those
   its destination receives from r follow, in expert-major order (padding pairs are not sent). Rank r receives
   T_recv tokens, grouped by source rank, and the M pairs over them;
3. **experts**: :func:`sonicmoe.experts` on the T_recv received tokens with the local routing of the M pairs over
   its E_loc experts (general routing: a token has 1 to E_loc of them), so each output row is the sum, over the
   token's pairs on this rank, of S·(W2[e] SwiGLU(W1[e] x + b1[e]) + b2[e]); the Triton kernels (or the torch
   backend) do the gathers, grouped GEMMs and the aggregation, and the experts' autograd Function keeps what it
   always keeps (its input, here the T_recv received tokens, and H);
4. **all-to-all back** and **combine**: each rank gets one partial output per token and destination back and sums
   every token's, in rank order (the aggregation kernel on CUDA, in float32).

The backward runs the same exchanges in reverse: dO is gathered to the send buffer's rows, sent to the experts'
owners, through the experts' backward, and the dX rows come back and are summed per token. Every step is a gather, a
sum in a fixed order or a data exchange: the outputs and gradients are bitwise the same on every run (no atomics).

Gradients: every rank's tokens reach the experts' backward on their owner, so an expert weight's gradient is the sum
over all ranks' losses, while the replicated router weight gets only its rank's. Under data parallelism over the
same group, :func:`expert_parallel_ddp` wraps the model so that DDP averages the replicated parameters and leaves
the expert weights out, which it divides by P: every parameter then gets the gradient of the mean of the ranks'
losses, as with plain data parallelism. Expert parallelism inside data parallelism (W = P·D ranks: experts split
over P, each split held by D replicas) takes :func:`expert_parallel_groups` for the two groups and
``expert_parallel_ddp(model, expert_dp_group=...)``, whose hook then sums the expert gradients over the D replicas
and divides by W.

Cost: one host sync per forward (the all-to-all's split sizes are host integers); none in the backward. A token
crosses the network once per rank holding any of its experts (at most min(K, P) times, not K), twice in the forward
(its x out, its partial output back) and twice in the backward (dO out, dx back), in the activation dtype; each pair
sends its score and an index. In a group of one rank the layer is the plain one plus four copies of x's size each
way (dispatch, exchange, exchange back, combine) and the planning's small ops (host-bound: session 73).

Status: verified against the float32 reference over two ranks on the CPU (gloo, the torch backend and the Triton
kernels through the interpreter) and on CUDA (bf16, Triton; both ranks sharing one H200 over gloo, sessions 72-73).
Two ranks with a GPU each, over NCCL, run the same code but have not been measured.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import numbers

import torch
import torch.distributed as dist

from ._autocast import casts_under_autocast
from ._device import on_device
from .checkpoints import loadable_float
from .config import GATE_UP_LAYOUTS
from .functional import _check_float, _check_routing, check_activation, check_expert_inputs, experts, resolve_backend
from .modules import MoE
from .ops.aggregation import gather_sum, gather_sum_ref
from .routing import Routing, routing_from_pairs


def _group_size_rank(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("expert parallelism needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group, e.g. under torchrun)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:  # torch.distributed answers -1 on a rank outside the group
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of it")
    return world, rank


class _AllToAll(torch.autograd.Function):
    """Rows of x (Σ send_splits, ...) sent, send_splits[j] to rank j; returns the Σ recv_splits rows received, in
    rank order. Backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _all_to_all(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _all_to_all(grad, recv_splits, send_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def _sum_slots(y: torch.Tensor, routing: Routing) -> torch.Tensor:
    """O (T, d): each token's rows of y summed in slot order, in float32 (the aggregation kernel on CUDA, its
    PyTorch twin elsewhere; both deterministic). y holds the routing's first rows, its real ones (padding rows
    come after them: :class:`~sonicmoe.Routing`)."""
    if y.is_cuda:  # the kernel reads the real slots only, which point to the real rows, the first y.shape[0]
        with on_device(y):
            return gather_sum(y, routing, None)
    # the twin reads every slot's row, padding slots' too (and drops them): zero rows for those
    pad = y.new_zeros(routing.num_rows - y.shape[0], y.shape[1])
    return gather_sum_ref(torch.cat([y, pad]) if pad.shape[0] else y, routing, None)


class _Dispatch(torch.autograd.Function):
    """x (T, d) -> the routing's first ``rows`` rows of x (its real ones), in its row order; backward: each token's
    row gradients summed."""

    @staticmethod
    def forward(ctx, x, routing, rows):
        ctx.routing = routing
        return x.index_select(0, routing.row_token[:rows])

    @staticmethod
    def backward(ctx, grad):
        return _sum_slots(grad, ctx.routing), None, None


class _Combine(torch.autograd.Function):
    """Rows y, the routing's first (real) rows in its row order -> O (T, d), each token's rows summed; backward: dO
    gathered to the rows."""

    @staticmethod
    def forward(ctx, y, routing):
        ctx.routing, ctx.rows = routing, y.shape[0]
        return _sum_slots(y, routing)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.routing.row_token[:ctx.rows]), None


@dataclasses.dataclass
class _Plan:
    """Where this rank's rows and tokens go (:func:`_exchange_plan`).

    Attributes:
        tokens: the send buffer as a routing of (token, destination rank) pairs over T tokens and P "experts": its
            real rows are the buffer's rows, rank-major and in token order within a rank (a token once per rank
            receiving any of its pairs), the rest padding (a static P·T rows, built before the sync).
        chunk_row: (R,) int64, each routed row's token as a row of what its destination receives from this rank
            (padding rows: any value; only the first, real, rows are sent).
        recv_first: (P,) int64, the first received token of each source rank (the tokens come by source).
        recv_rows: (P,) int64, the rows received from each source rank.
        recv_counts: (P·E_loc,) int64, the rows received from each source for each local expert, source-major.
        recv_expert: (P·E_loc,) int64, the local expert of each of those blocks.
        splits: host ints, P of each: the tokens and the rows sent to each rank, the tokens and the rows received.
    """

    tokens: Routing
    chunk_row: torch.Tensor
    recv_first: torch.Tensor
    recv_rows: torch.Tensor
    recv_counts: torch.Tensor
    recv_expert: torch.Tensor
    splits: list[int]


def _exchange_plan(routing: Routing, world: int, e_loc: int, group) -> _Plan:
    """Plan the exchange of :func:`expert_parallel_experts`; all of it on the device before its one host sync (the
    split sizes, last), so that the device has queued work while the host waits."""
    t = routing.num_tokens
    pt = world * t
    row_rank = routing.row_expert() // e_loc  # rows are expert-major: so is their destination rank
    key = row_rank * t + routing.row_token.long()  # (rank j, token t) at j·T + t
    real = routing.real_rows()
    if real is not None:  # padding rows go nowhere: to the spare entry P·T, dropped
        key = torch.where(real, key, pt)
    need = torch.zeros(pt + 1, dtype=torch.bool, device=key.device)
    need.index_fill_(0, key, True)  # duplicates write the same value: deterministic (need[key] = True syncs)
    need = need[:-1]
    per_rank = need.view(world, t).sum(1)
    total = per_rank.sum()
    # every (rank, token) gets a place: the needed ones first, in order (the send buffer), then the others
    before = torch.cumsum(need, 0)
    index = torch.arange(pt, device=key.device)
    place = torch.where(need, before - 1, total + index - before)
    order = torch.empty_like(index)
    order[place] = index  # a permutation: no two writes meet
    sent = index < total
    tokens = routing_from_pairs(torch.where(sent, order % max(t, 1), t), torch.where(sent, order // max(t, 1), world),
                                t, world, padding=True)
    first = torch.cumsum(per_rank, 0) - per_rank
    chunk_row = place[key.clamp(max=max(pt - 1, 0))] - first[row_rank] if pt else key
    # per destination rank j: the tokens sent to j, then the rows of each of j's experts
    send_info = torch.cat([per_rank[:, None], routing.expert_counts().view(world, e_loc).long()], 1)
    recv_info = _all_to_all(send_info.flatten(), [e_loc + 1] * world, [e_loc + 1] * world, group).view(world, -1)
    recv_rows = recv_info[:, 1:].sum(1)
    splits = torch.cat([send_info[:, 0], send_info[:, 1:].sum(1), recv_info[:, 0], recv_rows])
    return _Plan(tokens, chunk_row, torch.cumsum(recv_info[:, 0], 0) - recv_info[:, 0], recv_rows,
                 recv_info[:, 1:].flatten(), torch.arange(e_loc, device=key.device).repeat(world), splits.tolist())


def _check_ep_inputs(x, w1, w2, b1, b2, routing, pair_scores, world: int, backend: str,
                     gate_up_layout: str, activation: str = "swiglu") -> None:
    """As :func:`sonicmoe.functional.check_expert_inputs`, with the routing over E = E_loc·P experts; the options
    too, before any exchange (a bad one on one rank would otherwise leave the others waiting in a collective)."""
    allow_float64 = resolve_backend(backend, x) == "torch"  # float64 with the torch backend, as sonicmoe.experts
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up_layout must be one of {GATE_UP_LAYOUTS}, got {gate_up_layout!r}")
    check_activation(activation)
    check_expert_inputs(x, w1, w2, b1, b2, allow_float64=allow_float64)
    if not allow_float64:  # the kernels' device rule, on every rank (a rank whose experts get no row never meets it)
        from .ops.common import check_device  # imports triton: lazily, off the CPU path

        check_device("x", x)
    if w1.shape[0] < 1:
        raise ValueError("w1 must hold at least one expert: E_loc = E/P >= 1")
    if isinstance(routing, Routing) and routing.num_experts != w1.shape[0] * world:
        # (sonicmoe.experts' message would call E_loc·P w1's E)
        raise ValueError(f"routing is for E={routing.num_experts} experts but the group's P={world} ranks hold "
                         f"E = E_loc·P = {w1.shape[0] * world} (w1 has E_loc={w1.shape[0]}): route over all E experts")
    _check_routing(routing, x.shape[0], w1.shape[0] * world, x.device)
    _check_float("pair_scores", pair_scores, allow_float64=allow_float64)
    if pair_scores.dim() != 1 or pair_scores.shape[0] != routing.num_rows:
        raise ValueError(f"pair_scores must have shape (R={routing.num_rows},), got {tuple(pair_scores.shape)}")
    if pair_scores.device != x.device:
        raise ValueError(f"pair_scores is on {pair_scores.device} but x is on {x.device}")


@casts_under_autocast
def expert_parallel_experts(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    routing: Routing,
    pair_scores: torch.Tensor,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    *,
    group=None,
    gate_up_layout: str = "concat",
    backend: str = "auto",
    activation: str = "swiglu",
) -> torch.Tensor:
    """:func:`sonicmoe.experts` with the E experts split over the ranks of ``group`` (module docstring): the same
    arguments, but this rank's tokens and this rank's experts' weights.

    Every rank of ``group`` must call it, in the same order as its other collectives.

    Args:
        x: (T, d) this rank's tokens, bf16/fp16/fp32 (T may differ between ranks, and be 0).
        w1: (E_loc, 2n, d) the gate/up weights of this rank's experts, rank r holding experts
            [r·E_loc, (r+1)·E_loc); ``gate_up_layout`` ``"concat"`` ([gate; up] rows) or ``"interleaved"``.
        w2: (E_loc, d, n). b1, b2: optional (E_loc, 2n), (E_loc, d).
        routing: :class:`~sonicmoe.Routing` of this rank's R pairs over all E = E_loc·P experts: top-k
            (:func:`~sonicmoe.routing_from_topk`), general (:func:`~sonicmoe.routing_from_pairs`, padding included)
            or token rounding's (rounded on each rank's own tokens, so every expert's total over the ranks stays
            a multiple of M_tile).
        pair_scores: (R,) the score S of each pair, differentiable.
        group: the process group (default: the whole world); P = its size.
        backend: the local experts' backend, as :func:`sonicmoe.experts`.
        activation: ``"swiglu"`` or ``"clamped_swiglu"``, as :func:`sonicmoe.experts`.

    Returns:
        O (T, d) in x's dtype: O_t = Σ_{pairs p of token t} S_p · Expert_{e_p}(x_t).

    Synchronises with the device once (the all-to-all's split sizes). Index values are not checked (that would
    sync again), as in :func:`sonicmoe.experts`. Under ``torch.autocast``, x, the weights and biases are cast to the
    autocast dtype first, and the rows cross the network in it (as :func:`sonicmoe.experts` casts).

    Raises:
        RuntimeError: torch.distributed not initialised.
        TypeError, ValueError: as :func:`sonicmoe.experts`, naming the argument (the routing's E is E_loc·P).
    """
    world, _ = _group_size_rank(group)
    _check_ep_inputs(x, w1, w2, b1, b2, routing, pair_scores, world, backend, gate_up_layout, activation)
    e_loc = w1.shape[0]
    plan = _exchange_plan(routing, world, e_loc, group)
    send_tokens, send_rows, recv_tokens, recv_rows = (plan.splits[i * world:(i + 1) * world] for i in range(4))
    t_send, sent, t_recv, m = sum(send_tokens), sum(send_rows), sum(recv_tokens), sum(recv_rows)
    x_recv = _AllToAll.apply(_Dispatch.apply(x, plan.tokens, t_send), send_tokens, recv_tokens, group)
    chunk_row = _all_to_all(plan.chunk_row[:sent], send_rows, recv_rows, group)
    s_recv = _AllToAll.apply(routing.row_scores(pair_scores)[:sent], send_rows, recv_rows, group)
    # the received pairs: by source rank, by local expert within one; their tokens' rows offset by the tokens that
    # came from lower ranks
    offset = torch.repeat_interleave(plan.recv_first, plan.recv_rows, output_size=m)
    local_routing = routing_from_pairs(chunk_row + offset,
                                       torch.repeat_interleave(plan.recv_expert, plan.recv_counts, output_size=m),
                                       t_recv, e_loc)
    local_routing.tile_rows = routing.tile_rows  # each source's counts are multiples of it: so are their sums
    y = experts(x_recv, w1, w2, local_routing, s_recv, b1, b2, gate_up_layout=gate_up_layout, backend=backend,
                activation=activation)
    return _Combine.apply(_AllToAll.apply(y, recv_tokens, send_tokens, group), plan.tokens)


class _AllGatherExperts(torch.autograd.Function):
    """Every rank's (E_loc, ...) expert tensor concatenated to (E, ...); backward: the sum over ranks of the
    gradient, this rank's slice."""

    @staticmethod
    def forward(ctx, w, group):
        world, rank = _group_size_rank(group)
        ctx.group, ctx.world, ctx.rank = group, world, rank
        parts = [torch.empty_like(w) for _ in range(world)]
        dist.all_gather(parts, w.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.world)[ctx.rank], None


@casts_under_autocast
def expert_parallel_experts_ref(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    routing: Routing,
    pair_scores: torch.Tensor,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    *,
    group=None,
    gate_up_layout: str = "concat",
    backend: str = "torch",
    activation: str = "swiglu",
) -> torch.Tensor:
    """Reference for :func:`expert_parallel_experts`, same signature: every rank gathers all E experts' weights
    (all-gather; backward: all-reduce of their gradients) and runs :func:`sonicmoe.experts` on its own tokens.
    Runs on the CPU (gloo); holds P times the expert weights."""
    world, _ = _group_size_rank(group)
    _check_ep_inputs(x, w1, w2, b1, b2, routing, pair_scores, world, backend, gate_up_layout, activation)
    full = [None if w is None else _AllGatherExperts.apply(w, group) for w in (w1, w2, b1, b2)]
    return experts(x, full[0], full[1], routing, pair_scores, full[2], full[3], gate_up_layout=gate_up_layout,
                   backend=backend, activation=activation)


class ExpertParallelMoE(MoE):
    """:class:`sonicmoe.MoE` with its E experts split over the P ranks of a process group (expert parallelism).

    Same arguments, options and ``forward`` as :class:`~sonicmoe.MoE`, plus ``group`` (default: the whole world,
    which must be initialised first). The router ``gate.weight`` (E, d) is replicated; ``experts.gate_up_proj``
    (E_loc, 2n, d), ``experts.down_proj`` (E_loc, d, n) and the optional biases hold this rank's E_loc = E/P
    experts, rank r the experts [r·E_loc, (r+1)·E_loc) (the parameter names of ``MoE``, so a full checkpoint
    maps by slicing: :meth:`load_full_state_dict`). The experts are initialised as ``MoE``'s, from a random stream of
    their rank's own (forked off the current one, keyed by the rank in ``group``; :meth:`reset_parameters` too, after
    building on ``device="meta"``): ranks seeded alike get the same router and different experts, and replicas of
    the same experts (:func:`expert_parallel_groups`) equal ones.
    ``aux_loss`` and ``expert_counts`` are this rank's, over all E experts. Routing ``"topk"`` or
    ``"token_rounding"`` (each rank rounds its own tokens' counts, so every expert's total stays a multiple of
    M_tile). One host sync per forward (:func:`expert_parallel_experts`), and with
    ``static_pairs=False`` token rounding's own.

    Gradients: see the module docstring; wrap the model with :func:`expert_parallel_ddp` for data parallelism
    over the same group.

    Copies: ``copy.deepcopy`` (of the layer, or of a model or DDP wrapper holding it) copies the weights and shares
    ``group`` (a handle on this process's communicator, which cannot be copied): the copy exchanges over the same
    ranks. (:func:`expert_parallel_ddp`'s gradient hooks are tensor hooks, which torch does not copy: wrap a copied
    model with it again.) Pickling (``torch.save`` of the module) keeps ``group`` only where it is the default
    group (None, or ``torch.distributed.group.WORLD`` given explicitly; unpickled as None: the world of the process
    that loads it), as DDP does; another group raises TypeError: save the ``state_dict`` instead.

    Raises:
        RuntimeError: torch.distributed not initialised.
        ValueError: E not a multiple of P; as :class:`~sonicmoe.MoE`.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *, group=None,
                 **kwargs):
        world, rank = _group_size_rank(group)
        if isinstance(num_experts, numbers.Integral) and not isinstance(num_experts, bool):
            num_experts = int(num_experts)  # numpy integers, as MoEConfig takes them
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts % world:
            raise ValueError(f"num_experts must be a positive multiple of the group's size P={world} "
                             f"(E_loc = E/P experts per rank), got {num_experts!r}")
        self.ep_group, self.ep_size, self.ep_rank = group, world, rank
        super().__init__(hidden_size, intermediate_size, num_experts, top_k, **kwargs)
        self._reset_local_experts()

    def __deepcopy__(self, memo: dict) -> ExpertParallelMoE:
        """copy.deepcopy: the weights copied, the process group shared (a ProcessGroup cannot be copied or pickled;
        before, deepcopy raised torch's TypeError "cannot pickle ... ProcessGroup" for any group passed explicitly,
        the world's included)."""
        if self.ep_group is not None:
            memo[id(self.ep_group)] = self.ep_group  # deepcopy takes what memo holds as the copy: the group itself
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        # what deepcopy does without this method (MoE.__getstate__, then nn.Module.__setstate__), on MoE's state:
        # this class's __getstate__ refuses non-default groups, for pickling only
        twin.__setstate__(copy.deepcopy(MoE.__getstate__(self), memo))
        return twin

    def __getstate__(self) -> dict:
        """For pickling: the default group (``None``, or the world's given explicitly) pickles as ``None``;
        another group cannot be pickled (TypeError; DDP refuses it alike)."""
        state = super().__getstate__()
        group = state["ep_group"]
        if group is not None:
            if not dist.is_initialized() or group is not dist.group.WORLD:
                raise TypeError("an ExpertParallelMoE built with a process group other than the default one cannot "
                                "be pickled (a group belongs to its processes): save its state_dict() and load it "
                                "with load_state_dict (or a full MoE's with load_full_state_dict) into a layer built "
                                "in the loading process; copy.deepcopy shares the group")
            state["ep_group"] = None
        return state

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """:meth:`MoE.reset_parameters <sonicmoe.MoE.reset_parameters>` (e.g. after building on ``device="meta"``
        and ``.to_empty()``), then this rank's experts drawn again from the stream of its own, as ``__init__`` draws
        them: ranks seeded alike get the same router and different experts."""
        super().reset_parameters()
        self._reset_local_experts()

    def _reset_local_experts(self) -> None:
        # every rank built its experts from the same random stream (the ranks are usually seeded alike, so that the
        # replicated parameters agree): draw them again from a stream of this rank's own, forked off the current
        # one, so that experts of different ranks start different (the global stream moves on by one draw, the
        # same on every rank)
        w, rank = self.experts.gate_up_proj, self.ep_rank
        if w.device.type != "meta":
            seed = int(torch.randint(0, 2 ** 62, ()))
            with torch.random.fork_rng(devices=[w.device] if w.is_cuda else [], device_type=w.device.type):
                # the generator the experts draw from, only: torch.manual_seed would reseed every GPU's, and the
                # fork restores this one's alone
                if w.is_cuda:
                    with torch.cuda.device(w.device):
                        torch.cuda.manual_seed(seed + rank)
                else:
                    torch.random.default_generator.manual_seed(seed + rank)
                self.experts.reset_parameters()

    @classmethod
    def from_moe(cls, moe: MoE, group=None) -> ExpertParallelMoE:
        """The layer with ``moe``'s options, router and this rank's slice of its experts (on its device and dtype,
        in its training or eval mode, each parameter frozen where ``moe``'s is; the random stream is left as it was).
        Every rank of ``group`` must hold the same ``moe``.

        Raises:
            ValueError: E not a multiple of P.
        """
        c = moe.config
        head = ("hidden_size", "intermediate_size", "num_experts", "top_k")
        options = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name not in head}
        w = moe.gate.weight
        layer = cls(*(getattr(c, f) for f in head), group=group, device="meta", dtype=w.dtype, **options)
        layer = layer.to_empty(device=w.device)
        source = dict(moe.named_parameters())
        source.update(moe.named_buffers())
        for name, t in itertools.chain(layer.named_parameters(), layer.named_buffers()):
            if t.dtype != source[name].dtype:  # each in its source's dtype (a float32 router beside bf16 experts)
                t.data = t.data.to(source[name].dtype)
        layer.load_full_state_dict(moe.state_dict())
        for p, q in zip(moe.parameters(), layer.parameters()):  # frozen stays frozen
            q.requires_grad_(p.requires_grad)
        return layer.train(moe.training)  # an eval-mode source routes with plain top-k: so does its shard

    def _num_local_experts(self) -> int:
        return self.config.num_experts // self.ep_size

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, experts [{self.expert_range.start}, {self.expert_range.stop}) of rank " \
               f"{self.ep_rank}/{self.ep_size}"

    @property
    def expert_range(self) -> range:
        """The ids of the experts this rank holds: [rank·E_loc, (rank+1)·E_loc)."""
        e_loc = self._num_local_experts()
        return range(self.ep_rank * e_loc, (self.ep_rank + 1) * e_loc)

    def load_full_state_dict(self, state: dict) -> None:
        """Load a :class:`~sonicmoe.MoE` state dict with all E experts, keeping this rank's slice of theirs.

        Everything is checked before anything is copied: on an error the layer is unchanged (``load_state_dict``
        copies entry by entry and raises at the end, so a router of the wrong shape left the experts loaded). Each
        entry is cast to its parameter's (or buffer's) dtype and device, as ``load_state_dict`` casts it.

        Raises:
            KeyError: entries the layer needs are missing (all of them named).
            ValueError: entries the layer has no place for (named); an ``experts.*`` entry without E rows (a shard's
                state dict, say), naming it; an entry of the wrong shape (naming it, the expected and the got
                shape), not a dense tensor with data (a meta tensor, say), or not floating-point of 16 bits or more
                where the layer's is floating-point (integer or float8 codes, complex values).
        """
        r, e = self.expert_range, self.config.num_experts
        own = self.state_dict(keep_vars=True)  # this layer's parameters and persistent buffers, by name
        missing = [name for name in own if name not in state]
        if missing:
            raise KeyError(f"missing {', '.join(missing)} (a full MoE's state dict has every entry of the layer)")
        unexpected = [name for name in state if name not in own]
        if unexpected:
            raise ValueError(f"the state dict has entries the layer has no place for: {', '.join(unexpected)}")
        values = {}
        for name, t in own.items():  # every check (then every cast) before the first copy
            v, want = state[name], tuple(t.shape)
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"{name} must be a tensor, got {type(v).__name__}")
            if name.startswith("experts."):
                if v.dim() < 1 or v.shape[0] != e:
                    raise ValueError(f"{name} must hold all E={e} experts (a full MoE's state dict), got "
                                     f"{tuple(v.shape)}")
                want = (e, *want[1:])  # the full entry's; this rank keeps rows [r.start, r.stop)
            if tuple(v.shape) != want:
                raise ValueError(f"{name} must have shape {want}, got {tuple(v.shape)}")
            if v.layout != torch.strided or v.device.type == "meta":
                raise ValueError(f"{name} must be a dense tensor with data, got layout {v.layout} on {v.device}")
            if t.dtype.is_floating_point and not loadable_float(v.dtype):
                raise ValueError(f"{name} must be a floating-point tensor of 16 bits or more (the layer's is "
                                 f"{t.dtype}), got {v.dtype}")
            values[name] = v[r.start:r.stop] if name.startswith("experts.") else v
        # the casts too (a device out of memory, say) before the first copy
        values = {name: v.to(device=own[name].device, dtype=own[name].dtype) for name, v in values.items()}
        self.load_state_dict(values)

    def _run_experts(self, x2: torch.Tensor, routing: Routing, pair_scores: torch.Tensor, backend: str):
        c, ex = self.config, self.experts
        return expert_parallel_experts(x2, ex.gate_up_proj, ex.down_proj, routing, pair_scores, ex.gate_up_proj_bias,
                                       ex.down_proj_bias, group=self.ep_group, gate_up_layout=c.gate_up_layout,
                                       backend=backend, activation=c.activation)


def expert_parallel_groups(ep_size: int):
    """The process groups of expert parallelism inside data parallelism, from the world's W ranks: W/ep_size
    expert-parallel groups of ``ep_size`` consecutive ranks (rank w in group w // ep_size: on one node, where the
    all-to-all is fast, when ep_size divides the GPUs per node), and ep_size expert-data-parallel groups of the
    ranks holding the same experts (w, w + ep_size, w + 2·ep_size, ...).

    Every rank must call it, in the same order as its other collectives (it creates every group).

    Returns:
        (ep_group, expert_dp_group): this rank's two groups; pass ``group=ep_group`` to
        :class:`ExpertParallelMoE` and ``expert_dp_group=expert_dp_group`` to :func:`expert_parallel_ddp`.

    Raises:
        RuntimeError: torch.distributed not initialised.
        ValueError: ``ep_size`` not a positive divisor of W (an integer: numpy's taken, a bool or float not).
    """
    world, _ = _group_size_rank(None)
    if isinstance(ep_size, numbers.Integral) and not isinstance(ep_size, bool):
        ep_size = int(ep_size)  # numpy integers, as ExpertParallelMoE takes num_experts
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size must be a positive divisor of the world size W={world}, got {ep_size!r}")
    ep_group, _ = dist.new_subgroups_by_enumeration(
        [list(range(i, i + ep_size)) for i in range(0, world, ep_size)])
    dp_group, _ = dist.new_subgroups_by_enumeration([list(range(j, world, ep_size)) for j in range(ep_size)])
    return ep_group, dp_group


def expert_parallel_ddp(model: torch.nn.Module, *, expert_dp_group=None,
                        **ddp_kwargs) -> torch.nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(model, **ddp_kwargs)`` for a model with :class:`ExpertParallelMoE` layers. DDP
    averages the replicated parameters (router, attention, ...) over its W ranks and leaves the expert weights out;
    hooks scale those, whose gradients the all-to-all already summed over the losses of their expert-parallel
    group's P ranks. Each parameter then gets the gradient of the mean of the W ranks' losses, as with plain data
    parallelism.

    Two layouts:

    - the expert-parallel group is DDP's (W = P): the hook divides the expert gradients by P;
    - expert parallelism inside data parallelism (W = P·D, :func:`expert_parallel_groups`): ``expert_dp_group``
      is this rank's group of the D ranks holding the same experts; the hook sums the expert gradients over it
      (an all-reduce) and divides by W.

    Call it once per model (each call adds the hooks again), after freezing what stays frozen: an expert weight
    frozen here gets no hook, so unfreezing it later would leave its gradient unscaled (DDP, too, fixes which
    parameters train when it is built).

    Raises:
        RuntimeError: torch.distributed not initialised.
        ValueError: an :class:`ExpertParallelMoE` whose group is not DDP's while ``expert_dp_group`` is not given,
            or whose group's size times ``expert_dp_group``'s is not DDP's W.
    """
    from torch.nn.parallel import DistributedDataParallel

    _group_size_rank(None)  # RuntimeError, as its siblings, where torch.distributed is not initialised
    world_group = dist.group.WORLD
    ddp_group = ddp_kwargs.get("process_group") or world_group
    ddp_world = dist.get_world_size(ddp_group)
    ignored = []
    for prefix, module in model.named_modules():
        if not isinstance(module, ExpertParallelMoE):
            continue
        name_ = prefix or "model"
        if (module.ep_group or world_group) is ddp_group:
            hook = (lambda g, scale=1.0 / module.ep_size: g * scale)
        elif expert_dp_group is None:
            raise ValueError(f"{name_}: its expert-parallel group is not the process group DDP reduces over "
                             "(process_group=...): pass expert_dp_group= (expert_parallel_groups) for expert "
                             "parallelism inside data parallelism")
        elif module.ep_size * dist.get_world_size(expert_dp_group) != ddp_world:
            raise ValueError(f"{name_}: its expert-parallel group's size P={module.ep_size} times expert_dp_group's "
                             f"D={dist.get_world_size(expert_dp_group)} is not DDP's world size W={ddp_world}")
        else:
            hook = functools.partial(_sum_over_replicas, group=expert_dp_group, scale=1.0 / ddp_world)
        for name, p in module.experts.named_parameters():
            ignored.append(f"{prefix}.experts.{name}" if prefix else f"experts.{name}")
            if p.requires_grad:  # a frozen expert weight (router-only fine-tuning) gets no gradient and no hook
                p.register_hook(hook)
    # added to what the model already keeps out of DDP (torch's own helper replaces the list)
    ignored = [*getattr(model, "_ddp_params_and_buffers_to_ignore", ()), *ignored]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return DistributedDataParallel(model, **ddp_kwargs)


def _sum_over_replicas(grad: torch.Tensor, group, scale: float) -> torch.Tensor:
    """An expert weight's gradient summed over the ranks holding the same experts (an all-reduce), scaled."""
    grad = grad.contiguous().clone()
    dist.all_reduce(grad, group=group)
    return grad.mul_(scale)
