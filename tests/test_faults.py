"""Faults: bad inputs and misuse, each with what must hold afterwards (issue 14).

Every case here was found by trying the library as a new user would, with bad inputs,
kills and careless commands. A case checks both that the fault is refused or handled
with a clear reason and what must NOT have happened (nothing deleted, no byte of the
base changed, no more text tokenized than a window keeps). One section per component;
add a case to its component's section as it is found (validate's are in
tests/test_faults_validate.py).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from occamy_mtp.export import assemble as asm
from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.config import dump_yaml
from occamy_mtp.data import prepare, reader, split, windows
from occamy_mtp.selfgen import regenerate as G
from occamy_mtp.testing.checkpoints import build_tiny_checkpoint
from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH
from occamy_mtp.commands import assemble as assemble_command
from occamy_mtp.commands import data as data_command
from occamy_mtp.settings import plan_of
from test_assemble import assert_serves_head, base_tensors, head_variant, tree_state, write_head

# ==================================================================================
# assemble_head.py (occamy_mtp/export/assemble.py)
# ==================================================================================


@pytest.fixture
def base(tmp_path, sample_tokenizer_dir):
    """A tiny multimodal checkpoint with a tokenizer (its last shard mixes base tensors with mtp.*)."""
    return build_tiny_checkpoint(tmp_path / "base", tokenizer_dir=sample_tokenizer_dir)


@pytest.fixture
def head_file(base, tmp_path):
    path = tmp_path / "runs" / "run" / "mtp-trained.safetensors"
    path.parent.mkdir(parents=True)
    write_head(base.path, path)
    return path


def cli(base, head_file, out, *extra) -> list[str]:
    return ["--base", str(base.path), "--head", str(head_file), "--out", str(out), *extra]


def temporaries_beside(out: Path) -> list[Path]:
    return [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


# ---------------------------------------------------------------- --force (item 1)


def _training_run(out: Path) -> None:
    out.mkdir()
    (out / "mtp-trained.safetensors").write_bytes(b"weights of a week of training")
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "step-512.pt").write_bytes(b"state")


def _foreign_record(out: Path) -> None:
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / asm.RECORD_NAME).write_text(json.dumps({"written_by": "someone else", "entries": ["config.json"]}))


def _unreadable_record(out: Path) -> None:
    out.mkdir()
    (out / asm.RECORD_NAME).write_text("{not json")


def _record_is_a_link(out: Path) -> None:
    out.mkdir()
    (out / asm.RECORD_NAME).symlink_to(out.parent / "elsewhere.json")


@pytest.mark.parametrize(
    "make, why",
    [
        (_training_run, f"was not written by assemble_head.py (it has no {asm.RECORD_NAME})"),
        (_foreign_record, "is not an assembly record"),
        (_unreadable_record, "is not readable JSON"),
        (_record_is_a_link, f"it has no {asm.RECORD_NAME}"),
    ],
)
def test_force_refuses_a_directory_assembly_did_not_write(base, head_file, tmp_path, capsys, make, why):
    out = tmp_path / "precious"
    make(out)
    before = tree_state(out)

    assert assemble_command.main(cli(base, head_file, out, "--force")) == 2

    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out} ") and why in err and "nothing was deleted" in err
    assert tree_state(out) == before
    assert not temporaries_beside(out)


def test_force_refuses_an_assembly_holding_what_it_did_not_write(base, head_file, tmp_path, capsys):
    out = tmp_path / "serve"
    asm.assemble(base.path, head_file, out)
    (out / "notes.txt").write_text("mine")
    (out / "eval").mkdir()
    before = tree_state(out)

    assert assemble_command.main(cli(base, head_file, out, "--force")) == 2
    err = capsys.readouterr().err
    assert f"--out {out} holds entries that assembly did not write (eval, notes.txt)" in err
    assert tree_state(out) == before

    # A name the record lists, now a directory (e.g. a tool saved a folder under it).
    (out / "notes.txt").unlink()
    (out / "eval").rmdir()
    (out / "generation_config.json").unlink()
    (out / "generation_config.json").mkdir()
    (out / "generation_config.json" / "x").write_text("mine")
    assert assemble_command.main(cli(base, head_file, out, "--force")) == 2
    assert "generation_config.json is now a directory" in capsys.readouterr().err
    assert (out / "generation_config.json" / "x").read_text() == "mine"


def test_force_replaces_an_empty_directory_and_an_assembly_from_before_the_marker(base, head_file, tmp_path):
    out = tmp_path / "serve"
    out.mkdir()
    asm.assemble(base.path, head_file, out, force=True)  # empty: nothing to lose

    # assembly.json as the version before the marker wrote it: every carried entry linked.
    record = json.loads((out / asm.RECORD_NAME).read_text())
    for name in ("weights_mode", "weight_files", "copied", "written_by", "entries"):
        record.pop(name)
    record["linked"] = sorted(p.name for p in out.iterdir() if p.name not in {
        asm.CONFIG_NAME, ckpt_io.INDEX_NAME, asm.RECORD_NAME, head_file.name,
        *(s["name"] for s in record["rewritten_shards"]),
    })
    (out / asm.RECORD_NAME).write_text(json.dumps(record))
    before = tree_state(base.path)

    report = asm.assemble(base.path, head_file, out, force=True)

    assert report.replaced_existing_out
    assert json.loads((out / asm.RECORD_NAME).read_text())["written_by"] == asm.WRITTEN_BY
    assert tree_state(base.path) == before


# ---------------------------------------------------------------- where --out may be (item 2)


@pytest.mark.parametrize("where", ["head_directory", "around_head", "base_via_symlink", "inside_base_via_symlink"])
def test_out_is_refused_in_or_around_the_base_and_the_head(base, head_file, tmp_path, capsys, where):
    (tmp_path / "to-base").symlink_to(base.path)
    (tmp_path / "to-run").symlink_to(head_file.parent)
    out, why = {
        "head_directory": (tmp_path / "to-run", "is the directory of --head"),
        "around_head": (tmp_path / "runs", "contains --head"),
        "base_via_symlink": (tmp_path / "to-base", "is inside --base"),
        "inside_base_via_symlink": (tmp_path / "to-base" / "serve", "is inside --base"),
    }[where]
    watched = [base.path, head_file.parent]
    before = [tree_state(p) for p in watched]

    assert assemble_command.main(cli(base, head_file, out, "--force")) == 2

    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out} ") and why in err
    assert [tree_state(p) for p in watched] == before


def test_out_beside_the_head_in_its_run_directory_is_fine(base, head_file):
    """The documented layout (scripts/demo.sh): runs/demo/assembled next to runs/demo/mtp-trained.safetensors."""
    out = head_file.parent / "assembled"
    asm.assemble(base.path, head_file, out)
    assert (out / head_file.name).read_bytes() == head_file.read_bytes()


def test_head_given_through_a_symlinked_directory_is_checked_where_it_lies(base, head_file, tmp_path, capsys):
    (tmp_path / "alias").symlink_to(head_file.parent)
    out = head_file.parent  # the real directory of a head named through the alias
    assert assemble_command.main(cli(base, tmp_path / "alias" / head_file.name, out, "--force")) == 2
    assert "is the directory of --head" in capsys.readouterr().err


# ---------------------------------------------------------------- modes (item 3)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_assembled_directory_has_the_modes_of_the_umask(base, head_file, tmp_path, umask):
    previous = os.umask(umask)
    try:
        report = asm.assemble(base.path, head_file, tmp_path / "serve")
        replaced = asm.assemble(base.path, head_file, tmp_path / "serve", force=True)
    finally:
        os.umask(previous)
    assert report.rewritten_shards and report.copied and replaced.replaced_existing_out
    out = tmp_path / "serve"
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    for path in out.iterdir():  # copies, clones, the head, rewritten shards, index, config, record
        assert not path.is_symlink()
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path.name


# ---------------------------------------------------------------- writes into the assembled directory (item 4)


def _write_into_every_file(out: Path) -> None:
    """What careless tools do: save over the files, rewrite a shard in place, truncate, chmod."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(out)).save_pretrained(str(out))
    for path in sorted(out.iterdir()):
        with open(path, "r+b") as handle:  # in place, as an mmap-ed or seek-and-write update would
            handle.write(b"\0" * 8)
        with open(path, "wb") as handle:  # truncated and rewritten, as safetensors' save_file does
            handle.write(b"rewritten")
        os.chmod(path, 0o600)


def test_writing_into_the_assembled_directory_leaves_the_base_unchanged(base, head_file, tmp_path):
    before = tree_state(base.path)
    report = asm.assemble(base.path, head_file, tmp_path / "serve")
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(report.copied)
    assert set(report.weight_files.values()) <= {asm.CLONE, asm.COPY}  # the base is writable: no links

    _write_into_every_file(tmp_path / "serve")

    assert tree_state(base.path) == before


def test_symlinked_shards_are_only_made_into_a_read_only_base_unless_asked(base, head_file, tmp_path, monkeypatch):
    """Why auto never links into a writable base: an in-place write through the link
    rewrites the base's shard. --weights symlink does it anyway, and says so."""
    with monkeypatch.context() as patched:
        patched.setattr(asm, "on_read_only_filesystem", lambda path: True)
        patched.setattr(asm, "clone_file", lambda source, target: False)
        read_only = asm.assemble(base.path, head_file, tmp_path / "ro")
    assert set(read_only.weight_files.values()) == {asm.SYMLINK}
    assert not any("writable base" in note for note in read_only.notes)
    for shard in read_only.weight_files:
        assert os.readlink(tmp_path / "ro" / shard) == str(base.path.resolve() / shard)

    report = asm.assemble(base.path, head_file, tmp_path / "linked", weights=asm.SYMLINK)
    assert set(report.weight_files.values()) == {asm.SYMLINK}
    assert any("symlinks into the writable base" in note for note in report.notes)
    name = next(iter(report.weight_files))
    with open(tmp_path / "linked" / name, "r+b") as handle:
        handle.write(b"\0" * 8)
    assert (base.path / name).read_bytes()[:8] == b"\0" * 8  # the premise: the base was written


def test_clones_are_preferred_and_clone_mode_requires_them(base, head_file, tmp_path, monkeypatch, capsys):
    clones = []

    def fake_clone(source, target):  # a filesystem that clones: the bytes, in a file of its own
        Path(target).write_bytes(Path(source).read_bytes())
        clones.append(Path(source).name)
        return True

    monkeypatch.setattr(asm, "clone_file", fake_clone)
    monkeypatch.setattr(asm, "on_read_only_filesystem", lambda path: True)  # a clone still beats a link
    report = asm.assemble(base.path, head_file, tmp_path / "cloned")
    assert set(report.weight_files.values()) == {asm.CLONE} and sorted(clones) == sorted(report.weight_files)

    monkeypatch.setattr(asm, "clone_file", lambda source, target: False)
    out = tmp_path / "clone-required"
    assert assemble_command.main(cli(base, head_file, out, "--weights", "clone")) == 2
    err = capsys.readouterr().err
    assert "--weights clone:" in err and str(base.path / sorted(report.weight_files)[0]) in err
    assert not out.exists() and not temporaries_beside(out)


def test_clone_file_on_this_filesystem_clones_or_leaves_nothing(tmp_path):
    source = tmp_path / "shard.safetensors"
    source.write_bytes(os.urandom(1 << 16))
    target = tmp_path / "clone.safetensors"
    original = source.read_bytes()
    if asm.clone_file(source, target):  # btrfs, XFS with reflink
        assert target.read_bytes() == original
        with open(target, "r+b") as handle:
            handle.write(b"\0" * 8)
        assert source.read_bytes() == original
    else:  # ext4, tmpfs, ...
        assert not target.exists()


def test_copies_that_do_not_fit_are_refused_before_writing(base, head_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(asm, "clone_file", lambda source, target: False)
    monkeypatch.setattr(asm.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1000})())
    out = tmp_path / "serve"
    assert assemble_command.main(cli(base, head_file, out)) == 2
    err = capsys.readouterr().err
    assert "GiB are free" in err and "--weights symlink" in err and "read-only" in err
    assert not out.exists() and not temporaries_beside(out)


# ---------------------------------------------------------------- non-finite heads (item 5)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_head_is_refused_naming_the_tensor(base, tmp_path, capsys, value):
    def poison(tensors):
        fc = tensors["mtp.fc.weight"].clone()
        fc[3, 5] = value
        tensors["mtp.fc.weight"] = fc
        norm = tensors["mtp.norm.weight"].clone()
        norm[:2] = value
        tensors["mtp.norm.weight"] = norm

    poisoned = head_variant(base.path, tmp_path / "mtp-trained.safetensors", poison)
    out = tmp_path / "serve"

    assert assemble_command.main(cli(base, poisoned, out)) == 2

    err = capsys.readouterr().err
    nan, inf = (1, 0) if value != value else (0, 1)
    assert f"tensor mtp.fc.weight in {poisoned} is not finite: {nan} NaN and {inf} infinite values" in err
    assert f"tensor mtp.norm.weight in {poisoned} is not finite: {2 * nan} NaN and {2 * inf} infinite values" in err
    assert "mtp.layers.0" not in err  # only the poisoned tensors are named
    assert not out.exists() and not temporaries_beside(out)


def test_finite_head_passes_the_check(base, tmp_path):
    """The check's other side: the largest finite bf16 values are not mistaken for inf."""
    def extreme(tensors):
        fc = tensors["mtp.fc.weight"].clone()
        fc[0, 0], fc[0, 1] = torch.finfo(torch.bfloat16).max, torch.finfo(torch.bfloat16).min
        tensors["mtp.fc.weight"] = fc

    head = head_variant(base.path, tmp_path / "mtp-trained.safetensors", extreme)
    asm.assemble(base.path, head, tmp_path / "serve")
    assert_serves_head(tmp_path / "serve", base.text_config, base_tensors(head), head.name)


# ==================================================================================
# train.py and export.py: cheap checks first, nothing written into the base, non-finite
# values stopped, one run per output.dir, errors that name the setting
# ==================================================================================
@pytest.fixture(scope="module")
def run_models(tmp_path_factory, sample_tokenizer_dir):
    root = tmp_path_factory.mktemp("faults-run")
    donor = build_tiny_checkpoint(root / "donor", layout="fused", multimodal=False, seed=1, tokenizer_dir=sample_tokenizer_dir)
    base = build_tiny_checkpoint(root / "base", layout="per_expert", multimodal=True, seed=2, tokenizer_dir=sample_tokenizer_dir)
    data = root / "chats.jsonl"
    data.write_text("".join(SAMPLE_DATA_PATH.read_text().splitlines(keepends=True)[:40]))
    return {"root": root, "base": base.path, "donor": donor.path, "data": data}


def run_config(models, output, *overrides):
    """A few seconds of training on the tiny random models (CPU, fp32)."""
    from occamy_mtp.config import load_config

    return load_config(None, [
        f"model.base={models['base']}", f"model.donor_head={models['donor']}", "model.dtype=float32",
        f"data.files=[{models['data']}]", "data.context_tokens=16", "data.answer_tokens=24",
        "data.train_conversations=6", "data.validation_conversations=2", "data.heldout_conversations=2",
        "train.epochs=1", "train.lr=1.0e-2", "train.lr_warmup_steps=1", "train.checkpoint_every_steps=1",
        "train.select_every_steps=0", "eval.decoder_check_windows=0", "eval.served_steps=[1,2]", "eval.draft_steps=2",
        # greedy and one preset (the default adds a second preset: one more store a run, the suite's minutes)
        "eval.serving=[{temperature: 0}, instruct-general]",
        f"output.dir={output}", *overrides,
    ])


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if anything loads the base or the donor head."""
    from occamy_mtp.model import checkpoint as ckpt_io

    for name in ("load_base", "load_head", "load_shared_weights"):
        monkeypatch.setattr(ckpt_io, name, lambda *a, **k: pytest.fail("a model was loaded before the cheap checks"))


def sha256_tree(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["base", "inside-base", "symlink-into-base", "inside-donor"])
def test_outputs_inside_the_base_or_donor_are_refused(run_models, tmp_path, no_model_loading, where):
    from occamy_mtp.config import ConfigError
    from occamy_mtp.train.loop import train

    before = sha256_tree(run_models["base"])
    output = {"base": run_models["base"], "inside-base": run_models["base"] / "run",
              "symlink-into-base": tmp_path / "link" / "run", "inside-donor": run_models["donor"] / "sub" / "run"}[where]
    if where == "symlink-into-base":
        (tmp_path / "link").symlink_to(run_models["base"])
    with pytest.raises(ConfigError, match="output.dir: .* is inside model.(base|donor_head)"):
        train(plan_of(run_config(run_models, output)))
    with pytest.raises(ConfigError, match="data.self_generated_dir: .* is inside model.base"):
        train(plan_of(run_config(run_models, tmp_path / "ok", f"data.self_generated_dir={run_models['base'] / 'sg'}")))
    assert sha256_tree(run_models["base"]) == before and not (run_models["base"] / "run").exists()


def train_side_only(models, path: Path) -> Path:
    """The run's conversations whose split key puts them on the train side of a half/half split."""
    kept = []
    for line in models["data"].read_text().splitlines(keepends=True):
        conversation = reader.normalise_record(json.loads(line), "sample")
        if split.split_key(conversation.content_hash, seed=0) >= 0.5:
            kept.append(line)
    assert len(kept) >= 6
    path.write_text("".join(kept))
    return path


@pytest.mark.parametrize("case, overrides, message", [
    ("no-heldout", ["data.train_conversations=6", "data.validation_conversations=0", "data.heldout_conversations=6",
                    "train.select_every_steps=0"], "no heldout windows"),
    ("no-validation", ["data.validation_conversations=0", "train.select_every_steps=4"], "data.validation_conversations"),
    ("typo", ["train.trainable=[fc,pre_fc_norm_embeding]"], "train.trainable: trainable module 'pre_fc_norm_embeding'"),
])
def test_bad_settings_are_found_before_any_model_loads(run_models, tmp_path, no_model_loading, case, overrides, message):
    from occamy_mtp.config import ConfigError
    from occamy_mtp.train.loop import train

    if case == "no-heldout":  # every conversation hashes to the train side
        overrides = [*overrides, f"data.files=[{train_side_only(run_models, tmp_path / 'train-side.jsonl')}]"]
    with pytest.raises(ConfigError, match=message):
        train(plan_of(run_config(run_models, tmp_path / "run" / "nested", *overrides)))
    assert not (tmp_path / "run").exists()  # a config error leaves nothing behind (issue 22, item 5)


def test_an_output_dir_that_is_a_file_is_refused(run_models, tmp_path, no_model_loading):
    from occamy_mtp.config import ConfigError
    from occamy_mtp.train.loop import train

    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(ConfigError, match="output.dir: .* is a file"):
        train(plan_of(run_config(run_models, tmp_path / "run")))


@contextlib.contextmanager
def unwritable_directory(path: Path, how: str):
    """`path`, made, into which nothing can be written: immutable (chattr +i) or without write permission."""
    path.mkdir(parents=True, exist_ok=True)
    if how == "immutable":
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not permitted here")
        try:
            yield path
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes whatever the permissions")
        path.chmod(0o500)
        try:
            yield path
        finally:
            path.chmod(0o700)


@pytest.mark.parametrize("how", ["immutable", "permissions"])
def test_an_unwritable_output_dir_is_one_error_line_before_any_model_loads(run_models, tmp_path, no_model_loading, capsys, how):
    """Issue 22, item 5: an immutable parent of output.dir gave a PermissionError traceback, late."""
    from occamy_mtp.commands.train import main

    config = tmp_path / "run.yaml"
    with unwritable_directory(tmp_path / "parent", how) as parent:
        config.write_text(dump_yaml(run_config(run_models, parent / "run")))
        assert main(["--config", str(config)]) == 2
        assert not (parent / "run").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: output.dir: ") and "cannot be written: files cannot be created in" in err[-1]


@pytest.mark.parametrize("how", ["immutable", "permissions"])
def test_a_store_that_lacks_lines_and_cannot_take_them_is_refused_before_the_base_loads(run_models, tmp_path, monkeypatch,
                                                                                        capsys, how):
    from occamy_mtp.config import ConfigError
    from occamy_mtp.commands.cache import main as cache_main
    from occamy_mtp.train.loop import train

    for name in ("load_base", "load_head", "load_shared_weights"):
        monkeypatch.setattr(ckpt_io, name, lambda *a, **k: pytest.fail("a model was loaded before the store was checked"))
    with unwritable_directory(tmp_path / "shared", how) as shared:
        with pytest.raises(ConfigError, match=r"data.self_generated_dir: .* lacks \d+ of the run's \d+ continuations and "
                                              "cannot be written"):
            train(plan_of(run_config(run_models, tmp_path / "run", f"data.self_generated_dir={shared / 'store'}")))
        config = tmp_path / "cache.yaml"
        config.write_text(dump_yaml(run_config(run_models, tmp_path / "run", f"data.target_cache={shared / 'cache'}")))
        assert cache_main(["--config", str(config)]) == 2  # the store is fine; the cache cannot be written
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: data.target_cache: {shared / 'cache'} "
                                                                        "cannot be written")


@pytest.mark.parametrize("override, message", [
    ("train.lr=inf", "train.lr: expected a finite number > 0"),
    ("train.adam_beta2=1.0", r"train.adam_beta2: expected in \[0, 1\)"),
    ("train.adam_eps=0", "train.adam_eps: expected a finite number > 0"),
    ("train.weight_decay=-0.1", "train.weight_decay: expected a finite number >= 0"),
    ("train.step_loss_weights=[0,0]", "train.step_loss_weights"),
])
def test_bad_optimizer_settings_are_config_errors(run_models, tmp_path, override, message):
    from occamy_mtp.config import ConfigError

    extra = ["train.draft_steps=2"] if "step_loss" in override else []
    with pytest.raises(ConfigError, match=message):
        run_config(run_models, tmp_path / "run", *extra, override)


def test_a_non_finite_loss_stops_training_and_keeps_the_last_good_checkpoint(run_models, tmp_path, monkeypatch):
    from occamy_mtp.train import loop as train_module

    real = train_module.chain_loss
    calls = []

    def poisoned(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 3 else loss), stats

    monkeypatch.setattr(train_module, "chain_loss", poisoned)
    output = tmp_path / "run"
    with pytest.raises(train_module.TrainingError, match=r"step 3: the loss is nan; .*step-000002.pt, is kept"):
        train_module.train(plan_of(run_config(run_models, output)))
    assert [p.name for p in sorted((output / "checkpoints").glob("step-*.pt"))] == ["step-000001.pt", "step-000002.pt"]
    assert not (output / "trained-tensors.safetensors").exists()


def test_a_non_finite_update_is_caught_before_a_checkpoint_keeps_it(run_models, tmp_path, monkeypatch):
    from occamy_mtp.train import loop as train_module

    # The optimizer's third step overflows one weight (what a huge finite lr does in float32).
    real_step, steps = torch.optim.AdamW.step, []

    def overflowing(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        steps.append(1)
        if len(steps) == 3:
            with torch.no_grad():
                fc_weight = next(p for p in self.param_groups[0]["params"] if p.dim() == 2)  # the only matrix
                fc_weight.view(-1)[0] = float("inf")
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", overflowing)
    output = tmp_path / "run"
    with pytest.raises(train_module.TrainingError, match=r"step 3: the update made fc.weight non-finite; .*step-000002.pt, is kept"):
        train_module.train(plan_of(run_config(run_models, output)))
    kept = sorted((output / "checkpoints").glob("step-*.pt"))
    assert [p.name for p in kept] == ["step-000001.pt", "step-000002.pt"]
    for path in kept:
        payload = torch.load(path, weights_only=True)
        assert all(bool(torch.isfinite(t).all()) for t in payload["trainable"].values()), path.name


def test_the_whole_layer_trained_exports_in_a_per_expert_donor_s_layout(run_models, tmp_path):
    """train.trainable with layers.0 (the routed experts too) and a per-expert donor: the export
    writes every trained tensor in the donor's layout (it died on the fused expert key), and
    the head read back from the file is the trained head."""
    from safetensors import safe_open

    from occamy_mtp.export.exporter import export
    from occamy_mtp.model.head import SharedWeights
    from occamy_mtp.run import RunDir
    from occamy_mtp.train.loop import train

    donor = build_tiny_checkpoint(tmp_path / "donor", layout="per_expert", multimodal=False, seed=1)
    config = run_config(run_models, tmp_path / "run", f"model.donor_head={donor.path}",
                        "train.trainable=[fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm,layers.0]")
    train(plan_of(config))
    record = export(plan_of(config), allow_worse=True, log=lambda m: None)
    run_dir = RunDir.of(config)
    assert record["derived"]["export_layout"] == "per_expert"
    replaced = set(record["export"]["replaced"])
    assert "mtp.layers.0.mlp.experts.0.down_proj.weight" in replaced and "mtp.layers.0.mlp.experts.down_proj" not in replaced
    with safe_open(str(run_dir.head), "pt") as handle:
        assert set(handle.keys()) >= replaced and not any(".experts.gate_up_proj" in k for k in handle.keys())
        donor_ckpt = ckpt_io.SafetensorsCheckpoint(donor.path)
        assert not torch.equal(handle.get_tensor("mtp.layers.0.mlp.experts.0.down_proj.weight"),
                               donor_ckpt.get("mtp.layers.0.mlp.experts.0.down_proj.weight"))  # trained, and written
    base = ckpt_io.load_base(run_models["base"], dtype=torch.float32)
    shared = SharedWeights(base.model.embed_tokens, base.lm_head)
    reread, layout = ckpt_io.load_head(run_dir.head, base.config, shared, dtype=torch.float32)
    trained = load_file(run_dir.trained_tensors)
    assert layout == "per_expert" and set(trained) >= {"layers.0.mlp.experts.down_proj", "fc.weight"}
    state = reread.state_dict()
    for name, master in trained.items():  # the file holds the masters rounded to bf16
        assert torch.equal(state[name], master.to(torch.bfloat16).float()), name


@pytest.mark.parametrize("fault", ["non-finite", "shape"])
def test_export_refuses_non_finite_or_misshapen_tensors(run_models, tmp_path, fault):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from occamy_mtp.export.exporter import ExportError, export
    from occamy_mtp.run import RunDir
    from occamy_mtp.train.loop import train

    config = run_config(run_models, tmp_path / "run")
    train(plan_of(config))
    path = RunDir.of(config).trained_tensors
    tensors = load_file(path)
    with safe_open(str(path), "pt") as handle:  # keep the metadata (the config fingerprint)
        metadata = handle.metadata()
    if fault == "non-finite":
        tensors["fc.weight"][0, 0] = float("nan")
        expected = "tensor fc.weight holds 1 non-finite values"
    else:  # one row: would broadcast over the head's fc if it were copied in
        shape = tuple(tensors["fc.weight"].shape)
        tensors["fc.weight"] = tensors["fc.weight"][:1].contiguous()
        expected = re.escape(f"tensor 'fc.weight' has shape (1, {shape[1]}), the head's is {shape}")
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ExportError, match=expected):
        export(plan_of(config), allow_worse=True, log=lambda m: None)
    assert not (tmp_path / "run" / "mtp-trained.safetensors").exists()


def test_export_is_reproducible_atomic_and_cleans_stale_temporaries(run_models, tmp_path):
    from occamy_mtp.export.exporter import export
    from occamy_mtp.run import RunDir
    from occamy_mtp.train.loop import train

    config = run_config(run_models, tmp_path / "run")
    output = RunDir.of(config)
    train(plan_of(config))
    stale = output.root / f".{output.head.name}.killed.tmp"
    stale.write_bytes(b"half a head")
    export(plan_of(config), allow_worse=True, log=lambda m: None)
    first = {path: path.read_bytes() for path in output.export_outputs()}
    assert not stale.exists() and not list(output.root.glob(".*.tmp"))
    record = json.loads(first[output.record])
    assert record["outputs"][output.head.name] == hashlib.sha256(first[output.head]).hexdigest()
    export(plan_of(config), allow_worse=True, log=lambda m: None)
    assert output.head.read_bytes() == first[output.head]  # identical tensors, identical file


class Killed(BaseException):
    """What a SIGKILL leaves, in this process: nothing after it runs but the `finally` blocks."""


@pytest.fixture(scope="module")
def exported(run_models, tmp_path_factory):
    """A trained and exported run (the donor's layout), and its config."""
    from occamy_mtp.export.exporter import export
    from occamy_mtp.train.loop import train

    config = run_config(run_models, tmp_path_factory.mktemp("exported") / "run")
    train(plan_of(config))
    export(plan_of(config), allow_worse=True, log=lambda m: None)
    return config


def readers_refuse(config, message: str, capsys) -> None:
    """Every reader of an exported head refuses it: load_head (evaluate, the reference server), assemble, evaluate's CLI."""
    from occamy_mtp.commands.evaluate import main as evaluate_main
    from occamy_mtp.run import RunDir

    head = RunDir.of(config).head
    text_config = ckpt_io.read_config(config.model.base).text_config
    with pytest.raises(ckpt_io.CheckpointError, match=message):
        ckpt_io.load_head(head, text_config)
    with pytest.raises(asm.AssemblyError, match="--head: .*" + message):
        asm.check_head_file(head, text_config)
    config_file = head.parent.parent / "evaluate.yaml"
    config_file.write_text(dump_yaml(config))
    capsys.readouterr()
    assert evaluate_main(["--config", str(config_file), "--head", str(head), "--out", str(head.parent.parent / "eval")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and re.search(message, last), last


@pytest.mark.parametrize("renamed", [1, 2, 3, 4])
def test_an_export_killed_between_two_renames_is_refused_by_every_reader(exported, monkeypatch, capsys, renamed):
    """Issue 22, item 6: a kill between export's renames left a new head beside an old config and record."""
    import shutil

    from occamy_mtp import files
    from occamy_mtp.export.exporter import export
    from occamy_mtp.run import RunDir

    root = RunDir.of(exported).root.parent / f"killed-{renamed}"
    shutil.copytree(RunDir.of(exported).root, root)
    config = run_config_like(exported, root, expert_layout="fused")  # the new set differs in every file
    outputs = [p.name for p in RunDir.of(config).export_outputs()]
    real_replace, done = os.replace, []

    def replace(source, target):
        if Path(target).name in outputs:
            if len(done) == renamed:
                raise Killed
            done.append(target)
        real_replace(source, target)

    monkeypatch.setattr(files.os, "replace", replace)
    with pytest.raises(Killed):
        export(plan_of(config), allow_worse=True, log=lambda m: None)
    monkeypatch.undo()
    assert len(done) == renamed and RunDir.of(config).export_incomplete.exists()
    readers_refuse(config, "an export into it was interrupted", capsys)
    export(plan_of(config), allow_worse=True, log=lambda m: None)  # the next export completes the set
    assert not RunDir.of(config).export_incomplete.exists()
    ckpt_io.load_head(RunDir.of(config).head, ckpt_io.read_config(config.model.base).text_config)


def run_config_like(config, output: Path, **output_settings):
    """`config` writing into `output` (a copy of its run directory), other `output.*` settings changed."""
    import dataclasses

    return dataclasses.replace(config, output=dataclasses.replace(config.output, dir=str(output), **output_settings))


def test_a_head_that_is_not_the_one_its_record_names_is_refused(exported, tmp_path, capsys):
    import shutil

    from occamy_mtp.run import RunDir

    root = tmp_path / "run"
    shutil.copytree(RunDir.of(exported).root, root)
    config = run_config_like(exported, root)
    head = RunDir.of(config).head
    tensors = load_file(head)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1
    from safetensors.torch import save_file

    save_file(tensors, head, metadata={"format": "pt"})
    readers_refuse(config, "its sha256 is not the one .*TRAINING.json records", capsys)


def test_a_second_run_into_a_locked_output_dir_is_refused(run_models, tmp_path):
    from occamy_mtp.config import ConfigError
    from occamy_mtp.run import output_lock
    from occamy_mtp.train.loop import train

    config = run_config(run_models, tmp_path / "run")
    with output_lock(plan_of(config).run_dir):
        with pytest.raises(ConfigError, match=rf"output.dir: .* is in use by another run \(pid {os.getpid()}\)"):
            train(plan_of(config))
    train(plan_of(config))  # the lock went with its holder


def test_a_refused_resume_names_the_setting_that_differs(run_models, tmp_path, capsys):
    from occamy_mtp.commands.train import main

    output = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(dump_yaml(run_config(run_models, output)))
    assert main(["--config", str(config)]) == 0
    # flags and overrides in any order; the error goes to stderr and names what changed
    assert main(["--config", str(config), "--resume", "train.lr=0.02"]) == 2
    error = capsys.readouterr().err
    last = error.strip().splitlines()[-1]
    assert last.startswith("error: ") and "train.lr: 0.01 -> 0.02" in last


def test_a_resume_on_other_data_is_refused_before_any_model_loads(run_models, tmp_path, monkeypatch):
    """Issue 22, item 2: a data file replaced between a kill and --resume was trained on without a word."""
    from occamy_mtp.config import ConfigError
    from occamy_mtp.train.loop import train

    data = tmp_path / "chats.jsonl"
    lines = SAMPLE_DATA_PATH.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[:40]))
    config = run_config(run_models, tmp_path / "run", f"data.files=[{data}]")
    train(plan_of(config))
    train(plan_of(config), resume=True)  # the same data: resumes (and finds nothing left to do)
    data.write_text("".join(lines[:20] + lines[60:80]))  # half the conversations replaced
    for name in ("load_base", "load_head", "load_shared_weights"):
        monkeypatch.setattr(ckpt_io, name, lambda *a, **k: pytest.fail("a model was loaded before the data was checked"))
    with pytest.raises(ConfigError, match=r"step-\d+.pt: was trained on other data \(data.files .*chats.jsonl: sha256 "
                                          r"[0-9a-f]+\.\.\. then, [0-9a-f]+\.\.\. now; the train split: [1-9]\d* of its 6 "
                                          r"conversations are gone, [1-9]\d* are new"):
        train(plan_of(config), resume=True)


def test_slow_phases_report_progress(run_models, tmp_path, capsys):
    from occamy_mtp.export.exporter import export
    from occamy_mtp.train.loop import train

    config = run_config(run_models, tmp_path / "run")
    train(plan_of(config))
    export(plan_of(config), allow_worse=True)
    err = capsys.readouterr().err
    for phase in ("data: reading 1 file(s)", "base: loading", "self-generated windows: the base (greedy) writes",
                  "export: measuring the donor head", "hashing "):
        assert phase in err, phase


# ==================================================================================
# Chat data (occamy_mtp/data/, and the generate command's prompt reading)
# ==================================================================================


class CountingTokenizer:
    """A tokenizer that records the length (in characters) of every text it tokenizes."""

    def __init__(self, inner):
        self._inner = inner
        self.lengths: list[int] = []

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self._inner(text, **kwargs)

    def __len__(self):
        return len(self._inner)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def sample_texts() -> list[str]:
    """The sample answers: real sentences, punctuation, numbers."""
    records = [json.loads(line) for line in SAMPLE_DATA_PATH.read_text(encoding="utf-8").splitlines()]
    return [reader.normalise_record(r, "sample").messages[-1].content for r in records]


def long_text(characters: int, offset: int = 0) -> str:
    texts = sample_texts()
    pieces, total, index = [], 0, offset
    while total < characters:
        pieces.append(texts[index % len(texts)])
        total += len(pieces[-1]) + 1
        index += 1
    return " ".join(pieces)[:characters]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def chat(user: str, answer: str, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": messages + [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def assert_window_equals_the_whole(tokenizer, prompt: str, span: str, context_tokens: int, answer_tokens: int) -> windows.WindowTokens:
    whole = windows.tokenize_turn(tokenizer, prompt, span)
    bounded = windows.tokenize_window(tokenizer, prompt, span, context_tokens, answer_tokens)
    assert bounded.context_ids == whole.prompt_ids[-context_tokens:]
    assert bounded.answer_ids == whole.span_ids[:answer_tokens]
    assert bounded.boundary_retokenized == whole.boundary_retokenized
    return bounded


# ---------------------------------------------------------------- record size limit (item 7)


def test_a_byte_order_mark_is_read_past_and_bad_utf8_is_named_by_line(tmp_path, sample_tokenizer):
    """Issue 22, item 8: a UTF-8 file with a BOM (as some editors save JSONL) gives the windows of
    the same file without it; a byte that is not UTF-8 is reported with its line."""
    plain = write_jsonl(tmp_path / "plain.jsonl", [chat("Hi", "Hello there."), chat("Bye", "See you.")])
    with_bom = tmp_path / "bom.jsonl"
    with_bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    settings = dict(heldout_conversations=0)
    want = prepare.prepare_windows([plain], sample_tokenizer, **settings)
    got = prepare.prepare_windows([with_bom], sample_tokenizer, **settings)
    assert [w.input_ids for w in got.train] == [w.input_ids for w in want.train] and len(got.train) == 2
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(plain.read_bytes() + b'{"messages": "caf\xe9"}\n')
    with pytest.raises(reader.DataError, match=r"broken\.jsonl:3: not UTF-8 text \(invalid continuation byte at byte \d+ of the file\)"):
        prepare.prepare_windows([broken], sample_tokenizer, **settings)


def test_records_over_the_byte_limit_are_excluded_and_counted(tmp_path, sample_tokenizer, capsys, sample_tokenizer_dir):
    limit = 2000
    records = [
        chat("Hi", "Hello there."),
        chat("x" * 1000, "y" * 1001),  # 2001 bytes of text
        chat("Hi", "é" * 1000),  # 1000 characters, 2000 bytes (+2 for "Hi"): bytes count, not characters
        chat("x" * 1000, "y" * 1001),  # also a duplicate: the size is checked first
        chat("Hi", "z" * 1990, system="s" * 6),  # 1998 bytes: kept
    ]
    path = write_jsonl(tmp_path / "data.jsonl", records)

    result = prepare.prepare_windows([path], sample_tokenizer, max_record_bytes=limit, heldout_conversations=0)

    assert result.excluded == {reader.RECORD_TOO_LARGE: 3}
    assert result.conversations_read == 5 and result.conversations_kept == 2
    assert result.excluded_examples[reader.RECORD_TOO_LARGE][0] == (
        f"{path}:2: 2001 bytes of text, over the limit of 2000 (max_record_bytes)"
    )
    assert result.provenance()["max_record_bytes"] == limit
    assert reader.RECORD_TOO_LARGE in reader.EXCLUSION_REASONS

    assert data_command.main([f"data.files=[{path}]", f"model.tokenizer={sample_tokenizer_dir}", f"data.max_record_bytes={limit}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["excluded"][reader.RECORD_TOO_LARGE] == 3
    with pytest.raises(ValueError, match="max_record_bytes must be >= 1, got 0"):
        prepare.prepare_windows([path], sample_tokenizer, max_record_bytes=0)


def test_a_huge_record_is_refused_by_default_without_being_tokenized(tmp_path, sample_tokenizer):
    huge = long_text(reader.DEFAULT_MAX_RECORD_BYTES)
    path = write_jsonl(tmp_path / "data.jsonl", [chat(huge, "Fine."), chat("Hi", "Hello there.")])
    counting = CountingTokenizer(sample_tokenizer)

    result = prepare.prepare_windows([path], counting, heldout_conversations=0)

    assert result.excluded == {reader.RECORD_TOO_LARGE: 1} and result.conversations_kept == 1
    text_bytes = len((huge + "Fine.").encode("utf-8"))
    assert f"{text_bytes} bytes of text, over the limit of {reader.DEFAULT_MAX_RECORD_BYTES}" in result.excluded_examples[reader.RECORD_TOO_LARGE][0]
    assert max(counting.lengths) < 1000


def test_the_run_config_sets_the_record_size_limit(tmp_path, sample_tokenizer_dir, sample_tokenizer):
    from occamy_mtp.config import load_config
    from occamy_mtp.run import prepare_data

    records = [chat(f"question {i}?", long_text(300 + 400 * i, offset=i)) for i in range(4)]
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    config = load_config(None, [f"model.base={sample_tokenizer_dir}", f"data.files=[{path}]", "data.max_record_bytes=1000",
                                "data.train_conversations=3", "data.validation_conversations=0", "data.heldout_conversations=1",
                                "train.select_every_steps=0"])
    data = prepare_data(plan_of(config).setup, sample_tokenizer)
    assert data.excluded[reader.RECORD_TOO_LARGE] == 2 and data.summary()["conversations_kept"] == 2
    assert data.max_record_bytes == 1000 and data.provenance()["max_record_bytes"] == 1000


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])  # JSON escapes the control characters itself
def test_a_line_separator_inside_a_json_string_stays_in_its_record(tmp_path, separator):
    answer = f"one line{separator}the same answer"
    path = write_jsonl(tmp_path / "chats.jsonl", [chat("a?", answer), chat("b?", "plain")])
    assert separator in path.read_text(encoding="utf-8")  # written raw (ensure_ascii=False), not escaped
    records = list(reader.read_records(path))
    assert [location for location, _ in records] == [f"{path}:1", f"{path}:2"]
    assert records[0][1]["messages"][-1]["content"] == answer


def test_crlf_line_ends_are_read_as_line_ends(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_bytes(b"".join(json.dumps(chat(q, "yes")).encode() + b"\r\n" for q in ("a?", "b?")))
    assert [location for location, _ in reader.read_records(path)] == [f"{path}:1", f"{path}:2"]


def test_generate_reads_prompts_with_the_same_limit(tmp_path, sample_tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", [chat("Hi", "Hello there."), chat("x" * 600, "y" * 600)])
    read = G.read_prompts([path], sample_tokenizer, max_record_bytes=1000)
    windows = prepare.prepare_windows([path], sample_tokenizer, max_record_bytes=1000, heldout_conversations=0)
    assert read.excluded == windows.excluded == {reader.RECORD_TOO_LARGE: 1}
    assert read.excluded_examples == windows.excluded_examples
    assert len(read.prompts) == 1


# ---------------------------------------------------------------- the split keeps windows apart (issue 22, item 3)


@pytest.mark.parametrize("case", ["same-prompt-other-answer", "answers-differing-past-the-window"])
def test_no_heldout_or_validation_window_shares_a_context_or_answer_with_train(tmp_path, sample_tokenizer, case):
    records = []
    for i in range(30):
        prompt = f"Question {i}: how many legs do {i} spiders and {i + 3} ants have together?"
        answer = f"Spiders have eight legs and ants have six, so the answer for question {i} is {8 * i + 6 * (i + 3)}."
        if case == "same-prompt-other-answer":
            records += [chat(prompt, answer), chat(prompt, f"Let me count: {answer} That is all.")]
        else:  # the same first tokens, so the same window, once cut to its answer budget
            records += [chat(prompt, answer + " " + "Extra words. " * 10), chat(prompt, answer + " " + "Other words. " * 10)]
    data = prepare.prepare_windows([write_jsonl(tmp_path / "chats.jsonl", records)], sample_tokenizer, context_tokens=16,
                             answer_tokens=12, train_conversations=40, validation_conversations=10, heldout_conversations=10)

    def keys(windows, part):
        return {w.input_ids[: w.answer_start] if part == "context" else w.input_ids[w.answer_start :] for w in windows}

    for part in ("context", "answer"):
        assert not keys(data.heldout, part) & keys(data.train, part), part
        assert not keys(data.heldout, part) & keys(data.validation, part), part
        assert not keys(data.validation, part) & keys(data.train, part), part
    dropped = data.summary()["kept_apart"]
    assert dropped["train_windows_dropped"] > 0  # half the prompts have their twin on another side
    built = sum(len(w) for w in (data.train, data.validation, data.heldout))
    assert built + sum(dropped.values()) == data.conversations_kept  # one window a conversation: each counted once
    assert data.provenance()["windows"]["kept_apart"] == dropped


# ---------------------------------------------------------------- bounded tokenization (item 7)


def test_a_long_record_is_tokenized_only_around_its_window(tmp_path, sample_tokenizer):
    """2 MB of text on one line: the work is bounded by the window, and the window is
    the one a short record with the same text next to the answer gives (tokenization
    is local, so what lies megabytes before the answer cannot change it)."""
    near_the_answer = long_text(5_000, offset=11) + " And so, at the end of a very long question: what do you think?"
    answer = long_text(30_000, offset=7)
    long_record = chat(long_text(2_000_000) + " " + near_the_answer, answer, system=long_text(100_000, offset=3))
    short_record = chat(long_text(40_000) + " " + near_the_answer, answer[:20_000], system="You are a helpful assistant.")
    counting = CountingTokenizer(sample_tokenizer)

    [window] = prepare.prepare_windows([write_jsonl(tmp_path / "long.jsonl", [long_record])], counting, heldout_conversations=0).train
    [reference] = prepare.prepare_windows([write_jsonl(tmp_path / "short.jsonl", [short_record])], sample_tokenizer, heldout_conversations=0).train

    assert window.input_ids == reference.input_ids and window.answer_start == reference.answer_start
    assert window.answer_start == windows.DEFAULT_CONTEXT_TOKENS and window.answer_length == windows.DEFAULT_ANSWER_TOKENS
    bound = 8 * (windows.DEFAULT_ANSWER_TOKENS + windows.CUT_MARGIN_TOKENS) * windows.CUT_CHARS_PER_TOKEN
    assert max(counting.lengths) <= bound, counting.lengths  # 50 MB whole took minutes and gigabytes


@pytest.mark.parametrize("settings", [dict(context_tokens=8, answer_tokens=40), dict(context_tokens=128, answer_tokens=382)])
def test_bounded_tokenization_equals_the_whole_on_the_sample_data(sample_tokenizer, settings):
    """Every turn of every sample conversation. With 8/40 tokens both texts are cut
    (the prompt's first cut is 384 characters, the answer's 896); at 128/382 most are
    tokenized whole, and the window must not change either way."""
    records = [json.loads(line) for line in SAMPLE_DATA_PATH.read_text(encoding="utf-8").splitlines()]
    cut = 0
    for number, record in enumerate(records, start=1):
        conversation = reader.normalise_record(record, f"sample:{number}")
        for turn in windows.selected_turns(conversation, "every"):
            prompt, span = windows.render_turn(sample_tokenizer, conversation.messages, turn)
            assert_window_equals_the_whole(sample_tokenizer, prompt, span, **settings)
            budget = (settings["answer_tokens"] + windows.CUT_MARGIN_TOKENS) * windows.CUT_CHARS_PER_TOKEN
            cut += len(span) > budget
    if settings["answer_tokens"] == 40:
        assert cut > 100  # the bounded path was taken


# Texts on which a cut changes the tokens near it, or (runs) all the way to the run's end:
# the sample vocabulary has "ss", "==", "====", ..., "================", so a run's last
# tokens depend on its length modulo 2 or 16, i.e. on where a cut falls.
HARD_TEXTS = {
    "a run of s, odd": "x" + "s" * 6001 + "y",
    "a run of s, even": "x" + "s" * 6002 + "y",
    "a run of =": "Title\n" + "=" * 6003,
    "a run of spaces before a word": "code:" + " " * 6001 + "x",
    "one 20,000-letter word": "a" * 20_000,
    "spaces and newlines": ("word " + " " * 300 + "\n\n\n" + "\t" * 50) * 80,
    "digits": "3.14159265358979 " * 2000,
    "CJK and emoji": ("日本語のテキスト、絵文字😀🎉も。" * 700),
    "combining marks": ("e\u0301" * 9 + " cafe\u0301 ") * 1500,  # NFC joins them: a cut between them is a different text
    "punctuation runs": ("!!!???...;;;---" * 50 + " x ") * 60,
}
# (margin, characters per token of the first cut): the defaults, and none at all, where
# the kept tokens always reach the cut and only the moved-cut checks keep them exact.
CUT_SETTINGS = [(windows.CUT_MARGIN_TOKENS, windows.CUT_CHARS_PER_TOKEN), (0, 1)]


@pytest.mark.parametrize("margin, chars_per_token", CUT_SETTINGS)
@pytest.mark.parametrize("name", sorted(HARD_TEXTS))
def test_bounded_tokenization_equals_the_whole_on_hard_texts(sample_tokenizer, monkeypatch, name, margin, chars_per_token):
    monkeypatch.setattr(windows, "CUT_MARGIN_TOKENS", margin)
    monkeypatch.setattr(windows, "CUT_CHARS_PER_TOKEN", chars_per_token)
    text = HARD_TEXTS[name]
    conversation = reader.Conversation((reader.Message("user", text), reader.Message("assistant", text[::-1] + " " + text)), "hard")
    prompt, span = windows.render_turn(sample_tokenizer, conversation.messages, 1)
    for context_tokens, answer_tokens in [(1, 1), (128, 382), (5000, 5000)]:
        assert_window_equals_the_whole(sample_tokenizer, prompt, span, context_tokens, answer_tokens)


def test_a_run_at_the_end_of_the_prompt_is_cut_at_its_start(sample_tokenizer):
    """The premise of the moved-cut check: two cuts an even number of characters apart
    inside a run of "s" give the same wrong tokens; one character apart they differ."""
    text = "x" + "s" * 6002 + "y"  # cut 2304 or 4608 characters from the end: 2303 or 4607 s, and 6002 in the whole
    whole = windows._encode(sample_tokenizer, text)[-8:]
    same_phase = [windows._encode(sample_tokenizer, text[-length:])[-8:] for length in (2304, 4608)]
    assert same_phase[0] == same_phase[1] != whole
    assert windows._encode(sample_tokenizer, text[-2305:])[-8:] != same_phase[0]
    assert windows._last_tokens(sample_tokenizer, text, 8)[0] == whole


@pytest.mark.parametrize("margin, chars_per_token", CUT_SETTINGS)
def test_bounded_tokenization_equals_the_whole_on_long_sample_prompts(sample_tokenizer, monkeypatch, margin, chars_per_token):
    """Sample conversations strung into one long multi-turn chat: every turn's window."""
    monkeypatch.setattr(windows, "CUT_MARGIN_TOKENS", margin)
    monkeypatch.setattr(windows, "CUT_CHARS_PER_TOKEN", chars_per_token)
    records = [json.loads(line) for line in SAMPLE_DATA_PATH.read_text(encoding="utf-8").splitlines()[:12]]
    messages = tuple(m for number, r in enumerate(records) for m in reader.normalise_record(r, f"sample:{number}").messages
                     if m.role != "system")
    conversation = reader.Conversation(messages, "strung")
    for turn in windows.selected_turns(conversation, "every"):
        prompt, span = windows.render_turn(sample_tokenizer, conversation.messages, turn)
        for context_tokens, answer_tokens in [(8, 40), (128, 382)]:
            assert_window_equals_the_whole(sample_tokenizer, prompt, span, context_tokens, answer_tokens)


def test_text_after_the_end_of_turn_is_never_kept(sample_tokenizer):
    """A template that writes a footer after <|im_end|>: the head cut holds the end of
    turn, and the answer stops there however many tokens follow it."""
    tokenizer = copy.deepcopy(sample_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        + "(a footer the template writes after every message) " * 40
        + "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    conversation = reader.Conversation((reader.Message("user", "Hi"), reader.Message("assistant", "Hello there.")), "footer")
    prompt, span = windows.render_turn(tokenizer, conversation.messages, 1)
    assert len(span) > (40 + windows.CUT_MARGIN_TOKENS) * windows.CUT_CHARS_PER_TOKEN  # the head is cut
    bounded = assert_window_equals_the_whole(tokenizer, prompt, span, 4, 40)
    assert tokenizer.decode(bounded.answer_ids) == "Hello there.<|im_end|>"


def test_end_of_turn_just_beyond_a_cut(sample_tokenizer):
    """An answer whose <|im_end|> straddles the first head cut, and one that ends right at it."""
    budget = (40 + windows.CUT_MARGIN_TOKENS) * windows.CUT_CHARS_PER_TOKEN
    for shift in range(-12, 4):
        answer = "b" * (budget + shift - 3) + " ok"  # the template adds <|im_end|> and a newline after it
        conversation = reader.Conversation((reader.Message("user", "Hi"), reader.Message("assistant", answer)), "edge")
        prompt, span = windows.render_turn(sample_tokenizer, conversation.messages, 1)
        assert_window_equals_the_whole(sample_tokenizer, prompt, span, 4, 40)
        bounded = assert_window_equals_the_whole(sample_tokenizer, prompt, span, 4, 5000)
        assert bounded.answer_ids[-1] == sample_tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_boundary_retokenization_is_counted_as_the_whole_text_counts_it(sample_tokenizer):
    """A template whose generation prompt ends in a space: "assistant: " + "Hello" gives
    " Hello" in one piece. Long and short prompts count it alike."""
    tokenizer = copy.deepcopy(sample_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    flags = []
    for answer in ("Hello there.", "yes", "The quick brown fox.", "42 is the answer.", " spaced", "-dash"):
        for user in ("Hi", long_text(50_000)):
            conversation = reader.Conversation((reader.Message("user", user), reader.Message("assistant", answer)), "boundary")
            prompt, span = windows.render_turn(tokenizer, conversation.messages, 1)
            flags.append(assert_window_equals_the_whole(tokenizer, prompt, span, 16, 16).boundary_retokenized)
    assert any(flags) and not all(flags)  # both outcomes were checked


def test_generate_round_trip_reads_only_the_answer_of_a_long_prompt(sample_tokenizer):
    im_end = sample_tokenizer.convert_tokens_to_ids("<|im_end|>")
    answer_ids = sample_tokenizer("Hello there.", add_special_tokens=False)["input_ids"] + [im_end]
    messages = [reader.Message("user", long_text(300_000)), reader.Message("assistant", "Hello there.")]
    counting = CountingTokenizer(sample_tokenizer)
    assert G.roundtrip_outcome(counting, messages, answer_ids, True, im_end) == G.ROUNDTRIP_EXACT
    assert max(counting.lengths) < 10_000
    assert G.roundtrip_outcome(counting, messages, answer_ids[:1] + answer_ids, True, im_end) == G.RETOKENIZED


# ==================================================================================
# The self-generated store (occamy_mtp/selfgen/store.py): one writer at a time, every line
# checked for whose it is and whether it changed (issue 22, items 1 and 4)
# ==================================================================================
def store_config(models, store: Path, base: str = "base"):
    return run_config(models, store.parent / "run", f"data.self_generated_dir={store}", f"model.base={models[base]}",
                      "data.self_generate_batch_size=4")


def opened_store(config):
    """A run's store and windows as `open_run` has them once its models are loaded."""
    from occamy_mtp.data.windows import stop_token_ids
    from occamy_mtp.base.frozen import BaseFacts
    from occamy_mtp.run import load_tokenizer, open_store, prepare_data, self_generated_needed
    from occamy_mtp.sampling import GREEDY_TEXT

    tokenizer = load_tokenizer(config.model)
    data = prepare_data(plan_of(config).setup, tokenizer)
    return open_store(plan_of(config).setup, BaseFacts(config.model.base), stop_token_ids(tokenizer, config.model.base)), self_generated_needed(plan_of(config).setup, data)[GREEDY_TEXT]


def embedded_writer(config):
    from occamy_mtp.selfgen.store import EmbeddedWriter

    base = ckpt_io.load_base(config.model.base, dtype=torch.float32, device=torch.device("cpu"))
    return EmbeddedWriter(base, config.data.self_generate_batch_size)


def store_lines(store: Path) -> list[dict]:
    from occamy_mtp.selfgen.store import STORE_FILE

    return [json.loads(line) for line in (store / STORE_FILE).read_text().splitlines()]


@pytest.fixture(scope="module")
def written_store(run_models, tmp_path_factory):
    """A complete store of the base's continuations, and its config."""
    store = tmp_path_factory.mktemp("written-store") / "store"
    config = store_config(run_models, store)
    opened, needed = opened_store(config)
    opened.generate(embedded_writer(config), needed, log=lambda message: None)
    return config, store, len({w.input_ids[: w.answer_start] for w in needed})


def test_a_run_of_another_base_into_a_shared_store_is_refused_under_its_lock(run_models, tmp_path):
    from occamy_mtp.selfgen.store import SelfGenError

    store = tmp_path / "store"
    ours, theirs = store_config(run_models, store), store_config(run_models, store, base="donor")
    # Both open the empty store (the base loading takes minutes at real size); the other base writes first.
    ours_store, ours_needed = opened_store(ours)
    theirs_store, theirs_needed = opened_store(theirs)
    theirs_store.generate(embedded_writer(theirs), theirs_needed, log=lambda message: None)
    written = (store / "self-generated.jsonl").read_bytes()
    with pytest.raises(SelfGenError, match="written under other settings .*base_config_sha256"):
        ours_store.generate(embedded_writer(ours), ours_needed, log=lambda message: None)
    assert (store / "self-generated.jsonl").read_bytes() == written  # nothing of ours was added


def test_runs_of_the_same_settings_sharing_a_store_write_each_line_once(run_models, written_store, tmp_path):
    import threading

    from occamy_mtp.selfgen.store import LOCK_FILE

    config, reference, contexts = written_store
    store = tmp_path / "store"
    config = store_config(run_models, store)
    first, needed = opened_store(config)
    second, _ = opened_store(config)
    writer = embedded_writer(config)
    release, waiting, errors = threading.Event(), threading.Event(), []

    class HeldWriter:  # the first run holds the lock until the second is seen waiting
        source, details, describe, sampling = writer.source, writer.details, writer.describe, writer.sampling

        def answers(self, *args):
            assert release.wait(60)
            yield from writer.answers(*args)

    def run(store_, writer_, log):
        try:
            store_.generate(writer_, needed, log=log)
        except BaseException as err:  # reported in the main thread
            errors.append(err)

    one = threading.Thread(target=run, args=(first, HeldWriter(), lambda m: None))
    one.start()
    for _ in range(600):
        if (store / LOCK_FILE).exists():
            break
        threading.Event().wait(0.05)
    messages: list[str] = []

    def second_log(message):
        messages.append(message)
        if "being written by another run" in message:
            waiting.set()

    two = threading.Thread(target=run, args=(second, writer, second_log))
    two.start()
    assert waiting.wait(60), messages
    release.set()
    one.join(120), two.join(120)
    assert not errors, errors
    assert first.generated_now == contexts and second.generated_now == 0
    assert (store / "self-generated.jsonl").read_bytes() == (reference / "self-generated.jsonl").read_bytes()
    assert second.windows(needed) == first.windows(needed)


def _rewrite(store: Path, number: int, change) -> None:
    """Line `number` (1-based) of the store changed by `change(record)`."""
    from occamy_mtp.selfgen.store import STORE_FILE

    lines = (store / STORE_FILE).read_text().splitlines(keepends=True)
    record = json.loads(lines[number - 1])
    change(record)
    lines[number - 1] = json.dumps(record, separators=(",", ":")) + "\n"
    (store / STORE_FILE).write_text("".join(lines))


def _resealed(record: dict) -> None:
    from occamy_mtp.selfgen.store import line_digest

    record["line_sha256"] = line_digest(record["context_sha256"], record["tokens"], record["finished"])


@pytest.mark.parametrize("case, change, message", [
    ("changed", lambda r: r["tokens"].__setitem__(1, (r["tokens"][1] + 1) % 97),
     r"self-generated.jsonl:3: changed after it was written"),
    ("other-identity", lambda r: (r.__setitem__("store", "0123456789abcdef"), _resealed(r)),
     r"self-generated.jsonl:3: a line of another store .*its own data.self_generated_dir rather than removing"),
    ("beyond-vocab", lambda r: (r["tokens"].__setitem__(2, 10**6), _resealed(r)),
     r"self-generated.jsonl:3: token id 1000000 at position 2 is outside the base's vocabulary"),
    ("negative", lambda r: (r["tokens"].__setitem__(0, -1), _resealed(r)),
     r"self-generated.jsonl:3: token id -1 at position 0 is outside"),
    ("over-budget", lambda r: (r["tokens"].extend([5] * 40), _resealed(r)),
     r"self-generated.jsonl:3: \d+ tokens, over the budget of 24"),
    ("conflict", lambda r: None, r"self-generated.jsonl:\d+: context [0-9a-f]+ is stored before with another continuation"),
])
def test_store_lines_are_checked_when_read_naming_the_line(run_models, written_store, tmp_path, case, change, message):
    import shutil

    from occamy_mtp.selfgen.store import STORE_FILE, SelfGenError

    config, reference, _ = written_store
    store = tmp_path / "store"
    shutil.copytree(reference, store)
    if case == "conflict":  # a second line for the first context, with another (well-formed) continuation
        first = json.loads((store / STORE_FILE).read_text().splitlines()[0])
        first["tokens"] = [t + 1 for t in first["tokens"][:3]]
        first["finished"] = False
        _resealed(first)
        with open(store / STORE_FILE, "a") as handle:
            handle.write(json.dumps(first) + "\n")
    else:
        _rewrite(store, 3, change)
    with pytest.raises(SelfGenError, match=message):
        opened_store(store_config(run_models, store))


# ==================================================================================
# Readers and written JSON (issue 22, item 7)
# ==================================================================================
def test_written_json_is_standard_even_where_a_figure_is_not_finite(tmp_path):
    from occamy_mtp import files

    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    files.write_json(tmp_path / "report.json", {"data_nll": float("nan"), "steps": [1.5, float("inf"), -float("inf")],
                                                "nested": {"ok": 2.0, "pair": (float("nan"), 3)}})
    read = json.loads((tmp_path / "report.json").read_text(), parse_constant=refuse)
    assert read == {"data_nll": None, "steps": [1.5, None, None], "nested": {"ok": 2.0, "pair": [None, 3]}}


def test_a_donor_whose_head_sits_in_a_shard_the_index_does_not_list_is_named(tmp_path, sample_tokenizer_dir):
    """The donor's mtp.* tensors moved to a file of their own, the index not told: it said only 'no MTP head'."""
    from safetensors.torch import save_file

    donor = build_tiny_checkpoint(tmp_path / "donor", layout="fused", seed=1, tokenizer_dir=sample_tokenizer_dir).path
    index = json.loads((donor / ckpt_io.INDEX_NAME).read_text())
    head_keys = sorted(k for k in index["weight_map"] if k.startswith(ckpt_io.HEAD_PREFIX))
    assert head_keys
    moved = {}
    for shard in sorted({index["weight_map"][k] for k in head_keys}):
        tensors = load_file(donor / shard)
        moved.update({k: tensors.pop(k) for k in head_keys if k in tensors})
        save_file(tensors, donor / shard, metadata={"format": "pt"})
    save_file(moved, donor / "mtp.safetensors", metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in moved}
    (donor / ckpt_io.INDEX_NAME).write_text(json.dumps(index))
    text_config = ckpt_io.read_config(donor).text_config
    with pytest.raises(ckpt_io.CheckpointError, match=rf"no mtp\.\* tensors among the \d+ tensors that "
                                                      rf"model.safetensors.index.json maps, in .*But mtp.safetensors "
                                                      rf"\({len(head_keys)} mtp\.\* tensors\) in the same directory is not "
                                                      "listed in model.safetensors.index.json"):
        ckpt_io.load_head(donor, text_config)
    head, _ = ckpt_io.load_head(donor / "mtp.safetensors", text_config)  # the file itself, as the message says
    assert sum(p.numel() for p in head.parameters()) > 0


# ==================================================================================
# Prompt sets: records without answers, when the base writes the answers (issue 21)
# ==================================================================================
def prompt_records(count: int) -> list[dict]:
    """The sample conversations cut before their first answer, in the three shapes a prompt set comes in."""
    records = []
    for index, line in enumerate(SAMPLE_DATA_PATH.read_text().splitlines()[:count]):
        conversation = reader.normalise_record(json.loads(line), "sample")
        user = next(m.content for m in conversation.messages if m.role == "user")
        shape = index % 3
        if shape == 0:
            records.append({"messages": [{"role": "user", "content": user}]})
        elif shape == 1:
            records.append({"prompt": user})
        else:
            records.append({"conversations": [{"from": "human", "value": user}]})
    return records


def test_prompt_records_make_windows_only_when_the_base_writes_the_answers(tmp_path, sample_tokenizer):
    path = write_jsonl(tmp_path / "prompts.jsonl", prompt_records(12) + [chat("What is 2 + 2?", "4.")])
    settings = dict(context_tokens=32, answer_tokens=16, train_conversations=20, heldout_conversations=10)  # room for all
    refused = prepare.prepare_windows([path], sample_tokenizer, **settings)
    assert refused.excluded == {reader.NO_ASSISTANT_TURN: 12} and refused.conversations_kept == 1
    assert "usable when the base writes the answers" in refused.excluded_examples[reader.NO_ASSISTANT_TURN][0]
    taken = prepare.prepare_windows([path], sample_tokenizer, prompts=True, **settings)
    assert taken.conversations_kept == 13 and not taken.excluded
    windows = taken.train + taken.heldout
    assert sum(not w.has_answer for w in windows) == 12 == sum(taken.summary()["prompt_windows"].values())
    for window in windows:
        if not window.has_answer:  # the context is the rendered prompt, ending with the generation prompt
            whole = sample_tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                                         add_generation_prompt=True, enable_thinking=False)
            assert sample_tokenizer.decode(window.input_ids).endswith(whole[whole.index("x") + 1:])
            assert window.answer_start == len(window.input_ids) <= 32


def test_a_run_on_prompts_alone_trains_and_exports_with_the_teacher_forced_figures_absent(run_models, tmp_path, capsys):
    from occamy_mtp import record as rec
    from occamy_mtp.config import ConfigError
    from occamy_mtp.evaluation.evaluate import evaluate_run
    from occamy_mtp.export.exporter import export, format_metrics
    from occamy_mtp.train.loop import train

    path = write_jsonl(tmp_path / "prompts.jsonl", prompt_records(30))
    config = run_config(run_models, tmp_path / "run", f"data.files=[{path}]")
    summary = train(plan_of(config))
    assert summary["steps"] > 0
    record = export(plan_of(config), allow_worse=True, log=lambda m: None)
    assert not rec.validate_record(record)
    windows = record["dataset"]["windows"]
    assert windows["prompts"] == {side: windows[side] for side in ("train", "validation", "heldout")}  # every one
    assert windows["heldout"] == 2 and windows["train"] > 0
    for head in ("donor", "trained"):
        assert record["metrics"]["heldout"][head]["teacher_forced"] is None
        assert all(by_serving["served"]["1"]["contexts"] == 2 for by_serving in record["metrics"]["heldout"][head]["serving"].values())
    assert "absent" in format_metrics(record["metrics"])
    with pytest.raises(ConfigError, match="the data are prompts"):
        evaluate_run(plan_of(config), tmp_path / "run" / "mtp-trained.safetensors", tmp_path / "eval", torch.device("cpu"),
                     teacher_forced_only=True)


def test_export_s_decoder_checks_on_the_static_runners_equal_those_on_transformers_cache(run_models, tmp_path, monkeypatch):
    """Export's decoder checks through one pair of static runners (as on a GPU: the base's spans
    kept after a rejection, the head's static buffers, the trained tensors copied into the head
    in place) give the counts and decisions of the checks on transformers' cache, for both heads."""
    import dataclasses

    from occamy_mtp.evaluation import decode
    from occamy_mtp.export.exporter import export
    from occamy_mtp.train.loop import train

    config = run_config(run_models, tmp_path / "run", "eval.decoder_check_windows=2")
    train(plan_of(config))
    checks = []
    for static in (False, True):
        if static:
            monkeypatch.setattr(decode, "static_decoding", lambda base: True)
            monkeypatch.setattr(decode, "static_head_decoding", lambda head: True)
        output = tmp_path / f"export-{static}"
        shutil.copytree(tmp_path / "run", output)
        record = export(plan_of(dataclasses.replace(config, output=dataclasses.replace(config.output, dir=str(output)))), allow_worse=True,
                        log=lambda m: None)
        checks.append(json.loads((output / "metrics.json").read_text())["decoder_check"])
        assert record["outputs"]
    for head in ("donor", "trained"):
        for k in ("1", "2"):
            got, want = checks[1][head][k], checks[0][head][k]
            assert got["counts_equal"] and want["counts_equal"], (head, k)
            for field in ("measured", "replayed", "decisions", "decisions_equal", "texts_equal_to_store"):
                assert got[field] == want[field], (head, k, field)
    assert checks[0]["donor"]["1"]["measured"] != checks[0]["trained"]["1"]["measured"]  # the trained head was checked, not the donor twice
