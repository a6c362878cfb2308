"""Runs and entries: every directory below a root that holds a `metrics.json` is one run; runs whose configurations
differ only in `shard` are merged into one entry (predictions back in sample order, scores recomputed by the
task's own `aggregate`, speed and memory by `run.loop.summarize`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kvbench.run.labels import NA

# Settings that never change results; runs differing only in these (and in `shard`) are the same entry.
IGNORED_SETTINGS = ("shard", "progress", "overwrite", "device", "save_prompts", "compare")


IDENTITY = ("model", "policy", "budget")


class ReportError(ValueError):
    """Nothing to report (no runs below the directory, ...)."""


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


def find_runs(root: Path) -> tuple[list[Run], list[str]]:
    """Every finished run below `root` (a directory with metrics.json), and notes on what was skipped."""
    runs, notes = [], []
    for mp in sorted(root.rglob("metrics.json")):
        try:
            metrics = json.loads(mp.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            notes.append(f"{rel_path(mp.parent, root)}: unreadable metrics.json, skipped")
            continue
        runs.append(Run(mp.parent, metrics, _load_yaml(mp.parent / "config.yaml"),
                        (_job_num(mp.parent), mp.stat().st_mtime)))
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
    from kvbench.engine.generate import resolve_protocol

    m = run.metrics
    cfg = run.config or {"budget": m.get("budget"), "block": m.get("block"), "protocol": m.get("protocol"),
                         "scenario": m.get("scenario")}
    flat = {k: v for k, v in _flatten(cfg).items() if k.split(".")[0] not in IGNORED_SETTINGS}
    try:  # runs from before the protocol setting were blockwise; a block the protocol ignores does not apply
        flat["protocol"], block = resolve_protocol(str(cfg.get("protocol") or "blockwise"), cfg.get("block"))
        flat["block"] = NA if block is None else block
    except ValueError:
        pass
    for k, used in applies(m).items():
        if not used:
            flat[k] = NA
    return flat


def applies(metrics: dict[str, Any]) -> dict[str, bool]:
    """Which of budget, protocol and block the run's policy uses, as the run recorded it (metrics.json `applies`);
    runs from before that field: the full cache (the one policy that never evicts and reads the prompt in one
    forward) uses none, every other policy all three."""
    uses = metrics.get("policy") != "full"
    return {"budget": uses, "protocol": uses, "block": uses, **(metrics.get("applies") or {})}


def _merge_key(run: Run) -> str:
    s = _settings(run)
    return json.dumps([run.metrics.get("model"), run.metrics.get("policy"), run.metrics.get("task"),
                       sorted((k, repr(v)) for k, v in s.items())])


def entry_from_run(run: Run, label: str = "") -> Entry:
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
    from kvbench.run.loop import read_records

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
    entry = entry_from_run(shards[0], label="" if complete else f"({len(shards)}/{n} shards)")
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
        from kvbench.run.app import task_average
        from kvbench.run.loop import summarize
        from kvbench.run.settings import build_task

        task = build_task(cfg["task"])
        entry.scores = task.aggregate(records)
        entry.average = task_average(task, entry.scores)
        budget = cfg.get("budget")
        entry.stats = summarize(records, budget, applies(shards[0].metrics)["budget"])  # evicts iff it has a budget
    except Exception as e:  # noqa: BLE001 - any failure: fall back to sample-weighted shard means, say so
        weights = [float((r.metrics.get("stats") or {}).get("samples") or 0) for r in shards]
        wsum = sum(weights) or 1.0
        names = {k for r in shards for k in (r.metrics.get("scores") or {})}
        entry.scores = {k: sum(w * r.metrics["scores"].get(k, 0.0) for w, r in zip(weights, shards)) / wsum
                        for k in names}
        avgs = [(w, r.metrics.get("average")) for w, r in zip(weights, shards) if is_num(r.metrics.get("average"))]
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
