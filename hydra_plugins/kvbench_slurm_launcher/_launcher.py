"""`KvbenchSlurmLauncher`: hydra-submitit-launcher's SlurmLauncher with three changes.

- One array task per shared-work group: the sweep jobs whose runs differ only in policy and budget
  (kvbench.run.settings.RunSettings.group_key) go to one task, which plans and runs them as kvbench's in-process
  launcher does (hydra_plugins.kvbench_launcher.launcher.plan_and_run), their common prompt forwards done once;
  share=false gives each job its own task. A shard sweep (shard=0/4,...) makes one group per shard.

- Submitting and waiting (`launch`): submitit waits for each job in turn and learns a job's state from sacct only;
  without an accounting daemon sacct answers nothing, so a cancelled or killed job made `kvbench -m` wait forever.
  Here every job is watched at once through squeue/scontrol, sacct and its result file
  (kvbench.run.slurm.wait_for_jobs): the first failure ends the sweep with one line per failed job (id, state, log
  file) and exit code 1, within a minute; the jobs that succeeded keep their results, and launching the same sweep
  again finishes what is missing. sbatch refusing the array ends with its one-line reason and exit code 2, and the
  files made for it are removed.
- Inside a job (`__call__`): SIGTERM / SIGUSR1 / submitit's time-limit signal requeue a job SLURM keeps running,
  at most hydra.launcher.max_num_timeout times; a cancelled job is not requeued
  (kvbench.run.slurm.install_stop_handlers).

Building the executor follows hydra-submitit-launcher 1.2.0's BaseSubmititLauncher.launch line for line; only the
submission and the wait differ.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf, open_dict

log = logging.getLogger(__name__)

class KvbenchSlurmLauncher(SlurmLauncher):
    """hydra-submitit-launcher's SLURM launcher that cannot hang on a failed job and requeues preempted ones."""

    def __call__(self, group_overrides: list[list[str]], job_dir_key: str, job_nums: list[int], job_id: str,
                 singleton_state: dict[type, Singleton]) -> list[JobReturn]:
        """One array task: the sweep jobs of one shared-work group (kvbench.run.app.run_group), planned and run in
        this process as kvbench's in-process launcher runs them (hydra_plugins.kvbench_launcher.plan_and_run)."""
        # Runs inside the SLURM job, after submitit installed its own signal handlers (which ours wrap).
        import submitit
        from hydra.core.utils import setup_globals
        from hydra_plugins.kvbench_launcher.launcher import plan_and_run

        from kvbench.run.slurm import install_stop_handlers

        install_stop_handlers(int(self.params.get("max_num_timeout") or 0))
        assert self.hydra_context is not None and self.config is not None
        Singleton.set_state(singleton_state)
        setup_globals()
        task_id = submitit.JobEnvironment().job_id
        return plan_and_run(self.hydra_context, self.config, group_overrides, job_nums, [task_id] * len(job_nums))

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        from kvbench.errors import error_line
        from kvbench.run.slurm import wait_for_jobs

        assert self.config is not None
        assert len(job_overrides) > 0
        params = self.params
        specific_init_keys = {"max_num_timeout"}
        init_params = {"folder": params["submitit_folder"],
                       **{f"{self._EXECUTOR}_{x}": y for x, y in params.items() if x in specific_init_keys}}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init_params)
        baseparams = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{x if x in baseparams else f"{self._EXECUTOR}_{x}": y for x, y in params.items()
                                      if x not in specific_init_keys | {"submitit_folder"}})

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            sweep_dir.chmod(int(str(self.config.hydra.sweep.mode), 8))
        job_labels = _labels([filter_overrides(overrides) for overrides in job_overrides])
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
        # One array task per shared-work group (the jobs whose runs differ only in policy and budget): its runs share
        # their prompt forwards in that task; share=false gives every job a task of its own, as before.
        groups = self._groups(job_overrides)
        labels = [" + ".join(job_labels[k] for k in group) for group in groups]
        job_params = [([list(job_overrides[k]) for k in group], "hydra.sweep.dir",
                       [initial_job_idx + k for k in group], f"job_id_for_{initial_job_idx + group[0]}",
                       Singleton.get_state()) for group in groups]
        if len(groups) < len(job_overrides):
            print(f"kvbench: {len(job_overrides)} sweep jobs in {_jobs(len(groups))} (runs that differ only in "
                  f"policy and budget share work in one job; share=false: one job each)", flush=True)

        folder_root = _id_free_folder(str(params["submitit_folder"]))
        before = _tree(folder_root)
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # (submitit prints sbatch's error too; it is in `e`)
                jobs = executor.map_array(self, *zip(*job_params))
        except Exception as e:  # noqa: BLE001 - sbatch's refusal (submitit's FailedJobError), reported as one line
            _remove_new(folder_root, before, sweep_dir)
            print(f"kvbench: error: SLURM refused the sweep ({_jobs(len(labels))}): {error_line(e)}", file=sys.stderr)
            raise SystemExit(2) from None

        array = jobs[0].job_id.split("_")[0]
        print(f"kvbench: submitted {_jobs(len(jobs))} to SLURM as job {array}; waiting for them (logs in "
              f"{folder_root}; Ctrl-C stops waiting, not the jobs)", flush=True)
        try:
            failures = wait_for_jobs(jobs, labels, _result_error)
        except KeyboardInterrupt:
            print(f"\nkvbench: stopped waiting; the jobs keep running (scancel {array} stops them), and the same "
                  f"command with hydra.sweep.dir={sweep_dir} resumes what is missing", file=sys.stderr)
            raise SystemExit(130) from None
        if failures:
            for f in failures:
                print(f"kvbench: error: {f.line()}", file=sys.stderr)
            others = len(jobs) - len(failures)
            rest = (f"the other {others} keep their results or keep running (scancel {array} stops them); "
                    if others else "")
            print(f"kvbench: error: {len(failures)} of {_jobs(len(jobs))} failed; {rest}the same command with "
                  f"hydra.sweep.dir={sweep_dir} runs only what is missing", file=sys.stderr)
            raise SystemExit(1)
        print(f"kvbench: {'the ' + _jobs(len(jobs)) if len(jobs) > 1 else 'the job'} of SLURM job {array} finished; "
              f"tables: kvbench-report {sweep_dir}",
              flush=True)
        return [ret for job in jobs for ret in job.results()[0]]

    def _groups(self, job_overrides: Sequence[Sequence[str]]) -> list[list[int]]:
        """The sweep's jobs (indices) grouped by kvbench's RunSettings.group_key, in sweep order. A job whose config
        does not parse goes alone (its array task then fails with its one-line error, as any bad job does)."""
        from kvbench.run.settings import RunSettings, user_errors

        assert self.hydra_context is not None and self.config is not None
        groups: dict[Any, list[int]] = {}
        for k, overrides in enumerate(job_overrides):
            key: Any = None
            try:
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                with open_dict(cfg):
                    del cfg["hydra"]  # (its interpolations need a running job; the runs' settings do not)
                key = RunSettings.from_config(OmegaConf.to_container(cfg, resolve=True)).group_key()
            except user_errors():
                pass
            groups.setdefault(("alone", k) if key is None else key, []).append(k)
        return list(groups.values())


def _jobs(n: int) -> str:
    return f"{n} job{'s' if n != 1 else ''}"


def _labels(job_overrides: Sequence[Sequence[str]]) -> list[str]:
    """Each job's name in messages: the overrides that differ between the jobs of the sweep ("policy=tova
    budget=64"), or all of them for a sweep of one job."""
    def key(override: str) -> str:
        return override.split("=", 1)[0]

    values: dict[str, set[str]] = {}
    for overrides in job_overrides:
        for o in overrides:
            values.setdefault(key(o), set()).add(o)
    varying = {k for k, v in values.items() if len(v) > 1} if len(job_overrides) > 1 else set(values)
    return [" ".join(o for o in overrides if key(o) in varying) for overrides in job_overrides]


def _result_error(job: Any) -> str | None:
    """Why a job whose result file exists failed, in one line, or None when it succeeded."""
    from kvbench.errors import error_line
    from kvbench.run.slurm import error_in

    try:
        returns = job.results()[0]  # one array task: its group's JobReturns
    except Exception as e:  # noqa: BLE001 - submitit's error outcome, whose message holds the job's traceback
        return error_in(str(e)) or error_line(e, with_type=True)
    failed = [ret for ret in returns if ret.status == JobStatus.FAILED]
    if not failed:
        return None
    ret = failed[0]
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # (return_value prints Hydra's "Error executing job" line)
            _ = ret.return_value
    except Exception as e:  # noqa: BLE001 - the job's exception, raised again by Hydra
        return error_line(e, with_type=True)
    return "failed"


def _id_free_folder(folder: str) -> Path:
    # The part of hydra.launcher.submitit_folder before the first job-id pattern (%j, %A, ...): where submitit puts
    # the array's pickles and every job's folder.
    return Path(*itertools.takewhile(lambda part: "%" not in part, Path(folder).expanduser().absolute().parts))


def _tree(root: Path) -> set[Path]:
    return set(root.rglob("*")) | {root} if root.exists() else set()


def _remove_new(root: Path, before: set[Path], sweep_dir: Path) -> None:
    """After sbatch refused the sweep: remove the submitit files made for it, and the sweep directory when it holds
    nothing but Hydra's multirun.yaml (a sweep launched again keeps its runs)."""
    for path in sorted(_tree(root) - before, key=lambda p: len(p.parts), reverse=True):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} <= {"multirun.yaml"}:
        shutil.rmtree(sweep_dir, ignore_errors=True)
