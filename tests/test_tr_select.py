"""Token rounding's selection kernels (sonicmoe.ops.tr_select) against their torch twins and a Python oracle.

On CPU the kernels run through Triton's interpreter (keys are integers: no tl.dot involved).
"""

from __future__ import annotations

import pytest
import torch

from sonicmoe.config import ROUNDING_SUBROUTINES
from sonicmoe.ops.tr_select import (
    NO_KEY,
    RESIDENT_MAX_T,
    candidate_keys,
    candidate_keys_ref,
    select_routed,
    select_routed_ref,
)
from sonicmoe.routing import RouterOutput, router_topk
from sonicmoe.token_rounding import token_rounding, token_rounding_ref

pytestmark = [pytest.mark.interpreter, pytest.mark.filterwarnings("ignore:token rounding with")]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every kernel output poisoned (NaN; int32: int-min) before its kernel writes it: an element no program writes
    fails the comparison with the twin."""
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")


def best(key_row: list[int], n: int) -> set[int]:
    """The n largest real keys of a row, lower index first on ties (the oracle)."""
    cand = sorted((t for t, v in enumerate(key_row) if v != NO_KEY), key=lambda t: (-key_row[t], t))
    return set(cand[:n])


def oracle(prob_key: torch.Tensor, score_key: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    e, t = prob_key.shape
    out = torch.zeros(t, e, dtype=torch.bool)
    for x in range(e):
        s_row, p_row = score_key[x].tolist(), prob_key[x].tolist()
        f = sum(v != NO_KEY for v in s_row)
        kx = int(keep[x])
        toks = best(s_row, kx) if kx < f else best(s_row, f) | best(p_row, kx - f)
        for tok in toks:
            out[tok, x] = True
    return out


def random_keys(e, t, seed, distinct_values):
    """(prob_key, score_key, keep): keys from ``distinct_values`` values (few: many ties), ~30% chosen,
    keep below, at and above f (up to every candidate)."""
    g = torch.Generator().manual_seed(seed)
    vals = torch.randint(NO_KEY + 1, 2**31, (distinct_values,), generator=g, dtype=torch.int64)
    draw = lambda: vals[torch.randint(0, distinct_values, (e, t), generator=g)].to(torch.int32)  # noqa: E731
    chosen = torch.rand(e, t, generator=g) < 0.3
    prob_key = torch.where(chosen, NO_KEY, draw()).to(torch.int32)
    score_key = torch.where(chosen, draw(), NO_KEY).to(torch.int32)
    keep = (torch.rand(e, generator=g) * (t + 1)).long().clamp(max=t)
    f = chosen.sum(1)
    keep[0] = f[0]
    if e > 1:
        keep[1] = t  # every token
    if e > 2:
        keep[2] = 0
    return prob_key, score_key, f, keep


@pytest.mark.parametrize("e,t,values,seed", [(1, 1, 1, 0), (3, 7, 2, 1), (5, 40, 3, 2), (4, 1500, 7, 3),
                                             (6, 2049, 1000, 4), (2, 300, 2**20, 5)])
def test_select_equals_twin_and_oracle(device, e, t, values, seed):
    prob_key, score_key, f, keep = random_keys(e, t, seed, values)
    expect = oracle(prob_key, score_key, keep)
    args = [x.to(device) for x in (prob_key, score_key, f, keep)]
    for fn in (select_routed, select_routed_ref):
        assert torch.equal(fn(*args).cpu(), expect), fn.__name__
    for fanout in (2, 8):  # bisection, and a fanout whose passes do not split the 32 bits evenly
        for resident in (True, False):  # the row held in registers, or streamed once per counting pass
            got = select_routed(*args, fanout=fanout, resident=resident)
            assert torch.equal(got.cpu(), expect), (fanout, resident)
    # rounded-down experts searched over the list of their chosen keys (every one, none, or those with f <= 8)
    for compact in (None, 0, 8):
        got = select_routed(*args, resident=True, compact=compact, rank=True)
        assert torch.equal(got.cpu() != 0, expect), compact
    assert all(torch.equal(a.cpu(), b) for a, b in zip(args, (prob_key, score_key, f, keep)))  # inputs untouched


@pytest.mark.parametrize("subroutine", ["up", "down", "nearest"])
def test_select_on_router_keys(device, subroutine):
    """Keys of a real router (distinct float probabilities and scores, so the register-held search mostly ends at a
    threshold with exactly n keys above it) and a real rounding decision: both searches equal the torch twin."""
    from sonicmoe.token_rounding import _round_counts

    g = torch.Generator().manual_seed(7)
    t, e, k, m = 3000, 16, 2, 128
    router = router_topk(torch.randn(t, 32, generator=g), torch.randn(e, 32, generator=g), k)
    prob_key, score_key, f = candidate_keys_ref(router.probs, router.topk_ids, router.topk_scores.detach())
    keep, _ = _round_counts(f, m, t, subroutine, None)
    args = [x.to(device) for x in (prob_key, score_key, f, keep)]
    expect = select_routed_ref(*args, rank=True).cpu()
    assert bool((keep != f).all()), "every expert searched"
    for resident in (True, False):
        assert torch.equal(select_routed(*args, rank=True, resident=resident).cpu(), expect), resident
    down = keep < f
    assert bool(down.any()) == (subroutine != "up")
    for compact in (0, 256, 512):  # the listed search for none, some and all of the rounded-down experts
        assert torch.equal(select_routed(*args, rank=True, compact=compact).cpu(), expect), compact


def test_extreme_keys(device):
    t = 9
    prob_key = torch.tensor([[2**31 - 1, NO_KEY + 1, 0, -1, 2**31 - 1, NO_KEY, NO_KEY + 1, 5, 5],
                             [7] * t], dtype=torch.int32)
    score_key = torch.full((2, t), NO_KEY, dtype=torch.int32)
    score_key[0, 5] = 3
    f = torch.tensor([1, 0])
    for keep in ([3, 4], [9, 9], [0, 1], [1, 0]):
        keep = torch.tensor(keep)
        for fanout in (2, 16, 32):
            for resident in (True, False):
                got = select_routed(prob_key.to(device), score_key.to(device), f.to(device), keep.to(device),
                                    fanout=fanout, resident=resident)
                assert torch.equal(got.cpu(), oracle(prob_key, score_key, keep)), (keep, fanout, resident)


@pytest.mark.parametrize("t,e,k", [(1, 1, 1), (37, 5, 2), (300, 12, 3), (64, 200, 7), (5, 3, 3)])
def test_candidate_keys_kernel_equals_twin(device, t, e, k):
    g = torch.Generator().manual_seed(t + e)
    router = router_topk(torch.randn(t, 8, generator=g), torch.randn(e, 8, generator=g), k)
    probs = router.probs.detach().clone()
    probs[0, 0] = float("nan")
    scores = router.topk_scores.detach().clone()
    scores[t // 2, 0] = float("nan")
    if t > 2:  # ±inf keep their own keys (torch.nan_to_num's defaults would make them the largest finite floats)
        probs[t - 1, e - 1], scores[t - 1, k - 1], scores[1, 0] = float("inf"), float("inf"), float("-inf")
    args = [x.to(device) for x in (probs, router.topk_ids, scores)]
    a, b = candidate_keys(*args), candidate_keys_ref(*args)
    for x, y, name in zip(a, b, ("prob_key", "score_key", "f")):
        assert torch.equal(x.cpu(), y.cpu()), name
    assert torch.equal(a[2].cpu(), torch.bincount(router.topk_ids.reshape(-1), minlength=e))


def test_keys_order_nan_and_signed_zero():
    probs = torch.tensor([[0.5, 0.25, float("nan"), 0.25], [0.0, 1.0, 0.125, -0.0]])
    ids = torch.tensor([[0], [1]])
    prob_key, score_key, f = candidate_keys_ref(probs, ids, torch.tensor([[0.75], [-2.0]]))
    assert prob_key.shape == (4, 2) and prob_key.dtype == torch.int32
    assert prob_key[0, 0] == NO_KEY and prob_key[1, 1] == NO_KEY and f.tolist() == [1, 1, 0, 0]
    # the order of the probabilities: NaN lowest (as -inf), -0.0 equal to +0.0 (a tie, as the floats compare)
    assert prob_key[2, 0] < prob_key[3, 1] == prob_key[0, 1] < prob_key[2, 1] < prob_key[1, 0] == prob_key[3, 0]
    assert score_key[1, 1] < 0 < score_key[0, 0] and (score_key == NO_KEY).sum() == 6
    # a NaN score: the key of +inf, above every finite score (a NaN probability: below, as -inf)
    _, nan_key, _ = candidate_keys_ref(probs, ids, torch.tensor([[float("nan")], [float("inf")]]))
    assert nan_key[0, 0] == nan_key[1, 1] > score_key[0, 0]


def test_bad_arguments():
    keys = torch.zeros(3, 5, dtype=torch.int32)
    z = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="prob_key"):
        select_routed(keys.long(), keys, z, z)
    with pytest.raises(ValueError, match="score_key"):
        select_routed(keys, keys[:, :4], z, z)
    with pytest.raises(ValueError, match="keep"):
        select_routed(keys, keys, z, z[:2])
    for fanout in (1, 3, 0, True):
        with pytest.raises(ValueError, match="fanout"):
            select_routed(keys, keys, z, z, fanout=fanout)
    long_keys = torch.zeros(1, RESIDENT_MAX_T + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="resident"):
        select_routed(long_keys, long_keys, z[:1], z[:1], resident=True)
    with pytest.raises(ValueError, match="compact"):
        select_routed(keys, keys, z, z, compact=3)
    with pytest.raises(ValueError, match="topk_ids"):
        candidate_keys_ref(torch.zeros(5, 3), torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2))


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


def test_token_rounding_keeps_a_nan_score_token():
    # expert 0 rounds down from 5 chosen tokens to 4: it drops its lowest score, not the NaN token (a NaN token dropped
    # by every expert it chose would get a finite output, 0, where top-k gives NaN)
    t = 8
    logits = torch.zeros(t, 2)
    logits[5:, 1] = 1.0  # tokens 0-4 choose expert 0, 5-7 expert 1
    ids = logits.topk(1, dim=-1).indices
    scores = torch.tensor([[0.9], [0.8], [float("nan")], [0.7], [0.6], [0.5], [0.5], [0.5]])
    router = RouterOutput(logits, logits.softmax(-1), ids, scores)
    for fn, kw in ((token_rounding, {"use_kernel": True}), (token_rounding, {"use_kernel": False}),
                   (token_rounding_ref, {})):
        out = fn(router, m_tile=4, subroutine="down", warn=False, **kw)
        assert out.pair_token[out.pair_expert == 0].tolist() == [0, 1, 2, 3], (fn, kw)



def test_token_rounding_signed_zeros_tie():
    # -0.0 == +0.0: a tie, which goes to the lower token, as in the ref (the keys ranked +0.0 above -0.0 before)
    g = torch.Generator().manual_seed(11)
    t = 8
    paths = ((token_rounding, {"use_kernel": True}), (token_rounding, {"use_kernel": False}), (token_rounding_ref, {}))
    # expert 0 rounds down from 5 chosen tokens to 4: it drops one of its two zero scores, the higher token's
    chosen = torch.randperm(t, generator=g)[:5].sort().values.tolist()
    ids = torch.ones(t, 1, dtype=torch.long)
    ids[chosen] = 0
    scores = torch.rand(t, 1, generator=g) + 0.5
    scores[chosen[1], 0], scores[chosen[3], 0] = -0.0, 0.0
    logits = torch.randn(t, 2, generator=g)
    router = RouterOutput(logits, logits.softmax(-1), ids, scores)
    for fn, kw in paths:
        out = fn(router, m_tile=4, subroutine="down", warn=False, **kw)
        assert out.pair_token[out.pair_expert == 0].tolist() == [c for c in chosen if c != chosen[3]], (fn, kw)
    # expert 0 rounds up from 1 chosen token to 4: it adds the 0.9, then two zero probabilities, the lowest tokens'
    c = int(torch.randint(t, (1,), generator=g))
    ids = torch.ones(t, 1, dtype=torch.long)
    ids[c] = 0
    rest = [tok for tok in range(t) if tok != c]
    best = rest.pop(int(torch.randint(len(rest), (1,), generator=g)))
    probs = torch.rand(t, 2, generator=g)
    probs[rest[:3], 0], probs[rest[3:], 0], probs[best, 0] = -0.0, 0.0, 0.9
    router = RouterOutput(logits, probs, ids, torch.rand(t, 1, generator=g))
    for fn, kw in paths:
        out = fn(router, m_tile=4, subroutine="up", warn=False, **kw)
        assert out.pair_token[out.pair_added & (out.pair_expert == 0)].tolist() == sorted([best, *rest[:2]]), (fn, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k", [(16384, 512, 8), (4099, 64, 2)])
def test_gpu_kernel_path_equals_torch_path(t, e, k):
    """At benchmark sizes on the GPU: the kernels' pairs equal the torch twins', for every subroutine,
    with repeated tokens (exact ties), and their scores agree; two kernel runs give the same bits."""
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
            # added pairs' scores: the kernel's float32 logsumexp may differ from torch's in the last bit
            torch.testing.assert_close(outs[0].pair_scores, other.pair_scores, rtol=1e-6, atol=1e-7)
        assert torch.equal(outs[0].pair_scores, outs[2].pair_scores), s
