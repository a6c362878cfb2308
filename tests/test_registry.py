"""Registries: every policy/task YAML names a class, and every class has a YAML."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from kvbench.policies.base import Policy
from kvbench.run.config import CONF_DIR, load_group
from kvbench.tasks.base import Task

PKG = Path(__file__).resolve().parent.parent / "kvbench"


def _classes(package: str, base: type) -> set[str]:
    found = set()
    # A task or policy is a module, or a package (tasks/ruler/) whose __init__ holds the class.
    for path in sorted([*(PKG / package).glob("*.py"), *(PKG / package).glob("*/__init__.py")]):
        stem = path.parent.name if path.stem == "__init__" else path.stem
        if stem in (package, "base"):
            continue
        mod = importlib.import_module(f"kvbench.{package}.{stem}")
        for name, obj in inspect.getmembers(mod, inspect.isclass):
            if issubclass(obj, base) and obj is not base and obj.__module__ == mod.__name__:
                found.add(f"{mod.__name__}.{name}")
    return found


@pytest.mark.parametrize("group,package,base", [("policy", "policies", Policy), ("task", "tasks", Task)])
def test_every_yaml_has_a_class_and_every_class_a_yaml(group: str, package: str, base: type) -> None:
    targets = set()
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        spec = load_group(group, path.stem)
        module, _, cls = spec["_target_"].rpartition(".")
        assert hasattr(importlib.import_module(module), cls), spec["_target_"]
        targets.add(spec["_target_"])
    # Subclasses that are only building blocks of another policy (e.g. a base another one wraps) still need a
    # YAML of their own to be runnable: require it.
    assert _classes(package, base) <= targets


def _readme_row(key: str) -> set[str]:
    """The backquoted words of docs/running.md's `| `key=` | ... |` row (its settings table)."""
    import re

    readme = (PKG.parent / "docs" / "running.md").read_text()
    (row,) = [line for line in readme.splitlines() if line.startswith(f"| `{key}=` |")]
    return set(re.findall(r"`([^`]+)`", row.split("|")[2]))


@pytest.mark.parametrize("group,other", [
    ("model", {"conf/model/", "kvbench-fetch", "model.path=<hub id or local dir>"}),
    ("task", {"conf/task/"}),
])
def test_the_settings_table_lists_every_model_and_task_preset(group: str, other: set[str]) -> None:
    # Every conf/<group>/ option is named in the settings table's row, the default job's included, and the row names nothing
    # else in backquotes but the pinned extras (so a removed preset or a typo fails too).
    from kvbench.run.config import group_choices

    named = _readme_row(group)
    assert set(group_choices(group)) <= named
    assert named - set(group_choices(group)) == other
