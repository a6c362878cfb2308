"""H2O: keep the heavy hitters, tokens with the largest accumulated attention.

Each token's score is the sum of the attention it has received from every query that saw it (all block queries,
all blocks, all decoding steps), summed over the query heads of its KV head (their mean times a constant: the same
ranking). The accumulator is per-token
state, evicted with its token.

`policy=h2o` is KeyDiff's formulation (App. A.1): heavy hitters only, no recent window (`recent_ratio` 0). The
original H2O (Zhang et al. 2023) gives half the budget to the most recent tokens and half to heavy hitters:
`policy=h2o_original` (this class with `recent_ratio` 0.5). `n_sink` / `n_recent` protect the first / latest tokens
as other papers run it (HashEvict §4: the first 4 and the latest 10 for every method); with both `n_recent` and
`recent_ratio`, the larger recent window is kept.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from kvbench.policies.base import Policy, PolicyError, SlotView


class H2O(Policy):
    name = "h2o"
    needs_attention = True
    state_names = ("acc",)  # a token enters with 0: it has received no attention yet

    def __init__(self, recent_ratio: float = 0.0, n_recent: int = 0, budget: int | None = None, **kwargs) -> None:
        if not 0.0 <= recent_ratio < 1.0:
            raise PolicyError(f"h2o recent_ratio must be in [0, 1), got {recent_ratio}")
        self.recent_ratio = float(recent_ratio)
        ratio_recent = math.floor(self.recent_ratio * budget) if budget else 0
        super().__init__(budget=budget, n_recent=max(int(n_recent), ratio_recent), **kwargs)

    def on_attention(self, state: dict[str, Sequence[torch.Tensor]], row: int, received: torch.Tensor) -> None:
        state["acc"][row].add_(received)  # (b, h_kv, S)

    def score(self, view: SlotView) -> torch.Tensor:
        return view.state["acc"]  # (L, b, h_kv, S)
