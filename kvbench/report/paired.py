"""Paired comparisons (paired.csv and the table.md section): every two entries of the same model and task that ran
the same samples (identical task.* and model.* settings), per score over the samples both hold: the difference of
means, its 95 % paired bootstrap interval and a p value (exact McNemar for 0/100 scores, else a sign-flip
permutation test; "mean_of" scores stratified by component), plus the graded score `answer_logprob`; and what the
comparison's power needs (alpha 0.05 two-sided, 80 % power): for an unresolved pair the samples the observed
difference would need (`n_required`: McNemar sample size from the discordant shares, Connor 1987, for 0/100 scores;
else the paired normal approximation), and for every pair the smallest difference its n resolves
(`min_detectable_diff`, score units). A pair is resolved as `kvbench.metrics.stats.resolved` says, on its own p
(paired.csv corrects for no family; the claims tables apply Holm across theirs).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.metrics.stats import (EXACT_FLIPS_UP_TO, NO_DIFFERENCE, RESAMPLES, PairedResult, is_binary, mc_floor,
                                   min_detectable_diff, paired_compare, required_n, resolved)
from kvbench.report.collect import Entry, ReportError, pair_key
from kvbench.report.samples import LOGPROB, compare, strata
from kvbench.report.tables import Report, Row
from kvbench.run.labels import NA, setting_name

PAIRED_HEAD = ["model", "task", "score", "policy_a", "settings_a", "policy_b", "settings_b", "n", "mean_a", "mean_b",
               "diff", "ci_low", "ci_high", "p_value", "n_required", "min_detectable_diff"]


@dataclass
class Pair:
    task: str
    score: str
    row_a: Row
    a: Entry
    row_b: Row
    b: Entry
    result: PairedResult


def _value(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def settings_text(row: Row) -> str:
    """The settings that tell a row from the others of its model and task, in a few words: `N=256 B=128
    blockwise recent_ratio=0.5` (task and model settings are equal on both sides of a pair: left out)."""
    words = [] if row.budget in (NA, None) else [f"N={_value(row.budget)}"]
    rest = dict(row.settings)
    block, protocol = rest.pop("block", NA), rest.pop("protocol", NA)
    words += [] if block in (NA, None) else [f"B={_value(block)}"]
    words += [] if protocol in (NA, None) else [str(protocol)]
    words += [f"{setting_name(k)}={_value(v)}" for k, v in rest.items()
              if k.split(".")[0] not in ("task", "model") and v is not NA]
    return " ".join(words) or "-"


def _scores(rep: Report, a: Entry, b: Entry) -> list[str]:
    """The scores both entries compose, in table order (detail columns, summary columns, the rest), then the
    graded score."""
    order = [c.score for c in rep.columns + rep.summary_columns if c.task == a.task]
    names = [k for k in dict.fromkeys([*order, *a.composition]) if k in a.composition and k in b.composition]
    return [*names, LOGPROB]


def check_policy(rep: Report, policy: str | None) -> None:
    if policy is not None and policy not in {e.policy for r in rep.rows for e in r.entries.values()}:
        known = ", ".join(dict.fromkeys(e.policy for r in rep.rows for e in r.entries.values()))
        raise ReportError(f"--paired {policy}: no run has that policy (policies: {known})")


def pairs(rep: Report, policy: str | None = None) -> list[Pair]:
    """All pairs of entries on the same samples, a = the earlier in table order except that the reference run (the
    full cache: metrics.json `reference`) is always b; with `policy`, only pairs with an entry of that policy, which
    is then b (diff = other - policy)."""
    items = [(r, e) for r in rep.rows for e in r.entries.values() if e.records]
    out = []
    for i, first in enumerate(items):
        for second in items[i + 1:]:
            (ra, a), (rb, b) = first, second
            if pair_key(a) != pair_key(b):
                continue  # other samples (another haystack, length, model): never paired
            if policy is not None:
                if a.policy == policy and b.policy != policy:
                    (ra, a), (rb, b) = second, first
                elif b.policy != policy:
                    continue
            elif a.reference and not b.reference:
                (ra, a), (rb, b) = second, first  # against the full cache: diff = policy - full, a loss reads < 0
            for score in _scores(rep, a, b):
                res = compare(a.composition, a.records, b.composition, b.records, score)
                if res is not None:
                    out.append(Pair(a.task, score, ra, a, rb, b, res))
    return out


def compare_entries(a: Entry, b: Entry, score: str | None = None) -> tuple[PairedResult, bool] | None:
    """a vs b on one score (default: the score each run's `average` is, when both name the same one) over the
    samples both hold, and whether every paired value is 0 or 100 (where the exact McNemar bound applies); None
    when they ran other samples, lack per-sample data, or share none."""
    score = score or (a.average_key if a.average_key == b.average_key else None)
    if score is None or pair_key(a) != pair_key(b) or not a.records or not b.records:
        return None
    st = strata(a.composition, a.records, b.composition, b.records, score)
    if st is None:
        return None
    binary = all(is_binary(s.a) and is_binary(s.b) for s in st if len(s.a))
    return paired_compare(st), binary


def n_required_text(r: PairedResult) -> str:
    """"resolved", the samples an unresolved difference would need (alpha 0.05, 80 % power), or "no difference
    observed" where that n is infinite."""
    if resolved(r):
        return "resolved"
    need = required_n(r)
    return NO_DIFFERENCE if need is None else str(need)


def min_detectable(r: PairedResult) -> float | str:
    """The smallest difference the pair's n resolves at 80 % power (score units), or why there is none in words."""
    d = min_detectable_diff(r)
    if d is not None:
        return d
    if r.n10 + r.n01 == 0:
        return "no discordant pairs"
    return "none: too few discordant pairs for this n"


def row_values(p: Pair) -> list[Any]:
    r = p.result
    return [p.a.model, p.task, p.score, p.a.policy, settings_text(p.row_a), p.b.policy, settings_text(p.row_b),
            r.n, r.mean_a, r.mean_b, r.diff, r.ci_low, r.ci_high, r.p_value, n_required_text(r), min_detectable(r)]


def write_paired_csv(found: list[Pair], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(PAIRED_HEAD)
        for p in found:
            w.writerow([round(v, 6) if isinstance(v, float) else v for v in row_values(p)])


def markdown_pairs(rep: Report, found: list[Pair], policy: str | None) -> tuple[list[Pair], str]:
    """The pairs table.md shows, and the sentence above them. Against `--paired POLICY` or else the reference run,
    the full cache (when there is one): every such pair, but only the summary scores where the task has some (its detail
    scores are in paired.csv); without either, every pair."""
    reference = next((e.policy for p in found for e in (p.b, p.a) if e.reference), None)
    anchor = policy or reference
    shown = [p for p in found if anchor is None or anchor in (p.a.policy, p.b.policy)]
    summary = {(c.task, c.score) for c in rep.summary_columns}
    tasks_with_summary = {t for t, _ in summary}
    shown = [p for p in shown if p.task not in tasks_with_summary or (p.task, p.score) in summary
             or p.score == LOGPROB]
    what = f"pairs against `{anchor}`" if anchor else "all pairs"
    return shown, (f"diff = mean_a - mean_b over the samples both runs hold (n), with its 95 % paired bootstrap "
                   f"interval; p: exact McNemar test for 0/100 scores, else a paired sign-flip permutation test "
                   f"(stratified by component for means of scores; exact up to {EXACT_FLIPS_UP_TO} samples, else "
                   f"{RESAMPLES:,} random patterns, whose smallest p is written \"<= {mc_floor():.1g}\": a bound). "
                   f"n needed: for an unresolved pair, the samples the observed "
                   f"difference would need to be resolved at alpha 0.05 with 80 % power (McNemar sample size from the "
                   f"discordant shares for 0/100 scores, else the paired normal approximation); min. diff: the smallest "
                   f"difference this n resolves at 80 % power. Shown: {what}"
                   f"{', summary scores' if tasks_with_summary else ''} ({len(shown)} of {len(found)} rows); "
                   f"every pair and score: paired.csv.")
