"""SnapKV's observation window kept incrementally: `WindowRing`, the per-layer state behind
`window_attention(layer)` (SnapKV, PyramidKV, AdaKV and CriticalKV on either).

The window attention is the mean over the w stashed queries of their attention probabilities over the slots,
`query_attention(layer).mean(dim=-2)`. Recomputing it costs a (g * w x d) by (d x n) product, its softmax and mean
per KV head at every eviction; while decoding only one query is new per step. The ring keeps, per token, the
probability each stashed query gave it when that query's row was computed (`probs`, g * w floats per token and KV
head, in a ring of w slots), so a decoding step computes one new row and renormalises the older ones over the slots
still held (see `WindowRing.attention`).

The rows are per-token state of the ring's own: the layer holds the ring in `layer.extras` (a `LayerExtra`) and
calls its hooks where its storage changes (`on_keep`, `on_unpack`, `on_pack`, `fork`), so the rows are pruned,
padded and stored with the tokens like their keys. Appending tokens calls nothing: every query with a row is
earlier than a new token and does not see it, so its entries are zeros, added when the rows are next needed. On a
uniform layer an eviction prunes the rows lazily too (`sel`): the copy waits for the next scoring, so a prompt block
whose queries replace every row never copies the old ones, and a decoding step makes one copy (pruning and
appending together).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Callable

import torch

from kvbench.policies.base import attention_probs, query_attention

if TYPE_CHECKING:
    from kvbench.policies.layer import CacheLayer


def window_attention(layer: CacheLayer) -> torch.Tensor:
    """(b, h_q, n) float32: the mean over the stashed queries (`query_attention(layer)`'s rows) of their attention
    probabilities over the slots, `query_attention(layer).mean(dim=-2)`: SnapKV's observation window, kept
    incrementally by the layer's `WindowRing` (in `layer.extras`, created on first use; a decoding step adds the new
    query's row), so call it in place of that recomputation; equal to it up to float rounding
    (tests/test_window_state.py). `layer` uniform or in its padded scoring view."""
    if layer.keys.dim() != 4:  # (S, d): a ragged layer's flat storage
        raise RuntimeError("window_attention() reads the scoring view; unpack() the ragged layer first")
    return WindowRing.of(layer).attention(layer)


def forward_rows(layer: CacheLayer, k: int) -> torch.Tensor | None:
    """(b, h_q, n): the mean over the latest k queries of their attention probabilities as the last forward computed
    them (`layer.forward_rows`, a ragged layer's per-head attention: `Policy.attention_rows`), if it holds them for k
    and the slots held now; None otherwise. Taken once. The same values as query_attention(layer, mean=True) over
    those queries: the same products and softmax per head (tests/test_window_state.py)."""
    given, layer.forward_rows = layer.forward_rows, None
    if given is None:
        return None
    seen, rows, probs = given
    return probs if seen == layer.seen and rows == k and probs.shape[-1] == layer.keys.shape[2] else None


class WindowRing:
    """One layer's incremental window attention (a `LayerExtra`, held in `layer.extras[WindowRing.key]`).

    `probs` (None until a row is kept): per token, (b, h_kv, n, g * w) uniform / (S, g * w) ragged (flat per head, as
    the layer stores its keys) / (b, h_kv, L, g * w) in the padded view, the probability the stashed query in ring
    slot r (of w) of each query head of the group gave the token when that query's row was computed; zero where the
    query does not see the token (later tokens, padding). Host bookkeeping, in absolute positions: `rows`, `exact`,
    `base` (see __init__). The tokens appended since the rows were last complete are counted, not tracked: the layer
    holds that many more slots than `probs` (or `sel`) has rows, and their entries are zeros.
    """

    key = "window_attention"  # the ring's name in `layer.extras`
    # The rows are a cache of what the layer's stashed queries, keys and positions determine (`attention` recomputes
    # them whenever `probs` is None): a layer stack (kvbench/engine/stack.py) may drop its members' rings and keep one
    # of its own over all its rows (`LayerExtra.stackable`)
    stackable = True

    def __init__(self) -> None:
        self.probs: torch.Tensor | None = None
        self.rows = 0  # stashed queries at positions < this have their row computed
        self.exact = 0  # rows of queries at positions >= this were computed over exactly the slots held now
        self.base = 0  # the query at position p sits in ring slot (p - base) % w
        # Evictions of a uniform layer prune `probs` lazily: (b, h_kv, m) rows of `probs` (flattened) that the slots
        # held at the latest eviction have, -1 for zeros; applied (one copy) when the next scoring needs the rows, so
        # a prompt block whose queries replace every row never copies the old ones. None: `probs` as it is.
        self.sel: torch.Tensor | None = None
        self.sel_zeros = False  # `sel` may hold -1 (tokens appended, then kept, before any scoring)
        # (b, h_kv, g, w) each ring slot's row summed over the slots held (None: not known, summed when next needed).
        # Kept up to date through slot reuse (a freed slot's entries subtracted) and new rows (their own sums), so a
        # decoding step does not read every stored row once more only to renormalise them.
        self.mass: torch.Tensor | None = None

    @classmethod
    def of(cls, layer: CacheLayer) -> WindowRing:
        """The layer's ring, created (empty) on first use."""
        ring = layer.extras.get(cls.key)
        if ring is None:
            ring = layer.extras[cls.key] = cls()
        return ring

    # -- the window attention --------------------------------------------------------------------------------------
    def attention(self, layer: CacheLayer) -> torch.Tensor:
        """(b, h_q, n) float32: the mean over the stashed queries of their attention probabilities over the slots,
        `query_attention(layer).mean(dim=-2)` (padding and keys a query does not see weigh 0), kept incrementally.
        `layer` is uniform or in its padded view (never flat per head).

        When every stashed query is new (a prompt block of at least w tokens, the one-pass prompt, the first call) it
        is computed exactly as query_attention computes it; while decoding (or when fewer than w queries were stashed
        so far) each query's row of probabilities is then stored (`probs`, token-major, in a ring of w slots):
        prompt blocks of at least w tokens keep nothing, the next block replaces every row anyway. Afterwards a
        forward of k < w tokens computes only its k new rows (query_attention's arithmetic on those queries), written
        over the ring slots of the k queries that left the window. The older rows need no new entry (a new key is
        later than every older query, which does not see it) but have lost the slots evicted since they were computed:
        their probabilities are renormalised over the slots still held, p / sum(p), the softmax over fewer keys (the
        same values up to float rounding: a different order of the sums, one division more). sum(p) is kept per row
        (`mass`): its sum when written, less the entries of each slot freed since (slot reuse), summed again over the
        slots after any other eviction. A decoding step thus costs one (g x d) by (d x n) product per KV head and one
        pass over the g * w * n stored probabilities (with slot reuse), where recomputing costs the (g * w x d) by
        (d x n) product, its softmax and mean.
        Stashed positions with a gap (a forward that stashed nothing) or per-block queries (window < 0) have no ring:
        then it is the plain computation, every time.
        """
        w, first = layer.stash.window, layer.stash.first
        if w <= 0 or first is None or layer.stash.queries is None:
            self.probs, self.sel, self.sel_zeros, self.mass = None, None, False, None
            return query_attention(layer, mean=True)
        b, h_q = layer.stash.queries.shape[:2]
        h_kv, n = layer.keys.shape[1], layer.keys.shape[2]
        g = h_q // h_kv
        seen = layer.seen
        count = seen - first  # stashed queries, at positions first .. seen - 1
        fresh = max(first, self.rows)  # the queries from position `fresh` on have no row yet
        if self.probs is None or self.probs.shape[-1] != g * w or fresh == first:
            self.sel, self.sel_zeros, self.mass = None, False, None  # the old rows are all replaced: never copied
            if not layer.decoding and count == w:
                # A prompt block of at least w tokens: the next block replaces every row again, so none is kept (the
                # first decoding step computes them once). Under prefill_once nothing is held after the prompt.
                self.probs = None
                given = forward_rows(layer, w)
                return given if given is not None else query_attention(layer, mean=True)
            probs = query_attention(layer)  # (b, h_q, count, n): every stashed query is new
            rows = probs.view(b, h_kv, g, count, n).permute(0, 1, 4, 2, 3)  # (b, h_kv, n, g, count)
            if count == w:  # ring slot i <- the i-th stashed query (base = first)
                self.probs = rows.reshape(b, h_kv, n, g * w)
            else:  # fewer queries than the window so far: the other slots empty
                wp = probs.new_zeros(b, h_kv, n, g, w)
                wp[..., :count] = rows
                self.probs = wp.view(b, h_kv, n, g * w)
            self.base, self.rows, self.exact = first, seen, first
            return probs.mean(dim=-2)
        self._apply_pending(layer)  # the kept rows, and zeros for the tokens appended since: one copy
        wp = self.probs.view(b, h_kv, n, g, w)  # written in place: the new rows
        new = seen - fresh
        if new > 0:
            given = forward_rows(layer, 1) if new == 1 else None  # the forward's own row of the new query
            rows = given.unsqueeze(2) if given is not None else \
                self._query_rows(layer, layer.stash.queries[:, :, count - new:], fresh)  # (b, h_q, new, n)
            src = rows.view(b, h_kv, g, new, n).permute(0, 1, 4, 2, 3)  # (b, h_kv, n, g, new)
            sums = rows.view(b, h_kv, g, new, n).sum(dim=-1) if self.mass is not None else None  # (b, h_kv, g, new)
            done = 0
            for lo, hi in self._ring_runs(fresh, seen, w):
                wp[..., lo:hi] = src[..., done:done + hi - lo]
                if sums is not None:
                    self.mass[..., lo:hi] = sums[..., done:done + hi - lo]
                done += hi - lo
            self.rows = seen
        if self.mass is None:
            self.mass = wp.sum(dim=2)  # (b, h_kv, g, w): one pass over the rows, then kept up to date
        # Per ring slot: rows computed before the latest eviction are renormalised over the slots held (1 / their
        # remaining mass); rows computed since are already a softmax over exactly these slots (1: their values as
        # query_attention computes them); slots no stashed query holds (fewer than w stashed) weigh 0.
        scale = self.mass.reciprocal()  # (b, h_kv, g, w)
        for lo, hi in self._ring_runs(max(first, self.exact), seen, w):
            scale[..., lo:hi] = 1.0
        for lo, hi in self._ring_runs(seen, first + w, w):
            scale[..., lo:hi] = 0.0
        # The scaled sum over each query head's w rows as one product with a block-diagonal (g x g*w) matrix of the
        # scales: it reads the stored rows once and writes (b, h_q, n) directly (a product then a sum over w would
        # write and read a temporary as large as the rows; the zeros of the other heads add exactly nothing). The
        # rows as the right operand, transposed: the other orientation, (n x g*w) by (g*w x g), ran ~1.8x faster on
        # random rows but 2.6x slower in SnapKV's real decoding (15.7 against 6.1 ms a step, one CPU thread), whose
        # far tokens' probabilities are subnormal floats, slow in that kernel (4x on rows with a fifth subnormal)
        blocks = scale.new_zeros(b, h_kv, g, g, w)
        blocks.diagonal(dim1=2, dim2=3).copy_(scale.transpose(-1, -2))  # (b, h_kv, w, g) view of the diagonal
        mean = torch.bmm(blocks.view(b * h_kv, g, g * w), self.probs.view(b * h_kv, n, g * w).transpose(1, 2))
        return mean.view(b, h_q, n) / count  # (b, h_q, n)

    def _ring_runs(self, start: int, end: int, w: int) -> list[tuple[int, int]]:
        """The ring slots (of w) of the queries at positions start .. end - 1 (at most w of them), as at most two
        runs."""
        if end <= start:
            return []
        lo = (start - self.base) % w
        hi = lo + (end - start)
        return [(lo, hi)] if hi <= w else [(lo, w), (0, hi - w)]

    @staticmethod
    def _query_rows(layer: CacheLayer, query: torch.Tensor, first: int) -> torch.Tensor:
        """(b, h_q, k, n) attention probabilities of `query` (b, h_q, k, d), the stashed queries at positions first ..
        first + k - 1, over the slots: query_attention's arithmetic on k of its rows (policies.base.attention_probs)."""
        k = query.shape[2]
        return attention_probs(layer, query, torch.arange(first, first + k, device=query.device), first)

    # -- the lazy pruning ------------------------------------------------------------------------------------------
    def _pending_selection(self, layer: CacheLayer) -> torch.Tensor:
        """(b, h_kv, n) the rows of `probs` (flattened; -1: zeros) of the slots held now (uniform layer); notes in
        `sel_zeros` when there are zeros."""
        wp = self.probs
        b, h, m, _ = wp.shape
        sel = self.sel
        if sel is None:
            sel = torch.arange(b * h * m, device=wp.device).view(b, h, m)
        new = layer.keys.shape[2] - sel.shape[-1]  # tokens appended since: later than every query with a row, zeros
        if new == 0:
            return sel
        self.sel_zeros = True
        return torch.cat([sel, sel.new_full((b, h, new), -1)], dim=-1)

    def _apply_pending(self, layer: CacheLayer) -> None:
        """Make `probs` hold exactly the slots held now: the pending lazy pruning applied, and zeros for the tokens
        appended since it was last complete (every query with a row is earlier than them and does not see them).
        Deferred to the next scoring, so a cache that stops scoring (decoding under prefill_once) pays nothing per
        step, and one decoding step costs one copy of the rows (pruning and appending together). A no-op in the
        padded view (`on_unpack` pads a ragged layer's pending entries with zeros itself)."""
        wp, sel = self.probs, self.sel
        if wp is None:
            return
        # appended since: their rows are zeros (counted in slots: a token written into a freed slot has its row)
        new = layer.keys.shape[2] - (wp.shape[2] if sel is None else sel.shape[-1])
        if sel is None and new == 0:
            return
        b, h, _, r = wp.shape
        if sel is None:  # nothing evicted since: append the zeros
            self.probs = torch.cat([wp, wp.new_zeros(b, h, new, r)], dim=2)
        else:
            self.mass = None  # rows lost slots: summed again when next needed
            m = sel.shape[-1]
            rows = sel.clamp_min(0) if self.sel_zeros else sel
            if new:  # any row as a placeholder for the appended tokens, zeroed below
                rows = torch.cat([rows, rows[..., :1].expand(b, h, new)], dim=-1)
            out = wp.reshape(-1, r).index_select(0, rows.reshape(-1)).view(b, h, m + new, r)
            if new:
                out[:, :, m:] = 0.0
            if self.sel_zeros:  # kept tokens that were appended before the previous eviction
                out[:, :, :m].masked_fill_((sel < 0).unsqueeze(-1), 0.0)
            self.probs = out
        self.sel, self.sel_zeros = None, False

    # -- the layer's hooks (LayerExtra) ----------------------------------------------------------------------------
    def on_keep(self, layer: CacheLayer, idx: torch.Tensor, packed: bool) -> None:
        """The layer keeps the slots `idx` (b, h_kv, k). Uniform before and after (`packed` False): the rows are
        pruned lazily (`sel`, applied by the next scoring). Else (`on_pack` copies the rows with the layer's): every
        row computed so far loses slots, and the pending pruning is applied first, in the layout the rows follow."""
        if self.probs is None:
            return
        self.mass = None  # every row loses slots: summed again when next needed
        if packed:
            self._apply_pending(layer)
            self.exact = self.rows
            return
        self.sel = self._pending_selection(layer).gather(2, idx)  # (b, h, kept)
        self.exact = self.rows

    def on_reuse(self, layer: CacheLayer, slots: torch.Tensor) -> None:
        """The layer drops one token per head in place (slot reuse): `slots` (b, h_kv, 1) are freed for the next
        token. Their rows are zeroed in place (the dropped token leaves every row's sum; the next token is later
        than every query with a row): no copy. Rows computed before are renormalised from now on."""
        if self.probs is None:
            return
        self._apply_pending(layer)  # a lazy pruning of an earlier eviction, if any: the rows follow the slots again
        b, h, _, r = self.probs.shape
        index = slots.unsqueeze(-1).expand(b, h, 1, r)  # (b, h_kv, 1, g * w)
        if self.mass is not None:  # the dropped token's entries leave each row's sum
            self.mass.sub_(self.probs.gather(2, index).view(self.mass.shape))
        self.probs.scatter_(2, index, 0.0)  # (b, h_kv, n, g * w), any strides
        self.exact = self.rows

    def on_unpack(self, layer: CacheLayer, sizes: list[int],
                  pad: Callable[[torch.Tensor, list[int], float], torch.Tensor]) -> None:
        """The layer's padded view was built from its flat storage (head sizes `sizes`): the flat rows padded alike.
        The entries of the tokens appended since the rows were complete are zeros: part of the padding here."""
        if self.probs is None:
            return
        self.mass = None  # the padded view's layout: summed again when next needed
        if layer.stash.first is not None and self.rows <= layer.stash.first:
            self.probs = None  # every stashed query is newer than the rows (a prompt block): rebuilt, not padded
            return
        new = (sum(sizes) - self.probs.shape[0]) // len(sizes)  # appended to every head since: no rows yet
        self.probs = pad(self.probs, [n - new for n in sizes], 0)  # (b, h_kv, L, g * w)

    def on_pack(self, rows: torch.Tensor, shape: tuple[int, int, int] | None) -> None:
        """The layer stores the rows `rows` (S,) of its flattened arrays: uniform `shape` (b, h_kv, n), or flat."""
        if self.probs is None:
            return
        self.mass = None  # stored flat or pruned: summed again when next needed
        self.probs = self.probs.reshape(-1, self.probs.shape[-1]).index_select(0, rows)
        if shape is not None:
            self.probs = self.probs.view(*shape, -1)

    def fork(self) -> WindowRing:
        """An independent copy: `attention` writes new rows in place, so `probs` is cloned (`sel` is only replaced)."""
        new = copy.copy(self)
        if self.probs is not None:
            new.probs = self.probs.clone()
        if self.mass is not None:
            new.mass = self.mass.clone()  # updated in place too
        return new
