"""Relaxed acceptance of thinking tokens (issue 60, item 5): opt-in, lossy, beside the exact figure.

The rule: inside the reasoning, a draft among the target's top-k whose probability is at least a ratio
of the top one's is accepted outright; elsewhere the exact rule holds. Checked against a plain
enumeration, on the tiny model against the exact figures, and its refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from occamy_mtp import sampling
from occamy_mtp.config import ConfigError, PRESETS, Serving, load_config, serving_preset
from occamy_mtp.evaluation.served import ceiling_texts, heldout_report
from test_ceiling import models, prompts, written  # noqa: F401  (the fixture and the texts it writes)

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py


def plain_relaxed(p: list[float], q: list[float], top_k: int, ratio: float) -> float:
    """Token by token: a candidate (among the top_k by p, p >= ratio x the top) is accepted whenever drafted."""
    kth = sorted(p, reverse=True)[min(top_k, len(p)) - 1]
    top = max(p)
    return sum(qx if (px >= kth and px >= ratio * top and px > 0) else min(px, qx) for px, qx in zip(p, q))


@pytest.mark.parametrize("top_k, ratio", [(1, 0.0), (3, 0.0), (3, 0.5), (20, 0.9), (5, 1.0)])
def test_the_relaxed_acceptance_is_the_plain_rule(top_k, ratio):
    generator = torch.Generator().manual_seed(top_k)
    p = torch.softmax(torch.randn(6, 12, generator=generator) * 2, dim=-1)
    p[0, 7:] = 0  # a processed distribution cuts the tail
    p[0] /= p[0].sum()
    q = torch.softmax(torch.randn(6, 12, generator=generator) * 2, dim=-1)
    q[1] = torch.nn.functional.one_hot(p[1].argsort(descending=True)[1], 12).float()  # a greedy draft of p's second token
    got = sampling.relaxed_acceptance(p, q, top_k, ratio)
    for row in range(6):
        assert float(got[row]) == pytest.approx(plain_relaxed(p[row].tolist(), q[row].tolist(), top_k, ratio), abs=1e-6)
    assert bool((got >= sampling.acceptance(p, q) - 1e-6).all())  # never below the exact rule
    second_is_candidate = top_k >= 2 and float(p[1].sort(descending=True).values[1]) >= ratio * float(p[1].max())
    assert float(got[1]) == pytest.approx(1.0 if second_is_candidate else float(p[1].sort(descending=True).values[1]), abs=1e-6)


THINKING = dataclasses.replace(PRESETS["thinking-coding"], top_p=1.0)  # t0.6, top-k 20, thinking on
RELAXED = dataclasses.replace(THINKING, relaxed_top_k=5, relaxed_ratio=0.1)


@torch.no_grad()
def test_relaxed_figures_beside_the_exact_ones_on_the_tiny_model(models):  # noqa: F811
    """Where the text has no reasoning (no think marker known) the relaxed configuration's figures are the exact
    ones; where it is all reasoning (a marker never written), every draft counts its relaxed odds: the figures
    rise, a perfect drafter is accepted always, and nothing is lost there that the exact rule would keep."""
    base, head = models
    windows = [dataclasses.replace(w, thinking=True) for w in written(base, prompts(4), 12, THINKING)]
    never = [base.config.vocab_size - 1]  # a marker the text does not hold
    assert all(never[0] not in w.input_ids[w.answer_start :] for w in windows)

    def report(serving: Serving, think_close) -> dict:
        ceiling = ceiling_texts(base, head, windows, serving, windows_per_batch=2, steps=3, think_close=think_close)
        return heldout_report(base, head, {serving.label(): windows}, [], [serving], [1, 3], 3, 12, 2,
                              ceiling={serving.label(): ceiling}, think_close=think_close)["serving"][serving.label()]

    exact = report(THINKING, never)["served"]
    unmarked = report(RELAXED, [])["served"]  # no marker: no reasoning span, the exact rule throughout
    relaxed = report(RELAXED, never)
    for k in ("1", "3"):
        assert unmarked[k]["mean_accept_length"] == pytest.approx(exact[k]["mean_accept_length"], abs=1e-12)
        assert relaxed["served"][k]["mean_accept_length"] > exact[k]["mean_accept_length"]
    perfect = ceiling_texts(base, head, windows, RELAXED, windows_per_batch=2, steps=3, think_close=never)
    for text, window in zip(perfect, windows):
        assert all(v == 1.0 for v in text.best[window.answer_start + 1 :])
    assert relaxed["breakdown"]["total"]["lost"] >= 0


def test_the_relaxed_rule_is_named_and_refused_where_it_cannot_apply():
    relaxed = serving_preset("thinking-general-relaxed-k10-r0.6")
    assert (relaxed.relaxed_top_k, relaxed.relaxed_ratio, relaxed.thinking) == (10, 0.6, True)
    assert relaxed.label() == "thinking-general-relaxed-k10-r0.6"
    config = load_config(None, ["eval.serving=[thinking-general, thinking-general-relaxed-k10-r0.6]"])
    assert [s.relaxed for s in config.eval.serving] == [False, True]
    for setting, message in [
        ("eval.serving=[instruct-general-relaxed-k10-r0.6]", r"eval.serving\[0\].relaxed_top_k: the relaxed rule accepts "
                                                             "thinking tokens, and instruct-general-relaxed-k10-r0.6 is not in thinking mode"),
        ("eval.serving=[{temperature: 0, thinking: true, relaxed_top_k: 4}]", "modelled for sampled serving"),
        ("eval.serving=[{temperature: 1, thinking: true, relaxed_top_k: 4, relaxed_ratio: 1.5}]", r"a ratio in \[0, 1\]"),
        ("eval.serving=[{temperature: 1, thinking: true, relaxed_ratio: 0.5}]", "without relaxed_top_k"),
        ("eval.serving=[thinking-general-relaxed-k10-r0.6, thinking-general]", "is a relaxed \\(lossy\\) configuration"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [setting])
    with pytest.raises(ConfigError, match="eval.select_serving: thinking-general-relaxed-k10-r0.6 is a relaxed"):
        load_config(None, ["eval.serving=[thinking-general, thinking-general-relaxed-k10-r0.6]",
                           "eval.select_serving=thinking-general-relaxed-k10-r0.6"])
