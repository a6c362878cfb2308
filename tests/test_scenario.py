"""Compression scenarios (CriticalKV 4.2, App. H): question_aware puts the whole prompt under the budget;
context_only evicts only inside the context, then appends the question and decodes with no eviction at all."""

from __future__ import annotations

import pytest
import torch

from kvbench.engine.generate import GenerationSettings, Observer, generate
from kvbench.policies.adakv import AdaKV
from kvbench.policies.h2o import H2O
from kvbench.policies.keydiff import KeyDiff

from helpers import held_counts

N, B, CONTEXT, QUESTION, NEW = 40, 16, 150, 20, 6


def _ids() -> list[int]:
    return torch.randint(8, 500, (CONTEXT + QUESTION,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.mark.parametrize("factory", [lambda: KeyDiff(budget=N), lambda: H2O(budget=N),
                                     lambda: AdaKV(budget=N, window=8, allocation="kvpress")],
                         ids=["keydiff", "h2o", "adakv"])
def test_context_only_never_evicts_question_or_generated_tokens(model, factory) -> None:
    policy = factory()
    res = generate(model, policy, _ids(),
                   GenerationSettings(block=B, max_new_tokens=NEW, context_tokens=CONTEXT, scenario="context_only"),
                   observer=Observer(trace=True))
    assert len(res.tokens) == NEW
    h_kv = model.config.num_key_value_heads
    # forwards: 10 context blocks (9 x 16 + 6), 2 question blocks (16 + 4), 5 decoding steps (the 6th token is
    # never fed back)
    assert len(res.trace) == 10 + 2 + NEW - 1
    fed = CONTEXT
    for s, step in enumerate(res.trace):
        if s < 10:
            continue  # still inside the context
        for pos in step:  # every layer, every head: the context cut to N, then everything fed since, in order
            for h in range(h_kv):
                real = [p for p in pos[0, h].tolist() if p >= 0]
                assert [p for p in real if p >= CONTEXT] == list(range(CONTEXT, fed))
            context_held = int(((pos >= 0) & (pos < CONTEXT)).sum())
            assert context_held == N * h_kv  # per head N (AdaKV: N * h_kv over the layer's heads)
        fed += QUESTION - B if s == 11 else (B if s == 10 else 1)
    # peak (the fullest KV head's tokens, over layers and time): its cut context + the whole question + the fed-back
    # generated tokens, with nothing evicted after the context. KeyDiff and H2O keep N per head; AdaKV allocates the
    # layer's N * h_kv over its heads, so its fullest head holds more than N of the context. (The engine before the
    # static cache reported AdaKV's per-head average, N + 25; peak_kv_tokens is now the fullest head's, as for every
    # policy.)
    context = max(int(((pos[0, h] >= 0) & (pos[0, h] < CONTEXT)).sum()) for pos in res.trace[10] for h in range(h_kv))
    assert context > N if isinstance(policy, AdaKV) else context == N
    assert res.peak_kv_tokens == context + QUESTION + NEW - 1


def test_question_aware_keeps_the_budget_throughout(model) -> None:
    res = generate(model, KeyDiff(budget=N), _ids(),
                   GenerationSettings(block=B, max_new_tokens=NEW, context_tokens=CONTEXT, scenario="question_aware"),
                   observer=Observer(trace=True))
    assert res.peak_kv_tokens == N + B
    assert all(n == N for n in held_counts(res.trace[-1]))  # evicted back to N after every step
    # the scenario changes what is kept: question_aware evicts question tokens too
    held = res.trace[11][0][0, 0].tolist()  # layer 0's slots (-1 free) after the prompt (11 blocks), before the first decoding step
    assert not set(range(CONTEXT, CONTEXT + QUESTION)) <= set(held)


def test_context_only_without_context_split_is_question_aware(model) -> None:
    # no context boundary known (context_tokens None): the whole prompt is under eviction
    a = generate(model, KeyDiff(budget=N), _ids(),
                 GenerationSettings(block=B, max_new_tokens=NEW, scenario="context_only"))
    b = generate(model, KeyDiff(budget=N), _ids(),
                 GenerationSettings(block=B, max_new_tokens=NEW, scenario="question_aware"))
    assert a.tokens == b.tokens and a.peak_kv_tokens == b.peak_kv_tokens == N + B
