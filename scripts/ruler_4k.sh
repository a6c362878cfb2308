#!/usr/bin/env bash
# Table 2: RULER's offline tasks at 4K on SmolLM2-135M-Instruct: the full cache and the seed papers' policies
# with their baselines at one budget.
#
#   scripts/ruler_4k.sh                  # the committed table: results/ruler_4k/
#   QUICK=1 scripts/ruler_4k.sh          # 2 tasks at 1K, 1 sample, 2 policies (scratch output only)
#   PROTOCOL=prefill_once scripts/ruler_4k.sh   # another eviction protocol (kvbench with `protocol`)
#
# The 11 tasks that need no downloaded data (qa_1/qa_2 need SQuAD/HotpotQA files), max_seq_length 4096,
# SAMPLES samples per task (RULER's official runs use 500; 1 here, to fit the hour of CPU all tables share: each
# task cell is 0 or 100 and only the 11-task average ranks policies, coarsely), budget N = 1024 (a quarter of the context), block B = 128. The essay tasks use
# kvbench's built-in filler, not Paul Graham's essays. Policies: the full cache; the seed papers' KeyDiff,
# K-norm, HashEvict, CriticalKV (on SnapKV) and SAGE-KV; the baselines they compare with: StreamingLLM (SAGE-KV,
# K-norm), SnapKV (KeyDiff, CriticalKV), H2O (HashEvict, KeyDiff). Left out for time: TOVA, Random, AdaKV
# (POLICIES=... adds them; the NIAH grid has every policy).
NAME=ruler_4k
source "$(dirname "$0")/lib.sh"

TASKS=${TASKS:-[niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery,vt,cwe,fwe]}
LENGTHS=${LENGTHS:-[4096]}
SAMPLES=${SAMPLES:-1}
BUDGET=${BUDGET:-1024}
POLICIES=${POLICIES:-keydiff,knorm,hashevict,criticalkv,sagekv,streamingllm,snapkv,h2o}
if [[ "$QUICK" == 1 ]]; then
    TASKS=[niah_single_1,vt]; LENGTHS=[1024]; SAMPLES=1; BUDGET=256; POLICIES=keydiff,streamingllm
fi
TASK=(task=ruler "task.tasks=$TASKS" "task.lengths=$LENGTHS" "task.num_samples=$SAMPLES" block=128)

start_run
sweep_policies "$BUDGET" "$POLICIES" "${TASK[@]}"
wait_workers
finish_run
