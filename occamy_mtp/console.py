"""What a run prints while it works: progress bars on a terminal, periodic lines in a log file, and
one note, not one a function, when the Gated DeltaNet kernels fall back to PyTorch."""

from __future__ import annotations

import logging
import sys
import time

FLA_INSTALL_HINT = "pip install flash-linear-attention fla-core"
_FALLBACK = "falling back to its reference PyTorch implementation"
LINES_PER_RUN = 8  # a progress shown as lines (not a terminal) says where it is about this many times


class _KernelFallbacks(logging.Filter):
    """transformers warns once per function (four of them, in every process) that a Gated DeltaNet
    kernel runs its PyTorch reference. On a machine without CUDA that is the only way, so nothing
    is said; with CUDA it is said once, with the cost and the fix."""

    def __init__(self):
        super().__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if _FALLBACK not in record.getMessage():
            return True
        import torch

        if self.said or not torch.cuda.is_available():
            return False
        self.said = True
        record.msg, record.args = (
            "the fla kernels of the Gated DeltaNet layers are not installed: models on the GPU run transformers' "
            f"PyTorch reference instead, correct but several times slower; install them with: {FLA_INSTALL_HINT}"), ()
        return True


_fallbacks = _KernelFallbacks()


def quiet_kernel_fallbacks() -> None:
    """Install the filter on the loggers transformers warns through (idempotent)."""
    for name in ("transformers.integrations.hub_kernels", "transformers"):
        logger = logging.getLogger(name)
        if _fallbacks not in logger.filters:
            logger.addFilter(_fallbacks)
        for handler in logger.handlers:
            if _fallbacks not in handler.filters:
                handler.addFilter(_fallbacks)


def plural(count: int, noun: str) -> str:
    """`noun` as it goes with `count`: 1 prompt, 2 prompts (the nouns here take an s)."""
    return noun if count == 1 else noun + "s"


class Progress:
    """A tqdm bar on a terminal; elsewhere (a log file, CI) a line every `every` steps (by default
    `total / LINES_PER_RUN`), and at the last."""

    def __init__(self, total: int, desc: str, unit: str, initial: int = 0, enabled: bool = True, every: int | None = None):
        self.total, self.desc, self.unit, self.done, self.initial = total, desc, unit, initial, initial
        self.enabled, self.postfix = enabled, ""
        self.every = every or max(1, total // LINES_PER_RUN)
        self.started = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr)

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())
        if self.bar is not None:
            self.bar.set_postfix(**values)

    def update(self, steps: int = 1) -> None:
        self.done += steps
        if self.bar is not None:
            self.bar.update(steps)
        elif self.enabled and (self.done % self.every == 0 or self.done == self.total):
            rate = (self.done - self.initial) / max(time.perf_counter() - self.started, 1e-9)  # this process's steps
            print(f"{self.desc}: {self.done}/{self.total} {plural(self.total, self.unit)} ({rate:.1f}/s)"
                  + (f", {self.postfix}" if self.postfix else ""), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
