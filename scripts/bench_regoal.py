"""Rewrite a `kvbench-bench` engine or batch table's goal lines from its rows with today's rules
(kvbench/bench/goals.py, kvbench/bench/batch.py): the JSON's "goals" and the markdown's "## Goals" section (the
header, command and table stay as the run wrote them). For a table written before a goal line was added (the decoding
lines' HOLM family line, the batch lines' ceiling with free decoding); RUN.md says when it was used.

    python scripts/bench_regoal.py results/bench_smollm2/engine_4k_rounds8.json [--markdown PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvbench.bench.batch import batch_goal_lines
from kvbench.bench.goals import goal_lines, goals, goals_markdown


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path, help="a kvbench-bench engine or batch table's JSON (rows and goals)")
    ap.add_argument("--markdown", type=Path, help="its markdown (default: the JSON's path with .md)")
    a = ap.parse_args(argv)
    md = a.markdown or a.json.with_suffix(".md")
    try:
        data = json.loads(a.json.read_text(encoding="utf-8"))
        text = md.read_text(encoding="utf-8")
        rows = data["rows"]
        head = text.split("\n## Goals\n")[0].rstrip("\n")
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"bench_regoal: cannot read {a.json} and {md} as a bench engine table: {e}", file=sys.stderr)
        return 2
    if rows and all("workload" in r for r in rows):  # a batch table (--batch): its goals are the lines themselves
        results: list = batch_goal_lines(rows)
        lines = results
    else:
        results = goals(rows)
        lines = goal_lines(results)
    a.json.write_text(json.dumps({**data, "goals": results}, indent=1) + "\n", encoding="utf-8")
    md.write_text(head + "\n" + goals_markdown(lines), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
