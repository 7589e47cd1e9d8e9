"""The MTP head against a plain reference of docs/reference/CONTRACT.md section 2, its trainable selection,
its borrowed embedding/lm_head, its parameter names and its real-size accounting.

The reference below uses torch ops only (no transformers module) and computes the
engine's chain the slow, obvious way: one anchor at a time, each anchor's key list
built explicitly from the step-1 keys at positions <= i of its own window plus its own
chain entries.
"""

from __future__ import annotations

import pytest

from occamy_mtp.testing.checkpoints import QWEN3_5_35B_A3B, QWEN3_NEXT_80B_A3B
import torch
import torch.nn.functional as F

from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.model.head import MTPHead, SharedWeights, count_parameters, set_trainable
from occamy_mtp.testing.checkpoints import random_models, tiny_text_config
from occamy_mtp.testing.numerics import assert_close, rounding_bound

pytestmark = pytest.mark.usefixtures("single_thread")

QWEN3_5, QWEN3_NEXT = "qwen3_5_moe_text", "qwen3_next"
STEPS = 3  # what `--speculative-num-steps 3` runs
# Rounding bounds (occamy_mtp.testing.numerics), float32 throughout. One chained step runs
# about 15 reductions in series (fc, input norm, q_proj, q_norm, attention scores, softmax,
# value sum, o_proj, post-attention norm, router, router softmax, expert up and down, shared
# expert gate, final norm), the widest over fc's 2 x hidden inputs; the backward pass runs
# them again and then sums each weight's gradient over the positions.
FORWARD_REDUCTIONS = 15 * STEPS
BACKWARD_REDUCTIONS = 2 * FORWARD_REDUCTIONS + 1


def reduction_width(text_config) -> int:
    """The most terms any one reduction of the head sums (fc's input, or o_proj's, or the experts')."""
    return max(2 * text_config.hidden_size, text_config.num_attention_heads * text_config.head_dim,
               text_config.moe_intermediate_size, text_config.shared_expert_intermediate_size)


def assert_forward_close(got, want, text_config, what: str) -> None:
    bound = rounding_bound(want, torch.float32, reductions=FORWARD_REDUCTIONS, width=reduction_width(text_config))
    assert_close(got, want, bound, what)
MAX_LENGTH = 8  # longest window a test asks for


# ----------------------------------------------------------------------------------
# The reference: docs/reference/CONTRACT.md section 2 in plain torch ops
# ----------------------------------------------------------------------------------


def ref_rms_norm(x, weight, eps):
    """Gemma-style RMSNorm with a zero-centred weight."""
    out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return out.to(x.dtype)


def ref_rope(x, position, rotary_dims, theta):
    """Rotate the first `rotary_dims` dims of x (heads, head_dim) at integer `position`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dims, 2, dtype=torch.float32) / rotary_dims))
    angles = float(position) * inv_freq
    cos = torch.cat([angles, angles]).cos()
    sin = torch.cat([angles, angles]).sin()
    rot, rest = x[..., :rotary_dims], x[..., rotary_dims:]
    half = rotary_dims // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated_half * sin, rest], dim=-1)


def ref_moe(x, p, cfg):
    """Softmax router (fp32), top-k renormalised, SwiGLU experts, gated shared expert. x: (D,)."""
    prefix = "layers.0.mlp."
    probs = torch.softmax((p[prefix + "gate.weight"] @ x).float(), dim=-1)
    top_probs, top_experts = probs.topk(cfg.num_experts_per_tok)
    top_probs = top_probs / top_probs.sum()
    intermediate = cfg.moe_intermediate_size
    out = torch.zeros_like(x)
    for weight, expert in zip(top_probs, top_experts.tolist()):
        gate_up = p[prefix + "experts.gate_up_proj"][expert]  # (2I, D), gate rows first
        gate, up = gate_up[:intermediate] @ x, gate_up[intermediate:] @ x
        out = out + weight * (p[prefix + "experts.down_proj"][expert] @ (F.silu(gate) * up))
    shared = p[prefix + "shared_expert.down_proj.weight"] @ (
        F.silu(p[prefix + "shared_expert.gate_proj.weight"] @ x) * (p[prefix + "shared_expert.up_proj.weight"] @ x)
    )
    return out + torch.sigmoid(p[prefix + "shared_expert_gate.weight"] @ x) * shared


def reference_chain(p, embed_weight, cfg, step_tokens, base_hidden, position_ids, segment_ids):
    """docs/reference/CONTRACT.md section 2 for every anchor: (K, B, T) tokens, (B, T, D) H -> (K, B, T, D).

    `p` maps the head's parameter names to tensors. Padding positions are scored like
    any other and compared too: they come after every real position of their row.
    """
    eps = cfg.rms_norm_eps
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rotary_dims = int(head_dim * cfg.rope_parameters["partial_rotary_factor"])
    theta = cfg.rope_parameters["rope_theta"]
    attn = "layers.0.self_attn."
    steps, batch, length = step_tokens.shape
    rows = []
    for b in range(batch):
        keys, values = {}, {}  # (step, position) -> (kv_heads, head_dim)
        previous = [base_hidden[b, i] for i in range(length)]
        row_steps = []
        for step in range(1, steps + 1):
            outs = []
            # Projections of every anchor at this step (they depend on nothing but the anchor).
            queries, gates, residuals = {}, {}, {}
            for i in range(length):
                embedded = embed_weight[step_tokens[step - 1, b, i]]
                fused = torch.cat([
                    ref_rms_norm(embedded, p["pre_fc_norm_embedding.weight"], eps),
                    ref_rms_norm(previous[i], p["pre_fc_norm_hidden.weight"], eps),
                ])  # embedding half first
                u = p["fc.weight"] @ fused
                h = ref_rms_norm(u, p["layers.0.input_layernorm.weight"], eps)
                query_and_gate = (p[attn + "q_proj.weight"] @ h).view(heads, 2 * head_dim)
                query, gate = query_and_gate[:, :head_dim], query_and_gate[:, head_dim:]
                query = ref_rms_norm(query, p[attn + "q_norm.weight"], eps)
                key = ref_rms_norm((p[attn + "k_proj.weight"] @ h).view(kv_heads, head_dim), p[attn + "k_norm.weight"], eps)
                value = (p[attn + "v_proj.weight"] @ h).view(kv_heads, head_dim)
                position = int(position_ids[b, i]) + step - 1
                queries[i] = ref_rope(query, position, rotary_dims, theta)
                keys[step, i] = ref_rope(key, position, rotary_dims, theta)
                values[step, i] = value
                gates[i], residuals[i] = gate.reshape(-1), u
            for i in range(length):
                # Teacher-forced prefix of the anchor's own window, then its own chain.
                visible = [(1, j) for j in range(i + 1) if segment_ids[b, j] == segment_ids[b, i]]
                visible += [(s, i) for s in range(2, step + 1)]
                key_list = torch.stack([keys[v] for v in visible])  # (n, kv_heads, head_dim)
                value_list = torch.stack([values[v] for v in visible])
                head_outputs = []
                for hq in range(heads):
                    group = hq // (heads // kv_heads)
                    scores = key_list[:, group] @ queries[i][hq] * head_dim**-0.5
                    head_outputs.append(torch.softmax(scores, dim=0) @ value_list[:, group])
                attended = torch.cat(head_outputs) * torch.sigmoid(gates[i])
                hidden = residuals[i] + p[attn + "o_proj.weight"] @ attended
                hidden = hidden + ref_moe(ref_rms_norm(hidden, p["layers.0.post_attention_layernorm.weight"], eps), p, cfg)
                outs.append(ref_rms_norm(hidden, p["norm.weight"], eps))
            row_steps.append(torch.stack(outs))
            previous = outs  # the head's own post-norm output feeds the next step
        rows.append(torch.stack(row_steps))  # (K, T, D)
    return torch.stack(rows, dim=1)


# ----------------------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------------------


class Float32Models:
    """A tiny base and head in float32, and a way to build the head with any attention."""

    def __init__(self, family: str, seed: int = 1):
        self.text_config = tiny_text_config(family)
        base, head = random_models(self.text_config, seed)
        self.base = base.float().eval().requires_grad_(False)
        self.shared = SharedWeights(self.base.model.embed_tokens, self.base.lm_head)
        self.state = {k: v.float() for k, v in head.state_dict().items()}
        # One base forward serves every test: the base is causal, so the hidden states
        # of a prefix are the prefix of the hidden states.
        generator = torch.Generator().manual_seed(seed + 1)
        self.windows = torch.randint(self.text_config.vocab_size, (2, MAX_LENGTH + 1), generator=generator)
        with torch.no_grad():
            self.hidden = self.base.model(input_ids=self.windows[:, :-1]).last_hidden_state  # (2, MAX_LENGTH, D)

    def head(self, attn_implementation: str = "sdpa", experts_implementation: str | None = None) -> MTPHead:
        head = MTPHead(self.text_config, self.shared, attn_implementation, experts_implementation)
        head.load_state_dict(self.state, strict=True)
        return head.eval()

    def inputs(self, rows: list[int], length: int, seed: int = 2):
        """Step tokens (K, B, T) and the base's own post-norm hidden states (B, T, D) of `rows`."""
        generator = torch.Generator().manual_seed(seed)
        window = self.windows[rows, : length + 1]
        drafted = torch.randint(self.text_config.vocab_size, (STEPS - 1, len(rows), length), generator=generator)
        step_tokens = torch.cat([window[None, :, 1:], drafted])  # step 1 embeds x_{i+1}
        return step_tokens, self.hidden[rows, :length]


@pytest.fixture(scope="module")
def qwen3_5_fp32():
    return Float32Models(QWEN3_5)


@pytest.fixture(scope="module")
def qwen3_next_fp32():
    return Float32Models(QWEN3_NEXT)


def default_positions(batch, length):
    return torch.arange(length).expand(batch, -1), torch.zeros(batch, length, dtype=torch.long)


# ----------------------------------------------------------------------------------
# The oracle tests
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attn_implementation, experts_implementation",
    [("eager", "eager"), ("sdpa", None)],  # None: the default (grouped_mm where torch has it)
)
def test_chain_matches_reference(qwen3_5_fp32, attn_implementation, experts_implementation):
    models = qwen3_5_fp32
    head = models.head(attn_implementation, experts_implementation)
    step_tokens, hidden = models.inputs([0, 1], length=7)
    positions, segments = default_positions(2, 7)
    positions = positions + torch.tensor([[0], [5]])  # the second row starts mid-document
    with torch.no_grad():
        got = head(step_tokens, hidden, position_ids=positions)
        want = reference_chain(models.state, models.shared.embed_tokens.weight, models.text_config,
                               step_tokens, hidden, positions, segments)
    assert got.shape == (STEPS, 2, 7, models.text_config.hidden_size)
    for step in range(STEPS):
        assert_forward_close(got[step], want[step], models.text_config, f"step {step + 1}")
    # Step 1 alone is the teacher-forced head: running one step gives the same g1.
    with torch.no_grad():
        step1 = head(step_tokens[:1], hidden, position_ids=positions)
    assert_forward_close(step1[0], want[0], models.text_config, "step 1 run alone")


def test_chain_matches_reference_qwen3_next(qwen3_next_fp32):
    models = qwen3_next_fp32
    assert models.text_config.norm_topk_prob  # the reference renormalises the top-k
    head = models.head("sdpa")
    step_tokens, hidden = models.inputs([1], length=6)
    positions, segments = default_positions(1, 6)
    with torch.no_grad():
        got = head(step_tokens, hidden)
        want = reference_chain(models.state, models.shared.embed_tokens.weight, models.text_config,
                               step_tokens, hidden, positions, segments)
    assert_forward_close(got, want, models.text_config, "the chain")


def test_packed_rows_equal_separate_rows(qwen3_5_fp32):
    """Two windows packed in one right-padded row give what each gives alone."""
    models = qwen3_5_fp32
    head = models.head("sdpa")
    tokens_a, hidden_a = models.inputs([0], length=5, seed=3)
    tokens_b, hidden_b = models.inputs([1], length=4, seed=4)
    pad = 2
    pad_tokens = torch.zeros(STEPS, 1, pad, dtype=torch.long)
    pad_hidden = torch.zeros(1, pad, hidden_a.shape[-1])
    packed_tokens = torch.cat([tokens_a, tokens_b, pad_tokens], dim=-1)
    packed_hidden = torch.cat([hidden_a, hidden_b, pad_hidden], dim=1)
    positions = torch.cat([torch.arange(5), torch.arange(4), torch.arange(pad)])[None]
    segments = torch.tensor([[0] * 5 + [1] * 4 + [2] * pad])
    with torch.no_grad():
        packed = head(packed_tokens, packed_hidden, position_ids=positions, segment_ids=segments)
        alone_a = head(tokens_a, hidden_a)
        alone_b = head(tokens_b, hidden_b)
        want = reference_chain(models.state, models.shared.embed_tokens.weight, models.text_config,
                               packed_tokens, packed_hidden, positions, segments)
    assert_forward_close(packed[:, :, :5], alone_a, models.text_config, "first packed window")
    assert_forward_close(packed[:, :, 5:9], alone_b, models.text_config, "second packed window")
    assert_forward_close(packed[:, :, :9], want[:, :, :9], models.text_config, "packed row")
    # Without segment ids the second window would see the first: the packing is what separates them.
    with torch.no_grad():
        unsegmented = head(packed_tokens, packed_hidden, position_ids=positions)
    bound = rounding_bound(alone_b, torch.float32, reductions=FORWARD_REDUCTIONS, width=reduction_width(models.text_config))
    assert (unsegmented[:, :, 5:9] - alone_b).abs().max() > bound


def test_gradients_match_reference(qwen3_5_fp32):
    """d(loss)/d(fc, pre-fc norms) through all three chained steps, module vs reference."""
    models = qwen3_5_fp32
    head = models.head("sdpa")
    set_trainable(head)
    step_tokens, hidden = models.inputs([0, 1], length=5)
    positions, segments = default_positions(2, 5)
    loss_weights = torch.randn(STEPS, 2, 5, models.text_config.hidden_size, generator=torch.Generator().manual_seed(5))
    trainable = [head.fc.weight, head.pre_fc_norm_embedding.weight, head.pre_fc_norm_hidden.weight]

    got = torch.autograd.grad((head(step_tokens, hidden) * loss_weights).sum(), trainable)
    params = dict(head.named_parameters())
    want_out = reference_chain(params, models.shared.embed_tokens.weight, models.text_config,
                               step_tokens, hidden, positions, segments)
    want = torch.autograd.grad((want_out * loss_weights).sum(), trainable)
    for name, g, w in zip(("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden"), got, want):
        assert w.abs().max() > 0, name
        bound = rounding_bound(w, torch.float32, reductions=BACKWARD_REDUCTIONS, width=reduction_width(models.text_config))
        assert_close(g, w, bound, f"d loss / d {name}")


# ----------------------------------------------------------------------------------
# Trainable selection, borrowed weights, names
# ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    """The frozen base and the donor head as the loaders give them (bf16)."""
    written = tiny_checkpoint(QWEN3_5, ckpt_io.PER_EXPERT, multimodal=True)
    base = ckpt_io.load_base(written.path)
    shared = SharedWeights(base.model.embed_tokens, base.lm_head)
    head, _ = ckpt_io.load_head(written.path, base.config, shared)
    return base, head


TRAINABLE = {"fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight"}


def test_only_fc_and_pre_fc_norms_train(loaded):
    base, head = loaded
    hidden_size = base.config.hidden_size
    assert set_trainable(head) == 2 * hidden_size * hidden_size + 2 * hidden_size
    assert {n for n, p in head.named_parameters() if p.requires_grad} == TRAINABLE
    assert not any(p.requires_grad for p in base.parameters())  # load_base freezes the base

    ids = torch.randint(base.config.vocab_size, (1, 9))
    with torch.no_grad():
        hidden = base.model(input_ids=ids[:, :-1]).last_hidden_state
    step_tokens = torch.stack([ids[:, 1:]] * 2)
    for p in head.parameters():
        p.grad = None
    head.logits(head(step_tokens, hidden)).float().logsumexp(-1).sum().backward()
    with_grad = {n for n, p in head.named_parameters() if p.grad is not None}
    assert with_grad == TRAINABLE
    assert all(p.grad is None for p in base.parameters())
    for p in head.parameters():
        p.grad = None


def test_set_trainable_rejects_unknown_names(loaded):
    _, head = loaded
    with pytest.raises(ValueError, match="pre_fc_norm_hiden"):
        set_trainable(head, ("fc", "pre_fc_norm_hiden"))


def test_head_borrows_embedding_and_lm_head(loaded):
    base, head = loaded
    names = [n for n, _ in head.named_parameters()] + list(head.state_dict())
    assert not [n for n in names if "embed_tokens" in n or "lm_head" in n]
    assert head.shared.embed_tokens.weight is base.model.embed_tokens.weight
    assert head.shared.lm_head.weight is base.lm_head.weight
    borrowed = {base.model.embed_tokens.weight.data_ptr(), base.lm_head.weight.data_ptr()}
    assert not borrowed & {p.data_ptr() for p in head.parameters()}
    g = torch.randn(3, base.config.hidden_size).to(torch.bfloat16)
    torch.testing.assert_close(head.logits(g), g @ base.lm_head.weight.T)

    orphan = MTPHead(base.config)
    with pytest.raises(RuntimeError, match="attach"):
        orphan(torch.zeros(1, 1, 2, dtype=torch.long), torch.zeros(1, 2, base.config.hidden_size))


def test_parameter_names_are_the_checkpoint_names():
    """One-to-one with docs/reference/CONTRACT.md section 3's `mtp.*` names (fused expert layout), nothing else."""
    spec_names = {
        "fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
        "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
        "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
        "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight",
        "layers.0.mlp.gate.weight",
        "layers.0.mlp.shared_expert.gate_proj.weight", "layers.0.mlp.shared_expert.up_proj.weight",
        "layers.0.mlp.shared_expert.down_proj.weight", "layers.0.mlp.shared_expert_gate.weight",
        "layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj",
    }
    for family in (QWEN3_5, QWEN3_NEXT):
        with torch.device("meta"):
            head = MTPHead(tiny_text_config(family))
        assert set(head.state_dict()) == spec_names, family
        assert {n for n, _ in head.named_parameters()} == spec_names, family


# ----------------------------------------------------------------------------------
# Real-size accounting (meta device: no memory)
# ----------------------------------------------------------------------------------



def real_size_head(fields) -> MTPHead:
    with torch.device("meta"):
        head = MTPHead(ckpt_io.text_config_from_dict(dict(fields)))
    assert all(p.is_meta for p in head.parameters())
    set_trainable(head)
    return head


def part_sizes(head: MTPHead) -> dict[str, int]:
    def size(prefix):
        return sum(p.numel() for n, p in head.named_parameters() if n.startswith(prefix))

    layer = "layers.0."
    return {
        "fc": size("fc."),
        "pre_fc_norms": size("pre_fc_norm_embedding.") + size("pre_fc_norm_hidden."),
        "attention": size(layer + "self_attn."),
        "router": size(layer + "mlp.gate."),
        "experts": size(layer + "mlp.experts."),
        "shared_expert": size(layer + "mlp.shared_expert."),
        "shared_expert_gate": size(layer + "mlp.shared_expert_gate."),
        "layer_norms": size(layer + "input_layernorm.") + size(layer + "post_attention_layernorm."),
        "layer": size(layer),
        "norm": size("norm."),
    }


def test_real_size_accounting_qwen3_5():
    """docs/reference/CONTRACT.md section 1's table, part by part."""
    head = real_size_head(QWEN3_5_35B_A3B)
    assert count_parameters(head) == (844_640_768, 8_392_704)
    assert part_sizes(head) == {
        "fc": 8_388_608, "pre_fc_norms": 4_096, "attention": 27_263_488, "router": 524_288,
        "experts": 805_306_368, "shared_expert": 3_145_728, "shared_expert_gate": 2_048,
        "layer_norms": 4_096, "layer": 836_246_016, "norm": 2_048,
    }


def test_real_size_accounting_qwen3_next():
    """Qwen3-Next-80B-A3B: only the routed experts and router double (512 experts)."""
    head = real_size_head(QWEN3_NEXT_80B_A3B)
    # router 512 x 2048; experts 512 x 3 x 512 x 2048; everything else as Qwen3.5.
    assert part_sizes(head) == {
        "fc": 8_388_608, "pre_fc_norms": 4_096, "attention": 27_263_488, "router": 1_048_576,
        "experts": 1_610_612_736, "shared_expert": 3_145_728, "shared_expert_gate": 2_048,
        "layer_norms": 4_096, "layer": 1_642_076_672, "norm": 2_048,
    }
    assert count_parameters(head) == (1_650_471_424, 8_392_704)
