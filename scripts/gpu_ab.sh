#!/usr/bin/env bash
# A/B timing runs of adaptive speculation, one after another on one warm GPU machine:
#
#   scripts/gpu_ab.sh RESULTS_DIR 'NAME[:VAR=VALUE...]' ...
#
# Each argument is one scripts/gpu_bench.sh run (the model already trained into $WORK/gpu:
# scripts/train_on_h200.sh gpu in the call before, same WORK) with its own settings, e.g.
#
#   scripts/gpu_ab.sh OUT new 'old:ADAPTIVE_CHAINS=4' 'new2:TRACE_BATCHES=1,256:TRACE_ARGS=--temperatures 0'
#
# MODEL_DIR=PATH runs on another model folder (default $WORK/gpu), e.g. a copy of it whose
# training_log.json differs (the acceptance prior the engine starts from).
#
# Every run times adaptive against the autoregressive baseline at BATCH_SIZES (default
# 1,32,64,128,256) and TEMPERATURES (default 0,0.7), REPEATS (default 20) paired rounds, without
# the float32 check (CHECK_DTYPE=none), the GPU tests or the simulator validation, each within
# RUN_S seconds (default 200). Only RESULTS_DIR/NAME.json, NAME.md and, if traced, NAME-trace.txt
# are kept: the device tool brings back 8 files at most. A summary of the paired medians per run
# is printed at the end (scripts/gpu_ab_summary.py).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 RESULTS_DIR NAME[:VAR=VALUE...] ...}
shift
mkdir -p "$OUT"
for spec in "$@"; do
    name=${spec%%:*}
    dir=$(mktemp -d)
    (
        IFS=: read -r -a assignments <<< "${spec#"$name"}"
        for a in "${assignments[@]}"; do
            [ -n "$a" ] && export "${a?}"
        done
        export GPU_TESTS=0 CHECK_DTYPE=${CHECK_DTYPE:-none} MODES=adaptive VALIDATE_MIN_S=100000
        export BATCH_SIZES=${BATCH_SIZES:-1,32,64,128,256} TEMPERATURES=${TEMPERATURES:-0,0.7}
        export REPEATS=${REPEATS:-20} DEADLINE_S=${RUN_S:-200} END_S=$(( ${RUN_S:-200} + 60 ))
        echo "== $name: ${spec#"$name"}"
        bash scripts/gpu_bench.sh "$dir" ${MODEL_DIR:+"$MODEL_DIR"} > "$dir/stdout.txt" 2>&1 \
            || echo "== $name exited with status $?"
        tail -3 "$dir/stdout.txt"
    )
    for f in "$dir"/*.json "$dir"/*.md; do
        [ -e "$f" ] || continue
        case "$f" in *.json) cp "$f" "$OUT/$name.json" ;; *.md) cp "$f" "$OUT/$name.md" ;; esac
    done
    if [ -s "$dir/adaptive-trace.txt" ]; then cp "$dir/adaptive-trace.txt" "$OUT/$name-trace.txt"; fi
    rm -rf "$dir"
done
"${PYTHON:-python3}" scripts/gpu_ab_summary.py "$OUT"/*.json || true
