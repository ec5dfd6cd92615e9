"""What a run reports: environment, peak memory, expert-load statistics, the JSON log and the plot."""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ..provenance import git_commit


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    return git_commit()


def device_name(device: torch.device) -> str:
    """The GPU's name on CUDA, else the CPU's description."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def environment(device: torch.device) -> dict[str, Any]:
    """Device, versions, commit and date, for the log."""
    env = {
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "sonicmoe": _version("sonicmoe"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "commit": _git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["driver"] = _nvidia_driver()
    return env


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def peak_memory(device: torch.device) -> dict[str, Any]:
    """Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA, the process's max RSS on CPU (MiB)."""
    if device.type == "cuda":
        return {"kind": "cuda_max_memory_allocated",
                "mib": torch.cuda.max_memory_allocated(device) / 2**20}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes
    return {"kind": "cpu_max_rss", "mib": rss_bytes / 2**20}


def expert_load_summary(counts: list[list[int]], step_sorted: list[list[int]] | None = None) -> dict[str, Any]:
    """Statistics of routed pairs per expert, summed over training steps.

    Args:
        counts: per MoE layer, the E counts T_e summed over steps.
        step_sorted: per MoE layer, each step's E counts sorted in descending order and summed over the steps
            (position i: the i-th busiest expert of each step, whichever it was; under data parallelism each rank's
            own counts, sorted, summed over the ranks). None or all zero: not reported.

    Returns:
        ``per_layer`` (one dict per layer: ``counts``, ``fractions``, ``min_frac``, ``max_frac``,
        ``mean_frac`` = 1/E, ``cv`` = std/mean of the counts, ``max_over_mean``; with ``step_sorted`` also
        ``step_sorted_counts``, ``step_max_over_mean`` and ``step_min_over_mean``: the busiest and idlest expert of
        the typical step against the mean) and the layer averages ``mean_cv`` and ``mean_max_over_mean`` (and
        ``mean_step_max_over_mean``).
    """
    layers = []
    per_step = step_sorted is not None and any(any(row) for row in step_sorted)
    for i, row in enumerate(counts):
        total = sum(row) or 1
        frac = [c / total for c in row]
        mean = 1.0 / len(row)
        std = math.sqrt(sum((f - mean) ** 2 for f in frac) / len(frac))
        layer = {"counts": row, "fractions": frac, "min_frac": min(frac), "max_frac": max(frac),
                 "mean_frac": mean, "cv": std / mean, "max_over_mean": max(frac) / mean}
        if per_step:
            srt = step_sorted[i]
            layer.update(step_sorted_counts=srt, step_max_over_mean=srt[0] * len(srt) / (sum(srt) or 1),
                         step_min_over_mean=srt[-1] * len(srt) / (sum(srt) or 1))
        layers.append(layer)
    n = max(1, len(layers))
    out = {"per_layer": layers, "mean_cv": sum(x["cv"] for x in layers) / n,
           "mean_max_over_mean": sum(x["max_over_mean"] for x in layers) / n}
    if per_step:
        out["mean_step_max_over_mean"] = sum(x["step_max_over_mean"] for x in layers) / n
    return out


def write_json(path: Path, log: dict[str, Any]) -> None:
    """Write the log atomically (temporary file, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(log, indent=1))
    os.replace(tmp, path)


def plot_losses(path: Path, steps: list[dict[str, Any]], evals: list[dict[str, Any]], title: str) -> bool:
    """Train loss per step (with a moving average) and validation loss, to a PNG.

    Returns False, after printing why, when matplotlib is not installed.
    """
    return plot_runs(path, [("", steps, evals)], title)


def plot_runs(path: Path, runs: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]], title: str,
              raw: bool | None = None, ylim: tuple[float, float] | None = None) -> bool:
    """Several runs' train loss (moving average; per step too when ``raw``, by default for one run) and
    validation loss on one axis, to a PNG. ``runs``: (label, steps, evals) as in ``log.json``; ``ylim``: the loss
    axis' (low, high), else matplotlib's choice.

    Returns False, after printing why, when matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no loss plot (pip install 'sonicmoe[train]')")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    raw = len(runs) == 1 if raw is None else raw
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for i, (label, steps, evals) in enumerate(runs):
        color, val_color = (f"C{2 * i}", f"C{2 * i + 1}") if len(runs) > 1 else ("tab:blue", "tab:red")
        prefix = f"{label} " if label else ""
        if steps:
            xs = [s["step"] for s in steps]
            ys = [s["loss"] for s in steps]
            if raw:
                ax.plot(xs, ys, color=color, alpha=0.3, linewidth=0.8, label=f"{prefix}train (per step)")
            window = max(1, len(ys) // 50)
            smooth, acc = [], 0.0
            for j, y in enumerate(ys):
                acc += y - (ys[j - window] if j >= window else 0.0)
                smooth.append(acc / min(j + 1, window))
            ax.plot(xs, smooth, color=color, linewidth=1.5, label=f"{prefix}train ({window}-step mean)")
        if evals:
            ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o-", color=val_color,
                    label=f"{prefix}validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
