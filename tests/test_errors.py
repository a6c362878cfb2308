"""kvbench.errors.error_line, the one way an exception becomes one line, and the places that quote a library's
error through it (model loading, the bench's model configs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.errors import error_line


@pytest.mark.parametrize("exc, line, typed", [
    (ValueError("bad budget"), "bad budget", "ValueError: bad budget"),
    (OSError("  first line  \nsecond line\nthird"), "first line", "OSError: first line"),
    (RuntimeError("\n\n   after blank lines\nmore"), "after blank lines", "RuntimeError: after blank lines"),
    (ValueError(""), "ValueError", "ValueError"),  # nothing to say: the type's name, not an empty line
    (ValueError(" \n\t\n "), "ValueError", "ValueError"),
    (KeyError("k"), "'k'", "KeyError: 'k'"),  # str(KeyError) quotes its key
    (TypeError(), "TypeError", "TypeError"),
])
def test_error_line_by_hand(exc: BaseException, line: str, typed: str) -> None:
    assert error_line(exc) == line
    assert error_line(exc, with_type=True) == typed


def test_a_subclass_is_named_by_its_own_type() -> None:
    class PolicyTrouble(ValueError):
        pass

    assert error_line(PolicyTrouble()) == "PolicyTrouble"
    assert error_line(PolicyTrouble("x\ny"), with_type=True) == "PolicyTrouble: x"


def test_model_loading_quotes_the_first_line_of_the_library_error(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from kvbench.models.common import ModelError
    from kvbench.models.loading import load_model

    def broken(path: str, **kw: object) -> None:
        raise ValueError("Couldn't instantiate the tokenizer from one of:\n(1) a file\n(2) a class")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", broken)
    with pytest.raises(ModelError) as info:
        load_model("m", str(tmp_path), device="cpu")
    assert str(info.value) == f"cannot load model '{tmp_path}': Couldn't instantiate the tokenizer from one of:"


def test_bench_model_config_quotes_the_first_line_of_the_library_error(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from kvbench.bench import setup

    messages = iter(["\nno config.json here\nsee the docs", ""])

    def broken(path: str, **kw: object) -> None:
        raise OSError(next(messages))

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", broken)
    with pytest.raises(setup.BenchError) as info:
        setup.build_model(config=str(tmp_path))
    assert str(info.value) == f"cannot read model config '{tmp_path}': no config.json here"
    # An empty message names the exception instead of ending the line on ": ".
    with pytest.raises(setup.BenchError) as info:
        setup.build_model(config=str(tmp_path))
    assert str(info.value) == f"cannot read model config '{tmp_path}': OSError"


def test_bench_model_config_at_a_path_that_does_not_exist_says_so(tmp_path: Path) -> None:
    from kvbench.bench import setup

    # transformers read it as a hub id and complained about the repo id's characters
    with pytest.raises(setup.BenchError) as info:
        setup.build_model(config=str(tmp_path / "none"))
    assert str(info.value) == f"cannot read model config '{tmp_path / 'none'}': no such file or directory"
