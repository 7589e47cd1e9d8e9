"""Triton kernels for the decode step's Gated DeltaNet: a few tokens of a row, the state updated in place.

`fastdecode.BatchDecoder` keeps each Gated DeltaNet layer's causal-conv window (B, C, K - 1),
in the base's dtype, and its recurrent state (B, HV, Kd, V) in fp32, at real size 2 MiB a
row and layer: 20 GB for 160 rows over 30 layers. A decode step (one token a row) or a
verify pass (a span of a few) runs, per layer, the conv over the window and the new
inputs, then the gated delta rule. In PyTorch that is about twenty small kernels a layer
(concatenation, depthwise conv, SiLU, the decay, copies to contiguous q/k/v, the rule);
at batch 1 every kernel costs about its launch, and a step took several times the time its
weights take to read (bench/results/decode.md). Here they are two kernels:

* `conv_steps_`: the depthwise causal conv and SiLU of T new inputs, the window updated in
  place; the output in the (B, T, C) layout the projections give.
* `gated_delta_steps_`: the log decay from the raw `a` projection, and T steps of the rule;
  each state tile read once and written back once, whatever T. (beta = sigmoid(b) stays
  torch's: rounded to b's dtype as the module rounds it, which Triton's interpreter, used by
  the CPU tests, does not do the way the GPU does.)

A full-attention layer's queries and keys go through the head's RMSNorm and then the rotary
embedding of their first dimensions: in PyTorch about thirty small kernels a layer (the norm's
upcast, square, mean, rsqrt and products, each half of the rotation, the concatenations, the
transposes). `norm_rotate` does both, for the queries and the keys, in one kernel.

The token count is a compile-time constant (a span is 1 to K + 1 tokens: a few variants,
each loop unrolled). Each sits beside the plain PyTorch computation it replaces (`conv_steps_reference`,
`gated_delta_steps_reference`: the operations of transformers' Gated DeltaNet decode, in its
order and dtypes), which the functions run where the kernels cannot (a CPU without Triton's
interpreter), and which is their oracle in tests/test_decode_kernels.py.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references below still work
    triton = None

L2NORM_EPS = 1e-6  # transformers' l2norm inside the rule: x * rsqrt(sum(x^2) + eps)
SOFTPLUS_THRESHOLD = 20.0  # torch's softplus returns x itself above this


# -- references ------------------------------------------------------------------------


def conv_steps_reference(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """SiLU of the depthwise causal conv over `state` followed by the T inputs `x`; `state` becomes the last K - 1 inputs.

    x: (B, T, C); state: (B, C, K - 1), updated in place; weight: (C, K); bias: (C,) or None.
    Returns (B, T, C) in x's dtype (transformers' `causal_conv1d_update` fallback: the
    window concatenated in the state's dtype, a depthwise conv1d, then SiLU).
    """
    tokens = x.shape[1]
    window = torch.cat([state, x.transpose(1, 2).to(state.dtype)], dim=-1)  # (B, C, K - 1 + T)
    state.copy_(window[:, :, tokens:])
    out = F.conv1d(window, weight[:, None], bias, groups=weight.shape[0])  # (B, C, T)
    return F.silu(out).transpose(1, 2).to(x.dtype)


def log_decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """g of transformers' Gated DeltaNet: -exp(A_log) * softplus(a + dt_bias), in fp32."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias)


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


def gated_delta_steps_reference(q, k, v, a, beta, A_log, dt_bias, state: torch.Tensor,
                                states: torch.Tensor | None = None) -> torch.Tensor:
    """T tokens of the gated delta rule, one after another, `state` updated in place.

    q, k: (B, T, H, K); v: (B, T, HV, V); a: (B, T, HV), the raw projection (`log_decay`);
    beta: (B, T, HV); A_log, dt_bias: (HV,); state: (B, HV, K, V) fp32. Returns (B, T, HV, V)
    in v's dtype. `states` (T, B, HV, K, V) fp32, where given, receives the state after each
    token (what a verify pass keeps, so that a rejection needs no second pass).
    """
    g = log_decay(a, A_log, dt_bias)
    outputs = []
    for t in range(q.shape[1]):
        outputs.append(recurrent_step_reference(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state))
        if states is not None:
            states[t].copy_(state)
    return torch.stack(outputs, dim=1)


def norm_rotate_reference(query, key, q_norm, k_norm, cos, sin, rotate) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries and keys of a full-attention layer as its module computes them: each head's
    RMSNorm (`q_norm`, `k_norm`, the modules), then `rotate(query, key, cos, sin)` (the family's
    `apply_rotary_pos_emb`, on the first dimensions of each head).

    query (B, T, H, D) and key (B, T, KVH, D), strided views allowed; cos, sin (B, T, R), R <= D.
    Returns (B, H, T, D) and (B, KVH, T, D)."""
    return rotate(q_norm(query).transpose(1, 2), k_norm(key).transpose(1, 2), cos, sin)


# -- kernels ---------------------------------------------------------------------------


def available(tensor: torch.Tensor) -> bool:
    """Whether the kernels can run on this tensor: on CUDA, or under Triton's interpreter (`TRITON_INTERPRET=1`)."""
    return triton is not None and (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _conv_steps_kernel(x, state, weight, bias, out, channels, x_row, x_token, out_row, out_token, tokens: tl.constexpr,
                           taps: tl.constexpr, has_bias: tl.constexpr, block: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * block + tl.arange(0, block)
        mask = cols < channels
        window = state + (row * channels + cols) * (taps - 1)  # this row's K - 1 past inputs, oldest first
        first = tl.zeros([block], dtype=tl.float32)
        if has_bias:
            first = first + tl.load(bias + cols, mask=mask, other=0.0).to(tl.float32)
        for t in tl.static_range(tokens):
            acc = first
            for j in tl.static_range(taps):
                at = t + j  # index into the window followed by the new inputs
                past = tl.full([block], 0, tl.int32) + at < taps - 1  # (a vector: a mask takes no scalar)
                from_state = tl.load(window + at, mask=mask & past, other=0.0)
                from_input = tl.load(x + row * x_row + (at - (taps - 1)) * x_token + cols, mask=mask & ~past, other=0.0)
                value = tl.where(past, from_state.to(tl.float32), from_input.to(state.dtype.element_ty).to(tl.float32))
                acc = acc + value * tl.load(weight + cols * taps + j, mask=mask, other=0.0).to(tl.float32)
            acc = acc.to(state.dtype.element_ty).to(tl.float32)  # the conv's output dtype, then SiLU
            tl.store(out + row * out_row + t * out_token + cols, (acc * tl.sigmoid(acc)).to(out.dtype.element_ty), mask=mask)
        # The window becomes the last K - 1 inputs; index i reads index i + T >= i + 1 first.
        for i in tl.static_range(taps - 1):
            at = tokens + i
            past = tl.full([block], 0, tl.int32) + at < taps - 1
            from_state = tl.load(window + at, mask=mask & past, other=0.0)
            from_input = tl.load(x + row * x_row + (at - (taps - 1)) * x_token + cols, mask=mask & ~past, other=0.0)
            tl.store(window + i, tl.where(past, from_state, from_input.to(state.dtype.element_ty)), mask=mask)

    @triton.jit
    def _gated_delta_kernel(q, k, v, a, beta, A_log, dt_bias, state, states, out, scale, eps, softplus_threshold,
                            qk_row, qk_token, qk_head, v_row, v_token, v_head, ab_row, ab_token, state_size, tokens: tl.constexpr,
                            heads: tl.constexpr, value_heads: tl.constexpr, key_dim: tl.constexpr,
                            value_dim: tl.constexpr, block: tl.constexpr, keep_states: tl.constexpr):
        row_head = tl.program_id(0).to(tl.int64)  # b * HV + hv
        cols = tl.program_id(1) * block + tl.arange(0, block)
        mask = cols < value_dim
        row = row_head // value_heads
        value_head = row_head % value_heads
        head = value_head // (value_heads // heads)
        keys = tl.arange(0, key_dim)
        at = row_head * key_dim * value_dim + keys[:, None] * value_dim + cols[None, :]  # this tile in a state
        tile = state + at
        h = tl.load(tile, mask=mask[None, :], other=0.0)  # (K, block), fp32
        rate = -tl.exp(tl.load(A_log + value_head).to(tl.float32))
        shift = tl.load(dt_bias + value_head).to(tl.float32)
        for t in tl.static_range(tokens):
            q_vec = tl.load(q + row * qk_row + t * qk_token + head * qk_head + keys).to(tl.float32)
            k_vec = tl.load(k + row * qk_row + t * qk_token + head * qk_head + keys).to(tl.float32)
            q_vec = q_vec / tl.sqrt(tl.sum(q_vec * q_vec, axis=0) + eps) * scale
            k_vec = k_vec / tl.sqrt(tl.sum(k_vec * k_vec, axis=0) + eps)
            v_vec = tl.load(v + row * v_row + t * v_token + value_head * v_head + cols, mask=mask, other=0.0).to(tl.float32)
            x_a = tl.load(a + row * ab_row + t * ab_token + value_head).to(tl.float32) + shift
            softplus = tl.where(x_a > softplus_threshold, x_a, tl.log(1.0 + tl.exp(tl.minimum(x_a, softplus_threshold))))
            strength = tl.load(beta + row * ab_row + t * ab_token + value_head).to(tl.float32)
            h = h * tl.exp(rate * softplus)
            delta = (v_vec - tl.sum(h * k_vec[:, None], axis=0)) * strength
            h = h + k_vec[:, None] * delta[None, :]
            value = tl.sum(h * q_vec[:, None], axis=0)
            tl.store(out + (row_head + (row * (tokens - 1) + t) * value_heads) * value_dim + cols,
                     value.to(out.dtype.element_ty), mask=mask)
            if keep_states:  # the state after token t, at the same place in `states[t]`
                tl.store(states + t * state_size + at, h, mask=mask[None, :])
        tl.store(tile, h, mask=mask[None, :])


    @triton.jit
    def _norm_rotate_kernel(query, key, q_weight, k_weight, cos, sin, q_out, k_out, eps, q_row, q_token, q_head,
                            k_row, k_token, k_head, tokens, heads: tl.constexpr, kv_heads: tl.constexpr,
                            dim: tl.constexpr, rotary: tl.constexpr):
        program = tl.program_id(0).to(tl.int64)  # ((b * T + t) * (H + KVH) + head)
        head = program % (heads + kv_heads)
        row_token = program // (heads + kv_heads)
        row = row_token // tokens
        token = row_token % tokens
        is_query = head < heads
        if is_query:
            source = query + row * q_row + token * q_token + head * q_head
            weight = q_weight
            target = q_out + ((row * heads + head) * tokens + token) * dim  # (B, H, T, D)
        else:
            source = key + row * k_row + token * k_token + (head - heads) * k_head
            weight = k_weight
            target = k_out + ((row * kv_heads + head - heads) * tokens + token) * dim  # (B, KVH, T, D)
        cols = tl.arange(0, dim)
        x = tl.load(source + cols).to(tl.float32)
        inverse = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
        # The module's RMSNorm: x * rsqrt(mean(x^2) + eps) in fp32, times (1 + w) in fp32, rounded to x's dtype.
        normed = ((x * inverse) * (1.0 + tl.load(weight + cols).to(tl.float32))).to(q_out.dtype.element_ty)
        half: tl.constexpr = rotary // 2
        # rotate_half's partner of each rotated column (its negation for the first half); columns past the
        # rotary ones pass through.
        partner = tl.where(cols < half, cols + half, cols - half)
        rotated = cols < rotary
        other = tl.load(source + partner, mask=rotated, other=0.0).to(tl.float32)
        other = ((other * inverse) * (1.0 + tl.load(weight + partner, mask=rotated, other=0.0).to(tl.float32)))
        other = other.to(q_out.dtype.element_ty).to(tl.float32)
        other = tl.where(cols < half, -other, other)
        at = (row * tokens + token) * rotary + tl.where(rotated, cols, 0)
        c = tl.load(cos + at, mask=rotated, other=0.0).to(tl.float32)
        s = tl.load(sin + at, mask=rotated, other=0.0).to(tl.float32)
        # As the module rounds: each product to the dtype, then their sum.
        kind = q_out.dtype.element_ty
        first = (normed.to(tl.float32) * c).to(kind).to(tl.float32)
        second = (other * s).to(kind).to(tl.float32)
        out = tl.where(rotated, (first + second).to(kind), normed)
        tl.store(target + cols, out)


def conv_steps_(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`conv_steps_reference` in one Triton kernel (the reference where the kernel cannot run)."""
    if not available(state):
        return conv_steps_reference(x, state, weight, bias)
    batch, tokens, channels = x.shape
    taps = weight.shape[1]
    if state.shape != (batch, channels, taps - 1) or not state.is_contiguous():
        raise ValueError(f"conv_steps_: state must be a contiguous {[batch, channels, taps - 1]}, got {list(state.shape)}")
    if x.stride(2) != 1:
        raise ValueError("conv_steps_: x must have unit stride over its channels")
    weight = weight.contiguous()
    out = x.new_empty(batch, tokens, channels)
    block = min(256, triton.next_power_of_2(channels))
    _conv_steps_kernel[(batch, triton.cdiv(channels, block))](
        x, state, weight, bias if bias is not None else weight, out, channels,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), tokens=tokens,
        taps=taps, has_bias=bias is not None, block=block,
    )
    return out


def gated_delta_steps_(q, k, v, a, beta, A_log, dt_bias, state: torch.Tensor, states: torch.Tensor | None = None) -> torch.Tensor:
    """`gated_delta_steps_reference` in one Triton kernel: each state tile read once and written back
    once (and once a token into `states`, where given).

    q and k may be strided views (the conv output split into q, k, v) sharing their strides;
    each needs unit stride over its last dim."""
    if states is not None and (states.shape != (q.shape[1], *state.shape) or states.dtype != torch.float32
                               or not states.is_contiguous()):
        raise ValueError(f"gated_delta_steps_: states must be a contiguous float32 {[q.shape[1], *state.shape]}, "
                         f"got {states.dtype} {list(states.shape)}")
    if not available(state):
        return gated_delta_steps_reference(q, k, v, a, beta, A_log, dt_bias, state, states)
    batch, tokens, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    if state.shape != (batch, value_heads, key_dim, value_dim) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"gated_delta_steps_: state must be a contiguous float32 {[batch, value_heads, key_dim, value_dim]}, "
                         f"got {state.dtype} {list(state.shape)}")
    if value_heads % heads or key_dim & (key_dim - 1):
        raise ValueError(f"gated_delta_steps_: {value_heads} value heads over {heads} key heads, key dim {key_dim} "
                         "(a power of two) expected")
    if q.stride() != k.stride() or q.stride(3) != 1 or v.stride(3) != 1:
        raise ValueError("gated_delta_steps_: q and k must share strides, and q, k, v have unit stride over their last dim")
    a, beta = a.contiguous(), beta.contiguous()
    out = v.new_empty(batch, tokens, value_heads, value_dim)
    block = min(64, triton.next_power_of_2(value_dim))
    _gated_delta_kernel[(batch * value_heads, triton.cdiv(value_dim, block))](
        q, k, v, a, beta, A_log, dt_bias, state, state if states is None else states, out, key_dim**-0.5, L2NORM_EPS,
        SOFTPLUS_THRESHOLD, q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2), a.stride(0),
        a.stride(1), state.numel(), tokens=tokens, heads=heads, value_heads=value_heads, key_dim=key_dim,
        value_dim=value_dim, block=block, keep_states=states is not None,
    )
    return out


def norm_rotate(query, key, q_norm, k_norm, cos, sin, rotate) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_rotate_reference` in one Triton kernel for the module's zero-centred RMSNorm (a weight w
    multiplies as 1 + w) and rotate-half rotary embedding (the reference where the kernel cannot run).

    query and key may be strided views (the queries of a projection that interleaves them with their
    gates) with unit stride over their last dim."""
    if not available(query) or not _zero_centred(q_norm) or not _zero_centred(k_norm) or cos.dtype != query.dtype:
        # (the kernel rounds the rotation's products to the queries' dtype, as the module does when cos is in it)
        return norm_rotate_reference(query, key, q_norm, k_norm, cos, sin, rotate)
    batch, tokens, heads, dim = query.shape
    kv_heads = key.shape[2]
    rotary = cos.shape[-1]
    if key.shape != (batch, tokens, kv_heads, dim) or query.stride(3) != 1 or key.stride(3) != 1:
        raise ValueError(f"norm_rotate: query {list(query.shape)} and key {list(key.shape)} of one batch and head "
                         "dim, with unit stride over it, expected")
    if dim & (dim - 1) or rotary % 2 or rotary > dim or cos.shape != (batch, tokens, rotary) or sin.shape != cos.shape:
        raise ValueError(f"norm_rotate: head dim {dim} (a power of two), cos and sin {[batch, tokens, rotary]} "
                         f"(an even count <= the head dim) expected, got {list(cos.shape)} and {list(sin.shape)}")
    if q_norm.eps != k_norm.eps:
        raise ValueError(f"norm_rotate: the query's and key's norms take one eps, got {q_norm.eps} and {k_norm.eps}")
    q_out = query.new_empty(batch, heads, tokens, dim)
    k_out = key.new_empty(batch, kv_heads, tokens, dim)
    _norm_rotate_kernel[(batch * tokens * (heads + kv_heads),)](
        query, key, q_norm.weight, k_norm.weight, cos.contiguous(), sin.contiguous(), q_out, k_out, q_norm.eps,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2), tokens,
        heads=heads, kv_heads=kv_heads, dim=dim, rotary=rotary,
    )
    return q_out, k_out


def _zero_centred(norm) -> bool:
    """Whether `norm` is the Qwen3.5 family's RMSNorm, whose weight w multiplies as 1 + w (the kernel's)."""
    return type(norm).__name__ in ("Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm")
