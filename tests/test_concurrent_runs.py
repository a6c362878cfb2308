"""The same command started twice at the same instant into one run directory: one process runs it to the end, the
other is refused with one line and exit code 2, and the refused one removes nothing (the run lock is taken before
anything is written or removed; clean-up removes only what its own process created while holding the lock)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Two processes each import everything the job needs once, then run the same command once per round (so a round costs
# the job, not the imports): a process says it is ready, waits for the round's go file, runs `kvbench`
# (helpers.kvbench_main: kvbench.cli.main with the command's argv) and writes its exit code and stderr. Inside the
# command a second barrier holds each process just before it takes the run lock, until both are there: on a loaded
# machine one process can otherwise fall behind by more than the whole job, and then (correctly) find the run finished
# and exit 0. Both processes have set up Hydra's files in the directory by then; which one gets the lock is left to the
# race.
LAUNCHER = """
import json, pathlib, sys, time
sys.path.insert(0, "tests")  # (the launcher runs in the repository root)
import kvbench.cli, kvbench.run.app, kvbench.report.cli, kvbench.tasks.niah
import transformers.models.llama.modeling_llama
from helpers import kvbench_main
tmp, me, rounds, args = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
app, real_lock, now = kvbench.run.app, kvbench.run.app.run_lock, {}

def wait(name):
    while not (tmp / name).exists():
        time.sleep(0.001)

def aligned_lock(run_dir, *more, **kw):
    if kw.get("create", more[0] if more else True):  # run_one's lock, not the clean-up's (create=False)
        (tmp / f"atlock{now['k']}_{me}").touch()
        wait(f"golock{now['k']}")
    return real_lock(run_dir, *more, **kw)

app.run_lock = aligned_lock
for k in range(rounds):
    now["k"] = k
    (tmp / f"ready{k}_{me}").touch()
    wait(f"go{k}")
    r = kvbench_main(*args, f"hydra.run.dir={tmp / f'run{k}'}")
    part = tmp / f"result{k}_{me}.part"  # renamed whole: the test never reads half a file
    part.write_text(json.dumps({"code": r.returncode, "stderr": r.stderr}))
    part.rename(tmp / f"result{k}_{me}.json")
"""
COMMAND = ["model=tiny-llama", "task=niah", "task.context_lengths=[300]", "task.depths=[50]", "task.haystack=filler",
           "policy=streamingllm", "budget=128", "task.max_new_tokens=4", "progress=false"]


def _wait(ready: list[list[Path]], procs: list[subprocess.Popen], deadline: float) -> None:
    """Until every process has made one of its files in `ready` (process i: any of ready[i]). A process that has
    exited without its file failed. Each process is polled before its files are looked at: it writes its last result
    and then exits, so a file looked for after the poll that saw it exit is there if it ever will be."""
    while True:
        exited = [p.poll() is not None for p in procs]
        made = [any(p.exists() for p in paths) for paths in ready]
        if all(made):
            return
        # (the stderr of the exited processes only: one still running waits for a go file, communicate() would hang)
        assert not any(e and not m for e, m in zip(exited, made)), [
            p.communicate()[1][-3000:] for p, e in zip(procs, exited) if e]
        assert time.monotonic() < deadline, f"timed out waiting for {ready}"
        time.sleep(0.01)


def race(tmp_path: Path, rounds: int) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path), str(i), str(rounds), *COMMAND],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        deadline = time.monotonic() + 300 + 120 * rounds
        for k in range(rounds):
            results = [tmp_path / f"result{k}_{i}.json" for i in range(2)]
            _wait([[tmp_path / f"ready{k}_{i}"] for i in range(2)], procs, deadline)
            (tmp_path / f"go{k}").touch()  # both start the command together
            _wait([[tmp_path / f"atlock{k}_{i}", results[i]] for i in range(2)], procs, deadline)
            (tmp_path / f"golock{k}").touch()  # both at the lock (or done, if one never got there): race for it
            _wait([[r] for r in results], procs, deadline)
            check_round(tmp_path / f"run{k}", [json.loads(r.read_text()) for r in results])
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def check_round(run_dir: Path, results: list[dict]) -> None:
    codes = [r["code"] for r in results]
    assert sorted(codes) == [0, 2], results  # one ran, one was refused (never both run, never both refused)
    refused = results[codes.index(2)]["stderr"]
    assert [ln for ln in refused.splitlines() if ln.strip()] == [
        f"kvbench: error: another kvbench process is running in {run_dir}"], refused
    # The finished run is whole: nothing of it was removed by the refused process.
    names = {p.name for p in run_dir.iterdir()}
    assert {"metrics.json", "predictions.jsonl", "config.yaml", "run.json", ".hydra"} <= names, names
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    records = (run_dir / "predictions.jsonl").read_text().splitlines()
    assert len(records) == 1 and json.loads(records[0])["new_tokens"] <= 4  # one sample, written once
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["policy"] == "streamingllm" and set(metrics["scores"]) == {"L300_D50", "avg"}


def test_same_command_twice_at_once_one_runs_one_is_refused(tmp_path: Path) -> None:
    race(tmp_path, rounds=10)  # (44 s on the busy 2-core machine: the imports are paid once per process)


class _WritesThenExits:
    """A process that writes its file and exits between two looks of the waiter: at its first poll."""

    def __init__(self, path: Path) -> None:
        self.path, self.returncode = path, None

    def poll(self) -> int:
        self.path.touch()
        self.returncode = 0
        return 0


def test_wait_sees_the_file_of_a_process_that_wrote_it_and_exited_meanwhile(tmp_path: Path) -> None:
    # The last round's race (CI, stop 45): the file was missing at the look, the process wrote it and exited before
    # the poll; the poll that sees it exit must not be read as an exit without a file.
    last = tmp_path / "result9_1.json"
    (tmp_path / "result9_0.json").touch()
    _wait([[tmp_path / "result9_0.json"], [last]], [_WritesThenExits(tmp_path / "unused"), _WritesThenExits(last)],
          time.monotonic() + 5)
    assert last.exists()
