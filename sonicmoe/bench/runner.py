"""Run the benchmark: for each shape and routing, every backend on the same problem (SPEC §7).

Per backend: build the case (skipped with the reason if unavailable, or if it does not take the run's gated
activation, ``RunOptions.activation``: never run with SwiGLU in its place) → check against the float32
reference (a wrong result is reported as FAIL and not timed) → time forward and forward+backward
(bwd = total − fwd) → optionally time router + metadata + experts → measure memory (CUDA).
Exceptions of one backend (out of memory, compilation errors, ...) land in its row.
"""

from __future__ import annotations

import dataclasses
import math
import traceback
from collections.abc import Callable

import torch

from .baselines import REGISTRY, Case, Unavailable
from .gpu_state import GpuWatch, Nvml, open_nvml
from .measure import (
    SETTLED_REP_MS,
    SETTLED_WARMUP_MS,
    bench_error_types,
    bench_ms,
    check_case,
    default_tol,
    error_bound,
    free_memory,
    fwdbwd_fn,
    measure_memory,
    oom_error_types,
)
from .problem import Problem, TokenRoundingUnavailable, load_token_rounding, make_problem
from .shapes import Shape, spec_held_bytes, tflops, useful_flops

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# whose timings the ratios are relative to: ours when it ran, else the torch backend
RATIO_BASES = ("triton", "torch")


@dataclasses.dataclass
class RunOptions:
    """Options of one run (the command line's, see ``sonicmoe bench --help``)."""

    backends: list[str]
    device: torch.device
    dtype: torch.dtype
    mode: str = "fwdbwd"
    routings: tuple[str, ...] | None = None
    m_tile: int = 128
    rounding: str = "nearest"
    warmup: float = SETTLED_WARMUP_MS
    rep: float = SETTLED_REP_MS
    seed: int = 0
    check: bool = True
    check_grads: bool = True
    check_max_T: int | None = None
    tol: float | None = None  # None: by dtype (sonicmoe.bench.measure.DEFAULT_TOL)
    router_variant: bool = True
    memory: bool = True
    loop_max_E: int | None = 128
    load_profile: str | None = None  # a trained model's expert load (sonicmoe.bench.load_profile); None: even
    poison: bool = True
    verbose: bool = True
    activation: str = "swiglu"  # the experts' gated activation (sonicmoe.config.ACTIVATIONS)


def _message(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 600 else text[:600] + " …"


def _phase(ms: dict[str, float] | None, flops: int) -> dict | None:
    if ms is None:
        return None
    return {"ms": ms, "tflops": tflops(flops, ms["p50"])}


def _timed(fn: Callable[[], object], leaves: list[torch.Tensor], flops: int, opts: RunOptions,
           device: torch.device, nvml: Nvml | None) -> dict:
    """One measurement (:func:`bench_ms`) as a phase: ``{"ms", "tflops", "gpu"}``, ``gpu`` the SM clock, board
    power and temperature over its timing window (:meth:`GpuWatch.last`; None without NVML)."""
    with GpuWatch(device, nvml=nvml) as watch:
        ms = bench_ms(fn, device=device, warmup=opts.warmup, rep=opts.rep, grad_to_none=leaves)
    phase = _phase(ms, flops)
    phase["gpu"] = watch.last(opts.rep / 1e3)
    return phase


def _gpu_note(phase: dict | None) -> str:
    g = (phase or {}).get("gpu")
    if not g:
        return ""
    watts = f", {g['watts']:.0f} W" if g.get("watts") is not None else ""
    return f"  [{g['sm_mhz']:.0f} MHz{watts}, {g['temp_c']} °C]"


def run_backend(name: str, problem: Problem, opts: RunOptions, flops: dict[str, int],
                log: Callable[[str], None]) -> dict:
    """Check, time and measure one backend on ``problem``; returns its JSON row (never raises the
    backend's own errors: they become ``status`` "error"/"oom" with the message)."""
    spec = REGISTRY[name]
    row: dict = {"status": "ok", "message": None, "kind": spec.kind, "check": None, "fwd": None,
                 "bwd": None, "total": None, "router": None, "memory": None, "info": {}}
    errors = bench_error_types()
    options = {"loop_max_E": opts.loop_max_E, "activation": opts.activation}
    backward = opts.mode == "fwdbwd"
    step = "setup"
    case: Case | None = None
    try:
        if opts.activation not in spec.activations:
            raise Unavailable(f"takes only {', '.join(spec.activations)}, not --activation {opts.activation} "
                              "(not run with SwiGLU in its place)")
        case = spec.factory(problem, options)
        row["info"] = dict(getattr(case, "info", {}) or {})
        if name == "upper" and row["info"].get("rows"):  # its TFLOP/s from the rows it computes (not R under TR)
            _, d, n, _, _ = problem.shape.dims
            flops = useful_flops(row["info"]["rows"], n, d)
        if opts.check:
            step = "check"
            check_T = min(x for x in (problem.T, opts.check_max_T, spec.check_max_T) if x)
            cp = problem.head(check_T)
            ccase = case if cp is problem else spec.factory(cp, options)
            tol = opts.tol if opts.tol is not None else default_tol(problem.dtype)
            grads = backward and opts.check_grads
            res = check_case(ccase, cp.dout, grads=grads, tol=tol, poison=opts.poison)
            res["T"], res["pairs"] = cp.T, cp.R
            row["check"] = res
            what = ""
            if res["passed"] and opts.router_variant and spec.router_variant:
                # the router variant on its own choice of pairs (scores from float32 logits, dW_r, dx with the
                # router's path); what its timing runs besides the checked experts is the router and routing steps
                step, what = "check router variant", "router variant: "
                res = check_case(ccase, cp.dout, grads=grads, tol=tol, poison=opts.poison, router=True)
                res["T"] = cp.T
                row["check"]["router"] = res
                free_memory(*ccase.router_leaves)
                w = res["worst"]
                if (not res["pairs"] and cp is not problem and problem.mode == "token_rounding"
                        and math.isfinite(res["errors"][w]) and res["errors"][w] <= error_bound(tol, w)):
                    # the router variant rounds the checked tokens' counts again, and so few tokens can round every
                    # expert to no pair (the timed T tokens route some): nothing to check it on, timed unchecked
                    res.update(passed=None, skipped=(
                        f"token rounding of the {cp.T} checked tokens routes no pair at M_tile={problem.m_tile}; "
                        "raise --check-max-T or lower --m-tile to check it"))
                    log(f"  {name}: router variant not checked ({res['skipped']})")
                    res, what = row["check"], ""
            cp_T = cp.T
            del ccase, cp
            free_memory(*case.leaves)
            if not res["passed"]:
                row["status"] = "FAIL"
                w = res["worst"]
                local = w.endswith(("_rows", "_experts"))
                bound = f"local bound {error_bound(tol, w):g}" if local else f"tol {tol:g}"
                row["message"] = (f"{what}wrong result: rel err of {w} = {res['errors'][w]:.3g} > {bound}"
                                  if res["pairs"] or not cp_T else f"{what}checked no routed pair on T={cp_T}")
                log(f"  {name}: FAIL ({row['message']}); not timed")
                return row
        step = "time fwd"
        dev = problem.device
        nvml = open_nvml(dev)
        row["fwd"] = _timed(case.forward, case.leaves, flops["fwd"], opts, dev, nvml)
        if backward:
            step = "time fwd+bwd"
            row["total"] = _timed(fwdbwd_fn(case.forward, case.leaves, problem.dout), case.leaves, flops["total"],
                                  opts, dev, nvml)
            bwd = row["total"]["ms"]["p50"] - row["fwd"]["ms"]["p50"]
            row["bwd"] = {"ms": {"p50": bwd}, "tflops": tflops(flops["bwd"], bwd)}
            free_memory(*case.leaves)
        if opts.router_variant and spec.router_variant:
            step = "time router variant"
            leaves = case.router_leaves
            row["router"] = {"fwd": _timed(case.forward_with_router, leaves, flops["fwd"], opts, dev, nvml)}
            if backward:
                row["router"]["total"] = _timed(fwdbwd_fn(case.forward_with_router, leaves, problem.dout), leaves,
                                                flops["total"], opts, dev, nvml)
            free_memory(*leaves)
        if opts.memory and dev.type == "cuda":
            step = "memory"
            row["memory"] = measure_memory(case, problem.dout, backward=backward)
        log(f"  {name}: ok  fwd {row['fwd']['ms']['p50']:.4g} ms"
            + (f", fwd+bwd {row['total']['ms']['p50']:.4g} ms" if row["total"] else "")
            + _gpu_note(row["total"] or row["fwd"]))
    except Unavailable as exc:
        row["status"], row["message"] = "skipped", str(exc)
        log(f"  {name}: skipped ({exc})")
    except errors as exc:
        oom = isinstance(exc, oom_error_types())
        row["status"] = "oom" if oom else "error"
        row["message"] = f"{step}: {_message(exc)}"
        log(f"  {name}: {row['status'].upper()} during {step}: {_message(exc)}")
        if not oom and opts.verbose:
            log("".join(traceback.format_exception(exc)[-3:]).rstrip())
    finally:
        leaves = list(case.leaves) if case is not None else []
        del case
        free_memory(*leaves, *problem.leaves())
    return row


def _ratios(backends: dict[str, dict], pairs: int | None = None) -> tuple[str | None, dict]:
    """Speed-ups of the ratio base over every other timed backend: other_ms / base_ms per phase
    (> 1: the base is faster; vs ``upper`` it is the fraction of the upper bound's throughput)."""
    base = next((b for b in RATIO_BASES if backends.get(b, {}).get("fwd")), None)
    if base is None:
        return None, {}
    out = {}
    b = backends[base]
    for name, row in backends.items():
        if name == base or not row.get("fwd"):
            continue
        # the upper bound computes E·m rows (m = ⌈T·K'/E⌉, K' = round(R/T)), which under token rounding is not
        # R: its time scaled to R rows, so that the ratio compares the same work
        rows = (row.get("info") or {}).get("rows")
        scale = pairs / rows if name == "upper" and pairs and rows else 1.0
        r = {}
        for phase in ("fwd", "bwd", "total"):
            if row.get(phase) and b.get(phase):
                other, ours = row[phase]["ms"]["p50"] * scale, b[phase]["ms"]["p50"]
                r[phase] = other / ours if ours > 0 and other > 0 else None
        out[name] = r
    return base, out


def footprint_bytes(shape: Shape, elem: int, backward: bool) -> int:
    """Rough bytes one backend needs on ``shape``: W1, W2 (E·3·n·d) and their grads, x/dO/dx (T·d),
    and the torch baseline's per-pair activations (gathered X, H, A, Y: TK·(2d + 3n)) plus their grads."""
    T, d, n, E, K = shape.dims
    weights = E * 3 * n * d * elem
    acts = T * K * (2 * d + 3 * n) * elem
    return int(weights * (2 if backward else 1) + 3 * T * d * elem + acts * (2 if backward else 1))


def _device_bytes(device: torch.device) -> int | None:
    """Total GPU memory, or half the physical RAM for CPU runs (None if unknown)."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        import os

        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
    except (ValueError, OSError, AttributeError, RuntimeError):
        return None


def shape_header(shape: Shape, mode: str, opts: RunOptions) -> dict:
    """The fields that open a shape's JSON record, whether its run ended ok, skipped or raised: name, group, the
    dims T, d, n, E, K, the preset's T before --max-T, granularity G = d/n, sparsity rho = K/E, the routing mode,
    M_tile and the activation."""
    T, d, n, E, K = shape.dims
    return {"name": shape.name, "group": shape.group, "T": T, "d": d, "n": n, "E": E, "K": K,
            "T_preset": shape.T_preset, "G": shape.G, "rho": shape.rho, "routing": mode, "m_tile": opts.m_tile,
            "activation": opts.activation}


def run_shape(shape: Shape, mode: str, opts: RunOptions, log: Callable[[str], None]) -> dict:
    """All backends on one shape and routing mode; returns the shape's JSON record."""
    T, d, n, E, K = shape.dims
    rec: dict = {**shape_header(shape, mode, opts), "status": "ok", "message": None}
    need = footprint_bytes(shape, torch.empty((), dtype=opts.dtype).element_size(), opts.mode == "fwdbwd")
    rec["footprint_bytes"] = need
    have = _device_bytes(opts.device)
    if have is not None and need > have:
        msg = (f"needs about {need / 2**30:.1f} GiB (weights, grads, activations), more than the "
               f"{have / 2**30:.1f} GiB {'of GPU memory' if opts.device.type == 'cuda' else 'half the RAM'}")
        if opts.device.type != "cuda":
            rec.update(status="skipped", message=msg + "; run it on a GPU or lower --max-T", backends={})
            log(f"  skipped: {rec['message']}")
            return rec
        log(f"  warning: {msg}; expect out-of-memory rows")
    try:
        load = None
        if opts.load_profile:
            from .load_profile import load_profile_kind, target_load

            load = target_load(opts.load_profile, E, seed=opts.seed)
            rec["load_target"] = {"profile": str(opts.load_profile), "max_over_mean": float(load.max()) * E,
                                  "min_over_mean": float(load.min()) * E,
                                  "loads": load_profile_kind(opts.load_profile)}
        problem = make_problem(shape, dtype=opts.dtype, device=opts.device, seed=opts.seed, mode=mode,
                               m_tile=opts.m_tile, rounding=opts.rounding, load=load)
        if load is not None and problem.topk_ids is not None:  # what the calibrated router gave (top-k's counts)
            got = torch.bincount(problem.topk_ids.reshape(-1).long(), minlength=E).double()
            got = got / got.mean().clamp_min(1e-30)
            want = rec["load_target"]["max_over_mean"]
            rec["load_target"].update(achieved_max_over_mean=float(got.max()), achieved_min_over_mean=float(got.min()))
            if abs(float(got.max()) - want) > 0.1 * want:
                log(f"  warning: the router reached a busiest expert of {float(got.max()):.2f}x the mean, not the "
                    f"profile's {want:.2f}x (too few tokens per expert to calibrate?)")
    except TokenRoundingUnavailable as exc:
        rec.update(status="skipped", message=str(exc), backends={})
        return rec
    except bench_error_types() as exc:
        rec.update(status="oom" if isinstance(exc, oom_error_types()) else "error",
                   message=f"making the problem: {_message(exc)}", backends={})
        log(f"  {rec['status'].upper()}: {rec['message']}")
        free_memory()
        return rec
    R = problem.R
    if R == 0 and T > 0:  # token rounding rounded every expert down to no row: a check would pass any kernel
        rec.update(status="skipped", TK=0, backends={},
                   message=f"{mode} routed no (token, expert) pair: T·K/E = {T * K / E:g} mean tokens per expert "
                           f"rounded to multiples of M_tile={opts.m_tile} gives none; nothing to check or time "
                           f"(use --m-tile <= {max(1, T * K // E)} or a larger T)")
        log(f"  skipped: {rec['message']}")
        del problem
        return rec
    flops = useful_flops(R, n, d)
    elem = torch.empty((), dtype=opts.dtype).element_size()
    counts = problem.routing.expert_counts()
    rec.update(TK=R, flops=flops, spec_held_bytes=spec_held_bytes(T, d, R, n, elem),
               dtype=str(opts.dtype).replace("torch.", ""),
               tokens_per_expert={"min": int(counts.min()), "mean": R / E, "max": int(counts.max())})
    if opts.m_tile:
        # rows a grouped GEMM with M_tile-high tiles computes (each T_e rounded up to M_tile)
        rec["padded_rows"] = int(sum(math.ceil(int(c) / opts.m_tile) * opts.m_tile for c in counts.tolist()))
    rows = {}
    for name in opts.backends:
        rows[name] = run_backend(name, problem, opts, flops, log)
    rec["backends"] = rows
    rec["ratio_base"], rec["ratios"] = _ratios(rows, R)
    del problem
    free_memory()
    return rec


def expand(shapes: list[Shape], opts: RunOptions, log: Callable[[str], None]) -> list[tuple[Shape, str]]:
    """(shape, routing) items to run: each shape's own routings unless ``--routing`` was given.
    Token rounding falls back to top-k (with a message) when its module is missing."""
    try:
        load_token_rounding()
        tr_ok, why = True, ""
    except TokenRoundingUnavailable as exc:
        tr_ok, why = False, str(exc)
    items: list[tuple[Shape, str]] = []
    warned = False
    for s in shapes:
        modes = opts.routings or s.routings or ("topk",)
        for m in modes:
            if m == "token_rounding" and not tr_ok:
                if not warned:
                    log(f"token rounding unavailable: {why}; running top-k routing instead")
                    warned = True
                m = "topk"
            if (s, m) not in items:
                items.append((s, m))
    return items


def run(shapes: list[Shape], opts: RunOptions, log: Callable[[str], None] | None = print, *,
        records: list[dict] | None = None, on_record: Callable[[dict], None] | None = None) -> list[dict]:
    """Run every (shape, routing) item with a progress bar (tqdm if importable).

    Appends each shape's record to ``records`` (returned) and calls ``on_record(record)`` after each,
    so a caller can save partial results. ``log`` None: no progress messages.
    """
    quiet = log is None
    log = (lambda s: None) if quiet else log
    items = expand(shapes, opts, log)
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    records = [] if records is None else records
    if tqdm is not None:
        # disable=None: no bar when stderr is not a terminal (logs of remote runs stay readable)
        bar = tqdm(items, desc="sonicmoe bench", unit="shape", dynamic_ncols=True, disable=None)
        say = log if quiet else tqdm.write
    else:
        bar, say = items, log
    for i, (shape, mode) in enumerate(bar):
        act = "" if opts.activation == "swiglu" else f" activation={opts.activation}"
        say(f"[{i + 1}/{len(items)}] {shape.name} (T={shape.T}, d={shape.d}, n={shape.n}, E={shape.E}, "
            f"K={shape.K}) routing={mode}{act}")
        try:
            rec = run_shape(shape, mode, opts, say)
        except bench_error_types() as exc:  # e.g. a sticky CUDA error while summarising the routing
            rec = {**shape_header(shape, mode, opts), "backends": {},
                   "status": "oom" if isinstance(exc, oom_error_types()) else "error",
                   "message": _message(exc)}
            say(f"  {rec['status'].upper()}: {rec['message']}")
            free_memory()
        records.append(rec)
        if on_record is not None:
            on_record(records[-1])
    return records
