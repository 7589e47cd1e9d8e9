"""An FP8 base kept in FP8 (issue 46, item 4): each layer's weights written for its forward, against
the dequantizing load, which is the oracle: the same weights bit for bit, hence the same outputs, the
same fast paths, the same trained head. The Triton kernel of the write against its plain reference
(under Triton's interpreter here, compiled in the gpu-marked test)."""

from __future__ import annotations

import hashlib
import importlib
import json

import pytest
import torch

from occamy_mtp.memory import held_bytes
from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.model import fp8_weights
from occamy_mtp.model import quantized as q
from occamy_mtp.testing.checkpoints import build_tiny_checkpoint
from occamy_mtp.testing.quantize import write_quantized_copy
from test_end_to_end import without_timings

pytestmark = pytest.mark.usefixtures("single_thread")
BLOCK = (16, 16)


@pytest.fixture(scope="module")
def bases(tmp_path_factory, sample_tokenizer_dir):
    """A tiny bf16 base (per-expert, multimodal layout) and its FP8 copy in blocks of 16 x 16."""
    root = tmp_path_factory.mktemp("fp8-weights")
    base = build_tiny_checkpoint(root / "base", layout="per_expert", multimodal=True, seed=3,
                                 tokenizer_dir=sample_tokenizer_dir).path
    return {"root": root, "bf16": base, "fp8": write_quantized_copy(base, root / "fp8", q.FP8, block=BLOCK)}


@pytest.fixture()
def interpreted(monkeypatch):
    """`fp8_weights` with its kernel run by Triton's interpreter, on CPU tensors."""
    pytest.importorskip("triton", reason="needs triton (installed with the test extra on Linux x86-64)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    importlib.reload(fp8_weights)  # triton.jit reads the variable when the kernel is defined
    yield fp8_weights
    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(fp8_weights)


def _codes(shape, seed: int):
    """FP8 codes and multipliers of a random weight (blocks that do not divide it), with the format's
    extremes: 448, the smallest subnormal, zero, and values whose product lands on a bf16 tie."""
    generator = torch.Generator().manual_seed(seed)
    codes, scale = q.quantize_fp8(torch.randn(*shape, generator=generator) * 0.05, BLOCK)
    flat = codes.view(-1)
    flat[:4] = torch.tensor([448.0, -448.0, 2.0**-9, 0.0]).to(torch.float8_e4m3fn)
    # Code 1 times 1 + 2^-7 + 2^-8: halfway between bf16's 1 + 2^-7 (odd) and 1 + 2^-6 (even), which
    # rounding to nearest even picks and truncation does not.
    scale.view(-1)[0] = 1.0 + 2.0**-7 + 2.0**-8
    flat[4] = torch.tensor(1.0).to(torch.float8_e4m3fn)
    return codes, scale


# ----------------------------------------------------------------------------------
# The write against its reference
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_kernel_writes_the_reference_s_weights_bit_for_bit(interpreted, dtype):
    """A 2-D weight, and a row part of an expert stack (strided rows, as gate's and up's halves of a
    fused gate_up_proj are): each element the reference's, nothing outside the part touched."""
    codes, scale = _codes((40, 70), seed=1)
    out = torch.empty(40, 70, dtype=dtype)
    interpreted.dequantize_into(out, codes, scale, BLOCK)
    reference = interpreted.dequantize_reference(codes, scale, BLOCK, dtype)
    assert torch.equal(out, reference), float((out.float() - reference.float()).abs().max())
    if dtype == torch.bfloat16:  # the tie was among the elements compared
        assert float(reference.view(-1)[4]) == 1.0 + 2.0**-6

    stack, stack_scale = _codes((3, 24, 50), seed=2)
    fused = torch.full((3, 48, 50), 7.0, dtype=dtype)
    interpreted.dequantize_into(fused[:, 24:], stack, stack_scale, BLOCK)
    assert torch.equal(fused[:, 24:], interpreted.dequantize_reference(stack, stack_scale, BLOCK, dtype))
    assert bool((fused[:, :24] == 7.0).all())


@pytest.mark.parametrize("where", ["kernel", "reference"])
def test_only_the_routed_experts_are_written(request, where):
    """With `used`, a stack's slices it marks are written, the others keep what they held (the
    kernel's programs of an unmarked slice return before reading anything); slices of more than one
    program, the last one partial; the reference runs where the kernel cannot."""
    module = request.getfixturevalue("interpreted") if where == "kernel" else fp8_weights
    assert module._kernel_runs(torch.empty(0)) == (where == "kernel")
    shape = (5, 130, 140)
    assert fp8_weights._KERNEL_BLOCK * fp8_weights._KERNEL_STEPS < 130 * 140 < 2 * fp8_weights._KERNEL_BLOCK * fp8_weights._KERNEL_STEPS
    codes, scale = _codes(shape, seed=3)
    used = torch.tensor([1, 0, 0, 1, 0], dtype=torch.int32)
    out = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    module.dequantize_into(out, codes, scale, BLOCK, used)
    reference = module.dequantize_reference(codes, scale, BLOCK, torch.bfloat16)
    assert torch.equal(out[[0, 3]], reference[[0, 3]])
    assert bool(out[[1, 2, 4]].isnan().all())


def test_the_reference_writes_an_expert_stack_a_slice_at_a_time(monkeypatch):
    assert not fp8_weights._kernel_runs(torch.empty(0))  # on the CPU without the interpreter: the reference
    codes, scale = _codes((5, 20, 33), seed=4)
    monkeypatch.setattr(fp8_weights, "REFERENCE_CHUNK_ELEMENTS", 1000)  # two experts a slice, and a last one alone
    out = torch.empty(5, 20, 33, dtype=torch.bfloat16)
    fp8_weights.dequantize_into(out, codes, scale, BLOCK)
    assert torch.equal(out, fp8_weights.dequantize_reference(codes, scale, BLOCK, torch.bfloat16))


def test_the_modes_say_where_weights_stay_in_fp8():
    assert fp8_weights.keeps_fp8("fp8", "cpu") and not fp8_weights.keeps_fp8("dequantized", "cuda")
    assert fp8_weights.keeps_fp8("auto", "cuda") and not fp8_weights.keeps_fp8("auto", "cpu")
    with pytest.raises(ValueError, match="expected one of auto, fp8, dequantized"):
        fp8_weights.keeps_fp8("int8", "cpu")


def test_the_setting_is_checked_and_left_out_of_the_fingerprint():
    """How the weights are held does not change them, so a run may change it and resume."""
    from occamy_mtp.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.fp8_weights"):
        load_config(None, ["model.fp8_weights=int8"])
    assert load_config(None, ["model.fp8_weights=fp8"]).fingerprint() == load_config(None, []).fingerprint()


# ----------------------------------------------------------------------------------
# The base kept in FP8 against the dequantized base
# ----------------------------------------------------------------------------------


def _both(bases, dtype):
    kept = ckpt_io.load_base(bases["fp8"], dtype=dtype, fp8_weights="fp8")
    dequantized = ckpt_io.load_base(bases["fp8"], dtype=dtype, fp8_weights="dequantized")
    return kept, dequantized


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_layer_writes_the_weights_the_dequantizing_load_reads(bases, dtype):
    kept, dequantized = _both(bases, dtype)
    layers = kept.model.layers
    assert all(hasattr(layer, fp8_weights.ATTRIBUTE) for layer in layers)
    reference = dict(dequantized.named_parameters())
    for index, layer in enumerate(layers):
        fp8_weights.materialize(layer)
        names = [n for n, _ in layer.named_parameters()]
        compared = [n for n in names if torch.equal(layer.get_parameter(n), reference[f"model.layers.{index}.{n}"])]
        assert compared == names, sorted(set(names) - set(compared))
    written = {name for w in layers[0].occamy_fp8_weights.weights for name in [w.name]}
    assert {"gate_up_proj", "down_proj"} <= written  # the experts are among the weights kept in FP8
    assert all(not p.requires_grad for p in kept.parameters())


def test_the_layers_share_one_buffer_and_the_base_holds_what_is_counted(bases):
    """Every layer writes its routed experts into one buffer, the size of the largest layer's; its other
    quantized weights are parameters of their own, written once; the base holds the dequantized base's
    bytes less the experts in bf16, plus their codes and multipliers and that buffer."""
    kept, dequantized = _both(bases, torch.bfloat16)
    layers = kept.model.layers
    sizes = [sum(w.codes.numel() for w in layer.occamy_fp8_weights.weights) for layer in layers]
    buffers = {layer.occamy_fp8_weights.buffer.data_ptr() for layer in layers}
    pointers = {p.untyped_storage().data_ptr() for layer in layers for w in layer.occamy_fp8_weights.weights
                for p in [w.module.get_parameter(w.name)]}
    assert len(buffers) == 1 and pointers == buffers
    assert all(w.routed for layer in layers for w in layer.occamy_fp8_weights.weights)  # the experts alone
    others = {p.untyped_storage().data_ptr() for n, p in kept.named_parameters() if ".experts." not in n}
    assert not others & buffers  # every other weight holds its own storage: nothing writes it again
    offsets = [w.module.get_parameter(w.name).storage_offset() for layer in layers for w in layer.occamy_fp8_weights.weights]
    assert all(offset % fp8_weights.ALIGN_ELEMENTS == 0 for offset in offsets)  # the grouped GEMMs' alignment
    assert fp8_weights.aligned_size([10, 64, 3]) == 64 + 64 + 3  # a weight of 10 is followed by padding
    assert layers[0].occamy_fp8_weights.buffer.numel() == max(sizes)
    weights = [w for layer in layers for w in layer.occamy_fp8_weights.weights]
    experts = sum(w.codes.numel() * 2 for w in weights)
    fp8 = sum(w.codes.numel() + sum(s.numel() * 4 for s in w.scales) for w in weights)
    assert held_bytes(kept) == held_bytes(dequantized) - experts + fp8 + max(sizes) * 2


def test_a_larger_layer_grows_the_buffer_and_the_layers_before_move_to_it():
    """Layers kept one after another share a buffer; a layer whose experts need more gets a larger one, and
    the layers kept before it point into the new one, each still writing its own experts' values."""
    from occamy_mtp.model.quantized import quantize_fp8

    def layer_of(experts: int, seed: int):
        torch.manual_seed(seed)
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = torch.nn.Module()
        stacks = {"gate_up_proj": torch.randn(experts, 2 * 128, 128), "down_proj": torch.randn(experts, 128, 128)}
        held = {}
        for name, value in stacks.items():
            layer.mlp.experts.register_parameter(name, torch.nn.Parameter(value.to(torch.bfloat16), requires_grad=False))
            parts = value.split(128, dim=-2)
            quantized = [quantize_fp8(part, (128, 128)) for part in parts]
            held[f"mlp.experts.{name}"] = (torch.cat([c for c, _ in quantized], dim=-2), tuple(p.shape[-2] for p in parts),
                                           tuple(scale for _, scale in quantized))
        return layer, held

    buffers: dict = {}
    (small, small_held), (large, large_held) = layer_of(2, 1), layer_of(3, 2)
    first = fp8_weights.keep_layer(small, small_held, (128, 128), torch.bfloat16, buffers)
    before = first.buffer.numel()
    second = fp8_weights.keep_layer(large, large_held, (128, 128), torch.bfloat16, buffers)
    assert second.buffer.numel() > before and first.buffer.data_ptr() == second.buffer.data_ptr()
    for layer, held in ((small, small_held), (large, large_held)):
        fp8_weights.materialize(layer)
        assert layer.mlp.experts.gate_up_proj.untyped_storage().data_ptr() == second.buffer.data_ptr()
        for name, (codes, rows, scales) in held.items():
            parts = codes.split(list(rows), dim=-2)
            expected = torch.cat([fp8_weights.dequantize_reference(c, s, (128, 128), torch.bfloat16)
                                  for c, s in zip(parts, scales)], dim=-2)
            assert torch.equal(layer.mlp.experts.get_parameter(name.rpartition(".")[2]), expected), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_base_kept_in_fp8_computes_what_the_dequantized_base_computes(bases, dtype):
    """transformers' forward (the pre-hooks), greedy decoding, and the packed fast pass (which writes
    each layer itself): equal outputs, every layer's weights written after another layer's, from
    buffers filled with NaN, so that a weight read before it is written would show."""
    from occamy_mtp.base.fastbase import FastBasePass, torch_kernels
    from occamy_mtp.base.fastdecode import fast_plain_decode
    from occamy_mtp.base.generate import plain_decode

    kept, dequantized = _both(bases, dtype)
    def poisoned():  # whatever a forward reads that it did not write is NaN, and shows in its outputs
        kept.model.layers[0].occamy_fp8_weights.buffer.fill_(float("nan"))  # the layers' one buffer
        return kept

    ids = torch.randint(0, 1024, (2, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(poisoned()(input_ids=ids).logits, dequantized(input_ids=ids).logits)
        one_token = poisoned()(input_ids=ids[:1, :1]).logits
        assert torch.equal(one_token, dequantized(input_ids=ids[:1, :1]).logits)
    held = poisoned().model.layers[-1].occamy_fp8_weights
    held.materialize_experts(torch.tensor([[1, 3]]))  # a token routed to experts 1 and 3 writes theirs alone
    stacks = [w.module.get_parameter(w.name) for w in held.weights if w.routed]
    reference = dict(dequantized.model.layers[-1].named_parameters())
    assert len(stacks) == 2 and all(not s[[1, 3]].isnan().any() and s[[0, 2]].isnan().all() for s in stacks)
    experts = next(w.module for w in held.weights if w.routed)
    assert torch.equal(experts.gate_up_proj[[1, 3]], reference["mlp.experts.gate_up_proj"][[1, 3]])
    prompts = [ids[0, :9].tolist(), ids[1, :14].tolist()]
    decoded = [plain_decode(m, prompts, max_new_tokens=8, eos_token_ids={-1}, batch_size=2) for m in (poisoned(), dequantized)]
    assert decoded[0] == decoded[1]
    static = [fast_plain_decode(m, prompts, max_new_tokens=8, eos_token_ids=set(), batch_size=2)
              for m in (poisoned(), dequantized)]  # the static decoder, its layers unrolled
    assert static[0] == static[1]
    windows = [ids[0].tolist(), ids[1, :21].tolist(), ids[1, :2].tolist()]
    for grouped in (True, False):  # the grouped experts write the routed ones; the module's forward, its pre-hook
        passes = [FastBasePass(m, max_tokens_per_batch=64, kernels=torch_kernels(grouped_moe=grouped))(windows)
                  for m in (poisoned(), dequantized)]
        for a, b in zip(*passes):
            assert torch.equal(a.hidden, b.hidden) and torch.equal(a.greedy, b.greedy)


def test_a_base_built_in_memory_kept_in_fp8_computes_what_its_fp8_checkpoint_computes(bases):
    """The benches' full-size base is built on the card and kept in FP8 there (`keep_in_fp8`): it
    computes what the FP8 copy of the same weights, loaded, computes."""
    from occamy_mtp.testing.quantize import keep_in_fp8

    built = keep_in_fp8(ckpt_io.load_base(bases["bf16"], dtype=torch.float32), BLOCK)
    loaded = ckpt_io.load_base(bases["fp8"], dtype=torch.float32, fp8_weights="fp8")
    assert [len(layer.occamy_fp8_weights.weights) for layer in built.model.layers] == \
        [len(layer.occamy_fp8_weights.weights) for layer in loaded.model.layers]
    ids = torch.randint(0, 1024, (2, 30), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert torch.equal(built(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_a_sharded_base_is_read_dequantized(bases):
    """FSDP2 shards the layers' own tensors: a layer sharing a buffer cannot be one, so the loader
    reads an FP8 base dequantized when it places each layer (`place_layer`)."""
    placed = []
    model = ckpt_io.load_base(bases["fp8"], fp8_weights="fp8", place_layer=placed.append)
    assert len(placed) == len(model.model.layers)
    assert not any(hasattr(layer, fp8_weights.ATTRIBUTE) for layer in model.model.layers)


def test_the_recipe_on_the_base_kept_in_fp8_trains_the_head_the_dequantized_base_trains(bases, tmp_path, capsys):
    """The whole recipe (self-generation, training, selection, export with the decoder check) on the FP8
    base both ways: the same head, byte for byte, and the same figures."""
    from occamy_mtp.config import load_config
    from occamy_mtp.export.exporter import export
    from occamy_mtp.settings import plan_of
    from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH
    from occamy_mtp.train.loop import train

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(SAMPLE_DATA_PATH.read_text().splitlines(keepends=True)[:40]))
    records = {}
    for mode in ("fp8", "dequantized"):
        config = load_config(None, [
            f"model.base={bases['fp8']}", f"model.donor_head={bases['bf16']}", f"model.fp8_weights={mode}",
            f"data.files=[{data}]", "data.context_tokens=16", "data.answer_tokens=16",
            "data.train_conversations=4", "data.validation_conversations=2", "data.heldout_conversations=2",
            "train.epochs=1", "train.lr=1.0e-2", "train.lr_warmup_steps=1", "train.select_every_steps=2",
            "eval.decoder_check_windows=1", "eval.served_steps=[1,2]", "eval.draft_steps=2",
            "eval.serving=[{temperature: 0}, instruct-general]", "eval.sampled_continuations=1",
            f"output.dir={tmp_path / mode}"])
        train(plan_of(config))
        assert ("keep their weights in FP8" in capsys.readouterr().err) == (mode == "fp8")
        record = export(plan_of(config), allow_worse=True, log=lambda m: None)
        head = (tmp_path / mode / ckpt_io.HEAD_FILE).read_bytes()
        records[mode] = (hashlib.sha256(head).hexdigest(), json.dumps(without_timings(record["metrics"]), sort_keys=True))
    assert records["fp8"] == records["dequantized"]


# ----------------------------------------------------------------------------------
# On the GPU
# ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_compiled_kernel_writes_the_reference_s_weights_on_the_gpu(dtype):
    """The compiled kernel (the cast's own rounding on the GPU), on a gate_up-sized row part with more
    than 2**31 bytes of output behind it in the stack, and the base kept in FP8 on the card."""
    codes, scale = _codes((3, 40, 70), seed=7)
    out = torch.full((3, 80, 70), 7.0, dtype=dtype, device="cuda")
    fp8_weights.dequantize_into(out[:, :40], codes.cuda(), scale.cuda(), BLOCK)
    assert torch.equal(out[:, :40].cpu(), fp8_weights.dequantize_reference(codes, scale, BLOCK, dtype))
    assert bool((out[:, 40:] == 7.0).all())
    experts, rows, cols = 512, 1024, 2048  # 2**30 weights: element offsets past 2**31 bytes in float32
    big_codes = torch.randn(experts, rows, cols, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    big_scale = torch.rand(experts, rows // 128, cols // 128, device="cuda") + 0.5
    big = torch.empty(experts, rows, cols, dtype=dtype, device="cuda")
    fp8_weights.dequantize_into(big, big_codes, big_scale, (128, 128))
    for e in (0, experts - 1):
        assert torch.equal(big[e], fp8_weights.dequantize_reference(big_codes[e], big_scale[e], (128, 128), dtype))


@pytest.mark.gpu
def test_the_base_kept_in_fp8_on_the_gpu_computes_what_the_dequantized_base_computes(bases):
    """On the card: transformers' forward, the static decoder (its steps captured in a CUDA graph, the
    writes and the experts' mask inside) and the packed pass, against the base read dequantized."""
    from occamy_mtp.base.fastbase import FastBasePass
    from occamy_mtp.base.fastdecode import fast_plain_decode

    kept = ckpt_io.load_base(bases["fp8"], dtype=torch.bfloat16, device="cuda")  # auto: kept in FP8 on CUDA
    dequantized = ckpt_io.load_base(bases["fp8"], dtype=torch.bfloat16, device="cuda", fp8_weights="dequantized")
    assert all(hasattr(layer, fp8_weights.ATTRIBUTE) for layer in kept.model.layers)
    ids = torch.randint(0, 1024, (2, 30), generator=torch.Generator().manual_seed(8)).cuda()
    with torch.no_grad():
        assert torch.equal(kept(input_ids=ids).logits, dequantized(input_ids=ids).logits)
    prompts = [ids[0, :9].tolist(), ids[1, :14].tolist()]
    decoded = [fast_plain_decode(m, prompts, max_new_tokens=8, eos_token_ids=set(), batch_size=2, cuda_graph=True)
               for m in (kept, dequantized)]
    assert decoded[0] == decoded[1]
    windows = [ids[0].tolist(), ids[1, :21].tolist()]
    passes = [FastBasePass(m, max_tokens_per_batch=64)(windows) for m in (kept, dequantized)]
    for a, b in zip(*passes):
        assert torch.equal(a.hidden, b.hidden) and torch.equal(a.greedy, b.greedy)
