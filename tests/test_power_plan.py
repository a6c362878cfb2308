"""kvbench-report --plan (kvbench.report.plan): from a pilot: the n each comparison needs and the sentence it supports, on hand-made
rows and runs."""

from __future__ import annotations

import pytest

from test_report_analyses import report_exit

from kvbench.report import plan as pp


def _row(a: str, b: str, p: float, diff: float, lo: float, hi: float) -> dict:
    return {"a": a, "b": b, "budget": 512, "m": 4, "n": 100, "p": p, "diff": diff, "lo": lo, "hi": hi, "need": 9,
            "mdd": 0.05, "plan": 9}


def test_plan_sentences() -> None:
    row = _row("x", "y", 0.2, 0.1, -0.1, 0.3)
    assert pp.sentence(row, "answer_logprob", None) == \
        "9 samples resolve the pilot's difference at alpha 0.05/4 with 80 % power"
    assert pp.sentence({**row, "need": 500}, "answer_logprob", 383).startswith("needs 500 samples, more than the cap")
    assert pp.sentence({**row, "need": None}, "answer_logprob", None).startswith("the pilot shows no difference")


def test_a_comparison_is_two_policies() -> None:
    assert pp.parse_comparison("keydiff:tova") == ("keydiff", "tova")
    for bad in ("keydiff", "a:b:c", "a:", ":b"):
        with pytest.raises(ValueError, match="a:b"):
            pp.parse_comparison(bad)


def test_the_plan_reads_the_pilot_and_refuses_two_matching_pairs(tmp_path, capsys) -> None:
    from test_report_paired import write_run

    # keydiff -1 on all 8 samples vs h2o -2 on 6 and -1 on 2: diff +0.75 (m = 1 comparison x 1 budget)
    write_run(tmp_path / "kd", "k", "keydiff", [0] * 8, logprob=[-1.0] * 8)
    write_run(tmp_path / "kd", "h", "h2o", [0] * 8, logprob=[-2.0] * 6 + [-1.0] * 2)
    rows = pp.plan(tmp_path / "kd", "answer_logprob", [("keydiff", "h2o")], [256])
    assert [(r["a"], r["b"], r["budget"], r["m"], r["n"], round(r["diff"], 6)) for r in rows] == [
        ("keydiff", "h2o", 256, 1, 8, 0.75)]
    # A second H2O of other options on the same samples: which one the plan means is not ours to pick
    write_run(tmp_path / "kd", "h2", "h2o", [0] * 8, logprob=[-3.0] * 8, options={"n_sink": 4})
    out = tmp_path / "t.md"
    assert report_exit([str(tmp_path / "kd"), "--plan", str(out), "--compare", "keydiff:h2o", "--budgets", "256"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "keydiff:h2o@256 matches 2 pairs" in err
    assert not out.exists()
    assert report_exit([str(tmp_path / "kd"), "--plan", str(out), "--compare", "keydiff:h2o"]) == 2
    assert "--plan needs --compare and --budgets" in capsys.readouterr().err
