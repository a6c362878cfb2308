#!/usr/bin/env bash
# The lean-engine goals' measurement (docs/bench.md "Goals"): every policy in conf/policy/ (and h2o_original) against
# HF's own loop on SmolLM2-135M-Instruct (float32, CPU) at one 4096-token prompt (the built-in filler prose),
# N = 1024, B = 128, 32 new tokens, one thread, CPU time, medians of 3 interleaved rounds (one round is noisy: a
# configuration's time moves by up to ~10 % between rounds on this machine). Writes
# results/bench_smollm2/engine_4k.{json,md}. ~15 CPU-min; run it on a quiet machine (nothing else on the other core).
# SLOTS=1: the same, with every policy that can leave a hole measured twice, as it is and with slot reuse (rows
# NAME+slots, measured one after the other in each round; AdaKV and SAGE-KV store heads flat and never reuse a slot,
# so they run once): results/bench_smollm2/engine_4k_slots.{json,md}, ~50 CPU-min.
# STACK=1: the policies whose decoding evictions stack (Policy.stackable: every layer in one call, with slot reuse,
# kvbench/engine/stack.py), each as it is and with slot reuse: results/bench_smollm2/engine_4k_stack.{json,md},
# ~20 CPU-min.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/bench_smollm2}
name=engine_4k
policies=all
if [ "${SLOTS:-0}" = 1 ]; then
    name=engine_4k_slots
    policies=""
    for p in streamingllm random knorm keydiff tova h2o h2o_original snapkv pyramidkv criticalkv hashevict; do
        policies="$policies$p,$p+slots,"
    done
    policies="${policies}adakv,sagekv"
elif [ "${STACK:-0}" = 1 ]; then
    name=engine_4k_stack
    policies=""
    for p in streamingllm random knorm keydiff tova h2o h2o_original hashevict; do
        policies="$policies$p,$p+slots,"
    done
    policies="${policies%,}"
fi
OMP_NUM_THREADS=1 python -m kvbench.bench --model smollm2-135m --lengths 4096 --budgets 1024 --block 128 \
    --new-tokens 32 --policies "$policies" --repeats 3 --threads 1 --clock cpu --out "$out/$name.json" "${@:2}"
