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
    "progress": True, "batch_size": 1, "share": True, "share_rows": "auto",
    "compile": False,
}
# Settings of the engine before the static slot cache that runs of that time recorded (how they decoded, never what a
# result means): a reader of a stored config leaves them out.
RETIRED_SETTINGS = ("slot_reuse", "evict_together", "stack_prefill")
def stored_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config as a run recorded it (its config.yaml), less the retired settings; every reader of a stored config
    goes through this."""
    return {k: v for k, v in cfg.items() if k not in RETIRED_SETTINGS}


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
