"""How far slot reuse moves committed runs' logits: each sample's committed tokens and its graded answer, fed through
today's code decoding chronologically and with slot reuse, step by step.

    python scripts/slot_logits.py RUN [RUN ...] [--shard 0/3] [--out results/bench_smollm2/slot_logits.md]

Per sample of each committed run (its own config.yaml; --shard i/n: the samples with index % n == i), two teacher-forced
decodes after the prompt, each run twice (slot_reuse false, then true): the committed tokens (the greedy path the run
took) and the graded answer (the graded score's branch: its mean log-probability per token is that score). The table
gives the largest logit difference between the two storages over each path's steps (and the first step where it is not
0), whether today's argmax is the committed token at every step both ways, and the graded score both ways beside the
committed one. Slot reuse keeps the same keys in another order, so attention sums in another order: float32 rounding
(logit differences ~1e-5 on logits of magnitude ~20) is the expected size; a step whose held tokens differ moves the
logits by orders of magnitude more (a bug to find). The graded score here is computed in one forward per answer token
of one sample, as a batch-1 run's graded branch computes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path


def _forced(model, job, tokens: list[int], reuse: bool) -> list:
    """The logits (float64, on the host) of each step of `job`'s prompt then `tokens` teacher-forced, slot reuse on
    or off."""
    import torch

    from kvbench.engine.generate import Job, Observer, generate_batch

    steps: list[torch.Tensor] = []
    gen = dataclasses.replace(job.settings, slot_reuse=reuse, max_new_tokens=len(tokens), min_new_tokens=0,
                              stop_ids=())
    observer = Observer(on_logits=lambda logits: steps.append(logits[0].detach().double().cpu()))
    generate_batch(model, [Job(job.input_ids, job.policy, gen, forced=tokens, observer=observer)])
    return steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="committed run directories")
    p.add_argument("--shard", default="0/1", help="i/n: the samples with index %% n == i (default: every sample)")
    p.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    a = p.parse_args(argv)
    try:
        i, n = (int(v) for v in a.shard.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        print(f"slot_logits: --shard takes i/n with 0 <= i < n, got '{a.shard}'", file=sys.stderr)
        return 2
    from kvbench.run.records import read_records
    from kvbench.run.score import ScoreError, committed_run_configs

    try:
        configs = committed_run_configs(a.runs)  # a bad one is one line, nothing written
    except ScoreError as e:
        print(f"slot_logits: {e}", file=sys.stderr)
        return 2

    import copy

    import torch

    from kvbench.run.app import Session, task_env
    from kvbench.run.loop import eos_ids, run_samples, sample_job, sample_seed
    from kvbench.run.settings import RunSettings, build_policy, build_task

    session = Session()
    rows = []
    for run, cfg in configs.items():
        committed = {str(r["id"]): r for r in read_records(run / "predictions.jsonl", repair=False)}
        cfg.update(progress=False)
        settings = RunSettings.from_config(cfg)
        loaded = session.model(settings)
        task = build_task(settings.task)
        stop = eos_ids(loaded.model, loaded.tokenizer)
        samples = [s for s in run_samples(task, task_env(loaded, settings), settings) if str(s.id) in committed]
        for sample in samples[i::n]:
            rec = committed[str(sample.id)]
            policy = build_policy(settings.policy, settings)
            policy.start_sample(sample_seed(sample.id))
            job = sample_job(loaded.tokenizer, policy, task, sample, settings, stop)
            cells = []
            for tokens in (list(rec["tokens"]), list(job.answer_ids or [])):
                # each decode on its own copy of the started policy (a stochastic one draws the same)
                chrono, reuse = ([] if not tokens else _forced(loaded.model, dataclasses.replace(
                    job, policy=copy.deepcopy(policy)), tokens, r) for r in (False, True))
                diffs = [(x - y).abs().max().item() for x, y in zip(chrono, reuse, strict=True)]
                first = next((k for k, d in enumerate(diffs) if d > 0), None)
                agree = all(int(x.argmax()) == t and int(y.argmax()) == t for x, y, t in zip(chrono, reuse, tokens))
                cells.append((len(tokens), max(diffs, default=0.0), first, agree, chrono, reuse, tokens))
            (nt, dt, ft, at, *_), (na, da, fa, _, ca, ra, ans) = cells
            graded = [sum(torch.log_softmax(s, -1)[t].item() for s, t in zip(steps, ans)) / len(ans) if ans else None
                      for steps in (ca, ra)]
            fmt = (lambda v: "-" if v is None else f"{v:.6f}")
            rows.append(f"| `{run.as_posix()}` | `{sample.id}` | {nt} | {dt:.1e} | {'-' if ft is None else ft} | "
                        f"{'yes' if at else 'NO'} | {na} | {da:.1e} | {'-' if fa is None else fa} | {fmt(graded[0])} | "
                        f"{fmt(graded[1])} | "
                        f"{'-' if None in graded else f'{abs(graded[0] - graded[1]):.1e}'} | "
                        f"{fmt(rec.get('answer_logprob'))} |")
            print(rows[-1], flush=True)
    text = "\n".join([
        "Committed tokens and graded answers teacher-forced through today's code, decoding chronologically and with "
        "slot reuse (`python scripts/slot_logits.py " + " ".join(r.as_posix() for r in a.runs)
        + f" --shard {a.shard}`); logits float32, compared as float64.", "",
        "| committed run | sample | tokens | max abs logit difference | first step differing | argmax = committed "
        "token at every step, both | answer tokens | max abs logit difference | first step differing | graded score "
        "chronological | with slot reuse | difference | committed graded score |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|", *rows]) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
