"""Quantized copies of a bf16 base in the layouts users serve: the family's block-wise FP8 and
ModelOpt's NVFP4 (`occamy_mtp.model.quantized` reads both). The demo and the tests build theirs here.

    write_quantized_copy(Path("runs/demo/models/base"), Path("runs/demo/models/base-fp8"), "fp8")

Quantized: the decoder layers' linear projections (attention, Gated DeltaNet in/out
projections, every expert and the shared expert). Kept as stored: the embedding, lm_head, norms,
the convolution, the routers and shared-expert gates, the MTP head (`mtp.*`, which assembly keeps
out of the quantization too) and the vision tower. An NVFP4 linear whose input is not a multiple
of 16 elements is kept as well, as ModelOpt keeps it. NVFP4's `input_scale` is calibrated: the
largest input each linear sees on `calibration` token ids, over 6 x 448.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from occamy_mtp import files
from occamy_mtp.base.frozen import FrozenBase
from occamy_mtp.config import ModelSettings
from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.model import quantized as q
from occamy_mtp.model.fp8_weights import keep_layer

_LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|"
                     r"out_proj|gate_proj|up_proj|down_proj)\.weight$")
KEPT = ["lm_head", "embed_tokens", "norm", "conv1d", "mlp.gate", "shared_expert_gate", "mtp", "visual"]
_CALIBRATION_SEED = 0


def _quantizes(key: str, shape: tuple, scheme: str) -> bool:
    if key.startswith((ckpt_io.HEAD_PREFIX, "model.visual.", "visual.")) or ".mlp.gate.weight" in key:
        return False
    if not _LINEAR.search(key) or len(shape) != 2:
        return False
    return scheme != q.NVFP4 or shape[-1] % q.NVFP4_GROUP == 0


def _input_amax(source: Path, calibration: list[list[int]]) -> dict[str, float]:
    """The largest absolute input of each linear of the base at `source` (disk names), over the
    calibration windows; per expert for the fused experts."""
    base = FrozenBase.open(ModelSettings(base=str(source), dtype="float32"), "cpu")
    prefix = ckpt_io.base_text_prefix(ckpt_io.SafetensorsCheckpoint(source))
    amax: dict[str, float] = {}

    def disk(name: str) -> str:
        return prefix + name[len(ckpt_io.TEXT_PREFIX):] if name.startswith(ckpt_io.TEXT_PREFIX) else name

    def note(key: str, x: torch.Tensor) -> None:
        if x.numel():
            amax[key] = max(amax.get(key, 0.0), float(x.abs().max()))

    handles = []
    for name, module in base.named_modules():
        if isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_pre_hook(
                lambda m, args, key=disk(name) + ".weight": note(key, args[0])))
        elif hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and module.gate_up_proj.dim() == 3:
            def experts_hook(m, args, stem=disk(name)):
                hidden, index = args[0], args[1]
                for expert in index.unique().tolist():
                    rows = (index == expert).any(dim=-1)
                    x = hidden[rows]
                    gate, up = torch.nn.functional.linear(x, m.gate_up_proj[expert]).chunk(2, dim=-1)
                    for proj in ("gate_proj", "up_proj"):
                        note(f"{stem}.{expert}.{proj}.weight", x)
                    note(f"{stem}.{expert}.down_proj.weight", m.act_fn(gate) * up)
            handles.append(module.register_forward_pre_hook(experts_hook))
    with torch.no_grad():
        for ids in calibration:
            base(input_ids=torch.tensor([ids]), use_cache=False)
    for handle in handles:
        handle.remove()
    return amax


def keep_in_fp8(base: torch.nn.Module, block: tuple[int, int] = (128, 128)) -> torch.nn.Module:
    """`base`, an in-memory base, with its decoder layers' weights quantized as `write_quantized_copy`
    quantizes a checkpoint's (gate's and up's rows of a fused gate_up_proj each in their own blocks, as
    they are stored per expert) and kept in FP8 (`fp8_weights.keep_layer`), a layer at a time: for the
    benches at full size, where the bf16 base is built on the card and no checkpoint is written."""
    dtype = next(base.parameters()).dtype
    buffers: dict = {}
    for layer in base.model.layers:
        held = {}
        for name, param in list(layer.named_parameters()):
            if name.endswith("experts.gate_up_proj"):
                half = param.shape[-2] // 2
                (gate, gate_scale), (up, up_scale) = (q.quantize_fp8(part, block) for part in param.split(half, dim=-2))
                held[name] = (torch.cat([gate, up], dim=-2), (half, half), (gate_scale, up_scale))
            elif name.endswith("experts.down_proj") or _quantizes(f"{ckpt_io.LAYERS_PREFIX}0.{name}", tuple(param.shape), q.FP8):
                codes, scale = q.quantize_fp8(param, block)
                held[name] = (codes, (param.shape[-2],), (scale,))
        keep_layer(layer, held, block, dtype, buffers)
    return base


def write_quantized_copy(source: Path, target: Path, scheme: str, *, block: tuple[int, int] = (128, 128),
                         calibration: list[list[int]] | None = None) -> Path:
    """Write `source` (a bf16 base checkpoint directory) quantized under `scheme` (q.FP8 or q.NVFP4)
    into `target`, with every other file of the directory (config, tokenizer) beside it; returns
    `target`. Fused expert tensors are written per expert, as the published quantized checkpoints
    are. `calibration`: token-id windows for NVFP4's input scales (default: 8 random windows)."""
    source, target = Path(source), Path(target)
    ckpt = ckpt_io.SafetensorsCheckpoint(source)
    tensors: dict[str, torch.Tensor] = {}
    for key in ckpt.keys():
        tensor = ckpt.get(key)
        tensors.update(ckpt_io.fused_to_per_expert(key, tensor) if ckpt_io._FUSED_KEY.match(key) else {key: tensor})
    if scheme == q.NVFP4 and calibration is None:
        vocab = ckpt_io.read_config(source).text_config.vocab_size
        generator = torch.Generator().manual_seed(_CALIBRATION_SEED)
        calibration = [torch.randint(0, vocab, (64,), generator=generator).tolist() for _ in range(8)]
    amax = _input_amax(source, calibration) if scheme == q.NVFP4 else {}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if not _quantizes(key, tuple(tensor.shape), scheme):
            out[key] = tensor
        elif scheme == q.FP8:
            out[key], out[key + "_scale_inv"] = q.quantize_fp8(tensor, block)
        else:
            stem = key[: -len(".weight")]
            out[key], out[stem + ".weight_scale"], out[stem + ".weight_scale_2"] = q.quantize_nvfp4(tensor)
            seen = amax.get(key, 0.0)
            out[stem + ".input_scale"] = torch.tensor(seen / (q.E2M1_MAX * q.FP8_MAX) if seen > 0 else 1.0, dtype=torch.float32)
    target.mkdir(parents=True, exist_ok=True)
    ckpt_io.save_sharded(target, out, max_shard_bytes=400_000)
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copyfile(path, target / path.name)
    raw = json.loads((source / "config.json").read_text())
    if scheme == q.FP8:
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block), "modules_to_not_convert": KEPT}
    else:
        raw["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": q.NVFP4_GROUP,
                                      "ignore": KEPT}
        files.write_json(target / q.HF_QUANT_CONFIG_NAME, {
            "producer": {"name": "modelopt", "version": "occamy-mtp demo"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": q.NVFP4_GROUP,
                             "exclude_modules": KEPT}})
    files.write_json(target / "config.json", raw)
    return target
