#!/usr/bin/env bash
# The tables and plots of a results folder, drawn from its committed runs alone (OUT/runs: each run's config.yaml,
# metrics.json and predictions.jsonl): no model, nothing recomputed, and nothing read from a scratch directory, so
# anyone with a checkout gets the committed files byte for byte (tests/test_results_tables.py checks the tables).
#
#   bash scripts/tables.sh                      every committed folder below, then the verdicts (scripts/verdicts.py:
#                                               results/tests.csv, evidence.md, README.md's block)
#   bash scripts/tables.sh NAME [OUT]           one kind of folder (default OUT: results/NAME); the result scripts
#                                               call it on their own output after finish_run
#
# NAME: one of FOLDERS below. The claims tables also read the NIAH grid's and the RULER runs (NIAH_RUNS, RULER_RUNS;
# default: the committed ones). The analyses beside the tables are kvbench-report's options (--budget-choice, --plan,
# --claims, --graded-validity).
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

# run_budgets DIR: the budgets N the evicting runs below DIR hold, comma-separated (a script's QUICK runs use others)
run_budgets() {
    python -c 'import json, pathlib, sys; print(*sorted({m["budget"] for m in (json.loads(p.read_text())
for p in pathlib.Path(sys.argv[1]).rglob("metrics.json")) if m["budget"] is not None}), sep=",")' "$1"
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
        pilot_niah)
            # The budgets the final NIAH grid runs at: the full cache answers and the policies spread
            $REPORT "$out/runs" --budget-choice "$out/budgets.md" -q
            # The final grid's n at the chosen budget (0/100 score; cap: the 93 samples the pilot leaves)
            $REPORT "$out/runs" -q --plan "$out/plan.md" --score avg --cap 93 --budgets 1024 \
                --compare keydiff:tova keydiff:snapkv keydiff:h2o keydiff:full streamingllm:full ;;
        pilot_ruler)
            # The budgets a designed RULER run would use, and the n its planned comparisons need (cap: the 28 samples
            # the pilot leaves), at each budget the pilot ran
            $REPORT "$out/runs" --budget-choice "$out/budgets.md" -q
            $REPORT "$out/runs" -q --plan "$out/plan.md" --score avg --cap 28 \
                --budgets "$(run_budgets "$out/runs")" --compare keydiff:tova keydiff:snapkv keydiff:h2o keydiff:full ;;
        evidence_ruler | evidence_ruler_qwen | evidence_ruler_2k | evidence_ruler_qwen_2k)
            # The designed RULER run: its own pilot's budgets where it ran one (SmolLM2's is results/pilot_ruler), and
            # the final runs' report (their tests: scripts/verdicts.py)
            part_reports "$out" pilot final
            if [[ -d "$out/runs/pilot" ]]; then
                $REPORT "$out/runs/pilot" --budget-choice "$out/pilot/budgets.md" -q
            fi ;;
        pilot_evidence)
            # The final runs' n from the pilot's paired differences (Holm's strictest level over each plan's m)
            $REPORT "$out/runs/lm" -q --plan "$out/plan_lm.md" --score answer_logprob --cap 383 \
                --compare knorm:random knorm:full streamingllm:full keydiff:tova keydiff:snapkv keydiff:h2o \
                --budgets 256,512
            $REPORT "$out/runs/code" -q --plan "$out/plan_code.md" --score answer_logprob --cap 205 \
                --compare keydiff:tova keydiff:snapkv keydiff:full streamingllm:full --budgets 512 ;;
        evidence_qwen)
            # Qwen: the pilot's budget (the rule scripts/evidence_qwen.sh ran the grid at), and each part's report
            part_reports "$out" pilot lm grid code
            if [[ -d "$out/runs/pilot" ]]; then
                $REPORT "$out/runs/pilot" --budget-choice "$out/pilot/budgets.md" -q
            fi ;;
        evidence_knorm)
            # K-norm's pilot (the budget the grid ran at) and each part's report
            part_reports "$out" pilot grid
            $REPORT "$out/runs/pilot" --budget-choice "$out/pilot/budgets.md" -q ;;
        claims) $REPORT "$out/runs" --claims "$NIAH_RUNS" "$RULER_RUNS" --out "$out" -q ;;
        qwen2.5-coder-1.5b)
            # (no RULER runs on this model) and each claim's verdicts on SmolLM2 (results/claims) beside this model's
            $REPORT "$out/runs" --claims "$out/runs/niah" - --out "$out" -q --beside results/claims/claims.csv \
                --names SmolLM2-135M Qwen2.5-Coder-1.5B ;;
    esac
}

if [[ $# == 0 ]]; then
    for name in "${FOLDERS[@]}"; do tables "$name" "results/$name"; done
    # Whether the graded score separates hits from misses, per model (tests/test_graded_validity.py checks it)
    $REPORT "${VALIDITY_RUNS[@]}" --graded-validity results/graded_validity.md -q
    # Every planned comparison of results/design.csv from the records, one Holm family per model: results/tests.csv,
    # results/evidence.md and results/README.md's verdicts block (tests/test_verdicts.py checks them)
    python scripts/verdicts.py
elif [[ " ${FOLDERS[*]} " == *" $1 "* ]]; then
    tables "$1" "${2:-results/$1}"
else
    echo "tables.sh: error: unknown results folder '$1'; choose one of: ${FOLDERS[*]}" >&2
    exit 2
fi
