#!/usr/bin/env bash
# The real-code completion task at n = 106 on SmolLM2 (issue "Evidence that resolves"): the pilot's planned
# comparisons (results/pilot_evidence/plan_code.md: KeyDiff vs TOVA, KeyDiff vs SnapKV, KeyDiff vs the full cache,
# StreamingLLM vs the full cache at N = 512, B = 128; its largest n needed was 38) on LongBench-LCC-shaped
# next-line completion of the pinned wheels' source files (task=code, docs/code.md).
#
#   scripts/evidence_code.sh            # results/evidence_code/
#   QUICK=1 scripts/evidence_code.sh    # 2 samples of 2 policies (scratch output only)
#
# Samples: the code task's samples at even positions of its order (shard=0/2: 106 of 211 files, contexts of 1002-7518
# tokens); the pilot's shard 7/40 holds only odd positions, so no pilot sample is reused. Scores: code_sim_score
# (0-100, LongBench's) and the graded score (the gold line's mean log-probability per token, nats), which the tests
# use: on a 135M model most code_sim scores are low for every policy (results/pilot_evidence).
# Two workers, each one shared-work group (kvbench -m runs the runs that differ only in policy and budget
# sample-major, their common prompt blocks once): KeyDiff with TOVA; the full cache with SnapKV and StreamingLLM.
# CPU budget: 5 runs x 106 samples x ~13 s (the pilot's 15 s on a loaded machine) = ~115 CPU-min, ~60 min wall on
# two workers.
NAME=evidence_code
source "$(dirname "$0")/lib.sh"

CODE=(task=code shard=0/2 block=128 budget=512)
if [[ "$QUICK" == 1 ]]; then
    CODE=(task=code task.limit=4 shard=0/2 block=128 budget=512)
fi

start_run
if [[ "$QUICK" == 1 ]]; then
    sweep 0 "${CODE[@]}" policy=full,keydiff "hydra.sweep.dir=$RUNS"
else
    sweep 0 "${CODE[@]}" policy=keydiff,tova "hydra.sweep.dir=$RUNS"
    sweep 1 "${CODE[@]}" policy=full,snapkv,streamingllm "hydra.sweep.dir=$RUNS"
fi
wait_workers
finish_run
