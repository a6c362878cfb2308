"""Every result script with an argparse command line prints its --help (argparse formats each option's help with
%-formatting, so a bare "%" in a help text breaks --help, and only --help)."""

from __future__ import annotations

import pytest

from helpers import load_script

SCRIPTS = ("batch_identity", "logit_margin", "reproduce", "verdicts")


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_prints_and_exits_0(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        load_script(name).main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")

