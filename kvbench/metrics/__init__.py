"""Metrics, re-implemented from the official benchmark code's rules (see each module's docstring).

Metric modules import nothing else from kvbench; tasks refer to metrics by name through `get_metric`.
"""

from __future__ import annotations

import importlib
from typing import Callable

# name -> "module:function"; resolved lazily so importing kvbench.metrics loads no metric dependencies.
METRICS: dict[str, str] = {
    "string_match_all": "ruler:string_match_all",
    "string_match_part": "ruler:string_match_part",
    "niah_substring": "niah:substring_match",
    "niah_rouge1x10": "niah:rouge1x10",
}


def get_metric(name: str) -> Callable[..., float]:
    if name not in METRICS:
        raise KeyError(f"unknown metric '{name}'; choose one of: {', '.join(sorted(METRICS))}")
    module, fn = METRICS[name].split(":")
    return getattr(importlib.import_module(f"kvbench.metrics.{module}"), fn)
