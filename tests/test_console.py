"""What a run prints: periodic progress lines where stderr is not a terminal, and transformers'
kernel fallback warnings kept to one note (none without CUDA, where PyTorch is the only way)."""

from __future__ import annotations

import logging

import torch

from occamy_mtp import console


def test_progress_in_a_log_file_is_a_few_lines(capsys):
    progress = console.Progress(512, "train", "step")
    for _ in range(512):
        progress.set_postfix(loss="0.5")
        progress.update()
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == console.LINES_PER_RUN and "\r" not in "".join(lines)
    assert lines[-1].startswith("train: 512/512 steps (") and lines[-1].endswith(", loss 0.5")
    quiet = console.Progress(10, "train", "step", enabled=False)
    quiet.update(10)
    assert capsys.readouterr().err == ""


def fallback_records(monkeypatch, cuda: bool) -> list[str]:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(console, "_fallbacks", console._KernelFallbacks())
    logger = logging.getLogger("transformers.integrations.hub_kernels")
    monkeypatch.setattr(logger, "filters", [])
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        console.quiet_kernel_fallbacks()
        for name in ("causal_conv1d_fn", "chunk_gated_delta_rule", "causal_conv1d_update"):
            logger.warning("`%s` is falling back to its reference PyTorch implementation because ...", name)
        logger.warning("something else")
    finally:
        logger.removeHandler(handler)
    return seen


def test_kernel_fallbacks_are_one_note_with_cuda_and_none_without(monkeypatch):
    with_cuda = fallback_records(monkeypatch, cuda=True)
    assert len(with_cuda) == 2 and console.FLA_INSTALL_HINT in with_cuda[0] and with_cuda[1] == "something else"
    assert fallback_records(monkeypatch, cuda=False) == ["something else"]
