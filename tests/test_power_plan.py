"""scripts/power_plan.py's generated verdicts and plan sentences, on hand-made rows."""

from __future__ import annotations

from helpers import load_script

pp = load_script("power_plan")


def _row(a: str, b: str, p: float, diff: float, lo: float, hi: float) -> dict:
    return {"a": a, "b": b, "budget": 512, "m": 4, "n": 100, "p": p, "diff": diff, "lo": lo, "hi": hi, "need": 9,
            "mdd": 0.05, "plan": 9}


def test_holm_and_the_verdict_words_by_hand() -> None:
    # p = 0.01, 0.04, 0.03, 0.002 (m = 4): sorted 0.002 x 4 = 0.008, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 ->
    # running max 0.06. The last row passes Holm but its interval holds 0: not resolved.
    rows = pp.with_holm([_row("x", "y", 0.01, +0.3, 0.1, 0.5), _row("x", "z", 0.04, -0.2, -0.4, -0.01),
                         _row("y", "z", 0.03, -0.1, -0.3, -0.02), _row("w", "z", 0.002, 0.1, -0.01, 0.2),
                         {"a": "v", "b": "z", "budget": 512, "note": "no paired runs"}])
    assert [round(r.get("holm", -1), 6) for r in rows] == [0.03, 0.06, 0.06, 0.008, -1]
    assert [r.get("verdict") for r in rows] == ["resolved: x higher", "not resolved", "not resolved", "not resolved",
                                                None]
    text = pp.tests_markdown(rows, "answer_logprob", "runs")
    assert "| x | y | 512 | 100 | +0.300 [+0.100, +0.500] | 0.01 | 0.03 | **resolved: x higher** | - |" in text
    assert "| x | z | 512 | 100 | -0.200 [-0.400, -0.010] | 0.04 | 0.06 | **not resolved** | 0.050 |" in text
    assert "4 comparisons of this table" in text


def test_plan_sentences() -> None:
    row = _row("x", "y", 0.2, 0.1, -0.1, 0.3)
    assert pp.sentence(row, "answer_logprob", None) == \
        "9 samples resolve the pilot's difference at alpha 0.05/4 with 80 % power"
    assert pp.sentence({**row, "need": 500}, "answer_logprob", 383).startswith("needs 500 samples, more than the cap")
    assert pp.sentence({**row, "need": None}, "answer_logprob", None).startswith("the pilot shows no difference")


def test_tests_csv_rows_carry_the_holm_p_and_the_verdict(tmp_path) -> None:
    import csv

    rows = pp.with_holm([_row("x", "y", 0.01, +0.3, 0.1, 0.5), _row("x", "z", 0.04, -0.2, -0.4, -0.01),
                         {"a": "v", "b": "z", "budget": 512, "note": "no paired runs"}])
    out = tmp_path / "tests.csv"
    pp.write_tests_csv(rows, "answer_logprob", out)
    got = list(csv.DictReader(out.open()))
    # Holm over two p: 0.01 x 2 = 0.02, then max(0.02, 0.04 x 1) = 0.04
    assert [(r["a"], r["b"], r["p_holm"], r["verdict"]) for r in got] == [
        ("x", "y", "0.02", "resolved: x higher"), ("x", "z", "0.04", "resolved: z higher"),
        ("v", "z", "", "no paired runs")]
    assert got[0]["diff"] == "0.300000" and got[0]["ci_low"] == "0.100000" and got[0]["n"] == "100"


def test_a_comparison_names_its_runs_and_budget() -> None:
    import pytest

    assert pp.parse_comparison("keydiff:tova") == pp.Comparison("keydiff", "tova", "", None)
    assert pp.parse_comparison("hashevict_h2o/hashevict:h2o@1024") == \
        pp.Comparison("hashevict", "h2o", "hashevict_h2o", (1024,))
    for bad in ("keydiff", "a:b:c", "sub/a:b@x", "a:", "sub/a:b@"):
        with pytest.raises(ValueError, match="DIR/"):
            pp.parse_comparison(bad)


def test_scoped_comparisons_pair_only_their_own_runs(tmp_path, capsys) -> None:
    from test_report_paired import write_run

    # The same pair of policies in two folders (the second H2O with other options): keydiff -1 on all 8 samples vs
    # the first H2O -2 on 6 and -1 on 2: mean +0.75; keydiff -3 vs the second H2O -2 on 4 and -3 on 4: -0.5. Each
    # comparison pairs the runs of its own folder only; one family, m = 2.
    write_run(tmp_path / "kd", "k", "keydiff", [0] * 8, logprob=[-1.0] * 8)
    write_run(tmp_path / "kd", "h", "h2o", [0] * 8, logprob=[-2.0] * 6 + [-1.0] * 2)
    write_run(tmp_path / "he", "x", "keydiff", [0] * 8, logprob=[-3.0] * 8)
    write_run(tmp_path / "he", "h", "h2o", [0] * 8, logprob=[-2.0] * 4 + [-3.0] * 4, options={"n_sink": 4})
    rows = pp.plan(tmp_path, "answer_logprob",
                   [pp.parse_comparison("kd/keydiff:h2o@256"), pp.parse_comparison("he/keydiff:h2o@256")], [])
    assert [(r["a"], r["b"], r["budget"], r["m"], r["n"], round(r["diff"], 6)) for r in rows] == [
        ("keydiff", "h2o", 256, 2, 8, 0.75), ("keydiff", "h2o", 256, 2, 8, -0.5)]
    out = tmp_path / "t.md"
    assert pp.main([str(tmp_path), "--out", str(out), "--tests", "--compare", "kd/keydiff:h2o"]) == 2
    assert "give --budgets, or a budget @N" in capsys.readouterr().err
    assert not out.exists()
    # Unscoped, keydiff:h2o matches a pair in each folder (and across them): refused, never the first match taken
    assert pp.main([str(tmp_path), "--out", str(out), "--tests", "--compare", "keydiff:h2o@256"]) == 2
    assert "keydiff:h2o@256 matches" in capsys.readouterr().err
    assert not out.exists()


def test_a_zero_difference_prints_without_a_sign_of_minus() -> None:
    # A difference of -0.0 (e.g. a sign flip of 0) and an interval end of -1e-9 print as +0.000.
    rows = pp.with_holm([_row("x", "y", 1.0, -0.0, -1e-9, 15.0)])
    assert "| x | y | 512 | 100 | +0.000 [+0.000, +15.000] | 1 | 1 | **not resolved** | 0.050 |" in \
        pp.tests_markdown(rows, "avg", "runs")


def test_several_scores_are_one_holm_family_and_each_row_names_its_score(tmp_path) -> None:
    import csv

    # two depth cells of one comparison: p = 0.01 and 0.04 over m = 2 -> Holm 0.02 and max(0.02, 0.04) = 0.04
    rows = pp.with_holm([{**_row("streamingllm", "full", 0.01, -70.0, -87.0, -54.0), "score": "L2000_D10"},
                         {**_row("streamingllm", "full", 0.04, 3.0, -9.0, 19.0), "score": "L2000_D90"}])
    text = pp.tests_markdown(rows, "L2000_D10,L2000_D90", "runs")
    assert "| a | b | N | score | n | diff [95 % CI] |" in text
    assert ("| streamingllm | full | 512 | L2000_D10 | 100 | -70.000 [-87.000, -54.000] | 0.01 | 0.02 | "
            "**resolved: full higher** | - |") in text
    assert ("| streamingllm | full | 512 | L2000_D90 | 100 | +3.000 [-9.000, +19.000] | 0.04 | 0.04 | "
            "**not resolved** |") in text
    pp.write_tests_csv(rows, "L2000_D10,L2000_D90", tmp_path / "t.csv")
    assert [(r["score"], r["p_holm"]) for r in csv.DictReader((tmp_path / "t.csv").open())] == [
        ("L2000_D10", "0.02"), ("L2000_D90", "0.04")]
    # several scores plan nothing (a plan sizes one score's family)
    assert pp.main([str(tmp_path), "--out", str(tmp_path / "o.md"), "--score", "a,b", "--compare", "x:y",
                    "--budgets", "512"]) == 2
