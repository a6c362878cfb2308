"""`kvbench`: the Hydra entry point. Composes the config, builds model/policy/task, runs, writes the run directory.

Only this module, kvbench.run.config and kvbench.run.settings (Hydra's instantiate) import Hydra. Bad input ends in
one line on stderr and exit code 2, and a run directory that holds no results is removed again, unless another
kvbench process holds it (kvbench.run.app's run lock).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kvbench.errors import error_line
from kvbench.run import config as kconfig
from kvbench.run.settings import user_errors


def _fail(msg: str, run_dirs: Sequence[Path] = ()) -> None:
    if run_dirs:
        from kvbench.run.app import remove_if_empty_run

        for run_dir in run_dirs:
            remove_if_empty_run(run_dir)  # (takes the run lock: a directory another process holds is left alone)
    print(f"kvbench: error: {msg}", file=sys.stderr)
    sys.exit(2)


@dataclass
class PlannedJob:
    """One Hydra job of a run or a sweep, resolved but not run: its output directory and its runs (one, or one per
    `compare` policy)."""

    run_dir: Path
    members: list[Any]  # kvbench.run.app.Member


def plan_job(cfg: Any) -> PlannedJob:
    """Hydra's task function while a sweep is planned (kvbench's launcher, hydra_plugins/kvbench_launcher): parse the
    job's config into its runs, running nothing. Bad input: one line, exit 2."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from kvbench.run.app import plan_members
    from kvbench.run.settings import RunSettings

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    choices = dict(HydraConfig.get().runtime.choices)
    try:
        container = OmegaConf.to_container(cfg, resolve=True)
        dirs = kconfig.conf_dirs(HydraConfig.get().searchpath)
        return PlannedJob(run_dir, plan_members(RunSettings.from_config(container), choices, run_dir, dirs))
    except user_errors() as e:
        _fail(error_line(e), [run_dir])
        raise  # (unreachable: _fail exits)


def run_planned(jobs: Sequence[PlannedJob]) -> list[list[dict[str, Any]]]:
    """Run planned jobs in one process, the runs of all of them grouped for shared work (kvbench.run.app.run_members:
    runs that differ only in policy and budget go sample-major together unless share=false); print each job's table.
    Returns each job's metrics. Bad input: one line, exit 2, and job directories left without results removed."""
    from kvbench.report.cli import print_metrics_table
    from kvbench.run.app import RunBusy, Session, run_members
    from kvbench.run.threads import use_allocation

    use_allocation()  # in a SLURM job: torch's threads = the CPUs it was given, unless the user chose
    try:
        metrics = run_members([m for job in jobs for m in job.members], Session())
    except RunBusy as e:
        _fail(str(e))  # the directory is another process's: nothing of it is removed
    except user_errors() as e:
        _fail(error_line(e), [job.run_dir for job in jobs])
    out, start = [], 0
    for job in jobs:
        out.append(metrics[start:start + len(job.members)])
        start += len(job.members)
        print_metrics_table(out[-1])
        print(f"\nrun directory: {job.run_dir}")
    return out


def _job(cfg: Any) -> None:
    """Hydra's task function for a single run (`kvbench ...`), and for a sweep under a launcher that runs each job on
    its own (hydra/launcher=parallel); kvbench's own launchers plan every job first (plan_job), then share work."""
    run_planned([plan_job(cfg)])


def _register_launchers() -> None:
    from hydra.core.plugins import Plugins

    # kvbench's default launcher (conf/hydra/launcher/kvbench.yaml), registered here: an editable install's package
    # finder does not show it to Hydra's plugin scan.
    from hydra_plugins.kvbench_launcher.launcher import KvbenchLauncher

    Plugins.instance().register(KvbenchLauncher)
    _register_slurm_launcher()


def _register_slurm_launcher() -> None:
    # kvbench's SLURM launcher (conf/hydra/launcher/slurm*.yaml) extends hydra-submitit-launcher, an optional
    # dependency, so Hydra's plugin scan does not import it (hydra_plugins/kvbench_slurm_launcher says why): it is
    # registered here, through Hydra's public Plugins.register, when the launchers extra is installed.
    try:
        from hydra_plugins.kvbench_slurm_launcher._launcher import KvbenchSlurmLauncher
    except ImportError:
        return  # (choosing a SLURM preset then fails before this, with one line: kvbench.run.config)
    from hydra.core.plugins import Plugins

    Plugins.instance().register(KvbenchSlurmLauncher)


def main() -> None:
    # conf/config.yaml lists `experiment: null`, so Hydra wants `experiment=NAME`; the common `+experiment=NAME`
    # (appending a group absent from the defaults) is accepted as the same thing.
    sys.argv[1:] = [a[1:] if a.startswith("+experiment=") else a for a in sys.argv[1:]]
    argv = sys.argv[1:]
    kconfig.register_resolvers()
    err = kconfig.validate_overrides(argv)
    if err:
        _fail(err)
    import hydra

    _register_launchers()
    wrapped = hydra.main(version_base=None, config_path=str(kconfig.conf_dir()), config_name="config")(_job)
    wrapped()


if __name__ == "__main__":
    main()
