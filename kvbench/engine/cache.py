"""A KV cache whose layers can really drop tokens, and keep HF's masks and RoPE positions right when they do.

Convention (the one HF's own `DynamicSlidingWindowLayer` uses): `get_seq_length()` is the number of tokens the
layer has *seen*, not the number it holds, and `get_mask_sizes(q)` returns `(physical + q, seen - physical)`.
With that, HF derives absolute RoPE positions (`seen + arange(q)`) and a causal mask over the physical slots by
itself, in plain forwards and in `generate`. Kept keys keep their original rotation (they are stored post-RoPE).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from kvbench.engine.ragged import RaggedStorage
from kvbench.engine.slots import SlotReuse, in_position_order, slot_rows
from kvbench.engine.stash import QueryStash

if TYPE_CHECKING:
    from kvbench.policies.base import Policy
    from kvbench.policies.layer import LayerExtra


class EvictingLayer(SlotReuse, RaggedStorage, DynamicLayer):
    """One full-attention layer's cache: K/V plus, per token, its absolute position and per-token policy state.

    Stored uniform (every KV head holds the same number of tokens): keys/values (b, h_kv, n, d), positions and each
    state tensor (b, h_kv, n), slots in chronological order. A layer of per-head budgets (AdaKV, CriticalKV on
    AdaKV, SAGE-KV) is stored flat per head instead (ragged: `flat`, a `FlatHeads`) and scored in a padded view
    (`padded`, a `PaddedView`), chosen after every eviction by what the layer holds (kvbench/engine/ragged.py).
    `update` appends the block at the end of every head and returns the layer's storage (for ragged layers the flat
    (S, d) tensors, which only the kvbench attention wrapper reads, head by head). `keep` stores a uniform selection
    of a uniform layer at once, any other through the padded view and `pack`, which may wait for the engine to read
    the new head sizes (`defer_pack`, `EvictingCache.settle`). With `reuse_slots` a decoding step's eviction of one
    token per head leaves a hole that the next token fills in place (kvbench/engine/slots.py: `SlotReuse`).

    A policy's own incremental per-layer state lives in the policies layer, in objects the layer holds in `extras`
    (`LayerExtra`, kvbench/policies/layer.py) and knows nothing about: it calls their hooks where its storage
    changes (`on_keep`, `on_unpack`, `on_pack`, `fork`), so per-token rows of theirs follow the tokens. SnapKV's
    observation window (kept incrementally by a `WindowRing`, kvbench/policies/window.py) is one.
    """

    is_sliding = False
    is_croppable = False  # cropping by count would break the seen/physical bookkeeping

    def __init__(self, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.seen = 0  # tokens ever appended (logical length)
        self.row_seen: torch.Tensor | None = None  # (b, 1, 1) per-row counts: only a stack of several samples' layers
        self.positions: torch.Tensor | None = None  # (b, h_kv, n) or ragged (S,): absolute position of each token
        self.state: dict[str, torch.Tensor] = {}  # name -> (b, h_kv, n) or ragged (S,) per-token policy state
        self.stash = QueryStash()  # the latest queries the policy asked for (Policy.query_window)
        self.peak_tokens = 0  # max over time of tokens held per KV head (ragged: layer total / (b * h_kv), ceil)
        self.decoding = False  # set by generate once the prompt is done (SAGE-KV only slides its window then)
        # tokens held per KV head at the first decoding step, its token included (kvbench-bench's HF reference then
        # holds as many in this layer: GenerationResult.layer_tokens)
        self.decode_tokens: int | None = None
        # Set by the attention wrapper at every forward: the model's attention scale and softcap (query_attention
        # rebuilds the weights with them) and the attention module (CriticalKV reads its o_proj).
        self.scaling: float | None = None
        self.softcap: float | None = None
        self.module: Any = None
        # Per-layer (not per-token) values a policy keeps from a forward to the eviction after it (HashEvict's
        # probe code); per-token values go in `state`.
        self.scratch: dict[str, torch.Tensor] = {}
        # Policy-owned per-layer objects (`LayerExtra`: SnapKV's WindowRing), created by the policies layer on first
        # use; the layer only calls their hooks where its storage changes (keep, unpack, pack, fork).
        self.extras: dict[str, LayerExtra] = {}
        self.in_stack = False  # its arrays are views of a LayerStack's (kvbench/engine/stack.py), written in place
        # (slots (b, h_kv, 1), keys (b, h_kv, 1, d), query (b, h_q, 1, d)) of a decoding token whose per-token state
        # waits for the eviction (`settle_state`, Policy.state_from_tokens); None: none waits
        self.state_due: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.row_layers: tuple[int, ...] | None = None  # one layer's rows (a LayerStack's are several layers')

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.padded is not None:
            raise RuntimeError("append to a layer in its padded scoring view; pack() it first")
        b, h, q, d = key_states.shape  # (b, h_kv, q, d)
        new_pos = torch.arange(self.seen, self.seen + q, device=key_states.device).expand(b, h, q)
        self.block_slots, self.block_states = None, None
        if self._fill_hole(key_states, value_states, new_pos):
            pass  # written in place into the slots the last eviction freed (SlotReuse)
        elif self.ragged:
            self._append_flat(key_states, value_states, new_pos)
        elif self.keys.numel() == 0:
            self.keys, self.values, self.positions = key_states, value_states, new_pos.contiguous()
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.positions = torch.cat([self.positions, new_pos], dim=-1)
            # policies fill the new tokens' state in the attention wrapper
            self.state = {k: torch.cat([s, s.new_zeros(b, h, q)], dim=-1) for k, s in self.state.items()}
        self.seen += q
        held = self.tokens_per_head()
        self.peak_tokens = max(self.peak_tokens, held)
        if self.decoding and self.decode_tokens is None:
            self.decode_tokens = held
        return self.keys, self.values

    def physical(self) -> int:
        """Tokens of the longest head (uniform layers: every head's length; a hole is not a token)."""
        if self.keys is None or self.keys.numel() == 0:
            return 0
        hole = self.hole is not None  # one slot of every head (ragged: one row of every head's segment)
        return (max(self.flat.sizes) if self.ragged else self.keys.shape[-2]) - hole

    def tokens_per_head(self) -> int:
        """Tokens held per KV head: the layer's total over its b * h_kv heads, rounded up (exact when uniform)."""
        if self.keys is None or self.keys.numel() == 0:
            return 0
        if self.ragged:
            return -(-sum(self.flat.sizes) // len(self.flat.sizes)) - (self.hole is not None)
        return self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Ragged layers ignore HF's mask (the wrapper attends head by head); the size only has to be consistent.
        phys = self.physical()
        return phys + query_length, self.seen - phys

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an evicting cache cannot be cropped by token count")

    # -- the scoring view and eviction (the ragged moves: RaggedStorage) ---------------------------------------
    def head_lengths(self) -> list[int]:
        """Real tokens each (batch, KV head) holds, row-major, on the host (no read of the device)."""
        if self.pending():
            raise RuntimeError("the layer's head sizes are not known until its pending selection is packed")
        if self.ragged:
            return [n - (self.hole is not None) for n in self.flat.sizes]
        if self.padded is not None:  # the padded view of a ragged layer
            return list(self.padded.sizes)
        if self.keys is None or self.keys.numel() == 0:
            return []
        b, h = self.keys.shape[:2]
        return [self.physical()] * (b * h)

    def keep(self, idx: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Keep only the slots `idx` (b, h_kv, k) of the (padded) layout, in chronological order; `valid` (b, h_kv, k)
        marks padding. A uniform result of a uniform layer is stored at once; a selection with padding, or of a
        padded view, is stored by `pack` (uniform or flat), which needs the new head sizes on the host: with
        `defer_pack` it waits for the engine to read them (with the decoded token), else it reads them itself."""
        if self.ragged:
            raise RuntimeError("keep() indexes the padded view; unpack() the ragged layer first")
        if self.padded is None and valid is None:  # uniform before and after
            if not self._drop_one(idx):  # a decoding step's one token per head: a hole, nothing moves (SlotReuse)
                self._gather(*in_position_order(self.positions, self.chronological, idx, None))
            return
        if not self._orders_at_pack():
            idx, valid = in_position_order(self.positions, self.chronological, idx, valid)
        self._keep_padded(idx, valid, slot_rows(idx, self.keys.shape[-2]))  # a padded view, or turning ragged

    def _gather(self, idx: torch.Tensor, valid: None = None) -> None:
        """Store the slots `idx` (b, h_kv, k) of a uniform layer, in that order (a copy of every per-token array)."""
        b, h, kept = idx.shape
        rows = slot_rows(idx, self.keys.shape[-2])
        for extra in self.extras.values():  # their own per-token rows (WindowRing: pruned lazily)
            extra.on_keep(self, idx, False)
        # K and V are copied row by row (index_select over the flattened (b*h*n, d) rows): one memcpy per kept token,
        # ~15x cheaper on CPU than gather with an index expanded over head_dim, which visits every element.
        self.keys = self.keys.reshape(-1, self.keys.shape[-1]).index_select(0, rows).view(b, h, kept, -1)
        self.values = self.values.reshape(-1, self.values.shape[-1]).index_select(0, rows).view(b, h, kept, -1)
        self.positions = self.positions.gather(2, idx)
        self.state = {k: v.gather(2, idx) for k, v in self.state.items()}
        self.chronological = True

    def fork(self) -> EvictingLayer:
        """An independent copy of this layer's state. K/V and positions are shared where they are only ever
        replaced: cloned where slots are written in place (a hole, a stack's views); a ragged layer's, whose free rows
        are written in place, shared copy-on-write (both layers' next append lays them out anew). Per-token policy
        state is written in place (set_block_state, H2O's accumulator), so it is cloned, and each extra makes its own
        copy (`LayerExtra.fork`), as the query stash does (its fields its own, its tensors shared)."""
        new = copy.copy(self)
        if self.hole is not None or self.in_stack:  # this layer's tensors are written in place: the copy's own
            new.keys, new.values, new.positions = self.keys.clone(), self.values.clone(), self.positions.clone()
            new.in_stack = False
        if self.flat is not None:  # a ragged layer's free rows are written in place: copy-on-write, both layers
            self.flat = new.flat = self.flat.shared()
        new.state = {k: v.clone() for k, v in self.state.items()}
        new.scratch = dict(self.scratch)
        new.extras = {k: extra.fork() for k, extra in self.extras.items()}
        new.stash = self.stash.fork()
        return new

    def follow(self, lead: EvictingLayer) -> None:
        """Append the block `lead` has just appended (`update`), holding lead's very K/V and positions instead of a
        copy: a member of a shared trunk (TrunkCache), whose layer held exactly what lead's did before the block.
        Safe to share because K/V and positions are only ever replaced, never written in place (as `fork` relies on);
        per-token state is this layer's own, extended with zeros as `update` extends it."""
        if not (self.uniform and lead.uniform):
            raise RuntimeError("only uniform layers in chronological order follow a trunk (nothing evicted yet)")
        q = lead.seen - self.seen
        if not self.is_initialized:
            self.lazy_initialization(lead.keys, lead.values)
        self.keys, self.values, self.positions = lead.keys, lead.values, lead.positions
        b, h = self.keys.shape[:2]
        self.state = {k: torch.cat([s, s.new_zeros(b, h, q)], dim=-1) for k, s in self.state.items()}
        self.seen = lead.seen
        self.peak_tokens = max(self.peak_tokens, self.tokens_per_head())

    def evicted_any(self) -> bool:
        """Whether the layer ever dropped a token: it holds fewer than it has seen (or per-head counts)."""
        if not self.uniform:
            return True
        return self.keys is not None and self.keys.numel() > 0 and self.keys.shape[-2] != self.seen

    def kv_bytes(self) -> int:
        """Bytes of K and V of the tokens held (ragged layers: their heads' tokens, not the free rows after them, at
        most SLACK per head, kvbench/engine/ragged.py)."""
        if self.keys is None:
            return 0
        if self.ragged:
            rows = sum(self.flat.sizes) - (len(self.flat.sizes) if self.hole is not None else 0)
            return rows * (self.keys.shape[-1] * self.keys.element_size()
                           + self.values.shape[-1] * self.values.element_size())
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


def settle_state(unit: EvictingLayer, policy: Policy | None) -> None:
    """Compute the per-token state a decoding step left due (`state_due`: Policy.state_from_tokens) in `unit`, a layer
    or a layer stack (kvbench/engine/stack.py, its `members`): for a stack whose every member has its token's state
    due, one `on_append` over all their rows (the keys (L*b, h_kv, 1, d) and queries (L*b, h_q, 1, d) of the L
    members' new tokens), written into the stack's state at each member's slot; else member by member. Each row's
    values are what the layer's own call computes (the policy treats each row on its own; tests/test_stack.py compares
    every bit). Per-layer values the call sets (`scratch`: HashEvict's probe) end up in the stack and its members
    alike."""
    members = getattr(unit, "members", None) or [unit]
    due = [m for m in members if m.state_due is not None]
    if not due or policy is None:
        return
    together = len(due) == len(members)
    for target, layers in [(unit, due)] if together else [(m, [m]) for m in due]:
        slots, keys, query = (torch.cat(parts) for parts in zip(*(m.state_due for m in layers)))
        new = policy.on_append(target, None, keys, None, query)  # (L*b, h_kv, 1) each
        for name in policy.state_names:
            target.state[name].scatter_(2, slots, new[name].to(target.state[name].dtype))
        for m in layers:
            m.state_due = None
    if len(members) > 1 and together:  # each member's rows of the stack's per-layer values
        sizes = [m.keys.shape[0] for m in members]
        for name, value in unit.scratch.items():
            for m, part in zip(members, value.split(sizes)):
                m.scratch[name] = part
    elif len(members) > 1:  # the stack's again from its members'
        unit.scratch = {k: torch.cat([m.scratch[k] for m in members]) for k in members[0].scratch}


class EvictingCache(Cache):
    """One `EvictingLayer` per full-attention layer of the model; sliding layers stay HF's (bounded already)."""

    def __init__(self, config: Any, policy: Policy | None = None) -> None:
        from transformers.cache_utils import get_layer_types_and_kwargs

        text_cfg = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_cfg)
        layers: list[Any] = []
        for i, (kind, kw) in enumerate(zip(layer_types, layer_kwargs)):
            if kind == "full_attention":
                layers.append(EvictingLayer(i))
            elif kind in ("sliding_attention", "chunked_attention") and "sliding_window" in kw:
                layers.append(DynamicSlidingWindowLayer(**kw))
            else:
                raise ValueError(f"layer {i} has attention type '{kind}', which kvbench does not support")
        super().__init__(layers=layers)
        self.policy = policy
        if policy is not None:
            policy.attach(len(layers))  # per-layer budgets (PyramidKV) depend on the model's depth
        self.frozen = False  # context_only scenario: no eviction after the context
        # Layers the policy ever evicts: the others (K-norm's first two) get no policy work in the attention wrapper.
        self.evicted = {i for i, layer in enumerate(layers) if isinstance(layer, EvictingLayer)
                        and policy is not None and policy.layer_budget(i) is not None}
        self.masks: dict[Any, torch.Tensor] = {}  # causal masks rebuilt for layers HF's mask does not fit (attention)
        # Latest queries to stash per layer (Policy.query_window; generate raises it to 1 for diagnostics).
        self.query_window = policy.query_window if policy is not None else 0
        # Evictions of many layers in one call (kvbench/engine/stack.py): the stacks by their first layer; the
        # prompt's too with `stack_prefill` (GenerationSettings.stack_prefill)
        self.stacks: dict[int, Any] = {}
        self.stack_prefill = False

    def fork(self) -> EvictingCache:
        """A copy that evolves independently from here on, with its own copy of the policy (a stochastic policy's
        generator included): the graded score's teacher-forced branch runs on it while the greedy decode goes on
        unchanged in this cache. Costs no K/V copy (see EvictingLayer.fork)."""
        new = copy.copy(self)
        for layer in self.evicting_layers():  # a state still due is computed first: the fork's copy includes it
            settle_state(layer, self.policy)
        new.layers = [layer.fork() if isinstance(layer, EvictingLayer) else copy.copy(layer) for layer in self.layers]
        new.policy = copy.deepcopy(self.policy)
        new.masks = dict(self.masks)
        new.stacks = {}  # its layers hold their own copies (EvictingLayer.fork): nothing stacked
        return new

    def reuse_decoding_slots(self) -> None:
        """Let a decoding eviction of one token per head leave a hole that the next token fills in place, instead of
        gathering the kept slots (GenerationSettings.slot_reuse; kvbench/engine/slots.py); ragged layers too where the
        policy allows it (Policy.ragged_slot_reuse: RaggedStorage.pack)."""
        ragged = self.policy is not None and self.policy.ragged_slot_reuse
        for layer in self.evicting_layers():
            layer.reuse_slots = True
            layer.reuse_ragged_slots = ragged

    def start_decoding(self) -> None:
        for layer in self.evicting_layers():
            layer.decoding = True

    def defer_packing(self) -> None:
        """Let selections that change head sizes wait for `settle` (see EvictingLayer.pack): the engine then reads
        every layer's new sizes at once instead of one host read per layer."""
        for layer in self.evicting_layers():
            layer.defer_pack = True

    def pending_layers(self) -> list[EvictingLayer]:
        """The layers whose selection waits for its head sizes (in layer order)."""
        return [layer for layer in self.evicting_layers() if layer.pending()]

    def settle(self, layers: list[EvictingLayer] | None = None, sizes: list[int] | None = None) -> None:
        """Store the pending selections of `layers` (default: every pending layer), given their head sizes `sizes`
        (each pending view's `kept_counts`, concatenated in order) or reading them here in one host read."""
        layers = self.pending_layers() if layers is None else layers
        if not layers:
            return
        if sizes is None:
            sizes = torch.cat([layer.padded.kept_counts() for layer in layers]).tolist()  # one host read for all
        at = 0
        for layer in layers:
            n = layer.valid.shape[0] * layer.valid.shape[1]
            layer.pack(sizes[at:at + n])
            at += n

    def evicting_layers(self) -> list[EvictingLayer]:
        return [layer for layer in self.layers if isinstance(layer, EvictingLayer)]

    def peak_tokens(self) -> int:
        """Max over layers and over the cache's lifetime of the tokens a layer held per KV head.

        Per KV head = the layer's total held tokens / (batch x h_kv), rounded up: every head's length for uniform
        layers, the per-head average for ragged (per-head budget) layers, whose heads differ.
        """
        return max((layer.peak_tokens for layer in self.evicting_layers()), default=0)

    def decode_tokens(self) -> list[int] | None:
        """Per layer, the tokens it held per KV head at the first decoding step, that step's token included (as
        `peak_tokens` counts them); None before a decoding step."""
        held = [layer.decode_tokens for layer in self.evicting_layers()]
        return None if not held or None in held else held

    def kv_bytes(self) -> int:
        """Bytes of K and V held now, all layers (exact: what the tensors hold, no padding)."""
        return kv_bytes(self)

    def head_positions(self) -> list[torch.Tensor | None]:
        """Per layer, (b, h_kv, L) absolute positions of the tokens each head holds (-1 pads ragged heads);
        None for layers HF bounds itself (sliding)."""
        return [layer.head_positions() if isinstance(layer, EvictingLayer) else None for layer in self.layers]


class _MembersLayer(DynamicLayer):
    """One model layer of a cache made of several runs' caches (`BatchCache`, `TrunkCache`): the members' own layers
    at this depth, which hold the K/V; this layer only routes a forward's block to them."""

    is_sliding = False
    is_compileable = False

    def __init__(self, members: list[EvictingLayer]) -> None:
        super().__init__()
        self.members = members


class _BatchLayer(_MembersLayer):
    """One model layer of a `BatchCache`: hands each sample's rows of the new keys/values to that sample's own layer."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        # key_states (k, h_kv, q, d): row j is sample j's block
        for j, layer in enumerate(self.members):
            layer.update(key_states[j:j + 1], value_states[j:j + 1])
        return key_states, value_states  # not read: the attention wrapper attends each sample over its own layer

    def get_seq_length(self) -> int:
        return 0  # positions come from the forward's position_ids (each sample's own), never from here

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # HF's mask is not used: the wrapper builds each sample's own (attention._fit_mask)


class BatchCache(Cache):
    """The per-sample caches of one batched forward, as the single `past_key_values` the model takes.

    Each sample keeps its own `EvictingCache` (its own kept tokens, positions, per-token state and policy copy), so
    nothing of one sample's cache depends on the others. The model runs its projections and MLPs on the k samples'
    rows at once (what batching buys: the weights are read once per step); the kvbench attention wrapper sees this
    cache and attends each sample over its own layer, as a batch-1 forward would, and each sample's policy evicts its
    own cache afterwards. The forward must pass `position_ids` (k, q): each sample's own positions. Built per
    forward (a list of references: nothing copied), so samples leave a batch by not being in the next one.
    Only caches whose every layer is an `EvictingLayer` batch (a sliding layer's mask and length are per sample).
    """

    def __init__(self, caches: list[EvictingCache]) -> None:
        if not caches or not all(batchable(c) for c in caches):
            raise ValueError("only caches of full-attention layers batch (a sliding layer's length is per sample)")
        super().__init__(layers=[_BatchLayer([c.layers[i] for c in caches]) for i in range(len(caches[0].layers))])
        self.caches = caches


class _TrunkLayer(_MembersLayer):
    """One model layer of a `TrunkCache`: the block's K/V go into the lead member's layer (`update`), and every other
    member's layer follows it (the same tensors, its own per-token state)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        # key_states (1, h_kv, q, d): the one sample's block, the same for every member
        lead = self.members[0]
        keys, values = lead.update(key_states, value_states)
        for layer in self.members[1:]:
            layer.follow(lead)
        return keys, values

    def get_seq_length(self) -> int:
        return self.members[0].get_seq_length()  # every member has seen as many tokens: the solo positions

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.members[0].get_mask_sizes(query_length)  # every member holds the same slots: the solo mask


class TrunkCache(Cache):
    """The caches of several runs of one prompt (a sweep's policies and budgets) while none of them has evicted: they
    hold identical K/V, so one batch-1 forward serves them all (`generate.generate_shared`).

    Each run keeps its own `EvictingCache` (own policy copy, own per-token state, stashed queries, attention
    statistics); the K/V tensors are held once, by reference (`EvictingLayer.follow`). The kvbench attention wrapper
    runs every member's hooks on its own layer and computes the attention output once: every member must take the same
    attention path (explicit attention on the same layers, or none), which `generate` groups by. A member leaves the
    trunk as soon as its eviction drops anything; the forward is then exactly its solo forward. `hook_s` collects
    each member's seconds inside the wrapper (its own work), with `clock`.
    """

    def __init__(self, caches: list[EvictingCache], clock: Any = None) -> None:
        if not caches or not all(batchable(c) for c in caches):
            raise ValueError("only caches of full-attention layers share a trunk")
        super().__init__(layers=[_TrunkLayer([c.layers[i] for c in caches]) for i in range(len(caches[0].layers))])
        self.caches = caches
        self.clock = clock
        self.hook_s = [0.0] * len(caches)


def kv_bytes(cache: Cache) -> int:
    """Bytes of K and V held by any HF cache's layers now (sliding and evicting layers alike; no padding counted)."""
    return sum(layer.kv_bytes() if isinstance(layer, EvictingLayer) else
               sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
               for layer in cache.layers if layer.keys is not None)


def batchable(cache: EvictingCache) -> bool:
    """Whether `cache` can be one sample of a `BatchCache`: every layer is an EvictingLayer."""
    return all(isinstance(layer, EvictingLayer) for layer in cache.layers)
