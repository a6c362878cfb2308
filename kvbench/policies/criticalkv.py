"""CriticalKV (CriticalKV Alg. 1): perturbation-constrained two-stage selection on top of SnapKV or AdaKV.

With A the base policy's pooled window attention (SnapKV) and b the tokens a head keeps besides its protected
window (N - window for `base: snapkv`; the AdaKV allocation minus the window for `base: adakv`):
stage 1 keeps the top floor(alpha * b) tokens by A; stage 2 keeps the top b - floor(alpha * b) of the rest by
(A + eps) * ||v W_O||_1, where ||v_i W_O||_1 is the L1 norm of token i's value projected through the output
projection columns of each query head of the group, averaged over the group (GQA). That norm is a per-token
constant: computed once when the token enters the cache (`token_state`) and kept as per-token state.
Defaults: alpha 0.5, eps 1e-4 (CriticalKV 4.3 and footnote 2); window 32, kernel 7, max pooling (CriticalKV 4.3).
Stage-1 split (`stage1_window`), for a head keeping `count` tokens of which `w` protected:
- `outside` (default): stage 1 keeps w + floor(alpha * (count - w)): alpha splits the budget outside the window,
  since Alg. 1 replaces SnapKV's top-k, which SnapKV (kept "as originally defined", CriticalKV 4.3) runs over the
  tokens outside its window;
- `inside` (NVIDIA kvpress CriticalKVPress / CriticalAdaKVPress): stage 1 keeps max(w, floor(alpha * count)),
  the window counting inside alpha * b (there the window has the highest base scores). CriticalAdaKVPress also
  writes AdaKV's safeguard (each head's top floor(alpha_safeguard * N)) into the scores before stage 1, so a head
  whose count is below 2 x that keeps max(safeguard, floor(alpha * count)) there: kvbench's AdaKV base differs in
  such heads (measured: 1-4 kept tokens in one head, greedy answers still identical; results/peer_kvpress).
With `base: adakv` the per-head counts come from the AdaKV allocation (`allocation`, `alpha_safeguard`; `head_cap`, the
static bound on a head's count, see adakv.py). `score` ranks by stage 2, which needs each head's count: the base's
counts are computed there and handed to the engine by `counts`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvbench.policies.adakv import AdaKV
from kvbench.policies.base import CHUNK_BYTES, Policy, PolicyError, SlotView, ranks
from kvbench.policies.snapkv import SnapKV

BASES = {"snapkv": SnapKV, "adakv": AdaKV}
STAGE1 = ("outside", "inside")


class CriticalKV(Policy):
    """Composes, as the paper does: the base method (`base`) supplies the scores A, the protected window and the
    per-head budgets; CriticalKV only replaces its top-k by the two stages."""

    name = "criticalkv"
    state_names = ("vnorm",)
    _counts: torch.Tensor | None = None  # (L, b, h_kv) the counts `score` ranked for
    _w: tuple[tuple[int, ...], torch.Tensor] | None = None  # (layers, their W_O columns): `head_columns`

    def __init__(self, base: str = "snapkv", alpha: float = 0.5, eps: float = 1e-4, stage1_window: str = "outside",
                 pooling: str = "max", allocation: str = "adakv", alpha_safeguard: float = 0.2, head_cap: float = 2.0,
                 **kwargs: Any) -> None:
        if base not in BASES:
            raise PolicyError(f"criticalkv base '{base}' unknown; choose one of: {', '.join(BASES)}")
        if not 0.0 <= alpha <= 1.0:
            raise PolicyError(f"criticalkv alpha must be in [0, 1], got {alpha}")
        if stage1_window not in STAGE1:
            raise PolicyError(f"criticalkv stage1_window '{stage1_window}' unknown; choose one of: "
                              f"{', '.join(STAGE1)}")
        self.alpha, self.eps, self.stage1_window = float(alpha), float(eps), stage1_window
        # allocation, alpha_safeguard and head_cap are AdaKV's options (criticalkv.yaml lists them for base=adakv).
        extra = ({"allocation": allocation, "alpha_safeguard": alpha_safeguard, "head_cap": head_cap}
                 if base == "adakv" else {})
        self.base: Policy = BASES[base](pooling=pooling, **kwargs, **extra)  # max pooling: CriticalKV 4.3
        b = self.base
        self.query_window = b.query_window  # the engine keeps the queries the base scores with
        super().__init__(budget=b.budget, n_sink=b.n_sink, n_recent=b.n_recent, skip_layers=b.skip_layers,
                         seed=b.seed)

    def attach(self, num_layers: int, head_dim: int) -> None:
        super().attach(num_layers, head_dim)
        self.base.attach(num_layers, head_dim)

    def token_state(self, view: SlotView, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The value norms of a forward's t new tokens in every evicting layer (L, b, h_kv, t): ||v W_O^h||_1 of each
        value (read from the value buffers at its `slots` (L, b, h_kv, t)) through each query head h's columns of W_O
        (`head_columns`, made once per set of layers and kept), averaged over each KV head's g query heads, float32;
        every layer's query heads in one batched product, in chunks of layers whose (b, h_q, t, hidden)
        intermediates stay within `CHUNK_BYTES`."""
        if self._w is None or self._w[0] != view.layers:
            self._w = (view.layers, head_columns(view))
        w = self._w[1]  # (L, 1, h_kv, g, d, hidden)
        new = view.written(view.values, slots).float().unsqueeze(3)  # (L, b, h_kv, 1, t, d)
        L, b = new.shape[:2]
        step = max(1, CHUNK_BYTES // (b * w.shape[3] * slots.shape[-1] * w.shape[-1] * 4))
        norms = []
        for i in range(0, L, step):
            proj = torch.matmul(new[i:i + step], w[i:i + step])  # (l, b, h_kv, g, t, hidden)
            norms.append(proj.abs_().sum(dim=-1).mean(dim=3))
        return {"vnorm": torch.cat(norms)}

    def head_capacity(self, budget: int) -> int:
        return self.base.head_capacity(budget)

    def score(self, view: SlotView) -> torch.Tensor:
        """CriticalKV Alg. 1 per head as one ranking (L, b, h_kv, S) over the base's scores A: the stage-1 tokens (the
        head's top `first` by A, protected first, ties by position as the engine's) at +inf, the others by
        (A + eps) * vnorm, free slots -inf; the head keeps its top `counts` of it. `first` is n_prot + floor(alpha *
        (count - n_prot)) (`outside`) or max(n_prot, floor(alpha * count)) (`inside`), floors of the double products
        as Python's int() takes them. Stage 1 needs each head's count, so the base's allocation runs here (on A as the
        engine ranks it: protected +inf, free -inf, re-derived from the view; the budgets `view.budgets`), and
        `counts` hands the same counts to the engine (kept from this call)."""
        ranked = self.base.score(view).float()  # (L, b, h_kv, S): A
        ranked = torch.where(view.protected(self.n_sink, self.n_recent), math.inf, ranked)
        ranked = ranked.masked_fill(view.pos < 0, -math.inf)
        L, b, h, S = ranked.shape
        counts = self.base.counts(view, ranked, view.budgets).expand(L, b, h)  # type: ignore[arg-type]
        n_prot = (ranked == math.inf).sum(dim=-1)  # (L, b, h)
        if self.stage1_window == "outside":
            first = n_prot + ((counts - n_prot).double() * self.alpha).floor().long()  # (L, b, h)
        else:
            first = torch.maximum(n_prot, (counts.double() * self.alpha).floor().long())
        stage1 = ranks(ranked, view.pos) < first.unsqueeze(-1)  # (L, b, h, S)
        self._counts = counts  # SnapKV: each row's N; AdaKV: per head
        return ((ranked + self.eps) * view.state["vnorm"]).masked_fill(stage1, math.inf).masked_fill(
            ranked == -math.inf, -math.inf)

    def counts(self, view: SlotView, ranked: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        assert self._counts is not None, "counts before score"
        return self._counts  # (L, b, h_kv): what `score` ranked for (the engine calls it right after)


def head_columns(view: SlotView) -> torch.Tensor:
    """(L, 1, h_kv, g, d, hidden) float32: each evicting layer's W_O (hidden, h_q * d), head h's columns transposed,
    grouped by KV head (derived from the weights, never written)."""
    d, h_kv = view.values.shape[-1], view.values.shape[2]
    heads = [m.o_proj.weight.detach().float().view(-1, m.o_proj.weight.shape[1] // d, d).permute(1, 2, 0)
             for m in view.modules]  # (h_q, d, hidden) each
    w = torch.stack(heads)  # (L, h_q, d, hidden)
    return w.view(w.shape[0], 1, h_kv, -1, d, w.shape[-1]).contiguous()
