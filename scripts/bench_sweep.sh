#!/usr/bin/env bash
# Shared-work sweeps on SmolLM2-135M (issue "Shared-work sweeps"): results/bench_sweep/.
#
#   bash scripts/bench_sweep.sh [OUT]     # default OUT: results/bench_sweep
#
# 1. kvbench-bench --sweep: the niah_grid design (12 policies x N = 512, 1024, block-wise B = 128, 2000-token
#    prompts, 32 new tokens) and the prefill_once design (10 policies at N = 512), 3 samples each, run separately,
#    shared one run at a time (exact) and shared with the runs leaving together decoded 12 at a time, interleaved
#    sample by sample, one thread, CPU clock: smollm2.json / smollm2.md. CPU budget: ~35 CPU-min on one core.
# 2. scripts/batch_identity.py --share: the committed niah_grid runs (the full cache and 13 policies x 2 budgets)
#    rerun on 3 of their 15 samples (shard 0/5) as one shared-work sweep, every record compared field by field with
#    the committed one: shared_identity.md. CPU budget: ~15 CPU-min on one core.
# The two run side by side (two single-threaded processes); their peak RSS is /usr/bin/time's, in the logs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-results/bench_sweep}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
/usr/bin/time -v python -m kvbench.bench --model smollm2-135m --sweep niah_grid,prefill_once --fork-batch 1,12 \
    --samples 3 --threads 1 --clock cpu --out "$OUT/smollm2.json" > "$OUT/smollm2.log" 2>&1 &
bench=$!
/usr/bin/time -v python scripts/batch_identity.py --share --batch 1 --shard 0/5 --out "$OUT/shared_identity.md" \
    results/niah_grid/runs/smollm2-135m/niah/* > "$OUT/shared_identity.log" 2>&1 &
identity=$!
wait "$bench" && wait "$identity"
