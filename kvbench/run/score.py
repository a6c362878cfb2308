"""kvbench-score: rescore a directory of official-format LongBench predictions, as LongBench's eval.py does.

    kvbench-score PRED_DIR [--longbench-e] [--fuzz-backend difflib|levenshtein]

PRED_DIR holds `<dataset>.jsonl` files whose lines carry `pred`, `answers`, `all_classes` and `length` (what the
official pred.py writes, and what the longbench task's finalize writes into `<run_dir>/longbench_pred/`). Writes
PRED_DIR/result.json with eval.py's keys and numbers ({dataset: score}, or {dataset: {bucket: score}} with
--longbench-e; indent 4, non-ASCII kept) and prints a table with the labelled averages.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from kvbench.metrics import longbench as lbm
from kvbench.tasks.base import TaskError, parse_jsonl


class ScoreError(ValueError):
    """Bad prediction directory; printed as one line."""


def read_pred_dir(pred_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """{dataset: rows} for every `*.jsonl` file in `pred_dir` (eval.py reads every file ending in "jsonl")."""
    if not pred_dir.is_dir():
        raise ScoreError(f"prediction directory not found: {pred_dir}")
    files = sorted(p for p in pred_dir.iterdir() if p.is_file() and p.name.endswith("jsonl"))
    if not files:
        raise ScoreError(f"no <dataset>.jsonl files in {pred_dir}")
    out: dict[str, list[dict[str, Any]]] = {}
    for p in files:
        dataset = p.name.split(".")[0]
        if dataset not in lbm.DATASET2METRIC:
            raise ScoreError(f"{p}: '{dataset}' is not a LongBench dataset; expected files named "
                             f"<dataset>.jsonl with dataset one of: {', '.join(lbm.DATASET2METRIC)}")
        try:
            rows = parse_jsonl(p.read_bytes(), str(p))  # the one jsonl reader (lines split on "\n", as eval.py)
        except TaskError as e:
            raise ScoreError(str(e)) from None
        for i, row in enumerate(rows, 1):
            for key in ("pred", "answers", "all_classes"):
                if key not in row:
                    raise ScoreError(f"{p}:{i}: missing '{key}' (need pred, answers, all_classes, length)")
        if not rows:
            raise ScoreError(f"{p}: no predictions")
        out[dataset] = rows
    order = list(lbm.DATASET2METRIC)
    return {d: out[d] for d in sorted(out, key=order.index)}


def score_pred_dir(pred_dir: Path, longbench_e: bool = False, fuzz_backend: str = "difflib") -> dict[str, Any]:
    """eval.py's result dict for a prediction directory."""
    scores: dict[str, Any] = {}
    for dataset, rows in read_pred_dir(pred_dir).items():
        preds = [r["pred"] for r in rows]
        answers = [r["answers"] for r in rows]
        all_classes = rows[-1]["all_classes"]
        if longbench_e:
            missing = [i for i, r in enumerate(rows, 1) if "length" not in r]
            if missing:
                raise ScoreError(f"{pred_dir / (dataset + '.jsonl')}:{missing[0]}: missing 'length' "
                                 f"(needed for the LongBench-E buckets)")
            scores[dataset] = lbm.scorer_e(dataset, preds, answers, [r["length"] for r in rows], all_classes,
                                           fuzz_backend=fuzz_backend)
        else:
            scores[dataset] = lbm.scorer(dataset, preds, answers, all_classes, fuzz_backend=fuzz_backend)
    return scores


def format_table(scores: dict[str, Any], longbench_e: bool) -> str:
    from tabulate import tabulate

    def fmt(v: float) -> str:
        return "nan" if math.isnan(v) else f"{v:.2f}"

    if longbench_e:
        rows = [[d, *(fmt(b[k]) for k in lbm.E_BUCKETS)] for d, b in scores.items()]
        return tabulate(rows, headers=["dataset", *lbm.E_BUCKETS], tablefmt="github", disable_numparse=True)
    rows = [[d, fmt(v)] for d, v in scores.items()]
    summary = lbm.summary_scores(scores)
    rows += [[k, fmt(v)] for k, v in summary.items()]
    return tabulate(rows, headers=["dataset / average", "score"], tablefmt="github", disable_numparse=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbench-score", description=__doc__.split("\n\n")[0])
    ap.add_argument("pred_dir", type=Path, help="directory of <dataset>.jsonl prediction files")
    ap.add_argument("--longbench-e", action="store_true", help="score per length bucket (eval.py --e)")
    ap.add_argument("--fuzz-backend", choices=lbm.FUZZ_BACKENDS, default="difflib",
                    help="fuzzywuzzy backend for code_sim_score (difflib = the official requirements)")
    args = ap.parse_args(argv)
    try:
        scores = score_pred_dir(args.pred_dir, args.longbench_e, args.fuzz_backend)
    except ScoreError as e:
        print(f"kvbench-score: {e}", file=sys.stderr)
        return 2
    out = args.pred_dir / "result.json"
    with out.open("w", encoding="utf-8") as f:
        json.dump(scores, f, ensure_ascii=False, indent=4)
    print(format_table(scores, args.longbench_e))
    print(f"\nfuzz backend: {args.fuzz_backend}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
