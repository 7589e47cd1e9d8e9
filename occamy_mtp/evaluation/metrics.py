"""Acceptance arithmetic (docs/CONTRACT.md section 4), shared by the offline evaluation and the decoder.

Counts -> figures: step k is proposed only where steps 1..k-1 were accepted, so
acc_k = accepted_k / proposed_k; the mean accept length (bonus token included, as
SGLang reports it) is 1 + sum_k prod_{j<=k} acc_j; the accept rate is accepted draft
tokens / drafted tokens.

The decoder's walk. A speculative decoder drafts from the anchors where a verification
lands: after a round at anchor a that accepted j drafts, the next round is anchored at
a + j + 1. Which anchors it visits therefore depends on earlier outcomes, and the
per-anchor average over every anchor of a text (what an offline pass computes first) is
not the figure a served run reports. `decoder_rounds` replays `decode.speculative_decode`
on a fixed text from the per-anchor outcomes of the offline chain: on text the base
generated greedily, every decision the decoder makes equals the offline chain's at the
same anchor, so the replay gives the decoder's counts exactly (tests/test_metrics.py
checks it against the decoder itself) at the cost of one batched offline pass for any
number of draft steps, instead of one token-by-token decode per head and step count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass


def acceptance_summary(proposed: Sequence[int], accepted: Sequence[int], drafted: int) -> tuple[list[float], float, float]:
    """(acc_k per step, mean accept length with the bonus token, accept rate)."""
    acceptance = [a / p if p else 0.0 for a, p in zip(accepted, proposed)]
    length, running = 1.0, 1.0
    for acc in acceptance:
        running *= acc
        length += running
    rate = sum(accepted) / drafted if drafted else 0.0
    return acceptance, length, rate


def counts_from_outcomes(scorable: Sequence[int], accepted: Sequence[int], draft_steps: int) -> tuple[list[int], list[int], int]:
    """(proposed_k, accepted_k, drafted) of chains that were scorable for `scorable[n]` steps and
    accepted `accepted[n]` of them: step k is proposed when k <= accepted + 1 and k is scorable."""
    proposed, hits, drafted = [0] * draft_steps, [0] * draft_steps, 0
    for steps, run in zip(scorable, accepted):
        drafted += steps
        for k in range(min(run + 1, steps)):
            proposed[k] += 1
        for k in range(run):
            hits[k] += 1
    return proposed, hits, drafted


@dataclass(frozen=True)
class Round:
    """One draft-and-verify round of the replayed decoder."""

    anchor: int
    """Position a of the base hidden state the chain starts from (step 1 embeds x_{a+1})."""
    steps: int
    """Drafted steps whose predicted position a+k+1 lies inside the text (the accept-rate denominator)."""
    accepted: int
    """Leading drafts the base confirmed, <= steps."""


def decoder_rounds(
    accepted_at: Sequence[int], prompt_length: int, max_new_tokens: int, draft_steps: int
) -> tuple[list[Round], int]:
    """The rounds `decode.speculative_decode` runs on a text it wrote itself, and its base passes.

    Args:
        accepted_at: per anchor a = 0..L-1 of the whole text (prompt + output, length L):
            the leading chained steps the head gets right there (`ChainOutcome.accepted`,
            computed with at least `draft_steps` steps).
        prompt_length: P, the tokens before the first generated one.
        max_new_tokens: the generation budget the text was written under: the decoder
            leaves room for the bonus token, so its last rounds draft fewer steps.
        draft_steps: K.

    The decoder prefills the prompt (which gives the first output token), then, while
    the text goes on, drafts min(K, tokens left - 1) steps from anchor a = n - 2 (n the
    text length so far), accepts j of them and emits j + 1 tokens; with one token left
    it takes a plain base step instead. Returns the rounds and the base passes after the
    prefill (rounds + plain steps).
    """
    length = len(accepted_at)
    generated = length - prompt_length
    if prompt_length < 1 or generated < 1:
        raise ValueError(f"a text of {length} tokens with a {prompt_length}-token prompt has no generated token")
    if generated > max_new_tokens:
        raise ValueError(f"the text holds {generated} generated tokens, more than max_new_tokens={max_new_tokens}")
    rounds: list[Round] = []
    emitted, plain_steps = 1, 0
    while emitted < generated:
        steps = min(draft_steps, max_new_tokens - emitted - 1)
        if steps == 0:
            plain_steps += 1
            emitted += 1
            continue
        anchor = prompt_length + emitted - 2
        in_text = min(steps, length - 2 - anchor)
        accepted = min(accepted_at[anchor], steps)
        rounds.append(Round(anchor, in_text, min(accepted, in_text)))
        emitted += accepted + 1
    return rounds, len(rounds) + plain_steps


@dataclass(frozen=True)
class Acceptance:
    """What a speculative decoder measures over a set of texts at `draft_steps` steps."""

    draft_steps: int
    texts: int
    proposed: list[int]
    accepted: list[int]
    drafted: int
    acceptance: list[float]
    mean_accept_length: float
    accept_rate: float
    verify_passes: int
    """Base passes after the prefills (draft rounds + plain steps)."""
    tokens_per_verify_pass: float
    """Generated tokens after each prompt's first, per base pass: the measured speed-up over
    plain greedy decoding in base passes."""

    def to_dict(self) -> dict:
        return asdict(self)


def acceptance_from_counts(
    draft_steps: int, texts: int, proposed: Sequence[int], accepted: Sequence[int], drafted: int,
    verify_passes: int, generated_after_first: int,
) -> Acceptance:
    """The figures of summed counts."""
    acceptance, length, rate = acceptance_summary(proposed, accepted, drafted)
    return Acceptance(
        draft_steps=draft_steps,
        texts=texts,
        proposed=list(proposed),
        accepted=list(accepted),
        drafted=drafted,
        acceptance=acceptance,
        mean_accept_length=length,
        accept_rate=rate,
        verify_passes=verify_passes,
        tokens_per_verify_pass=generated_after_first / verify_passes if verify_passes else 0.0,
    )


def replayed_acceptance(
    texts: Sequence[tuple[Sequence[int], int]], max_new_tokens: int, draft_steps: int
) -> Acceptance:
    """The decoder's figures over texts given as (accepted_at, prompt_length) pairs."""
    scorable, hits = [], []
    passes = generated_after_first = 0
    for accepted_at, prompt_length in texts:
        rounds, text_passes = decoder_rounds(accepted_at, prompt_length, max_new_tokens, draft_steps)
        scorable += [r.steps for r in rounds]
        hits += [r.accepted for r in rounds]
        passes += text_passes
        generated_after_first += len(accepted_at) - prompt_length - 1
    proposed, accepted, drafted = counts_from_outcomes(scorable, hits, draft_steps)
    return acceptance_from_counts(draft_steps, len(texts), proposed, accepted, drafted, passes, generated_after_first)
