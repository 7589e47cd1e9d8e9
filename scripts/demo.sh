#!/usr/bin/env bash
# The embedded default, end to end on CPU: build the demo models, train, export, assemble.
set -euo pipefail
cd "$(dirname "$0")/.."
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
