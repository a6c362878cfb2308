#!/usr/bin/env bash
# The LM score on real code at n = 100 on SmolLM2 (issue "Evidence that resolves"): K-norm's language-modelling
# claims (K-norm §3.1: evicting the highest-norm keys leaves perplexity close to the full cache's; keeping the
# low-norm keys beats random eviction) and StreamingLLM against the full cache.
#
#   scripts/evidence_lm.sh                  # results/evidence_lm/ (real code)
#   SOURCE=essays scripts/evidence_lm.sh    # results/evidence_lm_essays/ (the Paul Graham essays)
#   QUICK=1 scripts/evidence_lm.sh          # 2 samples (scratch output only)
#
# Design, samples and CPU budget: results/evidence_lm/RUN.md.
SOURCE=${SOURCE:-code}
case $SOURCE in
    code) NAME=evidence_lm ;;
    essays) NAME=evidence_lm_essays ;;
    *) echo "evidence_lm.sh: error: SOURCE must be code or essays, not '$SOURCE'" >&2; exit 2 ;;
esac
source "$(dirname "$0")/lib.sh"

if [[ $SOURCE == code ]]; then
    N=${N:-1024}
    LM=(task=lm task.source=code task.tokens=2048 task.limit=200 shard=0/2 block=128 "budget=$N")
else
    N=${N:-512}
    LM=(task=lm task.source=essays task.tokens=1024 block=128 "budget=$N")
fi
if [[ "$QUICK" == 1 ]]; then
    LM=(task=lm "task.source=$SOURCE" task.tokens=512 task.limit=4 shard=0/2 block=64 budget=128)
fi

start_run
sweep 0 "${LM[@]}" policy=full "hydra.sweep.dir=$RUNS"
sweep 0 "${LM[@]}" policy=knorm "hydra.sweep.dir=$RUNS"
sweep 1 "${LM[@]}" policy=random "policy.skip_layers=[0,1]" "hydra.sweep.dir=$RUNS"
sweep 1 "${LM[@]}" policy=streamingllm "hydra.sweep.dir=$RUNS"
wait_workers
finish_run
