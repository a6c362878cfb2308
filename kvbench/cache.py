"""A KV cache whose layers can really drop tokens, and keep HF's masks and RoPE positions right when they do.

Convention (the one HF's own `DynamicSlidingWindowLayer` uses): `get_seq_length()` is the number of tokens the
layer has *seen*, not the number it holds, and `get_mask_sizes(q)` returns `(physical + q, seen - physical)`.
With that, HF derives absolute RoPE positions (`seen + arange(q)`) and a causal mask over the physical slots by
itself, in plain forwards and in `generate`. Kept keys keep their original rotation (they are stored post-RoPE).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

if TYPE_CHECKING:
    from kvbench.policies.base import Policy


class EvictingLayer(DynamicLayer):
    """One full-attention layer's cache: K/V plus, per slot, its absolute position and per-token policy state.

    All per-slot tensors share the token axis and are pruned together by `keep`. `valid` (optional) marks real
    slots when heads hold different numbers of tokens (per-head budgets): shorter heads are padded at the end.
    """

    is_sliding = False
    is_croppable = False  # cropping by count would break the seen/physical bookkeeping

    def __init__(self, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.seen = 0  # tokens ever appended (logical length)
        self.positions: torch.Tensor | None = None  # (b, h_kv, n) absolute position of each slot
        self.valid: torch.Tensor | None = None  # (b, h_kv, n) bool, only for ragged per-head budgets
        self.state: dict[str, torch.Tensor] = {}  # name -> (b, h_kv, n) per-token policy state
        self.queries: torch.Tensor | None = None  # (b, h_q, w, d) latest queries kept for the policy
        self.query_positions: torch.Tensor | None = None  # (w,) absolute positions of those queries
        self.peak_tokens = 0  # max physical slots held per KV head (incl. padding)
        self.decoding = False  # set by the runner once the prompt is done (SAGE-KV only slides its window then)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _ = key_states.shape  # (b, h_kv, q, d)
        new_pos = torch.arange(self.seen, self.seen + q, device=key_states.device).expand(b, h, q)
        if self.keys.numel() == 0:
            self.keys, self.values, self.positions = key_states, value_states, new_pos.contiguous()
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.positions = torch.cat([self.positions, new_pos], dim=-1)
        if self.valid is not None:
            self.valid = torch.cat([self.valid, self.valid.new_ones(b, h, q)], dim=-1)
        for name, s in self.state.items():  # policies fill the new tokens' state in the attention wrapper
            self.state[name] = torch.cat([s, s.new_zeros(b, h, q)], dim=-1)
        self.seen += q
        self.peak_tokens = max(self.peak_tokens, self.keys.shape[-2])
        return self.keys, self.values

    def physical(self) -> int:
        return 0 if (self.keys is None or self.keys.numel() == 0) else self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        phys = self.physical()
        return phys + query_length, self.seen - phys

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an evicting cache cannot be cropped by token count")

    def keep(self, idx: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Keep only the slots `idx` (b, h_kv, k), given in chronological order; `valid` (b, h_kv, k) marks padding."""
        d = self.keys.shape[-1]
        gidx = idx.unsqueeze(-1).expand(*idx.shape, d)  # (b, h_kv, k, d)
        self.keys = self.keys.gather(2, gidx)
        self.values = self.values.gather(2, gidx)
        self.positions = self.positions.gather(2, idx)
        self.state = {k: v.gather(2, idx) for k, v in self.state.items()}
        if valid is not None:
            base = self.valid.gather(2, idx) if self.valid is not None else torch.ones_like(valid)
            self.valid = base & valid
        elif self.valid is not None:
            self.valid = self.valid.gather(2, idx)
        if self.valid is not None and bool(self.valid.all()):
            self.valid = None  # all heads hold the same number of tokens again: the fast uniform path
        if self.valid is not None:
            # Padding slots get position -1: they name no token (traces and diagnostics skip them).
            self.positions = self.positions.masked_fill(~self.valid, -1)

    def kv_bytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def stash_queries(self, query: torch.Tensor, window: int) -> None:
        """Keep the latest `window` queries (-1: the current block's) for the policy's scoring."""
        q = query.shape[-2]
        pos = torch.arange(self.seen - q, self.seen, device=query.device)
        if window < 0 or self.queries is None:
            self.queries, self.query_positions = query, pos
        else:
            self.queries = torch.cat([self.queries, query], dim=-2)
            self.query_positions = torch.cat([self.query_positions, pos])
        if window > 0 and self.queries.shape[-2] > window:
            self.queries = self.queries[..., -window:, :]
            self.query_positions = self.query_positions[-window:]


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
        self.frozen = False  # context_only scenario: no eviction after the context
        # Latest queries to stash per layer (Policy.query_window; the runner raises it to 1 for diagnostics).
        self.query_window = policy.query_window if policy is not None else 0

    def start_decoding(self) -> None:
        for layer in self.evicting_layers():
            layer.decoding = True

    def evicting_layers(self) -> list[EvictingLayer]:
        return [layer for layer in self.layers if isinstance(layer, EvictingLayer)]

    def peak_tokens(self) -> int:
        """Max over layers of the physical tokens held per KV head, over the cache's lifetime."""
        return max((layer.peak_tokens for layer in self.evicting_layers()), default=0)

    def kv_bytes(self) -> int:
        """Bytes of K and V held now, all layers (padding of ragged heads included)."""
        return sum(layer.kv_bytes() for layer in self.layers if layer.keys is not None)
