"""HashEvict (HashEvict Alg. 1, 3): evict the keys whose SimHash code is farthest (Hamming) from the current query's.

h(x) = sign(R x) with R (bits x head_dim) ~ N(0, 1), one fixed R per layer drawn from (seed, layer index), so runs
are reproducible. Key codes are per-token state, computed once when a token enters the cache; score =
-Hamming(h(q), h(k_i)). GQA: the Hamming distance is averaged over the query heads of the KV head (HashEvict 4: the
method is agnostic to grouping). The first `n_sink` = 4 positions and the latest `n_recent` = 10 tokens are
always kept (HashEvict 4 setup); bits = 8 (HashEvict 4.7).
Deviation: with prompt blocks (B > 1) the probe is every query of the block and the score is the mean Hamming
similarity over them (the paper processes one token at a time; B = 1 is exact). `probe: key` hashes the new
tokens' keys instead of their queries (what the authors' code does).
Codes are stored in 16-bit chunks, one float32 state tensor per chunk ("hash0", "hash1", ...).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from kvbench.policies.base import Policy, PolicyError

if TYPE_CHECKING:
    from kvbench.policies.layer import CacheLayer
    from kvbench.policies.view import SlotView

PROBES = ("query", "key")
CHUNK = 16  # bits per state entry (exact in float32)


class HashEvict(Policy):
    name = "hashevict"
    stackable = True  # scores from the layer's codes and its probe (scratch), row by row (Policy.stackable)
    # codes and probe from the new keys and queries, each row by its layer's R (Policy.state_from_tokens)
    state_from_tokens = True
    slot_window = -1  # the static cache keeps the last forward's queries: the probe

    def __init__(self, bits: int = 8, probe: str = "query", n_sink: int = 4, n_recent: int = 10,
                 **kwargs: Any) -> None:
        if probe not in PROBES:
            raise PolicyError(f"hashevict probe '{probe}' unknown; choose one of: {', '.join(PROBES)}")
        if not 1 <= int(bits) <= 64:
            raise PolicyError(f"hashevict bits must be in 1..64, got {bits}")
        self.bits, self.probe = int(bits), probe
        self.state_names = tuple(f"hash{i}" for i in range(math.ceil(self.bits / CHUNK)))
        self.projections: dict[tuple[int, int], torch.Tensor] = {}  # (layer index, head_dim) -> R (bits, head_dim)
        self._row_projections: dict[tuple[tuple[int, ...], int, torch.device], torch.Tensor] = {}  # see hash_bits
        self._packings: dict[torch.device, torch.Tensor] = {}  # device -> (bits, chunks) code packing
        self._codes: dict[torch.device, torch.Tensor] = {}  # device -> (2^bits, bits) every code's bits
        super().__init__(n_sink=n_sink, n_recent=n_recent, **kwargs)

    def projection(self, layer_idx: int, dim: int, device: torch.device) -> torch.Tensor:
        r = self.projections.get((layer_idx, dim))
        if r is None:
            # Drawn on the CPU from a seeded generator: the same R on every device, so runs agree across devices.
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + layer_idx)
            r = self.projections[layer_idx, dim] = torch.randn(self.bits, dim, generator=gen)
        if r.device != device:  # moved once and kept there, not copied to the device at every forward
            r = self.projections[layer_idx, dim] = r.to(device)
        return r

    def hash_bits(self, x: torch.Tensor, layer: CacheLayer) -> torch.Tensor:
        """(b, h, q, d) -> (b, h, q, bits) float 0/1: bit j = [R_j . x > 0], R the layer's; where the batch rows are
        several layers' (a stack's `row_layers`), each row's layer's, in one batched product of the very per-row
        products (b = 1 rows: the same (h*q x d) by (d x bits) product as the layer's own call)."""
        d = x.shape[-1]
        rows = layer.row_layers
        if rows is None:
            r = self.projection(layer.layer_idx, d, x.device)
            return (x.float() @ r.T > 0).float()
        key = (rows, d, x.device)
        stacked = self._row_projections.get(key)
        if stacked is None:  # (rows, bits, d), kept: a decoding stack's rows are the same layers step after step
            stacked = self._row_projections[key] = torch.stack([self.projection(i, d, x.device) for i in rows])
        products = torch.matmul(x.float().reshape(len(rows), -1, d), stacked.transpose(1, 2))  # (rows, h*q, bits)
        return (products > 0).float().view(*x.shape[:-1], self.bits)

    def on_append(self, layer: CacheLayer, module: Any, keys: torch.Tensor, values: torch.Tensor,
                  query: torch.Tensor) -> dict[str, torch.Tensor]:
        kbits = self.hash_bits(keys, layer)  # (b, h_kv, q, bits)
        h_kv = keys.shape[1]
        if self.probe == "query":
            b, h_q, q, _ = query.shape
            qbits = self.hash_bits(query, layer)  # (b, h_q, q, bits)
            p = qbits.view(b, h_kv, (h_q // h_kv) * q, self.bits).mean(dim=2)  # (b, h_kv, bits)
        else:
            p = kbits.mean(dim=2)
        # Fraction of the block's probes with bit j set: the mean Hamming distance to a code is then linear in it.
        layer.scratch["probe"] = p
        codes = kbits @ self._packing(keys.device)  # (b, h_kv, q, chunks): sums of distinct powers of 2, exact
        return {name: codes[..., c] for c, name in enumerate(self.state_names)}

    def _packing(self, device: torch.device) -> torch.Tensor:
        """(bits, chunks): bit j -> 2^(j mod 16) in column j // 16, so one product packs a code's chunks (kept per
        device: building it was ~3 of the ~14 small ops each layer's append paid every decoding step)."""
        w = self._packings.get(device)
        if w is None:
            j = torch.arange(self.bits, device=device)
            w = torch.zeros(self.bits, len(self.state_names), device=device)
            w[j, j // CHUNK] = 2.0 ** (j % CHUNK)
            self._packings[device] = w
        return w

    def key_bits(self, layer: CacheLayer) -> torch.Tensor:
        """(b, h_kv, n, bits) float 0/1 unpacked from the stored codes."""
        return torch.cat([unpack(layer.state[name].long(), min(CHUNK, self.bits - c * CHUNK))
                          for c, name in enumerate(self.state_names)], dim=-1)

    def score(self, layer: CacheLayer) -> torch.Tensor:
        p = layer.scratch["probe"].unsqueeze(-2)  # (b, h_kv, 1, bits)
        n = layer.state[self.state_names[0]].shape[-1]
        if len(self.state_names) == 1 and 2 ** self.bits <= n:
            # Every token's distance is one of 2^bits values per head: computed once per code, as below, then looked
            # up by the token's code (one code a token): the same numbers (the same products and sums), and a table
            # of 2^bits rows instead of n unpacked codes (8 bits, 30 layers x 3 heads x 1025 tokens: 7.2 -> 1.7 ms)
            codes = layer.state[self.state_names[0]].long()  # (b, h_kv, n)
            table = (self._all_codes(p.device) * (1 - 2 * p) + p).sum(dim=-1)  # (b, h_kv, 2^bits)
            return -table.gather(-1, codes)
        k = self.key_bits(layer)  # (b, h_kv, n, bits)
        # Mean over probes of [probe bit != key bit] = p (key bit 0) or 1 - p (key bit 1).
        hamming = (k * (1 - 2 * p) + p).sum(dim=-1)  # (b, h_kv, n)
        return -hamming

    def slot_score(self, view: SlotView) -> torch.Tensor:
        L, b, h_kv, S, d = view.keys.shape
        r = torch.stack([self.projection(i, d, view.keys.device) for i in view.layers])  # (L, bits, d)
        kbits = (torch.matmul(view.keys.float().view(L, b * h_kv * S, d), r.transpose(1, 2)) > 0).float()
        kbits = kbits.view(L, b, h_kv, S, self.bits)
        # the probe: the last forward's queries (HashEvict §3), or its keys (`probe: key`)
        if self.probe == "query":
            q = view.queries  # (L, b, h_q, w, d)
            qbits = (torch.matmul(q.float().view(L, -1, d), r.transpose(1, 2)) > 0).float().view(*q.shape[:4], -1)
            mine = (view.qpos >= (view.seen - view.fed).unsqueeze(1)).float()  # (b, w): this forward's queries
            g = q.shape[2] // h_kv
            weights = mine.view(1, b, 1, 1, -1, 1)
            qbits = qbits.view(L, b, h_kv, g, -1, self.bits)
            p = (qbits * weights).sum(dim=(3, 4)) / (weights.sum(dim=(3, 4)) * g)  # (L, b, h_kv, bits)
        else:
            new = (view.pos >= (view.seen - view.fed).view(1, -1, 1, 1)).float().unsqueeze(-1)  # (L, b, h_kv, S, 1)
            p = (kbits * new).sum(dim=3) / new.sum(dim=3)
        # mean over probes of [probe bit != key bit]
        return -(kbits * (1 - 2 * p.unsqueeze(3)) + p.unsqueeze(3)).sum(dim=-1)  # (L, b, h_kv, S)

    def _all_codes(self, device: torch.device) -> torch.Tensor:
        """(2^bits, bits) float 0/1: row c holds code c's bits (`unpack`, as `key_bits` reads a token's)."""
        c = self._codes.get(device)
        if c is None:
            c = self._codes[device] = unpack(torch.arange(2 ** self.bits, device=device), self.bits)
        return c


def unpack(codes: torch.Tensor, width: int) -> torch.Tensor:
    """(...) integer codes -> (..., width) float 0/1, bit j = (code >> j) & 1: how a stored code reads as bits, for the
    tokens' codes (`key_bits`) and for every code of the score's table (`_all_codes`) alike."""
    return ((codes.unsqueeze(-1) >> torch.arange(width, device=codes.device)) & 1).float()
