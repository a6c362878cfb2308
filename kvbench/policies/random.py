"""Uniformly random eviction: the sanity baseline every policy should beat."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbench.policies.base import Policy

if TYPE_CHECKING:
    from kvbench.policies.layer import CacheLayer


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
        # tokens are evicted as in the chronological layout
        return draws.gather(-1, age_ranks(layer.positions, layer.seen))


def age_ranks(positions: torch.Tensor, seen: int) -> torch.Tensor:
    """(b, h, n) each slot's rank in its head by position (0: the oldest token), from `positions` (b, h, n), distinct
    per head, all in [0, seen). Counted, not sorted, while `seen` is within 8x n: mark each head's positions in a
    (b*h, seen) row, and a slot's rank is the marks before its own (a running sum). Stacked decoding (30 layers x 3
    heads x 1025 slots, seen 4128): 1.0 ms against 5.8 ms for an argsort, the same ranks (positions never tie)."""
    n = positions.shape[-1]
    if seen > 8 * n:
        order = positions.argsort(dim=-1)  # (b, h, n): slots oldest first
        return torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=order.device).expand_as(order))
    rows = positions.reshape(-1, n)  # (b*h, n)
    marks = torch.zeros(rows.shape[0], seen, dtype=torch.int32, device=rows.device)
    ranks = marks.scatter_(1, rows, 1).cumsum_(1).gather(1, rows).sub_(1)  # (b*h, n)
    return ranks.view(positions.shape).long()
