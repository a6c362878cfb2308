"""Slot reuse while decoding (`slot_reuse=true`, the default): a step appends and evicts without rebuilding K/V.

In chronological storage (`slot_reuse=false`) every decoding step copies each layer's K/V twice: the new token is
concatenated at the end (a new (b, h_kv, n + 1, d) tensor) and the kept slots are gathered after the eviction (another
(b, h_kv, n, d)). With slot reuse, a decoding eviction that drops exactly one token per head (the steady state: one
token in, one out) leaves every other slot where it is and marks the dropped slot of each head as its `hole`
(position -1); the next step's token is written into that hole, in place. K/V, positions and per-token state are thus
written O(new tokens) per step, and the tensors keep one size (N + 1 slots at attention time).

The price is order: a head's slots stop being chronological (`chronological` False), so everything that read "the
latest tokens are the last slots" reads positions instead (protected tokens, SnapKV's window and pooling, ties in the
selections, the stashed queries' causal mask: kvbench/policies/base.py, snapkv.py, window.py). Attention over the
slots is the same set of keys in another order: the same values up to float rounding (a different order of the sums),
so a run with slot reuse can differ from the chronological run where a greedy step or a selection is a near-tie
(tests/test_slots.py checks the float64 reference and the kept positions).

Every other change of the layer (a prompt block, an eviction dropping 0 or >= 2 tokens of a head, a per-head selection
with padding) goes the chronological way, except for a policy whose selections read positions only
(`Policy.ragged_slot_reuse`: SAGE-KV's slide): there a selection with padding that drops exactly one token of every
head leaves holes too, in a ragged (flat per head) or uniform layer alike (RaggedStorage.pack). A gather of a layer
whose slots are out of order takes the kept slots in position order, so it is chronological again afterwards.
`SlotReuse`, a base class of `EvictingLayer`, holds the bookkeeping. With a policy that declares `stackable`, the
layers of one budget are moreover stored in one tensor per array and evicted together, one call a step
(kvbench/engine/stack.py).
"""

from __future__ import annotations

from typing import Any

import torch

from kvbench.engine.ragged import FlatHeads, PaddedView, true_slots


def slot_rows(slots: torch.Tensor, n: int) -> torch.Tensor:
    """(b, h, k) slot indices of a (b, h, n, ...) layout -> (b*h*k,) rows of its flattened (b*h*n, ...) view."""
    b, h, _ = slots.shape
    return (slots + torch.arange(0, b * h * n, n, device=slots.device).view(b, h, 1)).view(-1)


def slots_at(positions: torch.Tensor, flat: FlatHeads | None, position: int) -> tuple[torch.Tensor,
                                                                                   torch.Tensor | None]:
    """The slot (b, h_kv, 1) of each head that holds absolute `position` (every head holds it once), and its rows
    (b*h_kv,) of the flat storage when stored flat per head (`flat`; positions (S,)), else None. One comparison."""
    if flat is None:  # (b, h_kv, n)
        return (positions == position).to(torch.uint8).argmax(dim=-1, keepdim=True), None
    hit = (positions == position) & flat.live_rows(positions.shape[0])  # (S,): free rows hold leftovers
    rows = hit.nonzero_static(size=len(flat.sizes)).view(-1)  # (b*h_kv,) in segment order
    return (rows - flat.start_rows).view(*flat.lengths.shape, 1), rows


def in_position_order(positions: torch.Tensor, chronological: bool, idx: torch.Tensor,
                      valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A selection `idx` (b, h_kv, k) of slots holding `positions` (b, h_kv, n) (with its `valid`) reordered so the
    kept slots come in position order: a gather by it leaves the layer chronological. Unchanged when the slots are in
    position order already (`chronological`)."""
    if chronological:
        return idx, valid
    order = positions.gather(2, idx)  # (b, h_kv, k) positions of the kept slots
    if valid is not None:  # padding after the real slots, as compact() puts it
        order = order.masked_fill(~valid, torch.iinfo(order.dtype).max)
    perm = order.argsort(dim=-1)
    return idx.gather(2, perm), None if valid is None else valid.gather(2, perm)


class SlotReuse:
    """The slot half of an `EvictingLayer` (a base class of it): holes left by decoding evictions, in a uniform layer's
    slots or a ragged one's flat rows, and their reuse; where the latest block's tokens lie (`block_kv`,
    `set_block_state`), and the order a selection is stored in. It works on the layer's own per-token arrays (`keys`,
    `values`, `positions`, `state`) and tells its extras about a hole (`on_reuse`), whose per-token rows of their own
    follow the slots."""

    keys: torch.Tensor | None  # the layer's per-token arrays and extras (see EvictingLayer)
    values: torch.Tensor | None
    positions: torch.Tensor | None
    state: dict[str, torch.Tensor]
    extras: dict[str, Any]
    decoding: bool
    ragged: bool  # RaggedStorage's: stored flat per head
    # RaggedStorage's: the heads' segments (FlatHeads) while the layer is ragged, else None; the padded view, its moves
    flat: Any
    padded: Any
    unpack: Any
    _keep_padded: Any

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reuse_slots = False  # set by the engine (GenerationSettings.slot_reuse)
        # ... and for ragged layers too where the policy allows it (Policy.ragged_slot_reuse; RaggedStorage.pack)
        self.reuse_ragged_slots = False
        self.chronological = True  # every head's slots are in position order
        # (b, h_kv, 1) the slot each head freed for the next token (ragged: its row within the head's segment)
        self.hole: torch.Tensor | None = None
        self.block_slots: torch.Tensor | None = None  # (b, h_kv, q) slots of the latest block; None: the last q
        # with `block_slots`: the K/V (b, h_kv, 1, d) `update` wrote there (block_kv's, not a copy gathered back)
        self.block_states: tuple[torch.Tensor, torch.Tensor] | None = None

    def _hole_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """(b, h_kv, 1) one slot per head -> (b*h_kv,) its rows of the flattened storage: (b*h_kv*n, ...) uniform, the
        flat (S, ...) per-head segments of a ragged layer (a slot counted from its head's first row)."""
        if self.flat is not None:
            return self.flat.start_rows + slots.flatten()
        return slot_rows(slots, self.keys.shape[-2])

    def _fill_hole(self, key_states: torch.Tensor, value_states: torch.Tensor, new_pos: torch.Tensor) -> bool:
        """`update`'s slot path: one new token per head (b, h_kv, 1, d) written into the hole its head freed, in place.
        False (nothing done) when there is no hole, or the block is not one token or a ragged layer's storage is
        shared with a fork (copy-on-write); a hole is then closed first."""
        hole = self.hole
        if hole is None:
            return False
        if key_states.shape[-2] != 1 or (self.flat is not None and not self.flat.writable):
            self._close_hole()
            return False
        rows = self._hole_rows(hole)  # (b*h_kv,)
        self.keys.view(-1, self.keys.shape[-1]).index_copy_(0, rows, key_states.reshape(-1, key_states.shape[-1]))
        self.values.view(-1, self.values.shape[-1]).index_copy_(0, rows,
                                                                value_states.reshape(-1, value_states.shape[-1]))
        self.positions.view(-1).index_copy_(0, rows, new_pos.reshape(-1))
        for s in self.state.values():  # policies fill the new token's state in the attention wrapper
            s.view(-1).index_fill_(0, rows, 0.0)
        self.hole, self.block_slots, self.block_states = None, hole, (key_states, value_states)
        self.chronological = False  # known without reading the device: the hole is rarely the last slot
        return True

    def _drop_one(self, idx: torch.Tensor) -> bool:
        """`keep`'s slot path: a decoding selection `idx` (b, h_kv, n - 1) of a uniform layer keeps all slots but one
        per head: that slot becomes the head's hole (position -1), nothing moves. False (nothing done) otherwise."""
        n = self.keys.shape[-2]
        if not (self.reuse_slots and self.decoding and self.hole is None and idx.shape[-1] == n - 1):
            return False
        # The dropped slot is the one idx lacks: sum(0..n-1) - sum(idx), exact in int64 (no read of the device).
        self._open_hole((n * (n - 1) // 2) - idx.sum(dim=-1, keepdim=True))  # (b, h_kv, 1)
        return True

    def _open_hole(self, hole: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Each head's slot `hole` (b, h_kv, 1) (its flat `rows` (b*h_kv,), if known) freed for the next token."""
        for extra in self.extras.values():
            extra.on_reuse(self, hole)
        self.positions.view(-1).index_fill_(0, self._hole_rows(hole) if rows is None else rows, -1)
        self.hole = hole

    def drop_position(self, position: int) -> bool:
        """Drop from every head the token at absolute `position`, which the caller knows each head holds (Policy.
        dropped_position): its slot becomes the head's hole, as `keep` leaves it (`_drop_one`, `_leave_holes`), found
        by one comparison instead of a padded view, a selection and its store. False (nothing done) where keep leaves
        none."""
        flat = self.flat
        if not (self.reuse_slots and self.decoding and self.hole is None and self.padded is None
                and (flat is None or (self.reuse_ragged_slots and flat.writable and not self.extras))):
            return False
        self._open_hole(*slots_at(self.positions, flat, position))
        return True

    def _close_hole(self) -> None:
        """Gather the held slots in position order (the hole left out): the chronological layout again."""
        if self.flat is not None:
            self._close_ragged_hole()
            return
        n = self.keys.shape[-2]
        keep = torch.ones(self.positions.shape, dtype=torch.bool, device=self.positions.device)
        keep.view(-1).index_fill_(0, slot_rows(self.hole, n), False)
        b, h = keep.shape[:2]
        idx = keep.view(-1, n).nonzero_static(size=b * h * (n - 1))[:, 1].view(b, h, n - 1)  # all but the hole
        self.hole = None
        self._gather(*in_position_order(self.positions, self.chronological, idx, None))

    def _orders_at_pack(self) -> bool:
        """Whether a selection of the padded view is put in position order when `pack` stores it (a policy that
        leaves holes, `reuse_ragged_slots`, and no extras, which see the kept slots in `keep`'s order), rather than
        in `keep` (`in_position_order`): a hole moves nothing, so its usual slide never sorts."""
        return self.reuse_ragged_slots and not self.extras

    def _leave_holes(self, view: PaddedView, sizes: list[int]) -> bool:
        """`pack`'s slot path (`reuse_ragged_slots`, Policy.ragged_slot_reuse): a decoding selection that keeps all
        of every head's tokens but one (`sizes`, read on the host, each one less than before), its K/V left flat,
        is stored by leaving the flat storage where it is, each head's dropped row its `hole` (position -1), which the
        next token is written into (SlotReuse._fill_hole): no K/V copied, where storing the kept rows copies the
        layer (SAGE-KV's slide, every step). The flat positions and state the view was built from are stored back
        (a selection moves no position; a state the selection set anew, as a new tensor, is laid out flat). False
        (nothing done) otherwise: extras (their own rows), a fork's shared storage."""
        if not (self.reuse_ragged_slots and self.reuse_slots and self.decoding and self.hole is None
                and view.rows is not None and not self.extras):
            return False
        if view.sizes is None:  # a uniform layer's selection with padding: every head one token less is SlotReuse's
            b, h, n = self.positions.shape
            if any(k != n - 1 for k in sizes):
                return False
            self.padded = None
            # view rows are slot + head * n (slot_rows); the kept slots come first (compact), padding after
            return self._drop_one((view.rows.view(b, h, -1) % n)[..., :n - 1])
        source = view.source
        if not (source is not None and source[0].writable and len(sizes) == len(view.sizes)
                and all(k == m - 1 for k, m in zip(sizes, view.sizes))):
            return False
        flat, keys, values = source
        positions, flat_state, padded_state = view.arrays
        b, h = flat.lengths.shape
        length = max(flat.sizes)  # the view's width
        kept = (view.rows.view(b, h, -1) % length).masked_fill(~view.valid, 0)  # (b, h, k) kept slots, padding 0
        n = flat.lengths  # (b, h)
        hole = (n * (n - 1) // 2 - kept.sum(dim=-1)).unsqueeze(-1)  # (b, h, 1): the real slot not kept (exact, int64)
        self.flat, self.padded, self.positions = flat, None, positions  # the flat positions (a selection moves none)
        self._open_hole(hole)
        state = {}
        for k, s in self.state.items():  # the flat state, unless the selection set a new one (SAGE-KV's pinned)
            if padded_state.get(k) is s:
                state[k] = flat_state[k]
                continue
            real = true_slots(flat.valid_slots(), sum(flat.sizes))  # (S,) view rows of every real slot
            new = s.reshape(-1).index_select(0, real)
            state[k] = s.new_zeros(keys.shape[0]).index_copy_(0, flat.view_rows(real), new)
        self.keys, self.values, self.state = keys, values, state
        return True

    def _close_ragged_hole(self) -> None:
        """A ragged layer's tokens without its holes, in position order, laid out anew (one copy of the layer): before
        an append a hole cannot take (a block of several tokens, a fork's shared storage). Through the padded view,
        where each hole is a slot of position -1, sorted after the real ones."""
        sizes = [n - 1 for n in self.flat.sizes]
        self.hole = None
        self.unpack()
        real = self.positions >= 0  # (b, h_kv, L)
        order = self.positions.masked_fill(~real, torch.iinfo(self.positions.dtype).max).argsort(dim=-1)
        self._keep_padded(order, real.gather(2, order), slot_rows(order, order.shape[-1]), sizes)

    # -- the block just appended (read and filled by the attention wrapper) -------------------------------------
    def block_kv(self, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (b, h_kv, q, d) of the latest q tokens of every head."""
        if self.block_slots is not None:  # one token per head, written into a hole (SlotReuse): the very K/V written
            return self.block_states
        if self.ragged:
            b, h = self.flat.lengths.shape
            idx = self._block_rows(q)
            return self.keys[idx].view(b, h, q, -1), self.values[idx].view(b, h, q, -1)
        return self.keys[..., -q:, :], self.values[..., -q:, :]

    def _block_rows(self, q: int) -> torch.Tensor:
        """(b*h_kv*q,) a ragged layer's flat rows of the latest q tokens of every head: each head's hole when the block
        was written into them (SlotReuse), else the last q of its segment."""
        if self.block_slots is not None:
            return self._hole_rows(self.block_slots)
        return self.flat.block_index(q).flatten()

    def set_block_state(self, name: str, new: torch.Tensor) -> None:
        """Write per-token state `new` (b, h_kv, q) of the latest q tokens (creating the state, zeros, if needed)."""
        if name not in self.state:
            self.state[name] = torch.zeros(self.positions.shape, dtype=torch.float32, device=self.positions.device)
        q = new.shape[-1]
        if self.ragged:
            self.state[name][self._block_rows(q)] = new.reshape(-1).to(self.state[name].dtype)
        elif self.block_slots is not None:
            self.state[name].scatter_(2, self.block_slots, new.to(self.state[name].dtype))
        else:
            self.state[name][..., -q:] = new

    def head_positions(self) -> torch.Tensor:
        """(b, h_kv, L) absolute positions per head (-1: padding, a hole); a copy when slots are reused, as they are
        then written in place (a trace keeps every step's)."""
        positions = super().head_positions()  # type: ignore[misc]
        written_in_place = self.reuse_slots and positions is not None and positions is self.positions
        return positions.clone() if written_in_place else positions

    def _gather(self, idx: torch.Tensor, valid: None = None) -> None:  # EvictingLayer's uniform keep
        raise NotImplementedError
