"""How far the library's NVFP4 emulation is from what an FP4 tensor-core GEMM computes, on the demo.

An FP4 tensor core multiplies the e2m1 codes of the input and the weight exactly, sums each
16-element block exactly, scales each block's sum by the two fp8 block scales and accumulates the
blocks in fp32, the two global scales applied last. The emulation (`occamy_mtp.model.quantized`)
instead dequantizes both sides to the model's dtype and multiplies them with an ordinary GEMM: the
same terms, rounded and summed in another order. This script measures, on every NVFP4 linear of
the demo's NVFP4 base and on inputs the base really sees (the sample chats, rendered), each
emulation's largest relative error against the tensor-core arithmetic done in float64, in
float32 and in bfloat16; and, over the whole model, how often the greedy choice of the float32
emulation and of the bfloat16 one differ, beside the same for the unquantized base.

    python -m occamy_mtp demo-models --quantized nvfp4
    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/nvfp4_emulation.py --models runs/demo/models --out nvfp4.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from occamy_mtp.model import checkpoint as ckpt_io  # noqa: E402
from occamy_mtp.model import quantized as q  # noqa: E402
from occamy_mtp.testing.demo_models import _conversations, _packed_sequences  # noqa: E402
from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH  # noqa: E402


def tensor_core(x: torch.Tensor, input_scale: torch.Tensor, packed: torch.Tensor, w_scale: torch.Tensor,
                w_scale_2: torch.Tensor) -> torch.Tensor:
    """(N, out) in float64: e2m1 codes multiplied exactly, summed per 16-element block, each block
    scaled by its two fp8 scales, the blocks summed, the global scales applied last."""
    x_values, x_scale = q.nvfp4_blocks(x.float(), input_scale.float())  # the input's codes, as the W4A4 path rounds them
    x_codes, x_scale = x_values.double(), x_scale.double()[..., None]
    w_codes = q.e2m1_decode(q.unpack_e2m1(packed)).double().reshape(packed.shape[0], -1, q.NVFP4_GROUP)
    block_sums = torch.einsum("nbi,obi->nob", x_codes, w_codes)  # exact: small integers and halves
    scales = x_scale[:, None, :, 0] * w_scale.double()[None]  # (N, out, blocks)
    return (block_sums * scales).sum(-1) * input_scale.double() * w_scale_2.double()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="runs/demo/models")
    parser.add_argument("--windows", type=int, default=8, help="rows of 256 tokens of the rendered sample chats")
    parser.add_argument("--out")
    args = parser.parse_args()
    models = Path(args.models)
    base_dir = models / "base-nvfp4"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models / "tokenizer", local_files_only=True)
    rows = _packed_sequences(tokenizer, _conversations(SAMPLE_DATA_PATH)[-64:], 256)[: args.windows]
    config = ckpt_io.read_config(base_dir)
    raw = ckpt_io.SafetensorsCheckpoint(base_dir)
    model = ckpt_io.load_base(base_dir, dtype=torch.float32, config=config)
    prefix = ckpt_io.base_text_prefix(raw)
    inputs: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    def keep(name: str, x: torch.Tensor) -> None:  # a pre-hook that returns nothing leaves the input as it is
        inputs.setdefault(name, x.detach().reshape(-1, x.shape[-1]))

    handles = [modules[name].register_forward_pre_hook(lambda m, a, name=name: keep(name, a[0]))
               for name, m in modules.items() if isinstance(m, torch.nn.Linear) and (prefix + name[len("model."):] + ".weight_scale") in raw]
    with torch.no_grad():
        logits32 = model(input_ids=rows, use_cache=False).logits
    for handle in handles:
        handle.remove()
    per_module = {}
    for name, x in inputs.items():
        stem = prefix + name[len("model."):]
        packed, w_scale, w_scale_2 = raw.get(stem + ".weight"), raw.get(stem + ".weight_scale"), raw.get(stem + ".weight_scale_2")
        input_scale = raw.get(stem + ".input_scale")
        x = x[:512]
        exact = tensor_core(x, input_scale, packed, w_scale, w_scale_2)
        weight = q.dequantize_nvfp4(packed, w_scale, w_scale_2)
        figures = {}
        for dtype in (torch.float32, torch.bfloat16):
            emulated = torch.nn.functional.linear(q.fake_quantize_nvfp4(x.to(dtype), input_scale), weight.to(dtype)).double()
            figures[str(dtype).split(".")[-1]] = float((emulated - exact).abs().max() / exact.abs().max())
        per_module[name] = figures
    model16 = ckpt_io.load_base(base_dir, dtype=torch.bfloat16, config=config)
    with torch.no_grad():
        logits16 = model16(input_ids=rows, use_cache=False).logits.float()
    agree = float((logits16.argmax(-1) == logits32.argmax(-1)).float().mean())
    with torch.no_grad():  # the same comparison on the unquantized base: what bf16 arithmetic alone moves
        plain = [ckpt_io.load_base(models / "base", dtype=d)(input_ids=rows, use_cache=False).logits.float().argmax(-1)
                 for d in (torch.float32, torch.bfloat16)]
    plain_agree = float((plain[0] == plain[1]).float().mean())
    result = {
        "base": str(base_dir), "positions": int(rows.numel()), "linears": len(per_module),
        "max_relative_error_float32": max(f["float32"] for f in per_module.values()),
        "max_relative_error_bfloat16": max(f["bfloat16"] for f in per_module.values()),
        "greedy_agreement_bfloat16_vs_float32": agree,
        "greedy_agreement_bfloat16_vs_float32_unquantized_base": plain_agree,
        "max_logit_difference_bfloat16_vs_float32": float((logits16 - logits32).abs().max()),
        "per_module": per_module,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "per_module"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
