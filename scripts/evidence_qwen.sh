#!/usr/bin/env bash
# The seed claims on Qwen2.5-Coder-1.5B (issue "Evidence that resolves", point 4: n >= 40 on the second model), as
# SmolLM2's evidence folders put them: a NIAH pilot that chooses the budget, the designed NIAH grid at that budget,
# the LM score on real code. Written for a GPU machine (~90 s per sample and run on this project's 2-core CPU).
#
#   WORKERS=8 scripts/evidence_qwen.sh                 # results/evidence_qwen/ (pilot, lm, niah)
#   PARTS="pilot lm niah code" ... scripts/evidence_qwen.sh   # also the real-code task (long prompts: the costliest)
#   QUICK=1 MODEL=smollm2-135m scripts/evidence_qwen.sh   # a tiny sub-grid that checks the script end to end
#
# Design, samples and CPU budget: results/evidence_qwen/RUN.md.
NAME=evidence_qwen
MODEL=${MODEL:-qwen2.5-coder-1.5b}
DYNAMIC=${DYNAMIC:-1}
source "$(dirname "$0")/lib.sh"

PARTS=${PARTS:-pilot lm niah}
NIAH_SHARDS=${NIAH_SHARDS:-0 1 2 3 4}
CODE_SHARDS=${CODE_SHARDS:-0/8 4/8}
GRID=("${DESIGNED_GRID[@]}")
PILOT_SHARD=10/11
PILOT_N=512,1024
ONCE_N=512
LM_SHARDS=${LM_SHARDS:-0/2}
LM=(task=lm task.source=code task.tokens=2048 task.limit=100 block=128 budget=1024)
CODE=(task=code block=128 budget=512)
if [[ "$QUICK" == 1 ]]; then
    GRID=(task=niah "task.context_lengths=[600]" "task.depths=[50]" task.samples_per_cell=4 task.max_new_tokens=8
          +task.windows=per_sample)
    NIAH_SHARDS="0"
    PILOT_SHARD=1/2
    PILOT_N=256
    ONCE_N=256
    LM=(task=lm task.source=code task.tokens=512 task.limit=4 block=64 budget=128)
    LM_SHARDS="0/2"
    CODE=(task=code task.limit=4 block=128 budget=512)
    CODE_SHARDS="0/2"
fi
has() { [[ " $PARTS " == *" $1 "* ]]; }

start_run
if has pilot; then
    sweep 0 "${GRID[@]}" "shard=$PILOT_SHARD" block=128 policy=full budget=null "hydra.sweep.dir=$RUNS/pilot"
    for p in keydiff tova snapkv h2o streamingllm; do
        sweep 0 "${GRID[@]}" "shard=$PILOT_SHARD" block=128 "policy=$p" "budget=$PILOT_N" "hydra.sweep.dir=$RUNS/pilot"
    done
fi
if has code; then  # (first: its commands are the longest; one policy a command, so that they run side by side)
    for s in $CODE_SHARDS; do
        for p in keydiff tova snapkv streamingllm full; do
            sweep 0 "${CODE[@]}" "shard=$s" "policy=$p" "hydra.sweep.dir=$RUNS/code"
        done
    done
fi
if has lm; then
    for s in $LM_SHARDS; do
        sweep 0 "${LM[@]}" "shard=$s" policy=full "hydra.sweep.dir=$RUNS/lm"
        sweep 0 "${LM[@]}" "shard=$s" policy=knorm "hydra.sweep.dir=$RUNS/lm"
        sweep 0 "${LM[@]}" "shard=$s" policy=random "policy.skip_layers=[0,1]" "hydra.sweep.dir=$RUNS/lm"
        sweep 0 "${LM[@]}" "shard=$s" policy=streamingllm "hydra.sweep.dir=$RUNS/lm"
    done
fi

BLOCK_N=1024
EXTRA_MD=""
if has niah; then
    wait_workers  # the pilot's runs choose the grid's budget
    if [[ -d "$RUNS/pilot" ]] && picked=$($REPORT "$RUNS/pilot" --budget-choice "$RUNS/budgets.md" --pick)
    then
        BLOCK_N=$picked
        EXTRA_MD="The block-wise runs of the grid use N = $BLOCK_N, chosen by the pilot (budgets.md)."
    else
        EXTRA_MD="No pilot budget passed (budgets.md): the block-wise runs of the grid use N = $BLOCK_N, SmolLM2's."
    fi
    for s in $NIAH_SHARDS; do
        shard="shard=$s/11"
        [[ "$QUICK" == 1 ]] && shard="shard=0/2"
        grid_claims 0 "$shard" "$RUNS/grid" "$BLOCK_N" "$ONCE_N"
    done
fi
wait_workers
finish_run
