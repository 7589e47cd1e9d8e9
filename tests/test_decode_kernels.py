"""The decode step's Gated DeltaNet kernels (`occamy_mtp.base.decode_kernels`): each PyTorch
reference against transformers' own function (its recurrent gated delta rule, its causal-conv
update), and each Triton kernel (under Triton's interpreter on a CPU) against its reference:
outputs and the states updated in place, one token and a span of several."""

from __future__ import annotations

import pytest
import torch

from occamy_mtp.base import decode_kernels
from occamy_mtp.compat import torch_function
from occamy_mtp.testing.interpreter import run_interpreted
from occamy_mtp.testing.numerics import assert_close, rounding_bound

BATCH, HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 3, 2, 4, 16, 24  # value heads in groups of 2; V not a power of two
# float32; the rule reduces over the key dim (L2 norms, state . k, state . q) a few times in series.
REDUCTIONS = 4


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


def transformers_conv(x, state, weight):
    """transformers' `causal_conv1d_update` fallback: its state holds K inputs, ours the last K - 1."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

    update = torch_function(qwen.causal_conv1d_update)
    theirs = torch.cat([torch.full_like(state[..., :1], 7.0), state], dim=-1)  # its oldest input never reaches an output
    out = update(x.transpose(1, 2), theirs, weight, None, activation="silu")
    return out.transpose(1, 2), theirs[..., 1:]


TAPS, CHANNELS = 4, 40  # channels not a power of two


def conv_case(tokens: int, seed: int = 0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, tokens, CHANNELS, generator=generator).to(dtype)
    state = torch.randn(BATCH, CHANNELS, TAPS - 1, generator=generator).to(dtype)
    weight = (torch.randn(CHANNELS, TAPS, generator=generator) * 0.5).to(dtype)
    return x, state, weight


@pytest.mark.parametrize("tokens", [1, 2, 5])  # fewer, as many and more new inputs than the window holds
def test_the_conv_reference_is_transformers_update(tokens):
    x, state, weight = conv_case(tokens)
    want_out, want_state = transformers_conv(x, state.clone(), weight)
    got_state = state.clone()
    got_out = decode_kernels.conv_steps_reference(x, got_state, weight, None)
    assert_close(got_out, want_out, rounding_bound(want_out, torch.float32, reductions=1, width=TAPS), "output")
    assert torch.equal(got_state, want_state)  # the window is moved, not computed


def rule_case(tokens: int, seed: int = 0, dtype=torch.float32):
    """q, k, v as views of one (B, T, C) conv output, as the decoder hands them; the raw a; beta."""
    generator = torch.Generator().manual_seed(seed)
    mixed = torch.randn(BATCH, tokens, 2 * HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM, generator=generator).to(dtype)
    q, k, v = torch.split(mixed, [HEADS * KEY_DIM, HEADS * KEY_DIM, VALUE_HEADS * VALUE_DIM], dim=-1)
    q, k = q.reshape(BATCH, tokens, HEADS, KEY_DIM), k.reshape(BATCH, tokens, HEADS, KEY_DIM)
    v = v.reshape(BATCH, tokens, VALUE_HEADS, VALUE_DIM)
    a = torch.randn(BATCH, tokens, VALUE_HEADS, generator=generator).to(dtype)
    beta = torch.rand(BATCH, tokens, VALUE_HEADS, generator=generator).to(dtype)
    a[0, 0, 0] = 30.0  # past softplus' threshold, where it returns its input
    A_log = torch.rand(VALUE_HEADS, generator=generator).log().to(dtype)
    dt_bias = torch.randn(VALUE_HEADS, generator=generator).to(dtype)
    state = torch.randn(BATCH, VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=generator) * 0.1
    return q, k, v, a, beta, A_log, dt_bias, state


def test_the_span_reference_keeps_the_state_after_each_token():
    """`states` holds, after token t of a span, what a span of the first t + 1 tokens leaves (to
    float32 rounding: torch's vectorised exp may round the decay of a shorter span otherwise)."""
    tokens = 3
    q, k, v, a, beta, A_log, dt_bias, state = rule_case(tokens)
    states = torch.zeros(tokens, *state.shape)
    decode_kernels.gated_delta_steps_reference(q, k, v, a, beta, A_log, dt_bias, state.clone(), states)
    for t in range(tokens):
        shorter = state.clone()
        decode_kernels.gated_delta_steps_reference(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], a[:, : t + 1], beta[:, : t + 1],
                                                   A_log, dt_bias, shorter)
        assert_close(states[t], shorter, rounding_bound(shorter, torch.float32, reductions=REDUCTIONS * (t + 1), width=KEY_DIM), f"state after token {t}")
        assert not torch.equal(states[t], states[-1]) or t == tokens - 1
    with pytest.raises(ValueError, match="states must be a contiguous float32"):
        decode_kernels.gated_delta_steps_(q, k, v, a, beta, A_log, dt_bias, state.clone(), torch.zeros(tokens - 1, *state.shape))


def test_the_span_reference_is_transformers_rule_over_the_span():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

    tokens = 3
    q, k, v, a, beta, A_log, dt_bias, state = rule_case(tokens)
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)  # the module's decay
    rule = torch_function(qwen.torch_recurrent_gated_delta_rule)
    groups = VALUE_HEADS // HEADS
    want_out, want_state = rule(q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2), v, g=g, beta=beta,
                                initial_state=state.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    got_state = state.clone()
    got_out = decode_kernels.gated_delta_steps_reference(q, k, v, a, beta, A_log, dt_bias, got_state)
    bound = rounding_bound(want_state, torch.float32, reductions=REDUCTIONS * tokens, width=KEY_DIM)
    assert_close(got_state, want_state, bound, "state")
    assert_close(got_out, want_out, rounding_bound(want_out, torch.float32, reductions=REDUCTIONS * tokens, width=KEY_DIM), "output")


def compare_kernels_with_references(dtype) -> None:
    """Run in a process started with TRITON_INTERPRET=1 (the kernels' reductions are jitted library
    functions, which Triton interprets only when the variable is set before it is imported)."""
    for tokens in (1, 3):
        x, state, weight = conv_case(tokens, seed=tokens, dtype=dtype)
        bias = torch.randn(CHANNELS).to(dtype)
        want_state = state.clone()
        want = decode_kernels.conv_steps_reference(x, want_state, weight, bias)
        got_state = state.clone()
        assert decode_kernels.available(got_state)
        got = decode_kernels.conv_steps_(x, got_state, weight, bias)
        assert got.dtype == dtype and torch.equal(got_state, want_state)
        # Both round the conv to the dtype, then SiLU's output: one rounding each may differ.
        bound = rounding_bound(want.float(), dtype, reductions=2, width=1) + rounding_bound(want.float(), torch.float32,
                                                                                            reductions=1, width=TAPS)
        assert_close(got.float(), want.float(), bound, f"conv output, {tokens} tokens")

        q, k, v, a, beta, A_log, dt_bias, state = rule_case(tokens, seed=tokens, dtype=dtype)
        want_state, want_states = state.clone(), torch.zeros(tokens, *state.shape)
        want = decode_kernels.gated_delta_steps_reference(q, k, v, a, beta, A_log, dt_bias, want_state, want_states)
        got_state, got_states = state.clone(), torch.full((tokens, *state.shape), float("nan"))
        got = decode_kernels.gated_delta_steps_(q, k, v, a, beta, A_log, dt_bias, got_state, got_states)
        assert got.dtype == dtype and got.shape == want.shape
        # The states are float32 either way; the output is rounded once to the input dtype.
        reductions = REDUCTIONS * tokens
        assert_close(got_state, want_state, rounding_bound(want_state, torch.float32, reductions=reductions, width=KEY_DIM), "state")
        assert torch.equal(got_states[-1], got_state)  # the last token's kept state is the state
        for t in range(tokens):  # the state after each token, as the verify pass keeps it
            bound = rounding_bound(want_states[t], torch.float32, reductions=REDUCTIONS * (t + 1), width=KEY_DIM)
            assert_close(got_states[t], want_states[t], bound, f"state after token {t}")
        kept_state = state.clone()
        assert torch.equal(decode_kernels.gated_delta_steps_(q, k, v, a, beta, A_log, dt_bias, kept_state), got)
        assert torch.equal(kept_state, got_state)  # keeping the states changes nothing else
        bound = rounding_bound(want.float(), dtype, reductions=1, width=1) + rounding_bound(want.float(), torch.float32,
                                                                                            reductions=reductions, width=KEY_DIM)
        assert_close(got.float(), want.float(), bound, f"rule output, {tokens} tokens")
        for bad in (state.double(), state.transpose(-1, -2)):
            try:
                decode_kernels.gated_delta_steps_(q, k, v, a, beta, A_log, dt_bias, bad)
            except ValueError as err:
                assert "contiguous float32" in str(err)
            else:
                raise AssertionError("a state the kernel cannot update was taken")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernels_are_the_references_under_triton_s_interpreter(dtype):
    pytest.importorskip("triton")
    run_interpreted(__file__, f"compare_kernels_with_references(torch.{dtype})", timeout=300)


def norm_rotate_case(tokens: int, dtype, seed: int = 0):
    """A tiny full-attention layer's queries (strided: interleaved with their gates, as its projection gives
    them) and keys, its norms with random weights, and the rotary embedding at positions 5 .. 5 + T - 1."""
    from occamy_mtp.testing.checkpoints import random_models, tiny_text_config

    model, _ = random_models(tiny_text_config(), seed=seed)
    model = model.to(dtype)
    attention = next(layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for norm in (attention.q_norm, attention.k_norm):
            norm.weight.copy_(torch.randn(norm.weight.shape, generator=generator) * 0.5)
    dim, batch = attention.head_dim, 2
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    query_gate = (torch.randn(batch, tokens, heads, 2 * dim, generator=generator) * 3).to(dtype)
    key = (torch.randn(batch, tokens, kv_heads, dim, generator=generator) * 3).to(dtype)
    positions = 5 + torch.arange(tokens)
    cos, sin = model.model.rotary_emb(key, positions[None, None].expand(3, batch, -1))
    return attention, query_gate[..., :dim], key, cos, sin


def compare_norm_rotate(dtype) -> None:
    """Run under Triton's interpreter: `norm_rotate`'s kernel against its reference (the module's norms, the
    family's rotation), for one token and a span."""
    import sys

    for tokens in (1, 4):
        attention, query, key, cos, sin = norm_rotate_case(tokens, dtype, seed=tokens)
        rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        want_q, want_k = decode_kernels.norm_rotate_reference(query, key, attention.q_norm, attention.k_norm, cos, sin, rotate)
        assert decode_kernels.available(query)
        got_q, got_k = decode_kernels.norm_rotate(query, key, attention.q_norm, attention.k_norm, cos, sin, rotate)
        for got, want, what in ((got_q, want_q, "queries"), (got_k, want_k, "keys")):
            assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
            # The norm's mean of squares (one reduction over the head dim, in fp32), then the roundings to the
            # dtype both make in the same places (the norm's output, each product, their sum): one of each may
            # fall on the other side.
            bound = rounding_bound(want.float(), torch.float32, reductions=1, width=query.shape[-1]) + \
                rounding_bound(want.float(), dtype, reductions=3, width=1)
            assert_close(got.float(), want.float(), bound, f"{what}, {tokens} tokens, {dtype}")
    # A real error fails it: the rotation's halves swapped.
    swapped = decode_kernels.norm_rotate(query, key, attention.q_norm, attention.k_norm, cos, -sin, rotate)[0]
    assert (swapped.float() - want_q.float()).abs().max() > bound


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_norm_rotate_kernel_is_its_reference_under_triton_s_interpreter(dtype):
    pytest.importorskip("triton")
    run_interpreted(__file__, f"compare_norm_rotate(torch.{dtype})", timeout=300)


def test_the_norm_rotate_reference_is_the_attention_module_s():
    """Where no kernel runs, `norm_rotate` is the module's own norms and rotation: its forward's queries and keys."""
    import sys

    attention, query, key, cos, sin = norm_rotate_case(3, torch.float32)
    rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb
    got_q, got_k = decode_kernels.norm_rotate(query, key, attention.q_norm, attention.k_norm, cos, sin, rotate)
    want_q, want_k = rotate(attention.q_norm(query).transpose(1, 2), attention.k_norm(key).transpose(1, 2), cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.gpu
def test_the_norm_rotate_kernel_is_its_reference_on_the_gpu():
    import sys

    for tokens in (1, 4):
        attention, query, key, cos, sin = norm_rotate_case(tokens, torch.bfloat16, seed=tokens)
        attention, query, key, cos, sin = attention.cuda(), query.cuda(), key.cuda(), cos.cuda(), sin.cuda()
        rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        want = decode_kernels.norm_rotate_reference(query, key, attention.q_norm, attention.k_norm, cos, sin, rotate)
        got = decode_kernels.norm_rotate(query, key, attention.q_norm, attention.k_norm, cos, sin, rotate)
        for g, w in zip(got, want):
            bound = rounding_bound(w.float(), torch.float32, reductions=1, width=query.shape[-1]) + \
                rounding_bound(w.float(), torch.bfloat16, reductions=3, width=1)
            assert_close(g.float(), w.float(), bound, f"norm_rotate on the GPU, {tokens} tokens")
