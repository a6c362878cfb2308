"""K runs through one static slot cache: the prompt in blocks, one step, the loop, for every row at once.

Each prompt round and each decoding step is one forward of fixed shapes over the K rows (kvbench/engine/slotcache.py),
then one eviction of every evicting layer of every row. A row whose forward is shorter is padded on the left with
tokens at position PAD (they see only padding, and their slots stay free); a row that is done decodes padding. With
`compiled` the forward runs as one `torch.compile(fullgraph=True)` graph per shape. The rows' policies must select
alike (`slot_key`: one class, one set of options; budgets may differ), as one call scores them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from kvbench.engine.generate import GenerationResult, GenerationSettings, Job, Observer, sync
from kvbench.engine.hf import greedy_processors
from kvbench.engine.slotcache import IMPL, PAD, SlotCache, evict, forward, install
from kvbench.options import PROTOCOLS
from kvbench.policies.base import Policy

_SCORE_ROWS = 512  # positions per float32 log_softmax of the LM score (a full cache scores the whole prompt at once)


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
    eviction leaves it `keep` tokens (the largest a head may keep)."""
    held = peak = 0
    for start, end, evicted in chunks:
        held += end - start
        peak = max(peak, held)
        if evicted:
            held = min(held, keep)
    for _ in range(new):
        held += 1
        peak = max(peak, held)
        if evicts_decoding:
            held = min(held, keep)
    return peak


def slot_key(policy: Policy) -> tuple[Any, ...] | None:
    """Rows whose policies have equal keys (not None) are scored by one call: one class, the same options but for
    the budget; None for a policy with per-sample state (Random's generator)."""
    if policy.sample_state:
        return None
    plain = (bool, int, float, str, tuple, frozenset, type(None))
    options = tuple(sorted((k, v) for k, v in vars(policy).items() if isinstance(v, plain) and k != "budget"))
    return type(policy), options


@dataclass
class _Row:
    """One job's state: its prompt, plan and answer so far, and what its result reports."""

    job: Job
    chunks: list[tuple[int, int, bool]]
    evicts_decoding: bool
    limit: int
    obs: Observer
    processors: Any
    seq: torch.Tensor  # (1, T + limit) the prompt and the answer so far, written in place
    new: list[int] = field(default_factory=list)
    steps: int = 0
    time_s: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    evict_s: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    traces: list[list[torch.Tensor | None]] = field(default_factory=list)
    lm: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (log p (n,), argmax hit (n,))
    layer_tokens: list[int] | None = None

    @property
    def T(self) -> int:
        return len(self.job.input_ids)


class Batch:
    """K jobs as the rows of one slot cache."""

    def __init__(self, model: Any, jobs: Sequence[Job], compiled: bool = False) -> None:
        if model.config._attn_implementation != IMPL:
            install(model)
        self.model, self.device = model, model.device
        self.policy = jobs[0].policy
        n = model.config.get_text_config(decoder=True).num_hidden_layers
        self.rows: list[_Row] = []
        keep = full = 1
        window = 0
        for job in jobs:
            s, T = job.settings, len(job.input_ids)
            job.policy.attach(n)
            chunks = plan(T, s, job.policy)
            evicts = PROTOCOLS[s.protocol][1] and chunks[-1][2]  # context_only's question froze the cache
            limit = s.max_new_tokens if job.forced is None else min(s.max_new_tokens, len(job.forced))
            new = max(limit, len(job.answer_ids or ()))
            budgets = [job.policy.layer_budget(i, T) for i in range(n)] if job.policy.evicts else []
            head = max([job.policy.head_capacity(b) for b in budgets if b is not None], default=T + new)
            keep, full = max(keep, capacity(chunks, head, new, evicts)), max(full, T + new)
            w = job.policy.query_window if job.policy.slot_window is None else job.policy.slot_window
            window = max(window, max(e - b for b, e, _ in chunks) if w < 0 else w)
            seq = torch.tensor([list(job.input_ids) + [0] * max(limit, 0)], device=self.device)  # (1, T + limit)
            processors = greedy_processors(model, seq[:, :T], sorted(set(s.stop_ids)), s.min_new_tokens,
                                           s.max_new_tokens)
            self.rows.append(_Row(job, chunks, evicts, limit, job.observer or Observer(), processors, seq))
        self.cache = SlotCache(model, self.policy, len(jobs), keep, full, window)
        self.seen = [0] * len(jobs)  # each row's tokens so far, on the host (its layers' budgets)
        self.clock = self.rows[0].obs.clock
        self.forward: Callable[..., torch.Tensor] = self._forward
        if compiled:
            self.forward = torch.compile(self._forward, fullgraph=True, dynamic=False)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, keep: int,
                 counts: torch.Tensor | None) -> torch.Tensor:
        """ids (K, t) at positions (K, t) -> logits (K, keep, vocab) of the last positions; then the eviction when
        `counts` (L, K, 1) is given: one graph with it when compiled."""
        logits = forward(self.model, self.cache, ids, positions, keep)
        self.cache.end()  # the peaks held: before the eviction
        if counts is not None:
            evict(self.cache, counts)
        return logits

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

    def step(self, chunks: list[tuple[int, int] | None], tokens: list[list[int]], evicting: list[bool],
             phase: str) -> torch.Tensor:
        """One forward of each row's tokens at positions chunks[k] = (start, end) (None: padding only), then the
        eviction of the rows in `evicting`; each row is charged an equal share of the time (and of the eviction's,
        measured apart unless compiled). Returns the last position's logits (K, vocab) float32."""
        t = max(len(ts) for ts in tokens)
        ids = torch.zeros(len(self.rows), t, dtype=torch.long)
        positions = torch.full((len(self.rows), t), PAD, dtype=torch.long)
        for k, (span, ts) in enumerate(zip(chunks, tokens)):
            if span is not None:
                ids[k, t - len(ts):] = torch.tensor(ts)
                positions[k, t - len(ts):] = torch.arange(span[0], span[1])
                self.seen[k] = span[1]
        ids, positions = ids.to(self.device), positions.to(self.device)
        for k, row in enumerate(self.rows):
            if row.obs.trace:
                row.traces.append([p[k:k + 1].clone() for p in self.cache.layer_positions()])
        keep = max([self._scored(k, span)[2] for k, span in enumerate(chunks)] + [1])
        t0 = self.clock()
        counts = self.counts(evicting)
        compiled = self.forward is not self._forward
        logits = self.forward(ids, positions, keep, counts if compiled else None)
        evict_s = 0.0
        sync(self.device)
        if counts is not None and not compiled:
            t1 = self.clock()
            evict(self.cache, counts)
            sync(self.device)
            evict_s = self.clock() - t1
        spent = self.clock() - t0
        for k, row in enumerate(self.rows):
            row.time_s[phase] += spent / len(self.rows)
            row.evict_s[phase] += evict_s / len(self.rows)
            lo, hi, _ = self._scored(k, chunks[k])
            if hi > lo:
                self._score(row, logits[k], keep - (chunks[k][1] - lo), lo, hi)
        return logits[:, -1].float()

    def _scored(self, k: int, span: tuple[int, int] | None) -> tuple[int, int, int]:
        """The prompt positions [lo, hi) of row k's forward over `span` whose next token the LM score takes, and
        how many of the forward's last rows that needs (0: none)."""
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
    returns the last round's logits (K, vocab), each row's from its own last forward."""
    rows = batch.rows
    last: list[torch.Tensor | None] = [None] * len(rows)
    for i in range(max(len(r.chunks) for r in rows)):
        spans = [r.chunks[i][:2] if i < len(r.chunks) else None for r in rows]
        tokens = [r.job.input_ids[s[0]:s[1]] if s is not None else [] for r, s in zip(rows, spans)]
        evicting = [i < len(r.chunks) and r.chunks[i][2] and r.job.policy.evicts for r in rows]
        logits = batch.step(spans, [list(t) for t in tokens], evicting, "prefill")
        for k, s in enumerate(spans):
            if s is not None:
                last[k] = logits[k]
    return torch.stack(last)  # type: ignore[arg-type]


def _decode(batch: Batch, logits: torch.Tensor, graded: bool = False) -> list[list[torch.Tensor]]:
    """Greedy decoding of every row from its prompt's last logits (K, vocab), up to its limit (teacher-forcing
    `forced`, or with `graded` the row's answer); a row that emits a stop token or reaches its limit decodes padding.
    Returns, with `graded`, each row's answer log-probabilities (the model's own, before the processors)."""
    rows = batch.rows
    logps: list[list[torch.Tensor]] = [[] for _ in rows]
    limits = [len(r.job.answer_ids or ()) if graded else r.limit for r in rows]
    active = [limits[k] > 0 for k in range(len(rows))]
    fed = [0] * len(rows)
    while any(active):
        t0 = batch.clock()
        for k, row in enumerate(rows):
            if active[k] and not graded:
                if row.obs.on_step is not None:
                    row.obs.on_step(batch.cache)
                if row.obs.on_logits is not None:
                    row.obs.on_logits(logits[k:k + 1])
        greedy = [k for k, r in enumerate(rows) if active[k] and not graded and r.job.forced is None]
        picked = {}
        if greedy:
            scores = torch.cat([rows[k].processors(rows[k].seq[:, :rows[k].T + len(rows[k].new)], logits[k:k + 1])
                                for k in greedy])
            picked = dict(zip(greedy, scores.argmax(dim=-1).tolist()))  # the step's one host read
        spans, tokens = [], []
        for k, row in enumerate(rows):
            if not active[k]:
                spans.append(None)
                tokens.append([])
                continue
            if graded:
                answer = list(row.job.answer_ids or ())
                logps[k].append(torch.log_softmax(logits[k], dim=-1)[answer[fed[k]]])
                tok = answer[fed[k]]
            elif row.job.forced is not None:
                tok = int(row.job.forced[len(row.new)])
            else:
                tok = picked[k]
                if tok in row.job.settings.stop_ids:
                    active[k] = False
                    spans.append(None)
                    tokens.append([])
                    continue
            fed[k] += 1
            if not graded:
                row.seq[0, row.T + len(row.new)] = tok
                row.new.append(tok)
            if fed[k] >= limits[k]:
                active[k] = False
                spans.append(None)
                tokens.append([])
                continue
            pos = row.T + fed[k] - 1
            spans.append((pos, pos + 1))
            tokens.append([tok])
        if not any(s is not None for s in spans):
            break
        spent = batch.clock() - t0  # the token picks
        for row in rows:
            row.time_s["decode"] += spent / len(rows)
        evicting = [s is not None and rows[k].evicts_decoding and rows[k].job.policy.evicts
                    for k, s in enumerate(spans)]
        logits = batch.step(spans, tokens, evicting, "decode")
        for k, s in enumerate(spans):
            if s is not None and not graded:
                rows[k].steps += 1
    return logps


@torch.inference_mode()
def generate_rows(model: Any, jobs: Sequence[Job], compiled: bool = False) -> list[GenerationResult]:
    """Every job as one row of one slot cache (their policies select alike: `slot_key`): the prompt, the graded
    branch of the jobs with an answer (teacher-forced through a fork taken after the prompt), greedy decoding."""
    batch = Batch(model, jobs, compiled)
    logits = _prefill(batch)
    batch.cache.decoding = True
    graded: list[list[torch.Tensor]] = [[] for _ in jobs]
    graded_s = [0.0] * len(jobs)
    if any(j.answer_ids for j in jobs):
        main = batch.cache
        batch.cache = main.fork()
        before = [r.time_s["decode"] for r in batch.rows]
        graded = _decode(batch, logits, graded=True)
        graded_s = [r.time_s["decode"] - b for r, b in zip(batch.rows, before)]
        for r, b in zip(batch.rows, before):
            r.time_s["decode"] = b
        batch.cache = main
        batch.seen = [r.T for r in batch.rows]
    after_prompt = torch.stack([h.amax(dim=-1) for h in batch.cache.held()], dim=1)  # (K, layers)
    _decode(batch, logits)
    # one host read: the peaks and each layer's tokens per head at the first decoding step (its token included)
    values = torch.cat([batch.cache.peak, batch.cache.peak_total, (after_prompt + 1).view(-1)]).tolist()
    K, per_token = len(jobs), batch.cache.bytes_per_head_token()
    peaks, totals, tokens_at = values[:K], values[K:2 * K], values[2 * K:]
    width = after_prompt.shape[1]
    out = []
    for k, r in enumerate(batch.rows):
        lm = _lm(r)
        peak, total = peaks[k], totals[k]
        out.append(GenerationResult(
            tokens=r.new, prompt_tokens=r.T, prefill_s=r.time_s["prefill"], decode_s=r.time_s["decode"],
            decode_steps=r.steps, evict_s=r.evict_s["prefill"] + r.evict_s["decode"], evict_prefill_s=r.evict_s["prefill"],
            evict_decode_s=r.evict_s["decode"], peak_kv_tokens=peak, kv_bytes_peak=total * per_token, trace=r.traces,
            layer_tokens=tokens_at[k * width:(k + 1) * width] if r.steps else None,
            answer_logprob=float(torch.stack(graded[k]).mean()) if graded[k] else None, graded_s=graded_s[k],
            batch_size=K, batch_kv_bytes_peak=sum(totals) * per_token, lm_logprobs=lm[0], lm_correct=lm[1]))
    return out


def _lm(row: _Row) -> tuple[list[float] | None, list[bool] | None]:
    """Row's LM score as host lists (None when it was not asked for)."""
    if row.job.settings.score_from is None:
        return None, None
    if not row.lm:
        return [], []
    logps = torch.cat([p for p, _ in row.lm])
    hits = torch.cat([h for _, h in row.lm])
    return logps.tolist(), hits.tolist()
