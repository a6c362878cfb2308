"""SLURM as kvbench's sweeps meet it (docs/sweeps.md, "A CPU cluster"), through SLURM's own commands only (sinfo,
squeue, scontrol, and sacct where accounting exists), so it works on clusters without an accounting daemon.

- Before anything is submitted: does the chosen partition exist, and can one of its nodes hold one job (GPUs, CPUs,
  memory)? A GPU preset on a CPU partition stops here with one line naming the override (`check_resources`).
- While `kvbench -m` waits: every job's state, from squeue/scontrol while SLURM remembers the job, from sacct after,
  from the job's own result file in any case (`job_states`, `wait_for_jobs`). submitit alone polls sacct, which
  answers nothing without accounting, so a cancelled job made the sweep wait forever.
- Inside a job: SIGTERM or the time-limit signal requeues the job when SLURM keeps it running (preemption, the
  warning before the time limit), up to a bound; a cancelled job is not requeued (`install_stop_handlers`). The
  finished samples are already on disk (predictions.jsonl), so the requeued job, or a relaunch of the sweep, resumes.

No Hydra here (the launcher plugin, hydra_plugins/kvbench_slurm_launcher, is the Hydra side); submitit is imported
only inside a job's handler.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

# Job states in which a job may still produce its result (squeue's long names). Every other state is final: COMPLETED,
# CANCELLED, FAILED, TIMEOUT, OUT_OF_MEMORY, NODE_FAIL, PREEMPTED (not requeued), BOOT_FAIL, DEADLINE, ...
ACTIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "REQUEUED", "REQUEUE_FED",
    "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "POWER_UP_NODE", "UPDATE_DB",
})
# The submit-side commands a SLURM launcher needs on the machine `kvbench -m` runs on (a login node).
COMMANDS = ("sbatch", "squeue", "sinfo", "scontrol")
# A final state without a result file is a failure once it has lasted this long: a result file written just before
# the job ended may take a moment to show on a shared filesystem (submitit waits 15 s as well).
RESULT_GRACE_S = 15.0
# Waiting polls squeue every 2 s at first, then less often, never less often than every 30 s: a failure is reported
# within RESULT_GRACE_S + 30 s of the job's end, and a long sweep does not load slurmctld.
MIN_POLL_S, MAX_POLL_S = 2.0, 30.0


class SlurmUnavailable(RuntimeError):
    """SLURM's commands are missing or do not answer; the message says which and why, in one line."""


def _run(cmd: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmUnavailable(f"{cmd[0]} not found: this machine has no SLURM commands") from None
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"{' '.join(cmd[:2])} did not answer within {timeout:.0f} s") from None


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


@dataclass(frozen=True)
class NodeGroup:
    """Nodes of one partition that sinfo reports together (same CPUs, memory and generic resources)."""

    partition: str
    default: bool
    cpus: int
    memory_mb: int
    gpus: bool
    max_minutes: int | None = None  # the partition's time limit (None: infinite or unknown)


def _number(text: str) -> int:
    # sinfo writes "2", or "2+" when nodes of one line differ (the smallest value first).
    digits = re.match(r"\d+", text.strip())
    return int(digits.group()) if digits else 0


def minutes(limit: str) -> int | None:
    """A SLURM time limit as sinfo writes it ("infinite", "1-12:00:00", "4:00:00", "30:00") in whole minutes, or None
    for no limit (or one it does not give)."""
    found = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", limit.strip())
    if not found:
        return None
    days, hours, mins, secs = (int(x or 0) for x in found.groups())
    if found.group(2) is None and found.group(1) is not None:  # "D-HH:MM" is not a form sinfo writes
        return None
    return days * 1440 + hours * 60 + mins + (secs > 0)


def partition_nodes() -> list[NodeGroup]:
    """Every partition's node groups, from `sinfo` (raises SlurmUnavailable when SLURM cannot be asked)."""
    out = _run(["sinfo", "--noheader", "--format=%P|%c|%m|%G|%l"])
    if out.returncode != 0:
        raise SlurmUnavailable(f"sinfo failed: {_first_line(out.stderr) or f'exit code {out.returncode}'}")
    groups = []
    for line in out.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 5:
            continue
        name, cpus, mem, gres, limit = parts
        groups.append(NodeGroup(partition=name.rstrip("*"), default=name.endswith("*"), cpus=_number(cpus),
                                memory_mb=_number(mem), gpus="gpu" in gres.lower(), max_minutes=minutes(limit)))
    return groups


def requested_gpus(params: Mapping[str, Any]) -> int:
    """GPUs one job of a submitit SLURM launcher config asks for (gpus_per_node, gpus_per_task, or a gpu gres)."""
    n = max(int(params.get("gpus_per_node") or 0), int(params.get("gpus_per_task") or 0))
    gres = str(params.get("gres") or "")
    if not n and "gpu" in gres:
        n = _number(gres.rsplit(":", 1)[-1]) or 1
    return n


def check_resources(params: Mapping[str, Any], choice: str) -> str | None:
    """One line saying why SLURM would refuse one job of this launcher config (hydra.launcher.*, chosen as
    `hydra/launcher=<choice>`) on its partition, or None when a node of the partition can hold it. Asked before
    anything is written, so a GPU preset on a CPU partition ends with the override to use instead of sbatch's
    error and a half-made sweep directory."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return (f"hydra/launcher={choice} submits to SLURM, but this machine has no {', '.join(missing)}: run kvbench "
                f"on the cluster's login node (scripts/slurm_cluster.sh start makes a one-node cluster here)")
    try:
        groups = partition_nodes()
    except SlurmUnavailable as e:
        return f"hydra/launcher={choice}: SLURM does not answer ({e})"
    names = sorted({g.partition for g in groups})
    wanted = params.get("partition")
    if wanted is None:
        defaults = {g.partition for g in groups if g.default}
        if not defaults:
            return f"SLURM has no default partition: choose one with hydra.launcher.partition=NAME ({', '.join(names)})"
        wanted = defaults.pop()
    nodes = [g for g in groups if g.partition == str(wanted)]
    if not nodes:
        return (f"SLURM has no partition '{wanted}': hydra.launcher.partition=NAME with one of "
                f"{', '.join(names) or '(none)'}")
    gpus = requested_gpus(params)
    if gpus and not any(g.gpus for g in nodes):
        return (f"partition '{wanted}' has no GPUs and hydra/launcher={choice} asks for {gpus} per job: use "
                f"hydra/launcher=slurm_cpu for CPU nodes (or hydra.launcher.gpus_per_node=null)")
    cpus, most_cpus = int(params.get("cpus_per_task") or 1) * int(params.get("tasks_per_node") or 1), max(
        g.cpus for g in nodes)
    if cpus > most_cpus:
        return (f"hydra.launcher.cpus_per_task={params.get('cpus_per_task')} but the nodes of partition '{wanted}' "
                f"have at most {most_cpus} CPUs: set hydra.launcher.cpus_per_task={most_cpus} or less")
    mem_gb, most_mb = params.get("mem_gb"), max(g.memory_mb for g in nodes)
    if mem_gb is not None and float(mem_gb) * 1024 > most_mb:
        return (f"hydra.launcher.mem_gb={mem_gb} but the nodes of partition '{wanted}' have at most {most_mb} MB: set "
                f"hydra.launcher.mem_gb={most_mb // 1024} or less")
    timeout, limit = params.get("timeout_min"), nodes[0].max_minutes
    if timeout is not None and limit is not None and int(timeout) > limit:
        # SLURM would accept the array and leave it pending for ever (reason PartitionTimeLimit).
        return (f"hydra.launcher.timeout_min={timeout} is longer than partition '{wanted}' allows ({limit} min): set "
                f"hydra.launcher.timeout_min={limit} or less (a job that needs longer is requeued and resumes)")
    return None


def _base_id(job_id: str) -> str:
    return job_id.split("_", 1)[0]


def job_states(job_ids: Sequence[str]) -> dict[str, str]:
    """The state of each job (submitit's ids: "123" or array tasks "123_4") that SLURM still knows: squeue for the
    jobs slurmctld holds (running, pending, and finished ones for MinJobAge, 5 min by default), then sacct for the
    others when the cluster keeps accounting. A job neither knows is left out. Never raises: a command that fails
    (sacct without accounting, squeue for purged ids) just answers nothing."""
    bases = sorted({_base_id(j) for j in job_ids})
    found: dict[str, str] = {}
    if not bases:
        return found
    try:
        out = _run(["squeue", "--noheader", "--array", "--states=all", f"--jobs={','.join(bases)}",
                    "--format=%i|%T"])
        if out.returncode == 0:
            for line in out.stdout.splitlines():
                jid, _, state = line.strip().partition("|")
                if jid and state:
                    found[jid] = state.strip().upper()
        rest = [j for j in job_ids if j not in found]
        if rest and shutil.which("sacct"):
            out = _run(["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={','.join(rest)}",
                        "--format=JobID,State"])
            if out.returncode == 0:
                for line in out.stdout.splitlines():
                    jid, _, state = line.strip().partition("|")
                    if jid in rest and state:
                        found[jid] = state.split()[0].upper()  # "CANCELLED by 0" -> CANCELLED
    except SlurmUnavailable:
        pass
    return {j: found[j] for j in job_ids if j in found}


@dataclass
class Failure:
    """A job of the sweep that ended without its result: its id, its final state, its error log and, when known, the
    error it ended with."""

    job_id: str
    label: str
    state: str
    log: Path
    detail: str | None = None

    def line(self) -> str:
        where = f"log {self.log}" if self.log.is_file() else f"no log ({self.log} was never written: the job never ran)"
        detail = f": {self.detail}" if self.detail else ""
        return f"sweep job {self.job_id} [{self.label}] {self.state}{detail}; {where}"


def error_in(text: str) -> str | None:
    """The line of a job's error output that says why it ended: kvbench's own one-line error (the last one), else
    the last exception line of a traceback, else what srun says of a task that died ("task 0: Killed"), else None."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("kvbench: error:"):
            return line[len("kvbench: error:"):].strip()
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", line):
            return line
    for line in reversed(lines):
        died = re.match(r"^srun: error: \S+: (task \d+: .+)$", line)
        if died:
            return died.group(1)
    return None


def last_error_line(log: Path) -> str | None:
    """`error_in` of a job's error log; None when there is no log."""
    try:
        return error_in(log.read_text(errors="replace"))
    except OSError:
        return None


def wait_for_jobs(jobs: Sequence[Any], labels: Sequence[str], result_error: Callable[[Any], str | None], *,
                  states: Callable[[Sequence[str]], dict[str, str]] = job_states,
                  sleep: Callable[[float], None] = time.sleep,
                  clock: Callable[[], float] = time.monotonic) -> list[Failure]:
    """Wait until every job has its result, or until one has failed; returns the failures found (empty: every job
    succeeded). `jobs` are submitit jobs (`job_id`, `paths.result_pickle`, `paths.stderr`); `labels` their sweep
    overrides; `result_error(job)` reads a job's result file and says why it failed, or None when it succeeded.

    A job has failed when its result says so, or when SLURM reports a final state (or no longer knows the job) and
    no result file has appeared RESULT_GRACE_S later. Never waits on sacct alone, so a cluster without accounting
    cannot make the sweep wait forever."""
    start = clock()
    ended_since: dict[str, float] = {}  # job id -> when SLURM was first seen to have ended it without a result
    done: set[str] = set()
    while True:
        failures = []
        for job, label in zip(jobs, labels):
            if job.job_id in done or not job.paths.result_pickle.exists():
                continue
            done.add(job.job_id)
            error = result_error(job)
            if error is not None:
                failures.append(Failure(job.job_id, label, "FAILED", job.paths.stderr, error))
        pending = [(j, lab) for j, lab in zip(jobs, labels) if j.job_id not in done]
        if pending and not failures:
            known = states([j.job_id for j, _ in pending])
            now = clock()
            for job, label in pending:
                state = known.get(job.job_id)
                if state in ACTIVE_STATES:
                    ended_since.pop(job.job_id, None)
                    continue
                first = ended_since.setdefault(job.job_id, now)
                if now - first >= RESULT_GRACE_S and not _refreshed(job.paths.result_pickle).exists():
                    shown = state or "UNKNOWN (no longer known to SLURM)"
                    if state == "COMPLETED":
                        detail: str | None = "it ended without writing its result"
                    else:  # (a cancelled job's log says only that it was cancelled)
                        detail = None if state in (None, "CANCELLED") else last_error_line(job.paths.stderr)
                    failures.append(Failure(job.job_id, label, shown, job.paths.stderr, detail))
        if failures or not pending:
            return failures
        sleep(min(MAX_POLL_S, MIN_POLL_S + (clock() - start) / 10))


def _refreshed(path: Path) -> Path:
    # On NFS a client may cache a directory's listing for up to a minute, and so miss a result file another node
    # has just written; changing the directory's attributes (to what they are) makes it look again, as submitit does.
    try:
        path.parent.chmod(path.parent.stat().st_mode)
    except OSError:
        pass
    return path


def job_label() -> str:
    """This SLURM job's id as squeue and submitit write it ("123_4" for an array task)."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID", "?")


def own_state() -> str | None:
    """This job's state as slurmctld holds it (RUNNING while it may go on; COMPLETING once it was cancelled or hit
    its time limit), or None when it cannot be asked."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = _run(["scontrol", "--oneliner", "show", "job", job], timeout=20)
    except SlurmUnavailable:
        return None
    found = re.search(r"\bJobState=(\S+)", out.stdout)
    return found.group(1).upper() if found else None


def install_stop_handlers(max_requeues: int) -> None:
    """In a SLURM job: SIGTERM, SIGUSR1 and submitit's time-limit signal (SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL
    says otherwise; sbatch --signal sends it hydra.launcher.signal_delay_s before the limit) requeue the job when
    SLURM keeps it RUNNING: preemption, or the warning before the time limit. The requeue is submitit's own handler
    of its time-limit signal, installed before the job's function runs (it calls the launcher's checkpoint, counts
    time-outs against max_num_timeout, `scontrol requeue`s the job and exits); nothing more needs saving, the
    finished samples are on disk. At most `max_requeues` restarts (SLURM_RESTART_COUNT), so a job that
    is preempted over and over does not loop forever.

    A job SLURM is ending (scancel: state COMPLETING or CANCELLED; the hard time limit) is not requeued: it says so on
    stderr and exits at once instead of waiting for SIGKILL."""
    from submitit import JobEnvironment

    usr_signal = getattr(signal, "SIG" + JobEnvironment.USR_SIG)
    requeue = signal.getsignal(usr_signal)
    if not callable(requeue):
        raise RuntimeError("install_stop_handlers runs inside a submitit job, after submitit's own handlers")

    stopping: list[int] = []  # set once the job requeues or exits: the signals SLURM sends while it ends change nothing

    def handler(signum: int, frame: Any) -> None:
        if stopping:
            return
        name = signal.Signals(signum).name
        state = own_state()
        if state != "RUNNING":
            stopping.append(signum)
            print(f"kvbench: job {job_label()} got {name} while {state or 'in an unknown state'}: not requeued; its "
                  f"finished samples are in predictions.jsonl (launching the sweep again resumes them)",
                  file=sys.stderr, flush=True)
            sys.exit(128 + signum)
        restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        if restarts >= max_requeues:
            print(f"kvbench: job {job_label()} got {name}: not requeued, it was requeued {restarts} times already "
                  f"(hydra.launcher.max_num_timeout={max_requeues}); it goes on until SLURM stops it",
                  file=sys.stderr, flush=True)
            return
        print(f"kvbench: job {job_label()} got {name}: requeued ({restarts + 1} of at most {max_requeues}); it "
              f"resumes from its predictions.jsonl", file=sys.stderr, flush=True)
        stopping.append(signum)
        requeue(signum, frame)

    for sig in {signal.SIGTERM, signal.SIGUSR1, usr_signal}:
        signal.signal(sig, handler)
