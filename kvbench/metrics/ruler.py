"""RULER metrics (NVIDIA/RULER `scripts/eval/synthetic/constants.py` + `scripts/eval/evaluate.py`).

The metric code is unchanged since RULER's first eval commit (4f6507e, 2024-04-25) up to c3f5e3b:
- each prediction is post-processed: strip, every control character (\\x00-\\x1f) becomes "\\n", strip again;
- string_match_all: per sample, the fraction of references that occur (case-insensitive substring) in the
  prediction; string_match_part: 1 if any reference occurs, else 0;
- the dataset score is round(sum(per-sample) / n * 100, 2) with Python's sum and round.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

_CTRL = re.compile(r"[\x00-\x1f]")


def postprocess_pred(prediction: str) -> str:
    """RULER's postprocess_pred: strip, control characters -> newline, strip."""
    return _CTRL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction (0-1) of `references` found in the post-processed prediction, case-insensitively."""
    pred = postprocess_pred(prediction).lower()
    if not references:
        return 0.0
    return sum(1.0 if r.lower() in pred else 0.0 for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1.0 if any of `references` is found in the post-processed prediction (case-insensitive), else 0.0."""
    pred = postprocess_pred(prediction).lower()
    return max((1.0 if r.lower() in pred else 0.0 for r in references), default=0.0)


def dataset_score(per_sample: list[float]) -> float:
    """RULER's aggregation: round(sum(per-sample fractions) / n * 100, 2)."""
    if not per_sample:
        return 0.0
    return round(sum(per_sample) / len(per_sample) * 100, 2)


def records_score(records: Sequence[Mapping[str, Any]]) -> float:
    """RULER's dataset score from predictions.jsonl records of one (task, length): each record's metric
    (meta.metric) recomputed from its prediction as a 0-1 fraction, then `dataset_score` (RULER rounds only once,
    on the dataset mean, so the rounded 0-100 per-sample scores are not summed)."""
    from kvbench.metrics import get_metric

    return dataset_score([get_metric(r["meta"]["metric"])(r["prediction"], r["answers"]) for r in records])
