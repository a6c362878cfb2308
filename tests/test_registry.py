"""Registries and the one-way import structure (style.md): every policy/task YAML names a class, every class
has a YAML, and modules import only in the allowed direction."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from kvbench.config import CONF_DIR, load_group
from kvbench.policies.base import Policy
from kvbench.tasks.base import Task

PKG = Path(__file__).resolve().parent.parent / "kvbench"


def _classes(package: str, base: type) -> set[str]:
    found = set()
    for path in sorted((PKG / package).glob("*.py")):
        if path.stem in ("__init__", "base"):
            continue
        mod = importlib.import_module(f"kvbench.{package}.{path.stem}")
        for name, obj in inspect.getmembers(mod, inspect.isclass):
            if issubclass(obj, base) and obj is not base and obj.__module__ == mod.__name__:
                found.add(f"{mod.__name__}.{name}")
    return found


@pytest.mark.parametrize("group,package,base", [("policy", "policies", Policy), ("task", "tasks", Task)])
def test_every_yaml_has_a_class_and_every_class_a_yaml(group: str, package: str, base: type) -> None:
    targets = set()
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        spec = load_group(group, path.stem)
        if "compare" in spec:  # policy=compare lists policies; it is not one
            assert all((CONF_DIR / group / f"{n}.yaml").is_file() for n in spec["compare"])
            continue
        module, _, cls = spec["_target_"].rpartition(".")
        assert hasattr(importlib.import_module(module), cls), spec["_target_"]
        targets.add(spec["_target_"])
    # Subclasses that are only building blocks of another policy (e.g. a base another one wraps) still need a
    # YAML of their own to be runnable: require it.
    assert _classes(package, base) <= targets


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _files(sub: str = "") -> list[Path]:
    return sorted((PKG / sub).rglob("*.py")) if sub else sorted(PKG.glob("*.py"))


def test_import_direction() -> None:
    all_files = sorted(PKG.rglob("*.py"))
    for f in all_files:
        imps = _imports(f)
        rel = f.relative_to(PKG).as_posix()
        assert "kvbench.cli" not in imps, f"{rel} imports the cli"
        if rel not in ("cli.py", "config.py"):
            assert not any(i == "hydra" or i.startswith("hydra.") for i in imps), f"{rel} imports hydra"
        if rel.startswith("policies/"):
            bad = [i for i in imps if i.startswith(("kvbench.runner", "kvbench.tasks", "kvbench.metrics",
                                                     "kvbench.app"))]
            assert not bad, f"{rel} imports {bad}"
        if rel.startswith("metrics/"):
            bad = [i for i in imps if i.startswith("kvbench") and not i.startswith("kvbench.metrics")]
            assert not bad, f"{rel} imports {bad}"
        if rel.startswith("tasks/"):
            bad = [i for i in imps if i.startswith(("kvbench.runner", "kvbench.cache", "kvbench.policies",
                                                     "kvbench.attention", "kvbench.app"))]
            assert not bad, f"{rel} imports {bad}"
