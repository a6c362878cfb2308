#!/usr/bin/env bash
# K-norm's claim on the designed NIAH grid (issue "Evidence that resolves": every seed claim on a retrieval score, at
# a budget where the policies differ). The earlier grids ran K-norm against Random at N = 1024 (prefill_once), where
# both scored 0 on all 15 samples: that budget told them apart on no sample. Here a pilot chooses the budget first.
#
#   scripts/evidence_knorm.sh                 # results/evidence_knorm/ (pilot, then the grid's shards 0-9)
#   QUICK=1 scripts/evidence_knorm.sh         # a tiny sub-grid that checks the script end to end (scratch output)
#
# Design, samples and CPU budget: results/evidence_knorm/RUN.md.
NAME=evidence_knorm
source "$(dirname "$0")/lib.sh"

GRID=("${DESIGNED_GRID[@]}")
PILOT_SHARD=10/11
PILOT_N=1280,1536,1792
SHARDS=${SHARDS:-0 1 2 3 4 5 6 7 8 9}
FALLBACK_N=1536
if [[ "$QUICK" == 1 ]]; then
    GRID=(task=niah "task.context_lengths=[600]" "task.depths=[50]" task.samples_per_cell=2 task.max_new_tokens=8
          +task.windows=per_sample)
    PILOT_SHARD=1/2
    PILOT_N=384,512
    SHARDS="0"
    FALLBACK_N=384
fi
ONCE=(protocol=prefill_once)
PROTO_ARGS=()  # the claim's own protocol

start_run
sweep 0 "${GRID[@]}" "shard=$PILOT_SHARD" policy=full budget=null "hydra.sweep.dir=$RUNS/pilot"
sweep 1 "${GRID[@]}" "shard=$PILOT_SHARD" "${ONCE[@]}" policy=knorm "budget=$PILOT_N" "hydra.sweep.dir=$RUNS/pilot"
sweep 0 "${GRID[@]}" "shard=$PILOT_SHARD" "${ONCE[@]}" policy=random "policy.skip_layers=[0,1]" "budget=$PILOT_N" \
    "hydra.sweep.dir=$RUNS/pilot"
wait_workers

if N=$($REPORT "$RUNS/pilot" --budget-choice "$RUNS/budgets.md" --pick); then
    EXTRA_MD="The grid runs at N = $N, chosen by the pilot (pilot/budgets.md)."
else
    N=$FALLBACK_N
    EXTRA_MD="No pilot budget passed (pilot/budgets.md): the grid runs at N = $N, the fallback stated in advance"
    if M=$($REPORT "$RUNS/pilot" --budget-choice "$RUNS/budgets.md" --most-informative) && [[ $M != "$N" ]]
    then
        N="$N,$M"
        EXTRA_MD+=", and at N = $M, the pilot's most informative budget"
    fi
    EXTRA_MD+="."
fi
echo "[$NAME] grid budget: N = $N"
for s in $SHARDS; do
    shard="shard=$s/11"
    [[ "$QUICK" == 1 ]] && shard="shard=0/2"
    sweep $((s % 2)) "${GRID[@]}" "$shard" "${ONCE[@]}" policy=knorm "budget=$N" "hydra.sweep.dir=$RUNS/grid"
    sweep $((s % 2 + 1)) "${GRID[@]}" "$shard" "${ONCE[@]}" policy=random "policy.skip_layers=[0,1]" "budget=$N" \
        "hydra.sweep.dir=$RUNS/grid"
done
wait_workers
finish_run
