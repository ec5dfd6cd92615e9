"""Expert load order: the experts sorted by their row counts T_e, busiest first (the schedule of the varlen-K
weight gradients, SPEC §4 kernels 2 and 4).

A varlen-K tile's work is proportional to its expert's rows. Under a trained router's load the programs that draw
the busiest experts' tiles last finish well after the others: in session 81 the busiest expert of a step took 3.2×
the mean (``sonicmoe train``'s ``step_max_over_mean``), and on that load the 7B layer's backward took 5% longer on
an H100 than on the random router's (``benchmarks/results/2026-12-05_nvidia-h100_session81/``).

In load order (``SONICMOE_WGRAD_ORDER=load``; not the default, see :func:`wgrad_order_by_load` for the A/B) the
weight-gradient kernels take the busiest expert's tiles first (longest processing time first), so each wave of
programs runs tiles of about the same length and the last wave holds the shortest ones. The persistent kernels
(the Gluon one, and the Triton one's step loop) also deal the waves to their programs alternately forwards and
backwards
(:func:`sonicmoe.ops.weight_grad_ws.program_tiles`): the program that drew a wave's longest tile draws the next
wave's shortest. A model of the schedule (``scripts/wgrad_schedule_model.py``) puts this within 1% of an even
split on that load at 7B, where expert order took 14% (dW1) and 22% (dW2) longer. Every tile is still computed
whole by one program with the same reduction order: the gradients are bitwise those of expert order.

The order is a strict total order (more rows first; ties by expert index), computed on the device from
``expert_offsets`` without a host sync: each expert's rank is the number of experts ahead of it, and
``order[rank[e]] = e`` (distinct positions, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..env import env_choice
from ..routing import Routing
from .common import cdiv, check_device, new_output
from .fast_launch import launch_kernel

BLOCK_E = 32  # experts ranked per program
BLOCK_C = 256  # experts compared against per step


@triton.jit
def _load_order_kernel(offsets_ptr, out_ptr, E, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
    """Ranks of experts [pid·BLOCK_E, (pid+1)·BLOCK_E): out[E + e] = rank of e, out[rank of e] = e."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < E
    ce = tl.load(offsets_ptr + e + 1, mask=emask, other=0) - tl.load(offsets_ptr + e, mask=emask, other=0)
    rank = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, E, BLOCK_C):
        j = c0 + tl.arange(0, BLOCK_C)
        jmask = j < E
        cj = tl.load(offsets_ptr + j + 1, mask=jmask, other=0) - tl.load(offsets_ptr + j, mask=jmask, other=0)
        ahead = (cj[None, :] > ce[:, None]) | ((cj[None, :] == ce[:, None]) & (j[None, :] < e[:, None]))
        rank += tl.sum((ahead & jmask[None, :]).to(tl.int32), axis=1)
    tl.store(out_ptr + rank, e, mask=emask)
    tl.store(out_ptr + E + e, rank, mask=emask)


def expert_load_order(expert_offsets: torch.Tensor) -> torch.Tensor:
    """The experts by descending row count, and each expert's place in that order.

    Args:
        expert_offsets: (E+1,) int32, the exclusive prefix sum of the per-expert row counts T_e
            (:attr:`sonicmoe.Routing.expert_offsets`), on a CUDA device (or the CPU under the interpreter).
    Returns:
        (2·E,) int32: ``[:E]`` the experts, busiest first (ties: lower index first); ``[E:]`` the rank of each
        expert in that order (the inverse permutation).
    Raises:
        ValueError: ``expert_offsets`` is not a 1-D int32 tensor of at least one element.
    """
    if expert_offsets.dim() != 1 or expert_offsets.dtype != torch.int32 or expert_offsets.numel() < 1:
        raise ValueError(f"expert_offsets must be a 1-D int32 tensor of E+1 >= 1 elements, got shape "
                         f"{tuple(expert_offsets.shape)} and dtype {expert_offsets.dtype}")
    check_device("expert_offsets", expert_offsets)
    expert_offsets = expert_offsets.contiguous()  # the kernel reads element e at offsets + e
    e = expert_offsets.numel() - 1
    out = new_output((2 * e,), device=expert_offsets.device, dtype=torch.int32)
    if e > 0:
        launch_kernel(_load_order_kernel, (cdiv(e, BLOCK_E),), expert_offsets, out, e, BLOCK_E=BLOCK_E,
                      BLOCK_C=BLOCK_C, num_warps=4)
    return out


def expert_load_order_ref(expert_offsets: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch twin of :func:`expert_load_order` (a stable descending sort of the counts)."""
    counts = (expert_offsets[1:] - expert_offsets[:-1]).long()
    order = torch.sort(counts, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return torch.cat([order, rank]).to(torch.int32)


WGRAD_ORDERS = ("expert", "load")


def wgrad_order_by_load() -> bool:
    """Whether the weight gradients take their experts busiest first (``SONICMOE_WGRAD_ORDER``: ``expert``, index
    order, the default, or ``load``; read at each call). The gradients are the same bits either way.

    Timed on an H100 in session 83 (``gpu_check.sh wgorder``: fresh processes, two alternating rounds,
    ``benchmarks/results/2026-12-05_nvidia-h100_session83/wgorder/``), the backward in ms:

    * a trained model's per-step load (busiest expert 3.2× the mean): 7B 2.258 / 2.251 in expert order against
      2.149 / 2.133 in load order (5% less: as fast as the random router's load); (32768, 4096, 1024, 128, 8)
      23.83 / 24.48 against 23.47 / 23.85 (1.5-2.6% less);
    * the random router's even load: 7B 2.153 / 2.149 against 2.173 / 2.172 (1% more); the large shape 23.10 /
      23.00 against 23.27 / 23.08 (0.3-0.7% more).

    Index order stays the default for now: the even load, on which the benchmark shapes are measured, loses about
    0.4% of the layer's fwd+bwd (where that comes from, the order's launch, the serpentine dealing or the order
    itself, is ``gpu_check.sh wgprof``'s question). Training under an uneven load gains with ``load``."""
    return env_choice("SONICMOE_WGRAD_ORDER", "expert", WGRAD_ORDERS) == "load"


def routing_load_order(routing: Routing) -> torch.Tensor:
    """:func:`expert_load_order` of ``routing``'s ``expert_offsets``, the weight gradients' tile order under
    ``SONICMOE_WGRAD_ORDER=load``, built once per Routing object and shared by dW1 and dW2 (the cache holds while
    ``expert_offsets`` is the same tensor, unmodified: its version counter). No host sync.
    """
    order = routing.cached("load_order")
    if order is None:
        order = expert_load_order(routing.expert_offsets)
        routing.cache("load_order", order)
    return order
