"""`kvbench-bench --sweep niah_grid,prefill_once`: configurations x samples per CPU-hour of a sweep's design run
shared (`engine.generate.generate_batch`, one call per sample for every configuration: the caches start from one
shared trunk of prompt forwards, and those whose policies select alike are the rows of one cache, sharing each later
forward and eviction) and run separately (`engine.generate.generate` per configuration and sample), in one
interleaved run.

A design is a set of configurations (policies x budgets under one protocol and block) over S samples (distinct
prompts of one length, as a task's samples). Per sample the ways run back to back, the order rotating from sample to
sample (machine drift hits all alike), each timed with the chosen clock (cpu: the process's CPU time, robust to other
processes on one thread). Every configuration decodes exactly its new tokens (no stop token). The number is
configurations x samples / seconds x 3600; `identical` counts the (configuration, sample) pairs whose greedy tokens
are equal shared and separate. `--fork-batch 1,12` measures the shared way once per K: at most K rows a cache (0: all
of a policy's budgets; a cache's trunk ends at its first row's first eviction that may drop a token, so with K = 1
each run's trunk is its own longest); a token may differ where a product over more rows or slots rounds a near-tie
the other way.

The designs (issue 28): `niah_grid`, scripts/niah_grid.sh's policies without the h2o_original variant (12) at
N = 512, 1024, blockwise B = 128, 2000-token prompts, 32 new tokens; `six_policies`, the same with the policies of a
typical comparison (StreamingLLM, K-norm, KeyDiff, TOVA, H2O, SnapKV); `prefill_once`, 10 policies at N = 512 under
prefill_once. The goals (>= 1.6x, >= 1.4x and >= 3.5x) are SmolLM2's on a CPU clock (docs/bench.md, "Goals")."""

from __future__ import annotations

import resource
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from kvbench.bench.batch import goal_verdict
from kvbench.bench.goals import family_line
from kvbench.bench.setup import make_policy, prompt_ids
from kvbench.engine.generate import GenerationSettings, Job, Observer, generate, generate_batch, sync


@dataclass(frozen=True)
class Design:
    """One sweep design: every (policy, budget) under one protocol and block, on prompts of `length` tokens."""

    name: str
    policies: tuple[str, ...]
    budgets: tuple[int, ...]
    protocol: str
    block: int | None
    length: int
    new_tokens: int
    goal: float  # shared vs separate, configurations x samples per CPU-hour (SmolLM2, the design as given here)


DESIGNS: dict[str, Design] = {
    "niah_grid": Design("niah_grid", ("streamingllm", "random", "knorm", "keydiff", "tova", "h2o", "snapkv",
                                      "pyramidkv", "adakv", "criticalkv", "hashevict", "sagekv"),
                        (512, 1024), "blockwise", 128, 2000, 32, 1.6),
    "six_policies": Design("six_policies", ("streamingllm", "knorm", "keydiff", "tova", "h2o", "snapkv"), (512, 1024),
                           "blockwise", 128, 2000, 32, 1.4),
    "prefill_once": Design("prefill_once", ("streamingllm", "random", "knorm", "keydiff", "tova", "snapkv",
                                            "pyramidkv", "adakv", "criticalkv", "sagekv"),
                           (512,), "prefill_once", None, 2000, 32, 3.5),
}


def _jobs(design: Design, ids: list[int], clock: Callable[[], float], seed: int, sample: int) -> list[Job]:
    jobs = []
    for name in design.policies:
        for budget in design.budgets:
            policy = make_policy(name, budget, seed)
            policy.start_sample(sample)  # as the run loop does (random: its generator)
            settings = GenerationSettings(block=design.block, max_new_tokens=design.new_tokens,
                                          protocol=design.protocol)
            jobs.append(Job(ids, policy, settings, observer=Observer(clock=clock)))
    return jobs


def _timed(model: Any, clock: Callable[[], float], run: Callable[[], list[Any]]) -> tuple[float, list[Any]]:
    sync(model.device)
    t0 = clock()
    results = run()
    sync(model.device)
    return clock() - t0, results


def run_sweep_bench(model: Any, tokenizer: Any, designs: Sequence[Design], samples: int, seed: int,
                    clock: Callable[[], float], log: Callable[[str], None] | None = None,
                    fork_batches: Sequence[int] = (0,), together: bool = False,
                    on_sample: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """One row per design and batch K: the design run shared (generate_batch with batch=K: a sample's runs whose
    policies select alike as the rows of one cache, K at a time; with `together` every cache's decoding steps as the
    rows of one forward) and separately, over the same samples; every way of a
    design runs each sample back to back with the others, the order rotating from sample to sample. `on_sample` is
    called after every sample but the last with the rows so far (a bench stopped early leaves them)."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    rows = []
    for design in designs:
        configs = len(design.policies) * len(design.budgets)
        ways: list[int | None] = [None, *fork_batches]  # None: separate
        each: dict[int | None, list[float]] = {w: [] for w in ways}  # seconds per sample (paired ratios for the goal)
        identical = {k: 0 for k in fork_batches}
        first_difference: dict[int, Any] = {k: None for k in fork_batches}
        for s in range(samples):
            ids = prompt_ids(design.length, vocab, tokenizer, seed + s)
            order = ways[s % len(ways):] + ways[:s % len(ways)]
            tokens: dict[int | None, list[list[int]]] = {}
            for way in order:
                jobs = _jobs(design, ids, clock, seed, s)
                if way is not None:
                    took, results = _timed(model, clock, lambda: generate_batch(
                        model, jobs, batch=way or None, together=together))
                else:
                    took, results = _timed(model, clock, lambda: [
                        generate(model, j.policy, list(j.input_ids), j.settings, observer=j.observer) for j in jobs])
                each[way].append(took)
                tokens[way] = [r.tokens for r in results]
            for k in fork_batches:
                same = [a == b for a, b in zip(tokens[k], tokens[None])]
                identical[k] += sum(same)
                if first_difference[k] is None and not all(same):
                    j = same.index(False)
                    first_difference[k] = {"sample": s, "configuration": _label(design, j)}
            seconds = {w: sum(times) for w, times in each.items()}  # so far
            if log:
                shared = ", ".join(f"shared K={k} {seconds[k]:.1f} s (identical {identical[k]}/"
                                   f"{configs * (s + 1)})" for k in fork_batches)
                log(f"  {design.name} sample {s + 1}/{samples}: separate {seconds[None]:.1f} s, {shared} so far")
            if on_sample is not None and (s + 1 < samples or design is not designs[-1]):
                on_sample(rows + _rows(design, each, identical, first_difference, together))
        rows += _rows(design, each, identical, first_difference, together)
    return rows


def _rows(design: Design, each: dict[int | None, list[float]], identical: dict[int, int],
          first_difference: dict[int, Any], together: bool) -> list[dict[str, Any]]:
    """A design's row per batch K from its samples so far: `each` way's seconds per sample (None: separate)."""
    configs, samples = len(design.policies) * len(design.budgets), len(each[None])
    seconds = {w: sum(times) for w, times in each.items()}
    work = configs * samples
    return [{
        "design": design.name, "protocol": design.protocol, "block": design.block,
        "policies": list(design.policies), "budgets": list(design.budgets), "configurations": configs,
        "samples": samples, "prompt_tokens": design.length, "new_tokens": design.new_tokens,
        "fork_batch": k, "decode_together": together,
        "shared_s": round(seconds[k], 3), "separate_s": round(seconds[None], 3),
        "shared_per_hour": round(work / seconds[k] * 3600, 1),
        "separate_per_hour": round(work / seconds[None] * 3600, 1),
        "speedup": round(seconds[None] / seconds[k], 3),
        "sample_ratios": [round(a / b, 3) for a, b in zip(each[None], each[k])],
        "identical": identical[k], "pairs": work, "first_difference": first_difference[k],
        "goal": design.goal,
        # the process's peak RSS so far: the largest of its ways (one process runs them all)
        "process_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    } for k in identical]


def _label(design: Design, j: int) -> str:
    name, budget = design.policies[j // len(design.budgets)], design.budgets[j % len(design.budgets)]
    return f"{name} N={budget}"


def designs_from(names: Sequence[str], policies: Sequence[str] | None, budgets: Sequence[int] | None,
                 block: int | None, length: int | None, new_tokens: int | None) -> list[Design]:
    """The named designs, with what the command line overrides (a smaller model's smoke run scales them down)."""
    out = []
    for name in names:
        d = DESIGNS[name]
        out.append(replace(d, policies=tuple(policies) if policies else d.policies,
                           budgets=tuple(budgets) if budgets else d.budgets,
                           block=block if block is not None and d.block is not None else d.block,
                           length=length or d.length, new_tokens=new_tokens or d.new_tokens))
    return out


def sweep_goal_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per design and K: the pooled speed-up, judged against its goal (SmolLM2's at the design's own sizes) on the
    samples' paired ratios (`goal_verdict`; a table without them is judged on the pooled ratio alone), and the identity
    count; with two or more goals over samples, a HOLM line (one family)."""
    lines, family = [], []
    for r in rows:
        each = r.get("sample_ratios")
        verdict, passed, p = (goal_verdict(each, r["goal"], "sample") if each else
                              goal_verdict([r["speedup"]], r["goal"], "pooled ratio"))
        per = f", per sample {', '.join(f'{x:.2f}' for x in each)}" if each else ""
        lines.append(f"{r['design']} ({_way(r)}): shared vs separate "
                     f"{r['speedup']:.2f}x configurations x samples per hour{per}: {verdict}; identical predictions "
                     f"{r['identical']}/{r['pairs']}")
        if p is not None:
            family.append((f"{r['design']} K={r.get('fork_batch') or 'all'}{' together' * _together(r)}", passed, p))
    held = family_line(family, "sweep goals", ("PASS", "MISS"), over="samples")
    return lines if held is None else [*lines, held]


def _together(row: dict[str, Any]) -> bool:
    return bool(row.get("decode_together"))  # (absent from tables written before the option)


def _way(row: dict[str, Any]) -> str:
    return f"rows per cache {row.get('fork_batch') or 'all'}" + (", decoding together" if _together(row) else "")


def sweep_markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| design | protocol | B | configurations | samples | prompt / new tokens | rows per cache | "
            "decoding together | shared (s) | separate (s) | shared cfg x samples / h | separate cfg x samples / h | "
            "speed-up | identical predictions |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        out.append(f"| {r['design']} | {r['protocol']} | {r['block'] or '-'} | {r['configurations']} "
                   f"({len(r['policies'])} x N={','.join(map(str, r['budgets']))}) | {r['samples']} | "
                   f"{r['prompt_tokens']} / {r['new_tokens']} | {r.get('fork_batch') or 'all'} | "
                   f"{'yes' if _together(r) else 'no'} | "
                   f"{r['shared_s']:.1f} | {r['separate_s']:.1f} | {r['shared_per_hour']:.0f} | {r['separate_per_hour']:.0f} | "
                   f"{r['speedup']:.2f} | {r['identical']}/{r['pairs']} |")
    return "\n".join(out)

