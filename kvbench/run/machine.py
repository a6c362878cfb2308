"""What a run's floating-point results depend on beyond the code and the packages: the processor and the instruction
set torch's CPU kernels (and the BLAS under them) were dispatched to.

The same commit, packages and model reproduce a run bit for bit on one machine, but not across CPUs: on an x86
processor with AVX-512 the matrix products take other kernels than on one with AVX2 only, and round differently
(graded scores moved by ~1e-5 nats, and a greedy near-tie flipped, when the committed runs of 2026-11-23 were rerun at
their own commit on another machine: results/reproduce/). Recorded in every run's provenance so such a difference
can be told from a change of the code.
"""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The processor's name ('AMD EPYC 7B13', ...): Linux's /proc/cpuinfo 'model name', else what the platform says."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def accelerator(device: str) -> str | None:
    """The accelerator's name for a run on one ('NVIDIA H100 80GB HBM3' for "cuda:0"), None on the CPU: its kernels
    round otherwise than the CPU's, so a GPU run's floats are told apart from a CPU run's by this, not by the code."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def cpu_info() -> dict[str, str]:
    """{"model": the processor's name, "isa": the instruction set torch's CPU kernels use ('AVX2', 'AVX512', ...)}."""
    import torch

    return {"model": cpu_model(), "isa": torch.backends.cpu.get_cpu_capability()}
