"""Differences between the transformers versions the library runs on (5.17 on GPU images, 5.2x here)."""

from __future__ import annotations

import inspect


def cache_kwarg(forward) -> str:
    """The keyword a transformers forward takes its cache under.

    transformers 5.2x renamed `past_key_values` to `cache`; 5.17 (still common on GPU
    images) has the old name. `forward` is a function or bound method (decorators that
    keep `__wrapped__` are seen through).
    """
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
