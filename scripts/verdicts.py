"""The verdicts of results/: every planned comparison of results/design.csv tested from the runs' predictions.jsonl
records, one Holm family per model (kvbench.report.family), written as results/tests.csv, results/evidence.md and
the summary block of results/README.md; no verdict sentence is typed by hand.

    python scripts/verdicts.py            write results/tests.csv, results/evidence.md, the README block and each
                                          results folder's RUN.md block (`<!-- verdicts:FOLDER:begin/end -->`)
    python scripts/verdicts.py --check    recompute every test from the records; exit 1 (and say where) when
                                          tests.csv, evidence.md or a block differs from what they give

A claim is judged on the comparisons the design marks `stated` (the claim as its text states it); `related` scores
are shown beside it and decide nothing. "A beats B, C" holds when every stated comparison is resolved for A and is
reversed when any is resolved for the rival. StreamingLLM's depth claim has two halves: "loses needles in the middle"
(a loss resolved at a depth before the last, at each budget) and "keeps those at the end", which needs a bound on
the loss at the last depth: a margin fixed before the data, which the design has not, so that half stays open.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a file: kvbench from this checkout

from kvbench.errors import error_line  # noqa: E402
from kvbench.metrics.stats import ALPHA, RESAMPLES, mc_floor  # noqa: E402
from kvbench.report.collect import ReportError  # noqa: E402
from kvbench.report.family import (TESTS_HEAD, Tested, read_design, run_design, tests_rows,  # noqa: E402
                                   write_tests)

# Each claim of the design: its text (the seed paper's claim as the claims tables word it) and what tests it as
# stated.
CLAIMS: dict[str, tuple[str, str]] = {
    "keydiff": ("KeyDiff beats TOVA, SnapKV and H2O at equal budget under block-wise prompt processing",
                "retrieval: the designed NIAH grid's 0/100 score"),
    "keydiff_ruler": ("The same claim on RULER niah_single_2", "RULER's 0/100 score, 4K and 2K"),
    "streamingllm_depth": ("StreamingLLM (sink + recent window) loses needles in the middle of the context once the "
                           "prompt exceeds the budget, and keeps those at the end",
                           "the grid's depth cells: a loss before the last depth, a bound at the last"),
    "knorm": ("Keeping the keys with the lowest L2 norm preserves retrieval better than random eviction at equal "
              "compression", "retrieval: the designed NIAH grid's 0/100 score"),
    "criticalkv_snapkv": ("CriticalKV's selection (attention x ||v W_O||) improves SnapKV at equal budget",
                          "retrieval: the designed NIAH grid's 0/100 score"),
    "criticalkv_adakv": ("CriticalKV's selection improves AdaKV (per-head budgets) at equal budget",
                         "retrieval: the designed NIAH grid's 0/100 score"),
    "sagekv": ("SAGE-KV (one attention-guided top-k selection per head group after the prompt) beats StreamingLLM "
               "at equal budget", "retrieval: the designed NIAH grid's 0/100 score"),
    "hashevict": ("HashEvict (SimHash of keys vs the query's code) beats H2O at equal budget",
                  "retrieval: the designed NIAH grid's 0/100 score"),
}
DESIGN, TESTS = ROOT / "results/design.csv", ROOT / "results/tests.csv"
EVIDENCE, README = ROOT / "results/evidence.md", ROOT / "results/README.md"
BEGIN, END = "<!-- verdicts:summary:begin -->", "<!-- verdicts:summary:end -->"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- verdicts:{name}:begin -->", f"<!-- verdicts:{name}:end -->"


def num(x: float) -> str:
    x = round(x, 6) + 0.0  # no "-0.000" for a zero turned round
    return f"{x:+.3f}" if x == 0 or abs(x) >= 0.0005 else f"{x:+.1e}"


def pval(t: Tested, q: bool = False) -> str:
    """p (or Holm p) in 2 digits; at the Monte-Carlo floor, "<= " it: a bound, not a measurement."""
    x = t.q if q else t.p
    return "-" if x is None else ("<= " if t.floor else "") + f"{x:.2g}"


def numbers(t: Tested) -> str:
    return f"{num(t.diff)} [{num(t.lo)}, {num(t.hi)}], n = {t.n}, Holm p {pval(t, True)}"


def claim_verdict(key: str, tests: list[Tested]) -> str:
    """The claim on its stated comparisons (module docstring)."""
    stated = [t for t in tests if t.plan.claim == key and t.plan.role == "stated"]
    if not stated:
        return "not run"
    if key == "streamingllm_depth":
        parts, reversed_ = [], False
        for n in sorted({t.plan.budget for t in stated}):
            at = [t for t in stated if t.plan.budget == n]
            lost = [t for t in at if t.plan.half == "loses" and t.verdict.endswith(f"{t.plan.b} higher")]
            keep = [t for t in at if t.plan.half == "keeps"]
            reversed_ |= any(t.verdict.endswith(f"{t.plan.b} higher") for t in keep)
            parts.append(f"N={n}: loss before the last depth {'resolved' if lost else 'not resolved'}; last depth "
                         + ", ".join(f"{num(t.diff)} [{num(t.lo)}, {num(t.hi)}]" for t in keep))
        head = "reversed" if reversed_ else "not resolved: \"keeps those at the end\" has no bound (no margin fixed " \
                                            "before the data)"
        return f"**{head}**; " + "; ".join(parts)
    words = [t.verdict for t in stated]
    if any(w == f"resolved: {t.plan.b} higher" for w, t in zip(words, stated)):
        head = "reversed"
    elif all(w == f"resolved: {t.plan.a} higher" for w, t in zip(words, stated)):
        head = "holds"
    else:
        head = f"not resolved ({sum(w != 'not resolved' for w in words)} of {len(stated)} resolved)"
    return f"**{head}**: " + "; ".join(f"vs {t.plan.b} N={t.plan.budget} ({t.plan.column}): "
                                        f"{t.verdict.removeprefix('resolved: ')}, {numbers(t)}" for t in stated)


def related(key: str, tests: list[Tested]) -> str:
    """The claim's related comparisons in a few words: per column, how many resolve for the claim's winner / rival."""
    out = []
    for col in dict.fromkeys(t.plan.column for t in tests if t.plan.claim == key and t.plan.role == "related"):
        rows = [t for t in tests if t.plan.claim == key and t.plan.role == "related" and t.plan.column == col]
        win = sum(t.verdict.endswith(f"{t.plan.a} higher") for t in rows)
        lose = sum(t.verdict.endswith(f"{t.plan.b} higher") for t in rows)
        out.append(f"{col}: {win} of {len(rows)} for {rows[0].plan.a}" + (f", {lose} against" if lose else ""))
    return "; ".join(out) or "-"


def families(tests: list[Tested]) -> list[str]:
    return list(dict.fromkeys(t.plan.family for t in tests))


def family_line(tests: list[Tested], fam: str, level: bool = True) -> str:
    mine = [t for t in tests if t.plan.family == fam and t.plan.role != "exploratory"]
    res = sum(t.verdict != "not resolved" for t in mine)
    return (f"{fam}: one Holm family of {len(mine)} planned comparisons, {res} resolved" + (
        f"; Holm stopped at alpha / {len(mine) - res} = {mine[0].level:.2g}, the level of the smallest resolvable "
        "differences" if level else ""))


def claims_table(tests: list[Tested]) -> list[str]:
    fams = families(tests)
    lines = ["| claim | tested as stated on | " + " | ".join(fams) + " |", "|---" * (2 + len(fams)) + "|"]
    for key, (text, how) in CLAIMS.items():
        mine = [t for t in tests if t.plan.claim == key]
        if mine:
            cells = [claim_verdict(key, [t for t in mine if t.plan.family == f]) for f in fams]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in [text, how, *cells]) + " |")
    return lines


def tests_table(tests: list[Tested]) -> list[str]:
    lines = ["| part | claim (role) | a | b | N | score | n (of planned) | test | diff [95 % CI] | p | Holm p | "
             "verdict | smallest resolvable diff |", "|---" * 13 + "|"]
    for t in tests:
        p = t.plan
        mdd = "-" if t.verdict != "not resolved" or p.role == "exploratory" else \
            "not reachable at this n" if t.mdd is None else f"{t.mdd:.3g}"
        test = t.test + (f" ({t.clusters})" if t.clusters else "")
        n = f"{t.n}" + ("" if p.n_planned in (None, t.n) else f" of {p.n_planned}")
        lines.append(f"| {p.column} | {p.claim or '-'} ({p.role}{', ' + p.half if p.half else ''}) | {p.a} | {p.b} | "
                     f"{p.budget} | {p.score} | {n} | {test} | {num(t.diff)} [{num(t.lo)}, {num(t.hi)}] | "
                     f"{pval(t)} | {pval(t, True)} | **{t.verdict}** | {mdd} |")
    return lines


def evidence(tests: list[Tested]) -> str:
    explo = [t for t in tests if t.plan.role == "exploratory"]
    lines = [
        "# The seed papers' claims, judged as stated", "",
        "Generated by `scripts/verdicts.py` from [`design.csv`](design.csv) (every planned comparison: its model, "
        "claim, role and look) and the runs' `predictions.jsonl` records; every test is in [`tests.csv`](tests.csv).",
        "", "How the verdicts are made:",
        "- One family per model: Holm's adjustment over every planned comparison of the model, all scores and all "
        f"folders together; resolved = Holm p < {ALPHA} and the 95 % interval excludes 0. "
        + "; ".join(family_line(tests, f) for f in families(tests)) + ".",
        "- Independent samples, or a test that knows they are not: the designed NIAH grid's samples are cut from "
        "windows of the essays, some overlapping (wrapped windows), and its needles repeat. Each sample is "
        "clustered by its window (windows sharing any token, joined) and by its needle, from the records' "
        "`meta.window` and `meta.needle`; those tests are the two-way cluster bootstrap (Owen's pigeonhole "
        "bootstrap: windows and needles resampled independently; p inverts its percentile interval). The other "
        "parts (RULER, code, LM score) hold one text or window per sample: exact McNemar for 0/100 scores, sign "
        "flips for graded ones (exact up to 16 samples).",
        f"- A Monte-Carlo p ({RESAMPLES:,} draws) at its floor {mc_floor():.1g} is written \"<= \": a bound, "
        "not a measurement.",
        "- One look: `n_planned` records each part's n as its script and RUN.md fixed it before the final runs, "
        "and `look` the records of the planned look; a part run past its planned n after an unresolved look is "
        "tested at the planned look, and the extended n is shown as exploratory, outside the families.",
        "- design.csv was written after the runs, from the scripts' planned comparisons: the families and the "
        "stated / related split were drawn after the data. Both only make verdicts harder to reach than the "
        "per-folder families before them.",
        "- A claim is judged on what it claims (the `stated` comparisons): every one must be resolved for the "
        "claim's winner, and a claim of two halves needs both. `related` scores (graded scores, code, the LM "
        "score) are shown beside it and decide nothing.", "",
        "## Verdicts", "", *claims_table(tests), "",
        "Related scores (resolved for the claim's winner / against it, within the family):", "",
        *(f"- {CLAIMS[k][0]}: " + " / ".join(f"{f}: {related(k, [t for t in tests if t.plan.family == f])}"
                                              for f in families(tests))
          for k in CLAIMS if any(t.plan.claim == k for t in tests)), ""]
    for fam in families(tests):
        mine = [t for t in tests if t.plan.family == fam and t.plan.role != "exploratory"]
        lines += [f"## {fam}", "", family_line(tests, fam) + ".", "", *tests_table(mine), ""]
    if explo:
        lines += ["## Exploratory: runs past the planned look (no verdict)", "",
                  "These extend a part past its planned n (`n_planned`) after its planned look was not resolved; "
                  "without a sequential design fixed before the data their p is not corrected for the extra look, "
                  "so they decide nothing.", "", *tests_table(explo), ""]
    return "\n".join(lines)


def summary(tests: list[Tested]) -> str:
    return "\n".join([
        "Generated by `scripts/verdicts.py` (the full tables and the method: [evidence.md](evidence.md)). "
        + "; ".join(family_line(tests, f, level=False) for f in families(tests)) + ".", "",
        "| claim | " + " | ".join(families(tests)) + " |", "|---" * (1 + len(families(tests))) + "|",
        *("| " + " | ".join([CLAIMS[k][0].replace("|", "\\|"),
                             *(re.sub(r"\*\*(.*?)\*\*.*", r"\1", claim_verdict(k, [t for t in tests
                                                                                   if t.plan.family == f]))
                               for f in families(tests))]) + " |"
          for k in CLAIMS if any(t.plan.claim == k for t in tests))]) + "\n"


def folder_block(tests: list[Tested], folder: str) -> str:
    """A results folder's planned comparisons (its RUN.md's block), each with its model's Holm p."""
    mine = [t for t in tests if t.plan.runs.split("/")[0] == folder]
    fams = dict.fromkeys(t.plan.family for t in mine)
    return "\n".join([f"Generated by `scripts/verdicts.py` from this folder's records: its planned comparisons, each "
                      f"within its model's family (" + "; ".join(family_line(tests, f) for f in fams)
                      + "); the claims' verdicts: [../evidence.md](../evidence.md).", "", *tests_table(mine)]) + "\n"


def with_block(text: str, name: str, block: str) -> str:
    begin, end = markers(name)
    if begin not in text or end not in text:
        raise ValueError(f"no {begin} ... {end} block")
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n{block}{end}{rest.split(end, 1)[1]}"


def readme_with(text: str, block: str) -> str:
    return with_block(text, "summary", block)


def run_files(results: Path) -> dict[Path, str]:
    """The results folders' RUN.md files that hold a verdicts block, and the folder each names."""
    out = {}
    for path in sorted(results.glob("*/RUN.md")):
        m = re.search(r"<!-- verdicts:(\S+):begin -->", path.read_text(encoding="utf-8"))
        if m:
            out[path] = m.group(1)
    return out


def csv_text(tests: list[Tested]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(TESTS_HEAD)
    w.writerows(tests_rows(tests))
    return buf.getvalue()


def check(tests: list[Tested], tests_csv: Path, evidence_md: Path, readme: Path) -> list[str]:
    """Where the committed files differ from what the records give: each differing tests.csv row, then the prose."""
    errors = []
    want = csv_text(tests).splitlines()
    have = tests_csv.read_text(encoding="utf-8").splitlines() if tests_csv.is_file() else []
    for k in range(max(len(want), len(have))):
        w, h = (want[k] if k < len(want) else "(none)"), (have[k] if k < len(have) else "(none)")
        if w != h:
            errors.append(f"{tests_csv.name} line {k + 1}: committed {h}; the records give {w}")
    if not evidence_md.is_file() or evidence_md.read_text(encoding="utf-8") != evidence(tests):
        errors.append(f"{evidence_md.name}: differs from what the records give")
    text = readme.read_text(encoding="utf-8")
    if BEGIN not in text or readme_with(text, summary(tests)) != text:
        errors.append(f"{readme.name}: the verdicts block differs from what the records give")
    for path, folder in run_files(readme.parent).items():
        text = path.read_text(encoding="utf-8")
        if with_block(text, folder, folder_block(tests, folder)) != text:
            errors.append(f"{path.parent.name}/{path.name}: the verdicts block differs from what the records give")
    return errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="recompute and compare instead of writing")
    p.add_argument("--design", type=Path, default=DESIGN, help="the planned comparisons (default results/design.csv)")
    p.add_argument("--results", type=Path, default=ROOT / "results",
                   help="the folder the design's runs paths start from, and where tests.csv, evidence.md and "
                        "README.md are (default results/)")
    a = p.parse_args(argv)
    out = a.results
    try:
        tests = run_design(read_design(a.design), a.results)
    except (ValueError, ReportError, OSError) as e:
        print(f"verdicts.py: error: {error_line(e)}", file=sys.stderr)
        return 2
    if a.check:
        errors = check(tests, out / "tests.csv", out / "evidence.md", out / "README.md")
        print("\n".join(errors) or f"verdicts: all {len(tests)} tests, evidence.md and every verdicts block as the "
              "records give")
        return 1 if errors else 0
    write_tests(tests, out / "tests.csv")
    (out / "evidence.md").write_text(evidence(tests), encoding="utf-8")
    readme = out / "README.md"
    try:
        readme.write_text(readme_with(readme.read_text(encoding="utf-8"), summary(tests)), encoding="utf-8")
        for path, folder in run_files(out).items():
            path.write_text(with_block(path.read_text(encoding="utf-8"), folder, folder_block(tests, folder)),
                            encoding="utf-8")
    except (ValueError, OSError) as e:
        print(f"verdicts.py: error: {error_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
