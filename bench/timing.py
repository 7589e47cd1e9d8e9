"""What the benches time with: a wait for the device's queued work before the clock is read.

    from timing import sync   # the bench's own directory is first on sys.path
"""

from __future__ import annotations

import torch


def sync(device: torch.device) -> None:
    """Wait for the work queued on `device` (a CUDA card; nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
