"""The offline pass: a head's chains over windows of the frozen base's outputs, batched to the GPU.

Teacher-forced or on the base's own text, one pass gives step 1's agreement and NLL and the
chained acceptance at every anchor (`evaluate_head`, `chain_outcomes`), and under a sampled
serving configuration each draft's odds of acceptance (`_run_batch_sampled`). The served
figures (`evaluation.served`) walk the decoder over these (docs/guide/EVALUATION.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from occamy_mtp import memory, sampling
from occamy_mtp.config import Serving
from occamy_mtp.model.head import DEFAULT_LOGITS_CHUNK_TOKENS
from occamy_mtp.model.loss import IGNORE, chain_batch, collate
from occamy_mtp.model.sharding import agreed_min
from occamy_mtp.evaluation.metrics import acceptance_summary
from occamy_mtp.base.fastbase import token_bytes
from occamy_mtp.base.logits import chunked_greedy, chunked_top
from occamy_mtp.targets.base import base_outputs, kept_probs


TEACHER_FORCED = "teacher_forced"


SELF_GENERATED = "self_generated"


# Rows of vocabulary-wide probabilities at a time under sampled serving: p, q, their minimum
# and top-p's sort are each (rows x V) of 4 to 12 bytes; 512 rows at V = 248,320 are
# 0.5 to 1.5 GiB each.
SAMPLED_CHUNK_TOKENS = 512


# Bytes a logit takes at the peak of each chunked loop below, at most `DEFAULT_LOGITS_CHUNK_TOKENS`
# (or `SAMPLED_CHUNK_TOKENS`) positions a chunk and fewer where the GPU has less free
# (`memory.logit_rows`); each figure is checked against a measured peak (tests/test_memory.py).
# Step 1's figures: the bf16 logits, their fp32 copy and cross-entropy's fp32 log-softmax.
FIGURES_BYTES_PER_LOGIT = 10


# Sampled odds: p's top-p sort (values, int64 order, the softmax, its running sum, the
# filtered copy), p itself, q, and min(p, q); under penalties also the penalized fp32 logits,
# the answer's counts and the mask of tokens seen.
ODDS_BYTES_PER_LOGIT = 64


@dataclass(frozen=True)
class Metrics:
    windows: int
    scored_positions: int
    agreement: float
    data_nll: float
    draft_steps: int
    proposed: list[float]
    accepted: list[float]
    acceptance: list[float]
    mean_accept_length: float
    accept_rate: float
    text: str
    exact: bool
    drafted: float = 0
    """Drafted tokens (step k counted wherever its predicted position is scored): the accept-rate denominator."""
    data_matches_target: float = 0.0
    """Fraction of scored positions whose data token x_{i+2} equals the base's greedy token:
    1.0 on greedy self-generated text; where it is below 1 on teacher-forced data the
    acceptance figure is an approximation (on sampled text it is exact regardless)."""
    outside_support: int = 0
    """Sampled serving: scored (step, anchor) pairs whose text token the base's processed
    distribution excludes, i.e. text not written under these settings (0 when it was)."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ChainOutcome:
    """The offline chain at every anchor i of one window (anchors are positions 0..T-1)."""

    scorable: tuple[int, ...]
    """Steps k whose predicted position i+k+1 is scored (inside the window and the answer); 0: anchor not scored."""
    accepted: tuple[int, ...]
    """Leading steps whose argmax equals the base's greedy token (<= scorable)."""


@dataclass(frozen=True)
class BatchChain:
    """One batch through base and head: which (step, anchor) pairs are scored and accepted."""

    scored: torch.Tensor  # (K, B, T) bool: step k at anchor i is scorable (step 1 scored, position inside the text)
    hits: torch.Tensor  # (K, B, T) bool: chained acceptance (steps 1..k all accepted)
    agree: int
    nll_sum: float
    data_matches: int
    lengths: list[int]
    confidence: torch.Tensor | None = None
    """(K, B, T) float64: the head's top-1 probability where it proposed (`base.logits.chunked_top`), else 0;
    None unless asked for (`head_batches`' confidence)."""


@dataclass(frozen=True)
class BatchOdds:
    """One batch under sampled serving: per (step, anchor), the acceptance odds given the text."""

    scored: torch.Tensor  # (K, B, T) bool
    given: torch.Tensor  # (K, B, T) float64: P(step k accepted | steps before accepted, the text), beta
    expected: torch.Tensor  # (K, B, T) float64: sum_x min(p, q), alpha
    agree: int
    nll_sum: float
    data_matches: int
    outside: int
    lengths: list[int]
    confidence: torch.Tensor | None = None
    """(K, B, T) float64: the head's top-1 probability (its softmax) at each scored pair; None unless asked for."""
    relaxed: torch.Tensor | None = None
    """(K, B, T) float64 under a relaxed configuration: the expected acceptance there under the relaxed rule
    (`sampling.relaxed_acceptance`); None otherwise."""


def batch_targets(base, batch):
    """The base's outputs over `batch`: from the base, or a target source (the offline cache) standing in for it."""
    if hasattr(base, "outputs"):
        return base.outputs(batch.input_ids, batch.attention_mask)
    return base_outputs(base, batch.input_ids, batch.attention_mask)


def _pass(base, head, windows, draft_steps: int, device, embed_text: bool = False):
    """The base's targets and the head's chain over one batch: (batch, targets, chain, hidden (K, B, T, D))."""
    batch = collate(windows, device)
    targets = batch_targets(base, batch)
    chain = chain_batch(batch.input_ids, targets.greedy, batch.assistant, batch.lengths, draft_steps, embed_text)
    return batch, targets, chain, head(chain.step_token_ids, targets.hidden)


def _step1_figures(head, hidden: torch.Tensor, chain) -> tuple[int, float, int]:
    """(argmax agreements with the greedy target, summed data-answer NLL, data tokens equal to the target) at step 1."""
    first = chain.labels[0] != IGNORE
    h1 = hidden[0][first]  # (N, D)
    target1 = chain.labels[0][first]
    data1 = chain.data_labels[first]
    agree, nll_sum = 0, 0.0
    chunk = memory.logit_rows(h1.device, head.vocab_size, FIGURES_BYTES_PER_LOGIT, DEFAULT_LOGITS_CHUNK_TOKENS)
    for start in range(0, h1.shape[0], chunk):  # never (N x V) fp32 at once
        part = slice(start, start + chunk)
        hits, nll = figures_of(head, h1[part], target1[part], data1[part])
        agree, nll_sum = agree + hits, nll_sum + nll
    return agree, nll_sum, int((data1 == target1).sum())


def figures_of(head, hidden: torch.Tensor, target: torch.Tensor, data: torch.Tensor) -> tuple[int, float]:
    """(argmax agreements with `target`, summed NLL of `data`) of (N, D) head states: one chunk."""
    logits = head.logits(hidden).float()
    return int((logits.argmax(-1) == target).sum()), float(F.cross_entropy(logits, data, reduction="sum"))


@torch.no_grad()
def _run_batch(base, head, windows, draft_steps: int, device, confidence: bool = False) -> BatchChain:
    batch, targets, chain, hidden = _pass(base, head, windows, draft_steps, device)
    valid = chain.labels != IGNORE  # (K, B, T)
    first = valid[0]
    agree, nll_sum, data_matches = _step1_figures(head, hidden, chain)
    scored = valid & first
    hits = torch.zeros_like(scored)
    sure = torch.zeros(scored.shape, dtype=torch.float64) if confidence else None
    alive = first.clone()  # anchors whose chain is still accepted
    for k in range(draft_steps):
        proposing = alive & scored[k]
        if proposing.any():
            if confidence:
                predicted, top = chunked_top(hidden[k][proposing], head.shared.lm_head)
                sure[k][proposing.cpu()] = top.double().cpu()
            else:
                predicted = chunked_greedy(hidden[k][proposing], head.shared.lm_head)
            hits[k][proposing] = predicted == chain.labels[k][proposing]
        alive = hits[k]
    return BatchChain(
        scored=scored,
        hits=hits,
        agree=agree,
        nll_sum=nll_sum,
        data_matches=data_matches,
        lengths=batch.lengths.tolist(),
        confidence=sure,
    )


@torch.no_grad()
def _run_batch_sampled(base, head, windows, draft_steps: int, device, serving: Serving,
                       confidence: bool = False) -> BatchOdds:
    """`_run_batch` under sampled serving: each scored (step, anchor) pair's odds given the text.

    Step k at anchor i predicts x_{i+k+1}: p is the base's processed distribution from
    H_{i+k}, q the head's under the draft rule; alpha = sum_x min(p, q), beta = min(p, q)(x) / p(x)
    at the text's token x = x_{i+k+1} (`occamy_mtp.sampling`). Steps k >= 2 embed the text's tokens.
    Penalties read the answer as the engine of `serving` verifies the round (`sampling.verified_history_ends`).
    """
    batch, targets, chain, hidden = _pass(base, head, windows, draft_steps, device, embed_text=True)
    valid = chain.labels != IGNORE
    scored = valid & valid[0]
    agree, nll_sum, data_matches = _step1_figures(head, hidden, chain)
    given = torch.zeros(scored.shape, dtype=torch.float64)
    expected = torch.zeros(scored.shape, dtype=torch.float64)
    sure = torch.zeros(scored.shape, dtype=torch.float64) if confidence else None
    relaxed = torch.zeros(scored.shape, dtype=torch.float64) if serving.relaxed else None
    outside = 0
    starts = torch.tensor([w.answer_start for w in windows])
    for k in range(draft_steps):  # step k + 1
        rows, anchors = scored[k].nonzero(as_tuple=True)  # (N,), (N,)
        base_hidden = targets.hidden[rows, anchors + k + 1]  # (N, D): H_{i+k+1} predicts x_{i+k+2}, step k + 1's draft
        tokens = batch.input_ids[rows, anchors + k + 2]
        head_hidden = hidden[k][rows, anchors]
        alpha, beta, top, loose = [], [], [], []
        positions = memory.logit_rows(head_hidden.device, head.vocab_size, ODDS_BYTES_PER_LOGIT, SAMPLED_CHUNK_TOKENS)
        for start in range(0, len(rows), positions):
            chunk = slice(start, min(start + positions, len(rows)))

            def p_of():
                history = sampling.answer_histories(batch.input_ids, starts, rows[chunk],
                                                    sampling.verified_history_ends(serving, anchors[chunk], k)) \
                    if serving.penalized else None
                return base_distribution(head, base_hidden[chunk], serving, history)

            # The same for every head on these texts (both heads at export, every selection step): kept by a
            # shared target source, computed once.
            p = kept_probs(base, batch.input_ids, batch.attention_mask, ("base_probs", serving, k), chunk, p_of)
            odds = odds_of(head, p, head_hidden[chunk], tokens[chunk], serving, confidence)
            alpha.append(odds.alpha)
            beta.append(odds.beta)
            top.append(odds.confidence)
            loose.append(odds.relaxed)
            outside += odds.outside
        if len(rows):
            where = (rows.cpu(), anchors.cpu())
            expected[k][where] = torch.cat(alpha)
            given[k][where] = torch.cat(beta)
            if sure is not None:
                sure[k][where] = torch.cat(top)
            if relaxed is not None:
                relaxed[k][where] = torch.cat(loose)
    return BatchOdds(scored.cpu(), given, expected, agree, nll_sum, data_matches, outside, batch.lengths.tolist(), sure,
                     relaxed)


class Odds(NamedTuple):
    """N (step, anchor) pairs' odds (`odds_of`), each (N,) float64 on the CPU but `outside`."""

    alpha: torch.Tensor
    beta: torch.Tensor
    outside: int
    """Text tokens outside p's support."""
    confidence: torch.Tensor | None
    """The head's top-1 probability (asked for: `odds_of`'s `confidence`)."""
    relaxed: torch.Tensor | None
    """The expected acceptance under the relaxed rule (a relaxed configuration; else None)."""


def base_distribution(head, base_hidden: torch.Tensor, serving: Serving, history: sampling.History | None = None) -> torch.Tensor:
    """p of N drafted positions: the base's processed distribution from `base_hidden` (N, D) (the head's
    logits are the base's lm_head), its penalties over `history` (the answer before each drafted position
    and the prompt: given the text, the accepted drafts are the text's tokens). (N, V) float32."""
    return sampling.base_probs(head.logits(base_hidden), serving, history)


def odds_of(head, p: torch.Tensor, head_hidden: torch.Tensor, tokens: torch.Tensor, serving: Serving,
            confidence: bool = False) -> Odds:
    """The odds of N (step, anchor) pairs: one chunk.

    p is the base's processed distribution at the drafted positions (`base_distribution`); q the
    head's from `head_hidden`; `tokens` are the text's. The head's confidence only with `confidence`
    (else None)."""
    logits = head.logits(head_hidden)
    sure = sampling.top_probability(logits).double().cpu() if confidence else None
    q = sampling.head_probs(logits, serving)
    del logits
    relaxed = sampling.relaxed_acceptance(p, q, serving.relaxed_top_k, serving.relaxed_ratio).double().cpu() \
        if serving.relaxed else None
    return Odds(sampling.acceptance(p, q).double().cpu(), sampling.acceptance_given(p, q, tokens).double().cpu(),
                int(sampling.outside_support(p, tokens).sum()), sure, relaxed)


def _target_token_bytes(targets) -> int:
    """Bytes a token of a batch takes while its targets are made: the base's forward where the base
    runs (a model, or the online source holding one; `fastbase.token_bytes`), else the hidden
    state and greedy token a cache copies to the device."""
    model = targets if isinstance(targets, torch.nn.Module) else getattr(targets, "base", None)
    if isinstance(model, torch.nn.Module):
        return token_bytes(getattr(model.config, "text_config", model.config), model.lm_head.weight.dtype)
    return targets.hidden_size * torch.empty((), dtype=targets.dtype).element_size() + 8


def window_batches(targets, head, windows, steps: int, windows_per_batch: int):
    """`windows` in order, `windows_per_batch` at a time; on a GPU fewer where the batch's padded
    pass would not fit beside what is allocated (`MTPHead.chain_bytes`, `_target_token_bytes`,
    `memory.MARGIN_BYTES` kept free): long windows' chain masks grow with the square of their
    length."""
    device = head.fc.weight.device
    if device.type != "cuda":  # nothing is sized off CUDA: results never depend on the free memory
        return grouped(windows, windows_per_batch, lambda part: True)
    # Each process of a sharded base sizes to its own card; they run the same forwards, so the least.
    budget = agreed_min(memory.available_bytes(device), getattr(targets, "base", None), device) - memory.MARGIN_BYTES
    per_token = _target_token_bytes(targets)

    def fits(part) -> bool:
        length = max(len(w.input_ids) for w in part)
        return head.chain_bytes(len(part), length, steps) + len(part) * length * per_token <= budget

    return grouped(windows, windows_per_batch, fits)


def grouped(windows, most: int, fits):
    """Consecutive runs of `windows`, in order, each of at most `most` and grown only while `fits(run)`:
    a window that does not fit even alone still runs alone."""
    start = 0
    while start < len(windows):
        end = start + 1
        while end < min(len(windows), start + most) and fits(windows[start : end + 1]):
            end += 1
        yield windows[start:end]
        start = end


def head_batches(base, head, windows, draft_steps: int, windows_per_batch: int, serving: Serving | None = None,
                 confidence: bool = False):
    """The batches' chains: `BatchChain`s for greedy serving (None too), `BatchOdds` for sampled; with
    `confidence`, the head's top-1 probability at its drafts too (`batch_confidence`: the breakdown's calibration)."""
    device = head.fc.weight.device
    was_training = head.training
    head.eval()
    try:
        for part in window_batches(base, head, windows, draft_steps, windows_per_batch):
            if serving is None or serving.greedy:
                yield _run_batch(base, head, part, draft_steps, device, confidence)
            else:
                yield _run_batch_sampled(base, head, part, draft_steps, device, serving, confidence)
    finally:
        head.train(was_training)


def evaluate_head(
    base,
    head,
    windows,
    draft_steps: int = 3,
    windows_per_batch: int = 4,
    text: str = TEACHER_FORCED,
) -> Metrics:
    """Agreement, NLL and chained acceptance of `head` on `windows` (see module docstring).

    `base` is the frozen base, or a target source with `.outputs(input_ids, attention_mask)`
    such as `target_cache.TargetCache`, whose stored targets then stand in for the base forward.
    """
    return batch_metrics(list(head_batches(base, head, windows, draft_steps, windows_per_batch)), len(windows), draft_steps, text)


def batch_metrics(results: list[BatchChain | BatchOdds], windows: int, draft_steps: int, text: str) -> Metrics:
    """The figures of every anchor: counts for greedy serving; expected counts given the text
    for sampled (step k proposed with P(steps before accepted), accepted with that times alpha)."""
    scored_positions = agree = data_matches = drafted = outside = 0
    nll_sum = 0.0
    proposed = [0] * draft_steps
    accepted = [0] * draft_steps
    for result in results:
        scored_positions += int(result.scored[0].sum())
        agree += result.agree
        nll_sum += result.nll_sum
        data_matches += result.data_matches
        drafted += int(result.scored[:draft_steps].sum())
        if isinstance(result, BatchOdds):
            outside += result.outside
            reached = result.scored[0].double()  # P(steps before k accepted), where step k is scored
            for k in range(draft_steps):
                reached = reached * result.scored[k]
                proposed[k] += float(reached.sum())
                accepted[k] += float((reached * result.expected[k]).sum())
                reached = reached * result.given[k]
            continue
        previous = result.scored[0]  # step 1 is proposed wherever it is scored
        for k in range(draft_steps):
            proposing = previous & result.scored[k]
            proposed[k] += int(proposing.sum())
            accepted[k] += int(result.hits[k].sum())
            previous = result.hits[k]
    acceptance, length, rate = acceptance_summary(proposed, accepted, drafted)
    return Metrics(
        windows=windows,
        scored_positions=scored_positions,
        agreement=agree / scored_positions if scored_positions else 0.0,
        data_nll=nll_sum / scored_positions if scored_positions else float("nan"),
        draft_steps=draft_steps,
        proposed=proposed,
        accepted=accepted,
        acceptance=acceptance,
        mean_accept_length=length,
        accept_rate=rate,
        text=text,
        exact=text == SELF_GENERATED,
        drafted=drafted,
        data_matches_target=data_matches / scored_positions if scored_positions else 0.0,
        outside_support=outside,
    )


def batch_outcomes(results: list[BatchChain]) -> list[ChainOutcome]:
    outcomes = []
    for result in results:
        scorable = result.scored.sum(0)  # (B, T)
        accepted = result.hits.sum(0)
        for row, length in enumerate(result.lengths):
            outcomes.append(ChainOutcome(tuple(scorable[row, :length].tolist()), tuple(accepted[row, :length].tolist())))
    return outcomes


def chain_outcomes(base, head, windows, draft_steps: int = 3, windows_per_batch: int = 4) -> list[ChainOutcome]:
    """Per window and anchor: how many chained steps are scorable and how many were accepted.

    This is the evaluation of `evaluate_head` kept per anchor, so that it can be compared,
    decision by decision, with a decoder that drafted from some of the anchors.
    """
    return batch_outcomes(list(head_batches(base, head, windows, draft_steps, windows_per_batch)))


def batch_confidence(results: list) -> list[list[list[float]]]:
    """Per window: the head's top-1 probability [anchor][step k (0-based)] where it drafted (`BatchChain` or
    `BatchOdds`' confidence, which `head_batches` computes when asked)."""
    out = []
    for result in results:
        for row, length in enumerate(result.lengths):
            out.append(result.confidence[:, row, :length].T.tolist())
    return out


def batch_relaxed(results: list[BatchOdds]) -> list[list[list[float]]]:
    """Per window: the relaxed rule's expected acceptance [anchor][step k (0-based)] (`BatchOdds.relaxed`)."""
    return [result.relaxed[:, row, :length].T.tolist() for result in results for row, length in enumerate(result.lengths)]


def batch_odds(results: list[BatchOdds]) -> list[tuple[list[list[float]], list[list[float]]]]:
    """Per window: (given, expected), each a list over anchors of the K steps' odds."""
    out = []
    for result in results:
        for row, length in enumerate(result.lengths):
            out.append((result.given[:, row, :length].T.tolist(), result.expected[:, row, :length].T.tolist()))
    return out
