"""Config-side helpers: where conf/ lives, early validation of command-line overrides, group YAML loading.

Hydra is imported lazily inside functions (no import-time side effects); only this module and the CLI use it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterable, Sequence

from kvbench.run.labels import model_label, policy_label, protocol_label

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ("model", "policy", "task", "experiment")
# Files Hydra writes into a run directory before the job starts; a directory holding only these has no results.
_HYDRA_ONLY = {".hydra", "cli.log", "kvbench.log", "main.log", "_job.log", ".lock"}


def conf_dirs(searchpath: Iterable[str] = ()) -> list[Path]:
    """Where group options are found: conf/, then the `file://` directories of `hydra.searchpath` (a user's own
    policies, tasks and models kept outside the repository; docs/extending.md)."""
    return [CONF_DIR] + [Path(str(p)[len("file://"):]) for p in searchpath if str(p).startswith("file://")]


def group_choices(group: str, dirs: Sequence[Path] = (CONF_DIR,)) -> list[str]:
    return sorted({p.stem for d in dirs for p in (Path(d) / group).glob("*.yaml")})


def load_group(group: str, name: str, dirs: Sequence[Path] = (CONF_DIR,)) -> dict[str, Any]:
    """A group option's YAML as a plain dict (used when one run composes several policies); the first of `dirs`
    that has it wins, as in Hydra's search path."""
    from omegaconf import OmegaConf

    for d in dirs:
        path = Path(d) / group / f"{name}.yaml"
        if path.is_file():
            return OmegaConf.to_container(OmegaConf.load(path), resolve=True)  # type: ignore[return-value]
    raise ValueError(f"unknown {group} '{name}'; choose one of: {', '.join(group_choices(group, dirs))}")


def register_resolvers() -> None:
    """The resolvers conf/config.yaml's run directory names use (${kvbench_model:...}, ${kvbench_protocol:...},
    ${kvbench_policy:...}).
    Called by the CLI before Hydra composes anything; registering twice is harmless."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("kvbench_model", model_label, replace=True)
    OmegaConf.register_new_resolver("kvbench_protocol", protocol_label, replace=True)
    OmegaConf.register_new_resolver("kvbench_policy", policy_label, replace=True)


def validate_overrides(argv: list[str]) -> str | None:
    """One-line message for command-line overrides that cannot compose (unknown group option, unknown key,
    bad syntax), or None. Sweep values are checked one by one; with --multirun every job of the sweep
    (command line plus an experiment's hydra.sweeper.params) is composed and its settings, policy and task
    are built before the first job starts (up to MAX_PREFLIGHT_JOBS jobs)."""
    if any(a in ("-h", "--help", "--hydra-help", "--info", "-i") or a.startswith("--info") for a in argv):
        return None
    overrides = [a for a in argv if not a.startswith("-")]
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        return _first_line(e)
    searchpath = [o for o in parsed if o.key_or_group == "hydra.searchpath"]
    dirs = conf_dirs(searchpath[-1].value() if searchpath else ())
    searchpath_lines = [o.input_line for o in searchpath[-1:]]  # composing needs the user's config directories too
    plain = list(searchpath_lines)
    for o in parsed:
        key = o.key_or_group
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        if key in GROUPS and o.package is None:
            for v in values:
                if v not in group_choices(key, dirs):
                    return f"unknown {key} '{v}'; choose one of: {', '.join(group_choices(key, dirs))}"
        if key.startswith("hydra.") or key == "hydra":
            continue
        prefix = "+" if o.is_add() else ("~" if o.is_delete() else ("++" if o.is_force_add() else ""))
        plain.append(f"{prefix}{key}={values[0]}" if not o.is_delete() else f"~{key}")
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=plain, return_hydra_config=True)
            if "-m" in argv or "--multirun" in argv:
                return _preflight(compose, cfg, [o for o in overrides if not o.lstrip("+~").startswith("hydra")], dirs,
                                  searchpath_lines)
    except Exception as e:  # noqa: BLE001 - any compose failure is reported as one line
        return _first_line(e)
    finally:
        GlobalHydra.instance().clear()
    return None


MAX_PREFLIGHT_JOBS = 256


def sweep_jobs(sweeper_params: dict[str, Any] | None, overrides: list[str]) -> list[list[str]]:
    """The jobs of a basic-launcher sweep, as Hydra's BasicSweeper expands them: the config's
    hydra.sweeper.params first, command-line overrides after (a key given on both wins on the command line)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [f"{k}={v}" for k, v in (sweeper_params or {}).items()] + overrides
    parsed = OverridesParser.create().parse_overrides(args)
    return [job for chunk in BasicSweeper.split_arguments(parsed, None) for job in chunk]


def _preflight(compose: Any, cfg: Any, overrides: list[str], dirs: Sequence[Path],
               searchpath: list[str]) -> str | None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from kvbench.run.settings import RunSettings, build_policy, build_task, user_errors

    params = OmegaConf.to_container(cfg.hydra.sweeper.params) if cfg.hydra.sweeper.get("params") else None
    jobs = sweep_jobs(params, overrides)
    if len(jobs) > MAX_PREFLIGHT_JOBS:
        return None
    parser = OverridesParser.create()
    composed: dict[tuple[str, ...], Any] = {}
    tasks_seen: set[str] = set()
    for job in jobs:
        try:
            # Compose once per combination of group choices (the slow part); plain key=value overrides are
            # then set on a copy, as Hydra applies them after the defaults list.
            parsed = parser.parse_overrides(job)
            simple = [o for o in parsed if not (o.key_or_group in GROUPS or "/" in o.key_or_group or o.is_add()
                                                or o.is_delete() or o.is_force_add())]
            base = tuple(o.input_line for o in parsed if o not in simple)
            if base not in composed:
                composed[base] = compose(config_name="config", overrides=[*searchpath, *base])
            job_cfg = composed[base].copy()
            for o in simple:
                OmegaConf.update(job_cfg, o.key_or_group, o.value(), merge=False)
            job_cfg = OmegaConf.to_container(job_cfg, resolve=True)
            settings = RunSettings.from_config(job_cfg)
            policies = [job_cfg["policy"]] if job_cfg.get("policy") else [
                load_group("policy", str(n), dirs) for n in job_cfg.get("compare") or []]
            for policy_cfg in policies:
                build_policy(policy_cfg, settings)
            task_key = repr(job_cfg["task"])
            if task_key not in tasks_seen:
                build_task(job_cfg["task"])
                tasks_seen.add(task_key)
        except user_errors() + (ValueError,) as e:
            return f"sweep job [{' '.join(job)}]: {_first_line(e)}"
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def remove_if_empty_run(run_dir: Path) -> None:
    """Remove a run directory that holds nothing but Hydra's own files (a run that failed before any result)."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= _HYDRA_ONLY:
        shutil.rmtree(run_dir, ignore_errors=True)
