"""TOVA (KeyDiff App. A.1): keep the tokens the last query attends to most; GQA: mean over the group's heads."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbench.policies.base import Policy, group_mean, query_attention

if TYPE_CHECKING:
    from kvbench.policies.layer import CacheLayer
    from kvbench.policies.view import SlotView


class TOVA(Policy):
    name = "tova"
    stackable = True  # scores from the layer's own arrays, row by row (Policy.stackable)
    query_window = 1

    def score(self, layer: CacheLayer) -> torch.Tensor:
        probs = query_attention(layer)  # (b, h_q, 1, n)
        return group_mean(probs[:, :, -1], layer.keys.shape[1])  # (b, h_kv, n)

    def slot_score(self, view: SlotView) -> torch.Tensor:
        return view.group_mean(view.attention()[:, :, :, -1])  # (L, b, h_kv, S): the latest query's attention
