"""The MTP draft head, computed exactly as the serving engine runs it (docs/reference/CONTRACT.md section 2).

Step 1, anchored at position i (teacher forced)::

    u_i  = fc( cat[ N_e(E(x_{i+1})), N_h(H_i) ] )        # embedding half first
    g1_i = N_f( L(u_i, rotary position i, causal over positions <= i) )
    logits = g1_i @ W.T                                   # predicts x_{i+2}

Step k >= 2 (same anchor i) feeds the head its own post-norm output back::

    u    = fc( cat[ N_e(E(t_k)), N_h(g(k-1)_i) ] )
    gk_i = N_f( L(u, rotary position i+k-1) )             # predicts x_{i+k+1}

and attends over the step-1 keys/values at positions <= i plus the chain's own steps
2..k of the same anchor. All steps of all anchors run together: step k is one call of
the decoder layer on the whole (B, T) block, its keys/values appended to those of the
earlier steps, with a mask that lets anchor i see exactly its own prefix and chain.

The module is pure: no file I/O. It borrows the base's embedding and lm_head by
reference (they are not submodules, so they are neither trained, counted nor saved
with the head), and its parameter names are the checkpoint's `mtp.*` names without
the prefix (see `occamy_mtp.model.checkpoint` for the expert-layout conversion).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from occamy_mtp.compat import cache_kwarg
from occamy_mtp.families import FAMILIES, family_of

# The parameters that adapt the donor head to a new base (docs/reference/CONTRACT.md section 1).
TRAINABLE_DEFAULT = ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden")


# Positions per lm_head + argmax chunk wherever logits over the vocabulary are taken (the
# loss, the base's greedy targets): (4096 x 248,320) bf16 logits are ~2 GiB.
DEFAULT_LOGITS_CHUNK_TOKENS = 4096

# Bytes a (query, key) pair of the chain's attention mask takes at its peak: the additive bf16
# mask (2), the bool blocks it is built from and their concatenation (2), and one more for the
# attention kernel's aligned copy (1). The mask is (rows, T, steps x T): at 16k tokens and 3
# steps, 4.2 GB a window, more than everything else the chain holds.
MASK_BYTES_PER_SCORE = 5
# Hidden-sized activations a token of the chain keeps alive in its layer at once (residual,
# norms, q/k/v and the attention's gated output, the shared expert), beside the routed
# experts' gathered rows; the fast base pass's 13 (`fastbase.token_bytes`) plus the
# attention's projections, which the Gated DeltaNet layers there do not have.
CHAIN_HIDDEN_ACTIVATIONS = 20


@dataclass(frozen=True)
class SharedWeights:
    """The base's token embedding and lm_head, which the head uses but never owns."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear


class ChainKV:
    """Keys/values of the head's one attention layer across the steps of a chain.

    It implements the one method transformers' attention calls on a cache: `update`
    appends this step's keys/values (B, kv_heads, T, head_dim) along the sequence
    axis and returns everything seen so far. Autograd flows through the concatenation,
    so step k's loss reaches the step-1 keys.
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.keys is None:
            self.keys, self.values = key_states, value_states
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]


def default_experts_implementation() -> str:
    """transformers' grouped-GEMM experts where torch has the kernel, else its loop."""
    return "grouped_mm" if hasattr(torch, "_grouped_mm") else "eager"


def head_layer_config(text_config, attn_implementation: str = "sdpa", experts_implementation: str | None = None):
    """A copy of the base's text config for the head's single full-attention layer."""
    if family_of(text_config.model_type) is None:
        raise ValueError(f"model_type {text_config.model_type!r} is not supported; expected one of {sorted(FAMILIES)}")
    config = copy.deepcopy(text_config)
    config.layer_types = ["full_attention"]
    config.num_hidden_layers = 1
    if getattr(config, "mlp_only_layers", None):
        config.mlp_only_layers = []  # the head's layer is always the MoE layer
    config._attn_implementation = attn_implementation
    config._experts_implementation = experts_implementation or default_experts_implementation()
    return config


def chain_attention_mask(
    segment_ids: torch.Tensor, step: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive attention mask (B, 1, T, step*T) for chain step `step` (1-based).

    Keys are laid out as [step-1 block, step-2 block, ..., step-`step` block], each of
    length T. Query anchor i sees step-1 keys j <= i of its own segment (packed rows
    hold several windows, told apart by `segment_ids` (B, T)), and, in each later
    block, only its own anchor: the chain of that anchor. Right padding needs no extra
    masking, because padded positions come after every real one.
    """
    batch, length = segment_ids.shape
    device = segment_ids.device
    positions = torch.arange(length, device=device)
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, T)
    causal = positions[None, :, None] >= positions[None, None, :]  # (1, T, T)
    blocks = [same_segment & causal]
    own_anchor = torch.eye(length, dtype=torch.bool, device=device).expand(batch, -1, -1)
    blocks += [own_anchor] * (step - 1)
    allowed = torch.cat(blocks, dim=-1)  # (B, T, step*T)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


class MTPHead(nn.Module):
    """The one-layer MTP head of a Qwen3.5-MoE (or Qwen3-Next) model."""

    def __init__(
        self,
        text_config,
        shared: SharedWeights | None = None,
        attn_implementation: str = "sdpa",
        experts_implementation: str | None = None,
    ):
        super().__init__()
        config = head_layer_config(text_config, attn_implementation, experts_implementation)
        family = family_of(config.model_type)
        layer_class, norm_class, rotary_class = (family.cls(name) for name in ("decoder_layer", "norm", "rotary"))
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)  # columns: [embedding | hidden]
        self.pre_fc_norm_embedding = norm_class(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_class(hidden, eps=eps)
        self.layers = nn.ModuleList([layer_class(config, 0)])
        self.norm = norm_class(hidden, eps=eps)
        self.rotary_emb = rotary_class(config)  # buffers only, not in the checkpoint
        self._cache_kwarg = cache_kwarg(layer_class.forward)
        self.shared = shared

    # -- the small interface: embed, project, backbone, logits -----------------------

    def attach(self, shared: SharedWeights) -> None:
        """Borrow the base's embedding and lm_head (by reference; never copied)."""
        self.shared = shared

    def _shared(self) -> SharedWeights:
        if self.shared is None:
            raise RuntimeError("MTPHead has no base embedding/lm_head; call attach(SharedWeights(...)) first")
        return self.shared

    def project(self, token_ids: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """u = fc(cat[N_e(E(tokens)), N_h(hidden)]): (B, T) ids and (B, T, D) -> (B, T, D)."""
        embeds = self._shared().embed_tokens(token_ids).to(hidden_states.dtype)
        fused = torch.cat(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden_states)], dim=-1
        )
        # fc may hold an fp32 master copy while activations are bf16: compute in the
        # activation dtype with the weight rounded to it, which is what serving runs.
        return F.linear(fused, self.fc.weight.to(fused.dtype))

    def backbone(
        self,
        projected: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        kv: ChainKV,
    ) -> torch.Tensor:
        """The decoder layer and final norm: (B, T, D) -> post-norm (B, T, D)."""
        rotary_positions = position_ids
        if family_of(self.config.model_type).text_mrope:
            # M-RoPE takes (3, B, T) rows (temporal, height, width); for text all three are
            # the token position, which makes it 1-D RoPE. transformers 5.2x expands a
            # (B, T) input itself, 5.17 does not, so pass all three rows.
            rotary_positions = position_ids[None].expand(3, -1, -1)
        position_embeddings = self.rotary_emb(projected, rotary_positions)
        out = self.layers[0](
            projected,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{self._cache_kwarg: kv},
        )
        return self.norm(out)

    def chain_bytes(self, rows: int, length: int, steps: int) -> int:
        """Bytes the chain of `steps` steps over (`rows`, `length`) tokens takes at its peak beside
        the weights, without gradients (evaluation): the attention mask, which grows with the
        square of the length (`MASK_BYTES_PER_SCORE`), and per token the routed experts' rows
        (top_k x (2 x hidden + 3 x moe_intermediate)), `CHAIN_HIDDEN_ACTIVATIONS` hidden-sized
        activations, and each step's output and keys and values, which later steps keep."""
        config = self.config
        size = self._shared().lm_head.weight.element_size()  # the activations' dtype is the base's
        hidden = config.hidden_size
        experts = config.num_experts_per_tok * (2 * hidden + 3 * config.moe_intermediate_size)
        kv = 2 * config.num_key_value_heads * config.head_dim
        token = size * (experts + CHAIN_HIDDEN_ACTIVATIONS * hidden + steps * (hidden + kv))
        return rows * length * token + rows * length * steps * length * MASK_BYTES_PER_SCORE

    @property
    def vocab_size(self) -> int:
        """V, the lm_head's rows."""
        return self._shared().lm_head.weight.shape[0]

    def logits(self, head_hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits through the base's lm_head: (..., D) -> (..., V)."""
        lm_head = self._shared().lm_head
        return lm_head(head_hidden.to(lm_head.weight.dtype))

    # -- the chain -----------------------------------------------------------------

    def forward(
        self,
        step_token_ids: torch.Tensor,
        base_hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        detach_chain: bool = False,
    ) -> torch.Tensor:
        """Run K chained steps for every anchor of every row.

        Args:
            step_token_ids: (K, B, T) tokens the head embeds at each step:
                step_token_ids[0, b, i] = x_{i+1} (teacher forced) and, for k >= 2,
                step_token_ids[k-1, b, i] = t_k, the token drafted at step k-1 (the
                target's greedy token at position i+k when the chain is scored).
            base_hidden: (B, T, D) the base's post-final-norm hidden states H_i.
            position_ids: (B, T) rotary positions of the anchors (default 0..T-1);
                step k runs at position_ids + k - 1.
            segment_ids: (B, T) window index of each position for packed rows
                (default: one window a row).
            detach_chain: stop gradients from flowing from step k into step k-1's output.

        Returns:
            (K, B, T, D) the head's post-norm hidden states g1..gK.
        """
        steps, batch, length = step_token_ids.shape
        device = base_hidden.device
        if position_ids is None:
            position_ids = torch.arange(length, device=device).expand(batch, -1)
        if segment_ids is None:
            segment_ids = torch.zeros(batch, length, dtype=torch.long, device=device)
        kv = ChainKV()
        outputs = []
        previous = base_hidden
        for step in range(1, steps + 1):
            projected = self.project(step_token_ids[step - 1], previous)
            mask = chain_attention_mask(segment_ids, step, projected.dtype)
            out = self.backbone(projected, position_ids + (step - 1), mask, kv)
            outputs.append(out)
            previous = out.detach() if detach_chain else out
        return torch.stack(outputs)


def set_trainable(head: MTPHead, names: tuple[str, ...] = TRAINABLE_DEFAULT) -> int:
    """Freeze everything but the named submodules (dotted prefixes of parameter names).

    Returns the number of trainable parameters. An unknown name is an error, so a typo
    in a config cannot silently train nothing.
    """
    known = {name for name, _ in head.named_parameters()}
    for prefix in names:
        if not any(n == prefix or n.startswith(prefix + ".") for n in known):
            raise ValueError(f"trainable module {prefix!r} matches no head parameter")
    trainable = 0
    for name, param in head.named_parameters():
        wanted = any(name == p or name.startswith(p + ".") for p in names)
        param.requires_grad_(wanted)
        trainable += param.numel() if wanted else 0
    return trainable


def count_parameters(head: MTPHead) -> tuple[int, int]:
    """(total, trainable) parameters of the head; the borrowed embedding and lm_head are not counted."""
    total = sum(p.numel() for p in head.parameters())
    trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
    return total, trainable
