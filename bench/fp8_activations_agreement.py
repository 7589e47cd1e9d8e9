"""How often an FP8 base's greedy choice moves when its activations are rounded as an engine's W8A8
path rounds them (`model.fp8_activations=fp8`), beside how often the weights' FP8 rounding moves it.

    python bench/fp8_activations_agreement.py      # after the demo's models and an FP8 copy in blocks of 32

Reads runs/w8a8/models (`demo-models --out runs/w8a8/models`) and its FP8 copy in blocks of 32 x 32
(`testing.quantize.write_quantized_copy`: the demo's hidden size, 64, is not a whole number of the
family's 128-feature groups). The first chats of data/sample.jsonl (`data.reader.ChatReader`), each
rendered with the tokenizer's chat template and cut to `--tokens`, those at least that long, go
through the bf16 base, the FP8 base (W8A16) and the FP8 base with its activations emulated (W8A8), in
bf16; printed: the share of positions where each pair's greedy choices agree.
"""

from __future__ import annotations

import argparse
from itertools import islice
from pathlib import Path

import torch
from transformers import AutoTokenizer

from occamy_mtp.data.reader import ChatReader
from occamy_mtp.model import checkpoint as ckpt_io
from report import write_report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="runs/w8a8/models", help="the demo's models: base and tokenizer")
    parser.add_argument("--fp8-base", default="runs/w8a8/models/base-fp8-b32")
    parser.add_argument("--data", default="data/sample.jsonl")
    parser.add_argument("--read", type=int, default=64, help="chats read, of which the long enough are kept")
    parser.add_argument("--chats", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    models = Path(args.models)
    tokenizer = AutoTokenizer.from_pretrained(models / "tokenizer", local_files_only=True)
    rows = []
    for conversation in islice(ChatReader([args.data]), args.read):
        messages = [{"role": m.role, "content": m.content} for m in conversation.messages]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False).input_ids[:args.tokens]
        if len(ids) == args.tokens:
            rows.append(ids)
    inputs = torch.tensor(rows[:args.chats])
    choices = {}
    for name, path, activations in (("bf16", models / "base", "bf16"), ("w8a16", args.fp8_base, "bf16"),
                                    ("w8a8", args.fp8_base, "fp8")):
        base = ckpt_io.load_base(path, dtype=torch.bfloat16, fp8_activations=activations)
        with torch.no_grad():
            choices[name] = torch.cat([base(input_ids=inputs[i:i + args.batch]).logits.argmax(-1)
                                       for i in range(0, len(inputs), args.batch)])
    result = {"positions": choices["bf16"].numel(), "agreement": {
        f"{a} / {b}": float((choices[a] == choices[b]).float().mean()) for a, b in
        (("bf16", "w8a16"), ("w8a16", "w8a8"), ("bf16", "w8a8"))}}
    write_report(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
