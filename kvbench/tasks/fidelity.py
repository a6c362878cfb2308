"""Label-free fidelity: how far does eviction move a model from its own full-cache behaviour?

For each prompt the full cache's greedy continuation of `new_tokens` tokens is computed once; the policy under
test is then teacher-forced along that same continuation (block prefill + decode-time eviction), so one early
deviation does not compound. Per sample: top-1 agreement with the full-cache tokens (the score, 0-100), mean and
max KL(full || evicted) of the next-token distributions, and the free-running greedy match length.

Prompts: `path` (a jsonl file with a `prompt` field per line, like task=jsonl), or generated at each of
`lengths` tokens: `source=filler` (the built-in filler prose, `samples_per_length` different passages) or
`source=random` (uniform random token ids, seeded).
"""

from __future__ import annotations

import random
from typing import Any, Iterator, Sequence

from kvbench.metrics import get_metric
from kvbench.metrics.aggregate import aggregate_scores
from kvbench.tasks.base import Sample, Task, TaskEnv, TaskError, read_jsonl
from kvbench.tasks.haystack import filler_text

SOURCES = ("filler", "random")


class FidelityTask(Task):
    name = "fidelity"
    needs_reference = True
    average_key = "top1"

    def __init__(self, path: str | None = None, source: str = "filler", lengths: Sequence[int] = (2048,),
                 samples_per_length: int = 1, new_tokens: int = 32, seed: int = 0, limit: int | None = None) -> None:
        if source not in SOURCES:
            raise TaskError(f"unknown fidelity source '{source}'; choose one of: {', '.join(SOURCES)}")
        if not lengths or any(int(n) < 2 for n in lengths):
            raise TaskError(f"task.lengths must be a non-empty list of lengths >= 2, got {list(lengths)}")
        if new_tokens < 1 or samples_per_length < 1:
            raise TaskError("task.new_tokens and task.samples_per_length must be positive")
        self.path, self.source, self.lengths = path, source, [int(n) for n in lengths]
        self.samples_per_length, self.new_tokens, self.seed, self.limit = samples_per_length, new_tokens, seed, limit
        self.rows = read_jsonl(path) if path else None
        if self.rows is not None:
            for i, row in enumerate(self.rows, 1):
                if not isinstance(row.get("prompt"), str):
                    raise TaskError(f"{path}: line {i} needs a string 'prompt'")

    def samples(self, env: TaskEnv) -> Iterator[Sample]:
        out = self._from_file(env) if self.rows is not None else self._generated(env)
        yield from (out[: self.limit] if self.limit else out)

    def _from_file(self, env: TaskEnv) -> list[Sample]:
        return [Sample(id=str(row.get("id", i)), input_ids=env.tokenizer(row["prompt"]).input_ids, answers=[],
                       max_new_tokens=int(row.get("max_new_tokens", self.new_tokens)), prompt=row["prompt"],
                       meta={"length": None})
                for i, row in enumerate(self.rows)]

    def _generated(self, env: TaskEnv) -> list[Sample]:
        tok = env.tokenizer
        out = []
        for length in self.lengths:
            for k in range(self.samples_per_length):
                if self.source == "random":
                    rng = random.Random(self.seed * 7919 + length * 31 + k)
                    special = set(tok.all_special_ids)
                    pool = [i for i in range(len(tok)) if i not in special]
                    ids = [rng.choice(pool) for _ in range(length)]
                    if tok.bos_token_id is not None:
                        ids[0] = tok.bos_token_id
                else:
                    # Roughly 1.3 tokens per word; take a different passage per sample, cut to `length` tokens.
                    text = filler_text(length * (k + 2), seed=self.seed)
                    words = text.split(" ")
                    start = (len(words) // (self.samples_per_length + 1)) * k
                    ids = tok(" ".join(words[start:]), add_special_tokens=True).input_ids[:length]
                    if len(ids) < length:
                        raise TaskError(f"built-in filler too short for {length} tokens")
                prompt = tok.decode(ids)
                out.append(Sample(id=f"{self.source}-L{length}-{k}", input_ids=ids, answers=[],
                                  max_new_tokens=self.new_tokens, prompt=prompt, meta={"length": length}))
        return out

    def score(self, sample: Sample, prediction: str) -> float:
        raise TaskError("task=fidelity scores against the full-cache run, not against answers")

    def score_reference(self, sample: Sample, ref_tokens: list[int], ref_logprobs: Any,
                        test_logprobs: Any) -> dict[str, Any]:
        f = get_metric("fidelity")(ref_logprobs, test_logprobs)
        return {"score": f["top1"], "fidelity": f}

    def recipe(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        # Over every sample: the means of the per-sample measures, and the largest KL.
        return {"top1": {"mean": "fidelity.top1"}, "kl_mean": {"mean": "fidelity.kl_mean"},
                "kl_max": {"max": "fidelity.kl_max"}, "match_len": {"mean": "fidelity.match_len"}}

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, float]:
        return aggregate_scores(records, self.recipe(records))

    def provenance(self) -> dict[str, Any]:
        return {"source": self.path or self.source, "lengths": self.lengths, "new_tokens": self.new_tokens,
                "seed": self.seed}
