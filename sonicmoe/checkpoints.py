"""Per-expert Hugging Face checkpoints to and from :class:`~sonicmoe.MoE`'s stacked parameters.

Many published MoE checkpoints store each expert as its own SwiGLU MLP of three linear layers. This module moves
such a block's weights into the layer, and back:

* ``"qwen"`` names (Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3): ``experts.{i}.gate_proj.weight`` (n, d),
  ``experts.{i}.up_proj.weight`` (n, d), ``experts.{i}.down_proj.weight`` (d, n);
* ``"mixtral"`` names (Mixtral): ``experts.{i}.w1.weight`` (gate, (n, d)), ``experts.{i}.w3.weight`` (up, (n, d)),
  ``experts.{i}.w2.weight`` (down, (d, n));
* both: the router ``gate.weight`` (E, d) (and ``gate.bias`` (E,) where the layer has a router bias,
  ``router_bias=True``), and DeepSeek-V3's ``gate.e_score_correction_bias`` (E,) where the layer has
  that buffer (``router_order="sigmoid_then_topk"``); ``.bias`` entries beside the weights where the layer has
  expert biases (``bias=True``: all three of every expert's; without it, none);
* the shared expert, where the layer has one (``shared_intermediate_size`` n_s > 0): ``shared_experts.{gate_proj,
  up_proj, down_proj}.weight`` (DeepSeek-V2/V3) or ``shared_expert.{...}.weight`` (Qwen2-MoE, Llama 4), of shapes
  (n_s, d), (n_s, d), (d, n_s), and Qwen2-MoE's ``shared_expert_gate.weight`` (1, d) where the layer has that gate
  (``shared_expert_gate=True``).

Expert i's gate and up rows become ``experts.gate_up_proj[i]`` (2n, d) in the layer's ``gate_up_layout``
(``"concat"``: [gate; up]; ``"interleaved"``: row 2j gate channel j, row 2j + 1 up channel j) and its down weight
``experts.down_proj[i]`` (d, n). The routing options are the layer's to set, to match the model: Mixtral is
``router_order="softmax_then_topk", renormalize=True``; Qwen3-MoE the same with its ``norm_topk_prob``; OLMoE
``renormalize=False``; DeepSeek-V3 ``"sigmoid_then_topk"``, ``renormalize=True``, ``routed_scaling_factor=2.5``,
``n_group=8, topk_group=4``, ``shared_intermediate_size=n_shared_experts·moe_intermediate_size``; Qwen2-MoE
``shared_intermediate_size=shared_expert_intermediate_size, shared_expert_gate=True``.

gpt-oss stores its experts stacked but transposed, and its router under another name: :func:`load_gpt_oss_experts`
and :func:`gpt_oss_state_dict` read and write ``router.weight`` (E, d), ``router.bias`` (E,),
``experts.gate_up_proj`` (E, d, 2n) with gate and up columns interleaved (column 2j gate channel j, 2j + 1 up
channel j), ``experts.gate_up_proj_bias`` (E, 2n) likewise, ``experts.down_proj`` (E, n, d) and
``experts.down_proj_bias`` (E, d). Its layer is :data:`GPT_OSS_OPTIONS`: top-k then softmax over the K chosen logits,
a router bias, expert biases, the clamped SwiGLU.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch

from .modules import MoE

STYLES = ("auto", "qwen", "mixtral")
_NAMES = {"qwen": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
SHARED_NAMES = ("shared_experts", "shared_expert")  # DeepSeek-V2/V3; Qwen2-MoE and Llama 4
_SHARED_GATE = "shared_expert_gate.weight"
# MoE options that make the layer compute gpt-oss's MLP block (transformers' GptOssMLP): its router is a biased linear
# map whose K largest logits are softmaxed, its experts have biases and the clamped SwiGLU; gpt-oss's stacked weights
# interleave gate and up, so this layout loads them without reordering rows
# (read-only: the loaders check layers against it)
GPT_OSS_OPTIONS = types.MappingProxyType({
    "router_order": "topk_then_softmax", "router_bias": True, "bias": True, "activation": "clamped_swiglu",
    "gate_up_layout": "interleaved", "routed_scaling_factor": 1.0})


def _style(state_dict: Mapping[str, torch.Tensor], prefix: str, style: str) -> str:
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if style != "auto":
        return style
    for name, (gate, _, _) in _NAMES.items():
        if f"{prefix}experts.0.{gate}.weight" in state_dict:
            return name
    raise KeyError(f"no per-expert weights under prefix {prefix!r}: expected {prefix}experts.0.gate_proj.weight "
                   f"(style 'qwen') or {prefix}experts.0.w1.weight (style 'mixtral')")


def _check_layer(layer: MoE) -> None:
    if not isinstance(layer, MoE):
        raise TypeError(f"layer must be a sonicmoe.MoE, got {type(layer).__name__}")
    if layer.experts.gate_up_proj.shape[0] != layer.config.num_experts:
        raise NotImplementedError("the layer holds a shard of the experts (expert parallelism): load the checkpoint "
                                  "into a plain MoE, then take this rank's shard with ExpertParallelMoE.from_moe")


def loadable_float(dtype: torch.dtype) -> bool:
    """Whether a checkpoint entry of ``dtype`` loads into a floating-point weight: floating-point of 16 bits or more
    (integer or float8 codes of a quantised checkpoint would load as raw values)."""
    return dtype.is_floating_point and dtype.itemsize > 1


def _take(state_dict: Mapping[str, torch.Tensor], key: str, shape: tuple[int, ...]) -> torch.Tensor:
    if key not in state_dict:
        raise KeyError(f"missing {key!r} (expected shape {shape})")
    v = state_dict[key]
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape:
        got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        raise ValueError(f"{key!r} must have shape {shape}, got {got}")
    # integer or float8 codes (a quantised checkpoint: DeepSeek-V3's float8 weights come with *_scale_inv tensors)
    # would load as raw values, a meta tensor would fail at its copy after earlier ones were copied: all are refused
    # before anything is copied
    if not loadable_float(v.dtype) or v.device.type == "meta":
        raise ValueError(f"{key!r} must be a floating-point tensor of 16 bits or more with data, got {v.dtype} on "
                         f"{v.device} (dequantise a quantised checkpoint first)")
    return v


def _gate_up(gate: torch.Tensor, up: torch.Tensor, layout: str) -> torch.Tensor:
    """(2n, ...) rows of W1 from the gate and up rows (n, ...) in ``layout``."""
    if layout == "concat":
        return torch.cat([gate, up], dim=0)
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def _split_gate_up(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up rows (n, ...) of W1's (2n, ...) rows in ``layout``: the inverse of :func:`_gate_up`."""
    if layout == "concat":
        n = w.shape[0] // 2
        return w[:n], w[n:]
    return w[0::2], w[1::2]


@torch.no_grad()
def load_hf_experts(layer: MoE, state_dict: Mapping[str, torch.Tensor], prefix: str = "", *,
                    style: str = "auto") -> None:
    """Copy a per-expert Hugging Face sparse-MoE block's weights into ``layer`` (module docstring for the names).

    Args:
        layer: a :class:`~sonicmoe.MoE` with the block's d, n, E (all E experts: not an expert-parallel shard).
        state_dict: the model's state dict (or the block's); values are cast to the layer's dtype and device.
        prefix: the block's key prefix, e.g. ``"model.layers.3.mlp."`` (Qwen) or
            ``"model.layers.3.block_sparse_moe."`` (Mixtral).
        style: ``"qwen"``, ``"mixtral"`` or ``"auto"`` (from the names of expert 0).

    Everything is checked before anything is copied: on an error the layer is unchanged. Entries the layer has no
    place for (other layers; a shared expert when the layer has none, for a model that keeps it as its own module)
    are ignored; nothing in ``state_dict`` is modified.

    Expert biases are looked up key by key: with ``bias=True`` each expert needs all three of its ``.bias`` entries
    (gate and up (n,), down (d,)), with ``bias=False`` none of them; the same for the shared expert's, which the
    layer never has.

    Raises:
        KeyError: a weight (or bias, or the selection bias, or the shared expert or its gate) the layer needs is
            missing (an expert's biases: every missing one named, and the ones the checkpoint has where it has
            some); no expert weights found.
        ValueError: a tensor of the wrong shape (the message names the key and the expected shape), not
            floating-point of 16 bits or more (integer or float8 codes of a quantised checkpoint, complex) or without
            data (meta); an unknown style;
            biases (any of an expert's three, named, also where the checkpoint lacks the others; any of the shared
            expert's), more experts, DeepSeek-V3's selection bias or a shared expert's gate in the checkpoint for a
            layer without a place for them; both ``shared_experts.*`` and ``shared_expert.*`` under the prefix
            (ambiguous) where the layer has a shared expert.
        TypeError / NotImplementedError: ``layer`` not an MoE, or an expert-parallel shard.
    """
    _check_layer(layer)
    style = _style(state_dict, prefix, style)
    gate_name, up_name, down_name = _NAMES[style]
    c, ex = layer.config, layer.experts
    e, d, n = c.num_experts, c.hidden_size, c.intermediate_size
    router = _take(state_dict, f"{prefix}gate.weight", (e, d))
    router_bias = _take_router_bias(layer, state_dict, f"{prefix}gate.bias")
    w1, w2, b1, b2 = [], [], [], []
    for i in range(e):
        p = f"{prefix}experts.{i}."
        w1.append(_gate_up(_take(state_dict, f"{p}{gate_name}.weight", (n, d)),
                           _take(state_dict, f"{p}{up_name}.weight", (n, d)), c.gate_up_layout))
        w2.append(_take(state_dict, f"{p}{down_name}.weight", (d, n)))
        biases = _take_expert_biases(layer, state_dict, i, [f"{p}{name}.bias" for name in _NAMES[style]])
        if biases is not None:
            b1.append(biases[0])
            b2.append(biases[1])
    if f"{prefix}experts.{e}.{gate_name}.weight" in state_dict:
        raise ValueError(f"the checkpoint has more than E={e} experts ({prefix}experts.{e}.{gate_name}.weight)")
    selection_bias = None
    if layer.e_score_correction_bias is not None:
        selection_bias = _take(state_dict, f"{prefix}gate.e_score_correction_bias", (e,))
    elif f"{prefix}gate.e_score_correction_bias" in state_dict:
        raise ValueError(f"the checkpoint has {prefix}gate.e_score_correction_bias (DeepSeek-V3's sigmoid router) but "
                         f"the layer routes with router_order={c.router_order!r}: build it with "
                         "router_order='sigmoid_then_topk'")
    shared = _take_shared(layer, state_dict, prefix)
    # every stack before the first copy: one that fails (tensors on mixed devices, say) leaves the layer unchanged
    w1, w2 = torch.stack(w1), torch.stack(w2)
    b1, b2 = (torch.stack(b1), torch.stack(b2)) if b1 else (None, None)
    layer.gate.weight.copy_(router)
    if router_bias is not None:
        layer.gate.bias.copy_(router_bias)
    ex.gate_up_proj.copy_(w1)
    ex.down_proj.copy_(w2)
    if b1 is not None:
        ex.gate_up_proj_bias.copy_(b1)
        ex.down_proj_bias.copy_(b2)
    if selection_bias is not None:
        layer.e_score_correction_bias.copy_(selection_bias)
    if shared is not None:
        w1_s, w2_s, gate = shared
        layer.shared_experts.gate_up_proj.copy_(w1_s[None])
        layer.shared_experts.down_proj.copy_(w2_s[None])
        if gate is not None:
            layer.shared_expert_gate.weight.copy_(gate)


def _take_expert_biases(layer: MoE, state_dict: Mapping[str, torch.Tensor], i: int,
                        keys: list[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Expert i's biases, checked key by key (``keys``: its gate, up and down ``.bias`` entries): (b1 (2n,) in the
    layer's layout, b2 (d,)) where the layer has expert biases; None where it has none. KeyError naming every key
    missing where the layer needs them; ValueError naming every one present where it has none. A checkpoint with
    some of the three but not all is told so, either way: before, only the gate's key was looked at, so a layer
    without biases silently dropped up and down biases that came without a gate bias."""
    have = [k for k in keys if k in state_dict]
    lack = [k for k in keys if k not in state_dict]
    if layer.experts.gate_up_proj_bias is None:
        if have and lack:
            raise ValueError(f"the checkpoint has biases of expert {i} ({', '.join(have)}) but the layer has none, and "
                             f"they are incomplete (no {', '.join(lack)}): a layer with bias=True needs all three")
        if have:
            raise ValueError(f"the checkpoint has expert biases ({', '.join(have)}) but the layer has none: build it "
                             "with bias=True")
        return None
    if have and lack:
        raise KeyError(f"missing {', '.join(lack)}: the checkpoint's biases of expert {i} are incomplete (it has "
                       f"{', '.join(have)}), the layer (bias=True) needs all three")
    if lack:
        raise KeyError(f"missing {', '.join(lack)}: the layer has expert biases (bias=True) but the checkpoint has "
                       f"none for expert {i}" + (": build the layer with bias=False" if i == 0 else ""))
    c = layer.config
    gate, up, down = (_take(state_dict, k, shape) for k, shape in zip(
        keys, ((c.intermediate_size,), (c.intermediate_size,), (c.hidden_size,))))
    return _gate_up(gate, up, c.gate_up_layout), down


def _take_router_bias(layer: MoE, state_dict: Mapping[str, torch.Tensor], key: str) -> torch.Tensor | None:
    """The router's (E,) bias at ``key`` where the layer has one (KeyError if missing); None where it has none
    (ValueError if the checkpoint has one: dropping it would change the routing)."""
    if layer.gate.bias is not None:
        return _take(state_dict, key, (layer.config.num_experts,))
    if key in state_dict:
        raise ValueError(f"the checkpoint's router has a bias ({key}) but the layer's has none: build it with "
                         "router_bias=True")
    return None


def _take_shared(layer: MoE, state_dict: Mapping[str, torch.Tensor], prefix: str):
    """The layer's shared expert from the checkpoint, checked: (W1_s (2n_s, d) in the layer's layout, W2_s (d, n_s),
    the gate's (1, d) weight or None); None where the layer has no shared expert (entries of one are then left to
    the caller's own module)."""
    if layer.shared_experts is None:
        return None
    c, gate_key = layer.config, f"{prefix}{_SHARED_GATE}"
    found = [name for name in SHARED_NAMES if f"{prefix}{name}.gate_proj.weight" in state_dict]
    if not found:
        raise KeyError(f"the layer has a shared expert (shared_intermediate_size={c.shared_intermediate_size}) but "
                       f"the checkpoint has neither {prefix}shared_experts.gate_proj.weight (DeepSeek) nor "
                       f"{prefix}shared_expert.gate_proj.weight (Qwen2-MoE)")
    # any entry under both names, not only gate_proj's (before, shared_experts.* was taken silently and
    # shared_expert.* ignored)
    if all(any(key.startswith(f"{prefix}{name}.") for key in state_dict) for name in SHARED_NAMES):
        raise ValueError(f"ambiguous checkpoint: it has both {prefix}shared_experts.* (DeepSeek) and "
                         f"{prefix}shared_expert.* (Qwen2-MoE) weights under one prefix; the layer has one shared "
                         "expert: keep only one of them in the state dict")
    p, d, n_s = f"{prefix}{found[0]}.", c.hidden_size, c.shared_intermediate_size
    w1 = _gate_up(_take(state_dict, f"{p}gate_proj.weight", (n_s, d)),
                  _take(state_dict, f"{p}up_proj.weight", (n_s, d)), c.gate_up_layout)
    w2 = _take(state_dict, f"{p}down_proj.weight", (d, n_s))
    # each of the three (before, the gate's only: an up or down bias without it was silently dropped)
    biases = [key for key in (f"{p}{name}.bias" for name in _NAMES["qwen"]) if key in state_dict]
    if biases:
        raise ValueError(f"the checkpoint's shared expert has biases ({', '.join(biases)}), which the layer's shared "
                         "expert does not")
    gate = None
    if layer.shared_expert_gate is not None:
        gate = _take(state_dict, gate_key, (1, d))
    elif gate_key in state_dict:
        raise ValueError(f"the checkpoint gates its shared expert ({gate_key}) but the layer has no gate: build it "
                         "with shared_expert_gate=True")
    return w1, w2, gate


@torch.no_grad()
def hf_experts_state_dict(layer: MoE, prefix: str = "", *, style: str = "qwen",
                          shared_name: str | None = None) -> dict[str, torch.Tensor]:
    """The inverse of :func:`load_hf_experts`: ``layer``'s weights as a per-expert Hugging Face state dict (new
    tensors, in the layer's dtype and device): ``{prefix}gate.weight`` (and ``{prefix}gate.bias`` with a router
    bias), ``{prefix}experts.{i}.{gate_proj, up_proj,
    down_proj}.weight`` under ``style="qwen"`` (Qwen2/3-MoE, OLMoE, DeepSeek) or ``{prefix}experts.{i}.{w1, w3,
    w2}.weight`` (gate, up, down) under ``"mixtral"`` (and ``.bias`` with expert biases),
    ``{prefix}gate.e_score_correction_bias`` where the layer has it, and a shared expert's
    ``{prefix}{shared_name}.{gate_proj, up_proj, down_proj}.weight`` (with ``{prefix}shared_expert_gate.weight``
    where the layer has that gate) where it has one. ``shared_name``: ``"shared_experts"`` (DeepSeek-V2/V3) or
    ``"shared_expert"`` (Qwen2-MoE, Llama 4); default: ``"shared_expert"`` for a gated shared expert, else
    ``"shared_experts"``.

    Raises:
        ValueError: an unknown style (``"auto"`` included: name one) or ``shared_name``. TypeError /
            NotImplementedError: as :func:`load_hf_experts`.
    """
    _check_layer(layer)
    if style not in _NAMES:
        raise ValueError(f"style must be one of {tuple(_NAMES)}, got {style!r}")
    if shared_name is not None and shared_name not in SHARED_NAMES:
        raise ValueError(f"shared_name must be None or one of {SHARED_NAMES}, got {shared_name!r}")
    gate_name, up_name, down_name = _NAMES[style]
    c, ex = layer.config, layer.experts
    out = {f"{prefix}gate.weight": layer.gate.weight.detach().clone()}
    if layer.gate.bias is not None:
        out[f"{prefix}gate.bias"] = layer.gate.bias.detach().clone()
    if layer.e_score_correction_bias is not None:
        out[f"{prefix}gate.e_score_correction_bias"] = layer.e_score_correction_bias.detach().clone()
    for i in range(c.num_experts):
        p = f"{prefix}experts.{i}."
        gate, up = _split_gate_up(ex.gate_up_proj[i], c.gate_up_layout)
        out[f"{p}{gate_name}.weight"] = gate.clone()
        out[f"{p}{up_name}.weight"] = up.clone()
        out[f"{p}{down_name}.weight"] = ex.down_proj[i].clone()
        if ex.gate_up_proj_bias is not None:
            gb, ub = _split_gate_up(ex.gate_up_proj_bias[i], c.gate_up_layout)
            out[f"{p}{gate_name}.bias"] = gb.clone()
            out[f"{p}{up_name}.bias"] = ub.clone()
            out[f"{p}{down_name}.bias"] = ex.down_proj_bias[i].clone()
    if layer.shared_experts is not None:
        gated = layer.shared_expert_gate is not None
        p = f"{prefix}{shared_name or SHARED_NAMES[1 if gated else 0]}."
        gate, up = _split_gate_up(layer.shared_experts.gate_up_proj[0], c.gate_up_layout)
        out[f"{p}gate_proj.weight"] = gate.clone()
        out[f"{p}up_proj.weight"] = up.clone()
        out[f"{p}down_proj.weight"] = layer.shared_experts.down_proj[0].clone()
        if gated:
            out[f"{prefix}{_SHARED_GATE}"] = layer.shared_expert_gate.weight.detach().clone()
    return out


def _check_gpt_oss_layer(layer: MoE) -> None:
    """ValueError naming the first option of ``layer`` that differs from :data:`GPT_OSS_OPTIONS` (but the layout,
    which the loader converts): such a layer would not compute gpt-oss's block with its weights."""
    c = layer.config
    for name, want in GPT_OSS_OPTIONS.items():
        if name != "gate_up_layout" and getattr(c, name) != want:
            raise ValueError(f"a gpt-oss block needs MoE(..., {name}={want!r}) (sonicmoe.GPT_OSS_OPTIONS), the layer "
                             f"has {name}={getattr(c, name)!r}")
    if layer.shared_experts is not None:
        raise ValueError("gpt-oss has no shared expert: build the layer with shared_intermediate_size=0")


@torch.no_grad()
def load_gpt_oss_experts(layer: MoE, state_dict: Mapping[str, torch.Tensor], prefix: str = "") -> None:
    """Copy a gpt-oss MLP block's weights (transformers' ``GptOssMLP``) into ``layer`` (module docstring for the names).

    The layer must be built with :data:`GPT_OSS_OPTIONS` (any ``gate_up_layout``: the interleaved one takes the
    weights as they are; the concat one reorders their rows), d = ``hidden_size``, n = ``intermediate_size``,
    E = ``num_local_experts`` and K = ``num_experts_per_tok`` of the model's config. W1[e] = ``gate_up_proj[e]``ᵀ
    (2n, d), W2[e] = ``down_proj[e]``ᵀ (d, n). Weights stored as MXFP4 blocks (the released checkpoints' expert
    weights, ``*_blocks`` and ``*_scales``) must be dequantised first (transformers does so when it loads the model
    with ``Mxfp4Config(dequantize=True)``): this reads floating-point tensors only. Shapes cannot tell a ``down_proj``
    stored the other way round when n = d (gpt-oss-120b: 2880 both): it must be gpt-oss's (E, n, d).

    Args:
        layer: a :class:`~sonicmoe.MoE` with all E experts.
        state_dict: the model's state dict (or the block's); values are cast to the dtype and device of the
            parameter each is copied to (a float32 router beside bf16 experts stays float32).
        prefix: the block's key prefix, e.g. ``"model.layers.3.mlp."``.

    Everything is checked before anything is copied: on an error the layer is unchanged; nothing in ``state_dict`` is
    modified.

    Raises:
        KeyError: a tensor of the block is missing (the message names it and its shape; or says that ``prefix`` lacks
            its final dot).
        ValueError: a tensor of the wrong shape, not floating-point of 16 bits or more, or without data (meta);
            MXFP4 blocks (``*_blocks``) instead of weights; a layer whose options differ from
            :data:`GPT_OSS_OPTIONS`, or with a shared expert.
        TypeError / NotImplementedError: ``layer`` not an MoE, or an expert-parallel shard.
    """
    _check_layer(layer)
    _check_gpt_oss_layer(layer)
    c, ex = layer.config, layer.experts
    e, d, n = c.num_experts, c.hidden_size, c.intermediate_size
    p = f"{prefix}experts."
    if f"{prefix}router.weight" not in state_dict and f"{prefix}.router.weight" in state_dict:
        raise KeyError(f"missing {prefix}router.weight: the prefix ends with the dot, prefix={prefix + '.'!r}")
    if f"{p}gate_up_proj_blocks" in state_dict:
        raise ValueError(f"{p}gate_up_proj_blocks: the experts are MXFP4-quantised; dequantise them first (e.g. load "
                         "the model with transformers' Mxfp4Config(dequantize=True) and take its state_dict)")

    def take(key: str, shape: tuple[int, ...], into: torch.Tensor) -> torch.Tensor:
        """The checked tensor, already in the dtype of the parameter ``into`` it is copied to and on its device (a
        float32 router beside bf16 experts keeps its float32 values): every failure (a meta tensor, an integer or
        float8 one) happens before the first copy."""
        return _take(state_dict, key, shape).to(device=into.device, dtype=into.dtype)

    router = take(f"{prefix}router.weight", (e, d), layer.gate.weight)
    router_bias = take(f"{prefix}router.bias", (e,), layer.gate.bias)
    w1 = take(f"{p}gate_up_proj", (e, d, 2 * n), ex.gate_up_proj).transpose(1, 2)  # (E, 2n, d), rows interleaved
    b1 = take(f"{p}gate_up_proj_bias", (e, 2 * n), ex.gate_up_proj_bias)
    w2 = take(f"{p}down_proj", (e, n, d), ex.down_proj).transpose(1, 2)
    b2 = take(f"{p}down_proj_bias", (e, d), ex.down_proj_bias)
    if c.gate_up_layout == "concat":  # interleaved rows [g0, u0, g1, u1, ...] -> [g0, g1, ...; u0, u1, ...]
        w1 = torch.cat([w1[:, 0::2], w1[:, 1::2]], dim=1)
        b1 = torch.cat([b1[:, 0::2], b1[:, 1::2]], dim=1)
    layer.gate.weight.copy_(router)
    layer.gate.bias.copy_(router_bias)
    ex.gate_up_proj.copy_(w1)
    ex.gate_up_proj_bias.copy_(b1)
    ex.down_proj.copy_(w2)
    ex.down_proj_bias.copy_(b2)


@torch.no_grad()
def gpt_oss_state_dict(layer: MoE, prefix: str = "") -> dict[str, torch.Tensor]:
    """The inverse of :func:`load_gpt_oss_experts`: ``layer``'s weights under gpt-oss's names and shapes (new
    contiguous tensors in the layer's dtype and device): ``{prefix}router.weight`` (E, d), ``{prefix}router.bias``
    (E,), ``{prefix}experts.gate_up_proj`` (E, d, 2n) interleaved, ``.gate_up_proj_bias`` (E, 2n),
    ``.down_proj`` (E, n, d), ``.down_proj_bias`` (E, d).

    Raises:
        ValueError / TypeError / NotImplementedError: as :func:`load_gpt_oss_experts`.
    """
    _check_layer(layer)
    _check_gpt_oss_layer(layer)
    ex, p = layer.experts, f"{prefix}experts."
    w1, b1 = ex.gate_up_proj.detach(), ex.gate_up_proj_bias.detach()
    if layer.config.gate_up_layout == "concat":  # [gate; up] -> interleaved
        w1 = torch.stack(w1.chunk(2, dim=1), dim=2).flatten(1, 2)
        b1 = torch.stack(b1.chunk(2, dim=1), dim=2).flatten(1, 2)
    return {f"{prefix}router.weight": layer.gate.weight.detach().clone(),
            f"{prefix}router.bias": layer.gate.bias.detach().clone(),
            # clone(): a transpose or chunk may already be contiguous (interleaved b1, d = n = 1) and would alias
            f"{p}gate_up_proj": w1.transpose(1, 2).clone(memory_format=torch.contiguous_format),
            f"{p}gate_up_proj_bias": b1.clone(memory_format=torch.contiguous_format),
            f"{p}down_proj": ex.down_proj.detach().transpose(1, 2).clone(memory_format=torch.contiguous_format),
            f"{p}down_proj_bias": ex.down_proj_bias.detach().clone()}
