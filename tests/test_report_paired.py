"""kvbench-report with per-sample data (metrics.json `composition`, predictions.jsonl records), on run directories
written by hand: `mean ± se` and n in table.md, `_se`/`_n` in table.csv, paired.csv (exact columns, McNemar and
the stratified permutation test by hand, runs on other samples never paired, --paired POLICY), agreement with the
full cache, the graded score, degenerate counts, a policy option that tells two rows apart, shard merging from the
composition.

The fixture: one task "qa" of 8 samples s1..s8; "easy" = s1..s5, "hard" = s6..s8, "all" = s1..s8 (plain means
of samples), "avg" = mean of easy and hard (average = avg).

    sample        s1  s2  s3  s4  s5  s6  s7  s8
    full         100 100 100 100 100 100 100   0
    keydiff        0   0   0   0   0 100   0   0
    h2o r=0.5    100 100 100 100 100 100 100   0   (as the full cache)
    h2o r=0.3    100 100 100 100 100 100   0   0
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbench.report.cli import main as report_main
from kvbench.report.cli import print_metrics_table
from kvbench.report.paired import PAIRED_HEAD

from helpers import run_config

IDS = [f"s{i}" for i in range(1, 9)]
COMPOSITION = {"easy": {"samples": IDS[:5]}, "hard": {"samples": IDS[5:]}, "all": {"samples": IDS},
               "avg": {"mean_of": ["easy", "hard"]}}
FULL_TOKENS = [1, 2, 3, 4]
TARGETS = {"full": "kvbench.policies.full.Full", "keydiff": "kvbench.policies.keydiff.KeyDiff",
           "h2o": "kvbench.policies.h2o.H2O"}


def _scores(values: list[float]) -> dict[str, float]:
    v = dict(zip(IDS, values))
    easy, hard = sum(v[i] for i in IDS[:5]) / 5, sum(v[i] for i in IDS[5:]) / 3
    return {"easy": easy, "hard": hard, "all": sum(values) / 8, "avg": (easy + hard) / 2}


def write_run(root: Path, name: str, policy: str, values: list[float], *, tokens: dict[str, list[int]] | None = None,
              logprob: list[float | None] | None = None, degenerate: tuple[str, ...] = (), options: dict | None = None,
              context_length: int = 1000, mtime: float = 1e9, shard: str | None = None,
              ids: list[str] | None = None, composition: dict | None = COMPOSITION) -> Path:
    d = root / name
    d.mkdir(parents=True)
    ids = ids or IDS
    by_id = dict(zip(IDS, values))
    records = [{"id": i, "score": by_id[i], "prediction": "x", "tokens": (tokens or {}).get(i, FULL_TOKENS),
                "answer_logprob": (logprob or [-0.5] * 8)[IDS.index(i)], "degenerate": i in degenerate,
                "prompt_tokens": 1000, "new_tokens": 4, "prefill_s": 1.0, "decode_s": 0.5, "decode_steps": 4,
                "evict_s": 0.1, "peak_kv_tokens": 384, "kv_bytes_peak": 2 ** 20} for i in ids]
    (d / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    scores = _scores(values)
    full = policy == "full"
    metrics = {"model": "m", "policy": policy, "budget": None if full else 256, "block": 128, "protocol": "blockwise",
               "task": "qa", "shard": shard, "scores": scores, "average": scores["avg"],
               "applies": {"budget": not full, "protocol": not full, "block": not full}, "reference": full,
               "layout": {"columns": [{"score": k, "category": "qa"} for k in ("easy", "hard", "all")],
                          "summary": ["avg"], "average": "avg", "recipe": None},
               "stats": {"samples": len(ids), "degenerate": sum(i in degenerate for i in ids)},
               "provenance": {"commit": "abc"}}
    if composition is not None:
        metrics["composition"] = composition
    (d / "metrics.json").write_text(json.dumps(metrics))
    cfg = run_config("block=128", "protocol=blockwise",
                     values={"model": {"name": "m"}, "policy": {"_target_": TARGETS[policy], **(options or {})},
                             "task": {"_target_": "my.QA", "context_length": context_length},
                             "budget": None if full else 256, "shard": shard})
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    os.utime(d / "metrics.json", (mtime, mtime))  # the table's order among equal rows: the order they ran in
    return d


FULL = [100, 100, 100, 100, 100, 100, 100, 0]
KEYDIFF = [0, 0, 0, 0, 0, 100, 0, 0]
H2O_05 = FULL
H2O_03 = [100, 100, 100, 100, 100, 100, 0, 0]


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    write_run(tmp_path, "a_full", "full", FULL, mtime=1e9)
    # keydiff: s2 first differs at token 2, s3 stops after 3 tokens (first difference at 3); no logprob for s8;
    # s3 and s5 degenerate.
    write_run(tmp_path, "b_keydiff", "keydiff", KEYDIFF, tokens={"s2": [1, 2, 9, 9], "s3": [1, 2, 3]},
              logprob=[-1.0] * 7 + [None], degenerate=("s3", "s5"), mtime=1e9 + 1)
    write_run(tmp_path, "c_h2o", "h2o", H2O_05, options={"recent_ratio": 0.5}, mtime=1e9 + 2)
    write_run(tmp_path, "d_h2o", "h2o", H2O_03, options={"recent_ratio": 0.3}, mtime=1e9 + 3)
    # The same sample ids under another context length are other samples: never paired with the runs above.
    write_run(tmp_path, "e_keydiff_2000", "keydiff", FULL, context_length=2000, mtime=1e9 + 4)
    return tmp_path


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _md_rows(md: str, section: str) -> list[list[str]]:
    body = md.split(f"## {section}")[1].split("\n## ")[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in body.splitlines() if line.startswith("|")]


def test_tables_show_mean_se_and_n(runs: Path) -> None:
    report_main([str(runs), "--no-plots", "-q"])
    md = (runs / "table.md").read_text()
    rows = _md_rows(md, "Scores")
    assert rows[0] == ["model", "policy", "budget", "block", "protocol", "task.context_length", "recent_ratio", "n",
                       "easy", "hard", "all", "degenerate", "Avg"]
    full, kd, kd2000, h2o_05, h2o_03 = rows[2:]  # paper style: model and policy only on a group's first row
    assert [r[1] for r in rows[2:]] == ["full", "keydiff", "", "h2o", ""]
    # full: easy = 5 x 100 (se 0, n 5); hard = [100, 100, 0]: mean 66.67, sd = sqrt((33.3^2 * 2 + 66.7^2) / 2) =
    # 57.74, se = 57.74 / sqrt(3) = 33.33; all = 7 x 100 + 0: mean 87.5, sd = sqrt((12.5^2 * 7 + 87.5^2) / 7) =
    # sqrt(1250) = 35.36, se = 35.36 / sqrt(8) = 12.5. Avg = avg = (100 + 66.67) / 2 = 83.33, se = sqrt(0^2 +
    # 33.33^2) / 2 = 16.67, n = 5 + 3. The row's n: the most samples a cell holds (8); the others say their own.
    assert full[7:] == ["8", "100.0 ± 0.0 (n=5)", "66.7 ± 33.3 (n=3)", "87.5 ± 12.5", "0/8", "83.3 ± 16.7"]
    # keydiff: easy 0 ± 0; hard = [100, 0, 0]: 33.33 ± 33.33; all = one 100 of 8: 12.5 ± 12.5; avg = 16.67 ± 16.67;
    # two degenerate outputs of 8.
    assert kd[7:] == ["8", "0.0 ± 0.0 (n=5)", "33.3 ± 33.3 (n=3)", "12.5 ± 12.5", "2/8", "16.7 ± 16.7"]
    # The policy option tells the two h2o rows apart; the context length the two keydiff rows.
    assert (h2o_05[5:7], h2o_03[5:7], kd[5:7], kd2000[5:7]) == (["1000", "0.50"], ["1000", "0.30"], ["1000", "-"],
                                                                 ["2000", "-"])
    summary = _md_rows(md, "Summary scores")
    assert summary[0][-2:] == ["n", "avg"] and summary[2][-2:] == ["8", "83.3 ± 16.7"]

    csv_rows = _csv(runs / "table.csv")
    assert list(csv_rows[0])[7:] == ["easy", "easy_se", "easy_n", "hard", "hard_se", "hard_n", "all", "all_se",
                                     "all_n", "avg", "avg_se", "avg_n", "Avg", "Avg_se", "Avg_n", "agree", "agree_n",
                                     "first_diff", "logprob", "logprob_se", "logprob_n"]
    full = csv_rows[0]
    assert full["policy"] == "full" and full["budget"] == ""
    assert float(full["hard"]) == pytest.approx(200 / 3) and float(full["hard_se"]) == pytest.approx(100 / 3)
    assert full["hard_n"] == "3" and full["easy_se"] == "0.0" and float(full["all_se"]) == pytest.approx(12.5)
    assert float(full["avg_se"]) == pytest.approx(50 / 3) and full["avg_n"] == "8"


def test_agreement_logprob_and_degenerate_against_the_full_cache(runs: Path) -> None:
    report_main([str(runs), "--no-plots", "-q"])
    rows = {(r["policy"], r["recent_ratio"], r["task.context_length"]): r for r in _csv(runs / "table.csv")}
    kd = rows["keydiff", "", "1000"]
    # 6 of 8 outputs equal the full cache's tokens (75 %); s2 first differs at index 2, s3 at 3: mean 2.5.
    assert (kd["agree"], kd["agree_n"], kd["first_diff"]) == ("75.0", "8", "2.5")
    # answer_logprob: seven values of -1.0 (s8 has none): mean -1, se 0, n 7.
    assert (kd["logprob"], kd["logprob_se"], kd["logprob_n"]) == ("-1.0", "0.0", "7")
    assert rows["h2o", "0.5", "1000"]["first_diff"] == ""  # every output agrees: no first difference
    assert rows["h2o", "0.5", "1000"]["agree"] == "100.0"
    assert rows["keydiff", "", "2000"]["agree"] == ""  # no full-cache run on its samples
    assert rows["full", "", "1000"]["agree"] == "" and rows["full", "", "1000"]["logprob"] == "-0.5"
    runs_csv = {(r["policy"], r["policy.recent_ratio"], r["task.context_length"]): r
                for r in _csv(runs / "runs.csv")}
    k = runs_csv["keydiff", "", "1000"]
    # Δlogprob vs full over s1..s7: every difference is -1.0 - (-0.5) = -0.5, so the interval collapses.
    assert (k["dlogprob"], k["dlogprob_ci_low"], k["dlogprob_ci_high"]) == ("-0.5", "-0.5", "-0.5")
    assert k["degenerate"] == "2/8"
    md = (runs / "table.md").read_text()
    vs = _md_rows(md, "Against the full cache")
    assert vs[0][-5:] == ["agree %", "agree_n", "first_diff", "logprob", "Δlogprob vs full [95 % CI]"]
    kd_md = next(r for r in vs if r[1] == "keydiff" and r[5] == "1000")
    assert kd_md[-5:] == ["75.0", "8", "2.5", "-1.000 ± 0.000 (n=7)", "-0.500 [-0.500, -0.500] (n=7)"]


def test_paired_csv_by_hand(runs: Path) -> None:
    report_main([str(runs), "--no-plots", "-q"])
    rows = _csv(runs / "paired.csv")
    assert list(rows[0]) == PAIRED_HEAD == ["model", "task", "score", "policy_a", "settings_a", "policy_b",
                                            "settings_b", "n", "mean_a", "mean_b", "diff", "ci_low", "ci_high",
                                            "p_value", "n_required", "min_detectable_diff"]
    # Pairs among full, keydiff, h2o 0.5, h2o 0.3 (context 1000): 6, each with easy, hard, all, avg and
    # answer_logprob; the full cache is always b (diff = policy - full). The keydiff run at context 2000 holds the
    # same ids but other samples: in no pair.
    assert len(rows) == 6 * 5
    assert {(r["policy_a"], r["settings_a"], r["policy_b"], r["settings_b"]) for r in rows} == {
        ("keydiff", "N=256 B=128 blockwise", "full", "-"),
        ("h2o", "N=256 B=128 blockwise recent_ratio=0.5", "full", "-"),
        ("h2o", "N=256 B=128 blockwise recent_ratio=0.3", "full", "-"),
        ("keydiff", "N=256 B=128 blockwise", "h2o", "N=256 B=128 blockwise recent_ratio=0.5"),
        ("keydiff", "N=256 B=128 blockwise", "h2o", "N=256 B=128 blockwise recent_ratio=0.3"),
        ("h2o", "N=256 B=128 blockwise recent_ratio=0.5", "h2o", "N=256 B=128 blockwise recent_ratio=0.3")}
    got = {r["score"]: r for r in rows if r["policy_a"] == "keydiff" and r["policy_b"] == "full"}
    # all: full right and keydiff wrong on s1..s5 and s7 (6 discordant pairs), never the reverse: McNemar
    # p = 2 * 0.5^6 = 0.03125; diff = 12.5 - 87.5 = -75.
    a = got["all"]
    assert (a["model"], a["task"], a["n"], a["mean_a"], a["mean_b"], a["diff"], a["p_value"]) == (
        "m", "qa", "8", "12.5", "87.5", "-75.0", "0.03125")
    assert float(a["ci_low"]) == -100.0 and -75 < float(a["ci_high"]) < 0  # 6 of 8 differences are -100, 2 are 0
    # Resolved; at psi = 6/8 even delta = psi needs only (1.959964 * sqrt(.75) + 0.841621 * sqrt(.75 - .5625))^2
    # / .5625 = 2.061813^2 / .5625 = 7.56 <= 8 samples, so n = 8 resolves a difference between 100 * 6/8 = 75
    # points (the exact floor) and 75.
    assert a["n_required"] == "resolved" and float(a["min_detectable_diff"]) == pytest.approx(75.0)
    # easy: 5 discordant, one way: p = 2 * 0.5^5 = 0.0625; all five differences are -100: the interval is [-100, -100].
    e = got["easy"]
    assert (e["n"], e["diff"], e["ci_low"], e["ci_high"], e["p_value"]) == ("5", "-100.0", "-100.0", "-100.0",
                                                                            "0.0625")
    # Not resolved; psi = delta = 1: Connor 1.959964^2 = 3.8 -> 4, below the 6 discordant pairs the exact test
    # needs: 6 samples. n = 5 holds 5 discordant pairs, fewer than 6: no difference it could resolve.
    assert (e["n_required"], e["min_detectable_diff"]) == ("6", "none: too few discordant pairs for this n")
    # hard: differences [0, -100, 0], 1 discordant: p = min(1, 2 * 0.5) = 1. A resample's mean is 0 with
    # probability (2/3)^3 = 0.30 and -100 with (1/3)^3 = 0.037, both above 2.5 %: the interval is [-100, 0].
    h = got["hard"]
    assert (h["n"], h["p_value"], h["ci_low"], h["ci_high"]) == ("3", "1.0", "-100.0", "0.0")
    assert float(h["diff"]) == pytest.approx(-100 / 3, abs=1e-5)
    # avg = mean of easy and hard, stratified: diff = (-100 - 33.33) / 2 = -66.67. Sign flips with per-sample
    # weights 0.5/5 (easy) and 0.5/3 (hard): the terms are five 10s, one 16.67 and two 0s (in size); only the two
    # all-equal patterns of the six nonzero terms reach 66.67 (x 4 patterns of the zeros): p = 8 / 2^8 = 0.03125.
    # Bootstrap: easy always adds -50, hard's mean adds 0.5 x {0, -33.3, -66.7, -100}, 0 with prob 0.30 and -100
    # with prob 0.037: the interval is [-100, -50].
    v = got["avg"]
    assert float(v["diff"]) == pytest.approx(-200 / 3, abs=1e-5) and v["n"] == "8"
    assert (v["p_value"], v["ci_low"], v["ci_high"]) == ("0.03125", "-100.0", "-50.0")
    # answer_logprob over s1..s7 (keydiff has none for s8): differences all -1.0 - (-0.5) = -0.5; exact sign flips
    # of 7 equal terms: p = 2 / 2^7 = 0.015625.
    g = got["answer_logprob"]
    assert (g["n"], g["diff"], g["ci_low"], g["ci_high"], g["p_value"]) == ("7", "-0.5", "-0.5", "-0.5", "0.015625")
    # Resolved; the differences have no spread (sd 0): the normal approximation resolves any difference at n = 7.
    assert (g["n_required"], g["min_detectable_diff"]) == ("resolved", "0.0")
    # h2o 0.5 answered exactly as the full cache: no discordant pair, p = 1, diff 0.
    same = next(r for r in rows if r["score"] == "all" and r["settings_a"].endswith("recent_ratio=0.5")
                and r["policy_b"] == "full")
    assert (same["diff"], same["p_value"], same["ci_low"], same["ci_high"]) == ("0.0", "1.0", "0.0", "0.0")
    assert (same["n_required"], same["min_detectable_diff"]) == ("no difference observed", "no discordant pairs")

    md = (runs / "table.md").read_text()
    assert "## Paired comparisons" in md and "paired.csv" in md
    shown = _md_rows(md, "Paired comparisons")
    # Against the full cache, summary scores (avg) and the graded score only: 3 pairs x 2 rows.
    assert len(shown) == 2 + 3 * 2
    assert ["qa", "avg", "keydiff", "N=256 B=128 blockwise", "full", "-", "8", "16.67", "83.33", "-66.67",
            "[-100.00, -50.00]", "0.0312", "resolved"] == shown[[r[:2] for r in shown].index(["qa", "avg"])][:13]


def test_paired_against_one_policy(runs: Path) -> None:
    report_main([str(runs), "--no-plots", "-q", "--paired", "full"])
    rows = _csv(runs / "paired.csv")
    assert len(rows) == 3 * 5 and all(r["policy_b"] == "full" for r in rows)  # full is b: diff = other - full
    a = next(r for r in rows if r["policy_a"] == "keydiff" and r["score"] == "all")
    assert (a["mean_a"], a["mean_b"], a["diff"], a["p_value"]) == ("12.5", "87.5", "-75.0", "0.03125")
    assert float(a["ci_low"]) == -100.0


def test_paired_unknown_policy_is_one_line_exit_2(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        report_main([str(runs), "--no-plots", "-q", "--paired", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "kvbench-report: error: --paired nope: no run has that policy (policies: full, keydiff, h2o)\n"
    assert not (runs / "table.md").exists() and not (runs / "paired.csv").exists()  # nothing written


def test_runs_on_different_samples_are_never_paired(tmp_path: Path) -> None:
    # Same task settings, disjoint sample ids: nothing shared, nothing paired.
    write_run(tmp_path, "a", "full", FULL, ids=IDS[:4], composition={"all": {"samples": IDS[:4]}})
    write_run(tmp_path, "b", "keydiff", KEYDIFF, ids=IDS[4:], composition={"all": {"samples": IDS[4:]}})
    report_main([str(tmp_path), "--no-plots", "-q"])
    rows = _csv(tmp_path / "paired.csv")
    assert [r["score"] for r in rows] == []
    # Overlapping ids: only the shared ones (s3, s4) are compared.
    write_run(tmp_path / "x", "a", "full", FULL, ids=IDS[:4], composition={"all": {"samples": IDS[:4]}})
    write_run(tmp_path / "x", "b", "keydiff", KEYDIFF, ids=IDS[2:6], composition={"all": {"samples": IDS[2:6]}})
    report_main([str(tmp_path / "x"), "--no-plots", "-q"])
    rows = _csv(tmp_path / "x" / "paired.csv")
    got = next(r for r in rows if r["score"] == "all")
    assert (got["n"], got["mean_a"], got["mean_b"], got["diff"]) == ("2", "0.0", "100.0", "-100.0")  # keydiff - full


def test_runs_of_an_older_kvbench_are_named_not_read(tmp_path: Path) -> None:
    # A run without composition (an older kvbench) is not read another way: the notes name it and say to rerun it.
    write_run(tmp_path, "a", "full", FULL)
    write_run(tmp_path, "b", "keydiff", KEYDIFF, composition=None)
    report_main([str(tmp_path), "--no-plots", "-q"])
    assert [r["policy"] for r in _csv(tmp_path / "table.csv")] == ["full"]
    assert "b: written by an older kvbench (no composition in metrics.json), skipped; run it again " \
        "with this kvbench" in (tmp_path / "table.md").read_text()


def test_shards_compiled_or_not_or_of_the_old_engine_merge(tmp_path: Path) -> None:
    # compile never changes what a run computes (the same forward and eviction, as one graph or eager), and the
    # retired settings of the engine before the static slot cache (slot_reuse, evict_together, stack_prefill) are left
    # out of a stored config: a shard run compiled that records them and one run eager without them are one run, n 8.
    # (Before, this was stack_prefill "auto" against a shard written before that setting existed.)
    for k in (0, 1):
        d = write_run(tmp_path / "job", f"shard{k}of2", "keydiff", KEYDIFF, ids=IDS[k::2],
                      composition={"all": {"samples": IDS[k::2]}}, shard=f"{k}/2")
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        if k == 0:
            cfg.update(compile=True, slot_reuse=True, evict_together=False, stack_prefill="auto")
        else:
            cfg["compile"] = False
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    report_main([str(tmp_path), "--no-plots", "-q"])
    rows = _csv(tmp_path / "table.csv")
    assert [(r["policy"], r["all_n"]) for r in rows] == [("keydiff", "8")]


def test_shards_merge_from_the_composition(tmp_path: Path) -> None:
    # Two shards of the keydiff run: shard 0 holds s1, s3, s5, s7, shard 1 s2, s4, s6, s8. Each shard's
    # composition lists its own samples; merged they are the whole run's, and the scores are the records' means
    # (no task is rebuilt: the task target "my.QA" does not exist).
    for k in (0, 1):
        ids = IDS[k::2]
        comp = {"easy": {"samples": [i for i in IDS[:5] if i in ids]},
                "hard": {"samples": [i for i in IDS[5:] if i in ids]}, "all": {"samples": ids},
                "avg": {"mean_of": ["easy", "hard"]}}
        write_run(tmp_path / "job", f"shard{k}of2", "keydiff", KEYDIFF, ids=ids, composition=comp,
                  degenerate=("s3", "s6"), shard=f"{k}/2")
    write_run(tmp_path, "full", "full", FULL)
    report_main([str(tmp_path), "--no-plots", "-q"])
    rows = {r["policy"]: r for r in _csv(tmp_path / "table.csv")}
    kd = rows["keydiff"]
    # As the unsharded keydiff run: all 12.5 ± 12.5 (n 8), hard 33.33 (n 3), avg 16.67; degenerate s3 and s6.
    assert (kd["all"], kd["all_n"], kd["hard_n"]) == ("12.5", "8", "3")
    assert {r["policy"]: r["degenerate"] for r in _csv(tmp_path / "runs.csv")} == {"full": "0/8", "keydiff": "2/8"}
    assert float(kd["all_se"]) == pytest.approx(12.5) and float(kd["Avg"]) == pytest.approx(50 / 3)
    assert "not recomputed" not in (tmp_path / "table.md").read_text()
    paired = [r for r in _csv(tmp_path / "paired.csv") if r["score"] == "all"]
    assert paired[0]["n"] == "8" and paired[0]["p_value"] == "0.03125"


def test_printed_table_counts_degenerate_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = write_run(tmp_path, "b", "keydiff", KEYDIFF, degenerate=("s3", "s5"))
    metrics: dict[str, Any] = json.loads((d / "metrics.json").read_text())
    text = print_metrics_table([metrics])
    head = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    row = [c.strip() for c in text.splitlines()[2].strip("|").split("|")]
    assert row[head.index("degenerate")] == "2/8"


def test_claim_verdicts_come_from_the_paired_test(runs: Path) -> None:
    from kvbench.report import claims
    from kvbench.report.collect import collect_entries

    es = {(e.policy, e.settings.get("policy.recent_ratio"), e.settings.get("task.context_length")): e
          for e in collect_entries(runs)[0]}
    full, kd, same = es["full", None, 1000], es["keydiff", None, 1000], es["h2o", 0.5, 1000]
    # avg (the runs' average), full - keydiff: diff 66.67, interval [50, 100], p = 0.03125 (see
    # test_paired_csv_by_hand): resolved for full; against keydiff's claim, reversed.
    row = claims.pairwise("full beats keydiff", "p", "w", {256: full}, {"keydiff": {256: kd}})
    assert row["holds?"] == "holds"
    # One claim alone is a family of two tests (avg and the graded score): Holm gives the smaller p x 2 = 0.031 x 2 =
    # 0.0625 unless the graded p is the smaller; here the graded differences are all -0.5 over 7 samples (p = 2 / 2^7
    # = 0.0156, x 2 = 0.031), so avg's 0.031 x 1 = 0.031 stays (running max with 0.031): resolved.
    assert row["numbers"] == ("N=256: full 83, keydiff 17 (diff +66.7 [+50.0, +100.0], p = 0.031, Holm p = 0.031, "
                              "n = 8)")
    # 0/100 scores, n = 8: 6 discordant pairs one way are the fewest McNemar can call: 100 * 6 / 8 = 75 points.
    assert row["smallest resolvable difference"] == "75 points (6 of n = 8 samples one way)"
    assert claims.pairwise("keydiff beats full", "p", "w", {256: kd}, {"full": {256: full}})["holds?"] == "reversed"
    # h2o 0.5 answered as the full cache: diff 0, p = 1.
    assert claims.pairwise("h2o beats full", "p", "w", {256: same}, {"full": {256: full}})["holds?"] == \
        "not resolved (n = 8)"
    # The context-2000 run ran other samples: nothing to pair.
    other = es["keydiff", None, 2000]
    assert claims.pairwise("x", "p", "w", {256: other}, {"full": {256: full}})["holds?"] == "no paired runs found"
    # Below 6 samples no 0/100 comparison can be resolved.
    from kvbench.metrics.stats import PairedResult

    r5 = PairedResult(5, 100.0, 0.0, 100.0, 100.0, 100.0, 0.0625, "mcnemar")
    assert claims.resolvable([(r5, True)]) == "needs n >= 6 (n = 5)"
    assert claims.paired_verdict([r5]) == "not resolved (n = 5)"  # p = 2 * 0.5^5 > 0.05 although the interval is 100


def test_score_vs_budget_draws_95_percent_intervals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.axes import Axes

    drawn: list[tuple[list, list, list]] = []
    real = Axes.errorbar

    def spy(self: Axes, x: Any, y: Any, yerr: Any = None, **kw: Any) -> Any:
        drawn.append((list(x), list(y), list(yerr)))
        return real(self, x, y, yerr=yerr, **kw)

    monkeypatch.setattr(Axes, "errorbar", spy)
    write_run(tmp_path, "a", "keydiff", KEYDIFF, mtime=1e9)
    d = write_run(tmp_path, "b", "keydiff", H2O_03, mtime=1e9 + 1)
    for name in ("metrics.json", "config.yaml"):  # the second run at N = 512
        (d / name).write_text((d / name).read_text().replace("256", "512"))
    report_main([str(tmp_path), "-q"])
    # avg: keydiff N=256 16.67 ± 16.67, N=512 (h2o 0.3's scores) 66.67 ± sqrt(0^2 + 33.33^2) / 2 = 16.67;
    # bars of 1.96 se = 32.67.
    (x, y, yerr), = drawn
    assert x == [256, 512] and y == pytest.approx([50 / 3, 200 / 3])
    # (lower, upper) bars: the lower one of the N=256 point is cut at the scale's 0 (16.67 - 32.67 < 0).
    assert yerr[0] == pytest.approx([50 / 3, 1.96 * 50 / 3]) and yerr[1] == pytest.approx([1.96 * 50 / 3] * 2)
    assert (tmp_path / "score_vs_budget.png").stat().st_size > 0


def test_shards_of_a_task_without_a_recipe_recompute_only_the_composed_scores(tmp_path: Path) -> None:
    # A task whose layout gives no recipe (it aggregates in its own code): a score the composition leaves out
    # ("board", like a leaderboard average) cannot come from the records and no task is built, so it is the first
    # shard's value, and a note says so; the composed scores still come from the records.
    for k in (0, 1):
        ids = IDS[k::2]
        d = write_run(tmp_path / "job", f"shard{k}of2", "keydiff", KEYDIFF, ids=ids, shard=f"{k}/2",
                      composition={"all": {"samples": ids}})
        m = json.loads((d / "metrics.json").read_text())
        m["scores"] = {"all": 999.0, "board": 10.0 * (k + 1)}  # "all" is recomputed whatever a shard says
        m["average"], m["layout"]["average"] = m["scores"]["all"], "all"
        (d / "metrics.json").write_text(json.dumps(m))
    report_main([str(tmp_path), "--no-plots", "-q"])
    row, = _csv(tmp_path / "table.csv")
    # all: keydiff is right on s6 only: 12.5; board: shard 0's 10; Avg = all (the layout's average).
    assert (row["all"], row["board"], row["Avg"]) == ("12.5", "10.0", "12.5")
    assert "keydiff qa: board are the first shard's (the task writes no recipe)" in (tmp_path / "table.md").read_text()


def test_shards_join_the_components_of_a_mean(tmp_path: Path) -> None:
    # Shard 0 ran only "easy" samples, shard 1 only "hard" ones (a RULER shard composes its per-length mean of the
    # tasks it holds): merged, avg is the mean of both, (0 + 33.33) / 2 = 16.67 for keydiff, n = 5 + 3.
    for k, (ids, part) in enumerate(((IDS[:5], "easy"), (IDS[5:], "hard"))):
        write_run(tmp_path, f"shard{k}of2", "keydiff", KEYDIFF, ids=ids, shard=f"{k}/2",
                  composition={part: {"samples": ids}, "avg": {"mean_of": [part]}})
    report_main([str(tmp_path), "--no-plots", "-q"])
    row, = _csv(tmp_path / "table.csv")
    assert float(row["avg"]) == pytest.approx(50 / 3) and row["avg_n"] == "8"
    assert float(row["avg_se"]) == pytest.approx(50 / 3)  # sqrt(0^2 + 33.33^2) / 2


def test_runs_csv_carries_each_diagnostics_mean_and_max(tmp_path: Path) -> None:
    """A run whose metrics.json holds diagnostics gets `<name>` (the mean) and `<name>_max` in runs.csv; a run without
    them leaves the cells empty."""
    d = write_run(tmp_path, "adakv", "keydiff", KEYDIFF)
    metrics = json.loads((d / "metrics.json").read_text())
    metrics["diagnostics"] = {"head_share": {"mean": 1.2, "per_layer": {"0": 1.2}, "samples": 8, "events": 40,
                                             "max": 1.75}}
    (d / "metrics.json").write_text(json.dumps(metrics))
    write_run(tmp_path, "full", "full", FULL)
    report_main([str(tmp_path), "--no-plots", "-q"])
    rows = {r["policy"]: r for r in _csv(tmp_path / "runs.csv")}
    assert (rows["keydiff"]["head_share"], rows["keydiff"]["head_share_max"]) == ("1.2", "1.75")
    assert (rows["full"]["head_share"], rows["full"]["head_share_max"]) == ("", "")
