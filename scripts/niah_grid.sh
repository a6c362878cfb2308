#!/usr/bin/env bash
# Table 1: Needle in a Haystack on SmolLM2-135M-Instruct, length x depth, every policy at two budgets.
#
#   scripts/niah_grid.sh                  # the committed table: results/niah_grid/
#   QUICK=1 scripts/niah_grid.sh          # a 2-policy, 1-cell check of the script (scratch output only)
#   PROTOCOL=prefill_once scripts/niah_grid.sh   # another eviction protocol (kvbench with `protocol`)
#
# Grid: context lengths 500/1000/2000/4000 tokens x depths 0/25/50/75/100 %, the built-in filler haystack,
# substring scoring; the full cache once, and all twelve evicting policies at N = 256 and
# N = 1024 (block B = 128). 32 new tokens: the full answer sentence is 25 tokens of SmolLM2's tokenizer.
# 8000-token contexts are left out: one 8k sample costs about as much as the 500-4000 samples of its depth
# together (results/README.md gives the measured costs).
NAME=niah_grid
source "$(dirname "$0")/lib.sh"

LENGTHS=${LENGTHS:-[500,1000,2000,4000]}
DEPTHS=${DEPTHS:-[0,25,50,75,100]}
BUDGETS=${BUDGETS:-256,1024}
POLICIES=${POLICIES:-streamingllm,random,knorm,keydiff,tova,h2o,snapkv,pyramidkv,adakv,criticalkv,hashevict,sagekv}
if [[ "$QUICK" == 1 ]]; then
    LENGTHS=[500]; DEPTHS=[50]; BUDGETS=256; POLICIES=streamingllm,keydiff
fi
TASK=(task=niah "task.context_lengths=$LENGTHS" "task.depths=$DEPTHS" task.max_new_tokens=32 block=128)

start_run
sweep_policies "$BUDGETS" "$POLICIES" "${TASK[@]}"
wait_workers
finish_run
python scripts/niah_heatmaps.py "$RUNS" "$OUT"
