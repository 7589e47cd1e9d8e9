"""Projections of one input laid out as one weight (`occamy_mtp.base.joined`): the base computes what it
did, the decoder reads each group in one GEMM, and weights that lie apart are read one at a time."""

from __future__ import annotations

import pytest
import torch

from occamy_mtp.base import joined
from occamy_mtp.base.fastdecode import StaticRunner, fast_plain_decode
from occamy_mtp.base.generate import plain_decode
from occamy_mtp.testing.checkpoints import random_models, tiny_text_config
from occamy_mtp.testing.interpreter import run_interpreted
from occamy_mtp.testing.numerics import assert_close, rounding_bound

pytestmark = pytest.mark.usefixtures("single_thread")

# The tiny base's 4 layers of about 12 reductions each, plus the Gated DeltaNet's running state over the
# text's positions (as tests/test_fastdecode.py bounds its hidden states).
REDUCTIONS = 4 * 12 + 40


def tiny_base(dtype=torch.float32, device="cpu"):
    model, _ = random_models(tiny_text_config(), seed=3)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def prompts_of(lengths, seed=0, vocab=1000):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def all_groups(model):
    return [group for layer in model.model.layers for group in joined.groups(layer)]


def test_laying_out_joins_every_group_and_keeps_every_weight():
    model = tiny_base()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    ids = torch.tensor([prompts_of((9,))[0]])
    logits = model(ids).logits
    groups = all_groups(model)
    linear_layers = sum(hasattr(layer, "linear_attn") for layer in model.model.layers)
    attention_layers = sum(hasattr(layer, "self_attn") for layer in model.model.layers)
    assert len(groups) == linear_layers + attention_layers + len(model.model.layers)  # each mixer, and each MoE block
    assert all(joined.joined(joined.tensors_of(group)) is None for group in groups)  # apart as loaded

    assert joined.lay_out(model) == len(groups)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    for group in groups:
        tensors = joined.tensors_of(group)
        weight = joined.joined(tensors)
        assert weight is not None and torch.equal(weight, torch.cat(tensors))
        assert weight.data_ptr() == tensors[0].data_ptr()  # a view, not a copy
    # The forward reads the same values in the same shapes: the same logits, bit for bit.
    assert torch.equal(model(ids).logits, logits)
    assert joined.lay_out(model) == 0  # laid out already: nothing moves again


def test_weights_that_lie_apart_are_read_one_projection_at_a_time():
    model = tiny_base()
    joined.lay_out(model)
    mixer = next(layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn"))
    x = torch.randn(2, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    separate = [module(x) for module, _ in joined.linear_attention_weights(mixer)]
    for got, want in zip(joined.linear_attention_inputs(mixer, x), separate):
        assert_close(got, want, rounding_bound(want, torch.float32, reductions=1, width=x.shape[-1]), "a joined projection")
    # Out of order, or one of them replaced since: no joined weight, and each projection its own GEMM.
    tensors = joined.tensors_of(joined.linear_attention_weights(mixer))
    assert joined.joined([tensors[1], tensors[0]]) is None
    assert joined.joined([tensors[0], tensors[2]]) is None  # a gap between them
    mixer.in_proj_z.weight = torch.nn.Parameter(mixer.in_proj_z.weight.clone(), requires_grad=False)
    assert joined.joined(joined.tensors_of(joined.linear_attention_weights(mixer))) is None
    for got, want in zip(joined.linear_attention_inputs(mixer, x), separate):
        assert torch.equal(got, want)
    block = model.model.layers[0].mlp
    block.gate.weight = torch.nn.Parameter(block.gate.weight.clone(), requires_grad=False)
    assert joined.moe_inputs(block, x[0]) is None


def test_a_laid_out_base_decodes_plain_decode_s_tokens_and_logits():
    """The decoder's step and prefill read the Gated DeltaNet's inputs in one GEMM: the tokens of
    plain_decode, and a runner's logits those of the base read one projection at a time."""
    apart, laid_out = tiny_base(), tiny_base()
    assert joined.lay_out(laid_out) > 0
    prompts = prompts_of((1, 9, 4, 17, 2))
    expected = plain_decode(apart, prompts, max_new_tokens=12, eos_token_ids=set(), batch_size=5)
    assert fast_plain_decode(laid_out, prompts, max_new_tokens=12, eos_token_ids=set(), batch_size=3) == expected
    text = prompts[3] + expected[3]
    want = StaticRunner(apart, positions=len(text), span=4).forward(text)[1]
    got = StaticRunner(laid_out, positions=len(text), span=4).forward(text)[1]
    assert_close(got, want, rounding_bound(want, torch.float32, reductions=REDUCTIONS, width=2 * apart.config.hidden_size),
                 "a laid-out runner's logits")


def moe_through_the_kernels() -> None:
    """Under Triton's interpreter (`run_interpreted`): `decode_moe_block` on a laid-out block (the router
    and the shared expert's inputs in one GEMM, the shared expert's SiLU * up in one kernel) against the
    block's own forward, float32."""
    from occamy_mtp.base.fastbase import decode_moe_block, fused_moe_block, module_moe

    model = tiny_base()
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    block = model.model.layers[0].mlp
    want = module_moe(block, x[None])[0]
    apart = fused_moe_block(block, x)
    joined.lay_out(model)
    assert joined.moe_inputs(block, x) is not None
    got = decode_moe_block(block, x)
    # Three reductions in series (the projections, the shared expert's down, the combine), the widest over
    # the hidden size; the kernels sum in another order than the module.
    bound = rounding_bound(want, torch.float32, reductions=3, width=2 * model.config.hidden_size)
    assert_close(got, want, bound, "the joined MoE block against the module's")
    assert_close(got, apart, bound, "the joined MoE block against the block read one projection at a time")
    block.gate.weight.data = block.gate.weight.data.clone()  # the router moved: read apart, the same output
    assert joined.moe_inputs(block, x) is None
    assert torch.equal(decode_moe_block(block, x), apart)


def test_the_joined_moe_block_is_the_block_s_forward():
    pytest.importorskip("triton")
    run_interpreted(__file__, "moe_through_the_kernels()")


def test_an_opened_base_is_laid_out_where_the_fast_paths_run_it():
    from occamy_mtp.base.frozen import FrozenBase

    model = tiny_base()
    base = FrozenBase.in_memory(model)
    assert base.fast_paths and base.joined_groups == len(all_groups(model))
    assert all(joined.joined(joined.tensors_of(group)) is not None for group in all_groups(model))


@pytest.mark.gpu
def test_a_laid_out_base_decodes_as_one_read_apart_on_the_gpu():
    """bf16 on CUDA, graphs captured: the joined GEMMs (the Gated DeltaNet's inputs, the MoE block's router and
    shared expert) give the logits of the projections one at a time within bf16's rounding, and the tokens."""
    apart, laid_out = tiny_base(torch.bfloat16, "cuda"), tiny_base(torch.bfloat16, "cuda")
    assert joined.lay_out(laid_out) == len(all_groups(laid_out))
    prompts = prompts_of((3, 12, 7, 1, 9, 4))
    reference = fast_plain_decode(apart, prompts, max_new_tokens=20, eos_token_ids=set(), batch_size=6)
    got = fast_plain_decode(laid_out, prompts, max_new_tokens=20, eos_token_ids=set(), batch_size=6)
    # bf16: another blocking of the joined GEMM may part a row at a near tie, not most of them
    assert sum(a == b for a, b in zip(got, reference)) >= len(prompts) - 1
    text = prompts[1] + reference[1]
    want = StaticRunner(apart, positions=len(text) + 4, span=4).forward(text)[1]
    runner = StaticRunner(laid_out, positions=len(text) + 4, span=4)
    assert_close(runner.forward(text)[1], want,
                 rounding_bound(want, torch.bfloat16, reductions=REDUCTIONS, width=2 * apart.config.hidden_size),
                 "a laid-out runner's logits on the GPU")


def test_a_base_opened_twice_counts_its_groups_as_laid_out():
    from occamy_mtp.base.frozen import FrozenBase

    model = tiny_base()
    first = FrozenBase.in_memory(model)
    second = FrozenBase.in_memory(model)  # nothing moves the second time; every group still lies as one weight
    assert first.joined_groups == second.joined_groups == joined.joined_groups(model) == len(all_groups(model))
