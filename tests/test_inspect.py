"""`python -m occamy_mtp inspect`: what it reports for configs and checkpoints, that it
reads no weights, and that it finds every kind of problem."""

from __future__ import annotations

import json
import runpy
import shutil
import sys
from pathlib import Path

import pytest

from occamy_mtp.testing.checkpoints import QWEN3_5_35B_A3B, QWEN3_NEXT_80B_A3B
import torch
from safetensors import safe_open

from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.model.checkpoint import FUSED, PER_EXPERT, SafetensorsCheckpoint
from occamy_mtp.commands.inspect import main
from occamy_mtp.model import fp8_weights
from occamy_mtp.testing.checkpoints import config_json, random_models, tiny_text_config, write_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")

QWEN3_5, QWEN3_NEXT = "qwen3_5_moe_text", "qwen3_next"

def run_json(capsys, path: Path) -> tuple[int, dict]:
    code = main([str(path), "--json"])
    return code, json.loads(capsys.readouterr().out)


def write_config(path: Path, fields: dict, multimodal: bool, quantization_config: dict | None = None) -> Path:
    config = ckpt_io.text_config_from_dict(dict(fields))
    path.write_text(json.dumps(config_json(config, multimodal, quantization_config)))
    return path


def head_numel_on_disk(path: Path) -> int:
    """Parameters of the mtp.* tensors, counted from the safetensors headers alone."""
    total = 0
    for shard in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            for key in handle.keys():
                if key.startswith("mtp."):
                    total += torch.Size(handle.get_slice(key).get_shape()).numel()
    return total


@pytest.fixture
def no_weight_reads(monkeypatch):
    def refuse(self, key):
        raise AssertionError(f"inspect read the weights of {key}")

    monkeypatch.setattr(SafetensorsCheckpoint, "get", refuse)


# ----------------------------------------------------------------------------------
# Configs at real size
# ----------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
def test_real_size_config_from_the_command_line(tmp_path, capsys, monkeypatch):
    """`python -m occamy_mtp inspect config.json --json` on the real model's bare config
    (no weights exist), run as __main__ in this interpreter to spare a second start-up."""
    config = write_config(tmp_path / "config.json", QWEN3_5_35B_A3B, multimodal=True)
    monkeypatch.setattr(sys, "argv", ["occamy_mtp", "inspect", str(config), "--json"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("occamy_mtp", run_name="__main__")
    assert exited.value.code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["head_parameters"] == 844_640_768
    assert report["trainable_parameters"] == 8_392_704
    assert report["architecture"] == "Qwen3_5MoeForConditionalGeneration"
    assert report["text_model_type"] == QWEN3_5 and report["multimodal"] is True
    d = report["dimensions"]
    assert (d["hidden_size"], d["num_hidden_layers"], d["vocab_size"]) == (2048, 40, 248_320)
    assert (d["full_attention_layers"], d["linear_attention_layers"]) == (10, 30)
    assert (d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"], d["rotary_dims"]) == (16, 2, 256, 64)
    assert (d["num_experts"], d["num_experts_per_tok"]) == (256, 8)
    assert report["mtp"]["present"] is None and report["checkpoint"] is None
    assert report["problems"] == []


def test_real_size_config_text_report(tmp_path, capsys):
    config = write_config(tmp_path / "config.json", QWEN3_5_35B_A3B, multimodal=True)
    assert main([str(config)]) == 0
    text = capsys.readouterr().out
    assert "844,640,768" in text and "trainable 8,392,704" in text
    assert "1,611" in text  # MiB of the head in bf16 (docs/reference/CONTRACT.md section 1)
    assert "hidden 2,048, 40 layers (10 full attention, 30 linear)" in text
    assert "problems          none" in text


def test_real_size_qwen3_next_config(tmp_path, capsys):
    config = write_config(tmp_path / "config.json", QWEN3_NEXT_80B_A3B, multimodal=False)
    code, report = run_json(capsys, config)
    assert code == 0
    assert report["architecture"] == "Qwen3NextForCausalLM"
    assert report["dimensions"]["num_experts"] == 512
    # 844,640,768 + 256 more experts (256 x 3 x 512 x 2048) + 256 more router rows (256 x 2048).
    assert report["head_parameters"] == 844_640_768 + 256 * 3 * 512 * 2048 + 256 * 2048 == 1_650_471_424
    assert report["trainable_parameters"] == 8_392_704


# ----------------------------------------------------------------------------------
# Tiny checkpoints
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, layout, multimodal",
    [(QWEN3_5, PER_EXPERT, True), (QWEN3_5, FUSED, False), (QWEN3_NEXT, PER_EXPERT, False)],
)
def test_checkpoint_report(tiny_checkpoint, capsys, no_weight_reads, family, layout, multimodal):
    written = tiny_checkpoint(family, layout, multimodal)
    code, report = run_json(capsys, written.path)
    assert code == 0, report["problems"]
    assert report["problems"] == [] and report["notes"] == []
    assert report["text_model_type"] == family and report["multimodal"] is multimodal
    assert report["mtp"]["present"] is True
    assert report["mtp"]["expert_layout"] == layout
    assert report["mtp"]["dtypes"] == {"BF16": report["mtp"]["tensors"]}
    hidden = written.text_config.hidden_size
    assert report["head_parameters"] == head_numel_on_disk(written.path)
    assert report["trainable_parameters"] == 2 * hidden * hidden + 2 * hidden
    assert report["base_parameters"] == sum(p.numel() for p in written.base.parameters())
    ckpt = report["checkpoint"]
    assert ckpt["text_prefix"] == ("model.language_model." if multimodal else "model.")
    assert (ckpt["vision_tensors"] > 0) == multimodal
    assert ckpt["files"] == len(set(json.loads((written.path / ckpt_io.INDEX_NAME).read_text())["weight_map"].values()))

    assert main([str(written.path)]) == 0
    text = capsys.readouterr().out
    assert f"mtp head          present, {layout} expert layout" in text


def test_checkpoint_without_head(tiny_checkpoint, tmp_path, capsys):
    written = tiny_checkpoint(QWEN3_5, PER_EXPERT, True)
    ckpt = SafetensorsCheckpoint(written.path)
    tensors = {k: ckpt.get(k) for k in ckpt.keys() if not k.startswith("mtp.")}
    bare = rewrite(written.path, tmp_path / "bare", tensors)
    code, report = run_json(capsys, bare)
    assert code == 0 and report["mtp"]["present"] is False
    assert any("no mtp.* tensors" in n for n in report["notes"])


# ----------------------------------------------------------------------------------
# Problems
# ----------------------------------------------------------------------------------


def rewrite(src: Path, dst: Path, tensors: dict) -> Path:
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    ckpt_io.save_sharded(dst, tensors, max_shard_bytes=400_000)
    return dst


@pytest.fixture
def donor(tiny_checkpoint):
    written = tiny_checkpoint(QWEN3_5, PER_EXPERT, True)
    ckpt = SafetensorsCheckpoint(written.path)
    return written, {k: ckpt.get(k) for k in ckpt.keys()}


def test_reports_missing_and_mis_shaped_tensors(donor, tmp_path, capsys):
    written, tensors = donor
    del tensors["mtp.layers.0.mlp.shared_expert_gate.weight"]
    del tensors["model.language_model.layers.0.linear_attn.dt_bias"]
    tensors["mtp.layers.0.self_attn.q_norm.weight"] = torch.zeros(16, dtype=torch.bfloat16)
    bad = rewrite(written.path, tmp_path / "bad", tensors)
    code, report = run_json(capsys, bad)
    assert code == 1
    problems = "\n".join(report["problems"])
    assert "missing tensor mtp.layers.0.mlp.shared_expert_gate.weight (expected shape [1, 64])" in problems
    assert "missing tensor model.language_model.layers.0.linear_attn.dt_bias (expected shape [4])" in problems
    assert "tensor mtp.layers.0.self_attn.q_norm.weight in" in problems and "has shape [16], expected [32]" in problems
    assert len(report["problems"]) == 3
    assert main([str(bad)]) == 1
    assert "problems (3):" in capsys.readouterr().out


def test_reports_a_head_of_another_hidden_size(donor, tmp_path, capsys):
    written, tensors = donor
    _, small_head = random_models(tiny_text_config(QWEN3_5, hidden_size=32), seed=3)
    tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    tensors.update(ckpt_io.head_checkpoint_tensors(small_head.state_dict(), PER_EXPERT))
    bad = rewrite(written.path, tmp_path / "bad", tensors)
    code, report = run_json(capsys, bad)
    assert code == 1
    mismatch = [p for p in report["problems"] if p.startswith("base/head dimension mismatch")]
    assert len(mismatch) == 1
    assert "mtp.fc.weight" in mismatch[0] and "[32, 64]" in mismatch[0] and "hidden_size is 64" in mismatch[0]
    assert any("has shape [32], expected [64]" in p for p in report["problems"])


def test_reports_mixed_expert_layouts(donor, tiny_checkpoint, tmp_path, capsys):
    written, tensors = donor
    fused = SafetensorsCheckpoint(tiny_checkpoint(QWEN3_5, FUSED, True).path)
    for key in [k for k in tensors if k.startswith("mtp.layers.0.mlp.experts.") and k.endswith("down_proj.weight")]:
        del tensors[key]
    tensors["mtp.layers.0.mlp.experts.down_proj"] = fused.get("mtp.layers.0.mlp.experts.down_proj")
    bad = rewrite(written.path, tmp_path / "bad", tensors)
    code, report = run_json(capsys, bad)
    assert code == 1
    assert any("mixes fused and per-expert" in p and "mtp.layers.0.mlp.experts.down_proj" in p for p in report["problems"])


def test_reports_a_quantized_base_and_what_it_takes_in_memory(tiny_checkpoint, tmp_path, capsys):
    """An FP8 and an NVFP4 copy inspect clean, with their scheme and the memory the base takes: for FP8
    kept in FP8, what the loaded base holds (`memory.held_bytes`, the rotary tables aside). A scale of
    the wrong shape, and an unsupported scheme in a bare config, are problems."""
    from occamy_mtp.memory import held_bytes
    from occamy_mtp.testing.quantize import write_quantized_copy

    written = tiny_checkpoint(QWEN3_5, PER_EXPERT, True)
    for scheme in ("fp8", "nvfp4"):
        quantized = write_quantized_copy(written.path, tmp_path / scheme, scheme, block=(16, 16))
        code, report = run_json(capsys, quantized)
        assert code == 0, report["problems"]
        assert report["quantization"]["scheme"] == scheme and any(f"quantized base ({scheme}" in n for n in report["notes"])
        memory = report["base_memory"]
        loaded = ckpt_io.load_base(quantized, fp8_weights="fp8")
        tables = sum(b.untyped_storage().nbytes() for n, b in loaded.named_buffers() if "rotary" in n)
        measured = held_bytes(loaded) - tables
        if scheme == "fp8":
            assert memory["kept_in_fp8_bytes"] == measured
            assert memory["dequantized_bytes"] == held_bytes(ckpt_io.load_base(quantized, fp8_weights="dequantized")) - tables
        else:
            assert "kept_in_fp8_bytes" not in memory and memory["dequantized_bytes"] == measured
    # hidden 50 and experts of 19: expert stacks that are not whole multiples of the buffer's
    # alignment, laid out with padding in every layer, the largest (which sizes the buffer) too
    odd_config = tiny_text_config(hidden_size=50, shared_expert_intermediate_size=20, moe_intermediate_size=19)
    odd = write_checkpoint(tmp_path / "odd", odd_config, random_models(odd_config, 0)[0], None, multimodal=False)
    quantized = write_quantized_copy(odd.path, tmp_path / "odd-fp8", "fp8", block=(16, 16))
    code, report = run_json(capsys, quantized)
    loaded = ckpt_io.load_base(quantized, fp8_weights="fp8")
    sizes = [[w.codes.numel() for w in layer.occamy_fp8_weights.weights] for layer in loaded.model.layers]
    assert max(map(fp8_weights.aligned_size, sizes)) > max(map(sum, sizes))  # padded: the count has to know it
    tables = sum(b.untyped_storage().nbytes() for n, b in loaded.named_buffers() if "rotary" in n)
    assert code == 0 and report["base_memory"]["kept_in_fp8_bytes"] == held_bytes(loaded) - tables
    capsys.readouterr()
    assert main([str(tmp_path / "fp8")]) == 0 and "with its layers kept in FP8" in capsys.readouterr().out
    # ModelOpt's scheme declared in hf_quant_config.json alone, config.json without a quantization_config
    raw = json.loads((tmp_path / "nvfp4" / "config.json").read_text())
    del raw["quantization_config"]
    (tmp_path / "nvfp4" / "config.json").write_text(json.dumps(raw))
    code, report = run_json(capsys, tmp_path / "nvfp4")
    assert code == 0 and report["quantization"]["scheme"] == "nvfp4"
    assert report["quantization"]["declared_in"].endswith("hf_quant_config.json")

    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "fp8", broken)
    ckpt = ckpt_io.SafetensorsCheckpoint(broken)
    key = next(k for k in ckpt.keys() if k.endswith(".weight_scale_inv"))
    tensors = {k: ckpt.get(k) for k in ckpt.keys()}
    tensors[key] = tensors[key][..., :0]
    for f in ckpt.files():
        f.unlink()
    (broken / ckpt_io.INDEX_NAME).unlink()
    ckpt_io.save_sharded(broken, tensors, max_shard_bytes=400_000)
    code, report = run_json(capsys, broken)
    assert code == 1 and any(key in p and "expected" in p for p in report["problems"])

    config = write_config(tmp_path / "config.json", QWEN3_5_35B_A3B, multimodal=False,
                          quantization_config={"quant_method": "gptq"})
    code, report = run_json(capsys, config)
    assert code == 1 and "'gptq' (known, not supported)" in report["problems"][0]
    assert report["head_parameters"] == 844_640_768


def test_reports_unreadable_checkpoints(donor, tmp_path, capsys):
    written, _ = donor
    corrupt = tmp_path / "corrupt"
    shutil.copytree(written.path, corrupt)
    (corrupt / ckpt_io.INDEX_NAME).write_text("{ not json")
    code, report = run_json(capsys, corrupt)
    assert code == 1 and "not readable JSON" in report["problems"][0] and ckpt_io.INDEX_NAME in report["problems"][0]
    # What the config says is still reported.
    assert report["head_parameters"] == head_numel_on_disk(written.path)

    code, report = run_json(capsys, tmp_path / "nowhere")
    assert code == 1 and "no such config file" in report["problems"][0]


@pytest.mark.parametrize("what", ["config.json", "a head file", "a training checkpoint"])
def test_inspect_and_train_on_a_file_that_is_not_text_say_so_in_one_line(donor, tmp_path, capsys, what):
    """A config.json of binary bytes (or a head file or a training checkpoint given where a checkpoint
    directory belongs): one line naming the file, from inspect and from train, no traceback."""
    from occamy_mtp.commands import train as train_command

    written, _ = donor
    target = tmp_path / "binary"
    shutil.copytree(written.path, target)
    binary = bytes(range(256)) * 8
    if what == "config.json":
        (target / "config.json").write_bytes(binary)
        given = target
    else:
        given = tmp_path / ("mtp-trained.safetensors" if what == "a head file" else "step-000064.pt")
        given.write_bytes(binary)
    code, report = run_json(capsys, given)
    assert code == 1 and report["problems"] and ("not readable JSON" in report["problems"][0]
                                                 or "not a checkpoint directory" in report["problems"][0])
    capsys.readouterr()
    assert train_command.main(["--config", "configs/demo.yaml", f"model.base={given}", f"output.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and str(given.name) in err[-1] and "Traceback" not in "\n".join(err), err
