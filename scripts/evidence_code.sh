#!/usr/bin/env bash
# The real-code completion task on SmolLM2 (issue "Evidence that resolves"): the pilot's planned comparisons
# (results/pilot_evidence/plan_code.md: KeyDiff vs TOVA, KeyDiff vs SnapKV, KeyDiff vs the full cache, StreamingLLM
# vs the full cache at N = 512, B = 128; its largest n needed was 38) on LongBench-LCC-shaped next-line completion of
# the pinned wheels' source files (task=code, docs/code.md).
#
#   scripts/evidence_code.sh                  # results/evidence_code/, shard 0/4: 53 samples
#   SHARDS=0/4,2/4 scripts/evidence_code.sh   # both even quarters: 106 samples (the report merges the shards)
#   QUICK=1 scripts/evidence_code.sh          # 2 samples of 2 policies (scratch output only)
#
# Samples: the code task's samples at positions 0 mod 4 of its order (shard=0/4: 53 of 211 files, contexts of
# 1002-7518 tokens); with shard 2/4 (positions 2 mod 4) the even half, 106. The pilot's shard 7/40 holds only odd
# positions, so no pilot sample is reused. Scores: code_sim_score (0-100, LongBench's) and the graded score (the
# gold line's mean log-probability per token, nats), which the tests use: on a 135M model most code_sim scores are
# low for every policy (results/pilot_evidence).
# Two workers, each one shared-work group (kvbench -m runs the runs that differ only in policy and budget
# sample-major, their common prompt blocks once): KeyDiff with TOVA; the full cache with SnapKV and StreamingLLM.
# CPU budget (measured on the first samples: ~18 s per run and sample, a 5000-token file ~30 s): 5 runs x 53 samples
# x ~18 s = ~80 CPU-min, ~45 min wall on two workers (the worker with three runs sets it); twice that for 106.
NAME=evidence_code
source "$(dirname "$0")/lib.sh"

SHARDS=${SHARDS:-0/4}
CODE=(task=code "shard=$SHARDS" block=128 budget=512)
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
