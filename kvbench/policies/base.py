"""The shared base of every eviction policy: budgets, protected tokens, GQA aggregation and top-N selection.

A policy subclass declares what it needs through class attributes and implements one method, `score(layer)`,
returning one score per (batch, KV head, cached token), higher = keep. Everything else lives here, once.

What the engine provides, only when a policy asks for it:
- `query_window` > 0: the latest `query_window` post-RoPE queries of each layer (rolling across blocks and
  decoding steps), in `layer.queries` with their absolute positions in `layer.query_positions`; -1: the current
  block's queries.
- `needs_attention`: `on_attention(layer, probs)` is called inside the attention wrapper with the block's real
  attention probabilities (the engine computes attention itself then, and reuses them for the output).
- `state_names`: per-token state tensors (b, h_kv, n) kept in `layer.state` and pruned with the tokens; new
  tokens' entries are filled by `on_append` when they enter the cache.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from kvbench.cache import EvictingLayer


class PolicyError(ValueError):
    """Invalid policy configuration (budget too small for the protected tokens, ...)."""


class Policy:
    name: str = ""
    evicts: bool = True
    single_pass_prefill: bool = False  # prefill in one forward whatever `block` says (the no-eviction baseline)
    query_window: int = 0
    needs_attention: bool = False
    state_names: tuple[str, ...] = ()

    def __init__(self, budget: int | None = None, n_sink: int = 0, n_recent: int = 0,
                 skip_layers: Sequence[int] = (), seed: int = 0, **kwargs: Any) -> None:
        if kwargs:
            raise PolicyError(f"policy '{self.name}' got unknown options: {', '.join(sorted(kwargs))}")
        self.budget = budget
        self.n_sink = int(n_sink)
        self.n_recent = int(n_recent)
        self.skip_layers = frozenset(int(i) for i in skip_layers)
        self.seed = int(seed)
        if self.evicts:
            if budget is None or budget <= 0:
                raise PolicyError(f"budget must be a positive integer for policy '{self.name}', got {budget}")
            if budget <= self.protected_count():
                raise PolicyError(f"budget {budget} must exceed the {self.protected_count()} tokens policy "
                                  f"'{self.name}' always keeps (sinks/recent/window)")

    # -- configuration ------------------------------------------------------------------------------------------
    def protected_count(self) -> int:
        return self.n_sink + self.n_recent

    def layer_budget(self, layer_idx: int) -> int | None:
        """Tokens layer `layer_idx` may keep per KV head; None = this layer is not evicted."""
        if not self.evicts or layer_idx in self.skip_layers:
            return None
        return self.budget

    def start_sample(self, sample_seed: int) -> None:
        """Called before each sample; stochastic policies reseed here so results do not depend on sample order."""

    # -- hooks called by the engine -----------------------------------------------------------------------------
    def on_append(self, layer: EvictingLayer, module: Any, keys: torch.Tensor, values: torch.Tensor,
                  query: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token state (name -> (b, h_kv, q)) for the `q` tokens just appended (keys/values are theirs)."""
        return {}

    def on_attention(self, layer: EvictingLayer, probs: torch.Tensor) -> None:
        """`probs` (b, h_kv, q, n): the block's attention, averaged over each KV head's query heads."""

    # -- scoring and selection ----------------------------------------------------------------------------------
    def score(self, layer: EvictingLayer) -> torch.Tensor:
        """(b, h_kv, n) scores over the layer's cached tokens, higher = keep."""
        raise NotImplementedError

    def protected(self, layer: EvictingLayer) -> torch.Tensor | None:
        """(b, h_kv, n) bool of slots that must be kept: the first `n_sink` positions and the last `n_recent` slots."""
        if self.protected_count() == 0:
            return None
        prot = layer.positions < self.n_sink  # (b, h_kv, n)
        if self.n_recent > 0:
            prot[..., -self.n_recent:] = True
        return prot

    def select(self, layer: EvictingLayer) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Kept slot indices (b, h_kv, k) in chronological order, plus a validity mask for ragged heads (or None).

        Returns None when the layer is within its budget (nothing evicted).
        """
        budget = self.layer_budget(layer.layer_idx)
        if budget is None or layer.physical() <= budget:
            return None
        scores = self.score(layer).float()  # (b, h_kv, n)
        prot = self.protected(layer)
        if prot is not None:
            scores = scores.masked_fill(prot, math.inf)
        if layer.valid is not None:
            scores = scores.masked_fill(~layer.valid, -math.inf)
        idx = scores.topk(budget, dim=-1, sorted=False).indices.sort(dim=-1).values  # (b, h_kv, budget)
        return idx, None

    def evict(self, layer: EvictingLayer) -> bool:
        """Prune `layer` to its budget; True if anything was evicted."""
        chosen = self.select(layer)
        if chosen is None:
            return False
        layer.keep(*chosen)
        return True


# ---------------------------------------------------------------------------------------------------------------
# Shared helpers for attention-based scores.

def group_mean(x: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(b, h_q, ...) -> (b, h_kv, ...): average over the query heads sharing each KV head (KeyDiff App. B.2)."""
    b, h_q = x.shape[:2]
    return x.view(b, n_kv, h_q // n_kv, *x.shape[2:]).mean(dim=2)


def query_attention(layer: EvictingLayer) -> torch.Tensor:
    """Attention probabilities (b, h_q, w, n) of the layer's stashed queries over its cached tokens.

    A query only sees keys at positions <= its own (causality for queries kept from earlier steps) and valid slots.
    Computed in float32.
    """
    q = layer.queries.float()  # (b, h_q, w, d)
    k = layer.keys.float()  # (b, h_kv, n, d)
    b, h_q, w, d = q.shape
    h_kv = k.shape[1]
    g = h_q // h_kv
    logits = torch.matmul(q.reshape(b, h_kv, g * w, d), k.transpose(-1, -2)).view(b, h_q, w, -1) * layer.scaling
    if getattr(layer, "softcap", None):
        logits = torch.tanh(logits / layer.softcap) * layer.softcap
    visible = layer.positions.unsqueeze(-2) <= layer.query_positions.view(1, 1, w, 1)  # (b, h_kv, w, n)
    if layer.valid is not None:
        visible = visible & layer.valid.unsqueeze(-2)
    visible = visible.repeat_interleave(g, dim=1)  # (b, h_q, w, n)
    logits = logits.masked_fill(~visible, -math.inf)
    return torch.softmax(logits, dim=-1)
