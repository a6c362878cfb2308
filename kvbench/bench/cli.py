"""`kvbench-bench`: the command line (see the package docstring and docs/bench.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from kvbench.bench.batch import (BATCH_POLICIES, WORKLOADS, batch_goal_lines, batch_markdown,
                                 run_batch_bench)
from kvbench.bench.goals import goal_lines, goals, goals_markdown, markdown_table
from kvbench.bench.measure import CLOCKS, configurations, run_bench
from kvbench.bench.sweep import DESIGNS, designs_from, run_sweep_bench, sweep_goal_lines, sweep_markdown
from kvbench.bench.against import against
from kvbench.bench.ops import count_ops, ops_markdown
from kvbench.bench.setup import (BASELINES, COMPILED, DEFAULT_POLICIES, FLOOR, FULL, HF, BenchError, all_policies,
                                 base_name, build_model, load_real_model, make_policy, prompt_ids)
from kvbench.models.common import ModelError
from kvbench.run.machine import cpu_info

# --quick runs single-threaded unless told otherwise: on a shared CI machine a second torch thread that is not
# scheduled stalls every parallel operator (see docs/bench.md); one thread takes ~75 CPU-seconds for this run.
QUICK = {"lengths": [512, 1024, 2048], "budgets": [256], "block": 64, "new_tokens": 8, "repeats": 3,
         "policies": ["keydiff"], "threads": 1}


FULL_RUN = {"lengths": [2048, 8192, 32768], "budgets": [1024], "block": 128, "new_tokens": 16, "repeats": 3,
            "policies": list(DEFAULT_POLICIES), "threads": None}


def _int_list(s: str, least: int = 1) -> list[int]:
    try:
        vals = [int(x.lower().replace("k", "")) * (1024 if x.lower().endswith("k") else 1)
                for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (e.g. 2k,8k or 1024), got '{s}'")
    if not vals or min(vals) < least:
        raise argparse.ArgumentTypeError(f"expected integers >= {least}, got '{s}'")
    return vals


def _counts(s: str) -> list[int]:
    """--fork-batch: integers >= 0 (0: all)."""
    return _int_list(s, least=0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvbench-bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"CI-sized run: lengths {QUICK['lengths']}, N={QUICK['budgets'][0]}, B={QUICK['block']}, "
                        f"policies {QUICK['policies']} + baselines, {QUICK['repeats']} rounds, 1 thread")
    p.add_argument("--model", default=None,
                   help="a real model: conf/model preset name (e.g. smollm2-135m) or a local HF directory; its own "
                        "weights, tokenizer and a filler-prose prompt (default: a random-weight --arch/--config)")
    p.add_argument("--arch", default="tiny-llama3", help="built-in tiny architecture (kvbench.models.TINY_ARCHS)")
    p.add_argument("--config", default=None,
                   help="take the architecture from an HF config.json / model directory / hub id / conf/model preset")
    p.add_argument("--layers", type=int, default=None, help="number of layers (default: the architecture's)")
    p.add_argument("--lengths", type=_int_list, default=None, help="prompt lengths, e.g. 2k,8k,32k")
    p.add_argument("--policies", default=None,
                   help=f"comma-separated conf/policy names, or 'all' (default: {','.join(DEFAULT_POLICIES)}); "
                        f"the baselines (--baselines) are added")
    p.add_argument("--baselines", default=None,
                   help=f"baselines added to the policies, comma-separated from {', '.join(BASELINES)}, or none "
                        f"(default: {FULL},{FLOOR}; with --model: {HF},{FLOOR}). {HF} = the hf-forward and hf-decode "
                        f"rows (HF's own loop, side by side)")
    p.add_argument("--full-max-tokens", type=lambda v: _int_list(v)[0], default=None,
                   help="run the full and hf-forward baselines only up to this prompt length (quadratic forwards)")
    p.add_argument("--budgets", type=_int_list, default=None, help="budgets N, e.g. 512,1024")
    p.add_argument("--block", type=int, default=None, help="block size B")
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens decoded per configuration")
    p.add_argument("--repeats", type=int, default=None,
                   help="interleaved rounds; medians are reported (default: the preset's; with --batch: 1)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    p.add_argument("--dtype", default=None,
                   help="float32 (default on CPU; with --model: the preset's) | bfloat16 (default on CUDA) | float16")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's; 1 with --quick)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="what the times measure: wall (default) or the process's CPU time (on a shared machine, with "
                        "--threads 1: robust to other processes' load; with more threads it sums them)")
    p.add_argument("--hf-beside", action="store_true",
                   help="measure HF's decoding (the hf-decode baseline) again right after every kvbench call and test "
                        "the decoding goal against those references, call by call (seconds apart rather than minutes: "
                        "what a slow stretch of a shared machine moves, it moves alike); one more HF call per call")
    p.add_argument("--hf-lockstep", action="store_true",
                   help="like --hf-beside, but HF's decoding runs one step after each of the kvbench call's decoding "
                        "steps (the call's clock paused meanwhile): the two sides a tenth of a second apart, not a "
                        "call apart; the call's peak RSS then includes HF's cache")
    p.add_argument("--no-syncs", dest="syncs", action="store_false",
                   help="skip counting host syncs per decoding step (one extra untimed call per policy and budget)")
    p.add_argument("--batch", type=_int_list, default=None,
                   help="batch sizes, e.g. 1,4,8: samples per hour with K samples per forward (kvbench.bench.batch) "
                        "for the NIAH- and LongBench-shaped workloads, next to HF's batched generate; default "
                        f"policies {','.join(BATCH_POLICIES)}, N = the first --budgets; NAME+compiled in --policies: "
                        "each forward of a batch and its eviction as one compiled graph")
    p.add_argument("--ops", action="store_true",
                   help="count aten operations per prompt block and per decoding step (the eviction included) of "
                        "every policy against HF's own forward of the same block and step (kvbench.bench.ops): the "
                        "CPU proxy for a GPU's kernel launches; no timing. N = the first --budgets, B = --block, a "
                        "prompt of N + 3B tokens")
    p.add_argument("--against", nargs=2, type=Path, default=None, metavar=("OLD", "NEW"),
                   help="compare two kvbench-bench JSON files policy by policy (kvbench.bench.against): prompt and "
                        "decoding times, now against earlier, and the goal lines (neither over 1.10x); runs nothing")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"with --batch: comma-separated from {', '.join(WORKLOADS)}")
    p.add_argument("--samples", type=int, default=None, help="with --batch: samples per workload (default: largest K)")
    p.add_argument("--sweep", default=None,
                   help=f"sweep designs, comma-separated from {', '.join(DESIGNS)}: configurations x samples per hour "
                        "with a sample's runs as the rows of one cache (engine.generate.generate_batch) vs "
                        "run separately, interleaved (kvbench.bench.sweep); --policies, --budgets, --block, "
                        "--lengths (the first) and --new-tokens override the design's, --samples its samples "
                        "(default 2)")
    p.add_argument("--fork-batch", type=_counts, default=None,
                   help="with --sweep: at most how many of a sample's runs go as the rows of one cache, one shared "
                        "way per value, e.g. 1,12 (default 0: all of a policy's budgets; 1: each run's own trunk)")
    p.add_argument("--together", action="store_true",
                   help="with --sweep: the shared ways decode every cache's steps as the rows of one forward "
                        "(share_rows=decode with --fork-batch 1, share_rows=true with 0)")
    p.add_argument("--compiled", action="store_true",
                   help="measure every policy twice: eager (the default) and with each forward and its eviction "
                        "as one compiled graph (row NAME+compiled); NAME+compiled in --policies picks single ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench.json", help="rows and goals as JSON")
    p.add_argument("--markdown", default=None, help="markdown table file (default: --out with .md)")
    p.add_argument("--quiet", action="store_true", help="no per-measurement log lines")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    preset = QUICK if a.quick else FULL_RUN
    lengths = a.lengths or preset["lengths"]
    budgets = a.budgets or preset["budgets"]
    block = a.block if a.block is not None else preset["block"]
    new_tokens = a.new_tokens if a.new_tokens is not None else preset["new_tokens"]
    repeats = a.repeats if a.repeats is not None else preset["repeats"]
    default_policies = BATCH_POLICIES if a.batch else preset["policies"]
    policies = [s.strip() for s in a.policies.split(",") if s.strip()] if a.policies else default_policies
    if block <= 0 or new_tokens < 1 or repeats < 1 or any(x is not None and x < 1 for x in (a.threads, a.layers)):
        p.error("--block, --new-tokens, --repeats, --threads and --layers must be positive")
    for table in a.against or ():
        if not table.is_file():
            p.error(f"--against: no such table: {table}")
    workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    if any(w not in WORKLOADS for w in workloads) or not workloads:
        p.error(f"--workloads takes {', '.join(WORKLOADS)} (comma-separated), got '{a.workloads}'")
    a.workloads = workloads
    if a.sweep is not None:
        a.sweep = [d.strip() for d in a.sweep.split(",") if d.strip()]
        if not a.sweep or any(d not in DESIGNS for d in a.sweep):
            p.error(f"--sweep takes {', '.join(DESIGNS)} (comma-separated)")
        if a.batch:
            p.error("--sweep and --batch are separate measurements; give one")
    if a.fork_batch is not None and (a.sweep is None or any(k < 0 for k in a.fork_batch)):
        p.error("--fork-batch takes integers >= 0 and goes with --sweep")
    if a.together and a.sweep is None:
        p.error("--together goes with --sweep")
    if a.samples is not None and a.samples < 1:
        p.error("--samples must be positive")
    if a.model is not None and a.config is not None:
        p.error("--model (real weights) and --config (random weights) exclude each other")
    if a.baselines is None:
        a.baselines = f"{HF},{FLOOR}" if a.model else f"{FULL},{FLOOR}"
    baselines = [] if a.baselines.strip() == "none" else [s.strip() for s in a.baselines.split(",") if s.strip()]
    if any(b not in BASELINES for b in baselines):
        p.error(f"--baselines takes {', '.join(BASELINES)} (comma-separated) or none, got '{a.baselines}'")
    a.baselines = baselines
    if a.hf_beside and a.hf_lockstep:
        p.error("--hf-beside and --hf-lockstep exclude each other")
    a.hf_reference = "beside" if a.hf_beside else "lockstep" if a.hf_lockstep else None
    if a.hf_reference and (a.batch or a.sweep is not None or HF not in baselines):
        p.error(f"--hf-{a.hf_reference} needs the {HF} baseline (--baselines) and goes without --batch and --sweep")
    a.command = "kvbench-bench " + " ".join(shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    threads = torch.get_num_threads()
    if a.threads or preset["threads"]:
        torch.set_num_threads(a.threads or preset["threads"])
    try:
        return _main(a, lengths, budgets, block, new_tokens, repeats, policies)
    except ModelError as e:  # a device torch does not know or see, a model that cannot load: before anything is written
        print(f"kvbench-bench: error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)  # main() is also called in-process (tests)


def _main(a: argparse.Namespace, lengths: list[int], budgets: list[int], block: int, new_tokens: int, repeats: int,
          policies: list[str]) -> int:
    from kvbench.models.loading import resolve_device
    from kvbench.policies.base import PolicyError

    device = resolve_device(a.device)
    log = None if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    if a.against:
        rows, table, lines = against(*a.against)
        if not rows:
            print("kvbench-bench: error: the two tables share no policy", file=sys.stderr)
            return 2
        return _write_rows(a, rows, lines, table, "kvbench-bench tables", device, log, time.perf_counter(),
                           "policies", "two earlier measurements compared")
    try:
        if a.sweep:
            return _sweep(a, log)
        if policies == ["all"]:
            policies = all_policies()
        if a.compiled:
            policies = [p for name in policies for p in (name, name + COMPILED)]
        for name in policies:  # fail on bad names and budgets before anything is built
            for b in budgets:
                make_policy(name, b, a.seed)
        model, tokenizer, desc = _model(a, device)
        prompt = prompt_ids(max(lengths + budgets), 0, tokenizer, a.seed) if tokenizer is not None else None
        if log:
            log(f"kvbench-bench: {desc} on {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
        t0 = time.perf_counter()
        if a.ops:
            return _ops(a, model, policies, budgets[0], block, desc, device, log, t0)
        if a.batch:
            rows = run_batch_bench(model, tokenizer, policies, a.batch, a.workloads, budgets[0], block, a.samples,
                                   HF in a.baselines, a.seed, CLOCKS[a.clock], log, rounds=a.repeats or 1,
                                   on_round=lambda done: _write_batch(a, done, desc, device, None, t0, partial=True))
            return _write_batch(a, rows, desc, device, log, t0)

        def write(rows: list[dict], done: int) -> None:  # after every round: a bench cut short keeps what it measured
            results = goals(rows)
            _write(a, {"rows": rows, "goals": results}, markdown_table(rows), goal_lines(results), desc, device,
                   (f"medians of {repeats} interleaved rounds" if done == repeats else
                    f"medians of the first {done} of {repeats} interleaved rounds (the rest not measured)")
                   + f", {new_tokens} new tokens"
                   + {None: "", "beside": ", HF's decoding measured again beside every kvbench call",
                      "lockstep": ", HF's decoding in lockstep with every kvbench call (a step after each of its "
                                  "steps; its peak RSS includes HF's cache)"}[a.hf_reference], show=done == repeats)

        rows = run_bench(model, configurations(policies, budgets, lengths, block, a.baselines, a.full_max_tokens),
                         new_tokens, repeats, a.seed, desc, log, prompt, a.clock, a.syncs, a.hf_reference, write)
    except (BenchError, PolicyError) as e:
        print(f"kvbench-bench: error: {e}", file=sys.stderr)
        return 2
    write(rows, repeats)
    if log:
        log(f"kvbench-bench: {len(rows)} configurations in {time.perf_counter() - t0:.0f} s -> {a.out}")
    return 0


def _model(a: argparse.Namespace, device: torch.device) -> tuple[Any, Any, str]:
    """(model, tokenizer or None, description): --model's real weights, else a random-weight --arch/--config model
    (bfloat16 on CUDA, float32 elsewhere, unless --dtype)."""
    if a.model is not None:
        return load_real_model(a.model, a.dtype, str(device))
    dtype = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model, desc = build_model(a.arch, a.config, a.layers, dtype, str(device), a.seed)
    return model, None, desc


def _sweep(a: argparse.Namespace, log) -> int:
    """--sweep: the designs both ways on the model asked for; bench.json (rows and goal lines) and the table."""
    from kvbench.models.loading import resolve_device

    device = resolve_device(a.device)
    policies = [s.strip() for s in a.policies.split(",") if s.strip()] if a.policies else None
    designs = designs_from(a.sweep, policies, a.budgets, a.block, a.lengths[0] if a.lengths else None,
                           a.new_tokens)
    for d in designs:  # bad names and budgets fail before anything is built
        for name in d.policies:
            for b in d.budgets:
                make_policy(name, b, a.seed)
    model, tokenizer, desc = _model(a, device)
    if log:
        log(f"kvbench-bench --sweep: {desc} on {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    t0 = time.perf_counter()
    about = "shared and separate interleaved sample by sample; every configuration decodes exactly its new tokens"
    rows = run_sweep_bench(model, tokenizer, designs, a.samples or 2, a.seed, CLOCKS[a.clock], log,
                           fork_batches=a.fork_batch or (0,), together=a.together, on_sample=lambda done: _write_rows(
                               a, done, sweep_goal_lines(done), sweep_markdown(done), desc, device, None, t0, "sweep",
                               about + f" (the samples so far, of {a.samples or 2}; the rest not measured)",
                               show=False))
    return _write_rows(a, rows, sweep_goal_lines(rows), sweep_markdown(rows), desc, device, log, t0, "sweep", about)


def _write_batch(a: argparse.Namespace, rows: list[dict], desc: str, device: torch.device, log, t0: float,
                 partial: bool = False) -> int:
    """--batch: bench.json (rows and goal lines) and the markdown table; `partial`: the rounds so far, unprinted."""
    rounds = max((r["rounds"] for r in rows), default=1)  # as the rows were measured (run_batch_bench)
    return _write_rows(a, rows, batch_goal_lines(rows), batch_markdown(rows), desc, device, log, t0, "batch",
                       ("one round" if rounds == 1 else f"medians of {rounds} interleaved rounds") +
                       (f" so far (of {a.repeats or 1}, and the workloads measured so far; the rest not measured)"
                        if partial else "") + "; samples decode exactly their new tokens", show=not partial)


def _ops(a: argparse.Namespace, model: Any, policies: list[str], budget: int, block: int, desc: str,
         device: torch.device, log, t0: float) -> int:
    """--ops: aten operations per block and step of each policy against HF's own (kvbench.bench.ops), and the goal
    lines: at most 1.25x HF's for every policy, 1.10x for the ones that score from keys or positions alone; a decoding
    step's kvbench functions and files."""
    length = budget + 3 * block
    ids = prompt_ids(length, model.config.get_text_config(decoder=True).vocab_size, None, a.seed)
    names = [p for p in dict.fromkeys(policies + [FLOOR]) if p not in (FULL, HF) and base_name(p) == p]
    rows = count_ops(model, lambda name: make_policy(name, budget, a.seed), names, budget, block, length, ids)
    lines = []
    for r in rows:
        limit = OPS_KEYS_ONLY if r["policy"] in OPS_KEYS_ONLY_POLICIES else OPS_ANY
        worst = max(r["block_ratio"], r["step_ratio"])
        lines.append(f"{r['policy']}: aten ops {worst:.2f}x HF's forward (block {r['block_ratio']:.2f}x, step "
                     f"{r['step_ratio']:.2f}x): {'PASS' if worst <= limit else 'MISS'} against <= {limit}x")
        files = len(r["step_files"])
        ok = r["step_functions"] <= READ_FUNCTIONS and files <= READ_FILES
        lines.append(f"{r['policy']}: a decoding step calls {r['step_functions']} kvbench functions in {files} files "
                     f"({', '.join(r['step_files'])}): {'PASS' if ok else 'MISS'} against <= {READ_FUNCTIONS} in "
                     f"<= {READ_FILES}")
    table = ops_markdown(rows, f"N = {budget}, B = {block}, a {length}-token prompt")
    return _write_rows(a, rows, lines, table, desc, device, log, t0, "ops", "aten operations counted eagerly")


# --ops goals (issue 62): every policy within 1.25x HF's aten operations per forward, those scoring from keys or
# positions alone within 1.10x
OPS_ANY, OPS_KEYS_ONLY = 1.25, 1.10
OPS_KEYS_ONLY_POLICIES = ("streamingllm", "random", "knorm", "keydiff")
READ_FUNCTIONS, READ_FILES = 25, 4  # a decoding step reads in at most 25 kvbench functions in at most 4 files


def _write_rows(a: argparse.Namespace, rows: list[dict], lines: list[str], table: str, desc: str,
                device: torch.device, log, t0: float, kind: str, about: str, show: bool = True) -> int:
    """--batch / --sweep output: bench.json (rows and goal lines), the table, and the closing log line."""
    _write(a, {"rows": rows, "goals": lines}, table, lines, desc, device, about, show)
    if log:
        log(f"kvbench-bench: {len(rows)} {kind} rows in {time.perf_counter() - t0:.0f} s -> {a.out}")
    return 0


def _write(a: argparse.Namespace, payload: dict, table: str, lines: list[str], desc: str, device: torch.device,
           about: str, show: bool = True) -> None:
    """--out (JSON) and the markdown file (--markdown, default --out with .md): where it ran, the command, the table
    and the goal lines; with `show` the table and the lines are printed too. Each file is written whole or not at
    all (a temporary file renamed over it), as a bench may be stopped while it writes."""
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = Path(a.markdown) if a.markdown else out.with_suffix(".md")
    cpu = cpu_info()
    for path, text in ((out, json.dumps(payload, indent=1) + "\n"),
                       (md, f"{desc} on {device} ({cpu['model']}, {cpu['isa']}, torch {torch.__version__}, "
                            f"{torch.get_num_threads()} threads); {a.clock} clock, {about}.\n\nCommand: "
                            f"`{a.command}`\n\n{table}\n" + goals_markdown(lines))):
        part = path.with_name(path.name + ".part")
        part.write_text(text, encoding="utf-8")
        os.replace(part, path)
    if show:
        print(table)
        for ln in lines:
            print(ln)


if __name__ == "__main__":
    sys.exit(main())
