"""Resume: a killed run (SIGKILL mid-sample) continues to exactly the clean run's predictions; torn lines are
repaired; a finished run is not recomputed; the resume key covers policy and model; one process per run dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbench.run.app import run_lock
from kvbench.run.records import append_record, read_records
from kvbench.run.settings import ConfigError, RunSettings

from helpers import WORDS, run_config, word_samples

ROOT = Path(__file__).resolve().parent.parent
TIMING = ("prefill_s", "decode_s", "evict_s", "graded_s")
N_SAMPLES = 8


def _data(tmp_path: Path) -> Path:
    return word_samples(tmp_path / "data.jsonl", N_SAMPLES,
                        lambda i: " ".join(WORDS[(i + k) % len(WORDS)] for k in range(60)))


def _args(data: Path, run_dir: Path) -> list[str]:
    return ["model=tiny-llama", "task=jsonl", f"task.path={data}", "task.max_new_tokens=40", "policy=keydiff",
            "budget=48", "block=16", "progress=false", f"hydra.run.dir={run_dir}"]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _strip(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def test_torn_last_line_is_cut_and_appending_continues(tmp_path: Path) -> None:
    path = tmp_path / "predictions.jsonl"
    good = b'{"id": "a", "score": 1}\n{"id": "b", "score": 2}\n'
    path.write_bytes(good + b'{"id": "c", "sco')
    assert [r["id"] for r in read_records(path, repair=False)] == ["a", "b"]
    assert path.read_bytes() == good + b'{"id": "c", "sco'  # a report only reads: the file is untouched
    assert [r["id"] for r in read_records(path)] == ["a", "b"]
    assert path.read_bytes() == good
    append_record(path, {"id": "c", "score": 3})
    assert path.read_bytes() == good + b'{"id": "c", "score": 3}\n'


def test_repeated_id_keeps_first_record(tmp_path: Path) -> None:
    path = tmp_path / "predictions.jsonl"
    path.write_text('{"id": "a", "score": 1}\n{"id": "a", "score": 9}\n{"id": "b", "score": 2}\n')
    assert [(r["id"], r["score"]) for r in read_records(path)] == [("a", 1), ("b", 2)]


def test_resume_key_covers_policy_and_model_not_progress() -> None:
    def key(cfg: dict, name: str) -> str:
        return RunSettings.from_config(cfg).key(name)

    cfg = {"model": {"path": "x", "dtype": "float32"}, "policy": {"_target_": "p.P"}, "budget": 64, "progress": True}
    k = key(cfg, "keydiff")
    assert key(cfg, "tova") != k
    assert key({**cfg, "model": {"path": "x", "dtype": "bfloat16"}}, "keydiff") != k
    assert key({**cfg, "policy": {"_target_": "p.Q"}}, "keydiff") != k
    assert key({**cfg, "budget": 65}, "keydiff") != k
    assert key({**cfg, "shard": "0/2"}, "keydiff") != k
    assert key({**cfg, "progress": False, "overwrite": True, "device": "cpu", "compare": ["full"]}, "keydiff") == k


def test_resume_key_is_the_hash_of_the_settings_that_change_results() -> None:
    # The key runs already on disk carry: sha256 of the sorted JSON of the recorded config without the four options
    # that do not change results (compare, overwrite, device, progress) plus the policy's name, first 16 hex digits.
    # Written out by hand here, so a change of the key (which would refuse every existing run's resume) fails.
    import hashlib
    import json

    cfg = {"model": {"name": "m", "path": "x"}, "policy": {"_target_": "p.P"}, "task": {"_target_": "t.T"},
           "compare": ["full"], "budget": 64, "block": 16, "protocol": "blockwise", "seed": 0,
           "scenario": "question_aware", "save_prompts": False, "overwrite": False, "device": "auto", "shard": "1/2",
           "diagnostics": [], "graded": True, "progress": True}
    stable = {k: v for k, v in cfg.items() if k not in ("compare", "overwrite", "device", "progress")}
    stable["policy_name"] = "keydiff"
    expected = hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]
    assert RunSettings.from_config(cfg).key("keydiff") == expected


def test_settings_reject_an_unknown_top_level_key() -> None:
    with pytest.raises(ConfigError, match="unknown setting: budgett"):
        RunSettings.from_config({"budgett": 64})


def test_second_process_on_a_run_dir_is_refused(tmp_path: Path) -> None:
    with run_lock(tmp_path):
        with pytest.raises(ConfigError, match="another kvbench process"):
            with run_lock(tmp_path):
                pass
    with run_lock(tmp_path):  # released again
        pass


def _cfg(data: Path, **changes: object) -> dict:
    """The config the command line `_args(data, ...)` runs, with `changes` as further overrides."""
    overrides = [a for a in _args(data, Path("unused")) if not a.startswith("hydra.")]
    return run_config(*overrides, *(f"{k}={v}" for k, v in changes.items()))


def test_sigkill_mid_run_resumes_to_the_clean_predictions(tmp_path: Path) -> None:
    from kvbench.run.app import Session, run_one

    data = _data(tmp_path)
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    session = Session()
    m_clean = run_one(_cfg(data), "keydiff", clean, session)
    clean_records = _lines(clean / "predictions.jsonl")
    assert [r["id"] for r in clean_records] == [f"s{i}" for i in range(N_SAMPLES)]

    proc = subprocess.Popen([sys.executable, "-m", "kvbench.cli", *_args(data, killed)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    pred = killed / "predictions.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if pred.is_file() and pred.read_bytes().count(b"\n") >= 1:
            os.killpg(proc.pid, signal.SIGKILL)  # mid-way through the second sample
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    n_done = pred.read_bytes().count(b"\n")
    assert 1 <= n_done < N_SAMPLES
    assert not (killed / "metrics.json").exists()
    with pred.open("ab") as f:  # as if the kill had cut a write short
        f.write(b'{"id": "s7", "prediction": "tor')

    m_resumed = run_one(_cfg(data), "keydiff", killed, session)  # the same command again
    resumed = _lines(pred)
    assert [r["id"] for r in resumed] == [f"s{i}" for i in range(N_SAMPLES)]  # no duplicates, sample order
    assert _strip(resumed) == _strip(clean_records)
    assert m_resumed["scores"] == m_clean["scores"]

    # Finished: a rerun does not recompute (the file is byte-identical), another configuration is refused.
    before = pred.read_bytes()
    assert run_one(_cfg(data), "keydiff", killed, session)["scores"] == m_clean["scores"]
    assert pred.read_bytes() == before
    with pytest.raises(ConfigError, match="different configuration"):
        run_one(_cfg(data, budget=40), "keydiff", killed, session)
    with pytest.raises(ConfigError, match="different configuration"):  # same settings, another policy name
        run_one(_cfg(data), "keydiff-variant", killed, session)
    assert pred.read_bytes() == before


def test_predictions_without_run_json_are_not_reused(tmp_path: Path) -> None:
    from kvbench.run.app import Session, run_one

    data = _data(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "predictions.jsonl").write_text('{"id": "s0", "prediction": "x"}\n')
    with pytest.raises(ConfigError, match="without run.json"):
        run_one(_cfg(data), "keydiff", run_dir, Session())
