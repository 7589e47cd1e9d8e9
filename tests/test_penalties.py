"""Serving presets and penalties (issue 44, item 1): the presets by name, the refusals, and the
penalties as vLLM applies them in verification, against plain references."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from occamy_mtp import sampling
from occamy_mtp.config import PRESETS, ConfigError, Serving, load_config
from occamy_mtp.data.windows import Window
from occamy_mtp.evaluation.offline import _run_batch_sampled
from occamy_mtp.evaluation.served import _ceiling_batch
from occamy_mtp.selfgen.store import context_of, context_uniforms, self_generate, with_continuation
from occamy_mtp.testing.checkpoints import random_models, tiny_text_config

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

INSTRUCT = PRESETS["instruct-general"]  # t0.7, top-p 0.8, top-k 20, presence 1.5


# ---------------------------------------------------------------- the presets


def test_presets_by_name_beside_explicit_settings():
    config = load_config(None, ["eval.serving=[{temperature: 0}, instruct-general, {temperature: 1, top_k: 40, "
                                "presence_penalty: 2}]"])
    assert [s.label() for s in config.eval.serving] == ["greedy", "instruct-general", "instruct-reasoning"]
    assert config.eval.serving[1] == Serving(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)
    assert Serving(temperature=1.0, top_p=0.9, presence_penalty=1.0).label() == "t1-p0.9-pp1"


@pytest.mark.parametrize("setting, message", [
    ("eval.serving=[instruct-genral]", "unknown serving preset 'instruct-genral'; expected greedy or one of thinking-general, "
                                       "thinking-coding, instruct-general, instruct-reasoning"),
    ("eval.serving=[{temperature: 0.7, min_p: 0.05}]", "vLLM refuses min_p with speculative decoding"),
    ("eval.serving=[{temperature: 0, presence_penalty: 1}]", "greedy decoding under penalties is not modelled"),
    ("eval.serving=[{temperature: 0.7, presence_penalty: 3}]", r"presence_penalty: expected a number in \[-2, 2\]"),
    ("eval.serving=[{temperature: 0.7, repetition_penalty: 0}]", "repetition_penalty: expected a finite number > 0"),
])
def test_refused_serving_settings_name_the_setting_and_the_reason(setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [setting])


def test_a_loss_that_reads_p_is_taken_under_penalties_and_refused_under_greedy_selection():
    for loss in ("kl", "tv", "top1-certainty", "top1-margin"):
        assert load_config(None, ["eval.serving=[instruct-general]", f"train.loss={loss}"]).train.loss == loss
        with pytest.raises(ConfigError, match=f"train.loss: {loss} reads the base's processed distribution .*greedy"):
            load_config(None, ["eval.serving=[greedy, instruct-general]", f"train.loss={loss}"])


def test_a_store_s_identity_names_penalties_only_when_set():
    plain = sampling.TextSampling(0.7, 0.8, 0, 0)
    assert plain.to_dict() == {"temperature": 0.7, "top_p": 0.8, "top_k": 0, "seed": 0}  # as stores before penalties
    penalized = sampling.text_sampling(INSTRUCT, seed=0)
    assert penalized.to_dict() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "seed": 0, "presence_penalty": 1.5}
    assert penalized.label() == "t0.7-p0.8-k20-pp1.5-seed0"


def test_servers_are_asked_with_the_penalties():
    from occamy_mtp.engines.completions import Request, request_body

    request = Request(8, frozenset({2}), 100, 10.0, 1, sampling=sampling.text_sampling(INSTRUCT, seed=0))
    body = request_body("m", [5, 6], request)
    assert body["presence_penalty"] == 1.5 and "frequency_penalty" not in body and body["top_k"] == 20


# ---------------------------------------------------------------- the penalties


def plain_penalized(logits: list[float], answer: list[int], prompt: list[int], presence: float, frequency: float,
                    repetition: float) -> list[float]:
    """vLLM's definition, token by token: repetition over prompt and answer, then frequency, then presence."""
    out = []
    for token, logit in enumerate(logits):
        if token in answer or token in prompt:
            logit = logit / repetition if logit > 0 else logit * repetition
        count = answer.count(token)
        out.append(logit - frequency * count - presence * (count > 0))
    return out


@pytest.mark.parametrize("presence, frequency, repetition", [(1.5, 0, 1), (0, 0.7, 1), (0, 0, 1.3), (2.0, -0.5, 1.1)])
def test_penalties_are_vllm_s_definition(presence, frequency, repetition):
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 9, generator=generator) * 3
    answers = [[3, 3, 5], [], [0, 8, 8, 8], [1]]
    prompts = [[2], [2, 4], [], [1, 7]]
    width = max(map(len, answers + prompts))
    pad = lambda rows: torch.tensor([r + [-1] * (width - len(r)) for r in rows])  # noqa: E731
    got = sampling.penalized(logits, (pad(answers), pad(prompts)), presence, frequency, repetition)
    for row in range(4):
        want = plain_penalized(logits[row].tolist(), answers[row], prompts[row], presence, frequency, repetition)
        # float32 against Python floats: a few ulps of logits of size ~10.
        assert got[row].tolist() == pytest.approx(want, abs=1e-5)
    assert not torch.equal(got, logits)  # a penalty that does nothing would pass the rest


def test_histories_are_the_answer_before_each_position_and_the_prompt():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]])
    answer, prompt = sampling.answer_histories(ids, torch.tensor([2, 4]), torch.tensor([0, 1, 0]), torch.tensor([2, 5, 5]))
    assert answer.tolist() == [[-1] * 6, [-1, -1, -1, -1, 24, -1], [-1, -1, 12, 13, 14, -1]]
    assert prompt.tolist() == [[10, 11, -1, -1, -1, -1], [20, 21, 22, 23, -1, -1], [10, 11, -1, -1, -1, -1]]


# ---------------------------------------------------------------- the base writes, and is measured, under penalties


@pytest.fixture(scope="module")
def models():
    base, head = random_models(tiny_text_config(), seed=9)
    return base.float().eval(), head.float().eval()


def prompts(count: int) -> list[Window]:
    generator = torch.Generator().manual_seed(4)
    return [Window(f"w{n}", 0, tuple(torch.randint(0, 1000, (5 + 2 * n,), generator=generator).tolist()), 5 + 2 * n)
            for n in range(count)]


# Enough penalty that the text differs from the unpenalized one (checked below), on a tiny random base.
STRONG = Serving(temperature=1.0, presence_penalty=2.0, frequency_penalty=0.5, repetition_penalty=1.3)


@torch.no_grad()
def test_the_base_writes_penalized_text_as_a_plain_loop_would(models):
    base, _ = models
    windows = prompts(3)
    text = sampling.text_sampling(STRONG, seed=0)
    contexts = [context_of(w) for w in windows]
    written = self_generate(base, contexts, 10, stop_token_ids=set(), batch_size=3, sampling=text)
    unpenalized = self_generate(base, contexts, 10, stop_token_ids=set(), batch_size=3,
                                sampling=sampling.TextSampling(1.0, 1.0, 0, 0))
    assert [c.tokens for c in written] != [c.tokens for c in unpenalized]
    for context, continuation, uniforms in zip(contexts, written, context_uniforms(text, contexts, 10)):
        ids = list(context)
        for step in range(10):  # a full forward a token, the penalties in Python
            logits = base(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            logits = torch.tensor(plain_penalized(logits.tolist(), ids[len(context):], list(context), 2.0, 0.5, 1.3))
            p = sampling.processed_probs(logits[None], 1.0, 1.0, 0)
            ids.append(int(sampling.draw(p, uniforms[step : step + 1])[0]))
        assert tuple(ids[len(context):]) == continuation.tokens


@torch.no_grad()
def test_odds_and_ceiling_under_penalties_are_the_plain_reference(models):
    base, head = models
    text = sampling.text_sampling(STRONG, seed=0)
    windows = prompts(3)
    written = self_generate(base, [context_of(w) for w in windows], 8, stop_token_ids=set(), batch_size=3, sampling=text)
    windows = [with_continuation(w, c) for w, c in zip(windows, written)]
    odds = _run_batch_sampled(base, head, windows, 2, torch.device("cpu"), STRONG)
    ceiling = _ceiling_batch(base, head, windows, torch.device("cpu"), STRONG)
    unpenalized = _run_batch_sampled(base, head, windows, 2, torch.device("cpu"), Serving(temperature=1.0))
    assert not torch.allclose(odds.expected, unpenalized.expected)
    for row, window in enumerate(windows):
        ids, start = list(window.input_ids), window.answer_start
        full = torch.tensor([ids])
        hidden = base.model(input_ids=full, use_cache=False).last_hidden_state  # (1, L, D)
        step_tokens = torch.zeros(1, 1, len(ids), dtype=torch.long)
        step_tokens[0, 0, :-1] = full[0, 1:]
        drafts = head.logits(head(step_tokens, hidden)[0, 0]).argmax(-1)  # (L,): step 1's draft at each anchor
        for t in range(start + 1, len(ids)):  # p at t, from the prefix, penalized over the answer before t
            logits = base(input_ids=torch.tensor([ids[:t]]), use_cache=False).logits[0, -1].float()
            p = sampling.processed_probs(torch.tensor(plain_penalized(logits.tolist(), ids[start:t], ids[:start], 2.0, 0.5,
                                                                      1.3))[None], 1.0, 1.0, 0)[0]
            hit, best = ceiling[row].hit, ceiling[row].best
            assert hit[t] == float(int(p.argmax()) == ids[t]) and best[t] == pytest.approx(float(p.max()), abs=1e-5)
            anchor = t - 2  # step 1 at anchor t - 2 drafts x_t: the head's argmax d, accepted with p(d)
            if odds.scored[0, row, anchor]:
                d = int(drafts[anchor])
                assert float(odds.expected[0, row, anchor]) == pytest.approx(float(p[d]), abs=1e-5)
                assert float(odds.given[0, row, anchor]) == float(d == ids[t])


def test_runs_fingerprinted_before_penalties_keep_their_fingerprint():
    """At their defaults the new settings stay out of the fingerprint, so that a run trained before them
    resumes and exports; set, they are in it."""
    before = load_config(None, ["train.select_every_steps=64"]).fingerprinted()
    assert "self_generate_presence_penalty" not in before["data"]
    assert set(before["eval.selected_serving"]) == {"temperature", "top_p", "top_k", "draft"}
    after = load_config(None, ["data.train_text={temperature: 1, presence_penalty: 1.5}",
                               "eval.serving=[instruct-general]", "train.select_every_steps=64"]).fingerprinted()
    assert after["data"]["self_generate_presence_penalty"] == 1.5
    assert after["eval.selected_serving"]["presence_penalty"] == 1.5


@torch.no_grad()
def test_top1_training_fits_the_base_s_choice_under_the_penalties(models):
    """Under a penalized selected configuration the base's own choice (what top-1 trains towards, and
    what a perfect drafter drafts) is the argmax of its penalized logits, position by position."""
    from occamy_mtp.model.loss import collate, served_choice

    base, head = models
    # contexts whose greedy text repeats its top token, which the penalties then push down
    windows = [Window("a", 0, (5, 6, 7, 8, 9), 5), Window("b", 0, (7, 8, 9), 3), Window("c", 0, (3, 5, 6, 7, 8, 9), 6)]
    written = self_generate(base, [context_of(w) for w in windows], 12, stop_token_ids=set(), batch_size=3)
    windows = [with_continuation(w, c) for w, c in zip(windows, written)]
    batch = collate(windows, torch.device("cpu"))
    outputs = base(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
    hidden = outputs.hidden_states[-1]  # post-norm, as the targets' `hidden`
    greedy = base.lm_head(hidden).argmax(-1)
    choice = served_choice(head, hidden, greedy, batch, STRONG)
    assert torch.equal(served_choice(head, hidden, greedy, batch, Serving(temperature=0.7)), greedy)  # no penalty
    changed = 0
    for row, window in enumerate(windows):
        ids, start = list(window.input_ids), window.answer_start
        for t in range(start - 1, len(ids) - 1):  # choice_t predicts x_{t+1}, penalized over x_start..x_t
            logits = head.logits(hidden[row, t]).float().tolist()
            want = max(range(len(logits)), key=lambda v: (plain_penalized(logits, ids[start : t + 1], ids[:start], 2.0, 0.5,
                                                                          1.3)[v], -v))
            assert int(choice[row, t]) == want
            changed += int(choice[row, t]) != int(greedy[row, t])
        assert torch.equal(choice[row, : start - 1], greedy[row, : start - 1])  # the prompt: untouched
    assert changed > 0  # the penalties changed some choices, so the comparison above could fail


@torch.no_grad()
def test_a_shared_source_gives_the_same_odds_and_computes_p_once(models, monkeypatch):
    """Under a top-k preset with penalties, a second pass over the same texts through a `SharedTargets`
    source (a second head at export, a later selection step) gives the odds of a pass on the plain base,
    bit for bit, without computing the base's distribution again."""
    from occamy_mtp.evaluation import offline
    from occamy_mtp.targets.base import OnlineTargets, SharedTargets

    base, head = models
    # Sampled drafts: q is the head's whole softmax, so every pair's odds are above 0 and move with the head.
    serving = dataclasses.replace(INSTRUCT, draft="sampled")
    windows = prompts(3)
    text = sampling.text_sampling(serving, seed=0)
    written = self_generate(base, [context_of(w) for w in windows], 8, stop_token_ids=set(), batch_size=3, sampling=text)
    windows = [with_continuation(w, c) for w, c in zip(windows, written)]
    plain = _run_batch_sampled(base, head, windows, 2, torch.device("cpu"), serving)
    computed = []
    original = offline.base_distribution
    monkeypatch.setattr(offline, "base_distribution", lambda *args: computed.append(1) or original(*args))
    shared = SharedTargets(OnlineTargets(base))
    first = _run_batch_sampled(shared, head, windows, 2, torch.device("cpu"), serving)
    once = len(computed)
    trained = head.fc.weight.clone()
    try:
        head.fc.weight.add_(torch.randn(trained.shape, generator=torch.Generator().manual_seed(1)))  # another head: its drafts change, the base's p does not
        second = _run_batch_sampled(shared, head, windows, 2, torch.device("cpu"), serving)
        after_second = len(computed)
        head_only = _run_batch_sampled(base, head, windows, 2, torch.device("cpu"), serving)
    finally:
        head.fc.weight.copy_(trained)
    assert once == 2 and after_second == once  # a chunk a step, once
    for field in ("expected", "given", "scored"):
        assert torch.equal(getattr(first, field), getattr(plain, field)), field
    assert bool((first.expected[first.scored] > 0).all()) and not torch.equal(second.expected, first.expected)
    assert torch.equal(second.expected, head_only.expected) and torch.equal(second.given, head_only.given)
