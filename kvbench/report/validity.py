"""Does the graded score track retrieval? (`kvbench-report DIR... --graded-validity MD`)

Per model and task, how well a sample's `answer_logprob` (the gold answer's mean log-probability per token,
teacher-forced through the run's own cache) separates the samples a run answered right (score 100) from those it
answered wrong (score 0): the AUC, i.e. the share of (hit, miss) pairs in which the hit's graded score is the higher
(ties count half), with the one-sided Mann-Whitney p. Every 0/100-scored record of the given runs counts once (runs
found twice, e.g. a grid's full cache read by two folders, are counted once).

The records are pooled over policies and budgets (a sample appears under many runs), so the AUC describes the
score's resolution across the committed evidence; it is not a test of independent samples.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from scipy import stats

from kvbench.run.records import read_records


@dataclass(frozen=True)
class Separation:
    model: str
    task: str
    hits: int
    misses: int
    auc: float | None  # None without both hits and misses
    p: float | None  # one-sided Mann-Whitney: hits' graded scores higher than misses'
    within: float | None  # the same share over (hit, miss) pairs of one run only (None: no run has both)
    within_pairs: int  # how many such pairs
    hit_mean: float | None
    miss_mean: float | None


def auc(hits: Sequence[float], misses: Sequence[float]) -> tuple[float, float] | tuple[None, None]:
    """(AUC, one-sided p): scipy's Mann-Whitney U of the hits over the misses, divided by the number of pairs."""
    if not hits or not misses:
        return None, None
    res = stats.mannwhitneyu(hits, misses, alternative="greater")
    return float(res.statistic) / (len(hits) * len(misses)), float(res.pvalue)


def graded_records(dirs: Iterable[Path]) -> dict[tuple[str, str], dict[str, dict[str, list[float]]]]:
    """(model, task) -> run key -> {"hits": [...], "misses": [...]}: the graded scores of the 0/100-scored records of
    every run below `dirs` (a run: a folder with metrics.json and predictions.jsonl), each (run settings, sample)
    once."""
    out: dict[tuple[str, str], dict[str, dict[str, list[float]]]] = {}
    seen: set[str] = set()
    for d in dirs:
        for metrics_path in sorted(Path(d).rglob("metrics.json")):
            m = json.loads(metrics_path.read_text(encoding="utf-8"))
            preds = metrics_path.parent / "predictions.jsonl"
            if not preds.is_file():
                continue
            run = [m.get(k) for k in ("model", "task", "policy", "budget", "block", "protocol", "scenario")]
            for r in read_records(preds, repair=False):
                lp, score = r.get("answer_logprob"), r.get("score")
                if lp is None or score not in (0, 0.0, 100, 100.0):
                    continue
                key = json.dumps([*run, r["id"], r.get("answers")])
                if key in seen:
                    continue
                seen.add(key)
                runs = out.setdefault((str(m.get("model")), str(m.get("task"))), {})
                side = runs.setdefault(json.dumps(run), {"hits": [], "misses": []})
                side["hits" if score == 100 else "misses"].append(float(lp))
    return out


def separations(dirs: Iterable[Path]) -> list[Separation]:
    rows = []
    for (model, task), runs in sorted(graded_records(dirs).items()):
        h = [v for side in runs.values() for v in side["hits"]]
        m = [v for side in runs.values() for v in side["misses"]]
        a, p = auc(h, m)
        # Within runs: the pairs of one run's hit and the same run's miss, pooled (sum of U over sum of n1 n2)
        won, pairs = 0.0, 0
        for side in runs.values():
            a_run, _ = auc(side["hits"], side["misses"])
            if a_run is not None:
                n = len(side["hits"]) * len(side["misses"])
                won, pairs = won + a_run * n, pairs + n
        rows.append(Separation(model, task, len(h), len(m), a, p, won / pairs if pairs else None, pairs,
                               sum(h) / len(h) if h else None, sum(m) / len(m) if m else None))
    return rows


def percent(share: float) -> str:
    """A share in whole percent, with a decimal where whole percent would read "100" or "0" for a share that is not
    (0.998 is 99.8 %, not 100 %)."""
    whole = f"{100 * share:.0f}"
    return f"{100 * share:.1f}" if whole in ("100", "0") and 0 < share < 1 else whole


def sentence(s: Separation) -> str:
    """What the row says, from its numbers alone."""
    if s.auc is None:
        return "no hits and misses to compare"
    share = f"a hit's graded score is above a miss's in {percent(s.auc)} % of (hit, miss) pairs"
    share += "" if s.p is not None and s.p < 0.05 else "; not distinguishable from chance (p >= 0.05)"
    if s.within is not None:
        share += f"; within one run in {percent(s.within)} %"
    return share


def markdown(rows: list[Separation], sources: Sequence[str]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = ["# Does the graded score separate hits from misses?", "",
             "Generated by `kvbench-report --graded-validity` from " + ", ".join(f"`{s}`" for s in sources)
             + ". Each "
             "0/100-scored record of those runs once (pooled over policies and budgets: a descriptive measure, not "
             "a test of independent samples); AUC = share of (hit, miss) pairs whose hit has the higher graded score "
             "(ties half), p = one-sided Mann-Whitney.", "",
             "`within runs`: the same share over the (hit, miss) pairs of one run only (the same policy and budget), "
             "pooled over the runs that have both: whether the score ranks one run's right answers above its wrong "
             "ones, not only good policies above collapsed ones.", "",
             "| model | task | hits | misses | graded mean, hits | graded mean, misses | AUC | p | AUC within runs "
             "(pairs) | what it says |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        lines.append(f"| {s.model} | {s.task} | {s.hits} | {s.misses} | {f(s.hit_mean, '.2f')} | "
                     f"{f(s.miss_mean, '.2f')} | {f(s.auc, '.3f')} | {f(s.p, '.2g')} | "
                     f"{f(s.within, '.3f')} ({s.within_pairs}) | {sentence(s)} |")
    return "\n".join(lines) + "\n"

