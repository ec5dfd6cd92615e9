"""Benchmark shapes (T, d, n, E, K) and useful-FLOP counting (SPEC §1, §6).

The presets copy the numbers of the project's ``configs.json`` (the SonicMoE paper's Table 9, Fig. 6,
Fig. 15-17 and public model cards) so the package needs no file outside itself at run time;
``tests/test_bench.py`` checks that the copies still match.

Letters: T tokens, d hidden size, n expert intermediate size, E experts, K experts per token,
TK routed (token, expert) pairs, G = d/n granularity, ρ = K/E activation ratio.
"""

from __future__ import annotations

import dataclasses

ROUTINGS = ("topk", "token_rounding")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One MoE layer problem.

    Attributes:
        name: label used in tables, JSON and plots.
        T: tokens per micro-batch. d: hidden size. n: expert intermediate size.
        E: number of experts. K: experts per token (top-k).
        group: shapes compared with each other in plots (e.g. ``"7B"`` for the 7B granularity sweep).
        routings: routing modes this shape runs by default (``None``: the command line's ``--routing``).
        T_preset: T before ``--max-T`` shrank it (``None`` when unchanged).
    """

    name: str
    T: int
    d: int
    n: int
    E: int
    K: int
    group: str = "custom"
    routings: tuple[str, ...] | None = None
    T_preset: int | None = None

    def __post_init__(self) -> None:
        for letter in ("T", "d", "n", "E", "K"):
            v = getattr(self, letter)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{letter} must be a positive int, got {v!r} (shape {self.name!r})")
        if self.K > self.E:
            raise ValueError(f"K={self.K} must not exceed E={self.E} (shape {self.name!r})")

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        """(T, d, n, E, K)."""
        return (self.T, self.d, self.n, self.E, self.K)

    @property
    def G(self) -> float:
        """Granularity d/n."""
        return self.d / self.n

    @property
    def rho(self) -> float:
        """Activation ratio K/E."""
        return self.K / self.E

    @property
    def TK(self) -> int:
        """Routed pairs under plain top-k, T·K."""
        return self.T * self.K

    def with_max_T(self, max_T: int | None) -> Shape:
        """This shape with T capped at ``max_T`` tokens (for quick runs); unchanged if already smaller."""
        if max_T is None or self.T <= max_T:
            return self
        return dataclasses.replace(self, T=int(max_T), T_preset=self.T_preset or self.T)


def useful_flops(tk: int, n: int, d: int) -> dict[str, int]:
    """Useful FLOPs of the expert computation for TK routed pairs (SPEC §6; router excluded).

    Forward: up-projection 2·TK·d·2n + down-projection 2·TK·n·d = 6·TK·n·d.
    Backward: twice the forward (grads of activations and of weights) = 12·TK·n·d.

    Returns:
        ``{"fwd": 6·TK·n·d, "bwd": 12·TK·n·d, "total": 18·TK·n·d}`` in FLOPs.
    """
    base = int(tk) * int(n) * int(d)
    return {"fwd": 6 * base, "bwd": 12 * base, "total": 18 * base}


def tflops(flops: float, ms: float | None) -> float | None:
    """Throughput in TFLOP/s of ``flops`` done in ``ms`` milliseconds (None if ms is missing or ≤ 0)."""
    if ms is None or not ms > 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def spec_held_bytes(T: int, d: int, tk: int, n: int, elem_bytes: int = 2) -> int:
    """Activation bytes SPEC §3 says the forward keeps: X (T, d) and H (TK, 2n).

    2·T·d + 4·TK·n for bf16 (``elem_bytes`` = 2). X is the layer input, allocated before the
    forward, so the measured "held" memory (which excludes inputs) should be close to the H part.
    """
    return elem_bytes * (T * d + 2 * tk * n)


# ---------------------------------------------------------------------------------------------------
# presets (numbers copied from configs.json)

_BREAKDOWN_7B = {"7B": (24576, 1536, 256, 128, 8)}

_GRANULARITY = {
    "1.4B-n256": (40960, 768, 256, 128, 8),
    "1.4B-n512": (40960, 768, 512, 64, 4),
    "1.4B-n1024": (40960, 768, 1024, 32, 2),
    "7B-n256": (24576, 1536, 256, 128, 8),
    "7B-n512": (24576, 1536, 512, 64, 4),
    "7B-n1024": (24576, 1536, 1024, 32, 2),
    "30B-n256": (32768, 4096, 256, 256, 16),
    "30B-n512": (32768, 4096, 512, 128, 8),
    "30B-n1024": (32768, 4096, 1024, 64, 4),
    "120B-n512": (32768, 4096, 512, 256, 16),
    "120B-n1024": (32768, 4096, 1024, 128, 8),
    "120B-n2048": (32768, 4096, 2048, 64, 4),
}

_ISO_FLOPS_7B = {
    "7B-n64": (24576, 1536, 64, 512, 32),
    "7B-n128": (24576, 1536, 128, 256, 16),
    "7B-n256": (24576, 1536, 256, 128, 8),
    "7B-n512": (24576, 1536, 512, 64, 4),
    "7B-n1024": (24576, 1536, 1024, 32, 2),
}

_MODELS = {
    "olmoe-1b-7b": (32768, 2048, 1024, 64, 8),
    "qwen3-30b-a3b": (32768, 2048, 768, 128, 8),
    "qwen3-235b-a22b": (32768, 4096, 1536, 128, 8),
    "qwen3-next-80b-a3b": (32768, 2048, 512, 512, 10),
    "gpt-oss-120b": (32768, 2880, 2880, 128, 4),
    "deepseek-v3": (32768, 7168, 2048, 256, 8),
}

# M_tile = 128; E swept at fixed (T, d, n, K)
TOKEN_ROUNDING_M_TILE = 128
_TOKEN_ROUNDING = {
    "tr-d4096-n1024-k4": {"T": 16384, "d": 4096, "n": 1024, "K": 4, "E": (32, 64, 128, 256)},
    "tr-d1536-n256-k8": {"T": 16384, "d": 1536, "n": 256, "K": 8, "E": (64, 128, 256, 512)},
    "tr-d4096-n512-k8": {"T": 16384, "d": 4096, "n": 512, "K": 8, "E": (64, 128, 256, 512)},
}

_TINY = {"tiny": (64, 32, 16, 4, 2)}


def _named(table: dict, group_of) -> list[Shape]:
    return [Shape(name, *dims, group=group_of(name)) for name, dims in table.items()]


def _token_rounding_shapes() -> list[Shape]:
    out = []
    for key, c in _TOKEN_ROUNDING.items():
        for e in c["E"]:
            out.append(Shape(f"{key}-E{e}", c["T"], c["d"], c["n"], e, c["K"], group=key,
                             routings=ROUTINGS))
    return out


def _build_presets() -> dict[str, list[Shape]]:
    presets = {
        "tiny": _named(_TINY, lambda name: "tiny"),
        "7b": _named(_BREAKDOWN_7B, lambda name: "7B"),
        "granularity": _named(_GRANULARITY, lambda name: name.split("-")[0]),
        "iso-flops": _named(_ISO_FLOPS_7B, lambda name: "7B-iso-flops"),
        "models": _named(_MODELS, lambda name: "models"),
        "token-rounding": _token_rounding_shapes(),
    }
    seen, every = set(), []
    for key in ("7b", "granularity", "iso-flops", "models", "token-rounding"):
        for s in presets[key]:
            if (s.dims, s.routings) not in seen:
                seen.add((s.dims, s.routings))
                every.append(s)
    presets["all"] = every
    return presets


PRESETS: dict[str, list[Shape]] = _build_presets()

PRESET_HELP = {
    "tiny": "T=64 d=32 n=16 E=4 K=2: smoke test (the default without a GPU)",
    "7b": "the 7B shape of the paper's Fig. 6 breakdown (the default on a GPU)",
    "granularity": "1.4B/7B/30B/120B at fixed FLOPs and parameters, n varied (12 shapes)",
    "iso-flops": "7B at fixed FLOPs, n from 64 to 1024 (5 shapes)",
    "models": "OLMoE, Qwen3-30B/235B/Next-80B, gpt-oss-120b, DeepSeek-V3 (6 shapes)",
    "token-rounding": "E swept at fixed T,d,n,K; runs top-k and token rounding (12 shapes)",
    "all": "every paper shape above except tiny, duplicates removed",
}


def preset_shapes(name: str) -> list[Shape]:
    """The shapes of preset ``name`` (one of :data:`PRESETS`); ValueError naming the choices."""
    key = name.strip().lower().replace("_", "-")
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return list(PRESETS[key])


def parse_shape(text: str) -> Shape:
    """Parse ``"T,d,n,E,K"`` (optionally ``"name=T,d,n,E,K"``) into a :class:`Shape` (group ``custom``)."""
    name = None
    if "=" in text:
        name, text = (s.strip() for s in text.split("=", 1))
    parts = [p.strip() for p in text.replace("x", ",").split(",") if p.strip()]
    if len(parts) != 5:
        raise ValueError(f"--shape wants 5 integers T,d,n,E,K, got {text!r}")
    try:
        t, d, n, e, k = (int(p) for p in parts)
    except ValueError as exc:
        raise ValueError(f"--shape wants integers T,d,n,E,K, got {text!r}") from exc
    return Shape(name or f"T{t}-d{d}-n{n}-E{e}-K{k}", t, d, n, e, k, group="custom")
