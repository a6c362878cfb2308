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

from fractions import Fraction
from typing import Any

from kvbench.policies.base import PolicyError
from kvbench.policies.snapkv import SnapKV


class PyramidKV(SnapKV):
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
        w, free, n_layers = self.window, self.budget - self.window, self.num_layers
        if n_layers == 1 or (seen is not None and seen < 2 * free):
            return self.budget
        low = Fraction(free) / Fraction(self.beta)
        high = 2 * free - low
        if seen is not None and high >= seen - w:
            high = Fraction(seen - w)
            low = 2 * free - high
        step = (high - low) / (n_layers - 1)
        return w + round(high - layer_idx * step)
