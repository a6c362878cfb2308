"""Per-sample data of a run: which samples make each score (metrics.json `composition`), the records of
predictions.jsonl, and what they give: each score's n and standard error, the stratified paired strata of two runs,
token agreement with the full cache, the graded score (`answer_logprob`).

composition: {score: {"samples": [ids]}} = the plain mean of those samples' `score`;
             {score: {"mean_of": [scores]}} = the plain mean of other scores (LongBench category averages).
A score outside the composition (a leaderboard average of rounded dataset scores) shows as stored, without se.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from kvbench.metrics.stats import MeanSE, PairedResult, Stratum, mean_of, mean_se, paired_compare

LOGPROB = "answer_logprob"  # the graded pseudo-score: per-sample mean log-probability of the gold answer (nats)
_MAX_DEPTH = 16  # a "mean_of" chain deeper than this is taken as a cycle in a malformed composition


Composition = dict[str, dict[str, Any]]
Records = dict[str, dict[str, Any]]  # sample id -> record


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def score_of(records: Records, sample_id: str) -> float | None:
    r = records.get(sample_id)
    v = None if r is None else r.get("score")
    return float(v) if _num(v) else None


def leaves(composition: Composition, name: str, depth: int = 0) -> dict[str, float] | None:
    """The "samples" scores under `name` with their weights in it (a mean_of k components gives each 1/k, nested
    means multiply), or None when `name` cannot be traced down to samples."""
    spec = composition.get(name)
    if not isinstance(spec, dict) or depth > _MAX_DEPTH:
        return None
    if "samples" in spec:
        return {name: 1.0}
    parts = spec.get("mean_of")
    if not parts:
        return None
    out: dict[str, float] = {}
    for p in parts:
        sub = leaves(composition, p, depth + 1)
        if sub is None:
            return None
        for k, w in sub.items():
            out[k] = out.get(k, 0.0) + w / len(parts)
    return out


def cell(composition: Composition, records: Records, name: str, depth: int = 0) -> MeanSE | None:
    """n and se of one score from its samples (mean_of: stratified, stats.mean_of); None without a composition."""
    spec = composition.get(name)
    if not isinstance(spec, dict) or depth > _MAX_DEPTH:
        return None
    if "samples" in spec:
        return mean_se([v for v in (score_of(records, i) for i in spec["samples"]) if v is not None])
    parts = [cell(composition, records, p, depth + 1) for p in spec.get("mean_of") or []]
    if not parts or any(p is None for p in parts):
        return None
    return mean_of(parts)  # type: ignore[arg-type]


def cells(composition: Composition, records: Records) -> dict[str, MeanSE]:
    out = {}
    for name in composition:
        c = cell(composition, records, name)
        if c is not None and c.mean is not None:
            out[name] = c
    return out


def merge_compositions(parts: Iterable[Composition], order: Iterable[str] = ()) -> tuple[Composition, list[str]]:
    """Shards' compositions as one: sample lists joined (each id once, in `order`, the merged records' sample
    order, where it knows them), component lists of "mean_of" joined (a shard composes a mean only of the
    components it ran: RULER's per-length means over the tasks it holds). Returns the merged composition and the
    names that are a sample mean in one shard and a mean of scores in another (the first shard's kind is kept)."""
    out: Composition = {}
    differ: list[str] = []
    for comp in parts:
        for name, spec in comp.items():
            kind = "samples" if "samples" in spec else "mean_of" if "mean_of" in spec else None
            if kind is None:
                continue
            have = out.setdefault(name, {kind: []})
            if kind not in have:
                differ += [] if name in differ else [name]
                continue
            seen = set(have[kind])
            have[kind] += [i for i in spec[kind] if i not in seen]
    rank = {i: k for k, i in enumerate(order)}
    for spec in out.values():
        if "samples" in spec and rank:
            spec["samples"].sort(key=lambda i: rank.get(i, len(rank)))
    return out, differ


def logprob_values(records: Records) -> dict[str, float]:
    return {i: float(r[LOGPROB]) for i, r in records.items() if _num(r.get(LOGPROB))}


def logprob_cell(records: Records) -> MeanSE | None:
    vals = logprob_values(records)
    return mean_se(list(vals.values())) if vals else None


def strata(comp_a: Composition, rec_a: Records, comp_b: Composition, rec_b: Records,
           score: str) -> list[Stratum] | None:
    """Paired per-sample values of one score over the samples both runs hold, one stratum per "samples" component
    (weighted as in the score); None when the score is not traceable in both runs the same way or nothing is
    shared. `answer_logprob`: one stratum over the samples where both runs have a value."""
    if score == LOGPROB:
        va, vb = logprob_values(rec_a), logprob_values(rec_b)
        shared = [i for i in va if i in vb]
        return [Stratum(np.array([va[i] for i in shared]), np.array([vb[i] for i in shared]), 1.0)] if shared else None
    la, lb = leaves(comp_a, score), leaves(comp_b, score)
    if la is None or lb is None or la.keys() != lb.keys():
        return None
    out = []
    for leaf, w in la.items():
        ids_b = set(comp_b[leaf]["samples"])
        shared = []
        for i in comp_a[leaf]["samples"]:
            a, b = score_of(rec_a, i), (score_of(rec_b, i) if i in ids_b else None)
            if a is not None and b is not None:
                shared.append((a, b))
        out.append(Stratum(np.array([a for a, _ in shared]), np.array([b for _, b in shared]), w))
    return out if any(len(s.a) for s in out) else None


def compare(comp_a: Composition, rec_a: Records, comp_b: Composition, rec_b: Records,
            score: str) -> PairedResult | None:
    st = strata(comp_a, rec_a, comp_b, rec_b, score)
    return None if st is None else paired_compare(st)


@dataclass
class Agreement:
    agree: float | None  # % of shared samples whose generated tokens equal the full cache's
    n: int  # shared samples with tokens on both sides
    first_diff: float | None  # mean index of the first differing token over the samples that differ


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (the shorter one's length when one extends the other);
    None when identical."""
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(records: Records, full: Records) -> Agreement:
    diffs: list[int] = []
    n = 0
    for i, r in records.items():
        f = full.get(i)
        if f is None or not isinstance(r.get("tokens"), list) or not isinstance(f.get("tokens"), list):
            continue
        n += 1
        d = first_difference(r["tokens"], f["tokens"])
        if d is not None:
            diffs.append(d)
    if n == 0:
        return Agreement(None, 0, None)
    return Agreement(100.0 * (n - len(diffs)) / n, n, sum(diffs) / len(diffs) if diffs else None)
