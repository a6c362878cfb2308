"""Label-free fidelity of an evicted run against the full-cache run (CriticalKV's output-perturbation view).

Inputs are next-token log-probabilities of both runs along the same (teacher-forced) token sequence, so
differences do not compound.
"""

from __future__ import annotations

import torch


def fidelity(ref_logprobs: torch.Tensor, test_logprobs: torch.Tensor) -> dict[str, float]:
    """Per-step comparison of (steps, vocab) log-probabilities.

    top1: % of steps where both argmaxes agree; kl_mean / kl_max: KL(full || evicted) in nats; match_len: steps
    before the first disagreement, which is exactly how many tokens a free-running greedy decode of the evicted
    run reproduces (both runs saw identical inputs up to there).
    """
    ref = ref_logprobs.double()
    test = test_logprobs.double()
    agree = ref.argmax(dim=-1) == test.argmax(dim=-1)  # (steps,)
    p = ref.exp()
    kl = torch.where(p > 0, p * (ref - test), 0.0).sum(dim=-1).clamp_min(0.0)  # (steps,)
    steps = agree.numel()
    first_miss = int((~agree).nonzero()[0, 0]) if not bool(agree.all()) else steps
    return {"top1": 100.0 * float(agree.double().mean()) if steps else 100.0,
            "kl_mean": float(kl.mean()) if steps else 0.0,
            "kl_max": float(kl.max()) if steps else 0.0,
            "match_len": first_miss}
