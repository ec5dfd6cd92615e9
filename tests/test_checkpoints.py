"""Per-expert Hugging Face checkpoints into sonicmoe.MoE and back (sonicmoe.checkpoints), on CPU.

The per-expert blocks below are written out by hand after the models' published forward passes (Mixtral's sparse
block; DeepSeek-V3's sigmoid gate with its selection bias, group limit and scaling), in float64: the layer loaded
from their state dicts must give their outputs.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from sonicmoe import MoE
from sonicmoe.checkpoints import hf_experts_state_dict, load_hf_experts

D, N, E, K = 12, 5, 8, 2  # d ≠ 2n: a split of the gate/up block along the wrong dimension changes shapes
N_S = 10  # Qwen2-MoE's shared expert width (shared_expert_intermediate_size)
_NAMES_OF = {"qwen": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}  # gate, up, down


class _Expert(nn.Module):
    def __init__(self, names: tuple[str, str, str], bias: bool = False, n: int = N):
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(D, n, bias=bias, dtype=torch.float64))
        setattr(self, up, nn.Linear(D, n, bias=bias, dtype=torch.float64))
        setattr(self, down, nn.Linear(n, D, bias=bias, dtype=torch.float64))

    def forward(self, x):
        gate, up, down = (getattr(self, a) for a in self.names)
        return down(torch.nn.functional.silu(gate(x)) * up(x))


class _MixtralBlock(nn.Module):
    """softmax over all E, top-K, renormalised; experts w1 (gate), w3 (up), w2 (down)."""

    def __init__(self, bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False, dtype=torch.float64)
        self.experts = nn.ModuleList(_Expert(("w1", "w3", "w2"), bias) for _ in range(E))

    def forward(self, x):
        probs = torch.softmax(self.gate(x), dim=-1)
        w, ids = probs.topk(K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(K):
                out[t] += w[t, j] * self.experts[int(ids[t, j])](x[t])
        return out


class _DeepSeekV3Block(nn.Module):
    """sigmoid gate; the choice by sigmoid + e_score_correction_bias within the topk_group best of n_group groups
    (a group scores its two best); weights the chosen sigmoids, renormalised, times the scaling factor."""

    def __init__(self, n_group=4, topk_group=2, scale=2.5, n_shared=0):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False, dtype=torch.float64)
        self.gate.register_buffer("e_score_correction_bias", torch.randn(E, dtype=torch.float64) * 0.1)
        self.experts = nn.ModuleList(_Expert(("gate_proj", "up_proj", "down_proj")) for _ in range(E))
        self.n_group, self.topk_group, self.scale = n_group, topk_group, scale
        # n_shared_experts shared experts: one MLP of n_shared · N (moe_intermediate_size), added unweighted
        self.shared_experts = _Expert(("gate_proj", "up_proj", "down_proj"), n=n_shared * N) if n_shared else None

    def forward(self, x):
        s = torch.sigmoid(self.gate(x))
        key = s + self.gate.e_score_correction_bias
        t = x.shape[0]
        groups = key.view(t, self.n_group, -1).topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
        mask = torch.zeros(t, self.n_group, dtype=torch.bool).scatter_(1, groups, True)
        key = key.masked_fill(~mask.repeat_interleave(E // self.n_group, dim=1), float("-inf"))
        ids = key.topk(K, dim=-1).indices
        w = s.gather(1, ids)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * self.scale
        out = torch.zeros_like(x)
        for i in range(t):
            for j in range(K):
                out[i] += w[i, j] * self.experts[int(ids[i, j])](x[i])
        return out if self.shared_experts is None else out + self.shared_experts(x)


class _Qwen2MoeBlock(nn.Module):
    """softmax over all E, top-K without renormalisation, plus a shared expert of width N_S scaled by
    sigmoid(shared_expert_gate(x))."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False, dtype=torch.float64)
        self.experts = nn.ModuleList(_Expert(("gate_proj", "up_proj", "down_proj")) for _ in range(E))
        self.shared_expert = _Expert(("gate_proj", "up_proj", "down_proj"), n=N_S)
        self.shared_expert_gate = nn.Linear(D, 1, bias=False, dtype=torch.float64)

    def forward(self, x):
        w, ids = torch.softmax(self.gate(x), dim=-1).topk(K, dim=-1)
        out = torch.zeros_like(x)
        for i in range(x.shape[0]):
            for j in range(K):
                out[i] += w[i, j] * self.experts[int(ids[i, j])](x[i])
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def _prefixed(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in module.state_dict().items()}


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("bias", [False, True])
def test_mixtral_block_loads_and_matches(layout, bias):
    torch.manual_seed(0)
    block = _MixtralBlock(bias)
    layer = MoE(D, N, E, K, router_order="softmax_then_topk", renormalize=True, gate_up_layout=layout, bias=bias,
                backend="torch", dtype=torch.float64)
    state = _prefixed(block, "model.layers.0.block_sparse_moe.")
    state["model.layers.0.block_sparse_moe.shared.weight"] = torch.zeros(3)  # ignored: not the layer's
    before = {k: v.clone() for k, v in state.items()}
    load_hf_experts(layer, state, "model.layers.0.block_sparse_moe.")
    assert all(torch.equal(v, before[k]) for k, v in state.items()), "the checkpoint is not modified"
    x = torch.randn(17, D, dtype=torch.float64)
    torch.testing.assert_close(layer(x), block(x), rtol=1e-12, atol=1e-12)


def test_deepseek_v3_block_loads_and_matches():
    torch.manual_seed(1)
    block = _DeepSeekV3Block()
    layer = MoE(D, N, E, K, router_order="sigmoid_then_topk", renormalize=True, routed_scaling_factor=2.5,
                n_group=4, topk_group=2, backend="torch", dtype=torch.float64)
    load_hf_experts(layer, _prefixed(block, "mlp."), "mlp.")  # style "auto": gate_proj/up_proj/down_proj
    assert torch.equal(layer.e_score_correction_bias, block.gate.e_score_correction_bias.float())
    x = torch.randn(23, D, dtype=torch.float64)
    torch.testing.assert_close(layer(x), block(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_deepseek_v3_block_with_shared_experts_loads_and_matches(layout):
    """DeepSeek-V3 with n_shared_experts = 2: the layer's shared expert of width 2N reads shared_experts.*."""
    torch.manual_seed(4)
    block = _DeepSeekV3Block(n_shared=2)
    layer = MoE(D, N, E, K, router_order="sigmoid_then_topk", renormalize=True, routed_scaling_factor=2.5,
                n_group=4, topk_group=2, shared_intermediate_size=2 * N, gate_up_layout=layout, backend="torch",
                dtype=torch.float64)
    load_hf_experts(layer, _prefixed(block, "mlp."), "mlp.")
    x = torch.randn(19, D, dtype=torch.float64)
    torch.testing.assert_close(layer(x), block(x), rtol=1e-12, atol=1e-12)
    assert layer.shared_experts.down_proj.abs().sum() > 0
    # the routed part alone (no shared expert in the layer) ignores the shared entries: the block less its MLP
    routed = MoE(D, N, E, K, router_order="sigmoid_then_topk", renormalize=True, routed_scaling_factor=2.5,
                 n_group=4, topk_group=2, backend="torch", dtype=torch.float64)
    load_hf_experts(routed, _prefixed(block, "mlp."), "mlp.")
    torch.testing.assert_close(routed(x) + block.shared_experts(x), block(x), rtol=1e-12, atol=1e-12)


def test_qwen2_moe_block_with_gated_shared_expert_loads_and_matches():
    torch.manual_seed(5)
    block = _Qwen2MoeBlock()
    layer = MoE(D, N, E, K, router_order="softmax_then_topk", shared_intermediate_size=N_S, shared_expert_gate=True,
                backend="torch", dtype=torch.float64)
    state = _prefixed(block, "model.layers.1.mlp.")
    load_hf_experts(layer, state, "model.layers.1.mlp.")
    x = torch.randn(21, D, dtype=torch.float64)
    torch.testing.assert_close(layer(x), block(x), rtol=1e-12, atol=1e-12)
    back = hf_experts_state_dict(layer, "model.layers.1.mlp.")  # gated: Qwen2's shared_expert.* names
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.parametrize("shared_name", [None, "shared_experts", "shared_expert"])
@pytest.mark.parametrize("gated", [False, True])
def test_shared_expert_round_trip(shared_name, gated):
    torch.manual_seed(6)
    layer = MoE(D, N, E, K, gate_up_layout="interleaved", shared_intermediate_size=N_S, shared_expert_gate=gated)
    state = hf_experts_state_dict(layer, "b.", shared_name=shared_name)
    name = shared_name or ("shared_expert" if gated else "shared_experts")
    assert state[f"b.{name}.gate_proj.weight"].shape == (N_S, D)
    assert state[f"b.{name}.down_proj.weight"].shape == (D, N_S)
    assert len(state) == 1 + 3 * E + 3 + gated and ("b.shared_expert_gate.weight" in state) == gated
    twin = MoE(D, N, E, K, shared_intermediate_size=N_S, shared_expert_gate=gated)  # the other layout
    load_hf_experts(twin, state, "b.")
    x = torch.randn(9, D)
    torch.testing.assert_close(twin(x), layer(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="shared_name"):
        hf_experts_state_dict(layer, "b.", shared_name="shared")


def test_shared_expert_errors_leave_the_layer_unchanged():
    torch.manual_seed(7)
    good = _prefixed(_Qwen2MoeBlock(), "b.")
    gated = MoE(D, N, E, K, shared_intermediate_size=N_S, shared_expert_gate=True, dtype=torch.float64)
    plain = MoE(D, N, E, K, shared_intermediate_size=N_S, dtype=torch.float64)

    def fails(layer, exc, match, state):
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        with pytest.raises(exc, match=match):
            load_hf_experts(layer, state, "b.")
        assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())

    no_shared = {k: v for k, v in good.items() if ".shared_expert." not in k}
    fails(gated, KeyError, "shared_experts.gate_proj.weight.*shared_expert.gate_proj.weight", no_shared)
    fails(gated, KeyError, "b.shared_expert_gate.weight",
          {k: v for k, v in good.items() if k != "b.shared_expert_gate.weight"})
    fails(gated, ValueError, r"b.shared_expert.down_proj.weight.*\(12, 10\)",
          {**good, "b.shared_expert.down_proj.weight": torch.zeros(D, N_S + 1)})
    fails(plain, ValueError, "shared_expert_gate=True", good)
    fails(gated, ValueError, "biases", {**good, "b.shared_expert.gate_proj.bias": torch.zeros(N_S)})
    # an up or down bias without the gate's (each was silently dropped: only gate_proj.bias was looked at)
    for name, width in (("up_proj", N_S), ("down_proj", D)):
        fails(gated, ValueError, rf"biases \(b.shared_expert.{name}.bias\)",
              {**good, f"b.shared_expert.{name}.bias": torch.zeros(width)})
    wide = MoE(D, N, E, K, shared_intermediate_size=N_S + 2, shared_expert_gate=True, dtype=torch.float64)
    fails(wide, ValueError, r"b.shared_expert.gate_proj.weight.*\(12, 12\)", good)


def test_both_shared_expert_names_are_ambiguous():
    """A checkpoint with both shared_experts.* (DeepSeek) and shared_expert.* (Qwen2-MoE) under one prefix is refused,
    naming both prefixes, with the layer unchanged (before, shared_experts.* was loaded silently); either alone loads,
    and entries under another prefix do not count."""
    torch.manual_seed(7)
    good = _prefixed(_Qwen2MoeBlock(), "b.")
    deepseek = {k.replace(".shared_expert.", ".shared_experts."): -v for k, v in good.items() if ".shared_expert." in k}
    layer = MoE(D, N, E, K, shared_intermediate_size=N_S, shared_expert_gate=True, dtype=torch.float64)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(ValueError, match=r"ambiguous.*b\.shared_experts\.\*.*b\.shared_expert\.\*"):
        load_hf_experts(layer, {**good, **deepseek}, "b.")
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())
    stray = {"b.shared_experts.down_proj.weight": deepseek["b.shared_experts.down_proj.weight"]}
    with pytest.raises(ValueError, match="ambiguous"):  # any entry of the other name, not only gate_proj's
        load_hf_experts(layer, {**good, **stray}, "b.")
    load_hf_experts(layer, {**good, **{"a." + k[2:]: v for k, v in deepseek.items()}}, "b.")
    assert torch.equal(layer.shared_experts.down_proj[0], good["b.shared_expert.down_proj.weight"])
    only = {k: v for k, v in good.items() if ".shared_expert." not in k}
    load_hf_experts(layer, {**only, **deepseek}, "b.")
    assert torch.equal(layer.shared_experts.down_proj[0], deepseek["b.shared_experts.down_proj.weight"])


@pytest.mark.parametrize("style", ["qwen", "mixtral"])
@pytest.mark.parametrize("biased", [True, False])
def test_expert_biases_are_checked_key_by_key(style, biased):
    """Expert 2's biases, each subset of its three ``.bias`` keys, both ways: into a layer with bias=True (every
    other expert's biases there) all three load and any missing one is a KeyError naming every missing key; into a
    layer with bias=False (no other expert's biases) none loads and any present one is a ValueError naming every
    present key (and the missing ones where some are). The layer is unchanged on every error. Before the fix only
    the gate's key was looked at: a layer without biases silently dropped up and down biases that came without a
    gate bias, and a KeyError named only the first missing key."""
    torch.manual_seed(8)
    source = MoE(D, N, E, K, bias=True, dtype=torch.float64)
    full = hf_experts_state_dict(source, "b.", style=style)
    bare = {k: v for k, v in full.items() if not k.endswith(".bias")}
    keys = [f"b.experts.2.{name}.bias" for name in _NAMES_OF[style]]
    layer = MoE(D, N, E, K, bias=biased, dtype=torch.float64)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    for r in range(4):
        for have in itertools.combinations(keys[::-1], r):  # down's and up's alone first, then with the gate's
            lack = [k for k in keys if k not in have]
            if biased:
                state = {k: v for k, v in full.items() if k not in lack}
            else:
                state = {**bare, **{k: full[k] for k in have}}
            if not (lack if biased else have):  # what the layer needs, and nothing more
                load_hf_experts(layer, state, "b.", style=style)
                assert torch.equal(layer.experts.down_proj, source.experts.down_proj)
                assert not biased or torch.equal(layer.experts.gate_up_proj_bias, source.experts.gate_up_proj_bias)
                layer.load_state_dict(before)
                continue
            with pytest.raises(KeyError if biased else ValueError) as info:
                load_hf_experts(layer, state, "b.", style=style)
            message = str(info.value)
            assert all(k in message for k in (lack if biased else have)), (have, message)
            if have and lack:  # told that the checkpoint's set is incomplete, naming both sides
                assert "incomplete" in message and all(k in message for k in keys), (have, message)
            # expert 0 has its biases here: "build the layer with bias=False" would be wrong advice
            assert "bias=False" not in message, (have, message)
            assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items()), have
    if biased:  # a checkpoint without any expert bias: build the layer without
        with pytest.raises(KeyError, match="b.experts.0.*bias=False"):
            load_hf_experts(layer, bare, "b.", style=style)


@pytest.mark.parametrize("style", ["qwen", "mixtral"])
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_round_trip(style, layout):
    torch.manual_seed(2)
    layer = MoE(D, N, E, K, gate_up_layout=layout, bias=True, router_order="sigmoid_then_topk")
    layer.e_score_correction_bias.normal_()
    state = hf_experts_state_dict(layer, "blk.", style=style)
    names = ("gate_proj", "up_proj", "down_proj") if style == "qwen" else ("w1", "w3", "w2")
    assert state[f"blk.experts.3.{names[0]}.weight"].shape == (N, D)
    assert state[f"blk.experts.3.{names[2]}.weight"].shape == (D, N)
    assert len(state) == 2 + 6 * E
    twin = MoE(D, N, E, K, gate_up_layout=layout, bias=True, router_order="sigmoid_then_topk")
    load_hf_experts(twin, state, "blk.", style=style)
    for (name, a), b in zip(layer.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name
    # the other layout holds the same experts in other rows: same output
    other = MoE(D, N, E, K, gate_up_layout="concat" if layout == "interleaved" else "interleaved", bias=True,
                router_order="sigmoid_then_topk")
    load_hf_experts(other, state, "blk.")
    x = torch.randn(9, D)
    torch.testing.assert_close(other(x), layer(x), rtol=1e-6, atol=1e-6)
    assert not torch.equal(other.experts.gate_up_proj, layer.experts.gate_up_proj)


def test_errors_name_the_key_and_leave_the_layer_unchanged():
    torch.manual_seed(3)
    block = _MixtralBlock()
    layer = MoE(D, N, E, K, dtype=torch.float64)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    good = _prefixed(block, "b.")

    def fails(exc, match, state, *args, **kw):
        with pytest.raises(exc, match=match):
            load_hf_experts(layer, state, *args, **kw)
        assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())

    fails(KeyError, "b.experts.5.w2.weight", {k: v for k, v in good.items() if k != "b.experts.5.w2.weight"}, "b.")
    fails(ValueError, rf"b.experts.2.w1.weight.*\({N}, {D}\)",
          {**good, "b.experts.2.w1.weight": torch.zeros(N + 1, D - 1)}, "b.")
    fails(ValueError, "more than E=8", {**good, "b.experts.8.w1.weight": torch.zeros(N, D)}, "b.")
    fails(ValueError, "bias=True", {**good, "b.experts.0.w1.bias": torch.zeros(N)}, "b.")
    fails(KeyError, "no per-expert weights", good, "wrong.")
    fails(ValueError, "style", good, "b.", style="olmoe")
    fails(KeyError, "gate_proj", good, "b.", style="qwen")
    fails(ValueError, "sigmoid_then_topk", {**good, "b.gate.e_score_correction_bias": torch.zeros(E)}, "b.")
    # tensors without data (an empty-weights model's state dict): refused before the router's copy, for one expert
    # and for all of them (all on meta, the stacks succeed and the first expert copy used to fail after the router's)
    on_meta = torch.zeros(D, N, dtype=torch.float64, device="meta")
    fails(ValueError, "b.experts.3.w2.weight.*16 bits or more with data",
          {**good, "b.experts.3.w2.weight": on_meta}, "b.")
    all_meta = {k: (v.to("meta") if ".experts." in k else v) for k, v in good.items()}
    fails(ValueError, "b.experts.0.w1.weight.*meta", all_meta, "b.")
    # integer codes (a quantised checkpoint without its scales) would load as raw values
    int8 = torch.randint(-100, 100, (N, D), dtype=torch.int8)
    fails(ValueError, "b.experts.1.w3.weight.*torch.int8", {**good, "b.experts.1.w3.weight": int8}, "b.")
    # float8 codes (DeepSeek-V3's checkpoint keeps their scales in *_scale_inv): also raw values without the scales
    fp8 = torch.randn(N, D).to(torch.float8_e4m3fn)
    fails(ValueError, "b.experts.2.w3.weight.*float8_e4m3fn.*dequantise", {**good, "b.experts.2.w3.weight": fp8}, "b.")
    sig = MoE(D, N, E, K, router_order="sigmoid_then_topk")
    with pytest.raises(KeyError, match="e_score_correction_bias"):
        load_hf_experts(sig, good, "b.")
    with pytest.raises(TypeError, match="layer"):
        load_hf_experts(block, good, "b.")
    with pytest.raises(ValueError, match="style"):
        hf_experts_state_dict(layer, style="auto")


def test_refusals_quote_the_layer_options_to_change():
    """The advice in two refusals quotes the layer's own options: a DeepSeek-V3 selection bias for a layer that
    routes otherwise names its router_order (not its routing mode), a missing shared expert the layer's
    shared_intermediate_size (not the routed experts' width)."""
    torch.manual_seed(10)
    good = _prefixed(_MixtralBlock(), "b.")
    layer = MoE(D, N, E, K, router_order="softmax_then_topk", dtype=torch.float64)
    with pytest.raises(ValueError) as info:
        load_hf_experts(layer, {**good, "b.gate.e_score_correction_bias": torch.randn(E)}, "b.")
    assert ("the layer routes with router_order='softmax_then_topk': build it with router_order='sigmoid_then_topk'"
            in str(info.value))
    shared = MoE(D, N, E, K, shared_intermediate_size=N_S, dtype=torch.float64)
    with pytest.raises(KeyError) as info:
        load_hf_experts(shared, good, "b.")
    assert f"the layer has a shared expert (shared_intermediate_size={N_S}) but" in str(info.value)


def test_a_missing_or_non_tensor_entry_is_named_with_its_shape():
    """A missing entry's KeyError names the key and the shape the layer expects (expert 0's up weight too: style
    "auto" reads expert 0's gate weight only, so the block is not "without per-expert weights"); an entry that is not
    a tensor (a list, a numpy array of the right shape) is a ValueError naming the key, the shape and what it got.
    The layer is unchanged each time."""
    torch.manual_seed(9)
    good = hf_experts_state_dict(MoE(D, N, E, K, dtype=torch.float64), "b.", style="mixtral")
    layer = MoE(D, N, E, K, dtype=torch.float64)
    before = {k: v.clone() for k, v in layer.state_dict().items()}

    def fails(exc, match, state):
        with pytest.raises(exc, match=match):
            load_hf_experts(layer, state, "b.")
        assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())

    for key in ("b.experts.4.w3.weight", "b.experts.0.w3.weight"):
        fails(KeyError, rf"missing '{key}' \(expected shape \({N}, {D}\)\)",
              {k: v for k, v in good.items() if k != key})
    fails(KeyError, r"missing 'b.gate.weight' \(expected shape \(8, 12\)\)",
          {k: v for k, v in good.items() if k != "b.gate.weight"})
    down = good["b.experts.3.w2.weight"]
    fails(ValueError, rf"'b.experts.3.w2.weight' must have shape \({D}, {N}\), got list",
          {**good, "b.experts.3.w2.weight": down.tolist()})
    fails(ValueError, rf"'b.experts.3.w2.weight' must have shape \({D}, {N}\), got ndarray",
          {**good, "b.experts.3.w2.weight": down.numpy()})


@settings(max_examples=25, deadline=None)
@given(e=st.integers(1, 5), n=st.integers(1, 5), n_s=st.integers(0, 6), gated=st.booleans(), bias=st.booleans(),
       style=st.sampled_from(["qwen", "mixtral"]), layout=st.sampled_from(["concat", "interleaved"]),
       sigmoid=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_hypothesis_round_trip_into_the_other_layout(e, n, n_s, gated, bias, style, layout, sigmoid, seed):
    """Any layer (E, n, shared expert or not, gated or not, biases, sigmoid router with its selection bias) written
    out per expert and read into a layer of the other gate/up layout: the same experts in other rows, so the same
    outputs; written out again, the same state dict, key for key and bit for bit."""
    gated = gated and n_s > 0
    opts = dict(bias=bias, shared_intermediate_size=n_s, shared_expert_gate=gated, backend="torch",
                router_order="sigmoid_then_topk" if sigmoid else "topk_then_softmax")
    torch.manual_seed(seed)
    layer = MoE(4, n, e, 1, gate_up_layout=layout, **opts)
    if sigmoid:
        layer.e_score_correction_bias.normal_()
    state = hf_experts_state_dict(layer, "m.", style=style)
    other = MoE(4, n, e, 1, gate_up_layout="interleaved" if layout == "concat" else "concat", **opts)
    load_hf_experts(other, state, "m.")
    again = hf_experts_state_dict(other, "m.", style=style)
    assert again.keys() == state.keys() and all(torch.equal(again[k], v) for k, v in state.items())
    x = torch.randn(7, 4, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(other(x), layer(x), rtol=1e-6, atol=1e-6)


def test_a_shard_of_the_experts_is_refused_before_any_copy():
    """A layer holding only some of the E experts (an expert-parallel rank's shard: here the first half, as rank 0 of
    2 holds) is refused with a NotImplementedError that points at ExpertParallelMoE.from_moe, by the loader (the layer
    left unchanged: the router is not copied first) and by the export (which would name E experts it lacks)."""
    torch.manual_seed(4)
    full = MoE(D, N, E, K, dtype=torch.float64)
    good = hf_experts_state_dict(full, "b.", style="mixtral")
    shard = MoE(D, N, E, K, dtype=torch.float64)
    ex = shard.experts
    ex.gate_up_proj = nn.Parameter(ex.gate_up_proj.detach()[: E // 2].clone())
    ex.down_proj = nn.Parameter(ex.down_proj.detach()[: E // 2].clone())
    before = {k: v.clone() for k, v in shard.state_dict().items()}
    with pytest.raises(NotImplementedError, match="shard of the experts.*ExpertParallelMoE.from_moe"):
        load_hf_experts(shard, good, "b.")
    assert all(torch.equal(v, before[k]) for k, v in shard.state_dict().items())
    with pytest.raises(NotImplementedError, match="shard of the experts"):
        hf_experts_state_dict(shard)


@pytest.mark.parametrize("style", ["qwen", "mixtral"])
def test_auto_style_reads_expert_0_of_a_one_expert_block(style):
    """style="auto" tells the names from expert 0's gate weight, the one every block has (a block of E = 1 has no
    expert 1): the loaded layer holds the exported weights exactly."""
    torch.manual_seed(6)
    src = MoE(D, N, 1, 1, dtype=torch.float64)
    state = hf_experts_state_dict(src, "m.", style=style)
    dst = MoE(D, N, 1, 1, dtype=torch.float64)
    load_hf_experts(dst, state, "m.")
    for name, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[name], v), name


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_export_is_new_tensors(layout):
    """hf_experts_state_dict returns new tensors: writing into every one of them (router weight and bias, selection
    bias, experts' weights and biases, the shared expert and its gate) leaves the layer's state as it was."""
    torch.manual_seed(7)
    layer = MoE(D, N, E, K, dtype=torch.float64, router_bias=True, bias=True, router_order="sigmoid_then_topk",
                shared_intermediate_size=N_S, shared_expert_gate=True, gate_up_layout=layout)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    out = hf_experts_state_dict(layer, "m.")
    assert {"m.gate.weight", "m.gate.bias", "m.gate.e_score_correction_bias", "m.shared_expert_gate.weight",
            "m.experts.0.down_proj.bias", "m.shared_expert.up_proj.weight"} <= set(out)
    for v in out.values():
        v.add_(1.0)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k
