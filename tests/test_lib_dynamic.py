"""scripts/lib.sh: DYNAMIC=1 runs queued commands in queue order, WORKERS at a time, a failure named at the end;
grid_claims queues the designed grid's claims."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, commands: list[str], workers: int) -> subprocess.CompletedProcess:
    queued = "\n".join(f"queue 0 bash -c {c!r}" for c in commands)
    script = f"""
NAME=t WORKERS={workers} DYNAMIC=1
source scripts/lib.sh
RUNS={tmp_path}/runs QUEUE_DIR={tmp_path}/q COMMANDS=()
mkdir -p "$RUNS" "$QUEUE_DIR"
{queued}
wait_workers
echo "queue left: $(ls "$QUEUE_DIR" | wc -l)"
"""
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True)


def test_commands_start_in_queue_order_at_most_workers_at_a_time(tmp_path: Path) -> None:
    events = tmp_path / "events"
    # Each command writes s<i> when it starts and e<i> when it ends; the first two sleep longest, so with two workers
    # the third starts only after one of them ends.
    cmds = [f"echo s{i} >> {events}; sleep {d}; echo e{i} >> {events}" for i, d in enumerate([0.6, 0.4, 0.1, 0.1])]
    r = _run(tmp_path, cmds, workers=2)
    assert r.returncode == 0, r.stderr
    seq = events.read_text().split()
    starts = [e for e in seq if e.startswith("s")]
    # the first two are taken in queue order but start together, so their two echoes may land either way round
    assert sorted(starts[:2]) == ["s0", "s1"] and starts[2:] == ["s2", "s3"]
    running = peak = 0
    for e in seq:
        running += 1 if e.startswith("s") else -1
        peak = max(peak, running)
    assert peak == 2
    assert seq.index("s2") > seq.index("e1")  # the worker that ended first took the next command
    assert "queue left: 0" in r.stdout  # emptied, so a script may queue and wait again
    assert sorted(p.name for p in (tmp_path / "runs").glob("job-*.log")) == [f"job-00{i}.log" for i in range(1, 5)]


def test_a_failed_command_fails_the_wait_after_the_others_ran(tmp_path: Path) -> None:
    done = tmp_path / "done"
    r = _run(tmp_path, ["exit 3", f"touch {done}"], workers=1)
    assert r.returncode == 1
    assert done.exists()
    assert "a command failed; see" in r.stderr


def test_grid_claims_queues_each_claim_under_its_protocol_in_its_folder(tmp_path: Path) -> None:
    script = f"""
NAME=t WORKERS=1 MODEL=m KVBENCH=kv
source scripts/lib.sh
QUEUE_DIR={tmp_path} COMMANDS=() GRID=(task=niah)
grid_claims 0 shard=3/11 D 1024 512
printf '%s\\n' "${{COMMANDS[@]}}"
"""
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    head = "kv -m model=m task=niah shard=3/11"
    assert r.stdout.splitlines() == [
        f"{head} protocol=blockwise block=128 'policy=keydiff,tova,snapkv,h2o,streamingllm' budget=1024 "
        "hydra.sweep.dir=D/keydiff progress=false",
        f"{head} protocol=blockwise block=128 policy=full budget=null hydra.sweep.dir=D/keydiff progress=false",
        f"{head} protocol=blockwise block=128 policy=hashevict budget=1024 hydra.sweep.dir=D/hashevict_h2o "
        "progress=false",
        f"{head} protocol=blockwise block=128 policy=h2o policy.n_sink=4 policy.n_recent=10 budget=1024 "
        "hydra.sweep.dir=D/hashevict_h2o progress=false",
        f"{head} protocol=prefill_once policy=snapkv policy.pooling=max budget=512 hydra.sweep.dir=D/criticalkv_snapkv "
        "progress=false",
        f"{head} protocol=prefill_once policy=criticalkv budget=512 hydra.sweep.dir=D/criticalkv_snapkv progress=false",
        f"{head} protocol=prefill_once policy=adakv budget=512 hydra.sweep.dir=D/criticalkv_adakv progress=false",
        f"{head} protocol=prefill_once policy=criticalkv policy.base=adakv budget=512 "
        "hydra.sweep.dir=D/criticalkv_adakv progress=false",
        f"{head} protocol=prefill_once_decode_evict 'policy=sagekv,streamingllm' budget=512 "
        "hydra.sweep.dir=D/sagekv_streamingllm progress=false",
    ]
