"""``sonicmoe train``: learning on the real stdlib corpus, logs and plot, exact resume, --data, CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from test_expert_parallel import _rank_worker, _spawn  # the two-process helpers (tests/ is on sys.path)

from sonicmoe.testing import rel_err
from sonicmoe.train import cli, loop
from sonicmoe.train.config import config_from_dict, make_config
from sonicmoe.train.data import ByteCorpus, stdlib_source_files
from sonicmoe.train.loop import Progress, lr_at
from sonicmoe.train.model import ModelConfig, MoETransformer
from sonicmoe.train.report import expert_load_summary, plot_losses

# A tiny model on the real corpus: T = 8·64 = 512 tokens per MoE layer, E=4, K=2, n=32, d=32.
TINY = ["--d-model", "32", "--layers", "2", "--heads", "2", "--experts", "4", "--top-k", "2",
        "--expert-size", "32", "--seq-len", "64", "--batch-size", "8", "--lr", "1e-2", "--warmup", "5",
        "--max-bytes", "262144", "--eval-every", "20", "--eval-batches", "2", "--log-every", "5",
        "--profile-every", "10", "--save-every", "0", "--device", "cpu", "--backend", "torch",
        "--seed", "3", "--no-progress"]
STEPS = 40
T, K, LAYERS, E = 8 * 64, 2, 2, 4
# the TrainConfig fields of gpt-oss's MoE block and their defaults (a config saved before them has none)
NEW_DEFAULTS = {"activation": "swiglu", "router_bias": False, "expert_bias": False}
GPT_OSS_FLAGS = ["--activation", "clamped_swiglu", "--router-bias", "--expert-bias"]


def _run(out, *extra: str) -> dict:
    assert cli.main([*TINY, "--out", str(out), *extra]) == 0
    return json.loads((out / "log.json").read_text())


def _losses(log: dict) -> list[float]:
    return [s["loss"] for s in log["steps"]]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """One uninterrupted 40-step run; its output directory and log."""
    out = tmp_path_factory.mktemp("baseline")
    return out, _run(out, "--steps", str(STEPS))


def test_loss_goes_down_on_stdlib_corpus(baseline):
    _, log = baseline
    losses = _losses(log)
    assert [s["step"] for s in log["steps"]] == list(range(1, STEPS + 1))
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    assert first > 5.0  # ~ln 256 at initialisation
    assert last < first - 1.5, (first, last)
    evals = log["evals"]
    assert [e["step"] for e in evals] == [0, 20, 40]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.0
    assert log["final_val_loss"] == evals[-1]["val_loss"]
    assert log["data"]["files"] > 1 and "python" in log["data"]["source"]


def test_log_and_plot(baseline):
    out, log = baseline
    for key in ("config", "env", "model", "steps", "evals", "profile", "final_val_loss", "final_train_loss",
                "tokens_per_s", "moe_time_share", "peak_memory", "expert_load", "wall_time_s"):
        assert key in log, key
    for key in ("device_name", "torch", "triton", "commit", "date"):
        assert key in log["env"], key
    assert log["config"]["experts"] == E and log["config"]["steps"] == STEPS
    assert set(log["steps"][0]) >= {"step", "loss", "router_loss", "lr", "grad_norm"}
    # the lr each step trained with (update step - 1 of the schedule: the first is the warm-up's first), the final
    # train loss over the last log window (--log-every 5), the bits per byte of each evaluation
    cfg = config_from_dict(log["config"])
    assert [s["lr"] for s in log["steps"]] == [lr_at(s["step"] - 1, cfg) for s in log["steps"]]
    assert log["steps"][0]["lr"] == pytest.approx(1e-2 / 5)
    assert log["final_train_loss"] == pytest.approx(sum(s["loss"] for s in log["steps"][-5:]) / 5)
    assert all(e["val_bpb"] == pytest.approx(e["val_loss"] / math.log(2)) for e in log["evals"])
    assert log["final_val_bpb"] == log["evals"][-1]["val_bpb"]
    assert log["tokens_per_s"] > 0
    # the throughput meter counts the steps after the min(5, 40 // 5) = 5 warm-up steps that are not profiled: steps
    # 6 to 40 but 10, 20, 30 and 40, each of all T tokens once (a stretch cut by a log line, an eval or a checkpoint
    # included)
    assert log["throughput"]["tokens"] == (STEPS - 5 - 4) * T
    assert log["tokens_per_s"] == pytest.approx(log["throughput"]["tokens"] / log["throughput"]["seconds"])
    assert log["model"]["dtype"] == "float32" and log["model"]["autocast"] is None  # --dtype auto on the CPU
    assert log["resumed_from"] is None and log["steps_done"] == STEPS  # a fresh run, not one resumed at step 0
    assert [p["step"] for p in log["profile"]] == [10, 20, 30, 40]
    for p in log["profile"]:  # each profiled step's share: its MoE layers' forward and backward over the step
        assert p["moe_share"] == pytest.approx((p["moe_forward_s"] + p["moe_backward_s"]) / p["step_s"])
        assert 0.0 < p["moe_share"] < 1.0
    assert all(p["moe_forward_s"] > 0 and p["moe_backward_s"] > 0 for p in log["profile"])  # both directions timed
    assert 0.0 < log["moe_time_share"] < 1.0
    # the MoE time over the profiled steps: forward and backward of every profiled step, over their step time
    moe_s = sum(p["moe_forward_s"] + p["moe_backward_s"] for p in log["profile"])
    step_s = sum(p["step_s"] for p in log["profile"])
    assert log["moe_time"] == {"profiled_steps": 4, "moe_s": pytest.approx(moe_s, rel=1e-12),
                               "step_s": pytest.approx(step_s, rel=1e-12)}
    assert log["moe_time_share"] == pytest.approx(moe_s / step_s, rel=1e-12)
    assert log["peak_memory"]["mib"] > 0
    load = log["expert_load"]
    assert len(load["per_layer"]) == LAYERS
    for layer in load["per_layer"]:
        assert len(layer["counts"]) == E
        assert sum(layer["counts"]) == STEPS * T * K  # every routed pair of every step counted once
        assert layer["min_frac"] <= 1 / E <= layer["max_frac"]
        # each step's counts sorted: the i-th busiest expert of every step, so the per-step curve descends, counts
        # every pair, and its ends bound the summed load's (sum of each step's max >= the max of the sums)
        srt = layer["step_sorted_counts"]
        assert len(srt) == E and sum(srt) == STEPS * T * K and srt == sorted(srt, reverse=True)
        assert srt[0] >= max(layer["counts"]) and srt[-1] <= min(layer["counts"])
        assert layer["step_max_over_mean"] >= layer["max_over_mean"] > 1.0
    assert load["mean_step_max_over_mean"] >= load["mean_max_over_mean"]
    assert (out / "ckpt.pt").is_file()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (out / "loss.png").exists()
    else:
        assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_continues_exactly(baseline, tmp_path):
    _, full = baseline
    part = _run(tmp_path, "--steps", str(STEPS), "--stop-after", "15")
    assert part["steps_done"] == 15
    assert _losses(part) == _losses(full)[:15]  # same seed, same losses
    # as a checkpoint written before the gpt-oss options existed: its config lacks them, they take their defaults
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert all(ckpt["config"].pop(k) == v for k, v in NEW_DEFAULTS.items())
    torch.save(ckpt, tmp_path / "ckpt.pt")
    resumed_dir = tmp_path / "resumed"
    assert cli.main(["--resume", str(tmp_path / "ckpt.pt"), "--out", str(resumed_dir), "--no-progress"]) == 0
    resumed = json.loads((resumed_dir / "log.json").read_text())
    assert all(resumed["config"][k] == v for k, v in NEW_DEFAULTS.items())
    assert resumed["resumed_from"] == 15 and resumed["steps_done"] == STEPS
    assert _losses(resumed) == _losses(full)
    assert resumed["final_val_loss"] == full["final_val_loss"]
    # the stopped run's evaluations (steps 0 and 15) from the checkpoint, none again at the resume, then the full
    # run's after step 15
    assert [e["step"] for e in part["evals"]] == [0, 15]
    assert resumed["evals"] == part["evals"] + [e for e in full["evals"] if e["step"] > 15]
    for key in ("counts", "step_sorted_counts"):
        assert resumed["expert_load"]["per_layer"][0][key] == full["expert_load"]["per_layer"][0][key]
    # the finished run resumed again: refused (exit 2), its log.json left as it was (it used to be rewritten with an
    # empty throughput meter)
    before = (resumed_dir / "log.json").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--resume", str(resumed_dir / "ckpt.pt"), "--no-progress"])
    assert exit_info.value.code == 2 and (resumed_dir / "log.json").read_bytes() == before


def test_same_seed_same_losses_in_another_process(baseline, tmp_path):
    _, full = baseline
    res = subprocess.run([sys.executable, "-m", "sonicmoe", "train", *TINY, "--steps", str(STEPS),
                          "--stop-after", "8", "--eval-every", "0", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    other = json.loads((tmp_path / "log.json").read_text())
    assert _losses(other) == _losses(full)[:8]


def test_data_directory(tmp_path):
    data = tmp_path / "texts"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    (data / "sub" / "b.md").write_text("# notes\n" + "pack my box with five dozen liquor jugs\n" * 60)
    (data / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)  # binary: skipped
    out = tmp_path / "run"
    log = _run(out, "--data", str(data), "--steps", "6", "--seq-len", "32", "--eval-every", "0")
    assert log["data"]["files"] == 2 and log["data"]["source"] == str(data)
    assert log["steps_done"] == 6 and log["final_val_loss"] is not None
    corpus = ByteCorpus.load(str(data / "a.txt"), 10_000, 0.1)
    assert corpus.num_files == 1 and corpus.val.numel() == int(0.1 * (corpus.train.numel() + corpus.val.numel()))


def test_corpus_skips_hidden_files_and_stops_at_the_cap(tmp_path):
    """A directory's hidden files and folders (.git, editor swap files) are not read; the corpus stops at --max-bytes
    exactly (the last file cut short), and its train and validation splits partition the bytes read."""
    data = tmp_path / "texts"
    (data / ".git").mkdir(parents=True)
    (data / "a.txt").write_text("alpha " * 100)
    (data / ".notes.txt").write_text("hidden " * 100)
    (data / ".git" / "config").write_text("[core] " * 100)
    corpus = ByteCorpus.load(str(data), 10_000, 0.1)
    blob = bytes(torch.cat([corpus.train, corpus.val]).tolist())
    assert corpus.num_files == 1 and blob.startswith(b"# ==== a.txt ====\n")
    assert b"hidden" not in blob and b"[core]" not in blob
    capped = ByteCorpus.load(str(data), 300, 0.1)
    assert capped.train.numel() + capped.val.numel() == 300
    assert bytes(torch.cat([capped.train, capped.val]).tolist()) == blob[:300]


def test_seq_len_check_matches_the_train_windows():
    """check_seq_len passes where train_batch can draw a window (seq_len + 2 bytes) and refuses one byte fewer, which
    would fail later in the run with torch.randint's error instead of a usage error."""
    split = torch.arange(34, dtype=torch.uint8)
    corpus = ByteCorpus(train=split, val=split, source="x", num_files=1)
    corpus.check_seq_len(32)
    x, y = corpus.train_batch(2, 32, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert x.shape == y.shape == (2, 32) and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="fewer than seq_len"):
        corpus.check_seq_len(33)
    # the validation split is checked too (a short one would fail at the first evaluation), and named
    short_val = ByteCorpus(train=torch.arange(200, dtype=torch.uint8), val=split, source="x", num_files=1)
    short_val.check_seq_len(32)
    with pytest.raises(ValueError, match="the validation split has 34 bytes"):
        short_val.check_seq_len(33)


def test_corpus_digest_sees_the_split():
    """The same bytes split elsewhere (another --val-fraction) are another corpus for a resumed run: its training and
    validation windows differ."""
    blob = torch.arange(200, dtype=torch.uint8)
    a = ByteCorpus(train=blob[:180], val=blob[180:], source="x", num_files=1)
    b = ByteCorpus(train=blob[:190], val=blob[190:], source="x", num_files=1)
    assert a.digest != b.digest and a.digest == ByteCorpus(blob[:180], blob[180:], "y", 2).digest
    # one byte changed in either split, at the same sizes, is another corpus too
    g = _fresh_generator()
    for split in ("train", "val"):
        t = getattr(a, split).clone()
        i = int(torch.randint(0, t.numel(), (), generator=g))
        t[i] ^= 1 + int(torch.randint(0, 255, (), generator=g))
        other = ByteCorpus(**{"train": a.train, "val": a.val, split: t}, source="x", num_files=1)
        assert other.digest != a.digest, split


def test_token_rounding_passes_through(tmp_path):
    pytest.importorskip("sonicmoe.token_rounding")
    log = _run(tmp_path, "--steps", "4", "--routing", "token_rounding", "--rounding", "up", "--m-tile", "16",
               "--eval-every", "0", "--profile-every", "0")
    assert log["config"]["routing"] == "token_rounding" and log["config"]["rounding"] == "up"
    for layer in log["expert_load"]["per_layer"]:
        assert all(c % 16 == 0 for c in layer["counts"])  # every step's T_e a multiple of M_tile


def test_deepseek_v3_routing_trains_and_resumes(tmp_path):
    """--router-order sigmoid_then_topk --renormalize --routed-scaling-factor 2.5 --n-group 2 --topk-group 1
    --bias-update-rate: the options reach the layers (E = 4 in two groups, K = 2: each token's experts are one
    group), the selection biases move (and travel in the checkpoint), and an interrupted run resumes to
    the uninterrupted one's losses and biases."""
    opts = ["--steps", "12", "--router-order", "sigmoid_then_topk", "--renormalize", "--routed-scaling-factor",
            "2.5", "--n-group", "2", "--topk-group", "1", "--bias-update-rate", "0.01", "--aux-loss-coef", "0",
            "--eval-every", "0", "--profile-every", "0"]
    full = _run(tmp_path / "full", *opts)
    c = full["config"]
    assert (c["router_order"], c["renormalize"], c["routed_scaling_factor"], c["bias_update_rate"]) == (
        "sigmoid_then_topk", True, 2.5, 0.01)
    assert (c["n_group"], c["topk_group"]) == (2, 1)
    model = torch.load(tmp_path / "full" / "ckpt.pt", weights_only=False)["model"]
    biases = [v for k, v in model.items() if k.endswith("e_score_correction_bias")]
    assert len(biases) == LAYERS and all(b.dtype == torch.float32 and b.abs().max() > 0 for b in biases)
    # each step moves every bias entry by ±0.01 or 0 (sign of mean − count)
    assert all(torch.allclose(b / 0.01, (b / 0.01).round(), atol=1e-4) for b in biases)
    assert all(math.isfinite(v) for v in _losses(full))
    for layer in full["expert_load"]["per_layer"]:  # a token's pair of experts is a group: {0, 1} or {2, 3}
        assert layer["counts"][0] == layer["counts"][1] and layer["counts"][2] == layer["counts"][3]
    _run(tmp_path / "part", *opts, "--stop-after", "5")
    assert cli.main(["--resume", str(tmp_path / "part" / "ckpt.pt"), "--out", str(tmp_path / "resumed"),
                     "--no-progress"]) == 0
    resumed = json.loads((tmp_path / "resumed" / "log.json").read_text())
    assert _losses(resumed) == _losses(full)
    again = torch.load(tmp_path / "resumed" / "ckpt.pt", weights_only=False)["model"]
    assert all(torch.equal(again[k], v) for k, v in model.items() if k.endswith("e_score_correction_bias"))
    with pytest.raises(SystemExit):  # the bias update needs the sigmoid order
        cli.main([*TINY, "--out", str(tmp_path / "bad"), "--bias-update-rate", "0.01"])


def test_deepseek_v3_router_with_token_rounding_trains(tmp_path):
    """--routing token_rounding under the sigmoid order (no groups): every layer's expert loads are tile multiples in
    training (T = 512 tokens, M_tile 16), the losses are finite and fall, and the selection biases move."""
    log = _run(tmp_path / "tr", "--steps", "12", "--routing", "token_rounding", "--m-tile", "16", "--router-order",
               "sigmoid_then_topk", "--renormalize", "--routed-scaling-factor", "2.5", "--bias-update-rate", "0.01",
               "--aux-loss-coef", "0", "--eval-every", "0", "--profile-every", "0")
    assert (log["config"]["routing"], log["config"]["router_order"]) == ("token_rounding", "sigmoid_then_topk")
    losses = _losses(log)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    model = torch.load(tmp_path / "tr" / "ckpt.pt", weights_only=False)["model"]
    assert all(v.abs().max() > 0 for k, v in model.items() if k.endswith("e_score_correction_bias"))
    with pytest.raises(SystemExit):  # token rounding with groups is refused
        cli.main([*TINY, "--out", str(tmp_path / "bad"), "--routing", "token_rounding", "--router-order",
                  "sigmoid_then_topk", "--n-group", "2", "--topk-group", "1"])


def test_shared_expert_trains_and_resumes(tmp_path):
    """--shared-expert-size 24 --shared-expert-gate: every layer has a gated shared expert (in the checkpoint), its
    weights and gate move, the losses are finite and fall, and an interrupted run resumes to the uninterrupted
    one's losses. A gate without a shared expert is refused."""
    opts = ["--steps", "10", "--shared-expert-size", "24", "--shared-expert-gate", "--eval-every", "0",
            "--profile-every", "0"]
    full = _run(tmp_path / "full", *opts)
    assert (full["config"]["shared_expert_size"], full["config"]["shared_expert_gate"]) == (24, True)
    losses = _losses(full)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    model = torch.load(tmp_path / "full" / "ckpt.pt", weights_only=False)["model"]
    shared = {k: v for k, v in model.items() if ".shared_expert" in k}
    assert len(shared) == 3 * LAYERS
    assert all(v.shape == (1, 48, 32) for k, v in shared.items() if k.endswith("shared_experts.gate_up_proj"))
    _run(tmp_path / "part", *opts, "--stop-after", "4")
    early = torch.load(tmp_path / "part" / "ckpt.pt", weights_only=False)["model"]
    assert all(not torch.equal(early[k], v) for k, v in shared.items())  # steps 5-10 moved each of them
    assert cli.main(["--resume", str(tmp_path / "part" / "ckpt.pt"), "--out", str(tmp_path / "resumed"),
                     "--no-progress"]) == 0
    assert _losses(json.loads((tmp_path / "resumed" / "log.json").read_text())) == losses
    with pytest.raises(SystemExit):
        cli.main([*TINY, "--out", str(tmp_path / "bad"), "--shared-expert-gate"])


def test_gpt_oss_options_reach_every_layer():
    """--activation clamped_swiglu --router-bias --expert-bias: every MoE layer of the built model has gpt-oss's
    activation, a router bias and expert biases (none of them by default or with --no-*), the
    options sonicmoe.GPT_OSS_OPTIONS sets; the biases are not weight-decayed."""
    from sonicmoe import GPT_OSS_OPTIONS
    from sonicmoe.train.config import config_from_dict
    from sonicmoe.train.loop import Optimizer, model_config

    def build(*flags: str):
        args = cli.build_parser().parse_args([*TINY, *flags])
        cfg = make_config("cpu-tiny", **{k: getattr(args, k) for k in cli._OVERRIDES})
        return cfg, MoETransformer(model_config(cfg))

    cfg, model = build(*GPT_OSS_FLAGS)
    assert (cfg.activation, cfg.router_bias, cfg.expert_bias) == ("clamped_swiglu", True, True)
    layers = model.moe_layers()
    assert len(layers) == LAYERS
    for layer in layers:
        c = layer.config
        assert (c.activation, c.router_bias, c.bias) == (GPT_OSS_OPTIONS["activation"], GPT_OSS_OPTIONS["router_bias"],
                                                         GPT_OSS_OPTIONS["bias"])
        assert layer.gate.bias is not None and layer.gate.bias.shape == (E,)
        assert layer.experts.gate_up_proj_bias.shape == (E, 64) and layer.experts.down_proj_bias.shape == (E, 32)
    opt = Optimizer(model, cfg, torch.device("cpu"))
    decayed = {id(p) for p in opt.adamw.param_groups[0]["params"]}
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    assert len(biases) == 3 * LAYERS and not any(id(p) in decayed for p in biases)
    assert model.moe_layers()[0].gate.weight.dim() == 2 and id(model.moe_layers()[0].gate.weight) in decayed
    for flags in ((), ("--activation", "swiglu", "--no-router-bias", "--no-expert-bias")):
        cfg, model = build(*flags)
        assert {k: getattr(cfg, k) for k in NEW_DEFAULTS} == NEW_DEFAULTS
        for layer in model.moe_layers():
            assert layer.config.activation == "swiglu" and layer.gate.bias is None
            assert layer.experts.gate_up_proj_bias is None and layer.experts.down_proj_bias is None
    # the saved config (log.json, the checkpoint) round-trips the options; one saved without them takes the defaults
    cfg = make_config("cpu-tiny", activation="clamped_swiglu", router_bias=True, expert_bias=True)
    assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    old = config_from_dict({k: v for k, v in cfg.to_dict().items() if k not in NEW_DEFAULTS})
    assert {k: getattr(old, k) for k in NEW_DEFAULTS} == NEW_DEFAULTS
    assert config_from_dict(cfg.to_dict(), activation="swiglu").activation == "swiglu"


def test_gpt_oss_block_trains_and_resumes(tmp_path, capsys):
    """--activation clamped_swiglu --router-bias --expert-bias: the losses are finite and fall, the router and expert
    biases (in the checkpoint) move, an interrupted run resumes with the options to the uninterrupted one's losses,
    and a resume that would change the model's parameters (--no-router-bias) is refused."""
    opts = ["--steps", "10", *GPT_OSS_FLAGS, "--eval-every", "0", "--profile-every", "0"]
    full = _run(tmp_path / "full", *opts)
    assert {k: full["config"][k] for k in NEW_DEFAULTS} == {"activation": "clamped_swiglu", "router_bias": True,
                                                           "expert_bias": True}
    losses = _losses(full)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    model = torch.load(tmp_path / "full" / "ckpt.pt", weights_only=False)["model"]
    biases = {k: v for k, v in model.items() if k.endswith("gate.bias") or k.endswith("_proj_bias")}
    assert len(biases) == 3 * LAYERS
    _run(tmp_path / "part", *opts, "--stop-after", "4")
    early = torch.load(tmp_path / "part" / "ckpt.pt", weights_only=False)["model"]
    assert all(not torch.equal(early[k], v) for k, v in biases.items())  # steps 5-10 moved each of them
    assert cli.main(["--resume", str(tmp_path / "part" / "ckpt.pt"), "--out", str(tmp_path / "resumed"),
                     "--no-progress"]) == 0
    resumed = json.loads((tmp_path / "resumed" / "log.json").read_text())
    assert resumed["config"] == {**full["config"], "resume": str(tmp_path / "part" / "ckpt.pt"),
                                 "out": str(tmp_path / "resumed"), "progress": False}
    assert _losses(resumed) == losses
    with pytest.raises(SystemExit):
        cli.main(["--resume", str(tmp_path / "part" / "ckpt.pt"), "--out", str(tmp_path / "bad"), "--no-progress",
                  "--no-router-bias"])
    assert "--router-bias: the checkpoint's model has router_bias=True" in capsys.readouterr().err


def test_bad_activation_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*TINY, "--out", "unused", "--activation", "gelu"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --activation: invalid choice" in err and "gelu" in err and "clamped_swiglu" in err
    with pytest.raises(ValueError, match="activation must be one of"):
        make_config("cpu-tiny", activation="gelu")
    with pytest.raises(ValueError, match="router_bias must be a bool"):
        make_config("cpu-tiny", router_bias="yes")


def test_resume_leaves_the_checkpoint_and_keeps_the_masters(tmp_path):
    """train(cfg, checkpoint) does not change the caller's checkpoint (history and AdamW state are its own copies);
    a mixed-precision (bf16) run resumed with float32 parameters continues from the saved float32 masters, and a
    float32 run resumed in bf16 starts its masters from the float32 weights (not their rounded copies); a checkpoint
    past the run's end is refused."""
    import copy

    from sonicmoe.train.config import config_from_dict
    from sonicmoe.train.loop import Optimizer, load_checkpoint, train

    _run(tmp_path / "bf16", "--steps", "6", "--stop-after", "3", "--dtype", "bfloat16", "--eval-every", "0",
         "--profile-every", "0")
    ckpt = load_checkpoint(tmp_path / "bf16" / "ckpt.pt")
    before = copy.deepcopy(ckpt)
    captured = {}
    load = Optimizer.load_state_dict

    def spy(self, state):
        load(self, state)
        captured["params"] = [p.detach().clone() for p in self.params]
        captured["masters"] = None if self.masters is None else [m.clone() for m in self.masters]

    Optimizer.load_state_dict = spy
    try:
        cfg = config_from_dict(ckpt["config"], dtype="float32", out=str(tmp_path / "f32"), stop_after=4,
                               progress=False)
        train(cfg, ckpt)
        saved = ckpt["optimizer"]["masters"]
        assert saved is not None and captured["masters"] is None  # float32 parameters: no masters of their own
        assert all(torch.equal(p, m) for p, m in zip(captured["params"], saved))
        assert any(not torch.equal(m, m.bfloat16().float()) for m in saved)  # the masters carry more than bf16
        assert ckpt["history"] == before["history"]
        for a, b in zip(ckpt["optimizer"]["adamw"]["state"].values(), before["optimizer"]["adamw"]["state"].values()):
            assert all(torch.equal(a[k], b[k]) for k in a)
        # float32 -> bf16: the masters start from the float32 model state
        f32 = load_checkpoint(tmp_path / "f32" / "ckpt.pt")
        assert f32["optimizer"]["masters"] is None
        cfg = config_from_dict(f32["config"], dtype="bfloat16", out=str(tmp_path / "back"), stop_after=5,
                               progress=False)
        train(cfg, f32)
        from sonicmoe.train.loop import model_config

        names = [n for n, _ in MoETransformer(model_config(cfg)).named_parameters()]
        assert len(names) == len(captured["masters"])
        assert all(torch.equal(m, f32["model"][n]) for n, m in zip(names, captured["masters"]))
    finally:
        Optimizer.load_state_dict = load
    with pytest.raises(ValueError, match="past this run's end"):
        train(config_from_dict(ckpt["config"], out=str(tmp_path / "x"), stop_after=2, progress=False), ckpt)
    # at the checkpoint's step (3): nothing to train either (a finished run resumed again rewrote its log.json)
    with pytest.raises(ValueError, match="is at step 3, at this run's end"):
        train(config_from_dict(ckpt["config"], out=str(tmp_path / "y"), stop_after=3, progress=False), ckpt)
    assert not (tmp_path / "y" / "log.json").exists()


@pytest.mark.parametrize("option,value", [("grad_clip", 0.0), ("grad_clip", -1.0), ("lr", float("nan")),
                                          ("weight_decay", -0.1), ("weight_decay", float("inf")), ("beta1", 1.0),
                                          ("beta2", 1.0), ("min_lr_ratio", 1.5), ("lr", 0.0),
                                          ("grad_clip", float("nan")), ("lr", float("inf"))])
def test_bad_optimiser_options_are_refused(option, value):
    with pytest.raises(ValueError, match=option):
        make_config("cpu-tiny", **{option: value}).validate()


@pytest.mark.parametrize("option,value", [("expert_parallel", 0), ("expert_parallel", 3), ("val_fraction", 1.0),
                                          ("stop_after", 0), ("val_fraction", 0.0), ("warmup", -1),
                                          ("steps", 2.5), ("eval_every", 2.5), ("seed", -1), ("heads", 0),
                                          ("device", "tpu"), ("dtype", "float16"), ("rounding", "floor"),
                                          ("shared_expert_gate", True), ("steps", True), ("warmup", False),
                                          ("stop_after", True), ("stop_after", 2.5),
                                          ("heads", 128)])  # cpu-tiny's d = 128 in 128 heads of one channel
def test_bad_run_options_are_refused(option, value):
    """A ValueError naming the option: expert_parallel 0 (a ZeroDivisionError otherwise) or not dividing E = 16,
    no training data left, no validation data, a negative warm-up (its learning rates would be negative), a count
    that is not an integer (range() of it fails later) or is a bool (True == 1 to Python), a negative seed, no
    heads (a ZeroDivisionError otherwise),
    a device or dtype the run cannot resolve, a rounding subroutine or a shared-expert gate (no shared expert) the
    MoE layer refuses (checked up front, not at the model's build),
    a run stopped before its first step, rotary heads of odd size (its halves cannot pair up)."""
    with pytest.raises(ValueError, match=option):
        make_config("cpu-tiny", **{option: value})


def test_config_errors_name_the_values_and_the_presets():
    """The refusals quote each value under its own name; an unknown preset is a ValueError listing the presets (not
    the KeyError of PRESETS[name])."""
    with pytest.raises(ValueError, match=r"^top_k=17 must be at most experts=16$"):
        make_config("cpu-tiny", top_k=17)
    with pytest.raises(ValueError, match=r"^experts=16 must be a multiple of expert_parallel=3$"):
        make_config("cpu-tiny", expert_parallel=3)
    with pytest.raises(ValueError, match=r"^preset must be one of \('cpu-tiny', 'h100'\), got 'h200'$"):
        make_config("h200")


@pytest.mark.parametrize("rate", [-0.01, float("inf"), float("nan")])
def test_bias_update_rate_must_be_finite_and_non_negative(rate):
    """bias_update_rate under router_order='sigmoid_then_topk' (the order it applies to): a negative rate would move
    the selection bias toward the busiest experts, an infinite or NaN one would make every bias inf or NaN; a finite
    rate >= 0 is taken."""
    with pytest.raises(ValueError, match="bias_update_rate must be a finite number >= 0"):
        make_config("cpu-tiny", router_order="sigmoid_then_topk", bias_update_rate=rate)
    assert make_config("cpu-tiny", router_order="sigmoid_then_topk", bias_update_rate=1e-3).bias_update_rate == 1e-3


def test_run_options_at_their_bounds_are_taken():
    """K = E (every expert for every token) is a valid model; a saved config with a field this version no longer
    has still rebuilds (checkpoints of older versions resume)."""
    from sonicmoe.train.config import config_from_dict

    cfg = make_config("cpu-tiny", experts=4, top_k=4, stop_after=1)
    assert (cfg.top_k, cfg.experts) == (4, 4)
    assert config_from_dict({**cfg.to_dict(), "retired_option": 1}) == cfg
    # an override of None keeps the saved value (the CLI passes every option it was not given as None)
    again = config_from_dict(cfg.to_dict(), lr=None, top_k=None, steps=7)
    assert again == dataclasses.replace(cfg, steps=7)
    # the optimiser's closed bounds: no floor on the learning rate, no weight decay, no momentum (beta = 0)
    low = make_config("cpu-tiny", min_lr_ratio=0.0, weight_decay=0.0, beta1=0.0, beta2=0.0, seed=0, warmup=0)
    assert (low.min_lr_ratio, low.weight_decay, low.beta1, low.beta2) == (0.0, 0.0, 0.0, 0.0)
    # a saved config is validated as a new one (a checkpoint edited by hand, an override given with --resume)
    with pytest.raises(ValueError, match="top_k"):
        config_from_dict({**cfg.to_dict(), "top_k": 5})
    with pytest.raises(ValueError, match="lr"):
        config_from_dict(cfg.to_dict(), lr=-1.0)


def test_make_config_takes_the_preset_then_the_overrides():
    """A preset sets its fields, an override replaces one (None: the preset's), an unknown field is a ValueError
    naming it (not the dataclass's TypeError)."""
    from sonicmoe.train.config import PRESETS

    cfg = make_config("h100", layers=2, seq_len=None)
    assert (cfg.d_model, cfg.experts, cfg.seq_len, cfg.layers) == (768, 64, PRESETS["h100"]["seq_len"], 2)
    with pytest.raises(ValueError, match="unknown TrainConfig fields: \\['layer'\\]"):
        make_config("cpu-tiny", layer=3)


def test_resume_takes_new_hyperparameters_and_refuses_another_seed_or_corpus(tmp_path, capsys):
    """A resumed run applies a --weight-decay given with --resume (AdamW's own load brought the saved one back, and
    the log claimed the new one); --seed, whose random streams the checkpoint carries, and a corpus other than the
    one it trained on (here --max-bytes; its SHA-256 travels in the checkpoint) are usage errors (both passed
    silently before session 89)."""
    short = ["--steps", "6", "--eval-every", "0", "--profile-every", "0"]
    part = _run(tmp_path / "part", *short, "--stop-after", "3")
    ckpt = tmp_path / "part" / "ckpt.pt"
    assert len(part["data"]["sha256"]) == 64
    assert torch.load(ckpt, weights_only=True)["corpus_sha256"] == part["data"]["sha256"]
    assert cli.main(["--resume", str(ckpt), "--out", str(tmp_path / "wd"), "--weight-decay", "0.5",
                     "--no-progress"]) == 0
    groups = torch.load(tmp_path / "wd" / "ckpt.pt", weights_only=True)["optimizer"]["adamw"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    for extra, match in ((["--seed", "99"], "--seed 99: the checkpoint's run has seed=3"),
                         (["--max-bytes", "131072"], "differs from the one the checkpoint trained on"),
                         (["--heads", "4"], "--heads: the checkpoint's model has heads=2"),  # the q/k/v split
                         (["--activation", "clamped_swiglu"], "the checkpoint's model has activation='swiglu'"),
                         (["--router-order", "sigmoid_then_topk"], "has router_order='topk_then_softmax'"),
                         (["--layers", "3"], "--layers: the checkpoint's model has layers=2"),
                         # --stop-after at the checkpoint's step: nothing to train, said before any model is built
                         (["--stop-after", "3"], "at or past this run's end (step 3)")):
        with pytest.raises(SystemExit) as e:
            cli.main(["--resume", str(ckpt), "--out", str(tmp_path / "x"), "--no-progress", *extra])
        assert e.value.code == 2 and match in capsys.readouterr().err
    from sonicmoe.train.loop import check_resume_corpus

    with pytest.raises(ValueError, match="differs"):
        check_resume_corpus({"corpus_sha256": "0" * 64}, part["data"]["sha256"])
    check_resume_corpus({}, part["data"]["sha256"])  # a checkpoint from before the digest: taken


def test_diverged_run_exits_1(tmp_path, capsys):
    """A run whose loss turns non-finite warns at that step and exits 1 (it exited 0 with NaN losses before)."""
    out = tmp_path / "nan"
    assert cli.main([*TINY, "--out", str(out), "--steps", "4", "--eval-every", "0", "--profile-every", "0",
                     "--log-every", "1", "--lr", "1e30", "--warmup", "1", "--grad-clip", "inf"]) == 1
    err = capsys.readouterr().err
    log = json.loads((out / "log.json").read_text())
    step = log["first_nonfinite_step"]
    assert step is not None and not math.isfinite(log["steps"][step - 1]["loss"])
    # the first such step (the later ones stay non-finite): every step before it trained on finite losses
    assert step > 1 and all(math.isfinite(s["loss"] + s["router_loss"]) for s in log["steps"][:step - 1])
    assert err.count("the run has diverged") == 1
    assert f"at step {step}: the run has diverged" in err and "the run diverged" in err


def test_token_rounding_that_would_empty_the_experts_is_refused(tmp_path, capsys):
    """Token rounding to the nearest multiple of M_tile with fewer than M_tile/2 tokens per expert on average (to the
    lower one: fewer than M_tile) would route most experts no token: the layers would train as zeros. TINY: 512
    tokens, K = 2, E = 4: 256 per expert. A usage error naming the cure; up-rounding and the bound itself run. Under
    top-k --rounding and --m-tile do nothing, and the run says so."""
    for rounding, m_tile in (("nearest", "1024"), ("down", "512")):
        with pytest.raises(SystemExit) as e:
            cli.main([*TINY, "--out", "unused", "--routing", "token_rounding", "--rounding", rounding,
                      "--m-tile", m_tile])
        assert e.value.code == 2 and "rounds most experts' counts to 0" in capsys.readouterr().err
    assert cli.main([*TINY, "--out", str(tmp_path / "topk"), "--steps", "1", "--eval-every", "0", "--rounding", "down",
                     "--m-tile", "1024"]) == 0  # under top-k they do nothing: said, not refused
    assert "--rounding and --m-tile apply to --routing token_rounding only" in capsys.readouterr().err
    from sonicmoe.train.loop import check_ranks

    # the cure named: the largest m_tile whose bound 128 tokens per expert meet (M_tile/2 <= 128 to the nearest
    # multiple, M_tile <= 128 to the lower one)
    for rounding, m_tile, cure in (("nearest", 512, 256), ("down", 256, 128), ("up", 4096, None)):
        cfg = make_config("cpu-tiny", experts=4, top_k=2, batch_size=8, seq_len=64, routing="token_rounding",
                          rounding=rounding, m_tile=m_tile)
        check_ranks(cfg, torch.device("cpu"), 1)
        if rounding != "up":  # two data-parallel ranks: 128 tokens per expert in each rank's batch, under the bound
            with pytest.raises(ValueError, match=rf"with 128 tokens per expert.* --m-tile \(to at most {cure}\) or"):
                check_ranks(cfg, torch.device("cpu"), 2)
    with pytest.raises(ValueError, match="bias_update_rate must be a finite number"):
        make_config("cpu-tiny", router_order="sigmoid_then_topk", bias_update_rate=math.inf).validate()


def test_sonicmoe_command_dispatches_and_exits_with_its_code(monkeypatch, capsys):
    """``sonicmoe``: no command or --help prints the usage (exit 0), an unknown command is a usage error (exit 2,
    named on stderr), ``train`` / ``bench`` get the arguments after the command and their exit code is the command's
    (None: 0); ``python -m sonicmoe`` exits with it."""
    from sonicmoe import cli as top
    from sonicmoe.bench import cli as bench_cli

    for argv in ([], ["-h"], ["--help"]):
        assert top.main(argv) == 0, argv
        assert "usage: sonicmoe {train,bench}" in capsys.readouterr().out
    assert top.main(["tarin", "--steps", "2"]) == 2
    assert "unknown command 'tarin'" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(cli, "main", lambda argv: seen.append(("train", argv)) or 3)
    monkeypatch.setattr(bench_cli, "main", lambda argv: seen.append(("bench", argv)))
    assert top.main(["train", "--steps", "2"]) == 3
    assert top.main(["bench", "--preset", "tiny"]) == 0
    assert seen == [("train", ["--steps", "2"]), ("bench", ["--preset", "tiny"])]
    res = subprocess.run([sys.executable, "-m", "sonicmoe", "tarin"], capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 2 and "unknown command 'tarin'" in res.stderr


class _Sleepy(torch.autograd.Function):
    """y = 2·x, sleeping a known time in the forward and in the backward."""

    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        import time

        time.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        import time

        time.sleep(ctx.bwd_s)
        return grad * 2, None, None


class _SleepyLayer(torch.nn.Module):
    def __init__(self, fwd_s: float, bwd_s: float, as_tuple: bool = False):
        super().__init__()
        self.fwd_s, self.bwd_s, self.as_tuple = fwd_s, bwd_s, as_tuple
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        y = _Sleepy.apply(x * self.w, self.fwd_s, self.bwd_s)
        return (y, None) if self.as_tuple else y  # as_tuple: MoELayerOutput's (output, router info)


def test_moe_profiler_sums_every_layers_forward_and_backward():
    """MoEProfiler on two layers of known forward and backward times (the second returns a tuple, as a layer with
    return_router_info=True): the sums over both layers, each direction bracketed by its own hooks; nothing while
    inactive or under no_grad (an eval pass in a profiled step); reset() zeroes both sums; an input that needs no
    gradient (the weights do) is timed forward without a backward hook on it."""
    from sonicmoe.train.profiling import MoEProfiler

    a, b = _SleepyLayer(0.06, 0.02), _SleepyLayer(0.02, 0.06, as_tuple=True)
    prof = MoEProfiler([a, b], torch.device("cpu"))
    x = torch.randn(5, requires_grad=True)
    b(a(x))[0].sum().backward()
    assert prof.forward_s == 0.0 and prof.backward_s == 0.0  # inactive
    prof.active = True
    b(a(x))[0].sum().backward()
    assert 0.08 <= prof.forward_s < 0.08 + 0.5 and 0.08 <= prof.backward_s < 0.08 + 0.5
    prof.reset()
    assert prof.forward_s == 0.0 and prof.backward_s == 0.0
    with torch.no_grad():
        b(a(x))
    assert prof.forward_s == 0.0
    out = a(torch.randn(5))
    assert out.requires_grad and 0.06 <= prof.forward_s
    prof.remove()
    prof.reset()
    a(x)
    assert prof.forward_s == 0.0


def test_moe_profiler_syncs_cuda_around_each_measurement(monkeypatch):
    """On CUDA each of the four hooks synchronises the device before it reads the clock (the kernels run
    asynchronously: an unsynchronised clock reads the launch, not the work): per layer and profiled step, a sync
    before the forward's start and end, and before the backward's start and end; none while inactive or on the CPU.
    The device is only named, torch.cuda.synchronize counted, so this runs without a GPU."""
    from types import SimpleNamespace

    from sonicmoe.train import profiling
    from sonicmoe.train.profiling import MoEProfiler

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    clock = iter(range(1, 1000))
    monkeypatch.setattr(profiling, "time", SimpleNamespace(perf_counter=lambda: events.append("clock") or next(clock)))
    a, b = _SleepyLayer(0.0, 0.0), _SleepyLayer(0.0, 0.0, as_tuple=True)
    prof = MoEProfiler([a, b], torch.device("cuda", 0))
    x = torch.randn(5, requires_grad=True)
    b(a(x))[0].sum().backward()
    assert events == []  # inactive: no hook syncs
    prof.active = True
    b(a(x))[0].sum().backward()
    # 2 layers x (forward start, forward end, backward start, backward end): each clock read right after a sync
    assert events == ["sync", "clock"] * 8
    # the clock's ticks in hook order: a's forward 1-2, b's 3-4; backward: b starts (5) as its output's gradient
    # arrives; a's output gradient then starts a's backward (6) and ends b's (7, hooks in registration order); x's
    # gradient ends a's (8)
    assert prof.forward_s == (2 - 1) + (4 - 3) and prof.backward_s == (7 - 5) + (8 - 6)
    prof.remove()
    events.clear()
    layer = _SleepyLayer(0.0, 0.0)
    cpu = MoEProfiler([layer], torch.device("cpu"))
    cpu.active = True
    layer(x).sum().backward()
    assert events == ["clock"] * 4  # the CPU: timed, never synchronised
    cpu.remove()


def test_moe_profiler_skips_a_bracket_it_did_not_open():
    """A forward whose start the profiler did not see (armed inside the layer's forward) adds no forward time, and
    a layer whose output the loss does not use (its input's gradient arrives by another path, a residual) adds no
    backward time: the end hooks only close a bracket their start hook opened (a KeyError before the guard)."""
    from sonicmoe.train.profiling import MoEProfiler

    class Arming(torch.nn.Module):
        def forward(self, x):
            prof.active = True  # turned on between the pre-hook and the forward hook
            return x * 2

    layer = Arming()
    prof = MoEProfiler([layer], torch.device("cpu"))
    x = torch.randn(4, requires_grad=True)
    layer(x).sum().backward()
    assert prof.forward_s == 0.0 and prof.backward_s == 0.0
    unused = _SleepyLayer(0.0, 0.0)
    prof2 = MoEProfiler([unused], torch.device("cpu"))
    prof2.active = True
    unused(x)  # its output is dropped: no backward of the layer
    (x * 3).sum().backward()  # x's gradient (the input hook fires) without the layer's backward having started
    assert prof2.forward_s > 0.0 and prof2.backward_s == 0.0
    prof.remove()
    prof2.remove()


def test_moe_profiler_reset_forgets_open_brackets_and_times_an_output_without_grad():
    """reset() forgets a forward bracket opened but not closed (the profiler disarmed inside the layer) and a backward
    bracket opened but not closed (an input that needs no gradient): after it, a forward hook or an input-gradient
    hook without its own start adds nothing. A layer whose output needs no gradient (no parameters, a constant
    input) is timed forward and gets no backward hook (registering one would raise)."""
    import time

    from sonicmoe.train.profiling import MoEProfiler

    class Switching(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))
            self.set_to = None

        def forward(self, x):
            if self.set_to is not None:
                prof.active = self.set_to  # flipped between the pre-hook and the forward hook
            time.sleep(0.002)
            return x * self.w

    layer = Switching()
    prof = MoEProfiler([layer], torch.device("cpu"))
    prof.active, layer.set_to = True, False
    layer(torch.randn(4))  # the pre-hook opens a bracket, the forward hook (disarmed) leaves it open
    prof.reset()
    layer.set_to = True  # now the pre-hook is disarmed and the forward hook armed
    layer(torch.randn(4))
    assert prof.forward_s == 0.0
    layer.set_to = None
    x = torch.randn(4)  # needs no gradient: the layer's backward starts (w needs one) but no input hook ends it
    layer(x).sum().backward()
    assert prof.forward_s > 0.0 and prof.backward_s == 0.0  # started, never ended: nothing added
    prof.reset()
    xg = torch.randn(4, requires_grad=True)
    layer(xg)  # output dropped: xg's gradient arrives by another path, the layer's backward never starts
    (xg * 3).sum().backward()
    assert prof.backward_s == 0.0
    prof.remove()
    class Plain(torch.nn.Module):  # no parameters
        def forward(self, x):
            time.sleep(0.002)
            return x * 2

    plain = Plain()
    prof2 = MoEProfiler([plain], torch.device("cpu"))
    prof2.active = True
    out = plain(torch.randn(3))
    assert not out.requires_grad and prof2.forward_s > 0.0 and prof2.backward_s == 0.0
    prof2.remove()


def test_moe_profiler_end_closes_only_its_own_calls_bracket():
    """A layer's backward that started and never ended (its input needs no gradient) leaves its bracket open; without
    a reset() in between, a later call's input-gradient hook whose own start never came (its output dropped, the
    input's gradient arriving by another path) adds nothing: the end hooks close only the bracket their own forward
    call opened. Before the fix (brackets keyed by the layer alone) it added the stale bracket, the whole pause. A
    call after both is timed as usual, from its own start."""
    import time

    from sonicmoe.train.profiling import MoEProfiler

    pause, bwd = 0.3 + 0.2 * float(torch.rand(())), 0.01
    layer = _SleepyLayer(0.0, bwd)
    prof = MoEProfiler([layer], torch.device("cpu"))
    prof.active = True
    layer(torch.randn(5)).sum().backward()  # w needs a gradient, the input does not: started, never ended
    assert prof.backward_s == 0.0
    time.sleep(pause)
    x = torch.randn(5, requires_grad=True)
    layer(x)  # dropped: this call's backward never starts
    (x * 3).sum().backward()  # its input hook fires with no start of its own
    assert prof.backward_s == 0.0
    layer(torch.randn(5, requires_grad=True)).sum().backward()
    assert bwd <= prof.backward_s < pause
    prof.remove()


def test_moe_profiler_reset_forgets_a_started_backward_of_the_same_call():
    """reset() forgets a backward bracket opened by a call whose end may still come: a backward that reaches the
    layer's output but stops short of its input (``inputs=`` the weight), then, after reset(), the input's gradient
    by another path fires that same call's end hook, which must add nothing (the start belongs before the reset)."""
    import time

    from sonicmoe.train.profiling import MoEProfiler

    layer = _SleepyLayer(0.0, 0.0)
    prof = MoEProfiler([layer], torch.device("cpu"))
    prof.active = True
    x = torch.randn(5, requires_grad=True)
    layer(x).sum().backward(inputs=[layer.w])  # the output's gradient arrives, the input's is never computed
    assert x.grad is None and prof.backward_s == 0.0
    prof.reset()
    time.sleep(0.2 + 0.1 * float(torch.rand(())))
    (x * 3).sum().backward()  # x's gradient: the end hook of the call whose start came before reset()
    assert prof.backward_s == 0.0
    prof.remove()


def test_help():
    res = subprocess.run([sys.executable, "-m", "sonicmoe", "train", "--help"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert "--preset" in res.stdout and "--resume" in res.stdout and "cpu-tiny" in res.stdout
    for flag in ("--activation {swiglu,clamped_swiglu}", "--router-bias", "--no-router-bias", "--expert-bias"):
        assert flag in res.stdout, flag
    assert "gpt-oss's clamped SwiGLU" in res.stdout


def test_bad_options_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--d-model", "30", "--heads", "4", "--out", "unused"])
    assert e.value.code == 2
    assert "d_model" in capsys.readouterr().err


def test_resume_from_a_file_that_is_not_a_checkpoint_exits_with_usage(tmp_path, capsys):
    """--resume of a file torch.load cannot read (it used to end in an UnpicklingError traceback), of an empty file, or
    of another torch file: exit 2 naming the file."""
    garbage, other, empty = tmp_path / "garbage.pt", tmp_path / "other.pt", tmp_path / "empty.pt"
    garbage.write_bytes(b"not a checkpoint")
    torch.save([1, 2], other)
    empty.write_bytes(b"")  # a checkpoint whose write never began (a full disk): torch.load raises EOFError
    for path, why in ((garbage, "torch.load failed: UnpicklingError"), (other, "format"),
                      (empty, "torch.load failed: EOFError")):
        with pytest.raises(SystemExit) as e:
            cli.main(["--resume", str(path), "--no-progress"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"{path} is not a sonicmoe train checkpoint" in err and why in err


def test_load_checkpoint_refuses_a_directory_and_another_format(tmp_path):
    """load_checkpoint: a directory is no checkpoint file (FileNotFoundError, not torch.load's IsADirectoryError); a
    torch file of another checkpoint format (a dict whose ``format`` is not this one's) is refused like any other
    file; this format's dict is returned as saved."""
    import re

    with pytest.raises(FileNotFoundError, match="no such checkpoint file"):
        loop.load_checkpoint(tmp_path)
    path = tmp_path / "ckpt.pt"
    step = int(torch.randint(1, 1000, ()))
    torch.save({"format": loop.CHECKPOINT_FORMAT + 1, "step": step}, path)
    with pytest.raises(ValueError, match=re.escape(f"{path} is not a sonicmoe train checkpoint (format ")):
        loop.load_checkpoint(path)
    torch.save({"format": loop.CHECKPOINT_FORMAT, "step": step}, path)
    assert loop.load_checkpoint(path) == {"format": loop.CHECKPOINT_FORMAT, "step": step}


def test_check_resume_corpus_names_both_digests():
    """check_resume_corpus' refusal names this corpus' SHA-256 first and the checkpoint's in brackets (12 hex digits
    each), so the user sees which one changed; the same digest passes."""
    import hashlib

    mine, saved = (hashlib.sha256(torch.randint(0, 256, (16,), dtype=torch.uint8).numpy().tobytes()).hexdigest()
                   for _ in range(2))
    with pytest.raises(ValueError) as e:
        loop.check_resume_corpus({"corpus_sha256": saved}, mine)
    assert f"the corpus (SHA-256 {mine[:12]}) differs from the one the checkpoint trained on ({saved[:12]})" in str(
        e.value)
    loop.check_resume_corpus({"corpus_sha256": mine}, mine)


@pytest.mark.parametrize("extra,match", [(["--max-bytes", "10"], "--data (the standard library): corpus from "),
                                         (["--max-bytes", "10"], "has only 10 bytes"),
                                         (["--max-bytes", "4096", "--seq-len", "5000"], "fewer than seq_len"),
                                         (["--out", "/proc/sonicmoe-cannot-write"], "--out /proc/sonicmoe")])
def test_data_and_out_errors_exit_with_usage(extra, match, tmp_path, capsys):
    """A corpus too small, a window longer than the corpus, an --out that cannot be made: exit 2 naming the cause,
    before any model is built (they used to end in a traceback from inside train())."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--preset", "cpu-tiny", "--steps", "1", "--no-progress", "--out", str(tmp_path / "run"), *extra])
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_out_inside_data_is_refused(tmp_path, capsys, monkeypatch):
    """--out inside the --data directory (e.g. --data . with the default runs/...) is a usage error: the run's log and
    checkpoint would become training data, and its resume would find another corpus. --out beside it is taken."""
    data = tmp_path / "corpus"
    data.mkdir()
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    (data / "a.txt").write_bytes(bytes(torch.randint(32, 127, (20000,), generator=g).tolist()))
    monkeypatch.chdir(data)
    for out in (["--out", str(data / "runs" / "x")], []):  # explicit, and the default runs/<preset>-<time>
        with pytest.raises(SystemExit) as e:
            cli.main([*TINY, "--steps", "1", "--data", ".", "--max-bytes", "20000", *out])
        assert e.value.code == 2 and "lies inside --data ." in capsys.readouterr().err
    assert not (data / "runs").exists()  # refused before anything was written
    log = _run(tmp_path / "beside", "--steps", "1", "--data", str(data), "--max-bytes", "20000", "--eval-every", "0",
               "--profile-every", "0")
    assert log["steps_done"] == 1


def _summary_log(**extra) -> dict:
    """A finished run's log as train() returns it (what the closing summary reads)."""
    return {"final_val_loss": 2.0, "final_val_bpb": 2.0 / math.log(2), "final_train_loss": 2.1, "steps_done": 40,
            "wall_time_s": 12.0, "tokens_per_s": 5000.0, "moe_time_share": None, "peak_memory": {"mib": 1.0,
            "kind": "cpu"}, "expert_load": expert_load_summary([[1, 1]]), "first_nonfinite_step": None, **extra}


def _cli_with_train_stubbed(monkeypatch, tmp_path, logs):
    """Stub ``cli.train`` (no model is built): each call is recorded in the returned list as (cfg, checkpoint) and
    returns ``logs[0]`` (a caller may swap it). Runs from ``tmp_path`` with RANK and WORLD_SIZE unset; returns that
    list and a corpus of 20000 random printable bytes."""
    seen = []
    monkeypatch.setattr(cli, "train", lambda cfg, checkpoint, corpus: seen.append((cfg, checkpoint)) or logs[0])
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    corpus = tmp_path / "corpus.txt"
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    corpus.write_bytes(bytes(torch.randint(32, 127, (20000,), generator=g).tolist()))
    return seen, corpus


def test_cli_builds_the_run_it_passes_to_train(tmp_path, monkeypatch, capsys):
    """What ``sonicmoe train`` hands train() (stubbed: no model is built): on the CPU the cpu-tiny preset, --out
    runs/cpu-tiny-<date>-<time> (made), a progress bar unless --no-progress; the summary from rank 0 only, exit 1
    for a diverged run. With --resume: the checkpoint's configuration (a --preset is ignored, and said so), --out the
    checkpoint's folder, new hyperparameters taken; an option that shapes the parameters is refused naming its flag
    as typed; --stop-after at the checkpoint's step is nothing to train, one step later is. A WORLD_SIZE that is no
    int is a usage error naming it."""
    import re

    if torch.cuda.is_available():
        pytest.skip("the default preset is h100 where a GPU is visible")
    logs = [_summary_log()]
    seen, corpus = _cli_with_train_stubbed(monkeypatch, tmp_path, logs)
    small = ["--data", str(corpus)]
    assert cli.main(small) == 0
    cfg, checkpoint = seen.pop()
    assert checkpoint is None and cfg.preset == "cpu-tiny" and (cfg.d_model, cfg.experts, cfg.steps) == (128, 16, 300)
    assert re.fullmatch(r"runs/cpu-tiny-\d{8}-\d{6}", cfg.out) and (tmp_path / cfg.out).is_dir()
    assert cfg.progress is True and cfg.resume is None
    assert "done: step 40" in capsys.readouterr().out
    monkeypatch.setenv("RANK", "1")  # another data-parallel rank: trains, prints no summary
    assert cli.main([*small, "--no-progress", "--out", str(tmp_path / "b")]) == 0
    assert seen.pop()[0].progress is False and "done:" not in capsys.readouterr().out
    monkeypatch.setenv("RANK", "0")
    logs[0] = _summary_log(first_nonfinite_step=7)
    assert cli.main([*small, "--out", str(tmp_path / "c")]) == 1
    assert "non-finite training loss from step 7" in capsys.readouterr().err and seen.pop()
    logs[0] = _summary_log()
    # --resume: a checkpoint at step 2 of a 6-step run (loaded through a stand-in)
    saved = make_config("cpu-tiny", steps=6, data=str(corpus), out=str(tmp_path / "elsewhere")).to_dict()
    ckpt = tmp_path / "run" / "ckpt.pt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"")
    fake = {"config": saved, "step": 2}
    monkeypatch.setattr(cli, "load_checkpoint", lambda path: fake)
    assert cli.main(["--resume", str(ckpt), "--preset", "h100", "--lr", "0.5", "--stop-after", "3"]) == 0
    cfg, checkpoint = seen.pop()
    assert "--preset h100 ignored: resuming with the checkpoint's configuration" in capsys.readouterr().out
    assert checkpoint is fake and cfg.out == str(ckpt.parent) and cfg.resume == str(ckpt)
    assert (cfg.preset, cfg.d_model, cfg.steps, cfg.lr, cfg.stop_after) == ("cpu-tiny", 128, 6, 0.5, 3)
    assert cli.main(["--resume", str(ckpt)]) == 0
    assert "ignored" not in capsys.readouterr().out and seen.pop()[0].stop_after is None
    for extra, match in ((["--router-order", "sigmoid_then_topk"],
                          "--router-order: the checkpoint's model has router_order='topk_then_softmax'"),
                         (["--shared-expert-size", "8"], "--shared-expert-size: the checkpoint's model has "
                          "shared_expert_size=0"),
                         (["--stop-after", "2"], "at step 2, at or past this run's end (step 2)")):
        with pytest.raises(SystemExit) as e:
            cli.main(["--resume", str(ckpt), *extra])
        assert e.value.code == 2 and match in capsys.readouterr().err, extra
    fake["step"] = 6
    with pytest.raises(SystemExit) as e:
        cli.main(["--resume", str(ckpt)])
    assert e.value.code == 2 and "at or past this run's end (step 6)" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(SystemExit) as e:
        cli.main([*small, "--out", str(tmp_path / "d")])
    assert e.value.code == 2 and "WORLD_SIZE='two' (set by torchrun) must be an int" in capsys.readouterr().err
    assert not seen


def test_cli_builds_every_option_into_the_run_and_guards_its_resume(tmp_path, monkeypatch, capsys):
    """Every option of ``sonicmoe train`` but the run's own (--preset, --out, --resume, --no-progress) overrides the
    configuration train() gets (train stubbed: no model is built), floats parsed as floats; --m-tile alone under top-k
    is noted. --data that does not exist or holds no file, and --resume of a directory, are usage errors naming them.
    A resume keeps the checkpoint's --renormalize unless given, refuses each option that shapes the parameters
    (--d-model, --experts, --expert-size, --expert-bias), naming the checkpoint's value, and a corpus other than the
    checkpoint's."""
    if torch.cuda.is_available():
        pytest.skip("the default preset is h100 where a GPU is visible")
    seen, corpus = _cli_with_train_stubbed(monkeypatch, tmp_path, [_summary_log()])
    dests = {a.dest for a in cli.build_parser()._actions} - {"help", "preset", "out", "resume", "no_progress"}
    assert dests == set(cli._OVERRIDES)
    small = ["--data", str(corpus), "--no-progress"]
    assert cli.main([*small, "--out", str(tmp_path / "a"), "--z-loss-coef", "0.25", "--grad-clip", "0.5",
                     "--val-fraction", "0.125", "--m-tile", "64"]) == 0
    cfg = seen.pop()[0]
    assert (cfg.z_loss_coef, cfg.grad_clip, cfg.val_fraction, cfg.m_tile) == (0.25, 0.5, 0.125, 64)
    assert "note: --m-tile apply to --routing token_rounding only; this run routes by topk" in capsys.readouterr().err
    missing, empty = tmp_path / "missing", tmp_path / "empty"
    empty.mkdir()
    for data, why in ((missing, "no such file or directory"), (empty, "the directory holds no file")):
        with pytest.raises(SystemExit) as e:
            cli.main(["--data", str(data), "--no-progress", "--out", str(tmp_path / "b")])
        assert e.value.code == 2 and f"error: --data {data}: {why}" in capsys.readouterr().err
    # --resume: a checkpoint at step 2 of a 6-step DeepSeek-V3-routed run (loaded through a stand-in)
    saved = make_config("cpu-tiny", steps=6, data=str(corpus), router_order="sigmoid_then_topk",
                        renormalize=True).to_dict()
    ckpt = tmp_path / "run" / "ckpt.pt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"")
    fake = {"config": saved, "step": 2}
    monkeypatch.setattr(cli, "load_checkpoint", lambda path: fake)
    assert cli.main(["--resume", str(ckpt)]) == 0
    assert seen.pop()[0].renormalize is True
    assert cli.main(["--resume", str(ckpt), "--no-renormalize"]) == 0
    assert seen.pop()[0].renormalize is False
    for flag, value in (("--d-model", 2 * saved["d_model"]), ("--experts", 2 * saved["experts"]),
                        ("--expert-size", 2 * saved["expert_size"]), ("--expert-bias", None)):
        name = flag[2:].replace("-", "_")
        with pytest.raises(SystemExit) as e:
            cli.main(["--resume", str(ckpt), flag, *([] if value is None else [str(value)])])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"{flag}: the checkpoint's model has {name}={saved[name]!r}; a resumed" in err
    with pytest.raises(SystemExit) as e:
        cli.main(["--resume", str(tmp_path)])
    assert e.value.code == 2 and f"--resume {tmp_path}: no such file" in capsys.readouterr().err
    fake["corpus_sha256"] = "0" * 64
    with pytest.raises(SystemExit) as e:
        cli.main(["--resume", str(ckpt)])
    assert e.value.code == 2 and "differs from the one the checkpoint trained on" in capsys.readouterr().err
    assert not seen


def test_lr_schedule():
    cfg = make_config("cpu-tiny", steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    lrs = [lr_at(i, cfg) for i in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # monotone cosine decay
    assert lr_at(100, cfg) == pytest.approx(0.1)
    assert lr_at(150, cfg) == pytest.approx(0.1)  # past `steps` the floor stays
    # the cosine starts at the peak right after the warm-up and is halfway down halfway through the decay steps
    assert lr_at(10, cfg) == pytest.approx(1.0) and lr_at(55, cfg) == pytest.approx(0.55)
    # a warm-up as long as the run leaves the cosine no steps (no division by zero): the peak at its first update,
    # then the floor
    flat = make_config("cpu-tiny", steps=10, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert [lr_at(i, flat) for i in (9, 10, 11)] == pytest.approx([1.0, 1.0, 0.1])


def test_resolve_device_and_dtype(monkeypatch):
    """resolve_device: ``auto`` is CUDA when torch sees a GPU, else the CPU (torch.cuda.is_available read through a
    stand-in: no GPU touched); resolve_dtype: each --dtype's parameter dtype (bfloat16 is bfloat16, not float16;
    amp-bf16 keeps float32 parameters under its autocast), ``auto`` bfloat16 on CUDA and float32 on the CPU."""
    for available, want in ((False, torch.device("cpu")), (True, torch.device("cuda"))):
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        assert loop.resolve_device("auto") == want and loop.resolve_device("cpu") == torch.device("cpu")
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [loop.resolve_dtype(name, cpu) for name in ("auto", "float32", "bfloat16", "amp-bf16")] == [
        torch.float32, torch.float32, torch.bfloat16, torch.float32]
    assert [loop.resolve_dtype(name, cuda) for name in ("auto", "float32", "bfloat16", "amp-bf16")] == [
        torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]


def test_stdlib_files_sorted_and_deterministic():
    root, files = stdlib_source_files()
    keys = [f.relative_to(root).as_posix() for f in files]
    assert keys == sorted(keys) and len(files) > 100
    assert not any(part in ("site-packages", "test") for k in keys for part in k.split("/")[:-1])
    assert stdlib_source_files()[1] == files


def test_model_forward_and_router_loss():
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(d_model=16, layers=2, heads=2, experts=4, top_k=2, expert_size=8,
                                       backend="torch", z_loss_coef=1e-3))
    idx = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        logits = model(idx)
        assert logits.shape == (2, 10, 256) and logits.dtype == torch.float32
        loss = model(idx, idx)
        assert abs(float(loss) - math.log(256)) < 0.5
        assert float(model.router_loss()) > 0
        assert all(float(m.z_loss) > 0 for m in model.moe_layers())  # so that router_loss must count it
        # the losses the layers returned are their attributes' (eager)
        assert torch.equal(model.router_loss(), sum(m.aux_loss + m.z_loss for m in model.moe_layers()))
        # causal: changing a later token leaves earlier logits unchanged
        idx2 = idx.clone()
        idx2[:, 7] = (idx2[:, 7] + 1) % 256
        torch.testing.assert_close(model(idx2)[:, :7], logits[:, :7])
        # (layers, E): each layer routed its 2·10 tokens K times
        counts = model.expert_counts()
        assert counts.shape == (2, 4) and counts.sum(dim=1).tolist() == [2 * 10 * 2] * 2


def test_bf16_model_keeps_the_dtypes():
    """apply_rotary computes in float32 and returns the input's dtype (a float32 q and k beside a bfloat16 v: SDPA
    refuses mixed dtypes); a bfloat16 model's logits are float32 anyway."""
    from sonicmoe.train.model import apply_rotary, rotary_tables

    g = _fresh_generator()
    L, hd = 5, 8
    cos, sin = rotary_tables(L, hd, torch.device("cpu"))
    x = torch.randn(2, 3, L, hd, generator=g).to(torch.bfloat16)
    got = apply_rotary(x, cos, sin)
    assert got.dtype == torch.bfloat16
    want = apply_rotary(x.float(), cos, sin)
    assert torch.equal(got, want.to(torch.bfloat16))
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=g)))
    model = MoETransformer(ModelConfig(d_model=16, layers=1, heads=2, experts=4, top_k=2, expert_size=8,
                                       backend="torch")).to(torch.bfloat16)
    with torch.no_grad():
        logits = model(torch.randint(0, 256, (2, 6), generator=g))
    assert logits.shape == (2, 6, 256) and logits.dtype == torch.float32


def test_model_options_reach_every_moe_layer():
    """Every MoE option of ModelConfig, set away from its default, is the option of each MoE layer built."""
    want = dict(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2, backend="torch", routing="topk",
                rounding="up", m_tile=16, aux_loss_coef=0.5, z_loss_coef=0.25, router_order="sigmoid_then_topk",
                renormalize=True, routed_scaling_factor=2.5, n_group=4, topk_group=2, shared_intermediate_size=8,
                shared_expert_gate=True, activation="clamped_swiglu", router_bias=True, bias=True)
    names = {"hidden_size": "d_model", "intermediate_size": "expert_size", "num_experts": "experts",
             "shared_intermediate_size": "shared_expert_size", "bias": "expert_bias"}
    mc = ModelConfig(layers=2, heads=2, **{names.get(k, k): v for k, v in want.items()})
    for layer in MoETransformer(mc).moe_layers():
        assert {k: getattr(layer.config, k) for k in want} == want
    tr = MoETransformer(ModelConfig(d_model=16, heads=2, experts=4, expert_size=8, routing="token_rounding"))
    assert all(layer.config.routing == "token_rounding" for layer in tr.moe_layers())


def test_model_init_scales_the_residual_branches_and_counts_parameters():
    """Attention's output projection and every expert's W2 (the shared expert's too) start 1/sqrt(2·layers) times
    their usual size (GPT-2's residual scaling); num_params counts the experts' weights and K/E of them as active."""
    d, layers, E, K, n, n_s = 32, 2, 4, 2, 8, 16
    torch.manual_seed(3)
    model = MoETransformer(ModelConfig(d_model=d, layers=layers, heads=2, experts=E, top_k=K, expert_size=n,
                                       shared_expert_size=n_s, backend="torch"))
    scale = 1 / math.sqrt(2 * layers)
    # N(0, 0.02): the embedding (tied to the output head) and the qkv projections (256·32 and 3·32·32 draws: the
    # sample std lies within 10% of 0.02)
    for w in (model.embed.weight, *(blk.attn.qkv.weight for blk in model.blocks)):
        assert abs(float(w.detach().std()) - 0.02) < 0.002 and abs(float(w.detach().mean())) < 0.002
    for blk in model.blocks:
        ratio = float(blk.attn.proj.weight.detach().std() / blk.attn.qkv.weight.detach().std())
        assert abs(ratio - scale) < 0.1 * scale, ratio
        for ex, width in ((blk.moe.experts, n), (blk.moe.shared_experts, n_s)):
            bound = scale / math.sqrt(width)  # U(-1/sqrt(n), 1/sqrt(n)) scaled
            assert 0.9 * bound < float(ex.down_proj.detach().abs().max()) <= bound
    counts = model.num_params()
    assert counts["experts"] == layers * E * 3 * n * d
    # with expert biases, b2 is scaled as W2 is (it adds to the same residual branch)
    biased = MoETransformer(ModelConfig(d_model=d, layers=layers, heads=2, experts=E, top_k=K, expert_size=n,
                                        backend="torch", expert_bias=True))
    for blk in biased.blocks:
        bound = scale / math.sqrt(n)
        assert 0.9 * bound < float(blk.moe.experts.down_proj_bias.detach().abs().max()) <= bound
    assert counts["active"] == counts["total"] - layers * (E - K) * 3 * n * d


def test_train_and_model_defaults_are_the_layers_defaults():
    """A TrainConfig or ModelConfig that leaves an MoE option unset builds the layer sonicmoe.MoE builds without it:
    each of their MoE options defaults to MoEConfig's default (a run with routing='token_rounding' and no --rounding
    rounds as the layer does)."""
    from sonicmoe.config import MoEConfig
    from sonicmoe.train.config import TrainConfig

    layer = {f.name: f.default for f in dataclasses.fields(MoEConfig)}
    names = {"shared_expert_size": "shared_intermediate_size", "expert_bias": "bias"}
    options = ("backend", "routing", "rounding", "m_tile", "aux_loss_coef", "z_loss_coef", "router_order",
               "renormalize", "routed_scaling_factor", "n_group", "topk_group", "shared_expert_size",
               "shared_expert_gate", "activation", "router_bias", "expert_bias")
    for cls in (TrainConfig, ModelConfig):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        assert {k: defaults[k] for k in options} == {k: layer[names.get(k, k)] for k in options}, cls.__name__


def test_rotary_embedding_rotates_by_the_relative_position():
    """apply_rotary rotates each pair of channels (norms kept), so that a query and a key rotated at positions i and
    j have a dot product that depends on i − j alone."""
    from sonicmoe.train.model import apply_rotary, rotary_tables

    L, hd = 6, 8
    cos, sin = rotary_tables(L, hd, torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(hd, generator=g).expand(1, 1, L, hd), torch.randn(hd, generator=g).expand(1, 1, L, hd)
    rq, rk = apply_rotary(q, cos, sin)[0, 0], apply_rotary(k, cos, sin)[0, 0]
    torch.testing.assert_close(rq.norm(dim=-1), q[0, 0].norm(dim=-1))
    dots = rq @ rk.T
    for shift in range(1, L):
        torch.testing.assert_close(dots.diagonal(shift)[1:], dots.diagonal(shift)[:-1].clone())


def test_expert_load_summary():
    s = expert_load_summary([[1, 1, 1, 1], [4, 0, 0, 0]])
    assert "step_sorted_counts" not in s["per_layer"][0] and "mean_step_max_over_mean" not in s
    assert "mean_step_max_over_mean" not in expert_load_summary([[1, 1]], [[0, 0]])  # an old checkpoint's zeros
    p = expert_load_summary([[2, 2], [3, 1]], [[3, 1], [4, 0]])
    assert [x["step_max_over_mean"] for x in p["per_layer"]] == [1.5, 2.0] and p["mean_step_max_over_mean"] == 1.75
    assert [x["step_min_over_mean"] for x in p["per_layer"]] == [0.5, 0.0]
    assert s["per_layer"][0]["cv"] == pytest.approx(0.0)
    assert s["per_layer"][1]["max_frac"] == 1.0 and s["per_layer"][1]["max_over_mean"] == 4.0
    assert s["per_layer"][1]["cv"] == pytest.approx(math.sqrt(3))
    # the layer averages: over both layers, not the last one's
    assert s["mean_cv"] == pytest.approx(math.sqrt(3) / 2) and s["mean_max_over_mean"] == pytest.approx(2.5)
    # three experts: the idlest is the last of the sorted counts, not the second
    q = expert_load_summary([[6, 3, 3]], [[6, 4, 2]])
    assert q["per_layer"][0]["step_min_over_mean"] == pytest.approx(0.5)
    assert q["per_layer"][0]["step_max_over_mean"] == pytest.approx(1.5)
    # cv = population std / mean of the fractions (1/2, 1/4, 1/4): std sqrt(1/72), mean 1/3
    assert q["per_layer"][0]["cv"] == pytest.approx(math.sqrt(1 / 72) * 3)
    # a layer that routed nothing (no steps yet): zero fractions, not a division by zero
    z = expert_load_summary([[0, 0, 0]])["per_layer"][0]
    assert z["fractions"] == [0.0, 0.0, 0.0] and z["max_frac"] == 0.0 and z["max_over_mean"] == 0.0
    # a model without MoE layers: no layers, zero averages (not a division by zero)
    assert expert_load_summary([]) == {"per_layer": [], "mean_cv": 0.0, "mean_max_over_mean": 0.0}
    # min_frac and max_frac are fractions of the layer's pairs (not counts)
    assert (q["per_layer"][0]["min_frac"], q["per_layer"][0]["max_frac"]) == (0.25, 0.5)
    # the per-step statistics once any layer has counts: a layer without any is reported with zeros (not left out,
    # not a division by zero)
    w = expert_load_summary([[3, 1], [0, 0]], [[3, 1], [0, 0]])
    assert [x["step_max_over_mean"] for x in w["per_layer"]] == [1.5, 0.0]
    assert [x["step_min_over_mean"] for x in w["per_layer"]] == [0.5, 0.0] and w["mean_step_max_over_mean"] == 0.75


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_memory_on_cpu_is_the_max_rss_in_mib():
    """peak_memory on the CPU: the process's peak resident set in MiB (getrusage reports KiB on Linux), checked
    against the kernel's own VmHWM line."""
    from sonicmoe.train.report import peak_memory

    got = peak_memory(torch.device("cpu"))
    with open("/proc/self/status") as f:
        hwm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    assert got["kind"] == "cpu_max_rss"
    assert 0.9 * hwm_kib / 1024 <= got["mib"] <= hwm_kib / 1024 + 1.0


def test_device_names_read_the_cpu_model_name_and_the_first_driver(monkeypatch):
    """device_name on the CPU: /proc/cpuinfo's "model name" line (not the "model" number line before it);
    _nvidia_driver: the first GPU's line of nvidia-smi's one line per GPU, None when it prints nothing."""
    import io
    from types import SimpleNamespace

    from sonicmoe.train import report

    cpuinfo = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
               "model name\t: Intel(R) Xeon(R) Platinum 8480+\nstepping\t: 8\n")
    monkeypatch.setattr(report, "open", lambda path: io.StringIO(cpuinfo), raising=False)
    assert report.device_name(torch.device("cpu")) == "Intel(R) Xeon(R) Platinum 8480+"
    printed = ["550.54.15\n550.54.15\n"]
    monkeypatch.setattr(report.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=printed[0]))
    assert report._nvidia_driver() == "550.54.15"
    printed[0] = "\n"
    assert report._nvidia_driver() is None


def test_device_names_fall_back_to_the_platform_without_a_cpuinfo_model_name(monkeypatch):
    """device_name on the CPU without /proc/cpuinfo (macOS: OSError) or without a "model name" line in it (some Arm
    kernels): platform.processor(), else platform.machine(), else "cpu"."""
    import io

    from sonicmoe.train import report

    names = {"processor": "", "machine": ""}
    monkeypatch.setattr(report.platform, "processor", lambda: names["processor"])
    monkeypatch.setattr(report.platform, "machine", lambda: names["machine"])

    def missing(path):
        raise FileNotFoundError(2, "No such file or directory", path)

    for opener in (missing, lambda path: io.StringIO("processor\t: 0\nBogoMIPS\t: 50.00\n")):
        monkeypatch.setattr(report, "open", opener, raising=False)
        names.update(processor="", machine="")
        assert report.device_name(torch.device("cpu")) == "cpu"
        names["machine"] = f"arch{int(torch.randint(0, 1000, ()))}"
        assert report.device_name(torch.device("cpu")) == names["machine"]
        names["processor"] = f"cpu-model-{int(torch.randint(0, 1000, ()))}"
        assert report.device_name(torch.device("cpu")) == names["processor"]


@pytest.mark.parametrize("error", [FileNotFoundError(2, "No such file or directory: 'nvidia-smi'"),
                                   subprocess.TimeoutExpired(["nvidia-smi"], 20)])
def test_nvidia_driver_is_none_when_nvidia_smi_fails(monkeypatch, error):
    """_nvidia_driver: no nvidia-smi (OSError) or one that hangs past its timeout (subprocess.TimeoutExpired) leaves
    the log's driver None; neither ends the run."""
    from sonicmoe.train import report

    def run(*args, **kwargs):
        raise error

    monkeypatch.setattr(report.subprocess, "run", run)
    assert report._nvidia_driver() is None


def test_environment_names_versions_threads_and_the_utc_date(monkeypatch):
    """environment(): torch's and Python's versions (None for a distribution not installed), torch's own thread
    count (not the cores: a run may set fewer), the commit, the date in UTC to the second; on CUDA also the CUDA
    version and the driver (nvidia-smi's), read here through stand-ins so no GPU is needed."""
    import datetime as dt
    import platform

    from sonicmoe import provenance
    from sonicmoe.train import report

    monkeypatch.setattr(report.os, "cpu_count", lambda: 96)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    env = report.environment(torch.device("cpu"))
    assert env["torch_threads"] == 3 and env["cpu_count"] == 96
    assert env["torch"] == torch.__version__ and env["python"] == platform.python_version()
    assert env["commit"] == provenance.git_commit() and env["device"] == "cpu"
    assert "cuda" not in env and "driver" not in env
    # a distribution that is not installed (sonicmoe run from a checkout, no triton): None, not an exception
    assert report._version(f"sonicmoe-absent-{int(torch.randint(0, 10**6, ()))}") is None
    date = dt.datetime.fromisoformat(env["date"])
    assert date.utcoffset() == dt.timedelta(0) and date.microsecond == 0
    assert abs((dt.datetime.now(dt.timezone.utc) - date).total_seconds()) < 60
    monkeypatch.setattr(report, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(report, "_nvidia_driver", lambda: "550.54.15")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    env = report.environment(torch.device("cuda", 0))
    assert (env["device"], env["device_name"], env["cuda"], env["driver"]) == ("cuda:0", "NVIDIA H100 80GB HBM3",
                                                                              "12.8", "550.54.15")


def test_peak_memory_on_cuda_is_the_max_allocated_in_mib(monkeypatch):
    """peak_memory on CUDA: torch.cuda.max_memory_allocated (the peak, not what is allocated now) in MiB, read here
    through stand-ins so no GPU is needed."""
    from sonicmoe.train.report import peak_memory

    seen = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: seen.append(device) or 3 * 2**30 + 2**19)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2**20)
    got = peak_memory(torch.device("cuda", 1))
    assert got == {"kind": "cuda_max_memory_allocated", "mib": 3 * 1024 + 0.5}
    assert seen == [torch.device("cuda", 1)]


def test_write_json_replaces_the_log_in_one_step(tmp_path):
    """write_json writes a temporary file beside the log and renames it over the log (a reader never sees half a
    log): the new content, no temporary file left behind; non-finite losses (a diverged run) round-trip."""
    from sonicmoe.train.report import write_json

    path = tmp_path / "log.json"
    path.write_text('{"old": true}')
    log = {"steps": [{"step": 1, "loss": 5.25}, {"step": 2, "loss": math.nan}], "final_val_loss": math.inf}
    write_json(path, log)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.json"]
    back = json.loads(path.read_text())
    assert back["steps"][0] == {"step": 1, "loss": 5.25} and math.isnan(back["steps"][1]["loss"])
    assert back["final_val_loss"] == math.inf


def test_summary_reports_milliseconds_per_profiled_step(tmp_path):
    """The closing summary: the MoE layers' and the whole step's time per profiled step in ms (log.json holds seconds
    over all profiled steps), the final val loss in nats and bits per byte."""
    log = {"final_val_loss": 2.0, "final_val_bpb": 2.0 / math.log(2), "final_train_loss": 2.1, "steps_done": 40,
           "wall_time_s": 12.0, "tokens_per_s": 5000.0, "moe_time_share": 0.25,
           "moe_time": {"profiled_steps": 4, "moe_s": 0.2, "step_s": 0.8}, "peak_memory": {"mib": 100.0, "kind": "cpu"},
           "expert_load": expert_load_summary([[1, 1, 1, 1]])}
    text = cli._summary(log, tmp_path)
    assert "MoE layers: 25.0% of step time (50.0 ms of 200.0 ms per profiled step, 4 profiled steps)" in text
    assert "final val loss 2.0000 nats/byte (2.885 bits/byte)" in text and "throughput: 5,000 tokens/s" in text
    assert text.endswith(f"files: {tmp_path / 'log.json'}")  # no checkpoint or plot there: not named
    # per layer [min, max] of the load fractions; per step the busiest expert over the mean, then the summed one's
    log["expert_load"] = expert_load_summary([[6, 3, 3], [2, 2, 4]], [[6, 4, 2], [8, 0, 0]])
    (tmp_path / "ckpt.pt").write_bytes(b"")
    text = cli._summary(log, tmp_path)
    assert "uniform = 0.333): [0.250, 0.500], [0.250, 0.500]; mean CV 0.354" in text
    assert "averaged over layers: 2.25 (summed over steps: 1.50)" in text
    assert text.endswith(f"files: {tmp_path / 'log.json'}, {tmp_path / 'ckpt.pt'}")


def test_summary_reports_a_missing_loss_or_rate_as_a_dash(tmp_path):
    """A run with no validation loss (or no training loss, or too few steps for a rate) says "-" for that number alone
    in its closing summary, the others as usual."""
    text = cli._summary(_summary_log(final_train_loss=None, tokens_per_s=None), tmp_path)
    assert "; final val loss 2.0000 nats/byte (2.885 bits/byte); final train loss -\n" in text
    assert "throughput: - (too few steps)" in text and "MoE layers: not profiled" in text
    text = cli._summary(_summary_log(final_val_loss=None), tmp_path)
    assert "; final val loss -; final train loss 2.1000\n" in text and "throughput: 5,000 tokens/s" in text


def test_progress_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    p = Progress(total=10, initial=0, enabled=True)
    assert p.bar is None
    p.log(5, 10, {"loss": "1.0"})
    p.close()
    assert "step      5/10 loss 1.0" in capsys.readouterr().out


def test_progress_of_a_silent_rank_prints_nothing(monkeypatch, capsys):
    """Progress(silent=True) (the data-parallel ranks but rank 0): no bar even where one is wanted and tqdm is there,
    no log line and no message; rank 0's Progress without a bar prints both."""
    import types

    bars = []

    class FakeBar:
        def __init__(self, **kwargs):
            bars.append(kwargs)

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=FakeBar))
    assert Progress(total=10, initial=2, enabled=True).bar is not None and bars[-1]["initial"] == 2
    bars.clear()
    quiet = Progress(total=10, initial=0, enabled=True, silent=True)
    assert quiet.bar is None and not bars
    quiet.update()
    quiet.log(5, 10, {"loss": "1.0"})
    quiet.write("val loss 2.0")
    quiet.close()
    assert capsys.readouterr() == ("", "")
    plain = Progress(total=10, initial=0, enabled=False)
    plain.log(5, 10, {"loss": "1.0", "lr": "1e-3"})
    plain.write("val loss 2.0")
    assert capsys.readouterr().out == "step      5/10 loss 1.0 lr 1e-3\nval loss 2.0\n"


def test_plot_skipped_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot_losses(tmp_path / "loss.png", [{"step": 1, "loss": 5.0}], [], "t") is False
    assert not (tmp_path / "loss.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_autocast_bf16_training(tmp_path):
    """``--dtype amp-bf16``: float32 parameters, forward under CPU autocast (bfloat16); losses finite and falling."""
    log = _run(tmp_path, "--steps", "12", "--dtype", "amp-bf16", "--eval-every", "0", "--profile-every", "0")
    assert log["model"]["dtype"] == "float32" and log["model"]["autocast"] == "bfloat16"
    losses = _losses(log)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert log["final_val_loss"] is not None and math.isfinite(log["final_val_loss"])


def test_autocast_context_runs_the_forward_in_bfloat16():
    """autocast_context: ``amp-bf16`` runs a float32 matmul in bfloat16 (bfloat16's rounding of the inputs, not
    float16's: a float16 autocast would train another model); every other dtype leaves float32 as it is."""
    cpu = torch.device("cpu")
    g = _fresh_generator()
    a, b = torch.randn(16, 32, generator=g), torch.randn(32, 8, generator=g)
    with loop.autocast_context("amp-bf16", cpu):
        got = a @ b
    assert got.dtype == torch.bfloat16
    # the product of the bfloat16-rounded inputs (accumulated in float32), rounded once more to bfloat16
    torch.testing.assert_close(got.float(), a.bfloat16().float() @ b.bfloat16().float(), rtol=2**-8, atol=1e-5)
    for name in ("auto", "float32", "bfloat16"):
        with loop.autocast_context(name, cpu):
            plain = a @ b
        assert plain.dtype == torch.float32 and torch.equal(plain, a @ b), name


# ------------------------------------------------------------------ data parallelism (torchrun, two CPU ranks)

DP_STEPS = 12
DP = [*TINY, "--steps", str(DP_STEPS), "--eval-every", "6", "--log-every", "3", "--profile-every", "0",
      "--aux-loss-coef", "0"]  # the load-balancing loss is per rank: left out where runs are compared


def _torchrun(out, *extra: str, ranks: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), "-m", "sonicmoe", "train", *extra, "--out", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory):
    """A 12-step run over two gloo ranks and the same run in one process; their output directories and logs."""
    runs = {}
    for name in ("one", "two"):
        out = tmp_path_factory.mktemp(f"dp_{name}")
        if name == "one":
            assert cli.main([*DP, "--out", str(out)]) == 0
        else:
            res = _torchrun(out, *DP)
            assert res.returncode == 0, res.stderr[-3000:]
            assert res.stdout.count("done: step") == 1, res.stdout  # rank 0 alone reports
        runs[name] = (out, json.loads((out / "log.json").read_text()))
    return runs


def test_data_parallel_tracks_one_process(data_parallel):
    """Two ranks, each on half of the global batch, follow the one-process run with the same options: the same
    losses and validation losses to float32 rounding (the gradients are summed in another order), every routed
    pair counted once."""
    (_, one), (_, two) = data_parallel["one"], data_parallel["two"]
    assert two["data_parallel"] == {"world_size": 2, "backend": "gloo", "tokens_per_rank": T // 2}
    assert one["data_parallel"]["world_size"] == 1
    assert [s["step"] for s in two["steps"]] == list(range(1, DP_STEPS + 1))
    for a, b in zip(_losses(two), _losses(one), strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    assert [e["step"] for e in two["evals"]] == [0, 6, 12]
    for a, b in zip(two["evals"], one["evals"], strict=True):
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    for layer_two, layer_one in zip(two["expert_load"]["per_layer"], one["expert_load"]["per_layer"], strict=True):
        assert sum(layer_two["counts"]) == DP_STEPS * T * K  # the ranks' halves, each counted once
        assert sum(layer_two["step_sorted_counts"]) == DP_STEPS * T * K  # each rank's sorted, summed over ranks
        for c2, c1 in zip(layer_two["counts"], layer_one["counts"], strict=True):
            assert abs(c2 - c1) <= 0.01 * c1


def _stop_and_resume(tmp_path, args: list[str]) -> dict:
    """Two ranks run ``args`` to step 6 and stop; two ranks resume from rank 0's checkpoint: the resumed log."""
    res = _torchrun(tmp_path, *args, "--stop-after", "6")
    assert res.returncode == 0, res.stderr[-3000:]
    resumed_dir = tmp_path / "resumed"
    res = _torchrun(resumed_dir, "--resume", str(tmp_path / "ckpt.pt"), "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((resumed_dir / "log.json").read_text())


def test_data_parallel_resume_continues_exactly(data_parallel, tmp_path):
    """Two ranks stopped after step 6 and resumed from rank 0's checkpoint continue as the uninterrupted run."""
    _, full = data_parallel["two"]
    resumed = _stop_and_resume(tmp_path, DP)
    assert resumed["resumed_from"] == 6 and resumed["steps_done"] == DP_STEPS
    assert _losses(resumed) == _losses(full)
    assert resumed["final_val_loss"] == full["final_val_loss"]
    assert resumed["expert_load"]["per_layer"] == full["expert_load"]["per_layer"]


def test_data_parallel_stochastic_rounding_draws_per_rank_and_resumes(tmp_path):
    """Stochastic token rounding over two ranks: each rank draws its per-expert uniforms from a stream of its own
    (one stream on both ranks padded or dropped the same experts' tiles together), the checkpoint keeps every rank's
    stream, and the run resumed from it continues as the uninterrupted one, bit for bit."""
    args = [*DP, "--routing", "token_rounding", "--rounding", "stochastic", "--m-tile", "16"]
    full_dir = tmp_path / "full"
    res = _torchrun(full_dir, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    full = json.loads((full_dir / "log.json").read_text())
    resumed = _stop_and_resume(tmp_path, args)
    states = torch.load(tmp_path / "ckpt.pt", weights_only=True)["rng"]["torch_ranks"]
    assert len(states) == 2 and not torch.equal(states[0], states[1])
    assert resumed["resumed_from"] == 6
    assert _losses(resumed) == _losses(full)
    assert resumed["expert_load"]["per_layer"] == full["expert_load"]["per_layer"]
    for layer in full["expert_load"]["per_layer"]:
        assert all(c % 16 == 0 for c in layer["counts"])


def test_seed_rank_stream():
    """Rank 0 keeps the seeded stream; ranks 1 and 2 get streams of their own, the same for the same seed."""
    draws = {}
    for rank in (0, 1, 2, 1):
        torch.manual_seed(5)
        loop.seed_rank_stream(5, rank, torch.device("cpu"))
        draws.setdefault(rank, []).append(torch.rand(8))
    torch.manual_seed(5)
    assert torch.equal(draws[0][0], torch.rand(8))
    assert not torch.equal(draws[0][0], draws[1][0]) and not torch.equal(draws[1][0], draws[2][0])
    assert torch.equal(draws[1][0], draws[1][1])
    # rank r's seed is seed + r * 0x9E3779B9 mod 2**32: not the next seed (seed + r), whose rank 0 another run may be
    for rank in (1, 2):
        torch.manual_seed((5 + rank * 0x9E3779B9) % 2**32)
        assert torch.equal(draws[rank][0], torch.rand(8)), rank
        torch.manual_seed(5 + rank)
        assert not torch.equal(draws[rank][0], torch.rand(8)), rank
    # rank 0 is not reseeded at all: its stream goes on from where it stands (the model's initialisation drew from
    # it), as the one-process run's does
    torch.manual_seed(5)
    torch.rand(3)
    loop.seed_rank_stream(5, 0, torch.device("cpu"))
    after = torch.rand(8)
    torch.manual_seed(5)
    torch.rand(3)
    assert torch.equal(after, torch.rand(8))


def test_data_parallel_of_one_process_and_the_torchrun_environment(monkeypatch):
    """A run of one process (SINGLE): main, the whole batch, a sum that is a new tensor (the caller may change it,
    the input stays), its own object gathered; rank r of W takes rows [r·B/W, (r+1)·B/W); only WORLD_SIZE > 1
    asks for data parallelism (torchrun sets WORLD_SIZE=1 for one process)."""
    from sonicmoe.train import distributed

    dp = distributed.SINGLE
    t = torch.randn(6, 3)
    keep = t.clone()
    assert dp.main and torch.equal(dp.shard(t), t)
    total = dp.sum(t)
    assert torch.equal(total, keep)
    total.add_(1.0)
    assert torch.equal(t, keep)
    assert dp.gather({"a": 1}) == [{"a": 1}] and dp.describe() == {"world_size": 1, "backend": "none"}
    second = distributed.DataParallel(rank=1, world=3, backend="gloo", owns_group=False)
    assert not second.main and torch.equal(second.shard(t), t[2:4])
    assert second.describe() == {"world_size": 3, "backend": "gloo"}  # the world's size, not this rank's place
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised here")
    for value, want in ((None, False), ("1", False), ("2", True), ("8", True)):
        if value is None:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", value)
        assert distributed.requested() is want, value


def test_setup_outside_torchrun_names_the_missing_variable(monkeypatch):
    """setup() creating the process group checks torchrun's variables first: a RuntimeError naming the first one
    missing and how to start the ranks, not torch's rendezvous error; no group is left behind."""
    from sonicmoe.train import distributed

    if not torch.distributed.is_available() or torch.distributed.is_initialized():
        pytest.skip("no torch.distributed, or a process group is already initialised here")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK is not set; start the ranks with torchrun"):
        distributed.setup(torch.device("cpu"))
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match="MASTER_PORT is not set"):
        distributed.setup(torch.device("cpu"))
    assert not torch.distributed.is_initialized()


@pytest.fixture
def group_of_one(tmp_path, monkeypatch):
    """A gloo process group of one rank that the test (not setup()) creates, torchrun's variables unset."""
    dist = torch.distributed
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("no torch.distributed, or a process group is already initialised here")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_setup_joins_a_group_of_one_and_clips_the_full_norm(group_of_one):
    """setup() in a process group the caller made joins it (no torchrun variables needed), and close() leaves that
    group alone; ExpertSharding.clip_grad_norm_ on one rank is torch's clip_grad_norm_ over every gradient, expert
    and replicated: scaled down to max_norm above it, untouched below it."""
    from sonicmoe.train import distributed

    dp, device = distributed.setup(torch.device("cpu"))
    assert dp == distributed.DataParallel(rank=0, world=1, backend="gloo", owns_group=False)
    assert device == torch.device("cpu")
    dp.close()
    assert torch.distributed.is_initialized()
    assert not distributed.requested()  # a group of one asks for no data parallelism
    sharding = distributed.ExpertSharding(1)
    sharding.sharded = [True, False, True, False]
    g = torch.Generator().manual_seed(4)
    for max_norm in (1.0, 100.0):
        params = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in ((3, 4), (5,), (2, 3), (4,))]
        for p in params[:3]:
            p.grad = torch.randn(p.shape, generator=g)
        ref = [p.grad.clone() for p in params[:3]]
        want = torch.nn.utils.get_total_norm(ref)
        assert 1.0 < float(want) < 100.0
        norm = sharding.clip_grad_norm_(params, max_norm)
        torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
        scale = min(1.0, max_norm / (float(want) + 1e-6))  # clip_grad_norm_'s factor, never above 1
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.grad, r * scale, rtol=1e-6, atol=1e-7)
        assert params[3].grad is None


def _cuda_stand_in(monkeypatch, gpus: int, current: int) -> list:
    """torch.cuda of a machine with ``gpus`` GPUs, ``current`` the current one; returns the set_device calls."""
    made_current = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    return made_current


def _group_creation_stand_in(monkeypatch, distributed, *, rank, world):
    """torch.distributed stood in for a process that is to create its group as `rank` of `world` (torchrun's
    environment set): skips without torch.distributed; returns the list the backends passed to init_process_group
    are appended to."""
    dist = distributed.dist
    if not dist.is_available():
        pytest.skip("no torch.distributed")
    made = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", made.append)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    for name, value in (("RANK", str(rank)), ("WORLD_SIZE", str(world)), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    return made


def test_setup_on_cuda_picks_the_local_gpu_and_backend(monkeypatch):
    """setup() for a CUDA device creating the group (torch.distributed and torch.cuda stand-ins): the GPU is
    LOCAL_RANK modulo the GPUs (without LOCAL_RANK, the current one), made current; NCCL while the local ranks
    (LOCAL_WORLD_SIZE, 1 without it) do not outnumber the GPUs, gloo where they do."""
    from sonicmoe.train import distributed

    made = _group_creation_stand_in(monkeypatch, distributed, rank=3, world=4)
    for gpus, local_world, local_rank, current, want, backend in (
            (2, "2", "3", 0, 1, "nccl"),  # one GPU per local rank
            (2, "4", "1", 0, 1, "gloo"),  # two local ranks per GPU: NCCL would refuse
            (1, None, None, 0, 0, "nccl"),  # no LOCAL_WORLD_SIZE: one local rank
            (4, None, None, 2, 2, "nccl")):  # no LOCAL_RANK: the caller's current GPU
        made_current = _cuda_stand_in(monkeypatch, gpus, current)
        for name, value in (("LOCAL_WORLD_SIZE", local_world), ("LOCAL_RANK", local_rank)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        dp, device = distributed.setup(torch.device("cuda"))
        case = (gpus, local_world, local_rank)
        assert device == torch.device("cuda", want) and made_current == [device], case
        assert made[-1] == backend, case
        assert dp == distributed.DataParallel(rank=3, world=4, backend=backend, owns_group=True), case


def test_setup_on_cpu_creates_a_gloo_group(monkeypatch):
    """setup() for the CPU creating the group (torch.distributed stood in for): gloo, whatever the GPUs, the device
    left as given, and a DataParallel that owns the group it made."""
    from sonicmoe.train import distributed

    made = _group_creation_stand_in(monkeypatch, distributed, rank=1, world=2)
    dp, device = distributed.setup(torch.device("cpu"))
    assert made == ["gloo"] and device == torch.device("cpu")
    assert dp == distributed.DataParallel(rank=1, world=2, backend="gloo", owns_group=True)


def test_expert_sharding_rank_is_the_one_in_its_group(monkeypatch):
    """ExpertSharding's rank, which picks the expert slice local() keeps, is this process's rank within its EP group
    (rank 5 of the world is rank 1 of its group of 2), not its global rank."""
    import sonicmoe.expert_parallel as ep
    from sonicmoe.train import distributed

    monkeypatch.setattr(ep, "expert_parallel_groups", lambda size: ("ep-group", "dp-group"))
    monkeypatch.setattr(distributed.dist, "get_rank", lambda group=None: 1 if group == "ep-group" else 5)
    sharding = distributed.ExpertSharding(2)
    assert (sharding.size, sharding.rank, sharding.group, sharding.dp_group) == (2, 1, "ep-group", "dp-group")


def test_setup_on_cuda_joins_with_the_group_backend(group_of_one, monkeypatch):
    """setup() for a CUDA device in a group the caller made reports that group's backend (gloo here), not the one
    it would have chosen for the GPUs (NCCL), and makes the current GPU current."""
    from sonicmoe.train import distributed

    made_current = _cuda_stand_in(monkeypatch, gpus=2, current=1)
    dp, device = distributed.setup(torch.device("cuda"))
    assert dp == distributed.DataParallel(rank=0, world=1, backend="gloo", owns_group=False)
    assert device == torch.device("cuda", 1) and made_current == [device]


def test_expert_sharding_gathers_slices_and_clips_over_its_group(monkeypatch):
    """ExpertSharding with torch.distributed's collectives stood in for (rank 0 of an EP group of 2 in a world of
    6): full() gathers each expert tensor over the EP group, rank r's slice after rank r-1's on dim 0, with or
    without an optimizer state (one without float32 masters keeps none); local() slices a copy (an update of it, or
    a checkpoint of it, is the slice's alone); clip_grad_norm_ sums the expert slices' squared norms over the EP
    group and scales as torch's clip_grad_norm_ does (its 1e-6 included); describe() counts the EP groups."""
    from sonicmoe.train import distributed

    sharding = distributed.ExpertSharding.__new__(distributed.ExpertSharding)  # no process group
    sharding.size, sharding.rank, sharding.group, sharding.sharded = 2, 0, "ep-group", [True, False]
    g = torch.Generator().manual_seed(12)
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.randn(2, 3, generator=g))
    model.b = torch.nn.Parameter(torch.randn(4, generator=g))

    def all_gather(parts, t, group=None):
        assert group == "ep-group" and len(parts) == 2
        for r, part in enumerate(parts):
            part.copy_(t + 10.0 * r)  # rank r's slice

    monkeypatch.setattr(distributed.dist, "all_gather", all_gather)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    full, no_opt = sharding.full(model, state)
    assert no_opt is None
    assert torch.equal(full["a"], torch.cat([state["a"], state["a"] + 10.0])) and torch.equal(full["b"], state["b"])
    avg = torch.randn(2, 3, generator=g)
    opt = {"adamw": {"state": {0: {"step": torch.tensor(2.0), "exp_avg": avg}}, "param_groups": []}}
    _, full_opt = sharding.full(model, state, opt, [0])
    assert full_opt["masters"] is None
    assert torch.equal(full_opt["adamw"]["state"][0]["exp_avg"], torch.cat([avg, avg + 10.0]))
    sharding.rank = 1
    local, _ = sharding.local(model, full)
    assert torch.equal(local["a"], state["a"] + 10.0)
    local["a"].add_(1.0)
    assert torch.equal(full["a"][2:], state["a"] + 10.0)
    assert local["a"].untyped_storage().nbytes() == local["a"].numel() * local["a"].element_size()

    others, reduced = [0.0], []

    def all_reduce(t, group=None):
        assert group == "ep-group"
        reduced.append(float(t))
        t.add_(others[0])  # the other rank's expert slice's squared norm

    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce)
    params = [torch.nn.Parameter(torch.randn(2, 3, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    ref = [p.grad.clone() for p in params]
    others[0] = 3.0
    want = (sum(float(r.square().sum()) for r in ref) + 3.0) ** 0.5
    norm = sharding.clip_grad_norm_(params, 1.0)
    assert float(norm) == pytest.approx(want, rel=1e-6)
    # only the expert slice's squared norm (params[0]) goes over the EP group; the replicated one stays local
    assert reduced == [pytest.approx(float(ref[0].double().square().sum()), rel=1e-6)]
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r / (want + 1e-6), rtol=1e-6, atol=0)
    # a norm near 1e-6: torch's clip factor, max_norm / (norm + 1e-6), not max_norm / norm
    others[0] = 0.0
    for p, r in zip(params, ref):
        p.grad = r * (1e-6 / float(torch.linalg.vector_norm(torch.cat([x.reshape(-1) for x in ref]))))
    before = [p.grad.clone() for p in params]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for t, b in zip(twins, before):
        t.grad = b.clone()
    torch.nn.utils.clip_grad_norm_(twins, 1e-6)
    sharding.clip_grad_norm_(params, 1e-6)
    for p, t, b in zip(params, twins, before):
        torch.testing.assert_close(p.grad, t.grad, rtol=1e-5, atol=0)
        torch.testing.assert_close(p.grad, b * 0.5, rtol=1e-5, atol=0)  # 1e-6 / (1e-6 + 1e-6)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda group=None: 6)
    assert sharding.describe() == {"size": 2, "groups": 3}


def test_expert_sharding_maps_expert_tensors_only():
    """ExpertSharding.local on rank 1 of 2: the expert parameters' tensors (by name in the model state, by model
    position in the float32 masters, through ``order`` for AdamW's indices) are sliced on dim 0; replicated ones,
    buffers, AdamW's 0-dim step counts and the other entries stay as they are."""
    from sonicmoe.train.distributed import ExpertSharding

    model = torch.nn.Module()
    g = torch.Generator().manual_seed(9)
    for name in ("a", "b", "c"):
        setattr(model, name, torch.nn.Parameter(torch.randn(4, 3, generator=g)))
    model.register_buffer("buf", torch.randn(4, generator=g))
    sharding = ExpertSharding.__new__(ExpertSharding)  # its slicing alone: no process group
    sharding.size, sharding.rank, sharding.sharded = 2, 1, [True, False, True]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    order = [2, 0, 1]  # AdamW's parameter i is the model's order[i]: c, a, b
    adam = {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3, generator=g)} for i in range(3)}
    masters = [torch.randn(4, 3, generator=g) for _ in range(3)]
    opt = {"adamw": {"state": adam, "param_groups": [{"lr": 1e-3}]}, "masters": masters, "scaler": 7}
    got, got_opt = sharding.local(model, state, opt, order)
    for k in ("a", "c"):
        assert torch.equal(got[k], state[k][2:]), k
    assert torch.equal(got["b"], state["b"]) and torch.equal(got["buf"], state["buf"])
    for i, expert in ((0, True), (1, True), (2, False)):
        st = got_opt["adamw"]["state"][i]
        assert torch.equal(st["exp_avg"], adam[i]["exp_avg"][2:] if expert else adam[i]["exp_avg"]), i
        assert st["step"].dim() == 0 and float(st["step"]) == 3.0
    for m, want, expert in zip(got_opt["masters"], masters, sharding.sharded):
        assert torch.equal(m, want[2:] if expert else want)
    assert got_opt["scaler"] == 7 and got_opt["adamw"]["param_groups"] == [{"lr": 1e-3}]
    # the caller's optimizer state is left as it was (a new "adamw" dict holds the sliced state)
    assert opt["adamw"]["state"] is adam and opt["masters"] is masters and adam[0]["exp_avg"].shape == (4, 3)


def test_setup_without_torch_distributed_says_so(monkeypatch):
    """setup() on a torch build without torch.distributed: a RuntimeError saying so, before it reads torchrun's
    variables (which would name a missing RANK instead)."""
    from sonicmoe.train import distributed

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(distributed.dist, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="data-parallel training needs torch.distributed, which this torch build "
                                           "lacks"):
        distributed.setup(torch.device("cpu"))


def test_setup_creates_a_group_from_torchrun_variables_and_close_destroys_it(monkeypatch):
    """setup() with torchrun's variables (one rank, a free port) creates a real gloo group it owns, and close()
    destroys that group (a group the caller made is left alone: test_setup_joins_a_group_of_one...)."""
    import socket

    from sonicmoe.train import distributed

    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("no torch.distributed with gloo, or a process group is already initialised here")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    try:
        dp, device = distributed.setup(torch.device("cpu"))
        assert dp == distributed.DataParallel(rank=0, world=1, backend="gloo", owns_group=True)
        assert device == torch.device("cpu") and dist.is_initialized() and dist.get_backend() == "gloo"
        dp.close()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@_rank_worker
def _data_parallel_worker(rank: int, world: int, init_file: str, seed: int) -> dict:
    """Rank ``rank`` of 2 in a gloo group it made itself (no torchrun variables): setup() joins it; DataParallel's
    main, shard, sum and gather over the real group; ExpertSharding(2) on a model whose MoE is nested in a
    submodule: the layer replaced, its expert weights (only) sharded, full() gathering the one-process state,
    local() slicing it again, wrap() accepting the groups, describe() counting one EP group."""
    from datetime import timedelta

    from sonicmoe import MoE
    from sonicmoe.expert_parallel import ExpertParallelMoE
    from sonicmoe.train import distributed

    dist = torch.distributed
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    dp, device = distributed.setup(torch.device("cpu"))
    errs = {"joined_flag": float(dp != distributed.DataParallel(rank=rank, world=world, backend="gloo",
                                                                 owns_group=False) or device.type != "cpu"),
            "main_flag": float(dp.main != (rank == 0)), "requested_flag": float(not distributed.requested())}
    g = torch.Generator().manual_seed(seed)
    batch = torch.randn(3 * world, 2, generator=g)  # the same global batch on every rank
    errs["shard_flag"] = float(not torch.equal(dp.shard(batch), batch[3 * rank:3 * rank + 3]))
    mine = torch.randn(4, generator=g) + rank
    keep = mine.clone()
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    total = dp.sum(mine)
    errs["sum_flag"] = float(not (torch.allclose(total, sum(parts)) and torch.equal(mine, keep)))
    errs["gather_flag"] = float(dp.gather({"rank": rank}) != [{"rank": r} for r in range(world)])
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(8, 8)
    model.block = torch.nn.Module()
    model.block.moe = MoE(8, 6, 4, 2, backend="torch")
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    sharding = distributed.ExpertSharding(world)
    sharding.shard(model)
    errs["replaced_flag"] = float(not isinstance(model.block.moe, ExpertParallelMoE))
    names = [name for name, _ in model.named_parameters()]
    errs["sharded_flag"] = float(sharding.sharded != [n.startswith("block.moe.experts.") for n in names]
                                 or not any(sharding.sharded))
    full, _ = sharding.full(model, model.state_dict())
    errs["full_flag"] = float(full.keys() != whole.keys() or not all(torch.equal(full[k], whole[k]) for k in whole))
    local, _ = sharding.local(model, whole)
    errs["local_flag"] = float(not all(torch.equal(local[k], v) for k, v in model.state_dict().items()))
    sharding.wrap(model)  # DDP over the world; the experts' replicas over the expert-data-parallel group (of one)
    errs["describe_flag"] = float(sharding.describe() != {"size": world, "groups": 1})
    return errs


def test_data_parallel_and_expert_sharding_over_two_gloo_ranks(tmp_path):
    """Two real gloo processes (see _data_parallel_worker): every check holds on both ranks."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available")
    results = _spawn(_data_parallel_worker, 2, tmp_path, int(torch.randint(0, 2 ** 31, ())))
    for rank, errs in enumerate(results):
        assert len(errs) == 11, errs
        bad = {key: v for key, v in errs.items() if v != 0.0}
        assert not bad, f"rank {rank}: {bad}"


def test_data_parallel_batch_must_split_evenly(tmp_path):
    res = _torchrun(tmp_path, *DP, "--batch-size", "7")
    assert res.returncode != 0
    assert "batch_size=7 must be a multiple of the 2 data-parallel ranks" in res.stderr


# ------------------------------------------------------------------ expert parallelism (torchrun, two CPU ranks)

EP = [*DP, "--expert-parallel", "2"]


@pytest.fixture(scope="module")
def expert_parallel(tmp_path_factory):
    """The data-parallel fixture's 12-step run over two gloo ranks with each layer's E = 4 experts split over them."""
    out = tmp_path_factory.mktemp("ep_two")
    res = _torchrun(out, *EP)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("done: step") == 1, res.stdout
    return out, json.loads((out / "log.json").read_text())


def test_expert_parallel_tracks_one_process(expert_parallel, data_parallel):
    """Two ranks holding two experts each follow the one-process run to float32 rounding: the losses, the gradient
    norms (the full model's, expert slices summed over the ranks), the validation losses (every rank in each eval
    forward) and the expert loads; the checkpoint holds the full model, a one-process run's tensors."""
    (ep_dir, two), (one_dir, one) = expert_parallel, data_parallel["one"]
    assert two["expert_parallel"] == {"size": 2, "groups": 1}
    assert two["model"]["params"] == one["model"]["params"]
    for a, b in zip(two["steps"], one["steps"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for a, b in zip(two["evals"], one["evals"], strict=True):
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    for layer_two, layer_one in zip(two["expert_load"]["per_layer"], one["expert_load"]["per_layer"], strict=True):
        assert sum(layer_two["counts"]) == DP_STEPS * T * K
        for c2, c1 in zip(layer_two["counts"], layer_one["counts"], strict=True):
            assert abs(c2 - c1) <= 0.01 * c1
    ckpt, ref = (torch.load(d / "ckpt.pt", weights_only=True) for d in (ep_dir, one_dir))
    for key, v in ref["model"].items():
        assert ckpt["model"][key].shape == v.shape, key
        assert rel_err(ckpt["model"][key], v) < 1e-4, key
    for i, st in ref["optimizer"]["adamw"]["state"].items():
        assert rel_err(ckpt["optimizer"]["adamw"]["state"][i]["exp_avg_sq"], st["exp_avg_sq"]) < 1e-3, i


def test_expert_parallel_resume_continues_exactly(expert_parallel, tmp_path):
    """Stopped after step 6 (the checkpoint gathers the expert slices) and resumed over two ranks (which slice it
    again): the uninterrupted run's losses, bit for bit."""
    _, full = expert_parallel
    resumed = _stop_and_resume(tmp_path, EP)
    assert resumed["resumed_from"] == 6 and resumed["expert_parallel"] == {"size": 2, "groups": 1}
    assert _losses(resumed) == _losses(full)
    assert resumed["final_val_loss"] == full["final_val_loss"]


def test_cli_builds_a_resume_that_repeats_its_own_shape_and_seed_into_a_new_out(tmp_path, monkeypatch, capsys):
    """A resume that repeats the checkpoint's own --d-model, --heads and --seed is taken (only another value is
    refused) and writes to a given --out instead of the checkpoint's folder; a fresh run's --seed is an int, and
    --deterministic is left to the run (None: on for CPU) unless given either way."""
    if torch.cuda.is_available():
        pytest.skip("the default preset is h100 where a GPU is visible")
    seen, corpus = _cli_with_train_stubbed(monkeypatch, tmp_path, [_summary_log()])
    seed = int(torch.randint(1, 2**20, ()))
    small = ["--data", str(corpus), "--no-progress"]
    assert cli.main([*small, "--out", str(tmp_path / "a"), "--seed", str(seed)]) == 0
    cfg = seen.pop()[0]
    assert cfg.seed == seed and type(cfg.seed) is int and cfg.deterministic is None
    for flag, want in (("--deterministic", True), ("--no-deterministic", False)):
        assert cli.main([*small, "--out", str(tmp_path / "a"), flag]) == 0
        assert seen.pop()[0].deterministic is want
    saved = make_config("cpu-tiny", steps=6, data=str(corpus), seed=seed).to_dict()
    ckpt = tmp_path / "run" / "ckpt.pt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"")
    fake = {"config": saved, "step": 2}
    monkeypatch.setattr(cli, "load_checkpoint", lambda path: fake)
    new_out = tmp_path / "continued"
    assert cli.main(["--resume", str(ckpt), "--d-model", str(saved["d_model"]), "--heads", str(saved["heads"]),
                     "--seed", str(seed), "--out", str(new_out)]) == 0
    cfg, checkpoint = seen.pop()
    assert checkpoint is fake and cfg.out == str(new_out) and new_out.is_dir() and cfg.resume == str(ckpt)
    assert (cfg.d_model, cfg.heads, cfg.seed) == (saved["d_model"], saved["heads"], seed)
    with pytest.raises(SystemExit) as e:
        cli.main(["--resume", str(ckpt), "--seed", str(seed + 1)])
    assert e.value.code == 2 and f"the checkpoint's run has seed={seed}" in capsys.readouterr().err
    assert not seen


def test_expert_parallel_needs_ranks(tmp_path, capsys):
    """--expert-parallel P must divide the ranks (one process here) and E: a usage error from the CLI before any
    data or model is built (session 86; a traceback from train() before), and a ValueError from train() itself."""
    with pytest.raises(SystemExit) as e:
        cli.main([*DP, "--expert-parallel", "2", "--out", str(tmp_path)])
    assert e.value.code == 2 and "expert_parallel=2 must divide the number of ranks, 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expert_parallel=2 must divide the number of ranks, 1"):
        loop.train(make_config("cpu-tiny", expert_parallel=2, experts=8, out=str(tmp_path)))
    with pytest.raises(SystemExit):
        cli.main([*DP, "--expert-parallel", "3", "--out", str(tmp_path)])


@pytest.mark.parametrize("extra,match", [
    (["--device", "cuda"], "no CUDA GPU"),
    (["--backend", "triton"], "TRITON_INTERPRET=1"),
])
def test_cli_refuses_what_this_machine_cannot_run(extra, match, capsys, monkeypatch):
    """--device cuda without a GPU and --backend triton on CPU without the interpreter: usage errors (exit 2) before
    any data or model is built, not a traceback at the first step (session 86)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU runs both")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main([*TINY, *extra, "--out", "unused"])
    assert e.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize("extra,match", [
    (["--device", "cpu"], "device"),  # TINY's own device
    (["--device", "auto", "--backend", "torch"], "backend"),
    (["--device", "auto", "--backend", "triton", "--dtype", "amp-bf16"], "autocast"),
])
def test_graph_moe_refusals(extra, match, capsys):
    """--graph-moe needs CUDA, the triton backend and no autocast: a usage error otherwise."""
    with pytest.raises(SystemExit) as e:
        cli.main([*TINY, *extra, "--graph-moe", "--out", "unused"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "graph_moe" in err and match in err


def test_graph_moe_config_refusals():
    """TrainConfig refuses graph_moe with expert parallelism and a non-bool graph_moe; check_ranks (train()'s own
    check, whatever the CLI said) takes it for one process on a CUDA device only, naming the device and the ranks."""
    with pytest.raises(ValueError, match="graph_moe"):
        make_config("cpu-tiny", graph_moe=True, device="auto", backend="triton", expert_parallel=2, experts=8)
    with pytest.raises(ValueError, match="graph_moe must be a bool"):
        make_config("cpu-tiny", graph_moe=1)
    # CUDA graphs need CUDA and the triton backend: each refused on its own (the other one right)
    with pytest.raises(ValueError, match="graph_moe captures .* got device='cpu', backend='triton'"):
        make_config("cpu-tiny", graph_moe=True, device="cpu", backend="triton")
    with pytest.raises(ValueError, match="graph_moe captures .* got device='cuda', backend='torch'"):
        make_config("cpu-tiny", graph_moe=True, device="cuda", backend="torch")
    with pytest.raises(ValueError, match="graph_moe does not run under autocast"):
        make_config("cpu-tiny", graph_moe=True, device="cuda", backend="triton", dtype="amp-bf16")
    assert make_config("cpu-tiny", graph_moe=True, device="cuda", backend="triton", dtype="bfloat16").graph_moe
    cfg = make_config("cpu-tiny", graph_moe=True, device="auto", backend="triton")
    loop.check_ranks(cfg, torch.device("cuda", 0), 1)  # one process on a GPU: taken (no GPU touched)
    for device, world in (("cpu", 1), ("cuda", 2), ("cpu", 2)):
        with pytest.raises(ValueError, match=rf"graph_moe needs one process on a CUDA device, got {device} with "
                                             rf"{world} rank"):
            loop.check_ranks(cfg, torch.device(device), world)


def test_graph_moe_puts_the_generator_back(monkeypatch):
    """graph_moe_layers graphs every MoE layer in one make_graphed_callables call, swaps the blocks' layers for the
    graphed ones, and puts the CUDA generator's state back after the capture, whose warm-up draws moved it (CUDA
    stubbed: the generator is a counter the stubbed capture advances). Without the restore, stochastic token
    rounding under --graph-moe would draw other uniforms than the eager run (test_gpu_graph_moe_trains_as_eager)."""
    from sonicmoe.train import loop

    model = MoETransformer(ModelConfig(d_model=16, layers=2, heads=2, experts=4, top_k=2, expert_size=8,
                                       backend="torch"))
    layers = model.moe_layers()
    state = {"rng": torch.tensor([7])}
    calls = []

    def capture(callables, samples):
        calls.append((callables, samples))
        state["rng"] = state["rng"] + 4  # the warm-up and capture runs draw
        return tuple(torch.nn.Identity() for _ in callables)

    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: state["rng"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device: state.update(rng=s))
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", capture)
    loop.graph_moe_layers(model, (3, 5), torch.float32)
    assert int(state["rng"]) == 7
    (callables, samples), = calls
    assert list(callables) == layers and [s[0].shape for s in samples] == [(3, 5, 16)] * 2
    assert all(isinstance(blk.moe, torch.nn.Identity) for blk in model.blocks)


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["topk", "token_rounding", "stochastic"])
def test_gpu_graph_moe_trains_as_eager(tmp_path, routing):
    """--graph-moe (each MoE layer's forward and backward replayed from CUDA graphs) trains bit for bit as the eager
    layers do on the triton backend (bf16, deterministic): the same train losses, router losses (their gradients
    reach the routers only through the graphs' returned losses), gradient norms, validation losses and expert
    loads, with the profiler's hooks armed every 10 steps. Stochastic token rounding too: the replays draw from the
    CUDA generator where the eager layers do, and the capture leaves its state as it found it."""
    gpu = [a for a in TINY if a not in ("cpu", "torch", "--device", "--backend")]
    gpu += ["--device", "cuda", "--backend", "triton", "--deterministic", "--steps", "30", "--eval-every", "15"]
    if routing != "topk":
        gpu += ["--routing", "token_rounding", "--m-tile", "16"]
    if routing == "stochastic":
        gpu += ["--rounding", "stochastic"]
    logs = []
    for graph in ("--no-graph-moe", "--graph-moe"):
        assert cli.main([*gpu, graph, "--out", str(tmp_path / graph)]) == 0
        logs.append(json.loads((tmp_path / graph / "log.json").read_text()))
    eager, graphed = logs
    assert graphed["config"]["graph_moe"] and not eager["config"]["graph_moe"]
    for key in ("loss", "router_loss", "grad_norm"):
        assert [s[key] for s in graphed["steps"]] == [s[key] for s in eager["steps"]], key
    assert [v["val_loss"] for v in graphed["evals"]] == [v["val_loss"] for v in eager["evals"]]
    assert graphed["expert_load"] == eager["expert_load"]
    assert all(s["router_loss"] > 0 for s in eager["steps"])
    assert all(p["moe_backward_s"] > 0 for p in graphed["profile"])


def test_large_validation_split_and_non_utf8_names(tmp_path):
    """A validation split past 2**24 bytes: float32 held only even integers there, so the last window started one
    byte past its end (IndexError at the first evaluation before session 82). A file name that is not UTF-8 reads
    (its bytes go into the header line and the order), as file contents that are not UTF-8 already did."""
    import os

    val = torch.zeros(16_779_476, dtype=torch.uint8)
    corpus = ByteCorpus(train=torch.zeros(100, dtype=torch.uint8), val=val, source="x", num_files=1)
    last = list(corpus.val_batches(8, 256, 4, torch.device("cpu")))[-1]
    assert last[0].shape == (8, 256) and last[1].shape == (8, 256)
    data = tmp_path / "names"
    data.mkdir()
    (data / "plain.txt").write_text("plain words and more words " * 20)
    (data / os.fsdecode(b"caf\xe9.txt")).write_text("cafe text " * 40)
    corpus = ByteCorpus.load(str(data), 100_000, 0.1)
    assert corpus.num_files == 2
    blob = bytes(torch.cat([corpus.train, corpus.val]).tolist())
    assert b"# ==== caf\xe9.txt ====\n" in blob


def test_single_file_corpus_names_the_file(tmp_path):
    """--data FILE: the corpus's source (log.json's data.source, the start line) is that file, not its folder, which
    may hold other files the run never read (it named the folder before)."""
    (tmp_path / "other.txt").write_text("not read " * 50)
    text = tmp_path / "notes.txt"
    text.write_text("the only file read " * 20)
    corpus = ByteCorpus.load(str(text), 10_000, 0.1)
    assert corpus.num_files == 1 and corpus.source == str(text)
    assert ByteCorpus.load(str(tmp_path), 10_000, 0.1).source == str(tmp_path)
    # its header line names the file (relative to its folder), as a directory's files are named
    assert bytes(torch.cat([corpus.train, corpus.val]).tolist()).startswith(b"# ==== notes.txt ====\n")
    with pytest.raises(ValueError, match=f"corpus from {text} has only"):
        text.write_text("short")
        ByteCorpus.load(str(text), 10_000, 0.1)


def test_corpus_of_64_bytes_and_its_split_sizes(tmp_path):
    """64 bytes (header line included) is the smallest corpus taken, 63 is refused; the validation split is the last
    int(N · val_fraction) bytes, at least 2 (val_fraction 0 still leaves a tail), and the train split the rest."""
    text = tmp_path / "notes.txt"
    header = b"# ==== notes.txt ====\n"
    g = _fresh_generator()
    body = bytes(torch.randint(97, 123, (64 - len(header) - 1,), generator=g).tolist()) + b"\n"
    text.write_bytes(body)
    corpus = ByteCorpus.load(str(text), 10_000, 0.0)
    assert (corpus.train.numel(), corpus.val.numel()) == (62, 2)
    assert bytes(torch.cat([corpus.train, corpus.val]).tolist()) == header + body
    text.write_bytes(body[1:])
    with pytest.raises(ValueError, match="has only 63 bytes"):
        ByteCorpus.load(str(text), 10_000, 0.1)
    size = int(torch.randint(300, 900, (), generator=g))
    text.write_bytes(bytes(torch.randint(97, 123, (size,), generator=g).tolist()))
    frac = float(torch.rand((), generator=g, dtype=torch.float64)) * 0.5
    corpus = ByteCorpus.load(str(text), 10_000, frac)
    total = len(header) + size + 1  # the newline added at the end
    assert corpus.val.numel() == max(2, int(total * frac)) and corpus.train.numel() + corpus.val.numel() == total


def test_nothing_to_read_is_a_file_not_found_error(tmp_path, monkeypatch):
    """A missing --data path, a directory of hidden files only, a standard library without its .py sources (its tests
    are not sources): FileNotFoundError naming the cause (the CLI's usage error), not an empty corpus."""
    import sysconfig

    from sonicmoe.train.data import text_files

    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        ByteCorpus.load(str(tmp_path / "missing"), 10_000, 0.1)
    data = tmp_path / "hidden"
    data.mkdir()
    (data / ".notes.txt").write_text("hidden words " * 20)
    with pytest.raises(FileNotFoundError, match="the directory holds no file"):
        text_files(data)
    stdlib = tmp_path / "lib"
    (stdlib / "test").mkdir(parents=True)
    (stdlib / "test" / "test_os.py").write_text("import os\n" * 20)
    (stdlib / "README.txt").write_text("no sources here\n" * 20)
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(stdlib)})
    with pytest.raises(FileNotFoundError, match="no .py sources under the standard library"):
        stdlib_source_files()
    (stdlib / "os.py").write_text("import sys\n" * 20)
    assert stdlib_source_files() == (stdlib, [stdlib / "os.py"])


def _fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))


def test_corpus_reads_files_in_hash_order_each_on_its_lines(tmp_path):
    """The corpus is the files in the SHA-256 order of their relative paths (not the sorted order: a byte cap then
    samples the whole tree), each after its ``# ==== path ====`` line and ending in a newline (added where the file
    has none, so that the next header starts a line); a cap reached exactly at a file's end reads no further file
    (the count of files used had one more, an empty one)."""
    import hashlib

    from sonicmoe.train.data import read_corpus, text_files

    data = tmp_path / "texts"
    (data / "sub").mkdir(parents=True)
    g = _fresh_generator()
    names = ("a.txt", "b.txt", "c.txt", "sub/d.txt", "sub/e.txt")
    bodies = {}
    for i, name in enumerate(names):
        size = int(torch.randint(60, 90, (), generator=g))
        body = bytes(torch.randint(97, 123, (size,), generator=g).tolist()) + (b"\n" if i % 2 else b"")
        (data / name).write_bytes(body)
        bodies[name] = body
    order = sorted(names, key=lambda n: hashlib.sha256(n.encode()).digest())
    assert order != sorted(names)  # the two orders differ for these names
    pieces = [b"# ==== " + n.encode() + b" ====\n" + bodies[n] + (b"" if bodies[n].endswith(b"\n") else b"\n")
              for n in order]
    corpus = ByteCorpus.load(str(data), 1 << 20, 0.1)
    assert corpus.num_files == len(names)
    assert bytes(torch.cat([corpus.train, corpus.val]).tolist()) == b"".join(pieces)
    root, files = text_files(data)
    assert read_corpus(files, root, len(pieces[0])) == (pieces[0], 1)
    assert read_corpus(files, root, len(pieces[0]) + 5) == (pieces[0] + pieces[1][:5], 2)


def test_train_and_val_windows_are_the_split_slices():
    """A training window is L + 1 consecutive bytes of the train split (inputs, then the same bytes shifted by one as
    targets), its start drawn uniformly from 0 to N - L - 2 (torch.randint's bound is exclusive: the one window that
    ends at the split's last byte is never drawn, and check_seq_len's N >= L + 2 matches that); the validation
    batches are the val split's windows at starts evenly spaced from 0 to the last one (N - L - 1), in order, batch
    after batch."""
    cpu = torch.device("cpu")
    train = torch.arange(40, dtype=torch.uint8)
    val = torch.arange(100, 150, dtype=torch.uint8)
    corpus = ByteCorpus(train=train, val=val, source="x", num_files=1)
    L = 8
    x, y = corpus.train_batch(600, L, _fresh_generator(), cpu)
    starts = x[:, 0]
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x, starts[:, None] + torch.arange(L)) and torch.equal(y, x + 1)
    assert set(starts.tolist()) == set(range(40 - L - 1))
    high = 50 - L - 1  # the last window's start: its targets end at the split's last byte
    want = [round(high * i / 11) for i in range(12)]  # 4 batches of 3: twelve starts, evenly spaced
    batches = list(corpus.val_batches(3, L, 4, cpu))
    assert len(batches) == 4
    for b, (vx, vy) in enumerate(batches):
        assert torch.equal(vx, 100 + torch.tensor(want[3 * b:3 * b + 3])[:, None] + torch.arange(L))
        assert torch.equal(vy, vx + 1)


def test_optimizer_decay_groups_and_bf16_masters():
    """Optimizer: weight decay on the attention, router and expert matrices only (not the byte embedding, not the
    norms, not the biases: the experts' b1 (E, 2n) and b2 (E, d) are matrices by shape); ``order`` names the model
    parameter behind each AdamW index (the checkpoint's expert-parallel slicing goes through it); with bfloat16
    parameters one step clips and updates the float32 masters (checked against AdamW's first step written out:
    p(1 - lr·wd) - lr·g/(|g| + eps), g the clipped gradient), returns the gradient norm before clipping, and gives
    the parameters the rounded masters; a fresh optimizer loading its state gets the masters and the parameters back,
    and keeps its own weight decay and betas."""
    from sonicmoe.train.loop import Optimizer, model_config

    cpu = torch.device("cpu")
    cfg = make_config("cpu-tiny", d_model=32, layers=2, heads=2, experts=4, top_k=2, expert_size=16,
                      shared_expert_size=8, backend="torch", device="cpu", weight_decay=0.1, expert_bias=True)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    model = MoETransformer(model_config(cfg))
    opt = Optimizer(model, cfg, cpu)
    assert opt.masters is None
    decayed = {id(p) for p in opt.adamw.param_groups[0]["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    matrices = ("attn.qkv.weight", "attn.proj.weight", "moe.gate.weight", "moe.experts.gate_up_proj",
                "moe.experts.down_proj", "moe.shared_experts.gate_up_proj", "moe.shared_experts.down_proj")
    assert names == {f"blocks.{i}.{m}" for i in range(2) for m in matrices}
    biases = {n for n, p in model.named_parameters() if n.endswith("bias")}
    assert {f"blocks.{i}.moe.experts.{b}" for i in range(2) for b in ("gate_up_proj_bias", "down_proj_bias")} <= biases
    assert any(p.dim() == 2 for n, p in model.named_parameters() if n in biases)  # (E, 2n): decayed by shape alone
    kept = {n for n, p in model.named_parameters() if id(p) not in decayed}
    # embedding, two norms a block, final norm, and the biases
    assert kept == {"embed.weight", "norm.weight", *(f"blocks.{i}.{m}_norm.weight" for i in range(2)
                                                      for m in ("attn", "mlp")), *biases}
    flat = [p for g in opt.adamw.param_groups for p in g["params"]]
    assert len(opt.order) == len(flat) and all(opt.params[i] is q for i, q in zip(opt.order, flat))
    assert opt.order != sorted(opt.order)  # the decayed first: not the model's order here

    model = model.to(torch.bfloat16)
    opt = Optimizer(model, cfg, cpu)
    assert opt.masters is not None and all(m.dtype == torch.float32 for m in opt.masters)
    g = _fresh_generator()
    for p in opt.params:
        p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
    grads = [p.grad.double() for p in opt.params]
    norm = math.sqrt(sum(float((x * x).sum()) for x in grads))
    before = [m.double() for m in opt.masters]
    decays = [any(p is q for q in opt.adamw.param_groups[0]["params"]) for p in opt.masters]
    lr, max_norm = 1e-2, 0.5
    got = opt.step(lr, max_norm)
    assert float(got) == pytest.approx(norm, rel=1e-5)
    clip = max_norm / (norm + 1e-6)
    for m, p0, grad, dec in zip(opt.masters, before, grads, decays):
        gc = grad * clip
        want = p0 * (1 - lr * cfg.weight_decay * dec) - lr * gc / (gc.abs() + 1e-8)
        torch.testing.assert_close(m.double(), want, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None and m.grad is None for p, m in zip(opt.params, opt.masters))
    assert all(torch.equal(p, m.bfloat16()) for p, m in zip(opt.params, opt.masters))
    flat = [p for g in opt.adamw.param_groups for p in g["params"]]
    assert all(opt.masters[i] is q for i, q in zip(opt.order, flat))  # the masters, in the parameters' order
    fresh = MoETransformer(model_config(cfg)).to(torch.bfloat16)
    again = Optimizer(fresh, dataclasses.replace(cfg, weight_decay=0.3, beta1=0.8), cpu)
    again.load_state_dict(opt.state_dict())
    assert [(g["weight_decay"], g["betas"][0]) for g in again.adamw.param_groups] == [(0.3, 0.8), (0.0, 0.8)]
    assert all(torch.equal(a, b) for a, b in zip(again.masters, opt.masters))
    assert all(torch.equal(a, b) for a, b in zip(again.params, opt.params))


def test_optimizer_keeps_masters_when_any_parameter_is_low_precision():
    """Optimizer: one bfloat16 parameter among float32 ones is enough for float32 masters of every parameter (AdamW
    then updates the masters, and the bfloat16 parameter gets the rounded master, not an update computed in
    bfloat16)."""
    from sonicmoe.train.loop import Optimizer

    cfg = make_config("cpu-tiny", device="cpu", backend="torch", weight_decay=0.1)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    model[1].to(torch.bfloat16)
    opt = Optimizer(model, cfg, torch.device("cpu"))
    assert opt.masters is not None and len(opt.masters) == 4
    assert all(m.dtype == torch.float32 and torch.equal(m, p.float()) for m, p in zip(opt.masters, opt.params))
    g = _fresh_generator()
    for p in opt.params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    opt.step(1e-2, math.inf)
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(opt.params, opt.masters))


def _eval_setup(eval_batches):
    """A tiny torch-backend config with ``eval_batches`` validation batches of 2 × 16 bytes, a random byte corpus with
    room for them, and a freshly seeded model built from it, for the evaluate tests."""
    from sonicmoe.train.loop import model_config

    cfg = make_config("cpu-tiny", d_model=32, layers=1, heads=2, experts=4, top_k=2, expert_size=16,
                      backend="torch", device="cpu", batch_size=2, seq_len=16, eval_batches=eval_batches)
    g = _fresh_generator()
    corpus = ByteCorpus(train=torch.randint(0, 256, (200,), dtype=torch.uint8, generator=g),
                        val=torch.randint(0, 256, (40 * eval_batches,), dtype=torch.uint8, generator=g), source="x",
                        num_files=1)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    return cfg, corpus, MoETransformer(model_config(cfg))


def test_evaluate_is_the_mean_val_loss_and_restores_train_mode():
    """evaluate: the mean cross-entropy of the eval-mode model over the fixed validation batches (its MoE layers see
    each batch in eval mode), and the model is back in training mode afterwards (the next steps train with the
    training routing)."""
    import torch.nn.functional as F

    from sonicmoe.train.loop import evaluate

    cfg, corpus, model = _eval_setup(eval_batches=3)
    cpu = torch.device("cpu")
    modes = []  # each MoE layer's mode as evaluate's forwards reach it: eval (plain top-k, whatever the routing)
    hooks = [m.register_forward_pre_hook(lambda m, args: modes.append(m.training)) for m in model.moe_layers()]
    got = evaluate(model, corpus, cfg, cpu)
    for h in hooks:
        h.remove()
    assert modes == [False] * 3 and model.training
    model.eval()
    with torch.no_grad():
        losses = [float(F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)))
                  for x, y in corpus.val_batches(2, 16, 3, cpu)]
    assert got == pytest.approx(sum(losses) / 3, rel=1e-6)


def test_evaluate_takes_this_ranks_batches_and_runs_the_lockstep_rounds():
    """evaluate on rank r of W (a stand-in whose sum is the identity: this rank's part alone): the validation batches
    b with b mod W = r, over ``eval_batches``; with ``lockstep`` (expert parallelism: every forward is a collective)
    every rank runs ceil(batches / W) forwards, a rank short of one running batch 0 again and dropping its loss."""
    import types

    import torch.nn.functional as F

    from sonicmoe.train.loop import evaluate

    cfg, corpus, model = _eval_setup(eval_batches=5)
    model.eval()
    cpu = torch.device("cpu")
    with torch.no_grad():
        losses = [float(F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)))
                  for x, y in corpus.val_batches(2, 16, 5, cpu)]
    batches = list(corpus.val_batches(2, 16, 5, cpu))
    model.train()
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    # 5 batches over 2 ranks: rank 0 takes 0, 2, 4 and rank 1 takes 1, 3 (3 rounds: one more forward on rank 1);
    # over 3 ranks: 0, 3 / 1, 4 / 2 (2 rounds)
    for world, rank, mine, rounds in ((2, 0, [0, 2, 4], 3), (2, 1, [1, 3], 3), (3, 2, [2], 2), (3, 1, [1, 4], 2)):
        dp = types.SimpleNamespace(rank=rank, world=world, sum=lambda t: t)
        for lockstep in (False, True):
            seen.clear()
            got = evaluate(model, corpus, cfg, cpu, dp, lockstep=lockstep)
            assert got == pytest.approx(sum(losses[b] for b in mine) / 5, rel=1e-6), (world, rank, lockstep)
            assert len(seen) == (rounds if lockstep else len(mine)), (world, rank, lockstep)
            assert all(torch.equal(x, batches[b][0]) for x, b in zip(seen, mine))
            assert all(torch.equal(x, batches[0][0]) for x in seen[len(mine):])  # the extra rounds: batch 0
            assert model.training


def test_throughput_counts_each_stretch_once(monkeypatch):
    """Throughput: the tokens added while a stretch is timed, over the seconds of the timed stretches (a device sync
    at each start and stop); tokens added outside a stretch, and a second stop, count nothing; ``rate`` is None
    before anything was timed."""
    import types

    g = _fresh_generator()
    ticks = (torch.rand(4, generator=g, dtype=torch.float64) * 10).cumsum(0).tolist()  # increasing clock readings
    clock = iter(ticks)
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    syncs = []
    meter = loop.Throughput(lambda: syncs.append(1))
    n = torch.randint(1, 1000, (4,), generator=g).tolist()
    assert meter.rate() is None and not meter.running
    meter.add(n[0])  # not timed
    meter.start()
    meter.add(n[1])
    meter.add(n[2])
    meter.stop()
    meter.stop()  # nothing to end: no sync, no clock reading
    meter.add(n[0])  # not timed
    meter.start()
    assert meter.running
    meter.add(n[3])
    meter.stop()
    assert meter.tokens == n[1] + n[2] + n[3] and len(syncs) == 4
    seconds = (ticks[1] - ticks[0]) + (ticks[3] - ticks[2])
    assert meter.seconds == pytest.approx(seconds, rel=1e-12)
    assert meter.rate() == pytest.approx((n[1] + n[2] + n[3]) / seconds, rel=1e-12)


def test_train_sets_the_deterministic_switch_and_restores_it(monkeypatch, tmp_path):
    """train: ``torch.use_deterministic_algorithms`` during the run is ``cfg.deterministic``, or on by default on the
    CPU (its reductions then repeat bit for bit), always warn-only; afterwards both the switch and its warn-only flag
    are what they were before, whichever they were."""
    seen = []
    monkeypatch.setattr(loop, "_train", lambda *a: seen.append((torch.are_deterministic_algorithms_enabled(),
                                                                torch.is_deterministic_algorithms_warn_only_enabled())))
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        for previous in ((False, False), (True, True), (True, False)):
            for deterministic, want in ((None, True), (False, False), (True, True)):
                torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
                cfg = make_config("cpu-tiny", device="cpu", backend="torch", out=str(tmp_path),
                                  deterministic=deterministic)
                if deterministic is False:  # make_config ignores None values only: False is kept
                    assert cfg.deterministic is False
                loop.train(cfg)
                assert seen[-1] == (want, True), (previous, deterministic)
                assert (torch.are_deterministic_algorithms_enabled(),
                        torch.is_deterministic_algorithms_warn_only_enabled()) == previous, (previous, deterministic)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_first_step_logs_what_it_trained_with_and_warm_up_steps_go_unmeasured(tmp_path):
    """train's log of step 1 is that step's own numbers, each in its field: the LM loss, the router loss and the
    gradient norm before clipping of the freshly seeded model on the first batch the data generator draws (recomputed
    here by hand); and tokens/s counts the steps after the min(5, steps // 5) warm-up steps (12 steps: 2)."""
    from sonicmoe.train.loop import model_config

    g = _fresh_generator()
    seed = int(torch.randint(0, 2**31 - 1, (), generator=g))
    cfg = make_config("cpu-tiny", d_model=32, layers=1, heads=2, experts=4, top_k=2, expert_size=16, backend="torch",
                      device="cpu", batch_size=2, seq_len=16, steps=12, warmup=3, eval_every=0, eval_batches=1,
                      profile_every=0, save_every=0, log_every=4, grad_clip=0.5, seed=seed, progress=False,
                      out=str(tmp_path))
    corpus = ByteCorpus(train=torch.randint(0, 256, (300,), dtype=torch.uint8, generator=g),
                        val=torch.randint(0, 256, (40,), dtype=torch.uint8, generator=g), source="x", num_files=1)
    log = loop.train(cfg, corpus=corpus)
    torch.manual_seed(seed)
    model = MoETransformer(model_config(cfg))
    x, y = corpus.train_batch(2, 16, torch.Generator().manual_seed(seed), torch.device("cpu"))
    loss = model(x, y)
    aux = model.router_loss()
    (loss + aux).backward()
    loss, aux = float(loss.detach()), float(aux.detach())
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    first = log["steps"][0]
    assert aux > 0 and float(norm) > cfg.grad_clip  # three different numbers, the norm a clipped one's
    assert (first["step"], first["lr"]) == (1, pytest.approx(cfg.lr / 3))
    assert first["loss"] == pytest.approx(loss, rel=1e-6)
    assert first["router_loss"] == pytest.approx(aux, rel=1e-6)
    assert first["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    assert log["throughput"]["tokens"] == (12 - 2) * 2 * 16


def test_fmt_rate():
    """The log line's tokens/s: thousands below a million, millions from one million, "-" for no measurement."""
    assert loop._fmt_rate(None) == "-"
    assert loop._fmt_rate(12_345.0) == "12.3k" and loop._fmt_rate(999_000.0) == "999.0k"
    assert loop._fmt_rate(1_000_000.0) == "1.00M" and loop._fmt_rate(2_468_000.0) == "2.47M"


def test_rotary_tables_are_the_position_angles():
    """rotary_tables: cos and sin of position p times the frequency base^(-2i/hd) of channel pair i."""
    from sonicmoe.train.model import rotary_tables

    L, hd = 7, 12
    cos, sin = rotary_tables(L, hd, torch.device("cpu"))
    assert cos.shape == sin.shape == (L, hd // 2) and cos.dtype == torch.float32
    angles = torch.tensor([[p * 10000.0 ** (-2 * i / hd) for i in range(hd // 2)] for p in range(L)],
                          dtype=torch.float64)
    torch.testing.assert_close(cos.double(), angles.cos(), rtol=0, atol=2e-6)
    torch.testing.assert_close(sin.double(), angles.sin(), rtol=0, atol=2e-6)


def test_model_forward_matches_a_reference():
    """MoETransformer's logits against the block written out in float32: x += Attn(RMSNorm(x)) with q, k, v the
    thirds of the qkv projection, each split into heads of consecutive channels, rotated, causal softmax attention;
    x += MoE(RMSNorm(x)); logits = RMSNorm(x) · embeddingᵀ (the norms' weights randomised, so each counts)."""
    from sonicmoe.train.model import rotary_tables

    d, H, L, B = 32, 4, 9, 2
    hd = d // H
    g = _fresh_generator()
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    model = MoETransformer(ModelConfig(d_model=d, layers=2, heads=H, experts=4, top_k=2, expert_size=16,
                                       backend="torch")).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.weight.copy_(1 + 0.5 * torch.randn(d, generator=g))
    idx = torch.randint(0, 256, (B, L), generator=g)
    cos, sin = rotary_tables(L, hd, torch.device("cpu"))
    c, s = cos[None, :, None], sin[None, :, None]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def rotate(t):  # (B, L, H, hd): channel i pairs with channel i + hd/2
        a, b = t[..., :hd // 2], t[..., hd // 2:]
        return torch.cat((a * c - b * s, a * s + b * c), dim=-1)

    causal = torch.ones(L, L, dtype=torch.bool).tril()
    with torch.no_grad():
        x = model.embed.weight[idx]
        for blk in model.blocks:
            h = rms(x, blk.attn_norm.weight)
            w = blk.attn.qkv.weight
            q, k, v = ((h @ w[i * d:(i + 1) * d].T).view(B, L, H, hd) for i in range(3))
            q, k = rotate(q), rotate(k)
            scores = torch.einsum("bihe,bjhe->bhij", q, k) / math.sqrt(hd)
            att = scores.masked_fill(~causal, -math.inf).softmax(-1)
            y = torch.einsum("bhij,bjhe->bihe", att, v).reshape(B, L, d)
            x = x + y @ blk.attn.proj.weight.T
            x = x + blk.moe(rms(x, blk.mlp_norm.weight))[0]
        want = rms(x, model.norm.weight) @ model.embed.weight.T
        got = model(idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
