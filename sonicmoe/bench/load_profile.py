"""Expert-load profiles: benchmark routing as imbalanced as a trained model's (SPEC §7).

A random router spreads the T·K pairs almost evenly over the E experts. A trained router does not: in our own
``sonicmoe train --preset h100`` run (E = 64, K = 8, 150 steps, aux_loss_coef 0.01; ``benchmarks/results/
2026-11-21_nvidia-h200_train/log.json``) the busiest expert of a layer received 1.4 times the mean load and the
idlest 0.53 times (averaged over the 8 layers, the loads summed over all steps: a single step is more uneven).
Logs written from session 80 on also hold each step's load sorted, summed over the steps (``step_sorted_counts``):
the typical step's curve, which a profile prefers.

A profile is the descending curve of load fractions of a trained model's experts. :func:`target_load` resamples
it to the benchmark's E (so a 64-expert profile shapes a 128-expert shape) and deals the fractions to the experts
in a seeded random order; :func:`calibrate_router` then scales each row of the router weight W_r (E, d) until the
top-K of the logits X W_rᵀ gives every expert its fraction of the T·K pairs. The router stays a plain linear map,
so every backend — and the timings that include the router — sees the same, realistic, routing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def _load_lists(path: str | Path, per_step: bool) -> tuple[object, str]:
    """The file's JSON with a train log's per-layer loads picked out, and which loads they are: ``step_sorted_counts``
    (each step's, sorted, summed), ``counts`` (summed over training) or ``list`` (a file of lists)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        return data, "list"
    data = data.get("expert_load", data)
    if not isinstance(data, dict):
        return data, "list"
    layers = data.get("per_layer", [])
    key = "step_sorted_counts" if per_step and layers and all(
        isinstance(x, dict) and "step_sorted_counts" in x for x in layers) else "counts"
    return [x.get(key) if isinstance(x, dict) else None for x in layers], key


def load_profile_kind(path: str | Path, per_step: bool = True) -> str:
    """Which loads :func:`read_load_profile` reads from ``path``: ``step_sorted_counts``, ``counts`` or ``list``."""
    return _load_lists(path, per_step)[1]


def _is_count(v) -> bool:
    """A JSON number (not a bool) that is finite and >= 0."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v)) and v >= 0
    except OverflowError:  # an int beyond float64
        return False


def read_load_profile(path: str | Path, per_step: bool = True) -> torch.Tensor:
    """The load curve in a file: (E_src,) float64 fractions, descending, summing to 1.

    Accepted files: a ``sonicmoe train`` ``log.json`` (its ``expert_load.per_layer[*]``: the typical step's sorted
    load ``step_sorted_counts`` where the log has it and ``per_step``, else the load summed over training,
    ``counts``), the ``expert_load`` dict alone, a JSON list of per-expert counts or fractions, or a list of such
    lists (one per layer). Each list is normalised and sorted; several lists are averaged position by position (the
    typical curve, whichever experts were busy).

    Raises:
        ValueError: the file holds none of these, a list is empty, or has a negative, non-finite or all-zero load.
    """
    data, _ = _load_lists(path, per_step)
    if isinstance(data, list) and data and not any(isinstance(v, list) for v in data):
        data = [data]
    if not (isinstance(data, list) and data and all(isinstance(row, list) and row for row in data)):
        raise ValueError(f"{path}: no expert load found (expected a sonicmoe train log.json, its expert_load, or a "
                         "list of per-expert counts, or of such lists)")
    curves = []
    for row in data:
        if not all(_is_count(v) for v in row) or not any(v > 0 for v in row):
            raise ValueError(f"{path}: a load list must hold finite numbers >= 0, not all zero; got {row[:8]}...")
        loads = torch.tensor([float(v) for v in row], dtype=torch.float64)
        loads = loads / loads.max()  # first: a sum of counts near the float64 maximum would overflow
        curves.append((loads / loads.sum()).sort(descending=True).values)
    if len({len(c) for c in curves}) != 1:
        raise ValueError(f"{path}: the layers' load lists differ in length: {sorted({len(c) for c in curves})}")
    return torch.stack(curves).mean(0)


def resample_load(curve: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) descending fractions summing to 1 with the shape of ``curve`` (E_src,): the cumulative load, linear
    between the source's experts, read at E equal steps (E = E_src gives ``curve`` back)."""
    src = curve.shape[0]
    cum = torch.cat([curve.new_zeros(1), curve.cumsum(0)])
    q = torch.linspace(0, src, num_experts + 1, dtype=torch.float64)
    lo = q.floor().long().clamp(max=src - 1)
    at = cum[lo] + (q - lo) * (cum[lo + 1] - cum[lo])
    return at.diff().clamp_min(0.0) / at[-1]


def target_load(path: str | Path, num_experts: int, seed: int = 0) -> torch.Tensor:
    """(E,) float64 target fraction of the pairs for each expert: the file's curve (:func:`read_load_profile`)
    resampled to E and dealt to the experts in the order of a permutation seeded by ``seed``."""
    fractions = resample_load(read_load_profile(path), num_experts)
    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed))
    return fractions[order]


def calibrate_router(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, target: torch.Tensor, *,
                     tol: float = 0.02, max_iters: int = 30) -> tuple[torch.Tensor, float]:
    """Scale the rows of W_r so that top-K of X W_rᵀ gives expert e the fraction ``target[e]`` of the T·K pairs.

    A logit's spread grows with its row's scale, so a larger row is chosen more often. Each step multiplies the
    scales by (target / achieved)^η, η = 0.5/(1 + step/4), on the logits of all T tokens in float32 (one GEMM, then
    one top-k per step), until every expert is within ``tol`` of its target (relative) or ``max_iters`` steps.
    Measured: (24576, 1536, ·, 128, 8) with our trained profile within 0.8% after 5 steps (CPU, float32).

    An expert with target 0 (an idle expert in a measured profile: :func:`read_load_profile` accepts zero counts) has
    its row scaled to 0 at the first step (log 0 = -inf); it keeps the pairs whose token's other logits are negative
    enough, since a zero logit still wins those. The deviation is measured over the experts with a target > 0
    (relative to 0 it would be infinite, and every step would run).

    Args:
        x: (T, d) tokens. router_weight: (E, d). top_k: K. target: (E,) fractions, each >= 0, summing to 1.

    Returns:
        (W_r scaled, in router_weight's dtype and without grad; the largest relative deviation reached, in the
        float32 logits — the caller's router may round them differently, as bf16 W_r does).

    Raises:
        ValueError: no fraction of ``target`` is > 0 (the deviation would have no expert to be measured over).
    """
    w = router_weight.detach().float()
    logits = x.detach().float() @ w.t()  # (T, E); scaling row e of W_r scales column e
    goal = target.to(device=logits.device, dtype=torch.float64)
    live = goal > 0
    if not bool(live.any()):
        raise ValueError("target: no expert has a fraction > 0 (expected (E,) fractions >= 0 summing to 1)")
    log_scale = torch.zeros_like(goal)
    dev = float("inf")
    for step in range(max_iters):
        ids = (logits * log_scale.exp().float()).topk(top_k, dim=1).indices
        got = torch.bincount(ids.reshape(-1), minlength=goal.shape[0]).double() / max(ids.numel(), 1)
        dev = float(((got - goal).abs() / goal)[live].max())  # a host read per step: setup, outside any timing
        if dev <= tol or step == max_iters - 1:
            break
        log_scale += 0.5 / (1 + step / 4) * (goal.log() - got.clamp_min(0.1 / ids.numel()).log())
    return (w * log_scale.exp().float()[:, None]).to(router_weight.dtype), dev
