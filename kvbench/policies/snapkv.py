"""SnapKV: score tokens by the attention of an observation window of the latest queries, smoothed by pooling.

KeyDiff's baseline (KeyDiff App. B.2): window 32, kernel 7, average pooling; the CriticalKV/AdaKV setting
(CriticalKV §4.3) uses max pooling. Score of each token outside the window = mean over the window queries of their
attention to it, pooled along the token axis (per query head, zero padding of kernel//2), then averaged over the
group's query heads; the window itself (the latest `window` tokens) is always kept.
Choice: the window is the latest `window` queries of the sequence, kept across blocks and decoding steps, so a
block smaller than the window (and B = 1 decoding) still scores with `window` queries; `block=null` is exact.
The score is `WindowAttention`'s (kvbench/policies/base.py), which PyramidKV, AdaKV and CriticalKV score with too.
"""

from __future__ import annotations

from kvbench.policies.base import WindowAttention


class SnapKV(WindowAttention):
    name = "snapkv"
