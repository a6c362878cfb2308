"""kvbench-score: score predictions again without the model, either a run directory of any task, as the run
scores it, or a directory of official-format LongBench predictions, as LongBench's eval.py does.

    kvbench-score DIR [--fuzz-backend difflib|levenshtein] [--longbench-e]
    kvbench-score RUN_DIR --close-stopped LIKE

A run directory (what `kvbench` writes: `config.yaml` and `predictions.jsonl`): the task is built from config.yaml as
the run built it (a task that reads its data when built, such as jsonl, needs that file where the run read it), every
record's `prediction` is scored again by the task's own `score` (from the record's `id`, `answers` and `meta`, what a
record keeps of its sample: scores never need the prompt; an LM-scored task's from the record's `lm` summary), and
the task aggregates the new scores as the run does.
Writes DIR/rescored.json ({"task", "samples", "scores", "average", "changed": the ids whose score differs from the
recorded one}) and prints the scores. `--fuzz-backend` switches a LongBench run's code_sim_score backend. The
fidelity task is the exception: it compares the full cache's log-probabilities, which predictions.jsonl does not keep,
so its runs cannot be rescored.

A LongBench prediction directory holds `<dataset>.jsonl` files whose lines carry `pred`, `answers`, `all_classes` and
`length` (what the official pred.py writes, and what the longbench task writes into `<run_dir>/longbench_pred/`).
Writes DIR/result.json with eval.py's keys and numbers ({dataset: score}, or {dataset: {bucket: score}} with
--longbench-e; indent 4, non-ASCII kept) and prints a table with the labelled averages.

`--close-stopped LIKE`: RUN_DIR is a run stopped before its last sample (a time limit); its metrics.json is written
over the samples it finished, as the run writes it at its end, with `stopped` recorded and what the loading process
records (provenance, threads) taken from LIKE, a finished run beside it (close_stopped).

Bad input (a directory of neither kind, a task that cannot be rebuilt or rescored, a malformed file) ends with one line
on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from kvbench.errors import error_line
from kvbench.metrics import longbench as lbm
from kvbench.options import stored_config
from kvbench.tasks.base import TaskError, parse_jsonl

PREDICTIONS = "predictions.jsonl"  # a run directory's records (kvbench.run.loop)
RESCORED = "rescored.json"


class ScoreError(ValueError):
    """Bad input (a directory of neither kind, a run that cannot be rescored, a malformed file); printed as one
    line."""


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


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """The resolved config a run recorded (config.yaml)."""
    import yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ScoreError(f"{run_dir} has {PREDICTIONS} but no config.yaml: the run's task is unknown")
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ScoreError(f"{path}: not a readable YAML file ({error_line(e)})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("task"), dict) or not cfg["task"].get("_target_"):
        raise ScoreError(f"{path}: no task section with a _target_ (not a kvbench run's config)")
    return stored_config(cfg)


def committed_run_configs(runs: list[Path]) -> dict[Path, dict[str, Any]]:
    """Each run directory's recorded config (`read_run_config`), all read before anything is rerun, so a bad one is
    one error (ScoreError) and nothing is written: what the scripts that rerun committed runs start from."""
    configs = {}
    for run in runs:
        if not (run / "config.yaml").is_file() or not (run / PREDICTIONS).is_file():
            raise ScoreError(f"{run} is not a run directory (config.yaml, {PREDICTIONS})")
        configs[run] = read_run_config(run)
    return configs


def rescore_run(run_dir: Path, fuzz_backend: str | None = None) -> dict[str, Any]:
    """Score a run directory's predictions again with its own task, as the run does: the task built from config.yaml
    (`fuzz_backend`, when given, replaces a LongBench task's backend), `Task.score` per record, `Task.aggregate` over
    them and the run's average. Returns {"task", "samples", "scores", "average", "changed"}."""
    from kvbench.run.app import task_average
    from kvbench.run.records import read_records
    from kvbench.run.settings import build_task
    from kvbench.tasks.base import Sample

    task_cfg = dict(read_run_config(run_dir)["task"])
    if fuzz_backend is not None:
        if "fuzz_backend" not in task_cfg:
            raise ScoreError(f"--fuzz-backend applies to LongBench runs; this run's task is {task_cfg['_target_']}")
        task_cfg["fuzz_backend"] = fuzz_backend
    try:
        task = build_task(task_cfg)
    except (TaskError, ImportError, AttributeError) as e:  # (ImportError: a user's task module not on the path)
        raise ScoreError(f"cannot build the run's task {task_cfg['_target_']}: {error_line(e)}") from None
    if task.needs_reference:
        raise ScoreError(f"task '{task.name}' scores against the full cache's log-probabilities, which {PREDICTIONS} "
                         f"does not keep: its runs cannot be rescored")
    path = run_dir / PREDICTIONS
    records = read_records(path, repair=False)  # only reads: the run may still be going
    if not records:
        raise ScoreError(f"{path}: no finished predictions")
    rescored = []
    for r in records:
        missing = [k for k in ("prediction", "answers") if k not in r]
        if missing:
            raise ScoreError(f"{path}: record {r['id']!r} has no '{missing[0]}'")
        # What a record keeps of its sample; the prompt's ids are not kept, and no task's score reads them.
        sample = Sample(id=str(r["id"]), input_ids=[], answers=list(r["answers"]),
                        max_new_tokens=int(r.get("new_tokens") or 0), meta=dict(r.get("meta") or {}))
        try:
            # an LM-scored task (task=lm) scores the record's LM summary, as the run does (kvbench.run.loop.lm_record)
            score = task.score(sample, r["prediction"]) if task.lm_tokens is None else task.score_lm(sample, r["lm"])
        except (TaskError, KeyError, TypeError) as e:  # a record of another task (no meta.dataset, ...)
            raise ScoreError(f"{path}: record {r['id']!r}: cannot score it as task '{task.name}' "
                             f"({error_line(e, with_type=True)})") from None
        rescored.append({**r, "score": score})
    try:
        scores = task.aggregate(rescored)
    except (TaskError, KeyError) as e:
        raise ScoreError(f"{path}: cannot aggregate as task '{task.name}' ({error_line(e, with_type=True)})") from None
    return {"task": task.name, "samples": len(rescored), "scores": scores, "average": task_average(task, scores),
            "changed": [n["id"] for r, n in zip(records, rescored) if r.get("score") != n["score"]]}


def close_stopped(run_dir: Path, like: Path) -> dict[str, Any]:
    """Close a run that was stopped before its last sample (a time limit: a SLURM job's, a lent machine's) over the
    samples it finished: metrics.json written from its predictions exactly as the run writes it at its end, with
    `stopped` recording how many samples it holds and where its provenance came from. The provenance (machine,
    device, library versions, model source), the torch threads and a batch note are what the loading process
    records; a stopped process recorded none, so they are taken from `like`, a finished run of the same commit,
    model, device, task and shard (the run beside it in the same sweep). Returns the metrics."""
    from kvbench.run.app import RunBusy, run_lock, write_metrics
    from kvbench.run.records import read_records
    from kvbench.run.settings import RunSettings, build_policy, build_task

    for name in ("config.yaml", "run.json", PREDICTIONS):
        if not (run_dir / name).is_file():
            raise ScoreError(f"{run_dir}: no {name} (not a run kvbench started)")
    if (run_dir / "metrics.json").is_file():
        raise ScoreError(f"{run_dir} is finished (it has metrics.json): nothing to close")
    if not (like / "metrics.json").is_file():
        raise ScoreError(f"--close-stopped {like}: not a finished run (no metrics.json)")
    cfg, like_cfg = read_run_config(run_dir), read_run_config(like)
    try:
        started = json.loads((run_dir / "run.json").read_text())
        policy_name = str(started["policy"])
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ScoreError(f"{run_dir / 'run.json'}: not a run's record (no policy)") from None
    try:
        like_metrics = json.loads((like / "metrics.json").read_text())
        prov = dict(like_metrics["provenance"])
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ScoreError(f"{like / 'metrics.json'}: no provenance") from None
    differ = [k for k in ("model", "device", "task", "shard") if cfg.get(k) != like_cfg.get(k)]
    if started.get("commit") != prov.get("commit"):
        differ.append(f"commit ({started.get('commit')} vs {prov.get('commit')})")
    if differ:
        raise ScoreError(f"{like} is not a run beside {run_dir}: its {', '.join(differ)} differ")
    settings = RunSettings.from_config(cfg)
    try:
        with run_lock(run_dir, create=False):
            records = read_records(run_dir / PREDICTIONS)  # a torn last line (the kill) is cut off
            if not records:
                raise ScoreError(f"{run_dir / PREDICTIONS}: no finished predictions")
            stopped = {"samples": len(records), "provenance_from": os.path.relpath(like, run_dir)}
            return write_metrics(settings, policy_name, run_dir, build_policy(settings.policy, settings),
                                 build_task(settings.task), records, str(like_metrics["model"]), prov,
                                 stopped=stopped, threads=like_metrics.get("threads"))
    except RunBusy as e:
        raise ScoreError(str(e)) from None


def format_scores(result: dict[str, Any]) -> str:
    """The rescored run as a table: every score, then the average."""
    from tabulate import tabulate

    def fmt(v: Any) -> str:
        return "nan" if isinstance(v, float) and math.isnan(v) else (f"{v:.2f}" if isinstance(v, float) else str(v))

    rows = [[k, fmt(v)] for k, v in result["scores"].items()]
    rows.append(["average", "-" if result["average"] is None else fmt(float(result["average"]))])
    return tabulate(rows, headers=[f"{result['task']} score", "value"], tablefmt="github", disable_numparse=True)


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
    ap.add_argument("dir", type=Path, metavar="DIR",
                    help=f"a run directory (config.yaml + {PREDICTIONS}, any task) or a directory of official-format "
                         f"LongBench <dataset>.jsonl predictions")
    ap.add_argument("--longbench-e", action="store_true",
                    help="LongBench prediction directories: score per length bucket (eval.py --e)")
    ap.add_argument("--fuzz-backend", choices=lbm.FUZZ_BACKENDS, default=None,
                    help="fuzzywuzzy backend for code_sim_score (default: difflib, the official requirements; for a "
                         "run directory, the run's own setting)")
    ap.add_argument("--close-stopped", type=Path, metavar="LIKE", default=None,
                    help="DIR is a run stopped before its last sample: write its metrics.json over the samples it "
                         "finished, its provenance taken from LIKE, a finished run beside it (same commit, model, "
                         "device, task and shard)")
    args = ap.parse_args(argv)
    try:
        if not args.dir.is_dir():
            raise ScoreError(f"directory not found: {args.dir}")
        if args.close_stopped is not None:
            if args.longbench_e or args.fuzz_backend:
                raise ScoreError("--close-stopped takes no other option: the run is scored by its own settings")
            m = close_stopped(args.dir, args.close_stopped)
            print(format_scores(m))
            print(f"\nclosed {args.dir} over its {m['stopped']['samples']} finished samples; wrote "
                  f"{args.dir / 'metrics.json'}")
        elif (args.dir / PREDICTIONS).is_file():
            if args.longbench_e:
                raise ScoreError("--longbench-e is for LongBench prediction directories; a run directory's "
                                 "config.yaml says which task it ran")
            _score_run_dir(args.dir, args.fuzz_backend)
        else:
            _score_longbench_dir(args.dir, args.longbench_e, args.fuzz_backend or "difflib")
    except ScoreError as e:
        print(f"kvbench-score: {e}", file=sys.stderr)
        return 2
    return 0


def _score_run_dir(run_dir: Path, fuzz_backend: str | None) -> None:
    result = rescore_run(run_dir, fuzz_backend)
    out = run_dir / RESCORED
    out.write_text(json.dumps(result, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    print(format_scores(result))
    changed = result["changed"]
    listed = ", ".join(map(str, changed[:10])) + (", ..." if len(changed) > 10 else "")
    print(f"\n{result['samples']} samples, {len(changed)} scored differently from {PREDICTIONS}"
          f"{f' ({listed})' if changed else ''}; wrote {out}")


def _score_longbench_dir(pred_dir: Path, longbench_e: bool, fuzz_backend: str) -> None:
    _check_longbench_files(pred_dir)
    scores = score_pred_dir(pred_dir, longbench_e, fuzz_backend)
    out = pred_dir / "result.json"
    with out.open("w", encoding="utf-8") as f:
        json.dump(scores, f, ensure_ascii=False, indent=4)
    print(format_table(scores, longbench_e))
    print(f"\nfuzz backend: {fuzz_backend}; wrote {out}")


def _check_longbench_files(pred_dir: Path) -> None:
    """A directory with neither a run's predictions nor LongBench files: say which it lacks, and name the runs below
    it (a `compare` job or a sharded run keeps one run directory per policy or shard)."""
    if any(p.is_file() and p.name.endswith("jsonl") for p in pred_dir.iterdir()):
        return
    runs = sorted(p.parent.name for p in pred_dir.glob(f"*/{PREDICTIONS}"))
    below = f"; the runs below it: {', '.join(runs)} (kvbench-score {pred_dir / runs[0]})" if runs else ""
    raise ScoreError(f"no {PREDICTIONS} (a run directory) nor <dataset>.jsonl files (LongBench predictions) in "
                     f"{pred_dir}{below}")


if __name__ == "__main__":
    sys.exit(main())
