"""The static slot cache (kvbench/engine/slotcache.py, slotgen.py): writes into free slots, eviction marks slots free,
the logits equal the float64 reference driven by the positions each head held, compiled == eager, and a forward's aten
ops (eviction included) stay near HF's own forward."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

import kvbench.engine.slotbatch as slotbatch
from kvbench.engine import attention
from kvbench.engine.generate import GenerationSettings, Job, Observer, generate
from kvbench.engine.slotcache import SlotCache, evict, free_slots, install
from kvbench.engine.slotgen import SlotRun, capacity, generate_slots, plan
from kvbench.models.tiny import build_tiny_model
from kvbench.policies.adakv import AdaKV
from kvbench.policies.base import Policy
from kvbench.policies.criticalkv import CriticalKV
from kvbench.policies.h2o import H2O
from kvbench.policies.hashevict import HashEvict
from kvbench.policies.keydiff import KeyDiff
from kvbench.policies.knorm import KNorm
from kvbench.policies.pyramidkv import PyramidKV
from kvbench.policies.sagekv import SageKV
from kvbench.policies.snapkv import SnapKV
from kvbench.policies.streamingllm import StreamingLLM
from kvbench.policies.tova import TOVA
from kvbench.policies.view import SlotView

from float64_reference import reference_logits
from helpers import random_prompt

POLICIES = {
    "streamingllm": lambda: StreamingLLM(budget=24),
    "knorm": lambda: KNorm(budget=24, skip_layers=[0]),  # layer 0 in the never-evicted group
    "keydiff": lambda: KeyDiff(budget=24),
    "h2o": lambda: H2O(budget=24),  # attention accumulated inside the forward
    "tova": lambda: TOVA(budget=24),
    "snapkv": lambda: SnapKV(budget=24, window=4, kernel=3),
    "pyramidkv": lambda: PyramidKV(budget=24, window=4, kernel=3),  # per-layer budgets
    "hashevict": lambda: HashEvict(budget=24),
    "adakv": lambda: AdaKV(budget=24, window=4, kernel=3),  # per-head counts (the layer's h_kv * N shared)
    "adakv_kvpress": lambda: AdaKV(budget=24, window=4, kernel=3, allocation="kvpress"),
    "criticalkv": lambda: CriticalKV(budget=24, window=4, kernel=3),  # value norms as per-token state
    "criticalkv_adakv": lambda: CriticalKV(base="adakv", budget=24, window=4, kernel=3),
    "criticalkv_inside": lambda: CriticalKV(base="adakv", allocation="kvpress", stage1_window="inside", budget=24,
                                            window=4, kernel=3),
    "sagekv": lambda: SageKV(budget=24, sink=2, k=4, recent=8),  # per-head unions; pins, then slides
    "sagekv_derived": lambda: SageKV(budget=24),  # sizes from N and the group: sink 6, k 6, recent 5
}
# Heads that keep different numbers of tokens: the chronological engine reports a layer's total over h_kv (ceil) as its
# peak_kv_tokens, the slot cache the most one head held, never less (the K+V bytes held agree)
PER_HEAD = {"adakv", "adakv_kvpress", "criticalkv_adakv", "criticalkv_inside", "sagekv", "sagekv_derived"}


def _model(layers: int = 2, slots: bool = True, dtype: torch.dtype = torch.float64):
    model, _ = build_tiny_model("tiny-llama", output_scale=1.0, num_hidden_layers=layers)
    model.set_attn_implementation("sdpa")
    if slots:
        install(model)
    else:
        attention.install(model)
    return model.to(dtype)


def _held(trace: list[list[torch.Tensor | None]]) -> list[list[list[int]]]:
    """Per forward and layer, each head's held positions, sorted (free slots and absent layers dropped)."""
    return [[sorted(p for p in t[0, h].tolist() if p >= 0) for h in range(t.shape[1])] if t is not None else None
            for step in trace[1:] for t in step]  # the first forward's (nothing held) records differ in form


# -- the layout, by hand ------------------------------------------------------------------------------------------
def test_free_slots_are_the_first_free_in_slot_order() -> None:
    pos = torch.tensor([[[5, -1, 2, -1, -1, 7]]])  # (1, 1, 6): slots 1, 3, 4 free
    assert free_slots(pos, 2).tolist() == [[[1, 3]]]
    assert free_slots(pos, 3).tolist() == [[[1, 3, 4]]]


def test_capacity_is_the_most_held_between_evictions() -> None:
    settings = GenerationSettings(block=16, max_new_tokens=5)
    chunks = plan(70, settings, StreamingLLM(budget=24))
    assert [(a, b) for a, b, _ in chunks] == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 70)]
    assert capacity(chunks, 24, 5, evicts_decoding=True) == 24 + 16  # N + B
    assert capacity(chunks, 24, 5, evicts_decoding=False) == 24 + 16  # the blocks still hold the most
    assert capacity(chunks, 24, 20, evicts_decoding=False) == 24 + 20  # N after the prompt, then growing
    one = plan(70, GenerationSettings(block=None, max_new_tokens=5), StreamingLLM(budget=24))
    assert one == [(0, 70, True)] and capacity(one, 24, 5, evicts_decoding=True) == 70


def test_a_block_writes_into_free_slots_and_eviction_marks_slots_free() -> None:
    """StreamingLLM, N = 6 (2 sinks), B = 4, one layer: worked out slot by slot."""
    model = _model(layers=1)
    policy = StreamingLLM(budget=6, n_sink=2)
    run = SlotRun(model, policy, 12, GenerationSettings(block=4), new=0)
    pos = run.cache.evicting.pos  # (1, 1, h_kv, 10)
    assert pos.shape[-1] == 10 and bool((pos == -1).all())
    ids = torch.tensor([random_prompt(12, 0)])
    with torch.inference_mode():
        for start in (0, 4):
            run.step(ids[:, start:start + 4], torch.arange(start, start + 4)[None], run.counts(start + 4))
        # 8 held: slots 0-7 in order; the eviction kept sinks 0, 1 and positions 4-7, freed slots 2, 3
        assert pos[0, 0, 0].tolist() == [0, 1, -1, -1, 4, 5, 6, 7, -1, -1]
        run.step(ids[:, 8:12], torch.arange(8, 12)[None], run.counts(12))
    # positions 8-11 went into the first free slots 2, 3, 8, 9; then 4-7 were freed
    assert pos[0, 0, 0].tolist() == [0, 1, 8, 9, -1, -1, -1, -1, 10, 11]
    assert bool((pos[0, 0] == pos[0, 0, :1]).all())  # every head alike (StreamingLLM ranks by position)


def test_per_layer_counts_keep_each_layers_budget() -> None:
    """Counts (L, b, 1) of 3 and 5 keep the latest 3 and 5 positions (StreamingLLM, no sinks) of each layer."""
    model = _model(layers=2)
    run = SlotRun(model, StreamingLLM(budget=5, n_sink=0), 8, GenerationSettings(block=8), new=0)
    ids = torch.tensor([random_prompt(8, 1)])
    with torch.inference_mode():
        run.step(ids, torch.arange(8)[None], None)
        evict(run.cache, torch.tensor([3, 5]).view(2, 1, 1))
    held = [sorted(p for p in run.cache.evicting.pos[layer, 0, 0].tolist() if p >= 0) for layer in (0, 1)]
    assert held == [[5, 6, 7], [3, 4, 5, 6, 7]]


# -- against the float64 reference and the chronological engine ---------------------------------------------------
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_slots_match_float64_reference(name: str) -> None:
    """Blocks of 16 over a 70-token prompt, 6 greedy steps: every logit the run saw equals the float64 reference
    attending, per layer and head, to exactly the positions the run held; each head held the same positions as in
    the chronological engine (kvbench.engine.generate), forward by forward."""
    _match_reference_and_chronological(POLICIES[name], name in PER_HEAD, 70, 6)


@pytest.mark.parametrize("name", ["adakv", "criticalkv_adakv", "sagekv"])
def test_per_head_prompt_within_budget_then_decoding(name: str) -> None:
    """A 20-token prompt (within N = 24), 12 steps: AdaKV's layers stay under h_kv * N for the first steps (counts =
    every held token), SAGE-KV makes its one selection at the first decoding eviction over budget, then slides."""
    _match_reference_and_chronological(POLICIES[name], True, 20, 12)


def _match_reference_and_chronological(make: Callable[[], Policy], per_head: bool, T: int, new: int) -> None:
    model, old = _model(), _model(slots=False)
    ids = random_prompt(T, 0)
    settings = GenerationSettings(block=16, max_new_tokens=new)
    logged: list[torch.Tensor] = []
    res = generate_slots(model, make(), ids, settings,
                         observer=Observer(trace=True, on_logits=lambda lg: logged.append(lg[0])))
    chunks = [ids[s:s + 16] for s in range(0, T, 16)] + [[t] for t in res.tokens[:-1]]
    assert len(res.trace) == len(chunks)
    ref = reference_logits(model, chunks, res.trace)
    first = len(chunks) - len(res.tokens)
    for got, want in zip(logged, [ref[first]] + ref[first + 1:], strict=True):
        assert (got.double() - want).abs().max().item() < 1e-5
    assert min(int((t >= 0).sum(dim=-1).max()) for t in res.trace[-1]) < T + len(res.tokens) - 1  # some evicted
    chrono = generate(old, make(), ids, settings, observer=Observer(trace=True))
    assert chrono.tokens == res.tokens
    assert _held(chrono.trace) == _held(res.trace)
    assert res.kv_bytes_peak == chrono.kv_bytes_peak
    if per_head:  # PER_HEAD: the two engines count peak_kv_tokens differently where heads differ
        assert res.peak_kv_tokens >= chrono.peak_kv_tokens
    else:
        assert res.peak_kv_tokens == chrono.peak_kv_tokens


# -- AdaKV's head cap (the static bound of a per-head allocation) ------------------------------------------------------
@pytest.mark.parametrize("allocation", ["kvpress", "adakv"])
def test_adakv_head_cap_clamps_counts_by_hand(allocation: str) -> None:
    """3 heads, N = 4, head_cap 1.5: a head keeps at most ceil(6.0) = 6. Each head holds 8 tokens, 1 protected (+inf);
    head 0's scores beat every other head's, so the allocation gives it all its 8 (safeguard 0): clamped to 6, the 2
    clamped away unused (10 kept of h_kv * N = 12). Under h_kv * N in all (7 + 2 + 2 = 11) a head keeps every held
    token, up to the cap too."""
    policy = AdaKV(budget=4, window=1, kernel=1, alpha_safeguard=0.0, allocation=allocation, head_cap=1.5)
    assert policy.head_capacity(4) == 6
    inf = float("inf")
    scores = torch.tensor([[inf, .9, .8, .7, .6, .5, .4, .3],
                           [inf, .1, .08, .06, .04, .02, .01, .005],
                           [inf, .09, .07, .05, .03, .015, .008, .003]]).view(1, 1, 3, 8)  # (L, b, h_kv, S)
    budgets = torch.tensor([4]).view(1, 1, 1)
    # adakv: F = 3 per head, c = (7, 1, 1) of the top 9 unprotected; k = round(c) = (7, 1, 1)
    assert policy.slot_allocation(scores, budgets).tolist() == [[[8, 2, 2]]]
    assert policy.slot_counts(None, scores, budgets).tolist() == [[[6, 2, 2]]]  # type: ignore[arg-type]
    under = scores.clone()
    under[..., 1, 2:] = -inf  # head 1 holds 2 (free slots -inf)
    under[..., 2, 2:] = -inf
    under[..., 0, 7:] = -inf  # head 0 holds 7: 11 in all, not over 12
    assert policy.slot_allocation(under, budgets).tolist() == [[[7, 2, 2]]]
    assert policy.slot_counts(None, under, budgets).tolist() == [[[6, 2, 2]]]  # type: ignore[arg-type]


class _CapCount(AdaKV):
    """AdaKV that counts, per eviction, the heads whose allocation the cap clamped (a host read: eager tests only)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.binds: list[int] = []

    def slot_counts(self, view: SlotView, ranked: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        kept = super().slot_counts(view, ranked, counts)
        self.binds.append(int((kept < self.slot_allocation(ranked, counts)).sum()))
        return kept


@pytest.mark.parametrize("allocation", ["kvpress", "adakv"])
def test_adakv_head_cap_on_a_small_run(allocation: str) -> None:
    """The 70-token run of the reference test: with 2 KV heads the default cap (2N = h_kv * N) never binds; at
    head_cap 1.0 (every head at most N) it binds in some evictions, and every head holds at most N after each."""
    model = _model()
    ids = random_prompt(70, 0)
    settings = GenerationSettings(block=16, max_new_tokens=6)
    default = _CapCount(budget=24, window=4, kernel=3, allocation=allocation)
    generate_slots(model, default, ids, settings)
    assert len(default.binds) == 5 + 5 and sum(default.binds) == 0  # 5 blocks, 5 decoding evictions
    tight = _CapCount(budget=24, window=4, kernel=3, allocation=allocation, head_cap=1.0)
    res = generate_slots(model, tight, ids, settings, observer=Observer(trace=True))
    assert sum(b > 0 for b in tight.binds) > 0
    for step in res.trace[1:]:  # before each forward: what the eviction before it left
        assert all(int((t >= 0).sum(dim=-1).max()) <= 24 for t in step)


# -- the rows of a batch, each with its own budget --------------------------------------------------------------------
ROW_POLICIES: dict[str, Callable[[int], Policy]] = {
    "adakv": lambda n: AdaKV(budget=n, window=4, kernel=3),
    "criticalkv": lambda n: CriticalKV(budget=n, window=4, kernel=3),
    "criticalkv_adakv": lambda n: CriticalKV(base="adakv", allocation="kvpress", budget=n, window=4, kernel=3),
    "sagekv": lambda n: SageKV(budget=n, sink=2, k=4, recent=8),
    "sagekv_derived": lambda n: SageKV(budget=n),  # sizes from each row's own budget
}


def _evict_with_budgets(cache: SlotCache, counts: torch.Tensor) -> None:
    """`evict` with the view's `budgets` set to the rows' `counts` (what CriticalKV's and SAGE-KV's scores read)."""
    view = cache.view
    cache.view = lambda: dataclasses.replace(view(), budgets=counts)  # type: ignore[method-assign]
    try:
        evict(cache, counts)
    finally:
        del cache.view


def _states(trace: list[list[torch.Tensor | None]]) -> list[list[list[int]]]:
    """Each head's held positions per forward, consecutive repeats (a batch row's idle rounds) dropped."""
    out: list[list[list[int]]] = []
    for step in trace:
        held = [sorted(p for p in t[0, h].tolist() if p >= 0) for t in step if t is not None for h in range(t.shape[1])]
        if not out or out[-1] != held:
            out.append(held)
    return out


@pytest.mark.parametrize("name", sorted(ROW_POLICIES))
def test_rows_with_their_own_budgets_keep_what_their_runs_alone_keep(name: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Three runs as the rows of one batch (slotbatch.generate_rows), budgets 24, 20 and 28, prompts of 64, 16 (within
    its budget: SAGE-KV selects while decoding) and 48 tokens, 6-12 steps: each row holds what its run alone holds,
    forward by forward, and decodes the same tokens. The budgets reach the scores through `SlotView.budgets`. Prompts
    of whole blocks: a shorter last block is padded to the batch's width, and the padding then takes slots beyond
    the row's capacity (an engine matter, left aside here)."""
    monkeypatch.setattr(slotbatch, "evict", _evict_with_budgets)
    model = _model()
    jobs, alone = [], []
    for k, (T, new, budget) in enumerate([(64, 6, 24), (16, 12, 20), (48, 9, 28)]):
        ids, settings = random_prompt(T, k), GenerationSettings(block=16, max_new_tokens=new)
        jobs.append(Job(ids, ROW_POLICIES[name](budget), settings, observer=Observer(trace=True)))
        alone.append(generate_slots(model, ROW_POLICIES[name](budget), ids, settings, observer=Observer(trace=True)))
    for row, run in zip(slotbatch.generate_rows(model, jobs), alone, strict=True):
        assert row.tokens == run.tokens
        want = _states(run.trace)
        assert _states(row.trace)[:len(want)] == want  # the batch records one round more (after the last token)


def test_graded_branch_leaves_the_greedy_run_alone() -> None:
    model = _model()
    ids = random_prompt(60, 2)
    settings = GenerationSettings(block=16, max_new_tokens=5)
    alone = generate_slots(model, KeyDiff(budget=24), ids, settings)
    graded = generate_slots(model, KeyDiff(budget=24), ids, settings, answer_ids=[10, 11, 12])
    assert graded.tokens == alone.tokens and graded.answer_logprob is not None
    old = generate(_model(slots=False), KeyDiff(budget=24), ids, settings, answer_ids=[10, 11, 12])
    assert graded.answer_logprob == pytest.approx(old.answer_logprob, abs=1e-9)


# -- compiled == eager -----------------------------------------------------------------------------------------------
def test_compiled_equals_eager_in_three_graphs() -> None:
    """One graph per forward shape: the blocks, the last partial block, a decoding step; no graph break."""
    from torch._dynamo.utils import counters

    model = _model(dtype=torch.float32)
    ids = random_prompt(70, 3)
    settings = GenerationSettings(block=16, max_new_tokens=6)
    eager = generate_slots(model, SnapKV(budget=24, window=4, kernel=3), ids, settings)
    torch._dynamo.reset()
    counters.clear()
    compiled = generate_slots(model, SnapKV(budget=24, window=4, kernel=3), ids, settings, compiled=True)
    assert compiled.tokens == eager.tokens
    assert counters["stats"]["unique_graphs"] == 3
    assert not counters["graph_break"]


# -- launches: aten ops per forward against HF's own ------------------------------------------------------------------
class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_ops_per_step_near_hf() -> None:
    """A decoding step (its eviction included) of a 28-layer model runs at most 1.10x the aten ops of HF's own
    decoding step over a DynamicCache (StreamingLLM, K-norm, KeyDiff; SnapKV within 1.25x)."""
    model, _ = build_tiny_model("tiny-llama", output_scale=1.0, num_hidden_layers=28)
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([random_prompt(200, 4)])
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :199], past_key_values=cache, use_cache=True)
        with _Ops() as hf:
            model(input_ids=ids[:, 199:], past_key_values=cache, use_cache=True, logits_to_keep=1)
        install(model)
        for policy, bound in ((StreamingLLM(budget=64), 1.10), (KNorm(budget=64), 1.10), (KeyDiff(budget=64), 1.10),
                              (SnapKV(budget=64), 1.25)):
            run = SlotRun(model, policy, 200, GenerationSettings(block=128, max_new_tokens=2), new=2)
            for start in (0, 128):
                end = min(200, start + 128)
                run.step(ids[:, start:end], torch.arange(start, end)[None], run.counts(end))
            with _Ops() as ours:
                run.step(ids[:, :1], torch.tensor([[200]]), run.counts(201))
            ratio = sum(ours.count.values()) / sum(hf.count.values())
            assert ratio <= bound, (policy.name, ratio)


def test_slot_cache_has_no_host_sync_in_a_step() -> None:
    """No `.item()`/`.tolist()` inside a step: the step's ops never read a tensor back (aten's _local_scalar_dense)."""
    model = _model(dtype=torch.float32)
    run = SlotRun(model, KeyDiff(budget=24), 40, GenerationSettings(block=16, max_new_tokens=2), new=2)
    ids = torch.tensor([random_prompt(40, 5)])
    with torch.inference_mode(), _Ops() as ops:
        for start in (0, 16, 32):
            end = min(40, start + 16)
            run.step(ids[:, start:end], torch.arange(start, end)[None], run.counts(end))
    assert "aten._local_scalar_dense.default" not in ops.count
    assert isinstance(run.cache, SlotCache)


@pytest.mark.parametrize("name", ["adakv_kvpress", "criticalkv_adakv", "sagekv_derived"])
def test_per_head_policies_read_nothing_back(name: str) -> None:
    """The per-head policies' scores and counts (allocation, stage 2, SAGE-KV's selection and slide) in eager steps,
    prompt blocks and a decoding step: no `_local_scalar_dense`."""
    model = _model(dtype=torch.float32)
    run = SlotRun(model, POLICIES[name](), 40, GenerationSettings(block=16, max_new_tokens=2), new=2)
    ids = torch.tensor([random_prompt(40, 5)])
    with torch.inference_mode(), _Ops() as ops:
        for start in (0, 16, 32):
            end = min(40, start + 16)
            run.step(ids[:, start:end], torch.arange(start, end)[None], run.counts(end))
        run.cache.decoding = True
        run.step(ids[:, :1], torch.tensor([[40]]), run.counts(41))
    assert "aten._local_scalar_dense.default" not in ops.count
