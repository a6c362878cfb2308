"""How runs are named: run directory parts (model, protocol), one-line run descriptions, and how a setting is
printed in tables and plot labels (`NA` = does not apply).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from kvbench.options import resolve_protocol


class _NotApplicable:
    """A setting that does not apply to a policy (the budget of the full cache)."""

    def __repr__(self) -> str:
        return "-"


NA = _NotApplicable()


def fmt(v: Any) -> str:
    if v is NA:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.2f}"
    return "" if v is None else str(v)


def setting_name(k: str) -> str:
    return k.split(".", 1)[1] if k.startswith("policy.") else k


def na(v: Any) -> Any:
    return NA if v is None else v


def settings_text(settings: dict[str, Any]) -> str:
    """A row's shown settings in a few words for plot labels: "blockwise B=128", "prefill_once window=16"; a setting
    that does not apply to the row (NA: another policy's option) is left out."""
    rest = dict(settings)
    protocol, block = rest.pop("protocol", NA), rest.pop("block", NA)
    words = [] if protocol is NA else [str(protocol)]
    words += [] if block is NA else [f"B={fmt(block)}"]
    return " ".join(words + [f"{setting_name(k)}={fmt(v)}" for k, v in rest.items() if v is not NA])


def describe_run(model: str, policy: str, budget: Any, block: Any, protocol: Any, evicts: bool = True) -> str:
    """One line naming a run for its own plots: "smollm2-135m: snapkv N=256, blockwise B=128"."""
    if not evicts:
        return f"{model}: {policy}"
    return f"{model}: {policy} N={budget}, {settings_text({'protocol': protocol, 'block': na(block)})}"


def model_label(name: Any, path: Any = None) -> str:
    """What a run directory calls the model: the preset's name, or for the generic `hf` preset the model's own
    name (the last component of its hub id or directory, as LoadedModel.name), made safe for a file name."""
    label = str(name)
    if label == "hf" and path:
        label = Path(str(path).rstrip("/")).name or label
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label)


def policy_label(choice: Any) -> str:
    """What a run directory calls the policy: the chosen one, or `compare` when none is (the `compare` option runs
    several, each in a subdirectory of its own name)."""
    return "compare" if choice in (None, "None", "null") else str(choice)


def protocol_label(protocol: Any, block: Any) -> str:
    """What a run directory calls the protocol: `blockwise_B128`, `prefill_once`, ... (the block only where the
    prompt goes in blocks). A bad value passes through unchanged; the run then fails on it with one line."""
    try:
        protocol, block = resolve_protocol(str(protocol), block)
    except ValueError:
        return re.sub(r"[^A-Za-z0-9._-]+", "_", str(protocol))
    return f"{protocol}_B{block}" if block is not None else protocol
