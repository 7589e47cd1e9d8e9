"""Projections that read one input, laid out as one weight: one GEMM where the modules run several.

At batch 1 a decode step's GEMMs are short and many: a Gated DeltaNet layer projects its
normed input four times (q/k/v, z, b, a), a full-attention layer three (queries with their
gates, keys, values) and a MoE block four more (the router, the shared expert's gate and up,
the shared expert's gate logit), each a launch that moves a few
megabytes or less, so the reference decoder's one-token forward took about three times
what its weights take to read (bench/results/decode.md). The serving engines merge these
projections; here the base's weights of each such group are put one after another in one
buffer as the base opens (`lay_out`), each module's parameter a view of its part, so the
modules compute what they did (same values, same shapes) and the decoder reads a group in
one GEMM (`joined`).

    lay_out(module)                      # once, before anything captures a graph of it
    qkv, z, b, a = linear_attention_inputs(mixer, x)
    query_gate, key, value = attention_inputs(attention, x)
    logits, gate_up, shared_gate = moe_inputs(block, x)   # or None: the block's weights lie apart

`joined` looks at where the weights lie, not at a mark left on the modules: weights moved
or replaced since (a test's, a sharded base's) are read one projection at a time, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def linear_attention_weights(mixer) -> list[tuple[torch.nn.Module, str]]:
    """(module, parameter name) of a Gated DeltaNet's input projections, in the order they are joined."""
    return [(mixer.in_proj_qkv, "weight"), (mixer.in_proj_z, "weight"), (mixer.in_proj_b, "weight"),
            (mixer.in_proj_a, "weight")]


def attention_weights(attention) -> list[tuple[torch.nn.Module, str]]:
    """(module, parameter name) of a full-attention layer's query (with its gate), key and value projections."""
    return [(attention.q_proj, "weight"), (attention.k_proj, "weight"), (attention.v_proj, "weight")]


def moe_weights(block) -> list[tuple[torch.nn.Module, str]]:
    """(module, parameter name) of a MoE block's projections of its input but the routed experts: the router,
    the shared expert's gate and up, and the shared expert's gate logit, in the order they are joined."""
    shared = block.shared_expert
    return [(block.gate, "weight"), (shared.gate_proj, "weight"), (shared.up_proj, "weight"),
            (block.shared_expert_gate, "weight")]


def groups(layer) -> list[list[tuple[torch.nn.Module, str]]]:
    """The groups of projections of one decoder layer that read one input and have no bias."""
    out = []
    mixer = getattr(layer, "linear_attn", None)
    if mixer is not None and all(hasattr(mixer, f"in_proj_{name}") for name in ("qkv", "z", "b", "a")):
        out.append(linear_attention_weights(mixer))  # (Qwen3-Next's are merged in its checkpoint already)
    attention = getattr(layer, "self_attn", None)
    if attention is not None and all(hasattr(attention, f"{name}_proj") for name in ("q", "k", "v")):
        out.append(attention_weights(attention))
    block = layer.mlp
    if all(hasattr(block, name) for name in ("gate", "shared_expert", "shared_expert_gate", "experts")):
        out.append(moe_weights(block))
    return [group for group in out if all(getattr(module, "bias", None) is None for module, _ in group)]


def joined(weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The (sum of their rows, columns) weight over `weights` that lie one after another in one storage,
    each (rows_i, columns) and contiguous, a view of them; None where they do not."""
    first = weights[0]
    offset = first.storage_offset()
    storage = first.untyped_storage().data_ptr()
    for weight in weights:
        if (weight.dim() != 2 or not weight.is_contiguous() or weight.dtype != first.dtype or weight.device != first.device
                or weight.shape[1] != first.shape[1] or weight.untyped_storage().data_ptr() != storage
                or weight.storage_offset() != offset):
            return None
        offset += weight.numel()
    return first.as_strided((sum(w.shape[0] for w in weights), first.shape[1]), (first.shape[1], 1))


def tensors_of(group: list[tuple[torch.nn.Module, str]]) -> list[torch.Tensor]:
    """The weights of a group, as its modules hold them now."""
    return [getattr(module, name) for module, name in group]


@torch.no_grad()
def lay_out(module: torch.nn.Module) -> int:
    """Put each group's weights (`groups`) one after another in a buffer of its own, the parameters views of
    their parts (values unchanged); groups already so laid out stay. Returns how many groups moved. Call it
    before anything captures a CUDA graph of the base: a graph reads the weights where they were."""
    moved = 0
    for layer in module.model.layers:
        for group in groups(layer):
            tensors = tensors_of(group)
            if joined(tensors) is not None or len({(t.dtype, t.device, t.shape[1:]) for t in tensors}) != 1 \
                    or any(t.dim() != 2 for t in tensors):
                continue
            buffer = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
            start = 0
            for (owner, name), tensor in zip(group, tensors):
                part = buffer[start : start + tensor.numel()].view(tensor.shape)
                part.copy_(tensor)
                getattr(owner, name).data = part
                start += tensor.numel()
            moved += 1
    return moved


def joined_groups(module: torch.nn.Module) -> int:
    """How many of the module's groups (`groups`) lie as one weight now."""
    return sum(joined(tensors_of(group)) is not None for layer in module.model.layers for group in groups(layer))


def linear_attention_inputs(mixer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mixed q/k/v, z, b, a) of a Gated DeltaNet for x (..., D): one GEMM where its projections are laid
    out (`lay_out`), else one a projection. The first three are views of the one product."""
    group = linear_attention_weights(mixer)
    weight = joined(tensors_of(group))
    if weight is None:
        return tuple(module(x) for module, _ in group)
    return F.linear(x, weight).split([t.shape[0] for t in tensors_of(group)], dim=-1)


def attention_inputs(attention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(queries with their gates, keys, values) of a full-attention layer for x (..., D): one GEMM where its
    projections are laid out (`lay_out`), else one a projection."""
    group = attention_weights(attention)
    weight = joined(tensors_of(group))
    if weight is None:
        return tuple(module(x) for module, _ in group)
    return F.linear(x, weight).split([t.shape[0] for t in tensors_of(group)], dim=-1)


def moe_inputs(block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(router logits, the shared expert's gate and up side by side, its gate logit) of a MoE block for
    x (N, D), in one GEMM where the block's projections are laid out (`lay_out`); None where they are not."""
    group = moe_weights(block)
    tensors = tensors_of(group)
    weight = joined(tensors)
    if weight is None:
        return None
    experts, gate, up, gate_logit = (t.shape[0] for t in tensors)
    return F.linear(x, weight).split([experts, gate + up, gate_logit], dim=-1)
