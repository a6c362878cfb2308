"""Batched samples (`generate_batch`, `batch_size=K`): each sample's result is the one it gets alone.

Every policy under every protocol, prompts of different lengths (so different tail blocks and prompt-block counts),
samples that stop at different steps (their own stop token, their own max_new_tokens) and leave the batch, a graded
branch per sample. In float64 the batched and the batch-1 runs must give the same tokens, decoding steps, peak
tokens and bytes and the same kept positions before every prompt forward (the only arithmetic difference, k rows
through a weight product instead of 1, is then ~1e-16 and cannot flip a token or a selection). The samples' policies
are copies of one (one seed), each started with its sample as the run loop starts it (`start_sample`), so they select
alike (`slot_key`) and go as the rows of one cache; Random's per-sample generator makes each of its samples run alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kvbench.bench.setup import make_policy
from kvbench.engine.generate import GenerationSettings, Job, Observer, generate, generate_batch
from kvbench.options import PROTOCOLS
from kvbench.run.config import group_choices

from helpers import float64_model, held_positions, installed_model, load_script, run_config

POLICIES = group_choices("policy")  # every conf/policy file, the full baseline included
N, B = 40, 16  # N above the 32 recent tokens SnapKV's family protects
LENGTHS = (101, 64, 133, 84)  # 7 / 4 / 9 / 6 prompt forwards; tails of 5, 0, 5 and 4 tokens
NEW = (9, 6, 12, 9)  # per-sample max_new_tokens


@pytest.fixture(scope="module")
def model64() -> Any:
    return float64_model(2)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(8, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _jobs(name: str, protocol: str, stops: list[tuple[int, ...]] | None = None, graded: bool = True,
          scenario: str = "question_aware") -> list[Job]:
    jobs = []
    for j, (n, new) in enumerate(zip(LENGTHS, NEW)):
        settings = GenerationSettings(block=B, max_new_tokens=new, protocol=protocol, scenario=scenario,
                                      context_tokens=n - 9 if scenario == "context_only" else None,
                                      stop_ids=stops[j] if stops else ())
        jobs.append(Job(_prompt(n, j), _policy(name, j), settings,
                        answer_ids=_prompt(4 + j, 100 + j) if graded else None))
    return jobs


def _policy(name: str, sample: int, budget: int = N) -> Any:
    """Sample `sample`'s copy of the run's policy (one seed for the run), started as the run loop starts it."""
    policy = make_policy(name, budget, seed=1)
    policy.start_sample(sample)
    return policy


def _same(alone: Any, batched: Any) -> None:
    assert batched.tokens == alone.tokens
    assert batched.decode_steps == alone.decode_steps
    assert (batched.peak_kv_tokens, batched.kv_bytes_peak) == (alone.peak_kv_tokens, alone.kv_bytes_peak)
    if alone.answer_logprob is None:
        assert batched.answer_logprob is None
    else:
        assert batched.answer_logprob == pytest.approx(alone.answer_logprob, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("name, protocol", [
    pytest.param(name, protocol, id=f"{name}-{protocol}")
    for protocol in PROTOCOLS for name in POLICIES])
def test_batched_equals_each_sample_alone(model64, name: str, protocol: str) -> None:
    alone = [generate(model64, j.policy, list(j.input_ids), j.settings, answer_ids=j.answer_ids)
             for j in _jobs(name, protocol)]
    # Sample 1 stops on the first token of its answer that did not occur before (a stop id emitted earlier would
    # have stopped it earlier), so it leaves the batch early; the others run to their own max_new_tokens (6-12).
    first = alone[1].tokens
    k = next((i for i in range(1, len(first)) if first[i] not in first[:i]), 0)
    stops: list[tuple[int, ...]] = [(), (first[k],), (), ()]
    job1 = _jobs(name, protocol, stops)[1]
    alone[1] = generate(model64, job1.policy, list(job1.input_ids), job1.settings, answer_ids=job1.answer_ids)
    assert len(alone[1].tokens) == k < NEW[1]
    batched = generate_batch(model64, _jobs(name, protocol, stops))
    for a, b in zip(alone, batched):
        _same(a, b)
    # the four samples are the rows of one cache; random's generator is per sample (sample_state): each alone
    assert [b.batch_size for b in batched] == ([1, 1, 1, 1] if name == "random" else [4, 4, 4, 4])


def test_pyramidkv_capacity_follows_its_growing_budget(model64) -> None:
    """PyramidKV at N = 40 (window 8, F = 32) on 2 layers, a 64-token prompt in one forward, evicting while decoding:
    with seen >= 2F = 64 its first layer's share 2F - F / 20 = 62.4 is capped at seen - 8, so layer 0 keeps
    N_0 = 8 + (seen - 8) = seen tokens (layer 1: 2 x 40 - seen): it never evicts. Before decoding step k = 1..5 it
    holds the prompt and the k - 1 tokens fed back, 64 .. 68, positions 0 .. 63 + k - 1: nothing may be lost."""
    policy = _policy("pyramidkv", 1)
    policy.attach(2, 64)
    assert [policy.layer_budget(i, 64) for i in range(2)] == [64, 16]
    assert [policy.layer_budget(i, 66) for i in range(2)] == [66, 14]
    res = generate(model64, _policy("pyramidkv", 1), _prompt(64, 1),
                   GenerationSettings(block=B, max_new_tokens=6, protocol="prefill_once_decode_evict"),
                   observer=Observer(trace=True))
    layer0 = [step[0][0] for step in held_positions(res.trace)[1:]]  # layer 0, KV head 0, before each step
    assert layer0 == [list(range(64 + k)) for k in range(5)]


def test_context_only_batches(model64) -> None:
    """The question after context_tokens goes in unevicted (a forward of 9 tokens, alone or with the others)."""
    jobs = _jobs("keydiff", "blockwise", scenario="context_only")
    alone = [generate(model64, j.policy, list(j.input_ids), j.settings, answer_ids=j.answer_ids)
             for j in _jobs("keydiff", "blockwise", scenario="context_only")]
    for a, b in zip(alone, generate_batch(model64, jobs)):
        _same(a, b)


def test_forced_tokens_and_logits_per_sample(model64) -> None:
    """Teacher forcing (the fidelity task) per sample: each sample's observer sees its own logits, equal to alone."""
    seen: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    alone_seen: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    jobs, alone = [], []
    for j in (0, 1):
        forced = _prompt(5 + j, 50 + j)
        s = GenerationSettings(block=B, max_new_tokens=10, protocol="blockwise")
        ids = _prompt(LENGTHS[j], j)
        alone.append(generate(model64, _policy("snapkv", j), ids, s, forced=forced,
                              observer=Observer(on_logits=alone_seen[j].append)))
        jobs.append(Job(ids, _policy("snapkv", j), s, forced=forced, observer=Observer(on_logits=seen[j].append)))
    batched = generate_batch(model64, jobs)
    assert [b.batch_size for b in batched] == [2, 2]
    for j in (0, 1):
        assert batched[j].tokens == alone[j].tokens == _prompt(5 + j, 50 + j)
        assert len(seen[j]) == len(alone_seen[j]) == 5 + j
        for x, y in zip(seen[j], alone_seen[j]):
            assert x.shape == (1, y.shape[-1]) and torch.allclose(x, y, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", POLICIES)
def test_kept_positions_of_every_prompt_forward_equal_batch_1s(model64, name: str) -> None:
    """The positions each head holds before every prompt forward (the trace) equal batch 1's. (The old engine also
    promised this bit for bit in float32, by running prompt blocks of >= 4 rows; the static cache promises results
    equal to batch 1's but for a K-row product's rounding, so the comparison is in float64.) A row's own prompt
    forwards come first in the batch's rounds (round i is each row's i-th block), so the first ceil(T / 16) entries
    of its trace (the full cache: 1) are its prompt's."""
    def job(j: int) -> Job:
        s = GenerationSettings(block=B, max_new_tokens=1, protocol="blockwise")  # one new token: no decoding forward
        return Job(_prompt(LENGTHS[j], j), _policy(name, j), s, observer=Observer(trace=True))

    alone = [generate(model64, jb.policy, list(jb.input_ids), jb.settings, observer=jb.observer)
             for jb in (job(j) for j in range(4))]
    batched = generate_batch(model64, [job(j) for j in range(4)])
    prompt_forwards = [1 if name == "full" else -(-n // B) for n in LENGTHS]  # 7, 4, 9, 6
    for a, b, n in zip(alone, batched, prompt_forwards):
        assert len(a.trace) == n and len(b.trace) >= n
        assert held_positions(b.trace[:n]) == held_positions(a.trace)


def test_batch_memory_is_the_sum_of_the_samples_caches(model64) -> None:
    """Bounded policy: each cache holds at most N + B tokens per KV head, so the batch's K+V never exceeds
    K x layers x 2 (K and V) x h_kv x (N + B) x head_dim x 8 bytes (float64); worked out from tiny-llama's config:
    4 x 2 x 2 x 2 x 56 x 64 x 8 = 917504 bytes. Prompts are long enough that every sample reaches N + B."""
    jobs = _jobs("keydiff", "blockwise", graded=False)
    batched = generate_batch(model64, jobs)
    assert all(r.peak_kv_tokens == N + B for r in batched)
    assert max(r.batch_kv_bytes_peak for r in batched) == 917504
    assert all(r.kv_bytes_peak == 2 * 2 * 2 * (N + B) * 64 * 8 for r in batched)


def test_sliding_window_models_batch_too() -> None:
    """A model with sliding-window layers batches like any other (the static cache bounds those layers per row by
    position); in float64 each sample's tokens are its own. (Before the static cache such a model ran one sample at a
    time, with a note in metrics.json: kvbench.run.loop.batching_note, removed.)"""
    model, _ = installed_model("tiny-mistral", output_scale=1.0, sliding_window=16)
    model = model.double()
    jobs = _jobs("keydiff", "blockwise", graded=False)[:2]
    alone = [generate(model, j.policy, list(j.input_ids), j.settings) for j in _jobs("keydiff", "blockwise",
                                                                                       graded=False)[:2]]
    batched = generate_batch(model, jobs)
    assert [r.batch_size for r in batched] == [2, 2]
    for a, b in zip(alone, batched):
        _same(a, b)


def test_a_batched_run_writes_the_batch_1_records_and_resumes(tmp_path) -> None:
    """batch_size=3 over 8 jsonl samples of different lengths (float64): every record equals the batch_size=1 run's
    but for timing and its `batch` entry; metrics.json says the batch; a run cut after its first batch resumes to
    the same records."""
    import json

    from kvbench.run.app import Session, run_one
    from test_resume import TIMING, _cfg, _data

    data = _data(tmp_path)
    session = Session()

    def records(path) -> list[dict]:
        rows = [json.loads(line) for line in (path / "predictions.jsonl").read_text().splitlines()]
        return sorted(({k: v for k, v in r.items() if k not in TIMING + ("batch",)} for r in rows),
                      key=lambda r: r["id"])

    one = run_one(_cfg(data, **{"model.dtype": "float64"}), "keydiff", tmp_path / "one", session)
    three = run_one(_cfg(data, **{"model.dtype": "float64", "batch_size": 3}), "keydiff", tmp_path / "three", session)
    assert records(tmp_path / "three") == records(tmp_path / "one")
    assert one["scores"] == three["scores"] and "batch" not in one
    assert three["batch"] == {"size": 3} and three["stats"]["batch_size"] == 3
    # the batch's K+V: at most 3 caches of N + B = 64 tokens, 2 layers x K,V x 2 heads x 64 dims x 8 bytes
    assert three["stats"]["batch_kv_bytes_peak"] <= 3 * 64 * 2 * 2 * 2 * 64 * 8
    # cut after the first batch (3 records), then resumed
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "predictions.jsonl").write_text("".join((tmp_path / "three" / "predictions.jsonl").read_text()
                                                   .splitlines(keepends=True)[:3]))
    (cut / "run.json").write_text((tmp_path / "three" / "run.json").read_text())
    run_one(_cfg(data, **{"model.dtype": "float64", "batch_size": 3}), "keydiff", cut, session)
    assert records(cut) == records(tmp_path / "one")


def test_a_reference_task_batches_too(tmp_path) -> None:
    """fidelity (label-free: the full cache's continuation, then the policy forced along it), 3 prompts of different
    lengths in float64: batch_size=2 gives the batch-1 records but for timing and `batch`."""
    import json

    from kvbench.run.app import Session, run_one

    def run(name: str, *extra: str) -> list[dict]:
        cfg = run_config("model=tiny-llama", "model.dtype=float64", "task=fidelity", "task.lengths=[60,90]",
                         "task.samples_per_length=2", "task.new_tokens=5", "policy=keydiff", "budget=40", "block=16",
                         "progress=false", *extra)
        metrics = run_one(cfg, "keydiff", tmp_path / name, Session())
        assert ("batch" in metrics) == bool(extra) and (not extra or metrics["batch"] == {"size": 2})
        rows = [json.loads(line) for line in (tmp_path / name / "predictions.jsonl").read_text().splitlines()]
        return sorted(({k: v for k, v in r.items() if not k.endswith("_s") and k != "batch"} for r in rows),
                      key=lambda r: r["id"])

    one, two = run("one"), run("two", "batch_size=2")
    assert len(one) == 4 and two == one


def test_batch_identity_script_counts_identical_and_differing_samples(tmp_path, capsys) -> None:
    """scripts/batch_identity.py on a tiny committed run (float64, 8 jsonl samples, batch 1) rerun at batch 2: all
    identical; then with one committed record planted different (a token from position 3 on, the graded score by
    0.5): 7 identical, that sample named with its first differing token, the graded difference 5.0e-01."""
    import json

    from kvbench.run.app import Session, run_one
    from test_resume import _cfg, _data

    script = load_script("batch_identity")
    run = tmp_path / "committed"
    run_one(_cfg(_data(tmp_path), **{"model.dtype": "float64"}), "keydiff", run, Session())
    out = tmp_path / "identity.md"
    args = ["--batch", "2", "--scratch", str(tmp_path / "scratch"), "--out", str(out), str(run)]
    assert script.main(args) == 0
    assert f"| `{run.as_posix()}` | keydiff | 8 | 8 | 0.0e+00 | - |" in out.read_text()
    rerun_cfg = yaml.safe_load((tmp_path / "scratch" / "committed" / "config.yaml").read_text())
    assert rerun_cfg["batch_size"] == 2

    rows = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    rows[5]["tokens"][3] += 1
    rows[5]["answer_logprob"] -= 0.5
    (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert script.main([*args, "--reuse"]) == 0
    line = next(ln for ln in out.read_text().splitlines() if ln.startswith(f"| `{run.as_posix()}`"))
    assert line.startswith(f"| `{run.as_posix()}` | keydiff | 8 | 7 | 5.0e-01 | {rows[5]['id']}: tokens from 3, "
                           "fields tokens |")

    capsys.readouterr()
    assert script.main(["--out", str(out), str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip().endswith("is not a run directory (config.yaml, predictions.jsonl)")
    bad = tmp_path / "bad"  # a run directory whose config.yaml is not a kvbench run's: one line, nothing rerun
    bad.mkdir()
    (bad / "config.yaml").write_text("budget: 64\n")
    (bad / "predictions.jsonl").write_text("")
    assert script.main(["--scratch", str(tmp_path / "scratch_bad"), "--out", str(tmp_path / "bad.md"), str(run),
                        str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("no task section with a _target_ (not a kvbench run's config)") and "\n" not in err
    assert not (tmp_path / "scratch_bad").exists() and not (tmp_path / "bad.md").exists()


def test_batch_identity_keeps_runs_of_one_leaf_name_apart(tmp_path) -> None:
    """Two committed runs in directories of one leaf name (as every `shard6of11` of a sweep), KeyDiff and
    StreamingLLM, rerun together (--share): each rerun has its own scratch directory and is compared with its own
    committed run, so both are identical; sharing one directory, one would be compared with the other's records."""
    from kvbench.run.app import Session, run_one
    from test_resume import _cfg, _data

    script = load_script("batch_identity")
    data, session = _data(tmp_path), Session()
    runs = [tmp_path / p / "committed" for p in ("keydiff", "streamingllm")]
    for run, name in zip(runs, ("keydiff", "streamingllm")):
        run_one(_cfg(data, **{"model.dtype": "float64", "policy": name}), name, run, session)
    assert script.scratch_names(runs) == [Path("keydiff/committed"), Path("streamingllm/committed")]
    assert script.scratch_names([runs[0], tmp_path / "other"]) == [Path("committed"), Path("other")]
    out = tmp_path / "identity.md"
    assert script.main(["--batch", "1", "--share", "--scratch", str(tmp_path / "scratch"), "--out", str(out),
                        *map(str, runs)]) == 0
    for run, name in zip(runs, ("keydiff", "streamingllm")):
        assert f"| `{run.as_posix()}` | {name} | 8 | 8 | 0.0e+00 | - |" in out.read_text()
    assert "(the runs below as one sweep, share=true, share_rows=auto, batch_size=1)" in out.read_text()
    assert (tmp_path / "scratch" / "streamingllm" / "committed" / "predictions.jsonl").is_file()


def test_compose_shards_by_hand() -> None:
    """A run of shard 4/8 holds samples 4, 12, 20, 28, ...; its sub-shard 1/2 (positions 1, 3, ... of those) is
    12, 28, 44, ... = indices 12 mod 16; 0/1000 of it is its first sample alone (4 mod 8000)."""
    compose = load_script("batch_identity").compose_shards
    assert compose("4/8", "1/2") == "12/16"
    assert compose("4/8", "0/1000") == "4/8000"
    assert (compose(None, "0/15"), compose("4/8", None), compose(None, None)) == ("0/15", "4/8", None)


def test_logit_margin_names_the_step_where_a_committed_token_is_not_the_argmax(tmp_path, capsys) -> None:
    """scripts/logit_margin.py feeds a run's own tokens back: on an untouched float64 run every step's argmax is the
    committed token; with token 3 of one sample planted different, step 3 is where they part, shown with both logits
    and a positive gap (the planted token is not the argmax)."""
    import json

    from kvbench.run.app import Session, run_one
    from test_resume import _cfg, _data

    script = load_script("logit_margin")
    run = tmp_path / "committed"
    run_one(_cfg(_data(tmp_path), **{"model.dtype": "float64"}), "keydiff", run, Session())
    assert script.main([str(run), "--sample", "s5"]) == 0
    assert "today's argmax is the committed token at every step" in capsys.readouterr().out
    # --steps shows a step where today agrees: the best other token, behind the committed one (a negative gap)
    assert script.main([str(run), "--sample", "s5", "--steps", "2"]) == 0
    step2 = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 2 |")).split(" | ")
    assert float(step2[-1].rstrip(" |")) < 0
    assert script.main([str(run), "--sample", "s5", "--steps", "two"]) == 2

    rows = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    planted = rows[5]["tokens"][3] + 1
    rows[5]["tokens"][3] = planted
    (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "margin.md"
    assert script.main([str(run), "--sample", "s5", "--out", str(out)]) == 0
    text = out.read_text()
    assert "parts from the committed token at step(s) [3" in text
    step3 = next(ln for ln in text.splitlines() if ln.startswith("| 3 |")).split(" | ")
    assert step3[1].startswith(f"{planted} ") and float(step3[-1].rstrip(" |")) > 0
    assert script.main([str(run), "--sample", "nope"]) == 2
    (run / "config.yaml").write_text("budget: 64\n")  # not a kvbench run's config: one line, exit 2
    capsys.readouterr()
    assert script.main([str(run), "--sample", "s5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("no task section with a _target_ (not a kvbench run's config)") and "\n" not in err


def test_reproduce_summary_by_hand(tmp_path) -> None:
    """scripts/reproduce.py's README row per folder: runs, samples, identical, the largest graded move and the
    differing samples by run, from batch_identity's --json rows (hand-made here); a folder without runs: exit 2."""
    import json

    script = load_script("reproduce")
    rows = [{"run": "results/x/runs/m/t/a_N512", "samples": 2, "identical": 2, "graded_moved": 1e-6, "differ": []},
            {"run": "results/x/runs/m/t/b_N512", "samples": 2, "identical": 1, "graded_moved": 3.4e-5,
             "differ": ["L2000_D10"]}]
    (tmp_path / "x.json").write_text(json.dumps(rows))
    text = script.summary(["x"], tmp_path, "0/1000")
    assert "| x | 2 | 4 | 3 | 3.4e-05 | `b_N512` L2000_D10 |" in text
    assert script.main(["no-such-folder", "--out", str(tmp_path)]) == 2


def test_reproduce_reuse_reruns_nothing_and_redraws_the_summary(tmp_path) -> None:
    """--reuse with a folder's rerun rows already in --out: no rerun starts (no scratch log), margins.md says no tokens
    differ and README.md's row is drawn from the rows given (hand-made: 4 runs, 3 identical, one graded move)."""
    import json

    script = load_script("reproduce")
    rows = [{"run": f"results/evidence_lm/runs/r{i}", "samples": 1, "identical": int(i != 2),
             "graded_moved": 2e-6 * i, "differ": []} for i in range(4)]
    (tmp_path / "evidence_lm.json").write_text(json.dumps(rows))
    scratch = tmp_path / "scratch"
    assert script.main(["evidence_lm", "--reuse", "--out", str(tmp_path), "--scratch", str(scratch)]) == 0
    assert not (scratch / "evidence_lm.log").exists()
    assert "Every rerun sample's tokens equal the committed ones." in (tmp_path / "margins.md").read_text()
    assert "| evidence_lm | 4 | 4 | 3 | 6.0e-06 | - |" in (tmp_path / "README.md").read_text()
