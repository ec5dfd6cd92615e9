"""Token rounding's padding kernel (sonicmoe.ops.pad_select) against its torch twin and a Python oracle.

On CPU the kernel runs through Triton's interpreter (integer keys only: no tl.dot involved).
"""

from __future__ import annotations

import pytest
import torch

from sonicmoe.config import ROUNDING_SUBROUTINES
from sonicmoe.ops.pad_select import CHOSEN_KEY, candidate_keys, pad_select, pad_select_ref
from sonicmoe.routing import RouterOutput, router_topk
from sonicmoe.token_rounding import token_rounding, token_rounding_ref

pytestmark = [pytest.mark.interpreter, pytest.mark.filterwarnings("ignore:token rounding with")]


def oracle(keys: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """(T, E) bool: per expert, the need[e] non-chosen tokens of largest key, lower token first on ties."""
    e, t = keys.shape
    out = torch.zeros(t, e, dtype=torch.bool)
    for x in range(e):
        cand = [tok for tok in range(t) if keys[x, tok] != CHOSEN_KEY]
        cand.sort(key=lambda tok: (-int(keys[x, tok]), tok))
        for tok in cand[: int(need[x])]:
            out[tok, x] = True
    return out


def random_keys(e, t, seed, distinct_values):
    """(E, T) int32 keys drawn from ``distinct_values`` values (few values: many ties), ~25% chosen."""
    g = torch.Generator().manual_seed(seed)
    vals = torch.randint(-(2**31) + 1, 2**31, (distinct_values,), generator=g, dtype=torch.int64)
    keys = vals[torch.randint(0, distinct_values, (e, t), generator=g)].to(torch.int32)
    keys[torch.rand(e, t, generator=g) < 0.25] = CHOSEN_KEY
    n_cand = (keys != CHOSEN_KEY).sum(1)
    need = (torch.rand(e, generator=g) * (n_cand + 1).float()).long().clamp(max=n_cand)
    need[0] = 0
    need[-1] = n_cand[-1]  # every candidate of the last expert
    return keys, need


@pytest.mark.parametrize("e,t,values,seed", [(1, 1, 1, 0), (3, 7, 2, 1), (5, 40, 3, 2), (4, 1500, 7, 3),
                                             (6, 2049, 1000, 4), (2, 300, 2**20, 5)])
def test_kernel_equals_twin_and_oracle(device, e, t, values, seed):
    keys, need = random_keys(e, t, seed, values)
    expect = oracle(keys, need)
    # a routed mask with prior marks (the kept chosen pairs): the selection only ever adds marks
    prior = (keys.t() == CHOSEN_KEY).contiguous()
    prior &= torch.rand(t, e, generator=torch.Generator().manual_seed(seed)) < 0.5
    for fn in (pad_select, pad_select_ref):
        routed = prior.clone().to(device)
        k_dev, need_dev = keys.to(device), need.to(device)
        fn(k_dev, need_dev, routed, int(need.max()) if need.numel() else 0)
        assert torch.equal(routed.cpu(), prior | expect), fn.__name__
        assert torch.equal(k_dev.cpu(), keys) and torch.equal(need_dev.cpu(), need)  # inputs untouched


def test_extreme_keys(device):
    # the largest and smallest candidate keys, and every key equal
    t = 9
    keys = torch.tensor([[2**31 - 1, -(2**31) + 1, 0, -1, 2**31 - 1, CHOSEN_KEY, -(2**31) + 1, 5, 5],
                         [7] * t], dtype=torch.int32)
    for need in ([2, 4], [8, 9], [1, 0]):
        need = torch.tensor(need)
        routed = torch.zeros(t, 2, dtype=torch.bool, device=device)
        pad_select(keys.to(device), need.to(device), routed, 9)
        assert torch.equal(routed.cpu(), oracle(keys, need)), need


def test_candidate_keys_order():
    probs = torch.tensor([[0.5, 0.25, float("nan"), 0.25], [0.0, 1.0, 0.125, -0.0]])
    ids = torch.tensor([[0], [1]])
    key = candidate_keys(probs, ids)
    assert key.shape == (4, 2) and key.dtype == torch.int32
    assert key[0, 0] == CHOSEN_KEY and key[1, 1] == CHOSEN_KEY
    # order of the probabilities: NaN lowest (as -inf), -0.0 just below +0.0
    assert key[2, 0] < key[3, 1] < key[0, 1] < key[2, 1] < key[1, 0] == key[3, 0]
    assert (key[key != CHOSEN_KEY] > CHOSEN_KEY).all()


def test_pad_select_rejects_bad_arguments():
    keys = torch.zeros(3, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="keys"):
        pad_select(keys.long(), torch.zeros(3), torch.zeros(5, 3, dtype=torch.bool), 1)
    with pytest.raises(ValueError, match="routed"):
        pad_select(keys, torch.zeros(3), torch.zeros(3, 5, dtype=torch.bool), 1)
    with pytest.raises(ValueError, match="need"):
        pad_select(keys, torch.zeros(4), torch.zeros(5, 3, dtype=torch.bool), 1)


@pytest.mark.parametrize("subroutine", ROUNDING_SUBROUTINES)
@pytest.mark.parametrize("t,e,k,m,seed", [(300, 12, 3, 16, 0), (77, 5, 5, 8, 1), (1, 4, 2, 4, 2), (130, 9, 1, 32, 3)])
def test_token_rounding_kernel_path_equals_torch_path_and_ref(subroutine, t, e, k, m, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 8, generator=g)
    x[t // 2:] = x[: t - t // 2].clone()  # repeated tokens: exactly tied probabilities
    router = router_topk(x, torch.randn(e, 8, generator=g), k)
    outs = [fn(router, m_tile=m, subroutine=subroutine, generator=torch.Generator().manual_seed(seed), **kw)
            for fn, kw in ((token_rounding, {"use_kernel": True}), (token_rounding, {"use_kernel": False}),
                           (token_rounding_ref, {}))]
    for other in outs[1:]:
        for name in ("pair_token", "pair_expert", "pair_added", "counts", "topk_counts", "padded"):
            assert torch.equal(getattr(outs[0], name), getattr(other, name)), name
        torch.testing.assert_close(outs[0].pair_scores, other.pair_scores, rtol=1e-6, atol=1e-7)
    key = outs[0].pair_token.long() * e + outs[0].pair_expert.long()
    assert bool((torch.diff(key) > 0).all()), "pairs are token-major and unique"


def test_token_rounding_nan_probabilities_rank_last():
    # expert 0 is padded from 1 chosen token to 4: the NaN-probability token is added last
    t = 6
    logits = torch.zeros(t, 2)
    logits[1:, 1] = 1.0  # token 0 chooses expert 0, the others expert 1
    probs = logits.softmax(-1)
    probs[1, 0] = float("nan")
    probs[2, 0] = 0.9
    ids = logits.topk(1, dim=-1).indices
    router = RouterOutput(logits, probs, ids, torch.ones(t, 1))
    for use in (True, False):
        out = token_rounding(router, m_tile=4, subroutine="up", use_kernel=use)
        added = out.pair_token[out.pair_added & (out.pair_expert == 0)].tolist()
        assert added == [2, 3, 4], use  # 0.9, then two of the tied rest by index; NaN (token 1) last


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k", [(16384, 512, 8), (4099, 64, 2)])
def test_gpu_kernel_path_equals_torch_path(t, e, k):
    """At benchmark sizes on the GPU: the kernel's pairs equal the torch twin's, for every subroutine,
    with repeated tokens (exact ties); and two runs give the same pairs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, 64, device="cuda", generator=g)
    x[t // 2:] = x[: t - t // 2].clone()
    router = router_topk(x, torch.randn(e, 64, device="cuda", generator=g), k)
    for s in ROUNDING_SUBROUTINES:
        outs = [token_rounding(router, m_tile=128, subroutine=s, use_kernel=use,
                               generator=torch.Generator(device="cuda").manual_seed(1)) for use in (True, False, True)]
        for other in outs[1:]:
            for name in ("pair_token", "pair_expert", "pair_added", "counts"):
                assert torch.equal(getattr(outs[0], name), getattr(other, name)), (s, name)
            assert torch.equal(outs[0].pair_scores, other.pair_scores), s
