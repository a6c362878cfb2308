#!/usr/bin/env bash
# Shared-work sweeps on SmolLM2-135M (issue "Shared-work sweeps"): results/bench_sweep/.
#
#   bash scripts/bench_sweep.sh [OUT]     # default OUT: results/bench_sweep
#
# 1. kvbench-bench --sweep: the niah_grid design (12 policies x N = 512, 1024, block-wise B = 128, 2000-token
#    prompts, 32 new tokens) and the prefill_once design (10 policies at N = 512), 3 samples each, run separately,
#    shared one run at a time (exact) and shared with the runs leaving together decoded 12 at a time, interleaved
#    sample by sample, one thread, CPU clock: smollm2.json / smollm2.md. CPU budget: ~40 CPU-min on one core.
# 2. scripts/batch_identity.py: the committed niah_grid runs (the full cache and 13 policies x 2 budgets) rerun on 3
#    of their 15 samples (shard 0/5), once as one shared-work sweep (shared_identity.md) and once one run after
#    another (alone_identity.md), every record compared field by field with the committed one; then the two reruns
#    with each other (shared_vs_alone.md). CPU budget: ~15 + ~17 CPU-min on one core.
# Steps 1 and 2 run side by side (two single-threaded processes); peak RSS and CPU time from /usr/bin/time -v, in
# the logs (scratch: results/runs/bench_sweep, git-ignored).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-results/bench_sweep}
SCRATCH=results/runs/bench_sweep
RUNS=(results/niah_grid/runs/smollm2-135m/niah/*)
mkdir -p "$OUT" "$SCRATCH"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
/usr/bin/time -v python -m kvbench.bench --model smollm2-135m --sweep niah_grid,prefill_once --fork-batch 1,12 \
    --samples 3 --threads 1 --clock cpu --out "$OUT/smollm2.json" > "$SCRATCH/bench.log" 2>&1 &
bench=$!
{
    /usr/bin/time -v python scripts/batch_identity.py --share --batch 1 --shard 0/5 --scratch "$SCRATCH/shared" \
        --out "$OUT/shared_identity.md" "${RUNS[@]}" > "$SCRATCH/shared.log" 2>&1
    /usr/bin/time -v python scripts/batch_identity.py --batch 1 --shard 0/5 --scratch "$SCRATCH/alone" \
        --out "$OUT/alone_identity.md" "${RUNS[@]}" > "$SCRATCH/alone.log" 2>&1
    python scripts/batch_identity.py --share --batch 1 --shard 0/5 --reuse --scratch "$SCRATCH/shared" \
        --reference "$SCRATCH/alone" --out "$OUT/shared_vs_alone.md" "${RUNS[@]}" > /dev/null 2>&1
} &
identity=$!
wait "$bench" && wait "$identity"
