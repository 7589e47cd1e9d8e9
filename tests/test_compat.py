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


# ---------------------------------------------------------------- kernels by device (issue 21)


def _kernel_world():
    """A module like transformers' modeling files: a layer whose forward calls a dispatch-wrapped
    kernel by its global name; the wrapper stands for fla, which refuses CPU tensors."""
    import functools
    import types

    module = types.ModuleType("fake_modeling")
    exec(
        "def torch_chunk_gated_delta_rule(x):\n"
        "    return x * 2\n"
        "class Layer:\n"
        "    def forward(self, hidden_states, scale=1):\n"
        "        return torch_chunk_gated_delta_rule(hidden_states) * scale\n",
        module.__dict__,
    )
    plain = module.torch_chunk_gated_delta_rule

    @functools.wraps(plain)
    def fla_like(x):
        if x.device.type == "cpu":
            raise RuntimeError("a Triton kernel was given CPU tensors")
        return plain(x)

    module.torch_chunk_gated_delta_rule = fla_like
    return module


def test_a_layer_on_cpu_runs_the_plain_kernels_and_elsewhere_the_installed_ones():
    from occamy_mtp.compat import route_kernels_by_device

    module = _kernel_world()
    layer = module.Layer()
    with pytest.raises(RuntimeError, match="CPU tensors"):  # what 5.17 with fla does to a CPU model
        layer.forward(torch.ones(2))
    route_kernels_by_device([module.Layer])
    route_kernels_by_device([module.Layer])  # idempotent
    assert torch.equal(layer.forward(torch.ones(2), scale=3), torch.full((2,), 6.0))
    with pytest.raises(RuntimeError, match="CPU tensors"):  # the global itself is untouched
        module.torch_chunk_gated_delta_rule(torch.ones(2))
    meta = layer.forward(torch.ones(2, device="meta"))  # another device: the installed kernel
    assert meta.device.type == "meta"


def test_the_routed_gated_deltanet_equals_the_plain_reference_on_cpu():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

    from occamy_mtp.compat import plain_forward
    from occamy_mtp.model import checkpoint as ckpt_io
    from occamy_mtp.testing.checkpoints import tiny_text_config

    config = tiny_text_config()
    ckpt_io.base_model_class(config)  # routes the class
    torch.manual_seed(0)
    layer_index = config.layer_types.index("linear_attention")
    layer = qwen.Qwen3_5MoeGatedDeltaNet(config, layer_index).float()
    hidden = torch.randn(2, 7, config.hidden_size)
    routed = layer(hidden)
    reference = plain_forward(qwen.Qwen3_5MoeGatedDeltaNet.forward)(layer, hidden)
    assert torch.equal(routed, reference)
