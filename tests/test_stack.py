"""A decoding step's eviction of many layers in one call (kvbench/engine/stack.py): the stack's mechanics by hand, and
the same kept tokens, tokens and logits as evicting layer by layer for every stackable policy."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import kvbench.engine.generate as generate_module
from kvbench.engine.cache import EvictingLayer, settle_state
from kvbench.engine.generate import GenerationSettings, Job, Observer, generate, generate_batch
from kvbench.engine.stack import LayerStack
from kvbench.policies.adakv import AdaKV
from kvbench.policies.criticalkv import CriticalKV
from kvbench.policies.h2o import H2O
from kvbench.policies.hashevict import HashEvict
from kvbench.policies.keydiff import KeyDiff
from kvbench.policies.knorm import KNorm
from kvbench.policies.pyramidkv import PyramidKV
from kvbench.policies.random import Random
from kvbench.policies.snapkv import SnapKV
from kvbench.policies.streamingllm import StreamingLLM
from kvbench.policies.tova import TOVA

from helpers import float64_model, held_positions, random_prompt


def _layer(norms: list[float]) -> EvictingLayer:
    """A decoding layer (b = 1, h_kv = 1, d = 2) at positions 0.. whose key at position p is (norm_p, 0) and value
    (p, -p), with slot reuse on."""
    layer = EvictingLayer(0)
    keys = torch.tensor([[n, 0.0] for n in norms]).view(1, 1, -1, 2)
    pos = torch.arange(len(norms), dtype=torch.float32)
    layer.update(keys, torch.stack([pos, -pos], dim=-1).view(1, 1, -1, 2))
    layer.reuse_slots, layer.decoding = True, True
    return layer


def _token(norm: float, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([norm, 0.0]).view(1, 1, 1, 2), torch.tensor([float(p), -float(p)]).view(1, 1, 1, 2)


def test_a_stack_evicts_each_member_as_alone_and_its_members_write_into_it() -> None:
    # K-norm keeps the lowest norms: with budget 4 of 5 slots each layer drops its highest norm, the first token a sink
    first, second = _layer([9.0, 1.0, 5.0, 2.0, 3.0]), _layer([9.0, 4.0, 1.0, 2.0, 3.0])
    stack = LayerStack([first, second])
    assert stack.keys.shape == (2, 1, 5, 2) and stack.current([first, second])
    policy = KNorm(budget=4, n_sink=1, skip_layers=())
    stack.refresh()
    assert policy.evict(stack)
    # layer 0 drops position 2 (norm 5), layer 1 position 1 (norm 4): each a hole, nothing moved
    assert first.hole.tolist() == [[[2]]] and second.hole.tolist() == [[[1]]]
    assert first.positions.tolist() == [[[0, 1, -1, 3, 4]]] and second.positions.tolist() == [[[0, -1, 2, 3, 4]]]
    assert stack.positions.tolist() == [[[0, 1, -1, 3, 4]], [[0, -1, 2, 3, 4]]]
    # the next token goes into each layer's hole, in the stack's storage
    first.update(*_token(0.5, 5))
    second.update(*_token(8.0, 5))
    assert stack.current([first, second])
    assert stack.positions.tolist() == [[[0, 1, 5, 3, 4]], [[0, 5, 2, 3, 4]]]
    assert stack.keys[:, 0, :, 0].tolist() == [[9.0, 1.0, 0.5, 2.0, 3.0], [9.0, 8.0, 1.0, 2.0, 3.0]]
    assert stack.values[1, 0, 1].tolist() == [5.0, -5.0]
    # the next step: layer 0 drops position 4 (norm 3, slot 4), layer 1 the new token (norm 8, slot 1)
    stack.refresh()
    assert policy.evict(stack)
    assert first.hole.tolist() == [[[4]]] and second.hole.tolist() == [[[1]]]
    assert [m.physical() for m in (first, second)] == [4, 4]


def test_a_stack_settles_each_member_s_state_by_its_own_layer() -> None:
    """settle_state over a stack (HashEvict, 8 bits, d = 2; by hand: layer 0's R reads x0's sign, layer 1's x1's): the
    new keys (n, 0) hash to code 255 in layer 0 and 0 in layer 1, written at each member's slot; the probe of the query
    (1, -1) is all ones in layer 0 and all zeros in layer 1, in the stack's scratch and each member's alike. A step
    where one member alone waits is settled member by member, and the stack's scratch is its members' again."""
    first, second = _layer([9.0, 1.0, 5.0]), _layer([9.0, 4.0, 1.0])
    second.layer_idx = 1
    policy = HashEvict(budget=3, n_sink=0, n_recent=0)
    policy.projections[0, 2] = torch.tensor([[1.0, 0.0]] * 8)
    policy.projections[1, 2] = torch.tensor([[0.0, 1.0]] * 8)
    query = torch.tensor([1.0, -1.0]).view(1, 1, 1, 2)
    for m in (first, second):
        m.set_block_state("hash0", torch.full((1, 1, 3), 7.0))
        m.scratch["probe"] = torch.full((1, 1, 8), 0.25)
    stack = LayerStack([first, second], spare=True)
    for m, norm in ((first, 6.0), (second, 2.0)):
        m.update(*_token(norm, 3))  # into the spare slot 3
        m.state_due = (m.block_slots, m.block_states[0], query)
    stack.refresh()
    settle_state(stack, policy)
    assert stack.state["hash0"].tolist() == [[[7.0, 7.0, 7.0, 255.0]], [[7.0, 7.0, 7.0, 0.0]]]
    assert stack.scratch["probe"].flatten().tolist() == [1.0] * 8 + [0.0] * 8
    assert first.scratch["probe"].flatten().tolist() == [1.0] * 8 and second.scratch["probe"].sum() == 0
    assert first.state_due is None and second.state_due is None
    first.state_due = (first.block_slots, first.block_states[0], -query)  # layer 0 alone: probe all zeros now
    settle_state(stack, policy)
    assert first.scratch["probe"].sum() == 0 and stack.scratch["probe"].sum() == 0


def test_a_stack_drops_a_position_as_each_member_would() -> None:
    """drop_position on a stack (one comparison over all its rows): each member gets the hole of the slot holding the
    position in its own rows, and the next token goes there."""
    first, second = _layer([9.0, 1.0, 5.0]), _layer([9.0, 4.0, 1.0])
    stack = LayerStack([first, second])
    stack.refresh()
    KNorm(budget=2, n_sink=1, skip_layers=()).evict(stack)  # layer 0 drops position 2 (slot 2), layer 1 position 1
    first.update(*_token(0.5, 3))
    second.update(*_token(0.5, 3))
    assert stack.positions.tolist() == [[[0, 1, 3]], [[0, 3, 2]]]
    assert stack.drop_position(3) and stack.hole is None
    assert first.hole.tolist() == [[[2]]] and second.hole.tolist() == [[[1]]]
    assert stack.positions.tolist() == [[[0, 1, -1]], [[0, -1, 2]]]
    first.update(*_token(0.25, 4))
    second.update(*_token(0.25, 4))
    assert stack.current([first, second]) and stack.positions.tolist() == [[[0, 1, 4]], [[0, 4, 2]]]


def test_a_stack_opened_with_a_spare_slot_takes_the_next_token_there() -> None:
    first, second = _layer([9.0, 1.0, 5.0]), _layer([9.0, 4.0, 1.0])
    first.set_block_state("norm", torch.tensor([[[9.0, 1.0, 5.0]]]))
    second.set_block_state("norm", torch.tensor([[[9.0, 4.0, 1.0]]]))
    stack = LayerStack([first, second], spare=True)
    assert stack.positions.tolist() == [[[0, 1, 2, -1]], [[0, 1, 2, -1]]]
    assert first.hole.tolist() == [[[3]]] and first.physical() == 3
    first.update(*_token(6.0, 3))
    second.update(*_token(2.0, 3))
    assert stack.current([first, second]) and first.hole is None
    assert stack.keys[:, 0, :, 0].tolist() == [[9.0, 1.0, 5.0, 6.0], [9.0, 4.0, 1.0, 2.0]]
    assert stack.positions.tolist() == [[[0, 1, 2, 3]], [[0, 1, 2, 3]]]
    assert stack.state["norm"].tolist() == [[[9.0, 1.0, 5.0, 0.0]], [[9.0, 4.0, 1.0, 0.0]]]  # the policy fills it


def test_a_member_whose_arrays_were_replaced_leaves_the_stack() -> None:
    first, second = _layer([9.0, 1.0, 5.0]), _layer([9.0, 4.0, 1.0])
    stack = LayerStack([first, second])
    first.update(*_token(1.0, 3))  # no hole: appended, a new tensor
    assert not stack.current([first, second])
    assert first.keys[0, 0, :, 0].tolist() == [9.0, 1.0, 5.0, 1.0] and stack.keys.shape == (2, 1, 3, 2)


def test_a_stack_refuses_a_selection_other_than_one_token_per_head() -> None:
    stack = LayerStack([_layer([1.0, 2.0, 3.0, 4.0]), _layer([1.0, 2.0, 3.0, 4.0])])
    with pytest.raises(RuntimeError, match="one token per head only"):
        stack.keep(torch.tensor([[[0, 1]], [[0, 1]]]))  # two of four: a gather would leave the members behind


def test_a_fork_of_a_stacked_layer_writes_its_own_tensors() -> None:
    first, second = _layer([9.0, 1.0, 5.0]), _layer([9.0, 4.0, 1.0])
    stack = LayerStack([first, second])
    stack.refresh()
    KNorm(budget=2, n_sink=1, skip_layers=()).evict(stack)
    branch = first.fork()
    first.update(*_token(7.0, 3))  # into the stack, in place
    assert first.keys[0, 0, :, 0].tolist() == [9.0, 1.0, 7.0]
    assert branch.keys[0, 0, :, 0].tolist() == [9.0, 1.0, 5.0] and branch.positions.tolist() == [[[0, 1, -1]]]


def test_a_prompt_blocks_stack_gathers_and_hands_each_member_its_rows() -> None:
    # Two layers after a prompt block (not decoding, no slot reuse), K-norm at budget 3 of 5 with the first token a
    # sink: each drops its two highest norms after the sink. Layer 0 (norms 9, 1, 5, 2, 3) keeps positions 0, 1, 3;
    # layer 1 (9, 4, 1, 2, 3) keeps 0, 2, 3.
    first, second = _layer([9.0, 1.0, 5.0, 2.0, 3.0]), _layer([9.0, 4.0, 1.0, 2.0, 3.0])
    for m in (first, second):
        m.reuse_slots, m.decoding = False, False
    stack = LayerStack([first, second])
    stack.refresh()
    assert KNorm(budget=3, n_sink=1, skip_layers=()).evict(stack)
    assert first.positions.tolist() == [[[0, 1, 3]]] and second.positions.tolist() == [[[0, 2, 3]]]
    assert first.keys[0, 0, :, 0].tolist() == [9.0, 1.0, 2.0] and second.values[0, 0, :, 0].tolist() == [0.0, 2.0, 3.0]
    # the members hold views of the stack's new arrays, in order and contiguous (what attention reads next)
    assert first.keys.data_ptr() == stack.keys.data_ptr() and first.keys.is_contiguous()
    assert stack.current([first, second]) and first.hole is None and first.chronological
    assert not first.in_stack  # nothing writes into a prompt's stack: a fork shares the arrays
    first.update(*_token(1.0, 5))  # the next block appends: a new tensor, the stack left behind
    assert not stack.current([first, second]) and first.positions.tolist() == [[[0, 1, 3, 5]]]


def _count_stacks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The member count of every stack evicted from now on, in order (LayerStack.refresh, called once per stack before
    its eviction, still runs)."""
    stacked: list[int] = []
    refresh = LayerStack.refresh

    def counted(self: LayerStack) -> None:
        stacked.append(len(self.members))
        refresh(self)

    monkeypatch.setattr(LayerStack, "refresh", counted)
    return stacked


def _together_and_alone(monkeypatch: pytest.MonkeyPatch, model: Any,
                        jobs: Callable[[bool], list[Job]]) -> tuple[list[int], list[Any], list[Any]]:
    """generate_batch of jobs(True) (a batch's decoding evictions in one call), then of jobs(False) (each sample on its
    own): the member counts of the stacks the first way evicted, and both ways' results."""
    stacked = _count_stacks(monkeypatch)
    together = generate_batch(model, jobs(True))
    per_step = list(stacked)
    return per_step, together, generate_batch(model, jobs(False))


STACKABLE = {
    "streamingllm": lambda: StreamingLLM(budget=24), "knorm": lambda: KNorm(budget=24, skip_layers=[0]),
    "knorm_skip_middle": lambda: KNorm(budget=24, skip_layers=[1]),  # layer 0 alone, layers 2-3 one stack
    "keydiff": lambda: KeyDiff(budget=24), "keydiff_median": lambda: KeyDiff(budget=24, anchor="median"),
    "tova": lambda: TOVA(budget=24), "h2o": lambda: H2O(budget=24),
    "h2o_original": lambda: H2O(budget=24, recent_ratio=0.5), "random": lambda: Random(budget=24),
    "hashevict": lambda: HashEvict(budget=24),
    # the observation window's ring (a stackable extra): the stack's own over all its rows
    "snapkv": lambda: SnapKV(budget=24, window=6, kernel=5),
    "snapkv_max": lambda: SnapKV(budget=24, window=4, kernel=3, pooling="max"),
    # SnapKV's scores, then the two stages' cuts head by head over the value norms (per-token state)
    "criticalkv": lambda: CriticalKV(budget=24, window=6, kernel=5),
    "criticalkv_inside": lambda: CriticalKV(budget=24, window=4, kernel=3, pooling="avg", stage1_window="inside",
                                            alpha=0.25),
}


def _stacked_and_layer_by_layer(name: str, monkeypatch: pytest.MonkeyPatch, settings: GenerationSettings,
                                 answer_ids: list[int]) -> list[int]:
    """float64, 4 layers, a 90-token prompt: `generate` with `settings` (its stacks), then with every eviction layer by
    layer; the same tokens held before every forward, the same greedy tokens, logits and graded score. Returns the
    member counts of the stacks the first run evicted."""
    model, ids = float64_model(4), random_prompt(90, 1)
    stacked = _count_stacks(monkeypatch)
    runs = []
    for stacking in (True, False):
        if not stacking:
            counted = list(stacked)
            monkeypatch.setattr(generate_module, "eviction_units", lambda cache: cache.evicting_layers())
            monkeypatch.setattr(generate_module, "open_stacks", lambda cache: None)
        logits: list[torch.Tensor] = []
        res = generate(model, STACKABLE[name](), ids, settings, answer_ids=answer_ids,
                       observer=Observer(trace=True, on_logits=lambda lg: logits.append(lg[0])))
        runs.append((res, logits))
    (on, l_on), (off, l_off) = runs
    assert on.tokens == off.tokens and len(on.tokens) == settings.max_new_tokens
    assert held_positions(on.trace) == held_positions(off.trace)
    assert all(torch.equal(a, b) for a, b in zip(l_on, l_off, strict=True))
    assert on.answer_logprob == off.answer_logprob
    return counted


@pytest.mark.parametrize("name", sorted(STACKABLE))
def test_stacked_eviction_keeps_what_layer_by_layer_keeps(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """K-norm: 3 layers evicted, consecutive or not; 20 new tokens and a graded branch: the same whether the layers
    are evicted as stacks or one by one, and a stack really evicted every decoding step."""
    stacked = _stacked_and_layer_by_layer(name, monkeypatch, GenerationSettings(block=16, max_new_tokens=20),
                                          [11, 12, 13, 14, 15])
    # every decoding step (19 of the answer, 4 of the graded branch) evicted one stack of consecutive evicted layers
    assert stacked == [{"knorm": 3, "knorm_skip_middle": 2}.get(name, 4)] * (19 + 4)


@pytest.mark.parametrize("name", sorted(STACKABLE))
def test_stacked_prompt_evictions_keep_what_layer_by_layer_keeps(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the prompt's evictions stacked too (stack_prefill, off by default): the same as layer by layer, and a
    stack evicted after each of the five blocks past the budget (90 tokens, B = 16, N = 24: blocks 2-6)."""
    settings = GenerationSettings(block=16, max_new_tokens=8, stack_prefill=True)
    stacked = _stacked_and_layer_by_layer(name, monkeypatch, settings, [11, 12, 13])
    width = {"knorm": 3, "knorm_skip_middle": 2}.get(name, 4)
    assert stacked == [width] * (5 + 7 + 2)  # 5 prompt blocks, then 7 decoding steps and 2 of the graded branch


def test_only_stackable_policies_and_equal_budgets_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyramidKV scores as SnapKV does (stackable), but its layers' budgets differ: it evicts layer by layer. AdaKV
    (per-head budgets, its own selection) is not stackable, nor CriticalKV over it."""
    stacked = _count_stacks(monkeypatch)
    assert PyramidKV.stackable and not AdaKV.stackable
    assert CriticalKV(budget=48).stackable and not CriticalKV(budget=48, base="adakv").stackable
    generate(float64_model(4), PyramidKV(budget=24, window=4, kernel=3), random_prompt(90, 1),
             GenerationSettings(block=16, max_new_tokens=6, slot_reuse=True))
    assert stacked == []


# -- several samples' layers in one stack (a batch's decoding evictions: SampleStacks) ---------------------------------

def test_a_stack_of_samples_protects_each_rows_own_latest_tokens() -> None:
    # K-norm keeps the lowest norms, with the first position a sink and each sample's latest token protected. Sample A
    # saw 5 tokens (positions 0-4), sample B 7, of which it holds positions 0, 2, 3, 5, 6 (norms 9, 1, 6, 7, 3).
    a = _layer([9.0, 1.0, 5.0, 2.0, 3.0])
    b = _layer([9.0, 8.0, 1.0, 6.0, 2.0, 7.0, 3.0])
    b.decoding = False  # a prompt's eviction: gathered, chronological
    b.keep(torch.tensor([[[0, 2, 3, 5, 6]]]))
    b.decoding = True
    assert b.positions.tolist() == [[[0, 2, 3, 5, 6]]] and (a.seen, b.seen) == (5, 7)
    stack = LayerStack([a, b])
    stack.refresh()
    assert stack.row_seen.view(-1).tolist() == [5, 7]
    assert KNorm(budget=4, n_sink=1, n_recent=1, skip_layers=()).evict(stack)
    # A drops position 2 (norm 5; position 4 is its latest). B drops position 5 (norm 7): its latest is 6, so 5 is not
    # protected; read with A's count (5), positions 4 and up would be, and B would drop position 3 (norm 6) instead.
    assert a.positions.tolist() == [[[0, 1, -1, 3, 4]]] and b.positions.tolist() == [[[0, 2, 3, -1, 6]]]
    # the members of a stack step together: a member whose count moved apart from the others leaves it
    a.update(*_token(1.0, 5))
    assert not stack.current([a, b])


def test_a_policy_with_per_sample_state_is_never_batched() -> None:
    assert Random(budget=8).batch_key() is None and AdaKV(budget=48).batch_key() is None
    assert KeyDiff(budget=8).batch_key() == KeyDiff(budget=8).batch_key()
    assert KeyDiff(budget=8).batch_key() != KeyDiff(budget=9).batch_key()
    assert KeyDiff(budget=8).batch_key() != KeyDiff(budget=8, anchor="median").batch_key()
    assert HashEvict(budget=24).batch_key() != HashEvict(budget=24, seed=1).batch_key()
    assert H2O(budget=8).batch_key() != H2O(budget=8, recent_ratio=0.5).batch_key()
    # CriticalKV's window, kernel and pooling are its base's settings
    assert CriticalKV(budget=48).batch_key() == CriticalKV(budget=48).batch_key()
    for other in ({"window": 8}, {"kernel": 5}, {"pooling": "avg"}, {"alpha": 0.25}):
        assert CriticalKV(budget=48).batch_key() != CriticalKV(budget=48, **other).batch_key()
    assert CriticalKV(budget=48, base="adakv").batch_key() is None


@pytest.mark.parametrize("name", sorted(STACKABLE))
def test_a_batchs_eviction_in_one_call_keeps_what_each_sample_keeps(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """float64, 4 layers, three samples of 90, 77 and 101 tokens decoded together (20 new tokens, a graded branch
    each): evicting every sample's layers in one stack per step gives each sample the tokens held before every forward,
    the greedy tokens and the logits that evicting sample by sample gives; and it really did (one stack of 3 samples x
    the evicted layers per step, but for Random, whose generator is each sample's own)."""
    prompts = [random_prompt(90, 1), random_prompt(77, 2), random_prompt(101, 3)]
    logits: dict[bool, list[list[torch.Tensor]]] = {True: [[], [], []], False: [[], [], []]}

    def jobs(together: bool) -> list[Job]:
        settings = GenerationSettings(block=16, max_new_tokens=20, slot_reuse=True, evict_together=together)
        return [Job(ids, STACKABLE[name](), settings, answer_ids=[11, 12, 13, 14, 15],
                    observer=Observer(trace=True, on_logits=lambda lg, k=k: logits[together][k].append(lg[0])))
                for k, ids in enumerate(prompts)]

    per_step, on, off = _together_and_alone(monkeypatch, float64_model(4), jobs)
    for a, b, la, lb in zip(on, off, logits[True], logits[False], strict=True):
        assert a.tokens == b.tokens and len(a.tokens) == 20
        assert held_positions(a.trace) == held_positions(b.trace)
        assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))
        assert a.answer_logprob == b.answer_logprob
    # 19 steps of the answers, 4 of the graded branches: all three samples' evicted layers each time, in one stack per
    # run of layers (K-norm skipping layer 1: layer 0 of each sample, then layers 2-3 of each). Random: each sample its
    # own stack, its own generator. SnapKV: each sample its own stack too, as its stashed window of queries sits at
    # other positions in samples of other lengths (a stack's causal mask reads one set of positions; `_alike`), and so
    # does CriticalKV over SnapKV
    own = [4, 4, 4]
    stacks = {"knorm": [9], "knorm_skip_middle": [3, 6], "random": own, "snapkv": own, "snapkv_max": own,
              "criticalkv": own, "criticalkv_inside": own}.get(name, [12])
    assert per_step == stacks * (19 + 4)


def test_samples_of_one_length_stack_their_observation_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """SnapKV on three samples of 90 tokens each (other tokens) decoded together: every step's evictions of all three
    in one stack of 3 x 4 layers, each sample keeping what it keeps on its own."""
    prompts = [random_prompt(90, seed) for seed in (1, 2, 3)]

    def jobs(together: bool) -> list[Job]:
        settings = GenerationSettings(block=16, max_new_tokens=12, slot_reuse=True, evict_together=together)
        return [Job(ids, STACKABLE["snapkv"](), settings, observer=Observer(trace=True)) for ids in prompts]

    per_step, on, off = _together_and_alone(monkeypatch, float64_model(4), jobs)
    for a, b in zip(on, off, strict=True):
        assert a.tokens == b.tokens and len(a.tokens) == 12
        assert held_positions(a.trace) == held_positions(b.trace)
    assert per_step == [12] * 11


def test_pyramidkv_samples_of_one_length_stack_each_layer_across_the_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyramidKV's layers have budgets of their own, so one sample's layers never stack; the same layer of three
    samples of one length does: each decoding step evicts 4 stacks of 3, and every sample keeps what it keeps alone."""
    prompts = [random_prompt(90, seed) for seed in (1, 2, 3)]

    def jobs(together: bool) -> list[Job]:
        settings = GenerationSettings(block=16, max_new_tokens=12, slot_reuse=True, evict_together=together)
        return [Job(ids, PyramidKV(budget=24, window=4, kernel=3), settings, answer_ids=[11, 12, 13],
                    observer=Observer(trace=True)) for ids in prompts]

    per_step, on, off = _together_and_alone(monkeypatch, float64_model(4), jobs)
    for a, b in zip(on, off, strict=True):
        assert a.tokens == b.tokens and len(a.tokens) == 12
        assert held_positions(a.trace) == held_positions(b.trace) and a.answer_logprob == b.answer_logprob
    assert per_step == [3] * 4 * (11 + 2)  # 11 steps of the answers, 2 of the graded branches


@pytest.mark.parametrize("name", ["h2o_original"])  # per-row protection (n_recent) across the stacks rebuilt
def test_samples_leaving_a_batch_leave_its_stacks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three samples asking for 20, 9 and 14 new tokens: after each leaves, the others' layers are stacked again
    without it (3, then 2 samples, then the last one's own stack of its 4 layers), and every sample keeps what it
    keeps evicting on its own."""
    prompts = [random_prompt(90, 4), random_prompt(77, 5), random_prompt(101, 6)]

    def jobs(together: bool) -> list[Job]:
        return [Job(ids, STACKABLE[name](), GenerationSettings(block=16, max_new_tokens=n, evict_together=together),
                    observer=Observer(trace=True)) for ids, n in zip(prompts, (20, 9, 14))]

    per_step, on, off = _together_and_alone(monkeypatch, float64_model(4), jobs)
    for a, b in zip(on, off, strict=True):
        assert a.tokens == b.tokens and held_positions(a.trace) == held_positions(b.trace)
    assert [len(a.tokens) for a in on] == [20, 9, 14]
    # steps 1-8 all three samples, 9-13 the first and third, 14-19 the first alone
    assert per_step == [12] * 8 + [8] * 5 + [4] * 6


@pytest.mark.parametrize("name", ["knorm", "keydiff", "hashevict"])
def test_a_decoding_steps_state_computed_at_the_eviction_is_the_forwards(name: str) -> None:
    """Policy.state_from_tokens (K-norm's norms, KeyDiff's inverse norms, HashEvict's codes and probe by each layer's
    own R): a decoding step's per-token state computed at the eviction, for the stack's layers in one call
    (cache.settle_state), against in each layer's forward: every score bit-equal at every eviction, the same tokens
    held, tokens, logits and graded score (float64, 4 layers, a 90-token prompt, 20 new tokens and a graded branch);
    and one call of 3 (4) rows a decoding step instead of 3 (4) of one."""
    model, ids = float64_model(4), random_prompt(90, 1)
    runs = []
    for deferred in (True, False):
        policy = STACKABLE[name]()
        policy.state_from_tokens = deferred
        rows: list[int] = []  # per one-token on_append call: the rows of keys it got
        scores: list[torch.Tensor] = []
        on_append, score = policy.on_append, policy.score

        def counted(layer: Any, module: Any, keys: torch.Tensor, values: Any, query: Any) -> dict:
            if keys.shape[-2] == 1:
                rows.append(keys.shape[0])
            return on_append(layer, module, keys, values, query)

        def kept(layer: Any) -> torch.Tensor:
            out = score(layer)
            scores.append(out.clone())
            return out

        policy.on_append, policy.score = counted, kept
        logits: list[torch.Tensor] = []
        res = generate(model, policy, ids, GenerationSettings(block=16, max_new_tokens=20),
                       answer_ids=[11, 12, 13, 14, 15],
                       observer=Observer(trace=True, on_logits=lambda lg: logits.append(lg[0])))
        runs.append((res, logits, scores, rows))
    (on, l_on, s_on, r_on), (off, l_off, s_off, r_off) = runs
    assert on.tokens == off.tokens and held_positions(on.trace) == held_positions(off.trace)
    assert all(torch.equal(a, b) for a, b in zip(l_on, l_off, strict=True))
    assert on.answer_logprob == off.answer_logprob
    assert len(s_on) == len(s_off) and all(torch.equal(a, b) for a, b in zip(s_on, s_off))
    # layers 1-3 evicted (K-norm skips layer 0; KeyDiff evicts all 4): the answer's 19 decoding steps and the graded
    # branch's 4, each one call over the stack's rows, against one call per layer and step
    width = {"knorm": 3, "keydiff": 4, "hashevict": 4}[name]
    assert r_on == [width] * (19 + 4), r_on
    assert r_off == [1] * (width * (19 + 4))
