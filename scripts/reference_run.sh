#!/usr/bin/env bash
# Regenerate the repository's TRAINING.json: the record of the embedded default's
# reference run, in runs/reference (its models are reused when they are the same build).
set -euo pipefail
cd "$(dirname "$0")/.."
# The reference figures were made with one thread per process; the thread count changes
# the floating-point sums, so it is part of the demo models' identity.
export OMP_NUM_THREADS=1
bash scripts/setup.sh
PY=.venv/bin/python
$PY -m occamy_mtp demo-models --out runs/reference/models
rm -rf runs/reference/run
$PY train.py --config configs/demo.yaml model.base=runs/reference/models/base model.donor_head=runs/reference/models/donor output.dir=runs/reference/run
$PY export.py --config configs/demo.yaml model.base=runs/reference/models/base model.donor_head=runs/reference/models/donor output.dir=runs/reference/run
cp runs/reference/run/TRAINING.json TRAINING.json
echo "wrote TRAINING.json"
