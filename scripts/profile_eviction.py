"""Where eviction time goes, per policy, on SmolLM2-135M: one generate() call under cProfile, the kvbench functions
that eviction runs (scoring, selection, copying the kept tokens) with their cumulative CPU seconds.

    python scripts/profile_eviction.py [--policies snapkv,adakv,criticalkv,sagekv,keydiff] [--prompt 2048]
        [--budget 1024] [--block 128] [--new-tokens 32] [--out results/bench_smollm2/profile.md]

The companion of results/bench_smollm2/bench.md: that table says which goals are missed, this one why.
One thread, CPU time (time.process_time), the same filler prompt as kvbench-bench --model.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import torch

from kvbench.bench.setup import load_real_model, make_policy, prompt_ids
from kvbench.engine.generate import GenerationSettings, Observer, generate

FUNCS = ("evict", "_evict", "select", "score", "window_scores", "query_attention", "ranked_scores", "top_slots",
         "rank_mask", "adaptive_counts", "head_counts", "compact", "stage2_scores", "keep", "unpack", "pack", "on_append",
         "on_attention", "explicit_attention", "ragged_attention", "wrapped", "window_attention", "attention",
         "_query_rows", "_apply_pending", "attention_probs", "_cut_mask", "pooled", "on_keep", "on_reuse")


def profile(model, tok, name: str, prompt: list[int], budget: int, block: int, new_tokens: int) -> list[str]:
    policy = make_policy(name, budget, 0)
    generate(model, policy, prompt[:256], GenerationSettings(block=block, max_new_tokens=2))  # warm-up
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="snapkv,adakv,criticalkv,sagekv,keydiff")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("results/bench_smollm2/profile.md"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok, desc = load_real_model("smollm2-135m")
    prompt = prompt_ids(a.prompt, model.config.vocab_size, tok)
    lines = [f"# Where eviction time goes: {desc}", "",
             f"Command: `python scripts/profile_eviction.py --policies {a.policies} --prompt {a.prompt} --budget "
             f"{a.budget} --block {a.block} --new-tokens {a.new_tokens}`; one thread, CPU seconds under cProfile "
             "(which adds its own overhead to every Python call, so shares are upper bounds), block-wise, "
             "eviction after every prompt block and every decoding step. Cumulative times nest (evict includes "
             "select, which includes score, ...).", ""]
    for name in a.policies.split(","):
        lines += profile(model, tok, name, prompt, a.budget, a.block, a.new_tokens)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
