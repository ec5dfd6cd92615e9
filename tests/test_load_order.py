"""The experts' load order (sonicmoe.ops.load_order), which the weight gradients take their tiles in: the kernel
against its torch twin (a stable descending sort), through the Triton interpreter on CPU and natively on a GPU, and
the per-Routing cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sonicmoe.ops.load_order import (
    expert_load_order,
    expert_load_order_ref,
    routing_load_order,
    wgrad_order_by_load,
)
from sonicmoe.routing import routing_from_pairs

pytestmark = pytest.mark.interpreter


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")


def _offsets(counts, device):
    c = torch.tensor(counts, dtype=torch.int32)
    return torch.cat([torch.zeros(1, dtype=torch.int32), c.cumsum(0).to(torch.int32)]).to(device)


@pytest.mark.parametrize("e, high", [(1, 5), (5, 3), (33, 4), (300, 40), (257, 1)],
                         ids=["one-expert", "ties", "two-programs", "column-steps", "all-tied-or-empty"])
def test_load_order_matches_stable_sort(e, high, device):
    """Busiest first, ties by index, with empty experts and many ties (``high`` small); more than BLOCK_E experts
    (several programs) and more than BLOCK_C (several column steps, a partial last one). The order is a
    permutation, its counts descend, ties keep index order, and the second half inverts the first."""
    g = torch.Generator().manual_seed(e)
    counts = torch.randint(0, high + 1, (e,), generator=g).tolist()
    got = expert_load_order(_offsets(counts, device)).cpu()
    assert got.dtype == torch.int32 and got.shape == (2 * e,)  # torch.equal would pass an int64 result
    assert torch.equal(got, expert_load_order_ref(_offsets(counts, "cpu")))
    order, rank = got[:e].long(), got[e:].long()
    assert torch.equal(torch.sort(order).values, torch.arange(e))
    c = torch.tensor(counts)[order]
    assert bool((c[:-1] >= c[1:]).all())
    ties = c[:-1] == c[1:]
    assert bool((order[:-1][ties] < order[1:][ties]).all())
    assert torch.equal(rank[order], torch.arange(e))


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=600), scale=st.sampled_from([1, 7, 1000]))
def test_load_order_fuzz(counts, scale):
    """Any E up to 600 (several programs and column steps) and counts with many ties (values 0-5, scaled so that
    counts reach 5000 rows): the kernel's order and ranks are those of the stable sort."""
    offsets = _offsets([c * scale for c in counts], "cpu")
    assert torch.equal(expert_load_order(offsets), expert_load_order_ref(offsets))


def test_load_order_no_experts_and_bad_offsets(device):
    assert expert_load_order(torch.zeros(1, dtype=torch.int32, device=device)).numel() == 0
    for bad in (torch.zeros(4, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int32),
                torch.zeros(0, dtype=torch.int32)):
        with pytest.raises(ValueError, match="expert_offsets"):
            expert_load_order(bad.to(device))


def test_load_order_refuses_offsets_off_the_device(monkeypatch):
    """Offsets where no kernel runs (a meta tensor; a CPU tensor outside the interpreter) raise before any launch, a
    ValueError naming ``expert_offsets`` and its device."""
    from sonicmoe.ops import common

    with pytest.raises(ValueError, match="expert_offsets is on meta; the triton backend needs CUDA"):
        expert_load_order(torch.zeros(4, dtype=torch.int32, device="meta"))
    monkeypatch.setattr(common, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="expert_offsets is on cpu; the triton backend needs CUDA"):
        expert_load_order(_offsets([3, 1, 2], "cpu"))


def test_routing_load_order_cached_and_switched(device, monkeypatch):
    """The load order is built once per Routing (dW1 and dW2 share it) and again when ``expert_offsets`` is modified
    in place. SONICMOE_WGRAD_ORDER: unset is index order, ``load`` the load order, another value an error naming
    the variable."""
    counts = [2, 7, 0, 7, 3]
    e = len(counts)
    tok = torch.cat([torch.arange(c) for c in counts])
    exp = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    routing = routing_from_pairs(tok.to(device), exp.to(device), 8, e)
    monkeypatch.delenv("SONICMOE_WGRAD_ORDER", raising=False)
    assert not wgrad_order_by_load()
    monkeypatch.setenv("SONICMOE_WGRAD_ORDER", "load")
    assert wgrad_order_by_load()
    first = routing_load_order(routing)
    assert first.cpu()[:e].tolist() == [1, 3, 4, 0, 2]
    assert routing_load_order(routing) is first
    routing.expert_offsets.copy_(_offsets([7, 2, 0, 7, 3], device))
    assert routing_load_order(routing).cpu()[:e].tolist() == [0, 3, 4, 1, 2]
    monkeypatch.setenv("SONICMOE_WGRAD_ORDER", "expert")
    assert not wgrad_order_by_load()
    monkeypatch.setenv("SONICMOE_WGRAD_ORDER", "busiest")
    with pytest.raises(ValueError, match="SONICMOE_WGRAD_ORDER"):
        wgrad_order_by_load()


def test_routing_load_order_under_inference_mode(device):
    """A routing made under torch.inference_mode (no version counter on its tensors): the load order is built and
    cached (reading the counter raised)."""
    with torch.inference_mode():
        routing = routing_from_pairs(torch.tensor([0, 1, 2], device=device), torch.tensor([1, 1, 0], device=device),
                                     3, 2)
        first = routing_load_order(routing)
        assert routing_load_order(routing) is first and first.cpu()[:2].tolist() == [1, 0]


@pytest.mark.parametrize("bias", [False, True])
def test_layer_gradients_same_bits_in_either_order(bias, device, monkeypatch):
    """The expert layer's forward+backward (backend triton) on a skewed routing, with the weight gradients in load
    order and in expert order: every gradient bitwise the same (dW1, dW2 and, with biases, db1, db2 run through the
    varlen-K kernel; dX and the scores' gradient must not change either), and within rounding of the float32
    reference."""
    from sonicmoe import functional
    from sonicmoe.reference import experts_ref
    from sonicmoe.testing import random_problem, rel_err

    t, d, n, e = 48, 32, 24, 6
    p = random_problem(t, d, n, e, bias=bias, device=device, seed=7)
    g = torch.Generator().manual_seed(7)
    counts = [40, 0, 3, 17, 48, 9]  # not descending: load order differs from expert order; an empty expert
    tok = torch.cat([torch.randperm(t, generator=g)[:c] for c in counts])
    exp = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    routing = routing_from_pairs(tok.to(device), exp.to(device), t, e)
    scores = torch.rand(routing.num_rows, generator=g).to(device)
    dout = torch.randn(t, d, generator=g).to(device)
    names = ["x", "w1", "w2", "b1", "b2"] if bias else ["x", "w1", "w2"]
    grads = {}
    for order in ("load", "expert"):
        monkeypatch.setenv("SONICMOE_WGRAD_ORDER", order)
        leaves = {k: p[k].detach().clone().requires_grad_(True) for k in names}
        s = scores.clone().requires_grad_(True)
        out = functional.experts(leaves["x"], leaves["w1"], leaves["w2"], routing, s, b1=leaves.get("b1"),
                                 b2=leaves.get("b2"), backend="triton")
        out.backward(dout)
        grads[order] = [leaves[k].grad for k in names] + [s.grad]
    for a, b in zip(grads["load"], grads["expert"], strict=True):
        assert torch.equal(a, b)
    # the float64 loop over experts (reference.experts_ref) on the same routing and scores
    leaves = {k: p[k].detach().double().requires_grad_(True) for k in names}
    s = scores.double().requires_grad_(True)
    experts_ref(leaves["x"], leaves["w1"], leaves["w2"], routing, s, leaves.get("b1"), leaves.get("b2")).backward(
        dout.double())
    for name, got, want in zip(names + ["scores"], grads["load"], [leaves[k].grad for k in names] + [s.grad],
                               strict=True):
        assert rel_err(got, want) < 1e-5, name


def test_strided_offsets(device):
    """A strided (E+1,) view of the offsets (a hand-built Routing's): the kernel read it as contiguous before
    session 82 and ranked the wrong counts."""
    base = torch.tensor([0, 0, 1, 0, 1, 0, 9, 0, 10, 0], dtype=torch.int32, device=device)
    offs = base[::2]  # [0, 1, 1, 9, 10]: counts [1, 0, 8, 1]
    assert not offs.is_contiguous()
    assert torch.equal(expert_load_order(offs), expert_load_order_ref(offs.contiguous()))
    assert expert_load_order(offs)[:4].tolist() == [2, 0, 3, 1]
