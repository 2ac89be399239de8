#!/usr/bin/env bash
# Train the demo (and optionally the gpu) model on an H200 in one command.
#
#   scripts/train_on_h200.sh [demo|gpu|all]
#
# Prints progress; writes each model folder to $WORK/<preset> and, for the demo model, packs it
# into $OUT as gzip'd tar parts of 15 MiB (a device run returns at most 8 files of 16 MiB), with
# a sha256 list. Rebuild the folder on the other side with:
#   cat demo.tar.gz.part-* | tar -xzf - -C models/      # -> models/demo/
# Env: OUT (default runs/h200), WORK (default /tmp/mtpserve-train), PYTHON (default python3),
# DEMO_BUDGET_S (default 420: corpus + tokenizer + training; imports, export, packing add ~20 s),
# GPU_BUDGET_S (default 540: the `gpu` model of the headline figures, trained in one call and
# benchmarked in the next on the same machine: WORK=$PWD/runs/bench then puts it where
# scripts/gpu_bench.sh looks), EXTRA_ARGS (passed to every training command).
set -euo pipefail
cd "$(dirname "$0")/.."
WHICH=${1:-demo}
OUT=${OUT:-runs/h200}
WORK=${WORK:-/tmp/mtpserve-train}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
mkdir -p "$OUT" "$WORK"

"$PY" -c 'import torch, transformers, tokenizers; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-", "transformers", transformers.__version__, "tokenizers", tokenizers.__version__)'

train() {  # preset budget_s pack(0|1)
    local name=$1 budget=$2 pack=$3
    rm -rf "${WORK:?}/$name" "${WORK:?}/$name.work"
    # shellcheck disable=SC2086
    "$PY" -m train --preset "$name" --out "$WORK/$name" --work-dir "$WORK/$name.work" \
        --time-budget-s "$budget" ${EXTRA_ARGS:-} 2>&1 | tee "$OUT/train_$name.log"
    cp "$WORK/$name/training_log.json" "$OUT/training_log_$name.json"
    if [ "$pack" = 1 ]; then
        tar -C "$WORK" -cf - "$name" | gzip -1 | split -b 15m -d -a 1 - "$OUT/$name.tar.gz.part-"
        (cd "$OUT" && sha256sum "$name".tar.gz.part-* > "$name.sha256")
    fi
    du -sh "$WORK/$name"
}

case "$WHICH" in
    demo) train demo "${DEMO_BUDGET_S:-420}" 1 ;;
    gpu) train gpu "${GPU_BUDGET_S:-540}" 0 ;;
    all) train demo "${DEMO_BUDGET_S:-420}" 1; train gpu "${GPU_BUDGET_S:-540}" 0 ;;
    *) echo "usage: $0 [demo|gpu|all]" >&2; exit 2 ;;
esac
ls -la "$OUT"
