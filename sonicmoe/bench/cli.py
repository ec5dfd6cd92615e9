"""``sonicmoe bench``: time our MoE experts against the torch backend, a Python loop and the cuBLAS
upper bound on the paper's shapes, check them against the float32 reference, write a results JSON
(and PNG plots made from it).

Examples::

    sonicmoe bench                                   # GPU: the 7B shape; no GPU: a tiny fp32 smoke run
    sonicmoe bench --preset granularity --tag h100
    sonicmoe bench --preset models --backends triton,upper --mode fwd
    sonicmoe bench --shape 32768,2048,768,128,8 --shape qwen=32768,4096,1536,128,8
    sonicmoe bench --preset token-rounding --m-tile 128 --max-T 8192
    sonicmoe bench --preset models --activation clamped_swiglu   # gpt-oss's clamped SwiGLU
    sonicmoe bench --plot-from benchmarks/results/2026-01-01_nvidia-h100-80gb-hbm3.json
    sonicmoe bench --markdown-from benchmarks/results/2026-01-01_nvidia-h100-80gb-hbm3.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import math
import os
import sys

from ..config import ACTIVATIONS
from ..env import interpreting
from .shapes import PRESET_HELP, PRESETS, ROUTINGS, parse_shape, preset_shapes

ROUNDINGS = ("nearest", "up", "down", "stochastic", "balance")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sonicmoe bench",
        description="Benchmark the SonicMoE expert layer (useful FLOPs: fwd 6·TK·n·d, bwd 12·TK·n·d).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="presets:\n" + "\n".join(f"  {k:<15} {v}" for k, v in PRESET_HELP.items()),
    )
    what = p.add_argument_group("what to run")
    what.add_argument("--preset", action="append", default=[], metavar="NAME",
                      help=f"shape preset, repeatable or comma list: {', '.join(PRESETS)} "
                           "(default: 7b on a GPU, tiny otherwise)")
    what.add_argument("--shape", action="append", default=[], metavar="T,d,n,E,K",
                      help="a free shape (optionally NAME=T,d,n,E,K); repeatable")
    what.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwdbwd",
                      help="fwd: forward only; fwdbwd: forward, backward (= total - fwd) and total (default)")
    what.add_argument("--routing", default=None, metavar="MODES",
                      help="comma list of topk,token_rounding (default: topk; the token-rounding preset runs both)")
    what.add_argument("--m-tile", type=int, default=128, help="M_tile for token rounding (default 128)")
    what.add_argument("--rounding", choices=ROUNDINGS, default="nearest", help="token-rounding subroutine")
    what.add_argument("--backends", default="default",
                      help="comma list of triton,torch,loop,upper,scattermoe; 'default' = triton,torch,loop,upper "
                           "plus installed competitor libraries; 'all'")
    what.add_argument("--activation", choices=ACTIVATIONS, default="swiglu",
                      help="the experts' gated activation on the (T, 2n) H: swiglu, silu(gate)·up (default), or "
                           "clamped_swiglu, gpt-oss's (clamp(up,-7,7)+1)·g·σ(1.702 g), g = min(gate, 7); every "
                           "built-in backend and the float32 check (H rounded to --dtype as the kernels store it) "
                           "take it, a registered backend that takes only SwiGLU is skipped; recorded in the results")
    what.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                      help="default bf16 on a GPU, fp32 on CPU")
    what.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                      help="where to run (default auto: cuda when a GPU is present, else cpu)")
    what.add_argument("--max-T", type=int, default=None, help="cap T (tokens) of every shape, for quick runs")
    what.add_argument("--seed", type=int, default=0,
                      help="seed of the inputs, weights, router and stochastic token rounding (default 0; each shape "
                           "draws fresh data)")
    what.add_argument("--load-profile", metavar="FILE.json", default=None,
                      help="route as unevenly as a trained model: the expert load of a `sonicmoe train` log.json "
                           "(or a JSON list of per-expert counts), resampled to each shape's E; the router weight is "
                           "scaled until top-k matches it (default: a random router's near-even load)")
    what.add_argument("--cpu-threads", type=int, default=1,
                      help="torch intra-op threads for CPU runs (default 1: tiny CPU ops slow down badly "
                           "with several threads on a busy machine; 0 keeps torch's setting)")
    what.add_argument("--loop-max-E", type=int, default=128,
                      help="run the per-expert loop baseline only when E <= this (0: always)")
    what.add_argument("--router-variant", action=argparse.BooleanOptionalAction, default=True,
                      help="also time router + routing metadata + experts for triton/torch (with the check: also "
                           "checked, on the pairs the router chose, scores and dW_r from float32 logits)")
    what.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                      help="measure held/peak activation memory (CUDA only)")
    timing = p.add_argument_group("timing and checks")
    timing.add_argument("--warmup", type=float, default=None,
                        help="warm-up time per measurement, ms (do_bench; default 1000: the GPU clock settles "
                             "under its power cap first)")
    timing.add_argument("--rep", type=float, default=None,
                        help="measured time per measurement, ms (do_bench; default 1000: the median of a window "
                             "this long is the sustained speed under the power cap, a 100 ms one is not)")
    timing.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="check each backend against the float32 reference before timing it")
    timing.add_argument("--check-grads", action=argparse.BooleanOptionalAction, default=True,
                        help="in fwdbwd mode also check the grads of x, W1, W2 and S")
    timing.add_argument("--check-max-T", type=int, default=None,
                        help="check on the first N tokens only (same d, n, E, K; top-k routing recomputed; token "
                        "rounding: the timed problem's own pairs of those tokens)")
    timing.add_argument("--tol", type=float, default=None,
                        help="max relative error, norm over all elements (default by dtype: bf16 2e-2, fp16 5e-3, "
                        "fp32 2e-3); the worst token row and the worst expert's weight gradient must stay under 10 "
                        "times it (NaN never passes)")
    timing.add_argument("--poison", action=argparse.BooleanOptionalAction, default=True,
                        help="fill freed GPU memory with NaN bytes before each check")
    out = p.add_argument_group("output")
    out.add_argument("--out", default=None, metavar="DIR", help="results directory (default benchmarks/results)")
    out.add_argument("--tag", default=None, help="suffix of the results file name")
    out.add_argument("--no-plot", dest="plot", action="store_false", help="do not write PNG plots")
    only = out.add_mutually_exclusive_group()  # one file, one job: a second would be silently ignored
    only.add_argument("--plot-from", metavar="FILE.json", help="only regenerate the plots of a results file")
    only.add_argument("--markdown-from", metavar="FILE.json", help="only print the README table of a results file")
    out.add_argument("--list", action="store_true", help="list presets and backends, then exit")
    out.add_argument("-q", "--quiet", action="store_true", help="less progress output")
    return p


def _shapes(args) -> list:
    shapes = []
    for item in args.preset:
        for name in item.split(","):
            if name.strip():
                shapes += preset_shapes(name)
    shapes += [parse_shape(s) for s in args.shape]
    return [s.with_max_T(args.max_T) for s in shapes]


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    """Usage errors (``parser.error``, exit 2) for values argparse accepts but the run cannot use."""
    from ..config import check_m_tile

    try:
        check_m_tile(args.m_tile)
    except ValueError as exc:
        parser.error(f"--m-tile: {exc}")
    for flag in ("max_T", "check_max_T"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            parser.error(f"--{flag.replace('_', '-')} must be a positive number of tokens, got {v}")
    if args.tol is not None and not (math.isfinite(args.tol) and args.tol > 0):
        parser.error(f"--tol must be a finite relative error > 0, got {args.tol}")
    for flag in ("warmup", "rep"):
        v = getattr(args, flag)
        if v is not None and not (math.isfinite(v) and v >= 0):
            parser.error(f"--{flag} must be a finite number of ms >= 0, got {v}")
    if not any(s.strip() for s in args.backends.split(",")):
        parser.error(f"--backends names no backend: {args.backends!r}")


def _list() -> int:
    from .baselines import REGISTRY, library_installed

    print("presets:")
    for k, v in PRESET_HELP.items():
        print(f"  {k:<15} {v}")
        for s in PRESETS[k] if k != "all" else []:
            print(f"      {s.name:<24} T={s.T:<6} d={s.d:<5} n={s.n:<5} E={s.E:<4} K={s.K}")
    print("backends:")
    for name, spec in REGISTRY.items():
        extra = "" if spec.kind != "library" else (" [installed]" if library_installed(name) else " [not installed]")
        print(f"  {name:<11} {spec.kind:<9} {spec.description}{extra}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sonicmoe bench``; returns the exit code: 0, 1 if any backend FAILed or errored or nothing was
    timed (every row skipped or out of memory), 2 for a usage error, 130 when interrupted."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        _check_args(parser, args)
    except SystemExit as exc:
        return int(exc.code or 0)

    if args.list:
        return _list()
    if args.plot_from or args.markdown_from:
        from .report import load_results, markdown_table

        path = args.plot_from or args.markdown_from
        try:
            doc = load_results(path)
        except (OSError, ValueError) as exc:  # missing file, not JSON, not a results file
            print(f"sonicmoe bench: cannot read {path}: {exc}", file=sys.stderr)
            return 2
        if args.markdown_from:
            print(markdown_table(doc))
            return 0
        from .plots import plot_from_file

        return 0 if plot_from_file(args.plot_from, args.out) else 1  # [] without matplotlib or without data

    import torch

    from .baselines import resolve_backends
    from .report import build_results, env_info, results_path, terminal_table, write_results
    from .runner import DTYPES, RunOptions, run

    if args.warmup is None:  # recorded in the results file as resolved
        args.warmup = RunOptions.warmup
    if args.rep is None:
        args.rep = RunOptions.rep
    if args.device == "cuda" and not torch.cuda.is_available():
        print("sonicmoe bench: --device cuda but no CUDA GPU is available", file=sys.stderr)
        return 2
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if not args.preset and not args.shape:
        args.preset = ["7b" if use_cuda else "tiny"]
    try:
        shapes = _shapes(args)
        backends = resolve_backends(args.backends)
        routings = None
        if args.routing:
            routings = tuple(r.strip() for r in args.routing.split(",") if r.strip())
            bad = [r for r in routings if r not in ROUTINGS]
            if bad:
                raise ValueError(f"--routing must be a comma list of {', '.join(ROUTINGS)}, got {bad}")
        if args.load_profile:
            from .load_profile import read_load_profile

            read_load_profile(args.load_profile)  # a bad file stops here, before any shape runs
        interpreted = interpreting()  # a TRITON_INTERPRET of no known meaning stops here too
    except (ValueError, OSError) as exc:
        print(f"sonicmoe bench: {exc}", file=sys.stderr)
        return 2
    dtype_name = args.dtype or ("bf16" if use_cuda else "fp32")
    if not use_cuda:
        triton_note = ("the triton backend runs through Triton's interpreter (slow)" if interpreted
                       else "the triton backend needs a GPU (or TRITON_INTERPRET=1)")
        print(f"no CUDA GPU: wall-clock timing (time.perf_counter), no memory numbers; {triton_note}")
    if args.activation != "swiglu":
        print(f"activation: {args.activation} (not SwiGLU); backends that take only SwiGLU are skipped")
    opts = RunOptions(
        backends=backends, device=device, dtype=DTYPES[dtype_name], mode=args.mode, routings=routings,
        m_tile=args.m_tile, rounding=args.rounding, rep=args.rep, seed=args.seed,
        warmup=args.warmup,
        check=args.check, check_grads=args.check_grads, check_max_T=args.check_max_T, tol=args.tol,
        router_variant=args.router_variant, memory=args.memory, loop_max_E=args.loop_max_E or None,
        load_profile=args.load_profile, poison=args.poison, verbose=not args.quiet, activation=args.activation,
    )
    env = env_info(device)
    now = _dt.datetime.now(_dt.timezone.utc)
    path = results_path(args.out or "benchmarks/results", env, args.tag, now)
    try:  # the folder made and writable before the first shape runs, not after it (its minutes lost to an error)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK):
            raise PermissionError(f"{path.parent} is not writable")
    except OSError as exc:
        print(f"sonicmoe bench: --out {args.out or 'benchmarks/results'}: cannot write results there: {exc}",
              file=sys.stderr)
        return 2
    saved_args = {**vars(args), "dtype": dtype_name, "backends": backends,
                  "device": str(device), "shapes": [list(s.dims) for s in shapes]}
    records: list[dict] = []

    def save(interrupted: bool = False):
        doc = build_results(records, env, argv, saved_args, now)
        if interrupted:
            doc["interrupted"] = True
        write_results(doc, path)
        return doc

    log = None if args.quiet else functools.partial(print, flush=True)
    threads = torch.get_num_threads()
    if not use_cuda and args.cpu_threads > 0:
        torch.set_num_threads(args.cpu_threads)
    try:
        run(shapes, opts, log=log, records=records, on_record=lambda rec: save())
    except KeyboardInterrupt:
        save(interrupted=True)
        print(f"\ninterrupted; partial results in {path}", file=sys.stderr)
        return 130
    finally:
        torch.set_num_threads(threads)
    doc = save()
    print()
    print(terminal_table(doc))
    print(f"\nresults: {path}")
    if args.plot:
        from .plots import plot_from_file

        plot_from_file(str(path), None, log=print)
    bad = [(r["name"], n, b["status"]) for r in records for n, b in (r.get("backends") or {}).items()
           if b.get("status") in ("FAIL", "error")]
    bad += [(r["name"], "-", r["status"]) for r in records if r.get("status") == "error"]
    if bad:
        print("not ok: " + ", ".join(f"{s} {n} {st}" for s, n, st in bad), file=sys.stderr)
        return 1
    if not any(b.get("status") == "ok" for r in records for b in (r.get("backends") or {}).values()):
        # a run that timed nothing is not a benchmark: a script reading exit codes must not take it for one
        print("not ok: nothing was timed (every shape or backend was skipped or ran out of memory; the reasons are "
              "in the notes above)", file=sys.stderr)
        return 1
    return 0
