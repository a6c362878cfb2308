"""PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"):
SnapKV's scores inside a layer, with per-layer budgets that shrink linearly with depth.

Schedule (the paper's arithmetic sequence; the official code, github.com/Zefan-Cai/KVCache-Factory, computes it
from the tokens seen, once per layer): with window w, F = N - w the free budget of the average layer, L layers:
- the deepest layer keeps min = F / beta free tokens, the first max = 2F - min, layers in between on the
  straight line: F_l = max - l (max - min) / (L - 1); layer l keeps N_l = w + F_l;
- if the first layer's max would exceed what a layer has seen (max >= seen - w), max = seen - w and
  min = 2F - max (the budget moves to the deeper layers; the mean stays F);
- while a layer has seen fewer than 2F tokens, every layer keeps N (SnapKV).
Rounding: F_l is computed exactly (rationals) and rounded half to even; a layer and its mirror (l, L-1-l) sum
to 2F exactly, so the layers keep on average exactly N per KV head. (The official code floors min and the
step instead, so its layers keep on average more than N: 32 layers, F = 96 -> mean F_l = 110.5.)
Defaults: beta 20 (paper), window 8, kernel 7, max pooling (KVCache-Factory's LongBench script; NVIDIA
kvpress's PyramidKVPress uses window 64, kernel 5, and counts the window inside the pyramid).
The model's depth comes from `attach` (the cache calls it). Shallow layers hold more than N + B: they are
reported as such in peak_kv_tokens (max over layers).
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import Any

from kvbench.policies.base import PolicyError, WindowAttention


class PyramidKV(WindowAttention):
    name = "pyramidkv"

    def __init__(self, beta: float = 20, window: int = 8, kernel: int = 7, pooling: str = "max",
                 **kwargs: Any) -> None:
        if beta < 1:
            raise PolicyError(f"pyramidkv beta must be >= 1, got {beta}")
        self.beta = beta
        super().__init__(window=window, kernel=kernel, pooling=pooling, **kwargs)

    def layer_budget(self, layer_idx: int, seen: int | None = None) -> int | None:
        """N_l for layer `layer_idx` after `seen` tokens (None: no prompt-length cap); see the module doc."""
        if super().layer_budget(layer_idx, seen) is None:
            return None
        if self.num_layers is None:
            raise PolicyError("pyramidkv needs the model's number of layers (Policy.attach) before evicting")
        free = self.budget - self.window
        if self.num_layers == 1 or (seen is not None and seen < 2 * free):
            return self.budget
        # The cap depends on `seen` only while the first layer's share reaches past what it has seen; otherwise the
        # schedule is one for the whole run (key None), computed once
        capped = seen is not None and first_share(free, self.beta) >= seen - self.window
        return schedule(self.budget, self.window, self.beta, self.num_layers, seen if capped else None)[layer_idx]


@functools.lru_cache(maxsize=64)
def first_share(free: int, beta: float) -> Fraction:
    """The first layer's free tokens before any cap, 2F - F / beta, exactly."""
    return 2 * free - Fraction(free) / Fraction(beta)


@functools.lru_cache(maxsize=64)
def schedule(budget: int, w: int, beta: float, n_layers: int, cap_seen: int | None) -> tuple[int, ...]:
    """Every layer's N_l (module doc) for n_layers >= 2 layers with at least 2F seen, the first layer's share capped
    at `cap_seen` - w when `cap_seen` is given. Exact rationals, each rounded half to even. Cached: the engine asks
    for every layer's budget at every eviction, and exact rationals are slow arithmetic."""
    free = budget - w
    high = first_share(free, beta) if cap_seen is None else Fraction(cap_seen - w)
    low = 2 * free - high  # the mean share stays F
    step = (high - low) / (n_layers - 1)
    return tuple(w + round(high - layer_idx * step) for layer_idx in range(n_layers))
