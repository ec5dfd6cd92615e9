"""Read an HGMMA's descriptor registers where a path leaves them unset: a check of nvdisasm SASS.

A Hopper ``HGMMA ... gdesc[URx]`` takes its A and B shared-memory descriptors from the uniform registers URx to
URx+3. In session 59 ptxas (12.8, the one Triton 3.6 carries) compiled a Gluon kernel whose branches issued
different numbers of wgmma k16 steps. It set some of those registers in one branch and read them in a sibling
branch. On the GPU the read registers held stale values, and the HGMMA read shared memory out of bounds
(compute-sanitizer; ``benchmarks/results/2026-12-02_nvidia-h200_session59/``). The PTX was right.

This module finds such reads offline. It splits the SASS into basic blocks and computes, by a forward must-analysis
(an intersection over predecessors), which uniform registers every path from the kernel's entry has written. It
reports every HGMMA that reads a descriptor register outside that set. A write under a predicate does not count,
so a report can be a false alarm; a clean result means every path sets every descriptor register.

``benchmarks/resource_report.py --check-sass`` runs it on every compiled config.
usage: python benchmarks/sass_check.py FILE.sass [...]
"""

from __future__ import annotations

import argparse
import re
import sys

_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_\w+):")
_TARGET = re.compile(r"`\((\.L_\w+)\)")
_UR = re.compile(r"^UR(\d+)$")
_GDESC = re.compile(r"gdesc\[UR(\d+)\]")


def _blocks(sass: str) -> list[dict]:
    """Basic blocks of nvdisasm output: each {"label", "instrs": [(addr, text)], "ends": (the branch's opcode,
    whether it is conditional, its target match) or None, "succ": [index]}."""
    blocks: list[dict] = []
    labels: dict[str, int] = {}
    cur = None

    def start(label=None):
        nonlocal cur
        cur = {"label": label, "instrs": [], "ends": None}
        blocks.append(cur)
        if label:
            labels[label] = len(blocks) - 1

    start()
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            if cur["instrs"] or cur["label"]:
                start(m[1])
            else:
                cur["label"] = m[1]
                labels[m[1]] = len(blocks) - 1
            continue
        m = _LINE.match(line)
        if not m:
            continue
        cur["instrs"].append((m[1], m[2]))
        op = m[2].split()
        pred = op[0].startswith("@")
        name = op[1] if pred else op[0]
        if name.startswith(("BRA", "EXIT", "RET", "BRX", "JMX", "JMP")):
            # a predicate among the operands (BRA.U !UP0, ...) makes it conditional too
            cond = pred or bool(re.match(r"\S+\s+!?U?P[0-9T]\b", m[2].split(None, 1)[1] if pred else m[2]))
            cur["ends"] = (name, cond, _TARGET.search(m[2]))
            start()
    for i, b in enumerate(blocks):
        succ = []
        ends = b["ends"]
        if ends is None or ends[1]:  # falls through
            if i + 1 < len(blocks):
                succ.append(i + 1)
        if ends is not None:
            name, _, target = ends
            listed = re.search(r"BRANCH_TARGETS ([\w.,]+)", b["instrs"][-1][1])
            if target and target[1] in labels:
                succ.append(labels[target[1]])
            elif listed:  # an indirect jump whose targets nvdisasm lists (warp specialisation's dispatch)
                succ.extend(labels[t] for t in listed[1].split(",") if t in labels)
            elif name.startswith(("BRX", "JMX", "JMP")):  # an indirect jump: any label
                succ.extend(labels.values())
        b["succ"] = succ
    return blocks


def _step(text: str, done: set[int]) -> set[int]:
    """The uniform registers set after instruction ``text``, given ``done`` before it.

    An instruction whose first operand is URn (both of a pair for a ``.64`` or ``.WIDE`` opcode) sets it when it
    runs without a predicate and its uniform sources are all set. Otherwise it leaves the register unset: a value
    computed from an unset register is unset too. Under a predicate the register keeps what it had, as on the paths
    where the write did not run."""
    parts = text.split(None, 1)
    if len(parts) < 2 or parts[0].startswith(("@", "HGMMA")):
        return done
    operands = [o.strip() for o in parts[1].split(",")]
    m = _UR.match(operands[0])
    if not m:
        return done
    n, wide = int(m[1]), ".64" in parts[0]
    dest = {n, n + 1} if wide or ".WIDE" in parts[0] else {n}
    sources: set[int] = set()
    for o in operands[1:]:
        for r in re.findall(r"\bUR(\d+)\b", o):
            sources |= {int(r), int(r) + 1} if wide else {int(r)}
    return done | dest if sources <= done else done - dest


def unset_descriptor_reads(sass: str) -> list[tuple[str, str, list[int]]]:
    """(address, instruction, the registers unset on some path) for every HGMMA whose ``gdesc[URx]`` reads one
    of URx to URx+3 that some path from the kernel's entry leaves unwritten."""
    blocks = _blocks(sass)
    universe = set(range(256))
    into = [set() if i == 0 else set(universe) for i in range(len(blocks))]
    preds: list[list[int]] = [[] for _ in blocks]
    for i, b in enumerate(blocks):
        for s in b["succ"]:
            preds[s].append(i)
    reach = {0}
    todo = [0]
    while todo:
        for s in blocks[todo.pop()]["succ"]:
            if s not in reach:
                reach.add(s)
                todo.append(s)

    def out_of(i):
        done = set(into[i])
        for _, text in blocks[i]["instrs"]:
            done = _step(text, done)
        return done

    changed = True
    while changed:
        changed = False
        for i in sorted(reach):
            if i == 0:
                continue
            ins = [out_of(p) for p in preds[i] if p in reach]
            new = set.intersection(*ins) if ins else set()
            if new != into[i]:
                into[i] = new
                changed = True
    found = []
    for i in sorted(reach):
        done = set(into[i])
        for addr, text in blocks[i]["instrs"]:
            m = _GDESC.search(text)
            if m and "HGMMA" in text:
                missing = [r for r in range(int(m[1]), int(m[1]) + 4) if r not in done]
                if missing:
                    found.append((addr, text, missing))
            done = _step(text, done)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="nvdisasm -c output")
    bad = 0
    for path in ap.parse_args().files:
        found = unset_descriptor_reads(open(path).read())
        for addr, text, missing in found:
            print(f"{path}: {addr}: {text}  unset on some path: {', '.join(f'UR{r}' for r in missing)}")
        bad += len(found)
    print(f"{bad} HGMMA descriptor reads unset on some path")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
