"""Decoding with the frozen base, one static step for the whole batch: what self-generation runs on a GPU.

A batch first reads its prompts in a prefill (`BatchDecoder.prefill`): the positions every
prompt holds, a few rows and up to PREFILL_CHUNK tokens a pass, each pass's attention only
over the keys written so far and the Gated DeltaNet's chunked rule carried from the state the
last pass left. Then every row advances one position a step, all rows at the same position
(the prefill ends where the shortest prompt does): while a row is still reading its prompt
the step feeds it the prompt's next token, afterwards the token it chose, so no prompt needs
padding. The state is allocated once for the batch: the full-attention layers' keys and
values (`StaticKV`, which `_attend`, the attention module's forward unrolled, writes and
`gqa_decode_attention` reads), the Gated DeltaNet layers' conv windows and
recurrent states (one buffer each, so that a snapshot is one copy). The step reads and writes
only those buffers, so on CUDA it is captured in one CUDA graph and replayed: no Python and
no kernel launches per step beyond the replay.
The decoder layer is transformers' (norms, attention, MoE block), unrolled as in
`fastbase.packed_hidden`. On CUDA the kernels are the fast pass's: the residual adds and
RMSNorms fused (fla's, `fastbase.fla_kernels`, where importable), the MoE block
`fastbase.decode_moe_block` (its experts' GEMMs `moe_kernels.expert_mlp` up to 256 tokens),
the Gated DeltaNet's conv and rule `decode_kernels`' in a step (two kernels a layer) and fla's
chunked rule in a prefill; elsewhere the modules' own and the kernels' PyTorch references. On
any device, a base laid out as it opens (`joined.lay_out`) has each Gated DeltaNet's four input
projections and each attention layer's three, and on CUDA each MoE block's router and shared-expert
inputs, read in one GEMM; the attention layer is its module's forward unrolled (`_attend`), its
queries' and keys' norms and rotation one kernel on CUDA (`decode_kernels.norm_rotate`).
`span_step` runs the same layers over a few tokens of a row at once (the reference
decoder's verify pass: the experts read once), keeping each Gated DeltaNet layer's state
after every token, so that `StaticRunner.keep` rolls a rejected verify pass back with a
copy. `tests/test_fastdecode.py` holds the step, the prefill and the span against
`generate.plain_decode`, against one step a token and against the full forward.
`StaticHeadRunner` runs the MTP head's one layer the same way for the reference decoder's
drafts (its keys and values in a static buffer, its extends and greedy chains captured),
held against `decode.HeadRunner` in tests/test_decode.py and tests/test_fastdecode.py.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Collection, Sequence

import torch

from occamy_mtp.base.frozen import runs_fast_paths
from occamy_mtp import families
from occamy_mtp.families import family_of
from occamy_mtp.base.decode_kernels import conv_steps_, conv_steps_reference, gated_delta_steps_, log_decay, norm_rotate
from occamy_mtp.sampling import GREEDY_TEXT, TextSampling, draw
from occamy_mtp.base.generate import check_prompts, check_uniforms
from occamy_mtp.base.joined import attention_inputs, linear_attention_inputs
from occamy_mtp.base.fastbase import (Kernels, decode_moe_block, decoder_layer, fla_kernels, module_moe, residual_norm,
                                      token_bytes, torch_gated_delta_rule, torch_kernels)

CHECK_EVERY_STEPS = 32  # steps between looks at whether every row has finished (each look waits for the GPU)
# Bytes a step's transient tensors take per logit of a row, beside the row's state: the
# logits' argmax (greedy), or the processed distribution's float32 scaling and softmax, its
# sort (values and int64 indices) for top-p, the masks and the float64 cumulative sum of the
# draw (sampled). `row_bytes` is held against the decoder's measured peak at real size in
# bench/results/decode.md.
GREEDY_STEP_BYTES_PER_LOGIT = 4
SAMPLED_STEP_BYTES_PER_LOGIT = 36
# Penalties add, over the vocabulary and beside the sampled step's: the penalized fp32 logits and their
# padded copy, the answer's counts (fp32) and the mask of tokens seen (`sampling.penalized`).
PENALTY_STEP_BYTES_PER_LOGIT = 24
DEFAULT_MAX_BATCH = 160  # the largest batch a self-generation sizes itself to: the one measured fastest a window
# A prefill pass reads up to PREFILL_CHUNK tokens of as many rows as keep its transient tensors
# (`BatchDecoder.prefill_token_bytes`) within PREFILL_PASS_BYTES, which the sizing keeps free beside
# the rows' state (`selfgen.store.EmbeddedWriter.batch_for`).
PREFILL_CHUNK = 256
PREFILL_PASS_BYTES = 2**30
# The attention's transient bytes per query and key of a head: its fp32 scores, their fp32 softmax
# and the probabilities in bf16 (`gqa_decode_attention`).
ATTENTION_BYTES_PER_SCORE = 10


def gqa_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of a few query positions over a static key buffer, the key/value heads shared in groups.

    transformers' sdpa path repeats the (B, KVH, L, D) keys and values up to the query heads
    whenever a mask is given: at real size that copy was a seventh of a decode step
    (bench/results/decode.md). Here each query head group reads its key/value head as it is.
    query (B, H, T, D); key, value (B, KVH, L, D); attention_mask additive, broadcast to (B, H, T, L).
    Returns ((B, T, H, D), None), as transformers' attention functions do.
    """
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    grouped = query.reshape(batch, kv_heads, groups * length, dim)  # query head i reads key/value head i // groups
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scale  # (B, KVH, G * T, L)
    if attention_mask is not None:  # added where it broadcasts, never expanded to the scores' size
        mask = attention_mask.float()  # (1 or B, 1 or H, T, L)
        mask = mask[:, :, None] if mask.shape[1] == 1 else mask.reshape(mask.shape[0], kv_heads, groups, length, -1)
        scores = scores.view(batch, kv_heads, groups, length, -1).add_(mask).view(batch, kv_heads, groups * length, -1)
    out = torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)  # (B, KVH, G * T, D)
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


def _attend(attention, position_embeddings, mask: torch.Tensor, kv: "StaticKV", normed: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3.5 attention (`Qwen3_5MoeAttention.forward`) over the step's positions, its keys and
    values in `kv`: the queries with their gates, the keys and the values in one GEMM where the base is laid
    out (`joined.attention_inputs`), the heads' norms and rotary embedding in one kernel on CUDA
    (`decode_kernels.norm_rotate`; the module's own norms and the family's rotation elsewhere), then
    `gqa_decode_attention`, the output gate and the output projection. normed: (B, T, D)."""
    batch, tokens = normed.shape[:2]
    dim = attention.head_dim
    query_gate, key, value = attention_inputs(attention, normed)
    query_gate = query_gate.view(batch, tokens, -1, 2 * dim)  # each head's query, then its gate
    query, gate = query_gate[..., :dim], query_gate[..., dim:]
    cos, sin = position_embeddings
    rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb
    query, key = norm_rotate(query, key.view(batch, tokens, -1, dim), attention.q_norm, attention.k_norm, cos, sin, rotate)
    keys, values = kv.update(key, value.view(batch, tokens, -1, dim).transpose(1, 2), attention.layer_idx)
    out, _ = gqa_decode_attention(attention, query, keys, values, mask, scaling=attention.scaling)
    out = out.reshape(batch, tokens, -1) * torch.sigmoid(gate.reshape(batch, tokens, -1))
    return attention.o_proj(out)


def _buffer_mask(positions: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (1, 1, T, L) of queries at `positions` (T,) over keys at `keys` (L,) = 0..L-1:
    each query sees the keys at its own position and before (the rest of the buffer is masked)."""
    visible = keys[None, :] <= positions[:, None]  # (T, L)
    mask = torch.zeros(visible.shape, dtype=dtype, device=keys.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]


class StaticKV:
    """Keys and values of the full-attention layers for `positions` positions, allocated once.

    `_attend` calls `update` with the new keys and values (as transformers' module calls its cache's); they are
    written at the step's position and the whole buffer comes back (masked by the step). A
    prefill pass narrows both: `rows`, the rows it feeds, and `visible`, the keys it can see
    (the positions written so far), so that its attention reads no more than those.
    """

    def __init__(self, layers: Sequence[int], batch: int, positions: int, kv_heads: int, head_dim: int, dtype, device):
        shape = (batch, kv_heads, positions, head_dim)
        self.keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.values = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # the first position this step writes
        self.writes = self.position
        """Every position this step writes: `position`, or a span's positions (`BatchDecoder.span_step`)."""
        self.rows: slice = slice(None)
        self.visible: int | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.keys[layer_idx][self.rows], self.values[layer_idx][self.rows]
        keys.index_copy_(2, self.writes, key_states)
        values.index_copy_(2, self.writes, value_states)
        if self.visible is not None:
            return keys[:, :, : self.visible], values[:, :, : self.visible]
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.position)


def chunked_gated_delta_(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """The gated delta rule over T tokens of each row in chunks (a prefill), from `state` (B, HV, dk, dv),
    fp32, which becomes the state after the last token. q, k (B, T, H, dk); v (B, T, HV, dv); g, beta
    (B, T, HV). Returns (B, T, HV, dv). fla's chunked kernel on CUDA where it imports; elsewhere
    transformers' PyTorch rule (`fastbase.torch_gated_delta_rule`)."""
    if q.is_cuda:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except ImportError:
            pass
        else:
            out, final = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
            state.copy_(final)
            return out
    out, final = torch_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)
    state.copy_(final)
    return out


def _kernels(device: torch.device) -> Kernels:
    """The fast pass's fused norms on CUDA where fla imports; the modules' own norms elsewhere."""
    if device.type == "cuda":
        try:
            return fla_kernels(fused_norms=True)
        except ImportError:  # the step stays correct with the modules' norms; the fast pass warns of fla once
            pass
    return torch_kernels()


def _moe(device: torch.device):
    """The MoE block: `fastbase.decode_moe_block` (Triton routing, experts and glue; a laid-out block's input
    projections in one GEMM) on CUDA; the module's own elsewhere."""
    return decode_moe_block if device.type == "cuda" else module_moe


class BatchDecoder:
    """The base's continuation of a batch of prompts: a prefill, then one static step at a time (module docstring).

    decoder = BatchDecoder(base, batch=64, positions=128 + 382)
    continuations = decoder.generate(prompts, max_new_tokens=382, eos_token_ids={...})

    `positions` bounds the longest prompt plus `max_new_tokens` - 1. A decoder is reused
    for batches of up to `batch` prompts (its graph and state stay allocated). With `span`,
    `span_step` also feeds up to that many tokens of every row in one pass (the reference
    decoder's verify passes, `StaticRunner`).
    """

    def __init__(self, base, *, batch: int, positions: int, cuda_graph: bool | None = None, span: int = 0,
                 sampling: TextSampling = GREEDY_TEXT, prefill: bool = True):
        if not runs_fast_paths(base):
            raise ValueError(f"BatchDecoder runs a whole base, its inputs not fake-quantized, of a family whose fast_paths "
                             f"are on (`occamy_mtp.base.frozen.FrozenBase.fast_paths`), not this model_type "
                             f"{base.config.model_type!r} base")
        config = base.config
        self.base, self.batch, self.positions = base, batch, positions
        self.prefills = prefill  # False: every prompt position is a step (the oracle and the benchmark's baseline)
        self.device = base.lm_head.weight.device
        if self.device.type == "cuda":
            # The allocator's cache handed back first. On fixed segments a decoder dropped just before
            # leaves its state cached as one large block; this decoder's smaller buffers, allocated
            # first, would be cut from it and leave no block for its own state (bench/results/decode.md).
            torch.cuda.empty_cache()
        self.moe = _moe(self.device)
        self.kernels = _kernels(self.device)
        dtype = base.lm_head.weight.dtype
        layers = base.model.layers[: config.num_hidden_layers]
        kinds = config.layer_types[: config.num_hidden_layers]
        attention = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
        self.kv = StaticKV(attention, batch, positions, config.num_key_value_heads, config.head_dim, dtype, self.device)
        # The Gated DeltaNet layers' conv windows and recurrent states, each kind one buffer
        # (`conv_states`, `recurrent_states`) viewed per layer (`conv_state[i]`, `recurrent_state[i]`).
        linear = [i for i, kind in enumerate(kinds) if kind == "linear_attention"]
        self.conv_states = self.recurrent_states = None
        self.conv_state, self.recurrent_state = {}, {}
        if linear:
            mixer = layers[linear[0]].linear_attn
            channels = mixer.conv1d.weight.shape[0]
            self.conv_states = torch.zeros(len(linear), batch, channels, mixer.conv_kernel_size - 1, dtype=dtype, device=self.device)
            self.recurrent_states = torch.zeros(len(linear), batch, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim,
                                                dtype=torch.float32, device=self.device)
            for n, i in enumerate(linear):
                self.conv_state[i], self.recurrent_state[i] = self.conv_states[n], self.recurrent_states[n]
        # What a span step keeps of each Gated DeltaNet layer (`keep`): the recurrent state after
        # each of its tokens and the conv's new inputs, so that a verify pass whose drafts are
        # rejected needs no second pass (the reference decoder's runner only: one row).
        self.span_states = self.span_inputs = None
        self._recording = False
        self._prefilling = False  # a prefill pass: the Gated DeltaNet runs its chunked rule on `kv.rows`
        if linear and span > 1:
            self.span_states = torch.zeros(len(linear), span, *self.recurrent_states.shape[1:], dtype=torch.float32,
                                           device=self.device)
            self.span_inputs = torch.zeros(len(linear), batch, span, channels, dtype=dtype, device=self.device)
        self._linear_index = {i: n for n, i in enumerate(linear)}
        # The step's inputs and outputs, read and written in place (so that a graph can replay them).
        self.tokens = torch.zeros(batch, dtype=torch.long, device=self.device)  # fed at this step
        self.prompts = torch.zeros(batch, positions + 1, dtype=torch.long, device=self.device)
        self.prompt_lengths = torch.ones(batch, dtype=torch.long, device=self.device)
        self.chosen = torch.zeros(batch, positions, dtype=torch.long, device=self.device)  # the choice at each position
        # Sampled decoding: the uniform each position's choice is drawn with (a row's j-th new token is
        # drawn at position len(prompt) - 1 + j with its stream's j-th value), and the settings.
        self.sampling = sampling
        self.uniforms = torch.zeros(0 if sampling.greedy else batch, positions, dtype=torch.float64, device=self.device)
        self.hidden = torch.zeros(batch, config.hidden_size, dtype=dtype, device=self.device)  # last step's, post-norm
        self.logits = torch.zeros(batch, config.vocab_size, dtype=dtype, device=self.device)  # last step's
        self._arange = torch.arange(positions, device=self.device)
        self.span = span  # the most tokens a `span_step` feeds (0: none; its buffers are then empty)
        self.span_tokens = torch.zeros(batch, span, dtype=torch.long, device=self.device)  # `span_step`'s input
        self.span_hidden = torch.zeros(batch, span, config.hidden_size, dtype=dtype, device=self.device)
        self.span_logits = torch.zeros(batch, span, config.vocab_size, dtype=dtype, device=self.device)
        # Captured only in bf16: torch's grouped GEMM runs other dtypes through a fallback that
        # copies to the host, which a capture refuses (a float32 base on CUDA decodes eagerly).
        capturable = self.device.type == "cuda" and dtype == torch.bfloat16
        if cuda_graph and not capturable:
            raise ValueError(f"cuda_graph=True needs a bfloat16 base on CUDA, got {dtype} on {self.device}")
        self.cuda_graph = capturable if cuda_graph is None else cuda_graph
        self._graph = None

    @staticmethod
    def row_state_bytes(config, positions: int, dtype: torch.dtype, sampled: bool = False) -> int:
        """Bytes of the state one row of a batch holds: every buffer `__init__` allocates per row."""
        kinds = config.layer_types[: config.num_hidden_layers]
        size = torch.empty((), dtype=dtype).element_size()
        attention, linear = kinds.count("full_attention"), kinds.count("linear_attention")
        keys_values = attention * 2 * config.num_key_value_heads * positions * config.head_dim * size
        channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim + config.linear_num_value_heads * config.linear_value_head_dim
        conv = linear * channels * (config.linear_conv_kernel_dim - 1) * size
        recurrent = linear * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
        steps = 8 * (1 + (positions + 1) + 1 + positions)  # the token fed, the prompt, its length, the choices
        last = (config.hidden_size + config.vocab_size) * size  # the last step's hidden state and logits
        uniforms = 8 * positions if sampled else 0
        return keys_values + conv + recurrent + steps + last + uniforms

    @classmethod
    def row_bytes(cls, config, positions: int, dtype: torch.dtype, sampling: TextSampling = GREEDY_TEXT) -> int:
        """Bytes one row of a batch takes: its state and the step's transient tensors over the vocabulary."""
        per_logit = GREEDY_STEP_BYTES_PER_LOGIT if sampling.greedy else SAMPLED_STEP_BYTES_PER_LOGIT
        per_logit += PENALTY_STEP_BYTES_PER_LOGIT if sampling.penalized else 0
        return cls.row_state_bytes(config, positions, dtype, not sampling.greedy) + config.vocab_size * per_logit

    @staticmethod
    def prefill_token_bytes(config, visible: int, dtype: torch.dtype) -> int:
        """Transient bytes a prefill pass takes per token of a row whose keys reach `visible`
        positions: the layer's activations (`fastbase.token_bytes`) and one attention layer's
        scores over those keys (ATTENTION_BYTES_PER_SCORE)."""
        return token_bytes(config, dtype) + config.num_attention_heads * visible * ATTENTION_BYTES_PER_SCORE

    # -- the step ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Feed `tokens` at `kv.position` to every row; record the argmax; choose the next tokens; advance."""
        base, position = self.base, self.kv.position
        model = base.model
        hidden = model.embed_tokens(self.tokens[:, None])  # (B, 1, D)
        positions = position.expand(self.batch)[:, None]  # (B, 1), every row at the same position
        position_embeddings = model.rotary_emb(hidden, positions[None].expand(3, -1, -1))  # text M-RoPE: three equal rows
        mask = _buffer_mask(position, self._arange, hidden.dtype)  # (1, 1, 1, L): keys at positions 0..t
        self.hidden.copy_(self._layers(hidden, position_embeddings, mask)[:, -1])
        logits = base.lm_head(self.hidden)  # (B, V)
        self.logits.copy_(logits)
        if self.sampling.greedy:
            chosen = logits.argmax(dim=-1)  # ties go to the lowest id, as in plain_decode
        else:
            history = self._penalty_history(position) if self.sampling.penalized else None
            chosen = draw(self.sampling.probs(logits, history), self.uniforms.index_select(1, position)[:, 0])
        self.chosen.index_copy_(1, position, chosen[:, None])
        following = position + 1
        from_prompt = following < self.prompt_lengths  # (B,) still reading its prompt
        self.tokens.copy_(torch.where(from_prompt, self.prompts.index_select(1, following)[:, 0], chosen))
        position.add_(1)

    def _penalty_history(self, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the penalties read at this step (`sampling.penalized`), in fixed shapes (a graph holds
        it): each row's answer so far, the choices made at positions prompt length - 1 .. position - 1
        (the tokens after its prompt), and its prompt; -1 elsewhere."""
        lengths = self.prompt_lengths[:, None]
        answer = self.chosen.masked_fill((self._arange < lengths - 1) | (self._arange >= position), -1)
        prompt = self.prompts.masked_fill(torch.arange(self.prompts.shape[1], device=self.device) >= lengths, -1)
        return answer, prompt

    def _layers(self, hidden: torch.Tensor, position_embeddings, mask: torch.Tensor) -> torch.Tensor:
        """The decoder layers over (B, T, D) at the positions `kv.writes`, then the final norm."""
        base, kernels = self.base, self.kernels
        residual = None
        for i, layer in enumerate(base.model.layers[: base.config.num_hidden_layers]):
            if i in self.conv_state:
                mix = functools.partial(self._gated_deltanet, layer.linear_attn, layer=i)
            else:
                mix = functools.partial(_attend, layer.self_attn, position_embeddings, mask, self.kv)
            hidden, residual = decoder_layer(layer, hidden, residual, kernels, mix, self.moe)
        return residual_norm(base.model.norm, hidden, residual, kernels)[0]

    def _gated_deltanet(self, mixer, x: torch.Tensor, layer: int) -> torch.Tensor:
        """`Qwen3_5MoeGatedDeltaNet.forward` for T tokens in a row with this decoder's conv and
        recurrent state: one causal-conv window over the last K - 1 inputs and the T new ones,
        then T recurrent steps (both states in place). x: (B, T, D)."""
        if self._prefilling:
            return self._gated_deltanet_chunked(mixer, x, layer)
        batch, tokens = x.shape[:2]
        projected, z, b, a = linear_attention_inputs(mixer, x)  # one GEMM where the base is laid out (`joined`)
        states = None
        if self._recording:
            n = self._linear_index[layer]
            self.span_inputs[n, :, :tokens].copy_(projected)
            states = self.span_states[n, :tokens]
        mixed_qkv = conv_steps_(projected, self.conv_state[layer], mixer.conv1d.weight[:, 0], mixer.conv1d.bias)
        z = z.reshape(-1, mixer.head_v_dim)
        query, key, value = torch.split(mixed_qkv, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
        query = query.reshape(batch, tokens, -1, mixer.head_k_dim)  # (B, T, H, K), views of the conv's output
        key = key.reshape(batch, tokens, -1, mixer.head_k_dim)
        value = value.reshape(batch, tokens, -1, mixer.head_v_dim)  # (B, T, HV, V)
        core = gated_delta_steps_(query, key, value, a, b.sigmoid(), mixer.A_log, mixer.dt_bias,
                                  self.recurrent_state[layer], states).reshape(-1, mixer.head_v_dim)
        if self.kernels.rms_norm_gated is not None:
            core = self.kernels.rms_norm_gated(core, z, mixer.norm.weight, mixer.norm.variance_epsilon)
        else:
            core = mixer.norm(core, z)
        return mixer.out_proj(core.reshape(batch, tokens, -1))

    def _gated_deltanet_chunked(self, mixer, x: torch.Tensor, layer: int) -> torch.Tensor:
        """`_gated_deltanet` for a prefill pass over the rows `kv.rows`: the conv over their window
        and the T new inputs, the delta rule in chunks (`chunked_gated_delta_`) from their state."""
        batch, tokens = x.shape[:2]
        rows = self.kv.rows
        projected, z, b, a = linear_attention_inputs(mixer, x)
        mixed_qkv = conv_steps_reference(projected, self.conv_state[layer][rows], mixer.conv1d.weight[:, 0], mixer.conv1d.bias)
        z = z.reshape(-1, mixer.head_v_dim)
        query, key, value = torch.split(mixed_qkv, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
        query = query.reshape(batch, tokens, -1, mixer.head_k_dim)
        key = key.reshape(batch, tokens, -1, mixer.head_k_dim)
        value = value.reshape(batch, tokens, -1, mixer.head_v_dim)
        g = log_decay(a, mixer.A_log, mixer.dt_bias)
        core = chunked_gated_delta_(query, key, value, g, b.sigmoid(),
                                    self.recurrent_state[layer][rows]).reshape(-1, mixer.head_v_dim)
        if self.kernels.rms_norm_gated is not None:
            core = self.kernels.rms_norm_gated(core, z, mixer.norm.weight, mixer.norm.variance_epsilon)
        else:
            core = mixer.norm(core, z)
        return mixer.out_proj(core.reshape(batch, tokens, -1))

    # -- the prefill ------------------------------------------------------------------

    @torch.no_grad()
    def prefill_pass(self, ids: torch.Tensor, rows: slice) -> torch.Tensor:
        """Feed `ids` (R, T) to the rows `rows` at positions `kv.position` .. + T - 1, as T steps
        would (their keys and values, conv windows and recurrent states), in one pass whose
        attention sees only the keys written so far: their post-norm hidden states (R, T, D).
        The position is left where it was (`prefill` moves it once every row is fed)."""
        base, start = self.base, int(self.kv.position)
        tokens = ids.shape[1]
        if start + tokens > self.positions:
            raise ValueError(f"a prefill to position {start + tokens} of a decoder that holds {self.positions}")
        model = base.model
        hidden = model.embed_tokens(ids)  # (R, T, D)
        positions = start + self._arange[:tokens]
        position_embeddings = model.rotary_emb(hidden, positions[None, None].expand(3, ids.shape[0], -1))
        mask = _buffer_mask(positions, self._arange[: start + tokens], hidden.dtype)  # (1, 1, T, start + T)
        self.kv.writes, self.kv.rows, self.kv.visible = positions, rows, start + tokens
        self._prefilling = True
        try:
            return self._layers(hidden, position_embeddings, mask)
        finally:
            self.kv.writes, self.kv.rows, self.kv.visible = self.kv.position, slice(None), None
            self._prefilling = False

    def prefill_tokens(self, start: int, remaining: int) -> int:
        """Tokens of a row the next prefill pass from `start` reads: up to PREFILL_CHUNK, halved
        while one row's pass would take more than PREFILL_PASS_BYTES."""
        tokens = min(PREFILL_CHUNK, remaining)
        while tokens > 1 and tokens * self.prefill_token_bytes(self.base.config, start + tokens, self.hidden.dtype) > PREFILL_PASS_BYTES:
            tokens //= 2
        return tokens

    def prefill(self, rows: int, length: int) -> None:
        """Read positions 0 .. `length` - 1 of the first `rows` rows' prompts (which each holds):
        passes of up to PREFILL_CHUNK tokens and as many rows as fit PREFILL_PASS_BYTES; then the
        step goes on from `length`, feeding each row its prompt's token there."""
        start = int(self.kv.position)
        while start < length:
            tokens = self.prefill_tokens(start, length - start)
            group = max(1, PREFILL_PASS_BYTES // (tokens * self.prefill_token_bytes(self.base.config, start + tokens, self.hidden.dtype)))
            for first in range(0, rows, group):
                chosen = slice(first, min(rows, first + group))
                self.prefill_pass(self.prompts[chosen, start : start + tokens], chosen)
            start += tokens
            self.kv.position.fill_(start)
        self.tokens.copy_(self.prompts[:, length])

    @torch.no_grad()
    def span_step(self, tokens: int) -> None:
        """Feed `span_tokens[:, :tokens]` at positions `kv.position` .. + tokens - 1 in one pass (every
        row at the same positions): post-norm hidden states and logits into `span_hidden` and
        `span_logits`; advance. What a verify pass of K + 1 tokens needs, the experts read once."""
        if not 1 <= tokens <= self.span:
            raise ValueError(f"a span step feeds 1 to {self.span} tokens (the decoder's span), got {tokens}")
        base, position = self.base, self.kv.position
        model = base.model
        hidden = model.embed_tokens(self.span_tokens[:, :tokens])  # (B, T, D)
        positions = position + self._arange[:tokens]  # (T,)
        position_embeddings = model.rotary_emb(hidden, positions[None, None].expand(3, self.batch, -1))
        mask = _buffer_mask(positions, self._arange, hidden.dtype)  # (1, 1, T, L): query t sees keys 0..position + t
        self.kv.writes = positions
        self._recording = self.span_states is not None
        try:
            normed = self._layers(hidden, position_embeddings, mask)
        finally:
            self.kv.writes = self.kv.position
            self._recording = False
        self.span_hidden[:, :tokens].copy_(normed)
        self.span_logits[:, :tokens].copy_(base.lm_head(normed))
        position.add_(tokens)

    def _capture(self) -> None:
        """Capture one step as a CUDA graph (`_graph_of`); it changes the state: the caller resets it after."""
        self._graph = self._graph_of(self.step)

    def _graph_of(self, run) -> torch.cuda.CUDAGraph:
        """`run` captured as a CUDA graph (`_graph_of`); it changes the state: the caller resets it after."""
        return _graph_of(self.device, run)

    def _run_step(self) -> None:
        if self._graph is not None:
            self._graph.replay()
        else:
            self.step()

    # -- a batch ----------------------------------------------------------------------

    def _reset(self, prompts: Sequence[Sequence[int]], uniforms: Sequence[torch.Tensor] | None = None) -> None:
        rows = len(prompts)
        self.prompts.zero_()
        self.prompt_lengths.fill_(1)
        self.uniforms.zero_()
        for row, prompt in enumerate(prompts):
            self.prompts[row, : len(prompt)] = torch.as_tensor(prompt, dtype=torch.long)
            self.prompt_lengths[row] = len(prompt)
            if uniforms is not None:
                stream = uniforms[row][: self.positions - len(prompt) + 1]
                self.uniforms[row, len(prompt) - 1 : len(prompt) - 1 + len(stream)] = stream.to(self.device)
        if rows < self.batch:  # spare rows decode a one-token prompt; their tokens are dropped
            self.prompt_lengths[rows:] = 1
        for state in [*self.kv.keys.values(), *self.kv.values.values(), self.conv_states, self.recurrent_states, self.chosen]:
            if state is not None:
                state.zero_()
        self.kv.position.zero_()
        self.tokens.copy_(self.prompts[:, 0])

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_token_ids: Collection[int],
                 uniforms: Sequence[torch.Tensor] | None = None) -> list[list[int]]:
        """Continuations of `prompts` (at most `batch`), greedy or drawn as the decoder's `sampling`
        says with one stream of `uniforms` per prompt: up to `max_new_tokens` ids each, ending with
        the first token of `eos_token_ids` when one is generated (as `generate.plain_decode`)."""
        if not 1 <= len(prompts) <= self.batch:
            raise ValueError(f"1 to {self.batch} prompts a batch, got {len(prompts)}")
        check_prompts(prompts, max_new_tokens)
        check_uniforms(prompts, self.sampling, uniforms, max_new_tokens)
        steps = max(len(p) for p in prompts) + max_new_tokens - 1
        if steps > self.positions:
            raise ValueError(f"a prompt of {max(len(p) for p in prompts)} tokens and {max_new_tokens} new ones need "
                             f"{steps} positions; this decoder holds {self.positions}")
        eos = frozenset(int(t) for t in eos_token_ids)
        if self.cuda_graph and self._graph is None:
            self._reset(prompts, uniforms)
            self._capture()
        self._reset(prompts, uniforms)
        stops = torch.tensor(sorted(eos), dtype=torch.long, device=self.device)
        first = torch.tensor([len(p) - 1 for p in prompts], device=self.device)  # position of the first new token
        shared = min(len(p) for p in prompts) - 1 if self.prefills else 0  # positions every prompt holds
        self.prefill(len(prompts), shared)
        for done in range(shared + 1, steps + 1):
            self._run_step()
            if done % CHECK_EVERY_STEPS == 0 and done < steps and self._all_finished(first, stops, done, max_new_tokens):
                break
        chosen = self.chosen[: len(prompts)].cpu().tolist()
        out = []
        for row, prompt in enumerate(prompts):
            continuation = chosen[row][len(prompt) - 1 : len(prompt) - 1 + max_new_tokens]
            stop = next((i for i, token in enumerate(continuation) if token in eos), None)
            out.append(continuation if stop is None else continuation[: stop + 1])
        return out

    def _all_finished(self, first: torch.Tensor, stops: torch.Tensor, done: int, max_new_tokens: int) -> bool:
        """Whether every row has chosen a stop token or its whole budget within the first `done` positions."""
        positions = self._arange[:done]
        generated = (positions[None] >= first[:, None]) & (positions[None] < first[:, None] + max_new_tokens)  # (R, done)
        is_stop = torch.isin(self.chosen[: len(first), :done], stops) & generated
        budget_spent = first + max_new_tokens <= done
        return bool((is_stop.any(dim=1) | budget_spent).all())


class StaticRunner:
    """The reference decoder's base runner (`decode.BaseRunner`'s interface) on a one-row `BatchDecoder`.

    `forward(tokens)` runs the tokens in spans of up to `span` (a verify pass of K drafts
    and the token before them is one span of K + 1: the experts read once, not K + 1
    times), each span length captured once as a CUDA graph, and returns their post-norm
    hidden states and fp32 logits; `snapshot()`/`restore()` put the conv and recurrent
    state and the position back (keys and values past the position are masked, and written
    over when the text goes on), and `keep(snapshot, j)` keeps the first j tokens of a span
    from the states it kept. `positions` bounds the text, drafts included.
    """

    def __init__(self, base, positions: int, span: int = 1):
        if span < 1:
            raise ValueError(f"span must be >= 1, got {span}")
        self.decoder = BatchDecoder(base, batch=1, positions=positions, span=span)
        self.seen = 0
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._empty = self.snapshot()
        self._last_forward: tuple[int, list[int]] = (0, [])  # where the last forward started, and its tokens

    def reset(self) -> None:
        """Empty, as when built: the runner of a new text (its captured graphs kept)."""
        self.restore(self._empty)

    def forward(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        decoder = self.decoder
        if self.seen + len(tokens) > decoder.positions:
            raise ValueError(f"{self.seen + len(tokens)} positions asked of a runner that holds {decoder.positions}")
        hidden, logits = [], []
        self._last_forward = (self.seen, list(tokens))
        for start in range(0, len(tokens), decoder.span):
            chunk = tokens[start : start + decoder.span]
            decoder.span_tokens[0, : len(chunk)] = torch.as_tensor(list(chunk), dtype=torch.long)
            self._run_span(len(chunk))
            hidden.append(decoder.span_hidden[0, : len(chunk)].clone())
            logits.append(decoder.span_logits[0, : len(chunk)].to(torch.float32, copy=True))
        self.seen += len(tokens)
        return torch.cat(hidden), torch.cat(logits)  # (m, D), (m, V)

    def prefill(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for a prompt: the tokens in prefill passes (`BatchDecoder.prefill_pass`), and the
        logits of the last one only (V,), fp32 (what decoding reads of a prompt; a long prompt's
        whole logits would not fit)."""
        decoder = self.decoder
        if self.seen + len(tokens) > decoder.positions:
            raise ValueError(f"{self.seen + len(tokens)} positions asked of a runner that holds {decoder.positions}")
        self._last_forward = (self.seen, list(tokens))
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=decoder.device)[None]
        hidden, start = [], 0
        while start < len(tokens):
            count = decoder.prefill_tokens(int(decoder.kv.position), len(tokens) - start)
            hidden.append(decoder.prefill_pass(ids[:, start : start + count], slice(0, 1))[0])
            decoder.kv.position.add_(count)
            start += count
        self.seen += len(tokens)
        hidden = torch.cat(hidden)  # (m, D)
        return hidden, decoder.base.lm_head(hidden[-1]).float()

    def _run_span(self, tokens: int) -> None:
        decoder = self.decoder
        if not decoder.cuda_graph:
            decoder.span_step(tokens)
            return
        if tokens not in self._graphs:
            saved = self.snapshot()
            self._graphs[tokens] = decoder._graph_of(lambda: decoder.span_step(tokens))
            self.restore(saved)
        self._graphs[tokens].replay()

    def keep(self, snapshot: dict, tokens: int) -> None:
        """Of the last forward, which started at `snapshot`, keep the first `tokens`: the state as if
        only they had been fed (a verify pass's accepted part). Where it was one span, from what the
        span kept: the recurrent states after its `tokens`-th token, the conv windows from the
        snapshot's and the span's inputs (the keys and values past them are masked, and written
        over); else by restoring the snapshot and feeding them again."""
        decoder = self.decoder
        kept = kept_tokens(self._last_forward, snapshot, tokens)
        if decoder.span_states is None or len(self._last_forward[1]) > decoder.span:
            self.restore(snapshot)
            self.forward(kept)
            return
        decoder.kv.position.copy_(snapshot["position"] + tokens)
        decoder.recurrent_states.copy_(decoder.span_states[:, tokens - 1])
        window = snapshot["states"][0]  # (layers, B, C, K - 1), before the span
        inputs = decoder.span_inputs[:, :, :tokens].transpose(-1, -2)  # (layers, B, C, tokens)
        decoder.conv_states.copy_(torch.cat([window, inputs], dim=-1)[..., -window.shape[-1] :])
        self.seen = snapshot["seen"] + tokens
        self._last_forward = (snapshot["seen"], kept)

    def snapshot(self) -> dict:
        decoder = self.decoder
        states = (decoder.conv_states, decoder.recurrent_states)
        return {"seen": self.seen, "position": decoder.kv.position.clone(),
                "states": [None if state is None else state.clone() for state in states]}

    def restore(self, snapshot: dict) -> None:
        decoder = self.decoder
        decoder.kv.position.copy_(snapshot["position"])
        for state, saved in zip((decoder.conv_states, decoder.recurrent_states), snapshot["states"]):
            if state is not None:
                state.copy_(saved)
        self.seen = snapshot["seen"]


class StaticHeadRunner:
    """The reference decoder's head runner (`decode.HeadRunner`'s interface) on static buffers.

    The head's one attention layer keeps its keys and values in a `StaticKV` of `positions`
    entries, one per anchor: `extend` writes step 1 at the next anchors and commits them
    (the position advances); `chain` writes its steps k >= 2 just past the committed entries,
    at their own positions, and leaves the position where it was (the rollback: the next
    `extend` writes over them). The layer is unrolled as `BatchDecoder._layers` unrolls the
    base's (its fused norms, MoE block and grouped attention on CUDA). On a bfloat16 head on
    CUDA an extend of 1 to `span` tokens and a greedy chain of 1 to `span` - 1 steps are each
    one CUDA graph, captured on first use and kept while the head's tensors stay where they
    were (captured again when a tensor is replaced, as export swaps the trained ones in);
    a greedy chain then waits for the GPU once, for its drafted tokens. Longer extends (the
    prompt) and chains that pick or override drafts run the same pass eagerly.
    """

    def __init__(self, head, positions: int, span: int):
        if span < 1:
            raise ValueError(f"span must be >= 1, got {span}")
        config = head.config
        lm_head = head.shared.lm_head
        self.head, self.positions, self.span = head, positions, span
        self.device = lm_head.weight.device
        dtype = lm_head.weight.dtype
        self.kv = StaticKV([0], 1, positions, config.num_key_value_heads, config.head_dim, dtype, self.device)
        self.moe = _moe(self.device)
        self.kernels = _kernels(self.device)
        self.ids = torch.zeros(positions, dtype=torch.long, device=self.device)  # an extend's tokens, a step's token
        self.hidden = torch.zeros(positions, config.hidden_size, dtype=dtype, device=self.device)  # the hidden states they see
        self.out = torch.zeros(positions, config.hidden_size, dtype=dtype, device=self.device)  # their post-norm outputs
        self.offset = torch.zeros(1, dtype=torch.long, device=self.device)  # a chain step's entry past the committed ones
        self.logits = torch.zeros(lm_head.weight.shape[0], dtype=dtype, device=self.device)  # a chain step's
        self.first = torch.zeros(config.hidden_size, dtype=dtype, device=self.device)  # a greedy chain's step-1 output
        self.drafted = torch.zeros(max(span - 1, 1), dtype=torch.long, device=self.device)  # a greedy chain's tokens
        self.chain_out = torch.zeros(max(span - 1, 1), config.hidden_size, dtype=dtype, device=self.device)
        self._arange = torch.arange(positions, device=self.device)
        self.cuda_graph = self.device.type == "cuda" and dtype == torch.bfloat16  # as `BatchDecoder` captures
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self._captured_from: tuple[int, ...] = ()
        self.anchors = 0

    def _tensors(self) -> list[torch.Tensor]:
        shared = self.head.shared
        return [*self.head.parameters(), shared.embed_tokens.weight, shared.lm_head.weight]

    def reset(self) -> None:
        """Empty: the runner of a new text (its graphs kept)."""
        self.kv.position.zero_()
        self.anchors = 0

    # -- the pass ---------------------------------------------------------------------

    def _pass(self, ids: torch.Tensor, hidden: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """The head over m tokens `ids` (m,) seeing `hidden` (m, D), its entries written at positions
        `start` (1,) .. + m - 1, each query seeing the entries up to its own: post-norm (m, D)."""
        head, kernels = self.head, self.kernels
        tokens = ids.shape[0]
        projected = head.project(ids[None], hidden[None])  # (1, m, D)
        positions = start + self._arange[:tokens]  # (m,)
        keys = self._arange if self.kv.visible is None else self._arange[: self.kv.visible]
        rotary = positions[None]  # (1, m); text M-RoPE takes three equal rows, as `MTPHead.backbone` gives it
        if family_of(head.config.model_type).text_mrope:
            rotary = rotary[None].expand(3, 1, -1)
        position_embeddings = head.rotary_emb(projected, rotary)
        mask = _buffer_mask(positions, keys, projected.dtype)  # (1, 1, m, L)
        layer = head.layers[0]
        self.kv.writes = positions
        try:
            attend = functools.partial(_attend, layer.self_attn, position_embeddings, mask, self.kv)
            out, residual = decoder_layer(layer, projected, None, kernels, attend, self.moe)
        finally:
            self.kv.writes = self.kv.position
        return residual_norm(head.norm, out, residual, kernels)[0][0]

    def _extend_pass(self, tokens: int) -> None:
        self.out[:tokens].copy_(self._pass(self.ids[:tokens], self.hidden[:tokens], self.kv.position))

    def _step_pass(self) -> None:
        """One chain step from `ids[0]` and `hidden[0]` at entry `offset` past the committed ones: output and logits."""
        out = self._pass(self.ids[:1], self.hidden[:1], self.kv.position + self.offset)
        self.out[:1].copy_(out)
        self.logits.copy_(self.head.logits(out[0]))

    def _greedy_chain(self, steps: int) -> None:
        """`steps` greedy drafts from `first`: step k >= 2 embeds step k - 1's argmax and sees its output."""
        output = self.first
        for step in range(steps):
            token = self.head.logits(output).argmax(-1, keepdim=True)  # (1,)
            self.drafted[step : step + 1].copy_(token)
            if step + 1 < steps:
                output = self._pass(token, output[None], self.kv.position + step)[0]
                self.chain_out[step].copy_(output)

    def _run(self, kind: str, size: int, run) -> None:
        if not self.cuda_graph:
            run()
            return
        where = tuple(t.data_ptr() for t in self._tensors())
        if where != self._captured_from:  # a tensor replaced: the graphs read the old one
            self._graphs.clear()
            self._captured_from = where
        if (kind, size) not in self._graphs:
            saved = self.kv.position.clone()
            self._graphs[(kind, size)] = _graph_of(self.device, run)
            self.kv.position.copy_(saved)
        self._graphs[(kind, size)].replay()

    # -- HeadRunner's interface ---------------------------------------------------------

    @torch.no_grad()
    def extend(self, next_tokens: Sequence[int], hidden: torch.Tensor) -> torch.Tensor:
        """Step 1 at anchors anchors..anchors+m-1: embeds x_{i+1} (`next_tokens`), sees H_i
        (`hidden`, (m, D)); returns the post-norm outputs (m, D) and commits their keys/values."""
        m = len(next_tokens)
        if self.anchors + m > self.positions:
            raise ValueError(f"{self.anchors + m} anchors asked of a head runner that holds {self.positions}")
        self.ids[:m] = torch.as_tensor(list(next_tokens), dtype=torch.long)
        self.hidden[:m].copy_(hidden)
        if m <= self.span:
            self._run("extend", m, lambda: self._extend_pass(m))
        else:  # a prompt: passes of PREFILL_CHUNK anchors, each seeing the entries written so far
            for start in range(0, m, PREFILL_CHUNK):
                end = min(m, start + PREFILL_CHUNK)
                self.kv.visible = self.anchors + end
                try:
                    self.out[start:end].copy_(self._pass(self.ids[start:end], self.hidden[start:end], self.kv.position + start))
                finally:
                    self.kv.visible = None
        self.kv.position.add_(m)
        self.anchors += m
        return self.out[:m].clone()

    @torch.no_grad()
    def chain(self, first: torch.Tensor, steps: int, override: Callable[[int, int], int] | None = None,
              pick: Callable[[torch.Tensor], int] | None = None) -> tuple[list[int], torch.Tensor]:
        """Draft `steps` tokens from step 1's output `first` (D,) at the last anchor (`decode.HeadRunner.chain`)."""
        if self.anchors + steps - 1 > self.positions:
            raise ValueError(f"a chain of {steps} steps at anchor {self.anchors - 1} passes the {self.positions} entries held")
        if override is None and pick is None and steps < self.span:
            self.first.copy_(first)
            self._run("chain", steps, lambda: self._greedy_chain(steps))
            return self.drafted[:steps].tolist(), torch.cat([first[None], self.chain_out[: steps - 1]])
        drafted: list[int] = []
        outputs = [first]
        for step in range(1, steps + 1):
            if step > 1:
                self.ids[0] = drafted[-1]
                self.hidden[0].copy_(outputs[-1])
                self.offset.fill_(step - 2)
                self._run("step", 1, self._step_pass)
                outputs.append(self.out[0].clone())
                logits = self.logits
            else:
                logits = self.head.logits(first)
            token = int(logits.argmax(-1)) if pick is None else pick(logits.clone())
            drafted.append(override(step, token) if override is not None else token)
        return drafted, torch.stack(outputs)


def kept_tokens(last_forward: tuple[int, list[int]], snapshot: dict, tokens: int) -> list[int]:
    """The first `tokens` of a runner's last forward (`(where it started, its tokens)`), which must
    have started at `snapshot`: what `keep(snapshot, tokens)` keeps."""
    start, fed = last_forward
    if start != snapshot["seen"] or not 1 <= tokens <= len(fed):
        raise ValueError(f"keep: {tokens} tokens of a forward of {len(fed)} from position {start}, "
                         f"asked against a snapshot at {snapshot['seen']}")
    return fed[:tokens]


def _graph_of(device: torch.device, run) -> torch.cuda.CUDAGraph:
    """Warm `run` up (autotuning, lazy allocations) on a side stream, then capture it as a CUDA graph.

    Both change the state; the caller puts it back after."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def static_head_decoding(head) -> bool:
    """Whether the reference decoder runs `head` with `StaticHeadRunner`: a head of a family with fast
    paths, on CUDA, whose tensors are all in the base's dtype, as export and serving hold it
    (elsewhere `decode.HeadRunner`, transformers' layer on a growing cache)."""
    lm_head = head.shared.lm_head.weight
    return (lm_head.device.type == "cuda" and families.fast_paths(head.config)
            and all(p.dtype == lm_head.dtype for p in head.parameters()))


def static_decoding(base) -> bool:
    """Whether self-generation decodes `base` with `BatchDecoder`: a base of a family with fast paths,
    on CUDA (elsewhere `generate.plain_decode`, whose cost there is not the launches)."""
    return base.lm_head.weight.device.type == "cuda" and runs_fast_paths(base)


def fast_plain_decode(base, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_token_ids: Collection[int],
                         batch_size: int, cuda_graph: bool | None = None, sampling: TextSampling = GREEDY_TEXT,
                         uniforms: Sequence[torch.Tensor] | None = None) -> list[list[int]]:
    """`generate.plain_decode` through `BatchDecoder`: `batch_size` prompts at a time, one decoder for all."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not prompts:
        return []
    longest = max(len(p) for p in prompts)
    decoder = BatchDecoder(base, batch=min(batch_size, len(prompts)), positions=max(1, longest + max_new_tokens - 1),
                           cuda_graph=cuda_graph, sampling=sampling)
    out: list[list[int]] = []
    for start in range(0, len(prompts), decoder.batch):
        streams = None if uniforms is None else uniforms[start : start + decoder.batch]
        out += decoder.generate(prompts[start : start + decoder.batch], max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
                                uniforms=streams)
    return out
