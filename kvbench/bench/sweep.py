"""`kvbench-bench --sweep niah_grid,prefill_once`: configurations x samples per CPU-hour of a sweep's design run with
shared prompt forwards (`engine.generate.generate_shared`, one call per sample for every configuration) and run
separately (`engine.generate.generate` per configuration and sample), in one interleaved run.

A design is a set of configurations (policies x budgets under one protocol and block) over S samples (distinct
prompts of one length, as a task's samples). Per sample the two ways run back to back, alternating which goes first
(machine drift hits both alike), each timed with the chosen clock (cpu: the process's CPU time, robust to other
processes on one thread). Every configuration decodes exactly its new tokens (no stop token). The number is
configurations x samples / seconds x 3600; `identical` counts the (configuration, sample) pairs whose greedy tokens
are equal both ways (sharing is exact by construction, so it should be all of them).

The designs (issue 28): `niah_grid`, scripts/niah_grid.sh's policies without the h2o_original variant (12) at
N = 512, 1024, blockwise B = 128, 2000-token prompts, 32 new tokens; `prefill_once`, 10 policies at N = 512 under
prefill_once. The goals (>= 1.6x and >= 3.5x) are SmolLM2's on a CPU clock (docs/sweeps.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from kvbench.bench.setup import make_policy, prompt_ids
from kvbench.engine.generate import GenerationSettings, Job, Observer, generate, generate_shared, sync


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
                    clock: Callable[[], float], log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One row per design: both ways over the same samples, interleaved sample by sample."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    rows = []
    for design in designs:
        configs = len(design.policies) * len(design.budgets)
        seconds = {"shared": 0.0, "separate": 0.0}
        shared_forward_s, identical, first_difference = 0.0, 0, None
        for s in range(samples):
            ids = prompt_ids(design.length, vocab, tokenizer, seed + s)
            ways = ["shared", "separate"] if s % 2 == 0 else ["separate", "shared"]
            tokens: dict[str, list[list[int]]] = {}
            for way in ways:
                jobs = _jobs(design, ids, clock, seed, s)
                if way == "shared":
                    took, results = _timed(model, clock, lambda: generate_shared(model, jobs))
                    shared_forward_s += sum(r.shared_s for r in results)
                else:
                    took, results = _timed(model, clock, lambda: [
                        generate(model, j.policy, list(j.input_ids), j.settings, observer=j.observer) for j in jobs])
                seconds[way] += took
                tokens[way] = [r.tokens for r in results]
            same = [a == b for a, b in zip(tokens["shared"], tokens["separate"])]
            identical += sum(same)
            if first_difference is None and not all(same):
                j = same.index(False)
                first_difference = {"sample": s, "configuration": _label(design, j)}
            if log:
                log(f"  {design.name} sample {s + 1}/{samples}: shared {seconds['shared']:.1f} s, separate "
                    f"{seconds['separate']:.1f} s so far; identical {identical}/{configs * (s + 1)}")
        work = configs * samples
        rows.append({
            "design": design.name, "protocol": design.protocol, "block": design.block,
            "policies": list(design.policies), "budgets": list(design.budgets), "configurations": configs,
            "samples": samples, "prompt_tokens": design.length, "new_tokens": design.new_tokens,
            "shared_s": round(seconds["shared"], 3), "separate_s": round(seconds["separate"], 3),
            "shared_forward_s": round(shared_forward_s, 3),
            "shared_per_hour": round(work / seconds["shared"] * 3600, 1),
            "separate_per_hour": round(work / seconds["separate"] * 3600, 1),
            "speedup": round(seconds["separate"] / seconds["shared"], 3),
            "identical": identical, "pairs": work, "first_difference": first_difference, "goal": design.goal,
        })
    return rows


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
    """Per design: the speed-up against its goal (a goal for SmolLM2 at the design's own sizes) and the identity
    count."""
    return [f"{r['design']}: shared vs separate {r['speedup']:.2f}x configurations x samples per hour "
            f"({'PASS' if r['speedup'] >= r['goal'] else 'MISS'} against the goal >= {r['goal']}x for SmolLM2 at "
            f"the design's sizes); identical predictions {r['identical']}/{r['pairs']}" for r in rows]


def sweep_markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| design | protocol | B | configurations | samples | prompt / new tokens | shared (s) | separate (s) | "
            "shared forwards (s) | shared cfg x samples / h | separate cfg x samples / h | speed-up | "
            "identical predictions |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        out.append(f"| {r['design']} | {r['protocol']} | {r['block'] or '-'} | {r['configurations']} "
                   f"({len(r['policies'])} x N={','.join(map(str, r['budgets']))}) | {r['samples']} | "
                   f"{r['prompt_tokens']} / {r['new_tokens']} | {r['shared_s']:.1f} | {r['separate_s']:.1f} | "
                   f"{r['shared_forward_s']:.1f} | {r['shared_per_hour']:.0f} | {r['separate_per_hour']:.0f} | "
                   f"{r['speedup']:.2f} | {r['identical']}/{r['pairs']} |")
    return "\n".join(out)

