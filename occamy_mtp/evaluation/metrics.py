"""Acceptance arithmetic (docs/reference/CONTRACT.md section 4), shared by the offline evaluation and the decoder.

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

Sampled serving (`occamy_mtp.sampling`). The decoder's walk is random, but given the text it
wrote it is a Markov chain over the anchors with known odds: the emitted token is drawn
from p whether or not the draft was accepted, so given the text, step k of a round is
accepted with probability beta = min(p, q)(x) / p(x) at the text's token x, independently
of every other draw. `expected_acceptance` walks that chain exactly (`expected_rounds`:
the probability that a round lands at each anchor, and the expected counts from there).
An accepted draft is counted with alpha = sum_x min(p, q), its expectation given the text
before the drafted position, rather than with beta: the same expectation, with the draw
of that token averaged out. On a text the base wrote under the same sampling settings,
the figures are the decoder's expected counts given the text, and their mean over texts
is the served expectation (docs/reference/CONTRACT.md section 4). With beta and alpha in {0, 1}
(greedy serving on the base's greedy text) the walk is `decoder_rounds`' and the counts
are the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace


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


def generated_tokens(length: int, prompt_length: int, max_new_tokens: int) -> int:
    """The generated tokens of a text of `length` tokens after its prompt; refused when there are
    none, or more than the budget it was written under."""
    generated = length - prompt_length
    if prompt_length < 1 or generated < 1:
        raise ValueError(f"a text of {length} tokens with a {prompt_length}-token prompt has no generated token")
    if generated > max_new_tokens:
        raise ValueError(f"the text holds {generated} generated tokens, more than max_new_tokens={max_new_tokens}")
    return generated


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
    generated = generated_tokens(length, prompt_length, max_new_tokens)
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
class ExpectedCounts:
    """The decoder's expected counts over one text (`expected_rounds`)."""

    proposed: list[float]
    accepted: list[float]
    drafted: float
    passes: float
    """Base passes after the prefill: rounds and plain steps."""
    generated_after_first: int = 0
    """Tokens the text holds after its first generated one."""
    plain_steps: float = 0.0
    """Of `passes`, the plain base steps (one token left in the budget: no draft). An engine counts
    verify passes only (SGLang's spec_verify_ct, the rounds), so a comparison with one takes
    `verify_passes`."""

    @property
    def verify_passes(self) -> float:
        """The rounds that drafted and verified: `passes` less the plain steps."""
        return self.passes - self.plain_steps


def expected_rounds(
    accept_given: Sequence[Sequence[float]],
    accept_expected: Sequence[Sequence[float]],
    prompt_length: int,
    max_new_tokens: int,
    draft_steps: int,
    visit: Callable[[int, int, float], None] | None = None,
) -> ExpectedCounts:
    """The expected counts of `decode.speculative_decode` that wrote this text under sampling (module docstring).

    Args:
        accept_given: per anchor a = 0..L-1 of the whole text and chain step k (0-based,
            at least `draft_steps` of them): P(step k accepted | steps before it accepted,
            the text), beta. Read only where step k's position a+k+1 lies inside the text.
        accept_expected: alpha, the same step's expected acceptance given the text before
            the drafted position: what an accepted draft counts.
        prompt_length, max_new_tokens, draft_steps: as for `decoder_rounds`, whose walk this
            is: from e emitted tokens a round drafts min(K, budget left - 1) steps at anchor
            P + e - 2 (a plain base step when that is 0), accepts j of them with probability
            beta_1 ... beta_j (1 - beta_{j+1}), and emits j + 1 tokens.
        visit: called as visit(anchor, k, weight) for every draft the walk may propose: step k
            (0-based) at `anchor`, proposed with probability `weight` (what `proposed[k]` sums),
            so that a caller can say where the drafts and their acceptance fall (`breakdown`).
    """
    length = len(accept_given)
    generated = generated_tokens(length, prompt_length, max_new_tokens)
    arrive = [0.0] * (generated + 1)  # arrive[e]: P(a round starts with e tokens emitted)
    arrive[1] = 1.0  # the prefill emits the first token
    proposed, accepted = [0.0] * draft_steps, [0.0] * draft_steps
    drafted = passes = plain = 0.0
    for emitted in range(1, generated):
        weight = arrive[emitted]
        if weight == 0.0:
            continue
        passes += weight
        steps = min(draft_steps, max_new_tokens - emitted - 1)
        if steps == 0:  # one token left: a plain base step
            plain += weight
            arrive[emitted + 1] += weight
            continue
        anchor = prompt_length + emitted - 2
        in_text = min(steps, length - 2 - anchor)
        drafted += weight * in_text
        reached = 1.0  # P(steps before this one all accepted)
        for k in range(in_text):
            proposed[k] += weight * reached
            accepted[k] += weight * reached * accept_expected[anchor][k]
            if visit is not None:
                visit(anchor, k, weight * reached)
            kept = reached * accept_given[anchor][k]
            if emitted + k + 1 < generated:  # k drafts accepted, then a rejection: k + 1 tokens
                arrive[emitted + k + 1] += weight * (reached - kept)
            reached = kept
        if emitted + in_text + 1 < generated:  # every draft accepted, then the bonus token
            arrive[emitted + in_text + 1] += weight * reached
    return ExpectedCounts(proposed, accepted, drafted, passes, length - prompt_length - 1, plain)


def replayed_counts(accepted_at: Sequence[int], prompt_length: int, max_new_tokens: int, draft_steps: int) -> ExpectedCounts:
    """The decoder's counts over one greedy text (`decoder_rounds`), in `expected_rounds`' form (whole numbers)."""
    rounds, passes = decoder_rounds(accepted_at, prompt_length, max_new_tokens, draft_steps)
    proposed, accepted, drafted = counts_from_outcomes([r.steps for r in rounds], [r.accepted for r in rounds], draft_steps)
    return ExpectedCounts(proposed, accepted, drafted, passes, len(accepted_at) - prompt_length - 1)


@dataclass(frozen=True)
class Acceptance:
    """What a speculative decoder measures over a set of texts at `draft_steps` steps: counts
    under greedy serving, expected counts (fractional) under sampled serving."""

    draft_steps: int
    texts: int
    proposed: list[float]
    accepted: list[float]
    drafted: float
    acceptance: list[float]
    mean_accept_length: float
    accept_rate: float
    verify_passes: float
    """Base passes after the prefills (draft rounds + plain steps)."""
    tokens_per_verify_pass: float
    """Generated tokens after each prompt's first, per base pass: the measured speed-up over
    plain greedy decoding in base passes."""
    contexts: int = 0
    """Distinct contexts among the texts (several sampled continuations of one context are one)."""
    mean_accept_length_se: float = 0.0
    """The standard error of `mean_accept_length` over contexts (`jackknife_se`): the spread of the
    figure between sets of contexts and continuations drawn as these were. 0 for one context."""

    def to_dict(self) -> dict:
        return asdict(self)


def acceptance_from_counts(
    draft_steps: int, texts: int, proposed: Sequence[float], accepted: Sequence[float], drafted: float,
    verify_passes: float, generated_after_first: int,
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
    texts: Sequence[tuple[Sequence[int], int]], max_new_tokens: int, draft_steps: int, clusters: Sequence | None = None,
) -> Acceptance:
    """The decoder's figures over texts given as (accepted_at, prompt_length) pairs (`summed_acceptance`)."""
    counts = [replayed_counts(accepted_at, prompt_length, max_new_tokens, draft_steps) for accepted_at, prompt_length in texts]
    return summed_acceptance(counts, draft_steps, clusters=clusters)


def expected_acceptance(
    texts: Sequence[tuple[Sequence[Sequence[float]], Sequence[Sequence[float]], int]], max_new_tokens: int,
    draft_steps: int, clusters: Sequence | None = None,
) -> Acceptance:
    """The decoder's expected figures over texts given as (accept_given, accept_expected,
    prompt_length) triples (`expected_rounds`): expected counts summed over the texts, and
    the figures of those sums, as an engine's counters sum them (`summed_acceptance`)."""
    counts = [expected_rounds(given, expected, prompt_length, max_new_tokens, draft_steps)
              for given, expected, prompt_length in texts]
    return summed_acceptance(counts, draft_steps, clusters=clusters)


def summed_acceptance(counts: Sequence[ExpectedCounts], draft_steps: int, generated_after_first: int | None = None,
                      clusters: Sequence | None = None) -> Acceptance:
    """The figures of counts (`expected_rounds`, `replayed_counts`) summed over texts, with the
    standard error of the mean accept length over `clusters` (one key per text: the texts of
    one context share it; default: every text its own). `generated_after_first` defaults to
    the texts' own."""
    proposed = [sum((c.proposed[k] for c in counts), 0) for k in range(draft_steps)]
    accepted = [sum((c.accepted[k] for c in counts), 0) for k in range(draft_steps)]
    generated = sum(c.generated_after_first for c in counts) if generated_after_first is None else generated_after_first
    keys = list(range(len(counts))) if clusters is None else list(clusters)
    if len(keys) != len(counts):
        raise ValueError(f"clusters: {len(keys)} keys for {len(counts)} texts")
    figures = acceptance_from_counts(draft_steps, len(counts), proposed, accepted, sum(c.drafted for c in counts),
                                     sum(c.passes for c in counts), generated)
    return replace(figures, contexts=len(set(keys)), mean_accept_length_se=jackknife_se(counts, keys, draft_steps))


def z_score(differences: Sequence[float]) -> float:
    """The mean of independent mean-0 differences over its standard error: 0 when they are all 0, and
    infinite (signed) when they are all one same nonzero value (a systematic offset, which no spread
    excuses: under greedy drafts an engine's verify passes given the text are certain)."""
    count = len(differences)
    mean = sum(differences) / count
    variance = sum((d - mean) ** 2 for d in differences) / max(1, count - 1)
    if variance == 0:
        return 0.0 if mean == 0 else math.copysign(math.inf, mean)
    return mean / math.sqrt(variance / count)


def jackknife_se(counts: Sequence[ExpectedCounts], clusters: Sequence, draft_steps: int) -> float:
    """The delete-one-cluster jackknife standard error of the mean accept length of summed counts.

    The figure is a ratio of sums over texts, so its spread is read by leaving out one cluster
    (a context with all its continuations) at a time: SE^2 = (n - 1) / n * sum_i (L_(i) - mean L_(.))^2
    over the n clusters. It covers both draws: which contexts, and which continuation of each.
    """
    return _spread(_leave_one_out(per_context(counts, clusters, draft_steps)))


def per_context(counts: Sequence[ExpectedCounts], clusters: Sequence, draft_steps: int) -> dict:
    """The counts summed per context (`clusters`: one key per text), in first-seen order: what a paired
    comparison of two heads on the same texts needs (`difference_noise`). Keys are written as text."""
    groups: dict = {}
    for key, c in zip(clusters, counts):
        proposed, accepted = groups.setdefault(key, ([0.0] * draft_steps, [0.0] * draft_steps))
        for k in range(draft_steps):
            proposed[k] += c.proposed[k]
            accepted[k] += c.accepted[k]
    return {"contexts": [":".join(str(part) for part in key) if isinstance(key, tuple) else str(key) for key in groups],
            "proposed": [g[0] for g in groups.values()], "accepted": [g[1] for g in groups.values()]}


def paired_difference_se(a: dict, b: dict) -> float:
    """The delete-one-context jackknife standard error of L(b) - L(a), the mean accept lengths of two
    heads' `per_context` counts on the same contexts: the spread the two share (which contexts, which
    continuations) cancels, so a real difference stands out of it."""
    if a["contexts"] != b["contexts"]:
        raise ValueError("the two heads were measured on different contexts")
    return _spread([y - x for x, y in zip(_leave_one_out(a), _leave_one_out(b))])


def _leave_one_out(counts: dict) -> list[float]:
    """The mean accept length of `per_context` counts with each context left out in turn."""
    totals_p = [sum(column) for column in zip(*counts["proposed"])]
    totals_a = [sum(column) for column in zip(*counts["accepted"])]
    return [acceptance_summary([t - p for t, p in zip(totals_p, proposed)], [t - x for t, x in zip(totals_a, accepted)], 0)[1]
            for proposed, accepted in zip(counts["proposed"], counts["accepted"])]


def _spread(values: list[float]) -> float:
    """The jackknife's standard error from its leave-one-out values: sqrt((n - 1) / n * sum (v_i - mean)^2); 0 under 2."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt((n - 1) / n * sum((v - mean) ** 2 for v in values))


NOISE_STANDARD_ERRORS = 2.0


def difference_noise(donor: dict, trained: dict) -> dict:
    """Whether trained - donor (mean accept lengths, `Acceptance.to_dict()`) is within noise: under
    NOISE_STANDARD_ERRORS standard errors of the difference. Paired where both carry `per_context`
    counts on the same contexts (`paired_difference_se`); else taken as if the two were measured on
    independent texts, sqrt(se_d^2 + se_t^2), which over-states the noise of figures measured on the
    same texts (a difference it calls significant is; one it calls within noise may not be)."""
    if donor.get("per_context") and trained.get("per_context"):
        se, paired = paired_difference_se(donor["per_context"], trained["per_context"]), True
    else:
        se, paired = math.hypot(donor.get("mean_accept_length_se", 0.0), trained.get("mean_accept_length_se", 0.0)), False
    return {"standard_error": se, "paired": paired,
            "within_noise": within_noise(trained["mean_accept_length"] - donor["mean_accept_length"], se)}


def within_noise(difference: float, standard_error: float) -> bool:
    """Whether a difference is under NOISE_STANDARD_ERRORS of its standard errors (an exact one, se 0, never is)."""
    return abs(difference) < NOISE_STANDARD_ERRORS * standard_error
