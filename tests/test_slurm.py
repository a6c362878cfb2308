"""Sweeps on SLURM (hydra/launcher=slurm_cpu; kvbench.run.slurm and hydra_plugins/kvbench_slurm_launcher).

Without a cluster: the resource check before submitting (which partition, GPUs, CPUs, memory, time limit) on sinfo
output written by hand, the wait that cannot hang (a fake clock and fake jobs), the threads a SLURM job runs.

On a real one-node cluster (marker `slurm`; scripts/slurm_cluster.sh starts one: munge, slurmctld, slurmd, no
accounting daemon): the GPU preset on the CPU partition stops with one line; the commands of docs/sweeps.md's
walk-through run as written; and one sweep where a job is preempted (requeued, resumes) and another is cancelled
(the sweep fails fast, naming it) is launched again and then equals local runs, each run with one thread per CPU it
was given. Where no cluster can be started (not root, no apt-get, no launchers extra) those tests skip with the
reason, except when CI is set: then they fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import pytest

from kvbench.run import slurm
from kvbench.run.slurm import Failure, NodeGroup, check_resources, wait_for_jobs
from kvbench.run.threads import allocation_threads, use_allocation

from helpers import kvbench_main

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "scripts" / "slurm_cluster.sh"
DOCS = ROOT / "docs" / "sweeps.md"
PRESETS = ROOT / "conf" / "hydra" / "launcher"


def _preset(name: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(PRESETS / f"{name}.yaml"))  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------- without a cluster

SINFO = ("debug*|2|24105|(null)|infinite\n"
         "gpu|64|512000|gpu:a100:8|1-00:00:00\n"
         "gpu|32|256000|gpu:a100:4|1-00:00:00\n")


@pytest.fixture
def fake_sinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    """sinfo of a cluster with a 2-CPU default partition `debug` and a GPU partition of two node kinds."""
    def run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        assert cmd[0] == "sinfo"
        return subprocess.CompletedProcess(cmd, 0, SINFO, "")

    monkeypatch.setattr(slurm, "_run", run)
    monkeypatch.setattr(slurm.shutil, "which", lambda name: f"/usr/bin/{name}")


def test_sinfo_lines_become_node_groups(fake_sinfo: None) -> None:
    assert slurm.partition_nodes() == [NodeGroup("debug", True, 2, 24105, False, None),
                                       NodeGroup("gpu", False, 64, 512000, True, 1440),
                                       NodeGroup("gpu", False, 32, 256000, True, 1440)]


def test_the_gpu_preset_on_a_cpu_partition_names_the_cpu_preset(fake_sinfo: None) -> None:
    gpu = _preset("slurm")
    assert check_resources({**gpu, "partition": "debug"}, "slurm") == (
        "partition 'debug' has no GPUs and hydra/launcher=slurm asks for 1 per job: use hydra/launcher=slurm_cpu for "
        "CPU nodes (or hydra.launcher.gpus_per_node=null)")
    assert check_resources({**gpu, "partition": None}, "slurm") is not None  # debug is the default partition
    assert check_resources({**gpu, "partition": "gpu"}, "slurm") is None  # 8 CPUs, 64 GB, 12 h: fits a GPU node
    # A gres line asks for GPUs as well.
    assert "has no GPUs" in check_resources({"partition": "debug", "gres": "gpu:2"}, "custom")


def test_the_cpu_preset_fits_the_two_core_debug_partition(fake_sinfo: None) -> None:
    cpu = _preset("slurm_cpu")
    assert cpu["gpus_per_node"] is None and "gres" not in cpu
    assert check_resources({**cpu, "partition": "debug"}, "slurm_cpu") is None


@pytest.mark.parametrize("change, message", [
    ({"partition": "cpu"}, "SLURM has no partition 'cpu': hydra.launcher.partition=NAME with one of debug, gpu"),
    ({"cpus_per_task": 4}, "hydra.launcher.cpus_per_task=4 but the nodes of partition 'debug' have at most 2 CPUs: "
                           "set hydra.launcher.cpus_per_task=2 or less"),
    # 24 GB = 24576 MB > 24105 MB; the largest that fits is 23 GB.
    ({"mem_gb": 24}, "hydra.launcher.mem_gb=24 but the nodes of partition 'debug' have at most 24105 MB: set "
                     "hydra.launcher.mem_gb=23 or less"),
    ({"partition": "gpu", "gpus_per_node": 1, "timeout_min": 1441},
     "hydra.launcher.timeout_min=1441 is longer than partition 'gpu' allows (1440 min): set "
     "hydra.launcher.timeout_min=1440 or less (a job that needs longer is requeued and resumes)"),
])
def test_a_job_no_node_can_hold_is_refused_in_one_line(fake_sinfo: None, change: dict, message: str) -> None:
    params = {**_preset("slurm_cpu"), "partition": "debug", **change}
    assert check_resources(params, "slurm_cpu") == message


def test_no_slurm_commands_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None if name in ("sinfo", "sbatch") else "/usr/bin/x")
    assert check_resources({"partition": "debug"}, "slurm_cpu") == (
        "hydra/launcher=slurm_cpu submits to SLURM, but this machine has no sbatch, sinfo: run kvbench on the "
        "cluster's login node (scripts/slurm_cluster.sh start makes a one-node cluster here)")


@pytest.mark.parametrize("text, minutes", [("infinite", None), ("n/a", None), ("30:00", 30), ("4:00:00", 240),
                                           ("1-12:00:00", 2160), ("0:30", 1)])
def test_time_limits_in_minutes(text: str, minutes: int | None) -> None:
    assert slurm.minutes(text) == minutes


class FakeJob:
    """What wait_for_jobs reads of a submitit job: its id and the paths of its result and error log."""

    def __init__(self, folder: Path, job_id: str) -> None:
        self.job_id = job_id
        self.paths = SimpleNamespace(result_pickle=folder / f"{job_id}_result.pkl", stderr=folder / f"{job_id}.err")


class FakeCluster:
    """A clock that only sleeps move, and squeue answers scripted by time."""

    def __init__(self, states: dict[str, list[tuple[float, str | None]]]) -> None:
        self.now, self.sleeps, self.states = 0.0, [], states

    def sleep(self, s: float) -> None:
        self.sleeps.append(round(s, 6))
        self.now += s

    def query(self, ids: list[str]) -> dict[str, str]:
        out = {}
        for jid in ids:
            # The last scripted state whose time has come; None = SLURM no longer knows the job.
            state = [s for t, s in self.states.get(jid, []) if t <= self.now][-1]
            if state is not None:
                out[jid] = state
        return out


def test_a_cancelled_job_fails_the_wait_once_the_grace_has_passed(tmp_path: Path) -> None:
    ok, cancelled = FakeJob(tmp_path, "7_0"), FakeJob(tmp_path, "7_1")
    fake = FakeCluster({"7_0": [(0, "RUNNING")], "7_1": [(0, "CANCELLED")]})
    failures = wait_for_jobs([ok, cancelled], ["budget=64", "budget=128"], lambda job: None, states=fake.query,
                             sleep=fake.sleep, clock=lambda: fake.now)
    # Polls at t = 0, 2, 4.2, 6.62, ...: each wait is 2 s plus a tenth of the time waited so far; the cancelled job
    # is declared failed at the first poll 15 s (RESULT_GRACE_S) after it was first seen ended.
    assert fake.sleeps == [2.0, 2.2, 2.42, 2.662, 2.9282, 3.22102]
    assert failures == [Failure("7_1", "budget=128", "CANCELLED", cancelled.paths.stderr, None)]
    assert failures[0].line() == (f"sweep job 7_1 [budget=128] CANCELLED; no log ({cancelled.paths.stderr} was never "
                                  f"written: the job never ran)")


def test_a_job_slurm_forgot_without_a_result_fails_with_its_last_error(tmp_path: Path) -> None:
    job = FakeJob(tmp_path, "9")
    job.paths.stderr.write_text("Traceback (most recent call last):\n  ...\nkvbench: error: budget must be positive\n"
                                "srun: error: vm: task 0: Exited with exit code 2\n")
    fake = FakeCluster({"9": [(0, "RUNNING"), (3, None)]})  # purged from slurmctld, and no accounting
    failures = wait_for_jobs([job], ["budget=0"], lambda j: None, states=fake.query, sleep=fake.sleep,
                             clock=lambda: fake.now)
    assert failures[0].state == "UNKNOWN (no longer known to SLURM)" and failures[0].detail is None
    # Ended first seen at t = 4.2 (the poll after 3 s), failed at the first poll from t = 19.2 on: t = 20.1...
    assert fake.now == pytest.approx(2 + 2.2 + 2.42 + 2.662 + 2.9282 + 3.22102 + 3.543122 + 3.8974342)
    fake = FakeCluster({"9": [(0, "FAILED")]})
    failures = wait_for_jobs([job], ["budget=0"], lambda j: None, states=fake.query, sleep=fake.sleep,
                             clock=lambda: fake.now)
    assert failures[0].line() == (f"sweep job 9 [budget=0] FAILED: budget must be positive; log {job.paths.stderr}")


def test_results_end_the_wait_and_a_failed_result_ends_it_at_once(tmp_path: Path) -> None:
    a, b = FakeJob(tmp_path, "3_0"), FakeJob(tmp_path, "3_1")
    # Pending for a long time is not a failure; the results appear after ~100 s.
    fake = FakeCluster({"3_0": [(0, "PENDING"), (60, "RUNNING")], "3_1": [(0, "PENDING")]})
    read = []

    def sleep(s: float) -> None:
        fake.sleep(s)
        if fake.now > 100:
            a.paths.result_pickle.write_text("r")
            b.paths.result_pickle.write_text("r")

    assert wait_for_jobs([a, b], ["x", "y"], lambda job: read.append(job.job_id), states=fake.query, sleep=sleep,
                         clock=lambda: fake.now) == []
    assert read == ["3_0", "3_1"]  # each result read once
    b.paths.stderr.write_text("ValueError: bad\n")
    failures = wait_for_jobs([a, b], ["x", "y"], lambda job: "ValueError: bad" if job is b else None,
                             states=fake.query, sleep=sleep, clock=lambda: fake.now)
    assert [f.line() for f in failures] == [f"sweep job 3_1 [y] FAILED: ValueError: bad; log {b.paths.stderr}"]


def test_the_error_line_of_a_log() -> None:
    assert slurm.error_in("x\nkvbench: error: one\nkvbench: error: two\nTraceback\nValueError: v\n") == "two"
    assert slurm.error_in("Traceback (most recent call last):\n  File x\nsubmitit.core.utils.UncompletedJobError: "
                          "timed-out too many times\n") == ("submitit.core.utils.UncompletedJobError: timed-out too "
                                                             "many times")
    # A task killed from outside (kill -9, the kernel's OOM killer) leaves only srun's word for it.
    assert slurm.error_in("Loading weights: 100%\nsrun: error: vm: task 0: Killed\n") == "task 0: Killed"
    assert slurm.error_in("submitit INFO - Starting\n") is None


def test_a_slurm_job_runs_one_thread_per_cpu_unless_the_user_chose() -> None:
    assert allocation_threads({"SLURM_CPUS_PER_TASK": "3"}) == 3
    assert allocation_threads({"SLURM_CPUS_PER_TASK": "3", "OMP_NUM_THREADS": "1"}) is None
    assert allocation_threads({"SLURM_CPUS_PER_TASK": "3", "MKL_NUM_THREADS": "2"}) is None
    assert allocation_threads({}) is None and allocation_threads({"SLURM_CPUS_PER_TASK": ""}) is None
    import torch

    before = torch.get_num_threads()
    try:
        assert use_allocation({"SLURM_CPUS_PER_TASK": "1"}) == 1 == torch.get_num_threads()
        assert use_allocation({}) == 1  # outside SLURM: left as it is
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------- on a real cluster

PARTITION = "debug"


def _cluster_answers() -> bool:
    try:
        out = subprocess.run(["sinfo", "--noheader", f"--partition={PARTITION}", "--format=%t"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip().startswith(("idle", "mix", "alloc", "comp"))


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A SLURM cluster with partition `debug`: the one running, or one started here (and stopped afterwards)."""
    def unavailable(reason: str) -> None:
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI is set: the SLURM tests must run)")
        pytest.skip(reason)

    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        unavailable("hydra-submitit-launcher is not installed (pip install -e .[launchers])")
    started = False
    if not _cluster_answers():
        res = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True, timeout=900)
        if res.returncode == 3:  # not root, or no SLURM and no apt-get
            unavailable(res.stderr.strip())
        assert res.returncode == 0, res.stdout + res.stderr
        started = True
    yield
    if started:
        subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, timeout=120)


@pytest.mark.slurm
def test_a_sweep_slurm_cannot_run_stops_with_one_line_and_writes_nothing(cluster: None, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    job = ["model=tiny-llama", "task=fidelity", "policy=keydiff", "budget=64", f"hydra.sweep.dir={sweep}"]
    # The GPU preset on the CPU partition: found before anything is submitted or written.
    res = kvbench_main("-m", "hydra/launcher=slurm", f"hydra.launcher.partition={PARTITION}", *job)
    line = ("kvbench: error: partition 'debug' has no GPUs and hydra/launcher=slurm asks for 1 per job: use "
            "hydra/launcher=slurm_cpu for CPU nodes (or hydra.launcher.gpus_per_node=null)")
    assert (res.returncode, res.stderr) == (2, line + "\n")
    assert not sweep.exists()
    assert line in DOCS.read_text()  # the docs show the line as it is
    # What only sbatch finds (a node feature no node has): its reason in one line, and the files made for the
    # submission (sweep directory, submitit folder) removed again.
    res = kvbench_main("-m", "hydra/launcher=slurm_cpu", f"hydra.launcher.partition={PARTITION}",
                       "hydra.launcher.constraint=avx1024", *job)
    assert (res.returncode, res.stderr) == (2, "kvbench: error: SLURM refused the sweep (1 job): sbatch: error: Batch "
                                               "job submission failed: Invalid feature specification\n")
    assert not sweep.exists()


def documented_commands() -> list[str]:
    """The commands of the block docs/sweeps.md marks as run word for word by this test."""
    text = DOCS.read_text()
    block = re.search(r"<!-- run as written by tests/test_slurm\.py -->\n```bash\n(.*?)```", text, re.DOTALL)
    assert block, "docs/sweeps.md lost its tested walk-through block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.slow  # 50 s: the walk-through end to end; the other SLURM tests cover its steps in CI
@pytest.mark.slurm
def test_the_documented_walk_through_runs_as_written(cluster: None, tmp_path: Path) -> None:
    commands = documented_commands()
    assert commands[0].startswith("kvbench -m hydra/launcher=slurm_cpu hydra.launcher.partition=debug "
                                  "hydra.launcher.cpus_per_task=1 ")
    for command in commands:
        res = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"{command}\n{res.stdout}\n{res.stderr}"
    sweep = tmp_path / shlex.split(commands[0])[-1].removeprefix("hydra.sweep.dir=")
    runs = sorted(p.parent.name for p in sweep.rglob("metrics.json"))
    assert runs == ["keydiff_N128_blockwise_B128", "keydiff_N64_blockwise_B128", "tova_N128_blockwise_B128",
                    "tova_N64_blockwise_B128"]
    # Every job ran with the CPUs it was given (hydra.launcher.cpus_per_task=1) as torch threads.
    assert {json.loads(p.read_text())["threads"] for p in sweep.rglob("metrics.json")} == {1}
    assert len([r for r in (sweep / "table.csv").read_text().splitlines()[1:] if r]) == 4  # kvbench-report's rows


# 3 jobs, 2 at a time, 1 CPU each: long enough (SAMPLES samples) to be preempted and cancelled mid-run. share=false: one
# array task per job (a shared-work group would put all three in one task: test_a_group_is_one_array_task_...).
SAMPLES = 16
SWEEP = ["model=tiny-llama", "task=fidelity", "task.lengths=[384]", f"task.samples_per_length={SAMPLES}",
         "task.new_tokens=8", "progress=false", "policy=keydiff", "budget=64,128,192", "share=false"]
LAUNCH = ["hydra/launcher=slurm_cpu", f"hydra.launcher.partition={PARTITION}", "hydra.launcher.cpus_per_task=1",
          "hydra.launcher.mem_gb=2", "hydra.launcher.array_parallelism=2"]
TIMING = {"prefill_s", "decode_s", "evict_s", "graded_s"}


def _lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _until(condition: Callable[[], object], what: str, timeout: float = 180, poll: float = 0.2) -> None:
    end = time.monotonic() + timeout  # (only to detect a hang)
    while not condition():
        assert time.monotonic() < end, f"waited {timeout:.0f} s for {what}"
        time.sleep(poll)


def _signal_mid_run(signals: dict[int, list[str]], runs: dict[int, Path]) -> dict[int, list[str]]:
    """Runs `signals[b]` (an scancel command) for each run b that has a finished sample on disk, and drops it from
    `signals`; returns what is left to signal."""
    for b in [b for b in signals if _lines(runs[b] / "predictions.jsonl")]:
        subprocess.run(signals.pop(b), check=True, timeout=30)
    return signals


def _states(array: str) -> dict[str, str]:
    out = subprocess.run(["squeue", "--noheader", "--array", "--states=all", f"--jobs={array}", "--format=%i|%T"],
                         capture_output=True, text=True, timeout=30).stdout
    return dict(line.split("|") for line in out.split())


@pytest.mark.slurm
def test_preempted_job_resumes_cancelled_job_fails_fast_and_a_relaunch_finishes(cluster: None,
                                                                                tmp_path: Path) -> None:
    from helpers import run_config

    from kvbench.run.app import Session, run_one

    sweep = tmp_path / "sweep"
    runs = {b: sweep / "tiny-llama" / "fidelity" / f"keydiff_N{b}_blockwise_B128" for b in (64, 128, 192)}
    command = [sys.executable, "-m", "kvbench.cli", "-m", *LAUNCH, *SWEEP, f"hydra.sweep.dir={sweep}"]
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=o, stderr=e, text=True)
    try:
        _until(lambda: "as job " in out.read_text() or proc.poll() is not None, "the submission")
        array = re.search(r"as job (\d+)", out.read_text()).group(1)
        # Each of the first two jobs mid-run (a finished sample on disk): the first preempted, the second cancelled,
        # each as soon as it is there. Not both at once: SLURM can start the second seconds after the first, and on a
        # quiet machine the first then finishes all its samples before the second has one.
        signals = {64: ["scancel", "--signal=TERM", f"{array}_0"], 128: ["scancel", f"{array}_1"]}
        _until(lambda: not _signal_mid_run(signals, runs), "both jobs to finish a sample", poll=0.02)
        proc.wait(timeout=120)  # the bound: a cancelled job ends the sweep within two minutes, never hangs
    finally:
        if proc.poll() is None:
            proc.kill()
    log = sweep / ".submitit" / f"{array}_1" / f"{array}_1_0_log.err"
    assert proc.returncode == 1
    assert err.read_text().splitlines() == [
        f"kvbench: error: sweep job {array}_1 [budget=128] CANCELLED; log {log}",
        f"kvbench: error: 1 of 3 jobs failed; the other 2 keep their results or keep running (scancel {array} stops "
        f"them); the same command with hydra.sweep.dir={sweep} runs only what is missing"]

    # The other jobs go on without kvbench: the preempted one requeued itself and resumed; the third ran.
    _until(lambda: not any(s not in ("COMPLETED", "CANCELLED", "FAILED") for s in _states(array).values()),
           "the array to end")
    assert _states(array) == {f"{array}_0": "COMPLETED", f"{array}_1": "CANCELLED", f"{array}_2": "COMPLETED"}
    job0_log = (sweep / ".submitit" / f"{array}_0" / f"{array}_0_0_log.err").read_text()
    assert f"kvbench: job {array}_0 got SIGTERM: requeued (1 of at most 3); it resumes from its predictions.jsonl" \
        in job0_log
    assert f"kvbench: job {array}_1 got SIGTERM while" in log.read_text() and "not requeued" in log.read_text()
    cancelled_lines = len(_lines(runs[128] / "predictions.jsonl"))
    assert 1 <= cancelled_lines < SAMPLES and not (runs[128] / "metrics.json").exists()  # its finished samples are kept
    finished = {b: (runs[b] / "metrics.json").read_bytes() for b in (64, 192)}

    res = kvbench_main(*command[3:])  # the same command again, in this process
    assert res.returncode == 0, res.stderr
    # Only what was missing ran: the finished runs are untouched, the cancelled one resumed and finished.
    assert {b: (runs[b] / "metrics.json").read_bytes() for b in (64, 192)} == finished
    assert (runs[128] / "metrics.json").is_file()

    # Every job ran on one thread, the one CPU it was given.
    assert [json.loads((run / "metrics.json").read_text())["threads"] for run in runs.values()] == [1, 1, 1]
    # The preempted and the cancelled job, each finished in two goes, equal local runs of the same jobs (on one
    # thread, as the jobs ran), timings aside; no sample twice.
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        session = Session()
        for budget in (64, 128):
            run = runs[budget]
            metrics = json.loads((run / "metrics.json").read_text())
            cfg = run_config(*[a for a in SWEEP if not a.startswith("budget=")], f"budget={budget}")
            local = run_one(cfg, "keydiff", tmp_path / "local" / str(budget), session)
            assert metrics["scores"] == local["scores"]
            slurm_rows = _lines(run / "predictions.jsonl")
            assert len({r["id"] for r in slurm_rows}) == len(slurm_rows) == SAMPLES
            assert _untimed(slurm_rows) == _untimed(_lines(tmp_path / "local" / str(budget) / "predictions.jsonl"))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slurm
def test_a_group_is_one_array_task_and_its_runs_equal_separate_local_runs(cluster: None, tmp_path: Path) -> None:
    """policy=keydiff,tova budget=64,96 (runs differing only in policy and budget: one shared-work group) and
    seed=0,1 (two groups): two array tasks, one CPU each, each running its four runs sample-major, each run in a cache
    of its own from one shared trunk, the four decoding together (share_rows auto on a CPU node); every run's records
    equal the same job run locally alone (on one thread, as the tasks ran; float64), timings aside."""
    import torch

    from kvbench.run.app import Session

    from helpers import WORDS, word_samples

    data = word_samples(tmp_path / "data.jsonl", 3, lambda i: " ".join(WORDS[(i + k) % 12] for k in range(50)),
                        max_new_tokens=4)
    sweep = tmp_path / "sweep"
    job = ["model=tiny-llama", "task=jsonl", f"task.path={data}", "block=16", "progress=false", "model.dtype=float64"]
    res = kvbench_main("-m", *LAUNCH[:3], "hydra.launcher.mem_gb=2", *job, "policy=keydiff,tova", "budget=64,96",
                       "seed=0,1", f"hydra.sweep.dir={sweep}",
                       "hydra.sweep.subdir=${hydra:runtime.choices.policy}_N${budget}_s${seed}")
    assert res.returncode == 0, res.stderr
    assert "kvbench: 8 sweep jobs in 2 jobs (runs that differ only in policy and budget share work" in res.stdout
    assert re.search(r"submitted 2 jobs to SLURM as job \d+", res.stdout)
    session = Session()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _compare_with_local(sweep, tmp_path, job, data, session)
    finally:
        torch.set_num_threads(threads)


def _compare_with_local(sweep: Path, tmp_path: Path, job: list[str], data: Path, session: Any) -> None:
    from helpers import run_config

    from kvbench.run.app import Member, run_members
    from kvbench.run.settings import RunSettings

    for policy in ("keydiff", "tova"):
        for budget in (64, 96):
            for seed in (0, 1):
                run = sweep / f"{policy}_N{budget}_s{seed}"
                records = _lines(run / "predictions.jsonl")
                # share_rows auto on a CPU: a cache each, the four decoding as the rows of one forward
                assert [r["batch"]["size"] for r in records] == [4] * len(records)
                # the four caches of a sample share a trunk, each taking it over to its own first eviction: the blocks
                # of 16 up to the first to end past N (80 for N = 64, 112 for N = 96)
                end = 80 if budget == 64 else 112
                assert all(r["trunk_tokens"] == min(end, r["prompt_tokens"]) for r in records)
                cfg = run_config(*job[:2], *job[3:], f"policy={policy}", f"budget={budget}", f"seed={seed}",
                                 "share=false", values={"task.path": str(data)})
                local = tmp_path / "local" / run.name
                run_members([Member(RunSettings.from_config(cfg), policy, local)], session)
                how = ("batch", "trunk_tokens")  # how the record ran, not what it holds
                assert _untimed([{k: v for k, v in r.items() if k not in how} for r in records]) == \
                    _untimed(_lines(local / "predictions.jsonl"))
