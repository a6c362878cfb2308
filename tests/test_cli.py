"""The command line: run directory contents, determinism, block=null vs block under full, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.models.tiny import build_tiny_model

from helpers import kvbench_main

TIMING = {"prefill_s", "decode_s", "evict_s", "graded_s"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("model")
    model, tok = build_tiny_model("tiny-llama", seed=3)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("data") / "qa.jsonl"
    words = "the river runs north while the mountain stands tall above the green valley".split()
    rows = []
    for i in range(3):
        text = " ".join(words[(j * (i + 1)) % len(words)] for j in range(400))
        rows.append({"id": f"q{i}", "prompt": text + " Question: what runs north? Answer:", "answers": ["river"],
                     "max_new_tokens": 6})
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbench.cli", *args, "progress=false"], capture_output=True,
                          text=True, cwd=cwd, timeout=600)


def predictions(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_run_directory_and_bound(model_dir: Path, data_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = kvbench_main("model=hf", f"model.path={model_dir}", "task=jsonl", f"task.path={data_file}", "policy=keydiff",
                     "budget=128", "block=32", "save_prompts=true", "progress=false", f"hydra.run.dir={out}")
    assert r.returncode == 0, r.stderr
    assert {"config.yaml", "predictions.jsonl", "metrics.json"} <= {p.name for p in out.iterdir()}
    m = json.loads((out / "metrics.json").read_text())
    assert set(m["scores"]) == {"jsonl"} and m["average"] == m["scores"]["jsonl"]
    st = m["stats"]
    assert st["peak_kv_tokens"] == 128 + 32
    prompt_tokens = [r["prompt_tokens"] for r in predictions(out)]
    assert st["prompt_tokens"] == sum(prompt_tokens)
    assert st["compression_ratio"] == pytest.approx(sum(min(1, 128 / n) for n in prompt_tokens) / 3, abs=1e-6)
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "evict_s", "kv_bytes_peak"):
        assert key in st
    recs = predictions(out)
    assert [r["id"] for r in recs] == ["q0", "q1", "q2"]
    assert all(r["prompt"].endswith("Answer:") and r["new_tokens"] <= 6 for r in recs)
    assert m["provenance"]["model_path"] == str(model_dir)


@pytest.mark.slow  # 37 s: two whole runs compared byte for byte (CI time; make test-all runs it)
def test_determinism_and_block_null_under_full(model_dir: Path, data_file: Path, tmp_path: Path) -> None:
    base = ["model=hf", f"model.path={model_dir}", "task=jsonl", f"task.path={data_file}", "budget=128"]
    for name, extra in (("a", ["policy=h2o", "block=32"]), ("b", ["policy=h2o", "block=32"]),
                        ("full32", ["policy=full", "block=32"]), ("fullnull", ["policy=full", "block=null"])):
        r = run_cli(*base, *extra, f"hydra.run.dir={tmp_path / name}")
        assert r.returncode == 0, r.stderr
    assert predictions(tmp_path / "a") == predictions(tmp_path / "b")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("peak_kv_tokens", "kv_bytes_peak")} for r in rows]
    assert strip(predictions(tmp_path / "full32")) == strip(predictions(tmp_path / "fullnull"))


@pytest.mark.parametrize("args,message", [
    (["policy=nope"], "unknown policy 'nope'; choose one of: "),
    (["model=nope"], "unknown model 'nope'; choose one of: "),
    (["task=nope"], "unknown task 'nope'; choose one of: "),
    (["budgte=3"], "Could not override 'budgte'; Key 'budgte' is not in struct"),  # no advice to append it
    # a key the option's YAML does not list: Hydra's advice kept (the first line alone left it out)
    (["task.samples_per_cell=2"], "Could not override 'task.samples_per_cell'; Key 'samples_per_cell' is not in "
                                  "struct; To append to your config use +task.samples_per_cell=2"),
    (["policy=streamingllm", "budget=4"], "budget 4 must exceed the 4 tokens"),
    (["policy=keydiff", "budget=0"], "budget must be a positive integer"),
    (["policy=keydiff", "block=0"], "block must be a positive integer or null"),
    (["policy=keydiff", "protocol=once"], "unknown protocol 'once'; choose one of: blockwise, prefill_once, "),
    (["task=jsonl"], "task=jsonl needs task.path"),
    (["task=niah", "+task.windows=bogus"], "niah: unknown windows 'bogus'; choose one of: shared, per_sample"),
    (["task=jsonl", "task.path=/nonexistent/file.jsonl"], "data file not found: /nonexistent/file.jsonl"),
    (["model=hf"], "model.path"),
    (["policy=keydiff", "model=hf", "model.path=/nonexistent/dir"], "model directory not found: /nonexistent/dir"),
    (["model=hf", "model.path=/nonexistent/dir"], "model directory not found: /nonexistent/dir"),  # compare mode
    # an option of another kind than its default in the YAML, named (the constructor's own error would not name it)
    (["policy=snapkv", "policy.window=abc"], "policy.window must be a number (default 32), got 'abc'"),
    (["policy=criticalkv", "policy.alpha=abc"], "policy.alpha must be a number (default 0.5), got 'abc'"),
    (["policy=knorm", "policy.skip_layers=3"], "policy.skip_layers must be a list (default [0, 1]), got 3"),
    (["policy=keydiff", "policy.anchor=true"], "policy.anchor must be a string (default 'mean_normalized'), got True"),
    (["task=niah", "task.context_lengths=abc"], "task.context_lengths must be a list (default [1024, 2048, 4096])"),
    # a default of null is not checked: the constructor's error, as one line
    (["task=longbench", "task.limit=abc"], "invalid literal for int() with base 10: 'abc'"),
    (["device=nope"], "unknown device 'nope'; use auto, cpu, cuda or cuda:N"),  # were tracebacks (exit 1)
    (["compare=[keydiff,nope]"], "unknown policy 'nope'; choose one of: "),
])
def test_bad_input_is_one_line_and_writes_nothing(args: list[str], message: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = kvbench_main(*args, "progress=false", f"hydra.run.dir={out}")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvbench: error: ") and message in lines[0], r.stderr
    assert not out.exists()


def test_a_device_torch_does_not_know_or_see_is_bad_input() -> None:
    import torch

    from kvbench.models.common import ModelError
    from kvbench.models.loading import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ModelError, match="^unknown device 'gpu0'; use auto, cpu, cuda or cuda:N$"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ModelError, match="torch sees no CUDA device here"):
            resolve_device("cuda:0")


def test_bad_input_to_the_installed_command_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    # The cases above run kvbench's main in this process; this one runs the command itself, so that nothing its
    # imports print (a warning, a log line) goes unseen.
    out = tmp_path / "run"
    r = run_cli("policy=nope", f"hydra.run.dir={out}")
    assert r.returncode == 2
    assert r.stderr.splitlines()[0].startswith("kvbench: error: unknown policy 'nope'; choose one of: ")
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert not out.exists()


def test_jsonl_line_without_prompt(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "x", "answers": ["y"]}\n{"id": "b", "answers": ["y"]}\n')
    r = kvbench_main("task=jsonl", f"task.path={bad}", "progress=false", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2
    assert r.stderr.strip() == f"kvbench: error: {bad}: line 2 needs a string 'prompt' (or 'context' and 'question')"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("task_args,bad_name", [
    (["task=jsonl"], "task.path"),
    (["task=fidelity"], "task.path"),
    # Read only while the samples are built (after the run directory exists): compare mode and a single policy.
    (["task=niah", "task.context_lengths=[512]", "task.depths=[50]"], "task.haystack_dir"),
    (["task=ruler", "task.tasks=[qa_1]", "task.lengths=[1024]", "task.num_samples=1", "policy=keydiff"],
     "task.squad_path"),
])
def test_binary_input_file_is_one_line_and_writes_nothing(task_args: list[str], bad_name: str,
                                                          tmp_path: Path) -> None:
    # Valid JSON up to a byte that is not UTF-8 (0xff), on line 2.
    data = b'{"id": "a", "prompt": "x", "answers": ["y"]}\n{"id": "b", "prompt": "\xff\xfe", "answers": []}\n'
    if bad_name == "task.haystack_dir":
        (tmp_path / "hay").mkdir()
        bad = tmp_path / "hay" / "essay.txt"
    else:
        bad = tmp_path / "data.jsonl"
    bad.write_bytes(data)
    target = bad.parent if bad_name == "task.haystack_dir" else bad
    out = tmp_path / "run"
    r = kvbench_main(*task_args, f"{bad_name}={target}", "progress=false", f"hydra.run.dir={out}")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("Loading weights")]
    assert lines == [f"kvbench: error: {bad}:2: not UTF-8 text (byte 0xff at offset 68); expected a UTF-8 "
                     f"text file"], r.stderr
    assert not out.exists()


def test_hydra_flag_values_are_not_taken_for_overrides() -> None:
    from kvbench.run.config import validate_overrides

    assert validate_overrides(["--cfg", "job", "model=tiny-llama"]) is None  # `job` is --cfg's value
    assert validate_overrides(["-c", "job", "policy=nope"]).startswith("unknown policy 'nope'; choose one of: ")


EDITABLE_INSTALL = """
import importlib.machinery, pkgutil, sys
repo = sys.argv[1]
sys.path = [p for p in sys.path if p not in ("", repo)]
class Finder:  # as an editable install's finder: kvbench's packages by name, no hydra_plugins folder on sys.path
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        where = {"kvbench": repo, "hydra_plugins.kvbench_launcher": repo + "/hydra_plugins",
                 "hydra_plugins.kvbench_slurm_launcher": repo + "/hydra_plugins"}.get(name)
        return importlib.machinery.PathFinder.find_spec(name, [where]) if where else None
sys.meta_path.insert(0, Finder)
import hydra_plugins
print("kvbench_launcher" in {m.name for m in pkgutil.iter_modules(hydra_plugins.__path__)})
from kvbench.run import config
config.expose_plugins()
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
print(sorted(c.__name__ for c in Plugins.instance().discover(Launcher) if c.__module__.startswith("hydra_plugins.kv")))
"""


def test_hydra_finds_the_launchers_of_an_editable_install(tmp_path: Path) -> None:
    # kvbench.cli imports no launcher: Hydra's plugin scan finds them, also where an editable install maps them
    # through an import finder that the scan cannot list (the first line: without expose_plugins it would not).
    repo = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", EDITABLE_INSTALL, str(repo)], capture_output=True, text=True,
                         cwd=tmp_path, check=True).stdout.splitlines()
    assert out == ["False", "['KvbenchLauncher', 'KvbenchSlurmLauncher']"]
