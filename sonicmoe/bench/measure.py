"""Measurements of one :class:`~sonicmoe.bench.baselines.Case`: correctness, time, memory (SPEC §7).

* :func:`check_case`: relative error ‖out − ref‖/‖ref‖ of O and of the gradients of x, W1, W2 and S
  against :func:`sonicmoe.experts_ref` (float32; the case's activation, and for the clamped one H rounded to the
  layer's dtype as the kernels store it: ``RefSpec.h_dtype``). The reference runs in chunks of experts, so its
  float32 copies of W1/W2 (and their gradients) never exceed ``chunk_bytes``: the output and the
  loss are sums over experts, hence O and dx, dS accumulate over chunks and dW1, dW2 are compared
  chunk by chunk (norms accumulated in float64).
* :func:`bench_ms`: ``triton.testing.do_bench`` on CUDA (median and p20/p80 in ms, L2 flushed),
  a ``time.perf_counter`` loop elsewhere (CPU smoke runs).
* :func:`measure_memory` (CUDA): bytes held after the forward and the peak over forward + backward.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable

import torch

from ..reference import experts_ref
from ..routing import routing_from_pairs
from ..testing import rel_err
from .baselines import Case, RefSpec

QUANTILES = (0.2, 0.5, 0.8)


def oom_error_types() -> tuple[type[BaseException], ...]:
    """Exception types that mean "out of memory" (GPU or host)."""
    t = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return (t, MemoryError) if t is not None else (MemoryError,)


def bench_error_types() -> tuple[type[BaseException], ...]:
    """Exception types a backend may raise that are reported in its row instead of ending the run."""
    types: list[type[BaseException]] = [*oom_error_types(), RuntimeError, ValueError, TypeError,
                                        NotImplementedError, AssertionError, IndexError, KeyError,
                                        AttributeError, ArithmeticError]
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import TritonError

        types += [TritonError, CompilationError]
    except ImportError:
        pass
    return tuple(types)


def free_memory(*leaves: torch.Tensor) -> None:
    """Drop gradients of ``leaves`` and give cached GPU memory back."""
    for t in leaves:
        if t is not None:
            t.grad = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()  # reference cycles may still hold GPU tensors
        try:
            torch.cuda.empty_cache()
        except RuntimeError:  # a sticky CUDA error (e.g. an illegal access) is reported elsewhere
            pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------
# correctness


class _NormAcc:
    """‖a − b‖ / ‖b‖ accumulated over pieces (of experts) in float64; NaN once any piece of ``a`` is not finite. Also
    the worst expert: max_e ‖a_e − b_e‖ over the RMS of the ‖b_e‖ (:meth:`local`)."""

    def __init__(self) -> None:
        self.diff2, self.ref2, self.finite = 0.0, 0.0, True
        self.count, self.worst2 = 0, 0.0

    def add(self, a: torch.Tensor | None, b: torch.Tensor) -> None:
        b = b.detach().double()
        a = torch.zeros_like(b) if a is None else a.detach().double()
        if not torch.isfinite(a).all():
            self.finite = False
        per = (a - b).square().flatten(1).sum(1) if b.dim() > 1 else (a - b).square()
        self.diff2 += float(per.sum())
        self.ref2 += float(b.square().sum())
        self.count += per.numel()
        self.worst2 = max(self.worst2, float(per.max()) if per.numel() else 0.0)

    def value(self) -> float:
        if not self.finite or not math.isfinite(self.diff2):
            return float("nan")
        return math.sqrt(self.diff2) / max(math.sqrt(self.ref2), 1e-30)

    def local(self) -> float:
        if not self.finite or not math.isfinite(self.worst2):
            return float("nan")
        return math.sqrt(self.worst2) / max(math.sqrt(self.ref2 / max(self.count, 1)), 1e-30)


def _worst_row(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max_t ‖out_t − ref_t‖ over the RMS of the ‖ref_t‖: a few wrong rows (a skipped tile, one token's slots) that
    a norm over all T·d elements would average away; NaN if ``out`` is not finite."""
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return float("nan")
    if not out.shape[0]:
        return 0.0
    rms = float(ref.square().sum(1).mean().sqrt())
    return float((out - ref).norm(dim=1).max()) / max(rms, 1e-30)


# the default --tol by dtype (relative error against the float32 reference, norm over all elements); the local
# errors (worst row, worst expert) must stay under LOCAL_TOL_FACTOR times it. Measured (session 82, the torch backend
# in bf16 on the CPU, T = 4096 and 2048, d up to 1536): norm errors 4.5e-3 to 5.8e-3, worst row 1.4e-2 at most, worst
# expert 5.5e-3: the local bound of 0.2 leaves a factor of 14. Our kernels in float32 (IEEE dots): about 1e-6
DEFAULT_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 2e-3, torch.float64: 1e-6}
LOCAL_TOL_FACTOR = 10.0


def default_tol(dtype: torch.dtype) -> float:
    """The check's relative-error bound for ``dtype`` (:data:`DEFAULT_TOL`)."""
    return DEFAULT_TOL.get(dtype, 2e-2)


def poison_allocator(device: torch.device, nbytes: int = 1 << 30) -> None:
    """Fill ``nbytes`` of the CUDA caching allocator with 0xFF and free it, so buffers a kernel
    forgets to write read as NaN (bf16/fp16/fp32 0xFF.. is NaN) rather than as stale valid numbers."""
    if device.type != "cuda":
        return
    try:
        free, _ = torch.cuda.mem_get_info(device)
        nbytes = int(min(nbytes, free // 4))
        if nbytes > 0:
            junk = torch.full((nbytes,), 255, dtype=torch.uint8, device=device)
            del junk
    except RuntimeError:
        pass


def reference_errors(out: torch.Tensor, spec: RefSpec, dout: torch.Tensor | None,
                     *, chunk_bytes: int = 1 << 30) -> dict[str, float]:
    """Relative errors of a case's output (and gradients, when ``dout`` is given) vs float32 experts_ref.

    Args:
        out: the case's O (T_out, d) after ``out.backward(dout)`` when dout is given (the gradients are
            read from ``spec``'s leaves).
        spec: the case's :class:`~sonicmoe.bench.baselines.RefSpec` (its ``activation`` and ``h_dtype`` go to the
            reference).
        dout: (T_out, d) upstream gradient, or None to compare the output only.
        chunk_bytes: float32 bytes of W1+W2 (and their gradients) per chunk of experts.

    Returns:
        ``{"out": …, "dx": …, "dw1": …, "dw2": …, "ds": …}`` (only "out" without dout), the norm-wise relative
        errors, and the local ones ``"out_rows"``, ``"dx_rows"`` (worst token row) and ``"dw1_experts"``,
        ``"dw2_experts"`` (worst expert), each over the RMS row or expert norm; NaN never passes. With
        ``spec.router_weight`` (the router variant), ``"dwr"`` in place of ``"ds"``.
    """
    E, two_n, d = spec.w1.shape
    n = two_n // 2
    want = dout is not None
    per_expert = 3 * n * d * 4 * (2 if want else 1)
    chunk = max(1, min(E, chunk_bytes // max(per_expert, 1)))
    x32 = spec.x.detach().float().requires_grad_(want)
    pt, pe = spec.pair_token.long(), spec.pair_expert.long()
    router = spec.router_weight is not None
    if router:  # the scores from float32 logits over the case's own top-k choice (RefSpec.router_weight)
        wr32 = spec.router_weight.detach().float().requires_grad_(want)
        logits = x32 @ wr32.t()
        lse = torch.logsumexp(logits.gather(1, spec.router_ids.long()), dim=1)
        s32 = torch.exp(logits[pt, pe] - lse[pt])
    else:
        s32 = spec.pair_scores.detach().float().requires_grad_(want)
    ref_out = None
    acc_w1, acc_w2 = _NormAcc(), _NormAcc()
    g32 = dout.float() if want else None
    for e0 in range(0, E, chunk):
        e1 = min(E, e0 + chunk)
        w1c = spec.w1.detach()[e0:e1].float().requires_grad_(want)
        w2c = spec.w2.detach()[e0:e1].float().requires_grad_(want)
        sel = ((pe >= e0) & (pe < e1)).nonzero().squeeze(1)
        routing = routing_from_pairs(pt[sel], pe[sel] - e0, spec.num_tokens, e1 - e0)
        o = experts_ref(x32, w1c, w2c, routing, s32[sel], activation=spec.activation, h_dtype=spec.h_dtype)
        if spec.post is not None:
            o = spec.post(o)
        ref_out = o.detach() if ref_out is None else ref_out + o.detach()
        if want:
            if o.requires_grad:
                o.backward(g32, retain_graph=router)  # the router's graph is shared by every chunk
            for acc, w, wc in ((acc_w1, spec.w1, w1c), (acc_w2, spec.w2, w2c)):
                acc.add(None if w.grad is None else w.grad[e0:e1],
                        wc.grad if wc.grad is not None else torch.zeros_like(wc))
        del o, w1c, w2c
    errs = {"out": rel_err(out, ref_out), "out_rows": _worst_row(out, ref_out)}
    if want:
        x_grad = spec.x.grad
        leaf = spec.score_leaf if spec.score_leaf is not None else spec.pair_scores
        s_grad = leaf.grad.reshape(-1) if leaf.grad is not None else None
        zeros = torch.zeros_like
        dx, dx_ref = (x_grad if x_grad is not None else zeros(x32)), (x32.grad if x32.grad is not None else zeros(x32))
        errs["dx"] = rel_err(dx, dx_ref)
        errs["dx_rows"] = _worst_row(dx, dx_ref)
        errs["dw1"] = acc_w1.value()
        errs["dw2"] = acc_w2.value()
        errs["dw1_experts"] = acc_w1.local()
        errs["dw2_experts"] = acc_w2.local()
        if router:  # dS flows on into dx (above) and dW_r
            w = spec.router_weight.grad
            errs["dwr"] = rel_err(w if w is not None else zeros(wr32),
                                  wr32.grad if wr32.grad is not None else zeros(wr32))
        else:
            errs["ds"] = rel_err(s_grad if s_grad is not None else zeros(s32),
                                 s32.grad if s32.grad is not None else zeros(s32))
    return errs


def error_bound(tol: float, key: str) -> float:
    """The check's bound on error ``key``: ``tol``, or ``LOCAL_TOL_FACTOR · tol`` for a local one (``*_rows``,
    ``*_experts``: a few wrong rows or experts)."""
    return tol * (LOCAL_TOL_FACTOR if key.endswith(("_rows", "_experts")) else 1.0)


def check_case(case: Case, dout: torch.Tensor, *, grads: bool, tol: float,
               chunk_bytes: int = 1 << 30, poison: bool = True, router: bool = False) -> dict:
    """Run ``case`` once (forward, and backward when ``grads``) and compare with the float32 reference.

    With ``router``, the case's router variant (:meth:`Case.router_check`: router, routing metadata, experts) is
    run and compared with the reference on the pairs it chose, scores recomputed from float32 logits; ``dwr``
    (W_r's gradient) replaces ``ds``, and ``dx`` includes the router's path.

    Returns:
        ``{"errors": {name: rel err}, "tol": tol, "passed": bool, "worst": name of the worst quantity}``.
        ``passed`` is False if any error is NaN, a norm-wise one above ``tol`` or a local one (``*_rows``,
        ``*_experts``) above ``LOCAL_TOL_FACTOR · tol``, or if no pair was checked on T > 0; "worst" is the one
        furthest over (or nearest to) its bound; "pairs" the number of routed pairs the reference computed.
    """
    leaves = case.router_leaves if router else case.leaves
    for t in leaves:
        t.grad = None
    device = dout.device
    if poison:
        poison_allocator(device)
    out, spec = case.router_check() if router else (case.forward(), case.ref_spec())
    if grads:
        out.backward(dout)
    _sync(device)
    errs = reference_errors(out.detach(), spec, dout if grads else None, chunk_bytes=chunk_bytes)
    spec_pairs, out_rows = spec.pair_token.numel(), out.shape[0]
    del out, spec
    for t in leaves:
        t.grad = None
    bad = {k: v for k, v in errs.items() if not (math.isfinite(v) and v <= error_bound(tol, k))}
    worst = max(errs, key=lambda k: math.inf if not math.isfinite(errs[k]) else errs[k] / error_bound(tol, k))
    pairs = int(spec_pairs)
    # a check on no routed pair passes any kernel (only an empty problem may have none)
    passed = not bad and (pairs > 0 or out_rows == 0)
    return {"errors": errs, "tol": tol, "passed": passed, "worst": worst, "pairs": pairs}


# ---------------------------------------------------------------------------------------------------
# timing


def _wall_ms(fn: Callable[[], object], warmup: float, rep: float, device: torch.device) -> list[float]:
    """Per-call wall-clock times (ms) with ``time.perf_counter``: calls for ``warmup`` ms (at least
    one), then measured calls for ``rep`` ms (at least 5, at most 1000)."""
    start = time.perf_counter()
    while True:
        fn()
        _sync(device)
        if (time.perf_counter() - start) * 1e3 >= warmup:
            break
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 1000 and (len(times) < 5 or (time.perf_counter() - start) * 1e3 < rep):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


# warm-up before each measurement, ms. Long enough for the GPU's power limiter to settle: an H100 or H200 running
# these layers sits at its 700 W cap, and the cap lowers the SM clock only some 100 ms after the load starts. With a
# 25 ms warm-up a timing right after an idle gap read 5% fast and one right after the autotuning call 5% slow (7B
# shape, H200, 2026-11-26 session 31: 434 and 411 TFLOP/s against 427 over a 3 s window; see the session's README).
SETTLED_WARMUP_MS = 1000.0

# measured time per measurement, ms. Under the power cap the limiter's clock wanders over seconds even once settled:
# back-to-back 100 ms windows of the 7B layer's forward+backward in one process read 3.34-3.58 ms (H100) and
# 3.13-3.26 ms (H200), while 1000 ms windows read 3.39-3.42 and 3.21-3.22, the median of a 4-6 s run of single
# calls (session 50, scripts/window_probe.py; benchmarks/results/2026-11-27_nvidia-h100-h200_session50/). Until
# session 50 the default was 100 ms, and one slow window decided a protocol run.
SETTLED_REP_MS = 1000.0


def bench_ms(fn: Callable[[], object], *, device: torch.device, warmup: float = SETTLED_WARMUP_MS,
             rep: float = SETTLED_REP_MS, grad_to_none: list[torch.Tensor] | None = None) -> dict[str, float]:
    """Time ``fn`` in milliseconds: ``{"p20", "p50", "p80"}`` (p50 = median).

    CUDA: ``triton.testing.do_bench(fn, warmup, rep, grad_to_none, quantiles=[0.2, 0.5, 0.8])``
    (warmup/rep in ms, L2 cache flushed before each call). The default warm-up, :data:`SETTLED_WARMUP_MS`, runs
    ``fn`` until the GPU's clock has settled under its power cap, and the default window, :data:`SETTLED_REP_MS`,
    is long enough that the median is the sustained speed, not one phase of the power limiter's wandering clock.
    Elsewhere: a perf_counter loop.
    """
    if device.type == "cuda":
        from triton.testing import do_bench

        q = do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, quantiles=list(QUANTILES),
                     return_mode="median")
    else:
        times = _wall_ms(fn, warmup, rep, device)
        if len(times) >= 2:
            cuts = statistics.quantiles(times, n=10, method="inclusive")
            q = [cuts[1], statistics.median(times), cuts[7]]
        else:
            q = [times[0]] * 3
    return dict(zip(("p20", "p50", "p80"), (float(v) for v in q)))


def forward_fn(forward: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """A call of the training forward (autograd on; output dropped)."""

    def run() -> None:
        forward()

    return run


def fwdbwd_fn(forward: Callable[[], torch.Tensor], leaves: list[torch.Tensor],
              dout: torch.Tensor) -> Callable[[], None]:
    """A call of forward + ``out.backward(dout)`` with the gradients of ``leaves`` reset first."""

    def run() -> None:
        for t in leaves:
            t.grad = None
        forward().backward(dout)

    return run


def graph_of(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after three eager calls on a side stream (as torch recommends: autotuning,
    allocator pools and lazy state settle outside the capture). ``graph.replay()`` then runs ``fn``'s kernels with
    no Python between them: timed, the GPU-bound time of a call (CUDA only)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def host_ms(fn: Callable[[], object], calls: int = 10) -> float:
    """Host time in ms to enqueue one call of ``fn``: perf_counter over ``calls`` calls with no synchronisation
    between them (few enough that the launch queue never fills), after three warm calls."""

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    ms = (time.perf_counter() - t0) * 1e3 / calls
    sync()
    return ms


# ---------------------------------------------------------------------------------------------------
# memory


def measure_memory(case: Case, dout: torch.Tensor, *, backward: bool) -> dict[str, int] | None:
    """Activation memory of one forward (+ backward) on CUDA, in bytes; None elsewhere.

    ``held_bytes``: memory_allocated after the forward minus before it, minus the output O — what
    the forward keeps for the backward (inputs and parameters were allocated before, so excluded).
    ``fwd_peak_bytes``: peak over the forward minus the baseline. ``peak_bytes``: peak over
    forward + backward minus the baseline (includes the gradients, ``grad_bytes`` of them).
    """
    device = dout.device
    if device.type != "cuda":
        return None
    free_memory(*case.leaves)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = case.forward()
    torch.cuda.synchronize(device)
    out_bytes = out.numel() * out.element_size()
    held = torch.cuda.memory_allocated(device) - base - out_bytes
    fwd_peak = torch.cuda.max_memory_allocated(device) - base
    res = {"held_bytes": int(held), "fwd_peak_bytes": int(fwd_peak), "out_bytes": int(out_bytes)}
    if backward:
        out.backward(dout)
        torch.cuda.synchronize(device)
        res["peak_bytes"] = int(torch.cuda.max_memory_allocated(device) - base)
        res["grad_bytes"] = int(sum(t.grad.numel() * t.grad.element_size()
                                    for t in case.leaves if t.grad is not None))
    else:
        res["peak_bytes"] = int(fwd_peak)
        res["grad_bytes"] = 0
    del out
    free_memory(*case.leaves)
    return res
