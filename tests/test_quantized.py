"""Quantized bases (issue 46, items 4-5): the family's block-wise FP8 and ModelOpt's NVFP4, read as
the frozen base; each dequantization and the NVFP4 activations against a plain reference."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.model import quantized as q
from occamy_mtp.testing.checkpoints import build_tiny_checkpoint
from occamy_mtp.testing.quantize import write_quantized_copy

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def bases(tmp_path_factory, sample_tokenizer_dir):
    """A tiny bf16 base (per-expert, multimodal layout) and its FP8 (blocks of 16 x 16) and NVFP4 copies."""
    root = tmp_path_factory.mktemp("quantized")
    base = build_tiny_checkpoint(root / "base", layout="per_expert", multimodal=True, seed=2,
                                 tokenizer_dir=sample_tokenizer_dir).path
    return {"root": root, "bf16": base,
            q.FP8: write_quantized_copy(base, root / "fp8", q.FP8, block=(16, 16)),
            q.NVFP4: write_quantized_copy(base, root / "nvfp4", q.NVFP4)}


# ----------------------------------------------------------------------------------
# Dequantization against element-by-element references
# ----------------------------------------------------------------------------------


def test_fp8_blocks_dequantize_as_each_element_times_its_block_s_multiplier():
    torch.manual_seed(0)
    weight = (torch.randn(2, 7, 37) * 3).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 2, 5) + 0.1  # blocks of 4 x 8: ceil(7/4) = 2, ceil(37/8) = 5
    got = q.dequantize_fp8(weight, scale_inv, (4, 8))
    for e in range(2):
        for i in range(7):
            for j in range(37):
                assert got[e, i, j] == weight[e, i, j].float() * scale_inv[e, i // 4, j // 8]


def test_nvfp4_bytes_dequantize_as_computed_by_hand():
    # One row of 32 elements, two groups. Byte 0x91: low nibble 1 (+0.5), high nibble 9 (-0.5).
    # Byte 0x7F: low 15 (-6.0), high 7 (+6.0). Group scales 2.0 and 0.5 (exact in fp8), global 0.25.
    packed = torch.tensor([[0x91, 0x7F] + [0x00] * 6 + [0x32, 0xC4] + [0x00] * 6], dtype=torch.uint8)
    scale = torch.tensor([[2.0, 0.5]]).to(torch.float8_e4m3fn)
    got = q.dequantize_nvfp4(packed, scale, torch.tensor(0.25))
    expected = torch.zeros(1, 32)
    expected[0, :4] = torch.tensor([0.5, -0.5, -6.0, 6.0]) * 2.0 * 0.25
    expected[0, 16:20] = torch.tensor([1.0, 1.5, 2.0, -2.0]) * 0.5 * 0.25  # 0x32: 2 (1.0), 3 (1.5); 0xC4: 4 (2.0), 12 (-2.0)
    assert torch.equal(got, expected)


def test_nvfp4_dequantizes_as_each_nibble_times_its_group_s_scales():
    torch.manual_seed(1)
    packed = torch.randint(0, 256, (3, 24), dtype=torch.uint8)  # 48 elements a row, 3 groups
    scale = (torch.rand(3, 3) * 4).to(torch.float8_e4m3fn)
    got = q.dequantize_nvfp4(packed, scale, torch.tensor(0.125))
    for r in range(3):
        for c in range(48):
            byte = int(packed[r, c // 2])
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            value = q.E2M1_VALUES[code & 7] * (-1 if code & 8 else 1)
            assert got[r, c] == value * scale[r, c // 16].float() * 0.125


def test_e2m1_rounds_to_nearest_and_ties_to_the_even_code():
    x = torch.tensor([0.24, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -5.0, 0.0])
    assert q.e2m1_round(x).tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -4.0, 0.0]


def test_nvfp4_activations_fake_quantize_group_by_group():
    torch.manual_seed(2)
    x = torch.randn(3, 32) * 5
    x[1, :16] = 0  # an all-zero group stays zero
    input_scale = torch.tensor(0.01)
    got = q.fake_quantize_nvfp4(x, input_scale)
    for r in range(3):
        for g in range(2):
            group = x[r, 16 * g: 16 * g + 16]
            scale = float(torch.tensor(float(group.abs().max()) / 6 / 0.01).to(torch.float8_e4m3fn).float())
            for c in range(16):
                if scale == 0:
                    assert got[r, 16 * g + c] == 0
                    continue
                step = scale * 0.01
                candidates = [v for m in q.E2M1_VALUES for v in (m, -m)]
                nearest = min(candidates, key=lambda v: (abs(float(group[c]) / step - v), v != 0 and q.E2M1_VALUES.index(abs(v)) % 2))
                assert float(got[r, 16 * g + c]) == pytest.approx(nearest * step, rel=1e-6)


@pytest.mark.parametrize("scheme", [q.FP8, q.NVFP4])
def test_quantizing_then_dequantizing_stays_within_the_format_s_step(scheme):
    torch.manual_seed(3)
    weight = torch.randn(40, 64)
    if scheme == q.FP8:
        stored, scale_inv = q.quantize_fp8(weight, (16, 32))
        back = q.dequantize_fp8(stored, scale_inv, (16, 32))
        # e4m3's widest gap below 448 is 32 (between 256 and 448): half of it, in the block's units
        bound = scale_inv.repeat_interleave(16, 0)[:40].repeat_interleave(32, 1) * 16
    else:
        packed, scale, scale_2 = q.quantize_nvfp4(weight)
        back = q.dequantize_nvfp4(packed, scale, scale_2)
        # e2m1's widest gap is 2 (between 4 and 6): half of it in the group's step; the group's fp8
        # scale, rounded down by at most 1/16, can leave its largest element 6/16 of a step past 6
        bound = scale.float().repeat_interleave(16, 1) * scale_2
    assert bool(((back - weight).abs() <= bound + 1e-6).all())


# ----------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", [q.FP8, q.NVFP4])
def test_a_quantized_base_loads_its_weights_dequantized(bases, scheme):
    raw = ckpt_io.SafetensorsCheckpoint(bases[scheme])
    model = ckpt_io.load_base(bases[scheme], dtype=torch.float32)
    reference = ckpt_io.load_base(bases["bf16"], dtype=torch.float32)
    state, original = model.state_dict(), reference.state_dict()
    checked = 0
    for key in raw.keys():
        if not key.endswith(".weight") or raw.dtype(key) not in ("F8_E4M3", "U8"):
            continue
        name = key.replace("model.language_model.", "model.")
        expert = q._EXPERT_KEY.match(name[: -len(".weight")])
        stem = key[: -len(".weight")]
        if scheme == q.FP8:
            value = q.dequantize_fp8(raw.get(key), raw.get(stem + ".weight_scale_inv"), (16, 16))
        else:
            value = q.dequantize_nvfp4(raw.get(key), raw.get(stem + ".weight_scale"), raw.get(stem + ".weight_scale_2"))
        if expert:
            e, proj = int(expert["expert"]), expert["proj"]
            fused = state[f"{expert['stem']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][e]
            half = fused.shape[0] // 2
            loaded = fused if proj == "down_proj" else fused[:half] if proj == "gate_proj" else fused[half:]
        else:
            loaded = state[name]
        assert torch.equal(loaded, value), key
        checked += 1
    assert checked > 10
    untouched = [k for k in state if "norm" in k or "embed_tokens" in k or "lm_head" in k]
    assert untouched and all(torch.equal(state[k], original[k]) for k in untouched)


def test_an_nvfp4_base_quantizes_each_linear_s_input(bases):
    model = ckpt_io.load_base(bases[q.NVFP4], dtype=torch.float32)
    scales = q.DequantizedCheckpoint(ckpt_io.SafetensorsCheckpoint(bases[q.NVFP4]), q.Scheme(q.NVFP4)).input_scales
    name = next(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith("o_proj"))
    linear = dict(model.named_modules())[name]
    x = torch.randn(5, linear.in_features)
    scale = scales["model.language_model." + name[len("model."):] + ".weight"]
    assert torch.equal(linear(x), torch.nn.functional.linear(q.fake_quantize_nvfp4(x, scale), linear.weight))


def test_the_emulated_experts_route_and_weigh_as_transformers_does(bases, monkeypatch):
    """With the activations' quantization taken out, the one-expert-at-a-time emulation gives
    transformers' own experts' output: routing, gating and weighting are the same."""
    base = ckpt_io.load_base(bases["bf16"], dtype=torch.float32)
    experts = next(m for m in base.modules() if hasattr(m, "gate_up_proj") and m.gate_up_proj.dim() == 3)
    tokens, count = 9, experts.gate_up_proj.shape[0]
    hidden = torch.randn(tokens, experts.gate_up_proj.shape[-1])
    index = torch.stack([torch.randperm(count)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2)
    expected = experts(hidden, index, weights)
    emulated = q._emulated_experts(experts, [None] * count, [None] * count, lambda x, scale: x)
    assert torch.allclose(emulated(hidden, index, weights), expected, atol=1e-6)


# ----------------------------------------------------------------------------------
# FP8 activations (W8A8), emulated: against a plain element-by-element reference
# ----------------------------------------------------------------------------------


def e4m3_round(values: torch.Tensor) -> torch.Tensor:
    """float64 `values` (|v| <= 448) rounded to the nearest float8_e4m3fn value, ties to the even code,
    by search in the table of every finite code: the reference, independent of torch's cast."""
    codes = torch.arange(128, dtype=torch.uint8)  # the non-negative codes; 127 is NaN
    table = codes.view(torch.float8_e4m3fn).double()[:127]
    magnitude = values.abs()
    above = torch.searchsorted(table, magnitude).clamp(max=126)
    below = (above - 1).clamp(min=0)
    down, up = table[below], table[above]
    pick_up = (up - magnitude < magnitude - down) | ((up - magnitude == magnitude - down) & (above % 2 == 0))
    return torch.where(pick_up, up, down).copysign(values)


def reference_fp8_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """The W8A8 input quantization, one group at a time: scale = max(amax, 1e-10) / 448 (float32),
    each element x / scale rounded to e4m3 (`e4m3_round`), times the scale."""
    out = torch.empty_like(x)
    rows = x.float().reshape(-1, x.shape[-1])
    flat = out.reshape(-1, x.shape[-1])
    for r in range(rows.shape[0]):
        for start in range(0, rows.shape[1], group):
            part = rows[r, start:start + group]
            scale = torch.clamp(part.abs().max(), min=1e-10) / 448.0
            scaled = (part / scale).double()
            flat[r, start:start + group] = (e4m3_round(scaled).float() * scale).to(x.dtype)
    return out


def test_fp8_activations_quantize_a_group_as_computed_by_hand():
    # One row of two groups of 4. Group 1: amax 2.0, scale 2/448; 1.0 -> 224 (exact), 0.3 -> 67.2 -> 64
    # (e4m3 steps by 8 between 64 and 128), -2.0 -> -448. Group 2: all zero -> stays zero.
    x = torch.tensor([[1.0, 0.3, -2.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    scale = torch.tensor(2.0) / 448.0
    expected = torch.tensor([[224.0, 64.0, -448.0, 0.0, 0.0, 0.0, 0.0, 0.0]]) * scale
    assert torch.equal(q.fake_quantize_fp8_groups(x, 4), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_activations_quantize_as_the_element_by_element_reference(dtype):
    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 64, generator=generator) * torch.logspace(-3, 3, 6)[:, None]).to(dtype)
    x[2, 16:32] = 0.0  # an all-zero group
    x[3, 5] = 1e4  # a group whose other elements fall to subnormals or zero
    ties = torch.tensor([1.0, 8.5, 9.5, 448.0])  # with amax 448 the scale is 1: 8.5 and 9.5 are ties (steps of 1 up to 16)
    x[4, :4] = ties.to(dtype)
    got = q.fake_quantize_fp8_groups(x, 16)
    assert torch.equal(got, reference_fp8_groups(x, 16))
    if dtype == torch.float32:
        assert got[4, :4].tolist() == [1.0, 8.0, 10.0, 448.0]  # ties to the even code


def test_an_fp8_base_quantizes_each_fp8_linear_s_input_as_the_engine_does(bases, monkeypatch):
    """model.fp8_activations fp8: every FP8 linear's input, and every expert's input and activation,
    quantized per token in groups of weight_block_size[1] (16 here); the layers the checkpoint keeps in
    bf16 (routers, norms, lm_head) untouched; the fast paths stand aside."""
    from occamy_mtp.base.frozen import FrozenBase
    from occamy_mtp.config import ModelSettings

    plain = FrozenBase.open(ModelSettings(base=str(bases[q.FP8]), dtype="float32"), "cpu")
    base = FrozenBase.open(ModelSettings(base=str(bases[q.FP8]), dtype="float32", fp8_activations="fp8"), "cpu")
    assert plain.fast_paths and not base.fast_paths and (plain.emulated, base.emulated) == (None, q.FP8)
    fp8_modules = {name for name, m in base.named_modules() if isinstance(m, torch.nn.Linear) and m._forward_pre_hooks}
    assert fp8_modules and not any("router" in n or "gate" == n.rsplit(".", 1)[-1] or "lm_head" in n for n in fp8_modules)
    seen: dict[str, list] = {}

    def capture(name, stage):
        def hook(module, args):
            seen.setdefault(name, []).append((stage, args[0].clone()))
        return hook

    for name in fp8_modules:
        module = dict(base.named_modules())[name]
        module.register_forward_pre_hook(capture(name, "raw"), prepend=True)
        module.register_forward_pre_hook(capture(name, "quantized"))
    quantized_inside_experts = []
    real = q.fake_quantize_fp8_groups

    def spy(x, group):
        out = real(x, group)
        quantized_inside_experts.append((x.clone(), out, group))
        return out

    monkeypatch.setattr(q, "fake_quantize_fp8_groups", spy)
    ids = torch.randint(0, 1024, (2, 19), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        emulated, unquantized = base(input_ids=ids).logits, plain(input_ids=ids).logits
    for name in fp8_modules:
        (stage_a, raw), (stage_b, quantized) = seen[name]
        assert (stage_a, stage_b) == ("raw", "quantized")
        assert torch.equal(quantized, reference_fp8_groups(raw, 16)), name
    experts = [m for m in base.modules() if hasattr(m, "gate_up_proj") and getattr(m.gate_up_proj, "dim", lambda: 0)() == 3]
    assert len(quantized_inside_experts) > len(fp8_modules)  # the experts' inputs and activations too
    for x, out, group in quantized_inside_experts:
        assert group == 16 and torch.equal(out, reference_fp8_groups(x, 16))
    assert experts and not torch.equal(emulated, unquantized)


def test_fp8_activations_are_the_same_with_the_weights_kept_in_fp8(bases):
    """model.fp8_weights fp8 writes each layer's weights before it runs, the quantized inputs' hooks run
    inside: the same logits bit for bit as the dequantized base with the same emulation."""
    ids = torch.randint(0, 1024, (2, 17), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        kept = ckpt_io.load_base(bases[q.FP8], dtype=torch.float32, fp8_weights="fp8", fp8_activations="fp8")(input_ids=ids).logits
        read = ckpt_io.load_base(bases[q.FP8], dtype=torch.float32, fp8_weights="dequantized",
                                 fp8_activations="fp8")(input_ids=ids).logits
    assert torch.equal(kept, read)


def test_fp8_activations_need_whole_groups(bases, tmp_path):
    """A linear whose input is not a whole number of the engine's groups is refused, naming the weight."""
    path = write_quantized_copy(bases["bf16"], tmp_path / "fp8-wide", q.FP8, block=(16, 48))
    with pytest.raises(q.QuantizationError, match=r"\.weight: its input has 64 features, not a multiple of the 48-feature"):
        ckpt_io.load_base(path, dtype=torch.float32, fp8_activations="fp8")


@pytest.mark.parametrize("scheme", [q.FP8, q.NVFP4])
def test_a_quantized_base_keeps_the_base_s_choices_mostly(bases, scheme):
    """The quantized copies are the same model within their formats' error: most greedy choices agree
    (a check that the copy is the base, not of how close a format is)."""
    ids = torch.randint(0, 1024, (2, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = ckpt_io.load_base(bases["bf16"], dtype=torch.float32)(input_ids=ids).logits.argmax(-1)
        quantized = ckpt_io.load_base(bases[scheme], dtype=torch.float32)(input_ids=ids).logits.argmax(-1)
    assert float((reference == quantized).float().mean()) > 0.7


# ----------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------


def _copy(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def _rewrite(directory: Path, change) -> None:
    """Rewrite the shard and index of `directory` with `change(tensors)` applied."""
    from safetensors.torch import load_file

    ckpt = ckpt_io.SafetensorsCheckpoint(directory)
    tensors = {}
    for path in ckpt.files():
        tensors.update(load_file(str(path)))
        path.unlink()
    (directory / "model.safetensors.index.json").unlink()
    change(tensors)
    ckpt_io.save_sharded(directory, tensors, max_shard_bytes=400_000)


@pytest.mark.parametrize("where", ["bf16 weight", "fp8 scale", "fp8 code kept"])
def test_a_nan_in_a_base_weight_or_scale_is_refused_naming_the_tensor(bases, tmp_path, capsys, where):
    """A NaN in a scale is refused by the base's facts and inspect before anything loads; a NaN in a
    weight (or a NaN code of an FP8 weight kept in FP8) by the load, naming the tensor."""
    from occamy_mtp.base.frozen import BaseFacts
    from occamy_mtp.commands import inspect as inspect_command

    attention = "model.language_model.layers.3.self_attn.o_proj"
    source = bases["bf16"] if where == "bf16 weight" else bases[q.FP8]
    broken = _copy(source, tmp_path / "broken")

    def poison(tensors):
        if where == "bf16 weight":
            tensors[f"{attention}.weight"][0, 0] = float("nan")
        elif where == "fp8 scale":
            tensors[f"{attention}.weight_scale_inv"][0, 0] = float("nan")
        else:
            codes = tensors[f"{attention}.weight"]
            codes.view(torch.uint8)[0, 0] = 0x7F  # e4m3fn's NaN
    _rewrite(broken, poison)
    name = f"{attention}.weight_scale_inv" if where == "fp8 scale" else f"{attention}.weight"
    if where == "fp8 scale":
        with pytest.raises(q.QuantizationError, match=f"{name} holds NaN"):
            BaseFacts(broken)
        assert inspect_command.main([str(broken), "--json"]) == 1
        assert any(f"{name} holds NaN" in problem for problem in json.loads(capsys.readouterr().out)["problems"])
        return
    BaseFacts(broken)  # the weights are read by the load
    with pytest.raises(ckpt_io.CheckpointError, match=f"{name} holds NaN or infinite values"):
        ckpt_io.load_base(broken, dtype=torch.float32, fp8_weights="fp8" if where == "fp8 code kept" else "dequantized")


def test_a_missing_or_misshapen_scale_is_refused_naming_the_tensor(bases, tmp_path):
    missing = _copy(bases[q.FP8], tmp_path / "missing")
    key = "model.language_model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"
    _rewrite(missing, lambda t: t.pop(key))
    with pytest.raises(q.QuantizationError, match=r"experts\.1\.up_proj\.weight is float8_e4m3fn but .*weight_scale_inv is missing"):
        ckpt_io.load_base(missing)
    wrong = _copy(bases[q.FP8], tmp_path / "wrong")
    _rewrite(wrong, lambda t: t.__setitem__(key, torch.ones(3, 3)))
    with pytest.raises(q.QuantizationError, match=r"experts\.1\.up_proj\.weight_scale_inv has shape \[3, 3\], expected \[\d+, \d+\] .*blocks of \[16, 16\]"):
        ckpt_io.load_base(wrong)
    nvfp4 = _copy(bases[q.NVFP4], tmp_path / "nvfp4")
    name = "model.language_model.layers.0.mlp.experts.0.down_proj"
    _rewrite(nvfp4, lambda t: t.__setitem__(name + ".weight_scale", t[name + ".weight_scale"][:, :1]))
    with pytest.raises(q.QuantizationError, match=r"down_proj\.weight_scale has shape .*one scale per 16 elements"):
        ckpt_io.load_base(nvfp4)


@pytest.mark.parametrize("declared, named", [
    ({"quant_method": "gptq", "bits": 4}, "'gptq' (known, not supported)"),
    ({"quant_method": "awq", "bits": 4}, "'awq' (known, not supported)"),
    ({"quant_method": "mxfp4"}, "'mxfp4' (known, not supported)"),
    ({"quant_method": "gguf"}, "'gguf' (known, not supported)"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "ModelOpt quant_algo 'FP8' is not supported"),
    ({"quant_method": "fp8", "fmt": "e4m3"}, "weight_block_size None"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fp8 fmt 'e5m2' is not supported"),
])
def test_an_unsupported_scheme_is_refused_naming_it_and_the_supported_ones(tmp_path, declared, named):
    with pytest.raises(q.QuantizationError, match="supported: block-wise FP8") as err:
        q.scheme_of(tmp_path, declared)
    assert named in str(err.value)


def test_the_train_command_refuses_an_unsupported_base_at_once_and_writes_nothing(bases, tmp_path, capsys):
    from occamy_mtp.commands.train import main

    base = _copy(bases["bf16"], tmp_path / "gptq")
    raw = json.loads((base / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (base / "config.json").write_text(json.dumps(raw))
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    output = tmp_path / "run"
    status = main(["--config", str(Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"),
                   f"model.base={base}", f"model.donor_head={bases['bf16']}", f"data.files=[{data}]", f"output.dir={output}"])
    err = capsys.readouterr().err
    assert status == 2 and "quantization 'gptq' (known, not supported)" in err and "Traceback" not in err
    assert not output.exists()


# ----------------------------------------------------------------------------------
# The recipe on quantized bases
# ----------------------------------------------------------------------------------


def _run_config(bases, base: Path, output: Path, *overrides):
    from occamy_mtp.config import load_config
    from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH

    data = bases["root"] / "chats.jsonl"
    if not data.exists():
        data.write_text("".join(SAMPLE_DATA_PATH.read_text().splitlines(keepends=True)[:40]))
    return load_config(None, [
        f"model.base={base}", f"model.donor_head={bases['bf16']}", "model.dtype=float32",
        f"data.files=[{data}]", "data.context_tokens=16", "data.answer_tokens=16",
        "data.train_conversations=4", "data.validation_conversations=2", "data.heldout_conversations=2",
        "train.epochs=1", "train.lr=1.0e-2", "train.lr_warmup_steps=1", "train.select_every_steps=0",
        "eval.decoder_check_windows=1", "eval.served_steps=[1,2]", "eval.draft_steps=2",
        "eval.serving=[{temperature: 0}, instruct-general]", "eval.sampled_continuations=1",
        f"output.dir={output}", *overrides])


def test_the_fp8_base_trains_and_exports_on_its_own_targets(bases, tmp_path):
    """The head trains on the FP8 base's own text and targets, and export measures it there (the
    reference decoder's check included, on the dequantized base)."""
    from occamy_mtp.export.exporter import export
    from occamy_mtp.settings import plan_of
    from occamy_mtp.train.loop import train

    config = _run_config(bases, bases[q.FP8], tmp_path / "run")
    summary = train(plan_of(config))
    record = export(plan_of(config), allow_worse=True, log=lambda m: None)
    assert summary["steps"] > 0 and record["base"]["path"] == str(bases[q.FP8].resolve())
    check = record["metrics"]["decoder_check"]["trained"]
    assert all(c["counts_equal"] for c in check.values())


def test_the_nvfp4_base_self_generates_and_evaluates(bases, tmp_path):
    """Evaluation on the NVFP4 base: the base (weights dequantized, inputs fake-quantized) writes the
    heldout continuations, and both heads are measured on them."""
    from occamy_mtp.evaluation.evaluate import evaluate_run
    from occamy_mtp.settings import plan_of

    config = _run_config(bases, bases[q.NVFP4], tmp_path / "run")
    report, printed = evaluate_run(plan_of(config), bases["bf16"], tmp_path / "eval", torch.device("cpu"))
    stores = report["self_generated"]["stores"]
    assert stores and all(s["windows"] > 0 for s in stores.values())
    assert set(report["heads"]) == {"donor", "trained"} and "greedy" in printed


def test_text_written_without_the_fp8_activations_is_not_taken_for_text_written_with_them(bases, tmp_path):
    """An FP8 base with its activations emulated computes other text and targets: a store the base wrote
    without the emulation is refused by name, and the target cache's identity differs; a bf16 base, which
    the setting leaves alone, keeps its identities, and so does an FP8 base without it (stores from
    before the setting open as they did)."""
    from occamy_mtp.evaluation.evaluate import evaluate_run
    from occamy_mtp.base.frozen import BaseFacts, BaseIdentity, emulated_activations
    from occamy_mtp.selfgen.store import SelfGenError
    from occamy_mtp.settings import plan_of
    from occamy_mtp.targets.cache import cache_identity

    plain = _run_config(bases, bases[q.FP8], tmp_path / "run")
    evaluate_run(plan_of(plain), bases["bf16"], tmp_path / "eval", torch.device("cpu"))
    emulated = _run_config(bases, bases[q.FP8], tmp_path / "run", "model.fp8_activations=fp8")
    with pytest.raises(SelfGenError, match=r"written under other settings \(activations: None in the store, 'fp8' now\)"):
        evaluate_run(plan_of(emulated), bases["bf16"], tmp_path / "eval", torch.device("cpu"))  # its stores, under --out
    fp8, bf16 = BaseFacts(bases[q.FP8]), BaseFacts(bases["bf16"])
    assert emulated_activations(emulated.model, fp8) == "fp8"
    assert emulated_activations(plain.model, fp8) is None and emulated_activations(emulated.model, bf16) is None
    identity = [cache_identity(BaseIdentity.of(c.model, fp8), [], {}).key for c in (plain, emulated)]
    assert identity[0] == cache_identity(BaseIdentity(fp8.fingerprint, fp8.text_config.vocab_size, "float32", "sdpa"), [], {}).key != identity[1]


def test_a_head_is_scored_on_the_base_it_is_served_on_beside_the_one_it_was_trained_on(bases, tmp_path):
    """`evaluate --served-base`: the served base writes its own text into its own store, every served
    figure is given on both bases with its difference, and the report warns that the head was trained
    on the bf16 base (its TRAINING.json says so) while it is scored on the FP8 one."""
    import shutil

    from occamy_mtp import record as rec
    from occamy_mtp.evaluation.served_base import evaluate_on_bases
    from occamy_mtp.settings import plan_of

    head_dir = tmp_path / "head"
    head_dir.mkdir()
    for path in bases["bf16"].iterdir():
        shutil.copyfile(path, head_dir / path.name)
    (head_dir / ckpt_io.EXPORT_RECORD).write_text(json.dumps({"base": rec.checkpoint_identity(bases["bf16"], {})}))
    config = _run_config(bases, bases["bf16"], tmp_path / "run", "eval.serving=[{temperature: 0}]")
    report, printed = evaluate_on_bases(plan_of(config), head_dir, tmp_path / "eval", torch.device("cpu"), [bases[q.FP8]])
    section = report["served_bases"]
    assert section["head_trained_on_run_base"] is True
    entry = section["bases"][str(bases[q.FP8])]
    assert entry["head_trained_on_it"] is False
    served = json.loads(Path(entry["report"]).read_text())
    assert served["inputs"]["base"] == str(bases[q.FP8])
    assert Path(entry["report"]).parent / "self-generated" != bases["root"]  # its own store, under --out
    for head in ("donor", "trained"):
        for k, d in entry["differences"][head]["greedy"].items():
            on_run = report["heads"][head]["serving"]["greedy"]["served"][k]["mean_accept_length"]
            on_served = served["heads"][head]["serving"]["greedy"]["served"][k]["mean_accept_length"]
            assert (d["run_base"], d["served_base"]) == (on_run, on_served) and d["difference"] == on_served - on_run
    assert len(section["warnings"]) == 1 and str(bases[q.FP8]) in section["warnings"][0]
    assert printed.startswith("warning: the head was trained on")
    written = json.loads((tmp_path / "eval" / "evaluation.json").read_text())
    assert written["served_bases"] == section


def test_an_emulated_nvfp4_base_is_left_to_transformers_forward(bases):
    """The fast paths (the packed base pass, the static decoder) read the weights directly and would
    skip the inputs' quantization: an NVFP4 base's opening records the emulation, and they stand aside.
    Nothing is tagged onto the transformers config."""
    from occamy_mtp.base.frozen import FrozenBase
    from occamy_mtp.config import ModelSettings

    fp8, nvfp4 = (FrozenBase.open(ModelSettings(base=str(bases[scheme])), "cpu") for scheme in (q.FP8, q.NVFP4))
    assert fp8.fast_paths and fp8.emulated is None
    assert not nvfp4.fast_paths and nvfp4.emulated == q.NVFP4
    assert not [name for base in (fp8, nvfp4) for name in vars(base.config) if name.startswith("occamy")]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [q.FP8, q.NVFP4])
def test_a_quantized_base_on_the_gpu_computes_what_it_computes_on_the_cpu(bases, scheme):
    """The dequantized weights and (NVFP4) the inputs' fake quantization run on a GPU as on the CPU,
    in float32: the same logits to float32's rounding of a different summation order, and the fast
    paths stand aside for NVFP4 there too. Both sides run the Gated DeltaNet's plain PyTorch code:
    with fla installed the GPU's would run fla's chunked kernels, whose other order of summation
    the NVFP4 input quantizer amplifies (an input moved across an e2m1 boundary changes every later
    position; on an H100 with fla, 7 of 80 positions stayed within 1e-4), which is not what this
    test is about."""
    import types

    from occamy_mtp.base.frozen import FrozenBase
    from occamy_mtp.compat import plain_forward
    from occamy_mtp.config import ModelSettings

    ids = torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(5))
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # float32 products on both
    try:
        with torch.no_grad():
            cpu = ckpt_io.load_base(bases[scheme], dtype=torch.float32)(input_ids=ids).logits
            model = FrozenBase.open(ModelSettings(base=str(bases[scheme]), dtype="float32"), "cuda")
            linear = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
            assert linear
            for module in linear:
                module.forward = types.MethodType(plain_forward(type(module).forward), module)
            gpu = model(input_ids=ids.cuda()).logits.cpu()
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    assert model.fast_paths == (scheme == q.FP8)
    if scheme == q.FP8:
        assert torch.allclose(gpu, cpu, atol=1e-4, rtol=1e-4), float((gpu - cpu).abs().max())
    else:  # an input at an e2m1 rounding boundary may round the other way: a few positions may move, no more
        close = (gpu - cpu).abs().amax(-1) <= 1e-4
        assert float(close.float().mean()) >= 0.9, float((gpu - cpu).abs().max())


def test_two_served_bases_of_one_name_are_refused_before_anything_runs(tmp_path):
    from occamy_mtp.config import ConfigError, load_config
    from occamy_mtp.evaluation.served_base import evaluate_on_bases
    from occamy_mtp.settings import plan_of

    plan = plan_of(load_config(None, [f"output.dir={tmp_path / 'run'}"]))
    with pytest.raises(ConfigError, match="two bases are named 'base'"):
        evaluate_on_bases(plan, tmp_path / "head", tmp_path / "eval", torch.device("cpu"), [tmp_path / "a" / "base", tmp_path / "b" / "base"])
    assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize("declaration", ["missing", "null"])
def test_an_fp8_base_whose_declaration_is_lost_is_named_before_anything_loads(bases, tmp_path, capsys, declaration):
    """config.json without its quantization_config (or with null): the base's facts, inspect and the load
    each say that the declaration is missing, in one line, before a weight is read."""
    import shutil

    from occamy_mtp.base.frozen import BaseFacts
    from occamy_mtp.commands import inspect as inspect_command

    lost = tmp_path / "lost"
    shutil.copytree(bases[q.FP8], lost)
    config = json.loads((lost / "config.json").read_text())
    holder = config if "quantization_config" in config else config["text_config"]
    if declaration == "missing":
        del holder["quantization_config"]
    else:
        holder["quantization_config"] = None
    (lost / "config.json").write_text(json.dumps(config))
    message = r"no quantization_config \(missing or null\).*tensors hold quantization scales"
    with pytest.raises(q.QuantizationError, match=message):
        BaseFacts(lost)
    assert inspect_command.main([str(lost), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert any(re.search(message, problem) for problem in report["problems"]), report["problems"]


@pytest.mark.parametrize("other", ["vocabulary", "family", "tokenizer"])
def test_a_served_base_that_is_another_model_is_refused_before_anything_runs(bases, tmp_path, other):
    """`evaluate --served-base` of a base with another vocabulary, another family (model_type) or another
    tokenizer: one ConfigError naming --served-base, before the run's own evaluation starts (nothing
    written under --out)."""
    import shutil

    from occamy_mtp.config import ConfigError
    from occamy_mtp.evaluation.served_base import evaluate_on_bases
    from occamy_mtp.settings import plan_of

    served = tmp_path / "served"
    shutil.copytree(bases[q.FP8], served)
    config_path = served / "config.json"
    config = json.loads(config_path.read_text())
    text = config.get("text_config", config)
    if other == "vocabulary":
        text["vocab_size"] += 64
        message = "vocab_size"
    elif other == "family":
        text["model_type"] = config["model_type"] = "llama"
        message = "model_type|architectures|family|not supported|llama"
    else:
        tokenizer = json.loads((served / "tokenizer_config.json").read_text())
        tokenizer["chat_template"] = "{{ messages[0].content }}"
        (served / "tokenizer_config.json").write_text(json.dumps(tokenizer))
        message = "its tokenizer is not the run's"
    config_path.write_text(json.dumps(config))
    plan = plan_of(_run_config(bases, bases["bf16"], tmp_path / "run", "eval.serving=[{temperature: 0}]"))
    with pytest.raises(ConfigError, match=f"--served-base {served}: .*({message})"):
        evaluate_on_bases(plan, bases["bf16"], tmp_path / "eval", torch.device("cpu"), [served])
    assert not (tmp_path / "eval").exists()


def test_an_nvfp4_base_with_kv_cache_scales_loads_them_read_past(bases, tmp_path):
    """ModelOpt writes `k_scale` / `v_scale` beside an fp8 KV cache: they are not weights of the
    model, and the base loads as it does without them."""
    with_kv = _copy(bases[q.NVFP4], tmp_path / "kv")
    attention = "model.language_model.layers.3.self_attn"
    _rewrite(with_kv, lambda t: t.update({f"{attention}.k_proj.k_scale": torch.tensor(0.5),
                                          f"{attention}.v_proj.v_scale": torch.tensor(0.5)}))
    ids = torch.randint(0, 1024, (1, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(ckpt_io.load_base(with_kv, dtype=torch.float32)(input_ids=ids).logits,
                           ckpt_io.load_base(bases[q.NVFP4], dtype=torch.float32)(input_ids=ids).logits)
