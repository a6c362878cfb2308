"""Ragged storage of an `EvictingLayer` (kvbench/engine/cache.py): the layouts a layer of per-head budgets (AdaKV,
CriticalKV on AdaKV, SAGE-KV) is stored and scored in, and the moves between them.

- Flat per head (`FlatHeads`), as AdaKV's own code stores it: the (batch, KV head) segments lie one after another,
  each in chronological order: keys/values (S, d), positions and state (S,), S the heads' total. No padding: each
  segment holds exactly its head's tokens, followed, with slot reuse (the default), by up to SLACK free rows that
  the next decoding steps write their tokens into in place, so a step that evicts nothing copies no K/V.
- The padded scoring view (`PaddedView`), (b, h_kv, L): each head's tokens first, then padding (`valid` False,
  position -1, zero K/V). Policies always score this view: the layer builds it from the flat storage at eviction
  time (`unpack`) and stores the view's kept slots again (`keep`, `pack`), flat or uniform, so it is never held
  across a forward. Storing a selection that changes head sizes needs them on the host: the view keeps the
  selection pending (`PaddedView.rows`) until the engine reads every layer's sizes with the step's token, one host
  read (`EvictingCache.settle`).
- Holes (`Policy.ragged_slot_reuse`, SAGE-KV's slide): a decoding selection dropping exactly one token of every head
  leaves the flat storage in place, each head's dropped row its hole (position -1) that the next token is written
  into (SlotReuse, kvbench/engine/slots.py): the segments then hold their tokens out of position order.

The layouts are replaced, never modified, so a forked layer (`EvictingLayer.fork`, a shallow copy) shares them;
the free rows of the arrays both then hold are written by neither (copy-on-write: `FlatHeads.shared`).
`RaggedStorage`, a base class of `EvictingLayer`, holds them and makes the moves on the layer's arrays.
"""

from __future__ import annotations

from typing import Any

import torch

SLACK = 16  # free rows after each head's segment when the flat storage is laid out (see FlatHeads)


class FlatHeads:
    """Where each (batch, KV head)'s tokens lie in a layer's flat storage: `lengths` (b, h_kv) on the device and
    `sizes`, the same counts on the host in segment (row-major) order: every forward needs them (split sizes, the
    longest head) and reading `lengths` would make the host wait for the device (a sync per read on a GPU).

    Head i's segment starts at row `starts[i]` (host; `start_rows` the same on the device) and has room for `caps[i]`
    rows, its `sizes[i]` tokens first. A layout built by a copy anyway (a prompt block's append, an eviction's `pack`)
    leaves `slack` free rows after each segment (`laid_out`; SLACK with slot reuse), so the next decoding steps write
    their tokens into them in place (`room`, `grown`): a step that evicts nothing copies no K/V (without them: a
    concatenation of the whole layer per step, ~9 % of AdaKV's profiled decoding on the CPU). Free rows hold leftovers
    that nothing reads: every reader takes a head's `sizes[i]` rows from its start (`views`, `pad`, `block_index`).
    `writable` False: the storage is shared with a fork (copy-on-write: the next append lays the layer out anew
    instead of writing into it)."""

    def __init__(self, lengths: torch.Tensor, sizes: list[int], starts: list[int], caps: list[int],
                 start_rows: torch.Tensor, writable: bool = True) -> None:
        self.lengths, self.sizes = lengths, sizes
        self.starts, self.caps, self.start_rows, self.writable = starts, caps, start_rows, writable
        self._live: torch.Tensor | None = None  # see live_rows

    def live_rows(self, total: int) -> torch.Tensor:
        """(total,) bool over the flat storage's `total` rows: those of a head's tokens (a hole included), not the free
        rows with their leftovers. Built once per layout (a decoding step that fills a hole keeps the layout)."""
        if self._live is None or self._live.shape[0] != total:
            self._live = torch.zeros(total, dtype=torch.bool, device=self.lengths.device)
            for s, n in zip(self.starts, self.sizes):
                self._live[s:s + n] = True
        return self._live

    @staticmethod
    def laid_out(lengths: torch.Tensor, sizes: list[int], slack: int = SLACK) -> FlatHeads:
        """The layout of a copy that writes the segments one after another, each followed by `slack` free rows
        (slack 0: compact)."""
        starts, at = [], 0
        for n in sizes:
            starts.append(at)
            at += n + slack
        room = lengths.flatten() + slack  # (b*h_kv,) each segment's rows, free ones included
        start_rows = room.cumsum(0) - room  # on the device too: block_index adds the lengths there
        return FlatHeads(lengths, sizes, starts, [n + slack for n in sizes], start_rows)

    def shared(self) -> FlatHeads:
        """The same layout, read-only (`fork`: both layers hold the same tensors)."""
        return FlatHeads(self.lengths, self.sizes, self.starts, self.caps, self.start_rows, writable=False)

    def room(self, q: int) -> bool:
        """Whether every head can take `q` more tokens in place."""
        return self.writable and all(n + q <= c for n, c in zip(self.sizes, self.caps))

    def grown(self, q: int) -> FlatHeads:
        """The layout after `q` tokens are written in place after every head's tokens (`room(q)`)."""
        return FlatHeads(self.lengths + q, [n + q for n in self.sizes], self.starts, self.caps, self.start_rows)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each head's rows (n_i, ...) of the flat storage, row-major: views, no copy."""
        return [flat[s:s + n] for s, n in zip(self.starts, self.sizes)]

    def append(self, flat: torch.Tensor, new: torch.Tensor, q: int, slack: int = SLACK) -> torch.Tensor:
        """Flat storage with `q` new rows (len(sizes) * q, ...) after each head's tokens, laid out anew with `slack`
        free rows after each segment (the `laid_out` layout of the grown sizes): one copy of the layer."""
        parts: list[torch.Tensor] = []
        gap = flat.new_zeros(slack, *flat.shape[1:])
        for o, n in zip(self.views(flat), new.split(q)):
            parts += [o, n, gap]
        return torch.cat(parts)

    def block_index(self, q: int) -> torch.Tensor:
        """(b*h_kv, q) flat indices of each head's latest q tokens."""
        ends = self.start_rows + self.lengths.flatten()  # (b*h_kv,)
        return (ends - q).unsqueeze(-1) + torch.arange(q, device=ends.device)

    def valid_slots(self) -> torch.Tensor:
        """(b, h_kv, L) bool: the padded view's real slots, L the longest head."""
        return torch.arange(max(self.sizes), device=self.lengths.device) < self.lengths.unsqueeze(-1)

    def pad(self, flat: torch.Tensor, fill: float, segments: list[int] | None = None) -> torch.Tensor:
        """Flat rows (S, ...) -> (b, h_kv, L, ...), the padded view's layout: each head's rows followed by `fill` up
        to L, the longest head. The rows are the layout's own (`segments` None: the layer's storage) or compact
        segments of `segments` rows (an extra's own rows). One concatenation of views (a single copy of the data):
        ~3x cheaper on CPU than scattering the rows with index_copy_ (measured: 3072 rows of 64 floats, 0.034 vs
        0.113 ms)."""
        b, h = self.lengths.shape
        length = max(self.sizes)
        parts_of = self.views(flat) if segments is None else flat.split(segments)
        segments = self.sizes if segments is None else segments
        pad = flat.new_full((length - min(segments), *flat.shape[1:]), fill)
        parts: list[torch.Tensor] = []
        for seg, n in zip(parts_of, segments):
            parts += [seg, pad[:length - n]]
        return torch.cat(parts).view(b, h, length, *flat.shape[1:])

    def view_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows (S,) of the padded view's flattened (b * h_kv * L) arrays -> (S,) the same tokens' rows of the flat
        storage: view row r is row r % L of head r // L's segment."""
        length = max(self.sizes)
        return self.start_rows.index_select(0, rows // length) + rows % length

    def padded_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """(b, h_kv, L) the flat positions per head, padded at the end with -1 (a copy)."""
        return self.pad(positions, -1)

    def gapped_rows(self, rows: torch.Tensor, slack: int = SLACK) -> torch.Tensor:
        """`rows` (S,) of a selection, each head's `sizes[i]` in turn -> (S + len(sizes) * slack,): the same rows in
        the `laid_out` layout, each head's followed by `slack` placeholders (row 0: any row; never read). One
        concatenation of views, split by the host's sizes (~2x cheaper on CPU than scattering by a device-side head
        index: 3 heads, 3072 rows, ~40 vs 81 us)."""
        gap = rows.new_zeros(slack)
        parts: list[torch.Tensor] = []
        for seg in rows.split(self.sizes):
            parts += [seg, gap]
        return torch.cat(parts)


class PaddedView:
    """A layer's padded scoring view (b, h_kv, L): `valid` its real slots; `sizes` the head sizes of the flat storage
    it was built from (host; None when a uniform layer's selection made it); `rows` a selection of `keep` not stored
    yet: rows (flattened, padding included) of the view's arrays that it keeps (None: nothing kept since); `source`
    the flat layout and K/V it was built from when K/V were left flat (`unpack(kv=False)`), else None; `arrays` then
    the flat positions and per-token state it was built from and the padded state it made of them (a selection that
    leaves holes stores the flat ones back, SlotReuse._leave_holes)."""

    def __init__(self, valid: torch.Tensor, sizes: list[int] | None = None, rows: torch.Tensor | None = None,
                 source: tuple[FlatHeads, torch.Tensor, torch.Tensor] | None = None,
                 arrays: tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None) -> None:
        self.valid, self.sizes, self.rows, self.source, self.arrays = valid, sizes, rows, source, arrays

    def selected(self, idx: torch.Tensor, valid: torch.Tensor | None, rows: torch.Tensor) -> PaddedView:
        """The view once `keep` selects its slots `idx` (b, h_kv, k), `valid` marking padding of the selection."""
        base = self.valid.gather(2, idx)
        return PaddedView(base if valid is None else base & valid, self.sizes, rows, self.source, self.arrays)

    def kept_counts(self) -> torch.Tensor:
        """(b * h_kv,) tokens each head keeps, row-major."""
        return self.valid.sum(dim=-1).flatten()

    def stored_rows(self, sizes: list[int] | None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """What storing the view keeps: the rows (S,) of its flattened (b * h_kv * L) arrays (the kept real slots,
        in order), the counts (b, h_kv) per head and their host `sizes` (read here when not given: one host read)."""
        counts = self.valid.sum(dim=-1)  # (b, h_kv)
        if sizes is None:
            sizes = counts.flatten().tolist()  # the one host read of a selection: the layout and the split sizes
        rows = true_slots(self.valid, sum(sizes))  # (S,): the real slots, as valid's boolean mask takes them
        if self.rows is not None:  # `keep`'s selection and the real slots of it: one copy of every tensor
            rows = self.rows.index_select(0, rows)
        return rows, counts, sizes


def rows_in_position_order(rows: torch.Tensor, positions: torch.Tensor, seen: int) -> torch.Tensor:
    """Kept rows (S,) of a padded view's flattened (b * h_kv * L) arrays, each head's together, reordered by position
    within each head: `positions` (b, h_kv, L) the view's, distinct per head and below `seen`."""
    length = positions.shape[-1]
    key = (rows // length) * (seen + 1) + positions.reshape(-1).index_select(0, rows)
    return rows.index_select(0, key.argsort())


def true_slots(valid: torch.Tensor, count: int) -> torch.Tensor:
    """(count,) flat indices of the True slots of `valid`, in row-major order, `count` their number known on the
    host: boolean-mask indexing would ask the device for it (a host sync on a GPU), nonzero_static does not."""
    return valid.reshape(-1).nonzero_static(size=count).squeeze(-1)


class RaggedStorage:
    """The ragged half of an `EvictingLayer` (a base class of it): the flat per-head storage (`flat`) and the padded
    scoring view (`padded`), and the moves between them and the uniform layout. It works on the layer's own per-token
    arrays (`keys`, `values`, `positions`, `state`) and calls its extras' hooks (`on_keep`, `on_unpack`, `on_pack`)."""

    keys: torch.Tensor | None  # the layer's per-token arrays and extras (see EvictingLayer)
    values: torch.Tensor | None
    positions: torch.Tensor | None
    state: dict[str, torch.Tensor]
    extras: dict[str, Any]
    reuse_slots: bool  # SlotReuse's: decoding writes in place (here: into free rows; else every append a copy)
    chronological: bool  # SlotReuse's: every head's tokens in position order
    _leave_holes: Any  # SlotReuse's: a selection of one token per head stored as holes
    _orders_at_pack: Any  # SlotReuse's: whether `pack` puts a selection in position order
    seen: int  # EvictingLayer's: tokens ever appended

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.flat: FlatHeads | None = None  # the heads' segments while stored flat per head (ragged)
        self.padded: PaddedView | None = None  # the padded scoring view's bookkeeping while the layer is in it
        # Set by the engine: a selection that changes head sizes waits in the padded view until the engine reads the
        # sizes of every such layer in one host read (with the decoded token) and calls `pack(sizes)`.
        self.defer_pack = False
        # (seen, k, (b, h_q, L)): the mean over the last forward's latest k queries of their attention probabilities
        # per query head, in the padded view's layout, when that forward computed them (`ragged_attention`, asked by
        # `Policy.attention_rows`); `seen` then: stale once the layer saw more, dropped when a selection is kept
        self.forward_rows: tuple[int, int, torch.Tensor] | None = None

    @property
    def ragged(self) -> bool:
        """True when stored flat per head (heads hold different numbers of tokens)."""
        return self.flat is not None

    @property
    def uniform(self) -> bool:
        """True when stored uniform: neither flat per head nor in the padded view."""
        return self.flat is None and self.padded is None

    @property
    def kv_heads(self) -> int:
        """KV heads per batch row, whatever the storage (flat per head, the keys are (S, d)); 0 while empty."""
        if self.flat is not None:
            return self.flat.lengths.shape[1]
        return self.keys.shape[1] if self.keys is not None else 0

    @property
    def lengths(self) -> torch.Tensor | None:
        """(b, h_kv) tokens per head of a ragged layer (None otherwise)."""
        return self.flat.lengths if self.flat is not None else None

    @property
    def head_sizes(self) -> list[int] | None:
        """A ragged layer's `lengths` on the host, row-major (None otherwise)."""
        return self.flat.sizes if self.flat is not None else None

    @property
    def valid(self) -> torch.Tensor | None:
        """(b, h_kv, L) bool real slots while in the padded view (None otherwise)."""
        return self.padded.valid if self.padded is not None else None

    def _append_flat(self, key_states: torch.Tensor, value_states: torch.Tensor, new_pos: torch.Tensor) -> None:
        """A ragged layer's `update`: the block (b, h_kv, q, ...) after every head's tokens: written in place into
        the heads' free rows when each has room (a decoding step), else the layer laid out anew (FlatHeads)."""
        b, h, q, d = key_states.shape
        flat = self.flat
        new = {"keys": key_states.reshape(b * h * q, d), "values": value_states.reshape(b * h * q, -1),
               "positions": new_pos.reshape(-1)}
        if flat.room(q):
            grown = flat.grown(q)
            rows = grown.block_index(q).flatten()  # (b*h*q,) the free rows after each head's tokens
            for name, block in new.items():
                getattr(self, name).index_copy_(0, rows, block)
            for s in self.state.values():  # policies fill the new tokens' state in the attention wrapper
                s.index_fill_(0, rows, 0.0)
            self.flat = grown
            return
        slack = self._slack()
        for name, rows in new.items():
            setattr(self, name, flat.append(getattr(self, name), rows, q, slack))  # (S + b*h*(q + slack), ...)
        self.state = {k: flat.append(s, s.new_zeros(b * h * q), q, slack) for k, s in self.state.items()}
        self.flat = FlatHeads.laid_out(flat.lengths + q, [n + q for n in flat.sizes], slack)

    def _slack(self) -> int:
        """Free rows a layout leaves after each head: SLACK where decoding writes in place (`reuse_slots`,
        GenerationSettings.slot_reuse), else none (every append concatenates the layer anew, as before)."""
        return SLACK if self.reuse_slots else 0

    def head_positions(self) -> torch.Tensor:
        """(b, h_kv, L) absolute positions per head; for a ragged layer padded at the end with -1 (a copy)."""
        return self.flat.padded_positions(self.positions) if self.ragged else self.positions

    def padded_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A ragged layer's keys and values, (b, h_kv, L, d), each head's tokens first and zeros after (the padded
        view's layout), for one attention over all heads at once; the storage stays flat."""
        return self.flat.pad(self.keys, 0), self.flat.pad(self.values, 0)

    def unpack(self, kv: bool = True) -> None:
        """Ragged layers: replace the flat storage by the padded (b, h_kv, L) scoring view (see the module doc).
        `kv` False: the selection reads no K/V (`Policy.needs_kv`: SAGE-KV's sliding window reads positions and its
        pinned state only), so K/V stay flat and the view's `keys`/`values` are stand-ins of the padded shape (row 0
        repeated: a view, no copy, never to be read); `pack` takes the kept rows from the flat K/V, the very rows the
        padded copies would hold. Saves padding K/V (a copy of the layer) per eviction."""
        flat = self.flat
        if flat is None:
            return
        if kv:
            view = PaddedView(flat.valid_slots(), flat.sizes)  # (b, h_kv, L)
            self.keys, self.values = self.padded_kv()
        else:
            view = PaddedView(flat.valid_slots(), flat.sizes, source=(flat, self.keys, self.values))
            (b, h), length = flat.lengths.shape, max(flat.sizes)
            self.keys = self.keys[:1].view(1, 1, 1, -1).expand(b, h, length, -1)  # (b, h_kv, L, d) stand-ins
            self.values = self.values[:1].view(1, 1, 1, -1).expand(b, h, length, -1)
        flat_positions, flat_state = self.positions, self.state
        self.positions = flat.pad(self.positions, -1)
        self.state = {k: flat.pad(s, 0) for k, s in self.state.items()}
        if not kv:
            view.arrays = (flat_positions, flat_state, dict(self.state))
        self.flat, self.padded = None, view
        for extra in self.extras.values():  # their flat rows (S, ...) in segments of their own -> the view's layout
            extra.on_unpack(self, view.sizes, lambda rows, segments, fill: flat.pad(rows, fill, segments))

    def head_keys(self) -> list[torch.Tensor] | None:
        """In the padded view of a ragged layer whose K/V were left flat (`unpack(kv=False)`): each (batch, KV head)'s
        real keys (n_i, d), row-major, in the view's slot order (position order while `chronological`; views of the
        flat storage, no copy), for attention over each head's own keys; None otherwise (the view's `keys` are the
        real ones, or the layer is not in the view)."""
        if self.padded is None or self.padded.source is None:
            return None
        flat, keys, _ = self.padded.source
        return flat.views(keys)

    def _keep_padded(self, idx: torch.Tensor, valid: torch.Tensor | None, rows: torch.Tensor,
                     sizes: list[int] | None = None) -> None:
        """`keep` of the slots `idx` (b, h_kv, k) of a padded view, or of a uniform layer with padding `valid` (it turns
        ragged): `rows` (b*h_kv*k,) the flattened rows they select. `pack` copies K/V, positions and state once, at
        `rows` restricted to the real kept slots (and hands those rows to the extras, `on_pack`, which copy their
        own), now or, with `defer_pack`, when the engine has read the new head sizes (`sizes`: known already, stored
        now)."""
        for extra in self.extras.values():
            extra.on_keep(self, idx, True)
        self.forward_rows = None  # over the slots before this selection
        if self.padded is not None:
            self.padded = self.padded.selected(idx, valid, rows)
        else:
            self.padded = PaddedView(valid, rows=rows)
        self.pack(sizes)

    def pack(self, sizes: list[int] | None = None) -> None:
        """Store the padded view's real slots (after `keep`: the kept ones): uniform layout if every head holds as
        many tokens, else flat. `sizes`: each (batch, KV head)'s count, row-major, read by the caller (the engine
        reads every pending layer's with the decoded token, `EvictingCache.settle`); None: the view's own sizes
        when nothing was kept since `unpack` (known on the host), else read here (one host sync). With
        `defer_pack` set, a selection of `keep` waits for the engine: a call without sizes leaves it pending."""
        view = self.padded
        if view is None:
            return
        if sizes is None:
            if view.rows is None and view.sizes is not None:
                sizes = view.sizes  # nothing kept since unpack: the flat storage as it was
            elif self.defer_pack:
                return  # pending: settled by the engine with the sizes it reads together with the token
            else:
                sizes = view.kept_counts().tolist()  # one host read
        if self._leave_holes(view, sizes):
            return
        self.padded = None
        rows, counts, sizes = view.stored_rows(sizes)
        if view.rows is not None:  # a selection, stored in position order (`keep` ordered it, else here)
            if not self.chronological and self._orders_at_pack():
                rows = rows_in_position_order(rows, self.positions, self.seen)
            self.chronological = True
        uniform = min(sizes) == max(sizes)
        for extra in self.extras.values():  # their own rows, stored alike (compact)
            extra.on_pack(rows, (*counts.shape, sizes[0]) if uniform else None)
        slack = self._slack()
        flat = None if uniform else FlatHeads.laid_out(counts, list(sizes), slack)
        if flat is not None and slack:  # the layer's own rows with free rows after each head's (FlatHeads)
            rows = flat.gapped_rows(rows, slack)
        d = self.keys.shape[-1]
        if view.source is None:
            self.keys = self.keys.reshape(-1, d).index_select(0, rows)
            self.values = self.values.reshape(-1, self.values.shape[-1]).index_select(0, rows)
        else:  # K/V left flat (unpack(kv=False)): the kept view rows' flat rows
            source, keys, values = view.source
            flat_rows = source.view_rows(rows)  # (S',)
            self.keys, self.values = keys.index_select(0, flat_rows), values.index_select(0, flat_rows)
        self.positions = self.positions.reshape(-1).index_select(0, rows)
        self.state = {k: s.reshape(-1).index_select(0, rows) for k, s in self.state.items()}
        if uniform:  # the fast uniform path again
            b, h = counts.shape
            n = sizes[0]
            self.keys, self.values = self.keys.view(b, h, n, d), self.values.view(b, h, n, -1)
            self.positions = self.positions.view(b, h, n)
            self.state = {k: s.view(b, h, n) for k, s in self.state.items()}
        self.flat = flat

    def pending(self) -> bool:
        """True while a selection of `keep` waits for its head sizes (`defer_pack`; see pack)."""
        return self.padded is not None and self.padded.rows is not None
