"""The decoder check: the reference speculative decoder run for real, against what the offline figures predict.

Greedy, its counts must equal the replay of its own text (`reference_decoder_check`); sampled,
its counts must sit within their expectation's spread (`sampled_decoder_check`), which
`validate --serving` also computes for a serving engine's text (docs/reference/DECODER.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from occamy_mtp.config import Serving
from occamy_mtp.sampling import seed_of
from occamy_mtp.evaluation.decode import Runners, decodes_runners, speculative_decode
from occamy_mtp.evaluation.metrics import (Acceptance, acceptance_from_counts, decoder_rounds, expected_rounds,
                                           replayed_acceptance, summed_acceptance, z_score)
from occamy_mtp.evaluation.offline import SELF_GENERATED, head_batches, batch_metrics, batch_odds, batch_outcomes
from occamy_mtp.evaluation.served import context_key


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
    """Base passes after the prefill: verify passes, and the reference decoder's plain steps where one token
    is left in the budget (an engine's count holds its verify passes only: `sampled_decoder_check`'s
    `engine_counts`)."""

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
    chains = list(head_batches(base, head, decoded, draft_steps, windows_per_batch))  # one offline pass: replay and figures
    outcomes = batch_outcomes(chains)
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
        "offline_all_anchors": batch_metrics(chains, len(decoded), draft_steps, SELF_GENERATED).to_dict(),
        "seconds": time.perf_counter() - started,
        "decode_seconds": decode_seconds,
    }


def sampled_decodes(base, head, windows, draft_steps: int, max_new_tokens: int, stop_token_ids, serving: Serving,
                    seeds, runners: Runners | None = None, stream: str = "") -> list[MeasuredText]:
    """Each window's context decoded once per seed by the reference decoder under sampled `serving`
    (`runners` as in `reference_decoder_check`). Every decode draws from its own generator, seeded by
    (seed, `stream`, the window's context): no two prompts, and no two streams (a head each), share their
    draws, so that the texts' differences from their expectation are independent, as
    `sampled_decoder_check`'s z-scores take them to be."""
    runners = runners or decodes_runners(base, head, [w.answer_start for w in windows], max_new_tokens, draft_steps)
    decodes = []
    for window in windows:
        prompt = list(window.input_ids[: window.answer_start])
        conversation, turn = context_key(window)
        context = f"decoder:{stream}:{conversation}:{turn}"
        for seed in seeds:
            result = speculative_decode(base, head, prompt, max_new_tokens, draft_steps, stop_token_ids, serving=serving,
                                        seed=seed_of(seed, context), runners=runners)
            decodes.append(MeasuredText.decoded(window, result))
    return decodes


def sampled_decoder_check(base, head, measured: list[MeasuredText], draft_steps: int, max_new_tokens: int,
                          serving: Serving, windows_per_batch: int = 4, engine_counts: bool = False,
                          names: Sequence[str] | None = None) -> dict:
    """A decoder's counts on texts it wrote under sampled `serving` (`sampled_decodes`, or an engine's)
    beside their expectation given each text.

    Given the text, the decoder's counts are random with the expectation `metrics.expected_rounds`
    computes from the offline pass over that text, so over the texts the differences
    (measured - expected) are independent with mean 0: their mean over its standard error is a
    z-score. `z` holds it for the accepted drafts and for the verify passes; |z| beyond about 4.5
    says that the decoder and the library's arithmetic disagree (a chance of 7e-6 when they agree).
    Under greedy drafts the walk given the text is certain, so every text's verify passes
    equal their expectation and that z is 0. With `engine_counts` the measured passes are an engine's
    verify passes (the rounds that drafted, SGLang's spec_verify_ct), so the expectation's are too: the
    plain steps where one token is left in the budget leave it (they had biased the verify passes' z,
    -4.31 over 32 texts against the library's own server). With `names` (each text's prompt), `per_prompt`
    sets each prompt's measured accept length beside its expectation (`prompt_by_prompt`).
    """

    started = time.perf_counter()
    odds = batch_odds(list(head_batches(base, head, [m.window for m in measured], draft_steps, windows_per_batch, serving)))
    counts = [expected_rounds(given, expected, text.window.answer_start, max_new_tokens, draft_steps)
              for text, (given, expected) in zip(measured, odds)]
    if engine_counts:  # verify passes on both sides: the plain steps at a budget's end are no engine's count
        counts = [replace(c, passes=c.verify_passes, plain_steps=0.0) for c in counts]
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
        **({"per_prompt": prompt_by_prompt(names, measured, counts, draft_steps)} if names is not None else {}),
        "seconds": time.perf_counter() - started,
    }


FURTHEST_PROMPTS = 3


def prompt_by_prompt(names: Sequence[str], measured: list[MeasuredText], counts, draft_steps: int) -> dict:
    """Per prompt, over its texts (a prompt's samples): the accept length measured beside the one expected given
    those texts, and their difference; then the differences' spread (their standard deviation over the
    prompts) and the `FURTHEST_PROMPTS` prompts furthest apart. Under sampling a prompt's difference is
    partly chance: the z-scores over all texts say whether the engine disagrees; this says where to look."""
    groups: dict[str, list[int]] = {}
    for index, name in enumerate(names):
        groups.setdefault(name, []).append(index)
    rows = []
    for name, members in groups.items():
        texts = [measured[i] for i in members]
        served = measured_totals(texts, draft_steps).mean_accept_length
        expected = summed_acceptance([counts[i] for i in members], draft_steps, totals_generated(texts)).mean_accept_length
        rows.append({"prompt": name, "texts": len(members), "measured_accept_length": served,
                     "expected_accept_length": expected, "difference": served - expected})
    differences = [row["difference"] for row in rows]
    mean = sum(differences) / len(differences) if differences else 0.0
    spread = (sum((d - mean) ** 2 for d in differences) / (len(differences) - 1)) ** 0.5 if len(differences) > 1 else 0.0
    furthest = sorted(rows, key=lambda row: -abs(row["difference"]))[:FURTHEST_PROMPTS]
    return {"prompts": rows, "mean_difference": mean, "spread": spread, "furthest": [row["prompt"] for row in furthest]}
