"""The derived rounding bounds of `occamy_mtp.testing.numerics` pass correct float32
arithmetic and still fail a real error.

The real errors here are small ones: one weight of fc off by 1% of fc's largest entry
(a single mis-loaded element), and the chain's step-2 tokens fed one anchor late (an
alignment slip, docs/reference/CONTRACT.md section 2). Both move the outputs and gradients by
far more than rounding does, and the bounds must say so.
"""

from __future__ import annotations

import pytest
import torch

from occamy_mtp.model.head import set_trainable
from occamy_mtp.testing.numerics import assert_close, rounding_bound, worst_difference
from test_head import (
    BACKWARD_REDUCTIONS,
    FORWARD_REDUCTIONS,
    STEPS,
    default_positions,
    qwen3_5_fp32,  # noqa: F401  (fixture)
    reduction_width,
    reference_chain,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def test_the_bound_scales_with_the_compared_values():
    small, large = torch.full((4,), 2.0), torch.full((4,), 64.0)
    assert rounding_bound(large, torch.float32, reductions=1, width=1) == 32 * rounding_bound(small, torch.float32, reductions=1, width=1)
    assert rounding_bound(small, torch.bfloat16, reductions=1, width=1) > rounding_bound(small, torch.float32, reductions=1, width=1)
    with pytest.raises(ValueError, match="reductions"):
        rounding_bound(small, torch.float32, reductions=0, width=4)


def test_the_message_names_the_worst_element():
    expected = torch.zeros(2, 3)
    actual = expected.clone()
    actual[1, 2] = 0.5
    actual[0, 0] = 0.25
    assert worst_difference(actual, expected)[:2] == (0.5, (1, 2))
    with pytest.raises(AssertionError, match=r"worst \|difference\| 0.5 at index \[1, 2\] \(got 0.5, expected 0\)"):
        assert_close(actual, expected, 0.1, "demo")
    actual[0, 1] = float("nan")
    with pytest.raises(AssertionError, match=r"inf at index \[0, 1\]"):
        assert_close(actual, expected, 0.1, "demo")


def _perturbed_fc(models):
    head = models.head("sdpa")
    with torch.no_grad():
        head.fc.weight[3, 5] += 0.01 * head.fc.weight.abs().max()
    return head


def test_a_perturbed_head_fails_the_forward_bound(qwen3_5_fp32):  # noqa: F811
    models = qwen3_5_fp32
    step_tokens, hidden = models.inputs([0, 1], length=5)
    positions, segments = default_positions(2, 5)
    want = reference_chain(models.state, models.shared.embed_tokens.weight, models.text_config,
                           step_tokens, hidden, positions, segments)
    bound = rounding_bound(want, torch.float32, reductions=FORWARD_REDUCTIONS, width=reduction_width(models.text_config))
    with torch.no_grad():
        assert_close(models.head("sdpa")(step_tokens, hidden), want, bound, "correct head")
        with pytest.raises(AssertionError, match="perturbed fc"):
            assert_close(_perturbed_fc(models)(step_tokens, hidden), want, bound, "perturbed fc")
        late = step_tokens.clone()
        late[1] = step_tokens[1].roll(1, dims=-1)
        with pytest.raises(AssertionError, match="late step-2 tokens"):
            assert_close(models.head("sdpa")(late, hidden), want, bound, "late step-2 tokens")


def test_a_perturbed_head_fails_the_gradient_bound(qwen3_5_fp32):  # noqa: F811
    models = qwen3_5_fp32
    step_tokens, hidden = models.inputs([0, 1], length=5)
    positions, segments = default_positions(2, 5)
    weights = torch.randn(STEPS, 2, 5, models.text_config.hidden_size, generator=torch.Generator().manual_seed(5))
    reference_head = models.head("sdpa")
    set_trainable(reference_head)
    params = dict(reference_head.named_parameters())
    want_out = reference_chain(params, models.shared.embed_tokens.weight, models.text_config,
                               step_tokens, hidden, positions, segments)
    (want,) = torch.autograd.grad((want_out * weights).sum(), [reference_head.pre_fc_norm_hidden.weight])
    bound = rounding_bound(want, torch.float32, reductions=BACKWARD_REDUCTIONS, width=reduction_width(models.text_config))
    for head, name in ((models.head("sdpa"), "correct head"), (_perturbed_fc(models), "perturbed fc")):
        set_trainable(head)
        (got,) = torch.autograd.grad((head(step_tokens, hidden) * weights).sum(), [head.pre_fc_norm_hidden.weight])
        if name == "correct head":
            assert_close(got, want, bound, name)
        else:
            with pytest.raises(AssertionError, match="perturbed fc"):
                assert_close(got, want, bound, name)
