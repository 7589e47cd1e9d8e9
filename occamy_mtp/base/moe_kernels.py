"""Triton kernels for the MoE block of the fast base pass and the decode step.

At real size (N tokens, top-8 of 256 experts, D = 2048, I = 512) the two grouped
GEMMs of a MoE layer are surrounded by element-wise passes over (N * 8)-row tensors
that cost about half as much as the GEMMs themselves (bench/results/base-pass.md); in a
decode step, where N is one row or a few hundred, it is the number of kernels that costs
(each is a launch of a few microseconds, about thirty a layer), and torch's grouped GEMM
reads the experts at two thirds of the memory bandwidth with 2 to 5 rows an expert. These
kernels take their place, each beside the plain PyTorch computation it replaces, which is
its oracle (tests/test_moe_kernels.py):

* `route`: the router's softmax in fp32, its top-k and their renormalisation
  (transformers' `Qwen3_5MoeTopKRouter` after its linear), one program a token.
* `align`: the (token, choice) pairs ordered by expert, the GEMMs' group offsets and
  the way back, one program an expert (what a sort, a histogram, a cumulative sum and
  an inverse permutation did), for up to `ALIGN_MAX_PAIRS` pairs.
* `silu_mul`: SiLU(gate) * up of the gate_up GEMM's output, in one read and one write
  instead of three passes.
* `combine`: the un-sort of the expert outputs back to token order, their sum weighted
  by the routing weights, and the shared expert's sigmoid-gated output, in one read of
  each input and one write of the (N, D) result, accumulating in fp32.
* `expert_mlp`: for decode-sized batches (a few rows an expert), the routed experts'
  two GEMMs themselves, each program streaming one slice of one expert's weights past all
  of that expert's rows: the gather of the rows, gate_up and SiLU(gate) * up in one kernel,
  down in another, where a gather, two grouped GEMMs and `silu_mul` were.

All are for the frozen base's forward only (no autograd).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference functions below still work
    triton = None


ALIGN_MAX_PAIRS = 16384  # `align` scans every pair once per expert: for decode-sized batches, not a whole pass
# `expert_mlp` walks an expert's rows in tiles of EXPERT_BLOCK_M, unrolled, enough tiles for every
# token of the batch (an expert sees a token at most once): for decode-sized batches only.
EXPERT_BLOCK_M, EXPERT_MAX_TOKENS = 16, 256


def route_reference(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (N, k) in the logits' dtype, experts (N, k) long) of transformers' Qwen3.5-MoE router
    after its linear: softmax in fp32, the top k, renormalised to sum to one."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, experts = torch.topk(probs, top_k, dim=-1)
    return (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype), experts


def align_reference(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs in expert order, for the grouped GEMMs.

    experts: (N, k) chosen experts. Returns (rows, inverse, offsets): rows (S,) long, the
    token of each pair in expert order (S = N * k; pairs of one expert in their flat
    order); inverse (S,) long, where pair n * k + j sits in that order; offsets (E,) int32,
    the end of each expert's group (what torch's grouped GEMM takes).
    """
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=num_experts)
    return order // experts.shape[1], inverse, torch.cumsum(counts, dim=0).to(torch.int32)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """(S, 2I) -> (S, I): SiLU of the first half times the second, as transformers' experts do."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def combine_reference(
    expert_out: torch.Tensor,
    inverse: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed output of every token plus its gated shared-expert output, in fp32 (fp64 for fp64 inputs), rounded once.

    expert_out: (S, D) rows in expert-sorted order, S = N * k.
    inverse: (S,) long; `expert_out[inverse[n * k + j]]` is token n's j-th choice.
    weights: (N, k) routing weights. shared: (N, D) and shared_gate: (N, 1) logits, or None.
    """
    tokens, top_k = weights.shape
    wide = torch.promote_types(expert_out.dtype, torch.float32)
    rows = expert_out[inverse].view(tokens, top_k, -1).to(wide)
    out = (weights.to(wide).unsqueeze(-1) * rows).sum(1)
    if shared is not None:
        out = out + torch.sigmoid(shared_gate.to(wide)) * shared.to(wide)
    return out.to(expert_out.dtype)


def expert_mlp_reference(
    x: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor
) -> torch.Tensor:
    """(S, D) expert outputs in expert order: pair s, of expert e (its group ends at offsets[e]),
    is `down_proj[e] @ (SiLU(gate) * up)` with `gate, up = gate_up_proj[e] @ x[rows[s]]` split in halves.

    x: (N, D) tokens; rows: (S,) the token of each pair in expert order (`align`); offsets:
    (E,) int32 group ends; gate_up_proj: (E, 2I, D); down_proj: (E, D, I), transformers' layout.
    An expert at a time, in the inputs' dtype between the two GEMMs (as the grouped GEMMs round).
    """
    out = x.new_empty(rows.numel(), down_proj.shape[1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            hidden = silu_mul_reference(x[rows[start:end]] @ gate_up_proj[expert].T)
            out[start:end] = hidden @ down_proj[expert].T
        start = end
    return out


def available(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on this tensor: on CUDA, or anywhere under Triton's
    interpreter (`TRITON_INTERPRET=1` before this module is imported; the CPU tests use it)."""
    return triton is not None and (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:
    # Only core `tl` builtins (no `tl.zeros`, `tl.sigmoid`: those are jitted library
    # functions, which Triton's interpreter cannot run unless it was on at import).

    @triton.jit
    def _silu_mul_kernel(gate_up, out, inter, block: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * block + tl.arange(0, block)
        mask = cols < inter
        gate = tl.load(gate_up + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        value = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out + row * inter + cols, value.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _combine_kernel(
        expert_out, inverse, weights, shared, shared_gate, out, dim,
        top_k: tl.constexpr, block: tl.constexpr, has_shared: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * block + tl.arange(0, block)
        mask = cols < dim
        acc = tl.full([block], 0.0, dtype=tl.float32)
        for j in tl.static_range(top_k):
            row = tl.load(inverse + token * top_k + j).to(tl.int64)
            weight = tl.load(weights + token * top_k + j).to(tl.float32)
            acc += weight * tl.load(expert_out + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
        if has_shared:
            gate = tl.load(shared_gate + token).to(tl.float32)
            acc += tl.load(shared + token * dim + cols, mask=mask, other=0.0).to(tl.float32) / (1.0 + tl.exp(-gate))
        tl.store(out + token * dim + cols, acc.to(out.dtype.element_ty), mask=mask)


    @triton.jit
    def _route_kernel(logits, weights, experts, num_experts, top_k: tl.constexpr, width: tl.constexpr, choices: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, width)
        x = tl.load(logits + token * num_experts + cols, mask=cols < num_experts, other=float("-inf")).to(tl.float32)
        x = tl.exp(x - tl.max(x, axis=0))
        probs = x / tl.sum(x, axis=0)
        slots = tl.arange(0, choices)
        top = tl.full([choices], 0.0, dtype=tl.float32)
        chosen = tl.full([choices], 0, dtype=tl.int64)
        for j in tl.static_range(top_k):  # the largest left, lowest index on a tie
            best = tl.max(probs, axis=0)
            where = tl.min(tl.where(probs == best, cols, width), axis=0)
            where = tl.minimum(where, num_experts - 1)  # a NaN row matches nothing: still a valid expert, as topk's
            top = tl.where(slots == j, best, top)
            chosen = tl.where(slots == j, where.to(tl.int64), chosen)
            probs = tl.where(cols == where, -1.0, probs)
        top = top / tl.sum(top, axis=0)
        tl.store(weights + token * top_k + slots, top.to(weights.dtype.element_ty), mask=slots < top_k)
        tl.store(experts + token * top_k + slots, chosen, mask=slots < top_k)

    @triton.jit
    def _align_kernel(experts, rows, inverse, offsets, pairs, top_k, chunks: tl.constexpr, block: tl.constexpr):
        expert = tl.program_id(0)
        before = 0  # pairs of lower experts: where this expert's group starts
        for chunk in tl.static_range(chunks):  # a constant trip count: Triton's interpreters of every version run it
            at = chunk * block + tl.arange(0, block)
            ids = tl.load(experts + at, mask=at < pairs, other=0)
            before += tl.sum(tl.where((at < pairs) & (ids < expert), 1, 0), axis=0)
        end = before
        for chunk in tl.static_range(chunks):
            at = chunk * block + tl.arange(0, block)
            ids = tl.load(experts + at, mask=at < pairs, other=0)
            mine = (at < pairs) & (ids == expert)
            slot = end + tl.cumsum(tl.where(mine, 1, 0), axis=0) - 1
            tl.store(rows + slot, (at // top_k).to(tl.int64), mask=mine)
            tl.store(inverse + at, slot.to(tl.int64), mask=mine)
            end += tl.sum(tl.where(mine, 1, 0), axis=0)
        tl.store(offsets + expert, end.to(tl.int32))


    @triton.jit
    def _weight_tile(weight_rows, scales, rows, row_mask, k0, ks, mask, k_dim, fp8: tl.constexpr, scale_rows: tl.constexpr,
                     scale_cols: tl.constexpr, n_scale_cols, dtype: tl.constexpr):
        """The (block_k, block_n) tile of weights `rows` x `ks` (`weight_rows` points at the expert's first
        row), in `dtype`; from FP8 codes, each times its (scale_rows x scale_cols) block's multiplier in
        fp32, rounded once to `dtype`: what dequantizing the weight first writes, element for element.
        The tile's k columns lie in one block of multipliers (`expert_mlp` sizes block_k so), so a row's
        multiplier is one load of a row vector, not one a weight."""
        tile = tl.load(weight_rows + rows[None, :].to(tl.int64) * k_dim + ks[:, None], mask=mask, other=0.0)
        if fp8:
            scale = tl.load(scales + (rows // scale_rows) * n_scale_cols + k0 // scale_cols, mask=row_mask, other=0.0)
            tile = (tile.to(tl.float32) * scale[None, :]).to(dtype)
        return tile

    @triton.jit
    def _expert_gemm_kernel(
        a, rows, offsets, weight, out, out_dim, scales, up_scales, n_scale_rows, n_scale_cols,
        k_dim: tl.constexpr, gate_up: tl.constexpr, m_tiles: tl.constexpr,
        block_m: tl.constexpr, block_n: tl.constexpr, block_k: tl.constexpr,
        fp8: tl.constexpr, scale_rows: tl.constexpr, scale_cols: tl.constexpr,
    ):
        """out[s, cols] for every pair s of one expert (program_id 0) and one slice of output
        columns (program_id 1). gate_up: SiLU(a[rows[s]] . gate rows) * (a[rows[s]] . up rows), the
        gate rows the expert's first out_dim, the up rows its next out_dim; else a[s] . weight rows.
        fp8: the weights are float8_e4m3fn codes with one fp32 multiplier a (scale_rows x scale_cols)
        block (`scales`, the gate's or the only part's, (E, n_scale_rows, n_scale_cols); `up_scales`,
        the up rows'), each tile dequantized as it is read (`_weight_tile`)."""
        expert = tl.program_id(0)
        cols = tl.program_id(1) * block_n + tl.arange(0, block_n)
        col_mask = cols < out_dim
        end = tl.load(offsets + expert)
        start = tl.where(expert > 0, tl.load(offsets + tl.maximum(expert - 1, 0)), 0)
        weight_rows = 2 * out_dim if gate_up else out_dim
        first_weight = weight + expert.to(tl.int64) * weight_rows * k_dim
        expert_scales = scales + expert.to(tl.int64) * n_scale_rows * n_scale_cols
        expert_up_scales = up_scales + expert.to(tl.int64) * n_scale_rows * n_scale_cols
        for tile in tl.static_range(m_tiles):  # a constant trip count (the interpreters of every Triton)
            first = start + tile * block_m
            if first < end:  # the expert's rows ran out: nothing to read
                m = first + tl.arange(0, block_m)
                m_mask = m < end
                if gate_up:
                    source = tl.load(rows + m, mask=m_mask, other=0).to(tl.int64)
                else:
                    source = m.to(tl.int64)
                acc = tl.full([block_m, block_n], 0.0, dtype=tl.float32)
                acc_up = tl.full([block_m, block_n], 0.0, dtype=tl.float32)
                for k0 in range(0, k_dim, block_k):
                    ks = k0 + tl.arange(0, block_k)
                    k_mask = ks < k_dim
                    a_tile = tl.load(a + source[:, None] * k_dim + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                    w_mask = k_mask[:, None] & col_mask[None, :]
                    w_tile = _weight_tile(first_weight, expert_scales, cols, col_mask, k0, ks, w_mask, k_dim, fp8,
                                          scale_rows, scale_cols, n_scale_cols, a.dtype.element_ty)
                    acc += tl.dot(a_tile, w_tile)
                    if gate_up:
                        up_tile = _weight_tile(first_weight + out_dim * k_dim, expert_up_scales, cols, col_mask, k0, ks,
                                               w_mask, k_dim, fp8, scale_rows, scale_cols, n_scale_cols, a.dtype.element_ty)
                        acc_up += tl.dot(a_tile, up_tile)
                if gate_up:
                    acc = acc.to(out.dtype.element_ty).to(tl.float32)  # rounded where the grouped GEMM rounds
                    acc_up = acc_up.to(out.dtype.element_ty).to(tl.float32)
                    acc = acc / (1.0 + tl.exp(-acc)) * acc_up
                tl.store(out + m[:, None].to(tl.int64) * out_dim + cols[None, :], acc.to(out.dtype.element_ty),
                         mask=m_mask[:, None] & col_mask[None, :])


# (block_n, block_k, num_warps, num_stages) of expert_mlp's two kernels; bench/bench_expert_gemms.py measures them.
EXPERT_UP_BLOCKS = (64, 128, 4, 3)
EXPERT_DOWN_BLOCKS = (64, 128, 4, 3)


def _block(width: int) -> int:
    return min(1024, triton.next_power_of_2(width))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_mul_reference` in one Triton kernel (fp32 inside, one rounding)."""
    if not available(gate_up):
        return silu_mul_reference(gate_up)
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    inter = width // 2
    out = gate_up.new_empty(rows, inter)
    if rows:
        block = _block(inter)
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, block=block)
    return out


def combine(
    expert_out: torch.Tensor,
    inverse: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """`combine_reference` in one Triton kernel."""
    if (shared is None) != (shared_gate is None):
        raise ValueError("combine: pass both shared and shared_gate, or neither")
    if not available(expert_out):
        return combine_reference(expert_out, inverse, weights, shared, shared_gate)
    tokens, top_k = weights.shape
    dim = expert_out.shape[-1]
    if inverse.numel() != tokens * top_k or expert_out.shape[0] != tokens * top_k:
        raise ValueError(
            f"combine: {tokens} tokens x {top_k} choices need {tokens * top_k} expert rows and indices, "
            f"got {expert_out.shape[0]} rows and {inverse.numel()} indices"
        )
    expert_out, inverse, weights = expert_out.contiguous(), inverse.contiguous(), weights.contiguous()
    if shared is not None:
        shared, shared_gate = shared.contiguous(), shared_gate.contiguous()
    out = expert_out.new_empty(tokens, dim)
    if tokens:
        block = _block(dim)
        _combine_kernel[(tokens, triton.cdiv(dim, block))](
            expert_out, inverse, weights,
            shared if shared is not None else out, shared_gate if shared_gate is not None else weights,
            out, dim, top_k=top_k, block=block, has_shared=shared is not None,
        )
    return out


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_reference` in one Triton kernel (one program a token)."""
    if not available(logits):
        return route_reference(logits, top_k)
    tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"route: top_k must be 1 to {num_experts}, got {top_k}")
    logits = logits.contiguous()
    weights = logits.new_empty(tokens, top_k)
    experts = torch.empty(tokens, top_k, dtype=torch.long, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](logits, weights, experts, num_experts, top_k=top_k,
                                 width=triton.next_power_of_2(num_experts), choices=triton.next_power_of_2(top_k))
    return weights, experts


def align(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`align_reference` in one Triton kernel (one program an expert), for up to `ALIGN_MAX_PAIRS` pairs."""
    if not available(experts):
        return align_reference(experts, num_experts)
    pairs = experts.numel()
    if pairs > ALIGN_MAX_PAIRS:
        raise ValueError(f"align: at most {ALIGN_MAX_PAIRS} (token, choice) pairs, got {pairs}")
    flat = experts.reshape(-1).contiguous()
    rows = torch.empty(pairs, dtype=torch.long, device=experts.device)
    inverse = torch.empty_like(rows)
    if not pairs:
        return rows, inverse, torch.zeros(num_experts, dtype=torch.int32, device=experts.device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=experts.device)
    block = 1024
    _align_kernel[(num_experts,)](flat, rows, inverse, offsets, pairs, experts.shape[1], chunks=triton.cdiv(pairs, block), block=block)
    return rows, inverse, offsets


@dataclass(frozen=True)
class Fp8Experts:
    """A fused experts module's weights as an FP8 checkpoint stores them (`model.fp8_weights.Fp8Weight`):
    float8_e4m3fn codes in transformers' layout and fp32 multipliers, one a (block[0] x block[1]) block
    of each row part: gate_up's two parts (gate's rows, up's), down's one."""

    gate_up_codes: torch.Tensor  # (E, 2I, D) float8_e4m3fn
    gate_scales: torch.Tensor  # (E, ceil(I / block[0]), ceil(D / block[1])) float32
    up_scales: torch.Tensor
    down_codes: torch.Tensor  # (E, D, I) float8_e4m3fn
    down_scales: torch.Tensor  # (E, ceil(D / block[0]), ceil(I / block[1])) float32
    block: tuple[int, int]

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj, down_proj) in `dtype`: each code times its block's multiplier in fp32, rounded
        once (the plain reference of what `expert_mlp` reads from the codes)."""
        def part(codes, scale):
            rows, cols = codes.shape[-2:]
            full = scale.repeat_interleave(self.block[0], dim=-2)[..., :rows, :].repeat_interleave(self.block[1], dim=-1)
            return (codes.float() * full[..., :cols]).to(dtype)
        inter = self.gate_up_codes.shape[1] // 2
        gate_up = torch.cat([part(self.gate_up_codes[:, :inter], self.gate_scales),
                             part(self.gate_up_codes[:, inter:], self.up_scales)], dim=1)
        return gate_up, part(self.down_codes, self.down_scales)


def expert_mlp(
    x: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    gate_up_proj: torch.Tensor | None,
    down_proj: torch.Tensor | None,
    *,
    up_blocks: tuple[int, int, int, int] | None = None,
    down_blocks: tuple[int, int, int, int] | None = None,
    fp8: Fp8Experts | None = None,
) -> torch.Tensor:
    """`expert_mlp_reference` in two Triton kernels, for up to `EXPERT_MAX_TOKENS` tokens.

    On CUDA the products are Triton's `tl.dot` with fp32 accumulation: exact products of bf16
    inputs (TF32 for fp32 inputs, so the library calls it for bf16 only). Triton's interpreter
    multiplies fp32 correctly and bf16 not at all (3.9), so the CPU tests use fp32.

    With `fp8` (gate_up_proj and down_proj then None) the kernels read the FP8 codes and their block
    multipliers and dequantize each tile in registers as they read it, to x's dtype, exactly as
    `Fp8Experts.dequantized` does: the products, and so the result, are those of `expert_mlp` on the
    dequantized weights, bit for bit, from half the bytes.
    """
    if fp8 is not None:
        gate_up_proj, down_proj = fp8.gate_up_codes, fp8.down_codes
    tokens, dim = x.shape
    num_experts, double_inter, weight_dim = gate_up_proj.shape
    inter = double_inter // 2
    if tokens > EXPERT_MAX_TOKENS:
        raise ValueError(f"expert_mlp: at most {EXPERT_MAX_TOKENS} tokens, got {tokens}")
    if weight_dim != dim or down_proj.shape != (num_experts, dim, inter) or offsets.numel() != num_experts:
        raise ValueError(
            f"expert_mlp: tokens of width {dim} need gate_up_proj (E, 2I, {dim}), down_proj (E, {dim}, I) and E offsets; "
            f"got {tuple(gate_up_proj.shape)}, {tuple(down_proj.shape)} and {offsets.numel()}"
        )
    if not available(x):
        if fp8 is not None:
            return expert_mlp_reference(x, rows, offsets, *fp8.dequantized(x.dtype))
        return expert_mlp_reference(x, rows, offsets, gate_up_proj, down_proj)
    pairs = rows.numel()
    hidden = x.new_empty(pairs, inter)
    out = x.new_empty(pairs, dim)
    if not pairs:
        return out
    x, rows, offsets = x.contiguous(), rows.contiguous(), offsets.contiguous()
    gate_up_proj, down_proj = gate_up_proj.contiguous(), down_proj.contiguous()
    m_tiles = triton.cdiv(tokens, EXPERT_BLOCK_M)
    if fp8 is None:
        scales = ((x, x), (x, x))  # not read
        block = (1, 1)
    else:
        scales = ((fp8.gate_scales.contiguous(), fp8.up_scales.contiguous()), (fp8.down_scales.contiguous(),) * 2)
        block = fp8.block
    for a, width, weight, k_dim, result, gate_up, blocks, (first, second) in (
        (x, inter, gate_up_proj, dim, hidden, True, up_blocks or EXPERT_UP_BLOCKS, scales[0]),
        (hidden, dim, down_proj, inter, out, False, down_blocks or EXPERT_DOWN_BLOCKS, scales[1]),
    ):
        block_n, block_k, warps, stages = blocks
        block_k = min(block_k, max(16, triton.next_power_of_2(k_dim)))
        if fp8 is not None:  # a tile's k columns within one block of multipliers (`_weight_tile`)
            block_k = min(block_k, block[1])
            if block[1] % block_k or block_k < 16:
                raise ValueError(f"expert_mlp: FP8 blocks of {block[1]} columns need a power-of-two block_k of 16 or "
                                 f"more that divides them, got {block_k}")
        n_scale_rows, n_scale_cols = (first.shape[-2], first.shape[-1]) if fp8 is not None else (1, 1)
        _expert_gemm_kernel[(num_experts, triton.cdiv(width, block_n))](
            a, rows, offsets, weight, result, width, first, second, n_scale_rows, n_scale_cols,
            k_dim=k_dim, gate_up=gate_up, m_tiles=m_tiles,
            block_m=EXPERT_BLOCK_M, block_n=block_n, block_k=block_k, fp8=fp8 is not None,
            scale_rows=block[0], scale_cols=block[1], num_warps=warps, num_stages=stages,
        )
    return out
