"""The offline target cache against the online base pass (occamy_mtp.cache).

Cached outputs equal the online ones bit for bit; a run trained from the cache ends with
the same head as the online run; a foreign base, changed data or changed settings is
refused with the differing part named; an interrupted pass resumes into the identical
cache; a corrupted or truncated shard is detected and recomputed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from occamy_mtp import cache as CP
from occamy_mtp.base.frozen import BaseIdentity
from occamy_mtp.targets import base as T
from occamy_mtp.targets import cache as C
from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp import files
from occamy_mtp.model import loss as loss_module
from occamy_mtp.train import loop as train_module
from occamy_mtp.config import load_config
from occamy_mtp.data.windows import Window
from occamy_mtp.data.prepare import prepare_windows
from occamy_mtp.targets.base import base_outputs
from occamy_mtp.testing.checkpoints import build_tiny_checkpoint
from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH
from occamy_mtp.files import sha256_file
from occamy_mtp.testing.numerics import assert_close, rounding_bound
from occamy_mtp.commands import cache as cache_command
from occamy_mtp.settings import plan_of, serving_texts

CONVERSATIONS = 30  # the first lines of data/sample.jsonl: enough for 6 + 2 conversations
WINDOW_SETTINGS = dict(context_tokens=16, answer_tokens=48, train_conversations=6, heldout_conversations=2)
HIDDEN_SIZE = 64  # the tiny models'
# fp32 hidden (64 x 4 bytes) + int32 id and greedy: 264 bytes per token, so two
# 64-token windows per shard and four shards for the 8 windows.
SHARD_BYTES = 2 * 64 * (HIDDEN_SIZE * 4 + 8)


class Interrupted(RuntimeError):
    pass


@dataclass(frozen=True)
class WindowOutputs:
    hidden: torch.Tensor  # (T, D)
    greedy: torch.Tensor  # (T,)


pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py


@pytest.fixture(scope="module")
def world(tmp_path_factory, sample_tokenizer_dir):
    root = tmp_path_factory.mktemp("cache")
    tokenizer_dir = sample_tokenizer_dir
    base = build_tiny_checkpoint(root / "base", seed=2, tokenizer_dir=tokenizer_dir)
    donor = build_tiny_checkpoint(root / "donor", layout=ckpt_io.FUSED, multimodal=False, seed=1)
    data_file = root / "sample.jsonl"
    data_file.write_text("\n".join(SAMPLE_DATA_PATH.read_text().splitlines()[:CONVERSATIONS]) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    data = prepare_windows([data_file], tokenizer, **WINDOW_SETTINGS)
    model = ckpt_io.load_base(base.path, dtype=torch.float32)
    identity = identity_of(base.path, data, "float32", "sdpa")
    directory = root / "targets"
    C.build_cache(directory, identity, window_ids(data), T.plain_compute(model), hidden_size=HIDDEN_SIZE, max_shard_bytes=SHARD_BYTES)
    return {
        "root": root, "base_path": base.path, "donor_path": donor.path, "tokenizer": tokenizer, "data_file": data_file,
        "data": data, "base": model, "identity": identity, "directory": directory,
    }


def windows_of(data):
    """The windows these tests cache: train, then heldout."""
    return list(data.train) + list(data.heldout)


def window_ids(data):
    return C.window_ids(windows_of(data))


def identity_of(base_path, data, dtype, attn_implementation):
    base = BaseIdentity(ckpt_io.checkpoint_fingerprint(base_path), 0, dtype, attn_implementation)  # the cache records no vocabulary
    return C.cache_identity(base, windows_of(data), data.settings)


def online(base, windows):
    return base_outputs(base, *T.padded_ids([w.input_ids for w in windows]))


def counting(compute, calls: list):
    """`compute`, recording the windows of every call."""

    def counted(windows):
        calls.append(list(windows))
        return compute(windows)

    return counted


def shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.safetensors"))}


def copy_cache(world, name: str) -> Path:
    return Path(shutil.copytree(world["directory"], world["root"] / name))


# ----------------------------------------------------------------------------------
# Equality with the online path
# ----------------------------------------------------------------------------------


def test_cached_outputs_equal_online_outputs_exactly(world):
    cache = C.TargetCache.open(world["directory"], world["identity"])
    windows = windows_of(world["data"])
    assert len(cache) == len(windows) == 8
    manifest = json.loads((world["directory"] / C.MANIFEST_NAME).read_text())
    assert manifest["complete"] and len(manifest["shards"]) == 4
    for window in windows:
        input_ids, mask = T.padded_ids([window.input_ids])
        expected, got = online(world["base"], [window]), cache.outputs(input_ids, mask)
        assert got.hidden.dtype == expected.hidden.dtype == torch.float32
        assert got.greedy.dtype == expected.greedy.dtype == torch.long
        assert torch.equal(got.hidden, expected.hidden) and torch.equal(got.greedy, expected.greedy)


def test_padded_batch_equals_online_when_batched_alike(world, tmp_path):
    """Windows of different lengths in one padded batch: the pass batched the same way
    gives the online batch's values bit for bit on every real position, zeros on padding."""
    full = windows_of(world["data"])[:3]
    windows = [Window(w.conversation_hash, w.turn_index, w.input_ids[:length], w.answer_start) for w, length in zip(full, (64, 37, 50))]
    identity = C.CacheIdentity(world["identity"].base, {"windows": "truncated"}, world["identity"].settings)
    C.build_cache(tmp_path / "c", identity, [w.input_ids for w in windows], T.plain_compute(world["base"], windows_per_batch=3),
                  hidden_size=HIDDEN_SIZE, compute_name=T.plain_compute_name(3))
    cache = C.TargetCache.open(tmp_path / "c", identity)
    input_ids, mask = T.padded_ids([w.input_ids for w in windows])
    expected, got = online(world["base"], windows), cache.outputs(input_ids, mask)
    for row, window in enumerate(windows):
        length = len(window.input_ids)
        assert torch.equal(got.hidden[row, :length], expected.hidden[row, :length])
        assert torch.equal(got.greedy[row, :length], expected.greedy[row, :length])
        assert not got.hidden[row, length:].any() and not got.greedy[row, length:].any()


def test_padded_ids_are_collate_s(world):
    windows = windows_of(world["data"])[:2]
    short = [windows[0], Window(windows[1].conversation_hash, 0, windows[1].input_ids[:20], 4)]
    for batch in (windows, short):
        input_ids, mask = T.padded_ids([w.input_ids for w in batch])
        collated = loss_module.collate(batch, "cpu")
        assert torch.equal(input_ids, collated.input_ids)
        assert (mask is None and collated.attention_mask is None) or torch.equal(mask, collated.attention_mask)


def run_config(world, output: Path) -> Path:
    path = output.parent / f"{output.name}.yaml"
    settings = "\n".join(f"  {k}: {v}" for k, v in WINDOW_SETTINGS.items())
    path.write_text(
        f"model:\n  base: {world['base_path']}\n  donor_head: {world['donor_path']}\n  dtype: float32\n"
        f"data:\n  files: [{world['data_file']}]\n{settings}\n  validation_conversations: 2\n"
        f"  self_generated_dir: {world['root'] / 'self-generated'}\n"
        "train:\n  epochs: 1\n  windows_per_step: 1\n  lr: 1.0e-2\n  lr_warmup_steps: 1\n  checkpoint_every_steps: 100\n"
        "  select_every_steps: 3\n"
        "eval:\n  decoder_check_windows: 0\n"
        f"output:\n  dir: {output}\n"
    )
    return path


def test_training_from_the_cache_gives_the_online_head(world, monkeypatch):
    """train() once online and once with `data.target_cache` set: the trained tensors are
    bit-identical, and the cached run never loads the base."""
    from occamy_mtp.export import exporter as export_module
    from occamy_mtp.data.windows import stop_token_ids
    from occamy_mtp.base.frozen import BaseFacts
    from occamy_mtp.run import open_stores, prepare_data, run_windows, self_generated_needed

    # Everything on the CPU, where the world's cache was built, also on a machine with a GPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    directory = world["root"] / "targets-cli"
    online_config = load_config(run_config(world, world["root"] / "run-online"))
    cached_config = load_config(run_config(world, world["root"] / "run-cached"), [f"data.target_cache={directory}"])
    # The cache pass writes the self-generated windows (shared with the online run) and caches every window of the run.
    assert cache_command.main(["--config", str(run_config(world, world["root"] / "run-cli")), "--dir", str(directory), "--max-shard-bytes", str(SHARD_BYTES)]) == 0
    data = prepare_data(plan_of(cached_config).setup, world["tokenizer"])
    stores = open_stores(plan_of(cached_config).setup, BaseFacts(cached_config.model.base), stop_token_ids(world["tokenizer"], cached_config.model.base),
                         self_generated_needed(plan_of(cached_config).setup, data))
    windows = run_windows(plan_of(cached_config).setup, data, stores).all()
    # self-generated (the heldout ones under each serving configuration: greedy once and each of the four
    # default presets eval.sampled_continuations times), + recorded heldout
    texts = sum(len(serving_texts(cached_config, s)) for s in cached_config.eval.serving)
    assert texts == 1 + 4 * cached_config.eval.sampled_continuations
    assert len(windows) == len(data.train) + len(data.validation) + len(data.heldout) * (texts + 1)
    library = world["root"] / "targets-library"  # the CLI built exactly the cache of the library pass
    C.build_cache(library, C.cache_identity(BaseIdentity(ckpt_io.checkpoint_fingerprint(world["base_path"]), 0, "float32", "sdpa"),
                                            windows, data.settings), C.window_ids(windows),
                  T.plain_compute(world["base"]), hidden_size=HIDDEN_SIZE, max_shard_bytes=SHARD_BYTES)
    assert shard_bytes(directory) == shard_bytes(library)
    with monkeypatch.context() as patch:  # a complete cache is confirmed without loading the base
        patch.setattr(ckpt_io, "load_base", lambda *a, **k: pytest.fail("the base was loaded for a complete cache"))
        plan = plan_of(cached_config)
        assert CP.build_for_run(plan.setup, dataclasses.replace(plan.cache, directory=str(directory)), log=lambda m: None)["complete"]

    train_module.train(plan_of(online_config))
    with monkeypatch.context() as patch:  # training from the cache needs only embed_tokens and lm_head
        patch.setattr(ckpt_io, "load_base", lambda *a, **k: pytest.fail("the base was loaded although targets are cached"))
        summary = train_module.train(plan_of(cached_config))
    assert summary["targets"]["source"] != "online"
    assert summary["selection"]["enabled"] and [e["step"] for e in summary["selection"]["history"]] == [0, 3, 6]
    # Export evaluates from the cache too, without the base (random models: the head may lose to the donor).
    online_record = export_module.export(plan_of(online_config), allow_worse=True, log=lambda m: None)
    with monkeypatch.context() as patch:
        patch.setattr(ckpt_io, "load_base", lambda *a, **k: pytest.fail("export loaded the base although targets are cached"))
        cached_record = export_module.export(plan_of(cached_config), allow_worse=True, log=lambda m: None)
    for head in ("donor", "trained"):
        online, cached = (r["metrics"]["heldout"][head] for r in (online_record, cached_record))
        parts = [(online["teacher_forced"], cached["teacher_forced"])]
        parts += [(online["serving"][label]["every_anchor"], cached["serving"][label]["every_anchor"])
                  for label in ("greedy", "thinking-general", "thinking-coding", "instruct-general", "instruct-reasoning")]
        for online_part, cached_part in parts:
            assert online_part["scored_positions"] == cached_part["scored_positions"]
            # the cache holds per-window targets, evaluation batches windows: equal up to rounding near-ties
            assert abs(online_part["agreement"] - cached_part["agreement"]) <= 2 / online_part["scored_positions"]
    assert cached_record["metrics"]["decoder_check"]["trained"] == {"skipped": "data.target_cache is set (no base loaded)"}
    trained_online = load_file(world["root"] / "run-online" / "trained-tensors.safetensors")
    trained_cached = load_file(world["root"] / "run-cached" / "trained-tensors.safetensors")
    assert trained_online.keys() == trained_cached.keys() and trained_online
    for name in trained_online:
        assert torch.equal(trained_online[name], trained_cached[name]), name


def test_the_cache_pass_with_the_base_placed_by_the_launch_writes_the_same_cache(world, monkeypatch, tmp_path):
    """`accelerate launch --config_file configs/accelerate/fsdp2-offload.yaml -m occamy_mtp cache ...`: the
    base placed by `model.sharding` (one process; in host memory on a GPU) writes the same continuations
    and the same cache as the base loaded whole."""
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = str(run_config(world, tmp_path / "run"))

    def build(name: str, environ: dict) -> None:
        with monkeypatch.context() as patch:
            for key, value in environ.items():
                patch.setenv(key, value)
            assert cache_command.main(["--config", config, "--dir", str(tmp_path / name), "--max-shard-bytes", str(SHARD_BYTES),
                                       f"data.self_generated_dir={tmp_path / name}-text"]) == 0

    build("whole", {})
    assert not dist.is_initialized()
    try:
        build("placed", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"})
        assert dist.is_initialized()  # the base was sharded, over a process group of this process alone
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert shard_bytes(tmp_path / "placed") == shard_bytes(tmp_path / "whole") and shard_bytes(tmp_path / "whole")

    def texts(root: Path) -> dict:
        return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("self-generated.jsonl"))}

    assert texts(tmp_path / "placed-text") == texts(tmp_path / "whole-text") and texts(tmp_path / "whole-text")


def test_the_fast_pass_plugs_in(world, tmp_path):
    """fastbase.FastBasePass is a `compute` as it is: the cache stores exactly what it gives."""
    fastbase = pytest.importorskip("occamy_mtp.base.fastbase")
    windows = window_ids(world["data"])[:3]
    fast = fastbase.FastBasePass(world["base"], max_tokens_per_batch=256)
    identity = C.CacheIdentity(world["identity"].base, {"windows": "first three"}, world["identity"].settings)
    C.build_cache(tmp_path / "fast", identity, windows, fast, hidden_size=HIDDEN_SIZE, compute_name="fastbase")
    cache = C.TargetCache.open(tmp_path / "fast", identity)
    for ids, expected, plain in zip(windows, fast(windows), T.plain_compute(world["base"])(windows)):
        hidden, greedy = cache.window_outputs(ids)
        assert torch.equal(hidden, expected.hidden) and torch.equal(greedy, expected.greedy)
        # Both float32 passes of the 4-layer base: about 12 reductions a layer, plus the Gated
        # DeltaNet's running state over the window's tokens, the widest over 2 x hidden terms.
        bound = rounding_bound(plain.hidden, torch.float32, reductions=4 * 12 + len(ids), width=2 * HIDDEN_SIZE)
        assert_close(hidden, plain.hidden, bound, f"fast pass, window of {len(ids)} tokens")


def test_auto_pass_choice(world, monkeypatch):
    """auto: the fast pass only where it runs its kernels (Qwen3.5-MoE on CUDA with fla), else plain."""
    base = world["base"]
    assert CP.auto_fastbase_tokens(base) == 0  # a CPU base
    assert CP.make_compute(base, fastbase_tokens=None)[1] == T.plain_compute_name()

    def on_cuda(model_type):  # what auto reads of a base, as if it were on a GPU
        return SimpleNamespace(
            lm_head=SimpleNamespace(weight=SimpleNamespace(device=torch.device("cuda"))),
            config=SimpleNamespace(model_type=model_type),
        )

    fast_base, next_base = on_cuda("qwen3_5_moe_text"), on_cuda("qwen3_next")
    from occamy_mtp.base import fastbase

    monkeypatch.setattr(fastbase, "fla_kernels", lambda: fastbase.torch_kernels())
    assert CP.auto_fastbase_tokens(fast_base) == CP.DEFAULT_FASTBASE_TOKENS
    assert CP.auto_fastbase_tokens(next_base) == 0  # FastBasePass is for Qwen3.5-MoE bases only

    def missing():
        raise ImportError("no fla")

    monkeypatch.setattr(fastbase, "fla_kernels", missing)
    assert CP.auto_fastbase_tokens(fast_base) == 0


def test_fastbase_tokens_argument():
    assert cache_command.tokens_or_auto("auto") is None and cache_command.tokens_or_auto("0") == 0 and cache_command.tokens_or_auto("4096") == 4096
    for bad in ("-1", "many"):
        with pytest.raises(Exception, match="tokens"):
            cache_command.tokens_or_auto(bad)


def test_online_source_is_base_outputs(world):
    from occamy_mtp.base.frozen import BaseFacts
    from occamy_mtp.run import open_targets

    config = load_config(None, [f"model.base={world['base_path']}", "model.dtype=float32"])
    source = open_targets(plan_of(config).setup, BaseFacts(config.model.base), windows_of(world["data"]), world["data"].settings, base=world["base"])
    window = windows_of(world["data"])[0]
    expected, got = online(world["base"], [window]), source.outputs(*T.padded_ids([window.input_ids]))
    assert torch.equal(got.hidden, expected.hidden) and source.provenance() == {"source": "online"}
    with pytest.raises(ValueError, match="base itself is needed"):
        open_targets(plan_of(config).setup, BaseFacts(config.model.base), windows_of(world["data"]), world["data"].settings)


def test_shared_weights_only_are_the_base_s(world):
    shared = ckpt_io.load_shared_weights(world["base_path"], dtype=torch.float32)
    assert torch.equal(shared.embed_tokens.weight, world["base"].model.embed_tokens.weight)
    assert torch.equal(shared.lm_head.weight, world["base"].lm_head.weight)
    assert not shared.embed_tokens.weight.requires_grad and not shared.lm_head.weight.requires_grad


# ----------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------


def test_foreign_base_is_refused(world):
    """Same config, other weights (what a fine-tuned base looks like): the base part differs."""
    other = build_tiny_checkpoint(world["root"] / "other-base", seed=3, with_head=False)
    identity = identity_of(other.path, world["data"], "float32", "sdpa")
    with pytest.raises(C.CacheError) as err:
        C.TargetCache.open(world["directory"], identity)
    message = str(err.value)
    assert "base: files." in message and "fingerprint" in message
    assert "data:" not in message and "settings:" not in message


def test_changed_data_is_refused(world):
    """Other conversations with the same settings: only the data part differs."""
    shifted = world["root"] / "shifted.jsonl"
    shifted.write_text("\n".join(SAMPLE_DATA_PATH.read_text().splitlines()[CONVERSATIONS : 2 * CONVERSATIONS]) + "\n")
    data = prepare_windows([shifted], world["tokenizer"], **WINDOW_SETTINGS)
    with pytest.raises(C.CacheError) as err:
        C.TargetCache.open(world["directory"], identity_of(world["base_path"], data, "float32", "sdpa"))
    message = str(err.value)
    assert "data: window_ids_sha256" in message
    assert "base:" not in message and "settings:" not in message


def test_changed_settings_are_refused(world):
    with pytest.raises(C.CacheError, match="settings: dtype: float32 in the cache vs bfloat16 for this run"):
        C.TargetCache.open(world["directory"], identity_of(world["base_path"], world["data"], "bfloat16", "sdpa"))
    with pytest.raises(C.CacheError, match="settings: attn_implementation"):
        C.TargetCache.open(world["directory"], identity_of(world["base_path"], world["data"], "float32", "eager"))
    shorter = prepare_windows([world["data_file"]], world["tokenizer"], **{**WINDOW_SETTINGS, "answer_tokens": 40})
    with pytest.raises(C.CacheError) as err:
        C.TargetCache.open(world["directory"], identity_of(world["base_path"], shorter, "float32", "sdpa"))
    assert "settings: windows.answer_tokens: 48 in the cache vs 40 for this run" in str(err.value)


def test_pass_refuses_another_cache_or_a_non_cache_directory(world, tmp_path):
    bf16 = identity_of(world["base_path"], world["data"], "bfloat16", "sdpa")
    with pytest.raises(C.CacheError, match="holds a target cache for another base, data or settings"):
        C.build_cache(world["directory"], bf16, window_ids(world["data"]), T.plain_compute(world["base"]), hidden_size=HIDDEN_SIZE)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(C.CacheError, match="not empty"):
        C.build_cache(tmp_path, world["identity"], window_ids(world["data"]), T.plain_compute(world["base"]), hidden_size=HIDDEN_SIZE)
    with pytest.raises(C.CacheError, match="no target cache here"):
        C.TargetCache.open(tmp_path, world["identity"])


def test_a_window_not_in_the_cache_is_an_error(world):
    cache = C.TargetCache.open(world["directory"], world["identity"], verify=False)
    window = windows_of(world["data"])[0]
    with pytest.raises(C.CacheError, match="no window with these 63 token ids"):
        cache.outputs(torch.tensor([window.input_ids[:63]]))


# ----------------------------------------------------------------------------------
# Interruption and corruption
# ----------------------------------------------------------------------------------


def test_interrupted_pass_resumes_into_the_identical_cache(world, tmp_path):
    directory = tmp_path / "targets"
    windows = window_ids(world["data"])
    plain = T.plain_compute(world["base"])
    calls = []

    def dies_in_shard_2(batch):  # called once per shard
        calls.append(batch)
        if len(calls) == 2:
            plain(batch[:1])  # killed midway through shard 2's forwards
            raise Interrupted
        return plain(batch)

    build = dict(hidden_size=HIDDEN_SIZE, max_shard_bytes=SHARD_BYTES)
    with pytest.raises(Interrupted):
        C.build_cache(directory, world["identity"], windows, dies_in_shard_2, **build)
    manifest = json.loads((directory / C.MANIFEST_NAME).read_text())
    assert [s["sha256"] is not None for s in manifest["shards"]] == [True, False, False, False]
    assert sorted(p.name for p in directory.iterdir()) == [C.MANIFEST_NAME, manifest["shards"][0]["file"]]
    with pytest.raises(C.CacheError, match=r"incomplete target cache \(1 of 4 shards done\)"):
        C.TargetCache.open(directory, world["identity"])
    # A write killed before its rename leaves a temporary file: never referenced, removed.
    (directory / f".{manifest['shards'][1]['file']}.x1y2.tmp").write_bytes(b"half a shard")
    with pytest.raises(C.CacheError, match="started with compute 'target.base_outputs, 1 window"):
        C.build_cache(directory, world["identity"], windows, plain, compute_name=T.plain_compute_name(2), **build)

    calls.clear()
    C.build_cache(directory, world["identity"], windows, counting(plain, calls), **build)
    assert [ids for batch in calls for ids in batch] == windows[2:]  # shard 1 is not computed again
    assert shard_bytes(directory) == shard_bytes(world["directory"])
    assert not any(p.name.endswith(".tmp") for p in directory.iterdir())
    reference = json.loads((world["directory"] / C.MANIFEST_NAME).read_text())
    resumed = json.loads((directory / C.MANIFEST_NAME).read_text())
    assert resumed["shards"] == reference["shards"] and resumed["key"] == reference["key"]
    C.TargetCache.open(directory, world["identity"])


def test_corrupted_or_truncated_shard_is_detected_and_recomputed(world):
    directory = copy_cache(world, "corrupted")
    manifest = json.loads((directory / C.MANIFEST_NAME).read_text())
    second = directory / manifest["shards"][1]["file"]
    data = bytearray(second.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one hidden value
    second.write_bytes(bytes(data))
    with pytest.raises(C.CacheError, match=rf"{second.name}: sha256 differs from the manifest's \(corrupted\)"):
        C.TargetCache.open(directory, world["identity"])
    third = directory / manifest["shards"][2]["file"]
    third.write_bytes(third.read_bytes()[:-10])
    with pytest.raises(C.CacheError, match=rf"{third.name}: \d+ bytes, the manifest says \d+ \(truncated"):
        C.TargetCache.open(directory, world["identity"], verify=False)

    calls = []
    plain = T.plain_compute(world["base"])
    C.build_cache(directory, world["identity"], window_ids(world["data"]), counting(plain, calls),
                  hidden_size=HIDDEN_SIZE, max_shard_bytes=SHARD_BYTES)
    assert calls == [list(window_ids(world["data"])[2:4]), list(window_ids(world["data"])[4:6])]  # the damaged shards only
    assert shard_bytes(directory) == shard_bytes(world["directory"])
    C.TargetCache.open(directory, world["identity"])


def test_a_shard_from_another_cache_is_detected(world, tmp_path):
    """A shard file copied in from another cache, manifest edited to match its size and hash."""
    directory = copy_cache(world, "mixed")
    bf16 = identity_of(world["base_path"], world["data"], "bfloat16", "sdpa")
    windows = window_ids(world["data"])[:2]
    other = tmp_path / "other"
    plain = T.plain_compute(world["base"])

    def in_bf16(batch):
        return [WindowOutputs(out.hidden.bfloat16(), out.greedy) for out in plain(batch)]

    C.build_cache(other, bf16, windows, in_bf16, hidden_size=HIDDEN_SIZE)
    manifest = json.loads((directory / C.MANIFEST_NAME).read_text())
    foreign = next(other.glob("*.safetensors"))
    target = directory / manifest["shards"][0]["file"]
    shutil.copyfile(foreign, target)
    manifest["shards"][0].update(bytes=target.stat().st_size, sha256=sha256_file(target))
    files.write_json(directory / C.MANIFEST_NAME, manifest)
    with pytest.raises(C.CacheError, match="written for another cache"):
        C.TargetCache.open(directory, world["identity"])


def test_shared_targets_give_the_source_s_outputs_once_computed_and_their_own_copies():
    """`SharedTargets`: a batch asked for again is not computed again, and what comes back equals what the
    source computed; another batch is computed; beyond the cap nothing is kept; a reader's copy is its own."""
    import torch

    from occamy_mtp.targets.base import BaseOutputs, SharedTargets

    class Source:
        calls = 0
        base = "the base"

        def outputs(self, input_ids, attention_mask=None):
            Source.calls += 1
            hidden = input_ids[..., None].float() * torch.arange(3.0) + Source.calls * 0  # (B, T, 3)
            return BaseOutputs(hidden, input_ids + 1)

        def provenance(self):
            return {"source": "test"}

    shared = SharedTargets(Source(), max_bytes=10_000)
    ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    first = shared.outputs(ids, mask)
    again = shared.outputs(ids.clone(), mask.clone())
    assert Source.calls == 1 and shared.hits == 1
    assert torch.equal(again.hidden, first.hidden) and torch.equal(again.greedy, first.greedy)
    again.hidden.zero_()  # the reader's copy
    assert torch.equal(shared.outputs(ids, mask).hidden, first.hidden) and Source.calls == 1
    shared.outputs(ids, None)  # another mask: another batch
    shared.outputs(ids[:1], mask[:1])
    assert Source.calls == 3
    assert shared.base == "the base" and shared.provenance() == {"source": "test"}
    tiny = SharedTargets(Source(), max_bytes=8)  # nothing fits: every ask computes
    tiny.outputs(ids, mask), tiny.outputs(ids, mask)
    assert Source.calls == 5 and tiny.hits == 0


def test_shared_targets_keep_a_sparse_table_once_computed_and_give_its_values_again():
    """`SharedTargets.probs`: a top-k table (few nonzeros a row), computed a chunk of rows at a time, is computed
    once a batch and `what`, and its rows come back equal however they are chunked the next time, a fresh tensor
    each time; rows not yet computed, another `what` or batch are computed; a dense table (more than an eighth
    nonzero) or one beyond the cap is not kept; a plain source computes every time."""
    import torch

    from occamy_mtp import sampling
    from occamy_mtp.targets.base import SharedTargets, kept_probs

    calls = []
    logits = {seed: torch.randn(6, 64, generator=torch.Generator().manual_seed(seed)) for seed in range(5)}

    def table(seed: int, part: slice, top_k: int = 5):
        def compute():
            calls.append((seed, part.start, part.stop))
            return sampling.processed_probs(logits[seed][part], 1.0, 0.9, top_k)
        return compute

    whole = sampling.processed_probs(logits[0], 1.0, 0.9, 5)
    shared = SharedTargets(object(), max_bytes=10_000)
    ids, mask = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 1, 1]])
    for part in (slice(0, 4), slice(4, 6)):  # the first reader's chunks
        assert torch.equal(shared.probs(ids, mask, ("p", 0), part, table(0, part)), whole[part])
    assert calls == [(0, 0, 4), (0, 4, 6)]
    for part in (slice(0, 2), slice(2, 5), slice(5, 6), slice(0, 6)):  # another reader's chunks: none computed
        again = shared.probs(ids.clone(), mask.clone(), ("p", 0), part, table(0, part))
        assert torch.equal(again, whole[part]) and again.dtype == whole.dtype
        again.zero_()  # the reader's own
    assert len(calls) == 2 and shared.hits == 4
    assert torch.equal(shared.probs(ids, mask, ("p", 0), slice(0, 6), table(0, slice(0, 6))), whole)
    shared.probs(ids, mask, ("p", 1), slice(0, 6), table(1, slice(0, 6)))  # another what
    shared.probs(ids[:, :2], mask[:, :2], ("p", 0), slice(0, 6), table(0, slice(0, 6)))  # another batch
    assert calls[2:] == [(1, 0, 6), (0, 0, 6)]
    half = SharedTargets(object(), max_bytes=10_000)
    half.probs(ids, mask, ("p", 0), slice(0, 3), table(0, slice(0, 3)))
    half.probs(ids, mask, ("p", 0), slice(2, 6), table(0, slice(2, 6)))  # rows 3-5 not yet computed
    assert calls[-1] == (0, 2, 6)
    dense = [shared.probs(ids, mask, ("dense", 0), slice(0, 6), table(2, slice(0, 6), top_k=0)) for _ in range(2)]
    assert calls[-2:] == [(2, 0, 6), (2, 0, 6)] and torch.equal(dense[0], dense[1])  # nearly all nonzero: not kept
    tiny = SharedTargets(object(), max_bytes=8)
    tiny.probs(ids, mask, ("p", 0), slice(0, 6), table(3, slice(0, 6))), tiny.probs(ids, mask, ("p", 0), slice(0, 6), table(3, slice(0, 6)))
    assert calls[-2:] == [(3, 0, 6), (3, 0, 6)] and tiny.hits == 0
    for _ in range(2):
        kept_probs(object(), ids, mask, ("p", 0), slice(0, 6), table(4, slice(0, 6)))
    assert calls[-2:] == [(4, 0, 6), (4, 0, 6)]
