#!/usr/bin/env bash
# The designed NIAH grid on SmolLM2 (issue "Evidence that resolves", points 3-4): the seed claims put to independent
# samples at the budget the pilot chose (results/pilot_niah), each claim under its paper's protocol as scripts/claims.sh
# runs it, with every sample of the final grid the pilot left out.
#
#   scripts/evidence_niah.sh                 # shards 0/11 .. 5/11 (57 samples)
#   SHARDS="0 1 2 3 4 5 6 7 8 9" scripts/evidence_niah.sh   # every sample the pilot left out (93):
#                                            # results/evidence_niah/ as committed (shards 0-5, then "6 7 8 9": RUN.md)
#   QUICK=1 scripts/evidence_niah.sh         # 1 sample per command (scratch output only)
#
# Samples: the grid results/pilot_niah sized (2000-token prompts, depths 10/50/90 %, 34 per depth, each needle in its
# own window of the essays: +task.windows=per_sample; 102 samples, 76 in disjoint windows, docs/niah.md), shards 0/11
# to 9/11; the pilot's shard 10/11 (9 samples, used to choose the budget) is left out, so n <= 93.
# Runs, per shard (scripts/lib.sh grid_claims; each line one kvbench command: the runs of a command that differ only in policy and budget are one
# shared-work group, their prompt blocks before the first eviction computed once):
#   blockwise B = 128, N = 1024 (the pilot's budget: the full cache answers 9/9, 7/9 samples informative):
#     the full cache; KeyDiff, TOVA, SnapKV, H2O, StreamingLLM (KeyDiff App. B.2, the pilot's five planned comparisons);
#     HashEvict and H2O with the first 4 and latest 10 tokens kept for both (HashEvict §4);
#   prefill_once, N = 512 (as scripts/claims.sh: the 15-sample grid spread there, 27-40 of 100 against the full
#   cache's 93; no pilot on these samples): SnapKV (max pooling) and CriticalKV; AdaKV and CriticalKV on AdaKV;
#   prefill_once_decode_evict, N = 512: SAGE-KV and StreamingLLM.
# K-norm vs Random is not run here: at N = 1024 (prefill_once) both scored 0 on all 15 samples of the earlier grid, so
# that budget tells them apart on no sample; its claim is put to the LM score (results/evidence_lm).
# Order: shard-major, shards dealt to the two workers in turn, so that wherever the runs are stopped every
# configuration holds the same samples (the stopping point is the clock's, not the results').
# CPU, measured (results/evidence_niah/RUN.md): shards 0-5 took 181 CPU-min (~30 per shard of 9-10 samples, beside
# test runs), shards 6-9 83.6 (~21 per shard).
NAME=evidence_niah
source "$(dirname "$0")/lib.sh"

SHARDS=${SHARDS:-0 1 2 3 4 5}
GRID=("${DESIGNED_GRID[@]}")
BLOCK_N=1024
ONCE_N=512
if [[ "$QUICK" == 1 ]]; then
    GRID=(task=niah "task.context_lengths=[600]" "task.depths=[50]" task.samples_per_cell=2 task.max_new_tokens=8
          +task.windows=per_sample)
    SHARDS="0"
    BLOCK_N=256
    ONCE_N=256
fi
PROTO_ARGS=()  # each claim runs under its paper's protocol

start_run
for s in $SHARDS; do
    w=$((s % 2))
    shard="shard=$s/11"
    [[ "$QUICK" == 1 ]] && shard="shard=0/2"
    grid_claims $w "$shard" "$RUNS" "$BLOCK_N" "$ONCE_N"
done
wait_workers
finish_run
