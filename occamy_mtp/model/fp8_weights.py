"""An FP8 base's weights kept in FP8 in memory, each decoder layer's dequantized for its forward.

A block-wise FP8 base (`model.quantized`, the family's layout) read dequantized holds every weight
in `model.dtype`: 64.6 GiB in bf16 at real size. Kept in FP8, its decoder layers' quantized weights
stay float8_e4m3fn codes beside their checkpoint's block multipliers (one byte a weight), and the
weights a layer computes with are written into one buffer in `model.dtype` just before the layer
runs: the layer's parameters are views of that buffer, which every layer of the same shapes shares.
A base then holds about half its bf16 bytes plus one layer's weights in `model.dtype` a layer kind
(1.6 GiB at real size).

The weights computed are the ones the dequantizing load computes, bit for bit: each is the code
times its block's multiplier in float32, rounded once to `model.dtype` (`quantized.dequantize_fp8`,
then the load's cast). So everything the base computes is unchanged; only memory and time differ
(tests/test_fp8_weights.py; bench/RESULTS.md, "An FP8 base kept in FP8").

`materialize(layer)` writes a layer's weights. A forward pre-hook calls it for transformers' own
forward; the fast paths, which unroll the decoder layer, call it themselves (`fastbase.decoder_layer`).
The write is a fixed sequence of kernels on fixed buffers, so a CUDA graph captures it with the layer.
On CUDA it is one Triton kernel a weight part (`_dequantize_kernel`), elsewhere the plain reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference below still works
    triton = None

ATTRIBUTE = "occamy_fp8_weights"
"""A decoder layer holding its weights in FP8 carries its `Fp8Layer` under this name."""
MODES = ("auto", "fp8", "dequantized")
REFERENCE_CHUNK_ELEMENTS = 2**24  # the reference dequantizes an expert stack this many elements at a time (64 MiB of fp32)


@dataclass
class Fp8Weight:
    """One parameter of a decoder layer held as FP8 codes: `module.name` (a view of the layer kind's
    buffer) is written from `codes` (float8_e4m3fn, the parameter's shape) and `scales`, one float32
    multiplier per (block[0] x block[1]) block of each row part. A fused experts' gate_up_proj has two
    row parts (gate's rows, then up's), each with its own blocks, as its checkpoint stores them."""

    module: torch.nn.Module
    name: str
    codes: torch.Tensor  # (..., rows, cols) float8_e4m3fn
    rows: tuple[int, ...]  # each part's rows, summing to codes.shape[-2]
    scales: tuple[torch.Tensor, ...]  # each part's (..., ceil(part rows / block[0]), ceil(cols / block[1])) float32
    block: tuple[int, int]

    def write(self) -> None:
        out = getattr(self.module, self.name)
        start = 0
        for count, scale in zip(self.rows, self.scales):
            dequantize_into(out[..., start:start + count, :], self.codes[..., start:start + count, :], scale, self.block)
            start += count


class Fp8Layer:
    """A decoder layer's FP8 weights (`Fp8Weight`s) and the buffer they are written into."""

    def __init__(self, weights: list[Fp8Weight], buffer: torch.Tensor):
        self.weights, self.buffer = weights, buffer

    def materialize(self) -> None:
        with torch.no_grad():
            for weight in self.weights:
                weight.write()


def materialize(layer: torch.nn.Module) -> None:
    """Write `layer`'s weights from its FP8 codes, when it holds them (a no-op otherwise)."""
    held = getattr(layer, ATTRIBUTE, None)
    if held is not None:
        held.materialize()


def keeps_fp8(mode: str, device) -> bool:
    """Whether a base loaded on `device` keeps an FP8 checkpoint's weights in FP8 (`model.fp8_weights`):
    `fp8` always, `dequantized` never, `auto` on a CUDA device (where the memory matters; on the CPU
    the dequantization a forward would cost more than the memory saved)."""
    if mode not in MODES:
        raise ValueError(f"fp8_weights {mode!r}: expected one of {', '.join(MODES)}")
    return mode == "fp8" or (mode == "auto" and torch.device(device).type == "cuda")


def keep_layer(layer: torch.nn.Module, held: dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[torch.Tensor, ...]]],
               block: tuple[int, int], dtype: torch.dtype, buffers: dict) -> Fp8Layer:
    """Make `layer`'s parameters named in `held` (dotted names within the layer -> (codes, row parts,
    their multipliers)) views of one `dtype` buffer, shared through `buffers` by every layer with the
    same names and shapes, and attach the `Fp8Layer` that writes them (`materialize`), with a forward
    pre-hook for transformers' forward. The buffer starts as zeros: nothing is computed before a write."""
    codes = {name: value[0] for name, value in held.items()}
    device = next(iter(codes.values())).device
    kind = (dtype, str(device), tuple((name, tuple(c.shape)) for name, c in sorted(codes.items())))
    if kind not in buffers:
        buffers[kind] = torch.zeros(sum(c.numel() for c in codes.values()), dtype=dtype, device=device)
    buffer = buffers[kind]
    weights, offset = [], 0
    for name in sorted(held):
        weight_codes, rows, scales = held[name]
        owner_name, _, attribute = name.rpartition(".")
        owner = layer.get_submodule(owner_name)
        view = buffer[offset:offset + weight_codes.numel()].view(weight_codes.shape)
        owner._parameters[attribute] = torch.nn.Parameter(view, requires_grad=False)
        weights.append(Fp8Weight(owner, attribute, weight_codes, rows, scales, block))
        offset += weight_codes.numel()
    for number, weight in enumerate(weights):  # the layer's buffers too, so that what it holds is counted (`memory.held_bytes`)
        layer.register_buffer(f"fp8_codes_{number}", weight.codes, persistent=False)
        for part, scale in enumerate(weight.scales):
            layer.register_buffer(f"fp8_scales_{number}_{part}", scale, persistent=False)
    kept = Fp8Layer(weights, buffer)
    setattr(layer, ATTRIBUTE, kept)
    layer.register_forward_pre_hook(lambda module, args: kept.materialize())
    return kept


# ----------------------------------------------------------------------------------
# The write: a Triton kernel on CUDA, beside its plain reference
# ----------------------------------------------------------------------------------


def dequantize_reference(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """`codes` (..., rows, cols) times their blocks' float32 multipliers, in float32, rounded to `dtype`:
    what the dequantizing load computes (`quantized.dequantize_fp8`, then the cast)."""
    from occamy_mtp.model.quantized import dequantize_fp8

    return dequantize_fp8(codes, scale, block).to(dtype)


def dequantize_into(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    """Write `dequantize_reference(codes, scale, block, out.dtype)` into `out` (a view of the same shape,
    any strides): the Triton kernel on CUDA, else the reference a leading slice at a time."""
    if _kernel_runs(out):
        _dequantize_triton(out, codes, scale, block)
        return
    if codes.dim() == 2:
        out.copy_(dequantize_reference(codes, scale, block, out.dtype))
        return
    step = max(1, REFERENCE_CHUNK_ELEMENTS // max(1, codes[0].numel()))
    for first in range(0, codes.shape[0], step):
        part = slice(first, first + step)
        out[part].copy_(dequantize_reference(codes[part], scale[part], block, out.dtype))


def _kernel_runs(tensor: torch.Tensor) -> bool:
    """The kernel runs on CUDA, or anywhere under Triton's interpreter (`TRITON_INTERPRET=1` set before
    Triton was imported; the CPU tests use it)."""
    return triton is not None and (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


_KERNEL_BLOCK = 1024  # elements a program

if triton is not None:

    @triton.jit
    def _dequantize_kernel(codes, scale, out, total, rows, cols,
                           c_stack, c_row, s_stack, s_row, o_stack, o_row,
                           block_rows: tl.constexpr, block_cols: tl.constexpr, bf16_bits: tl.constexpr,
                           elements: tl.constexpr):
        # One program: `elements` consecutive elements of the (stack, rows, cols) weight, in row-major
        # order; each the code times its block's multiplier in fp32, rounded once to the output's dtype.
        index = tl.program_id(0).to(tl.int64) * elements + tl.arange(0, elements)
        inside = index < total
        col = index % cols
        row = (index // cols) % rows
        stack = index // (cols * rows)
        code = tl.load(codes + stack * c_stack + row * c_row + col, mask=inside, other=0.0).to(tl.float32)
        multiplier = tl.load(scale + stack * s_stack + (row // block_rows) * s_row + col // block_cols, mask=inside, other=0.0)
        value = code * multiplier
        if bf16_bits:
            # bf16 written as its bits (`out` viewed as uint16), rounded to nearest, ties to even, by
            # hand: what the cast computes on the GPU, and what Triton's interpreter (which truncates) does not.
            bits = value.to(tl.uint32, bitcast=True)
            value = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
        tl.store(out + stack * o_stack + row * o_row + col, value.to(out.dtype.element_ty), mask=inside)


def _dequantize_triton(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    # As a (stack, rows, cols) weight whose last dimension is contiguous (a row part of a fused
    # experts tensor is strided in its rows only).
    out3, codes3, scale3 = (t if t.dim() == 3 else t.unsqueeze(0) for t in (out, codes, scale))
    for t, what in ((out3, "output"), (codes3, "codes"), (scale3, "multipliers")):
        if t.stride(-1) != 1:
            raise ValueError(f"FP8 dequantization: the {what}' last dimension must be contiguous")
    stack, rows, cols = codes3.shape
    total = stack * rows * cols
    bf16 = out3.dtype == torch.bfloat16
    grid = (triton.cdiv(total, _KERNEL_BLOCK),)
    _dequantize_kernel[grid](codes3, scale3.float(), out3.view(torch.uint16) if bf16 else out3, total, rows, cols,
                             codes3.stride(0), codes3.stride(1), scale3.stride(0), scale3.stride(1),
                             out3.stride(0), out3.stride(1), block_rows=block[0], block_cols=block[1],
                             bf16_bits=bf16, elements=_KERNEL_BLOCK)
