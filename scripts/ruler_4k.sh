#!/usr/bin/env bash
# Table 2: RULER's offline tasks at 4K on SmolLM2-135M-Instruct: the full cache and the seed papers' policies
# with their baselines at one budget.
#
#   scripts/ruler_4k.sh                  # the committed table: results/ruler_4k/
#   QUICK=1 scripts/ruler_4k.sh          # 2 tasks at 1K, 1 sample, 2 policies (scratch output only)
#   PROTOCOL=prefill_once scripts/ruler_4k.sh   # another eviction protocol (kvbench with `protocol`)
#
# Design, samples and CPU budget: results/ruler_4k/RUN.md.
NAME=ruler_4k
source "$(dirname "$0")/lib.sh"

TASKS=${TASKS:-[niah_single_2]}
LENGTHS=${LENGTHS:-[4096]}
SAMPLES=${SAMPLES:-10}
BUDGET=${BUDGET:-1024}
POLICIES=${POLICIES:-keydiff,tova,snapkv,h2o,streamingllm}
if [[ "$QUICK" == 1 ]]; then
    TASKS=[niah_single_1,vt]; LENGTHS=[1024]; SAMPLES=2; BUDGET=256; POLICIES=keydiff,streamingllm
fi
TASK=(task=ruler "task.tasks=$TASKS" "task.lengths=$LENGTHS" "task.num_samples=$SAMPLES" block=128)

start_run
sweep_policies "$BUDGET" "$POLICIES" "${TASK[@]}"
wait_workers
finish_run
