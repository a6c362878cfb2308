#!/usr/bin/env bash
# The pilot of a designed RULER run (issue "Evidence that resolves": KeyDiff's claim on RULER, which results/ruler_4k
# left unresolved at n = 10 with 7 of 10 samples failed by every policy). RULER's generator gives every sample of a
# (task, length) the same haystack (the essays' first words); here each sample has its own stretch of the essays
# (task.windows=per_sample, docs/ruler.md), so samples are independent draws, and the pilot chooses the budget where the
# full cache answers and the policies spread.
#
#   scripts/pilot_ruler.sh            # results/pilot_ruler/
#   QUICK=1 scripts/pilot_ruler.sh    # 1 sample, the full cache and KeyDiff (scratch output only)
#
# Design, samples and CPU budget: results/pilot_ruler/RUN.md.
NAME=pilot_ruler
source "$(dirname "$0")/lib.sh"

BUDGETS=${BUDGETS:-1024,2048,3072}
TASK=(task=ruler "task.tasks=[niah_single_2]" "task.lengths=[4096]" task.num_samples=35 task.windows=per_sample
      block=128 shard=4/5)
if [[ "$QUICK" == 1 ]]; then
    TASK=(task=ruler "task.tasks=[niah_single_2]" "task.lengths=[4096]" task.num_samples=2 task.windows=per_sample
          block=128 shard=1/2)
    BUDGETS=2048
fi

start_run
sweep 0 "${TASK[@]}" policy=full budget=null "hydra.sweep.dir=$RUNS"
if [[ "$QUICK" == 1 ]]; then
    sweep 1 "${TASK[@]}" policy=keydiff "budget=$BUDGETS" "hydra.sweep.dir=$RUNS"
else
    sweep 0 "${TASK[@]}" policy=keydiff,tova "budget=$BUDGETS" "hydra.sweep.dir=$RUNS"
    sweep 1 "${TASK[@]}" policy=snapkv,h2o "budget=$BUDGETS" "hydra.sweep.dir=$RUNS"
fi
wait_workers
finish_run
