#!/usr/bin/env bash
# The whole recipe twice on one machine, as two processes: the first pays the machine's
# start-up (Triton compilation, autotuning) and leaves it on disk; the second shows what a
# run costs once that is paid. Each process's memory is capped as a smaller card's would be.
#
#   OUT=results bash bench/startup_runs.sh [FIRST_CAP_GIB] [SECOND_CAP_GIB]
#
# Writes $OUT/first.json and $OUT/second.json (bench_recipe.py's report: each phase's
# seconds, start-up and work, peak memory), their logs, the export's profile, and the
# autotuning Triton kept on disk (the configs it chose, for kernels/README.md).
set -euo pipefail
OUT=${OUT:?set OUT to a directory}
FIRST=${1:-72}
SECOND=${2:-79.6}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
run() {  # name cap
    TRITON_PRINT_AUTOTUNING=1 python3 bench/bench_recipe.py --compute fast --generate-windows 320 --generate-batch-size 0 \
        --fast-tokens 0 --memory-cap-gib "$2" --profile-export "$OUT/$1-export-profile.txt" --out "$OUT/$1.json" \
        >"$OUT/$1.log" 2>&1 || { echo "$1: exit $?"; tail -40 "$OUT/$1.log"; }
    grep -E '^(self_generate|cache_fast|train|export):' "$OUT/$1.log" || true
}
run first "$FIRST"
run second "$SECOND"
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -cf "$OUT/autotune.tar" -T -) || true
tar -tf "$OUT/autotune.tar" | wc -l
