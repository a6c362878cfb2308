"""Planned comparisons tested from the per-sample records, one Holm family per model.

A design file (CSV, one row per planned comparison: DESIGN_HEAD) names each comparison: its family (the model),
the claim it serves and how (`stated`: the claim as its text states it; `related`: another score beside it;
`exploratory`: outside every family, e.g. a look that extended n after the planned one), the runs folder, the two
policies, the budget, the score, and `look`: a shard whose records alone make the planned look (empty: every record).

Each comparison is computed from the runs' predictions.jsonl records (kvbench.report.collect): the samples both runs
hold, diff = a - b, its 95 % interval and a p. Samples cut from shared text are not independent: where the records
carry a NIAH window (`meta.window`) and needle (`meta.needle`), every sample is labelled with its window cluster
(windows that share any haystack token, joined transitively) and its needle, and the test is the two-way cluster
bootstrap (kvbench.metrics.stats.cluster_bootstrap); otherwise the paired test of kvbench-report (exact McNemar for
0/100 scores, sign flips for graded ones, exact up to 16 samples). A Monte-Carlo p at its floor is flagged.

Holm's adjustment runs over every non-exploratory comparison of a family; resolved = Holm p < alpha and the interval
excludes 0. An unresolved comparison's smallest resolvable difference is computed at the level Holm's procedure
stopped at, alpha / (m - R) (R: the family's resolved comparisons), the level it would have had to pass.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kvbench.metrics.stats import (ALPHA, EXACT_FLIPS_UP_TO, PairedResult, Stratum, at_mc_floor, cluster_bootstrap,
                                   holm, mc_floor, min_detectable_diff, paired_compare)
from kvbench.report.collect import Entry, ReportError, collect_entries, pair_key
from kvbench.report.samples import LOGPROB, leaves, logprob_values, score_of
from kvbench.run.labels import NA

DESIGN_HEAD = ["family", "claim", "half", "role", "column", "runs", "a", "b", "budget", "score", "look", "n_planned"]
ROLES = ("stated", "related", "exploratory")
TESTS_HEAD = ["family", "m", "claim", "half", "role", "column", "a", "b", "budget", "score", "look", "n_planned", "n",
              "test", "clusters", "diff", "ci_low", "ci_high", "p", "p_floor", "p_holm", "verdict", "level",
              "smallest_resolvable"]


@dataclass(frozen=True)
class Planned:
    """One row of a design file."""

    family: str
    claim: str
    half: str
    role: str
    column: str
    runs: str
    a: str
    b: str
    budget: int
    score: str
    look: str = ""
    n_planned: int | None = None


@dataclass(frozen=True)
class Tested:
    """A planned comparison's test: diff = a - b over n paired samples."""

    plan: Planned
    n: int
    test: str
    clusters: str  # "" (independent samples) or "W windows x K needles"
    diff: float
    lo: float
    hi: float
    p: float
    floor: bool  # p is a Monte-Carlo p at its floor: "at most", not a measurement
    mdd_basis: PairedResult  # what the smallest resolvable difference is computed from
    m: int = 0  # the family's size (0: exploratory)
    q: float | None = None  # Holm p (None: exploratory)
    level: float = ALPHA  # the level its verdict faced
    mdd: float | None = None

    @property
    def verdict(self) -> str:
        if self.q is None:  # outside every family: its p is not corrected for what it is outside of
            return "exploratory: no verdict"
        p = self.q
        if p < ALPHA and self.lo > 0:
            return f"resolved: {self.plan.a} higher"
        if p < ALPHA and self.hi < 0:
            return f"resolved: {self.plan.b} higher"
        return "not resolved"


def read_design(path: Path) -> list[Planned]:
    """The design file's rows; ValueError naming the row for a bad one."""
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != DESIGN_HEAD:
            raise ValueError(f"{path.name}: the header must be {','.join(DESIGN_HEAD)}")
        out = []
        for i, r in enumerate(reader, start=2):
            if r["role"] not in ROLES or not r["budget"].isdigit():
                raise ValueError(f"{path.name} line {i}: role is one of {', '.join(ROLES)} and budget a number")
            out.append(Planned(r["family"], r["claim"], r["half"], r["role"], r["column"], r["runs"], r["a"], r["b"],
                               int(r["budget"]), r["score"], r["look"],
                               int(r["n_planned"]) if r["n_planned"] else None))
    return out


def _budget(e: Entry) -> Any:
    return None if e.budget is NA else e.budget


def find_pair(entries: list[Entry], a: str, b: str, budget: int) -> tuple[Entry, Entry]:
    """The runs of policies a and b that ran the same samples, each at `budget` or budget-free (the full cache),
    at least one at `budget`; ReportError when none or several pairs match."""
    found = [(x, y) for x in entries for y in entries
             if x.policy == a and y.policy == b and x.records and y.records and pair_key(x) == pair_key(y)
             and _budget(x) in (budget, None) and _budget(y) in (budget, None) and budget in (_budget(x), _budget(y))]
    if len(found) != 1:
        raise ReportError(f"{a}:{b}@{budget} matches {len(found)} pairs of runs (one is needed)")
    return found[0]


def sample_values(e: Entry, score: str) -> dict[str, float]:
    """Sample id -> the score's per-sample value (the graded score, or a score that is a mean of one set of samples)."""
    if score == LOGPROB:
        return logprob_values(e.records)
    parts = leaves(e.composition, score)  # (RULER's avg: a mean of one length's mean of one task's samples)
    if parts is None or len(parts) != 1:
        raise ReportError(f"{e.policy}: score {score!r} is not a mean of one set of samples in its runs")
    (leaf,) = parts
    return {i: v for i in e.composition[leaf]["samples"] if (v := score_of(e.records, i)) is not None}


def look_ids(e: Entry, look: str) -> set[str]:
    """The ids of the records the runs hold in their shard folder named `look`."""
    ids: set[str] = set()
    for path in e.paths:
        if path.name == look:
            with (path / "predictions.jsonl").open(encoding="utf-8") as f:
                ids |= {json.loads(line)["id"] for line in f if line.strip()}
    return ids


def _windows_spec(e: Entry) -> tuple[int, int] | None:
    """(window width, haystack period) in tokens from the runs' metrics.json (NIAH windows=per_sample)."""
    def find(x: Any) -> dict[str, Any] | None:
        if isinstance(x, dict):
            if "window_tokens" in x and "haystack_tokens" in x:
                return x
            return next((w for v in x.values() if (w := find(v)) is not None), None)
        return None
    for path in e.paths:
        spec = find(json.loads((path / "metrics.json").read_text(encoding="utf-8")))
        if spec is not None:
            return int(spec["window_tokens"]), int(spec["haystack_tokens"])
    return None


def window_clusters(starts: Sequence[int], width: int, period: int) -> list[int]:
    """A cluster number per window: windows [start, start + width) on a haystack of `period` tokens read round (a
    window past the end wraps to its start) that share a token are in one cluster, joined transitively."""
    parent = list(range(len(starts)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(starts)):
        for j in range(i):
            gap = (starts[i] - starts[j]) % period
            if min(gap, period - gap) < width:
                parent[root(i)] = root(j)
    roots = [root(i) for i in range(len(starts))]
    number = {r: k for k, r in enumerate(dict.fromkeys(roots))}
    return [number[r] for r in roots]


def clusters_of(e: Entry, ids: list[str]) -> list[list[object]] | None:
    """Per sample, its window cluster and its needle (two factors), or None where the records carry no window."""
    metas = [e.records[i].get("meta") or {} for i in ids]
    if not all(isinstance(m.get("window"), dict) and "needle" in m for m in metas):
        return None
    spec = _windows_spec(e)
    if spec is None:
        raise ReportError(f"{e.policy}: records carry windows but metrics.json gives no window_tokens/haystack_tokens")
    width, period = spec
    return [window_clusters([int(m["window"]["start"]) for m in metas], width, period), [m["needle"] for m in metas]]


def test_one(plan: Planned, a: Entry, b: Entry, clustered: bool = True) -> Tested:
    """The planned comparison on the records of runs a and b (clustered=False: as if every sample were independent)."""
    va, vb = sample_values(a, plan.score), sample_values(b, plan.score)
    ids = [i for i in va if i in vb]
    if plan.look:
        keep = look_ids(a, plan.look) & look_ids(b, plan.look)
        ids = [i for i in ids if i in keep]
    if not ids:
        raise ReportError(f"{plan.runs}: {plan.a}:{plan.b}@{plan.budget} {plan.score}: no shared samples")
    xa, xb = np.array([va[i] for i in ids]), np.array([vb[i] for i in ids])
    factors = clusters_of(a, ids) if clustered else None
    if factors is not None and factors != clusters_of(b, ids):
        raise ReportError(f"{plan.runs}: {plan.a} and {plan.b} cut the same sample from other windows")
    if factors is None:
        r = paired_compare([Stratum(xa, xb, 1.0)])
        test = r.test if r.test == "mcnemar" or len(ids) > EXACT_FLIPS_UP_TO else "sign-flip (exact)"
        return Tested(plan, r.n, test, "", r.diff, r.ci_low, r.ci_high, r.p_value, at_mc_floor(r), r)
    lo, hi, p, se = cluster_bootstrap(xa - xb, factors)
    n = len(ids)
    # sd_d = sqrt(n) * the resampled se, so that min_detectable_diff's (z_a/2 + z_b) sd_d / sqrt(n) uses that se
    basis = PairedResult(n, float(xa.mean()), float(xb.mean()), float((xa - xb).mean()), lo, hi, p, "sign-flip",
                         sd_d=se * float(np.sqrt(n)))
    text = f"{len(set(factors[0]))} windows x {len(set(factors[1]))} needles"
    return Tested(plan, n, "cluster bootstrap", text, basis.diff, lo, hi, p, p <= mc_floor() * (1 + 1e-9), basis)


def run_design(design: Sequence[Planned], root: Path, clustered: bool = True) -> list[Tested]:
    """Every planned comparison tested (runs folders read once each, relative to `root`), then Holm per family."""
    found: dict[str, list[Entry]] = {}
    out = []
    for plan in design:
        if plan.runs not in found:
            if not (root / plan.runs).is_dir():
                raise ReportError(f"{plan.runs}: no such runs folder under {root.name}/")
            found[plan.runs] = collect_entries(root / plan.runs)[0]
        a, b = find_pair(found[plan.runs], plan.a, plan.b, plan.budget)
        out.append(test_one(plan, a, b, clustered))
    return with_holm(out)


def with_holm(tests: list[Tested], alpha: float = ALPHA) -> list[Tested]:
    """Holm over each family's non-exploratory tests; each unresolved test's smallest resolvable difference at the
    level Holm stopped at (alpha / (m - R)), an exploratory one's at alpha."""
    out = list(tests)
    for family in dict.fromkeys(t.plan.family for t in tests):
        idx = [i for i, t in enumerate(tests) if t.plan.family == family and t.plan.role != "exploratory"]
        qs = holm([tests[i].p for i in idx])
        m = len(idx)
        for i, q in zip(idx, qs):
            out[i] = replace(out[i], m=m, q=q)
        resolved = sum(out[i].verdict != "not resolved" for i in idx)
        level = alpha / (m - resolved) if m > resolved else alpha
        for i in idx:
            out[i] = replace(out[i], level=level)
    return [replace(t, mdd=None if t.verdict != "not resolved" or (t.mdd_basis.test != "mcnemar" and
                                                                 t.mdd_basis.sd_d == 0)  # no spread: undefined
                    else min_detectable_diff(t.mdd_basis, alpha=t.level)) for t in out]


def _f(x: float) -> str:
    return f"{round(x, 6) + 0.0:.6f}"


def tests_rows(tests: Sequence[Tested]) -> list[list[str]]:
    """The tests as CSV rows (TESTS_HEAD): what `--check` compares byte for byte."""
    rows = []
    for t in tests:
        p = t.plan
        rows.append([p.family, str(t.m) if t.m else "", p.claim, p.half, p.role, p.column, p.a, p.b, str(p.budget),
                     p.score, p.look, "" if p.n_planned is None else str(p.n_planned), str(t.n), t.test, t.clusters,
                     _f(t.diff), _f(t.lo), _f(t.hi), f"{t.p:.6g}", "1" if t.floor else "0",
                     "" if t.q is None else f"{t.q:.6g}", t.verdict, f"{t.level:.6g}",
                     "" if t.mdd is None else _f(t.mdd)])
    return rows


def write_tests(tests: Sequence[Tested], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(TESTS_HEAD)
        w.writerows(tests_rows(tests))
