#!/usr/bin/env bash
# Batched samples on SmolLM2-135M-Instruct (fp32, CPU): samples per CPU-hour at K = 1, 4, 8 samples per forward for
# KeyDiff, SnapKV and StreamingLLM (N = 1024, B = 128, each sample with its own cache) next to HF's own batched
# generate (full cache), for one workload: niah (8 prompts of 1957-2048 tokens, 32 new tokens each) or longbench
# (8 prompts of 4005-4096 tokens, 256 new tokens each). Writes results/bench_smollm2/batch_<workload>.{json,md}.
# Design, samples and CPU budget: results/bench_smollm2/RUN.md.
set -euo pipefail
cd "$(dirname "$0")/.."
workload=${1:?usage: scripts/bench_batch.sh niah|longbench [out_dir] [kvbench-bench options]}
out=${2:-results/bench_smollm2}
python -m kvbench.bench --model smollm2-135m --batch 1,4,8 --workloads "$workload" --budgets 1024 --block 128 \
    --threads 1 --clock cpu --out "$out/batch_$workload.json" "${@:3}"
