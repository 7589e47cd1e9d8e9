#!/usr/bin/env bash
# Create .venv with the project installed. Idempotent; no downloads beyond PyPI.
#   bash scripts/setup.sh          the package and its run-time dependencies (the demo's needs)
#   bash scripts/setup.sh --test   and its test extra (pytest, xdist, deepspeed, triton): .ci/run
# Without a GPU the CPU build of torch is installed first, so that the plain `torch`
# requirement does not pull a multi-GB CUDA build. Packages are installed without compiling
# their byte code (--no-compile): Python compiles, on first import, only the modules a run
# imports, which saves about half the set-up's time (bench/results/fresh-clone.md).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    "") extra="" ;;
    --test) extra="[test]" ;;
    *) echo "scripts/setup.sh: unknown argument '$1' (expected nothing or --test)" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
PIP=(.venv/bin/pip install -q --no-compile)
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "${PIP[@]}" torch
    else
        "${PIP[@]}" torch==2.13.0
    fi
fi
needs="occamy_mtp, transformers, accelerate, safetensors, datasets, yaml, matplotlib"
if [ -n "$extra" ]; then
    needs="$needs, pytest, xdist, deepspeed"
    if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then needs="$needs, triton"; fi
fi
if ! .venv/bin/python -c "import $needs" >/dev/null 2>&1; then
    "${PIP[@]}" -e ".$extra"
fi
