"""The language-modelling score under eviction (task=lm, GenerationSettings.score_from): every expected value comes
from an independent computation (one plain HF forward, the explicit float64 re-implementation driven by the run's
trace, hand arithmetic), never from the code under test."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbench.engine.cache import install
from kvbench.engine.generate import GenerationSettings, Observer, generate
from kvbench.metrics.lm import lm_summary, pooled_perplexity
from kvbench.models.tiny import build_tiny_model
from kvbench.policies.full import Full
from kvbench.policies.keydiff import KeyDiff
from kvbench.policies.knorm import KNorm
from kvbench.policies.streamingllm import StreamingLLM
from kvbench.run.loop import lm_score_start
from kvbench.run.settings import ConfigError, RunSettings
from kvbench.tasks.base import TaskEnv, TaskError
from kvbench.tasks.lm import LMTask

from float64_reference import reference_logits
from helpers import held_counts, held_positions, kvbench_main

ROOT = Path(__file__).resolve().parents[1]


def _model(layers: int = 2):
    model, tok = build_tiny_model("tiny-llama", output_scale=1.0, num_hidden_layers=layers)
    install(model)
    return model, tok


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(8, 500, (n,), generator=g).tolist()


def _plain_logprobs(model, ids: list[int], start: int) -> list[float]:
    """log p(ids[t+1] | ids[:t+1]) for t = start .. T-2 from one plain forward over the whole text."""
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # (T, vocab)
    return [logp[t, ids[t + 1]].item() for t in range(start, len(ids) - 1)]


# 1. Nothing evicted: the scores are those of one plain forward -----------------------------------------------------
@pytest.mark.parametrize("policy", [Full(), KNorm(budget=400, skip_layers=[]), StreamingLLM(budget=400)],
                         ids=lambda p: p.name)
def test_unevicted_scores_equal_one_plain_forward(policy) -> None:
    # Full reads the prompt in one forward; the others go block by block (B = 16) with a budget above T, so their
    # block-wise logits of every position are checked too.
    model, _ = _model()
    ids = _prompt(100)
    res = generate(model, policy, ids, GenerationSettings(block=16, score_from=40))
    want = _plain_logprobs(model, ids, 40)
    assert len(res.lm_logprobs) == len(want) == 59  # positions 40..98 predict tokens 41..99
    assert max(abs(a - b) for a, b in zip(res.lm_logprobs, want)) < 1e-5
    with torch.inference_mode():
        argmax = model(torch.tensor([ids])).logits[0].argmax(-1)
    assert res.lm_correct == [argmax[t].item() == ids[t + 1] for t in range(40, 99)]


def test_batched_samples_score_as_alone() -> None:
    # generate_batch: two samples as the rows of one cache (the shorter left-padded), with different prompt lengths
    # and scoring starts; each scores what it scores alone (to a 2-row product's rounding, in float32)
    from kvbench.engine.generate import Job, generate_batch

    model, _ = _model()
    a, b = _prompt(100, seed=1), _prompt(90, seed=2)
    alone = [generate(model, StreamingLLM(budget=24), ids, GenerationSettings(block=16, score_from=s))
             for ids, s in ((a, 32), (b, 48))]
    together = generate_batch(model, [Job(a, StreamingLLM(budget=24), GenerationSettings(block=16, score_from=32)),
                                      Job(b, StreamingLLM(budget=24), GenerationSettings(block=16, score_from=48))])
    assert [r.batch_size for r in together] == [2, 2]
    for one, both, n in zip(alone, together, (100 - 1 - 32, 90 - 1 - 48)):
        assert len(both.lm_logprobs) == n and both.lm_correct == one.lm_correct
        assert max(abs(x - y) for x, y in zip(one.lm_logprobs, both.lm_logprobs)) < 1e-5


# 2. With eviction: the explicit float64 forward over exactly the positions the trace says each head held ------------
@pytest.mark.parametrize("policy_factory,layers", [
    (lambda: StreamingLLM(budget=24), 2),
    (lambda: KNorm(budget=24, skip_layers=[0]), 3),  # layer 0 keeps all: per-layer lengths
    (lambda: KeyDiff(budget=24), 2),  # per-head kept sets
])
def test_evicted_scores_equal_float64_reference(policy_factory, layers: int) -> None:
    model, _ = _model(layers)
    model.double()
    ids = _prompt(70)
    start = lm_score_start(70, "after_eviction", RunSettings(budget=24, block=16))
    assert start == 32  # blocks end at 16, 32 (> 24: first eviction), so position 32 is the first pruned one
    res = generate(model, policy_factory(), ids, GenerationSettings(block=16, score_from=start),
                   observer=Observer(trace=True))
    chunks = [ids[s:s + 16] for s in range(0, 70, 16)]
    assert len(res.trace) == len(chunks)
    ref = torch.cat(reference_logits(model, chunks, res.trace, all_rows=True))  # (70, vocab) float64
    logp = torch.log_softmax(ref, dim=-1)
    want = [logp[t, ids[t + 1]].item() for t in range(start, 69)]
    assert len(res.lm_logprobs) == len(want) == 37
    assert max(abs(a - b) for a, b in zip(res.lm_logprobs, want)) < 1e-5
    assert res.lm_correct == [bool(ref[t].argmax() == ids[t + 1]) for t in range(start, 69)]
    # the scored blocks really saw a pruned cache (the last layer holds its budget, 24 of the 32 tokens seen), and
    # that changed the scores (the test can tell)
    assert held_counts(res.trace[2])[layers - 1:] == [24]
    unevicted = _plain_logprobs(model, ids, start)
    assert max(abs(a - b) for a, b in zip(res.lm_logprobs, unevicted)) > 1e-3


# 3. The aggregation arithmetic, by hand -------------------------------------------------------------------------------
def test_perplexity_by_hand() -> None:
    # p = 1/2, 1/4, 1/8: mean log p = -(1 + 2 + 3) ln 2 / 3 = -2 ln 2, perplexity = 2^2 = 4; 2 of 3 argmax hits
    s = lm_summary([math.log(0.5), math.log(0.25), math.log(0.125)], [True, False, True])
    assert s["tokens"] == 3
    assert s["logprob"] == pytest.approx(-2 * math.log(2), abs=1e-12)
    assert s["perplexity"] == pytest.approx(4.0, abs=1e-12)
    assert s["accuracy"] == pytest.approx(200 / 3, abs=1e-12)
    # pooled over samples, token-weighted: 1 token at -ln 2 and 3 at -ln 8 -> exp((ln 2 + 9 ln 2) / 4) = 2^2.5
    assert pooled_perplexity([-math.log(2), -math.log(8)], [1, 3]) == pytest.approx(2 ** 2.5, abs=1e-12)
    assert lm_summary([], [])["perplexity"] is None and pooled_perplexity([], []) is None
    with pytest.raises(ValueError):
        lm_summary([0.0], [])


# 4. Which tokens count ------------------------------------------------------------------------------------------------
def test_which_tokens_count_by_hand() -> None:
    s = RunSettings(budget=64, block=16)
    # blocks end at 16, 32, 48, 64 (= N: nothing to evict), 80 (> N: first eviction) -> first pruned position 80
    assert lm_score_start(130, "after_eviction", s) == 80
    assert lm_score_start(2048, "after_eviction", RunSettings(budget=512, block=128)) == 640
    assert lm_score_start(200, "after_eviction", RunSettings(budget=48, block=64)) == 64  # N < B: after block 1
    assert lm_score_start(100, 10, s) == 89  # the last 10 tokens: positions 89..98 predict 90..99
    # the engine agrees: the cache is whole before the forward at 64 and pruned before the one at 80
    model, _ = _model()
    ids = _prompt(130)
    res = generate(model, StreamingLLM(budget=64), ids, GenerationSettings(block=16, score_from=80),
                   observer=Observer(trace=True))
    held = [held_counts(t)[0] for t in res.trace]  # layer 0, before each forward
    assert held == [0, 16, 32, 48, 64, 64, 64, 64, 64]
    positions = held_positions(res.trace)
    assert positions[4][0][0] == list(range(64))  # at 64: every token still there
    assert positions[5][0][0] != list(range(64))  # at 80: 16 of the 80 dropped
    assert len(res.lm_logprobs) == 130 - 1 - 80
    assert len(generate(model, StreamingLLM(budget=64), ids, GenerationSettings(block=16, score_from=119))
               .lm_logprobs) == 10
    # settings under which the score means nothing, or nothing is left to score: one clear error
    with pytest.raises(ConfigError, match="blockwise"):
        lm_score_start(130, "after_eviction", RunSettings(budget=64, block=None, protocol="prefill_once"))
    with pytest.raises(ConfigError, match="budget"):
        lm_score_start(130, "after_eviction", RunSettings(budget=None, block=16))
    with pytest.raises(TaskError, match="no token to score"):
        lm_score_start(81, "after_eviction", s)
    with pytest.raises(TaskError, match="exceeds"):
        lm_score_start(100, 100, s)


# 5. The default path is unchanged -------------------------------------------------------------------------------------
def test_default_path_keeps_one_logit_and_the_same_tokens() -> None:
    model, _ = _model()
    ids = _prompt(120)
    seen: list[int] = []
    forward = model.forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("logits_to_keep"))
        return forward(*args, **kwargs)

    model.forward = spy
    plain = generate(model, KeyDiff(budget=40), ids, GenerationSettings(block=16, max_new_tokens=8),
                     observer=Observer(trace=True))
    assert seen and set(seen) == {1} and plain.lm_logprobs is None
    seen.clear()
    scored = generate(model, KeyDiff(budget=40), ids, GenerationSettings(block=16, max_new_tokens=8, score_from=64),
                      observer=Observer(trace=True))
    # prompt blocks at 0..48 keep 1 row, the blocks at 64, 80, 96 all 16, the last (112..119) all 8 (its 7 scored
    # rows 112..118 and the last, which predicts the first new token); decoding steps 1
    assert seen == [1, 1, 1, 1, 16, 16, 16, 8] + [1] * 7
    assert scored.tokens == plain.tokens  # scoring reads logits only: the cache, hence every token, is the same
    assert len(plain.trace) == len(scored.trace)
    assert all((a is None and b is None) or torch.equal(a, b)
               for s, t in zip(plain.trace, scored.trace, strict=True) for a, b in zip(s, t, strict=True))


# The task and the run: records, report -------------------------------------------------------------------------------
def test_task_samples_from_a_jsonl(tmp_path: Path) -> None:
    _, tok = _model()
    long = "The quick brown fox jumps over the lazy dog. " * 40
    data = tmp_path / "texts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [{"id": "a", "text": long}, {"id": "short", "text": "Hi."},
                                                      {"text": long[::-1]}]) + "\n")
    env = TaskEnv(tokenizer=tok, model_name="tiny-llama", max_prompt_tokens=7500)
    task = LMTask(source="jsonl", path=str(data), tokens=64, spans_per_text=2)
    samples = list(task.samples(env))
    body = tok(long, add_special_tokens=False)["input_ids"]
    assert [s.id for s in samples] == ["a#0", "a#1", "2#0", "2#1"]
    assert samples[0].input_ids == [tok.bos_token_id] + body[:63]  # BOS (the tokenizer's default) + 63 tokens
    assert samples[1].input_ids == [tok.bos_token_id] + body[63:126]
    assert all(len(s.input_ids) == 64 and s.max_new_tokens == 0 for s in samples)
    assert task.provenance()["texts_too_short"] == 1
    for bad in ({"source": "web"}, {"source": "jsonl"}, {"tokens": 1}, {"lm_tokens": 0}, {"lm_tokens": "some"}):
        with pytest.raises(TaskError):
            LMTask(**bad)


def _kvbench(tmp_path: Path, run: str, *args: str) -> subprocess.CompletedProcess:
    """`kvbench` on the texts in tmp_path, in this process (helpers.kvbench_main)."""
    return kvbench_main("model=tiny-llama", "task=lm", "task.source=jsonl", f"task.path={tmp_path / 'texts.jsonl'}",
                        "task.tokens=96", "budget=32", "block=16", f"hydra.run.dir={tmp_path / 'runs' / run}",
                        "progress=false", *args)


@pytest.mark.slow  # 22 s of CLI runs; test_the_full_cache_pairs_at_its_own_budget covers the CLI-to-report path in CI
def test_run_records_and_report(tmp_path: Path) -> None:
    _, tok = build_tiny_model("tiny-llama")
    texts = ["The quick brown fox jumps over the lazy dog. " * 30, "Memory is the budget; attention is the "
             "currency; the cache keeps what the policy believes will matter. " * 12]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n"
                                                  for i, t in enumerate(texts)))
    for policy in ("full", "streamingllm"):
        r = _kvbench(tmp_path, policy, f"policy={policy}")
        assert r.returncode == 0, r.stderr[-2000:]
    model, _ = build_tiny_model("tiny-llama")  # the preset's model: builtin:tiny-llama, seed 0
    full = [json.loads(x) for x in (tmp_path / "runs" / "full" / "predictions.jsonl").read_text().splitlines()]
    evicted = [json.loads(x) for x in (tmp_path / "runs" / "streamingllm" / "predictions.jsonl").read_text()
               .splitlines()]
    for rec, text in zip(full, texts):
        ids = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"][:95]
        want = _plain_logprobs(model, ids, 48)  # N = 32, B = 16: first pruned position 48
        assert rec["lm"]["tokens"] == 47 and rec["lm"]["start"] == 48
        assert rec["answer_logprob"] == pytest.approx(sum(want) / 47, abs=2e-6)
        assert rec["lm"]["perplexity"] == pytest.approx(math.exp(-sum(want) / 47), rel=1e-5)
        assert 0 <= rec["score"] <= 100 and rec["new_tokens"] == 0 and rec["degenerate"] is False
        assert rec["tokens"] is None and rec["score"] == pytest.approx(rec["lm"]["accuracy"], abs=1e-6)
    assert [r["id"] for r in evicted] == ["t0", "t1"] and all(r["lm"]["tokens"] == 47 for r in evicted)
    assert any(abs(a["answer_logprob"] - b["answer_logprob"]) > 1e-4 for a, b in zip(evicted, full))
    from kvbench.run.score import rescore_run

    again = rescore_run(tmp_path / "runs" / "streamingllm")  # kvbench-score: the same scores from the records
    assert again["changed"] == [] and again["samples"] == 2
    metrics = json.loads((tmp_path / "runs" / "full" / "metrics.json").read_text())
    assert set(metrics["scores"]) == {"token_acc"} and metrics["lm"]["tokens"] == 94
    out = subprocess.run([sys.executable, "-m", "kvbench.report", str(tmp_path / "runs")], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    table = (tmp_path / "runs" / "table.md").read_text() if (tmp_path / "runs" / "table.md").is_file() else out.stdout
    line = [x for x in table.splitlines() if x.startswith("|") and "streamingllm" in x and "(n=2)" in x]
    assert line, table  # the LM score with its n, and the paired difference to the full cache
    assert "| 100.0 |" not in table  # no token agreement counted where nothing was generated


def test_lm_needs_blockwise_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "texts.jsonl").write_text(json.dumps({"text": "word " * 200}) + "\n")
    r = _kvbench(tmp_path, "bad", "policy=streamingllm", "protocol=prefill_once")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "blockwise" in r.stderr


def test_code_source_reads_the_pinned_wheels_in_turn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two fake packages of task=code's kind (wheels checked against their sha256 and RECORD): one text per file,
    # the packages in turn, each sample's meta naming its file and that file's sha256.
    import hashlib

    from helpers import CharTokenizer, make_wheel

    from kvbench.tasks import code

    texts = {"a": {"a/one.py": "x = 1\n" * 4, "a/two.py": "y = 2\n" * 4}, "b": {"b/three.py": "z = 3\n" * 4}}
    pins = []
    for name, files in texts.items():
        _, sha = make_wheel(tmp_path, files, name=name)
        pins.append(code.Pin(name, "1.0", sha))
    monkeypatch.setattr(code, "configured_packages", lambda: pins)
    task = LMTask(source="code", path=str(tmp_path), tokens=9)  # BOS + 8 characters of each file
    samples = list(task.samples(TaskEnv(tokenizer=CharTokenizer(), model_name="char", max_prompt_tokens=100)))
    by_id = {s.id: s for s in samples}
    # a's files come in the order of the sha256 of their paths, interleaved with b's one file
    first_a = min(texts["a"], key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    assert [s.id for s in samples][:2] == [f"a/{first_a}", "b/b/three.py"] and len(samples) == 3
    three = by_id["b/b/three.py"]
    assert three.input_ids == [1] + [ord(c) for c in ("z = 3\n" * 4)[:8]]
    assert three.meta["sha256"] == hashlib.sha256(texts["b"]["b/three.py"].encode()).hexdigest()
    assert [w["name"] for w in task.provenance()["wheels"]] == ["a", "b"]
    pins[1] = code.Pin("b", "1.0", "0" * 64)  # a wheel that is not the pinned one stops the task in one line
    with pytest.raises(TaskError, match="sha256"):
        list(LMTask(source="code", path=str(tmp_path), tokens=9).samples(
            TaskEnv(tokenizer=CharTokenizer(), model_name="char", max_prompt_tokens=100)))


def test_the_full_cache_pairs_at_its_own_budget(tmp_path: Path) -> None:
    # after_eviction: N and B say which tokens are scored, for the full cache too. Its runs at N = 32 and N = 48 score
    # tokens 48.. and 64.. (other samples, in effect): two rows, and StreamingLLM at N = 48 is compared with the full
    # cache at N = 48 alone.
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"id": f"t{i}", "text": f"Sentence {i} of a text. " * 40})
                                                  + "\n" for i in range(3)))
    for run, args in {"full32": ("policy=full", "budget=32"), "full48": ("policy=full", "budget=48"),
                      "stream48": ("policy=streamingllm", "budget=48")}.items():
        r = _kvbench(tmp_path, run, *args)
        assert r.returncode == 0, r.stderr[-2000:]

    def logprobs(run: str) -> list[float]:
        recs = [json.loads(x) for x in (tmp_path / "runs" / run / "predictions.jsonl").read_text().splitlines()]
        assert all(rec["lm"]["tokens"] == (47 if run == "full32" else 31) for rec in recs)
        return [rec["answer_logprob"] for rec in recs]

    want = sum(a - b for a, b in zip(logprobs("stream48"), logprobs("full48"))) / 3
    assert abs(want - sum(a - b for a, b in zip(logprobs("stream48"), logprobs("full32"))) / 3) > 1e-3
    from kvbench.report.collect import collect_entries, pair_key
    from kvbench.report.tables import build_report

    report = build_report(*collect_entries(tmp_path / "runs"))
    fulls = [r for r in report.rows if r.policy == "full"]
    assert sorted(r.budget for r in fulls) == [32, 48]
    stream = next(e for r in report.rows if r.policy == "streamingllm" for e in r.entries.values())
    assert pair_key(stream) == pair_key(next(e for r in fulls if r.budget == 48 for e in r.entries.values()))
    assert stream.dlogprob is not None and stream.dlogprob.diff == pytest.approx(want, abs=1e-6)
