"""Shared-work sweeps in the run layer (kvbench.run.app.run_members / run_group, kvbench.run.loop.run_shared, the
in-process launcher): a sweep's runs that differ only in policy and budget run sample-major, each sample's runs
through `generate_batch` together (from one shared trunk; with share_rows=true the runs whose policies select alike,
a policy's budgets, as the rows of one cache; the default on a CPU, a cache each; both: every cache's decoding steps as
the rows of one forward), each into its own run directory
with the records it has alone (timings and the record's `batch` aside; in float64, where a K-row product cannot round
a near-tie the other way); share=false runs alone; a kill mid-group resumes per (run, sample) to the same records;
the CLI's sweep and a `compare` job share."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbench.run.app import Member, Session, run_members
from kvbench.run.settings import RunSettings

from helpers import WORDS, kvbench_main, run_config, word_samples

ROOT = Path(__file__).resolve().parent.parent
# What differs between a shared and a separate run of the same job: the clocks, and a batch's row's record of its batch.
TIMED = {"prefill_s", "decode_s", "evict_s", "graded_s", "batch", "trunk_tokens"}  # how it ran, not what
FLOAT64 = "model.dtype=float64"
N_SAMPLES = 4


def _data(tmp_path: Path) -> Path:
    """Four prompts of ~200-300 tiny-tokenizer tokens: longer than N = 64 + B (evicting), shorter than N = 4096."""
    return word_samples(tmp_path / "data.jsonl", N_SAMPLES,
                        lambda i: " ".join(WORDS[(i * 5 + k * (i + 1)) % len(WORDS)] for k in range(40 + 8 * i)),
                        max_new_tokens=6)


# Every kind of member a group can hold: attention-free and attention-scoring policies, a stochastic one (random: its
# generator restarted per sample), the full cache; a budget below the prompts (evicts) and one above (never evicts).
POLICIES = ("full", "keydiff", "snapkv", "random")
BUDGETS = (64, 4096)


def _members(data: Path, out: Path, *extra: str, policies=POLICIES, budgets=BUDGETS) -> list[Member]:
    members = []
    for name in policies:
        for budget in budgets:
            cfg = run_config("model=tiny-llama", FLOAT64, "task=jsonl", f"policy={name}", f"budget={budget}",
                             "block=16", "progress=false", *extra, values={"task.path": str(data)})
            members.append(Member(RunSettings.from_config(cfg), name, out / f"{name}_N{budget}"))
    return members


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _untimed(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMED} for r in _lines(run_dir / "predictions.jsonl")]


@pytest.fixture(scope="module")
def separate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The reference: every job of the sweep (two protocols) run alone (share=false)."""
    tmp = tmp_path_factory.mktemp("separate")
    data = _data(tmp)
    session = Session()
    for protocol in ("blockwise", "prefill_once"):
        run_members(_members(data, tmp / protocol, f"protocol={protocol}", "share=false"), session)
    return data, tmp


def test_a_shared_sweep_writes_what_separate_runs_write(separate: tuple[Path, Path], tmp_path: Path) -> None:
    data, alone = separate
    members = [m for protocol in ("blockwise", "prefill_once")
               for m in _members(data, tmp_path / protocol, f"protocol={protocol}", "share_rows=true")]
    metrics = run_members(members, Session())
    assert [m["policy"] for m in metrics] == [m.name for m in members]  # in the order given
    for m in members:
        protocol = m.run_dir.parent.name
        assert _untimed(m.run_dir) == _untimed(alone / protocol / m.run_dir.name), m.run_dir
        mine = json.loads((m.run_dir / "metrics.json").read_text())
        theirs = json.loads((alone / protocol / m.run_dir.name / "metrics.json").read_text())
        assert mine["scores"] == theirs["scores"] and mine["average"] == theirs["average"]
        assert {p.name for p in m.run_dir.iterdir()} == {p.name for p in (alone / protocol / m.run_dir.name).iterdir()}
    # Every run decoded as a row of one forward with the sample's 7 others (a policy's two budgets the rows of one
    # cache, the full cache's too: its budget is never used; random a cache of its own: it draws from its own
    # generator per sample), under either protocol; the K+V they held together is at least each run's own.
    for m in members:
        records = _lines(m.run_dir / "predictions.jsonl")
        stats = json.loads((m.run_dir / "metrics.json").read_text())["stats"]
        assert {r["batch"]["size"] for r in records} == {8} and stats["batch_size"] == 8, m.run_dir
        assert all(r["batch"]["kv_bytes_peak"] >= r["kv_bytes_peak"] for r in records)
        assert stats["batch_kv_bytes_peak"] == max(r["batch"]["kv_bytes_peak"] for r in records)
    # The shared trunk, by hand: blockwise, keydiff's and snapkv's caches (rows N = 64 and 4096) share the blocks up
    # to 80 (the first block to end past 64); the full cache prefills in one forward, a plan of its own; under
    # prefill_once the three share the prompt's one forward; random never shares one.
    for m in members:
        blockwise = m.run_dir.parent.name == "blockwise"
        for r in _lines(m.run_dir / "predictions.jsonl"):
            want = None if m.name == "random" or (m.name == "full" and blockwise) else \
                80 if blockwise else r["prompt_tokens"]
            assert r.get("trunk_tokens") == want, (m.run_dir, r["id"])
    # the rows of a budget above every prompt (N = 4096) hold the whole prompt: more than the N = 64 row's peak
    for protocol in ("blockwise", "prefill_once"):
        big, small = (_lines(tmp_path / protocol / f"keydiff_N{n}" / "predictions.jsonl") for n in (4096, 64))
        assert all(b["kv_bytes_peak"] > s["kv_bytes_peak"] for b, s in zip(big, small))


def test_share_false_runs_alone(separate: tuple[Path, Path], tmp_path: Path) -> None:
    data, alone = separate
    members = _members(data, tmp_path, "share=false", policies=("keydiff", "tova"), budgets=(64,))
    run_members(members, Session())
    for m in members:
        assert all("batch" not in r for r in _lines(m.run_dir / "predictions.jsonl"))
        assert "batch_size" not in json.loads((m.run_dir / "metrics.json").read_text())["stats"]
    assert _untimed(tmp_path / "keydiff_N64") == _untimed(alone / "blockwise" / "keydiff_N64")


def test_group_keys() -> None:
    def key(*overrides: str) -> str | None:
        return RunSettings.from_config(run_config("model=tiny-llama", *overrides)).group_key()

    base = key("policy=keydiff", "budget=64")
    assert base is not None
    # Policy, budget, the compare list and how a run is shown share a group ...
    assert key("policy=tova", "budget=128") == base
    assert key("compare=[full,tova]") == key("compare=[keydiff]") == base
    assert key("policy=keydiff", "budget=64", "progress=false", "overwrite=true") == base
    # ... what changes the samples or the forwards does not; share=false and batches go alone.
    for other in ("block=32", "protocol=prefill_once", "scenario=context_only", "seed=1", "shard=0/2",
                  "task=niah", "task.max_new_tokens=9", "graded=false", "model.dtype=bfloat16"):
        assert key("policy=keydiff", "budget=64", other) != base, other
    assert key("policy=keydiff", "share=false") is None
    assert key("policy=keydiff", "budget=64", "batch_size=4") not in (base, None)  # a group of its own


def _kill_and_resume(separate: tuple[Path, Path], tmp_path: Path) -> dict[str, list[dict]]:
    """What a kill leaves mid-group: the runs finished different samples (each record is appended when its sample
    ends for that run), one file ends in a torn line, one run has written nothing yet, none has metrics.json; then
    the relaunch. Each run's records, by run directory name."""
    data, alone = separate
    members = _members(data, tmp_path, "share_rows=true", policies=("keydiff", "snapkv"))[:3]  # keydiff N = 64,
    # 4096; snapkv N = 64
    assert [m.run_dir.name for m in members] == ["keydiff_N64", "keydiff_N4096", "snapkv_N64"]
    for m, keep in zip(members, (3, 0, 1)):
        shutil.copytree(alone / "blockwise" / m.run_dir.name, m.run_dir)
        (m.run_dir / "metrics.json").unlink()
        lines = (m.run_dir / "predictions.jsonl").read_bytes().splitlines(keepends=True)
        torn = lines[keep][: len(lines[keep]) // 2] if m.name == "snapkv" else b""
        (m.run_dir / "predictions.jsonl").write_bytes(b"".join(lines[:keep]) + torn)
    run_members(members, Session())
    return {m.run_dir.name: _lines(m.run_dir / "predictions.jsonl") for m in members}


def test_a_kill_mid_group_resumes_per_run_and_sample(separate: tuple[Path, Path], tmp_path: Path) -> None:
    # The relaunch runs each sample for the runs that lack it and ends with the separate runs' records.
    _, alone = separate
    records = _kill_and_resume(separate, tmp_path)
    for name, recs in records.items():
        assert _untimed(tmp_path / name) == _untimed(alone / "blockwise" / name)
        assert [r["id"] for r in recs] == ["s0", "s1", "s2", "s3"]


def test_a_resumed_groups_runs_batch_where_they_meet(separate: tuple[Path, Path], tmp_path: Path) -> None:
    # keydiff N = 4096 runs sample 0 alone (keydiff N = 64 had samples 0-2 from before the kill, snapkv sample 0),
    # samples 1-2 decoding with snapkv's cache, sample 3 as a row of keydiff's cache with N = 64, decoding with snapkv
    records = _kill_and_resume(separate, tmp_path)
    assert [r.get("batch", {}).get("size") for r in records["keydiff_N4096"]] == [None, 2, 2, 3]
    assert [r.get("batch", {}).get("size") for r in records["keydiff_N64"]] == [None, None, None, 3]
    assert [r.get("batch", {}).get("size") for r in records["snapkv_N64"]] == [None, 2, 2, 3]


def test_the_cli_sweep_shares_and_sigkill_mid_group_resumes(separate: tuple[Path, Path], tmp_path: Path) -> None:
    """`kvbench -m` over keydiff, random x N = 64, 4096 (one group), killed (SIGKILL) once some run has finished a
    sample, then launched again: every run's records equal the separate runs' (the module's reference); with the
    default share_rows (auto) on a CPU each run has a cache of its own, from the shared trunk."""
    data, alone = separate
    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "kvbench.cli", "-m", "model=tiny-llama", FLOAT64, "task=jsonl", f"task.path={data}",
               "policy=keydiff,random", "budget=64,4096", "block=16", "progress=false", f"hydra.sweep.dir={killed}",
               "hydra.sweep.subdir=${hydra:runtime.choices.policy}_N${budget}"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 240  # (only to detect a hang)
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.read_bytes().count(b"\n") >= 1 for p in killed.rglob("predictions.jsonl")):
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not list(killed.rglob("metrics.json"))
    res = kvbench_main(*command[3:])  # the same command again, in this process
    assert res.returncode == 0, res.stderr
    runs = ["keydiff_N4096", "keydiff_N64", "random_N4096", "random_N64"]
    assert sorted(p.parent.name for p in killed.rglob("metrics.json")) == runs
    for run in runs:
        assert _untimed(killed / run) == _untimed(alone / "blockwise" / run), run
        assert (killed / run / ".hydra" / "overrides.yaml").is_file()  # each job set up by Hydra as before
    assert res.stdout.count("run directory: ") == 4
    # the last sample ran after the relaunch: keydiff's two budgets each in its own cache from one trunk, each taking
    # it over to its own first eviction (N = 64: the blocks to 80, the first to end past 64; N = 4096 never evicts
    # this prompt: all of it), random's alone; the four caches decoded together (share_rows auto: decode)
    last = {run: _lines(killed / run / "predictions.jsonl")[-1] for run in runs}
    assert [r["batch"]["size"] for r in last.values()] == [4] * 4
    assert [last[run].get("trunk_tokens") for run in runs] == [last["keydiff_N4096"]["prompt_tokens"], 80, None, None]


def test_a_compare_job_shares(separate: tuple[Path, Path], tmp_path: Path) -> None:
    from kvbench.run.app import run_configured

    data, alone = separate
    cfg = run_config("model=tiny-llama", FLOAT64, "task=jsonl", "compare=[keydiff,snapkv]", "budget=64", "block=16",
                     "progress=false", values={"task.path": str(data)})
    run_configured(cfg, {}, tmp_path)
    for name in ("keydiff", "snapkv"):
        assert _untimed(tmp_path / name) == _untimed(alone / "blockwise" / f"{name}_N64")
        # one budget, two classes: each sample's two runs go through generate_batch together, a cache each, decoding
        # as the rows of one forward (share_rows auto on a CPU: decode)
        assert [r["batch"]["size"] for r in _lines(tmp_path / name / "predictions.jsonl")] == [2] * N_SAMPLES


def test_batch_size_groups_share_too(separate: tuple[Path, Path], tmp_path: Path) -> None:
    """share with batch_size=2: a group of its own (test_group_keys), whose runs share as any group's: keydiff at
    N = 64 and 128 as the rows of one cache per sample (each record says batch size 2), every record the separate
    run's but for `batch` (float64)."""
    data, _ = separate

    def run(out: Path, *extra: str) -> None:
        run_members(_members(data, out, *extra, policies=("keydiff",), budgets=(64, 128)), Session())

    run(tmp_path / "alone", "share=false")
    run(tmp_path / "batched", "batch_size=2", "share_rows=true")
    for name in ("keydiff_N64", "keydiff_N128"):
        batched = _lines(tmp_path / "batched" / name / "predictions.jsonl")
        assert {r["batch"]["size"] for r in batched} == {2}
        assert _untimed(tmp_path / "batched" / name) == _untimed(tmp_path / "alone" / name)


def test_a_group_too_big_for_memory_splits_with_one_line(separate: tuple[Path, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """With the limit set to what two KeyDiff runs need on a 200-token prompt, a group of four runs goes whole on the
    shorter prompts and in parts whose bound fits the limit on the longer ones, says so once, and writes the records
    it writes whole."""
    import kvbench.run.loop as loop
    from kvbench.bench.setup import make_policy
    from kvbench.engine.generate import GenerationSettings, Job

    data, alone = separate
    members = _members(data, tmp_path, policies=("keydiff", "snapkv", "random", "full"), budgets=(64,))
    session = Session()
    model = session.model(members[0].settings).model
    two = [Job([5] * 200, make_policy("keydiff", 64, 0), GenerationSettings(block=16, max_new_tokens=6))] * 2
    limit = loop.shared_bytes(model, two)
    monkeypatch.setattr(loop, "memory_limit", lambda model: limit)
    real, parts_seen = loop.split_to_fit, []

    def spy(model, jobs, batch, lim, together):
        parts = real(model, jobs, batch, lim, together)
        assert all(len(p) == 1 or loop.shared_bytes(model, [jobs[k] for k in p], batch, together) <= lim
                   for p in parts)
        parts_seen.append(len(parts))
        return parts

    monkeypatch.setattr(loop, "split_to_fit", spy)
    run_members(members, session)
    assert len(parts_seen) == N_SAMPLES and max(parts_seen) >= 2  # the longer prompts split, the short ones not
    err = capsys.readouterr().err
    assert err.count("runs sharing a sample's work would hold") == 1 and "they run as " in err
    for m in members:
        assert _untimed(m.run_dir) == _untimed(alone / "blockwise" / m.run_dir.name)
