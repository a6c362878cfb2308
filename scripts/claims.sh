#!/usr/bin/env bash
# Table 3: the seed papers' qualitative claims put to the test on SmolLM2-135M-Instruct, each under its paper's
# protocol where kvbench and a 135M model allow. Writes results/claims/claims.md (claim, paper, setting, numbers,
# holds?) from the runs below plus the NIAH grid (scripts/niah_grid.sh) and the RULER table (scripts/ruler_4k.sh).
#
#   scripts/claims.sh                 # after scripts/niah_grid.sh (and ideally scripts/ruler_4k.sh)
#   QUICK=1 scripts/claims.sh         # one 500-token cell per configuration (scratch output only)
#
# Design, samples and CPU budget: results/claims/RUN.md.
NAME=claims
source "$(dirname "$0")/lib.sh"

if grep -q '^protocol:' conf/config.yaml; then HAS_PROTOCOL=1; else HAS_PROTOCOL=0; fi
# protocol NAME: the overrides that select a paper's protocol on this kvbench.
protocol() {
    if [[ "$HAS_PROTOCOL" == 1 ]]; then
        if [[ "$1" == blockwise ]]; then echo "protocol=blockwise block=128"; else echo "protocol=$1"; fi
    elif [[ "$1" == blockwise ]]; then echo "block=128"
    else echo "block=null"; fi
}
[[ -n "$PROTOCOL" ]] && echo "[claims] PROTOCOL=$PROTOCOL is ignored: each claim uses its paper's protocol" >&2
PROTO_ARGS=()

NIAH=("${NIAH_2K[@]}")
RULER=(task=ruler "task.tasks=[niah_multikey_1]" "task.lengths=[4096]" task.num_samples=${SAMPLES:-10})
KNORM_BUDGETS=${KNORM_BUDGETS:-1024}; CKV_BUDGETS=${CKV_BUDGETS:-512}; SAGE_BUDGETS=${SAGE_BUDGETS:-512}
HASH_BUDGETS=${HASH_BUDGETS:-1229}
if [[ "$QUICK" == 1 ]]; then
    NIAH=(task=niah "task.context_lengths=[1000]" "task.depths=[50]" task.samples_per_cell=2 task.max_new_tokens=32)
    RULER=(task=ruler "task.tasks=[niah_multikey_1]" "task.lengths=[1024]" task.num_samples=1)
    KNORM_BUDGETS=256; CKV_BUDGETS=256; SAGE_BUDGETS=256; HASH_BUDGETS=512
fi

start_run
read -ra P_ONCE <<< "$(protocol prefill_once)"
read -ra P_ONCE_DEC <<< "$(protocol prefill_once_decode_evict)"
read -ra P_BLOCK <<< "$(protocol blockwise)"
sweep 0 "${NIAH[@]}" "${P_ONCE[@]}" policy=knorm "budget=$KNORM_BUDGETS" "hydra.sweep.dir=$RUNS/knorm_random"
sweep 0 "${NIAH[@]}" "${P_ONCE[@]}" policy=random "policy.skip_layers=[0,1]" "budget=$KNORM_BUDGETS" \
    "hydra.sweep.dir=$RUNS/knorm_random"
# (One policy per command where a policy option is set: Hydra applies non-sweep overrides to the default policy
# before it expands a policy sweep. criticalkv and adakv pool with max by default; the snapkv preset uses avg.)
sweep 1 "${NIAH[@]}" "${P_ONCE[@]}" policy=snapkv policy.pooling=max "budget=$CKV_BUDGETS" \
    "hydra.sweep.dir=$RUNS/criticalkv_snapkv"
sweep 1 "${NIAH[@]}" "${P_ONCE[@]}" policy=criticalkv "budget=$CKV_BUDGETS" "hydra.sweep.dir=$RUNS/criticalkv_snapkv"
sweep 0 "${NIAH[@]}" "${P_ONCE[@]}" policy=adakv "budget=$CKV_BUDGETS" "hydra.sweep.dir=$RUNS/criticalkv_adakv"
sweep 1 "${NIAH[@]}" "${P_ONCE[@]}" policy=criticalkv policy.base=adakv "budget=$CKV_BUDGETS" \
    "hydra.sweep.dir=$RUNS/criticalkv_adakv"
sweep 0 "${NIAH[@]}" "${P_ONCE_DEC[@]}" policy=sagekv,streamingllm "budget=$SAGE_BUDGETS" \
    "hydra.sweep.dir=$RUNS/sagekv_streamingllm"
sweep 1 "${RULER[@]}" "${P_BLOCK[@]}" policy=hashevict "budget=$HASH_BUDGETS" "hydra.sweep.dir=$RUNS/hashevict_h2o"
sweep 1 "${RULER[@]}" "${P_BLOCK[@]}" policy=h2o policy.n_sink=4 policy.n_recent=10 "budget=$HASH_BUDGETS" \
    "hydra.sweep.dir=$RUNS/hashevict_h2o"
sweep 0 "${RULER[@]}" "${P_BLOCK[@]}" policy=full budget=null "hydra.sweep.dir=$RUNS/hashevict_h2o"
wait_workers

if [[ "$QUICK" == 1 ]]; then SUFFIX=-quick; else SUFFIX=; fi
NIAH_RUNS=${NIAH_RUNS:-$( [[ -d results/runs/niah_grid$SUFFIX ]] && echo results/runs/niah_grid$SUFFIX || echo results/niah_grid/runs)}
RULER_RUNS=${RULER_RUNS:-$( [[ -d results/runs/ruler_4k$SUFFIX ]] && echo results/runs/ruler_4k$SUFFIX || echo results/ruler_4k/runs)}
export NIAH_RUNS RULER_RUNS  # (scripts/tables.sh draws the claims table with them)
EXTRA_MD="Claims table: \`kvbench-report $OUT/runs --claims $NIAH_RUNS $RULER_RUNS --out $OUT\` (NIAH grid and RULER runs from scripts/niah_grid.sh and scripts/ruler_4k.sh; part of scripts/tables.sh)."
finish_run
