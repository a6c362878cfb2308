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
Cost per eviction: O(N + B) per head for the first two (one query), O(N d^2) for the log-det; never O(T^2).
Per sample: per-layer means over eviction events (prefill blocks and decoding steps) and their mean; per run
(`aggregate`): means over samples.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch

from kvbench.engine.cache import EvictingLayer
from kvbench.policies.base import query_attention

NAMES = ("attention_loss", "perturbation", "key_logdet")
_QUERY_NAMES = ("attention_loss", "perturbation")
RIDGE = 1e-6


class Diagnostics:
    def __init__(self, names: Sequence[str]) -> None:
        for n in names:
            if n not in NAMES:
                raise ValueError(f"unknown diagnostic '{n}'; choose from: {', '.join(NAMES)}")
        self.names = tuple(dict.fromkeys(names))
        self.sums: dict[str, dict[int, list[float]]] = {n: {} for n in self.names}  # name -> layer -> [sum, count]
        self.elapsed = 0.0  # seconds spent here (generate leaves them out of the eviction time)

    @property
    def query_window(self) -> int:
        """Latest queries the engine must stash for these diagnostics (declared, whatever the policy needs)."""
        return 1 if any(n in _QUERY_NAMES for n in self.names) else 0

    def _add(self, name: str, layer_idx: int, value: float) -> None:
        acc = self.sums[name].setdefault(layer_idx, [0.0, 0])
        acc[0] += value
        acc[1] += 1

    @torch.no_grad()
    def observe(self, layer: EvictingLayer, idx: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Called by Policy.evict with the selection (idx, valid) while `layer` still holds every token."""
        t0 = time.perf_counter()
        # padding repeats a kept slot
        keep = torch.zeros_like(layer.positions, dtype=torch.bool).scatter_(-1, idx, True)
        if any(n in _QUERY_NAMES for n in self.names):
            self._query_terms(layer, keep)
        if "key_logdet" in self.names:
            self._add("key_logdet", layer.layer_idx, key_logdet(layer.keys, keep))
        self.elapsed += time.perf_counter() - t0

    def _query_terms(self, layer: EvictingLayer, keep: torch.Tensor) -> None:
        v = layer.values.float()  # (b, h_kv, n, d)
        b, h_kv, n, _ = v.shape
        # The latest query's attention over the pre-eviction cache (padding gets 0), the policies' own helper.
        probs = query_attention(layer)[:, :, -1]  # (b, h_q, n)
        g = probs.shape[1] // h_kv
        probs = probs.view(b, h_kv, g, n)
        kept = probs * keep.unsqueeze(2)  # (b, h_kv, g, n)
        if "attention_loss" in self.names:
            self._add("attention_loss", layer.layer_idx, float((1.0 - kept.sum(dim=-1)).mean()))
        if "perturbation" in self.names:
            kept = kept / kept.sum(dim=-1, keepdim=True).clamp_min(1e-30)
            diff = torch.matmul(probs - kept, v).reshape(b, h_kv * g, v.shape[-1])  # (b, h_q, d_v)
            w = layer.module.o_proj.weight.float()  # (hidden, h_q * d_v)
            proj = torch.einsum("bhd,ohd->bho", diff, w.view(w.shape[0], h_kv * g, v.shape[-1]))  # (b, h_q, hidden)
            self._add("perturbation", layer.layer_idx, float(proj.abs().sum(dim=-1).mean()))

    def summary(self) -> dict[str, Any]:
        """Per diagnostic: per-layer means over eviction events, their mean, and the number of events."""
        out: dict[str, Any] = {}
        for name, layers in self.sums.items():
            per_layer = {str(li): s / c for li, (s, c) in sorted(layers.items()) if c}
            out[name] = {"mean": sum(per_layer.values()) / len(per_layer) if per_layer else None,
                         "per_layer": per_layer, "events": sum(c for _, c in layers.values())}
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


def aggregate(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Over samples: mean of the per-sample means, and per-layer means over the samples that evicted there."""
    out: dict[str, Any] = {}
    for rec in records:
        for name, d in (rec.get("diagnostics") or {}).items():
            acc = out.setdefault(name, {"means": [], "layers": {}, "events": 0})
            if d.get("mean") is not None:
                acc["means"].append(d["mean"])
            for li, v in d.get("per_layer", {}).items():
                acc["layers"].setdefault(li, []).append(v)
            acc["events"] += d.get("events", 0)
    return {name: {"mean": sum(a["means"]) / len(a["means"]) if a["means"] else None,
                   "per_layer": {li: sum(v) / len(v) for li, v in sorted(a["layers"].items(), key=lambda x: int(x[0]))},
                   "samples": len(a["means"]), "events": a["events"]}
            for name, a in out.items()}
