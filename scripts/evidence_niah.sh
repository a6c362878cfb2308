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
# Design, samples and CPU budget: results/evidence_niah/RUN.md.
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
