"""Property-based fuzzing of the triton backend against the float32 reference (hypothesis).

Each example draws a shape (T tokens, hidden size d, expert width n, E experts, K per token) and a
routing — plain top-k, or general routing with a variable number of experts per token, tokens with
none, empty experts, or every token on one expert — then compares the triton backend's output O (T, d)
and the gradients of X (T, d), W1 (E, 2n, d), W2 (E, d, n), b1 (E, 2n), b2 (E, d) and the pair scores
S (R,) with :func:`sonicmoe.experts_ref`. On CPU the kernels run in float32 through Triton's
interpreter (few, small examples); the GPU test runs larger bf16 problems and bounds the error by the
torch backend's bf16 error.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import sonicmoe
from sonicmoe.reference import swiglu_ref
from sonicmoe.routing import routing_from_pairs, routing_from_topk
from sonicmoe.testing import random_problem, rel_err

DIMS = [8, 16, 24, 32, 40, 48]  # d and n: multiples of 8, not all powers of two (24, 40, 48)
ROUTINGS = ["topk", "general", "one_expert", "skewed"]
GRAD_NAMES = ("x", "w1", "w2", "b1", "b2", "scores")


pytestmark = pytest.mark.usefixtures("poisoned_outputs")  # every kernel output NaN until written (conftest.py)


@dataclasses.dataclass
class Case:
    t: int  # T
    d: int
    n: int
    e: int  # E
    k: int  # K (top-k; for general routings the mean experts per token is random)
    routing: str
    keep: float  # general: probability that a (token, expert) pair is routed
    token_major: bool  # pairs given in token order (else shuffled: slot_pair is set)
    bias: bool
    layout: str
    seed: int


def _pairs_per_token(routing: str, e: int, k: int) -> int:
    """Most pairs one token can have under the routing kind (bounds R = T · this)."""
    return {"topk": k, "one_expert": 1}.get(routing, e)


@st.composite
def cases(draw, t_max=40, dims=DIMS, e_max=9, work_max=None):
    """A Case. ``work_max`` bounds R·(d + n) (R at most T · pairs per token): the interpreter's time
    grows with it, so the CPU fuzz caps the largest draws (T = 40 with E = K = 9 and d = n = 48)."""
    e = draw(st.integers(1, e_max))
    k = draw(st.integers(1, e))
    routing = draw(st.sampled_from(ROUTINGS))
    d, n = draw(st.sampled_from(dims)), draw(st.sampled_from(dims))
    if work_max is not None:
        t_max = max(1, min(t_max, work_max // (_pairs_per_token(routing, e, k) * (d + n))))
    return Case(
        t=draw(st.integers(1, t_max)), d=d, n=n, e=e, k=k, routing=routing,
        keep=draw(st.sampled_from([0.0, 0.15, 0.5, 1.0])), token_major=draw(st.booleans()),
        bias=draw(st.booleans()), layout=draw(st.sampled_from(["concat", "interleaved"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make_routing(c: Case, device):
    """Routing and (R,) scores for the case. general: each pair kept with probability ``keep`` (tokens
    with none, empty experts, any number of experts per token); one_expert: every token on one expert;
    skewed: every token on expert 0 plus top-k-like extra pairs on the others."""
    g = torch.Generator().manual_seed(c.seed)
    t, e = c.t, c.e
    if c.routing == "topk":
        ids = torch.stack([torch.randperm(e, generator=g)[: c.k] for _ in range(t)])
        routing = routing_from_topk(ids.to(device), e)
    else:
        if c.routing == "general":
            mask = torch.rand(t, e, generator=g) < c.keep
        elif c.routing == "one_expert":
            mask = torch.zeros(t, e, dtype=torch.bool)
            mask[:, int(torch.randint(e, (1,), generator=g))] = True
        else:
            mask = torch.rand(t, e, generator=g) < c.k / e
            mask[:, 0] = True
        tok, exp = mask.nonzero(as_tuple=True)  # token-major
        if not c.token_major:
            perm = torch.randperm(tok.numel(), generator=g)
            tok, exp = tok[perm], exp[perm]
        routing = routing_from_pairs(tok.to(device), exp.to(device), t, e, token_major=c.token_major, check=True)
    scores = (torch.rand(routing.num_rows, generator=g) + 0.1).to(device)
    return routing, scores


def run(c: Case, routing, scores, fn, dtype, device, dout, leaf_dtype=None):
    """Output and gradients of ``fn`` (sonicmoe.experts or experts_ref signature) on the case's problem,
    its inputs rounded to ``dtype`` (and held in ``leaf_dtype``, e.g. float64 for a reference on
    bf16-rounded inputs). Inputs that nothing depends on (no routed pairs at all) get zero gradients."""
    p = random_problem(c.t, c.d, c.n, c.e, bias=c.bias, device=device, seed=c.seed % 10_000)
    leaf_dtype = leaf_dtype or dtype
    leaves = {k: p[k].to(dtype).to(leaf_dtype).requires_grad_(True) for k in GRAD_NAMES[:5] if p[k] is not None}
    leaves["scores"] = scores.detach().to(torch.promote_types(scores.dtype, leaf_dtype)).clone().requires_grad_(True)
    out = fn(leaves["x"], leaves["w1"], leaves["w2"], routing, leaves["scores"], leaves.get("b1"),
             leaves.get("b2"), gate_up_layout=c.layout)
    if out.requires_grad:
        grads = torch.autograd.grad(out, list(leaves.values()), dout.to(dtype).to(out.dtype), allow_unused=True)
    else:
        grads = [None] * len(leaves)
    return out.detach(), {k: (g if g is not None else torch.zeros_like(v)) for (k, v), g in zip(leaves.items(), grads)}


def triton_experts(*args, **kw):
    return sonicmoe.experts(*args, backend="triton", **kw)


def torch_experts(*args, **kw):
    return sonicmoe.experts(*args, backend="torch", **kw)


# -------------------------------------------------------------------------- CPU: interpreter, float32

FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def score_grad_scale(c: Case, routing, dout, device) -> torch.Tensor:
    """(R,) float64 Σ_j |dO_{t,j}|·|Y_{p,j}| for each pair p = (t, e): the size of the terms whose sum is
    dS_p = ⟨dO_t, Y_p⟩. A dot product's rounding error is bounded by ε times this, not by |dS_p|,
    which can be far smaller when the terms cancel."""
    p = random_problem(c.t, c.d, c.n, c.e, bias=c.bias, device=device, seed=c.seed % 10_000, dtype=torch.float64)
    rows = routing.row_token.long()
    offsets = routing.expert_offsets.tolist()
    y = torch.zeros(routing.num_rows, c.d, dtype=torch.float64, device=device)
    for i in range(c.e):
        lo, hi = offsets[i], offsets[i + 1]
        h = p["x"][rows[lo:hi]] @ p["w1"][i].t() + (p["b1"][i] if c.bias else 0.0)
        y[lo:hi] = swiglu_ref(h, c.layout) @ p["w2"][i].t() + (p["b2"][i] if c.bias else 0.0)
    per_row = (dout.double()[rows].abs() * y.abs()).sum(1)
    return per_row[routing.pair_row.long()]


def score_norm(c: Case, routing, dout, device, ref: torch.Tensor) -> float:
    """The denominator of dS's relative error: ‖dS_ref‖, at least ‖score_grad_scale‖/√d — what ‖dS‖ is
    when the terms of each inner product do not cancel — so a few pairs whose ⟨dO_t, Y_p⟩ cancel to near
    zero (tiny T·K) cannot fail a result that is exact up to rounding; for many pairs this is ‖dS_ref‖."""
    floor = float(score_grad_scale(c, routing, dout, device).norm()) / c.d**0.5
    return max(float(ref.double().norm()), floor, 1e-30)


def grad_errors(c: Case, routing, dout, device, grads, ref_grads, norm: float | None = None) -> dict[str, float]:
    """Relative error of each gradient against the reference (dS over :func:`score_norm`, or ``norm`` when
    given: the same value, computed once by the caller)."""
    errs = {}
    for name, ref in ref_grads.items():
        got = grads[name]
        assert got.shape == ref.shape, name
        if name == "scores" and torch.isfinite(got).all():
            if norm is None:
                norm = score_norm(c, routing, dout, device, ref)
            errs[name] = float((got.double() - ref.double()).norm()) / norm
        else:
            errs[name] = rel_err(got, ref)
    return errs


def h_rounding_error(c: Case, routing, dout, device, dtype, norm: float) -> float:
    """How far storing H in ``dtype`` moves dS by itself, relative to ``norm`` (:func:`score_norm`): the backward of the
    method recomputes A from the stored H (SPEC §4), so its dS_p = ⟨dA′_p, A(round(H_p))⟩ where the float64
    reference has ⟨dA′_p, A(H_p)⟩. Computed in float64 on the inputs as :func:`run` rounds them. With few
    pairs this one rounding can outweigh the torch backend's whole error, which does not round H."""
    p = random_problem(c.t, c.d, c.n, c.e, bias=c.bias, device=device, seed=c.seed % 10_000)
    x, w1, w2 = (p[k].to(dtype).double() for k in ("x", "w1", "w2"))
    b1 = p["b1"].to(dtype).double() if c.bias else None
    do = dout.to(dtype).double()
    rows = routing.row_token.long()
    offsets = routing.expert_offsets.tolist()
    shift = torch.zeros(routing.num_rows, dtype=torch.float64, device=device)
    for i in range(c.e):
        lo, hi = offsets[i], offsets[i + 1]
        h = x[rows[lo:hi]] @ w1[i].t() + (b1[i] if b1 is not None else 0.0)
        a_stored = swiglu_ref(h.to(dtype).double(), c.layout)
        shift[lo:hi] = ((a_stored - swiglu_ref(h, c.layout)) * (do[rows[lo:hi]] @ w2[i])).sum(1)
    return float(shift.norm()) / norm


@pytest.mark.interpreter
@FUZZ
@given(c=cases(work_max=16_000))
def test_fuzz_triton_vs_reference_float32(c):
    """float32 triton (interpreter on CPU) against experts_ref evaluated in float64 on the same values:
    relative error < 1e-5 for O and every gradient (dS as in :func:`grad_errors`)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    routing, scores = make_routing(c, device)
    dout = torch.randn(c.t, c.d, generator=torch.Generator().manual_seed(c.seed % 997)).to(device)
    out, grads = run(c, routing, scores, triton_experts, torch.float32, device, dout)
    ref, ref_grads = run(c, routing, scores, sonicmoe.experts_ref, torch.float32, device, dout, torch.float64)
    assert out.shape == (c.t, c.d) and out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5, "O"
    assert all(g.dtype == torch.float32 for g in grads.values())
    for name, err in grad_errors(c, routing, dout, device, grads, ref_grads).items():
        assert err < 1e-5, (name, err)
    has_rows = torch.zeros(c.t, dtype=torch.bool, device=device)
    has_rows[routing.row_token.long()] = True
    assert torch.all(out[~has_rows] == 0), "tokens without experts give exactly zero"


# ------------------------------------------------------------------------------------ GPU: bf16, larger

GPU_DIMS = [64, 96, 128, 192, 256, 384, 512]


@pytest.mark.gpu
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=cases(t_max=3000, dims=GPU_DIMS, e_max=64))
# one pair whose dS the bf16 rounding of H moves by 4.2e-3 (H100, 2026-11-24), against a torch error of 9e-4
@example(c=Case(t=1, d=64, n=64, e=58, k=1, routing="topk", keep=0.0, token_major=False, bias=False,
                layout="concat", seed=0))
def test_gpu_fuzz_bf16_vs_torch_backend(c):
    """bf16: the triton backend's error (against float64 on the same bf16-rounded inputs) is at most twice
    the torch backend's bf16 error plus 2e-3, for O and every gradient (dS as in :func:`grad_errors`, with
    twice the shift that storing H in bf16 makes by itself added: :func:`h_rounding_error`)."""
    c.k = min(c.k, 8)
    routing, scores = make_routing(c, "cuda")
    dout = torch.randn(c.t, c.d, generator=torch.Generator().manual_seed(c.seed % 997)).cuda()
    out, grads = run(c, routing, scores, triton_experts, torch.bfloat16, "cuda", dout)
    tout, tgrads = run(c, routing, scores, torch_experts, torch.bfloat16, "cuda", dout)
    ref, rgrads = run(c, routing, scores, sonicmoe.experts_ref, torch.bfloat16, "cuda", dout, torch.float64)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel_err(out, ref) <= 2 * rel_err(tout, ref) + 2e-3, "O"
    norm = score_norm(c, routing, dout, "cuda", rgrads["scores"])
    errs = grad_errors(c, routing, dout, "cuda", grads, rgrads, norm)
    terrs = grad_errors(c, routing, dout, "cuda", tgrads, rgrads, norm)
    allow = {"scores": 2 * h_rounding_error(c, routing, dout, "cuda", torch.bfloat16, norm)}
    for name in rgrads:
        assert errs[name] <= 2 * terrs[name] + 2e-3 + allow.get(name, 0.0), (name, errs[name], terrs[name], allow)
