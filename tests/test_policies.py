"""Pinned selections of the core policies on hand-built caches; expected indices worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from kvbench.policies.base import PolicyError, pool
from kvbench.policies.full import Full
from kvbench.policies.h2o import H2O
from kvbench.policies.keydiff import KeyDiff
from kvbench.policies.knorm import KNorm
from kvbench.policies.random import Random
from kvbench.policies.snapkv import SnapKV
from kvbench.policies.streamingllm import StreamingLLM
from kvbench.policies.tova import TOVA

from helpers import kept
from helpers import make_view as shared_make_view


def make_view(keys: list, queries: list | None = None, layer_idx: int = 2):
    return shared_make_view(keys, queries, layer_idx=layer_idx)  # layer 2: K-norm evicts it


def test_streamingllm_keeps_sinks_and_recent() -> None:
    view = make_view([[[float(i)] for i in range(10)]])
    assert kept(StreamingLLM(budget=6), view) == [[0, 1, 2, 3, 8, 9]]


def test_knorm_keeps_lowest_norms_and_skips_layers() -> None:
    # norms: 5, 1, 3, 2, 4 -> keep the three lowest: slots 1, 3, 2 -> sorted [1, 2, 3]
    view = make_view([[[3.0, 4.0], [1.0, 0.0], [0.0, 3.0], [0.0, -2.0], [4.0, 0.0]]])
    assert kept(KNorm(budget=3), view) == [[1, 2, 3]]
    assert [KNorm(budget=3).layer_budget(i) for i in range(3)] == [None, None, 3]  # layers 0, 1 not evicted


def test_keydiff_keeps_keys_least_similar_to_mean_unit_key() -> None:
    # Unit keys at 0, 0, 0, 90, 180 degrees: anchor = mean = (1/5)(2, 1) -> direction (2, 1)/sqrt5.
    # cos with anchor: 2/sqrt5 (x3), 1/sqrt5, -2/sqrt5 -> least similar: slot 4, then slot 3.
    keys = [[[1.0, 0.0], [2.0, 0.0], [0.5, 0.0], [0.0, 3.0], [-1.0, 0.0]]]
    assert kept(KeyDiff(budget=2), make_view(keys)) == [[3, 4]]
    # Two heads are scored independently: head 1 mirrors head 0 (y <-> x): same slots.
    mirrored = [[[k[1], k[0]] for k in keys[0]]]
    assert kept(KeyDiff(budget=2), make_view(keys + mirrored)) == [[3, 4], [3, 4]]


def test_keydiff_variants() -> None:
    keys = [[[4.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]
    # mean anchor = (1.5, 0.5). dot: 6, 1.5, 0.5, 2 -> keep lowest dot: slots 2, 1.
    assert kept(KeyDiff(budget=2, anchor="mean", metric="dot"), make_view(keys)) == [[1, 2]]
    # euclidean to (1.5, 0.5): 2.55, 0.71, 1.58, 0.71 -> farthest: slots 0 and 2.
    assert kept(KeyDiff(budget=2, anchor="mean", metric="euclidean"), make_view(keys)) == [[0, 2]]
    # median anchor (lower median of 4 values, torch semantics) = (1, 0): cosine 1, 1, 0, 0.707 -> keep 2, 3.
    assert kept(KeyDiff(budget=2, anchor="median"), make_view(keys)) == [[2, 3]]
    # pairwise: -sum_j cos(k_i, k_j). Unit keys (1,0), (0,1), (.6,.8), (-.6,.8) sum to S = (1.0, 2.6);
    # sum_j cos(k_i, k_j) = u_i . S = 1.0, 2.6, 2.68, 1.48 -> keep the two smallest sums: slots 0 and 3.
    pair_keys = [[[2.0, 0.0], [0.0, 1.0], [0.6, 0.8], [-1.2, 1.6]]]
    assert kept(KeyDiff(budget=2, anchor="pairwise"), make_view(pair_keys)) == [[0, 3]]
    # recent_ratio 0.5 of budget 2 reserves the newest slot (3); the other by KeyDiff: slot 2.
    assert kept(KeyDiff(budget=2, recent_ratio=0.5), make_view(keys)) == [[2, 3]]


def test_tova_last_query_attention_with_gqa_mean() -> None:
    # 1-d keys; two query heads share the KV head. head 0 (q=+1) prefers large keys, head 1 (q=-1) small ones.
    keys = [[[0.0], [3.0], [-2.0], [1.0], [0.5]]]
    e = [math.exp(v) for v in (0.0, 3.0, -2.0, 1.0, 0.5)]
    f = [math.exp(-v) for v in (0.0, 3.0, -2.0, 1.0, 0.5)]
    mean = [(a / sum(e) + b / sum(f)) / 2 for a, b in zip(e, f)]  # 0.5*(p_head0 + p_head1)
    expect = sorted(sorted(range(5), key=lambda i: -mean[i])[:2])
    assert expect == [1, 2]  # hand check: slot 1 (0.400+0.006), slot 2 (0.001+0.505)
    assert kept(TOVA(budget=2), make_view(keys, queries=[[[1.0]], [[-1.0]]])) == [expect]


def test_h2o_keeps_largest_accumulated_attention() -> None:
    view = make_view([[[0.0]] * 5])
    view.state["acc"] = torch.tensor([[[[0.5, 2.0, 0.1, 1.5, 0.2]]]])  # (L, b, h_kv, S)
    assert kept(H2O(budget=2), view) == [[1, 3]]
    assert kept(H2O(budget=3, recent_ratio=0.5), view) == [[1, 3, 4]]  # newest slot reserved + top 2


def test_h2o_accumulates_what_each_forward_gives() -> None:
    # The engine hands each forward's attention per slot (b, h_kv, S), summed over its queries; H2O adds it in place
    # into its layer's row of the state. Three forwards' rows [1, 0, 0], [.25, .75, 0], [.25, .25, .5] sum to
    # [1.5, 1.0, 0.5] (exact in binary floating point); the other layer's row stays 0.
    acc = torch.zeros(2, 1, 1, 3)
    state = {"acc": acc.unbind(0)}
    policy = H2O(budget=2)
    for received in ([1.0, 0.0, 0.0], [0.25, 0.75, 0.0], [0.25, 0.25, 0.5]):
        policy.on_attention(state, 1, torch.tensor([[received]]))
    assert acc.tolist() == [[[[0.0, 0.0, 0.0]]], [[[1.5, 1.0, 0.5]]]]


def test_snapkv_window_attention_pooled() -> None:
    # One window query (q=1), keys ln(w): attention p = w / 18 with w = [3, 8, 1, 1, 4, 1].
    # The last slot is the window (kept). Prefix p * 18 = [3, 8, 1, 1, 4]; avg pool k=3 with zero padding:
    # [11, 12, 10, 6, 5] / 3 -> top 2 of the prefix: slots 1, 0 -> kept [0, 1, 5].
    w = [3.0, 8.0, 1.0, 1.0, 4.0, 1.0]
    view = make_view([[[math.log(v)] for v in w]], queries=[[[1.0]]])
    assert kept(SnapKV(budget=3, window=1, kernel=3), view) == [[0, 1, 5]]
    # max pooling: [8, 8, 8, 4, 4] -> ties among 0-2, to the earlier positions: 0, 1
    assert kept(SnapKV(budget=3, window=1, kernel=3, pooling="max"), view) == [[0, 1, 5]]
    # kernel 1 (no smoothing): prefix p -> slots 1, 4
    assert kept(SnapKV(budget=3, window=1, kernel=1), view) == [[1, 4, 5]]


def test_pooling_by_hand_and_bit_for_bit_as_torchs() -> None:
    # [3, 8, 1, 1, 4], kernel 3, zero padding, always / 3: [11, 12, 10, 6, 5] / 3; max [8, 8, 8, 4, 4]
    x = torch.tensor([[3.0, 8.0, 1.0, 1.0, 4.0]])
    assert torch.equal(pool(x, 3, "avg") * 3, torch.tensor([[11.0, 12.0, 10.0, 6.0, 5.0]]))
    assert pool(x, 3, "max").tolist() == [[8.0, 8.0, 8.0, 4.0, 4.0]]
    # The sum of shifted slices adds each window in avg_pool1d's own order: the same bits, padding and short rows too
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        for n in (1, 3, 40, 1153):
            x = torch.rand(2, 9, n, generator=gen, dtype=dtype) ** 3  # probabilities: small, of many magnitudes
            for kernel in (1, 3, 5, 7):
                flat = x.reshape(-1, 1, n)
                avg = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2).view(x.shape)
                mx = torch.nn.functional.max_pool1d(flat, kernel, stride=1, padding=kernel // 2).view(x.shape)
                assert torch.equal(pool(x, kernel, "avg"), avg) and torch.equal(pool(x, kernel, "max"), mx)


def test_snapkv_window_queries_are_causal() -> None:
    # Two window queries at positions 3 and 4. The query at position 3 must not see slot 4.
    view = make_view([[[0.0], [math.log(4.0)], [0.0], [0.0], [0.0]]], queries=[[[1.0], [1.0]]])
    # query@3 over slots 0..3: w = [1, 4, 1, 1] / 7; query@4 over 0..4: [1, 4, 1, 1, 1] / 8
    probs = view.attention()[0, 0, 0]  # (w, S)
    assert torch.allclose(probs[0], torch.tensor([1 / 7, 4 / 7, 1 / 7, 1 / 7, 0.0]))
    assert torch.allclose(probs[1], torch.tensor([1 / 8, 4 / 8, 1 / 8, 1 / 8, 1 / 8]))


def test_random_is_seeded_per_sample() -> None:
    view = make_view([[[0.0]] * 20])
    a, b = Random(budget=5, seed=1), Random(budget=5, seed=1)
    a.start_sample(7)
    b.start_sample(7)
    assert kept(a, view) == kept(b, view)
    b.start_sample(8)
    assert kept(a, view) != kept(b, view)  # another sample draws another subset (fixed seeds: checked once)


def test_no_eviction_within_budget_and_full() -> None:
    assert kept(KeyDiff(budget=4), make_view([[[1.0]] * 4])) == [[0, 1, 2, 3]]
    assert Full().layer_budget(0) is None  # the full baseline evicts no layer


@pytest.mark.parametrize("factory", [lambda: StreamingLLM(budget=4), lambda: SnapKV(budget=32),
                                     lambda: KeyDiff(budget=0), lambda: H2O(budget=-3)])
def test_budget_must_exceed_protected_tokens(factory) -> None:
    with pytest.raises(PolicyError, match="budget"):
        factory()


def test_unknown_options_are_errors() -> None:
    with pytest.raises(PolicyError, match="anchor"):
        KeyDiff(budget=8, anchor="nope")
    with pytest.raises(PolicyError, match="pooling"):
        SnapKV(budget=64, pooling="min")
