"""The base families the library reads, trains a head for and serves: one table.

Each family is a row: its transformers classes (config, causal LM, and the decoder layer,
RMSNorm and rotary embedding the head is built from, the Gated DeltaNet whose kernels are
routed by device), the multimodal checkpoint that may wrap it, whether its rotary takes
text M-RoPE's three position rows, what the engines read to build its MTP draft (SGLang's
draft architecture, the `n_predict` config fields), and whether the library's fast paths
(the packed base pass, the static decoder and runners) run it. Adding a family is a row
here; docs/developer/ADDING.md walks it through.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    model_type: str
    """The text config's `model_type`."""
    label: str
    """The family in messages."""
    modeling: str
    """transformers' modeling module of the family, whose classes are named below."""
    config_class: str
    causal_lm: str
    decoder_layer: str
    norm: str
    rotary: str
    gated_deltanet: str
    multimodal_type: str | None = None
    """The `model_type` of a multimodal checkpoint whose `text_config` is this family's (None: none)."""
    text_mrope: bool = False
    """Its rotary embedding takes (3, B, T) position rows (M-RoPE; for text all three are the position)."""
    draft_architectures: dict[str, str] = field(default_factory=dict)
    """A base's `architectures` entry -> the MTP draft class SGLang builds from it (assembly checks it)."""
    n_predict_fields: tuple[str, ...] = ()
    """config.json fields the engines read for the number of MTP layers (assembly sets them)."""
    fast_paths: bool = False
    """`base.fastbase` (the packed pass), `base.fastdecode` (the static decoder and runners) run it on CUDA."""

    def module(self):
        return importlib.import_module(self.modeling)

    def cls(self, name: str) -> type:
        """One of the family's classes by its field name (`config_class`, `decoder_layer`, ...)."""
        class_name = getattr(self, name)
        if name == "config_class":
            return getattr(importlib.import_module("transformers"), class_name)
        return getattr(self.module(), class_name)


QWEN3_5_MOE = Family(
    model_type="qwen3_5_moe_text", label="Qwen3.5-MoE",
    modeling="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    config_class="Qwen3_5MoeTextConfig", causal_lm="Qwen3_5MoeForCausalLM", decoder_layer="Qwen3_5MoeDecoderLayer",
    norm="Qwen3_5MoeRMSNorm", rotary="Qwen3_5MoeTextRotaryEmbedding", gated_deltanet="Qwen3_5MoeGatedDeltaNet",
    multimodal_type="qwen3_5_moe", text_mrope=True,
    draft_architectures={"Qwen3_5MoeForConditionalGeneration": "Qwen3_5ForCausalLMMTP"},
    n_predict_fields=("mtp_num_hidden_layers",),  # vLLM's n_predict for Qwen3.5; the library's own has_mtp
    fast_paths=True,
)
QWEN3_NEXT = Family(
    model_type="qwen3_next", label="Qwen3-Next",
    modeling="transformers.models.qwen3_next.modeling_qwen3_next",
    config_class="Qwen3NextConfig", causal_lm="Qwen3NextForCausalLM", decoder_layer="Qwen3NextDecoderLayer",
    norm="Qwen3NextRMSNorm", rotary="Qwen3NextRotaryEmbedding", gated_deltanet="Qwen3NextGatedDeltaNet",
    draft_architectures={"Qwen3NextForCausalLM": "Qwen3NextForCausalLMMTP"},
    n_predict_fields=("mtp_num_hidden_layers", "num_nextn_predict_layers"),  # vLLM's n_predict for Qwen3-Next
)

FAMILIES: dict[str, Family] = {family.model_type: family for family in (QWEN3_5_MOE, QWEN3_NEXT)}
MULTIMODAL_TYPES: dict[str, str] = {f.multimodal_type: f.model_type for f in FAMILIES.values() if f.multimodal_type}
"""Top-level model_type of a multimodal checkpoint -> model_type of its text_config."""


def family_of(model_type: str | None) -> Family | None:
    """The family of a text config's `model_type` (None when the library does not read it)."""
    return FAMILIES.get(model_type)


def fast_paths(config) -> bool:
    """Whether the library's fast paths run a model of this config's family. Whether they run a given
    base (not where its inputs are fake-quantized, nor where its layers are sharded) is what its
    opening decided: `base.frozen.FrozenBase.fast_paths`."""
    family = family_of(getattr(config, "model_type", None))
    return family is not None and family.fast_paths


def draft_architectures() -> dict[str, str]:
    """Every family's base architectures -> SGLang's MTP draft class."""
    return {base: draft for family in FAMILIES.values() for base, draft in family.draft_architectures.items()}
