"""Bring run directories written by an older kvbench up to today's metrics.json, once, so the report reads every run
one way (it has no code path for older runs).

    python scripts/migrate_runs.py DIR [DIR ...]

For every metrics.json below DIR that lacks them it adds:
- `layout`: the run's task rebuilt from its config.yaml writes its layout from the run's own records, exactly as a
  run writes it today (kvbench.tasks.base.Task.layout). Before writing, the layout's recipe is checked to recompute
  the run's stored scores from its records (kvbench.metrics.aggregate), so a report merging or re-reading the run
  gets the numbers the run wrote;
- `reference`: true for the run that is the reference of a comparison (a policy that never evicts: the full cache),
  read from the run's own `applies` (budget not used).
Keys go where a run writes them; nothing else changes. A run already carrying both is left untouched; a run whose
recipe does not reproduce its scores is reported and left untouched (exit 1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from kvbench.metrics.aggregate import aggregate_scores
from kvbench.run.records import read_records
from kvbench.run.settings import build_task


def _insert_after(metrics: dict[str, Any], after: str, key: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        out[k] = v
        if k == after:
            out[key] = value
    if key not in out:
        out[key] = value
    return out


def migrate(run_dir: Path) -> str:
    """'migrated', 'current' or a one-line reason it was left alone."""
    path = run_dir / "metrics.json"
    metrics = json.loads(path.read_text(encoding="utf-8"))
    if "layout" in metrics and "reference" in metrics:
        return "current"
    if "layout" not in metrics:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        task = build_task(cfg["task"])
        records = read_records(run_dir / "predictions.jsonl", repair=False)
        layout = task.layout(records, metrics["scores"])
        again = aggregate_scores(records, layout["recipe"])
        if again != metrics["scores"]:
            return f"its task's recipe gives {again}, not the stored {metrics['scores']}"
        metrics = _insert_after(metrics, "graded", "layout", layout)
    if "reference" not in metrics:
        metrics = _insert_after(metrics, "applies", "reference", not metrics["applies"]["budget"])
    path.write_text(json.dumps(metrics, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return "migrated"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    failed = 0
    for root in map(Path, argv):
        if not root.is_dir():
            print(f"migrate_runs: error: {root} is not a directory", file=sys.stderr)
            return 2
        for mp in sorted(root.rglob("metrics.json")):
            what = migrate(mp.parent)
            failed += what not in ("migrated", "current")
            print(f"{mp.parent}: {what}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
