"""The acceptance arithmetic, and the decoder replay against the reference decoder's own counts.

`metrics.decoder_rounds` replays `decode.speculative_decode` on a fixed text from the
offline chain's per-anchor outcomes. The oracle is the decoder itself: on the text it
wrote, the replay must visit the same anchors, draft the same number of steps and count
the same proposals, acceptances, drafted tokens and base passes, for K = 1, 2 and 3,
whether the text ends on a stop token or on the token budget.
"""

from __future__ import annotations

import pytest

from occamy_mtp.data.windows import Window
from occamy_mtp.evaluation.decode import greedy_decode, speculative_decode
from occamy_mtp.evaluation.offline import chain_outcomes
from occamy_mtp.evaluation.metrics import Round, decoder_rounds, replayed_acceptance

from test_decode import agreeable_models, random_prompt

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py


@pytest.fixture(scope="module")
def models():
    return agreeable_models(seed=3)


def test_rounds_of_a_hand_made_text():
    """Prompt of 2, budget 8, K = 2: a worked example of anchors, drafting caps and passes."""
    # Text: 2 prompt tokens + 8 generated = 10 positions; accepted_at by anchor.
    accepted_at = [0, 2, 1, 0, 2, 0, 1, 0, 0, 0]
    rounds, passes = decoder_rounds(accepted_at, prompt_length=2, max_new_tokens=8, draft_steps=2)
    # emitted=1: anchor 1, 2 steps, 2 accepted -> emitted 4; anchor 4, 2 steps, 2 -> 7;
    # one token left before the budget: a plain step, no draft.
    assert rounds == [Round(1, 2, 2), Round(4, 2, 2)]
    assert passes == 3
    acc = replayed_acceptance([(accepted_at, 2)], max_new_tokens=8, draft_steps=2)
    assert (acc.proposed, acc.accepted, acc.drafted) == ([2, 2], [2, 2], 4)
    assert acc.tokens_per_verify_pass == pytest.approx(7 / 3)
    assert acc.mean_accept_length == pytest.approx(3.0)

    # The same text ended by a stop token under a larger budget: the third round drafts
    # two steps, but only one predicted position lies inside the text; no plain step.
    rounds, passes = decoder_rounds(accepted_at, prompt_length=2, max_new_tokens=20, draft_steps=2)
    assert rounds == [Round(1, 2, 2), Round(4, 2, 2), Round(7, 1, 0)]
    assert passes == 3


def test_rounds_refuse_impossible_texts():
    with pytest.raises(ValueError, match="no generated token"):
        decoder_rounds([0, 0], prompt_length=2, max_new_tokens=4, draft_steps=1)
    with pytest.raises(ValueError, match="more than max_new_tokens"):
        decoder_rounds([0] * 8, prompt_length=2, max_new_tokens=4, draft_steps=1)


def _stop_token(base, prompt, new_tokens):
    """A token the base emits partway into its greedy continuation of `prompt`."""
    return greedy_decode(base, prompt, new_tokens).output_ids[new_tokens // 2]


@pytest.mark.parametrize("draft_steps", [1, 2, 3])
@pytest.mark.parametrize("ending", ["budget", "stop"])
def test_replay_equals_the_reference_decoder(models, draft_steps, ending):
    base, head = models
    max_new_tokens = 23
    results, texts = [], []
    for seed in (31, 32, 33):
        prompt = random_prompt(7, seed)
        stop = {_stop_token(base, prompt, 16)} if ending == "stop" else set()
        result = speculative_decode(base, head, prompt, max_new_tokens, draft_steps, stop)
        assert result.finish_reason == ("stop" if ending == "stop" else "length")
        window = Window("self-generated", 0, result.text_ids, len(prompt))
        outcome = chain_outcomes(base, head, [window], draft_steps=3)[0]  # more steps than replayed: capped
        rounds, passes = decoder_rounds(outcome.accepted, len(prompt), max_new_tokens, draft_steps)
        assert [(r.anchor, r.accepted) for r in rounds] == [(r.anchor, r.accepted) for r in result.rounds]
        assert passes == result.base_passes
        results.append(result)
        texts.append((outcome.accepted, len(prompt)))
    replayed = replayed_acceptance(texts, max_new_tokens, draft_steps)
    assert replayed.proposed == [sum(v) for v in zip(*(r.proposed for r in results))]
    assert replayed.accepted == [sum(v) for v in zip(*(r.accepted for r in results))]
    assert replayed.drafted == sum(r.drafted for r in results)
    assert replayed.verify_passes == sum(r.base_passes for r in results)
    emitted = sum(len(r.output_ids) - 1 for r in results)
    assert replayed.tokens_per_verify_pass == pytest.approx(emitted / replayed.verify_passes)
    assert 0 < replayed.accepted[0] < replayed.proposed[0], "the agreeable head should accept some drafts, not all"
