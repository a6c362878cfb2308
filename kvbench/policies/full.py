"""No eviction: the full-cache baseline (prefilled in one forward, as a plain model would)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbench.policies.base import Policy

if TYPE_CHECKING:
    from kvbench.policies.layer import CacheLayer


class Full(Policy):
    name = "full"
    evicts = False
    single_pass_prefill = True  # block mode with an unbounded cache only adds cost (HF sdpa repeats K/V per block)

    def score(self, layer: CacheLayer) -> torch.Tensor:
        raise RuntimeError("the full policy never scores")
