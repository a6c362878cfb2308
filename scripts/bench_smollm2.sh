#!/usr/bin/env bash
# The committed side-by-side benchmark: kvbench's block-wise eviction (every policy in conf/policy/)
# against HF's own loop (one full forward; plain decoding at cache size N) on SmolLM2-135M-Instruct (fp32, CPU),
# N=1024, B=128, 32 new tokens, prompts of 2k, 4k and 8000 tokens (8000 + 32 stays inside the 8192 context).
# Writes results/bench_smollm2/bench.{json,md}: the table, the command and the goal pass/fail lines.
# Design, samples and CPU budget: results/bench_smollm2/RUN.md.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/bench_smollm2}
python -m kvbench.bench --model smollm2-135m --lengths 2k,4k,8000 --budgets 1024 --block 128 --new-tokens 32 \
    --policies all --repeats 1 --threads 1 --clock cpu --out "$out/bench.json" "${@:2}"
