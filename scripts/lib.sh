# Shared steps of the result scripts (sourced, not run): run kvbench sweeps in parallel workers, write the
# report, copy what is committed into results/<name>/ and record how the table was made.
#
# Every script sets NAME and calls, in order:
#   start_run                     scratch dir results/runs/<name>/ (git-ignored), clock started
#   sweep <worker> <overrides...> one `kvbench --multirun` command, queued on worker <worker> (0..WORKERS-1)
#   sweep_policies <budgets> <policies> <overrides...>   the full cache plus one sweep per policy
#   wait_workers                  run the queued commands (workers in parallel, each worker's commands in order)
#   finish_run                    copy the run files into results/<name>/runs/, draw its tables from them
#                                 (scripts/tables.sh), RUN.md
#
# Environment knobs common to all scripts:
#   QUICK=1      a tiny sub-grid that checks the script end to end; output goes to results/runs/<name>-quick/
#                and results/runs/<name>-quick-out/ (nothing committed is touched)
#   PROTOCOL=... passed as `protocol=...` to every kvbench command (needs a kvbench with the protocol
#                setting; empty = kvbench's default, block-wise eviction)
#   WORKERS=2    parallel kvbench processes (2 on a 2-core machine; each gets THREADS torch threads)
#   DYNAMIC=0    1: the queued commands run in the order they were queued, WORKERS at a time, each worker taking the
#                next command when its own ends (for uneven commands on many cores, e.g. a GPU machine); the
#                <worker> given to `sweep` is then ignored. Logs: $RUNS/job-NNN.log, one per command.
#   THREADS=1    torch/OpenMP threads per worker
#   KVBENCH="python -m kvbench.cli"   the kvbench command
#   MODEL=smollm2-135m                 the model preset every command runs (scripts for another model set it)

set -euo pipefail

# The NIAH samples the NIAH grid and the NIAH claims share (so every run pairs with the grid's full cache):
# 2000-token prompts on the official essays, the needle at 10 / 50 / 90 % depth, 5 needles per cell (the classic
# one and 4 generated ones), 32 new tokens (the answer sentence is 25 tokens of SmolLM2's tokenizer).
NIAH_2K=(task=niah "task.context_lengths=[2000]" "task.depths=[10,50,90]" task.samples_per_cell=5
         task.max_new_tokens=32)
# The designed NIAH grid (scripts/pilot_niah.sh, evidence_niah.sh, evidence_qwen.sh): 2000-token prompts on the
# essays, the needle at 10 / 50 / 90 % depth, 34 samples per depth, each in its own window of the essays
# (docs/niah.md), 32 new tokens.
DESIGNED_GRID=(task=niah "task.context_lengths=[2000]" "task.depths=[10,50,90]" task.samples_per_cell=34
               task.max_new_tokens=32 +task.windows=per_sample)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
QUICK=${QUICK:-0}
PROTOCOL=${PROTOCOL:-}
WORKERS=${WORKERS:-2}
THREADS=${THREADS:-1}
KVBENCH=${KVBENCH:-python -m kvbench.cli}
MODEL=${MODEL:-smollm2-135m}
REPORT=${REPORT:-python -m kvbench.report}
DYNAMIC=${DYNAMIC:-0}
PROTO_ARGS=()
if [[ -n "$PROTOCOL" ]]; then PROTO_ARGS=("protocol=$PROTOCOL"); fi

start_run() {
    if [[ "$QUICK" == 1 ]]; then
        RUNS="results/runs/${NAME}-quick"
        OUT="results/runs/${NAME}-quick-out"
    else
        RUNS="results/runs/${NAME}"
        OUT="results/${NAME}"
    fi
    mkdir -p "$RUNS"
    QUEUE_DIR="$(mktemp -d)"
    COMMANDS=()
    T0=$(date +%s)
    LOAD0=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
    COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
    DIRTY=$(git status --porcelain --untracked-files=no -- kvbench conf 2>/dev/null | wc -l)
    echo "[$NAME] runs in $RUNS, outputs in $OUT, kvbench commit $COMMIT (dirty files: $DIRTY)"
}

# queue <worker> <command words...>: queue one command for a worker (and list it in RUN.md).
queue() {
    local worker=$1
    shift
    local line="" a
    for a in "$@"; do
        if [[ "$a" == *[\[\],\$\ \'\"]* ]]; then line+=" '$a'"; else line+=" $a"; fi
    done
    COMMANDS+=("${line# }")
    local file="$QUEUE_DIR/worker$((worker % WORKERS)).sh"
    [[ "$DYNAMIC" == 1 ]] && file="$QUEUE_DIR/all.sh"  # one queue, in order (run_dynamic)
    printf '%q ' "$@" >> "$file"
    printf '\n' >> "$file"
}

# sweep <worker> <kvbench overrides...>: queue one kvbench multirun command for a worker.
sweep() {
    local worker=$1
    shift
    # shellcheck disable=SC2086  # KVBENCH is a command line of several words
    queue "$worker" $KVBENCH -m "model=$MODEL" "$@" "${PROTO_ARGS[@]}" progress=false
}

# sweep_policies <budgets> <policies,comma,separated> <kvbench overrides...>: the full cache on worker 0, then
# one sweep per policy over <budgets>, the policies dealt to the workers in turn (K-norm, the slowest at long
# prompts, and the attention-scored policies land on different workers).
sweep_policies() {
    local budgets=$1 policies=$2 i
    shift 2
    sweep 0 "$@" policy=full budget=null "hydra.sweep.dir=$RUNS"
    IFS=, read -ra PLIST <<< "$policies"
    for i in "${!PLIST[@]}"; do
        sweep $((i + 1)) "$@" "policy=${PLIST[$i]}" "budget=$budgets" "hydra.sweep.dir=$RUNS"
    done
}

# grid_claims <worker> <shard override> <dir> <block-wise N> <one-pass N>: queue every seed claim but K-norm's on
# one shard of the grid "${GRID[@]}" (the calling script's), each under its paper's protocol, each claim's runs in
# <dir>/<claim>/ (their protocols and options differ): the full cache, KeyDiff, TOVA, SnapKV, H2O and StreamingLLM
# block-wise; HashEvict and H2O with the same protected tokens (4 first, 10 latest: HashEvict §4) block-wise;
# SnapKV (max pooling) and CriticalKV, AdaKV and CriticalKV on AdaKV under prefill_once; SAGE-KV and StreamingLLM
# under prefill_once_decode_evict. The longest command (five runs sharing their prompt blocks) first.
grid_claims() {
    local w=$1 shard=$2 dir=$3 block_n=$4 once_n=$5
    local bw=("${GRID[@]}" "$shard" protocol=blockwise block=128) once=("${GRID[@]}" "$shard" protocol=prefill_once)
    sweep "$w" "${bw[@]}" policy=keydiff,tova,snapkv,h2o,streamingllm "budget=$block_n" "hydra.sweep.dir=$dir/keydiff"
    sweep "$w" "${bw[@]}" policy=full budget=null "hydra.sweep.dir=$dir/keydiff"
    sweep "$w" "${bw[@]}" policy=hashevict "budget=$block_n" "hydra.sweep.dir=$dir/hashevict_h2o"
    # (One policy per command where a policy option is set: Hydra applies non-sweep overrides to the default policy
    # before it expands a policy sweep.)
    sweep "$w" "${bw[@]}" policy=h2o policy.n_sink=4 policy.n_recent=10 "budget=$block_n" \
        "hydra.sweep.dir=$dir/hashevict_h2o"
    sweep "$w" "${once[@]}" policy=snapkv policy.pooling=max "budget=$once_n" "hydra.sweep.dir=$dir/criticalkv_snapkv"
    sweep "$w" "${once[@]}" policy=criticalkv "budget=$once_n" "hydra.sweep.dir=$dir/criticalkv_snapkv"
    sweep "$w" "${once[@]}" policy=adakv "budget=$once_n" "hydra.sweep.dir=$dir/criticalkv_adakv"
    sweep "$w" "${once[@]}" policy=criticalkv policy.base=adakv "budget=$once_n" "hydra.sweep.dir=$dir/criticalkv_adakv"
    sweep "$w" "${GRID[@]}" "$shard" protocol=prefill_once_decode_evict policy=sagekv,streamingllm "budget=$once_n" \
        "hydra.sweep.dir=$dir/sagekv_streamingllm"
}

# wait_workers: run what is queued (and empty the queue, so that a script may queue and wait again).
wait_workers() {
    local pids=() failed=0
    if [[ "$DYNAMIC" == 1 ]]; then
        run_dynamic
        return
    fi
    for q in "$QUEUE_DIR"/worker*.sh; do
        [[ -f "$q" ]] || continue
        local log="$RUNS/$(basename "$q" .sh).log"
        echo "[$NAME] $(basename "$q" .sh): $(wc -l < "$q") commands, log $log"
        OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS bash -e "$q" >> "$log" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || failed=1; done
    rm -f "$QUEUE_DIR"/worker*.sh
    if [[ $failed != 0 ]]; then
        echo "[$NAME] a worker failed; see $RUNS/worker*.log" >&2
        exit 1
    fi
}

run_dynamic() {
    local line failed=0
    [[ -f "$QUEUE_DIR/all.sh" ]] || return 0
    echo "[$NAME] $(wc -l < "$QUEUE_DIR/all.sh") commands, $WORKERS at a time, logs $RUNS/job-*.log"
    while IFS= read -r line; do
        JOBS_RUN=$((${JOBS_RUN:-0} + 1))
        while (( $(jobs -rp | wc -l) >= WORKERS )); do wait -n || failed=1; done
        OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS bash -e -c "$line" \
            >> "$RUNS/job-$(printf %03d "$JOBS_RUN").log" 2>&1 &
    done < "$QUEUE_DIR/all.sh"
    while (( $(jobs -rp | wc -l) > 0 )); do wait -n || failed=1; done
    rm -f "$QUEUE_DIR/all.sh"
    if [[ $failed != 0 ]]; then
        echo "[$NAME] a command failed; see $RUNS/job-*.log" >&2
        exit 1
    fi
}

finish_run() {
    local t1 wall cpu
    t1=$(date +%s)
    wall=$((t1 - T0))
    times > "$QUEUE_DIR/times"  # (not in $(...): a subshell has no children) the second line: every kvbench process
    cpu=$(tail -1 "$QUEUE_DIR/times" | awk '{print $1" user, "$2" sys"}')
    mkdir -p "$OUT"
    rm -rf "$OUT/runs"
    # Each run's resolved config, scores and predictions (small), under the same relative paths; the tables are drawn
    # from this copy (scripts/tables.sh), so the committed tables come from the committed runs alone.
    (cd "$RUNS" && find . -name metrics.json -printf '%h\n') | while read -r d; do
        mkdir -p "$OUT/runs/$d"
        for f in config.yaml metrics.json predictions.jsonl; do
            [[ -f "$RUNS/$d/$f" ]] && cp "$RUNS/$d/$f" "$OUT/runs/$d/$f"
        done
    done
    bash scripts/tables.sh "$NAME" "$OUT"
    EXTRA_MD=${EXTRA_MD:-}
    {
        echo "# How \`$OUT\` was made"
        echo
        echo "- script: \`scripts/$(basename "$0")\`$([[ "$QUICK" == 1 ]] && echo " (QUICK=1)")"
        echo "- kvbench commit: \`$COMMIT\`$([[ "$DIRTY" != 0 ]] && echo " (with $DIRTY uncommitted changes in kvbench/ or conf/)")"
        echo "- finished: $(date -u +%Y-%m-%dT%H:%MZ); wall time: $((wall / 60)) min $((wall % 60)) s; CPU time of the kvbench processes: $cpu"
        echo "- machine: $(nproc --all) CPU cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), $WORKERS workers x $THREADS threads; load average at start $LOAD0, at end $(cut -d' ' -f1-3 /proc/loadavg)"
        echo "- protocol override: ${PROTOCOL:-none (kvbench default: block-wise eviction after every prompt block and decoding step)}"
        echo
        echo "Commands (the scratch directory \`$RUNS\` is git-ignored; \`runs/\` here holds each run's config, metrics and predictions):"
        echo
        echo '```bash'
        for c in "${COMMANDS[@]}"; do echo "$c"; done
        echo "bash scripts/tables.sh $NAME $OUT   # kvbench-report on $OUT/runs, and this folder's other tables"
        echo '```'
        if [[ -n "$EXTRA_MD" ]]; then echo; echo "$EXTRA_MD"; fi
    } > "$OUT/RUN.md"
    rm -rf "$QUEUE_DIR"
    echo "[$NAME] done in $((wall / 60)) min $((wall % 60)) s -> $OUT"
}
