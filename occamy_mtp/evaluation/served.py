"""Served figures: the decoder's walk over the base's own text, by configuration, by group and against the ceiling.

`served_acceptance` replays (greedy) or takes the expectation of (sampled) the speculative
decoder's walk over each heldout continuation; `grouped_acceptance` splits it by domain or
context length; `ceiling_acceptance` is a perfect drafter's on the same texts; `heldout_report`
puts a head's together (docs/reference/METRICS.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from occamy_mtp import memory, sampling
from occamy_mtp.config import Serving
from occamy_mtp.model.loss import collate
from occamy_mtp.evaluation.breakdown import TextOdds, breakdown, context_bucket, greedy_odds, reasoning_end
from occamy_mtp.evaluation.metrics import (Acceptance, ExpectedCounts, expected_acceptance, per_context,
                                           expected_rounds, replayed_counts, summed_acceptance)
from occamy_mtp.evaluation.offline import (ODDS_BYTES_PER_LOGIT, SAMPLED_CHUNK_TOKENS, SELF_GENERATED, TEACHER_FORCED,
                                           BatchOdds, head_batches, batch_confidence, batch_metrics, batch_odds, batch_relaxed,
                                           batch_outcomes, batch_targets, evaluate_head, window_batches)


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
    return _served(per_text(results), windows, served_steps, max_new_tokens)


def served_with_contexts(base, head, windows, served_steps, max_new_tokens: int, windows_per_batch: int = 4,
                         serving: Serving | None = None) -> dict[int, dict]:
    """`served_acceptance`'s figures as dicts, each with its counts per context (`metrics.per_context`),
    which a paired comparison of two heads on the same windows reads (`metrics.difference_noise`)."""
    results = list(head_batches(base, head, windows, max(served_steps), windows_per_batch, serving))
    return _served_figures(_served_counts(per_text(results), windows, served_steps, max_new_tokens), windows)


def _served_figures(counts: dict[int, list[ExpectedCounts]], windows) -> dict[int, dict]:
    """Per served step count, the figures of `counts` summed over `windows` with their counts per context."""
    clusters = [context_key(w) for w in windows]
    return {k: {**summed_acceptance(c, k, clusters=clusters).to_dict(), "per_context": per_context(c, clusters, k)}
            for k, c in counts.items()}


def _served(texts: list, windows, served_steps, max_new_tokens: int) -> dict[int, Acceptance]:
    counts = _served_counts(texts, windows, served_steps, max_new_tokens)
    clusters = [context_key(w) for w in windows]
    return {k: summed_acceptance(c, k, clusters=clusters) for k, c in counts.items()}


def per_text(results: list) -> list:
    """A head's pass (`head_batches`' results) per window: its odds (given, expected) under sampling, its
    chain's outcome (`ChainOutcome`) under greedy serving; read once, by the served figures and the breakdown."""
    return batch_odds(results) if results and isinstance(results[0], BatchOdds) else batch_outcomes(results)


def _served_counts(texts: list, windows, served_steps, max_new_tokens: int) -> dict[int, list[ExpectedCounts]]:
    """Per served step count, the decoder's counts on each window's text (`per_text`: replayed, or expected under sampling)."""
    if texts and isinstance(texts[0], tuple):
        return {k: [expected_rounds(given, expected, w.answer_start, max_new_tokens, k) for w, (given, expected) in zip(windows, texts)]
                for k in served_steps}
    return {k: [replayed_counts(o.accepted, w.answer_start, max_new_tokens, k) for w, o in zip(windows, texts)]
            for k in served_steps}


def context_key(window) -> tuple[str, int]:
    """What identifies a window's context: its conversation and turn (its continuations share it)."""
    return window.conversation_hash, window.turn_index


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


@dataclass(frozen=True)
class CeilingText:
    """A perfect drafter's odds on one text, per position t (0 outside the drafted positions)."""

    hit: list[float]
    """1 where x_t is the base's own choice (a perfect draft of it is accepted given the text), else 0."""
    best: list[float]
    """The expected acceptance of the perfect draft: the base's processed top probability (1 under greedy)."""
    certainty: list[float]
    """The base's certainty (`breakdown`): `best` under sampling; under greedy, its softmax's top probability."""
    later: tuple[tuple[list[float], list[float]], ...] = ()
    """Under SGLang's penalties (`Serving.round_start_penalties`), (hit, best) per position where it is
    draft step 2, 3, ...: the base's choice there is penalized over the output before the round, not
    before the position. Empty where every step reads `hit` and `best`."""

    def by_anchor(self, steps: int) -> tuple[list[list[float]], list[list[float]]]:
        """(hit, best) as the walk reads them: [anchor a][step k (0-based)] is position a + k + 2's at step k."""
        hits = [self.hit, *(h for h, _ in self.later)]
        bests = [self.best, *(b for _, b in self.later)]
        return (_by_anchor([hits[min(k, len(hits) - 1)] for k in range(steps)]),
                _by_anchor([bests[min(k, len(bests) - 1)] for k in range(steps)]))


@torch.no_grad()
def _ceiling_batch(targets, head, windows, device, serving: Serving, steps: int = 1) -> list[CeilingText]:
    """Per window of one batch, per position t of its text: a perfect drafter's odds (`CeilingText`).

    The perfect drafter drafts argmax p_t, p_t being the base's distribution at t as `serving`
    processes it: greedy serving accepts it always (and the base's greedy text is that token), so
    both are 1 where the text is the base's greedy choice; sampled serving accepts it with p_t of it.
    Under SGLang's penalties p_t depends on the draft step that drafts t, up to `steps`."""
    batch = collate(windows, device)
    outputs = batch_targets(targets, batch)
    ids = batch.input_ids
    rounds = steps if serving.round_start_penalties else 1
    given = torch.zeros((rounds, *ids.shape), dtype=torch.float64)
    expected = torch.zeros((rounds, *ids.shape), dtype=torch.float64)
    certainty = torch.zeros(ids.shape, dtype=torch.float64)
    # Drafted positions only: a decoder's first draft predicts the answer's second token.
    wanted = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    for row, (window, length) in enumerate(zip(windows, batch.lengths.tolist())):
        wanted[row, window.answer_start + 1 : length] = True
    rows, positions = wanted.nonzero(as_tuple=True)  # (N,), (N,): x_t predicted from H_{t-1}
    if serving.greedy:
        hit = (outputs.greedy[rows, positions - 1] == ids[rows, positions]).double().cpu()
        given[0][rows.cpu(), positions.cpu()] = hit
        expected[0][rows.cpu(), positions.cpu()] = hit
    chunk = memory.logit_rows(ids.device, head.vocab_size, ODDS_BYTES_PER_LOGIT, SAMPLED_CHUNK_TOKENS)
    starts = torch.tensor([w.answer_start for w in windows])
    for start in range(0, len(rows), chunk):
        part = slice(start, start + chunk)
        where = (rows[part].cpu(), positions[part].cpu())
        logits = head.logits(outputs.hidden[rows[part], positions[part] - 1])  # (n, V)
        if serving.greedy:  # the processed distribution is one-hot: the base's certainty is its softmax's
            certainty[where] = torch.softmax(logits.float(), dim=-1).max(-1).values.double().cpu()
            continue
        for k in range(rounds):  # position t drafted at step k + 1, from the anchor t - k - 2
            ends = sampling.verified_history_ends(serving, positions[part] - k - 2, k)
            history = sampling.answer_histories(ids, starts, rows[part], ends) if serving.penalized else None
            p = sampling.base_probs(logits, serving, history)  # (n, V)
            best, choice = p.max(-1)
            given[k][where] = (choice == ids[rows[part], positions[part]]).double().cpu()
            expected[k][where] = best.double().cpu()
            if k == 0:
                certainty[where] = best.double().cpu()
    return [CeilingText(given[0, row, :length].tolist(), expected[0, row, :length].tolist(),
                        certainty[row, :length].tolist(),
                        tuple((given[k, row, :length].tolist(), expected[k, row, :length].tolist()) for k in range(1, rounds)))
            for row, length in enumerate(batch.lengths.tolist())]


def ceiling_texts(targets, head, windows, serving: Serving | None = None, windows_per_batch: int = 4,
                  steps: int = 1, think_close: Sequence[int] = ()) -> list[CeilingText]:
    """A perfect drafter's odds on each of `windows` under `serving` (None: greedy), in their order, for
    rounds of up to `steps` drafts. `head` lends only the base's lm_head (its logits). Under the relaxed rule
    its draft, the base's top choice, is always a candidate: accepted outright in the reasoning (`think_close`
    ends it)."""
    serving = serving or Serving()
    device = head.fc.weight.device
    texts = [text for part in window_batches(targets, head, windows, 0, windows_per_batch)
             for text in _ceiling_batch(targets, head, part, device, serving, steps)]
    if serving.relaxed:
        texts = [_relaxed_ceiling(text, reasoning_end(w, think_close), w.answer_start) for text, w in zip(texts, windows)]
    return texts


def _relaxed_ceiling(text: CeilingText, end: int | None, answer_start: int) -> CeilingText:
    """`text` with the drafted positions before `end` (the reasoning's) accepted outright."""
    if end is None:
        return text
    sure = lambda values: [1.0 if answer_start < t < end else v for t, v in enumerate(values)]  # noqa: E731
    return CeilingText(sure(text.hit), sure(text.best), text.certainty, tuple((sure(h), sure(b)) for h, b in text.later))


def relaxed_texts(texts: list, relaxed: list, windows, think_close: Sequence[int]) -> list:
    """A relaxed configuration's odds per window (`per_text`'s (given, expected)): at a draft that falls in the
    reasoning, the relaxed rule's expected acceptance (`offline.batch_relaxed`) as both. Lossy and approximate:
    an accepted draft other than the text's token would change what follows, and the walk continues on the
    base's text as if it had not."""
    out = []
    for (given, expected), loose, window in zip(texts, relaxed, windows):
        end = reasoning_end(window, think_close)
        if end is None:
            out.append((given, expected))
            continue
        inside = [[a + k + 2 < end for k in range(len(row))] for a, row in enumerate(given)]
        out.append(([[loose[a][k] if inside[a][k] else v for k, v in enumerate(row)] for a, row in enumerate(given)],
                    [[loose[a][k] if inside[a][k] else v for k, v in enumerate(row)] for a, row in enumerate(expected)]))
    return out


def ceiling_acceptance(targets, head, windows, served_steps, max_new_tokens: int, windows_per_batch: int = 4,
                       serving: Serving | None = None, texts: list[CeilingText] | None = None) -> dict[int, Acceptance]:
    """What the decoder would measure, at each served step count, with a perfect drafter on the same
    texts as `served_acceptance`: one that drafts the base's own choice (argmax of its processed
    distribution) at every step, the expectation exact under `serving`. Greedy: every draft inside
    the budget is accepted, so the accept length is K + 1 but for the texts' ends. `head` lends only
    the base's lm_head (its logits); the figure is the base's and the serving configuration's.
    `texts`: the windows' `ceiling_texts`, when the caller has them."""
    steps = max(served_steps)
    texts = texts if texts is not None else ceiling_texts(targets, head, windows, serving, windows_per_batch, steps)
    walks = [(*t.by_anchor(steps), w.answer_start) for w, t in zip(windows, texts)]
    clusters = [context_key(w) for w in windows]
    return {k: expected_acceptance(walks, max_new_tokens, k, clusters=clusters) for k in served_steps}


def _by_anchor(values: list[list[float]]) -> list[list[float]]:
    """Per-position odds of each step (`values[k][t]`) as `expected_rounds` reads them: [anchor a][step k
    (0-based)] is position a + k + 2's at step k."""
    length, steps = len(values[0]), len(values)
    return [[values[k][a + k + 2] if a + k + 2 < length else 0.0 for k in range(steps)] for a in range(length)]


def ceilings(targets, head, heldout: dict[str, list], servings, windows_per_batch: int = 4,
             steps: int = 1, think_close: Sequence[int] = ()) -> dict[str, list[CeilingText]]:
    """Per serving configuration (its label), a perfect drafter's odds on the heldout windows the base wrote
    under it, for rounds of up to `steps` drafts (the largest served step count)."""
    return {s.label(): ceiling_texts(targets, head, heldout[s.label()], s, windows_per_batch, steps, think_close)
            for s in servings}


def ceiling_report(texts: dict[str, list[CeilingText]], heldout: dict[str, list], servings, served_steps,
                   max_new_tokens: int) -> dict:
    """Per serving configuration (its label), per served step count: the perfect drafter's figures
    (`ceiling_acceptance`) on the heldout windows the base wrote under it, from their `ceilings`."""
    return {serving.label(): {str(k): a.to_dict() for k, a in ceiling_acceptance(
                None, None, heldout[serving.label()], served_steps, max_new_tokens, serving=serving,
                texts=texts[serving.label()]).items()}
            for serving in servings}


def heldout_report(targets, head, heldout: dict[str, list], recorded, servings, served_steps, draft_steps: int,
                   max_new_tokens: int, windows_per_batch: int = 4, domains: dict[str, dict] | None = None,
                   ceiling: dict[str, list[CeilingText]] | None = None, think_close: Sequence[int] = ()) -> dict:
    """Every heldout figure of one head, from one pass over each set of windows.

    * `serving`: per serving configuration (its label; `heldout` holds the windows the base
      wrote under each):
      * `served`: per served step count, what the reference speculative decoder measures
        there (decoder replay, or its expectation under sampling; exact): the headline, with
        the counts per context (`per_context`) that a paired comparison of two heads reads;
      * `every_anchor`: the chain over every anchor of the same text (exact, but another
        sample than the decoder's anchors);
      * `by_context`: the served figures by the context's length (`breakdown.CONTEXT_BUCKETS`, those the
        windows reach);
      * `by_file`, `by_category`: the served figures by the data file a conversation came from and
        by its record's `category` (`domains`: conversation hash -> {file, category}; records
        without a category are left out of `by_category`, empty when none has one);
      * `breakdown` (with `ceiling`, the configurations' `ceilings`): at the largest served step
        count, the drafts by where they fall, beside a perfect drafter's at the same positions
        (`breakdown.breakdown`; `think_close`: the token ids of `</think>`, which end the reasoning);
    * `teacher_forced`: agreement, NLL and the greedy chain on the recorded answers
      (`recorded`); the acceptance there is an approximation, and has pointed the wrong
      way. None when no heldout window has a recorded answer (a prompt set).
    """
    steps = max(draft_steps, *served_steps)
    by_serving = {}
    for serving in servings:
        windows = heldout[serving.label()]
        results = list(head_batches(targets, head, windows, steps, windows_per_batch, serving, confidence=ceiling is not None))
        texts = per_text(results)
        if serving.relaxed:
            texts = relaxed_texts(texts, batch_relaxed(results), windows, think_close)
        counts = _served_counts(texts, windows, served_steps, max_new_tokens)
        domain = (domains or {}).get
        by_serving[serving.label()] = {
            "settings": asdict(serving),
            "served": {str(k): figures for k, figures in _served_figures(counts, windows).items()},
            "every_anchor": batch_metrics(results, len(windows), steps, SELF_GENERATED).to_dict(),
            "by_context": grouped_acceptance(counts, windows, lambda w: context_bucket(w.answer_start)),
            "by_file": grouped_acceptance(counts, windows, lambda w: (domain(w.conversation_hash) or {}).get("file")),
            "by_category": grouped_acceptance(counts, windows, lambda w: (domain(w.conversation_hash) or {}).get("category") or None),
        }
        if ceiling is not None:
            drafts = breakdown_texts(texts, windows, ceiling[serving.label()], max(served_steps), think_close,
                                     batch_confidence(results))
            by_serving[serving.label()]["breakdown"] = {"draft_steps": max(served_steps),
                                                        **breakdown(drafts, max_new_tokens, max(served_steps))}
    return {
        "serving": by_serving,
        "teacher_forced": evaluate_head(targets, head, recorded, steps, windows_per_batch, TEACHER_FORCED).to_dict()
        if recorded else None,
    }


def breakdown_texts(texts: list, windows, ceiling: list[CeilingText], steps: int, think_close: Sequence[int] = (),
                    confidence: list | None = None) -> list[TextOdds]:
    """A head's odds on each window (`per_text`) beside the perfect drafter's (`ceiling`), as `breakdown` reads them;
    with `confidence` (`offline.batch_confidence`), the head's confidence in each draft too."""
    odds = texts if texts and isinstance(texts[0], tuple) else [(greedy_odds(o.accepted, steps),) * 2 for o in texts]
    sure = confidence if confidence is not None else [None] * len(windows)
    return [TextOdds(given, expected, perfect.by_anchor(steps)[1], perfect.certainty, w.answer_start,
                     context_bucket(w.answer_start), reasoning_end(w, think_close), c)
            for w, (given, expected), perfect, c in zip(windows, odds, ceiling, sure)]


def distinct_contexts(windows) -> list:
    """The first window of each context (`context_key`), in order: a sampled configuration's windows hold
    several continuations of each prompt, and a decoder starts from the prompt alone."""
    seen, out = set(), []
    for window in windows:
        if context_key(window) not in seen:
            seen.add(context_key(window))
            out.append(window)
    return out
