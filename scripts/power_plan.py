"""Planned comparisons (policy a vs policy b at a budget, on one score), before and after the evidence runs.

Plan (default), from a pilot: each comparison's paired difference and the samples it needs to be resolved with 80 %
power at the Holm-corrected level of its family (alpha / m, the first and strictest Holm step: n that passes it
passes every step). `--tests`, on the final runs: each comparison's paired test with its Holm-adjusted p over the
family and the verdict (resolved: the 95 % interval excludes 0 and the Holm p < alpha), or, unresolved, the smallest
difference the run's n resolves. Both write a markdown table with the sentence each row supports, all generated from
the tests.

    python scripts/power_plan.py RUNS --out plan.md --score answer_logprob \\
        --compare knorm:random streamingllm:full knorm:full --budgets 256,512 [--cap 400] [--tests]

RUNS: a pilot's run directories (kvbench-report reads them); each comparison a:b names two policies whose runs pair
(the full cache pairs at every budget where its runs are budget-free). m = the number of planned comparisons
(comparisons x budgets). The pilot's samples must not be reused by the final runs (scripts/pilot_evidence.sh).

`--tests --score S1,S2,...`: the comparisons on each of several scores (e.g. a NIAH grid's depth cells, L2000_D10,
L2000_D50, L2000_D90: where in the context a policy loses the needle), one Holm family over all of them; the table and
the CSV name each row's score.

A comparison may name its own runs and budget, `DIR/a:b@N`: the runs under RUNS/DIR only (where one claim's runs sit
apart from another's, e.g. H2O with HashEvict's protected tokens beside the default H2O), at budget N only
(--budgets is then not needed for it). Holm's family is still every comparison of the command.
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kvbench.errors import error_line
from kvbench.metrics.stats import ALPHA, POWER, holm, min_detectable_diff, required_n
from kvbench.report.collect import ReportError, collect_entries
from kvbench.report.paired import pairs
from kvbench.report.tables import build_report
from kvbench.run.labels import NA


def _budget(row: Any) -> Any:
    return None if row.budget is NA else row.budget


@dataclass(frozen=True)
class Comparison:
    """One planned comparison: policy a against policy b, over the runs under RUNS/sub (sub "" = all of RUNS), at
    `budgets` (None: the command's --budgets)."""

    a: str
    b: str
    sub: str = ""
    budgets: tuple[int, ...] | None = None


def parse_comparison(spec: str) -> Comparison:
    """`[DIR/]a:b[@N]` -> Comparison; ValueError with the spec for anything else."""
    sub, _, rest = spec.rpartition("/")
    rest, at, budget = rest.partition("@")
    pair = rest.split(":")
    if len(pair) != 2 or not all(pair) or (at and not budget.isdigit()):
        raise ValueError(f"--compare takes [DIR/]a:b[@N] (policy names, N a budget), got {spec!r}")
    return Comparison(pair[0], pair[1], sub, (int(budget),) if at else None)


def plan(runs: Path, score: str, comparisons: Sequence[Comparison], budgets: Sequence[int],
         alpha: float = ALPHA, power: float = POWER, cap: int | None = None) -> list[dict[str, Any]]:
    """One dict per (comparison, budget): the pilot's n, difference, p, and the n needed at alpha / m."""
    cells = [(c, n) for c in comparisons for n in (c.budgets if c.budgets is not None else budgets)]
    found: dict[str, list[Any]] = {}  # sub -> its paired tests on `score` (each sub's runs read once)
    m = len(cells)
    out = []
    for c, n_budget in cells:
        if c.sub not in found:
            entries, notes = collect_entries(runs / c.sub)  # (runs / "" is runs)
            found[c.sub] = [p for p in pairs(build_report(entries, notes)) if p.score == score]
        a, b = c.a, c.b
        match = [p for p in found[c.sub]
                 for x, y, rx, ry in ((p.a, p.b, p.row_a, p.row_b), (p.b, p.a, p.row_b, p.row_a))
                 if x.policy == a and y.policy == b and _budget(rx) in (n_budget, None)
                 and _budget(ry) in (n_budget, None) and n_budget in (_budget(rx), _budget(ry))]
        row: dict[str, Any] = {"a": a, "b": b, "budget": n_budget, "m": m}
        if not match:
            row["note"] = "no paired runs"
            out.append(row)
            continue
        if len(match) > 1:  # e.g. two H2O runs of other options at one budget: which one the claim means is not ours
            raise ValueError(f"{c.sub + '/' if c.sub else ''}{a}:{b}@{n_budget} matches {len(match)} pairs of runs "
                             "(runs of these policies with other options); give each its own folder: DIR/a:b@N")
        p = match[0]
        sign = 1 if p.a.policy == a else -1  # diff = a - b
        r = p.result
        need = required_n(r, alpha=alpha / m, power=power)
        lo, hi = (r.ci_low, r.ci_high) if sign > 0 else (-r.ci_high, -r.ci_low)
        row.update(n=r.n, diff=sign * r.diff, lo=lo, hi=hi, p=r.p_value, need=need, mdd=min_detectable_diff(r),
                   plan=None if need is None else (min(need, cap) if cap else need))
        out.append(row)
    return out


def sentence(row: dict[str, Any], score: str, cap: int | None) -> str:
    """What the pilot says about the row's final n (generated, never typed by hand)."""
    if "note" in row:
        return row["note"]
    if row["need"] is None:
        return ("the pilot shows no difference: no n resolves it; the final run reports the smallest difference its n "
                "resolves")
    if cap is not None and row["need"] > cap:
        return (f"needs {row['need']} samples, more than the cap of {cap}: the final run at {cap} reports the "
                f"smallest difference it resolves instead")
    return f"{row['need']} samples resolve the pilot's difference at alpha {ALPHA}/{row['m']} with 80 % power"


def markdown(rows: list[dict[str, Any]], score: str, cap: int | None, source: str) -> str:
    lines = [f"# Sample sizes from the pilot ({score})", "",
             f"From `{source}`: each planned comparison's paired difference in the pilot (diff = a - b), and the "
             f"samples it needs to be resolved with 80 % power at alpha {ALPHA} / m (Holm's strictest step, m = "
             f"{rows[0]['m'] if rows else 0} planned comparisons). Generated by `scripts/power_plan.py`.", "",
             "| a | b | N | pilot n | diff | p | n needed | what it says |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['a']} | {r['b']} | {r['budget']} | - | - | - | - | {r['note']} |")
            continue
        lines.append(f"| {r['a']} | {r['b']} | {r['budget']} | {r['n']} | {r['diff']:+.3f} | {r['p']:.2g} | "
                     f"{'-' if r['need'] is None else r['need']} | {sentence(r, score, cap)} |")
    planned = [r["plan"] for r in rows if r.get("plan") is not None]
    if planned:
        lines += ["", f"Final n per run: {max(planned)} (the largest row{' within the cap' if cap else ''})."]
    return "\n".join(lines) + "\n"


def with_holm(rows: list[dict[str, Any]], alpha: float = ALPHA) -> list[dict[str, Any]]:
    """The rows with `holm` (Holm-adjusted p over the rows that have a test) and `verdict`."""
    tested = [r for r in rows if "p" in r]
    for r, adjusted in zip(tested, holm([r["p"] for r in tested])):
        r["holm"] = adjusted
        excludes = r["lo"] > 0 or r["hi"] < 0
        r["verdict"] = (f"resolved: {r['a'] if r['diff'] > 0 else r['b']} higher" if adjusted < alpha and excludes
                        else "not resolved")
    return rows


def signed(x: float) -> str:
    """A difference or bound to 3 decimals with its sign; a zero (to 1e-6) is +0.000, never -0.000 (a zero difference
    turned round); a tiny negative keeps its minus (an interval that reaches below 0)."""
    return f"{round(x, 6) + 0.0:+.3f}"


def tests_markdown(rows: list[dict[str, Any]], score: str, source: str) -> str:
    m = sum(1 for r in rows if "p" in r)
    several = len({r.get("score", score) for r in rows}) > 1  # a family over several scores: each row names its own
    score_head, score_rule = ("score | ", "---|") if several else ("", "")
    lines = [f"# Planned comparisons ({score})", "",
             f"From `{source}`: each planned comparison's paired test (diff = a - b over the samples both runs hold, "
             f"95 % paired bootstrap interval, p of kvbench-report's paired test) and its Holm-adjusted p over the "
             f"{m} comparisons of this table; resolved = the interval excludes 0 and the Holm p < {ALPHA}. For an "
             "unresolved comparison, the smallest difference its n resolves (80 % power). Generated by "
             "`scripts/power_plan.py --tests`.", "",
             f"| a | b | N | {score_head}n | diff [95 % CI] | p | Holm p | verdict | smallest resolvable diff |",
             f"|---|---|---|{score_rule}---|---|---|---|---|---|"]
    for r in rows:
        cell = f"{r.get('score', score)} | " if several else ""
        if "p" not in r:
            lines.append(f"| {r['a']} | {r['b']} | {r['budget']} | {cell}- | - | - | - | {r['note']} | - |")
            continue
        mdd = "-" if r["verdict"] != "not resolved" else ("undefined" if r["mdd"] is None else f"{r['mdd']:.3f}")
        diff, lo, hi = (signed(r[k]) for k in ("diff", "lo", "hi"))
        lines.append(f"| {r['a']} | {r['b']} | {r['budget']} | {cell}{r['n']} | {diff} [{lo}, {hi}] | "
                     f"{r['p']:.2g} | {r['holm']:.2g} | **{r['verdict']}** | {mdd} |")
    return "\n".join(lines) + "\n"


TESTS_CSV = ["a", "b", "budget", "score", "n", "diff", "ci_low", "ci_high", "p", "p_holm", "verdict"]


def write_tests_csv(rows: list[dict[str, Any]], score: str, path: Path) -> None:
    """with_holm's rows as CSV, one per planned comparison (untested ones: empty numbers, the note as verdict)."""
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(TESTS_CSV)
        for r in rows:
            if "p" not in r:
                w.writerow([r["a"], r["b"], r["budget"], r.get("score", score), "", "", "", "", "", "", r["note"]])
                continue
            w.writerow([r["a"], r["b"], r["budget"], r.get("score", score), r["n"], f"{r['diff']:.6f}",
                        f"{r['lo']:.6f}", f"{r['hi']:.6f}", f"{r['p']:.6g}", f"{r['holm']:.6g}", r["verdict"]])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--score", default="answer_logprob",
                    help="the score compared; with --tests several, comma-separated, are one Holm family")
    ap.add_argument("--compare", nargs="+", required=True,
                    help="a:b pairs of policies, each optionally DIR/a:b@N (its runs under RUNS/DIR, budget N)")
    ap.add_argument("--budgets", default="", help="comma-separated budgets N (for comparisons without @N)")
    ap.add_argument("--cap", type=int, default=None, help="the most samples a run may have (the source's size)")
    ap.add_argument("--tests", action="store_true", help="the final runs' Holm-corrected verdicts instead of a plan")
    ap.add_argument("--csv", type=Path, default=None,
                    help="with --tests: also the rows as CSV (a, b, budget, n, diff, ci, p, Holm p, verdict), which "
                         "scripts/evidence_table.py reads")
    a = ap.parse_args(argv)
    try:
        comparisons = [parse_comparison(c) for c in a.compare]
        budgets = [int(x) for x in a.budgets.split(",") if x.strip()]
        if not budgets and any(c.budgets is None for c in comparisons):
            raise ValueError("give --budgets, or a budget @N with every comparison")
        scores = [x.strip() for x in a.score.split(",") if x.strip()]
        if len(scores) > 1 and not a.tests:
            raise ValueError("several scores (--score S1,S2,...) are one family of final tests: give --tests")
        rows = [{**r, "score": sc} for sc in scores for r in plan(a.runs, sc, comparisons, budgets, cap=a.cap)]
    except (ValueError, ReportError, OSError) as e:
        print(f"power_plan.py: error: {error_line(e)}", file=sys.stderr)
        return 2
    text = (tests_markdown(with_holm(rows), a.score, str(a.runs)) if a.tests
            else markdown(rows, a.score, a.cap, str(a.runs)))
    a.out.write_text(text, encoding="utf-8")
    if a.tests and a.csv:
        write_tests_csv(rows, a.score, a.csv)
    print(a.out.read_text(encoding="utf-8"), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
