"""Every Triton kernel of the library compiles for the GPU it runs on (sm_90: H100, H200), on a
machine without one, with the constants the library launches it with.

The interpreter tests (tests/test_decode_kernels.py, tests/test_moe_kernels.py) check what the
kernels compute, but Triton's interpreter runs Python: a construct the compiler refuses
(a constant where a tensor is needed, a loop it cannot lower) passes there and fails only
on a GPU. Triton compiles for a named target with its own bundled ptxas; no device is needed.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from occamy_mtp.base import decode_kernels  # noqa: E402
from occamy_mtp.base import moe_kernels  # noqa: E402
from occamy_mtp.model import fp8_weights  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
# Qwen3.5-35B-A3B's widths: 16 key heads and 32 value heads of 128 in the Gated DeltaNet (conv
# channels 2 * 2048 + 4096), 256 experts, top-8, expert width 512, hidden 2048.
CONV_CHANNELS, KEY_HEADS, VALUE_HEADS, HEAD_DIM = 8192, 16, 32, 128


def conv_steps(tokens: int):
    signature = {"x": "*bf16", "state": "*bf16", "weight": "*bf16", "bias": "*bf16", "out": "*bf16", "channels": "i32",
                 "x_row": "i32", "x_token": "i32", "out_row": "i32", "out_token": "i32"}
    return decode_kernels._conv_steps_kernel, signature, {"tokens": tokens, "taps": 4, "has_bias": False, "block": 256}


def gated_delta(tokens: int, keep_states: bool = False):
    signature = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "a": "*bf16", "beta": "*bf16", "A_log": "*bf16",
                 "dt_bias": "*bf16", "state": "*fp32", "states": "*fp32", "out": "*bf16", "scale": "fp32", "eps": "fp32",
                 "softplus_threshold": "fp32", "qk_row": "i32", "qk_token": "i32", "qk_head": "i32", "v_row": "i32",
                 "v_token": "i32", "v_head": "i32", "ab_row": "i32", "ab_token": "i32", "state_size": "i32"}
    return decode_kernels._gated_delta_kernel, signature, {"tokens": tokens, "heads": KEY_HEADS, "value_heads": VALUE_HEADS,
                                                           "key_dim": HEAD_DIM, "value_dim": HEAD_DIM, "block": 64,
                                                           "keep_states": keep_states}


def align(chunks: int):
    signature = {"experts": "*i64", "rows": "*i64", "inverse": "*i64", "offsets": "*i32", "pairs": "i32", "top_k": "i32"}
    return moe_kernels._align_kernel, signature, {"chunks": chunks, "block": 1024}


def route():
    signature = {"logits": "*bf16", "weights": "*bf16", "experts": "*i64", "num_experts": "i32"}
    return moe_kernels._route_kernel, signature, {"top_k": 8, "width": 256, "choices": 8}


def silu_mul():
    return moe_kernels._silu_mul_kernel, {"gate_up": "*bf16", "out": "*bf16", "inter": "i32"}, {"block": 512}


def combine():
    signature = {"expert_out": "*bf16", "inverse": "*i64", "weights": "*bf16", "shared": "*bf16", "shared_gate": "*bf16",
                 "out": "*bf16", "dim": "i32"}
    return moe_kernels._combine_kernel, signature, {"top_k": 8, "block": 1024, "has_shared": True}


def expert_gemm(gate_up: bool, m_tiles: int, fp8: bool = False):
    signature = {"a": "*bf16", "rows": "*i64", "offsets": "*i32", "weight": "*fp8e4nv" if fp8 else "*bf16", "out": "*bf16",
                 "out_dim": "i32", "scales": "*fp32" if fp8 else "*bf16", "up_scales": "*fp32" if fp8 else "*bf16",
                 "n_scale_rows": "i32", "n_scale_cols": "i32"}
    block_n, block_k, _, _ = moe_kernels.EXPERT_UP_BLOCKS if gate_up else moe_kernels.EXPERT_DOWN_BLOCKS
    return moe_kernels._expert_gemm_kernel, signature, {"k_dim": 2048 if gate_up else 512, "gate_up": gate_up, "m_tiles": m_tiles,
                                                        "block_m": moe_kernels.EXPERT_BLOCK_M, "block_n": block_n, "block_k": block_k,
                                                        "fp8": fp8, "scale_rows": 128 if fp8 else 1, "scale_cols": 128 if fp8 else 1}


def fp8_dequantize(out: str, routed: bool = False):
    signature = {"codes": "*fp8e4nv", "scale": "*fp32", "out": out, "used": "*i32", "rows": "i32", "cols": "i32",
                 "c_stack": "i64", "c_row": "i32", "s_stack": "i32", "s_row": "i32", "o_stack": "i64", "o_row": "i32"}
    return fp8_weights._dequantize_kernel, signature, {"block_rows": 128, "block_cols": 128, "bf16_bits": out == "*bf16",
                                                       "routed": routed, "elements": fp8_weights._KERNEL_BLOCK,
                                                       "steps": fp8_weights._KERNEL_STEPS}


CASES = {
    "conv, one token": conv_steps(1), "conv, a span of 4": conv_steps(4),
    "rule, one token": gated_delta(1), "rule, a span of 4": gated_delta(4),
    "rule, a span of 4 keeping its states": gated_delta(4, keep_states=True),
    "align, one chunk": align(1), "align, two chunks": align(2),
    "route": route(), "silu_mul": silu_mul(), "combine": combine(),
    "expert gate_up, one token": expert_gemm(True, 1), "expert gate_up, 160 tokens": expert_gemm(True, 10),
    "expert down, 160 tokens": expert_gemm(False, 10),
    "fp8 expert gate_up, one token": expert_gemm(True, 1, fp8=True), "fp8 expert down, 256 tokens": expert_gemm(False, 16, fp8=True),
    "fp8 weights into bf16": fp8_dequantize("*bf16"), "fp8 weights into float32": fp8_dequantize("*fp32"),
    "fp8 routed experts into bf16": fp8_dequantize("*bf16", routed=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_compiles_for_sm90(case):
    kernel, signature, constants = CASES[case]
    assert set(signature) | set(constants) == set(kernel.arg_names)  # the case names every argument, nothing else
    source = ASTSource(fn=kernel, signature={**signature, **{name: "constexpr" for name in constants}}, constexprs=constants)
    compiled = triton.compile(source, target=HOPPER)
    assert ".target sm_90" in compiled.asm["ptx"]
