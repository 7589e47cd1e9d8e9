#!/usr/bin/env bash
# The embedded default, end to end on CPU: build the demo models, train, export, assemble, and
# say whether the head is, byte for byte, the reference run's (the repository's TRAINING.json).
set -euo pipefail
cd "$(dirname "$0")/.."
# One thread per process, as the reference run: the thread count decides how floating-point sums
# are split, so it is part of what makes the head's bytes (occamy_mtp/record.py, BYTES_DEPEND_ON).
# At the demo's size one thread is also the fastest.
export OMP_NUM_THREADS=1
bash scripts/setup.sh
PY=.venv/bin/python
$PY -m occamy_mtp demo-models --out runs/demo/models
# The base's own text ships beside its models (data/demo-text, what the reference run's base wrote:
# tests/test_demo_text.py holds it to what the library writes), so that the demo does not wait about
# three minutes for it; OCCAMY_DEMO_WRITE_TEXT=1 has the base write it here instead.
if [ ! -e runs/demo/self-generated ] && [ -z "${OCCAMY_DEMO_WRITE_TEXT:-}" ]; then
    mkdir -p runs/demo && cp -r data/demo-text runs/demo/self-generated
fi
if [ -f runs/demo/train-summary.json ]; then
    echo "runs/demo already trained; remove runs/demo (keep runs/demo/models) to train again"
else
    $PY train.py --config configs/demo.yaml $( [ -d runs/demo/checkpoints ] && echo --resume )
fi
$PY export.py --config configs/demo.yaml
$PY assemble_head.py --base runs/demo/models/base --head runs/demo/mtp-trained.safetensors --out runs/demo/assembled --force
$PY -m occamy_mtp compare runs/demo/TRAINING.json TRAINING.json
