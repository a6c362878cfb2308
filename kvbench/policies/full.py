"""No eviction: the full-cache baseline (prefilled in one forward, as a plain model would)."""

from __future__ import annotations

import torch

from kvbench.policies.base import Policy


class Full(Policy):
    name = "full"
    evicts = False
    single_pass_prefill = True  # block mode with an unbounded cache only adds cost (architecture note, fact 8)

    def score(self, layer) -> torch.Tensor:
        raise RuntimeError("the full policy never scores")
