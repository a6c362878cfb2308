"""`kvbench-report DIR [--paired POLICY]`: collect the runs below DIR, build the report, write table.md / table.csv /
runs.csv / paired.csv and the plots; and the one table `kvbench` prints after its runs.
`kvbench-report DIR --design CSV`: the design's planned comparisons instead (runs paths below DIR), tested from the
records with one Holm family per model (kvbench.report.family), written as tests.csv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from kvbench.report.collect import Entry, ReportError, Run, collect_entries, entry_from_run
from kvbench.report.family import read_design, run_design, write_tests
from kvbench.report.output import render_markdown, write_csv, write_runs_csv
from kvbench.report.paired import check_policy, pairs, write_paired_csv
from kvbench.report.plots import plot_budget_heatmaps, plot_heatmaps, plot_score_vs_budget
from kvbench.report.tables import ALWAYS_SHOWN, SPEED_HEAD, Report, build_report, score_table, speed_cells
from kvbench.run.labels import fmt


def report(root: Path, plots: bool = True, quiet: bool = False, paired: str | None = None,
           out: Path | None = None, per_budget: bool = False) -> Report:
    """Collect every run below `root`, write table.md, table.csv, runs.csv, paired.csv (and plots) into `out`
    (default: `root`). `paired`: only the pairs with an entry of that policy (as policy_b) in paired.csv and
    table.md. `per_budget`: NIAH heatmaps per (model, budget, block, protocol) too (plots.plot_budget_heatmaps)."""
    root = Path(root)
    if not root.is_dir():
        raise ReportError(f"not a directory: {root}")
    out = Path(out) if out is not None else root
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out is not a directory: {out}")
    entries, notes = collect_entries(root)
    if not entries:
        raise ReportError(f"no finished runs (metrics.json) below {root}")
    rep = build_report(entries, notes)
    check_policy(rep, paired)  # before anything is written
    found = pairs(rep, paired)
    out.mkdir(parents=True, exist_ok=True)
    if plots:
        written = plot_heatmaps(rep, out)
        curve = plot_score_vs_budget(rep, out)
        written += [curve] if curve else []
        rep.notes += [f"plot: {p.name}" for p in written]
    text = render_markdown(rep, root, found, paired)
    (out / "table.md").write_text(text, encoding="utf-8")
    write_csv(rep, out / "table.csv")
    write_runs_csv(rep, out / "runs.csv", root)
    write_paired_csv(found, out / "paired.csv")
    if per_budget:
        for path in plot_budget_heatmaps(entries, out):
            print(f"wrote {path}")
    if not quiet:
        print(text)
    return rep


def _entries_from_metrics(results: Iterable[dict[str, Any]]) -> list[Entry]:
    out = []
    for k, m in enumerate(results):
        run = Run(Path("."), m, {}, (0, f"{k:09d}"))  # in the order the runs were given
        e = entry_from_run(run, read=False)  # no run directory here: metrics only
        e.settings = {k: v for k, v in e.settings.items() if k in ("budget", *ALWAYS_SHOWN)}
        out.append(e)
    return out


def metrics_rows(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Scores and speed side by side, one row per metrics dict (the table `kvbench` prints after its runs)."""
    rep = build_report(_entries_from_metrics(results))
    s_head, s_body = score_table(rep, paper_style=False)
    head = [*s_head, *SPEED_HEAD]
    body = [[fmt(v) for v in [*row, *speed_cells(next(iter(r.entries.values())))]] for row, r in zip(s_body, rep.rows)]
    return head, body


def print_metrics_table(results: list[dict[str, Any]]) -> str:
    from tabulate import tabulate

    head, rows = metrics_rows(results)
    text = tabulate(rows, headers=head, tablefmt="github", disable_numparse=True)
    print(text)
    return text


def print_job_tables(jobs: Sequence[Any], metrics: Sequence[list[dict[str, Any]]]) -> None:
    """After `kvbench` ran its jobs (kvbench.run.jobs.run_planned): each job's table and its run directory."""
    for job, results in zip(jobs, metrics):
        print_metrics_table(results)
        print(f"\nrun directory: {job.run_dir}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvbench-report", description="Paper-shaped tables from kvbench runs: "
                                     "writes table.md, table.csv, runs.csv, paired.csv and plots into DIR (or --out).")
    parser.add_argument("dir", type=Path, help="a run, sweep or results directory (searched recursively)")
    parser.add_argument("--no-plots", action="store_true", help="skip the heatmap and score-vs-budget PNGs")
    parser.add_argument("-q", "--quiet", action="store_true", help="do not print the markdown")
    parser.add_argument("--paired", metavar="POLICY", default=None,
                        help="paired comparisons only against this policy (it is policy_b: diff = other - POLICY); "
                             "default: every pair of runs on the same samples")
    parser.add_argument("--out", type=Path, default=None, metavar="OUT",
                        help="write the tables and plots into OUT instead of DIR (e.g. committed runs, read-only)")
    parser.add_argument("--heatmaps-per-budget", action="store_true",
                        help="also one NIAH heatmap figure per (model, budget, block, protocol): the full cache and "
                             "every policy side by side, niah_<model>_N<budget>_B<block>_<protocol>.png")
    parser.add_argument("--design", type=Path, default=None, metavar="CSV",
                        help="test the planned comparisons of this design file (runs paths below DIR) instead: "
                             "one Holm family per model, written as OUT/tests.csv")
    args = parser.parse_args(argv)
    try:
        if args.design is not None:
            out = args.out or args.dir
            out.mkdir(parents=True, exist_ok=True)
            tests = run_design(read_design(args.design), args.dir)
            write_tests(tests, out / "tests.csv")
            if not args.quiet:
                print(f"{len(tests)} planned comparisons tested: {out / 'tests.csv'}")
            return
        report(args.dir, plots=not args.no_plots, quiet=args.quiet, paired=args.paired, out=args.out,
               per_budget=args.heatmaps_per_budget)
    except (ReportError, ValueError, OSError) as e:
        print(f"kvbench-report: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
