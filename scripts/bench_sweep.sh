#!/usr/bin/env bash
# Shared-work sweeps on SmolLM2-135M (the static engine's shared trunks): results/bench_sweep/static_*.
#
#   bash scripts/bench_sweep.sh [OUT]     # default OUT: results/bench_sweep
#   PREFILL_ONCE=1 bash scripts/bench_sweep.sh [OUT]   # the prefill_once design alone: OUT/static_prefill_once.*
#   TOGETHER=1 bash scripts/bench_sweep.sh [OUT]   # decoding together (share_rows=decode): OUT/together_*
#       (a pilot, niah_grid beside six_policies; then niah_grid's final look beside prefill_once's pilot and a rerun
#       of the committed niah_grid runs as one group; then prefill_once's final look)
#
# Design, samples and CPU budget: results/bench_sweep/RUN.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-results/bench_sweep}
SCRATCH=results/runs/bench_sweep
RUNS=(results/niah_grid/runs/smollm2-135m/niah/*)
mkdir -p "$OUT" "$SCRATCH"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
BENCH=(python -m kvbench.bench --model smollm2-135m --samples 3 --threads 1 --clock cpu)
IDENTITY=(python scripts/batch_identity.py --batch 1 --shard 0/5)
if [ "${PREFILL_ONCE:-0}" = 1 ]; then
    /usr/bin/time -v "${BENCH[@]}" --sweep prefill_once --fork-batch 1 --out "$OUT/static_prefill_once.json" \
        > "$OUT/static_prefill_once.log" 2>&1
    exit
fi
if [ "${TOGETHER:-0}" = 1 ]; then  # a cache each, every cache's decoding steps as one forward (share_rows=decode)
    together() {  # DESIGN NAME [OPTION...]: its bench, decoding together, into OUT/NAME.*
        /usr/bin/time -v "${BENCH[@]}" --sweep "$1" --fork-batch 1 --together "${@:3}" --out "$OUT/$2.json" \
            > "$OUT/$2.log" 2>&1
    }
    # the pilot: 3 samples a design, niah_grid beside six_policies
    together niah_grid together_niah_grid & first=$!
    together six_policies together_six_policies & second=$!
    wait "$first" && wait "$second"
    # niah_grid's final look (6 other samples: n from the pilot's power analysis, RUN.md) beside prefill_once's pilot
    # and the committed niah_grid runs rerun as one group (share_rows auto on a CPU: decode)
    together niah_grid together_niah_grid_final --samples 6 --seed 10 & first=$!
    {
        together prefill_once together_prefill_once
        /usr/bin/time -v "${IDENTITY[@]}" --share --scratch "$SCRATCH/together" --out "$OUT/together_identity.md" \
            "${RUNS[@]}" > "$OUT/together_identity.log" 2>&1
    } & second=$!
    wait "$first" && wait "$second"
    # prefill_once's final look, alone (16 other samples: n from its pilot's power analysis, RUN.md)
    together prefill_once together_prefill_once_final --samples 16 --seed 20
    exit
fi
{
    /usr/bin/time -v "${BENCH[@]}" --sweep niah_grid,prefill_once --fork-batch 1,12 \
        --out "$OUT/static_smollm2.json" > "$SCRATCH/bench.log" 2>&1
    /usr/bin/time -v "${IDENTITY[@]}" --scratch "$SCRATCH/alone" --out "$OUT/static_alone_identity.md" "${RUNS[@]}" \
        > "$SCRATCH/alone.log" 2>&1
} &
first=$!
{
    /usr/bin/time -v "${BENCH[@]}" --sweep six_policies --fork-batch 1,0 --out "$OUT/static_six_policies.json" \
        > "$SCRATCH/six.log" 2>&1
    /usr/bin/time -v "${IDENTITY[@]}" --share --scratch "$SCRATCH/shared" --out "$OUT/static_shared_identity.md" \
        "${RUNS[@]}" > "$SCRATCH/shared.log" 2>&1
} &
second=$!
wait "$first" && wait "$second"
"${IDENTITY[@]}" --share --reuse --scratch "$SCRATCH/shared" --reference "$SCRATCH/alone" \
    --out "$OUT/static_shared_vs_alone.md" "${RUNS[@]}" > /dev/null
