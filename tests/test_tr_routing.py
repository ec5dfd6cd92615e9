"""Token rounding's decision and routing-metadata kernels (sonicmoe.ops.tr_routing) and the selection's rank output,
against their torch twins: on CPU through the Triton interpreter (the ``interpreter`` mark), natively on a GPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sonicmoe.config import ROUNDING_SUBROUTINES
from sonicmoe.ops import tr_routing, tr_select
from sonicmoe.routing import router_topk, routing_from_pairs
from sonicmoe.token_rounding import max_pairs, token_rounding

pytestmark = [pytest.mark.filterwarnings("ignore:token rounding with")]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every kernel output poisoned (NaN; int32: int-min) before its kernel writes it: an element no program writes
    fails the comparison with the twin."""
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")


ROUTING_FIELDS = ("expert_offsets", "row_token", "row_pair", "pair_row", "token_offsets", "token_rows", "slot_pair")


def _assert_routing_equal(a, b):
    for name in ROUTING_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (a.num_tokens, a.num_experts, a.padded) == (b.num_tokens, b.num_experts, b.padded)


def _random_ranks(t, e, density, seed):
    """A rank array with each (t, e) routed with probability ``density`` (each expert's routed tokens ranked
    1, 2, ... in token order, 0 elsewhere), and the experts' row offsets."""
    routed = torch.rand(t, e, generator=torch.Generator().manual_seed(seed)) < density
    ranks = (routed.cumsum(0) * routed).to(torch.int32)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), routed.sum(0).cumsum(0)]).to(torch.int32)
    return ranks, offsets, int(routed.sum())


def _assert_ranks_routing_equal(ranks, offsets, r_max, tile=None):
    """ranks_routing's pairs and routing equal its torch twin's."""
    got = tr_routing.ranks_routing(ranks, offsets, max_pairs=r_max, tile=tile)
    ref = tr_routing.ranks_routing_ref(ranks, offsets, max_pairs=r_max)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    _assert_routing_equal(got[2], ref[2])


@pytest.mark.interpreter
@settings(max_examples=40, deadline=None)
@given(nb=st.integers(1, 9), e=st.integers(1, 70), m=st.integers(1, 40), t=st.integers(1, 300),
       subroutine=st.sampled_from(ROUNDING_SUBROUTINES), seed=st.integers(0, 10**6))
def test_round_counts_kernel_equals_torch(nb, e, m, t, subroutine, seed):
    """f, keep, pad and the expert offsets from the one-program kernel equal the torch decision's, for random
    per-block counts (many exact multiples of M_tile, zeros, and counts near T: the cap edge)."""
    _assert_round_counts_equal(nb, e, m, t, subroutine, seed)


def _assert_round_counts_equal(nb, e, m, t, subroutine, seed):
    """The body of the hypothesis test above: round_counts equals round_counts_ref on seeded random block counts."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, t // nb + 1, (nb, e), generator=g, dtype=torch.int32)  # column sums <= T
    counts[:, ::3] = 0  # every third expert: an exact multiple of M_tile (0, M or 2M, at most T)
    counts[0, ::3] = (torch.randint(0, 3, (len(range(0, e, 3)),), generator=g, dtype=torch.int32) * m).clamp(max=t)
    u = torch.rand(e, generator=g)
    got = tr_routing.round_counts(counts, m, t, subroutine, u)
    ref = tr_routing.round_counts_ref(counts, m, t, subroutine, u)
    for name, a, b in zip(("f", "keep", "pad", "offsets"), got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), (name, a, b)


@pytest.mark.interpreter
@pytest.mark.parametrize("subroutine", ROUNDING_SUBROUTINES)
def test_round_counts_kernel_equals_torch_fixed_cases(subroutine):
    """The hypothesis test's comparison on fixed draws of (NB, E, M_tile, T, seed): one block and several, E below,
    at and past a power of two, M_tile 1, tiny and large, T at the cap edge, so the kernel's rounding and offsets
    are checked every run, not only when the random draws happen to reach a case."""
    for nb, e, m, t, seed in [(1, 1, 1, 1, 0), (1, 5, 4, 9, 1), (2, 7, 3, 20, 2), (3, 17, 8, 64, 3),
                              (4, 33, 5, 120, 4), (9, 70, 16, 300, 5), (5, 12, 40, 37, 6), (2, 64, 2, 7, 7)]:
        _assert_round_counts_equal(nb, e, m, t, subroutine, seed)


@pytest.mark.interpreter
@pytest.mark.parametrize("subroutine", ROUNDING_SUBROUTINES)
@pytest.mark.parametrize("static", [False, True])
def test_selection_ranks_and_pairs_routing_kernels(subroutine, static):
    """The selection's rank output equals its torch twin's (1-based rank of each routed token within its expert, in
    token order), and the routing built from it without a sort equals routing_from_pairs of the same pairs."""
    t, e, k, m = 150, 12, 3, 8
    router = router_topk(torch.randn(t, 16, generator=torch.Generator().manual_seed(3)),
                         torch.randn(e, 16, generator=torch.Generator().manual_seed(4)), k)
    prob_key, score_key, counts = tr_select.candidate_keys(router.probs, router.topk_ids, router.topk_scores,
                                                           block_counts=True)
    u = torch.rand(e, generator=torch.Generator().manual_seed(5))
    f, keep, _, offsets = tr_routing.round_counts(counts, m, t, subroutine, u)
    ranks = tr_select.select_routed(prob_key, score_key, f, keep, rank=True)
    ref_ranks = tr_select.select_routed_ref(prob_key, score_key, f, keep, rank=True)
    assert ranks.dtype == torch.int32 and torch.equal(ranks, ref_ranks)
    assert torch.equal(ranks != 0, tr_select.select_routed(prob_key, score_key, f, keep))
    _assert_ranks_routing_equal(ranks, offsets, max_pairs(t, e, k, m, subroutine) if static else None)


@pytest.mark.interpreter
@settings(max_examples=30, deadline=None)
@given(t=st.integers(0, 100), e=st.integers(1, 300), density=st.floats(0.0, 1.0), extra=st.integers(0, 50),
       static=st.booleans(), seed=st.integers(0, 10**6), tile=st.sampled_from([None, (8, 16, 1), (16, 64, 2)]))
def test_ranks_routing_kernels_equal_torch(t, e, density, extra, static, seed, tile):
    """The pairs and routing from any rank array (each expert's routed tokens ranked 1, 2, ... in token order):
    the two kernels equal nonzero(_static) + routing_from_pairs, for empty and full rows, E past one 128-wide
    block, T = 0, R_max with no padding left (extra = 0) or many padding pairs, and other tiles (up to 19 blocks of
    experts per token)."""
    ranks, offsets, real = _random_ranks(t, e, density, seed)
    _assert_ranks_routing_equal(ranks, offsets, real + extra if static else None, tile)


@pytest.mark.interpreter
@pytest.mark.parametrize("tile", [None, (8, 16, 1), (16, 64, 2)])
def test_ranks_routing_kernels_equal_torch_fixed_cases(tile):
    """The hypothesis test's comparison on fixed draws: T = 0, one token, empty and full rank arrays, E past one
    128-wide block, static with no padding left (extra = 0) and with many padding pairs."""
    for t, e, density, extra, static, seed in [(0, 5, 0.5, 3, True, 0), (1, 1, 1.0, 0, True, 1),
                                               (17, 9, 0.0, 4, True, 2), (23, 6, 1.0, 0, False, 3),
                                               (40, 130, 0.3, 0, True, 4), (64, 37, 0.5, 50, True, 5),
                                               (100, 300, 0.1, 7, False, 6), (31, 3, 0.7, 11, True, 7)]:
        ranks, offsets, real = _random_ranks(t, e, density, seed)
        _assert_ranks_routing_equal(ranks, offsets, real + extra if static else None, tile)


@pytest.mark.interpreter
@pytest.mark.parametrize("static", [False, True])
def test_token_rounding_routing_field(static):
    """token_rounding's ``routing`` (kernels, interpreter) is routing_from_pairs of its own pairs, and equals the
    torch path's."""
    t, e = 90, 7
    router = router_topk(torch.randn(t, 8, generator=torch.Generator().manual_seed(0)),
                         torch.randn(e, 8, generator=torch.Generator().manual_seed(1)), 2)
    fast = token_rounding(router, m_tile=4, use_kernel=True, static=static, warn=False)
    slow = token_rounding(router, m_tile=4, use_kernel=False, static=static, warn=False)
    expect = routing_from_pairs(fast.pair_token, fast.pair_expert, t, e, token_major=True, padding=static)
    _assert_routing_equal(fast.routing, expect)
    _assert_routing_equal(slow.routing, expect)


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k", [(16384, 512, 8), (24576, 128, 8), (4099, 64, 2)])
def test_gpu_routing_field_at_benchmark_sizes(t, e, k):
    """On the GPU at benchmark sizes, for every subroutine and both forms: the kernels' routing equals
    routing_from_pairs of the kernels' pairs, and their decision equals the torch twin's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    router = router_topk(torch.randn(t, 64, device="cuda", generator=g),
                         torch.randn(e, 64, device="cuda", generator=g), k)
    for s in ROUNDING_SUBROUTINES:
        for static in (False, True):
            gen = torch.Generator(device="cuda").manual_seed(1)
            out = token_rounding(router, m_tile=128, subroutine=s, static=static, generator=gen)
            expect = routing_from_pairs(out.pair_token, out.pair_expert, t, e, token_major=True, padding=static)
            _assert_routing_equal(out.routing, expect)
            gen = torch.Generator(device="cuda").manual_seed(1)
            ref = token_rounding(router, m_tile=128, subroutine=s, static=static, generator=gen, use_kernel=False)
            for name in ("pair_token", "pair_expert", "counts", "topk_counts", "padded"):
                assert torch.equal(getattr(out, name), getattr(ref, name)), (s, static, name)


@pytest.mark.interpreter
def test_ranks_routing_many_blocks():
    """More blocks of (tokens, experts) than the pair kernel sums at once (1315 > 1024 block sums): the same
    pairs and routing as the torch twin."""
    ranks, offsets, real = _random_ranks(2100, 80, 0.05, 9)
    _assert_ranks_routing_equal(ranks, offsets, real + 100, (8, 16, 1))


@pytest.mark.interpreter
def test_strided_offsets_and_draws(device):
    """ranks_routing with a strided expert_offsets view (its kernel wrote row_pair out of bounds before session 82)
    and round_counts with strided stochastic draws (it read the wrong ones): the same as their twins."""
    ranks = torch.tensor([[1, 0], [0, 1], [2, 0]], dtype=torch.int32, device=device)
    offs = torch.tensor([0, 7, 2, 7, 3, 7], dtype=torch.int32, device=device)[::2]  # [0, 2, 3]
    got, want = tr_routing.ranks_routing(ranks, offs)[2], tr_routing.ranks_routing_ref(ranks, offs.contiguous())[2]
    for name in ("row_pair", "pair_row", "row_token", "token_offsets"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    counts = torch.tensor([[3, 5, 6, 1]], dtype=torch.int32, device=device)
    u = torch.tensor([0.9, 0.0] * 4, device=device)[::2]  # 0.9 for every expert: none pads at m = 8
    got = tr_routing.round_counts(counts, 8, 100, "stochastic", u)
    want = tr_routing.round_counts_ref(counts, 8, 100, "stochastic", u.contiguous())
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and not got[2].any()


@pytest.mark.interpreter
def test_ranks_routing_strided_ranks(device):
    """ranks_routing with a rank array that is a transposed view (strides (1, T)): the kernels read it at
    base + t·E + e, so it is read through a contiguous copy; the same pairs and routing as the twin's on the copy.
    Several blocks of tokens and of experts (tile (8, 16, 1): 5 and 3, a count array of 3 columns read as 4 with the
    fourth masked), static and exact."""
    ranks, offsets, real = _random_ranks(37, 40, 0.3, 11)
    view = ranks.t().contiguous().to(device).t()
    assert view.stride() == (1, 37) and torch.equal(view.cpu(), ranks)
    for r_max in (None, real + 5):
        got = tr_routing.ranks_routing(view, offsets.to(device), max_pairs=r_max, tile=(8, 16, 1))
        ref = tr_routing.ranks_routing_ref(ranks.to(device), offsets.to(device), max_pairs=r_max)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        _assert_routing_equal(got[2], ref[2])


@pytest.mark.interpreter
def test_stochastic_round_counts_needs_draws(device):
    """round_counts under "stochastic" without its (E,) draws raises, naming u: the kernel read the counts in their
    place (never padding, where the twin draws them) before the ops audit of session 90."""
    counts = torch.randint(1, 40, (1, 6), dtype=torch.int32, device=device)
    for u in (None, torch.rand(5, device=device)):
        with pytest.raises(ValueError, match="u: the stochastic"):
            tr_routing.round_counts(counts, 16, 100, "stochastic", u)
    u = torch.rand(6, device=device)
    got = tr_routing.round_counts(counts, 16, 100, "stochastic", u)
    assert all(torch.equal(a, b) for a, b in zip(got, tr_routing.round_counts_ref(counts, 16, 100, "stochastic", u)))


@pytest.mark.interpreter
def test_round_counts_nearest_ties_and_cap_by_hand(device):
    """The "nearest" decision on values written out by hand: a count exactly M_tile/2 past a multiple rounds down
    (a tie), one more rounds up, capped at T; the two blocks' counts summed first. The random test above meets an
    exact tie only when its draws happen to (a tie rounded up passed it on one run of the mutation probe and failed
    it on another)."""
    m, t = 8, 30
    f = [4, 5, 12, 13, 3, 0, 16, 20, 30, 28]
    # f - lo: 4 (tie), 5, 4 (tie), 5, 3, 0, 0, 4 (tie), 6 (up to 32, capped at T = 30), 4 (tie)
    want_keep = [0, 8, 8, 16, 0, 0, 16, 16, 30, 24]
    want_pad = [False, True, False, True, False, False, False, False, True, False]
    first = torch.tensor([1, 2, 5, 6, 0, 0, 9, 11, 15, 20], dtype=torch.int32)
    counts = torch.stack([first, torch.tensor(f, dtype=torch.int32) - first]).to(device)  # (2, E): two blocks
    got_f, keep, pad, offsets = tr_routing.round_counts(counts, m, t, "nearest")
    assert got_f.tolist() == f and keep.tolist() == want_keep and pad.tolist() == want_pad
    assert offsets.tolist() == [0, 0, 8, 16, 32, 32, 32, 48, 64, 94, 118]
    ref = tr_routing.round_counts_ref(counts, m, t, "nearest")
    assert all(torch.equal(a, b) for a, b in zip((got_f, keep, pad, offsets), ref))


@pytest.mark.interpreter
def test_round_counts_balance_ties_by_hand(device):
    """The "balance" decision on values written out by hand (M_tile = 8): the prefix sums 4, 12, 16, 19, 24, 36
    round to the nearest multiple of 8 with ties down (0, 8, 16, 16, 24, 32), and each expert keeps its share of the
    rounded sums. The ties 4 and 12 (and 36) make M - 2x an exact negative multiple of 2M (12: -16), where a floor
    division that rounds q down without checking for a remainder, or a grid that rounds ties up, pads other experts.
    A random test meets such exact ties only when its draws happen to."""
    m, t = 8, 100
    f = [4, 8, 4, 3, 5, 12]
    want_keep = [0, 8, 8, 0, 8, 8]  # the differences of the rounded prefix sums
    want_pad = [False, False, True, False, True, False]  # above the count rounded down: 0, 8, 0, 0, 0, 8
    counts = torch.tensor([f], dtype=torch.int32, device=device)
    got_f, keep, pad, offsets = tr_routing.round_counts(counts, m, t, "balance")
    assert got_f.tolist() == f and keep.tolist() == want_keep and pad.tolist() == want_pad
    assert offsets.tolist() == [0, 0, 8, 16, 16, 24, 32]
    ref = tr_routing.round_counts_ref(counts, m, t, "balance")
    assert all(torch.equal(a, b) for a, b in zip((got_f, keep, pad, offsets), ref))


@pytest.mark.interpreter
def test_round_counts_stochastic_draws_at_the_edge(device):
    """"stochastic" pads an expert when u · M < its remainder, strictly: a draw of 0 (torch.rand's range is [0, 1))
    never pads an exact multiple of M_tile (remainder 0), and u · M equal to the remainder does not pad; a draw just
    below it does. Values by hand (M_tile = 8, remainders 0, 0, 4, 4, 4, 1)."""
    m, t = 8, 100
    f = [0, 16, 4, 12, 20, 1]
    u = torch.tensor([0.0, 0.0, 0.5, 0.5, 0.49, 0.0], device=device)
    counts = torch.tensor([f], dtype=torch.int32, device=device)
    got_f, keep, pad, offsets = tr_routing.round_counts(counts, m, t, "stochastic", u)
    assert pad.tolist() == [False, False, False, False, True, True]
    assert keep.tolist() == [0, 16, 0, 8, 24, 8] and offsets.tolist() == [0, 0, 16, 16, 24, 48, 56]
    ref = tr_routing.round_counts_ref(counts, m, t, "stochastic", u)
    assert all(torch.equal(a, b) for a, b in zip((got_f, keep, pad, offsets), ref))


@pytest.mark.interpreter
@pytest.mark.parametrize("e", [5, 130])
def test_ranks_routing_no_tokens_padding_only(e, device):
    """T = 0 with a static R_max: no pair is real, so every pair is a padding pair (token T = 0, expert E, row = its
    index, row_token max(T − 1, 0) = 0) and token_offsets is [0]. The pair kernel still needs its grid of one block
    of tokens to write them (an empty grid left them unwritten); without R_max there are no pairs at all. The random
    test above meets T = 0 only when its draws happen to."""
    ranks = torch.zeros(0, e, dtype=torch.int32, device=device)
    offsets = torch.zeros(e + 1, dtype=torch.int32, device=device)
    r = 1100  # past one padding block of 1024
    pair_token, pair_expert, routing = tr_routing.ranks_routing(ranks, offsets, max_pairs=r)
    idx = torch.arange(r, dtype=torch.int32, device=device)
    assert pair_token.tolist() == [0] * r and pair_expert.tolist() == [e] * r
    assert torch.equal(routing.pair_row, idx) and torch.equal(routing.row_pair, idx)
    assert routing.row_token.tolist() == [0] * r and routing.token_offsets.tolist() == [0] and routing.padded
    _assert_ranks_routing_equal(ranks, offsets, r)
    pair_token, pair_expert, routing = tr_routing.ranks_routing(ranks, offsets)
    assert pair_token.numel() == 0 and pair_expert.numel() == 0 and routing.token_offsets.tolist() == [0]


@pytest.mark.interpreter
def test_ranks_routing_padding_slices_cover_every_program(device):
    """The padding pairs past the real ones are dealt in slices of 1024 to the programs by their flat index
    tb · NEB + eb over a (2, 2) grid (tile (8, 16, 1): T = 16, E = 32), four slices a round: with R_max about 4000
    past the real pairs every program's first slice holds padding and the first program's second one too. Each slice
    written by exactly its program: two programs sharing an index (tb + eb) leave a slice unwritten (poisoned)."""
    g = torch.Generator().manual_seed(21)
    ranks, offsets, real = _random_ranks(16, 32, float(torch.rand(1, generator=g)) * 0.5, 21)
    r_max = real + 4000 + int(torch.randint(0, 200, (1,), generator=g))
    _assert_ranks_routing_equal(ranks.to(device), offsets.to(device), r_max, (8, 16, 1))
    pair_token, pair_expert, routing = tr_routing.ranks_routing(ranks.to(device), offsets.to(device),
                                                                max_pairs=r_max, tile=(8, 16, 1))
    pad = torch.arange(real, r_max, dtype=torch.int32, device=device)
    assert bool((pair_token[real:] == 16).all()) and bool((pair_expert[real:] == 32).all())
    assert torch.equal(routing.pair_row[real:], pad) and torch.equal(routing.row_pair[real:], pad)
