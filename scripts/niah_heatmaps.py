"""Side-by-side NIAH heatmaps, one figure per (model, budget, block, protocol): the full cache and every policy.

    python scripts/niah_heatmaps.py RUNS_DIR OUT_DIR

Reads every finished run below RUNS_DIR with kvbench-report's own collector, writes
OUT_DIR/niah_<model>_N<budget>.png. Each figure says what it shows without its caption: model (and where its
weights came from), budget, block, protocol, scorer and haystack in the title; one panel per policy with its
average in the panel title; context length on x, needle depth on y.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from kvbench.report.collect import collect_entries
from kvbench.run.labels import NA


def _label_source(entry) -> str:
    src = (entry.provenance or {}).get("model_source") or {}
    if not src:
        return entry.model
    return (f"{entry.model} ({src.get('package')} {src.get('package_version')}, {src.get('quantization')} "
            f"dequantized to {src.get('dequantized_to', 'float32')})")


def main(runs: Path, out: Path) -> list[Path]:
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    entries, _ = collect_entries(runs)
    entries = [e for e in entries if e.task == "niah"]
    full = [e for e in entries if e.budget is NA]
    groups: dict[tuple, list] = {}
    for e in entries:
        if e.budget is NA:
            continue
        key = (e.model, e.budget, e.settings.get("block"), e.settings.get("protocol", "blockwise"))
        groups.setdefault(key, []).append(e)
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for (model, budget, block, protocol), group in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        panels = [e for e in full if e.model == model] + group
        cells = [{e.layout["cells"][k]: v for k, v in e.scores.items() if k in e.layout["cells"]} for e in panels]
        lengths = sorted({L for c in cells for L, _ in c})
        depths = sorted({d for c in cells for _, d in c})
        ncol = min(4, len(panels))
        nrow = math.ceil(len(panels) / ncol)
        fig = Figure(figsize=(3.3 * ncol + 1.2, 2.6 * nrow + 1.3), layout="constrained")
        FigureCanvasAgg(fig)
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
        fig.suptitle(f"NIAH (substring recall, 0-100) on {_label_source(first)}\n"
                     f"budget N = {budget} tokens per layer and KV head, block B = {block}, protocol {protocol}; "
                     f"{haystack}; full cache: no eviction", fontsize=11)
        if im is not None:
            fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.6, label="score")
        path = out / f"niah_{model}_N{budget}_B{block}_{protocol}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
        print(f"wrote {path}")
    return written


def cli(argv: list[str] | None = None) -> int:
    """The command line: --help prints the usage and exits 0; a RUNS_DIR that does not exist is one line and exit 2."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, metavar="RUNS_DIR")
    ap.add_argument("out", type=Path, metavar="OUT_DIR")
    a = ap.parse_args(argv)
    if not a.runs.is_dir():
        print(f"niah_heatmaps.py: error: {a.runs} is not a directory", file=sys.stderr)
        return 2
    main(a.runs, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
