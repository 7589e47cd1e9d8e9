"""Differences between the transformers versions the library runs on (5.17 on GPU images, 5.24 and 5.25 here)."""

from __future__ import annotations

import inspect


def cache_kwarg(forward) -> str:
    """The keyword a transformers forward takes its cache under.

    transformers 5.2x renamed `past_key_values` to `cache`; 5.17 (still common on GPU
    images) has the old name. `forward` is a function or bound method (decorators that
    keep `__wrapped__` are seen through).
    """
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def torch_function(fn):
    """The plain PyTorch function under transformers' kernel-dispatch wrappers.

    transformers decorates its Gated DeltaNet functions (`causal_conv1d_fn`,
    `torch_chunk_gated_delta_rule`) so that a call may go to fla, causal-conv1d or a Hub
    kernel. Up to 5.24 the decorated name is a function whose `__wrapped__` is the PyTorch
    one; from 5.25, which requires the `kernels` package, it is an `nn.Module` whose
    `forward` calls that function. Both are seen through here; anything else is an error
    rather than a silent call into another implementation.
    """
    seen = fn
    for _ in range(8):
        if hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
            continue
        forward = getattr(type(fn), "forward", None)
        inner = inspect.getclosurevars(forward).nonlocals.get("func") if callable(forward) else None
        if inner is None:
            break
        fn = inner
    if not inspect.isfunction(fn):
        raise TypeError(f"cannot find the PyTorch function under {seen!r} (transformers' kernel wrapper changed?)")
    return fn
