"""Uniformly random eviction: the sanity baseline every policy should beat."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbench.policies.base import Policy
from kvbench.policies.ranks import slot_ranks

if TYPE_CHECKING:
    from kvbench.policies.layer import CacheLayer
    from kvbench.policies.view import SlotView


class Random(Policy):
    name = "random"
    # A stack of L layers (kvbench/engine/stack.py) draws its (L*b, h_kv, n) numbers in one call: the CPU generator
    # fills a tensor in order, so they are the draws of the L layers one by one (tests/test_stack.py)
    stackable = True
    sample_state = True  # each sample's own generator: two samples' layers are never drawn for by one instance

    def start_sample(self, sample_seed: int) -> None:
        # One generator per sample, seeded from (policy seed, sample): results do not depend on sample order.
        self._gen = torch.Generator().manual_seed(self.seed * 1_000_003 + sample_seed)

    def score(self, layer: CacheLayer) -> torch.Tensor:
        if not hasattr(self, "_gen"):
            self.start_sample(0)
        draws = torch.rand(layer.positions.shape, generator=self._gen).to(layer.positions.device)  # (b, h_kv, n)
        if layer.chronological:
            return draws
        # slots out of order (slot reuse): the i-th draw still goes to each head's i-th oldest token, so the same
        # tokens are evicted as in the chronological layout (ranks kept from step to step: kvbench/policies/ranks.py)
        return draws.gather(-1, slot_ranks(layer))

    def slot_score(self, view: SlotView) -> torch.Tensor:
        if not hasattr(self, "_gen"):
            self.start_sample(0)
        # one draw per slot, in the row's own generator; the engine ranks free slots below every draw
        return torch.rand(view.pos.shape, generator=self._gen).to(view.pos.device)  # (L, b, h_kv, S)
