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
if [ -f runs/demo/train-summary.json ]; then
    echo "runs/demo already trained; remove runs/demo (keep runs/demo/models) to train again"
else
    $PY train.py --config configs/demo.yaml $( [ -d runs/demo/checkpoints ] && echo --resume )
fi
$PY export.py --config configs/demo.yaml
$PY assemble_head.py --base runs/demo/models/base --head runs/demo/mtp-trained.safetensors --out runs/demo/assembled --force
$PY -m occamy_mtp compare runs/demo/TRAINING.json TRAINING.json
