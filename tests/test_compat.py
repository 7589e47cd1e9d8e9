"""The shims over transformers versions (occamy_mtp.compat)."""

from __future__ import annotations

import functools

import pytest
import torch

from occamy_mtp.compat import torch_function


def plain(x):
    return x + 1


def test_torch_function_sees_through_a_functools_wrapper():
    @functools.wraps(plain)
    def dispatch(*args, **kwargs):
        raise AssertionError("the dispatcher must not be returned")

    assert torch_function(dispatch) is plain


def test_torch_function_sees_through_a_module_wrapper():
    """The form of transformers 5.25 with `kernels`: a module whose forward calls a dispatcher."""

    @functools.wraps(plain)
    def dispatch(*args, **kwargs):
        raise AssertionError("the dispatcher must not be returned")

    def module_for(func):
        class Func(torch.nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)

        return Func()

    assert torch_function(module_for(dispatch)) is plain
    assert torch_function(plain) is plain


def test_torch_function_refuses_what_it_cannot_unwrap():
    with pytest.raises(TypeError, match="cannot find the PyTorch function"):
        torch_function(torch.nn.Linear(2, 2))


def test_torch_function_of_the_installed_transformers():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

    for name in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule"):
        fn = torch_function(getattr(qwen, name))
        assert fn.__module__ == qwen.__name__ and not hasattr(fn, "__wrapped__"), name
