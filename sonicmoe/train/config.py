"""Options of the ``sonicmoe train`` job: one dataclass and the named presets.

Letters (SPEC §1): d model width, n expert intermediate size, E experts, K experts per token;
each MoE layer sees T = batch_size · seq_len tokens per step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..config import MoEConfig

MIB = 1 << 20

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "amp-bf16")

# Each preset sets these fields; command-line options override them one by one.
PRESETS: dict[str, dict[str, Any]] = {
    # Under a minute on 2 idle CPU cores (a few minutes when they are shared): d=128, 2 layers,
    # E=16, K=4, n=64 (G = d/n = 2, ρ = K/E = 1/4), T = 32·128 = 4096 tokens per step.
    "cpu-tiny": {
        "steps": 300,
        "batch_size": 32,
        "seq_len": 128,
        "d_model": 128,
        "layers": 2,
        "heads": 4,
        "experts": 16,
        "top_k": 4,
        "expert_size": 64,
        "lr": 3e-3,
        "warmup": 30,
        "eval_every": 100,
        "eval_batches": 16,
        "log_every": 10,
        "save_every": 100,
        "profile_every": 50,
        "max_bytes": 4 * MIB,
    },
    # One H100: d=768, 8 layers, E=64, K=8, n=256 (granularity G = d/n = 3, ρ = K/E = 1/8),
    # T = 32·1024 = 32768 tokens per MoE call (mean T_e = T·K/E = 4096), bf16 parameters.
    "h100": {
        "steps": 1000,
        "batch_size": 32,
        "seq_len": 1024,
        "d_model": 768,
        "layers": 8,
        "heads": 12,
        "experts": 64,
        "top_k": 8,
        "expert_size": 256,
        "lr": 1e-3,
        "warmup": 100,
        "eval_every": 100,
        "eval_batches": 16,
        "log_every": 10,
        "save_every": 250,
        "profile_every": 100,
        "max_bytes": 64 * MIB,
    },
}


@dataclasses.dataclass
class TrainConfig:
    """Everything one training run depends on (stored in the JSON log and in each checkpoint).

    Model: ``d_model`` (d), ``layers``, ``heads`` (d must divide by heads), ``experts`` (E),
    ``top_k`` (K), ``expert_size`` (n); byte-level vocabulary of 256.
    Data: ``data`` (a text file or a directory of text files; ``None``: the CPython standard library's
    ``.py`` sources), ``max_bytes`` read at most, ``val_fraction`` of them (the tail) held out.
    Optimisation: AdamW (``lr``, ``beta1``, ``beta2``, ``weight_decay``), linear warm-up over
    ``warmup`` steps then cosine decay to ``min_lr_ratio · lr`` at ``steps``; gradients clipped to
    global norm ``grad_clip``; each step sees ``batch_size`` sequences of ``seq_len`` bytes.
    MoE options passed to :class:`sonicmoe.MoE`: ``backend``, ``routing``, ``rounding``, ``m_tile``,
    ``aux_loss_coef``, ``z_loss_coef``, ``router_order``, ``renormalize``, ``routed_scaling_factor``, ``n_group``,
    ``topk_group``, and ``shared_expert_size`` (n_s, the layer's ``shared_intermediate_size``; 0: no shared expert)
    with ``shared_expert_gate``;
    ``activation`` (the experts' gated activation: ``"swiglu"``, or ``"clamped_swiglu"``, gpt-oss's clamped SwiGLU;
    the shared expert's too), ``router_bias`` (the router ``gate`` has a bias (E,), as gpt-oss's) and ``expert_bias``
    (the layer's ``bias``: expert biases b1 (E, 2n) and b2 (E, d), as gpt-oss's; :data:`sonicmoe.GPT_OSS_OPTIONS`
    sets all three); these change the model's parameters, so a checkpoint resumes only with its own values;
    ``bias_update_rate`` > 0 (with ``router_order="sigmoid_then_topk"``) moves each layer's selection bias after
    every optimizer step by that much (:meth:`sonicmoe.MoE.update_expert_bias`, counts summed over the ranks;
    DeepSeek-V3's auxiliary-loss-free balancing, usually with ``aux_loss_coef`` 0 or small). 0: never.
    Parallelism (under ``torchrun``): data-parallel over the W ranks; ``expert_parallel`` P > 1 splits each MoE
    layer's experts over groups of P ranks (:mod:`sonicmoe.expert_parallel`; P must divide W and E).
    Run: ``device``/``dtype`` (``auto``: CUDA + bfloat16 when there is a GPU, else CPU + float32;
    ``amp-bf16``: float32 parameters, forward under ``torch.autocast`` in bfloat16),
    ``eval_every``/``eval_batches``, ``log_every``, ``save_every`` (0: only at the end),
    ``profile_every`` (time the MoE layers on every such step; 0: never), ``graph_moe`` (each MoE layer's training
    forward and backward replayed from CUDA graphs, ``torch.cuda.make_graphed_callables``: the layers' host time
    gone; CUDA, the triton backend, one process, not ``amp-bf16``), ``stop_after`` (end this
    process after that step, with a checkpoint, as if interrupted; the schedule still runs to
    ``steps``), ``out`` directory, ``resume`` checkpoint, ``progress`` bar.
    """

    preset: str = "cpu-tiny"
    # data
    data: str | None = None
    max_bytes: int = 4 * MIB
    val_fraction: float = 0.05
    # model
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    experts: int = 8
    top_k: int = 2
    expert_size: int = 64
    # optimisation
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    # MoE layer options
    backend: str = "auto"
    routing: str = "topk"
    rounding: str = "nearest"
    m_tile: int = 128
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    router_order: str = "topk_then_softmax"
    renormalize: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_expert_size: int = 0
    shared_expert_gate: bool = False
    activation: str = "swiglu"
    router_bias: bool = False
    expert_bias: bool = False
    bias_update_rate: float = 0.0
    # run
    device: str = "auto"
    dtype: str = "auto"
    eval_every: int = 100
    eval_batches: int = 16
    log_every: int = 10
    save_every: int = 100
    profile_every: int = 50
    stop_after: int | None = None
    out: str | None = None
    resume: str | None = None
    progress: bool = True
    deterministic: bool | None = None
    expert_parallel: int = 1
    graph_moe: bool = False

    def validate(self) -> None:
        """Raise ValueError for values no run can use."""
        positive = ("max_bytes", "d_model", "layers", "heads", "experts", "top_k", "expert_size", "steps",
                    "batch_size", "seq_len", "m_tile", "eval_batches", "log_every", "expert_parallel")
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:  # a flag is no count (True == 1 in Python)
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("warmup", "eval_every", "save_every", "profile_every", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise ValueError(f"d_model={self.d_model} must split into heads={self.heads} of even size")
        if self.experts % self.expert_parallel:
            raise ValueError(f"experts={self.experts} must be a multiple of expert_parallel={self.expert_parallel}")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} must be at most experts={self.experts}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in (0, 1), got {self.val_fraction}")
        if not 0 < self.lr < math.inf or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"need 0 < lr < inf and 0 <= min_lr_ratio <= 1, got {self.lr}, {self.min_lr_ratio}")
        # 0 would zero every gradient and a negative bound flip their sign (gradient ascent); inf: no clipping
        if not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 (inf: no clipping), got {self.grad_clip!r}")
        if not 0.0 <= self.weight_decay < math.inf:
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ValueError(f"beta1 and beta2 must lie in [0, 1), got {self.beta1!r}, {self.beta2!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 0 <= self.bias_update_rate < math.inf:
            raise ValueError(f"bias_update_rate must be a finite number >= 0, got {self.bias_update_rate!r}")
        if self.bias_update_rate and self.router_order != "sigmoid_then_topk":
            raise ValueError(f"bias_update_rate > 0 moves the selection bias of router_order='sigmoid_then_topk' "
                             f"only; got router_order={self.router_order!r}")
        if not isinstance(self.graph_moe, bool):
            raise ValueError(f"graph_moe must be a bool, got {self.graph_moe!r}")
        if self.graph_moe:
            if self.device == "cpu" or self.backend == "torch":
                raise ValueError("graph_moe captures the MoE layers in CUDA graphs: it needs device cuda (or auto "
                                 f"with a GPU) and the triton backend, got device={self.device!r}, "
                                 f"backend={self.backend!r}")
            if self.dtype == "amp-bf16":
                raise ValueError("graph_moe does not run under autocast (dtype='amp-bf16'); use bfloat16 or float32 "
                                 "parameters")
            if self.expert_parallel > 1:
                raise ValueError("graph_moe cannot capture an expert-parallel layer (its all-to-all sizes are read "
                                 "on the host); use expert_parallel=1")
        if self.stop_after is not None and (isinstance(self.stop_after, bool) or not isinstance(self.stop_after, int)
                                            or self.stop_after < 1):
            raise ValueError(f"stop_after must be a positive integer, got {self.stop_after}")
        # the layer's own refusals (groups, token rounding with groups, the shared expert's options, ...), up front
        MoEConfig(self.d_model, self.expert_size, self.experts, self.top_k, routing=self.routing,
                  rounding=self.rounding, m_tile=self.m_tile, aux_loss_coef=self.aux_loss_coef,
                  z_loss_coef=self.z_loss_coef, router_order=self.router_order, renormalize=self.renormalize,
                  routed_scaling_factor=self.routed_scaling_factor, n_group=self.n_group, topk_group=self.topk_group,
                  backend=self.backend, shared_intermediate_size=self.shared_expert_size,
                  shared_expert_gate=self.shared_expert_gate, activation=self.activation,
                  router_bias=self.router_bias, bias=self.expert_bias)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON- and checkpoint-friendly)."""
        return dataclasses.asdict(self)


def make_config(preset: str = "cpu-tiny", **overrides: Any) -> TrainConfig:
    """A :class:`TrainConfig` from a preset name plus field overrides (``None`` values are ignored).

    Raises:
        ValueError: unknown preset or field, or a value :meth:`TrainConfig.validate` rejects.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {preset!r}")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"unknown TrainConfig fields: {sorted(unknown)}")
    values = {"preset": preset, **PRESETS[preset]}
    values.update({k: v for k, v in overrides.items() if v is not None})
    cfg = TrainConfig(**values)
    cfg.validate()
    return cfg


def config_from_dict(values: dict[str, Any], **overrides: Any) -> TrainConfig:
    """Rebuild a :class:`TrainConfig` saved with :meth:`TrainConfig.to_dict` (e.g. from a checkpoint),
    then apply ``overrides`` (``None`` values are ignored). Fields unknown to this version are dropped."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    merged = {k: v for k, v in values.items() if k in fields}
    merged.update({k: v for k, v in overrides.items() if v is not None})
    cfg = TrainConfig(**merged)
    cfg.validate()
    return cfg
