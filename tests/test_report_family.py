"""kvbench-report --design: a design's planned comparisons tested from the runs' records, worked by hand."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from kvbench.report.cli import main
from kvbench.report.family import DESIGN_HEAD
from test_report_paired import write_run


def test_a_design_is_tested_from_the_records(tmp_path: Path) -> None:
    # keydiff's graded score -1 on all 8 samples, h2o's -2 on 6 and -1 on 2: d = (1 x 6, 0 x 2), diff = 0.75.
    # Exact sign flips (8 <= 16 samples): |sum| >= 6 needs the six 1s one sign, the two 0s free: 2 * 4 = 8 of the
    # 2^8 = 256 patterns, p = 0.03125; one test, so Holm p = p; resolved (the interval lies above 0).
    write_run(tmp_path / "runs/kd", "k", "keydiff", [0] * 8, logprob=[-1.0] * 8)
    write_run(tmp_path / "runs/kd", "h", "h2o", [0] * 8, logprob=[-2.0] * 6 + [-1.0] * 2)
    with (tmp_path / "design.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(DESIGN_HEAD)
        w.writerow(["M", "keydiff", "", "stated", "col", "kd", "keydiff", "h2o", "256", "answer_logprob", "", "8"])
    main([str(tmp_path / "runs"), "--design", str(tmp_path / "design.csv"), "--out", str(tmp_path / "o"), "-q"])
    (row,) = csv.DictReader((tmp_path / "o/tests.csv").open())
    assert (row["family"], row["m"], row["n"], row["test"], row["diff"]) == ("M", "1", "8", "sign-flip (exact)",
                                                                            "0.750000")
    assert float(row["p"]) == pytest.approx(0.03125) and float(row["p_holm"]) == pytest.approx(0.03125)
    assert row["verdict"] == "resolved: keydiff higher" and row["p_floor"] == "0"


def test_a_comparison_without_its_runs_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "runs").mkdir()
    with (tmp_path / "design.csv").open("w", newline="") as f:
        csv.writer(f).writerows([DESIGN_HEAD, ["M", "", "", "related", "c", "nope", "a", "b", "256", "avg", "", ""]])
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "runs"), "--design", str(tmp_path / "design.csv")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope: no such runs folder" in err
