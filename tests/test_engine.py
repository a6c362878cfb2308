"""The engine's invariants (kvbench/engine/cache.py, generate.py): block prefill equals one forward; a block writes into
free slots and an eviction marks slots free; the logits equal an explicit float64 reference attending to exactly the
positions each head held, with uniform, per-layer and per-head budgets; the cache stays within its bounds; batch rows
keep what their runs alone keep; compiled equals eager in two graphs; a step's aten ops stay near HF's own forward and
read nothing back to the host; canaries for what the engine relies on in transformers."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

import kvbench.engine.cache as cache_module
from kvbench.bench.setup import all_policies, make_policy
from kvbench.engine.cache import install
from kvbench.engine.generate import Batch, GenerationSettings, Job, Observer, capacity, generate, generate_batch, plan
from kvbench.models.tiny import build_tiny_model
from kvbench.policies.adakv import AdaKV
from kvbench.policies.base import Policy, SlotView, rank_mask
from kvbench.policies.criticalkv import CriticalKV
from kvbench.policies.full import Full
from kvbench.policies.h2o import H2O
from kvbench.policies.hashevict import HashEvict
from kvbench.policies.keydiff import KeyDiff
from kvbench.policies.knorm import KNorm
from kvbench.policies.pyramidkv import PyramidKV
from kvbench.policies.random import Random
from kvbench.policies.sagekv import SageKV
from kvbench.policies.snapkv import SnapKV
from kvbench.policies.streamingllm import StreamingLLM
from kvbench.policies.tova import TOVA

from float64_reference import reference_logits
from helpers import held_counts, random_prompt

ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-phi3", "tiny-gemma"]
POLICIES: dict[str, Callable[[], Policy]] = {
    "streamingllm": lambda: StreamingLLM(budget=24),
    "random": lambda: Random(budget=24),
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


def _model(arch: str = "tiny-llama", dtype: torch.dtype = torch.float64, **kw: Any) -> Any:
    # Output scale 1: logits of order 1, the scale the 1e-5 tolerances refer to.
    model, _ = build_tiny_model(arch, output_scale=1.0, **kw)
    install(model)
    return model.to(dtype)


# 1. No eviction: block prefill equals one full forward -------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_block_prefill_equals_full_forward(arch: str) -> None:
    """Every prompt position's next-token log-probability (the LM score) through blocks of 1, 7 and 128 tokens and a
    budget above the prompt equals one plain forward's, sliding-window layers (gemma) included."""
    model = _model(arch, dtype=torch.float32)
    ids = random_prompt(150, 0)
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)  # (T - 1, vocab)
    want = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    for block in (1, 7, 128):
        res = generate(model, StreamingLLM(budget=400), ids, GenerationSettings(block=block, score_from=0))
        assert (torch.tensor(res.lm_logprobs) - want).abs().max().item() < 1e-5, (arch, block)


def test_softcap_model_attends_explicitly_and_equals_hf() -> None:
    """A Gemma-2-shaped model (attention logit softcap 5.0, which sdpa lacks, and sliding layers of window 24) attends
    explicitly in every layer: the LM score through blocks of 7 and 32 and one forward, StreamingLLM and H2O (which
    reads the attention), equals HF's eager forward of the whole prompt in float64 (scores stored as float32)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
                       attn_logit_softcapping=5.0, final_logit_softcapping=None, max_position_embeddings=512)
    cfg._attn_implementation = "eager"
    model = Gemma2ForCausalLM(cfg).double().eval()
    # larger query and key weights, so the attention logits reach where the cap bends them (at the random init's scale
    # the cap changes almost nothing: a layer attending through sdpa, without it, passed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
            layer.self_attn.k_proj.weight.mul_(30.0)
    ids = random_prompt(100, 5)
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], dim=-1)
    want = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    install(model)
    for policy in (StreamingLLM(budget=400), H2O(budget=400)):
        for block in (7, 32, None):
            res = generate(model, policy, ids, GenerationSettings(block=block, score_from=0))
            assert (torch.tensor(res.lm_logprobs, dtype=torch.float64) - want).abs().max().item() < 1e-6, block


def test_budget_at_least_prompt_evicts_nothing() -> None:
    model = _model(dtype=torch.float32)
    ids = random_prompt(200, 1)
    full = generate(model, Full(), ids, GenerationSettings(block=None, max_new_tokens=12))
    for policy in (KeyDiff(budget=400), StreamingLLM(budget=400), TOVA(budget=400), H2O(budget=400),
                   SnapKV(budget=400), KNorm(budget=400, skip_layers=[]), Random(budget=400)):
        res = generate(model, policy, ids, GenerationSettings(block=32, max_new_tokens=12))
        assert res.tokens == full.tokens, policy.name
        assert res.peak_kv_tokens == 200 + 11  # prompt + fed-back generated tokens, nothing dropped


# 2. The layout, by hand --------------------------------------------------------------------------------------------
def test_capacity_is_the_most_held_during_a_forward() -> None:
    settings = GenerationSettings(block=16, max_new_tokens=5)
    chunks = plan(70, settings, StreamingLLM(budget=24))
    assert [(a, b) for a, b, _ in chunks] == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 70)]
    assert capacity(chunks, 24, 5, evicts_decoding=True) == 24 + 16  # N + B
    assert capacity(chunks, 24, 20, evicts_decoding=False) == 24 + 20  # N after the prompt, then growing
    one = plan(70, GenerationSettings(block=None, max_new_tokens=5), StreamingLLM(budget=24))
    assert one == [(0, 70, True)] and capacity(one, 24, 5, evicts_decoding=True) == 70
    # in a batch whose rounds are 16 wide, a 13-token last block is padded to 16: 24 held + 16 during that forward
    tail = plan(61, settings, StreamingLLM(budget=24))
    assert capacity(tail, 24, 5, True) == 40 and capacity(tail, 24, 5, True, widths=[16] * 5) == 40
    assert capacity(tail, 24, 5, True, widths=[16] * 4 + [20]) == 24 + 20


def test_a_block_writes_into_free_slots_and_eviction_marks_slots_free() -> None:
    """StreamingLLM, N = 6 (2 sinks), B = 4, one layer, 12 tokens: worked out slot by slot."""
    model = _model(num_hidden_layers=1)
    ids = random_prompt(12, 0)
    batch = Batch(model, [Job(ids, StreamingLLM(budget=6, n_sink=2), GenerationSettings(block=4))])
    pos = batch.cache.evicting.pos  # (1, 1, h_kv, 10): N + B slots
    assert pos.shape[-1] == 10 and bool((pos == -1).all())
    with torch.inference_mode():
        for start in (0, 4):
            batch.step([(start, start + 4)], [ids[start:start + 4]], [True], "prefill")
        # 8 held in slots 0-7 in order; the eviction kept sinks 0, 1 and positions 4-7, freed slots 2, 3
        assert pos[0, 0, 0].tolist() == [0, 1, -1, -1, 4, 5, 6, 7, -1, -1]
        batch.step([(8, 12)], [ids[8:12]], [True], "prefill")
    # positions 8-11 went into the first free slots 2, 3, 8, 9; then 4-7 were freed
    assert pos[0, 0, 0].tolist() == [0, 1, 8, 9, -1, -1, -1, -1, 10, 11]
    assert bool((pos[0, 0] == pos[0, 0, :1]).all())  # every head alike (StreamingLLM ranks by position)


@pytest.mark.parametrize("arch,policy", [("tiny-llama", "streamingllm"), ("tiny-llama", "h2o"),
                                         ("tiny-mistral", "streamingllm"), ("tiny-mistral", "h2o")])
def test_first_forward_is_causal_over_its_own_slots(arch: str, policy: str) -> None:
    """An empty cache's unpadded first forward (`Batch.step` says so) builds no (t, S) mask and attends causally over
    slots 0..t-1: the same logits and H2O's received attention as the masked path over all S slots, in float64,
    through sdpa, explicit attention and a sliding-window layer (mistral, window 16 < t = 40)."""
    from kvbench.engine.cache import SlotCache, forward

    model = _model(arch, sliding_window=16) if arch == "tiny-mistral" else _model(arch)
    ids = torch.tensor([random_prompt(40, 4)])
    out = {}
    with torch.inference_mode():
        for causal in (True, False):
            cache = SlotCache(model, POLICIES[policy](), 1, 64, 64)
            logits = forward(model, cache, ids, torch.arange(40)[None], keep=40, causal=causal)
            g = cache.evicting
            assert (g.visible == ()) == causal and g.pos[..., :40].eq(torch.arange(40)).all()
            out[causal] = logits, {k: v.clone() for k, v in g.state.items()}
    assert (out[True][0] - out[False][0]).abs().max().item() < 1e-12
    for name, state in out[False][1].items():  # H2O: every slot's received attention, the 24 free ones 0
        assert (out[True][1][name] - state).abs().max().item() < 1e-12 and state[..., 40:].eq(0).all()
    batch = Batch(model, [Job(ids[0].tolist(), StreamingLLM(budget=24), GenerationSettings(block=16))])
    with torch.inference_mode():
        batch.step([(0, 16)], [ids[0, :16].tolist()], [True], "prefill")
        assert batch.cache.causal
        batch.step([(16, 32)], [ids[0, 16:32].tolist()], [True], "prefill")
        assert not batch.cache.causal


def test_per_layer_budgets_keep_each_layers_own() -> None:
    """PyramidKV on 4 layers, N = 24, window 4, beta 20 (F = 20: the deepest layer 1, the first 39, the mirror pairs
    summing to 40; kvbench.policies.pyramidkv): after a 100-token prompt each layer holds its own N_l = 4 + F_l."""
    model = _model(num_hidden_layers=4)
    policy = PyramidKV(budget=24, window=4, kernel=3)
    res = generate(model, policy, random_prompt(100, 2), GenerationSettings(block=16, max_new_tokens=2),
                   observer=Observer(trace=True))
    # F_l = 39 - l * 38 / 3 rounded half to even: 39, 26.33 -> 26, 13.67 -> 14, 1
    assert held_counts(res.trace[-1]) == [4 + 39, 4 + 26, 4 + 14, 4 + 1]


def test_each_layer_uses_only_its_first_slots() -> None:
    """PyramidKV as above, B = 16, 3 new tokens: layer l's key and value views are its first max N_l + B slots (its
    largest budget over the run and a block: 43 + 16, 30 + 16, then N = 24 + 16 for layers 2 and 3, whose budget is N
    while fewer than 2F = 40 tokens were seen), and no head ever holds a token beyond them (it writes into its first
    free slots and never holds more than that), so its attention never reads the slots of a fuller layer."""
    model = _model(num_hidden_layers=4)
    ids = random_prompt(100, 2)
    settings = GenerationSettings(block=16, max_new_tokens=3)
    batch = Batch(model, [Job(ids, PyramidKV(budget=24, window=4, kernel=3), settings)])
    assert [k.shape[2] for k in batch.cache.evicting.k_rows] == [59, 46, 40, 40]
    assert [v.shape[2] for v in batch.cache.evicting.v_rows] == [59, 46, 40, 40]
    res = generate(model, PyramidKV(budget=24, window=4, kernel=3), ids, settings, observer=Observer(trace=True))
    for step in res.trace:
        for pos, limit in zip(step, [59, 46, 40, 40]):
            assert bool((pos[..., limit:] == -1).all())


def test_query_ring_holds_position_p_in_slot_p_mod_w() -> None:
    """SnapKV, window 4, blocks of 4 over 10 tokens: the last forward (8, 9) writes ring slots 0 and 1, the one before
    left 6 and 7 in slots 2 and 3; a padded row leaves its ring as it was (its padding goes to the spare slot 4)."""
    model = _model(num_hidden_layers=1)
    ids = random_prompt(10, 0)
    jobs = [Job(ids, SnapKV(budget=64, window=4, kernel=3), GenerationSettings(block=4)),
            Job(ids[:6], SnapKV(budget=64, window=4, kernel=3), GenerationSettings(block=4))]
    batch = Batch(model, jobs)
    with torch.inference_mode():
        batch.step([(0, 4), (0, 4)], [ids[:4], ids[:4]], [True, True], "prefill")
        batch.step([(4, 8), (4, 6)], [ids[4:8], ids[4:6]], [True, True], "prefill")  # row 1: 2 tokens, 2 padding
        assert batch.cache.view.qpos.tolist() == [[4, 5, 6, 7], [4, 5, 2, 3]]
        batch.step([(8, 10), None], [ids[8:10], []], [True, False], "prefill")
        assert batch.cache.view.qpos.tolist() == [[8, 9, 6, 7], [4, 5, 2, 3]]


@pytest.mark.parametrize("name,chunk", [("snapkv", None), ("tova", None), ("adakv", None), ("snapkv", 1)])
def test_stored_window_rows_equal_their_recomputation(name: str, chunk: int | None, monkeypatch: Any) -> None:
    """The attention rows the cache keeps for the latest queries (each computed once, when its query entered, then
    renormalised over the slots still held) equal the attention recomputed from the stored queries and the slots held
    now, at every eviction of a batch of two runs of different lengths (the shorter padded): prompt blocks and
    decoding steps; `mean_attention` is their mean. `chunk` 1: the rows computed a layer at a time (`CHUNK_BYTES`)."""
    if chunk is not None:
        monkeypatch.setattr(cache_module, "CHUNK_BYTES", chunk)
    model = _model(num_hidden_layers=2)
    jobs = [Job(random_prompt(n, n), POLICIES[name](), GenerationSettings(block=16, max_new_tokens=6))
            for n in (70, 57)]
    checked = []
    policy = jobs[0].policy
    score = policy.score

    def compare(view: SlotView) -> torch.Tensor:
        again = dataclasses.replace(view, probs=None)  # recomputed from the queries
        assert view.probs is not None
        assert (view.attention() - again.attention()).abs().max().item() < 1e-5
        assert (view.mean_attention() - again.attention().mean(dim=-2)).abs().max().item() < 1e-5
        checked.append(view.decoding)
        return score(view)

    monkeypatch.setattr(policy, "score", compare)
    generate_batch(model, jobs)
    assert False in checked and True in checked  # prompt blocks and decoding steps


def test_rank_mask_with_a_bound_equals_the_sorted_ranking() -> None:
    """A top-k bounded by `most` selects what the full ranking does, ties to the earlier position included (integer
    scores tie often), for counts that differ per row."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (6, 3, 40), generator=gen).float()
    scores[0, 0, :7] = -math.inf
    positions = torch.stack([torch.randperm(40, generator=gen) for _ in range(18)]).view(6, 3, 40)
    counts = torch.randint(0, 12, (6, 3), generator=gen)
    want = rank_mask(scores, counts, positions)
    assert torch.equal(rank_mask(scores, counts, positions, most=12), want)
    assert torch.equal(rank_mask(scores, 5, positions, most=5), rank_mask(scores, 5, positions))
    assert want.sum().item() == counts.sum().item() - (counts[0, 0] - min(int(counts[0, 0]), 33)).item()


# 3. With eviction: the explicit float64 re-implementation driven by the logged positions ---------------------------
def _match_reference(make: Callable[[], Policy], T: int, new: int, protocol: str = "blockwise") -> Any:
    model = _model()
    ids = random_prompt(T, 0)
    logged: list[torch.Tensor] = []
    res = generate(model, make(), ids, GenerationSettings(block=16, max_new_tokens=new, protocol=protocol),
                   observer=Observer(trace=True, on_logits=lambda lg: logged.append(lg[0])))
    prompt = [ids[s:s + 16] for s in range(0, T, 16)] if protocol == "blockwise" else [ids]
    chunks = prompt + [[t] for t in res.tokens[:-1]]
    assert len(res.trace) == len(chunks)
    ref = reference_logits(model, chunks, res.trace)
    first = len(chunks) - len(res.tokens)  # logged[0] comes from the last prompt block, each later from a step
    for got, want in zip(logged, [ref[first]] + ref[first + 1:], strict=True):
        assert (got.double() - want).abs().max().item() < 1e-5
    return res


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_eviction_matches_float64_reference(name: str) -> None:
    """Blocks of 16 over a 70-token prompt, 6 greedy steps: every logit the run saw equals the float64 reference, and
    the run really evicted (some layer held fewer tokens than it had seen)."""
    res = _match_reference(POLICIES[name], 70, 6)
    assert min(int((t >= 0).sum(dim=-1).max()) for t in res.trace[-1]) < 70 + 5


@pytest.mark.parametrize("protocol", ["prefill_once", "prefill_once_decode_evict"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_one_pass_protocols_match_float64_reference(name: str, protocol: str) -> None:
    """The 70-token prompt in one forward and one eviction, then 6 steps (the cache growing, or evicting every step)
    over the slots cut to what decoding needs (`SlotCache.shrink`): every logit equals the float64 reference."""
    _match_reference(POLICIES[name], 70, 6, protocol)


def test_a_one_pass_prompt_leaves_decoding_the_slots_it_needs() -> None:
    """SnapKV, N = 24, a 70-token prompt in one forward: that forward needs 70 slots a head; decoding then has what a
    head keeps plus its own tokens, N + 6 = 30 slots growing by 6 tokens (prefill_once), N + 1 = 25 evicting every step
    (prefill_once_decode_evict), each head's 24 kept tokens moved to its first slots."""
    model, ids = _model(), random_prompt(70, 0)
    for protocol, slots in (("prefill_once", 30), ("prefill_once_decode_evict", 25)):
        res = generate(model, SnapKV(budget=24, window=4, kernel=3), ids,
                       GenerationSettings(block=16, max_new_tokens=6, protocol=protocol), observer=Observer(trace=True))
        assert {p.shape[-1] for p in res.trace[0]} == {70}
        assert {p.shape[-1] for p in res.trace[1]} == {slots}
        assert all(bool((p[..., :24] >= 0).all()) and bool((p[..., 24:] < 0).all()) for p in res.trace[1])


@pytest.mark.parametrize("name", ["adakv", "criticalkv_adakv", "sagekv"])
def test_per_head_prompt_within_budget_then_decoding(name: str) -> None:
    """A 20-token prompt (within N = 24), 12 steps: AdaKV's layers stay under h_kv * N for the first steps, SAGE-KV
    makes its one selection at the first decoding eviction over budget, then slides."""
    _match_reference(POLICIES[name], 20, 12)


# 4. The cache never exceeds N + B, and is cut back to N after every forward ----------------------------------------
@pytest.mark.parametrize("name", ["keydiff", "streamingllm", "tova", "h2o", "snapkv", "random", "hashevict"])
def test_cache_bounded(name: str) -> None:
    model = _model(dtype=torch.float32)
    policy = {**POLICIES, "knorm": lambda: KNorm(budget=24, skip_layers=[])}[name]()
    res = generate(model, policy, random_prompt(300, 3), GenerationSettings(block=16, max_new_tokens=10),
                   observer=Observer(trace=True))
    for step in res.trace[1:]:  # before every forward after the first: at most N held
        assert all(n <= 24 for n in held_counts(step))
        assert all(pos.shape[-1] == 24 + 16 for pos in step)  # N + B slots, never more
    assert res.peak_kv_tokens == 24 + 16
    bytes_per_token = 2 * 2 * 64 * 4 * 2  # K+V x 2 kv heads x head_dim 64 x fp32 x 2 layers
    assert res.kv_bytes_peak == (24 + 16) * bytes_per_token


def test_knorm_default_skips_layers_0_and_1_and_bounds_the_rest() -> None:
    # K-norm's default leaves layers 0 and 1 uncompressed; on a 2-layer model it would evict nothing, so use 4.
    model = _model(dtype=torch.float32, num_hidden_layers=4)
    res = generate(model, KNorm(budget=40), random_prompt(100, 4), GenerationSettings(block=16, max_new_tokens=5),
                   observer=Observer(trace=True))
    assert len(res.trace) == 7 + 4  # 7 prompt blocks (100 = 6 x 16 + 4), then 4 one-token decoding steps
    for k, step in enumerate(res.trace[1:], 1):  # before forward k: the tokens seen so far, or N after eviction
        seen = min(16 * k, 100) + max(0, k - 7)
        assert held_counts(step) == [seen, seen, min(seen, 40), min(seen, 40)]
    assert res.peak_kv_tokens == 100 + 4  # the uncompressed layers hold the whole prompt plus 4 fed-back tokens


def test_block_null_is_one_forward_then_one_eviction() -> None:
    model = _model(dtype=torch.float32)
    res = generate(model, KeyDiff(budget=40), random_prompt(300, 5), GenerationSettings(block=None, max_new_tokens=3),
                   observer=Observer(trace=True))
    assert len(res.trace) == 1 + 2  # prompt forward + two decoding steps
    assert res.peak_kv_tokens == 300
    assert held_counts(res.trace[1]) == [40, 40]


# 5. AdaKV's head cap: the static bound of a per-head allocation ----------------------------------------------------
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
    assert policy.allocation_counts(scores, budgets).tolist() == [[[8, 2, 2]]]
    assert policy.counts(None, scores, budgets).tolist() == [[[6, 2, 2]]]  # type: ignore[arg-type]
    under = scores.clone()
    under[..., 1, 2:] = -inf  # head 1 holds 2 (free slots -inf)
    under[..., 2, 2:] = -inf
    under[..., 0, 7:] = -inf  # head 0 holds 7: 11 in all, not over 12
    assert policy.allocation_counts(under, budgets).tolist() == [[[7, 2, 2]]]
    assert policy.counts(None, under, budgets).tolist() == [[[6, 2, 2]]]  # type: ignore[arg-type]


class _CapCount(AdaKV):
    """AdaKV that counts, per eviction, the heads whose allocation the cap clamped (a host read: eager tests only)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.binds: list[int] = []

    def counts(self, view: SlotView, ranked: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        kept = super().counts(view, ranked, counts)
        self.binds.append(int((kept < self.allocation_counts(ranked, counts)).sum()))
        return kept


@pytest.mark.parametrize("allocation", ["kvpress", "adakv"])
def test_adakv_head_cap_on_a_small_run(allocation: str) -> None:
    """70 tokens, blocks of 16, 6 steps: with 2 KV heads the default cap (2N = h_kv * N) never binds; at head_cap 1.0
    (every head at most N) it binds in some evictions, and every head holds at most N after each."""
    model = _model()
    ids = random_prompt(70, 0)
    settings = GenerationSettings(block=16, max_new_tokens=6)
    default = _CapCount(budget=24, window=4, kernel=3, allocation=allocation)
    generate(model, default, ids, settings)
    assert len(default.binds) == 5 + 5 and sum(default.binds) == 0  # 5 blocks, 5 decoding evictions
    tight = _CapCount(budget=24, window=4, kernel=3, allocation=allocation, head_cap=1.0)
    res = generate(model, tight, ids, settings, observer=Observer(trace=True))
    assert sum(b > 0 for b in tight.binds) > 0
    for step in res.trace[1:]:  # before each forward: what the eviction before it left
        assert all(n <= 24 for n in held_counts(step))


# 6. Batch rows: each keeps what its run alone keeps ------------------------------------------------------------------
ROW_POLICIES: dict[str, Callable[[int], Policy]] = {
    "keydiff": lambda n: KeyDiff(budget=n),
    "snapkv": lambda n: SnapKV(budget=n, window=4, kernel=3),
    "hashevict": lambda n: HashEvict(budget=n),
    "adakv": lambda n: AdaKV(budget=n, window=4, kernel=3),
    "criticalkv": lambda n: CriticalKV(budget=n, window=4, kernel=3),
    "criticalkv_adakv": lambda n: CriticalKV(base="adakv", allocation="kvpress", budget=n, window=4, kernel=3),
    "sagekv": lambda n: SageKV(budget=n, sink=2, k=4, recent=8),
    "sagekv_derived": lambda n: SageKV(budget=n),  # sizes from each row's own budget
}


def _states(trace: list[list[torch.Tensor | None]]) -> list[list[list[int]]]:
    """Each head's held positions per forward, consecutive repeats (a batch row's idle rounds) dropped."""
    out: list[list[list[int]]] = []
    for step in trace:
        held = [sorted(p for p in t[0, h].tolist() if p >= 0) for t in step if t is not None for h in range(t.shape[1])]
        if not out or out[-1] != held:
            out.append(held)
    return out


@pytest.mark.parametrize("name", sorted(ROW_POLICIES))
def test_rows_with_their_own_budgets_keep_what_their_runs_alone_keep(name: str) -> None:
    """Three runs as the rows of one cache, budgets 24, 20 and 28, prompts of 70 (a 6-token last block, padded in the
    batch's rounds), 16 (within its budget: SAGE-KV selects while decoding) and 45 tokens, 6-12 steps, float64: each
    row holds what its run alone holds, forward by forward, and decodes the same tokens."""
    model = _model()
    jobs, alone = [], []
    for k, (T, new, budget) in enumerate([(70, 6, 24), (16, 12, 20), (45, 9, 28)]):
        ids, settings = random_prompt(T, k), GenerationSettings(block=16, max_new_tokens=new)
        jobs.append(Job(ids, ROW_POLICIES[name](budget), settings, observer=Observer(trace=True)))
        alone.append(generate(model, ROW_POLICIES[name](budget), ids, settings, observer=Observer(trace=True)))
    for row, run in zip(generate_batch(model, jobs), alone, strict=True):
        assert row.tokens == run.tokens and row.batch_size == 3
        want = _states(run.trace)
        assert _states(row.trace)[:len(want)] == want


def test_graded_branch_leaves_the_greedy_run_alone() -> None:
    """The graded score teacher-forces the answer through a fork: the greedy tokens are those of the run without it,
    and the score is the mean of the log-probabilities the answer's tokens get when forced in the same loop."""
    model = _model()
    ids, answer = random_prompt(60, 2), [10, 11, 12]
    settings = GenerationSettings(block=16, max_new_tokens=5)
    alone = generate(model, KeyDiff(budget=24), ids, settings)
    graded = generate(model, KeyDiff(budget=24), ids, settings, answer_ids=answer)
    assert graded.tokens == alone.tokens
    logps: list[float] = []
    forced = GenerationSettings(block=16, max_new_tokens=len(answer))
    generate(model, KeyDiff(budget=24), ids, forced, forced=answer, observer=Observer(
        on_logits=lambda lg: logps.append(float(torch.log_softmax(lg[0], dim=-1)[answer[len(logps)]]))))
    assert graded.answer_logprob == pytest.approx(sum(logps) / len(logps), abs=1e-6)  # a float32 mean


# 7. Compiled equals eager ------------------------------------------------------------------------------------------
def _compile_with(monkeypatch: Any, backend: str = "eager") -> Any:
    """A fresh dynamo (no graphs, its counters cleared) whose torch.compile uses `backend`, and the engine's compiled
    forwards made anew through it; returns dynamo's counters. (`eager`: dynamo's graphs run as they are, no inductor
    compile.)"""
    import functools

    from torch._dynamo.utils import counters

    from kvbench.engine import generate as engine

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(engine, "_compiled", {})
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    return counters


def test_compiled_equals_eager_in_three_graphs() -> None:
    """One graph for the first block (an empty cache: causal attention over its own slots), one for the other blocks
    (the last partial one padded to B) and one for a decoding step, reused by the next sample (another length): no
    graph break, no recompilation; the same tokens as eager."""
    from torch._dynamo.utils import counters

    model = _model(dtype=torch.float32)
    torch._dynamo.reset()
    counters.clear()
    for T in (70, 61):
        ids = random_prompt(T, 3)
        eager = generate(model, SnapKV(budget=24, window=4, kernel=3), ids, GenerationSettings(block=16,
                                                                                           max_new_tokens=6))
        compiled = generate(model, SnapKV(budget=24, window=4, kernel=3), ids,
                            GenerationSettings(block=16, max_new_tokens=6, compile=True))
        assert compiled.tokens == eager.tokens
    assert counters["stats"]["unique_graphs"] == 3
    assert not counters["graph_break"]


def test_a_compiled_one_pass_prompt_runs_eagerly(monkeypatch: Any) -> None:
    """Under prefill_once a sample's prompt is one forward: compiled, only its decoding step is a graph (the prompt's
    would be compiled again for every prompt length, to run once); the same tokens as eager. (Dynamo with its eager
    backend.)"""
    counters = _compile_with(monkeypatch)
    model, ids = _model(dtype=torch.float32), random_prompt(140, 3)
    runs = [generate(model, SnapKV(budget=48, window=4, kernel=3), ids,
                     GenerationSettings(block=16, max_new_tokens=6, protocol="prefill_once", compile=c)).tokens
            for c in (False, True)]
    assert runs[0] == runs[1]
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_compiled_runs_of_many_policies_in_one_process(monkeypatch: Any) -> None:
    """Four policies' compiled runs in one process, 3 graphs each of the one compiled function: past dynamo's default
    of 8 graphs a function, which with fullgraph would raise; the same tokens as eager. (Dynamo with its eager
    backend: the graphs and guards are dynamo's, no inductor compile here.)"""
    _compile_with(monkeypatch)
    model, ids = _model(dtype=torch.float32), random_prompt(70, 3)
    with torch._dynamo.config.patch(recompile_limit=8):  # dynamo's default, whatever an earlier test left
        for make in (lambda: StreamingLLM(budget=24, n_sink=2), lambda: KeyDiff(budget=24),
                     lambda: SnapKV(budget=24, window=4, kernel=3), lambda: H2O(budget=24)):
            eager = generate(model, make(), ids, GenerationSettings(block=16, max_new_tokens=4))
            assert generate(model, make(), ids, GenerationSettings(block=16, max_new_tokens=4, compile=True)).tokens \
                == eager.tokens
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", all_policies())
def test_every_policy_compiles_into_three_graphs_equal_to_eager(name: str, backend: str, monkeypatch: Any) -> None:
    """Every policy of conf/policy/ compiled: three graphs in a run and the next sample's (another length), no graph
    break, the tokens of eager. HashEvict's projections are drawn when the cache is built (a graph cannot create their
    generator); Random draws from its generator, which a graph cannot trace: its evictions run eagerly after each
    compiled forward, and its tokens are not eager's (it draws per slot, and a compiled run's slots are others: its
    last block padded, its slots rounded up). `eager`: dynamo's graphs run as they are; `inductor` (slow: ~20 s a
    policy on two cores) compiles them as torch.compile does by default."""
    counters = _compile_with(monkeypatch, backend)
    model = _model(dtype=torch.float32)
    for T in (140, 121):
        ids = random_prompt(T, 3)
        runs = []
        for compile in (False, True):
            policy = make_policy(name, 48, 0)
            policy.start_sample(T)  # as the run loop does (Random: the sample's generator)
            runs.append(generate(model, policy, ids, GenerationSettings(block=16, max_new_tokens=8,
                                                                        compile=compile)).tokens)
        assert runs[0] == runs[1] or policy.sample_state
    assert counters["stats"]["unique_graphs"] == 3
    assert not counters["graph_break"]
    torch._dynamo.reset()


def test_every_cache_tensor_a_compiled_forward_takes_is_a_static_address(monkeypatch: Any) -> None:
    """On CUDA a compiled forward replays as a CUDA graph only if every input it writes in place is a static address
    (CUDA graph trees skip a graph with another mutated input): every tensor the graph takes from the cache (slots,
    positions, state, the ring and its rows, the peaks, the graded branch's fork) is one; the per-forward inputs (ids,
    positions, counts) are copied in. Captured from dynamo's graphs (an eager backend: no inductor compile here)."""
    from kvbench.engine import generate as engine

    taken: dict[str, bool] = {}

    def capture(gm: Any, example_inputs: list[Any]) -> Any:
        for node in gm.graph.find_nodes(op="placeholder"):
            arg = node.meta["grapharg"]
            if isinstance(arg.example, torch.Tensor):
                static = getattr(arg.example, "_dynamo_static_input_type", None) is not None
                taken[arg.source.name] = taken.get(arg.source.name, True) and static  # static in every graph
        return gm.forward

    torch._dynamo.reset()
    monkeypatch.setattr(engine, "_compiled", {"cpu": torch.compile(engine.forward, backend=capture, fullgraph=True,
                                                                   dynamic=False)})
    model, ids = _model(dtype=torch.float32), random_prompt(70, 3)
    # first a one-pass prompt with no graded branch, after which the cache's buffers are new (`SlotCache.shrink`): its
    # decoding graph takes them (the later runs' steps reuse it: the same shapes)
    for policy, protocol, answer in ((SnapKV(budget=24, window=4, kernel=3), "prefill_once", None),
                                     (SnapKV(budget=24, window=4, kernel=3), "blockwise", [5, 6]),
                                     (H2O(budget=24), "blockwise", [5, 6])):
        generate(model, policy, ids, GenerationSettings(block=16, max_new_tokens=4, protocol=protocol, compile=True),
                 answer_ids=answer)
    torch._dynamo.reset()
    cache = {name for name in taken if name.startswith("L['cache']")}
    assert {"L['cache'].seen", "L['cache'].peak", "L['cache'].view.probs"} <= cache
    assert {name for name in cache if not taken[name]} == set()
    assert {name for name in taken if not taken[name]} == {"L['ids']", "L['positions']", "L['counts']"}


# 8. Launches: aten ops per forward against HF's own --------------------------------------------------------------------
class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_ops_per_step_near_hf() -> None:
    """A decoding step (its eviction included) of a 28-layer model runs at most 1.10x the aten ops of HF's own
    decoding step over a DynamicCache (StreamingLLM, K-norm, KeyDiff; SnapKV and H2O, whose attention is explicit,
    within 1.25x), and reads nothing back to the host (no aten._local_scalar_dense)."""
    model, _ = build_tiny_model("tiny-llama", output_scale=1.0, num_hidden_layers=28)
    ids = random_prompt(200, 4)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ids[:199]]), past_key_values=cache, use_cache=True)
        with _Ops() as hf:
            model(input_ids=torch.tensor([ids[199:]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        for policy, bound in ((StreamingLLM(budget=64), 1.10), (KNorm(budget=64), 1.10), (KeyDiff(budget=64), 1.10),
                              (SnapKV(budget=64), 1.25), (H2O(budget=64), 1.25)):
            batch = Batch(model, [Job(ids, policy, GenerationSettings(block=128, max_new_tokens=2))])
            for start in (0, 128):
                end = min(200, start + 128)
                batch.step([(start, end)], [ids[start:end]], [True], "prefill")
            with _Ops() as ours:
                batch.step([(200, 201)], [[ids[0]]], [True], "decode")
            ratio = sum(ours.count.values()) / sum(hf.count.values())
            assert ratio <= bound, (policy.name, ratio)
            assert "aten._local_scalar_dense.default" not in ours.count


def test_a_decoding_step_reads_in_at_most_25_functions_in_4_files() -> None:
    """Issue 62's reading goal, for every policy in conf/policy/ at its defaults: one steady decoding step (the
    forward and its eviction) calls at most 25 distinct kvbench functions in at most 4 files (`kvbench-bench --ops`'s
    count: comprehensions count). A 4-layer model, so that K-norm (layers 0 and 1 skipped) evicts too."""
    from kvbench.bench.ops import count_ops
    from kvbench.bench.setup import all_policies, make_policy

    model, _ = build_tiny_model("tiny-llama", num_hidden_layers=4)
    ids = random_prompt(200, 4)
    rows = count_ops(model, lambda name: make_policy(name, 64, 0), all_policies(), 64, 64, 200, ids)
    assert len(rows) == 13
    for r in rows:
        assert r["step_functions"] <= 25 and len(r["step_files"]) <= 4, (r["policy"], r["step_functions"],
                                                                          r["step_files"])
        assert {"engine/cache.py", "engine/generate.py", "policies/base.py"} <= set(r["step_files"]), r["policy"]


# 9. Canaries: fail loudly when transformers changes what the engine relies on ---------------------------------------
def test_transformers_canaries() -> None:
    """An attention function registered with transformers receives the forward's extra keyword arguments (the slot
    cache travels so) and no mask when its name has no mask function."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen: dict[str, Any] = {}

    def probe(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any,
              **kwargs: Any) -> Any:
        seen["kwargs"], seen["mask"] = sorted(kwargs), mask
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register("kvbench_canary", probe)
    model, _ = build_tiny_model("tiny-llama", num_hidden_layers=1)
    model.set_attn_implementation("kvbench_canary")
    with torch.inference_mode():
        model(input_ids=torch.tensor([random_prompt(5, 0)]), use_cache=False, marker=1)
    assert "marker" in seen["kwargs"] and seen["mask"] is None
