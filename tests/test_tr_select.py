"""Token rounding's selection kernels (sonicmoe.ops.tr_select) against their torch twins and a Python oracle.

On CPU the kernels run through Triton's interpreter (keys are integers: no tl.dot involved).
"""

from __future__ import annotations

import pytest
import torch

from sonicmoe.config import ROUNDING_SUBROUTINES
from sonicmoe.ops import tr_select
from sonicmoe.ops.common import interpreting
from sonicmoe.ops.tr_select import (
    NO_KEY,
    RESIDENT_MAX_T,
    candidate_keys,
    candidate_keys_ref,
    select_routed,
    select_routed_ref,
    use_select_kernels,
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


def test_select_in_loads_far_shorter_than_the_row(device):
    """8 keys per load (tile) against rows of 40 keys of 3 values, so an expert's ties straddle loads: the take counts
    the ties taken in earlier loads, the ranks go on from earlier loads, and a rounded-down expert's list gathers its
    chosen keys from every load, streamed and held alike, each equal to the twin's ranks and the oracle's pairs."""
    prob_key, score_key, f, keep = random_keys(6, 40, 21, 3)
    keep[3::2], keep[4::2] = f[3::2] // 2, (f[4::2] + 40) // 2  # rounded down, and up, part of the way
    assert bool(((keep[3::2] > 0) & (keep[3::2] < f[3::2])).all()) and bool((keep[4::2] > f[4::2]).all()), (f, keep)
    expect = oracle(prob_key, score_key, keep)
    args = [x.to(device) for x in (prob_key, score_key, f, keep)]
    want = select_routed_ref(*args, rank=True).cpu()
    assert torch.equal(want != 0, expect) and int(want.max()) > 8
    # held: over the lists of the rounded-down experts, and over whole rows; streamed (16 thresholds a pass)
    for kw in ({"resident": True, "compact": 64}, {"resident": True, "compact": 0}, {"resident": False, "fanout": 16}):
        got = select_routed(*args, tile=(8, 1), rank=True, **kw)
        assert got.dtype == torch.int32 and torch.equal(got.cpu(), want), kw  # (torch.equal ignores the dtype)
    # ranks are int32 (ranks_routing's input, 4 bytes a pair of the (T, E) array), the plain mask bool
    assert want.dtype == torch.int32 and select_routed(*args).dtype == select_routed_ref(*args).dtype == torch.bool


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


@pytest.mark.parametrize("seed,values", [(0, 2), (1, 2), (2, 3)])
def test_select_adjacent_key_values(device, seed, values):
    """Keys of two or three adjacent values (the keys of floats one ulp apart), with ties at each expert's cut: the
    search narrows the range down to the single value of the n-th largest key (a range of two values left unsplit
    takes every key of the upper one), held at every fanout, over the lists, and streamed, equal to the oracle."""
    g = torch.Generator().manual_seed(seed)
    e, t = 8, 24
    base = int(torch.randint(NO_KEY + 1, 2**31 - values, (1,), generator=g))
    keys = base + torch.randint(0, values, (e, t), generator=g)
    chosen = torch.rand(e, t, generator=g) < 0.5
    prob_key = torch.where(chosen, NO_KEY, keys).to(torch.int32)
    score_key = torch.where(chosen, keys, NO_KEY).to(torch.int32)
    f = chosen.sum(1)
    # experts 0-3 rounded down (keep in [1, f)), 4-7 rounded up (keep in (f, T))
    part = torch.rand(e, generator=g)
    keep = torch.where(torch.arange(e) < 4, 1 + (part * (f - 1)).long(), f + 1 + (part * (t - f - 1)).long())
    assert bool((keep[:4] < f[:4]).all() and (keep[4:] > f[4:]).all() and (keep[4:] < t).all()), (f, keep)
    expect = oracle(prob_key, score_key, keep)
    args = [x.to(device) for x in (prob_key, score_key, f, keep)]
    assert torch.equal(select_routed_ref(*args).cpu(), expect)
    for fanout in (2, 4, 8):
        for kw in ({"resident": True, "compact": 0}, {"resident": True, "compact": 32}, {"resident": False}):
            assert torch.equal(select_routed(*args, fanout=fanout, **kw).cpu(), expect), (fanout, kw)


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


def test_candidate_keys_strided_operands_and_block_counts(device):
    """Operands the kernel cannot index as they are give the keys of their contiguous copies: probs a block of
    columns of a wider tensor (row stride E + 3), probs stored column-major (inner stride T), and topk_ids and
    topk_scores every other column of (T, 2K) tensors whose other columns hold an expert id (-1) and a score (NaN)
    that would show if read. The per-block counts (``block_counts``) are int32, one row per block of tokens, and
    sum to f; the twin's are its single block's."""
    t, e, k = 37, 6, 2
    g = torch.Generator().manual_seed(95)
    router = router_topk(torch.randn(t, 8, generator=g), torch.randn(e, 8, generator=g), k)
    probs, ids, scores = router.probs.detach(), router.topk_ids, router.topk_scores.detach()
    want = candidate_keys_ref(probs, ids, scores)
    wide = torch.rand(t, e + 3, generator=g)
    wide[:, 1:e + 1] = probs
    probs_block = wide[:, 1:e + 1]
    probs_cols = probs.t().contiguous().t()
    ids_wide = torch.stack([ids, torch.full_like(ids, -1)], 2).reshape(t, 2 * k)
    scores_wide = torch.stack([scores, torch.full_like(scores, float("nan"))], 2).reshape(t, 2 * k)
    assert probs_block.stride() == (e + 3, 1) and probs_cols.stride(1) == t
    assert torch.equal(ids_wide[:, ::2], ids) and ids_wide[:, ::2].stride(1) == 2
    for p_, i_, s_ in ((probs_block, ids, scores), (probs_cols, ids, scores), (probs, ids_wide[:, ::2], scores),
                       (probs, ids, scores_wide[:, ::2])):
        args = [x.to(device) for x in (p_, i_, s_)]
        for fn in (candidate_keys, candidate_keys_ref):
            got = fn(*args)
            for x, y, name in zip(got, want, ("prob_key", "score_key", "f")):
                assert torch.equal(x.cpu(), y), (fn.__name__, name, p_.stride(), i_.stride(), s_.stride())
    f = torch.bincount(ids.reshape(-1), minlength=e)
    args = [x.to(device) for x in (probs, ids, scores)]
    counts = candidate_keys(*args, tile=(16, 8, 1), block_counts=True)[2].cpu()
    assert counts.dtype == torch.int32 and counts.shape == (3, e)  # cdiv(37, 16) blocks of tokens
    assert torch.equal(counts.sum(0), f)
    assert torch.equal(counts[1], torch.bincount(ids[16:32].reshape(-1), minlength=e).int())
    ref_counts = candidate_keys_ref(*args, block_counts=True)[2].cpu()
    assert ref_counts.dtype == torch.int32 and torch.equal(ref_counts, f.int()[None, :])


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
    for compact in (3, True):  # True is an int 1, a power of two: refused as fanout's True is
        with pytest.raises(ValueError, match=f"compact must be 0 or a power of two, got {compact!r}"):
            select_routed(keys, keys, z, z, compact=compact)
    with pytest.raises(ValueError, match="topk_ids"):
        candidate_keys_ref(torch.zeros(5, 3), torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2))
    # keys that are not contiguous, and float counts, are refused by the kernel's launcher and by its twin alike
    strided = torch.zeros(5, 3, dtype=torch.int32).t()
    assert strided.shape == keys.shape and not strided.is_contiguous()
    for fn in (select_routed, select_routed_ref):
        with pytest.raises(ValueError, match="score_key must be a contiguous"):
            fn(keys, strided, z, z)
        with pytest.raises(ValueError, match="prob_key must be a contiguous"):
            fn(strided, keys, z, z)
        with pytest.raises(ValueError, match="keep must be an"):
            fn(keys, keys, z, z.float())
        with pytest.raises(ValueError, match="f must be an"):
            fn(keys, keys, z.double(), z)
    # scores of another shape than the ids (here one column short), and probs that are not (T, E)
    ids = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2]])
    for fn in (candidate_keys, candidate_keys_ref):
        with pytest.raises(ValueError, match="topk_scores must both be"):
            fn(torch.rand(4, 3), ids, torch.rand(4, 1))
        with pytest.raises(ValueError, match="probs must be"):
            fn(torch.rand(4, 3, 1), ids, torch.rand(4, 2))
        # ids and scores of one expert per token given as (T,) vectors, not (T, 1): a ValueError, not an IndexError
        with pytest.raises(ValueError, match=r"topk_ids and topk_scores must both be \(T=4, K\), got \(4,\) and"):
            fn(torch.rand(4, 3), ids[:, 0], torch.rand(4))


def test_select_launch_parameters(monkeypatch):
    """select_routed's launch, recorded instead of run: the row is held in registers (ROW = next_pow2(T)) up to and
    including T = RESIDENT_MAX_T (resident=True is accepted there), streamed past it (ROW = 0); the default fanout is
    RESIDENT_FANOUT held, SELECT_FANOUT streamed, with ceil(32 / log2 fanout) counting passes; the compact list (CAP)
    defaults to min(next_pow2(T), COMPACT_MAX) and exists only with the row held; keys per load are capped at
    next_pow2(T); warps are resident_warps(T) held (4 to 16, about 64 keys per thread)."""
    calls = []
    monkeypatch.setattr(tr_select, "launch_kernel", lambda kernel, grid, *args, **kw: calls.append((grid, kw)))

    def launch(t, e=1, **kw):
        z = torch.zeros(e, dtype=torch.int64)
        keys = torch.full((e, t), NO_KEY, dtype=torch.int32)
        calls.clear()
        select_routed(keys, keys, z, z, **kw)
        ((grid, params),) = calls
        assert grid == (e,)
        return {name: params[name] for name in ("ROW", "CAP", "FANOUT", "PASSES", "BLOCK", "num_warps")}

    block, warps = tr_select.SELECT_TILE  # CPU tensors: not the few-experts tile, which is for CUDA devices
    held, streamed = tr_select.RESIDENT_FANOUT, tr_select.SELECT_FANOUT
    passes = {2: 32, 4: 16, 8: 11, 16: 8}
    bound = RESIDENT_MAX_T
    assert launch(bound) == launch(bound, resident=True) == dict(
        ROW=bound, CAP=tr_select.COMPACT_MAX, FANOUT=held, PASSES=passes[held], BLOCK=block, num_warps=16)
    assert launch(bound + 1) == dict(ROW=0, CAP=0, FANOUT=streamed, PASSES=passes[streamed], BLOCK=block,
                                     num_warps=warps)
    assert launch(bound, resident=False, fanout=8) == dict(ROW=0, CAP=0, FANOUT=8, PASSES=11, BLOCK=block,
                                                           num_warps=warps)
    assert launch(7, e=3) == dict(ROW=8, CAP=8, FANOUT=held, PASSES=passes[held], BLOCK=8, num_warps=4)
    assert launch(7, e=3, compact=0, fanout=16)["CAP"] == 0 and launch(7, fanout=16)["PASSES"] == 8
    assert launch(7, resident=False, compact=4)["CAP"] == 0
    assert launch(3000, compact=1024, tile=(1024, 2)) == dict(ROW=4096, CAP=1024, FANOUT=held, PASSES=passes[held],
                                                              BLOCK=1024, num_warps=2)
    assert [tr_select.resident_warps(t) for t in (0, 1, 8192, 16384, 16385, 32768)] == [4, 4, 4, 8, 16, 16]
    calls.clear()
    empty = torch.zeros(2, 0, dtype=torch.int32)
    z2 = torch.zeros(2, dtype=torch.int64)
    assert select_routed(empty, empty, z2, z2).shape == (0, 2) and not calls  # no tokens: nothing launched


def test_use_select_kernels(monkeypatch):
    """The kernels run on CUDA unless use_kernel is False; on CPU only when asked for (True) under the interpreter,
    never by default (None): the torch twins are the CPU path."""
    assert interpreting()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [use_select_kernels(cpu, u) for u in (None, True, False)] == [False, True, False]
    assert [use_select_kernels(cuda, u) for u in (None, True, False)] == [True, True, False]
    monkeypatch.setattr(tr_select, "interpreting", lambda: False)
    assert [use_select_kernels(cpu, u) for u in (None, True, False)] == [False, False, False]


def test_token_rounding_use_kernel_picks_the_path(monkeypatch):
    """token_rounding's use_kernel reaches both choices: True (on CPU, under the interpreter) selects with the kernels
    of this module and scores with tr_scores' kernel; False and None (the CPU default) take their torch twins. The
    paths give the same pairs, so only the calls tell them apart."""
    from sonicmoe.ops import tr_scores

    calls = []

    def spy(module, name):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(name) or fn(*a, **kw))

    for name in ("candidate_keys", "candidate_keys_ref", "select_routed", "select_routed_ref"):
        spy(tr_select, name)
    for name in ("pair_scores", "pair_scores_ref"):
        spy(tr_scores, name)
    g = torch.Generator().manual_seed(4)
    router = router_topk(torch.randn(40, 8, generator=g), torch.randn(6, 8, generator=g), 2)
    kernels, twins = ["candidate_keys", "select_routed", "pair_scores"], ["candidate_keys_ref", "select_routed_ref",
                                                                         "pair_scores_ref"]
    for use_kernel, want in ((True, kernels), (False, twins), (None, twins)):
        calls.clear()
        token_rounding(router, m_tile=4, use_kernel=use_kernel)
        assert calls == want, use_kernel


def test_listed_search_reads_only_its_f_keys(device, monkeypatch):
    """The list search of a rounded-down expert reads its f listed keys and no slot past them: with the scratch lists
    filled beforehand with the largest key (and token 0), a read of slot f would take token 0 (the poisoned default
    fills them with NO_KEY, which no search takes)."""
    new_output = tr_select.new_output

    def prefilled(shape, **kw):
        out = new_output(shape, **kw)
        if len(shape) == 3:  # the (2, E, CAP) scratch: keys, then tokens
            out[0].fill_(2**31 - 1)
            out[1].fill_(0)
        return out

    monkeypatch.setattr(tr_select, "new_output", prefilled)
    prob_key, score_key, f, keep = random_keys(6, 40, 6, 1000)
    score_key[:, 0] = NO_KEY  # token 0 is chosen by no expert: taken nowhere by a rounded-down one
    f = (score_key != NO_KEY).sum(1)
    keep = torch.minimum(keep, (f - 1).clamp_min(0))
    keep[0] = f[0] - 1
    assert int(f.min()) > 0 and bool((keep < f).all()) and int(f.max()) < 64
    expect = oracle(prob_key, score_key, keep)
    args = [x.to(device) for x in (prob_key, score_key, f, keep)]
    for compact in (None, 64):
        got = select_routed(*args, resident=True, compact=compact, rank=True).cpu()
        assert torch.equal(got, select_routed_ref(*args, rank=True).cpu()), compact
        assert torch.equal(got != 0, expect), compact


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
    for fn, kw in ((token_rounding, {"use_kernel": True}), (token_rounding, {"use_kernel": False}),
                   (token_rounding_ref, {})):  # the oracle too: the other paths are checked against it
        out = fn(router, m_tile=4, subroutine="up", **kw)
        added = out.pair_token[out.pair_added & (out.pair_expert == 0)].tolist()
        assert added == [2, 3, 4], (fn, kw)  # 0.9, then two of the tied rest by index; NaN (token 1) last


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
