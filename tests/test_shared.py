"""A sweep's runs of one sample as the rows of one cache (`generate_batch`): every run's result is the one `generate`
gives it alone.

A sweep's runs of one sample (every policy x budgets below and above the prompt, under each protocol) go through
`generate_batch` together and one by one through `generate`, in float64 (where a product over more rows cannot round
a near-tie the other way); tokens, graded log-probabilities, LM scores, peak tokens and bytes, decoding steps and the
positions each head holds before every forward must be equal exactly (==). The runs whose policies select alike (one
class and options, budgets aside: `slot_key`) are the rows of one cache; the others (Random's per-sample generator,
another class) run alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvbench.bench.setup import make_policy
from kvbench.engine.generate import GenerationResult, GenerationSettings, Job, Observer, generate, generate_batch
from kvbench.options import PROTOCOLS
from kvbench.run.config import group_choices

from helpers import float64_model, held_positions, installed_model

POLICIES = group_choices("policy")  # every conf/policy file, the full baseline included
T, B = 101, 16  # 7 prompt blocks (6 of 16 tokens, a tail of 5)
BUDGETS = (40, 64, 200)  # first eviction after block 3 / block 5 / never (above the prompt)
ANSWER = [17, 3, 250, 41]


@pytest.fixture(scope="module")
def model64() -> Any:
    return float64_model(2)


def _prompt(n: int = T, seed: int = 0) -> list[int]:
    return torch.randint(8, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _jobs(names: list[str], protocol: str, budgets: tuple[int, ...] = BUDGETS, scenario: str = "question_aware",
          score_from: int | None = None, seeds: tuple[int, ...] = (1,), sample: int = 7, n: int = T,
          prompt_seed: int = 0, trace: bool = True) -> list[Job]:
    jobs = []
    for name in names:
        for budget in budgets if name != "full" else budgets[:1]:
            for seed in seeds:
                policy = make_policy(name, budget, seed)
                policy.start_sample(sample)  # as the run loop does before each sample (random: its generator)
                settings = GenerationSettings(block=B, max_new_tokens=8, protocol=protocol, scenario=scenario,
                                              context_tokens=n - 9 if scenario == "context_only" else None,
                                              score_from=score_from)
                jobs.append(Job(_prompt(n, prompt_seed), policy, settings, answer_ids=ANSWER,
                                observer=Observer(trace=trace)))
    return jobs


def _separate(model: Any, jobs: list[Job]) -> list[GenerationResult]:
    return [generate(model, j.policy, list(j.input_ids), j.settings, answer_ids=j.answer_ids, observer=j.observer)
            for j in jobs]


def _same(alone: GenerationResult, batched: GenerationResult, trace: bool = True) -> None:
    assert batched.tokens == alone.tokens
    assert batched.answer_logprob == alone.answer_logprob  # exactly, in float64
    assert batched.decode_steps == alone.decode_steps
    assert (batched.peak_kv_tokens, batched.kv_bytes_peak) == (alone.peak_kv_tokens, alone.kv_bytes_peak)
    assert batched.layer_tokens == alone.layer_tokens
    assert (batched.lm_logprobs, batched.lm_correct) == (alone.lm_logprobs, alone.lm_correct)
    # the positions each head holds before every forward (a batch's rows have the batch's slot count, so the slots
    # they sit in are not compared: only which positions are held)
    if not trace:
        return
    assert len(batched.trace) == len(alone.trace)
    assert held_positions(batched.trace) == held_positions(alone.trace)


def _expected_rows(names: list[str], budgets: tuple[int, ...] = BUDGETS) -> list[int]:
    """Each job's batch size, by hand: a policy's budgets are one cache's rows; the full cache has one job (its
    budget is never used), random draws from its own generator per sample (sample_state), and h2o_original's recent
    window is half its budget (n_recent 20, 32, 100: options that differ), so each of their runs goes alone."""
    return [1 if name in ("full", "random", "h2o_original") else len(budgets)
            for name in names for _ in (budgets if name != "full" else budgets[:1])]


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_batch_equals_separate_for_every_policy(model64, protocol: str) -> None:
    """All policies x budgets 40, 64 (below the prompt) and 200 (above it) in one call: every result equals the
    job's own `generate`; a policy's three budgets went as the three rows of one cache."""
    jobs = _jobs(POLICIES, protocol)
    batched = generate_batch(model64, jobs)
    jobs = _jobs(POLICIES, protocol)
    for alone, res in zip(_separate(model64, jobs), batched, strict=True):
        _same(alone, res)
    assert [r.batch_size for r in batched] == _expected_rows(POLICIES)
    assert all(r.batch_kv_bytes_peak >= r.kv_bytes_peak for r in batched)


def test_batch_kv_bytes_peak_is_the_rows_held_together(model64) -> None:
    """GenerationResult.batch_kv_bytes_peak: the most K+V bytes the batch's rows held together, by hand.
    StreamingLLM at N = 40 and N = 200, T = 101, B = 16, no new tokens; per KV head after each block (before its
    eviction) the N = 40 row holds 16, 32, 48, 56, 56, 56, 45 and the N = 200 row 16, 32, ..., 96, 101: together
    32, 64, 96, 120, 136, 152, 146, at most 152 (block 6), against 56 + 101 = 157 for the sum of the rows' own
    peaks. x 2 layers x 2 heads = 608 tokens x 1,024 bytes (K+V, 2 x 64 float64) = 622,592."""
    jobs = [Job(_prompt(), make_policy("streamingllm", n, 1), GenerationSettings(block=B)) for n in (40, 200)]
    batched = generate_batch(model64, jobs)
    assert [r.kv_bytes_peak for r in batched] == [56 * 4 * 1024, 101 * 4 * 1024]  # each row's own peak
    assert [r.batch_kv_bytes_peak for r in batched] == [622_592] * 2


@pytest.mark.parametrize("protocol", ["blockwise", "prefill_once"])
def test_caches_decoding_together_equal_separate(model64, protocol: str) -> None:
    """`together`: every cache's decoding steps as the rows of one forward, each cache attending over and evicting its
    own rows (a cache each, or a policy's budgets as one cache's rows): every result equals the job's own `generate`
    (float64), and says it decoded as a row of all of them. A traced job decodes alone (its trace reads one cache)."""
    for rows in (1, None):
        together = generate_batch(model64, _jobs(POLICIES, protocol, trace=False), batch=rows, together=True)
        alone = _separate(model64, _jobs(POLICIES, protocol, trace=False))
        for a, res in zip(alone, together, strict=True):
            _same(a, res, trace=False)
        assert [r.batch_size for r in together] == [len(together)] * len(together)
    jobs = _jobs(["keydiff", "tova"], protocol, trace=False)
    jobs[0] = _jobs(["keydiff"], protocol)[0]  # traced
    mixed = generate_batch(model64, jobs, batch=1, together=True)
    assert [r.batch_size for r in mixed] == [1, 5, 5, 5, 5, 5]
    for a, res in zip(_separate(model64, _jobs(["keydiff", "tova"], protocol)), mixed, strict=True):
        _same(a, res, trace=res is mixed[0])


def test_caches_decoding_together_share_each_step(model64) -> None:
    """keydiff and tova at N = 40, 64, 200, 8 new tokens, a 4-token answer: each run feeds 7 decoding steps (the 8th
    token is not fed) and 3 graded steps (its fork, alone per cache). A cache each, alone: 6 x 10 = 60 one-token
    forwards of one row; decoding together: 7 forwards of 6 rows and 6 x 3 graded ones of one row."""
    seen: list[int] = []

    def hook(module: Any, args: Any, kwargs: dict) -> None:
        if kwargs["input_ids"].shape[1] == 1:
            seen.append(kwargs["input_ids"].shape[0])

    handle = model64.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        generate_batch(model64, _jobs(["keydiff", "tova"], "blockwise", trace=False), batch=1)
        assert seen == [1] * 60
        seen.clear()
        generate_batch(model64, _jobs(["keydiff", "tova"], "blockwise", trace=False), batch=1, together=True)
    finally:
        handle.remove()
    assert sorted(seen) == [1] * 18 + [6] * 7


def test_caches_decoding_together_hold_the_sum_of_their_peaks(model64) -> None:
    """StreamingLLM at N = 40 and N = 200 as two caches (T = 101, B = 16, 2 new tokens: one decoding step), decoding
    together, so both are held at once: per KV head the N = 40 cache holds at most 56 (40 + a block), the N = 200 one
    102 (the prompt and the step's token): 158 x 2 layers x 2 heads x 1,024 bytes (K+V, 2 x 64 float64) = 647,168,
    what each result reports as its batch's; each its own peak as alone."""
    jobs = [Job(_prompt(), make_policy("streamingllm", n, 1), GenerationSettings(block=B, max_new_tokens=2))
            for n in (40, 200)]
    res = generate_batch(model64, jobs, batch=1, together=True)
    assert [r.kv_bytes_peak for r in res] == [56 * 4 * 1024, 102 * 4 * 1024]
    assert [(r.batch_size, r.batch_kv_bytes_peak) for r in res] == [(2, 647_168)] * 2


def _count_prompt_forwards(model: Any) -> tuple[list[int], Any]:
    count = [0]

    def hook(module: Any, args: Any, kwargs: dict) -> None:
        if kwargs["input_ids"].shape[1] > 1:  # a prompt forward (decoding and graded steps feed one token)
            count[0] += 1

    return count, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_a_policys_budgets_share_every_forward(model64) -> None:
    """keydiff and tova at N = 40, 64, 200, B = 16, T = 101 (7 prompt forwards): alone 6 x 7 = 42 prompt forwards;
    as the rows of one cache per policy 2 x 7 = 14; at most 2 rows a cache (batch=2: {40, 64} and {200} per policy)
    4 x 7 = 28. Every way gives each run its own result."""
    count, handle = _count_prompt_forwards(model64)
    try:
        batched = generate_batch(model64, _jobs(["keydiff", "tova"], "blockwise"))
        assert count[0] == 14
        count[0] = 0
        pairs = generate_batch(model64, _jobs(["keydiff", "tova"], "blockwise"), batch=2)
        assert count[0] == 28
        count[0] = 0
        alone = _separate(model64, _jobs(["keydiff", "tova"], "blockwise"))
        assert count[0] == 42
    finally:
        handle.remove()
    for a, s, p in zip(alone, batched, pairs, strict=True):
        _same(a, s)
        _same(a, p)
    assert [s.batch_size for s in batched] == [3, 3, 3] * 2
    assert [p.batch_size for p in pairs] == [2, 2, 1] * 2


def test_prefill_once_one_forward_per_cache(model64) -> None:
    """prefill_once: the whole prompt is one forward per cache. keydiff, snapkv, streamingllm, h2o at N = 40, 64
    and the full cache: four caches of two rows and the full cache alone, 5 prompt forwards (9 alone)."""
    names = ["keydiff", "snapkv", "streamingllm", "full", "h2o"]
    count, handle = _count_prompt_forwards(model64)
    try:
        batched = generate_batch(model64, _jobs(names, "prefill_once", budgets=(40, 64)))
    finally:
        handle.remove()
    assert count[0] == 5
    assert [s.batch_size for s in batched] == [2, 2, 2, 2, 2, 2, 1, 2, 2]
    for a, s in zip(_separate(model64, _jobs(names, "prefill_once", budgets=(40, 64))), batched, strict=True):
        _same(a, s)


def test_shared_bytes_bound() -> None:
    """The bound worked out by hand for tiny-llama (2 layers, 4 query / 2 KV heads, head_dim 64, float32): per slot
    of one head of one layer, K+V 2 x 64 x 4 = 512 bytes, its position (int64) 8 and per-token state (4 x float32)
    16: 536, x 2 heads = 1,072; TOVA reads its window's attention (query_window 1): 4 query heads x 2 rows x 4 = 32
    a slot of a layer; x 2 layers = 2,208 per slot of a row. T = 101, 8 new tokens + a 4-token answer: 113 slots a
    row. Five jobs (K-norm, StreamingLLM, KeyDiff, TOVA at N = 64, the full cache): 5 x 113 x 2,208 = 1,247,520; at
    most 1 row a cache: that row and up to 2 shared trunks, 3 x 113 x 2,208 = 748,512; decoding together, every
    cache is held with them: 7 x 113 x 2,208 = 1,746,528. Without TOVA (4 jobs): 4 x 113 x 2,144 = 969,088."""
    from kvbench.run.loop import shared_bytes

    model32 = installed_model("tiny-llama", output_scale=1.0)[0]
    jobs = []
    for name, budget in (("knorm", 64), ("streamingllm", 64), ("keydiff", 64), ("tova", 64), ("full", 200)):
        policy = make_policy(name, budget, 1)
        jobs.append(Job(_prompt(), policy, GenerationSettings(block=B, max_new_tokens=8), answer_ids=ANSWER))
    assert shared_bytes(model32, jobs) == 1_247_520
    assert shared_bytes(model32, jobs, batch=1) == 748_512
    assert shared_bytes(model32, jobs, batch=1, together=True) == 1_746_528
    assert shared_bytes(model32, [j for j in jobs if j.policy.name != "tova"]) == 969_088


def test_context_only(model64) -> None:
    """The question after context_tokens goes in unevicted (frozen): the same as a row of a batch as alone."""
    names = ["keydiff", "snapkv", "h2o", "adakv", "full"]
    for protocol in ("blockwise", "prefill_once"):
        batched = generate_batch(model64, _jobs(names, protocol, scenario="context_only"))
        for a, s in zip(_separate(model64, _jobs(names, protocol, scenario="context_only")), batched, strict=True):
            _same(a, s)
        assert [s.batch_size for s in batched] == _expected_rows(names)


def test_a_stochastic_policy_keeps_its_own_generator(model64) -> None:
    """random with seeds 1 and 2 at each budget: each run draws from its own generator (its graded branch from a
    fork of it) and runs alone, so every run equals its separate run, and the two seeds do evict differently."""
    batched = generate_batch(model64, _jobs(["random"], "blockwise", seeds=(1, 2)))
    alone = _separate(model64, _jobs(["random"], "blockwise", seeds=(1, 2)))
    for a, s in zip(alone, batched, strict=True):
        _same(a, s)
    assert all(s.batch_size == 1 for s in batched)
    seed1, seed2 = held_positions(batched[0].trace), held_positions(batched[1].trace)  # N = 40: seeds 1 and 2
    assert seed1 != seed2


def test_lm_score(model64) -> None:
    """The LM score's per-position log-probabilities (settings.score_from) as a batch's rows are the solo ones."""
    names = ["keydiff", "tova", "full"]
    for protocol in ("blockwise", "prefill_once"):
        batched = generate_batch(model64, _jobs(names, protocol, score_from=20))
        for a, s in zip(_separate(model64, _jobs(names, protocol, score_from=20)), batched, strict=True):
            assert a.lm_logprobs and len(a.lm_logprobs) == T - 1 - 20
            _same(a, s)


def _two_prompts(protocol: str) -> list[Job]:
    a = _jobs(["keydiff"], protocol, budgets=(40, 64))
    b = _jobs(["keydiff"], protocol, budgets=(40, 64), n=90, prompt_seed=5)
    return [a[0], b[0], a[1], b[1]]


@pytest.mark.parametrize("protocol", ["blockwise", "prefill_once"])
def test_jobs_of_different_prompts(model64, protocol: str) -> None:
    """Two samples' prompts (101 and 90 tokens): rows of one cache (the shorter left-padded), results in job order,
    each its own; the 101-token rows' traces too (the trace of a row with fewer forwards than the batch: below)."""
    batched = generate_batch(model64, _two_prompts(protocol))
    assert [s.prompt_tokens for s in batched] == [T, 90, T, 90]
    assert [s.batch_size for s in batched] == [4, 4, 4, 4]
    for a, s in zip(_separate(model64, _two_prompts(protocol)), batched, strict=True):
        _same(a, s, trace=a.prompt_tokens == T)


def test_a_shorter_rows_trace_is_its_own_forwards(model64) -> None:
    """Observer(trace=True) records the positions held before each of the run's own forwards: the 90-token prompt
    in blocks of 16 is 6 forwards (5 x 16 + 10), then 7 decoding steps (8 new tokens, the last never fed back):
    13, as alone, though its batch's 101-token rows take 7 prompt forwards (14 in all)."""
    batched = generate_batch(model64, _two_prompts("blockwise"))
    assert [len(s.trace) for s in batched] == [14, 13, 14, 13]


def test_bench_sweep_measures_both_ways(tmp_path) -> None:
    """kvbench-bench --sweep on a scaled-down prefill_once design, shared one row at a time and three at a time: one
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
    assert row["shared_s"] > 0 and row["separate_s"] > 0
    assert data["goals"] == sweep_goal_lines(data["rows"])
    assert "identical predictions" in (tmp_path / "sweep.md").read_text()
    assert len(row["sample_ratios"]) == 2 and all(x > 0 for x in row["sample_ratios"])


def test_bench_sweep_together_row(tmp_path) -> None:
    """--together: the shared way decodes every cache's steps as one forward's rows; its row and table say so."""
    import json

    from kvbench.bench import cli as bench

    out = tmp_path / "sweep.json"
    assert bench.main(["--arch", "tiny-llama", "--sweep", "six_policies", "--policies", "keydiff,tova", "--budgets",
                       "40", "--lengths", "61", "--block", "16", "--new-tokens", "3", "--samples", "1", "--threads",
                       "1", "--clock", "cpu", "--fork-batch", "1", "--together", "--out", str(out), "--quiet"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["fork_batch"], row["decode_together"], row["pairs"]) == (1, True, 2)
    assert "| 1 | yes |" in (tmp_path / "sweep.md").read_text()
    assert "(rows per cache 1, decoding together)" in json.loads(out.read_text())["goals"][0]


def test_bench_sweep_stopped_after_a_sample_leaves_it(tmp_path, monkeypatch) -> None:
    """After every sample but the last the files hold the samples so far: a sweep bench stopped in its second sample
    (here: the shared way fails once the first sample's files exist) leaves the first, said so in the header."""
    import json

    from kvbench.bench import cli as bench
    from kvbench.bench import sweep

    out = tmp_path / "sweep.json"
    real = sweep.generate_batch

    def stopping(*args, **kwargs):
        if out.exists():
            raise RuntimeError("stopped")
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep, "generate_batch", stopping)
    with pytest.raises(RuntimeError, match="stopped"):
        bench.main(["--arch", "tiny-llama", "--sweep", "prefill_once", "--policies", "keydiff,tova", "--budgets", "40",
                    "--lengths", "61", "--new-tokens", "2", "--samples", "3", "--threads", "1", "--clock", "cpu",
                    "--fork-batch", "1", "--out", str(out), "--quiet"])
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["samples"], row["pairs"], len(row["sample_ratios"])) == (1, 2, 1)
    assert "(the samples so far, of 3; the rest not measured)" in (tmp_path / "sweep.md").read_text()


def test_sweep_goal_lines_judge_the_samples_paired_ratios() -> None:
    """A design's per-sample ratios 1.38, 1.46, 1.48 against 1.4, on their logs 0.32208, 0.37844, 0.39204: mean 0.36419
    (geometric mean 1.44), sd 0.03709, se 0.02142, t(0.95, 2) 2.920: one-sided bounds exp(0.30165) = 1.35 and
    exp(0.42673) = 1.53, not resolved although the pooled 1.44x is over the line; 1.45, 1.50, 1.55 against 1.4: mean
    log 0.40509, se 0.01925: bounds 1.42 and 1.59, PASS. Two goals over samples: a Holm line follows."""
    from kvbench.bench.sweep import sweep_goal_lines

    rows = [{"design": "six_policies", "fork_batch": 1, "speedup": 1.44, "sample_ratios": [1.38, 1.46, 1.48],
             "goal": 1.4, "identical": 36, "pairs": 36},
            {"design": "niah_grid", "fork_batch": 0, "speedup": 1.5, "sample_ratios": [1.45, 1.50, 1.55],
             "goal": 1.4, "identical": 72, "pairs": 72}]
    lines = sweep_goal_lines(rows)
    assert lines[0] == ("six_policies (rows per cache 1): shared vs separate 1.44x configurations x samples per hour, "
                        "per sample 1.38, 1.46, 1.48: NOT RESOLVED at 95 % (goal >= 1.4x; 3 samples, geometric mean "
                        "1.44x, one-sided t bounds 1.35x and 1.53x); identical predictions 36/36")
    assert ("PASS at 95 % (goal >= 1.4x; 3 samples, geometric mean 1.50x, one-sided t bounds 1.42x and 1.59x)"
            in lines[1])
    assert "(rows per cache all)" in lines[1] and lines[2].startswith("HOLM  sweep goals, the 2 lines over samples")
    # a table from before the per-sample ratios: judged on its pooled ratio alone, said so
    pooled = {k: v for k, v in rows[0].items() if k != "sample_ratios"}
    assert sweep_goal_lines([pooled]) == ["six_policies (rows per cache 1): shared vs separate 1.44x configurations x "
                                          "samples per hour: PASS (goal >= 1.4x; one pooled ratio: no interval); "
                                          "identical predictions 36/36"]


def _trunk_jobs(names: list[str], protocol: str) -> list[Job]:
    """`_jobs` without the trace (a traced job records every forward, so it never takes a trunk)."""
    return [Job(j.input_ids, j.policy, j.settings, answer_ids=j.answer_ids) for j in _jobs(names, protocol)]


@pytest.mark.parametrize("protocol", ["blockwise", "prefill_once"])
def test_caches_of_one_prompt_share_a_trunk(model64, protocol: str) -> None:
    """Every policy x N = 40, 64, 200 on one prompt (T = 101): the caches start from one shared trunk, the prompt
    forwards before the first eviction that may drop one of their rows' tokens, and every result equals the job's
    own `generate` exactly (float64). The trunk's length, by hand: blockwise (B = 16) a cache with an N = 40 row
    evicts first after the block that ends at 48 (48 > 40), one with N = 64 alone at 80, N = 200 never (101: the
    prompt); K-norm evicts no layer of this 2-layer model (it skips layers 0 and 1): 101. prefill_once: the prompt's
    one forward (101) for all. Never: Random (per-sample generator); the full cache blockwise (its one cache has one
    forward, nothing to share with a cache of another plan)."""
    jobs = _trunk_jobs(POLICIES, protocol)
    batched = generate_batch(model64, jobs)
    for alone, res in zip(_separate(model64, _trunk_jobs(POLICIES, protocol)), batched, strict=True):
        _same(alone, res, trace=False)
    cases = {"random": [0] * 3, "knorm": [101] * 3, "h2o_original": [48, 80, 101], "full": [0]}
    want = [t for name in POLICIES for t in cases.get(name, [48] * 3)]
    if protocol == "prefill_once":
        want = [0 if name == "random" else 101 for name in POLICIES for _ in (BUDGETS if name != "full" else [0])]
    assert [r.trunk_tokens for r in batched] == want


def test_a_trunk_saves_its_forwards(model64) -> None:
    """keydiff, tova, snapkv at N = 40, 64, 200 (a cache each, blockwise B = 16, T = 101: 7 prompt forwards):
    the trunk does blocks 1-3 once (up to 48 > 40), each cache blocks 4-7: 3 + 3 x 4 = 15 prompt forwards (21
    without the trunk)."""
    count, handle = _count_prompt_forwards(model64)
    try:
        generate_batch(model64, _trunk_jobs(["keydiff", "tova", "snapkv"], "blockwise"))
    finally:
        handle.remove()
    assert count[0] == 15
