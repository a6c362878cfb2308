"""Does every committed result reproduce? Each committed run of results/<folder>/runs rerun on a sample subset (by
default its first sample) with today's code on this machine, compared field by field with its committed records
(scripts/batch_identity.py --batch 1: the run alone, as `kvbench` runs it), and every sample whose tokens differ
explained or not by its logits at the step where they part (scripts/logit_margin.py).

    OMP_NUM_THREADS=1 python scripts/reproduce.py                    # every folder, two workers
    OMP_NUM_THREADS=1 python scripts/reproduce.py niah_grid --shard 0/5

Writes results/reproduce/: <folder>.md (batch_identity's table) and .json, margins.md (one logit table per
differing sample) and README.md (the summary, generated here); the reruns go to results/runs/reproduce/ (scratch).
Folders run in parallel workers (--workers), the costliest first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
# Costliest first (Qwen's runs take ~90 s a sample, the 2k-token SmolLM2 runs ~30 s), so two workers finish together.
ORDER = ("qwen2.5-coder-1.5b", "niah_grid", "pilot_evidence", "claims", "evidence_code", "ruler_4k", "evidence_lm")


def run_dirs(folder: str) -> list[Path]:
    """The committed run directories of results/<folder>/runs (those with config.yaml and predictions.jsonl)."""
    return sorted(p.parent for p in (RESULTS / folder / "runs").rglob("predictions.jsonl")
                  if (p.parent / "config.yaml").is_file())


def folders_with_runs() -> list[str]:
    found = {p.name for p in RESULTS.iterdir() if p.is_dir() and p.name != "runs" and run_dirs(p.name)}
    return [f for f in ORDER if f in found] + sorted(found - set(ORDER))


def rerun(folder: str, shard: str, out: Path, scratch: Path) -> float:
    """batch_identity on the folder's runs; returns the seconds it took (wall)."""
    t0 = time.time()
    runs = [str(p.relative_to(ROOT)) for p in run_dirs(folder)]
    cmd = [sys.executable, "scripts/batch_identity.py", "--batch", "1", "--shard", shard, "--scratch",
           str(scratch / folder), "--out", str(out / f"{folder}.md"), "--json", str(out / f"{folder}.json"), *runs]
    with open(scratch / f"{folder}.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.time() - t0


def margins(folder: str, out: Path, scratch: Path) -> list[str]:
    """logit_margin's table for every differing sample of the folder's reruns."""
    parts = []
    for row in json.loads((out / f"{folder}.json").read_text()):
        for sid in row["differ"]:
            md = scratch / f"margin-{len(parts)}-{folder}.md"
            subprocess.run([sys.executable, "scripts/logit_margin.py", row["run"], "--sample", str(sid), "--out",
                            str(md)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            parts.append(md.read_text())
    return parts


def summary(folders: list[str], out: Path, shard: str) -> str:
    """README.md: per folder, the runs and samples rerun, how many are identical, the largest graded move."""
    lines = ["# Committed results rerun", "",
             f"Every committed run of each folder rerun on the samples of shard `{shard}` of its own samples "
             "(0/1000: its first sample) at today's commit, alone (batch 1), and compared with its committed records "
             "(`scripts/reproduce.py`; how it was run: RUN.md). Identical = tokens, prediction, score, decoding "
             "steps, new tokens, peak tokens and bytes, degenerate flag all equal; the graded score "
             "(`answer_logprob`, stored to 6 decimals) by its largest difference. Per folder: `<folder>.md`; where "
             "tokens differ, the logits at the step where they part: margins.md.", "",
             "| folder | runs | samples rerun | identical | graded score: max abs difference | differing samples |",
             "|---|---|---|---|---|---|"]
    for folder in folders:
        rows = json.loads((out / f"{folder}.json").read_text())
        n, same = sum(r["samples"] for r in rows), sum(r["identical"] for r in rows)
        moved = max((r["graded_moved"] for r in rows), default=0.0)
        diff = "; ".join(f"`{Path(r['run']).name}` {', '.join(map(str, r['differ']))}" for r in rows if r["differ"])
        lines.append(f"| {folder} | {len(rows)} | {n} | {same} | {moved:.1e} | {diff or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="*", help="results/ folders (default: every one with committed runs)")
    p.add_argument("--shard", default="0/1000", help="i/n of each run's own samples (default: its first sample)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "reproduce")
    p.add_argument("--scratch", type=Path, default=RESULTS / "runs" / "reproduce")
    p.add_argument("--reuse", action="store_true",
                   help="keep the reruns of folders whose <folder>.json is already in --out (rerun only the others)")
    a = p.parse_args(argv)
    folders = a.folders or folders_with_runs()
    missing = [f for f in folders if not run_dirs(f)]
    if missing:
        print(f"reproduce: no committed runs in results/{missing[0]}/runs", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    a.scratch.mkdir(parents=True, exist_ok=True)
    todo = [f for f in folders if not (a.reuse and (a.out / f"{f}.json").is_file())]
    with ThreadPoolExecutor(a.workers) as pool:
        took = dict(zip(todo, pool.map(lambda f: rerun(f, a.shard, a.out, a.scratch), todo)))
    for f in todo:
        print(f"reproduce: {f}: {took[f] / 60:.1f} min wall", file=sys.stderr)
    parts = [m for f in folders for m in margins(f, a.out, a.scratch)]
    (a.out / "margins.md").write_text(
        "# Where a rerun's tokens part from the committed ones\n\n"
        + ("\n".join(parts) if parts else "Every rerun sample's tokens equal the committed ones.\n"), encoding="utf-8")
    (a.out / "README.md").write_text(summary(folders, a.out, a.shard), encoding="utf-8")
    print((a.out / "README.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
