"""Assembly (docs/reference/CONTRACT.md section 5): base directory untouched, the assembled one serves exactly the new head.

Every base is a tiny real-layout checkpoint written into the test's own tmp_path. "What
an engine loads" is `assemble.engine_view`: vLLM and SGLang keep the safetensors files
the index names and read every tensor of each (see occamy_mtp/export/assemble.py).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

from occamy_mtp.export import assemble as asm
from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp import files
from occamy_mtp.testing.checkpoints import build_tiny_checkpoint, random_models, tiny_text_config, write_checkpoint
from occamy_mtp.commands import assemble as assemble_command

REPO_ROOT = Path(__file__).resolve().parents[1]

# Modelled on the config.json / hf_quant_config.json of ModelOpt NVFP4 and FP8 exports
# of Qwen3.5-MoE (quant_method "modelopt", flat `ignore` in config.json, nested
# `quantization.exclude_modules` in hf_quant_config.json). The original NVFP4 release
# excluded `mtp.layers.0*` but not `mtp.fc`.
MODELOPT_NVFP4 = {
    "config_groups": {
        "group_0": {
            "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
            "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
            "targets": ["Linear"],
        }
    },
    "ignore": ["lm_head", "model.language_model.layers.0.linear_attn*", "model.visual*", "mtp.layers.0*"],
    "quant_algo": "NVFP4",
    "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
    "producer": {"name": "modelopt", "version": "0.41.0"},
    "quant_method": "modelopt",
}
HF_QUANT_NVFP4 = {
    "producer": {"name": "modelopt", "version": "0.41.0"},
    "quantization": {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": "FP8",
        "group_size": 16,
        "exclude_modules": ["lm_head", "model.language_model.layers.0.linear_attn*", "model.visual*", "mtp.layers.0*"],
    },
}
MODELOPT_FP8 = {
    "config_groups": {
        "group_0": {
            "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
            "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
            "targets": ["Linear"],
        }
    },
    "ignore": ["lm_head", "model.layers.0.mlp.gate"],
    "quant_algo": "FP8",
    "producer": {"name": "modelopt", "version": "0.41.0"},
    "quant_method": "modelopt",
}
COMPRESSED_TENSORS = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"]}

# Module prefixes the engines build for the head (and some of the base, which our
# entries must leave alone).
HEAD_MODULES = [
    "mtp.fc",
    "mtp.layers.0.self_attn.qkv_proj",
    "mtp.layers.0.self_attn.o_proj",
    "mtp.layers.0.mlp.gate",
    "mtp.layers.0.mlp.experts",
    "mtp.layers.0.mlp.shared_expert.gate_up_proj",
    "mtp.layers.0.mlp.shared_expert_gate",
]
BASE_MODULES = [
    "language_model.model.layers.3.self_attn.qkv_proj",
    "model.layers.3.mlp.experts",
    "model.language_model.layers.1.linear_attn.in_proj_qkvz",
]


# ----------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------


def tree_state(root: Path) -> dict[str, tuple]:
    """Every entry under root: files by (sha256, size, mtime_ns, mode), links by target, dirs by mode."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            st = os.lstat(path)
            if path.is_symlink():
                state[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                state[rel] = ("dir", st.st_mode)
            else:
                state[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns, st.st_mode)
    return state


def base_tensors(directory: Path) -> dict[str, torch.Tensor]:
    ckpt = ckpt_io.SafetensorsCheckpoint(directory)
    return {k: ckpt.get(k) for k in ckpt.keys()}


def write_head(directory: Path, path: Path, layout: str | None = None, text_config=None) -> dict[str, torch.Tensor]:
    """A "trained" head: the base's own mtp.* tensors with mtp.fc.weight changed."""
    tensors = {k: v for k, v in base_tensors(directory).items() if k.startswith(ckpt_io.HEAD_PREFIX)}
    tensors["mtp.fc.weight"] = (tensors["mtp.fc.weight"].float() * 0.5 + 0.01).to(torch.bfloat16)
    if layout is not None:  # re-lay the experts through the module layout
        from occamy_mtp.model.head import MTPHead

        with torch.device("meta"):
            head = MTPHead(text_config)
        state, _ = ckpt_io.load_head_state(ckpt_io.SafetensorsCheckpoint(directory), head)
        state["fc.weight"] = tensors["mtp.fc.weight"]
        tensors = ckpt_io.head_checkpoint_tensors(state, layout)
    files.save_safetensors(path, tensors)
    return tensors


def relayout(source: Path, target: Path, shard_of, single_file: bool = False) -> None:
    """Copy a tiny checkpoint with tensors assigned to shards by `shard_of(key) -> file name`."""
    target.mkdir(parents=True)
    tensors = base_tensors(source)
    if single_file:
        files.save_safetensors(target / ckpt_io.SINGLE_NAME, tensors)
    else:
        shards: dict[str, dict] = {}
        for key, tensor in tensors.items():
            shards.setdefault(shard_of(key), {})[key] = tensor
        for name, members in shards.items():
            files.save_safetensors(target / name, members)
        weight_map = {k: shard_of(k) for k in sorted(tensors)}
        files.write_json(target / ckpt_io.INDEX_NAME, {"metadata": {}, "weight_map": weight_map})
    for name in ("config.json", "generation_config.json"):
        (target / name).write_bytes((source / name).read_bytes())


def assert_serves_head(out: Path, text_config, head_tensors: dict[str, torch.Tensor], head_name: str) -> None:
    """Index, engine view and our own loader all agree: the only head is the new one."""
    index = json.loads((out / ckpt_io.INDEX_NAME).read_text())["weight_map"]
    mtp_index = {k: f for k, f in index.items() if k.startswith(ckpt_io.HEAD_PREFIX)}
    assert mtp_index == {k: head_name for k in head_tensors}
    view = asm.engine_view(out)
    assert {k for k, f in view.items() if k.startswith(ckpt_io.HEAD_PREFIX)} == set(head_tensors)
    assert all(view[k] == head_name for k in head_tensors)
    assert set(view) == set(index)
    head, _ = ckpt_io.load_head(out, text_config)
    ckpt = ckpt_io.SafetensorsCheckpoint(out / head_name)
    expected, _ = ckpt_io.load_head_state(ckpt, head)
    for name, tensor in head.state_dict().items():
        if name in expected:
            assert torch.equal(tensor, expected[name]), name
    assert torch.equal(head.fc.weight, head_tensors["mtp.fc.weight"])


def vllm_excluded(prefix: str, entries: list[str]) -> bool:
    """vLLM ModelOptQuantConfigBase.is_layer_excluded, after apply_vllm_mapper's `x*` split."""
    expanded = []
    for e in entries:
        expanded += [e[:-1], e[:-1] + ".*"] if len(e) >= 2 and e.endswith("*") and e[-2] != "." else [e]
    return any(prefix == e or e in prefix or fnmatch.fnmatch(prefix, e) for e in expanded)


def sglang_excluded(prefix: str, entries: list[str]) -> bool:
    """SGLang ModelOptQuantConfig.is_layer_excluded: a glob matching the prefix or one of its parts."""
    for e in entries:
        regex = e.replace(".", r"\.").replace("*", ".*")
        if re.fullmatch(regex, prefix) or any(re.fullmatch(regex, part) for part in prefix.split(".")):
            return True
    return False


def sglang_legacy_excluded(prefix: str, entries: list[str]) -> bool:
    """Older SGLang ModelOptFp8Config: plain substring."""
    return any(e in prefix for e in entries)


@pytest.fixture
def base(tmp_path):
    """The default tiny multimodal checkpoint: its last shard mixes base tensors with mtp.*."""
    return build_tiny_checkpoint(tmp_path / "base")


# ----------------------------------------------------------------------------------
# The assembled directory
# ----------------------------------------------------------------------------------


def test_base_unchanged_and_assembled_dir_serves_new_head(base, tmp_path):
    head_file = tmp_path / "mtp-trained.safetensors"
    head = write_head(base.path, head_file)
    before = tree_state(base.path)

    report = asm.assemble(base.path, head_file, tmp_path / "serve")

    assert tree_state(base.path) == before
    out = tmp_path / "serve"
    assert_serves_head(out, base.text_config, head, head_file.name)
    assert report.removed_base_mtp_keys == len(head)
    # The head file is a checked copy, not a link to the training output.
    assert not (out / head_file.name).is_symlink()
    assert report.head_sha256 == hashlib.sha256(head_file.read_bytes()).hexdigest()
    # A writable base is never linked: unchanged shards are cloned or copied, other files copied.
    assert report.weight_files and set(report.weight_files.values()) <= {asm.CLONE, asm.COPY}
    assert "generation_config.json" in report.copied
    for name in [*report.weight_files, *report.copied]:
        assert not (out / name).is_symlink() and (out / name).read_bytes() == (base.path / name).read_bytes(), name
    assert not any(p.is_symlink() for p in out.iterdir())
    record = json.loads((out / asm.RECORD_NAME).read_text())
    assert record["head_sha256"] == report.head_sha256 and record["written_by"] == asm.WRITTEN_BY
    assert record["entries"] == sorted(p.name for p in out.iterdir())


def test_mixed_shard_is_rewritten_without_old_head(base, tmp_path):
    head_file = tmp_path / "mtp-trained.safetensors"
    write_head(base.path, head_file)
    original = base_tensors(base.path)
    mixed = [p for p in asm.plan_shards(base.path, sorted(set(ckpt_io.SafetensorsCheckpoint(base.path).weight_map.values())))
             if p.action == asm.REWRITE]
    assert len(mixed) == 1  # the fixture's layout: sorted keys put mtp.* at the end of the last shard

    report = asm.assemble(base.path, head_file, tmp_path / "serve")

    (shard,) = report.rewritten_shards
    assert shard["name"] == mixed[0].name and shard["removed_mtp_tensors"] == mixed[0].mtp_tensors
    rewritten = tmp_path / "serve" / shard["name"]
    assert not rewritten.is_symlink()
    keys = asm.read_safetensors_header(rewritten)
    assert keys and not any(k.startswith(ckpt_io.HEAD_PREFIX) for k in keys)
    ckpt = ckpt_io.SafetensorsCheckpoint(tmp_path / "serve")
    for key in keys:  # base tensors bit-identical
        assert torch.equal(ckpt.get(key).view(torch.int16), original[key].view(torch.int16)), key
    # And the whole base still loads from the assembled directory.
    served = ckpt_io.load_base(tmp_path / "serve").state_dict()
    reference = ckpt_io.load_base(base.path).state_dict()
    assert served.keys() == reference.keys()
    assert all(torch.equal(served[k], reference[k]) for k in reference)


def test_shards_holding_only_head_tensors_are_not_linked(base, tmp_path):
    def shard_of(key):
        if key.startswith(ckpt_io.HEAD_PREFIX):
            return "model-mtp.safetensors"
        return "model-00001-of-00002.safetensors" if key < "model.language_model.layers.2" else "model-00002-of-00002.safetensors"

    relayout(base.path, tmp_path / "split", shard_of)
    head_file = tmp_path / "mtp-trained.safetensors"
    head = write_head(tmp_path / "split", head_file)
    before = tree_state(tmp_path / "split")

    report = asm.assemble(tmp_path / "split", head_file, tmp_path / "serve")

    assert tree_state(tmp_path / "split") == before
    assert report.dropped_shards == ["model-mtp.safetensors"] and report.rewritten_shards == []
    assert not (tmp_path / "serve" / "model-mtp.safetensors").exists()
    assert_serves_head(tmp_path / "serve", base.text_config, head, head_file.name)


def test_single_file_base_gets_an_index(base, tmp_path):
    relayout(base.path, tmp_path / "single", None, single_file=True)
    head_file = tmp_path / "mtp-trained.safetensors"
    head = write_head(tmp_path / "single", head_file)

    report = asm.assemble(tmp_path / "single", head_file, tmp_path / "serve")

    assert [s["name"] for s in report.rewritten_shards] == [ckpt_io.SINGLE_NAME]
    assert_serves_head(tmp_path / "serve", base.text_config, head, head_file.name)


def test_base_without_head(tmp_path):
    no_head = build_tiny_checkpoint(tmp_path / "base", with_head=False, mtp_num_hidden_layers=0)
    donor = build_tiny_checkpoint(tmp_path / "donor")
    head_file = tmp_path / "mtp-trained.safetensors"
    head = write_head(donor.path, head_file)
    before = tree_state(no_head.path)

    report = asm.assemble(no_head.path, head_file, tmp_path / "serve")

    assert tree_state(no_head.path) == before
    assert report.removed_base_mtp_keys == 0 and report.rewritten_shards == [] and report.dropped_shards == []
    assert report.config_changes == ["text_config.mtp_num_hidden_layers: 0 -> 1"]
    config = json.loads((tmp_path / "serve" / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    assert ckpt_io.read_config(tmp_path / "serve").has_mtp
    assert_serves_head(tmp_path / "serve", donor.text_config, head, head_file.name)


def test_fused_head_onto_per_expert_base(base, tmp_path):
    head_file = tmp_path / "head-fused.safetensors"
    head = write_head(base.path, head_file, layout=ckpt_io.FUSED, text_config=base.text_config)

    report = asm.assemble(base.path, head_file, tmp_path / "serve")

    assert report.head_layout == ckpt_io.FUSED
    assert_serves_head(tmp_path / "serve", base.text_config, head, head_file.name)


def test_qwen3_next_config_fields(tmp_path):
    base = build_tiny_checkpoint(tmp_path / "base", family="qwen3_next", multimodal=False)
    head_file = tmp_path / "mtp-trained.safetensors"
    head = write_head(base.path, head_file)

    report = asm.assemble(base.path, head_file, tmp_path / "serve")

    config = json.loads((tmp_path / "serve" / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1 and config["num_nextn_predict_layers"] == 1
    assert report.config_changes == ["num_nextn_predict_layers: None -> 1"]
    assert report.notes == []  # Qwen3NextForCausalLM is an SGLang NEXTN architecture
    assert_serves_head(tmp_path / "serve", base.text_config, head, head_file.name)


def test_reassembling_onto_an_assembled_dir(base, tmp_path):
    """The first head becomes an mtp.*-only shard of the new base: dropped, and its name reused."""
    head_file = tmp_path / "mtp-trained.safetensors"
    write_head(base.path, head_file)
    asm.assemble(base.path, head_file, tmp_path / "first")
    (tmp_path / "second-head").mkdir()
    second_file = tmp_path / "second-head" / "mtp-trained.safetensors"
    head_variant(tmp_path / "first", second_file, lambda t: t.update({"mtp.norm.weight": t["mtp.norm.weight"] + 1}))
    before = tree_state(tmp_path / "first")

    report = asm.assemble(tmp_path / "first", second_file, tmp_path / "second")

    assert tree_state(tmp_path / "first") == before
    assert report.dropped_shards == [second_file.name]
    assert_serves_head(tmp_path / "second", base.text_config, base_tensors(second_file), second_file.name)


def test_head_given_as_symlink_keeps_its_name(base, tmp_path):
    blob = tmp_path / "blobs" / "3f2a9c"  # a hub-cache blob has no .safetensors suffix
    blob.parent.mkdir()
    head = write_head(base.path, blob)
    link = tmp_path / "mtp-trained.safetensors"
    link.symlink_to(blob)

    report = asm.assemble(base.path, link, tmp_path / "serve")

    assert report.head_file == link.name
    assert_serves_head(tmp_path / "serve", base.text_config, head, link.name)


def test_head_name_clashing_with_a_base_file(base, tmp_path):
    head_file = tmp_path / "model-00001-of-00003.safetensors"
    write_head(base.path, head_file)
    with pytest.raises(asm.AssemblyError, match="already has a file named model-00001-of-00003.safetensors"):
        asm.assemble(base.path, head_file, tmp_path / "serve")


# ----------------------------------------------------------------------------------
# Quantized bases
# ----------------------------------------------------------------------------------


def write_quantized(path: Path, quantization_config: dict, *, multimodal: bool, family: str = "qwen3_5_moe_text"):
    text_config = tiny_text_config(family)
    base_model, head_model = random_models(text_config, seed=0)
    return write_checkpoint(
        path, text_config, base_model, head_model, multimodal=multimodal, quantization_config=json.loads(json.dumps(quantization_config))
    )


def test_modelopt_nvfp4_base_excludes_head(tmp_path):
    base = write_quantized(tmp_path / "base", MODELOPT_NVFP4, multimodal=True)
    files.write_json(base.path / asm.HF_QUANT_CONFIG_NAME, HF_QUANT_NVFP4)
    head_file = tmp_path / "mtp-trained.safetensors"
    head = write_head(base.path, head_file)
    before = tree_state(base.path)

    report = asm.assemble(base.path, head_file, tmp_path / "serve")

    assert tree_state(base.path) == before
    out = tmp_path / "serve"
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    exclude = json.loads((out / asm.HF_QUANT_CONFIG_NAME).read_text())["quantization"]["exclude_modules"]
    for entries, original in ((ignore, MODELOPT_NVFP4["ignore"]), (exclude, HF_QUANT_NVFP4["quantization"]["exclude_modules"])):
        assert entries == original + list(asm.HEAD_EXCLUSIONS)  # the base's own entries kept, in order
    assert report.quantization["quant_algo"] == "NVFP4"
    assert set(report.quantization["added"]) == {
        "config.json quantization_config: ignore", "hf_quant_config.json: quantization.exclude_modules"
    }
    assert not (out / asm.HF_QUANT_CONFIG_NAME).is_symlink()
    # The original list misses mtp.fc in vLLM's check; ours covers every head module, in every engine check.
    assert not vllm_excluded("mtp.fc", MODELOPT_NVFP4["ignore"])
    for check in (vllm_excluded, sglang_excluded, sglang_legacy_excluded):
        for module in HEAD_MODULES:
            assert check(module, ignore) and check(module, exclude), (check.__name__, module)
        for module in BASE_MODULES:
            assert not check(module, list(asm.HEAD_EXCLUSIONS)), (check.__name__, module)
    assert_serves_head(out, base.text_config, head, head_file.name)


def test_modelopt_fp8_text_only_base_excludes_head(tmp_path):
    base = write_quantized(tmp_path / "base", MODELOPT_FP8, multimodal=False)
    head_file = tmp_path / "mtp-trained.safetensors"
    write_head(base.path, head_file)

    report = asm.assemble(base.path, head_file, tmp_path / "serve")

    config = json.loads((tmp_path / "serve" / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == MODELOPT_FP8["ignore"] + list(asm.HEAD_EXCLUSIONS)
    assert report.quantization["quant_algo"] == "FP8"
    # A text-only Qwen3.5 architecture is not one SGLang NEXTN maps; the report says so.
    assert any("Qwen3_5MoeForCausalLM" in note for note in report.notes)


def test_exclusions_are_not_duplicated(tmp_path):
    quant = json.loads(json.dumps(MODELOPT_FP8))
    quant["ignore"].append("mtp")
    base = write_quantized(tmp_path / "base", quant, multimodal=False)
    head_file = tmp_path / "mtp-trained.safetensors"
    write_head(base.path, head_file)

    report = asm.assemble(base.path, head_file, tmp_path / "serve")

    config = json.loads((tmp_path / "serve" / "config.json").read_text())
    assert config["quantization_config"]["ignore"].count("mtp") == 1
    assert report.quantization["added"] == {"config.json quantization_config: ignore": ["mtp*"]}


def test_non_modelopt_quantization_is_refused(tmp_path):
    base = write_quantized(tmp_path / "base", COMPRESSED_TENSORS, multimodal=True)
    head_file = tmp_path / "mtp-trained.safetensors"
    write_head(base.path, head_file)

    with pytest.raises(asm.AssemblyError, match="compressed-tensors"):
        asm.assemble(base.path, head_file, tmp_path / "serve")
    assert not (tmp_path / "serve").exists()


# ----------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------


def head_variant(base_dir: Path, path: Path, edit) -> Path:
    tensors = {k: v for k, v in base_tensors(base_dir).items() if k.startswith(ckpt_io.HEAD_PREFIX)}
    edit(tensors)
    files.save_safetensors(path, tensors)
    return path


def test_head_with_missing_tensor(base, tmp_path):
    head_file = head_variant(base.path, tmp_path / "h.safetensors", lambda t: t.pop("mtp.norm.weight"))
    with pytest.raises(asm.AssemblyError, match=r"missing tensor mtp\.norm\.weight \(expected shape \[64\]\)"):
        asm.assemble(base.path, head_file, tmp_path / "serve")
    assert not (tmp_path / "serve").exists()


def test_head_with_wrong_shape(base, tmp_path):
    def edit(t):
        t["mtp.fc.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)

    head_file = head_variant(base.path, tmp_path / "h.safetensors", edit)
    with pytest.raises(asm.AssemblyError, match=r"mtp\.fc\.weight .* has shape \[64, 64\], expected \[64, 128\]"):
        asm.assemble(base.path, head_file, tmp_path / "serve")


def test_head_with_wrong_dtype_and_foreign_tensor(base, tmp_path):
    def edit(t):
        t["mtp.norm.weight"] = t["mtp.norm.weight"].float()
        t["lm_head.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)

    head_file = head_variant(base.path, tmp_path / "h.safetensors", edit)
    with pytest.raises(asm.AssemblyError) as err:
        asm.assemble(base.path, head_file, tmp_path / "serve")
    assert "mtp.norm.weight" in str(err.value) and "F32, expected BF16" in str(err.value)
    assert "lm_head.weight" in str(err.value) and "not an mtp.* tensor" in str(err.value)


@pytest.mark.parametrize("where", ["inside", "same", "parent"])
def test_out_must_lie_outside_base(base, tmp_path, where):
    head_file = tmp_path / "mtp-trained.safetensors"
    write_head(base.path, head_file)
    before = tree_state(base.path)
    out = {"inside": base.path / "serve", "same": base.path, "parent": tmp_path}[where]
    with pytest.raises(asm.AssemblyError, match="--base"):
        asm.assemble(base.path, head_file, out, force=True)
    assert tree_state(base.path) == before


def test_existing_out_needs_force(base, tmp_path):
    """--force replaces an earlier assembly (what else it refuses: tests/test_faults.py)."""
    head_file = tmp_path / "mtp-trained.safetensors"
    head = write_head(base.path, head_file)
    out = tmp_path / "serve"
    first = asm.assemble(base.path, head_file, out)
    with pytest.raises(asm.AssemblyError, match="--force"):
        asm.assemble(base.path, head_file, out)

    before = tree_state(base.path)
    second = asm.assemble(base.path, head_file, out, force=True)
    third = asm.assemble(base.path, head_file, out, force=True, weights=asm.SYMLINK)  # an assembly full of links
    fourth = asm.assemble(base.path, head_file, out, force=True)  # replaces it without following them

    assert not first.replaced_existing_out and second.replaced_existing_out and fourth.replaced_existing_out
    assert set(third.weight_files.values()) == {asm.SYMLINK}
    assert tree_state(base.path) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".serve.")]
    assert_serves_head(out, base.text_config, head, head_file.name)


def test_interrupted_assembly_leaves_nothing(base, tmp_path, monkeypatch):
    head_file = tmp_path / "mtp-trained.safetensors"
    write_head(base.path, head_file)

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(asm, "_copy_with_sha256", fail)
    with pytest.raises(OSError, match="disk full"):
        asm.assemble(base.path, head_file, tmp_path / "serve")
    assert not (tmp_path / "serve").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".serve.")]


# ----------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------


def test_cli_json_and_errors(base, tmp_path, capsys):
    head_file = tmp_path / "mtp-trained.safetensors"
    write_head(base.path, head_file)
    argv = ["--base", str(base.path), "--head", str(head_file), "--out", str(tmp_path / "serve")]

    assert assemble_command.main(argv + ["--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["head_file"] == head_file.name and printed["rewritten_shards"]

    assert assemble_command.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: --out ") and "already exists" in captured.err


def test_entry_point_runs(base, tmp_path, monkeypatch, capsys):
    """The thin top-level script, run as __main__ in this process (a fresh interpreter costs seconds)."""
    head_file = tmp_path / "mtp-trained.safetensors"
    write_head(base.path, head_file)
    argv = ["assemble_head.py", "--base", str(base.path), "--head", str(head_file), "--out", str(tmp_path / "serve")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(REPO_ROOT / "assemble_head.py"), run_name="__main__")
    assert exit_.value.code == 0
    assert "rewritten without mtp.*" in capsys.readouterr().out
    assert (tmp_path / "serve" / head_file.name).is_file()


def test_the_family_s_block_fp8_base_keeps_the_head_out_of_its_quantization(tmp_path):
    """A base in the family's FP8 layout (`quant_method` fp8): assembly adds the head to
    `modules_to_not_convert`, the base's FP8 weights and scales go through untouched, and the
    served directory still loads as a quantized base with the new head."""
    from occamy_mtp.model import quantized
    from occamy_mtp.testing.quantize import write_quantized_copy

    bf16 = build_tiny_checkpoint(tmp_path / "bf16", layout="per_expert", multimodal=True, seed=0).path
    base = write_quantized_copy(bf16, tmp_path / "base", quantized.FP8, block=(16, 16))
    head_file = tmp_path / "mtp-trained.safetensors"
    head = write_head(base, head_file)
    before = tree_state(base)

    report = asm.assemble(base, head_file, tmp_path / "serve")

    assert tree_state(base) == before
    out = tmp_path / "serve"
    kept = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    declared = json.loads((base / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert kept == declared + [e for e in asm.HEAD_EXCLUSIONS if e not in declared]
    assert report.quantization["method"] == "fp8"
    served = ckpt_io.SafetensorsCheckpoint(out)
    assert any(served.dtype(k) == "F8_E4M3" for k in served.keys()) and ckpt_io.quantization_of(out, ckpt_io.read_config(out))
    assert_serves_head(out, ckpt_io.read_config(out).text_config, head, head_file.name)
