"""What the benches time with: a wait for the device's queued work before the clock is read.

    from timing import seconds_of, sync   # the bench's own directory is first on sys.path
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    """Wait for the work queued on `device` (a CUDA card; nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_of(run: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Wall seconds of each of `repeats` calls of `run`, the device's queue drained before and after each."""
    seconds = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        run()
        sync(device)
        seconds.append(time.perf_counter() - started)
    return seconds
