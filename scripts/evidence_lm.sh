#!/usr/bin/env bash
# The LM score on real code at n = 100 on SmolLM2 (issue "Evidence that resolves"): K-norm's language-modelling
# claims (K-norm §3.1: evicting the highest-norm keys leaves perplexity close to the full cache's; keeping the
# low-norm keys beats random eviction) and StreamingLLM against the full cache.
#
#   scripts/evidence_lm.sh            # results/evidence_lm/
#   QUICK=1 scripts/evidence_lm.sh    # 2 samples (scratch output only)
#
# Samples: the first 2048 tokens of .py files of task=code's pinned wheels (task=lm source=code), the texts at even
# positions of the first 200 of its order (task.limit=200 shard=0/2: 100 samples; the pilot's shard 7/40 holds
# only odd positions, so no pilot sample is reused). Scored: every token predicted after the first eviction at
# N = 1024, B = 128 (positions 1152-2046, 895 tokens per sample), the full cache on the same tokens (budget=1024
# sets them; nothing is evicted). N = 1024 is half of the 2048-token text: the paper's "up to 50 %" point.
# Random evicts the same layers as K-norm (layers 0-1 unpruned for both: equal compression).
# CPU budget: 4 runs x 100 samples x ~8-10 s = ~55-65 CPU-min, ~30-35 min wall on two workers.
NAME=evidence_lm
source "$(dirname "$0")/lib.sh"

N=${N:-1024}
LM=(task=lm task.source=code task.tokens=2048 task.limit=200 shard=0/2 block=128 "budget=$N")
if [[ "$QUICK" == 1 ]]; then
    LM=(task=lm task.source=code task.tokens=512 task.limit=4 shard=0/2 block=64 budget=128)
fi

start_run
sweep 0 "${LM[@]}" policy=full "hydra.sweep.dir=$RUNS"
sweep 0 "${LM[@]}" policy=knorm "hydra.sweep.dir=$RUNS"
sweep 1 "${LM[@]}" policy=random "policy.skip_layers=[0,1]" "hydra.sweep.dir=$RUNS"
sweep 1 "${LM[@]}" policy=streamingllm "hydra.sweep.dir=$RUNS"
wait_workers
finish_run
