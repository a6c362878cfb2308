"""The generation loop: block prefill -> evict -> greedy decode with eviction, through a policy-managed cache.

`generate` is the whole mechanism: the prompt goes through the model in blocks of B tokens; after each block
every layer's cache is pruned back to its budget by the policy; decoding feeds one token at a time (B = 1) and
evicts after every step. The protocol (PROTOCOLS) can instead feed the prompt in one forward and/or leave the
cache to grow while decoding. The loop never looks at a policy's class: it only reads its declared needs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from kvbench.engine import attention
from kvbench.engine.cache import EvictingCache
from kvbench.engine.diagnostics import Diagnostics
from kvbench.options import PROTOCOLS
from kvbench.policies.base import Policy


@dataclass(frozen=True)
class GenerationSettings:
    """How one `generate` call runs, beyond the model, the policy and the prompt.

    `block`: prompt tokens per forward (None: the whole prompt in one forward, then one eviction); `protocol`
    (kvbench.options.PROTOCOLS) says whether the prompt goes in blocks at all (else `block` is ignored) and whether
    decoding steps evict. `stop_ids` end the answer (not emitted); `min_new_tokens` holds them off as generate's
    min_new_tokens does. `scenario="context_only"` with `context_tokens`: only the prompt's first `context_tokens`
    tokens are ever evicted (the question after them is not). `diagnostics` names kvbench.engine.diagnostics
    measures taken at every eviction.
    """

    block: int | None = None
    max_new_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    protocol: str = "blockwise"
    scenario: str = "question_aware"
    context_tokens: int | None = None
    diagnostics: tuple[str, ...] = ()


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


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a timer's edge on a GPU; nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Observer:
    """Hooks into one `generate` call, for the fidelity task, tests and the benchmark; the defaults change nothing.

    `on_logits` sees each step's next-token logits (1, vocab) float32, before the processors; `trace` records,
    before every forward, each layer's per-head token positions (b, h_kv, L) into GenerationResult.trace (tests
    rebuild attention from them; ragged layers' shorter heads are padded with -1 in this record only); `clock` times
    prefill, decoding and eviction (kvbench-bench can pass time.process_time: CPU time).
    """

    on_logits: Callable[[torch.Tensor], None] | None = None
    trace: bool = False
    clock: Callable[[], float] = time.perf_counter


class _Stepper:
    """One forward through a policy-managed cache, and the eviction after it: the step prefill, decoding and the
    graded branch all take. Keeps what the result reports of the cache: peak K+V bytes, the position trace and the
    eviction seconds per phase (diagnostics' own time excluded)."""

    def __init__(self, model: Any, cache: EvictingCache, observer: Observer, diag: Diagnostics | None = None) -> None:
        self.model, self.cache, self.obs, self.diag = model, cache, observer, diag
        self.evict_s = {"prefill": 0.0, "decode": 0.0}
        self.peak_bytes = 0
        self.traces: list[list[torch.Tensor | None]] = []

    def forward(self, chunk: torch.Tensor) -> torch.Tensor:
        """chunk (1, t) token ids -> next-token logits (1, vocab) float32."""
        if self.obs.trace:
            self.traces.append(self.cache.head_positions())
        out = self.model(input_ids=chunk, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.peak_bytes = max(self.peak_bytes, self.cache.kv_bytes())
        return out.logits[:, -1].float()

    def evict(self, phase: str) -> None:
        cache, diag = self.cache, self.diag
        if cache.frozen or not cache.policy.evicts:
            return
        device = self.model.device
        sync(device)
        t0 = self.obs.clock()
        spent = diag.elapsed if diag is not None else 0.0
        for layer in cache.evicting_layers():
            cache.policy.evict(layer, diag.observe if diag is not None else None)
        sync(device)
        self.evict_s[phase] += self.obs.clock() - t0 - ((diag.elapsed - spent) if diag is not None else 0.0)

    def step(self, chunk: torch.Tensor, phase: str, evicts: bool = True) -> torch.Tensor:
        logits = self.forward(chunk)
        if evicts:
            self.evict(phase)
        return logits


def _prefill(run: _Stepper, ids: torch.Tensor, s: GenerationSettings) -> torch.Tensor:
    """The prompt ids (1, T) through the cache in blocks (or one forward), evicting after each; returns the last
    position's logits (1, vocab). context_only: the question after `context_tokens` goes in unevicted."""
    T = ids.shape[1]
    one_pass = PROTOCOLS[s.protocol][0] or s.block is None or run.cache.policy.single_pass_prefill
    if s.scenario == "context_only" and s.context_tokens is not None and 0 < s.context_tokens < T:
        segments = [(0, s.context_tokens, True), (s.context_tokens, T, False)]
    else:
        segments = [(0, T, True)]
    for start, end, evicted in segments:
        run.cache.frozen = not evicted
        step = end - start if one_pass else s.block
        for i in range(start, end, step):
            logits = run.step(ids[:, i:min(end, i + step)], "prefill")
    return logits


def _decode(run: _Stepper, ids: torch.Tensor, logits: torch.Tensor, s: GenerationSettings, processors: Any,
            forced: Sequence[int] | None) -> tuple[list[int], int]:
    """Greedy decoding from the prompt's last logits: (new tokens, one-token forwards). `forced` tokens are fed
    instead of the argmax (teacher forcing; the stop tokens do not end it). One host sync per step: the token."""
    T = ids.shape[1]
    stop = set(s.stop_ids)
    evicts = PROTOCOLS[s.protocol][1]
    limit = s.max_new_tokens if forced is None else min(s.max_new_tokens, len(forced))
    # The prompt and the answer so far, in one buffer written in place: the processors read a view of it and each
    # step's input is a one-token view, so a step does no O(T) host work (no list copied into a new tensor).
    seq = torch.cat([ids, ids.new_zeros((1, max(limit, 0)))], dim=1)  # (1, T + limit)
    new: list[int] = []
    steps = 0
    while len(new) < limit:
        if run.obs.on_logits is not None:
            run.obs.on_logits(logits)
        if processors:  # what generate(do_sample=False) does to the logits (min_new_tokens included)
            logits = processors(seq[:, :T + len(new)], logits)
        tok = forced[len(new)] if forced is not None else int(logits.argmax(dim=-1))
        if forced is None and tok in stop:
            break
        seq[0, T + len(new)] = tok
        new.append(tok)
        if len(new) == limit:
            break
        logits = run.step(seq[:, T + len(new) - 1:T + len(new)], "decode", evicts)
        steps += 1
    return new, steps


@torch.inference_mode()
def generate(model: Any, policy: Policy, input_ids: list[int], settings: GenerationSettings,
             forced: Sequence[int] | None = None, answer_ids: Sequence[int] | None = None,
             observer: Observer | None = None) -> GenerationResult:
    """Greedy generation through a policy-managed cache: `_prefill`, then `_decode`, then (with `answer_ids`) the
    graded branch.

    Greedy = what `model.generate(do_sample=False)` picks: the generation_config's processors apply
    (greedy_processors). `forced`: tokens fed instead of the argmax, at most `settings.max_new_tokens` of them (the
    fidelity task scores a policy along the full cache's answer). `answer_ids`: a gold continuation whose mean
    log-probability per token (the graded score) is measured by teacher forcing it after the prompt through a fork
    of the cache taken when the prompt is done, so it sees the same cache, protocol and evictions as the greedy
    decode, which it leaves untouched; the log-probabilities are the model's own (before the logits processors), as
    in a teacher-forced forward of prompt + answer.
    """
    obs = observer or Observer()
    clock, device = obs.clock, model.device
    ids = torch.tensor([input_ids], device=device)  # (1, T)
    cache = EvictingCache(model.config, policy)
    processors = greedy_processors(model, ids, sorted(set(settings.stop_ids)), settings.min_new_tokens,
                                   settings.max_new_tokens)
    diag = Diagnostics(tuple(settings.diagnostics)) if settings.diagnostics else None
    if diag is not None and not cache.query_window:
        cache.query_window = diag.query_window
    run = _Stepper(model, cache, obs, diag)
    with attention.active(cache):
        sync(device)
        t0 = clock()
        logits = _prefill(run, ids, settings)
        sync(device)
        prefill_s = clock() - t0
        cache.start_decoding()
        branch = (cache.fork(), logits) if answer_ids else None
        t0 = clock()
        new, steps = _decode(run, ids, logits, settings, processors, forced)
        sync(device)
        decode_s = clock() - t0
    answer_logprob, graded_s = None, 0.0
    if branch is not None:
        t0 = clock()
        answer_logprob = teacher_forced_logprob(model, *branch, list(answer_ids or ()), PROTOCOLS[settings.protocol][1])
        graded_s = clock() - t0
    return GenerationResult(tokens=new, prompt_tokens=ids.shape[1], prefill_s=prefill_s, decode_s=decode_s,
                            decode_steps=steps, evict_s=run.evict_s["prefill"] + run.evict_s["decode"],
                            evict_prefill_s=run.evict_s["prefill"], evict_decode_s=run.evict_s["decode"],
                            peak_kv_tokens=cache.peak_tokens(), kv_bytes_peak=run.peak_bytes, trace=run.traces,
                            diagnostics=diag.summary() if diag is not None else None,
                            answer_logprob=answer_logprob, graded_s=graded_s)


def teacher_forced_logprob(model: Any, cache: EvictingCache, logits: torch.Tensor, answer_ids: list[int],
                           evicts: bool) -> float:
    """Mean log-probability per token (nats) of `answer_ids` fed one by one into `cache` (a fork taken after the
    prompt; its own policy copy evicts after every token when `evicts`), `logits` (1, vocab) the prompt's last.
    The same step as decoding (_Stepper), with nothing recorded."""
    run = _Stepper(model, cache, Observer())
    answer = torch.tensor([answer_ids], device=logits.device)  # (1, A)
    logps: list[torch.Tensor] = []  # one 0-d tensor per answer token; a single host sync at the end
    with attention.active(cache):
        for k, tok in enumerate(answer_ids):
            logps.append(torch.log_softmax(logits[0], dim=-1)[tok])
            if k + 1 == len(answer_ids):
                break
            logits = run.step(answer[:, k:k + 1], "decode", evicts)
    return float(torch.stack(logps).mean())
