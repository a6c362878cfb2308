"""K-norm (§3): keep the keys with the lowest L2 norm; layers 0 and 1 are not compressed.

The skipped layers keep every token, so they are not bounded by the budget (reported in peak_kv_tokens), and the
engine does no policy work for them. A token's norm never changes: it is computed once, when the token enters the
cache, and kept as per-token state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from kvbench.policies.base import Policy

if TYPE_CHECKING:
    from kvbench.policies.layer import CacheLayer
    from kvbench.policies.view import SlotView


class KNorm(Policy):
    name = "knorm"
    stackable = True  # scores from the layer's own arrays, row by row (Policy.stackable)
    state_from_tokens = True  # the norms: the new keys' own (Policy.state_from_tokens)

    state_names = ("norm",)

    def __init__(self, skip_layers: Sequence[int] = (0, 1), **kwargs) -> None:
        super().__init__(skip_layers=skip_layers, **kwargs)

    def on_append(self, layer: CacheLayer, module: Any, keys: torch.Tensor, values: torch.Tensor,
                  query: torch.Tensor) -> dict[str, torch.Tensor]:
        # (b, h_kv, q); Tensor.norm's kernel called directly (the same bits, without its Python dispatch)
        return {"norm": torch.linalg.vector_norm(keys.float(), dim=-1)}

    def score(self, layer: CacheLayer) -> torch.Tensor:
        norm = layer.state.get("norm")  # (b, h_kv, n)
        if norm is None:  # a layer filled outside the attention wrapper (hand-built caches)
            norm = self.on_append(layer, None, layer.keys, None, None)["norm"]
        return -norm

    def slot_score(self, view: SlotView) -> torch.Tensor:
        return -torch.linalg.vector_norm(view.keys.float(), dim=-1)  # (L, b, h_kv, S)
