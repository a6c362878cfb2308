"""The contract between a policy and the cache: what a policy may read and write of one layer.

Policies see a layer only through `CacheLayer`; the engine's `EvictingLayer` (kvbench/engine/cache.py) implements it.
So no module of the policies layer imports the engine, not even for type hints (tests/test_layers.py checks every
import, TYPE_CHECKING ones included), and tests/test_layers.py checks that every attribute the policies use of a
layer is named here and that `EvictingLayer` has every member named here.

Shapes: a layer is scored in a padded view (b, h_kv, n): every KV head holds n slots, in chronological order unless
`chronological` says otherwise (slot reuse: a decoding step's token written where an eviction freed a slot); a
layer stored flat per head (ragged: per-head budgets) is turned into that view by `unpack` before scoring and back
by `pack`/`keep` (`Policy.evict` does both), so a policy never sees the flat storage.

A policy's own incremental per-layer state (SnapKV's observation-window ring, kvbench/policies/window.py) lives in
the policies layer, in an object the layer holds in `extras` (a `LayerExtra`): the layer knows nothing of what it
holds and calls its hooks where the storage changes (a kept selection, the padded view, the stored rows, a fork).
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch


class QueryView(Protocol):
    """A layer's stashed queries (`CacheLayer.stash`), as the policy asked for them (`Policy.query_window`)."""

    queries: torch.Tensor | None  # (b, h_q, w, d) the latest w post-RoPE queries
    positions: torch.Tensor | None  # (w,) their absolute positions
    first: int | None  # position of the earliest stashed query while the stashed positions have no gap
    # the window of the latest stash: w > 0 the latest w queries, kept across forwards; -1 the forward's own; 0 none
    window: int


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
    # (seen, k, (b, h_q, n)): the mean over the latest k queries of the last forward of their attention probabilities
    # per query head over the padded view's slots (0 on padding), when that forward computed them anyway (a ragged
    # layer's per-head attention) and the policy asked for k (`Policy.attention_rows`); `seen` the layer's then (stale
    # once it differs); None otherwise. A reader may set it to None (taken once)
    forward_rows: tuple[int, int, torch.Tensor] | None
    # name -> a policy-owned object with per-layer incremental state that follows the storage (`LayerExtra`: the
    # layer calls its hooks at every keep, unpack, pack and fork); created by the policies layer on first use
    extras: dict[str, LayerExtra]

    # -- where the layer is --------------------------------------------------------------------------------------
    kv_heads: int  # h_kv, whatever the storage: what `due` may read before a ragged layer is unpacked
    layer_idx: int  # the decoder layer's index in the model (per-layer budgets, per-layer random projections)
    # each batch row's decoder layer where the rows are several layers' (a stack's, kvbench/engine/stack.py); None:
    # every row is `layer_idx`'s
    row_layers: tuple[int, ...] | None
    seen: int  # tokens ever appended: the next token's absolute position
    # (b, 1, 1) each batch row's own `seen` where the rows saw different numbers (a stack of several samples' layers,
    # kvbench/engine/stack.py); None: every row saw `seen`
    row_seen: torch.Tensor | None
    decoding: bool  # True once the prompt is done (SAGE-KV slides its window only then)
    # True while every head's slots are in position order (the latest tokens the last slots); False once a decoding
    # step wrote a token into a slot an eviction freed (slot_reuse; a ragged layer's only with
    # Policy.ragged_slot_reuse): then read the order from `positions`
    chronological: bool
    # (b, h_kv, q) the slots the latest forward's tokens were written into when those were the holes the eviction
    # before it freed (slot reuse: exactly one token per head came in since that eviction); None otherwise
    block_slots: torch.Tensor | None

    # -- the queries a policy asked for (`query_window`) and the model's attention settings ----------------------
    stash: QueryView  # the latest post-RoPE queries and where they sit
    scaling: float | None  # the model's attention scale (query_attention rebuilds the weights with it)
    softcap: float | None  # the model's attention logit softcap, if any

    # -- selection ---------------------------------------------------------------------------------------------------
    def physical(self) -> int:
        """Slots of the longest head (a uniform layer: every head's length)."""
        ...

    def head_lengths(self) -> list[int]:
        """Real tokens each (batch, KV head) holds, row-major, known on the host (no read of the device)."""
        ...

    def head_keys(self) -> list[torch.Tensor] | None:
        """In the padded view with K/V left flat (`unpack(kv=False)`): each (batch, KV head)'s real keys (n_i, d),
        row-major, in position order (views, no copy): what attention over the keys reads then (the view's `keys` are
        stand-ins); None otherwise."""
        ...

    def unpack(self, kv: bool = True) -> None:
        """A ragged layer: replace its flat storage by the padded scoring view (no-op for a uniform layer); `kv` False:
        K/V stay flat and the view's keys/values are stand-ins of its shape, never to be read (`Policy.needs_kv`;
        attention over the keys reads `head_keys` then)."""
        ...

    def pack(self, sizes: list[int] | None = None) -> None:
        """Store the padded view's real slots again (no-op when not in the padded view); `sizes`: the new head sizes
        when the caller read them (the engine), else the layer knows or reads them, or leaves them to the engine."""
        ...

    def drop_position(self, position: int) -> bool:
        """Drop from every head the token at absolute `position`, which every head holds (`Policy.dropped_position`),
        as `keep` of every other slot would, without a selection; False (nothing done) where the layer cannot (then
        select and `keep`)."""
        ...

    def keep(self, idx: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Keep only the slots `idx` (b, h_kv, k), chronological, of the padded view; `valid` (b, h_kv, k) marks
        padding. K/V, positions and every state tensor are pruned together (a selection with padding may be stored
        later, when the engine reads the new head sizes together with the decoded token)."""
        ...



class LayerExtra(Protocol):
    """A policy-owned per-layer object held in `CacheLayer.extras` (SnapKV's `WindowRing`): incremental state that
    follows the layer's storage, e.g. its own per-token rows, pruned, padded and stored with the tokens like their
    keys. The layer calls these hooks on each of its extras where the storage changes. Appending tokens calls none:
    an extra notes `layer.seen` when its rows were complete and gives the tokens appended since their entries when it
    next needs them (the layer's `seen` tells it how many)."""

    # True when the extra only caches what the layer's arrays and stash determine, so that it may be dropped at any
    # time (its owner builds it again from the layer on next use): then layers holding it may be evicted as one stack
    # (kvbench/engine/stack.py), which drops its members' extras and builds one of its own over all its rows
    stackable: bool

    def on_keep(self, layer: CacheLayer, idx: torch.Tensor, packed: bool) -> None:
        """`layer.keep` keeps the slots `idx` (b, h_kv, k) of the current layout (uniform or the padded view).
        `packed` False: a uniform layer that stays uniform, stored at once (the extra prunes its rows here, now or
        lazily); True: the selection is stored by `pack`, whose `on_pack` hands the extra the rows to keep in the
        current layout (bring its rows up to date with that layout now)."""
        ...

    def on_unpack(self, layer: CacheLayer, sizes: list[int],
                  pad: Callable[[torch.Tensor, list[int], float], torch.Tensor]) -> None:
        """`layer.unpack` has built the padded view (b, h_kv, L) of a ragged layer whose heads held `sizes` tokens
        (row-major, on the host). `pad(flat, segment_sizes, fill)`: flat per-head rows (S, ...) in segments of
        `segment_sizes` -> (b, h_kv, L, ...), each segment followed by `fill`, the view's own layout."""
        ...

    def on_reuse(self, layer: CacheLayer, slots: torch.Tensor) -> None:
        """`layer.keep` drops one token per head and leaves every other slot where it is (slot reuse while decoding):
        `slots` (b, h_kv, 1) the freed slot of each head, where the next token will be written (its entries of every
        row computed so far are zeros: those queries are earlier than it)."""
        ...

    def on_pack(self, rows: torch.Tensor, shape: tuple[int, int, int] | None) -> None:
        """`layer.pack` stores the rows `rows` (S,) of the current layout's flattened (b * h_kv * n) slots (the kept
        real slots, in order): `shape` (b, h_kv, n) when every head keeps n (uniform), None when stored flat per
        head (S, ...)."""
        ...

    def fork(self) -> LayerExtra:
        """An independent copy for `layer.fork()` (the graded branch): clone what is written in place."""
        ...
