"""Every result script with an argparse command line prints its --help (argparse formats each option's help with
%-formatting, so a bare "%" in a help text breaks --help, and only --help)."""

from __future__ import annotations

import pytest

from helpers import load_script

SCRIPTS = ("batch_identity", "budget_choice", "claims_side_by_side", "graded_validity",
           "logit_margin", "power_plan", "reproduce", "slot_logits", "stack_pairs", "verdicts")


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_prints_and_exits_0(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        load_script(name).main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_migrate_runs_help_is_its_docstring(capsys: pytest.CaptureFixture[str]) -> None:
    # (no argparse: its only arguments are run directories; --help is not taken for one)
    module = load_script("migrate_runs")
    assert module.main(["--help"]) == 0
    assert capsys.readouterr().out.strip() == module.__doc__.strip()


@pytest.mark.parametrize("name", ["claims_table", "niah_heatmaps"])
def test_positional_scripts_print_help_and_exit_0(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    # (their main() takes paths, for the tests that call them; the command line is cli())
    with pytest.raises(SystemExit) as e:
        load_script(name).cli(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_niah_heatmaps_refuses_a_missing_runs_directory(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert load_script("niah_heatmaps").cli([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a directory" in err and not (tmp_path / "out").exists()


def test_slot_logits_bad_input_is_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    module = load_script("slot_logits")
    assert module.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.strip().endswith("is not a run directory (config.yaml, predictions.jsonl)")
    assert module.main([str(tmp_path), "--shard", "3/2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--shard takes i/n with 0 <= i < n, got '3/2'" in err
