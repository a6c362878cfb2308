"""kvbench's SLURM launcher for Hydra (`hydra/launcher=slurm_cpu`, `slurm`, `slurm_shards`): hydra-submitit-launcher's
SlurmLauncher, waiting without sacct and requeueing preempted jobs (the launcher module's docstring says how).

The class lives in `_launcher` (a leading underscore: Hydra's plugin scan skips it) and is imported here only when
hydra-submitit-launcher, an optional dependency (`pip install -e .[launchers]`), is installed: the scan imports this
package on every kvbench run, and would warn about the missing package on machines without it.
"""

try:
    from hydra_plugins.kvbench_slurm_launcher._launcher import KvbenchSlurmLauncher  # noqa: F401 (for the scan)
except ImportError:  # no launchers extra: choosing a SLURM preset then fails with one line (kvbench.run.config)
    pass
