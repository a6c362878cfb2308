"""Plots of a report: NIAH/probe heatmaps (depth x context length) and score vs budget.
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path
from typing import Any

from kvbench.report.collect import is_num
from kvbench.report.tables import Report
from kvbench.run.labels import NA, settings_text

Z95 = 1.96  # normal quantile of a two-sided 95 % interval of a mean


def _figure(width: float, height: float, layout: str | None = None) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout=layout)
    FigureCanvasAgg(fig)
    return fig


def plot_heatmaps(rep: Report, out_dir: Path) -> list[Path]:
    """Length x depth heatmaps of NIAH-like tasks side by side: one figure per (task, model), one panel per row. The
    cells are the score columns the tasks' layouts place on a (context length, depth) grid."""
    written = []
    cell_tasks = list(dict.fromkeys(c.task for c in rep.columns if c.cell is not None))
    for task in cell_tasks:
        where = {c.score: c.cell for c in rep.columns if c.task == task and c.cell is not None}
        for model in dict.fromkeys(r.model for r in rep.rows):
            rows = [r for r in rep.rows if r.model == model and task in r.entries]
            if not rows:
                continue
            cells = [{where[k]: v for k, v in r.entries[task].scores.items() if k in where and is_num(v)}
                     for r in rows]
            lengths = sorted({k[0] for c in cells for k in c})
            depths = sorted({k[1] for c in cells for k in c})
            if not lengths:
                continue
            ncol = min(len(rows), 4)
            nrow = math.ceil(len(rows) / ncol)
            # constrained layout: two-line panel titles never run into the tick labels of the row above
            panel_w = 1.1 + 0.5 * len(lengths)  # inches
            fig = _figure(1.2 + ncol * panel_w, 0.6 + nrow * (1.5 + 0.3 * len(depths)), layout="constrained")
            axes = fig.subplots(nrow, ncol, squeeze=False)
            im = None
            for k, (r, c) in enumerate(zip(rows, cells)):
                ax = axes[k // ncol][k % ncol]
                grid = [[c.get((L, d), float("nan")) for L in lengths] for d in depths]  # (depths, lengths)
                im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
                ax.set_xticks(range(len(lengths)), [f"{L:g}" for L in lengths], fontsize=7)
                ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
                budget = "" if r.budget is NA else f" N={r.budget}"
                # Wrapped to the panel's width (~5 pt a character at 8 pt): long settings never run into the next panel
                shown = textwrap.fill(settings_text(r.settings), width=max(16, int(panel_w * 72 / 5)),
                                      break_long_words=False)
                ax.set_title(f"{r.policy}{budget}\n{shown}".strip(), fontsize=8)
                if k % ncol == 0:
                    ax.set_ylabel("depth (%)", fontsize=7)
                if k // ncol == nrow - 1:
                    ax.set_xlabel("context length", fontsize=7)
            for k in range(len(rows), nrow * ncol):
                axes[k // ncol][k % ncol].set_axis_off()
            if im is not None:
                fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
            ns = sorted({st.n for r in rows for k, st in r.entries[task].cells.items() if k in where and st.n})
            n_text = "" if not ns else f" (cell means, n = {ns[0]}{'' if len(ns) == 1 else f'-{ns[-1]}'} per cell)"
            fig.suptitle(f"{task}: {model}{n_text}", fontsize=9)
            path = out_dir / f"heatmap_{_safe(task)}_{_safe(model)}.png"
            fig.savefig(path, dpi=110)
            written.append(path)
    return written


def _model_source(entry: Any) -> str:
    """The model and where its weights came from, for a figure's title (a GGUF package: its name, version and
    quantization)."""
    src = (entry.provenance or {}).get("model_source") or {}
    if not src:
        return entry.model
    return (f"{entry.model} ({src.get('package')} {src.get('package_version')}, {src.get('quantization')} "
            f"dequantized to {src.get('dequantized_to', 'float32')})")


def plot_budget_heatmaps(entries: list[Any], out_dir: Path) -> list[Path]:
    """NIAH heatmaps side by side, one figure per (model, budget, block, protocol): the full cache and every policy
    run there (`kvbench-report --heatmaps-per-budget`), each figure titled with what it shows (model and its source,
    budget, block, protocol, scorer, haystack and n per cell), one panel per policy with its average; context length
    on x, needle depth on y. Writes out_dir/niah_<model>_N<budget>_B<block>_<protocol>.png."""
    import numpy as np

    entries = [e for e in entries if e.task == "niah"]
    full = [e for e in entries if e.budget is NA]
    groups: dict[tuple, list] = {}
    for e in entries:
        if e.budget is not NA:
            key = (e.model, e.budget, e.settings.get("block"), e.settings.get("protocol", "blockwise"))
            groups.setdefault(key, []).append(e)
    written = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for (model, budget, block, protocol), group in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        panels = [e for e in full if e.model == model] + group
        cells = [{e.layout["cells"][k]: v for k, v in e.scores.items() if k in e.layout["cells"]} for e in panels]
        lengths = sorted({L for c in cells for L, _ in c})
        depths = sorted({d for c in cells for _, d in c})
        ncol = min(4, len(panels))
        nrow = math.ceil(len(panels) / ncol)
        fig = _figure(3.3 * ncol + 1.2, 2.6 * nrow + 1.3, layout="constrained")
        axes = fig.subplots(nrow, ncol, squeeze=False)
        im = None
        for k, (e, c) in enumerate(zip(panels, cells)):
            ax = axes[k // ncol][k % ncol]
            grid = np.array([[c.get((L, d), np.nan) for L in lengths] for d in depths])  # (depths, lengths)
            im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
            ax.set_xticks(range(len(lengths)), [f"{L:g}" for L in lengths], fontsize=8)
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=8)
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    if not np.isnan(grid[i, j]):
                        ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=7, color="black")
            name = "full cache (no eviction)" if e.budget is NA else e.policy
            ax.set_title(f"{name}  avg {e.average:.0f}", fontsize=10)
            if k % ncol == 0:
                ax.set_ylabel("needle depth (%)", fontsize=9)
            if k // ncol == nrow - 1 or k + ncol >= len(panels):
                ax.set_xlabel("context length (tokens)", fontsize=9)
        for k in range(len(panels), nrow * ncol):
            axes[k // ncol][k % ncol].set_axis_off()
        first = panels[0]
        notes = " ".join(first.notes)
        haystack = ("Paul Graham essays" if "Paul Graham essays" in notes else
                    "built-in filler haystack" if "builtin" in notes or "filler" in notes else "haystack: see table.md")
        ns = sorted({st.n for e in panels for k, st in e.cells.items() if k in e.layout["cells"] and st.n})
        if ns:  # samples behind each cell's mean (the scores are cell means)
            haystack += f"; n = {ns[0]}{'' if len(ns) == 1 else f'-{ns[-1]}'} samples per cell"
        fig.suptitle(f"NIAH (substring recall, 0-100) on {_model_source(first)}\n"
                     f"budget N = {budget} tokens per layer and KV head, block B = {block}, protocol {protocol}; "
                     f"{haystack}; full cache: no eviction", fontsize=11)
        if im is not None:
            fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.6, label="score")
        path = out_dir / f"niah_{model}_N{budget}_B{block}_{protocol}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def plot_score_vs_budget(rep: Report, out_dir: Path) -> Path | None:
    """Each task's average against budget, one line per policy (and setting), one panel per (model, task) (tasks
    are not averaged together: their scales differ); the full cache dashed. Where the runs carry per-sample data,
    error bars (a band for the full cache) show the 95 % interval of the mean, mean ± 1.96 se."""
    panels = list(dict.fromkeys((r.model, t) for r in rep.rows for t in r.entries))
    series: dict[tuple[str, str], dict[str, list[tuple[int, float, float]]]] = {k: {} for k in panels}
    flat: dict[tuple[str, str], list[tuple[str, float, float]]] = {k: [] for k in panels}
    sizes: dict[tuple[str, str], set[int]] = {k: set() for k in panels}  # n behind each point, for the title
    for r in rep.rows:
        label = f"{r.policy} {settings_text(r.settings)}".strip()
        for task, e in r.entries.items():
            if not is_num(e.average):
                continue
            st = e.cells.get(e.average_key) if e.average_key else None
            half = Z95 * st.se if st is not None and st.se is not None else 0.0
            if st is not None and st.n:
                sizes[r.model, task].add(int(st.n))
            if isinstance(r.budget, int) and not isinstance(r.budget, bool):
                pts = series[r.model, task].setdefault(label, [])
                pts.append((r.budget, e.average, half))  # type: ignore[arg-type]
            else:
                flat[r.model, task].append((label, e.average, half))  # type: ignore[arg-type]
    panels = [k for k in panels if any(len(pts) > 1 for pts in series[k].values())]
    if not panels:
        return None
    import matplotlib

    colors = matplotlib.colormaps["tab20"].colors  # up to 20 distinct series; markers tell repeats apart
    markers = "osD^v<>ph*"
    fig = _figure(6.4 * len(panels), 3.8, layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (m, task) in zip(axes, panels):
        for i, (label, pts) in enumerate(series[m, task].items()):
            pts.sort()
            color = colors[i % len(colors)]
            # The interval of a 0-100 score is cut at the scale's ends (the normal approximation overshoots them).
            lo = [min(h, v) if 0 <= v <= 100 else h for _, v, h in pts]
            hi = [min(h, 100.0 - v) if 0 <= v <= 100 else h for _, v, h in pts]
            ax.errorbar([b for b, _, _ in pts], [v for _, v, _ in pts], yerr=[lo, hi], capsize=3,
                        marker=markers[i % len(markers)], color=color, label=label)
        for label, v, half in flat[m, task]:
            ax.axhline(v, linestyle="--", color="black", linewidth=1, label=label)
            if half:
                inside = 0 <= v <= 100
                ax.axhspan(max(0.0, v - half) if inside else v - half, min(100.0, v + half) if inside else v + half,
                           color="black", alpha=0.08, linewidth=0)
        budgets = sorted({b for pts in series[m, task].values() for b, _, _ in pts})
        ax.set_xscale("log", base=2)
        close = any(b2 / b1 < 1.5 for b1, b2 in zip(budgets, budgets[1:]))  # neighbouring labels would overlap
        ax.set_xticks(budgets, [str(b) for b in budgets], rotation=45 if close else 0)
        ax.set_xlabel("budget N (tokens)")
        bars = any(h for pts in series[m, task].values() for _, _, h in pts)
        # Name the score the average is where the task says so and it is not a plain "avg" (lm: next-token accuracy)
        keys = {e.average_key for r in rep.rows if r.model == m for t, e in r.entries.items() if t == task}
        key = next(iter(keys)) if len(keys) == 1 else None
        what = f"{task} average" + (f" ({key})" if key and key not in ("avg", task) else "")
        ax.set_ylabel(what + (" (bars: 95 % interval)" if bars else ""))
        ns = sorted(sizes[m, task])
        n_text = "" if not ns else f" (n = {ns[0]} samples per point)" if len(ns) == 1 else \
            f" (n = {ns[0]}-{ns[-1]} samples per point)"
        title = f"{m}: {what} vs budget{n_text}"
        if len(title) > 60:  # past the axes' width: the n on a second line
            title = f"{m}: {what} vs budget\n{n_text.strip(' ()')}"
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)  # beside the lines
    path = out_dir / "score_vs_budget.png"
    fig.savefig(path, dpi=110)
    return path


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s)
