"""StreamingLLM (Sink): the first `n_sink` tokens plus the most recent ones (KeyDiff App. B.2: n_sink = 4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbench.policies.base import Policy

if TYPE_CHECKING:
    from kvbench.policies.layer import CacheLayer
    from kvbench.policies.view import SlotView


class StreamingLLM(Policy):
    name = "streamingllm"
    stackable = True  # scores from the layer's own arrays, row by row (Policy.stackable)

    def __init__(self, n_sink: int = 4, **kwargs) -> None:
        super().__init__(n_sink=n_sink, **kwargs)

    def score(self, layer: CacheLayer) -> torch.Tensor:
        return layer.positions.float()  # (b, h_kv, n): later = keep; sinks are protected by the base

    def slot_score(self, view: SlotView) -> torch.Tensor:
        return view.pos.float()  # (L, b, h_kv, S): later = keep; the sinks are protected

    def dropped_position(self, layer: CacheLayer) -> int | None:
        """One token over the budget N drops position seen - N - 1 + n_sink from every head, known on the host: every
        head always holds the sinks and the latest tokens (an append adds the latest, every eviction drops the
        earliest others), so N + 1 held tokens are the n_sink sinks and positions seen - (N + 1 - n_sink) .. seen - 1,
        and the earliest of those goes, as the selection would drop it (the budget exceeds the sinks: Policy checks
        it). None where the rows saw different numbers of tokens (a stack of samples: `row_seen`)."""
        budget = self.layer_budget(layer.layer_idx, layer.seen)
        if budget is None or layer.row_seen is not None or layer.physical() != budget + 1:
            return None
        return layer.seen - budget - 1 + self.n_sink
