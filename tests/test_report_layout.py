"""metrics.json `layout`: each task describes its own table layout (columns and categories, summary scores, heatmap
cells, the average's score) and the recipe its scores are aggregated with (kvbench.metrics.aggregate); the report
reads that, never builds a Task, and merges shards with the run's own aggregation. Expected values are worked out
by hand in the comments.
"""

from __future__ import annotations

import ast
import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvbench.metrics.aggregate import RecipeError, aggregate_scores
from kvbench.report.cli import report
from kvbench.report.collect import ReportError
from kvbench.tasks.fidelity import FidelityTask
from kvbench.tasks.jsonl import JsonlTask
from kvbench.tasks.longbench import LongBench, LongBenchE
from kvbench.tasks.niah import NIAH
from kvbench.tasks.probe import ProbeTask
from kvbench.tasks.ruler import Ruler

from helpers import run_config

PKG = Path(__file__).resolve().parent.parent / "kvbench"


def _plain(layout: dict[str, Any]) -> dict[str, Any]:
    """The layout after a trip through metrics.json: it must come back unchanged (lists, not tuples)."""
    back = json.loads(json.dumps(layout))
    assert back == layout
    return back


# -- the layout each task writes ---------------------------------------------------------------------------------
def test_niah_layout_sorts_its_grid_and_rounds_like_the_task() -> None:
    task = NIAH(context_lengths=[1000, 500], depths=[75, 25], haystack="filler")  # configured out of order
    scores = [("L1000_D75", 1000, 75, 100.0), ("L1000_D75_n1", 1000, 75, 100.0), ("L1000_D25", 1000, 25, 0.0),
              ("L500_D75", 500, 75, 100.0), ("L500_D25", 500, 25, 100.0), ("L500_D25_n1", 500, 25, 0.0)]
    recs = [{"id": i, "score": s, "meta": {"context_length": L, "depth": float(d)}} for i, L, d, s in scores]
    # cells: L500_D25 = (100 + 0) / 2 = 50; avg = 400 / 6 = 66.666... -> 66.67 (the mean of the samples)
    got = task.aggregate(recs)
    assert got == {"L500_D25": 50.0, "L500_D75": 100.0, "L1000_D25": 0.0, "L1000_D75": 100.0, "avg": 66.67}
    assert list(got) == ["L500_D25", "L500_D75", "L1000_D25", "L1000_D75", "avg"]

    def where(L: int, d: float) -> dict:
        return {"mean": "score", "where": {"meta.context_length": L, "meta.depth": d}, "round": 2}

    assert _plain(task.layout(recs, got)) == {
        "columns": [{"score": "L500_D25", "category": "niah L500", "sort": [500, 25.0]},
                    {"score": "L500_D75", "category": "niah L500", "sort": [500, 75.0]},
                    {"score": "L1000_D25", "category": "niah L1000", "sort": [1000, 25.0]},
                    {"score": "L1000_D75", "category": "niah L1000", "sort": [1000, 75.0]}],
        "summary": ["avg"],
        "cells": {"L500_D25": [500, 25.0], "L500_D75": [500, 75.0], "L1000_D25": [1000, 25.0],
                  "L1000_D75": [1000, 75.0]},
        "average": "avg",
        "recipe": {"L500_D25": where(500, 25.0), "L500_D75": where(500, 75.0), "L1000_D25": where(1000, 25.0),
                   "L1000_D75": where(1000, 75.0), "avg": {"mean": "score", "round": 2, "default": 0.0}}}


def test_probe_layout() -> None:
    task = ProbeTask(context_lengths=[1024], depths=[0, 50])
    recs = [{"id": f"x{k}", "score": s, "meta": {"length": 1024, "depth": d}}
            for k, (d, s) in enumerate([(0.0, 100.0), (0.0, 0.0), (50.0, 100.0)])]
    got = task.aggregate(recs)
    assert got == {"L1024_D0": 50.0, "L1024_D50": 100.0, "avg": 75.0}  # avg: the mean of the cells, (50 + 100) / 2
    assert _plain(task.layout(recs, got)) == {
        "columns": [{"score": "L1024_D0", "category": "probe L1024", "sort": [1024, 0.0]},
                    {"score": "L1024_D50", "category": "probe L1024", "sort": [1024, 50.0]}],
        "summary": ["avg"], "cells": {"L1024_D0": [1024, 0.0], "L1024_D50": [1024, 50.0]}, "average": "avg",
        "recipe": {"L1024_D0": {"mean": "score", "where": {"meta.length": 1024, "meta.depth": 0.0}},
                   "L1024_D50": {"mean": "score", "where": {"meta.length": 1024, "meta.depth": 50.0}},
                   "avg": {"mean_of": ["L1024_D0", "L1024_D50"], "skip_missing": True}}}


def _ruler_rec(task: str, length: int, pred: str, answers: list[str]) -> dict:
    return {"id": f"{task}{length}{pred}", "prediction": pred, "answers": answers, "score": 0.0,
            "meta": {"task": task, "length": length, "metric": "string_match_all"}}


def test_ruler_layouts_one_and_two_lengths() -> None:
    one = [_ruler_rec("niah_single_1", 4096, "123", ["123"]), _ruler_rec("niah_single_1", 4096, "no", ["9"]),
           _ruler_rec("vt", 4096, "A B", ["A", "B", "C", "D"])]
    task = Ruler(tasks=["vt", "niah_single_1"], lengths=[4096])
    # niah_single_1: (1 + 0) / 2 -> 50.0; vt: 2 of 4 -> 50.0; L4096 = avg = 50.0
    assert task.aggregate(one) == {"vt": 50.0, "niah_single_1": 50.0, "L4096": 50.0, "avg": 50.0}
    cell = lambda t, L: {"metric": "ruler_dataset", "where": {"meta.task": t, "meta.length": L}}  # noqa: E731
    assert _plain(task.layout(one, task.aggregate(one))) == {
        "columns": [{"score": "vt", "category": "ruler"}, {"score": "niah_single_1", "category": "ruler"}],
        "summary": ["L4096", "avg"], "cells": {}, "average": "avg",
        "recipe": {"vt": {**cell("vt", 4096), "round": 2}, "niah_single_1": {**cell("niah_single_1", 4096), "round": 2},
                   "L4096": {"mean_of": ["vt", "niah_single_1"], "skip_missing": True, "round": 2},
                   "avg": {"mean_of": ["L4096"], "skip_missing": True, "round": 2, "default": 0.0}}}

    two = one + [_ruler_rec("niah_single_1", 8192, "123", ["123"]), _ruler_rec("vt", 8192, "a", ["A", "B", "C"])]
    task = Ruler(tasks=["vt", "niah_single_1"], lengths=[8192, 4096])
    # vt_L8192 = 1/3 -> 33.33; vt = (50 + 33.33) / 2 = 41.66499.. -> 41.66; L8192 = (33.33 + 100) / 2 -> 66.66;
    # niah_single_1 = (50 + 100) / 2 = 75; avg = (50 + 66.66) / 2 = 58.33
    got = task.aggregate(two)
    assert list(got.items()) == [("vt", 41.66), ("niah_single_1", 75.0), ("L4096", 50.0), ("L8192", 66.66),
                                 ("niah_single_1_L4096", 50.0), ("niah_single_1_L8192", 100.0), ("vt_L4096", 50.0),
                                 ("vt_L8192", 33.33), ("avg", 58.33)]
    lay = _plain(task.layout(two, got))
    assert [c["score"] for c in lay["columns"]] == ["vt", "niah_single_1", "niah_single_1_L4096",
                                                    "niah_single_1_L8192", "vt_L4096", "vt_L8192"]
    assert lay["summary"] == ["L4096", "L8192", "avg"]
    assert lay["recipe"]["vt"] == {"mean_of": ["vt_L4096", "vt_L8192"], "skip_missing": True, "round": 2}
    assert lay["recipe"]["L8192"] == {"mean_of": ["vt_L8192", "niah_single_1_L8192"], "skip_missing": True,
                                      "round": 2}
    assert lay["recipe"]["vt_L8192"] == cell("vt", 8192)


def _lb_rec(dataset: str, k: int, pred: str, answer: str, length: int = 1000) -> dict:
    return {"id": f"{dataset}/{k}", "prediction": pred, "answers": [answer], "score": 0.0,
            "meta": {"dataset": dataset, "all_classes": ["Location", "Entity"], "length": length}}


def test_longbench_layout_categories_in_the_official_order() -> None:
    task = LongBench(datasets=["trec", "qasper"])
    recs = [_lb_rec("trec", 0, "Location", "Location"), _lb_rec("trec", 1, "Entity", "Location"),
            _lb_rec("qasper", 0, "the cat sat", "cat sat")]
    # trec: classification 1 and 0 -> 50.0; qasper: F1 of {cat, sat} ("the" is dropped) = 1 -> 100.0
    got = task.aggregate(recs)
    assert list(got.items()) == [("qasper", 100.0), ("trec", 50.0), ("avg_selected", 75.0)]

    def ds(d: str) -> dict:
        return {"metric": "longbench_dataset", "kwargs": {"dataset": d, "fuzz_backend": "difflib"},
                "where": {"meta.dataset": d}}

    assert _plain(task.layout(recs, got)) == {
        "columns": [{"score": "qasper", "category": "Single Doc. QA", "sort": [1, "qasper"]},
                    {"score": "trec", "category": "Few-shot Learning", "sort": [12, "trec"]}],
        "summary": ["avg_selected"], "cells": {}, "average": "avg_selected",
        "recipe": {"qasper": ds("qasper"), "trec": ds("trec"),
                   "avg_selected": {"mean_of": ["qasper", "trec"], "skip_missing": True}}}


def test_longbench_e_layout_buckets() -> None:
    task = LongBenchE(datasets=["trec"])
    recs = [_lb_rec("trec", 0, "Location", "Location", 1000), _lb_rec("trec", 1, "Entity", "Location", 9000)]
    got = task.aggregate(recs)
    # 0-4k: 100; 4-8k: empty -> NaN (eval.py); 8k+: 0; avg = (100 + 0) / 2 over the buckets that have samples
    assert got["trec:0-4k"] == 100.0 and math.isnan(got["trec:4-8k"]) and got["trec:8k+"] == 0.0
    assert {k: v for k, v in got.items() if k.startswith("avg")} == {"avg:0-4k": 100.0, "avg:8k+": 0.0, "avg": 50.0}
    lay = _plain(task.layout(recs, got))
    assert lay["columns"] == [{"score": f"trec:{b}", "category": "Few-shot Learning", "sort": [12, f"trec:{b}"]}
                              for b in ("0-4k", "4-8k", "8k+")]
    assert lay["summary"] == ["avg:0-4k", "avg:4-8k", "avg:8k+", "avg"] and lay["average"] == "avg"
    assert lay["recipe"]["trec:4-8k"] == {"metric": "longbench_dataset_e", "where": {"meta.dataset": "trec"},
                                          "kwargs": {"dataset": "trec", "bucket": "4-8k", "fuzz_backend": "difflib"}}
    assert lay["recipe"]["avg"] == {"mean_of": ["avg:0-4k", "avg:4-8k", "avg:8k+"], "skip_missing": True}


def test_jsonl_and_fidelity_layouts_are_the_default_one() -> None:
    jl = JsonlTask.__new__(JsonlTask)
    recs = [{"id": "a", "score": 100.0}, {"id": "b", "score": 0.0}]
    assert jl.aggregate(recs) == {"jsonl": 50.0}
    assert _plain(jl.layout(recs, {"jsonl": 50.0})) == {
        "columns": [{"score": "jsonl", "category": "jsonl"}], "summary": [], "cells": {}, "average": None,
        "recipe": {"jsonl": {"mean": "score"}}}

    fid = FidelityTask()
    recs = [{"id": "a", "score": 100.0, "fidelity": {"top1": 100.0, "kl_mean": 0.5, "kl_max": 2.0, "match_len": 4}},
            {"id": "b", "score": 50.0, "fidelity": {"top1": 50.0, "kl_mean": 1.5, "kl_max": 3.0, "match_len": 2}}]
    got = fid.aggregate(recs)
    assert got == {"top1": 75.0, "kl_mean": 1.0, "kl_max": 3.0, "match_len": 3.0}
    lay = _plain(fid.layout(recs, got))
    assert lay["columns"] == [{"score": k, "category": "fidelity"} for k in ("top1", "kl_mean", "kl_max", "match_len")]
    assert (lay["summary"], lay["cells"], lay["average"]) == ([], {}, "top1")
    assert lay["recipe"]["kl_max"] == {"max": "fidelity.kl_max"}


# -- the aggregation function ------------------------------------------------------------------------------------
def tripled(records: list[dict], factor: float = 1.0) -> float:
    """A set-level metric for the recipe test (named "test_report_layout:tripled")."""
    return 3.0 * factor * len(records)


def not_a_number(records: list[dict]) -> float:
    return math.nan


def test_aggregate_scores_by_hand() -> None:
    recs = [{"id": "a", "score": 10, "meta": {"g": "x"}, "m": {"v": 1.0}},
            {"id": "b", "score": 20, "meta": {"g": "x"}, "m": {"v": 4.0}},
            {"id": "c", "score": 60, "meta": {"g": "y"}, "m": {"v": 2.0}}]
    recipe = {
        "x": {"mean": "score", "where": {"meta.g": "x"}},  # (10 + 20) / 2 = 15
        "y": {"mean": "score", "where": {"meta.g": "y"}},  # 60
        "z": {"mean": "score", "where": {"meta.g": "z"}},  # no record: left out
        "z0": {"mean": "score", "where": {"meta.g": "z"}, "default": 0.0},
        "top": {"max": "m.v"},  # 4.0
        "v": {"mean": "m.v", "round": 1},  # 7 / 3 = 2.33.. -> 2.3
        "xy": {"mean_of": ["x", "y"]},  # 37.5
        "xz": {"mean_of": ["x", "z"]},  # z missing: left out
        "xz_skip": {"mean_of": ["x", "z"], "skip_missing": True},  # 15
        "n": {"metric": "test_report_layout:tripled", "kwargs": {"factor": 2.0}, "where": {"meta.g": "x"}},  # 12
        "nan": {"metric": "test_report_layout:not_a_number"},
        "with_nan": {"mean_of": ["x", "nan"], "skip_missing": True},  # NaN counts as missing: 15
    }
    got = aggregate_scores(recs, recipe)
    assert list(got) == ["x", "y", "z0", "top", "v", "xy", "xz_skip", "n", "nan", "with_nan"]
    assert {k: v for k, v in got.items() if k != "nan"} == {"x": 15.0, "y": 60.0, "z0": 0.0, "top": 4.0, "v": 2.3,
                                                            "xy": 37.5, "xz_skip": 15.0, "n": 12.0, "with_nan": 15.0}
    assert math.isnan(got["nan"])
    assert math.isnan(aggregate_scores(recs, {**recipe, "all": {"mean_of": ["x", "nan"]}})["all"])  # not skipped
    for bad, match in [({"b": {"mean": "score", "max": "score"}}, "exactly one"),
                       ({"b": {"mean_of": ["nowhere"]}}, "does not define"),
                       ({"b": {"mean": "meta.missing"}}, "no field"),
                       ({"a": {"mean_of": ["b"]}, "b": {"mean_of": ["a"]}}, "cycle")]:
        with pytest.raises(RecipeError, match=match):
            aggregate_scores(recs, bad)


# -- the report reads the layout ---------------------------------------------------------------------------------
def _csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


ZEBRA_SCORES = {"zeta": 1.0, "cat:alpha": 2.0, "L9": 3.0, "avg_total": 4.0, "L1_D2": 5.0, "extra": 6.0}


def _zebra_run(root: Path, layout: dict | None) -> None:
    d = root / "run"
    d.mkdir(parents=True)
    metrics = {"model": "m", "policy": "keydiff", "budget": 256, "block": 128, "protocol": "blockwise",
               "task": "zebra", "shard": None, "applies": {"budget": True, "protocol": True, "block": True},
               "reference": False, "scores": ZEBRA_SCORES, "average": 4.0, "composition": {},
               "stats": {"samples": 2}, "provenance": {"commit": "abc"}}
    if layout is not None:
        metrics["layout"] = layout
    (d / "metrics.json").write_text(json.dumps(metrics))


def test_report_lays_out_a_made_up_task_as_its_layout_says(tmp_path: Path) -> None:
    # Names that the old name rules would place otherwise (cat:alpha and L9 as summaries, L1_D2 as a heatmap cell,
    # zeta under the task): the layout decides. "ghost" has no score (not shown); "extra" is in no layout slot
    # (shown after the layout's columns, under the task's name).
    layout = {"columns": [{"score": "L9", "category": "Part B"}, {"score": "zeta", "category": "Part A"},
                          {"score": "cat:alpha", "category": "Part A"}, {"score": "ghost", "category": "Part A"}],
              "summary": ["L1_D2", "avg_total"], "cells": {"zeta": [100, 0], "L9": [200, 50]},
              "average": "avg_total", "recipe": None}
    _zebra_run(tmp_path / "new", layout)
    rep = report(tmp_path / "new", plots=True, quiet=True)
    assert [(c.score, c.category, c.cell) for c in rep.columns] == [
        ("L9", "Part B", (200.0, 50.0)), ("zeta", "Part A", (100.0, 0.0)), ("cat:alpha", "Part A", None),
        ("extra", "zebra", None)]
    assert [c.score for c in rep.summary_columns] == ["L1_D2", "avg_total"]
    assert list(_csv(tmp_path / "new" / "table.csv")[0]) == [
        "model", "policy", "budget", "block", "protocol", "L9", "zeta", "cat:alpha", "extra", "L1_D2", "avg_total",
        "Avg"]
    md = (tmp_path / "new" / "table.md").read_text()
    assert "*Part B*" in md and "*Part A*" in md and "*zebra*" in md
    assert rep.entries[0].average_key == "avg_total"
    assert (tmp_path / "new" / "heatmap_zebra_m.png").stat().st_size > 0  # the layout's cells, not the names

    # The same run without a layout (an older kvbench): not read by name rules, but named in the notes.
    _zebra_run(tmp_path / "old", None)
    with pytest.raises(ReportError, match="no finished runs"):
        report(tmp_path / "old", plots=False, quiet=True)


# -- shards: the run's own aggregation, no task ------------------------------------------------------------------
def _shard_dir(root: Path, name: str, shard: str | None, records: list[dict], layout: dict, scores: dict) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    metrics = {"model": "m", "policy": "keydiff", "budget": 256, "block": 128, "protocol": "blockwise",
               "task": "cells", "shard": shard, "applies": {"budget": True, "protocol": True, "block": True},
               "reference": False, "scores": scores, "average": scores.get("avg"), "stats": {"samples": len(records)}, "provenance": {"commit": "abc"},
               "composition": {"c": {"samples": [r["id"] for r in records]}}, "layout": layout}
    (d / "metrics.json").write_text(json.dumps(metrics))


def test_shards_merge_with_the_recipe_not_the_composition_means(tmp_path: Path) -> None:
    # One cell "c" of 3 samples (100, 0, 0), rounded to 2 decimals by the recipe: 33.33, and avg = c. The
    # composition's plain mean would be 33.333...: the merge must give the run's rounded number.
    timing = {"prompt_tokens": 10, "new_tokens": 1, "prefill_s": 1.0, "decode_s": 1.0, "decode_steps": 1,
              "evict_s": 0.0, "peak_kv_tokens": 10, "kv_bytes_peak": 10}
    recs = [{"id": f"s{k}", "score": v, "meta": {"cell": "c"}, **timing} for k, v in enumerate([100.0, 0.0, 0.0])]
    recipe = {"c": {"mean": "score", "where": {"meta.cell": "c"}, "round": 2}, "avg": {"mean_of": ["c"]}}
    layout = {"columns": [{"score": "c", "category": "cells"}], "summary": ["avg"], "cells": {}, "average": "avg",
              "recipe": recipe}
    _shard_dir(tmp_path / "job", "shard0", "0/2", recs[0::2], layout, {"c": 50.0, "avg": 50.0})
    _shard_dir(tmp_path / "job", "shard1", "1/2", recs[1::2], layout, {"c": 0.0, "avg": 0.0})
    rep = report(tmp_path, plots=False, quiet=True)
    e = rep.entries[0]
    assert (e.scores, e.average, e.average_key) == ({"c": 33.33, "avg": 33.33}, 33.33, "avg")
    assert e.cells["c"].n == 3 and rep.notes == []


def _probe_cfg(shard: str | None) -> dict:
    return run_config("model=probe", "policy=streamingllm", "task=probe", "task.context_lengths=[256]",
                      "task.depths=[0,50,100]", "task.samples_per_cell=2", "budget=64", "block=32", "device=cpu",
                      "progress=false", f"shard={shard or 'null'}")


def test_shards_of_a_tiny_model_run_merge_into_the_unsharded_metrics(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbench.run import settings
    from kvbench.run.app import Session, run_one

    session = Session()
    sharded, whole = tmp_path / "sharded", tmp_path / "whole"
    shard_metrics = [run_one(_probe_cfg(f"{i}/2"), "streamingllm", sharded / "job" / f"shard{i}of2", session)
                     for i in (0, 1)]
    unsharded = run_one(_probe_cfg(None), "streamingllm", whole / "run", session)
    # The run wrote its layout; every shard wrote the same one (configured cells, not the ones the shard held).
    assert unsharded["layout"]["cells"] == {"L256_D0": [256, 0.0], "L256_D50": [256, 50.0], "L256_D100": [256, 100.0]}
    assert all(m["layout"] == unsharded["layout"] for m in shard_metrics)

    def no_task(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the report built a task")

    monkeypatch.setattr(settings, "build_task", no_task)
    rep = report(sharded, plots=False, quiet=True)
    assert len(rep.entries) == 1 and rep.notes == []
    e = rep.entries[0]
    assert e.scores == unsharded["scores"] and list(e.scores) == list(unsharded["scores"])
    assert e.average == unsharded["average"] and e.stats["samples"] == 6


# -- the report's imports --------------------------------------------------------------------------------------
def test_the_report_imports_no_task_and_builds_none() -> None:
    from test_layers import all_modules, imports

    modules = all_modules()
    for path in sorted((PKG / "report").glob("*.py")):
        found = imports(path, modules)
        assert not [m for m in found if m == "kvbench.tasks" or m.startswith("kvbench.tasks.")], path.name
        names = {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
        assert "build_task" not in names, path.name
