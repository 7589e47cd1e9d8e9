"""Checkpoint reading: the base and the donor head come back exactly as written, in
every layout docs/reference/CONTRACT.md section 3 accepts, and every kind of bad checkpoint is a clear error
that names the tensor or file and the shapes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp import files
from occamy_mtp.model.checkpoint import FUSED, PER_EXPERT, CheckpointError, SafetensorsCheckpoint
from occamy_mtp.model.head import SharedWeights
from occamy_mtp.testing.checkpoints import random_models, tiny_text_config

pytestmark = pytest.mark.usefixtures("single_thread")

QWEN3_5, QWEN3_NEXT = "qwen3_5_moe_text", "qwen3_next"

BASE_VARIANTS = [
    (QWEN3_5, PER_EXPERT, True),
    (QWEN3_5, FUSED, True),
    (QWEN3_5, PER_EXPERT, False),
    (QWEN3_5, FUSED, False),
    (QWEN3_NEXT, PER_EXPERT, False),
    (QWEN3_NEXT, FUSED, False),
]
HEAD_VARIANTS = [(QWEN3_5, PER_EXPERT, True), (QWEN3_5, FUSED, True), (QWEN3_NEXT, PER_EXPERT, False), (QWEN3_NEXT, FUSED, False)]


def variant_id(variant):
    family, layout, multimodal = variant
    return f"{family}-{layout}-{'multimodal' if multimodal else 'text'}"


def read_all(path: Path) -> dict[str, torch.Tensor]:
    ckpt = SafetensorsCheckpoint(path)
    return {k: ckpt.get(k) for k in ckpt.keys()}


def write_variant(src: Path, dst: Path, tensors: dict[str, torch.Tensor], single_file: bool = False) -> Path:
    """A copy of checkpoint `src` (its config) holding `tensors`, sharded like the fixtures."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    if single_file:
        files.save_safetensors(dst / ckpt_io.SINGLE_NAME, tensors)
    else:
        ckpt_io.save_sharded(dst, tensors, max_shard_bytes=400_000)
    return dst


def index_of(path: Path) -> dict:
    return json.loads((path / ckpt_io.INDEX_NAME).read_text())


# ----------------------------------------------------------------------------------
# The base
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", BASE_VARIANTS, ids=variant_id)
def test_load_base_equals_the_written_model(tiny_checkpoint, monkeypatch, variant):
    written = tiny_checkpoint(*variant)
    read = []
    original_get = SafetensorsCheckpoint.get
    monkeypatch.setattr(SafetensorsCheckpoint, "get", lambda self, key: read.append(key) or original_get(self, key))

    base = ckpt_io.load_base(written.path)

    on_disk = SafetensorsCheckpoint(written.path).keys()
    assert any(k.startswith("model.visual.") for k in on_disk) == written.multimodal
    assert any(k.startswith("mtp.") for k in on_disk)
    assert not [k for k in read if k.startswith("model.visual.") or k.startswith("mtp.")]
    assert len(read) == len(set(read))  # each tensor read once
    assert type(base) is type(written.base)

    # Every tensor lands under its own name, bit for bit; frozen, bf16, eval mode.
    want = written.base.state_dict()
    got = base.state_dict()
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == torch.bfloat16, name
        assert torch.equal(got[name], want[name]), name
    assert not any(p.requires_grad for p in base.parameters())
    assert not base.training

    # The base hidden states are transformers' own post-norm last_hidden_state.
    ids = torch.randint(written.text_config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got_hidden = base.model(input_ids=ids).last_hidden_state
        want_hidden = written.base.model(input_ids=ids).last_hidden_state
    assert got_hidden.dtype == torch.bfloat16
    assert torch.equal(got_hidden, want_hidden)


def test_single_file_checkpoint(tiny_checkpoint, tmp_path):
    """One model.safetensors and no index: the base and the head load the same."""
    written = tiny_checkpoint(QWEN3_5, PER_EXPERT, True)
    single = write_variant(written.path, tmp_path / "single", read_all(written.path), single_file=True)
    assert not (single / ckpt_io.INDEX_NAME).exists()
    base = ckpt_io.load_base(single)
    for name, tensor in written.base.state_dict().items():
        assert torch.equal(base.state_dict()[name], tensor), name
    head, layout = ckpt_io.load_head(single, written.text_config)
    assert layout == PER_EXPERT
    for name, tensor in written.head.state_dict().items():
        assert torch.equal(head.state_dict()[name], tensor), name


def test_read_config_resolves_text_config(tiny_checkpoint):
    multimodal = ckpt_io.read_config(tiny_checkpoint(QWEN3_5, PER_EXPERT, True).path)
    text_only = ckpt_io.read_config(tiny_checkpoint(QWEN3_5, PER_EXPERT, False).path)
    next_ = ckpt_io.read_config(tiny_checkpoint(QWEN3_NEXT, PER_EXPERT, False).path / "config.json")
    assert (multimodal.multimodal, text_only.multimodal, next_.multimodal) == (True, False, False)
    assert multimodal.raw["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    for config, family in ((multimodal, QWEN3_5), (text_only, QWEN3_5), (next_, QWEN3_NEXT)):
        assert config.text_config.model_type == family
        assert config.text_config.hidden_size == 64
        assert config.has_mtp
    assert next_.text_config.num_experts == 16


# ----------------------------------------------------------------------------------
# The head: loading and the round trip
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", HEAD_VARIANTS, ids=variant_id)
def test_head_round_trip_is_bit_identical(tiny_checkpoint, tmp_path, variant):
    """donor checkpoint -> head -> saved mtp.* tensors: the donor's own bytes, layout and names."""
    written = tiny_checkpoint(*variant)
    base_shared = SharedWeights(written.base.model.embed_tokens, written.base.lm_head)
    head, layout = ckpt_io.load_head(written.path, written.text_config, base_shared)
    assert layout == written.layout
    assert head.shared is base_shared

    # The module holds the written head's weights under the same names, in bf16.
    for name, tensor in written.head.state_dict().items():
        loaded = head.state_dict()[name]
        assert loaded.dtype == torch.bfloat16, name
        assert torch.equal(loaded, tensor), name

    donor = SafetensorsCheckpoint(written.path)
    donor_keys = {k for k in donor.keys() if k.startswith("mtp.")}
    exported = tmp_path / "mtp.safetensors"
    files.save_safetensors(exported, ckpt_io.head_checkpoint_tensors(head.state_dict(), layout))
    with safe_open(str(exported), framework="pt") as handle:
        assert set(handle.keys()) == donor_keys
        for key in sorted(donor_keys):
            saved, original = handle.get_tensor(key), donor.get(key)
            assert saved.dtype == original.dtype == torch.bfloat16, key
            assert torch.equal(saved, original), key

    # The exported file is itself a loadable head (one bare safetensors file).
    again, again_layout = ckpt_io.load_head(exported, written.text_config)
    assert again_layout == layout
    for name, tensor in head.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


@pytest.mark.parametrize("family, multimodal", [(QWEN3_5, True), (QWEN3_NEXT, False)])
def test_both_expert_layouts_hold_the_same_head(tiny_checkpoint, family, multimodal):
    """Per-expert and fused checkpoints of one seed load to the same module, and each
    converts to the other's on-disk tensors exactly."""
    per_expert = tiny_checkpoint(family, PER_EXPERT, multimodal)
    fused = tiny_checkpoint(family, FUSED, multimodal)
    head_p, _ = ckpt_io.load_head(per_expert.path, per_expert.text_config)
    head_f, _ = ckpt_io.load_head(fused.path, fused.text_config)
    for name, tensor in head_p.state_dict().items():
        assert torch.equal(head_f.state_dict()[name], tensor), name
    for source, target, layout in ((head_p, fused, FUSED), (head_f, per_expert, PER_EXPERT)):
        converted = ckpt_io.head_checkpoint_tensors(source.state_dict(), layout)
        on_disk = SafetensorsCheckpoint(target.path)
        assert set(converted) == {k for k in on_disk.keys() if k.startswith("mtp.")}
        for key, tensor in converted.items():
            assert torch.equal(tensor, on_disk.get(key)), key
    # The per-expert names are the ones docs/reference/CONTRACT.md section 3 lists.
    experts = per_expert.text_config.num_experts
    per_expert_keys = set(ckpt_io.head_checkpoint_tensors(head_p.state_dict(), PER_EXPERT))
    for e in (0, experts - 1):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"mtp.layers.0.mlp.experts.{e}.{proj}.weight" in per_expert_keys


# ----------------------------------------------------------------------------------
# Bad checkpoints
# ----------------------------------------------------------------------------------


@pytest.fixture
def donor(tiny_checkpoint):
    """The per-expert multimodal fixture: path, text config and all its tensors (a fresh dict)."""
    written = tiny_checkpoint(QWEN3_5, PER_EXPERT, True)
    return written, read_all(written.path)


def load_head_error(path: Path, text_config) -> str:
    with pytest.raises(CheckpointError) as info:
        ckpt_io.load_head(path, text_config)
    return str(info.value)


def test_missing_head_tensor(donor, tmp_path):
    written, tensors = donor
    del tensors["mtp.layers.0.self_attn.k_norm.weight"]
    del tensors["mtp.layers.0.mlp.experts.3.up_proj.weight"]
    bad = write_variant(written.path, tmp_path / "bad", tensors)
    message = load_head_error(bad, written.text_config)
    assert "missing tensor mtp.layers.0.self_attn.k_norm.weight (expected shape [32])" in message
    assert "missing tensor mtp.layers.0.mlp.experts.3.up_proj.weight (expected shape [32, 64])" in message
    assert str(bad) in message


def test_mis_shaped_head_tensor(donor, tmp_path):
    written, tensors = donor
    key = "mtp.layers.0.self_attn.o_proj.weight"
    assert list(tensors[key].shape) == [64, 128]
    tensors[key] = tensors[key][:, :96].clone()
    bad = write_variant(written.path, tmp_path / "bad", tensors)
    shard = index_of(bad)["weight_map"][key]
    message = load_head_error(bad, written.text_config)
    assert f"tensor {key} in {bad / shard} has shape [64, 96], expected [64, 128]" in message


def test_unexpected_head_tensor(donor, tmp_path):
    written, tensors = donor
    extra = "mtp.layers.1.input_layernorm.weight"
    tensors[extra] = torch.zeros(64, dtype=torch.bfloat16)
    bad = write_variant(written.path, tmp_path / "bad", tensors)
    shard = index_of(bad)["weight_map"][extra]
    message = load_head_error(bad, written.text_config)
    assert f"unexpected tensor {extra} (shape [64]) in {bad / shard}" in message


def test_head_of_another_hidden_size(donor, tmp_path):
    """A donor head of hidden 32 beside a base of hidden 64: every affected tensor is named."""
    written, tensors = donor
    small_config = tiny_text_config(QWEN3_5, hidden_size=32)
    _, small_head = random_models(small_config, seed=3)
    tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    tensors.update(ckpt_io.head_checkpoint_tensors(small_head.state_dict(), PER_EXPERT))
    bad = write_variant(written.path, tmp_path / "bad", tensors)
    weight_map = index_of(bad)["weight_map"]
    message = load_head_error(bad, written.text_config)
    assert f"tensor mtp.fc.weight in {bad / weight_map['mtp.fc.weight']} has shape [32, 64], expected [64, 128]" in message
    assert "mtp.norm.weight" in message and "has shape [32], expected [64]" in message
    assert "mtp.layers.0.mlp.experts.0.down_proj.weight" in message and "has shape [32, 32], expected [64, 32]" in message


def test_checkpoint_without_head(donor, tmp_path):
    written, tensors = donor
    bad = write_variant(written.path, tmp_path / "bad", {k: v for k, v in tensors.items() if not k.startswith("mtp.")})
    message = load_head_error(bad, written.text_config)
    assert "no mtp.* tensors" in message and str(bad) in message


def test_mixed_expert_layouts(donor, tiny_checkpoint, tmp_path):
    written, tensors = donor
    fused = read_all(tiny_checkpoint(QWEN3_5, FUSED, True).path)
    gate_up = "mtp.layers.0.mlp.experts.gate_up_proj"
    for e in range(written.text_config.num_experts):
        del tensors[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"]
        del tensors[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"]
    tensors[gate_up] = fused[gate_up]
    bad = write_variant(written.path, tmp_path / "bad", tensors)
    message = load_head_error(bad, written.text_config)
    assert "mixes fused and per-expert" in message
    assert gate_up in message and "mtp.layers.0.mlp.experts.0.down_proj.weight" in message

    # Both layouts in full: the second copy is reported tensor by tensor.
    tensors.update({k: v for k, v in read_all(written.path).items() if k.startswith("mtp.")})
    tensors["mtp.layers.0.mlp.experts.down_proj"] = fused["mtp.layers.0.mlp.experts.down_proj"]
    both = write_variant(written.path, tmp_path / "both", tensors)
    message = load_head_error(both, written.text_config)
    assert "unexpected tensor mtp.layers.0.mlp.experts.0.gate_proj.weight (shape [32, 64])" in message


def test_corrupt_index(donor, tmp_path):
    written, _ = donor
    bad = tmp_path / "bad"
    shutil.copytree(written.path, bad)
    index = bad / ckpt_io.INDEX_NAME
    index.write_text('{"weight_map": {"mtp.fc.weight": ')
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not readable JSON"):
        SafetensorsCheckpoint(bad)
    index.write_text(json.dumps({"metadata": {}, "weights": {}}))
    with pytest.raises(CheckpointError, match="weight_map") as info:
        ckpt_io.load_base(bad)
    assert str(index) in str(info.value)


def test_index_names_a_missing_shard(donor, tmp_path):
    written, _ = donor
    bad = tmp_path / "bad"
    shutil.copytree(written.path, bad)
    shard = index_of(bad)["weight_map"]["mtp.fc.weight"]
    (bad / shard).unlink()
    with pytest.raises(CheckpointError) as info:
        ckpt_io.load_head(bad, written.text_config)
    assert f"names shard {shard!r}, which does not exist" in str(info.value)
    assert ckpt_io.INDEX_NAME in str(info.value)


def test_shard_lacks_a_promised_tensor(donor, tmp_path):
    written, _ = donor
    bad = tmp_path / "bad"
    shutil.copytree(written.path, bad)
    index = index_of(bad)
    key = "mtp.fc.weight"
    other = sorted(set(index["weight_map"].values()) - {index["weight_map"][key]})[0]
    index["weight_map"][key] = other
    (bad / ckpt_io.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as info:
        ckpt_io.load_head(bad, written.text_config)
    assert f"maps {key!r}" in str(info.value) and f"to {other}, which does not contain it" in str(info.value)


def test_corrupt_shard(donor, tmp_path):
    written, _ = donor
    bad = tmp_path / "bad"
    shutil.copytree(written.path, bad)
    shard = index_of(bad)["weight_map"]["mtp.fc.weight"]
    (bad / shard).write_bytes(b"\x00garbage, not safetensors")
    with pytest.raises(CheckpointError, match="cannot be read as safetensors") as info:
        ckpt_io.load_head(bad, written.text_config)
    assert str(bad / shard) in str(info.value)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        SafetensorsCheckpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a safetensors checkpoint directory"):
        SafetensorsCheckpoint(tmp_path / "empty")


def test_bad_base_tensors(donor, tmp_path):
    """The base gets the same care: missing and mis-shaped text tensors are named."""
    written, tensors = donor
    missing = "model.language_model.layers.1.linear_attn.A_log"
    assert missing in tensors
    del tensors[missing]
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:1000].clone()
    bad = write_variant(written.path, tmp_path / "bad", tensors)
    shard = index_of(bad)["weight_map"]["lm_head.weight"]
    with pytest.raises(CheckpointError) as info:
        ckpt_io.load_base(bad)
    message = str(info.value)
    assert f"missing tensor {missing} (expected shape [4])" in message
    assert f"tensor lm_head.weight in {bad / shard} has shape [1000, 64], expected [1024, 64]" in message
