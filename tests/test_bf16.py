"""bfloat16, the GPU path's dtype, checked on a CPU: block-wise processing without eviction equals one full forward
within bfloat16's resolution; every policy runs under every protocol on a bfloat16 model, evicts and stays bounded;
scores, per-token state and selections are computed in float32 (bit-identical to the same cache values in float32).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from kvbench.bench.setup import make_policy
from kvbench.engine import cache as engine_cache
from kvbench.engine import generate as engine_generate
from kvbench.engine.cache import SlotCache, forward, install, probabilities
from kvbench.engine.generate import GenerationSettings, Observer, generate
from kvbench.models.tiny import build_tiny_model
from kvbench.options import PROTOCOLS
from kvbench.policies.base import SlotView
from kvbench.policies.full import Full
from kvbench.policies.h2o import H2O
from kvbench.policies.keydiff import KeyDiff
from kvbench.policies.knorm import KNorm
from kvbench.policies.snapkv import SnapKV
from kvbench.policies.tova import TOVA
from kvbench.run.config import group_choices

from helpers import installed_model, kept, make_view

ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-phi3", "tiny-gemma"]
# Two bfloat16 steps at the logits' scale. With output_scale 1 the logits lie in (-2, 2) (asserted), where bfloat16's
# spacing is at most 2^-7. Block-wise and full forwards do the same products, but attention reduces them in another
# order (and through another kernel: the slot cache's attention over its slots, HF's sdpa for the full forward) for a
# 1-token or 7-token block than for 150 queries, and every layer's output is rounded to bfloat16, so a logit can land
# on a neighbouring bfloat16 value: measured at most one step (2^-7) over the 6 architectures x blocks 1/7/16/128,
# and over KeyDiff, H2O, SnapKV, TOVA, AdaKV with nothing evicted. The bfloat16 forward itself is 0.007-0.033 away
# from float32 with the same weights, so a tighter bound would test kernels, not the engine. What it still catches:
# a one-position shift of the last block's RoPE moves tiny-llama's logits by 0.29 (test below). Subtler errors are
# the float32 tests' job (tests/test_engine.py: 1e-5).
BF16_TOL = 2.0 ** -6
POLICIES = group_choices("policy")  # every conf/policy file, the full baseline included
N, B, T, NEW = 40, 16, 100, 5


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(8, 500, (1, n), generator=torch.Generator().manual_seed(seed))  # (1, n)


def _bf16_model(arch: str, **kw: Any) -> Any:
    model, _ = build_tiny_model(arch, output_scale=1.0, dtype=torch.bfloat16, **kw)
    install(model)
    return model


def _blocks(model: Any, ids: torch.Tensor, block: int, shift_last: int = 0) -> tuple[torch.Tensor, SlotCache]:
    """Logits (1, T, V) float32 of `ids` fed in blocks through a slot cache that evicts nothing (the full baseline's);
    `shift_last` moves the last block's positions (the control)."""
    n = ids.shape[1]
    cache = SlotCache(model, Full(), 1, 1, n)
    outs = []
    with torch.inference_mode():
        for s in range(0, n, block):
            chunk = ids[:, s:s + block]
            positions = torch.arange(s, s + chunk.shape[1]).unsqueeze(0)
            if shift_last and s + block >= n:
                positions = positions + shift_last
            outs.append(forward(model, cache, chunk, positions, keep=chunk.shape[1]).float())
    return torch.cat(outs, dim=1), cache


# 1. Nothing evicted: block-wise = one full forward, within bfloat16's resolution ----------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_block_prefill_equals_full_forward(arch: str) -> None:
    model = _bf16_model(arch)
    ids = _prompt(150)
    with torch.inference_mode():
        ref = model(ids).logits.float()  # (1, T, V): HF's own forward (sdpa), no slot cache
    assert ref.abs().max().item() < 2.0  # the scale BF16_TOL is two bfloat16 steps of
    for block in (1, 7, 16):
        out, cache = _blocks(model, ids, block)
        assert cache.full.keys.dtype == torch.bfloat16  # the cache really holds bfloat16
        assert (out - ref).abs().max().item() <= BF16_TOL, (arch, block)


def test_bf16_tolerance_detects_a_one_position_shift() -> None:
    """The control: the same block loop with the last block's positions one too far is far outside BF16_TOL."""
    model = _bf16_model("tiny-llama")
    ids = _prompt(150)
    good, _ = _blocks(model, ids, 16)
    bad, _ = _blocks(model, ids, 16, shift_last=1)
    assert (bad - good)[:, 144:].abs().max().item() > 10 * BF16_TOL


def test_bf16_generate_without_eviction_matches_full() -> None:
    """Budget above the prompt, blocks of 16: each step's logits match the full baseline's (one forward), teacher-
    forced on the baseline's tokens so both see the same sequence; nothing is dropped; K/V are 2 bytes each."""
    model = _bf16_model("tiny-llama")
    ids = _prompt(150)[0].tolist()
    ref: list[torch.Tensor] = []
    full = generate(model, Full(), ids, GenerationSettings(block=16, max_new_tokens=12),
                    observer=Observer(on_logits=ref.append))
    # 150 + 11 tokens x 2 layers x 2 KV heads x head_dim 64 x (K and V) x 2 bytes
    assert full.kv_bytes_peak == (150 + 11) * 2 * 2 * 64 * 2 * 2
    for policy in (KeyDiff(budget=400), H2O(budget=400), SnapKV(budget=400), TOVA(budget=400)):
        got: list[torch.Tensor] = []
        res = generate(model, policy, ids, GenerationSettings(block=16, max_new_tokens=12), forced=full.tokens,
                       observer=Observer(on_logits=got.append))
        assert res.peak_kv_tokens == 150 + 11, policy.name
        assert len(got) == len(ref) == 12
        assert max((a - b).abs().max().item() for a, b in zip(got, ref)) <= BF16_TOL, policy.name


# 2. Every policy, every protocol, with evictions: no dtype error, bounded, float32 scores --------------------------
class Float32Twin:
    """Checks a policy during a real bfloat16 run: every `token_state` is also run on float32 copies of its inputs and
    every eviction also scores and selects (the engine's `select`) on a float32 copy of the view. bfloat16 -> float32
    is exact, so a policy that casts to float32 before any arithmetic gets bit-identical state, scores and
    selections; any arithmetic in bfloat16 (a norm, a dot product, an accumulator) rounds differently and is
    recorded in `mismatches`. `install` puts the twin in the engine's `select` (pytest's monkeypatch)."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.mismatches: list[tuple[str, tuple[int, ...]]] = []
        self.selections = 0
        self.scores: list[torch.Tensor] = []  # what `score` returned, in order
        self._score, self._token_state = policy.score, policy.token_state
        policy.score, policy.token_state = self.score, self.token_state

    def install(self, monkeypatch: Any) -> None:
        monkeypatch.setattr(engine_cache, "select", self.select)  # a compiled forward's eviction
        monkeypatch.setattr(engine_generate, "select", self.select)  # the eager one, timed apart

    def _draws(self) -> Any:  # Random's generator: the checks must not consume the run's draws
        gen = getattr(self.policy, "_gen", None)
        return (gen, gen.get_state()) if gen is not None else None

    @staticmethod
    def _restore(saved: Any) -> None:
        if saved is not None:
            saved[0].set_state(saved[1])

    def token_state(self, view: SlotView, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        twin = dataclasses.replace(view, keys=view.keys.float(), values=view.values.float(),
                                   queries=None if view.queries is None else view.queries.float())
        want = self._token_state(twin, slots)
        got = self._token_state(view, slots)
        for name, t in got.items():
            if t.dtype != torch.float32 or not torch.equal(t, want[name]):
                self.mismatches.append((f"state {name}", view.layers))
        return got

    def score(self, view: SlotView) -> torch.Tensor:
        out = self._score(view)
        self.scores.append(out)
        return out

    def select(self, policy: Any, view: SlotView, counts: torch.Tensor) -> torch.Tensor:
        f32 = None if view.queries is None else view.queries.float()
        twin = dataclasses.replace(view, keys=view.keys.float(), values=view.values.float(), queries=f32,
                                   state={k: v.clone() for k, v in view.state.items()})  # SAGE-KV writes its pins
        saved = self._draws()
        want = _select(policy, twin, counts)
        self._restore(saved)
        got = _select(policy, view, counts)
        want_scores, got_scores = self.scores[-2:]
        self.scores.clear()
        if got_scores.dtype != torch.float32 or not torch.equal(got_scores, want_scores):
            self.mismatches.append(("scores", view.layers))
        if not torch.equal(got, want):
            self.mismatches.append(("selection", view.layers))
        self.selections += 1
        return got


_select = engine_cache.select  # the engine's own, which the twin wraps


@pytest.fixture(scope="module")
def model4() -> Any:
    """tiny-llama with 4 layers (K-norm leaves layers 0 and 1 alone) in bfloat16."""
    return installed_model("tiny-llama-4l", dtype=torch.bfloat16)[0]


def _seen_before_each_forward(protocol: str, policy: Any) -> list[int]:
    step = T if PROTOCOLS[protocol][0] or policy.single_pass_prefill else B  # the full baseline: one forward
    prompt = [min(s + step, T) for s in range(0, T, step)]
    return [0] + prompt + [T + k for k in range(1, NEW - 1)]  # trace k is taken before forward k


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_runs_bounded_in_bf16_with_float32_scores(model4, monkeypatch, name: str, protocol: str) -> None:
    policy = make_policy(name, N, 0)
    policy.start_sample(0)
    check = Float32Twin(policy)
    check.install(monkeypatch)
    res = generate(model4, policy, _prompt(T)[0].tolist(),
                   GenerationSettings(block=B, max_new_tokens=NEW, protocol=protocol), observer=Observer(trace=True))
    assert len(res.tokens) == NEW  # no stop tokens: every step ran
    assert check.mismatches == []
    seen = _seen_before_each_forward(protocol, policy)
    assert len(res.trace) == len(seen)
    h_kv = model4.config.num_key_value_heads
    if not policy.evicts:
        assert check.selections == 0 and res.peak_kv_tokens == T + NEW - 1
        return
    assert check.selections > 0
    evicted = [i for i in range(model4.config.num_hidden_layers) if policy.layer_budget(i) is not None]
    one_pass, decode_evicts = PROTOCOLS[protocol]
    for k in range(1, len(seen)):  # after forward k - 1 and the eviction that followed it (if any)
        for i in evicted:
            held = int((res.trace[k][i] >= 0).sum())  # the layer's tokens, all heads (-1: a free slot)
            if decode_evicts or seen[k] <= T:
                bound = policy.layer_budget(i, seen[k])
            else:  # prefill_once: one eviction after the prompt, then one more token per step
                bound = policy.layer_budget(i, T) + seen[k] - T
            assert held <= h_kv * min(bound, seen[k]), (name, protocol, k, i)
    last = res.trace[-1]
    assert any(int((last[i] >= 0).sum()) < h_kv * seen[-1] for i in evicted)  # tokens really were dropped


def test_the_float32_twin_check_catches_bf16_arithmetic(model4, monkeypatch) -> None:
    """Negative controls: K-norm with its norms taken in the cache's dtype, as state and as scores."""

    class StateInBf16(KNorm):
        state_names = ("norm",)

        def token_state(self, view, slots):
            new = view.keys.gather(3, slots.unsqueeze(-1).expand(*slots.shape, view.keys.shape[-1]))
            return {"norm": new.norm(dim=-1)}  # bfloat16 in, bfloat16 out: the bug the check is for

    class ScoreInBf16(KNorm):
        def score(self, view):
            return -view.keys.norm(dim=-1)

    for cls, kind in ((StateInBf16, "state norm"), (ScoreInBf16, "scores")):
        check = Float32Twin(cls(budget=N))
        check.install(monkeypatch)
        generate(model4, check.policy, _prompt(T)[0].tolist(), GenerationSettings(block=B, max_new_tokens=NEW))
        assert kind in {m[0] for m in check.mismatches}, cls.__name__


def test_bf16_diagnostics_and_graded_branch_run(model4) -> None:
    ids = _prompt(T)[0].tolist()
    for name in ("keydiff", "adakv", "criticalkv"):
        policy = make_policy(name, N, 0)
        res = generate(model4, policy, ids,
                       GenerationSettings(block=B, max_new_tokens=NEW,
                                          diagnostics=("attention_loss", "perturbation", "key_logdet")),
                       answer_ids=[11, 12, 13])
        assert math.isfinite(res.answer_logprob)
        for diag in ("attention_loss", "perturbation", "key_logdet"):
            assert res.diagnostics[diag]["events"] > 0 and math.isfinite(res.diagnostics[diag]["mean"]), (name, diag)


# 3. Where bfloat16 would flip a selection: attention logits ---------------------------------------------------------
def test_attention_probabilities_are_float32_so_h2o_keeps_the_larger_one() -> None:
    """Query (1, 1), keys (8, 8) and (8, 8.0625), all exact in bfloat16: logits 16 and 16.0625. bfloat16's step in
    [16, 32) is 0.125, so a bfloat16 product rounds 16.0625 to 16 (half to even) and the two tie; H2O with N = 1 would
    then keep slot 0 (ties keep the earlier position). In float32 the attention is 1 / (1 + e^0.0625) = 0.48438 and
    e^0.0625 / (1 + e^0.0625) = 0.51562, and H2O keeps slot 1."""
    bf = torch.bfloat16
    q = torch.tensor([[[[1.0, 1.0]]]], dtype=bf)  # (b, h_q, t, d)
    k = torch.tensor([[[[8.0, 8.0], [8.0, 8.0625]]]], dtype=bf)  # (b, h_kv, S, d)
    assert (q[0, 0] @ k[0, 0].T).tolist() == [[16.0, 16.0]]  # the premise: bfloat16 products tie
    # what the slot attention hands H2O: the probabilities (b, h_kv, g, t, S) summed over the queries and query heads
    # (g = 1); both slots visible (none hidden), computed in float32 (the dtype of `zero`)
    received = probabilities(q, k, torch.zeros(1, 1, 1, 1, 2, dtype=torch.bool), 1.0, None, torch.zeros(())).sum(
        dim=(2, 3))
    view = make_view([[[8.0, 8.0], [8.0, 8.0625]]])
    view.state["acc"] = torch.zeros(1, 1, 1, 2)
    h2o = H2O(budget=1)
    h2o.on_attention({"acc": view.state["acc"].unbind(0)}, 0, received)
    assert view.state["acc"][0, 0, 0].tolist() == pytest.approx([0.48438, 0.51562], abs=1e-5)
    assert kept(h2o, view) == [[1]]
