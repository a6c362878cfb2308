"""K-norm (paper 004, §3): keep the keys with the lowest L2 norm; layers 0 and 1 are not compressed.

The skipped layers keep every token, so they are not bounded by the budget (reported in peak_kv_tokens).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvbench.policies.base import Policy


class KNorm(Policy):
    name = "knorm"

    def __init__(self, skip_layers: Sequence[int] = (0, 1), **kwargs) -> None:
        super().__init__(skip_layers=skip_layers, **kwargs)

    def score(self, layer) -> torch.Tensor:
        return -layer.keys.float().norm(dim=-1)  # (b, h_kv, n)
