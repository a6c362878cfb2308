#!/usr/bin/env bash
# Shared-work sweeps on SmolLM2-135M (issue "Shared-work sweeps"): results/bench_sweep/.
#
#   bash scripts/bench_sweep.sh [OUT]     # default OUT: results/bench_sweep
#
# Design, samples and CPU budget: results/bench_sweep/RUN.md.
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
