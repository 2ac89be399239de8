#!/usr/bin/env bash
# GPU benchmark in one command (an H200, within 10 minutes of wall time):
#
#   scripts/gpu_bench.sh RESULTS_DIR [MODEL_DIR]
#
# 1. trains the `gpu` preset model into MODEL_DIR unless it already holds one (200 s, ~4 minutes in all);
# 2. runs the GPU kernel tests (tests/engine/kernels/test_gpu_kernels.py, into
#    gpu_kernel_tests.log; GPU_TESTS=0 skips them, GPU_TESTS=after runs them after the sweep;
#    GPU_TESTS_S, default 180: the seconds they may take), then `mtpserve bench offline` on CUDA in bf16 (greedy check in float32 first), with a time
#    limit so the whole script ends in time: points not started in time are listed as skipped;
# 3. writes into RESULTS_DIR: <device>-<date>.json, .md, a few PNGs (if matplotlib is
#    installed; otherwise run `mtpserve bench report FILE.json` elsewhere) and gpu_bench.log;
# 4. with the time left (until END_S, default 585 s; at least VALIDATE_MIN_S, default 150 s),
#    validates the simulator's predictions on the same model (scripts/validate_simulator.py ->
#    simulator-validation-h200.json).
# Env: PYTHON (default python3), WORK (default /tmp/mtpserve-bench), TRAIN_BUDGET_S (default
# 200; the headline figures' model trains 540 s in a call of its own first: scripts/train_on_h200.sh
# gpu with the same WORK), TRAIN_ARGS (more `mtpserve train` arguments, e.g. --no-compile), DEADLINE_S (default 560: seconds from start by which the sweep must end; the tree
# engine's Triton kernels take 25-60 s to compile on a fresh machine),
# PRICE_PER_HOUR (default 3.50: $ per GPU-hour for the cost columns; set your own),
# BATCH_SIZES, TEMPERATURES, TREE_BUDGETS, MAX_NEW_TOKENS, REPEATS, MIN_SEQUENCES, MODES (override the sweep),
# WARMUP_TOKENS (default MAX_NEW_TOKENS: the warm-up round does the timed rounds' work, so a code
# path first taken late in a request, such as a catch-up, is not first used in a timed round;
# 16 until session 23), VALIDATE_PROMPTS
# (default 8: prompts of the simulator validation), TRACE_BATCHES (e.g. 4,16,64: then
# scripts/adaptive_trace.py runs after the sweep, at most TRACE_S seconds (default 90), into
# adaptive-trace.txt, before the validation takes the time left; TRACE_ARGS are passed on,
# e.g. "--temperatures 0 --cprofile-batch 256"),
# PROFILE_BATCHES (e.g. 1,64: then scripts/gpu_profile.py runs after the trace, at most
# PROFILE_S seconds (default 120), with --catch-up and host profiles at the last of them, into
# RESULTS_DIR/profile.tar.gz: one file, as the device tool brings back 8 at most; PROFILE_ARGS,
# default "--closed-rounds --catch-up-profile-batch <last batch>", are passed on),
# STEP_PROFILE (set: after the trace, the batch-1 tree and autoregressive steps' kernels in order,
# scripts/spec_step_profile.py on random weights, into RESULTS_DIR/step-profile.txt),
# AR_PROFILE_BATCHES (e.g. 64,256: after the step profile, scripts/ar_step_profile.py on the
# trained model, the baseline's and an adaptive engine's steps side by side at those batches,
# the adaptive one pinned to autoregressive steps, at most AR_PROFILE_S seconds
# (default 120), into RESULTS_DIR/ar-step-profile.json and .txt: whether the adaptive engine's
# autoregressive steps cost more than the baseline's; AR_PROFILE_TEMPERATURES, default 0,0.7:
# session 35's sweeps had them 1.7-3.7% dearer per step under T=0.7),
# OVERLAP_STEPS (on, off or auto, default auto = on on CUDA: EngineConfig.overlap_steps of every
# engine, the baseline's too),
# LAUNCH_AFTER_PREFILL (on or off, default on: EngineConfig.launch_after_prefill of every engine),
# EARLY_CATCH_UP (on or off, default on: EngineConfig.early_catch_up of every engine),
# PREFILL_CHUNK (prompt tokens prefilled per step by every engine, the baseline's too; default:
# the engine's, 4096 on CUDA),
# SPIN_MS (default 50: milliseconds of GPU matrix products before every timed run, so that each
# starts at the boost clock; an idle H200 runs at 345 of 1980 MHz; 0: none; the stall counters
# record runs begun below 90% of the maximum clock either way),
# CHECK_DTYPE (default float32: the dtype of the greedy check before timing; "none" skips it,
# ~160 s with the float32 engines' build, for a timing run of a commit already checked),
# SWEEP_MARGIN_S (default 120: seconds past the sweep's limit before a stalled sweep is stopped
# with SIGABRT and a stack dump),
# TRITON_CACHE_TAR (a .tar.gz of a Triton cache from an earlier call, a path from the repository
# root, e.g. triton-cache.tar.gz, which git ignores so that the device tool can carry it:
# unpacked into the cache this run uses (scripts/triton_cache.sh), so the engines' Triton
# kernels load instead of compiling; ~90 s of the bf16 engines' build on a fresh machine),
# SAVE_TRITON_CACHE (set: this run's Triton cache is packed into RESULTS_DIR/triton-cache.tar.gz
# when it packs to at most TRITON_CACHE_MAX_MB, default 8: the device tool carries 64 MiB with
# the repository; one more file among the 8 it brings back),
# NUM_PROMPTS, PROMPT_OFFSET (held-out prompts of the sweep and how many are skipped first: 256
# runs on prompts no default sweep uses), ADAPTIVE_TREE (TOPKxDEPTH-N: the adaptive mode's tree
# arm instead of the default tree), ADAPTIVE_CHAINS (depths of its chain arms, e.g. 4,6),
# TREE_STATS (set: before the sweep, scripts/default_tree_inputs.py gpu-stats measures the trained
# model's greedy acceptance per depth and rank with a full top-4, depth-8 tree on 32 held-out
# prompts the sweep does not use, into RESULTS_DIR/h200-gpu-greedy-stats.json: the input of
# the GPU default tree, engine/spec/defaults.py),
# MTPSERVE_COMMIT (recorded as the commit; set it where the copy has no .git or a stale one, as
# on the device tool's machines, whose .git is not the checkout's).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 RESULTS_DIR [MODEL_DIR]}
WORK=${WORK:-/tmp/mtpserve-bench}
MODEL=${2:-$WORK/gpu}
PY=${PYTHON:-python3}
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-560}
END_S=${END_S:-585}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true PYTHONPATH=${PYTHONPATH:-.}
exec > >(tee -a "$OUT/gpu_bench.log") 2>&1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$WORK/triton-cache}
if [ -n "${TRITON_CACHE_TAR:-}" ]; then
    scripts/triton_cache.sh unpack "$TRITON_CACHE_TAR"
fi

"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-", "transformers", transformers.__version__)'

if [ ! -f "$MODEL/config.json" ]; then
    echo "== training the gpu preset into $MODEL"
    rm -rf "$MODEL" "$MODEL.work"
    # shellcheck disable=SC2086  # TRAIN_ARGS is a list of arguments
    "$PY" -m train --preset gpu --out "$MODEL" --work-dir "$MODEL.work" \
        --time-budget-s "${TRAIN_BUDGET_S:-200}" ${TRAIN_ARGS:-}
fi
# The Triton kernels against their PyTorch references on this GPU (tests/engine/kernels), before
# anything is timed (GPU_TESTS=1), after the sweep in the time left (GPU_TESTS=after, so a
# slow compile cannot eat the sweep's time), or not at all (GPU_TESTS=0).
gpu_tests() {  # $1: seconds allowed
    if "$PY" -c 'import pytest' 2>/dev/null; then
        echo "== GPU kernel tests (at most $1 s)"
        # The failed-step test first: the kernel tests alone took more than 180 s in session 41.
        timeout "$1" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_step_failure.py \
            tests/engine/test_mixed_sampling_batches.py tests/engine/kernels/test_gpu_kernels.py \
            > "$OUT/gpu_kernel_tests.log" 2>&1 || echo "== GPU kernel tests exited with status $?"
        tail -1 "$OUT/gpu_kernel_tests.log"
    fi
}
GPU_TESTS_S=${GPU_TESTS_S:-180}  # seconds the GPU tests may take
if [ "${GPU_TESTS:-1}" = 1 ]; then
    gpu_tests "$GPU_TESTS_S"
fi
if [ -n "${TREE_STATS:-}" ]; then
    echo "== acceptance per depth and rank of a full top-4, depth-8 tree"
    timeout 240 "$PY" scripts/default_tree_inputs.py gpu-stats --model "$MODEL" --out-dir "$OUT" \
        ${MTPSERVE_COMMIT:+--commit "$MTPSERVE_COMMIT"} > "$OUT/tree-stats.log" 2>&1 \
        || echo "== tree statistics exited with status $?"
    tail -2 "$OUT/tree-stats.log"
fi
ELAPSED=$(( $(date +%s) - START ))
# The limit counts from the start of the sweep (model load and float32 check included); leave
# room for the last run (no run starts after the limit) and for writing the results.
LIMIT=$(( DEADLINE_S - ELAPSED - 90 ))
if [ "$LIMIT" -lt 30 ]; then LIMIT=30; fi
echo "== benchmark (elapsed ${ELAPSED} s; sweep points start within ${LIMIT} s)"
if [ "$LIMIT" -lt 120 ]; then
    # Loading the model and the float32 check of every mode take ~40-60 s of the limit: a run
    # with DEADLINE_S=330 after training once timed nothing.
    echo "== warning: ${LIMIT} s may not leave time for any timed point (raise DEADLINE_S)"
fi
# A stalled sweep must not take the whole command's time: past its limit (plus the last run's
# and the results' time) it is stopped with SIGABRT, which makes Python print every thread's
# stack (PYTHONFAULTHANDLER), and the script goes on.
PYTHONFAULTHANDLER=1 timeout -s ABRT $(( LIMIT + ${SWEEP_MARGIN_S:-120} )) \
"$PY" -m engine bench offline --model "$MODEL" --device cuda --dtype bfloat16 \
    --check-dtype "${CHECK_DTYPE:-float32}" --check-batch 8 \
    --batch-sizes "${BATCH_SIZES:-1,4,16,64,256}" --temperatures "${TEMPERATURES:-0,0.7}" \
    --max-new-tokens "${MAX_NEW_TOKENS:-64}" --prompt-tokens 64 \
    --modes "${MODES:-chain,tree,adaptive,transformers,transformers-mtp}" \
    --tree-budgets "${TREE_BUDGETS:-32}" --repeats "${REPEATS:-3}" \
    ${NUM_PROMPTS:+--num-prompts "$NUM_PROMPTS"} --prompt-offset "${PROMPT_OFFSET:-0}" \
    ${ADAPTIVE_TREE:+--adaptive-tree "$ADAPTIVE_TREE"} ${ADAPTIVE_CHAINS:+--adaptive-chains "$ADAPTIVE_CHAINS"} \
    --min-sequences "${MIN_SEQUENCES:-16}" --warmup-tokens "${WARMUP_TOKENS:-${MAX_NEW_TOKENS:-64}}" \
    --spin-ms "${SPIN_MS:-50}" --overlap-steps "${OVERLAP_STEPS:-auto}" \
    --launch-after-prefill "${LAUNCH_AFTER_PREFILL:-on}" --early-catch-up "${EARLY_CATCH_UP:-on}" \
    ${PREFILL_CHUNK:+--prefill-chunk-tokens "$PREFILL_CHUNK"} \
    --time-limit-s "$LIMIT" --price-per-hour "${PRICE_PER_HOUR:-3.50}" \
    --out "$OUT" --no-progress || echo "== bench offline exited with status $?"
LEFT=$(( END_S - ($(date +%s) - START) ))
if [ "${GPU_TESTS:-1}" = after ] && [ "$LEFT" -gt 20 ]; then
    gpu_tests $(( LEFT < GPU_TESTS_S ? LEFT : GPU_TESTS_S ))
fi
LEFT=$(( END_S - ($(date +%s) - START) ))
if [ -n "${TRACE_BATCHES:-}" ] && [ "$LEFT" -gt 30 ]; then
    TRACE_LIMIT=$(( LEFT < ${TRACE_S:-90} ? LEFT : ${TRACE_S:-90} ))
    echo "== adaptive trace at batches ${TRACE_BATCHES} (${TRACE_LIMIT} s)"
    timeout "$TRACE_LIMIT" "$PY" scripts/adaptive_trace.py --model "$MODEL" --device cuda \
        --batch-sizes "$TRACE_BATCHES" ${TRACE_ARGS:-} > "$OUT/adaptive-trace.txt" 2>&1 \
        || echo "== adaptive trace exited with status $?"
fi
LEFT=$(( END_S - ($(date +%s) - START) ))
if [ -n "${PROFILE_BATCHES:-}" ] && [ "$LEFT" -gt 30 ]; then
    PROFILE_LIMIT=$(( LEFT < ${PROFILE_S:-120} ? LEFT : ${PROFILE_S:-120} ))
    echo "== profile at batches ${PROFILE_BATCHES} (${PROFILE_LIMIT} s)"
    PROF=$(mktemp -d)
    # shellcheck disable=SC2086  # PROFILE_ARGS is a list of arguments
    timeout "$PROFILE_LIMIT" "$PY" scripts/gpu_profile.py "$PROF" --model "$MODEL" \
        --batch-sizes "$PROFILE_BATCHES" --host-profile-batch "${PROFILE_BATCHES##*,}" --catch-up \
        ${PROFILE_ARGS:---closed-rounds --catch-up-profile-batch ${PROFILE_BATCHES##*,}} \
        > "$PROF/stdout.txt" 2>&1 || echo "== profile exited with status $?"
    tar czf "$OUT/profile.tar.gz" -C "$PROF" .
fi
LEFT=$(( END_S - ($(date +%s) - START) ))
if [ -n "${STEP_PROFILE:-}" ] && [ "$LEFT" -gt 40 ]; then
    # Every kernel of one batch-1 tree step and one autoregressive step, in order, on random
    # weights of the preset (the step's cost does not depend on them): the device time and
    # launch count of the code just swept (~60 s with the graphs' capture).
    echo "== batch-1 step profile ($(( LEFT < 120 ? LEFT : 120 )) s at most)"
    STEP_DIR=$(mktemp -d)  # only the text comes back (the device tool returns 8 files at most)
    timeout $(( LEFT < 120 ? LEFT : 120 )) "$PY" scripts/spec_step_profile.py "$STEP_DIR" \
        --random-preset gpu --max-batch 1 --profile 1:64:tree,1:64:none --sequence --no-sweep \
        > /dev/null 2>&1 || echo "== step profile exited with status $?"
    cp "$STEP_DIR/spec_step_profile.txt" "$OUT/step-profile.txt" 2>/dev/null || true
fi
LEFT=$(( END_S - ($(date +%s) - START) ))
if [ -n "${AR_PROFILE_BATCHES:-}" ] && [ "$LEFT" -gt 40 ]; then
    AR_LIMIT=$(( LEFT < ${AR_PROFILE_S:-120} ? LEFT : ${AR_PROFILE_S:-120} ))
    echo "== autoregressive steps, baseline and adaptive, at batches ${AR_PROFILE_BATCHES} (${AR_LIMIT} s)"
    AR_DIR=$(mktemp -d)
    timeout "$AR_LIMIT" "$PY" scripts/ar_step_profile.py "$AR_DIR" --model "$MODEL" --device cuda \
        --batch-sizes "$AR_PROFILE_BATCHES" --temperatures "${AR_PROFILE_TEMPERATURES:-0,0.7}" \
        --methods none,adaptive --adaptive-autoregressive \
        > "$AR_DIR/stdout.txt" 2>&1 || echo "== autoregressive step profile exited with status $?"
    cp "$AR_DIR/ar_step_profile.json" "$OUT/ar-step-profile.json" 2>/dev/null || true
    cp "$AR_DIR/ar_step_profile.txt" "$OUT/ar-step-profile.txt" 2>/dev/null || tail -20 "$AR_DIR/stdout.txt"
fi
LEFT=$(( END_S - ($(date +%s) - START) ))
# The validation takes ~190 s on the H200 (8 prompts): with less it would be cut off and write
# nothing (session 11: 49 s, exit 124), so it is skipped.
if [ "$LEFT" -gt "${VALIDATE_MIN_S:-150}" ]; then
    echo "== simulator validation (${LEFT} s left)"
    timeout "$LEFT" "$PY" scripts/validate_simulator.py --model "$MODEL" --device cuda \
        --dtype bfloat16 --prompts "${VALIDATE_PROMPTS:-8}" --max-tokens 64 --out "$OUT/simulator-validation-h200.json" \
        || echo "== simulator validation exited with status $?"
fi
if [ -n "${SAVE_TRITON_CACHE:-}" ]; then
    scripts/triton_cache.sh pack "$OUT/triton-cache.tar.gz" || true
fi
echo "== done in $(( $(date +%s) - START )) s"
ls -la "$OUT"
