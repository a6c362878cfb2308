#!/usr/bin/env bash
# The tables and plots of a results folder, drawn from its committed runs alone (OUT/runs: each run's config.yaml,
# metrics.json and predictions.jsonl): no model, nothing recomputed, and nothing read from a scratch directory, so
# anyone with a checkout gets the committed files byte for byte (tests/test_results_tables.py checks the tables).
#
#   bash scripts/tables.sh                      every committed folder below, then results/README.md's verdicts
#                                               (scripts/verdicts.py)
#   bash scripts/tables.sh NAME [OUT]           one kind of folder (default OUT: results/NAME); the result scripts
#                                               call it on their own output after finish_run
#
# NAME: niah_grid | ruler_4k | claims | qwen2.5-coder-1.5b | pilot_evidence | evidence_lm | evidence_code |
# pilot_niah | evidence_niah | evidence_qwen | evidence_knorm | evidence_lm_essays | pilot_ruler | evidence_ruler |
# evidence_ruler_qwen | evidence_ruler_2k | evidence_ruler_qwen_2k. The claims tables also read the NIAH grid's and the RULER runs (NIAH_RUNS,
# RULER_RUNS; default: the committed ones).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPORT=${REPORT:-python -m kvbench.report}
NIAH_RUNS=${NIAH_RUNS:-results/niah_grid/runs}
RULER_RUNS=${RULER_RUNS:-results/ruler_4k/runs}
FOLDERS=(niah_grid ruler_4k claims qwen2.5-coder-1.5b pilot_evidence evidence_lm evidence_code pilot_niah evidence_niah
         evidence_qwen evidence_knorm evidence_lm_essays pilot_ruler evidence_ruler evidence_ruler_qwen
         evidence_ruler_2k evidence_ruler_qwen_2k)
# The runs with 0/100 scores and graded scores, for results/graded_validity.md
VALIDITY_RUNS=(results/niah_grid/runs results/ruler_4k/runs results/claims/runs results/qwen2.5-coder-1.5b/runs
               results/evidence_niah/runs results/evidence_qwen/runs/grid results/pilot_ruler/runs
               results/evidence_ruler/runs results/evidence_ruler_qwen/runs results/evidence_ruler_2k/runs
               results/evidence_ruler_qwen_2k/runs)

# The designed NIAH grid's planned comparisons (the runs scripts/lib.sh's grid_claims queues), each within its claim's
# folder, the block-wise ones at the grid's budget N ($1), the one-pass ones at 512
grid_comparisons() {
    echo "keydiff/keydiff:tova@$1 keydiff/keydiff:snapkv@$1 keydiff/keydiff:h2o@$1 keydiff/keydiff:full@$1" \
        "keydiff/streamingllm:full@$1 hashevict_h2o/hashevict:h2o@$1 criticalkv_snapkv/criticalkv:snapkv@512" \
        "criticalkv_adakv/criticalkv:adakv@512 sagekv_streamingllm/sagekv:streamingllm@512"
}

# run_budgets DIR: the budgets N the evicting runs below DIR hold, comma-separated (a script's QUICK runs use others)
run_budgets() {
    python -c 'import json, pathlib, sys; print(*sorted({m["budget"] for m in (json.loads(p.read_text())
for p in pathlib.Path(sys.argv[1]).rglob("metrics.json")) if m["budget"] is not None}), sep=",")' "$1"
}

# depth_tests RUNS OUT N: StreamingLLM's depth claim on a designed NIAH grid: StreamingLLM against the full cache at
# each needle depth (the grid's depth cells), block-wise at the grid's N and under SAGE-KV's protocol at 512, one
# Holm family (OUT/tests_depth.md, .csv; scripts/evidence_table.py reads the claim from them)
depth_tests() {
    python scripts/power_plan.py "$1" --out "$2/tests_depth.md" --csv "$2/tests_depth.csv" --tests \
        --score L2000_D10,L2000_D50,L2000_D90 --compare "streamingllm:full@$3" streamingllm:full@512 > /dev/null
}

# both_scores RUNS DIR ARGS...: the planned comparisons' tests (power_plan.py --tests ARGS) on the 0/100 score
# (DIR/tests.md, .csv) and on the graded score (DIR/tests_graded.md, .csv), one Holm family per score
both_scores() {
    local runs=$1 dir=$2
    shift 2
    python scripts/power_plan.py "$runs" --out "$dir/tests.md" --csv "$dir/tests.csv" --score avg --tests "$@" \
        > /dev/null
    python scripts/power_plan.py "$runs" --out "$dir/tests_graded.md" --csv "$dir/tests_graded.csv" \
        --score answer_logprob --tests "$@" > /dev/null
}

# part_reports OUT PART...: a report of each part's runs (OUT/runs/PART -> OUT/PART), for the parts that were run
part_reports() {
    local out=$1 part
    shift
    for part in "$@"; do
        [[ -d "$out/runs/$part" ]] || continue
        mkdir -p "$out/$part"
        $REPORT "$out/runs/$part" --out "$out/$part" -q
    done
}

tables() {
    local name=$1 out=$2
    if [[ ! -d "$out/runs" ]]; then
        echo "tables.sh: error: $out/runs does not exist" >&2
        exit 2
    fi
    # (the parts of evidence_qwen, evidence_knorm and evidence_ruler* hold different tasks or the pilot: a report of
    # each, below)
    # (the NIAH grid: a heatmap figure per budget too)
    local extra=""
    [[ $name != niah_grid ]] || extra=--heatmaps-per-budget
    [[ $name == evidence_qwen || $name == evidence_knorm || $name == evidence_ruler* ]] || \
        $REPORT "$out/runs" --out "$out" -q $extra
    case $name in
        niah_grid) ;;
        ruler_4k) ;;
        evidence_niah)
            # Every claim's planned comparisons on the designed grid, each within its own runs' folder (the claims'
            # protocols and options differ), one Holm family per score: the 0/100 score the pilot sized, then the
            # graded one
            local niah_compare
            read -ra niah_compare <<< "$(grid_comparisons 1024)"
            both_scores "$out/runs" "$out" --compare "${niah_compare[@]}"
            depth_tests "$out/runs" "$out" 1024 ;;
        pilot_niah)
            # The budgets the final NIAH grid runs at: the full cache answers and the policies spread
            python scripts/budget_choice.py "$out/runs" --out "$out/budgets.md" > /dev/null
            # The final grid's n at the chosen budget (0/100 score; cap: the 93 samples the pilot leaves)
            python scripts/power_plan.py "$out/runs" --out "$out/plan.md" --score avg --cap 93 --budgets 1024 \
                --compare keydiff:tova keydiff:snapkv keydiff:h2o keydiff:full streamingllm:full > /dev/null ;;
        pilot_ruler)
            # The budgets a designed RULER run would use, and the n its planned comparisons need (cap: the 28 samples
            # the pilot leaves), at each budget the pilot ran
            python scripts/budget_choice.py "$out/runs" --out "$out/budgets.md" > /dev/null
            python scripts/power_plan.py "$out/runs" --out "$out/plan.md" --score avg --cap 28 \
                --budgets "$(run_budgets "$out/runs")" --compare keydiff:tova keydiff:snapkv keydiff:h2o keydiff:full \
                > /dev/null ;;
        evidence_ruler | evidence_ruler_qwen | evidence_ruler_2k | evidence_ruler_qwen_2k)
            # The designed RULER run: its own pilot's budgets where it ran one (SmolLM2's is results/pilot_ruler), then
            # the final runs' planned comparisons at the budget they hold, one Holm family per score
            local rn ruler_compare=(keydiff:tova keydiff:snapkv keydiff:h2o keydiff:full)
            part_reports "$out" pilot final
            if [[ -d "$out/runs/pilot" ]]; then
                python scripts/budget_choice.py "$out/runs/pilot" --out "$out/pilot/budgets.md" > /dev/null
            fi
            rn=$(run_budgets "$out/runs/final")
            both_scores "$out/runs/final" "$out/final" --budgets "$rn" --compare "${ruler_compare[@]}" ;;
        evidence_lm | evidence_lm_essays)
            # The planned comparisons' tests, Holm over the table (the LM score: answer_logprob, nats per token), at the
            # budget the runs hold (code: N = 1024 of 2048 tokens; essays: 512 of 1024)
            python scripts/power_plan.py "$out/runs" --out "$out/tests.md" --csv "$out/tests.csv" \
                --score answer_logprob --tests --budgets "$(run_budgets "$out/runs")" \
                --compare knorm:random knorm:full streamingllm:full knorm:streamingllm > /dev/null ;;
        evidence_code)
            # The pilot's planned comparisons on the code task's graded score (the gold line's log-probability) over
            # the keydiff part's runs, HashEvict's against H2O with the same protected tokens and KeyDiff's against its
            # H2O where they were run (each part in its own folder)
            local code_compare=(smollm2-135m/keydiff:tova smollm2-135m/keydiff:snapkv smollm2-135m/keydiff:full
                                smollm2-135m/streamingllm:full)
            [[ -d "$out/runs/hashevict_h2o" ]] && code_compare+=(hashevict_h2o/hashevict:h2o@512)
            [[ -d "$out/runs/keydiff_h2o" ]] && code_compare+=(keydiff_h2o/keydiff:h2o@512)
            python scripts/power_plan.py "$out/runs" --out "$out/tests.md" --csv "$out/tests.csv" \
                --score answer_logprob --tests --budgets 512 --compare "${code_compare[@]}" > /dev/null ;;
        pilot_evidence)
            # The final runs' n from the pilot's paired differences (Holm's strictest level over each plan's m)
            python scripts/power_plan.py "$out/runs/lm" --out "$out/plan_lm.md" --score answer_logprob --cap 383 \
                --compare knorm:random knorm:full streamingllm:full keydiff:tova keydiff:snapkv keydiff:h2o \
                --budgets 256,512 > /dev/null
            python scripts/power_plan.py "$out/runs/code" --out "$out/plan_code.md" --score answer_logprob --cap 205 \
                --compare keydiff:tova keydiff:snapkv keydiff:full streamingllm:full --budgets 512 > /dev/null ;;
        evidence_qwen)
            # Qwen: the pilot's budget (the rule scripts/evidence_qwen.sh ran the grid at), then each part's planned
            # comparisons as on SmolLM2 (evidence_niah, evidence_lm, evidence_code), one Holm family per part and score
            local n=1024
            part_reports "$out" pilot lm grid code
            if [[ -d "$out/runs/pilot" ]]; then
                n=$(python scripts/budget_choice.py "$out/runs/pilot" --out "$out/pilot/budgets.md" --pick) || n=1024
            fi
            if [[ -d "$out/runs/grid" ]]; then
                local qwen_niah
                read -ra qwen_niah <<< "$(grid_comparisons "$n")"
                both_scores "$out/runs/grid" "$out/grid" --compare "${qwen_niah[@]}"
                depth_tests "$out/runs/grid" "$out/grid" "$n"
            fi
            if [[ -d "$out/runs/lm" ]]; then
                python scripts/power_plan.py "$out/runs/lm" --out "$out/lm/tests.md" --csv "$out/lm/tests.csv" \
                    --score answer_logprob --tests --budgets 1024 \
                    --compare knorm:random knorm:full streamingllm:full knorm:streamingllm > /dev/null
            fi
            if [[ -d "$out/runs/code" ]]; then
                python scripts/power_plan.py "$out/runs/code" --out "$out/code/tests.md" --csv "$out/code/tests.csv" \
                    --score answer_logprob --tests --budgets 512 \
                    --compare keydiff:tova keydiff:snapkv keydiff:full streamingllm:full > /dev/null
            fi ;;
        evidence_knorm)
            # K-norm's pilot (the budget the grid ran at) and the grid's one planned comparison per score, at the
            # budget its runs hold
            local kn
            part_reports "$out" pilot grid
            python scripts/budget_choice.py "$out/runs/pilot" --out "$out/pilot/budgets.md" > /dev/null
            kn=$(run_budgets "$out/runs/grid")
            both_scores "$out/runs/grid" "$out/grid" --budgets "$kn" --compare knorm:random ;;
        claims) python scripts/claims_table.py "$out/runs" "$NIAH_RUNS" "$RULER_RUNS" "$out" ;;
        qwen2.5-coder-1.5b)
            python scripts/claims_table.py "$out/runs" "$out/runs/niah" - "$out"
            # Each claim's verdicts on SmolLM2 (results/claims) and on this model, side by side.
            python scripts/claims_side_by_side.py results/claims/claims.csv "$out/claims.csv" \
                --names SmolLM2-135M Qwen2.5-Coder-1.5B --out "$out/side_by_side.md" ;;
    esac
}

evidence_table() {
    python scripts/evidence_table.py --claims results/claims/claims.csv --claims results/qwen2.5-coder-1.5b/claims.csv \
        --names SmolLM2-135M Qwen2.5-Coder-1.5B \
        --tests \
        results/evidence_niah/tests.csv+results/evidence_knorm/grid/tests.csv+results/evidence_niah/tests_depth.csv \
        results/evidence_niah/tests_graded.csv+results/evidence_knorm/grid/tests_graded.csv \
        results/evidence_code/tests.csv results/evidence_lm/tests.csv results/evidence_lm_essays/tests.csv \
        results/evidence_qwen/grid/tests.csv+results/evidence_qwen/grid/tests_depth.csv \
        results/evidence_qwen/grid/tests_graded.csv \
        results/evidence_qwen/lm/tests.csv results/evidence_qwen/code/tests.csv \
        results/evidence_ruler/final/tests.csv results/evidence_ruler/final/tests_graded.csv \
        results/evidence_ruler_qwen/final/tests.csv results/evidence_ruler_qwen/final/tests_graded.csv \
        results/evidence_ruler_2k/final/tests.csv results/evidence_ruler_2k/final/tests_graded.csv \
        results/evidence_ruler_qwen_2k/final/tests.csv results/evidence_ruler_qwen_2k/final/tests_graded.csv \
        --test-names "designed NIAH grid, 0/100 (SmolLM2)" "designed NIAH grid, graded score (SmolLM2)" \
        "real code, graded score (SmolLM2)" "LM score on code (SmolLM2)" "LM score on the essays (SmolLM2)" \
        "designed NIAH grid, 0/100 (Qwen)" "designed NIAH grid, graded score (Qwen)" "LM score on code (Qwen)" \
        "real code, graded score (Qwen)" "designed RULER 4K, 0/100 (SmolLM2)" \
        "designed RULER 4K, graded score (SmolLM2)" "designed RULER 4K, 0/100 (Qwen)" \
        "designed RULER 4K, graded score (Qwen)" "designed RULER 2K, 0/100 (SmolLM2)" \
        "designed RULER 2K, graded score (SmolLM2)" "designed RULER 2K, 0/100 (Qwen)" \
        "designed RULER 2K, graded score (Qwen)" --ruler 10 11 12 13 14 15 16 17 \
        --out results/evidence.md > /dev/null
}

if [[ $# == 0 ]]; then
    for name in "${FOLDERS[@]}"; do tables "$name" "results/$name"; done
    # results/README.md's verdict blocks, from the CSVs just written (tests/test_verdicts.py checks them).
    python scripts/verdicts.py
    # Whether the graded score separates hits from misses, per model (tests/test_graded_validity.py checks it)
    python scripts/graded_validity.py --runs "${VALIDITY_RUNS[@]}" --out results/graded_validity.md > /dev/null
    # Each claim on every score that tests it: the claims tables beside the evidence folders' planned tests
    evidence_table
elif [[ " ${FOLDERS[*]} " == *" $1 "* ]]; then
    tables "$1" "${2:-results/$1}"
else
    echo "tables.sh: error: unknown results folder '$1'; choose one of: ${FOLDERS[*]}" >&2
    exit 2
fi
