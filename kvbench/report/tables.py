"""Table layout: rows = (model, policy, budget, block, protocol, any other varying setting), grouped by model with
the full cache first; columns = scores grouped by category (LongBench categories, NIAH context lengths, else the
task), then Avg; the summary and speed tables.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvbench.report.collect import IDENTITY, Entry, is_num
from kvbench.run.labels import NA, setting_name

ALWAYS_SHOWN = ("block", "protocol")  # settings shown as columns even when every row has the same value


CELL = re.compile(r"^L(\d+)_D(\d+(?:\.\d+)?)$")  # NIAH / probe cell scores


LONGBENCH_CATEGORIES = {"single_doc_qa": "Single Doc. QA", "multi_doc_qa": "Multi Doc. QA",
                        "summarization": "Summarization", "few_shot": "Few-shot Learning",
                        "synthetic": "Synthetic", "code": "Code"}


SPEED_HEAD = ["samples", "prefill tok/s", "decode tok/s", "evict s", "peak KV tok", "KV MiB", "compression"]


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


def cell_value(row: Row, c: Column) -> Any:
    e = row.entries.get(c.task)
    return None if e is None else e.scores.get(c.score)


def speed_cells(e: Entry) -> list[Any]:
    st = e.stats
    kv = st.get("kv_bytes_peak")
    return [st.get("samples"), st.get("prefill_tokens_per_s"), st.get("decode_tokens_per_s"), st.get("evict_s"),
            st.get("peak_kv_tokens"), kv / 2**20 if is_num(kv) else None, st.get("compression_ratio")]


def score_table(rep: Report, paper_style: bool = True) -> tuple[list[str], list[list[Any]]]:
    """Header and rows of the main table. paper_style: model and policy only on the first row of their group,
    and a category row under the header when the columns have more than one category."""
    head = [*IDENTITY, *(setting_name(k) for k in rep.varying), *(c.name for c in rep.columns), "Avg"]
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
        body.append([model, policy, r.budget, *r.settings.values(), *(cell_value(r, c) for c in rep.columns), r.avg])
    return head, body


def summary_table(rep: Report) -> tuple[list[str], list[list[Any]]]:
    head = [*IDENTITY, *(setting_name(k) for k in rep.varying), *(c.name for c in rep.summary_columns)]
    return head, [[r.model, f"{r.policy} {r.label}".strip(), r.budget, *r.settings.values(),
                   *(cell_value(r, c) for c in rep.summary_columns)] for r in rep.rows]


def speed_table(rep: Report) -> tuple[list[str], list[list[Any]]]:
    multi = len({e.task for e in rep.entries}) > 1
    head = [*IDENTITY, *(setting_name(k) for k in rep.varying), *(["task"] if multi else []), *SPEED_HEAD, "score"]
    body = []
    for r in rep.rows:
        for task, e in r.entries.items():
            body.append([r.model, f"{r.policy} {r.label}".strip(), r.budget, *r.settings.values(),
                         *([task] if multi else []), *speed_cells(e), e.average])
    return head, body
