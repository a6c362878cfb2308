"""Where tests find the shared reference files: `../shared/reference` beside the repository root (every clone,
CI's included, has `../shared/` next to it). A missing reference directory skips the test with the path it
looked at as the reason; a directory that exists but lacks a listed file is a failure."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
REFERENCE = REPO_ROOT / ".." / "shared" / "reference"


def reference_file(benchmark: str, name: str) -> Path:
    """`../shared/reference/<benchmark>/<name>`; skips the calling test when that directory is missing."""
    d = (REFERENCE / benchmark).resolve()
    if not d.is_dir():
        pytest.skip(f"reference directory not found: {d} (expected ../shared/reference beside the repository)")
    path = d / name
    assert path.is_file(), f"{path} is missing from the reference directory"
    return path
