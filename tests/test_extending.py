"""docs/extending.md's two recipes, followed to the letter from a temporary directory: a policy (one module + one
YAML) and a task (one module + one YAML + its metric), run through the real `kvbench` command with nothing in
the repository touched. The module texts below are the ones the guide shows."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "extending.md"

N, B = 48, 16  # budget and block of the runs below


def guide_block(title: str) -> str:
    """The code block that follows the line `<!-- file: title -->` in docs/extending.md."""
    text = GUIDE.read_text()
    m = re.search(rf"<!-- file: {re.escape(title)} -->\n```[a-z]*\n(.*?)```", text, re.S)
    assert m, f"docs/extending.md has no block for {title}"
    return m.group(1)


def write_files(root: Path, names: list[str]) -> None:
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(guide_block(name))


def kvbench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # the user's modules, importable as in the guide
    return subprocess.run([sys.executable, "-m", "kvbench.cli", "model=tiny-llama",
                           f"hydra.searchpath=[file://{tmp_path}/conf]", f"hydra.run.dir={tmp_path / 'run'}",
                           "progress=false", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout


def test_a_policy_from_one_module_and_one_yaml(tmp_path: Path) -> None:
    before = git_status()
    write_files(tmp_path, ["my_policies/first_coordinate.py", "conf/policy/first_coordinate.yaml"])
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "the cache keeps what the policy scores highest. " * 6,
                                "answers": ["x"], "max_new_tokens": 3}) + "\n")
    r = kvbench(tmp_path, "policy=first_coordinate", f"budget={N}", f"block={B}", "task=jsonl", f"task.path={data}")
    assert r.returncode == 0, r.stderr
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["policy"] == "first_coordinate" and metrics["budget"] == N
    record = json.loads((tmp_path / "run" / "predictions.jsonl").read_text().splitlines()[0])
    assert record["prompt_tokens"] > N + B  # so the policy had to evict, block after block
    assert record["peak_kv_tokens"] == N + B  # the engine held it to the budget plus one block
    assert git_status() == before  # nothing in the repository was touched


def test_a_task_from_one_module_one_yaml_and_its_metric(tmp_path: Path) -> None:
    before = git_status()
    write_files(tmp_path, ["my_tasks/repeat_word.py", "my_tasks/exact_start.py", "conf/task/repeat_word.yaml"])
    r = kvbench(tmp_path, "policy=streamingllm", f"budget={N}", f"block={B}", "task=repeat_word")
    assert r.returncode == 0, r.stderr
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    records = [json.loads(x) for x in (tmp_path / "run" / "predictions.jsonl").read_text().splitlines()]
    assert [x["id"] for x in records] == ["apple", "river", "stone"]
    for x in records:  # the guide's metric: 100 if the prediction starts with the answer (after spaces)
        assert x["score"] == (100.0 if x["prediction"].lstrip().startswith(x["answers"][0]) else 0.0)
        assert x["prompt_tokens"] > N + B
    assert metrics["scores"] == {"repeat_word": sum(x["score"] for x in records) / 3}
    assert git_status() == before
