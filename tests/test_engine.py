"""The engine's invariants: block prefill = full forward, eviction = explicit float64 reference,
cache bound, hand loop = generate(prefill_chunk_size), and canaries for transformers upgrades."""

from __future__ import annotations

import inspect

import pytest
import torch

from kvbench.engine import attention
from kvbench.engine.cache import EvictingCache
from kvbench.engine.generate import GenerationSettings, Observer, generate
from kvbench.models.tiny import build_tiny_model
from kvbench.policies.full import Full
from kvbench.policies.h2o import H2O
from kvbench.policies.keydiff import KeyDiff
from kvbench.policies.knorm import KNorm
from kvbench.policies.pyramidkv import PyramidKV
from kvbench.policies.random import Random
from kvbench.policies.snapkv import SnapKV
from kvbench.policies.streamingllm import StreamingLLM
from kvbench.policies.tova import TOVA

from float64_reference import reference_logits
from helpers import held_counts

ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-phi3", "tiny-gemma"]


def _model(arch: str, impl: str = "sdpa", **kw):
    # Output scale 1: logits of order 1, the scale the 1e-5 tolerances refer to.
    model, tok = build_tiny_model(arch, output_scale=1.0, **kw)
    model.set_attn_implementation(impl)  # before install: the wrapper delegates to the implementation set here
    attention.install(model)
    return model, tok


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(8, 500, (1, n), generator=g)


# 1. No eviction: block prefill equals one full forward ----------------------------------------------------------
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_block_prefill_equals_full_forward(arch: str, impl: str) -> None:
    model, _ = _model(arch, impl)
    ids = _prompt(150)
    with torch.inference_mode():
        ref = model(ids).logits  # (1, T, V)
        for block in (1, 7, 128):
            cache = EvictingCache(model.config, None)
            with attention.active(cache):
                out = torch.cat([model(ids[:, s:s + block], past_key_values=cache).logits
                                 for s in range(0, ids.shape[1], block)], dim=1)
            assert (out - ref).abs().max().item() < 1e-5, (arch, impl, block)
            assert cache.get_seq_length() == 150


def test_budget_at_least_prompt_evicts_nothing() -> None:
    model, _ = _model("tiny-llama")
    ids = _prompt(200)[0].tolist()
    full = generate(model, Full(), ids, GenerationSettings(block=None, max_new_tokens=12))
    for policy in (KeyDiff(budget=400), StreamingLLM(budget=400), TOVA(budget=400), H2O(budget=400),
                   SnapKV(budget=400), KNorm(budget=400, skip_layers=[]), Random(budget=400)):
        res = generate(model, policy, ids, GenerationSettings(block=32, max_new_tokens=12))
        assert res.tokens == full.tokens, policy.name
        assert res.peak_kv_tokens == 200 + 11  # prompt + fed-back generated tokens, nothing dropped


# 2. With eviction: explicit float64 re-implementation driven by the logged kept positions ------------------------
@pytest.mark.parametrize("policy_factory,layers", [
    (lambda: KeyDiff(budget=24), 2),  # per-head kept sets, uniform budget
    (lambda: H2O(budget=24), 2),  # attention computed by the wrapper itself
    (lambda: KNorm(budget=24, skip_layers=[0]), 3),  # per-layer lengths: layer 0 keeps all, mask rebuilt per layer
    (lambda: SnapKV(budget=24, window=4, kernel=3), 2),
    (lambda: PyramidKV(budget=24, window=4, kernel=3), 3),  # per-layer budgets shrinking with depth
])
def test_eviction_matches_float64_reference(policy_factory, layers: int) -> None:
    model, _ = _model("tiny-llama", num_hidden_layers=layers)
    model.double()
    ids = _prompt(70)[0].tolist()
    logged: list[torch.Tensor] = []
    policy = policy_factory()
    res = generate(model, policy, ids, GenerationSettings(block=16, max_new_tokens=6),
                   observer=Observer(trace=True, on_logits=lambda lg: logged.append(lg[0])))
    chunks = [ids[s:s + 16] for s in range(0, len(ids), 16)] + [[t] for t in res.tokens[:-1]]
    assert len(res.trace) == len(chunks)
    ref = reference_logits(model, chunks, res.trace)
    # logged[0] comes from the last prompt block; each later one from a one-token decoding step
    ref_steps = [ref[len(chunks) - len(res.tokens)]] + ref[len(chunks) - len(res.tokens) + 1:]
    for got, want in zip(logged, ref_steps, strict=True):
        assert (got.double() - want).abs().max().item() < 1e-5
    # the run really evicted: some layer held fewer tokens than it had seen
    assert any(t is not None and t.shape[-1] < 70 for t in res.trace[-1])


# 3. The cache never exceeds N + B, and is cut back to N after every step -------------------------------------------
@pytest.mark.parametrize("slot_reuse", [False, True])
@pytest.mark.parametrize("policy", [KeyDiff(budget=40), StreamingLLM(budget=40), TOVA(budget=40), H2O(budget=40),
                                    SnapKV(budget=40), Random(budget=40), KNorm(budget=40, skip_layers=[])],
                         ids=lambda p: p.name)
def test_cache_bounded(policy, slot_reuse: bool) -> None:
    model, _ = _model("tiny-llama")
    ids = _prompt(300)[0].tolist()
    res = generate(model, policy, ids, GenerationSettings(block=16, max_new_tokens=10, slot_reuse=slot_reuse),
                   observer=Observer(trace=True))
    for step in res.trace[1:]:  # before every forward after the first: at most N held
        assert all(n <= 40 for n in held_counts(step))
        for pos in step:
            if slot_reuse:  # at most the N held and one hole (position -1), the slot the next token goes into
                assert pos.shape[-1] <= 40 + 1
            else:
                assert pos.shape[-1] <= 40 and bool((pos.diff(dim=-1) > 0).all())  # chronological order kept
    if slot_reuse:  # after the last decoding eviction: N held, one hole per head
        assert all(int((pos < 0).sum()) == pos.shape[1] and pos.shape[-1] == 41 for pos in res.trace[-1])
    assert res.peak_kv_tokens == 40 + 16
    bytes_per_token = 2 * 2 * 64 * 4 * 2  # K+V x 2 kv heads x head_dim 64 x fp32 x 2 layers
    assert res.kv_bytes_peak == (40 + 16) * bytes_per_token


def test_knorm_default_skips_layers_0_and_1_and_bounds_the_rest() -> None:
    # K-norm's default leaves layers 0 and 1 uncompressed; on a 2-layer model it would evict nothing, so use 4.
    model, _ = _model("tiny-llama", num_hidden_layers=4)
    ids = _prompt(100)[0].tolist()
    res = generate(model, KNorm(budget=40), ids, GenerationSettings(block=16, max_new_tokens=5),
                   observer=Observer(trace=True))
    assert len(res.trace) == 7 + 4  # 7 prompt blocks (100 = 6 x 16 + 4), then 4 one-token decoding steps
    for k, step in enumerate(res.trace[1:], 1):  # before forward k: the tokens seen so far, or N after eviction
        seen = min(16 * k, 100) + max(0, k - 7)
        assert held_counts(step) == [seen, seen, min(seen, 40), min(seen, 40)]
    assert res.peak_kv_tokens == 100 + 4  # the uncompressed layers hold the whole prompt plus 4 fed-back tokens


def test_block_null_is_one_forward_then_one_eviction() -> None:
    model, _ = _model("tiny-llama")
    ids = _prompt(300)[0].tolist()
    res = generate(model, KeyDiff(budget=40), ids, GenerationSettings(block=None, max_new_tokens=3),
                   observer=Observer(trace=True))
    assert len(res.trace) == 1 + 2  # prompt forward + two decoding steps
    assert res.peak_kv_tokens == 300
    assert held_counts(res.trace[1]) == [40, 40]


# 4. The hand loop equals generate(prefill_chunk_size=B) with the same eviction in forward hooks -------------------
@pytest.mark.parametrize("policy_factory", [lambda: KeyDiff(budget=48), lambda: TOVA(budget=48),
                                            lambda: H2O(budget=48)])
def test_hand_loop_equals_hf_generate(policy_factory) -> None:
    model, tok = _model("tiny-llama")
    ids = _prompt(200)[0].tolist()
    mine = generate(model, policy_factory(), ids, GenerationSettings(block=32, max_new_tokens=15))
    policy = policy_factory()
    cache = EvictingCache(model.config, policy)

    def evict(*_):
        for layer in cache.evicting_layers():
            policy.evict(layer)

    hook = model.register_forward_hook(evict)
    try:
        with attention.active(cache), torch.inference_mode():
            out = model.generate(torch.tensor([ids]), past_key_values=cache, prefill_chunk_size=32, do_sample=False,
                                 max_new_tokens=15, min_new_tokens=15, eos_token_id=None, pad_token_id=0)
    finally:
        hook.remove()
    assert out[0, len(ids):].tolist() == mine.tokens


# 5. Canaries: fail loudly when transformers changes what the engine relies on -------------------------------------
def test_transformers_canaries() -> None:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.models.llama.modeling_llama import LlamaModel

    assert "cache_position" not in inspect.signature(LlamaModel.forward).parameters
    assert "sdpa" in AttentionMaskInterface._global_mapping
    from transformers.cache_utils import DynamicSlidingWindowLayer

    # The evicting layer follows the sliding layer's convention: seen length vs physical length.
    layer = DynamicSlidingWindowLayer(sliding_window=4)
    k = torch.zeros(1, 1, 6, 2)
    layer.update(k, k)
    assert layer.get_seq_length() == 6 and layer.get_mask_sizes(1) == (4, 3)
