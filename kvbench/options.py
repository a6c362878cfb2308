"""The run options every layer reads, in one torch-free module: the eviction protocols and prompt scenarios, the
canonical (protocol, block) of a setting, and the one check of budget and block values.

Torch-free on purpose: run directory names, config validation and the report put settings into canonical form
without loading torch; the engine and the policies read the same tables.
"""

from __future__ import annotations

from typing import Any

# When the cache is pruned, as the seed papers run it: name -> (prompt in one forward, evict while decoding).
PROTOCOLS: dict[str, tuple[bool, bool]] = {
    "blockwise": (False, True),  # KeyDiff Eq. 6, HashEvict (B = 1): after every prompt block and decoding step
    "prefill_once": (True, False),  # SnapKV, AdaKV, CriticalKV Alg. 2, kvpress: once after the prompt, then grow
    "prefill_once_decode_evict": (True, True),  # KeyDiff Table 7 (B = inf), SAGE-KV: once, then at every step
}

# Which prompt tokens eviction applies to: all of them, or the context only (the question after it is never
# evicted: CriticalKV App. H).
SCENARIOS = ("question_aware", "context_only")
# The LM score's default token set (task=lm `lm_tokens`): the prompt tokens predicted after the first eviction at
# N = budget, B = block; the run loop places it, and the report pairs runs only at equal N and B under it.
LM_TOKENS_AFTER_EVICTION = "after_eviction"
# The run settings' defaults, as a run records them (its config.yaml's top-level keys): what RunSettings.from_config
# takes for an absent key, and (a run made before a setting existed ran as its default) what the report reads for a
# setting absent from an older run's config.yaml. RunSettings' field defaults are the same (tests/test_settings.py).
RUN_DEFAULTS: dict[str, Any] = {
    "compare": [], "budget": None, "block": None, "protocol": "blockwise", "seed": 0, "scenario": "question_aware",
    "save_prompts": False, "overwrite": False, "device": "auto", "shard": None, "diagnostics": [], "graded": True,
    "progress": True, "batch_size": 1, "share": True, "slot_reuse": True, "evict_together": True,
    "stack_prefill": "auto",
}
# Settings whose default changed after runs were recorded without them: a stored config.yaml that lacks one of these
# keys ran under the value here, not under today's default (RUN_DEFAULTS). slot_reuse was false until it became the
# default; the runs written before it existed decoded chronologically. stack_prefill was false until "auto" became the
# default; every run recorded before then (all CPU runs) evicted its prompt layer by layer.
STORED_DEFAULTS: dict[str, Any] = {"slot_reuse": False, "stack_prefill": False}


def stored_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config as a run recorded it (its config.yaml), with the settings it lacks that ran under an older default
    (STORED_DEFAULTS) filled in as that default; every reader of a stored config goes through this."""
    return {**STORED_DEFAULTS, **cfg}


def positive_int(what: str, value: Any, allow_none: bool = False) -> int | None:
    """The one check of `budget` and `block` values, wherever they come from: a positive integer (a bool is not
    one), or None where `allow_none`. Raises ValueError with the one message users see."""
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{what} must be a positive integer{' or null' if allow_none else ''}, got {value!r}")
    return value


def resolve_protocol(protocol: str, block: int | None) -> tuple[str, int | None]:
    """The canonical (protocol, block) of a setting: block is None (does not apply) unless the prompt goes in
    blocks, and blockwise with block=None (B = inf) is the same computation as prefill_once_decode_evict."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol '{protocol}'; choose one of: {', '.join(PROTOCOLS)}")
    if PROTOCOLS[protocol][0] or block is None:
        return ("prefill_once_decode_evict" if protocol == "blockwise" else protocol), None
    return protocol, block
