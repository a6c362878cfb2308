"""Writing a report: markdown (scores, summary, speed, provenance notes), table.csv and runs.csv.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path
from typing import Any

from kvbench.report.collect import rel_path
from kvbench.report.tables import SPEED_HEAD, Report, cell_value, score_table, speed_cells, speed_table, summary_table
from kvbench.run.labels import NA, fmt


def _markdown(head: list[str], body: list[list[Any]]) -> str:
    from tabulate import tabulate

    return tabulate([[fmt(v) for v in row] for row in body], headers=head, tablefmt="github",
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
            w.writerow([_csv(v) for v in [*row[:-1], *(cell_value(r, c) for c in rep.summary_columns), row[-1]]])


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
                    e.model, e.policy, e.budget, e.task, *r.settings.values(), *speed_cells(e), e.average,
                    p.get("kvbench"), p.get("commit"), p.get("transformers"), p.get("torch"), p.get("model_path"),
                    p.get("model_revision"), p.get("dtype"), p.get("device"),
                    json.dumps(p.get("task") or {}, sort_keys=True), ";".join(rel_path(x, root) for x in e.paths)]])


def _csv(v: Any) -> Any:
    if v is NA:
        return ""
    return "" if v is None else v
