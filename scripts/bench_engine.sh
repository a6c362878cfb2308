#!/usr/bin/env bash
# The lean-engine goals' measurement (docs/bench.md "Goals"): every policy in conf/policy/ (and h2o_original) against
# HF's own loop on SmolLM2-135M-Instruct (float32, CPU) at one 4096-token prompt (the built-in filler prose),
# N = 1024, B = 128, 32 new tokens, one thread, CPU time, medians of 3 interleaved rounds (one round is noisy: a
# configuration's time moves by up to ~10 % between rounds on this machine). Writes
# results/bench_smollm2/engine_4k.{json,md}. ~15-21 CPU-min (17 on an AMD EPYC, 21 on an Intel Xeon); run it on a
# quiet machine (nothing else on the other core).
# Every policy decodes as the engine does by default: with slot reuse (no K/V copy per step; a stackable policy's
# layers evicted in one call, kvbench/engine/stack.py).
# CHRONO=1: the same, with every policy measured twice, decoding chronologically (rows NAME+chrono: each head's slots
# gathered after every eviction, how every run before slot reuse became the default decoded) and as it is, one after the
# other in each round (AdaKV, stored flat per head, leaves no hole: its NAME+chrono rows concatenate every layer per
# decoding step, its NAME rows write the token into the free rows after each head, kvbench/engine/ragged.py; SAGE-KV's
# NAME rows write it into the row its slide freed, Policy.ragged_slot_reuse): results/bench_smollm2/engine_4k_chrono.{json,md}, ~50 CPU-min. (The engine_4k_slots and
# engine_4k_stack tables were made before slot reuse was the default, by SLOTS=1 and STACK=1 modes that wrote the rows
# NAME and NAME+slots; results/bench_smollm2/RUN.md gives their commits.) POLICIES="a b ...": only these policies, each
# both ways (a shorter paired run).
# PREFILL=1: each policy of POLICIES (default: keydiff snapkv) as it is and with its prompt evictions stacked over the
# layers too (rows NAME+stackprefill, GenerationSettings.stack_prefill), one after the other in each round:
# results/bench_smollm2/engine_4k_prefill_stack.{json,md}, ~4 CPU-min per policy.
# Arguments after the first go to kvbench-bench (a later flag wins): the committed tables since engine_4k_488c3da add
# --policies ... --baselines hf --full-max-tokens 1024 --repeats 5 and --hf-beside (HF's decoding after each call) or,
# since engine_4k_lockstep_pilot_e8b7fcb, --hf-lockstep (HF's decoding step by step between the call's: the tightest
# test of the decoding goal; docs/bench.md).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/bench_smollm2}
name=engine_4k
policies=all
if [ "${CHRONO:-0}" = 1 ]; then
    name=engine_4k_chrono
    policies=""
    for p in ${POLICIES:-streamingllm random knorm keydiff tova h2o h2o_original snapkv pyramidkv criticalkv hashevict \
            adakv sagekv}; do
        policies="$policies$p+chrono,$p,"
    done
    policies="${policies%,}"
fi
if [ "${PREFILL:-0}" = 1 ]; then
    name=engine_4k_prefill_stack
    policies=""
    for p in ${POLICIES:-keydiff snapkv}; do policies="$policies$p,$p+stackprefill,"; done
    policies="${policies%,}"
fi
OMP_NUM_THREADS=1 python -m kvbench.bench --model smollm2-135m --lengths 4096 --budgets 1024 --block 128 \
    --new-tokens 32 --policies "$policies" --repeats 3 --threads 1 --clock cpu --out "$out/$name.json" "${@:2}"
