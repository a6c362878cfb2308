"""Each slot's rank by position, kept from step to step through slot reuse: `slot_ranks(layer)`, `slot_order(layer)`.

With slot reuse (kvbench/engine/slots.py) a head's slots are out of position order, and a policy that reads the
chronological layout (Random's draws, SnapKV's pooling) asks for each slot's rank by position. Counted afresh
(`position_ranks`) that is a scatter, a running sum and a gather over a row of `seen` + 1 marks per head: ~1.9 ms of a
~85 ms decoding step for SmolLM2's 30 layers at 4k tokens (one thread), 45 % of Random's decoding eviction. But a
decoding step changes one slot per head: the eviction frees slot s (rank r) and the next token, the newest, is written
into it. So the ranks after that step are the ranks before, less one where they were above r, and n - 1 at s: one
comparison and subtraction over the ranks (tests/test_ranks.py). The layer holds them in a `PositionRanks` (a
`LayerExtra` in `layer.extras`), which `on_reuse` brings up to date for the next step; any other change of the slots
(a kept selection, a prompt block, a padded view) drops them, and they are counted again when next asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from kvbench.policies.base import inverse_permutation, position_bound, position_order, position_ranks

if TYPE_CHECKING:
    from kvbench.policies.layer import CacheLayer


def slot_ranks(layer: CacheLayer) -> torch.Tensor:
    """(b, h_kv, n) each slot's rank in its head by position (0: the earliest): `position_ranks(layer.positions,
    position_bound(layer))`, kept from step to step through slot reuse by the layer's `PositionRanks` (a uniform
    layer's; a padded view's are counted each time). Read only: the same tensor serves the next step."""
    if layer.valid is not None:  # a ragged layer's padded view: a new layout each time
        return position_ranks(layer.positions, position_bound(layer))
    ranks = layer.extras.get(PositionRanks.key)
    if ranks is None:
        ranks = layer.extras[PositionRanks.key] = PositionRanks()
    return ranks.of(layer)


def slot_order(layer: CacheLayer) -> torch.Tensor:
    """(b, h_kv, n) each head's slots in position order: `position_order`, from the kept `slot_ranks` (their inverse)
    where the layer keeps them; a padded view's computed afresh (sorted or counted, never inverted twice)."""
    if layer.valid is not None:
        return position_order(layer.positions, position_bound(layer))
    return inverse_permutation(slot_ranks(layer))


class PositionRanks:
    """A uniform layer's slot ranks by position (a `LayerExtra`, `layer.extras[PositionRanks.key]`).

    `ranks` (b, h_kv, n) int64 are the ranks of the slots the layer holds when it holds `positions` (the very tensor:
    slot reuse writes it in place, any other change replaces it) and has seen `seen` tokens; None: not known."""

    key = "position_ranks"
    # a cache of what the layer's positions determine, dropped at any time (counted again): a layer stack
    # (kvbench/engine/stack.py) may hold its own over all its rows
    stackable = True

    def __init__(self) -> None:
        self.ranks: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.seen = -1

    def _current(self, layer: CacheLayer) -> bool:
        return self.ranks is not None and layer.positions is self.positions and layer.seen == self.seen

    def of(self, layer: CacheLayer) -> torch.Tensor:
        """The layer's ranks now: kept, or counted (and kept)."""
        if not self._current(layer):
            self.ranks = position_ranks(layer.positions, position_bound(layer))
            self.positions, self.seen = layer.positions, layer.seen
        return self.ranks

    # -- the layer's hooks (LayerExtra) ----------------------------------------------------------------------------
    def on_reuse(self, layer: CacheLayer, slots: torch.Tensor) -> None:
        """The layer frees `slots` (b, h_kv, 1) and the next step writes its token, the newest, into each (slot reuse):
        the ranks after that step, where they are known now (else dropped). A hole is a position of its own until the
        token comes (-1, the earliest), so the ranks hold for the next step's count `seen` + 1 only."""
        if not self._current(layer):
            self.ranks = None
            return
        ranks = self.ranks  # (b, h_kv, n), nobody else's: written in place
        ranks.sub_((ranks > ranks.gather(-1, slots)).to(ranks.dtype))  # the later tokens move up one
        ranks.scatter_(-1, slots, ranks.shape[-1] - 1)  # the new token: the latest
        self.seen += 1

    def on_keep(self, layer: CacheLayer, idx: torch.Tensor, packed: bool) -> None:
        self.ranks = None

    def on_unpack(self, layer: CacheLayer, sizes: list[int],
                  pad: Callable[[torch.Tensor, list[int], float], torch.Tensor]) -> None:
        self.ranks = None

    def on_pack(self, rows: torch.Tensor, shape: tuple[int, int, int] | None) -> None:
        self.ranks = None

    def fork(self) -> PositionRanks:
        return PositionRanks()  # the fork's slots are its own copies: counted again there
