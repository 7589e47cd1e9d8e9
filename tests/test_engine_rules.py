"""Each engine's penalty rule in verification (issue 60, item 1): vLLM penalizes the j-th drafted
position over the output and the drafts before it, SGLang every position of a round over the output
committed before the round. Checked against a brute-force enumeration of each engine's round on a
tiny vocabulary, and on the tiny model against plain references."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from occamy_mtp import sampling
from occamy_mtp.config import ConfigError, PRESETS, Serving, load_config
from occamy_mtp.evaluation.offline import _run_batch_sampled
from occamy_mtp.evaluation.served import _ceiling_batch
from occamy_mtp.selfgen.store import context_of, self_generate, with_continuation
from tests.test_penalties import STRONG, models, plain_penalized, prompts  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

VOCAB = 4
_generator = torch.Generator().manual_seed(3)
BASE = (torch.randn(VOCAB, VOCAB, generator=_generator) * 2).tolist()  # the base's logits after each token (a Markov base)
HEAD = (torch.randn(3, VOCAB, VOCAB, generator=_generator) * 2).tolist()  # the head's at step j after each token
PROMPT, OUTPUT = [0], [1, 2, 1]  # the request's prompt and the output committed before the round


def _softmax(logits: list[float], temperature: float, top_k: int) -> list[float]:
    scaled = [x / temperature for x in logits]
    kth = sorted(scaled, reverse=True)[top_k - 1] if 0 < top_k < len(scaled) else -math.inf
    weights = [math.exp(x) if x >= kth else 0.0 for x in scaled]
    return [w / sum(weights) for w in weights]


def engine_round(serving: Serving, engine: str, steps: int) -> float:
    """The expected drafts a round accepts, every draft and coin enumerated, as `engine` verifies: the target's
    p at the j-th position penalized over the output and drafts 1..j-1 (vllm) or the output alone (sglang)."""
    def expected(drafts: list[int], j: int) -> float:
        if j == steps:
            return 0.0
        last = (OUTPUT + drafts)[-1]
        history = OUTPUT + drafts if engine == "vllm" else OUTPUT
        p = _softmax(plain_penalized(BASE[last], history, PROMPT, serving.presence_penalty, serving.frequency_penalty,
                                     serving.repetition_penalty), serving.temperature, serving.top_k)
        if serving.draft == "greedy":
            q = [float(d == max(range(VOCAB), key=lambda t: HEAD[j][last][t])) for d in range(VOCAB)]
        else:
            q = _softmax(HEAD[j][last], serving.temperature, 0)
        return sum(q[d] * min(1.0, p[d] / q[d]) * (1.0 + expected(drafts + [d], j + 1)) for d in range(VOCAB) if q[d] > 0)

    return expected([], 0)


def library_round(serving: Serving, steps: int) -> float:
    """The same round as the library measures it: over every text the round can emit, weighted by its
    probability there, the chained acceptance given the text (`sampling.acceptance_given`) with the
    penalties' history where `sampling.verified_history_ends` puts it."""
    total = 0.0
    anchor = len(PROMPT) + len(OUTPUT) - 2  # x_{anchor+1} is the output's last token
    for text in itertools.product(range(VOCAB), repeat=steps):
        ids = torch.tensor([PROMPT + OUTPUT + list(text)])
        weight, reached, accepted = 1.0, 1.0, 0.0
        for j in range(steps):
            end = sampling.verified_history_ends(serving, torch.tensor([anchor]), j)
            history = sampling.answer_histories(ids, torch.tensor([len(PROMPT)]), torch.tensor([0]), end)
            last = int(ids[0, anchor + j + 1])
            p = sampling.base_probs(torch.tensor([BASE[last]]), serving, history).double()
            q = sampling.head_probs(torch.tensor([HEAD[j][last]]), serving).double()
            token = torch.tensor([text[j]])
            weight *= float(p[0, text[j]])
            reached *= float(sampling.acceptance_given(p, q, token)[0])
            accepted += reached
        total += weight * accepted
    return total


PENALIZED = Serving(temperature=1.0, top_k=3, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.2)


@pytest.mark.parametrize("draft", ["greedy", "sampled"])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_each_engine_s_round_is_the_brute_force_enumeration(draft, steps):
    for engine in ("vllm", "sglang"):
        serving = Serving(**{**PENALIZED.__dict__, "draft": draft, "engine": engine})
        assert library_round(serving, steps) == pytest.approx(engine_round(serving, engine, steps), abs=1e-6), engine
    vllm, sglang = (engine_round(Serving(**{**PENALIZED.__dict__, "draft": draft}), e, steps) for e in ("vllm", "sglang"))
    if steps == 1:  # the first draft is verified over the same output under both
        assert vllm == pytest.approx(sglang, abs=1e-12)
    else:  # the rules differ here, so a library that confused them would fail above
        assert abs(vllm - sglang) > 1e-3


def test_without_penalties_the_rules_agree():
    plain = Serving(temperature=1.0, top_k=3, draft="sampled")
    for steps in (2, 3):
        assert engine_round(plain, "vllm", steps) == pytest.approx(engine_round(plain, "sglang", steps), abs=1e-12)
        assert library_round(plain, steps) == pytest.approx(library_round(Serving(**{**plain.__dict__, "engine": "sglang"}),
                                                                          steps), abs=1e-12)


@torch.no_grad()
def test_the_tiny_model_s_odds_and_ceiling_follow_the_rule(models):  # noqa: F811
    """On the tiny model: SGLang's odds equal vLLM's at step 1 and differ at step 2, and the ceiling at step 2
    is p penalized over the answer before the round (the token before the position left out)."""
    base, head = models
    sglang = Serving(**{**STRONG.__dict__, "engine": "sglang"})
    windows = prompts(3)
    written = self_generate(base, [context_of(w) for w in windows], 8, stop_token_ids=set(), batch_size=3,
                            sampling=sampling.text_sampling(STRONG, seed=0))
    windows = [with_continuation(w, c) for w, c in zip(windows, written)]
    cpu = torch.device("cpu")
    vllm_odds, sglang_odds = (_run_batch_sampled(base, head, windows, 2, cpu, s) for s in (STRONG, sglang))
    assert torch.equal(vllm_odds.expected[0], sglang_odds.expected[0]) and torch.equal(vllm_odds.given[0], sglang_odds.given[0])
    assert not torch.allclose(vllm_odds.expected[1], sglang_odds.expected[1])
    ceiling = _ceiling_batch(base, head, windows, cpu, sglang, steps=2)
    plain = _ceiling_batch(base, head, windows, cpu, STRONG, steps=2)
    assert all(text.later == () for text in plain)  # vLLM's steps all read the position's own p
    for row, window in enumerate(windows):
        ids, start = list(window.input_ids), window.answer_start
        assert ceiling[row].hit == plain[row].hit and ceiling[row].best == plain[row].best  # step 1 alike
        hit, best = ceiling[row].later[0]
        for t in range(start + 2, len(ids)):  # x_t drafted at step 2, from the anchor t - 3: the round began after x_{t-2}
            logits = base(input_ids=torch.tensor([ids[:t]]), use_cache=False).logits[0, -1].float()
            p = sampling.processed_probs(torch.tensor(plain_penalized(logits.tolist(), ids[start : t - 1], ids[:start], 2.0, 0.5,
                                                                      1.3))[None], 1.0, 1.0, 0)[0]
            assert hit[t] == float(int(p.argmax()) == ids[t]) and best[t] == pytest.approx(float(p.max()), abs=1e-5)


def test_the_engine_is_named_by_a_suffix_or_a_setting_and_an_unknown_one_is_refused():
    config = load_config(None, ["eval.serving=[thinking-general, thinking-general-sglang, "
                                "{temperature: 0.7, presence_penalty: 1, engine: sglang}]"])
    assert [s.label() for s in config.eval.serving] == ["thinking-general", "thinking-general-sglang", "t0.7-pp1-sglang"]
    assert config.eval.serving[1] == Serving(**{**PRESETS["thinking-general"].__dict__, "engine": "sglang"})
    assert config.eval.serving[1].round_start_penalties and not config.eval.serving[0].round_start_penalties
    with pytest.raises(ConfigError, match=r"eval.serving\[0\].engine: expected vllm or sglang, got 'trtllm'"):
        load_config(None, ["eval.serving=[{temperature: 1, engine: trtllm}]"])
    with pytest.raises(ConfigError, match="unknown serving preset 'thinking-general-trtllm'"):
        load_config(None, ["eval.serving=[thinking-general-trtllm]"])
    # at its default the engine stays out of the fingerprint: runs fingerprinted before it keep theirs
    selected = load_config(None, ["train.select_every_steps=64", "eval.serving=[instruct-general]"]).fingerprinted()
    assert "engine" not in selected["eval.selected_serving"]
    chosen = load_config(None, ["train.select_every_steps=64", "eval.serving=[instruct-general-sglang]"]).fingerprinted()
    assert chosen["eval.selected_serving"]["engine"] == "sglang"
