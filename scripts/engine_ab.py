"""Issue 62's CPU goal as a paired A/B: every policy's 4k prompt time and decoding time per token, an earlier commit's
engine against this one's, measured at the same moment.

Across runs on a shared VM the machine's speed moves by about 10 % (results/bench_smollm2/RUN.md), as much as the goal's
margin, so two tables made on different days cannot tell a 10 % change. Here both engines run from frozen worktrees
(`git worktree`, each with the `kvbench/conf` link) as a pair of processes, one right after the other, one thread, alone
on the machine as the goal's tables were made. Each process is one `kvbench-bench` call of one policy (SmolLM2-135M, the
4096-token filler prompt, N = 1024, B = 128, 32 new tokens or `--new-tokens`, CPU clock, one measured call after its
warm-up, no HF baseline); pairs run policy after policy, the policy order rotated each round, the side that runs first
alternating. A policy's ratio per round is its time now over its time then in the same pair; a goal line (a policy's
prompt or decoding) is a one-sided t-test of the rounds' log ratios against log 1.10 (the goal), on the side its mean
falls, Holm-adjusted over all lines: PASS (under the line) or MISS (over it) where the adjusted p < 0.05, else not
resolved. The goal as a whole ("no line above 1.10x") is an intersection-union test: met when every line's own test puts
it under the line at 0.05 (no adjustment: the claim needs all of them), not met when a line MISSes.

`--together` starts a pair's two calls at once, one on each of two cores, instead of one after the other: half the
wall time, and both sides see the same moment of the machine (each beside the other). Its decoding line is biased when
the prompts' times differ: the side whose prompt ends sooner decodes beside the other's prompt, the other side partly
alone (results/bench_smollm2/RUN.md measures it); its prompt line is not. `--new-tokens` decodes more tokens per call
than the goal's 32, for a decoding time per token that one call measures with less spread.

    python scripts/engine_ab.py REF [--rounds 3] [--policies all] [--new-tokens 32] [--together]
        [--out results/bench_smollm2/engine_ab_REF.json]

Needs the model in the local cache (`kvbench-bench --model smollm2-135m` fetches it). Writes OUT (raw values) and
OUT with .md (the table and the verdicts); the worktrees and per-call files go to a scratch folder under
results/runs/ (git-ignored), removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvbench.metrics.stats import ALPHA, holm, ratio_test

ROOT = Path(__file__).resolve().parents[1]
GOAL = 1.10
BENCH = ["--model", "smollm2-135m", "--lengths", "4096", "--budgets", "1024", "--block", "128", "--repeats", "1",
         "--threads", "1", "--clock", "cpu", "--baselines", "none", "--no-syncs", "--quiet"]
MEASURES = (("prefill_s", "prompt s"), ("decode_ms_per_token", "decoding ms/token"))


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def worktree(rev: str, path: Path) -> str:
    """A frozen checkout of `rev` at `path` with its configuration linked into the package; returns its commit."""
    git("worktree", "add", "--detach", "-f", str(path), rev)
    (path / "kvbench" / "conf").symlink_to(Path("..") / "conf")
    return git("-C", str(path), "rev-parse", "--short", "HEAD")


def start(tree: Path, policy: str, new_tokens: int, out: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
    return subprocess.Popen([sys.executable, "-m", "kvbench.bench", *BENCH, "--new-tokens", str(new_tokens),
                             "--policies", policy, "--out", str(out)],
                            cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def measured(path: Path) -> dict[str, float]:
    data = json.loads(path.read_text())
    rows = data["rows"] if isinstance(data, dict) else data
    row = next(r for r in rows if isinstance(r, dict) and r.get("budget") == 1024)
    return {key: float(row[key]) for key, _ in MEASURES}


def lines(result: dict) -> list[dict]:
    """One goal line per policy and measure: the rounds' ratios, their geometric mean, its one-sided 95 % bounds,
    the claim's side and its Holm-adjusted p (over every line), the verdict."""
    out = []
    for name, p in result["policies"].items():
        for key, label in MEASURES:
            ratios = [c / t for t, c in zip(p["ref"][key], p["now"][key])]
            test = ratio_test(ratios, GOAL)
            under = test is not None and test.p_under <= test.p_over
            out.append({"policy": name, "measure": key, "label": label, "ratios": ratios,
                        "mean": statistics.geometric_mean(ratios),
                        "bounds": None if test is None else [test.lower, test.upper],
                        "side": "under" if under else "over",
                        "p": None if test is None else min(test.p_under, test.p_over)})
    tested = [line for line in out if line["p"] is not None]
    for line, adj in zip(tested, holm([line["p"] for line in tested])):
        line["p_holm"] = adj
        line["verdict"] = ("not resolved" if adj >= ALPHA else "PASS" if line["side"] == "under" else "MISS")
    for line in out:
        line.setdefault("verdict", "not resolved")
    return out


def overall(lines_: list[dict]) -> str:
    """The goal as a whole, "every line at most 1.10x": met when every line's own one-sided test puts it under the
    line (p < 0.05 each, the intersection-union test: a claim about all lines at once needs no adjustment), not met
    when a line MISSes after Holm, else not resolved."""
    if any(line["verdict"] == "MISS" for line in lines_):
        return "not met"
    if all(line["p"] is not None and line["side"] == "under" and line["p"] < ALPHA for line in lines_):
        return "met"
    return "not resolved"


def markdown(result: dict) -> str:
    ref, now = result["ref"], result["now"]
    new_tokens = result.get("new_tokens", 32)
    flags = [f" --policies {result['policies_arg']}" if result.get("policies_arg", "all") != "all" else "",
             f" --new-tokens {new_tokens}" if new_tokens != 32 else "", " --together" if result.get("together") else ""]
    chosen = "".join(flags)
    when = ("each round's two calls started together, one on each of the two cores" if result.get("together") else
            "each round's two calls one right after the other, alone on the machine")
    head = [f"Paired A/B of issue 62's CPU goal: kvbench `{now}` against `{ref}`, {result['rounds']} rounds "
            f"(`python scripts/engine_ab.py {result['ref_arg']} --rounds {result['rounds']}{chosen}`). SmolLM2-135M, "
            f"float32, CPU, one thread; 4096-token prompt, N = 1024, B = 128, {new_tokens} new tokens; CPU clock; "
            f"{when}. Times: medians over rounds; ratio = "
            "now / then within a round, their geometric mean and its one-sided 95 % bounds (unadjusted); a line "
            f"PASSes (MISSes) when the one-sided t-test that its mean is under (over) {GOAL:.2f}x has p < 0.05 "
            f"after Holm over all {2 * len(result['policies'])} lines.", "",
            "| policy | measure | then | now | ratios by round | mean ratio | 95 % bounds | Holm p | verdict |",
            "|---|---|---|---|---|---|---|---|---|"]
    rows, goals = [], []
    judged = lines(result)
    for line in judged:
        p = result["policies"][line["policy"]]
        fmt = "{:.2f}" if line["measure"] == "prefill_s" else "{:.1f}"
        then, cur = (fmt.format(statistics.median(p[s][line["measure"]])) for s in ("ref", "now"))
        bounds = "" if line["bounds"] is None else f"{line['bounds'][0]:.2f}-{line['bounds'][1]:.2f}"
        p_holm = f"{line['p_holm']:.3f}" if "p_holm" in line else ""
        rows.append(f"| {line['policy']} | {line['label']} | {then} | {cur} | "
                    f"{', '.join(f'{r:.2f}' for r in line['ratios'])} | {line['mean']:.2f} | {bounds} | {p_holm} | "
                    f"{line['verdict']} |")
        goals.append(f"- {line['policy']}: {line['label']} {line['mean']:.2f}x `{ref}`'s: {line['verdict']} against "
                     f"<= {GOAL:.2f}x")
    whole = (f"- the goal as a whole (every line <= {GOAL:.2f}x; intersection-union test, each line's own one-sided p "
             f"< 0.05): {overall(judged)}")
    return "\n".join(head + rows + ["", "## Goals", ""] + goals + [whole]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ref", help="the earlier commit (the goal's 'today')")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", default="all", help="comma-separated, or all (every policy both commits have)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per call (the goal's: 32)")
    ap.add_argument("--together", action="store_true", help="a pair's two calls at once, one per core")
    ap.add_argument("--out", default=None, help="JSON (default results/bench_smollm2/engine_ab_REF.json)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.new_tokens < 1:
        print("engine_ab: --rounds and --new-tokens must be at least 1", file=sys.stderr)
        return 2
    try:
        ref_commit = git("rev-parse", "--short", args.ref)
    except subprocess.CalledProcessError:
        print(f"engine_ab: unknown revision {args.ref}", file=sys.stderr)
        return 2
    out = Path(args.out or ROOT / "results" / "bench_smollm2" / f"engine_ab_{ref_commit}.json")
    scratch = ROOT / "results" / "runs" / f"engine_ab_{ref_commit}_{os.getpid()}"
    scratch.mkdir(parents=True)
    trees = {"ref": scratch / "ref", "now": scratch / "now"}
    try:
        commits = {side: worktree(rev, trees[side]) for side, rev in (("ref", ref_commit), ("now", "HEAD"))}
        both = [sorted(p.stem for p in (trees[s] / "conf" / "policy").glob("*.yaml")) for s in ("ref", "now")]
        known = [n for n in both[1] if n in both[0] and n != "full"]
        names = known if args.policies == "all" else args.policies.split(",")
        if any(n not in known for n in names):
            print(f"engine_ab: policies not in both commits: {', '.join(n for n in names if n not in known)}",
                  file=sys.stderr)
            return 2
        values = {n: {"ref": {k: [] for k, _ in MEASURES}, "now": {k: [] for k, _ in MEASURES}} for n in names}
        t0 = time.time()
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for i, name in enumerate(order):
                sides = ("ref", "now") if (r + i) % 2 == 0 else ("now", "ref")
                # one after the other (alone on the machine), or both at once (`--together`)
                for group in ([sides] if args.together else [[s] for s in sides]):
                    procs = {s: start(trees[s], name, args.new_tokens, scratch / f"{s}_{name}_{r}.json") for s in group}
                    for s, proc in procs.items():
                        _, err = proc.communicate()
                        if proc.returncode != 0:
                            raise RuntimeError(f"{s} {name} round {r}: exit {proc.returncode}: {err.strip()[-500:]}")
                for s in sides:
                    for key, v in measured(scratch / f"{s}_{name}_{r}.json").items():
                        values[name][s][key].append(v)
                print(f"round {r + 1}/{args.rounds} {name}: " + ", ".join(
                    f"{s} {values[name][s]['prefill_s'][-1]:.2f} s" for s in ("ref", "now")), flush=True)
        result = {"ref": commits["ref"], "now": commits["now"], "ref_arg": args.ref, "rounds": args.rounds,
                  "policies_arg": args.policies, "new_tokens": args.new_tokens, "together": args.together,
                  "bench_args": BENCH, "wall_s": round(time.time() - t0, 1), "policies": values}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(result))
        print(out.with_suffix(".md").read_text())
    finally:
        for tree in trees.values():
            if tree.exists():
                git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
