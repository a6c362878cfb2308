"""The eviction fast paths select exactly what the straightforward computation selects: drop-one
selection, chronological protection masks, KeyDiff's and K-norm's per-token state, the tail-only causal mask of
query attention, row-copy `keep`, no policy work in layers a policy never evicts, and shared rebuilt masks.
Expected values are worked out by hand or come from the plain formula the fast path replaces."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvbench.engine import attention
from kvbench.engine.cache import EvictingCache, EvictingLayer
from kvbench.policies.adakv import AdaKV
from kvbench.policies.base import latest_mask, query_attention, rank_mask, top_slots
from kvbench.policies.criticalkv import stage2_scores
from kvbench.policies.keydiff import KeyDiff
from kvbench.policies.knorm import KNorm
from kvbench.policies.base import position_order, position_ranks
from kvbench.policies.snapkv import SnapKV
from kvbench.policies.streamingllm import StreamingLLM

pytestmark = pytest.mark.tiny_model(num_hidden_layers=4)  # the `model` fixture (conftest.py)


def _layer(n: int, h: int = 2, d: int = 4, d_v: int | None = None, seed: int = 0) -> EvictingLayer:
    g = torch.Generator().manual_seed(seed)
    layer = EvictingLayer(3)
    layer.update(torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d_v or d, generator=g))
    layer.scaling, layer.softcap = 0.5, None
    return layer


def test_top_slots_drops_one_lowest_score_latest_on_ties() -> None:
    scores = torch.tensor([[[3.0, 1.0, 2.0, 5.0, 4.0], [1.0, 0.5, 0.5, 2.0, 0.5]]])  # (1, 2, 5)
    # head 0: lowest is slot 1; head 1: slots 1, 2, 4 tie at 0.5 -> the latest (4) goes, earlier slots stay
    assert top_slots(scores, 4).tolist() == [[[0, 2, 3, 4], [0, 1, 2, 3]]]
    # more than one over: the highest scores, in slot order
    assert top_slots(scores, 2).tolist() == [[[3, 4], [0, 3]]]
    # ties across the cut keep the earlier slot there too: head 1 keeps 3 (2.0), 0 (1.0), then slot 1, the first
    # of the three 0.5s
    assert top_slots(scores, 3).tolist() == [[[0, 3, 4], [0, 1, 3]]]
    assert top_slots(torch.zeros(1, 1, 6), 3).tolist() == [[[0, 1, 2]]]


def test_top_slots_drop_one_equals_topk_without_ties() -> None:
    scores = torch.randn(2, 3, 257, generator=torch.Generator().manual_seed(1))
    want = scores.topk(256, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(top_slots(scores, 256), want)


def test_ties_by_position_keep_the_earlier_token_whatever_its_slot() -> None:
    # One head, slots out of position order (slot reuse): slot -> position 0:40, 1:7, 2:12, 3:3, 4:25, 5:9.
    pos = torch.tensor([[[40, 7, 12, 3, 25, 9]]])
    scores = torch.tensor([[[2.0, 0.0, -1.5, -0.0, 2.0, 0.0]]])
    # By score: 2.0 at slots 0 (position 40) and 4 (25): 25 is earlier, so slot 4 ranks first; then the three zeros
    # (-0.0 equals 0.0) at positions 7 (slot 1), 3 (slot 3), 9 (slot 5): slot 3, slot 1, slot 5; then -1.5 (slot 2).
    # Ranking: 4, 0, 3, 1, 5, 2
    assert top_slots(scores, 2, pos).tolist() == [[[0, 4]]]
    assert top_slots(scores, 3, pos).tolist() == [[[0, 3, 4]]]
    assert top_slots(scores, 4, pos).tolist() == [[[0, 1, 3, 4]]]
    assert rank_mask(scores, 3, pos).int().tolist() == [[[1, 0, 0, 1, 1, 0]]]
    # by slot instead: the zeros at slots 1, 3, 5 rank in that order
    assert top_slots(scores, 3).tolist() == [[[0, 1, 4]]]
    # infinities and negative scores: +inf first, -inf last and never in rank_mask
    inf = torch.tensor([[[-math.inf, -2.0, math.inf, -3.0, math.inf, -2.0]]])
    assert top_slots(inf, 3, pos).tolist() == [[[1, 2, 4]]]  # +inf at slots 2 and 4, then -2.0 at position 7 (slot 1)
    assert rank_mask(inf, 5, pos).int().tolist() == [[[0, 1, 1, 1, 1, 1]]]


def test_drop_one_by_position_reads_a_hole_as_the_earliest_token() -> None:
    # slot -> position 0:5, 1:-1 (a hole), 2:7. The hole alone lowest: it goes (the old mask of -1 dropped slot 0).
    pos = torch.tensor([[[5, -1, 7]]])
    assert top_slots(torch.tensor([[[1.0, 0.0, 2.0]]]), 2, pos).tolist() == [[[0, 2]]]
    # tied lowest with position 5: the latest of the two goes (5), the hole stays, as the sort ranks them
    assert top_slots(torch.tensor([[[0.0, 0.0, 2.0]]]), 2, pos).tolist() == [[[1, 2]]]
    assert rank_mask(torch.tensor([[[0.0, 0.0, 2.0]]]), 2, pos).int().tolist() == [[[0, 1, 1]]]


@pytest.mark.parametrize("n,count", [(9, 4), (64, 33), (130, 1), (130, 128)])
def test_ties_by_position_are_the_stable_sorts_first_in_position_order(n: int, count: int) -> None:
    g = torch.Generator().manual_seed(n * count)
    scores = torch.randint(-2, 3, (2, 3, n), generator=g).float()  # five values: ties everywhere, across the cut too
    scores[scores == 0] = torch.tensor([0.0, -0.0])[torch.randint(0, 2, (int((scores == 0).sum()),), generator=g)]
    scores[0, 0, :3] = math.inf
    scores[1, 2, -4:] = -math.inf
    pos = torch.stack([torch.randperm(3 * n, generator=g)[:n] for _ in range(6)]).view(2, 3, n)  # distinct per head
    # the plain formula: slots in position order, a stable descending sort of their scores, its first `count`
    by_pos = pos.argsort(dim=-1)
    order = by_pos.gather(-1, torch.sort(scores.gather(-1, by_pos), dim=-1, descending=True, stable=True).indices)
    if count < n - 1:  # (n - 1: the drop-one path, tested above)
        assert torch.equal(top_slots(scores, count, pos), order[..., :count].sort(dim=-1).values)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n).expand_as(order))
    assert torch.equal(rank_mask(scores, count, pos), (rank < count) & (scores > -math.inf))


@pytest.mark.parametrize("n,count", [(9, 4), (64, 33), (130, 1), (130, 128)])
def test_top_slots_and_rank_mask_of_one_count_are_the_stable_sorts_first(n: int, count: int) -> None:
    g = torch.Generator().manual_seed(n + count)
    scores = torch.randint(0, 5, (2, 3, n), generator=g).float()  # five values: ties everywhere, across the cut too
    scores[0, 0, :3] = math.inf  # protected slots
    scores[1, 2, -4:] = -math.inf  # padding
    # the plain formula the cut replaces: a stable descending sort (ties to the earlier slot), its first `count`
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    assert torch.equal(top_slots(scores, count), order[..., :count].sort(dim=-1).values)
    # rank_mask with one count for every head: the same ranks as a mask, padding (-inf) never selected
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n).expand_as(order))
    assert torch.equal(rank_mask(scores, count), (rank < count) & (scores > -math.inf))


@pytest.mark.parametrize("window", ["outside", "inside"])
def test_criticalkv_stage2_with_host_counts_equals_per_head_counts(window: str) -> None:
    g = torch.Generator().manual_seed(5)
    scores, vnorm = torch.rand(1, 3, 40, generator=g), torch.rand(1, 3, 40, generator=g)
    scores[..., -4:] = math.inf  # 4 protected slots per head
    want = stage2_scores(scores, vnorm, torch.full((1, 3), 25), torch.full((1, 3), 4), 0.5, 1e-4, window)
    assert torch.equal(stage2_scores(scores, vnorm, 25, 4, 0.5, 1e-4, window), want)
    # stage 1 by hand: outside 4 + floor(0.5 * 21) = 14 tokens at +inf per head, inside max(4, floor(12.5)) = 12
    assert (want == math.inf).sum(dim=-1).tolist() == [[14 if window == "outside" else 12] * 3]


def _padded_view(kept: list[list[int]], seen: int = 12, d: int = 4) -> EvictingLayer:
    """A layer that saw `seen` tokens and keeps the positions `kept[h]` of KV head h (batch 1; heads of different
    sizes, so it is stored flat per head), in its padded scoring view."""
    g = torch.Generator().manual_seed(seen)
    layer = EvictingLayer(0)
    layer.update(torch.randn(1, len(kept), seen, d, generator=g), torch.randn(1, len(kept), seen, d, generator=g))
    width = max(len(k) for k in kept)
    idx = torch.tensor([[k + [0] * (width - len(k)) for k in kept]])
    valid = torch.tensor([[[True] * len(k) + [False] * (width - len(k)) for k in kept]])
    layer.keep(idx, valid)
    assert layer.ragged
    layer.unpack()
    return layer


def test_latest_mask_of_a_padded_view_is_each_heads_latest_real_tokens() -> None:
    layer = _padded_view([[0, 2, 5, 7], [1, 3], [4, 6, 8]], seen=9)
    assert latest_mask(layer, 2)[0].tolist() == [[False, False, True, True], [True, True, False, False],
                                                  [False, True, True, False]]
    assert latest_mask(layer, 3)[0].tolist() == [[False, True, True, True], [True, True, False, False],
                                                  [True, True, True, False]]


def test_query_attention_of_a_padded_view_masks_only_the_tail_like_the_full_mask() -> None:
    # heads of 7, 3 and 5 tokens after a 12-token prompt; the queries at 9..11 cannot see the keys after them
    # (positions 10 and 11, held by heads 0 and 2) nor the padding; head 1 holds none of them
    layer = _padded_view([[0, 1, 4, 6, 9, 10, 11], [0, 5, 8], [2, 3, 7, 9, 11]])
    layer.scaling, layer.softcap = 0.4, None
    layer.stash.add(torch.randn(1, 6, 3, 4, generator=torch.Generator().manual_seed(2)), layer.seen, 3)
    assert layer.stash.first == 9
    fast = query_attention(layer)  # masks from slot min(7, 3, 5) - (11 - 9) = 1 on
    layer.stash.first = None  # the general path: every key's visibility to every query
    full = query_attention(layer)
    assert torch.equal(fast, full)
    # query 9 (row 0) of head 0's group: positions 10 and 11 (slots 5, 6) weigh exactly 0, as the padding of head 1
    assert fast[0, :2, 0, 5:].abs().max().item() == 0.0 and fast[0, 2:4, :, 3:].abs().max().item() == 0.0


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("gap_free", [True, False])
def test_query_attention_over_each_heads_own_keys_equals_the_padded_keys(softcap: float | None,
                                                                        gap_free: bool) -> None:
    # The same layer in its padded view with K/V padded and with K/V left flat (`unpack(kv=False)`: attention over
    # each head's own keys, `head_keys`): the same probabilities bit for bit, padding exactly 0, and their mean
    kept = [[0, 1, 4, 6, 9, 10, 11], [0, 5, 8], [2, 3, 7, 9, 11]]
    query = torch.randn(1, 6, 3, 4, generator=torch.Generator().manual_seed(2))
    views = []
    for kv in (True, False):
        layer = _padded_view(kept)
        layer.pack()
        layer.unpack(kv=kv)
        layer.scaling, layer.softcap = 0.4, softcap
        layer.stash.add(query, layer.seen, 3)
        if not gap_free:
            layer.stash.first = None
        views.append(layer)
    padded, flat = views
    assert padded.head_keys() is None and [k.shape[0] for k in flat.head_keys()] == [7, 3, 5]
    want = query_attention(padded)  # (1, 6, 3, 7)
    got = query_attention(flat)
    assert torch.equal(got, want)
    assert got[0, 2:4, :, 3:].abs().max().item() == 0.0 and got[0, 4:, :, 5:].abs().max().item() == 0.0
    assert torch.equal(query_attention(flat, mean=True), want.mean(dim=-2))
    # by hand: query 9 (row 0) of head 1's group sees all 3 of its keys (positions 0, 5, 8): a softmax over 3
    keys = flat.head_keys()[1]
    logits = 0.4 * query[0, 2] @ keys.t()  # (3 queries, 3 keys)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    torch.testing.assert_close(got[0, 2, :, :3], torch.softmax(logits, dim=-1))


def test_a_ragged_layer_under_its_total_budget_is_not_unpacked() -> None:
    # AdaKV: 3 heads share 3 x 5 slots; 6 + 2 + 4 = 12 tokens fit although head 0 holds more than 5
    layer = _padded_view([[0, 1, 2, 3, 4, 5], [0, 6], [1, 3, 5, 7]])
    layer.pack()
    keys = layer.keys  # (S, d): the flat storage
    policy = AdaKV(budget=5, window=2, kernel=1)
    assert layer.kv_heads == 3 and not policy.due(layer)
    assert policy.evict(layer) is False
    assert layer.ragged and layer.keys is keys  # no padded view built and stored back
    over = _padded_view([[0, 1, 2, 3, 4, 5, 6], [0, 6, 7, 8, 9], [1, 3, 5, 7]])  # 16 > 15
    over.pack()
    assert policy.due(over)
    # the forward keeps the window's rows only for a layer its eviction will select from: a decoding step's 1, a
    # block's latest `window` (2) of its 3 queries; none for a layer under its total budget
    assert [policy.attention_rows(over, q) for q in (1, 3)] == [1, 2]
    assert [policy.attention_rows(layer, q) for q in (1, 3)] == [0, 0]


def test_protected_mask_of_chronological_slots_is_sinks_first_and_recent_last() -> None:
    layer = _layer(9)
    policy = StreamingLLM(budget=6, n_sink=2, n_recent=3)
    prot = policy.protected(layer)
    assert prot[0, 0].tolist() == [True, True, False, False, False, False, True, True, True]
    assert policy.protected(layer) is prot  # built once per shape
    layer.keep(torch.tensor([[[0, 1, 3, 6, 7, 8]] * 2]))  # the sinks stay the first slots after an eviction
    assert policy.protected(layer)[0, 1].tolist() == [True, True, False, True, True, True]


def test_keep_copies_the_kept_rows_of_keys_values_positions_and_state() -> None:
    layer = _layer(6, d=4, d_v=3)  # value head dim != key head dim
    layer.state["s"] = torch.arange(12, dtype=torch.float32).view(1, 2, 6)
    k, v = layer.keys.clone(), layer.values.clone()
    idx = torch.tensor([[[0, 2, 5], [1, 3, 4]]])
    layer.keep(idx)
    for h in range(2):
        assert torch.equal(layer.keys[0, h], k[0, h, idx[0, h]])
        assert torch.equal(layer.values[0, h], v[0, h, idx[0, h]])
    assert layer.positions.tolist() == [[[0, 2, 5], [1, 3, 4]]]
    assert layer.state["s"].tolist() == [[[0.0, 2.0, 5.0], [7.0, 9.0, 10.0]]]


@pytest.mark.parametrize("anchor", ["mean_normalized", "pairwise"])
def test_keydiff_state_scores_rank_like_cosine_to_the_mean_unit_key(anchor: str) -> None:
    layer = _layer(40, h=3, d=8, seed=2)
    k = layer.keys
    unit = F.normalize(k, dim=-1)
    plain = -F.cosine_similarity(k, unit.mean(dim=-2, keepdim=True), dim=-1)  # Eq. 8 as written
    policy = KeyDiff(budget=30, anchor=anchor)
    layer.state["inv_norm"] = policy.on_append(layer, None, k, layer.values, None)["inv_norm"]
    fast = policy.score(layer)
    # same values up to the positive per-head factor |sum of unit keys| (the cosine divides by it)
    assert torch.allclose(fast, plain * unit.sum(dim=-2).norm(dim=-1, keepdim=True), atol=1e-5)
    idx, _ = policy.select(layer)
    assert torch.equal(idx, plain.topk(30, dim=-1).indices.sort(dim=-1).values)


def test_knorm_norms_are_per_token_state() -> None:
    layer = _layer(10, seed=3)
    policy = KNorm(budget=6)
    layer.state["norm"] = policy.on_append(layer, None, layer.keys, layer.values, None)["norm"]
    layer.keys = torch.zeros_like(layer.keys)  # the score must come from the state, not from re-reading keys
    idx, _ = policy.select(layer)
    assert torch.equal(idx, (-layer.state["norm"]).topk(6, dim=-1).indices.sort(dim=-1).values)


def test_query_attention_masks_only_the_tail_like_the_full_causal_mask() -> None:
    layer = EvictingLayer(0)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):  # three blocks of 5, queries stashed with a rolling window of 7 as the wrapper does
        q = torch.randn(1, 4, 5, 8, generator=g)
        layer.update(torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g))
        layer.stash.add(q, layer.seen, 7)
    layer.scaling, layer.softcap = 0.3, None
    layer.keep(torch.tensor([[[0, 2, 4, 6, 9, 10, 11, 12, 13, 14]] * 2]))
    assert layer.stash.first == 8 and layer.stash.positions.tolist() == list(range(8, 15))
    fast = query_attention(layer)
    layer.stash.first = None  # the general path: visibility of every key to every query
    full = query_attention(layer)
    assert torch.equal(fast, full)
    # query 8 sees positions 0..8 only: its attention to 9..14 (the last six slots, the tail seen - 1 - 8 that the
    # fast path masks) is exactly zero, to 0, 2, 4, 6 positive
    assert fast[0, :, 0, -6:].abs().max().item() == 0.0 and fast[0, :, 0, :4].min().item() > 0


def test_a_gap_in_stashed_queries_falls_back_to_the_full_mask() -> None:
    layer = _layer(6)
    layer.stash.add(torch.zeros(1, 2, 2, 4), layer.seen, 4)
    layer.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))  # a forward that stashed nothing
    layer.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    layer.stash.add(torch.zeros(1, 2, 1, 4), layer.seen, 4)
    assert layer.stash.first is None and layer.stash.positions.tolist() == [4, 5, 9]


def test_layers_a_policy_never_evicts_get_no_policy_work(model) -> None:
    cache = EvictingCache(model.config, KNorm(budget=16))  # skip_layers (0, 1)
    assert cache.evicted == {2, 3}
    ids = torch.randint(8, 500, (1, 40), generator=torch.Generator().manual_seed(5))
    with attention.active(cache), torch.inference_mode():
        for s in range(0, 40, 8):
            model(input_ids=ids[:, s:s + 8], past_key_values=cache)
            for layer in cache.evicting_layers():
                cache.policy.evict(layer)
    assert [sorted(layer.state) for layer in cache.layers] == [[], [], ["norm"], ["norm"]]
    assert [layer.physical() for layer in cache.layers] == [40, 40, 16, 16]


def test_snapkv_window_queries_stashed_only_in_evicted_layers(model) -> None:
    policy = SnapKV(budget=16, window=4, skip_layers=[1])
    cache = EvictingCache(model.config, policy)
    ids = torch.randint(8, 500, (1, 24), generator=torch.Generator().manual_seed(6))
    with attention.active(cache), torch.inference_mode():
        model(input_ids=ids, past_key_values=cache)
    assert [layer.stash.queries is None for layer in cache.layers] == [False, True, False, False]


def test_rebuilt_masks_are_shared_between_layers_of_one_length() -> None:
    memo: dict = {}
    hf = torch.ones(1, 1, 8, 40, dtype=torch.bool)  # sized for an unbounded first layer
    a = attention._fit_mask(hf, 8, 24, "sdpa", torch.float32, torch.device("cpu"), memo)
    b = attention._fit_mask(hf, 8, 24, "sdpa", torch.float32, torch.device("cpu"), memo)
    assert a is b and len(memo) == 1
    assert a[0, 0].sum(dim=-1).tolist() == [17, 18, 19, 20, 21, 22, 23, 24]  # 16 earlier slots + causal block
    assert attention._fit_mask(hf, 8, 40, "sdpa", torch.float32, torch.device("cpu"), memo) is hf


@pytest.mark.parametrize("seen", [10, 100, None])  # counted (10 <= 8 x 4), sorted (100 > 32; None: rows' own counts)
def test_random_draws_follow_each_token_by_its_age(seen: int | None) -> None:
    """By hand: slots holding positions 5, 2, 9, 0 rank 2, 1, 3, 0 by age (0 the oldest), so the draws d0..d3 the
    chronological layout gives its tokens in order go to the slots as d2, d1, d3, d0."""
    positions = torch.tensor([[[5, 2, 9, 0]]])
    assert position_ranks(positions, seen).tolist() == [[[2, 1, 3, 0]]]
    draws = torch.tensor([[[0.1, 0.2, 0.3, 0.4]]])
    assert torch.equal(draws.gather(-1, position_ranks(positions, seen)), draws[..., [2, 1, 3, 0]])


@pytest.mark.parametrize("seen", [10, 100, None])
def test_position_order_lists_slots_oldest_first(seen: int | None) -> None:
    """By hand: head 0 holds positions 5, 2, 9, 0 in slots 0..3, so its slots in position order are 3 (pos 0), 1 (2),
    0 (5), 2 (9); head 1 holds 7, -1 (a hole), 3, 8: the hole first, as a sort puts it, then slots 2, 0, 3."""
    positions = torch.tensor([[[5, 2, 9, 0], [7, -1, 3, 8]]])
    assert position_order(positions, seen).tolist() == [[[3, 1, 0, 2], [1, 2, 0, 3]]]
    assert position_ranks(positions, seen).tolist() == [[[2, 1, 3, 0], [2, 0, 1, 3]]]
