"""Paper-shaped result tables from run directories (`kvbench-report DIR`), and the table `policy=compare` prints.

Every directory below DIR that holds a `metrics.json` is one run. Runs whose configurations differ only in
`shard` are merged into one entry: their predictions are put back in sample order (shard i holds samples
i, i+n, i+2n, ...) and the scores are recomputed by the task's own `aggregate`, the task being rebuilt from the
run's `config.yaml`; speed and memory are recomputed from the merged records by `runner.summarize`.

Tables (KeyDiff Table 1 and HashEvict Tables 1-2 shape):
- scores: one row per (model, policy, budget, block, protocol, any other setting that varies), grouped by model
  with the full-cache row first; block and protocol are always shown ("-" where they do not apply: the block
  under a prefill_once* protocol, both for the full cache), so two protocols never share a table unlabelled;
  one column per score, grouped by category (LongBench dataset categories, NIAH context lengths, else the
  task), then `Avg` (the mean of the row's task averages). Scores are printed as stored (0-100).
- summary scores: the tasks' own summary numbers (LongBench category means, RULER per-length means, ...).
- speed and memory: prefill/decode tokens/s, eviction time, peak KV tokens and bytes, compression ratio.
- provenance: code and library versions, models, task data sources and checksums, metric backends (notes).
Files: DIR/table.md, DIR/table.csv (scores), DIR/runs.csv (one line per entry: stats, provenance, run dirs),
and when there is something to draw, DIR/heatmap_<task>_<model>.png and DIR/score_vs_budget.png.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

# Settings that never change results; runs differing only in these (and in `shard`) are the same entry.
IGNORED_SETTINGS = ("shard", "progress", "overwrite", "device", "save_prompts")
IDENTITY = ("model", "policy", "budget")
ALWAYS_SHOWN = ("block", "protocol")  # settings shown as columns even when every row has the same value
CELL = re.compile(r"^L(\d+)_D(\d+(?:\.\d+)?)$")  # NIAH / probe cell scores
LONGBENCH_CATEGORIES = {"single_doc_qa": "Single Doc. QA", "multi_doc_qa": "Multi Doc. QA",
                        "summarization": "Summarization", "few_shot": "Few-shot Learning",
                        "synthetic": "Synthetic", "code": "Code"}
SPEED_HEAD = ["samples", "prefill tok/s", "decode tok/s", "evict s", "peak KV tok", "KV MiB", "compression"]


class ReportError(ValueError):
    """Nothing to report (no runs below the directory, ...)."""


class _NotApplicable:
    """A setting that does not apply to a policy (the budget of the full cache)."""

    def __repr__(self) -> str:
        return "-"


NA = _NotApplicable()


@dataclass
class Run:
    path: Path
    metrics: dict[str, Any]
    config: dict[str, Any]  # the run's resolved config.yaml ({} when absent)
    order: tuple[int, float]  # (Hydra job number, metrics.json mtime): the order the sweep ran them in


@dataclass
class Entry:
    """One (configuration, task) result; the shards of a sharded run merged."""

    model: str
    policy: str
    task: str
    budget: Any
    settings: dict[str, Any]  # flattened config (dotted keys), budget/block set to NA where they do not apply
    scores: dict[str, float]
    average: float | None
    stats: dict[str, Any]
    provenance: dict[str, Any]
    notes: list[str]
    paths: list[Path]
    order: tuple[int, float]
    label: str = ""  # "(1/2 shards)" for an incomplete merge


@dataclass
class Column:
    task: str
    score: str
    name: str  # the table header (task-prefixed when two tasks share a score name)
    category: str


@dataclass
class Row:
    key: tuple[Any, ...]
    model: str
    policy: str
    budget: Any
    settings: dict[str, Any]  # the varying settings shown as extra columns
    entries: dict[str, Entry] = field(default_factory=dict)  # task -> entry

    @property
    def label(self) -> str:
        return " ".join(e.label for e in self.entries.values() if e.label)

    @property
    def avg(self) -> float | None:
        vals = [e.average for e in self.entries.values() if _is_num(e.average)]
        return sum(vals) / len(vals) if vals else None


@dataclass
class Report:
    entries: list[Entry]
    rows: list[Row]
    columns: list[Column]  # detail score columns (the main table)
    summary_columns: list[Column]
    varying: list[str]  # setting keys shown as columns
    notes: list[str]


# ---------------------------------------------------------------------------------------------------------------
# Collecting runs


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _load_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _job_num(run_dir: Path) -> int:
    # Shard and compare sub-directories live below the Hydra job directory that holds .hydra/.
    for d in (run_dir, run_dir.parent):
        hydra = _load_yaml(d / ".hydra" / "hydra.yaml").get("hydra") or {}
        num = (hydra.get("job") or {}).get("num")
        if isinstance(num, int):
            return num
    return 0


def find_runs(root: Path) -> tuple[list[Run], list[str]]:
    """Every finished run below `root` (a directory with metrics.json), and notes on what was skipped."""
    runs, notes = [], []
    for mp in sorted(root.rglob("metrics.json")):
        try:
            metrics = json.loads(mp.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            notes.append(f"{_rel(mp.parent, root)}: unreadable metrics.json, skipped")
            continue
        runs.append(Run(mp.parent, metrics, _load_yaml(mp.parent / "config.yaml"),
                        (_job_num(mp.parent), mp.stat().st_mtime)))
    for pp in sorted(root.rglob("predictions.jsonl")):
        if not (pp.parent / "metrics.json").is_file():
            notes.append(f"{_rel(pp.parent, root)}: unfinished (no metrics.json), not in the tables")
    return runs, notes


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root)) or "."
    except ValueError:
        return str(path)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, dict)) else v
    return out


def _class_attr(spec: dict[str, Any] | None, attr: str, default: Any) -> Any:
    """A class attribute of a config's `_target_` without building the object (policy.evicts, ...)."""
    target = (spec or {}).get("_target_")
    if not isinstance(target, str):
        return default
    module, _, name = target.rpartition(".")
    try:
        return getattr(getattr(importlib.import_module(module), name), attr, default)
    except (ImportError, AttributeError):
        return default


def _settings(run: Run) -> dict[str, Any]:
    from kvbench.runner import resolve_protocol

    m = run.metrics
    cfg = run.config or {"budget": m.get("budget"), "block": m.get("block"), "protocol": m.get("protocol"),
                         "scenario": m.get("scenario")}
    flat = {k: v for k, v in _flatten(cfg).items() if k.split(".")[0] not in IGNORED_SETTINGS}
    try:  # runs from before the protocol setting were blockwise; a block the protocol ignores does not apply
        flat["protocol"], block = resolve_protocol(str(cfg.get("protocol") or "blockwise"), cfg.get("block"))
        flat["block"] = NA if block is None else block
    except ValueError:
        pass
    policy_cfg = cfg.get("policy") if isinstance(cfg.get("policy"), dict) else None
    evicts = _class_attr(policy_cfg, "evicts", m.get("policy") != "full")
    if not evicts:  # the full cache: budget and protocol do not apply, nor (single-pass prefill) the block
        flat["budget"] = flat["protocol"] = NA
        if _class_attr(policy_cfg, "single_pass_prefill", True):
            flat["block"] = NA
    return flat


def _merge_key(run: Run) -> str:
    s = _settings(run)
    return json.dumps([run.metrics.get("model"), run.metrics.get("policy"), run.metrics.get("task"),
                       sorted((k, repr(v)) for k, v in s.items())])


def _entry_from_run(run: Run, label: str = "") -> Entry:
    m = run.metrics
    s = _settings(run)
    return Entry(model=str(m.get("model")), policy=str(m.get("policy")), task=str(m.get("task")),
                 budget=s.get("budget", m.get("budget")), settings=s, scores=dict(m.get("scores") or {}),
                 average=m.get("average"), stats=dict(m.get("stats") or {}), provenance=dict(m.get("provenance") or {}),
                 notes=list(m.get("notes") or []), paths=[run.path], order=run.order, label=label)


def _shard_of(run: Run) -> tuple[int, int] | None:
    shard = run.metrics.get("shard")
    if shard is None:
        return None
    i, n = (int(x) for x in str(shard).split("/"))
    return i, n


def merge_shards(runs: Sequence[Run], root: Path, notes: list[str]) -> Entry:
    """One entry from runs that differ only in `shard` (an unsharded run among them wins)."""
    from kvbench.runner import read_records  # the resume reader, read-only here

    runs = sorted(runs, key=lambda r: r.order)
    whole = [r for r in runs if _shard_of(r) is None]
    if whole:
        for r in runs[1:] if whole[0] is runs[0] else [r for r in runs if r is not whole[0]]:
            notes.append(f"{_rel(r.path, root)}: same configuration as {_rel(whole[0].path, root)}, ignored")
        return _entry_from_run(whole[0])
    n = _shard_of(runs[0])[1]  # type: ignore[index]
    by_index: dict[int, Run] = {}
    for r in runs:
        i, count = _shard_of(r)  # type: ignore[misc]
        if count != n or i in by_index:
            notes.append(f"{_rel(r.path, root)}: shard {i}/{count} does not fit the {n}-way split "
                         f"of {_rel(runs[0].path, root)} (or repeats a shard), ignored")
            continue
        by_index[i] = r
    shards = [by_index[i] for i in sorted(by_index)]
    parts = [read_records(r.path / "predictions.jsonl", repair=False) for r in shards]
    complete = sorted(by_index) == list(range(n))
    total = sum(len(p) for p in parts)
    if complete and all(len(p) == len(range(i, total, n)) for i, p in enumerate(parts)):
        records = [parts[k % n][k // n] for k in range(total)]  # shard i holds samples i, i + n, ...
    else:
        records = [r for p in parts for r in p]
    entry = _entry_from_run(shards[0], label="" if complete else f"({len(shards)}/{n} shards)")
    entry.paths = [r.path for r in shards]
    entry.order = min(r.order for r in shards)
    entry.notes = sorted({n_ for r in shards for n_ in (r.metrics.get("notes") or [])})
    if not complete:
        notes.append(f"{entry.model} {entry.policy} {entry.task}: only shards {sorted(by_index)} of {n} finished; "
                     f"its row covers {total} samples")
    if len({(r.metrics.get("provenance") or {}).get("commit") for r in shards}) > 1:
        notes.append(f"{entry.model} {entry.policy} {entry.task}: shards come from different commits")
    cfg = shards[0].config
    try:
        from kvbench.app import build_task, task_average
        from kvbench.runner import summarize

        task = build_task(cfg["task"])
        entry.scores = task.aggregate(records)
        entry.average = task_average(task, entry.scores)
        budget = cfg.get("budget")
        entry.stats = summarize(records, budget, bool(_class_attr(cfg.get("policy"), "evicts", True)))
    except Exception as e:  # noqa: BLE001 - any failure: fall back to sample-weighted shard means, say so
        weights = [float((r.metrics.get("stats") or {}).get("samples") or 0) for r in shards]
        wsum = sum(weights) or 1.0
        names = {k for r in shards for k in (r.metrics.get("scores") or {})}
        entry.scores = {k: sum(w * r.metrics["scores"].get(k, 0.0) for w, r in zip(weights, shards)) / wsum
                        for k in names}
        avgs = [(w, r.metrics.get("average")) for w, r in zip(weights, shards) if _is_num(r.metrics.get("average"))]
        entry.average = sum(w * a for w, a in avgs) / (sum(w for w, _ in avgs) or 1.0) if avgs else None
        notes.append(f"{entry.model} {entry.policy} {entry.task}: shard scores are sample-weighted means, not "
                     f"recomputed ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})")
    return entry


def collect_entries(root: Path) -> tuple[list[Entry], list[str]]:
    runs, notes = find_runs(root)
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(_merge_key(r), []).append(r)
    entries = [merge_shards(g, root, notes) for g in groups.values()]
    return sorted(entries, key=lambda e: e.order), notes


# ---------------------------------------------------------------------------------------------------------------
# Table layout


def _longbench_spec() -> dict[str, dict[str, Any]]:
    try:
        from kvbench.tasks.longbench import load_spec

        return load_spec()
    except Exception:  # noqa: BLE001 - LongBench data missing: fall back to plain task columns
        return {}


def _is_summary(task: str, name: str) -> bool:
    if name.startswith(("cat:", "cat_zh:", "avg")) or re.fullmatch(r"L\d+", name):
        return True
    return False


def _layout(task: str, names: list[str]) -> list[tuple[str, str]]:
    """(score, category) pairs of a task's detail scores, in table order."""
    details = [n for n in names if not _is_summary(task, n)]
    if task in ("longbench", "longbench_e"):
        spec = _longbench_spec()
        order = list(spec)

        def ds(n: str) -> str:
            return n.split(":")[0]

        if spec and all(ds(n) in spec for n in details):
            details.sort(key=lambda n: (order.index(ds(n)), n))
            return [(n, LONGBENCH_CATEGORIES.get(spec[ds(n)].get("category"), spec[ds(n)].get("category", task)))
                    for n in details]
    if details and all(CELL.match(n) for n in details):
        details.sort(key=lambda n: tuple(float(x) for x in CELL.match(n).groups()))  # type: ignore[union-attr]
        return [(n, f"{task} L{CELL.match(n).group(1)}") for n in details]  # type: ignore[union-attr]
    return [(n, task) for n in details]


def _columns(entries: list[Entry]) -> tuple[list[Column], list[Column]]:
    tasks: list[str] = []
    names: dict[str, list[str]] = {}
    for e in entries:
        if e.task not in names:
            tasks.append(e.task)
            names[e.task] = []
        names[e.task] += [k for k in e.scores if k not in names[e.task]]
    count = Counter(n for t in tasks for n in names[t])
    multi = len(tasks) > 1

    def col(task: str, score: str, category: str) -> Column:
        return Column(task, score, f"{task}/{score}" if count[score] > 1 else score, category)

    detail = [col(t, s, c) for t in tasks for s, c in _layout(t, names[t])]
    summary = [col(t, s, t) for t in tasks for s in names[t] if _is_summary(t, s)]
    if not multi:  # one task: a summary equal in name to nothing else needs no prefix
        for c in detail + summary:
            c.name = c.score
    return detail, summary


def _varying(entries: list[Entry]) -> list[str]:
    """The extra columns: block and protocol always, then the setting keys (besides model, policy, budget) whose
    value differs between entries. Group options (policy.*, task.*, model.*) count only when they differ within
    one policy/task/model."""
    keys: list[str] = []
    for e in entries:
        keys += [k for k in e.settings if k not in keys]
    out = [k for k in ALWAYS_SHOWN if k in keys]
    for k in keys:
        if k in ALWAYS_SHOWN:
            continue
        top = k.split(".")[0]
        if top in ("budget", "model", "policy", "task") and "." not in k:
            continue
        if top in ("model", "policy", "task"):
            groups: dict[str, set[str]] = {}
            for e in entries:
                name = {"model": e.model, "policy": e.policy, "task": e.task}[top]
                groups.setdefault(name, set()).add(repr(e.settings.get(k, NA)))
            if any(len(v) > 1 for v in groups.values()):
                out.append(k)
        else:
            values = {repr(e.settings.get(k, NA)) for e in entries if e.settings.get(k, NA) is not NA}
            if len(values) > 1:
                out.append(k)
    return out


def build_report(entries: list[Entry], notes: list[str] | None = None) -> Report:
    notes = list(notes or [])
    varying = _varying(entries)
    rows: dict[tuple[Any, ...], Row] = {}
    for e in entries:
        shown = {k: e.settings.get(k, NA) for k in varying}
        key = (e.model, e.policy, repr(e.budget), tuple(repr(v) for v in shown.values()))
        row = rows.setdefault(key, Row(key, e.model, e.policy, e.budget, shown))
        if e.task in row.entries:
            notes.append(f"{e.model} {e.policy} budget {e.budget!r} {e.task}: a second run "
                         f"({', '.join(map(str, e.paths))}) ignored")
            continue
        row.entries[e.task] = e
    detail, summary = _columns(entries)
    model_order = list(dict.fromkeys(e.model for e in entries))
    policy_order = list(dict.fromkeys(e.policy for e in entries))

    def sort_key(r: Row) -> tuple[Any, ...]:
        budget = -1 if r.budget is NA or r.budget is None else r.budget
        return (model_order.index(r.model), r.budget is not NA, policy_order.index(r.policy), budget,
                min(e.order for e in r.entries.values()))

    ordered = sorted(rows.values(), key=sort_key)
    all_tasks = {c.task for c in detail + summary}
    for r in ordered:
        missing = sorted(all_tasks - set(r.entries))
        if missing and len(all_tasks) > 1:
            notes.append(f"{r.model} {r.policy} budget {r.budget!r}: no {', '.join(missing)} run; Avg covers "
                         f"{', '.join(r.entries)}")
    return Report(entries, ordered, detail, summary, varying, notes)


# ---------------------------------------------------------------------------------------------------------------
# Rendering


def _fmt(v: Any) -> str:
    if v is NA:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.2f}"
    return "" if v is None else str(v)


def _value(row: Row, c: Column) -> Any:
    e = row.entries.get(c.task)
    return None if e is None else e.scores.get(c.score)


def _speed(e: Entry) -> list[Any]:
    st = e.stats
    kv = st.get("kv_bytes_peak")
    return [st.get("samples"), st.get("prefill_tokens_per_s"), st.get("decode_tokens_per_s"), st.get("evict_s"),
            st.get("peak_kv_tokens"), kv / 2**20 if _is_num(kv) else None, st.get("compression_ratio")]


def _setting_name(k: str) -> str:
    return k.split(".", 1)[1] if k.startswith("policy.") else k


def _na(v: Any) -> Any:
    return NA if v is None else v


def _settings_text(settings: dict[str, Any]) -> str:
    """A row's shown settings in a few words for plot labels: "blockwise B=128", "prefill_once window=16"."""
    rest = dict(settings)
    protocol, block = rest.pop("protocol", NA), rest.pop("block", NA)
    words = [] if protocol is NA else [str(protocol)]
    words += [] if block is NA else [f"B={_fmt(block)}"]
    return " ".join(words + [f"{_setting_name(k)}={_fmt(v)}" for k, v in rest.items()])


def describe_run(model: str, policy: str, budget: Any, block: Any, protocol: Any, evicts: bool = True) -> str:
    """One line naming a run for its own plots: "smollm2-135m: snapkv N=256, blockwise B=128"."""
    if not evicts:
        return f"{model}: {policy}"
    return f"{model}: {policy} N={budget}, {_settings_text({'protocol': protocol, 'block': _na(block)})}"


def score_table(rep: Report, paper_style: bool = True) -> tuple[list[str], list[list[Any]]]:
    """Header and rows of the main table. paper_style: model and policy only on the first row of their group,
    and a category row under the header when the columns have more than one category."""
    head = [*IDENTITY, *(_setting_name(k) for k in rep.varying), *(c.name for c in rep.columns), "Avg"]
    body: list[list[Any]] = []
    cats = [c.category for c in rep.columns]
    if paper_style and len(set(cats)) > 1:
        lead = [""] * (len(IDENTITY) + len(rep.varying))
        body.append([*lead, *(f"*{c}*" if k == 0 or cats[k - 1] != c else "" for k, c in enumerate(cats)), ""])
    prev: tuple[str, str] | None = None
    for r in rep.rows:
        policy = f"{r.policy} {r.label}".strip()
        model = r.model
        if paper_style and prev is not None:
            model = "" if prev[0] == r.model else model
            policy = "" if prev == (r.model, r.policy) else policy
        prev = (r.model, r.policy)
        body.append([model, policy, r.budget, *r.settings.values(), *(_value(r, c) for c in rep.columns), r.avg])
    return head, body


def summary_table(rep: Report) -> tuple[list[str], list[list[Any]]]:
    head = [*IDENTITY, *(_setting_name(k) for k in rep.varying), *(c.name for c in rep.summary_columns)]
    return head, [[r.model, f"{r.policy} {r.label}".strip(), r.budget, *r.settings.values(),
                   *(_value(r, c) for c in rep.summary_columns)] for r in rep.rows]


def speed_table(rep: Report) -> tuple[list[str], list[list[Any]]]:
    multi = len({e.task for e in rep.entries}) > 1
    head = [*IDENTITY, *(_setting_name(k) for k in rep.varying), *(["task"] if multi else []), *SPEED_HEAD, "score"]
    body = []
    for r in rep.rows:
        for task, e in r.entries.items():
            body.append([r.model, f"{r.policy} {r.label}".strip(), r.budget, *r.settings.values(),
                         *([task] if multi else []), *_speed(e), e.average])
    return head, body


def _markdown(head: list[str], body: list[list[Any]]) -> str:
    from tabulate import tabulate

    return tabulate([[_fmt(v) for v in row] for row in body], headers=head, tablefmt="github",
                    disable_numparse=True)


def _provenance_lines(rep: Report) -> list[str]:
    code = Counter()
    libs = Counter()
    models: dict[str, set[str]] = {}
    tasks: dict[str, set[str]] = {}
    for e in rep.entries:
        p = e.provenance
        code[f"kvbench {p.get('kvbench')} @ {str(p.get('commit'))[:12]}"] += 1
        libs[f"transformers {p.get('transformers')}, torch {p.get('torch')}, python {p.get('python')}"] += 1
        models.setdefault(e.model, set()).add(f"{p.get('model_path')} (revision {p.get('model_revision')}, "
                                              f"{p.get('dtype')}, {p.get('device')})")
        tasks.setdefault(e.task, set()).add(json.dumps(p.get("task") or {}, sort_keys=True))
    lines = [f"- code: {k} ({v} runs)" for k, v in code.items()]
    if len(code) > 1:
        lines.append("- warning: the runs come from different kvbench versions/commits")
    lines += [f"- libraries: {k} ({v} runs)" for k, v in libs.items()]
    lines += [f"- model {m}: {v}" for m, vals in models.items() for v in sorted(vals)]
    lines += [f"- task {t}: {v}" for t, vals in tasks.items() for v in sorted(vals)]
    run_notes = sorted({n for e in rep.entries for n in e.notes})
    lines += [f"- {n}" for n in run_notes]
    return lines


def render_markdown(rep: Report, root: Path | None = None) -> str:
    parts = [f"# kvbench report{f': {root}' if root else ''}", "",
             "## Scores (0-100 as stored; Avg = mean of each row's task averages)", "",
             _markdown(*score_table(rep))]
    if rep.summary_columns:
        parts += ["", "## Summary scores", "", _markdown(*summary_table(rep))]
    parts += ["", "## Speed and memory", "", _markdown(*speed_table(rep)), "",
              "KV MiB: peak K+V bytes held, all layers; compression: mean of min(1, N / prompt length).", "",
              "## Provenance", "", *_provenance_lines(rep)]
    if rep.notes:
        parts += ["", "## Notes", "", *(f"- {n}" for n in rep.notes)]
    return "\n".join(parts) + "\n"


def write_csv(rep: Report, path: Path) -> None:
    head, body = score_table(rep, paper_style=False)
    extra = [c.name for c in rep.summary_columns]
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow([*head[:-1], *extra, "Avg"])
        for row, r in zip(body, rep.rows):
            w.writerow([_csv(v) for v in [*row[:-1], *(_value(r, c) for c in rep.summary_columns), row[-1]]])


def write_runs_csv(rep: Report, path: Path, root: Path) -> None:
    head = ["model", "policy", "budget", "task", *rep.varying, *SPEED_HEAD, "average", "kvbench", "commit",
            "transformers", "torch", "model_path", "model_revision", "dtype", "device", "task_provenance", "run_dirs"]
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(head)
        for r in rep.rows:
            for e in r.entries.values():
                p = e.provenance
                w.writerow([_csv(v) for v in [
                    e.model, e.policy, e.budget, e.task, *r.settings.values(), *_speed(e), e.average,
                    p.get("kvbench"), p.get("commit"), p.get("transformers"), p.get("torch"), p.get("model_path"),
                    p.get("model_revision"), p.get("dtype"), p.get("device"),
                    json.dumps(p.get("task") or {}, sort_keys=True), ";".join(_rel(x, root) for x in e.paths)]])


def _csv(v: Any) -> Any:
    if v is NA:
        return ""
    return "" if v is None else v


# ---------------------------------------------------------------------------------------------------------------
# Plots (matplotlib Figure + Agg canvas: no pyplot, no global backend change)


def _figure(width: float, height: float, layout: str | None = None) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout=layout)
    FigureCanvasAgg(fig)
    return fig


def plot_heatmaps(rep: Report, out_dir: Path) -> list[Path]:
    """Length x depth heatmaps of NIAH-like tasks side by side: one figure per (task, model), one panel per row."""
    written = []
    cell_tasks = list(dict.fromkeys(c.task for c in rep.columns if CELL.match(c.score)))
    for task in cell_tasks:
        for model in dict.fromkeys(r.model for r in rep.rows):
            rows = [r for r in rep.rows if r.model == model and task in r.entries]
            if not rows:
                continue
            cells = [{tuple(float(x) for x in CELL.match(k).groups()): v  # type: ignore[union-attr]
                      for k, v in r.entries[task].scores.items() if CELL.match(k) and _is_num(v)} for r in rows]
            lengths = sorted({k[0] for c in cells for k in c})
            depths = sorted({k[1] for c in cells for k in c})
            if not lengths:
                continue
            ncol = min(len(rows), 4)
            nrow = math.ceil(len(rows) / ncol)
            # constrained layout: two-line panel titles never run into the tick labels of the row above
            fig = _figure(1.2 + ncol * (1.1 + 0.5 * len(lengths)), 0.6 + nrow * (1.3 + 0.3 * len(depths)),
                          layout="constrained")
            axes = fig.subplots(nrow, ncol, squeeze=False)
            im = None
            for k, (r, c) in enumerate(zip(rows, cells)):
                ax = axes[k // ncol][k % ncol]
                grid = [[c.get((L, d), float("nan")) for L in lengths] for d in depths]  # (depths, lengths)
                im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
                ax.set_xticks(range(len(lengths)), [f"{L:g}" for L in lengths], fontsize=7)
                ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
                budget = "" if r.budget is NA else f" N={r.budget}"
                ax.set_title(f"{r.policy}{budget}\n{_settings_text(r.settings)}".strip(), fontsize=8)
                if k % ncol == 0:
                    ax.set_ylabel("depth (%)", fontsize=7)
                if k // ncol == nrow - 1:
                    ax.set_xlabel("context length", fontsize=7)
            for k in range(len(rows), nrow * ncol):
                axes[k // ncol][k % ncol].set_axis_off()
            if im is not None:
                fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
            fig.suptitle(f"{task}: {model}", fontsize=9)
            path = out_dir / f"heatmap_{_safe(task)}_{_safe(model)}.png"
            fig.savefig(path, dpi=110)
            written.append(path)
    return written


def plot_score_vs_budget(rep: Report, out_dir: Path) -> Path | None:
    """Avg against budget, one line per policy (and setting), one panel per model; full cache dashed."""
    models = list(dict.fromkeys(r.model for r in rep.rows))
    series: dict[str, dict[str, list[tuple[int, float]]]] = {m: {} for m in models}
    flat: dict[str, list[tuple[str, float]]] = {m: [] for m in models}
    for r in rep.rows:
        if not _is_num(r.avg):
            continue
        label = f"{r.policy} {_settings_text(r.settings)}".strip()
        if isinstance(r.budget, int) and not isinstance(r.budget, bool):
            series[r.model].setdefault(label, []).append((r.budget, r.avg))  # type: ignore[arg-type]
        else:
            flat[r.model].append((label, r.avg))  # type: ignore[arg-type]
    if not any(len(pts) > 1 for s in series.values() for pts in s.values()):
        return None
    fig = _figure(4.2 * len(models), 3.4)
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, m in zip(axes, models):
        for label, pts in series[m].items():
            pts.sort()
            ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", label=label)
        for label, v in flat[m]:
            ax.axhline(v, linestyle="--", color="black", linewidth=1, label=label)
        budgets = sorted({b for pts in series[m].values() for b, _ in pts})
        if budgets:
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget N (tokens)")
        ax.set_ylabel("Avg")
        tasks = dict.fromkeys(t for r in rep.rows if r.model == m for t in r.entries)
        ax.set_title(f"{m}: Avg of {', '.join(tasks)}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "score_vs_budget.png"
    fig.savefig(path, dpi=110)
    return path


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s)


# ---------------------------------------------------------------------------------------------------------------
# Entry points


def report(root: Path, plots: bool = True, quiet: bool = False) -> Report:
    """Collect every run below `root`, write table.md, table.csv, runs.csv (and plots) into `root`."""
    root = Path(root)
    if not root.is_dir():
        raise ReportError(f"not a directory: {root}")
    entries, notes = collect_entries(root)
    if not entries:
        raise ReportError(f"no finished runs (metrics.json) below {root}")
    rep = build_report(entries, notes)
    if plots:
        written = plot_heatmaps(rep, root)
        curve = plot_score_vs_budget(rep, root)
        written += [curve] if curve else []
        rep.notes += [f"plot: {p.name}" for p in written]
    text = render_markdown(rep, root)
    (root / "table.md").write_text(text, encoding="utf-8")
    write_csv(rep, root / "table.csv")
    write_runs_csv(rep, root / "runs.csv", root)
    if not quiet:
        print(text)
    return rep


def _entries_from_metrics(results: Iterable[dict[str, Any]]) -> list[Entry]:
    out = []
    for k, m in enumerate(results):
        run = Run(Path("."), m, {}, (0, float(k)))
        e = _entry_from_run(run)
        e.settings = {k: v for k, v in e.settings.items() if k in ("budget", *ALWAYS_SHOWN)}
        out.append(e)
    return out


def metrics_rows(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Scores and speed side by side, one row per metrics dict (the `policy=compare` table)."""
    rep = build_report(_entries_from_metrics(results))
    s_head, s_body = score_table(rep, paper_style=False)
    head = [*s_head, *SPEED_HEAD]
    body = [[_fmt(v) for v in [*row, *_speed(next(iter(r.entries.values())))]] for row, r in zip(s_body, rep.rows)]
    return head, body


def print_metrics_table(results: list[dict[str, Any]]) -> str:
    from tabulate import tabulate

    head, rows = metrics_rows(results)
    text = tabulate(rows, headers=head, tablefmt="github", disable_numparse=True)
    print(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvbench-report", description="Paper-shaped tables from kvbench runs: "
                                     "writes DIR/table.md, DIR/table.csv, DIR/runs.csv and plots.")
    parser.add_argument("dir", type=Path, help="a run, sweep or results directory (searched recursively)")
    parser.add_argument("--no-plots", action="store_true", help="skip the heatmap and score-vs-budget PNGs")
    parser.add_argument("-q", "--quiet", action="store_true", help="do not print the markdown")
    args = parser.parse_args(argv)
    try:
        report(args.dir, plots=not args.no_plots, quiet=args.quiet)
    except ReportError as e:
        print(f"kvbench-report: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
