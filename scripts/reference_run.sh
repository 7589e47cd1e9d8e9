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
# The text the base wrote for it is the demo's shipped text (data/demo-text; scripts/demo.sh copies it).
rm -rf data/demo-text
(cd runs/reference/run/self-generated && find . -name self-generated.jsonl -o -name self-generated.meta.json) | while read -r f; do
    mkdir -p "data/demo-text/$(dirname "$f")" && cp "runs/reference/run/self-generated/$f" "data/demo-text/$f"
done
echo "wrote TRAINING.json and data/demo-text"
