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
