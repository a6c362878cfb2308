#!/usr/bin/env bash
# The NIAH pilot of the designed grid (issue "Evidence that resolves", point 3): needles each in its own window of
# the essays (+task.windows=per_sample), so samples are independent draws, and budgets chosen where the full cache
# answers (>= 90 %) and the policies spread (not all 0, not all 100). The pilot's samples are left out of the final
# runs.
#
#   scripts/pilot_niah.sh            # results/pilot_niah/
#   QUICK=1 scripts/pilot_niah.sh    # 1 sample, 1 policy (scratch output only)
#
# Design, samples and CPU budget: results/pilot_niah/RUN.md.
NAME=pilot_niah
source "$(dirname "$0")/lib.sh"

SHARD=${SHARD:-10/11}
BUDGETS=${BUDGETS:-256,512,1024}
GRID=("${DESIGNED_GRID[@]}" block=128 "shard=$SHARD")
if [[ "$QUICK" == 1 ]]; then
    GRID=(task=niah "task.context_lengths=[600]" "task.depths=[50]" task.samples_per_cell=1 task.max_new_tokens=8
          +task.windows=per_sample block=128)
    BUDGETS=256
fi

start_run
if [[ "$QUICK" == 1 ]]; then
    sweep 0 "${GRID[@]}" policy=streamingllm "budget=$BUDGETS" "hydra.sweep.dir=$RUNS"
else
    sweep 0 "${GRID[@]}" policy=full budget=null "hydra.sweep.dir=$RUNS"
    sweep 0 "${GRID[@]}" policy=keydiff,tova "budget=$BUDGETS" "hydra.sweep.dir=$RUNS"
    sweep 1 "${GRID[@]}" policy=snapkv,h2o,streamingllm "budget=$BUDGETS" "hydra.sweep.dir=$RUNS"
fi
wait_workers
finish_run
