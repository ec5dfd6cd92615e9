"""Token rounding's padding step: each expert's best non-chosen tokens by router probability (SPEC §5).

An expert e that token rounding pads up needs ``need[e]`` (< M_tile) tokens that top-k did not route to
it: the ones of highest router probability ``probs[t, e]``, ties broken toward the lower token index.
Both functions here take the candidates as an order-preserving int32 *key* per (expert, token) — see
:func:`candidate_keys` — and set ``routed[t, e] = True`` for the selected tokens; nothing else of
``routed`` changes.

Kernel (one program per expert, no sort, no atomics, no host sync): a binary search over the 2^32 key
values finds τ, the need[e]-th largest key of the expert's row (32 counting passes over the row, which
stays in L2); the tokens with key > τ are taken, and of those with key == τ the lowest-indexed
``need[e] − #{key > τ}`` (a running prefix count). The work is 33 passes over T int32 keys per padded
expert, ~2 MB of L2 reads per expert at T = 16384; its output depends only on the keys.

:func:`pad_select_ref` is the torch twin (one ``torch.topk`` over an exact int64 key per expert): the
path on CPU and the oracle of the kernel's tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_device, interpreting

CHOSEN_KEY = -(2**31)  # the key of a pair top-k chose: below every probability's key
_KEY_BLOCK = 1024


def candidate_keys(probs: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """(E, T) int32 keys of the padding candidates, in the order the selection ranks them.

    The key of (e, t) is the float32 probability ``probs[t, e]`` read as an order-preserving int32
    (its bits, with the magnitude bits of negative values flipped), so keys compare exactly as the
    probabilities do (−0.0 just below +0.0); NaN counts as −inf; pairs top-k chose get
    :data:`CHOSEN_KEY`, below every other key. probs: (T, E) any float dtype; topk_ids: (T, K).
    Memory: one transient (E, T) float32 / int32 pair (4·T·E bytes each).
    """
    t, e = probs.shape
    p = torch.nan_to_num(probs.detach().float(), nan=float("-inf"))
    bits = p.t().contiguous().view(torch.int32)
    key = torch.bitwise_xor(bits, torch.bitwise_and(torch.bitwise_right_shift(bits, 31), 0x7FFFFFFF))
    tokens = torch.arange(t, device=probs.device)
    key[topk_ids.long(), tokens[:, None]] = CHOSEN_KEY
    return key


@triton.jit(do_not_specialize=["T"])
def _count_at_least(row_ptr, threshold, T, BLOCK_T: tl.constexpr):
    """#{t : key[t] >= threshold} over the row of T keys (int32)."""
    cnt = tl.zeros((), dtype=tl.int32)
    for start in range(0, T, BLOCK_T):
        offs = start + tl.arange(0, BLOCK_T)
        k = tl.load(row_ptr + offs, mask=offs < T, other=-(2**31))
        cnt += tl.sum((k.to(tl.int64) >= threshold).to(tl.int32), axis=0)
    return cnt


@triton.jit(do_not_specialize=["T"])
def _pad_select_kernel(key_ptr, need_ptr, routed_ptr, T, E, BLOCK_T: tl.constexpr):
    e = tl.program_id(0)
    need = tl.load(need_ptr + e)
    if need > 0:
        row_ptr = key_ptr + e.to(tl.int64) * T
        # invariant: count(key >= lo) >= need > count(key >= hi); every candidate's key is >= -2^31 + 1
        lo = tl.full((), -(2**31) + 1, tl.int64)
        hi = tl.full((), 2**31, tl.int64)
        for _ in range(32):  # hi - lo < 2^32 halves to 1
            mid = (lo + hi) >> 1
            enough = _count_at_least(row_ptr, mid, T, BLOCK_T) >= need
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
        # τ = lo: every key > τ is taken, and the lowest-indexed keys == τ fill the rest
        ties = need - _count_at_least(row_ptr, lo + 1, T, BLOCK_T)
        seen = tl.zeros((), dtype=tl.int32)
        for start in range(0, T, BLOCK_T):
            offs = start + tl.arange(0, BLOCK_T)
            k = tl.load(row_ptr + offs, mask=offs < T, other=-(2**31)).to(tl.int64)
            eq = (k == lo).to(tl.int32)
            take = (k > lo) | ((eq > 0) & (tl.cumsum(eq, axis=0) + seen <= ties))
            tl.store(routed_ptr + offs.to(tl.int64) * E + e, tl.full((BLOCK_T,), 1, tl.int8), mask=take)
            seen += tl.sum(eq, axis=0)


def pad_select(keys: torch.Tensor, need: torch.Tensor, routed: torch.Tensor, max_need: int) -> None:
    """Mark each expert's ``need[e]`` best candidates in ``routed`` (in place), on the Triton kernel.

    Args:
        keys: (E, T) int32 from :func:`candidate_keys` (contiguous).
        need: (E,) integer, tokens to add per expert, each in [0, min(max_need, #candidates of e)].
        routed: (T, E) bool, contiguous; ``routed[t, e]`` is set True for every selected token.
        max_need: an upper bound of ``need`` known on the host (M_tile − 1 for token rounding); the
            kernel does not need it, the torch twin sizes its top-k with it (no read-back).

    Raises:
        ValueError: shapes, dtypes or devices that do not match the above.
    """
    e, t = keys.shape
    if keys.dtype != torch.int32 or not keys.is_contiguous():
        raise ValueError(f"keys must be a contiguous (E, T) int32 tensor, got {keys.dtype} {tuple(keys.shape)}")
    if routed.shape != (t, e) or routed.dtype != torch.bool or not routed.is_contiguous():
        raise ValueError(f"routed must be a contiguous (T={t}, E={e}) bool tensor, got {routed.dtype} "
                         f"{tuple(routed.shape)}")
    if need.shape != (e,):
        raise ValueError(f"need must have shape (E={e},), got {tuple(need.shape)}")
    for name, x in (("keys", keys), ("need", need), ("routed", routed)):
        check_device(name, x)
    if e == 0 or t == 0:
        return
    _pad_select_kernel[(e,)](keys, need.to(torch.int32).contiguous(), routed.view(torch.int8), t, e,
                             BLOCK_T=min(_KEY_BLOCK, triton.next_power_of_2(t)), num_warps=4)


def pad_select_ref(keys: torch.Tensor, need: torch.Tensor, routed: torch.Tensor, max_need: int) -> None:
    """Torch twin of :func:`pad_select` (same arguments and effect): one ``torch.topk`` of max_need per
    expert over the exact int64 key (probability key, then lower token index), the first need[e] taken.
    Memory: a transient (E, T) int64 key."""
    e, t = keys.shape
    n_add = min(max_need, t)
    if n_add <= 0 or e == 0:
        return
    tokens = torch.arange(t, device=keys.device, dtype=torch.int64)
    pkey = (keys.long() - CHOSEN_KEY).mul_(2**31).add_((2**31 - 1) - tokens)  # unique per (e, t), chosen lowest
    best = torch.topk(pkey, n_add, dim=1).indices  # (E, n_add) tokens, best first
    del pkey
    take = torch.arange(best.shape[1], device=keys.device)[None, :] < need.long()[:, None]
    experts = torch.arange(e, device=keys.device)[:, None].expand_as(best)
    routed[best, experts] = routed[best, experts] | take


def use_pad_kernel(device: torch.device, use_kernel: bool | None) -> bool:
    """Whether token rounding runs :func:`pad_select` (the kernel): on CUDA unless ``use_kernel`` is
    False; on CPU only when ``use_kernel`` is True and the Triton interpreter is on (tests)."""
    if use_kernel is False:
        return False
    if device.type == "cuda":
        return True
    return use_kernel is True and interpreting()
