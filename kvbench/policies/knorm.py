"""K-norm (§3): keep the keys with the lowest L2 norm; layers 0 and 1 are not compressed.

The skipped layers keep every token, so they are not bounded by the budget (reported in peak_kv_tokens), and the
engine does no policy work for them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvbench.policies.base import Policy, SlotView


class KNorm(Policy):
    name = "knorm"
    state_names = ("norm",)  # a key's L2 norm, computed once when it enters the cache

    def __init__(self, skip_layers: Sequence[int] = (0, 1), **kwargs) -> None:
        super().__init__(skip_layers=skip_layers, **kwargs)

    def token_state(self, view: SlotView, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"norm": torch.linalg.vector_norm(view.written(view.keys, slots).float(), dim=-1)}  # (L, b, h_kv, t)

    def score(self, view: SlotView) -> torch.Tensor:
        return -view.state["norm"]  # (L, b, h_kv, S)
