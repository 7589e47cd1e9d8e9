"""How often an FP8 base's greedy choice moves when its activations are rounded as an engine's W8A8
path rounds them (`model.fp8_activations=fp8`), beside how often the weights' FP8 rounding moves it.

    python bench/fp8_activations_agreement.py      # after the demo's models and an FP8 copy in blocks of 32

Reads runs/w8a8/models (`demo-models --out runs/w8a8/models`) and its FP8 copy in blocks of 32 x 32
(`testing.quantize.write_quantized_copy`: the demo's hidden size, 64, is not a whole number of the
family's 128-feature groups); 24 chats of data/sample.jsonl, 256 tokens each, through the bf16 base,
the FP8 base (W8A16) and the FP8 base with its activations emulated (W8A8), in bf16.
"""
import json, torch
from transformers import AutoTokenizer
from occamy_mtp.model import checkpoint as ckpt_io
torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained("runs/w8a8/models/tokenizer")
texts = []
for line in open("data/sample.jsonl"):
    rec = json.loads(line)
    msgs = rec.get("messages") or rec.get("conversations")
    texts.append(tok.apply_chat_template(msgs, tokenize=False))
    if len(texts) == 64: break
ids = [tok(t, add_special_tokens=False).input_ids[:256] for t in texts]
ids = [i for i in ids if len(i) == 256][:24]
x = torch.tensor(ids)
out = {}
for name, path, act in [("bf16", "runs/w8a8/models/base", "bf16"), ("w8a16", "runs/w8a8/models/base-fp8-b32", "bf16"),
                        ("w8a8", "runs/w8a8/models/base-fp8-b32", "fp8")]:
    base = ckpt_io.load_base(path, dtype=torch.bfloat16, fp8_activations=act)
    with torch.no_grad():
        out[name] = torch.cat([base(input_ids=x[i:i+4]).logits.argmax(-1) for i in range(0, len(x), 4)])
n = out["bf16"].numel()
for a, b in [("bf16", "w8a16"), ("w8a16", "w8a8"), ("bf16", "w8a8")]:
    print(a, b, f"{(out[a] == out[b]).float().mean().item():.4f}", n)
