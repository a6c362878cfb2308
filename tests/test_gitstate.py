"""kvbench.run.gitstate: the commit and the uncommitted-changes flag that every run's metrics.json records."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvbench.run import gitstate


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


def test_clean_modified_untracked_and_not_a_repo(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "pkg" / "a.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("scratch/\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "one")
    gitstate.commit.cache_clear()
    gitstate.dirty.cache_clear()
    sub = repo / "pkg"  # asked from a subdirectory, as kvbench asks from its package directory
    assert gitstate.dirty(sub) is False
    assert len(gitstate.commit(sub) or "") == 40

    (repo / "scratch").mkdir()
    (repo / "scratch" / "out.txt").write_text("ignored")  # git-ignored output is not a change
    gitstate.dirty.cache_clear()
    assert gitstate.dirty(sub) is False

    (repo / "pkg" / "a.py").write_text("x = 2\n")
    gitstate.dirty.cache_clear()
    assert gitstate.dirty(sub) is True

    _git(repo, "checkout", "--", "pkg/a.py")
    (repo / "pkg" / "new.py").write_text("")  # an untracked, not ignored file: code nobody committed
    gitstate.dirty.cache_clear()
    assert gitstate.dirty(sub) is True

    plain = tmp_path / "plain"
    plain.mkdir()
    assert gitstate.commit(plain) is None and gitstate.dirty(plain) is None


def test_computed_once_per_process(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a").write_text("1")
    _git(repo, "add", "a")
    _git(repo, "commit", "-q", "-m", "one")
    gitstate.dirty.cache_clear()
    assert gitstate.dirty(repo) is False
    (repo / "a").write_text("2")
    assert gitstate.dirty(repo) is False  # the answer of the process's first ask (one `git status` per process)


def test_torch_free() -> None:
    code = "import sys, kvbench.run.gitstate as g; g.dirty(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_report_code_line_shows_the_tree() -> None:
    from kvbench.report.output import _tree_note

    # Runs written before `dirty` was recorded (absent, or null outside a checkout) print as before: unknown.
    assert [_tree_note(v) for v in (True, False, None)] == [" + uncommitted changes", " (clean tree)", ""]
