#!/usr/bin/env bash
# The pilot of the evidence runs (issue "Evidence that resolves"): small n on samples the final runs leave out,
# to choose budgets where the policies differ and to size n by a power analysis of the paired differences
# (kvbench-report's required-n column of paired.csv).
#
#   scripts/pilot_evidence.sh            # results/pilot_evidence/
#   QUICK=1 scripts/pilot_evidence.sh    # 2 samples, 2 policies (scratch output only)
#
# Two workloads on SmolLM2-135M, block-wise B = 128:
# - the LM score on real code (task=lm source=code, the first 2048 tokens of the pinned wheels' .py files, the last
#   1024 of them scored): the full cache and 7 policies at N = 256 and 512;
# - next-line completion of real code (task=code, LongBench lcc's prompt and code_sim_score, graded = the gold
#   line's log-probability): the full cache and KeyDiff, SnapKV, TOVA, StreamingLLM at N = 512.
# Pilot samples: shard 7/40 of each task's sample order (every 40th sample from the 8th: 10 of the 393 code-LM texts,
# 6 of the 211 completion samples), which the final runs must leave out.
# CPU budget: LM 15 runs x 10 samples x ~11 s = ~30 CPU-min; code 5 runs x 6 samples x ~25 s = ~13
# CPU-min; ~45 CPU-min in all, ~25 min wall on two workers.
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
