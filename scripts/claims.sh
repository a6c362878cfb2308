#!/usr/bin/env bash
# Table 3: the seed papers' qualitative claims put to the test on SmolLM2-135M-Instruct, each under its paper's
# protocol where kvbench and a 135M model allow. Writes results/claims/claims.md (claim, paper, setting, numbers,
# holds?) from the runs below plus the NIAH grid (scripts/niah_grid.sh) and the RULER table (scripts/ruler_4k.sh).
#
#   scripts/claims.sh                 # after scripts/niah_grid.sh (and ideally scripts/ruler_4k.sh)
#   QUICK=1 scripts/claims.sh         # one 500-token cell per configuration (scratch output only)
#
# Each claim runs with the settings of the paper that makes it (docs/policies.md, "Baselines as each paper runs
# them"). NIAH claims use the NIAH grid's samples (NIAH_2K in lib.sh: 2000 tokens of the essays, depths 10/50/90 %,
# 5 needles per cell), so every run pairs with the grid's full cache and with each other on the same 15 samples;
# budgets are absolute token counts, the papers' fractions of a ~1900-token prompt:
#   K-norm vs Random (K-norm): one compression after the prompt (prefill_once), layers 0-1 kept whole for both
#     (random policy.skip_layers=[0,1]: equal compression), N = 1024 (about 54 % of the prompt kept).
#   CriticalKV on SnapKV and AdaKV: prefill_once as in CriticalKV Alg. 2, max pooling, window 32, N = 512.
#   SAGE-KV vs StreamingLLM (SAGE-KV): one selection after the prompt, eviction at every decoding step
#     (prefill_once_decode_evict), the same N = 512.
#   One budget per claim (KNORM_BUDGETS=1024,512 CKV_BUDGETS=256,512 ... add more): the CPU this session had.
#   HashEvict vs H2O (HashEvict): RULER niah_multikey_1 at 4K (one of the paper's Figure 5 tasks; its other, cwe,
#     came out the same for every policy and the full cache in the one-sample table, so it cannot separate), 10 samples,
#     N = 1229 (30 % of 4K; HASH_BUDGETS=1229,2048 adds the paper's 50 %), block-wise; the first 4 and latest 10 tokens protected for both
#     (HashEvict §4); the paper hashes token by token (B = 1), kvbench's B = 128 is its faster approximation.
# From the NIAH grid and the RULER table: KeyDiff vs TOVA/SnapKV/H2O under block-wise processing (KeyDiff App. B.2).
# CPU budget: 8 NIAH runs x 15 samples x ~12 s + 3 RULER runs x 10 samples x ~18 s = ~33 CPU-min.
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
EXTRA_MD="Claims table: \`python scripts/claims_table.py $OUT/runs $NIAH_RUNS $RULER_RUNS $OUT\` (NIAH grid and RULER runs from scripts/niah_grid.sh and scripts/ruler_4k.sh; part of scripts/tables.sh)."
finish_run
