"""Faults in what runs write and check first (issue 43): links at output paths, unwritable and full
disks, a base config.json of wrong types, unbounded draft steps, and the checks that must come
before the base loads.

Each case is a reproduction that failed before its fix: it checks that the fault is refused or
handled with one clear line (exit status 2 from a command), and what must not have happened (no
byte of the base changed, nothing received or trained lost).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from occamy_mtp import files
from occamy_mtp.config import ConfigError, dump_yaml, load_config
from occamy_mtp.commands import train as train_command
from occamy_mtp.settings import plan_of
from test_faults import no_model_loading, run_config, run_models, sha256_tree, unwritable_directory  # noqa: F401 (fixtures)


def write_config(config, path: Path) -> Path:
    path.write_text(dump_yaml(config))
    return path


def one_error_line(capsys) -> str:
    """The command's last line on stderr, checked to be its one `error:` line (no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: "), err
    return last


# ==================================================================================
# 1. Nothing is written through a link
# ==================================================================================


def test_open_owned_refuses_links_and_other_names_and_truncates_nothing(tmp_path):
    target = tmp_path / "base-shard.safetensors"
    target.write_bytes(b"x" * 1000)
    (tmp_path / "soft").symlink_to(target)
    os.link(target, tmp_path / "hard")
    os.mkfifo(tmp_path / "fifo")
    for name, message in (("soft", "is a symbolic link"), ("hard", "has 1 other name"), ("fifo", "not a regular file")):
        for mode in ("a", "a+", "r+b", "w"):
            with pytest.raises(files.LinkedOutput, match=message):
                files.open_owned(tmp_path / name, mode)
    assert target.read_bytes() == b"x" * 1000
    with files.open_owned(tmp_path / "own", "a") as handle:  # a file of its own is made, and appended to
        handle.write("one\n")
    with files.open_owned(tmp_path / "own", "a+") as handle:
        handle.write("two\n")
    assert (tmp_path / "own").read_text() == "one\ntwo\n"
    with files.open_owned(tmp_path / "own", "w") as handle:
        handle.write("three\n")
    assert (tmp_path / "own").read_text() == "three\n"


def _base_file(models) -> Path:
    return sorted(Path(models["base"]).glob("*.safetensors"))[0]


@pytest.mark.parametrize("command", ["train", "export"])
def test_a_lock_that_links_into_the_base_is_refused_and_the_base_unchanged(run_models, tmp_path, capsys, no_model_loading,
                                                                           command):
    """The probe's repro: output.dir/.lock a link to a base shard; train.py or export.py truncated it to a pid."""
    from occamy_mtp.commands.export import main as export_main
    from occamy_mtp.commands.train import main as train_main

    before = sha256_tree(run_models["base"])
    output = tmp_path / "run"
    output.mkdir()
    (output / ".lock").symlink_to(_base_file(run_models))
    config = write_config(run_config(run_models, output), tmp_path / "run.yaml")
    assert {"train": train_main, "export": export_main}[command](["--config", str(config)]) == 2
    line = one_error_line(capsys)
    assert f"{output / '.lock'} is a symbolic link" in line and "remove the link" in line
    assert sha256_tree(run_models["base"]) == before
    assert (output / ".lock").is_symlink()  # left as it was found


@pytest.mark.parametrize("name", ["self-generated.lock", "self-generated.jsonl"])
def test_a_store_file_that_links_into_the_base_is_refused_and_the_base_unchanged(run_models, tmp_path, capsys,
                                                                                 no_model_loading, name):
    from occamy_mtp.commands.train import main as train_main

    before = sha256_tree(run_models["base"])
    store = tmp_path / "store"
    store.mkdir()
    (store / name).symlink_to(Path(run_models["base"]) / "special_tokens_map.json")
    config = write_config(run_config(run_models, tmp_path / "run", f"data.self_generated_dir={store}"), tmp_path / "run.yaml")
    assert train_main(["--config", str(config)]) == 2
    line = one_error_line(capsys)
    assert str(store / name) in line
    assert sha256_tree(run_models["base"]) == before


def test_a_torn_store_tail_is_not_cut_through_a_hard_link(tmp_path):
    from occamy_mtp.selfgen.store import _drop_torn_tail

    outside = tmp_path / "outside.json"
    outside.write_bytes(b'{"complete": 1}\n{"torn')
    os.link(outside, tmp_path / "store.jsonl")
    with pytest.raises(files.LinkedOutput, match="hard link"):
        _drop_torn_tail(tmp_path / "store.jsonl")
    assert outside.read_bytes() == b'{"complete": 1}\n{"torn'


def test_checkpoints_that_link_into_the_base_are_refused_before_any_model_loads(run_models, tmp_path, no_model_loading):
    from occamy_mtp.train.loop import train

    before = sha256_tree(run_models["base"])
    output = tmp_path / "run"
    output.mkdir()
    (output / "checkpoints").symlink_to(run_models["base"])
    with pytest.raises(ConfigError, match=r"output.dir: .*checkpoints is inside model.base"):
        train(plan_of(run_config(run_models, output)))
    assert sha256_tree(run_models["base"]) == before


# ==================================================================================
# 2. Every output location is checked before anything loads
# ==================================================================================


@pytest.mark.parametrize("how", ["immutable", "permissions"])
def test_an_unwritable_checkpoints_dir_is_refused_before_any_model_loads(run_models, tmp_path, no_model_loading, capsys, how):
    """The probe's repro: the whole run went by, then save_checkpoint's PermissionError traceback."""
    from occamy_mtp.commands.train import main

    output = tmp_path / "run"
    config = write_config(run_config(run_models, output), tmp_path / "run.yaml")
    with unwritable_directory(output / "checkpoints", how):
        assert main(["--config", str(config)]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: output.dir: {output / 'checkpoints'} cannot be written")


# ==================================================================================
# 3. A full disk: one line, and nothing trained or received lost
# ==================================================================================

# What torch.save says when the disk fills under it: nothing names the disk, the path or the space.
TORCH_SAVE_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 42048 vs 41936"


class _Usage:
    def __init__(self, free: int):
        self.total, self.used, self.free = 10 * free + 1, 9 * free, free


class _FullAtClose:
    """A stream whose close finds the disk full after half of what it held reached the file, as a
    buffered append's last flush does."""

    def __init__(self, stream):
        self._stream, self._held = stream, []

    def write(self, text):
        self._held.append(text)

    def flush(self):
        pass

    def tell(self):
        return self._stream.tell()

    @property
    def closed(self):
        return self._stream.closed

    def close(self):
        if not self._stream.closed:
            held = "".join(self._held)
            self._stream.write(held[: len(held) // 2])
            self._stream.close()
            raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["write", "close"])
def test_an_append_that_fills_the_disk_is_one_line_and_keeps_whole_lines(tmp_path, monkeypatch, where):
    """Self-generation's stores append through `files.appended_lines`: a full disk in a write or in the
    close (the last flush) is one DiskFull, the lines before it stay and a torn last line is cut off."""
    path = tmp_path / "store.jsonl"
    path.write_text('{"a": 1}\n')
    if where == "close":
        real = files.open_owned
        monkeypatch.setattr(files, "open_owned", lambda p, mode, **k: _FullAtClose(real(p, mode, **k)) if mode == "a"
                            else real(p, mode, **k))
    with pytest.raises(files.DiskFull, match=r"No space left|store.jsonl.*the lines before are kept") as caught:
        with files.appended_lines(path, kept="the lines before are kept") as stream:
            stream.write('{"b": 2}\n')
            stream.write('{"c": 3, "long": "' + "x" * 100 + '"}\n')
            if where == "write":
                stream.write('{"d": 4, "torn')
                stream.flush()
                raise OSError(errno.ENOSPC, "No space left on device")
    assert "\n" not in str(caught.value).strip() and str(caught.value).endswith("the lines before are kept")
    text = path.read_text()
    assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())
    assert text.startswith('{"a": 1}\n{"b": 2}\n')


def test_disk_full_names_the_path_the_space_needed_and_free(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(4096))
    full = files.disk_full(tmp_path / "x.pt", RuntimeError(TORCH_SAVE_FULL), needed_bytes=3 * 2**20)
    assert str(full) == (f"{tmp_path / 'x.pt'}: no space left on the device holding {tmp_path} (about 3.0 MiB is needed, "
                         "4.0 KiB is free); free some space and run the command again")
    assert files.disk_full(tmp_path / "x", OSError(errno.ENOSPC, "No space left on device")) is not None
    # torch.save's error with room to spare is not a full disk, nor is any other error
    assert files.disk_full(tmp_path / "x.pt", RuntimeError(TORCH_SAVE_FULL), needed_bytes=1024) is None
    assert files.disk_full(tmp_path / "x", OSError(errno.EACCES, "Permission denied")) is None
    assert files.disk_full(tmp_path / "x", ValueError("No space left on device")) is not None  # safetensors says it so


def _fill_disk_at(monkeypatch, module, name: str, when):
    """`module.name` fails as on a full disk (the free space then reads 1 KiB) on the calls where `when(call)`."""
    real = getattr(module, name)
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if when(calls["n"]):
            path = next(a for a in args if isinstance(a, (str, Path)))
            Path(path).write_bytes(b"\0" * 100)  # a partial file, as a real full disk leaves
            monkeypatch.setattr(shutil, "disk_usage", lambda p: _Usage(1024))
            raise RuntimeError(TORCH_SAVE_FULL)
        monkeypatch.setattr(shutil, "disk_usage", real_usage)
        return real(*args, **kwargs)

    real_usage = shutil.disk_usage
    monkeypatch.setattr(module, name, failing)
    return calls


def test_a_checkpoint_on_a_full_disk_is_skipped_and_the_trained_tensors_are_kept(run_models, tmp_path, monkeypatch, capsys):
    from occamy_mtp.train import loop

    reference = run_config(run_models, tmp_path / "reference")
    loop.train(plan_of(reference))
    expected = load_file(tmp_path / "reference" / "trained-tensors.safetensors")

    _fill_disk_at(monkeypatch, torch, "save", lambda call: call >= 2)  # every checkpoint after the first
    loop.train(plan_of(run_config(run_models, tmp_path / "run")))
    err = capsys.readouterr().err
    assert "step 2's checkpoint was not written" in err and "no space left on the device" in err
    assert "the older checkpoints are kept" in err
    kept = load_file(tmp_path / "run" / "trained-tensors.safetensors")
    assert kept.keys() == expected.keys() and all(torch.equal(kept[k], expected[k]) for k in kept)
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-000001.pt"]  # no partial file


def test_trained_tensors_on_a_full_disk_say_how_to_get_them_back_and_resume_does(run_models, tmp_path, monkeypatch, capsys):
    from occamy_mtp.train import loop

    reference = run_config(run_models, tmp_path / "reference")
    loop.train(plan_of(reference))
    expected = load_file(tmp_path / "reference" / "trained-tensors.safetensors")

    output = tmp_path / "run"
    config = write_config(run_config(run_models, output), tmp_path / "run.yaml")
    monkeypatch.setattr(files, "write_safetensors", _failing_safetensors(files.write_safetensors))
    assert train_command.main(["--config", str(config)]) == 2
    line = one_error_line(capsys)
    newest = sorted((output / "checkpoints").glob("step-*.pt"))[-1]
    assert f"{output / 'trained-tensors.safetensors'}: no space left" in line
    assert f"The newest checkpoint, {newest}, holds step" in line and "--resume` writes the tensors at once" in line
    assert not (output / "trained-tensors.safetensors").exists()

    monkeypatch.undo()  # the space is freed; the command the line gave
    assert train_command.main(["--config", str(output / "config.resolved.yaml"), "--resume"]) == 0
    kept = load_file(output / "trained-tensors.safetensors")
    assert all(torch.equal(kept[k], expected[k]) for k in expected)


def _failing_safetensors(real):
    def failing(path, tensors, metadata=None):
        Path(path).write_bytes(b"\0" * 10)
        raise Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })')

    return failing


def test_an_export_on_a_full_disk_is_one_line_and_replaces_nothing(run_models, tmp_path, monkeypatch, capsys):
    from occamy_mtp.commands.export import main as export_main
    from occamy_mtp.train.loop import train

    output = tmp_path / "run"
    config = run_config(run_models, output)
    train(plan_of(config))
    before = sha256_tree(output)
    monkeypatch.setattr(files, "write_safetensors", _failing_safetensors(files.write_safetensors))
    assert export_main(["--config", str(write_config(config, tmp_path / "run.yaml")), "--allow-worse"]) == 2
    line = one_error_line(capsys)
    assert f"{output / 'mtp-trained.safetensors'}: no space left" in line and "about " in line and "nothing was replaced" in line
    assert sha256_tree(output) == before  # no half file, no temporary left


class _FillingStream:
    """A store's stream that takes `room` lines, then fails as a full disk does."""

    def __init__(self, inner, room: int):
        self.inner, self.room = inner, room

    def write(self, text):
        if self.room == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= 1
        return self.inner.write(text)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.inner.close()


def test_self_generation_on_a_full_disk_is_one_line_and_keeps_the_lines_written(run_models, tmp_path, monkeypatch, capsys):
    from occamy_mtp.selfgen.store import STORE_FILE
    from occamy_mtp.commands.train import main as train_main

    store = tmp_path / "store"
    config = write_config(run_config(run_models, tmp_path / "run", f"data.self_generated_dir={store}"), tmp_path / "run.yaml")
    real = files.open_owned
    monkeypatch.setattr(files, "open_owned", lambda path, mode, **kw: _FillingStream(real(path, mode, **kw), 3)
                        if Path(path).name == STORE_FILE and mode == "a" else real(path, mode, **kw))
    assert train_main(["--config", str(config)]) == 2
    line = one_error_line(capsys)
    assert f"{store / STORE_FILE}: no space left" in line and "is needed" in line
    assert "the continuations written before are kept" in line
    assert len((store / STORE_FILE).read_text().splitlines()) == 3
    monkeypatch.undo()
    assert train_main(["--config", str(config)]) == 0  # the rerun writes only the rest
    assert len((store / STORE_FILE).read_text().splitlines()) > 3


# ==================================================================================
# 4. A base config.json of wrong types
# ==================================================================================


@pytest.mark.parametrize("change, message", [
    (lambda c: c["text_config"].__setitem__("hidden_size", "64"), "text config field 'hidden_size' is \"64\" (str); an integer"),
    (lambda c: c.__setitem__("text_config", [1, 2]), "text_config is list; an object of the text model's fields"),
    (lambda c: c["text_config"].__setitem__("num_experts", True), "'num_experts' is true (bool); an integer is expected"),
    (lambda c: c["text_config"].__setitem__("rms_norm_eps", "1e-6"), "'rms_norm_eps' is \"1e-6\" (str); a number"),
    (lambda c: c.__setitem__("quantization_config", "fp8"), "quantization_config is str; an object is expected"),
])
def test_a_base_config_of_wrong_types_is_one_line_naming_the_field(run_models, tmp_path, capsys, no_model_loading,
                                                                    change, message):
    from occamy_mtp.commands.inspect import main as inspect_main
    from occamy_mtp.commands.train import main as train_main

    base = tmp_path / "base"
    shutil.copytree(run_models["base"], base)
    raw = json.loads((base / "config.json").read_text())
    change(raw)
    (base / "config.json").write_text(json.dumps(raw))
    models = {**run_models, "base": base}
    config = write_config(run_config(models, tmp_path / "run"), tmp_path / "run.yaml")
    assert train_main(["--config", str(config)]) == 2
    line = one_error_line(capsys)
    assert str(base / "config.json") in line and message in line
    assert inspect_main([str(base)]) == 1  # inspect's report: its problems listed, as for any other bad checkpoint
    out = capsys.readouterr()
    assert message in out.out and "Traceback" not in out.err


# ==================================================================================
# 5. Draft steps within the answer budget
# ==================================================================================


@pytest.mark.parametrize("setting", ["eval.draft_steps=100000", "train.draft_steps=100000", "eval.served_steps=[1,100000]"])
def test_draft_steps_beyond_the_answer_budget_are_refused(setting):
    option = setting.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{option}: expected .*1 to data.answer_tokens \(382\)"):
        load_config(None, [setting])
    served = ["eval.draft_steps=382"] if option == "eval.served_steps" else []  # served counts stop at the measured chain
    load_config(None, [setting.replace("100000", "382"), *served])  # the budget itself is allowed


# ==================================================================================
# The smaller problems: cheap checks first, nothing received lost, plain words
# ==================================================================================


def test_windows_beyond_the_base_s_positions_are_refused_before_any_model_loads(run_models, tmp_path, no_model_loading):
    from occamy_mtp.model.checkpoint import read_config
    from occamy_mtp.train.loop import train

    positions = read_config(run_models["base"]).text_config.max_position_embeddings
    with pytest.raises(ConfigError, match=rf"data.context_tokens \+ data.answer_tokens: .* beyond the base's "
                                          rf"max_position_embeddings \({positions}"):
        train(plan_of(run_config(run_models, tmp_path / "run", f"data.answer_tokens={positions}")))


def test_evaluate_refuses_a_wrong_head_before_any_model_loads(run_models, tmp_path, no_model_loading, capsys):
    from occamy_mtp.commands.evaluate import main as evaluate_main

    head = tmp_path / "head.safetensors"
    torch.manual_seed(0)
    from safetensors.torch import save_file

    save_file({"mtp.fc.weight": torch.zeros(3, 3)}, head)
    config = write_config(run_config(run_models, tmp_path / "run"), tmp_path / "run.yaml")
    assert evaluate_main(["--config", str(config), "--head", str(head), "--out", str(tmp_path / "eval")]) == 2
    assert "MTP head checkpoint does not match the model config" in capsys.readouterr().err


def test_endpoints_are_checked_before_any_model_loads(run_models, tmp_path, no_model_loading, capsys):
    from occamy_mtp.testing.loopback import LoopbackServer
    from occamy_mtp.commands.train import main as train_main
    from http.server import BaseHTTPRequestHandler

    with LoopbackServer(BaseHTTPRequestHandler) as server:
        url = server.url  # a port that answered once and is closed now
    config = write_config(run_config(run_models, tmp_path / "run", f"data.self_generate_endpoints=[{url}]"),
                          tmp_path / "run.yaml")
    assert train_main(["--config", str(config)]) == 2
    line = one_error_line(capsys)
    assert f"{url} does not answer as an OpenAI-compatible server" in line
    assert line.count("GET /v1/models") <= 1


def test_resume_without_a_checkpoint_says_it_starts_from_step_0(run_models, tmp_path, capsys):
    from occamy_mtp.train.loop import train

    train(plan_of(run_config(run_models, tmp_path / "run")), resume=True)
    assert f"--resume: {tmp_path / 'run' / 'checkpoints'} holds no checkpoint, so training starts from step 0" in \
        capsys.readouterr().err


def test_a_bad_max_shard_bytes_is_refused(run_models, tmp_path, capsys, no_model_loading):
    from occamy_mtp.commands.cache import main as cache_main

    config = write_config(run_config(run_models, tmp_path / "run"), tmp_path / "run.yaml")
    for value in ("0", "-5"):
        assert cache_main(["--config", str(config), "--dir", str(tmp_path / "cache"), "--max-shard-bytes", value]) == 2
        assert f"--max-shard-bytes: expected a size of 1 byte or more, got {value}" in one_error_line(capsys)


def test_an_unquoted_hub_dataset_override_gets_a_hint_to_quote_it():
    with pytest.raises(ConfigError, match=r"quote a value with YAML's special characters"):
        load_config(None, ["data.files=[hf:org/name?split=train&column=messages]"])
    config = load_config(None, ["data.files=[\"hf:org/name?split=train&column=messages\"]"])
    assert config.data.files == ("hf:org/name?split=train&column=messages",) or \
        list(config.data.files) == ["hf:org/name?split=train&column=messages"]


def test_an_oversized_jsonl_line_is_excluded_unparsed(tmp_path, monkeypatch):
    from occamy_mtp.data import reader

    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}, {"role": "assistant", "content": "y"}]})
    path = tmp_path / "chats.jsonl"
    path.write_text(good + "\n" + huge + "\n")
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(reader.json, "loads", lambda text, **kw: parsed.append(len(text)) or real_loads(text, **kw))
    read = reader.ChatReader([str(path)], max_record_bytes=500)
    kept = list(read)
    assert len(kept) == 1 and read.excluded() == {reader.RECORD_TOO_LARGE: 1}
    assert max(parsed) < 5000  # the long line was never parsed
    assert "not parsed" in read.excluded_examples()[reader.RECORD_TOO_LARGE][0]


# ---------------------------------------------------------------- a server that dies mid-store


def _engine_store(tmp_path):
    """An empty engine-written store for the fake engine's contexts, and windows of those contexts."""
    from occamy_mtp.base.frozen import BaseIdentity
    from occamy_mtp.data.windows import Window
    from occamy_mtp.selfgen.store import ENGINE, SelfGeneratedStore, store_identity
    from test_engine_generate import CONTEXTS, FakeEngine

    base = BaseIdentity({"config_sha256": "c" * 64, "weights_sample_sha256": "w" * 64}, 64, "float32", "sdpa")
    identity = store_identity(base, max_new_tokens=6, stop_token_ids={FakeEngine.STOP}, writer=ENGINE)
    windows = [Window(f"conversation-{i}", 1, (*context, 1), len(context)) for i, context in enumerate(CONTEXTS)]
    return SelfGeneratedStore.open(tmp_path / "store", identity), windows, identity


def test_answers_received_behind_an_unanswered_context_are_kept_when_a_server_dies(tmp_path):
    """The probe's repro: 2 of 14 answers that came back out of order were thrown away with the failure."""
    import time as clock

    from occamy_mtp.selfgen import engine_writer as G
    from occamy_mtp.selfgen.store import SelfGeneratedStore, context_digest, context_of
    from test_engine_generate import FakeEngine, Tokenizer, request

    store, windows, identity = _engine_store(tmp_path)
    first = min(windows, key=lambda w: context_digest(context_of(w)))  # the context the store writes first

    class Dying(FakeEngine):
        def continuation(self, prompt, max_tokens):
            if tuple(prompt) == context_of(first) and max_tokens > 2:
                clock.sleep(0.5)  # the others come back meanwhile
                raise BrokenPipeError  # the server dies on it: the connection closes unanswered
            return super().continuation(prompt, max_tokens)

    with Dying() as engine:
        writer = G.EngineWriter([engine.url], "", Tokenizer(), request(timeout=2.0, retries=0), 6)
        with pytest.raises(G.EngineError, match=rf"{engine.url} failed on a request"):
            store.generate(writer, windows, log=lambda m: None)
    kept = SelfGeneratedStore.open(tmp_path / "store", identity)
    assert kept.missing(windows) == [first]  # every answer that came back was kept


def test_a_server_that_fails_before_its_first_answer_leaves_no_store_marked_as_its_own(tmp_path):
    from occamy_mtp.selfgen import engine_writer as G
    from occamy_mtp.selfgen.store import EMBEDDED, META_FILE, SelfGeneratedStore
    from test_engine_generate import FakeEngine, Tokenizer, request

    store, windows, identity = _engine_store(tmp_path)

    def fail_after_probe(number, handler):
        if number > 1:
            handler._json(404, {"error": "gone"})
            return True
        return False

    with FakeEngine(fail_after_probe) as engine:
        writer = G.EngineWriter([engine.url], "", Tokenizer(), request(retries=2), 2)
        with pytest.raises(G.EngineError, match=r"HTTP 404"):
            store.generate(writer, windows, log=lambda m: None)
    assert not (tmp_path / "store" / META_FILE).exists()
    # the same directory then takes the embedded writer's continuations
    SelfGeneratedStore.open(tmp_path / "store", {**identity, "writer": EMBEDDED})


@pytest.mark.parametrize("command", ["cache", "generate", "evaluate"])
def test_every_command_refuses_an_output_inside_the_base(run_models, tmp_path, no_model_loading, capsys, command):
    """An output in the base would put files there, and an atomic rename could replace one of its own."""
    from occamy_mtp.commands.cache import main as cache_main
    from occamy_mtp.commands.evaluate import main as evaluate_main
    from occamy_mtp.commands.generate import main as generate_main

    before = sha256_tree(run_models["base"])
    config = write_config(run_config(run_models, tmp_path / "run"), tmp_path / "run.yaml")
    inside = Path(run_models["base"])
    head = tmp_path / "head.safetensors"
    head.write_bytes(b"")
    argv = {"cache": (cache_main, ["--dir", str(inside / "cache")]),
            "generate": (generate_main, ["--out", str(inside / "model.safetensors.index.json")]),
            "evaluate": (evaluate_main, ["--head", str(head), "--out", str(inside)])}[command]
    assert argv[0](["--config", str(config), *argv[1]]) == 2
    assert "is inside model.base" in one_error_line(capsys)
    assert sha256_tree(run_models["base"]) == before
