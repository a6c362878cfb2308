"""Metrics, re-implemented from the official benchmark code's rules (see each module's docstring).

Metric modules import nothing else from kvbench; tasks refer to metrics by name through `get_metric`.
"""

from __future__ import annotations

import importlib
from typing import Callable

# name -> "module:function"; resolved lazily so importing kvbench.metrics loads no metric dependencies.
METRICS: dict[str, str] = {
    "substring_any": "basic:substring_any",
    "fidelity": "fidelity:fidelity",
    "string_match_all": "ruler:string_match_all",
    "string_match_part": "ruler:string_match_part",
    "niah_substring": "niah:substring_match",
    "niah_rouge1x10": "niah:rouge1x10",
    # LongBench v1 (official metric names; f(prediction, ground_truth, **kwargs) -> 0-1)
    "qa_f1_score": "longbench:qa_f1_score",
    "qa_f1_zh_score": "longbench:qa_f1_zh_score",
    "rouge_score": "longbench:rouge_score",
    "rouge_zh_score": "longbench:rouge_zh_score",
    "classification_score": "longbench:classification_score",
    "retrieval_score": "longbench:retrieval_score",
    "retrieval_zh_score": "longbench:retrieval_zh_score",
    "count_score": "longbench:count_score",
    "code_sim_score": "longbench:code_sim_score",
    # LongBench eval.py aggregation and the leaderboard averages
    "longbench_sample_score": "longbench:sample_score",
    "longbench_scorer": "longbench:scorer",
    "longbench_scorer_e": "longbench:scorer_e",
    "longbench_summary": "longbench:summary_scores",
    # Set-level: f(records, **kwargs) -> a dataset score from predictions.jsonl records (metrics.aggregate recipes)
    "longbench_dataset": "longbench:records_score",
    "longbench_dataset_e": "longbench:records_score_e",
    "ruler_dataset": "ruler:records_score",
}


def get_metric(name: str) -> Callable[..., float]:
    """A metric by its registry name, or by "package.module:function" for a metric that lives outside kvbench (a
    user's own task, docs/extending.md)."""
    if name in METRICS:
        module, fn = METRICS[name].split(":")
        return getattr(importlib.import_module(f"kvbench.metrics.{module}"), fn)
    if ":" in name:
        module, _, fn = name.partition(":")
        try:
            return getattr(importlib.import_module(module), fn)
        except (ImportError, AttributeError):
            raise KeyError(f"metric '{name}': no function {fn} in an importable module {module}") from None
    raise KeyError(f"unknown metric '{name}'; choose one of: {', '.join(sorted(METRICS))}, or module:function")
