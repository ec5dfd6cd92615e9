"""Routing metadata invariants (sonicmoe.routing) and the router / auxiliary losses.

Every expected value here is computed independently of the library: Python loops over the pairs,
``torch.bincount`` for counts, hand-written softmax / logsumexp in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sonicmoe.routing import (
    INDEX_DTYPE,
    Routing,
    check_pairs,
    is_integer_dtype,
    load_balancing_loss,
    router_topk,
    routing_from_pairs,
    routing_from_topk,
    routing_from_topk_ref,
    z_loss,
)

HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread():
    """These tests run thousands of tiny CPU ops: use one intra-op thread. torch's CPU softmax wakes an
    OpenMP team on every call, which costs ~10 ms per call when the CPU is shared (CI, parallel jobs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------
# the invariant checker
# ---------------------------------------------------------------------------------------------


def check_routing(r: Routing, pair_token: list[int], pair_expert: list[int], T: int, E: int) -> None:
    """Assert every documented invariant of ``r`` built from the given pairs (Python lists)."""
    R = len(pair_token)
    assert r.num_tokens == T and r.num_experts == E and r.num_rows == R
    for name in ("expert_offsets", "row_token", "row_pair", "pair_row", "token_offsets", "token_rows"):
        assert getattr(r, name).dtype == INDEX_DTYPE, name
    assert r.expert_offsets.shape == (E + 1,)
    assert r.token_offsets.shape == (T + 1,)
    for name in ("row_token", "row_pair", "pair_row", "token_rows"):
        assert getattr(r, name).shape == (R,), name

    row_pair = r.row_pair.tolist()
    pair_row = r.pair_row.tolist()
    # inverse permutations
    assert sorted(row_pair) == list(range(R))
    assert all(pair_row[row_pair[i]] == i for i in range(R))
    assert all(row_pair[pair_row[p]] == p for p in range(R))

    # expert offsets: start 0, end R, diff = counts (bincount)
    offs = r.expert_offsets.tolist()
    assert offs[0] == 0 and offs[-1] == R
    counts = torch.bincount(torch.tensor(pair_expert, dtype=torch.long), minlength=E)
    assert torch.equal(r.expert_counts().long(), counts)
    assert torch.equal(torch.diff(r.expert_offsets.long()), counts)

    # rows of expert e are contiguous, hold exactly e's pairs, in ascending token order
    for e in range(E):
        rows_e = row_pair[offs[e]:offs[e + 1]]
        assert rows_e == sorted((p for p in range(R) if pair_expert[p] == e), key=lambda p: pair_token[p]), \
            f"expert {e}"

    # row_expert() and row_token
    row_expert = r.row_expert()
    assert row_expert.dtype == torch.int64 and row_expert.shape == (R,)
    assert row_expert.tolist() == [pair_expert[p] for p in row_pair]
    assert r.row_token.tolist() == [pair_token[p] for p in row_pair]

    # token side: offsets, slots and the pair behind each slot
    toffs = r.token_offsets.tolist()
    assert toffs[0] == 0 and toffs[-1] == R
    tcounts = torch.bincount(torch.tensor(pair_token, dtype=torch.long), minlength=T)
    assert torch.equal(torch.diff(r.token_offsets.long()), tcounts)
    slot_pair = list(range(R)) if r.slot_pair is None else r.slot_pair.tolist()
    if r.slot_pair is not None:
        assert r.slot_pair.dtype == INDEX_DTYPE and r.slot_pair.shape == (R,)
    token_rows = r.token_rows.tolist()
    for t in range(T):
        slots = range(toffs[t], toffs[t + 1])
        # the slots of token t are exactly its pairs, in pair order
        assert [slot_pair[s] for s in slots] == [p for p in range(R) if pair_token[p] == t], f"token {t}"
        for s in slots:
            assert token_rows[s] == pair_row[slot_pair[s]]
            assert r.row_token[token_rows[s]].item() == t

    # score helpers
    scores = torch.arange(R, dtype=torch.float32) * 0.5 + 1.0
    assert r.row_scores(scores).tolist() == [scores[p].item() for p in row_pair]
    assert r.slot_scores(scores).tolist() == [scores[p].item() for p in slot_pair]


def random_topk_ids(T: int, K: int, E: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    return ids.long()


# ---------------------------------------------------------------------------------------------
# routing_from_topk
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "T,K,E",
    [(1, 1, 1), (1, 1, 4), (1, 4, 4), (7, 1, 5), (9, 3, 3), (16, 2, 8), (33, 4, 6), (5, 8, 8), (0, 2, 4),
     (6, 0, 3)],
)
def test_routing_from_topk_invariants(T, K, E):
    ids = random_topk_ids(T, K, E, seed=T * 100 + K * 10 + E)
    r = routing_from_topk(ids, E)
    assert r.slot_pair is None  # token-major: identity
    pair_token = [t for t in range(T) for _ in range(K)]
    check_routing(r, pair_token, ids.reshape(-1).tolist(), T, E)
    # plain top-k: every token has exactly K slots
    assert torch.equal(torch.diff(r.token_offsets.long()), torch.full((T,), K))


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
@pytest.mark.parametrize("e", [5, 128])
def test_routing_from_topk_index_dtypes(id_dtype, e):
    """Any integer ids; E = 128 does not fit int8's E + 1 (its offsets' search bound wrapped to 0 before session
    82), nor would E = 256 uint8's."""
    ids = random_topk_ids(6, 2, e, seed=3)
    ids[0, 0] = e - 1  # the last expert holds a row
    r = routing_from_topk(ids.to(id_dtype), e)
    check_routing(r, [t for t in range(6) for _ in range(2)], ids.reshape(-1).tolist(), 6, e)
    assert int(r.expert_offsets[-1]) == 12


def test_routing_from_topk_empty_experts_and_all_on_one():
    T, E = 10, 6
    ids = torch.zeros(T, 1, dtype=torch.long)  # everybody on expert 0
    r = routing_from_topk(ids, E)
    check_routing(r, list(range(T)), [0] * T, T, E)
    assert r.expert_offsets.tolist() == [0] + [T] * E
    assert r.row_expert().tolist() == [0] * T

    ids = torch.tensor([[5, 2], [2, 5], [5, 2]])  # experts 0, 1, 3, 4 empty, including the first
    r = routing_from_topk(ids, E)
    check_routing(r, [0, 0, 1, 1, 2, 2], [5, 2, 2, 5, 5, 2], 3, E)
    assert r.expert_offsets.tolist() == [0, 0, 0, 3, 3, 3, 6]
    assert r.row_token.tolist() == [0, 1, 2, 0, 1, 2]


@HYP
@given(
    T=st.integers(0, 24),
    E=st.integers(1, 9),
    data=st.data(),
)
def test_routing_from_topk_hypothesis(T, E, data):
    K = data.draw(st.integers(1, E))
    seed = data.draw(st.integers(0, 2**31 - 1))
    ids = random_topk_ids(T, K, E, seed)
    r = routing_from_topk(ids, E)
    check_routing(r, [t for t in range(T) for _ in range(K)], ids.reshape(-1).tolist(), T, E)


# ---------------------------------------------------------------------------------------------
# routing_from_pairs: general routing
# ---------------------------------------------------------------------------------------------


def random_pairs(T: int, E: int, seed: int, p_keep: float = 0.4, shuffle: bool = True):
    """Unique (token, expert) pairs, a variable number (0..E) of experts per token."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(T, E, generator=g) < p_keep
    tok, exp = keep.nonzero(as_tuple=True)
    if shuffle:
        perm = torch.randperm(tok.numel(), generator=g)
        tok, exp = tok[perm], exp[perm]
    return tok, exp


@pytest.mark.parametrize("T,E,p_keep", [(1, 1, 1.0), (1, 5, 0.5), (12, 4, 0.3), (20, 7, 0.6), (8, 8, 1.0),
                                        (6, 3, 0.0), (30, 10, 0.15)])
def test_routing_from_pairs_general(T, E, p_keep):
    tok, exp = random_pairs(T, E, seed=T + 31 * E, p_keep=p_keep)
    r = routing_from_pairs(tok, exp, T, E)
    check_routing(r, tok.tolist(), exp.tolist(), T, E)


def test_routing_from_pairs_zero_expert_tokens_and_empty_experts():
    # token 1 and 3 have no expert; experts 0 and 2 receive nothing; pairs not token-major
    tok = torch.tensor([4, 0, 2, 0, 4, 2, 4])
    exp = torch.tensor([1, 3, 3, 1, 4, 1, 3])
    T, E = 5, 5
    r = routing_from_pairs(tok, exp, T, E)
    check_routing(r, tok.tolist(), exp.tolist(), T, E)
    assert r.token_offsets.tolist() == [0, 2, 2, 4, 4, 7]
    assert r.expert_offsets.tolist() == [0, 0, 3, 3, 6, 7]
    # rows of expert 1 are pairs 3, 5, 0 (its pairs in token order) -> tokens 0, 2, 4
    assert r.row_token[0:3].tolist() == [0, 2, 4]
    assert r.row_pair[0:3].tolist() == [3, 5, 0]
    assert r.slot_pair.tolist() == [1, 3, 2, 5, 0, 4, 6]


def test_routing_from_pairs_token_major_matches_general():
    tok, exp = random_pairs(15, 6, seed=7, shuffle=False)  # nonzero() is row-major: token-major
    assert bool((torch.diff(tok) >= 0).all())
    fast = routing_from_pairs(tok, exp, 15, 6, token_major=True)
    slow = routing_from_pairs(tok, exp, 15, 6)
    assert fast.slot_pair is None
    check_routing(fast, tok.tolist(), exp.tolist(), 15, 6)
    assert torch.equal(slow.slot_pair.long(), torch.arange(tok.numel()))
    for name in ("expert_offsets", "row_token", "row_pair", "pair_row", "token_offsets", "token_rows"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name


def test_routing_from_pairs_empty():
    empty = torch.empty(0, dtype=torch.long)
    r = routing_from_pairs(empty, empty, 4, 3)
    check_routing(r, [], [], 4, 3)
    assert r.expert_offsets.tolist() == [0, 0, 0, 0]
    assert r.token_offsets.tolist() == [0, 0, 0, 0, 0]


def test_routing_from_topk_is_lean_and_checks_its_arguments():
    """routing_from_topk builds top-k's routing in at most 11 dispatched torch ops (each one costs host time in the
    eager layer; the generic routing_from_pairs path took 16), and names a bad argument."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    ids = random_topk_ids(13, 3, 6, seed=1)
    with Count():
        routing_from_topk(ids, 6)
    assert Count.ops <= 11
    with pytest.raises(TypeError, match="topk_ids"):
        routing_from_topk(ids.float(), 6)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="num_experts"):
            routing_from_topk(ids, bad)
    # check=True: the ids' values (without it an id >= E drops its pair and a repeated one counts twice, silently)
    for fn in (routing_from_topk, routing_from_topk_ref):
        checked = fn(ids, 6, check=True)
        assert torch.equal(checked.expert_offsets, routing_from_topk(ids, 6).expert_offsets)
        for value, match in ((6, r"\[0, E=6\), got values in \[\d, 6\]"), (-1, r"got values in \[-1, \d\]")):
            bad = ids.clone()
            bad[4, 1] = value
            with pytest.raises(ValueError, match=match):
                fn(bad, 6, check=True)
        bad = ids.clone()
        bad[7, 2] = bad[7, 0]
        with pytest.raises(ValueError, match="distinct experts per token, token 7 has"):
            fn(bad, 6, check=True)
        bad[11, 1] = bad[11, 2]  # two tokens with a repeated id: the first is named
        with pytest.raises(ValueError, match=r"distinct experts per token, token 7 has \[(\d), \d, \1\]$"):
            fn(bad, 6, check=True)
        with pytest.raises(ValueError, match="check must be a bool"):
            fn(ids, 6, check="yes")


@pytest.mark.parametrize("fn", [routing_from_topk, routing_from_topk_ref])
def test_topk_check_finds_a_repeat_that_is_not_the_smallest_id(fn):
    """check=True finds an id repeated within a token's row whichever ids are repeated: here the row's largest, set
    again over its smallest (after sorting the row, the repeat sits at its end, away from its first entry)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    t, k, e = 7, 4, 9
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    fn(ids, e, check=True)
    bad_t = int(torch.randint(0, t, (), generator=g))
    row = ids[bad_t]
    row[row.argmin()] = row.max()
    with pytest.raises(ValueError, match=f"distinct experts per token, token {bad_t} has"):
        fn(ids, e, check=True)


def test_routing_from_pairs_matches_topk_when_pairs_are_topk():
    ids = random_topk_ids(11, 3, 7, seed=5)
    tok = torch.arange(11).repeat_interleave(3)
    a = routing_from_topk(ids, 7)
    b = routing_from_pairs(tok, ids.reshape(-1), 11, 7)
    for name in ("expert_offsets", "row_token", "row_pair", "pair_row", "token_offsets", "token_rows"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@HYP
@given(T=st.integers(0, 20), E=st.integers(1, 8), p_keep=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**31 - 1), shuffle=st.booleans())
def test_routing_from_pairs_hypothesis(T, E, p_keep, seed, shuffle):
    tok, exp = random_pairs(T, E, seed, p_keep=p_keep, shuffle=shuffle)
    r = routing_from_pairs(tok, exp, T, E, token_major=not shuffle)
    check_routing(r, tok.tolist(), exp.tolist(), T, E)


def test_check_padding_pairs_are_both_t_and_e():
    """With check=True and padding=True, a pair with token T but a real expert (or a real token and expert E) is
    refused: it would be a real row added to token T − 1, or a token's slot pointing at a row no expert computes."""
    ok = routing_from_pairs(torch.tensor([0, 1, 2]), torch.tensor([1, 0, 2]), 2, 2, padding=True, check=True)
    assert int(ok.expert_offsets[-1]) == 2
    for tok, exp in (([0, 2], [1, 1]), ([0, 1], [1, 2])):
        with pytest.raises(ValueError, match=r"padding pairs must be \(token T=2, expert E=2\)"):
            routing_from_pairs(torch.tensor(tok), torch.tensor(exp), 2, 2, padding=True, check=True)


def test_check_refuses_a_broken_token_major_promise():
    """check=True with token_major=True verifies that pair_token is non-decreasing (the Triton backend reads the
    token slots as given; unsorted pairs gave it a relative error near 1, silently, before session 89); padding pairs
    (token T) sort last and pass; without token_major any order is taken."""
    tok, exp = torch.tensor([3, 0, 2, 1]), torch.tensor([0, 1, 2, 0])
    with pytest.raises(ValueError, match="token_major=True promises a non-decreasing pair_token"):
        routing_from_pairs(tok, exp, 4, 3, token_major=True, check=True)
    r = routing_from_pairs(tok, exp, 4, 3, check=True)
    check_routing(r, tok.tolist(), exp.tolist(), 4, 3)
    ok = routing_from_pairs(torch.tensor([0, 1, 1, 3, 4, 4]), torch.tensor([1, 0, 2, 0, 3, 3]), 4, 3,
                            token_major=True, padding=True, check=True)
    assert int(ok.expert_offsets[-1]) == 4


def test_routing_from_pairs_sizes_and_padding_without_tokens():
    """num_experts >= 1 and num_tokens >= 0 are checked (E = 0 built a routing of no expert whose pairs no row
    computes); with T = 0 and padding the padding pairs' rows read token 0, the documented value (not T − 1 = −1)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    tok, exp = torch.randint(0, 5, (7,), generator=g), torch.zeros(7, dtype=torch.long)
    for bad in (0, -1, True, 1.0):
        with pytest.raises(ValueError, match=f"num_experts must be an int >= 1, got {bad!r}"):
            routing_from_pairs(tok, exp, 5, bad)
    with pytest.raises(ValueError, match="num_tokens must be an int >= 0, got -1"):
        routing_from_pairs(tok, exp, -1, 3)
    e = int(torch.randint(1, 6, (), generator=g))
    n = int(torch.randint(1, 5, (), generator=g))
    pad_tok, pad_exp = torch.zeros(n, dtype=torch.long), torch.full((n,), e)
    for token_major in (False, True):
        r = routing_from_pairs(pad_tok, pad_exp, 0, e, padding=True, check=True, token_major=token_major)
        assert r.padded and r.num_rows == n
        assert r.row_token.tolist() == [0] * n
        assert r.expert_offsets.tolist() == [0] * (e + 1) and r.token_offsets.tolist() == [0]
        assert r.real_rows().tolist() == [False] * n and r.row_expert().tolist() == [e - 1] * n


@pytest.mark.parametrize("flag", ["token_major", "check", "padding"])
def test_routing_from_pairs_flags_must_be_bools(flag):
    """token_major, check and padding are bools: a string such as "False" read as True before, so unsorted pairs
    passed with token_major="False" were taken as sorted (wrong token slots; the Triton backend's output silently
    wrong) and padding="no" marked a routing padded."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    t, e = 6, 4
    tok, exp = torch.randperm(t, generator=g), torch.randint(0, e, (t,), generator=g)
    for value in ("False", "no", 0, None):
        with pytest.raises(ValueError, match=f"{flag} must be a bool"):
            routing_from_pairs(tok, exp, t, e, **{flag: value})
    r = routing_from_pairs(tok, exp, t, e, **{flag: False})
    check_routing(r, tok.tolist(), exp.tolist(), t, e)


def test_routing_from_pairs_refuses_indices_on_two_devices():
    """pair_token and pair_expert on different devices (the meta device stands in for a GPU): a ValueError naming both
    devices, before any sort or gather mixes them (torch's own error from inside named neither argument)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    tok, exp = torch.randint(0, 5, (6,), generator=g), torch.randint(0, 3, (6,), generator=g)
    for token_major in (False, True):
        with pytest.raises(ValueError, match="pair_expert is on meta but pair_token is on cpu"):
            routing_from_pairs(tok.sort().values, exp.to("meta"), 5, 3, token_major=token_major)
        with pytest.raises(ValueError, match="pair_expert is on cpu but pair_token is on meta"):
            routing_from_pairs(tok.to("meta"), exp, 5, 3, token_major=token_major)


def test_check_pairs_accepts_valid():
    tok, exp = random_pairs(9, 4, seed=1)
    assert check_pairs(tok, exp, 9, 4) is None
    empty = torch.empty(0, dtype=torch.long)
    assert check_pairs(empty, empty, 1, 1) is None


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.uint16, torch.uint32, torch.uint64])
def test_check_takes_narrow_and_unsigned_ids(dtype):
    """check=True on ids of any integer dtype: the routing of their int64 copies, and an out-of-range id named (torch
    has no min/max of uint16/32/64 on the CPU: a NotImplementedError from inside the check before)."""
    tok, exp = random_pairs(9, 4, seed=5)
    want = routing_from_pairs(tok, exp, 9, 4)
    got = routing_from_pairs(tok.to(dtype), exp.to(dtype), 9, 4, check=True)
    for name in ("expert_offsets", "row_token", "row_pair", "pair_row", "token_offsets", "token_rows"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    ids = torch.stack([tok, exp], 1)[:, :1] % 4
    assert torch.equal(routing_from_topk(ids.to(dtype), 4, check=True).row_pair, routing_from_topk(ids, 4).row_pair)
    bad = exp.clone()
    bad[3] = 4
    with pytest.raises(ValueError, match=r"pair_expert must lie in \[0, E=4\), got values in \[0, 4\]"):
        routing_from_pairs(tok.to(dtype), bad.to(dtype), 9, 4, check=True)


INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
                  torch.uint64)
NON_INTEGER_DTYPES = (torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
                      torch.float8_e5m2, torch.complex64, torch.complex128)


@pytest.mark.parametrize("dtype", INTEGER_DTYPES + NON_INTEGER_DTYPES)
def test_is_integer_dtype_over_every_dtype(dtype):
    """The one predicate behind the index TypeErrors: every signed and unsigned integer dtype is one; bool,
    floating-point (float8 included) and complex are not, and a pair index of that dtype is refused by name."""
    want = dtype in INTEGER_DTYPES
    assert is_integer_dtype(dtype) is want
    idx = torch.tensor([0, 1, 1]).to(dtype)
    if want:
        assert routing_from_pairs(idx, idx, 2, 2).expert_offsets.tolist() == [0, 1, 3]
    else:
        with pytest.raises(TypeError, match=rf"pair_token must be an integer tensor .*got {dtype}"):
            routing_from_pairs(idx, idx, 2, 2)


def test_routing_does_not_mutate_inputs():
    tok, exp = random_pairs(10, 5, seed=2)
    tok0, exp0 = tok.clone(), exp.clone()
    routing_from_pairs(tok, exp, 10, 5)
    routing_from_pairs(tok, exp, 10, 5, token_major=False)
    ids = random_topk_ids(6, 2, 5, seed=2)
    ids0 = ids.clone()
    routing_from_topk(ids, 5)
    assert torch.equal(tok, tok0) and torch.equal(exp, exp0) and torch.equal(ids, ids0)


def test_routing_cache_belongs_to_its_offsets_tensor():
    """Routing.cached returns what Routing.cache stored for this very ``expert_offsets`` tensor while it is unmodified:
    another tensor put in its place (same values, same version counter) or an in-place write misses; another key
    misses; a fresh store under the new tensor hits again."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(9)])
    r = routing_from_topk(ids, 6)
    table = object()
    r.cache("tiles", table)
    assert r.cached("tiles") is table and r.cached("order") is None
    other = r.expert_offsets.clone()
    assert other._version == r.expert_offsets._version and torch.equal(other, r.expert_offsets)
    r.expert_offsets = other
    assert r.cached("tiles") is None
    r.cache("tiles", table)
    assert r.cached("tiles") is table
    r.expert_offsets.add_(0)
    assert r.cached("tiles") is None


# ---------------------------------------------------------------------------------------------
# router_topk against a hand computation
# ---------------------------------------------------------------------------------------------


def hand_router(x, w, k, order, renormalize):
    """Per token, in float64 Python: logits, all-E softmax, chosen ids and scores."""
    xd, wd = x.double(), w.double()
    T, E = x.shape[0], w.shape[0]
    logits = [[float(torch.dot(xd[t], wd[e])) for e in range(E)] for t in range(T)]
    ids, scores, probs = [], [], []
    for t in range(T):
        lt = logits[t]
        m = max(lt)
        z = sum(math.exp(v - m) for v in lt)
        p = [math.exp(v - m) / z for v in lt]
        chosen = sorted(range(E), key=lambda e, lt=lt: -lt[e])[:k]
        if order == "topk_then_softmax":
            mc = max(lt[e] for e in chosen)
            zc = sum(math.exp(lt[e] - mc) for e in chosen)
            s = [math.exp(lt[e] - mc) / zc for e in chosen]
        else:
            s = [p[e] for e in chosen]
            if renormalize:
                tot = sum(s)
                s = [v / tot for v in s]
        ids.append(chosen)
        scores.append(s)
        probs.append(p)
    f64 = torch.float64
    return (torch.tensor(logits, dtype=f64), torch.tensor(probs, dtype=f64), torch.tensor(ids),
            torch.tensor(scores, dtype=f64))


ORDERS = [("topk_then_softmax", False), ("softmax_then_topk", False), ("softmax_then_topk", True)]


@pytest.mark.parametrize("order,renorm", ORDERS)
@pytest.mark.parametrize("T,d,E,K", [(1, 4, 3, 1), (13, 8, 6, 2), (9, 5, 4, 4), (20, 16, 8, 3)])
def test_router_topk_matches_hand(order, renorm, T, d, E, K):
    g = torch.Generator().manual_seed(T * 7 + E)
    x = torch.randn(T, d, generator=g)
    w = torch.randn(E, d, generator=g) * d**-0.5
    out = router_topk(x, w, K, router_order=order, renormalize=renorm)
    logits, probs, ids, scores = hand_router(x, w, K, order, renorm)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (T, E)
    assert out.probs.shape == (T, E) and out.topk_ids.shape == (T, K) and out.topk_scores.shape == (T, K)
    assert out.topk_ids.dtype == torch.int64
    torch.testing.assert_close(out.logits.double(), logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.probs.double(), probs, rtol=1e-5, atol=1e-7)
    assert torch.equal(out.topk_ids, ids)
    torch.testing.assert_close(out.topk_scores.double(), scores, rtol=1e-5, atol=1e-7)
    if order == "topk_then_softmax" or renorm:
        torch.testing.assert_close(out.topk_scores.sum(-1), torch.ones(T), rtol=0, atol=1e-6)
    elif K < E:
        assert bool((out.topk_scores.sum(-1) < 1 - 1e-6).all())


def test_router_probs_of_the_sigmoid_order_and_kept_once_computed():
    """RouterOutput.probs, computed on first access where the router did not need it: under "sigmoid_then_topk" the
    sigmoids normalised to sum 1 over E (DeepSeek-V3's balance loss), else the softmax over E, each against a float64
    hand computation; the tensor is kept (a second access returns the same one, with no second (T, E) softmax)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    T, d, E, K = 11, 8, 6, 2
    x, w = torch.randn(T, d, generator=g), torch.randn(E, d, generator=g) * d**-0.5
    logits = hand_router(x, w, K, "topk_then_softmax", False)[0]
    sig = 1 / (1 + torch.exp(-logits))
    expected = {"sigmoid_then_topk": sig / sig.sum(dim=1, keepdim=True), "topk_then_softmax": torch.softmax(logits, 1)}
    for order, want in expected.items():
        out = router_topk(x, w, K, router_order=order, use_kernel=False)
        assert out._probs is None  # lazy: neither order needs the (T, E) probabilities to choose
        assert repr(out) == f"RouterOutput(logits=({T}, {E}), topk_ids=({T}, {K}), probs=on first access)"
        probs = out.probs
        assert out.probs is probs
        assert repr(out) == f"RouterOutput(logits=({T}, {E}), topk_ids=({T}, {K}), probs=computed)"
        torch.testing.assert_close(probs.double(), want, rtol=1e-5, atol=1e-7)


def test_router_topk_renormalize_ignored_for_topk_then_softmax_and_equivalence():
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(10, 6, generator=g), torch.randn(5, 6, generator=g)
    a = router_topk(x, w, 2, router_order="topk_then_softmax", renormalize=False)
    b = router_topk(x, w, 2, router_order="topk_then_softmax", renormalize=True)
    c = router_topk(x, w, 2, router_order="softmax_then_topk", renormalize=True)
    assert torch.equal(a.topk_scores, b.topk_scores)
    # softmax over all E, top-k, renormalised == softmax over the K chosen logits
    assert torch.equal(a.topk_ids, c.topk_ids)
    torch.testing.assert_close(a.topk_scores, c.topk_scores, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="renormalize must be a bool, got 'no'"):  # read as True before
        router_topk(x, w, 2, router_order="softmax_then_topk", renormalize="no")
    with pytest.raises(ValueError, match="use_kernel must be a bool, got 0"):  # 0 took the kernel on CUDA
        router_topk(x, w, 2, use_kernel=0)


def test_router_topk_low_precision_inputs_compute_in_float32():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(7, 8, generator=g), torch.randn(4, 8, generator=g)
    xb, wb = x.bfloat16(), w.bfloat16()
    out = router_topk(xb, wb, 2)
    assert out.logits.dtype == torch.float32 and out.topk_scores.dtype == torch.float32
    ref = router_topk(xb.float(), wb.float(), 2)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.topk_scores, ref.topk_scores)


@pytest.mark.parametrize("order,renorm", ORDERS)
def test_router_topk_gradcheck(order, renorm):
    g = torch.Generator().manual_seed(21)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    logits = (x @ w.t()).detach().sort(dim=-1, descending=True).values
    assert float((logits[:, 2] - logits[:, 3]).abs().min()) > 1e-3  # top-3 selection stable under eps

    def f(x, w):
        return router_topk(x, w, 3, router_order=order, renormalize=renorm).topk_scores

    assert f(x, w).dtype == torch.float64
    assert torch.autograd.gradcheck(f, (x, w))


def test_expert_groups_accepted_exactly_when_they_can_hold_k():
    """check_expert_groups against its rule, written out, for every small (E, n_group, topk_group, K): groups only
    under sigmoid_then_topk, n_group dividing E into groups of at least two experts (a group scores its two largest
    keys), 1 <= topk_group <= n_group, K <= topk_group · E/n_group; and the boundary cases the rule accepts route
    each token to K distinct experts within its topk_group groups."""
    from sonicmoe.routing import check_expert_groups

    def ok(e, ng, tg, k, order):
        if ng == 1:
            return tg == 1
        return (order == "sigmoid_then_topk" and e % ng == 0 and e // ng >= 2 and tg <= ng
                and k <= tg * (e // ng))

    accepted = []
    for order in ("sigmoid_then_topk", "softmax_then_topk"):
        for e in range(1, 13):
            for ng in range(1, e + 2):
                for tg in range(1, ng + 2):
                    for k in range(1, e + 1):
                        if ok(e, ng, tg, k, order):
                            check_expert_groups(ng, tg, e, k, order)
                            accepted.append((e, ng, tg, k))
                        else:
                            with pytest.raises(ValueError, match="n_group|topk_group"):
                                check_expert_groups(ng, tg, e, k, order)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    for e, ng, tg, k in ((12, 6, 2, 4), (12, 3, 3, 12), (8, 4, 1, 2), (6, 3, 2, 4)):  # groups of two, all kept, ...
        assert (e, ng, tg, k) in accepted
        x, w = torch.randn(9, 5, generator=g), torch.randn(e, 5, generator=g)
        ids = router_topk(x, w, k, router_order="sigmoid_then_topk", n_group=ng, topk_group=tg).topk_ids
        assert ids.shape == (9, k) and bool((ids.sort(1).values.diff(1) > 0).all())
        assert all(len(set((row // (e // ng)).tolist())) <= tg for row in ids)


@pytest.mark.parametrize("arg", ["n_group", "topk_group"])
def test_expert_groups_refuse_bools(arg):
    """n_group and topk_group are ints: True (which equals 1, no groups) is refused, by the check and the router, with a
    ValueError naming the argument, as the layer's sizes refuse it."""
    from sonicmoe.routing import check_expert_groups

    kw = {"n_group": 1, "topk_group": 1, arg: True}
    with pytest.raises(ValueError, match=f"{arg} must be a positive int, got True"):
        check_expert_groups(kw["n_group"], kw["topk_group"], 4, 2, "sigmoid_then_topk")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x, w = torch.randn(5, 8, generator=g), torch.randn(4, 8, generator=g)
    with pytest.raises(ValueError, match=f"{arg} must be a positive int"):
        router_topk(x, w, 2, router_order="sigmoid_then_topk", **kw)


# ---------------------------------------------------------------------------------------------
# auxiliary losses
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("E,K,per_expert", [(4, 1, 3), (8, 2, 2), (5, 5, 1), (1, 1, 4)])
def test_load_balancing_loss_is_one_when_uniform(E, K, per_expert):
    T = E * per_expert
    # token t picks experts t, t+1, ..., t+K-1 (mod E): every expert gets exactly K*per_expert pairs
    ids = (torch.arange(T)[:, None] + torch.arange(K)[None, :]) % E
    r = routing_from_topk(ids, E)
    assert r.expert_counts().tolist() == [K * per_expert] * E
    probs = torch.full((T, E), 1.0 / E)
    loss = load_balancing_loss(probs, r)
    assert loss.shape == ()
    assert abs(loss.item() - 1.0) < 1e-6


def test_load_balancing_loss_collapsed_routing_is_E():
    E, T = 6, 10
    r = routing_from_topk(torch.zeros(T, 1, dtype=torch.long), E)
    probs = torch.zeros(T, E)
    probs[:, 0] = 1.0
    assert abs(load_balancing_loss(probs, r).item() - E) < 1e-6


def test_load_balancing_loss_formula_and_gradient():
    g = torch.Generator().manual_seed(9)
    T, E = 12, 5
    tok, exp = random_pairs(T, E, seed=9, p_keep=0.5)
    r = routing_from_pairs(tok, exp, T, E)
    probs = torch.softmax(torch.randn(T, E, generator=g, dtype=torch.float64), -1).requires_grad_()
    loss = load_balancing_loss(probs, r)
    counts = torch.bincount(exp, minlength=E).double()
    f = counts / counts.sum()
    expected = E * sum(f[e] * probs[:, e].mean() for e in range(E))
    assert abs(loss.item() - expected.item()) < 1e-6  # f_e is computed in float32
    loss.backward()
    # f is not differentiated: dloss/dprobs[t, e] = E * f_e / T
    torch.testing.assert_close(probs.grad, (E * f / T).expand(T, E), rtol=1e-6, atol=0)


def test_losses_finite_for_empty_batch():
    E = 4
    r = routing_from_topk(torch.empty(0, 2, dtype=torch.long), E)
    lb = load_balancing_loss(torch.empty(0, E), r)
    zl = z_loss(torch.empty(0, E))
    assert lb.item() == 0.0 and zl.item() == 0.0


def test_losses_of_float16_router_outputs_do_not_overflow():
    """Float16 logits or probabilities (a user's own router under float16 autocast) are accepted; the losses are
    computed in float32: z-loss squares logsumexps (256² > 65504 overflows float16) and sums them over tokens, and
    the balance loss sums probabilities over T > 65504 tokens (both gave inf before session 89)."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(1000, 8, generator=g) + 10).half()
    lse = torch.logsumexp(logits.double(), dim=-1)
    got = z_loss(logits)
    assert got.dtype == torch.float32 and torch.isfinite(got)
    assert abs(float(got) - float(lse.square().mean())) < 1e-5 * float(lse.square().mean())
    big = torch.full((1, 4), 300.0, dtype=torch.float16)
    assert abs(float(z_loss(big)) - (300 + math.log(4)) ** 2) < 1e-3 * 300 ** 2
    t, e = 70000, 8  # every token on expert 0 with probability 1: P_0 sums 70000 > 65504 probabilities; loss = E
    probs = torch.zeros(t, e, dtype=torch.float16)
    probs[:, 0] = 1
    lb = load_balancing_loss(probs, routing_from_topk(torch.zeros(t, 1, dtype=torch.long), e))
    assert lb.dtype == torch.float32 and float(lb) == e


def test_load_balancing_loss_of_float64_probs_and_its_routing_argument():
    """float64 probabilities give the loss in float64, equal to a float64 Python computation E · Σ_e f_e · P_e to
    float64 rounding (float32 would be off by ~1e-8); a routing that is not a Routing is a TypeError naming it."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    t, k, e = 13, 3, 7
    probs = torch.softmax(torch.randn(t, e, generator=g, dtype=torch.float64) * 2, dim=1)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    counts = [sum(int(v == j) for v in ids.reshape(-1).tolist()) for j in range(e)]
    rows = probs.tolist()
    want = e * sum(counts[j] / (t * k) * sum(row[j] for row in rows) / t for j in range(e))
    got = load_balancing_loss(probs, routing_from_topk(ids, e))
    assert got.dtype == torch.float64 and abs(float(got) - want) < 1e-13 * want
    for bad in (None, ids, (probs, ids)):
        with pytest.raises(TypeError, match="routing must be a sonicmoe.Routing, got"):
            load_balancing_loss(probs, bad)


def test_z_loss_formula():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 5, generator=g) * 3
    lse = [math.log(sum(math.exp(v) for v in row)) for row in logits.double().tolist()]
    expected = sum(v * v for v in lse) / len(lse)
    assert abs(z_loss(logits).item() - expected) < 1e-5 * expected
    # numerically stable for large logits: logsumexp(1000 + l) = 1000 + logsumexp(l)
    big = z_loss(logits + 1000.0)
    expected_big = sum((1000.0 + v) ** 2 for v in lse) / len(lse)
    assert math.isfinite(big.item()) and abs(big.item() - expected_big) < 1e-5 * expected_big


def test_z_loss_gradient():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    z_loss(logits).backward()
    # d/dl mean_t lse_t^2 = 2 lse_t softmax(l_t) / T
    lse = torch.logsumexp(logits.detach(), -1, keepdim=True)
    expected = 2 * lse * torch.softmax(logits.detach(), -1) / 4
    torch.testing.assert_close(logits.grad, expected, rtol=1e-12, atol=0)


def test_take_chosen_under_compile_is_gather():
    """routing.take_chosen: the one-hot select-and-sum it runs under torch.compile on CPU (an Inductor workaround,
    session 86) gives gather's values and gradients, NaN and ±inf included (a −0.0 entry reads +0.0: equal, not the same
    bits); eager it is gather, bit for bit."""
    from sonicmoe.routing import take_chosen

    torch.manual_seed(0)
    values = torch.randn(6, 5)
    values[0, 1], values[1, 2], values[2, 3], values[3, 0] = -0.0, float("nan"), float("inf"), -float("inf")
    ids = torch.tensor([[1, 0], [2, 4], [3, 1], [0, 4], [4, 3], [2, 1]])
    weights = torch.randn(6, 2)
    got = []
    for fn in (torch.compile(take_chosen, fullgraph=True, backend="aot_eager"), lambda v, i: v.gather(1, i)):
        v = values.clone().requires_grad_(True)
        out = fn(v, ids)
        (out * weights).sum().backward()
        got.append((out.detach(), v.grad))
    assert torch.equal(got[0][0].isnan(), got[1][0].isnan())
    assert torch.equal(got[0][0].nan_to_num(), got[1][0].nan_to_num())
    assert got[1][0][0, 0].signbit() and got[0][0][0, 0] == 0
    assert torch.equal(got[0][1], got[1][1])
    eager = take_chosen(values, ids)
    assert torch.equal(eager.signbit(), values.gather(1, ids).signbit())
    assert torch.equal(eager.nan_to_num(), values.gather(1, ids).nan_to_num())
