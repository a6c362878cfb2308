"""KeyDiff (Eq. 8): keep the keys least similar to the anchor of the layer's cached keys, per KV head.

Variants (KeyDiff Tables 2-3, 11):
- `anchor`: `mean_normalized` (default; mean of unit keys), `mean` (mean of raw keys), `median` (per-dimension
  median of raw keys), `pairwise` (Eq. 7: score_i = -sum_j cos(k_i, k_j), computed as -k_i/|k_i| . sum_j k_j/|k_j|,
  which is the same sum without building an n x n matrix).
- `metric`: `cosine` (default; score = -cos(k_i, a)), `dot` (score = -k_i . a), `euclidean` (score = |k_i - a|).
  For `pairwise` the metric is cosine by definition.
- `recent_ratio`: that fraction of the budget is reserved for the most recent tokens (Table 11); default 0.
The anchor is computed over all keys the layer holds at eviction time (kept + the new block). `pairwise` ranks as
the default does: -sum_j cos(k_i, k_j) = -cos(k_i, mean_j u_j) |mean_j u_j| n, the same positive factor for a head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvbench.policies.base import Policy, PolicyError, SlotView

ANCHORS = ("mean_normalized", "mean", "median", "pairwise")
METRICS = ("cosine", "dot", "euclidean")


class KeyDiff(Policy):
    name = "keydiff"
    state_names = ("inv_norm",)  # 1 / |k|, computed once when the key enters the cache

    def __init__(self, anchor: str = "mean_normalized", metric: str = "cosine", recent_ratio: float = 0.0,
                 budget: int | None = None, **kwargs) -> None:
        if anchor not in ANCHORS:
            raise PolicyError(f"keydiff anchor '{anchor}' unknown; choose one of: {', '.join(ANCHORS)}")
        if metric not in METRICS:
            raise PolicyError(f"keydiff metric '{metric}' unknown; choose one of: {', '.join(METRICS)}")
        if not 0.0 <= recent_ratio < 1.0:
            raise PolicyError(f"keydiff recent_ratio must be in [0, 1), got {recent_ratio}")
        self.anchor, self.metric, self.recent_ratio = anchor, metric, float(recent_ratio)
        n_recent = math.floor(self.recent_ratio * budget) if budget else 0
        super().__init__(budget=budget, n_recent=n_recent, **kwargs)

    def token_state(self, view: SlotView, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        norm = torch.linalg.vector_norm(view.written(view.keys, slots).float(), dim=-1)  # (L, b, h_kv, t)
        return {"inv_norm": norm.clamp_min_(1e-12).reciprocal_()}

    def score(self, view: SlotView) -> torch.Tensor:
        k = view.keys.float()  # (L, b, h_kv, S, d)
        if self.anchor in ("mean_normalized", "pairwise") and self.metric == "cosine":
            # -cos(k_i, mean_j u_j) ranks a head's tokens as -(k_i . sum_j u_j) / |k_i| does (|anchor| and the count
            # are one positive number per head): two products over the keys
            inv = view.state["inv_norm"]  # (L, b, h_kv, S)
            # (L, b, h_kv, 1, d): the held unit keys' sum
            anchor = torch.matmul((inv * (view.pos >= 0)).unsqueeze(-2), k)
            return torch.matmul(k, anchor.transpose(-1, -2)).squeeze(-1).mul_(inv).neg_()  # (L, b, h_kv, S)
        held = (view.pos >= 0).unsqueeze(-1)  # (L, b, h_kv, S, 1): the anchor is over the held keys only
        count = held.sum(dim=-2, keepdim=True).clamp_min(1)  # (L, b, h_kv, 1, 1)
        if self.anchor in ("mean_normalized", "pairwise"):
            a = (F.normalize(k, dim=-1) * held).sum(dim=-2, keepdim=True) / count  # (L, b, h_kv, 1, d)
        elif self.anchor == "mean":
            a = (k * held).sum(dim=-2, keepdim=True) / count
        else:
            a = k.masked_fill(~held, math.nan).nanmedian(dim=-2, keepdim=True).values
        if self.anchor == "pairwise" or self.metric == "cosine":
            return -F.cosine_similarity(k, a, dim=-1)
        if self.metric == "dot":
            return -(k * a).sum(-1)
        return (k - a).norm(dim=-1)
