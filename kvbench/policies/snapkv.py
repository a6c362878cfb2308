"""SnapKV: score tokens by the attention of an observation window of the latest queries, smoothed by pooling.

KeyDiff's baseline (KeyDiff App. B.2): window 32, kernel 7, average pooling; the CriticalKV/AdaKV setting
(CriticalKV §4.3) uses max pooling. Score of each token outside the window = mean over the window queries of their attention to it,
pooled along the token axis (per query head, zero padding of kernel//2), then averaged over the group's query
heads; the window itself (the latest `window` tokens) is always kept.
Choice: the window is the latest `window` queries of the sequence, kept across blocks and decoding steps, so a
block smaller than the window (and B = 1 decoding) still scores with `window` queries; `block=null` is exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvbench.policies.base import Policy, PolicyError, group_mean
from kvbench.policies.ranks import slot_order
from kvbench.policies.window import window_attention

if TYPE_CHECKING:
    from kvbench.policies.layer import CacheLayer
    from kvbench.policies.view import SlotView


class SnapKV(Policy):
    name = "snapkv"
    # Scores from the layer's own stashed queries, keys and positions, row by row (Policy.stackable); its window ring
    # is a stackable extra. In a stack the window's own slots get the stack's maximum rather than the layer's: they
    # are protected (ranked +inf), so no selection reads it
    stackable = True

    def __init__(self, window: int = 32, kernel: int = 7, pooling: str = "avg", **kwargs) -> None:
        if pooling not in ("avg", "max"):
            raise PolicyError(f"snapkv pooling '{pooling}' unknown; choose one of: avg, max")
        if kernel < 1 or kernel % 2 == 0:
            raise PolicyError(f"snapkv kernel must be a positive odd number, got {kernel}")
        self.window, self.kernel, self.pooling = int(window), int(kernel), pooling
        self.query_window = self.window
        super().__init__(n_recent=self.window, **kwargs)

    def attention_rows(self, layer: CacheLayer, q: int) -> int:
        """The window's rows from a forward that computes them (`WindowRing.attention` takes them): a prompt block's
        latest `window` queries (their mean: the window of a block that replaces every row), a decoding step's one (its
        new row); none when the eviction after this forward will not select (`due`, on the host: the layer already
        holds the forward's tokens), as most of AdaKV's layers in a decoding step, which would never read them."""
        if not self.due(layer):
            return 0
        return 1 if q == 1 else (self.window if q >= self.window else 0)

    def window_scores(self, layer: CacheLayer) -> torch.Tensor:
        """(b, h_q, n) pooled window attention per query head (the window's own slots get the max, as kept)."""
        probs = window_attention(layer)  # (b, h_q, n): query_attention(layer).mean(dim=-2), kept incrementally
        if layer.chronological:
            return self.pooled(probs)
        # Slots out of position order (slot reuse): pooled in position order, the neighbours and the window of the
        # chronological layout, then put back in slot order
        order = slot_order(layer)  # (b, h_kv, n), from ranks kept from step to step (kvbench/policies/ranks.py)
        order = order.repeat_interleave(probs.shape[1] // layer.keys.shape[1], dim=1)  # (b, h_q, n)
        return torch.empty_like(probs).scatter_(-1, order, self.pooled(probs.gather(-1, order)))

    def pooled(self, probs: torch.Tensor) -> torch.Tensor:
        """(b, h_q, n) window attention in position order -> its scores: the tokens before the window (the latest
        `window`) pooled along the sequence, the window at the maximum."""
        w = min(self.window, probs.shape[-1])
        prefix = probs[..., :-w]  # (b, h_q, n - w)
        b, h, n = prefix.shape
        pooled = pool(prefix, self.kernel, self.pooling)  # (b, h_q, n - w)
        top = pooled.amax().view(1, 1, 1) if n else pooled.new_zeros(1, 1, 1)  # a tensor: no host sync
        return torch.cat([pooled, top.expand(b, h, w)], dim=-1)

    def score(self, layer: CacheLayer) -> torch.Tensor:
        return group_mean(self.window_scores(layer), layer.keys.shape[1])  # (b, h_kv, n)

    def slot_score(self, view: SlotView) -> torch.Tensor:
        probs = view.attention().mean(dim=-2)  # (L, b, h_q, S): the window's mean attention
        g = probs.shape[2] // view.pos.shape[2]
        window = (view.pos >= view.seen.view(1, -1, 1, 1) - self.window).repeat_interleave(g, dim=2)
        # pooled along the sequence: the slots in position order (free slots, all 0, first: zero padding), the
        # window's own attention left out of its neighbours' (it is protected)
        order = view.position_order().repeat_interleave(g, dim=2)  # (L, b, h_q, S)
        pooled = pool(probs.masked_fill(window, 0.0).gather(-1, order), self.kernel, self.pooling)
        return view.group_mean(torch.empty_like(pooled).scatter_(-1, order, pooled))  # (L, b, h_kv, S)


def pool(x: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """(..., n) float32 or float64 scores -> (..., n): each pooled over itself and its kernel // 2 neighbours on either
    side along the last axis, zero padded; "avg" divides by `kernel` whatever the padding, as F.avg_pool1d (stride 1,
    count_include_pad) does, "max" is F.max_pool1d. The average is the sum of `kernel` shifted slices, added in the
    window's order, over `kernel`: the very float32/float64 values of avg_pool1d, whose CPU kernel adds each window in
    that order (adding the padding's zeros changes no sum; tests/test_policies.py checks every bit), at ~1/3 of its
    CPU time over many rows (SnapKV's stacked decoding evictions pool 30 layers' rows in one call: 7.4 ms a step with
    avg_pool1d on one thread)."""
    pad = kernel // 2
    if pooling == "max":
        return F.max_pool1d(x.reshape(-1, 1, x.shape[-1]), kernel, stride=1, padding=pad).view(x.shape)
    n = x.shape[-1]
    padded = F.pad(x, (pad, pad))  # (..., n + 2 pad)
    total = padded[..., :n].clone()
    for j in range(1, kernel):
        total += padded[..., j:j + n]
    return total / kernel
