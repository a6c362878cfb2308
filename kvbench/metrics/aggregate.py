"""Named scores from the per-sample records by a recipe written as plain JSON: the one aggregation that a task's
`aggregate` runs at the end of a run and that kvbench-report runs again on the merged records of a sharded run (it
reads the recipe from metrics.json `layout`), so the merge gives exactly the unsharded run's numbers without
rebuilding the task.

A recipe maps score names, in output order, to a spec. What a spec computes, exactly one of:

    {"mean": FIELD}                   the mean of the selected records' FIELD: Python's sequential sum over n
    {"max": FIELD}                    the largest value of FIELD among them
    {"metric": NAME, "kwargs": {..}}  a set-level metric of the registry, get_metric(NAME)(records, **kwargs): the
                                      official dataset scores (LongBench eval.py, RULER), computed from the
                                      predictions as the official code does, not from the rounded per-sample scores
    {"mean_of": [score names]}        the mean of other scores of the recipe (summed in the listed order); left out
                                      when any of them is, unless "skip_missing": true, which averages those that are
                                      there (NaN counts as missing) and leaves the score out only when none is

and optionally:

    "where": {FIELD: value, ...}      the records whose FIELDs equal these values (default: every record); a record
                                      score is left out when no record is selected
    "round": k                        Python's round(value, k), as the task's own code rounds
    "default": value                  the value when the score would be left out (RULER's and NIAH's avg of 0.0 on
                                      no records)

FIELD is a key of the record or a dotted path into it: "score", "meta.dataset", "fidelity.kl_max". Selectors read
the records' own fields (not sample ids), so a recipe does not depend on which samples a shard holds.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

KINDS = ("mean", "max", "metric", "mean_of")
_MAX_DEPTH = 32  # a "mean_of" chain deeper than this is taken as a cycle


class RecipeError(ValueError):
    """A recipe that cannot be evaluated: an unknown kind, a score it does not define, a field a record lacks."""


def field(record: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted `path` of a record ("meta.dataset"); RecipeError when it is not there."""
    value: Any = record
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise RecipeError(f"record {record.get('id')!r} has no field {path!r}")
        value = value[part]
    return value


def _selected(records: Sequence[Mapping[str, Any]], where: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    if not where:
        return list(records)
    # A record without a selector field is not selected (field() raises only where a value is required).
    missing = object()

    def get(r: Mapping[str, Any], path: str) -> Any:
        try:
            return field(r, path)
        except RecipeError:
            return missing

    return [r for r in records if all(get(r, k) == v for k, v in where.items())]


def _kind(name: str, spec: Any) -> str:
    if not isinstance(spec, Mapping):
        raise RecipeError(f"score {name!r}: the spec must be an object, got {type(spec).__name__}")
    kinds = [k for k in KINDS if k in spec]
    if len(kinds) != 1:
        raise RecipeError(f"score {name!r}: the spec needs exactly one of {', '.join(KINDS)}, got {sorted(spec)}")
    return kinds[0]


def _missing(v: float | None) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def aggregate_scores(records: Sequence[Mapping[str, Any]], recipe: Mapping[str, Any],
                     known: Mapping[str, float] | None = None) -> dict[str, float]:
    """The recipe's scores from `records` (in their order, which sums follow), in the recipe's order; scores with
    nothing to compute are left out (or take their "default"). `known`: scores computed elsewhere that a mean_of may
    name (not repeated in the output; with `known`, a name defined nowhere is a missing score, not an error).
    RecipeError on a malformed recipe."""
    from kvbench.metrics import get_metric

    done: dict[str, float | None] = {}

    def value(name: str, depth: int = 0) -> float | None:
        if name in done:
            return done[name]
        if name not in recipe:
            if known is not None:
                return known.get(name)  # a score not known is missing, as one left out
            raise RecipeError(f"a mean_of names {name!r}, which the recipe does not define")
        if depth > _MAX_DEPTH:
            raise RecipeError(f"score {name!r}: mean_of nested deeper than {_MAX_DEPTH} (a cycle?)")
        spec = recipe[name]
        kind = _kind(name, spec)
        out: float | None
        if kind == "mean_of":
            parts = [value(p, depth + 1) for p in spec["mean_of"]]
            if spec.get("skip_missing"):
                parts = [p for p in parts if not _missing(p)]
            whole = bool(parts) and all(p is not None for p in parts)
            out = sum(parts) / len(parts) if whole else None  # type: ignore[arg-type]
        else:
            chosen = _selected(records, spec.get("where"))
            if not chosen:
                out = None
            elif kind == "metric":
                out = float(get_metric(spec["metric"])(chosen, **(spec.get("kwargs") or {})))
            else:
                vals = [field(r, spec[kind]) for r in chosen]
                out = sum(vals) / len(vals) if kind == "mean" else max(vals)
        if out is not None and spec.get("round") is not None:
            out = round(out, int(spec["round"]))
        if out is None and "default" in spec:
            out = spec["default"]
        done[name] = out
        return out

    for name in recipe:
        value(name)
    return {k: done[k] for k in recipe if done[k] is not None}  # type: ignore[misc]


def average_of(scores: Mapping[str, float], key: str | None) -> float | None:
    """A run's `average` (metrics.json): the score named `key`, else (key None) the mean of all scores. The run
    (kvbench.run.app.task_average) and the report's shard merge both apply it."""
    if key:
        return scores.get(key)
    return sum(scores.values()) / len(scores) if scores else None
