"""`kvbench-report DIR [--paired POLICY]`: collect the runs below DIR, build the report, write table.md / table.csv /
runs.csv / paired.csv and the plots; and the one table `kvbench` prints after its runs.
`kvbench-report DIR --design CSV`: the design's planned comparisons instead (runs paths below DIR), tested from the
records with one Holm family per model (kvbench.report.family), written as tests.csv.
The analyses of a results folder beside its tables (scripts/tables.sh): `--budget-choice MD` (a pilot's budgets:
kvbench.report.budgets), `--plan MD` (the n a pilot's planned comparisons need: kvbench.report.plan), `--claims`
(the seed papers' claims table, `--beside` another model's: kvbench.report.claims) and `--graded-validity MD`
(whether the graded score separates hits from misses in the runs below every DIR: kvbench.report.validity).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from kvbench.report import budgets, claims, plan, validity
from kvbench.report.collect import Entry, ReportError, Run, collect_entries, entry_from_run
from kvbench.report.family import read_design, run_design, write_tests
from kvbench.report.output import render_markdown, write_csv, write_runs_csv
from kvbench.report.paired import check_policy, pairs, write_paired_csv
from kvbench.report.plots import plot_budget_heatmaps, plot_heatmaps, plot_score_vs_budget
from kvbench.report.tables import (ALWAYS_SHOWN, SHARED_NOTE, SPEED_HEAD, Report, build_report, has_shared,
                                   score_table, shared_text, speed_cells)
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
    shared = has_shared(rep)
    head = [*s_head, *SPEED_HEAD, *(["shared"] if shared else [])]
    entries = [next(iter(r.entries.values())) for r in rep.rows]
    body = [[fmt(v) for v in [*row, *speed_cells(e), *([shared_text(e)] if shared else [])]]
            for row, e in zip(s_body, entries)]
    return head, body


def print_metrics_table(results: list[dict[str, Any]]) -> str:
    from tabulate import tabulate

    head, rows = metrics_rows(results)
    text = tabulate(rows, headers=head, tablefmt="github", disable_numparse=True)
    if "shared" in head:
        text += "\n\n" + SHARED_NOTE
    print(text)
    return text


def print_job_tables(jobs: Sequence[Any], metrics: Sequence[list[dict[str, Any]]]) -> None:
    """After `kvbench` ran its jobs (kvbench.run.jobs.run_planned): each job's table and its run directory."""
    for job, results in zip(jobs, metrics):
        print_metrics_table(results)
        print(f"\nrun directory: {job.run_dir}")


def _analysis(args: argparse.Namespace) -> bool:
    """Write the one analysis the options ask for (False: none, the tables are wanted)."""
    root, say = args.dir[0], (lambda text: None if args.quiet else print(text, end=""))
    if args.budget_choice is not None:
        text, table = budgets.write(root, args.budget_choice)
        if args.pick or args.most_informative:  # the budget alone, for a script to read
            chosen = budgets.pick(table) if args.pick else budgets.most_informative(table)
            if chosen is None:
                sys.exit(1)
            print(chosen)
        else:
            say(text)
    elif args.plan is not None:
        wanted = [int(x) for x in (args.budgets or "").split(",") if x.strip()]
        score = args.score or "answer_logprob"
        if not wanted or not args.compare:
            raise ValueError("--plan needs --compare and --budgets")
        rows = plan.plan(root, score, [plan.parse_comparison(c) for c in args.compare], wanted, cap=args.cap)
        text = plan.markdown(rows, score, args.cap, str(root))
        args.plan.write_text(text, encoding="utf-8")
        say(text)
    elif args.claims is not None:
        out = args.out or root
        claims.claims_table(root, args.claims[0], args.claims[1], out)
        say((out / "claims.md").read_text(encoding="utf-8"))
        if args.beside is not None:
            names = args.names or ["A", "B"]
            say(claims.side_by_side(args.beside, out / "claims.csv", (names[0], names[1]),
                                    out / "side_by_side.md"))
    elif args.graded_validity is not None:
        missing = [str(d) for d in args.dir if not d.is_dir()]
        if missing:
            raise ReportError(f"not a directory: {', '.join(missing)}")
        text = validity.markdown(validity.separations(args.dir), [str(d) for d in args.dir])
        args.graded_validity.write_text(text, encoding="utf-8")
        say(text)
    else:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvbench-report", description="Paper-shaped tables from kvbench runs: "
                                     "writes table.md, table.csv, runs.csv, paired.csv and plots into DIR (or --out).")
    parser.add_argument("dir", type=Path, nargs="+", metavar="DIR",
                        help="a run, sweep or results directory (searched recursively; several: --graded-validity)")
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
    analyses = parser.add_argument_group("analyses beside the tables (written instead of them)")
    analyses.add_argument("--budget-choice", type=Path, metavar="MD",
                          help="the budgets a pilot's runs support (the full cache >= 90, at least half the samples "
                               "tell the policies apart), written to MD")
    pick = analyses.add_mutually_exclusive_group()
    pick.add_argument("--pick", action="store_true", help="with --budget-choice: print only the one budget a final "
                      "grid runs at (the chosen budget with the most informative samples, a tie to the larger); "
                      "exit 1 when none is chosen")
    pick.add_argument("--most-informative", action="store_true",
                      help="with --budget-choice: print only the budget with the most informative samples where the "
                           "full cache scores >= 90, chosen or not (a tie to the larger); exit 1 when there is none")
    analyses.add_argument("--plan", type=Path, metavar="MD",
                          help="the samples each --compare needs at --budgets, from a pilot's runs, written to MD")
    analyses.add_argument("--compare", nargs="+", default=[], metavar="A:B", help="with --plan: pairs of policies")
    analyses.add_argument("--budgets", metavar="N,N", help="with --plan: comma-separated budgets")
    analyses.add_argument("--score", help="with --plan: the score compared (default: answer_logprob)")
    analyses.add_argument("--cap", type=int, default=None, help="with --plan: the most samples a run may have")
    analyses.add_argument("--claims", nargs=2, type=Path, metavar=("NIAH_RUNS", "RULER_RUNS"),
                          help="the seed papers' claims table of the claim runs in DIR, the NIAH grid's and the RULER "
                               "runs (- for none): OUT/claims.md, claims.csv, claims_tests.csv")
    analyses.add_argument("--beside", type=Path, metavar="CSV", help="with --claims: also OUT/side_by_side.md, "
                          "another model's claims.csv (first) beside this one's")
    analyses.add_argument("--names", nargs=2, metavar=("FIRST", "THIS"),
                          help="with --beside: the two models' names (default: A B)")
    analyses.add_argument("--graded-validity", type=Path, metavar="MD",
                          help="whether the graded score separates hits from misses, over the runs below every DIR, "
                               "written to MD")
    args = parser.parse_args(argv)
    if len(args.dir) > 1 and args.graded_validity is None:
        parser.error("more than one DIR is for --graded-validity")
    # (an option of one analysis given without it would be ignored without a word: refused instead)
    for option, of in (("pick", "budget_choice"), ("most_informative", "budget_choice"), ("compare", "plan"),
                       ("budgets", "plan"), ("score", "plan"), ("cap", "plan"), ("beside", "claims"),
                       ("names", "beside")):
        if getattr(args, option) not in (None, False, []) and getattr(args, of) is None:
            parser.error(f"--{option.replace('_', '-')} is an option of --{of.replace('_', '-')}")
    if args.cap is not None and args.cap < 1:
        parser.error(f"--cap must be a positive number of samples, got {args.cap}")
    if sum(getattr(args, a) is not None for a in ("budget_choice", "plan", "claims", "graded_validity")) > 1:
        parser.error("one analysis at a time (--budget-choice, --plan, --claims, --graded-validity)")
    try:
        if _analysis(args):
            return
        args.dir = args.dir[0]
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
