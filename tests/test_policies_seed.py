"""Pinned selections of AdaKV, CriticalKV, HashEvict and SAGE-KV on hand-built caches (expected indices worked out
by hand from the papers' formulas), per-head caches against an explicit float64 model, determinism, cache
bounds, and the eviction diagnostics."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

import kvbench.policies.criticalkv as criticalkv_module
from kvbench.policies.diagnostics import Diagnostics, key_logdet
from kvbench.run.records import aggregate_diagnostics as aggregate
from kvbench.engine.generate import GenerationSettings, Observer, generate
from kvbench.models.tiny import build_tiny_model
from kvbench.policies.adakv import AdaKV, allocate
from kvbench.policies.base import PolicyError, SlotView
from kvbench.policies.criticalkv import CriticalKV
from kvbench.policies.hashevict import HashEvict
from kvbench.policies.keydiff import KeyDiff
from kvbench.policies.pyramidkv import PyramidKV
from kvbench.policies.sagekv import SageKV

from helpers import held_counts, installed_model, kept, make_view, run_config, settle
from float64_reference import reference_logits


def log_keys(weights: list[float]) -> list[list[float]]:
    """1-d keys ln(w): with query 1 and scaling 1 the attention to slot i is w_i / sum(w)."""
    return [[math.log(w)] for w in weights]


# AdaKV -------------------------------------------------------------------------------------------------------------
# Two KV heads (one query head each), window 1 (slot 7, the query's own token), kernel 1 (no smoothing), N = 4.
# Head 0 weights 8,8,8,8,8,1,1 | 1 -> A = 8/43 (slots 0-4), 1/43 (5, 6).
# Head 1 weights 1,1.2,1.4,1.6,1.8,2,6 | 1 -> A = .0625 .075 .0875 .1 .1125 .125 .375.
# The layer has 2 * 4 = 8 slots; each head keeps its window. Free budget F = N - window = 3 per head.
# allocation=adakv (AdaKV's code): c = shares of the global top 2F = 6 unprotected scores = h1 slot 6 (.375),
# h0 slots 0-4 (.186) -> c = (5, 1); head h keeps round((1 - a) c_h + floor(a F)) by its own scores:
#  a 0   : floor 0, round(5), round(1)          = 5, 1 -> h0 slots 0-4, h1 slot 6
#  a 0.2 : floor(0.6) = 0, round(4.0), round(.8) = 4, 1 -> h0 slots 0-3 (ties: earlier slot), h1 slot 6 (7 < 8 kept)
#  a 0.5 : floor(1.5) = 1, round(3.5), round(1.5) = 4, 2 (half to even) -> h0 slots 0-3, h1 slots 6, 5
#  a 1   : floor 3, 3 each = SnapKV per head: h0 slots 0, 1, 2, h1 slots 4, 5, 6
# allocation=kvpress: each head keeps its top floor(a N) slots counting its window (at least the window), then
# the layer's best remaining scores fill the 8 slots:
#  a 0.2 : floor(0.8) = 0 -> window only; global top 6 as above            -> h0 slots 0-4, h1 slot 6
#  a 0.75: floor(3) -> window + h0 0, 1 and h1 6, 5; 2 more: h0 2, 3 (.186) beat h1 4 (.1125)
#  a 1   : floor(4) -> window + 3 each = SnapKV per head
ADA_KEYS = [log_keys([8, 8, 8, 8, 8, 1, 1, 1]), log_keys([1, 1.2, 1.4, 1.6, 1.8, 2, 6, 1])]
ADA_QUERIES = [[[1.0]], [[1.0]]]


@pytest.mark.parametrize("allocation,alpha,expected", [
    ("adakv", 0.0, [[0, 1, 2, 3, 4, 7], [6, 7]]),
    ("adakv", 0.2, [[0, 1, 2, 3, 7], [6, 7]]),
    ("adakv", 0.5, [[0, 1, 2, 3, 7], [5, 6, 7]]),
    ("adakv", 1.0, [[0, 1, 2, 7], [4, 5, 6, 7]]),
    ("kvpress", 0.2, [[0, 1, 2, 3, 4, 7], [6, 7]]),
    ("kvpress", 0.75, [[0, 1, 2, 3, 7], [5, 6, 7]]),
    ("kvpress", 1.0, [[0, 1, 2, 7], [4, 5, 6, 7]]),
])
def test_adakv_per_head_budgets(allocation: str, alpha: float, expected: list[list[int]]) -> None:
    policy = AdaKV(budget=4, window=1, kernel=1, alpha_safeguard=alpha, allocation=allocation)
    assert kept(policy, make_view(ADA_KEYS, ADA_QUERIES)) == expected


def test_adakv_defaults_are_adakv_code_allocation_with_a_fifth_safeguard() -> None:
    policy = AdaKV(budget=4, window=1, kernel=1)
    assert (policy.allocation, policy.alpha_safeguard) == ("adakv", 0.2)
    assert kept(policy, make_view(ADA_KEYS, ADA_QUERIES)) == [[0, 1, 2, 3, 7], [6, 7]]
    with pytest.raises(PolicyError):
        AdaKV(budget=4, alpha_safeguard=1.5)
    with pytest.raises(PolicyError, match="allocation"):
        AdaKV(budget=40, allocation="mix")


def test_adakv_code_rounding_never_exceeds_the_layer_budget() -> None:
    # Three heads, N = 3, one protected slot each (slot 0) -> F = 2, global top 2 * 3 = 6 unprotected scores:
    # h0 .9, h1 .8, h2 .7 .6 .5 .4 -> c = (1, 1, 4). a = 0.5: floor(1.0) = 1; 0.5 c + 1 = 1.5, 1.5, 3 round to
    # 2, 2, 3 = 7 > 6: one token back from a head rounded up the most (h0, h1 tie: h0) -> 1, 2, 3 (+1 protected).
    inf = math.inf
    scores = torch.tensor([[[inf, .9, .1, .1, .1, .1], [inf, .8, .1, .1, .1, .1], [inf, .7, .6, .5, .4, .1]]])
    one = torch.ones(1, 3, dtype=torch.long)
    assert allocate(scores, torch.tensor([[3]]), one, 0.5, "adakv").tolist() == [[2, 3, 4]]
    # kvpress on the same scores: safeguard floor(1.5) = 1 = the protected slot; then the global top 6 -> (2, 2, 5)
    assert allocate(scores, torch.tensor([[3]]), one, 0.5, "kvpress").tolist() == [[2, 2, 5]]


def test_adakv_head_cap_bounds_a_head() -> None:
    # alpha 0 gave head 0 six tokens (above). head_cap 1.25: a head keeps at most ceil(1.25 * 4) = 5 tokens, its
    # protected one included: head 0's last unprotected by rank (slot 4, tied at 8/43, goes after slots 0-3) is
    # dropped, and the slot clamped away is not handed to head 1.
    policy = AdaKV(budget=4, window=1, kernel=1, alpha_safeguard=0.0, head_cap=1.25)
    assert policy.head_capacity(4) == 5
    assert kept(policy, make_view(ADA_KEYS, ADA_QUERIES)) == [[0, 1, 2, 3, 7], [6, 7]]
    with pytest.raises(PolicyError, match="head_cap"):
        AdaKV(budget=4, head_cap=0.5)


# CriticalKV --------------------------------------------------------------------------------------------------------
# One head, window 1 (slot 7), kernel 1, N = 5 -> free budget b = 4.
# A = w / 23 with w = 6,5,4,3,2,1,1 | 1;  ||v W_O||_1 = .1,1,1,1,10,1,50 | 1.
# alpha .5: stage 1 = floor(2) by A -> slots 0, 1; stage 2 (2 of the rest) by (A + eps) * vnorm:
#   slot 2 .174, 3 .130, 4 .870, 5 .043, 6 2.17 -> slots 6, 4.                     => [0, 1, 4, 6, 7]
# alpha 1: all by A (= SnapKV)                                                       => [0, 1, 2, 3, 7]
# alpha 0: all by (A + eps) * vnorm: 6 (2.17), 4 (.87), 1 (.217), 2 (.174)           => [1, 2, 4, 6, 7]
CRIT_KEYS = [log_keys([6, 5, 4, 3, 2, 1, 1, 1])]
CRIT_VNORM = [0.1, 1, 1, 1, 10, 1, 50, 1]


def crit_view() -> SlotView:
    view = make_view(CRIT_KEYS, [[[1.0]]])
    view.state["vnorm"] = torch.tensor(CRIT_VNORM).view(1, 1, 1, 8)
    return view


@pytest.mark.parametrize("alpha,expected", [(0.5, [0, 1, 4, 6, 7]), (1.0, [0, 1, 2, 3, 7]),
                                            (0.0, [1, 2, 4, 6, 7])])
def test_criticalkv_two_stages(alpha: float, expected: list[int]) -> None:
    assert kept(CriticalKV(budget=5, window=1, kernel=1, alpha=alpha), crit_view()) == [expected]


# Stage-1 split, same cache, alpha .75, the head keeps 5 (window 1):
#  outside (default): stage 1 = 1 + floor(.75 * 4) = 4 -> window + slots 0, 1, 2; stage 2 keeps 1: slot 6
#  inside (kvpress) : stage 1 = max(1, floor(.75 * 5)) = 3 -> window + slots 0, 1; stage 2 keeps 2: slots 6, 4
@pytest.mark.parametrize("stage1_window,expected", [("outside", [0, 1, 2, 6, 7]), ("inside", [0, 1, 4, 6, 7])])
def test_criticalkv_stage1_window(stage1_window: str, expected: list[int]) -> None:
    policy = CriticalKV(budget=5, window=1, kernel=1, alpha=0.75, stage1_window=stage1_window)
    assert kept(policy, crit_view()) == [expected]
    assert CriticalKV(budget=40).stage1_window == "outside"
    with pytest.raises(PolicyError, match="stage1_window"):
        CriticalKV(budget=40, stage1_window="both")


def test_criticalkv_value_norm_through_output_projection() -> None:
    # h_q = 2 query heads share one KV head, d = 2, hidden = 2. W_O columns of head 0: identity -> |v1| + |v2|;
    # head 1: diag(2, -1) -> 2|v1| + |v2|. For v = (1, -3): 4 and 5 -> group mean 4.5; v = (0, 0): 0.
    o_proj = torch.nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        o_proj.weight.copy_(torch.tensor([[1.0, 0, 2, 0], [0, 1, 0, -1]]))
    module = SimpleNamespace(o_proj=o_proj)
    values = [[[9.0, 9.0], [1.0, -3.0], [0.0, 0.0]]]  # (h_kv, S, d): slot 0 an older token
    view = make_view(values, values=values)
    view.modules = (module,)
    policy = CriticalKV(budget=40)
    out = policy.token_state(view, torch.tensor([[[[1, 2]]]]))  # (L, b, h_kv, t): the forward wrote slots 1, 2
    assert out["vnorm"].tolist() == [[[[4.5, 0.0]]]]  # the new tokens' slots 1, 2 only
    # a long block (40 new tokens, in slots 0-39): the same norms, each token's own
    values = [[[0.0, 0.0]] * 40]
    values[0][1] = [1.0, -3.0]
    view = make_view(values, values=values)
    view.modules = (module,)
    out = CriticalKV(budget=40).token_state(view, torch.arange(40).view(1, 1, 1, 40))
    assert out["vnorm"].tolist() == [[[[0.0, 4.5] + [0.0] * 38]]]


def test_criticalkv_value_norms_layer_by_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two layers, each its own chunk (`CHUNK_BYTES` 1): the first layer's W_O as above (v = (1, -3): 4.5), the
    second's doubled (9.0); each layer's norms come from its own columns."""
    monkeypatch.setattr(criticalkv_module, "CHUNK_BYTES", 1)
    modules = []
    for scale in (1.0, 2.0):
        o_proj = torch.nn.Linear(4, 2, bias=False)
        with torch.no_grad():
            o_proj.weight.copy_(scale * torch.tensor([[1.0, 0, 2, 0], [0, 1, 0, -1]]))
        modules.append(SimpleNamespace(o_proj=o_proj))
    one = make_view([[[1.0, -3.0]]], values=[[[1.0, -3.0]]])
    two = one.values.expand(2, -1, -1, -1, -1)  # (L = 2, 1, 1, 1, 2)
    view = dataclasses.replace(one, keys=two, values=two, pos=one.pos.expand(2, -1, -1, -1), layers=(0, 1),
                               modules=tuple(modules))
    out = CriticalKV(budget=40).token_state(view, torch.zeros(2, 1, 1, 1, dtype=torch.long))
    assert out["vnorm"].tolist() == [[[[4.5]]], [[[9.0]]]]


def test_criticalkv_on_adakv_follows_adakv_budgets() -> None:
    # With vnorm = 1 everywhere, stage 2 ranks by A + eps as stage 1 does: the selection is AdaKV's (see above).
    view = make_view(ADA_KEYS, ADA_QUERIES)
    view.state["vnorm"] = torch.ones(1, 1, 2, 8)
    for allocation, alpha in (("adakv", 0.5), ("kvpress", 0.75)):
        policy = CriticalKV(budget=4, window=1, kernel=1, base="adakv", alpha_safeguard=alpha, allocation=allocation)
        assert kept(policy, view) == [[0, 1, 2, 3, 7], [5, 6, 7]]
    with pytest.raises(PolicyError):
        CriticalKV(budget=40, base="h2o")


# PyramidKV ---------------------------------------------------------------------------------------------------------
# Budgets by hand. N = 64, window 8 -> F = 56, beta 20, 4 layers: min = 56 / 20 = 2.8, max = 112 - 2.8 = 109.2,
# step (109.2 - 2.8) / 3 = 35.4667: F_l = 109.2, 73.733, 38.267, 2.8 -> 109, 74, 38, 3 (sum 224 = 4 x 56)
# -> N_l = 117, 82, 46, 11, mean 64.
# After 115 tokens (>= 2F = 112): max 109.2 >= 115 - 8 = 107 -> max = 107, min = 112 - 107 = 5, step 34:
# 107, 73, 39, 5 -> 115, 81, 47, 13. After 100 tokens (< 2F): every layer keeps N = 64.
# N = 128, window 8 -> F = 120, 8 layers: min 6, max 234, step 228 / 7 = 32.571: 234, 201.43, 168.86, 136.29,
# 103.71, 71.14, 38.57, 6 -> 234, 201, 169, 136, 104, 71, 39, 6 (sum 960 = 8 x 120) -> +8.
@pytest.mark.parametrize("budget,layers,seen,expected", [
    (64, 4, None, [117, 82, 46, 11]),
    (64, 4, 10_000, [117, 82, 46, 11]),
    (64, 4, 115, [115, 81, 47, 13]),
    (64, 4, 100, [64, 64, 64, 64]),
    (128, 8, None, [242, 209, 177, 144, 112, 79, 47, 14]),
])
def test_pyramidkv_layer_budgets(budget: int, layers: int, seen: int | None, expected: list[int]) -> None:
    policy = PyramidKV(budget=budget)
    assert (policy.beta, policy.window, policy.kernel, policy.pooling) == (20, 8, 7, "max")
    policy.attach(layers, 64)
    got = [policy.layer_budget(i, seen) for i in range(layers)]
    assert got == expected and sum(got) == layers * budget  # the layers keep N per KV head on average


def test_pyramidkv_scores_like_snapkv_within_its_layer_budget() -> None:
    # One head, window 1 (slot 9), kernel 1: A ~ w = 9,1,8,2,7,3,6,4,5 | 1. N = 6 -> F = 5, beta 10, 2 layers:
    # min .5, max 9.5 >= 10 - 1 seen -> capped: max 9, min 1 -> layer 0 keeps N_0 = 10 (all), layer 1 N_1 = 2:
    # the window and the best other token (slot 0).
    policy = PyramidKV(budget=6, window=1, kernel=1, beta=10)
    weights = [9, 1, 8, 2, 7, 3, 6, 4, 5, 1]
    with pytest.raises(PolicyError, match="number of layers"):
        kept(policy, make_view([log_keys(weights)], [[[1.0]]], layer_idx=1))
    policy.attach(2, 64)
    assert [policy.layer_budget(i, 10) for i in (0, 1)] == [10, 2]
    assert kept(policy, make_view([log_keys(weights)], [[[1.0]]], layer_idx=0)) == [list(range(10))]
    assert kept(policy, make_view([log_keys(weights)], [[[1.0]]], layer_idx=1)) == [[0, 9]]
    # uncapped (a long prompt), min .5 rounds to 0: the deepest layer keeps only its window
    assert policy.layer_budget(1) == 1
    with pytest.raises(PolicyError, match="beta"):
        PyramidKV(budget=64, beta=0.5)


def test_pyramidkv_run_keeps_n_per_layer_on_average() -> None:
    # 4 layers, N = 40, window 8, B = 16: F = 32, min 1.6, max 62.4, step 20.267 -> 62, 42, 22, 2 (+8).
    model = _model("tiny-llama", num_hidden_layers=4)
    policy = PyramidKV(budget=40)
    res = generate(model, policy, _prompt(200, seed=3), GenerationSettings(block=16, max_new_tokens=3),
                   observer=Observer(trace=True))
    assert policy.num_layers == 4  # told by the cache
    assert held_counts(res.trace[-1]) == [70, 50, 30, 10]
    # all layers together: at most 4 x (N + B) tokens per KV head; 2 KV heads x 64 dims x (K + V) x 4 bytes each
    assert res.kv_bytes_peak <= 4 * (40 + 16) * 2 * 64 * 2 * 4
    assert res.peak_kv_tokens == 70 + 16  # the first layer


# HashEvict ---------------------------------------------------------------------------------------------------------
# bits 2, projection R = I: h(x) = ([x1 > 0], [x2 > 0]). Sink 1 (slot 0), recent 1 (slot 4).
# keys: slot 1 (1, 1) -> 11, slot 2 (-1, 1) -> 01, slot 3 (1, -1) -> 10.
HASH_KEYS = [[[-1.0, -1.0], [1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]]]


def hash_view(policy: HashEvict, queries: list | None) -> SlotView:
    policy.projections[0, 2] = torch.eye(2)
    # every token (and query) is the last forward's: the probe's; each key's code hashed as the engine does
    return settle(policy, make_view(HASH_KEYS, queries))


@pytest.mark.parametrize("queries,probe,budget,expected", [
    # one query (1, 1) -> code 11: Hamming 0, 1, 1 for slots 1, 2, 3 -> keep slot 1
    ([[[1.0, 1.0]]], "query", 3, [0, 1, 4]),
    # block of queries (1, 1), (1, -1): bit means p = (1, .5); mean Hamming = sum_j k_j (1 - 2 p_j) + p_j:
    # slot 1: .5, slot 2: 1.5, slot 3: .5 -> keep 1 and 3
    ([[[1.0, 1.0], [1.0, -1.0]]], "query", 4, [0, 1, 3, 4]),
    # probe = key: the block's key codes 00 11 01 10 00 -> p = (.4, .4); slot 1: 1.2, slot 2: 1.0, slot 3: 1.0
    (None, "key", 4, [0, 2, 3, 4]),
])
def test_hashevict_hamming_to_probe(queries, probe: str, budget: int, expected: list[int]) -> None:
    policy = HashEvict(budget=budget, bits=2, probe=probe, n_sink=1, n_recent=1)
    assert kept(policy, hash_view(policy, queries)) == [expected]


def test_hashevict_scores_are_minus_the_mean_hamming_distance() -> None:
    """Queries (1, 1), (1, -1): p = (1, .5). Codes 00 (slots 0, 4): 1 + .5 = 1.5; 11 (slot 1): 0 + .5; 01 (slot 2,
    bits (0, 1)): 1 + .5; 10 (slot 3): 0 + .5. Score = -distance. A query from before the last forward (position 2
    here, the last forward being positions 3, 4) is no part of the probe."""
    policy = HashEvict(budget=4, bits=2, n_sink=1, n_recent=1)
    view = hash_view(policy, [[[1.0, 1.0], [1.0, -1.0]]])
    assert policy.score(view)[0, 0, 0].tolist() == [-1.5, -0.5, -1.5, -0.5, -1.5]
    view = hash_view(policy, [[[-1.0, -1.0], [1.0, 1.0], [1.0, -1.0]]])
    view.fed = torch.tensor([2])
    assert policy.score(view)[0, 0, 0].tolist() == [-1.5, -0.5, -1.5, -0.5, -1.5]


def test_hashevict_projection_is_seeded() -> None:
    a, b = HashEvict(budget=40, seed=3), HashEvict(budget=40, seed=3)
    assert torch.equal(a.projection(1, 16, torch.device("cpu")), b.projection(1, 16, torch.device("cpu")))
    assert not torch.equal(a.projection(0, 16, torch.device("cpu")), a.projection(1, 16, torch.device("cpu")))
    assert not torch.equal(HashEvict(budget=40, seed=4).projection(1, 16, torch.device("cpu")),
                           a.projection(1, 16, torch.device("cpu")))


def test_hashevict_hashes_each_layer_of_a_view_by_its_own_projection() -> None:
    """A view's L rows are several layers': by hand, layer 0's R reads x0's sign and layer 1's x1's (8 bits, d = 2).
    The key (1, -1) hashes to all ones in layer 0 and all zeros in layer 1; the probe is the mean over the group's
    two queries (1, -1), (1, 1): all ones in layer 0 (p = 1: distance 0), bits of mean .5 in layer 1 (distance
    8 x .5 = 4)."""
    p = HashEvict(budget=40)
    p.projections[0, 2] = torch.tensor([[1.0, 0.0]] * 8)
    p.projections[1, 2] = torch.tensor([[0.0, 1.0]] * 8)
    keys = torch.tensor([1.0, -1.0]).expand(2, 1, 1, 1, 2)  # (L, b, h_kv, S, d): the same key in both layers
    queries = torch.tensor([[1.0, -1.0], [1.0, 1.0]]).view(1, 1, 2, 1, 2).expand(2, 1, 2, 1, 2)  # 2 query heads
    one = torch.tensor([1])
    view = SlotView(keys=keys, values=keys, pos=torch.zeros(2, 1, 1, 1, dtype=torch.long), seen=one, fed=one,
                    layers=(0, 1), scaling=1.0, queries=queries, qpos=torch.tensor([[0]]))
    assert p.score(settle(p, view)).flatten().tolist() == [0.0, -4.0]


# SAGE-KV -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group,expected", [(4, (2048, 1024, 2047)), (7, (2048, 512, 2559)), (1, (2048, 4096, 2047))])
def test_sagekv_sizes_from_budget(group: int, expected: tuple[int, int, int]) -> None:
    # SAGE-KV App. A.2 (N = 8192): g = 4 -> sink 2048, k 1024, local window 2048 (= recent 2047 + the last token);
    # g = 7 -> sink 2048, k 512, local window 2560.
    assert SageKV(budget=8192).sizes(group) == expected


def test_sagekv_bad_sizes_fail_at_config_time() -> None:
    with pytest.raises(PolicyError):
        SageKV(budget=16, sink=8, recent=8)


def test_sagekv_selection_then_sliding_window() -> None:
    # N = 12, g = 2: sink 3, k = 12 // 4 = 3, recent 12 - 3 - 6 - 1 = 2 (+ the last token).
    # 16 tokens: sinks 0-2, recent + last 13-15; candidates 3..12. Query head 0 = (1, 0) ranks by x, head 1 =
    # (0, 1) by y. x: slot 5: 5, 7: 4, 9: 3 -> {5, 7, 9}; y: 7: 5, 11: 4, 4: 3 -> {4, 7, 11}; union {4, 5, 7, 9, 11}.
    # Big x at sink slot 1 and big y at recent slot 14 do not use up k.
    keys = [[0.0, 0.0] for _ in range(16)]
    for slot, x in ((5, 5.0), (7, 4.0), (9, 3.0), (1, 9.0)):
        keys[slot][0] = x
    for slot, y in ((7, 5.0), (11, 4.0), (4, 3.0), (14, 9.0)):
        keys[slot][1] = y
    view = make_view([keys], [[[1.0, 0.0]], [[0.0, 1.0]]])
    view.state["pinned"] = torch.zeros(1, 1, 1, 16)
    policy = SageKV(budget=12)
    chosen = [0, 1, 2, 4, 5, 7, 9, 11]
    assert kept(policy, view) == [chosen + [13, 14, 15]]  # 16 tokens over a budget of 12: the selection
    assert view.state["pinned"][0, 0, 0].nonzero().flatten().tolist() == chosen  # sinks | union
    view.pos[~torch.isin(view.pos, torch.tensor(chosen + [13, 14, 15]))] = -1  # the eviction frees the others
    assert kept(policy, view) == [chosen + [13, 14, 15]]  # 11 tokens, still in the prompt: nothing to do
    # decoding: a new token (position 16) goes into the first free slot (3, freed above, its state 0); it joins the
    # recent window, whose oldest token (13) leaves; the selection stays
    view.decoding = True
    view.pos[0, 0, 0, 3], view.keys[0, 0, 0, 3] = 16, torch.zeros(2)
    view.state["pinned"][0, 0, 0, 3] = 0.0
    view.seen, view.fed, view.qpos = torch.tensor([17]), torch.tensor([1]), torch.tensor([[16]])
    assert kept(policy, view) == [chosen + [14, 15, 16]]  # 12 tokens (within the budget) of 17 seen: a slide


def test_protected_tokens_by_position_in_any_slot_order() -> None:
    # The sinks (positions < 1) and the recent window (the 3 latest of 10 seen: positions 7-9) are found by position,
    # whichever slots they sit in, never a free slot (-1): head 0 in position order, head 1 out of order with holes.
    view = make_view([[[0.0]] * 8] * 2, positions=[[0, 1, 2, 3, 4, 7, 8, 9], [8, -1, 6, 9, 7, 0, -1, 3]])
    assert view.protected(1, 3)[0, 0].int().tolist() == [[1, 0, 0, 0, 0, 1, 1, 1], [1, 0, 0, 1, 1, 1, 0, 0]]
    assert view.protected(0, 0)[0, 0].sum() == 0


# Per-head caches against an explicit float64 model ---------------------------------------------------------------
def _model(arch: str = "tiny-llama", **kw):
    return installed_model(arch, **kw)[0]


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(8, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("policy_factory", [
    lambda: AdaKV(budget=24, window=4, kernel=3),
    lambda: SageKV(budget=24),
], ids=["adakv", "sagekv"])
def test_ragged_heads_match_float64_reference(policy_factory) -> None:
    model = _model()
    model.double()
    ids = _prompt(70)
    logged: list[torch.Tensor] = []
    res = generate(model, policy_factory(), ids, GenerationSettings(block=16, max_new_tokens=6),
                   observer=Observer(trace=True, on_logits=lambda lg: logged.append(lg[0])))
    chunks = [ids[s:s + 16] for s in range(0, len(ids), 16)] + [[t] for t in res.tokens[:-1]]
    ref = reference_logits(model, chunks, res.trace)
    first = len(chunks) - len(res.tokens)
    for got, want in zip(logged, ref[first:], strict=True):
        assert (got.double() - want).abs().max().item() < 1e-5
    # the run was really per head: some layer's heads held different numbers of tokens
    assert any(len(set((t >= 0).sum(dim=-1)[0].tolist())) > 1 for step in res.trace for t in step)


# Determinism and bounds --------------------------------------------------------------------------------------------
NEW_POLICIES = {
    "adakv": lambda: AdaKV(budget=40, window=8),
    "criticalkv": lambda: CriticalKV(budget=40, window=8),
    "criticalkv-adakv": lambda: CriticalKV(budget=40, window=8, base="adakv"),
    "hashevict": lambda: HashEvict(budget=40),
    "sagekv": lambda: SageKV(budget=40),
}


@pytest.mark.parametrize("name", list(NEW_POLICIES))
def test_deterministic_and_bounded(name: str) -> None:
    model = _model()
    ids = _prompt(120, seed=1)
    settings = GenerationSettings(block=16, max_new_tokens=4)
    runs = [generate(model, NEW_POLICIES[name](), ids, settings, observer=Observer(trace=True)) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens
    assert all(torch.equal(a, b) for a, b in zip(runs[0].trace[-1], runs[1].trace[-1], strict=True))
    h_kv = model.config.num_key_value_heads
    per_head = name in ("adakv", "criticalkv-adakv")
    # a head keeps at most N (AdaKV: ceil(head_cap N) = 80, its layer at most h_kv N), then a block joins
    head_bound = 80 if per_head else 40
    for step in runs[0].trace[1:]:  # before every forward after the first: evicted back to the budget
        for pos in step:
            held = (pos >= 0).sum(dim=-1)  # (1, h_kv) real tokens per head
            assert int(held.max()) <= head_bound and int(held.sum()) <= 40 * h_kv
    # peak_kv_tokens: the fullest head during a forward, its block included
    assert runs[0].peak_kv_tokens == max(max(held_counts(step)) + width
                                         for step, width in zip(runs[0].trace, [16] * 7 + [8] + [1] * 3, strict=True))
    assert runs[0].peak_kv_tokens <= head_bound + 16


# Per-head layers hold at most the layer total --------------------------------------------------------------------
@pytest.mark.parametrize("allocation", ["adakv", "kvpress"])
@pytest.mark.parametrize("arch,h_kv,d", [("tiny-llama", 2, 64), ("tiny-llama3", 8, 128)])
def test_adakv_layer_total_and_peaks(arch: str, h_kv: int, d: int, allocation: str) -> None:
    N, B = 96, 32
    model = _model(arch)
    res = generate(model, AdaKV(budget=N, allocation=allocation), _prompt(224),
                   GenerationSettings(block=B, max_new_tokens=3), observer=Observer(trace=True))
    assert any(len(set((t >= 0).sum(dim=-1)[0].tolist())) > 1 for step in res.trace for t in step)  # per head
    for k, step in enumerate(res.trace):
        for pos in step:
            total = int((pos >= 0).sum())
            held = (pos >= 0).sum(dim=-1)
            assert int(held.max()) <= 2 * N  # head_cap 2: ceil(2 N) slots a head may keep
            if k >= 4:  # evicted after the 4th block (128 > N per head) and after every later forward
                # the layer total is cut back to h_kv * N; kvpress hands out exactly h_kv * N
                assert total == h_kv * N if allocation == "kvpress" else total <= h_kv * N
    # Changed with the static engine: peak_kv_tokens is the fullest head (no longer the layer total / h_kv): the
    # most a head held in a forward, its block included (7 blocks of 32, then 2 decoding steps of 1)
    widths = [B] * 7 + [1] * 2
    assert res.peak_kv_tokens == max(max(held_counts(step)) + w for step, w in zip(res.trace, widths, strict=True))
    assert res.peak_kv_tokens >= N + B  # the 4th block, before the first eviction
    # kv_bytes_peak, all heads together: the 4th block (every head N + B), never more after (a layer at most h_kv N
    # + h_kv B): 2 layers x h_kv heads x (N + B) tokens x head_dim x (K + V) x 4 bytes (fp32)
    assert res.kv_bytes_peak == 2 * h_kv * (N + B) * d * 2 * 4


# Diagnostics -------------------------------------------------------------------------------------------------------
def test_diagnostics_by_hand() -> None:
    # One head, keys ln(w) with w = 1, 2, 3, 4 and query 1: A = .1, .2, .3, .4. Keep slots 1, 3.
    # attention loss = .1 + .3 = .4.
    # values (1,0), (0,1), (2,0), (0,2); W_O = I (one head, d = hidden = 2):
    # full output = (.1 + .6, .2 + .8) = (.7, 1.0); kept: A' = (1/3, 2/3) on slots 1, 3 -> (0, 1/3 + 4/3)
    # perturbation = |.7 - 0| + |1.0 - 5/3| = .7 + .6667 = 1.3667.
    # kept keys ln2, ln4 (d = 1 < 2 tokens): pseudo-determinant = K^T K = ln2^2 + ln4^2 = 5 ln2^2.
    view = make_view([log_keys([1, 2, 3, 4])], [[[1.0]]], values=[[[1, 0], [0, 1], [2, 0], [0, 2]]])
    o_proj = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        o_proj.weight.copy_(torch.eye(2))
    view.modules = (SimpleNamespace(o_proj=o_proj),)
    diag = Diagnostics(["attention_loss", "perturbation", "key_logdet"])
    diag.observe(view, torch.tensor([False, True, False, True]).view(1, 1, 1, 4), 0)
    got = diag.summary()
    assert got["attention_loss"]["mean"] == pytest.approx(0.4, abs=1e-6)
    assert got["perturbation"]["mean"] == pytest.approx(0.7 + 2 / 3, abs=1e-5)
    assert got["key_logdet"]["mean"] == pytest.approx(math.log(5 * math.log(2) ** 2), abs=1e-4)
    assert got["attention_loss"]["per_layer"] == {"0": pytest.approx(0.4, abs=1e-6)}
    assert got["attention_loss"]["events"] == 1


def test_head_share_is_the_fullest_heads_tokens_over_the_budget() -> None:
    """Two KV heads, N = 3 (the engine's budgets): the eviction keeps 4 tokens of head 0 and 2 of head 1 (a per-head
    allocation) -> 4 / 3; a second event keeps 3 and 3 -> 1; mean 7 / 6, max 4 / 3. A layer that drops nothing is
    no event."""
    keys = [[[1.0]] * 6, [[1.0]] * 6]
    view = make_view(keys)
    view.budgets = torch.tensor([[[3]]])
    diag = Diagnostics(["head_share"])
    diag.observe(view, torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool).view(1, 1, 2, 6), 0)
    diag.observe(view, torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1]], dtype=torch.bool).view(1, 1, 2, 6), 0)
    diag.observe(view, torch.ones(1, 1, 2, 6, dtype=torch.bool), 0)
    got = diag.summary()["head_share"]
    assert got["mean"] == pytest.approx(7 / 6) and got["max"] == pytest.approx(4 / 3) and got["events"] == 2
    assert aggregate([{"diagnostics": {"head_share": got}}])["head_share"]["max"] == pytest.approx(4 / 3)


def test_key_logdet_of_fewer_keys_than_dims() -> None:
    # K = [[1, 0], [0, 2]]: K K^T = diag(1, 4) -> log 4 (ridge 1e-6 * 5 / 2 is negligible)
    keys = torch.tensor([[[[1.0, 0.0], [0.0, 2.0], [5.0, 5.0]]]])
    assert key_logdet(keys, torch.tensor([[[True, True, False]]])) == pytest.approx(math.log(4), abs=1e-4)


def test_diagnostics_in_a_run_do_not_change_tokens() -> None:
    model = _model()
    ids = _prompt(150, seed=2)
    plain = generate(model, KeyDiff(budget=40), ids, GenerationSettings(block=16, max_new_tokens=5))
    diag = generate(model, KeyDiff(budget=40), ids,
                    GenerationSettings(block=16, max_new_tokens=5,
                                       diagnostics=tuple(["attention_loss", "perturbation", "key_logdet"])))
    assert plain.tokens == diag.tokens and plain.diagnostics is None
    # key-only KeyDiff: the engine kept the latest query anyway (asked for by the diagnostics)
    # evictions: 150 tokens in blocks of 16 -> blocks 3..10 overflow 40 (8 events) + 4 decoding steps, per layer
    for name in ("attention_loss", "perturbation", "key_logdet"):
        d = diag.diagnostics[name]
        assert d["events"] == 2 * (8 + 4) and set(d["per_layer"]) == {"0", "1"}
    assert 0.0 < diag.diagnostics["attention_loss"]["mean"] < 1.0


def test_aggregate_over_samples() -> None:
    recs = [{"diagnostics": {"attention_loss": {"mean": 0.2, "per_layer": {"0": 0.1, "1": 0.3}, "events": 4}}},
            {"diagnostics": {"attention_loss": {"mean": 0.4, "per_layer": {"0": 0.5, "1": 0.3}, "events": 2}}},
            {}]
    got = aggregate(recs)["attention_loss"]
    assert got["mean"] == pytest.approx(0.3) and got["per_layer"] == {"0": pytest.approx(0.3), "1": pytest.approx(0.3)}
    assert got["samples"] == 2 and got["events"] == 6


def test_run_reports_diagnostics_in_records_and_metrics(tmp_path) -> None:
    import json

    from kvbench.run.app import Session, run_one

    model, tok = build_tiny_model("tiny-llama", seed=3)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    rows = [{"id": f"q{i}", "prompt": " ".join(["river north valley"] * (20 + 10 * i)), "answers": ["x"],
             "max_new_tokens": 3} for i in range(2)]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = run_config("model=hf", "model.dtype=float32", "model.max_prompt_tokens=4000", "model.chat_template=false",
                     "policy=adakv", "policy.window=8", "task=jsonl", "budget=32", "block=16", "device=cpu",
                     "diagnostics=[attention_loss,key_logdet]", "progress=false",
                     values={"model.path": str(tmp_path / "model"), "task.path": str(tmp_path / "qa.jsonl")})
    metrics = run_one(cfg, "adakv", tmp_path / "run", Session())
    recs = [json.loads(line) for line in (tmp_path / "run" / "predictions.jsonl").read_text().splitlines()]
    means = [r["diagnostics"]["attention_loss"]["mean"] for r in recs]
    assert set(recs[0]["diagnostics"]) == {"attention_loss", "key_logdet"}
    assert metrics["diagnostics"]["attention_loss"]["mean"] == pytest.approx(sum(means) / 2)
    assert metrics["diagnostics"]["attention_loss"]["samples"] == 2
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["diagnostics"] == metrics["diagnostics"]
