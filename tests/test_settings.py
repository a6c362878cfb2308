"""The run settings' defaults in their two places: RunSettings' field defaults and kvbench.options.RUN_DEFAULTS (what
RunSettings.from_config takes for an absent key, and what the torch-free report reads for a key absent from an older
run's config.yaml)."""

from __future__ import annotations

import pytest
import yaml

from kvbench.options import RUN_DEFAULTS, stored_config
from kvbench.run.score import read_run_config
from kvbench.run.settings import ConfigError, RunSettings


def test_the_reports_defaults_are_the_runs() -> None:
    settings = {k: v for k, v in RunSettings().recorded().items() if k not in ("model", "policy", "task")}
    assert settings == RUN_DEFAULTS
    # an empty config reads every setting as its default too (from_config's own fallbacks), but for the protocol:
    # no block means the prompt in one forward, whose canonical protocol is prefill_once_decode_evict
    parsed = RunSettings.from_config({}).recorded()
    assert {k: parsed[k] for k in RUN_DEFAULTS if k != "protocol"} == {k: v for k, v in RUN_DEFAULTS.items()
                                                                      if k != "protocol"}


def test_retired_engine_settings_are_dropped_from_stored_configs(tmp_path) -> None:
    # slot_reuse, evict_together and stack_prefill said how the engine before the static slot cache decoded, never
    # what a result means: a stored config's are left out by every reader (stored_config, read_run_config), so a run
    # that recorded them reads as one that did not; a new run's config may no longer set them (unknown settings)
    assert not {"slot_reuse", "evict_together", "stack_prefill"} & set(RUN_DEFAULTS)
    old = {"budget": 64, "slot_reuse": False, "evict_together": True, "stack_prefill": "auto"}
    assert stored_config(old) == {"budget": 64} == stored_config({"budget": 64})
    task = {"_target_": "kvbench.tasks.jsonl.JsonlTask"}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"task": task, **old}))
    assert not {"slot_reuse", "evict_together", "stack_prefill"} & set(read_run_config(tmp_path))
    assert read_run_config(tmp_path)["budget"] == 64
    for name in ("slot_reuse", "evict_together", "stack_prefill"):
        with pytest.raises(ConfigError, match=f"unknown setting: {name}"):
            RunSettings.from_config({name: True})


def test_compile_reaches_the_engine_and_is_not_in_the_key() -> None:
    # compile (false by default: eager; true: each forward with its eviction as one compiled graph, the same
    # predictions) goes to GenerationSettings, and a run made either way resumes the other
    from kvbench.run.loop import generation_settings
    from kvbench.tasks.base import Sample

    sample = Sample(id="s0", input_ids=[1, 2, 3], answers=["x"], max_new_tokens=4)
    plain, flipped = RunSettings.from_config({}), RunSettings.from_config({"compile": True})
    assert RUN_DEFAULTS["compile"] is False and plain.compile is False and flipped.compile is True
    assert generation_settings(plain, sample, ()).compile is False
    assert generation_settings(flipped, sample, ()).compile is True
    assert flipped.recorded()["compile"] is True and plain.recorded()["compile"] is False
    assert flipped.key("keydiff") == plain.key("keydiff")  # the resume key leaves it out
    assert RunSettings.from_config({"budget": 64}).key("keydiff") != plain.key("keydiff")  # where a setting changes it
    with pytest.raises(ConfigError, match="compile must be true or false, got 'yes please'"):
        RunSettings.from_config({"compile": "yes please"})


def test_share_rows_is_true_false_decode_or_auto_and_not_in_the_key() -> None:
    # share_rows (auto by default: true on CUDA, decode elsewhere) changes how a group runs, never its records but for
    # a batch's rounding: not in the resume key;
    # a group shares with runs of its own share_rows only (the rest of the settings are the group key's)
    plain = RunSettings.from_config({})
    assert RUN_DEFAULTS["share_rows"] == "auto" == plain.share_rows
    for value in (True, False, "decode", "auto"):
        flipped = RunSettings.from_config({"share_rows": value})
        assert flipped.share_rows == value and flipped.key("keydiff") == plain.key("keydiff")
    assert RunSettings.from_config({"share_rows": True}).group_key() != plain.group_key()
    with pytest.raises(ConfigError, match="share_rows must be true, false, decode or auto, got 'rows'"):
        RunSettings.from_config({"share_rows": "rows"})
