#!/usr/bin/env bash
# The GPU default tree, measured, then swept (an H200, within 10 minutes of wall time):
#
#   scripts/gpu_default_tree.sh RESULTS_DIR
#
# 1. scripts/gpu_bench.sh (training the `gpu` preset first unless WORK/gpu holds it) times the
#    fixed trees of SHAPES and the chain at batch 1, greedy, on 16 held-out prompts that no
#    default sweep uses (the 257th to 272nd), into RESULTS_DIR/shapes;
# 2. the tree with the highest median speedup there (scripts/fastest_shape.py) becomes the
#    adaptive engine's tree arm (ADAPTIVE_TREE) for a sweep of batch sizes 1 to 256, greedy and
#    T=0.7 (SWEEP_REPEATS rounds, default 10), on the usual prompts, into RESULTS_DIR/sweep.
# Env: WORK, PYTHON, MTPSERVE_COMMIT as for scripts/gpu_bench.sh; SHAPES (default
# 4x4-24,4x4-32,4x4-48,4x5-32,4x5-48,4x6-32), SHAPES_DEADLINE_S (default 420: seconds from the
# start by which the shapes' points must have started, training included), SWEEP_S (seconds the
# sweep's gpu_bench.sh may take, default 270; 0: no sweep).
# Timing on the H200 (session 34): training 225 s; on a cold machine the shapes' engines take
# ~106 s to build (Triton compiles), ~10 s with the cache warm; the sweep's adaptive engine
# ~100 s, its 36 points ~60 s. On a fresh machine both stages do not fit one 10-minute call:
# run the shapes alone first (SHAPES_DEADLINE_S=480 SWEEP_S=0), then, on the same machine
# while it is warm (model and Triton cache kept), the whole script (SHAPES_DEADLINE_S=150).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 RESULTS_DIR}
PY=${PYTHON:-python3}
export WORK=${WORK:-/tmp/mtpserve-bench}
trap 'rm -f "$OUT"/*/*.png' EXIT  # the device tool brings back 8 files at most
GPU_TESTS=0 CHECK_DTYPE=none MODES=chain,tree TREE_BUDGETS=${SHAPES:-4x4-24,4x4-32,4x4-48,4x5-32,4x5-48,4x6-32} \
    BATCH_SIZES=1 TEMPERATURES=0 REPEATS=16 NUM_PROMPTS=16 PROMPT_OFFSET=256 \
    DEADLINE_S=${SHAPES_DEADLINE_S:-420} END_S=${SHAPES_DEADLINE_S:-420} VALIDATE_MIN_S=100000 \
    bash scripts/gpu_bench.sh "$OUT/shapes"
BEST=$("$PY" scripts/fastest_shape.py "$OUT"/shapes/*-*.json)
echo "== fastest tree at batch 1 on the shapes' prompts: $BEST"
SWEEP_S=${SWEEP_S:-270}
if [ "$SWEEP_S" = 0 ]; then exit 0; fi
GPU_TESTS=0 CHECK_DTYPE=none MODES=adaptive ADAPTIVE_TREE=$BEST BATCH_SIZES=1,2,4,8,16,32,64,128,256 \
    TEMPERATURES=0,0.7 REPEATS=${SWEEP_REPEATS:-10} DEADLINE_S=$(( SWEEP_S - 15 )) END_S=$SWEEP_S \
    VALIDATE_MIN_S=100000 bash scripts/gpu_bench.sh "$OUT/sweep"
