#!/usr/bin/env bash
# The pilot of the evidence runs (issue "Evidence that resolves"): small n on samples the final runs leave out,
# to choose budgets where the policies differ and to size n by a power analysis of the paired differences
# (kvbench-report's required-n column of paired.csv).
#
#   scripts/pilot_evidence.sh            # results/pilot_evidence/
#   QUICK=1 scripts/pilot_evidence.sh    # 2 samples, 2 policies (scratch output only)
#
# Design, samples and CPU budget: results/pilot_evidence/RUN.md.
NAME=pilot_evidence
source "$(dirname "$0")/lib.sh"

SHARD=${SHARD:-7/40}
LM_BUDGETS=${LM_BUDGETS:-256,512}
LM_POLICIES=${LM_POLICIES:-streamingllm,knorm,random,keydiff,snapkv,tova,h2o}
CODE_POLICIES=${CODE_POLICIES:-keydiff,snapkv,tova,streamingllm}
LM=(task=lm task.source=code task.tokens=2048 task.lm_tokens=1024 block=128 "shard=$SHARD")
CODE=(task=code block=128 "shard=$SHARD")
if [[ "$QUICK" == 1 ]]; then
    SHARD=0/200; LM_BUDGETS=256; LM_POLICIES=streamingllm; CODE_POLICIES=streamingllm
    LM=(task=lm task.source=code task.tokens=512 task.lm_tokens=128 block=64 "shard=$SHARD"); CODE=(task=code block=128 "shard=$SHARD")
fi

start_run
# The LM score of the last 1024 of the 2048 tokens (positions 1023-2046): every one is predicted after the first
# eviction at both budgets (from position 384 at N = 256, 640 at N = 512), so one full-cache run pairs with both.
# Worker 0: the LM full cache and five policies; worker 1: the completion task and the other two LM policies.
IFS=, read -ra LMP <<< "$LM_POLICIES"
sweep 0 "${LM[@]}" policy=full budget=null "hydra.sweep.dir=$RUNS/lm"
for i in "${!LMP[@]}"; do
    sweep $((i >= 5)) "${LM[@]}" "policy=${LMP[$i]}" "budget=$LM_BUDGETS" "hydra.sweep.dir=$RUNS/lm"
done
sweep 1 "${CODE[@]}" policy=full budget=null "hydra.sweep.dir=$RUNS/code"
sweep 1 "${CODE[@]}" "policy=$CODE_POLICIES" budget=512 "hydra.sweep.dir=$RUNS/code"
wait_workers
finish_run
