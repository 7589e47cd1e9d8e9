"""The ceiling: what a perfect drafter, one that drafts the base's own choice at every step, would
reach on the heldout text (issue 44, item 5), against a plain per-prefix reference."""

from __future__ import annotations

import pytest
import torch

from occamy_mtp import sampling
from occamy_mtp.config import Serving
from occamy_mtp.data.windows import Window
from occamy_mtp.evaluation.served import _ceiling_batch, ceiling_acceptance
from occamy_mtp.evaluation.report import share_of_ceiling
from occamy_mtp.evaluation.metrics import replayed_acceptance
from occamy_mtp.selfgen.store import context_of, self_generate, with_continuation
from occamy_mtp.testing.checkpoints import random_models, tiny_text_config

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py


@pytest.fixture(scope="module")
def models():
    base, head = random_models(tiny_text_config(), seed=7)
    return base.float().eval(), head.float().eval()


def prompts(count: int) -> list[Window]:
    generator = torch.Generator().manual_seed(3)
    return [Window(f"w{n}", 0, tuple(torch.randint(0, 1000, (6 + 3 * n,), generator=generator).tolist()), 6 + 3 * n)
            for n in range(count)]


def written(base, windows, budget: int, serving: Serving) -> list[Window]:
    """The base's own continuations of the windows' contexts under `serving` (what the heldout holds)."""
    text = sampling.text_sampling(serving, seed=0)
    continuations = self_generate(base, [context_of(w) for w in windows], budget, stop_token_ids=set(), batch_size=4,
                                  sampling=text)
    return [with_continuation(w, c) for w, c in zip(windows, continuations)]


@torch.no_grad()
def plain_ceiling_odds(base, window: Window, serving: Serving) -> tuple[list[float], list[float], list[float]]:
    """Position by position, a fresh forward over the prefix: is x_t the base's top choice, its probability,
    and the base's certainty there (that probability; under greedy, the plain softmax's top probability)."""
    ids = list(window.input_ids)
    hit, best, certainty = [0.0] * len(ids), [0.0] * len(ids), [0.0] * len(ids)
    for t in range(window.answer_start + 1, len(ids)):
        logits = base(input_ids=torch.tensor([ids[:t]]), use_cache=False).logits[0, -1].float()
        p = sampling.base_probs(logits[None], serving)[0]
        hit[t] = float(int(p.argmax()) == ids[t])
        best[t] = float(p.max()) if not serving.greedy else hit[t]
        certainty[t] = float(torch.softmax(logits, -1).max()) if serving.greedy else best[t]
    return hit, best, certainty


@pytest.mark.parametrize("serving", [Serving(), Serving(temperature=0.7, top_p=0.8), Serving(temperature=1.0, top_k=20)],
                         ids=lambda s: s.label())
def test_the_perfect_drafter_s_odds_are_the_plain_reference(models, serving):
    base, head = models
    windows = written(base, prompts(3), 12, serving)
    batched = _ceiling_batch(base, head, windows, torch.device("cpu"), serving)
    for window, text in zip(windows, batched):
        plain_hit, plain_best, plain_certainty = plain_ceiling_odds(base, window, serving)
        assert text.hit == plain_hit
        # float32 softmax of the same logits, batched against one prefix at a time: the logits agree to
        # a few ulps of their scale (~10), so a probability to ~1e-6; 1e-5 leaves room and fails a wrong position.
        assert text.best == pytest.approx(plain_best, abs=1e-5)
        assert text.certainty == pytest.approx(plain_certainty, abs=1e-5)
        assert all(0 < c <= 1 for c in text.certainty[window.answer_start + 1:])
    if serving.greedy:  # the base's own greedy text: every position is its top choice
        assert all(h == 1.0 for window, text in zip(windows, batched) for h in text.hit[window.answer_start + 1:])


def test_the_greedy_ceiling_is_every_draft_accepted(models):
    base, head = models
    windows = written(base, prompts(4), 12, Serving())
    ceiling = ceiling_acceptance(base, head, windows, [1, 3], max_new_tokens=12, windows_per_batch=2)
    for k, figures in ceiling.items():
        # the decoder's walk replayed with every chain accepted as far as the text goes
        texts = [([min(k, len(w.input_ids) - 2 - a) for a in range(len(w.input_ids))], w.answer_start) for w in windows]
        replay = replayed_acceptance(texts, 12, k)
        assert figures.mean_accept_length == pytest.approx(k + 1)
        assert figures.proposed == pytest.approx(replay.proposed) and figures.accepted == pytest.approx(replay.accepted)


def test_a_sampled_ceiling_lies_below_the_greedy_one(models):
    base, head = models
    serving = Serving(temperature=1.0)
    windows = written(base, prompts(4), 12, serving)
    ceiling = ceiling_acceptance(base, head, windows, [3], 12, 2, serving)[3]
    assert 1.0 < ceiling.mean_accept_length < 4.0


def test_share_of_the_way_to_the_ceiling():
    assert share_of_ceiling(1.5, 2.0, 2.5) == pytest.approx(0.5)
    assert share_of_ceiling(1.5, 1.4, 2.5) == pytest.approx(-0.1)
    assert share_of_ceiling(2.0, 2.0, 2.0) is None
