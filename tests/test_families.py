"""The table of base families (`occamy_mtp.families`): each row names classes that exist and fit together."""

from __future__ import annotations

import pytest
import torch

from occamy_mtp.families import FAMILIES, MULTIMODAL_TYPES, draft_architectures, fast_paths, family_of
from occamy_mtp.model.head import MTPHead, SharedWeights
from occamy_mtp.testing.checkpoints import tiny_text_config


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_family_names_classes_that_exist_and_build_a_head(model_type):
    family = family_of(model_type)
    assert family.cls("config_class")().model_type == model_type  # the config class is the family's own
    for name in ("causal_lm", "decoder_layer", "norm", "rotary", "gated_deltanet"):
        assert family.cls(name).__module__ == family.modeling, name
    config = tiny_text_config(model_type)
    base = family.cls("causal_lm")(config)
    head = MTPHead(config, SharedWeights(base.model.embed_tokens, base.lm_head))
    assert isinstance(head.layers[0], family.cls("decoder_layer")) and isinstance(head.norm, family.cls("norm"))
    assert family.n_predict_fields and all(arch.endswith("MTP") for arch in family.draft_architectures.values())
    assert fast_paths(config) is family.fast_paths


def test_the_lookups_are_the_table_s():
    assert family_of("llama") is None and not fast_paths(tiny_text_config("qwen3_next"))
    assert all(family_of(text) is not None for text in MULTIMODAL_TYPES.values())
    assert set(draft_architectures()) == {a for f in FAMILIES.values() for a in f.draft_architectures}
    with torch.device("meta"):  # the fast paths refuse a family without them, naming it
        from occamy_mtp.base.fastdecode import BatchDecoder
        from occamy_mtp.families import QWEN3_NEXT

        base = QWEN3_NEXT.cls("causal_lm")(tiny_text_config("qwen3_next"))
        with pytest.raises(ValueError, match="model_type 'qwen3_next'"):
            BatchDecoder(base, batch=1, positions=4)
