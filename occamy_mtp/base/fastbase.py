"""The fast frozen-base pass: packed windows, fla kernels, chunked greedy (issue 6).

docs/developer/FASTBASE.md sets out the details.
"""

from __future__ import annotations

import functools
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from occamy_mtp.base import joined, moe_kernels
from occamy_mtp.compat import torch_function
from occamy_mtp.console import FLA_INSTALL_HINT
from occamy_mtp.base.frozen import runs_fast_paths
from occamy_mtp.model.fp8_weights import ATTRIBUTE as FP8_ATTRIBUTE, materialize_experts
from occamy_mtp.base.logits import chunked_greedy, greedy_chunk_tokens
from occamy_mtp.base.tuning import use_tuned_kernel_configs


# Attention implementations for which `attention_mask=None` means causal (transformers'
# sdpa passes is_causal; flash kernels are causal by default). Under "eager" a None mask
# is NOT causal (docs/reference/CONTRACT.md section 2), so an explicit mask is built for every other one.
_CAUSAL_WITHOUT_MASK = ("sdpa", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class WindowOutputs:
    """The frozen base's outputs for one window of T_w tokens."""

    hidden: torch.Tensor  # (T_w, D) post-final-norm hidden states, base dtype
    greedy: torch.Tensor  # (T_w,) long, argmax(W @ hidden): the base's choice for t+1


# -- layout -------------------------------------------------------------------------


@dataclass(frozen=True)
class PackLayout:
    """Where each window's tokens sit in one packed batch.

    Packed batches are one row (1, N) of concatenated windows. When every window has
    the same length the batch is instead (W, T), one window a row, so that nothing
    needs `cu_seqlens` or a gather (and the forward can be captured in a CUDA graph).
    """

    lengths: tuple[int, ...]  # tokens of each window, in packed order
    cu_seqlens: torch.Tensor | None  # (W+1,) int32 window starts in the packed row; None when uniform
    grid_index: torch.Tensor | None  # (N,) long: packed token -> slot in the (W * L) right-padded grid

    @property
    def uniform(self) -> bool:
        return self.cu_seqlens is None

    @property
    def num_windows(self) -> int:
        return len(self.lengths)

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """(1, N, ...) packed or (W, T, ...) uniform -> (W, L, ...) right-padded windows."""
        if self.uniform:
            return x
        grid = x.new_zeros(self.num_windows * self.max_length, *x.shape[2:])
        grid[self.grid_index] = x[0]
        return grid.view(self.num_windows, self.max_length, *x.shape[2:])

    def from_grid(self, grid: torch.Tensor) -> torch.Tensor:
        """Inverse of `to_grid`: drop the padding slots."""
        if self.uniform:
            return grid
        return grid.reshape(-1, *grid.shape[2:])[self.grid_index][None]


def make_layout(lengths: Sequence[int], device: torch.device) -> PackLayout:
    lengths = tuple(int(n) for n in lengths)
    if min(lengths) < 1:
        raise ValueError(f"every window needs at least one token, got lengths {lengths}")
    if len(set(lengths)) == 1:
        return PackLayout(lengths, None, None)
    starts = torch.tensor((0,) + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    longest = max(lengths)
    grid_index = torch.cat([torch.arange(n) + w * longest for w, n in enumerate(lengths)])
    return PackLayout(lengths, starts.to(device), grid_index.to(device))


def plan_batches(lengths: Sequence[int], max_tokens_per_batch: int) -> list[list[int]]:
    """Split window indices, in order, into batches of at most `max_tokens_per_batch` tokens."""
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, length in enumerate(lengths):
        if length > max_tokens_per_batch:
            raise ValueError(
                f"window {index} has {length} tokens, more than max_tokens_per_batch={max_tokens_per_batch}"
            )
        if current and used + length > max_tokens_per_batch:
            batches.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        batches.append(current)
    return batches


# -- kernels ------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernels:
    """The implementations the pass calls for the parts transformers' modules cannot pack.

    causal_conv1d(x (B, T, C), weight (C, K), bias, activation, layout) -> (B, T, C)
    chunk_gated_delta_rule(q, k (B, T, H, dk), v (B, T, HV, dv), g, beta (B, T, HV), layout)
        -> (B, T, HV, dv), q and k L2-normalised inside, scale dk ** -0.5
    rms_norm(x, weight, eps, residual) -> (normed, residual + x): zero-centred
        `x * rsqrt(mean(x^2) + eps) * (1 + weight)` of the residual sum; None: the modules'.
    rms_norm_gated(x, gate, weight, eps) -> norm(x) * weight * silu(gate); None: the module's.
    sparse_moe(block, x (B, T, D)) -> (B, T, D): the MoE block; None: the module's forward.
    """

    name: str
    causal_conv1d: Callable
    chunk_gated_delta_rule: Callable
    rms_norm: Callable | None = None
    rms_norm_gated: Callable | None = None
    sparse_moe: Callable | None = None


def _torch_causal_conv1d(x, weight, bias, activation, layout: PackLayout):
    """transformers' PyTorch causal conv1d, each window its own row of the padded grid."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

    conv = torch_function(qwen.causal_conv1d_fn)
    grid = layout.to_grid(x)  # (W, L, C); right padding never reaches a real position
    out = conv(grid.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)
    return layout.from_grid(out)


def torch_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state: bool = False):
    """transformers' PyTorch chunked gated delta rule (q, k (B, T, H, dk); v (B, T, HV, dv); g, beta
    (B, T, HV)), q and k L2-normalised inside: (out, final state or None)."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

    groups = v.shape[2] // q.shape[2]
    if groups > 1:  # value heads share query/key heads; older transformers repeat them before the call
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    return torch_function(qwen.torch_chunk_gated_delta_rule)(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                                             output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)


def _torch_chunk_gated_delta_rule(q, k, v, g, beta, layout: PackLayout):
    """transformers' PyTorch chunked gated delta rule over the padded grid of windows."""
    grid = [layout.to_grid(t) for t in (q, k, v, g, beta)]
    out, _ = torch_gated_delta_rule(*grid)
    return layout.from_grid(out)


def torch_kernels(grouped_moe: bool = False) -> Kernels:
    """transformers' own PyTorch implementations (exact, slow): the fallback and the test oracle.

    grouped_moe: route the MoE block through `grouped_moe` instead of its own forward.
    """
    return Kernels(
        "torch" + ("+grouped-moe" if grouped_moe else ""), _torch_causal_conv1d, _torch_chunk_gated_delta_rule,
        sparse_moe=grouped_moe_block if grouped_moe else None,
    )


_ONE_PLUS = WeakIdKeyDictionary()  # norm weight -> (its version, 1 + weight in fp32)


def _one_plus(weight: torch.Tensor) -> torch.Tensor:
    """1 + weight in fp32, the scale of a zero-centred RMSNorm: kept per weight while the weight is
    unchanged (a decode step would otherwise spend a kernel a norm on it). Not kept when first
    asked for inside a CUDA-graph capture, where it would hold nothing until the graph replays."""
    kept = _ONE_PLUS.get(weight)
    if kept is not None and kept[0] == weight._version:
        return kept[1]
    shifted = 1.0 + weight.detach().float()
    if not (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
        _ONE_PLUS[weight] = (weight._version, shifted)
    return shifted


def fla_kernels(
    fused_norms: bool = True,
    grouped_moe: bool = True,
    repeat_kv_heads: bool = False,
    triton_conv: bool = True,
    fused_moe_glue: bool = True,
) -> Kernels:
    """fla's Triton kernels. Raises ImportError when fla (or Triton) is missing.

    fused_norms: fla's fused (residual +) RMSNorm kernels; False: the modules' own norms.
    grouped_moe: `grouped_moe_block`; False: the MoE block's own forward.
    fused_moe_glue: with grouped_moe, the Triton kernels of `occamy_mtp.base.moe_kernels` around
        the expert GEMMs.
    repeat_kv_heads: hand the delta rule query/key heads repeated up to the value heads
        (what transformers <= 5.1x does) instead of relying on fla's grouped value heads.
    triton_conv: fla's varlen causal conv1d; False: transformers' PyTorch conv over the padded grid.
    """
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.modules.norm.layernorm import rms_norm
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if torch.cuda.is_available():
        use_tuned_kernel_configs(torch.device("cuda", torch.cuda.current_device()))

    def conv(x, weight, bias, activation, layout: PackLayout):
        out, _ = causal_conv1d(x, weight=weight, bias=bias, activation=activation, cu_seqlens=layout.cu_seqlens)
        return out

    def rule(q, k, v, g, beta, layout: PackLayout):
        groups = v.shape[2] // q.shape[2]
        if repeat_kv_heads and groups > 1:
            q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        out, _ = chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=True, cu_seqlens=layout.cu_seqlens,
        )
        return out

    def norm(x, weight, eps, residual):
        # Zero-centred weights: the kernel multiplies by the weight, so hand it 1 + w in fp32.
        if residual is None:
            return rms_norm(x, _one_plus(weight), None, eps=eps), x
        return rms_norm(x, _one_plus(weight), None, residual=residual, eps=eps, prenorm=True)

    def norm_gated(x, gate, weight, eps):
        return rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)

    moe = (fused_moe_block if fused_moe_glue else grouped_moe_block) if grouped_moe else None
    name = "fla" + ("+fused-norms" if fused_norms else "") + ("+grouped-moe" if grouped_moe else "")
    name += "+fused-glue" if grouped_moe and fused_moe_glue else ""
    name += ("+repeat-kv" if repeat_kv_heads else "") + ("" if triton_conv else "+torch-conv")
    return Kernels(
        name, conv if triton_conv else _torch_causal_conv1d, rule,
        rms_norm=norm if fused_norms else None,
        rms_norm_gated=norm_gated if fused_norms else None,
        sparse_moe=moe,
    )


def default_kernels(device: torch.device, fused_norms: bool = True) -> Kernels:
    """fla's kernels on CUDA when importable; otherwise transformers' PyTorch ones, with a warning."""
    if torch.device(device).type != "cuda":
        return torch_kernels()
    try:
        return fla_kernels(fused_norms)
    except ImportError as error:
        warnings.warn(
            f"fla kernels are not importable ({error}); the frozen-base pass falls back to transformers' "
            f"PyTorch Gated DeltaNet, which is correct but much slower. Install them with: {FLA_INSTALL_HINT}",
            stacklevel=2,
        )
        return torch_kernels(grouped_moe=True)


# -- the MoE block ------------------------------------------------------------------

_SILU_CLASSES = ("SiLU", "SiLUActivation")  # torch's and transformers' (ACT2FN["silu"])


def grouped_experts(
    experts,
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    fused_glue: bool = False,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts as two grouped GEMMs: (N, D) tokens, (N, k) choices and weights -> (N, D).

    The computation of transformers' "grouped_mm" experts, with less memory traffic
    around the GEMMs (at real size the glue cost more than the GEMMs; transformers <= 5.1x
    also masks three (N*k, D)-sized tensors per layer for expert parallelism):
    the (token, expert) pairs are sorted by expert, gathered, pushed through
    gate_up -> SiLU(gate) * up -> down, put back in token order, and summed with their
    routing weights, accumulating in fp32.

    fused_glue: SiLU * up, and the un-sort + weighted sum, each in one Triton kernel
        (`occamy_mtp.base.moe_kernels`), and for decode-sized batches the ordering by
        expert too (`moe_kernels.align`), and for up to `moe_kernels.EXPERT_MAX_TOKENS` bf16
        tokens the two GEMMs with it (`moe_kernels.expert_mlp`); else in PyTorch (a sort, a
        gather, a batched matmul).
    shared, shared_gate: the shared expert's (N, D) output and (N, 1) gate logits, added
        as `sigmoid(shared_gate) * shared` (inside the fused combine when fused_glue).
    """
    from transformers.integrations.moe import _grouped_mm

    if (shared is None) != (shared_gate is None):
        raise ValueError("grouped_experts: pass both shared and shared_gate, or neither")
    tokens, top_k = top_k_index.shape
    silu = type(experts.act_fn).__name__ in _SILU_CLASSES
    codes = fp8_experts(experts)
    # Kept in FP8, a decode-sized batch's expert GEMMs read the codes (`moe_kernels.expert_mlp`'s fp8); any
    # other batch has the routed experts' weights written to the model's dtype now, and reads those.
    reads_codes = (codes is not None and fused_glue and silu and tokens <= moe_kernels.EXPERT_MAX_TOKENS
                   and x.is_cuda and x.dtype == torch.bfloat16 and moe_kernels.available(x))
    if not reads_codes:
        materialize_experts(experts, top_k_index)
    num_experts = experts.gate_up_proj.shape[0]
    if fused_glue and moe_kernels.available(x) and tokens * top_k <= moe_kernels.ALIGN_MAX_PAIRS:
        rows, inverse, offsets = moe_kernels.align(top_k_index, num_experts)  # one kernel: decode-sized batches
    else:
        expert_ids = top_k_index.reshape(-1)  # (S,) with S = N * k
        # On CUDA the ids sort as 32-bit keys (half the radix passes of 64-bit ones), which histc also takes.
        sorted_ids, order = torch.sort(expert_ids.int() if x.is_cuda else expert_ids)
        # histc, not bincount: no host sync, so the pass can be captured in a CUDA graph.
        counts = torch.histc(sorted_ids if x.is_cuda else sorted_ids.float(), bins=num_experts, min=0, max=num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        rows = order // top_k
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
    if reads_codes:
        out = moe_kernels.expert_mlp(x, rows, offsets, None, None, fp8=codes)  # (S, D) in expert order
        return moe_kernels.combine(out, inverse, top_k_weights, shared, shared_gate)
    if fused_glue and silu and tokens <= moe_kernels.EXPERT_MAX_TOKENS and expert_kernels_apply(x, experts):
        out = moe_kernels.expert_mlp(x, rows, offsets, experts.gate_up_proj, experts.down_proj)  # (S, D) in expert order
        return moe_kernels.combine(out, inverse, top_k_weights, shared, shared_gate)
    gate_up = _grouped_mm(x[rows], experts.gate_up_proj.transpose(-2, -1), offs=offsets)  # (S, 2I)
    if fused_glue and silu:
        hidden = moe_kernels.silu_mul(gate_up)
    else:  # the kernel computes SiLU only; any other activation keeps the module's
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = experts.act_fn(gate) * up
    out = _grouped_mm(hidden, experts.down_proj.transpose(-2, -1), offs=offsets)  # (S, D) in expert order
    if fused_glue:
        return moe_kernels.combine(out, inverse, top_k_weights, shared, shared_gate)
    out = out[inverse].view(tokens, top_k, -1)  # (N, k, D) token-major
    routed = torch.bmm(top_k_weights.to(out.dtype).unsqueeze(1), out).squeeze(1)  # (N, D)
    if shared is not None:
        routed = routed + torch.sigmoid(shared_gate) * shared
    return routed


def fp8_experts(experts) -> moe_kernels.Fp8Experts | None:
    """The FP8 codes and multipliers of a fused experts module whose layer is kept in FP8
    (`model.fp8_weights`), as `moe_kernels.expert_mlp` reads them; None for any other. Made once a module."""
    held = getattr(experts, FP8_ATTRIBUTE, None)
    if held is None:
        return None
    cached = getattr(experts, "_occamy_fp8_experts", None)
    if cached is not None:
        return cached
    stacks = {w.name: w for w in held.weights if w.module is experts}
    gate_up, down = stacks.get("gate_up_proj"), stacks.get("down_proj")
    if gate_up is None or down is None or len(gate_up.scales) != 2 or len(down.scales) != 1:
        return None
    codes = moe_kernels.Fp8Experts(gate_up.codes, gate_up.scales[0], gate_up.scales[1], down.codes, down.scales[0],
                                   gate_up.block)
    object.__setattr__(experts, "_occamy_fp8_experts", codes)  # a plain attribute: not a submodule or a buffer
    return codes


def expert_kernels_apply(x: torch.Tensor, experts) -> bool:
    """Whether `moe_kernels.expert_mlp` computes these experts: bf16 on CUDA (its products are
    exact there, where fp32 would be TF32), fp32 under Triton's interpreter (whose bf16 products are wrong)."""
    if not moe_kernels.available(x):
        return False
    dtype = torch.bfloat16 if x.is_cuda else torch.float32
    return x.dtype == dtype and experts.gate_up_proj.dtype == dtype


def grouped_moe_block(block, x: torch.Tensor, fused_glue: bool = False, joined_inputs: bool = False) -> torch.Tensor:
    """`Qwen3_5MoeSparseMoeBlock.forward` with `grouped_experts` for the routed experts (and with
    fused_glue, the router after its linear in one kernel, `moe_kernels.route`). With joined_inputs and
    fused_glue, a block whose projections are laid out as one weight (`joined.lay_out`) computes the
    router's logits and the shared expert's gate, up and gate logit in one GEMM (`joined.moe_inputs`)."""
    flat = x.reshape(-1, x.shape[-1])  # (N, D)
    router = block.gate
    routes = fused_glue and moe_kernels.available(flat) and hasattr(router, "top_k") and hasattr(router, "weight")
    inputs = joined.moe_inputs(block, flat) if joined_inputs and routes else None
    if inputs is not None:
        logits, gate_up, shared_gate = inputs
        mlp = block.shared_expert
        if type(mlp.act_fn).__name__ in _SILU_CLASSES:
            hidden = moe_kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = mlp.act_fn(gate) * up
        shared = mlp.down_proj(hidden)
        routing_weights, selected = moe_kernels.route(logits, router.top_k)
    else:
        shared = block.shared_expert(flat)
        shared_gate = block.shared_expert_gate(flat)
        if routes:
            routing_weights, selected = moe_kernels.route(F.linear(flat, router.weight), router.top_k)  # the router's, in one kernel
        else:
            _, routing_weights, selected = router(flat)  # softmax router in fp32, top-k renormalised
    out = grouped_experts(
        block.experts, flat, selected, routing_weights,
        fused_glue=fused_glue, shared=shared, shared_gate=shared_gate,
    )
    return out.reshape(x.shape)


def fused_moe_block(block, x: torch.Tensor) -> torch.Tensor:
    """`grouped_moe_block` with the Triton glue kernels (`occamy_mtp.base.moe_kernels`)."""
    return grouped_moe_block(block, x, fused_glue=True)


def decode_moe_block(block, x: torch.Tensor) -> torch.Tensor:
    """`fused_moe_block` with a laid-out block's input projections in one GEMM (`joined.moe_inputs`): the
    decoder's, whose GEMMs are a few rows each."""
    return grouped_moe_block(block, x, fused_glue=True, joined_inputs=True)


# -- the forward --------------------------------------------------------------------


def _gated_deltanet(mixer, x: torch.Tensor, layout: PackLayout, kernels: Kernels) -> torch.Tensor:
    """transformers' Qwen3.5 Gated DeltaNet forward (no cache), with window-aware kernels.

    Same modules and the same order of operations as `Qwen3_5MoeGatedDeltaNet.forward`;
    only the conv and the delta rule are the `kernels`' window-aware versions.
    x: (B, T, D) -> (B, T, D).
    """
    batch, length, _ = x.shape
    mixed_qkv = mixer.in_proj_qkv(x)  # (B, T, 2 * key_dim + value_dim)
    z = mixer.in_proj_z(x).reshape(batch, length, -1, mixer.head_v_dim)
    b = mixer.in_proj_b(x)
    a = mixer.in_proj_a(x)
    mixed_qkv = kernels.causal_conv1d(mixed_qkv, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.activation, layout)
    query, key, value = torch.split(mixed_qkv, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    query = query.reshape(batch, length, -1, mixer.head_k_dim)
    key = key.reshape(batch, length, -1, mixer.head_k_dim)
    value = value.reshape(batch, length, -1, mixer.head_v_dim)
    beta = b.sigmoid()
    g = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)  # (B, T, HV) log decay
    core = kernels.chunk_gated_delta_rule(query, key, value, g, beta, layout)  # (B, T, HV, dv)
    core, z = core.reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim)
    if kernels.rms_norm_gated is not None:
        core = kernels.rms_norm_gated(core, z, mixer.norm.weight, mixer.norm.variance_epsilon)
    else:
        core = mixer.norm(core, z)
    return mixer.out_proj(core.reshape(batch, length, -1))


def _attention(attn, x: torch.Tensor, position_embeddings, mask, layout: PackLayout) -> torch.Tensor:
    """The base's own attention module, causal within each window (rows of the padded grid)."""
    out, _ = attn(hidden_states=layout.to_grid(x), position_embeddings=position_embeddings, attention_mask=mask)
    return layout.from_grid(out)


def _causal_mask(attn_implementation: str, length: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    if attn_implementation in _CAUSAL_WITHOUT_MASK:
        return None
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    mask = torch.zeros(length, length, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]  # (1, 1, L, L), broadcast over windows and heads


def residual_norm(module, x: torch.Tensor, residual: torch.Tensor | None, kernels: Kernels):
    """(norm(residual + x), residual + x), as the decoder layer computes it."""
    if kernels.rms_norm is not None:
        return kernels.rms_norm(x, module.weight, module.eps, residual)
    summed = x if residual is None else residual + x
    return module(summed), summed


def module_moe(block, x: torch.Tensor) -> torch.Tensor:
    """The MoE block's own forward (transformers'), its output alone."""
    out = block(x)
    return out[0] if isinstance(out, tuple) else out  # some versions also return router logits


def decoder_layer(layer, hidden: torch.Tensor, residual: torch.Tensor | None, kernels: Kernels, mix, moe) -> tuple:
    """One decoder layer as transformers computes it, unrolled: residual -> input norm -> `mix` (the
    token mixer, on the normed input) -> residual -> post-attention norm -> `moe` (the MoE block).
    Returns the MoE block's output and the residual stream, which the next layer (or the final
    norm, `residual_norm`) adds. A layer that keeps its routed experts in FP8 writes them once routed
    (`grouped_experts`, or the experts module's pre-hook), or its decode-sized GEMMs read the codes."""
    normed, residual = residual_norm(layer.input_layernorm, hidden, residual, kernels)
    hidden = mix(normed)
    normed, residual = residual_norm(layer.post_attention_layernorm, hidden, residual, kernels)
    return moe(layer.mlp, normed), residual


@torch.no_grad()
def packed_hidden(base, input_ids: torch.Tensor, layout: PackLayout, kernels: Kernels) -> torch.Tensor:
    """Post-final-norm hidden states of a packed batch: (1, N) or uniform (W, T) ids -> (..., D).

    The decoder layer of transformers, unrolled so that each token mixer sees the
    layout: residual -> input_layernorm -> mixer -> residual -> post_attention_layernorm
    -> MoE block -> residual. Positions restart at 0 in every window.
    """
    model = base.model
    config = base.config
    hidden = model.embed_tokens(input_ids)
    grid_positions = torch.arange(layout.max_length, device=input_ids.device).expand(layout.num_windows, -1)
    # Text M-RoPE: three equal position rows, shape (3, W, L).
    position_embeddings = model.rotary_emb(hidden, grid_positions[None].expand(3, -1, -1))
    mask = _causal_mask(config._attn_implementation, layout.max_length, hidden.dtype, hidden.device)

    moe = kernels.sparse_moe or module_moe
    residual = None
    for layer in model.layers[: config.num_hidden_layers]:
        if layer.block_type == "linear_attention":
            mix = functools.partial(_gated_deltanet, layer.linear_attn, layout=layout, kernels=kernels)
        else:
            mix = functools.partial(_attention, layer.self_attn, position_embeddings=position_embeddings, mask=mask, layout=layout)
        hidden, residual = decoder_layer(layer, hidden, residual, kernels, mix, moe)
    normed, _ = residual_norm(model.norm, hidden, residual, kernels)
    return normed


def token_bytes(config, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes the packed pass's peak takes per token of a forward, beside the base's weights.

    The tensors a token keeps alive in a layer: its top-k experts' gathered inputs,
    gate/up and down outputs (top_k x (2 x hidden + 3 x moe_intermediate)), the Gated
    DeltaNet's mixed q/k/v twice (2 x conv channels), and about a dozen hidden-sized
    activations (residual, norms, projections, the cache's copy). The dozen (13) was fitted
    to the peak measured at real size (bench/results/base-pass.md), and lies a few percent above it.
    """
    size = torch.empty((), dtype=dtype).element_size()
    channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim + config.linear_num_value_heads * config.linear_value_head_dim
    experts = config.num_experts_per_tok * (2 * config.hidden_size + 3 * config.moe_intermediate_size)
    return size * (experts + 2 * channels + 13 * config.hidden_size)


class FastBasePass:
    """The frozen base's hidden states and greedy targets for lists of windows, fast.

    pass_ = FastBasePass(base, max_tokens_per_batch=65536)
    outputs = pass_(windows)   # list of WindowOutputs, one per window, in order

    Args:
        base: a transformers Qwen3.5-MoE (or Qwen3-Next) causal LM, frozen.
        max_tokens_per_batch: tokens packed into one forward. Large batches keep the GPU
            busy (small ones are held back by kernel-launch overhead); memory grows with it.
        logits_chunk_tokens: positions per lm_head + argmax chunk (None: as many as fit, `base.chunked_greedy`).
        kernels: see `Kernels`; default fla's on CUDA when importable, else transformers' own.
        cuda_graphs: capture and replay one CUDA graph per batch shape whose windows
            all have one length (others run eagerly). Each graph keeps its activations'
            memory; `max_graphs` bounds how many are kept.
    """

    def __init__(
        self,
        base,
        *,
        max_tokens_per_batch: int,
        logits_chunk_tokens: int | None = None,
        kernels: Kernels | None = None,
        cuda_graphs: bool = False,
        max_graphs: int = 2,
    ):
        if not runs_fast_paths(base):
            raise ValueError(f"FastBasePass runs a whole base, its inputs not fake-quantized, of a family whose fast_paths "
                             f"are on (`occamy_mtp.base.frozen.FrozenBase.fast_paths`), not this "
                             f"model_type {base.config.model_type!r}; use occamy_mtp.targets.base.base_outputs for other bases")
        self.base = base
        self.max_tokens_per_batch = max_tokens_per_batch
        self.logits_chunk_tokens = logits_chunk_tokens
        self.device = base.lm_head.weight.device
        self.kernels = kernels if kernels is not None else default_kernels(self.device)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple[int, int], _CapturedForward] = OrderedDict()

    def forward_batch(self, windows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, PackLayout]:
        """One packed forward: (hidden (N, D), greedy (N,), layout) for windows of <= max tokens in all."""
        layout = make_layout([len(w) for w in windows], self.device)
        rows = [torch.as_tensor(w, dtype=torch.long) for w in windows]
        input_ids = (torch.stack(rows) if layout.uniform else torch.cat(rows)[None]).to(self.device)
        if self.cuda_graphs and layout.uniform:
            hidden, greedy = self._graph(input_ids.shape).run(input_ids)
        else:
            hidden, greedy = self._eager(input_ids, layout)
        return hidden, greedy, layout

    def _eager(self, input_ids: torch.Tensor, layout: PackLayout, chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = packed_hidden(self.base, input_ids, layout, self.kernels)
        hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, D)
        return hidden, chunked_greedy(hidden, self.base.lm_head, chunk_tokens or self.logits_chunk_tokens)

    def _graph(self, shape: torch.Size) -> _CapturedForward:
        key = (shape[0], shape[1])
        if key in self._graphs:
            self._graphs.move_to_end(key)
            return self._graphs[key]
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        layout = make_layout([shape[1]] * shape[0], self.device)
        # the logits' chunk sized before the capture (sizing asks the allocator, which a capture refuses)
        chunk = self.logits_chunk_tokens or greedy_chunk_tokens(self.base.lm_head)
        captured = _CapturedForward(lambda ids: self._eager(ids, layout, chunk), shape, self.device)
        self._graphs[key] = captured
        return captured

    @torch.no_grad()
    def __call__(self, windows: Sequence[Sequence[int]]) -> list[WindowOutputs]:
        outputs: list[WindowOutputs | None] = [None] * len(windows)
        for indices in plan_batches([len(w) for w in windows], self.max_tokens_per_batch):
            hidden, greedy, layout = self.forward_batch([windows[i] for i in indices])
            start = 0
            for index, length in zip(indices, layout.lengths):
                outputs[index] = WindowOutputs(hidden[start : start + length], greedy[start : start + length])
                start += length
        return outputs  # type: ignore[return-value]


class _CapturedForward:
    """One forward of a fixed input shape, captured as a CUDA graph; replays copy the outputs out."""

    def __init__(self, forward: Callable, shape: torch.Size, device: torch.device):
        self.input_ids = torch.zeros(shape, dtype=torch.long, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up: autotuning and lazy allocations happen outside the graph
            forward(self.input_ids)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = forward(self.input_ids)

    def run(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.input_ids.copy_(input_ids)
        self.graph.replay()
        return tuple(t.clone() for t in self.outputs)


def packed_base_outputs(
    base,
    windows: Sequence[Sequence[int]],
    *,
    max_tokens_per_batch: int,
    logits_chunk_tokens: int | None = None,
    kernels: Kernels | None = None,
) -> list[WindowOutputs]:
    """One-shot form of `FastBasePass`: per-window hidden states and greedy targets."""
    return FastBasePass(
        base, max_tokens_per_batch=max_tokens_per_batch, logits_chunk_tokens=logits_chunk_tokens, kernels=kernels
    )(windows)
