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
