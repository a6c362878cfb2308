#!/usr/bin/env bash
# The engine goals' CPU measurement (docs/bench.md): every policy in conf/policy/ against HF's own loop on
# SmolLM2-135M-Instruct (float32, CPU) at one 4096-token prompt (the built-in filler prose), N = 1024, B = 128,
# 32 new tokens, one thread, CPU time, medians of 3 interleaved rounds, HF's decoding step by step between the call's
# (--hf-lockstep). Writes OUT/engine_4k.{json,md} (OUT default results/bench_smollm2). Run it on a quiet machine.
# COMPILED=1: each policy of POLICIES (default: streamingllm keydiff snapkv) eager and compiled (rows NAME+compiled:
# each forward with its eviction as one torch.compile graph), one after the other in each round:
# OUT/engine_4k_compiled.{json,md}.
# OPS=1: the launch and reading goals instead (aten ops and kvbench functions per forward, counted, not timed; a
# 28-layer tiny Llama: the width changes no count): OUT/engine_ops_28layers.{json,md}.
# Arguments after the first go to kvbench-bench (a later flag wins).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/bench_smollm2}
name=engine_4k
policies=all
if [ "${OPS:-0}" = 1 ]; then
    exec python -m kvbench.bench --arch tiny-llama --layers 28 --ops --policies all --budgets 1024 --block 128 \
        --baselines none --out "$out/engine_ops_28layers.json" "${@:2}"
fi
if [ "${COMPILED:-0}" = 1 ]; then
    name=engine_4k_compiled
    policies=""
    for p in ${POLICIES:-streamingllm keydiff snapkv}; do policies="$policies$p,$p+compiled,"; done
    policies="${policies%,}"
fi
OMP_NUM_THREADS=1 python -m kvbench.bench --model smollm2-135m --lengths 4096 --budgets 1024 --block 128 \
    --new-tokens 32 --policies "$policies" --repeats 3 --threads 1 --clock cpu --baselines hf --hf-lockstep \
    --out "$out/$name.json" "${@:2}"
