"""The generation loop: block prefill -> evict -> greedy decode with eviction, through a policy-managed cache.

`generate` is the whole mechanism: the prompt goes through the model in blocks of B tokens; after each block
every layer's cache is pruned back to its budget by the policy; decoding feeds one token at a time (B = 1) and
evicts after every step. The protocol (PROTOCOLS) can instead feed the prompt in one forward and/or leave the
cache to grow while decoding. The loop never looks at a policy's class: it only reads its declared needs.
`generate_batch` runs several samples through the same steps together (each with its own cache and policy: the
model's projections see the batch, attention and eviction stay per sample); `generate` is its one-sample case.
`generate_shared` runs a sweep's configurations of one sample, sharing the prompt forwards that are bit-for-bit the
same between them (a trunk, until each run's first eviction), each result the one `generate` gives it alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from kvbench.engine import attention
from kvbench.engine.cache import BatchCache, EvictingCache, TrunkCache, batchable, settle_state
from kvbench.engine.diagnostics import Diagnostics
from kvbench.engine.hf import greedy_processors
from kvbench.engine.stack import SampleStacks, eviction_units, open_stacks
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
    measures taken at every eviction. `score_from`: the language-modelling score (None: not measured, and every
    forward keeps only its last position's logits as before): the log-probability of each prompt token t + 1 given
    what the cache holds when position t goes in, for every prompt position t >= score_from (GenerationResult
    lm_logprobs; the task decides where scoring starts, kvbench.run.loop.lm_score_start). `slot_reuse`: a decoding
    step's eviction of one token per head leaves a hole the next token is written into, instead of gathering the kept
    slots (kvbench/engine/slots.py): no O(N) copy per step, the same kept tokens, attention summed in another order;
    False keeps each head's slots in chronological order (a gather after every eviction). `evict_together`: in a
    batch (`generate_batch`), the decoding evictions of the samples whose policies select alike go in one call per
    run of layers (kvbench/engine/stack.py: `SampleStacks`), the same selections as each sample's own; False: each
    sample evicts on its own (what kvbench-bench compares it with, rows NAME+alone). `stack_prefill`: the prompt's
    evictions of a run of layers of one budget go in one call too (kvbench/engine/stack.py), the same selections as
    layer by layer; None: on for a CUDA device, off otherwise (`stacks_prefill`). On an H200 it cut the prompt's
    evictions 4.7-13.7x in every round (32-48 ms against 167-559 ms at 4k tokens, results/bench_gpu/
    prefill_pairs_h200.md), where each layer's eviction is a chain of small kernel launches; on the CPU it made
    SnapKV's prompt slower (the stack copies every layer per block; SnapKV's prompt evictions 2.96 s against 2.13 s,
    its prompt 1.07-1.22x as long in 3 paired rounds: results/bench_smollm2/engine_4k_prefill_stack). False by
    default here, so `kvbench-bench`'s NAME rows evict the prompt layer by layer on every device and its
    NAME+stackprefill rows stack; a run's `stack_prefill: auto` passes None.
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
    slot_reuse: bool = True
    evict_together: bool = True
    stack_prefill: bool | None = False


def stacks_prefill(setting: bool | None, device: torch.device) -> bool:
    """Whether the prompt's evictions stack (GenerationSettings.stack_prefill): the setting, or for None whether
    `device` is a GPU, the only kind where stacking measured faster."""
    return device.type == "cuda" if setting is None else setting


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
    # per layer, the tokens held per KV head at the first decoding step, its token included (None: no decoding step)
    layer_tokens: list[int] | None = None
    answer_logprob: float | None = None  # mean log-probability per token (nats) of `answer_ids`, when given
    graded_s: float = 0.0  # time of that teacher-forced branch (not in prefill_s nor decode_s)
    batch_size: int = 1  # the most samples one forward of this sample held (generate_batch)
    batch_kv_bytes_peak: int = 0  # max over those forwards of the K+V bytes of all the batch's caches together
    # The language-modelling score (settings.score_from): log p(token t + 1 | cache at t) in nats, float32
    # log_softmax, for t = score_from .. prompt_tokens - 2 in order, and whether the argmax was that token.
    lm_logprobs: list[float] | None = None
    lm_correct: list[bool] | None = None
    # generate_shared: the prompt forwards this run shared with other runs of the same prompt (a sweep's trunk)
    shared_with: int = 1  # the most runs one of its forwards served (1: none shared)
    shared_s: float = 0.0  # its equal share of those forwards' shared seconds (inside prefill_s)
    shared_forward_s: float = 0.0  # those forwards' shared seconds in full (what every member's share adds up to)


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
    prefill, decoding and eviction (kvbench-bench can pass time.process_time: CPU time); `on_step` is called with
    the run's cache before each step's token pick (kvbench-bench's lockstep runs HF's own decoding step there, with
    `clock` stopped).
    """

    on_logits: Callable[[torch.Tensor], None] | None = None
    on_step: Callable[[Any], None] | None = None
    trace: bool = False
    clock: Callable[[], float] = time.perf_counter


@dataclass(frozen=True)
class Job:
    """One sample of a `generate_batch` call: what `generate` takes for one prompt."""

    input_ids: Sequence[int]
    policy: Policy
    settings: GenerationSettings
    forced: Sequence[int] | None = None
    answer_ids: Sequence[int] | None = None
    observer: Observer | None = None


class _Run:
    """One sample's state while it goes through the model, alone or in a batch: its cache (with its own policy), its
    prompt and answer buffer, and what its result reports (time, eviction seconds, peak K+V bytes, trace)."""

    def __init__(self, ids: torch.Tensor, cache: EvictingCache, settings: GenerationSettings,
                 observer: Observer, diag: Diagnostics | None = None, forced: Sequence[int] | None = None,
                 processors: Any = None, evicts_decoding: bool = True) -> None:
        self.ids, self.cache, self.settings, self.obs, self.diag = ids, cache, settings, observer, diag
        self.forced, self.processors, self.evicts_decoding = forced, processors, evicts_decoding
        self.pos = 0  # tokens fed so far: the next one's position
        self.logits: torch.Tensor | None = None  # (1, vocab) float32: the latest next-token logits
        self.time_s = {"prefill": 0.0, "decode": 0.0}  # this sample's share of the batch's steps + its own evictions
        self.evict_s = {"prefill": 0.0, "decode": 0.0}
        self.peak_bytes = 0
        self.batch_peak_bytes = 0  # max over its forwards of the K+V bytes of every cache in the batch
        self.batch_size = 0  # the most samples one of its forwards held
        self.traces: list[list[torch.Tensor | None]] = []
        self.new: list[int] = []
        self.steps = 0  # one-token forwards while decoding
        # The LM score's per-block pieces, on the device until the one host read at the end (_lm_result)
        self.lm_logps: list[torch.Tensor] = []  # (n,) float32 each
        self.lm_hits: list[torch.Tensor] = []  # (n,) bool each
        self.shared_with = 1  # generate_shared: the most runs one of its forwards served
        self.shared_s = 0.0  # its share of the shared forwards' seconds
        self.shared_forward_s = 0.0  # those seconds in full


# Fewer rows than this go through the model alone: on this machine's CPU BLAS a product of 1-3 rows takes another kernel
# than one of 4 or more and rounds differently, while every count from 4 on gives each row the same bits (measured:
# rows of torch.nn.functional.linear at 1..512 rows vs 2048, SmolLM2's three shapes). So prompt blocks of >= 4 tokens
# batch without changing a bit of any sample's cache; a 1-3 token tail block would not, and goes alone.
_MIN_BATCH_ROWS = 4


def _forward(model: Any, runs: list[_Run], chunk: torch.Tensor) -> torch.Tensor:
    """chunk (k, t) token ids, row j for runs[j], through their caches -> next-token logits (k, vocab) float32."""
    _trace(runs)
    if len(runs) == 1:
        cache, extra = runs[0].cache, {}  # batch 1: exactly HF's own positions and mask
    else:
        cache = BatchCache([r.cache for r in runs])
        first = torch.tensor([r.pos for r in runs], device=chunk.device).unsqueeze(1)  # (k, 1)
        extra = {"position_ids": first + torch.arange(chunk.shape[1], device=chunk.device)}  # (k, t) each its own
    keep = max(_scored_rows(r, chunk.shape[1]) for r in runs)
    with attention.active(cache):
        # Only a forward that scores prompt tokens keeps more than the last position's logits (the lm_head over
        # the block's rows); every other forward is the one it always was.
        out = model(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=max(keep, 1), **extra)
    if keep:
        _score_rows(runs, chunk.shape[1], out.logits)
    _advance(runs, chunk.shape[1], batched=True)
    return out.logits[:, -1].float()


def _trace(runs: list[_Run]) -> None:
    """Before a forward: each tracing run's per-head token positions (Observer.trace)."""
    for r in runs:
        if r.obs.trace:
            r.traces.append(r.cache.head_positions())


def _advance(runs: list[_Run], t: int, batched: bool) -> None:
    """After a forward of t tokens: each run's position and peak K+V bytes. `batched`: the runs were one batch (its
    bytes are all their caches' together, its size their number); else each held its own K/V in a forward of one
    sample (a shared trunk: its solo numbers)."""
    held = []
    for r in runs:
        r.pos += t
        held.append(r.cache.kv_bytes())
        r.peak_bytes = max(r.peak_bytes, held[-1])
    for r, own in zip(runs, held):
        r.batch_peak_bytes = max(r.batch_peak_bytes, sum(held) if batched else own)
        r.batch_size = max(r.batch_size, len(runs) if batched else 1)


def _scored_span(r: _Run, t: int) -> tuple[int, int]:
    """The prompt positions [lo, hi) of r's next forward (t tokens from r.pos) whose next-token prediction the LM
    score takes: from settings.score_from on, up to the prompt's second-to-last token (the last one predicts a token
    the prompt does not hold); lo >= hi when none. Decoding steps (past the prompt) score nothing."""
    start = r.settings.score_from
    if start is None:
        return 0, 0
    return max(r.pos, start), min(r.pos + t, r.ids.shape[1] - 1)


def _scored_rows(r: _Run, t: int) -> int:
    """How many of the forward's last rows r's LM score needs (0: none)."""
    lo, hi = _scored_span(r, t)
    return r.pos + t - lo if hi > lo else 0


def _score_rows(runs: list[_Run], t: int, logits: torch.Tensor) -> None:
    """Each run's LM-score pieces from one forward's logits (k, keep, vocab), whose rows are the chunk's last keep
    positions: float32 log_softmax gathered at the next prompt token, and whether the argmax is that token. Kept on
    the device (read once at the end)."""
    keep = logits.shape[1]
    for j, r in enumerate(runs):
        lo, hi = _scored_span(r, t)
        if hi <= lo:
            continue
        first = r.pos + t - keep  # the position of row 0
        # In slices of _SCORE_ROWS positions: the full cache reads the whole prompt in one forward, and its float32
        # copies (n, vocab) would otherwise double the logits' memory at once (T = 4096, a 128k vocabulary: GBs).
        for a in range(lo, hi, _SCORE_ROWS):
            b = min(hi, a + _SCORE_ROWS)
            rows = logits[j, a - first:b - first].float()  # (n, vocab)
            target = r.ids[0, a + 1:b + 1]  # (n,) the tokens those positions predict
            r.lm_logps.append(torch.log_softmax(rows, dim=-1).gather(1, target[:, None])[:, 0])
            r.lm_hits.append(rows.argmax(dim=-1) == target)


_SCORE_ROWS = 512  # positions per float32 log_softmax of the LM score (_score_rows)


def _lm_result(r: _Run) -> tuple[list[float] | None, list[bool] | None]:
    """r's LM score as host lists, in one read (None when it was not asked for)."""
    if r.settings.score_from is None:
        return None, None
    if not r.lm_logps:
        return [], []
    logps = torch.cat(r.lm_logps)  # (n,)
    values = torch.cat([logps, torch.cat(r.lm_hits).to(logps.dtype)]).tolist()  # one host read
    n = logps.numel()
    return values[:n], [v > 0.5 for v in values[n:]]


def _evict(r: _Run, phase: str, device: torch.device) -> float:
    """Prune every layer of r's cache with its policy; returns the seconds it took (diagnostics included; evict_s
    excludes them). The device is idle when it is called (see _step)."""
    cache, diag = r.cache, r.diag
    t0 = r.obs.clock()
    spent = diag.elapsed if diag is not None else 0.0
    # diagnostics observe each layer's own selection; otherwise layers may be evicted stacked (engine/stack.py)
    for layer in cache.evicting_layers() if diag is not None else eviction_units(cache):
        settle_state(layer, cache.policy)  # the step's state left due (Policy.state_from_tokens), a stack's in one call
        cache.policy.evict(layer, diag.observe if diag is not None else None)
    if phase == "prefill":
        cache.settle()  # new head sizes of every layer in one host read; decoding reads them with its token
    sync(device)
    took = r.obs.clock() - t0
    r.evict_s[phase] += took - ((diag.elapsed - spent) if diag is not None else 0.0)
    return took


def _evicts(r: _Run, phase: str) -> bool:
    return (phase == "prefill" or r.evicts_decoding) and not r.cache.frozen and r.cache.policy.evicts


def _evicting(runs: list[_Run], phase: str, device: torch.device) -> list[bool]:
    """Which runs evict after the forward just done; when any does, waits for the device (the timers' edge: the
    forward's time ends here, each eviction's own begins)."""
    evicting = [_evicts(r, phase) for r in runs]
    if any(evicting):
        sync(device)
    return evicting


def _step(model: Any, runs: list[_Run], chunk: torch.Tensor, phase: str, since: float | None = None,
          together: dict[Any, SampleStacks] | None = None) -> None:
    """One forward of `runs` together, then each sample's own eviction (decoding: if its protocol evicts then).
    Each sample is charged its own eviction and an equal share of the rest of the step's time (from `since`, when
    the step's own host work began, else from the forward); sets each run's logits. `together` (decoding): the
    samples whose evictions go in one call (`_evict_together`). On a GPU the timers synchronise after the forward
    and after each eviction, and only when something evicts (a step that only appends waits for nothing but its
    token)."""
    device, clock = chunk.device, runs[0].obs.clock
    t0 = clock() if since is None else since
    logits = _forward(model, runs, chunk)
    evicting = _evicting(runs, phase, device)
    shared = clock() - t0
    done = set() if together is None else _evict_together([r for r, e in zip(runs, evicting) if e], together, device)
    for j, r in enumerate(runs):
        r.logits = logits[j:j + 1]
        if evicting[j] and id(r) not in done:
            r.time_s[phase] += _evict(r, phase, device)
        r.time_s[phase] += shared / len(runs)


def _together_key(r: _Run) -> Any:
    """Runs with the same key that is not None evict their decoding steps in one call: their policies select alike
    (`Policy.batch_key`), no diagnostics observe them layer by layer, and their settings let them."""
    if r.diag is not None or not r.settings.evict_together or not _evicts(r, "decode"):
        return None
    return r.cache.policy.batch_key()


def _groups(runs: list[_Run]) -> dict[Any, list[_Run]]:
    """The runs that evict together, by key: two or more each."""
    groups: dict[Any, list[_Run]] = {}
    for r in runs:
        key = _together_key(r)
        if key is not None:
            groups.setdefault(key, []).append(r)
    return {k: g for k, g in groups.items() if len(g) >= 2}


def _evict_together(runs: list[_Run], together: dict[Any, SampleStacks], device: torch.device) -> set[int]:
    """A decoding step's evictions of the runs whose policies select alike, each group in one call per run of layers
    (engine/stack.py: `SampleStacks`), its seconds shared equally among its runs; returns the ids of the runs evicted
    so. A group's stacks are kept for the next step (`together`, by key); a group gone lets its stacks go."""
    groups = _groups(runs)
    for key in [k for k in together if k not in groups]:
        del together[key]
    done: set[int] = set()
    for key, group in groups.items():
        t0 = group[0].obs.clock()
        units = together.setdefault(key, SampleStacks()).units([r.cache for r in group])
        if units is None:
            continue  # their layers run differently: each evicts on its own
        for policy, unit in units:
            settle_state(unit, policy)
            policy.evict(unit)
        sync(device)
        _charge(group, group[0].obs.clock() - t0)
        done |= {id(r) for r in group}
    return done


def _charge(runs: list[_Run], seconds: float) -> None:
    """Decoding eviction work done for `runs` together: each is charged an equal share, as eviction and as time."""
    for r in runs:
        r.evict_s["decode"] += seconds / len(runs)
        r.time_s["decode"] += seconds / len(runs)


def _chunks(r: _Run) -> list[tuple[int, int, bool]]:
    """The prompt's forwards in order: (start, end, evicted). Blocks of B tokens, or one forward; context_only: the
    question after `context_tokens` goes in unevicted."""
    s, T = r.settings, r.ids.shape[1]
    one_pass = PROTOCOLS[s.protocol][0] or s.block is None or r.cache.policy.single_pass_prefill
    if s.scenario == "context_only" and s.context_tokens is not None and 0 < s.context_tokens < T:
        segments = [(0, s.context_tokens, True), (s.context_tokens, T, False)]
    else:
        segments = [(0, T, True)]
    out: list[tuple[int, int, bool]] = []
    for start, end, evicted in segments:
        step = end - start if one_pass else s.block
        out += [(i, min(end, i + step), evicted) for i in range(start, end, step)]
    return out


def _prefill(model: Any, runs: list[_Run], first: int = 0) -> None:
    """Every prompt through its cache, evicting after each forward; leaves each run's last-position logits. Round i
    is every sample's i-th forward; the samples whose i-th forward has the same length go through the model
    together (blocks of B tokens, mostly), the others alone. `first`: the rounds before it are done already (a run
    leaving a generate_shared trunk)."""
    plans = [_chunks(r) for r in runs]
    for i in range(first, max(len(p) for p in plans)):
        groups: dict[Any, list[int]] = {}
        for j, plan in enumerate(plans):
            if i < len(plan):
                size = plan[i][1] - plan[i][0]
                groups.setdefault(size if size >= _MIN_BATCH_ROWS else ("alone", j), []).append(j)
        for members in groups.values():
            for j in members:
                runs[j].cache.frozen = not plans[j][i][2]  # stays as the last chunk left it (context_only decoding)
            chunk = torch.cat([runs[j].ids[:, plans[j][i][0]:plans[j][i][1]] for j in members])  # (k, t)
            _step(model, [runs[j] for j in members], chunk, "prefill")


def _decode(model: Any, runs: list[_Run], limits: list[int]) -> None:
    """Greedy decoding of every run together from its prompt's last logits, up to limits[j] new tokens; a sample
    leaves the batch when it emits a stop token or reaches its limit. `forced` tokens are fed instead of the argmax
    (teacher forcing; the stop tokens do not end it). One host sync per step: the batch's tokens, with the new head
    sizes of the layers whose previous eviction changed them (`_read`)."""
    T = [r.ids.shape[1] for r in runs]
    # Each sample's prompt and answer so far in one buffer written in place: the processors read a view of it and
    # each step's input is a one-token view, so a step does no O(T) host work (no list copied into a new tensor).
    seqs = [torch.cat([r.ids, r.ids.new_zeros((1, max(n, 0)))], dim=1) for r, n in zip(runs, limits)]  # (1, T + n)
    stops = [set(r.settings.stop_ids) for r in runs]
    active = [j for j in range(len(runs)) if limits[j] > 0]
    together: dict[Any, SampleStacks] = {}  # the stacks of the samples that evict together (_evict_together)
    _open_stacks([runs[j] for j in active], together)
    while active:
        t0 = runs[active[0]].obs.clock()
        picked = []
        for j in active:
            r = runs[j]
            if r.obs.on_step is not None:
                r.obs.on_step(r.cache)
            if r.obs.on_logits is not None:
                r.obs.on_logits(r.logits)
            # what generate(do_sample=False) does to the logits (min_new_tokens included)
            picked.append(r.processors(seqs[j][:, :T[j] + len(r.new)], r.logits) if r.processors else r.logits)
        greedy = any(runs[j].forced is None for j in active)
        best = (picked[0] if len(picked) == 1 else torch.cat(picked)).argmax(dim=-1) if greedy else None  # (k,)
        tokens, settled = _read(best, [runs[j] for j in active])
        t0 += settled  # the packing is the previous step's eviction, charged to it (see _read)
        going = []
        for k, j in enumerate(active):
            r = runs[j]
            tok = r.forced[len(r.new)] if r.forced is not None else tokens[k]
            if r.forced is None and tok in stops[j]:
                continue
            seqs[j][0, T[j] + len(r.new)] = tok
            r.new.append(tok)
            if len(r.new) < limits[j]:
                going.append(j)
        if not going:
            break
        chunk = torch.cat([seqs[j][:, T[j] + len(runs[j].new) - 1:T[j] + len(runs[j].new)] for j in going])  # (k, 1)
        _step(model, [runs[j] for j in going], chunk, "decode", since=t0, together=together)
        for j in going:
            runs[j].steps += 1
        active = going


def _open_stacks(runs: list[_Run], together: dict[Any, SampleStacks]) -> None:
    """Before the runs decode: the layers their decoding evictions will take as one stack, stacked with a spare slot
    (engine/stack.py), charged to their decoding eviction: the runs that evict together in stacks of every sample
    (`together`, the time shared equally), each other one in its own; not under diagnostics (they observe layer by
    layer) or when decoding does not evict."""
    groups = _groups(runs)
    grouped = {id(r) for g in groups.values() for r in g}
    for key, group in groups.items():
        t0 = group[0].obs.clock()
        together[key] = SampleStacks()
        together[key].open([r.cache for r in group])
        sync(group[0].ids.device)
        _charge(group, group[0].obs.clock() - t0)
    for r in runs:
        if id(r) in grouped or not _evicts(r, "decode") or r.diag is not None:
            continue
        t0 = r.obs.clock()
        open_stacks(r.cache)
        sync(r.ids.device)
        _charge([r], r.obs.clock() - t0)


def _read(tokens: torch.Tensor | None, runs: list[_Run]) -> tuple[list[int] | None, float]:
    """A decoding step's one host read: the greedy tokens (k,) and the new head sizes of every layer whose
    selection of the previous step waits for them (EvictingLayer.pack), in one `tolist`; then those layers are
    stored. Returns the tokens (None without `tokens`) and the seconds the storing took, which are added to each
    run's decode and eviction time."""
    pending = [(r, r.cache.pending_layers()) for r in runs]
    counts = [layer.padded.kept_counts() for _, layers in pending for layer in layers]  # (b*h_kv,) each
    if not counts:
        return (tokens.tolist() if tokens is not None else None), 0.0
    k = 0 if tokens is None else tokens.numel()
    values = torch.cat(([tokens] if tokens is not None else []) + counts).tolist()
    at, spent = k, 0.0
    for r, layers in pending:
        if not layers:
            continue
        t0 = r.obs.clock()
        n = sum(layer.valid.shape[0] * layer.valid.shape[1] for layer in layers)
        r.cache.settle(layers, values[at:at + n])
        at += n
        took = r.obs.clock() - t0
        r.evict_s["decode"] += took
        r.time_s["decode"] += took
        spent += took
    return (values[:k] if tokens is not None else None), spent


def _new_run(model: Any, job: Job) -> _Run:
    """A job's run state: its cache (with the job's own policy), diagnostics and logits processors."""
    ids = torch.tensor([list(job.input_ids)], device=model.device)  # (1, T)
    s = job.settings
    cache = EvictingCache(model.config, job.policy)
    cache.defer_packing()  # one host read per step for every layer's new head sizes (see _read)
    if s.slot_reuse:
        cache.reuse_decoding_slots()
    cache.stack_prefill = stacks_prefill(s.stack_prefill, ids.device)
    diag = Diagnostics(tuple(s.diagnostics)) if s.diagnostics else None
    if diag is not None and not cache.query_window:
        cache.query_window = diag.query_window
    processors = greedy_processors(model, ids, sorted(set(s.stop_ids)), s.min_new_tokens, s.max_new_tokens)
    return _Run(ids, cache, s, job.observer or Observer(), diag, job.forced, processors, PROTOCOLS[s.protocol][1])


@torch.inference_mode()
def generate_batch(model: Any, jobs: Sequence[Job]) -> list[GenerationResult]:
    """`generate` for several samples at once: they go through the model together, each with its own
    policy-managed cache (its own copy of its policy: give each job its own instance), and each result is what
    `generate` returns for that job alone: the same prompt blocks, evictions, positions and greedy steps. The
    caches' contents after the prompt are bit-identical to batch 1 (prompt blocks of >= 4 tokens, see
    _MIN_BATCH_ROWS); a decoding step multiplies k rows by the weights instead of 1, which this CPU's BLAS rounds
    differently from a single row (a different kernel), so a later token can differ where two logits or two eviction
    scores are within that rounding (kvbench-bench --batch counts such samples). Times are per sample: its own
    evictions plus an equal share of each batched step. Models with sliding-window layers run one job at a time."""
    if not jobs:
        return []
    runs = [_new_run(model, job) for job in jobs]
    if len(runs) > 1 and not batchable(runs[0].cache):
        return [generate_batch(model, [job])[0] for job in jobs]
    _prefill(model, runs)
    return _finish(model, runs, jobs)


def _finish(model: Any, runs: list[_Run], jobs: Sequence[Job]) -> list[GenerationResult]:
    """After the prompt: the graded branches, greedy decoding (the runs together), and the results."""
    for r in runs:
        r.cache.start_decoding()
    # the graded score's teacher-forced branch of each job with an answer: a fork after the prompt
    graded = [_graded_branch(r, job.answer_ids) if job.answer_ids else None for r, job in zip(runs, jobs)]
    branches = [g[0] for g in graded if g is not None]
    limits = [r.settings.max_new_tokens if r.forced is None else min(r.settings.max_new_tokens, len(r.forced))
              for r in runs]
    _decode(model, runs, limits)
    if branches:
        _decode(model, branches, [len(b.forced) for b in branches])
    for r in runs + branches:
        r.cache.settle()  # nothing is left pending by _decode (each step's selection is read with the next token)
    lm = [_lm_result(r) for r in runs]
    return [GenerationResult(tokens=r.new, prompt_tokens=r.ids.shape[1], prefill_s=r.time_s["prefill"],
                             decode_s=r.time_s["decode"], decode_steps=r.steps,
                             evict_s=r.evict_s["prefill"] + r.evict_s["decode"], evict_prefill_s=r.evict_s["prefill"],
                             evict_decode_s=r.evict_s["decode"], peak_kv_tokens=r.cache.peak_tokens(),
                             layer_tokens=r.cache.decode_tokens(),
                             kv_bytes_peak=r.peak_bytes, trace=r.traces,
                             diagnostics=r.diag.summary() if r.diag is not None else None,
                             answer_logprob=None if g is None else float(torch.stack(g[1]).mean()),
                             graded_s=0.0 if g is None else g[0].time_s["decode"],
                             batch_size=r.batch_size, batch_kv_bytes_peak=r.batch_peak_bytes,
                             lm_logprobs=m[0], lm_correct=m[1], shared_with=r.shared_with, shared_s=r.shared_s,
                             shared_forward_s=r.shared_forward_s)
            for r, g, m in zip(runs, graded, lm)]


def _graded_branch(r: _Run, answer_ids: Sequence[int]) -> tuple[_Run, list[torch.Tensor]]:
    """A run teacher-forcing `answer_ids` through a fork of r's cache taken now (after the prompt), and the list its
    observer fills with each answer token's log-probability (0-d tensors: one host sync at the end). The model's own
    log-probabilities (before the processors), as in a teacher-forced forward of prompt + answer."""
    answer = list(answer_ids)
    logps: list[torch.Tensor] = []
    hook = (lambda lg: logps.append(torch.log_softmax(lg[0], dim=-1)[answer[len(logps)]]))
    branch = _Run(r.ids, r.cache.fork(), r.settings, Observer(on_logits=hook, clock=r.obs.clock), forced=answer,
                  evicts_decoding=r.evicts_decoding)
    branch.logits, branch.pos = r.logits, r.pos
    return branch, logps


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
    return generate_batch(model, [Job(input_ids, policy, settings, forced, answer_ids, observer)])[0]


def _trunk_key(r: _Run, job: Job) -> tuple[Any, ...]:
    """Runs with equal keys can share their prompt forwards while none of them has evicted: the same prompt, the same
    plan of forwards (protocol, block or one pass, scenario and context: `_chunks`), the same logits kept (the LM
    score's rows: a product over more rows can round the last one differently), and the same attention path (a
    `needs_attention` policy computes attention explicitly on the layers it evicts, the others through the base
    implementation: the two round differently, so they never share an output)."""
    policy = r.cache.policy
    path = tuple(sorted(r.cache.evicted)) if policy is not None and policy.needs_attention else None
    return (tuple(int(t) for t in job.input_ids), tuple(_chunks(r)), r.settings.score_from, path)


def _diverged(r: _Run) -> bool:
    """Whether r's cache dropped anything: its K/V then differ from the trunk's and it goes on alone."""
    return any(layer.evicted_any() for layer in r.cache.evicting_layers())


def _trunk_step(model: Any, runs: list[_Run], chunk: torch.Tensor) -> None:
    """One prompt forward shared by `runs` (whose caches hold identical K/V): the model runs once, batch 1, exactly
    each run's solo forward; each run's hooks run on its own cache inside it (TrunkCache), then each run evicts with
    its own policy. Each run is charged its own hook seconds and eviction plus an equal share of the rest (the shared
    seconds, also recorded in shared_s / shared_forward_s). chunk (1, t); the first run's clock times the forward."""
    device, clock, k, t = chunk.device, runs[0].obs.clock, len(runs), chunk.shape[1]
    t0 = clock()
    _trace(runs)
    cache = TrunkCache([r.cache for r in runs], clock)
    keep = _scored_rows(runs[0], t)  # the same for every run (same prompt, position and score_from)
    with attention.active(cache):
        out = model(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=max(keep, 1))
    if keep:
        _score_rows(runs, t, out.logits.expand(k, -1, -1))  # (k, keep, vocab): the one row, read by each run
    logits = out.logits[:, -1].float()  # (1, vocab)
    _advance(runs, t, batched=False)  # each holds the trunk's tensors, by reference: its solo numbers
    evicting = _evicting(runs, "prefill", device)
    shared = max(clock() - t0 - sum(cache.hook_s), 0.0)
    for j, r in enumerate(runs):
        r.logits = logits
        if evicting[j]:
            r.time_s["prefill"] += _evict(r, "prefill", device)
        r.time_s["prefill"] += cache.hook_s[j] + shared / k
        r.shared_s += shared / k
        r.shared_forward_s += shared
        r.shared_with = max(r.shared_with, k)


@torch.inference_mode()
def generate_shared(model: Any, jobs: Sequence[Job], batch: int = 1) -> list[GenerationResult]:
    """`generate` for every job (several policies and budgets on one prompt: a sweep's runs of one sample), sharing
    the prompt forwards that are bit-for-bit the same between them; with batch=1 each result equals the job's
    `generate` result.

    Jobs of the same prompt, plan of forwards and attention path (`_trunk_key`) form a trunk: while none of its
    members has evicted, they hold identical K/V, so each prompt forward runs once for all of them (`_trunk_step`:
    every member's own hooks inside it, then every member's own eviction). The members whose eviction dropped
    anything leave the trunk together and run the rest of their prompt, their decoding and their graded branches to
    the end, before the trunk's next forward; the last prompt forward ends the trunk (prefill_once: the whole prompt
    once for all). A budget above the prompt never evicts and shares every prompt forward. `batch`: how many of the
    members leaving at one forward go through the model together, each with its own cache (generate_batch's
    batching: their prompt blocks stay bit-identical, their decoding steps multiply k rows instead of one and may
    round a near-tie the other way, as batch_size does); at most `batch` runs beyond the trunk hold their own K/V at
    once. Each job needs its own policy instance (a stochastic policy's generator included). Timing per run: its own
    hooks, evictions and decoding plus an equal share of each shared or batched forward (shared_s: the trunk's), on
    the first trunk member's clock. Models with sliding-window layers run every job alone."""
    runs: list[_Run | None] = [_new_run(model, job) for job in jobs]
    results: list[GenerationResult | None] = [None] * len(jobs)

    def finish(members: list[int], done: int) -> None:
        """Run `members` (at the same prompt forward `done`) to the end, `batch` at a time; release their caches."""
        for at in range(0, len(members), batch):
            part = members[at:at + batch]
            _prefill(model, [runs[j] for j in part], done)
            for j, res in zip(part, _finish(model, [runs[j] for j in part], [jobs[j] for j in part])):
                results[j], runs[j] = res, None  # its cache is released before the trunk goes on

    groups: dict[Any, list[int]] = {}
    for j, (r, job) in enumerate(zip(runs, jobs)):
        groups.setdefault(_trunk_key(r, job) if batchable(r.cache) else ("alone", j), []).append(j)
    for members in groups.values():
        plan = _chunks(runs[members[0]])
        trunk, done = list(members), 0  # done: the plan's forwards the trunk has taken
        while len(trunk) > 1 and done < len(plan):
            start, end, evicted = plan[done]
            for j in trunk:
                runs[j].cache.frozen = not evicted  # stays as the last chunk left it (context_only decoding)
            _trunk_step(model, [runs[j] for j in trunk], runs[trunk[0]].ids[:, start:end].clone())
            done += 1
            stay = [j for j in trunk if done < len(plan) and not _diverged(runs[j])]
            finish([j for j in trunk if j not in stay], done)
            trunk = stay
        finish(trunk, done)  # alone from the start, or the trunk's last member(s): the rest of the prompt
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def shared_bytes(model: Any, jobs: Sequence[Job], batch: int = 1) -> int:
    """An upper bound of what `generate_shared(model, jobs, batch)` holds at once beyond the model (jobs of one
    prompt): the trunk's K/V for the whole prompt and the new tokens, the `batch` largest caches of runs gone on
    alone (N + B + new tokens each, or the prompt's length when smaller), and every run's per-token state (its
    policy's `state_names`, float32, and the kept positions, int64) over the prompt. Per token and layer, K/V cost
    2 x h_kv x head_dim x the model's element size."""
    cfg = model.config.get_text_config(decoder=True)
    layers, h_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_token = layers * 2 * h_kv * head_dim * torch.finfo(model.dtype).bits // 8
    T = max(len(j.input_ids) for j in jobs)
    new = max(j.settings.max_new_tokens + len(j.answer_ids or ()) for j in jobs)
    alone = sorted((min(T, (j.policy.budget or T) + (j.settings.block or 0)) + new for j in jobs), reverse=True)
    state = sum((4 * len(j.policy.state_names) + 8) * T * layers * h_kv for j in jobs)
    return (T + new) * kv_token + sum(alone[:max(batch, 1)]) * kv_token + state
