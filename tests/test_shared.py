"""Shared prompt forwards (`generate_shared`): every run's result is bit-for-bit the one `generate` gives it alone.

A sweep's runs of one sample (every policy x budgets below and above the prompt, under each protocol) go through
`generate_shared` together and one by one through `generate`; tokens, graded log-probabilities, peak tokens and bytes,
decoding steps and the kept positions before every forward must be equal exactly (==, torch.equal), in float32,
where any change of arithmetic (another attention path, a hook fed other values, a forward over other K/V) shows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvbench.bench.setup import make_policy
from kvbench.engine.generate import GenerationResult, GenerationSettings, Job, Observer, generate, generate_shared
from kvbench.options import PROTOCOLS
from kvbench.run.config import group_choices

from helpers import installed_model

POLICIES = group_choices("policy")  # every conf/policy file, the full baseline included
T, B = 101, 16  # 7 prompt blocks (6 of 16 tokens, a tail of 5)
BUDGETS = (40, 64, 200)  # first eviction after block 3 / block 5 / never (above the prompt)
ANSWER = [17, 3, 250, 41]


@pytest.fixture(scope="module")
def model32() -> Any:
    return installed_model("tiny-llama", output_scale=1.0)[0]


def _prompt(n: int = T, seed: int = 0) -> list[int]:
    return torch.randint(8, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _jobs(names: list[str], protocol: str, budgets: tuple[int, ...] = BUDGETS, scenario: str = "question_aware",
          score_from: int | None = None, seeds: tuple[int, ...] = (1,), sample: int = 7) -> list[Job]:
    jobs = []
    for name in names:
        for budget in budgets if name != "full" else budgets[:1]:
            for seed in seeds:
                policy = make_policy(name, budget, seed)
                policy.start_sample(sample)  # as the run loop does before each sample (random: its generator)
                settings = GenerationSettings(block=B, max_new_tokens=8, protocol=protocol, scenario=scenario,
                                              context_tokens=T - 9 if scenario == "context_only" else None,
                                              score_from=score_from)
                jobs.append(Job(_prompt(), policy, settings, answer_ids=ANSWER, observer=Observer(trace=True)))
    return jobs


def _separate(model: Any, jobs: list[Job]) -> list[GenerationResult]:
    return [generate(model, j.policy, list(j.input_ids), j.settings, answer_ids=j.answer_ids, observer=j.observer)
            for j in jobs]


def _same(alone: GenerationResult, shared: GenerationResult) -> None:
    assert shared.tokens == alone.tokens
    assert shared.answer_logprob == alone.answer_logprob  # exactly: the same arithmetic
    assert shared.decode_steps == alone.decode_steps
    assert (shared.peak_kv_tokens, shared.kv_bytes_peak) == (alone.peak_kv_tokens, alone.kv_bytes_peak)
    assert (shared.lm_logprobs, shared.lm_correct) == (alone.lm_logprobs, alone.lm_correct)
    assert len(shared.trace) == len(alone.trace)
    for step_a, step_s in zip(alone.trace, shared.trace):  # the kept positions before every forward
        for pa, ps in zip(step_a, step_s):
            assert (pa is None) == (ps is None) and (pa is None or torch.equal(pa, ps))


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_shared_equals_separate_for_every_policy(model32, protocol: str) -> None:
    """All policies x budgets 40, 64 (below the prompt) and 200 (above it) in one call: every result equals the
    job's own `generate`; the runs did share (a budget above the prompt shares every prompt forward)."""
    shared = generate_shared(model32, _jobs(POLICIES, protocol))
    jobs = _jobs(POLICIES, protocol)
    for job, alone, sh in zip(jobs, _separate(model32, jobs), shared):
        _same(alone, sh)
    above = [sh for job, sh in zip(jobs, shared) if job.policy.budget == 200]
    assert all(sh.shared_with > 1 and sh.shared_forward_s > 0 and 0 < sh.shared_s <= sh.prefill_s for sh in above)


def _count_prompt_forwards(model: Any) -> tuple[list[int], Any]:
    count = [0]

    def hook(module: Any, args: Any, kwargs: dict) -> None:
        if kwargs["input_ids"].shape[1] > 1:  # a prompt forward (decoding and graded steps feed one token)
            count[0] += 1

    return count, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_blockwise_trunk_shares_the_blocks_before_each_budgets_first_eviction(model32) -> None:
    """keydiff and tova at N = 40, 64, 200, B = 16, T = 101 (7 forwards): alone 6 x 7 = 42 prompt forwards. Shared:
    blocks 1-3 once for all six, then the N = 40 runs alone (2 x 4); blocks 4-5 once for the other four, then the
    N = 64 runs alone (2 x 2); blocks 6-7 once for the N = 200 pair: 3 + 8 + 2 + 4 + 2 = 19."""
    count, handle = _count_prompt_forwards(model32)
    try:
        shared = generate_shared(model32, _jobs(["keydiff", "tova"], "blockwise"))
        assert count[0] == 19
        count[0] = 0
        alone = _separate(model32, _jobs(["keydiff", "tova"], "blockwise"))
        assert count[0] == 42
    finally:
        handle.remove()
    for a, s in zip(alone, shared):
        _same(a, s)
    assert [s.shared_with for s in shared] == [6, 6, 6] * 2


def test_prefill_once_reads_the_prompt_once_for_all(model32) -> None:
    """prefill_once: the whole prompt is one forward for every run of a trunk; the full cache (one forward whatever
    the protocol) joins it; the policies that need attention probabilities (H2O) form their own trunk."""
    names = ["keydiff", "snapkv", "streamingllm", "full", "h2o"]
    count, handle = _count_prompt_forwards(model32)
    try:
        shared = generate_shared(model32, _jobs(names, "prefill_once", budgets=(40,)))
    finally:
        handle.remove()
    assert count[0] == 2  # the sdpa trunk (keydiff, snapkv, streamingllm, full) and H2O alone
    assert [s.shared_with for s in shared] == [4, 4, 4, 4, 1]
    for a, s in zip(_separate(model32, _jobs(names, "prefill_once", budgets=(40,))), shared):
        _same(a, s)


def test_forks_leaving_together_go_through_the_model_together(model32) -> None:
    """batch=4: the members leaving the trunk at one forward run the rest of their prompt and their decoding together
    (keydiff, tova at N = 40: one batched forward per remaining block, 4 instead of 2 x 4). The prompt blocks stay
    bit-identical (>= 4 rows, see _MIN_BATCH_ROWS), so every kept position equals the separate run's; the decoding
    steps multiply k rows and may round another way, so tokens are compared in float64, where they must be equal."""
    count, handle = _count_prompt_forwards(model32)
    try:
        shared = generate_shared(model32, _jobs(["keydiff", "tova"], "blockwise"), batch=4)
    finally:
        handle.remove()
    assert count[0] == 3 + 4 + 2 + 2 + 2  # blocks 1-3 shared, N = 40 pair batched, 4-5 shared, N = 64 pair, N = 200 pair
    assert [s.batch_size for s in shared] == [2, 2, 2] * 2
    for a, s in zip(_separate(model32, _jobs(["keydiff", "tova"], "blockwise")), shared):
        for step_a, step_s in zip(a.trace[:7], s.trace[:7]):  # the kept positions before each prompt forward
            assert all((pa is None and ps is None) or torch.equal(pa, ps) for pa, ps in zip(step_a, step_s))
    model64 = model32.to(torch.float64)
    try:
        jobs = _jobs(POLICIES, "blockwise")
        alone = _separate(model64, _jobs(POLICIES, "blockwise"))
        for a, s in zip(alone, generate_shared(model64, jobs, batch=3)):
            assert (s.tokens, s.decode_steps, s.peak_kv_tokens) == (a.tokens, a.decode_steps, a.peak_kv_tokens)
            assert s.answer_logprob == pytest.approx(a.answer_logprob, abs=1e-9)
    finally:
        model32.to(torch.float32)


def test_shared_bytes_bound(model32) -> None:
    """The bound worked out by hand for tiny-llama (2 layers, 2 KV heads, head_dim 64, float32: 2 x 2 x 2 x 64 x 4 =
    2048 bytes of K/V per token), T = 101, 8 new tokens + a 4-token answer (12), B = 16: K-norm (one state, "norm")
    and StreamingLLM (none) at N = 64, the full cache (N = 200, above the prompt).
    trunk (101 + 12) x 2048 = 231,424; the largest run alone min(101, 200 + 16) + 12 = 113 tokens = 231,424 (batch 2:
    113 + min(101, 80) + 12 = 205 tokens = 419,840); state (4 x states + 8) x 101 x 2 layers x 2 heads:
    12 x 404 + 8 x 404 + 8 x 404 = 11,312."""
    from kvbench.engine.generate import shared_bytes

    jobs = []
    for name, budget in (("knorm", 64), ("streamingllm", 64), ("full", 200)):
        policy = make_policy(name, budget, 1)
        jobs.append(Job(_prompt(), policy, GenerationSettings(block=B, max_new_tokens=8), answer_ids=ANSWER))
    assert [len(j.policy.state_names) for j in jobs] == [1, 0, 0]
    assert shared_bytes(model32, jobs) == 231_424 + 231_424 + 11_312
    assert shared_bytes(model32, jobs, batch=2) == 231_424 + 419_840 + 11_312


def test_context_only(model32) -> None:
    """The question after context_tokens goes in unevicted (frozen): the same in a trunk as alone."""
    names = ["keydiff", "snapkv", "h2o", "adakv", "full"]
    for protocol in ("blockwise", "prefill_once"):
        shared = generate_shared(model32, _jobs(names, protocol, scenario="context_only"))
        for a, s in zip(_separate(model32, _jobs(names, protocol, scenario="context_only")), shared):
            _same(a, s)


def test_a_stochastic_policy_keeps_its_own_generator(model32) -> None:
    """random with seeds 1 and 2 at each budget: each run draws from its own generator (its graded branch from a
    fork of it), so every run equals its separate run, and the two seeds do evict differently."""
    shared = generate_shared(model32, _jobs(["random"], "blockwise", seeds=(1, 2)))
    alone = _separate(model32, _jobs(["random"], "blockwise", seeds=(1, 2)))
    for a, s in zip(alone, shared):
        _same(a, s)
    seed1, seed2 = shared[0].trace, shared[1].trace  # N = 40: seeds 1 and 2
    assert any(not torch.equal(x, y) for f1, f2 in zip(seed1, seed2) for x, y in zip(f1, f2) if x is not None)


def test_lm_score(model32) -> None:
    """The LM score's per-position log-probabilities (settings.score_from) from shared forwards are the solo ones."""
    names = ["keydiff", "tova", "full"]
    for protocol in ("blockwise", "prefill_once"):
        shared = generate_shared(model32, _jobs(names, protocol, score_from=20))
        for a, s in zip(_separate(model32, _jobs(names, protocol, score_from=20)), shared):
            assert a.lm_logprobs and len(a.lm_logprobs) == T - 1 - 20
            _same(a, s)


def test_jobs_of_different_prompts_do_not_share(model32) -> None:
    """Two samples' prompts: each its own trunk, results in job order."""
    jobs = _jobs(["keydiff"], "prefill_once", budgets=(40, 64))
    other = [Job(_prompt(90, 5), make_policy("keydiff", n, 1), j.settings, answer_ids=ANSWER,
                 observer=Observer(trace=True)) for n, j in zip((40, 64), jobs)]
    shared = generate_shared(model32, [jobs[0], other[0], jobs[1], other[1]])
    assert [s.shared_with for s in shared] == [2, 2, 2, 2]
    assert [s.prompt_tokens for s in shared] == [T, 90, T, 90]
    fresh = _jobs(["keydiff"], "prefill_once", budgets=(40, 64))
    fresh_other = [Job(_prompt(90, 5), make_policy("keydiff", n, 1), j.settings, answer_ids=ANSWER,
                       observer=Observer(trace=True)) for n, j in zip((40, 64), fresh)]
    for a, s in zip(_separate(model32, [fresh[0], fresh_other[0], fresh[1], fresh_other[1]]), shared):
        _same(a, s)


def test_bench_sweep_measures_both_ways(tmp_path) -> None:
    """kvbench-bench --sweep on a scaled-down prefill_once design, shared one fork at a time and three at a time: one
    row per way, every way timed, every prediction of the exact way equal."""
    import json

    from kvbench.bench import cli as bench
    from kvbench.bench.sweep import sweep_goal_lines

    out = tmp_path / "sweep.json"
    rc = bench.main(["--arch", "tiny-llama", "--sweep", "prefill_once", "--policies", "keydiff,tova,random",
                     "--budgets", "40,64", "--lengths", "101", "--new-tokens", "4", "--samples", "2", "--threads", "1",
                     "--clock", "cpu", "--fork-batch", "1,3", "--out", str(out), "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    row, batched = data["rows"]
    assert (row["fork_batch"], batched["fork_batch"]) == (1, 3) and batched["separate_s"] == row["separate_s"]
    assert batched["pairs"] == 12 and batched["shared_s"] > 0
    assert (row["design"], row["configurations"], row["samples"], row["pairs"]) == ("prefill_once", 6, 2, 12)
    assert row["identical"] == 12 and row["first_difference"] is None
    assert row["shared_s"] > 0 and row["separate_s"] > 0 and row["shared_forward_s"] > 0
    assert data["goals"] == sweep_goal_lines(data["rows"])
    assert "identical predictions" in (tmp_path / "sweep.md").read_text()
