"""Where acceptance is lost: a head's served drafts split by where they fall, beside a perfect drafter's.

The decoder's walk over a text (`metrics.expected_rounds`) proposes step k at anchor a with some
probability w, and a draft there is accepted with probability alpha: the head's draft's
(`served`'s odds), or, for a perfect drafter that drafts the base's own choice at the same
position, the base's processed top probability there (the ceiling's odds, `served.CeilingText`).
Summed over a bucket of drafted positions:

    proposed = sum w        accepted = sum w * alpha_head        ceiling_accepted = sum w * alpha_best

and `lost` = ceiling_accepted - accepted is the expected accepted drafts the head missed there,
at the positions it drafted (never below 0: no draft is accepted more often than the base's own
choice). The buckets (`AXES`), each a partition of the drafts:

* `certainty`: the base's certainty at the drafted position: the processed top probability under
  a sampled configuration (what even a perfect draft is accepted with); under greedy serving,
  whose processed distribution is one-hot, the top probability of the base's softmax at
  temperature 1;
* `step`: the draft step (1 .. K);
* `span`: thinking (before the answer's `</think>`) or answer, for text written in thinking mode;
* `answer_position`: the drafted token's position in the answer;
* `context`: the window's context length (`CONTEXT_BUCKETS`).

`largest_loss` names the bucket holding the largest share of what is lost: where a better head
would gain most (docs/reference/METRICS.md).

`calibration` sets the same drafts by the head's own confidence in its draft (its softmax's top-1
probability, `CONFIDENCE_BUCKETS`): per bucket, the mean confidence beside the acceptance, and the
expected calibration error, the drafts' weighted mean of |acceptance - confidence| over the buckets.
A verifier that decides from the draft's own logits how many slots to verify (vLLM's adaptive
verification) serves a head faster when its confidence says how often it is accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from occamy_mtp.evaluation.metrics import expected_rounds

CERTAINTY_BUCKETS = (("<0.3", 0.0, 0.3), ("0.3-0.6", 0.3, 0.6), ("0.6-0.9", 0.6, 0.9), (">=0.9", 0.9, None))
"""[low, high) of the base's top probability at the drafted position."""
ANSWER_POSITION_BUCKETS = (("0-31", 0, 32), ("32-127", 32, 128), ("128-255", 128, 256), ("256+", 256, None))
"""[low, high) of the drafted token's index in the answer (0: its first token)."""
# Context-length buckets (`by_context`, the `context` axis): [low, high) tokens of context a window holds.
CONTEXT_BUCKETS = (("<256", 0, 256), ("256-1k", 256, 1024), ("1k-4k", 1024, 4096), ("4k+", 4096, None))
CONFIDENCE_BUCKETS = tuple((f"{low / 10:.1f}-{(low + 1) / 10:.1f}", low / 10, None if low == 9 else (low + 1) / 10)
                           for low in range(10))
"""[low, high) of the head's top-1 probability at its draft, tenths."""
THINKING, ANSWER = "thinking", "answer"
AXES = ("certainty", "step", "span", "answer_position", "context")


def _bucket(value: float, buckets) -> str:
    return next(name for name, low, high in buckets if value >= low and (high is None or value < high))


def context_bucket(tokens: int) -> str:
    return _bucket(tokens, CONTEXT_BUCKETS)


@dataclass
class Tally:
    """Expected drafts in one bucket: proposed, accepted (the head's), and accepted by a perfect drafter there."""

    proposed: float = 0.0
    accepted: float = 0.0
    ceiling_accepted: float = 0.0

    def add(self, weight: float, alpha: float, best: float) -> None:
        self.proposed += weight
        self.accepted += weight * alpha
        self.ceiling_accepted += weight * best

    def to_dict(self, lost_in_all: float) -> dict:
        lost = max(0.0, self.ceiling_accepted - self.accepted)
        return {
            "proposed": self.proposed, "accepted": self.accepted, "ceiling_accepted": self.ceiling_accepted,
            "acceptance": self.accepted / self.proposed if self.proposed else 0.0,
            "ceiling_acceptance": self.ceiling_accepted / self.proposed if self.proposed else 0.0,
            "lost": lost, "share_of_lost": lost / lost_in_all if lost_in_all > 0 else 0.0,
        }


@dataclass(frozen=True)
class TextOdds:
    """One text's odds as the walk reads them: [anchor a][step k (0-based)] is position a + k + 2's
    (`served.CeilingText.by_anchor`); `certainty` per position of the text.""" 

    given: Sequence[Sequence[float]]
    """The head's: P(step k accepted | the steps before it accepted, the text)."""
    expected: Sequence[Sequence[float]]
    """The head's: the expected acceptance of its draft there."""
    best: Sequence[Sequence[float]]
    """A perfect drafter's expected acceptance there (the base's processed top probability)."""
    certainty: Sequence[float]
    """The base's certainty at each position (module docstring)."""
    answer_start: int
    context_bucket: str
    thinking_end: int | None = None
    """Where the reasoning of thinking-mode text ends (`reasoning_end`): the position of the answer's `</think>`,
    or the text's end where the reasoning never closes; positions before it are reasoning. None where the
    text has no thinking span."""
    confidence: Sequence[Sequence[float]] | None = None
    """The head's top-1 probability at its draft there (`offline.batch_confidence`); None: no calibration."""


def breakdown(texts: Sequence[TextOdds], max_new_tokens: int, draft_steps: int) -> dict:
    """The served drafts at `draft_steps` steps over `texts`, per axis and bucket (module docstring):
    {axis: {bucket: Tally.to_dict()}}, with `largest_loss` and the totals."""
    tallies: dict[str, dict[str, Tally]] = {axis: {} for axis in AXES}
    total = Tally()
    calibration: dict[str, list[float]] = {}  # bucket -> [proposed, accepted, summed confidence]
    for text in texts:
        def visit(anchor: int, k: int, weight: float, text: TextOdds = text) -> None:
            position = anchor + k + 2  # the drafted token's
            alpha, best = text.expected[anchor][k], text.best[anchor][k]
            keys = {
                "certainty": _bucket(text.certainty[position], CERTAINTY_BUCKETS),
                "step": str(k + 1),
                "span": THINKING if text.thinking_end is not None and position < text.thinking_end else ANSWER,
                "answer_position": _bucket(position - text.answer_start, ANSWER_POSITION_BUCKETS),
                "context": text.context_bucket,
            }
            for axis, key in keys.items():
                tallies[axis].setdefault(key, Tally()).add(weight, alpha, best)
            total.add(weight, alpha, best)
            if text.confidence is not None:
                sure = text.confidence[anchor][k]
                cell = calibration.setdefault(_bucket(sure, CONFIDENCE_BUCKETS), [0.0, 0.0, 0.0])
                cell[0], cell[1], cell[2] = cell[0] + weight, cell[1] + weight * alpha, cell[2] + weight * sure

        expected_rounds(text.given, text.expected, text.answer_start, max_new_tokens, draft_steps, visit=visit)
    lost = max(0.0, total.ceiling_accepted - total.accepted)
    out = {axis: {key: tally.to_dict(lost) for key, tally in sorted(by.items(), key=lambda kv: _order(axis, kv[0]))}
           for axis, by in tallies.items()}
    out["total"] = total.to_dict(lost)
    out["largest_loss"] = largest_loss(out)
    if calibration:
        out["calibration"] = calibration_of(calibration)
    return out


def calibration_of(cells: dict[str, list[float]]) -> dict:
    """The reliability table ({bucket: proposed, acceptance, confidence}) of `breakdown`'s confidence cells and
    the expected calibration error: the drafts' weighted mean of |acceptance - mean confidence| over the buckets."""
    names = [name for name, _, _ in CONFIDENCE_BUCKETS]
    proposed = sum(cell[0] for cell in cells.values())
    table = {name: {"proposed": cell[0], "acceptance": cell[1] / cell[0] if cell[0] else 0.0,
                    "confidence": cell[2] / cell[0] if cell[0] else 0.0}
             for name, cell in sorted(cells.items(), key=lambda kv: names.index(kv[0]))}
    error = sum(b["proposed"] * abs(b["acceptance"] - b["confidence"]) for b in table.values()) / proposed if proposed else 0.0
    return {"buckets": table, "expected_calibration_error": error,
            "acceptance": sum(cell[1] for cell in cells.values()) / proposed if proposed else 0.0,
            "confidence": sum(cell[2] for cell in cells.values()) / proposed if proposed else 0.0}


def _order(axis: str, key: str):
    """Buckets in their natural order: by their lower bound, steps by number, thinking before answer."""
    order = {"certainty": [name for name, _, _ in CERTAINTY_BUCKETS], "context": [name for name, _, _ in CONTEXT_BUCKETS],
             "answer_position": [name for name, _, _ in ANSWER_POSITION_BUCKETS], "span": [THINKING, ANSWER]}
    if axis == "step":
        return int(key)
    names = order.get(axis)
    return names.index(key) if names and key in names else 0


def largest_loss(figures: dict) -> dict | None:
    """The bucket that loses most beyond its share of the drafts: the largest share of what is lost less
    the share of the drafts it holds, among the axes that split the drafts into two or more buckets (the
    step's aside: every text has each step); ties go to the earlier axis of AXES. A bucket that holds
    95% of the drafts and 95% of the loss says nothing of where; one that holds 12% of the drafts and
    24% of the loss does."""
    total = figures["total"]["proposed"]
    candidates = []
    for order, axis in enumerate(AXES):
        buckets = {key: b for key, b in figures.get(axis, {}).items() if b.get("proposed", 0.0) > 0}
        if axis == "step" or len(buckets) < 2:
            continue
        for key, b in buckets.items():
            drafts = b["proposed"] / total if total else 0.0
            if b["share_of_lost"] > 0:
                candidates.append((-(b["share_of_lost"] - drafts), order, key, axis, drafts, b["share_of_lost"]))
    if not candidates:
        return None
    excess, _, key, axis, drafts, share = min(candidates)
    return {"axis": axis, "bucket": key, "share_of_lost": share, "share_of_drafts": drafts}


def thinking_end(input_ids: Sequence[int], answer_start: int, think_close: Sequence[int]) -> int | None:
    """The position of the first `think_close` token sequence in the answer (None: none there)."""
    close = list(think_close)
    if not close:
        return None
    ids = list(input_ids)
    for start in range(answer_start, len(ids) - len(close) + 1):
        if ids[start : start + len(close)] == close:
            return start
    return None


def reasoning_end(window, think_close: Sequence[int]) -> int | None:
    """Where a window's reasoning ends (`TextOdds.thinking_end`): its answer's first `think_close`, or the text's end
    where a thinking-mode answer never closes its reasoning (the window cut it inside it: all of it is
    reasoning); None for a window not in thinking mode, or a tokenizer without the marker."""
    if not window.thinking or not list(think_close):
        return None
    end = thinking_end(window.input_ids, window.answer_start, think_close)
    return len(window.input_ids) if end is None else end


def greedy_odds(accepted_at: Sequence[int], steps: int) -> list[list[float]]:
    """A greedy text's odds in the walk's form: step k at anchor a is accepted iff the head's chain there
    gets more than k steps right (`ChainOutcome.accepted`)."""
    return [[1.0 if accepted > k else 0.0 for k in range(steps)] for accepted in accepted_at]


def one_line(figures: dict) -> str:
    """The bucket that loses most beyond its share, in words: "certainty 0.6-0.9: 24% of the drafts lost, from 12% of the drafts"."""
    largest = figures.get("largest_loss")
    if not largest:
        return "nothing lost"
    return (f"{largest['axis'].replace('_', ' ')} {largest['bucket']}: {largest['share_of_lost']:.0%} of the drafts lost, "
            f"from {largest['share_of_drafts']:.0%} of the drafts")
