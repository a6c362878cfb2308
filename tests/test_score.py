"""kvbench-score on a run directory: any task's predictions scored again by the run's own task, from config.yaml and
predictions.jsonl alone (no model), with the scores pinned by hand; what cannot be rescored is one line and exit 2.
(LongBench prediction directories: tests/test_longbench_task.py; a real run rescored to its own metrics.json:
tests/test_tasks_e2e.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvbench.run.score import main as score_main

from helpers import run_config

FIXTURES = Path(__file__).parent / "fixtures"
TREC_CLASSES = ["Abbreviation", "Animal", "Description", "Human being", "Location", "Numeric value"]
GT = "x = 1 " * 84  # 504 characters, every one frequent: difflib's autojunk drops them all (test_longbench_metrics)


def write_run(run_dir: Path, cfg: dict, records: list[dict]) -> Path:
    """A run directory as `kvbench` leaves it, as far as scoring goes: config.yaml and predictions.jsonl."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run_dir / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def record(rid: str, prediction: str, answers: list[str], score: float, **meta: object) -> dict:
    return {"id": rid, "prediction": prediction, "answers": answers, "score": score, "new_tokens": 3, "meta": meta}


@pytest.fixture
def jsonl_run(tmp_path: Path) -> Path:
    data = tmp_path / "qa.jsonl"  # the jsonl task reads its data file when it is built, as in the run
    data.write_text("".join(json.dumps({"id": i, "prompt": "Where?", "answers": ["Paris"]}) + "\n" for i in "abc"))
    cfg = run_config("model=tiny-llama", "policy=keydiff", "task=jsonl", values={"task.path": str(data)})
    return write_run(tmp_path / "run", cfg, [
        record("a", "It is PARIS, of course", ["paris"], 100.0),
        record("b", "London", ["Paris", "Lyon"], 100.0),  # recorded wrongly: the rescore gives 0
        record("c", "lyon!", ["Paris", "Lyon"], 100.0),
    ])


def test_a_jsonl_run_is_rescored_by_its_own_task(jsonl_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = (jsonl_run / "predictions.jsonl").read_bytes()
    assert score_main([str(jsonl_run)]) == 0
    got = json.loads((jsonl_run / "rescored.json").read_text())
    # substring_any, case-insensitive: a 100, b 0, c 100; the jsonl score is their mean, and the average the mean of
    # the task's scores (it has no average_key).
    assert got == {"task": "jsonl", "samples": 3, "scores": {"jsonl": 200 / 3}, "average": 200 / 3, "changed": ["b"]}
    out = capsys.readouterr().out
    assert "| jsonl" in out and "66.67" in out and "3 samples, 1 scored differently from predictions.jsonl (b)" in out
    assert (jsonl_run / "predictions.jsonl").read_bytes() == before  # scoring never touches the run


def longbench_run(tmp_path: Path, lcc_prediction: str) -> Path:
    cfg = run_config("model=tiny-llama", "policy=keydiff", "task=longbench",
                     values={"task.data_dir": str(FIXTURES / "longbench"), "task.datasets": ["trec", "lcc"]})
    return write_run(tmp_path / "lb", cfg, [
        record("trec/0", "\nAnimal\nLocation", ["Animal"], 100.0, dataset="trec", all_classes=TREC_CLASSES),
        record("trec/1", "Numeric value or Location", ["Numeric value"], 50.0, dataset="trec",
               all_classes=TREC_CLASSES),
        record("lcc/0", lcc_prediction, [GT], 0.0, dataset="lcc", all_classes=None),
    ])


def test_a_longbench_run_is_rescored_with_eval_py_numbers(tmp_path: Path) -> None:
    pytest.importorskip("Levenshtein")
    run = longbench_run(tmp_path, " " + GT)
    assert score_main([str(run)]) == 0
    got = json.loads((run / "rescored.json").read_text())
    # trec: the first line "Animal" matches (1), "Numeric value or Location" names two classes, one right (1/2): 75.0.
    # lcc: difflib (the run's backend) finds no match in all-junk text: 0.
    assert got["scores"] == {"trec": 75.0, "lcc": 0.0, "avg_selected": 37.5}
    assert got["changed"] == [] and got["average"] == 37.5
    # The Levenshtein backend: one inserted space in 1009 characters rounds to 100.
    assert score_main([str(run), "--fuzz-backend", "levenshtein"]) == 0
    got = json.loads((run / "rescored.json").read_text())
    assert got["scores"] == {"trec": 75.0, "lcc": 100.0, "avg_selected": 87.5} and got["changed"] == ["lcc/0"]


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvbench-score: "), err
    return err.strip()


def test_what_cannot_be_rescored_is_one_line_and_exit_2(tmp_path: Path, jsonl_run: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # The label-free fidelity task scores log-probabilities that predictions.jsonl does not keep.
    fid = write_run(tmp_path / "fid", run_config("model=tiny-llama", "policy=keydiff", "task=fidelity"),
                    [{"id": "L2048_0", "prediction": "x", "answers": [], "score": 50.0, "meta": {"length": 2048}}])
    assert score_main([str(fid)]) == 2
    assert _one_line_error(capsys) == ("kvbench-score: task 'fidelity' scores against the full cache's "
                                       "log-probabilities, which predictions.jsonl does not keep: its runs cannot be "
                                       "rescored")
    # Options of the other kind of directory.
    assert score_main([str(jsonl_run), "--longbench-e"]) == 2
    assert "--longbench-e is for LongBench prediction directories" in _one_line_error(capsys)
    assert score_main([str(jsonl_run), "--fuzz-backend", "levenshtein"]) == 2
    assert _one_line_error(capsys) == ("kvbench-score: --fuzz-backend applies to LongBench runs; this run's task is "
                                       "kvbench.tasks.jsonl.JsonlTask")
    # No config.yaml: the task is unknown.
    (jsonl_run / "config.yaml").unlink()
    assert score_main([str(jsonl_run)]) == 2
    assert _one_line_error(capsys) == f"kvbench-score: {jsonl_run} has predictions.jsonl but no config.yaml: the " \
                                      f"run's task is unknown"


def test_a_task_that_cannot_be_built_or_does_not_fit_the_records(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    mine = write_run(tmp_path / "mine", run_config(values={"task": {"_target_": "my_tasks.nowhere.Task"}}),
                     [record("a", "x", ["x"], 100.0)])
    assert score_main([str(mine)]) == 2
    assert _one_line_error(capsys) == ("kvbench-score: cannot build the run's task my_tasks.nowhere.Task: No module "
                                       "named 'my_tasks'")
    # jsonl records under a LongBench config: they have no meta.dataset.
    cfg = run_config("task=longbench", values={"task.datasets": ["trec"]})
    foreign = write_run(tmp_path / "foreign", cfg, [record("a", "x", ["x"], 100.0)])
    assert score_main([str(foreign)]) == 2
    assert _one_line_error(capsys) == (f"kvbench-score: {foreign / 'predictions.jsonl'}: record 'a': cannot score it "
                                       f"as task 'longbench' (KeyError: 'dataset')")


def test_a_directory_of_runs_names_them(tmp_path: Path, jsonl_run: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job"  # a `compare` job: one run directory per policy below it
    for name in ("keydiff", "full"):
        write_run(job / name, yaml.safe_load((jsonl_run / "config.yaml").read_text()), [])
    assert score_main([str(job)]) == 2
    assert _one_line_error(capsys) == (f"kvbench-score: no predictions.jsonl (a run directory) nor <dataset>.jsonl "
                                       f"files (LongBench predictions) in {job}; the runs below it: full, keydiff "
                                       f"(kvbench-score {job / 'full'})")
    assert score_main([str(job / "full")]) == 2  # a run with no finished sample yet
    assert _one_line_error(capsys) == f"kvbench-score: {job / 'full' / 'predictions.jsonl'}: no finished predictions"
    assert score_main([str(tmp_path / "missing")]) == 2
    assert _one_line_error(capsys) == f"kvbench-score: directory not found: {tmp_path / 'missing'}"
