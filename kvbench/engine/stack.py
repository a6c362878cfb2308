"""A decoding step's eviction of many layers in one call (slot reuse): a `LayerStack`.

With slot reuse (kvbench/engine/slots.py) every uniform layer of a decoding cache holds the same number of slots at
each step's eviction (its budget N + 1: one token in, one out), and a policy that declares `stackable` scores a layer
from its own per-token arrays only, each (batch row, KV head) on its own (kvbench/policies/base.py). Such a policy
selects in each of L layers what it selects in the matching batch rows of one layer of batch L * b holding the L
layers' arrays. So consecutive layers that share a budget are stored in one (L, b, h_kv, n, ...) tensor per array,
each layer holding its row as a view, and evicted together as a layer of batch L * b: one chain of tensor operations
per step instead of L. On CPU each operation costs a few microseconds of dispatch whatever its size, and a decoding
eviction is ~15 of them per layer: one by one, StreamingLLM's took 3.4 ms of a 65 ms step over SmolLM2's 30 layers,
stacked 2.1-2.2 ms (results/bench_smollm2/engine_4k_stack.md). The stack is built before the first decoding step with a
spare slot per layer (`open_stacks`), in place of that step's append: the same bytes copied once.

The next token is written into each layer's freed slot in place (`SlotReuse._fill_hole`), so the views stay views and
the stack stays current for the whole answer. A member whose arrays were replaced (a block of more than one token,
a gather) is no longer a view: the stack is rebuilt (one copy of every member) at the next eviction that can use it.
A stack is only used where its eviction is surely one token per head (each member at budget + 1); anything else
(the first eviction of a decoding phase that appended several tokens, diagnostics, a policy that is not stackable)
evicts layer by layer. The selections are the same as layer by layer: every operation of a stackable score works
row by row (tests/test_stack.py compares the kept positions step by step, and the float64 reference holds).

The prompt's evictions stack too with `cache.stack_prefill` (GenerationSettings.stack_prefill; the run setting
`stack_prefill`: `auto`, the default, stacks on a CUDA device only): after a block every layer of one budget holds as
many slots, so its run is copied into one stack and evicted as one layer; the stack's gather leaves each member its rows
of the kept arrays as views (`LayerStack._gather`), and the next block's append replaces them. The selections are the
same as layer by layer (tests/test_stack.py, float64). It pays on a GPU, where each layer's eviction is a chain of small
kernel launches: on an H200 the prompt's evictions at 4k tokens took 32-48 ms stacked against 167-559 ms
(results/bench_gpu/prefill_pairs_h200.md); on the CPU the copy of every layer per block costs more than it saves
(SnapKV's prompt evictions at 4k tokens: 2.96 s stacked against 2.13 s, results/bench_smollm2/engine_4k_prefill_stack).

In a batch, the samples whose policies select alike (`Policy.batch_key`) go further: their layers of one run are one
stack across the samples (`SampleStacks`), a decoding step's evictions of the whole batch one call per run of layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbench.engine.cache import EvictingLayer
from kvbench.engine.stash import QueryStash

if TYPE_CHECKING:
    from kvbench.engine.cache import EvictingCache
    from kvbench.policies.base import Policy


class LayerStack(EvictingLayer):
    """`members` (uniform layers with equal shapes, per-token state names and slot order: of one cache, or of several
    samples' caches, `SampleStacks`, whose counts `seen` may differ) as one layer of batch L * b whose arrays the
    members' arrays are views of. It is evicted as any layer is
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
        self.row_layers = tuple(m.layer_idx for m in members for _ in range(b))  # (HashEvict's per-layer projections)
        hole = torch.full((b, h, 1), n, dtype=torch.long, device=lead.positions.device) if spare else None
        for i, m in enumerate(members):
            m.keys, m.values, m.positions = keys[i], values[i], positions[i]
            m.state = {k: state[k][i] for k in names}
            # Stackable extras (SnapKV's window ring) cache what the arrays determine: the stack builds its own over
            # all its rows at its first eviction, and a member evicted on its own later builds its own again (a
            # member's kept while the stack evicts would go stale)
            m.extras = {}
            # a decoding stack's arrays are written in place from now on (see EvictingLayer.fork); a prompt's stack
            # only gathers, into new arrays (a spare slot only opens a decoding phase)
            m.in_stack = spare or lead.decoding
            if spare:
                m.hole = hole  # read only (SlotReuse._fill_hole): one tensor for every member
        self.keys, self.values = keys.flatten(0, 1), values.flatten(0, 1)  # (L*b, h_kv, n, d)
        self.positions = positions.flatten(0, 1)  # (L*b, h_kv, n)
        self.state = {k: s.flatten(0, 1) for k, s in state.items()}
        self.is_initialized, self.dtype, self.device = True, lead.dtype, lead.device
        self.reuse_slots, self.decoding = lead.reuse_slots, lead.decoding
        self._views = [self._pointers(m) for m in members]
        # Members of several samples (`SampleStacks`) have seen different numbers of tokens; they step together, so
        # each keeps its offset to the lead's count, and each row's own count (`row_seen`) is the lead's plus its
        # offset: (L*b, 1, 1), built on the host once, then one addition per step. None when every member saw as many.
        self._offsets = [m.seen - lead.seen for m in members]
        self._row_offsets = None if not any(self._offsets) else torch.tensor(
            self._offsets, device=lead.positions.device).repeat_interleave(b).view(-1, 1, 1)

    @staticmethod
    def _pointers(layer: EvictingLayer) -> tuple[int, ...]:
        """Where the layer's arrays live (host-side: no read of the device)."""
        return (layer.keys.data_ptr(), layer.values.data_ptr(), layer.positions.data_ptr(),
                *(layer.state[k].data_ptr() for k in sorted(layer.state)))

    def current(self, members: list[EvictingLayer]) -> bool:
        """Whether `members` are this stack's members and still hold views of its arrays."""
        lead = self.members[0]
        return (len(members) == len(self.members) and all(a is b for a, b in zip(members, self.members))
                and self.decoding == lead.decoding
                and all(self._pointers(m) == p for m, p in zip(members, self._views))
                and all(m.seen - lead.seen == o for m, o in zip(members, self._offsets)))

    def refresh(self) -> None:
        """Before an eviction: the members' bookkeeping (what a policy reads besides the arrays), and their stashed
        queries (TOVA's latest query) and scratch (HashEvict's probe) stacked as the arrays are."""
        lead = self.members[0]
        self.seen, self.chronological, self.hole = lead.seen, lead.chronological, None
        self.row_seen = None if self._row_offsets is None else self._row_offsets + lead.seen  # (L*b, 1, 1)
        self.scaling, self.softcap, self.module = lead.scaling, lead.softcap, lead.module
        s = lead.stash
        if s.queries is not None:
            self.stash = QueryStash(torch.cat([m.stash.queries for m in self.members]), s.positions, s.first,
                                    s.window, s.end)  # (L*b, h_q, w, d)
        # per-layer values from the forward (HashEvict's probe), (b, ...) each -> (L*b, ...)
        self.scratch = {k: torch.cat([m.scratch[k] for m in self.members]) for k in lead.scratch}

    def _open_hole(self, hole: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """A one-token-per-head drop (`_drop_one`, `drop_position`): each member gets its rows' hole (b, h_kv, 1)."""
        super()._open_hole(hole, rows)  # the positions marked in place, in the arrays the members view
        b = self.members[0].keys.shape[0]
        for m, part in zip(self.members, hole.split(b)):
            m.hole = part
        self.hole = None

    def _gather(self, idx: torch.Tensor, valid: None = None) -> None:
        """A prompt block's eviction (`idx` (L*b, h_kv, k)): the kept slots gathered as one layer's are (new arrays),
        each member then holding its rows of them as views. A decoding stack's members write into its arrays in place,
        so a gather there would leave them behind: it drops one token per head only."""
        if self.decoding:
            raise RuntimeError("a decoding layer stack drops one token per head only; evict its members one by one "
                               "otherwise")
        super()._gather(idx)
        b = self.members[0].keys.shape[0]
        for i, m in enumerate(self.members):
            rows = slice(i * b, (i + 1) * b)
            m.keys, m.values, m.positions = self.keys[rows], self.values[rows], self.positions[rows]
            m.state = {k: s[rows] for k, s in self.state.items()}
            m.chronological = True
        self._views = [self._pointers(m) for m in self.members]

    def _keep_padded(self, idx: torch.Tensor, valid: torch.Tensor | None, rows: torch.Tensor) -> None:
        raise RuntimeError("a layer stack drops one token per head only; evict its members one by one otherwise")


def eviction_units(cache: EvictingCache) -> list[EvictingLayer]:
    """The layers of `cache` to evict now, in layer order, as `Policy.evict` takes them: one by one, except that each
    run of consecutive layers of one budget (at least two) is one `LayerStack` where that is exact and surely drops
    one token per head (`_runs`). Consecutive, so that a policy drawing random numbers per layer (Random) draws them
    in the same order either way. The cache keeps its stacks (`cache.stacks`, by their first layer) from step to step;
    one is rebuilt when a member's arrays were replaced."""
    units: list[EvictingLayer] = []
    stacks: dict[int, LayerStack] = {}
    for ok, run in _runs(cache, spare=False):
        if ok and len(run) >= 2:
            stack = _current(cache.stacks, run) or LayerStack(run)  # _runs made the run's layers alike
            stack.refresh()
            stacks[run[0].layer_idx] = stack
            units.append(stack)
        else:
            units.extend(run)
    cache.stacks = stacks  # a stack no run uses now holds a stale copy of its members' arrays: let it go
    return units


def open_stacks(cache: EvictingCache) -> None:
    """Before a decoding phase: the runs of layers that `eviction_units` will stack (each layer at its budget now)
    stacked already, with a spare slot each, so the first step writes its token into the spare slot instead of
    appending it (a copy of every layer either way). A no-op where they would not stack."""
    for ok, run in _runs(cache, spare=True):
        if ok and len(run) >= 2:
            cache.stacks[run[0].layer_idx] = LayerStack(run, spare=True)


class SampleStacks:
    """The decoding evictions of several samples of a batch in one call per run of layers: each run's layers of every
    sample in one `LayerStack` (K samples x L layers as one layer of batch K * L * b). For samples whose policies
    select alike (`Policy.batch_key`: the same stackable policy and settings, no per-sample state) and whose caches
    stack the same runs of layers; each row is scored on its own as in a stack of one sample's layers, so every
    sample keeps what it keeps alone (tests/test_stack.py). Samples that saw different numbers of tokens (prompts of
    other lengths) stack too: each row has its own `row_seen`. The stacks are kept from step to step and rebuilt
    when the batch's members change (a sample leaves) or a member's arrays were replaced."""

    def __init__(self) -> None:
        self.stacks: dict[int, LayerStack] = {}  # by the run's first layer

    def open(self, caches: list[EvictingCache]) -> None:
        """Before the samples decode together: their runs stacked with a spare slot each (as `open_stacks`), or each
        cache's own where the samples' runs differ."""
        plan = _sample_runs(caches, spare=True)
        if plan is None or not all(_alike_all(run) for ok, run in plan if ok):
            for cache in caches:
                open_stacks(cache)
            return
        for cache in caches:
            cache.stacks = {}  # their layers are the samples' stacks' views now
        self.stacks = {run[0].layer_idx: LayerStack(run, spare=True) for ok, run in plan if ok}

    def units(self, caches: list[EvictingCache]) -> list[tuple[Policy, EvictingLayer]] | None:
        """The layers of the samples' caches to evict now with the policy that evicts each: one stack per run of
        layers over every sample (the first sample's policy, which selects as each sample's own does) and each other
        layer with its own cache's policy; None when the samples' runs of layers differ, or a stack to build would
        hold members that are not alike (each evicts on its own). A held stack still current needs no check: its
        members are the same layers, holding the same arrays, at the same offsets of their counts."""
        plan = _sample_runs(caches, spare=False)
        if plan is None:
            self.stacks = {}
            return None
        units: list[tuple[Policy, EvictingLayer]] = []
        stacks: dict[int, LayerStack] = {}
        for ok, run in plan:
            if not ok:
                units += [(cache.policy, layer) for cache, layer in zip(caches, run)]
                continue
            stack = _current(self.stacks, run)
            if stack is None:
                if not _alike_all(run):
                    self.stacks = {}
                    return None
                stack = LayerStack(run)
            stack.refresh()
            stacks[run[0].layer_idx] = stack
            units.append((caches[0].policy, stack))
        self.stacks = stacks
        for cache in caches:
            cache.stacks = {}
        return units


def _current(held: dict[int, LayerStack], members: list[EvictingLayer]) -> LayerStack | None:
    """The held stack of `members` (by their first layer) when it is still current, else None."""
    stack = held.get(members[0].layer_idx)
    return stack if stack is not None and stack.current(members) else None


def _alike_all(members: list[EvictingLayer]) -> bool:
    """Whether one stack can hold `members` (`_alike` with the first)."""
    return all(_alike(members[0], m) for m in members[1:])


def _sample_runs(caches: list[EvictingCache], spare: bool) -> list[tuple[bool, list[EvictingLayer]]] | None:
    """The runs of layers of several samples' caches side by side: for each run of one sample's layers that stacks,
    (True, that run's layers of every sample, sample by sample); for each other layer, (False, that layer of every
    sample). None when the caches run other layers; whether the samples' layers of a run are alike across the samples
    (`_alike_all`) the callers check where they build a stack."""
    plans = [_runs(cache, spare) for cache in caches]
    shape = [(ok, [m.layer_idx for m in run]) for ok, run in plans[0]]
    if any([(ok, [m.layer_idx for m in run]) for ok, run in plan] != shape for plan in plans[1:]):
        return None
    out: list[tuple[bool, list[EvictingLayer]]] = []
    for i, (ok, run) in enumerate(plans[0]):
        if ok:
            out.append((True, [m for plan in plans for m in plan[i][1]]))
        else:
            out += [(False, [plan[i][1][j] for plan in plans]) for j in range(len(run))]
    return out


def _runs(cache: EvictingCache, spare: bool) -> list[tuple[bool, list[EvictingLayer]]]:
    """The cache's evicting layers in order: each maximal run of consecutive layers that may be evicted as one stack
    as (True, its layers), and each other layer as (False, [layer]). Stackable: a stackable policy, each layer uniform,
    no hole, no policy extras but stackable ones (`LayerExtra.stackable`), alike (`_alike`) with the same budget, and
    either decoding with slot reuse at its budget + 1 (`spare`: at its budget, before the step that appends), or, with
    `cache.stack_prefill`, a prompt block's layer over its budget in chronological order."""
    layers = cache.evicting_layers()
    policy = cache.policy
    if not (policy is not None and policy.stackable and not cache.frozen):
        return [(False, [layer]) for layer in layers]
    out: list[tuple[bool, list[EvictingLayer]]] = []
    run: list[EvictingLayer] = []
    run_budget = None
    prefill = cache.stack_prefill and not spare  # (a spare slot only opens a decoding phase)
    for layer in layers:
        budget = policy.layer_budget(layer.layer_idx, layer.seen)
        ok = budget is not None and _stackable(layer, budget - 1 if spare else budget, prefill)
        if ok and run and budget == run_budget and _alike(run[0], layer):
            run.append(layer)
            continue
        if run:
            out.append((True, run))
        run, run_budget = ([layer], budget) if ok else ([], None)
        if not ok:
            out.append((False, [layer]))
    if run:
        out.append((True, run))
    return out


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


def _stackable(layer: EvictingLayer, budget: int, prefill: bool = False) -> bool:
    """A uniform layer with no hole and no policy extras but stackable ones, whose eviction now is either a decoding
    step's one token per head by slot reuse, or (`prefill`) a prompt block's gather of its chronological slots."""
    if not (layer.uniform and layer.hole is None and all(extra.stackable for extra in layer.extras.values())
            and layer.keys is not None and layer.keys.dim() == 4):
        return False
    if layer.decoding:
        return layer.reuse_slots and layer.keys.shape[-2] == budget + 1
    return prefill and layer.chronological and layer.keys.shape[-2] > budget


def _alike(lead: EvictingLayer, m: EvictingLayer) -> bool:
    """Equal shapes, state names, slot order, stash and scratch shapes: what one batch of rows needs. Layers of one
    cache have seen as many tokens; layers of samples that saw different numbers stack as well (each row its own
    `row_seen`), unless they hold stashed queries other than their latest one, whose causal mask reads absolute
    positions (the stack's stash holds the lead's)."""
    q, mq = lead.stash.queries, m.stash.queries
    if m.seen == lead.seen:
        same_stash = q is None or m.stash.first == lead.stash.first
    else:
        same_stash = q is None or (lead.stash.first == lead.seen - 1 and m.stash.first == m.seen - 1)
    return (m.keys.shape == lead.keys.shape and m.values.shape == lead.values.shape and same_stash
            and m.chronological == lead.chronological and sorted(m.state) == sorted(lead.state)
            and (mq is None) == (q is None) and (q is None or mq.shape == q.shape)
            and sorted(m.scratch) == sorted(lead.scratch)
            and all(m.scratch[k].shape == v.shape for k, v in lead.scratch.items()))
