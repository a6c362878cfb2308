#!/usr/bin/env bash
# The real-code completion task on SmolLM2 (issue "Evidence that resolves"): the pilot's planned comparisons
# (results/pilot_evidence/plan_code.md: KeyDiff vs TOVA, KeyDiff vs SnapKV, KeyDiff vs the full cache, StreamingLLM
# vs the full cache at N = 512, B = 128; its largest n needed was 38) on LongBench-LCC-shaped next-line completion of
# the pinned wheels' source files (task=code, docs/code.md).
#
#   scripts/evidence_code.sh                       # results/evidence_code/, shard 0/8: 27 samples
#   SHARDS=0/8,4/8,2/8,6/8 scripts/evidence_code.sh   # the even half: 106 samples (the report merges the shards)
#   QUICK=1 scripts/evidence_code.sh               # 2 samples of 2 policies (scratch output only)
#   PARTS=hashevict WORKERS=2 SHARDS=0/8,4/8,2/8,6/8 scripts/evidence_code.sh   # HashEvict's claim on the same samples
#   PARTS=h2o WORKERS=2 SHARDS=0/8,4/8,2/8,6/8 scripts/evidence_code.sh   # KeyDiff's H2O (heavy hitters only), same samples
#
# Design, samples and CPU budget: results/evidence_code/RUN.md.
NAME=evidence_code
WORKERS=${WORKERS:-3}
source "$(dirname "$0")/lib.sh"

SHARDS=${SHARDS:-0/8}
PARTS=${PARTS:-keydiff}
CODE=(task=code "shard=$SHARDS" block=128 budget=512)
if [[ "$QUICK" == 1 ]]; then
    CODE=(task=code task.limit=4 shard=0/2 block=128 budget=512)
fi

start_run
if [[ "$QUICK" == 1 ]]; then
    sweep 0 "${CODE[@]}" policy=full,keydiff "hydra.sweep.dir=$RUNS"
else
    if [[ " $PARTS " == *" keydiff "* ]]; then
        sweep 0 "${CODE[@]}" policy=keydiff,tova "hydra.sweep.dir=$RUNS"
        sweep 1 "${CODE[@]}" policy=snapkv,streamingllm "hydra.sweep.dir=$RUNS"
        sweep 2 "${CODE[@]}" policy=full "hydra.sweep.dir=$RUNS"
    fi
    if [[ " $PARTS " == *" h2o "* ]]; then
        IFS=, read -ra SHARD_LIST <<< "$SHARDS"
        for i in "${!SHARD_LIST[@]}"; do
            sweep $((i % WORKERS)) task=code "shard=${SHARD_LIST[$i]}" block=128 budget=512 policy=h2o \
                "hydra.sweep.dir=$RUNS/keydiff_h2o"
        done
    fi
    if [[ " $PARTS " == *" hashevict "* ]]; then
        sweep 0 "${CODE[@]}" policy=hashevict "hydra.sweep.dir=$RUNS/hashevict_h2o"
        sweep 1 "${CODE[@]}" policy=h2o policy.n_sink=4 policy.n_recent=10 "hydra.sweep.dir=$RUNS/hashevict_h2o"
    fi
fi
wait_workers
finish_run
