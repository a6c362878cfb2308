#!/usr/bin/env bash
# The lean-engine goals' measurement (docs/bench.md "Goals"): every policy in conf/policy/ (and h2o_original) against
# HF's own loop on SmolLM2-135M-Instruct (float32, CPU) at one 4096-token prompt (the built-in filler prose),
# N = 1024, B = 128, 32 new tokens, one thread, CPU time, medians of 3 interleaved rounds (one round is noisy: a
# configuration's time moves by up to ~10 % between rounds on this machine). Writes
# results/bench_smollm2/engine_4k.{json,md}. ~15 CPU-min; run it on a quiet machine (nothing else on the other core).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/bench_smollm2}
OMP_NUM_THREADS=1 python -m kvbench.bench --model smollm2-135m --lengths 4096 --budgets 1024 --block 128 \
    --new-tokens 32 --policies all --repeats 3 --threads 1 --clock cpu --out "$out/engine_4k.json" "${@:2}"
