"""One command-line convention: every command that works on a run takes `--config RUN.yaml`
plus `section.key=value` overrides through the config loader, and a library error is one
`error:` line on stderr with exit status 2."""

from __future__ import annotations

import importlib

import pytest

# command module -> the flags it cannot run without (besides the config)
COMMANDS = {
    "occamy_mtp.train.loop": [],
    "occamy_mtp.export.exporter": [],
    "occamy_mtp.cache": [],
    "occamy_mtp.evaluation.evaluate": ["--out", "unused"],
    "occamy_mtp.data.windows": [],
    "occamy_mtp.serve.validate": ["--reference", "http://127.0.0.1:9", "--out", "unused"],
}


@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_every_command_reads_its_settings_through_the_config_loader(module, tmp_path, capsys):
    main = importlib.import_module(module).main
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  lr: 1.0e-3\n")
    # an unknown key fails with its dotted path, from the file and from an override alike
    assert main(["--config", str(config), "train.learning_rate=1", *COMMANDS[module]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: unknown config key train.learning_rate (known keys: " + err[0].split("(known keys: ")[1]]
    config.write_text("train:\n  lr: -1\n")
    assert main(["--config", str(config), *COMMANDS[module]]) == 2
    assert capsys.readouterr().err.strip() == "error: train.lr: expected a finite number > 0, got -1.0"


def _failure_paths(tmp_path):
    """(command module, argv, what the error line must say) for the failures a user meets first."""
    missing = tmp_path / "no-such-checkpoint"
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  base: {missing}\n  donor_head: {missing}\ndata:\n  files: [{tmp_path / 'chats.jsonl'}]\n"
                      f"output:\n  dir: {tmp_path / 'run'}\n")
    uncached = tmp_path / "uncached.yaml"
    uncached.write_text("model:\n  base: occamy-test/never-downloaded\n")
    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    return [
        ("occamy_mtp.train.loop", ["--config", str(config)], str(missing)),
        ("occamy_mtp.export.exporter", ["--config", str(config)], str(missing)),
        ("occamy_mtp.cache", ["--config", str(config), "--dir", str(tmp_path / "cache")], str(missing)),
        ("occamy_mtp.cache", ["--config", str(config)], "data.target_cache: no cache directory configured"),
        ("occamy_mtp.evaluation.evaluate", ["--config", str(config), "--out", str(tmp_path / "e")],
         "mtp-trained.safetensors: no such file or directory (export the run first"),
        ("occamy_mtp.evaluation.evaluate", ["--config", str(config), "--head", str(config), "--out", str(tmp_path / "e")],
         str(missing)),
        ("occamy_mtp.data.windows", ["--config", str(config)], str(missing)),
        ("occamy_mtp.train.loop", ["--config", str(uncached)], "model.base: occamy-test/never-downloaded is not a local path"),
        ("occamy_mtp.export.assemble", ["--base", str(missing), "--head", str(missing), "--out", str(tmp_path / "a")],
         str(missing)),
        ("occamy_mtp.serve.reference_server", ["--base", str(missing), "--port", "0"], str(missing)),
    ]


@pytest.mark.parametrize("case", range(10))
def test_a_known_failure_is_one_error_line_never_a_traceback(case, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # nothing is reached for
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    module, argv, named = _failure_paths(tmp_path)[case]
    assert importlib.import_module(module).main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and named in err[-1], err
    assert not any("Traceback" in line for line in err)
