"""The per-task run loop: every sample of a task through `generate`, one resumable line per sample in
predictions.jsonl, and the run's summary statistics.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any, Sequence

import torch

from kvbench.engine.generate import GenerationResult, GenerationSettings, Job, Observer, generate_batch
from kvbench.metrics.degenerate import is_degenerate
from kvbench.metrics.lm import lm_summary
from kvbench.models.common import head_dim
from kvbench.options import LM_TOKENS_AFTER_EVICTION
from kvbench.policies.base import Policy
from kvbench.policies.full import Full
from kvbench.run.records import append_record, read_records
from kvbench.run.settings import ConfigError, RunSettings
from kvbench.tasks.base import Sample, Task, TaskEnv, TaskError


def sample_seed(sample_id: str) -> int:
    return zlib.crc32(sample_id.encode("utf-8"))


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def run_task(model: Any, tokenizer: Any, policy: Policy, task: Task, env: TaskEnv, settings: RunSettings,
             out_dir: Path, references: dict[Any, Any] | None = None) -> list[dict[str, Any]]:
    """Run every (not yet finished) sample of `task`, appending records to out_dir/predictions.jsonl.

    `references` caches full-cache continuations of reference tasks between runs on the same model.
    """
    from tqdm import tqdm

    pred_path = out_dir / "predictions.jsonl"
    records = read_records(pred_path)
    done = {r["id"] for r in records}
    samples = run_samples(task, env, settings)
    default_stop = eos_ids(model, tokenizer)
    todo = [s for s in samples if s.id not in done]
    if task.lm_tokens is not None:  # bad settings or too short a text: one line before any sample runs
        for s in todo:
            lm_score_start(len(s.input_ids), task.lm_tokens, settings)
    size = settings.batch_size  # generate_batch itself runs alone a sample whose policy it cannot batch (random)
    # Batches of similar prompt lengths (equal-length prompt blocks go through the model together; the records are
    # appended as each batch ends, so a kill loses at most the batch under way and resumes at sample granularity)
    ordered = sorted(todo, key=lambda s: len(s.input_ids)) if size > 1 else todo
    bar = tqdm(total=len(todo), desc=f"{task.name}", unit="sample", disable=not settings.progress, dynamic_ncols=True)
    for start in range(0, len(ordered), size):
        batch = ordered[start:start + size]
        if task.needs_reference:
            new = _reference_samples(model, tokenizer, policy, task, batch, settings,
                                     references if references is not None else {})
        else:
            new = _generate_samples(model, tokenizer, policy, task, batch, settings, default_stop)
        for record in new:
            append_record(pred_path, record)
            records.append(record)
        bar.update(len(batch))
    bar.close()
    return in_sample_order(records, samples)


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def shared_bytes(model: Any, jobs: Sequence[Job], batch: int | None = None, together: bool = False) -> int:
    """An upper bound of the K+V bytes `generate_batch(model, jobs, batch, together)` allocates at once beyond the
    model: per
    row of a batch, every layer at the run's largest capacity (the prompt and its answer, T + new), and per-token
    state (float32) and positions (int64) alike, and for a policy that reads its window's attention (query_window
    w > 0, or diagnostics: w >= 1) the stored rows, h_q x (w + 1) float32 a slot; a cache's rows at a time (`together`:
    every cache, held until they decode together), and the shared trunks (a row each, at most 2: one per way of
    attending, each shared by 2 caches at least, so never more than half the jobs)."""
    cfg = model.config.get_text_config(decoder=True)
    layers, h_kv, h_q = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads
    d = head_dim(cfg)
    window = max(max(j.policy.query_window, 1 if j.settings.diagnostics else 0) for j in jobs)
    rows_per_slot = h_q * (window + 1) * 4 if window > 0 else 0
    per_slot = layers * (h_kv * (2 * d * torch.finfo(model.dtype).bits // 8 + 8 + 4 * 4) + rows_per_slot)
    T = max(len(j.input_ids) for j in jobs)
    new = max(j.settings.max_new_tokens + len(j.answer_ids or ()) for j in jobs)
    trunks = min(2, len(jobs) // 2)
    rows = len(jobs) + trunks if together else min(len(jobs), (batch or len(jobs)) + trunks)
    return rows * (T + new) * per_slot


def memory_limit(model: Any) -> int:
    """Bytes a shared-work group may hold for its caches: half the device's free memory (CUDA: what the allocator
    reports free; CPU: the kernel's MemAvailable), so the model's activations and the rest keep room."""
    if model.device.type == "cuda":
        return torch.cuda.mem_get_info(model.device)[0] // 2
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024 // 2
    except (OSError, StopIteration, ValueError):  # not Linux: free pages (a lower bound of what is available)
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def split_to_fit(model: Any, jobs: list[Job], batch: int | None, limit: int,
                 together: bool = False) -> list[list[int]]:
    """The jobs (indices, in order) in as few consecutive parts as keep each part's shared_bytes under `limit`; a
    job too big alone is a part of its own."""
    parts: list[list[int]] = [[]]
    for k in range(len(jobs)):
        if parts[-1] and shared_bytes(model, [jobs[i] for i in parts[-1] + [k]], batch, together) > limit:
            parts.append([])
        parts[-1].append(k)
    return parts


def in_sample_order(records: list[dict[str, Any]], samples: list[Sample]) -> list[dict[str, Any]]:
    """The records of `samples` (others dropped: another shard's), in the samples' order."""
    order = {s.id: k for k, s in enumerate(samples)}
    return sorted((r for r in records if r["id"] in order), key=lambda r: order[r["id"]])


def run_samples(task: Task, env: TaskEnv, settings: RunSettings) -> list[Sample]:
    """The run's samples in task order: all of them, or its shard's (index % n == i)."""
    samples = list(task.samples(env))
    if settings.shard is not None:
        i, n = settings.shard
        samples = [s for k, s in enumerate(samples) if k % n == i]
    return samples


def _generate_samples(model: Any, tokenizer: Any, policy: Policy, task: Task, batch: list[Sample],
                      settings: RunSettings, default_stop: list[int]) -> list[dict[str, Any]]:
    """Records of `batch`'s samples, generated together (one sample: exactly the batch-1 run). Each sample has its
    own copy of the policy, started with the sample's own seed as a batch-1 run starts it."""
    jobs = [sample_job(tokenizer, own, task, sample, settings, default_stop)
            for sample, own in zip(batch, _sample_policies(policy, batch))]
    return [sample_record(tokenizer, task, sample, job, res, settings)
            for sample, job, res in zip(batch, jobs, generate_batch(model, jobs))]


def sample_job(tokenizer: Any, policy: Policy, task: Task, sample: Sample, settings: RunSettings,
               default_stop: list[int]) -> Job:
    """The engine job of one sample under one run's settings (`policy`: the sample's own, already started)."""
    stop = sample.stop_token_ids if sample.stop_token_ids is not None else default_stop
    gen = generation_settings(settings, sample, stop)
    lm = task.lm_tokens is not None
    if lm:
        gen = dataclasses.replace(gen, score_from=lm_score_start(len(sample.input_ids), task.lm_tokens, settings))
    graded = settings.graded and not lm  # an LM task's graded score is its LM score (lm_record)
    return Job(sample.input_ids, policy, gen, answer_ids=answer_token_ids(tokenizer, sample, task) if graded else None)


def sample_record(tokenizer: Any, task: Task, sample: Sample, job: Job, res: GenerationResult,
                  settings: RunSettings) -> dict[str, Any]:
    """The predictions.jsonl record of one sample's generation."""
    prediction = tokenizer.decode(res.tokens, skip_special_tokens=True)
    if task.lm_tokens is not None:
        return lm_record(sample, prediction, res, task, settings, job.settings.score_from or 0)
    return make_record(sample, prediction, res, task.score(sample, prediction), settings)


@dataclasses.dataclass
class SharedRun:
    """One run of a shared-work group (kvbench.run.app.run_group): its policy (one instance, restarted per sample as a
    batch-1 run restarts it), its settings and its predictions file. The group's runs share model, task and every
    setting but the policy and the budget."""

    policy: Policy
    settings: RunSettings
    pred_path: Path


def run_shared(model: Any, tokenizer: Any, runs: list[SharedRun], task: Task,
               env: TaskEnv) -> list[list[dict[str, Any]]]:
    """Every run's missing samples, sample-major: for each sample, the runs that lack it go through
    `engine.generate.generate_batch` together (from one shared trunk; with `share_rows` true the runs whose policies
    select alike, budgets included, as the rows of one cache: one forward and one eviction for all of them; true or
    decode: every cache's decoding steps as the rows of one forward), and each run's
    record is appended to its own predictions.jsonl as soon as the sample ends, so a kill loses at most the sample
    under way and a relaunch resumes per (run, sample). Each record is the run's batch-1 record but for the timings
    (its equal share of each forward) and a batch's rounding (a token may differ where it decides a near-tie, as with
    batched samples; the record's `batch` says it was a row). Returns each run's records in the task's sample order."""
    from tqdm import tqdm

    settings = runs[0].settings  # the group's common settings (samples, shard, progress)
    have = [read_records(r.pred_path) for r in runs]
    done = [{rec["id"] for rec in records} for records in have]
    samples = run_samples(task, env, settings)
    default_stop = eos_ids(model, tokenizer)
    todo = [s for s in samples if any(s.id not in d for d in done)]
    if task.lm_tokens is not None:  # bad settings or too short a text: one line before any sample runs
        for s in todo:
            for r in runs:
                lm_score_start(len(s.input_ids), task.lm_tokens, r.settings)
    bar = tqdm(total=len(todo), desc=f"{task.name} x {len(runs)} runs", unit="sample", disable=not settings.progress,
               dynamic_ncols=True)
    rows = settings.share_rows
    rows = (True if model.device.type == "cuda" else "decode") if rows == "auto" else rows
    batch, together = (None if rows is True else 1), rows is not False  # None: a policy class's runs as rows
    limit, said = memory_limit(model), False
    for sample in todo:
        members = [j for j, d in enumerate(done) if sample.id not in d]
        jobs = []
        for j in members:
            runs[j].policy.start_sample(sample_seed(sample.id))
            jobs.append(sample_job(tokenizer, runs[j].policy, task, sample, runs[j].settings, default_stop))
        parts = split_to_fit(model, jobs, batch, limit, together)
        if len(parts) > 1 and not said:
            need = shared_bytes(model, jobs, batch, together)
            print(f"kvbench: {len(jobs)} runs sharing a sample's work would hold ~{_size(need)} of caches, over the "
                  f"{_size(limit)} kvbench allows (half the free memory): they run as {len(parts)} groups",
                  file=sys.stderr)
            said = True
        # (the parts are consecutive: their results come in the jobs' order)
        results = [res for part in parts for res in generate_batch(model, [jobs[k] for k in part], batch, together)]
        for j, job, res in zip(members, jobs, results):
            record = sample_record(tokenizer, task, sample, job, res, runs[j].settings)
            append_record(runs[j].pred_path, record)
            have[j].append(record)
            done[j].add(sample.id)
        bar.update(1)
    bar.close()
    return [in_sample_order(records, samples) for records in have]


def check_lm_settings(lm_tokens: int | str, settings: RunSettings) -> None:
    """ConfigError (one line) for run settings under which an LM score means nothing: a protocol other than
    blockwise with a block (it sees the whole prompt before it evicts: every prompt prediction would be the full
    cache's), or lm_tokens=after_eviction without a budget (the boundary is N's)."""
    if settings.protocol != "blockwise" or settings.block is None:
        raise ConfigError(f"the LM score needs protocol=blockwise and a block (B), got protocol={settings.protocol} "
                          f"block={settings.block}: other protocols evict only after the whole prompt is in")
    if lm_tokens == LM_TOKENS_AFTER_EVICTION and settings.budget is None:
        raise ConfigError("the LM score with lm_tokens=after_eviction needs budget=N (where the first eviction "
                          "happens), also for policy=full")


def lm_score_start(prompt_tokens: int, lm_tokens: int | str, settings: RunSettings) -> int:
    """The first prompt position t whose next-token prediction (of token t + 1) the LM score takes.

    "after_eviction": the first position fed after the first eviction. Blocks of B tokens go in at 0, B, 2B, ...;
    the cache first exceeds N (and is cut back to N) after the block that ends past N, the k-th with k = N // B + 1
    (a block ending exactly at N leaves N tokens: nothing to evict), so the first prediction made from a pruned cache
    is at position (N // B + 1) * B, when the cache holds N + (its place in the block) <= N + B tokens. The full cache
    scores the same positions (from the same N and B), with nothing evicted. An int M: the prompt's last M tokens
    (positions T - 1 - M .. T - 2). ConfigError as check_lm_settings; TaskError when nothing is left to score."""
    check_lm_settings(lm_tokens, settings)
    if lm_tokens == LM_TOKENS_AFTER_EVICTION:
        assert settings.budget is not None and settings.block is not None  # check_lm_settings
        start = (settings.budget // settings.block + 1) * settings.block
        if start >= prompt_tokens - 1:
            raise TaskError(f"a sample of {prompt_tokens} tokens has no token to score after the first eviction at "
                            f"position {start} (N={settings.budget}, B={settings.block}): use longer samples or a "
                            f"smaller budget")
        return start
    if isinstance(lm_tokens, bool) or not isinstance(lm_tokens, int) or lm_tokens < 1:
        raise TaskError(f"lm_tokens must be '{LM_TOKENS_AFTER_EVICTION}' or a positive integer, got {lm_tokens!r}")
    if lm_tokens > prompt_tokens - 1:
        raise TaskError(f"lm_tokens={lm_tokens} exceeds the {prompt_tokens - 1} predictable tokens of a "
                        f"{prompt_tokens}-token sample")
    return prompt_tokens - 1 - lm_tokens


def lm_record(sample: Sample, prediction: str, res: GenerationResult, task: Task, settings: RunSettings,
              start: int) -> dict[str, Any]:
    """The record of an LM-scored sample: `lm` (tokens scored, the first scored position, mean log-probability,
    perplexity, next-token accuracy), `answer_logprob` = that mean log-probability (so the report's graded-score
    columns and paired tests carry it), `score` = task.score_lm (0-100)."""
    summary = lm_summary(res.lm_logprobs or [], res.lm_correct or [])
    rec = make_record(sample, prediction, res, task.score_lm(sample, summary), settings)
    rec["answer_logprob"] = None if summary["logprob"] is None else round(summary["logprob"], 6)
    # Nothing is generated: no output to collapse, and no tokens to agree with the full cache's (null, not an empty
    # list, which the report would count as agreeing)
    rec["degenerate"], rec["tokens"] = False, None
    rec["lm"] = {"tokens": summary["tokens"], "start": start, "setting": task.lm_tokens,
                 **{k: None if summary[k] is None else round(summary[k], 6)
                    for k in ("logprob", "perplexity", "accuracy")}}
    return rec


def _sample_policies(policy: Policy, batch: list[Sample]) -> list[Policy]:
    """One policy per sample of `batch`, each started with its sample's seed as a batch-1 run starts it: the run's
    own policy for a batch of one, copies otherwise (a policy's state, a generator included, is per sample)."""
    own = [policy] if len(batch) == 1 else [copy.deepcopy(policy) for _ in batch]
    for p, sample in zip(own, batch):
        p.start_sample(sample_seed(sample.id))
    return own


def generation_settings(settings: RunSettings, sample: Sample, stop_ids: Any,
                        max_new_tokens: int | None = None) -> GenerationSettings:
    """What `generate` needs of the run's settings and one sample (its answer length, stop tokens, context)."""
    return GenerationSettings(block=settings.block, protocol=settings.protocol, scenario=settings.scenario,
                              diagnostics=settings.diagnostics, context_tokens=sample.context_tokens,
                              stop_ids=tuple(stop_ids), min_new_tokens=sample.min_new_tokens,
                              compile=settings.compile,
                              max_new_tokens=sample.max_new_tokens if max_new_tokens is None else max_new_tokens)


def answer_token_ids(tokenizer: Any, sample: Sample, task: Task) -> list[int] | None:
    """The graded score's gold continuation as token ids: the task's graded answer, tokenized without special
    tokens, with one space in front when neither the prompt's last token nor the answer supplies whitespace (an
    answer follows "...context:" as " eat a sandwich ...", not "eat a sandwich ...")."""
    text = task.graded_answer(sample)
    if not text:
        return None
    last = tokenizer.decode(sample.input_ids[-1:]) if sample.input_ids else ""
    if last and not last[-1].isspace() and not text[0].isspace():
        text = " " + text
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return ids or None


def _reference_samples(model: Any, tokenizer: Any, policy: Policy, task: Task, batch: list[Sample],
                       settings: RunSettings, references: dict[Any, Any]) -> list[dict[str, Any]]:
    """Label-free scoring of `batch` (together, as `_generate_samples`): each sample's full-cache greedy continuation
    (kept in `references` for the next policy on the same model), then the policy teacher-forced along it."""
    def collector(out: list[torch.Tensor]) -> Observer:
        return Observer(on_logits=lambda lg: out.append(torch.log_softmax(lg[0], dim=-1)))

    keys = [(s.id, zlib.crc32(json.dumps(s.input_ids).encode()), s.max_new_tokens) for s in batch]
    missing = [(s, k) for s, k in zip(batch, keys) if k not in references]
    logps: dict[Any, list[torch.Tensor]] = {k: [] for _, k in missing}
    jobs = [Job(s.input_ids, Full(), GenerationSettings(max_new_tokens=s.max_new_tokens), observer=collector(logps[k]))
            for s, k in missing]
    for (_, k), ref in zip(missing, generate_batch(model, jobs)):
        references[k] = (ref.tokens, torch.stack(logps[k]))  # (new, vocab)
    test_logps: list[list[torch.Tensor]] = [[] for _ in batch]
    jobs = []
    for sample, key, out, own in zip(batch, keys, test_logps, _sample_policies(policy, batch)):
        ref_tokens = references[key][0]
        # Along the reference's tokens: no stop token ends it and nothing holds one off (min_new_tokens 0).
        along = dataclasses.replace(generation_settings(settings, sample, (), len(ref_tokens)), min_new_tokens=0)
        jobs.append(Job(sample.input_ids, own, along, forced=ref_tokens, observer=collector(out)))
    records = []
    for sample, key, out, res in zip(batch, keys, test_logps, generate_batch(model, jobs)):
        ref_tokens, ref_logp = references[key]
        test_logp = torch.stack(out)  # (new, vocab)
        prediction = tokenizer.decode(test_logp.argmax(dim=-1).tolist(), skip_special_tokens=True)
        record = make_record(sample, prediction, res, 0.0, settings)
        extra = task.score_reference(sample, ref_tokens, ref_logp, test_logp)
        record["score"] = extra.pop("score")
        record["reference"] = tokenizer.decode(ref_tokens, skip_special_tokens=True)
        record.update(extra)
        records.append(record)
    return records


def make_record(sample: Sample, prediction: str, res: GenerationResult, score: float,
                settings: RunSettings) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "id": sample.id, "prediction": prediction, "answers": sample.answers, "score": score,
        "prompt_tokens": res.prompt_tokens, "new_tokens": len(res.tokens),
        "prefill_s": round(res.prefill_s, 6), "decode_s": round(res.decode_s, 6), "decode_steps": res.decode_steps,
        "evict_s": round(res.evict_s, 6), "peak_kv_tokens": res.peak_kv_tokens, "kv_bytes_peak": res.kv_bytes_peak,
        # The generated ids (agreement with the full cache, first divergence) and whether the output collapsed.
        "tokens": list(res.tokens), "degenerate": is_degenerate(prediction, res.tokens),
        "answer_logprob": None if res.answer_logprob is None else round(res.answer_logprob, 6),
        "meta": sample.meta,
    }
    if res.answer_logprob is not None:
        rec["graded_s"] = round(res.graded_s, 6)
    if res.diagnostics is not None:
        rec["diagnostics"] = res.diagnostics
    if settings.save_prompts:
        rec["prompt"] = sample.prompt
    if res.batch_size > 1:  # a row of a batch (samples, or a shared group's runs): its rounding, its share of time
        rec["batch"] = {"size": res.batch_size, "kv_bytes_peak": res.batch_kv_bytes_peak}
    if res.trunk_tokens:  # its first prompt forwards were shared with other runs of the sample (and their time)
        rec["trunk_tokens"] = res.trunk_tokens
    return rec
