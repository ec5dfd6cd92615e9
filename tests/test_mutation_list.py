"""scripts/mutation_probe.py's planted bugs stay plantable: each mutant's snippet occurs exactly once in its file, its
replacement differs, and the test files it runs exist (a refactor that moves a snippet fails here, not silently as a
"stale" mutant in the next probe run)."""

from __future__ import annotations

import runpy
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_mutant_applies():
    mutants = runpy.run_path(str(REPO / "scripts" / "mutation_probe.py"), run_name="mutation_probe")["MUTANTS"]
    names = [m.name for m in mutants]
    assert len(names) == len(set(names)), "mutant names must be unique"
    for m in mutants:
        text = (REPO / m.path).read_text()
        assert text.count(m.find) == 1, f"{m.name}: its snippet occurs {text.count(m.find)} times in {m.path}"
        assert m.replace != m.find, m.name
        files = [t.split("::")[0] for t in m.tests if t.startswith("tests/")]
        assert files and all((REPO / f).is_file() for f in files), f"{m.name}: {m.tests}"
