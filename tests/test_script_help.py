"""Every result script with an argparse command line prints its --help (argparse formats each option's help with
%-formatting, so a bare "%" in a help text breaks --help, and only --help)."""

from __future__ import annotations

import pytest

from helpers import load_script

SCRIPTS = ("batch_identity", "budget_choice", "claims_side_by_side", "graded_validity", "logit_margin", "power_plan",
           "reproduce", "verdicts")


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_prints_and_exits_0(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        load_script(name).main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


@pytest.mark.parametrize("name", ["claims_table"])
def test_positional_scripts_print_help_and_exit_0(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    # (their main() takes paths, for the tests that call them; the command line is cli())
    with pytest.raises(SystemExit) as e:
        load_script(name).cli(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")
