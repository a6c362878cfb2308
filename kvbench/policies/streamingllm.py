"""StreamingLLM (Sink): the first `n_sink` tokens plus the most recent ones (KeyDiff App. B.2: n_sink = 4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbench.policies.base import Policy

if TYPE_CHECKING:
    from kvbench.policies.layer import CacheLayer


class StreamingLLM(Policy):
    name = "streamingllm"
    stackable = True  # scores from the layer's own arrays, row by row (Policy.stackable)

    def __init__(self, n_sink: int = 4, **kwargs) -> None:
        super().__init__(n_sink=n_sink, **kwargs)

    def score(self, layer: CacheLayer) -> torch.Tensor:
        return layer.positions.float()  # (b, h_kv, n): later = keep; sinks are protected by the base
