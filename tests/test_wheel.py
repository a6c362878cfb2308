"""The installable package: the wheel built from the checkout holds every module and every config YAML (conf/ ships
as `kvbench.conf`), and once installed into a fresh environment, apart from the checkout, `kvbench` runs a
tiny-model job and `kvbench-report` reports it from a directory outside the repository; a user's own config
directory still composes on top of the installed one (`hydra.searchpath`)."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# Slow (20-30 s): CI runs it in its virtualenv stage (.ci/run: `-m "slow or not slow"`), the newcomer's environment,
# so `make test` does not run it a second time; `make test-all` does.
@pytest.mark.slow
def test_wheel_installs_apart_from_the_checkout_and_runs(tmp_path: Path) -> None:
    # Build from a copy of the sources, so the checkout gets no build/ or egg-info from this test.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("kvbench", "conf", "hydra_plugins"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    dist = tmp_path / "dist"
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
              str(src)], tmp_path, env)
    assert r.returncode == 0, r.stderr
    (wheel,) = dist.glob("kvbench-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kvbench").rglob("*.py")}
    assert modules - names == set()  # every module (pyproject.toml lists the packages by hand)
    configs = {"kvbench/conf/" + p.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").rglob("*.yaml")}
    assert len(configs) > 40 and configs - names == set()  # every group option, conf/hydra/launcher/ included
    assert {"kvbench/conf/__init__.py", "kvbench/conf/config.yaml", "kvbench/data/longbench.json"} <= names
    assert {"hydra_plugins/kvbench_slurm_launcher/__init__.py", "hydra_plugins/kvbench_slurm_launcher/_launcher.py",
            "hydra_plugins/kvbench_launcher/__init__.py", "hydra_plugins/kvbench_launcher/launcher.py"} \
        <= names  # kvbench's launchers (in-process with shared work; SLURM), Hydra plugins

    # A fresh environment that gets kvbench from the wheel only and reuses the packages of the interpreter running
    # the tests (torch, transformers, hydra, ...): a .pth file adds that interpreter's site directories. Not
    # `venv --system-site-packages`: run from inside a virtualenv, that would see the base Python's packages instead
    # of the virtualenv's. The venv's own site-packages comes first on sys.path, so its kvbench wins over an
    # editable install of the checkout.
    venv = tmp_path / "venv"
    r = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    assert r.returncode == 0, r.stderr
    py = venv / "bin" / "python"
    r = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env)
    assert r.returncode == 0, r.stderr
    site_dirs = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    (Path(r.stdout.strip()) / "kvbench_test_parent_site.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in site_dirs) + "\n")
    r = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--force-reinstall",
              str(wheel)], tmp_path, env)
    assert r.returncode == 0, r.stderr

    work = tmp_path / "work"  # outside the repository: nothing is found relative to the current directory
    work.mkdir()
    r = _run([str(py), "-c", "import kvbench, kvbench.run.config as c; print(kvbench.__file__); print(c.conf_dir())"],
             work, env)
    assert r.returncode == 0, r.stderr
    module_file, conf = map(Path, r.stdout.split())
    home = venv.resolve()
    assert module_file.resolve().is_relative_to(home) and conf.resolve().is_relative_to(home), r.stdout
    assert conf.name == "conf" and (conf / "policy" / "streamingllm.yaml").is_file()

    run_dir = tmp_path / "run"
    r = _run([str(venv / "bin" / "kvbench"), "model=tiny-llama", "task=niah", "task.context_lengths=[300]",
              "task.depths=[50]", "task.haystack=filler", "policy=streamingllm", "budget=128",
              "task.max_new_tokens=4", "progress=false", f"hydra.run.dir={run_dir}"], work, env)
    assert r.returncode == 0, r.stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["model"] == "tiny-llama" and metrics["policy"] == "streamingllm" and metrics["budget"] == 128
    assert set(metrics["scores"]) == {"L300_D50", "avg"}

    r = _run([str(venv / "bin" / "kvbench-report"), str(run_dir), "--no-plots"], work, env)
    assert r.returncode == 0, r.stderr
    assert "streamingllm" in (run_dir / "table.md").read_text()

    # A user's config directory composes on top of the installed conf/ (docs/extending.md's recipe).
    user = tmp_path / "user_conf"
    (user / "policy").mkdir(parents=True)
    (user / "policy" / "mine.yaml").write_text("_target_: kvbench.policies.streamingllm.StreamingLLM\nn_sink: 2\n")
    r = _run([str(venv / "bin" / "kvbench"), f"hydra.searchpath=[file://{user}]", "model=tiny-llama",
              "policy=mine", "--cfg", "job"], work, env)
    assert r.returncode == 0, r.stderr
    assert "n_sink: 2" in r.stdout and "kvbench.policies.streamingllm.StreamingLLM" in r.stdout
