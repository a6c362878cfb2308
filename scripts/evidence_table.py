"""Each seed paper's claim with every score that tests it, side by side: the NIAH / RULER verdicts of the claims
tables (SmolLM2 and Qwen2.5-Coder-1.5B) and the planned comparisons of the evidence runs (the real-code task's graded
score, the LM score on real code) that put the same "A beats B" to the test.

    python scripts/evidence_table.py --claims results/claims/claims.csv \
        --claims results/qwen2.5-coder-1.5b/claims.csv --names SmolLM2-135M Qwen2.5-Coder-1.5B \
        --tests results/evidence_code/tests.csv results/evidence_lm/tests.csv \
        --test-names "real code (SmolLM2)" "LM score on code (SmolLM2)" --out results/evidence.md

Every cell is generated: a claims table's cell is its own verdict words (scripts/claims_table.py: "holds",
"reversed", "not resolved (n = ...)", graded score after the semicolon); an evidence cell reads the claim's winner
against each rival in that folder's tests.csv (scripts/power_plan.py --tests: Holm over that folder's planned
comparisons), "A higher" or "not resolved" with the difference, its interval and n, and "not run" for a rival the
folder has no comparison for. A claim is "holds" on a score when every rival it names was run and resolved below the
winner, "reversed" when any was resolved above it, otherwise not resolved. StreamingLLM's depth claim is no "A beats
B": it reads StreamingLLM against the full cache at each needle depth of a NIAH grid (rows whose score is a depth cell,
L<length>_D<depth>, from power_plan.py --tests --score L2000_D10,...): at a budget it holds when a needle before the
last depth is lost (the full cache resolved higher) and no loss is resolved at the last depth, and it is reversed
when a loss is resolved at the last depth; the claim holds on the score when it holds at every budget run.

A claim the claims table puts on RULER (its text ends with "(RULER)") reads only the columns `--ruler` names (the
designed RULER runs' tests), and those columns serve no other claim: the same "KeyDiff beats TOVA" on NIAH and on
RULER are two claims, each with its own benchmark's evidence.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a file: its sibling scripts
from claims_side_by_side import verdict  # noqa: E402  (a claims.csv cell's verdict words)
from power_plan import signed  # noqa: E402  (the tests.md numbers, written the same way here)

RULER = "(RULER)"  # how claims_table.py marks the claim it tests on RULER

DEPTH_CELL = re.compile(r"L\d+_D(\d+(?:\.\d+)?)")  # a NIAH grid's depth cell score: L<length>_D<depth %>

# Each claim's winner and the rivals it names, by the first words of its text in claims.csv (None: StreamingLLM's depth
# claim, read by depth_cell).
CLAIMS: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("KeyDiff beats TOVA, SnapKV and H2O", "keydiff", ("tova", "snapkv", "h2o")),
    ("StreamingLLM (sink + recent window) loses needles", None, ()),
    ("Keeping the keys with the lowest L2 norm", "knorm", ("random",)),
    ("CriticalKV's selection (attention", "criticalkv", ("snapkv",)),
    ("CriticalKV's selection improves AdaKV", "criticalkv", ("adakv",)),
    ("SAGE-KV", "sagekv", ("streamingllm",)),
    ("HashEvict", "hashevict", ("h2o",)),
)


def claim_key(text: str) -> tuple[str, str | None, tuple[str, ...]] | None:
    return next((c for c in CLAIMS if text.startswith(c[0])), None)


def table_verdict(row: dict[str, str]) -> str:
    """A claims.csv row's verdict words on the 0/100 score and on the graded score ("holds; graded: reversed")."""
    return f"{verdict(row.get('holds?', ''))}; graded: {verdict(row.get('graded score', ''))}"


def oriented(row: dict[str, str], first: str) -> tuple[float, float, float, int]:
    """A tests.csv row's diff and 95 % interval as `first` minus the other policy of the row, and the sign of a
    resolved difference (0: not resolved)."""
    flip = 1 if row["a"] == first else -1
    diff, lo, hi = (flip * float(row[k]) for k in ("diff", "ci_low", "ci_high"))
    sign = (1 if diff > 0 else -1) if row["verdict"].startswith("resolved") else 0
    return diff, min(lo, hi), max(lo, hi), sign


def numbers(row: dict[str, str], diff: float, lo: float, hi: float) -> str:
    """The row's difference, interval, n and Holm p, as the evidence cells write them."""
    return f"{signed(diff)} [{signed(lo)}, {signed(hi)}], n = {row['n']}, Holm p = {float(row['p_holm']):.2g}"


def evidence_cell(winner: str, rivals: tuple[str, ...], tests: list[dict[str, str]]) -> str:
    """The claim on one folder's planned tests: its verdict, then each rival's comparison (one per budget the folder
    compared them at; the claim holds only where every one is resolved for the winner)."""
    parts, signs = [], []
    for rival in rivals:
        rows = [r for r in tests if {r["a"], r["b"]} == {winner, rival} and r["p"]]
        if not rows:
            parts.append(f"vs {rival}: not run")
            signs.append(None)
        for row in rows:
            diff, lo, hi, sign = oriented(row, winner)  # winner - rival
            signs.append(sign)
            word = f"{winner if diff > 0 else rival} higher" if sign else "not resolved"
            parts.append(f"vs {rival} (N={row['budget']}): {word}, {numbers(row, diff, lo, hi)}")
    if all(s is None for s in signs):
        return "not run"
    if any(s == -1 for s in signs):
        verdict = "reversed"
    elif all(s == 1 for s in signs):
        verdict = "holds"
    elif None in signs and all(s in (1, None) for s in signs):
        verdict = "holds where run"
    else:
        verdict = "not resolved"
    return f"**{verdict}**: " + "; ".join(parts)


def depth_cell(tests: list[dict[str, str]]) -> str:
    """StreamingLLM's depth claim on one folder's tests: per budget, StreamingLLM - full cache at each needle depth;
    holds at a budget when an earlier depth is lost (full higher, resolved) and the last depth's loss is not resolved,
    reversed when the last depth's loss is resolved; "not run" without depth rows."""
    by_budget: dict[str, list[tuple[float, dict[str, str]]]] = {}
    for r in tests:
        m = DEPTH_CELL.fullmatch(r.get("score", ""))
        if m and {r["a"], r["b"]} == {"streamingllm", "full"} and r["p"]:
            by_budget.setdefault(r["budget"], []).append((float(m.group(1)), r))
    if not by_budget:
        return "not run"
    parts, signs = [], []
    for budget, rows in sorted(by_budget.items(), key=lambda kv: int(kv[0])):
        cells, lost = [], []
        for depth, r in sorted(rows, key=lambda dr: dr[0]):
            diff, lo, hi, sign = oriented(r, "streamingllm")  # streamingllm - full
            lost.append(sign < 0)
            word = "lost" if sign < 0 else "StreamingLLM higher" if sign > 0 else "no loss resolved"
            cells.append(f"depth {depth:g} %: {word}, {numbers(r, diff, lo, hi)}")
        signs.append(-1 if lost[-1] else 1 if any(lost[:-1]) else 0)
        parts.append(f"N={budget}: " + "; ".join(cells))
    verdict = "reversed" if -1 in signs else "holds" if all(x == 1 for x in signs) else "not resolved"
    return f"**{verdict}** (streamingllm - full): " + " / ".join(parts)


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def build(claims: list[list[dict[str, str]]], names: list[str], tests: list[list[dict[str, str]]],
          test_names: list[str], ruler: frozenset[int] = frozenset()) -> str:
    """The table; `ruler`: the indices of `tests` that are RULER runs' (they serve only the RULER claims)."""
    lines = ["# The seed papers' claims on every score that tests them", "",
             "Generated by `scripts/evidence_table.py`. NIAH / RULER columns: the claims tables' verdicts (0/100 score; "
             "graded score), Holm over each claims table. Evidence columns: the claim's winner against each rival it "
             "names in that folder's planned comparisons (the 0/100 score in points, or the graded score or LM score in "
             "nats per token, as the column says; diff = winner - rival with its 95 % paired interval; Holm over that "
             "folder's planned comparisons on that score; a column joining two folders keeps each row's own folder's). "
             "\"holds where run\": every comparison run is resolved for "
             "the winner but a named rival was not run. A claim on RULER reads the RULER columns only, and they serve "
             "no other claim (\"-\"). StreamingLLM's depth claim: StreamingLLM - full cache at each needle depth "
             "(0/100 points), per budget; it holds where a needle before the last depth is lost (resolved) and no "
             "loss is resolved at the last depth.", "",
             "| claim | " + " | ".join(f"NIAH / RULER, {n}" for n in names) + " | " + " | ".join(test_names) + " |",
             "|---" * (1 + len(names) + len(test_names)) + "|"]
    by_model = [{r["claim"]: r for r in rows} for rows in claims]
    order = list(dict.fromkeys(r["claim"] for rows in claims for r in rows))
    for text in order:
        key = claim_key(text)
        cells = [table_verdict(m[text]) if text in m else "not run" for m in by_model]
        if key is None:
            ev = ["-" for _ in tests]
        elif key[1] is None:  # StreamingLLM's depth claim
            ev = [depth_cell(t) if i not in ruler else "-" for i, t in enumerate(tests)]
        else:
            on_ruler = text.rstrip().endswith(RULER)
            ev = [evidence_cell(key[1], key[2], t) if (i in ruler) == on_ruler else "-" for i, t in enumerate(tests)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in [text, *cells, *ev]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--claims", type=Path, action="append", required=True, help="a claims.csv (one per model)")
    p.add_argument("--names", nargs="+", required=True, help="the models of --claims, in order")
    p.add_argument("--tests", nargs="+", required=True,
                   help="evidence folders' tests.csv; A.csv+B.csv joins two folders' tests in one column (e.g. the "
                        "designed grid's and K-norm's runs on that grid), each row keeping its own folder's Holm p")
    p.add_argument("--test-names", nargs="+", required=True, help="column names of --tests, in order")
    p.add_argument("--ruler", type=int, nargs="+", default=[], metavar="K",
                   help="the --tests columns (1 = the first) that hold RULER runs' tests: they serve only the claims "
                        "on RULER, which read no other column")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if len(a.names) != len(a.claims) or len(a.test_names) != len(a.tests):
        print("evidence_table.py: error: give one name per --claims file and one per --tests file", file=sys.stderr)
        return 2
    if any(not 1 <= k <= len(a.tests) for k in a.ruler):
        print(f"evidence_table.py: error: --ruler takes column numbers 1..{len(a.tests)}", file=sys.stderr)
        return 2
    columns = [[Path(f) for f in spec.split("+")] for spec in a.tests]
    missing = next((f for f in [*a.claims, *(f for c in columns for f in c)] if not f.is_file()), None)
    if missing is not None:
        print(f"evidence_table.py: error: {missing} does not exist", file=sys.stderr)
        return 2
    tests = []
    for spec, files in zip(a.tests, columns):
        rows = [r for f in files for r in read_csv(f)]
        pairs = [(frozenset((r["a"], r["b"])), r["budget"], r.get("score")) for r in rows]
        if len(set(pairs)) != len(pairs):
            print(f"evidence_table.py: error: {spec}: the joined files hold the same comparison twice", file=sys.stderr)
            return 2
        tests.append(rows)
    text = build([read_csv(f) for f in a.claims], a.names, tests, a.test_names, frozenset(k - 1 for k in a.ruler))
    a.out.write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
