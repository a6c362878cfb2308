"""The committed tables come from the committed runs alone: kvbench-report on a results folder's runs/ (what
scripts/tables.sh runs) writes table.md, table.csv, runs.csv and paired.csv byte for byte as committed. The report
reads no scratch directory, no Hydra job file and no file time, so any checkout gets the same tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.report.cli import report

ROOT = Path(__file__).resolve().parent.parent
TABLES = ("table.md", "table.csv", "runs.csv", "paired.csv")


def _check(folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runs: str | None = None) -> None:
    """results/<folder>'s tables against a report of its runs (default results/<folder>/runs)."""
    monkeypatch.chdir(ROOT)  # the tables name the runs by their path below the repository, as scripts/tables.sh does
    report(Path("results") / (runs or f"{folder}/runs"), quiet=True, out=tmp_path)  # (table.md names its plots)
    for name in TABLES:
        assert (tmp_path / name).read_text() == (ROOT / "results" / folder / name).read_text(), f"{folder}/{name}"


def test_the_ruler_tables_regenerate_from_the_committed_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _check("ruler_4k", tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["niah_grid", "claims", "qwen2.5-coder-1.5b", "evidence_niah", "evidence_lm",
                                    "evidence_lm_essays", "evidence_code", "pilot_niah", "pilot_ruler"])
def test_every_committed_table_regenerates(folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _check(folder, tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("part", ["evidence_qwen/pilot", "evidence_qwen/lm", "evidence_qwen/grid", "evidence_qwen/code",
                                  "evidence_knorm/pilot", "evidence_knorm/grid", "evidence_ruler/final",
                                  "evidence_ruler_qwen/pilot", "evidence_ruler_qwen/final", "evidence_ruler_2k/pilot",
                                  "evidence_ruler_2k/final", "evidence_ruler_qwen_2k/pilot",
                                  "evidence_ruler_qwen_2k/final"])
def test_the_evidence_parts_regenerate(part: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # results/evidence_qwen, evidence_knorm and evidence_ruler* report each part of their runs apart (scripts/tables.sh)
    folder, name = part.split("/")
    _check(part, tmp_path, monkeypatch, runs=f"{folder}/runs/{name}")
