"""Batched or shared-work reruns against committed runs: every record of a committed run, rerun with batch_size=K
(or with the other runs given, as one shared-work sweep), compared field by field (tokens, prediction, score, graded
log-probability, decoding steps, peak tokens and bytes).

    python scripts/batch_identity.py --batch 4 --shard 0/2 --out results/bench_smollm2/batch_identity.md \
        results/niah_grid/runs/smollm2-135m/niah/*_N512_blockwise_B128
    python scripts/batch_identity.py --share --batch 1 --shard 0/5 --out results/bench_sweep/shared_identity.md \
        results/niah_grid/runs/smollm2-135m/niah/*

--share: the runs go through kvbench.run.app.run_members together, as `kvbench -m` runs them: those that differ only
in policy and budget form one group, run sample-major, with the share_rows each run recorded (the default, auto: on a
CPU a cache each, every cache's decoding steps as the rows of one forward).

Each run directory's own config.yaml (as the run recorded it: kvbench.options.stored_config) is rerun (shard i/n: its
samples with index % n == i) into a scratch directory (--scratch, default a temporary one; under it, the shortest
tail of the run's path no other run given shares: scratch_names); the table says, per run, how many samples are identical in every field above,
and for the others where the tokens first differ and by how much the graded score moved.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


# Compared exactly; the graded score (`answer_logprob`, 6 decimals) is compared by its difference: the teacher-forced
# branch decodes the batch's answers together, so its products round as batched decoding steps do.
FIELDS = ("tokens", "prediction", "score", "decode_steps", "new_tokens", "peak_kv_tokens", "kv_bytes_peak",
          "degenerate")


def _records(path: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def scratch_names(runs: list[Path]) -> list[Path]:
    """Where each run's rerun goes under --scratch (and is looked up under --reference): the shortest tail of its path
    that no other run given shares, so runs of one leaf name (e.g. every `shard6of11` of a sweep) never share a
    rerun directory; a unique leaf name is just that name."""
    def tail(run: Path, k: int) -> Path:
        return Path(*run.parts[-k:])

    out = []
    for run in runs:
        k = 1
        while k < len(run.parts) and sum(tail(r, k) == tail(run, k) for r in runs) > 1:
            k += 1
        out.append(tail(run, k))
    return out


def compose_shards(own: str | None, sub: str | None) -> str | None:
    """The shard of a run's own shard `own` (i/n, the run's samples: index % n == i) that holds its samples at
    positions j, j + m, ... of that shard (`sub` = j/m): (i + n j)/(n m); either may be None (all)."""
    if sub is None or own is None:
        return sub if own is None else own
    (i, n), (j, m) = (tuple(int(x) for x in s.split("/")) for s in (own, sub))
    return f"{i + n * j}/{n * m}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--share", action="store_true", help="rerun the runs together as one shared-work sweep")
    p.add_argument("--reference", type=Path, default=None,
                   help="compare with the runs of the same names in this directory (e.g. another rerun's --scratch "
                        "of the same runs) instead of the committed ones")
    p.add_argument("--shard", default=None,
                   help="i/n: rerun only the run's samples with index %% n == i (a run of a shard: the index within "
                        "its shard; e.g. 0/1000 reruns each run's first sample)")
    p.add_argument("--scratch", type=Path, default=None)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--json", type=Path, default=None,
                   help="also write, per run, its samples and the ids of those that differ (for scripts/reproduce.py)")
    p.add_argument("--reuse", action="store_true",
                   help="take finished reruns already in --scratch as they are (redraw the table without rerunning)")
    a = p.parse_args(argv)
    from kvbench.run.score import ScoreError, committed_run_configs

    try:
        configs = committed_run_configs(a.runs)  # a bad one is one line, nothing written
    except ScoreError as e:
        print(f"batch_identity: {e}", file=sys.stderr)
        return 2
    from kvbench.run.app import Member, Session, run_members
    from kvbench.run.settings import RunSettings

    scratch = a.scratch or Path(tempfile.mkdtemp(prefix="kvbench-batch-"))
    session = Session()
    members = []
    where = dict(zip(a.runs, scratch_names(a.runs)))
    for run in a.runs:
        cfg = configs[run]
        name = json.loads((run / "metrics.json").read_text())["policy"]
        cfg.update(batch_size=a.batch, shard=compose_shards(cfg.get("shard"), a.shard), overwrite=not a.reuse,
                   progress=False, share=a.share)
        members.append(Member(RunSettings.from_config(cfg), name, scratch / where[run]))
    if a.share:
        run_members(members, session)  # one shared-work sweep (per group of runs differing in policy and budget)
    rows, differing = [], []
    for run, member in zip(a.runs, members):
        name = member.name
        if not a.share:
            run_members([member], session)
        ref = a.reference / where[run] if a.reference else run
        old, new = _records(ref / "predictions.jsonl"), _records(scratch / where[run] / "predictions.jsonl")
        # the rerun's own time, from its records (each sample's share of its batches): also right with --reuse
        took = sum(r["prefill_s"] + r["decode_s"] + r.get("graded_s", 0.0) for r in new.values())
        same, diffs, moved = 0, [], 0.0
        for sid, rec in new.items():
            ref = old[sid]
            if rec.get("answer_logprob") is not None and ref.get("answer_logprob") is not None:
                moved = max(moved, abs(rec["answer_logprob"] - ref["answer_logprob"]))
            if all(rec.get(f) == ref.get(f) for f in FIELDS):
                same += 1
                continue
            diffs.append(f"{sid}: tokens from {_first_diff(rec.get('tokens') or [], ref.get('tokens') or [])}, "
                         f"fields {', '.join(f for f in FIELDS if rec.get(f) != ref.get(f))}")
        rows.append((run, name, len(new), same, moved, diffs, took))
        differing.append({"run": run.as_posix(), "samples": len(new), "identical": same, "graded_moved": moved,
                          "differ": [sid for sid, rec in new.items()
                                     if not all(rec.get(f) == old[sid].get(f) for f in FIELDS)]})
        print(f"{run.name}: {same}/{len(new)} identical, graded score moved {moved:.1e} ({took:.0f} s)",
              file=sys.stderr, flush=True)
    share_rows = ",".join(sorted({str(m.settings.share_rows).lower() for m in members}))
    what = (f"Shared-work reruns (the runs below as one sweep, share=true, share_rows={share_rows}, "
            f"batch_size={a.batch})" if a.share else f"Batched (batch_size={a.batch}) reruns")
    against = (f" compared with the runs of the same names in `{a.reference.name}/` (not the committed ones)"
               if a.reference else " of committed batch-1 runs")
    lines = [f"{what}{against}"
             + (f", samples of shard {a.shard}" if a.shard else "") + "; identical = every field of "
             + ", ".join(f"`{f}`" for f in FIELDS) + " equal; the graded score (`answer_logprob`, nats per token, "
             "stored to 6 decimals) by its largest difference.", "",
             "| committed run | policy | samples | identical | graded score: max abs difference | differing samples "
             "(first differing token, fields) | rerun time (s) |",
             "|---|---|---|---|---|---|---|"]
    for run, name, n, same, moved, diffs, took in rows:
        lines.append(f"| `{run.as_posix()}` | {name} | {n} | {same} | {moved:.1e} | {'; '.join(diffs) or '-'} | "
                     f"{took:.0f} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    if a.json:
        a.json.write_text(json.dumps(differing, indent=1) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
