"""Eviction diagnostics from the papers, measured by the harness at every eviction (off unless a run asks).

- `attention_loss` (HashEvict 4.8, K-norm Eq. 1): attention probability mass of the latest query on the tokens an
  eviction drops, over the pre-eviction cache (= 1 - mass on the kept tokens); mean over query heads.
- `perturbation` (CriticalKV 4.6, Eq. 9): || (A - A') V W_O^h ||_1 per query head for the latest query, where A is its
  attention over the pre-eviction cache, A' the same renormalised over the kept tokens, and W_O^h the head's
  output-projection columns (the head's contribution to the hidden state); mean over query heads.
- `key_logdet` (KeyDiff 3.3, Fig. 5): log det(K K^T) of each KV head's kept keys after the eviction; mean over heads.
  Choice: for more kept tokens than dimensions K K^T is singular (det 0), so the log pseudo-determinant is used:
  log det of the smaller Gram matrix (K^T K when n > d), which is the product of K K^T's nonzero eigenvalues;
  a ridge of 1e-6 * trace / size is always added (keeps slogdet finite when that is singular too); float64.
- `head_share`: the most tokens one KV head keeps after the eviction over the layer's budget N (1 for a uniform
  budget; a per-head allocation, AdaKV's, gives a head more): with its `max`, how close the heads come to the static
  bound a per-head policy's slots set (AdaKV's `head_cap`).
Cost per eviction: O(N + B) per head for the first two (one query), O(N d^2) for the log-det; never O(T^2). An
eviction event: a layer that drops a token.
Per sample: per-layer means over eviction events (prefill blocks and decoding steps), their mean and the largest value
of any event; per run (kvbench.run.records.aggregate_diagnostics): means over samples, and the largest.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch

from kvbench.policies.base import SlotView

NAMES = ("attention_loss", "perturbation", "key_logdet", "head_share")
_QUERY_NAMES = ("attention_loss", "perturbation")
RIDGE = 1e-6


class Diagnostics:
    def __init__(self, names: Sequence[str]) -> None:
        for n in names:
            if n not in NAMES:
                raise ValueError(f"unknown diagnostic '{n}'; choose from: {', '.join(NAMES)}")
        self.names = tuple(dict.fromkeys(names))
        self.sums: dict[str, dict[int, list[float]]] = {n: {} for n in self.names}  # name -> layer -> [sum, count]
        self.largest: dict[str, float] = {}  # name -> the largest value of any event
        self.elapsed = 0.0  # seconds spent here (generate leaves them out of the eviction time)
        self._charged = 0.0  # of which already left out (`elapsed_now`)

    def _add(self, name: str, layer_idx: int, value: float) -> None:
        acc = self.sums[name].setdefault(layer_idx, [0.0, 0])
        acc[0] += value
        acc[1] += 1
        self.largest[name] = max(self.largest.get(name, -math.inf), value)

    def elapsed_now(self) -> float:
        """The seconds spent here since the last call (the engine leaves them out of the eviction time)."""
        spent, self._charged = self.elapsed - self._charged, self.elapsed
        return spent

    @torch.no_grad()
    def observe(self, view: SlotView, keep: torch.Tensor, row: int) -> None:
        """Called by the eviction with its selection, keep (L, b, h_kv, S), while every token is still held: the
        measures of batch row `row`, for each layer that drops a token (an eviction event)."""
        t0 = time.perf_counter()
        held = view.pos[:, row] >= 0  # (L, h_kv, S)
        kept = keep[:, row]
        dropped = (held & ~kept).flatten(1).any(dim=1).tolist()  # (L,)
        probs = view.latest_attention()[:, row] if any(n in _QUERY_NAMES for n in self.names) else None  # (L, h_q, S)
        share = None
        if "head_share" in self.names and view.budgets is not None:  # (L,) the fullest head's tokens over N
            share = ((held & kept).sum(dim=-1).amax(dim=-1) / view.budgets[:, row, 0]).tolist()
        for i, layer in enumerate(view.layers):
            if not dropped[i]:
                continue
            if share is not None:
                self._add("head_share", layer, share[i])
            if probs is not None:
                self._query_terms(layer, view.values[i, row], probs[i], kept[i], view.modules[i])
            if "key_logdet" in self.names:
                self._add("key_logdet", layer, key_logdet(view.keys[i, row:row + 1], kept[i:i + 1]))
        self.elapsed += time.perf_counter() - t0

    def _query_terms(self, layer: int, values: torch.Tensor, probs: torch.Tensor, keep: torch.Tensor,
                     module: Any) -> None:
        """values (h_kv, S, d), the latest query's attention probs (h_q, S) over the pre-eviction cache (free slots
        0), keep (h_kv, S)."""
        v = values.float()
        h_kv, S, d_v = v.shape
        g = probs.shape[0] // h_kv
        probs = probs.view(h_kv, g, S)
        kept = probs * keep.unsqueeze(1)  # (h_kv, g, S)
        if "attention_loss" in self.names:
            self._add("attention_loss", layer, float((1.0 - kept.sum(dim=-1)).mean()))
        if "perturbation" in self.names:
            kept = kept / kept.sum(dim=-1, keepdim=True).clamp_min(1e-30)
            diff = torch.matmul(probs - kept, v).reshape(h_kv * g, d_v)  # (h_q, d_v)
            w = module.o_proj.weight.float()  # (hidden, h_q * d_v)
            proj = torch.einsum("hd,ohd->ho", diff, w.view(w.shape[0], h_kv * g, d_v))  # (h_q, hidden)
            self._add("perturbation", layer, float(proj.abs().sum(dim=-1).mean()))

    def summary(self) -> dict[str, Any]:
        """Per diagnostic: per-layer means over eviction events, their mean, and the number of events."""
        out: dict[str, Any] = {}
        for name, layers in self.sums.items():
            per_layer = {str(li): s / c for li, (s, c) in sorted(layers.items()) if c}
            out[name] = {"mean": sum(per_layer.values()) / len(per_layer) if per_layer else None,
                         "per_layer": per_layer, "events": sum(c for _, c in layers.values()),
                         "max": self.largest.get(name)}
        return out


def key_logdet(keys: torch.Tensor, keep: torch.Tensor) -> float:
    """Mean over (batch, KV head) of the log (pseudo-)determinant of K K^T over the kept keys (see module doc)."""
    vals = []
    for bi in range(keys.shape[0]):
        for hi in range(keys.shape[1]):
            kk = keys[bi, hi][keep[bi, hi]].double()  # (m, d)
            gram = kk @ kk.T if kk.shape[0] <= kk.shape[1] else kk.T @ kk
            size = gram.shape[0]
            if size == 0:
                continue
            ridge = RIDGE * float(gram.diagonal().sum()) / size
            sign, logabs = torch.linalg.slogdet(gram + ridge * torch.eye(size, dtype=gram.dtype, device=gram.device))
            vals.append(float(logabs) if sign > 0 else -math.inf)
    return sum(vals) / len(vals) if vals else float("nan")

