"""Differences between the transformers versions the library runs on (5.17 on GPU images, 5.24 and 5.25 here)."""

from __future__ import annotations

import functools
import inspect
import types


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


# transformers' Gated DeltaNet kernel entry points, as its modeling modules name them.
GATED_DELTANET_KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                          "causal_conv1d_update", "causal_conv1d_forward")
_ROUTED = "_occamy_routed_by_device"


def plain_forward(forward):
    """`forward` (a Gated DeltaNet's, under any decorators) with every kernel entry point it calls
    bound to its plain PyTorch function: the same code, run against a copy of its module's
    globals in which those names are swapped (nothing global changes)."""
    inner = forward
    while hasattr(inner, "__wrapped__"):
        inner = inner.__wrapped__
    names = {name for name in inner.__code__.co_names if name in GATED_DELTANET_KERNELS and name in inner.__globals__}
    swapped = {name: torch_function(inner.__globals__[name]) for name in names}
    plain = types.FunctionType(inner.__code__, {**inner.__globals__, **swapped}, inner.__name__, inner.__defaults__,
                               inner.__closure__)
    plain.__kwdefaults__ = inner.__kwdefaults__
    return plain


def route_kernels_by_device(classes=None) -> None:
    """Run a Gated DeltaNet on the kernels of the device its input is on (idempotent).

    transformers before 5.25 (5.17 on GPU images) sends every Gated DeltaNet call to fla
    when fla imports, whatever the device: with CUDA visible, a model on the CPU then
    fails inside fla's Triton kernels. After this, a call on CPU tensors runs the layer's
    own code with the plain PyTorch kernels (`plain_forward`), and a call on any other
    device runs the forward as transformers defines it (fla where it is installed).
    `classes` defaults to every family's Gated DeltaNet (`families`).
    """
    if classes is None:
        from occamy_mtp.families import FAMILIES

        classes = tuple(family.cls("gated_deltanet") for family in FAMILIES.values())
    for cls in classes:
        if getattr(cls.forward, _ROUTED, False):
            continue
        original, plain = cls.forward, plain_forward(cls.forward)

        @functools.wraps(original)
        def forward(self, hidden_states, *args, _original=original, _plain=plain, **kwargs):
            run = _plain if hidden_states.device.type == "cpu" else _original
            return run(self, hidden_states, *args, **kwargs)

        setattr(forward, _ROUTED, True)
        cls.forward = forward
