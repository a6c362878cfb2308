"""The shared base of every eviction policy: budgets, protected tokens, GQA aggregation and top-N selection.

A policy subclass declares what it needs through class attributes and implements one method, `score(layer)`,
returning one score per (batch, KV head, cached token), higher = keep. Everything else lives here, once.

What the engine provides, only when a policy asks for it:
- `query_window` > 0: the latest `query_window` post-RoPE queries of each layer (rolling across blocks and
  decoding steps), in `layer.stash.queries` with their absolute positions in `layer.stash.positions`; -1: the current
  block's queries.
- `needs_attention`: `on_attention(layer, probs)` is called inside the attention wrapper with the block's real
  attention probabilities (the engine computes attention itself then, and reuses them for the output).
- `state_names`: per-token state tensors (b, h_kv, n) kept in `layer.state` and pruned with the tokens; new
  tokens' entries are filled by `on_append` when they enter the cache.
- `attach(num_layers)`: called when a cache is built for a model, with its number of decoder layers (per-layer
  budgets such as PyramidKV's depend on it).

Scoring always sees a layer in the (b, h_kv, n) layout: `evict` asks a ragged layer (flat per-head storage, see
engine/ragged.py) for its transient padded view first and stores the selection back flat, so nothing padded outlives
the eviction (in a run, the storing waits for the engine's one host read of the new head sizes, with the next token).
Selections never read counts back from the device: what they need on the host (head sizes, protected counts) the
layer and the policy know (`CacheLayer.head_lengths`, `Policy.protected_sizes`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from kvbench.options import positive_int

if TYPE_CHECKING:
    from kvbench.policies.layer import CacheLayer
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
    # True: `score` reads only the layer's own per-token arrays (keys, positions, state, stashed queries, scratch) and
    # treats each (batch row, KV head) on its own, `due` is the base one and `select` keeps each head's top `budget`
    # of a ranking made head by head (the base one, or CriticalKV's two stages), the policy keeps no per-layer
    # extras but stackable ones (`LayerExtra.stackable`: SnapKV's window ring), and whatever it draws per layer it draws
    # in layer order. Then a decoding step's eviction may score consecutive layers of equal shape as one layer whose
    # batch rows are theirs (kvbench/engine/stack.py): the same selections, one call instead of one per layer.
    stackable: bool = False
    # True: the policy object holds per-sample state that its score reads (Random's generator, reseeded per sample), so
    # the layers of two samples are never scored by one instance (`batch_key`)
    sample_state: bool = False
    # True: every selection of a ragged (per-head) layer reads which tokens it holds by position, never by slot order
    # (`latest_mask` and `tie_positions`, not slot ranges), changes per-token state only by setting a new tensor
    # (`layer.state[name] = ...`), and the policy keeps no per-layer extras. Then a decoding eviction that drops
    # exactly one token from every head of a ragged layer leaves each head's dropped row as a hole the next token is
    # written into (slot reuse, as uniform layers do: kvbench/engine/slots.py) instead of storing the kept rows again:
    # no K/V copied. The heads' rows then stop being in position order (`layer.chronological`).
    ragged_slot_reuse: bool = False
    # True: `on_append` reads only the new tokens' keys and queries (not `module` or values; of `layer` only which
    # decoder layer each batch row is, `layer_idx` or a stack's `row_layers`, and it may set per-row `scratch`) and
    # treats each (batch row, KV head) on its own (K-norm's norms, KeyDiff's inverse norms, HashEvict's codes and
    # probe). Then the engine may compute a decoding step's state at the eviction after it, for every layer of a stack
    # in one call (kvbench/engine/cache.py `settle_state`), instead of in each layer's forward: the same values, a few
    # operations a step instead of ~5-10 per layer (the per-layer hooks took ~1.0-1.3 ms of a ~80 ms step on one CPU
    # thread for K-norm and KeyDiff, ~3 for HashEvict).
    state_from_tokens: bool = False
    # True: every per-token state of a new token starts at 0 and `on_append` returns just that (H2O's accumulator,
    # SAGE-KV's pins). The layer fills a new token's row of an existing state with 0 itself, so the engine calls
    # `on_append` only to create the state (a layer's first forward): ~5 operations less per layer and step.
    state_starts_zero: bool = False
    # The static slot cache's query window (kvbench/engine/slotcache.py): how many of the latest queries it keeps for
    # `slot_score` (None: `query_window`; -1: as many as the run's largest forward, the last forward's queries)
    slot_window: int | None = None

    def __init__(self, budget: int | None = None, n_sink: int = 0, n_recent: int = 0,
                 skip_layers: Sequence[int] = (), seed: int = 0, **kwargs: Any) -> None:
        if kwargs:
            raise PolicyError(f"policy '{self.name}' got unknown options: {', '.join(sorted(kwargs))}")
        self.budget = budget
        self.n_sink = int(n_sink)
        self.n_recent = int(n_recent)
        self.skip_layers = frozenset(int(i) for i in skip_layers)
        self.seed = int(seed)
        self._edge_masks: dict[tuple[torch.Size, torch.device], torch.Tensor] = {}  # see `_edge_mask`
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

    def attach(self, num_layers: int) -> None:
        """Called when a cache is built for a model: its number of decoder layers (sliding ones included)."""
        self.num_layers = int(num_layers)

    def batch_key(self) -> tuple[Any, ...] | None:
        """Two samples' layers may be evicted in one call by one of their policies (a batch's decoding evictions,
        kvbench/engine/stack.py: `SampleStacks`) when both policies give the same key and it is not None: a stackable
        policy without per-sample state, of one class, with the same settings (every plain value the instance holds:
        budget, protected tokens, seed, options; not its caches)."""
        if not self.stackable or self.sample_state:
            return None
        plain = (bool, int, float, str, tuple, frozenset, type(None))
        return (type(self), tuple(sorted((k, v) for k, v in vars(self).items() if isinstance(v, plain))))

    def start_sample(self, sample_seed: int) -> None:
        """Called before each sample; stochastic policies reseed here so results do not depend on sample order."""

    # -- hooks called by the engine -----------------------------------------------------------------------------
    def on_append(self, layer: CacheLayer, module: Any, keys: torch.Tensor, values: torch.Tensor,
                  query: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token state (name -> (b, h_kv, q)) for the `q` tokens just appended (keys/values are theirs)."""
        return {}

    def on_attention(self, layer: CacheLayer, probs: torch.Tensor) -> None:
        """`probs` (b, h_kv, q, n): the block's attention, averaged over each KV head's query heads."""

    # -- the static slot cache's contract (kvbench/engine/slotcache.py): a score over every evicting layer's slots ---
    def slot_score(self, view: SlotView) -> torch.Tensor:
        """(L, b, h_kv, S) scores over the slots of every evicting layer, higher = keep; free slots and protected
        tokens are ranked by the engine (below and above everything)."""
        raise NotImplementedError(f"policy '{self.name}' has no slot_score")

    def slot_counts(self, view: SlotView, ranked: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """(L, b, h_kv) or (L, b, 1) tokens each head keeps; `counts` (L, b, 1) are the layers' budgets for each row
        (`layer_budget`), `ranked` the scores as the engine ranks them (protected +inf, free -inf). Per-head budgets
        (AdaKV) allocate here."""
        return counts

    def head_capacity(self, budget: int) -> int:
        """The most tokens one KV head may keep under `budget` (the static cache's slots per head are this plus the
        largest forward): the budget, unless the policy allocates per head (AdaKV's heads share the layer's)."""
        return budget

    def token_state(self, layer_idx: int, module: Any, keys: torch.Tensor, values: torch.Tensor,
                    query: torch.Tensor, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token state (name -> (b, h_kv, t)) of the t tokens a forward just wrote into `slots` (b, h_kv, t) of
        a layer whose buffers are keys/values (b, h_kv, S, d); a state not returned starts at 0."""
        return {}

    def on_slot_attention(self, state: dict[str, Sequence[torch.Tensor]], row: int, received: torch.Tensor) -> None:
        """`received` (b, h_kv, S): the attention each slot of one layer received from a forward's queries (their
        probabilities summed over the queries, averaged over each KV head's query heads), for a policy that
        `needs_attention`; `state[name][row]` is that layer's per-token state (b, h_kv, S), written in place."""

    # -- scoring and selection ----------------------------------------------------------------------------------
    def score(self, layer: CacheLayer) -> torch.Tensor:
        """(b, h_kv, n) scores over the layer's cached tokens, higher = keep."""
        raise NotImplementedError

    def protected(self, layer: CacheLayer) -> torch.Tensor | None:
        """(b, h_kv, n) bool of slots always kept: the first `n_sink` positions and the latest `n_recent` tokens."""
        if self.protected_count() == 0:
            return None
        if layer.valid is None and layer.chronological:
            return self._edge_mask(layer.positions.shape, layer.positions.device)
        if layer.valid is None:  # slots out of order (slot reuse): by position. Protected tokens are never evicted, so
            # a head holds every sink and every one of the latest n_recent positions
            prot = layer.positions < self.n_sink  # (b, h_kv, n)
            seen = layer.seen if layer.row_seen is None else layer.row_seen  # int, or (b, 1, 1): each row's own
            return prot | (layer.positions >= seen - self.n_recent) if self.n_recent > 0 else prot
        prot = (layer.positions >= 0) & (layer.positions < self.n_sink)  # (b, h_kv, n); padding has position -1
        if self.n_recent > 0:
            prot |= latest_mask(layer, self.n_recent)
        return prot

    def protected_sizes(self, layer: CacheLayer) -> list[int]:
        """How many slots `protected(layer)` marks in each (batch, KV head), row-major, counted on the host (no
        device read): min(held, min(n_sink, seen) + n_recent). The sinks are the lowest positions and never
        evicted (every head holds all of them), the latest tokens the highest, so the two sets overlap only when
        they cover the head."""
        sinks = min(self.n_sink, layer.seen)
        return [min(n, sinks + self.n_recent) for n in layer.head_lengths()]

    def _edge_mask(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """`protected` for chronological slots, shared (read-only) per shape: the sinks are the first slots (tokens
        enter in order and sinks are never evicted), the latest tokens the last ones."""
        mask = self._edge_masks.get((shape, device))
        if mask is None:
            mask = torch.zeros(shape, dtype=torch.bool, device=device)  # (b, h_kv, n)
            mask[..., :self.n_sink] = True
            if self.n_recent > 0:
                mask[..., -self.n_recent:] = True
            self._edge_masks[shape, device] = mask
        return mask

    def over_budget(self, layer: CacheLayer) -> int | None:
        """The layer's budget N when it holds more than N tokens per head (a selection is due), else None."""
        budget = self.layer_budget(layer.layer_idx, layer.seen)
        if budget is None or layer.physical() <= budget:
            return None
        return budget

    def ranked_scores(self, layer: CacheLayer) -> torch.Tensor:
        """(b, h_kv, n) float scores as selection ranks them: protected slots +inf, padding -inf."""
        scores = self.score(layer).float()  # (b, h_kv, n)
        prot = self.protected(layer)
        # torch.where, not masked_fill: the same values in one pass (an out-of-place masked_fill clones, then fills)
        if prot is not None:
            scores = torch.where(prot, math.inf, scores)
        if layer.valid is not None:
            scores = torch.where(layer.valid, scores, -math.inf)
        return scores

    def head_counts(self, layer: CacheLayer, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """(b, h_kv) tokens each head keeps: the budget, for every head (AdaKV allocates per head instead)."""
        return torch.full(scores.shape[:2], budget, dtype=torch.long, device=scores.device)

    def due(self, layer: CacheLayer) -> bool:
        """Whether `select` may evict from the layer now; False only where it surely selects nothing, so `evict`
        leaves the layer alone (a per-head layer not even turned into its padded view). Asked first, it reads only
        what the stored layer tells on the host (head sizes, `physical`, `kv_heads`), never the device. The default
        asks `select` every time (a subclass's own `select` may evict on any terms); the per-head policies, whose
        padded view costs the most, say when."""
        return True

    def dropped_position(self, layer: CacheLayer) -> int | None:
        """The absolute position of the one token every head of `layer` drops in this eviction, where the policy knows
        it on the host without scoring (SAGE-KV's steady slide, StreamingLLM one token over its budget): the layer
        frees that slot itself (`CacheLayer.drop_position`), keeping what `select` would keep. None (the default):
        `select`."""
        return None

    def attention_rows(self, layer: CacheLayer, q: int) -> int:
        """How many of a forward's latest queries (of its `q`) the policy takes the attention probabilities of, as
        their mean per query head (`layer.forward_rows`), where the forward computes them anyway (a ragged layer's
        per-head attention): the same values `query_attention(layer, mean=True)` computes over those queries, without
        computing them again. 0 (the default): none."""
        return 0

    def needs_kv(self, layer: CacheLayer) -> bool:
        """Whether `select` reads the padded view's keys or values themselves now (asked before a ragged layer's padded
        view is built: False leaves K/V flat and the view's K/V stand-ins of its shape, `CacheLayer.unpack(kv=False)`).
        Attention over the keys (`query_attention`, `attention_probs`, the observation window) needs no padded keys: it
        attends each head's own keys then (`CacheLayer.head_keys`). True unless a subclass knows better (AdaKV's,
        CriticalKV's and SAGE-KV's selections read keys only through that attention)."""
        return True

    def select(self, layer: CacheLayer) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Kept slot indices (b, h_kv, k) in chronological order, plus a validity mask for ragged heads (or None).

        Returns None when the layer is within its budget (nothing evicted).
        """
        budget = self.over_budget(layer)
        if budget is None:
            return None
        return top_slots(self.ranked_scores(layer), budget, tie_positions(layer)), None

    def evict(self, layer: CacheLayer,
              observe: Callable[[CacheLayer, torch.Tensor, torch.Tensor | None], None] | None = None) -> bool:
        """Prune `layer` to its budget; True if anything was evicted.

        `observe(layer, idx, valid)` (diagnostics) sees the selection while the layer still holds every token.
        A ragged layer is scored in its padded view, built here and packed back before returning; not when the policy
        is not `due` (AdaKV's layers stay under their total budget for many decoding steps: building the view and
        storing it back unchanged cost ~0.6 ms a layer there, three quarters of its decoding eviction).
        """
        if not self.due(layer):
            return False
        if observe is None:  # diagnostics observe a selection
            position = self.dropped_position(layer)
            if position is not None and layer.drop_position(position):
                return True
        layer.unpack(kv=observe is not None or self.needs_kv(layer))  # diagnostics may read K/V
        try:
            chosen = self.select(layer)
            if chosen is None:
                return False
            if observe is not None:
                observe(layer, *chosen)
            layer.keep(*chosen)
            return True
        finally:
            layer.pack()  # no-op after keep; restores the flat storage when nothing was evicted


def tie_positions(layer: CacheLayer) -> torch.Tensor | None:
    """What selections break ties by: None while the layer's slots are chronological (slot order is position order),
    else its positions (b, h_kv, n) (slot reuse), so a selection is the same whatever slot a token sits in."""
    return None if layer.chronological else layer.positions


def position_bound(layer: CacheLayer) -> int | None:
    """What `position_ranks` and `position_order` may count up to: `layer.seen` (every position is below it) when all
    rows saw as many tokens; None for a stack of samples that saw different numbers (`row_seen`: a row's positions may
    pass the lead's count, and the highest is on the device), which sorts instead."""
    return layer.seen if layer.row_seen is None else None


def position_ranks(positions: torch.Tensor, seen: int | None) -> torch.Tensor:
    """(b, h, n) each slot's rank in its head by position (0: the earliest), from `positions` (b, h, n), distinct per
    head, in [-1, seen) (-1: a hole, the earliest, as a sort ranks it). Counted, not sorted, while `seen` is known and
    within 8x n: mark each head's positions in a (b*h, seen + 1) row, and a slot's rank is the marks before its own (a
    running sum). Stacked decoding (30 layers x 3 heads x 1025 slots, seen 4128): 1.9 ms against 5.9 ms for an argsort
    (one thread), the same ranks (positions never tie)."""
    n = positions.shape[-1]
    if not _countable(seen, n):
        return inverse_permutation(positions.argsort(dim=-1))
    rows = positions.reshape(-1, n) + 1  # (b*h, n) in [0, seen]
    marks = torch.zeros(rows.shape[0], seen + 1, dtype=torch.int32, device=rows.device)
    ranks = marks.scatter_(1, rows, 1).cumsum_(1).gather(1, rows).sub_(1)  # (b*h, n)
    return ranks.view(positions.shape).long()


def position_order(positions: torch.Tensor, seen: int | None) -> torch.Tensor:
    """(b, h, n) each head's slots in position order: `positions.argsort(dim=-1)` (positions distinct per head, so the
    order is unique), counted as `position_ranks` counts (2.2 ms against 5.9 ms in its setting)."""
    if not _countable(seen, positions.shape[-1]):
        return positions.argsort(dim=-1)
    return inverse_permutation(position_ranks(positions, seen))


def _countable(seen: int | None, n: int) -> bool:
    """Whether positions of heads of `n` slots, all below `seen`, are ranked by counting (a row of `seen` + 1 marks
    per head) rather than sorted: `seen` known and within 8x n, where the count is the cheaper."""
    return seen is not None and seen <= 8 * n


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """(..., n) the inverse of each row's permutation `perm` (..., n) of 0..n-1."""
    n = perm.shape[-1]
    return torch.empty_like(perm).scatter_(-1, perm, torch.arange(n, device=perm.device).expand_as(perm))


def top_slots(scores: torch.Tensor, count: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """(b, h, count) slot indices of the `count` highest `scores` (b, h, n) of each head, in slot order.

    Ties keep the earlier token (as `rank_mask`), so a selection never depends on how a top-k kernel orders equal
    scores (which differs between devices and versions; HashEvict's Hamming scores tie all the time). One slot over
    (every decoding step) is the common case: the lowest score is dropped with one argmin instead of a sort; among
    equal lowest scores the latest token goes. `positions` (b, h, n): the tokens' order when the slots are not in it
    (`tie_positions`); None: slot order.
    """
    n = scores.shape[-1]
    if n - count == 1:
        if positions is None:
            drop = (n - 1) - scores.flip(-1).argmin(dim=-1, keepdim=True)  # (b, h, 1)
        else:  # the latest position among the lowest scores; a hole (position -1) ranks as the earliest token, so
            # the others are masked below it: it goes only when it alone holds the lowest score
            lowest = scores == scores.amin(dim=-1, keepdim=True)  # (b, h, n)
            drop = torch.where(lowest, positions, -2).argmax(dim=-1, keepdim=True)
        j = torch.arange(count, device=scores.device)  # (count,)
        return j + (j >= drop)  # (b, h, count): every slot but `drop`
    if 0 < count < n and (positions is None or scores.dtype == torch.float32):
        # the cut's mask, its slots in order (nonzero_static: no host read)
        b, h = scores.shape[:2]
        cut = _cut_mask(scores, count) if positions is None else _position_cut_mask(scores, count, positions)
        return cut.view(b * h, n).nonzero_static(size=b * h * count)[:, 1].view(b, h, count)
    ranked = _ranked(scores, positions)  # (b, h, n), ties in token order
    return ranked[..., :count].sort(dim=-1).values


def _cut_mask(scores: torch.Tensor, count: int) -> torch.Tensor:
    """(b, h, n) bool: the `count` (0 < count < n) highest `scores` (b, h, n) of each head, ties to the earlier slot:
    what a stable descending sort ranks first (`_ranked`), found without sorting. The count-th highest score is the
    cut (one selection, `kthvalue`); every score above it is kept, then the earliest slots at the cut up to `count`.
    The same slots by construction, ~2-4x cheaper on CPU than sorting (top_slots, 1024 of 1152 slots, 3 heads: 126 vs
    232 us; of 4096: 212 vs 834 us). NaN ranks as +inf here (a sort ranks it above +inf: the two differ only where
    NaN and +inf scores straddle the cut, which finite model scores never do)."""
    n = scores.shape[-1]
    s = scores.nan_to_num(nan=math.inf, posinf=math.inf, neginf=-math.inf)
    cut = s.kthvalue(n - count + 1, dim=-1, keepdim=True).values  # (b, h, 1): the count-th highest
    above = s > cut
    at_cut = s == cut
    return above | (at_cut & (at_cut.cumsum(dim=-1) <= count - above.sum(dim=-1, keepdim=True)))  # count per head


def _position_cut_mask(scores: torch.Tensor, count: int, positions: torch.Tensor) -> torch.Tensor:
    """`_cut_mask` with ties to the earlier position (slot reuse leaves slots out of position order): the `count`
    (0 < count < n) highest float32 `scores` (b, h, n) of each head, what a stable descending sort of the scores in
    position order ranks first (`_ranked`), found without sorting. Each slot gets one int64 key, its score's order in
    the high 32 bits (the float32 bits made order-preserving, -0.0 as +0.0) and its position reversed in the low 32,
    so keys differ within a head (positions do; -1 marks the one hole a decoding head may have) and order the slots as
    that sort does; the count-th highest key is the cut (`kthvalue`). ~3x cheaper on CPU than the sort (CriticalKV's
    stage 1 over 30 stacked layers, 3 KV heads, N = 1024: 3.3-3.9 vs 10.8-11.0 ms, one thread). NaN ranks as +inf (as
    `_cut_mask`)."""
    n = scores.shape[-1]
    s = scores.nan_to_num(nan=math.inf, posinf=math.inf, neginf=-math.inf)
    bits = torch.where(s == 0, 0.0, s).view(torch.int32)  # (b, h, n); -0.0 ties +0.0 in a sort: one key for both
    # Negative floats' bits grow with their magnitude: flipping the 31 low bits reverses them, below every positive
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # (b, h, n), ascending as the scores are
    keys = order * 2**32 + ((2**32 - 2) - positions.long())  # earlier position, higher key; |keys| < 2^63
    return keys >= keys.kthvalue(n - count + 1, dim=-1, keepdim=True).values


def _ranked(scores: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """(b, h, n) slots by descending score, ties in slot order (`positions` None) or in position order."""
    if positions is None:
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices
    order = positions.argsort(dim=-1)  # (b, h, n) slots in position order (positions differ within a head)
    ranked = torch.sort(scores.gather(-1, order), dim=-1, descending=True, stable=True).indices
    return order.gather(-1, ranked)


# ---------------------------------------------------------------------------------------------------------------
# Shared helpers for attention-based scores.

def group_mean(x: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(b, h_q, ...) -> (b, h_kv, ...): average over the query heads sharing each KV head (KeyDiff App. B.2)."""
    b, h_q = x.shape[:2]
    return x.view(b, n_kv, h_q // n_kv, *x.shape[2:]).mean(dim=2)


def query_attention(layer: CacheLayer, mean: bool = False) -> torch.Tensor:
    """Attention probabilities (b, h_q, w, n) of the layer's stashed queries over its cached tokens; `mean`: their mean
    over the w queries, (b, h_q, n) (SnapKV's observation window).

    A query only sees keys at positions <= its own (causality for queries kept from earlier steps) and valid slots.
    Computed in float32.
    """
    return attention_probs(layer, layer.stash.queries, layer.stash.positions, layer.stash.first, mean)


def attention_probs(layer: CacheLayer, query: torch.Tensor, query_positions: torch.Tensor,
                    first: int | None, mean: bool = False) -> torch.Tensor:
    """Attention probabilities (b, h_q, k, n) of `query` (b, h_q, k, d), at `query_positions` (k,), over the layer's
    slots: float32, the model's scale fused into the product, its softcap, keys after a query's position and invalid
    slots masked, softmax; `mean`: their mean over the k queries, (b, h_q, n). The one definition the policies' scores
    (query_attention) and the observation window's incremental rows (policies/window.py's WindowRing) use. `first`:
    the earliest query position when the positions are gap-free (first .. first + k - 1), else None.
    A padded view whose K/V were left flat (`layer.head_keys()`) is attended head by head over each head's own keys
    (`_head_probs`), the padding 0 as here."""
    segments = layer.head_keys()
    if segments is not None:
        return _head_probs(layer, segments, query, query_positions, first, mean)
    q = query.float()  # (b, h_q, k, d)
    keys = layer.keys.float()  # (b, h_kv, n, d)
    b, h_q, w, d = q.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    g = h_q // h_kv
    # The scale is fused into the product (one pass less over the (w, n) logits; same values as a product then *).
    logits = torch.baddbmm(q.new_zeros(()), q.reshape(b * h_kv, g * w, d), keys.reshape(b * h_kv, n, d).transpose(1, 2),
                           beta=0.0, alpha=layer.scaling).view(b, h_q, w, n)
    if layer.softcap:
        logits = torch.tanh(logits / layer.softcap) * layer.softcap
    if first is not None and (layer.chronological or first >= layer.seen - 1):
        # Gap-free query positions: only the keys after the earliest query (at most seen - 1 - first of them) and
        # padding can be hidden from some query, and they lie from slot `start` on. Chronological slots hold them
        # last (none is hidden when every query is the latest token, whatever the slots' order); the padded view holds
        # each head's real slots first (in position order unless a ragged hole was refilled), then padding, so none
        # lies before the shortest head's length less seen - 1 - first. The mask is built and applied in place from
        # `start` on: the same -inf entries as masking every slot (a full-size masked_fill and its repeat over the
        # query heads cost ~3x the softmax on CPU).
        after = layer.seen - 1 - first
        start = n - min(n, after) if layer.valid is None else max(0, min(layer.head_lengths()) - after)
        if start < n:
            hidden = layer.positions[..., start:].unsqueeze(-2) > query_positions.view(1, 1, w, 1)  # (b, h_kv, w, n')
            if layer.valid is not None:
                hidden |= ~layer.valid[..., start:].unsqueeze(-2)
            logits.view(b, h_kv, g, w, n)[..., start:].masked_fill_(hidden.unsqueeze(2), -math.inf)
        probs = torch.softmax(logits, dim=-1)
    else:
        visible = layer.positions.unsqueeze(-2) <= query_positions.view(1, 1, w, 1)  # (b, h_kv, w, n)
        if layer.valid is not None:
            visible = visible & layer.valid.unsqueeze(-2)
        visible = visible.repeat_interleave(g, dim=1)  # (b, h_q, w, n)
        probs = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)
    return probs.mean(dim=-2) if mean else probs


def _head_probs(layer: CacheLayer, segments: list[torch.Tensor], query: torch.Tensor, query_positions: torch.Tensor,
                first: int | None, mean: bool) -> torch.Tensor:
    """attention_probs in a padded view (b, h_kv, L) whose K/V were left flat: each KV head's query group over the
    head's own `segments[i]` keys (n_i, d), its softmax written into the view's layout, 0 on padding. The same
    arithmetic per head as attention_probs over the padded keys (the same products, the same -inf entries, padding
    adding exact zeros to the softmax's sums; tests/test_fast_paths.py), without padding the keys (a copy of the
    layer), masking the padding or multiplying and exponentiating it: AdaKV's heads differ by hundreds of tokens."""
    q = query.float()  # (b, h_q, k, d)
    b, h_q, k, d = q.shape
    h_kv, length = layer.positions.shape[1], layer.positions.shape[2]
    g = h_q // h_kv
    out = q.new_zeros((b, h_q, length) if mean else (b, h_q, k, length))
    zero = q.new_zeros(())
    # gap-free query positions over a head in position order: only its last `after` keys can lie after a query
    after = layer.seen - 1 - first if first is not None and (layer.chronological or first >= layer.seen - 1) else None
    for i, keys in enumerate(segments):
        bi, hi = divmod(i, h_kv)
        n = keys.shape[0]
        heads = slice(hi * g, (hi + 1) * g)
        logits = torch.baddbmm(zero, q[bi:bi + 1, heads].reshape(1, g * k, d), keys.float().t().unsqueeze(0),
                               beta=0.0, alpha=layer.scaling).view(g, k, n)
        if layer.softcap:
            logits = torch.tanh(logits / layer.softcap) * layer.softcap
        # The head's real slots in position order: only its last `after` can lie after a query (gap-free positions)
        start = 0 if after is None else n - min(n, after)
        if start < n:
            hidden = layer.positions[bi, hi, start:n].unsqueeze(0) > query_positions.view(k, 1)  # (k, n - start)
            logits[..., start:].masked_fill_(hidden, -math.inf)
        probs = torch.softmax(logits, dim=-1)  # (g, k, n)
        if mean:
            out[bi, heads, :n] = probs.mean(dim=-2)
        else:
            out[bi, heads, :, :n] = probs
    return out


# ---------------------------------------------------------------------------------------------------------------
# Shared helpers for per-head (ragged) selections. In the padded view of a ragged layer each head's real tokens
# come first, then padding (`valid` False, position -1); the real ones in chronological order unless a decoding step
# wrote a token into a hole (`Policy.ragged_slot_reuse`: `layer.chronological` False), so the helpers read positions
# where the layer says its slots are out of order, and never assume that the latest tokens are the last slots.

def latest_mask(layer: CacheLayer, count: int) -> torch.Tensor:
    """(b, h_kv, n) bool: each head's `count` latest real tokens (by position; padding and holes never). Counted where
    the real slots are in position order (`layer.chronological`), else ranked by position (slot reuse's holes, uniform
    or ragged)."""
    if not layer.chronological:
        return rank_mask(layer.positions.float().masked_fill(layer.positions < 0, -math.inf), count)
    return latest_in_order(layer.positions >= 0, count)


def latest_in_order(marked: torch.Tensor, count: int) -> torch.Tensor:
    """(b, h, n) bool: of the slots `marked` (b, h, n), each head's `count` latest, for slots in position order: the
    marked slots with fewer than `count` marked slots after them. What rank_mask of their positions selects (positions
    differ), counted instead of cut at the count-th: one running sum (3 heads x 900 slots, one CPU thread: SAGE-KV's
    slide selects in 167-177 against 455-495 us with rank_mask; AdaKV's window and protected tokens every eviction)."""
    after = marked.sum(dim=-1, keepdim=True) - marked.long().cumsum(dim=-1)  # (b, h, n): marked slots after each
    return marked & (after < count)


def rank_mask(scores: torch.Tensor, count: int | torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """(b, h, n) bool: the top-`count` entries per head (`count` an int or a (b, h) tensor); -inf never selected.

    Ties are broken by slot order (earlier slot first), or by `positions` (b, h, n) when given (`tie_positions`), so
    selections are deterministic.
    """
    if isinstance(count, int) and 0 < count < scores.shape[-1]:
        if positions is None:
            return _cut_mask(scores, count) & (scores > -math.inf)
        if scores.dtype == torch.float32:
            return _position_cut_mask(scores, count, positions) & (scores > -math.inf)
    order = _ranked(scores, positions)  # (b, h, n)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device)
                                            .expand_as(order))
    count = torch.as_tensor(count, device=scores.device)
    if count.dim() == 2:
        count = count.unsqueeze(-1)  # (b, h, 1)
    return (rank < count) & (scores > -math.inf)


def compact(keep: torch.Tensor, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Slot indices (b, h, L) and validity (b, h, L) that keep the `keep` (b, h, n) slots of each head.

    Kept slots come first in slot order (chronological, see above), then padding: L = n, the view's own width, so
    the selection never asks the device how many a head keeps (a host sync on a GPU); padding re-uses the head's
    first kept slot and is dropped when the layer stores the selection (flat per head, `CacheLayer.keep`: the one
    read of the new head sizes, which the engine takes together with the decoded token).
    `count`: the caller knows every head keeps exactly that many: (b, h, count) indices, validity None.
    """
    n = keep.shape[-1]
    j = torch.arange(n, device=keep.device)  # (n,)
    # The slots' order, kept ones first, each group in slot order (the argsort of (~keep) * n + j), placed rather than
    # sorted: a kept slot goes to its rank among the kept, another after all kept ones at its rank among the others.
    # A permutation, so every place is written once; the same indices as the sort (3 heads x 900 slots, one CPU
    # thread: 98 against 128 us)
    kept_before = keep.long().cumsum(dim=-1)  # (b, h, n): kept slots up to and including each
    kept = kept_before[..., -1:]  # (b, h, 1)
    place = torch.where(keep, kept_before - 1, kept + j - kept_before)  # (b, h, n)
    idx = inverse_permutation(place)  # (b, h, n): the slot at each place
    if count is not None:
        return idx[..., :count], None
    valid = j < kept  # (b, h, n)
    return torch.where(valid, idx, idx[..., :1]), valid


ALLOCATIONS = ("adakv", "kvpress")


def adaptive_counts(scores: torch.Tensor, budget: int, n_protected: torch.Tensor, alpha_safeguard: float,
                    rule: str = "adakv", total: int | None = None) -> torch.Tensor:
    """AdaKV budget allocation (CriticalKV Alg. 2 line 1): tokens each head keeps, (b, h), protected ones included.

    `scores` (b, h, n): protected slots +inf, padding -inf; `n_protected` (b, h); a = `alpha_safeguard`.
    The layer's heads share h * budget slots; two published rules:
    - `adakv` (AdaKV's own code): with F = budget - protected per head, count c_h = how many of the layer's
      top sum(F) unprotected scores are head h's, then head h keeps its protected tokens and its own top
      round((1 - a) * c_h + floor(a * F)) (torch.round, half to even, computed in float32 as that code does).
      The total can fall short of h * budget, or (rounding) exceed it: kvbench then takes one token back from
      the heads rounded up the most (lower head first), so a layer never holds more than h * budget.
    - `kvpress` (NVIDIA kvpress AdaKVPress): each head first keeps its own top floor(a * budget) slots counting
      its protected ones (the window has the highest scores there), at least its protected tokens; the rest of
      the h * budget slots go to the best remaining scores over all heads.
    A head with fewer tokens than its count keeps them all (`rank_mask`).
    `total`: the size of the pooled top-k (`adaptive_total`), when the caller knows it on the host; None reads it
    from the device (one host sync).
    """
    b, h, n = scores.shape
    if rule == "kvpress":
        safe_count = n_protected.clamp_min(math.floor(alpha_safeguard * budget))
        safe = rank_mask(scores, safe_count)
        pooled = scores.masked_fill(safe, math.inf).reshape(b, h * n)  # (b, h*n)
        if total is None:
            total = min(h * budget, int((pooled > -math.inf).sum(dim=-1).min()))
        top = pooled.topk(total, dim=-1).indices // n  # (b, total): head of each kept token
        return torch.zeros(b, h, dtype=torch.long, device=scores.device).scatter_add_(1, top, torch.ones_like(top))
    if rule != "adakv":
        raise ValueError(f"unknown allocation rule '{rule}'; choose one of: {', '.join(ALLOCATIONS)}")
    free = budget - n_protected  # (b, h) F per head
    floor_cap = (free.double() * alpha_safeguard).floor()  # (b, h) int(a * F) in double, as Python computes it
    unprot = scores.masked_fill(scores == math.inf, -math.inf).reshape(b, h * n)  # (b, h*n)
    if total is None:
        total = min(torch.stack([free.sum(dim=-1).min(), (unprot > -math.inf).sum(dim=-1).min()]).tolist())  # 1 read
    top = unprot.topk(total, dim=-1).indices // n  # (b, total)
    c = torch.zeros(b, h, dtype=torch.long, device=scores.device).scatter_add_(1, top, torch.ones_like(top))
    exact = c * (1 - alpha_safeguard) + floor_cap.float()  # (b, h) float32, as AdaKV's code computes it
    k = torch.round(exact).long()
    excess = (k.sum(dim=-1) - free.sum(dim=-1)).clamp_min(0)  # (b,) > 0 only through rounding up
    # One token back from each of the `excess` heads rounded up the most (stable sort: lower head first), computed
    # on the device (a loop over rows would read `excess` back to the host).
    k = k - rank_mask((k - exact).unsqueeze(0), excess.unsqueeze(0))[0].long()
    return n_protected + k


def adaptive_total(sizes: Sequence[int], protected: Sequence[int], heads: int, budget: int, rule: str) -> int:
    """`adaptive_counts`' pooled top-k size from host counts: `sizes` and `protected` the real and the protected
    tokens of each (batch, head), row-major, `heads` per batch row. What adaptive_counts reads from the device:
    - `adakv`: the fewest over batch rows of min(sum of F = budget - protected, unprotected real tokens);
    - `kvpress`: min(heads * budget, the fewest real tokens of a batch row).
    """
    rows = range(0, len(sizes), heads)
    real = [sum(sizes[i:i + heads]) for i in rows]
    if rule == "kvpress":
        return min(heads * budget, min(real))
    prot = [sum(protected[i:i + heads]) for i in rows]
    return min(min(heads * budget - p for p in prot), min(r - p for r, p in zip(real, prot)))
