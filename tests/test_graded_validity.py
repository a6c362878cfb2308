"""kvbench-report --graded-validity (kvbench.report.validity): the AUC of the graded score between hits and misses, worked by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvbench.report import validity as gv


def _run(root: Path, name: str, policy: str, records: list[tuple[float, float]]) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps({"model": "m", "task": "niah", "policy": policy, "budget": 8}))
    (d / "predictions.jsonl").write_text("".join(
        json.dumps({"id": f"s{i}", "answers": ["a"], "score": score, "answer_logprob": lp}) + "\n"
        for i, (score, lp) in enumerate(records)))


def test_auc_by_hand_pooled_and_within_runs(tmp_path: Path) -> None:
    # Run A: hits -1, -2; misses -3, -1.5. Pairs: (-1,-3) (-1,-1.5) (-2,-3) won, (-2,-1.5) lost: 3 of 4.
    # Run B: hit -0.5; miss -0.5 (a tie: half) and one 50-point record (not 0/100: left out).
    _run(tmp_path, "a", "x", [(100, -1.0), (100, -2.0), (0, -3.0), (0, -1.5)])
    _run(tmp_path, "b", "y", [(100, -0.5), (0, -0.5), (50, -9.0)])
    # A copy of run A under another folder counts once.
    _run(tmp_path / "copy", "a", "x", [(100, -1.0), (100, -2.0), (0, -3.0), (0, -1.5)])
    (row,) = gv.separations([tmp_path])
    assert (row.hits, row.misses) == (3, 3)
    # Pooled hits -1, -2, -0.5 vs misses -3, -1.5, -0.5, pair by pair (ties half):
    # -1 beats -3, -1.5, loses to -0.5 -> 2; -2 beats -3 -> 1; -0.5 beats -3, -1.5, ties -0.5 -> 2.5. 5.5 of 9.
    assert row.auc == 5.5 / 9
    # Within runs: A's 3 of 4 pairs and B's one tie (0.5 of 1): 3.5 of 5.
    assert row.within == 3.5 / 5 and row.within_pairs == 5
    assert row.hit_mean == -3.5 / 3 and row.miss_mean == -5.0 / 3


def test_no_misses_says_so(tmp_path: Path) -> None:
    _run(tmp_path, "a", "x", [(100, -1.0)])
    (row,) = gv.separations([tmp_path])
    assert row.auc is None and gv.sentence(row) == "no hits and misses to compare"


def test_the_committed_table_is_what_the_script_writes(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    # The runs scripts/tables.sh gives it (VALIDITY_RUNS), read from there: one list of folders
    listed = re.search(r"VALIDITY_RUNS=\(([^)]*)\)", (root / "scripts" / "tables.sh").read_text()).group(1).split()
    runs = [root / d for d in listed]
    assert "results/evidence_niah/runs" in listed
    out = tmp_path / "graded_validity.md"
    out.write_text(gv.markdown(gv.separations(runs), [str(r.relative_to(root)) for r in runs]), encoding="utf-8")
    assert out.read_text(encoding="utf-8") == (root / "results" / "graded_validity.md").read_text(encoding="utf-8")


def test_a_share_short_of_all_never_reads_100_percent() -> None:
    # 0.998 rounds to 100 in whole percent: one decimal instead; 0.823 -> 82; exactly 1 -> 100; 0.004 -> 0.4
    assert [gv.percent(x) for x in (0.998, 0.823, 1.0, 0.004, 0.0)] == ["99.8", "82", "100", "0.4", "0"]
