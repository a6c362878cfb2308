"""Uniformly random eviction: the sanity baseline every policy should beat."""

from __future__ import annotations

import torch

from kvbench.policies.base import Policy, SlotView


class Random(Policy):
    name = "random"
    sample_state = True  # each sample's own generator: two samples are never scored by one instance

    def start_sample(self, sample_seed: int) -> None:
        # One generator per sample, seeded from (policy seed, sample): results do not depend on sample order.
        self._gen = torch.Generator().manual_seed(self.seed * 1_000_003 + sample_seed)

    def score(self, view: SlotView) -> torch.Tensor:
        if not hasattr(self, "_gen"):
            self.start_sample(0)
        # a fresh draw per slot at every eviction, from the CPU generator (the same draws on every device)
        return torch.rand(view.pos.shape, generator=self._gen).to(view.pos.device)  # (L, b, h_kv, S)
