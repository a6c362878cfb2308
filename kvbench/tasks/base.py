"""The contract between tasks and the run loop (kvbench.run.loop).

A task turns its data into `Sample`s (token ids exactly as fed to the model), scores one prediction at a time,
and aggregates the per-sample records of `predictions.jsonl` into named 0-100 scores. It describes those scores as
plain data for metrics.json: `composition` (which samples make each score) and `layout` (the table's columns, the
heatmap cells, and the recipe the scores are aggregated with), so the report never needs the task. Tasks never
import the run loop, the cache or the policies; they refer to metrics by name.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator


class TaskError(ValueError):
    """Bad task input (missing file, missing field, ...). The CLI prints it as one line and exits non-zero."""


@dataclass
class Sample:
    id: str
    input_ids: list[int]  # the whole prompt, tokenized exactly as fed (special tokens included)
    answers: list[str]
    max_new_tokens: int
    # Leading tokens that form the context. Under scenario=context_only only these are under eviction and the
    # rest (question, answer prefix, chat suffix) is appended afterwards without eviction. None = all tokens.
    context_tokens: int | None = None
    # Token ids that end generation. None = the model's own EOS ids (generation_config); a list replaces them
    # (LongBench samsum: [eos, "\n"]).
    stop_token_ids: list[int] | None = None
    min_new_tokens: int = 0  # EOS/stop tokens are not allowed to end generation before this many tokens
    prompt: str | None = None  # the prompt text, written to predictions.jsonl when save_prompts=true
    meta: dict[str, Any] = field(default_factory=dict)  # task-specific, JSON-serialisable; copied to the record


@dataclass
class TaskEnv:
    """What a task may know about the evaluated model when it builds its inputs."""

    tokenizer: Any  # a transformers tokenizer
    model_name: str  # preset name, e.g. "llama3.2-3b"
    max_prompt_tokens: int  # the model preset's prompt budget (LongBench middle truncation etc.)
    chat_template: bool = True  # the preset's choice: wrap prompts in the tokenizer's chat template where tasks do
    seed: int = 42


class Task(ABC):
    """Base class: subclasses set `name` and implement `samples`, `score` and `aggregate`."""

    name: str = ""
    # Label-free tasks (fidelity) compare against the model's own full-cache output instead of `answers`.
    needs_reference: bool = False
    # The score name reported as `average` in metrics.json; None = the mean of all scores.
    average_key: str | None = None
    # The language-modelling score (docs/protocols.md): None = not measured (every task but lm); "after_eviction" =
    # the prompt's own tokens whose prediction is made after the first eviction (at N = budget, B = block); an int M =
    # the prompt's last M tokens. The run loop then records `lm` and `answer_logprob` from it, and `score_lm`.
    lm_tokens: int | str | None = None

    @abstractmethod
    def samples(self, env: TaskEnv) -> Iterator[Sample]:
        """Yield samples in a fixed, deterministic order (resume and sharding rely on it)."""

    @abstractmethod
    def score(self, sample: Sample, prediction: str) -> float:
        """Score one decoded prediction, 0-100 (higher is better)."""

    @abstractmethod
    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, float]:
        """Named scores (0-100, higher is better) from the records of predictions.jsonl.

        Each record holds `id`, `prediction`, `answers`, `score`, `prompt_tokens`, `new_tokens`, the timings
        and `meta` (the sample's meta). Records come in sample order.
        """

    def composition(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """How each score of `aggregate(records)` is built, for standard errors and paired tests in the report
        (which never rebuilds a Task): score name -> {"samples": [ids]} when the score is the plain mean of those
        records' `score`, or {"mean_of": [score names]} when it is the plain mean of other scores. Scores left out
        (none by default) are shown without an uncertainty."""
        return {}

    def recipe(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
        """How `aggregate(records)` computes each score from the records, as plain data
        (kvbench.metrics.aggregate: score name -> {"mean" | "max": field, "metric": name, "mean_of": [scores],
        "where", "round", ...}, in score order). A task that has one aggregates through it
        (`aggregate_scores(records, self.recipe(records))`), and kvbench-report recomputes a sharded run's scores
        from the merged records with the same recipe, read from metrics.json `layout`. None (the default): the task
        computes its scores in its own code, and a shard merge recomputes only the scores of the composition."""
        return None

    def layout(self, records: list[dict[str, Any]], scores: dict[str, float]) -> dict[str, Any]:
        """What kvbench-report needs to lay out and recompute this task's scores without building the task:
        metrics.json `layout`, plain JSON.

            columns: [{"score": name, "category": header, "sort": [..]}, ...] the score table's columns in order,
                     grouped under `category` (a category row appears when there are several); the optional "sort"
                     keys order the columns of several runs of the task (NIAH: [length, depth])
            summary: [score names] the summary table's columns (category means, per-length means, averages)
            cells:   {score: [context length, depth %]} the scores that are cells of a length x depth grid (heatmaps)
            average: the score metrics.json `average` is (None: the mean of all scores)
            recipe:  `recipe(records)`, or None

        Default: every score a column under the task's name, in score order; no summary, no cells."""
        return make_layout([column(k, self.name) for k in scores], average=self.average_key,
                           recipe=self.recipe(records))

    def graded_answer(self, sample: Sample) -> str | None:
        """The gold continuation whose log-probability the graded score measures (teacher-forced after the prompt):
        by default the first answer; None = no graded score for this sample."""
        return sample.answers[0] if sample.answers else None

    def score_reference(self, sample: Sample, ref_tokens: list[int], ref_logprobs: Any,
                        test_logprobs: Any) -> dict[str, Any]:
        """For `needs_reference` tasks: compare the policy's teacher-forced next-token log-probabilities
        (new, vocab) with the full cache's. Returns {"score": 0-100, ...extra record fields}."""
        raise NotImplementedError(f"task '{self.name}' does not compare against a reference")

    def score_lm(self, sample: Sample, lm: dict[str, Any]) -> float:
        """For tasks with `lm_tokens`: the record's 0-100 score from the sample's LM summary
        (kvbench.metrics.lm.lm_summary); by default next-token accuracy in %."""
        return float(lm["accuracy"]) if lm["accuracy"] is not None else 0.0

    def provenance(self) -> dict[str, Any]:
        """Where the data came from (source, revision, checksum, generator settings) for metrics.json."""
        return {}

    def finalize(self, run_dir: Path, records: list[dict[str, Any]], scores: dict[str, float],
                 label: str = "") -> dict[str, Any]:
        """Write task-specific extra outputs into run_dir (heatmaps, official-format files).

        Returns extra entries for metrics.json (e.g. {"notes": [...]}); default: nothing.
        """
        return {}


def column(score: str, category: str, sort: list[Any] | None = None) -> dict[str, Any]:
    """One column of a layout (Task.layout): a score, its category header, optionally its sort key."""
    return {"score": score, "category": category, **({"sort": list(sort)} if sort is not None else {})}


def make_layout(columns: list[dict[str, Any]], summary: list[str] | None = None,
                cells: dict[str, list[Any]] | None = None, average: str | None = None,
                recipe: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A Task.layout dict with every key present (plain JSON: lists, not tuples)."""
    return {"columns": columns, "summary": list(summary or []),
            "cells": {k: list(v) for k, v in (cells or {}).items()}, "average": average, "recipe": recipe}


def grid_layout(task: str, grid: list[tuple[int, float]], key: Any, average: str | None,
                recipe: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The layout of a length x depth grid task (NIAH, the probe): one column per cell named `key(length, depth)`,
    grouped by length, sorted by (length, depth), each a heatmap cell; `avg` in the summary."""
    return make_layout([column(key(L, d), f"{task} L{L}", [L, d]) for L, d in grid], summary=["avg"],
                       cells={key(L, d): [L, d] for L, d in grid}, average=average, recipe=recipe)


def group_ids(records: list[dict[str, Any]], key: Any) -> dict[str, dict[str, Any]]:
    """{name: {"samples": [ids]}} grouping records by `key(record)` (a score name, or None to leave it out), in
    record order: the `composition` entry of scores that are plain means over their samples."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        name = key(r)
        if name is not None:
            out.setdefault(name, {"samples": []})["samples"].append(r["id"])
    return out


def decode_text(data: bytes, where: str) -> str:
    """`data` as UTF-8 text. Anything else (a binary file, another encoding) is a TaskError naming `where`, the
    line and the first byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise TaskError(f"{where}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                        f"expected a UTF-8 text file") from None


def read_bytes(path: str | Path) -> bytes:
    """A file's bytes; a file that cannot be read (permissions, a directory) is a TaskError."""
    p = Path(path)
    try:
        return p.read_bytes()
    except OSError as e:
        raise TaskError(f"cannot read {p}: {e.strerror or type(e).__name__}") from None


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's contents; see decode_text for what is not."""
    return decode_text(read_bytes(path), str(Path(path)))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a jsonl file; a missing file or a bad line is a TaskError naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise TaskError(f"data file not found: {p}")
    return parse_jsonl(read_bytes(p), str(p))


def parse_jsonl(data: bytes, where: str) -> list[dict[str, Any]]:
    """JSON objects, one per non-blank line of `data`; a bad line is a TaskError naming `where` and the line."""
    rows = []
    # Split on "\n" only: str.splitlines would also cut at U+2028 & co., which JSON strings may hold raw.
    for i, line in enumerate(decode_text(data, where).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{where}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise TaskError(f"{where}:{i}: expected a JSON object")
        rows.append(row)
    return rows
