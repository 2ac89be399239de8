#!/usr/bin/env bash
# Carry Triton's compiled kernels from one GPU run to the next (a fresh machine compiles the
# engines' kernels for ~90 s before anything is timed):
#
#   scripts/triton_cache.sh unpack TAR_GZ    # into $TRITON_CACHE_DIR (made if missing)
#   scripts/triton_cache.sh pack OUT_TAR_GZ  # $TRITON_CACHE_DIR packed, if it packs to at most
#                                            # TRITON_CACHE_MAX_MB (default 8); else nothing
#
# Triton finds a kernel in its cache by the hash of its source, target and options, so a cache
# from the same Triton on the same kind of GPU serves the same commit's kernels; any other
# entry is simply not found. Exit status 0 also when there is nothing to do (no TAR_GZ, or too
# large to pack): the run goes on compiling.
set -euo pipefail
: "${TRITON_CACHE_DIR:?set TRITON_CACHE_DIR}"
case "${1:-}" in
    unpack)
        tar_gz=${2:?usage: $0 unpack TAR_GZ}
        mkdir -p "$TRITON_CACHE_DIR"
        if [ ! -f "$tar_gz" ]; then
            echo "== Triton cache: no $tar_gz (compiling)"
        elif tar xzf "$tar_gz" -C "$TRITON_CACHE_DIR"; then
            echo "== Triton cache: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files from $tar_gz"
        else
            echo "== Triton cache: could not unpack $tar_gz (compiling)"
        fi
        ;;
    pack)
        out=${2:?usage: $0 pack OUT_TAR_GZ}
        packed=$(mktemp)
        tar czf "$packed" -C "$TRITON_CACHE_DIR" .
        bytes=$(stat -c %s "$packed")
        limit=$(( ${TRITON_CACHE_MAX_MB:-8} * 1048576 ))
        if [ "$bytes" -le "$limit" ]; then
            mv "$packed" "$out"
            echo "== Triton cache packed: $out ($(( bytes / 1024 )) KiB)"
        else
            rm -f "$packed"
            echo "== Triton cache not packed: $(( bytes / 1048576 )) MB > TRITON_CACHE_MAX_MB=${TRITON_CACHE_MAX_MB:-8}"
        fi
        ;;
    *)
        echo "usage: $0 unpack TAR_GZ | pack OUT_TAR_GZ" >&2
        exit 2
        ;;
esac
