"""AdaKV (CriticalKV Alg. 2 line 1, 4.3): SnapKV scores with per-head budgets chosen per layer.

In each layer the h_kv heads share h_kv * N slots: every head keeps its protected tokens (the SnapKV window),
and the rest of the layer's budget goes to heads by their scores, with a safeguard `alpha_safeguard` (a) so
that no head is starved. Two published allocation rules (`allocation`; details in `allocate`):
- `adakv` (default; AdaKV's own code, the method "as originally defined" that CriticalKV 4.3 runs): with F = N - window,
  head h keeps its window + its top round((1 - a) * c_h + floor(a * F)), c_h = its share of the layer's top
  h_kv * F scores;
- `kvpress` (NVIDIA kvpress AdaKVPress): each head keeps its top floor(a * N) slots counting the window, the rest
  of the h_kv * N slots go to the layer's best remaining scores.
Heads thus keep different numbers of tokens (the layer at most h_kv * N after an eviction); peak_kv_tokens reports
the fullest head, kv_bytes_peak what the heads hold together.
Defaults follow the AdaKV/CriticalKV setting (CriticalKV 4.3): window 32, kernel 7, max pooling; alpha_safeguard 0.2
(kvpress's default; CriticalKV gives none, AdaKV's README example uses 0.5).
Choice: eviction runs when the layer holds more than h_kv * N real tokens. With `adakv`, rounding can make the
counts exceed h_kv * F by a few tokens; kvbench takes them back (heads rounded up the most first).
The static bound: a head has a fixed number of slots (kvbench/engine/cache.py), so a head keeps at most
ceil(`head_cap` * N) tokens (default 2.0; at least 1): the allocation's counts are clamped to it after every eviction
(also one that is not over h_kv * N: a head may never hold more than its slots allow), and the budget clamped away
stays unused (not handed to the other heads). With 2 KV heads the default never binds (a head's count is at most
h_kv * N).
"""

from __future__ import annotations

import math

import torch

from kvbench.policies.base import PolicyError, SlotView, WindowAttention, rank_mask, ranks

ALLOCATIONS = ("adakv", "kvpress")


class AdaKV(WindowAttention):
    name = "adakv"

    def __init__(self, alpha_safeguard: float = 0.2, allocation: str = "adakv", pooling: str = "max",
                 head_cap: float = 2.0, **kwargs) -> None:
        if not head_cap >= 1.0:  # below 1 a layer could not hold its h_kv * N
            raise PolicyError(f"adakv head_cap must be at least 1, got {head_cap}")
        if not 0.0 <= alpha_safeguard <= 1.0:
            raise PolicyError(f"adakv alpha_safeguard must be in [0, 1], got {alpha_safeguard}")
        if allocation not in ALLOCATIONS:
            raise PolicyError(f"adakv allocation '{allocation}' unknown; choose one of: {', '.join(ALLOCATIONS)}")
        self.alpha_safeguard = float(alpha_safeguard)
        self.allocation = allocation
        self.head_cap = float(head_cap)
        super().__init__(pooling=pooling, **kwargs)

    def head_capacity(self, budget: int) -> int:
        return math.ceil(self.head_cap * budget)

    def counts(self, view: SlotView, ranked: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """(L, b, h_kv) `allocation` clamped to `head_capacity` (the slots a head has; what is clamped away
        stays unused)."""
        cap = (counts.double() * self.head_cap).ceil().long()  # (L, b | 1, 1): head_capacity's ceil per row
        return self.allocation_counts(ranked, counts).minimum(cap)

    def allocation_counts(self, ranked: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        """(L, b, h_kv) tokens each head keeps, uncapped: `allocate` over each layer row whose heads hold more
        than h_kv * N in all (`over_budget`), every held token elsewhere. `ranked` (L, b, h_kv, S): protected +inf,
        free -inf; `budgets` (L, b | 1, 1) each row's N."""
        L, b, h, S = ranked.shape
        N = budgets.expand(L, b, 1).reshape(L * b, 1)  # (R, 1), R = L * b rows
        scores = ranked.reshape(L * b, h, S)
        held = (scores > -math.inf).sum(dim=-1)  # (R, h)
        n_prot = (scores == math.inf).sum(dim=-1)  # (R, h)
        alloc = allocate(scores, N, n_prot, self.alpha_safeguard, self.allocation)
        over = held.sum(dim=-1, keepdim=True) > h * N  # (R, 1)
        return torch.where(over, alloc, held).view(L, b, h)


def allocate(scores: torch.Tensor, budget: torch.Tensor, n_protected: torch.Tensor, alpha_safeguard: float,
             rule: str) -> torch.Tensor:
    """The AdaKV allocation (CriticalKV Alg. 2 line 1): (R, h) tokens each head keeps, protected ones included, with
    tensors only (no host read, static shapes). `scores` (R, h, S) protected +inf, free -inf; `budget` (R, 1) each
    row's N; `n_protected` (R, h); a = `alpha_safeguard`. The row's heads share h * N slots:
    - `adakv` (AdaKV's own code): with F = N - protected per head, c_h = how many of the row's top sum(F) unprotected
      scores are head h's; head h keeps its protected tokens and round((1 - a) * c_h + floor(a * F)) (torch.round,
      half to even, in float32 as that code computes it); a total rounded above sum(F) gives one token back from the
      heads rounded up the most (the lower head first);
    - `kvpress` (NVIDIA kvpress AdaKVPress): each head first keeps its top floor(a * N) slots counting its protected
      ones (at least those), the rest of the h * N go to the best remaining scores over all heads.
    The pooled top-`total` is a rank among the row's h * S scores (`ranks`); scores tied at the cut across heads go
    to the lower head."""
    R, h, S = scores.shape
    # both rules count how many of a row's top `total` (R, 1) pooled scores (R, h * S) are each head's: their ranks
    # below `total`, summed per head (ties to the lower head, then the lower slot: `ranks` by index)
    if rule == "kvpress":
        safe_count = n_protected.maximum((budget.double() * alpha_safeguard).floor().long())  # (R, h)
        # (R, h, S): which of tokens tied at a head's cut is `safe` changes no head's count (they are one head's)
        safe = rank_mask(scores, safe_count)
        pooled = scores.masked_fill(safe, math.inf).reshape(R, h * S)
        total = (pooled > -math.inf).sum(dim=-1, keepdim=True).minimum(h * budget)  # (R, 1)
        return (ranks(pooled) < total).view(R, h, S).sum(dim=-1)
    free = budget - n_protected  # (R, h) F per head
    floor_cap = (free.double() * alpha_safeguard).floor()  # (R, h) int(a * F) in double, as Python computes it
    unprot = scores.masked_fill(scores == math.inf, -math.inf).reshape(R, h * S)
    total = torch.minimum(free.sum(dim=-1, keepdim=True), (unprot > -math.inf).sum(dim=-1, keepdim=True))  # (R, 1)
    c = (ranks(unprot) < total).view(R, h, S).sum(dim=-1)  # (R, h)
    exact = c * (1 - alpha_safeguard) + floor_cap.float()  # (R, h) float32, as AdaKV's code computes it
    k = torch.round(exact).long()
    excess = (k.sum(dim=-1) - free.sum(dim=-1)).clamp_min(0)  # (R,) > 0 only through rounding up
    k = k - rank_mask((k - exact).unsqueeze(0), excess.unsqueeze(0))[0].long()  # one back from the most rounded up
    return n_protected + k
