#!/usr/bin/env bash
# Regenerate the repository's TRAINING.json: the record of the embedded default's
# reference run. Trains from scratch in runs/reference (the demo models are reused
# when runs/demo/models already holds the same build).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
$PY -m occamy_mtp.testing.demo_models --out runs/demo/models
rm -rf runs/reference
$PY train.py --config configs/demo.yaml output.dir=runs/reference
$PY export.py --config configs/demo.yaml output.dir=runs/reference
cp runs/reference/TRAINING.json TRAINING.json
echo "wrote TRAINING.json"
