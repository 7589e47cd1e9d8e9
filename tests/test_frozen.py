"""The frozen base has one door (`base.frozen.FrozenBase.open`) and one identity (`BaseIdentity`).

Every command that loads the base opens it there, so each honours every `model.*` setting; what
the opening decided is a field of the object, never a tag on transformers' config; and every
store or cache built from the base embeds its whole identity, so that a setting that changes what
the base computes is never resumed onto text or targets computed without it.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from occamy_mtp.base.frozen import BaseFacts, BaseIdentity, FrozenBase
from occamy_mtp.config import ModelSettings
from occamy_mtp.model import quantized as q
from occamy_mtp.testing.checkpoints import build_tiny_checkpoint
from occamy_mtp.testing.quantize import write_quantized_copy

PACKAGE = Path(__file__).resolve().parent.parent / "occamy_mtp"
LOW_LEVEL_LOADS = {"load_base", "open_base"}  # model.checkpoint's reads of a base's weights into a model


@pytest.fixture(scope="module")
def bases(tmp_path_factory, sample_tokenizer_dir):
    """A tiny bf16 base and its FP8 copy (blocks of 16 x 16)."""
    root = tmp_path_factory.mktemp("frozen")
    base = build_tiny_checkpoint(root / "base", seed=2, tokenizer_dir=sample_tokenizer_dir).path
    return {"root": root, "bf16": base, q.FP8: write_quantized_copy(base, root / "fp8", q.FP8, block=(16, 16))}


def settings(base: Path, **fields) -> ModelSettings:
    return ModelSettings(base=str(base), **{"dtype": "float32", **fields})


def _calls(path: Path) -> set[str]:
    """The names of the functions `path` calls (`f(...)`, `module.f(...)`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            out.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return out


# ----------------------------------------------------------------------------------
# One door
# ----------------------------------------------------------------------------------


def test_the_low_level_base_load_has_one_library_caller():
    callers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if _calls(p) & LOW_LEVEL_LOADS)
    # checkpoint.load_base is open_base's model alone (for tests and benches); the library opens through frozen.py
    assert callers == ["base/frozen.py", "model/checkpoint.py"], callers


def test_the_door_check_finds_a_second_caller(tmp_path):
    path = tmp_path / "loader.py"
    path.write_text("from occamy_mtp.model import checkpoint as ckpt_io\nbase = ckpt_io.load_base('b', device='cpu')\n")
    assert _calls(path) & LOW_LEVEL_LOADS == {"load_base"}


def _setattr_on_a_config(path: Path) -> list[str]:
    """`setattr(x.config, ...)` or `x.config.<name> = ...` in `path`: a fact tagged onto transformers' config."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
            target = node.args[0]
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
            target = node.targets[0].value
        else:
            continue
        if isinstance(target, ast.Attribute) and target.attr == "config":
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_fact_is_tagged_onto_a_transformers_config():
    tagged = [line for path in PACKAGE.rglob("*.py") for line in _setattr_on_a_config(path)]
    assert tagged == []


def test_the_tag_check_finds_a_tag(tmp_path):
    path = tmp_path / "tagger.py"
    path.write_text("def mark(model):\n    setattr(model.config, 'sharded', 2)\n    model.config.emulated = 'fp8'\n")
    assert sorted(_setattr_on_a_config(path)) == ["tagger.py:2", "tagger.py:3"]


def test_the_opened_base_carries_what_the_opening_decided(bases):
    plain = FrozenBase.open(settings(bases[q.FP8]), "cpu")
    emulated = FrozenBase.open(settings(bases[q.FP8], fp8_activations="fp8"), "cpu")
    kept = FrozenBase.open(settings(bases[q.FP8], fp8_weights="fp8"), "cpu")
    assert plain.quantization.kind == q.FP8 and plain.placement.sharded_over == 0 and plain.described() == "whole, on cpu"
    assert (plain.emulated, plain.fp8_layers, plain.fast_paths) == (None, 0, True)
    assert (emulated.emulated, emulated.fast_paths) == (q.FP8, False)
    assert kept.fp8_layers == len(kept.model.layers) and kept.fast_paths
    for base in (plain, emulated, kept):
        assert not [name for name in vars(base.config) if name.startswith("occamy")]
    ids = torch.randint(0, 1024, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the object reads as the causal LM it holds
        assert torch.equal(plain(input_ids=ids).logits, plain.module(input_ids=ids).logits)
        assert torch.equal(kept(input_ids=ids).logits, plain(input_ids=ids).logits)  # FP8 kept resident: bit for bit


# ----------------------------------------------------------------------------------
# One identity
# ----------------------------------------------------------------------------------


def _identities(identity: BaseIdentity, base_dir: Path) -> dict[str, object]:
    """What each store built from the base records of it."""
    from occamy_mtp.selfgen.regenerate import base_record
    from occamy_mtp.selfgen.store import compared, store_identity
    from occamy_mtp.targets.cache import cache_identity

    return {"store": compared(store_identity(identity, max_new_tokens=8, stop_token_ids={2})),
            "cache": cache_identity(identity, [], {}).key,
            "sidecar": {k: v for k, v in base_record(identity, base_dir).items() if k != "path"}}


def test_each_setting_that_changes_what_the_base_computes_changes_every_identity(bases, tmp_path):
    fp8 = BaseFacts(bases[q.FP8])
    default = _identities(BaseIdentity.of(settings(bases[q.FP8]), fp8), bases[q.FP8])
    changed = {
        "model.dtype": settings(bases[q.FP8], dtype="bfloat16"),
        "model.attn_implementation": settings(bases[q.FP8], attn_implementation="eager"),
        "model.fp8_activations": settings(bases[q.FP8], fp8_activations="fp8"),
    }
    for option, model in changed.items():
        other = _identities(BaseIdentity.of(model, fp8), bases[q.FP8])
        assert [part for part in default if other[part] == default[part]] == [], option
    other_weights = build_tiny_checkpoint(tmp_path / "other", seed=3).path
    other = _identities(BaseIdentity.of(settings(other_weights), BaseFacts(other_weights)), other_weights)
    assert [part for part in default if other[part] == default[part]] == []


def test_a_setting_that_leaves_the_output_alone_leaves_the_identity_alone(bases):
    fp8, bf16 = BaseFacts(bases[q.FP8]), BaseFacts(bases["bf16"])
    kept = BaseIdentity.of(settings(bases[q.FP8], fp8_weights="fp8"), fp8)
    assert kept == BaseIdentity.of(settings(bases[q.FP8], fp8_weights="dequantized"), fp8)
    # fp8_activations only rounds an FP8 base's inputs: a bf16 base computes, and is identified, as before
    assert BaseIdentity.of(settings(bases["bf16"], fp8_activations="fp8"), bf16) == BaseIdentity.of(settings(bases["bf16"]), bf16)
    assert "activations" not in BaseIdentity.of(settings(bases["bf16"]), bf16).settings()  # earlier stores keep their identity


# ----------------------------------------------------------------------------------
# generate and validate --serving honour every model.* setting
# ----------------------------------------------------------------------------------


def test_generate_resumes_only_onto_text_the_same_base_computed_the_same_way(bases, tmp_path, sample_tokenizer_dir, capsys):
    """A resumed `generate` after switching model.fp8_activations (or the attention backend) appended
    text of one arithmetic to text of another without a word: now each is refused by name."""
    from occamy_mtp.commands import generate as generate_command
    from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(SAMPLE_DATA_PATH.read_text().splitlines(keepends=True)[:6]))
    out = tmp_path / "out.jsonl"
    common = [f"model.base={bases[q.FP8]}", f"data.files=[{chats}]", "--out", str(out), "--device", "cpu",
              "model.dtype=float32", "data.answer_tokens=4", "--no-progress"]
    assert generate_command.main(common + ["model.fp8_activations=fp8", "--limit", "2"]) == 0
    sidecar = json.loads((tmp_path / "out.jsonl.meta.json").read_text())
    assert sidecar["base"]["activations"] == "fp8" and sidecar["base"]["attn_implementation"] == "sdpa"
    before = out.read_bytes()
    capsys.readouterr()
    assert generate_command.main(common) == 2
    assert "base.activations: 'fp8' in the existing output, None now" in capsys.readouterr().err
    assert generate_command.main(common + ["model.fp8_activations=fp8", "model.attn_implementation=eager"]) == 2
    assert "base.attn_implementation: 'sdpa' in the existing output, 'eager' now" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert generate_command.main(common + ["model.fp8_activations=fp8"]) == 0  # the same base, computing the same way


def test_generate_writes_what_the_opened_base_writes(bases, tmp_path, sample_tokenizer):
    """Under W8A8 emulation the text is the emulated base's own greedy continuation (the command opens
    the base through the one door, so every model.* setting reaches it)."""
    from occamy_mtp.base.generate import plain_decode
    from occamy_mtp.commands import generate as generate_command
    from occamy_mtp.selfgen.regenerate import read_prompts
    from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(SAMPLE_DATA_PATH.read_text().splitlines(keepends=True)[:3]))
    out = tmp_path / "out.jsonl"
    model = settings(bases[q.FP8], fp8_activations="fp8")
    assert generate_command.main([f"model.base={model.base}", f"data.files=[{chats}]", "--out", str(out), "--device", "cpu",
                                  "model.dtype=float32", "model.fp8_activations=fp8", "data.answer_tokens=6",
                                  "data.self_generate_batch_size=1", "--no-progress"]) == 0
    prompts = read_prompts([chats], sample_tokenizer).prompts
    emulated, plain = FrozenBase.open(model, "cpu"), FrozenBase.open(dataclasses.replace(model, fp8_activations="bf16"), "cpu")
    metas = [json.loads(line)["meta"] for line in out.read_text().splitlines()]
    written = {(m["source_hash"], m["turn_index"]): m["generated_token_ids"] for m in metas}
    stop = {int(t) for t in json.loads((tmp_path / "out.jsonl.meta.json").read_text())["settings"]["eos_token_ids"]}
    expected = {p.key: plain_decode(emulated, [p.prompt_ids], max_new_tokens=6, eos_token_ids=stop, batch_size=1)[0]
                for p in prompts}
    other = {p.key: plain_decode(plain, [p.prompt_ids], max_new_tokens=6, eos_token_ids=stop, batch_size=1)[0]
             for p in prompts}
    assert len(written) == len(prompts) > 0 and written == expected
    assert other != expected  # the emulation changes this text: the check above can tell the two apart


@pytest.mark.parametrize("option, value", [("fp8_activations", "fp8"), ("attn_implementation", "eager"), ("dtype", "bfloat16")])
def test_validate_s_expectation_and_the_reference_server_read_the_base_as_the_run_does(bases, option, value):
    """`validate --serving` computed its expectation on a W8A16 base (and sdpa) where the run trains on
    W8A8 (or eager): both it and the reference server now open the base through the one door."""
    from occamy_mtp.serve.reference_server import GREEDY, load_model
    from occamy_mtp.serve.sampled import expectation_models

    model = settings(bases[q.FP8], **{option: value})
    run = FrozenBase.open(model, "cpu")
    expectation, _ = expectation_models(model, None, torch.device("cpu"))
    served = load_model(model, None, GREEDY, 1, "cpu").base
    ids = torch.randint(0, 1024, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = run(input_ids=ids).logits
        for base in (expectation, served):
            assert base.identity == run.identity and base.emulated == run.emulated
            assert base.config._attn_implementation == run.config._attn_implementation
            assert torch.equal(base(input_ids=ids).logits, logits)


# ----------------------------------------------------------------------------------
# On a GPU: the fast paths follow what the opening decided
# ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_on_a_gpu_the_fast_paths_run_an_opened_base_and_stand_aside_for_an_emulated_one(bases):
    """The decisions that read `FrozenBase.fast_paths` (self-generation's static decoder, the reference
    decoder's runner): on for a plain FP8 base opened on CUDA, and the static decoder writes what
    transformers' decoding writes there; off for the same base with its activations emulated (the fast
    paths read the weights directly and would skip the emulation)."""
    from occamy_mtp.base.fastdecode import fast_plain_decode, static_decoding
    from occamy_mtp.base.generate import plain_decode
    from occamy_mtp.evaluation.decode import BaseRunner, base_runner_for

    plain = FrozenBase.open(settings(bases[q.FP8], dtype="bfloat16", fp8_weights="fp8"), "cuda")
    emulated = FrozenBase.open(settings(bases[q.FP8], dtype="bfloat16", fp8_activations="fp8"), "cuda")
    assert plain.fp8_layers == len(plain.model.layers) and static_decoding(plain)
    assert not static_decoding(emulated) and isinstance(base_runner_for(emulated, 64), BaseRunner)
    prompts = [[5, 9, 200, 31], [7], [300, 2, 2, 2, 41, 18]]
    fast = fast_plain_decode(plain, prompts, max_new_tokens=12, eos_token_ids=set(), batch_size=3)
    reference = plain_decode(plain.module, prompts, max_new_tokens=12, eos_token_ids=set(), batch_size=3)
    # bf16: the static decoder's other summation order may part a row at a near tie, not most of them
    assert sum(a == b for a, b in zip(fast, reference)) >= 2
