"""Where acceptance is lost (`evaluation.breakdown`): a head's served drafts split by where they fall.

Against hand-computed tallies on a text small enough to walk by hand, and on the tiny model: every
axis partitions the decoder's drafts (its buckets sum to the served figure's counts), a perfect
drafter loses nothing, and a head never gains on it.
"""

from __future__ import annotations

import pytest
import torch

from occamy_mtp.config import Serving
from occamy_mtp.evaluation.breakdown import AXES, TextOdds, breakdown, greedy_odds, largest_loss, one_line, thinking_end
from occamy_mtp.evaluation.served import ceiling_texts, heldout_report
from test_ceiling import models, prompts, written  # noqa: F401  (the fixture and the texts it writes)

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py


def test_a_walk_by_hand():
    """A prompt of 2 tokens and 4 answer tokens, K = 1, budget 4. The decoder emits the first answer token
    from the prefill, then drafts step 1 at anchor 1 (position 3), then at anchor 2 or 3 as the draft fell:
    with beta 0.5 at anchor 1 it reaches anchor 2 (position 4) with weight 0.5 and anchor 3 with 0.5."""
    given = [[0.0], [0.5], [1.0], [0.0], [0.0], [0.0]]
    expected = [[0.0], [0.4], [0.9], [0.2], [0.0], [0.0]]
    best = [0.0, 0.0, 0.0, 0.6, 0.95, 0.3]
    by_anchor = [[best[a + 2] if a + 2 < len(best) else 0.0] for a in range(len(best))]  # position a + 2's, at step 1
    text = TextOdds(given, expected, by_anchor, certainty=best, answer_start=2, context_bucket="<256", thinking_end=4)
    figures = breakdown([text], max_new_tokens=4, draft_steps=1)
    # anchor 1 (position 3) weight 1; anchor 2 (position 4) weight 0.5 (the draft at 1 rejected: 1 token);
    # anchor 3 (position 5) is past the budget's last draft: 4 tokens, the last a plain step or the bonus
    total = figures["total"]
    assert total["proposed"] == pytest.approx(1.5)
    assert total["accepted"] == pytest.approx(0.4 + 0.5 * 0.9)
    assert total["ceiling_accepted"] == pytest.approx(0.6 + 0.5 * 0.95)
    lost = 0.2 + 0.5 * (0.95 - 0.9)
    assert figures["certainty"] == {  # position 3 is sure to 0.6 (the next bucket's low end), position 4 to 0.95
        "0.6-0.9": pytest.approx({"proposed": 1.0, "accepted": 0.4, "ceiling_accepted": 0.6, "acceptance": 0.4,
                                  "ceiling_acceptance": 0.6, "lost": 0.2, "share_of_lost": 0.2 / lost}),
        ">=0.9": pytest.approx({"proposed": 0.5, "accepted": 0.45, "ceiling_accepted": 0.475, "acceptance": 0.9,
                                "ceiling_acceptance": 0.95, "lost": 0.025, "share_of_lost": 0.025 / lost})}
    assert figures["span"]["thinking"]["proposed"] == pytest.approx(1.0)  # position 3 < 4, the `</think>`
    assert figures["span"]["answer"]["proposed"] == pytest.approx(0.5)
    assert figures["answer_position"]["0-31"]["proposed"] == pytest.approx(1.5)
    # the axes of one bucket (the answer's position, the context here) say nothing of where; certainty 0.6-0.9 and
    # the thinking span lose 89% from 67% of the drafts: the tie goes to certainty
    assert figures["largest_loss"] == pytest.approx({"axis": "certainty", "bucket": "0.6-0.9", "share_of_lost": 0.2 / lost,
                                                     "share_of_drafts": 1.0 / 1.5})
    assert one_line(figures) == "certainty 0.6-0.9: 89% of the drafts lost, from 67% of the drafts"


def test_the_largest_loss_is_the_bucket_that_loses_most_beyond_its_share_of_the_drafts():
    figures = {axis: {} for axis in AXES}
    figures["total"] = {"proposed": 10.0}
    figures["step"] = {"1": {"proposed": 5.0, "share_of_lost": 0.9}, "2": {"proposed": 5.0, "share_of_lost": 0.1}}
    figures["certainty"] = {"<0.3": {"proposed": 3.0, "share_of_lost": 0.5}, ">=0.9": {"proposed": 7.0, "share_of_lost": 0.5}}
    figures["span"] = {"thinking": {"proposed": 0.5, "share_of_lost": 0.05}, "answer": {"proposed": 9.5, "share_of_lost": 0.95}}
    figures["context"] = {"<256": {"proposed": 10.0, "share_of_lost": 1.0}}  # one bucket: the whole
    # the answer span holds most of the loss, and most of the drafts; certainty <0.3 loses 50% from 30%
    assert largest_loss(figures) == {"axis": "certainty", "bucket": "<0.3", "share_of_lost": 0.5, "share_of_drafts": 0.3}
    assert one_line(figures | {"largest_loss": largest_loss(figures)}) == "certainty <0.3: 50% of the drafts lost, from 30% of the drafts"
    assert largest_loss({**{axis: {} for axis in AXES}, "total": {"proposed": 0.0}}) is None
    assert one_line({"largest_loss": None}) == "nothing lost"


def test_the_end_of_the_reasoning_is_found_as_a_token_sequence():
    assert thinking_end([1, 2, 9, 7, 8, 9, 7, 3], answer_start=3, think_close=[9, 7]) == 5  # not the one in the context
    assert thinking_end([1, 2, 3], answer_start=1, think_close=[9]) is None
    assert thinking_end([1, 2, 3], answer_start=1, think_close=[]) is None


def test_greedy_odds_are_the_chain_s_outcomes():
    assert greedy_odds([0, 2, 3], 3) == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


@pytest.mark.parametrize("serving", [Serving(), Serving(temperature=1.0, top_k=20),
                                     Serving(temperature=1.0, top_k=20, presence_penalty=1.5, engine="sglang")],
                         ids=lambda s: s.label())
def test_each_axis_partitions_the_served_drafts_and_a_perfect_drafter_loses_nothing(models, serving):  # noqa: F811
    base, head = models
    windows = written(base, prompts(4), 12, serving)
    perfect = ceiling_texts(base, head, windows, serving, windows_per_batch=2, steps=3)
    report = heldout_report(base, head, {serving.label(): windows}, [], [serving], [1, 3], 3, 12, 2,
                            ceiling={serving.label(): perfect})["serving"][serving.label()]
    figures, served = report["breakdown"], report["served"]["3"]
    assert figures["draft_steps"] == 3
    assert figures["total"]["proposed"] == pytest.approx(sum(served["proposed"]), rel=1e-9)
    assert figures["total"]["accepted"] == pytest.approx(sum(served["accepted"]), rel=1e-9)
    for axis in AXES:
        for field in ("proposed", "accepted", "ceiling_accepted"):
            assert sum(b[field] for b in figures[axis].values()) == pytest.approx(figures["total"][field], rel=1e-9), axis
        assert all(b["lost"] >= 0 for b in figures[axis].values())
    assert [figures["step"][str(k)]["proposed"] for k in (1, 2, 3)] == pytest.approx(served["proposed"], rel=1e-9)
    assert figures["total"]["ceiling_accepted"] >= figures["total"]["accepted"]
    # the perfect drafter's own walk: its drafts are the base's choices, so nothing is lost
    own = [TextOdds(*t.by_anchor(3), t.by_anchor(3)[1], t.certainty, w.answer_start, "<256") for w, t in zip(windows, perfect)]
    assert breakdown(own, 12, 3)["total"]["lost"] == pytest.approx(0.0, abs=1e-12)


def test_a_head_that_drafts_badly_loses_where_the_base_is_sure(models):  # noqa: F811
    """A head whose fusion is zeroed drafts one token everywhere: it loses most where a perfect draft would be
    accepted, so the buckets of high certainty hold more of the loss than their share of the drafts."""
    base, head = models
    serving = Serving()
    windows = written(base, prompts(4), 12, serving)
    perfect = ceiling_texts(base, head, windows, serving, windows_per_batch=2)
    broken = type(head)(head.config, head.shared).float().eval()
    broken.load_state_dict(head.state_dict())
    with torch.no_grad():
        broken.fc.weight.zero_()
    figures = heldout_report(base, broken, {"greedy": windows}, [], [serving], [3], 3, 12, 2,
                             ceiling={"greedy": perfect})["serving"]["greedy"]["breakdown"]
    assert figures["total"]["lost"] > 0.5 * figures["total"]["ceiling_accepted"]
    assert sum(b["share_of_lost"] for b in figures["certainty"].values()) == pytest.approx(1.0)


def test_the_card_says_where_the_trained_head_still_loses():
    from occamy_mtp.export.card import where_lost

    figures = {"draft_steps": 3, "total": {"acceptance": 0.25, "ceiling_acceptance": 0.40},
               "largest_loss": {"axis": "certainty", "bucket": "0.6-0.9", "share_of_lost": 0.24, "share_of_drafts": 0.12}}
    metrics = {"serving": [{"label": "greedy"}, {"label": "thinking-general"}],
               "heldout": {"trained": {"serving": {"greedy": {}, "thinking-general": {"breakdown": figures}}}}}
    lines = where_lost(metrics)
    assert lines[2] == ("- thinking-general, 3-step: the trained head's drafts are accepted 25.0% of the time where a "
                        "perfect drafter's would be 40.0%; certainty 0.6-0.9: 24% of the drafts lost, from 12% of the drafts.")
    assert len(lines) == 4 and where_lost({**metrics, "serving": [{"label": "greedy"}]}) == []  # a record before the breakdown


def test_calibration_by_hand():
    """The walk of `test_a_walk_by_hand` with the head's confidence at its drafts: anchor 1 (weight 1, alpha 0.4)
    sure to 0.85, anchor 2 (weight 0.5, alpha 0.9) to 0.82: one bucket, 0.8-0.9, whose acceptance is
    (0.4 + 0.45) / 1.5 and confidence (0.85 + 0.41) / 1.5; the error is their distance."""
    given = [[0.0], [0.5], [1.0], [0.0], [0.0], [0.0]]
    expected = [[0.0], [0.4], [0.9], [0.2], [0.0], [0.0]]
    best = [[0.0], [0.6], [0.95], [0.3], [0.0], [0.0]]
    sure = [[0.0], [0.85], [0.82], [0.1], [0.0], [0.0]]
    text = TextOdds(given, expected, best, certainty=[0.0] * 6, answer_start=2, context_bucket="<256", confidence=sure)
    calibration = breakdown([text], max_new_tokens=4, draft_steps=1)["calibration"]
    assert list(calibration["buckets"]) == ["0.8-0.9"]
    acceptance, confidence = 0.85 / 1.5, 1.26 / 1.5
    assert calibration["buckets"]["0.8-0.9"] == pytest.approx({"proposed": 1.5, "acceptance": acceptance, "confidence": confidence})
    assert calibration["expected_calibration_error"] == pytest.approx(abs(acceptance - confidence))
    sure[2] = [0.15]  # two buckets now: each its own distance, weighted by its drafts
    calibration = breakdown([text], max_new_tokens=4, draft_steps=1)["calibration"]
    assert list(calibration["buckets"]) == ["0.1-0.2", "0.8-0.9"]
    assert calibration["expected_calibration_error"] == pytest.approx((1.0 * abs(0.4 - 0.85) + 0.5 * abs(0.9 - 0.15)) / 1.5)
    assert "calibration" not in breakdown([TextOdds(given, expected, best, [0.0] * 6, 2, "<256")], 4, 1)


@pytest.mark.parametrize("serving", [Serving(), Serving(temperature=1.0, top_k=20)], ids=lambda s: s.label())
def test_the_head_s_confidence_is_its_softmax_s_top_probability_where_it_drafted(models, serving):  # noqa: F811
    """Each served draft's confidence is the head's softmax top-1 there, computed plainly; the reliability table
    partitions the drafts the breakdown counts."""
    from occamy_mtp.evaluation.offline import _pass, batch_confidence, head_batches

    base, head = models
    windows = written(base, prompts(3), 12, serving)
    results = list(head_batches(base, head, windows, 2, 3, serving, confidence=True))
    confidence = batch_confidence(results)
    with torch.no_grad():
        _, _, _, hidden = _pass(base, head, windows, 2, torch.device("cpu"), embed_text=not serving.greedy)
        plain = torch.softmax(head.logits(hidden).float(), dim=-1).amax(-1)  # (K, B, T)
    checked = 0
    for row, per_anchor in enumerate(confidence):
        for anchor, steps in enumerate(per_anchor):
            for k, value in enumerate(steps):
                if value > 0:
                    assert value == pytest.approx(float(plain[k, row, anchor]), abs=1e-5)
                    checked += 1
    assert checked > 0
    perfect = ceiling_texts(base, head, windows, serving, windows_per_batch=3, steps=2)
    figures = heldout_report(base, head, {serving.label(): windows}, [], [serving], [2], 2, 12, 3,
                             ceiling={serving.label(): perfect})["serving"][serving.label()]["breakdown"]
    buckets = figures["calibration"]["buckets"]
    assert sum(b["proposed"] for b in buckets.values()) == pytest.approx(figures["total"]["proposed"], rel=1e-9)
    assert 0 <= figures["calibration"]["expected_calibration_error"] <= 1


def test_a_thinking_answer_cut_inside_its_reasoning_is_reasoning_throughout():
    """A thinking-mode window whose answer never writes `</think>` (cut inside the reasoning) is all reasoning;
    one that closes it, reasoning up to the marker; a window not in thinking mode, or a tokenizer without the
    marker, has no reasoning span."""
    from occamy_mtp.data.windows import Window
    from occamy_mtp.evaluation.breakdown import reasoning_end

    cut = Window("a", 0, (1, 2, 3, 4, 5), 2, thinking=True)
    closed = Window("b", 0, (1, 2, 3, 9, 5), 2, thinking=True)
    assert reasoning_end(cut, [9]) == 5 and reasoning_end(closed, [9]) == 3
    assert reasoning_end(Window("c", 0, (1, 2, 3), 2), [9]) is None and reasoning_end(cut, []) is None
