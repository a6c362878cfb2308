"""Needle in a Haystack (gkamradt/LLMTest_NeedleInAHaystack @ 7b90d28, docs/niah.md).

Context construction follows the official tester token for token, with the evaluated model's tokenizer:
1. haystack = the `.txt` files of `haystack_dir` concatenated in sorted order (full passes repeated until it has
   at least max(context_lengths) tokens), or the built-in filler when no directory is given;
2. trim to `context_length` tokens and decode;
3. re-encode; keep at most `context_length - buffer` tokens including the needle; insert the needle tokens at
   `int(n * depth / 100)`, moved back to just after the last token that *is* the "." token (depth 100 appends);
   decode.
Special tokens are never added while encoding the context, the needle or "." (the official code used
tiktoken-like encoders without BOS).

The official scorer is an LLM judge; kvbench scores by `substring` recall (primary) or `rouge1x10`
(kvbench.metrics.niah). Aggregate scores hold one entry per (length, depth) cell, `L{length}_D{depth}`, plus
`avg`; finalize draws the length x depth heatmap.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator, Sequence

from kvbench.tasks.base import Sample, Task, TaskEnv, TaskError
from kvbench.tasks.haystack import (chat_wrapper, encode_prompt, filler_text, haystack_label, prefix_token_count,
                                    read_haystack_dir)

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


def cell_key(length: int, depth: float) -> str:
    return f"L{int(length)}_D{depth:g}"


class NIAH(Task):
    name = "niah"
    average_key = "avg"

    def __init__(self, context_lengths: Sequence[int] = (1024, 2048, 4096),
                 depths: Sequence[float] = (0, 25, 50, 75, 100), needle: str = DEFAULT_NEEDLE,
                 question: str = DEFAULT_QUESTION, answer: str = DEFAULT_ANSWER, haystack_dir: str | None = None,
                 scorer: str = "substring", buffer: int = 200, prompt_template: str = DEFAULT_TEMPLATE,
                 answer_prefix: str = DEFAULT_ANSWER_PREFIX, max_new_tokens: int = 64, filler_seed: int = 0,
                 heatmap: bool = True) -> None:
        if scorer not in SCORERS:
            raise TaskError(f"unknown niah scorer '{scorer}'; choose one of: {', '.join(SCORERS)}")
        if not context_lengths or not depths:
            raise TaskError("niah: context_lengths and depths must be non-empty lists")
        bad = [d for d in depths if not 0 <= float(d) <= 100]
        if bad:
            raise TaskError(f"niah: depths are percentages in [0, 100]; got {bad}")
        if "{context}" not in prompt_template:
            raise TaskError("niah: prompt_template must contain {context} (and usually {question})")
        if scorer == "substring" and not answer.strip():
            raise TaskError("niah: scorer=substring needs a non-empty task.answer (the span to find)")
        self.context_lengths = [int(x) for x in context_lengths]
        self.depths = [float(d) for d in depths]
        self.needle, self.question, self.answer = needle, question, answer
        self.haystack_dir = haystack_dir or None
        self.scorer, self.buffer = scorer, int(buffer)
        self.prompt_template, self.answer_prefix = prompt_template, answer_prefix
        self.max_new_tokens, self.filler_seed, self.heatmap = int(max_new_tokens), int(filler_seed), heatmap

    # -- inputs ---------------------------------------------------------------------------------------------------
    def haystack_ids(self, tokenizer: Any, min_tokens: int) -> list[int]:
        """Haystack token ids (no special tokens), at least `min_tokens` long."""
        enc = lambda s: list(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
        if self.haystack_dir:
            base = read_haystack_dir(self.haystack_dir)
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

    def build_prompt(self, tokenizer: Any, context: str, chat: bool) -> tuple[str, int]:
        """(prompt text, index of the character just after the context)."""
        pre, post = chat_wrapper(tokenizer, chat)
        before, after = self.prompt_template.split("{context}", 1)
        head = pre + before.format(question=self.question)
        tail = after.format(question=self.question)
        if pre or post:
            text = head + context + tail + post + self.answer_prefix
        else:
            text = head + context + tail + ("\n\n" + self.answer_prefix if self.answer_prefix else "")
        return text, len(head) + len(context)

    def samples(self, env: TaskEnv) -> Iterator[Sample]:
        tok = env.tokenizer
        hay = self.haystack_ids(tok, max(self.context_lengths))
        chat = bool(env.chat_template) and bool(getattr(tok, "chat_template", None))
        answers = [self.answer] if self.scorer == "substring" else [self.needle.strip()]
        for length in self.context_lengths:
            for depth in self.depths:
                context = build_context(tok, hay, self.needle, length, depth, self.buffer)
                text, ctx_end = self.build_prompt(tok, context, chat)
                ids = encode_prompt(tok, text, chat)
                yield Sample(
                    id=cell_key(length, depth), input_ids=ids, answers=answers, max_new_tokens=self.max_new_tokens,
                    context_tokens=prefix_token_count(tok, text, chat, ctx_end, ids), prompt=text,
                    meta={"context_length": length, "depth": depth, "scorer": self.scorer,
                          "haystack": haystack_label(self.haystack_dir)})

    # -- scoring --------------------------------------------------------------------------------------------------
    def score(self, sample: Sample, prediction: str) -> float:
        from kvbench.metrics import get_metric

        if self.scorer == "substring":
            return 100.0 * get_metric("niah_substring")(prediction, sample.answers[0])
        # rouge1x10 is on the judge's 0-10 scale; x10 puts it on the 0-100 scale every task score uses.
        return 10.0 * get_metric("niah_rouge1x10")(prediction, self.needle)

    def _cells(self, records: list[dict[str, Any]]) -> dict[tuple[int, float], list[float]]:
        cells: dict[tuple[int, float], list[float]] = {}
        for r in records:
            meta = r.get("meta") or {}
            if "context_length" in meta and "depth" in meta:
                key = (int(meta["context_length"]), float(meta["depth"]))
            else:  # records without meta: the id is the cell key
                length, depth = str(r["id"]).split("_D")
                key = (int(length.lstrip("L")), float(depth))
            cells.setdefault(key, []).append(float(r["score"]))
        return cells

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, float]:
        cells = self._cells(records)
        out = {cell_key(L, d): round(sum(v) / len(v), 2) for (L, d), v in sorted(cells.items())}
        all_scores = [s for v in cells.values() for s in v]
        out["avg"] = round(sum(all_scores) / len(all_scores), 2) if all_scores else 0.0
        return out

    def finalize(self, run_dir: Path, records: list[dict[str, Any]], scores: dict[str, float],
                 label: str = "") -> dict[str, Any]:
        scale = "recall, 0/100" if self.scorer == "substring" else "ROUGE-1 F x 100, no stemmer"
        notes = [f"niah scorer: {self.scorer} ({scale})", f"niah haystack: {haystack_label(self.haystack_dir)}"]
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
