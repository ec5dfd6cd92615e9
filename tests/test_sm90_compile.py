"""scripts/sm90_compile.py: every GPU kernel of the layer compiled for Hopper (sm_90) by Triton's NVIDIA backend
behind a stand-in driver, on this machine, GPU or not. It catches what only a native compile finds (a Gluon
kernel's type or layout errors, shared memory over the limit) in CI, which has no GPU; it runs nothing, so results
are tested elsewhere (the interpreter on CPU, the ``gpu`` tests on a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sonicmoe.ops import weight_grad_ws

REPO = Path(__file__).resolve().parents[1]
GLUON = {"_up_ws_kernel", "_dh_ws_kernel", "_ws_varlen_m_kernel", "_long_kernel", "_wgrad_ws_kernel"}
TRITON = {"_up_proj_kernel", "_varlen_m_kernel", "_gather_sum_kernel", "_dh_kernel", "_varlen_k_kernel",
          "_load_order_kernel", "_tile_table_kernel"}
SM90_SHARED_LIMIT = 232448  # bytes of shared memory a block may opt in to on sm_90


def test_every_layer_kernel_compiles_for_sm90(tmp_path):
    """The Gluon kernels (up-projection, dH, ping-pong and long-row GEMMs, the weight gradients in every config form,
    in expert order and in load order with the serpentine schedule) and the Triton kernels in their pinned Hopper
    configs, at the 7B shape's d, n and at (4096, 1024): each gives a cubin within sm_90's shared memory, and
    Triton's driver is left as it was (a second compile in the same process would fail otherwise)."""
    if not weight_grad_ws.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "compiled.json"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "sm90_compile.py"), "--json", str(out)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    records = json.loads(out.read_text())
    names = {r["kernel"] for r in records}
    assert GLUON | TRITON <= names, sorted((GLUON | TRITON) - names)
    assert all(r["cubin_bytes"] > 0 and r["shared_bytes"] <= SM90_SHARED_LIMIT for r in records)
    wgrad = [r for r in records if r["kernel"] == "_wgrad_ws_kernel"]
    assert {(r["P_GATHER"], r["SERPENTINE"], r["WG_SPLIT"]) for r in wgrad} == {
        (pg, s, w) for pg in (False, True) for s in (False, True) for w in (False, True)}


def test_stand_in_driver_is_restored():
    """Inside ``hopper_stand_in`` Triton's active driver names an sm_90 target; after it, the one before is back
    (here none had been made active, or the one a GPU machine made)."""
    import runpy

    from triton.runtime import driver

    mod = runpy.run_path(str(REPO / "scripts" / "sm90_compile.py"))
    before = driver._active
    with mod["hopper_stand_in"]():
        target = driver.active.get_current_target()
        assert (target.backend, target.arch) == ("cuda", 90)
    assert driver._active is before
