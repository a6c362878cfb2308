"""torch's intra-op threads: sized to a SLURM allocation, and recorded with every run (metrics.json `threads`).

torch starts one thread per core of the machine, which SLURM does not change when tasks are not bound to cores
(TaskPlugin=task/none, no cgroups): a job given 2 CPUs of a 64-core node would run 64 threads and slow down every
job beside it. So a job uses the CPUs it was given (SLURM_CPUS_PER_TASK), unless the user chose a thread count
(OMP_NUM_THREADS or MKL_NUM_THREADS, which torch reads itself).
"""

from __future__ import annotations

import os
from typing import Mapping

# Thread counts the user sets for torch in the environment; kvbench never overrides them.
USER_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def allocation_threads(environ: Mapping[str, str]) -> int | None:
    """The threads one task of this SLURM allocation should run: SLURM_CPUS_PER_TASK (set when the job asked for
    --cpus-per-task, as hydra.launcher.cpus_per_task does); None outside SLURM, without it, or when the user set
    a thread count."""
    if any(environ.get(name) for name in USER_THREAD_VARIABLES):
        return None
    cpus = environ.get("SLURM_CPUS_PER_TASK", "")
    return int(cpus) if cpus.isdigit() and int(cpus) > 0 else None


def use_allocation(environ: Mapping[str, str] | None = None) -> int:
    """Set torch's intra-op threads to the SLURM allocation (see allocation_threads); returns the threads torch
    runs with now."""
    import torch

    n = allocation_threads(os.environ if environ is None else environ)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    return torch.get_num_threads()


def current_threads() -> int:
    """The intra-op threads torch runs with (what metrics.json records as `threads`)."""
    import torch

    return torch.get_num_threads()
