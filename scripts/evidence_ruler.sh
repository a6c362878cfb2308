#!/usr/bin/env bash
# The designed RULER run for KeyDiff's RULER claim (issue "Evidence that resolves"; KeyDiff §5: KeyDiff against TOVA,
# SnapKV and H2O under block-wise prompt processing). results/ruler_4k left it unresolved at n = 10, its samples
# sharing one haystack and 7 of 10 failed by every policy. Here: niah_single_2 (essay haystack, a 7-digit value) at
# 4096 tokens, 35 samples, each its own stretch of the essays (task.windows=per_sample, docs/ruler.md: independent
# draws); the pilot takes shard 4/5 (7 samples), the final run the other four shards (28 samples) at the budget the
# pilot's rule picks (kvbench-report --budget-choice --pick, fixed before the pilot ran: the full cache >= 90, at
# least half the samples informative, then the most informative budget, a tie to the larger).
#
#   scripts/evidence_ruler.sh      # SmolLM2: the pilot is results/pilot_ruler (N = 3072 picked); the final run
#                                  # into results/evidence_ruler/runs/final
#   MODEL=qwen2.5-coder-1.5b NAME=evidence_ruler_qwen PILOT=run scripts/evidence_ruler.sh
#                                  # another model: its own pilot first (runs/pilot: the full cache; KeyDiff, TOVA,
#                                  # SnapKV, H2O at N = 1024, 2048, 3072), then the final run at its pick; when no
#                                  # budget passes, the most informative one where the full cache scores >= 90
#                                  # (--most-informative), else 3072, and RUN.md says so
#   PILOT=run NAME=evidence_ruler_2k LENGTH=2048 NUM=75 OF=10 PILOT_BUDGETS=512,1024,1280 FALLBACK_N=1024 \
#       scripts/evidence_ruler.sh  # SmolLM2 at 2K: the essays hold 75 disjoint 2K windows (the 76th would wrap); the
#                                  # pilot is shard 9/10 (7 samples), the final runs the other 68
#   MODEL=qwen2.5-coder-1.5b PILOT=run NAME=evidence_ruler_qwen_2k LENGTH=2048 NUM=70 OF=10 \
#       PILOT_BUDGETS=512,1024,1280 FALLBACK_N=1024 scripts/evidence_ruler.sh   # Qwen at 2K (a GPU machine:
#                                  # scripts/gpu_qwen.sh's part ruler): its tokenizer's 2K windows take ~1,470 essay
#                                  # words, so the essays hold 74 disjoint ones (the 75th wraps); 70 in 10 shards:
#                                  # the pilot shard 9/10 (7 samples), the final runs the other 63
#   QUICK=1 [PILOT=run] scripts/evidence_ruler.sh   # 1024-token samples, one in the final run (scratch output)
#
# Design, samples and CPU budget: results/evidence_ruler/RUN.md.
NAME=${NAME:-evidence_ruler}
DYNAMIC=${DYNAMIC:-1}
source "$(dirname "$0")/lib.sh"

PILOT=${PILOT:-results/pilot_ruler/runs}  # a pilot's runs, or "run": run this model's pilot first
LENGTH=${LENGTH:-4096}  # the samples' length in tokens; NUM of them (as many disjoint windows as the essays hold)
NUM=${NUM:-35}
OF=${OF:-5}  # the samples' shards: the pilot takes the last, the final runs the others
PILOT_BUDGETS=${PILOT_BUDGETS:-1024,2048,3072}
FALLBACK_N=${FALLBACK_N:-3072}
SHARDS=$(seq -s ' ' 0 $((OF - 2)))
if [[ "$QUICK" == 1 ]]; then
    LENGTH=1024 NUM=3 OF=3 SHARDS="0" PILOT_BUDGETS=512,768 FALLBACK_N=512
fi
TASK=(task=ruler "task.tasks=[niah_single_2]" "task.lengths=[$LENGTH]" "task.num_samples=$NUM" task.windows=per_sample
      block=128)

start_run
if [[ "$PILOT" == run ]]; then
    PILOT="$RUNS/pilot"
    sweep 0 "${TASK[@]}" "shard=$((OF - 1))/$OF" policy=full budget=null "hydra.sweep.dir=$PILOT"
    for p in keydiff tova snapkv h2o; do  # (one policy a command: on a GPU machine they run side by side)
        sweep 0 "${TASK[@]}" "shard=$((OF - 1))/$OF" "policy=$p" "budget=$PILOT_BUDGETS" "hydra.sweep.dir=$PILOT"
    done
    wait_workers
fi
[[ -d "$PILOT" ]] || { echo "evidence_ruler.sh: error: no pilot runs in $PILOT" >&2; exit 2; }
mkdir -p "$RUNS"
if N=$($REPORT "$PILOT" --budget-choice "$RUNS/pilot_budgets.md" --pick); then
    EXTRA_MD="The final runs use N = $N, the budget the pilot's rule picks ($PILOT, kvbench-report"
    EXTRA_MD+=" --budget-choice --pick)."
elif N=$($REPORT "$PILOT" --budget-choice "$RUNS/pilot_budgets.md" --most-informative); then
    EXTRA_MD="No pilot budget passed the rule: the final runs use N = $N, the most informative where the full cache"
    EXTRA_MD+=" scores >= 90."
else
    N=$FALLBACK_N
    EXTRA_MD="The full cache scored < 90 at every pilot budget: the final runs use N = $N (the stated fallback)."
fi
echo "[$NAME] $EXTRA_MD"
for s in $SHARDS; do
    shard="shard=$s/$OF"
    sweep 0 "${TASK[@]}" "$shard" policy=keydiff,tova "budget=$N" "hydra.sweep.dir=$RUNS/final"
    sweep 0 "${TASK[@]}" "$shard" policy=snapkv,h2o "budget=$N" "hydra.sweep.dir=$RUNS/final"
    sweep 0 "${TASK[@]}" "$shard" policy=full budget=null "hydra.sweep.dir=$RUNS/final"
done
wait_workers
finish_run
