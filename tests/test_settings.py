"""The run settings' defaults in their two places: RunSettings' field defaults and kvbench.options.RUN_DEFAULTS (what
RunSettings.from_config takes for an absent key, and what the torch-free report reads for a key absent from an older
run's config.yaml)."""

from __future__ import annotations

from kvbench.options import RUN_DEFAULTS
from kvbench.run.settings import RunSettings


def test_the_reports_defaults_are_the_runs() -> None:
    settings = {k: v for k, v in RunSettings().recorded().items() if k not in ("model", "policy", "task")}
    assert settings == RUN_DEFAULTS
    # an empty config reads every setting as its default too (from_config's own fallbacks), but for the protocol:
    # no block means the prompt in one forward, whose canonical protocol is prefill_once_decode_evict
    parsed = RunSettings.from_config({}).recorded()
    assert {k: parsed[k] for k in RUN_DEFAULTS if k != "protocol"} == {k: v for k, v in RUN_DEFAULTS.items()
                                                                      if k != "protocol"}


def test_slot_reuse_defaults_off() -> None:
    # every committed result decoded chronologically: a run that records no slot_reuse ran without it
    assert RUN_DEFAULTS["slot_reuse"] is False and RUN_DEFAULTS["batch_size"] == 1
