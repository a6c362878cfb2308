"""No committed result, script or document names a machine's own directories: a reader's machine has other ones,
and a home or temporary path says where someone's files were, not what the reader should run."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("results", "scripts", "docs", "README.md")
# A home, temporary or checkout directory: absolute, not part of a longer path or URL (…/tmp/ inside a URL, or a
# relative results/runs/ path, is not matched: the character before the slash must not be a word char, '.', '/' or ':').
MACHINE_PATH = re.compile(r"(?<![\w./:~-])(/(?:root|home|tmp|Users|var/folders|private/var|work|mnt|scratch)/[^\s\"'`)]*"
                          r"|[A-Za-z]:\\(?:Users|Windows)\\[^\s\"']*)")


def machine_paths(text: str, root: Path = REPO_ROOT) -> list[str]:
    """The machine paths in `text`: the patterns above, and the checkout's own absolute path wherever it is."""
    found = MACHINE_PATH.findall(text)
    if str(root) in text:
        found.append(str(root))
    return found


def _files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *SCANNED],
                         cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.split("\n")
    return [REPO_ROOT / f for f in out if f and (REPO_ROOT / f).is_file()]


def test_the_pattern_finds_what_it_should_and_nothing_else() -> None:
    # Planted cases, so the scan below cannot pass by matching nothing.
    assert machine_paths('{"model_dir": "/root/.cache/kvbench/models/x"}') == ["/root/.cache/kvbench/models/x"]
    assert machine_paths("python -m venv /tmp/kvpress-venv") == ["/tmp/kvpress-venv"]
    assert machine_paths("run directory: /home/ana/kvbench/results/runs/a") == ["/home/ana/kvbench/results/runs/a"]
    assert machine_paths(r"C:\Users\ana\kvbench") == [r"C:\Users\ana\kvbench"]
    assert machine_paths(f"cd {REPO_ROOT}/results", root=REPO_ROOT) != []
    for fine in ("results/runs/niah_grid", "~/.cache/kvbench", "$KVBENCH_CACHE/models", "../shared/reference",
                 "https://example.org/home/page", "a/tmp/b", "see docs/sweeps.md"):
        assert machine_paths(fine, root=REPO_ROOT / "no-such-checkout") == [], fine


def test_no_machine_path_in_results_scripts_docs_and_readme() -> None:
    files = _files()
    assert any(f.suffix == ".jsonl" for f in files) and any(f.name == "README.md" for f in files)
    bad = {}
    for f in files:
        data = f.read_bytes()
        if b"\0" in data:  # a picture
            continue
        hits = machine_paths(data.decode("utf-8", errors="replace"))
        if hits:
            bad[str(f.relative_to(REPO_ROOT))] = sorted(set(hits))[:3]
    assert not bad, f"machine paths in committed files: {bad}"
