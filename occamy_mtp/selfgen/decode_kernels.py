"""A Triton kernel for the decode step: one token of the gated delta rule, the state updated in place.

`fastdecode.BatchDecoder` keeps each Gated DeltaNet layer's recurrent state, (B, HV, K, V)
in fp32: at real size 2 MiB a row and layer, 20 GB for 160 rows over 30 layers. fla's
fused recurrent kernel writes the new state to a fresh tensor, which the decoder then
copies back: a second read and write of the whole state every step (about 9 ms of a
63 ms step at batch 160 on an H200, bench/RESULTS.md). `recurrent_step_` reads each
state tile once and writes it back in place. `recurrent_step_reference` is the plain
PyTorch computation it replaces (transformers' recurrent rule for one token), its oracle
in tests/test_decode_kernels.py.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference below still works
    triton = None

L2NORM_EPS = 1e-6  # transformers' l2norm inside the rule: x * rsqrt(sum(x^2) + eps)


def recurrent_step_reference(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule, `state` updated in place; returns the output.

    q, k: (B, H, K); v: (B, HV, V); g (log decay), beta: (B, HV); state: (B, HV, K, V) fp32.
    Value heads share query/key heads in groups of HV // H. q and k are L2-normalised and q
    scaled by K ** -0.5, as `use_qk_l2norm_in_kernel` does. Returns (B, HV, V) in v's dtype.
    """
    groups = v.shape[1] // q.shape[1]
    q, k = (x.float().repeat_interleave(groups, dim=1) for x in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    state.mul_(g.float().exp()[..., None, None])
    delta = (v.float() - (state * k[..., None]).sum(-2)) * beta.float()[..., None]  # (B, HV, V)
    state.add_(k[..., None] * delta[..., None, :])
    return (state * q[..., None]).sum(-2).to(v.dtype)


def available(tensor: torch.Tensor) -> bool:
    """Whether the kernel can run on this tensor: on CUDA, or under Triton's interpreter (`TRITON_INTERPRET=1`)."""
    return triton is not None and (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _recurrent_step_kernel(q, k, v, g, beta, state, out, scale, eps,
                               heads: tl.constexpr, value_heads: tl.constexpr, key_dim: tl.constexpr,
                               value_dim: tl.constexpr, block: tl.constexpr):
        row_head = tl.program_id(0).to(tl.int64)  # b * HV + hv
        cols = tl.program_id(1) * block + tl.arange(0, block)
        mask = cols < value_dim
        b = row_head // value_heads
        head = (row_head % value_heads) // (value_heads // heads)
        keys = tl.arange(0, key_dim)
        q_vec = tl.load(q + (b * heads + head) * key_dim + keys).to(tl.float32)
        k_vec = tl.load(k + (b * heads + head) * key_dim + keys).to(tl.float32)
        q_vec = q_vec / tl.sqrt(tl.sum(q_vec * q_vec, axis=0) + eps) * scale
        k_vec = k_vec / tl.sqrt(tl.sum(k_vec * k_vec, axis=0) + eps)
        v_vec = tl.load(v + row_head * value_dim + cols, mask=mask, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g + row_head).to(tl.float32))
        strength = tl.load(beta + row_head).to(tl.float32)
        tile = state + row_head * key_dim * value_dim + keys[:, None] * value_dim + cols[None, :]
        h = tl.load(tile, mask=mask[None, :], other=0.0) * decay  # (K, block)
        delta = (v_vec - tl.sum(h * k_vec[:, None], axis=0)) * strength
        h = h + k_vec[:, None] * delta[None, :]
        tl.store(tile, h, mask=mask[None, :])
        value = tl.sum(h * q_vec[:, None], axis=0)
        tl.store(out + row_head * value_dim + cols, value.to(out.dtype.element_ty), mask=mask)


def recurrent_step_(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """`recurrent_step_reference` in one Triton kernel: each state tile read once and written back in place."""
    if not available(state):
        return recurrent_step_reference(q, k, v, g, beta, state)
    batch, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1], v.shape[2]
    if state.shape != (batch, value_heads, key_dim, value_dim) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"recurrent_step_: state must be a contiguous float32 {[batch, value_heads, key_dim, value_dim]}, "
                         f"got {state.dtype} {list(state.shape)}")
    if value_heads % heads or key_dim & (key_dim - 1):
        raise ValueError(f"recurrent_step_: {value_heads} value heads over {heads} key heads, key dim {key_dim} "
                         "(a power of two) expected")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = v.new_empty(batch, value_heads, value_dim)
    block = min(64, triton.next_power_of_2(value_dim))
    _recurrent_step_kernel[(batch * value_heads, triton.cdiv(value_dim, block))](
        q, k, v, g, beta, state, out, key_dim**-0.5, L2NORM_EPS,
        heads=heads, value_heads=value_heads, key_dim=key_dim, value_dim=value_dim, block=block,
    )
    return out
