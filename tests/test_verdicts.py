"""results/README.md states no hand-typed verdict: every block between `<!-- verdicts:NAME:begin/end -->` is what
scripts/verdicts.py writes from the committed CSVs, and every row's verdict, numbers and Holm p are its test's.
A planted wrong row in a hand-made table is caught."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def v() -> Any:
    # Registered in sys.modules before it runs: its dataclass resolves its annotations through its module.
    spec = importlib.util.spec_from_file_location("verdicts", ROOT / "scripts" / "verdicts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["verdicts"] = module
    spec.loader.exec_module(module)
    return module


def test_the_readme_blocks_are_generated_and_agree_with_their_tests(v: Any) -> None:
    assert v.check_readme(ROOT / "results" / "README.md") == []


def test_an_edited_block_differs_from_the_generated_one(v: Any, tmp_path: Path) -> None:
    text = (ROOT / "results" / "README.md").read_text(encoding="utf-8")
    # Drop one generated row (a hand edit that leaves every other row true): (a) catches it.
    row = next(ln for ln in text.splitlines() if ln.startswith("| keydiff | tova | 1024 | answer_logprob"))
    (tmp_path / "README.md").write_text(text.replace(row + "\n", "", 1), encoding="utf-8")
    errors = v.check_readme(tmp_path / "README.md")
    assert errors == ["niah_grid:keydiff: differs from what scripts/verdicts.py writes from the committed CSVs"]


HEAD = ["model", "task", "score", "policy_a", "settings_a", "policy_b", "settings_b", "n", "mean_a", "mean_b", "diff",
        "ci_low", "ci_high", "p_value", "n_required", "min_detectable_diff"]


def test_a_planted_wrong_row_is_caught(v: Any, tmp_path: Path) -> None:
    path = tmp_path / "paired.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEAD)
        w.writerow(["m", "niah", "avg", "tova", "N=512 B=128", "full", "-", 15, 20, 60, -40, -66.7, -13.3, 0.01,
                    "resolved", 40.0])
        w.writerow(["m", "niah", "avg", "snapkv", "N=512 B=128", "full", "-", 15, 50, 60, -10, -30, 10, 0.5, "116",
                    40.0])
    tests = v.paired_tests(path, v.vs_full(("avg",)))
    # Holm over the two rows: sorted 0.01 * 2 = 0.02, 0.5 * 1 = 0.5 (running max 0.5): q = 0.02 and 0.5.
    assert [(t.a, t.q) for t in tests] == [("tova", 0.02), ("snapkv", 0.5)]
    body = "\n".join(v.table(v.TEST_HEAD, [v.test_row(t) for t in tests])) + "\n"
    assert "| tova | full | 512 | avg | 15 | -40.00 [-66.70, -13.30] | 0.01 | 0.02 | **resolved: full higher** | - |" \
        in body
    assert "| snapkv | full | 512 | avg | 15 | -10.00 [-30.00, +10.00] | 0.5 | 0.5 | **not resolved** | 116 |" in body
    assert v.check("t", body, tests=tests) == []
    # A verdict the test does not give: snapkv's interval holds 0 and its Holm p is 0.5.
    planted = body.replace("| 0.5 | 0.5 | **not resolved** | 116 |", "| 0.5 | 0.5 | **resolved: full higher** | 116 |")
    assert len(v.check("t", planted, tests=tests)) == 1
    # The raw p stated as the Holm p (0.01 for 0.02), and a number that is not the row's.
    assert len(v.check("t", body.replace("| 0.01 | 0.02 |", "| 0.01 | 0.01 |"), tests=tests)) == 1
    assert len(v.check("t", body.replace("-40.00 [", "-45.00 ["), tests=tests)) == 1
    # The same row with its sides swapped is the same test (diff and interval negated): no error.
    swapped = body.replace("| tova | full | 512 | avg | 15 | -40.00 [-66.70, -13.30] | 0.01 | 0.02 | "
                           "**resolved: full higher** |",
                           "| full | tova | 512 | avg | 15 | +40.00 [+13.30, +66.70] | 0.01 | 0.02 | "
                           "**resolved: full higher** |")
    assert v.check("t", swapped, tests=tests) == []
    # A row naming no test of the source.
    assert len(v.check("t", body.replace("| snapkv | full |", "| adakv | full |"), tests=tests)) == 1


def test_a_planted_claim_verdict_is_caught(v: Any) -> None:
    # Claim 1, two tests on the 0/100 score: one resolved for the claim (Holm p 0.01, interval above 0), one not
    # (p 0.3): "not resolved (n = 15)", not "holds".
    tests = [v.Test("keydiff", "tova", "512", "avg", 15, 40.0, 13.3, 66.7, 0.005, 0.01, claim="1"),
             v.Test("keydiff", "h2o", "512", "avg", 15, 10.0, -5.0, 25.0, 0.3, 0.3, claim="1")]
    claims = [("1", "KeyDiff beats TOVA and H2O", "holds", "not run")]  # claims.csv says holds: the tests win
    rows = [["1", "KeyDiff beats TOVA and H2O", "not resolved (n = 15)", "not run"]]
    body = "\n".join([*v.table(v.CLAIM_HEAD, rows), "", *v.table(v.CLAIM_TEST_HEAD, [v.test_row(t) for t in tests])])
    assert v.check("c", body, tests=tests, claims=claims) == []
    wrong = body.replace("| not resolved (n = 15) | not run |", "| holds | not run |")
    assert v.check("c", wrong, tests=tests, claims=claims) == [
        "c: claim 1: stated ['holds', 'not run'], its tests give ['not resolved (n = 15)', 'not run']"]
    # The claim verdict rule: every test resolved for the claim -> holds; one resolved against -> reversed.
    assert v.claim_verdict(tests[:1], "x") == "holds"
    against = v.Test("keydiff", "h2o", "512", "avg", 15, -30.0, -50.0, -10.0, 0.001, 0.002, claim="1")
    assert v.claim_verdict([tests[0], against], "x") == "reversed"


def test_a_planned_comparison_block_is_checked_per_file(v: Any, tmp_path: Path, monkeypatch: Any) -> None:
    # A power_plan.py --tests CSV of two comparisons: p 0.01 and 0.04 -> Holm 0.02 and max(0.02, 0.04) = 0.04.
    path = tmp_path / "tests.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["a", "b", "budget", "score", "n", "diff", "ci_low", "ci_high", "p", "p_holm", "verdict"])
        w.writerow(["keydiff", "tova", "1024", "avg", 93, "20.0", "8.0", "32.0", "0.01", "0.02", "resolved: keydiff higher"])
        w.writerow(["sagekv", "streamingllm", "512", "avg", 93, "-3.0", "-9.0", "3.0", "0.04", "0.04", "not resolved"])
        w.writerow(["hashevict", "h2o", "1024", "avg", "", "", "", "", "", "", "no paired runs"])
    monkeypatch.setitem(v.PLANNED, "x", (path,))
    monkeypatch.setattr(v, "ROOT", tmp_path)
    body = "\n".join(v.planned_block((path,))()) + "\n"
    assert body.startswith("`tests.csv` (avg): 1 of 2 planned comparisons resolved (Holm family: these 2).")
    assert "| keydiff | tova | 1024 | avg | 93 | +20.00 [+8.00, +32.00] | 0.01 | 0.02 | **resolved: keydiff higher** |" \
        in body
    assert "hashevict" not in body  # a comparison that was not run states no verdict
    assert v.check("x:tests", body) == []
    planted = body.replace("| 0.04 | 0.04 | **not resolved** |", "| 0.04 | 0.04 | **resolved: streamingllm higher** |")
    assert len(v.check("x:tests", planted)) == 1
    # A p_holm in the file that is not Holm over the file is named.
    path.write_text(path.read_text().replace(",0.01,0.02,", ",0.01,0.01,"))
    assert [e for e in v.check("x:tests", body) if "is not Holm's" in e] == [
        "x:tests: keydiff vs tova N=1024 avg: p_holm 0.01 is not Holm's 0.020000"]


def test_two_files_of_a_planned_block_may_hold_the_same_comparison(v: Any, tmp_path: Path, monkeypatch: Any) -> None:
    # StreamingLLM vs the full cache on answer_logprob at N = 1024 in two families (the LM score's and the NIAH grid's),
    # with other numbers: each file's rows are checked against that file alone.
    head = ["a", "b", "budget", "score", "n", "diff", "ci_low", "ci_high", "p", "p_holm", "verdict"]
    paths = []
    for name, row in (("lm.csv", ["-0.06", "-0.09", "-0.04", "0.0002", "0.0002", "resolved: full higher"]),
                      ("grid.csv", ["-1.45", "-2.02", "-0.91", "0.0004", "0.0004", "resolved: full higher"])):
        path = tmp_path / name
        with path.open("w", newline="") as f:
            csv.writer(f).writerows([head, ["streamingllm", "full", "1024", "answer_logprob", 50, *row]])
        paths.append(path)
    monkeypatch.setitem(v.PLANNED, "x", tuple(paths))
    monkeypatch.setattr(v, "ROOT", tmp_path)
    body = "\n".join(v.planned_block(tuple(paths))()) + "\n"
    assert v.check("x:tests", body) == []
    # the two rows swapped between the files: each is now the other file's, and both are named
    lm_row = "| -0.06 [-0.09, -0.04] | 0.0002 | 0.0002 |"
    grid_row = "| -1.45 [-2.02, -0.91] | 0.0004 | 0.0004 |"
    swapped = body.replace(lm_row, "@").replace(grid_row, lm_row).replace("@", grid_row)
    assert len(v.check("x:tests", swapped)) == 2
    assert v.check("x:tests", body.split("`grid.csv`")[0]) == ["x:tests: no section for grid.csv"]
