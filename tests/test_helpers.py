"""The tests' own helpers (tests/helpers.py, tests/conftest.py): the run-config builder composes the real
conf/config.yaml, and the `model` fixture builds the variant a module's `tiny_model` marker asks for."""

from __future__ import annotations

import pytest
import yaml

from kvbench.run.config import conf_dir
from kvbench.run.settings import RunSettings

from helpers import run_config

pytestmark = pytest.mark.tiny_model("tiny-llama", num_hidden_layers=3)


def test_run_config_is_the_default_job_without_overrides() -> None:
    cfg = run_config()
    raw = yaml.safe_load((conf_dir() / "config.yaml").read_text())
    top = {k for k in raw if k not in ("defaults", "hydra")}
    # config.yaml's keys and the chosen groups' sections; `policy: null` chooses none (the `compare` list runs).
    assert set(cfg) == top | {"model", "task"}
    assert (cfg["model"]["name"], cfg["budget"], cfg["block"]) == ("smollm2-135m", 640, 128)
    assert cfg["task"]["context_lengths"] == [1000] and cfg["task"]["depths"] == [25, 75]  # task=niah_1k
    assert cfg["compare"] == raw["compare"]


def test_overrides_then_values() -> None:
    cfg = run_config("model=tiny-llama", "policy=snapkv", "policy.window=8", "budget=48",
                     values={"task.path": "x.jsonl", "block": None, "model": {"name": "m"}})
    assert cfg["model"] == {"name": "m"}  # a whole section replaced
    assert cfg["policy"]["window"] == 8 and cfg["policy"]["kernel"] == 7  # the rest of snapkv.yaml stays
    assert (cfg["budget"], cfg["block"], cfg["task"]["path"]) == (48, None, "x.jsonl")
    RunSettings.from_config(run_config("model=tiny-llama", "policy=snapkv"))  # a config the run accepts as it is


def test_each_config_is_a_fresh_copy() -> None:
    a = run_config("model=tiny-llama")
    a["task"]["depths"].append(99)
    a["budget"] = 1
    b = run_config("model=tiny-llama")
    assert b["task"]["depths"] == [25, 75] and b["budget"] == 640


def test_the_marker_picks_the_model_variant(model) -> None:
    # This module's marker asks for 3 layers; conftest's default tiny-llama has 2.
    assert model.config.num_hidden_layers == 3
