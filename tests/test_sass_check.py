"""benchmarks/sass_check.py: HGMMA descriptor registers that some path through the SASS leaves unset (CPU, on
SASS text shaped like nvdisasm's)."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
check = runpy.run_path(str(REPO / "benchmarks" / "sass_check.py"))["unset_descriptor_reads"]


def _sass(*lines: str) -> str:
    """nvdisasm-style text: labels as given, instructions numbered /*0000*/, /*0010*/, ..."""
    out, addr = [], 0
    for ln in lines:
        if ln.endswith(":"):
            out.append(ln)
        else:
            out.append(f"        /*{addr:04x}*/                   {ln} ;")
            addr += 16
    return "\n".join(out)


DESC = ("UMOV UR4, 0x100", "UMOV UR5, 0x40000040", "UMOV UR6, 0x2000", "UMOV UR7, 0x40000040")


def test_straight_line_is_clean_and_a_missing_register_is_named():
    assert check(_sass(*DESC, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4].tnspA.tnspB, R24", "EXIT")) == []
    found = check(_sass(*DESC[:3], "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4].tnspA.tnspB, R24", "EXIT"))
    assert [(a, miss) for a, _, miss in found] == [("0030", [7])]


def test_a_register_set_in_a_sibling_branch_only():
    """Session 59's miscompile: the 32-row branch reads UR10:UR11, which only the fall-through path sets."""
    def kernel(*before_branch):
        return _sass(
            "UMOV UR8, 0x100", "UMOV UR9, 0x40000040", *before_branch,
            "@!P0 BRA `(.L_x_1)",
            "UIADD3 UR10, UR8, 0x80, URZ", "UMOV UR11, 0x40000040",
            "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8].tnspA.tnspB, R24", "BRA `(.L_x_2)",
            ".L_x_1:",
            "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8].tnspA.tnspB, R24",
            ".L_x_2:",
            "EXIT")

    assert [(a, miss) for a, _, miss in check(kernel())] == [("0070", [10, 11])]
    # the same registers set before the branch: clean
    assert check(kernel("UIADD3 UR10, UR8, 0x80, URZ", "UMOV UR11, 0x40000040")) == []


def test_a_value_computed_from_an_unset_register_is_unset():
    """e71dff0's split form: UR8 recomputed from UR4, which only the other branch sets."""
    sass = _sass(
        "UMOV UR8, 0x100", "UMOV UR9, 0x40000040", "UMOV UR10, 0x2000", "UMOV UR11, 0x40000040",
        "@P1 BRA `(.L_x_1)",
        "UIADD3 UR4, UR8, 0x80, URZ", "BRA `(.L_x_2)",
        ".L_x_1:",
        "UIADD3 UR8, UP0, UR4, 0x180, URZ",
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8].tnspA.tnspB, R24",
        ".L_x_2:",
        "EXIT")
    assert [miss for _, _, miss in check(sass)] == [[8]]


def test_predicated_writes_and_loops():
    """A write under a predicate does not count; a register set before a loop stays set around its back edge,
    and one set only inside the loop body, after the HGMMA, is unset on the first trip."""
    pred = _sass(*DESC[:3], "@P0 UMOV UR7, 0x40000040",
                 "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4].tnspA.tnspB, R24", "EXIT")
    assert [miss for _, _, miss in check(pred)] == [[7]]
    loop = _sass(*DESC, ".L_x_0:", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4].tnspA.tnspB, R24",
                 "UIADD3 UR6, UR6, 0x80, URZ", "@P0 BRA `(.L_x_0)", "EXIT")
    assert check(loop) == []
    late = _sass(*DESC[:3], ".L_x_0:", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4].tnspA.tnspB, R24",
                 "UMOV UR7, 0x40000040", "@P0 BRA `(.L_x_0)", "EXIT")
    assert [miss for _, _, miss in check(late)] == [[7]]


def test_a_pair_write_sets_both_registers():
    """``.64`` opcodes write a pair from pairs; ``.WIDE`` ones a pair from 32-bit sources (ptxas's UIMAD.WIDE, whose
    high half the up-projection's descriptors are built from)."""
    sass = _sass("UMOV UR6, 0x2000", "UMOV UR7, 0x40000040", "UIADD3.64 UR4, UR6, 0x80, URZ",
                 "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4].tnspA.tnspB, R24", "EXIT")
    assert check(sass) == []
    wide = _sass("UMOV UR9, 0x3", "UIMAD.WIDE UR6, UR9, 0x100, URZ", "UMOV UR4, 0x100", "UMOV UR5, 0x40000040",
                 "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4].tnspA.tnspB, R24", "EXIT")
    assert check(wide) == []
    assert [miss for _, _, miss in check(wide.replace("UIMAD.WIDE", "UIMAD"))] == [[7]]


def test_an_indirect_jump_goes_only_to_its_listed_targets():
    """Warp specialisation dispatches the partitions by BRX, whose targets nvdisasm lists. Taken as a jump to any
    label, it would skip the block that sets the descriptors and flag the HGMMA after it."""
    sass = _sass(
        'BRX R2 -0x10 (*"BRANCH_TARGETS .L_x_1,.L_x_3"*)',
        ".L_x_1:",
        *DESC,
        ".L_x_2:",
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4].tnspA.tnspB, R24", "@P0 BRA `(.L_x_2)", "EXIT",
        ".L_x_3:",
        "EXIT")
    assert check(sass) == []
    assert len(check(sass.replace("BRANCH_TARGETS .L_x_1,.L_x_3", "no list"))) == 1


def test_the_layers_gluon_kernels_set_every_descriptor_on_every_path():
    """Each Gluon kernel's default config (the weight gradients also in load order with the serpentine schedule,
    SONICMOE_WGRAD_ORDER=load; the up-projection and dH also with gpt-oss's clamped SwiGLU), compiled offline for sm_90
    by Triton's own ptxas (``resource_report.py --space default --check-sass``, in a process without the interpreter
    that the other tests run under): every config compiles, and no HGMMA reads a descriptor register that some path
    leaves unset."""
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "resource_report.py"), "--space", "default",
                          "--check-sass"], capture_output=True, text=True, timeout=1200,
                         env={**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                              "PYTHONPATH": str(REPO)}).stdout
    compiled = [ln for ln in out.splitlines() if " reg " in ln]
    assert len(compiled) == 14 and "ERROR" not in out, out
    assert sum(ln.startswith("dw1_ws_load") or ln.startswith("dw2_ws_load") for ln in compiled) == 2, out
    assert sum(ln.startswith(("up_ws_clamped", "dh_ws_clamped")) for ln in compiled) == 3, out
    assert not [ln for ln in compiled if "HGMMA-DESC-UNSET" in ln], out


def test_a_branch_on_a_predicate_operand_also_falls_through():
    """``BRA.U !UP0, target`` is conditional like ``@!UP0 BRA target``. The path that falls through past it
    skips the block that sets UR7, so the HGMMA is flagged either way."""
    sass = _sass(*DESC[:3], "BRA.U !UP0, `(.L_x_1)", "BRA `(.L_x_2)",
                 ".L_x_1:", "UMOV UR7, 0x40000040",
                 ".L_x_2:", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4].tnspA.tnspB, R24", "EXIT")
    assert [miss for _, _, miss in check(sass)] == [[7]]
    assert [miss for _, _, miss in check(sass.replace("BRA.U !UP0, ", "@!UP0 BRA "))] == [[7]]
