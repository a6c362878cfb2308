"""The jobs of `kvbench` and `kvbench -m`: each Hydra job parsed into its runs (`plan_job`, Hydra's task function),
then the runs of all jobs run together with shared work (`run_planned`). The CLI (kvbench.cli) and kvbench's
launchers (hydra_plugins/kvbench_launcher, hydra_plugins/kvbench_slurm_launcher) call these; neither imports the other.

Bad input ends in one line on stderr and exit code 2 (`fail`), and a run directory that holds no results is removed
again, unless another kvbench process holds it (kvbench.run.app's run lock).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Sequence

from kvbench.errors import error_line
from kvbench.run import config as kconfig
from kvbench.run.settings import user_errors


def fail(msg: str, run_dirs: Sequence[Path] = ()) -> NoReturn:
    """`kvbench: error: MSG` on stderr, exit code 2; `run_dirs` left without results are removed first."""
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
    """Hydra's task function while a sweep is planned: parse the job's config into its runs, running nothing."""
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
        fail(error_line(e), [run_dir])


def run_planned(jobs: Sequence[PlannedJob]) -> list[list[dict[str, Any]]]:
    """Run planned jobs in one process, the runs of all of them grouped for shared work (kvbench.run.app.run_members:
    runs that differ only in policy and budget go sample-major together unless share=false). Returns each job's
    metrics; on bad input the job directories left without results are removed."""
    from kvbench.run.app import RunBusy, Session, run_members
    from kvbench.run.threads import use_allocation

    use_allocation()  # in a SLURM job: torch's threads = the CPUs it was given, unless the user chose
    try:
        metrics = run_members([m for job in jobs for m in job.members], Session())
    except RunBusy as e:
        fail(str(e))  # the directory is another process's: nothing of it is removed
    except user_errors() as e:
        fail(error_line(e), [job.run_dir for job in jobs])
    out, start = [], 0
    for job in jobs:
        out.append(metrics[start:start + len(job.members)])
        start += len(job.members)
    return out
