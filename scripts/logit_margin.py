"""Why a rerun's tokens differ from a committed run's: the logits at the step where they part.

    python scripts/logit_margin.py results/niah_grid/runs/smollm2-135m/niah/hashevict_N512_blockwise_B128 \
        --sample L2000_D10

Reruns one sample of a committed run (its own config.yaml) with today's code on this machine, feeding the committed
tokens instead of the argmax (`forced`), so every step sees the committed run's history, and prints, per decoding
step where the committed token is not today's argmax (and the step before it): the committed token's logit, today's
argmax and its logit, and their gap. A gap of float32 rounding size (well under 1e-2 on logits of magnitude ~20) says
the two runs took the other side of a near tie; a large gap says the computation itself changed (a bug to find).
The logits are the model's own, before the generation config's processors (the ones greedy decoding ranks unless a
processor applies; the header says which apply).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


from kvbench.run.records import read_records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path, help="a committed run directory (config.yaml, metrics.json, predictions.jsonl)")
    p.add_argument("--sample", required=True, help="the sample id")
    p.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    p.add_argument("--steps", default="",
                   help="comma-separated decoding steps to show too (e.g. where a batched rerun parted): the committed "
                        "token's logit against the best other token's, so a near tie shows where today agrees")
    a = p.parse_args(argv)
    try:
        extra = sorted({int(v) for v in a.steps.split(",") if v.strip()})
    except ValueError:
        print(f"logit_margin: --steps takes comma-separated step numbers, got '{a.steps}'", file=sys.stderr)
        return 2
    pred = a.run / "predictions.jsonl"
    if not (a.run / "config.yaml").is_file() or not pred.is_file():
        print(f"logit_margin: {a.run} is not a run directory (config.yaml, predictions.jsonl)", file=sys.stderr)
        return 2
    committed = next((r for r in read_records(pred, repair=False) if str(r["id"]) == a.sample), None)
    if committed is None:
        print(f"logit_margin: no sample '{a.sample}' in {pred}", file=sys.stderr)
        return 2
    if not committed.get("tokens"):  # an LM-score task's record: no tokens generated, none to part
        text = (f"`{a.run.as_posix()}`, sample `{a.sample}`: no generated tokens (a language-modelling score), so no "
                "step where tokens part; its score moved (the table above).\n")
        print(text)
        if a.out:
            a.out.write_text(text, encoding="utf-8")
        return 0
    from kvbench.run.score import ScoreError, read_run_config

    try:
        cfg = read_run_config(a.run)
    except ScoreError as e:
        print(f"logit_margin: {e}", file=sys.stderr)
        return 2

    import torch

    from kvbench.engine.generate import Job, Observer, generate_batch
    from kvbench.models.generation import describe_processors, greedy_processors
    from kvbench.run.app import Session, task_env
    from kvbench.run.loop import eos_ids, generation_settings, run_samples, sample_seed
    from kvbench.run.settings import RunSettings, build_policy, build_task

    cfg.update(shard=None, progress=False)
    settings = RunSettings.from_config(cfg)
    loaded = Session().model(settings)
    task = build_task(settings.task)
    sample = next(s for s in run_samples(task, task_env(loaded, settings), settings) if str(s.id) == a.sample)
    policy = build_policy(settings.policy, settings)
    policy.start_sample(sample_seed(sample.id))
    stop = sample.stop_token_ids if sample.stop_token_ids is not None else eos_ids(loaded.model, loaded.tokenizer)
    tokens = committed["tokens"]
    gen = generation_settings(settings, sample, stop, max_new_tokens=len(tokens))
    steps: list[torch.Tensor] = []
    observer = Observer(on_logits=lambda logits: steps.append(logits[0].detach().float().cpu()))
    generate_batch(loaded.model, [Job(sample.input_ids, policy, gen, forced=tokens, observer=observer)])
    procs = describe_processors(greedy_processors(loaded.model, torch.tensor([sample.input_ids]), stop))

    rows = []
    parted = [i for i, (lg, t) in enumerate(zip(steps, tokens)) if int(lg.argmax()) != t]
    for i in sorted({j for k in parted[:3] for j in (k - 1, k) if j >= 0} | {j for j in extra if j < len(steps)}):
        lg, t = steps[i], tokens[i]
        # today's argmax, or where it is the committed token the best other one (a positive gap: how far ahead)
        best = int(lg.argmax()) if int(lg.argmax()) != t else int(lg.topk(2).indices[1])
        rows.append(f"| {i} | {t} {loaded.tokenizer.decode([t])!r} | {lg[t].item():.6f} | {best} "
                    f"{loaded.tokenizer.decode([best])!r} | {lg[best].item():.6f} | {lg[best].item() - lg[t].item():.2e} |")
    lines = [f"`{a.run.as_posix()}`, sample `{a.sample}`: the committed tokens fed back through today's code "
             f"({len(steps)} steps; processors: {procs or 'none'}); "
             + (f"today's argmax parts from the committed token at step(s) {parted[:3]}" if parted
                else "today's argmax is the committed token at every step") + ".", ""]
    if rows:
        lines += ["| step | committed token | its logit | today's argmax (else the best other token) | its logit | gap |",
                  "|---|---|---|---|---|---|", *rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
