"""kvbench's SLURM launcher for Hydra (`hydra/launcher=slurm_cpu`, `slurm`, `slurm_shards`): hydra-submitit-launcher's
SlurmLauncher, waiting without sacct and requeueing preempted jobs (the launcher module's docstring says how).

The class lives in `_launcher` (a leading underscore: Hydra's plugin scan skips it), because it extends
hydra-submitit-launcher, an optional dependency (`pip install -e .[launchers]`): the scan imports every other module
here on every kvbench run, and would warn about the missing package on machines without it. `kvbench` registers the
class with Hydra itself when the package is there (kvbench.cli).
"""
