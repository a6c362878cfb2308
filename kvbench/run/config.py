"""Config-side helpers: early validation of command-line overrides, the jobs of a sweep (where conf/ lives and its
group YAMLs: kvbench.run.groups, re-exported here).

Hydra is imported lazily inside functions (no import-time side effects); only this module and the CLI use it, and
only its public API (nothing from Hydra's private modules).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from kvbench.errors import error_line
from kvbench.run.groups import CONF_PACKAGE, conf_dir, group_choices, load_group  # noqa: F401 (re-exported)
from kvbench.run.labels import model_label, policy_label, protocol_label

GROUPS = ("model", "policy", "task", "experiment")


def __getattr__(name: str) -> Any:
    # CONF_DIR is looked up on first use rather than when this module is imported.
    if name == "CONF_DIR":
        return conf_dir()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def conf_dirs(searchpath: Iterable[str] = ()) -> list[Path]:
    """Where group options are found: kvbench's conf/, then the `file://` and `pkg://` entries of `hydra.searchpath`
    (a user's own policies, tasks and models kept outside the repository; docs/extending.md)."""
    from importlib import resources

    dirs = [conf_dir()]
    for p in map(str, searchpath):
        if p.startswith("file://"):
            dirs.append(Path(p[len("file://"):]))
        elif p.startswith("pkg://"):
            try:
                dirs.append(Path(str(resources.files(p[len("pkg://"):].replace("/", ".")))))
            except ModuleNotFoundError:
                continue  # Hydra reports a search path it cannot read
    return dirs


def expose_plugins() -> None:
    """Let Hydra's plugin scan find kvbench's launchers (hydra_plugins/kvbench_launcher, kvbench_slurm_launcher).

    The scan lists the `hydra_plugins` namespace's folders. A wheel installs kvbench's into site-packages' folder, which
    it lists; an editable install reaches them through setuptools' import finder, whose namespace entry the scan cannot
    list, so the folder that holds them joins the namespace's path. Nothing is imported here but the namespace."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("hydra_plugins.kvbench_launcher")
    except ImportError:
        return
    if spec is None or not spec.submodule_search_locations:
        return
    import hydra_plugins

    root = str(Path(list(spec.submodule_search_locations)[0]).parent)
    if root not in list(hydra_plugins.__path__):
        hydra_plugins.__path__ = [*hydra_plugins.__path__, root]


def register_resolvers() -> None:
    """The resolvers conf/config.yaml's run directory names use (${kvbench_model:...}, ${kvbench_protocol:...},
    ${kvbench_policy:...}).
    Called by the CLI before Hydra composes anything; registering twice is harmless."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("kvbench_model", model_label, replace=True)
    OmegaConf.register_new_resolver("kvbench_protocol", protocol_label, replace=True)
    OmegaConf.register_new_resolver("kvbench_policy", policy_label, replace=True)


# Hydra's command-line flags that take a value as the next argument.
_VALUED = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
           "--experimental-rerun"}


def validate_overrides(argv: list[str]) -> str | None:
    """One-line message for command-line overrides that cannot compose (unknown group option, unknown key,
    bad syntax), or None. Sweep values are checked one by one; with --multirun every job of the sweep
    (command line plus an experiment's hydra.sweeper.params) is composed and its settings, policy and task
    are built before the first job starts (up to MAX_PREFLIGHT_JOBS jobs)."""
    if any(a in ("-h", "--help", "--hydra-help", "--info", "-i") or a.startswith("--info") for a in argv):
        return None
    # Hydra's own flags and the values of those that take one (`--cfg job`) are not overrides.
    overrides = [a for i, a in enumerate(argv) if not a.startswith("-") and (i == 0 or argv[i - 1] not in _VALUED)]
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        return error_line(e)
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
        if (key.startswith("hydra.") and not key.startswith("hydra.launcher.")) or key == "hydra":
            continue  # (the launcher's keys are composed: a SLURM launcher's resources are checked below)
        prefix = "+" if o.is_add() else ("~" if o.is_delete() else ("++" if o.is_force_add() else ""))
        plain.append(f"{prefix}{key}={values[0]}" if not o.is_delete() else f"~{key}")
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = compose(config_name="config", overrides=plain, return_hydra_config=True)
            if "-m" in argv or "--multirun" in argv:
                launcher_error = _slurm_launcher_error(cfg)
                if launcher_error:
                    return launcher_error
                return _preflight(compose, cfg, [o for o in overrides if not o.lstrip("+~").startswith("hydra")], dirs,
                                  searchpath_lines)
    except Exception as e:  # noqa: BLE001 - any compose failure is reported as one line
        if re.search(r"Could not (load|find) 'hydra/launcher/", str(e)):  # a launcher preset without its plugin
            return f"{error_line(e)}: install the launchers with `pip install -e .[launchers]`"
        return _compose_line(e)
    finally:
        GlobalHydra.instance().clear()
    return None


# kvbench's SLURM launcher (conf/hydra/launcher/slurm*.yaml), and the hydra.launcher keys that say what one job asks
# SLURM for.
KVBENCH_SLURM_LAUNCHER = "hydra_plugins.kvbench_slurm_launcher._launcher.KvbenchSlurmLauncher"
_SLURM_RESOURCES = ("partition", "gpus_per_node", "gpus_per_task", "gres", "cpus_per_task", "tasks_per_node",
                    "mem_gb", "timeout_min")


def _slurm_launcher_error(cfg: Any) -> str | None:
    """For a sweep launched on SLURM (kvbench's launcher or hydra-submitit-launcher's): one line when the launcher
    cannot be loaded or one job cannot run on its partition (kvbench.run.slurm.check_resources), before anything is
    written; else None."""
    import importlib.util

    from omegaconf import OmegaConf

    from kvbench.run.slurm import check_resources

    target = OmegaConf.select(cfg, "hydra.launcher._target_", default=None)
    if not (isinstance(target, str) and target.endswith("SlurmLauncher")):
        return None
    choice = OmegaConf.select(cfg, "hydra.runtime.choices", default={}).get("hydra/launcher", target)
    if target == KVBENCH_SLURM_LAUNCHER:
        module = target.rpartition(".")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            return (f"hydra/launcher={choice} needs kvbench's launcher plugin ({module}), which this installation "
                    f"lacks: reinstall kvbench (pip install -e .[launchers])")
    launcher = cfg.hydra.launcher
    return check_resources({k: OmegaConf.select(launcher, k, default=None) for k in _SLURM_RESOURCES}, str(choice))


MAX_PREFLIGHT_JOBS = 256


def sweep_jobs(sweeper_params: dict[str, Any] | None, overrides: list[str]) -> list[list[str]]:
    """The jobs of a sweep, as Hydra's basic sweeper (the sweeper of every kvbench launcher) expands them: the
    config's hydra.sweeper.params first, command-line overrides after; one list of values per key, keys in the order
    they first appear, a key given twice keeping its place and its last values (the command line wins); then every
    combination, the first key varying slowest. Built on Hydra's public override parser; tests/test_sweep.py checks
    the result against the sweeper itself."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [f"{k}={v}" for k, v in (sweeper_params or {}).items()] + overrides
    values: dict[str, list[str]] = {}  # (re-assigning a key keeps its first position)
    for o in OverridesParser.create().parse_overrides(args):
        key = o.get_key_element()
        if o.is_sweep_override() and not o.is_discrete_sweep():
            raise ValueError(f"{o.input_line}: a sweep over an interval needs a sweeper plugin (the basic sweeper "
                             f"takes lists, choice() and range())")
        items = o.sweep_string_iterator() if o.is_sweep_override() else [o.get_value_element_as_str()]
        values[key] = [f"{key}={v}" for v in items]
    return [list(job) for job in itertools.product(*values.values())]


def _compose_line(e: BaseException) -> str:
    """Hydra's composition error in one line: its first line, why (its cause's first line) and its advice ("To append
    to your config use +task.x=1": the key is not in the option's YAML), which the first line alone leaves out."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return error_line(e)
    parts = [lines[0].rstrip(".")]
    if e.__cause__ is not None and str(e.__cause__).strip():
        parts.append(error_line(e.__cause__))
    # the advice only for a group option (task.x, policy.x): an unknown top-level setting is refused when appended too
    return "; ".join(parts + [ln for ln in lines[1:] if re.match(r"To append .* use \+\w+\.", ln)])


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
            policies = [settings.policy] if settings.policy else [
                load_group("policy", n, dirs) for n in settings.compare]
            for policy_cfg in policies:
                build_policy(policy_cfg, settings)
            task_key = repr(settings.task)
            if task_key not in tasks_seen:
                build_task(settings.task)
                tasks_seen.add(task_key)
        except user_errors() + (ValueError,) as e:
            return f"sweep job [{' '.join(job)}]: {error_line(e)}"
    return None

