"""The verdicts of results/ come from the raw records: scripts/verdicts.py --check recomputes every planned test of
results/design.csv from the runs' predictions.jsonl and fails on a record edited after the fact; one Holm family per
model, a claim judged on its stated comparisons, samples that share a window or needle resampled together (pinned
by hand)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import load_script
from kvbench.metrics.stats import PairedResult, cluster_bootstrap, mc_floor
from kvbench.report.family import DESIGN_HEAD, Planned, window_clusters, with_holm
from kvbench.report.family import Tested as Row  # (not "Test...": pytest would collect it)

ROOT = Path(__file__).resolve().parent.parent
v = load_script("verdicts")


def test_the_committed_verdicts_are_what_the_records_give() -> None:
    # Every test of results/tests.csv, evidence.md and README.md's block, recomputed from the committed records
    assert v.main(["--check"]) == 0


def _design(path: Path, rows: list[list[str]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(DESIGN_HEAD)
        w.writerows(rows)


def test_an_edited_record_fails_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A copy of one small evidence folder (the LM score on the essays, 34 samples) and a design of two comparisons
    shutil.copytree(ROOT / "results/evidence_lm_essays/runs", tmp_path / "lm/runs")
    (tmp_path / "README.md").write_text(f"x\n{v.BEGIN}\n{v.END}\n", encoding="utf-8")
    _design(tmp_path / "design.csv", [
        ["M", "knorm", "", "related", "LM score", "lm/runs", "knorm", "random", "512", "answer_logprob", "", "34"],
        ["M", "", "", "related", "LM score", "lm/runs", "knorm", "full", "512", "answer_logprob", "", "34"]])
    args = ["--design", str(tmp_path / "design.csv"), "--results", str(tmp_path)]
    assert v.main(args) == 0
    assert v.main([*args, "--check"]) == 0
    capsys.readouterr()
    # One record's graded score edited in the knorm run: its two tests move, and the check names the tests.csv rows
    pred = next(p for p in (tmp_path / "lm/runs").rglob("predictions.jsonl") if "knorm_" in str(p))
    lines = pred.read_text(encoding="utf-8").splitlines()
    rec = json.loads(lines[0])
    rec["answer_logprob"] += 0.5
    pred.write_text("\n".join([json.dumps(rec), *lines[1:]]) + "\n", encoding="utf-8")
    assert v.main([*args, "--check"]) == 1
    out = capsys.readouterr().out
    assert "tests.csv line 2: committed" in out and "tests.csv line 3: committed" in out
    assert "evidence.md: differs" in out
    # A fabricated p written into tests.csv (the prose regenerated from it or not) fails as well
    assert v.main(args) == 0
    text = (tmp_path / "tests.csv").read_text(encoding="utf-8").splitlines()
    row = text[1].split(",")
    row[v.TESTS_HEAD.index("p")] = "0.001"
    (tmp_path / "tests.csv").write_text("\n".join([text[0], ",".join(row), *text[2:]]) + "\n", encoding="utf-8")
    assert v.main([*args, "--check"]) == 1
    assert "tests.csv line 2" in capsys.readouterr().out


def test_an_edited_0_100_score_fails_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The designed RULER 4K run (28 samples): one KeyDiff record's 0/100 score turned round moves its McNemar test
    shutil.copytree(ROOT / "results/evidence_ruler/runs/final", tmp_path / "ruler/runs")
    (tmp_path / "README.md").write_text(f"{v.BEGIN}\n{v.END}\n", encoding="utf-8")
    _design(tmp_path / "design.csv", [["M", "keydiff_ruler", "", "stated", "RULER", "ruler/runs", "keydiff", "tova",
                                       "3072", "avg", "", "28"]])
    args = ["--design", str(tmp_path / "design.csv"), "--results", str(tmp_path)]
    assert v.main(args) == 0 and v.main([*args, "--check"]) == 0
    pred = next(p for p in sorted((tmp_path / "ruler/runs").rglob("predictions.jsonl")) if "keydiff_" in str(p))
    lines = pred.read_text(encoding="utf-8").splitlines()
    rec = json.loads(lines[0])
    rec["score"] = 100.0 - rec["score"]
    pred.write_text("\n".join([json.dumps(rec), *lines[1:]]) + "\n", encoding="utf-8")
    capsys.readouterr()
    assert v.main([*args, "--check"]) == 1
    assert "tests.csv line 2: committed" in capsys.readouterr().out


def test_bad_design_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "design.csv").write_text("family,claim\n", encoding="utf-8")
    assert v.main(["--design", str(tmp_path / "design.csv"), "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the header must be" in err


def _t(family: str, a: str, b: str, p: float, lo: float, hi: float, role: str = "stated", claim: str = "c",
       half: str = "", budget: int = 512, sd: float = 1.0, n: int = 100) -> Row:
    plan = Planned(family, claim, half, role, "col", "runs", a, b, budget, "avg")
    basis = PairedResult(n, 0, 0, (lo + hi) / 2, lo, hi, p, "sign-flip", sd_d=sd)
    return Row(plan, n, "sign-flip", "", (lo + hi) / 2, lo, hi, p, False, basis)


def test_holm_runs_over_each_model_and_leaves_exploratory_tests_out() -> None:
    # Family A: p = 0.01, 0.04, 0.03 (m = 3): sorted 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 -> running max 0.06.
    # Family B: one test, p = 0.04 -> 0.04. The exploratory test joins no family (no Holm p).
    tests = with_holm([_t("A", "x", "y", 0.01, 0.1, 0.5), _t("A", "x", "z", 0.04, -0.4, -0.1),
                       _t("A", "y", "z", 0.03, 0.1, 0.3), _t("B", "x", "y", 0.04, 0.1, 0.2),
                       _t("A", "x", "w", 0.001, 0.1, 0.2, role="exploratory")])
    assert [(t.m, None if t.q is None else round(t.q, 6)) for t in tests] == [(3, 0.03), (3, 0.06), (3, 0.06),
                                                                              (1, 0.04), (0, None)]
    assert [t.verdict for t in tests[:4]] == ["resolved: x higher", "not resolved", "not resolved",
                                              "resolved: x higher"]
    # Holm stopped after R = 1 of m = 3: the unresolved tests faced alpha / (3 - 1) = 0.025, and their smallest
    # resolvable difference is (z_{1 - 0.025/2} + z_{0.8}) * sd / sqrt(n) = (2.2414 + 0.8416) * 1 / 10 = 0.3083
    assert tests[1].level == pytest.approx(0.025)
    assert tests[1].mdd == pytest.approx(0.30830, abs=1e-4)
    assert tests[0].mdd is None


def test_a_claim_needs_every_stated_comparison_and_both_halves() -> None:
    both = with_holm([_t("A", "k", "t", 0.001, 1, 2), _t("A", "k", "s", 0.001, 1, 2),
                      _t("A", "k", "g", 0.001, 1, 2, role="related")])
    assert v.claim_verdict("c", both).startswith("**holds**")
    one = with_holm([_t("A", "k", "t", 0.001, 1, 2), _t("A", "k", "s", 0.5, -1, 2),
                     _t("A", "k", "g", 0.001, -2, -1, role="related")])  # a related reversal decides nothing
    assert v.claim_verdict("c", one).startswith("**not resolved (1 of 2 resolved)**")
    rev = with_holm([_t("A", "k", "t", 0.001, 1, 2), _t("A", "k", "s", 0.001, -2, -1)])
    assert v.claim_verdict("c", rev).startswith("**reversed**")
    # The depth claim: a loss resolved before the last depth, and the last depth's interval is no bound
    depth = with_holm([_t("A", "s", "f", 0.001, -90, -50, claim="streamingllm_depth", half="loses"),
                       _t("A", "s", "f", 1.0, -21, 0, claim="streamingllm_depth", half="keeps")])
    assert v.claim_verdict("streamingllm_depth", depth).startswith('**not resolved: "keeps those at the end" has no')
    lost = with_holm([_t("A", "s", "f", 0.001, -90, -50, claim="streamingllm_depth", half="keeps")])
    assert v.claim_verdict("streamingllm_depth", lost).startswith("**reversed**")


def test_windows_that_share_a_token_are_one_cluster() -> None:
    # Width 10 on a period of 35: [0, 10), [10, 20) and [20, 30) share nothing; 33 wraps round to [33, 35) + [0, 8),
    # sharing tokens with [0, 10); 5 shares with 0 and 10 (joined through it).
    assert window_clusters([0, 10, 20, 33], 10, 35) == [0, 1, 2, 0]
    assert window_clusters([0, 10, 20, 5], 10, 35) == [0, 0, 1, 0]


def test_the_cluster_bootstrap_by_hand() -> None:
    # Two samples in two clusters of one factor: a resample draws cluster counts (2, 0), (1, 1), (0, 2) with chances
    # 1/4, 1/2, 1/4, so the mean is 1, 2 or 3 for d = (1, 3): the interval [1, 3], every resample above 0, p at the
    # floor 2 / (B + 1).
    lo, hi, p, _ = cluster_bootstrap([1.0, 3.0], [[0, 1]])
    assert (lo, hi) == (1.0, 3.0) and p == pytest.approx(mc_floor()) and mc_floor(10_000) == 2 / 10_001
    # d = (-1, 3): the mean is -1 with chance 1/4, so p ~ 2 * 1/4 = 0.5
    assert cluster_bootstrap([-1.0, 3.0], [[0, 1]])[2] == pytest.approx(0.5, abs=0.03)
    # Both samples in one cluster: every resample draws both, the interval collapses to the mean
    assert cluster_bootstrap([-1.0, 3.0], [["w", "w"]])[:2] == (1.0, 1.0)
    # Every difference 0: p = 1
    assert cluster_bootstrap(np.zeros(4), [[0, 1, 2, 3], [0, 0, 1, 1]])[2] == 1.0


def test_the_design_is_one_family_per_model_with_the_second_look_outside() -> None:
    rows: list[dict[str, Any]] = list(csv.DictReader((ROOT / "results/design.csv").open(encoding="utf-8")))
    in_family = [r for r in rows if r["role"] != "exploratory"]
    assert {f: sum(r["family"] == f for r in in_family) for f in ("SmolLM2-135M", "Qwen2.5-Coder-1.5B")} == \
        {"SmolLM2-135M": 58, "Qwen2.5-Coder-1.5B": 48}
    qwen_lm = [r for r in rows if r["family"] == "Qwen2.5-Coder-1.5B" and r["runs"].endswith("/lm")]
    assert {(r["role"], r["look"]) for r in qwen_lm} == {("related", "shard0of2"), ("exploratory", "")}
