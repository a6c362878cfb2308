"""TOVA (KeyDiff App. A.1): keep the tokens the last query attends to most; GQA: mean over the group's heads."""

from __future__ import annotations

import torch

from kvbench.policies.base import Policy, SlotView


class TOVA(Policy):
    name = "tova"
    query_window = 1

    def score(self, view: SlotView) -> torch.Tensor:
        return view.group_mean(view.attention()[:, :, :, -1])  # (L, b, h_kv, S): the one stored query's (window 1)
