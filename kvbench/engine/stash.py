"""The queries a policy asked for (`Policy.query_window`), kept per layer across forwards: a layer's `stash`.

The attention wrapper adds each forward's post-RoPE queries (`add`) before the policy scores the layer; policies read
them through `CacheLayer.stash` (kvbench/policies/layer.py: `QueryView`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


@dataclass
class QueryStash:
    """The latest stashed queries of one layer and where they sit."""

    queries: torch.Tensor | None = None  # (b, h_q, w, d) the latest queries kept for the policy
    positions: torch.Tensor | None = None  # (w,) absolute positions of those queries
    # Position of the earliest stashed query, known on the host while the stashed positions have no gap (None
    # otherwise): query_attention then masks only the keys after it, which are the last slots.
    first: int | None = None
    window: int = 0  # the window of the latest stash: w > 0 the latest w, kept across forwards; -1 the forward's own
    end: int = 0  # the layer's `seen` at the latest stash

    def add(self, query: torch.Tensor, seen: int, window: int) -> None:
        """Keep the latest `window` queries (-1: only this forward's) after the forward's `query` (b, h_q, q, d),
        whose last token is at position seen - 1."""
        q = query.shape[-2]
        pos = torch.arange(seen - q, seen, device=query.device)  # (q,)
        self.window = window
        if window < 0 or self.queries is None:
            self.queries, self.positions = query, pos
            self.first = seen - q
        else:
            if self.end != seen - q:
                self.first = None  # a forward was not stashed: the positions have a gap
            if 0 < window <= q:  # only this forward's queries stay (TOVA's and SAGE-KV's one): nothing to concatenate
                self.queries, self.positions = query, pos
            else:
                self.queries = torch.cat([self.queries, query], dim=-2)
                self.positions = torch.cat([self.positions, pos])
        if window > 0 and self.queries.shape[-2] > window:
            self.queries = self.queries[..., -window:, :]
            self.positions = self.positions[-window:]
        if self.first is not None:
            self.first = seen - self.queries.shape[-2]
        self.end = seen

    def fork(self) -> QueryStash:
        """An independent copy: the tensors are only ever replaced, never written in place, so it shares them."""
        return copy.copy(self)
