"""Each seed paper's claim on two models side by side: the verdicts of two claims tables (scripts/claims_table.py's
claims.csv) and whether the models agree, disagree, or neither resolves the claim.

    python scripts/claims_side_by_side.py results/claims/claims.csv results/qwen2.5-coder-1.5b/claims.csv \
        --names SmolLM2-135M Qwen2.5-Coder-1.5B --out results/qwen2.5-coder-1.5b/side_by_side.md

Claims are matched by their text. Two verdicts per model: on the 0/100 score ("holds?") and on the graded score
(the paired test on answer_logprob; the first words of its column). A verdict is *resolved* when it is "holds" or
"reversed" (a paired test that excludes 0 at p < 0.05), or for threshold claims "holds" / "does not hold";
"not resolved", "mixed", "no paired runs found" and "not run" are not. Per score: both resolved the same way =
"agree", resolved opposite ways = "disagree", one resolved = "only <model>", neither = "neither resolves it".
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

RESOLVED = {"holds": 1, "reversed": -1, "does not hold": -1}


def verdict(text: str) -> str:
    """The verdict words of a claims.csv cell: "holds: N=512 vs ..." -> "holds"; "-" or "" -> "not run"."""
    text = (text or "").strip()
    if text in ("", "-"):
        return "not run"
    return text.split(":", 1)[0].strip()


def compare(a: str, b: str, names: tuple[str, str]) -> str:
    va, vb = RESOLVED.get(a.split(" (")[0]), RESOLVED.get(b.split(" (")[0])
    if a == b == "not run":
        return "not run"
    if "not run" in (a, b):
        return f"not run on {names[0] if a == 'not run' else names[1]}"
    if va is not None and vb is not None:
        return "agree" if va == vb else "disagree"
    if va is not None or vb is not None:
        return f"only {names[0] if va is not None else names[1]} resolves it"
    return "neither resolves it"


def read(path: Path) -> dict[str, dict[str, str]]:
    with path.open(encoding="utf-8") as f:
        return {r["claim"]: r for r in csv.DictReader(f)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="claims.csv of the first model")
    p.add_argument("b", type=Path, help="claims.csv of the second model")
    p.add_argument("--names", nargs=2, default=["A", "B"], help="the two models' names for the table")
    p.add_argument("--out", type=Path, required=True, help="markdown file to write")
    args = p.parse_args(argv)
    for path in (args.a, args.b):
        if not path.is_file():
            print(f"claims_side_by_side: error: no claims table at {path} (run scripts/claims_table.py)",
                  file=sys.stderr)
            return 2
    a, b = read(args.a), read(args.b)
    names = (args.names[0], args.names[1])
    head = ["claim", f"{names[0]}: 0/100", f"{names[0]}: graded", f"{names[1]}: 0/100", f"{names[1]}: graded",
            "0/100 score", "graded score"]
    lines = [f"# The seed papers' claims on {names[0]} and {names[1]}", "",
             f"Verdicts from `{args.a}` and `{args.b}` (scripts/claims_table.py: paired tests at equal budget; "
             "holds / reversed = resolved for / against the claim; the settings, n and numbers are in those "
             "tables). The last two columns compare the two models' verdicts on each score.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for claim in [c for c in a if c in b] + [c for c in b if c not in a] + [c for c in a if c not in b]:
        ra, rb = a.get(claim, {}), b.get(claim, {})
        ha, hb = verdict(ra.get("holds?", "")), verdict(rb.get("holds?", ""))
        ga, gb = verdict(ra.get("graded score", "")), verdict(rb.get("graded score", ""))
        row = [claim, ha, ga, hb, gb, compare(ha, hb, names), compare(ga, gb, names)]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
