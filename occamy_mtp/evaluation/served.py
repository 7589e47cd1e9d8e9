"""Served figures: the decoder's walk over the base's own text, by configuration, by group and against the ceiling.

`served_acceptance` replays (greedy) or takes the expectation of (sampled) the speculative
decoder's walk over each heldout continuation; `grouped_acceptance` splits it by domain or
context length; `ceiling_acceptance` is a perfect drafter's on the same texts; `heldout_report`
puts a head's together (docs/reference/METRICS.md).
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from occamy_mtp import memory, sampling
from occamy_mtp.config import Serving
from occamy_mtp.model.loss import collate
from occamy_mtp.evaluation.metrics import (Acceptance, ExpectedCounts, expected_acceptance, per_context,
                                           expected_rounds, replayed_counts, summed_acceptance)
from occamy_mtp.evaluation.offline import (ODDS_BYTES_PER_LOGIT, SAMPLED_CHUNK_TOKENS, SELF_GENERATED, TEACHER_FORCED,
                                           BatchOdds, head_batches, batch_metrics, batch_odds, batch_outcomes, batch_targets, evaluate_head,
                                           window_batches)


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
    results = list(head_batches(base, head, windows, max(served_steps), windows_per_batch, serving))
    return _served(results, windows, served_steps, max_new_tokens)


def served_with_contexts(base, head, windows, served_steps, max_new_tokens: int, windows_per_batch: int = 4,
                         serving: Serving | None = None) -> dict[int, dict]:
    """`served_acceptance`'s figures as dicts, each with its counts per context (`metrics.per_context`),
    which a paired comparison of two heads on the same windows reads (`metrics.difference_noise`)."""
    results = list(head_batches(base, head, windows, max(served_steps), windows_per_batch, serving))
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
    if results and isinstance(results[0], BatchOdds):
        odds = batch_odds(results)
        return {k: [expected_rounds(given, expected, w.answer_start, max_new_tokens, k) for w, (given, expected) in zip(windows, odds)]
                for k in served_steps}
    outcomes = batch_outcomes(results)
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


@torch.no_grad()
def _ceiling_batch(targets, head, windows, device, serving: Serving) -> list[tuple[list[float], list[float]]]:
    """Per window of one batch, per position t of its text: (P(a perfect draft of x_t is accepted given
    the text, i.e. x_t is the base's own choice there), the expected acceptance of that draft, max p_t).

    The perfect drafter drafts argmax p_t, p_t being the base's distribution at t as `serving`
    processes it: greedy serving accepts it always (and the base's greedy text is that token), so
    both are 1 where the text is the base's greedy choice; sampled serving accepts it with p_t of it."""
    batch = collate(windows, device)
    outputs = batch_targets(targets, batch)
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
        results = list(head_batches(targets, head, windows, steps, windows_per_batch, serving))
        counts = _served_counts(results, windows, served_steps, max_new_tokens)
        domain = (domains or {}).get
        by_serving[serving.label()] = {
            "settings": asdict(serving),
            "served": {str(k): figures for k, figures in _served_figures(counts, windows).items()},
            "every_anchor": batch_metrics(results, len(windows), steps, SELF_GENERATED).to_dict(),
            "by_context": grouped_acceptance(counts, windows, lambda w: context_bucket(w.answer_start)),
            "by_file": grouped_acceptance(counts, windows, lambda w: (domain(w.conversation_hash) or {}).get("file")),
            "by_category": grouped_acceptance(counts, windows, lambda w: (domain(w.conversation_hash) or {}).get("category") or None),
        }
    return {
        "serving": by_serving,
        "teacher_forced": evaluate_head(targets, head, recorded, steps, windows_per_batch, TEACHER_FORCED).to_dict()
        if recorded else None,
    }


def distinct_contexts(windows) -> list:
    """The first window of each context (`context_key`), in order: a sampled configuration's windows hold
    several continuations of each prompt, and a decoder starts from the prompt alone."""
    seen, out = set(), []
    for window in windows:
        if context_key(window) not in seen:
            seen.add(context_key(window))
            out.append(window)
    return out
