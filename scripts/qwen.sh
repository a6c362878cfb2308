#!/usr/bin/env bash
# The second real model: Qwen2.5-Coder-1.5B-Instruct (11x SmolLM2-135M, another family, 2 KV heads), the NIAH
# slice where its full cache succeeds, the seed papers' claims at the budgets SmolLM2's claims ran, and a
# kvbench-bench row set at 2k/8k next to HF's own loop. Writes results/qwen2.5-coder-1.5b/ (tables, claims.md,
# bench.json/md, runs/).
#
#   kvbench-fetch qwen2.5-coder-1.5b      # once (1.1 GB download, ~9 GB RAM to convert)
#   scripts/qwen.sh
#   QUICK=1 MODEL=smollm2-135m scripts/qwen.sh   # the script end to end on SmolLM2, tiny cells (scratch only)
#
# Design, samples and CPU budget: results/qwen2.5-coder-1.5b/RUN.md.
MODEL=${MODEL:-qwen2.5-coder-1.5b}
NAME=qwen2.5-coder-1.5b
source "$(dirname "$0")/lib.sh"

ALL=("${NIAH_2K[@]}")
SLICE=(task=niah "task.context_lengths=[2000]" "task.depths=[10,90]" task.samples_per_cell=5 task.max_new_tokens=32)
BLOCKWISE=(protocol=blockwise block=128)
BENCH=(--lengths 2k,8000 --budgets 1024 --block 128 --new-tokens 32 --policies keydiff,snapkv
       --baselines hf,streamingllm --repeats 1 --threads 1 --clock cpu --no-syncs)
if [[ "$QUICK" == 1 ]]; then
    ALL=(task=niah "task.context_lengths=[1000]" "task.depths=[10,50]" task.samples_per_cell=1 task.max_new_tokens=8)
    SLICE=(task=niah "task.context_lengths=[1000]" "task.depths=[10]" task.samples_per_cell=1 task.max_new_tokens=8)
    BENCH=(--lengths 512 --budgets 256 --block 64 --new-tokens 4 --policies keydiff --baselines hf --repeats 1
           --threads 1 --clock cpu --no-syncs)
fi
KD_BUDGETS=${KD_BUDGETS:-512}; KNORM_BUDGETS=${KNORM_BUDGETS:-1024}; CKV_BUDGETS=${CKV_BUDGETS:-512}
SAGE_BUDGETS=${SAGE_BUDGETS:-512}
[[ "$QUICK" == 1 ]] && { KD_BUDGETS=256; KNORM_BUDGETS=256; CKV_BUDGETS=256; SAGE_BUDGETS=256; }

start_run
# Worker 0: the full cache (all depths), then KeyDiff's rivals, then K-norm vs Random, then the bench.
# Worker 1: SnapKV block-wise, then the prefill_once claims. (~100 CPU-min each before the bench.)
sweep 0 "${ALL[@]}" "${BLOCKWISE[@]}" policy=full budget=null "hydra.sweep.dir=$RUNS/niah"
sweep 1 "${SLICE[@]}" "${BLOCKWISE[@]}" policy=snapkv "budget=$KD_BUDGETS" "hydra.sweep.dir=$RUNS/niah"
sweep 0 "${SLICE[@]}" "${BLOCKWISE[@]}" policy=keydiff "budget=$KD_BUDGETS" "hydra.sweep.dir=$RUNS/niah"
sweep 1 "${SLICE[@]}" protocol=prefill_once_decode_evict policy=sagekv,streamingllm "budget=$SAGE_BUDGETS" \
    "hydra.sweep.dir=$RUNS/sagekv_streamingllm"
sweep 0 "${SLICE[@]}" "${BLOCKWISE[@]}" policy=tova "budget=$KD_BUDGETS" "hydra.sweep.dir=$RUNS/niah"
sweep 1 "${SLICE[@]}" protocol=prefill_once policy=snapkv policy.pooling=max "budget=$CKV_BUDGETS" \
    "hydra.sweep.dir=$RUNS/criticalkv_snapkv"
sweep 1 "${SLICE[@]}" protocol=prefill_once policy=criticalkv "budget=$CKV_BUDGETS" \
    "hydra.sweep.dir=$RUNS/criticalkv_snapkv"
sweep 0 "${SLICE[@]}" "${BLOCKWISE[@]}" policy=h2o "budget=$KD_BUDGETS" "hydra.sweep.dir=$RUNS/niah"
sweep 0 "${SLICE[@]}" protocol=prefill_once policy=knorm "budget=$KNORM_BUDGETS" "hydra.sweep.dir=$RUNS/knorm_random"
sweep 0 "${SLICE[@]}" protocol=prefill_once policy=random "policy.skip_layers=[0,1]" "budget=$KNORM_BUDGETS" \
    "hydra.sweep.dir=$RUNS/knorm_random"
sweep 1 "${SLICE[@]}" protocol=prefill_once policy=adakv "budget=$CKV_BUDGETS" "hydra.sweep.dir=$RUNS/criticalkv_adakv"
sweep 1 "${SLICE[@]}" protocol=prefill_once policy=criticalkv policy.base=adakv "budget=$CKV_BUDGETS" \
    "hydra.sweep.dir=$RUNS/criticalkv_adakv"
# The full cache once more on the slice alone: kvbench-report pairs runs only when their task settings are identical
# (depths [10,90] vs [10,50,90] are other sample sets to it), so this run is what table.md's "against the full
# cache" rows compare with. The same 10 samples as the all-depths run, recomputed (~15 CPU-min).
sweep 1 "${SLICE[@]}" "${BLOCKWISE[@]}" policy=full budget=null "hydra.sweep.dir=$RUNS/full_slice"
queue 0 python -m kvbench.bench --model "$MODEL" "${BENCH[@]}" --out "$RUNS/bench/bench.json"
wait_workers

EXTRA_MD="Claims table: \`kvbench-report $OUT/runs --claims $OUT/runs/niah - --out $OUT\` (no RULER runs on this model) and the side-by-side table, both part of scripts/tables.sh."
finish_run
cp "$RUNS"/bench/bench.json "$RUNS"/bench/bench.md "$OUT"/
