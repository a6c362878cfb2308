"""What the per-head policies now count on the host instead of reading from the device, against the device counts
they replace; CriticalKV's one-ranking selection against its two rank masks; and the engine's deferred storing of a
per-head selection (read with the next token) against storing it at once: the same tokens, kept positions and
head sizes."""

from __future__ import annotations

import math

import pytest
import torch

from kvbench.engine.cache import EvictingCache, EvictingLayer
from kvbench.engine.generate import GenerationSettings, Observer, generate
from kvbench.policies.adakv import AdaKV
from kvbench.policies.base import Policy, adaptive_counts, adaptive_total, compact, rank_mask, top_slots
from kvbench.policies.criticalkv import CriticalKV, stage2_scores
from kvbench.policies.sagekv import SageKV

from helpers import installed_model

IDS = torch.randint(8, 500, (48,), generator=torch.Generator().manual_seed(1)).tolist()


def _ragged(counts: list[list[int]], seen: int = 12, d: int = 4, seed: int = 0, sinks: int = 2) -> EvictingLayer:
    """A layer that saw `seen` tokens and keeps, per (batch, head), the first `sinks` positions (a policy with that
    many sinks never evicts them) and random later ones, `counts` in all, then unpacked: the padded view a policy
    scores."""
    g = torch.Generator().manual_seed(seed)
    b, h = len(counts), len(counts[0])
    layer = EvictingLayer(0)
    layer.update(torch.randn(b, h, seen, d, generator=g), torch.randn(b, h, seen, d, generator=g))
    width = max(max(row) for row in counts)
    idx = torch.zeros(b, h, width, dtype=torch.long)
    valid = torch.zeros(b, h, width, dtype=torch.bool)
    for i, row in enumerate(counts):
        for j, c in enumerate(row):
            first = min(sinks, c)
            later = (torch.randperm(seen - first, generator=g)[:c - first] + first).sort().values
            idx[i, j, :c] = torch.cat([torch.arange(first), later])
            valid[i, j, :c] = True
    layer.keep(idx, valid)
    layer.unpack()
    return layer


@pytest.mark.parametrize("n_sink,n_recent", [(0, 3), (2, 3), (1, 0), (0, 9), (5, 4), (30, 2)])
@pytest.mark.parametrize("counts", [[[7, 3, 10]], [[2, 9, 5], [6, 6, 11]], [[12, 1, 4]]])
def test_protected_sizes_are_the_protected_mask_counted(n_sink: int, n_recent: int, counts) -> None:
    layer = _ragged(counts, sinks=n_sink)
    policy = Policy(budget=40, n_sink=n_sink, n_recent=n_recent)
    prot = policy.protected(layer)  # (b, h, L) on the device
    want = [0] * len(layer.head_lengths()) if prot is None else prot.sum(dim=-1).flatten().tolist()
    assert policy.protected_sizes(layer) == want
    uniform = EvictingLayer(0)
    uniform.update(torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4))  # chronological slots: the edge mask
    prot = policy.protected(uniform)
    assert policy.protected_sizes(uniform) == ([0, 0] if prot is None else prot.sum(dim=-1).flatten().tolist())


@pytest.mark.parametrize("rule", ["adakv", "kvpress"])
@pytest.mark.parametrize("budget", [3, 5, 8])
def test_adaptive_total_is_the_device_count(rule: str, budget: int) -> None:
    """The pooled top-k size adaptive_counts reads from the device, from the host counts: the same allocation."""
    layer = _ragged([[2, 9, 5], [6, 6, 11]])
    policy = AdaKV(budget=budget, window=2, kernel=1, allocation=rule)
    scores = torch.rand(layer.positions.shape, generator=torch.Generator().manual_seed(budget))
    scores = scores.masked_fill(policy.protected(layer), math.inf).masked_fill(~layer.valid, -math.inf)
    n_prot = (scores == math.inf).sum(dim=-1)
    total = adaptive_total(layer.head_lengths(), policy.protected_sizes(layer), 3, budget, rule)
    if rule == "adakv":
        free = budget - n_prot
        unprot = scores.masked_fill(scores == math.inf, -math.inf).reshape(2, -1)
        want = min(int(free.sum(dim=-1).min()), int((unprot > -math.inf).sum(dim=-1).min()))
    else:
        want = min(3 * budget, int(layer.valid.reshape(2, -1).sum(dim=-1).min()))
    assert total == want
    assert torch.equal(adaptive_counts(scores, budget, n_prot, 0.2, rule, total),
                       adaptive_counts(scores, budget, n_prot, 0.2, rule))


@pytest.mark.parametrize("n_drop", [1, 3])
@pytest.mark.parametrize("ties", [False, True])
def test_criticalkv_uniform_selection_is_its_two_rank_masks(n_drop: int, ties: bool) -> None:
    """On a uniform layer the kept slots are the top `budget` of the stage-2 ranking (top_slots: one argmin when one
    token goes): the slots rank_mask then compact keep, ties (quantised scores and norms) included."""
    g = torch.Generator().manual_seed(n_drop)
    b, h, n, budget = 2, 3, 40, 40 - n_drop
    scores = torch.rand(b, h, n, generator=g)
    vnorm = torch.rand(b, h, n, generator=g) * 4
    if ties:
        scores, vnorm = (scores * 4).round() / 4, (vnorm * 2).round() / 2
    scores[..., -5:] = math.inf  # the protected window
    n_prot = torch.full((b, h), 5)
    counts = torch.full((b, h), budget)
    stage2 = stage2_scores(scores, vnorm, counts, n_prot, 0.5, 1e-4)
    want, _ = compact(rank_mask(stage2, counts), budget)
    assert torch.equal(top_slots(stage2, budget), want)


def _run(policy: Policy, defer: bool, protocol: str = "blockwise") -> tuple[list[int], list[list[int]], list]:
    """Tokens, final head sizes and final kept positions of one generate call; `defer=False` stores every selection
    at once (one read per layer) instead of reading the sizes with the next token."""
    caches: list[EvictingCache] = []
    real_init, real_defer = EvictingCache.__init__, EvictingCache.defer_packing

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        caches.append(self)

    EvictingCache.__init__ = spy
    if not defer:
        EvictingCache.defer_packing = lambda self: None
    try:
        model = installed_model("tiny-llama")[0]
        res = generate(model, policy, IDS, GenerationSettings(block=8, max_new_tokens=6, protocol=protocol),
                       observer=Observer(trace=True))
    finally:
        EvictingCache.__init__, EvictingCache.defer_packing = real_init, real_defer
    layers = caches[0].evicting_layers()
    return res.tokens, [layer.head_lengths() for layer in layers], [layer.head_positions().tolist() for layer in
                                                                     layers] + [[t.tolist() for t in step if t is not
                                                                                 None] for step in res.trace]


@pytest.mark.parametrize("make,protocol", [
    (lambda: AdaKV(budget=16, window=4, kernel=3), "blockwise"),
    (lambda: AdaKV(budget=16, window=4, kernel=3, allocation="kvpress"), "prefill_once_decode_evict"),
    (lambda: CriticalKV(budget=16, window=4, kernel=3, base="adakv"), "blockwise"),
    (lambda: SageKV(budget=16), "prefill_once_decode_evict"),
    (lambda: SageKV(budget=16), "blockwise"),
], ids=["adakv", "adakv_kvpress", "criticalkv_adakv", "sagekv_decode_evict", "sagekv_blockwise"])
def test_deferred_storing_changes_nothing(make, protocol: str) -> None:
    """Every layer's positions before every forward (the trace) and at the end, and the tokens, equal whether each
    per-head selection is stored at once or when its sizes are read with the next token."""
    assert _run(make(), True, protocol) == _run(make(), False, protocol)


def test_sagekv_knows_on_the_host_whether_it_pinned() -> None:
    """SAGE-KV's slide condition, read on the host (the layer holds fewer tokens than it has seen), is exactly
    whether any token is pinned, at every selection of a run."""
    checks: list[tuple[bool, bool]] = []

    class Spy(SageKV):
        def select(self, layer):
            pinned = ((layer.state["pinned"] > 0) & (layer.positions >= 0)).any()
            checks.append((layer.physical() < layer.seen, bool(pinned)))
            return super().select(layer)

    for protocol in ("blockwise", "prefill_once_decode_evict"):
        _run(Spy(budget=16), True, protocol)
    assert checks and all(host == device for host, device in checks)
    assert {device for _, device in checks} == {True, False}  # both branches were taken


@pytest.mark.parametrize("protocol", ["blockwise", "prefill_once_decode_evict"])
@pytest.mark.parametrize("reuse", [False, True])
def test_sagekv_slides_the_latest_positions_whatever_the_slots_order(protocol: str, reuse: bool) -> None:
    """SAGE-KV's slide keeps the unpinned tokens from position seen - recent - 1 on (one comparison): at every slide of
    a run, the same slots as ranking the unpinned tokens by position and keeping the latest recent + 1 (budgets where
    the heads' unions overlap, so some heads hold fewer tokens; with slot reuse the slots out of position order)."""
    checks: list[bool] = []

    class Spy(SageKV):
        def dropped_position(self, layer):
            return None  # every slide selected (the shortcut is the same slide: tests/test_engine_shortcuts.py)

        def select(self, layer):
            chosen = super().select(layer)
            if self._sliding(layer):
                _, _, recent = self.sizes(layer.stash.queries.shape[1] // layer.keys.shape[1])
                real = layer.positions >= 0
                unpinned = real & ~(layer.state["pinned"] > 0)
                ranked = rank_mask(layer.positions.float().masked_fill(~unpinned, -math.inf), recent + 1)
                want = compact((real & (layer.state["pinned"] > 0)) | ranked)
                checks.append(torch.equal(chosen[0], want[0]) and torch.equal(chosen[1], want[1]))
            return chosen

    model = installed_model("tiny-llama")[0]
    for budget in (16, 24):
        generate(model, Spy(budget=budget), IDS, GenerationSettings(block=8, max_new_tokens=12, protocol=protocol,
                                                                      slot_reuse=reuse))
    assert len(checks) >= 20 and all(checks)
