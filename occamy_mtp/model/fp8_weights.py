"""An FP8 base's routed experts kept in FP8 in memory, each layer's written out for its forward.

A block-wise FP8 base (`occamy_mtp.model.quantized`, the family's layout) read dequantized holds every weight
in `model.dtype`: 64.6 GiB in bf16 at real size. Kept in FP8, its decoder layers' routed experts (96%
of their quantized weights) stay float8_e4m3fn codes beside their checkpoint's block multipliers (one byte a weight),
and the experts a layer computes with are written into one buffer in `model.dtype` once its router has
chosen (only those it chose): the experts' parameters are views of that buffer, which every layer
shares. The layers' other quantized weights (the projections of attention and the Gated DeltaNet, the
shared expert: 2.9 GB in bf16 at real size) are dequantized once when the layer is kept: a forward of
any rows reads all of them, and writing them again before each forward took 7.35 ms of a 15.2 ms
one-token forward on an H100, more than the bf16 base's whole dense GEMMs (bench/results/quantized.md).
A base then holds about half its bf16 bytes, plus those weights in bf16 and its largest layer's
experts in `model.dtype` (1.5 GiB at real size): about 36 GiB.

The weights computed are the ones the dequantizing load computes, bit for bit: each is the code
times its block's multiplier in float32, rounded once to `model.dtype` (`quantized.dequantize_fp8`,
then the load's cast). So everything the base computes is unchanged; only memory and time differ
(tests/test_fp8_weights.py; bench/results/quantized.md).

`materialize(layer)` writes all of a layer's routed experts; `materialize_experts(experts, top_k_index)`
writes those the router chose, once it has. A decode-sized batch of the fast paths does not write the routed
experts at all: their GEMMs read the codes and multipliers themselves (`base.fastbase.fp8_experts`,
`base.moe_kernels.expert_mlp`'s `fp8`). A forward pre-hook on the experts module calls `materialize_experts`
for transformers' own forward; the fast paths call it themselves (`fastbase.grouped_experts`). The write is a fixed sequence of kernels on
fixed buffers, its mask of experts made on the device, so a CUDA graph captures it with the layer.
On CUDA it is one Triton kernel a weight part (`_dequantize_kernel`), elsewhere the plain reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from occamy_mtp.config import FP8_WEIGHTS_CHOICES as MODES

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference below still works
    triton = None

ATTRIBUTE = "occamy_fp8_weights"
"""A decoder layer holding its weights in FP8 carries its `Fp8Layer` under this name."""
EXPERT_STACKS = ("gate_up_proj", "down_proj")  # a fused experts module's (E, rows, cols) parameters
ALIGN_ELEMENTS = 64  # each weight's view starts at a multiple of this many elements of the buffer (128 bytes in bf16)
REFERENCE_CHUNK_ELEMENTS = 2**24  # the reference dequantizes an expert stack this many elements at a time (64 MiB of fp32)


def routed_stack(name: str) -> bool:
    """Whether the module tensor `name` (dotted, from the layer or the checkpoint's root) is a fused routed
    experts' stack, which a layer kept in FP8 holds as codes: "...experts.gate_up_proj" or "...experts.down_proj"."""
    owner, _, attribute = name.rpartition(".")
    return attribute in EXPERT_STACKS and owner.rpartition(".")[2] == "experts"


@dataclass
class Fp8Weight:
    """One parameter of a decoder layer held as FP8 codes: `module.name` (a view of the layers' shared
    buffer) is written from `codes` (float8_e4m3fn, the parameter's shape) and `scales`, one float32
    multiplier per (block[0] x block[1]) block of each row part. A fused experts' gate_up_proj has two
    row parts (gate's rows, then up's), each with its own blocks, as its checkpoint stores them."""

    module: torch.nn.Module
    name: str
    codes: torch.Tensor  # (..., rows, cols) float8_e4m3fn
    rows: tuple[int, ...]  # each part's rows, summing to codes.shape[-2]
    scales: tuple[torch.Tensor, ...]  # each part's (..., ceil(part rows / block[0]), ceil(cols / block[1])) float32
    block: tuple[int, int]
    routed: bool
    """A routed experts' stack (E, rows, cols) (`routed_stack`): written only for the experts a forward routes to."""

    def write(self, used: torch.Tensor | None = None) -> None:
        """Write the weight; of a stack, only the experts `used` marks ((E,) int32, nonzero: write), when given."""
        out = getattr(self.module, self.name)
        start = 0
        for count, scale in zip(self.rows, self.scales):
            dequantize_into(out[..., start:start + count, :], self.codes[..., start:start + count, :], scale, self.block, used)
            start += count


class Fp8Layer:
    """A decoder layer's routed experts held in FP8 (`Fp8Weight`s) and the buffer they are written into."""

    def __init__(self, weights: list[Fp8Weight], buffer: torch.Tensor):
        self.weights, self.buffer = weights, buffer

    def materialize(self) -> None:
        """Write every expert of every stack (`materialize_experts` writes those the router chose)."""
        with torch.no_grad():
            for weight in self.weights:
                weight.write()

    def materialize_experts(self, top_k_index: torch.Tensor) -> None:
        """Write the routed experts' stacks for the experts `top_k_index` (N, k) names, and no other: a
        decode step of a few rows touches a few dozen of 256 experts. Indices past the last expert (the
        padding of expert parallelism) are ignored. The mask is made on the device, without a sync, so
        that a CUDA graph captures it."""
        experts = self.weights[0].codes.shape[0]
        with torch.no_grad():
            used = torch.zeros(experts + 1, dtype=torch.int32, device=top_k_index.device)
            used.scatter_(0, top_k_index.reshape(-1).long().clamp(max=experts), 1)  # a scatter: no sync, captured
            for weight in self.weights:
                weight.write(used[:experts])


def materialize(layer: torch.nn.Module) -> None:
    """Write all of `layer`'s routed experts from their FP8 codes, when it holds them (a no-op otherwise)."""
    held = getattr(layer, ATTRIBUTE, None)
    if held is not None:
        held.materialize()


def materialize_experts(experts: torch.nn.Module, top_k_index: torch.Tensor) -> None:
    """Write the routed experts' weights for the experts `top_k_index` names, when `experts` (a fused
    experts module) belongs to a layer kept in FP8 (a no-op otherwise)."""
    held = getattr(experts, ATTRIBUTE, None)
    if held is not None:
        held.materialize_experts(top_k_index)


def keeps_fp8(mode: str, device) -> bool:
    """Whether a base loaded on `device` keeps an FP8 checkpoint's weights in FP8 (`model.fp8_weights`):
    `fp8` always, `dequantized` never, `auto` on a CUDA device (where the memory matters; on the CPU
    the dequantization a forward would cost more than the memory saved)."""
    if mode not in MODES:
        raise ValueError(f"fp8_weights {mode!r}: expected one of {', '.join(MODES)}")
    return mode == "fp8" or (mode == "auto" and torch.device(device).type == "cuda")


def keep_layer(layer: torch.nn.Module, held: dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[torch.Tensor, ...]]],
               block: tuple[int, int], dtype: torch.dtype, buffers: dict) -> Fp8Layer | None:
    """Keep `layer`'s routed experts named in `held` (dotted names within the layer -> (codes, row parts,
    their multipliers)) in FP8: their parameters become views of one `dtype` buffer, shared through
    `buffers` by every layer kept so far (the layers run one at a time, so one layer's experts are all
    that is ever written at once), and the `Fp8Layer` that writes them (`materialize_experts`) is
    attached, with forward pre-hooks for transformers' forward. A layer larger than the buffer gets a
    larger one, and the layers before it move to it. The buffer starts as zeros: nothing is computed
    before a write. Every other weight in `held` is written into a parameter of its own now, once (the
    values the dequantizing load reads); None when `held` names no routed experts."""
    weights = []
    for name in sorted(held):
        weight_codes, rows, scales = held[name]
        owner_name, _, attribute = name.rpartition(".")
        weights.append(Fp8Weight(layer.get_submodule(owner_name), attribute, weight_codes, rows, scales, block, routed_stack(name)))
    # The dense weights (every projection but the routed experts: 4% of the bytes at real size) are written
    # into their own parameters here, once: a forward of any rows reads all of them, and writing them again
    # before each forward cost more than the bf16 base's whole dense GEMMs (bench/results/quantized.md).
    with torch.no_grad():
        for weight in [w for w in weights if not w.routed]:
            weight.module._parameters[weight.name] = torch.nn.Parameter(
                torch.empty(weight.codes.shape, dtype=dtype, device=weight.codes.device), requires_grad=False)
            weight.write()
    weights = [w for w in weights if w.routed]
    if not weights:
        return None
    device = weights[0].codes.device
    need = aligned_size([w.codes.numel() for w in weights])  # laid out in this order (`_view_into`)
    shared = buffers.setdefault((dtype, str(device)), {"buffer": torch.zeros(0, dtype=dtype, device=device), "layers": []})
    if shared["buffer"].numel() < need:
        shared["buffer"] = torch.zeros(need, dtype=dtype, device=device)
        for earlier in shared["layers"]:
            _view_into(earlier, shared["buffer"])
    kept = Fp8Layer(weights, shared["buffer"])
    _view_into(kept, shared["buffer"])
    shared["layers"].append(kept)
    for number, weight in enumerate(weights):  # the layer's buffers too, so that what it holds is counted (`memory.held_bytes`)
        layer.register_buffer(f"fp8_codes_{number}", weight.codes, persistent=False)
        for part, scale in enumerate(weight.scales):
            layer.register_buffer(f"fp8_scales_{number}_{part}", scale, persistent=False)
    setattr(layer, ATTRIBUTE, kept)
    # transformers' forward: the experts once routed (the experts module's inputs are the hidden states,
    # top_k_index and top_k_weights).
    for owner in {id(w.module): w.module for w in weights}.values():
        setattr(owner, ATTRIBUTE, kept)
        owner.register_forward_pre_hook(lambda module, args: kept.materialize_experts(args[1]))
    return kept


def aligned_size(sizes: list[int]) -> int:
    """Elements a layer's weights of `sizes` take laid out one after another, each from a multiple of
    `ALIGN_ELEMENTS` (the grouped GEMMs want their operands 16-byte aligned; every weight here has the
    hidden size as a dimension, so at real sizes nothing is padded)."""
    end = 0
    for size in sizes:
        end = _aligned(end) + size
    return end


def _aligned(offset: int) -> int:
    """`offset` rounded up to a multiple of `ALIGN_ELEMENTS`."""
    return -(-offset // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def _view_into(kept: Fp8Layer, buffer: torch.Tensor) -> None:
    """Point `kept`'s parameters at consecutive views of `buffer`, from its start, each aligned."""
    offset = 0
    for weight in kept.weights:
        offset = _aligned(offset)
        view = buffer[offset:offset + weight.codes.numel()].view(weight.codes.shape)
        weight.module._parameters[weight.name] = torch.nn.Parameter(view, requires_grad=False)
        offset += weight.codes.numel()
    kept.buffer = buffer


# ----------------------------------------------------------------------------------
# The write: a Triton kernel on CUDA, beside its plain reference
# ----------------------------------------------------------------------------------


def dequantize_reference(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """`codes` (..., rows, cols) times their blocks' float32 multipliers, in float32, rounded to `dtype`:
    what the dequantizing load computes (`quantized.dequantize_fp8`, then the cast)."""
    from occamy_mtp.model.quantized import dequantize_fp8

    return dequantize_fp8(codes, scale, block).to(dtype)


def dequantize_into(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                    used: torch.Tensor | None = None) -> None:
    """Write `dequantize_reference(codes, scale, block, out.dtype)` into `out` (a view of the same shape,
    any strides): the Triton kernel on CUDA, else the reference a leading slice at a time. `used` ((E,)
    int32, a stack of E): only the slices it marks nonzero are written; the others keep what they held."""
    if _kernel_runs(out):
        _dequantize_triton(out, codes, scale, block, used)
        return
    if codes.dim() == 2:
        out.copy_(dequantize_reference(codes, scale, block, out.dtype))
        return
    chosen = torch.arange(codes.shape[0], device=codes.device) if used is None else used.nonzero().flatten().to(codes.device)
    step = max(1, REFERENCE_CHUNK_ELEMENTS // max(1, codes[0].numel()))
    for first in range(0, len(chosen), step):
        part = chosen[first:first + step]
        out.index_copy_(0, part.to(out.device), dequantize_reference(codes[part], scale[part], block, out.dtype).to(out.device))


def _kernel_runs(tensor: torch.Tensor) -> bool:
    """The kernel runs on CUDA, or anywhere under Triton's interpreter (`TRITON_INTERPRET=1` set before
    Triton was imported; the CPU tests use it)."""
    return triton is not None and (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


_KERNEL_BLOCK = 1024  # elements a vector step
_KERNEL_STEPS = 16  # vector steps a program: a program writes 16,384 consecutive elements

if triton is not None:

    @triton.jit
    def _dequantize_kernel(codes, scale, out, used, rows, cols,
                           c_stack, c_row, s_stack, s_row, o_stack, o_row,
                           block_rows: tl.constexpr, block_cols: tl.constexpr, bf16_bits: tl.constexpr,
                           routed: tl.constexpr, elements: tl.constexpr, steps: tl.constexpr):
        # Program (c, s): the c-th `steps * elements` consecutive elements, in row-major order, of slice s
        # of the (stack, rows, cols) weight, `elements` at a time; each the code times its block's
        # multiplier in fp32, rounded once to the output's dtype. With `routed`, a program of a slice
        # `used` does not mark returns at once: a decode step's few experts cost little more than
        # their own bytes (the grid is fixed, so that a CUDA graph captures it).
        stack = tl.program_id(1).to(tl.int64)
        if routed:
            if tl.load(used + stack) == 0:
                return
        first = tl.program_id(0).to(tl.int64) * (steps * elements)
        for step in range(steps):
            index = first + step * elements + tl.arange(0, elements)
            inside = index < rows * cols
            col = index % cols
            row = index // cols
            code = tl.load(codes + stack * c_stack + row * c_row + col, mask=inside, other=0.0).to(tl.float32)
            multiplier = tl.load(scale + stack * s_stack + (row // block_rows) * s_row + col // block_cols,
                                 mask=inside, other=0.0)
            value = code * multiplier
            if bf16_bits:
                # Rounded to bf16 by hand, to nearest, ties to even: what the cast computes on the GPU,
                # and what Triton's interpreter (which truncates) does not. The bits then read as bf16.
                bits = value.to(tl.uint32, bitcast=True)
                value = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            tl.store(out + stack * o_stack + row * o_row + col, value.to(out.dtype.element_ty), mask=inside)


def _dequantize_triton(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                       used: torch.Tensor | None = None) -> None:
    # As a (stack, rows, cols) weight whose last dimension is contiguous (a row part of a fused
    # experts tensor is strided in its rows only).
    out3, codes3, scale3 = (t if t.dim() == 3 else t.unsqueeze(0) for t in (out, codes, scale))
    for t, what in ((out3, "output"), (codes3, "codes"), (scale3, "multipliers")):
        if t.stride(-1) != 1:
            raise ValueError(f"FP8 dequantization: the {what}' last dimension must be contiguous")
    stack, rows, cols = codes3.shape
    bf16 = out3.dtype == torch.bfloat16
    grid = (triton.cdiv(rows * cols, _KERNEL_BLOCK * _KERNEL_STEPS), stack)  # the stack second: at most 65,535 slices
    _dequantize_kernel[grid](codes3, scale3.float(), out3,
                             codes3 if used is None else used, rows, cols,
                             codes3.stride(0), codes3.stride(1), scale3.stride(0), scale3.stride(1),
                             out3.stride(0), out3.stride(1), block_rows=block[0], block_cols=block[1],
                             bf16_bits=bf16, routed=used is not None, elements=_KERNEL_BLOCK,
                             steps=_KERNEL_STEPS)
