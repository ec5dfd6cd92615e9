"""``sonicmoe train``: train a small MoE language model on real text and report speed and quality."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..config import ACTIVATIONS, BACKENDS, ROUNDING_SUBROUTINES, ROUTER_ORDERS, ROUTING_MODES
from ..env import interpreting
from .config import DEVICES, DTYPES, PRESETS, config_from_dict, make_config
from .data import ByteCorpus
from .loop import CHECKPOINT, LOG, PLOT, check_ranks, check_resume_corpus, load_checkpoint, resolve_device, train

DESCRIPTION = """Train a byte-level decoder-only transformer whose MLPs are sonicmoe.MoE layers.

Default data: the CPython standard library's .py sources (sorted, capped at --max-bytes); the last
--val-fraction of the bytes is the validation split. Writes log.json, loss.png and ckpt.pt to --out.
Presets: cpu-tiny (a few minutes on 2 CPU cores) and h100 (one H100, bf16); the default is h100 when a
CUDA GPU is visible, else cpu-tiny. Options below override the preset; with --resume the checkpoint's
configuration is used and only the options given override it.

Data-parallel over several GPUs (or CPU processes): torchrun --nproc-per-node N -m sonicmoe train ...
--batch-size is then the global batch, split evenly over the N ranks; rank 0 prints and writes the files."""


def _preset_help() -> str:
    """Every value each preset sets (an option left out takes it: the options below without a stated default)."""
    lines = [f"{name}: " + ", ".join(f"{k}={v}" for k, v in values.items()) for name, values in PRESETS.items()]
    return ("the values of every option left out that the preset sets (default cpu-tiny on CPU, h100 on a GPU): "
            + "; ".join(lines))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (every override defaults to ``None``: 'take it from the preset')."""
    p = argparse.ArgumentParser(prog="sonicmoe train", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=tuple(PRESETS), default=None, help=_preset_help())
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="PATH", help="a text file or a directory of text files "
                   "(default: the Python standard library's .py sources)")
    g.add_argument("--max-bytes", type=int, help="read at most this many bytes of text")
    g.add_argument("--val-fraction", type=float, help="share of the bytes (the tail) held out (default 0.05)")
    g = p.add_argument_group("model (letters of SPEC §1)")
    g.add_argument("--d-model", type=int, help="d, model width")
    g.add_argument("--layers", type=int, help="transformer blocks")
    g.add_argument("--heads", type=int, help="attention heads")
    g.add_argument("--experts", type=int, help="E, experts per MoE layer")
    g.add_argument("--top-k", type=int, help="K, experts per token")
    g.add_argument("--expert-size", type=int, help="n, expert intermediate size")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, help="optimizer steps (the schedule's length)")
    g.add_argument("--batch-size", type=int, help="sequences per step (B)")
    g.add_argument("--seq-len", type=int, help="bytes per sequence (L); each MoE layer sees T = B·L tokens")
    g.add_argument("--lr", type=float, help="peak learning rate (AdamW, warm-up then cosine)")
    g.add_argument("--warmup", type=int, help="warm-up steps")
    g.add_argument("--weight-decay", type=float, help="AdamW weight decay (default 0.1)")
    g.add_argument("--grad-clip", type=float, help="global gradient-norm clip (default 1.0)")
    g.add_argument("--seed", type=int, help="seed of the initialisation and the batches (default 0)")
    g = p.add_argument_group("MoE layer")
    g.add_argument("--backend", choices=BACKENDS, help="auto: triton on CUDA, torch on CPU")
    g.add_argument("--routing", choices=ROUTING_MODES, help="training routing (eval always uses top-k)")
    g.add_argument("--rounding", choices=ROUNDING_SUBROUTINES, help="token-rounding subroutine")
    g.add_argument("--m-tile", type=int, help="M_tile for token rounding (default 128)")
    g.add_argument("--aux-loss-coef", type=float, help="load-balancing loss weight (default 0.01)")
    g.add_argument("--z-loss-coef", type=float, help="router z-loss weight (default 0)")
    g.add_argument("--router-order", choices=ROUTER_ORDERS, help="how the router scores its top-k (default "
                   "topk_then_softmax; sigmoid_then_topk: DeepSeek-V3)")
    g.add_argument("--renormalize", action=argparse.BooleanOptionalAction, default=None,
                   help="divide the K chosen probabilities by their sum (softmax_then_topk, sigmoid_then_topk)")
    g.add_argument("--routed-scaling-factor", type=float, help="every score times this (default 1; DeepSeek-V3 2.5)")
    g.add_argument("--n-group", type=int, help="sigmoid_then_topk: experts in this many groups (default 1: none)")
    g.add_argument("--topk-group", type=int, help="with --n-group: the groups each token picks its experts in")
    g.add_argument("--shared-expert-size", type=int, metavar="N_S", help="a shared expert of this width in every "
                   "MoE layer, which every token passes through (DeepSeek-V2/V3, Qwen2-MoE; default 0: none)")
    g.add_argument("--shared-expert-gate", action=argparse.BooleanOptionalAction, default=None,
                   help="scale the shared expert's output by a learned sigmoid gate per token (Qwen2-MoE)")
    g.add_argument("--activation", choices=ACTIVATIONS, help="the experts' gated activation (the shared expert's "
                   "too): swiglu, silu(gate)·up (default), or clamped_swiglu, gpt-oss's clamped SwiGLU "
                   "(gate <= 7, up in [-7, 7], (up + 1)·gate·sigmoid(1.702·gate))")
    g.add_argument("--router-bias", action=argparse.BooleanOptionalAction, default=None,
                   help="the router's linear map gets a learned bias per expert (gpt-oss; default off)")
    g.add_argument("--expert-bias", action=argparse.BooleanOptionalAction, default=None,
                   help="the experts get learned biases b1 (E, 2n) and b2 (E, d) (gpt-oss; default off). "
                   "gpt-oss's block: --activation clamped_swiglu --router-bias --expert-bias")
    g.add_argument("--bias-update-rate", type=float, help="sigmoid_then_topk: move the selection bias by this "
                   "after each step toward balanced loads (auxiliary-loss-free; DeepSeek-V3 1e-3; default 0: off)")
    g.add_argument("--expert-parallel", type=int, metavar="P", help="split each MoE layer's experts over groups "
                   "of P ranks (expert parallelism inside data parallelism; under torchrun, P dividing the ranks "
                   "and E; default 1)")
    g = p.add_argument_group("run")
    g.add_argument("--device", choices=DEVICES, help="auto: cuda when available")
    g.add_argument("--dtype", choices=DTYPES, help="parameter dtype; auto: bfloat16 on CUDA (with float32 "
                   "master weights in the optimizer), float32 on CPU; amp-bf16: float32 parameters, forward "
                   "under torch.autocast in bfloat16")
    g.add_argument("--eval-every", type=int, help="validate every N steps (0: only at the end)")
    g.add_argument("--eval-batches", type=int, help="validation batches (fixed windows of the val split)")
    g.add_argument("--log-every", type=int, help="read back and log metrics every N steps")
    g.add_argument("--save-every", type=int, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--profile-every", type=int, help="time the MoE layers (with device syncs) on every "
                   "N-th step (0: never)")
    g.add_argument("--stop-after", type=int, metavar="STEP", help="stop after this step with a checkpoint, "
                   "as if interrupted (the LR schedule still spans --steps)")
    g.add_argument("--out", metavar="DIR", help="output directory (default runs/<preset>-<time>, or the "
                   "checkpoint's directory with --resume)")
    g.add_argument("--resume", metavar="PATH", help="continue from a checkpoint (ckpt.pt)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar; print log lines")
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.use_deterministic_algorithms for the run (default: on CPU only, where the "
                   "same seed then gives bit-identical losses)")
    g.add_argument("--graph-moe", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each MoE layer's training forward and backward from CUDA graphs "
                   "(torch.cuda.make_graphed_callables): no host time in the layers; CUDA and one process only")
    return p


_OVERRIDES = ("data", "max_bytes", "val_fraction", "d_model", "layers", "heads", "experts", "top_k",
              "expert_size", "steps", "batch_size", "seq_len", "lr", "warmup", "weight_decay", "grad_clip",
              "seed", "backend", "routing", "rounding", "m_tile", "aux_loss_coef", "z_loss_coef", "router_order",
              "renormalize", "routed_scaling_factor", "n_group", "topk_group", "shared_expert_size",
              "shared_expert_gate", "activation", "router_bias", "expert_bias", "bias_update_rate", "device",
              "dtype", "eval_every", "eval_batches", "log_every", "save_every", "profile_every", "stop_after",
              "deterministic", "expert_parallel", "graph_moe")


# options that shape the model's parameters or say how they are read (the attention heads' split of the projections,
# the experts' activation, the router's score function): a resumed run must keep the checkpoint's values
_PARAMETER_SHAPES = ("d_model", "layers", "experts", "expert_size", "shared_expert_size", "shared_expert_gate",
                     "router_bias", "expert_bias", "heads", "activation", "router_order")


def _summary(log: dict[str, Any], out: Path) -> str:
    lines = []
    val = log["final_val_loss"]
    val_s = f"{val:.4f} nats/byte ({log['final_val_bpb']:.3f} bits/byte)" if val is not None else "-"
    train_s = f"{log['final_train_loss']:.4f}" if log["final_train_loss"] is not None else "-"
    lines.append(f"done: step {log['steps_done']} in {log['wall_time_s']:.1f} s wall; "
                 f"final val loss {val_s}; final train loss {train_s}")
    rate = log["tokens_per_s"]
    lines.append(f"throughput: {rate:,.0f} tokens/s" if rate else "throughput: - (too few steps)")
    share = log["moe_time_share"]
    if share is not None:
        t = log["moe_time"]
        n = t["profiled_steps"]
        lines.append(f"MoE layers: {100 * share:.1f}% of step time ({1e3 * t['moe_s'] / n:.1f} ms of "
                     f"{1e3 * t['step_s'] / n:.1f} ms per profiled step, {n} profiled steps)")
    else:
        lines.append("MoE layers: not profiled (see --profile-every)")
    mem = log["peak_memory"]
    lines.append(f"peak memory: {mem['mib']:.0f} MiB ({mem['kind']})")
    load = log["expert_load"]
    per = ", ".join(f"[{x['min_frac']:.3f}, {x['max_frac']:.3f}]" for x in load["per_layer"])
    lines.append(f"expert load (fraction of routed pairs, min/max per layer; uniform = "
                 f"{load['per_layer'][0]['mean_frac']:.3f}): {per}; mean CV {load['mean_cv']:.3f}")
    if "mean_step_max_over_mean" in load:
        lines.append(f"per step, the busiest expert's load over the mean, averaged over layers: "
                     f"{load['mean_step_max_over_mean']:.2f} (summed over steps: {load['mean_max_over_mean']:.2f})")
    plot = out / PLOT
    files = [out / LOG] + [f for f in (out / CHECKPOINT, plot) if f.exists()]
    lines.append("files: " + ", ".join(str(f) for f in files))
    return "\n".join(lines)


def _preflight(cfg) -> None:
    """ValueError, before any data or model is built, for options this process cannot run: ``--device cuda``
    without a GPU, ``--graph-moe`` off CUDA or with several ranks, ``--expert-parallel`` that does not divide the
    ranks torchrun started (``WORLD_SIZE``; 1 without torchrun), ``--backend triton`` on CPU without
    ``TRITON_INTERPRET=1`` (as Triton reads it: :func:`sonicmoe.env.interpreting`, which raises on a value of no
    known meaning) (:func:`train` checks the ranks itself too, with the real process group)."""
    try:
        device = resolve_device(cfg.device)
    except RuntimeError as e:
        raise ValueError(str(e)) from None
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} (set by torchrun) must be an int") from None
    check_ranks(cfg, device, world)
    if device.type == "cpu" and cfg.backend == "triton" and not interpreting():
        raise ValueError("--backend triton on CPU runs only under Triton's interpreter: set TRITON_INTERPRET=1 "
                         "(slow), or use --backend torch")


def main(argv: list[str] | None = None) -> int:
    """Run ``sonicmoe train`` with ``argv`` (without the ``train`` word); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    overrides = {k: getattr(args, k) for k in _OVERRIDES}
    checkpoint = None
    try:
        if args.resume:
            if not Path(args.resume).is_file():
                parser.error(f"--resume {args.resume}: no such file")
            checkpoint = load_checkpoint(args.resume)
            if args.preset is not None:
                print(f"--preset {args.preset} ignored: resuming with the checkpoint's configuration")
            base = {**checkpoint["config"], "stop_after": None}
            saved = config_from_dict(base)  # a checkpoint from before a field existed: that field's default
            for k in _PARAMETER_SHAPES:
                if overrides[k] is not None and overrides[k] != getattr(saved, k):
                    parser.error(f"--{k.replace('_', '-')}: the checkpoint's model has {k}={getattr(saved, k)!r}; a "
                                 "resumed run keeps the options that shape its parameters or how they are read")
            if args.seed is not None and args.seed != saved.seed:  # logged, but the checkpoint's RNG states rule
                parser.error(f"--seed {args.seed}: the checkpoint's run has seed={saved.seed}; a resumed run "
                             "continues its random streams (batches, initialisation, stochastic rounding)")
            out = args.out or str(Path(args.resume).parent)
            cfg = config_from_dict(base, **overrides, resume=args.resume, out=out)
            end = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
            if int(checkpoint["step"]) >= end:  # train() refuses it too; here without a traceback
                parser.error(f"--resume {args.resume}: the checkpoint is at step {checkpoint['step']}, at or past "
                             f"this run's end (step {end}): nothing to train (raise --steps to continue it)")
        else:
            preset = args.preset or ("h100" if torch.cuda.is_available() else "cpu-tiny")
            out = args.out or str(Path("runs") / f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}")
            cfg = make_config(preset, **overrides, out=out)
        _preflight(cfg)
    except ValueError as e:
        parser.error(str(e))
    unused = [f"--{k.replace('_', '-')}" for k in ("rounding", "m_tile") if overrides[k] is not None]
    if unused and cfg.routing != "token_rounding":
        print(f"note: {' and '.join(unused)} apply to --routing token_rounding only; this run routes by "
              f"{cfg.routing}", file=sys.stderr)
    cfg.progress = not args.no_progress
    if cfg.data is not None and not Path(cfg.data).exists():
        parser.error(f"--data {cfg.data}: no such file or directory")
    if cfg.data is not None and Path(cfg.data).is_dir() and Path(cfg.out).resolve().is_relative_to(
            Path(cfg.data).resolve()):
        parser.error(f"--out {cfg.out} lies inside --data {cfg.data}: the run's own files (log, checkpoint) would "
                     "become training data, and a resume would find another corpus; put --out elsewhere")
    # what would otherwise fail in train() with a traceback, before any model is built
    try:
        corpus = ByteCorpus.load(cfg.data, cfg.max_bytes, cfg.val_fraction)
        corpus.check_seq_len(cfg.seq_len)
        if checkpoint is not None:
            check_resume_corpus(checkpoint, corpus.digest)
    except (OSError, ValueError) as e:
        msg = str(e)  # the loader's own errors for a missing or empty --data name the option and the path already
        parser.error(msg if msg.startswith("--data ") else f"--data {cfg.data or '(the standard library)'}: {msg}")
    try:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        if not os.access(cfg.out, os.W_OK):
            raise PermissionError(f"{cfg.out} is not writable")
    except OSError as e:
        parser.error(f"--out {cfg.out}: cannot write there: {e}")
    log = train(cfg, checkpoint, corpus)
    if int(os.environ.get("RANK", "0")) == 0:  # data-parallel (torchrun): rank 0 reports
        print(_summary(log, Path(cfg.out)))
    if log["first_nonfinite_step"] is not None:
        print(f"the run diverged: non-finite training loss from step {log['first_nonfinite_step']}", file=sys.stderr)
        return 1
    return 0
