"""Every task end to end through app.run_one (model -> engine -> task -> metrics.json), on tiny local models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.run.app import Session, run_one
from kvbench.run.score import main as score_main

from helpers import run_config

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def session() -> Session:
    return Session()


def _cfg(model: str, policy: str, task: str, budget: int | None, block: int | None, **task_over) -> dict:
    """conf/config.yaml with these choices, on the CPU; `task_over` replaces options of the task."""
    return run_config(f"model={model}", f"policy={policy}", f"task={task}", "device=cpu", "progress=false",
                      values={"budget": budget, "block": block, **{f"task.{k}": v for k, v in task_over.items()}})


def _rescored(run_dir: Path) -> tuple[dict, float | None, list]:
    """kvbench-score on a finished run (its config.yaml and predictions.jsonl only, no model): scores, average and
    the samples it scored differently."""
    assert score_main([str(run_dir)]) == 0
    got = json.loads((run_dir / "rescored.json").read_text())
    return got["scores"], got["average"], got["changed"]


def test_longbench_from_local_directory(session: Session, tmp_path: Path) -> None:
    cfg = _cfg("tiny-llama", "keydiff", "longbench", 64, 32, data_dir=str(FIXTURES / "longbench"),
               datasets=["trec", "samsum", "narrativeqa"], limit=1)
    m = run_one(cfg, "keydiff", tmp_path, session)
    assert {"trec", "samsum", "narrativeqa", "avg_selected"} <= set(m["scores"])
    assert m["average"] == m["scores"]["avg_selected"]
    assert m["stats"]["samples"] == 3 and m["stats"]["peak_kv_tokens"] <= 64 + 32
    assert m["provenance"]["task"]["data"]["source"] == f"dir:{FIXTURES / 'longbench'}"
    official = json.loads((tmp_path / "longbench_pred" / "result.json").read_text())
    assert set(official) == {"trec", "samsum", "narrativeqa"}
    assert _rescored(tmp_path) == (m["scores"], m["average"], [])  # scored again exactly as the run scored it


def test_niah_grid_and_heatmap(session: Session, tmp_path: Path) -> None:
    cfg = _cfg("tiny-llama", "streamingllm", "niah", 128, 64, context_lengths=[512, 1024], depths=[0, 50, 100],
               max_new_tokens=4)
    m = run_one(cfg, "streamingllm", tmp_path, session)
    cells = {k for k in m["scores"] if k.startswith("L")}
    assert cells == {f"L{n}_D{d}" for n in (512, 1024) for d in (0, 50, 100)}
    assert list(tmp_path.glob("*.png"))
    assert _rescored(tmp_path) == (m["scores"], m["average"], [])


def test_probe_full_cache_retrieves(session: Session, tmp_path: Path) -> None:
    cfg = _cfg("probe", "full", "probe", None, None, context_lengths=[1024], depths=[0, 50, 100],
               samples_per_cell=1)
    m = run_one(cfg, "full", tmp_path, session)
    assert m["average"] == 100.0
    assert any("synthetic" in n for n in m.get("notes", []))
    assert _rescored(tmp_path) == (m["scores"], m["average"], [])
