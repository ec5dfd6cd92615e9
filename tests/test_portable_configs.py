"""The Triton kernels' tile configs for GPUs other than Hopper and datacenter Blackwell (``common.tile_family``'s
``"mma"`` family: Ampere, Ada, consumer Blackwell): compiled offline for those architectures on the CPU, chosen by
the launcher and the autotuner on such a GPU, and run on a Hopper GPU through ``SONICMOE_TILE_FAMILY=mma``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from sonicmoe.ops import common, dh, grouped_gemm, up_proj, weight_grad
from sonicmoe.ops.common import TMA_FLAGS, config_dict
from sonicmoe.testing import layer_grads, random_problem, reference_grads, rel_err

REPO = Path(__file__).resolve().parents[1]
MODULES = {"up_proj": up_proj, "dh": dh, "grouped_gemm": grouped_gemm, "weight_grad": weight_grad}
# resource_report.py's kernel names, each with the module whose PORTABLE_SPACE it compiles
REPORT_KERNELS = {"up_proj": up_proj, "down_proj": grouped_gemm, "dxtilde": grouped_gemm, "dh": dh,
                  "dw2": weight_grad, "dw1": weight_grad}
LINE = re.compile(r"^(\w+)\s+reg\s+(\d+) stack\s+(\d+) smem\s+(\d+)")


def _report(*args: str) -> str:
    """``benchmarks/resource_report.py`` in a process of its own (it installs an offline Triton driver), without the
    interpreter the other CPU tests run under."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "resource_report.py"), *args],
                          capture_output=True, text=True, timeout=1200, env={**env, "PYTHONPATH": str(REPO)}).stdout


@pytest.mark.parametrize("arch", [80, 86, 120])
def test_portable_configs_compile_without_spills_within_shared_memory(arch):
    """Every config of every Triton GEMM kernel's PORTABLE_SPACE (and the aggregation's space) compiles for
    ``arch`` with no spilled registers and within its shared-memory limit (99 KiB on sm_86 and sm_120)."""
    out = _report("--space", "portable", "--arch", str(arch))
    assert "ERROR" not in out, out
    compiled = [LINE.match(ln) for ln in out.splitlines() if LINE.match(ln)]
    counts = {name: sum(m.group(1) == name for m in compiled) for name in REPORT_KERNELS}
    assert counts == {name: len(mod.PORTABLE_SPACE) for name, mod in REPORT_KERNELS.items()}, out
    assert sum(m.group(1) == "aggregate" for m in compiled) > 0, out
    for m in compiled:
        assert int(m.group(3)) == 0, f"spills on sm_{arch}: {m.group(0)}"
        assert int(m.group(4)) <= 101376, f"over 99 KiB of shared memory: {m.group(0)}"
    assert "SPILLS" not in out and "SMEM>LIMIT" not in out, out


def test_the_tma_family_spaces_spill_on_sm80():
    """Why the portable spaces exist, and that the check above can fail: the up-projection's tuning space (the
    "tma" family's) spills registers when compiled for sm_80."""
    out = _report("--space", "tune", "--arch", "80", "--kernels", "up_proj")
    assert "SPILLS" in out, out


@pytest.mark.parametrize("name", list(MODULES))
def test_portable_spaces_load_by_pointers_and_differ_from_the_tma_family(name):
    """The "mma" family's configs ask for no TMA descriptor, the first is the one pinned there, and the autotuner
    hands each family its own space."""
    mod = MODULES[name]
    tuned = mod._tuned
    assert tuned.portable is mod.PORTABLE_SPACE and tuned.space is mod.TUNING_SPACE
    assert tuned.portable_default == config_dict(mod.PORTABLE_SPACE[0])
    every_flag = frozenset(TMA_FLAGS)
    for cfg in tuned.get(every_flag, "mma"):
        assert not any(cfg.kwargs.get(f) for f in TMA_FLAGS), cfg
    assert [c.kwargs for c in tuned.get(every_flag, "mma")] == [c.kwargs for c in mod.PORTABLE_SPACE]
    assert any(any(c.kwargs.get(f) for f in TMA_FLAGS) for c in tuned.get(every_flag, "tma"))


def test_tile_family_by_compute_capability_and_by_environment(monkeypatch):
    monkeypatch.delenv("SONICMOE_TILE_FAMILY", raising=False)
    assert common.tile_family(torch.device("cpu")) == "tma"
    expected = {(8, 0): "mma", (8, 6): "mma", (8, 9): "mma", (9, 0): "tma", (10, 0): "tma", (12, 0): "mma"}
    for cap, family in expected.items():
        monkeypatch.setattr(common, "_FAMILY", {})
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx, cap=cap: cap)
        assert common.tile_family(torch.device("cuda", 0)) == family, cap
    for forced in ("mma", "tma"):
        monkeypatch.setenv("SONICMOE_TILE_FAMILY", forced)
        assert common.tile_family(torch.device("cuda", 0)) == forced
        assert common.tile_family(torch.device("cpu")) == forced
    monkeypatch.setenv("SONICMOE_TILE_FAMILY", "ampere")
    with pytest.raises(ValueError, match="SONICMOE_TILE_FAMILY"):
        common.tile_family(torch.device("cuda", 0))


def _fake_kernel():
    pass


@pytest.fixture
def recorded_launches(monkeypatch):
    """``launch`` as on a GPU (no interpreter, no PDL), with every kernel launch recorded instead of run."""
    seen: list[dict] = []
    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setattr(common, "launch_kernel", lambda kernel, grid, **kw: seen.append(kw))
    monkeypatch.setenv("SONICMOE_PDL", "0")
    return seen


def _tuners(monkeypatch):
    space = [triton.Config({"BLOCK_M": 128, "W_TMA": True}, num_warps=8, num_stages=4),
             triton.Config({"BLOCK_M": 64, "W_TMA": True}, num_warps=4, num_stages=4)]
    portable = [triton.Config({"BLOCK_M": 32, "W_TMA": False}, num_warps=4, num_stages=3),
                triton.Config({"BLOCK_M": 16, "W_TMA": False}, num_warps=4, num_stages=2)]
    monkeypatch.setattr(common, "_ALL_TUNERS", [])  # the fake stays out of tuned_configs() elsewhere
    return common.Tuners(_fake_kernel, space, ["N"], None, portable, config_dict(portable[0]))


def test_launch_pins_each_familys_default(monkeypatch, recorded_launches):
    monkeypatch.setenv("SONICMOE_AUTOTUNE", "0")
    tuners = _tuners(monkeypatch)
    args = {"x_ptr": torch.randn(4), "N": 4}
    for family, block_m in (("mma", 32), ("tma", 256)):
        monkeypatch.setenv("SONICMOE_TILE_FAMILY", family)
        common.launch(_fake_kernel, tuners, lambda meta: (1,), args, {"BLOCK_M": 8},
                      {"BLOCK_M": 256, "num_warps": 8, "num_stages": 4}, pdl_device=torch.device("cuda", 0))
        assert recorded_launches[-1]["BLOCK_M"] == block_m, family


def test_autotuning_times_only_the_familys_space(monkeypatch, recorded_launches):
    monkeypatch.setenv("SONICMOE_AUTOTUNE", "1")
    timed: list[int] = []

    def bench(call):
        call()
        timed.append(recorded_launches[-1]["BLOCK_M"])
        return float(recorded_launches[-1]["BLOCK_M"])  # the smaller block "runs faster"

    monkeypatch.setattr(common, "_bench_ms", bench)
    tuners = _tuners(monkeypatch)
    args = {"x_ptr": torch.randn(4), "N": 4}
    for family, blocks, chosen in (("mma", {32, 16}, 16), ("tma", {128, 64}, 64)):
        monkeypatch.setenv("SONICMOE_TILE_FAMILY", family)
        timed.clear()
        common.launch(_fake_kernel, tuners, lambda meta: (1,), args, {"BLOCK_M": 8}, {"BLOCK_M": 256},
                      pdl_device=torch.device("cuda", 0))
        assert set(timed) == blocks and recorded_launches[-1]["BLOCK_M"] == chosen, family
    assert sorted(d["tile_family"] for d in tuners.described()) == ["mma", "tma"]


def test_every_portable_config_matches_its_reference(device, monkeypatch):
    """Each op run with each config of its PORTABLE_SPACE (as given: the interpreter on CPU, natively on a GPU) in
    float32 on a shape that fills no tile (d, n and the experts' counts not tile multiples, one expert empty), its
    outputs NaN before the kernel writes them: within 1e-5 of its float32 twin."""
    from sonicmoe.routing import routing_from_topk

    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")

    t, d, n, e, k = 40, 96, 80, 7, 2
    p = random_problem(t, d, n, e, device=device, seed=31)
    gen = torch.Generator().manual_seed(32)
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)]).to(device)  # expert e-1: empty
    routing = routing_from_topk(ids, e)
    r = routing.num_rows
    a = torch.randn(r, n, generator=gen).to(device)
    h = torch.randn(r, 2 * n, generator=gen).to(device)
    dout = torch.randn(t, d, generator=gen).to(device)
    s = torch.rand(r, generator=gen).to(device)
    for cfg in map(config_dict, up_proj.PORTABLE_SPACE):
        got, ref = up_proj.up_proj(p["x"], p["w1"], None, routing, config=cfg), \
            up_proj.up_proj_ref(p["x"], p["w1"], None, routing)
        assert all(rel_err(g, r_) < 1e-5 for g, r_ in zip(got, ref)), cfg
    for cfg in map(config_dict, grouped_gemm.PORTABLE_SPACE):
        got = grouped_gemm.down_proj(a, p["w2"], None, routing, config=cfg)
        assert rel_err(got, grouped_gemm.down_proj_ref(a, p["w2"], None, routing)) < 1e-5, cfg
        got = grouped_gemm.varlen_m_gemm(h, p["w1"], None, routing, transpose_b=False, config=cfg)
        assert rel_err(got, grouped_gemm.varlen_m_gemm_ref(h, p["w1"], None, routing, transpose_b=False)) < 1e-5, cfg
    for cfg in map(config_dict, dh.PORTABLE_SPACE):
        got, ref = dh.dh(dout, p["w2"], h, s, routing, config=cfg), dh.dh_ref(dout, p["w2"], h, s, routing)
        assert all(rel_err(g, r_) < 1e-5 for g, r_ in zip(got, ref)), cfg
    for cfg in map(config_dict, weight_grad.PORTABLE_SPACE):
        for pg, qg, pm, qm in ((True, False, dout, a), (False, True, h, p["x"])):
            got = weight_grad.varlen_k_gemm(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=torch.float32,
                                            config=cfg)
            ref = weight_grad.varlen_k_gemm_ref(pm, qm, routing, p_gather=pg, q_gather=qg, out_dtype=torch.float32)
            assert rel_err(got, ref) < 1e-5 and torch.all(got[e - 1] == 0), cfg


# ---------------------------------------------------------------- GPU: the portable configs run on a Hopper GPU

PORTABLE_GPU_SHAPES = [
    (4096, 1024, 256, 64, 8, False, "fine-grained"),
    (3000, 768, 384, 32, 4, True, "T and n not tile multiples, biases"),
    (1, 512, 128, 8, 8, False, "T=1, K=E"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("autotune", ["0", "1"], ids=["pinned", "autotuned"])
@pytest.mark.parametrize("shape", PORTABLE_GPU_SHAPES, ids=[s[-1] for s in PORTABLE_GPU_SHAPES])
def test_gpu_portable_configs_layer_bf16(monkeypatch, shape, autotune):
    """The layer in bf16 with the "mma" family's configs and no Gluon kernel (as on an Ampere GPU): output and every
    gradient within 2x the torch backend's bf16 error of the float64 reference (+ small eps), and bitwise the same
    on a second run."""
    monkeypatch.setenv("SONICMOE_TILE_FAMILY", "mma")
    monkeypatch.setenv("SONICMOE_GLUON", "0")
    monkeypatch.setenv("SONICMOE_AUTOTUNE", autotune)
    t, d, n, e, k, bias, _ = shape
    p = random_problem(t, d, n, e, bias=bias, device="cuda", seed=21)
    dout = torch.randn(t, d, device="cuda", generator=torch.Generator("cuda").manual_seed(22))
    dout16 = dout.to(torch.bfloat16)
    out, grads = layer_grads(p, dout16, k)
    again, grads2 = layer_grads(p, dout16, k)
    tout, tgrads = layer_grads(p, dout16, k, backend="torch")
    ref, rgrads = reference_grads(p, dout, k, rounded_to=torch.bfloat16)
    assert rel_err(out, ref) <= 2 * rel_err(tout, ref) + 1e-3 and rel_err(out, ref) < 1e-2
    for key in grads:
        assert rel_err(grads[key], rgrads[key]) <= 2 * rel_err(tgrads[key], rgrads[key]) + 2e-3, key
    assert torch.equal(out, again) and all(torch.equal(grads[key], grads2[key]) for key in grads)


@pytest.mark.gpu
def test_gpu_portable_configs_are_the_ones_that_ran(monkeypatch):
    """With SONICMOE_TILE_FAMILY=mma and autotuning, every Triton GEMM kernel's choice comes from its PORTABLE_SPACE
    (and records the family)."""
    monkeypatch.setenv("SONICMOE_TILE_FAMILY", "mma")
    monkeypatch.setenv("SONICMOE_GLUON", "0")
    monkeypatch.setenv("SONICMOE_AUTOTUNE", "1")
    p = random_problem(2048, 512, 256, 16, device="cuda", seed=23)
    layer_grads(p, torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16), 4)
    for name, mod in MODULES.items():
        chosen = [d for d in mod._tuned.described() if d["tile_family"] == "mma"]
        assert chosen, name
        portable = [config_dict(c) for c in mod.PORTABLE_SPACE]
        assert all(d["config"] in portable for d in chosen), (name, chosen)
