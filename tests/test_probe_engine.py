"""Engine checks on the hand-wired probe model: retrieval succeeds exactly when the needle's KV entries survive."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvbench.engine.cache import install
from kvbench.engine.generate import GenerationSettings, generate
from kvbench.models.loading import load_model
from kvbench.policies.base import Policy
from kvbench.policies.streamingllm import StreamingLLM
from kvbench.tasks.base import TaskEnv
from kvbench.tasks.probe import ProbeTask


class DropPositions(Policy):
    """Test policy: removes the given absolute positions from the given layers as soon as they are cached (at the
    eviction after their forward): they score -inf, and each head keeps every other token it holds."""

    name = "drop"

    def __init__(self, drop: dict[int, set[int]]) -> None:
        super().__init__(budget=10**9)
        self.drop = drop

    def score(self, view):
        gone = torch.zeros_like(view.pos >= 0)
        for row, layer in enumerate(view.layers):
            for p in self.drop.get(layer, ()):
                gone[row] |= view.pos[row] == p
        return torch.zeros(gone.shape).masked_fill(gone, -math.inf)

    def counts(self, view, ranked, counts):
        return (ranked > -math.inf).sum(dim=-1)  # (L, b, h_kv): every held token not dropped


@pytest.fixture(scope="module")
def probe():
    loaded = load_model("probe", "probe:A", dtype="float32", max_prompt_tokens=65536, chat_template=False,
                        device="cpu")
    install(loaded.model)
    return loaded


def _samples(probe, length: int, depths: list[int]):
    env = TaskEnv(tokenizer=probe.tokenizer, model_name="probe", max_prompt_tokens=65536, chat_template=False)
    return list(ProbeTask(context_lengths=[length], depths=depths, samples_per_cell=1).samples(env))


def _answer(probe, sample, policy, block: int | None = 128) -> bool:
    res = generate(probe.model, policy, sample.input_ids, GenerationSettings(block=block, max_new_tokens=1))
    return probe.tokenizer.decode(res.tokens, skip_special_tokens=True).strip() == sample.answers[0]


def test_needle_value_entry_is_necessary(probe) -> None:
    for s in _samples(probe, 1024, [0, 50, 100]):
        value = s.meta["needle_value_pos"]
        same_block_as_query = value // 128 == (len(s.input_ids) - 1) // 128
        assert _answer(probe, s, DropPositions({}))  # nothing dropped: retrieved
        # The value's last-layer entry gone: fails, unless it shares the query's block (a block is evicted only
        # after its forward, so its own tokens are always seen: depth 100 here).
        assert _answer(probe, s, DropPositions({1: {value}})) == same_block_as_query
        assert _answer(probe, s, DropPositions({0: {value}}))  # its first-layer entry is not needed
        assert s.meta["depth"] != 100 or same_block_as_query


def test_random_non_needle_evictions_are_harmless_with_unequal_layer_lengths(probe) -> None:
    rng = random.Random(0)
    for s in _samples(probe, 1024, [10, 60, 90]):
        needle = {s.meta["needle_key_pos"], s.meta["needle_value_pos"]}
        others = [p for p in range(len(s.input_ids) - 1) if p not in needle]
        # Different positions and counts per layer: the layers hold different numbers of tokens.
        drop = {0: set(rng.sample(others, 300)), 1: set(rng.sample(others, 100))}
        assert _answer(probe, s, DropPositions(drop), block=64)


def test_streamingllm_retrieves_only_inside_sinks_or_recent_window(probe) -> None:
    length, budget, block = 4096, 410, 128  # budget = 10 % of 4k
    depths = [0, 25, 50, 75, 100]
    got = {s.meta["depth"]: _answer(probe, s, StreamingLLM(budget=budget), block) for s in _samples(probe, 4096,
                                                                                                   depths)}
    for s in _samples(probe, length, depths):
        value = s.meta["needle_value_pos"]
        # Before the last block, the cache holds positions < 4 and the latest budget-4 positions of what came
        # before that block; the last block itself is fully visible to its last token.
        last_block_start = ((len(s.input_ids) - 1) // block) * block
        kept = value < 4 or value >= last_block_start - (budget - 4)
        assert got[s.meta["depth"]] == kept, (s.meta["depth"], value)
    assert got[0] and got[100] and not got[50]
