"""Writing a report: markdown (scores, summary, speed, provenance notes), table.csv and runs.csv.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path
from typing import Any

from kvbench.metrics.stats import MeanSE, p_text
from kvbench.report.collect import IDENTITY, Entry, rel_path
from kvbench.report.paired import PAIRED_HEAD, Pair, markdown_pairs, row_values
from kvbench.report.tables import (SHARED_NOTE, SPEED_HEAD, Report, Row, avg_stat, cell_stat, cell_value,
                                   has_degenerate, has_shared, has_stats, score_table, speed_cells, speed_table,
                                   summary_table)
from kvbench.run.labels import NA, fmt, setting_name


def _markdown(head: list[str], body: list[list[Any]]) -> str:
    from tabulate import tabulate

    return tabulate([[fmt(v) for v in row] for row in body], headers=head, tablefmt="github",
                    disable_numparse=True)


def _tree_note(dirty: Any) -> str:
    """How the commit's working tree was: runs written before kvbench recorded it have no `dirty` (unknown: no note,
    so their tables read as before)."""
    if dirty is True:
        return " + uncommitted changes"
    return " (clean tree)" if dirty is False else ""


def _provenance_lines(rep: Report) -> list[str]:
    code = Counter()
    libs = Counter()
    models: dict[str, set[str]] = {}
    tasks: dict[str, set[str]] = {}
    for e in rep.entries:
        p = e.provenance
        code[f"kvbench {p.get('kvbench')} @ {str(p.get('commit'))[:12]}{_tree_note(p.get('dirty'))}"] += 1
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


def _se_lines(rep: Report) -> list[str]:
    if not has_stats(rep):
        return []
    lines = ["", "mean ± standard error of the mean (sample sd with n - 1 over sqrt(n); a mean of scores: "
             "sqrt(sum se²) / k); n: samples per cell, `(n=k)` where a cell's differs from its row's."]
    return lines


def _degenerate_line(rep: Report) -> list[str]:
    if not has_degenerate(rep):
        return []
    return ["", "degenerate: outputs that are empty, or one token or n-gram repeated over >= 80 % of the output "
            "(k of n samples)."]


def _entry_head(rep: Report) -> list[str]:
    multi = len({e.task for e in rep.entries}) > 1
    return [*IDENTITY, *(setting_name(k) for k in rep.varying), *(["task"] if multi else [])]


def _entry_lead(rep: Report, r: Row, task: str) -> list[Any]:
    multi = len({e.task for e in rep.entries}) > 1
    return [r.model, f"{r.policy} {r.label}".strip(), r.budget, *r.settings.values(), *([task] if multi else [])]


def _logprob_text(st: MeanSE | None) -> str:
    if st is None or st.mean is None:
        return ""
    return f"{st.mean:.3f}" + (f" ± {st.se:.3f}" if st.se is not None else "") + f" (n={st.n})"


# Runs whose records carry an LM summary (task=lm, docs/protocols.md): their logprob is the LM score
_LM_CLAUSE = " (LM-scored runs: of the text's own scored tokens; a sample's perplexity is exp(-logprob))"


def _has_lm(items: list[Any]) -> bool:
    return any(isinstance(rec.get("lm"), dict) for _, _, e in items for rec in e.records.values())


def _vs_full_section(rep: Report) -> list[str]:
    """Token agreement and the graded score against the full cache, one line per entry that has either."""
    items = [(r, t, e) for r in rep.rows for t, e in r.entries.items()
             if e.vs_full is not None or e.logprob is not None or e.dlogprob is not None]
    if not any(e.vs_full is not None or e.dlogprob is not None for _, _, e in items):
        return []
    head = [*_entry_head(rep), "agree %", "agree_n", "first_diff", "logprob", "Δlogprob vs full [95 % CI]"]
    body = []
    for r, t, e in items:
        a, d = e.vs_full, e.dlogprob
        body.append([*_entry_lead(rep, r, t), "" if a is None else f"{a.agree:.1f}", "" if a is None else a.n,
                     "" if a is None else ("-" if a.first_diff is None else f"{a.first_diff:.1f}"),
                     _logprob_text(e.logprob),
                     "" if d is None else f"{d.diff:+.3f} [{d.ci_low:+.3f}, {d.ci_high:+.3f}] (n={d.n})"])
    return ["", "## Against the full cache", "",
            "agree: % of samples whose generated tokens equal the full cache's (agree_n samples both ran); "
            "first_diff: mean index of the first differing token over the samples that differ (- when all agree); "
            "logprob: mean log-probability per token (nats) of the gold answer teacher-forced through the cache, "
            f"± se{_LM_CLAUSE if _has_lm(items) else ''}; Δlogprob: paired difference to the full cache with its 95 % "
            "bootstrap interval.", "",
            _markdown(head, body)]


def _paired_section(rep: Report, found: list[Pair] | None, policy: str | None) -> list[str]:
    if not found:
        return []
    shown, sentence = markdown_pairs(rep, found, policy)
    body = []
    for p in shown:
        v = dict(zip(PAIRED_HEAD, row_values(p)))
        body.append([v["task"], v["score"], v["policy_a"], v["settings_a"], v["policy_b"], v["settings_b"], v["n"],
                     f"{v['mean_a']:.2f}", f"{v['mean_b']:.2f}", f"{v['diff']:+.2f}",
                     f"[{v['ci_low']:+.2f}, {v['ci_high']:+.2f}]", p_text(p.result), v["n_required"],
                     f"{v['min_detectable_diff']:.3g}" if isinstance(v["min_detectable_diff"], float)
                     else v["min_detectable_diff"]])
    head = ["task", "score", "policy_a", "settings_a", "policy_b", "settings_b", "n", "mean_a", "mean_b", "diff",
            "95 % CI", "p", "n needed", "min. diff"]
    return ["", "## Paired comparisons", "", sentence, "", _markdown(head, body)]


def render_markdown(rep: Report, root: Path | None = None, pairs: list[Pair] | None = None,
                    paired_policy: str | None = None) -> str:
    parts = [f"# kvbench report{f': {root}' if root else ''}", "",
             "## Scores (0-100 as stored; Avg = mean of each row's task averages)", "",
             _markdown(*score_table(rep, text=True)), *_se_lines(rep), *_degenerate_line(rep)]
    if rep.summary_columns:
        parts += ["", "## Summary scores", "", _markdown(*summary_table(rep, text=True))]
    parts += _vs_full_section(rep)
    parts += _paired_section(rep, pairs, paired_policy)
    parts += ["", "## Speed and memory", "", _markdown(*speed_table(rep)), "",
              "KV MiB: peak K+V bytes held, all layers; compression: mean of min(1, N / prompt length).", "",
              *([SHARED_NOTE, ""] if has_shared(rep) else []), "## Provenance", "", *_provenance_lines(rep)]
    if rep.notes:
        parts += ["", "## Notes", "", *(f"- {n}" for n in rep.notes)]
    return "\n".join(parts) + "\n"


def _stat_cells(st: MeanSE | None) -> list[Any]:
    return [None, None] if st is None else [st.se, st.n]


AGREE_HEAD = ["agree", "agree_n", "first_diff"]
LOGPROB_HEAD = ["logprob", "logprob_se", "logprob_n"]


def _sample_head(rep: Report) -> tuple[bool, bool]:
    """Which per-sample column groups have data: agreement with the full cache, the graded score."""
    es = [e for r in rep.rows for e in r.entries.values()]
    return any(e.vs_full is not None for e in es), any(e.logprob is not None for e in es)


def _sample_cells(e: Entry | None, agree: bool, logprob: bool) -> list[Any]:
    a = None if e is None else e.vs_full
    lp = None if e is None else e.logprob
    out: list[Any] = []
    if agree:
        out += [None] * 3 if a is None else [a.agree, a.n, a.first_diff]
    if logprob:
        out += [None] * 3 if lp is None else [lp.mean, lp.se, lp.n]
    return out


def write_csv(rep: Report, path: Path) -> None:
    """The score table; with per-sample data `<column>_se` and `<column>_n` beside each score column (and Avg),
    then, per task, agreement with the full cache and the graded score where the runs have them."""
    stats = has_stats(rep)
    agree, logprob = _sample_head(rep)
    tasks = list(dict.fromkeys(e.task for e in rep.entries))
    cols = [*rep.columns, *rep.summary_columns]
    head = [*IDENTITY, *(setting_name(k) for k in rep.varying)]
    for c in cols:
        head += [c.name, f"{c.name}_se", f"{c.name}_n"] if stats else [c.name]
    head += ["Avg", "Avg_se", "Avg_n"] if stats else ["Avg"]
    extra = [*(AGREE_HEAD if agree else []), *(LOGPROB_HEAD if logprob else [])]
    head += [h if len(tasks) == 1 else f"{t}/{h}" for t in tasks for h in extra]
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(head)
        for r in rep.rows:
            row: list[Any] = [r.model, f"{r.policy} {r.label}".strip(), r.budget, *r.settings.values()]
            for c in cols:
                row += [cell_value(r, c), *(_stat_cells(cell_stat(r, c)) if stats else [])]
            row += [r.avg, *(_stat_cells(avg_stat(r)) if stats else [])]
            row += [v for t in tasks for v in _sample_cells(r.entries.get(t), agree, logprob)]
            w.writerow([_csv(v) for v in row])


def write_runs_csv(rep: Report, path: Path, root: Path) -> None:
    deg = has_degenerate(rep)
    agree, logprob = _sample_head(rep)
    dlog = any(e.dlogprob is not None for r in rep.rows for e in r.entries.values())
    diags = sorted({n for r in rep.rows for e in r.entries.values() for n in e.diagnostics})  # mean and max each
    head = ["model", "policy", "budget", "task", *rep.varying, *SPEED_HEAD, "average", "kvbench", "commit",
            "transformers", "torch", "model_path", "model_revision", "dtype", "device", "task_provenance", "run_dirs"]
    head += [*(["degenerate"] if deg else []), *(AGREE_HEAD if agree else []), *(LOGPROB_HEAD if logprob else []),
             *(["dlogprob", "dlogprob_ci_low", "dlogprob_ci_high"] if dlog else []),
             *(c for n in diags for c in (n, f"{n}_max"))]
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(head)
        for r in rep.rows:
            for e in r.entries.values():
                p = e.provenance
                row = [e.model, e.policy, e.budget, e.task, *r.settings.values(), *speed_cells(e), e.average,
                       p.get("kvbench"), p.get("commit"), p.get("transformers"), p.get("torch"), p.get("model_path"),
                       p.get("model_revision"), p.get("dtype"), p.get("device"),
                       json.dumps(p.get("task") or {}, sort_keys=True), ";".join(rel_path(x, root) for x in e.paths)]
                if deg:
                    k = e.stats.get("degenerate")
                    row.append(None if k is None else f"{k}/{e.stats.get('samples')}")
                row += _sample_cells(e, agree, logprob)
                if dlog:
                    d = e.dlogprob
                    row += [None] * 3 if d is None else [d.diff, d.ci_low, d.ci_high]
                for n in diags:
                    got = e.diagnostics.get(n) or {}
                    row += [got.get("mean"), got.get("max")]
                w.writerow([_csv(v) for v in row])


def _csv(v: Any) -> Any:
    if v is NA:
        return ""
    return "" if v is None else v
