"""The architecture note's invariants: block prefill = full forward, eviction = explicit float64 reference,
cache bound, hand loop = generate(prefill_chunk_size), and canaries for transformers upgrades."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from kvbench import attention
from kvbench.cache import EvictingCache
from kvbench.models import build_tiny_model
from kvbench.policies.full import Full
from kvbench.policies.h2o import H2O
from kvbench.policies.keydiff import KeyDiff
from kvbench.policies.knorm import KNorm
from kvbench.policies.random import Random
from kvbench.policies.snapkv import SnapKV
from kvbench.policies.streamingllm import StreamingLLM
from kvbench.policies.tova import TOVA
from kvbench.runner import generate

ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-phi3", "tiny-gemma"]


def _model(arch: str, impl: str = "sdpa", **kw):
    # Output scale 1: logits of order 1, the scale the architecture note's 1e-5 tolerances refer to.
    model, tok = build_tiny_model(arch, output_scale=1.0, **kw)
    model.set_attn_implementation(impl)
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
    full = generate(model, Full(), ids, None, 12, stop_ids=())
    for policy in (KeyDiff(budget=400), StreamingLLM(budget=400), TOVA(budget=400), H2O(budget=400),
                   SnapKV(budget=400), KNorm(budget=400), Random(budget=400)):
        res = generate(model, policy, ids, 32, 12, stop_ids=())
        assert res.tokens == full.tokens, policy.name
        assert res.peak_kv_tokens == 200 + 11  # prompt + fed-back generated tokens, nothing dropped


# 2. With eviction: explicit float64 re-implementation driven by the logged kept positions ------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.double().unsqueeze(-1) * inv  # (n, d/2)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_logits(model, chunks: list[list[int]], trace: list[list[torch.Tensor | None]]) -> list[torch.Tensor]:
    """Llama forward in float64, chunk by chunk; chunk s attends, per layer and KV head, to exactly the positions
    `trace[s]` held before it (plus itself, causally). K/V of a token are those computed when it was fed."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    L, h_q, h_kv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.head_dim
    theta = cfg.rope_parameters["rope_theta"]
    eps = cfg.rms_norm_eps
    kv: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(L)]  # pos -> (k, v) (h_kv, d)
    out, seen = [], 0
    for s, chunk in enumerate(chunks):
        pos = torch.arange(seen, seen + len(chunk))
        x = sd["model.embed_tokens.weight"][torch.tensor(chunk)]  # (q, hidden)
        for li in range(L):
            p = f"model.layers.{li}."
            h = _rms(x, sd[p + "input_layernorm.weight"], eps)
            q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(-1, h_q, d).transpose(0, 1)  # (h_q, q, d)
            k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(-1, h_kv, d).transpose(0, 1)
            v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(-1, h_kv, d).transpose(0, 1)
            q, k = _rope(q, pos, theta), _rope(k, pos, theta)
            for j, pj in enumerate(pos.tolist()):
                kv[li][pj] = (k[:, j], v[:, j])
            heads = []
            for hq in range(h_q):
                hk = hq // (h_q // h_kv)
                held = [] if trace[s][li] is None else trace[s][li][0, hk].tolist()
                o = []
                for j, pj in enumerate(pos.tolist()):
                    visible = held + list(range(seen, pj + 1))
                    K = torch.stack([kv[li][t][0][hk] for t in visible])  # (m, d)
                    V = torch.stack([kv[li][t][1][hk] for t in visible])
                    a = torch.softmax(K @ q[hq, j] / math.sqrt(d), dim=0)
                    o.append(a @ V)
                heads.append(torch.stack(o))  # (q, d)
            attn = torch.stack(heads, 1).reshape(len(chunk), h_q * d) @ sd[p + "self_attn.o_proj.weight"].T
            x = x + attn
            h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
            mlp = (torch.nn.functional.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T))
            x = x + mlp @ sd[p + "mlp.down_proj.weight"].T
        x = _rms(x, sd["model.norm.weight"], eps)
        out.append(x[-1] @ sd["lm_head.weight"].T)
        seen += len(chunk)
    return out


@pytest.mark.parametrize("policy_factory,layers", [
    (lambda: KeyDiff(budget=24), 2),  # per-head kept sets, uniform budget
    (lambda: H2O(budget=24), 2),  # attention computed by the wrapper itself
    (lambda: KNorm(budget=24, skip_layers=[0]), 3),  # per-layer lengths: layer 0 keeps all, mask rebuilt per layer
    (lambda: SnapKV(budget=24, window=4, kernel=3), 2),
])
def test_eviction_matches_float64_reference(policy_factory, layers: int) -> None:
    model, _ = _model("tiny-llama", num_hidden_layers=layers)
    model.double()
    ids = _prompt(70)[0].tolist()
    logged: list[torch.Tensor] = []
    policy = policy_factory()
    res = generate(model, policy, ids, 16, 6, stop_ids=(), trace=True, on_logits=lambda lg: logged.append(lg[0]))
    chunks = [ids[s:s + 16] for s in range(0, len(ids), 16)] + [[t] for t in res.tokens[:-1]]
    assert len(res.trace) == len(chunks)
    ref = reference_logits(model, chunks, res.trace)
    # logged[0] comes from the last prompt block; each later one from a one-token decoding step
    ref_steps = [ref[len(chunks) - len(res.tokens)]] + ref[len(chunks) - len(res.tokens) + 1:]
    for got, want in zip(logged, ref_steps):
        assert (got.double() - want).abs().max().item() < 1e-5
    # the run really evicted: some layer held fewer tokens than it had seen
    assert any(t is not None and t.shape[-1] < 70 for t in res.trace[-1])


# 3. The cache never exceeds N + B, and is cut back to N after every step -------------------------------------------
@pytest.mark.parametrize("policy", [KeyDiff(budget=40), StreamingLLM(budget=40), TOVA(budget=40), H2O(budget=40),
                                    SnapKV(budget=40), Random(budget=40), KNorm(budget=40, skip_layers=[])],
                         ids=lambda p: p.name)
def test_cache_bounded(policy) -> None:
    model, _ = _model("tiny-llama")
    ids = _prompt(300)[0].tolist()
    res = generate(model, policy, ids, 16, 10, stop_ids=(), trace=True)
    for step in res.trace[1:]:  # before every forward after the first: at most N held
        for pos in step:
            assert pos is not None and pos.shape[-1] <= 40
            assert bool((pos.diff(dim=-1) > 0).all())  # chronological order kept
    assert res.peak_kv_tokens == 40 + 16
    bytes_per_token = 2 * 2 * 64 * 4 * 2  # K+V x 2 kv heads x head_dim 64 x fp32 x 2 layers
    assert res.kv_bytes_peak == (40 + 16) * bytes_per_token


def test_block_null_is_one_forward_then_one_eviction() -> None:
    model, _ = _model("tiny-llama")
    ids = _prompt(300)[0].tolist()
    res = generate(model, KeyDiff(budget=40), ids, None, 3, stop_ids=(), trace=True)
    assert len(res.trace) == 1 + 2  # prompt forward + two decoding steps
    assert res.peak_kv_tokens == 300
    assert all(p.shape[-1] == 40 for p in res.trace[1])


# 4. The hand loop equals generate(prefill_chunk_size=B) with the same eviction in forward hooks -------------------
@pytest.mark.parametrize("policy_factory", [lambda: KeyDiff(budget=48), lambda: TOVA(budget=48),
                                            lambda: H2O(budget=48)])
def test_hand_loop_equals_hf_generate(policy_factory) -> None:
    model, tok = _model("tiny-llama")
    ids = _prompt(200)[0].tolist()
    mine = generate(model, policy_factory(), ids, 32, 15, stop_ids=())
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
