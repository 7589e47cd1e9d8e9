"""Reference decoding in plain PyTorch: greedy with the base alone, and speculative with the MTP head.

docs/reference/DECODER.md sets out the details.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

from occamy_mtp import sampling
from occamy_mtp.config import Serving
from occamy_mtp.evaluation.metrics import acceptance_summary, counts_from_outcomes
from occamy_mtp.compat import cache_kwarg
from occamy_mtp.base.fastdecode import StaticHeadRunner, StaticRunner, kept_tokens, static_decoding, static_head_decoding
from occamy_mtp.base.generate import check_prompts
from occamy_mtp.model.head import ChainKV

# (anchor position a, chain step k = 1..K, drafted token) -> token to propose instead for
# position a+k+1. Tests use it to force rejections at chosen draft positions; None drafts
# with the head unchanged.
DraftOverride = Callable[[int, int, int], int]


# ----------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftRound:
    """One draft-and-verify round of the speculative decoder."""

    anchor: int
    """Position a of the base hidden state H_a the chain started from (step 1 embeds x_{a+1})."""
    drafted: tuple[int, ...]
    """The proposed tokens d_1..d_k (k <= draft_steps: fewer near the end of the budget)."""
    accepted: int
    """Leading drafted tokens the base confirmed (and that lie inside the final text)."""


@dataclass(frozen=True)
class DecodeResult:
    """The output of one prompt; `rounds` and the counts are empty for greedy decoding."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """The base's log-probability of each output token, from the pass that chose it."""
    finish_reason: str
    """"stop" (a stop token was emitted, and is the last output token) or "length"."""
    draft_steps: int = 0
    rounds: tuple[DraftRound, ...] = ()
    proposed: tuple[int, ...] = ()
    """Per step k: rounds in which step k was proposed (steps 1..k-1 accepted), inside the text."""
    accepted: tuple[int, ...] = ()
    """Per step k: rounds in which steps 1..k were all accepted."""
    drafted: int = 0
    """Drafted tokens whose predicted position lies inside the text (the accept-rate denominator)."""
    base_passes: int = 0
    """Base forwards after the prefill: verify passes, plus a plain step when one token was left."""

    @property
    def text_ids(self) -> tuple[int, ...]:
        return self.prompt_ids + self.output_ids

    @property
    def verify_passes(self) -> int:
        return len(self.rounds)

    def summary(self) -> dict:
        """Measured acceptance: acc_k, the contract's mean accept length and accept rate, and the
        measured tokens per verify pass (the bonus token included)."""
        acceptance, length, rate = acceptance_summary(list(self.proposed), list(self.accepted), self.drafted)
        emitted_in_rounds = sum(r.accepted + 1 for r in self.rounds)
        return {
            "draft_steps": self.draft_steps,
            "verify_passes": self.verify_passes,
            "proposed": list(self.proposed),
            "accepted": list(self.accepted),
            "drafted": self.drafted,
            "acceptance": acceptance,
            "mean_accept_length": length,
            "accept_rate": rate,
            "tokens_per_verify_pass": emitted_in_rounds / self.verify_passes if self.rounds else 0.0,
        }


# ----------------------------------------------------------------------------------
# The base, incrementally
# ----------------------------------------------------------------------------------


class BaseRunner:
    """The frozen base over one growing sequence, with its transformers cache.

    `forward(tokens)` runs the next tokens at positions seen..seen+m-1 and returns their
    post-norm hidden states and fp32 logits. `snapshot()`/`restore()` put the cache back
    to an earlier length: attention layers are cropped; Gated DeltaNet conv and
    recurrent states are copied back from the snapshot.
    """

    def __init__(self, base):
        self.base = base
        self.device = next(base.parameters()).device
        self._cache_kwarg = cache_kwarg(base.model.forward)
        self.reset()

    def reset(self) -> None:
        """Empty: the runner of a new text."""
        self.cache = DynamicCache(config=self.base.config)
        self.seen = 0  # tokens the cache holds
        self._last_forward: tuple[int, list[int]] = (0, [])  # where the last forward started, and its tokens

    def forward(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self._hidden(tokens)
        return hidden, self.base.lm_head(hidden).float()  # (m, D), (m, V)

    def prefill(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for a prompt: the hidden states (m, D) and the last token's logits only (V,)."""
        hidden = self._hidden(tokens)
        return hidden, self.base.lm_head(hidden[-1]).float()

    def _hidden(self, tokens: Sequence[int]) -> torch.Tensor:
        self._last_forward = (self.seen, list(tokens))
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # (1, m)
        positions = torch.arange(self.seen, self.seen + len(tokens), device=self.device)[None]
        out = self.base.model(input_ids=ids, position_ids=positions, use_cache=True, **{self._cache_kwarg: self.cache})
        self.seen += len(tokens)
        return out.last_hidden_state[0]  # (m, D)

    def keep(self, snapshot: dict, tokens: int) -> None:
        """Of the last forward, which started at `snapshot`, keep the first `tokens`: the snapshot
        restored and they fed again (the cache holds no state per position to go back to)."""
        kept = kept_tokens(self._last_forward, snapshot, tokens)
        self.restore(snapshot)
        self.forward(kept)

    def snapshot(self) -> dict:
        linear, lengths = {}, {}
        for index, layer in enumerate(self.cache.layers):
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                linear[index] = (
                    {i: t.clone() for i, t in layer.conv_states.items() if t is not None},
                    {i: t.clone() for i, t in layer.recurrent_states.items() if t is not None},
                )
            if isinstance(layer, DynamicLayer):
                lengths[index] = layer.get_seq_length()
        return {"seen": self.seen, "linear": linear, "lengths": lengths}

    def restore(self, snapshot: dict) -> None:
        for index, (conv, recurrent) in snapshot["linear"].items():
            layer = self.cache.layers[index]
            for i, tensor in conv.items():
                layer.conv_states[i].copy_(tensor)  # in place: the layer keeps its buffers
            for i, tensor in recurrent.items():
                layer.recurrent_states[i].copy_(tensor)
        for index, length in snapshot["lengths"].items():
            layer = self.cache.layers[index]
            extra = layer.get_seq_length() - length
            if extra:
                DynamicLayer.crop(layer, -extra)
        self.seen = snapshot["seen"]


def base_runner_for(base, positions: int, span: int = 1):
    """`fastdecode.StaticRunner` (one captured pass for every `span` tokens: a verify pass of
    span - 1 drafts) where `fastdecode.static_decoding` holds, else `BaseRunner`;
    `positions` bounds the text the runner holds.

    One runner serves any number of decodes (`speculative_decode(runners=...)` resets it):
    its CUDA graphs are captured once, by the first decode that runs each span length."""
    return StaticRunner(base, positions, span) if static_decoding(base) else BaseRunner(base)


def head_runner_for(head, positions: int, span: int = 1):
    """`fastdecode.StaticHeadRunner` (extends of up to `span` tokens and greedy chains of up to
    `span` - 1 steps captured) where `fastdecode.static_head_decoding` holds, else `HeadRunner`;
    `positions` bounds the text the runner holds."""
    return StaticHeadRunner(head, positions, span) if static_head_decoding(head) else HeadRunner(head)


@dataclass(frozen=True)
class Runners:
    """The base's and the head's runners that many decodes share (`speculative_decode(runners=...)`
    resets both), so that their CUDA graphs are captured once; `positions` and `span` as
    `base_runner_for` and `head_runner_for` take them."""

    base: BaseRunner | StaticRunner
    head: HeadRunner | StaticHeadRunner
    positions: int
    span: int

    def with_head(self, head) -> Runners:
        """These runners for decoding with `head`: the same base runner; this head runner where it runs `head`."""
        if self.head.head is head:
            return self
        return Runners(self.base, head_runner_for(head, self.positions, self.span), self.positions, self.span)


def decodes_runners(base, head, prompt_lengths: Collection[int], max_new_tokens: int, draft_steps: int) -> Runners:
    """The runners for decoding every prompt of `prompt_lengths` with `head` and up to `draft_steps` drafts."""
    positions, span = max(prompt_lengths) + max_new_tokens + draft_steps, draft_steps + 1
    return Runners(base_runner_for(base, positions, span), head_runner_for(head, positions, span), positions, span)


# ----------------------------------------------------------------------------------
# The head, incrementally
# ----------------------------------------------------------------------------------


class HeadKV(ChainKV):
    """The head's attention cache while decoding: committed step-1 keys/values of every
    accepted position, followed by the current chain's (dropped by `rollback`).

    `ChainKV.update` is what transformers' attention calls (keys/values are
    (1, kv_heads, S, head_dim)); this adds the commit point.
    """

    def __init__(self) -> None:
        super().__init__()
        self.committed = 0

    def commit(self) -> None:
        self.committed = self.get_seq_length()

    def rollback(self) -> None:
        if self.keys is not None:
            self.keys = self.keys[..., : self.committed, :]
            self.values = self.values[..., : self.committed, :]


def _prefix_mask(queries: int, cached: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask (1, 1, queries, cached + queries): query q sees every cached key and
    the new keys up to itself (causal over "accepted prefix + these positions")."""
    keys = torch.arange(cached + queries, device=device)
    allowed = keys[None, :] <= (cached + torch.arange(queries, device=device))[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


class HeadRunner:
    """The MTP head over one growing sequence: step-1 extension and K-step chains."""

    def __init__(self, head):
        self.head = head
        self.reset()

    def reset(self) -> None:
        """Empty: the runner of a new text."""
        self.kv = HeadKV()
        self.anchors = 0  # step-1 entries held (anchors 0..anchors-1)

    def extend(self, next_tokens: Sequence[int], hidden: torch.Tensor) -> torch.Tensor:
        """Step 1 at anchors anchors..anchors+m-1: embeds x_{i+1} (`next_tokens`), sees H_i
        (`hidden`, (m, D)); returns the post-norm outputs (m, D) and commits their keys/values."""
        m = len(next_tokens)
        ids = torch.tensor([list(next_tokens)], dtype=torch.long, device=hidden.device)
        projected = self.head.project(ids, hidden[None])  # (1, m, D)
        positions = torch.arange(self.anchors, self.anchors + m, device=hidden.device)[None]
        mask = _prefix_mask(m, self.kv.get_seq_length(), projected.dtype, hidden.device)
        out = self.head.backbone(projected, positions, mask, self.kv)[0]  # (m, D)
        self.kv.commit()
        self.anchors += m
        return out

    def chain(
        self, first: torch.Tensor, steps: int, override: Callable[[int, int], int] | None = None,
        pick: Callable[[torch.Tensor], int] | None = None,
    ) -> tuple[list[int], torch.Tensor]:
        """Draft `steps` tokens from step 1's output `first` (D,) at the last anchor.

        Step k >= 2 embeds the token drafted at step k-1, feeds back step k-1's post-norm
        output and sits at rotary position anchor + k - 1. `pick` chooses each draft from
        the step's logits (V,) (default: the argmax). The chain's keys/values are rolled
        back afterwards. Returns the drafted tokens and the post-norm outputs g1..gk (k, D).
        """
        anchor = self.anchors - 1
        drafted: list[int] = []
        outputs = [first]
        for step in range(1, steps + 1):
            if step > 1:
                ids = torch.tensor([[drafted[-1]]], dtype=torch.long, device=first.device)
                projected = self.head.project(ids, outputs[-1][None, None])
                position = torch.tensor([[anchor + step - 1]], device=first.device)
                mask = _prefix_mask(1, self.kv.get_seq_length(), projected.dtype, first.device)
                outputs.append(self.head.backbone(projected, position, mask, self.kv)[0, 0])
            logits = self.head.logits(outputs[-1])
            token = int(logits.argmax(-1)) if pick is None else pick(logits)
            drafted.append(override(step, token) if override is not None else token)
        self.kv.rollback()
        return drafted, torch.stack(outputs)


# ----------------------------------------------------------------------------------
# Decoders
# ----------------------------------------------------------------------------------


class _Draws:
    """The sampled decoder's random draws, all from one seeded generator, in the order they are made."""

    def __init__(self, serving: Serving, seed: int):
        if serving.penalized:
            raise ValueError(f"the reference decoder samples without penalties; {serving.label()} sets some "
                             "(its figures come from the exact expectation, `served.served_acceptance`)")
        self.serving = serving
        self.generator = torch.Generator().manual_seed(seed)

    def uniform(self) -> float:
        return float(torch.rand((), dtype=torch.float64, generator=self.generator))

    def token(self, probs: torch.Tensor) -> int:
        """One draw from `probs` (V,) (`sampling.draw`)."""
        return int(sampling.draw(probs, torch.tensor(self.uniform(), dtype=torch.float64, device=probs.device)))

    def base_token(self, logits: torch.Tensor) -> int:
        """The base's next token from its logits (V,), as the engine samples it (a bonus or plain token)."""
        return self.token(sampling.base_probs(logits, self.serving))


@torch.no_grad()
def greedy_decode(base, prompt_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Collection[int] = (),
                  serving: Serving | None = None, seed: int = 0) -> DecodeResult:
    """Plain decoding with the base: prefill, then one token per forward; the argmax, or under a
    sampled `serving` a draw from the processed distribution (a generator seeded with `seed`)."""
    check_prompts([prompt_ids], max_new_tokens)
    draws = None if serving is None or serving.greedy else _Draws(serving, seed)
    runner = base_runner_for(base, len(prompt_ids) + max_new_tokens)
    _, scores = runner.prefill(prompt_ids)
    output, logprobs = [], []
    while True:
        token = int(scores.argmax()) if draws is None else draws.base_token(scores)
        output.append(token)
        logprobs.append(float(F.log_softmax(scores, dim=-1)[token]))
        if token in stop_token_ids or len(output) == max_new_tokens:
            reason = "stop" if token in stop_token_ids else "length"
            return DecodeResult(tuple(prompt_ids), tuple(output), tuple(logprobs), reason, base_passes=len(output) - 1)
        scores = runner.forward([token])[1][-1]


@dataclass
class _Round:
    anchor: int
    drafted: list[int]
    accepted: int


@torch.no_grad()
def speculative_decode(
    base,
    head,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    draft_steps: int = 3,
    stop_token_ids: Collection[int] = (),
    draft_override: DraftOverride | None = None,
    serving: Serving | None = None,
    seed: int = 0,
    runners: Runners | None = None,
) -> DecodeResult:
    """The base's decoding under `serving` (None or temperature 0: greedy), accelerated by drafting
    `draft_steps` tokens with the head.

    Greedy: the output is token-identical to `greedy_decode` by construction: every emitted
    token is the base's argmax given the accepted text. "Identical" holds up to floating
    point: a multi-token verify pass sums in another order than one-token steps (chunked
    vs recurrent delta rule), so a near-tie between the top two logits could resolve
    differently; the logprobs differ by rounding (~1e-6 in fp32). See the module
    docstring for the round, the cache rollback and how acceptance is counted.

    Sampled (temperature > 0): the engines' rejection sampling (`occamy_mtp.sampling`),
    every draw from a generator seeded with `seed`: the draft is the head's argmax or a
    draw from its softmax (`serving.draft`), accepted with probability min(1, p(d) / q(d))
    against the base's processed p; the first rejection emits a draw from
    norm(max(p - q, 0)) and ends the round, and after every draft accepted a bonus token is
    drawn from p. The output is then a sample of the base's processed distribution.
    `draft_override` replaces drafted tokens (tests force rejections with it). `runners`
    (`decodes_runners`, for this `head`) are reset and used instead of runners of this
    decode's own, so that many decodes capture their CUDA graphs once.
    """
    check_prompts([prompt_ids], max_new_tokens)
    if draft_steps < 1:
        raise ValueError(f"draft_steps must be >= 1, got {draft_steps}")
    draws = None if serving is None or serving.greedy else _Draws(serving, seed)
    prompt = list(prompt_ids)
    if runners is None:
        runners = decodes_runners(base, head, [len(prompt)], max_new_tokens, draft_steps)
    else:
        runners = runners.with_head(head)
        runners.base.reset()
        runners.head.reset()
    base_runner, head_runner = runners.base, runners.head

    # Prefill: the base over the prompt gives x_P; the head's step 1 over anchors 0..P-1.
    hidden, last = base_runner.prefill(prompt)
    first_token = int(last.argmax()) if draws is None else draws.base_token(last)
    output = [first_token]
    logprobs = [float(F.log_softmax(last, dim=-1)[first_token])]
    rounds: list[_Round] = []
    plain_steps = 0
    finish = "stop" if first_token in stop_token_ids else None
    if finish is None and len(output) < max_new_tokens:
        step1 = head_runner.extend(prompt[1:] + [first_token], hidden)[-1]

    while finish is None and len(output) < max_new_tokens:
        text_length = len(prompt) + len(output)  # n; x_{n-1} is output[-1]
        steps = min(draft_steps, max_new_tokens - len(output) - 1)
        if steps == 0:  # one token left: a plain base step, no draft
            plain_steps += 1
            hidden, logits = base_runner.forward([output[-1]])
            token = int(logits[-1].argmax()) if draws is None else draws.base_token(logits[-1])
            output.append(token)
            logprobs.append(float(F.log_softmax(logits[-1], dim=-1)[token]))
            finish = "stop" if token in stop_token_ids else None
            break

        anchor = text_length - 2
        override = None if draft_override is None else (lambda step, token: draft_override(anchor, step, token))
        drafts_from: list[torch.Tensor] = []  # q of each step, sampled serving only
        pick = None if draws is None else (lambda step_logits: _draft(step_logits, draws, drafts_from))
        drafted, _ = head_runner.chain(step1, steps, override, pick)

        # Verify all drafts in one base pass; keep a snapshot for the rollback.
        snapshot = base_runner.snapshot()
        hidden, logits = base_runner.forward([output[-1]] + drafted)  # (1+k, D), (1+k, V)
        if draws is None:
            greedy = logits.argmax(-1).tolist()  # y_0..y_k
            accepted = 0
            while accepted < steps and drafted[accepted] == greedy[accepted]:
                accepted += 1
            emitted = drafted[:accepted] + [greedy[accepted]]
        else:
            accepted, emitted = _rejection_sample(logits, drafted, drafts_from, draws)
        for j, token in enumerate(emitted):  # a stop token ends the text there
            if token in stop_token_ids:
                emitted, accepted, finish = emitted[: j + 1], min(accepted, j + 1), "stop"
                break
        log_probs = F.log_softmax(logits[: len(emitted)], dim=-1)
        output += emitted
        logprobs += [float(log_probs[j, t]) for j, t in enumerate(emitted)]
        rounds.append(_Round(anchor=anchor, drafted=drafted, accepted=accepted))

        if finish is not None or len(output) == max_new_tokens:
            break
        if accepted < steps:  # roll back the rejected drafts: keep the verify pass's [x_{n-1}, d_1..d_j]
            base_runner.keep(snapshot, accepted + 1)
        # Step 1 at anchors n-1..n-1+j on the verified hidden states (the engine's draft extend).
        step1 = head_runner.extend(emitted, hidden[: len(emitted)])[-1]

    finish = finish or "length"
    return _speculative_result(prompt, output, logprobs, finish, draft_steps, rounds, plain_steps)


def _draft(logits: torch.Tensor, draws: _Draws, drafts_from: list[torch.Tensor]) -> int:
    """A draft under sampled serving: q from the head's logits (V,) by the draft rule, kept for
    the ratio test; the argmax for greedy drafts, a draw from q for sampled ones."""
    q = sampling.head_probs(logits, draws.serving)
    drafts_from.append(q)
    return int(q.argmax()) if draws.serving.draft == sampling.GREEDY_DRAFTS else draws.token(q)


def _rejection_sample(logits: torch.Tensor, drafted: list[int], drafts_from: list[torch.Tensor],
                      draws: _Draws) -> tuple[int, list[int]]:
    """The engines' verification of one round (`speculative_decode`): (accepted drafts, emitted tokens).

    Draft j is accepted when a uniform u <= p_j(d_j) / q_j(d_j) (vLLM's test), q_j being the
    distribution the draft was drawn from (one-hot for greedy drafts, or a draft forced by
    `draft_override`, whose q is then taken as one-hot at it).
    """
    p = sampling.base_probs(logits, draws.serving)  # (1+k, V): p_j predicts the token after drafts 1..j
    for j, token in enumerate(drafted):
        q = drafts_from[j]
        if q[token] == 0:  # a forced draft: one-hot there
            q = torch.zeros_like(q).index_fill_(0, torch.tensor(token, device=q.device), 1.0)
        if draws.uniform() <= float(p[j, token] / q[token]):
            continue
        return j, drafted[:j] + [draws.token(sampling.residual(p[j], q))]
    return len(drafted), drafted + [draws.token(p[len(drafted)])]


def _speculative_result(prompt, output, logprobs, finish, draft_steps, rounds: list[_Round], plain_steps: int) -> DecodeResult:
    """Count proposals and acceptances only at predicted positions inside the final text."""
    text_length = len(prompt) + len(output)
    # Step k at anchor a predicts position a+k+1, which must be < text_length.
    in_text = [min(len(r.drafted), text_length - 2 - r.anchor) for r in rounds]
    hits = [min(r.accepted, steps) for r, steps in zip(rounds, in_text)]
    proposed, accepted, drafted = counts_from_outcomes(in_text, hits, draft_steps)
    return DecodeResult(
        prompt_ids=tuple(prompt),
        output_ids=tuple(output),
        logprobs=tuple(logprobs),
        finish_reason=finish,
        draft_steps=draft_steps,
        rounds=tuple(DraftRound(r.anchor, tuple(r.drafted), h) for r, h in zip(rounds, hits)),
        proposed=tuple(proposed),
        accepted=tuple(accepted),
        drafted=drafted,
        base_passes=len(rounds) + plain_steps,
    )
