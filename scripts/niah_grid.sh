#!/usr/bin/env bash
# Table 1: Needle in a Haystack on SmolLM2-135M-Instruct, every policy at two budgets, on the official essays.
#
#   scripts/niah_grid.sh                  # the committed table: results/niah_grid/
#   QUICK=1 scripts/niah_grid.sh          # a 2-policy, 1-cell check of the script (scratch output only)
#   PROTOCOL=prefill_once scripts/niah_grid.sh   # another eviction protocol
#
# Design, samples and CPU budget: results/niah_grid/RUN.md.
NAME=niah_grid
source "$(dirname "$0")/lib.sh"

BUDGETS=${BUDGETS:-512,1024}
POLICIES=${POLICIES:-streamingllm,random,knorm,keydiff,tova,h2o,h2o_original,snapkv,pyramidkv,adakv,criticalkv,hashevict,sagekv}
TASK=("${NIAH_2K[@]}" block=128)
if [[ "$QUICK" == 1 ]]; then
    BUDGETS=512; POLICIES=streamingllm,keydiff
    TASK=(task=niah "task.context_lengths=[1000]" "task.depths=[50]" task.samples_per_cell=2 task.max_new_tokens=32
          block=128)
fi

start_run
sweep_policies "$BUDGETS" "$POLICIES" "${TASK[@]}"
wait_workers
finish_run
