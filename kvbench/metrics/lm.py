"""The language-modelling score of one sample: its scored tokens' log-probabilities summed up.

`lm_summary` turns the per-token natural-log probabilities log p(x_{t+1} | cache at t) and whether each was the
model's top-1 guess into the record's numbers: the mean log-probability per token (nats, higher is better),
perplexity = exp(-mean), and next-token accuracy in % (K-norm's second language-modelling measure). Plain Python
(math.fsum), no tensors: the same arithmetic for the run loop and for a reader checking it by hand.
"""

from __future__ import annotations

import math
from typing import Any, Sequence


def lm_summary(logprobs: Sequence[float], correct: Sequence[bool]) -> dict[str, Any]:
    """{"tokens": n, "logprob": mean log-probability (nats), "perplexity": exp(-logprob), "accuracy": % of tokens
    whose argmax was the token}; the three values are None when n = 0. `correct` pairs with `logprobs`."""
    n = len(logprobs)
    if len(correct) != n:
        raise ValueError(f"lm_summary: {n} log-probabilities but {len(correct)} correctness flags")
    if n == 0:
        return {"tokens": 0, "logprob": None, "perplexity": None, "accuracy": None}
    mean = math.fsum(float(v) for v in logprobs) / n
    return {"tokens": n, "logprob": mean, "perplexity": math.exp(-mean),
            "accuracy": 100.0 * sum(1 for c in correct if c) / n}


def pooled_perplexity(logprob_means: Sequence[float], tokens: Sequence[int]) -> float | None:
    """The perplexity of all samples' scored tokens together (token-weighted: exp of minus the mean log-probability
    over every token), from each sample's mean and count; None without tokens."""
    total = sum(tokens)
    if total == 0:
        return None
    return math.exp(-math.fsum(m * n for m, n in zip(logprob_means, tokens)) / total)
