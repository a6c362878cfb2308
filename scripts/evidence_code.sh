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
# PARTS (default keydiff): keydiff = the pilot's four comparisons above; hashevict = HashEvict against H2O with the
# same protected tokens (the first 4 and the latest 10, HashEvict §4, as scripts/evidence_niah.sh runs it), into
# runs/hashevict_h2o/ (its own folder: an H2O with other options beside a plain one would make "h2o" ambiguous).
# h2o = KeyDiff's H2O baseline (KeyDiff App. A.1: heavy hitters only, no protected tokens) into runs/keydiff_h2o/
# (its own folder, for the same reason), the shards dealt to the workers in turn; the KeyDiff runs it is compared
# with are the keydiff part's, copied into that folder by hand after the run (the same files: RUN.md).
# Each part was run apart (RUN.md): a run of one part leaves the other's runs out of the scratch folder, so its
# hashevict_h2o/ folder is copied into the committed runs rather than finish_run's copy replacing them.
# Samples: the code task's samples at positions 0 mod 8 of its order (shard=0/8: 27 of 211 files, contexts of
# 1002-7518 tokens); shards 4/8, 2/8 and 6/8 complete the even half (106 samples) and kvbench-report merges them into
# one row per run. The pilot's shard 7/40 holds only odd positions, so no pilot sample is reused. Scores:
# code_sim_score (0-100, LongBench's) and the graded score (the gold line's mean log-probability per token, nats),
# which the tests use: on a 135M model most code_sim scores are low for every policy (results/pilot_evidence).
# Three single-threaded workers on the two cores, each one shared-work group (kvbench -m runs the runs that differ only
# in policy and budget sample-major, their common prompt blocks once): KeyDiff with TOVA; SnapKV with StreamingLLM;
# the full cache alone (its one pass over the prompt shares nothing with the block-wise runs, and on these files it
# costs as much as two of them).
# CPU budget, from the first samples of a shard 0/4 attempt (files of 2200-6400 tokens: 20-45 s per run and sample
# on a loaded machine, the full cache's one pass ~30 s on 5000 tokens): 5 runs x 27 samples x ~35 s = ~80 CPU-min,
# ~45 min wall. (That attempt, at shard 0/4, would have taken ~2 h here and was stopped.)
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
