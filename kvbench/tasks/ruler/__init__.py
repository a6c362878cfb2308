"""x"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from kvbench.metrics.aggregate import aggregate_scores
from kvbench.tasks.base import Sample, Task, TaskEnv, TaskError, column, group_ids, make_layout
from kvbench.tasks.haystack import (HAYSTACKS, Haystack, chat_wrapper, encode_prompt, filler_text, load_haystack,
                                    prefix_token_count)
from kvbench.tasks.haystack import sentence_splitter as pick_splitter
from kvbench.tasks.ruler.constants import METRIC, RULER_COMMIT, TASKS, TEMPLATES
from kvbench.tasks.ruler.qa import gen_qa, load_json, read_hotpotqa, read_squad
from kvbench.tasks.ruler.synthetic import GenContext, Generated, gen_cwe, gen_fwe, gen_niah, gen_vt

log = logging.getLogger(__name__)


class Ruler(Task):
    name = "ruler"
    average_key = "avg"

    def __init__(self, tasks: Sequence[str] = tuple(TASKS), lengths: Sequence[int] = (4096,), num_samples: int = 25,
                 haystack: str = "essays", haystack_dir: str | None = None, squad_path: str | None = None, hotpot_path: str | None = None,
                 cwe_words_path: str | None = None, sentence_splitter: str = "auto", filler_seed: int = 0,
                 windows: str = "shared") -> None:
        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise TaskError(f"unknown RULER task(s) {unknown}; choose from: {', '.join(TASKS)}")
        if not tasks or not lengths:
            raise TaskError("ruler: tasks and lengths must be non-empty lists")
        if int(num_samples) < 1:
            raise TaskError(f"ruler: num_samples must be >= 1, got {num_samples}")
        self.tasks, self.lengths, self.num_samples = list(tasks), [int(x) for x in lengths], int(num_samples)
        if haystack not in HAYSTACKS:
            raise TaskError(f"unknown ruler haystack '{haystack}'; choose one of: {', '.join(HAYSTACKS)}")
        self.haystack, self.haystack_dir, self.filler_seed = haystack, haystack_dir or None, int(filler_seed)
        self._source: Haystack | None = None
        self.paths = {"squad": squad_path or None, "hotpotqa": hotpot_path or None}
        self.cwe_words_path = cwe_words_path or None
        self.splitter = sentence_splitter
        if sentence_splitter not in ("auto", "nltk", "regex"):
            raise TaskError(f"unknown sentence_splitter '{sentence_splitter}'; choose one of: auto, nltk, regex")
        self._essay: list[str] | None = None
        # shared: every sample's essay haystack is the essays' first words, as the official generator builds it;
        # per_sample: sample k's starts k haystack sizes further on (its own window; an opt-in, off the official
        # inputs), so that samples are independent draws of the haystack too
        if windows not in ("shared", "per_sample"):
            raise TaskError(f"ruler: unknown windows '{windows}'; choose one of: shared, per_sample")
        self.windows = windows

    # -- data sources ---------------------------------------------------------------------------------------------
    def skipped(self) -> dict[str, str]:
        """Tasks that cannot run with this configuration -> why (qa without its local data file)."""
        out = {}
        for t in self.tasks:
            kind, args = TASKS[t]
            if kind == "qa" and not self.paths[args["dataset"]]:
                key = "squad_path (SQuAD v2.0 dev-v2.0.json)" if args["dataset"] == "squad" else \
                    "hotpot_path (hotpot_dev_distractor_v1.json)"
                out[t] = f"skipped: set task.{key} to run it"
        return out

    def _essay_words(self, n: int, start: int = 0) -> list[str]:
        """n words of the essay haystack (`re.sub(r"\\s+", " ", text).split(" ")`) from word `start` on, repeated
        cyclically (start 0: its first n words, the official haystack)."""
        if self.haystack_dir or self.haystack == "essays":
            if self._essay is None:
                self._essay = re.sub(r"\s+", " ", self.source().text).split(" ")
            words = self._essay
            if start % len(words):
                words = words[start % len(words):] + words[:start % len(words)]
            return words[:n] if n <= len(words) else (words * -(-n // len(words)))[:n]
        # The built-in filler is an endless stream: take more of it instead of repeating.
        if self._essay is None or len(self._essay) < start + n:
            self._essay = re.sub(r"\s+", " ", filler_text(max(start + n, 2 * len(self._essay or [])),
                                                          seed=self.filler_seed)).split(" ")
        return self._essay[start:start + n]

    def source(self) -> Haystack:
        """The essay haystack's label and provenance (and text, for essays or a directory), read once."""
        if self._source is None:
            self._source = load_haystack(self.haystack, self.haystack_dir, 0, self.filler_seed)
        return self._source

    def _uses_essays(self) -> bool:
        return any(TASKS[t][1].get("type_haystack") == "essay" for t in self.tasks)

    def provenance(self) -> dict[str, Any]:
        if not self._uses_essays():
            return {}
        return {"haystack": self.source().provenance, **({"windows": self.windows} if self.windows != "shared" else {})}

    def _cwe_extra_words(self) -> list[str]:
        if not self.cwe_words_path:
            raise TaskError("ruler cwe: this length needs more distinct words than wonderwords has; set "
                            "task.cwe_words_path to RULER's english_words.json")
        data = load_json(self.cwe_words_path, "cwe_words_path")
        if not isinstance(data, dict):
            raise TaskError(f"cwe_words_path {self.cwe_words_path}: expected a JSON object of words")
        return list(data.values())

    def generate(self, task: str, length: int, env: TaskEnv) -> list[Generated]:
        """The samples of one (task, length), seeded afresh like one official generator run."""
        kind, args = TASKS[task]
        pre, post = chat_wrapper(env.tokenizer, env.chat_template)
        c = GenContext(env.tokenizer, int(length), env.seed, pre, post, random.Random(env.seed),
                 np.random.RandomState(env.seed))
        if kind == "niah":
            return gen_niah(c, args, self.num_samples, self._essay_words, pick_splitter(self.splitter)[1],
                            per_sample_windows=self.windows == "per_sample")
        if kind == "variable_tracking":
            return gen_vt(c, args, self.num_samples)
        if kind == "common_words_extraction":
            return gen_cwe(c, args, self.num_samples, self._cwe_extra_words)
        if kind == "freq_words_extraction":
            return gen_fwe(c, args, self.num_samples)
        qas, docs = (read_squad if args["dataset"] == "squad" else read_hotpotqa)(self.paths[args["dataset"]])
        return gen_qa(c, qas, docs, self.num_samples)

    def samples(self, env: TaskEnv) -> Iterator[Sample]:
        skipped = self.skipped()
        for t, why in skipped.items():
            log.warning("ruler %s %s", t, why)
        chat = bool(env.chat_template) and bool(getattr(env.tokenizer, "chat_template", None))
        for length in self.lengths:
            for task in self.tasks:
                if task in skipped:
                    continue
                kind = TASKS[task][0]
                key = TEMPLATES[kind]["answer_prefix"][:10]
                for i, g in enumerate(self.generate(task, length, env)):
                    ids = encode_prompt(env.tokenizer, g.text, chat)
                    ctx_end = g.text.rfind(g.context) + len(g.context)
                    cut = g.text.rfind(key)
                    yield Sample(
                        id=f"{task}_L{length}_{i}", input_ids=ids, answers=list(g.answers),
                        max_new_tokens=TEMPLATES[kind]["tokens_to_generate"],
                        context_tokens=prefix_token_count(env.tokenizer, g.text, chat, ctx_end, ids), prompt=g.text,
                        meta={"task": task, "length": length, "metric": METRIC[kind],
                              "answer_prefix": g.text[cut:] if cut >= 0 else "",
                              **({"window_start_word": g.window_start} if g.window_start is not None else {})})

    # -- scoring --------------------------------------------------------------------------------------------------
    def score(self, sample: Sample, prediction: str) -> float:
        from kvbench.metrics import get_metric

        return 100.0 * get_metric(sample.meta["metric"])(prediction, sample.answers)

    def _shape(self, records: list[dict[str, Any]]) -> tuple[list[str], list[int]]:
        """The tasks (configured order, then any other the records hold, sorted) and lengths (sorted) of the
        scores: the configuration's, so every shard of a run has the same recipe."""
        tasks = list(dict.fromkeys(self.tasks))
        tasks += sorted({r["meta"]["task"] for r in records} - set(tasks))
        lengths = sorted(set(self.lengths) | {int(r["meta"]["length"]) for r in records})
        return tasks, lengths

    def recipe(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        # A (task, length) cell is RULER's dataset score of its samples; each task score, per-length mean and avg
        # is a mean of the cells (or per-length means) there are, rounded to 2 decimals. With one length the task
        # score is its one cell; with several the cells are scores of their own (task_L<length>).
        tasks, lengths = self._shape(records)
        multi = len(lengths) > 1

        def cell(t: str, L: int) -> dict[str, Any]:
            return {"metric": "ruler_dataset", "where": {"meta.task": t, "meta.length": L}}

        def mean(parts: list[str], **extra: Any) -> dict[str, Any]:
            return {"mean_of": parts, "skip_missing": True, "round": 2, **extra}

        name = (lambda t, L: f"{t}_L{L}") if multi else (lambda t, L: t)
        out: dict[str, dict[str, Any]] = {}
        for t in tasks:
            out[t] = mean([name(t, L) for L in lengths]) if multi else {**cell(t, lengths[0]), "round": 2}
        for L in lengths:
            out[f"L{L}"] = mean([name(t, L) for t in tasks])
        if multi:
            out.update({name(t, L): cell(t, L) for t, L in sorted((t, L) for t in tasks for L in lengths)})
        out["avg"] = mean([f"L{L}" for L in lengths], default=0.0)
        return out

    def layout(self, records: list[dict[str, Any]], scores: dict[str, float]) -> dict[str, Any]:
        recipe = self.recipe(records)
        summary = [f"L{L}" for L in self._shape(records)[1]] + ["avg"]
        return make_layout([column(k, self.name) for k in recipe if k not in summary], summary=summary,
                           average=self.average_key, recipe=recipe)

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, float]:
        # The 0-1 fractions are recomputed from the text (metrics.ruler.records_score): RULER rounds only once, on
        # the dataset mean.
        return aggregate_scores(records, self.recipe(records))

    def composition(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        cell = lambda r: (r["meta"]["task"], int(r["meta"]["length"]))  # noqa: E731
        lengths = sorted({cell(r)[1] for r in records})
        tasks = list(dict.fromkeys(cell(r)[0] for r in records))
        tasks = [t for t in self.tasks if t in tasks] + sorted(set(tasks) - set(self.tasks))
        if len(lengths) == 1:  # the task score is its one cell
            out = group_ids(records, lambda r: r["meta"]["task"])
            per_length = {f"L{lengths[0]}": {"mean_of": [t for t in tasks if t in out]}}
        else:
            out = group_ids(records, lambda r: f"{r['meta']['task']}_L{r['meta']['length']}")
            per_length = {f"L{L}": {"mean_of": [f"{t}_L{L}" for t in tasks if f"{t}_L{L}" in out]} for L in lengths}
            out.update({t: {"mean_of": [f"{t}_L{L}" for L in lengths if f"{t}_L{L}" in out]} for t in tasks})
        out.update(per_length)
        if lengths:
            out["avg"] = {"mean_of": list(per_length)}
        return out

    def graded_answer(self, sample: Sample) -> str | None:
        # Every expected value, in order, as the answer prefix's continuation lists them.
        return ", ".join(sample.answers) if sample.answers else None

    def finalize(self, run_dir: Path, records: list[dict[str, Any]], scores: dict[str, float],
                 label: str = "") -> dict[str, Any]:
        notes = [f"ruler: generation rules of NVIDIA/RULER@{RULER_COMMIT[:7]} (docs/ruler.md); seed per (task, length)"]
        if self._uses_essays():
            notes.append(f"ruler essay haystack: {self.source().label}; sentence splitter: "
                         f"{pick_splitter(self.splitter)[0]}")
        for t, why in self.skipped().items():
            notes.append(f"ruler {t}: {why}; L* and avg exclude it")
        return {"notes": notes}
