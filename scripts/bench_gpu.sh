#!/usr/bin/env bash
# kvbench's engine on a GPU, side by side with HF's own loop: `kvbench-bench` on CUDA, bfloat16, wall clock (each
# timer synchronises the device), every policy in conf/policy/, >= 3 interleaved rounds (medians).
#
#   bash scripts/bench_gpu.sh OUT CONFIG_DIR [part ...]
#
# CONFIG_DIR: a directory holding SmolLM2-135M-Instruct's config.json (the converted model's, e.g. the kvbench model
# cache's entry for smollm2-135m): its geometry (30 layers, 9/3 heads, head_dim 64) with random weights, since a GPU
# machine without the package registry cannot convert the GGUF. Speed and memory do not depend on what the weights
# know (docs/bench.md); greedy tokens of random weights are meaningless, so no prediction is compared here.
# Parts (default: the first three). A 4k-token part of every policy took ~4 min on an H100, and block-wise prefill time
# grows with the number of blocks, so the long parts time a subset of policies (one of each kind of score:
# key-only, attention window, accumulated attention, per-head budgets) to end inside one 10-minute device call.
#   smollm2-4k   issue 29's setting: 4k-token prompt, N = 1024, B = 128, 32 new tokens, every policy
#   smollm2-16k  a long prompt: 16k tokens, N = 4096, B = 128; keydiff, snapkv, h2o, adakv
#   llama3b-16k  Llama-3.2-3B's geometry (tiny-llama3 at its full 28 layers, 24/8 heads, head_dim 128): 16k, N = 4096
#   smollm2-4k-stack  smollm2-4k's setting for the policies whose decoding evictions stack (Policy.stackable), each
#                decoding chronologically (rows NAME+chrono: one eviction per layer per step) and as it is (slot
#                reuse, the default: one eviction call for all layers per decoding step, kvbench/engine/stack.py),
#                one after the other in each round; ~3 min on an H100 for the eight before SnapKV (69cadc6) and
#                CriticalKV (60d6daf) joined them, ~4 min on an H200 for all ten (scripts/stack_pairs.py pairs them)
#   smollm2-niah-batch  samples per hour at batch 1 and 8 (--batch, one round) on the NIAH-shaped workload (8 prompts
#                of 1957-2048 random tokens, 32 new tokens, N = 1024, B = 128) for five stackable policies, each
#                twice: a batch's decoding evictions in one call for all its samples (the default, SampleStacks) and
#                each sample on its own (rows NAME+alone), next to HF's batched generate; ~2-3 min on an H100
#   smollm2-4k-prefill-stack  smollm2-4k's setting for five stackable policies, each as it is and with its prompt
#                evictions stacked over the layers too (rows NAME+stackprefill: GenerationSettings.stack_prefill, off
#                by default; SnapKV's prompt slower with it on the CPU, meant for a GPU), one after the other in each
#                round
#   smollm2-4k-ragged  smollm2-4k's setting for the policies with per-head budgets (ragged layers: AdaKV, SAGE-KV),
#                each with the free rows after each head's segment (the default with slot reuse, dd7555d) and in the
#                compact layout (rows NAME+chrono: every decoding step copies each layer to append), one after the
#                other in each round, next to HF's loop (scripts/stack_pairs.py --way "free rows" pairs them)
# Each part writes OUT/<part>.json and OUT/<part>.md (the table, the command, the goal lines).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
    echo "usage: bash scripts/bench_gpu.sh OUT CONFIG_DIR [smollm2-4k|smollm2-16k|llama3b-16k|smollm2-4k-stack|smollm2-niah-batch|smollm2-4k-prefill-stack|smollm2-4k-ragged ...]" >&2
    exit 2
fi
out=$1 config=$2
shift 2
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(smollm2-4k smollm2-16k llama3b-16k)
for part in "${parts[@]}"; do  # every part checked before anything is written
    case $part in
        smollm2-4k|smollm2-16k|llama3b-16k|smollm2-4k-stack|smollm2-niah-batch|smollm2-4k-prefill-stack) ;;
        smollm2-4k-ragged) ;;
        *) echo "bench_gpu.sh: unknown part '$part' (smollm2-4k, smollm2-16k, llama3b-16k, smollm2-4k-stack," \
                "smollm2-niah-batch, smollm2-4k-prefill-stack, smollm2-4k-ragged)" >&2
           exit 2 ;;
    esac
done
mkdir -p "$out"
common=(--device cuda --dtype bfloat16 --clock wall --block 128 --new-tokens 32 --repeats 3
        --baselines full,hf,streamingllm)
few=keydiff,snapkv,h2o,adakv
stack=""
for p in streamingllm random knorm keydiff tova h2o h2o_original hashevict snapkv criticalkv; do stack="$stack$p+chrono,$p,"; done
batch=""
for p in streamingllm keydiff tova h2o hashevict; do batch="$batch$p,$p+alone,"; done
prefill=""
for p in keydiff tova h2o snapkv criticalkv; do prefill="$prefill$p,$p+stackprefill,"; done
for part in "${parts[@]}"; do
    case $part in
        smollm2-4k) args=(--config "$config" --lengths 4k --budgets 1024 --policies all) ;;
        smollm2-16k) args=(--config "$config" --lengths 16k --budgets 4096 --policies $few) ;;
        llama3b-16k) args=(--arch tiny-llama3 --layers 28 --lengths 16k --budgets 4096 --policies $few) ;;
        smollm2-4k-stack) args=(--config "$config" --lengths 4k --budgets 1024 --policies "${stack%,}") ;;
        smollm2-niah-batch) args=(--config "$config" --batch 1,8 --workloads niah --budgets 1024 --policies "${batch%,}") ;;
        smollm2-4k-prefill-stack) args=(--config "$config" --lengths 4k --budgets 1024 --policies "${prefill%,}") ;;
        smollm2-4k-ragged) args=(--config "$config" --lengths 4k --budgets 1024
                                 --policies adakv+chrono,adakv,sagekv+chrono,sagekv --baselines hf) ;;
    esac
    python3 -m kvbench.bench "${common[@]}" "${args[@]}" --out "$out/$part.json" --quiet
done
