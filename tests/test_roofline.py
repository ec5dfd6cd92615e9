"""benchmarks/roofline.py: the per-kernel FLOP and DRAM-byte model and the floors drawn from it (CPU)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
roofline = runpy.run_path(str(REPO / "benchmarks" / "roofline.py"))


def test_flops_sum_to_the_spec_counts():
    t, d, n, e, k = 24576, 1536, 256, 128, 8
    r = t * k
    costs = roofline["kernel_costs"](t, d, n, e, r)
    fwd = sum(costs[name][0] for name in roofline["FORWARD"])
    total = sum(flops for flops, _ in costs.values())
    assert fwd == 6 * r * n * d  # SPEC §6: forward 6·TK·n·d
    assert total == 18 * r * n * d  # forward + backward 18·TK·n·d


def test_bytes_count_each_operand_once():
    t, d, n, e, r = 64, 32, 48, 4, 128
    costs = roofline["kernel_costs"](t, d, n, e, r, elem_bytes=2)
    x, w1, w2 = 2 * t * d, 2 * e * 2 * n * d, 2 * e * d * n
    h, a, y = 2 * r * 2 * n, 2 * r * n, 2 * r * d
    assert costs[roofline["UP"]][1] == x + w1 + h + a
    assert costs[roofline["DOWN"]][1] == a + w2 + y
    assert costs[roofline["DH"]][1] == x + w2 + 2 * h + a + 4 * r  # dS (R,) float32, written once
    assert costs[roofline["DW1"]][1] == h + x + w1
    assert costs[roofline["AGG"]] == (0.0, y + x)


def test_floors_pick_the_binding_limit():
    fl = roofline["floors"]({"gemm": (2e12, 1e9), "copy": (0.0, 3e9)}, tflops=1000.0, dram_tbs=3.0)
    assert fl["gemm"]["bound"] == "compute" and fl["gemm"]["floor_ms"] == pytest.approx(2.0)
    assert fl["copy"]["bound"] == "memory" and fl["copy"]["floor_ms"] == pytest.approx(1.0)


def test_cli_reads_a_breakdown_and_writes_json(tmp_path, capsys, monkeypatch):
    t, d, n, e, k = 256, 64, 32, 8, 2
    rows = [{"kernel": name, "ms": 0.5, "tflops": None} for name in roofline["KERNELS"]]
    breakdown = tmp_path / "b.json"
    breakdown.write_text(json.dumps({"device": "x", "records": [
        {"shape": [t, d, n, e, k], "routing": "topk", "R": t * k, "rows": rows},
        {"shape": [t, d, n, e, k], "routing": "routing", "R": 0, "rows": []}]}))
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["roofline.py", "--breakdown", str(breakdown), "--tflops", "1", "--dram-tbs",
                                      "1", "--json", str(out)])
    runpy.run_path(str(REPO / "benchmarks" / "roofline.py"), run_name="__main__")
    res = json.loads(out.read_text())["results"]
    assert len(res) == 1  # the routing-profile record is skipped
    kern = res[0]["kernels"][roofline["UP"]]
    costs = roofline["kernel_costs"](t, d, n, e, t * k)[roofline["UP"]]
    assert kern["floor_ms"] == pytest.approx(max(costs[0], costs[1]) / 1e9)
    assert kern["over_floor"] == pytest.approx(0.5 / kern["floor_ms"])
    assert res[0]["sums"]["fwd+bwd"]["ms"] == pytest.approx(0.5 * 8)
    assert "up-proj" in capsys.readouterr().out


def test_cli_refuses_a_file_that_is_not_a_breakdown(tmp_path, capsys, monkeypatch):
    """A `sonicmoe bench` results file given to --breakdown: a usage error naming it, not a KeyError."""
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"schema": "sonicmoe-bench/1", "results": []}))
    monkeypatch.setattr(sys, "argv", ["roofline.py", "--breakdown", str(bench), "--tflops", "1", "--dram-tbs", "1"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(REPO / "benchmarks" / "roofline.py"), run_name="__main__")
    assert exc.value.code == 2
    assert "a sonicmoe bench results file, not a kernel_breakdown.py --json file" in capsys.readouterr().err


def test_plot_from_a_written_result(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    t, d, n, e, k = 256, 64, 32, 8, 2
    rec = {"shape": [t, d, n, e, k], "routing": "topk", "R": t * k,
           "rows": [{"kernel": name, "ms": 0.5, "tflops": None} for name in roofline["KERNELS"]]}
    doc = {"peaks": {"tflops": 1.0, "dram_tbs": 1.0}, "results": [roofline["analyse"](rec, 1.0, 1.0)]}
    src = tmp_path / "r.json"
    src.write_text(json.dumps(doc))
    png = tmp_path / "r.png"
    monkeypatch.setattr(sys, "argv", ["roofline.py", "--plot-from", str(src), "--plot", str(png)])
    runpy.run_path(str(REPO / "benchmarks" / "roofline.py"), run_name="__main__")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
