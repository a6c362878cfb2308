"""`kvbench`: the Hydra entry point. Composes the config, builds model/policy/task, runs, writes the run directory.

Only this module, kvbench.run.config, kvbench.run.settings (Hydra's instantiate) and kvbench.run.jobs (Hydra's
task function) import Hydra. A run is planned and run by kvbench.run.jobs, as kvbench's launchers run a sweep's jobs;
Hydra finds the launchers as plugins (kvbench.run.config.expose_plugins), so this module does not import them. Bad
input ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys
from typing import Any

from kvbench.run import config as kconfig
from kvbench.run.jobs import fail, plan_job, run_planned


def _job(cfg: Any) -> None:
    """Hydra's task function for a single run (`kvbench ...`), and for a sweep under a launcher that runs each job on
    its own (hydra/launcher=parallel); kvbench's own launchers plan every job first (plan_job), then share work."""
    from kvbench.report.cli import print_job_tables

    jobs = [plan_job(cfg)]
    print_job_tables(jobs, run_planned(jobs))


def main() -> None:
    # conf/config.yaml lists `experiment: null`, so Hydra wants `experiment=NAME`; the common `+experiment=NAME`
    # (appending a group absent from the defaults) is accepted as the same thing.
    sys.argv[1:] = [a[1:] if a.startswith("+experiment=") else a for a in sys.argv[1:]]
    argv = sys.argv[1:]
    kconfig.expose_plugins()  # before anything composes a config: Hydra scans its plugins once per process
    kconfig.register_resolvers()
    err = kconfig.validate_overrides(argv)
    if err:
        fail(err)
    import hydra

    wrapped = hydra.main(version_base=None, config_path=str(kconfig.conf_dir()), config_name="config")(_job)
    wrapped()


if __name__ == "__main__":
    main()
