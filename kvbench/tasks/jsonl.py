"""Bring-your-own data: one JSON object per line.

Fields: `id`, `prompt` (fed verbatim: `tokenizer(prompt)` with the tokenizer's default special tokens; the chat
template only with `chat_template=true`, and then no special tokens are added because the template text already
holds the model's BOS) or `context` + `question` (concatenated as context + question; the
context part alone is under eviction with scenario=context_only), `answers` (list of strings), optional
`max_new_tokens`. Score: 100 if any answer occurs in the prediction (case-insensitive), else 0.
"""

from __future__ import annotations

from typing import Any, Iterator

from kvbench.metrics import get_metric
from kvbench.metrics.aggregate import aggregate_scores
from kvbench.tasks.base import Sample, Task, TaskEnv, TaskError, group_ids, read_jsonl
from kvbench.tasks.haystack import encode_prompt


class JsonlTask(Task):
    name = "jsonl"

    def __init__(self, path: str | None = None, max_new_tokens: int = 32, chat_template: bool = False,
                 limit: int | None = None) -> None:
        if not path:
            raise TaskError("task=jsonl needs task.path=FILE (one JSON object per line)")
        self.path, self.max_new_tokens, self.chat_template, self.limit = path, int(max_new_tokens), chat_template, limit
        self.rows = self._validate(read_jsonl(path))

    def _validate(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not rows:
            raise TaskError(f"{self.path}: no samples")
        seen = set()
        for i, row in enumerate(rows, 1):
            has_prompt = isinstance(row.get("prompt"), str)
            has_parts = isinstance(row.get("context"), str) and isinstance(row.get("question"), str)
            if not (has_prompt or has_parts):
                raise TaskError(f"{self.path}: line {i} needs a string 'prompt' (or 'context' and 'question')")
            answers = row.get("answers", [])
            if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
                raise TaskError(f"{self.path}: line {i}: 'answers' must be a list of strings")
            mnt = row.get("max_new_tokens", self.max_new_tokens)
            if not isinstance(mnt, int) or mnt < 1:
                raise TaskError(f"{self.path}: line {i}: 'max_new_tokens' must be a positive integer")
            rid = str(row.get("id", i - 1))
            if rid in seen:
                raise TaskError(f"{self.path}: line {i}: duplicate id '{rid}'")
            seen.add(rid)
        return rows[: self.limit] if self.limit else rows

    def _encode(self, env: TaskEnv, text: str) -> tuple[str, list[int]]:
        if self.chat_template:
            text = env.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                     add_generation_prompt=True)
        return text, encode_prompt(env.tokenizer, text, self.chat_template)

    def samples(self, env: TaskEnv) -> Iterator[Sample]:
        for i, row in enumerate(self.rows):
            context_tokens = None
            if isinstance(row.get("prompt"), str):
                prompt, ids = self._encode(env, row["prompt"])
            else:
                prompt, ids = self._encode(env, row["context"] + row["question"])
                # Tokens of the prompt text up to the end of the context (chat prefix included) are the context.
                ctx_end = prompt.index(row["context"]) + len(row["context"])
                ctx_ids = encode_prompt(env.tokenizer, prompt[:ctx_end], self.chat_template)
                context_tokens = min(len(ctx_ids), len(ids))
            yield Sample(id=str(row.get("id", i)), input_ids=ids, answers=list(row.get("answers", [])),
                         max_new_tokens=int(row.get("max_new_tokens", self.max_new_tokens)),
                         context_tokens=context_tokens, prompt=prompt)

    def score(self, sample: Sample, prediction: str) -> float:
        return get_metric("substring_any")(prediction, sample.answers)

    def composition(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return group_ids(records, lambda r: "jsonl")

    def recipe(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {"jsonl": {"mean": "score"}}  # the mean over every sample

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, float]:
        return aggregate_scores(records, self.recipe(records))
