"""A decoding step's eviction of many layers in one call (slot reuse): a `LayerStack`.

With slot reuse (kvbench/engine/slots.py) every uniform layer of a decoding cache holds the same number of slots at
each step's eviction (its budget N + 1: one token in, one out), and a policy that declares `stackable` scores a layer
from its own per-token arrays only, each (batch row, KV head) on its own (kvbench/policies/base.py). Such a policy
selects in each of L layers what it selects in the matching batch rows of one layer of batch L * b holding the L
layers' arrays. So the layers that share a budget are stored in one (L, b, h_kv, n, ...) tensor per array, each
layer holding its row as a view, and evicted together as a layer of batch L * b: one chain of tensor operations per
step instead of L. On CPU each operation costs a few microseconds of dispatch whatever its size, and a decoding
eviction is ~15 of them per layer: one by one, StreamingLLM's took 3.4 ms of a 65 ms step over SmolLM2's 30 layers.

The next token is written into each layer's freed slot in place (`SlotReuse._fill_hole`), so the views stay views and
the stack stays current for the whole answer. A member whose arrays were replaced (a block of more than one token,
a gather) is no longer a view: the stack is rebuilt (one copy of every member) at the next eviction that can use it.
A stack is only used where its eviction is surely one token per head (each member at budget + 1); anything else
(the first eviction of a decoding phase that appended several tokens, diagnostics, a policy that is not stackable)
evicts layer by layer. The selections are the same as layer by layer: every operation of a stackable score works
row by row (tests/test_stack.py compares the kept positions step by step, and the float64 reference holds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbench.engine.cache import EvictingLayer
from kvbench.engine.stash import QueryStash

if TYPE_CHECKING:
    from kvbench.engine.cache import EvictingCache


class LayerStack(EvictingLayer):
    """`members` (uniform layers of one cache with equal shapes, per-token state names, `seen` and slot order) as one
    layer of batch L * b whose arrays the members' arrays are views of. It is evicted as any layer is
    (`Policy.evict`); its one-token-per-head drop hands each member its own hole, and a wider selection raises (the
    members' arrays are views: a gather would leave them behind)."""

    def __init__(self, members: list[EvictingLayer], spare: bool = False) -> None:
        lead = members[0]
        super().__init__(lead.layer_idx)  # the members share a budget: the lead's index stands for all
        self.members = members
        names = sorted(lead.state)
        # spare: one free slot after each member's n, left as its hole (position -1), where the next token goes: the
        # stack is then built in place of the step's append, with the same bytes copied
        keys = _stacked([m.keys for m in members], spare, 0.0)  # (L, b, h_kv, n (+ 1), d)
        values = _stacked([m.values for m in members], spare, 0.0)
        positions = _stacked([m.positions for m in members], spare, -1)  # (L, b, h_kv, n (+ 1))
        state = {k: _stacked([m.state[k] for m in members], spare, 0.0) for k in names}
        b, h, n = lead.positions.shape
        hole = torch.full((b, h, 1), n, dtype=torch.long, device=lead.positions.device) if spare else None
        for i, m in enumerate(members):
            m.keys, m.values, m.positions = keys[i], values[i], positions[i]
            m.state = {k: state[k][i] for k in names}
            m.in_stack = True  # its arrays are written in place from now on (see EvictingLayer.fork)
            if spare:
                m.hole = hole  # read only (SlotReuse._fill_hole): one tensor for every member
        self.keys, self.values = keys.flatten(0, 1), values.flatten(0, 1)  # (L*b, h_kv, n, d)
        self.positions = positions.flatten(0, 1)  # (L*b, h_kv, n)
        self.state = {k: s.flatten(0, 1) for k, s in state.items()}
        self.is_initialized, self.dtype, self.device = True, lead.dtype, lead.device
        self.reuse_slots = self.decoding = True
        self._views = [self._pointers(m) for m in members]

    @staticmethod
    def _pointers(layer: EvictingLayer) -> tuple[int, ...]:
        """Where the layer's arrays live (host-side: no read of the device)."""
        return (layer.keys.data_ptr(), layer.values.data_ptr(), layer.positions.data_ptr(),
                *(layer.state[k].data_ptr() for k in sorted(layer.state)))

    def current(self, members: list[EvictingLayer]) -> bool:
        """Whether `members` are this stack's members and still hold views of its arrays."""
        return (len(members) == len(self.members) and all(a is b for a, b in zip(members, self.members))
                and all(self._pointers(m) == p for m, p in zip(members, self._views)))

    def refresh(self) -> None:
        """Before an eviction: the members' bookkeeping (what a policy reads besides the arrays), and their stashed
        queries stacked as the arrays are (TOVA's latest query)."""
        lead = self.members[0]
        self.seen, self.chronological, self.hole = lead.seen, lead.chronological, None
        self.scaling, self.softcap, self.module = lead.scaling, lead.softcap, lead.module
        s = lead.stash
        if s.queries is not None:
            self.stash = QueryStash(torch.cat([m.stash.queries for m in self.members]), s.positions, s.first,
                                    s.window, s.end)  # (L*b, h_q, w, d)

    def _drop_one(self, idx: torch.Tensor) -> bool:
        if not super()._drop_one(idx):
            return False
        b = self.members[0].keys.shape[0]
        for m, hole in zip(self.members, self.hole.split(b)):  # (b, h_kv, 1) each; positions were marked in place
            m.hole = hole
        self.hole = None
        return True

    def _gather(self, idx: torch.Tensor, valid: None = None) -> None:
        raise RuntimeError("a layer stack drops one token per head only; evict its members one by one otherwise")

    def _keep_padded(self, idx: torch.Tensor, valid: torch.Tensor | None, rows: torch.Tensor) -> None:
        raise RuntimeError("a layer stack drops one token per head only; evict its members one by one otherwise")


def eviction_units(cache: EvictingCache) -> list[EvictingLayer]:
    """The layers of `cache` to evict now, in order, as `Policy.evict` takes them: its evicting layers one by one,
    except that the layers sharing a budget are one `LayerStack` where that is exact and surely drops one token per
    head: a stackable policy, slot reuse while decoding, every such layer uniform, at budget + 1, with the same shape,
    state, `seen` and slot order, no hole, no policy extras. The cache keeps its stacks (`cache.stacks`) from step to
    step; one is rebuilt when a member's arrays were replaced."""
    layers = cache.evicting_layers()
    policy = cache.policy
    if not (cache.stacking and policy is not None and policy.stackable and not cache.frozen):
        return layers
    groups: dict[int, list[EvictingLayer]] = {}
    for layer in layers:
        budget = policy.layer_budget(layer.layer_idx, layer.seen)
        if budget is not None and _stackable(layer, budget):
            groups.setdefault(budget, []).append(layer)
    units: list[EvictingLayer] = []
    stacked: set[int] = set()
    for budget, members in groups.items():
        if len(members) < 2 or not _alike(members):
            continue
        stack = cache.stacks.get(budget)
        if stack is None or not stack.current(members):
            stack = cache.stacks[budget] = LayerStack(members)
        stack.refresh()
        units.append(stack)
        stacked.update(id(m) for m in members)
    # a stack no group uses now holds a stale copy of its members' arrays: let it go
    cache.stacks = {budget: stack for budget, stack in cache.stacks.items() if stack in units}
    return units + [layer for layer in layers if id(layer) not in stacked]


def open_stacks(cache: EvictingCache) -> None:
    """Before a decoding phase: the layers that `eviction_units` will stack (each at its budget now) stacked already,
    with a spare slot each, so the first step writes its token into the spare slot instead of appending it (a copy of
    every layer either way). A no-op where they would not stack."""
    policy = cache.policy
    if not (cache.stacking and policy is not None and policy.stackable and not cache.frozen):
        return
    groups: dict[int, list[EvictingLayer]] = {}
    for layer in cache.evicting_layers():
        budget = policy.layer_budget(layer.layer_idx, layer.seen)
        if budget is not None and _stackable(layer, budget - 1):
            groups.setdefault(budget, []).append(layer)
    for budget, members in groups.items():
        if len(members) >= 2 and _alike(members):
            cache.stacks[budget] = LayerStack(members, spare=True)


def _stacked(arrays: list[torch.Tensor], spare: bool, fill: float) -> torch.Tensor:
    """(L, ...) the arrays stacked, with one more slot (`fill`) along the slot axis (2) when `spare`."""
    if not spare:
        return torch.stack(arrays)
    a = arrays[0]
    out = a.new_empty((len(arrays), *a.shape[:2], a.shape[2] + 1, *a.shape[3:]))  # (L, b, h_kv, n + 1, ...)
    out[:, :, :, -1] = fill
    for i, x in enumerate(arrays):
        out[i, :, :, :-1] = x
    return out


def _stackable(layer: EvictingLayer, budget: int) -> bool:
    """A layer whose eviction now is one token per head by slot reuse, with nothing of its own beyond its arrays."""
    return (layer.reuse_slots and layer.decoding and layer.uniform and layer.hole is None and not layer.extras
            and not layer.scratch and layer.keys is not None and layer.keys.dim() == 4
            and layer.keys.shape[-2] == budget + 1)


def _alike(members: list[EvictingLayer]) -> bool:
    """Equal shapes, state names, `seen`, slot order and stash shapes: what one batch of L * b rows needs."""
    lead = members[0]
    names = sorted(lead.state)
    q = lead.stash.queries
    return all(m.keys.shape == lead.keys.shape and m.values.shape == lead.values.shape and m.seen == lead.seen
               and m.chronological == lead.chronological and sorted(m.state) == names
               and (m.stash.queries is None) == (q is None)
               and (q is None or (m.stash.queries.shape == q.shape and m.stash.first == lead.stash.first))
               for m in members)
