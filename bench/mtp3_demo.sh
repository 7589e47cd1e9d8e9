#!/usr/bin/env bash
# MTP-3 vs step-1 training on the embedded default, measured on self-generated text.
#
#   bash bench/mtp3_demo.sh        (after bash scripts/demo.sh has built runs/demo/models)
#
# 1. the demo base regenerates the sample chats' answers greedily (thinking disabled);
# 2. the same recipe is trained at draft_steps=1 and at draft_steps=3 on that text;
# 3. both heads (and the donor) are evaluated on the heldout windows of that text, where
#    the offline chain is exact, and with the reference speculative decoder.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
SELF=runs/demo-selfgen/sample.self.jsonl
$PY -m occamy_mtp.generate --base runs/demo/models/base --data data/sample.jsonl --out "$SELF" \
    --dtype float32 --batch-size 16 --max-new-tokens 382 --no-progress
for k in 1 3; do
    out=runs/demo-mtp3-k$k
    overrides=(train.draft_steps=$k output.dir=$out)
    [ "$k" = 1 ] && overrides+=("train.step_loss_weights=[]")
    [ -f $out/train-summary.json ] || $PY train.py --config configs/demo-mtp3.yaml "${overrides[@]}"
    $PY export.py --config configs/demo-mtp3.yaml "${overrides[@]}"
    $PY -m occamy_mtp.evaluate --base runs/demo/models/base --head $out/mtp-trained.safetensors \
        --donor runs/demo/models/donor --data "$SELF" --dtype float32 --steps 3 \
        --reference-decoder --max-new-tokens 96 --out $out/eval
done
