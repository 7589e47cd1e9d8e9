#!/usr/bin/env bash
# Create .venv with the project installed. Idempotent; no downloads beyond PyPI.
# Without a GPU the CPU build of torch is installed first, so that the plain `torch`
# requirement does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        .venv/bin/pip install -q torch
    else
        .venv/bin/pip install -q torch==2.13.0
    fi
fi
needs="occamy_mtp, transformers, accelerate, pytest, xdist, deepspeed"
if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then needs="$needs, triton"; fi
if ! .venv/bin/python -c "import $needs" 2>/dev/null; then
    .venv/bin/pip install -q -e ".[test]"
fi
