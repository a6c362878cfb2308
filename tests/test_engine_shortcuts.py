"""Shortcuts the engine takes where a policy declares it may, each against the long way on the same run: the same
tokens held at every forward, the same tokens and logits bit for bit. Float64 tiny-llama (tests/helpers.py)."""

from __future__ import annotations

import torch

from kvbench.engine.cache import EvictingLayer
from kvbench.engine.generate import GenerationSettings, Observer, generate
from kvbench.engine.stash import QueryStash
from kvbench.policies.h2o import H2O
from kvbench.policies.sagekv import SageKV
from kvbench.policies.streamingllm import StreamingLLM

from helpers import float64_model, held_positions, random_prompt


def _run(policy, layers: int = 2, new: int = 12, forwards: list | None = None, prompt: int = 90):
    logits: list[torch.Tensor] = []
    model = float64_model(layers)
    if forwards is not None:
        model.register_forward_hook(lambda *_: forwards.append(1))
    res = generate(model, policy, random_prompt(prompt, 0),
                   GenerationSettings(block=16, max_new_tokens=new, slot_reuse=True), answer_ids=[11, 12, 13],
                   observer=Observer(trace=True, on_logits=lambda lg: logits.append(lg[0].clone())))
    return res, logits


def _same(a, b) -> None:
    (ra, la), (rb, lb) = a, b
    assert ra.tokens == rb.tokens and len(ra.tokens) == 12
    assert held_positions(ra.trace) == held_positions(rb.trace)
    assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))
    assert ra.answer_logprob == rb.answer_logprob


def test_a_stash_of_the_latest_queries_keeps_the_forward_s_own() -> None:
    """By hand: window 1 keeps each forward's last query and its position; window 2 after a block of 3 keeps its
    last 2; `first` is the earliest kept position while no forward went unstashed, None after a gap, for good."""
    q = torch.arange(5.0).view(1, 1, 5, 1)  # query i holds the value i
    stash = QueryStash()
    stash.add(q[:, :, :3], 3, 1)  # positions 0..2
    assert stash.queries.flatten().tolist() == [2.0] and stash.positions.tolist() == [2] and stash.first == 2
    stash.add(q[:, :, 3:4], 4, 1)
    assert stash.queries.flatten().tolist() == [3.0] and stash.positions.tolist() == [3] and stash.first == 3
    stash.add(q[:, :, 4:5], 6, 1)  # position 5: the forward at position 4 stashed nothing
    assert stash.queries.flatten().tolist() == [4.0] and stash.positions.tolist() == [5] and stash.first is None
    stash.add(q[:, :, 0:1], 7, 1)
    assert stash.positions.tolist() == [6] and stash.first is None and stash.end == 7
    two = QueryStash()
    two.add(q[:, :, :1], 1, 2)
    two.add(q[:, :, 1:4], 4, 2)  # a block of 3 after one query: its last 2
    assert two.queries.flatten().tolist() == [2.0, 3.0] and two.positions.tolist() == [2, 3] and two.first == 2
    two.add(q[:, :, 4:5], 5, 2)  # one query after 2: both forwards' (concatenated)
    assert two.queries.flatten().tolist() == [3.0, 4.0] and two.positions.tolist() == [3, 4] and two.first == 3


def test_a_state_that_starts_at_zero_is_left_to_the_layer(monkeypatch) -> None:
    """Policy.state_starts_zero (H2O's accumulator, SAGE-KV's pins): on_append is called once per layer (its first
    forward, which creates the state), not at every forward; the run is the one that calls it every time."""
    for cls, make in ((H2O, lambda: H2O(budget=24)), (SageKV, lambda: SageKV(budget=40))):
        calls = []
        original = cls.on_append

        def counted(self, layer, *args, _original=original, _calls=calls):
            _calls.append(layer.layer_idx)
            return _original(self, layer, *args)

        monkeypatch.setattr(cls, "on_append", counted)
        short = _run(make())
        assert sorted(calls) == [0, 1]
        monkeypatch.setattr(cls, "state_starts_zero", False)
        calls.clear()
        forwards: list[int] = []
        long = _run(make(), forwards=forwards)
        assert len(forwards) == 6 + 11 + 2  # 6 prompt blocks, 11 decoding steps, the graded branch's
        assert len(calls) == 2 * len(forwards)  # each layer at every forward
        _same(short, long)
        monkeypatch.undo()


def test_sagekv_s_steady_slide_drops_the_known_position(monkeypatch) -> None:
    """SAGE-KV's slide one token after an eviction drops position seen - recent - 2 from every head without a
    selection (Policy.dropped_position, CacheLayer.drop_position): at every decoding eviction but each layer's first
    (its token went into free rows, not a hole), on its ragged layer and its uniform one alike, in the graded branch
    too; the same run as with every slide selected."""
    taken: list[tuple[int, bool, bool]] = []
    original = EvictingLayer.drop_position

    def counted(self, position):
        done = original(self, position)
        taken.append((self.layer_idx, self.ragged, done))
        return done

    monkeypatch.setattr(EvictingLayer, "drop_position", counted)
    short = _run(SageKV(budget=40))
    # 10 of the 11 decoding evictions and 1 of the graded branch's 2 (forked after the prompt): each first selects
    assert sorted(taken) == sorted([(0, True, True), (1, False, True)] * 11)
    monkeypatch.setattr(SageKV, "dropped_position", lambda self, layer: None)
    taken.clear()
    long = _run(SageKV(budget=40))
    assert taken == []
    _same(short, long)


def test_sagekv_names_the_position_only_one_token_after_an_eviction() -> None:
    """By hand, N = 64, g = 2: sink 16, k 64 // 4 = 16, recent 64 - 16 - 32 - 1 = 15; at seen 100 the slide drops
    position 100 - 15 - 2 = 83. None before a selection was made (nothing evicted: physical == seen), in the prompt, and
    when the token did not go into a hole (more than one token may have come in since the eviction)."""
    from types import SimpleNamespace

    def layer(**kw):
        base = dict(layer_idx=0, decoding=True, seen=100, held=60, block_slots=torch.zeros(1, 2, 1, dtype=torch.long),
                    kv_heads=2, stash=SimpleNamespace(queries=torch.zeros(1, 4, 1, 8)))
        base.update(kw)
        return SimpleNamespace(physical=lambda: base["held"], **base)

    policy = SageKV(budget=64)
    assert policy.sizes(2) == (16, 16, 15)
    assert policy.dropped_position(layer()) == 83
    assert policy.dropped_position(layer(block_slots=None)) is None
    assert policy.dropped_position(layer(held=100)) is None
    assert policy.dropped_position(layer(decoding=False)) is None


def test_streamingllm_drops_the_known_position_one_token_over(monkeypatch) -> None:
    """StreamingLLM one token over its budget drops position seen - N - 1 + n_sink from every head without a
    selection (Policy.dropped_position): at every decoding eviction, on the two layers' stack, in the graded branch
    too; after a prompt longer than N (the prompt's blocks select) and after one shorter than N (nothing evicted before
    decoding: the first eviction at seen = N + 1); the same run as with every eviction selected."""
    taken: list[bool] = []
    original = EvictingLayer.drop_position

    def counted(self, position):
        done = original(self, position)
        taken.append(done)
        return done

    monkeypatch.setattr(EvictingLayer, "drop_position", counted)
    for prompt, evictions in ((90, 11 + 2), (20, 7)):
        taken.clear()
        short = _run(StreamingLLM(budget=24), prompt=prompt)
        # one eviction of the two layers' stack a step: 90 prompt tokens, then 11 decoding forwards (the first token
        # is the prompt's) and 2 of the graded branch's 3 answer tokens (its first fills the prompt's hole); 20
        # prompt tokens, then seen 21 .. 31, over N = 24 from 25 on (7), the graded branch's 23 within it
        assert taken == [True] * evictions, (prompt, taken)
        with monkeypatch.context() as m:
            m.setattr(StreamingLLM, "dropped_position", lambda self, layer: None)
            long = _run(StreamingLLM(budget=24), prompt=prompt)
        _same(short, long)


def test_streamingllm_names_the_position_only_one_token_over() -> None:
    """By hand, N = 8, n_sink = 4: at seen 100 a head holding 9 tokens holds sinks 0..3 and 95..99 and drops 95; at
    seen 9 (nothing evicted yet) it holds 0..8 and drops 4. None when more than one token is over (a prompt block), when
    each row saw its own count (a stack of samples), and on a layer the policy does not evict."""
    from types import SimpleNamespace

    def layer(**kw):
        base = dict(layer_idx=0, seen=100, held=9, row_seen=None)
        base.update(kw)
        return SimpleNamespace(physical=lambda: base["held"], **base)

    policy = StreamingLLM(budget=8)
    assert policy.dropped_position(layer()) == 95
    assert policy.dropped_position(layer(seen=9)) == 4
    assert policy.dropped_position(layer(held=10)) is None
    assert policy.dropped_position(layer(row_seen=torch.tensor([100, 101]).view(2, 1, 1))) is None
    assert StreamingLLM(budget=8, skip_layers=[0]).dropped_position(layer()) is None
