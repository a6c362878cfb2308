"""The contract between a policy and the cache: what a policy may read and write of one layer.

Policies see a layer only through `CacheLayer`; the engine's `EvictingLayer` (kvbench/engine/cache.py) implements it.
So no module of the policies layer imports the engine, not even for type hints (tests/test_layers.py checks every
import, TYPE_CHECKING ones included), and tests/test_layers.py checks that every attribute the policies use of a
layer is named here and that `EvictingLayer` has every member named here.

Shapes: a layer is scored in a padded view (b, h_kv, n): every KV head holds n slots, in chronological order; a
layer stored flat per head (ragged: per-head budgets) is turned into that view by `unpack` before scoring and back
by `pack`/`keep` (`Policy.evict` does both), so a policy never sees the flat storage.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class CacheLayer(Protocol):
    """One full-attention layer's cache, as a policy sees it while scoring and selecting."""

    # -- what the layer holds (the padded view while a policy scores it) -------------------------------------------
    # post-RoPE keys (b, h_kv, n, d). No `values`: a policy that scores values computes per-token state from the
    # values `on_append` is handed (CriticalKV's value norms), once per token
    keys: torch.Tensor
    positions: torch.Tensor  # (b, h_kv, n) absolute position of each slot; -1 on padding
    valid: torch.Tensor | None  # (b, h_kv, n) bool real slots in the padded view of a ragged layer; None: all real
    # name -> (b, h_kv, n) per-token policy state (a policy's `state_names`), pruned with the tokens by `keep`;
    # written by `on_append` results and in place (H2O's accumulator, SAGE-KV's pins)
    state: dict[str, torch.Tensor]
    # per-layer (not per-token) values a policy keeps from a forward to the eviction after it (HashEvict's probe)
    scratch: dict[str, torch.Tensor]

    # -- where the layer is --------------------------------------------------------------------------------------
    layer_idx: int  # the decoder layer's index in the model (per-layer budgets, per-layer random projections)
    seen: int  # tokens ever appended: the next token's absolute position
    decoding: bool  # True once the prompt is done (SAGE-KV slides its window only then)

    # -- the queries a policy asked for (`query_window`) and the model's attention settings ----------------------
    queries: torch.Tensor | None  # (b, h_q, w, d) the latest w post-RoPE queries
    query_positions: torch.Tensor | None  # (w,) their absolute positions
    query_first: int | None  # position of the earliest stashed query while the stashed positions have no gap
    scaling: float | None  # the model's attention scale (query_attention rebuilds the weights with it)
    softcap: float | None  # the model's attention logit softcap, if any

    # -- selection ---------------------------------------------------------------------------------------------------
    def physical(self) -> int:
        """Slots of the longest head (a uniform layer: every head's length)."""
        ...

    def head_lengths(self) -> list[int]:
        """Real tokens each (batch, KV head) holds, row-major, known on the host (no read of the device)."""
        ...

    def unpack(self) -> None:
        """A ragged layer: replace its flat storage by the padded scoring view (no-op for a uniform layer)."""
        ...

    def pack(self, sizes: list[int] | None = None) -> None:
        """Store the padded view's real slots again (no-op when not in the padded view); `sizes`: the new head sizes
        when the caller read them (the engine), else the layer knows or reads them, or leaves them to the engine."""
        ...

    def window_attention(self) -> torch.Tensor:
        """(b, h_q, n) float32: the mean over the stashed queries (`query_attention(layer)`'s rows) of their attention
        probabilities over the slots, `query_attention(layer).mean(dim=-2)`: SnapKV's observation window. The layer
        keeps it incrementally (per-token state: a decoding step adds the new query's row), so call it in place of
        that recomputation; equal to it up to float rounding (tests/test_window_state.py)."""
        ...

    def keep(self, idx: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Keep only the slots `idx` (b, h_kv, k), chronological, of the padded view; `valid` (b, h_kv, k) marks
        padding. K/V, positions and every state tensor are pruned together (a selection with padding may be stored
        later, when the engine reads the new head sizes together with the decoded token)."""
        ...

