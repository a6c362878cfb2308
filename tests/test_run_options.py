"""Run options added with the layout: `compare` (several policies when none is chosen), the `applies` record the
report reads instead of importing policy classes, metrics named module:function, CriticalKV's composed base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.metrics import get_metric
from kvbench.metrics.basic import substring_any
from kvbench.policies.adakv import AdaKV
from kvbench.policies.criticalkv import CriticalKV
from kvbench.policies.snapkv import SnapKV
from kvbench.report.collect import collect_entries
from kvbench.run.app import run_configured
from kvbench.run.labels import NA
from kvbench.run.settings import ConfigError

from helpers import run_config


def _cfg(data: Path, *overrides: str, **top: object) -> dict:
    """tiny-llama on the one-line jsonl file `data`, N = 48, B = 16; `top` replaces top-level keys."""
    return run_config("model=tiny-llama", "task=jsonl", "task.max_new_tokens=3", "budget=48", "block=16",
                      "progress=false", *overrides, values={"task.path": str(data), **top})


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("data") / "d.jsonl"
    p.write_text(json.dumps({"id": "a", "prompt": "the river runs north past the mill. " * 5, "answers": ["x"]}) + "\n")
    return p


def test_no_policy_runs_every_compare_policy_in_its_own_directory(data: Path, tmp_path: Path) -> None:
    results = run_configured(_cfg(data, compare=["full", "streamingllm"]), {}, tmp_path)
    assert [r["policy"] for r in results] == ["full", "streamingllm"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "streamingllm"]
    assert [r["applies"] for r in results] == [{"budget": False, "protocol": False, "block": False},
                                               {"budget": True, "protocol": True, "block": True}]


def test_a_chosen_policy_runs_alone_whatever_compare_lists(data: Path, tmp_path: Path) -> None:
    cfg = _cfg(data, "policy=keydiff", compare=["full", "streamingllm"])
    results = run_configured(cfg, {"policy": "keydiff"}, tmp_path)
    assert [r["policy"] for r in results] == ["keydiff"]
    assert (tmp_path / "metrics.json").is_file() and not (tmp_path / "full").exists()


def test_no_policy_and_no_compare_list_is_one_line(data: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^no policy to run: choose one \(policy=NAME\) or list several"):
        run_configured(_cfg(data, compare=[]), {}, tmp_path)
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        run_configured(_cfg(data, compare=["full", "nope"]), {}, tmp_path)
    assert list(tmp_path.iterdir()) == []  # a bad name fails before any run starts


def _write_run(root: Path, name: str, metrics: dict) -> None:
    d = root / name
    d.mkdir()
    base = {"task": "jsonl", "model": "m", "budget": 64, "block": 128, "protocol": "blockwise", "reference": False,
            "scores": {"jsonl": 50.0}, "average": 50.0, "composition": {}, "stats": {"samples": 1},
            "layout": {"columns": [{"score": "jsonl", "category": "jsonl"}], "average": "jsonl", "recipe": None}}
    (d / "metrics.json").write_text(json.dumps({**base, **metrics}))


def test_report_reads_which_settings_apply_from_the_run(tmp_path: Path) -> None:
    none = {"budget": False, "protocol": False, "block": False}
    _write_run(tmp_path, "full", {"policy": "full", "budget": None, "applies": none, "reference": True})
    _write_run(tmp_path, "keydiff", {"policy": "keydiff", "applies": {"budget": True, "protocol": True,
                                                                       "block": True}})
    _write_run(tmp_path, "recorded", {"policy": "mine", "applies": {"budget": True, "protocol": True,
                                                                     "block": False}})
    entries, _ = collect_entries(tmp_path)
    got = {e.policy: (e.settings["budget"], e.settings["protocol"], e.settings["block"]) for e in entries}
    assert got == {"full": (NA, NA, NA), "keydiff": (64, "blockwise", 128), "mine": (64, "blockwise", NA)}
    assert [e.reference for e in entries] == [True, False, False]


def test_metrics_by_registry_name_or_module_function() -> None:
    assert get_metric("substring_any") is substring_any
    assert get_metric("kvbench.metrics.basic:substring_any") is substring_any
    with pytest.raises(KeyError, match="no function nope in an importable module kvbench.metrics.basic"):
        get_metric("kvbench.metrics.basic:nope")
    with pytest.raises(KeyError, match="unknown metric 'nope'"):
        get_metric("nope")


def test_criticalkv_composes_its_base_with_max_pooling() -> None:
    on_snap, on_ada = CriticalKV(budget=64), CriticalKV(budget=64, base="adakv", alpha_safeguard=0.3)
    assert type(on_snap.base) is SnapKV and type(on_ada.base) is AdaKV
    assert (on_snap.base.pooling, on_ada.base.pooling) == ("max", "max")  # CriticalKV 4.3
    assert on_ada.base.alpha_safeguard == 0.3 and on_snap.query_window == 32 and on_snap.n_recent == 32
