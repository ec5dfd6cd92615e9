"""gpt-oss's MLP block on the layer: the router bias, the loader and exporter of its stacked transposed weights, and
the whole block against an independent float64 transcription of transformers' GptOssMLP (biased router, softmax
over the K largest logits, interleaved gate/up columns, clamped SwiGLU with (up + 1), expert biases)."""

from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch

import sonicmoe
from sonicmoe import GPT_OSS_OPTIONS, MoE, gpt_oss_state_dict, load_gpt_oss_experts
from sonicmoe.checkpoints import hf_experts_state_dict, load_hf_experts
from sonicmoe.routing import router_topk
from sonicmoe.testing import rel_err

D, N, E, K = 24, 16, 6, 2


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")


def _gpt_oss_block(seed: int, prefix: str = "model.layers.0.mlp.", scale: float = 6.0) -> dict[str, torch.Tensor]:
    """Random weights under gpt-oss's names and shapes; ``scale`` makes the clamps bind."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s):
        return torch.randn(*shape, generator=g) * s

    p = f"{prefix}experts."
    return {f"{prefix}router.weight": rnd(E, D, s=D ** -0.5), f"{prefix}router.bias": rnd(E, s=0.5),
            f"{p}gate_up_proj": rnd(E, D, 2 * N, s=scale * D ** -0.5), f"{p}gate_up_proj_bias": rnd(E, 2 * N, s=0.5),
            f"{p}down_proj": rnd(E, N, D, s=N ** -0.5), f"{p}down_proj_bias": rnd(E, D, s=0.1)}


def _gpt_oss_mlp(x: torch.Tensor, sd: dict[str, torch.Tensor], prefix: str = "model.layers.0.mlp.") -> torch.Tensor:
    """transformers' GptOssMLP written out token by token in float64 (loops, no sonicmoe code)."""
    p = f"{prefix}experts."
    sd = {k: v.double() for k, v in sd.items()}
    logits = x @ sd[f"{prefix}router.weight"].t() + sd[f"{prefix}router.bias"]
    top, idx = torch.topk(logits, K, dim=-1)
    weights = torch.softmax(top, dim=-1)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(D, dtype=torch.float64)
        for k in range(K):
            e = int(idx[t, k])
            gate_up = x[t] @ sd[f"{p}gate_up_proj"][e] + sd[f"{p}gate_up_proj_bias"][e]
            gate, up = gate_up[0::2].clamp(max=7.0), gate_up[1::2].clamp(min=-7.0, max=7.0)
            glu = gate * torch.sigmoid(gate * 1.702)
            acc = acc + weights[t, k] * ((up + 1) * glu @ sd[f"{p}down_proj"][e] + sd[f"{p}down_proj_bias"][e])
        rows.append(acc)
    return torch.stack(rows)


def _layer(layout: str, backend: str = "torch", **extra) -> MoE:
    options = {**GPT_OSS_OPTIONS, "gate_up_layout": layout, "aux_loss_coef": 0.0, "backend": backend, **extra}
    return MoE(D, N, E, K, **options)


@pytest.mark.parametrize("layout", ["interleaved", "concat"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_block_matches_gpt_oss(layout, backend):
    """The loaded layer's output and input gradient against the float64 transcription; the clamps bind on part of
    H, so SwiGLU or a missed bias would fail."""
    sd = _gpt_oss_block(seed=1)
    layer = _layer(layout, backend)
    load_gpt_oss_experts(layer, sd, "model.layers.0.mlp.")
    x = torch.randn(19, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    ref = _gpt_oss_mlp(xr, sd)
    (dx_ref,) = torch.autograd.grad(ref.square().sum(), xr)
    xo = x.float().requires_grad_(True)
    out = layer(xo)
    (dx,) = torch.autograd.grad(out.square().sum(), xo)
    assert rel_err(out, ref) < 1e-5 and rel_err(dx, dx_ref) < 1e-5
    h = x.float() @ layer.experts.gate_up_proj[0].t()
    assert (h.abs() > 7).float().mean() > 0.05  # the clamps bind
    swiglu = _layer(layout, backend, activation="swiglu")
    swiglu.load_state_dict(layer.state_dict())
    assert rel_err(swiglu(x.float()), ref) > 0.05


@pytest.mark.parametrize("layout", ["interleaved", "concat"])
def test_round_trip_is_exact(layout):
    sd = _gpt_oss_block(seed=3, prefix="")
    layer = _layer(layout)
    load_gpt_oss_experts(layer, sd)
    back = gpt_oss_state_dict(layer)
    assert back.keys() == sd.keys()
    for key, v in sd.items():
        assert torch.equal(back[key], v), key
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}  # new tensors: the interleaved b1 aliased
    assert not params & {v.untyped_storage().data_ptr() for v in back.values()}
    if layout == "interleaved":  # gpt-oss's layout: W1[e] is gate_up_proj[e] transposed, nothing reordered
        assert torch.equal(layer.experts.gate_up_proj, sd["experts.gate_up_proj"].transpose(1, 2))


def test_loader_checks_before_copying():
    sd = _gpt_oss_block(seed=4, prefix="")
    layer = _layer("interleaved")
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    bad = dict(sd)
    bad["experts.down_proj"] = bad["experts.down_proj"].transpose(1, 2)  # (E, d, n): the layer's own orientation
    with pytest.raises(ValueError, match=r"experts.down_proj.*\(6, 16, 24\)"):
        load_gpt_oss_experts(layer, bad)
    missing = {k: v for k, v in sd.items() if k != "router.bias"}
    with pytest.raises(KeyError, match="router.bias"):
        load_gpt_oss_experts(layer, missing)
    for key, v in layer.state_dict().items():
        assert torch.equal(v, before[key]), key
    # the exporter checks the layer as the loader does: it would write another block under gpt-oss's names
    for name, value in (("activation", "swiglu"), ("router_bias", False), ("bias", False),
                        ("router_order", "softmax_then_topk"), ("routed_scaling_factor", 2.5)):
        other = _layer("interleaved", **{name: value})
        # the message quotes the option gpt-oss needs and the layer's own value of it
        has = re.escape(f"needs MoE(..., {name}={GPT_OSS_OPTIONS[name]!r}) (sonicmoe.GPT_OSS_OPTIONS), the layer has "
                        f"{name}={value!r}")
        with pytest.raises(ValueError, match=has + "$"):
            load_gpt_oss_experts(other, sd)
        with pytest.raises(ValueError, match=has + "$"):
            gpt_oss_state_dict(other)
    shared = _layer("interleaved", shared_intermediate_size=8)
    with pytest.raises(ValueError, match="shared expert"):
        load_gpt_oss_experts(shared, sd)
    with pytest.raises(ValueError, match="shared expert"):
        gpt_oss_state_dict(shared)


def test_a_shard_of_the_experts_is_refused_by_the_loader_and_the_exporter():
    """A gpt-oss layer holding only some of the E experts (rank 0 of 2's shard, the first half) is refused with the
    NotImplementedError that points at ExpertParallelMoE.from_moe: by the loader before anything is copied (the router
    not first, the expert copy failing after it), and by the exporter (which would write E / 2 experts as the block's
    E)."""
    sd = _gpt_oss_block(seed=8, prefix="")
    shard = _layer("interleaved")
    ex = shard.experts
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        setattr(ex, name, torch.nn.Parameter(getattr(ex, name).detach()[: E // 2].clone()))
    before = {k: v.clone() for k, v in shard.state_dict().items()}
    with pytest.raises(NotImplementedError, match="shard of the experts.*ExpertParallelMoE.from_moe"):
        load_gpt_oss_experts(shard, sd)
    for key, v in shard.state_dict().items():
        assert torch.equal(v, before[key]), key
    with pytest.raises(NotImplementedError, match="shard of the experts"):
        gpt_oss_state_dict(shard)


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "kernel"])
def test_router_bias_shifts_logits_and_gets_gradients(use_kernel):
    """router_topk(router_bias=b): logits = X W_rᵀ + b on the torch path and the router kernel's (interpreter); the
    bias changes the choice and gets the column sums of d logits as its gradient."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(13, D, generator=g), torch.randn(E, D, generator=g) * D ** -0.5
    b = (3 * torch.randn(E, generator=g)).requires_grad_(True)
    out = router_topk(x, w, K, router_bias=b, use_kernel=use_kernel)
    torch.testing.assert_close(out.logits, x @ w.t() + b, rtol=1e-6, atol=1e-6)
    plain = router_topk(x, w, K, use_kernel=use_kernel)
    assert not torch.equal(out.topk_ids, plain.topk_ids)
    wanted = torch.randn(13, K, generator=g)
    (db,) = torch.autograd.grad((out.topk_scores * wanted).sum(), b)
    bd = b.detach().double().requires_grad_(True)
    logits = x.double() @ w.double().t() + bd
    ref = torch.softmax(logits.gather(1, out.topk_ids), -1)
    (db_ref,) = torch.autograd.grad((ref * wanted.double()).sum(), bd)
    assert rel_err(db, db_ref) < 1e-5


def test_router_bias_errors_are_named():
    x, w = torch.randn(4, D), torch.randn(E, D)
    with pytest.raises(ValueError, match=r"router_bias must have shape \(E=6,\)"):
        router_topk(x, w, K, router_bias=torch.zeros(E + 1))
    with pytest.raises(TypeError, match="router_bias must be a floating-point tensor"):
        router_topk(x, w, K, router_bias=torch.zeros(E, dtype=torch.long))
    with pytest.raises(ValueError, match="router_bias must be a bool"):
        MoE(D, N, E, K, router_bias=1)


@pytest.mark.filterwarnings("ignore:token rounding with")
def test_layer_with_router_bias_trains_under_token_rounding():
    """A biased router under token rounding (its added pairs scored from the biased logits): the bias gets a
    gradient through the scores and the auxiliary loss, and the functional moe_ref agrees with the layer in eval."""
    torch.manual_seed(0)
    layer = MoE(D, N, E, K, router_bias=True, routing="token_rounding", m_tile=4, backend="torch")
    x = torch.randn(32, D)
    out = layer(x)
    (out.square().mean() + layer.aux_loss).backward()
    assert layer.gate.bias.grad is not None and layer.gate.bias.grad.abs().sum() > 0
    layer.eval()
    ex = layer.experts
    ref, _, _ = sonicmoe.moe_ref(x, layer.gate.weight, ex.gate_up_proj, ex.down_proj, top_k=K,
                                 router_bias=layer.gate.bias)
    assert rel_err(layer(x), ref) < 1e-5


def test_hf_loader_reads_and_writes_the_router_bias():
    torch.manual_seed(1)
    src = MoE(D, N, E, K, router_bias=True)
    with torch.no_grad():
        src.gate.bias.normal_()  # the bias starts at zero, as the loaded layer's does: a missed copy would pass
    sd = hf_experts_state_dict(src, "mlp.")
    assert torch.equal(sd["mlp.gate.bias"], src.gate.bias)
    dst = MoE(D, N, E, K, router_bias=True)
    load_hf_experts(dst, sd, "mlp.")
    assert torch.equal(dst.gate.bias, src.gate.bias)
    with pytest.raises(ValueError, match="router_bias=True"):
        load_hf_experts(MoE(D, N, E, K), sd, "mlp.")
    with pytest.raises(KeyError, match="mlp.gate.bias"):
        load_hf_experts(dst, {k: v for k, v in sd.items() if k != "mlp.gate.bias"}, "mlp.")


def test_loader_is_all_or_nothing_and_explains_itself():
    """A tensor without data (meta) or not floating-point fails before anything is copied; MXFP4 blocks and a prefix
    without its final dot get messages that say what to do; GPT_OSS_OPTIONS cannot be changed by accident."""
    sd = _gpt_oss_block(seed=6)
    layer = _layer("concat")
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    p = "model.layers.0.mlp."
    for key, bad in ((f"{p}experts.down_proj_bias", sd[f"{p}experts.down_proj_bias"].to("meta")),
                     (f"{p}experts.down_proj_bias", sd[f"{p}experts.down_proj_bias"].long())):
        with pytest.raises(ValueError, match="floating-point tensor of 16 bits or more with data"):
            load_gpt_oss_experts(layer, {**sd, key: bad}, p)
        for name, v in layer.state_dict().items():
            assert torch.equal(v, before[name]), name
    blocks = {k: v for k, v in sd.items() if not k.endswith("experts.gate_up_proj")}
    blocks[f"{p}experts.gate_up_proj_blocks"] = torch.zeros(E, 2 * N, 90, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="dequantise"):
        load_gpt_oss_experts(layer, blocks, p)
    with pytest.raises(KeyError, match=re.escape(f"ends with the dot, prefix={p!r}")):  # the prefix to pass instead
        load_gpt_oss_experts(layer, sd, p[:-1])
    with pytest.raises(TypeError):
        GPT_OSS_OPTIONS["activation"] = "swiglu"
    load_gpt_oss_experts(layer, {k: v.double() for k, v in sd.items()}, p)  # cast to the layer's dtype
    assert layer.experts.gate_up_proj.dtype == torch.float32


def test_copy_pickle_and_reset_after_a_training_forward():
    """deepcopy and pickle work after a training-mode forward (whose aux_loss holds a graph); reset_parameters
    re-initialises a layer built on the meta device, the router bias to zero."""
    layer = MoE(D, N, E, K, **GPT_OSS_OPTIONS)
    layer(torch.randn(5, D)).sum()
    assert layer.aux_loss.grad_fn is not None
    twin = copy.deepcopy(layer)
    assert twin.aux_loss is None and layer.aux_loss is not None
    assert torch.equal(twin(torch.ones(2, D)), layer(torch.ones(2, D)))
    assert isinstance(pickle.loads(pickle.dumps(layer)), MoE)
    meta = MoE(D, N, E, K, device="meta", **GPT_OSS_OPTIONS).to_empty(device="cpu")
    with torch.no_grad():
        meta.gate.bias.fill_(5.0)
    meta.reset_parameters()
    assert not meta.gate.bias.any() and meta.gate.weight.abs().max() <= D ** -0.5
    assert meta.experts.gate_up_proj.abs().max() <= D ** -0.5 and meta.experts.gate_up_proj.std() > 0


def test_round_trip_keeps_a_float32_router_beside_bf16_experts():
    """A layer whose router stays float32 beside bf16 experts (as MoE allows): the loader casts each tensor to its
    own parameter's dtype, so the float32 router and its bias come back bit for bit. Before the fix every tensor went
    through the experts' dtype first, rounding the router to bf16 (and changing which experts tokens chose)."""
    layer = MoE(D, N, E, K, dtype=torch.bfloat16, **GPT_OSS_OPTIONS)
    layer.gate.float()
    sd = _gpt_oss_block(seed=int(torch.randint(0, 2 ** 31, ())), prefix="")
    load_gpt_oss_experts(layer, sd)
    assert layer.gate.weight.dtype == torch.float32 and layer.experts.gate_up_proj.dtype == torch.bfloat16
    assert torch.equal(layer.gate.weight, sd["router.weight"]) and torch.equal(layer.gate.bias, sd["router.bias"])
    assert torch.equal(layer.experts.down_proj_bias, sd["experts.down_proj_bias"].bfloat16())
    back = gpt_oss_state_dict(layer)
    twin = MoE(D, N, E, K, dtype=torch.bfloat16, **GPT_OSS_OPTIONS)
    twin.gate.float()
    load_gpt_oss_experts(twin, back)
    for (name, a), b in zip(layer.state_dict().items(), twin.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
