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


def test_self_generation_says_how_many_stores_and_continuations_are_ahead():
    """Several stores to write: one line with the totals first, then each store's place among them."""
    from occamy_mtp.run import write_missing
    from occamy_mtp.sampling import GREEDY_TEXT, TextSampling

    class Store:
        def __init__(self, lacking):
            self.lacking, self.written = lacking, 0

        def missing(self, windows):
            return windows[: self.lacking]

        def generate(self, writer, windows, log):
            self.written = len(self.missing(windows))

    class Writer:
        shares_batches = False

        def for_text(self, sampling):
            return sampling

    sampled = [TextSampling(0.7, 0.8, 0, seed) for seed in range(2)]
    stores = {GREEDY_TEXT: Store(3), sampled[0]: Store(0), sampled[1]: Store(5)}
    lines = []
    write_missing(stores, {text: list(range(6)) for text in stores}, Writer(), log=lines.append)
    assert lines[0].startswith("self-generated windows: 8 continuations to write into 2 stores")
    assert lines[1:] == ["self-generated windows: store 1 of 2 (0 of 8 continuations written)",
                         "self-generated windows: store 2 of 2 (3 of 8 continuations written)"]
    assert [s.written for s in stores.values()] == [3, 0, 5]
    lines.clear()
    write_missing({GREEDY_TEXT: Store(2)}, {GREEDY_TEXT: [0, 1]}, Writer(), log=lines.append)
    assert lines == []  # one store: its own lines say it all
