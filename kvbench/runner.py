"""The generation loop (block prefill -> evict -> greedy decode with eviction) and the per-task run loop.

`generate` is the whole mechanism: the prompt goes through the model in blocks of B tokens; after each block
every layer's cache is pruned back to its budget by the policy; decoding feeds one token at a time (B = 1) and
evicts after every step. The protocol (PROTOCOLS) can instead feed the prompt in one forward and/or leave the
cache to grow while decoding. The runner never looks at a policy's class: it only reads its declared needs.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from kvbench import attention
from kvbench.cache import EvictingCache
from kvbench.diagnostics import Diagnostics
from kvbench.policies.base import Policy
from kvbench.policies.full import Full
from kvbench.tasks.base import Sample, Task, TaskEnv

SCENARIOS = ("question_aware", "context_only")
# When the cache is pruned, as the seed papers run it: name -> (prompt in one forward, evict while decoding).
PROTOCOLS = {
    "blockwise": (False, True),  # KeyDiff Eq. 6, HashEvict (B = 1): after every prompt block and decoding step
    "prefill_once": (True, False),  # SnapKV, AdaKV, CriticalKV Alg. 2, kvpress: once after the prompt, then grow
    "prefill_once_decode_evict": (True, True),  # KeyDiff Table 7 (B = inf), SAGE-KV: once, then at every step
}


def resolve_protocol(protocol: str, block: int | None) -> tuple[str, int | None]:
    """The canonical (protocol, block) of a setting: block is None (does not apply) unless the prompt goes in
    blocks, and blockwise with block=None (B = inf) is the same computation as prefill_once_decode_evict."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol '{protocol}'; choose one of: {', '.join(PROTOCOLS)}")
    if PROTOCOLS[protocol][0] or block is None:
        return ("prefill_once_decode_evict" if protocol == "blockwise" else protocol), None
    return protocol, block


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids (stop token excluded)
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    decode_steps: int  # one-token forwards during decoding
    evict_s: float  # evict_prefill_s + evict_decode_s
    peak_kv_tokens: int  # max over layers and time of tokens held per KV head (ragged: layer total / h_kv)
    kv_bytes_peak: int  # max over time of K+V bytes held, all layers
    trace: list[list[torch.Tensor | None]] = field(default_factory=list, repr=False)
    diagnostics: dict[str, Any] | None = None  # Diagnostics.summary() when diagnostics were asked for
    evict_prefill_s: float = 0.0  # eviction time inside prefill_s
    evict_decode_s: float = 0.0  # eviction time inside decode_s


def greedy_processors(model: Any, prompt: torch.Tensor, stop_ids: Iterable[int] = (), min_new_tokens: int = 0,
                      max_new_tokens: int = 0) -> Any:
    """The logits processors `model.generate(prompt, do_sample=False, eos_token_id=stop_ids,
    min_new_tokens=min_new_tokens, max_new_tokens=max_new_tokens)` applies: those the model's generation_config
    asks for (repetition_penalty, no_repeat_ngram_size, bad_words_ids, suppress_tokens, ...; official LongBench
    pred.py decodes through generate, so they apply there) plus min_new_tokens. Built by transformers' own
    `_get_logits_processor`, so the set, order and arguments are generate's (tests/test_protocol.py checks it
    token for token against generate). A LogitsProcessorList; call it with (1, seq) ids and (1, vocab) logits."""
    import copy

    cfg = copy.deepcopy(model.generation_config)
    cfg.do_sample = False  # sampling warpers (temperature, top-p, ...) do not apply to greedy search
    cfg.eos_token_id = list(stop_ids) or None
    cfg.min_new_tokens = int(min_new_tokens) or None
    cfg.max_length = prompt.shape[-1] + int(max_new_tokens)  # as generate sets it (ForcedEOS reads it)
    model._prepare_special_tokens(cfg, kwargs_has_attention_mask=False, device=prompt.device, batch_size=1)
    return model._get_logits_processor(cfg, input_ids_seq_length=prompt.shape[-1], encoder_input_ids=prompt,
                                       device=prompt.device, model_kwargs={})


def describe_processors(processors: Iterable[Any]) -> list[dict[str, Any]]:
    """metrics.json form of a processor list: class name and scalar settings, e.g.
    {"name": "RepetitionPenaltyLogitsProcessor", "penalty": 1.05}."""
    return [{"name": type(p).__name__, **{k: v for k, v in vars(p).items()
                                          if isinstance(v, (bool, int, float, str)) and not k.startswith("_")}}
            for p in processors]


def generation_provenance(model: Any) -> dict[str, Any]:
    """metrics.json's record of how tokens are picked: greedy, with the generation_config's processors (each
    sample adds min_new_tokens and its stop tokens as eos, as a generate call with those arguments would)."""
    prompt = torch.zeros(1, 1, dtype=torch.long, device=model.device)  # (1, 1): the processors' settings only
    return {"decoding": "greedy", "processors": describe_processors(greedy_processors(model, prompt))}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate(model: Any, policy: Policy, input_ids: list[int], block: int | None, max_new_tokens: int,
             stop_ids: Iterable[int] = (), min_new_tokens: int = 0, context_tokens: int | None = None,
             scenario: str = "question_aware", forced: list[int] | None = None,
             on_logits: Callable[[torch.Tensor], None] | None = None, trace: bool = False,
             diagnostics: Iterable[str] = (), protocol: str = "blockwise",
             clock: Callable[[], float] = time.perf_counter) -> GenerationResult:
    """Greedy generation through a policy-managed cache.

    Greedy = what `model.generate(do_sample=False)` picks: the generation_config's processors apply
    (greedy_processors). `block=None` feeds the whole prompt in one forward, then evicts once. `protocol`
    (PROTOCOLS) says whether the prompt goes in blocks (else `block` is ignored) and whether decoding steps evict.
    `forced` teacher-forces these tokens instead of the argmax (the fidelity task); `on_logits` sees each step's
    next-token logits (1, vocab) float32, before the processors. `trace` records, before every forward, each
    layer's per-head token positions (b, h_kv, L) (tests rebuild attention from them; ragged layers' shorter
    heads are padded with -1 in this record only). `diagnostics` names kvbench.diagnostics measures taken at
    every eviction. `clock` times prefill, decoding and eviction (kvbench-bench can pass time.process_time: CPU
    time).
    """
    device = model.device
    ids = torch.tensor([input_ids], device=device)  # (1, T)
    T = ids.shape[1]
    one_pass, decode_evicts = PROTOCOLS[protocol]
    cache = EvictingCache(model.config, policy)
    stop = set(stop_ids)
    processors = greedy_processors(model, ids, sorted(stop), min_new_tokens, max_new_tokens)
    timing = {"prefill": 0.0, "decode": 0.0}  # eviction seconds, by phase
    diag = Diagnostics(tuple(diagnostics)) if diagnostics else None
    if diag is not None and not cache.query_window:
        cache.query_window = diag.query_window
    peak_bytes = 0
    traces: list[list[torch.Tensor | None]] = []

    def forward(chunk: torch.Tensor) -> torch.Tensor:
        nonlocal peak_bytes
        if trace:
            traces.append(cache.head_positions())
        out = model(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)
        peak_bytes = max(peak_bytes, cache.kv_bytes())
        return out.logits[:, -1].float()  # (1, vocab)

    def evict(phase: str) -> None:
        if cache.frozen or not policy.evicts:
            return
        _sync(device)
        t0 = clock()
        spent = diag.elapsed if diag is not None else 0.0
        for layer in cache.evicting_layers():
            policy.evict(layer, diag.observe if diag is not None else None)
        _sync(device)
        timing[phase] += clock() - t0 - ((diag.elapsed - spent) if diag is not None else 0.0)

    # Prompt segments: (start, end, evicted?). context_only keeps the question out of eviction (CriticalKV App. H).
    if scenario == "context_only" and context_tokens is not None and 0 < context_tokens < T:
        segments = [(0, context_tokens, True), (context_tokens, T, False)]
    else:
        segments = [(0, T, True)]
    with attention.active(cache):
        _sync(device)
        t0 = clock()
        for start, end, evicted in segments:
            cache.frozen = not evicted
            step = end - start if (block is None or one_pass or policy.single_pass_prefill) else block
            for s in range(start, end, step):
                logits = forward(ids[:, s:min(end, s + step)])
                evict("prefill")
        _sync(device)
        prefill_s = clock() - t0

        cache.start_decoding()
        new: list[int] = []
        steps = 0
        t0 = clock()
        while max_new_tokens > 0:
            if on_logits is not None:
                on_logits(logits)
            if processors:  # what generate(do_sample=False) does to the logits (min_new_tokens included)
                logits = processors(torch.tensor([input_ids + new], device=device), logits)
            tok = forced[len(new)] if forced is not None else int(logits.argmax(dim=-1))
            if forced is None and tok in stop:
                break
            new.append(tok)
            if len(new) >= max_new_tokens or (forced is not None and len(new) >= len(forced)):
                break
            logits = forward(torch.tensor([[tok]], device=device))
            if decode_evicts:
                evict("decode")
            steps += 1
        _sync(device)
        decode_s = clock() - t0
    return GenerationResult(tokens=new, prompt_tokens=T, prefill_s=prefill_s, decode_s=decode_s, decode_steps=steps,
                            evict_s=timing["prefill"] + timing["decode"], evict_prefill_s=timing["prefill"],
                            evict_decode_s=timing["decode"], peak_kv_tokens=cache.peak_tokens(), kv_bytes_peak=peak_bytes,
                            trace=traces, diagnostics=diag.summary() if diag is not None else None)


# ---------------------------------------------------------------------------------------------------------------
# The run loop over a task's samples: resumable, one predictions.jsonl line per finished sample.

def sample_seed(sample_id: str) -> int:
    return zlib.crc32(sample_id.encode("utf-8"))


def read_records(path: Path, repair: bool = True) -> list[dict[str, Any]]:
    """Finished records of a predictions file, in file order.

    A torn or unreadable line ends the file: it and everything after it are cut off (a killed run leaves at most
    its last line torn); `repair=False` only reads (reports must not modify a run that may still be going). A repeated id keeps its first record (appends are one line per finished sample, so a
    repeat can only come from outside interference; the first record is the one a clean run would hold).
    """
    if not path.is_file():
        return []
    data = path.read_bytes()
    records, good, seen = [], 0, set()
    for line in data.split(b"\n"):
        end = good + len(line) + 1
        if end > len(data):  # no newline: the write was interrupted
            break
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            break
        if not isinstance(record, dict) or "id" not in record:
            break
        if record["id"] not in seen:
            seen.add(record["id"])
            records.append(record)
        good = end
    if repair and good < len(data):
        with path.open("r+b") as f:
            f.truncate(good)
            f.flush()
            os.fsync(f.fileno())
    return records


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One complete line per write, flushed to disk, so a kill never leaves a half record behind a good one."""
    line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    with path.open("ab") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


@dataclass
class RunSettings:
    budget: int | None
    block: int | None  # None: the prompt goes in one forward (the protocol says so, or B = inf)
    scenario: str = "question_aware"
    protocol: str = "blockwise"
    save_prompts: bool = False
    shard: tuple[int, int] | None = None  # (i, n): samples with index % n == i
    diagnostics: tuple[str, ...] = ()


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def run_task(model: Any, tokenizer: Any, policy: Policy, task: Task, env: TaskEnv, settings: RunSettings,
             out_dir: Path, progress: bool = True, references: dict[Any, Any] | None = None) -> list[dict[str, Any]]:
    """Run every (not yet finished) sample of `task`, appending records to out_dir/predictions.jsonl.

    `references` caches full-cache continuations of reference tasks between runs on the same model.
    """
    from tqdm import tqdm

    pred_path = out_dir / "predictions.jsonl"
    records = read_records(pred_path)
    done = {r["id"] for r in records}
    samples = list(task.samples(env))
    if settings.shard is not None:
        i, n = settings.shard
        samples = [s for k, s in enumerate(samples) if k % n == i]
    default_stop = eos_ids(model, tokenizer)
    todo = [s for s in samples if s.id not in done]
    bar = tqdm(todo, desc=f"{task.name}", unit="sample", disable=not progress, dynamic_ncols=True)
    for sample in bar:
        policy.start_sample(sample_seed(sample.id))
        if task.needs_reference:
            record = _reference_sample(model, tokenizer, policy, task, sample, settings,
                                       references if references is not None else {})
        else:
            res = generate(model, policy, sample.input_ids, settings.block, sample.max_new_tokens,
                           stop_ids=sample.stop_token_ids if sample.stop_token_ids is not None else default_stop,
                           min_new_tokens=sample.min_new_tokens, context_tokens=sample.context_tokens,
                           scenario=settings.scenario, diagnostics=settings.diagnostics,
                           protocol=settings.protocol)
            prediction = tokenizer.decode(res.tokens, skip_special_tokens=True)
            record = make_record(sample, prediction, res, task.score(sample, prediction), settings)
        append_record(pred_path, record)
        records.append(record)
    order = {s.id: k for k, s in enumerate(samples)}
    return sorted((r for r in records if r["id"] in order), key=lambda r: order[r["id"]])


def _reference_sample(model: Any, tokenizer: Any, policy: Policy, task: Task, sample: Sample,
                      settings: RunSettings, references: dict[Any, Any]) -> dict[str, Any]:
    """Label-free scoring: the full cache's greedy continuation, then the policy teacher-forced along it."""
    key = (sample.id, zlib.crc32(json.dumps(sample.input_ids).encode()), sample.max_new_tokens)
    if key not in references:
        logps: list[torch.Tensor] = []
        ref = generate(model, Full(), sample.input_ids, None, sample.max_new_tokens, stop_ids=(),
                       on_logits=lambda lg: logps.append(torch.log_softmax(lg[0], dim=-1)))
        references[key] = (ref.tokens, torch.stack(logps))  # (new, vocab)
    ref_tokens, ref_logp = references[key]
    logps = []
    res = generate(model, policy, sample.input_ids, settings.block, len(ref_tokens), stop_ids=(),
                   context_tokens=sample.context_tokens, scenario=settings.scenario, forced=ref_tokens,
                   on_logits=lambda lg: logps.append(torch.log_softmax(lg[0], dim=-1)),
                   diagnostics=settings.diagnostics, protocol=settings.protocol)
    test_logp = torch.stack(logps)  # (new, vocab)
    prediction = tokenizer.decode(test_logp.argmax(dim=-1).tolist(), skip_special_tokens=True)
    record = make_record(sample, prediction, res, 0.0, settings)
    extra = task.score_reference(sample, ref_tokens, ref_logp, test_logp)
    record["score"] = extra.pop("score")
    record["reference"] = tokenizer.decode(ref_tokens, skip_special_tokens=True)
    record.update(extra)
    return record


def make_record(sample: Sample, prediction: str, res: GenerationResult, score: float,
                settings: RunSettings) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "id": sample.id, "prediction": prediction, "answers": sample.answers, "score": score,
        "prompt_tokens": res.prompt_tokens, "new_tokens": len(res.tokens),
        "prefill_s": round(res.prefill_s, 6), "decode_s": round(res.decode_s, 6), "decode_steps": res.decode_steps,
        "evict_s": round(res.evict_s, 6), "peak_kv_tokens": res.peak_kv_tokens, "kv_bytes_peak": res.kv_bytes_peak,
        "meta": sample.meta,
    }
    if res.diagnostics is not None:
        rec["diagnostics"] = res.diagnostics
    if settings.save_prompts:
        rec["prompt"] = sample.prompt
    return rec


def summarize(records: list[dict[str, Any]], budget: int | None, evicts: bool) -> dict[str, Any]:
    """Speed and memory over all samples (KeyDiff App. B.3 compression ratio: mean of min(1, N / L_i))."""
    prompt = sum(r["prompt_tokens"] for r in records)
    prefill = sum(r["prefill_s"] for r in records)
    steps = sum(r["decode_steps"] for r in records)
    decode = sum(r["decode_s"] for r in records)
    ratio = [min(1.0, budget / r["prompt_tokens"]) if (evicts and budget) else 1.0 for r in records]
    return {
        "samples": len(records),
        "prompt_tokens": prompt,
        "new_tokens": sum(r["new_tokens"] for r in records),
        "prefill_s": round(prefill, 4),
        "decode_s": round(decode, 4),
        "prefill_tokens_per_s": round(prompt / prefill, 2) if prefill else None,
        "decode_tokens_per_s": round(steps / decode, 2) if decode and steps else None,
        "evict_s": round(sum(r["evict_s"] for r in records), 4),
        "peak_kv_tokens": max((r["peak_kv_tokens"] for r in records), default=0),
        "kv_bytes_peak": max((r["kv_bytes_peak"] for r in records), default=0),
        "compression_ratio": round(sum(ratio) / len(ratio), 6) if ratio else None,
    }


