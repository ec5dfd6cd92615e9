"""Top-k routing by the counting-sort kernels (sonicmoe.ops.topk_routing) against the torch twin
(routing_from_topk_ref): through the Triton interpreter on CPU (the ``device`` fixture), natively on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sonicmoe.ops import topk_routing as tkr
from sonicmoe.routing import routing_from_topk, routing_from_topk_ref

REPO = Path(__file__).resolve().parents[1]
FIELDS = ("expert_offsets", "row_token", "row_pair", "pair_row", "token_offsets", "token_rows")


def _ids(t, k, e, seed, device, dtype=torch.int64):
    """(T, K) distinct experts per token, drawn at random (each row the first K of a random permutation),
    contiguous."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].to(device=device, dtype=dtype).contiguous()


def _poisoned(monkeypatch):
    """Every int32 buffer the launcher allocates filled with -7 first (no output left unwritten by accident)."""
    empty = torch.empty

    def poisoned(*a, **kw):
        out = empty(*a, **kw)
        if out.dtype == torch.int32:
            out.fill_(-7)
        return out

    monkeypatch.setattr(tkr.torch, "empty", poisoned)


def _assert_equal(a, b):
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == torch.int32 and x.shape == y.shape and torch.equal(x, y), name
    assert (a.num_tokens, a.num_experts, a.padded, a.slot_pair) == (b.num_tokens, b.num_experts, b.padded, None)


@pytest.mark.parametrize("t,k,e", [
    (1, 1, 1),  # one pair, one expert (E_P2 = 1)
    (1, 4, 4),  # T = 1, K = E
    (7, 7, 7),  # K = E, E not a power of two
    (37, 3, 16),  # R not a block multiple
    (300, 8, 128),  # several blocks (BLOCK = 256 at E = 128)
    (5000, 2, 5),  # E tiny: blocks of 4096 pairs, three of them
    (700, 6, 33),  # E just past a power of two
    (90, 2, 256),  # E at the dispatch's limit: blocks of 32 pairs
    (90, 2, 512),  # past it (routing_from_topk takes the twin), still right: blocks of 16 pairs
])
def test_counting_sort_equals_torch(device, monkeypatch, t, k, e):
    """Every routing tensor bit for bit the torch twin's (a stable sort by expert), with the outputs poisoned first,
    for edge shapes: T = 1, K = 1, K = E, E = 1, E not a power of two, R not a multiple of the block."""
    ids = _ids(t, k, e, t * 1000 + e, device)
    _poisoned(monkeypatch)
    _assert_equal(tkr.topk_routing(ids, e), routing_from_topk_ref(ids, e))


def test_column_scan_carries_across_chunks(device, monkeypatch):
    """More blocks than the column scan takes in one step: with SCAN_ROWS lowered to 4, 38 blocks of 64 pairs (E =
    128) take 10 steps, each carrying the sums of the steps before into its blocks' first rows (at the 7B size on a
    GPU: 3072 blocks in 12 steps of 256). The twin's tensors, with the outputs poisoned."""
    monkeypatch.setattr(tkr, "SCAN_ROWS", 4)
    ids = _ids(300, 8, 128, 9, device)
    _poisoned(monkeypatch)
    _assert_equal(tkr.topk_routing(ids, 128), routing_from_topk_ref(ids, 128))


@pytest.mark.interpreter
@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 600), e=st.integers(1, 200), data=st.data())
def test_counting_sort_fuzz(t, e, data):
    """Random T, E and K in [1, E], int32 or int64 ids, a non-contiguous view (a column slice) too: the torch twin's
    tensors."""
    k = data.draw(st.integers(1, min(e, 9)))
    ids = _ids(t, k, e, data.draw(st.integers(0, 10**6)), "cpu", data.draw(st.sampled_from([torch.int32,
                                                                                             torch.int64])))
    if data.draw(st.booleans()):  # the first K columns of (T, K + 1) ids: strides (K + 1, 1)
        ids = torch.cat([ids, ids[:, :1]], dim=1)[:, :k]
    _assert_equal(tkr.topk_routing(ids, e), routing_from_topk_ref(ids, e))


def test_strided_ids(device):
    """K = 1 ids sliced from a wider tensor flatten to a strided view (stride 3): read through a copy, they give the
    twin's routing."""
    ids = _ids(100, 3, 9, 5, device)[:, 1:2]
    assert ids.reshape(-1).stride() == (3,)
    _assert_equal(tkr.topk_routing(ids, 9), routing_from_topk_ref(ids, 9))


@pytest.mark.parametrize("e", [12, 16])
def test_outside_ids_stay_in_bounds(device, monkeypatch, e):
    """Ids outside [0, E) (a broken promise) get the rows after every expert's, in pair order: the rows are the
    stable sort of the ids with those replaced by E, so every index stays in [0, R), and expert_offsets counts only
    the valid pairs. At E = 16, a multiple of the column scan's 16 columns, the outside column E is the first of a
    second scan program (the buffers poisoned: a column left unscanned shows); two blocks of 512 pairs."""
    t, k = 200, 4
    ids = _ids(t, k, e, 3, device)
    ids[5, 1], ids[77, 0], ids[150, 3] = e, -1, e + 40
    _poisoned(monkeypatch)
    got = tkr.topk_routing(ids, e)
    flat = ids.reshape(-1)
    bucket = torch.where((flat >= 0) & (flat < e), flat, e)
    order = torch.sort(bucket, stable=True).indices.to(torch.int32)
    assert torch.equal(got.row_pair, order)
    assert torch.equal(got.pair_row[order.long()], torch.arange(t * k, device=device, dtype=torch.int32))
    assert torch.equal(got.row_token, order // k)
    assert int(got.expert_offsets[e]) == t * k - 3
    assert got.row_pair[-3:].tolist() == [5 * k + 1, 77 * k + 0, 150 * k + 3]


def test_dispatch(monkeypatch):
    """routing_from_topk takes the kernels on CUDA only, with SONICMOE_ROUTING_KERNEL=1 (the torch twin on CPU, for
    E above 256, without it), and checks its arguments the same way either way."""
    ids = _ids(50, 2, 8, 0, "cpu")
    calls = []
    monkeypatch.setattr(tkr, "topk_routing", lambda *a: calls.append(a))
    monkeypatch.setitem(os.environ, "SONICMOE_ROUTING_KERNEL", "1")
    _assert_equal(routing_from_topk(ids, 8), routing_from_topk_ref(ids, 8))  # CPU ids: the twin, switch or not
    assert not calls
    assert not tkr.counting_sort_applies(ids, 257) and tkr.counting_sort_applies(ids, 256)
    assert not tkr.counting_sort_applies(ids[:0], 8)
    # R = T·K below 2^27 only (an expanded view: no memory behind its 2^27 elements)
    assert tkr.counting_sort_applies(torch.zeros(1, 1, dtype=torch.int32).expand(2**27 - 1, 1), 8)
    assert not tkr.counting_sort_applies(torch.zeros(1, 1, dtype=torch.int32).expand(2**20, 2**7), 8)
    for fn in (routing_from_topk, routing_from_topk_ref):
        with pytest.raises(ValueError, match="topk_ids must have shape"):
            fn(ids.reshape(-1), 8)
        with pytest.raises(TypeError, match="integer"):
            fn(ids.float(), 8)
        with pytest.raises(ValueError, match="num_experts"):
            fn(ids, 0)


_OFFLINE = """
import json, runpy, sys, torch
report = runpy.run_path("benchmarks/resource_report.py")
report["_install"](int(sys.argv[1]))
from sonicmoe.ops import topk_routing
out = []
for t, k, e in [(24576, 8, 128), (8192, 8, 256), (4096, 2, 64), (4096, 4, 5)]:
    report["_COMPILED"].clear()
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(64)]).repeat(t // 64, 1)
    try:
        topk_routing.topk_routing(ids, e)
    except Exception:
        pass  # compiled, never launched: what follows the launches may fail on CPU tensors
    out += [[t, k, e, c.metadata.name, report["resources"](c)] for c in report["_COMPILED"]]
print(json.dumps(out))
"""


@pytest.mark.parametrize("arch", [90, 80])
def test_kernels_compile_without_spills(arch):
    """The three kernels compile offline (resource_report.py's driver, no GPU) for sm_90 and sm_80 at E = 128, 256,
    64 and 5, with no spilled registers (STACK and LOCAL zero)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _OFFLINE, str(arch)], capture_output=True, text=True, timeout=900,
                         cwd=REPO, env={**env, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = json.loads(run.stdout.strip().splitlines()[-1])
    names = [c[3] for c in compiled]
    assert len(compiled) == 12 and set(names) == {"_block_counts_kernel", "_column_scan_kernel",
                                                  "_scatter_rows_kernel"}, names
    for t, k, e, name, res in compiled:
        assert res["stack"] == 0 and res["local"] == 0 and res["reg"] <= 255, (t, k, e, name, res)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e", [(24576, 8, 128), (32768, 8, 128), (32768, 8, 256), (8193, 2, 64)])
def test_gpu_counting_sort_at_benchmark_sizes(monkeypatch, t, k, e):
    """At benchmark sizes on the GPU, routing_from_topk with SONICMOE_ROUTING_KERNEL=1 (the kernels) equals the
    torch twin bit for bit, twice the same; unset or 0 takes the twin."""
    ids = _ids(t, k, e, 1, "cuda")
    ref = routing_from_topk_ref(ids, e)
    monkeypatch.setitem(os.environ, "SONICMOE_ROUTING_KERNEL", "1")
    got = routing_from_topk(ids, e)
    _assert_equal(got, ref)
    _assert_equal(routing_from_topk(ids, e), got)
    calls = []
    real = tkr.topk_routing
    monkeypatch.setattr(tkr, "topk_routing", lambda *a: calls.append(a) or real(*a))
    routing_from_topk(ids, e)
    assert len(calls) == 1
    for value in ("0", None):
        if value is None:
            monkeypatch.delitem(os.environ, "SONICMOE_ROUTING_KERNEL")
        else:
            monkeypatch.setitem(os.environ, "SONICMOE_ROUTING_KERNEL", value)
        _assert_equal(routing_from_topk(ids, e), ref)
    assert len(calls) == 1


@pytest.mark.gpu
def test_gpu_layer_same_bits_either_routing(monkeypatch):
    """The bf16 top-k layer at a 7B-like width: output and every gradient with the counting sort's routing have the
    bits of the torch routing's."""
    torch.manual_seed(0)
    t, d, n, e, k = 4096, 1536, 256, 128, 8
    import sonicmoe

    m = sonicmoe.MoE(d, n, e, k, backend="triton", device="cuda", dtype=torch.bfloat16)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(x)
    res = []
    for value in ("0", "1"):
        monkeypatch.setitem(os.environ, "SONICMOE_ROUTING_KERNEL", value)
        m.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_(True)
        y = m(leaf)
        (y.float() * dout.float()).sum().add(m.aux_loss).backward()
        res.append([y.detach(), leaf.grad, *(p.grad for p in m.parameters())])
    for a, b in zip(*res):
        assert torch.isfinite(a).all() and torch.equal(a, b)
