"""SAGE-KV (SAGE-KV 2, App. A.2): one selection after the prompt, then only the recent window slides.

Kept per KV head: the first `sink` positions, the union over the group's query heads of each head's top-`k`
tokens by the last token's attention (chosen among the tokens that are neither sinks nor recent), and the
`recent` most recent tokens plus the last token. Sizes from the budget N and the group size g = h_q / h_kv
(SAGE-KV App. A.2; N = 8192: g = 4 -> sink 2048, k 1024, recent 2047 + last; g = 7 -> sink 2048, k 512,
recent 2559 + last): sink = N // 4, k = N // 2^ceil(log2(2g)), recent = N - sink - g*k - 1; each can be set.
Heads whose unions overlap keep fewer than N tokens (per-head counts). Decoding: the sinks and selected tokens stay
fixed (per-token state `pinned`); each new token joins the recent window and the window's oldest token is dropped,
so every head keeps a constant size. `score` is 1 for the slots an eviction keeps, and `counts` their number.
Deviation: under block processing the same selection is made after every block that overflows the budget, with
that block's last query (the paper evicts once after a full prefill; `block=null` is exact). If the prompt never
overflowed the budget, the first decoding step that does makes the selection.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvbench.policies.base import Policy, PolicyError, SlotView, rank_mask


class SageKV(Policy):
    name = "sagekv"
    query_window = 1
    state_names = ("pinned",)  # 1 for the sinks and the selected tokens: never slid out while decoding

    def __init__(self, sink: int | None = None, k: int | None = None, recent: int | None = None,
                 budget: int | None = None, **kwargs: Any) -> None:
        self.sink, self.k, self.recent = sink, k, recent
        super().__init__(budget=budget, **kwargs)
        self.sizes(1)  # bad explicit sizes fail at config time; group-dependent ones when the model is seen

    def sizes(self, group: int) -> tuple[int, int, int]:
        """(sink, k, recent) for budget N and `group` query heads per KV head."""
        n = self.budget
        sink, k, recent = self.row_sizes(n, group)
        if sink < 0 or k < 1 or recent < 0 or sink + group * k + recent + 1 > n:
            raise PolicyError(f"sagekv sizes sink={sink} k={k} recent={recent} with group {group} do not fit "
                              f"budget {n} (need sink + group*k + recent + 1 <= budget, k >= 1)")
        return sink, k, recent

    def score(self, view: SlotView) -> torch.Tensor:
        """1 for the slots this eviction keeps, 0 for the held ones it drops (free slots: the engine's -inf), the
        three cases of `select` per batch row and layer as tensor logic: a slide (decoding after a selection: the
        pinned tokens and the latest recent + 1), a selection (over budget otherwise: sinks | union | the latest
        recent + 1, pinning sinks | union in `state["pinned"]`, in place), else every held token. A row whose budget
        is the capacity S or more (a batch row that does not evict now) keeps every held token: under such a budget
        no head ever passed it, so it never selected and never slides."""
        held = view.pos >= 0  # (L, b, h_kv, S)
        L, b, h_kv, S = held.shape
        assert view.queries is not None
        h_q = view.queries.shape[2]
        g = h_q // h_kv
        budgets = view.budgets.view(L, b, 1, 1)  # type: ignore[union-attr]
        sink, k, recent = self.row_sizes(budgets, g)  # ints, or (L, b, 1, 1) from each row's budget
        seen = view.seen.view(1, b, 1, 1)
        longest = held.sum(dim=-1, keepdim=True).amax(dim=2, keepdim=True)  # (L, b, 1, 1): `physical()`
        # A selection was made exactly when the row holds fewer tokens than it saw (`_sliding`); only while decoding
        sliding = (longest < seen) if view.decoding else torch.zeros_like(longest, dtype=torch.bool)
        sliding &= budgets < S
        selecting = ~sliding & (longest > budgets)  # (L, b, 1, 1)
        pinned = (view.state["pinned"] > 0) & held
        # The latest recent + 1 positions are all held whenever a slide or a selection runs (every token is held before
        # the first selection; a selection and a slide keep the latest ones), so by position, as `select`'s slide
        latest = held & (view.pos >= seen - recent - 1)
        sinks = held & (view.pos < sink)
        cand = (held & ~sinks & ~latest).repeat_interleave(g, dim=2)  # (L, b, h_q, S)
        probs = view.attention()[..., -1, :].masked_fill(~cand, -math.inf)  # (L, b, h_q, S): the last query's
        order = view.pos.repeat_interleave(g, dim=2).reshape(L * b, h_q, S)  # ties to the earlier token
        top_k = k if isinstance(k, int) else k.view(L * b, 1).expand(L * b, h_q)
        most = k if isinstance(k, int) else self.row_sizes(S, g)[1]  # on the host: budgets are at most S
        top = rank_mask(probs.reshape(L * b, h_q, S), top_k, order, most=most)  # each query head's top-k
        chosen = sinks | top.view(L, b, h_kv, g, S).any(dim=3)  # (L, b, h_kv, S): sinks | union
        keep = torch.where(selecting, chosen | latest, torch.where(sliding, pinned | latest, held))
        view.state["pinned"].copy_(torch.where(selecting, chosen, pinned).float())
        return keep.float()

    def row_sizes(self, budgets: torch.Tensor | int, group: int) -> tuple[Any, Any, Any]:
        """`sizes` for each row's budget N (a tensor): the explicit sizes as ints, the derived ones as tensors of
        `budgets`' shape (a batch's rows may have different budgets; an int budget gives ints)."""
        n = budgets
        sink = n // 4 if self.sink is None else int(self.sink)
        k = n // 2 ** math.ceil(math.log2(2 * group)) if self.k is None else int(self.k)
        recent = n - sink - group * k - 1 if self.recent is None else int(self.recent)
        return sink, k, recent

    def counts(self, view: SlotView, ranked: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return (ranked > 0).sum(dim=-1)  # (L, b, h_kv): the slots `score` keeps (no protected +inf here)
