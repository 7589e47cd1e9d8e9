"""Offline evaluation of a head against the frozen base (docs/reference/CONTRACT.md section 4).

docs/guide/EVALUATION.md sets out the details.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from occamy_mtp import memory, sampling
from occamy_mtp.console import plural
from occamy_mtp.config import ConfigError, Serving
from occamy_mtp.evaluation.decode import Runners, decodes_runners, speculative_decode
from occamy_mtp.model.head import DEFAULT_LOGITS_CHUNK_TOKENS
from occamy_mtp.model.loss import IGNORE, chain_batch, collate
from occamy_mtp.model.sharding import Sharding, agreed_min
from occamy_mtp.run import HELDOUT, check_inputs, log_stderr, open_run, refuse_inside_models
from occamy_mtp.settings import EvalPlan, Measuring, Plan
from occamy_mtp.evaluation.metrics import (
    Acceptance,
    acceptance_from_counts,
    acceptance_summary,
    decoder_rounds,
    ExpectedCounts,
    expected_acceptance,
    per_context,
    expected_rounds,
    replayed_acceptance,
    replayed_counts,
    summed_acceptance,
    z_score,
)
from occamy_mtp.base.fastbase import token_bytes
from occamy_mtp.base.logits import chunked_greedy
from occamy_mtp.targets.base import base_outputs

TEACHER_FORCED = "teacher_forced"
SELF_GENERATED = "self_generated"
EVALUATION_FILE = "evaluation.json"
PLOT_FILE = "acceptance.png"
EVALUATION_FORMAT = 3  # 3: served figures per serving configuration
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


# ----------------------------------------------------------------------------------
# The offline chain
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _BatchChain:
    """One batch through base and head: which (step, anchor) pairs are scored and accepted."""

    scored: torch.Tensor  # (K, B, T) bool: step k at anchor i is scorable (step 1 scored, position inside the text)
    hits: torch.Tensor  # (K, B, T) bool: chained acceptance (steps 1..k all accepted)
    agree: int
    nll_sum: float
    data_matches: int
    lengths: list[int]


@dataclass(frozen=True)
class _BatchOdds:
    """One batch under sampled serving: per (step, anchor), the acceptance odds given the text."""

    scored: torch.Tensor  # (K, B, T) bool
    given: torch.Tensor  # (K, B, T) float64: P(step k accepted | steps before accepted, the text), beta
    expected: torch.Tensor  # (K, B, T) float64: sum_x min(p, q), alpha
    agree: int
    nll_sum: float
    data_matches: int
    outside: int
    lengths: list[int]


def _targets(base, batch):
    """The base's outputs over `batch`: from the base, or a target source (the offline cache) standing in for it."""
    if hasattr(base, "outputs"):
        return base.outputs(batch.input_ids, batch.attention_mask)
    return base_outputs(base, batch.input_ids, batch.attention_mask)


def _pass(base, head, windows, draft_steps: int, device, embed_text: bool = False):
    """The base's targets and the head's chain over one batch: (batch, targets, chain, hidden (K, B, T, D))."""
    batch = collate(windows, device)
    targets = _targets(base, batch)
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
def _run_batch(base, head, windows, draft_steps: int, device) -> _BatchChain:
    batch, targets, chain, hidden = _pass(base, head, windows, draft_steps, device)
    valid = chain.labels != IGNORE  # (K, B, T)
    first = valid[0]
    agree, nll_sum, data_matches = _step1_figures(head, hidden, chain)
    scored = valid & first
    hits = torch.zeros_like(scored)
    alive = first.clone()  # anchors whose chain is still accepted
    for k in range(draft_steps):
        proposing = alive & scored[k]
        if proposing.any():
            predicted = chunked_greedy(hidden[k][proposing], head.shared.lm_head)
            hits[k][proposing] = predicted == chain.labels[k][proposing]
        alive = hits[k]
    return _BatchChain(
        scored=scored,
        hits=hits,
        agree=agree,
        nll_sum=nll_sum,
        data_matches=data_matches,
        lengths=batch.lengths.tolist(),
    )


@torch.no_grad()
def _run_batch_sampled(base, head, windows, draft_steps: int, device, serving: Serving) -> _BatchOdds:
    """`_run_batch` under sampled serving: each scored (step, anchor) pair's odds given the text.

    Step k at anchor i predicts x_{i+k+1}: p is the base's processed distribution from
    H_{i+k}, q the head's under the draft rule; alpha = sum_x min(p, q), beta = min(p, q)(x) / p(x)
    at the text's token x = x_{i+k+1} (`occamy_mtp.sampling`). Steps k >= 2 embed the text's tokens.
    """
    batch, targets, chain, hidden = _pass(base, head, windows, draft_steps, device, embed_text=True)
    valid = chain.labels != IGNORE
    scored = valid & valid[0]
    agree, nll_sum, data_matches = _step1_figures(head, hidden, chain)
    given = torch.zeros(scored.shape, dtype=torch.float64)
    expected = torch.zeros(scored.shape, dtype=torch.float64)
    outside = 0
    starts = torch.tensor([w.answer_start for w in windows])
    for k in range(draft_steps):  # step k + 1
        rows, anchors = scored[k].nonzero(as_tuple=True)  # (N,), (N,)
        base_hidden = targets.hidden[rows, anchors + k + 1]  # (N, D): H_{i+k+1} predicts x_{i+k+2}, step k + 1's draft
        tokens = batch.input_ids[rows, anchors + k + 2]
        head_hidden = hidden[k][rows, anchors]
        alpha, beta = [], []
        positions = memory.logit_rows(head_hidden.device, head.vocab_size, ODDS_BYTES_PER_LOGIT, SAMPLED_CHUNK_TOKENS)
        for start in range(0, len(rows), positions):
            chunk = slice(start, start + positions)
            history = sampling.answer_histories(batch.input_ids, starts, rows[chunk], anchors[chunk] + k + 2) \
                if serving.penalized else None
            a, b, out = odds_of(head, base_hidden[chunk], head_hidden[chunk], tokens[chunk], serving, history)
            alpha.append(a)
            beta.append(b)
            outside += out
        if len(rows):
            where = (rows.cpu(), anchors.cpu())
            expected[k][where] = torch.cat(alpha)
            given[k][where] = torch.cat(beta)
    return _BatchOdds(scored.cpu(), given, expected, agree, nll_sum, data_matches, outside, batch.lengths.tolist())


def odds_of(head, base_hidden: torch.Tensor, head_hidden: torch.Tensor, tokens: torch.Tensor,
            serving: Serving, history: sampling.History | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(alpha, beta (N,) float64 on the CPU, tokens outside p's support) of N (step, anchor) pairs: one chunk.

    p is the base's processed distribution from `base_hidden` (the head's logits are the
    base's lm_head), its penalties over `history` (the answer before each drafted position and
    the prompt: given the text, the accepted drafts are the text's tokens); q the head's from
    `head_hidden`; `tokens` are the text's."""
    p = sampling.base_probs(head.logits(base_hidden), serving, history)
    q = sampling.head_probs(head.logits(head_hidden), serving)
    return (sampling.acceptance(p, q).double().cpu(), sampling.acceptance_given(p, q, tokens).double().cpu(),
            int(sampling.outside_support(p, tokens).sum()))


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


def _batches(base, head, windows, draft_steps: int, windows_per_batch: int, serving: Serving | None = None):
    """The batches' chains: `_BatchChain`s for greedy serving (None too), `_BatchOdds` for sampled."""
    device = head.fc.weight.device
    was_training = head.training
    head.eval()
    try:
        for part in window_batches(base, head, windows, draft_steps, windows_per_batch):
            if serving is None or serving.greedy:
                yield _run_batch(base, head, part, draft_steps, device)
            else:
                yield _run_batch_sampled(base, head, part, draft_steps, device, serving)
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
    return _metrics(list(_batches(base, head, windows, draft_steps, windows_per_batch)), len(windows), draft_steps, text)


def _metrics(results: list[_BatchChain | _BatchOdds], windows: int, draft_steps: int, text: str) -> Metrics:
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
        if isinstance(result, _BatchOdds):
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


def _outcomes(results: list[_BatchChain]) -> list[ChainOutcome]:
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
    return _outcomes(list(_batches(base, head, windows, draft_steps, windows_per_batch)))


def served_acceptance(base, head, windows, served_steps, max_new_tokens: int, windows_per_batch: int = 4,
                      serving: Serving | None = None) -> dict[int, Acceptance]:
    """What the reference speculative decoder measures at each served step count, on self-generated
    windows written under `serving` (None: greedy).

    Greedy: one offline chain pass gives every anchor's outcome (`chain_outcomes`); the
    decoder's walk is replayed from them (`metrics.decoder_rounds`), which on the base's own
    greedy text equals decoding every window's context with `decode.speculative_decode`
    under a budget of `max_new_tokens` (the one the continuations were written with).
    Sampled: the same pass gives each (step, anchor)'s odds given the text, and the figures
    are the decoder's expected counts on those texts (`metrics.expected_acceptance`). On
    text written any other way the figure means nothing.
    """
    results = list(_batches(base, head, windows, max(served_steps), windows_per_batch, serving))
    return _served(results, windows, served_steps, max_new_tokens)


def served_with_contexts(base, head, windows, served_steps, max_new_tokens: int, windows_per_batch: int = 4,
                         serving: Serving | None = None) -> dict[int, dict]:
    """`served_acceptance`'s figures as dicts, each with its counts per context (`metrics.per_context`),
    which a paired comparison of two heads on the same windows reads (`metrics.difference_noise`)."""
    results = list(_batches(base, head, windows, max(served_steps), windows_per_batch, serving))
    return _served_figures(_served_counts(results, windows, served_steps, max_new_tokens), windows)


def _served_figures(counts: dict[int, list[ExpectedCounts]], windows) -> dict[int, dict]:
    """Per served step count, the figures of `counts` summed over `windows` with their counts per context."""
    clusters = [context_key(w) for w in windows]
    return {k: {**summed_acceptance(c, k, clusters=clusters).to_dict(), "per_context": per_context(c, clusters, k)}
            for k, c in counts.items()}


def _served(results: list, windows, served_steps, max_new_tokens: int) -> dict[int, Acceptance]:
    counts = _served_counts(results, windows, served_steps, max_new_tokens)
    clusters = [context_key(w) for w in windows]
    return {k: summed_acceptance(c, k, clusters=clusters) for k, c in counts.items()}


def _served_counts(results: list, windows, served_steps, max_new_tokens: int) -> dict[int, list[ExpectedCounts]]:
    """Per served step count, the decoder's counts on each window's text (replayed, or expected under sampling)."""
    if results and isinstance(results[0], _BatchOdds):
        odds = _odds(results)
        return {k: [expected_rounds(given, expected, w.answer_start, max_new_tokens, k) for w, (given, expected) in zip(windows, odds)]
                for k in served_steps}
    outcomes = _outcomes(results)
    return {k: [replayed_counts(o.accepted, w.answer_start, max_new_tokens, k) for w, o in zip(windows, outcomes)]
            for k in served_steps}


def context_key(window) -> tuple[str, int]:
    """What identifies a window's context: its conversation and turn (its continuations share it)."""
    return window.conversation_hash, window.turn_index


# Context-length buckets of the served figures (`by_context`): [low, high) tokens of context a window holds.
CONTEXT_BUCKETS = (("<256", 0, 256), ("256-1k", 256, 1024), ("1k-4k", 1024, 4096), ("4k+", 4096, None))


def context_bucket(tokens: int) -> str:
    return next(name for name, low, high in CONTEXT_BUCKETS if tokens >= low and (high is None or tokens < high))


def grouped_acceptance(counts: dict[int, list[ExpectedCounts]], windows, group_of) -> dict[str, dict[str, dict]]:
    """The served figures of each group of windows (`group_of(window)`: its name, None for none), per step count."""
    names: dict[str, list[int]] = {}
    for index, window in enumerate(windows):
        name = group_of(window)
        if name is not None:
            names.setdefault(name, []).append(index)
    return {name: {str(k): summed_acceptance([c[i] for i in members], k, clusters=[context_key(windows[i]) for i in members])
                            .to_dict() for k, c in counts.items()}
            for name, members in names.items()}


def _odds(results: list[_BatchOdds]) -> list[tuple[list[list[float]], list[list[float]]]]:
    """Per window: (given, expected), each a list over anchors of the K steps' odds."""
    out = []
    for result in results:
        for row, length in enumerate(result.lengths):
            out.append((result.given[:, row, :length].T.tolist(), result.expected[:, row, :length].T.tolist()))
    return out


# ----------------------------------------------------------------------------------
# The ceiling: a perfect drafter
# ----------------------------------------------------------------------------------


@torch.no_grad()
def _ceiling_batch(targets, head, windows, device, serving: Serving) -> list[tuple[list[float], list[float]]]:
    """Per window of one batch, per position t of its text: (P(a perfect draft of x_t is accepted given
    the text, i.e. x_t is the base's own choice there), the expected acceptance of that draft, max p_t).

    The perfect drafter drafts argmax p_t, p_t being the base's distribution at t as `serving`
    processes it: greedy serving accepts it always (and the base's greedy text is that token), so
    both are 1 where the text is the base's greedy choice; sampled serving accepts it with p_t of it."""
    batch = collate(windows, device)
    outputs = _targets(targets, batch)
    ids = batch.input_ids
    given = torch.zeros(ids.shape, dtype=torch.float64)
    expected = torch.zeros(ids.shape, dtype=torch.float64)
    # Drafted positions only: a decoder's first draft predicts the answer's second token.
    wanted = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    for row, (window, length) in enumerate(zip(windows, batch.lengths.tolist())):
        wanted[row, window.answer_start + 1 : length] = True
    rows, positions = wanted.nonzero(as_tuple=True)  # (N,), (N,): x_t predicted from H_{t-1}
    if serving.greedy:
        hit = (outputs.greedy[rows, positions - 1] == ids[rows, positions]).double().cpu()
        given[rows.cpu(), positions.cpu()] = hit
        expected[rows.cpu(), positions.cpu()] = hit
    else:
        chunk = memory.logit_rows(ids.device, head.vocab_size, ODDS_BYTES_PER_LOGIT, SAMPLED_CHUNK_TOKENS)
        starts = torch.tensor([w.answer_start for w in windows])
        for start in range(0, len(rows), chunk):
            part = slice(start, start + chunk)
            history = sampling.answer_histories(ids, starts, rows[part], positions[part]) if serving.penalized else None
            p = sampling.base_probs(head.logits(outputs.hidden[rows[part], positions[part] - 1]), serving, history)  # (n, V)
            best, choice = p.max(-1)
            where = (rows[part].cpu(), positions[part].cpu())
            given[where] = (choice == ids[rows[part], positions[part]]).double().cpu()
            expected[where] = best.double().cpu()
    return [(given[row, :length].tolist(), expected[row, :length].tolist())
            for row, length in enumerate(batch.lengths.tolist())]


def ceiling_acceptance(targets, head, windows, served_steps, max_new_tokens: int, windows_per_batch: int = 4,
                       serving: Serving | None = None) -> dict[int, Acceptance]:
    """What the decoder would measure, at each served step count, with a perfect drafter on the same
    texts as `served_acceptance`: one that drafts the base's own choice (argmax of its processed
    distribution) at every step, the expectation exact under `serving`. Greedy: every draft inside
    the budget is accepted, so the accept length is K + 1 but for the texts' ends. `head` lends only
    the base's lm_head (its logits); the figure is the base's and the serving configuration's."""
    serving = serving or Serving()
    device = head.fc.weight.device
    texts = []
    for part in window_batches(targets, head, windows, 0, windows_per_batch):
        for window, (hit, best) in zip(part, _ceiling_batch(targets, head, part, device, serving)):
            texts.append((_by_anchor(hit, max(served_steps)), _by_anchor(best, max(served_steps)), window.answer_start))
    clusters = [context_key(w) for w in windows]
    return {k: expected_acceptance(texts, max_new_tokens, k, clusters=clusters) for k in served_steps}


def _by_anchor(values: list[float], steps: int) -> list[list[float]]:
    """Per-position odds as `expected_rounds` reads them: [anchor a][step k (0-based)] is position a + k + 2's."""
    return [[values[a + k + 2] if a + k + 2 < len(values) else 0.0 for k in range(steps)] for a in range(len(values))]


def ceiling_report(targets, head, heldout: dict[str, list], servings, served_steps, max_new_tokens: int,
                   windows_per_batch: int = 4) -> dict:
    """Per serving configuration (its label), per served step count: the perfect drafter's figures
    (`ceiling_acceptance`) on the heldout windows the base wrote under it."""
    return {serving.label(): {str(k): a.to_dict() for k, a in ceiling_acceptance(
                targets, head, heldout[serving.label()], served_steps, max_new_tokens, windows_per_batch, serving).items()}
            for serving in servings}


def share_of_ceiling(donor: float, trained: float, ceiling: float) -> float | None:
    """How much of the way from the donor's accept length to the ceiling's the trained head went
    (1: all of it, 0: none, below 0: it lost ground); None where the donor is at the ceiling."""
    room = ceiling - donor
    return (trained - donor) / room if room > 1e-12 else None


def heldout_report(targets, head, heldout: dict[str, list], recorded, servings, served_steps, draft_steps: int,
                   max_new_tokens: int, windows_per_batch: int = 4, domains: dict[str, dict] | None = None) -> dict:
    """Every heldout figure of one head, from one pass over each set of windows.

    * `serving`: per serving configuration (its label; `heldout` holds the windows the base
      wrote under each):
      * `served`: per served step count, what the reference speculative decoder measures
        there (decoder replay, or its expectation under sampling; exact): the headline, with
        the counts per context (`per_context`) that a paired comparison of two heads reads;
      * `every_anchor`: the chain over every anchor of the same text (exact, but another
        sample than the decoder's anchors);
      * `by_context`: the served figures by the context's length (`CONTEXT_BUCKETS`, those the
        windows reach);
      * `by_file`, `by_category`: the served figures by the data file a conversation came from and
        by its record's `category` (`domains`: conversation hash -> {file, category}; records
        without a category are left out of `by_category`, empty when none has one);
    * `teacher_forced`: agreement, NLL and the greedy chain on the recorded answers
      (`recorded`); the acceptance there is an approximation, and has pointed the wrong
      way. None when no heldout window has a recorded answer (a prompt set).
    """
    steps = max(draft_steps, *served_steps)
    by_serving = {}
    for serving in servings:
        windows = heldout[serving.label()]
        results = list(_batches(targets, head, windows, steps, windows_per_batch, serving))
        counts = _served_counts(results, windows, served_steps, max_new_tokens)
        domain = (domains or {}).get
        by_serving[serving.label()] = {
            "settings": asdict(serving),
            "served": {str(k): figures for k, figures in _served_figures(counts, windows).items()},
            "every_anchor": _metrics(results, len(windows), steps, SELF_GENERATED).to_dict(),
            "by_context": grouped_acceptance(counts, windows, lambda w: context_bucket(w.answer_start)),
            "by_file": grouped_acceptance(counts, windows, lambda w: (domain(w.conversation_hash) or {}).get("file")),
            "by_category": grouped_acceptance(counts, windows, lambda w: (domain(w.conversation_hash) or {}).get("category") or None),
        }
    return {
        "serving": by_serving,
        "teacher_forced": evaluate_head(targets, head, recorded, steps, windows_per_batch, TEACHER_FORCED).to_dict()
        if recorded else None,
    }


# ----------------------------------------------------------------------------------
# The reference decoder
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredText:
    """What a speculative decoder (the reference one, or an engine) wrote from one context, and what it counted."""

    window: object
    """`data.Window`: the context followed by what was written (`answer_start`: the context's length)."""
    accepted: tuple[float, ...]
    """Per step k: rounds in which steps 1..k were accepted."""
    proposed: tuple[float, ...]
    """Per step k: rounds in which step k was drafted (steps before it accepted)."""
    drafted: float
    passes: float
    """Base passes after the prefill: verify passes (and plain steps)."""

    @classmethod
    def decoded(cls, window, result) -> "MeasuredText":
        """What the reference decoder wrote from `window`'s context and counted (`decode.DecodeResult`)."""
        return cls(replace(window, input_ids=result.text_ids), result.accepted, result.proposed, result.drafted,
                   result.base_passes)


def measured_totals(measured: list[MeasuredText], draft_steps: int) -> Acceptance:
    """The figures of what a decoder counted over its texts, summed as an engine's counters sum them."""
    return acceptance_from_counts(
        draft_steps, len(measured), [sum(values) for values in zip(*(m.proposed for m in measured))],
        [sum(values) for values in zip(*(m.accepted for m in measured))], sum(m.drafted for m in measured),
        sum(m.passes for m in measured), totals_generated(measured),
    )


def totals_generated(measured: list[MeasuredText]) -> int:
    """Generated tokens after each text's first: what tokens per verify pass divides."""
    return sum(len(m.window.input_ids) - m.window.answer_start - 1 for m in measured)


def reference_decoder_check(base, head, windows, draft_steps: int, max_new_tokens: int, stop_token_ids,
                            windows_per_batch: int = 4, runners: Runners | None = None) -> dict:
    """Decode each window's context with the reference speculative decoder and replay it offline.

    `measured` is what the decoder counted. `replayed` is `metrics.replayed_acceptance`
    from the offline chain on the text the decoder wrote: equal to `measured` unless a
    floating-point near-tie resolved differently in the incremental and the
    full-sequence pass; `decisions_equal` of `decisions` counts the decoder's rounds
    whose accepted drafts the replay reproduces at the same anchor. `texts_equal` counts
    decoded texts identical to the given windows: where those are self-generated (a
    run's store), that checks the stored continuations against the decoder.
    `offline_all_anchors` is the per-anchor figure over every anchor of the same text:
    another sample than the decoder's, which drafts only where a verification lands.
    `runners` (`decode.decodes_runners`, for at least `draft_steps`) are the decodes' runners
    when several checks share them; `decode_seconds` of `seconds` were the decodes.
    """
    started = time.perf_counter()
    prompts = [list(w.input_ids[: w.answer_start]) for w in windows]
    runners = runners or decodes_runners(base, head, [len(p) for p in prompts], max_new_tokens, draft_steps)
    results = [speculative_decode(base, head, p, max_new_tokens, draft_steps, stop_token_ids, runners=runners) for p in prompts]
    decode_seconds = time.perf_counter() - started
    texts = [MeasuredText.decoded(w, r) for w, r in zip(windows, results)]
    decoded = [text.window for text in texts]
    chains = list(_batches(base, head, decoded, draft_steps, windows_per_batch))  # one offline pass: replay and figures
    outcomes = _outcomes(chains)
    decisions = equal = 0
    for result, outcome in zip(results, outcomes):
        rounds, _ = decoder_rounds(outcome.accepted, len(result.prompt_ids), max_new_tokens, draft_steps)
        replayed_at = {r.anchor: r.accepted for r in rounds}
        decisions += len(result.rounds)
        equal += sum(replayed_at.get(r.anchor) == r.accepted for r in result.rounds)
    measured = measured_totals(texts, draft_steps)
    replayed = replayed_acceptance([(o.accepted, len(r.prompt_ids)) for r, o in zip(results, outcomes)], max_new_tokens, draft_steps)
    return {
        "windows": len(windows),
        "draft_steps": draft_steps,
        "max_new_tokens": max_new_tokens,
        "measured": {**measured.to_dict(), "output_tokens": sum(len(r.output_ids) for r in results)},
        "replayed": replayed.to_dict(),
        "decisions": decisions,
        "decisions_equal": equal,
        "texts_equal": sum(d.input_ids == w.input_ids for d, w in zip(decoded, windows)),
        "offline_all_anchors": _metrics(chains, len(decoded), draft_steps, SELF_GENERATED).to_dict(),
        "seconds": time.perf_counter() - started,
        "decode_seconds": decode_seconds,
    }


def sampled_decodes(base, head, windows, draft_steps: int, max_new_tokens: int, stop_token_ids, serving: Serving,
                    seeds, runners: Runners | None = None) -> list[MeasuredText]:
    """Each window's context decoded once per seed by the reference decoder under sampled `serving`
    (`runners` as in `reference_decoder_check`)."""
    runners = runners or decodes_runners(base, head, [w.answer_start for w in windows], max_new_tokens, draft_steps)
    decodes = []
    for window in windows:
        prompt = list(window.input_ids[: window.answer_start])
        for seed in seeds:
            result = speculative_decode(base, head, prompt, max_new_tokens, draft_steps, stop_token_ids, serving=serving, seed=seed,
                                        runners=runners)
            decodes.append(MeasuredText.decoded(window, result))
    return decodes


def sampled_decoder_check(base, head, measured: list[MeasuredText], draft_steps: int, max_new_tokens: int,
                          serving: Serving, windows_per_batch: int = 4) -> dict:
    """A decoder's counts on texts it wrote under sampled `serving` (`sampled_decodes`, or an engine's)
    beside their expectation given each text.

    Given the text, the decoder's counts are random with the expectation `metrics.expected_rounds`
    computes from the offline pass over that text, so over the texts the differences
    (measured - expected) are independent with mean 0: their mean over its standard error is a
    z-score. `z` holds it for the accepted drafts and for the verify passes; |z| beyond about 4.5
    says that the decoder and the library's arithmetic disagree (a chance of 7e-6 when they agree).
    Under greedy drafts the walk given the text is certain, so every text's verify passes
    equal their expectation and that z is 0.
    """

    started = time.perf_counter()
    odds = _odds(list(_batches(base, head, [m.window for m in measured], draft_steps, windows_per_batch, serving)))
    counts = [expected_rounds(given, expected, text.window.answer_start, max_new_tokens, draft_steps)
              for text, (given, expected) in zip(measured, odds)]
    differences = {"accepted": [sum(text.accepted) - sum(c.accepted) for text, c in zip(measured, counts)],
                   "verify_passes": [text.passes - c.passes for text, c in zip(measured, counts)]}
    totals = measured_totals(measured, draft_steps)
    return {
        "serving": serving.label(),
        "decodes": len(measured),
        "draft_steps": draft_steps,
        "max_new_tokens": max_new_tokens,
        "measured": totals.to_dict(),
        "expected": summed_acceptance(counts, draft_steps, totals_generated(measured)).to_dict(),
        "z": {name: z_score(values) for name, values in differences.items()},
        "largest_passes_difference": max(abs(d) for d in differences["verify_passes"]),
        "seconds": time.perf_counter() - started,
    }


# ----------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------


def format_table(results: dict[str, dict]) -> str:
    """A side-by-side table of metrics dicts (`Metrics.to_dict()`), one column per head."""
    names = list(results)
    first = results[names[0]]
    rows = [
        ("target top-1 agreement", [f"{m['agreement']:.2%}" for m in results.values()]),
        ("data-answer NLL", [f"{m['data_nll']:.4f}" for m in results.values()]),
    ]
    for k in range(first["draft_steps"]):
        rows.append((
            f"acceptance step {k + 1}",
            [f"{m['acceptance'][k]:.2%} ({m['accepted'][k]}/{m['proposed'][k]})" for m in results.values()],
        ))
    rows.append(("mean accept length", [f"{m['mean_accept_length']:.3f}" for m in results.values()]))
    rows.append(("accept rate", [f"{m['accept_rate']:.2%}" for m in results.values()]))
    if first["exact"]:
        kind = "exact (the base's own greedy text)"
    else:
        kind = f"approximate (teacher-forced data; data token = greedy target at {first['data_matches_target']:.1%} of positions)"
    width = max(22, *(len(v) for _, values in rows for v in values)) + 2
    lines = [
        f"{first['windows']} windows, {first['scored_positions']} scored positions, {first['draft_steps']} chained steps",
        f"acceptance is {kind}",
        f"{'metric':<24}" + "".join(f"{name:>{width}}" for name in names),
    ]
    lines += [f"{label:<24}" + "".join(f"{v:>{width}}" for v in values) for label, values in rows]
    return "\n".join(lines)


def with_error(figures: dict) -> str:
    """A mean accept length with its standard error, when it has one."""
    se = figures.get("mean_accept_length_se", 0.0)
    return f"{figures['mean_accept_length']:.3f}" + (f" ± {se:.3f}" if se else "")


def _short_group(name: str, limit: int = 18) -> str:
    """A group's name in a table row: a file by its last part, anything longer than `limit` cut."""
    name = name.rsplit("/", 1)[-1]
    return name if len(name) <= limit else name[: limit - 3] + "..."


def format_served(reports: dict[str, dict], servings, served_steps, max_new_tokens: int, selected: str | None = None,
                  ceiling: dict | None = None) -> str:
    """The headline of `heldout_report`s side by side, one column per head: per serving
    configuration and served step count, each step's acceptance, the mean accept length and
    the tokens per verify pass; `selected` (a configuration's label) is marked. With `ceiling`
    (`ceiling_report`) a last column gives a perfect drafter's figures, and a row each head's
    share of the way from the donor to them."""
    names = list(reports)
    columns = names + (["ceiling"] if ceiling else [])
    first = reports[names[0]]["serving"][servings[0].label()]["served"][str(served_steps[0])]
    width = 18
    lines = [
        "served acceptance (exact): the reference speculative decoder on the base's own continuation of "
        f"{first['texts']} heldout {plural(first['texts'], 'prompt')} (<= {max_new_tokens} new tokens each), per serving configuration: greedy "
        "(decoder replay), sampled (the decoder's expected counts given each of the base's sampled continuations); "
        "± one standard error over contexts",
        f"  {'':<48}" + "".join(f"{name:>{width}}" for name in columns),
    ]
    for serving in servings:
        label = serving.label()
        mark = " (selected)" if label == selected and len(servings) > 1 else ""
        penalties = "".join(f", {name.replace('_', ' ')} {getattr(serving, name):g}" for name, none in (
            ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)) if getattr(serving, name) != none)
        shown = reports[names[0]]["serving"][label]["served"][str(served_steps[0])]
        continuations = (f", {shown['texts'] // max(1, shown['contexts'])} continuations a context"
                         if shown.get("contexts") and shown["texts"] > shown["contexts"] else "")
        lines.append(f"  {label}{mark}: temperature {serving.temperature:g}, top_p {serving.top_p:g}, top_k {serving.top_k}"
                     f"{penalties}, thinking {'on' if serving.thinking else 'off'}, {serving.draft} drafts{continuations}")
        for k in served_steps:
            figures = [reports[name]["serving"][label]["served"][str(k)] for name in names]
            figures += [ceiling[label][str(k)]] if ceiling else []
            for j in range(k):
                lines.append(f"    {f'{k}-step drafts: step {j + 1} acceptance':<46}"
                             + "".join(f"{f['acceptance'][j]:>{width}.2%}" for f in figures))
            lines.append(f"    {f'{k}-step drafts: mean accept length':<46}" + "".join(f"{with_error(f):>{width}}" for f in figures))
            lines.append(f"    {f'{k}-step drafts: tokens per verify pass':<46}"
                         + "".join(f"{f['tokens_per_verify_pass']:>{width}.3f}" for f in figures))
            if ceiling and "donor" in reports:
                top, base = ceiling[label][str(k)]["mean_accept_length"], figures[names.index("donor")]["mean_accept_length"]
                shares = [share_of_ceiling(base, f["mean_accept_length"], top) for f in figures[: len(names)]]
                lines.append(f"    {f'{k}-step drafts: share of donor -> ceiling':<46}"
                             + "".join(f"{'-' if v is None or name == 'donor' else format(v, '.1%'):>{width}}"
                                       for name, v in zip(names, shares)))
        k = max(served_steps)
        for key, what in (("by_context", "context"), ("by_file", "file"), ("by_category", "category")):
            groups = reports[names[0]]["serving"][label].get(key) or {}
            if len(groups) < 2 and key != "by_category" or not groups:
                continue  # one group is the whole
            for group in groups:
                cells = [reports[name]["serving"][label][key].get(group, {}).get(str(k)) for name in names]
                count = next((c["contexts"] for c in cells if c), 0)
                title = f"{k}-step accept length, {what} {_short_group(group)} ({count})"
                lines.append(f"    {title:<46}" + "".join(f"{with_error(c) if c else '-':>{width}}" for c in cells))
    def recorded(field: str, form: str):
        return lambda r: "absent" if r["teacher_forced"] is None else format(r["teacher_forced"][field], form)

    rows = [
        ("target top-1 agreement (recorded answers)", recorded("agreement", ".2%")),
        ("data-answer NLL (recorded answers)", recorded("data_nll", ".4f")),
        ("accept length, teacher-forced (approx.)", recorded("mean_accept_length", ".3f")),
    ]
    rows += [(f"accept length, every anchor ({serving.label()})",
              lambda r, label=serving.label(): f"{r['serving'][label]['every_anchor']['mean_accept_length']:.3f}")
             for serving in servings]
    lines.append("secondary: the recorded answers, teacher forced (acceptance approximate), and every anchor of the self-generated text")
    lines += [f"  {label:<46}" + "".join(f"{cell(reports[name]):>{width}}" for name in names) for label, cell in rows]
    return "\n".join(lines)


def evaluate_run(plan: Plan, head_path: Path, out: Path, device: torch.device, *, teacher_forced_only: bool = False,
                 reference_decoder: bool = False, max_windows: int | None = None, decoder_seeds: int = 4,
                 sharding: Sharding | None = None) -> tuple[dict, str]:
    """Donor (`model.donor_head`) and the head at `head_path` on the run's heldout windows; writes
    evaluation.json and the plot into `out`, returns the report and its printed table. `sharding`:
    the frozen base's placement (`model.sharding`)."""
    from occamy_mtp.model import checkpoint as ckpt_io

    setup, settings = plan.setup, plan.evaluate
    measuring = settings.measuring
    if reference_decoder and setup.data.target_cache:
        raise ConfigError("--reference-decoder decodes with the base, which data.target_cache leaves unloaded; unset it")
    penalized = [s.label() for s in measuring.servings if s.penalized]
    if reference_decoder and penalized:
        raise ConfigError(f"--reference-decoder samples without penalties, and eval.serving's {', '.join(penalized)} "
                          "set some; leave those out of eval.serving for the decoder check")
    facts = check_inputs(setup)
    refuse_inside_models(setup.model, [("--out", out)])
    ckpt_io.check_head(head_path, facts.text_config)  # before the base loads (load_head checks it again)
    run = open_run(setup, device, base=facts, log=log_stderr, splits=(HELDOUT,), self_generated=not teacher_forced_only,
                   max_heldout=max_windows, sharding=sharding)
    return evaluate(run, settings, head_path, out, device, teacher_forced_only=teacher_forced_only,
                    reference_decoder=reference_decoder, decoder_seeds=decoder_seeds)


def evaluate(run, settings: EvalPlan, head_path: Path, out: Path, device: torch.device, *, teacher_forced_only: bool = False,
             reference_decoder: bool = False, decoder_seeds: int = 4) -> tuple[dict, str]:
    """Donor and the head at `head_path` on an opened run's heldout windows (`evaluate_run` opens it);
    writes evaluation.json and the plot into `out`, returns the report and its printed table."""
    from occamy_mtp.model import checkpoint as ckpt_io
    from occamy_mtp.files import write_json
    from occamy_mtp.evaluation.plot import plot_acceptance, plot_served

    measuring = settings.measuring
    dtype = ckpt_io.DTYPES[settings.dtype]
    donor = run.models.head
    for param in donor.parameters():  # as served: every tensor in the model dtype
        param.data = param.data.to(dtype)
    trained = ckpt_io.load_head(head_path, run.base_facts.text_config, donor.shared, dtype=dtype, device=device,
                                attn_implementation=settings.attn_implementation)[0]
    heads = {"donor": donor, "trained": trained}
    steps, served_steps, budget = measuring.draft_steps, measuring.served_steps, measuring.answer_tokens
    per_batch = measuring.windows_per_batch

    started = time.perf_counter()
    report = {
        "format": EVALUATION_FORMAT,
        "inputs": {"base": settings.inputs["base"], "head": str(head_path), "donor": settings.inputs["donor"],
                   "data": settings.inputs["data"], "dtype": settings.dtype, "device": str(device)},
        "dataset": {k: v for k, v in run.data.provenance().items() if k in ("files", "windows", "settings")},
        "heldout_windows_evaluated": len(run.windows.heldout_data),
        "plot": PLOT_FILE,
    }
    out.mkdir(parents=True, exist_ok=True)
    if teacher_forced_only:
        if not run.windows.heldout_data:
            raise ConfigError("--teacher-forced-only: no heldout window has a recorded answer (the data are prompts); "
                              "evaluate without it, on the base's own answers")
        results = {}
        for name, head in heads.items():
            log_stderr(f"evaluate: teacher-forced chains of the {name} head on {len(run.windows.heldout_data)} heldout "
                       f"{plural(len(run.windows.heldout_data), 'window')}")
            results[name] = evaluate_head(run.targets, head, run.windows.heldout_data, steps, per_batch).to_dict()
        report.update(text=TEACHER_FORCED, exact=False, draft_steps=steps, heads=results)
        plot_acceptance(results, out / PLOT_FILE, title="Drafts accepted at each step, on the recorded answers (teacher-forced, approximate)")
        printed = format_table(results)
    else:
        servings, selected = measuring.servings, measuring.selected.label()
        results = {}
        log_stderr("evaluate: the ceiling, a drafter of the base's own choices, under each serving configuration")
        ceiling = ceiling_report(run.targets, donor, run.windows.heldout, servings, served_steps, budget, per_batch)
        count = len(next(iter(run.windows.heldout.values())))
        for name, head in heads.items():
            log_stderr(f"evaluate: measuring the {name} head on {count} heldout {plural(count, 'window')} under "
                       f"{len(servings)} serving {plural(len(servings), 'configuration')}")
            results[name] = heldout_report(run.targets, head, run.windows.heldout, run.windows.heldout_data, servings,
                                           served_steps, steps, budget, per_batch, run.data.domains)
        report.update(
            text=SELF_GENERATED, exact=True, headline="served", serving=[{"label": s.label(), **asdict(s)} for s in servings],
            selected_serving=selected, served_steps=list(served_steps), max_new_tokens=budget, heads=results, ceiling=ceiling,
            self_generated={"stores": run.windows.self_generated, "max_new_tokens": budget,
                            "stop_token_ids": sorted(run.stop_token_ids), "batch_size": settings.self_generate_batch_size},
        )
        plot_served({"serving": report["serving"], "served_steps": list(served_steps), "selected_serving": selected,
                     "heldout": results, "ceiling": ceiling}, out / PLOT_FILE)
        printed = format_served(results, servings, served_steps, budget, selected, ceiling)
        if reference_decoder:
            shared = decodes_runners(run.models.base, next(iter(heads.values())),
                                     [w.answer_start for s in servings for w in run.windows.heldout[s.label()]], budget, max(served_steps))
            runners = {name: shared.with_head(head) for name, head in heads.items()}  # one base runner, a head runner each
            report["reference_decoder"] = {
                name: {serving.label(): {str(k): _decoder_check(run, measuring, head, serving, k, range(decoder_seeds), runners[name])
                                         for k in served_steps}
                       for serving in servings}
                for name, head in heads.items()
            }
            printed += _format_decoder_checks(report["reference_decoder"])
    report["eval_seconds"] = time.perf_counter() - started
    write_json(out / EVALUATION_FILE, report)
    return report, printed


def _decoder_check(run, measuring: Measuring, head, serving: Serving, draft_steps: int, seeds, runners: Runners) -> dict:
    """The reference decoder on the run's heldout prompts under one serving configuration."""
    windows = distinct_contexts(run.windows.heldout[serving.label()])
    decodes = len(windows) * (1 if serving.greedy else len(seeds))
    log_stderr(f"evaluate: reference decoder, {serving.label()}, {draft_steps}-step drafts: {decodes} "
               f"{plural(decodes, 'decode')}")
    if serving.greedy:
        return reference_decoder_check(run.models.base, head, windows, draft_steps, measuring.answer_tokens,
                                       run.stop_token_ids, measuring.windows_per_batch, runners)
    started = time.perf_counter()
    decodes = sampled_decodes(run.models.base, head, windows, draft_steps, measuring.answer_tokens, run.stop_token_ids,
                              serving, seeds, runners)
    check = sampled_decoder_check(run.models.base, head, decodes, draft_steps, measuring.answer_tokens, serving,
                                  measuring.windows_per_batch)
    return {**check, "windows": len(windows), "seeds": len(seeds), "seconds": time.perf_counter() - started}


def distinct_contexts(windows) -> list:
    """The first window of each context (`context_key`), in order: a sampled configuration's windows hold
    several continuations of each prompt, and a decoder starts from the prompt alone."""
    seen, out = set(), []
    for window in windows:
        if context_key(window) not in seen:
            seen.add(context_key(window))
            out.append(window)
    return out


def _format_decoder_checks(checks_by_head: dict) -> str:
    lines = []
    for name, by_serving in checks_by_head.items():
        for label, checks in by_serving.items():
            for k, check in checks.items():
                measured = check["measured"]
                head = (f"\nreference decoder ({name}, {label}, {k}-step): accept length {measured['mean_accept_length']:.3f}, "
                        f"{measured['tokens_per_verify_pass']:.3f} tokens per verify pass; ")
                if "replayed" in check:
                    equal = all(measured[f] == check["replayed"][f] for f in ("proposed", "accepted", "drafted", "verify_passes"))
                    lines.append(head + f"replayed counts {'equal' if equal else 'DIFFER'}; {check['decisions_equal']}/"
                                 f"{check['decisions']} decisions equal; {check['texts_equal']}/{check['windows']} texts equal")
                else:
                    lines.append(head + f"expected {check['expected']['mean_accept_length']:.3f} over its {check['decodes']} "
                                 f"decodes; z of accepted drafts {check['z']['accepted']:+.2f}, of verify passes "
                                 f"{check['z']['verify_passes']:+.2f}")
    return "".join(lines)
