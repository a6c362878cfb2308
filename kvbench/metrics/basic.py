"""Simple metrics shared by the generic tasks."""

from __future__ import annotations


def substring_any(prediction: str, answers: list[str]) -> float:
    """100 if any answer occurs in the prediction, case-insensitively; else 0 (no answers: 0)."""
    pred = prediction.lower()
    return 100.0 if any(a.lower() in pred for a in answers) else 0.0
