"""Generation through the static slot cache: the prompt in blocks, one step, the loop.

Each prompt block and each decoding step is one forward of fixed shapes followed by one eviction of every evicting
layer at once (kvbench/engine/slotcache.py); with `compile` both run as one `torch.compile(fullgraph=True)` graph per
forward shape (the prompt's blocks, its last partial block, a decoding step).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from kvbench.engine.generate import GenerationResult, GenerationSettings, Observer, sync
from kvbench.engine.hf import greedy_processors
from kvbench.engine.slotcache import IMPL, SlotCache, evict, forward, install
from kvbench.options import PROTOCOLS
from kvbench.policies.base import Policy


def plan(T: int, settings: GenerationSettings, policy: Policy) -> list[tuple[int, int, bool]]:
    """The prompt's forwards in order: (start, end, evicted). Blocks of B tokens, or one forward; context_only: the
    question after `context_tokens` goes in unevicted."""
    s = settings
    one_pass = PROTOCOLS[s.protocol][0] or s.block is None or policy.single_pass_prefill
    segments = [(0, T, True)]
    if s.scenario == "context_only" and s.context_tokens is not None and 0 < s.context_tokens < T:
        segments = [(0, s.context_tokens, True), (s.context_tokens, T, False)]
    out = []
    for start, end, evicted in segments:
        step = end - start if one_pass else s.block
        out += [(i, min(end, i + step), evicted) for i in range(start, end, step)]
    return out


def capacity(chunks: list[tuple[int, int, bool]], keep: int, new: int, evicts_decoding: bool) -> int:
    """The slots per head an evicting layer needs for the run: the most it holds between two evictions, when every
    eviction leaves it `keep` tokens (the largest budget)."""
    held = peak = 0
    for start, end, evicted in chunks:
        held += end - start
        peak = max(peak, held)
        if evicted:
            held = min(held, keep)
    frozen = bool(chunks) and not chunks[-1][2]
    for _ in range(new):
        held += 1
        peak = max(peak, held)
        if evicts_decoding and not frozen:
            held = min(held, keep)
    return peak


class SlotRun:
    """One `generate` call's cache and step functions."""

    def __init__(self, model: Any, policy: Policy, T: int, settings: GenerationSettings, new: int,
                 compiled: bool = False) -> None:
        self.model, self.policy, self.settings = model, policy, settings
        self.chunks = plan(T, settings, policy)
        self.evicts_decoding = PROTOCOLS[settings.protocol][1] and not (self.chunks and not self.chunks[-1][2])
        cfg = model.config.get_text_config(decoder=True)
        n = cfg.num_hidden_layers
        policy.attach(n)
        budgets = [policy.layer_budget(i, T) for i in range(n)] if policy.evicts else []
        keep = max([policy.head_capacity(b) for b in budgets if b is not None], default=T + new)
        S = capacity(self.chunks, keep, new, self.evicts_decoding)
        window = policy.query_window if policy.slot_window is None else policy.slot_window
        if window < 0:
            window = max(end - start for start, end, _ in self.chunks)
        self.cache = SlotCache(model, policy, 1, S, T + new, window)
        self.step: Callable[..., torch.Tensor] = self._step
        if compiled:
            self.step = torch.compile(self._step, fullgraph=True, dynamic=False)

    def counts(self, seen: int) -> torch.Tensor:
        """(L, 1, 1) the evicting layers' budgets after `seen` tokens."""
        g = self.cache.evicting
        return torch.tensor([self.policy.layer_budget(i, seen) for i in g.layers], device=g.pos.device).view(-1, 1, 1)

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
        """One forward of ids (1, t) at positions (1, t), then the eviction when `counts` is given; the last row's
        logits (1, vocab) float32."""
        logits = forward(self.model, self.cache, ids, positions)
        self.cache.end()  # the peaks: before the eviction
        if counts is not None:
            evict(self.cache, counts)
        return logits[:, -1].float()


@torch.inference_mode()
def generate_slots(model: Any, policy: Policy, input_ids: Sequence[int], settings: GenerationSettings,
                   forced: Sequence[int] | None = None, answer_ids: Sequence[int] | None = None,
                   observer: Observer | None = None, compiled: bool = False) -> GenerationResult:
    """`generate` through the static slot cache: the prompt in the plan's forwards (each followed by an eviction of
    every evicting layer), then greedy decoding, one step a token, each evicting when the protocol says so;
    `answer_ids` teacher-forced through a fork of the cache after the prompt (the graded score)."""
    if model.config._attn_implementation != IMPL:
        install(model)
    obs = observer or Observer()
    ids = torch.tensor([list(input_ids)], device=model.device)  # (1, T)
    T = ids.shape[1]
    new = max(settings.max_new_tokens, len(answer_ids or ()))
    run = SlotRun(model, policy, T, settings, new, compiled)
    evicting = policy.evicts and run.cache.evicting is not None
    traces: list[list[torch.Tensor | None]] = []
    clock, device = obs.clock, ids.device
    t0 = clock()
    logits = None
    for start, end, evicted in run.chunks:
        if obs.trace:
            traces.append(run.cache.layer_positions())
        positions = torch.arange(start, end, device=device).unsqueeze(0)
        logits = run.step(ids[:, start:end], positions, run.counts(end) if evicted and evicting else None)
    sync(device)
    prefill_s = clock() - t0
    run.cache.decoding = True
    graded = None
    if answer_ids:
        branch = run.cache.fork()
        graded = _teacher(run, branch, logits, T, list(answer_ids), clock)
    t0 = clock()
    processors = greedy_processors(model, ids, sorted(set(settings.stop_ids)), settings.min_new_tokens,
                                   settings.max_new_tokens)
    limit = settings.max_new_tokens if forced is None else min(settings.max_new_tokens, len(forced))
    tokens: list[int] = []
    seq = torch.cat([ids, ids.new_zeros((1, max(limit, 0)))], dim=1)  # (1, T + limit)
    steps = 0
    while len(tokens) < limit:
        if obs.on_step is not None:
            obs.on_step(run.cache)
        if obs.on_logits is not None:
            obs.on_logits(logits)
        if forced is not None:
            tok = int(forced[len(tokens)])
        else:
            tok = int(processors(seq[:, :T + len(tokens)], logits).argmax(dim=-1))
            if tok in settings.stop_ids:
                break
        seq[0, T + len(tokens)] = tok
        tokens.append(tok)
        if len(tokens) >= limit:
            break
        if obs.trace:
            traces.append(run.cache.layer_positions())
        pos = T + len(tokens) - 1
        counts = run.counts(pos + 1) if evicting and run.evicts_decoding else None
        logits = run.step(seq[:, pos:pos + 1], torch.tensor([[pos]], device=device), counts)
        steps += 1
    sync(device)
    decode_s = clock() - t0
    peak, total = (int(v) for v in torch.stack([run.cache.peak, run.cache.peak_total]).view(-1).tolist())
    return GenerationResult(tokens=tokens, prompt_tokens=T, prefill_s=prefill_s, decode_s=decode_s,
                            decode_steps=steps, evict_s=0.0, peak_kv_tokens=peak,
                            kv_bytes_peak=total * run.cache.bytes_per_head_token(), trace=traces,
                            answer_logprob=graded)


def _teacher(run: SlotRun, cache: SlotCache, logits: torch.Tensor, T: int, answer: list[int],
             clock: Callable[[], float]) -> float:
    """The mean log-probability per token of `answer` teacher-forced after the prompt through `cache` (a fork)."""
    main, run.cache = run.cache, cache
    try:
        logps = []
        for k, tok in enumerate(answer):
            logps.append(torch.log_softmax(logits[0], dim=-1)[tok])
            if k + 1 == len(answer):
                break
            pos = T + k
            counts = run.counts(pos + 1) if run.policy.evicts and run.evicts_decoding and cache.evicting else None
            logits = run.step(torch.tensor([[tok]], device=logits.device), torch.tensor([[pos]], device=logits.device),
                              counts)
        return float(torch.stack(logps).mean())
    finally:
        run.cache = main
