"""Every task end to end through app.run_one (model -> engine -> task -> metrics.json), on tiny local models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.run.app import Session, run_one
from kvbench.run.config import load_group

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def session() -> Session:
    return Session()


def _cfg(model: str, policy: str, task: str, budget: int | None, block: int | None, **task_over) -> dict:
    t = load_group("task", task)
    t.update(task_over)
    return {"model": load_group("model", model), "policy": load_group("policy", policy), "task": t,
            "budget": budget, "block": block, "seed": 0, "scenario": "question_aware", "save_prompts": False,
            "overwrite": False, "device": "cpu", "shard": None, "diagnostics": [], "progress": False}


def test_longbench_from_local_directory(session: Session, tmp_path: Path) -> None:
    cfg = _cfg("tiny-llama", "keydiff", "longbench", 64, 32, data_dir=str(FIXTURES / "longbench"),
               datasets=["trec", "samsum", "narrativeqa"], limit=1)
    m = run_one(cfg, "keydiff", tmp_path, session, progress=False)
    assert {"trec", "samsum", "narrativeqa", "avg_selected"} <= set(m["scores"])
    assert m["average"] == m["scores"]["avg_selected"]
    assert m["stats"]["samples"] == 3 and m["stats"]["peak_kv_tokens"] <= 64 + 32
    assert m["provenance"]["task"]["data"]["source"] == f"dir:{FIXTURES / 'longbench'}"
    official = json.loads((tmp_path / "longbench_pred" / "result.json").read_text())
    assert set(official) == {"trec", "samsum", "narrativeqa"}


def test_niah_grid_and_heatmap(session: Session, tmp_path: Path) -> None:
    cfg = _cfg("tiny-llama", "streamingllm", "niah", 128, 64, context_lengths=[512, 1024], depths=[0, 50, 100],
               max_new_tokens=4)
    m = run_one(cfg, "streamingllm", tmp_path, session, progress=False)
    cells = {k for k in m["scores"] if k.startswith("L")}
    assert cells == {f"L{n}_D{d}" for n in (512, 1024) for d in (0, 50, 100)}
    assert list(tmp_path.glob("*.png"))


def test_probe_full_cache_retrieves(session: Session, tmp_path: Path) -> None:
    cfg = _cfg("probe", "full", "probe", None, None, context_lengths=[1024], depths=[0, 50, 100],
               samples_per_cell=1)
    m = run_one(cfg, "full", tmp_path, session, progress=False)
    assert m["average"] == 100.0
    assert any("synthetic" in n for n in m.get("notes", []))
