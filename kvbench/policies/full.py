"""No eviction: the full-cache baseline (prefilled in one forward, as a plain model would)."""

from __future__ import annotations

from kvbench.policies.base import Policy


class Full(Policy):
    name = "full"
    evicts = False
    single_pass_prefill = True  # block mode with an unbounded cache only adds cost
