"""SnapKV: score tokens by the attention of an observation window of the latest queries, smoothed by pooling.

KeyDiff's baseline (KeyDiff App. B.2): window 32, kernel 7, average pooling; the CriticalKV/AdaKV setting
(CriticalKV §4.3) uses max pooling. Score of each token outside the window = mean over the window queries of their attention to it,
pooled along the token axis (per query head, zero padding of kernel//2), then averaged over the group's query
heads; the window itself (the latest `window` tokens) is always kept.
Choice: the window is the latest `window` queries of the sequence, kept across blocks and decoding steps, so a
block smaller than the window (and B = 1 decoding) still scores with `window` queries; `block=null` is exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbench.policies.base import Policy, PolicyError, SlotView


class SnapKV(Policy):
    name = "snapkv"

    def __init__(self, window: int = 32, kernel: int = 7, pooling: str = "avg", **kwargs) -> None:
        if pooling not in ("avg", "max"):
            raise PolicyError(f"snapkv pooling '{pooling}' unknown; choose one of: avg, max")
        if kernel < 1 or kernel % 2 == 0:
            raise PolicyError(f"snapkv kernel must be a positive odd number, got {kernel}")
        self.window, self.kernel, self.pooling = int(window), int(kernel), pooling
        self.query_window = self.window
        super().__init__(n_recent=self.window, **kwargs)

    def score(self, view: SlotView) -> torch.Tensor:
        """(L, b, h_kv, S): the window's mean attention per query head (`view.mean_attention`), pooled along the
        sequence (the slots in position order, free slots, all 0, first: zero padding; the window's own attention
        left out of its neighbours': its tokens are protected), then averaged over each KV head's query heads."""
        probs = view.mean_attention()  # (L, b, h_q, S)
        g = probs.shape[2] // view.pos.shape[2]
        window = (view.pos >= view.seen.view(1, -1, 1, 1) - self.window).repeat_interleave(g, dim=2)
        order = view.pos.argsort(dim=-1).repeat_interleave(g, dim=2)  # (L, b, h_q, S): by position, free first
        pooled = pool(probs.masked_fill(window, 0.0).gather(-1, order), self.kernel, self.pooling)
        return view.group_mean(torch.empty_like(pooled).scatter_(-1, order, pooled))


def pool(x: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """(..., n) float32 or float64 scores -> (..., n): each pooled over itself and its kernel // 2 neighbours on either
    side along the last axis, zero padded; "avg" divides by `kernel` whatever the padding, as F.avg_pool1d (stride 1,
    count_include_pad) does, "max" is F.max_pool1d. The average is the sum of `kernel` shifted slices, added in the
    window's order, over `kernel`: the very float32/float64 values of avg_pool1d, whose CPU kernel adds each window in
    that order (adding the padding's zeros changes no sum; tests/test_policies.py checks every bit), in fewer passes
    over many rows."""
    pad = kernel // 2
    if pooling == "max":
        return F.max_pool1d(x.reshape(-1, 1, x.shape[-1]), kernel, stride=1, padding=pad).view(x.shape)
    n = x.shape[-1]
    padded = F.pad(x, (pad, pad))  # (..., n + 2 pad)
    total = padded[..., :n].clone()
    for j in range(1, kernel):
        total += padded[..., j:j + n]
    return total / kernel
