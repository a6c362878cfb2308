"""StreamingLLM (Sink): the first `n_sink` tokens plus the most recent ones (KeyDiff App. B.2: n_sink = 4)."""

from __future__ import annotations

import torch

from kvbench.policies.base import Policy, SlotView


class StreamingLLM(Policy):
    name = "streamingllm"

    def __init__(self, n_sink: int = 4, **kwargs) -> None:
        super().__init__(n_sink=n_sink, **kwargs)

    def score(self, view: SlotView) -> torch.Tensor:
        return view.pos.float()  # (L, b, h_kv, S): later = keep; the sinks are protected
