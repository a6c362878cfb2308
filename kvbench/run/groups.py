"""kvbench's own configuration groups (conf/model, conf/policy, conf/task, conf/experiment) read as plain data: where
they are, which options a group has, one option's YAML, and whether a user's override has the kind of its default.
Below kvbench.run.config (Hydra's composition) and kvbench.run.settings, which both read them."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Mapping, Sequence


class ConfigError(ValueError):
    """A bad setting or group option (said in one line): a top-level setting's value, an unknown group option."""


# The repository's top-level conf/ ships as this package (pyproject.toml maps it), in wheels and editable installs.
CONF_PACKAGE = "kvbench.conf"


@functools.cache
def conf_dir() -> Path:
    """kvbench's own config directory (Hydra's primary config): `kvbench.conf` found through importlib.resources, so
    the same lookup serves a wheel (site-packages/kvbench/conf) and an editable install (the checkout's conf/)."""
    from importlib import resources

    try:
        root = resources.files(CONF_PACKAGE)
    except ModuleNotFoundError:
        raise RuntimeError(f"kvbench is installed without its configuration (package {CONF_PACKAGE}); reinstall it: "
                           f"pip install -e . (or make install)") from None
    return Path(str(root))


def group_choices(group: str, dirs: Sequence[Path] | None = None) -> list[str]:
    return sorted({p.stem for d in (dirs or [conf_dir()]) for p in (Path(d) / group).glob("*.yaml")})


def load_group(group: str, name: str, dirs: Sequence[Path] | None = None) -> dict[str, Any]:
    """A group option's YAML as a plain dict (used when one run composes several policies); the first of `dirs`
    (default: kvbench's conf/) that has it wins, as in Hydra's search path."""
    from omegaconf import OmegaConf

    dirs = dirs or [conf_dir()]
    for d in dirs:
        path = Path(d) / group / f"{name}.yaml"
        if path.is_file():
            return OmegaConf.to_container(OmegaConf.load(path), resolve=True)  # type: ignore[return-value]
    raise ConfigError(f"unknown {group} '{name}'; choose one of: {', '.join(group_choices(group, dirs))}")


def option_kind_error(group: str, spec: Mapping[str, Any]) -> str | None:
    """The one-line complaint about the first option in `spec` whose value is not of the kind of its default (a
    number, a string, a flag, a list, a mapping) in kvbench's YAML of the same `_target_` (`policy.window=abc`: the
    constructor would fail on it with an error that names no option, or take it); None when every one fits. Defaults
    of null, and targets kvbench's conf/ does not know (a user's own YAML), are not checked."""
    defaults = _defaults_by_target(group).get(str(spec.get("_target_"))) or {}
    kinds = ((bool, "true or false"), ((int, float), "a number"), (str, "a string"), (list, "a list"),
             (dict, "a mapping"))
    for key, default in defaults.items():
        if key not in spec or default is None or key == "_target_":
            continue
        want, words = next((k for k in kinds if isinstance(default, k[0])), (None, ""))
        value = spec[key]
        if want is not None and (not isinstance(value, want) or (want is not bool and isinstance(value, bool))):
            return f"{group}.{key} must be {words} (default {default!r}), got {value!r}"
    return None


@functools.cache
def _defaults_by_target(group: str) -> dict[str, dict[str, Any]]:
    """`_target_` -> the entries of the first of kvbench's YAMLs in `group` (by name) that instantiates it."""
    found = [load_group(group, name) for name in group_choices(group)]
    return {str(d["_target_"]): d for d in reversed(found) if d.get("_target_")}
