"""``sonicmoe bench`` on CPU: smoke run and its JSON, FLOP counting, presets vs configs.json, plots and
markdown from a synthetic results file, wrong or crashing backends reported (FAIL / error) and not timed.

The CPU runs use wall-clock timing with ``--warmup 0 --rep 0`` (one warm-up call, five measured) so the
whole file stays well under 30 s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sonicmoe.bench import baselines, cli, report
from sonicmoe.bench.baselines import REGISTRY, BaselineSpec, ExpertsCase, UpperBoundCase
from sonicmoe.bench.measure import reference_errors
from sonicmoe.bench.problem import make_problem
from sonicmoe.bench.shapes import (
    PRESETS,
    Shape,
    parse_shape,
    preset_shapes,
    spec_held_bytes,
    tflops,
    useful_flops,
)
from sonicmoe.env import interpreting

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO.parent / "shared" / "configs.json"
FAST = ["--warmup", "0", "--rep", "0", "--no-plot", "-q", "--device", "cpu"]


def _strict_load(path: Path) -> dict:
    def bad_constant(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(path.read_text(), parse_constant=bad_constant)


def _only_json(out_dir: Path) -> Path:
    files = sorted(out_dir.glob("*.json"))
    assert len(files) == 1, files
    return files[0]


def _run(tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "res"
    rc = cli.main(["--out", str(out), *FAST, *args])
    return rc, _strict_load(_only_json(out))


# ---------------------------------------------------------------------------------------------------
# CPU smoke run


def test_cpu_smoke_writes_valid_json(tmp_path, monkeypatch):
    monkeypatch.setenv("SONICMOE_AGG_CHUNK", "0")  # a library switch: the results file names it
    rc, doc = _run(tmp_path, "--preset", "tiny", "--backends", "torch,loop,upper", "--tag", "ci smoke")
    assert rc == 0
    assert _only_json(tmp_path / "res").name.endswith("_cpu_ci-smoke.json")
    for key in ("schema", "date", "argv", "args", "env", "timer", "flops", "results"):
        assert key in doc, key
    env = doc["env"]
    for key in ("device", "driver", "torch", "triton", "python", "git_commit"):
        assert key in env, key
    assert env["torch"] == torch.__version__
    assert env["switches"]["SONICMOE_AGG_CHUNK"] == "0" and "SONICMOE_GIT_COMMIT" not in env["switches"]
    assert doc["timer"] == "time.perf_counter"
    assert doc["autotune"] is False and doc["tile_configs"] == {}  # nothing is autotuned on CPU
    assert doc["args"]["dtype"] == "fp32"
    (rec,) = doc["results"]
    assert (rec["T"], rec["d"], rec["n"], rec["E"], rec["K"]) == (64, 32, 16, 4, 2)
    assert rec["TK"] == 128 and rec["routing"] == "topk"
    assert set(rec["backends"]) == {"torch", "loop", "upper"}
    for name, row in rec["backends"].items():
        assert row["status"] == "ok", (name, row["message"])
        assert row["check"]["passed"] and set(row["check"]["errors"]) == {
            "out", "dx", "dw1", "dw2", "ds", "out_rows", "dx_rows", "dw1_experts", "dw2_experts"}
        assert row["check"]["pairs"] == rec["TK"] and row["check"]["tol"] == 2e-3  # fp32's default
        assert all(0 <= v <= 1e-4 for v in row["check"]["errors"].values())  # float32 vs float32
        for phase in ("fwd", "total"):
            ms = row[phase]["ms"]
            assert ms["p20"] <= ms["p50"] <= ms["p80"] and ms["p50"] > 0
            assert row[phase]["tflops"] == pytest.approx(rec["flops"][phase] / (ms["p50"] * 1e-3) / 1e12)
        assert row["bwd"]["ms"]["p50"] == pytest.approx(row["total"]["ms"]["p50"] - row["fwd"]["ms"]["p50"])
        assert row["memory"] is None  # CUDA only
    assert rec["backends"]["torch"]["router"]["fwd"]["ms"]["p50"] > 0
    assert rec["ratio_base"] == "torch" and set(rec["ratios"]) == {"loop", "upper"}


def _unavailable_factory(problem, options):
    raise baselines.Unavailable("not in this test")


def test_default_run_without_gpu_is_tiny(tmp_path, monkeypatch):
    """`sonicmoe bench` with no preset on a machine without GPU: tiny shape, every default backend
    has a row (triton stubbed out: the interpreter would be slow here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(REGISTRY, "triton", BaselineSpec("triton", _unavailable_factory, "stub", kind="ours"))
    out = tmp_path / "res"
    rc = cli.main(["--out", str(out), "--warmup", "0", "--rep", "0", "--no-plot", "-q",
                   "--no-router-variant"])
    doc = _strict_load(_only_json(out))
    assert rc == 0
    (rec,) = doc["results"]
    assert rec["name"] == "tiny"
    assert list(rec["backends"]) == ["triton", "torch", "loop", "upper"]
    assert rec["backends"]["triton"]["status"] == "skipped"


@pytest.mark.interpreter
def test_triton_backend_through_interpreter(tmp_path):
    """Ours (sonicmoe.experts backend="triton") through Triton's interpreter in float32: checked
    (output and grads), timed, and the ratio base. Skipped until sonicmoe.ops.moe_function exists."""
    pytest.importorskip("sonicmoe.ops.moe_function")
    if not torch.cuda.is_available() and not interpreting():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    rc, doc = _run(tmp_path, "--preset", "tiny", "--backends", "triton,upper", "--no-router-variant")
    rec = doc["results"][0]
    row = rec["backends"]["triton"]
    assert row["status"] in ("ok", "FAIL"), row["message"]  # a FAIL is the kernels' business, not ours
    if row["status"] == "ok":
        assert rc == 0 and rec["ratio_base"] == "triton" and "upper" in rec["ratios"]
        assert row["check"]["errors"]["dw1"] <= 1e-3 and row["total"]["ms"]["p50"] > 0


def test_flop_formulas():
    f = useful_flops(24576 * 8, 256, 1536)
    tk_nd = 24576 * 8 * 256 * 1536
    assert f == {"fwd": 6 * tk_nd, "bwd": 12 * tk_nd, "total": 18 * tk_nd}
    assert f["fwd"] + f["bwd"] == f["total"]
    # the up-projection (2·TK·d·2n) plus the down-projection (2·TK·n·d)
    assert f["fwd"] == 2 * 24576 * 8 * 1536 * 512 + 2 * 24576 * 8 * 256 * 1536
    assert spec_held_bytes(10, 8, 30, 4) == 2 * 10 * 8 + 4 * 30 * 4


def test_tflops_of_no_time_is_none():
    """Throughput of a measured time only: 2e12 FLOPs in 1000 ms are 2 TFLOP/s; a missing, zero or negative time
    (nothing measured) gives None, not a division by zero or a negative speed."""
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert tflops(3e12, 0.5) == pytest.approx(6000.0)
    for ms in (None, 0.0, -1.0, float("nan")):
        assert tflops(1e12, ms) is None, ms


# ---------------------------------------------------------------------------------------------------
# presets


def test_presets_match_configs_json():
    if not CONFIGS.exists():
        pytest.skip(f"{CONFIGS} not present")
    cfg = json.loads(CONFIGS.read_text())

    def dims(preset):
        return {s.name: list(s.dims) for s in preset_shapes(preset)}

    assert dims("7b") == cfg["breakdown_7b"]
    assert dims("granularity") == cfg["granularity"]
    assert dims("iso-flops") == cfg["iso_flops_sweep_7b"]
    assert dims("models") == cfg["models"]
    want = {}
    for key, c in cfg["token_rounding"].items():
        if key.startswith("_"):
            continue
        for e in c["E"]:
            want[f"{key}-E{e}"] = [c["T"], c["d"], c["n"], e, c["K"]]
    assert dims("token-rounding") == want
    assert all(s.routings == ("topk", "token_rounding") for s in preset_shapes("token-rounding"))


def test_preset_groups_and_parse_shape():
    groups = {s.group for s in PRESETS["granularity"]}
    assert groups == {"1.4B", "7B", "30B", "120B"}
    assert len({s.dims for s in PRESETS["all"]}) == len(PRESETS["all"])
    s = parse_shape("32768,2048,768,128,8")
    assert s.dims == (32768, 2048, 768, 128, 8) and s.group == "custom"
    assert parse_shape("qwen=1, 2, 3, 4, 2").name == "qwen"
    assert s.with_max_T(1000).T == 1000 and s.with_max_T(1000).T_preset == 32768
    for bad in ("1,2,3,4", "a,b,c,d,e", "8,8,8,2,4"):
        with pytest.raises(ValueError):
            parse_shape(bad)
    with pytest.raises(ValueError, match="5 integers"):  # one too many: the count is the error, not the integers
        parse_shape("1,2,3,4,2,6")
    # the default name spells each letter's value; G = d/n, rho = K/E, TK = T·K
    odd = parse_shape("96,48,16,12,3")
    assert odd.name == "T96-d48-n16-E12-K3"
    assert (odd.G, odd.rho, odd.TK) == (3.0, 0.25, 288)
    with pytest.raises(ValueError):
        preset_shapes("nope")
    assert cli.main(["--preset", "nope", *FAST]) == 2
    assert cli.main(["--routing", "bogus", *FAST]) == 2


def test_shape_bounds_max_T_and_preset_names():
    """A shape takes K = E (every expert per token) and refuses K > E or a letter below 1, naming it; ``--max-T``
    at or above T leaves the shape as it is (no T_preset), and capping twice keeps the preset's T; preset names
    take any case and ``_`` for ``-``; ``--shape`` takes ``x`` between the numbers; the CLI's ``--preset`` takes
    comma lists and repeats, in order."""
    assert Shape("all", 8, 4, 4, 3, 3).rho == 1.0
    with pytest.raises(ValueError, match="K=4 must not exceed E=3"):
        Shape("over", 8, 4, 4, 3, 4)
    for i, letter in enumerate("TdnEK"):
        dims = [8, 4, 4, 3, 2]
        dims[i] = 0
        with pytest.raises(ValueError, match=f"{letter} must be a positive int, got 0"):
            Shape("zero", *dims)
    s = Shape("s", 4096, 64, 32, 8, 2)
    assert s.with_max_T(4096) is s and s.with_max_T(5000) is s and s.with_max_T(None) is s
    assert s.with_max_T(4096).T_preset is None
    twice = s.with_max_T(1024).with_max_T(256)
    assert (twice.T, twice.T_preset) == (256, 4096)
    assert [x.dims for x in preset_shapes(" ISO_FLOPS ")] == [x.dims for x in PRESETS["iso-flops"]]
    assert parse_shape("64x32x16x4x2").dims == (64, 32, 16, 4, 2)
    assert parse_shape("64, 32, 16, 4, 2,").dims == (64, 32, 16, 4, 2)  # a trailing comma adds no number
    for i, letter in enumerate("TdnEK"):  # a float is no count, even a whole one
        dims = [8, 4, 4, 3, 2]
        dims[i] = float(dims[i])
        with pytest.raises(ValueError, match=f"{letter} must be a positive int, got {dims[i]!r}"):
            Shape("float", *dims)
    args = cli.build_parser().parse_args(["--preset", "tiny, 7b", "--preset", "iso_flops", "--max-T", "32"])
    shapes = cli._shapes(args)
    assert [x.name for x in shapes] == ["tiny", "7B", *(x.name for x in PRESETS["iso-flops"])]
    assert all(x.T == 32 for x in shapes) and [x.T_preset for x in shapes[:2]] == [64, 24576]
    # blank items of a comma list (a trailing comma, a lone one) name no preset
    blank = cli.build_parser().parse_args(["--preset", "tiny,", "--preset", " , "])
    assert [x.name for x in cli._shapes(blank)] == ["tiny"]


def test_preset_all_is_every_paper_shape_once():
    """``all``: every shape of the paper presets (7b, granularity, iso-flops, models, token-rounding), each (dims,
    routings) once, in that order, tiny left out; the token-rounding sweep runs both routings by default, the others
    the command line's; preset_shapes returns a new list each time (a caller's edit leaves the preset alone)."""
    paper = ("7b", "granularity", "iso-flops", "models", "token-rounding")
    want = []
    for key in paper:
        for s in PRESETS[key]:
            if (s.dims, s.routings) not in [(w.dims, w.routings) for w in want]:
                want.append(s)
    assert [(s.name, s.dims, s.routings) for s in PRESETS["all"]] == [(s.name, s.dims, s.routings) for s in want]
    assert {s.dims for s in PRESETS["models"]} <= {s.dims for s in PRESETS["all"]}
    assert PRESETS["tiny"][0].dims not in {s.dims for s in PRESETS["all"]}
    assert len(PRESETS["token-rounding"]) == 12
    assert all(s.routings == ("topk", "token_rounding") for s in PRESETS["token-rounding"])
    assert all(s.routings is None for key in paper[:4] for s in PRESETS[key])
    first = preset_shapes("tiny")
    first.append(Shape("extra", 8, 4, 4, 2, 1))
    first[0] = Shape("other", 8, 4, 4, 2, 1)
    assert [s.name for s in preset_shapes("tiny")] == ["tiny"] and len(PRESETS["tiny"]) == 1


def test_max_T_of_zero_tokens_is_refused_and_an_empty_shape_name_takes_the_default(capsys):
    """``with_max_T(0)`` is no "leave it alone" (that is None): a cap of 0 tokens leaves no token, refused as T = 0
    (the CLI exits 2 on ``--max-T 0`` before anything runs); ``--shape "=T,d,n,E,K"`` (nothing before the ``=``)
    names the shape as if no name were given, not with an empty label."""
    s = Shape("s", 4096, 64, 32, 8, 2)
    with pytest.raises(ValueError, match="T must be a positive int, got 0"):
        s.with_max_T(0)
    assert s.with_max_T(1).T == 1 and s.with_max_T(1).T_preset == 4096
    assert cli.main([*FAST, "--shape", "64,32,16,4,2", "--max-T", "0", "--backends", "torch"]) == 2
    assert "--max-T must be a positive number of tokens, got 0" in capsys.readouterr().err
    assert parse_shape("=64,32,16,4,2").name == "T64-d32-n16-E4-K2"
    assert parse_shape(" = 96,48,16,12,3").name == "T96-d48-n16-E12-K3"


def test_preset_sweeps_hold_flops_and_parameters_fixed():
    """Without configs.json (a checkout without ../shared skips the comparison above): each granularity sweep of a
    model size, and the 7B iso-FLOPs sweep, is at one (T, d) with K·n (FLOPs per token) and E·n (parameters) fixed
    while n varies, every name spelling its n; the token-rounding sweeps spell d, n, K and E in their names; the groups
    are the model sizes, "7B" for the breakdown shape and "7B-iso-flops" for that sweep (kept apart from the 7B
    granularity sweep it shares shapes with)."""
    sweeps = [(s.group, s) for s in PRESETS["granularity"]] + [("iso", s) for s in PRESETS["iso-flops"]]
    by_group: dict[str, list[Shape]] = {}
    for key, s in sweeps:
        by_group.setdefault(key, []).append(s)
        assert s.name.endswith(f"-n{s.n}"), s.name
    assert sorted(by_group) == ["1.4B", "120B", "30B", "7B", "iso"]
    for key, shapes in by_group.items():
        assert len(shapes) == (5 if key == "iso" else 3) and len({s.n for s in shapes}) == len(shapes), key
        for what in ((lambda s: (s.T, s.d)), (lambda s: s.K * s.n), (lambda s: s.E * s.n)):
            assert len({what(s) for s in shapes}) == 1, (key, [s.dims for s in shapes])
    assert {s.group for s in PRESETS["iso-flops"]} == {"7B-iso-flops"} and [s.group for s in PRESETS["7b"]] == ["7B"]
    for s in PRESETS["token-rounding"]:
        assert s.name == f"tr-d{s.d}-n{s.n}-k{s.K}-E{s.E}" and s.group == s.name.rsplit("-E", 1)[0], s.name


# ---------------------------------------------------------------------------------------------------
# correctness gate


def _wrong_out_factory(problem, options):
    def fn(x, w1, w2, routing, pair_scores):
        import sonicmoe

        return 1.1 * sonicmoe.experts(x, w1, w2, routing, pair_scores, backend="torch")

    return ExpertsCase("wrong_out", problem, fn)


def _wrong_grad_factory(problem, options):
    def fn(x, w1, w2, routing, pair_scores):
        import sonicmoe

        return sonicmoe.experts(x, w1, w2.detach(), routing, pair_scores, backend="torch")  # no dW2

    return ExpertsCase("wrong_grad", problem, fn)


def _nan_factory(problem, options):
    def fn(x, w1, w2, routing, pair_scores):
        import sonicmoe

        out = sonicmoe.experts(x, w1, w2, routing, pair_scores, backend="torch")
        return out + torch.where(torch.arange(out.shape[0])[:, None] == 3, float("nan"), 0.0)

    return ExpertsCase("nan", problem, fn)


def _boom_factory(problem, options):
    def fn(*args):
        raise RuntimeError("boom: kernel exploded")

    return ExpertsCase("boom", problem, fn)


def test_wrong_backends_fail_and_are_not_timed(tmp_path, monkeypatch):
    for name, factory in (("wrong_out", _wrong_out_factory), ("wrong_grad", _wrong_grad_factory),
                          ("nan", _nan_factory), ("boom", _boom_factory)):
        monkeypatch.setitem(REGISTRY, name, BaselineSpec(name, factory, "test", default=False))
    rc, doc = _run(tmp_path, "--preset", "tiny", "--backends", "torch,wrong_out,wrong_grad,nan,boom",
                   "--no-router-variant")
    assert rc == 1
    rows = doc["results"][0]["backends"]
    assert rows["torch"]["status"] == "ok"
    for name, worst in (("wrong_out", None), ("wrong_grad", "dw2"), ("nan", "out")):
        row = rows[name]
        assert row["status"] == "FAIL", (name, row)
        assert row["check"]["passed"] is False and row["check"]["worst"] == (worst or row["check"]["worst"])
        assert row["fwd"] is None and row["total"] is None and row["bwd"] is None and row["memory"] is None
        assert "wrong result" in row["message"]
    assert rows["wrong_out"]["check"]["errors"]["out"] == pytest.approx(0.1, rel=1e-3)
    assert rows["nan"]["check"]["errors"]["out"] is None  # NaN stored as null, never passes
    assert rows["boom"]["status"] == "error" and "boom: kernel exploded" in rows["boom"]["message"]
    assert rows["boom"]["fwd"] is None
    assert set(doc["results"][0]["ratios"]) == set()  # nothing but the base was timed
    table = report.terminal_table(doc)
    assert "FAIL" in table and "boom" in table


def test_no_check_times_anyway_and_loop_limit(tmp_path, monkeypatch):
    monkeypatch.setitem(REGISTRY, "wrong_out", BaselineSpec("wrong_out", _wrong_out_factory, "t", default=False))
    rc, doc = _run(tmp_path, "--preset", "tiny", "--backends", "wrong_out,loop", "--no-check",
                   "--loop-max-E", "2", "--mode", "fwd", "--no-router-variant")
    assert rc == 0
    rows = doc["results"][0]["backends"]
    assert rows["wrong_out"]["status"] == "ok" and rows["wrong_out"]["check"] is None
    assert rows["wrong_out"]["fwd"]["ms"]["p50"] > 0 and rows["wrong_out"]["total"] is None
    assert rows["loop"]["status"] == "skipped" and "loop-max-E" in rows["loop"]["message"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_chunks_and_upper_bound(dtype):
    """The expert-chunked reference equals the one-chunk reference; the upper bound matches its ref."""
    shape = Shape("t", 50, 16, 8, 5, 2)
    p = make_problem(shape, dtype=dtype, device="cpu", seed=3)
    for case in (ExpertsCase("torch", p, baselines.experts_loop), UpperBoundCase(p)):
        out = case.forward()
        out.backward(p.dout)
        whole = reference_errors(out.detach(), case.ref_spec(), p.dout)
        chunked = reference_errors(out.detach(), case.ref_spec(), p.dout, chunk_bytes=1)
        for k in whole:
            assert chunked[k] == pytest.approx(whole[k], rel=1e-3, abs=1e-6), k
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert all(v <= tol for v in whole.values()), whole
        for t in case.leaves:
            t.grad = None
    up = UpperBoundCase(p)
    assert up.m == 20 and up.k_up == 2 and up.x_up.shape == (100, 16)
    # under top-k the bound weighs each token's K rows by the problem's own scores, in the layer's dtype
    assert up.s_up.dtype == dtype and torch.equal(up.s_up.detach(), p.pair_scores.detach().view(50, 2).to(dtype))
    # E = 3 does not divide T·K = 100: ⌈100/3⌉ = 34 rows per expert, 102 in all, the first 100 summed
    p3 = make_problem(Shape("t3", 50, 16, 8, 3, 2), dtype=dtype, device="cpu", seed=3)
    up = UpperBoundCase(p3)
    assert up.m == 34 and up.rows == 102
    out = up.forward()
    assert out.shape == (50, 16) and out.dtype == dtype
    # and it sums the first T·K rows, those its reference takes (not the last T·K of the E·m it computed)
    errors = reference_errors(out.detach(), up.ref_spec(), None)
    assert set(errors) >= {"out"} and all(v <= tol for v in errors.values()), errors
    # X_up's row r is a copy of x[r mod T]: the 102 rows cycle through the 50 tokens (the last 2 are x[0], x[1])
    assert torch.equal(up.x_up.detach(), p3.x.detach()[torch.arange(102) % 50])
    # token rounding down to M_tile = 8 keeps R = 80 pairs of T = 50 tokens: K' = round(1.6) = 2, not 1
    tr = make_problem(shape, dtype=dtype, device="cpu", seed=3, mode="token_rounding", m_tile=8, rounding="down")
    up = UpperBoundCase(tr)
    assert tr.R == 80 and up.k_up == 2 and up.m == 20
    # no top-k scores of its own to reuse: each token weighs its K' rows equally, 1/K' each, in the layer's dtype
    assert up.s_up.dtype == dtype and torch.equal(up.s_up.detach(), torch.full((50, 2), 0.5, dtype=dtype))


def test_upper_bound_of_token_rounding_weighs_rows_equally_and_keeps_one_row_per_token():
    """Under token rounding the bound never reuses the pair scores, even where R happens to equal T·K' (the pairs
    are then no (T, K') grid: a token may hold 1 or 3 of them), and it computes at least one row per token where the
    rounding kept fewer pairs than T / 2 (K' = round(R / T) would be 0: no row, an empty bound)."""
    p = make_problem(Shape("tr", 64, 16, 8, 4, 2), dtype=torch.float32, device="cpu", seed=0,
                     mode="token_rounding", m_tile=16)
    per_token = torch.bincount(p.pair_token.long(), minlength=64)
    assert p.R == 128 and p.topk_ids is None and per_token.min() < 2 < per_token.max()
    up = UpperBoundCase(p)
    assert up.k_up == 2 and torch.equal(up.s_up.detach(), torch.full((64, 2), 0.5))
    with pytest.warns(UserWarning, match="token rounding with"):
        few = make_problem(Shape("few", 64, 16, 8, 8, 1), dtype=torch.float32, device="cpu", seed=1,
                           mode="token_rounding", m_tile=16, rounding="down")
    assert 0 < few.R < 32
    up = UpperBoundCase(few)
    assert (up.k_up, up.m, up.rows) == (1, 8, 64) and torch.equal(up.s_up.detach(), torch.ones(64, 1))
    out = up.forward()
    errors = reference_errors(out.detach(), up.ref_spec(), None)
    assert out.shape == (64, 16) and out.abs().sum() > 0 and errors["out"] < 1e-5, errors


def test_make_problem_dtypes_scales_and_seed():
    """make_problem: the activations and weights in the asked dtype, the scores S a float32 leaf requiring grad
    (whatever the dtype), fan-in scales (W_r, W1 by 1/sqrt(d), W2 by 1/sqrt(n)), top-k pairs token-major
    (p = t·K + k), and the same data for the same seed only."""
    T, d, n, E, K = 256, 64, 16, 8, 2
    p = make_problem(Shape("p", T, d, n, E, K), dtype=torch.float16, device="cpu", seed=5)
    for t in (p.x, p.router_weight, p.w1, p.w2, p.dout):
        assert t.dtype == torch.float16
    assert p.pair_scores.dtype == torch.float32 and p.pair_scores.is_leaf and p.pair_scores.requires_grad
    assert p.pair_scores.shape == (T * K,) and p.R == T * K
    for t, scale in ((p.x, 1.0), (p.router_weight, d**-0.5), (p.w1, d**-0.5), (p.w2, n**-0.5), (p.dout, 1.0)):
        assert float(t.detach().float().std()) == pytest.approx(scale, rel=0.06), t.shape
    assert torch.equal(p.pair_token, torch.arange(T, dtype=torch.int32).repeat_interleave(K))
    assert torch.equal(p.pair_expert, p.topk_ids.reshape(-1))
    same = make_problem(Shape("p", T, d, n, E, K), dtype=torch.float16, device="cpu", seed=5)
    other = make_problem(Shape("p", T, d, n, E, K), dtype=torch.float16, device="cpu", seed=6)
    assert torch.equal(same.x, p.x) and torch.equal(same.w2, p.w2) and torch.equal(same.pair_scores, p.pair_scores)
    assert not torch.equal(other.x, p.x) and not torch.equal(other.w2, p.w2)


def test_route_takes_a_token_rounding_that_returns_a_tuple(monkeypatch):
    """A token_rounding that returns (pair_token, pair_expert, pair_scores) as a tuple (no routing of its own):
    the same pairs, in that order, and their routing built from them; a result of neither form is reported as
    TokenRoundingUnavailable."""
    from sonicmoe.bench import problem as bp

    real = bp.load_token_rounding()
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(96, 16, generator=gen), torch.randn(6, 16, generator=gen)
    want = bp.route(x, w, 2, "token_rounding", m_tile=8)
    monkeypatch.setattr(bp, "load_token_rounding",
                        lambda: lambda router, **kw: tuple(getattr(real(router, **kw), a)
                                                           for a in ("pair_token", "pair_expert", "pair_scores")))
    got = bp.route(x, w, 2, "token_rounding", m_tile=8)
    assert got.pair_token.numel() > 0 and not torch.equal(got.pair_token, got.pair_expert)
    for a in ("pair_token", "pair_expert", "pair_scores"):
        assert torch.equal(getattr(got, a), getattr(want, a)), a
    assert torch.equal(got.routing.expert_offsets, want.routing.expert_offsets)
    assert torch.equal(got.routing.row_token, want.routing.row_token)
    # the static form's padding pairs (token T, expert E) become padding rows, as in the library's own routing
    monkeypatch.setattr(bp, "load_token_rounding", lambda: real)
    want = bp.route(x, w, 2, "token_rounding", m_tile=8, static=True)
    assert int((want.pair_token == 96).sum()) > 0 and want.routing.padded
    monkeypatch.setattr(bp, "load_token_rounding",
                        lambda: lambda router, **kw: tuple(getattr(real(router, **kw), a)
                                                           for a in ("pair_token", "pair_expert", "pair_scores")))
    got = bp.route(x, w, 2, "token_rounding", m_tile=8, static=True)
    assert got.routing.padded
    for a in ("expert_offsets", "row_token", "token_offsets", "token_rows"):
        assert torch.equal(getattr(got.routing, a), getattr(want.routing, a)), a
    monkeypatch.setattr(bp, "load_token_rounding", lambda: lambda router, **kw: 5)
    with pytest.raises(bp.TokenRoundingUnavailable, match="token_rounding returned int"):
        bp.route(x, w, 2, "token_rounding", m_tile=8)


def test_route_takes_a_list_result_and_refuses_a_partial_object(monkeypatch):
    """token_rounding's result as a list [pair_token, pair_expert, pair_scores] is taken like a tuple (the same pairs);
    an object with only some of the three attributes is TokenRoundingUnavailable, not half read."""
    from sonicmoe.bench import problem as bp

    real = bp.load_token_rounding()
    gen = torch.Generator().manual_seed(12)
    x, w = torch.randn(80, 16, generator=gen), torch.randn(5, 16, generator=gen)
    want = bp.route(x, w, 2, "token_rounding", m_tile=8)
    monkeypatch.setattr(bp, "load_token_rounding",
                        lambda: lambda router, **kw: [getattr(real(router, **kw), a)
                                                      for a in ("pair_token", "pair_expert", "pair_scores")])
    got = bp.route(x, w, 2, "token_rounding", m_tile=8)
    assert got.pair_token.numel() > 0
    for a in ("pair_token", "pair_expert", "pair_scores"):
        assert torch.equal(getattr(got, a), getattr(want, a)), a
    assert torch.equal(got.routing.expert_offsets, want.routing.expert_offsets)
    monkeypatch.setattr(bp, "load_token_rounding",
                        lambda: lambda router, **kw: SimpleNamespace(pair_token=real(router, **kw).pair_token))
    with pytest.raises(bp.TokenRoundingUnavailable, match="token_rounding returned SimpleNamespace"):
        bp.route(x, w, 2, "token_rounding", m_tile=8)


def test_route_without_pairs_keeps_the_router_choice_and_pair_tokens_are_int32():
    """route(pairs=False) under top-k leaves out pair_token/pair_expert only: topk_ids and router_ids are still the
    router's (T, K) choice (the router variant's check reads router_ids); top-k's pair_token is int32, the dtype
    token rounding gives its own pair_token."""
    from sonicmoe.bench import problem as bp

    gen = torch.Generator().manual_seed(13)
    x, w = torch.randn(48, 16, generator=gen), torch.randn(6, 16, generator=gen)
    full = bp.route(x, w, 2, "topk")
    bare = bp.route(x, w, 2, "topk", pairs=False)
    assert bare.pair_token is None and bare.pair_expert is None
    want = torch.topk(x.float() @ w.float().t(), 2, dim=1).indices
    for r in (full, bare):
        assert torch.equal(r.topk_ids.long().sort(1).values, want.sort(1).values)
        assert r.router_ids is not None and torch.equal(r.router_ids, r.topk_ids)
    tr = bp.route(x, w, 2, "token_rounding", m_tile=8)
    assert full.pair_token.dtype == tr.pair_token.dtype == torch.int32


def test_problem_leaves_are_every_tensor_with_a_gradient():
    """Problem.leaves() names every leaf that takes a gradient (x, W_r, W1, W2, S): the runner frees their gradients
    after each backend through it, the router weight's (set by the router variant) included."""
    from sonicmoe.bench.measure import free_memory

    p = make_problem(Shape("l", 32, 16, 8, 4, 2), dtype=torch.float32, device="cpu", seed=3)
    r = p.route(p.x)
    loss = r.pair_scores.sum() + (p.x * p.dout).sum() + p.w1.sum() + p.w2.sum() + p.pair_scores.sum()
    loss.backward()
    grads = [p.x, p.router_weight, p.w1, p.w2, p.pair_scores]
    assert all(t.grad is not None for t in grads)
    assert [id(t) for t in p.leaves()] == [id(t) for t in grads]
    free_memory(*p.leaves())
    assert all(t.grad is None for t in grads)


def test_loop_limit_and_default_backends(monkeypatch):
    """The loop runs up to --loop-max-E experts inclusive; ``default`` adds a competitor library only where it is
    installed."""
    p = make_problem(Shape("t", 8, 16, 8, 5, 2), dtype=torch.float32, device="cpu", seed=3)
    assert baselines._loop_factory(p, {"loop_max_E": 5}).name == "loop"
    with pytest.raises(baselines.Unavailable, match="loop-max-E=4"):
        baselines._loop_factory(p, {"loop_max_E": 4})
    # without the option the loop takes up to 128 experts; empty items of the list (a trailing comma) are skipped
    wide = make_problem(Shape("w", 4, 8, 4, 128, 2), dtype=torch.float32, device="cpu", seed=3)
    assert baselines._loop_factory(wide, {}).name == "loop"
    with pytest.raises(baselines.Unavailable, match="loop-max-E=128"):
        baselines._loop_factory(make_problem(Shape("w", 4, 8, 4, 129, 2), dtype=torch.float32, device="cpu"), {})
    # no limit (--loop-max-E 0 reaches the factory as None): the loop takes any number of experts
    wider = make_problem(Shape("w", 4, 8, 4, 129, 2), dtype=torch.float32, device="cpu")
    assert baselines._loop_factory(wider, {"loop_max_E": None}).name == "loop"
    assert baselines.resolve_backends("torch,, loop,") == ["torch", "loop"]
    with pytest.raises(ValueError, match="^unknown backend 'lop'; choose from triton, torch, loop, upper, scattermoe, "
                       "default, all$"):
        baselines.resolve_backends("torch,lop")
    for installed in (False, True):
        monkeypatch.setattr(baselines, "library_installed", lambda name, installed=installed: installed)
        assert ("scattermoe" in baselines.resolve_backends("default")) == installed
    assert baselines.resolve_backends("upper,default,triton") == ["upper", "triton", "torch", "loop", "scattermoe"]
    # ``all``: every registered backend, the ones off by default too, whether or not their library is installed
    monkeypatch.setattr(baselines, "library_installed", lambda name: False)
    assert baselines.resolve_backends("all") == list(baselines.REGISTRY)
    assert baselines.resolve_backends("loop,all") == ["loop"] + [n for n in baselines.REGISTRY if n != "loop"]
    # register_baseline replaces a backend of the same name (and returns the spec it registered)
    monkeypatch.setattr(baselines, "REGISTRY", dict(baselines.REGISTRY))
    mine = baselines.BaselineSpec("loop", baselines._loop_factory, "a replacement loop", default=False)
    assert baselines.register_baseline(mine) is mine and baselines.REGISTRY["loop"] is mine
    assert "loop" not in baselines.resolve_backends("default") and "loop" in baselines.resolve_backends("all")


def test_library_installed_finds_modules_without_importing(monkeypatch):
    """library_installed: True for an importable module, False for a missing one, for a submodule of a missing
    package (find_spec raises ModuleNotFoundError) and for a module in sys.modules without a spec (ValueError)."""
    import types

    assert baselines.library_installed("torch") and baselines.library_installed("sonicmoe.bench")
    assert not baselines.library_installed("sonicmoe_no_such_library")
    assert not baselines.library_installed("sonicmoe_no_such_library.sub")
    monkeypatch.setitem(sys.modules, "sonicmoe_specless", types.ModuleType("sonicmoe_specless"))
    assert not baselines.library_installed("sonicmoe_specless")


def test_scattermoe_unavailable_reasons(monkeypatch):
    """The ScatterMoE factory's reasons, in order: no CUDA device; a routing that is not plain top-k (no (T, K)
    pair grid to hand it) before any import; then the library missing (the import fails)."""
    p = make_problem(Shape("t", 8, 16, 8, 4, 2), dtype=torch.float32, device="cpu", seed=3)
    with pytest.raises(baselines.Unavailable, match="needs a CUDA GPU"):
        baselines._scattermoe_factory(p, {})
    monkeypatch.setitem(sys.modules, "scattermoe", None)  # an import of it fails, installed or not
    on_gpu = SimpleNamespace(device=torch.device("cuda"), topk_ids=None, shape=p.shape)
    with pytest.raises(baselines.Unavailable, match="plain top-k"):
        baselines._scattermoe_factory(on_gpu, {})
    on_gpu.topk_ids = p.topk_ids
    with pytest.raises(baselines.Unavailable, match="scattermoe is not installed"):
        baselines._scattermoe_factory(on_gpu, {})


def test_triton_backend_unavailable_in_bf16_under_the_interpreter(monkeypatch):
    """Under TRITON_INTERPRET on a CPU the triton backend runs float32 only: the interpreter multiplies bf16 wrongly
    (triton#11584), and a wrong result must not read as our kernels' error; without it, it needs a GPU."""
    p = make_problem(Shape("t", 8, 16, 8, 4, 2), dtype=torch.bfloat16, device="cpu", seed=3)
    for interp, why in ((True, "triton#11584"), (False, "needs a CUDA GPU")):
        monkeypatch.setattr(baselines, "interpreting", lambda interp=interp: interp)
        with pytest.raises(baselines.Unavailable, match=why):
            baselines._triton_factory(p, {})


def test_calibrate_router_returns_the_weights_it_measured():
    """The deviation calibrate_router returns is that of the weights it returns: after max_iters steps it stops
    without one more update (max_iters=1: the router as given, and its own deviation from the target)."""
    from sonicmoe.bench.load_profile import calibrate_router

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(512, 16, generator=g), torch.randn(8, 16, generator=g)
    target = torch.full((8,), 1 / 8, dtype=torch.float64)
    got_w, dev = calibrate_router(x, w, 2, target, tol=0.0, max_iters=1)
    assert torch.equal(got_w, w)
    ids = (x @ w.t()).topk(2, dim=1).indices
    got = torch.bincount(ids.reshape(-1), minlength=8).double() / ids.numel()
    assert dev == pytest.approx(float(((got - target).abs() / target).max()))
    # measured in float64 against the float64 target, bit for bit (fractions float32 cannot hold: 0.3, 0.2, 0.1, 0.05)
    uneven = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.05], dtype=torch.float64)
    _, dev = calibrate_router(x, w, 2, uneven, tol=0.0, max_iters=1)
    assert dev == float(((got - uneven).abs() / uneven).max())


def test_calibrate_router_with_an_idle_expert():
    """A target of 0 for one expert (a measured profile with an idle expert, which read_load_profile accepts): the
    deviation returned is finite and measured over the other experts, which end within tol of their targets; the
    idle expert's row is 0, and it ends with fewer pairs than at the start and under a quarter of the mean. Before
    session 94 the deviation was inf (relative to 0), so every step ran and the caller got inf back."""
    from sonicmoe.bench.load_profile import calibrate_router

    g = torch.Generator().manual_seed(6)
    e, k, t = 8, 2, 4096
    x, w = torch.randn(t, 16, generator=g), torch.randn(e, 16, generator=g)
    target = torch.tensor([0.0] + [1 / (e - 1)] * (e - 1), dtype=torch.float64)

    def load(weight):
        ids = (x @ weight.t()).topk(k, dim=1).indices
        return torch.bincount(ids.reshape(-1), minlength=e).double() / ids.numel()

    got_w, dev = calibrate_router(x, w, k, target, tol=0.05, max_iters=30)
    got = load(got_w)
    assert math.isfinite(dev) and dev <= 0.05
    assert dev == pytest.approx(float(((got - target).abs() / target)[1:].max()))
    assert got[0] < load(w)[0] and got[0] < 0.25 / e and not got_w[0].any()  # its row scaled to 0
    with pytest.raises(ValueError, match="target: no expert has a fraction > 0"):
        calibrate_router(x, w, k, torch.zeros(e, dtype=torch.float64))


def test_calibrate_router_returns_the_router_weights_dtype():
    """A bf16 router weight comes back bf16 (the problem's router keeps its dtype), the float32 calibration rounded
    once: the same scaled rows as calibrating its float32 copy, and the same deviation."""
    from sonicmoe.bench.load_profile import calibrate_router

    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(1024, 16, generator=g), torch.randn(8, 16, generator=g).bfloat16()
    target = torch.tensor([0.25, 0.2, 0.15, 0.1, 0.1, 0.1, 0.05, 0.05], dtype=torch.float64)
    got_w, dev = calibrate_router(x, w, 2, target, max_iters=6)
    ref_w, ref_dev = calibrate_router(x, w.float(), 2, target, max_iters=6)
    assert got_w.dtype == torch.bfloat16 and not torch.equal(ref_w, w.float())  # scaled, not handed back
    assert torch.equal(got_w, ref_w.bfloat16()) and dev == ref_dev


def test_calibrate_router_reaches_an_expert_that_starts_with_no_pair():
    """An expert the random router gives no pair at all (its row 1000 times smaller) is scaled up from the floor of
    a tenth of a pair (log 0 would make its scale infinite, its row inf/NaN, and it would take every token): every
    expert ends within tol of an even load, with finite weights."""
    from sonicmoe.bench.load_profile import calibrate_router

    g = torch.Generator().manual_seed(8)
    e, k, t = 16, 2, 1024
    x, w = torch.randn(t, 16, generator=g), torch.randn(e, 16, generator=g)
    w[3] *= 1e-3
    target = torch.full((e,), 1 / e, dtype=torch.float64)

    def load(weight):
        ids = (x @ weight.t()).topk(k, dim=1).indices
        return torch.bincount(ids.reshape(-1), minlength=e).double() / ids.numel()

    assert load(w)[3] == 0
    got_w, dev = calibrate_router(x, w, k, target, tol=0.05, max_iters=30)
    assert torch.isfinite(got_w).all() and dev <= 0.05
    assert dev == pytest.approx(float(((load(got_w) - target).abs() / target).max()))


def test_token_rounding_path_and_fallback(tmp_path, monkeypatch):
    """General routing (variable experts per token) through a stand-in token_rounding module, and
    the fallback to top-k with a message when the module is missing."""
    fake = SimpleNamespace()

    def token_rounding(router, m_tile=128, subroutine="nearest"):
        T, K = router.topk_ids.shape
        keep = torch.ones(T, K, dtype=torch.bool)
        keep[1::2, -1] = False  # odd tokens drop their last expert
        tok = torch.arange(T).repeat_interleave(K).view(T, K)
        return SimpleNamespace(pair_token=tok[keep], pair_expert=router.topk_ids[keep],
                               pair_scores=router.topk_scores[keep])

    fake.token_rounding = token_rounding
    monkeypatch.setitem(sys.modules, "sonicmoe.token_rounding", fake)
    rc, doc = _run(tmp_path, "--shape", "64,32,16,4,2", "--routing", "topk,token_rounding",
                   "--backends", "torch,loop,upper", "--no-router-variant")
    assert rc == 0
    topk, tr = doc["results"]
    assert (topk["routing"], tr["routing"]) == ("topk", "token_rounding")
    assert topk["TK"] == 128 and tr["TK"] == 96
    assert tr["flops"]["fwd"] == 6 * 96 * 16 * 32
    assert all(b["status"] == "ok" for b in tr["backends"].values())

    monkeypatch.setitem(sys.modules, "sonicmoe.token_rounding", None)  # import raises ImportError
    rc, doc = _run(tmp_path / "b", "--shape", "64,32,16,4,2", "--routing", "token_rounding",
                   "--backends", "torch", "--no-router-variant")
    assert rc == 0 and [r["routing"] for r in doc["results"]] == ["topk"]


def test_token_rounding_that_routes_no_pair_is_skipped_not_failed(tmp_path, capsys):
    """The tiny shape under token rounding at the default M_tile = 128: T·K/E = 32 mean tokens per expert round to
    no pair. A check on no pair passes any kernel, so the shape is skipped with how to route pairs (a smaller
    --m-tile), not reported as every backend FAILing; a smaller M_tile on the same shape runs and checks."""
    rc, doc = _run(tmp_path, "--shape", "64,32,16,4,2", "--routing", "token_rounding", "--backends", "torch,upper",
                   "--no-router-variant")
    (rec,) = doc["results"]
    assert rec["status"] == "skipped" and rec["backends"] == {} and rec["TK"] == 0
    assert "routed no (token, expert) pair" in rec["message"] and "--m-tile <= 32" in rec["message"]
    captured = capsys.readouterr()
    assert "FAIL" not in captured.out
    assert rc == 1 and "nothing was timed" in captured.err  # the run timed nothing: not a success
    rc, doc = _run(tmp_path / "b", "--shape", "64,32,16,4,2", "--routing", "token_rounding", "--m-tile", "16",
                   "--backends", "torch,upper", "--no-router-variant")
    (rec,) = doc["results"]
    assert rc == 0 and rec["status"] == "ok" and rec["TK"] > 0
    assert rec["backends"]["torch"]["status"] == "ok" and rec["backends"]["torch"]["check"]["pairs"] > 0


# ---------------------------------------------------------------------------------------------------
# plots and markdown from a results file alone


def _synthetic_doc() -> dict:
    recs = []

    def row(ms_f, ms_t, held, peak, status="ok"):
        return {"status": status, "message": None, "kind": "x", "check": None,
                "fwd": {"ms": {"p20": ms_f, "p50": ms_f, "p80": ms_f}, "tflops": 100 / ms_f},
                "total": {"ms": {"p20": ms_t, "p50": ms_t, "p80": ms_t}, "tflops": 300 / ms_t},
                "bwd": {"ms": {"p50": ms_t - ms_f}, "tflops": 200 / (ms_t - ms_f)},
                "router": None, "memory": {"held_bytes": held, "peak_bytes": peak}, "info": {}}

    def rec(name, group, T, d, n, E, K, routing="topk"):
        r = {"name": name, "group": group, "T": T, "d": d, "n": n, "E": E, "K": K, "G": d / n,
             "rho": K / E, "routing": routing, "TK": T * K, "flops": useful_flops(T * K, n, d),
             "spec_held_bytes": spec_held_bytes(T, d, T * K, n), "status": "ok", "message": None,
             "backends": {"triton": row(1.0, 3.0, 2 << 30, 5 << 30), "torch": row(1.5, 5.0, 6 << 30, 9 << 30),
                          "upper": row(0.9, 2.8, 1 << 30, 4 << 30), "loop": row(1, 2, 1, 1, status="skipped")},
             "ratio_base": "triton",
             "ratios": {"torch": {"fwd": 1.5, "bwd": 1.75, "total": 5 / 3}, "upper": {"fwd": 0.9, "total": 0.93}}}
        recs.append(r)

    for g, T, d in (("7B", 24576, 1536), ("30B", 32768, 4096)):
        for n, E, K in ((256, 128, 8), (512, 64, 4), (1024, 32, 2)):
            rec(f"{g}-n{n}", g, T, d, n, E, K)
    for E in (64, 128):
        for mode in ("topk", "token_rounding"):
            rec(f"tr-E{E}", "tr", 16384, 1536, 256, E, 8, routing=mode)
    recs.append({"name": "broken", "group": "custom", "T": 1, "d": 8, "n": 8, "E": 2, "K": 1, "G": 1.0,
                 "routing": "topk", "status": "oom", "message": "making the problem: OOM", "backends": {}})
    env = {"device": "NVIDIA H100 80GB HBM3", "device_type": "cuda", "driver": "580.1", "torch": "2.11",
           "triton": "3.6.0", "git_commit": "abc123", "python": "3.12"}
    return report.build_results(recs, env, ["--preset", "granularity"], {}, __import__("datetime").datetime(
        2026, 1, 2, tzinfo=__import__("datetime").timezone.utc))


def test_plot_from_results_file(tmp_path):
    pytest.importorskip("matplotlib")
    path = report.write_results(_synthetic_doc(), tmp_path / "2026-01-02_nvidia-h100.json")
    assert cli.main(["--plot-from", str(path)]) == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == [f"2026-01-02_nvidia-h100_{k}.png" for k in
                    ("granularity_memory", "granularity_tflops", "speedup", "token_rounding")]
    assert all((tmp_path / p).stat().st_size > 1000 for p in pngs)
    other = tmp_path / "plots"
    assert cli.main(["--plot-from", str(path), "--out", str(other)]) == 0
    assert len(list(other.glob("*.png"))) == 4


@pytest.fixture
def saved_figures(monkeypatch) -> list:
    """The figures the plots save, in order, kept open for the test to read back (Figure.savefig writes nothing);
    skips without matplotlib."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    figs = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: figs.append(fig))
    return figs


def test_plot_title_speedup_bars_and_memory_in_gib(saved_figures):
    """The plots' title names the run (and the activation unless SwiGLU alone); the speed-up chart centres each
    record's bars on its tick (two competitors: idx ± width/2); the memory chart plots bytes in GiB."""
    from sonicmoe.bench.plots import GiB, _plot_memory, _plot_speedup, _setup, _title

    env = {"device": "H100", "torch": "2.11", "triton": "3.6", "git_commit": "0123456789abcdef"}
    doc = {"env": env, "date": "2026-01-02T03:04:05", "results": [{"activation": "swiglu"}, {}]}
    assert _title(doc) == "H100 | torch 2.11 | triton 3.6 | 0123456789 | 2026-01-02"
    clamped = dict(doc, results=[{}, {"activation": "clamped_swiglu"}])
    assert _title(clamped).endswith("| 2026-01-02 | activation swiglu, clamped_swiglu")
    figs = saved_figures
    plt = _setup()
    recs = [{"name": f"s{i}", "ratio_base": "triton", "ratios": {"torch": {"fwd": 1.5 + i, "total": 2.0},
                                                                  "upper": {"fwd": 0.5 + i, "total": 0.9}}}
            for i in range(2)]
    assert _plot_speedup(plt, doc, recs, "s.png") == "s.png"
    bars = sorted((r.get_x() + r.get_width() / 2, r.get_height()) for r in figs[-1].axes[0].patches)
    assert [round(x, 9) for x, _ in bars] == [-0.2, 0.2, 0.8, 1.2]
    assert [h for _, h in bars] == [1.5, 0.5, 2.5, 1.5]
    ok = {"status": "ok"}
    mem = [{"G": g, "n": 64 // g, "backends": {"triton": dict(ok, memory={"held_bytes": g * GiB // 2,
                                                                           "peak_bytes": 3 * g * GiB})}}
           for g in (1, 2)]
    assert _plot_memory(plt, doc, {"g": mem}, ["triton"], "m.png") == "m.png"
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in figs[-1].axes[0].lines}
    assert lines == {"triton held": [0.5, 1.0], "triton peak": [3.0, 6.0]}


def test_plot_train_line_is_the_moving_mean(saved_figures, tmp_path):
    """plot_runs' smoothed train loss at step j: the mean of the last ``window`` losses (fewer at the start), window
    = steps // 50."""
    from sonicmoe.train.report import plot_runs

    figs = saved_figures
    g = torch.Generator().manual_seed(3)
    ys = (torch.rand(200, generator=g, dtype=torch.float64) * 4).tolist()
    assert plot_runs(tmp_path / "l.png", [("", [{"step": i, "loss": y} for i, y in enumerate(ys)], [])], "t")
    line = next(ln for ln in figs[0].axes[0].lines if ln.get_label() == "train (4-step mean)")
    want = [sum(ys[max(0, j - 3):j + 1]) / min(j + 1, 4) for j in range(200)]
    assert list(line.get_ydata()) == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_plot_runs_one_run_per_step_blue_and_validation_red(saved_figures, tmp_path):
    """plot_runs with one unlabelled run (train's loss.png): the per-step losses and their moving mean in blue, the
    validation losses in red, the labels without a run prefix."""
    from sonicmoe.train.report import plot_runs

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    ys = (torch.rand(6, generator=g, dtype=torch.float64) * 4 + 1).tolist()
    vals = (torch.rand(2, generator=g, dtype=torch.float64) * 4 + 1).tolist()
    steps = [{"step": s, "loss": y} for s, y in enumerate(ys, 1)]
    assert plot_runs(tmp_path / "one.png", [("", steps, [{"step": 0, "val_loss": vals[0]},
                                                           {"step": 6, "val_loss": vals[1]}])], "t")
    lines = {ln.get_label(): ln for ln in saved_figures[0].axes[0].lines}
    assert sorted(lines) == ["train (1-step mean)", "train (per step)", "validation"]
    assert [lines[k].get_color() for k in sorted(lines)] == ["tab:blue", "tab:blue", "tab:red"]
    assert list(lines["train (per step)"].get_ydata()) == ys and list(lines["validation"].get_ydata()) == vals


def test_plot_runs_colours_validation_and_closes_its_figure(saved_figures, tmp_path):
    """plot_runs with two runs: each run's train line and validation line in colours of their own (C0/C1, C2/C3: no
    run's train line takes another's validation colour), no per-step lines by default, the validation line the
    val_loss values in nats (the axis' unit; not the bits per byte beside them); the figure is closed once saved (a
    loop of plots leaked one figure each)."""
    import matplotlib.pyplot as plt

    from sonicmoe.train.report import plot_runs

    figs = saved_figures
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    vals = (torch.rand(2, 3, generator=g, dtype=torch.float64) * 4 + 1).tolist()
    runs = [(label, [{"step": s, "loss": 5.0 - s / 10} for s in range(1, 11)],
             [{"step": s, "val_loss": v, "val_bpb": v / math.log(2)} for s, v in zip((0, 5, 10), vs)])
            for label, vs in zip(("a", "b"), vals)]
    before = plt.get_fignums()
    assert plot_runs(tmp_path / "two.png", runs, "t")
    assert plt.get_fignums() == before
    lines = {ln.get_label(): ln for ln in figs[0].axes[0].lines}
    assert sorted(lines) == ["a train (1-step mean)", "a validation", "b train (1-step mean)", "b validation"]
    assert [lines[k].get_color() for k in sorted(lines)] == ["C0", "C1", "C2", "C3"]
    for label, vs in zip(("a", "b"), vals):
        assert list(lines[f"{label} validation"].get_ydata()) == vs


def test_granularity_groups_keep_sweeps_only():
    """Groups at one (T, d) with two or more G are plotted against G; a group of unrelated shapes (the models
    preset: d differs) is not, and neither is a group with one G (the token-rounding sweep varies E only)."""
    from sonicmoe.bench.plots import granularity_groups

    recs = _synthetic_doc()["results"]
    models = [dict(r, group="models", name=f"m{i}") for i, r in enumerate(recs[:6:2])]  # 7B and 30B rows: d differs
    groups = granularity_groups(recs + models)
    assert sorted(groups) == ["30B", "7B"]
    assert [r["G"] for r in groups["7B"]] == sorted(r["G"] for r in groups["7B"])
    # a sweep run under token rounding too: those records stay out of the top-k lines (one point per G and backend)
    both = granularity_groups(recs + [dict(r, routing="token_rounding") for r in groups["7B"]])
    assert [(r["G"], r["routing"]) for r in both["7B"]] == [(r["G"], "topk") for r in groups["7B"]]


def test_plots_draw_the_recorded_numbers(saved_figures):
    """Each chart draws the numbers its records hold, read back from the figures: TFLOP/s of forward and of
    forward+backward per G (ok rows only: a skipped row's numbers are not drawn), SPEC §3's line in GiB, the speed-up
    bars of both phases (three competitors: bars 0.8/3 wide, centred on the tick; token-rounding ticks marked), and
    our median times against E, sorted by E, for groups that hold both routings only."""
    from sonicmoe.bench import plots

    figs = saved_figures
    plt = plots._setup()
    doc = {"env": {}, "date": "2026-01-02"}

    def row(fwd, total, status="ok"):  # numbers of one backend: TFLOP/s and milliseconds (p20 = p50 / 2)
        return {"status": status, "fwd": {"tflops": fwd, "ms": {"p20": fwd / 2, "p50": fwd}},
                "total": {"tflops": total, "ms": {"p20": total / 2, "p50": total}},
                "bwd": {"tflops": 1000.0 + fwd}, "memory": {"held_bytes": 3 * GiB, "peak_bytes": 5 * GiB}}

    GiB = plots.GiB
    recs = [{"group": "g", "routing": "topk", "T": 64, "d": 32, "n": 32 // G, "G": G, "TK": 128, "dtype": "bfloat16",
             "backends": {"triton": row(10.0 * G, 3.0 * G), "loop": row(7.0, 7.0, status="skipped")}}
            for G in (4, 1, 2)]
    groups = plots.granularity_groups(recs)
    names = plots._backend_names(recs)
    assert plots._plot_granularity(plt, doc, groups, names, "g.png") == "g.png"
    panels = [{ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.lines}
              for ax in figs[-1].axes]
    assert panels == [{"triton": ([1, 2, 4], [10.0, 20.0, 40.0])}, {"triton": ([1, 2, 4], [3.0, 6.0, 12.0])}]
    assert plots._plot_memory(plt, doc, groups, names, "m.png") == "m.png"
    spec = [ln for ln in figs[-1].axes[0].lines if ln.get_label().startswith("4TKn")]
    assert len(spec) == 1 and list(spec[0].get_ydata()) == [2 * 2 * 128 * n / GiB for n in (32, 16, 8)]

    ratios = [{"torch": {"fwd": 1.5, "total": 2.5}, "upper": {"fwd": 0.5, "total": 0.75},
               "loop": {"fwd": 4.0, "total": 3.0}},
              {"torch": {"fwd": 1.25, "total": 2.0}, "upper": {"fwd": 0.25, "total": 0.5},
               "loop": {"fwd": 5.0, "total": 6.0}}]
    speed = [{"name": f"s{i}", "routing": mode, "ratio_base": "triton", "ratios": ratios[i]}
             for i, mode in enumerate(("topk", "token_rounding"))]
    assert plots._plot_speedup(plt, doc, speed, "s.png") == "s.png"
    axes = figs[-1].axes
    assert [ax.get_ylabel() for ax in axes] == ["triton speed-up (fwd)", "triton speed-up (fwd+bwd)"]
    assert [t.get_text() for t in axes[0].get_xticklabels()] == ["s0", "s1\n[token_rounding]"]
    w = 0.8 / 3
    for ax, phase in zip(axes, ("fwd", "total")):
        bars = sorted((round(b.get_x() + b.get_width() / 2, 9), b.get_width(), b.get_height()) for b in ax.patches)
        want = sorted((round(i + (k - 1) * w, 9), w, ratios[i][n][phase])
                      for i in range(2) for k, n in enumerate(("torch", "upper", "loop")))
        assert bars == pytest.approx(want, abs=1e-12), phase

    tr = [{"group": "tr", "routing": mode, "T": 512, "E": E, "backends": {"triton": row(E / 8 + j, E / 4 + j),
                                                                         "torch": row(99.0, 99.0)}}
          for E in (128, 64) for j, mode in enumerate(("topk", "token_rounding"))]
    tr.append({"group": "topk_only", "routing": "topk", "T": 512, "E": 8, "backends": {"triton": row(1.0, 2.0)}})
    assert plots._plot_token_rounding(plt, doc, tr, "t.png") == "t.png"
    assert len(figs[-1].axes) == 1 and figs[-1].axes[0].get_title() == "tr"
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in figs[-1].axes[0].lines}
    assert lines == {"topk fwd": ([64, 128], [8.0, 16.0]), "topk total": ([64, 128], [16.0, 32.0]),
                     "token_rounding fwd": ([64, 128], [9.0, 17.0]), "token_rounding total": ([64, 128], [17.0, 33.0])}


def test_markdown_from_results_file(tmp_path, capsys, monkeypatch):
    path = report.write_results(_synthetic_doc(), tmp_path / "r.json")
    assert cli.main(["--markdown-from", str(path)]) == 0
    md = capsys.readouterr().out
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert lines[0].startswith("| shape") and set(lines[1]) <= {"|", "-"}
    assert len(lines) == 2 + 11
    assert "| 7B-n256 (24576, 1536, 256, 128, 8) | topk | 1 | 100 | 3 | 100 | 1.50× / 1.67× | 0.90 / 0.93 |" in md
    assert "2.00 / 5.00" in md and "oom" in md
    assert "NVIDIA H100 80GB HBM3" in md and "2026-01-02" in md
    monkeypatch.setattr(sys, "argv", ["readme_table.py", str(path)])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(REPO / "scripts" / "readme_table.py"), run_name="__main__")
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == md.strip()


def test_results_file_name_and_strict_json(tmp_path):
    import datetime as dt

    now = dt.datetime(2026, 3, 4, 5, 6, 7, tzinfo=dt.timezone.utc)
    env = {"device_type": "cuda", "device": "NVIDIA H200"}
    p = report.results_path(tmp_path, env, "my tag", now)
    assert p.name == "2026-03-04_nvidia-h200_my-tag.json"
    report.write_results({"results": [], "x": float("nan"), "y": (1, float("inf"))}, p)
    assert _strict_load(p) == {"results": [], "x": None, "y": [1, None]}
    nested = report.write_results({"results": []}, tmp_path / "new" / "dir" / "r.json")  # --out made as needed
    assert _strict_load(nested) == {"results": []}
    assert report.results_path(tmp_path, env, "my tag", now).name == "2026-03-04-050607_nvidia-h200_my-tag.json"
    assert report.results_path(tmp_path, {"device_type": "cpu", "device": "x86"}, None, now).name == \
        "2026-03-04_cpu.json"
    # slugs: no dash at either end, and a name of no letter or digit is "unknown"
    assert report.slug(" (NVIDIA H100)  80GB! ") == "nvidia-h100-80gb"
    assert report.results_path(tmp_path, {"device_type": "cuda", "device": "???"}, "-x-", now).name == \
        "2026-03-04_unknown_x.json"


def test_sanitize_names_dtypes_and_makes_keys_strings(tmp_path):
    """sanitize: a torch dtype is its bare name ("bfloat16", what the records' dtype field holds), a device its
    string, and every key a string, so that json.dump takes keys such as a dtype or a tuple."""
    doc = {"results": [], "dt": torch.bfloat16, "dev": torch.device("cpu"),
           "by": {torch.float16: (1.5, float("nan")), (2, 3): [torch.float32], 7: None}}
    want = {"results": [], "dt": "bfloat16", "dev": "cpu",
            "by": {"torch.float16": [1.5, None], "(2, 3)": ["float32"], "7": None}}
    assert report.sanitize(doc) == want
    assert _strict_load(report.write_results(doc, tmp_path / "r.json")) == want


def test_list_and_help(capsys):
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3" in out and "upper" in out and "scattermoe" in out
    assert cli.main(["--help"]) == 0


def test_cpu_timing_reports_median_and_deciles(monkeypatch):
    """Without CUDA the per-call wall times give p50 = their median and p20 / p80 = their 2nd and 8th deciles (the
    times stubbed, so the figures are known): 1..10 ms -> 2.8, 5.5, 8.2."""
    from sonicmoe.bench import measure

    times = [7.0, 1.0, 10.0, 4.0, 2.0, 9.0, 3.0, 8.0, 5.0, 6.0]
    monkeypatch.setattr(measure, "_wall_ms", lambda fn, warmup, rep, device: times)
    got = measure.bench_ms(lambda: None, device=torch.device("cpu"))
    assert got == pytest.approx({"p20": 2.8, "p50": 5.5, "p80": 8.2})
    monkeypatch.setattr(measure, "_wall_ms", lambda fn, warmup, rep, device: [4.0])
    assert measure.bench_ms(lambda: None, device=torch.device("cpu")) == {"p20": 4.0, "p50": 4.0, "p80": 4.0}
    # two times are interpolated too (1.4 = 1 + 0.2 · 2), not reported as the first three times
    monkeypatch.setattr(measure, "_wall_ms", lambda fn, warmup, rep, device: [3.0, 1.0])
    got = measure.bench_ms(lambda: None, device=torch.device("cpu"))
    assert got == pytest.approx({"p20": 1.4, "p50": 2.0, "p80": 2.6})


def test_timing_warms_up_until_the_clock_settles(tmp_path, monkeypatch):
    """On a GPU every measurement warms up for SETTLED_WARMUP_MS (the power cap needs ~100 ms to lower the clock;
    25 ms read the state left by what ran before) and times a SETTLED_REP_MS window, and a run without --warmup or
    --rep records those values."""
    import triton.testing

    from sonicmoe.bench.measure import SETTLED_REP_MS, SETTLED_WARMUP_MS, bench_ms

    seen = {}

    def fake_do_bench(fn, **kwargs):
        seen.update(kwargs)
        return [1.0, 2.0, 3.0]

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    leaves = [torch.zeros(2, requires_grad=True)]
    got = bench_ms(lambda: None, device=torch.device("cuda"), grad_to_none=leaves)
    assert got == {"p20": 1.0, "p50": 2.0, "p80": 3.0}
    assert seen["grad_to_none"] is leaves and seen["quantiles"] == [0.2, 0.5, 0.8]
    assert seen["return_mode"] == "median"
    assert seen["warmup"] == SETTLED_WARMUP_MS >= 500
    assert seen["rep"] == SETTLED_REP_MS >= 500  # a 100 ms window reads one phase of the limiter's clock
    # the CLI without --warmup: RunOptions' default, recorded in the results file (patched to 50 ms here, a
    # short CPU loop)
    from sonicmoe.bench import runner

    monkeypatch.setattr(runner.RunOptions, "warmup", 50.0)
    monkeypatch.setattr(runner.RunOptions, "rep", 0.0)
    out = tmp_path / "res"
    rc = cli.main(["--out", str(out), "--no-plot", "-q", "--device", "cpu", "--preset", "tiny",
                   "--backends", "torch", "--mode", "fwd", "--no-router-variant"])
    assert rc == 0
    args = _strict_load(_only_json(out))["args"]
    assert args["warmup"] == 50.0 and args["rep"] == 0.0


# ---------------------------------------------------------------------------------------------------
# the GPU's clock, power and temperature beside each timing (sonicmoe.bench.gpu_state)


class _FakeNvml:
    """NVML's readings as a board at 700 W would give them: energy rises 700 mJ per host millisecond, the clock and
    the power-cap reason alternate between samples, the temperature climbs."""

    def __init__(self):
        self.calls = 0

    def sm_mhz(self):
        self.calls += 1
        return 1500 if self.calls % 2 else 1700

    def energy_mj(self):
        import time

        return int(time.perf_counter() * 700_000.0)  # mJ

    def temperature_c(self):
        return 40 + self.calls

    def clock_reasons(self):
        return 0x4 if self.calls % 2 else 0x0


def test_gpu_watch_summarises_its_window():
    import time

    from sonicmoe.bench.gpu_state import GpuWatch, open_nvml

    assert open_nvml(torch.device("cpu")) is None
    fake = _FakeNvml()
    with GpuWatch(nvml=fake, period=0.002) as watch:
        time.sleep(0.2)
    n = len(watch.samples)
    assert n >= 10
    time.sleep(0.01)
    assert len(watch.samples) == n  # the thread stopped with the block
    g = watch.last(1.0)
    clocks = [s[1] for s in watch.samples]
    assert g["samples"] == n and g["sm_mhz"] == pytest.approx(sum(clocks) / n, abs=0.05)
    assert 1500 < g["sm_mhz"] < 1700
    assert g["watts"] == pytest.approx(700.0, rel=0.05)
    assert g["temp_c"] == max(s[3] for s in watch.samples) and g["clock_reasons"] == "0x4"
    # a window that holds under two samples says nothing
    assert watch.between(watch.samples[-1][0] + 1.0, watch.samples[-1][0] + 2.0) is None
    # without NVML nothing is sampled and nothing is claimed
    with GpuWatch(torch.device("cpu")) as none:
        time.sleep(0.01)
    assert none.samples == [] and none.last(1.0) is None


def test_bench_records_the_gpu_state_of_each_timing(tmp_path, monkeypatch, capsys):
    """Each timed phase carries the clock, power and temperature over its window where NVML answers (a fake one
    here), and null where it does not; the log line names the clock."""
    from sonicmoe.bench import runner

    monkeypatch.setattr(runner, "open_nvml", lambda device: _FakeNvml())
    out = tmp_path / "res"
    rc = cli.main(["--out", str(out), "--warmup", "50", "--rep", "200", "--no-plot", "--device", "cpu",
                   "--preset", "tiny", "--backends", "torch", "--no-router-variant", "--no-check"])
    assert rc == 0
    row = _strict_load(_only_json(out))["results"][0]["backends"]["torch"]
    for phase in ("fwd", "total"):
        g = row[phase]["gpu"]
        assert 1500 < g["sm_mhz"] < 1700 and g["samples"] >= 2 and g["clock_reasons"] == "0x4"
    assert " MHz, " in capsys.readouterr().out
    monkeypatch.setattr(runner, "open_nvml", lambda device: None)
    out2 = tmp_path / "res2"
    assert cli.main(["--out", str(out2), *FAST, "--preset", "tiny", "--backends", "torch", "--no-router-variant",
                     "--no-check"]) == 0
    row = _strict_load(_only_json(out2))["results"][0]["backends"]["torch"]
    assert row["fwd"]["gpu"] is None and row["total"]["gpu"] is None


def test_gpu_watch_window_arithmetic():
    """between() on known samples: the mean clock, the power from the energy counter (mJ over host seconds: W), the
    highest temperature, the OR of every sample's clock-event reasons; None from one sample; stop() drops a sample
    the thread took after it."""
    import time

    from sonicmoe.bench.gpu_state import GpuWatch

    watch = GpuWatch(nvml=_FakeNvml())
    watch.samples = [(0.0, 1500, 0, 40, 0x4), (0.5, 1700, 350_000, 45, 0x1), (1.0, 1600, 700_000, 42, 0x0)]
    assert watch.between(0.0, 1.0) == {"sm_mhz": 1600.0, "watts": 700.0, "temp_c": 45, "clock_reasons": "0x5",
                                       "samples": 3}
    assert watch.between(0.4, 0.6) is None  # one sample

    class _LateThread:  # the sampling thread's last sample lands after stop()'s time
        def join(self):
            watch.samples.append((time.perf_counter() + 60.0, 1500, 0, 40, 0))

    watch._thread = _LateThread()
    watch.stop()
    assert len(watch.samples) == 3

    class _ThreadAtStop:  # a sample at stop()'s very time lies in the block (the windows are closed)
        def join(self):
            watch.samples.append((watch.stopped_at, 1500, 0, 40, 0))

    watch._thread = _ThreadAtStop()
    watch.stop()
    assert len(watch.samples) == 4 and watch.samples[-1][0] == watch.stopped_at
    # the clock and the power to 0.1: 1533.3 MHz, 466.7 W
    watch.samples = [(0.0, 1500, 0, 40, 0), (0.75, 1500, 150_000, 40, 0), (1.5, 1600, 700_000, 40, 0)]
    got = watch.between(0.0, 1.5)
    assert (got["sm_mhz"], got["watts"]) == (1533.3, 466.7)


def test_gpu_watch_edge_windows_and_no_thread_without_nvml():
    """between() over two samples at one host time claims no power (no division by a zero span); last() ends at
    stop()'s time, however long ago; without NVML start() starts no sampling thread."""
    from sonicmoe.bench.gpu_state import GpuWatch

    watch = GpuWatch(nvml=_FakeNvml())
    watch.samples = [(2.0, 1500, 1000, 40, 0), (2.0, 1700, 1000, 41, 0)]
    assert watch.between(1.0, 3.0) == {"sm_mhz": 1600.0, "watts": None, "temp_c": 41, "clock_reasons": "0x0",
                                       "samples": 2}
    watch.samples = [(0.0, 1500, 0, 40, 0), (0.5, 1700, 350_000, 45, 0), (1.0, 1600, 700_000, 42, 0)]
    watch.stopped_at = 1.0
    assert watch.last(1.0)["samples"] == 3 and watch.last(0.6)["samples"] == 2
    none = GpuWatch(torch.device("cpu")).start()
    assert none.nvml is None and none._thread is None
    none.stop()


def test_gpu_watch_last_ends_at_stop_and_samples_on_a_daemon_thread():
    """last() is the window that ends at stop()'s time: a sample taken later (a watch started again) lies outside
    it, however long the window; the sampling thread is a daemon (an NVML read that hangs never keeps the process
    from exiting); a watch started again after stop() samples until the next stop (before the lp20_ mutation audit
    its stop event stayed set, so the new thread took one sample and ended)."""
    import time

    from sonicmoe.bench.gpu_state import GpuWatch

    watch = GpuWatch(nvml=_FakeNvml())
    watch.samples = [(0.0, 1500, 0, 40, 0), (0.5, 1700, 350_000, 45, 0), (1.0, 1600, 700_000, 42, 0),
                     (1.5, 1900, 1_400_000, 60, 0x4)]
    watch.stopped_at = 1.0
    assert watch.last(0.6) == {"sm_mhz": 1650.0, "watts": 700.0, "temp_c": 45, "clock_reasons": "0x0", "samples": 2}
    assert watch.last(2.0)["samples"] == 3
    with GpuWatch(nvml=_FakeNvml(), period=0.001) as live:
        time.sleep(0.005)
        assert live._thread.is_alive() and live._thread.daemon
    assert live._thread is None
    # started again after stop(): it samples on until the next stop (the stop event cleared), not once
    first = len(live.samples)
    live.start()
    assert live.stopped_at is None
    deadline = time.monotonic() + 5.0  # polled, not a fixed sleep: a loaded machine may schedule the thread late
    while len(live.samples) - first < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    live.stop()
    assert len(live.samples) - first >= 3 and live.samples[-1][0] <= live.stopped_at


def test_timing_loops_count_calls():
    """_wall_ms: at least one warm-up call and at least 5 timed calls, however short the windows, at most 1000 however
    long; host_ms: ms per call, not for all of them, after three warm calls."""
    import time

    from sonicmoe.bench import measure

    calls = []
    times = measure._wall_ms(lambda: calls.append(1), 0.0, 0.0, torch.device("cpu"))
    assert len(times) == 5 and len(calls) == 6
    assert 3.5 < measure.host_ms(lambda: time.sleep(0.004), calls=5) < 15.0
    assert len(measure._wall_ms(lambda: None, 0.0, 1e9, torch.device("cpu"))) == 1000
    calls.clear()
    measure.host_ms(lambda: calls.append(1), calls=7)
    assert len(calls) == 3 + 7


def test_worst_expert_error_is_over_the_rms_expert():
    """One expert of 16 all wrong: the norm-wise error is 1/4 (sqrt(1/16)), the worst-expert error 1 (its error over
    the RMS expert's norm, not over all experts' norm, which would shrink it by sqrt(E)); the pieces added in two
    calls, as the reference adds its chunks of experts."""
    from sonicmoe.bench.measure import _NormAcc

    acc = _NormAcc()
    ref = torch.ones(16, 4, 4)
    got = ref.clone()
    got[3] = 0
    acc.add(got[:8], ref[:8])
    acc.add(got[8:], ref[8:])
    assert acc.value() == pytest.approx(0.25) and acc.local() == pytest.approx(1.0)
    # one row of expert 3 wrong: the worst expert's error is that row's norm (2) over the RMS expert norm (4), 0.5, not
    # over the RMS norm of a row (2), 1: the worst is taken per expert, not per row
    acc = _NormAcc()
    got = ref.clone()
    got[3, 1] = 0
    acc.add(got[:8], ref[:8])
    acc.add(got[8:], ref[8:])
    assert acc.value() == pytest.approx(1 / 8) and acc.local() == pytest.approx(0.5)


def test_norm_error_of_a_non_finite_piece_is_nan():
    """A NaN in one expert's gradient makes both the norm-wise and the worst-expert error NaN (a failed check), not
    the worst expert among the finite ones (max() skips a NaN)."""
    from sonicmoe.bench.measure import _NormAcc

    acc = _NormAcc()
    acc.add(torch.ones(2, 3), torch.ones(2, 3))
    acc.add(torch.tensor([[float("nan"), 1.0, 1.0]]), torch.ones(1, 3))
    assert math.isnan(acc.value()) and math.isnan(acc.local())


def test_check_on_no_routed_pair_fails():
    """A check whose reference computed no pair on T > 0 tokens (token rounding's counts all rounded to 0) passes any
    kernel, so it is not a pass."""
    from sonicmoe.bench.measure import check_case

    with pytest.warns(UserWarning, match="mean tokens per expert"):
        p = make_problem(Shape("none", 64, 32, 16, 4, 2), dtype=torch.float32, device="cpu", mode="token_rounding")
    res = check_case(REGISTRY["torch"].factory(p, {}), p.dout, grads=False, tol=5e-2, poison=False)
    assert res["pairs"] == 0 and not res["passed"]


def test_footprint_of_a_forward_holds_no_gradients():
    """footprint_bytes: weights, x / dO / dx and the torch baseline's per-pair activations, the weights' and
    activations' gradients on top only for a backward."""
    from sonicmoe.bench.runner import footprint_bytes

    shape = Shape("f", 16, 8, 4, 2, 1)
    weights, acts, io = 2 * 3 * 4 * 8 * 2, 16 * (2 * 8 + 3 * 4) * 2, 3 * 16 * 8 * 2
    assert footprint_bytes(shape, 2, False) == weights + io + acts
    assert footprint_bytes(shape, 2, True) == 2 * weights + io + 2 * acts
    # K = 2: every token's activations twice (gathered X, H, A, Y per pair), the weights and x / dO / dx once
    assert footprint_bytes(Shape("f2", 16, 8, 4, 2, 2), 2, False) == weights + io + 2 * acts


def test_plots_are_titled_and_styled(saved_figures):
    """Every chart carries the run's title (_title: device, versions, commit, date); the memory chart draws each
    backend's held memory solid and its peak dashed, both in the backend's own colour (another backend: another
    colour), SPEC's line dotted; the granularity ticks name G and n; the speed-up chart marks parity (y = 1) on each
    phase's panel; the token-rounding chart draws top-k solid and token rounding dashed."""
    from sonicmoe.bench import plots

    figs = saved_figures
    plt = plots._setup()
    env = {"device": "H100", "torch": "2.11", "triton": "3.6", "git_commit": "0123456789abcdef"}
    doc = {"env": env, "date": "2026-01-02T03:04:05", "results": []}
    title = plots._title(doc)
    assert title == "H100 | torch 2.11 | triton 3.6 | 0123456789 | 2026-01-02"
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    vals = iter((torch.rand(64, generator=g, dtype=torch.float64) + 0.5).tolist())
    GiB = plots.GiB

    def row():
        return {"status": "ok", "fwd": {"tflops": next(vals), "ms": {"p50": next(vals)}},
                "total": {"tflops": next(vals), "ms": {"p50": next(vals)}},
                "memory": {"held_bytes": int(next(vals) * GiB), "peak_bytes": int(next(vals) * 4 * GiB)}}

    recs = [{"group": "g", "routing": "topk", "T": 64, "d": 64, "n": 64 // G, "G": float(G), "TK": 128,
             "dtype": "bfloat16", "backends": {"triton": row(), "torch": row()}} for G in (1, 4)]
    groups = plots.granularity_groups(recs)
    names = plots._backend_names(recs)
    assert plots._plot_granularity(plt, doc, groups, names, "g.png") == "g.png"
    for ax in figs[-1].axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1\n(n=64)", "4\n(n=16)"]
    assert plots._plot_memory(plt, doc, groups, names, "m.png") == "m.png"
    lines = {ln.get_label(): ln for ln in figs[-1].axes[0].lines}
    assert {k: ln.get_linestyle() for k, ln in lines.items()} == {
        "triton held": "-", "triton peak": "--", "torch held": "-", "torch peak": "--",
        "4TKn (SPEC §3 less the input X)": ":"}
    assert lines["triton held"].get_color() == lines["triton peak"].get_color()
    assert lines["torch held"].get_color() == lines["torch peak"].get_color() != lines["triton held"].get_color()
    speed = [{"name": f"s{i}", "ratio_base": "triton",
              "ratios": {"torch": {"fwd": next(vals), "total": next(vals)}}} for i in range(2)]
    assert plots._plot_speedup(plt, doc, speed, "s.png") == "s.png"
    for ax in figs[-1].axes:
        assert [list(ln.get_ydata()) for ln in ax.lines] == [[1.0, 1.0]]
    tr = [{"group": "tr", "routing": mode, "T": 512, "E": E, "backends": {"triton": row()}}
          for E in (64, 128) for mode in ("topk", "token_rounding")]
    assert plots._plot_token_rounding(plt, doc, tr, "t.png") == "t.png"
    styles = {ln.get_label(): ln.get_linestyle() for ln in figs[-1].axes[0].lines}
    assert styles == {"topk fwd": "-", "topk total": "-", "token_rounding fwd": "--", "token_rounding total": "--"}
    assert len(figs) == 4 and [f.get_suptitle() for f in figs] == [title] * 4


def test_plotted_values_skip_non_finite_ones():
    from sonicmoe.bench.plots import _val

    assert _val({"r": {"fwd": 2.0}}, "r", "fwd") == 2.0
    assert _val({"r": {"fwd": float("nan")}}, "r", "fwd") is None
    assert _val({"r": {"fwd": float("inf")}}, "r", "fwd") is None and _val({"r": 1.0}, "r", "fwd") is None


@pytest.mark.gpu
def test_gpu_watch_reads_the_board():
    from sonicmoe.bench.gpu_state import GpuWatch, open_nvml

    nvml = open_nvml(torch.device("cuda"))
    assert nvml is not None, "NVML (libnvidia-ml.so.1) did not open on a CUDA machine"
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    with GpuWatch(nvml=nvml, period=0.01) as watch:
        for _ in range(200):
            a @ a
        torch.cuda.synchronize()
    g = watch.last(10.0)
    assert g is not None and 200 < g["sm_mhz"] < 3000 and 10 < g["temp_c"] < 110
    assert g["watts"] is None or g["watts"] >= 0


def test_target_summary_reads_the_protocol_files(tmp_path, monkeypatch, capsys):
    """scripts/target_summary.py: the median over runs judged against issue #4's targets, the timing window, and
    each run's clock where the results file has it."""
    def results(tflops, ratio, gpu):
        row = {"T": 24576, "d": 1536, "n": 256, "E": 128, "K": 8,
               "backends": {"triton": {"status": "ok", "total": {"ms": {"p50": 1391.569 / tflops}, "tflops": tflops,
                                                                 "gpu": gpu}}},
               "ratios": {"torch": {"total": ratio}}}
        return {"env": {"device": "NVIDIA H200"}, "args": {"rep": 1000.0}, "results": [row]}

    files = []
    for i, (tf, ratio) in enumerate([(441.0, 3.1), (438.0, 2.9), (445.0, 3.2)]):
        path = tmp_path / f"r{i}.json"
        gpu = {"sm_mhz": 1500.0 + i, "temp_c": 50 + i} if i else None
        path.write_text(json.dumps(results(tf, ratio, gpu)))
        files.append(str(path))
    monkeypatch.setattr(sys, "argv", ["target_summary.py", *files])
    runpy.run_path(str(REPO / "scripts" / "target_summary.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "timing window (ms): 1000.0" in out
    assert "median 441.0 | target 440: met" in out and "median 3.10x | target 3x: met" in out
    assert "['?', '1501/51', '1502/52']" in out


def test_target_summary_keeps_routings_apart_and_skips_fwd_only_rows(tmp_path, monkeypatch, capsys):
    """One shape's top-k and token-rounding records (and another activation's) are separate medians, judged against
    the target only for top-k SwiGLU; a --mode fwd row (no fwd+bwd) is left out, not a TypeError."""
    def row(tflops, routing=None, activation=None, total=True):
        r = {"T": 24576, "d": 1536, "n": 256, "E": 128, "K": 8,
             "backends": {"triton": {"status": "ok", "total": {"ms": {"p50": 1.0}, "tflops": tflops}
                                     if total else None}}}
        r.update({k: v for k, v in (("routing", routing), ("activation", activation)) if v})
        return r

    rows = [row(430.0), row(600.0, "token_rounding"), row(700.0, activation="clamped_swiglu"), row(0.0, total=False)]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"env": {"device": "NVIDIA H200"}, "args": {"rep": 1000.0}, "results": rows}))
    monkeypatch.setattr(sys, "argv", ["target_summary.py", str(path)])
    runpy.run_path(str(REPO / "scripts" / "target_summary.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "8) topk: 1 runs" in out and "median 430.0 | target 440: NOT met" in out
    assert "8) token_rounding: 1 runs" in out and "median 600.0 | \n" in out
    assert "8) topk clamped_swiglu: 1 runs" in out and "median 700.0 | \n" in out


# ---------------------------------------------------------------------------------------------------
# a trained model's expert load (--load-profile)

TRAINED_LOG = REPO / "benchmarks" / "results" / "2026-11-21_nvidia-h200_train" / "log.json"


def test_load_profile_reads_and_resamples(tmp_path):
    """read_load_profile: a train log.json (per layer, sorted, averaged), a list, or lists; resample_load keeps the
    curve at E = E_src, splits each expert's share at E = 2·E_src, and always sums to 1 in descending order."""
    from sonicmoe.bench.load_profile import load_profile_kind, read_load_profile, resample_load, target_load

    path = tmp_path / "log.json"
    path.write_text(json.dumps({"expert_load": {"per_layer": [{"counts": [1, 3, 0, 4]}, {"counts": [2, 2, 2, 2]}]}}))
    curve = read_load_profile(path)
    assert torch.allclose(curve, torch.tensor([0.375, 0.3125, 0.1875, 0.125], dtype=torch.float64))
    (tmp_path / "list.json").write_text("[4, 1, 3, 0]")
    assert torch.allclose(read_load_profile(tmp_path / "list.json"), torch.tensor([0.5, 0.375, 0.125, 0.0],
                                                                                   dtype=torch.float64))
    assert torch.allclose(resample_load(curve, 4), curve)
    assert torch.allclose(resample_load(curve, 8), curve.repeat_interleave(2) / 2)
    for e in (1, 3, 7, 128):
        r = resample_load(curve, e)
        assert r.shape == (e,) and abs(float(r.sum()) - 1) < 1e-12 and bool((r[:-1] >= r[1:]).all())
    t = target_load(path, 8, seed=3)  # dealt in a seeded order: the same multiset, reproducibly
    assert torch.equal(t.sort(descending=True).values, resample_load(curve, 8))
    assert torch.equal(t, target_load(path, 8, seed=3)) and not torch.equal(t, target_load(path, 8, seed=4))
    assert load_profile_kind(path) == "counts" and load_profile_kind(tmp_path / "list.json") == "list"
    # the log's expert_load dict alone (no enclosing log) is read the same way
    (tmp_path / "load.json").write_text(json.dumps(json.loads(path.read_text())["expert_load"]))
    assert load_profile_kind(tmp_path / "load.json") == "counts"
    assert torch.equal(read_load_profile(tmp_path / "load.json"), curve)
    # a log with each step's sorted load: that curve is the profile (per_step=False: the summed one)
    both = {"expert_load": {"per_layer": [{"counts": [2, 2, 2, 2], "step_sorted_counts": [5, 2, 1, 0]}]}}
    path2 = tmp_path / "log2.json"
    path2.write_text(json.dumps(both))
    assert load_profile_kind(path2) == "step_sorted_counts" and load_profile_kind(path2, per_step=False) == "counts"
    assert torch.allclose(read_load_profile(path2), torch.tensor([0.625, 0.25, 0.125, 0.0], dtype=torch.float64))
    assert torch.allclose(read_load_profile(path2, per_step=False), torch.full((4,), 0.25, dtype=torch.float64))
    # the step curve only where every layer has one (a log merged from runs of both kinds): else the summed counts
    both["expert_load"]["per_layer"].append({"counts": [1, 3, 0, 4]})
    path2.write_text(json.dumps(both))
    assert load_profile_kind(path2) == "counts"
    assert torch.allclose(read_load_profile(path2), curve)  # the same two layers as log.json
    for bad in ("{}", "[]", "[[1, 2], [1, 2, 3]]", "[-1, 2]", "[0, 0]", '"x"', '{"per_layer": [1, 2]}',
                '{"per_layer": [{"cv": 1}]}'):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(ValueError):
            read_load_profile(tmp_path / "bad.json")
    if TRAINED_LOG.exists():  # the committed h100-preset run: E_src = 64, the busiest expert 1.43x the mean
        trained = read_load_profile(TRAINED_LOG)
        assert trained.shape == (64,) and 1.3 < float(trained[0]) * 64 < 1.6 and float(trained[-1]) * 64 < 0.6


def test_load_profile_takes_only_finite_counts_and_never_overflows(tmp_path, capsys):
    """Every load must be a finite number >= 0 (a string, null or bool is a usage error, not a TypeError), and counts
    near the float64 maximum are normalised without their sum overflowing to inf (NaN fractions)."""
    from sonicmoe.bench.load_profile import read_load_profile

    path = tmp_path / "lp.json"
    path.write_text("[1e308, 1e308, 1]")
    curve = read_load_profile(path)
    assert torch.isfinite(curve).all() and torch.allclose(curve, torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64))
    for bad in ('[[1, "a", 3]]', '{"expert_load": {"per_layer": [{"counts": [5, null, 2]}]}}', "[true, 1]",
                "[1, [2]]", "[1e999]", "[1" + "0" * 400 + "]"):
        path.write_text(bad)
        with pytest.raises(ValueError):
            read_load_profile(path)
        assert cli.main(["--out", str(tmp_path / "res"), *FAST, "--shape", "64,32,16,4,2", "--load-profile",
                         str(path)]) == 2
    assert "load" in capsys.readouterr().err


def test_load_profile_target_resample_and_nested_list(tmp_path):
    """target_load deals the typical step's curve where the log has one (as read_load_profile does by default), not
    the summed counts; resample_load normalises any curve it is given (counts as well as fractions) to fractions
    summing to 1; a log whose expert_load is itself a list is read, and named, as a list."""
    from sonicmoe.bench.load_profile import load_profile_kind, read_load_profile, resample_load, target_load

    f64 = torch.float64
    path = tmp_path / "log.json"
    path.write_text(json.dumps({"expert_load": {"per_layer": [{"counts": [2, 2, 2, 2],
                                                               "step_sorted_counts": [5, 2, 1, 0]}]}}))
    t = target_load(path, 4, seed=1)
    torch.testing.assert_close(t.sort(descending=True).values, torch.tensor([0.625, 0.25, 0.125, 0.0], dtype=f64),
                               rtol=1e-12, atol=1e-15)
    counts = torch.tensor([6.0, 3.0, 2.0, 1.0], dtype=f64)
    torch.testing.assert_close(resample_load(counts, 4), counts / 12, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(resample_load(counts, 8), (counts / 24).repeat_interleave(2), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(resample_load(counts * 1e6, 3), resample_load(counts / 12, 3), rtol=1e-12, atol=1e-15)
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps({"expert_load": [4, 1, 3, 0]}))
    assert load_profile_kind(nested) == "list"
    torch.testing.assert_close(read_load_profile(nested), torch.tensor([0.5, 0.375, 0.125, 0.0], dtype=f64),
                               rtol=1e-12, atol=1e-15)


def test_calibrated_router_follows_the_profile(tmp_path):
    """make_problem(load=...): the router weight's rows scaled until top-k gives each expert its share; the
    problem's routing counts within 3% of the target (T·K = 32768 pairs over 32 experts): the busiest expert 2.3x the
    mean, where the random router's stays under 1.6x (1.35x: its rows' norms differ at d = 64). The router stays
    X W_rᵀ: route() with the problem's weight gives the same counts."""
    from sonicmoe.bench.load_profile import calibrate_router, target_load

    path = tmp_path / "skew.json"
    path.write_text(json.dumps([3.0] * 4 + [1.0] * 20 + [0.4] * 8))  # 2.3x the mean down to 0.3x
    shape = parse_shape("8192,64,16,32,4")
    load = target_load(path, 32)
    even = make_problem(shape, dtype=torch.float32, device="cpu").routing.expert_counts().double()
    skewed = make_problem(shape, dtype=torch.float32, device="cpu", load=load)
    got = skewed.routing.expert_counts().double()
    assert float((got / got.sum() / load - 1).abs().max()) < 0.03
    assert float(even.max() / even.mean()) < 1.6 < 2.2 < float(got.max() / got.mean())  # target: 2.3
    assert torch.equal(skewed.route(skewed.x.detach()).routing.expert_counts(), skewed.routing.expert_counts())
    w, dev = calibrate_router(skewed.x, skewed.router_weight, 4, load)
    assert dev <= 0.02 and w.dtype == torch.float32 and not w.requires_grad


def test_cli_load_profile(tmp_path):
    """--load-profile: the records name the profile and its resampled extremes; a missing or bad file stops the
    run before any shape (exit 2)."""
    path = tmp_path / "skew.json"
    path.write_text(json.dumps([3.0] * 4 + [1.0] * 12))
    rc, doc = _run(tmp_path, "--shape", "1024,32,16,16,2", "--backends", "torch", "--load-profile", str(path))
    assert rc == 0
    (rec,) = doc["results"]
    assert rec["load_target"]["profile"] == str(path) and rec["load_target"]["max_over_mean"] == pytest.approx(2.0)
    assert rec["load_target"]["loads"] == "list"
    assert rec["tokens_per_expert"]["max"] > 1.8 * rec["tokens_per_expert"]["mean"]
    # what the calibrated router reached is recorded beside the target (a warning when 10% off)
    assert rec["load_target"]["achieved_max_over_mean"] == pytest.approx(
        rec["tokens_per_expert"]["max"] / rec["tokens_per_expert"]["mean"])
    # the least loaded expert likewise: 1 / 1.5 of the mean in the profile, what the router reached beside it
    assert rec["load_target"]["min_over_mean"] == pytest.approx(2 / 3)
    assert rec["load_target"]["achieved_min_over_mean"] == pytest.approx(
        rec["tokens_per_expert"]["min"] / rec["tokens_per_expert"]["mean"])
    for bad in (tmp_path / "missing.json", tmp_path / "skew.json"):
        if bad.exists():
            bad.write_text("[0, 0]")
        assert cli.main(["--out", str(tmp_path / "res2"), *FAST, "--shape", "64,32,16,4,2", "--load-profile",
                         str(bad)]) == 2


def test_check_catches_a_few_wrong_rows_the_norm_misses():
    """Three zeroed output rows of 2048: the norm-wise error (about 0.04 of sqrt(3/2048)) stays under a loose tol of
    5e-2, the worst-row error (1, over the RMS row) does not: the check FAILs on out_rows. The correct backend
    passes, and its local errors sit far under their bound."""
    from sonicmoe.bench.measure import LOCAL_TOL_FACTOR, check_case

    p = make_problem(Shape("rows", 2048, 32, 16, 4, 2), dtype=torch.float32, device="cpu", seed=4)
    case = REGISTRY["torch"].factory(p, {})
    good = check_case(case, p.dout, grads=True, tol=5e-2, poison=False)
    assert good["passed"] and max(good["errors"].values()) < 1e-5
    forward = case.forward
    mask = torch.ones(2048, 1)
    mask[[5, 700, 2047]] = 0
    case.forward = lambda: forward() * mask
    bad = check_case(case, p.dout, grads=False, tol=5e-2, poison=False)
    assert bad["errors"]["out"] < 5e-2 and bad["errors"]["out_rows"] > 5e-2 * LOCAL_TOL_FACTOR
    assert not bad["passed"] and bad["worst"] == "out_rows"
    # every row 1% off: the worst row's error is the larger number, but the norm-wise one is nearer its bound (a
    # tenth of the local one's): "worst" names the one nearest its bound
    case.forward = lambda: forward() * 1.01
    scaled = check_case(case, p.dout, grads=False, tol=5e-2, poison=False)
    assert scaled["passed"] and scaled["errors"]["out_rows"] > scaled["errors"]["out"] and scaled["worst"] == "out"


@pytest.mark.parametrize("mode", ["topk", "token_rounding"])
def test_router_variant_check_catches_a_wrong_router(mode):
    """The router variant (router + routing metadata + experts) is checked on the pairs it chose, its scores
    recomputed from float32 logits: the torch backend passes with errors at float32 rounding and dW_r compared;
    a router whose scores skip the softmax's max shift of one token, or whose W_r gradient is dropped, FAILs."""
    from sonicmoe.bench.measure import check_case

    p = make_problem(Shape("rv", 512, 32, 16, 8, 2), dtype=torch.float32, device="cpu", seed=5, mode=mode,
                     m_tile=16)
    case = REGISTRY["torch"].factory(p, {})
    good = check_case(case, p.dout, grads=True, tol=2e-3, poison=False, router=True)
    assert good["passed"] and "dwr" in good["errors"] and "ds" not in good["errors"]
    assert max(good["errors"].values()) < 1e-5 and good["pairs"] >= (512 * 2 if mode == "topk" else 1)
    assert p.router_weight.grad is None and p.x.grad is None  # the check leaves no gradient behind
    route = p.route

    def wrong_scale(x):  # token 7's scores doubled (a wrong normalisation of one row)
        r = route(x)
        scale = torch.where(r.pair_token == 7, 2.0, 1.0)
        return dataclasses.replace(r, pair_scores=r.pair_scores * scale)

    def no_router_grad(x):
        r = route(x)
        return dataclasses.replace(r, pair_scores=r.pair_scores.detach())

    for wrong, worst in ((wrong_scale, ("out_rows", "dx_rows")), (no_router_grad, ("dwr",))):
        p.route = wrong
        bad = check_case(case, p.dout, grads=True, tol=2e-3, poison=False, router=True)
        assert not bad["passed"] and bad["worst"] in worst, bad


def test_router_variant_reference_in_chunks_of_experts():
    """The router variant's reference in one chunk per expert (chunk_bytes=1) equals the one-chunk reference: the
    scores' float32 logits are one graph shared by every chunk's backward, kept until the last (a graph freed by the
    first chunk's backward raised on the second)."""
    from sonicmoe.bench.measure import check_case

    p = make_problem(Shape("rc", 64, 32, 16, 4, 2), dtype=torch.float32, device="cpu", seed=8)
    case = REGISTRY["torch"].factory(p, {})
    whole = check_case(case, p.dout, grads=True, tol=2e-3, poison=False, router=True)
    chunked = check_case(case, p.dout, grads=True, tol=2e-3, poison=False, router=True, chunk_bytes=1)
    assert whole["passed"] and chunked["passed"] and set(chunked["errors"]) == set(whole["errors"])
    assert "dwr" in chunked["errors"] and max(chunked["errors"].values()) < 1e-5, chunked


def test_bench_row_fails_on_a_wrong_router_variant(tmp_path, monkeypatch, capsys):
    """A router variant that FAILs its check marks the backend's row FAIL, naming the router variant, and the run
    exits 1."""
    from sonicmoe.bench import problem as problem_mod

    route = problem_mod.Problem.route

    def wrong(self, x):
        r = route(self, x)
        return dataclasses.replace(r, pair_scores=r.pair_scores * 1.5)

    monkeypatch.setattr(problem_mod.Problem, "route", wrong)
    rc, doc = _run(tmp_path, "--shape", "256,32,16,4,2", "--backends", "torch,upper", "--dtype", "fp32")
    row = doc["results"][0]["backends"]["torch"]
    assert row["status"] == "FAIL" and row["message"].startswith("router variant: wrong result"), row
    assert row["check"]["errors"]["out"] < 1e-5 and not row["check"]["router"]["passed"]
    # a FAIL row beside a row that timed fine (upper has no router variant), no errored row: the run fails
    assert doc["results"][0]["backends"]["upper"]["status"] == "ok"
    assert rc == 1 and "not ok: " in capsys.readouterr().err


class _AtenLog(TorchDispatchMode):
    """The aten ops run inside a ``with`` block, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["topk", "token_rounding"])
def test_router_variant_times_only_the_layers_routing(mode):
    """The timed router variant (router + routing + experts) runs exactly the ops the MoE layer's routing runs before
    its experts (``MoE._route``): no top-k pair list (an arange and a T·K copy per call) that only the check needs."""
    from sonicmoe.routing import router_topk, routing_from_topk
    from sonicmoe.token_rounding import token_rounding

    p = make_problem(Shape("rv", 256, 32, 16, 8, 2), dtype=torch.float32, device="cpu", seed=1, mode=mode,
                     m_tile=16)
    case = REGISTRY["torch"].factory(p, {})
    case.fn = lambda x, w1, w2, routing, scores: None  # the routing alone
    with torch.no_grad(), _AtenLog() as timed:
        case.forward_with_router()
    with torch.no_grad(), _AtenLog() as layer:
        r = router_topk(p.x, p.router_weight, 2)
        if mode == "topk":  # MoE._route's calls: the routing and the pair scores
            routing_from_topk(r.topk_ids, 8), r.topk_scores.reshape(-1)
        else:
            token_rounding(r, m_tile=16, static=True, fused_router_grad=True)
    assert layer.ops and timed.ops == layer.ops
    # the check still gets the pairs it compares on
    assert p.route(p.x.detach()).pair_token is not None


def test_token_rounding_check_uses_the_timed_pairs():
    """The check of a token-rounding problem on its first tokens keeps the timed problem's own pairs of those tokens
    (rounding 64 tokens again rounds every expert down to none, and a check on no pair passes anything)."""
    p = make_problem(Shape("tr", 1024, 16, 8, 4, 2), dtype=torch.float32, device="cpu", mode="token_rounding",
                     m_tile=128)
    head = p.head(64)
    keep = p.pair_token < 64
    assert head.R == int(keep.sum()) > 0 and head.T == 64
    assert torch.equal(head.pair_expert, p.pair_expert[keep]) and torch.equal(head.pair_scores, p.pair_scores[keep])
    assert torch.equal(head.routing.expert_counts(), torch.bincount(p.pair_expert[keep].long(), minlength=4).int())
    # a routing of the 64 tokens (not of the problem's 1024), and leaves that take the check's gradients
    per_token = torch.bincount(p.pair_token[keep].long(), minlength=64)
    assert head.routing.num_tokens == 64 and torch.equal(
        head.routing.token_offsets, torch.cat([per_token.new_zeros(1), per_token.cumsum(0)]).int())
    for t in (head.x, head.pair_scores):
        assert t.is_leaf and t.requires_grad
    assert p.head(1024) is p and p.head(4096) is p  # all the tokens: the problem itself, nothing copied


def test_problem_head_slices_dout_and_route_is_the_layers_static_form():
    """Problem.head(T) keeps the first T rows of dO with those of x; Problem.route routes as the MoE layer does:
    token rounding's static form, R_max pairs (padding last), where make_problem's own routing holds exactly R;
    route() refuses an unknown routing mode rather than routing it as top-k."""
    from sonicmoe.bench.problem import route
    from sonicmoe.token_rounding import max_pairs

    p = make_problem(Shape("h", 64, 16, 8, 4, 2), dtype=torch.float32, device="cpu", seed=1)
    h = p.head(16)
    assert h.T == 16 and torch.equal(h.dout, p.dout[:16]) and torch.equal(h.x, p.x[:16])
    assert h.routing.num_tokens == 16 and p.head(64) is p
    for t in (h.x, h.pair_scores):
        assert t.is_leaf and t.requires_grad
    with pytest.raises(ValueError, match="routing must be 'topk' or 'token_rounding', got 'top_k'"):
        route(p.x.detach(), p.router_weight.detach(), 2, "top_k")
    tr = make_problem(Shape("tr", 256, 16, 8, 4, 2), dtype=torch.float32, device="cpu", seed=2,
                      mode="token_rounding", m_tile=16)
    r_max = max_pairs(256, 4, 2, 16, "nearest")
    with torch.no_grad():
        got = tr.route(tr.x)
    assert tr.R < r_max and got.pair_token.shape[0] == got.pair_scores.shape[0] == r_max
    assert int(got.routing.expert_counts().sum()) == tr.R


@pytest.mark.parametrize("rounding", ["up", "down"])
def test_problem_head_caps_its_shape_and_route_keeps_the_rounding(rounding):
    """Problem.head(T)'s shape is the shape at T tokens (T_preset the problem's), as the FLOPs and the records read it;
    Problem.route rounds with the problem's own subroutine: its real pairs (the static form's, padding left out) are
    make_problem's, which "nearest" would not give here."""
    from sonicmoe.bench.problem import route

    p = make_problem(Shape("h", 128, 16, 8, 8, 2), dtype=torch.float32, device="cpu", seed=4,
                     mode="token_rounding", m_tile=16, rounding=rounding)
    h = p.head(40)
    assert (h.shape.T, h.shape.T_preset, h.shape.E, h.shape.K) == (40, 128, 8, 2) and h.T == 40
    with torch.no_grad():
        got = p.route(p.x.detach())
        nearest = route(p.x.detach(), p.router_weight, 2, "token_rounding", m_tile=16, rounding="nearest")
    real = got.pair_expert < 8
    assert torch.equal(got.pair_token[real], p.pair_token) and torch.equal(got.pair_expert[real], p.pair_expert)
    assert not torch.equal(nearest.pair_expert, p.pair_expert) or not torch.equal(nearest.pair_token, p.pair_token)


def test_router_check_on_tokens_that_round_to_no_pair_is_skipped_not_failed(tmp_path, capsys):
    """--check-max-T 64 under token rounding: the experts are checked on the timed problem's pairs of those tokens,
    but the router variant rounds the 64 tokens' counts again (8 per expert at M_tile 128: none). That check on no
    pair is recorded as skipped with the reason, not a FAIL, and the backend and its router variant are timed."""
    rc, doc = _run(tmp_path, "--shape", "1024,32,16,32,4", "--routing", "token_rounding", "--check-max-T", "64",
                   "--backends", "torch")
    row = doc["results"][0]["backends"]["torch"]
    assert rc == 0 and row["status"] == "ok", row["message"]
    assert row["check"]["passed"] and row["check"]["pairs"] > 0 and row["check"]["T"] == 64
    router = row["check"]["router"]
    assert router["pairs"] == 0 and router["passed"] is None and "routes no pair" in router["skipped"]
    assert row["total"]["ms"]["p50"] > 0 and row["router"]["total"]["ms"]["p50"] > 0
    assert "router variant not checked" in report.terminal_table(doc)


def test_stochastic_token_rounding_follows_the_seed():
    """--rounding stochastic draws from the problem's seeded generator, not torch's global RNG: the same seed gives
    the same pairs (the problem's and the router variant's), whatever the global RNG's state."""
    shape = Shape("st", 256, 16, 8, 16, 2)  # 32 pairs per expert on average, M_tile 16: each rounds up or down

    def problem(global_seed):
        torch.manual_seed(global_seed)
        p = make_problem(shape, dtype=torch.float32, device="cpu", seed=3, mode="token_rounding", m_tile=16,
                         rounding="stochastic")
        torch.manual_seed(global_seed + 10)
        return p, p.route(p.x.detach())

    (a, ra), (b, rb) = problem(1), problem(2)
    assert torch.equal(a.pair_expert, b.pair_expert) and torch.equal(a.pair_token, b.pair_token)
    assert torch.equal(ra.pair_expert, rb.pair_expert)


def test_loop_baseline_with_no_pair_has_a_backward():
    """No pair routed: the loop's output is zeros in the graph of every input, so each one (the scores too) gets a
    zero gradient, not None."""
    from sonicmoe import routing_from_pairs

    leaves = [t.requires_grad_() for t in (torch.randn(3, 8), torch.randn(2, 8, 8), torch.randn(2, 8, 4),
                                           torch.empty(0))]
    empty = torch.empty(0, dtype=torch.long)
    x, w1, w2, s = leaves
    out = baselines.experts_loop(x, w1, w2, routing_from_pairs(empty, empty, 3, 2), s)
    out.sum().backward()
    assert not out.any()
    for t in leaves:
        assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()


def test_loop_baseline_runs_experts_of_one_row():
    """Experts routed a single row (here experts 0 and 2 of 4; expert 3 none) are computed like the others: the loop's
    output and gradients equal the float32 reference's."""
    import sonicmoe
    from sonicmoe import routing_from_pairs
    from sonicmoe.testing import rel_err

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    t, d, n, e = 5, 16, 8, 4
    x, w1, w2 = (torch.randn(*s, generator=g).requires_grad_(True) for s in ((t, d), (e, 2 * n, d), (e, d, n)))
    pair_token = torch.tensor([0, 0, 1, 2, 3, 4, 4])
    pair_expert = torch.tensor([0, 1, 1, 2, 1, 1, 1])  # one row each for experts 0 and 2, five for 1, none for 3
    s = torch.rand(7, generator=g).requires_grad_(True)
    routing = routing_from_pairs(pair_token, pair_expert, t, e)
    assert routing.expert_offsets.tolist() == [0, 1, 6, 7, 7]
    out = baselines.experts_loop(x, w1, w2, routing, s)
    ref = sonicmoe.experts_ref(x, w1, w2, routing, s)
    assert rel_err(out, ref) < 1e-5 and out[0].abs().sum() > 0
    dout = torch.randn(t, d, generator=g)
    leaves = (x, w1, w2, s)
    for got, want in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(ref, leaves, dout)):
        assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_clamped_activation_reference_rounds_h_in_the_problems_dtype(dtype):
    """Under the clamped activation every backend's reference rounds H to the problem's dtype (fp16, bf16 here), for
    the experts' check and the router variant's alike; under SwiGLU it leaves H unrounded (None)."""
    p = make_problem(Shape("hd", 16, 16, 8, 4, 2), dtype=dtype, device="cpu", seed=2)
    for activation, want in (("clamped_swiglu", dtype), ("swiglu", None)):
        loop = REGISTRY["loop"].factory(p, {"activation": activation})
        with torch.no_grad():
            _, router_spec = loop.router_check()
        upper = REGISTRY["upper"].factory(p, {"activation": activation})
        for spec in (loop.ref_spec(), router_spec, upper.ref_spec()):
            assert spec.activation == activation and spec.h_dtype == want


def test_router_variant_backward_reaches_the_router_weight():
    """The timed router variant runs the experts on the routing it computed: its output is the checked call's, and
    its backward reaches W_r (through the scores) with the checked call's dW_r, the problem's own scores untouched."""
    p = make_problem(Shape("rw", 48, 16, 8, 4, 2), dtype=torch.float32, device="cpu", seed=6)
    case = REGISTRY["loop"].factory(p, {})
    checked, _ = case.router_check()
    checked.backward(p.dout)
    want = p.router_weight.grad.clone()
    assert want.abs().sum() > 0
    for t in (p.x, p.router_weight, p.w1, p.w2, p.pair_scores):
        t.grad = None
    timed = case.forward_with_router()
    assert torch.equal(timed, checked)
    timed.backward(p.dout)
    assert p.pair_scores.grad is None and torch.allclose(p.router_weight.grad, want, rtol=1e-6, atol=1e-7)


def _checked_twice_alike(case, dout, leaves):
    """``case``'s leaves are exactly ``leaves``; check_case on it twice in a row passes both times with the same
    errors and leaves no gradient behind."""
    from sonicmoe.bench.measure import check_case

    assert {id(t) for t in case.leaves} == {id(t) for t in leaves}
    first = check_case(case, dout, grads=True, tol=1e-5)
    second = check_case(case, dout, grads=True, tol=1e-5)
    assert first["passed"] and second["passed"], (first, second)
    assert second["errors"] == pytest.approx(first["errors"], rel=1e-6, abs=1e-9)
    assert all(t.grad is None for t in case.leaves)


def test_upper_bound_check_twice_and_its_info():
    """check_case on the upper bound twice in a row passes both times with the same errors (its scores S_up are a
    leaf, cleared with the others); its info records m, K' and the E·m rows it computes (the ratio's row count)."""
    p = make_problem(Shape("t3", 50, 16, 8, 3, 2), dtype=torch.float32, device="cpu", seed=4)
    up = UpperBoundCase(p)
    assert up.info == {"rows_per_expert": 34, "K_up": 2, "rows": 102}
    _checked_twice_alike(up, p.dout, (up.x_up, p.w1, p.w2, up.s_up))


def test_check_case_twice_starts_from_no_gradients():
    """check_case on the same case twice in a row passes both times with the same errors: every leaf whose
    gradient is compared (the scores' too) is cleared before and after, so the second backward does not add to the
    first's."""
    p = make_problem(Shape("t", 40, 16, 8, 4, 2), dtype=torch.float32, device="cpu", seed=9)
    _checked_twice_alike(ExpertsCase("loop", p, baselines.experts_loop), p.dout, (p.x, p.w1, p.w2, p.pair_scores))


def test_markdown_never_shows_torch_as_ours(tmp_path, capsys):
    """A shape where ours FAILed (the ratio base fell back to torch): the README row names ours' status, and no
    number of torch's appears in our columns."""
    doc = _synthetic_doc()
    rec = doc["results"][0]
    rec["backends"]["triton"].update(status="FAIL", message="wrong result: rel err of dx = 0.5 > tol 0.02")
    rec["ratio_base"] = "torch"
    md = report.markdown_table(doc)
    line = next(ln for ln in md.splitlines() if ln.startswith(f"| {rec['name']} "))
    assert "ours: FAIL (wrong result" in line and "1.5" not in line and "| 5 |" not in line
    # the terminal table marks torch, the base, as such, and ours not
    rows = {ln.split()[2]: ln for ln in report.terminal_table(doc).splitlines() if ln.startswith(rec["name"] + " ")}
    assert " base " in rows["torch"] and " base " not in rows["triton"]
    # ours "ok" but untimed (no fwd): the base is torch, whose ratio to the bound must not read as ours
    rec["backends"]["triton"].update(status="ok", message=None, fwd=None, total=None)
    line = next(ln for ln in report.markdown_table(doc).splitlines() if ln.startswith(f"| {rec['name']} "))
    assert "ours: no result" in line and "0.90" not in line
    # ours timed on no shape at all: the footnote names no backend as the one timed
    for r in doc["results"]:
        r["ratio_base"] = "torch"
    assert report.markdown_table(doc).splitlines()[-1].startswith("Backend: - (no timing of ours). NVIDIA H100")


def test_markdown_row_of_a_multiline_error_is_one_row():
    """Ours' error message in the README row: a multi-line message (a Triton compilation error lists the source) and
    a ``|`` in it once broke the table (the row continued on the next lines, the bar ended the cell)."""
    import re

    doc = _synthetic_doc()
    rec = doc["results"][0]
    message = "forward: CompilationError: at 3:4:\n    x = tl.load(p | q)\n"
    rec["backends"]["triton"].update(status="error", message=message)
    rec["ratio_base"] = "torch"
    rows = [ln for ln in report.markdown_table(doc).splitlines() if ln.startswith("|")]
    assert len(rows) == 2 + 11
    line = next(ln for ln in rows if ln.startswith(f"| {rec['name']} "))
    assert "ours: error (forward: CompilationError: at 3:4: x = tl.load(p \\| q))" in line
    assert len(re.split(r"(?<!\\)\|", line)) == 9 + 2  # nine cells


def test_bench_cli_refuses_bad_files_and_check_sizes(tmp_path, capsys):
    assert cli.main(["--markdown-from", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "bad.json").write_text("{not json")
    assert cli.main(["--plot-from", str(tmp_path / "bad.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert cli.main([*FAST, "--shape", "8,8,4,2,1", "--check-max-T", "-5"]) == 2


@pytest.mark.parametrize("args, flag", [
    (["--m-tile", "0", "--routing", "token_rounding"], "--m-tile"), (["--m-tile", "-5"], "--m-tile"),
    (["--tol", "-1"], "--tol"), (["--tol", "0"], "--tol"), (["--tol", "nan"], "--tol"), (["--tol", "inf"], "--tol"),
    (["--check-max-T", "0"], "--check-max-T"), (["--max-T", "-3"], "--max-T"), (["--backends", ""], "--backends"),
    (["--backends", ","], "--backends"), (["--warmup", "nan"], "--warmup"), (["--rep", "-1"], "--rep"),
    (["--plot-from", "A"], "--markdown-from"),  # with --markdown-from B: one would be ignored
])
def test_bench_cli_refuses_bad_values_before_running(tmp_path, capsys, monkeypatch, args, flag):
    """Values argparse takes but the run cannot use are usage errors (exit 2) naming the flag; nothing runs."""
    from sonicmoe.bench import runner

    def never(*a, **k):
        raise AssertionError("ran")

    monkeypatch.setattr(runner, "run", never)
    doc = report.write_results(_synthetic_doc(), tmp_path / "r.json")
    args = [str(doc) if a == "A" else a for a in args]
    if "--plot-from" in args:
        args += ["--markdown-from", str(doc)]
    assert cli.main(["--out", str(tmp_path / "res"), *FAST, "--shape", "64,32,16,4,2", *args]) == 2
    err = capsys.readouterr().err
    # the error line names the flag (the usage text above it names every flag): the right value refused, not one of
    # the valid ones beside it (FAST's --warmup 0 --rep 0)
    assert "usage:" in err and flag in err.strip().splitlines()[-1]


@pytest.mark.parametrize("results", [5, [{}], [1], "drop T", "drop G", "bool T", "backends list", "ratios list",
                                     "row list", "number name"])
@pytest.mark.parametrize("how", ["--plot-from", "--markdown-from"])
def test_bench_cli_refuses_malformed_results_files(tmp_path, capsys, results, how):
    """A results file whose records the tables and plots cannot read: "cannot read" (exit 2), not a traceback. Each
    record needs a string name, numbers T, d, n, E, K, G, and objects for its backends, each backend's row and its
    ratios."""
    doc = _synthetic_doc()
    if isinstance(results, str):
        what, key = results.split()
        if what == "drop":
            del doc["results"][0][key]
        elif what == "bool":  # a JSON true is no number of tokens
            doc["results"][0][key] = True
        elif what == "number":  # a name that is no string
            doc["results"][0][key] = 7
        elif what == "row":  # one backend's row a list, the backends themselves an object
            doc["results"][0]["backends"]["triton"] = []
        else:
            doc["results"][0][what] = []
    else:
        doc["results"] = results
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    assert cli.main([how, str(path), "--out", str(tmp_path / "plots")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_terminal_table_shows_the_error_nearest_its_bound():
    """The error column shows the check's "worst" error (nearest its bound) and names it: a worst row's 5e-2 under its
    local bound 10·tol is not the largest-looking 5e-2 in place of the norm error 1.5e-2 that decides (tol 2e-2)."""
    doc = _synthetic_doc()
    rec = doc["results"][0]
    errs = {"out": 0.015, "out_rows": 0.05, "dx": 0.001, "dx_rows": 0.01}
    rec["backends"]["triton"]["check"] = {"errors": errs, "tol": 0.02, "passed": True, "worst": "out"}
    rec["backends"]["torch"]["check"] = {"errors": dict(errs, dx=None), "tol": 0.02, "passed": False, "worst": "dx"}
    rec["dtype"] = "float32"
    table = report.terminal_table(doc)
    line = {ln.split()[2]: ln for ln in table.splitlines() if ln.startswith(rec["name"] + " ")}
    assert "1.50e-02 out " in line["triton"] and "5.00e-02" not in line["triton"]
    assert "nan dx " in line["torch"]
    assert "worst err" in table and "in the run's dtype" in table
    # a "worst" that names no error of the check (a file of another version): "-", not a KeyError
    rec["backends"]["torch"]["check"] = {"errors": {"out": 0.015}, "tol": 0.02, "passed": True, "worst": "ds"}
    line = {ln.split()[2]: ln for ln in report.terminal_table(doc).splitlines() if ln.startswith(rec["name"] + " ")}
    assert line["torch"].split()[4] == "-" and "1.50e-02" not in line["torch"]


def test_terminal_table_cells_of_missing_numbers_router_and_notes():
    """The terminal table: a NaN or infinite timing is "-" (not "nan"); +router is the f+b time with the router, or
    the forward's where only the forward ran; only rows that did not run "ok" add their message as a note."""
    doc = _synthetic_doc()
    rec = doc["results"][0]
    tri, torch_row = rec["backends"]["triton"], rec["backends"]["torch"]
    tri["fwd"]["ms"]["p50"], tri["fwd"]["tflops"] = float("nan"), float("inf")
    tri["router"] = {"fwd": {"ms": {"p50": 1.25}}, "total": None}
    tri["message"] = "calibrated router: 3 idle experts"
    torch_row["router"] = {"fwd": {"ms": {"p50": 1.5}}, "total": {"ms": {"p50": 5.75}}}
    torch_row.update(status="FAIL", message="wrong result: dx")
    table = report.terminal_table(doc)
    rows = {ln.split()[2]: ln.split() for ln in table.splitlines() if ln.startswith(rec["name"] + " ")}
    header = ["shape", "routing", "backend", "status", "worst err", "fwd ms", "fwd TF/s", "bwd ms", "bwd TF/s",
              "f+b ms", "f+b TF/s", "+router ms"]
    col = {h: i for i, h in enumerate(header)}  # every cell one word here ("worst err": "-", no check)
    assert rows["triton"][col["fwd ms"]] == "-" and rows["triton"][col["fwd TF/s"]] == "-"
    assert rows["triton"][col["+router ms"]] == "1.25" and rows["torch"][col["+router ms"]] == "5.75"
    assert f"{rec['name']} [topk] torch: FAIL: wrong result: dx" in table
    assert "calibrated router" not in table
    # a shape that failed as a whole (no backend ran) notes its own message; the foot names the commit by 12 digits
    assert "broken [topk]: making the problem: OOM" in table
    doc["env"]["git_commit"] = "0123456789abcdef0123456789abcdef01234567"
    assert "| commit 0123456789ab | " in report.terminal_table(doc)
    assert ", commit 0123456789ab, " in report.markdown_table(doc)


def test_markdown_rows_of_unstated_status_and_of_a_shape_ours_never_ran():
    """A row of ours without a status field is taken as ok (its numbers shown); a shape that ran "ok" without ours
    says "ours: not run", not "ok" over empty columns. A file of mixed activations is headed by both."""
    doc = _synthetic_doc()
    first, second = doc["results"][0], doc["results"][1]
    del first["backends"]["triton"]["status"]
    del second["backends"]["triton"]
    second["ratio_base"] = "torch"
    md = report.markdown_table(doc)
    rows = {ln.split()[1]: ln for ln in md.splitlines() if ln.startswith("| ")}
    assert rows[first["name"]].startswith(f"| {first['name']} (24576, 1536, 256, 128, 8) | topk | 1 | 100 | 3 | 100 |")
    assert f"| {second['name']} (24576, 1536, 512, 64, 4) | topk | ours: not run |" in md
    assert md.splitlines()[0].startswith("| shape")
    doc["results"][3]["activation"] = "clamped_swiglu"
    assert report.activations(doc) == ["swiglu", "clamped_swiglu"]
    md = report.markdown_table(doc)
    assert md.splitlines()[0].startswith("Activation: swiglu, clamped_swiglu (not SwiGLU alone")
    assert md.splitlines()[-1].endswith("Activation: swiglu, clamped_swiglu.")


def test_format_table_aligns_numbers_right_and_text_left():
    """format_table: each column as wide as its widest cell, header included; numbers (ratios with an x, exponents,
    and "-" for a missing one) right-aligned, words left-aligned; no trailing spaces."""
    rows = [["a", "-", "1.5x", "ok"], ["bbbbbb", "12.25", "3e-05", "FAIL"]]
    want = ("name    value  ratio  status\n"
            "------  -----  -----  ------\n"
            "a           -   1.5x  ok\n"
            "bbbbbb  12.25  3e-05  FAIL")
    assert report.format_table(rows, ["name", "value", "ratio", "status"]) == want


def test_terminal_table_memory_in_mib_and_spec_beyond_x():
    """held, spec−X and peak in MiB of 2^20 bytes; spec−X is H, 2·TK·n elements of the run's dtype (2 bytes in
    bf16): (24576·8)·256·2·2 bytes = 192 MiB for the first shape; 2 GiB held is 2048 MiB, 5 GiB peak 5120 MiB."""
    doc = _synthetic_doc()
    rec = doc["results"][0]
    rec["dtype"] = "bfloat16"
    assert report.spec_beyond_x_bytes(rec) == 2 * rec["TK"] * rec["n"] * 2 == 192 << 20
    line = {ln.split()[2]: ln for ln in report.terminal_table(doc).splitlines() if ln.startswith(rec["name"] + " ")}
    assert line["triton"].split()[-3:] == ["2048", "192", "5120"]


def test_markdown_tflops_cells_are_integers_from_100():
    """TFLOP/s in the README table: no decimals from 100 up (1234, not 1.23e+03), 3 significant digits below."""
    doc = _synthetic_doc()
    rec = doc["results"][0]
    rec["backends"]["triton"]["fwd"]["tflops"], rec["backends"]["triton"]["total"]["tflops"] = 1234.4, 56.78
    assert f"| {rec['name']} (24576, 1536, 256, 128, 8) | topk | 1 | 1234 | 3 | 56.8 |" in report.markdown_table(doc)


def test_spec_beyond_x_bytes_per_dtype():
    """spec−X = 2·TK·n elements of the record's dtype: 4 bytes each in float32, 2 in float16 and bfloat16; None for a
    dtype it does not know or a record without TK or n (no crash on a file of another version)."""
    rec = {"TK": 24576 * 8, "n": 256}
    for dtype, elem in (("float32", 4), ("float16", 2), ("bfloat16", 2)):
        assert report.spec_beyond_x_bytes(dict(rec, dtype=dtype)) == elem * 2 * 24576 * 8 * 256, dtype
    assert report.spec_beyond_x_bytes(dict(rec, dtype="int8")) is None
    assert report.spec_beyond_x_bytes({"dtype": "float32", "n": 256}) is None
    assert report.spec_beyond_x_bytes({"dtype": "float32", "TK": 8}) is None


def test_terminal_table_notes_an_unchecked_router_variant_and_an_infinite_error_as_saved():
    """A backend whose router variant went unchecked (token rounding routed no checked pair) gets a note naming the
    reason; an infinite error reads "nan", as the saved file (null) will read it, not "inf" live and "nan" later."""
    doc = _synthetic_doc()
    rec = doc["results"][0]
    rec["backends"]["triton"]["check"] = {"errors": {"out": float("inf"), "dx": 0.001}, "tol": 0.02,
                                          "passed": False, "worst": "out",
                                          "router": {"passed": None, "skipped": "no pair routed"}}
    table = report.terminal_table(doc)
    assert f"{rec['name']} [topk] triton: router variant not checked: no pair routed" in table
    assert "router variant not checked" not in report.terminal_table(_synthetic_doc())
    line = next(ln for ln in table.splitlines() if ln.startswith(rec["name"] + " ") and ln.split()[2] == "triton")
    assert line.split()[4:6] == ["nan", "out"]
    assert table == report.terminal_table(report.sanitize(doc))


def test_activations_of_records_without_one_or_with_null_are_swiglu():
    """A record without ``activation`` or with a null one (written before the field, or by a run that left it unset)
    ran SwiGLU: no activation note, and the README table is not headed by one."""
    doc = _synthetic_doc()
    doc["results"][0]["activation"] = None
    doc["results"][1].pop("activation", None)
    assert report.activations(doc) == ["swiglu"]
    assert report.activation_note(doc) is None
    assert report.markdown_table(doc).splitlines()[0].startswith("| shape")


@pytest.mark.parametrize("text", ["5", '"results"', '["results"]', "null"])
def test_load_results_refuses_a_document_that_is_no_object(tmp_path, text):
    """A results file whose JSON is no object (a number, a string, a list, null): ValueError (the CLI's "cannot read"),
    not a TypeError from looking "results" up in it."""
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="not a sonicmoe bench results file"):
        report.load_results(path)


def test_results_say_autotune_only_on_a_gpu(monkeypatch):
    """``autotune`` is true only for a CUDA run with autotuning on: the CPU runs the pinned configs (or none) whatever
    SONICMOE_AUTOTUNE says."""
    from sonicmoe.ops import common

    monkeypatch.setattr(common, "autotune_enabled", lambda: True)
    now = __import__("datetime").datetime(2026, 1, 2)
    assert report.build_results([], {"device_type": "cpu"}, [], {}, now)["autotune"] is False
    assert report.build_results([], {"device_type": "cuda"}, [], {}, now)["autotune"] is True
    # and the timer it names: do_bench's on a GPU, the host clock on the CPU
    assert report.build_results([], {"device_type": "cpu"}, [], {}, now)["timer"] == "time.perf_counter"
    assert report.build_results([], {"device_type": "cuda"}, [], {}, now)["timer"] == "triton.testing.do_bench"


def test_env_info_names_the_cpu_and_a_cuda_device(monkeypatch):
    """env_info on a CPU: the processor's name, else the machine's, else "cpu"; on a CUDA device (the driver and
    properties faked here): name, count, capability, memory and the CUDA driver API version 12080 as "12.8"."""
    monkeypatch.setattr(report.platform, "processor", lambda: "")
    monkeypatch.setattr(report.platform, "machine", lambda: "aarch64")
    assert report.env_info(torch.device("cpu"))["device"] == "aarch64"
    monkeypatch.setattr(report.platform, "processor", lambda: " Xeon ")
    assert report.env_info(torch.device("cpu"))["device"] == "Xeon"
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=85 << 30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda idx: props)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(report.shutil, "which", lambda name: None)  # no nvidia-smi: no driver string
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12080, raising=False)
    env = report.env_info(torch.device("cuda", 1))
    assert (env["device_type"], env["device"], env["gpu_count"], env["capability"], env["memory_bytes"]) == (
        "cuda", "NVIDIA H100 80GB HBM3", 2, "9.0", 85 << 30)
    assert env["driver"] is None and env["cuda_driver_api"] == "12.8"


def test_env_switches_leave_out_the_commit_override(monkeypatch):
    """The results' switches are the run's SONICMOE_* settings, not SONICMOE_GIT_COMMIT (the commit's own field)."""
    monkeypatch.setenv("SONICMOE_GIT_COMMIT", "0123abc")
    monkeypatch.setenv("SONICMOE_AGG_CHUNK", "0")
    env = report.env_info(torch.device("cpu"))
    assert env["git_commit"] == "0123abc"
    assert env["switches"]["SONICMOE_AGG_CHUNK"] == "0" and "SONICMOE_GIT_COMMIT" not in env["switches"]


def test_upper_bound_ratio_counts_the_rows_it_computes():
    """The upper bound computes E·m rows, not R under token rounding: the ratio scales its time to R rows."""
    from sonicmoe.bench.runner import _ratios

    def timed(ms, **info):
        return {"fwd": {"ms": {"p50": ms}}, "total": {"ms": {"p50": 3 * ms}}, "info": info}

    base, r = _ratios({"triton": timed(1.0), "upper": timed(0.9, rows=1100), "torch": timed(2.0, rows=1100)}, 1000)
    assert base == "triton"
    assert r["upper"]["fwd"] == pytest.approx(0.9 * 1000 / 1100) and r["torch"]["fwd"] == pytest.approx(2.0)
    # ours skipped (no timing): the next base, torch, not a base without timings (which left every ratio empty)
    base, r = _ratios({"triton": {"status": "skipped"}, "torch": timed(2.0), "upper": timed(1.0, rows=1000)}, 1000)
    assert base == "torch" and r["upper"] == {"fwd": pytest.approx(0.5), "total": pytest.approx(0.5)}
    assert set(r) == {"upper"}  # no ratio row for a backend with no timing
    # the backward's phase too; a backward time <= 0 (total - fwd under noise) has no ratio, never a negative one
    def phases(fwd, total):
        return {"fwd": {"ms": {"p50": fwd}}, "bwd": {"ms": {"p50": total - fwd}}, "total": {"ms": {"p50": total}}}

    base, r = _ratios({"triton": phases(1.0, 3.0), "torch": phases(2.5, 2.0), "loop": phases(1.5, 5.0),
                       "tutel": {"status": "error", "fwd": None}})
    assert base == "triton" and r == {"torch": {"fwd": pytest.approx(2.5), "bwd": None, "total": pytest.approx(2 / 3)},
                                      "loop": {"fwd": pytest.approx(1.5), "bwd": pytest.approx(1.75),
                                               "total": pytest.approx(5 / 3)}}


def test_expand_falls_back_to_topk_once(monkeypatch):
    """Without the token-rounding module a shape's top-k and token-rounding items are one top-k item (not the same
    shape timed twice), and the fallback is said once."""
    from sonicmoe.bench import runner

    def unavailable():
        raise runner.TokenRoundingUnavailable("no module")

    monkeypatch.setattr(runner, "load_token_rounding", unavailable)
    a, b = Shape("a", 64, 32, 16, 4, 2, routings=("topk", "token_rounding")), Shape("b", 64, 32, 16, 4, 2)
    said = []
    items = runner.expand([a, b], SimpleNamespace(routings=None), said.append)
    assert items == [(a, "topk"), (b, "topk")] and len(said) == 1 and "no module" in said[0]


# ---------------------------------------------------------------------------------------------------
# the experts' gated activation (--activation)


def _capture_activations(monkeypatch) -> tuple[list, list]:
    """Record the activation each custom op gets and the (activation, h_dtype) of each float32 reference. The Triton
    op runs the torch backend in its place (the interpreter would take a minute here; test_bench_triton_kernels_take
    the_clamped_activation runs the kernels)."""
    from sonicmoe.bench import measure
    from sonicmoe.ops import moe_function, torch_experts

    ops, refs = [], []
    torch_op, ref = torch_experts.experts_torch, measure.experts_ref

    def triton_op(*args, activation="swiglu", **kw):
        ops.append(("triton", activation))
        return torch_op(*args, activation=activation, **kw)

    def torch_backend(*args, activation="swiglu", **kw):
        ops.append(("torch", activation))
        return torch_op(*args, activation=activation, **kw)

    def reference(*args, activation="swiglu", h_dtype=None, **kw):
        refs.append((activation, h_dtype))
        return ref(*args, activation=activation, h_dtype=h_dtype, **kw)

    monkeypatch.setattr(moe_function, "experts_triton", triton_op)
    monkeypatch.setattr(torch_experts, "experts_torch", torch_backend)
    monkeypatch.setattr(measure, "experts_ref", reference)
    return ops, refs


@pytest.mark.parametrize("activation", [None, "clamped_swiglu"])
def test_bench_activation_reaches_backends_and_reference(tmp_path, monkeypatch, capsys, activation):
    """--activation clamped_swiglu reaches both custom ops (the router variant's calls too) and the float32
    reference, which rounds H to the layer's dtype for it (h_dtype; None for SwiGLU, whose check is as before); every
    backend passes its check against that reference, and the results and the printed table name the activation.
    Without the option everything is SwiGLU and the table has no activation line."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops, refs = _capture_activations(monkeypatch)
    extra = ["--activation", activation] if activation else []
    rc, doc = _run(tmp_path, "--shape", "64,32,16,4,2", "--backends", "triton,torch,loop,upper", "--dtype", "fp32",
                   *extra)
    want = activation or "swiglu"
    out = capsys.readouterr().out
    assert rc == 0
    assert doc["args"]["activation"] == want
    (rec,) = doc["results"]
    assert rec["activation"] == want
    for name, row in rec["backends"].items():
        assert row["status"] == "ok" and row["check"]["passed"], (name, row["message"])
        assert max(row["check"]["errors"].values()) < 1e-4, name
    assert {b for b, _ in ops} == {"triton", "torch"} and {a for _, a in ops} == {want}
    # a reference per checked case: triton, torch (each with its router variant), loop, upper
    h_dtype = torch.float32 if activation else None
    assert len(refs) == 6 and set(refs) == {(want, h_dtype)}
    head = "activation: clamped_swiglu (not SwiGLU alone"
    assert (head in out) == bool(activation)
    assert (head in report.terminal_table(doc)) == bool(activation)


def _ignores_activation_factory(problem, options):
    """Claims every activation but runs SwiGLU: what --activation must never do silently."""
    def fn(x, w1, w2, routing, pair_scores):
        import sonicmoe

        return sonicmoe.experts(x, w1, w2, routing, pair_scores, backend="torch")

    return ExpertsCase("ignores", problem, fn, activation=options.get("activation", "swiglu"))


def test_bench_check_tells_the_activations_apart(tmp_path, monkeypatch):
    """The clamped activation differs from SwiGLU at any input ((u + 1)·g·σ(1.702 g) against g·σ(g)·u), so a backend
    that runs SwiGLU under --activation clamped_swiglu FAILs its check and is not timed; under SwiGLU it passes."""
    from sonicmoe.config import ACTIVATIONS

    monkeypatch.setitem(REGISTRY, "ignores", BaselineSpec("ignores", _ignores_activation_factory, "test",
                                                          default=False, activations=ACTIVATIONS))
    rc, doc = _run(tmp_path, "--preset", "tiny", "--backends", "torch,ignores", "--no-router-variant",
                   "--activation", "clamped_swiglu")
    rows = doc["results"][0]["backends"]
    assert rc == 1 and rows["torch"]["status"] == "ok"
    assert rows["ignores"]["status"] == "FAIL" and rows["ignores"]["fwd"] is None
    assert rows["ignores"]["check"]["errors"]["out"] > 0.1
    rc, doc = _run(tmp_path / "swiglu", "--preset", "tiny", "--backends", "ignores", "--no-router-variant")
    assert rc == 0 and doc["results"][0]["backends"]["ignores"]["status"] == "ok"


def test_bench_skips_a_backend_without_the_activation(tmp_path, monkeypatch, capsys):
    """A registered backend that declares no activation (BaselineSpec.activations: SwiGLU only) is skipped under
    --activation clamped_swiglu, its factory never called, the reason in its row and the table's notes; the run still
    succeeds. Under SwiGLU it runs."""
    built = []

    def swiglu_only(problem, options):
        built.append(options.get("activation"))
        return ExpertsCase("swiglu_only", problem, baselines.experts_loop)

    monkeypatch.setitem(REGISTRY, "swiglu_only", BaselineSpec("swiglu_only", swiglu_only, "test", default=False))
    rc, doc = _run(tmp_path, "--preset", "tiny", "--backends", "torch,swiglu_only", "--no-router-variant",
                   "--activation", "clamped_swiglu")
    assert rc == 0 and built == []
    row = doc["results"][0]["backends"]["swiglu_only"]
    assert row["status"] == "skipped" and row["fwd"] is None and row["check"] is None
    assert "takes only swiglu, not --activation clamped_swiglu" in row["message"]
    out = capsys.readouterr().out  # -q: no progress lines; the table's notes and the note on the activation
    assert "backends that take only SwiGLU are skipped" in out
    assert "tiny [topk] swiglu_only: skipped: takes only swiglu, not --activation clamped_swiglu" in out
    rc, doc = _run(tmp_path / "swiglu", "--preset", "tiny", "--backends", "swiglu_only", "--no-router-variant")
    assert rc == 0 and built == ["swiglu"] and doc["results"][0]["backends"]["swiglu_only"]["status"] == "ok"


def test_bench_rejects_an_unknown_activation(tmp_path, capsys):
    assert cli.main(["--out", str(tmp_path), *FAST, "--preset", "tiny", "--activation", "gelu"]) == 2
    err = capsys.readouterr().err
    assert "argument --activation: invalid choice: 'gelu'" in err and "clamped_swiglu" in err
    assert not list(tmp_path.glob("*.json"))


def test_markdown_and_plot_title_name_a_clamped_run():
    """The README table of a clamped run says so above the table and in its footnote; a SwiGLU run's (and an old
    file's, whose records have no activation) has no such line."""
    from sonicmoe.bench.plots import _title

    doc = _synthetic_doc()
    plain = report.markdown_table(doc)
    assert "ctivation" not in plain and "activation" not in _title(doc)
    for rec in doc["results"]:
        rec["activation"] = "clamped_swiglu"
    md = report.markdown_table(doc)
    assert md.splitlines()[0].startswith("Activation: clamped_swiglu")
    assert md.splitlines()[-1].endswith("Activation: clamped_swiglu.")
    assert [ln for ln in md.splitlines() if ln.startswith("|")] == [ln for ln in plain.splitlines()
                                                                  if ln.startswith("|")]
    assert "activation clamped_swiglu" in _title(doc)


@pytest.mark.interpreter
def test_bench_triton_kernels_take_the_clamped_activation():
    """Ours through Triton's interpreter with the clamped activation, W1 scaled so that some of H passes the clamps:
    the bench's check (O and the grads of x, W1, W2, S) passes against the clamped float32 reference, and O differs
    from the SwiGLU case's."""
    from sonicmoe.bench.measure import check_case
    from sonicmoe.reference import split_gate_up

    if not torch.cuda.is_available() and not interpreting():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    p = make_problem(Shape("act", 32, 32, 16, 4, 2), dtype=torch.float32, device=dev, seed=1)
    with torch.no_grad():
        p.w1.mul_(8.0)
        g, u = split_gate_up(p.x @ p.w1[0].t())
        assert bool((g > 7).any()) and bool((u.abs() > 7).any())  # the clamps bind somewhere
    clamped = REGISTRY["triton"].factory(p, {"activation": "clamped_swiglu"})
    res = check_case(clamped, p.dout, grads=True, tol=2e-3, poison=False)
    assert res["passed"] and max(res["errors"].values()) < 1e-4, res
    assert clamped.ref_spec().activation == "clamped_swiglu"
    with torch.no_grad():
        a = clamped.forward()
        b = REGISTRY["triton"].factory(p, {}).forward()
    assert (a - b).norm() > 0.1 * b.norm()


def _graph_nodes(root) -> list[str]:
    """The names of every autograd node under ``root`` (each once)."""
    seen, stack, names = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return names


@pytest.mark.parametrize("baseline", ["torch_backend", "loop"])
def test_per_expert_loops_take_each_weight_by_one_unbind(baseline):
    """The torch backend's per-expert path and the bench's loop baseline take the experts' weights apart with one
    unbind (as an HF model's separate expert modules hold them), not ``w[e]`` per expert: each ``w[e]``'s backward
    builds a zero-filled gradient of all of W, E² work in all (at E = 128 the backward ran 57× slower); and the
    gradients equal the float32 per-expert reference."""
    import sonicmoe
    from sonicmoe.routing import routing_from_topk
    from sonicmoe.testing import rel_err

    t, d, n, e, k = 13, 16, 8, 6, 2
    g = torch.Generator().manual_seed(41)
    x, w1, w2 = (torch.randn(*s, generator=g).requires_grad_(True) for s in ((t, d), (e, 2 * n, d), (e, d, n)))
    routing = routing_from_topk(torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]), e)
    s = torch.rand(t * k, generator=g).requires_grad_(True)
    if baseline == "loop":
        out = baselines.experts_loop(x, w1, w2, routing, s)
    else:
        out = sonicmoe.experts(x, w1, w2, routing, s, backend="torch")
    names = _graph_nodes(out.grad_fn)
    assert "SelectBackward0" not in names and names.count("UnbindBackward0") == 2, sorted(set(names))
    dout = torch.randn(t, d, generator=g)
    grads = torch.autograd.grad(out, (x, w1, w2, s), dout)
    ref = sonicmoe.experts_ref(x, w1, w2, routing, s)
    for got, want in zip(grads, torch.autograd.grad(ref, (x, w1, w2, s), dout)):
        assert rel_err(got, want) < 1e-5


def test_bench_cli_interrupt_saves_partial_results_and_restores_threads(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the run: exit 130 (a shell's code for SIGINT, not 1: nothing FAILed), the results file marked
    interrupted, torch's thread count put back after the run's ``--cpu-threads``; ``--loop-max-E 0`` reaches the
    run as no limit (None), not as a limit of 0 experts."""
    from sonicmoe.bench import runner

    seen = []

    def interrupted(shapes, opts, log=None, records=None, on_record=None):
        seen.append((torch.get_num_threads(), opts.loop_max_E))
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run", interrupted)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rc = cli.main(["--out", str(tmp_path / "res"), *FAST, "--preset", "tiny", "--cpu-threads", "1",
                       "--loop-max-E", "0"])
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert rc == 130 and seen == [(1, None)] and after == 2
    doc = _strict_load(_only_json(tmp_path / "res"))
    assert doc["interrupted"] is True and doc["results"] == []
    assert "interrupted; partial results in" in capsys.readouterr().err


def test_bench_exits_1_when_a_shape_errors(tmp_path, monkeypatch, capsys):
    """A shape whose problem could not be made (its record's own status "error", no backend row) fails the run
    (exit 1, named in the "not ok" line) even where another shape timed fine."""
    from sonicmoe.bench import runner

    real = runner.make_problem

    def make(shape, **kwargs):
        if shape.name == "bad":
            raise RuntimeError("no problem for this one")
        return real(shape, **kwargs)

    monkeypatch.setattr(runner, "make_problem", make)
    rc, doc = _run(tmp_path, "--shape", "bad=16,8,8,2,1", "--shape", "16,8,8,2,1", "--backends", "torch",
                   "--no-router-variant", "--mode", "fwd")
    assert [r.get("status") for r in doc["results"]] == ["error", "ok"]
    assert doc["results"][1]["backends"]["torch"]["status"] == "ok"
    assert rc == 1 and "not ok: bad - error" in capsys.readouterr().err


def test_bench_cli_device_cuda_without_gpu_routing_list_and_cpu_threads(tmp_path, monkeypatch, capsys):
    """--device cuda on a machine without a GPU: exit 2 naming it, before anything runs; --routing takes a comma
    list with blanks and a trailing comma (the empty items dropped, the order kept); --cpu-threads 0 keeps torch's
    thread count during the run (1 sets it, and it is put back after)."""
    from sonicmoe.bench import runner

    seen = []
    monkeypatch.setattr(runner, "run", lambda shapes, opts, **kw: seen.append((opts.routings, torch.get_num_threads())))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["--out", str(tmp_path / "a"), *FAST[:-2], "--device", "cuda", "--preset", "tiny"]) == 2
    assert "--device cuda but no CUDA GPU" in capsys.readouterr().err and not seen
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for threads in ("0", "1"):
            cli.main(["--out", str(tmp_path / threads), *FAST, "--preset", "tiny", "--cpu-threads", threads,
                      "--routing", " token_rounding, ,topk,"])
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert seen == [(("token_rounding", "topk"), 2), (("token_rounding", "topk"), 1)] and after == 2


def test_bench_cli_passes_its_options_to_the_run(tmp_path, monkeypatch, capsys):
    """What the command line hands the run: without --preset or --shape the tiny shape on a CPU (not the 7B one),
    with --shape that shape alone; fp32 by default on a CPU (recorded so in the results file's args); --rounding,
    --seed, --no-check-grads (apart from --check) and -q (verbose off) reach RunOptions as given."""
    from sonicmoe.bench import runner

    seen = []
    monkeypatch.setattr(runner, "run", lambda shapes, opts, **kw: seen.append(([s.dims for s in shapes], opts)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["--out", str(tmp_path / "a"), *FAST]) == 1  # nothing was timed: the run is a stub
    (dims, opts), = seen
    assert dims == [(64, 32, 16, 4, 2)] and opts.dtype == torch.float32 and opts.device == torch.device("cpu")
    assert (opts.rounding, opts.seed, opts.check, opts.check_grads, opts.verbose) == ("nearest", 0, True, True, False)
    assert _strict_load(_only_json(tmp_path / "a"))["args"]["dtype"] == "fp32"
    seen.clear()
    assert cli.main(["--out", str(tmp_path / "b"), *FAST[:-3], "--device", "cpu", "--shape", "96,48,16,12,3",
                     "--rounding", "balance", "--seed", "7", "--no-check-grads"]) == 1
    (dims, opts), = seen
    assert dims == [(96, 48, 16, 12, 3)]
    assert (opts.rounding, opts.seed, opts.check, opts.check_grads, opts.verbose) == ("balance", 7, True, False, True)
    capsys.readouterr()


def test_bench_cli_defaults_are_the_documented_ones():
    """The defaults the help text states: --m-tile 128, --cpu-threads 1, the loop baseline up to E = 128, fwdbwd,
    seed 0, nearest rounding, SwiGLU, device auto, every routing unset (the shape's own)."""
    parser = cli.build_parser()
    args = parser.parse_args([])
    assert (args.m_tile, args.cpu_threads, args.loop_max_E) == (128, 1, 128)
    assert (args.mode, args.seed, args.rounding, args.activation, args.device) == (
        "fwdbwd", 0, "nearest", "swiglu", "auto")
    assert args.routing is None and args.backends == "default" and args.plot and args.check and args.router_variant
    helps = {a.dest: a.help for a in parser._actions}
    assert "(default 128)" in helps["m_tile"] and "(default 1:" in helps["cpu_threads"]


def test_bench_cli_plots_only_without_no_plot_and_runs_presets_before_shapes(tmp_path, monkeypatch, capsys):
    """--no-plot writes no plot (plot_from_file never called); without it the results file is plotted once, next
    to itself; the shapes run in the order given: the presets' then the --shape ones."""
    from sonicmoe.bench import plots, runner

    seen, plotted = [], []
    monkeypatch.setattr(runner, "run", lambda shapes, opts, **kw: seen.append([s.name for s in shapes]))
    monkeypatch.setattr(plots, "plot_from_file", lambda path, out=None, **kw: plotted.append((path, out)) or [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["--shape", "mine=16,8,8,2,1", "--preset", "tiny"]
    assert cli.main(["--out", str(tmp_path / "a"), *FAST, *args]) == 1  # the stub timed nothing
    assert plotted == [] and seen == [["tiny", "mine"]]
    fast_plotting = [a for a in FAST if a != "--no-plot"]
    assert cli.main(["--out", str(tmp_path / "b"), *fast_plotting, *args]) == 1
    assert plotted == [(str(_only_json(tmp_path / "b")), None)]
    capsys.readouterr()


def test_bench_list_shows_each_preset_with_its_shapes_and_which_libraries_are_installed(monkeypatch, capsys):
    """--list prints each preset's shapes under it, ``all`` without repeating them; a competitor library is marked
    [installed] exactly when it can be found."""
    libraries = [n for n, spec in REGISTRY.items() if spec.kind == "library"]
    assert libraries
    monkeypatch.setattr(baselines, "library_installed", lambda name: name == libraries[0])
    assert cli.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for shape in PRESETS["all"]:
        assert sum(1 for ln in lines if ln.split()[:1] == [shape.name]) >= 1, shape.name
    assert sum(1 for ln in lines if ln.split()[:1] == ["deepseek-v3"]) == 1
    assert sum(1 for ln in lines if ln.split()[:1] == ["tiny"]) == 2  # the preset's line and its one shape
    for name in libraries:
        (line,) = [ln for ln in lines if ln.split()[:1] == [name]]
        assert line.endswith(" [installed]" if name == libraries[0] else " [not installed]"), line


def test_bench_cli_plot_from_without_plots_exits_1(tmp_path, monkeypatch, capsys):
    """--plot-from that writes no PNG (matplotlib missing): exit 1 with the reason, not 0."""
    from sonicmoe.bench import plots

    monkeypatch.setattr(plots, "_setup", lambda: None)
    path = report.write_results(_synthetic_doc(), tmp_path / "r.json")
    assert cli.main(["--plot-from", str(path)]) == 1
    assert "matplotlib is not installed" in capsys.readouterr().out and not list(tmp_path.glob("*.png"))


def test_out_that_cannot_be_written_is_refused_before_any_shape_runs(tmp_path, monkeypatch, capsys):
    """--out naming a file (or an unwritable place): exit 2 with a message naming --out, before the first shape runs
    (it used to run the shape, then fail with a FileExistsError traceback when saving)."""
    ran = []
    monkeypatch.setattr("sonicmoe.bench.runner.run", lambda *a, **k: ran.append(1))
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert cli.main(["--out", str(not_a_dir), *FAST]) == 2
    assert not ran and "--out" in capsys.readouterr().err


def test_plot_train_takes_ylim_and_refuses_an_unlabelled_run(tmp_path, monkeypatch, capsys):
    """benchmarks/plot_train.py: --ylim LO,HI (its usage text names it) sets the loss axis; a run without LABEL=, a
    malformed or inverted --ylim, a missing or unreadable log (a checkpoint given by mistake) and a missing output
    folder are usage errors (exit 2), not tracebacks (the last three since session 89)."""
    pytest.importorskip("matplotlib")
    log = REPO / "benchmarks" / "results" / "2026-11-21_nvidia-h200_train" / "log.json"
    script = str(REPO / "benchmarks" / "plot_train.py")
    out = tmp_path / "loss.png"
    from sonicmoe.train import report as train_report

    seen = []
    real = train_report.plot_runs
    monkeypatch.setattr(train_report, "plot_runs", lambda *a, **k: seen.append(k.get("ylim")) or real(*a, **k))
    monkeypatch.setattr(sys, "argv", [script, str(out), f"h200={log}", "--ylim", "1,6"])
    runpy.run_path(script, run_name="__main__")
    assert seen == [(1.0, 6.0)] and out.stat().st_size > 0
    import matplotlib.pyplot as plt

    limits, real_savefig = [], plt.Figure.savefig
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: (limits.append(fig.axes[0].get_ylim()),
                                                                      real_savefig(fig, *a, **k)))
    train_report.plot_runs(tmp_path / "y.png", [("a", [{"step": 1, "loss": 3.0}], [])], "t", ylim=(1.0, 6.0))
    assert limits == [(1.0, 6.0)]
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"PK\x03\x04\xff\xfe not json")
    for bad, msg in (([str(log)], "expected LABEL=RUN/log.json"), ([f"h200={log}", "--ylim", "1"], "two numbers"),
                     ([f"h200={log}", "--ylim", "3,1"], "LO must be below HI"),
                     ([f"a={tmp_path / 'none.json'}"], "not a sonicmoe train log.json"),
                     ([f"a={ckpt}"], "not a sonicmoe train log.json")):
        monkeypatch.setattr(sys, "argv", [script, str(tmp_path / "x.png"), *bad])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(script, run_name="__main__")
        assert exit_info.value.code == 2 and msg in capsys.readouterr().err, bad
    monkeypatch.setattr(sys, "argv", [script, str(tmp_path / "no" / "x.png"), f"h200={log}"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(script, run_name="__main__")
    assert exit_info.value.code == 2 and "its folder does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("commit_env", [None, "abc123"])
def test_git_dirty_unknown_without_git_tree(commit_env, monkeypatch):
    """A tree without ``.git`` (a copy on a GPU machine): git fails, so whether it is dirty is unknown (None), also
    with SONICMOE_GIT_COMMIT naming its commit; a checkout's clean and dirty states read False and True."""
    from sonicmoe import provenance

    outputs = {"rev-parse": (0, "0123abc\n"), "status": (0, "")}

    def fake_run(cmd, **kwargs):
        rc, out = outputs[cmd[3]]
        return SimpleNamespace(returncode=rc, stdout=out, stderr="")

    monkeypatch.setattr(provenance.shutil, "which", lambda name: "/usr/bin/git")
    monkeypatch.setattr(provenance.subprocess, "run", fake_run)
    if commit_env is None:
        monkeypatch.delenv("SONICMOE_GIT_COMMIT", raising=False)
    else:
        monkeypatch.setenv("SONICMOE_GIT_COMMIT", commit_env)
    assert provenance.git_dirty() is False  # a clean checkout
    assert provenance.git_commit() == (commit_env or "0123abc")  # SONICMOE_GIT_COMMIT, where set, over HEAD
    outputs["status"] = (0, " M sonicmoe/routing.py\n")
    assert provenance.git_dirty() is True
    outputs["status"] = outputs["rev-parse"] = (128, "")  # fatal: not a git repository
    assert provenance.git_dirty() is None
    assert provenance.git_commit() == commit_env


def test_git_commit_of_an_empty_answer_is_unknown(monkeypatch):
    """git answering with nothing (exit 0, empty output) names no commit: None, not an empty string."""
    from sonicmoe import provenance

    monkeypatch.delenv("SONICMOE_GIT_COMMIT", raising=False)
    monkeypatch.setattr(provenance.shutil, "which", lambda name: "/usr/bin/git")
    monkeypatch.setattr(provenance.subprocess, "run",
                        lambda cmd, **kw: SimpleNamespace(returncode=0, stdout="\n", stderr=""))
    assert provenance.git_commit() is None


def test_git_commit_of_an_empty_sonicmoe_git_commit_is_head(monkeypatch):
    """SONICMOE_GIT_COMMIT exported empty (``SONICMOE_GIT_COMMIT=$UNSET_VAR``) names no commit: HEAD is read, not an
    empty string written into a results file as the commit."""
    from sonicmoe import provenance

    monkeypatch.setenv("SONICMOE_GIT_COMMIT", "")
    monkeypatch.setattr(provenance.shutil, "which", lambda name: "/usr/bin/git")
    monkeypatch.setattr(provenance.subprocess, "run",
                        lambda cmd, **kw: SimpleNamespace(returncode=0, stdout="89abcdef\n", stderr=""))
    assert provenance.git_commit() == "89abcdef"


def test_git_that_hangs_or_cannot_start_is_unknown(monkeypatch):
    """git that runs past its 10 s timeout (a network file system, a lock) or cannot be started: commit and dirty
    state unknown (None), not an exception out of a results writer."""
    import subprocess

    from sonicmoe import provenance

    monkeypatch.delenv("SONICMOE_GIT_COMMIT", raising=False)
    monkeypatch.setattr(provenance.shutil, "which", lambda name: "/usr/bin/git")
    for exc in (subprocess.TimeoutExpired(["git"], 10), PermissionError(13, "Permission denied")):
        def hang(cmd, exc=exc, **kwargs):
            assert kwargs["timeout"] == 10
            raise exc

        monkeypatch.setattr(provenance.subprocess, "run", hang)
        assert provenance.git_commit() is None and provenance.git_dirty() is None, exc


def test_git_provenance_of_a_real_checkout(tmp_path, monkeypatch):
    """sonicmoe.provenance in a git checkout of its own (the module copied into a fresh repository): HEAD's commit,
    clean with an untracked file beside it (a results file or a scratch script is no change to the code), dirty
    once a tracked file changes; without a git executable both are unknown (None), not a clean tree."""
    import importlib.util
    import shutil
    import subprocess

    from sonicmoe import provenance

    if shutil.which("git") is None:
        pytest.skip("no git executable")
    monkeypatch.delenv("SONICMOE_GIT_COMMIT", raising=False)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    shutil.copy2(provenance.__file__, pkg / "provenance.py")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t",
                               "-c", "commit.gpgsign=false", *args],
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    git("add", "pkg/provenance.py")
    git("commit", "-q", "-m", "one")
    spec = importlib.util.spec_from_file_location("provenance_copy", pkg / "provenance.py")
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    assert copy.git_commit() == git("rev-parse", "HEAD") and len(copy.git_commit()) == 40
    assert copy.git_dirty() is False
    (pkg / "results.json").write_text("{}")  # untracked
    assert copy.git_dirty() is False
    with open(pkg / "provenance.py", "a") as f:
        f.write("# changed\n")
    assert copy.git_dirty() is True
    monkeypatch.setattr(copy.shutil, "which", lambda name: None)
    assert copy.git_dirty() is None and copy.git_commit() is None


# ---------------------------------------------------------------------------------------------------
# the benchmark scripts' figures (benchmarks/, scripts/)


def test_kernel_breakdown_times_the_training_forward(monkeypatch):
    """benchmarks/kernel_breakdown.py's "layer ... fwd" rows (and energy_probe's, which reuses them) time the training
    forward, as ``sonicmoe bench`` and the kernel rows do: leaves that require grad, so the layer writes and keeps H.
    Without grad the Triton layer takes its inference path (no H store) and its forward reads fast."""
    import sonicmoe

    kb = runpy.run_path(str(REPO / "benchmarks" / "kernel_breakdown.py"))
    from sonicmoe.testing import random_problem

    p = random_problem(32, 16, 8, 4, seed=0)
    router = sonicmoe.router_topk(p["x"], p["router_weight"], 2)
    routing, s_pair = sonicmoe.routing_from_topk(router.topk_ids, 4), router.topk_scores.reshape(-1).detach()
    rows = kb["layer_rows"](p, routing, s_pair, torch.randn(32, 16), ("torch",))
    recorded = []
    experts = sonicmoe.experts

    def spy(*args, **kw):
        out = experts(*args, **kw)
        recorded.append(torch.is_grad_enabled() and out.requires_grad)
        return out

    monkeypatch.setattr(sonicmoe, "experts", spy)
    for name, fn, flops, _ in rows:
        fn()
        assert flops == (18 if "fwd+bwd" in name else 6) * routing.num_rows * 8 * 16
    assert [name for name, *_ in rows] == ["layer torch fwd", "layer torch fwd+bwd"]
    assert recorded == [True, True]


def test_every_script_timing_is_a_median():
    """SPEC §7 times with do_bench's median; triton's do_bench and do_bench_cudagraph return the mean unless asked.
    Every call in benchmarks/, scripts/ and sonicmoe/ asks for the median (``return_mode="median"``) or quantiles."""
    import ast

    calls, wrong = 0, []
    for path in sorted([*(REPO / "benchmarks").glob("*.py"), *(REPO / "scripts").glob("*.py"),
                        *(REPO / "sonicmoe").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name not in ("do_bench", "do_bench_cudagraph"):
                continue
            calls += 1
            kw = {k.arg: k.value for k in node.keywords}
            mode = kw.get("return_mode")
            if "quantiles" not in kw and not (isinstance(mode, ast.Constant) and mode.value == "median"):
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert calls >= 20 and not wrong, wrong


def test_router_orders_and_shared_expert_bench_fail_over_the_bench_bound(monkeypatch, capsys):
    """benchmarks/router_orders.py and scripts/shared_expert_bench.py exit with status 1 (after the table) when an
    error against the float32 reference is over ``sonicmoe bench``'s bf16 bound (default_tol: 2e-2, norm-wise, not
    the local factor's 0.2) or NaN, naming each; 0 when all are within it. Before, they only printed the errors."""
    import importlib.util
    import math

    from sonicmoe.bench.measure import default_tol

    tol = default_tol(torch.bfloat16)
    ro = runpy.run_path(str(REPO / "benchmarks" / "router_orders.py"))
    errs = {"ok": 3.8e-3, "at_bound": tol, "over": 0.05, "nan": math.nan}
    results = [{"shape": [64, 16, 8, 4, 2], "orders": {name: {"check_rel_err": v} for name, v in errs.items()}}]
    failed = ro["check_failures"](results, tol)
    assert len(failed) == 2 and "(64, 16, 8, 4, 2) over: check rel err 5.00e-02" in failed[0] and "nan" in failed[1]
    assert ro["check_failures"](results[:0], tol) == []

    spec = importlib.util.spec_from_file_location("shared_expert_bench", REPO / "scripts" / "shared_expert_bench.py")
    seb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seb)
    row = {**{f"layer_{v}_ms": 1.0 for v in ("plain", "shared", "shared_gated")},
           **{f"shared_{v}_{key}": 1.0 for v in ("ours", "torch") for key in ("ms", "tflops", "held_bytes")},
           "shared_rel_err_vs_torch": 3.6e-3}
    monkeypatch.setattr(seb, "run_shape", lambda s: {**row, "shape": s, "shared_rel_err": errs[s]})
    for shapes, code in ((["ok", "at_bound"], 0), (["ok", "over", "nan"], 1)):
        monkeypatch.setattr(sys, "argv", ["shared_expert_bench.py", "--shape", *shapes])
        assert seb.main() == code, shapes
        out, err = capsys.readouterr()
        assert all(f"{s} |" in out for s in shapes), out  # the table is printed either way
        assert [line.split(":")[1] for line in err.splitlines()] == [" over", " nan"][:2 * code], err


def test_router_orders_counts_the_pairs_token_rounding_routed():
    """benchmarks/router_orders.py --routing token_rounding: TFLOP/s at 18·TK·n·d with TK the pairs the layer routed
    (SPEC §1: the rounded count, as ``sonicmoe bench`` counts R), not T·K; under top-k the two agree."""
    from sonicmoe import MoE

    ro = runpy.run_path(str(REPO / "benchmarks" / "router_orders.py"))
    t, d, n, e, k = 100, 16, 8, 4, 2  # 50 pairs per expert on average: M_tile 16 rounds each to 48 or 64
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(0))
    for routing in ("token_rounding", "topk"):
        torch.manual_seed(0)
        m = MoE(d, n, e, k, backend="torch", routing=routing, m_tile=16, aux_loss_coef=0.0)
        m(x)
        pairs = ro["routed_pairs"](m)
        assert (pairs == t * k) == (routing == "topk") and pairs % (16 if routing != "topk" else 1) == 0
        row = {"orders": {"o": {"pairs": pairs, **{key: [] for key in ro["SERIES"]}}}}
        row["orders"]["o"]["layer_ms"] = [2.0, 1.0, 3.0]
        ro["summarise"](row, (t, d, n, e, k), False)
        v = row["orders"]["o"]
        assert v["useful_flops"] == 18 * pairs * n * d
        assert v["tflops"] == pytest.approx(18 * pairs * n * d / 2.0e-3 / 1e12)


def test_run_options_reach_the_check_and_the_record(tmp_path):
    """--check-max-T checks the first N tokens (the smallest of it, T and the backend's own limit), --tol is the
    check's bound, --no-check-grads compares the output only (mutation probe: bx5_runner_*); the record's
    tokens-per-expert mean is TK / E and its padded_rows every expert's count rounded up to M_tile; its dtype is
    torch's name without "torch." and spec_held_bytes is X (T·d) and H (TK·2n) in that dtype."""
    import math as _math

    rc, doc = _run(tmp_path, "--preset", "tiny", "--backends", "torch", "--no-router-variant", "--check-max-T", "16",
                   "--tol", "0.25", "--no-check-grads")
    assert rc == 0
    (rec,) = doc["results"]
    chk = rec["backends"]["torch"]["check"]
    assert chk["T"] == 16 and chk["pairs"] == 16 * 2 and chk["tol"] == 0.25
    assert set(chk["errors"]) == {"out", "out_rows"}
    p = make_problem(Shape("tiny", 64, 32, 16, 4, 2), dtype=torch.float32, device="cpu", seed=0)
    counts = p.routing.expert_counts().tolist()
    assert rec["tokens_per_expert"] == {"min": min(counts), "mean": 128 / 4, "max": max(counts)}
    assert rec["m_tile"] == 128 and rec["padded_rows"] == sum(_math.ceil(c / 128) * 128 for c in counts) > 128
    assert rec["dtype"] == "float32" and rec["spec_held_bytes"] == 4 * (64 * 32 + 128 * 2 * 16)


def _fake_gpu_watch(last):
    """A stand-in for bench.gpu_state.GpuWatch: a context manager whose ``last(seconds)`` returns ``last(seconds)``."""

    class Watch:
        def __init__(self, device, nvml=None):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def last(self, seconds):
            return last(seconds)

    return Watch


def test_timed_phase_reads_the_gpu_over_its_timing_window(monkeypatch):
    """_timed: the GPU state over the last rep milliseconds of the watch (rep is in ms, GpuWatch.last takes
    seconds), TFLOP/s from the median."""
    from sonicmoe.bench import runner

    seen = []

    def last(seconds):
        seen.append(seconds)
        return {"sm_mhz": 1600.0}

    monkeypatch.setattr(runner, "GpuWatch", _fake_gpu_watch(last))
    monkeypatch.setattr(runner, "bench_ms", lambda fn, **kw: {"p20": 1.0, "p50": 2.0, "p80": 3.0})
    opts = runner.RunOptions(backends=[], device=torch.device("cpu"), dtype=torch.float32, warmup=0.0, rep=250.0)
    phase = runner._timed(lambda: None, [], 4 * 10**12, opts, torch.device("cpu"), None)
    assert seen == [0.25]
    assert phase == {"ms": {"p20": 1.0, "p50": 2.0, "p80": 3.0}, "tflops": pytest.approx(2000.0),
                     "gpu": {"sm_mhz": 1600.0}}


def test_open_nvml_never_reads_a_board_for_a_cpu_device(monkeypatch):
    """A CPU device gets no NVML handle even on a machine where NVML opens (it would report some GPU's clock beside
    a CPU timing); a CUDA device or an index gets one, and a failing NVML gives None."""
    from sonicmoe.bench import gpu_state

    monkeypatch.setattr(gpu_state, "Nvml", lambda device: ("board", device))
    assert gpu_state.open_nvml(torch.device("cpu")) is None
    assert gpu_state.open_nvml(torch.device("meta")) is None  # any device but CUDA: not only the CPU
    assert gpu_state.open_nvml(torch.device("cuda", 1)) == ("board", torch.device("cuda", 1))
    assert gpu_state.open_nvml(0) == ("board", 0)

    def broken(device):
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(gpu_state, "Nvml", broken)
    assert gpu_state.open_nvml(torch.device("cuda")) is None

    def no_symbol(device):  # a driver's NVML without a symbol ctypes looks up
        raise AttributeError("undefined symbol: nvmlDeviceGetHandleByPciBusId_v2")

    monkeypatch.setattr(gpu_state, "Nvml", no_symbol)
    assert gpu_state.open_nvml(torch.device("cuda")) is None


class _FakeNvmlLib:
    """libnvidia-ml.so.1 as ctypes sees it, on a machine of ``boards`` boards: each call answers through its
    ``byref`` arguments and returns NVML's status (0 success), and is recorded in :attr:`calls`."""

    def __init__(self, boards=4, pci_ok=True, energy_ok=True):
        self.boards, self.pci_ok, self.energy_ok = boards, pci_ok, energy_ok
        self.calls = []

    def nvmlInit_v2(self):
        return 0

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus, ref):
        self.calls.append(("pci", bus.value))
        if not self.pci_ok:
            return 2
        ref._obj.value = 0x700
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, ref):
        self.calls.append(("index", index.value))
        if index.value >= self.boards:
            return 2
        ref._obj.value = 0x100 + index.value
        return 0

    def nvmlDeviceGetClockInfo(self, handle, kind, ref):
        self.calls.append(("clock", handle.value, kind.value))
        ref._obj.value = {0: 1410, 1: 1980}[kind.value]  # NVML_CLOCK_GRAPHICS, NVML_CLOCK_SM
        return 0

    def nvmlDeviceGetTemperature(self, handle, kind, ref):
        ref._obj.value = {0: 65}[kind.value]  # NVML_TEMPERATURE_GPU
        return 0

    def nvmlDeviceGetTotalEnergyConsumption(self, handle, ref):
        if not self.energy_ok:
            return 3  # NVML_ERROR_NOT_SUPPORTED
        ref._obj.value = 12_345_678_901_234  # past 2**32: a 64-bit counter
        return 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle, ref):
        ref._obj.value = 0x4
        return 0

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle, ref):
        ref._obj.value = 0x8
        return 0


def test_nvml_handle_picks_the_device_board(monkeypatch):
    """Nvml on a stand-in NVML library: the board of the CUDA device named (an index, a device's index, else the
    current device) found by its PCI bus id (8-4-2 hex digits, zero-padded) and, where that fails, by index (never
    both); an SM clock (not the graphics clock), the 64-bit energy counter (a failing read raises), the newer
    clock-event reasons where the driver has them, the throttle reasons where not."""
    import ctypes

    from sonicmoe.bench import gpu_state

    lib = _FakeNvmlLib()
    props_of = []

    def props(index):
        props_of.append(index)
        return SimpleNamespace(pci_domain_id=0, pci_bus_id=5 + index, pci_device_id=0)

    monkeypatch.setattr(ctypes, "CDLL", lambda name: lib)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    for device, index in ((3, 3), (torch.device("cuda", 1), 1), (torch.device("cuda"), 2), (None, 2)):
        lib.calls.clear()
        nv = gpu_state.Nvml(device)
        assert props_of[-1] == index, device
        assert lib.calls == [("pci", f"00000000:{5 + index:02x}:00.0".encode())], device  # no index lookup
        assert nv.handle.value == 0x700
    assert lib.calls[0][1] == b"00000000:07:00.0"
    lib.calls.clear()
    assert (nv.sm_mhz(), nv.temperature_c(), nv.energy_mj(), nv.clock_reasons()) == (1980, 65, 12_345_678_901_234,
                                                                                   0x4)
    assert lib.calls == [("clock", 0x700, 1)]
    # the PCI lookup fails: the board of that index; no board there: an error naming the device
    lib.pci_ok = False
    lib.calls.clear()
    assert gpu_state.Nvml(3).handle.value == 0x103 and lib.calls[1] == ("index", 3)
    lib.boards = 3
    with pytest.raises(RuntimeError, match="no NVML handle for CUDA device 3"):
        gpu_state.Nvml(3)
    # an older driver: throttle reasons; a board without an energy counter: RuntimeError, and no sample
    old = _FakeNvmlLib(energy_ok=False)
    old.nvmlDeviceGetCurrentClocksEventReasons = None
    monkeypatch.setattr(ctypes, "CDLL", lambda name: old)
    nv = gpu_state.Nvml(0)
    assert nv.clock_reasons() == 0x8
    with pytest.raises(RuntimeError, match="nvmlDeviceGetTotalEnergyConsumption failed"):
        nv.energy_mj()


def test_gpu_watch_sampling_loop_waits_its_period_and_stops_on_a_failed_read():
    """GpuWatch._run (on this thread): one sample, then a wait of ``period`` s, until the stop event is set; a read
    that fails (no energy counter) ends the sampling quietly with the samples taken so far."""
    from sonicmoe.bench.gpu_state import GpuWatch

    class Stop:
        def __init__(self, after):
            self.waits, self.after = [], after

        def wait(self, timeout):
            self.waits.append(timeout)
            return len(self.waits) >= self.after

    watch = GpuWatch(nvml=_FakeNvml(), period=0.125)
    watch._stop = Stop(3)
    watch._run()
    assert watch._stop.waits == [0.125] * 3 and len(watch.samples) == 3
    assert [s[1] for s in watch.samples] == [1500, 1700, 1500]

    class Failing(_FakeNvml):
        def energy_mj(self):
            if self.calls > 2:
                raise RuntimeError("nvmlDeviceGetTotalEnergyConsumption failed")
            return super().energy_mj()

    watch = GpuWatch(nvml=Failing(), period=0.125)
    watch._stop = Stop(10)
    watch._run()
    assert len(watch.samples) == 2 and watch._stop.waits == [0.125] * 2


def test_fwdbwd_call_resets_the_gradients_first():
    """fwdbwd_fn: each call sets the leaves' gradients to None before its backward, so that timed calls do not add
    gradients up (an accumulating backward runs an extra add per leaf)."""
    from sonicmoe.bench.measure import fwdbwd_fn

    g = torch.Generator().manual_seed(11)
    w = torch.randn(5, 3, generator=g, dtype=torch.float64).requires_grad_()
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    dout = torch.randn(4, 3, generator=g, dtype=torch.float64)
    run = fwdbwd_fn(lambda: x @ w, [w], dout)
    run()
    run()
    torch.testing.assert_close(w.grad, x.t() @ dout, rtol=1e-12, atol=1e-12)


def test_host_out_of_memory_is_an_oom_row(tmp_path, monkeypatch):
    """A backend that runs out of host memory (MemoryError, as a CPU run does) gets an "oom" row with the step and
    the message; the run goes on."""

    def factory(problem, options):
        raise MemoryError("cannot allocate 64 GiB")

    monkeypatch.setitem(REGISTRY, "torch", BaselineSpec("torch", factory, "stub", kind="baseline"))
    _, doc = _run(tmp_path, "--preset", "tiny", "--backends", "torch,upper", "--no-router-variant")
    rows = doc["results"][0]["backends"]
    assert rows["torch"]["status"] == "oom"
    assert rows["torch"]["message"] == "setup: MemoryError: cannot allocate 64 GiB"
    assert rows["upper"]["status"] == "ok"


def test_plots_name_each_backend_once_and_sort_sweeps_by_g():
    """_backend_names: every backend once, in first-seen order (one line per backend, not one per record that has
    it); granularity_groups sorts a sweep by G whatever the order of the records."""
    from sonicmoe.bench.plots import _backend_names, granularity_groups

    recs = [{"backends": {"torch": {}, "triton": {}}}, {"backends": {"triton": {}, "upper": {}}}, {"backends": None}]
    assert _backend_names(recs) == ["torch", "triton", "upper"]
    sweep = [{"group": "7B", "T": 8, "d": 64, "n": 64 // g, "G": float(g), "routing": "topk",
              "backends": {"triton": {}}} for g in (4, 1, 2)]
    assert [r["G"] for r in granularity_groups(sweep)["7B"]] == [1.0, 2.0, 4.0]


def test_token_rounding_plot_draws_only_our_timings(tmp_path):
    """The token-rounding chart plots ours (the triton row) only: records with torch's timings alone draw nothing,
    never torch's times as ours."""
    pytest.importorskip("matplotlib")
    from sonicmoe.bench.plots import _plot_token_rounding, _setup

    plt = _setup()
    row = {"status": "ok", "fwd": {"ms": {"p50": 1.0}}, "total": {"ms": {"p50": 3.0}}}
    recs = [{"group": "tr", "E": e, "routing": m, "backends": {"torch": row}}
            for e in (8, 16) for m in ("topk", "token_rounding")]
    doc = {"env": {}, "date": "2026-01-02", "results": recs}
    assert _plot_token_rounding(plt, doc, recs, tmp_path / "a.png") is None
    ours = [dict(r, backends={"torch": row, "triton": row}) for r in recs]
    assert _plot_token_rounding(plt, doc, ours, tmp_path / "b.png") == tmp_path / "b.png"
    assert (tmp_path / "b.png").stat().st_size > 1000 and not (tmp_path / "a.png").exists()


def test_worst_row_error_is_over_token_rows():
    """_worst_row: max over tokens t of ‖out_t − ref_t‖ over the RMS of the ‖ref_t‖ (rows are tokens: a norm over a
    column of d would mix every token's error), computed here row by row."""
    from sonicmoe.bench.measure import _worst_row

    g = torch.Generator().manual_seed(21)
    ref = torch.randn(64, 4, generator=g, dtype=torch.float64)
    out = ref + 0.01 * torch.randn(64, 4, generator=g, dtype=torch.float64)
    out[9] += torch.tensor([0.3, -0.2, 0.1, 0.25], dtype=torch.float64)
    rms = math.sqrt(sum(float(r.dot(r)) for r in ref) / 64)
    want = max(math.sqrt(float((o - r).dot(o - r))) for o, r in zip(out, ref)) / rms
    assert _worst_row(out, ref) == pytest.approx(want, rel=1e-12)
    assert _worst_row(ref[:0], ref[:0]) == 0.0


def test_expand_runs_the_routing_option_over_the_shapes_own(monkeypatch):
    """--routing overrides the routings a preset's shape lists; without it each shape runs its own (top-k where it
    lists none)."""
    from sonicmoe.bench import runner

    monkeypatch.setattr(runner, "load_token_rounding", lambda: None)
    a, b = Shape("a", 64, 32, 16, 4, 2, routings=("topk",)), Shape("b", 64, 32, 16, 4, 2)
    items = runner.expand([a, b], SimpleNamespace(routings=("token_rounding",)), print)
    assert items == [(a, "token_rounding"), (b, "token_rounding")]
    assert runner.expand([a, b], SimpleNamespace(routings=None), print) == [(a, "topk"), (b, "topk")]


def test_dx_rows_error_reads_the_input_gradient():
    """dx_rows is the worst token row of dx (not of the output): one token's dx row zeroed, its largest, gives a
    worst-row error of at least 1 (the row's norm over the RMS row), while out_rows and the norm-wise dx error of
    the other rows stay at float32 rounding."""
    from sonicmoe.bench.measure import reference_errors

    p = make_problem(Shape("dx", 256, 32, 16, 4, 2), dtype=torch.float32, device="cpu", seed=5)
    case = REGISTRY["torch"].factory(p, {})
    out = case.forward()
    out.backward(p.dout)
    spec = case.ref_spec()
    good = reference_errors(out.detach(), spec, p.dout)
    assert good["dx_rows"] < 1e-5 and good["out_rows"] < 1e-5
    row = int(spec.x.grad.norm(dim=1).argmax())
    spec.x.grad[row] = 0
    bad = reference_errors(out.detach(), spec, p.dout)
    assert bad["dx_rows"] >= 1 - 1e-5 and bad["out_rows"] == good["out_rows"]


# ---------------------------------------------------------------------------------------------------
# the runner's and the measurements' host logic (mutation probe: bm8_*)


def test_backend_errors_become_rows(monkeypatch):
    """run_backend: any of the error types a backend may raise (bench_error_types) becomes an "error" row naming the
    step, the type and the message, a MemoryError an "oom" row; the run is not ended."""
    from sonicmoe.bench import runner

    p = make_problem(Shape("e", 16, 8, 8, 2, 1), dtype=torch.float32, device="cpu", seed=1)
    opts = runner.RunOptions(backends=["bad"], device=torch.device("cpu"), dtype=torch.float32, verbose=False)
    for exc in (ValueError, TypeError, NotImplementedError, AssertionError, IndexError, KeyError, AttributeError,
                ZeroDivisionError, RuntimeError, MemoryError):

        def factory(problem, options, exc=exc):
            raise exc("no case")

        monkeypatch.setitem(REGISTRY, "bad", BaselineSpec("bad", factory, "t", default=False))
        row = runner.run_backend("bad", p, opts, useful_flops(p.R, 8, 8), lambda s: None)
        assert row["status"] == ("oom" if exc is MemoryError else "error"), exc
        assert row["message"] == f"setup: {exc.__name__}: {exc('no case')}" and row["fwd"] is None  # KeyError: quoted


def test_free_memory_drops_the_gradients():
    """free_memory drops the gradient of every leaf it is given (None entries skipped), on CPU too."""
    from sonicmoe.bench.measure import free_memory

    a, b = torch.randn(3, requires_grad=True), torch.randn(2, 2, requires_grad=True)
    (a.sum() + b.sum()).backward()
    assert a.grad is not None and b.grad is not None
    free_memory(a, None, b)
    assert a.grad is None and b.grad is None


def test_check_names_a_nan_error_worst_and_bounds_local_errors(monkeypatch):
    """check_case: a NaN error anywhere (not only the first key) is the "worst" one and fails; a worst-expert error
    (*_experts) is held to the local bound LOCAL_TOL_FACTOR · tol like a worst-row one, a norm-wise one to tol."""
    from sonicmoe.bench import measure

    assert measure.error_bound(0.01, "dw1_experts") == pytest.approx(0.1)
    assert measure.error_bound(0.01, "dx_rows") == pytest.approx(0.1)
    assert measure.error_bound(0.01, "dw1") == 0.01
    p = make_problem(Shape("n", 16, 8, 8, 2, 1), dtype=torch.float32, device="cpu", seed=2)
    case = REGISTRY["torch"].factory(p, {})
    nan_dx = {"out": 1e-4, "out_rows": 1e-4, "dx": float("nan"), "dx_rows": 1e-4, "dw1": 5e-4}
    local = {"out": 5e-4, "out_rows": 2e-3, "dw1": 4e-4, "dw1_experts": 5e-3, "dw2_experts": 9e-3}
    for errs, passed, worst in ((nan_dx, False, "dx"), (local, True, "dw2_experts")):
        monkeypatch.setattr(measure, "reference_errors", lambda *a, errs=errs, **k: dict(errs))
        res = measure.check_case(case, p.dout, grads=False, tol=1e-3, poison=False)
        assert res["passed"] is passed and res["worst"] == worst, res


def test_check_passes_an_error_exactly_at_its_bound(monkeypatch):
    """check_case's bounds are inclusive: an error equal to its bound (tol for a norm-wise one, LOCAL_TOL_FACTOR · tol
    for a local one) passes; the next float above it fails."""
    from sonicmoe.bench import measure

    p = make_problem(Shape("b", 16, 8, 8, 2, 1), dtype=torch.float32, device="cpu", seed=2)
    case = REGISTRY["torch"].factory(p, {})
    tol = 1e-3
    at = {k: measure.error_bound(tol, k) for k in ("out", "out_rows", "dw1", "dw1_experts")}
    for above, passed in ((None, True), ("out", False), ("dw1_experts", False)):
        errs = {**at, above: math.nextafter(at[above], math.inf)} if above else dict(at)
        monkeypatch.setattr(measure, "reference_errors", lambda *a, errs=errs, **k: dict(errs))
        res = measure.check_case(case, p.dout, grads=False, tol=tol, poison=False)
        assert res["passed"] is passed, (above, res)


def test_reference_errors_name_the_weight_gradient_that_is_wrong():
    """reference_errors compares dW1 with the reference's dW1 and dW2 with its dW2: one expert's dW1 scaled by 1.5
    shows in dw1 and dw1_experts alone, and one expert's dW2 in dw2 and dw2_experts alone, in one chunk of experts
    or one chunk per expert."""
    p = make_problem(Shape("w", 40, 16, 8, 4, 2), dtype=torch.float32, device="cpu", seed=6)
    case = ExpertsCase("torch", p, baselines.experts_loop)
    for w, other in ((p.w1, "dw2"), (p.w2, "dw1")):
        mine = "dw1" if other == "dw2" else "dw2"
        for t in case.leaves:
            t.grad = None
        case.forward().backward(p.dout)
        w.grad[2] *= 1.5
        for chunk_bytes in (1 << 30, 1):
            errs = reference_errors(case.forward().detach(), case.ref_spec(), p.dout, chunk_bytes=chunk_bytes)
            assert errs[mine] > 0.1 and errs[mine + "_experts"] > 0.3, (mine, errs)
            assert errs[other] < 1e-5 and errs[other + "_experts"] < 1e-5, (mine, errs)
    for t in case.leaves:
        t.grad = None


def test_measure_memory_counts_from_the_baseline(monkeypatch):
    """measure_memory's accounting on a stubbed CUDA allocator (a peak of 5000 bytes left from before, 1000 held
    before the call): held = after the forward - before - the output; the peaks are over the call only (peak stats
    reset first, the baseline subtracted); grad_bytes in bytes; a forward-only call's peak is the forward's."""
    from sonicmoe.bench.measure import measure_memory

    class Alloc:
        def __init__(self):
            self.now, self.peak = 1000, 5000

        def add(self, n):
            self.now += n
            self.peak = max(self.peak, self.now)

        def reset(self, device=None):
            self.peak = self.now

    w1 = torch.zeros(3, 4, dtype=torch.float32)  # gradient 48 bytes
    w2 = torch.zeros(5, dtype=torch.float64)  # 40 bytes

    def setup():
        mem = Alloc()
        for name, fn in (("synchronize", lambda device=None: None), ("memory_allocated", lambda device=None: mem.now),
                         ("max_memory_allocated", lambda device=None: mem.peak),
                         ("reset_peak_memory_stats", mem.reset)):
            monkeypatch.setattr(torch.cuda, name, fn)

        class Out:
            def numel(self):
                return 16

            def element_size(self):
                return 4

            def backward(self, dout):
                mem.add(2000)  # backward's temporaries
                mem.add(-2000)
                w1.grad, w2.grad = torch.ones_like(w1), torch.ones_like(w2)
                mem.add(48 + 40)

        def forward():
            mem.add(700)  # temporaries
            mem.add(-700)
            mem.add(200)  # kept for the backward
            mem.add(64)  # the output
            return Out()

        return SimpleNamespace(forward=forward, leaves=[w1, w2])

    dout = SimpleNamespace(device=torch.device("cuda"))
    got = measure_memory(setup(), dout, backward=True)
    assert got == {"held_bytes": 200, "fwd_peak_bytes": 700, "out_bytes": 64, "peak_bytes": 2264, "grad_bytes": 88}
    assert w1.grad is None and w2.grad is None
    got = measure_memory(setup(), dout, backward=False)
    assert got == {"held_bytes": 200, "fwd_peak_bytes": 700, "out_bytes": 64, "peak_bytes": 700, "grad_bytes": 0}


def test_error_message_cut_at_600_characters():
    """A backend's error message is kept whole up to 600 characters and cut to 600 plus an ellipsis past that."""
    from sonicmoe.bench.runner import _message

    whole = _message(RuntimeError("x" * (600 - len("RuntimeError: "))))
    assert len(whole) == 600 and whole.endswith("x")
    cut = _message(RuntimeError("x" * (601 - len("RuntimeError: "))))
    assert cut == "RuntimeError: " + "x" * (600 - len("RuntimeError: ")) + " …"


def test_phases_take_their_flops(monkeypatch):
    """run_backend (timings stubbed): bwd = total - fwd with the backward's FLOPs, the router variant's forward and
    forward+backward with the forward's and the total's, and the upper bound's TFLOP/s from the rows it computes (E·m
    = 4·3 = 12 rows for R = 10 pairs), not from R."""
    from sonicmoe.bench import runner

    T, d, n, E, K = 10, 16, 8, 4, 1
    p = make_problem(Shape("ph", T, d, n, E, K), dtype=torch.float32, device="cpu", seed=3)
    assert p.R == 10
    ms = iter([1.0, 3.0, 1.5, 4.0, 0.5, 2.0])
    monkeypatch.setattr(runner, "bench_ms", lambda fn, **kw: {"p20": 0.0, "p50": next(ms), "p80": 9.0})
    opts = runner.RunOptions(backends=["torch", "upper"], device=torch.device("cpu"), dtype=torch.float32,
                             check=False, warmup=0.0, rep=0.0)
    flops = useful_flops(p.R, n, d)
    row = runner.run_backend("torch", p, opts, flops, lambda s: None)

    def tf(f, ms):
        return pytest.approx(f / (ms * 1e-3) / 1e12, rel=1e-12)

    assert row["fwd"]["tflops"] == tf(6 * 10 * n * d, 1.0) and row["total"]["tflops"] == tf(18 * 10 * n * d, 3.0)
    assert row["bwd"] == {"ms": {"p50": 2.0}, "tflops": tf(12 * 10 * n * d, 2.0)}
    assert row["router"]["fwd"]["tflops"] == tf(6 * 10 * n * d, 1.5)
    assert row["router"]["total"]["tflops"] == tf(18 * 10 * n * d, 4.0)
    up = runner.run_backend("upper", p, opts, flops, lambda s: None)
    assert up["info"]["rows"] == 12 and up["router"] is None
    assert up["fwd"]["tflops"] == tf(6 * 12 * n * d, 0.5) and up["total"]["tflops"] == tf(18 * 12 * n * d, 2.0)


def test_device_bytes_of_cpu_and_gpu(monkeypatch):
    """_device_bytes: half the physical RAM for a CPU run, the GPU's total memory for a CUDA one, None when unknown."""
    import os

    from sonicmoe.bench import runner

    monkeypatch.setattr(os, "sysconf", lambda key: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1001}[key])
    assert runner._device_bytes(torch.device("cpu")) == 4096 * 1001 // 2
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 << 30))
    assert runner._device_bytes(torch.device("cuda")) == 80 << 30

    def unknown(key):
        raise ValueError(key)

    monkeypatch.setattr(os, "sysconf", unknown)
    assert runner._device_bytes(torch.device("cpu")) is None


def test_footprint_gate_skips_only_past_the_memory(monkeypatch):
    """run_shape on CPU: a shape whose footprint is exactly the memory runs; one byte more is skipped before any
    problem is made, the message in GiB (2**30 bytes)."""
    from sonicmoe.bench import runner

    opts = runner.RunOptions(backends=[], device=torch.device("cpu"), dtype=torch.float32, verbose=False)
    tiny = Shape("tiny", 64, 32, 16, 4, 2)
    need = runner.footprint_bytes(tiny, 4, True)
    monkeypatch.setattr(runner, "_device_bytes", lambda device: need)
    rec = runner.run_shape(tiny, "topk", opts, lambda s: None)
    assert rec["status"] == "ok" and rec["footprint_bytes"] == need and rec["backends"] == {}
    big = Shape("big", 32768, 4096, 2048, 64, 8)
    need = runner.footprint_bytes(big, 4, True)
    assert need > 10 << 30
    monkeypatch.setattr(runner, "_device_bytes", lambda device: need - 1)
    monkeypatch.setattr(runner, "make_problem", None)  # never reached
    rec = runner.run_shape(big, "topk", opts, lambda s: None)
    assert rec["status"] == "skipped" and rec["backends"] == {}
    gib = f"{need / 2**30:.1f}"
    assert gib != f"{need / 1e9:.1f}"
    assert rec["message"] == (f"needs about {gib} GiB (weights, grads, activations), more than the "
                              f"{(need - 1) / 2**30:.1f} GiB half the RAM; run it on a GPU or lower --max-T")


# ---------------------------------------------------------------------------------------------------
# the runner's loop over shapes, its checks' bounds and its records (mutation probe: ck13_runner_*)


def test_shape_ratios_scale_the_upper_bound_to_the_pairs(monkeypatch):
    """run_shape hands R to the ratios: the upper bound computes E·m = 4·3 = 12 rows for R = 10 pairs (T = 10, E = 4,
    K = 1), so its stubbed times are scaled by 10 / 12 before the division by the base's (torch: no triton row)."""
    from sonicmoe.bench import runner

    ms = iter([1.0, 3.0, 0.5, 2.0])  # torch fwd, fwd+bwd; upper fwd, fwd+bwd
    monkeypatch.setattr(runner, "bench_ms", lambda fn, **kw: {"p20": 0.0, "p50": next(ms), "p80": 9.0})
    opts = runner.RunOptions(backends=["torch", "upper"], device=torch.device("cpu"), dtype=torch.float32,
                             check=False, router_variant=False, warmup=0.0, rep=0.0, verbose=False)
    rec = runner.run_shape(Shape("r", 10, 16, 8, 4, 1), "topk", opts, lambda s: None)
    assert rec["TK"] == 10 and rec["backends"]["upper"]["info"]["rows"] == 12
    assert rec["ratio_base"] == "torch"
    scale = 10 / 12
    assert rec["ratios"] == {"upper": {"fwd": pytest.approx(0.5 * scale / 1.0), "bwd": pytest.approx(1.5 * scale / 2.0),
                                       "total": pytest.approx(2.0 * scale / 3.0)}}


def test_run_numbers_its_items_keeps_the_callers_records_and_rows_a_shape_error(monkeypatch, capsys):
    """run(): the progress line of item i of n reads "[i/n]" from 1; each record is appended to the caller's list
    (the one returned) and handed to on_record; a shape whose run raises becomes a record of its own, "oom" for a
    MemoryError and "error" otherwise, and the run goes on."""
    from sonicmoe.bench import runner

    def shape_run(shape, mode, opts, log):
        if shape.name == "oom":
            raise MemoryError("no room")
        if shape.name == "err":
            raise RuntimeError("sticky CUDA error")
        return {"name": shape.name, "routing": mode, "status": "ok"}

    monkeypatch.setattr(runner, "run_shape", shape_run)
    monkeypatch.setattr(runner, "load_token_rounding", lambda: None)
    shapes = [Shape("a", 16, 8, 8, 2, 1), Shape("oom", 32, 8, 8, 2, 1), Shape("err", 48, 8, 8, 2, 1)]
    opts = runner.RunOptions(backends=[], device=torch.device("cpu"), dtype=torch.float32)
    mine, seen, said = [{"name": "earlier"}], [], []
    out = runner.run(shapes, opts, said.append, records=mine, on_record=seen.append)
    assert out is mine and [r["name"] for r in mine] == ["earlier", "a", "oom", "err"]
    assert len(seen) == 3 and all(s is r for s, r in zip(seen, mine[1:]))
    assert (mine[2]["status"], mine[2]["message"]) == ("oom", "MemoryError: no room")
    assert (mine[3]["status"], mine[3]["message"]) == ("error", "RuntimeError: sticky CUDA error")
    assert mine[3]["backends"] == {} and mine[3]["T"] == 48 and mine[3]["routing"] == "topk"
    assert mine[3]["activation"] == opts.activation == "swiglu"  # what the failed shape ran with
    # a failed shape's record opens with the same fields as one that ran (runner.shape_header)
    assert {k: mine[3][k] for k in ("T_preset", "G", "rho", "m_tile", "E", "K")} == {
        "T_preset": None, "G": 1.0, "rho": 0.5, "m_tile": opts.m_tile, "E": 2, "K": 1}
    lines = said + capsys.readouterr().out.splitlines()  # through tqdm.write where tqdm is installed
    progress = [s for s in lines if s.startswith("[")]
    assert progress == [f"[{i}/3] {s.name} (T={s.T}, d=8, n=8, E=2, K=1) routing=topk" for i, s in enumerate(shapes, 1)]


def test_fail_message_holds_worst_row_and_expert_errors_to_the_local_bound(monkeypatch):
    """A FAIL row's message names the bound its worst error broke: LOCAL_TOL_FACTOR · tol for a worst-row (*_rows) or
    worst-expert (*_experts) error, tol for a norm-wise one (check stubbed to fail on each)."""
    from sonicmoe.bench import runner

    p = make_problem(Shape("f", 16, 8, 8, 2, 1), dtype=torch.float32, device="cpu", seed=4)
    opts = runner.RunOptions(backends=["torch"], device=torch.device("cpu"), dtype=torch.float32, tol=1e-3,
                             router_variant=False, verbose=False)
    for worst, bound in (("dw1_experts", "local bound 0.01"), ("dx_rows", "local bound 0.01"), ("dw2", "tol 0.001")):
        def failing(*args, worst=worst, **kw):
            return {"passed": False, "worst": worst, "errors": {worst: 0.5}, "pairs": p.R}

        monkeypatch.setattr(runner, "check_case", failing)
        row = runner.run_backend("torch", p, opts, useful_flops(p.R, 8, 8), lambda s: None)
        assert row["status"] == "FAIL" and row["fwd"] is None
        assert row["message"] == f"wrong result: rel err of {worst} = 0.5 > {bound}"


def test_check_takes_the_backends_token_limit_and_the_dtypes_tol(monkeypatch):
    """run_backend checks on the first min(T, --check-max-T, the backend's own check_max_T) tokens (a torch backend
    limited to 16 of T = 64 here; --check-max-T 8 below that wins) and, without --tol, at the bound of the problem's
    dtype (bf16: 2e-2, not float32's 2e-3); the check is stubbed to record what it was given."""
    from sonicmoe.bench import runner
    from sonicmoe.bench.measure import DEFAULT_TOL

    seen = []

    def check(case, dout, **kw):
        seen.append((dout.shape[0], kw["tol"]))
        return {"passed": True, "worst": "out", "errors": {"out": 0.0}, "pairs": 1}

    monkeypatch.setattr(runner, "check_case", check)
    monkeypatch.setattr(runner, "bench_ms", lambda fn, **kw: {"p20": 1.0, "p50": 1.0, "p80": 1.0})
    monkeypatch.setitem(REGISTRY, "torch16", dataclasses.replace(REGISTRY["torch"], check_max_T=16))
    for dtype, cap, want_T in ((torch.bfloat16, None, 16), (torch.float32, 8, 8)):
        p = make_problem(Shape("c", 64, 16, 8, 4, 2), dtype=dtype, device="cpu", seed=5)
        opts = runner.RunOptions(backends=["torch16"], device=torch.device("cpu"), dtype=dtype, check_max_T=cap,
                                 router_variant=False, verbose=False)
        row = runner.run_backend("torch16", p, opts, useful_flops(p.R, 8, 16), lambda s: None)
        assert row["status"] == "ok", row["message"]
        assert seen[-1] == (want_T, DEFAULT_TOL[dtype]) and row["check"]["T"] == want_T
    assert DEFAULT_TOL[torch.bfloat16] == 2e-2 and DEFAULT_TOL[torch.float32] == 2e-3


def test_load_profile_warns_only_when_the_router_misses_the_target(tmp_path, monkeypatch):
    """run_shape with --load-profile: no warning where the calibrated router's busiest expert is within 10% of the
    profile's (2x the mean here); where it is not (the router left even: the load dropped before the problem is
    made), one warning naming both."""
    from sonicmoe.bench import runner

    path = tmp_path / "skew.json"
    path.write_text(json.dumps([3.0] * 4 + [1.0] * 12))
    opts = runner.RunOptions(backends=[], device=torch.device("cpu"), dtype=torch.float32, load_profile=str(path),
                             verbose=False)
    shape = Shape("lp", 1024, 32, 16, 16, 2)
    said = []
    rec = runner.run_shape(shape, "topk", opts, said.append)
    got, want = rec["load_target"]["achieved_max_over_mean"], rec["load_target"]["max_over_mean"]
    assert want == pytest.approx(2.0) and abs(got - want) <= 0.1 * want
    assert not [s for s in said if "warning" in s]
    real = runner.make_problem
    monkeypatch.setattr(runner, "make_problem", lambda shape, **kw: real(shape, **{**kw, "load": None}))
    said.clear()
    rec = runner.run_shape(shape, "topk", opts, said.append)
    got = rec["load_target"]["achieved_max_over_mean"]
    assert abs(got - want) > 0.1 * want  # an even router's busiest expert: 1.6x here
    assert [s for s in said if "warning" in s] == [
        f"  warning: the router reached a busiest expert of {got:.2f}x the mean, not the profile's 2.00x (too few "
        "tokens per expert to calibrate?)"]


# ---------------------------------------------------------------------------------------------------
# the runner's logs, an empty check, the plots' axes and the terminal table's ratios (mutation probe: br18_*)


def test_oom_row_logs_no_traceback_and_an_error_row_does(monkeypatch):
    """run_backend with verbose: an error row logs its one line and then the traceback's last lines; an out-of-memory
    row logs its one line only (the traceback of an allocation says nothing the message does not)."""
    from sonicmoe.bench import runner

    p = make_problem(Shape("e", 16, 8, 8, 2, 1), dtype=torch.float32, device="cpu", seed=1)
    opts = runner.RunOptions(backends=["bad"], device=torch.device("cpu"), dtype=torch.float32, verbose=True)
    for exc, status in ((MemoryError, "OOM"), (RuntimeError, "ERROR")):

        def factory(problem, options, exc=exc):
            raise exc("no room")

        monkeypatch.setitem(REGISTRY, "bad", BaselineSpec("bad", factory, "t", default=False))
        said = []
        runner.run_backend("bad", p, opts, useful_flops(p.R, 8, 8), said.append)
        assert said[0] == f"  bad: {status} during setup: {exc.__name__}: no room"
        if exc is MemoryError:
            assert said == said[:1]
        else:
            assert len(said) == 2 and said[1].endswith("RuntimeError: no room") and "in factory" in said[1]


def test_no_pair_hint_names_an_m_tile_of_at_least_one():
    """A token-rounding shape with fewer routed pairs than experts (T·K/E = 4·1/8 = 0.5) routes no pair at M_tile =
    128; the skip's hint names --m-tile <= 1 (T·K // E = 0 would name no usable M_tile)."""
    from sonicmoe.bench import runner

    opts = runner.RunOptions(backends=[], device=torch.device("cpu"), dtype=torch.float32, verbose=False)
    with pytest.warns(UserWarning, match="mean tokens per expert"):
        rec = runner.run_shape(Shape("few", 4, 8, 8, 8, 1), "token_rounding", opts, lambda s: None)
    assert rec["status"] == "skipped" and rec["TK"] == 0 and rec["backends"] == {}
    assert rec["message"] == ("token_rounding routed no (token, expert) pair: T·K/E = 0.5 mean tokens per expert "
                              "rounded to multiples of M_tile=128 gives none; nothing to check or time "
                              "(use --m-tile <= 1 or a larger T)")


def test_quiet_run_prints_nothing(monkeypatch, capsys):
    """run(log=None): no progress line, no per-shape message, on stdout or stderr (tqdm's bar is off where stderr is
    not a terminal, and its write is not used)."""
    from sonicmoe.bench import runner

    def shape_run(shape, mode, opts, log):
        log(f"  {shape.name}: ok")
        return {"name": shape.name, "routing": mode, "status": "ok"}

    monkeypatch.setattr(runner, "run_shape", shape_run)
    monkeypatch.setattr(runner, "load_token_rounding", lambda: None)
    opts = runner.RunOptions(backends=[], device=torch.device("cpu"), dtype=torch.float32)
    out = runner.run([Shape("a", 16, 8, 8, 2, 1), Shape("b", 32, 8, 8, 2, 1)], opts, None)
    assert [r["name"] for r in out] == ["a", "b"]
    assert capsys.readouterr() == ("", "")
    runner.run([Shape("a", 16, 8, 8, 2, 1)], opts, print)  # the same run with a log prints its lines
    assert "  a: ok" in capsys.readouterr().out


def test_check_of_an_empty_problem_passes():
    """check_case on a problem of no token (O of shape (0, d)): no pair, nothing to be wrong, a pass; the no-pair
    rule fails only a check on T > 0 rows (test_check_on_no_routed_pair_fails)."""
    from sonicmoe.bench.measure import check_case
    from sonicmoe.routing import routing_from_pairs

    p = make_problem(Shape("e", 16, 8, 8, 2, 1), dtype=torch.float32, device="cpu", seed=3)
    none = torch.zeros(0, dtype=p.pair_token.dtype)
    p0 = dataclasses.replace(p, x=p.x.detach()[:0].clone().requires_grad_(True), pair_token=none,
                             pair_expert=none.clone(), routing=routing_from_pairs(none, none, 0, 2),
                             pair_scores=p.pair_scores.detach()[:0].clone().requires_grad_(True),
                             dout=p.dout[:0].clone(), topk_ids=None)
    res = check_case(REGISTRY["torch"].factory(p0, {}), p0.dout, grads=True, tol=2e-3, poison=False)
    assert res["pairs"] == 0 and res["passed"] is True
    assert all(v == 0.0 for v in res["errors"].values())


def test_plots_use_log2_axes_centred_speedup_ticks_and_spec_only_beside_timings(saved_figures):
    """G and E axes are logarithmic in base 2 (the sweeps double them); the speed-up chart puts record i's tick at x
    = i, the centre of its bars; the memory chart draws SPEC's line only on panels that drew a measured line (a
    group whose rows hold no memory gets none)."""
    from sonicmoe.bench import plots

    figs = saved_figures
    plt = plots._setup()
    doc = {"env": {}, "date": "2026-01-02"}
    vals = iter((torch.rand(64, dtype=torch.float64) + 0.5).tolist())

    def row(memory=True):
        return {"status": "ok", "fwd": {"tflops": next(vals), "ms": {"p50": next(vals)}},
                "total": {"tflops": next(vals), "ms": {"p50": next(vals)}},
                "memory": {"held_bytes": 1 << 30, "peak_bytes": 3 << 30} if memory else None}

    def rec(group, G, memory=True):
        return {"group": group, "routing": "topk", "T": 64, "d": 64, "n": 64 // G, "G": float(G), "TK": 128,
                "dtype": "bfloat16", "backends": {"triton": row(memory)}}

    groups = {"none": [rec("none", G, memory=False) for G in (1, 2)], "some": [rec("some", G) for G in (1, 2)]}
    assert plots._plot_granularity(plt, doc, groups, ["triton"], "g.png") == "g.png"
    assert plots._plot_memory(plt, doc, groups, ["triton"], "m.png") == "m.png"
    tr = [{"group": "tr", "routing": mode, "T": 512, "E": E, "backends": {"triton": row()}}
          for E in (64, 128) for mode in ("topk", "token_rounding")]
    assert plots._plot_token_rounding(plt, doc, tr, "t.png") == "t.png"
    assert len(figs) == 3
    for fig in figs:
        for ax in fig.axes:
            assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
    none_ax, some_ax = figs[1].axes
    assert len(none_ax.lines) == 0
    assert [ln.get_label() for ln in some_ax.lines] == ["triton held", "triton peak",
                                                         "4TKn (SPEC §3 less the input X)"]
    speed = [{"name": f"s{i}", "ratio_base": "triton", "ratios": {"torch": {"fwd": next(vals)}, "upper": {
        "fwd": next(vals)}}} for i in range(3)]
    assert plots._plot_speedup(plt, doc, speed, "s.png") == "s.png"
    (ax,) = figs[-1].axes
    assert list(ax.get_xticks()) == [0, 1, 2]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["s0", "s1", "s2"]
    centres = sorted(b.get_x() + b.get_width() / 2 for b in ax.patches)
    assert [round((a + b) / 2, 9) for a, b in zip(centres[::2], centres[1::2])] == [0, 1, 2]


def test_terminal_table_ratio_columns_read_fwd_and_total():
    """The terminal table's base/this columns: the forward's ratio and the forward+backward's (not the backward's),
    "base" on the base's row and "-" where a backend has no ratio (a skipped row)."""
    doc = _synthetic_doc()
    rec = doc["results"][0]
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    r = (torch.rand(6, generator=g, dtype=torch.float64) * 3 + 0.1).tolist()
    r[1], r[4] = r[2] + 1.0, r[5] + 1.0  # backward ratios that never print as the totals do
    rec["ratios"] = {"torch": {"fwd": r[0], "bwd": r[1], "total": r[2]}, "upper": {"fwd": r[3], "bwd": r[4],
                                                                                 "total": r[5]}}
    rows = {ln.split()[2]: ln.split() for ln in report.terminal_table(doc).splitlines()
            if ln.startswith(rec["name"] + " ")}
    f, fb = 12, 13  # "base/this f", "base/this f+b" (every cell before them one word here)
    assert (rows["triton"][f], rows["triton"][fb]) == ("base", "base")
    assert (rows["torch"][f], rows["torch"][fb]) == (format(r[0], ".3g"), format(r[2], ".3g"))
    assert (rows["upper"][f], rows["upper"][fb]) == (format(r[3], ".3g"), format(r[5], ".3g"))
    assert (rows["loop"][f], rows["loop"][fb]) == ("-", "-")


# ---------------------------------------------------------------------------------------------------
# plots that draw nothing, the runner's messages, forward-mode checks and the results document (mutation probe: bp21_*)


def _fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))


def test_speedup_plot_of_ratios_without_a_phase_draws_nothing(saved_figures):
    """_plot_speedup on records whose ratios hold neither a forward nor a forward+backward number (a backward ratio
    only, or None where a time was not positive): no chart (None) and no figure saved, not an empty one."""
    from sonicmoe.bench import plots

    v = (torch.rand(2, generator=_fresh_generator(), dtype=torch.float64) + 0.5).tolist()
    recs = [{"name": "a", "ratio_base": "triton", "ratios": {"torch": {"fwd": None, "bwd": v[0], "total": None}}},
            {"name": "b", "ratio_base": "triton", "ratios": {"upper": {"bwd": v[1]}}}]
    assert plots._plot_speedup(plots._setup(), {"env": {}, "date": "2026-01-02"}, recs, "s.png") is None
    assert saved_figures == []


def test_memory_plot_draws_the_rows_that_ran_ok_only(saved_figures):
    """The memory chart draws a backend's held and peak memory from its ok rows only: a skipped (or failed) row's
    numbers, whatever they hold, draw no line."""
    from sonicmoe.bench import plots

    GiB = plots.GiB
    v = iter((torch.rand(16, generator=_fresh_generator(), dtype=torch.float64) + 0.5).tolist())

    def row(status):
        return {"status": status, "memory": {"held_bytes": int(next(v) * GiB), "peak_bytes": int(next(v) * 4 * GiB)}}

    recs = [{"group": "g", "routing": "topk", "T": 64, "d": 64, "n": 64 // G, "G": float(G), "TK": 128,
             "dtype": "bfloat16", "backends": {"triton": row("ok"), "loop": row("skipped"), "torch": row("FAIL")}}
            for G in (1, 2)]
    groups = plots.granularity_groups(recs)
    assert plots._plot_memory(plots._setup(), {"env": {}, "date": "x"}, groups, plots._backend_names(recs),
                              "m.png") == "m.png"
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in saved_figures[-1].axes[0].lines}
    assert lines.pop("4TKn (SPEC §3 less the input X)")
    assert lines == {"triton held": [r["backends"]["triton"]["memory"]["held_bytes"] / GiB for r in recs],
                     "triton peak": [r["backends"]["triton"]["memory"]["peak_bytes"] / GiB for r in recs]}


def test_plot_from_file_lists_only_the_charts_it_made_and_says_when_none_apply(tmp_path):
    """plot_from_file returns the paths it wrote and logs each: for a file of one shape with ratios, the speed-up chart
    alone (no None in the place of the granularity and token-rounding charts it did not make); for a file of a shape
    that never ran, nothing, and it says why."""
    pytest.importorskip("matplotlib")
    from sonicmoe.bench.plots import plot_from_file

    doc = _synthetic_doc()
    r = (torch.rand(2, generator=_fresh_generator(), dtype=torch.float64) + 0.5).tolist()
    one, broken = doc["results"][0], doc["results"][-1]
    one["ratios"] = {"torch": {"fwd": r[0], "total": r[1]}}
    path = report.write_results(dict(doc, results=[one]), tmp_path / "one.json")
    said = []
    assert plot_from_file(str(path), log=said.append) == [tmp_path / "one_speedup.png"]
    assert said == [f"wrote {tmp_path / 'one_speedup.png'}"]
    path = report.write_results(dict(doc, results=[broken]), tmp_path / "none.json")
    said.clear()
    assert plot_from_file(str(path), log=said.append) == []
    assert len(said) == 1 and said[0].startswith("no plot applies to these results")
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["one_speedup.png"]


def test_error_message_ends_without_white_space():
    """_message strips the white space an exception's text ends (or is empty) with: a compiler's message that ends in
    a newline, an exception with no text."""
    from sonicmoe.bench.runner import _message

    word = "".join(chr(ord("a") + int(i)) for i in torch.randint(0, 26, (8,), generator=_fresh_generator()))
    assert _message(ValueError(f"bad {word}\n\n")) == f"ValueError: bad {word}"
    assert _message(RuntimeError()) == "RuntimeError:"


def test_gpu_note_names_the_clock_watts_and_temperature_of_the_fwd_bwd_timing(monkeypatch):
    """_gpu_note: "[MHz, W, °C]" of a phase's GPU state (no watts where the board gave none, nothing without NVML);
    run_backend's ok line carries the forward+backward timing's note, the forward's where only it ran."""
    from sonicmoe.bench import runner

    g = _fresh_generator()
    mhz = (torch.rand(2, generator=g, dtype=torch.float64) * 1000 + 800).tolist()
    watts = (torch.rand(1, generator=g, dtype=torch.float64) * 500 + 100).item()
    state = {"sm_mhz": mhz[0], "watts": watts, "temp_c": 61}
    assert runner._gpu_note({"gpu": state}) == f"  [{mhz[0]:.0f} MHz, {watts:.0f} W, 61 °C]"
    assert runner._gpu_note({"gpu": dict(state, watts=None)}) == f"  [{mhz[0]:.0f} MHz, 61 °C]"
    assert runner._gpu_note({"gpu": None}) == "" and runner._gpu_note(None) == ""
    states = iter([dict(state, sm_mhz=m) for m in mhz] * 2)

    monkeypatch.setattr(runner, "GpuWatch", _fake_gpu_watch(lambda seconds: next(states)))
    monkeypatch.setattr(runner, "bench_ms", lambda fn, **kw: {"p20": 1.0, "p50": 2.0, "p80": 3.0})
    p = make_problem(Shape("n", 16, 8, 8, 2, 1), dtype=torch.float32, device="cpu", seed=1)
    for mode, note in (("fwdbwd", mhz[1]), ("fwd", mhz[0])):
        opts = runner.RunOptions(backends=["torch"], device=torch.device("cpu"), dtype=torch.float32, mode=mode,
                                 check=False, router_variant=False, warmup=0.0, rep=0.0, verbose=False)
        said = []
        assert runner.run_backend("torch", p, opts, useful_flops(p.R, 8, 8), said.append)["status"] == "ok"
        assert said[-1].endswith(f"  [{note:.0f} MHz, {watts:.0f} W, 61 °C]"), (mode, said)


def test_forward_mode_checks_the_output_only():
    """--mode fwd: the check compares the output (no gradient is computed, --check-grads or not) and nothing past the
    forward is timed."""
    from sonicmoe.bench import runner

    seed = int(torch.randint(0, 2**31 - 1, ()))
    p = make_problem(Shape("fw", 32, 16, 8, 4, 2), dtype=torch.float32, device="cpu", seed=seed)
    opts = runner.RunOptions(backends=["torch"], device=torch.device("cpu"), dtype=torch.float32, mode="fwd",
                             check_grads=True, router_variant=False, warmup=0.0, rep=0.0, verbose=False)
    row = runner.run_backend("torch", p, opts, useful_flops(p.R, 8, 16), lambda s: None)
    assert row["status"] == "ok" and set(row["check"]["errors"]) == {"out", "out_rows"}
    assert row["fwd"]["ms"]["p50"] > 0 and row["total"] is None and row["bwd"] is None


def test_a_failed_check_is_not_followed_by_the_router_variants(monkeypatch):
    """A backend whose experts FAIL their check is not checked again through its router variant: the row is FAIL with
    the experts' error, its check holds no router entry (a passing router check would have hidden the FAIL)."""
    from sonicmoe.bench import runner

    err = 0.2 + torch.rand(1, generator=_fresh_generator(), dtype=torch.float64).item()
    p = make_problem(Shape("rv", 16, 8, 8, 2, 1), dtype=torch.float32, device="cpu", seed=2)
    calls = []

    def check(case, dout, *, grads, tol, poison, router=False):
        calls.append(router)
        return {"errors": {"out": 0.0 if router else err}, "worst": "out", "passed": router, "pairs": p.R,
                "tol": tol}

    def never(*a, **k):
        raise AssertionError("timed")

    monkeypatch.setattr(runner, "check_case", check)
    monkeypatch.setattr(runner, "bench_ms", never)
    assert REGISTRY["torch"].router_variant
    opts = runner.RunOptions(backends=["torch"], device=torch.device("cpu"), dtype=torch.float32, tol=0.1,
                             warmup=0.0, rep=0.0, verbose=False)
    row = runner.run_backend("torch", p, opts, useful_flops(p.R, 8, 8), lambda s: None)
    assert calls == [False]
    assert row["status"] == "FAIL" and "router" not in row["check"] and row["fwd"] is None
    assert row["message"] == f"wrong result: rel err of out = {err:.3g} > tol 0.1"


def test_env_info_switches_leave_out_the_commit_override(monkeypatch):
    """env_info's switches are the SONICMOE_* variables set for the run but SONICMOE_GIT_COMMIT, which is no library
    switch: it names the commit (git_commit) instead."""
    commit = f"{int(torch.randint(0, 2**62, (), generator=_fresh_generator())):040x}"
    monkeypatch.setenv("SONICMOE_GIT_COMMIT", commit)
    monkeypatch.setenv("SONICMOE_AGG_CHUNK", "0")
    env = report.env_info(torch.device("cpu"))
    assert env["git_commit"] == commit
    assert env["switches"]["SONICMOE_AGG_CHUNK"] == "0" and "SONICMOE_GIT_COMMIT" not in env["switches"]


def test_results_document_names_its_command_and_its_file_ends_in_a_newline(tmp_path):
    """build_results' command is "sonicmoe bench" and the arguments, one space between each; write_results ends the
    file in a newline (a text file: cat, diff and git read its last line whole)."""
    import datetime as dt

    tag = "".join(chr(ord("a") + int(i)) for i in torch.randint(0, 26, (6,), generator=_fresh_generator()))
    argv = ["--preset", "tiny", "--tag", tag]
    doc = report.build_results([], {"device_type": "cpu"}, argv, {}, dt.datetime(2026, 1, 2, tzinfo=dt.timezone.utc))
    assert doc["command"] == f"sonicmoe bench --preset tiny --tag {tag}"
    text = report.write_results(doc, tmp_path / "r.json").read_text()
    assert text.endswith("}\n") and not text.endswith("\n\n")
    assert _strict_load(tmp_path / "r.json")["command"] == doc["command"]


# ---------------------------------------------------------------------------------------------------
# the backends' registry, the measurements, the problems and the shapes (mutation probe: cx22_*)


def test_default_backends_add_installed_libraries_only(monkeypatch):
    """``default`` adds a backend that is off by default only where it is a competitor library (kind "library") whose
    module is installed: a non-default backend named after an installed module (json) stays out, a library of that
    name joins, a library whose module is missing does not."""
    monkeypatch.setattr(baselines, "REGISTRY", dict(baselines.REGISTRY))
    base = set(baselines.resolve_backends("default"))
    for name, kind in (("json", "baseline"), ("sonicmoe_no_such_library", "library")):
        baselines.register_baseline(BaselineSpec(name, baselines._loop_factory, "t", kind=kind, default=False))
    got = baselines.resolve_backends("default")
    assert "json" not in got and "sonicmoe_no_such_library" not in got and set(got) == base
    baselines.register_baseline(BaselineSpec("json", baselines._loop_factory, "t", kind="library", default=False))
    assert baselines.resolve_backends("default")[-1] == "json"


def test_triton_backend_unavailable_when_its_kernels_cannot_be_imported(monkeypatch):
    """Under the interpreter in float32, a sonicmoe.ops.moe_function that cannot be imported makes the triton backend
    Unavailable with the reason (a skipped row), not an ImportError that ends the run."""
    import sonicmoe.ops

    p = make_problem(Shape("t", 8, 16, 8, 4, 2), dtype=torch.float32, device="cpu", seed=3)
    monkeypatch.setattr(baselines, "interpreting", lambda: True)
    monkeypatch.delattr(sonicmoe.ops, "moe_function", raising=False)
    monkeypatch.setitem(sys.modules, "sonicmoe.ops.moe_function", None)  # an import of it fails
    with pytest.raises(baselines.Unavailable, match="sonicmoe.ops.moe_function is not importable"):
        baselines._triton_factory(p, {})


def test_timing_loops_time_each_call_in_ms_over_a_window_in_ms():
    """_wall_ms: each call's time in milliseconds (a call sleeping 3 ms reads at least 3, and under 1500 unless a
    load slows it 500-fold; in microseconds it would read 3000), and the measured window ``rep`` in milliseconds
    too: a 30 ms window of 3 ms calls times at most 11 of them (5 at least), not the 1000-call cap a window in
    seconds would reach."""
    import time

    from sonicmoe.bench import measure

    sleep_ms = 3.0 + float(torch.rand((), generator=_fresh_generator()))
    times = measure._wall_ms(lambda: time.sleep(sleep_ms / 1e3), 0.0, 30.0, torch.device("cpu"))
    assert 5 <= len(times) <= 11, len(times)
    assert all(sleep_ms <= t < 500 * sleep_ms for t in times), times


def test_default_tol_is_tighter_for_finer_dtypes_and_fp16_passes_it():
    """default_tol orders the dtypes by their precision: float64 < float32 < float16 < bfloat16 (fp16 keeps 3 more
    mantissa bits than bf16, 8x finer rounding: its bound is under half of bf16's), an unlisted dtype gets the loosest
    (bf16's); the torch backend in fp16 passes its own dtype's bound."""
    from sonicmoe.bench.measure import check_case, default_tol

    tols = [default_tol(t) for t in (torch.float64, torch.float32, torch.float16, torch.bfloat16)]
    assert tols == sorted(tols) and len(set(tols)) == 4
    assert default_tol(torch.float16) <= default_tol(torch.bfloat16) / 2
    assert default_tol(torch.int8) == default_tol(torch.bfloat16)
    seed = int(torch.randint(0, 2**31 - 1, (), generator=_fresh_generator()))
    p = make_problem(Shape("h", 64, 32, 16, 4, 2), dtype=torch.float16, device="cpu", seed=seed)
    res = check_case(REGISTRY["torch"].factory(p, {}), p.dout, grads=True, tol=default_tol(torch.float16),
                     poison=False)
    assert res["passed"], res


def test_triton_errors_become_rows(monkeypatch):
    """A backend that raises one of Triton's own errors (TritonError: an interpreter error, out of resources) gets an
    "error" row naming it; the run goes on."""
    from triton.runtime.errors import InterpreterError, TritonError

    from sonicmoe.bench import runner
    from sonicmoe.bench.measure import bench_error_types

    assert TritonError in bench_error_types()
    p = make_problem(Shape("e", 16, 8, 8, 2, 1), dtype=torch.float32, device="cpu", seed=1)
    opts = runner.RunOptions(backends=["bad"], device=torch.device("cpu"), dtype=torch.float32, verbose=False)

    def factory(problem, options):
        raise InterpreterError("kernel broke")

    monkeypatch.setitem(REGISTRY, "bad", BaselineSpec("bad", factory, "t", default=False))
    row = runner.run_backend("bad", p, opts, useful_flops(p.R, 8, 8), lambda s: None)
    assert row["status"] == "error" and row["message"].startswith("setup: InterpreterError") and row["fwd"] is None


def test_worst_expert_of_two_dimensional_pieces_is_over_the_rms_expert():
    """_NormAcc on (experts, k) pieces (a 2-D gradient of one row per expert): the worst expert is the largest error
    norm of an expert's row over the RMS norm of the experts' rows, not the largest single element over the RMS
    element."""
    from sonicmoe.bench.measure import _NormAcc

    g = _fresh_generator()
    ref = torch.randn(8, 5, generator=g, dtype=torch.float64)
    got = ref + 1e-3 * torch.randn(8, 5, generator=g, dtype=torch.float64)
    got[3] += torch.randn(5, generator=g, dtype=torch.float64)
    acc = _NormAcc()
    acc.add(got[:4], ref[:4])
    acc.add(got[4:], ref[4:])
    rms = math.sqrt(sum(float(r.dot(r)) for r in ref) / 8)
    worst = max(math.sqrt(float((a - b).dot(a - b))) for a, b in zip(got, ref))
    assert acc.local() == pytest.approx(worst / rms, rel=1e-9)
    assert acc.value() == pytest.approx(float((got - ref).norm() / ref.norm()), rel=1e-9)


def test_token_rounding_without_its_function_is_token_rounding_unavailable(monkeypatch):
    """A sonicmoe.token_rounding that imports but lacks the token_rounding function (an ImportError that is no
    ModuleNotFoundError) is TokenRoundingUnavailable, naming the module, as a missing module is."""
    import types

    from sonicmoe.bench import problem as bp

    monkeypatch.setitem(sys.modules, "sonicmoe.token_rounding", types.ModuleType("sonicmoe.token_rounding"))
    with pytest.raises(bp.TokenRoundingUnavailable, match="sonicmoe.token_rounding is not importable"):
        bp.load_token_rounding()
    monkeypatch.setitem(sys.modules, "sonicmoe.token_rounding", None)
    with pytest.raises(bp.TokenRoundingUnavailable, match="sonicmoe.token_rounding is not importable"):
        bp.load_token_rounding()


def test_granularity_of_a_shape_is_not_floored():
    """G = d/n is a true ratio: a shape whose n exceeds d (the granularity sweep's n1024 of d768) has G below 1, not 0,
    and one where n does not divide d keeps the fraction."""
    g = _fresh_generator()
    n = int(torch.randint(17, 64, (), generator=g))
    d = n + int(torch.randint(1, n, (), generator=g))  # n < d < 2n: d/n has a fraction
    assert Shape("g", 8, d, n, 4, 2).G == pytest.approx(d / n) and Shape("g", 8, d, n, 4, 2).G % 1 > 0
    assert Shape("w", 8, n, d, 4, 2).G == pytest.approx(n / d) and 0 < Shape("w", 8, n, d, 4, 2).G < 1
    wide = [s for s in PRESETS["granularity"] if s.n > s.d]
    assert wide and all(0 < s.G < 1 for s in wide)


def test_parse_shape_names_the_flag_and_text_of_a_non_integer():
    """--shape with a non-integer number: a ValueError naming the flag and the text, not int()'s bare message."""
    # letters before "x" only: parse_shape reads an "x" as a separator
    word = "".join(chr(ord("a") + int(i)) for i in torch.randint(0, 23, (5,), generator=_fresh_generator()))
    text = f"64,{word},16,4,2"
    with pytest.raises(ValueError, match=rf"^--shape wants integers T,d,n,E,K, got '{text}'$"):
        parse_shape(text)


def test_route_builds_a_routing_of_the_routers_experts(monkeypatch):
    """route's routing has one expert per row of W_r (E), not one per column (d): its expert counts are the top-k
    choice's, E of them, under top-k and under a token_rounding that returns bare pairs (the routing built here)."""
    from sonicmoe.bench import problem as bp

    g = _fresh_generator()
    T, d, E = 48, 24, 6
    x, w = torch.randn(T, d, generator=g), torch.randn(E, d, generator=g)
    r = bp.route(x, w, 2, "topk")
    assert r.routing.num_experts == E
    assert torch.equal(r.routing.expert_counts().long(), torch.bincount(r.topk_ids.reshape(-1).long(), minlength=E))
    real = bp.load_token_rounding()
    monkeypatch.setattr(bp, "load_token_rounding",
                        lambda: lambda router, **kw: tuple(getattr(real(router, **kw), a)
                                                           for a in ("pair_token", "pair_expert", "pair_scores")))
    tr = bp.route(x, w, 2, "token_rounding", m_tile=8)
    assert tr.routing.num_experts == E and int(tr.routing.expert_counts().sum()) == tr.pair_token.numel() > 0
    assert torch.equal(tr.routing.expert_counts().long(), torch.bincount(tr.pair_expert.long(), minlength=E))
