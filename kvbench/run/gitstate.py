"""Which kvbench source a run used: the commit of the checkout kvbench runs from, and whether its working tree had
uncommitted changes (a commit alone does not say what ran when files were edited after it).

Torch-free (the report and tests import it cheaply). Each answer is computed once per process and per directory:
`git status` walks the tree, and a sweep asks for every run.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

_HERE = Path(__file__).parent


def _git(directory: Path, *args: str) -> str | None:
    """stdout of `git -C directory ARGS`, or None when git is missing, fails or `directory` is not in a checkout."""
    try:
        out = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


@functools.lru_cache(maxsize=None)
def commit(directory: Path = _HERE) -> str | None:
    """HEAD of the checkout holding `directory` (default: kvbench's own source), or None outside a git checkout."""
    out = _git(directory, "rev-parse", "HEAD")
    return (out or "").strip() or None


@functools.lru_cache(maxsize=None)
def dirty(directory: Path = _HERE) -> bool | None:
    """Whether that checkout's working tree has uncommitted changes (`git status --porcelain` prints anything:
    modified, staged, deleted or untracked files that .gitignore does not cover), or None outside a git checkout
    (e.g. an installed wheel). Untracked files count: a new module nobody committed changes what runs as much as an
    edited one."""
    if commit(directory) is None:
        return None
    out = _git(directory, "status", "--porcelain")
    return None if out is None else bool(out.strip())
