"""LongBench v1 and LongBench-E (THUDM/LongBench @ 2e00731 `pred.py` + `eval.py`; docs/longbench.md).

Prompt path per record, as pred.py builds it:
1. `template.format(**record)` with the official template (kvbench/data/longbench.json);
2. middle truncation in tokens: if the prompt encodes (special tokens included) to more than `max_length` tokens,
   keep decode(first half) + decode(last half) with half = int(max_length / 2) and special tokens skipped;
3. the chat template (`apply_chat_template`, one user turn, generation prompt) unless the model preset disables
   it or the dataset is one pred.py leaves bare (trec, triviaqa, samsum, lsht, lcc, repobench-p);
4. encode again: a plain prompt with the tokenizer's default special tokens (its BOS, as pred.py adds), a
   chat-templated one without added special tokens, because the template text already holds the model's BOS
   (pred.py's re-encoding would give such a prompt a second BOS; the model was trained with one, and NIAH/RULER
   encode chat prompts the same way, `kvbench.tasks.haystack.encode_prompt`).
Generation: greedy, the dataset's max_new_tokens; samsum stops at EOS or "\\n" after at least one new token.

`context_tokens` (scenario context_only): the prompt text up to the end of the substituted `{context}` is the
context; everything after it (template text, `{input}`, answer prefix, chat suffix) is not. The tail after the
context is located in the final prompt text (it survives truncation whole unless the question alone is longer than
half the budget), and the count is the number of tokens that start before that point (fast tokenizers' offsets;
otherwise the length of the encoded prefix).

Scoring is eval.py's, through the metrics registry: `score` gives the per-sample value x100 (first-line rule
included) and `aggregate` recomputes each dataset's score from the records exactly as eval.py does.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from kvbench.metrics import get_metric
from kvbench.metrics.aggregate import aggregate_scores
from kvbench.tasks.base import (Sample, Task, TaskEnv, TaskError, column, group_ids, make_layout, parse_jsonl,
                                 read_bytes)
from kvbench.tasks.haystack import encode_prompt

HF_REPO_ID = "THUDM/LongBench"  # now zai-org/LongBench; the hub redirects
# HF `main` as of 2024-12-18. data.zip has been unchanged since the paper-release upload (HF commit 4a90f81,
# 2023-08-29); later commits touched only LongBench.py and README.md.
HF_REVISION = "5e628be450b7e67fb7ae6e201bd6d8f7056f7672"
FUZZ_BACKENDS = ("difflib", "levenshtein")
E_BUCKETS = ("0-4k", "4-8k", "8k+")  # eval.py's LongBench-E length buckets (length < 4000, < 8000, else)


def load_spec() -> dict[str, dict[str, Any]]:
    """Per-dataset definitions (template, max_new_tokens, metric, language, category, chat_template, longbench_e)."""
    text = resources.files("kvbench").joinpath("data/longbench.json").read_text(encoding="utf-8")
    return json.loads(text)["datasets"]


def truncate_middle(tokenizer: Any, prompt: str, max_length: int) -> tuple[str, int | None]:
    """pred.py's middle truncation: (prompt, None) when it fits, else (first half + last half, len(first half))."""
    ids = tokenizer(prompt, truncation=False).input_ids
    if len(ids) <= max_length:
        return prompt, None
    half = int(max_length / 2)
    first = tokenizer.decode(ids[:half], skip_special_tokens=True)
    return first + tokenizer.decode(ids[-half:], skip_special_tokens=True), len(first)


def context_end(prompt: str, final: str, tail: str, junction: int | None) -> int | None:
    """Character offset in `final` (the prompt after any chat template) where the context ends.

    Normally the text after the context (`tail`) is found at the end of `final`. When truncation cut into the
    tail itself (a question longer than half the budget), the context is taken to end at the truncation
    junction. None when neither can be located.
    """
    for t in (tail, tail.rstrip(), tail.strip()):  # templates that trim the message lose the outer space
        if t and (pos := final.rfind(t)) >= 0:
            return pos
    if junction is not None:
        lead = len(prompt) - len(prompt.lstrip())
        for p, shift in ((prompt, 0), (prompt.strip(), lead)):
            if p and (start := final.find(p)) >= 0:
                return start + max(junction - shift, 0)
    return None


def count_tokens_before(tokenizer: Any, text: str, char_pos: int, input_ids: Sequence[int],
                        add_special_tokens: bool = True) -> int:
    """Number of leading tokens of `input_ids` (= tokenizer(text, add_special_tokens=...).input_ids) that start
    before `char_pos`."""
    if getattr(tokenizer, "is_fast", False):
        offsets = tokenizer(text, truncation=False, add_special_tokens=add_special_tokens,
                            return_offsets_mapping=True)["offset_mapping"]
        n = 0
        for start, end in offsets:
            # Special tokens added by the tokenizer have (0, 0) and belong to the front.
            if start >= char_pos and not (start == end == 0):
                break
            n += 1
        return n
    prefix = tokenizer(text[:char_pos], truncation=False, add_special_tokens=add_special_tokens).input_ids
    return min(len(prefix), len(input_ids))


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def download_data_zip(repo_id: str = HF_REPO_ID, revision: str = HF_REVISION, cache_dir: str | None = None,
                      downloader: Callable[..., str] | None = None) -> Path:
    """data.zip from the HF hub at a pinned revision (the loading script is unusable with datasets >= 4)."""
    if downloader is None:
        from huggingface_hub import hf_hub_download as downloader
    try:
        return Path(downloader(repo_id=repo_id, filename="data.zip", repo_type="dataset", revision=revision,
                               cache_dir=cache_dir))
    except Exception as e:  # network, auth or missing revision: say what to do instead
        raise TaskError(f"longbench: could not download data.zip from {repo_id}@{revision} ({type(e).__name__}: "
                        f"{e}); offline, set task.data_dir=<dir with <dataset>.jsonl files> or "
                        f"task.data_zip=<path to data.zip>") from None


class LongBench(Task):
    """All 21 LongBench datasets (or `datasets=[...]`); scores per dataset plus labelled averages."""

    name = "longbench"
    e_variant = False  # LongBench-E: <name>_e files, scores per length bucket
    average_key = "avg_selected"  # plain mean over the datasets run (avg_en16 when all 16 English ones ran)

    def __init__(self, datasets: Sequence[str] | None = None, limit: int | None = None,
                 data_dir: str | None = None, data_zip: str | None = None, repo_id: str = HF_REPO_ID,
                 revision: str = HF_REVISION, cache_dir: str | None = None, max_length: int | None = None,
                 fuzz_backend: str = "difflib", write_official: bool = True,
                 downloader: Callable[..., str] | None = None) -> None:
        self.spec = load_spec()
        valid = [d for d, s in self.spec.items() if s["longbench_e"] or not self.e_variant]
        if datasets is None:
            self.datasets = valid
        else:
            if isinstance(datasets, str):
                datasets = [datasets]
            bad = [d for d in datasets if d not in valid]
            if bad:
                raise TaskError(f"{self.name}: unknown dataset(s) {', '.join(map(str, bad))}; "
                                f"choose from: {', '.join(valid)}")
            if len(set(datasets)) != len(datasets):
                raise TaskError(f"{self.name}: datasets listed twice in {list(datasets)}")
            self.datasets = list(datasets)
        if limit is not None and int(limit) < 1:
            raise TaskError(f"{self.name}: limit must be a positive number of samples per dataset, got {limit}")
        if fuzz_backend not in FUZZ_BACKENDS:
            raise TaskError(f"{self.name}: unknown fuzz_backend '{fuzz_backend}'; "
                            f"choose one of: {', '.join(FUZZ_BACKENDS)}")
        if data_dir is not None and data_zip is not None:
            raise TaskError(f"{self.name}: give data_dir or data_zip, not both")
        self.limit = None if limit is None else int(limit)
        self.data_dir, self.data_zip = data_dir, data_zip
        self.repo_id, self.revision, self.cache_dir = repo_id, revision, cache_dir
        self.max_length = max_length
        self.fuzz_backend = fuzz_backend
        self.write_official = write_official
        self.downloader = downloader
        self._data_provenance: dict[str, Any] = {}  # filled by load_rows: source and sha256 of what was read

    # -- data ----------------------------------------------------------------------------------------------------

    def file_name(self, dataset: str) -> str:
        return f"{dataset}_e.jsonl" if self.e_variant else f"{dataset}.jsonl"

    def load_rows(self) -> dict[str, list[dict[str, Any]]]:
        """Rows of every selected dataset, in file order (all of them; `limit` is applied by `samples`)."""
        files = {d: self.file_name(d) for d in self.datasets}
        blobs: dict[str, bytes] = {}
        if self.data_dir is not None:
            root = Path(self.data_dir).expanduser()
            if not root.is_dir():
                raise TaskError(f"{self.name}: data_dir not found or not a directory: {root}")
            # Both a flat directory and the unzipped layout (data/<file>) are accepted.
            paths = {d: next((p for p in (root / f, root / "data" / f) if p.is_file()), None)
                     for d, f in files.items()}
            missing = [files[d] for d, p in paths.items() if p is None]
            if missing:
                raise TaskError(f"{self.name}: data_dir {root} lacks {', '.join(missing)} "
                                f"(expected <data_dir>/<file> or <data_dir>/data/<file>)")
            blobs = {d: read_bytes(p) for d, p in paths.items()}
            where = {d: str(p) for d, p in paths.items()}
            source = f"dir:{root}"
        else:
            if self.data_zip is not None:
                zp = Path(self.data_zip).expanduser()
                if not zp.is_file():
                    raise TaskError(f"{self.name}: data_zip not found: {zp}")
                source = f"zip:{zp}"
            else:
                zp = download_data_zip(self.repo_id, self.revision, self.cache_dir, self.downloader)
                source = f"hf:{self.repo_id}@{self.revision}"
            zip_bytes = zp.read_bytes()
            self._data_provenance["data_zip_sha256"] = _sha256_bytes(zip_bytes)
            try:
                with zipfile.ZipFile(zp) as z:
                    names = set(z.namelist())
                    missing = [f"data/{f}" for f in files.values() if f"data/{f}" not in names]
                    if missing:
                        raise TaskError(f"{self.name}: {zp} lacks {', '.join(missing)}")
                    blobs = {d: z.read(f"data/{f}") for d, f in files.items()}
            except zipfile.BadZipFile:
                raise TaskError(f"{self.name}: not a zip file: {zp}") from None
            where = {d: f"{zp}:data/{f}" for d, f in files.items()}
        self._data_provenance["source"] = source
        self._data_provenance["files_sha256"] = {files[d]: _sha256_bytes(b) for d, b in blobs.items()}
        return {d: parse_jsonl(b, where[d]) for d, b in blobs.items()}

    # -- samples -------------------------------------------------------------------------------------------------

    def build_sample(self, env: TaskEnv, dataset: str, index: int, row: dict[str, Any]) -> Sample:
        tok = env.tokenizer
        spec = self.spec[dataset]
        for key in ("context", "input", "answers"):
            if key not in row:
                raise TaskError(f"{self.name}: {self.file_name(dataset)} record {index} has no '{key}' field")
        try:
            prompt = spec["template"].format(**row)
        except (KeyError, IndexError) as e:
            raise TaskError(f"{self.name}: {self.file_name(dataset)} record {index}: template field {e} "
                            f"missing") from None
        # The part of the prompt after the substituted context (template text, input, answer prefix).
        tail = spec["template"].split("{context}", 1)[1].format(**row)
        max_length = self.max_length if self.max_length is not None else env.max_prompt_tokens
        text, junction = truncate_middle(tok, prompt, max_length)
        prompt = text
        chat = bool(env.chat_template and spec["chat_template"])
        if chat:
            if not getattr(tok, "chat_template", None):
                raise TaskError(f"{self.name}: the model preset asks for a chat template but tokenizer "
                                f"'{env.model_name}' has none; set chat_template: false in the preset")
            prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        input_ids = encode_prompt(tok, prompt, chat)  # one BOS: the chat text holds it, a plain prompt gets it
        meta: dict[str, Any] = {"dataset": dataset, "_id": row.get("_id"), "all_classes": row.get("all_classes"),
                                "length": row.get("length"), "index": index, "truncated": junction is not None}
        pos = context_end(text, prompt, tail, junction)
        # None (whole prompt is context) only if the prompt text cannot be found in the chat-templated one.
        context_tokens = None if pos is None else count_tokens_before(tok, prompt, pos, input_ids,
                                                                      add_special_tokens=not chat)
        stop, min_new = None, 0
        if dataset == "samsum":
            # pred.py: eos_token_id=[eos, last id of "\n"], min_length=context_length+1.
            stop = [tok.eos_token_id, tok.encode("\n", add_special_tokens=False)[-1]]
            min_new = 1
        sid = f"{dataset}_e/{index}" if self.e_variant else f"{dataset}/{index}"
        return Sample(id=sid, input_ids=input_ids, answers=list(row["answers"]),
                      max_new_tokens=int(spec["max_new_tokens"]), context_tokens=context_tokens,
                      stop_token_ids=stop, min_new_tokens=min_new, prompt=prompt, meta=meta)

    def samples(self, env: TaskEnv) -> Iterator[Sample]:
        rows = self.load_rows()
        for dataset in self.datasets:
            data = rows[dataset] if self.limit is None else rows[dataset][: self.limit]
            for index, row in enumerate(data):
                yield self.build_sample(env, dataset, index, row)

    # -- scoring -------------------------------------------------------------------------------------------------

    def score(self, sample: Sample, prediction: str) -> float:
        m = sample.meta
        return 100 * get_metric("longbench_sample_score")(m["dataset"], prediction, sample.answers,
                                                            m.get("all_classes"), fuzz_backend=self.fuzz_backend)

    def _by_dataset(self, records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in records:
            ds = r.get("meta", {}).get("dataset")
            if ds not in self.spec:
                raise TaskError(f"{self.name}: record {r.get('id')} has no known meta.dataset ({ds!r})")
            groups.setdefault(ds, []).append(r)
        order = list(self.spec)
        return {d: groups[d] for d in sorted(groups, key=order.index)}

    def dataset_scores(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """eval.py's result.json content: {dataset: score} (LongBench) or {dataset: {bucket: score}} (-E)."""
        out: dict[str, Any] = {}
        scorer = get_metric("longbench_scorer_e" if self.e_variant else "longbench_scorer")
        for ds, recs in self._by_dataset(records).items():
            preds = [r["prediction"] for r in recs]
            answers = [r["answers"] for r in recs]
            all_classes = recs[-1]["meta"].get("all_classes")  # eval.py keeps the last row's value
            if self.e_variant:
                lengths = [r["meta"]["length"] for r in recs]
                out[ds] = scorer(ds, preds, answers, lengths, all_classes, fuzz_backend=self.fuzz_backend)
            else:
                out[ds] = scorer(ds, preds, answers, all_classes, fuzz_backend=self.fuzz_backend)
        return out

    def composition(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Dataset scores (LongBench-E: dataset x length bucket) are sample means; the category means, avg_en16 and
        avg_selected are means of dataset scores. The leaderboard averages (means of category means with the
        Chinese code special case) are left without an uncertainty."""
        from kvbench.metrics.longbench import EN16, EN_CATEGORIES, length_bucket

        if self.e_variant:
            return group_ids(records, lambda r: f"{r['meta']['dataset']}:{length_bucket(r['meta']['length'])}")
        out = group_ids(records, lambda r: r["meta"]["dataset"])
        for cat, members in EN_CATEGORIES.items():
            if all(d in out for d in members):
                out[f"cat:{cat}"] = {"mean_of": list(members)}
        if all(d in out for d in EN16):
            out["avg_en16"] = {"mean_of": list(EN16)}
        datasets = [k for k, v in out.items() if "samples" in v]
        if datasets:
            out["avg_selected"] = {"mean_of": datasets}
        return out

    def _datasets(self, records: list[dict[str, Any]]) -> list[str]:
        """The configured datasets (and any other the records hold) in the official order: the same in every shard
        of a run."""
        held = set(self._by_dataset(records))  # (raises on a record of no known dataset)
        return [d for d in self.spec if d in held or d in self.datasets]

    def recipe(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        # Dataset scores are eval.py's, from the predictions (metrics.longbench.records_score*): LongBench rounds
        # only the dataset mean. LongBench-E: each dataset's three buckets (NaN when empty, as eval.py), the bucket
        # averages over the datasets that have the bucket, avg the mean of the bucket averages.
        datasets = self._datasets(records)
        where = lambda d: {"meta.dataset": d}  # noqa: E731
        if not self.e_variant:
            per = {d: {"metric": "longbench_dataset", "kwargs": {"dataset": d, "fuzz_backend": self.fuzz_backend},
                       "where": where(d)} for d in datasets}
            from kvbench.metrics.longbench import summary_recipe

            return {**per, **summary_recipe(datasets)}
        out: dict[str, dict[str, Any]] = {
            f"{d}:{b}": {"metric": "longbench_dataset_e", "where": where(d),
                         "kwargs": {"dataset": d, "bucket": b, "fuzz_backend": self.fuzz_backend}}
            for d in datasets for b in E_BUCKETS}
        for b in E_BUCKETS:
            out[f"avg:{b}"] = {"mean_of": [f"{d}:{b}" for d in datasets], "skip_missing": True}
        out["avg"] = {"mean_of": [f"avg:{b}" for b in E_BUCKETS], "skip_missing": True}
        return out

    def layout(self, records: list[dict[str, Any]], scores: dict[str, float]) -> dict[str, Any]:
        from kvbench.metrics.longbench import CATEGORY_TITLES

        recipe = self.recipe(records)
        order = list(self.spec)
        columns = []
        for d in self._datasets(records):  # grouped under the dataset's category, in the official order
            category = CATEGORY_TITLES.get(self.spec[d]["category"], self.spec[d]["category"])
            names = [f"{d}:{b}" for b in E_BUCKETS] if self.e_variant else [d]
            columns += [column(n, category, [order.index(d), n]) for n in names]
        shown = {c["score"] for c in columns}
        return make_layout(columns, summary=[k for k in recipe if k not in shown], average=self.average_key,
                           recipe=recipe)

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, float]:
        return aggregate_scores(records, self.recipe(records))

    def provenance(self) -> dict[str, Any]:
        """Data source and checksums (filled while loading) and the code_sim backend used."""
        return {"fuzz_backend": self.fuzz_backend, "data": dict(self._data_provenance) or {
            "source": f"dir:{self.data_dir}" if self.data_dir else f"zip:{self.data_zip}" if self.data_zip
            else f"hf:{self.repo_id}@{self.revision}"}}

    def finalize(self, run_dir: Path, records: list[dict[str, Any]], scores: dict[str, float],
                 label: str = "") -> dict[str, Any]:
        extra: dict[str, Any] = self.provenance()
        if self.write_official and records:
            out_dir = Path(run_dir) / f"{self.name}_pred"
            out_dir.mkdir(parents=True, exist_ok=True)
            for ds, recs in self._by_dataset(records).items():
                with (out_dir / f"{ds}.jsonl").open("w", encoding="utf-8") as f:
                    for r in recs:
                        m = r["meta"]
                        json.dump({"pred": r["prediction"], "answers": r["answers"],
                                   "all_classes": m.get("all_classes"), "length": m.get("length")}, f,
                                  ensure_ascii=False)
                        f.write("\n")
            with (out_dir / "result.json").open("w", encoding="utf-8") as f:
                json.dump(self.dataset_scores(records), f, ensure_ascii=False, indent=4)
            extra["official_pred_dir"] = out_dir.name
        return {"longbench": extra}


class LongBenchE(LongBench):
    """LongBench-E: the 13 datasets with `<name>_e` files; scores per length bucket (0-4k, 4-8k, 8k+)."""

    name = "longbench_e"
    e_variant = True
    average_key = "avg"  # mean of the three length-bucket averages
