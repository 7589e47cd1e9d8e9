"""The fast frozen-base pass against the plain transformers forward, window by window.

Oracle: `occamy_mtp.targets.base.base_outputs` on each window alone (batch of one, no
packing). The pass must give the same greedy targets and the same hidden states
(to float32 rounding in float32, to bf16 tolerance in bf16), whatever the window
lengths and however the windows are split into batches.
"""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch

from occamy_mtp.base import fastbase
from occamy_mtp.compat import torch_function
from occamy_mtp.base.fastbase import (
    FastBasePass,
    Kernels,
    PackLayout,
    make_layout,
    packed_base_outputs,
    plan_batches,
)
from occamy_mtp.targets.base import base_outputs
from occamy_mtp.testing.checkpoints import random_models, tiny_text_config
from occamy_mtp.testing.numerics import assert_close, rounding_bound

# Window lengths: a single token, shorter than the conv kernel (4), around the
# chunked delta rule's chunk (64), and a long one.
LENGTHS = (37, 1, 3, 64, 65, 20, 130)


def windows_of(lengths, vocab_size: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def as_dtype(base, dtype):
    base = base.to(dtype)
    base.model.rotary_emb = type(base.model.rotary_emb)(base.config)  # fp32 frequencies, as loaded
    return base.eval()


@pytest.fixture(scope="module")
def tiny():
    config = tiny_text_config()
    base, _ = random_models(config, seed=0)
    return config, base


def plain_per_window(base, windows):
    """The oracle, on the base's own device (on a GPU with fla installed, transformers runs fla there too)."""
    device = base.lm_head.weight.device
    return [base_outputs(base, torch.tensor([w], device=device)) for w in windows]


def assert_matches_plain(base, windows, outputs, *, rel_tol: float, exact_greedy: bool):
    assert len(outputs) == len(windows)
    for window, got, ref in zip(windows, outputs, plain_per_window(base, windows)):
        got = fastbase.WindowOutputs(got.hidden.cpu(), got.greedy.cpu())
        ref_hidden, ref_greedy = ref.hidden[0].cpu(), ref.greedy[0].cpu()
        assert got.hidden.shape == ref_hidden.shape and got.greedy.shape == ref_greedy.shape
        error = (got.hidden.float() - ref_hidden.float()).norm() / ref_hidden.float().norm()
        assert error <= rel_tol, f"window of {len(window)} tokens: hidden relative error {error:.2e} > {rel_tol:.0e}"
        if exact_greedy:
            assert torch.equal(got.greedy, ref_greedy), f"window of {len(window)} tokens: greedy differs"
        else:
            # bf16 rounding may flip a near-tie: a differing choice must be (almost) as good.
            logits = base.lm_head(ref.hidden[0]).float().cpu()
            chosen = logits.gather(-1, got.greedy[:, None])[:, 0]
            best = logits.gather(-1, ref_greedy[:, None])[:, 0]
            margin = (best - chosen).max()
            assert margin <= 0.05 * logits.abs().max(), f"greedy choice worse by {margin:.3f} logits"


def segment_kernels(fused_norms: bool) -> Kernels:
    """Kernels with fla's contract, in PyTorch: they read the packed row and its cu_seqlens
    (one call per window), and the fused norms add the residual in fp32 as fla's do.
    They exercise the code path that runs with fla on a GPU."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

    conv_fn = torch_function(qwen.causal_conv1d_fn)
    rule_fn = torch_function(qwen.torch_chunk_gated_delta_rule)

    def segments(layout: PackLayout, tensor):
        if layout.cu_seqlens is None:
            return [tensor[i : i + 1] for i in range(tensor.shape[0])]
        bounds = layout.cu_seqlens.tolist()
        return [tensor[:, a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def join(layout, pieces):
        return torch.cat(pieces, dim=0 if layout.cu_seqlens is None else 1)

    def conv(x, weight, bias, activation, layout):
        return join(layout, [conv_fn(s.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)
                             for s in segments(layout, x)])

    def rule(q, k, v, g, beta, layout):
        groups = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        pieces = zip(*(segments(layout, t) for t in (q, k, v, g, beta)))
        return join(layout, [rule_fn(*p[:3], g=p[3], beta=p[4], use_qk_l2norm_in_kernel=True)[0] for p in pieces])

    def norm(x, weight, eps, residual):
        summed = x.float() if residual is None else x.float() + residual.float()
        normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
        return normed.to(x.dtype), summed.to(x.dtype)

    def norm_gated(x, gate, weight, eps):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return (normed * torch.nn.functional.silu(gate.float())).to(x.dtype)

    return Kernels(
        "segments", conv, rule,
        rms_norm=norm if fused_norms else None,
        rms_norm_gated=norm_gated if fused_norms else None,
        sparse_moe=fastbase.grouped_moe_block,
    )


# -- batching and layout --------------------------------------------------------------


def test_plan_batches_keeps_order_and_budget():
    assert plan_batches([3, 4, 2, 5, 1], max_tokens_per_batch=7) == [[0, 1], [2, 3], [4]]
    assert plan_batches([7, 7], max_tokens_per_batch=7) == [[0], [1]]
    with pytest.raises(ValueError, match="window 1 has 9 tokens"):
        plan_batches([3, 9], max_tokens_per_batch=8)


def test_layout_grid_round_trip():
    layout = make_layout([3, 1, 2], torch.device("cpu"))
    assert not layout.uniform and layout.cu_seqlens.tolist() == [0, 3, 4, 6]
    packed = torch.arange(6.0)[None, :, None]  # (1, N, 1)
    grid = layout.to_grid(packed)
    assert grid.shape == (3, 3, 1)
    assert grid[..., 0].tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]  # right-padded windows
    assert torch.equal(layout.from_grid(grid), packed)
    assert make_layout([4, 4], torch.device("cpu")).uniform
    with pytest.raises(ValueError, match="at least one token"):
        make_layout([2, 0], torch.device("cpu"))


# -- the pass equals the plain per-window forward --------------------------------------


@pytest.mark.parametrize("grouped_moe", [False, True], ids=["module-moe", "grouped-moe"])
@pytest.mark.parametrize("max_tokens", [400, 140], ids=["one-batch", "several-batches"])
def test_packed_equals_plain_fp32(tiny, grouped_moe, max_tokens):
    config, base = tiny
    base = as_dtype(base, torch.float32)
    windows = windows_of(LENGTHS, config.vocab_size)
    outputs = packed_base_outputs(
        base, windows, max_tokens_per_batch=max_tokens, kernels=fastbase.torch_kernels(grouped_moe=grouped_moe)
    )
    assert_matches_plain(base, windows, outputs, rel_tol=1e-5, exact_greedy=True)


@pytest.mark.parametrize("fused_norms", [False, True], ids=["module-norms", "fused-norms"])
def test_varlen_kernel_path_equals_plain_fp32(tiny, fused_norms):
    """The cu_seqlens path fla runs (conv and delta rule restarted at each window start)."""
    config, base = tiny
    base = as_dtype(base, torch.float32)
    windows = windows_of(LENGTHS, config.vocab_size, seed=2)
    outputs = packed_base_outputs(base, windows, max_tokens_per_batch=400, kernels=segment_kernels(fused_norms))
    assert_matches_plain(base, windows, outputs, rel_tol=1e-5, exact_greedy=True)


@pytest.mark.parametrize("kernels", ["torch", "torch-grouped-moe", "segments-fused"])
def test_packed_equals_plain_bf16(tiny, kernels):
    config, base = tiny
    base = as_dtype(base, torch.bfloat16)
    chosen = {
        "torch": fastbase.torch_kernels(),
        "torch-grouped-moe": fastbase.torch_kernels(grouped_moe=True),
        "segments-fused": segment_kernels(fused_norms=True),
    }[kernels]
    windows = windows_of(LENGTHS, config.vocab_size, seed=3)
    outputs = packed_base_outputs(base, windows, max_tokens_per_batch=400, kernels=chosen)
    assert_matches_plain(base, windows, outputs, rel_tol=3e-2, exact_greedy=False)


def test_uniform_batch_equals_plain(tiny):
    """Windows of one length run as (W, T) rows: no cu_seqlens, no gathers."""
    config, base = tiny
    base = as_dtype(base, torch.float32)
    windows = windows_of((48, 48, 48), config.vocab_size, seed=4)
    runner = FastBasePass(base, max_tokens_per_batch=1000, kernels=fastbase.torch_kernels(grouped_moe=True))
    hidden, greedy, layout = runner.forward_batch(windows)
    assert layout.uniform and hidden.shape == (3 * 48, config.hidden_size) and greedy.shape == (3 * 48,)
    assert_matches_plain(base, windows, runner(windows), rel_tol=1e-5, exact_greedy=True)


def test_eager_attention_gets_a_causal_mask(tiny):
    """Under eager attention a None mask is not causal: the pass must build one."""
    config, base = tiny
    base = as_dtype(base, torch.float32)
    base.config._attn_implementation = "eager"
    try:
        windows = windows_of((20, 7, 33), config.vocab_size, seed=5)
        outputs = packed_base_outputs(base, windows, max_tokens_per_batch=100, kernels=fastbase.torch_kernels())
        assert_matches_plain(base, windows, outputs, rel_tol=1e-5, exact_greedy=True)
    finally:
        base.config._attn_implementation = "sdpa"


def test_grouped_experts_equal_transformers_experts(tiny):
    config, base = tiny
    base = as_dtype(base, torch.float32)
    block = base.model.layers[0].mlp
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(50, config.hidden_size, generator=generator)
    _, weights, selected = block.gate(x)
    expected = block.experts(x, selected, weights)
    got = fastbase.grouped_experts(block.experts, x, selected, weights)
    # float32; the block runs about 8 reductions in series (router, its softmax, expert up and
    # down, the routed sum, the shared expert's up, down and gate), none wider than hidden.
    bound = rounding_bound(expected, torch.float32, reductions=8, width=config.hidden_size)
    assert_close(got, expected, bound, "grouped experts")
    block_out = block(x[None])
    bound = rounding_bound(block_out, torch.float32, reductions=8, width=config.hidden_size)
    assert_close(fastbase.grouped_moe_block(block, x[None]), block_out, bound, "grouped MoE block")


# -- kernels selection ----------------------------------------------------------------


def test_missing_fla_warns_with_install_hint(monkeypatch):
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fla", None)  # makes `import fla...` raise ImportError
    with pytest.warns(UserWarning, match="pip install flash-linear-attention fla-core"):
        kernels = fastbase.default_kernels(torch.device("cuda"))
    assert kernels.name.startswith("torch") and kernels.sparse_moe is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on CPU fla is not used at all: no warning
        assert fastbase.default_kernels(torch.device("cpu")).name == "torch"


def test_other_families_are_refused():
    config = tiny_text_config("qwen3_next")
    base, _ = random_models(config, seed=0)
    with pytest.raises(ValueError, match="qwen3_next"):
        FastBasePass(base, max_tokens_per_batch=64)


# -- on a GPU with fla: the real kernels and CUDA graphs -----------------------------


def _fla_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        fastbase.fla_kernels()
    except ImportError:
        return False
    return True


needs_fla = pytest.mark.skipif(not _fla_available(), reason="needs CUDA and fla (pip install flash-linear-attention fla-core)")


@pytest.fixture
def tiny_on_gpu(tiny):
    config, base = tiny
    return config, as_dtype(copy.deepcopy(base), torch.bfloat16).cuda()  # the module's CPU model stays as it is


@needs_fla
@pytest.mark.gpu
def test_fla_kernels_equal_plain_on_gpu(tiny_on_gpu):
    """fla's varlen kernels, fused norms and the Triton MoE glue against plain transformers on the GPU."""
    config, base = tiny_on_gpu
    windows = windows_of(LENGTHS, config.vocab_size, seed=7)
    outputs = packed_base_outputs(base, windows, max_tokens_per_batch=400, kernels=fastbase.fla_kernels())
    assert_matches_plain(base, windows, outputs, rel_tol=3e-2, exact_greedy=False)


@needs_fla
@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_on_gpu(tiny_on_gpu):
    config, base = tiny_on_gpu
    uniform = windows_of((64,) * 4, config.vocab_size, seed=8)
    graphed = FastBasePass(base, max_tokens_per_batch=256, kernels=fastbase.fla_kernels(), cuda_graphs=True)
    eager = FastBasePass(base, max_tokens_per_batch=256, kernels=fastbase.fla_kernels())
    for _ in range(2):  # capture, then replay
        g_hidden, g_greedy, _ = graphed.forward_batch(uniform)
    e_hidden, e_greedy, _ = eager.forward_batch(uniform)
    torch.testing.assert_close(g_hidden, e_hidden)
    assert torch.equal(g_greedy, e_greedy)
