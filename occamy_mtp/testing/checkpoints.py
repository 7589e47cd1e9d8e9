"""Tiny Qwen3.5-MoE / Qwen3-Next checkpoints in the real on-disk layout.

Tests, benchmarks and the demo build their models here: a config.json in the
multimodal style (`text_config`, `vision_config`, architectures
`Qwen3_5MoeForConditionalGeneration`) or the text-only style, sharded safetensors with
`model.safetensors.index.json`, `model.language_model.*` or `model.*` base keys, a few
`model.visual.*` tensors that loaders must skip, and `mtp.*` head tensors in either
expert layout. Everything is deterministic in the seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp import files
from occamy_mtp.model.head import MTPHead, SharedWeights

# Literal sizes of the tiny models (real: hidden 2048, 40 layers, 256 experts top-8).
TINY_QWEN3_5 = dict(
    model_type="qwen3_5_moe_text",
    vocab_size=1024,
    hidden_size=64,
    num_hidden_layers=4,  # 3 Gated DeltaNet + 1 full attention, as every 4th real layer
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    mtp_num_hidden_layers=1,
    # partial rotary 0.25 of head_dim 32 = 8 rotary dims = 4 frequencies = 2+1+1 M-RoPE sections
    rope_parameters=dict(
        rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25, mrope_section=[2, 1, 1], mrope_interleaved=True
    ),
)

# The same tiny model in the Qwen3-Next family: 1-D RoPE, dense MLP size, twice the experts.
TINY_QWEN3_NEXT = {
    **TINY_QWEN3_5,
    "model_type": "qwen3_next",
    "intermediate_size": 64,
    "num_experts": 16,  # the real Qwen3-Next has twice the experts of Qwen3.5
    "decoder_sparse_step": 1,
    "rope_parameters": dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
}

# Real dimensions, for accounting on the meta device (docs/reference/CONTRACT.md section 1; Qwen3-Next-80B-A3B's
# config.json). Never instantiated with memory in tests.
QWEN3_5_35B_A3B = dict(
    model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, vocab_size=248_320,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, rms_norm_eps=1e-6,
    tie_word_embeddings=False, mtp_num_hidden_layers=1,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                         mrope_section=[11, 11, 10], mrope_interleaved=True),
)
QWEN3_NEXT_80B_A3B = dict(
    model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48, vocab_size=151_936,
    intermediate_size=5120, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    decoder_sparse_step=1, norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
)

# A small vision tower's worth of tensors: present on disk, never loaded.
_VISION_TENSORS = {
    "model.visual.patch_embed.proj.weight": (16, 3, 2, 4, 4),
    "model.visual.blocks.0.attn.qkv.weight": (48, 16),
    "model.visual.merger.linear_fc1.weight": (64, 64),
}


def tiny_text_config(family: str = "qwen3_5_moe_text", **overrides):
    """The text config of a tiny model of the given family, with field overrides."""
    fields = dict(TINY_QWEN3_5 if family == "qwen3_5_moe_text" else TINY_QWEN3_NEXT)
    fields.update(overrides)
    return ckpt_io.text_config_from_dict(fields, source="tiny config")


def _config_fields(text_config) -> dict:
    """The config.json fields of a text config: those the family's defaults define."""
    fields = {k: v for k, v in text_config.to_dict().items() if k not in ("transformers_version", "_name_or_path", "dtype")}
    for noise in ("architectures", "id2label", "label2id", "chunk_size_feed_forward", "is_encoder_decoder",
                  "output_attentions", "output_hidden_states", "problem_type", "return_dict"):
        fields.pop(noise, None)
    fields["dtype"] = "bfloat16"
    return fields


def config_json(text_config, multimodal: bool, quantization_config: dict | None = None) -> dict:
    """config.json in the layout of the real checkpoints."""
    text = _config_fields(text_config)
    if multimodal and text_config.model_type == "qwen3_5_moe_text":
        out = {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "text_config": text,
            "vision_config": {"model_type": "qwen3_5_moe", "depth": 1, "hidden_size": 16, "out_hidden_size": text["hidden_size"]},
            "image_token_id": text["vocab_size"] - 1,
            "tie_word_embeddings": text["tie_word_embeddings"],
        }
    else:
        arch = "Qwen3_5MoeForCausalLM" if text_config.model_type == "qwen3_5_moe_text" else "Qwen3NextForCausalLM"
        out = {"architectures": [arch], **text}
    if quantization_config is not None:
        out["quantization_config"] = quantization_config
    return out


def random_models(text_config, seed: int = 0):
    """A randomly initialised base (transformers' own class) and head, norms perturbed.

    Norm weights are zero-centred on disk; they are given random values here so that a
    loader that adds 1, or drops a norm, changes the output and fails the tests.
    """
    torch.manual_seed(seed)
    base = ckpt_io.base_model_class(text_config)._from_config(text_config, dtype=torch.float32)
    head = MTPHead(text_config, SharedWeights(base.model.embed_tokens, base.lm_head))
    init_std = text_config.initializer_range
    with torch.no_grad():
        for module in (base, head):
            for name, param in module.named_parameters():
                if "norm" in name and param.ndim == 1:
                    param.normal_(0.0, 0.1)
                elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                    param.normal_(0.0, init_std)  # transformers leaves these uninitialised on some versions
        head.layers[0].mlp.experts.gate_up_proj.normal_(0.0, init_std)
        # MTPHead is built outside transformers' init, so its router starts at zeros:
        # uniform routing with tied top-k, which hides a router loaded from the wrong key.
        head.layers[0].mlp.gate.weight.normal_(0.0, init_std)
    base, head = base.to(torch.bfloat16), head.to(torch.bfloat16)
    # `.to` also rounds the rotary frequency buffers to bf16, which transformers (and
    # our loaders) keep in fp32: rebuild them so the in-memory models are the loaded ones.
    base.model.rotary_emb = type(base.model.rotary_emb)(base.config)
    head.rotary_emb = type(head.rotary_emb)(head.config)
    return base, head


@dataclass(frozen=True)
class TinyCheckpoint:
    path: Path
    text_config: object
    layout: str
    multimodal: bool


def write_checkpoint(
    out_dir: Path,
    text_config,
    base,
    head: MTPHead | None,
    *,
    layout: str = ckpt_io.PER_EXPERT,
    multimodal: bool = True,
    max_shard_bytes: int = 400_000,
    quantization_config: dict | None = None,
    tokenizer_dir: Path | None = None,
) -> TinyCheckpoint:
    """Write base (+ optional head) in the real on-disk layout. bf16 on disk."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(torch.bfloat16) for k, v in ckpt_io.base_checkpoint_tensors(base, layout, multimodal).items()}
    if head is not None:
        head_tensors = ckpt_io.head_checkpoint_tensors(head.state_dict(), layout)
        tensors.update({k: v.to(torch.bfloat16) for k, v in head_tensors.items()})
    if multimodal:
        generator = torch.Generator().manual_seed(1234)
        for key, shape in _VISION_TENSORS.items():
            tensors[key] = torch.randn(shape, generator=generator).to(torch.bfloat16)
    ckpt_io.save_sharded(out_dir, tensors, max_shard_bytes)
    files.write_json(out_dir / "config.json", config_json(text_config, multimodal, quantization_config))
    files.write_json(out_dir / "generation_config.json", {"do_sample": False, "eos_token_id": None})
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out_dir)
    return TinyCheckpoint(out_dir, text_config, layout, multimodal)


def copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    for path in Path(tokenizer_dir).iterdir():
        if path.is_file():
            (Path(out_dir) / path.name).write_bytes(path.read_bytes())


def build_tiny_checkpoint(
    out_dir: Path,
    *,
    family: str = "qwen3_5_moe_text",
    layout: str = ckpt_io.PER_EXPERT,
    multimodal: bool = True,
    seed: int = 0,
    with_head: bool = True,
    tokenizer_dir: Path | None = None,
    **config_overrides,
) -> TinyCheckpoint:
    """Build and write a random tiny checkpoint; the one-call builder tests use."""
    text_config = tiny_text_config(family, **config_overrides)
    base, head = random_models(text_config, seed)
    if multimodal and family != "qwen3_5_moe_text":
        multimodal = False  # Qwen3-Next ships text-only checkpoints
    return write_checkpoint(
        out_dir, text_config, base, head if with_head else None,
        layout=layout, multimodal=multimodal, tokenizer_dir=tokenizer_dir,
    )
