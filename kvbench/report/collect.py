"""Runs and entries: every directory below a root that holds a `metrics.json` is one run; runs whose configurations
differ only in `shard` are merged into one entry (predictions back in sample order, scores recomputed from the
merged records by the recipe of metrics.json `layout` through kvbench.metrics.aggregate, the function the run's
task aggregated with, so they equal the unsharded run's; speed and memory by `run.records.summarize`). No task is
ever built here. An entry carries its records, composition and layout, so every score has its n and standard error
(report.samples) and its place in the tables (report.layout).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kvbench.errors import error_line
from kvbench.metrics.aggregate import RecipeError, aggregate_scores, average_of
from kvbench.metrics.stats import MeanSE
from kvbench.options import LM_TOKENS_AFTER_EVICTION
from kvbench.report.layout import Layout, stored_layout
from kvbench.report.samples import Agreement, Composition, Records, cells, logprob_cell, merge_compositions
from kvbench.run.labels import NA
from kvbench.run.records import read_records, summarize

# Settings that never change results; runs differing only in these (and in `shard`) are the same entry.
# compile: the same forward and eviction as one graph or eager.
IGNORED_SETTINGS = ("shard", "progress", "overwrite", "device", "save_prompts", "compare", "compile")


IDENTITY = ("model", "policy", "budget")


class ReportError(ValueError):
    """Nothing to report (no runs below the directory, ...)."""


@dataclass
class Run:
    path: Path
    metrics: dict[str, Any]
    config: dict[str, Any]  # the run's resolved config.yaml ({} when absent)
    # (Hydra job number, path below the report's root): the sweep's order where Hydra recorded it, else the path's.
    # Nothing time-dependent, so a report of committed runs (which keep no .hydra/) is the same on every checkout.
    order: tuple[int, str]


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
    order: tuple[int, str]
    reference: bool  # the run a comparison is made against (metrics.json `reference`: the full cache)
    label: str = ""  # "(1/2 shards)" for an incomplete merge
    composition: Composition = field(default_factory=dict)  # metrics.json `composition`
    records: Records = field(default_factory=dict)  # sample id -> record of predictions.jsonl (all shards)
    cells: dict[str, MeanSE] = field(default_factory=dict)  # score -> mean, se, n (scores in the composition)
    logprob: MeanSE | None = None  # mean answer_logprob over the samples that have one
    vs_full: Agreement | None = None  # token agreement with the full cache's entry (set by tables.build_report)
    dlogprob: Any = None  # stats.PairedResult: answer_logprob of this entry - the full cache's (build_report)
    layout: Layout = field(default_factory=dict)  # metrics.json `layout` (report.layout.stored_layout)
    diagnostics: dict[str, Any] = field(default_factory=dict)  # metrics.json `diagnostics` (name -> mean, max, ...)

    @property
    def average_key(self) -> str | None:
        """The score `average` is, as the run's layout names it (None: the mean of all scores)."""
        return self.layout.get("average")


def is_num(v: Any) -> bool:
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


# What every run's metrics.json carries since kvbench writes it this way; a run without them was written by an
# older kvbench and is listed in the notes instead of read another way.
REQUIRED = ("applies", "reference", "composition", "layout", "scores", "stats")


def find_runs(root: Path) -> tuple[list[Run], list[str]]:
    """Every finished run below `root` (a directory with metrics.json), and notes on what was skipped."""
    runs, notes = [], []
    for mp in sorted(root.rglob("metrics.json")):
        where = rel_path(mp.parent, root)
        try:
            metrics = json.loads(mp.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            notes.append(f"{where}: unreadable metrics.json, skipped")
            continue
        missing = [k for k in REQUIRED if k not in metrics]
        if missing or stored_layout(metrics) is None:
            notes.append(f"{where}: written by an older kvbench (no {', '.join(missing) or 'valid layout'} in "
                         f"metrics.json), skipped; run it again with this kvbench")
            continue
        stopped = metrics.get("stopped")
        if isinstance(stopped, dict):  # closed over the samples it finished (kvbench-score --close-stopped)
            notes.append(f"{where}: stopped before its last sample; closed over the {stopped.get('samples')} it "
                         f"finished (provenance from {stopped.get('provenance_from')})")
        runs.append(Run(mp.parent, metrics, _load_yaml(mp.parent / "config.yaml"), (_job_num(mp.parent), where)))
    for pp in sorted(root.rglob("predictions.jsonl")):
        if not (pp.parent / "metrics.json").is_file():
            notes.append(f"{rel_path(pp.parent, root)}: unfinished (no metrics.json), not in the tables")
    return runs, notes


def rel_path(path: Path, root: Path) -> str:
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


def _settings(run: Run) -> dict[str, Any]:
    from kvbench.options import RUN_DEFAULTS, resolve_protocol, stored_config

    m = run.metrics
    if run.config:
        # A run setting added after the run was made is absent from its config.yaml: it ran as that setting's
        # default then, so it reads as that here too, and its shards merge with those of a later run that records
        # it; the retired engine settings it may record are left out (kvbench.options.stored_config)
        cfg = {**RUN_DEFAULTS, **stored_config(run.config)}
    else:
        cfg = {"budget": m.get("budget"), "block": m.get("block"), "protocol": m.get("protocol"),
               "scenario": m.get("scenario")}
    flat = {k: v for k, v in _flatten(cfg).items() if k.split(".")[0] not in IGNORED_SETTINGS}
    try:  # a block the protocol ignores does not apply
        flat["protocol"], block = resolve_protocol(str(cfg.get("protocol")), cfg.get("block"))
        flat["block"] = NA if block is None else block
    except ValueError:
        pass
    for k, used in m["applies"].items():
        if not used:
            flat[k] = NA
    return flat


def _merge_key(run: Run) -> str:
    s = _settings(run)
    return json.dumps([run.metrics.get("model"), run.metrics.get("policy"), run.metrics.get("task"),
                       sorted((k, repr(v)) for k, v in s.items())])


def _composition(metrics: dict[str, Any]) -> Composition:
    comp = metrics.get("composition")
    return {k: v for k, v in comp.items() if isinstance(v, dict)} if isinstance(comp, dict) else {}


def _read(path: Path) -> Records:
    return {str(r["id"]): r for r in read_records(path / "predictions.jsonl", repair=False)}


def with_samples(entry: Entry, composition: Composition, records: Records) -> Entry:
    """Attach the per-sample data: composition, records, each composed score's n and se, the graded score."""
    entry.composition, entry.records = composition, records
    entry.cells = cells(composition, records) if records else {}
    entry.logprob = logprob_cell(records)
    return entry


def entry_from_run(run: Run, label: str = "", read: bool = True) -> Entry:
    """One run as an entry; `read`: load its predictions.jsonl."""
    m = run.metrics
    s = _settings(run)
    e = Entry(model=str(m.get("model")), policy=str(m.get("policy")), task=str(m.get("task")),
              budget=s.get("budget", m.get("budget")), settings=s, scores=dict(m["scores"]),
              average=m.get("average"), stats=dict(m["stats"]), provenance=dict(m.get("provenance") or {}),
              notes=list(m.get("notes") or []), paths=[run.path], order=run.order, reference=bool(m["reference"]),
              label=label, diagnostics=dict(m.get("diagnostics") or {}))
    with_samples(e, _composition(m), _read(run.path) if read else {})
    e.layout = stored_layout(m)  # type: ignore[assignment]  (find_runs keeps only runs whose layout reads)
    return e


def pair_key(e: Entry) -> str:
    """Entries with equal keys ran the same model on the same samples (task and model settings identical: the
    same sample ids under another haystack or length are other samples), so their scores can be paired."""
    same = sorted((k, repr(v)) for k, v in e.settings.items() if k.split(".")[0] in ("task", "model"))
    if e.settings.get("task.lm_tokens") == LM_TOKENS_AFTER_EVICTION:
        # The LM score counts the tokens predicted after N's first eviction: another N or B scores other tokens
        same += [("budget", repr(e.settings.get("budget"))), ("block", repr(e.settings.get("block")))]
    return json.dumps([e.model, e.task, same])


def _shard_of(run: Run) -> tuple[int, int] | None:
    shard = run.metrics.get("shard")
    if shard is None:
        return None
    i, n = (int(x) for x in str(shard).split("/"))
    return i, n


def merge_shards(runs: Sequence[Run], root: Path, notes: list[str]) -> Entry:
    """One entry from runs that differ only in `shard` (an unsharded run among them wins)."""
    runs = sorted(runs, key=lambda r: r.order)
    whole = [r for r in runs if _shard_of(r) is None]
    if whole:
        for r in runs[1:] if whole[0] is runs[0] else [r for r in runs if r is not whole[0]]:
            notes.append(f"{rel_path(r.path, root)}: same configuration as {rel_path(whole[0].path, root)}, ignored")
        return entry_from_run(whole[0])
    n = _shard_of(runs[0])[1]  # type: ignore[index]
    by_index: dict[int, Run] = {}
    for r in runs:
        i, count = _shard_of(r)  # type: ignore[misc]
        if count != n or i in by_index:
            notes.append(f"{rel_path(r.path, root)}: shard {i}/{count} does not fit the {n}-way split "
                         f"of {rel_path(runs[0].path, root)} (or repeats a shard), ignored")
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
    entry = entry_from_run(shards[0], label="" if complete else f"({len(shards)}/{n} shards)", read=False)
    entry.paths = [r.path for r in shards]
    entry.order = min(r.order for r in shards)
    entry.notes = sorted({n_ for r in shards for n_ in (r.metrics.get("notes") or [])})
    what = f"{entry.model} {entry.policy} {entry.task}"
    if entry.diagnostics and len(shards) > 1:
        entry.diagnostics = {}
        notes.append(f"{what}: diagnostics are each shard's (its metrics.json), not merged in runs.csv")
    if not complete:
        notes.append(f"{what}: only shards {sorted(by_index)} of {n} finished; its row covers {total} samples")
    if len({(r.metrics.get("provenance") or {}).get("commit") for r in shards}) > 1:
        notes.append(f"{what}: shards come from different commits")
    comps = [_composition(r.metrics) for r in shards]
    composition, differ = merge_compositions(comps, (str(r["id"]) for r in records))
    if differ:
        notes.append(f"{what}: shards compose {', '.join(differ)} differently; the first shard's is used")
    with_samples(entry, composition, {str(r["id"]): r for r in records})
    budget = shards[0].config.get("budget", shards[0].metrics.get("budget"))
    try:
        entry.stats = summarize(records, budget, shards[0].metrics["applies"]["budget"])  # evicts iff it has a budget
    except Exception as e:  # noqa: BLE001 - records without timings: keep the first shard's, with the merged count
        entry.stats = {**entry.stats, "samples": len(records)}
        notes.append(f"{what}: speed and memory are the first shard's ({_why(e)})")
    layouts = {json.dumps(r.metrics.get("layout"), sort_keys=True) for r in shards}
    if len(layouts) > 1:
        notes.append(f"{what}: shards write different layouts; the first shard's is used")
    recipe = entry.layout["recipe"]
    if recipe is None:  # a task that aggregates in its own code: the composed scores are the merged samples' means
        entry.scores = {k: entry.cells[k].mean if k in entry.cells else v for k, v in entry.scores.items()}
        rest = [k for k in entry.scores if k not in entry.cells]
        if rest:
            notes.append(f"{what}: {', '.join(rest)} are the first shard's (the task writes no recipe)")
    else:
        try:
            # The run's own aggregation (the task aggregated through the same function and recipe): the merged
            # records, back in sample order, give the unsharded run's scores.
            entry.scores = aggregate_scores(records, recipe)
        except RecipeError as e:
            notes.append(f"{what}: the shards' scores could not be recomputed ({_why(e)}); the first shard's are shown")
    entry.average = average_of(entry.scores, entry.layout["average"])
    return entry


def _why(e: Exception) -> str:
    return error_line(e, with_type=True)


def collect_entries(root: Path) -> tuple[list[Entry], list[str]]:
    runs, notes = find_runs(root)
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(_merge_key(r), []).append(r)
    entries = [merge_shards(g, root, notes) for g in groups.values()]
    return sorted(entries, key=lambda e: e.order), notes
