"""`kvbench-bench`: prefill/decode speed, eviction cost and memory of the policies, side by side with HF's own loop.

Two kinds of model:
- `--model NAME|DIR`: a real model (a conf/model preset such as `smollm2-135m`, or a local HF directory) with its
  own weights and tokenizer; the prompt is kvbench's built-in filler prose, tokenized;
- otherwise a random-weight model with real attention geometry (default: Llama-3.2-3B's head_dim 128 and 24/8 GQA
  heads in two small layers, `TINY_ARCHS["tiny-llama3"]`, or `--config` for any architecture nobody ships) and a
  random prompt: speed and memory do not depend on what the weights say.
Every (policy, budget, prompt length) configuration runs `engine.generate` on the same prompt, configurations are
interleaved inside one process round after round (machine drift hits all of them alike) and each number is the
median over rounds.

Two baselines are always measured with the policies asked for:
- `full`: one forward over the whole prompt, no eviction (the plain model);
- `streamingllm`: the same block loop as every evicting policy with the cheapest eviction there is (keep the
  sinks and the most recent tokens; its score is the slot positions), i.e. the cost floor of block processing.
- `hf` (side by side with HF, the default with `--model`): two rows that run HF's own loop on the same model object
  outside kvbench (a plain `DynamicCache`, HF's sdpa attention, the same greedy hand loop as `engine.generate`):
  `hf-forward` = one forward over the whole prompt, then decoding at that cache size; `hf-decode` = a forward over
  the first N prompt tokens, then decoding at cache size N, the size every evicting policy decodes at.
So `evict_share` (eviction time / total run time), `vs_floor` (prefill time / the floor's - 1), `vs_hf_forward`,
`decode_vs_hf` and `kv_vs_full` (peak KV bytes / full's) are ratios between configurations of the same run, and
`goals()` turns them into the pass/fail lines of the speed goals of docs/bench.md (eviction share, decode vs HF,
prefill vs HF, slowest policy vs KeyDiff, flat memory, host syncs per decoding step).

`--batch 1,4,8` measures something else: samples per hour with K samples per forward (`batch`), for NIAH- and
LongBench-shaped workloads, next to HF's batched `generate`.

Modules: setup (models, prompts, policies by name), batch (--batch), measure (one configuration, interleaved rounds,
peak memory; its docstring says how RSS is measured), hfloop (HF's own loop, whole or in lockstep with a call:
--hf-lockstep), syncs (host syncs per decoding step, counted on any device), goals (ratios, pass/fail lines, the
table), cli (`main`).
"""
