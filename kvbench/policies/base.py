"""The shared base of every eviction policy: its budget, protected tokens and the one method it writes, `score`.

A policy scores the slots of every evicting layer at once (a `SlotView`, kvbench/policies/view.py): `score(view)`
returns (L, b, h_kv, S), higher = keep. The engine (kvbench/engine/cache.py) does the rest, for every policy alike:
the protected tokens (the first `n_sink` positions and the latest `n_recent`) rank above everything and free slots
below, each head keeps its top `counts` (the layer's budget, `layer_budget`; a per-head allocation overrides
`counts`), ties go to the earlier token, and the other slots are marked free.

What the engine provides, only when a policy asks for it:
- `query_window` w > 0: the latest w post-RoPE queries of each layer (across blocks and decoding steps), in
  `view.queries` with their positions in `view.qpos`; -1: the last forward's queries (as many as its largest).
- `needs_attention`: `on_attention` is called inside every forward of an evicting layer with the attention each slot
  received (the engine computes the probabilities then).
- `state_names`: per-token state (L, b, h_kv, S) float32 in `view.state`, 0 for a token when it enters the cache
  unless `token_state` gives its value (once per forward, for every evicting layer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from kvbench.options import positive_int

if TYPE_CHECKING:
    from kvbench.policies.view import SlotView


class PolicyError(ValueError):
    """Invalid policy configuration (budget too small for the protected tokens, ...)."""


class Policy:
    name: str = ""
    evicts: bool = True
    single_pass_prefill: bool = False  # prefill in one forward whatever `block` says (the no-eviction baseline)
    query_window: int = 0
    needs_attention: bool = False
    state_names: tuple[str, ...] = ()
    # True: the policy object holds per-sample state its score reads (Random's generator, reseeded per sample), so two
    # samples are never the rows of one cache scored by one instance (kvbench.engine.generate.slot_key)
    sample_state: bool = False

    def __init__(self, budget: int | None = None, n_sink: int = 0, n_recent: int = 0,
                 skip_layers: Sequence[int] = (), seed: int = 0, **kwargs: Any) -> None:
        if kwargs:
            raise PolicyError(f"policy '{self.name}' got unknown options: {', '.join(sorted(kwargs))}")
        self.budget = budget
        self.n_sink = int(n_sink)
        self.n_recent = int(n_recent)
        self.skip_layers = frozenset(int(i) for i in skip_layers)
        self.seed = int(seed)
        self.num_layers: int | None = None  # the model's depth, told by `attach`
        if self.evicts:
            if budget is None:
                raise PolicyError(f"policy '{self.name}' needs a budget (budget=N)")
            try:
                positive_int("budget", budget)
            except ValueError as e:
                raise PolicyError(str(e)) from None
            if budget <= self.protected_count():
                raise PolicyError(f"budget {budget} must exceed the {self.protected_count()} tokens policy "
                                  f"'{self.name}' always keeps (sinks/recent/window)")

    # -- configuration ------------------------------------------------------------------------------------------
    def protected_count(self) -> int:
        return self.n_sink + self.n_recent

    def layer_budget(self, layer_idx: int, seen: int | None = None) -> int | None:
        """Tokens layer `layer_idx` may keep per KV head once it has seen `seen` tokens; None = not evicted."""
        if not self.evicts or layer_idx in self.skip_layers:
            return None
        return self.budget

    def head_capacity(self, budget: int) -> int:
        """The most tokens one KV head may keep under `budget` (the static cache's slots per head are this plus the
        largest forward): the budget, unless the policy allocates per head (AdaKV's heads share the layer's)."""
        return budget

    def attach(self, num_layers: int) -> None:
        """Called when a cache is built for a model: its number of decoder layers (sliding ones included)."""
        self.num_layers = int(num_layers)

    def start_sample(self, sample_seed: int) -> None:
        """Called before each sample; stochastic policies reseed here so results do not depend on sample order."""

    # -- what the engine calls ----------------------------------------------------------------------------------
    def score(self, view: SlotView) -> torch.Tensor:
        """(L, b, h_kv, S) scores over the slots of every evicting layer, higher = keep; free slots and protected
        tokens are ranked by the engine (below and above everything)."""
        raise NotImplementedError(f"policy '{self.name}' has no score")

    def counts(self, view: SlotView, ranked: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """(L, b, h_kv) or (L, b, 1) tokens each head keeps; `counts` (L, b, 1) are the layers' budgets for each row
        (`layer_budget`), `ranked` the scores as the engine ranks them (protected +inf, free -inf). Per-head budgets
        (AdaKV) allocate here."""
        return counts

    def token_state(self, view: SlotView, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token state (name -> (L, b, h_kv, t)) of the t tokens a forward just wrote into `slots` (L, b, h_kv, t)
        of every evicting layer (their K/V in the view's buffers), called once per forward; a state not returned
        starts at 0."""
        return {}

    def on_attention(self, state: dict[str, Sequence[torch.Tensor]], row: int, received: torch.Tensor) -> None:
        """`received` (b, h_kv, S): the attention each slot of one layer received from a forward's queries (their
        probabilities summed over the queries and each KV head's query heads), for a policy that `needs_attention`;
        `state[name][row]` is that layer's per-token state (b, h_kv, S), written in place."""
