"""The in-place recurrent step of the decode (`occamy_mtp.selfgen.decode_kernels`) against transformers'
recurrent gated delta rule, and the Triton kernel (under Triton's interpreter on a CPU)
against its PyTorch reference: outputs and the updated state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from occamy_mtp.selfgen import decode_kernels
from occamy_mtp.compat import torch_function
from occamy_mtp.testing.numerics import assert_close, rounding_bound

BATCH, HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 3, 2, 4, 16, 24  # value heads in groups of 2; V not a power of two
# float32; the rule reduces over the key dim (L2 norms, state . k, state . q) a few times in series.
REDUCTIONS = 4
TESTS = Path(__file__).resolve().parent


def case(seed: int = 0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q, k = randn(BATCH, HEADS, KEY_DIM).to(dtype), randn(BATCH, HEADS, KEY_DIM).to(dtype)
    v = randn(BATCH, VALUE_HEADS, VALUE_DIM).to(dtype)
    g = -torch.rand(BATCH, VALUE_HEADS, generator=generator)  # log decay <= 0
    beta = torch.rand(BATCH, VALUE_HEADS, generator=generator).to(dtype)
    state = randn(BATCH, VALUE_HEADS, KEY_DIM, VALUE_DIM) * 0.1
    return q, k, v, g, beta, state


def transformers_rule(q, k, v, g, beta, state):
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

    rule = torch_function(qwen.torch_recurrent_gated_delta_rule)
    groups = VALUE_HEADS // HEADS
    q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    out, final = rule(q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], initial_state=state.clone(),
                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[:, 0], final


def test_the_reference_is_transformers_rule():
    q, k, v, g, beta, state = case()
    want_out, want_state = transformers_rule(q, k, v, g, beta, state)
    got_state = state.clone()
    got_out = decode_kernels.recurrent_step_reference(q, k, v, g, beta, got_state)
    for got, want, what in ((got_out, want_out, "output"), (got_state, want_state, "state")):
        assert_close(got, want, rounding_bound(want, torch.float32, reductions=REDUCTIONS, width=KEY_DIM), what)
    assert not torch.equal(got_state, state)  # it was updated in place


def compare_kernel_with_reference(dtype) -> None:
    """Run in a process started with TRITON_INTERPRET=1 (the kernel's reductions are jitted library
    functions, which Triton interprets only when the variable is set before it is imported)."""
    q, k, v, g, beta, state = case(seed=1, dtype=dtype)
    want_state = state.clone()
    want = decode_kernels.recurrent_step_reference(q, k, v, g, beta, want_state)
    got_state = state.clone()
    assert decode_kernels.available(got_state)
    got = decode_kernels.recurrent_step_(q, k, v, g, beta, got_state)
    assert got.dtype == dtype
    # The state is float32 either way; the output is rounded once to the input dtype.
    assert_close(got_state, want_state, rounding_bound(want_state, torch.float32, reductions=REDUCTIONS, width=KEY_DIM), "state")
    bound = rounding_bound(want.float(), dtype, reductions=1, width=1) + rounding_bound(want.float(), torch.float32,
                                                                                        reductions=REDUCTIONS, width=KEY_DIM)
    assert_close(got.float(), want.float(), bound, "output")
    for bad in (state.double(), state.transpose(-1, -2)):
        try:
            decode_kernels.recurrent_step_(q, k, v, g, beta, bad)
        except ValueError as err:
            assert "contiguous float32" in str(err)
        else:
            raise AssertionError("a state the kernel cannot update was taken")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernel_is_the_reference_under_triton_s_interpreter(dtype):
    pytest.importorskip("triton")
    script = f"import torch, test_decode_kernels as t; t.compare_kernel_with_reference(torch.{dtype}); print('ok')"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent)]))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
