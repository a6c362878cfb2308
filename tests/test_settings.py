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


def test_slot_reuse_defaults_on_but_not_for_older_runs(tmp_path) -> None:
    # a new run decodes with slot reuse; a stored config without the key was written before slot reuse existed and
    # decoded chronologically, so every reader of a stored config reads it as false, and one that records it as it says
    assert RUN_DEFAULTS["slot_reuse"] is True and RUN_DEFAULTS["batch_size"] == 1
    assert RunSettings.from_config({}).slot_reuse is True
    assert stored_config({"budget": 64}) == {"budget": 64, "slot_reuse": False, "stack_prefill": False}
    assert stored_config({"slot_reuse": True})["slot_reuse"] is True
    task = {"_target_": "kvbench.tasks.jsonl.JsonlTask"}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"task": task, "budget": 64}))
    assert read_run_config(tmp_path)["slot_reuse"] is False
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"task": task, "budget": 64, "slot_reuse": True}))
    assert read_run_config(tmp_path)["slot_reuse"] is True


@pytest.mark.parametrize("name, default, passed", [("evict_together", True, True), ("stack_prefill", "auto", None)])
def test_engine_settings_reach_the_engine_and_are_not_in_the_key(name: str, default: object, passed: object) -> None:
    # evict_together (on by default; false: each sample's decoding evictions on their own) and stack_prefill ("auto" by
    # default, which reaches the engine as None: the device decides; true: the prompt's evictions stacked over the
    # layers) go to GenerationSettings, and a run made either way resumes the other (the same selections:
    # tests/test_stack.py), as with slot_reuse
    from kvbench.run.loop import generation_settings
    from kvbench.tasks.base import Sample

    sample = Sample(id="s0", input_ids=[1, 2, 3], answers=["x"], max_new_tokens=4)
    plain, flipped = RunSettings.from_config({}), RunSettings.from_config({name: False})
    assert RUN_DEFAULTS[name] == default and getattr(plain, name) == default and getattr(flipped, name) is False
    assert getattr(generation_settings(plain, sample, ()), name) is passed
    assert getattr(generation_settings(flipped, sample, ()), name) is False
    assert flipped.recorded()[name] is False and plain.recorded()[name] == default
    assert flipped.key("keydiff") == plain.key("keydiff")  # the resume key leaves it out
    assert RunSettings.from_config({"budget": 64}).key("keydiff") != plain.key("keydiff")  # where a setting changes it
    with pytest.raises(ConfigError, match=name):
        RunSettings.from_config({name: "yes please"})


def test_stack_prefill_auto_stacks_on_a_gpu_only() -> None:
    # auto (None in the engine): stacked on a CUDA device, layer by layer on the CPU; a set flag wins on either
    import torch

    from kvbench.engine.generate import stacks_prefill

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert (stacks_prefill(None, gpu), stacks_prefill(None, cpu)) == (True, False)
    assert (stacks_prefill(True, cpu), stacks_prefill(False, gpu)) == (True, False)
    assert RunSettings.from_config({"stack_prefill": True}).stack_prefill is True
    with pytest.raises(ConfigError, match="stack_prefill must be true, false or auto, got 'on'"):
        RunSettings.from_config({"stack_prefill": "on"})
