#!/usr/bin/env bash
# kvbench's engine on a GPU beside HF's own loop: `kvbench-bench` on CUDA, bfloat16, wall clock (each timer syncs the
# device), >= 3 interleaved rounds (medians). A part takes a few minutes (the previous engine's eager ones 170-250 s
# on an H100): give each its own call, the most wanted first, OUT under the device's $OUT: a part stopped by the
# call's time limit leaves the rounds it finished there (kvbench-bench rewrites its files after each round), and its
# round lines in the call's output.   bash scripts/bench_gpu.sh OUT CONFIG_DIR [part ...]
#
# CONFIG_DIR: a directory holding SmolLM2-135M-Instruct's config.json (e.g. the kvbench model cache's entry for
# smollm2-135m): its geometry with random weights, since a GPU machine without the package registry cannot convert
# the GGUF. Speed and memory do not depend on what the weights know; greedy tokens of random weights are meaningless,
# so no prediction is compared here. Parts (default: all five, in this order):
#   llama3b-16k   issue 62's setting: Llama-3.2-3B's geometry (tiny-llama3 at its 28 layers, 24/8 heads, head_dim 128),
#                 16k-token prompt, N = 4096, B = 128, every policy eager, next to HF's one forward and its decoding
#   compiled      llama3b-16k's setting, StreamingLLM and KeyDiff eager beside compiled (rows NAME+compiled: each
#                 block and decoding step one CUDA graph; each policy compiles its own graphs in its warm-up call, and
#                 a 28-layer model's take minutes: two policies a part)
#   batch8        runs per hour of 8 prompts as the rows of one cache against one at a time (--batch 1,8), NIAH-shaped
#                 workload, N = 1024, B = 128, four policies
#   compiled-attention  the same for SnapKV and H2O (the policies that read attention)
#   smollm2-4k    SmolLM2's geometry, 4k-token prompt, N = 1024, B = 128, every policy eager
# Each part writes OUT/<part>.json and OUT/<part>.md (the table, the command, the goal lines). DRY=1 prints each
# part's command instead of running it (tests/test_script_help.py parses them).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
    echo "usage: bash scripts/bench_gpu.sh OUT CONFIG_DIR [llama3b-16k|compiled|batch8|compiled-attention|smollm2-4k]..." \
        >&2
    exit 2
fi
out=$1 config=$2
shift 2
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(llama3b-16k compiled batch8 compiled-attention smollm2-4k)
for part in "${parts[@]}"; do  # every part checked before anything is written
    case $part in
        llama3b-16k|compiled|batch8|compiled-attention|smollm2-4k) ;;
        *) echo "bench_gpu.sh: unknown part '$part' (llama3b-16k, compiled, batch8, compiled-attention, smollm2-4k)" >&2
           exit 2 ;;
    esac
done
mkdir -p "$out"
common=(--device cuda --dtype bfloat16 --clock wall --block 128 --new-tokens 32 --repeats 3)
every=streamingllm,random,knorm,keydiff,tova,h2o,hashevict,snapkv,pyramidkv,adakv,criticalkv,sagekv
llama3b=(--arch tiny-llama3 --layers 28 --lengths 16k --budgets 4096)
for part in "${parts[@]}"; do
    case $part in
        llama3b-16k) args=("${llama3b[@]}" --policies "$every" --baselines full,hf) ;;
        batch8) args=(--config "$config" --batch 1,8 --workloads niah --budgets 1024
                      --policies streamingllm,keydiff,snapkv,h2o) ;;
        compiled) args=("${llama3b[@]}" --baselines hf --policies streamingllm,keydiff --compiled) ;;
        compiled-attention) args=("${llama3b[@]}" --baselines hf --policies snapkv,h2o --compiled) ;;
        smollm2-4k) args=(--config "$config" --lengths 4k --budgets 1024 --policies "$every" --baselines full,hf) ;;
    esac
    ${DRY:+echo} python3 -m kvbench.bench "${common[@]}" "${args[@]}" --out "$out/$part.json"
done
