"""The generation loop: the prompt in blocks, one step, the loop, through the static slot cache.

`generate` feeds the prompt in blocks of B tokens; after each block every evicting layer is pruned back to its budget
N by the policy's scores (kvbench/engine/cache.py: one ranking for all layers); decoding feeds one token at a time
and evicts after every step. The protocol (kvbench.options.PROTOCOLS) can instead feed the prompt in one forward and/or
leave the cache to grow while decoding. K runs (`Job`s: samples, or one sample's budgets) go as the cache's batch rows:
one forward and one eviction for all of them. A row whose forward is shorter is padded on the left with tokens at
position PAD (they see only padding and their slots stay free); a row that is done decodes padding. Caches of
different shapes or policies can decode together (`_Together`): each step one forward of all their rows. With
`compile=True` a forward and its eviction run as one `torch.compile(fullgraph=True)` graph (the prompt's last partial
block padded to B: one graph for the blocks, one for a decoding step; a one-pass prompt, one forward, runs eagerly).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from kvbench.engine.cache import IMPL, PAD, Caches, SlotCache, evicted_layers, forward, install, select
from kvbench.models.common import head_dim
from kvbench.models.generation import greedy_processors
from kvbench.options import PROTOCOLS
from kvbench.policies.base import Policy
from kvbench.policies.diagnostics import Diagnostics

_SCORE_ROWS = 512  # positions per float32 log_softmax of the LM score (a full cache scores the whole prompt at once)


@dataclass(frozen=True)
class GenerationSettings:
    """How one `generate` call runs, beyond the model, the policy and the prompt.

    `block`: prompt tokens per forward (None: the whole prompt in one forward, then one eviction); `protocol`
    (kvbench.options.PROTOCOLS) says whether the prompt goes in blocks at all (else `block` is ignored) and whether
    decoding steps evict. `stop_ids` end the answer (not emitted); `min_new_tokens` holds them off as generate's
    min_new_tokens does. `scenario="context_only"` with `context_tokens`: only the prompt's first `context_tokens`
    tokens are ever evicted (the question after them is not, nor the answer after it). `diagnostics` names
    kvbench.policies.diagnostics measures taken at every eviction. `score_from`: the language-modelling score (None:
    not measured): the log-probability of each prompt token t + 1 given what the cache holds when position t goes
    in, for every prompt position t >= score_from (GenerationResult.lm_logprobs). `compile`: each block and decoding
    step with its eviction as one compiled graph (eager's predictions up to rounding; eviction time is not measured
    apart; a one-pass prompt runs eagerly).
    """

    block: int | None = None
    max_new_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    protocol: str = "blockwise"
    scenario: str = "question_aware"
    context_tokens: int | None = None
    diagnostics: tuple[str, ...] = ()
    score_from: int | None = None
    compile: bool = False


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids (stop token excluded)
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    decode_steps: int  # one-token forwards during decoding
    evict_s: float  # evict_prefill_s + evict_decode_s
    peak_kv_tokens: int  # max over layers, heads and time of the tokens one KV head held
    kv_bytes_peak: int  # max over time of the K+V bytes held, all layers
    trace: list[list[torch.Tensor | None]] = field(default_factory=list, repr=False)
    diagnostics: dict[str, Any] | None = None  # Diagnostics.summary() when diagnostics were asked for
    evict_prefill_s: float = 0.0  # eviction time inside prefill_s
    evict_decode_s: float = 0.0  # eviction time inside decode_s
    # per layer, the tokens its fullest KV head holds at the first decoding step, its token included (None: no step)
    layer_tokens: list[int] | None = None
    answer_logprob: float | None = None  # mean log-probability per token (nats) of `answer_ids`, when given
    graded_s: float = 0.0  # time of that teacher-forced branch (not in prefill_s nor decode_s)
    batch_size: int = 1  # the runs (rows) of its forwards (decoding together: of its decoding forwards)
    # max over time of the K+V bytes all its batch's rows held together (decoding together: the caches' sum of theirs)
    batch_kv_bytes_peak: int = 0
    # The language-modelling score (settings.score_from): log p(token t + 1 | cache at t) in nats, float32
    # log_softmax, for t = score_from .. prompt_tokens - 2 in order, and whether the argmax was that token.
    lm_logprobs: list[float] | None = None
    lm_correct: list[bool] | None = None
    trunk_tokens: int = 0  # prompt tokens whose forwards a shared trunk did for this run and others (run_trunk)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a timer's edge on a GPU; nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Observer:
    """Hooks into one `generate` call, for the fidelity task, tests and the benchmark; the defaults change nothing.

    `on_logits` sees each step's next-token logits (1, vocab) float32, before the processors; `trace` records,
    before every forward, each layer's slot positions (1, h_kv, S), -1 free, into GenerationResult.trace (tests
    rebuild attention from them); `clock` times prefill, decoding and eviction (kvbench-bench can pass
    time.process_time: CPU time); `on_step` is called with the run's cache before each step's token pick.
    """

    on_logits: Callable[[torch.Tensor], None] | None = None
    on_step: Callable[[Any], None] | None = None
    trace: bool = False
    clock: Callable[[], float] = time.perf_counter


@dataclass(frozen=True)
class Job:
    """One run of a `generate_batch` call: what `generate` takes for one prompt."""

    input_ids: Sequence[int]
    policy: Policy
    settings: GenerationSettings
    forced: Sequence[int] | None = None
    answer_ids: Sequence[int] | None = None
    observer: Observer | None = None


def plan(T: int, settings: GenerationSettings, policy: Policy) -> list[tuple[int, int, bool]]:
    """The prompt's forwards in order: (start, end, evicted). Blocks of B tokens, or one forward; context_only: the
    question after `context_tokens` goes in unevicted."""
    s = settings
    one_pass = one_forward(s, policy)
    segments = [(0, T, True)]
    if s.scenario == "context_only" and s.context_tokens is not None and 0 < s.context_tokens < T:
        segments = [(0, s.context_tokens, True), (s.context_tokens, T, False)]
    out = []
    for start, end, evicted in segments:
        step = end - start if one_pass else s.block
        out += [(i, min(end, i + step), evicted) for i in range(start, end, step)]
    return out


def one_forward(settings: GenerationSettings, policy: Policy) -> bool:
    """Whether the prompt goes in one forward (a one-pass protocol, no block, or a policy that never evicts)."""
    return PROTOCOLS[settings.protocol][0] or settings.block is None or policy.single_pass_prefill


def capacity(chunks: list[tuple[int, int, bool]], keep: int, new: int, evicts_decoding: bool,
             widths: Sequence[int] | None = None, decoding: bool = False) -> int:
    """The slots per head an evicting layer needs for the run: the most it holds during a forward, when every
    eviction leaves it `keep` tokens (the most a head may keep). `widths`: each prompt round's forward in a batch
    (its padding takes free slots during the forward too; default: the run's own forwards). `decoding`: the most it
    holds once the prompt is in (what a one-pass prompt's slots are cut to, `SlotCache.shrink`)."""
    held = peak = 0
    for i, width in enumerate(widths if widths is not None else [e - s for s, e, _ in chunks]):
        peak = max(peak, held + width)
        if i < len(chunks):
            start, end, evicted = chunks[i]
            held += end - start
            if evicted:
                held = min(held, keep)
    peak = held if decoding else peak
    for _ in range(new):
        held += 1
        peak = max(peak, held)
        if evicts_decoding:
            held = min(held, keep)
    return peak


def slot_key(policy: Policy) -> tuple[Any, ...] | None:
    """Runs whose policies have equal keys (not None) can be rows of one cache, scored by one call: one class, the
    same options but for the budget; None for a policy with per-sample state (Random's generator)."""
    if policy.sample_state:
        return None
    plain = (bool, int, float, str, tuple, frozenset, type(None))
    options = tuple(sorted((k, v) for k, v in vars(policy).items()
                           if isinstance(v, plain) and k not in ("budget", "num_layers") and not k.startswith("_")))
    return type(policy), options


@dataclass
class _Row:
    """One job's state: its plan, its answer so far, and what its result reports."""

    job: Job
    chunks: list[tuple[int, int, bool]]
    evicts_decoding: bool
    limit: int
    obs: Observer
    processors: Any
    seq: torch.Tensor  # (1, T + limit) the prompt and the answer so far, written in place
    diag: Diagnostics | None
    T: int  # the prompt's tokens
    new: list[int] = field(default_factory=list)
    steps: int = 0
    time_s: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    evict_s: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    traces: list[list[torch.Tensor | None]] = field(default_factory=list)
    lm: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (log p (n,), argmax hit (n,))
    trunk: int = 0  # prompt tokens done by a shared trunk


_compiled: dict[str, Callable[..., torch.Tensor]] = {}  # `forward` compiled per device type (graphs kept per shape)


def compiled_forward(device: torch.device) -> Callable[..., torch.Tensor]:
    """`forward` (forward + eviction) as one torch.compile graph per shape; on CUDA a CUDA graph (reduce-overhead)."""
    if device.type not in _compiled:
        mode = "reduce-overhead" if device.type == "cuda" else None
        # every policy, cache shape and batch has graphs of its own (3 a run), all of this one function: dynamo's
        # default of 8 would end a process's third compiled run (fullgraph: an error)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   torch._dynamo.config.accumulated_recompile_limit)
        _compiled[device.type] = torch.compile(forward, fullgraph=True, dynamic=False, mode=mode)
    return _compiled[device.type]


class Batch:
    """K jobs as the rows of one slot cache, and their forward."""

    def __init__(self, model: Any, jobs: Sequence[Job]) -> None:
        if model.config._attn_implementation != IMPL:
            install(model)
        self.model, self.device = model, model.device
        self.compiled = jobs[0].settings.compile
        text = model.config.get_text_config(decoder=True)
        n = text.num_hidden_layers
        self.rows: list[_Row] = []
        plans = [plan(len(job.input_ids), job.settings, job.policy) for job in jobs]
        # each prompt round's forward: the widest row's (compiled: at least a block, the one graph's shape)
        self.floor = floor = max(job.settings.block or 0 for job in jobs) if self.compiled else 0
        widths = [max([p[i][1] - p[i][0] for p in plans if i < len(p)] + [floor]) for i in range(max(map(len, plans)))]
        for job in jobs:
            job.policy.attach(n, head_dim(text))
        evicted = evicted_layers(text, jobs[0].policy)
        keep, after, full, window, attention = [1] * len(evicted), [1] * len(evicted), 1, 0, False
        one_pass = all(one_forward(j.settings, j.policy) for j in jobs)  # decoding needs fewer slots than the prompt
        for job, chunks in zip(jobs, plans):
            s, T = job.settings, len(job.input_ids)
            evicts = PROTOCOLS[s.protocol][1] and chunks[-1][2]  # context_only's question froze the cache
            limit = s.max_new_tokens if job.forced is None else min(s.max_new_tokens, len(job.forced))
            new = max(limit, len(job.answer_ids or ()))
            # per evicting layer, the most a head may keep at any point of the run (PyramidKV's budgets move with the
            # tokens seen), and so the slots the layer needs, and (one-pass) needs once the prompt is in (`after`)
            for j, i in enumerate(evicted):
                budgets = [job.policy.layer_budget(i, seen) for seen in {end for _, end, _ in chunks} | {T + new}]
                head = max([job.policy.head_capacity(b) for b in budgets if b is not None], default=T + new)
                keep[j] = max(keep[j], capacity(chunks, head, new, evicts, widths))
                after[j] = max(after[j], capacity(chunks, head, new, evicts, widths, decoding=True)) if one_pass else 1
            full = max(full, capacity(chunks, T + new, new, False, widths))  # the layers never evicted
            w = job.policy.query_window
            window = max(window, max(e - b for b, e, _ in chunks) if w < 0 else w, 1 if s.diagnostics else 0)
            attention = attention or w > 0 or bool(s.diagnostics)  # the stored queries' attention is read
            seq = torch.tensor([list(job.input_ids) + [0] * max(limit, 0)], device=self.device)  # (1, T + limit)
            processors = greedy_processors(model, seq[:, :T], sorted(set(s.stop_ids)), s.min_new_tokens,
                                           s.max_new_tokens)
            diag = Diagnostics(s.diagnostics) if s.diagnostics else None
            self.rows.append(_Row(job, chunks, evicts, limit, job.observer or Observer(), processors, seq, diag, T))
        if self.compiled:  # fewer shapes, fewer graphs: whole blocks (`step` pads the last), capacities rounded up, all
            # layers' alike (a graph is reused by any cache of the same buffers' shapes: its views are not guarded)
            keep, after = ([max(x, default=0) - max(x, default=0) % -64] * len(x) for x in (keep, after))
            full += -full % 256
        self.after = after if one_pass and after != keep else None  # the slots a one-pass prompt's decoding needs
        self.cache = SlotCache(model, jobs[0].policy, len(jobs), keep, full, window, attention)
        if self.compiled:
            self.cache.static()
        self.seen = [0] * len(jobs)  # each row's tokens so far, on the host (its layers' budgets)
        self.layer_tokens: list[int] | None = None  # the first row's SlotCache.layer_tokens, known after the prompt
        self.tracing = True  # Observer.trace records the run's forwards (not its graded branch's)
        self.clock = self.rows[0].obs.clock
        self.forward = compiled_forward(self.device) if self.compiled else forward
        self.diagnosed = [r.diag for r in self.rows]
        # diagnostics observe the eviction from the host: a diagnosed batch evicts outside the compiled forward
        self.in_graph = self.compiled and not any(self.diagnosed) and not jobs[0].policy.sample_state
        self.start, self.trunk_logits = 0, None  # the first prompt round to run, and the logits before it (`adopt`)
        # set by `_prompt`: the logits to decode from (K, vocab), the graded branch's log-probabilities and seconds
        # per row, and the tokens each row's layers hold per head after the prompt (K, layers)
        self.logits = self.after_prompt = torch.empty(0, device=self.device)
        self.graded: list[list[torch.Tensor]] = []
        self.graded_s: list[float] = []

    def adopt(self, trunk: Trunk) -> None:
        """Every row starts from `trunk` (one prompt and plan): its forwards done, their time each row's share; the
        eviction after the last of them (the first that may drop a token) runs here."""
        t0 = self.clock()
        self.cache.adopt(trunk.cache, trunk.end, trunk.fed, trunk.queries, trunk.received)
        self.start, self.trunk_logits = trunk.chunks, trunk.logits
        self.seen = [trunk.end] * len(self.rows)
        evicting = [r.chunks[trunk.chunks - 1][2] and r.job.policy.evicts for r in self.rows]
        counts = self.counts(evicting)
        evict_s = self._evict(counts, evicting) if counts is not None else 0.0
        spent = self.clock() - t0
        for row in self.rows:
            row.time_s["prefill"] += (trunk.seconds + spent) / len(self.rows)
            row.evict_s["prefill"] += evict_s / len(self.rows)
            row.trunk = trunk.end

    def counts(self, evicting: list[bool]) -> torch.Tensor | None:
        """(L, K, 1) each row's budget per evicting layer after the tokens it has seen (a row not evicting keeps
        all: the capacity); None when no row evicts."""
        g = self.cache.evicting
        if g is None or not any(evicting):
            return None
        S = g.pos.shape[-1]
        table = [[r.job.policy.layer_budget(i, self.seen[k]) if evicting[k] else S for k, r in enumerate(self.rows)]
                 for i in g.layers]
        return torch.tensor(table, device=self.device).view(len(g.layers), len(self.rows), 1)

    def step(self, spans: list[tuple[int, int] | None], tokens: list[list[int]], evicting: list[bool],
             phase: str) -> torch.Tensor:
        """One forward of each row's tokens at positions spans[k] = (start, end) (None: padding only), then the
        eviction of the rows in `evicting`; each row is charged an equal share of the time (and of the eviction's,
        measured apart unless compiled). Returns the last position's logits (K, vocab) float32."""
        t = 1 if phase == "decode" else max(max(len(ts) for ts in tokens), self.floor)
        # compiled: a block or a step is a graph; a one-pass prompt, one forward a sample, runs eagerly (as a graph it
        # would compile again for every prompt length, to run once)
        run, in_graph = (self.forward, self.in_graph) if phase == "decode" or t == self.floor else (forward, False)
        ids = torch.zeros(len(self.rows), t, dtype=torch.long)
        positions = torch.full((len(self.rows), t), PAD, dtype=torch.long)
        causal = not any(self.seen) and all(s is not None and s[1] - s[0] == t for s in spans)  # empty, unpadded
        for k, (span, ts) in enumerate(zip(spans, tokens)):
            if span is not None:
                ids[k, t - len(ts):] = torch.tensor(ts)
                positions[k, t - len(ts):] = torch.arange(span[0], span[1])
                self.seen[k] = span[1]
        ids, positions = ids.to(self.device), positions.to(self.device)
        for k, row in enumerate(self.rows):
            if row.obs.trace and self.tracing and spans[k] is not None:  # the row's own forwards only
                row.traces.append([p[k:k + 1].clone() for p in self.cache.layer_positions()])
        scored, keep = [], 1  # the LM score's positions per row (`_scored`), the last positions the logits keep
        if phase == "prefill":
            scored = [self._scored(k, s) for k, s in enumerate(spans)]
            keep = max(max(n for _, _, n in scored), 1)
        t0 = self.clock()
        counts = self.counts(evicting)
        logits = run(self.model, self.cache, ids, positions, keep, counts if in_graph else None, causal)
        evict_s = self._evict(counts, evicting) if counts is not None and not in_graph else 0.0
        spent = self.clock() - t0
        for row in self.rows:
            row.time_s[phase] += spent / len(self.rows)
            row.evict_s[phase] += evict_s / len(self.rows)
        for k, (lo, hi, _) in enumerate(scored):
            if hi > lo:
                self._score(self.rows[k], logits[k], keep - (spans[k][1] - lo), lo, hi)  # type: ignore[index]
        last = logits[:, -1].float()
        return last.clone() if self.compiled else last  # a CUDA graph's next replay overwrites its outputs

    def _evict(self, counts: torch.Tensor, evicting: list[bool]) -> float:
        """The eviction of the rows in `evicting` outside a compiled forward, timed apart (a timer's edge on each
        side); returns its seconds."""
        sync(self.device)
        t1 = self.clock()
        diagnosed, view = self.diagnosed, self.cache.view
        drop = select(self.cache.policy, view, counts)  # (L, K, h_kv, S) the slots it frees
        for k, diag in enumerate(diagnosed):  # each diagnosed row's measures, while every token is still held
            if diag is not None and evicting[k]:
                diag.observe(view, ~drop & (view.pos >= 0), k)
        view.pos.masked_fill_(drop, -1)
        sync(self.device)
        evict_s = self.clock() - t1
        if any(diagnosed):  # the diagnostics' own time is not the eviction's
            evict_s -= sum(d.elapsed_now() for d in diagnosed if d is not None)
        return evict_s

    def _scored(self, k: int, span: tuple[int, int] | None) -> tuple[int, int, int]:
        """The prompt positions [lo, hi) of row k's forward over `span` whose next token the LM score takes, and
        how many of the forward's last positions that needs (0: none)."""
        start = self.rows[k].job.settings.score_from
        if start is None or span is None:
            return 0, 0, 0
        lo, hi = max(span[0], start), min(span[1], self.rows[k].T - 1)
        return lo, hi, (span[1] - lo if hi > lo else 0)

    def _score(self, row: _Row, logits: torch.Tensor, first: int, lo: int, hi: int) -> None:
        """Row's LM-score pieces from its logits (keep, vocab), whose row `first` is position lo: float32 log_softmax
        at the next prompt token and whether the argmax is it; kept on the device until the end."""
        target = row.seq[0, lo + 1:hi + 1]
        for a in range(0, hi - lo, _SCORE_ROWS):
            b = min(hi - lo, a + _SCORE_ROWS)
            rows = logits[first + a:first + b].float()  # (n, vocab)
            row.lm.append((torch.log_softmax(rows, dim=-1).gather(1, target[a:b, None])[:, 0],
                           rows.argmax(dim=-1) == target[a:b]))


def _prefill(batch: Batch) -> torch.Tensor:
    """Every row's prompt, round by round (round i: each row's i-th forward), each followed by its eviction;
    returns each row's logits after its last prompt forward (K, vocab)."""
    rows = batch.rows
    last: list[torch.Tensor | None] = [batch.trunk_logits] * len(rows)
    for i in range(batch.start, max(len(r.chunks) for r in rows)):
        spans = [r.chunks[i][:2] if i < len(r.chunks) else None for r in rows]
        tokens = [list(r.job.input_ids[s[0]:s[1]]) if s is not None else [] for r, s in zip(rows, spans)]
        evicting = [i < len(r.chunks) and r.chunks[i][2] and r.job.policy.evicts for r in rows]
        logits = batch.step(spans, tokens, evicting, "prefill")
        for k, s in enumerate(spans):
            if s is not None:
                last[k] = logits[k]
    t0 = batch.clock()
    if batch.after is not None:  # a one-pass prompt's slots cut to what decoding needs
        batch.cache.shrink(batch.after)
        if batch.compiled:
            batch.cache.static()
    sync(batch.device)  # the prompt's queued work is the prompt's (a GPU's timer edge; nothing on a CPU)
    for r in rows:
        r.time_s["prefill"] += (batch.clock() - t0) / len(rows)
    return torch.stack(last)  # type: ignore[arg-type]


def _pick(batch: Batch, logits: torch.Tensor, active: list[bool], graded: bool) -> dict[int, int]:
    """The observers' calls and the greedy rows' tokens (generate's processors, then the argmax: one host read)."""
    rows = batch.rows
    for k, row in enumerate(rows):
        if active[k] and not graded:
            if row.obs.on_step is not None:
                row.obs.on_step(batch.cache)
            if row.obs.on_logits is not None:
                row.obs.on_logits(logits[k:k + 1])
    greedy = [k for k, r in enumerate(rows) if active[k] and not graded and r.job.forced is None]
    if not greedy:
        return {}
    scores = torch.cat([rows[k].processors(rows[k].seq[:, :rows[k].T + len(rows[k].new)], logits[k:k + 1])
                        for k in greedy])
    return dict(zip(greedy, scores.argmax(dim=-1).tolist()))


def _decode(batch: Batch, logits: torch.Tensor, graded: bool = False) -> list[list[torch.Tensor]]:
    """Greedy decoding of every row from its prompt's last logits (K, vocab), up to its limit (teacher-forcing its
    `forced` tokens, or with `graded` its answer); a row that emits a stop token or reaches its limit decodes
    padding. Returns, with `graded`, each row's answer log-probabilities (the model's own, before the processors)."""
    rows = batch.rows
    logps: list[list[torch.Tensor]] = [[] for _ in rows]
    limits = [len(r.job.answer_ids or ()) if graded else r.limit for r in rows]
    active = [n > 0 for n in limits]
    fed = [0] * len(rows)
    while any(active):
        t0 = batch.clock()
        picked = _pick(batch, logits, active, graded)
        spans: list[tuple[int, int] | None] = [None] * len(rows)
        tokens: list[list[int]] = [[] for _ in rows]
        for k, row in enumerate(rows):
            if not active[k]:
                continue
            if graded:
                tok = int(row.job.answer_ids[fed[k]])  # type: ignore[index]
                logps[k].append(torch.log_softmax(logits[k], dim=-1)[tok])
            else:
                tok = int(row.job.forced[len(row.new)]) if row.job.forced is not None else picked[k]
                if row.job.forced is None and tok in row.job.settings.stop_ids:
                    active[k] = False
                    continue
                row.seq[0, row.T + len(row.new)] = tok
                row.new.append(tok)
            fed[k] += 1
            if fed[k] >= limits[k]:
                active[k] = False
                continue
            spans[k], tokens[k] = (row.T + fed[k] - 1, row.T + fed[k]), [tok]
        spent = batch.clock() - t0  # the token picks
        for row in rows:
            row.time_s["decode"] += spent / len(rows)
        if all(s is None for s in spans):
            break
        evicting = [s is not None and r.evicts_decoding and r.job.policy.evicts for s, r in zip(spans, rows)]
        logits = batch.step(spans, tokens, evicting, "decode")
        for k, s in enumerate(spans):
            if s is not None and not graded:
                rows[k].steps += 1
        if batch.cache.layer_tokens is None and not graded:
            batch.cache.layer_tokens = batch.layer_tokens
    return logps


def _lm(row: _Row) -> tuple[list[float] | None, list[bool] | None]:
    """Row's LM score as host lists (None when it was not asked for)."""
    if row.job.settings.score_from is None:
        return None, None
    if not row.lm:
        return [], []
    return torch.cat([p for p, _ in row.lm]).tolist(), torch.cat([h for _, h in row.lm]).tolist()


def _prompt(model: Any, jobs: Sequence[Job], trunk: Trunk | None = None) -> Batch:
    """Every job as one row of one slot cache, through its prompt (from `trunk` on when given) and the graded branch
    of the jobs with an answer (teacher-forced through a fork of the cache taken after the prompt); the batch is
    then ready to decode from `batch.logits` (K, vocab)."""
    batch = Batch(model, jobs)
    if trunk is not None:
        batch.adopt(trunk)
    batch.logits = _prefill(batch)
    if batch.cache.view is not None:
        batch.cache.view.decoding = True
    batch.graded, batch.graded_s = [[] for _ in jobs], [0.0] * len(jobs)
    if any(j.answer_ids for j in jobs):
        main, before = batch.cache, [r.time_s["decode"] for r in batch.rows]
        batch.cache, batch.tracing = main.fork().static() if batch.compiled else main.fork(), False
        batch.graded = _decode(batch, batch.logits, graded=True)
        for k, r in enumerate(batch.rows):
            batch.graded_s[k], r.time_s["decode"] = r.time_s["decode"] - before[k], before[k]
        batch.cache, batch.seen, batch.tracing = main, [r.T for r in batch.rows], True
    batch.after_prompt = torch.stack([h.amax(dim=-1) for h in batch.cache.held()], dim=1)  # (K, layers)
    if any(r.obs.on_step is not None for r in batch.rows):  # kvbench-bench's lockstep reads it (one host read)
        batch.layer_tokens = (batch.after_prompt[0] + 1).tolist()
    return batch


def _results(batch: Batch, size: int, held_together: torch.Tensor) -> list[GenerationResult]:
    """Each row's result once decoded: `size` rows went through its decoding forwards, holding `held_together` (a
    tensor) tokens per KV head at most over time."""
    # one host read: the peaks and each layer's tokens per head at the first decoding step (its token included)
    values = torch.cat([batch.cache.peak, batch.cache.peak_total, held_together.view(1),
                        (batch.after_prompt + 1).view(-1)]).tolist()
    K, per_token, width = len(batch.rows), batch.cache.bytes_per_head_token(), batch.after_prompt.shape[1]
    peaks, totals, together, tokens_at = values[:K], values[K:2 * K], values[2 * K], values[2 * K + 1:]
    out = []
    for k, r in enumerate(batch.rows):
        lm, graded = _lm(r), batch.graded[k]
        out.append(GenerationResult(
            tokens=r.new, prompt_tokens=r.T, prefill_s=r.time_s["prefill"], decode_s=r.time_s["decode"],
            decode_steps=r.steps, evict_s=r.evict_s["prefill"] + r.evict_s["decode"],
            evict_prefill_s=r.evict_s["prefill"], evict_decode_s=r.evict_s["decode"], peak_kv_tokens=peaks[k],
            kv_bytes_peak=totals[k] * per_token, trace=r.traces,
            diagnostics=r.diag.summary() if r.diag is not None else None,
            layer_tokens=tokens_at[k * width:(k + 1) * width] if r.steps else None,
            answer_logprob=float(torch.stack(graded).mean()) if graded else None, graded_s=batch.graded_s[k],
            batch_size=size, batch_kv_bytes_peak=together * per_token, lm_logprobs=lm[0], lm_correct=lm[1],
            trunk_tokens=r.trunk))
    return out


class _Together(Batch):
    """The decoding of several batches (caches) as one: each step one model forward of all their rows (`Caches`), each
    cache attending over and evicting its own rows by its own policy. Eager, unobserved runs only (`_joins`)."""

    def __init__(self, batches: list[Batch]) -> None:
        self.__dict__.update(batches[0].__dict__)  # the model, its device and clock; eager
        self.members = batches
        self.rows = [r for b in batches for r in b.rows]
        self.seen = [n for b in batches for n in b.seen]
        self.cache = Caches([b.cache for b in batches])  # type: ignore[assignment]
        self.diagnosed = [None] * len(self.rows)
        ends = [sum(self.cache.sizes[:i + 1]) for i in range(len(batches))]
        self.spans = list(zip([0, *ends], ends))  # each member's rows

    def _split(self, values: list[Any]) -> list[tuple[Batch, list[Any]]]:
        return [(b, values[i:j]) for b, (i, j) in zip(self.members, self.spans)]

    def counts(self, evicting: list[bool]) -> list[torch.Tensor | None]:  # type: ignore[override]
        for b, seen in self._split(self.seen):
            b.seen = seen
        return [b.counts(e) for b, e in self._split(evicting)]

    def _evict(self, counts: list[torch.Tensor | None], evicting: list[bool]) -> float:  # type: ignore[override]
        return sum(b._evict(n, e) for (b, e), n in zip(self._split(evicting), counts) if n is not None)


def _joins(batch: Batch) -> bool:
    """Whether a batch may decode together with others (`_Together`): eager, and no row observed per forward or step
    (trace, diagnostics, on_step: they read one cache)."""
    return not batch.compiled and not any(r.diag or r.obs.trace or r.obs.on_step for r in batch.rows)


# -- shared trunks: the prompt forwards a sample's runs have in common, done once -----------------------------------
@dataclass(eq=False)
class Trunk:
    """A cache's share of a trunk (`run_trunk`): its first `chunks` prompt forwards, to position `end` (`fed` in the
    last), as `SlotCache.adopt` takes them; the last position's logits (vocab,) float32; the rows' share of the time."""

    cache: SlotCache
    chunks: int
    end: int
    fed: int
    queries: torch.Tensor | None
    received: list[dict[int, torch.Tensor]]
    logits: torch.Tensor
    seconds: float


class _TrunkPolicy(Policy):
    """A trunk's: every layer a run may evict keeps its queries (and with `attention` its received attention)."""

    def __init__(self, budget: int, window: int, attention: bool) -> None:
        super().__init__(budget=budget)
        self.query_window, self.needs_attention = window, attention
        self.received: list[dict[int, torch.Tensor]] = []  # per forward: trunk row -> (1, h_kv, S)

    def on_attention(self, state: dict[str, Sequence[torch.Tensor]], row: int, received: torch.Tensor) -> None:
        self.received[-1][row] = received


def trunk_length(chunks: list[tuple[int, int, bool]], policy: Policy, layers: list[int]) -> int:
    """How many of a run's first prompt forwards a trunk can do: up to the first after which its eviction may drop a
    token (a head over its layer's budget; before, a head holds every position seen), that one included."""
    for i, (_, end, evicted) in enumerate(chunks):
        least = min((policy.layer_budget(layer, end) or end for layer in layers), default=end)
        if evicted and policy.evicts and end > least:
            return i + 1
    return len(chunks)


def run_trunk(model: Any, jobs: Sequence[Job], lengths: Sequence[int], runs: Sequence[int]) -> list[Trunk]:
    """Job i's `Trunk`: the first lengths[i] prompt forwards of `jobs` (one prompt and plan) done once, without
    eviction, for runs[i] runs (its cache's rows), each forward's time shared equally among the runs taking it."""
    job, n = jobs[0], max(lengths)
    chunks = plan(len(job.input_ids), job.settings, job.policy)
    end, widest = chunks[n - 1][1], max(e - s for s, e, _ in chunks)
    window = max(widest if j.policy.query_window < 0 else j.policy.query_window for j in jobs)  # as Batch sizes it
    policy = _TrunkPolicy(end, window, job.policy.needs_attention)
    policy.single_pass_prefill = job.policy.single_pass_prefill  # the same plan
    clock = job.observer.clock if job.observer is not None else time.perf_counter
    settings = GenerationSettings(block=job.settings.block, protocol=job.settings.protocol,
                                  scenario=job.settings.scenario, context_tokens=job.settings.context_tokens)
    batch = Batch(model, [Job(job.input_ids[:end], policy, settings, observer=Observer(clock=clock))])
    assert [c[:2] for c in batch.rows[0].chunks] == [c[:2] for c in chunks[:n]]  # its slots are sized by them
    if batch.cache.evicting is not None:
        batch.cache.evicting.probs = None  # the runs compute their window rows when they adopt the trunk
    out, spent = {}, []  # spent: each forward's time per run that takes it
    for i, (s, e, _) in enumerate(chunks[:n]):
        policy.received.append({})
        t0 = clock()
        logits = batch.step([(s, e)], [list(job.input_ids[s:e])], [False], "prefill")
        sync(batch.device)
        spent.append((clock() - t0) / sum(r for k, r in zip(lengths, runs) if k > i))
        if i + 1 in lengths:
            q = getattr(batch.cache.evicting, "queries", None)  # (L, 1, h_q, W + 1, d) or None
            q = q if q is None else q.clone()
            out[i + 1] = (batch.cache, i + 1, e, e - s, q, list(policy.received), logits[0].clone())
    return [Trunk(*out[k], seconds=sum(spent[:k]) * r) for k, r in zip(lengths, runs)]


def _trunks(model: Any, parts: list[list[Job]]) -> list[Trunk | None]:
    """Each part's (one cache's rows) trunk, or None: parts whose jobs have one prompt, plan and way of attending
    (`needs_attention`: explicitly) share one, up to the part's shortest `trunk_length`. Never shared: a policy with
    per-sample state its score reads (Random would have drawn at the skipped evictions), a job that observes every
    forward or eviction (trace, diagnostics, the LM score), compiled runs (more graph shapes)."""
    text = model.config.get_text_config(decoder=True)
    groups: dict[Any, list[tuple[int, int]]] = {}
    for p, part in enumerate(parts):
        keys, lengths = set(), []
        for job in part:
            s, policy = job.settings, job.policy
            if (policy.sample_state or s.diagnostics or s.score_from is not None or s.compile
                    or (job.observer is not None and job.observer.trace)):
                break
            policy.attach(text.num_hidden_layers, head_dim(text))
            chunks = plan(len(job.input_ids), s, policy)
            keys.add((tuple(job.input_ids), tuple(chunks), policy.needs_attention))
            lengths.append(trunk_length(chunks, policy, evicted_layers(text, policy)))
        if len(lengths) == len(part) and len(keys) == 1:  # every job may share, and all alike
            groups.setdefault(keys.pop(), []).append((p, min(lengths)))
    out: list[Trunk | None] = [None] * len(parts)
    for members in (m for m in groups.values() if len(m) > 1):
        ps, lengths = zip(*members)
        for p, trunk in zip(ps, run_trunk(model, [parts[p][0] for p in ps], lengths, [len(parts[p]) for p in ps])):
            out[p] = trunk
    return out


@torch.inference_mode()
def generate_batch(model: Any, jobs: Sequence[Job], batch: int | None = None,
                   together: bool = False) -> list[GenerationResult]:
    """`generate` for several runs at once: the jobs whose policies select alike (`slot_key`) go as the rows of one
    cache, at most `batch` rows at a time (None: all), each with its own prompt, budget and answer; the others alone.
    Caches of one prompt share a trunk (`_trunks`): the prompt forwards before the first eviction that may drop one
    of their rows' tokens, done once for all of them; each cache starts from there. With `together` the caches'
    decoding steps go as the rows of one model forward (`_Together`: a CPU's matrix products read the weights once for
    all of them), each cache attending over and evicting its own rows.
    Each result is the job's own `generate` result but for the timings (an equal share of each forward) and the
    batch's rounding: a forward multiplies K rows by the weights, which a CPU BLAS may round differently from one
    row, so a token can differ where two logits or two scores are within that rounding. Give each job its own policy
    instance."""
    groups: dict[Any, list[int]] = {}
    for j, job in enumerate(jobs):
        key = slot_key(job.policy)
        groups.setdefault(("alone", j) if key is None else (key, job.settings.compile), []).append(j)
    parts = [members[at:at + (batch or len(members))] for members in groups.values()
             for at in range(0, len(members), batch or len(members))]
    results: list[GenerationResult | None] = [None] * len(jobs)
    joined: list[tuple[list[int], Batch]] = []  # the parts decoding together
    for part, trunk in zip(parts, _trunks(model, [[jobs[j] for j in part] for part in parts])):
        batch = _prompt(model, [jobs[j] for j in part], trunk)
        if together and _joins(batch):
            joined.append((part, batch))
            continue
        _decode(batch, batch.logits)
        for j, res in zip(part, _results(batch, len(part), batch.cache.peak_batch)):
            results[j] = res
    if joined:  # (one batch alone decodes as itself)
        batches = [b for _, b in joined]
        _decode(_Together(batches) if len(batches) > 1 else batches[0], torch.cat([b.logits for b in batches]))
    # every cache is held while they decode: the most they held together is at most the sum of each one's most
    size, held = sum(len(p) for p, _ in joined), sum(b.cache.peak_batch for _, b in joined)
    for part, batch in joined:
        for j, res in zip(part, _results(batch, size, held)):
            results[j] = res
    return results  # type: ignore[return-value]


def generate(model: Any, policy: Policy, input_ids: Sequence[int], settings: GenerationSettings,
             forced: Sequence[int] | None = None, answer_ids: Sequence[int] | None = None,
             observer: Observer | None = None) -> GenerationResult:
    """Greedy generation through a policy-managed cache: the prompt, then decoding, then (with `answer_ids`) the
    graded branch.

    Greedy = what `model.generate(do_sample=False)` picks: the generation_config's processors apply
    (greedy_processors). `forced`: tokens fed instead of the argmax, at most `settings.max_new_tokens` of them (the
    fidelity task scores a policy along the full cache's answer). `answer_ids`: a gold continuation whose mean
    log-probability per token (the graded score) is measured by teacher forcing it after the prompt through a fork
    of the cache taken when the prompt is done, so it sees the same cache, protocol and evictions as the greedy
    decode, which it leaves untouched; the log-probabilities are the model's own (before the logits processors).
    """
    return generate_batch(model, [Job(input_ids, policy, settings, forced, answer_ids, observer)])[0]
