"""`KvbenchLauncher`: Hydra's basic (in-process) launcher, but a sweep's jobs are planned first and run together.

Hydra's BasicLauncher runs each job of `kvbench -m` to its end before the next one starts, so the runs of a sweep
cannot share the prompt forwards they have in common. Here every job is first set up as Hydra sets it up (its output
directory, `.hydra/`, logging, callbacks: `hydra.core.utils.run_job`) with a task function that only parses the job
into its runs (kvbench.run.jobs.plan_job); then all the jobs' runs go to kvbench.run.jobs.run_planned, which runs the
runs that differ only in policy and budget sample-major in one group (share=false: each alone, as the basic launcher
does).
A bad job fails at planning, before any run starts. The SLURM launcher (hydra_plugins/kvbench_slurm_launcher) runs
one such group per array task with `plan_and_run`.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


def plan_and_run(hydra_context: HydraContext, config: DictConfig, job_overrides: Sequence[Sequence[str]],
                 job_nums: Sequence[int], job_ids: Sequence[Any] | None = None) -> list[JobReturn]:
    """Set up each job (Hydra's run_job with kvbench.run.jobs.plan_job: output directory, .hydra/, no run), then run
    all their runs in this process with shared work (kvbench.run.jobs.run_planned) and print each job's table; each
    JobReturn's value is its job's metrics. `job_ids`: Hydra's job ids (default: the job numbers)."""
    from hydra.core.utils import JobStatus

    from kvbench.report.cli import print_job_tables
    from kvbench.run.jobs import plan_job, run_planned

    returns, planned = [], []
    for k, (num, overrides) in enumerate(zip(job_nums, job_overrides)):
        log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
        sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = num if job_ids is None else job_ids[k]
            sweep_config.hydra.job.num = num
        ret = run_job(hydra_context=hydra_context, task_function=plan_job, config=sweep_config,
                      job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
        if ret.status != JobStatus.COMPLETED:
            return [*returns, ret]  # (Hydra raises the job's error from its return value)
        returns.append(ret)
        planned.append(ret.return_value)
        configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    metrics = run_planned(planned)
    print_job_tables(planned, metrics)
    for ret, job_metrics in zip(returns, metrics):
        ret.return_value = job_metrics
    return returns


class KvbenchLauncher(Launcher):
    """Runs a sweep's jobs in this process, planned first and then run with shared work (module docstring). Built on
    Hydra's public Launcher interface rather than BasicLauncher, which lives in hydra._internal."""

    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from pathlib import Path

        setup_globals()
        assert self.hydra_context is not None and self.config is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(job_overrides)} jobs locally")
        nums = range(initial_job_idx, initial_job_idx + len(job_overrides))
        return plan_and_run(self.hydra_context, self.config, job_overrides, list(nums))
