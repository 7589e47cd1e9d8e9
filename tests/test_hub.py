"""Models and datasets named by Hub id (issue 21), resolved offline from a local Hub cache the tests build.

The cache has the layout `huggingface_hub` keeps (`models--org--name/refs/<ref>` holding a
commit, `snapshots/<commit>/` holding the files), so the library resolves the names exactly
as it does a user's cache, with `HF_HUB_OFFLINE` set and nothing reachable.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from occamy_mtp import hub
from occamy_mtp.cli import parse, parser
from occamy_mtp.data import prepare
from occamy_mtp.record import checkpoint_identity
from occamy_mtp.testing.checkpoints import build_tiny_checkpoint
from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH
from occamy_mtp.commands import generate as generate_command

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def cache_repo(cache: Path, kind: str, repo_id: str, files: Path, commit: str = COMMIT, refs=("main",)) -> Path:
    """`files` (a directory) as the snapshot `commit` of `repo_id` in a Hub cache at `cache`."""
    root = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    shutil.copytree(files, snapshot)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def cache(tmp_path_factory, sample_tokenizer_dir):
    root = tmp_path_factory.mktemp("hub")
    base = build_tiny_checkpoint(root / "local-base", seed=2, tokenizer_dir=sample_tokenizer_dir).path
    chats = root / "local-chats"
    (chats / "data").mkdir(parents=True)
    lines = SAMPLE_DATA_PATH.read_text().splitlines(keepends=True)[:30]
    (chats / "data" / "train.jsonl").write_text("".join(lines))
    (chats / "data" / "test.jsonl").write_text("".join(SAMPLE_DATA_PATH.read_text().splitlines(keepends=True)[30:40]))
    hub_cache = root / "cache"
    return {
        "cache": hub_cache,
        "base": cache_repo(hub_cache, "model", "occamy-test/tiny-base", base, refs=("main", "v1")),
        "chats": cache_repo(hub_cache, "dataset", "occamy-test/chats", chats),
        "lines": lines,
        "tokenizer_dir": sample_tokenizer_dir,
    }


@pytest.fixture
def offline(cache, monkeypatch):
    """The Hub unreachable and offline, its cache the one built here."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache["cache"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return cache


def command_config(*overrides):
    return parse(parser("test", "a command"), ["--config", str(Path(__file__).parent.parent / "configs" / "demo.yaml"),
                                               *overrides])[1]


@pytest.mark.parametrize("name", ["occamy-test/tiny-base", f"occamy-test/tiny-base@{COMMIT}", "occamy-test/tiny-base@v1"])
def test_a_model_named_by_hub_id_is_its_cached_snapshot(offline, name):
    config = command_config(f"model.base={name}", f"model.donor_head={name}")
    assert Path(config.model.base) == Path(config.model.donor_head) == offline["base"]
    identity = checkpoint_identity(Path(config.model.base), {})
    assert identity["revision"] == COMMIT  # what TRAINING.json records, with every file's sha256
    assert {f["name"] for f in identity["files"]} == {p.name for p in offline["base"].glob("*.safetensors")}


def test_a_local_path_is_never_taken_for_a_hub_id(offline, tmp_path, monkeypatch):
    local = tmp_path / "occamy-test" / "tiny-base"  # the same spelling as the Hub id, on disk
    shutil.copytree(offline["base"], local)
    monkeypatch.chdir(tmp_path)
    assert command_config("model.base=occamy-test/tiny-base").model.base == "occamy-test/tiny-base"


@pytest.mark.parametrize("name, message", [
    ("occamy-test/not-cached", r"model.base: occamy-test/not-cached is not a local path, and the Hub is offline "
                               r"\(HF_HUB_OFFLINE\) while the cache .* has no snapshot of it"),
    (f"occamy-test/tiny-base@{OTHER_COMMIT}", rf"model.base: occamy-test/tiny-base@{OTHER_COMMIT} is not a local path"),
])
def test_a_hub_id_that_cannot_be_resolved_is_one_error_line(offline, tmp_path, capsys, name, message):
    import re

    from occamy_mtp.commands.train import main

    assert main(["--config", str(Path(__file__).parent.parent / "configs" / "demo.yaml"), f"model.base={name}",
                 f"output.dir={tmp_path / 'run'}"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and re.search(message, last), last
    assert not (tmp_path / "run").exists()


def test_a_hub_dataset_reads_as_its_files_do(offline, sample_tokenizer):
    settings = dict(context_tokens=32, answer_tokens=16, train_conversations=20, heldout_conversations=8)
    named = prepare.prepare_windows(["hf:occamy-test/chats?split=train&column=messages"], sample_tokenizer, **settings)
    local = prepare.prepare_windows([offline["chats"] / "data" / "train.jsonl"], sample_tokenizer, **settings)
    assert [w.input_ids for w in named.train + named.heldout] == [w.input_ids for w in local.train + local.heldout]
    assert named.conversations_read == len(offline["lines"]) == 30
    [described] = named.provenance()["files"]
    assert described["hub"]["revision"] == COMMIT and described["hub"]["split"] == "train"
    assert {f["name"] for f in described["hub"]["files"]} == {"data/train.jsonl", "data/test.jsonl"}
    other = prepare.prepare_windows(["hf:occamy-test/chats?split=test&column=messages"], sample_tokenizer, **settings)
    assert other.conversations_read == 10


@pytest.mark.parametrize("spec, message", [
    ("hf:occamy-test/chats?split=train", "no column= "),
    ("hf:occamy-test/chats?column=messages", "no split= "),
    ("hf:occamy-test/chats?split=train&column=messages&config=x", "unknown key 'config'"),
    ("hf:not a repo?split=train&column=messages", "expected hf:org/name"),
    ("hf:occamy-test/chats?split=train&column=text", "no column 'text'; the split has messages"),
    ("hf:occamy-test/missing?split=train&column=messages", "is not a local path, and the Hub is offline"),
])
def test_a_bad_dataset_name_is_refused_naming_what_is_wrong(offline, sample_tokenizer, spec, message):
    with pytest.raises(hub.HubError, match=message.replace("(", r"\(").replace(")", r"\)")):
        prepare.prepare_windows([spec], sample_tokenizer, train_conversations=20, heldout_conversations=8)


def test_a_prompt_column_reads_as_prompts(offline, tmp_path, sample_tokenizer):
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "train.jsonl").write_text("".join(json.dumps({"question": f"What is {i} + {i}?"}) + "\n" for i in range(12)))
    cache_repo(offline["cache"], "dataset", "occamy-test/prompts", prompts)
    data = prepare.prepare_windows(["hf:occamy-test/prompts?split=train&column=question"], sample_tokenizer, prompts=True,
                             context_tokens=32, answer_tokens=16, train_conversations=20, heldout_conversations=8)
    assert data.conversations_kept == 12 and sum(data.summary()["prompt_windows"].values()) == 12


@pytest.mark.parametrize("error, message", [
    ("RepositoryNotFoundError", "is not a local path, and no model repository on the Hub has that name"),
    ("RevisionNotFoundError", "is not a local path, and the Hub repository has no revision 'v9'"),
])
def test_what_the_hub_answers_is_named_with_the_option(monkeypatch, error, message):
    """Online answers (here raised by a stand-in for the download) become one HubError naming the option."""
    import huggingface_hub
    from huggingface_hub import errors

    def refuse(*args, **kwargs):
        raise getattr(errors, error).__new__(getattr(errors, error))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(hub.HubError, match=f"model.donor_head: occamy-test/somewhere@v9 {message}"):
        hub.snapshot("occamy-test/somewhere", "v9", where="model.donor_head")


def test_generate_and_validate_read_a_hub_dataset_as_training_does(offline, sample_tokenizer, tmp_path, capsys):
    """Every reader of data.files goes through `data.reader.ChatReader`: a Hub dataset gives
    `generate` the same prompts, and validate the same heldout prompts, as its files do."""
    from occamy_mtp.selfgen import regenerate
    from occamy_mtp.serve.validate import heldout_prefixes, heldout_window_contexts

    named, local = "hf:occamy-test/chats?split=train&column=messages", offline["chats"] / "data" / "train.jsonl"
    from_hub, from_file = regenerate.read_prompts([named], sample_tokenizer), regenerate.read_prompts([local], sample_tokenizer)
    assert from_hub.prompts and [p.prompt_ids for p in from_hub.prompts] == [p.prompt_ids for p in from_file.prompts]
    assert from_hub.files[0]["hub"]["revision"] == COMMIT and from_hub.excluded == from_file.excluded

    split = dict(context_tokens=32, answer_tokens=16, train_conversations=20, heldout_conversations=8)
    for read in (heldout_prefixes, heldout_window_contexts):
        hub_prompts, file_prompts = read([named], sample_tokenizer, **split), read([local], sample_tokenizer, **split)
        assert hub_prompts and hub_prompts == file_prompts

    # The command: data.files may name the dataset (a missing local file is still refused at once).
    out = tmp_path / "regenerated.jsonl"
    argv = [f"model.base={offline['base']}", f'data.files=["{named}"]', "model.dtype=float32", "data.answer_tokens=2",
            "eval.draft_steps=2", "eval.served_steps=[1,2]",  # draft steps within the answer budget
            "--out", str(out), "--device", "cpu", "--limit", "2", "--no-progress"]
    assert generate_command.main(argv) == 0, capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 2
    assert json.loads(regenerate.sidecar_path(out).read_text())["data"]["files"][0]["path"] == named
