"""Where a result came from: the git commit of the sonicmoe checkout (for results files and logs)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def _git_output(*args: str) -> str | None:
    """The stripped output of a git command in the checkout ("" for none), or None when git failed or is missing."""
    if shutil.which("git") is None:
        return None
    repo = str(Path(__file__).resolve().parent)
    try:
        res = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _git(*args: str) -> str | None:
    return _git_output(*args) or None


def git_commit() -> str | None:
    """HEAD of the checkout, or SONICMOE_GIT_COMMIT when set (e.g. a copy of the tree without .git on a
    GPU machine); None when neither is known."""
    return os.environ.get("SONICMOE_GIT_COMMIT") or _git("rev-parse", "HEAD")


def git_dirty() -> bool | None:
    """Whether tracked files differ from HEAD (None when unknown: no git, or a tree without ``.git``, even with
    SONICMOE_GIT_COMMIT set)."""
    status = _git_output("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)
