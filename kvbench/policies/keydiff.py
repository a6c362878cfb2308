"""KeyDiff (Eq. 8): keep the keys least similar to the anchor of the layer's cached keys, per KV head.

Variants (KeyDiff Tables 2-3, 11):
- `anchor`: `mean_normalized` (default; mean of unit keys), `mean` (mean of raw keys), `median` (per-dimension
  median of raw keys), `pairwise` (Eq. 7: score_i = -sum_j cos(k_i, k_j), computed as -k_i/|k_i| . sum_j k_j/|k_j|,
  which is the same sum without building an n x n matrix).
- `metric`: `cosine` (default; score = -cos(k_i, a)), `dot` (score = -k_i . a), `euclidean` (score = |k_i - a|).
  For `pairwise` the metric is cosine by definition.
- `recent_ratio`: that fraction of the budget is reserved for the most recent tokens (Table 11); default 0.
The anchor is computed over all keys the layer holds at eviction time (kept + the new block).
Speed (default variant and `pairwise`): -cos(k_i, mean_j u_j) ranks every token of a head exactly like
-(k_i . sum_j u_j) / |k_i| (|anchor| and the count are the same positive number for the whole head), so each token's
inverse norm is computed once, when it enters the cache (per-token state), and a score is two matrix products over
the held keys: s = inv_norm @ K (the sum of unit keys), score = -(K s) * inv_norm. Same ranking as normalising every
key again at every eviction, up to float rounding.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvbench.policies.base import Policy, PolicyError

if TYPE_CHECKING:
    from kvbench.policies.layer import CacheLayer
    from kvbench.policies.view import SlotView

ANCHORS = ("mean_normalized", "mean", "median", "pairwise")
METRICS = ("cosine", "dot", "euclidean")


class KeyDiff(Policy):
    name = "keydiff"
    stackable = True  # scores from the layer's own arrays, row by row (Policy.stackable)
    state_from_tokens = True  # the inverse norms: the new keys' own (Policy.state_from_tokens)

    def __init__(self, anchor: str = "mean_normalized", metric: str = "cosine", recent_ratio: float = 0.0,
                 budget: int | None = None, **kwargs) -> None:
        if anchor not in ANCHORS:
            raise PolicyError(f"keydiff anchor '{anchor}' unknown; choose one of: {', '.join(ANCHORS)}")
        if metric not in METRICS:
            raise PolicyError(f"keydiff metric '{metric}' unknown; choose one of: {', '.join(METRICS)}")
        if not 0.0 <= recent_ratio < 1.0:
            raise PolicyError(f"keydiff recent_ratio must be in [0, 1), got {recent_ratio}")
        self.anchor, self.metric, self.recent_ratio = anchor, metric, float(recent_ratio)
        self.unit_anchor = anchor == "pairwise" or (anchor == "mean_normalized" and metric == "cosine")
        self.state_names = ("inv_norm",) if self.unit_anchor else ()
        n_recent = math.floor(self.recent_ratio * budget) if budget else 0
        super().__init__(budget=budget, n_recent=n_recent, **kwargs)

    def on_append(self, layer: CacheLayer, module: Any, keys: torch.Tensor, values: torch.Tensor,
                  query: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.unit_anchor:
            return {}
        # (b, h_kv, q), as F.normalize; Tensor.norm's kernel called directly (its Python dispatch cost ~5 us of 13)
        return {"inv_norm": torch.linalg.vector_norm(keys.float(), dim=-1).clamp_min_(1e-12).reciprocal_()}

    def score(self, layer: CacheLayer) -> torch.Tensor:
        k = layer.keys.float()  # (b, h_kv, n, d)
        if layer.valid is not None:
            raise PolicyError("keydiff scores whole heads; it cannot run on ragged per-head caches")
        if self.unit_anchor:
            inv = layer.state.get("inv_norm")  # (b, h_kv, n)
            if inv is None:  # a layer filled outside the attention wrapper (hand-built caches)
                inv = self.on_append(layer, None, k, None, None)["inv_norm"]
            anchor = torch.matmul(inv.unsqueeze(-2), k)  # (b, h_kv, 1, d): sum of the unit keys
            return torch.matmul(k, anchor.transpose(-1, -2)).squeeze(-1).mul_(inv).neg_()  # (b, h_kv, n)
        unit = F.normalize(k, dim=-1)
        if self.anchor == "mean_normalized":
            a = unit.mean(dim=-2, keepdim=True)  # (b, h_kv, 1, d)
        elif self.anchor == "mean":
            a = k.mean(dim=-2, keepdim=True)
        else:
            a = k.median(dim=-2, keepdim=True).values
        if self.metric == "cosine":
            return -F.cosine_similarity(k, a, dim=-1)
        if self.metric == "dot":
            return -(k * a).sum(-1)
        return (k - a).norm(dim=-1)

    def slot_score(self, view: SlotView) -> torch.Tensor:
        k = view.keys.float()  # (L, b, h_kv, S, d)
        held = view.held.unsqueeze(-1)  # (L, b, h_kv, S, 1): the anchor is over the held keys only
        count = held.sum(dim=-2, keepdim=True).clamp_min(1)  # (L, b, h_kv, 1, 1)
        unit = F.normalize(k, dim=-1)
        if self.anchor == "mean_normalized" or self.anchor == "pairwise":
            a = (unit * held).sum(dim=-2, keepdim=True) / count  # (L, b, h_kv, 1, d)
        elif self.anchor == "mean":
            a = (k * held).sum(dim=-2, keepdim=True) / count
        else:
            a = k.masked_fill(~held, math.nan).nanmedian(dim=-2, keepdim=True).values
        if self.unit_anchor or self.metric == "cosine":
            return -F.cosine_similarity(k, a, dim=-1)
        if self.metric == "dot":
            return -(k * a).sum(-1)
        return (k - a).norm(dim=-1)
