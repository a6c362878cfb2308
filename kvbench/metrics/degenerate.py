"""Degenerate generations: outputs that are empty, whitespace only, or one token / n-gram over and over.

A collapsed policy (H2O without a recent window at a tight budget emits newlines, "1111...", "is is The The ...")
scores 0 like a policy that answered the wrong thing; counting these outputs keeps the two apart in every table.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

REPEAT_SHARE = 0.8  # a pattern covering this share of the output makes it degenerate
MAX_NGRAM = 8  # longest repeated unit looked for, in tokens


def _cover(tokens: Sequence[int], n: int) -> int:
    """Tokens covered by non-overlapping repeats of the most frequent n-gram (only when it occurs twice or more)."""
    if len(tokens) < 2 * n:
        return 0
    counts = Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))
    best = 0
    for gram, c in counts.most_common(3):  # the non-overlapping count is at most the overlapping one
        if c * n <= best:
            break
        i, k = 0, 0
        while i <= len(tokens) - n:
            if tuple(tokens[i:i + n]) == gram:
                k, i = k + 1, i + n
            else:
                i += 1
        if k >= 2:
            best = max(best, k * n)
    return best


def is_degenerate(text: str, tokens: Sequence[int]) -> bool:
    """True for an empty or whitespace-only output, or one whose most repeated token or n-gram (n <= 8, two or more
    non-overlapping occurrences) covers at least 80 % of its tokens. A one-token answer ("Paris") is not
    degenerate: a repeat needs two occurrences."""
    if not text.strip():
        return True
    tokens = list(tokens)
    if not tokens:
        return True
    need = REPEAT_SHARE * len(tokens)
    return any(_cover(tokens, n) >= need for n in range(1, min(MAX_NGRAM, len(tokens) // 2) + 1))
