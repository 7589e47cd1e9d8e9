"""One command-line convention: every command that works on a run takes `--config RUN.yaml`
plus `section.key=value` overrides through the config loader, and a library error is one
`error:` line on stderr with exit status 2."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from occamy_mtp.__main__ import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent

# command -> the flags it cannot run without (besides the config)
RUN_COMMANDS = {
    "train": [],
    "export": [],
    "cache": [],
    "evaluate": ["--out", "unused"],
    "data": [],
    "generate": ["--out", "unused"],
    "validate": ["--reference", "http://127.0.0.1:9", "--out", "unused"],
}


@pytest.mark.parametrize("command", sorted(RUN_COMMANDS))
def test_every_command_reads_its_settings_through_the_config_loader(command, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  lr: 1.0e-3\n")
    # an unknown key fails with its dotted path, from the file and from an override alike
    assert main([command, "--config", str(config), "train.learning_rate=1", *RUN_COMMANDS[command]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: unknown config key train.learning_rate (known keys: " + err[0].split("(known keys: ")[1]]
    config.write_text("train:\n  lr: -1\n")
    assert main([command, "--config", str(config), *RUN_COMMANDS[command]]) == 2
    assert capsys.readouterr().err.strip() == "error: train.lr: expected a finite number > 0, got -1.0"


def test_the_dispatcher_names_its_commands_and_refuses_an_unknown_one(capsys):
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in COMMANDS)
    assert main(["trian"]) == 2
    assert capsys.readouterr().err.strip() == f"error: unknown command 'trian'; expected one of {', '.join(COMMANDS)}"
    assert main([]) == 2 and "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_names_itself_as_the_dispatcher_runs_it(command, capsys):
    with pytest.raises(SystemExit) as stopped:
        main([command, "--help"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m occamy_mtp {command} ")


@pytest.mark.parametrize("script", ["train.py", "export.py", "assemble_head.py"])
def test_the_top_level_scripts_name_themselves(script, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    assert stopped.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {script} ")


def _failure_paths(tmp_path):
    """(command, argv, what the error line must say) for the failures a user meets first."""
    missing = tmp_path / "no-such-checkpoint"
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  base: {missing}\n  donor_head: {missing}\ndata:\n  files: [{tmp_path / 'chats.jsonl'}]\n"
                      f"output:\n  dir: {tmp_path / 'run'}\n")
    uncached = tmp_path / "uncached.yaml"
    uncached.write_text("model:\n  base: occamy-test/never-downloaded\n")
    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    return [
        ("train", ["--config", str(config)], f"model.base: {missing}: no such directory"),
        ("export", ["--config", str(config)], f"model.base: {missing}: no such directory"),
        ("cache", ["--config", str(config), "--dir", str(tmp_path / "cache")], str(missing)),
        ("cache", ["--config", str(config)], "data.target_cache: no cache directory configured"),
        ("evaluate", ["--config", str(config), "--out", str(tmp_path / "e")],
         "mtp-trained.safetensors: no such file or directory (export the run first"),
        ("evaluate", ["--config", str(config), "--head", str(config), "--out", str(tmp_path / "e")],
         str(missing)),
        ("data", ["--config", str(config)], str(missing)),
        ("train", ["--config", str(uncached)], "model.base: occamy-test/never-downloaded is not a local path"),
        ("assemble", ["--base", str(missing), "--head", str(missing), "--out", str(tmp_path / "a")],
         str(missing)),
        ("serve-reference", ["--base", str(missing), "--port", "0"], str(missing)),
        ("generate", ["--config", str(config), "--out", str(tmp_path / "g.jsonl")], str(missing)),
    ]


@pytest.mark.parametrize("case", range(11))
def test_a_known_failure_is_one_error_line_never_a_traceback(case, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # nothing is reached for
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    command, argv, named = _failure_paths(tmp_path)[case]
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and named in err[-1], err
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("command, argv", [
    ("train", []), ("export", []), ("cache", ["--dir", "unused-cache"]), ("evaluate", ["--head", "head.safetensors", "--out", "unused"]),
])
def test_a_shipped_config_run_as_it_is_names_the_paths_still_to_give(command, argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing is written beside the shipped configs
    (tmp_path / "head.safetensors").write_bytes(b"")
    assert main([command, "--config", str(ROOT / "configs" / "512step.yaml"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    needed = ["model.base ('REPLACE_ME/occamy-base')", "data.files (['REPLACE_ME/chats.jsonl'])"]
    if command in ("train", "export"):
        needed.append("model.donor_head ('REPLACE_ME/donor')")
    assert len(err) == 1 and err[0].startswith("error: ") and "still the placeholder REPLACE_ME" in err[0], err
    assert all(option in err[0] for option in needed), err
