#!/usr/bin/env bash
# The whole recipe as successive processes on one machine: the first pays the machine's
# start-up that is not avoided (Triton compilation, the autotuning no fixed config covers)
# and leaves it on disk; the later ones show what a run costs once that is paid. Each
# argument is one process's memory cap in GiB (0: none), as a smaller card would have.
#
#   OUT=results bash bench/startup_runs.sh 0 0 79.6 72
#
# Writes $OUT/runN.json (bench_recipe.py's report: each phase's seconds, start-up and work,
# peak memory), runN.log, runN-export-profile.txt, and autotune.tar: the autotuning Triton
# kept on disk (bench/kernel_configs.py turns it into fixed configs).
set -uo pipefail
OUT=${OUT:?set OUT to a directory}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
n=0
for cap in "$@"; do
    n=$((n + 1))
    started=$(date +%s)
    TRITON_PRINT_AUTOTUNING=1 python3 bench/bench_recipe.py --compute fast --generate-windows 320 --generate-batch-size 0 \
        --fast-tokens 0 --memory-cap-gib "$cap" --profile-export "$OUT/run$n-export-profile.txt" --out "$OUT/run$n.json" \
        >"$OUT/run$n.log" 2>&1 || { echo "run$n: exit $?"; tail -30 "$OUT/run$n.log"; }
    echo "run$n (cap $cap GiB): $(( $(date +%s) - started )) s in all, start-up of the process included"
    grep -E '^(self_generate|cache_fast|train|export):' "$OUT/run$n.log" | cut -c1-160
    grep -E 'fixed configs|autotune on first|sized to the GPU|Triton autotuning for' "$OUT/run$n.log" | sort | uniq -c | head -20
done
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -cf "$OUT/autotune.tar" -T -) || true
