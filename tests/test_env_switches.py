"""The library's environment switches (sonicmoe.env): each accepts exactly its documented values, with their meaning
as before, and raises ValueError naming the variable, the value and the accepted ones for anything else. Before,
``SONICMOE_GLUON=false`` (or ``off``, ``" 0"``) left every Gluon kernel on, ``SONICMOE_POISON_OUTPUTS=true`` left
the poisoning off, ``SONICMOE_OVERLAP=off`` turned the side stream off and ``TRITON_INTERPRET=false`` made the
library take the interpreter's paths while Triton compiled the kernels.

Every test sets a bad value somewhere, so each fails on the lax parsing; the good values are checked beside them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sonicmoe import env
from sonicmoe.ops import (
    common,
    dh_ws,
    fast_launch,
    grouped_gemm,
    grouped_gemm_ws,
    library,
    load_order,
    router_logits,
    up_proj_ws,
    varlen_m_ws,
    weight_grad_ws,
)

REPO = Path(__file__).resolve().parents[1]

# typos an on/off switch used to take silently (as on, or as off, depending on the switch)
BAD_ON_OFF = ("true", "false", "on", "off", "yes", "no", "TRUE", " 1", "1 ", "0 ", "", "2", "-1", "01")
# ... and a kernel's Gluon switch, whose third value is "all"
BAD_GLUON_KERNEL = ("true", "false", "off", "ALL", "All", " all", "force", "", "2")


def _raises(monkeypatch, name: str, value: str, read) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        read()
    message = str(info.value)
    assert name in message and repr(value) in message, message


def test_env_switch_accepts_0_and_1_only(monkeypatch):
    """common.env_switch, through which the Gluon kernels' modules read their on/off switches (sonicmoe.env's)."""
    name = "SONICMOE_TEST_SWITCH"
    for default in (False, True):
        monkeypatch.delenv(name, raising=False)
        assert common.env_switch(name, default) is default
        for value, want in (("0", False), ("1", True)):
            monkeypatch.setenv(name, value)
            assert common.env_switch(name, default) is want
    for value in BAD_ON_OFF:
        _raises(monkeypatch, name, value, lambda: common.env_switch(name, True))
    monkeypatch.setenv(name, "true")
    with pytest.raises(ValueError, match=r"SONICMOE_TEST_SWITCH='true': expected '0' \(off\) or '1' \(on\)"):
        common.env_switch(name, True)
    assert common.env_switch is env.env_switch


def test_settings_messages_list_the_accepted_values(monkeypatch):
    """The ValueError of a choice lists its values as a sentence ("'a', 'b' or 'c'"), and that of a count its bound
    or its multiple, so that the message says what to write instead."""
    name = "SONICMOE_TEST_SETTING"
    cases = [
        (lambda: env.env_choice(name, "a", ("a", "b", "c")), "d", "expected 'a', 'b' or 'c'"),
        (lambda: env.env_choice(name, "0", ("0", "1")), "2", "expected '0' or '1'"),
        (lambda: env.env_choice(name, "x", ("x",)), "y", "expected 'x'"),
        (lambda: env.env_count(name, 0), "-3", "expected an integer"),
        (lambda: env.env_count(name, 0, most=16), "17", "expected an integer 0..16"),
        (lambda: env.env_count(name, 0, multiple=8), "12", "expected 0 or a positive multiple of 8"),
        (lambda: env.env_count(name, 0, multiple=2), "3", "expected 0 or a positive multiple of 2"),
        # both bounds: the message names the largest value too (a multiple above it was refused without saying why)
        (lambda: env.env_count(name, 0, most=16, multiple=8), "24", "expected 0 or a positive multiple of 8 up to 16"),
        (lambda: env.env_count(name, 0, most=16, multiple=8), "12", "expected 0 or a positive multiple of 8 up to 16"),
    ]
    for read, value, accepted in cases:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError) as info:
            read()
        assert str(info.value) == f"{name}={value!r}: {accepted} (unset for the default)"
    monkeypatch.setenv(name, "24")
    assert env.env_count(name, 0, multiple=8) == 24 and env.env_count(name, 0, most=24) == 24
    monkeypatch.setenv(name, "c")
    assert env.env_choice(name, "a", ("a", "b", "c")) == "c"
    monkeypatch.delenv(name)
    assert env.env_choice(name, "b", ("a", "b", "c")) == "b" and env.env_count(name, 5, most=4) == 5


# (name, reader of the library, its value for each good setting, or None where it reads no value back)
ON_OFF_SWITCHES = [
    ("SONICMOE_AUTOTUNE", lambda: common.autotune_enabled(False), {None: True, "1": True, "0": False}),
    ("SONICMOE_PDL", lambda: common.pdl_enabled(torch.device("cpu")), {None: False, "1": False, "0": False}),
    ("SONICMOE_GLUON_DXT", lambda: grouped_gemm_ws.ws_enabled(transpose_b=False),
     {None: False, "1": False, "0": False}),
    ("SONICMOE_GLUON_CLAMPED", lambda: up_proj_ws.gluon_serves_activation("clamped_swiglu"),
     {None: up_proj_ws.GLUON_CLAMPED, "1": True, "0": False}),
    ("SONICMOE_UP_EPI", lambda: up_proj_ws.up_ws_config(4096)["EPI_WARPS"],
     {None: 0, "1": up_proj_ws.EPI_WARPS, "0": 0}),
    ("SONICMOE_UP_H_PACKED", lambda: up_proj_ws.up_ws_config(4096)["H_PACKED"],
     {None: up_proj_ws.H_PACKED, "1": True, "0": False}),
    ("SONICMOE_UP_GU_FUSED", lambda: up_proj_ws.up_ws_config(4096)["GU_FUSED"],
     {None: up_proj_ws.GU_FUSED, "1": True, "0": False}),
    ("SONICMOE_SIGMOID_FTZ", up_proj_ws.sigmoid_ftz, {None: up_proj_ws.SIGMOID_FTZ, "1": True, "0": False}),
    ("SONICMOE_DH_STAGE_IN_RING", lambda: dh_ws.dh_ws_config(256)["STAGE_IN_RING"],
     {None: dh_ws.STAGE_IN_RING, "1": True, "0": False}),
    ("SONICMOE_WGRAD_WG_SPLIT", lambda: weight_grad_ws.wgrad_ws_config(1024, 1024, True)["WG_SPLIT"],
     {None: weight_grad_ws.WG_SPLIT, "1": True, "0": False}),
    ("SONICMOE_WGRAD_SWAP_AB", lambda: weight_grad_ws.wgrad_ws_config(1024, 1024, False)["SWAP_AB"],
     {None: weight_grad_ws.SWAP_AB, "1": True, "0": False}),
    ("SONICMOE_WGRAD_STAGE_IN_RING",
     lambda: weight_grad_ws.wgrad_ws_config(1024, 1024, True, wg_split=False)["STAGE_IN_RING"],
     {None: weight_grad_ws.STAGE_IN_RING, "1": True, "0": False}),
    ("SONICMOE_ROUTER_BF16_GEMM",
     lambda: router_logits.bf16_gemm_applies(torch.zeros(2, 4, dtype=torch.bfloat16),
                                             torch.zeros(3, 4, dtype=torch.bfloat16)),
     {None: False, "1": False, "0": False}),  # CPU tensors: never, but the switch is read (and checked)
]


@pytest.mark.parametrize("name,read,good", ON_OFF_SWITCHES, ids=[s[0] for s in ON_OFF_SWITCHES])
def test_on_off_switch(name, read, good, monkeypatch):
    """Each on/off switch: unset, 0 and 1 as documented (read at each call), any other value raises (on CPU too,
    where a GPU-only switch has no effect)."""
    for value, want in good.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        assert read() == want, (name, value)
    for value in BAD_ON_OFF:
        _raises(monkeypatch, name, value, read)


def test_poison_outputs_switch(monkeypatch):
    """SONICMOE_POISON_OUTPUTS=1 fills kernel outputs with NaN (int-min); 0 or unset leaves them empty; ``true`` was
    silently off."""
    cpu = torch.device("cpu")
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")
    assert common.new_output((3,), device=cpu, dtype=torch.float32).isnan().all()
    assert (common.new_output(2, device=cpu, dtype=torch.int32) == torch.iinfo(torch.int32).min).all()
    for value in ("0", None):
        if value is None:
            monkeypatch.delenv("SONICMOE_POISON_OUTPUTS")
        else:
            monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", value)
        assert common.new_output((3,), device=cpu, dtype=torch.float32).shape == (3,)
    for value in BAD_ON_OFF:
        _raises(monkeypatch, "SONICMOE_POISON_OUTPUTS", value,
                lambda: common.new_output((3,), device=cpu, dtype=torch.float32))


def test_router_and_routing_kernel_switches(monkeypatch):
    """SONICMOE_ROUTER_KERNEL (default 1) and SONICMOE_ROUTING_KERNEL (default off): 0 / 1 as before (CPU takes
    torch either way), anything else raises (``false`` took the fused router on CUDA; ``true`` left the counting
    sort off)."""
    from sonicmoe import router_topk, routing_from_topk

    x, w = torch.randn(5, 8), torch.randn(4, 8)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]])
    want_router, want_routing = router_topk(x, w, 2), routing_from_topk(ids, 4)
    for value in ("0", "1"):
        monkeypatch.setenv("SONICMOE_ROUTER_KERNEL", value)
        monkeypatch.setenv("SONICMOE_ROUTING_KERNEL", value)
        got = router_topk(x, w, 2)
        assert torch.equal(got.topk_ids, want_router.topk_ids) and torch.equal(got.topk_scores, want_router.topk_scores)
        assert torch.equal(routing_from_topk(ids, 4).row_token, want_routing.row_token)
    for value in BAD_ON_OFF:
        _raises(monkeypatch, "SONICMOE_ROUTER_KERNEL", value, lambda: router_topk(x, w, 2))
    monkeypatch.setenv("SONICMOE_ROUTER_KERNEL", "1")
    for value in BAD_ON_OFF:
        _raises(monkeypatch, "SONICMOE_ROUTING_KERNEL", value, lambda: routing_from_topk(ids, 4))


def test_gluon_switch(monkeypatch):
    """SONICMOE_GLUON: 1 (default), 0 or force; never on under the interpreter; anything else raises (``false`` and
    ``off`` left every Gluon kernel on)."""
    for value in (None, "0", "1", "force"):
        if value is None:
            monkeypatch.delenv("SONICMOE_GLUON", raising=False)
        else:
            monkeypatch.setenv("SONICMOE_GLUON", value)
        assert grouped_gemm_ws.ws_enabled() is False
        assert grouped_gemm_ws.ws_enabled(transpose_b=False) is False
    for value in (*BAD_ON_OFF, "FORCE", "all"):
        _raises(monkeypatch, "SONICMOE_GLUON", value, grouped_gemm_ws.ws_enabled)


def test_gluon_switch_outside_the_interpreter(monkeypatch):
    """As on a GPU machine with Triton 3.6 (the interpreter off, Gluon present): 0 turns the kernels off, 1 and force
    leave them on, GLUON_DXT=0 the dX̃ form alone; bad values raise there too."""
    monkeypatch.setattr(grouped_gemm_ws, "interpreting", lambda: False)
    monkeypatch.setattr(grouped_gemm_ws, "HAVE_GLUON", True)
    monkeypatch.setattr(grouped_gemm_ws, "triton_release", lambda: grouped_gemm_ws.GLUON_TRITON)
    monkeypatch.delenv("SONICMOE_GLUON_DXT", raising=False)
    for value, want in ((None, True), ("1", True), ("force", True), ("0", False)):
        if value is None:
            monkeypatch.delenv("SONICMOE_GLUON", raising=False)
        else:
            monkeypatch.setenv("SONICMOE_GLUON", value)
        assert grouped_gemm_ws.ws_enabled() is want and grouped_gemm_ws.ws_enabled(False) is want, value
    monkeypatch.setenv("SONICMOE_GLUON", "1")
    monkeypatch.setenv("SONICMOE_GLUON_DXT", "0")
    assert grouped_gemm_ws.ws_enabled() is True and grouped_gemm_ws.ws_enabled(False) is False
    _raises(monkeypatch, "SONICMOE_GLUON", "false", grouped_gemm_ws.ws_enabled)
    monkeypatch.setenv("SONICMOE_GLUON", "1")
    _raises(monkeypatch, "SONICMOE_GLUON_DXT", "false", lambda: grouped_gemm_ws.ws_enabled(False))


# (switch, the kernel's enabled(), its preferred(...) over a few arguments, the arguments)
GLUON_KERNELS = [
    ("SONICMOE_GLUON_UP", up_proj_ws.up_ws_enabled, up_proj_ws.up_ws_preferred, (64, 1536, 4096, 8192)),
    ("SONICMOE_GLUON_DH", dh_ws.dh_ws_enabled, dh_ws.dh_ws_preferred, (64, 128, 384, 512)),
    ("SONICMOE_GLUON_WGRAD", weight_grad_ws.wgrad_ws_enabled, library.gluon_wgrad_preferred, (64, 128, 1024)),
    ("SONICMOE_GLUON_LONG", varlen_m_ws.long_enabled, varlen_m_ws.long_preferred, (False, True)),
]


@pytest.mark.parametrize("name,enabled,preferred,args", GLUON_KERNELS, ids=[k[0] for k in GLUON_KERNELS])
def test_gluon_kernel_switch(name, enabled, preferred, args, monkeypatch):
    """A Gluon kernel's own switch: 1 (default) where the layer's rule prefers it, 0 off, ``all`` wherever it applies;
    as on a GPU with Gluon (``ws_enabled`` True). Anything else raises, on CPU too (``false`` left it on)."""
    monkeypatch.setattr(sys.modules[enabled.__module__], "ws_enabled", lambda: True)
    monkeypatch.delenv(name, raising=False)
    rule = [preferred(a) for a in args]
    assert enabled() is True and not all(rule)  # each rule leaves some argument out
    for value, on, want in (("1", True, rule), ("0", False, rule), ("all", True, [True] * len(args))):
        monkeypatch.setenv(name, value)
        assert enabled() is on and [preferred(a) for a in args] == want, value
    for value in BAD_GLUON_KERNEL:
        _raises(monkeypatch, name, value, enabled)
        _raises(monkeypatch, name, value, lambda: preferred(args[0]))
    monkeypatch.undo()
    for value in BAD_GLUON_KERNEL:  # the real ws_enabled: False on CPU, and the switch checked all the same
        _raises(monkeypatch, name, value, enabled)


def test_fast_launch_switch(monkeypatch):
    """SONICMOE_FAST_LAUNCH: 1 (default), 0 or check; anything else raises (``false`` kept the fast path)."""
    monkeypatch.delenv("SONICMOE_FAST_LAUNCH", raising=False)
    assert fast_launch._mode() == "1"
    for value in ("0", "1", "check"):
        monkeypatch.setenv("SONICMOE_FAST_LAUNCH", value)
        assert fast_launch._mode() == value
    for value in (*BAD_ON_OFF, "CHECK"):
        _raises(monkeypatch, "SONICMOE_FAST_LAUNCH", value, fast_launch._mode)


def test_overlap_switch(monkeypatch):
    """SONICMOE_OVERLAP: programs per multiprocessor 0..16 (default 2), 0 on CPU and under the interpreter; anything
    else raises, on CPU too (``off`` and ``17`` turned the side stream off, ``true`` too)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    for value in (None, "0", "2", "16"):
        if value is None:
            monkeypatch.delenv("SONICMOE_OVERLAP", raising=False)
        else:
            monkeypatch.setenv("SONICMOE_OVERLAP", value)
        assert common.overlap_mode(cpu) == 0
    monkeypatch.setattr(common, "interpreting", lambda: False)  # as on a GPU (no CUDA query: device type only)
    for value, want in ((None, 2), ("0", 0), ("1", 1), ("2", 2), ("16", 16), ("04", 4)):
        if value is None:
            monkeypatch.delenv("SONICMOE_OVERLAP", raising=False)
        else:
            monkeypatch.setenv("SONICMOE_OVERLAP", value)
        assert common.overlap_mode(cuda) == want, value
    for value in ("17", "100", "off", "true", "-1", " 2", "2.0", "", "²"):
        _raises(monkeypatch, "SONICMOE_OVERLAP", value, lambda: common.overlap_mode(cuda))
        _raises(monkeypatch, "SONICMOE_OVERLAP", value, lambda: common.overlap_mode(cpu))


def test_multi_valued_settings_name_themselves(monkeypatch):
    """The settings that already raised still do, with their names (and the new ones' edge cases): a non-ASCII
    digit as SONICMOE_VARLEN_M_CONFIG raised int()'s bare message; SONICMOE_WGRAD_ORDER and SONICMOE_TILE_FAMILY
    take their documented values."""
    monkeypatch.setenv("SONICMOE_VARLEN_M_CONFIG", "auto")
    assert grouped_gemm.env_config() is None
    monkeypatch.setenv("SONICMOE_VARLEN_M_CONFIG", "0")
    assert grouped_gemm.env_config() is not None
    for value in ("²", "", " 0", "-1", str(len(grouped_gemm.TUNING_SPACE)), "AUTO"):
        monkeypatch.setenv("SONICMOE_VARLEN_M_CONFIG", value)
        with pytest.raises(ValueError, match="SONICMOE_VARLEN_M_CONFIG"):
            grouped_gemm.env_config()
    for value, want in (("expert", False), ("load", True)):
        monkeypatch.setenv("SONICMOE_WGRAD_ORDER", value)
        assert load_order.wgrad_order_by_load() is want
    for value in ("Load", "", "busiest"):
        _raises(monkeypatch, "SONICMOE_WGRAD_ORDER", value, load_order.wgrad_order_by_load)
    for family in common.TILE_FAMILIES:
        monkeypatch.setenv("SONICMOE_TILE_FAMILY", family)
        assert common.tile_family(torch.device("cuda", 0)) == family
    for value in ("TMA", "", "ampere"):
        _raises(monkeypatch, "SONICMOE_TILE_FAMILY", value, lambda: common.tile_family(torch.device("cpu")))


# TRITON_INTERPRET: what Triton's own parser (triton.knobs, any case) reads as on, and the spellings of off
INTERPRET_GOOD = {"1": True, "true": True, "TRUE": True, "on": True, "Yes": True, "y": True,
                  "0": False, "": False, "false": False, "False": False, "off": False, "no": False, "N": False}


def test_triton_interpret_agrees_with_triton(monkeypatch):
    """One parser of TRITON_INTERPRET (sonicmoe.env.interpreting, which common re-exports), reading each value as
    Triton does; values Triton reads as off without meaning it (``2``, ``" 1"``) raise. Before, the library read
    ``false``, ``off`` and ``2`` as on while Triton compiled the kernels."""
    from triton import knobs

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert common.interpreting() is False and knobs.runtime.interpret is False
    for value, want in INTERPRET_GOOD.items():
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert common.interpreting() is want, value
        assert knobs.runtime.interpret is want, value  # Triton's own reading of the same value
    for value in ("2", " 1", "1 ", "true ", "maybe", "t", "-1"):
        _raises(monkeypatch, "TRITON_INTERPRET", value, common.interpreting)
    # the message lists the spellings of on, then those of off
    monkeypatch.setenv("TRITON_INTERPRET", "2")
    with pytest.raises(ValueError) as info:
        common.interpreting()
    assert str(info.value) == ("TRITON_INTERPRET='2': expected '1', 'true', 'on', 'yes' or 'y' (on) or '', '0', "
                               "'false', 'off', 'no' or 'n' (off), any case, as Triton reads it "
                               "(unset for the default)")
    assert common.interpreting is env.interpreting


def test_triton_interpret_in_the_clis(monkeypatch, capsys, tmp_path):
    """The training CLI takes ``--backend triton`` on CPU under any spelling Triton interprets (``true`` was refused)
    and refuses it under ``false`` and ``0``; a value of no known meaning is a usage error in both CLIs (the bench
    ran anyway, calling it compiled)."""
    from sonicmoe.bench import cli as bench_cli
    from sonicmoe.train import cli as train_cli
    from sonicmoe.train.config import make_config

    cfg = make_config("cpu-tiny", backend="triton", device="cpu")
    for value in ("1", "true", "ON"):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        train_cli._preflight(cfg)
    for value in ("0", "false", ""):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
            train_cli._preflight(cfg)
    monkeypatch.setenv("TRITON_INTERPRET", "2")
    with pytest.raises(ValueError, match="TRITON_INTERPRET='2'"):
        train_cli._preflight(cfg)
    capsys.readouterr()
    assert bench_cli.main(["--shape", "16,8,8,2,1", "--backends", "torch", "--warmup", "0", "--rep", "0",
                           "--no-plot", "-q", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "TRITON_INTERPRET='2'" in capsys.readouterr().err


def test_switches_are_checked_at_call_not_import():
    """A bad value does not stop ``import sonicmoe`` (nor the kernels' modules): it raises at the first read."""
    code = ("import sonicmoe, sonicmoe.ops.library\n"
            "from sonicmoe.ops import grouped_gemm_ws\n"
            "try:\n    grouped_gemm_ws.ws_enabled()\nexcept ValueError as e:\n    print('raised:', e)\n")
    env_vars = {**os.environ, "SONICMOE_GLUON": "off", "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env_vars, capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "raised: SONICMOE_GLUON='off'" in out.stdout, out.stdout
