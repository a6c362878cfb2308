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


def test_close_stopped_run(session: Session, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """kvbench-score --close-stopped: a run killed after 4 of its 6 samples (its last line torn) is closed over those
    4 as the run closes itself, its provenance taken from a finished run beside it; what is not such a pair is one
    line and exit 2."""
    import shutil

    from kvbench.report.collect import find_runs

    cfg = _cfg("tiny-llama", "streamingllm", "niah", 128, 64, context_lengths=[512], depths=[0, 50, 100],
               samples_per_cell=2, max_new_tokens=4)
    like = tmp_path / "like"
    m_like = run_one(cfg, "streamingllm", like, session)
    assert m_like["stats"]["samples"] == 6
    stopped = tmp_path / "stopped"
    shutil.copytree(like, stopped)
    lines = (like / "predictions.jsonl").read_text().splitlines(keepends=True)
    (stopped / "predictions.jsonl").write_text("".join(lines[:4]) + lines[4][:20])  # killed while writing the 5th
    (stopped / "metrics.json").unlink()
    kept = [json.loads(x) for x in lines[:4]]
    # the loading process's threads come from LIKE, not from the process that closes the run
    like_m = json.loads((like / "metrics.json").read_text())
    (like / "metrics.json").write_text(json.dumps({**like_m, "threads": 7}))

    assert score_main([str(stopped), "--close-stopped", str(like)]) == 0
    m = json.loads((stopped / "metrics.json").read_text())
    assert m["stopped"] == {"samples": 4, "provenance_from": "../like"}
    assert m["provenance"] == m_like["provenance"] and m["model"] == m_like["model"] and m["threads"] == 7
    assert m["stats"]["samples"] == 4 and (stopped / "predictions.jsonl").read_text() == "".join(lines[:4])
    # each depth cell is the mean of the kept records at that depth (samples run depth by depth: 0, 0, 50, 50)
    for depth in (0, 50, 100):
        cell = [r["score"] for r in kept if r["meta"]["depth"] == depth]
        if cell:
            assert m["scores"][f"L512_D{depth}"] == round(sum(cell) / len(cell), 2)
    assert m["composition"]["avg"]["samples"] == [r["id"] for r in kept]
    runs, notes = find_runs(tmp_path)
    assert len(runs) == 2 and any("stopped" in n and "the 4 it finished" in n for n in notes)

    capsys.readouterr()
    assert score_main([str(stopped), "--close-stopped", str(like)]) == 2  # finished now
    assert "is finished" in capsys.readouterr().err
    other = tmp_path / "other"
    shutil.copytree(like, other)
    (other / "metrics.json").unlink()
    cfg_other = (like / "config.yaml").read_text().replace("shard: null", "shard: 1/2")
    assert cfg_other != (like / "config.yaml").read_text()
    (like / "config.yaml").write_text(cfg_other)
    assert score_main([str(other), "--close-stopped", str(like)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "shard differ" in err and not (other / "metrics.json").exists()
    (other / "run.json").write_text("{torn")  # a record that is not JSON: one line, not a traceback
    assert score_main([str(other), "--close-stopped", str(stopped)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.json" in err and not (other / "metrics.json").exists()
