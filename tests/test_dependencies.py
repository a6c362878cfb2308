"""Declared dependencies and imports agree: every third-party package kvbench, its tests and scripts import is
declared in pyproject.toml (a dependency or an optional extra), and every declared package is used."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Imported module name -> distribution name, where the two differ.
# `hydra_plugins` alone: the namespace Hydra's plugin scan reads (kvbench.run.config.expose_plugins), Hydra's own.
DISTRIBUTION_OF = {"yaml": "pyyaml", "hydra": "hydra-core", "hydra_plugins": "hydra-core",
                   "Levenshtein": "python-levenshtein",
                   "hydra_plugins.hydra_submitit_launcher": "hydra-submitit-launcher",
                   "hydra_plugins.hydra_joblib_launcher": "hydra-joblib-launcher"}
# Declared but never imported, each with the reason it is needed.
USED_WITHOUT_IMPORT = {
    "accelerate": "transformers refuses to load a GGUF file without it (model=smollm2-135m)",
    "hydra-joblib-launcher": "Hydra finds it as hydra/launcher=joblib (conf/hydra/launcher/parallel.yaml)",
    "pytest-xdist": "`make test` runs the suite on two workers (pytest -n, Makefile)",
}
# Imported but not a dependency of kvbench: the peer a comparison script measures kvbench against.
SOURCES = ("kvbench", "hydra_plugins", "tests", "scripts")
NOT_A_DEPENDENCY = {"kvpress": "scripts/peer_kvpress.py compares kvbench with it; its README says how to install"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def declared() -> dict[str, str]:
    """Distribution name -> where pyproject.toml declares it ("dependencies" or "extra:<name>")."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {_name(r): "dependencies" for r in project["dependencies"]}
    for extra, reqs in project.get("optional-dependencies", {}).items():
        for r in reqs:
            out.setdefault(_name(r), f"extra:{extra}")
    return out


def imported(folders: tuple[str, ...]) -> dict[str, str]:
    """Third-party distribution name -> one file importing it, over the .py files below `folders`."""
    # The repo's own modules: the package, its launchers, and the tests' and scripts' sibling modules (a script
    # imports another script from scripts/, which its own folder puts on sys.path).
    local = ({"kvbench", "hydra_plugins.kvbench_launcher", "hydra_plugins.kvbench_slurm_launcher"}
             | {p.stem for folder in ("tests", "scripts") for p in (ROOT / folder).glob("*.py")})
    out: dict[str, str] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    parts = name.split(".")
                    # hydra_plugins is Hydra's namespace package: its second part names the distribution.
                    top = ".".join(parts[:2]) if parts[0] == "hydra_plugins" and len(parts) > 1 else parts[0]
                    if top in sys.stdlib_module_names or top in local or top == "__future__":
                        continue
                    dist = DISTRIBUTION_OF.get(top, top).lower().replace("_", "-")
                    out.setdefault(dist, path.relative_to(ROOT).as_posix())
    return out


def test_every_import_is_declared() -> None:
    decl = declared()
    undeclared = {d: f for d, f in imported(SOURCES).items()
                  if d not in decl and d not in NOT_A_DEPENDENCY}
    assert undeclared == {}


def test_the_package_imports_only_its_required_dependencies_at_top_level() -> None:
    # Optional extras (python-Levenshtein, nltk, the launchers) are imported only where an option asks for them,
    # inside a function, so `import kvbench...` never needs them.
    decl = declared()
    for path in sorted((ROOT / "kvbench").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "level", 0) == 0:
                mod = node.names[0].name if isinstance(node, ast.Import) else node.module
                top = (mod or "").split(".")[0]
                dist = DISTRIBUTION_OF.get(top, top).lower().replace("_", "-")
                if dist in decl:
                    assert decl[dist] == "dependencies", f"{path.relative_to(ROOT)} imports {mod} at top level"


def test_every_declared_dependency_is_used() -> None:
    used = set(imported(SOURCES)) | set(USED_WITHOUT_IMPORT)
    assert {d: where for d, where in declared().items() if d not in used} == {}


def test_the_joblib_launcher_said_to_be_used_is_named_by_a_launcher_preset() -> None:
    presets = "".join(p.read_text() for p in (ROOT / "conf" / "hydra" / "launcher").glob("*.yaml"))
    assert "- joblib" in presets


def test_xdist_said_to_be_used_runs_make_test() -> None:
    recipe = (ROOT / "Makefile").read_text().split("\ntest: install\n", 1)[1].split("\n\n", 1)[0]
    assert "-m pytest -n $(TEST_WORKERS)" in recipe
