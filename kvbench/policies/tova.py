"""TOVA (KeyDiff App. A.1): keep the tokens the last query attends to most; GQA: mean over the group's heads."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbench.policies.base import Policy, group_mean, query_attention

if TYPE_CHECKING:
    from kvbench.policies.layer import CacheLayer


class TOVA(Policy):
    name = "tova"
    stackable = True  # scores from the layer's own arrays, row by row (Policy.stackable)
    query_window = 1

    def score(self, layer: CacheLayer) -> torch.Tensor:
        probs = query_attention(layer)  # (b, h_q, 1, n)
        return group_mean(probs[:, :, -1], layer.keys.shape[1])  # (b, h_kv, n)
