"""HashEvict (HashEvict Alg. 1, 3): evict the keys whose SimHash code is farthest (Hamming) from the current query's.

h(x) = sign(R x) with R (bits x head_dim) ~ N(0, 1), one fixed R per layer drawn from (seed, layer index), so runs
are reproducible. Score = -Hamming(h(q), h(k_i)); a key's code is computed once, when it enters the cache (per-token
state, 24 bits a float). GQA: the Hamming distance is averaged over the query heads of the KV head (HashEvict 4: the
method is agnostic to grouping). The first `n_sink` = 4 positions and the latest `n_recent` = 10 tokens are
always kept (HashEvict 4 setup); bits = 8 (HashEvict 4.7).
Deviation: with prompt blocks (B > 1) the probe is every query of the block and the score is the mean Hamming
similarity over them (the paper processes one token at a time; B = 1 is exact). `probe: key` hashes the new
tokens' keys instead of their queries (what the authors' code does).
"""

from __future__ import annotations

from typing import Any

import torch

from kvbench.policies.base import Policy, PolicyError, SlotView

PROBES = ("query", "key")
PACK = 24  # code bits per float32 state (exact integers up to 2^24)


class HashEvict(Policy):
    name = "hashevict"
    query_window = -1  # the last forward's queries: the probe

    def __init__(self, bits: int = 8, probe: str = "query", n_sink: int = 4, n_recent: int = 10,
                 **kwargs: Any) -> None:
        if probe not in PROBES:
            raise PolicyError(f"hashevict probe '{probe}' unknown; choose one of: {', '.join(PROBES)}")
        if not 1 <= int(bits) <= 64:
            raise PolicyError(f"hashevict bits must be in 1..64, got {bits}")
        self.bits, self.probe = int(bits), probe
        self.projections: dict[tuple[int, int], torch.Tensor] = {}  # (layer index, head_dim) -> R (bits, head_dim)
        self._stacked: dict[tuple[tuple[int, ...], int, torch.device], torch.Tensor] = {}  # see `stacked`
        self.state_names = tuple(f"code{i}" for i in range(-(-self.bits // PACK)))  # a key's code, PACK bits a float
        super().__init__(n_sink=n_sink, n_recent=n_recent, **kwargs)

    def attach(self, num_layers: int, head_dim: int) -> None:
        """Every layer's R drawn here, before any forward: a compiled forward cannot create the generator."""
        super().attach(num_layers, head_dim)
        for i in range(num_layers):
            self.projection(i, head_dim, torch.device("cpu"))

    def projection(self, layer_idx: int, dim: int, device: torch.device) -> torch.Tensor:
        r = self.projections.get((layer_idx, dim))
        if r is None:
            # Drawn on the CPU from a seeded generator: the same R on every device, so runs agree across devices.
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + layer_idx)
            r = self.projections[layer_idx, dim] = torch.randn(self.bits, dim, generator=gen)
        if r.device != device:  # moved once and kept there, not copied to the device at every forward
            r = self.projections[layer_idx, dim] = r.to(device)
        return r

    def stacked(self, layers: tuple[int, ...], dim: int, device: torch.device) -> torch.Tensor:
        """(L, bits, d) the R of each of `layers`, kept (an eviction sees the same layers every time)."""
        key = (layers, dim, device)
        if key not in self._stacked:
            self._stacked[key] = torch.stack([self.projection(i, dim, device) for i in layers])
        return self._stacked[key]

    def token_state(self, view: SlotView, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The codes of the t keys a forward wrote into `slots` (L, b, h_kv, t) of every evicting layer."""
        L, d = slots.shape[0], view.keys.shape[-1]
        r = self.stacked(view.layers, d, view.keys.device).transpose(1, 2)  # (L, d, bits)
        new = view.written(view.keys, slots).float().reshape(L, -1, d)
        bits = (torch.matmul(new, r) > 0).long().view(*slots.shape, self.bits)  # (L, b, h_kv, t, bits)
        weights = 1 << torch.arange(PACK, device=bits.device)
        return {name: (bits[..., PACK * i:PACK * (i + 1)] * weights[:min(PACK, self.bits - PACK * i)]).sum(dim=-1)
                .float() for i, name in enumerate(self.state_names)}

    def score(self, view: SlotView) -> torch.Tensor:
        L, b, h_kv, S, d = view.keys.shape
        r = self.stacked(view.layers, d, view.keys.device).transpose(1, 2)  # (L, d, bits)
        shifts = torch.arange(PACK, device=view.pos.device)
        kbits = torch.cat([(view.state[name].long().unsqueeze(-1) >> shifts[:min(PACK, self.bits - PACK * i)]) & 1
                           for i, name in enumerate(self.state_names)], dim=-1).float()  # (L, b, h_kv, S, bits)
        new = (view.seen - view.fed).view(1, b, 1, 1)  # the last forward's first position
        if self.probe == "query":  # its queries' codes, averaged over the forward and the KV head's query heads
            q = view.queries  # (L, b, h_q, w, d)
            qbits = (torch.matmul(q.float().reshape(L, -1, d), r) > 0).float()
            qbits = qbits.view(L, b, h_kv, -1, q.shape[3], self.bits)  # (L, b, h_kv, g, w, bits)
            mine = (view.qpos.view(1, b, 1, 1, -1, 1) >= new.view(1, b, 1, 1, 1, 1)).float()  # (1, b, 1, 1, w, 1)
            p = (qbits * mine).sum(dim=(3, 4)) / (mine.sum(dim=(3, 4)) * qbits.shape[3])  # (L, b, h_kv, bits)
        else:  # its keys' codes
            mine = (view.pos >= new).float().unsqueeze(-1)  # (L, b, h_kv, S, 1)
            p = (kbits * mine).sum(dim=3) / mine.sum(dim=3)
        # the mean over the probes of [probe bit != key bit]: p where the key's bit is 0, 1 - p where it is 1
        return -(kbits * (1 - 2 * p.unsqueeze(3)) + p.unsqueeze(3)).sum(dim=-1)  # (L, b, h_kv, S)
