"""The Triton glue kernels of the MoE block against their plain PyTorch references.

Oracles: `combine_reference` / `silu_mul_reference` (themselves checked against a
token-by-token loop and transformers' experts), and through `grouped_experts`, the MoE
block's own forward. On a CPU the kernels run under Triton's interpreter
(`TRITON_INTERPRET=1`), which executes the same kernel code on CPU tensors; the tests
marked gpu run the compiled kernels, at real width and with more than 2**31 elements.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from occamy_mtp.base import fastbase
from occamy_mtp.base import moe_kernels
from occamy_mtp.testing.checkpoints import random_models, tiny_text_config
from occamy_mtp.testing.interpreter import run_interpreted
from occamy_mtp.testing.numerics import assert_close, rounding_bound

BF16_ULP = 2.0**-7  # bf16 keeps 8 significant bits: one unit in the last place is 2**-7 of the leading bit


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def interpreted(monkeypatch):
    """`moe_kernels` with its kernels run by Triton's interpreter, on CPU tensors."""
    if not _triton_importable():
        pytest.skip("needs triton (installed with the test extra on Linux x86-64)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    importlib.reload(moe_kernels)  # triton.jit reads the variable when the kernels are defined
    yield moe_kernels
    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(moe_kernels)


def routed_case(tokens: int, top_k: int, dim: int, dtype, seed: int = 0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    expert_out = torch.randn(tokens * top_k, dim, generator=generator).to(device, dtype)
    inverse = torch.randperm(tokens * top_k, generator=generator).to(device)
    weights = torch.rand(tokens, top_k, generator=generator).softmax(-1).to(device, dtype)
    shared = torch.randn(tokens, dim, generator=generator).to(device, dtype)
    shared_gate = torch.randn(tokens, 1, generator=generator).to(device, dtype)
    return expert_out, inverse, weights, shared, shared_gate


def loop_combine(expert_out, inverse, weights, shared, shared_gate):
    """Token by token, choice by choice, in float64."""
    tokens, top_k = weights.shape
    out = torch.zeros(tokens, expert_out.shape[1], dtype=torch.float64)
    for n in range(tokens):
        for j in range(top_k):
            out[n] += weights[n, j].double() * expert_out[inverse[n * top_k + j]].double()
        if shared is not None:
            out[n] += torch.sigmoid(shared_gate[n].double()) * shared[n].double()
    return out


def assert_within_bf16_rounding(got: torch.Tensor, exact: torch.Tensor):
    """Each value is the exact one rounded to bf16, give or take one unit in the last place
    (plus fp32 accumulation error, relative to the largest value, for values near zero)."""
    exact = exact.double().cpu()
    error = (got.double().cpu() - exact).abs()
    allowed = BF16_ULP * exact.abs() + 2.0**-20 * exact.abs().max()
    worst = (error / allowed).max()
    assert worst <= 1.0, f"error up to {worst:.2f} bf16 ulps of the exact value"


# -- the references ---------------------------------------------------------------------


@pytest.mark.parametrize("with_shared", [True, False])
def test_combine_reference_equals_token_loop(with_shared):
    expert_out, inverse, weights, shared, shared_gate = routed_case(7, 3, 10, torch.float64, seed=1)
    if not with_shared:
        shared = shared_gate = None
    got = moe_kernels.combine_reference(expert_out, inverse, weights, shared, shared_gate)
    want = loop_combine(expert_out, inverse, weights, shared, shared_gate)
    # float64; per output: products then one sum over the choices and the shared expert.
    assert_close(got, want, rounding_bound(want, torch.float64, reductions=2, width=4), "combine reference")


def test_silu_mul_reference_is_silu_of_gate_times_up():
    gate_up = torch.randn(5, 12, dtype=torch.float64)
    gate, up = gate_up[:, :6], gate_up[:, 6:]
    want = gate / (1 + torch.exp(-gate)) * up
    # float64, elementwise: exp, division and two products.
    assert_close(moe_kernels.silu_mul_reference(gate_up), want, rounding_bound(want, torch.float64, reductions=4, width=1), "silu * up")


def test_without_triton_the_functions_are_the_references():
    """CPU tensors outside the interpreter never reach a kernel."""
    case = routed_case(4, 2, 6, torch.float32, seed=2)
    assert not moe_kernels.available(case[0])
    with pytest.raises(ValueError, match="both shared and shared_gate"):
        moe_kernels.combine(*case[:4], None)
    assert torch.equal(moe_kernels.combine(*case), moe_kernels.combine_reference(*case))
    gate_up = torch.randn(3, 8)
    assert torch.equal(moe_kernels.silu_mul(gate_up), moe_kernels.silu_mul_reference(gate_up))


# -- the kernels, interpreted on CPU -----------------------------------------------------


@pytest.mark.parametrize("with_shared", [True, False])
@pytest.mark.parametrize("dim", [48, 1100], ids=["one-block", "two-blocks-masked"])
def test_combine_kernel_fp32(interpreted, with_shared, dim):
    expert_out, inverse, weights, shared, shared_gate = routed_case(6, 4, dim, torch.float32, seed=3)
    if not with_shared:
        shared = shared_gate = None
    assert interpreted.available(expert_out)
    got = interpreted.combine(expert_out, inverse, weights, shared, shared_gate)
    want = loop_combine(expert_out, inverse, weights, shared, shared_gate)
    # float32 kernel against the float64 loop: products then one sum over 4 choices and the shared expert.
    assert_close(got.double(), want, rounding_bound(want, torch.float32, reductions=2, width=5), "combine kernel")


def test_combine_kernel_bf16_rounds_once(interpreted):
    case = routed_case(9, 8, 64, torch.bfloat16, seed=4)
    assert_within_bf16_rounding(interpreted.combine(*case), loop_combine(*case))


def test_combine_kernel_checks_shapes(interpreted):
    expert_out, inverse, weights, shared, _ = routed_case(4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="4 tokens x 2 choices need 8 expert rows"):
        interpreted.combine(expert_out[:6], inverse, weights)
    with pytest.raises(ValueError, match="both shared and shared_gate"):
        interpreted.combine(expert_out, inverse, weights, shared, None)


@pytest.mark.parametrize("inter", [32, 1030], ids=["one-block", "two-blocks-masked"])
def test_silu_mul_kernel(interpreted, inter):
    generator = torch.Generator().manual_seed(5)
    gate_up = torch.randn(11, 2 * inter, generator=generator)
    want = moe_kernels.silu_mul_reference(gate_up)
    # float32, elementwise: exp, division and two products, no reduction.
    assert_close(interpreted.silu_mul(gate_up), want, rounding_bound(want, torch.float32, reductions=4, width=1), "silu * up")
    rounded = gate_up.bfloat16()
    assert_within_bf16_rounding(interpreted.silu_mul(rounded), moe_kernels.silu_mul_reference(rounded.double()))


def test_kernels_handle_no_tokens(interpreted):
    expert_out, inverse, weights, shared, shared_gate = routed_case(0, 8, 16, torch.float32)
    assert interpreted.combine(expert_out, inverse, weights, shared, shared_gate).shape == (0, 16)
    assert interpreted.silu_mul(torch.zeros(0, 10)).shape == (0, 5)


def test_route_reference_is_transformers_router():
    config = tiny_text_config()
    base, _ = random_models(config, seed=0)
    router = base.float().model.layers[0].mlp.gate
    x = torch.randn(30, config.hidden_size, generator=torch.Generator().manual_seed(8))
    _, want_weights, want_experts = router(x)
    weights, experts = moe_kernels.route_reference(torch.nn.functional.linear(x, router.weight), router.top_k)
    assert torch.equal(experts, want_experts) and torch.equal(weights, want_weights)


def test_align_reference_orders_the_pairs_by_expert():
    generator = torch.Generator().manual_seed(9)
    experts = torch.stack([torch.randperm(12, generator=generator)[:3] for _ in range(7)])  # 7 tokens, top-3 of 12
    rows, inverse, offsets = moe_kernels.align_reference(experts, 12)
    counts = torch.bincount(experts.reshape(-1), minlength=12)
    assert offsets.dtype == torch.int32 and offsets.tolist() == counts.cumsum(0).tolist()
    flat = experts.reshape(-1)
    for pair in range(flat.numel()):  # pair n * k + j sits at inverse[pair]: token n, in its expert's group
        slot = int(inverse[pair])
        expert = int(flat[pair])
        assert int(rows[slot]) == pair // 3
        assert (offsets[expert] - counts[expert]) <= slot < offsets[expert]
    assert sorted(inverse.tolist()) == list(range(flat.numel()))


def compare_routing_kernels_with_references() -> None:
    """Run in a process started with TRITON_INTERPRET=1 (`route` and `align` reduce with jitted
    library functions, which Triton interprets only when the variable is set before it is imported)."""
    generator = torch.Generator().manual_seed(10)
    for tokens, num_experts, top_k in ((5, 40, 3), (9, 256, 8), (0, 16, 2)):
        logits = torch.randn(tokens, num_experts, generator=generator) * 3
        want_weights, want_experts = moe_kernels.route_reference(logits, top_k)
        weights, experts = moe_kernels.route(logits, top_k)
        assert torch.equal(experts, want_experts), (experts, want_experts)
        if not tokens:
            assert weights.shape == (0, top_k) and torch.equal(moe_kernels.align(experts, num_experts)[2],
                                                               torch.zeros(num_experts, dtype=torch.int32))
            continue
        # float32: the softmax's two reductions over the experts, the renormalising sum over k
        assert_close(weights, want_weights, rounding_bound(want_weights, torch.float32, reductions=3, width=num_experts), "route")
        rounded = logits.bfloat16()  # bf16 logits tie often: any of the tied experts is the router's choice
        weights, experts = moe_kernels.route(rounded, top_k)
        want_weights, want_experts = moe_kernels.route_reference(rounded, top_k)
        probs = torch.softmax(rounded, dim=-1, dtype=torch.float)
        assert weights.dtype == torch.bfloat16
        assert torch.equal(probs.gather(1, experts), probs.gather(1, want_experts))  # the same top k values, in order
        assert all(len(set(row)) == top_k for row in experts.tolist())
        assert_within_bf16_rounding(weights, want_weights.double())
        # more pairs than one block of the kernel, and some experts never chosen
        choices = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens * 40)]) \
            if tokens else torch.zeros(0, top_k, dtype=torch.long)
        got, want = moe_kernels.align(choices, num_experts), moe_kernels.align_reference(choices, num_experts)
        for name, a, b in zip(("rows", "inverse", "offsets"), got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), name
    try:
        moe_kernels.align(torch.zeros(moe_kernels.ALIGN_MAX_PAIRS + 1, 1, dtype=torch.long), 4)
    except ValueError as err:
        assert "at most" in str(err)
    else:
        raise AssertionError("align took more pairs than it scans")
    # Through the whole MoE block of a tiny Qwen3.5-MoE: the module's own forward is the oracle.
    config = tiny_text_config()
    base, _ = random_models(config, seed=0)
    block = base.float().model.layers[0].mlp
    x = torch.randn(1, 40, config.hidden_size, generator=torch.Generator().manual_seed(6))
    # float32; the block runs about 8 reductions in series (router, its softmax, expert up and
    # down, the routed sum, the shared expert's up, down and gate), none wider than hidden.
    want = block(x)
    assert_close(fastbase.fused_moe_block(block, x), want, rounding_bound(want, torch.float32, reductions=8, width=config.hidden_size),
                 "fused MoE block")
    _, weights, selected = block.gate(x[0])
    want = block.experts(x[0], selected, weights)
    assert_close(fastbase.grouped_experts(block.experts, x[0], selected, weights, fused_glue=True), want,
                 rounding_bound(want, torch.float32, reductions=8, width=config.hidden_size), "grouped experts, fused glue")
    assert type(block.experts.act_fn).__name__ in fastbase._SILU_CLASSES  # so the kernel ran above
    block.experts.act_fn = torch.nn.GELU()  # an activation the kernel does not compute: the module's is used
    want = block(x)
    assert_close(fastbase.fused_moe_block(block, x), want, rounding_bound(want, torch.float32, reductions=8, width=config.hidden_size),
                 "fused MoE block, GELU experts")


def test_the_routing_kernels_and_the_fused_block_under_triton_s_interpreter():
    if not _triton_importable():
        pytest.skip("needs triton (installed with the test extra on Linux x86-64)")
    run_interpreted(__file__, "compare_routing_kernels_with_references()")


def expert_case(tokens: int, num_experts: int, top_k: int, dim: int, inter: int, seed: int, device="cpu", dtype=torch.float32):
    """Tokens, their pairs in expert order (`align_reference`) and one layer's expert weights; expert 2
    takes every token (more rows than one tile of `expert_mlp`) and the last expert none."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=generator)
    gate_up = torch.randn(num_experts, 2 * inter, dim, generator=generator) / dim**0.5
    down = torch.randn(num_experts, dim, inter, generator=generator) / inter**0.5
    choices = torch.zeros(tokens, top_k, dtype=torch.long)
    for token in range(tokens):
        choices[token] = torch.randperm(num_experts - 1, generator=generator)[:top_k]
    swapped = choices == 2  # expert 2 first in every row, where it was chosen already its slot takes the first's
    choices[swapped] = choices[:, :1].expand_as(choices)[swapped]
    choices[:, 0] = 2
    rows, _, offsets = moe_kernels.align_reference(choices, num_experts)
    return (x.to(device, dtype), rows.to(device), offsets.to(device), gate_up.to(device, dtype), down.to(device, dtype))


def loop_expert_mlp(x, rows, offsets, gate_up, down):
    """Pair by pair, in float64."""
    inter = down.shape[2]
    ends = offsets.tolist()
    out = torch.zeros(rows.numel(), down.shape[1], dtype=torch.float64)
    for pair in range(rows.numel()):
        expert = next(e for e, end in enumerate(ends) if pair < end)
        product = gate_up[expert].double() @ x[rows[pair]].double()
        out[pair] = down[expert].double() @ (torch.nn.functional.silu(product[:inter]) * product[inter:])
    return out


def test_expert_mlp_reference_equals_a_pair_loop():
    case = expert_case(9, 12, 3, 16, 8, seed=11, dtype=torch.float64)
    assert torch.allclose(moe_kernels.expert_mlp_reference(*case), loop_expert_mlp(*case), rtol=1e-12, atol=1e-12)


def test_expert_mlp_refuses_what_it_cannot_compute():
    x, rows, offsets, gate_up, down = expert_case(5, 8, 2, 16, 8, seed=1)
    with pytest.raises(ValueError, match=r"need gate_up_proj \(E, 2I, 16\)"):
        moe_kernels.expert_mlp(x, rows, offsets, gate_up[:, :, :8], down)
    with pytest.raises(ValueError, match="need gate_up_proj"):
        moe_kernels.expert_mlp(x, rows, offsets[:-1], gate_up, down)
    many = torch.zeros(moe_kernels.EXPERT_MAX_TOKENS + 1, 16)
    with pytest.raises(ValueError, match=f"at most {moe_kernels.EXPERT_MAX_TOKENS} tokens"):
        moe_kernels.expert_mlp(many, rows, offsets, gate_up, down)


def compare_expert_mlp_with_reference() -> None:
    """Run in a process started with TRITON_INTERPRET=1. float32 only: the interpreter's bf16 `tl.dot` is wrong (Triton 3.9)."""
    for tokens, num_experts, top_k, dim, inter, blocks in (
        (9, 12, 3, 48, 40, ((16, 32, 4, 3), (32, 16, 4, 3))),  # widths not a multiple of the blocks
        (40, 8, 2, 64, 32, ((16, 32, 4, 3), (16, 64, 4, 3))),  # expert 2's 40 rows: three tiles of 16
        (1, 16, 4, 64, 32, (None, None)),  # one token, the default blocks
    ):
        case = expert_case(tokens, num_experts, top_k, dim, inter, seed=tokens)
        got = moe_kernels.expert_mlp(*case, up_blocks=blocks[0], down_blocks=blocks[1])
        want = loop_expert_mlp(*case)
        # float32: gate_up's sum over dim, SiLU and the product, down's sum over inter
        assert_close(got, want, rounding_bound(want, torch.float32, reductions=4, width=dim), f"expert_mlp, {tokens} tokens")
    empty = expert_case(0, 8, 2, 16, 16, seed=0)
    assert moe_kernels.expert_mlp(*empty).shape == (0, 16)


def test_expert_mlp_under_triton_s_interpreter():
    if not _triton_importable():
        pytest.skip("needs triton (installed with the test extra on Linux x86-64)")
    run_interpreted(__file__, "compare_expert_mlp_with_reference()")


def fp8_experts(gate_up: torch.Tensor, down: torch.Tensor, block: tuple[int, int]) -> moe_kernels.Fp8Experts:
    """The weights quantized as the family's checkpoints store them: e4m3 codes, one multiplier a block
    (each block's largest |value| over 448, times a spread so that the multipliers differ)."""
    def quantize(weight):
        rows, cols = weight.shape[-2:]
        nr, nc = -(-rows // block[0]), -(-cols // block[1])
        padded = torch.nn.functional.pad(weight.float(), (0, nc * block[1] - cols, 0, nr * block[0] - rows))
        blocks = padded.unflatten(-1, (nc, block[1])).unflatten(-3, (nr, block[0]))  # (E, nr, br, nc, bc)
        scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-6) / 448.0  # (E, nr, nc)
        full = scale.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
        return (weight.float() / full).to(torch.float8_e4m3fn), scale
    inter = gate_up.shape[1] // 2
    gate, gate_scales = quantize(gate_up[:, :inter])
    up, up_scales = quantize(gate_up[:, inter:])
    down_codes, down_scales = quantize(down)
    return moe_kernels.Fp8Experts(torch.cat([gate, up], dim=1), gate_scales, up_scales, down_codes, down_scales, block)


def compare_fp8_expert_mlp_with_dequantized() -> None:
    """Run in a process started with TRITON_INTERPRET=1: the kernels read FP8 codes and multipliers and give
    what they give on the weights dequantized first, bit for bit (float32 here, as the interpreter needs)."""
    for tokens, num_experts, top_k, dim, inter, block, blocks in (
        (9, 12, 3, 48, 40, (16, 16), ((16, 16, 4, 3), (32, 16, 4, 3))),
        (40, 8, 2, 64, 32, (16, 32), ((16, 32, 4, 3), (16, 32, 4, 3))),  # block_k within a block of multipliers
    ):
        x, rows, offsets, gate_up, down = expert_case(tokens, num_experts, top_k, dim, inter, seed=tokens)
        fp8 = fp8_experts(gate_up, down, block)
        got = moe_kernels.expert_mlp(x, rows, offsets, None, None, fp8=fp8, up_blocks=blocks[0], down_blocks=blocks[1])
        want = moe_kernels.expert_mlp(x, rows, offsets, *fp8.dequantized(torch.float32), up_blocks=blocks[0],
                                      down_blocks=blocks[1])
        assert torch.equal(got, want), float((got - want).abs().max())


def test_fp8_expert_mlp_under_triton_s_interpreter():
    if not _triton_importable():
        pytest.skip("needs triton (installed with the test extra on Linux x86-64)")
    run_interpreted(__file__, "compare_fp8_expert_mlp_with_dequantized()")


def test_fp8_experts_dequantize_as_the_checkpoint_s_reference():
    """`Fp8Experts.dequantized` is `quantized.dequantize_fp8` part by part (the load's dequantization)."""
    from occamy_mtp.model.quantized import dequantize_fp8

    _, _, _, gate_up, down = expert_case(3, 4, 2, 40, 24, seed=3)
    fp8 = fp8_experts(gate_up, down, (16, 16))
    gate_up_deq, down_deq = fp8.dequantized(torch.bfloat16)
    assert torch.equal(gate_up_deq[:, :24], dequantize_fp8(fp8.gate_up_codes[:, :24], fp8.gate_scales, (16, 16)).bfloat16())
    assert torch.equal(gate_up_deq[:, 24:], dequantize_fp8(fp8.gate_up_codes[:, 24:], fp8.up_scales, (16, 16)).bfloat16())
    assert torch.equal(down_deq, dequantize_fp8(fp8.down_codes, fp8.down_scales, (16, 16)).bfloat16())
    assert float((gate_up_deq.float() - gate_up).abs().max()) < 0.1 * float(gate_up.abs().max())  # a quantization of it


# -- the compiled kernels on a GPU ---------------------------------------------------------


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not _triton_importable(), reason="needs CUDA and triton")


@pytest.mark.gpu
@needs_cuda
def test_compiled_kernels_at_real_width():
    """Qwen3.5-35B-A3B widths: D = 2048, I = 512, top-8; 4096 tokens."""
    case = routed_case(4096, 8, 2048, torch.bfloat16, seed=7, device="cuda")
    got = moe_kernels.combine(*case)
    exact = moe_kernels.combine_reference(*(t.double() if t.is_floating_point() else t for t in case))
    assert_within_bf16_rounding(got, exact)
    gate_up = torch.randn(4096 * 8, 1024, device="cuda", dtype=torch.bfloat16)
    assert_within_bf16_rounding(moe_kernels.silu_mul(gate_up), moe_kernels.silu_mul_reference(gate_up.double()))


@pytest.mark.gpu
@needs_cuda
def test_compiled_combine_beyond_int32_offsets():
    """More than 2**31 elements in the expert rows: offsets must be 64-bit."""
    tokens, top_k, dim = 140_000, 8, 2048  # 2.29e9 elements, 4.3 GiB in bf16
    if torch.cuda.get_device_properties(0).total_memory < 16 * 2**30:
        pytest.skip("needs 16 GiB of GPU memory")
    expert_out = torch.zeros(tokens * top_k, dim, device="cuda", dtype=torch.bfloat16)
    # Every token picks its rows from the far end: token n, choice j -> row S - 1 - (n * k + j).
    inverse = torch.arange(tokens * top_k - 1, -1, -1, device="cuda")
    marks = torch.arange(tokens * top_k, device="cuda", dtype=torch.float32) % 251
    expert_out[:, -1] = marks.to(torch.bfloat16)
    weights = torch.zeros(tokens, top_k, device="cuda", dtype=torch.bfloat16)
    weights[:, 0] = 1.0
    got = moe_kernels.combine(expert_out, inverse, weights)[:, -1].float()
    expected = marks[tokens * top_k - 1 - torch.arange(tokens, device="cuda") * top_k]
    assert torch.equal(got, expected)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 64, 160, 256])
def test_compiled_fp8_expert_mlp_computes_the_dequantized_weights_products(tokens):
    """Qwen3.5-35B-A3B widths and the family's 128 x 128 blocks: the kernels reading FP8 codes, each
    tile dequantized in registers to the bf16 value the dequantizing load writes, against float64 from
    those bf16 weights, rounded where the kernels round; the bound of the bf16 kernel's own test
    (`test_compiled_expert_mlp_at_real_width`): the compiler may order a tile's fp32 sums otherwise once
    it is converted in registers (on an H100 the bits differ from the bf16 kernel's at some token
    counts, one among them)."""
    x, rows, offsets, gate_up, down = expert_case(tokens, 256, 8, 2048, 512, seed=tokens, device="cuda")
    fp8 = fp8_experts(gate_up, down, (128, 128))
    gate_up, down = fp8.dequantized(torch.bfloat16)
    x = x.bfloat16()
    got = moe_kernels.expert_mlp(x, rows, offsets, None, None, fp8=fp8)
    assert_within_the_expert_bound(got, *expert_bound(x, rows, offsets, gate_up, down))


def expert_bound(x, rows, offsets, gate_up, down) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, allowed) of `expert_mlp` at real width: each pair's output in float64 from the bf16 inputs,
    rounded where the kernels round (gate and up, the hidden row), and the error a correct bf16 kernel may
    show (`test_compiled_expert_mlp_at_real_width`'s docstring says why)."""
    starts = torch.cat([offsets.new_zeros(1), offsets[:-1]]).long()
    expert = torch.searchsorted(offsets.long(), torch.arange(rows.numel(), device=x.device), right=True)
    assert torch.all(torch.arange(rows.numel(), device=x.device) >= starts[expert])
    product = torch.einsum("sod,sd->so", gate_up[expert].double(), x[rows].double()).bfloat16().double()
    inter = down.shape[-1]
    hidden = (torch.nn.functional.silu(product[:, :inter]) * product[:, inter:]).bfloat16().double()
    exact = torch.einsum("sdi,si->sd", down[expert].double(), hidden)
    spread = torch.einsum("sdi,si->sd", down[expert].double().abs(), hidden.abs())
    return exact, BF16_ULP * exact.abs() + 2.0**-8 * spread + 2.0**-20 * exact.abs().max()


def assert_within_the_expert_bound(got: torch.Tensor, exact: torch.Tensor, allowed: torch.Tensor) -> None:
    worst = ((got.double() - exact).abs() / allowed).max()
    assert worst <= 1.0, f"error up to {worst:.2f} of the allowed bound"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 64, 160])
def test_compiled_expert_mlp_at_real_width(tokens):
    """Qwen3.5-35B-A3B widths, bf16: each pair's output against float64 from the same bf16 inputs,
    rounded where the kernels round (gate and up, the hidden row, the output). A bf16 rounding of
    gate or up may fall the other way after fp32 sums in another order: one unit of the hidden
    row, which moves the output by at most 2**-8 of the sum of |down| * |hidden|."""
    x, rows, offsets, gate_up, down = expert_case(tokens, 256, 8, 2048, 512, seed=tokens, device="cuda", dtype=torch.bfloat16)
    exact, allowed = expert_bound(x, rows, offsets, gate_up, down)
    assert_within_the_expert_bound(moe_kernels.expert_mlp(x, rows, offsets, gate_up, down), exact, allowed)
    from transformers.integrations.moe import _grouped_mm  # the path it replaces, to the same bound
    grouped = _grouped_mm(moe_kernels.silu_mul(_grouped_mm(x[rows], gate_up.transpose(-2, -1), offs=offsets)),
                          down.transpose(-2, -1), offs=offsets)
    assert_within_the_expert_bound(grouped, exact, allowed)
