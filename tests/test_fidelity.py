"""task=fidelity: teacher forcing along the full cache's continuation, agreement and KL."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvbench.engine.generate import GenerationSettings, Observer, generate
from kvbench.metrics.fidelity import fidelity
from kvbench.policies.full import Full
from kvbench.policies.h2o import H2O
from kvbench.policies.keydiff import KeyDiff
from kvbench.policies.snapkv import SnapKV
from kvbench.policies.streamingllm import StreamingLLM
from kvbench.run.loop import run_task
from kvbench.run.settings import RunSettings
from kvbench.tasks.base import TaskEnv
from kvbench.tasks.fidelity import FidelityTask


def _run(model, tok, policy, tmp_path: Path, budget: int, lengths=(300,), new_tokens: int = 8,
         source: str = "filler"):
    task = FidelityTask(lengths=list(lengths), new_tokens=new_tokens, source=source)
    env = TaskEnv(tokenizer=tok, model_name="tiny", max_prompt_tokens=8000)
    records = run_task(model, tok, policy, task, env, RunSettings(budget=budget, block=32, progress=False),
                       tmp_path)
    return task, records


def test_metric_by_hand() -> None:
    ref = torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]).log()
    test = torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [0.1, 0.2, 0.7]]).log()
    f = fidelity(ref, test)
    # step 2: KL = 0.5 ln(0.5/0.25) + 0.25 ln(0.25/0.5) = 0.25 ln 2; steps 1 and 3: 0
    assert f["kl_max"] == pytest.approx(0.25 * math.log(2), abs=1e-7)
    assert f["kl_mean"] == pytest.approx(0.25 * math.log(2) / 3, abs=1e-7)
    assert f["top1"] == pytest.approx(200 / 3)
    assert f["match_len"] == 1


def test_full_policy_is_exactly_its_own_reference(model, tok, tmp_path: Path) -> None:
    task, records = _run(model, tok, Full(), tmp_path, budget=64)
    f = records[0]["fidelity"]
    assert f == {"top1": 100.0, "kl_mean": 0.0, "kl_max": 0.0, "match_len": 8}
    assert task.aggregate(records)["top1"] == 100.0
    assert records[0]["prediction"] == records[0]["reference"]


@pytest.mark.parametrize("policy", [KeyDiff(budget=400), H2O(budget=400), SnapKV(budget=400),
                                    StreamingLLM(budget=400)], ids=lambda p: p.name)
def test_budget_above_prompt_matches_full(model, tok, tmp_path: Path, policy) -> None:
    _, records = _run(model, tok, policy, tmp_path, budget=400)
    f = records[0]["fidelity"]
    assert f["top1"] == 100.0 and f["match_len"] == 8
    assert f["kl_max"] < 1e-6  # block-wise prefill vs one forward: fp32 rounding only (logits ~1e-5 apart)


def test_eviction_moves_the_model(model, tok, tmp_path: Path) -> None:
    _, records = _run(model, tok, StreamingLLM(budget=24), tmp_path, budget=24, lengths=(400,), new_tokens=16)
    f = records[0]["fidelity"]
    assert f["kl_mean"] > 0 and f["kl_max"] > 0
    assert f["top1"] < 100.0  # 24 of 400 tokens kept: some next-token choices change


def test_teacher_forcing_feeds_exactly_the_given_tokens(model) -> None:
    fed: list[list[int]] = []
    hook = model.register_forward_pre_hook(lambda m, args, kw: fed.append(kw["input_ids"][0].tolist()),
                                           with_kwargs=True)
    try:
        prompt = list(range(10, 74))  # 64 tokens -> two blocks of 32
        forced = [5, 400, 7, 7, 123]
        res = generate(model, KeyDiff(budget=40), prompt, GenerationSettings(block=32, max_new_tokens=len(forced)),
                       forced=forced)
    finally:
        hook.remove()
    assert fed[:2] == [prompt[:32], prompt[32:]]
    assert [f[0] for f in fed[2:]] == forced[:-1]  # each forced token is fed; the last one needs no forward
    assert res.tokens == forced


def test_generated_prompts_have_the_requested_lengths(tok) -> None:
    env = TaskEnv(tokenizer=tok, model_name="tiny", max_prompt_tokens=8000)
    for source in ("filler", "random"):
        samples = list(FidelityTask(lengths=[100, 250], samples_per_length=2, source=source).samples(env))
        assert [len(s.input_ids) for s in samples] == [100, 100, 250, 250]
        assert samples[0].input_ids != samples[1].input_ids  # different passages per sample
        assert samples[0].input_ids[0] == tok.bos_token_id
