"""kvbench-report --budget-choice (kvbench.report.budgets): the pilot's budget choice, on hand-made runs."""

from __future__ import annotations

import json
from pathlib import Path

from test_report_analyses import report_exit

from kvbench.report import budgets as bc


def _run(root: Path, name: str, policy: str, budget: int | None, scores: list[float]) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps({"policy": policy, "budget": budget}))
    (d / "predictions.jsonl").write_text("".join(json.dumps({"id": s, "score": v}) + "\n"
                                                 for s, v in zip("abcd", scores)))


def test_budgets_by_hand(tmp_path: Path) -> None:
    # full cache 100 on a-d. N = 256: keydiff fails all, tova answers c only -> a, b, d fail for both (3), 1
    # informative of 4 < half: not chosen. N = 512: keydiff misses b, tova misses c -> a, d answered by both (2),
    # b and c informative (2 of 4 = half): chosen.
    _run(tmp_path, "full", "full", None, [100, 100, 100, 100])
    _run(tmp_path, "k256", "keydiff", 256, [0, 0, 0, 0])
    _run(tmp_path, "t256", "tova", 256, [0, 0, 100, 0])
    _run(tmp_path, "k512", "keydiff", 512, [100, 0, 100, 100])
    _run(tmp_path, "t512", "tova", 512, [100, 100, 0, 100])
    out = tmp_path / "budgets.md"
    assert report_exit([str(tmp_path), "--budget-choice", str(out)]) == 0
    text = out.read_text()
    assert "| 256 | 4 | 100 | 0 | 25 | 3 | 0 | 1 | not chosen: only 1 of 4 samples tell the policies apart |" in text
    assert "| 512 | 4 | 100 | 75 | 75 | 0 | 2 | 2 | chosen |" in text
    assert text.rstrip().endswith("Chosen budgets: 512.")
    table = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert len({ln.count("|") for ln in table}) == 1  # header, separator and rows have the same columns


def test_a_full_cache_below_90_is_named(tmp_path: Path) -> None:
    _run(tmp_path, "full", "full", None, [100, 100, 100, 0])  # 75
    _run(tmp_path, "k", "keydiff", 512, [100, 0, 100, 0])
    _run(tmp_path, "t", "tova", 512, [0, 100, 100, 0])
    text = bc.markdown(bc.rows(*bc.load(tmp_path)), "x")
    assert "not chosen: the full cache scores 75 < 90 |" in text and "Chosen budgets: none" in text
    assert report_exit([str(tmp_path / "nothing"), "--budget-choice", str(tmp_path / "o.md")]) == 2


def test_pick_takes_the_most_informative_chosen_budget(tmp_path: Path, capsys) -> None:
    # full 100 on a-d; (keydiff, tova) per sample. N = 512: a (0, 0) all fail, b (0, 100) informative, c (100, 100)
    # all answer, d (100, 0) informative -> 2 of 4: chosen.
    # N = 1024: a: (100, 0), b: (0, 100), c: (100, 100), d: (100, 0) -> 3 informative: chosen, and picked.
    # N = 2048: every sample answered by both -> 0 informative: not chosen.
    _run(tmp_path, "full", "full", None, [100, 100, 100, 100])
    _run(tmp_path, "k512", "keydiff", 512, [0, 0, 100, 100])
    _run(tmp_path, "t512", "tova", 512, [0, 100, 100, 0])
    _run(tmp_path, "k1024", "keydiff", 1024, [100, 0, 100, 100])
    _run(tmp_path, "t1024", "tova", 1024, [0, 100, 100, 0])
    _run(tmp_path, "k2048", "keydiff", 2048, [100, 100, 100, 100])
    _run(tmp_path, "t2048", "tova", 2048, [100, 100, 100, 100])
    out = tmp_path / "budgets.md"
    assert report_exit([str(tmp_path), "--budget-choice", str(out), "--pick"]) == 0
    assert capsys.readouterr().out == "1024\n"
    assert "The final grid runs at N = 1024" in out.read_text()


def test_pick_breaks_a_tie_to_the_larger_budget_and_fails_when_none_is_chosen(tmp_path: Path, capsys) -> None:
    rows = [{"budget": 512, "n": 4, "full": 100.0, "informative": 2}, {"budget": 1024, "n": 4, "full": 100.0,
                                                                         "informative": 2}]
    assert bc.pick(rows) == 1024
    assert bc.pick([{**rows[0], "full": 75.0}]) is None
    _run(tmp_path, "full", "full", None, [100, 100, 100, 0])  # 75: nothing is chosen
    _run(tmp_path, "k", "keydiff", 512, [100, 0, 100, 0])
    assert report_exit([str(tmp_path), "--budget-choice", str(tmp_path / "o.md"), "--pick"]) == 1
    assert capsys.readouterr().out == ""


def test_most_informative_ignores_the_share_but_not_the_full_cache(tmp_path: Path, capsys) -> None:
    # K-norm's pilot shape: full 100 on a-d; (knorm, random) per sample. N = 1536: a-c (0, 0), d (0, 100) -> 1
    # informative of 4: not chosen. N = 1792: a (100, 100), b (100, 0), c (0, 100), d (100, 100) -> 2 of 4: chosen
    # by the share too; with c answered by both only 1 of 4 -> not chosen, and a tie with 1536 goes to 1792.
    _run(tmp_path, "full", "full", None, [100, 100, 100, 100])
    _run(tmp_path, "k1536", "knorm", 1536, [0, 0, 0, 0])
    _run(tmp_path, "r1536", "random", 1536, [0, 0, 0, 100])
    _run(tmp_path, "k1792", "knorm", 1792, [100, 100, 100, 100])
    _run(tmp_path, "r1792", "random", 1792, [100, 0, 100, 100])
    out = tmp_path / "budgets.md"
    assert report_exit([str(tmp_path), "--budget-choice", str(out), "--pick"]) == 1  # nothing passes the share
    assert report_exit([str(tmp_path), "--budget-choice", str(out), "--most-informative"]) == 0
    assert capsys.readouterr().out == "1792\n"
    assert bc.most_informative([{"budget": 512, "full": 80.0, "informative": 4}]) is None  # the full cache misses
