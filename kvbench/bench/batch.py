"""`kvbench-bench --batch 1,4,8`: samples per CPU-hour (per hour on a GPU) when K samples go through the model
together, each with its own policy-managed cache (`engine.generate.generate_batch`), next to HF's own batched
`generate` (full cache, no eviction) on the same model and prompts.

Two workloads, shaped like the benchmarks' samples: `niah` (2k-token prompts, 32 new tokens) and `longbench`
(4k-token prompts, 256 new tokens). A workload's S samples (S = the largest K unless --samples) have distinct
prompts of slightly different lengths (L, L - 13, L - 26, ...: as a task's samples differ, so their last prompt
blocks differ and go through the model alone), and every sample decodes exactly its new tokens (no stop token), so
every batch size does the same work. Each (workload, policy, K) runs the S samples in batches of K; the number is
S / time x 3600 with the chosen clock (cpu: the process's CPU time, robust to other processes' load on one thread).
For K > 1 the row also counts the samples whose tokens equal the K = 1 run's (`same_as_batch1`): a batched decoding
step multiplies K rows by the weights where batch 1 multiplies one, which the CPU's BLAS rounds differently, so a
near-tie between two logits (or two eviction scores) can go the other way; the first differing sample is shown.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

from kvbench.bench.goals import family_line
from kvbench.bench.setup import HF, make_policy, prompt_ids, variant
from kvbench.bench.hfloop import kv_bytes
from kvbench.engine.generate import GenerationSettings, Job, Observer, generate_batch, sync
from kvbench.metrics.stats import ratio_test

WORKLOADS: dict[str, tuple[int, int]] = {"niah": (2048, 32), "longbench": (4096, 256)}  # prompt tokens, new tokens
LENGTH_STEP = 13  # sample j's prompt is j x 13 tokens shorter: distinct tails, as a task's samples have
BATCH_POLICIES = ["keydiff", "snapkv", "streamingllm"]
GOALS = {"longbench": 1.6, "niah": 1.35}  # batch 8 vs batch 1, samples per hour (docs/bench.md)
GOAL_BATCH = 8


def batch_prompts(model: Any, tokenizer: Any, length: int, count: int, seed: int) -> list[list[int]]:
    """`count` distinct prompts of lengths length, length - 13, ... (filler prose of seed + j, or random ids)."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    return [prompt_ids(length - LENGTH_STEP * j, vocab, tokenizer, seed + j) for j in range(count)]


def _kvbench(model: Any, name: str, budget: int, block: int, prompts: list[list[int]], new_tokens: int, k: int,
             clock: Callable[[], float], seed: int) -> dict[str, Any]:
    """The prompts in batches of k through kvbench; time, tokens and the batches' peak K+V."""
    jobs = []
    engine = variant(name)[1]  # NAME+compiled: each forward and its eviction as one compiled graph
    for ids in prompts:
        policy = make_policy(name, budget, seed)
        policy.start_sample(seed)
        jobs.append(Job(ids, policy, GenerationSettings(block=block, max_new_tokens=new_tokens, **engine),
                        observer=Observer(clock=clock)))
    sync(model.device)
    t0 = clock()
    results = [r for i in range(0, len(jobs), k) for r in generate_batch(model, jobs[i:i + k])]
    sync(model.device)
    seconds = clock() - t0
    return {"seconds": seconds, "tokens": [r.tokens for r in results],
            "prefill_s": sum(r.prefill_s for r in results), "decode_s": sum(r.decode_s for r in results),
            "evict_s": sum(r.evict_s for r in results), "evict_decode_s": sum(r.evict_decode_s for r in results),
            "kv_bytes_peak": max(r.batch_kv_bytes_peak for r in results)}


@torch.inference_mode()
def _hf(model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int, k: int,
        clock: Callable[[], float]) -> dict[str, Any]:
    """HF's own batched `generate` (greedy, full cache, exactly new_tokens each), prompts left-padded per batch."""
    device = model.device
    pad = (getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None)
    if pad is None:
        pad = model.generation_config.eos_token_id
        pad = pad[0] if isinstance(pad, list) else (pad if pad is not None else 0)
    tokens: list[list[int]] = []
    kv = 0
    sync(device)
    t0 = clock()
    for i in range(0, len(prompts), k):
        group = prompts[i:i + k]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=device)  # (k, width) left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                             return_dict_in_generate=True)
        tokens += out.sequences[:, width:].tolist()
        kv = max(kv, kv_bytes(out.past_key_values))
    sync(device)
    return {"seconds": clock() - t0, "tokens": tokens, "prefill_s": None, "decode_s": None, "evict_s": None,
            "evict_decode_s": None, "kv_bytes_peak": kv}


def run_batch_bench(model: Any, tokenizer: Any, policies: Sequence[str], batches: Sequence[int],
                    workloads: Sequence[str], budget: int, block: int, samples: int | None, hf: bool, seed: int,
                    clock: Callable[[], float], log: Callable[[str], None] | None = None,
                    rounds: int = 1, on_round: Callable[[list[dict[str, Any]]], None] | None = None
                    ) -> list[dict[str, Any]]:
    """One row per (workload, policy or hf, K), K = 1 first in each (workload, policy): every later row is compared
    with it (speed-up, identical tokens). With `rounds` > 1 every (policy, K) of a workload runs once per round, the
    rounds interleaved (round r starts r places further along the list, as kvbench.bench.measure does), and a row
    gives the medians over the rounds; its speed-up is the median of the per-round ratios (K = 1 and K of the same
    round: a slow stretch of the machine weighs on both), with every round's ratio beside it. `on_round` is called
    after every round but the last with the rows measured so far (a bench stopped early leaves them)."""
    rows: list[dict[str, Any]] = []
    batches = sorted(set(batches) | {1})
    count = samples or max(batches)
    for workload in workloads:
        length, new_tokens = WORKLOADS[workload]
        prompts = batch_prompts(model, tokenizer, length, count, seed)
        cells = [(name, k) for name in [*policies, *([HF] if hf else [])] for k in batches]
        runs: dict[tuple[str, int], list[dict[str, Any]]] = {cell: [] for cell in cells}

        def measured() -> list[dict[str, Any]]:  # the workload's rows from its rounds so far
            return [_row(workload, name, k, runs[(name, k)], runs[(name, 1)], prompts, new_tokens, budget, block)
                    for name, k in cells]

        for r in range(rounds):
            for name, k in cells[r % len(cells):] + cells[:r % len(cells)]:
                t0 = time.perf_counter()
                m = (_hf(model, tokenizer, prompts, new_tokens, k, clock) if name == HF else
                     _kvbench(model, name, budget, block, prompts, new_tokens, k, clock, seed))
                m["wall_s"] = time.perf_counter() - t0
                runs[(name, k)].append(m)
                if log and rounds > 1:
                    log(f"  round {r + 1}/{rounds} {workload:9s} {name:13s} K={k}: {m['seconds']:.1f} s")
            if on_round is not None and (r + 1 < rounds or workload != workloads[-1]):
                on_round(rows + measured())
        for (name, k), row in zip(cells, measured()):
            rows.append(row)
            if log:
                log(f"  {workload:9s} {name:13s} K={k}: {row['seconds']:.1f} s, {row['samples_per_hour']:.0f} "
                    f"samples/h ({row['vs_batch1']:.2f}x batch 1), same tokens as batch 1: "
                    f"{row['same_as_batch1']}/{count}")
    return rows


def _median(values: Sequence[float | None]) -> float | None:
    return None if values[0] is None else statistics.median(values)


def _row(workload: str, name: str, k: int, runs: list[dict[str, Any]], first: list[dict[str, Any]],
         prompts: list[list[int]], new_tokens: int, budget: int, block: int) -> dict[str, Any]:
    """One (workload, policy, K) row from its rounds' measurements `runs` and the K = 1 rounds `first`: medians over
    the rounds, the tokens of the first round (each later round's tokens must equal them: `repeatable`)."""
    count = len(prompts)
    same = [a == b for a, b in zip(runs[0]["tokens"], first[0]["tokens"])]
    diverged = next((j for j, s in enumerate(same) if not s), None)
    seconds = statistics.median(m["seconds"] for m in runs)
    ratios = [f["seconds"] / m["seconds"] for f, m in zip(first, runs)]  # the same round's K = 1 over K
    rnd = (lambda v: None if v is None else round(v, 3))
    return {
        "workload": workload, "policy": name, "batch": k, "samples": count,
        "prompt_tokens": [len(p) for p in prompts], "new_tokens": new_tokens,
        "budget": None if name == HF else budget, "block": None if name == HF else block,
        "rounds": len(runs), "seconds": round(seconds, 3),
        "samples_per_hour": round(count / seconds * 3600, 1),
        "vs_batch1": round(statistics.median(ratios), 3),
        "round_seconds": [round(m["seconds"], 3) for m in runs],
        "round_vs_batch1": [round(x, 3) for x in ratios],
        **{key: rnd(_median([m[key] for m in runs])) for key in ("prefill_s", "decode_s", "evict_s", "evict_decode_s")},
        "kv_bytes_peak": max(m["kv_bytes_peak"] for m in runs),
        "same_as_batch1": sum(same),
        "first_difference": None if diverged is None else {
            "sample": diverged, "token": _first_diff(runs[0]["tokens"][diverged], first[0]["tokens"][diverged])},
        "repeatable": all(m["tokens"] == runs[0]["tokens"] for m in runs),
        "wall_s": round(sum(m["wall_s"] for m in runs), 3),
    }


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def batch_goal_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Pass/fail lines: the largest K vs K = 1 per (workload, policy) against GOALS, and identical tokens; with two or
    more goals judged over rounds, a HOLM line after them (the goals as one family, `family_line`)."""
    lines = []
    family: list[tuple[str, bool | None, float]] = []
    for (workload, name), group in _groups(rows).items():
        top = max(group, key=lambda r: r["batch"])
        if top["batch"] == 1:
            continue
        goal = GOALS.get(workload) if top["batch"] >= GOAL_BATCH and name != HF else None
        each = top.get("round_vs_batch1") or [top["vs_batch1"]]
        verdict, passed, p = ("", None, None) if goal is None else goal_verdict(each, goal)
        spread = f" (median of {len(each)} rounds: {', '.join(f'{x:.2f}' for x in each)})" if len(each) > 1 else ""
        same = ", ".join(f"K={r['batch']} {r['same_as_batch1']}/{r['samples']}" for r in group if r["batch"] > 1)
        lines.append(f"{workload}: {name} batch {top['batch']} vs 1: {top['vs_batch1']:.2f}x samples per hour"
                     f"{spread}{' ' if verdict else ''}{verdict}{_ceiling(group, top)}; tokens identical to batch 1: "
                     f"{same}")
        if p is not None:
            family.append((f"{workload} {name}", passed, p))
    held = family_line(family, "batch goals", ("PASS", "MISS"))
    return lines if held is None else [*lines, held]


def _ceiling(group: list[dict[str, Any]], top: dict[str, Any]) -> str:
    """What batching could give at most with the prompts as they batch: K = 1's time over the largest K's prompt
    time alone (medians), as if its decoding cost nothing. Said beside the verdict, so a workload whose prompts do
    not batch shows why no decoding speed-up can meet its goal; empty without the times."""
    one = next((r for r in group if r["batch"] == 1), None)
    if one is None or not top.get("prefill_s"):
        return ""
    most = one["seconds"] / top["prefill_s"]
    return (f"; with its decoding free, batch {top['batch']} would reach at most {most:.2f}x (its prompts "
            f"{top['prefill_s']:.1f} s against batch 1's {one['seconds']:.1f} s in all)")


def goal_verdict(ratios: Sequence[float], goal: float, unit: str = "round"
                 ) -> tuple[str, bool | None, float | None]:
    """The goal judged on paired ratios (each round's, or sample's: `unit`; the baseline's time over the measured
    way's) at 95 %, on their logs (`kvbench.metrics.stats.ratio_test`): PASS when the one-sided lower t bound of their
    geometric mean meets it, MISS when the upper bound is under it, NOT RESOLVED otherwise (every ratio over the line
    is not enough at n = 3 when they spread). One ratio has no interval: it is said against the goal, marked as one.
    Returns (the words, the verdict: PASS True / MISS False / None, its one-sided p value in that direction for a
    family of goals, the smaller of the two when not resolved; None with one round)."""
    test = ratio_test(ratios, goal)
    if test is None:
        ok = ratios[0] >= goal
        return f"{'PASS' if ok else 'MISS'} (goal >= {goal}x; one {unit}: no interval)", ok, None
    passed, p = ((True, test.p_over) if test.lower >= goal else (False, test.p_under) if test.upper < goal
                 else (None, min(test.p_under, test.p_over)))
    label = {True: "PASS", False: "MISS", None: "NOT RESOLVED"}[passed]
    return (f"{label} at 95 % (goal >= {goal}x; {len(ratios)} {unit}s, geometric mean {test.mean:.2f}x, one-sided t "
            f"bounds {test.lower:.2f}x and {test.upper:.2f}x)"), passed, p


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["workload"], r["policy"]), []).append(r)
    return out


def batch_markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (times in the run's clock)."""
    head = ("| workload | prompt / new tokens | policy | N | K | samples | time (s) | samples / h | vs K=1 | "
            "prefill (s) | decode (s) | evict (s) | of it decoding (s) | K+V peak (MiB) | same tokens as K=1 |")
    rounds = max(r.get("rounds", 1) for r in rows) if rows else 1
    if rounds > 1:  # each round's time and its ratio to the same round's K = 1
        head += " time by round (s) | vs K=1 by round |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lengths = r["prompt_tokens"]
        span = f"{min(lengths)}-{max(lengths)} / {r['new_tokens']}"
        fmt = (lambda v: "-" if v is None else f"{v:.1f}")
        same = f"{r['same_as_batch1']}/{r['samples']}" if r["batch"] > 1 else "-"
        out.append(f"| {r['workload']} | {span} | {r['policy']} | {r['budget'] or '-'} | {r['batch']} | "
                   f"{r['samples']} | {r['seconds']:.1f} | {r['samples_per_hour']:.0f} | {r['vs_batch1']:.2f} | "
                   f"{fmt(r['prefill_s'])} | {fmt(r['decode_s'])} | {fmt(r['evict_s'])} | "
                   f"{'-' if r.get('evict_decode_s') is None else format(r['evict_decode_s'], '.2f')} | "
                   f"{r['kv_bytes_peak'] / 2 ** 20:.0f} | {same} |" +
                   (f" {', '.join(f'{x:.1f}' for x in r['round_seconds'])} | "
                    f"{', '.join(f'{x:.2f}' for x in r['round_vs_batch1'])} |" if rounds > 1 else ""))
    return "\n".join(out)

