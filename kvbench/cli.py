"""`kvbench`: the Hydra entry point. Composes the config, builds model/policy/task, runs, writes the run directory.

Only this module, kvbench.run.config and kvbench.run.settings (Hydra's instantiate) import Hydra. Bad input ends in
one line on stderr and exit code 2, and a run directory that holds no results is removed again, unless another
kvbench process holds it (kvbench.run.app's run lock).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kvbench.errors import error_line
from kvbench.run import config as kconfig
from kvbench.run.settings import user_errors


def _fail(msg: str, run_dir: Path | None = None) -> None:
    if run_dir is not None:
        from kvbench.run.app import remove_if_empty_run

        remove_if_empty_run(run_dir)  # (takes the run lock: a directory another process holds is left alone)
    print(f"kvbench: error: {msg}", file=sys.stderr)
    sys.exit(2)


def _job(cfg: Any) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from kvbench.report.cli import print_metrics_table
    from kvbench.run.app import RunBusy, run_configured
    from kvbench.run.threads import use_allocation

    use_allocation()  # in a SLURM job: torch's threads = the CPUs it was given, unless the user chose
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    choices = dict(HydraConfig.get().runtime.choices)
    try:
        container = OmegaConf.to_container(cfg, resolve=True)
        dirs = kconfig.conf_dirs(HydraConfig.get().searchpath)
        print_metrics_table(run_configured(container, choices, run_dir, dirs))
        print(f"\nrun directory: {run_dir}")
    except RunBusy as e:
        _fail(str(e))  # the directory is another process's: nothing of it is removed
    except user_errors() as e:
        _fail(error_line(e), run_dir)


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

    _register_slurm_launcher()
    wrapped = hydra.main(version_base=None, config_path=str(kconfig.conf_dir()), config_name="config")(_job)
    wrapped()


if __name__ == "__main__":
    main()
