"""Where eviction time goes, per policy, on SmolLM2-135M: one generate() call under cProfile, the kvbench functions
that eviction runs (scoring, selection, copying the kept tokens) with their cumulative CPU seconds; with --ops, the
torch operations of one phase's evictions instead (torch.profiler: self CPU ms by operation and input shapes, per
decoding step or, with --phase prefill, per prompt block), next to the phase they are part of, timed in a run
without the profiler.

    python scripts/profile_eviction.py [--policies snapkv,adakv,criticalkv,sagekv,keydiff] [--prompt 2048]
        [--budget 1024] [--block 128] [--new-tokens 32] [--ops [--phase decode|prefill]] [--top 12]
        [--out results/bench_smollm2/profile.md]

The companion of results/bench_smollm2/bench.md: that table says which goals are missed, this one why.
One thread, CPU time (time.process_time), the same filler prompt as kvbench-bench --model.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import kvbench.engine.generate as engine
from kvbench.bench.setup import load_real_model, make_policy, prompt_ids
from kvbench.engine.generate import GenerationSettings, Observer, generate

FUNCS = ("evict", "_evict", "select", "score", "window_scores", "query_attention", "ranked_scores", "top_slots",
         "rank_mask", "adaptive_counts", "head_counts", "compact", "stage2_scores", "keep", "unpack", "pack",
         "on_append", "on_attention", "explicit_attention", "ragged_attention", "wrapped", "window_attention",
         "attention", "_query_rows", "_apply_pending", "attention_probs", "_cut_mask", "pooled", "on_keep", "on_reuse")


def warm_up(model: Any, name: str, prompt: list[int], budget: int, block: int) -> None:
    """A short run of the policy first, so one-time costs (kernel choice, allocations) are not in what is timed."""
    generate(model, make_policy(name, budget, 0), prompt[:256], GenerationSettings(block=block, max_new_tokens=2))


def profile(model, tok, name: str, prompt: list[int], budget: int, block: int, new_tokens: int) -> list[str]:
    warm_up(model, name, prompt, budget, block)
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    res = generate(model, make_policy(name, budget, 0), prompt,
                   GenerationSettings(block=block, max_new_tokens=new_tokens),
                   observer=Observer(clock=time.process_time))
    prof.disable()
    total = res.prefill_s + res.decode_s
    rows = [f"### {name}: total {total:.2f} s (prefill {res.prefill_s:.2f}, decode {res.decode_s:.2f}), eviction "
            f"{res.evict_prefill_s:.2f} + {res.evict_decode_s:.2f} s ({100 * res.evict_s / total:.1f} %)", "",
            "| function | calls | cumulative s | share of the run |", "|---|---|---|---|"]
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    picked = [(k, v) for k, v in stats.items() if "kvbench" in k[0] and k[2] in FUNCS]
    for (file, _, fn), (_, calls, _, cum, _) in sorted(picked, key=lambda kv: -kv[1][3])[:12]:
        where = file.split("kvbench/", 1)[-1]
        rows.append(f"| `{where}:{fn}` | {calls} | {cum:.2f} | {100 * cum / total:.1f} % |")
    return rows + [""]


def profile_ops(model: Any, name: str, prompt: list[int], budget: int, block: int, new_tokens: int,
                top: int, phase: str = "decode") -> list[str]:
    """One phase's evictions' torch operations: one run timed as it is, then one with each eviction of `phase`
    ("decode": every decoding step's, "prefill": every prompt block's) under torch.profiler (the engine's `_evict`,
    wrapped: the forwards and the other phase's evictions are not profiled)."""
    settings = GenerationSettings(block=block, max_new_tokens=new_tokens)
    warm_up(model, name, prompt, budget, block)
    res = generate(model, make_policy(name, budget, 0), prompt, settings, observer=Observer(clock=time.process_time))
    steps = len(res.tokens) - 1  # the first token comes from the prompt's forward
    totals: dict[tuple[str, str], list[float]] = {}  # (operation, input shapes) -> [self CPU us, calls]
    profiled = [0]
    evict = engine._evict

    def traced(r: Any, at: str, device: torch.device) -> float:  # engine._evict's
        if at != phase:
            return evict(r, at, device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            took = evict(r, at, device)
        profiled[0] += 1
        for e in prof.key_averages(group_by_input_shape=True):
            shapes = ", ".join(str(x) for x in e.input_shapes if x) or "-"
            t = totals.setdefault((e.key, shapes), [0.0, 0])
            t[0] += e.self_cpu_time_total
            t[1] += e.count
        return took

    with mock.patch.object(engine, "_evict", traced):
        generate(model, make_policy(name, budget, 0), prompt, settings)
    n = max(profiled[0], 1)
    total = sum(t[0] for t in totals.values()) / 1000 / n
    if phase == "decode":
        rows = [f"### {name}: decoding {1000 * res.decode_s / steps:.1f} ms a step, of which eviction "
                f"{1000 * res.evict_decode_s / steps:.1f} ms ({steps} steps, no profiler)", "",
                f"Operations of {profiled[0]} decoding evictions under the profiler: {total:.1f} ms a step of self CPU "
                f"time in torch operations; the top {top}:", "",
                "| operation | input shapes | ms per step | calls per step |", "|---|---|---|---|"]
    else:
        rows = [f"### {name}: prompt {res.prefill_s:.2f} s, of which eviction {res.evict_prefill_s:.2f} s: "
                f"{1000 * res.evict_prefill_s / n:.1f} ms a block ({n} blocks, no profiler)", "",
                f"Operations of the {profiled[0]} prompt blocks' evictions under the profiler (the first blocks, under "
                f"the budget, evict nothing): {total:.1f} ms a block of self CPU time in torch operations; the top "
                f"{top}:", "", "| operation | input shapes | ms per block | calls per block |", "|---|---|---|---|"]
    for (op, shapes), (us, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        rows.append(f"| `{op}` | {shapes} | {us / 1000 / n:.2f} | {calls / n:.1f} |")
    # The same per operation, all input shapes together: a ragged layer's heads and a per-layer budget give every
    # layer other shapes, which split one operation over many rows above
    by_op: dict[str, float] = {}
    for (op, _), (us, _) in totals.items():
        by_op[op] = by_op.get(op, 0.0) + us
    ranked = sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
    rows += ["", "By operation, all input shapes together (ms): "
             + ", ".join(f"`{op}` {us / 1000 / n:.2f}" for op, us in ranked) + "."]
    return rows + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="snapkv,adakv,criticalkv,sagekv,keydiff")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--ops", action="store_true", help="the decoding evictions' torch operations (torch.profiler)")
    ap.add_argument("--top", type=int, default=12, help="operations shown per policy (--ops)")
    ap.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                    help="--ops: the evictions of the decoding steps or of the prompt blocks")
    ap.add_argument("--out", type=Path, default=None,
                    help="default results/bench_smollm2/profile.md (with --ops: profile_ops.md, with --phase prefill "
                         "profile_ops_prefill.md)")
    a = ap.parse_args()
    if a.out is None:
        name = ("profile_ops.md" if a.phase == "decode" else "profile_ops_prefill.md") if a.ops else "profile.md"
        a.out = Path("results/bench_smollm2") / name
    torch.set_num_threads(1)
    model, tok, desc = load_real_model("smollm2-135m")
    prompt = prompt_ids(a.prompt, model.config.vocab_size, tok)
    command = (f"python scripts/profile_eviction.py --policies {a.policies} --prompt {a.prompt} --budget {a.budget} "
               f"--block {a.block} --new-tokens {a.new_tokens}")
    if a.ops:
        what = ("decoding step", "decoding evictions") if a.phase == "decode" else ("prompt", "prompt-block evictions")
        lines = [f"# The {what[1]}' operations: {desc}", "",
                 f"Command: `{command} --ops --top {a.top} --phase {a.phase}`; one thread, block-wise, eviction after "
                 f"every prompt block and every decoding step. Per policy: its {what[0]} and the eviction's share, CPU "
                 f"time without the profiler; then the self CPU time of the torch operations the {what[1]} ran "
                 "(torch.profiler, in a second run), by operation and input shapes, per eviction. Python's own time "
                 "between operations is not in them: the sum is below the eviction's time.", ""]
        for name in a.policies.split(","):
            lines += profile_ops(model, name, prompt, a.budget, a.block, a.new_tokens, a.top, a.phase)
    else:
        lines = [f"# Where eviction time goes: {desc}", "",
                 f"Command: `{command}`; one thread, CPU seconds under cProfile (which adds its own overhead to every "
                 "Python call, so shares are upper bounds), block-wise, eviction after every prompt block and every "
                 "decoding step. Cumulative times nest (evict includes select, which includes score, ...).", ""]
        for name in a.policies.split(","):
            lines += profile(model, tok, name, prompt, a.budget, a.block, a.new_tokens)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
