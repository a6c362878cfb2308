"""The generation loop: block prefill -> evict -> greedy decode with eviction, through a policy-managed cache.

`generate` is the whole mechanism: the prompt goes through the model in blocks of B tokens; after each block
every layer's cache is pruned back to its budget by the policy; decoding feeds one token at a time (B = 1) and
evicts after every step. The protocol (PROTOCOLS) can instead feed the prompt in one forward and/or leave the
cache to grow while decoding. The loop never looks at a policy's class: it only reads its declared needs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from kvbench.engine import attention
from kvbench.engine.cache import EvictingCache
from kvbench.engine.diagnostics import Diagnostics
from kvbench.policies.base import Policy

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
    answer_logprob: float | None = None  # mean log-probability per token (nats) of `answer_ids`, when given
    graded_s: float = 0.0  # time of that teacher-forced branch (not in prefill_s nor decode_s)


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


@dataclass
class Observer:
    """Hooks into one `generate` call, for the fidelity task, tests and the benchmark; the defaults change nothing.

    `forced` teacher-forces these tokens instead of the argmax (the fidelity task); `on_logits` sees each step's
    next-token logits (1, vocab) float32, before the processors; `trace` records, before every forward, each
    layer's per-head token positions (b, h_kv, L) into GenerationResult.trace (tests rebuild attention from them;
    ragged layers' shorter heads are padded with -1 in this record only); `clock` times prefill, decoding and
    eviction (kvbench-bench can pass time.process_time: CPU time).
    """

    forced: list[int] | None = None
    on_logits: Callable[[torch.Tensor], None] | None = None
    trace: bool = False
    clock: Callable[[], float] = time.perf_counter


@torch.inference_mode()
def generate(model: Any, policy: Policy, input_ids: list[int], block: int | None, max_new_tokens: int,
             stop_ids: Iterable[int] = (), min_new_tokens: int = 0, context_tokens: int | None = None,
             scenario: str = "question_aware", protocol: str = "blockwise", diagnostics: Iterable[str] = (),
             observer: Observer | None = None, answer_ids: list[int] | None = None) -> GenerationResult:
    """Greedy generation through a policy-managed cache.

    Greedy = what `model.generate(do_sample=False)` picks: the generation_config's processors apply
    (greedy_processors). `block=None` feeds the whole prompt in one forward, then evicts once. `protocol`
    (PROTOCOLS) says whether the prompt goes in blocks (else `block` is ignored) and whether decoding steps evict.
    `context_tokens` with scenario=context_only: the prompt's first tokens that eviction applies to (the question
    after them is never evicted). `diagnostics` names kvbench.engine.diagnostics measures taken at every eviction.
    `answer_ids`: a gold continuation whose mean log-probability per token (the graded score) is measured by
    teacher forcing it after the prompt through a fork of the cache taken when the prompt is done, so it sees the
    same cache, protocol and evictions as the greedy decode, which it leaves untouched; the log-probabilities are
    the model's own (before the logits processors), as in a teacher-forced forward of prompt + answer.
    """
    obs = observer or Observer()
    clock, forced = obs.clock, obs.forced
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
        if obs.trace:
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
        branch = (cache.fork(), logits) if answer_ids else None
        new: list[int] = []
        steps = 0
        t0 = clock()
        while max_new_tokens > 0:
            if obs.on_logits is not None:
                obs.on_logits(logits)
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
    answer_logprob, graded_s = None, 0.0
    if branch is not None:
        t0 = clock()
        answer_logprob = teacher_forced_logprob(model, *branch, answer_ids, decode_evicts)
        graded_s = clock() - t0
    return GenerationResult(tokens=new, prompt_tokens=T, prefill_s=prefill_s, decode_s=decode_s, decode_steps=steps,
                            evict_s=timing["prefill"] + timing["decode"], evict_prefill_s=timing["prefill"],
                            evict_decode_s=timing["decode"], peak_kv_tokens=cache.peak_tokens(),
                                                                                              kv_bytes_peak=peak_bytes,
                            trace=traces, diagnostics=diag.summary() if diag is not None else None,
                            answer_logprob=answer_logprob, graded_s=graded_s)


def teacher_forced_logprob(model: Any, cache: EvictingCache, logits: torch.Tensor, answer_ids: list[int],
                           evicts: bool) -> float:
    """Mean log-probability per token (nats) of `answer_ids` fed one by one into `cache` (a fork taken after the
    prompt; its own policy copy evicts after every token when `evicts`), `logits` (1, vocab) the prompt's last."""
    device = logits.device
    logps: list[torch.Tensor] = []  # one 0-d tensor per answer token; a single host sync at the end
    with attention.active(cache):
        for k, tok in enumerate(answer_ids):
            logps.append(torch.log_softmax(logits[0], dim=-1)[tok])
            if k + 1 == len(answer_ids):
                break
            out = model(input_ids=torch.tensor([[tok]], device=device), past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
            logits = out.logits[:, -1].float()  # (1, vocab)
            if evicts and not cache.frozen and cache.policy.evicts:
                for layer in cache.evicting_layers():
                    cache.policy.evict(layer, None)
    return float(torch.stack(logps).mean())
