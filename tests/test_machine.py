"""The processor recorded in every run's provenance (kvbench.run.machine)."""

from pathlib import Path

import torch

from kvbench.run.machine import cpu_info, cpu_model

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13 64-Core Processor
flags\t\t: fpu avx2

processor\t: 1
model name\t: AMD EPYC 7B13 64-Core Processor
"""


def test_cpu_model_reads_the_first_model_name(tmp_path: Path) -> None:
    f = tmp_path / "cpuinfo"
    f.write_text(CPUINFO)
    assert cpu_model(f) == "AMD EPYC 7B13 64-Core Processor"


def test_cpu_model_without_cpuinfo_falls_back_to_the_platform(tmp_path: Path) -> None:
    name = cpu_model(tmp_path / "absent")
    assert isinstance(name, str) and name  # platform.processor() or platform.machine(), never empty on CI


def test_cpu_info_names_torchs_kernel_isa() -> None:
    info = cpu_info()
    assert info["isa"] == torch.backends.cpu.get_cpu_capability()
    assert info["isa"] in ("DEFAULT", "VSX", "Z VECTOR", "NO AVX", "AVX2", "AVX512", "SVE256")  # its documented values


def test_accelerator_names_the_gpu_a_run_used_and_none_on_the_cpu(monkeypatch) -> None:
    import torch

    from kvbench.run.machine import accelerator

    assert accelerator("cpu") is None
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: asked.append(d) or "NVIDIA H100 80GB HBM3")
    assert accelerator("cuda:1") == "NVIDIA H100 80GB HBM3"
    assert asked == [torch.device("cuda:1")]
