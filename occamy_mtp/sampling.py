"""Sampled serving: the distributions an engine draws from, and how it accepts a draft.

An engine serving a request with temperature T, top_p and top_k draws every token of the
base from the *processed* distribution p: the logits divided by T, the top-k largest
kept (ties at the k-th kept too), then, of what is left, the most probable tokens kept
while the tokens more probable than them hold less than top_p of the mass (the most
probable one always), renormalised. T = 0 is greedy: p is one-hot at the argmax (the
lowest id on a tie). This is vLLM's order and boundary (`apply_top_k_top_p`); SGLang
applies top-k then top-p to the same probabilities.

A draft token d is drawn from the head's distribution q and accepted with probability
min(1, p(d) / q(d)); on rejection the emitted token is drawn from norm(max(p - q, 0)),
and after K accepted drafts a bonus token from p. Two draft rules are served:

* greedy drafts (SGLang's NEXTN with `--speculative-eagle-topk 1`, vLLM's default
  `draft_sample_method="greedy"`): d is the head's argmax and q is one-hot there, so d is
  accepted with probability p(d) and a rejection draws from p without d;
* sampled drafts (vLLM's `draft_sample_method="probabilistic"`): d is drawn from
  q = softmax(head logits / T) (temperature only: the engine leaves top-k and top-p out
  of the draft) and the ratio test uses that q.

Either way the emitted text is distributed as p, and the expected acceptance of one
drafted position is sum_x min(p(x), q(x)) (`acceptance`); docs/reference/CONTRACT.md section 4
sets out the chain's expectation. Random draws here are inverse-CDF draws from given
uniforms (`draw`), so a seeded stream (`uniform_stream`) fixes every token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from occamy_mtp.config import DRAFT_RULES, Serving, any_penalty, sampling_label

GREEDY_DRAFTS, SAMPLED_DRAFTS = DRAFT_RULES


def processed_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The distribution an engine samples the base from: (..., V) logits -> (..., V) float32 probabilities.

    temperature 0: one-hot at the argmax. top_k 0 (or >= V) and top_p 1 leave the
    softmax whole (module docstring for the order and boundaries).
    """
    if temperature == 0:
        return one_hot_argmax(logits)
    scaled = logits.float() / temperature
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]  # (..., 1) the k-th largest logit
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = scaled.sort(dim=-1)
        below = ascending.softmax(dim=-1).cumsum(dim=-1)  # mass of each token and every less probable one
        drop = below <= 1.0 - top_p  # the more probable tokens hold >= top_p without it
        drop[..., -1] = False  # the most probable token always stays
        scaled = scaled.scatter(-1, order, ascending.masked_fill(drop, float("-inf")))
    return scaled.softmax(dim=-1)


History = tuple[torch.Tensor, torch.Tensor]
"""What penalties read of a row: (answer ids (N, L), prompt ids (N, Lp)), long, padded with -1. The
answer is what the request has generated before the position: the text's tokens, which are the
accepted drafts in a verification (docs/reference/CONTRACT.md section 4c)."""


def penalized(logits: torch.Tensor, history: History | None, presence: float = 0.0, frequency: float = 0.0,
              repetition: float = 1.0) -> torch.Tensor:
    """(N, V) logits with the penalties applied, as vLLM applies them before the temperature
    (`apply_penalties`): the repetition penalty on every token of the prompt or the answer (a positive
    logit divided by it, a negative one multiplied), then `frequency` times each token's count in the
    answer and `presence` once for each token the answer holds, subtracted. float32; `logits` itself
    when no penalty is set."""
    if not any_penalty(presence, frequency, repetition):
        return logits
    if history is None:
        raise ValueError("penalties need each row's answer and prompt ids")
    answer, prompt = history
    rows, vocab = logits.shape
    out = torch.cat([logits.float(), logits.new_zeros((rows, 1), dtype=torch.float32)], dim=-1)  # column V: the pads' sink
    answer = answer.masked_fill(answer < 0, vocab)
    counts = torch.zeros_like(out).scatter_add_(-1, answer, torch.ones(answer.shape, dtype=out.dtype, device=out.device))
    counts[:, vocab] = 0
    if repetition != 1.0:
        seen = (counts > 0).scatter_(-1, prompt.masked_fill(prompt < 0, vocab), True)
        seen[:, vocab] = False
        out = torch.where(seen, torch.where(out > 0, out / repetition, out * repetition), out)
    out = out - frequency * counts - presence * (counts > 0).to(out.dtype)
    return out[:, :vocab]


def base_probs(logits: torch.Tensor, serving: Serving, history: History | None = None) -> torch.Tensor:
    """p: the base's distribution as `serving` samples it: its penalties over `history` (`penalized`),
    then `processed_probs`."""
    logits = penalized(logits, history, serving.presence_penalty, serving.frequency_penalty, serving.repetition_penalty)
    return processed_probs(logits, serving.temperature, serving.top_p, serving.top_k)


def answer_histories(input_ids: torch.Tensor, answer_starts: torch.Tensor, rows: torch.Tensor,
                     positions: torch.Tensor) -> History:
    """The penalties' history of N positions of a (B, T) batch of windows: for the token at
    `positions[n]` of row `rows[n]`, the answer before it (ids from the row's answer start) and its
    prompt (the ids before the answer start), each (N, T) padded with -1."""
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)[None]  # (1, T)
    ids = input_ids[rows]  # (N, T)
    starts = answer_starts.to(input_ids.device)[rows][:, None]
    answer = ids.masked_fill(~((columns >= starts) & (columns < positions[:, None])), -1)
    prompt = ids.masked_fill(columns >= starts, -1)
    return answer, prompt


def verified_history_ends(serving: Serving, anchors: torch.Tensor, step: int) -> torch.Tensor:
    """Where the penalties' history ends (exclusive, `answer_histories`' positions) when draft step
    `step` (0-based) of the round at `anchors` is verified, whose drafted token is at anchors + step + 2.

    vLLM penalizes each drafted position over the output before it, drafts 1..step included (given
    the text, the text's tokens): anchors + step + 2. SGLang penalizes every position of the round
    over the output committed before the round, whose last token, at anchors + 1, the round verifies
    from: anchors + 2 at every step (docs/reference/CONTRACT.md section 4c). The two agree at step 0."""
    return anchors + 2 + (0 if serving.round_start_penalties else step)


def head_probs(logits: torch.Tensor, serving: Serving) -> torch.Tensor:
    """q: the head's distribution under `serving`'s draft rule (`draft_probs`)."""
    return draft_probs(logits, serving.temperature, serving.draft)


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> float32 one-hot at the argmax (the lowest id on a tie, as torch.argmax)."""
    out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def draft_probs(logits: torch.Tensor, temperature: float, draft: str) -> torch.Tensor:
    """The head's q under a draft rule (module docstring): one-hot at its argmax for greedy
    drafts (and at temperature 0), softmax(logits / T) for sampled ones."""
    if draft not in DRAFT_RULES:
        raise ValueError(f"draft rule must be one of {DRAFT_RULES}, got {draft!r}")
    if draft == GREEDY_DRAFTS or temperature == 0:
        return one_hot_argmax(logits)
    return (logits.float() / temperature).softmax(dim=-1)


def top_probability(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (...) float32: the softmax's largest probability, the head's confidence in its argmax
    (at temperature 1, as its logits give it: what a verifier reading the draft's own logits sees)."""
    logits = logits.float()
    return (logits.amax(dim=-1) - logits.logsumexp(dim=-1)).exp()


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Expected acceptance of a draft drawn from q and checked against p: sum_x min(p, q) over the last axis."""
    return torch.minimum(p, q).sum(dim=-1)


def relaxed_acceptance(p: torch.Tensor, q: torch.Tensor, top_k: int, ratio: float) -> torch.Tensor:
    """Expected acceptance of a draft drawn from q under the relaxed rule (`Serving.relaxed_top_k`): a draft among
    p's `top_k` most probable tokens with p at least `ratio` of p's top is accepted outright, any other with
    min(1, p / q) as the exact rule. (N, V) -> (N,); at least `acceptance(p, q)`."""
    top = p.amax(dim=-1, keepdim=True)
    kth = p.topk(min(top_k, p.shape[-1]), dim=-1).values[..., -1:]  # ties at the k-th count in, as an engine's >= does
    candidates = (p >= kth) & (p >= ratio * top) & (p > 0)
    return torch.where(candidates, q, torch.minimum(p, q)).sum(dim=-1)


def acceptance_given(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """P(the draft was accepted | the emitted token is `tokens`) = min(p, q)(x) / p(x), per row.

    The emitted token is distributed as p whether the draft was accepted or not, so this
    is the acceptance conditioned on the text. Where p(x) = 0 (a token the processed p
    excludes, which the text should never hold: see `outside_support`) the draft is taken
    as accepted when q(x) > 0, so that a text from a slightly different p still counts.
    """
    px = p.gather(-1, tokens[..., None])[..., 0]
    qx = q.gather(-1, tokens[..., None])[..., 0]
    both = torch.minimum(px, qx)
    return torch.where(px > 0, both / px.clamp_min(torch.finfo(px.dtype).tiny), (qx > 0).to(px.dtype))


def outside_support(p: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Rows whose token has probability 0 under p (bool): text p could not have written."""
    return p.gather(-1, tokens[..., None])[..., 0] <= 0


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejection draws from: norm(max(p - q, 0)); p itself where p <= q everywhere."""
    rest = (p - q).clamp_min(0)
    total = rest.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, rest / total.clamp_min(torch.finfo(rest.dtype).tiny), p)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: (..., V) probabilities (any scale) and (...) uniforms in [0, 1) -> (...) token ids.

    Token x is drawn for u in [c(x-1), c(x)) of the cumulative mass c in id order, so its
    probability is p(x) exactly up to the rounding of the cumulative sum (in float64). A
    token of zero probability is never drawn. No branch on values: a CUDA graph can hold it.
    """
    cumulative = probs.double().cumsum(dim=-1)  # (..., V)
    total = cumulative[..., -1:]
    index = torch.searchsorted(cumulative, uniforms.double()[..., None] * total, right=True)[..., 0]
    index = index.clamp_max(probs.shape[-1] - 1)
    # u * total rounded up to the total itself lands past the last token of nonzero mass:
    # take that token instead.
    positive = probs > 0
    last = probs.shape[-1] - 1 - positive.flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.where(positive.gather(-1, index[..., None])[..., 0], index, last)


def seed_of(seed: int, key: str, bits: int = 63) -> int:
    """A seed of `bits` bits derived from (seed, key): one per context of a sampled text."""
    digest = hashlib.sha256(f"{int(seed)}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**bits - 1)


def uniform_stream(seed: int, key: str, count: int) -> torch.Tensor:
    """`count` float64 uniforms in [0, 1), a pure function of (seed, key): the same on every
    machine and in every batch (torch's CPU generator), so that a sampled continuation keyed
    by its context is the same whichever batch writes it, and after a resume."""
    generator = torch.Generator().manual_seed(seed_of(seed, key))
    return torch.rand(count, dtype=torch.float64, generator=generator)


@dataclass(frozen=True)
class TextSampling:
    """How the base writes a text: greedy (temperature 0), or sampled from its processed
    distribution with a seeded uniform stream per context (`uniform_stream`)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return any_penalty(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)

    def label(self) -> str:
        """greedy, or e.g. t0.7-p0.8-seed0, t1-p0.95-k20-pp1.5-seed0 (the settings that fix the text)."""
        label = sampling_label(self.temperature, self.top_p, self.top_k, self.presence_penalty, self.frequency_penalty,
                               self.repetition_penalty)
        return label if self.greedy else f"{label}-seed{self.seed}"

    def to_dict(self) -> dict | None:
        """The text's part of a store's identity: None for greedy text (as stores before sampling); a
        penalty only when set (as stores before penalties)."""
        if self.greedy:
            return None
        out = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}
        for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, name) != default:
                out[name] = getattr(self, name)
        return out

    def probs(self, logits: torch.Tensor, history: History | None = None) -> torch.Tensor:
        """The processed distribution the text is drawn from, its penalties over `history` first."""
        logits = penalized(logits, history, self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        return processed_probs(logits, self.temperature, self.top_p, self.top_k)

    def request_seed(self, context_key: str) -> int:
        """The seed a serving engine is asked to sample the continuation of this context with (31 bits:
        what every engine's API takes)."""
        return seed_of(self.seed, context_key, bits=31)

    def uniforms(self, context_key: str, count: int) -> torch.Tensor:
        """The uniforms of the continuation of the context whose digest is `context_key`: the
        j-th draws its j-th token."""
        return uniform_stream(self.seed, context_key, count)


def text_sampling(serving: Serving, seed: int) -> TextSampling:
    """How the base writes the text a serving configuration is measured on (its draft rule aside)."""
    if serving.greedy:
        return GREEDY_TEXT
    return TextSampling(serving.temperature, serving.top_p, serving.top_k, seed, serving.presence_penalty,
                        serving.frequency_penalty, serving.repetition_penalty)


GREEDY_TEXT = TextSampling()
