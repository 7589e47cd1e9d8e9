"""Sampled serving: the processed distribution, the draws, and the decoder's expected counts.

The oracle of `metrics.expected_rounds` is brute force: on a toy vocabulary of three tokens
(a base and a head given as tables of logits keyed by the text so far), every path of the
speculative decoder under rejection sampling is enumerated with its probability (each
draft, coin, replacement and bonus draw), and its expected counts are compared with the
library's, which enumerates only the texts (each weighted by the base's probability of
writing it) and walks each one's acceptance odds. The two agree to float64 rounding for
greedy and sampled drafts, with top-p and top-k cutting tokens out, with and without a
stop token, and a deliberately wrong walk fails the comparison.
"""

from __future__ import annotations

import hashlib
import itertools
import math

import pytest
import torch

from occamy_mtp import sampling
from occamy_mtp.testing.numerics import assert_close, rounding_bound
from occamy_mtp.evaluation.metrics import (
    counts_from_outcomes,
    decoder_rounds,
    expected_acceptance,
    expected_rounds,
    replayed_acceptance,
)

# ----------------------------------------------------------------------------------
# The processed distribution
# ----------------------------------------------------------------------------------


def plain_processed(logits: list[float], temperature: float, top_p: float, top_k: int) -> list[float]:
    """The definition, one token at a time: top-k keeps logits >= the k-th largest; top-p keeps
    a token when the tokens strictly more probable than it hold less than top_p."""
    if temperature == 0:
        best = max(range(len(logits)), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(len(logits))]
    scaled = [value / temperature for value in logits]
    kept = set(range(len(scaled)))
    if 0 < top_k < len(scaled):
        kth = sorted(scaled, reverse=True)[top_k - 1]
        kept = {i for i in kept if scaled[i] >= kth}
    total = sum(math.exp(scaled[i]) for i in kept)
    probs = {i: math.exp(scaled[i]) / total for i in kept}
    if top_p < 1:
        kept = {i for i in kept if sum(p for j, p in probs.items() if p > probs[i]) < top_p}
        total = sum(math.exp(scaled[i]) for i in kept)
    return [math.exp(scaled[i]) / total if i in kept else 0.0 for i in range(len(scaled))]


@pytest.mark.parametrize("temperature,top_p,top_k", [
    (0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 0.8, 0), (0.6, 0.95, 20), (1.3, 1.0, 5), (0.7, 0.05, 0), (0.9, 0.5, 3),
])
def test_processed_probs_is_the_definition(temperature, top_p, top_k):
    logits = torch.randn(16, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    got = sampling.processed_probs(logits, temperature, top_p, top_k)
    want = torch.tensor([plain_processed(row.tolist(), temperature, top_p, top_k) for row in logits], dtype=torch.float64)
    # float32 work: the scaling, then a softmax (a max, a sum of 40 terms, a division)
    assert_close(got, want, rounding_bound(want, torch.float32, reductions=3, width=40), "processed probabilities")
    assert torch.equal(got > 0, want > 0)  # a cut token is exactly 0 on both sides


def test_top_k_keeps_ties_at_the_kth_logit():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    probs = sampling.processed_probs(logits, 1.0, top_k=2)
    assert (probs[0] > 0).tolist() == [True, False, True, True, False]


def test_greedy_is_one_hot_at_the_lowest_tied_argmax():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    assert sampling.processed_probs(logits, 0.0).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert sampling.draft_probs(logits, 0.7, sampling.GREEDY_DRAFTS).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    sampled = sampling.draft_probs(logits, 0.7, sampling.SAMPLED_DRAFTS)
    assert torch.allclose(sampled, (logits / 0.7).softmax(-1))
    with pytest.raises(ValueError, match="draft rule"):
        sampling.draft_probs(logits, 0.7, "nucleus")


# ----------------------------------------------------------------------------------
# Draws and the rejection rule
# ----------------------------------------------------------------------------------


def test_inverse_cdf_draws_give_each_token_its_mass():
    """On an even grid of N uniforms, token x is drawn p(x) * N times, to within one draw."""
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.125, 0.125, 0.0])
    count = 4096
    uniforms = (torch.arange(count, dtype=torch.float64) + 0.5) / count
    drawn = sampling.draw(probs.expand(count, -1), uniforms)
    frequency = torch.bincount(drawn, minlength=len(probs)).double()
    assert torch.all((frequency - probs.double() * count).abs() <= 1), frequency
    # the ends of [0, 1): the first and the last token of nonzero mass, never a zero one
    edge = sampling.draw(probs.expand(2, -1), torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64))
    assert edge.tolist() == [1, 5]


def test_uniform_stream_is_a_function_of_seed_and_key():
    a = sampling.uniform_stream(0, "context-a", 5)
    assert torch.equal(a, sampling.uniform_stream(0, "context-a", 5))
    assert torch.equal(a[:3], sampling.uniform_stream(0, "context-a", 3))  # a prefix of a longer stream
    assert not torch.equal(a, sampling.uniform_stream(1, "context-a", 5))
    assert not torch.equal(a, sampling.uniform_stream(0, "context-b", 5))
    assert bool(((a >= 0) & (a < 1)).all())


@pytest.mark.parametrize("draft", sampling.DRAFT_RULES)
def test_rejection_sampling_emits_p_and_accepts_sum_min(draft):
    """Enumerated over the draft and the replacement: the emitted token is distributed as p,
    the acceptance is sum_x min(p, q), and acceptance given the emitted token averages to it."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        p = sampling.processed_probs(torch.randn(6, generator=generator), 0.8, top_p=0.9).double()
        q = sampling.draft_probs(torch.randn(6, generator=generator), 0.8, draft).double()
        emitted = torch.zeros(6, dtype=torch.float64)
        accepted = 0.0
        for d in range(6):
            if q[d] == 0:
                continue
            keep = min(1.0, float(p[d] / q[d]))
            emitted[d] += q[d] * keep
            accepted += float(q[d]) * keep
            emitted += q[d] * (1 - keep) * sampling.residual(p, q)
        assert torch.allclose(emitted, p, atol=1e-12)
        assert accepted == pytest.approx(float(sampling.acceptance(p, q)), abs=1e-12)
        tokens = torch.arange(6)
        given = sampling.acceptance_given(p.expand(6, -1), q.expand(6, -1), tokens)
        assert float((p * given).sum()) == pytest.approx(accepted, abs=1e-12)


# ----------------------------------------------------------------------------------
# The expected walk against the replay, and against brute force
# ----------------------------------------------------------------------------------


def test_expected_rounds_with_certain_outcomes_are_the_replay():
    """beta and alpha in {0, 1} (greedy serving): the same counts as `decoder_rounds`."""
    generator = torch.Generator().manual_seed(2)
    for trial in range(200):
        steps = 1 + trial % 3
        prompt_length = 1 + trial % 4
        length = prompt_length + 1 + int(torch.randint(0, 12, (1,), generator=generator))
        budget = length - prompt_length + int(torch.randint(0, 3, (1,), generator=generator))
        accepted_at = torch.randint(0, steps + 1, (length,), generator=generator).tolist()
        rounds, passes = decoder_rounds(accepted_at, prompt_length, budget, steps)
        proposed, hits, drafted = counts_from_outcomes([r.steps for r in rounds], [r.accepted for r in rounds], steps)
        given = [[1.0 if k < run else 0.0 for k in range(steps)] for run in accepted_at]
        counts = expected_rounds(given, given, prompt_length, budget, steps)
        assert (counts.proposed, counts.accepted, counts.drafted, counts.passes) == (proposed, hits, drafted, passes), trial
        replayed = replayed_acceptance([(accepted_at, prompt_length)], budget, steps)
        expected = expected_acceptance([(given, given, prompt_length)], budget, steps)
        assert expected == replayed


VOCAB = 3


def _table_logits(*key) -> torch.Tensor:
    """Three float64 logits, a pure function of `key`: the toy base and head."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return torch.tensor([(b - 127.5) / 40 for b in digest[:VOCAB]], dtype=torch.float64)


class Toy:
    """A base and a head over three tokens; the head's step k sees the text up to its anchor
    + 1 and the tokens drafted before it, as the MTP chain does."""

    def __init__(self, temperature, top_p, top_k, draft):
        self.temperature, self.top_p, self.top_k, self.draft = temperature, top_p, top_k, draft

    # Renormalised in float64: the library's float32 probabilities sum to 1 only to a few
    # ulps, and the two enumerations below must weigh paths and texts with the same numbers.
    def p(self, text) -> torch.Tensor:
        probs = sampling.processed_probs(_table_logits("base", tuple(text)), self.temperature, self.top_p, self.top_k)
        return probs.double() / probs.double().sum()

    def q(self, seen, step) -> torch.Tensor:
        probs = sampling.draft_probs(_table_logits("head", tuple(seen), step), self.temperature, self.draft).double()
        return probs / probs.sum()


def _speculative_paths(toy: Toy, prompt, budget, steps, stop):
    """Every path of the speculative decoder (decode.speculative_decode's rules, sampled) with its
    probability: yields (probability, output tokens, rounds as (anchor, drafted, accepted), plain steps)."""

    def branches(probs):
        return [(int(x), float(probs[x])) for x in range(VOCAB) if probs[x] > 0]

    def walk(weight, output, rounds, plain):
        if (output and output[-1] in stop) or len(output) == budget:
            yield weight, output, rounds, plain
            return
        text = list(prompt) + output
        draft_steps = min(steps, budget - len(output) - 1)
        if draft_steps == 0:  # a plain base step
            for x, px in branches(toy.p(text)):
                yield from walk(weight * px, output + [x], rounds, plain + 1)
            return
        anchor = len(text) - 2
        yield from draft(weight, output, rounds, plain, anchor, text, [], [], draft_steps)

    def draft(weight, output, rounds, plain, anchor, text, drafted, qs, draft_steps):
        if len(drafted) == draft_steps:
            yield from verify(weight, output, rounds, plain, anchor, text, drafted, qs)
            return
        q = toy.q(text + drafted, len(drafted) + 1)
        for d, qd in branches(q):
            yield from draft(weight * qd, output, rounds, plain, anchor, text, drafted + [d], qs + [q], draft_steps)

    def verify(weight, output, rounds, plain, anchor, text, drafted, qs):
        reached = weight
        for j, d in enumerate(drafted):
            p = toy.p(text + drafted[:j])
            keep = min(1.0, float(p[d] / qs[j][d]))
            for x, rx in branches(sampling.residual(p, qs[j])):
                if keep < 1:
                    yield from emit(reached * (1 - keep) * rx, output, rounds, plain, anchor, drafted, drafted[:j] + [x], j)
            reached *= keep
            if reached == 0:
                return
        for x, px in branches(toy.p(text + drafted)):
            yield from emit(reached * px, output, rounds, plain, anchor, drafted, drafted + [x], len(drafted))

    def emit(weight, output, rounds, plain, anchor, drafted, emitted, accepted):
        for j, token in enumerate(emitted):  # a stop token ends the text there
            if token in stop:
                emitted, accepted = emitted[: j + 1], min(accepted, j + 1)
                break
        yield from walk(weight, output + emitted, rounds + [(anchor, len(drafted), accepted)], plain)

    first = toy.p(prompt)
    for x, px in branches(first):
        yield from walk(px, [x], [], 0)


def _brute_force_counts(toy, prompt, budget, steps, stop):
    """Expected (proposed, accepted, drafted, passes) over every path, counted as the decoder counts."""
    proposed, accepted, drafted, passes = [0.0] * steps, [0.0] * steps, 0.0, 0.0
    for weight, output, rounds, plain in _speculative_paths(toy, prompt, budget, steps, stop):
        length = len(prompt) + len(output)
        in_text = [min(n, length - 2 - anchor) for anchor, n, _ in rounds]
        hits = [min(a, n) for (_, _, a), n in zip(rounds, in_text)]
        p_k, a_k, d = counts_from_outcomes(in_text, hits, steps)
        proposed = [x + weight * y for x, y in zip(proposed, p_k)]
        accepted = [x + weight * y for x, y in zip(accepted, a_k)]
        drafted += weight * d
        passes += weight * (len(rounds) + plain)
    return proposed, accepted, drafted, passes


def _texts(toy, prompt, budget, stop):
    """Every text the base writes (sampled from p until a stop token or the budget) with its probability."""
    for output in itertools.chain.from_iterable(itertools.product(range(VOCAB), repeat=n) for n in range(1, budget + 1)):
        if any(t in stop for t in output[:-1]) or (len(output) < budget and output[-1] not in stop):
            continue
        weight, text = 1.0, list(prompt)
        for token in output:
            weight *= float(toy.p(text)[token])
            text.append(token)
        if weight > 0:
            yield weight, text


def _library_counts(toy, prompt, budget, steps, stop, walk=expected_rounds):
    """The library's figure: over the texts, the expected walk from the odds of each (anchor, step)."""
    proposed, accepted, drafted, passes = [0.0] * steps, [0.0] * steps, 0.0, 0.0
    for weight, text in _texts(toy, prompt, budget, stop):
        given = [[0.0] * steps for _ in text]
        expected = [[0.0] * steps for _ in text]
        for anchor in range(len(text)):
            for k in range(steps):
                position = anchor + k + 2  # step k + 1 predicts x_{anchor + k + 2}
                if position >= len(text):
                    break
                seen = text[:position]  # the text to the anchor + 1, then the accepted drafts
                p, q = toy.p(seen), toy.q(seen, k + 1)
                given[anchor][k] = float(sampling.acceptance_given(p, q, torch.tensor(text[position])))
                expected[anchor][k] = float(sampling.acceptance(p, q))
        counts = walk(given, expected, len(prompt), budget, steps)
        proposed = [x + weight * y for x, y in zip(proposed, counts.proposed)]
        accepted = [x + weight * y for x, y in zip(accepted, counts.accepted)]
        drafted += weight * counts.drafted
        passes += weight * counts.passes
    return proposed, accepted, drafted, passes


CASES = [  # temperature, top_p, top_k, draft rule, draft steps, budget, stop tokens
    (0.8, 1.0, 0, sampling.GREEDY_DRAFTS, 2, 5, set()),
    (0.8, 1.0, 0, sampling.SAMPLED_DRAFTS, 2, 5, set()),
    (0.7, 0.8, 0, sampling.GREEDY_DRAFTS, 3, 5, {2}),
    (0.7, 0.8, 0, sampling.SAMPLED_DRAFTS, 3, 5, {2}),
    (1.2, 1.0, 2, sampling.SAMPLED_DRAFTS, 1, 4, {0}),
    (0.0, 1.0, 0, sampling.GREEDY_DRAFTS, 3, 6, set()),
]


@pytest.mark.parametrize("temperature,top_p,top_k,draft,steps,budget,stop", CASES)
def test_expected_walk_equals_the_enumerated_decoder(temperature, top_p, top_k, draft, steps, budget, stop):
    toy = Toy(temperature, top_p, top_k, draft)
    prompt = [1, 0]
    want = _brute_force_counts(toy, prompt, budget, steps, stop)
    got = _library_counts(toy, prompt, budget, steps, stop)
    assert want[1][0] > 0.05 and want[0][0] > want[1][0]  # the case tests something: drafts accepted and rejected
    for name, a, b in zip(("proposed", "accepted", "drafted", "passes"), got, want):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-12), name


def test_a_wrong_walk_fails_the_enumeration():
    """Counting an accepted draft by beta at the anchor one too early (a shifted text) differs."""
    toy = Toy(0.8, 1.0, 0, sampling.SAMPLED_DRAFTS)
    prompt = [1, 0]
    want = _brute_force_counts(toy, prompt, 5, 2, set())

    def shifted(given, expected, *args):
        return expected_rounds(given[1:] + given[:1], expected, *args)

    got = _library_counts(toy, prompt, 5, 2, set(), walk=shifted)
    assert max(abs(a - b) for a, b in zip(got[0] + got[1], want[0] + want[1])) > 1e-3
