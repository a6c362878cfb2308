"""Where a bench configuration's greedy tokens part with and without slot reuse: the logits at each step up to it.

    python scripts/slot_margin.py --config .gpu/smollm2 --dtype bfloat16 --policy tova --length 512 --budget 128 \
        --block 64

Runs one `kvbench-bench` configuration (its random-weight model and random prompt, seed 0) twice, decoding
chronologically and with slot reuse, and prints per decoding step, up to the first step whose tokens differ: each
run's two largest logits, their gap, and the largest difference between the two runs' logits. Slot reuse keeps the
same keys in another order, so attention sums in another order: in float32 and float64 the tokens agree
(tests/test_slots.py, tests/test_stack.py), while in bfloat16 a random-weight model's near-flat logits (magnitude ~2,
where bfloat16's spacing is 2^-7) can tie within that rounding. A parting at a gap of a few spacings is such a tie; a
parting at a large gap is a bug to find.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="an HF config.json / model directory (as kvbench-bench --config)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--policy", required=True, help="a conf/policy name")
    p.add_argument("--length", type=int, default=512, help="prompt tokens")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--tokens", type=int, default=8, help="greedy tokens decoded")
    a = p.parse_args(argv)

    import torch

    from kvbench.bench.setup import BenchError, build_model, make_policy, prompt_ids
    from kvbench.engine.generate import GenerationSettings, Observer, generate

    try:
        model, desc = build_model(config=a.config, dtype=a.dtype, device=a.device)
        make_policy(a.policy, a.budget, 0)
    except BenchError as e:
        print(f"slot_margin: {e}", file=sys.stderr)
        return 2
    ids = prompt_ids(a.length, model.config.get_text_config(decoder=True).vocab_size, seed=0)
    runs = []
    for slots in (False, True):
        logits: list[torch.Tensor] = []  # per step: (vocab,) float32, before the processors
        policy = make_policy(a.policy, a.budget, 0)
        policy.start_sample(0)
        settings = GenerationSettings(block=a.block, max_new_tokens=a.tokens, slot_reuse=slots)
        res = generate(model, policy, ids, settings, observer=Observer(on_logits=lambda x: logits.append(x[0].clone())))
        runs.append((res.tokens, logits))
    (ta, la), (tb, lb) = runs
    print(f"{desc}; {a.policy}, prompt {a.length}, N = {a.budget}, B = {a.block}, {a.device}\n")
    print(f"tokens, chronological: {ta}\ntokens, slot reuse:    {tb}\n")
    print("| step | chronological: top 2 (logits) | gap | slot reuse: top 2 (logits) | gap | max abs logit diff |")
    print("|---|---|---|---|---|---|")
    for step, (x, y) in enumerate(zip(la, lb)):
        cells = []
        for v in (x, y):
            top = torch.topk(v, 2)
            cells += [f"{top.indices.tolist()} ({', '.join(f'{t:.6g}' for t in top.values.tolist())})",
                      f"{float(top.values[0] - top.values[1]):.4g}"]
        print(f"| {step} | {' | '.join(cells)} | {float((x - y).abs().max()):.4g} |")
        if ta[step] != tb[step]:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
