"""The static slot cache: fixed buffers per layer, tokens written into free slots, eviction by marking slots free.

Layout. The cache's layers form two groups of stacked buffers: the evicting layers (S slots per KV head: N + B for a
uniform budget, sized by the run's plan, `capacity`) and the layers the policy never evicts (as many slots as the run
has tokens). A group holds keys and values (L, b, h_kv, S, d), each slot's absolute position (L, b, h_kv, S) int64
(-1: free), each per-token policy state (L, b, h_kv, S) float32, and for a policy that scores with queries the latest
w queries (L, b, h_q, w, d), the query at position p in ring slot p % w; for a policy that reads their attention
(`Policy.query_window` w > 0) also each stored query's attention probabilities over the slots (L, b, h_q, w, S), as
computed when the query entered (`SlotView.attention` renormalises them over the slots still held: evictions only
remove keys, and a key written later is after every stored query, so its entries are set to 0). A decoder layer's
cache is a view of its group's row. Nothing ever changes shape, so a forward (and its eviction) can be one compiled
graph.

A forward of t tokens writes them into each head's first t free slots (`begin`), with their positions; attention
runs over all S slots with a mask built from the positions (held, and not after the query: causal); eviction ranks the
slots and marks the ones beyond each head's count free. No slot is copied or compacted, and nothing is read back to
the host. Batch rows are independent runs: each has its own positions and seen count.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves
from transformers.cache_utils import Cache

from kvbench.models.common import head_dim
from kvbench.policies.base import CHUNK_BYTES, Policy, SlotView, ranks

IMPL = "kvbench_slots"
PAD = -2  # the position of a padding token: it sees only padding, and its slot stays free


class _Group:
    """The stacked buffers of the layers with one capacity."""

    def __init__(self, layers: list[int], b: int, h_kv: int, h_q: int, slots: list[int], d: int, dtype: torch.dtype,
                 device: torch.device, states: tuple[str, ...], window: int, attention: bool, explicit: bool) -> None:
        L, S = len(layers), max(slots)
        self.layers, self.explicit = layers, explicit  # explicit: its layers attend explicitly, not through sdpa
        # the slots each layer uses, its first `limits[i]` (S for all but a policy with per-layer budgets): a head
        # writes into its first free slots and never holds more than its layer's limit, so it never reaches past it
        self.limits = slots
        self.keys = torch.zeros(L, b, h_kv, S, d, dtype=dtype, device=device)
        self.values = torch.zeros(L, b, h_kv, S, d, dtype=dtype, device=device)
        self.pos = torch.full((L, b, h_kv, S), -1, dtype=torch.long, device=device)
        self.state = {name: torch.zeros(L, b, h_kv, S, device=device) for name in states}
        # one ring slot more than the window, w: where a padding token's query (and its row) goes, never read
        self.queries = torch.zeros(L, b, h_q, window + 1, d, dtype=dtype, device=device) if window else None
        self.probs = torch.zeros(L, b, h_q, window + 1, S, device=device) if window and attention else None
        self.rows()
        self.write: torch.Tensor | None = None  # (L, b, h_kv, t) the slots this forward's tokens go into
        # per layer, set by `SlotCache.begin` for a forward: the write index over K/V (b, h_kv, t, d), the visibility
        # (b, h_kv, t, S), and for sdpa the same as (b * h_kv, 1, t, S) (`k_flat`), for explicit attention its
        # complement (b, h_kv, 1, t, S)
        self.write_kv: tuple[torch.Tensor, ...] = ()
        self.visible: tuple[torch.Tensor, ...] = ()
        self.masks: tuple[torch.Tensor, ...] = ()
        self.hidden: tuple[torch.Tensor, ...] = ()

    def rows(self) -> None:
        """Each layer's views of the stacked buffers (its first `limits` slots), made once (a layer's forward then
        indexes nothing)."""
        self.k_rows = tuple(k[:, :, :s] for k, s in zip(self.keys.unbind(0), self.limits))
        self.v_rows = tuple(v[:, :, :s] for v, s in zip(self.values.unbind(0), self.limits))
        # the same as sdpa reads them: each KV head a batch entry of its own, (b * h_kv, 1, S_l, d), so that its mask
        # is one (t, S) per KV head, shared by its query heads (not copied per query head)
        self.k_flat = tuple(k.flatten(0, 1).unsqueeze(1) for k in self.k_rows)
        self.v_flat = tuple(v.flatten(0, 1).unsqueeze(1) for v in self.v_rows)
        self.q_rows = self.queries.unbind(0) if self.queries is not None else ()
        self.state_rows = {name: t.unbind(0) for name, t in self.state.items()}

    def clone(self) -> _Group:
        other = object.__new__(_Group)
        other.layers, other.limits, other.explicit, other.write = self.layers, self.limits, self.explicit, None
        other.keys, other.values, other.pos = self.keys.clone(), self.values.clone(), self.pos.clone()
        other.state = {k: v.clone() for k, v in self.state.items()}
        other.queries = None if self.queries is None else self.queries.clone()
        other.probs = None if self.probs is None else self.probs.clone()
        other.rows()
        return other


def evicted_layers(cfg: Any, policy: Policy) -> list[int]:
    """The decoder layers `policy` evicts: those with a budget, but for sliding-window layers (they keep their window
    as the model defines it, as HF's own cache does)."""
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * n
    return [i for i in range(n) if policy.evicts and policy.layer_budget(i) is not None
            and types[i] != "sliding_attention"]


class SlotCache(Cache):
    """A static, policy-managed cache for `b` runs (batch rows) of one model and one policy (module doc)."""

    def __init__(self, model: Any, policy: Policy, batch: int, capacity: int | list[int], full_capacity: int,
                 window: int = 0, attention: bool = False) -> None:
        super().__init__(layers=[])
        cfg = model.config.get_text_config(decoder=True)
        n, h_kv, h_q = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads
        d = head_dim(cfg)
        policy.attach(n, d)
        self.policy, self.num_layers = policy, n
        dtype, device = model.dtype, model.device
        evicted = evicted_layers(cfg, policy)
        kept = [i for i in range(n) if i not in evicted]
        w = window  # the query ring's length (Policy.query_window); `attention`: keep the stored queries' attention
        slots = [capacity] * len(evicted) if isinstance(capacity, int) else capacity  # per evicting layer
        # attention computed explicitly: a softcap (sdpa has none) in every layer, a policy that reads it in its own
        softcap = bool(getattr(cfg, "attn_logit_softcapping", None))
        self.evicting = _Group(evicted, batch, h_kv, h_q, slots, d, dtype, device, policy.state_names, w,
                               attention, softcap or policy.needs_attention) if evicted else None
        self.full = _Group(kept, batch, h_kv, h_q, [full_capacity] * len(kept), d, dtype, device, (), 0, False,
                           softcap) if kept else None
        self.index()
        # baddbmm's input (its beta is 0), in the dtype explicit attention computes in (at least float32)
        self.zero = torch.zeros((), dtype=torch.promote_types(dtype, torch.float32), device=device)
        self.seen = torch.zeros(batch, dtype=torch.long, device=device)  # (b,) tokens each row has seen
        self.fed = torch.zeros(batch, dtype=torch.long, device=device)  # (b,) tokens of the last forward
        self.window = w
        self.qpos = torch.full((batch, w + 1), -1, dtype=torch.long, device=device)  # (b, w + 1) stored queries'
        self.positions: torch.Tensor | None = None  # (b, t) the current forward's positions
        self.causal = False  # the current forward's (`begin`)
        self.no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)  # what HF's layers get: never read
        # set by `begin`: the ring slots (b, m) the forward's last m = min(t, w) queries go to (padding: the spare
        # slot w), and the same as a scatter index over a layer's queries (b, h_q, m, d)
        self.ring: torch.Tensor | None = None
        self.ring_q: torch.Tensor | None = None
        # per decoder layer, its fullest head's tokens at the first decoding step (set by the loop; for kvbench-bench)
        self.layer_tokens: list[int] | None = None
        # decoder layer -> its attention module; the model's attention scale and softcap (what scores recompute)
        self.modules = {m.layer_idx: m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")}
        self.scaling: float = next(iter(self.modules.values())).scaling if self.modules else d ** -0.5
        self.softcap: float | None = getattr(cfg, "attn_logit_softcapping", None)
        self.row_modules = tuple(self.modules.get(i) for i in (self.evicting.layers if self.evicting else ()))
        self.peak = torch.zeros(batch, dtype=torch.long, device=device)  # (b,) most tokens a head held, over time
        # (b,) most tokens all layers' heads held together, over time (x bytes_per_head_token: the K+V bytes held)
        self.peak_total = torch.zeros(batch, dtype=torch.long, device=device)
        self.peak_batch = torch.zeros((), dtype=torch.long, device=device)  # the most all rows held together
        # what the policy reads (its `decoding` set once the prompt is done: SAGE-KV selects differently then)
        self.view = self.make_view()

    def index(self) -> None:
        """`groups` (the evicting one first) and `where`: each decoder layer's group and row in it (its views)."""
        self.groups = [g for g in (self.evicting, self.full) if g is not None]
        self.where: dict[int, tuple[_Group, int]] = {}
        for group in self.groups:
            for row, layer in enumerate(group.layers):
                self.where[layer] = (group, row)

    # -- one forward ----------------------------------------------------------------------------------------------
    def begin(self, positions: torch.Tensor, causal: bool = False) -> None:
        """Before a forward of positions (b, t): where each layer's new tokens go, and the query positions. `causal`
        (the caller knows it on the host): the cache is empty and no row is padded, so the t tokens fill slots 0..t-1
        of every head in order and attention over those is causal (`slot_attention` builds no (t, S) mask)."""
        b, t = positions.shape
        self.positions, self.causal = positions, causal
        self.fed.copy_((positions >= 0).sum(dim=1))  # padding is not seen
        self.seen.add_(self.fed)
        want = torch.arange(1, t + 1, device=positions.device)  # (t,)
        for group in self.groups:
            L, _, h_kv, S, d = group.keys.shape
            # each head's first t free slots, in slot order: the j-th is the first where the running count of free
            # slots reaches j (a binary search per token, no sort)
            free = (group.pos < 0).long().cumsum(dim=-1)  # (L, b, h_kv, S) nondecreasing
            group.write = torch.searchsorted(free, want.expand(L, b, h_kv, t).contiguous())  # (L, b, h_kv, t)
            group.pos.scatter_(-1, group.write, positions.view(1, b, 1, t).expand(L, b, h_kv, t))
            for state in group.state.values():
                state.scatter_(-1, group.write, 0.0)
            if group.probs is not None:  # no stored query sees the new tokens (they are later)
                _, _, h_q, w, _ = group.probs.shape
                slots = group.write.repeat_interleave(h_q // h_kv, dim=2).unsqueeze(3)  # (L, b, h_q, 1, t)
                group.probs.scatter_(-1, slots.expand(L, b, h_q, w, t), 0.0)
            group.write_kv = group.write.unsqueeze(-1).expand(L, b, h_kv, t, d).unbind(0)
            if causal:  # slot_attention builds the (t, t) masks it needs
                group.visible = group.masks = group.hidden = ()
                continue
            pos = group.pos.unsqueeze(3)  # (L, b, h_kv, 1, S)
            query = positions.view(1, b, 1, t, 1)
            # held (0 <= pos) and not after the query; a padding token (PAD) sees only padding (PAD <= pos <= PAD)
            visible = (pos <= query) & (pos >= query.clamp(max=0))  # (L, b, h_kv, t, S)
            group.visible = visible.unbind(0)  # (b, h_kv, t, S) each
            group.masks = () if group.explicit else visible.flatten(1, 2).unsqueeze(2).unbind(0)
            group.hidden = (~visible).unsqueeze(3).unbind(0) if group.explicit else ()
            if min(group.limits) < S:  # per-layer budgets: each layer attends over its own first S_l slots
                group.visible = tuple(v[..., :s] for v, s in zip(group.visible, group.limits))
                group.masks = tuple(m[..., :s] for m, s in zip(group.masks, group.limits))
                group.hidden = tuple(h[..., :s] for h, s in zip(group.hidden, group.limits))
        # the ring: the last m = min(t, w) queries go to slots position % w (positions end at seen - 1), padding to w
        w = self.window
        if w:
            m = min(t, w)
            slot = (self.seen.view(b, 1) - m + torch.arange(m, device=positions.device)).remainder(w)  # (b, m)
            self.ring = torch.where(positions[:, t - m:] >= 0, slot, w)
            self.qpos.scatter_(1, self.ring, positions[:, t - m:])
            if self.evicting is not None and self.evicting.queries is not None:
                _, _, h_q, _, d = self.evicting.queries.shape
                self.ring_q = self.ring.view(b, 1, m, 1).expand(b, h_q, m, d)

    def settle(self) -> None:
        """After a forward, before its eviction: the peaks of tokens held; for every evicting layer at once, the
        attention rows of the queries that entered the ring (over the slots they saw: every one held now) and the
        per-token state of its tokens (`Policy.token_state`, one call), written at their slots (`begin` set it to 0)."""
        held = (self.groups[0].pos >= 0).sum(dim=-1)  # (layers, b, h_kv): the evicting layers first
        if len(self.groups) > 1:
            held = torch.cat([held, (self.groups[1].pos >= 0).sum(dim=-1)])
        torch.maximum(self.peak, held.amax(dim=(0, 2)), out=self.peak)  # in place: the buffers stay where they are
        torch.maximum(self.peak_total, held.sum(dim=(0, 2)), out=self.peak_total)
        torch.maximum(self.peak_batch, held.sum(), out=self.peak_batch)
        g = self.evicting
        if g is None:
            return
        if g.probs is not None and self.ring is not None:
            L, b, h_q, _, S = g.probs.shape
            d, m = g.queries.shape[-1], self.ring.shape[1]  # type: ignore[union-attr]
            ring = self.ring.view(1, b, 1, m, 1)
            query = g.queries.gather(3, ring.expand(L, b, h_q, m, d))  # type: ignore[union-attr]
            qpos = self.qpos.gather(1, self.ring).view(1, b, 1, m, 1)
            rows_b = torch.arange(b, device=qpos.device).view(b, 1).expand(b, m)
            # a few layers at a time (`CHUNK_BYTES`: a prompt block's w rows of all layers are 40 MB for SmolLM2 at
            # N = 1024); a decoding step's one row per layer is one chunk
            n = max(1, CHUNK_BYTES // (4 * b * h_q * m * S)) if g.keys.is_cpu else L
            for lo in range(0, L, n):
                pos = g.pos[lo:lo + n].unsqueeze(3)  # (n, b, h_kv, 1, S); hidden: not held, or after the query
                hidden = ((pos > qpos) | (pos < 0)).flatten(0, 1).unsqueeze(2)  # (n * b, h_kv, 1, m, S)
                rows = probabilities(query[lo:lo + n].flatten(0, 1), g.keys[lo:lo + n].flatten(0, 1), hidden,
                                     self.scaling, self.softcap, self.zero)  # (n * b, h_kv, g, m, S)
                # whole rows put over the (batch row, ring slot) axes (a scatter would read an index per entry)
                g.probs[lo:lo + n].permute(1, 3, 0, 2, 4).index_put_(
                    (rows_b, self.ring), rows.view(-1, b, h_q, m, S).float().permute(1, 3, 0, 2, 4))
        if self.policy.state_names:
            for name, new in self.policy.token_state(self.view, g.write).items():
                g.state[name].scatter_(-1, g.write, new.float())

    def adopt(self, trunk: SlotCache, end: int, fed: int, queries: torch.Tensor | None,
              received: Sequence[dict[int, torch.Tensor]]) -> None:
        """Start every row from a shared trunk (generate.run_trunk): its tokens before `end` in the slots a run alone
        writes them to, the query ring a run alone holds then (from `queries` (L_t, 1, h_q, W + 1, d), the trunk's
        ring at `end`; `fed`: the last forward's tokens), `received` (per forward, trunk row -> (1, h_kv, S_t))
        replayed into a policy that `needs_attention`; then `settle`, as after the forward that reached `end`."""
        b = self.seen.shape[0]
        for layer, (group, row) in self.where.items():
            source, r = trunk.where[layer]
            n = min(group.pos.shape[-1], source.pos.shape[-1])
            pos = source.pos[r, :, :, :n]  # (1, h_kv, n): the trunk went on past `end`; those slots are free here
            group.pos[row, :, :, :n] = pos.masked_fill(pos >= end, -1)
            group.keys[row, :, :, :n] = source.keys[r, :, :, :n]
            group.values[row, :, :, :n] = source.values[r, :, :, :n]
        self.seen.fill_(end)
        self.fed.fill_(fed)
        g, w = self.evicting, self.window
        if g is not None:
            rows = [trunk.where[layer][1] for layer in g.layers]
            if w and queries is not None and g.queries is not None:
                j = torch.arange(w, device=self.seen.device)
                p = end - 1 - (end - 1 - j).remainder(w)  # (w,) the latest position before `end` in ring slot j
                self.qpos[:, :w] = torch.where(p >= 0, p, -1)
                self.ring = torch.where(p >= 0, j, w).expand(b, w)  # the queries whose rows `settle` computes
                g.queries[:, :, :, :w] = queries[rows][:, :, :, p.clamp_min(0) % (queries.shape[3] - 1)]
            S = g.pos.shape[-1]
            for forward in received if self.policy.needs_attention else ():
                for row, r in enumerate(rows):
                    got = F.pad(forward[r], (0, max(0, S - forward[r].shape[-1])))[..., :S]  # (1, h_kv, S)
                    self.policy.on_attention(g.state_rows, row, got.expand(b, -1, -1))
            # the held slots, for `settle`: the trunk wrote positions 0..end-1 into slots 0..end-1 of every head (one
            # unpadded prompt, nothing evicted before `end`)
            g.write = torch.arange(end, device=g.pos.device).expand(*g.pos.shape[:3], end)
        self.settle()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a layer's new K/V (b, h_kv, t, d) into its free slots; returns its whole buffers (b, h_kv, S, d)."""
        group, row = self.where[layer_idx]
        keys, values = group.k_rows[row], group.v_rows[row]
        keys.scatter_(2, group.write_kv[row], key_states)  # positions and states were written by `begin`
        values.scatter_(2, group.write_kv[row], value_states)
        return keys, values

    # -- what the engine and observers read -------------------------------------------------------------------------
    def make_view(self) -> SlotView | None:
        """What a policy reads (`view`): views of the evicting group's buffers, which every forward updates in place,
        so made once (and for a fork); None when no layer evicts."""
        g = self.evicting
        if g is None:
            return None
        w = self.window  # the ring's spare slot w left out
        return SlotView(keys=g.keys, values=g.values, pos=g.pos, seen=self.seen, fed=self.fed, layers=tuple(g.layers),
                        scaling=self.scaling, softcap=self.softcap,
                        queries=g.queries[:, :, :, :w] if g.queries is not None else None,
                        qpos=self.qpos[:, :w] if g.queries is not None else None, state=g.state,
                        modules=self.row_modules, probs=g.probs[:, :, :, :w] if g.probs is not None else None)

    def layer_positions(self) -> list[torch.Tensor]:
        """Per decoder layer, its slots' positions (b, h_kv, S), -1 free (a trace's record)."""
        return [self.where[i][0].pos[self.where[i][1]].clone() for i in range(self.num_layers)]

    def fork(self) -> SlotCache:
        """An independent copy (the graded branch goes on from it)."""
        other = object.__new__(SlotCache)
        other.__dict__.update(self.__dict__)
        other.evicting = self.evicting.clone() if self.evicting is not None else None
        other.full = self.full.clone() if self.full is not None else None
        other.index()
        other.seen, other.fed, other.qpos = self.seen.clone(), self.fed.clone(), self.qpos.clone()
        other.peak, other.peak_total = self.peak.clone(), self.peak_total.clone()
        other.peak_batch = self.peak_batch.clone()
        other.view = other.make_view()
        if other.view is not None:
            other.view.decoding = self.view.decoding  # type: ignore[union-attr]
        return other

    def shrink(self, slots: list[int]) -> None:
        """Cut the evicting layers to `slots` per head (per layer; none below what a head holds: the caller's plan),
        each head's held slots moved to its first ones in slot order (after a one-pass prompt: decoding needs fewer)."""
        g = self.evicting
        assert g is not None
        order = (g.pos < 0).to(torch.uint8).argsort(dim=-1, stable=True)[..., :max(slots)]  # (L, b, h_kv, S) held first
        rows = order.unsqueeze(-1).expand(*order.shape, g.keys.shape[-1])
        g.keys, g.values = g.keys.gather(3, rows), g.values.gather(3, rows)
        g.pos, g.state = g.pos.gather(3, order), {k: v.gather(3, order) for k, v in g.state.items()}
        if g.probs is not None:  # (L, b, h_q, w + 1, S): a query head's rows over its KV head's slots
            idx = order.repeat_interleave(g.probs.shape[2] // order.shape[2], dim=2).unsqueeze(3)
            g.probs = g.probs.gather(4, idx.expand(-1, -1, -1, g.probs.shape[3], -1))
        g.limits = list(slots)
        g.rows()
        view, self.view = self.view, self.make_view()
        self.view.decoding = view.decoding  # type: ignore[union-attr]

    def static(self) -> SlotCache:
        """Tags every tensor of the cache (a compiled forward's inputs) as a fixed address, unguarded (another cache
        of the same shapes needs no recompilation): CUDA graph trees then replay over them and write them in place,
        where one input the graph writes that is not static keeps the whole forward from being a CUDA graph."""
        for t in tree_leaves([vars(x) for x in (self, *self.groups, self.view) if x is not None]):
            if isinstance(t, torch.Tensor):
                torch._dynamo.mark_static_address(t, guard=False)
        return self

    def bytes_per_head_token(self) -> int:
        """K+V bytes of one token in one KV head of one layer."""
        g = self.evicting if self.evicting is not None else self.full
        return 2 * g.keys.shape[4] * g.keys.element_size()

    def held(self) -> list[torch.Tensor]:
        """Per decoder layer, the tokens each row's heads hold, (b, h_kv)."""
        return [(self.where[i][0].pos[self.where[i][1]] >= 0).sum(dim=-1) for i in range(self.num_layers)]


class Caches(Cache):
    """Several slot caches as one forward's batch (generate._Together: the decoding steps of a sample's runs, each with
    a cache of its own): the forward's rows are the caches' rows in order; each cache writes, attends over (in
    `slot_attention`) and keeps its own rows, and the model's other layers see one batch."""

    def __init__(self, caches: Sequence[SlotCache]) -> None:
        super().__init__(layers=[])
        self.caches = list(caches)
        self.sizes = [c.seen.shape[0] for c in self.caches]  # each cache's rows
        self.no_mask = self.caches[0].no_mask
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # each cache's buffers of the layer being run (`update`)
        self.layer_tokens: list[int] | None = None  # as SlotCache's (no observer reads it here)

    def begin(self, positions: torch.Tensor, causal: bool = False) -> None:
        for cache, p in zip(self.caches, positions.split(self.sizes)):
            cache.begin(p, causal)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.kv = [c.update(k, v, layer_idx) for c, k, v in
                   zip(self.caches, key_states.split(self.sizes), value_states.split(self.sizes))]
        return key_states, value_states  # slot_attention reads each cache's own (`kv`)

    def settle(self) -> None:
        for cache in self.caches:
            cache.settle()


# -- eviction ---------------------------------------------------------------------------------------------------------
def select(policy: Policy, view: SlotView, counts: torch.Tensor) -> torch.Tensor:
    """(L, b, h_kv, S) bool: the slots an eviction frees. Each head keeps its top `counts` (L, b, 1) tokens (the
    layers' budgets per row; the policy's `counts` may allocate per head) by the policy's score, the protected tokens
    first, ties to the earlier token: one ranking for every layer."""
    view.budgets = counts
    ranked = policy.score(view).float()  # (L, b, h_kv, S)
    ranked = torch.where(view.protected(policy.n_sink, policy.n_recent), math.inf, ranked)
    ranked = ranked.masked_fill(view.pos < 0, -math.inf)
    counts = policy.counts(view, ranked, counts)  # (L, b, h_kv | 1)
    return ranks(ranked, view.pos) >= counts.unsqueeze(-1)


# -- attention --------------------------------------------------------------------------------------------------------
def slot_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                   slot_cache: SlotCache | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of the forward's queries (b, h_q, t, d) over a layer's slots (b, h_kv, S, d): a slot is visible
    to a query when it holds a token at a position up to the query's (and within the layer's sliding window). Feeds
    the policy what it asked for (its query window, the attention probabilities). Returns (b, t, h_q, d)."""
    cache = slot_cache
    if isinstance(cache, Caches):  # each cache's rows attend over its own slots
        parts = [slot_attention(module, q, k, v, attention_mask, scaling, dropout, slot_cache=c, **kwargs)[0]
                 for c, q, (k, v) in zip(cache.caches, query.split(cache.sizes), cache.kv)]
        return torch.cat(parts), None
    if cache is None:  # a forward outside kvbench's loop (HF's own generate, a plain forward): HF's sdpa
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    group, row = cache.where[module.layer_idx]
    scaling = module.head_dim ** -0.5 if scaling is None else scaling
    softcap, window = kwargs.get("softcap"), kwargs.get("sliding_window")
    (b, h_q, t, d), (h_kv, S) = query.shape, key.shape[1:3]
    p = cache.positions  # (b, t)
    if cache.causal:  # an empty cache, no padding (`begin`): slots 0..t-1 hold the forward's positions, in order
        # (b, 1, t, t), every head alike, built only where it is read; none for sdpa's causal kernel
        visible = (p.view(b, 1, 1, t) <= p.view(b, 1, t, 1)) if window or group.explicit else None
        mask = None
    else:
        visible, mask = group.visible[row], group.masks[row] if group.masks else None  # (b, h_kv, t, S), sdpa's
    if window:  # a sliding layer (never evicted): the slot holding position p is slot p
        kpos = p.view(b, 1, 1, t) if cache.causal else group.pos[row].unsqueeze(2)  # (b, h_kv | 1, 1, n)
        visible = visible & (kpos > p.view(b, 1, t, 1) - window)
    policy = cache.policy
    if group is cache.evicting and group.queries is not None:  # the forward's last queries enter the ring
        group.q_rows[row].scatter_(2, cache.ring_q, query[:, :, t - cache.ring_q.shape[2]:])
    attends = policy.needs_attention and group is cache.evicting
    if not group.explicit:  # sdpa, each KV head a batch entry (`k_flat`); its causal kernel when it can
        causal = cache.causal and not window
        if window:  # (b * h_kv, 1, t, n) as sdpa reads it
            mask = visible.expand(b, h_kv, t, -1).reshape(b * h_kv, 1, t, -1)
        k, v = group.k_flat[row], group.v_flat[row]  # (b * h_kv, 1, S, d)
        if cache.causal:
            k, v = k[:, :, :t], v[:, :, :t]
        out = F.scaled_dot_product_attention(query.reshape(b * h_kv, h_q // h_kv, t, d), k, v, attn_mask=mask,
                                             scale=scaling, is_causal=causal, enable_gqa=True)
        return out.view(b, h_q, t, d).transpose(1, 2), None
    if cache.causal:
        key, value = key[:, :, :t], value[:, :, :t]
    # explicit (sdpa has no softcap; a policy reads the probabilities): the output from them, in the input dtype
    hidden = (~visible).unsqueeze(2) if window or cache.causal else group.hidden[row]  # (b, h_kv | 1, 1, t, S)
    probs = probabilities(query, key, hidden, scaling, softcap, cache.zero)  # (b, h_kv, g, t, S | t)
    if attends:  # what each slot received from the forward's queries, summed over them and the KV head's query heads
        received = probs.sum(dim=(2, 3))  # (b, h_kv, S), causal: (b, h_kv, t), the slots after t received nothing
        policy.on_attention(group.state_rows, row, F.pad(received, (0, S - t)) if cache.causal else received)
    probs = probs if probs.dtype == value.dtype else probs.to(value.dtype)
    n = key.shape[2]  # S, or t when causal
    out = torch.bmm(probs.view(b * h_kv, h_q // h_kv * t, n), value.reshape(b * h_kv, n, -1))
    return out.view(b, h_q, t, -1).transpose(1, 2), None  # (b, t, h_q, d)


def probabilities(query: torch.Tensor, key: torch.Tensor, hidden: torch.Tensor, scaling: float,
                  softcap: float | None, zero: torch.Tensor) -> torch.Tensor:
    """(b, h_kv, g, t, S) attention probabilities of queries (b, h_q, t, d) over keys (b, h_kv, S, d), 0 where
    `hidden` (b, h_kv, 1, t, S): the model's scale fused into the product, its softcap, softmax, in `zero`'s dtype
    (at least float32 whatever the model's dtype, as sdpa's kernels accumulate; float64 for the reference)."""
    b, h_q, t, d = query.shape
    h_kv, S = key.shape[1], key.shape[2]
    q = query if query.dtype == zero.dtype else query.to(zero.dtype)
    k = key if key.dtype == zero.dtype else key.to(zero.dtype)
    logits = torch.baddbmm(zero, q.reshape(b * h_kv, h_q // h_kv * t, d), k.flatten(0, 1).transpose(1, 2), beta=0.0,
                           alpha=scaling).view(b, h_kv, h_q // h_kv, t, S)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return torch.softmax(logits.masked_fill_(hidden, -math.inf), dim=-1)


def install(model: Any) -> None:
    """Register the slot attention and select it for `model`. Its mask function is sdpa's, for forwards outside
    kvbench's loop (HF's own generate: they attend through sdpa); a slot-cache forward passes a 4-D placeholder mask,
    so HF builds none, and builds its own."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPL, slot_attention)
    AttentionMaskInterface.register(IMPL, sdpa_mask)
    model.set_attn_implementation(IMPL)


def forward(model: Any, cache: SlotCache, ids: torch.Tensor, positions: torch.Tensor, keep: int = 1,
            counts: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """One forward of ids (b, t) at positions (b, t) through the cache -> logits (b, keep, vocab) of the last rows;
    then the eviction when `counts` (L, b, 1) is given (the two one graph when compiled). `causal`: the cache is empty
    and no row padded (`SlotCache.begin`)."""
    cache.begin(positions, causal)
    # a 4-D attention_mask makes HF's mask preparation return it untouched (slot_attention builds its own)
    out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=keep,
                attention_mask=cache.no_mask, slot_cache=cache)
    cache.settle()  # the per-token state and the peaks held: before the eviction
    if counts is not None:  # the eviction: the slots `select` frees are marked free
        cache.view.pos.masked_fill_(select(cache.policy, cache.view, counts), -1)  # type: ignore[union-attr]
    return out.logits
