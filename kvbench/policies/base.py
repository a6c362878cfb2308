"""The shared base of every eviction policy: the `Policy` class (its budget, protected tokens and the one method it
writes, `score`), the `SlotView` a score reads, and the ranking the engine selects by.

A policy scores the slots of every evicting layer at once: `score(view)` returns (L, b, h_kv, S), higher = keep. The
engine (kvbench/engine/cache.py) does the rest, for every policy alike: the protected tokens (the first `n_sink`
positions and the latest `n_recent`) rank above everything and free slots below, each head keeps its top `counts`
(the layer's budget, `layer_budget`; a per-head allocation overrides `counts`), ties go to the earlier token
(`ranks`), and the other slots are marked free.

The view. The static layout (kvbench/engine/cache.py) gives each evicting layer S slots per KV head; a slot holds a
token's post-RoPE key and value and its absolute position, or is free (position -1). The evicting layers are stacked
on a leading axis L, so one policy call scores every layer (one batched selection follows, by the engine). Free slots
keep whatever K/V they held last: a score may read them, the engine ranks them below every held token.

What the engine provides, only when a policy asks for it:
- `query_window` w > 0: the latest w post-RoPE queries of each layer (across blocks and decoding steps), in
  `view.queries` with their positions in `view.qpos`; -1: the last forward's queries (as many as its largest).
- `needs_attention`: `on_attention` is called inside every forward of an evicting layer with the attention each slot
  received (the engine computes the probabilities then).
- `state_names`: per-token state (L, b, h_kv, S) float32 in `view.state`, 0 for a token when it enters the cache
  unless `token_state` gives its value (once per forward, for every evicting layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from kvbench.options import positive_int

# the most bytes of float32 intermediates a batched computation over layers makes at once: on a CPU a chunk then stays
# in the core's cache from its product to its reduction, where a whole prompt block's would go through memory at each
# step. CriticalKV's value norms keep to it everywhere (a bound on their memory too); the engine's stored attention
# rows only on a CPU (on a GPU each chunk would be launches more, for no gain). A decoding step's are one chunk.
CHUNK_BYTES = 4 << 20
_TINY = torch.finfo(torch.float32).tiny  # a row's mass when it holds nothing (its probabilities are then 0)


@dataclass
class SlotView:
    keys: torch.Tensor  # (L, b, h_kv, S, d) post-RoPE keys, free slots stale
    values: torch.Tensor  # (L, b, h_kv, S, d)
    pos: torch.Tensor  # (L, b, h_kv, S) int64 absolute positions, -1 free
    seen: torch.Tensor  # (b,) int64 tokens each row has seen (every position is below it)
    fed: torch.Tensor  # (b,) int64 tokens of the forward just done (positions seen - fed .. seen - 1)
    layers: tuple[int, ...]  # the decoder layer of each of the L rows
    scaling: float  # the model's attention scale
    softcap: float | None = None
    # (L, b, h_q, w, d) the latest w queries (Policy.query_window), post-RoPE, the one at position p in ring slot p % w
    queries: torch.Tensor | None = None
    qpos: torch.Tensor | None = None  # (b, w) int64 their positions, -1: no query there yet
    # (L, b, h_q, w, S) float32 each stored query's attention probabilities over the slots as computed when it entered
    # (0 for the slots it does not see), kept by the engine; None: `attention` computes them from the queries
    probs: torch.Tensor | None = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (L, b, h_kv, S) float32 per-token state
    modules: tuple[Any, ...] = ()  # the attention module of each row's layer
    decoding: bool = False  # the eviction after a decoding step (else after a prompt forward)
    # (L, b, 1) int64 each row's budget per layer in this eviction, for a score that depends on it (CriticalKV's
    # stage 1, SAGE-KV's selection): the engine's `counts` (per-row budgets of a batch, the capacity S for a row that
    # does not evict), set by its `select` before it calls `score`
    budgets: torch.Tensor | None = None

    def protected(self, n_sink: int, n_recent: int) -> torch.Tensor:
        """(L, b, h_kv, S) bool: the held slots a selection always keeps, the first `n_sink` positions and the latest
        `n_recent` (by position: seen - n_recent on). The engine's +inf ranks (kvbench/engine/cache.py `select`),
        here so that a score that needs them before the engine applies them (CriticalKV's stage 1) marks the same."""
        edge = self.pos < n_sink
        if n_recent > 0:
            edge |= self.pos >= self.seen.view(1, -1, 1, 1) - n_recent
        return edge & (self.pos >= 0)

    def attention(self) -> torch.Tensor:
        """(L, b, h_q, w, S) float32 attention probabilities of the stored queries over the slots: a query sees the
        held slots at positions up to its own; the model's scale and softcap; a query slot not filled yet (qpos -1)
        gets zeros. From the engine's stored rows (`probs`) renormalised over the slots held now: the softmax over
        fewer keys, the same values up to float rounding (a different order of the sums, one division more)."""
        rows, held = self.attention_rows()
        return rows * (held / rows.mul(held).sum(dim=-1, keepdim=True).clamp_min(_TINY))

    def mean_attention(self) -> torch.Tensor:
        """(L, b, h_q, S) `attention()` averaged over the stored queries (SnapKV's observation window), as one product
        over the stored rows: sum_r rows_r / (w * mass_r), mass_r = the row's sum over the slots held."""
        rows, held = self.attention_rows()  # (L, b, h_q, w, S), (L, b, h_q, 1, S)
        L, b, h_q, w, S = rows.shape
        flat = rows.reshape(L * b * h_q, w, S)
        # (R, 1, w): held (1 x S) times the rows transposed, which BLAS reads row by row (flat times held, a column,
        # strides across them)
        mass = torch.bmm(held.reshape(L * b * h_q, 1, S), flat.transpose(1, 2))
        weight = mass.clamp_min(_TINY).reciprocal().mul_(1.0 / w)  # (R, 1, w)
        return torch.bmm(weight, flat).view(L, b, h_q, S) * held.view(L, b, h_q, S)

    def latest_attention(self) -> torch.Tensor:
        """(L, b, h_q, S) `attention()` of each row's latest query (the stored one at the highest position)."""
        rows, held = self.attention_rows()
        L, b, h_q, w, S = rows.shape
        slot = self.qpos.argmax(dim=1).view(1, b, 1, 1, 1).expand(L, b, h_q, 1, S)  # type: ignore[union-attr]
        last = rows.gather(3, slot) * held  # (L, b, h_q, 1, S)
        return (last / last.sum(dim=-1, keepdim=True).clamp_min(_TINY)).squeeze(3)

    def attention_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored queries' rows (L, b, h_q, w, S), the engine's (`probs`) or computed from the queries (a view
        built by hand), and the held slots (L, b, h_q, 1, S) float32."""
        assert self.queries is not None and self.qpos is not None, "the policy declares no query_window"
        L, b, h_q, w, d = self.queries.shape
        h_kv, S = self.keys.shape[2], self.keys.shape[3]
        g = h_q // h_kv
        held = (self.pos >= 0).repeat_interleave(g, dim=2).unsqueeze(3).float()  # (L, b, h_q, 1, S)
        if self.probs is not None:
            return self.probs, held
        q = self.queries.float().reshape(L * b * h_kv, g * w, d)
        k = self.keys.float().reshape(L * b * h_kv, S, d)
        logits = torch.baddbmm(q.new_zeros(()), q, k.transpose(1, 2), beta=0.0, alpha=self.scaling)
        logits = logits.view(L, b, h_kv, g, w, S)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        qpos = self.qpos.view(1, b, 1, 1, w, 1)
        visible = (self.pos.view(L, b, h_kv, 1, 1, S) <= qpos) & (self.pos >= 0).view(L, b, h_kv, 1, 1, S)
        probs = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1).nan_to_num_(0.0)  # unfilled: 0
        return probs.view(L, b, h_q, w, S), held

    def written(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """(L, b, h_kv, t, d): the entries of a slot buffer `x` (L, b, h_kv, S, d) (`keys`, `values`) at `slots`
        (L, b, h_kv, t): a forward's new tokens, for `Policy.token_state`."""
        return x.gather(3, slots.unsqueeze(-1).expand(*slots.shape, x.shape[-1]))

    def group_mean(self, x: torch.Tensor) -> torch.Tensor:
        """(L, b, h_q, ...) -> (L, b, h_kv, ...): the mean over each KV head's query heads (GQA)."""
        L, b, h_q = x.shape[:3]
        h_kv = self.keys.shape[2]
        return x.view(L, b, h_kv, h_q // h_kv, *x.shape[3:]).mean(dim=3)


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
    # samples are never the rows of one cache scored by one instance (kvbench.engine.generate.slot_key), and a compiled
    # run evicts outside its graphs (torch.compile does not trace a generator)
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

    def attach(self, num_layers: int, head_dim: int) -> None:
        """Called when a cache is built for a model, outside any compiled graph: its number of decoder layers (sliding
        ones included) and the size of an attention head (what a policy's own constants are drawn for)."""
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


class WindowAttention(Policy):
    """SnapKV's scores (kvbench/policies/snapkv.py), shared here by the policies built on them (PyramidKV, AdaKV,
    CriticalKV's bases): the mean attention of the latest `window` queries (the observation window, its tokens
    protected), pooled along the sequence over `kernel` neighbours (`pool`), averaged over each KV head's query
    heads."""

    def __init__(self, window: int = 32, kernel: int = 7, pooling: str = "avg", **kwargs: Any) -> None:
        if pooling not in ("avg", "max"):
            raise PolicyError(f"{self.name} pooling '{pooling}' unknown; choose one of: avg, max")
        if kernel < 1 or kernel % 2 == 0:
            raise PolicyError(f"{self.name} kernel must be a positive odd number, got {kernel}")
        self.window, self.kernel, self.pooling = int(window), int(kernel), pooling
        self.query_window = self.window
        super().__init__(n_recent=self.window, **kwargs)

    def score(self, view: SlotView) -> torch.Tensor:
        """(L, b, h_kv, S): the window's mean attention per query head (`view.mean_attention`), pooled along the
        sequence (the slots in position order, free slots, all 0, first: zero padding; the window's own attention
        left out of its neighbours': its tokens are protected), then averaged over each KV head's query heads."""
        probs = view.mean_attention()  # (L, b, h_q, S)
        L, b, h_kv, S = view.pos.shape
        g = probs.shape[2] // h_kv
        window = (view.pos >= view.seen.view(1, -1, 1, 1) - self.window).repeat_interleave(g, dim=2)
        order = view.pos.argsort(dim=-1).repeat_interleave(g, dim=2)  # (L, b, h_q, S): by position, free first
        pooled = pool(probs.masked_fill(window, 0.0).gather(-1, order), self.kernel, self.pooling)
        return torch.empty_like(pooled).scatter_(-1, order, pooled).view(L, b, h_kv, g, S).mean(dim=3)


def pool(x: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """(..., n) float32 or float64 scores -> (..., n): each pooled over itself and its kernel // 2 neighbours on either
    side along the last axis, zero padded; "avg" divides by `kernel` whatever the padding, as F.avg_pool1d (stride 1,
    count_include_pad) does, "max" is F.max_pool1d. The average is the sum of `kernel` shifted slices, added in the
    window's order, over `kernel`: the very float32/float64 values of avg_pool1d, whose CPU kernel adds each window in
    that order (adding the padding's zeros changes no sum; tests/test_policies.py checks every bit), in fewer passes
    over many rows."""
    pad = kernel // 2
    if pooling == "max":
        return F.max_pool1d(x.reshape(-1, 1, x.shape[-1]), kernel, stride=1, padding=pad).view(x.shape)
    n = x.shape[-1]
    padded = F.pad(x, (pad, pad))  # (..., n + 2 pad)
    total = padded[..., :n].clone()
    for j in range(1, kernel):
        total += padded[..., j:j + n]
    return total / kernel


# -- the ranking the engine selects by (and policies that rank within their score) -------------------------------------
def ranks(scores: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """(..., n) each entry's rank in its row by `scores` (..., n) taken in float32, highest first (0); ties go to the
    earlier token: the lower position when `positions` (..., n) (at least PAD) are given, else the lower index. One
    sort of a key that holds both (`order_key`), so a ranking never depends on how a kernel orders equal scores
    (HashEvict's Hamming scores tie all the time)."""
    order = order_key(scores, positions).argsort(dim=-1, descending=True)
    n = scores.shape[-1]
    return torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=order.device).expand_as(order))


def order_key(scores: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """(..., n) int64, ordered as `ranks` ranks: the float32 score's order-preserving bits above, the tie-break (the
    earlier position, or index, larger) below; distinct within a row whenever the positions are."""
    bits = (scores.float() + 0.0).view(torch.int32).long()  # + 0.0: -0.0 is 0.0
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats' magnitude bits flipped: ordered as the floats
    n = scores.shape[-1]
    later = positions + 2 if positions is not None else torch.arange(n, device=scores.device).expand(scores.shape)
    return bits * (1 << 32) + ((1 << 32) - 1 - later)


def rank_mask(scores: torch.Tensor, count: int | torch.Tensor, positions: torch.Tensor | None = None,
              most: int | None = None) -> torch.Tensor:
    """(..., n) bool: each row's top `count` entries (an int, or a tensor of the rows' shape), -inf never; ties as
    `ranks` breaks them. `most`: no count exceeds it (a bound known on the host), so a top-`most` replaces the sort."""
    count = torch.as_tensor(count, device=scores.device)
    if most is None:
        return (ranks(scores, positions) < count.unsqueeze(-1)) & (scores > -math.inf)
    most = min(most, scores.shape[-1])
    top = order_key(scores, positions).topk(most, dim=-1).indices  # (..., most), best first
    chosen = torch.arange(most, device=scores.device) < count.unsqueeze(-1)  # (..., most)
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, top, chosen.expand_as(top))
    return mask & (scores > -math.inf)
