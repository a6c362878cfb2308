"""Table layout: rows = (model, policy, budget, block, protocol, any other varying setting), grouped by model with
the full cache first; columns = scores in the order and under the categories the tasks' metrics.json `layout`
gives (LongBench categories, NIAH context lengths, else the task), then
Avg; the summary and speed tables.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvbench.metrics.stats import MeanSE, mean_of
from kvbench.report.collect import IDENTITY, Entry, is_num, pair_key
from kvbench.report.layout import cells_of, merge_layouts
from kvbench.report.samples import LOGPROB, agreement, compare
from kvbench.run.labels import NA, fmt, setting_name

ALWAYS_SHOWN = ("block", "protocol")  # settings shown as columns even when every row has the same value

SPEED_HEAD = ["samples", "prefill tok/s", "decode tok/s", "evict s", "peak KV tok", "KV MiB", "compression"]


@dataclass
class Column:
    task: str
    score: str
    name: str  # the table header (task-prefixed when two tasks share a score name)
    category: str
    cell: tuple[float, float] | None = None  # (context length, depth) of a heatmap cell score


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
        # Each task's entry carries its own label; equal ones (every task sharded alike) are said once.
        return " ".join(dict.fromkeys(e.label for e in self.entries.values() if e.label))

    @property
    def avg(self) -> float | None:
        vals = [e.average for e in self.entries.values() if is_num(e.average)]
        return sum(vals) / len(vals) if vals else None


@dataclass
class Report:
    entries: list[Entry]
    rows: list[Row]
    columns: list[Column]  # detail score columns (the main table)
    summary_columns: list[Column]
    varying: list[str]  # setting keys shown as columns
    notes: list[str]


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

    def col(task: str, score: str, category: str, cell: tuple[float, float] | None = None) -> Column:
        return Column(task, score, f"{task}/{score}" if count[score] > 1 else score, category, cell)

    detail: list[Column] = []
    summary: list[Column] = []
    for t in tasks:
        layouts = [e.layout for e in entries if e.task == t]
        cols, summ = merge_layouts(layouts, names[t], t)
        cells = cells_of(layouts)
        detail += [col(t, c["score"], c["category"], cells.get(c["score"])) for c in cols]
        summary += [col(t, s, t) for s in summ]
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
    _against_full(ordered)
    all_tasks = {c.task for c in detail + summary}
    for r in ordered:
        missing = sorted(all_tasks - set(r.entries))
        if missing and len(all_tasks) > 1:
            notes.append(f"{r.model} {r.policy} budget {r.budget!r}: no {', '.join(missing)} run; Avg covers "
                         f"{', '.join(r.entries)}")
    return Report(entries, ordered, detail, summary, varying, notes)


def _against_full(rows: list[Row]) -> None:
    """Each entry's token agreement with, and graded-score difference from, the full cache's entry of the same
    model, task and task/model settings (the first in table order), where both hold per-sample records."""
    fulls: dict[str, Entry] = {}
    for r in rows:
        for e in r.entries.values():
            if e.reference and e.records:
                fulls.setdefault(pair_key(e), e)
    for r in rows:
        for e in r.entries.values():
            f = fulls.get(pair_key(e))
            if e.reference or f is None or not e.records:
                continue
            a = agreement(e.records, f.records)
            e.vs_full = a if a.n else None
            e.dlogprob = compare(e.composition, e.records, f.composition, f.records, LOGPROB)


def cell_value(row: Row, c: Column) -> Any:
    e = row.entries.get(c.task)
    return None if e is None else e.scores.get(c.score)


def cell_stat(row: Row, c: Column) -> MeanSE | None:
    e = row.entries.get(c.task)
    return None if e is None else e.cells.get(c.score)


def avg_stat(row: Row) -> MeanSE | None:
    """n and se of the row's Avg (a mean of its task averages: stratified like a mean_of score)."""
    parts = [e.cells.get(e.average_key) if e.average_key else None
             for e in row.entries.values() if is_num(e.average)]
    if not parts or any(p is None for p in parts):
        return None
    return parts[0] if len(parts) == 1 else mean_of(parts)  # type: ignore[arg-type]


def has_stats(rep: Report) -> bool:
    return any(e.cells for e in rep.entries)


def has_degenerate(rep: Report) -> bool:
    return any("degenerate" in e.stats for r in rep.rows for e in r.entries.values())


def degenerate_text(row: Row) -> str | None:
    """`k/n`: degenerate outputs (empty, or one token or n-gram over >= 80 % of the output) of the row's samples."""
    es = [e for e in row.entries.values() if is_num(e.stats.get("degenerate"))]
    if not es:
        return None
    return f"{sum(int(e.stats['degenerate']) for e in es)}/{sum(int(e.stats.get('samples') or 0) for e in es)}"


def stat_text(value: Any, st: MeanSE | None, row_n: int | None = None) -> str:
    """`mean ± se` (one decimal), `mean` alone when n = 1, `(n=k)` after it when its n is not the row's; a score
    outside the composition (a leaderboard average) as stored."""
    if st is None or not is_num(value):
        return fmt(value)
    text = f"{value:.1f}" + (f" ± {st.se:.1f}" if st.se is not None else "")
    return text if st.n == row_n else f"{text} (n={st.n})"


def row_n(stats: list[MeanSE | None]) -> int | None:
    """The row's n, shown once in the `n` column: the most samples any of its cells holds (the task's own score
    holds them all; a breakdown column over fewer says its own `(n=k)`). Not the n most cells share: five
    per-package columns of 2-11 samples each would then label a 27-sample row n = 2."""
    ns = [s.n for s in stats if s is not None]
    return max(ns) if ns else None


SHARED_NOTE = ("shared: the run's forwards were shared with other runs, its speed is its equal share of them (the "
               "group's throughput, not the policy's own speed: kvbench-bench measures that); rows of K: it was one of "
               "K rows of each forward (batched samples, or a shared group's runs decoding together); trunk: its "
               "first prompt forwards came from a trunk shared by the sample's runs (docs/sweeps.md).")


def shared_text(e: Entry) -> str:
    """How the run's forwards were shared with other runs ("trunk", "rows of K"; "" when they were not)."""
    st = e.stats
    parts = ["trunk"] if st.get("trunk_samples") else []
    if is_num(st.get("batch_size")) and st["batch_size"] > 1:
        parts.append(f"rows of {st['batch_size']}")
    return ", ".join(parts)


def has_shared(rep: Report) -> bool:
    return any(shared_text(e) for r in rep.rows for e in r.entries.values())


def speed_cells(e: Entry) -> list[Any]:
    st = e.stats
    kv = st.get("kv_bytes_peak")
    return [st.get("samples"), st.get("prefill_tokens_per_s"), st.get("decode_tokens_per_s"), st.get("evict_s"),
            st.get("peak_kv_tokens"), kv / 2**20 if is_num(kv) else None, st.get("compression_ratio")]


def score_table(rep: Report, paper_style: bool = True, text: bool = False) -> tuple[list[str], list[list[Any]]]:
    """Header and rows of the main table. paper_style: model and policy only on the first row of their group,
    and a category row under the header when the columns have more than one category. text (markdown): cells
    as `mean ± se` with an `n` column (runs with per-sample data). A `degenerate` column (`k/n`) when the runs
    count degenerate outputs, so a collapsed baseline shows in the table that ranks it."""
    stats = text and has_stats(rep)
    deg = has_degenerate(rep)
    head = [*IDENTITY, *(setting_name(k) for k in rep.varying), *(["n"] if stats else []),
            *(c.name for c in rep.columns), *(["degenerate"] if deg else []), "Avg"]
    body: list[list[Any]] = []
    cats = [c.category for c in rep.columns]
    if paper_style and len(set(cats)) > 1:
        lead = [""] * (len(IDENTITY) + len(rep.varying) + stats)
        body.append([*lead, *(f"*{c}*" if k == 0 or cats[k - 1] != c else "" for k, c in enumerate(cats)),
                     *([""] if deg else []), ""])
    prev: tuple[str, str] | None = None
    for r in rep.rows:
        policy = f"{r.policy} {r.label}".strip()
        model = r.model
        if paper_style and prev is not None:
            model = "" if prev[0] == r.model else model
            policy = "" if prev == (r.model, r.policy) else policy
        prev = (r.model, r.policy)
        values: list[Any] = [cell_value(r, c) for c in rep.columns]
        avg: Any = r.avg
        n: list[Any] = []
        if stats:
            sts = [cell_stat(r, c) for c in rep.columns]
            rn = row_n(sts)
            values = [stat_text(v, st, rn) for v, st in zip(values, sts)]
            avg, n = stat_text(avg, avg_stat(r), rn), [rn]
        body.append([model, policy, r.budget, *r.settings.values(), *n, *values,
                     *([degenerate_text(r)] if deg else []), avg])
    return head, body


def summary_table(rep: Report, text: bool = False) -> tuple[list[str], list[list[Any]]]:
    stats = text and has_stats(rep)
    head = [*IDENTITY, *(setting_name(k) for k in rep.varying), *(["n"] if stats else []),
            *(c.name for c in rep.summary_columns)]
    body = []
    for r in rep.rows:
        values: list[Any] = [cell_value(r, c) for c in rep.summary_columns]
        n: list[Any] = []
        if stats:
            sts = [cell_stat(r, c) for c in rep.summary_columns]
            rn = row_n(sts)
            values, n = [stat_text(v, st, rn) for v, st in zip(values, sts)], [rn]
        body.append([r.model, f"{r.policy} {r.label}".strip(), r.budget, *r.settings.values(), *n, *values])
    return head, body


def speed_table(rep: Report) -> tuple[list[str], list[list[Any]]]:
    multi = len({e.task for e in rep.entries}) > 1
    shared = has_shared(rep)  # the column only where some run shared its forwards (committed tables stay as they are)
    head = [*IDENTITY, *(setting_name(k) for k in rep.varying), *(["task"] if multi else []), *SPEED_HEAD,
            *(["shared"] if shared else []), "score"]
    body = []
    for r in rep.rows:
        for task, e in r.entries.items():
            body.append([r.model, f"{r.policy} {r.label}".strip(), r.budget, *r.settings.values(),
                         *([task] if multi else []), *speed_cells(e), *([shared_text(e)] if shared else []),
                         e.average])
    return head, body
