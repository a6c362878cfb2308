"""Slot ranks by position kept from step to step through slot reuse (kvbench/policies/ranks.py): by hand on one layer,
and the same kept tokens as counting them afresh at every eviction for the policies that read them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvbench.policies.ranks as ranks_module
from kvbench.engine.cache import EvictingLayer
from kvbench.engine.generate import GenerationSettings, Observer, generate
from kvbench.policies.base import position_ranks
from kvbench.policies.random import Random
from kvbench.policies.ranks import PositionRanks, slot_order, slot_ranks
from kvbench.policies.snapkv import SnapKV

from helpers import float64_model, held_positions, random_prompt


def _decoding_layer(n: int) -> EvictingLayer:
    """A decoding layer (b = 1, h_kv = 1, d = 2) holding positions 0..n-1 in slots 0..n-1, with slot reuse on."""
    layer = EvictingLayer(0)
    layer.update(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2))
    layer.reuse_slots, layer.decoding = True, True
    return layer


def _step(layer: EvictingLayer, drop: int) -> None:
    """Drop slot `drop` (every other slot kept: a hole, slot reuse), then append the next token (into the hole)."""
    n = layer.keys.shape[-2]
    layer.keep(torch.tensor([[[i for i in range(n) if i != drop]]]))
    layer.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per count of the ranks afresh (position_ranks) from now on."""
    calls: list[int] = []

    def counted(positions: torch.Tensor, seen: int | None) -> torch.Tensor:
        calls.append(seen)
        return position_ranks(positions, seen)

    monkeypatch.setattr(ranks_module, "position_ranks", counted)
    return calls


def test_a_step_of_slot_reuse_updates_the_ranks_without_counting(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_calls(monkeypatch)
    layer = _decoding_layer(5)
    assert slot_ranks(layer).tolist() == [[[0, 1, 2, 3, 4]]] and calls == [5]
    # slot 1 (rank 1) freed, position 5 written there: positions 0 5 2 3 4 rank 0 4 1 2 3
    _step(layer, 1)
    assert layer.positions.tolist() == [[[0, 5, 2, 3, 4]]]
    assert slot_ranks(layer).tolist() == [[[0, 4, 1, 2, 3]]]
    # slot 2 (rank 1) freed, position 6 there: positions 0 5 6 3 4 rank 0 3 4 1 2; its order: slots 0 3 4 1 2
    _step(layer, 2)
    assert slot_ranks(layer).tolist() == [[[0, 3, 4, 1, 2]]]
    assert slot_order(layer).tolist() == [[[0, 3, 4, 1, 2]]]
    # slot 0 (rank 0, the sink) freed, position 7 there: 7 5 6 3 4 rank 4 2 3 0 1
    _step(layer, 0)
    assert slot_ranks(layer).tolist() == [[[4, 2, 3, 0, 1]]]
    assert calls == [5]  # counted once, at the start


def test_ranks_are_counted_again_after_any_other_change(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_calls(monkeypatch)
    layer = _decoding_layer(5)
    slot_ranks(layer)
    _step(layer, 1)  # positions 0 5 2 3 4
    _step(layer, 3)  # positions 0 5 2 6 4: kept through steps whose evictions did not read them
    assert slot_ranks(layer).tolist() == [[[0, 3, 1, 4, 2]]] and calls == [5]
    # a selection of two tokens fewer: gathered in position order (chronological again), the ranks counted again
    layer.keep(torch.tensor([[[0, 2, 3]]]))  # positions 0 2 6
    assert layer.positions.tolist() == [[[0, 2, 6]]]
    assert slot_ranks(layer).tolist() == [[[0, 1, 2]]] and calls == [5, 7]
    # a block of two tokens appended (new arrays): counted again
    layer.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    assert slot_ranks(layer).tolist() == [[[0, 1, 2, 3, 4]]] and calls == [5, 7, 9]
    # a count that moved on without the hook (here by hand: two tokens later): counted again
    ranks = layer.extras[PositionRanks.key]
    ranks.seen -= 2
    assert slot_ranks(layer).tolist() == [[[0, 1, 2, 3, 4]]] and calls == [5, 7, 9, 9]
    # a fork starts with none (its own copies of the slots)
    fork = layer.fork()
    assert isinstance(fork.extras[PositionRanks.key], PositionRanks) and fork.extras[PositionRanks.key].ranks is None


@pytest.mark.parametrize("make", [lambda: Random(budget=24), lambda: SnapKV(budget=24, window=6, kernel=5)],
                         ids=["random", "snapkv"])
def test_kept_ranks_keep_what_counting_each_time_keeps(make, monkeypatch: pytest.MonkeyPatch) -> None:
    """float64, 4 layers, a 90-token prompt, 20 new tokens and a graded branch, slot reuse (the layers stacked): the
    same tokens held before every forward, the same tokens and logits as with the ranks counted at every eviction;
    and they were counted only where a stack starts, not every step."""
    model, ids = float64_model(4), random_prompt(90, 1)
    settings = GenerationSettings(block=16, max_new_tokens=20)
    runs = []
    for kept in (True, False):
        calls = _count_calls(monkeypatch)
        if not kept:
            monkeypatch.setattr(PositionRanks, "_current", lambda self, layer: False)
        logits: list[torch.Tensor] = []
        res = generate(model, make(), ids, settings, answer_ids=[11, 12, 13, 14, 15],
                       observer=Observer(trace=True, on_logits=lambda lg: logits.append(lg[0])))
        runs.append((res, logits, len(calls)))
    (on, l_on, n_on), (off, l_off, n_off) = runs
    assert on.tokens == off.tokens and len(on.tokens) == 20
    assert held_positions(on.trace) == held_positions(off.trace)
    assert all(torch.equal(a, b) for a, b in zip(l_on, l_off, strict=True))
    assert on.answer_logprob == off.answer_logprob
    # counted afresh at every decoding eviction (the answer's 19, the graded branch's 4: one stack each), against
    # once where a stack starts (the answer's, the branch's)
    assert n_off == 19 + 4 and n_on == 2


def test_a_padded_views_order_is_computed_afresh() -> None:
    """A ragged layer's padded view (valid set) keeps no ranks: by hand, positions 5 2 9 0 and a padding slot (-1,
    the earliest, as a sort puts it) give the order 4 3 1 0 2, with nothing left in the extras."""
    view = SimpleNamespace(positions=torch.tensor([[[5, 2, 9, 0, -1]]]),
                           valid=torch.tensor([[[True, True, True, True, False]]]), seen=10, row_seen=None, extras={})
    assert slot_order(view).tolist() == [[[4, 3, 1, 0, 2]]]
    assert slot_ranks(view).tolist() == [[[3, 2, 4, 1, 0]]] and view.extras == {}
