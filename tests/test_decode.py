"""The reference speculative decoder against plain greedy decoding and the offline chain.

Models are tiny fp32 Qwen3.5-MoE (3 Gated DeltaNet layers + 1 full attention) and, once,
Qwen3-Next. A random head almost never agrees with a random base, so the acceptance tests
use an "agreeable" head: fc passes the embedding half through (plus a random share of
the hidden half), so the head predicts roughly the base's bigram-like next token and
accepts 30-50% of drafts at every step while its decoder layer and attention still shape
every logit. Rejections at chosen draft positions are forced with `draft_override`.
"""

from __future__ import annotations

import pytest
import torch

from occamy_mtp.data.windows import Window
from occamy_mtp.base.fastdecode import StaticHeadRunner
from occamy_mtp.evaluation.decode import BaseRunner, HeadRunner, greedy_decode, speculative_decode
from occamy_mtp.evaluation.offline import SELF_GENERATED, chain_outcomes, evaluate_head
from occamy_mtp.evaluation.metrics import counts_from_outcomes
from occamy_mtp.testing.checkpoints import random_models, tiny_text_config
from occamy_mtp.testing.numerics import assert_close, rounding_bound

HIDDEN_SHARE = 0.3  # scale of the agreeable head's random fc columns on the hidden half


pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

# Rounding bounds (occamy_mtp.testing.numerics), float32 throughout. The tiny base has 4
# layers of about 12 reductions each, and its Gated DeltaNet carries a running state over
# up to MAX_TOKENS positions; the head's 3-step chain runs about 15 reductions a step. The
# widest reduction sums 2 x hidden terms (64); the log-softmax sums the vocabulary.
MAX_TOKENS = 32
BASE_REDUCTIONS = 4 * 12 + MAX_TOKENS
HEAD_REDUCTIONS = 3 * 15
WIDTH = 2 * 64
VOCAB = 1024


def agreeable_models(seed: int = 0, family: str = "qwen3_5_moe_text"):
    """A random fp32 base and a head that agrees with it on a fair share of positions."""
    config = tiny_text_config(family)
    base, head = random_models(config, seed)
    base.float().eval()
    head.float().eval()
    hidden = config.hidden_size
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        fc = torch.zeros(hidden, 2 * hidden)
        fc[:, :hidden] = torch.eye(hidden)
        fc[:, hidden:] = torch.randn(hidden, hidden, generator=generator) * HIDDEN_SHARE / hidden**0.5
        head.fc.weight.copy_(fc)
        head.pre_fc_norm_embedding.weight.zero_()
        head.norm.weight.copy_(base.model.norm.weight)
    return base, head


@pytest.fixture(scope="module")
def models():
    return agreeable_models()


def random_prompt(length: int, seed: int, vocab: int = 1000) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# ----------------------------------------------------------------------------------
# Token identity
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_length,seed", [(1, 0), (13, 2)])
def test_speculative_output_is_greedy_output(models, prompt_length, seed):
    base, head = models
    prompt = random_prompt(prompt_length, seed)
    reference = greedy_decode(base, prompt, 16)
    assert reference.finish_reason == "length" and len(reference.output_ids) == 16
    for draft_steps, max_new in ((1, 16), (3, 16), (2, 5)):
        result = speculative_decode(base, head, prompt, max_new, draft_steps)
        assert result.output_ids == reference.output_ids[:max_new], (draft_steps, max_new)
        assert result.finish_reason == "length"
        # The same token's logprob from a multi-token verify pass vs a one-token step: float32
        # rounding of the base forward (BASE_REDUCTIONS) and of the log-softmax over the vocabulary.
        logprobs, reference_logprobs = torch.tensor(result.logprobs), torch.tensor(reference.logprobs[:max_new])
        bound = rounding_bound(reference_logprobs, torch.float32, reductions=BASE_REDUCTIONS + 1, width=VOCAB)
        assert_close(logprobs, reference_logprobs, bound, f"logprobs, {draft_steps}-step drafts")
        assert sum(r.accepted + 1 for r in result.rounds) <= max_new  # every round emits accepted + bonus
    assert speculative_decode(base, head, prompt, 1, 3).output_ids == reference.output_ids[:1]


@pytest.mark.parametrize("reject_at", [1, 2, 3, 4])
def test_forced_rejection_at_each_draft_position(models, reject_at):
    """Drafts correct before position `reject_at`, wrong at it (4: all three correct)."""
    base, head = models
    prompt = random_prompt(7, 11)
    reference = greedy_decode(base, prompt, 14)
    text = reference.text_ids

    def override(anchor: int, step: int, token: int) -> int:
        position = anchor + step + 1  # the position this draft proposes a token for
        if position >= len(text):
            return token
        if step < reject_at:
            return text[position]
        return (text[position] + 1) % 1000 if step == reject_at else token

    result = speculative_decode(base, head, prompt, 14, 3, draft_override=override)
    assert result.output_ids == reference.output_ids
    full_rounds = [r for r in result.rounds if len(r.drafted) == 3 and r.anchor + 4 < len(text)]
    assert len(full_rounds) >= 2
    assert all(r.accepted == reject_at - 1 for r in full_rounds)
    if reject_at <= 3:
        assert result.accepted[reject_at - 1] == 0 and result.proposed[reject_at - 1] == len(result.rounds)


def test_stop_token_ends_both_decoders_at_the_same_place(models):
    base, head = models
    prompt = random_prompt(5, 3)
    reference = greedy_decode(base, prompt, 16)
    stop = reference.output_ids[9]
    first = reference.output_ids.index(stop)
    greedy = greedy_decode(base, prompt, 16, stop_token_ids={stop})
    assert greedy.output_ids == reference.output_ids[: first + 1] and greedy.finish_reason == "stop"
    for draft_steps in (1, 3):
        result = speculative_decode(base, head, prompt, 16, draft_steps, stop_token_ids={stop})
        assert result.output_ids == greedy.output_ids and result.finish_reason == "stop"
        # Nothing is counted beyond the stop token: every counted draft predicts a position in the text.
        assert all(r.anchor + 1 + min(len(r.drafted), r.accepted + 1) < len(result.text_ids) for r in result.rounds)


def test_qwen3_next_family_decodes_identically():
    base, head = agreeable_models(seed=3, family="qwen3_next")
    prompt = random_prompt(6, 4)
    reference = greedy_decode(base, prompt, 12)
    assert speculative_decode(base, head, prompt, 12, 3).output_ids == reference.output_ids


def test_bad_arguments_are_refused(models):
    base, head = models
    with pytest.raises(ValueError, match="empty"):
        greedy_decode(base, [], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_decode(base, head, [1, 2], 0)
    with pytest.raises(ValueError, match="draft_steps"):
        speculative_decode(base, head, [1, 2], 4, draft_steps=0)


# ----------------------------------------------------------------------------------
# Caches
# ----------------------------------------------------------------------------------


@torch.no_grad()
def test_base_snapshot_restore_undoes_a_verify_pass(models):
    """Gated DeltaNet conv/recurrent states and attention KV come back exactly."""
    base, _ = models
    tokens = random_prompt(14, 5)
    runner = BaseRunner(base)
    runner.forward(tokens[:9])
    snapshot = runner.snapshot()
    runner.forward([7, 8, 9, 10])  # a rejected verify pass
    runner.restore(snapshot)
    hidden, _ = runner.forward(tokens[9:])
    full = base.model(input_ids=torch.tensor([tokens]), use_cache=False).last_hidden_state[0]
    bound = rounding_bound(full[9:], torch.float32, reductions=BASE_REDUCTIONS, width=WIDTH)
    assert_close(hidden, full[9:], bound, "hidden states after restore")
    assert runner.seen == len(tokens)


@torch.no_grad()
@pytest.mark.parametrize("runner_class", [HeadRunner, StaticHeadRunner, "static, the prompt in passes"])
def test_head_chain_matches_the_offline_chain_hidden_states(models, runner_class, monkeypatch):
    """The decoder's head cache (step-1 entries of the accepted text + its own chain) gives
    the same g1..g3 as MTPHead.forward's masked all-anchor chain, at every anchor: the
    growing cache and the static one (its keys and values in fixed buffers, the chain's
    entries written past the committed ones), whose extends longer than its span (a prompt)
    run in passes of PREFILL_CHUNK anchors."""
    base, head = models
    text = greedy_decode(base, random_prompt(6, 6), 14).text_ids
    ids = torch.tensor([text])
    hidden = base.model(input_ids=ids, use_cache=False).last_hidden_state  # (1, L, D)
    greedy = base.lm_head(hidden).argmax(-1)[0]  # greedy[t] = x_{t+1} on greedy text
    steps, length = 3, len(text)
    step_tokens = torch.zeros(steps, 1, length, dtype=torch.long)
    step_tokens[0, 0, :-1] = ids[0, 1:]
    for k in range(1, steps):
        step_tokens[k, 0, : length - k] = greedy[k:]
    offline = head(step_tokens, hidden)  # (K, 1, L, D)

    if runner_class == "static, the prompt in passes":
        from occamy_mtp.base import fastdecode

        monkeypatch.setattr(fastdecode, "PREFILL_CHUNK", 2)
        runner = StaticHeadRunner(head, length, span=2)  # the first extend, of 3 anchors, in passes of 2 and 1
    else:
        runner = HeadRunner(head) if runner_class is HeadRunner else StaticHeadRunner(head, length, span=4)
    prompt_outputs = runner.extend(list(text[1:4]), hidden[0, :3])  # anchors 0..2 in one piece
    bound = rounding_bound(offline[0, 0, :3], torch.float32, reductions=HEAD_REDUCTIONS, width=WIDTH)
    assert_close(prompt_outputs, offline[0, 0, :3], bound, "step 1 at anchors 0..2")
    for anchor in range(3, length - steps - 1):
        first = runner.extend([text[anchor + 1]], hidden[0, anchor : anchor + 1])[-1]
        # Feed the chain the offline chain's tokens (greedy), whatever the head drafts.
        drafted, outputs = runner.chain(first, steps, lambda step, token: int(greedy[anchor + step]))
        assert drafted == [int(greedy[anchor + k]) for k in range(1, steps + 1)]
        bound = rounding_bound(offline[:, 0, anchor], torch.float32, reductions=HEAD_REDUCTIONS, width=WIDTH)
        assert_close(outputs, offline[:, 0, anchor], bound, f"chain at anchor {anchor}")
        assert runner.kv.get_seq_length() == anchor + 1  # the chain's entries were rolled back


def test_the_static_head_runner_drafts_as_the_head_runner(models):
    """Greedy chains (one captured graph each on a GPU) and extends of 1 to `span` tokens on the
    static buffers: the same drafts at every anchor, the outputs g1..gK and step 1's to float32
    rounding; a chain leaves the committed entries as they were."""
    base, head = models
    text = greedy_decode(base, random_prompt(5, 8), 16).text_ids
    hidden = base.model(input_ids=torch.tensor([text]), use_cache=False).last_hidden_state[0]  # (L, D)
    eager, static = HeadRunner(head), StaticHeadRunner(head, len(text), span=4)
    anchor, pieces = 0, [6, 1, 2, 3, 1, 4, 1]  # an extend per piece (the first one longer than the span: never captured)
    for size in pieces:
        size = min(size, len(text) - 2 - anchor)
        tokens, seen = list(text[anchor + 1 : anchor + 1 + size]), hidden[anchor : anchor + size]
        want, got = eager.extend(tokens, seen), static.extend(tokens, seen)
        bound = rounding_bound(want, torch.float32, reductions=HEAD_REDUCTIONS, width=WIDTH)
        assert_close(got, want, bound, f"step 1 at anchors {anchor}..{anchor + size - 1}")
        anchor += size
        for steps in (3, 1, 2):
            want_drafts, want_outputs = eager.chain(want[-1], steps)
            drafts, outputs = static.chain(got[-1], steps)
            assert drafts == want_drafts, (anchor, steps)
            bound = rounding_bound(want_outputs, torch.float32, reductions=steps * HEAD_REDUCTIONS, width=WIDTH)
            assert_close(outputs, want_outputs, bound, f"chain of {steps} at anchor {anchor - 1}")
            assert static.kv.get_seq_length() == static.anchors == anchor
    assert static.anchors == eager.anchors == anchor == sum(pieces)


# ----------------------------------------------------------------------------------
# Measured acceptance == offline chained acceptance on the same self-generated text
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_steps", [1, 3])
def test_decoder_acceptance_equals_offline_chain_at_its_anchors(models, draft_steps):
    """On greedy self-generated text the offline chain at anchor a is exactly what the
    decoder drafts from a: every accept/reject decision agrees, hence the aggregate.

    The decoder drafts only from anchors where a verification lands (a subset chosen by
    earlier outcomes); the offline figure over all anchors is a different sample, so it
    is reported beside, not asserted equal.
    """
    base, head = models
    totals = {"decoder": [[0] * draft_steps, [0] * draft_steps, 0], "offline": [[0] * draft_steps, [0] * draft_steps, 0]}
    checked = 0
    for seed in (21, 22):
        prompt = random_prompt(8, seed)
        result = speculative_decode(base, head, prompt, 26, draft_steps)
        window = Window("self-generated", 0, result.text_ids, len(prompt))
        outcome = chain_outcomes(base, head, [window], draft_steps)[0]
        scorable, accepted = [], []
        for r in result.rounds:
            steps = min(len(r.drafted), outcome.scorable[r.anchor])
            scorable.append(steps)
            accepted.append(min(outcome.accepted[r.anchor], steps))
            assert accepted[-1] == r.accepted, f"anchor {r.anchor}: offline accepted {accepted[-1]}, decoder {r.accepted}"
            checked += 1
        offline = counts_from_outcomes(scorable, accepted, draft_steps)
        assert offline == (list(result.proposed), list(result.accepted), result.drafted)
        for key, (p, a, d) in (("decoder", (result.proposed, result.accepted, result.drafted)), ("offline", offline)):
            totals[key][0] = [x + y for x, y in zip(totals[key][0], p)]
            totals[key][1] = [x + y for x, y in zip(totals[key][1], a)]
            totals[key][2] += d
        # Each base pass after the prefill emits its accepted drafts plus one token.
        assert result.base_passes == len(result.output_ids) - 1 - sum(r.accepted for r in result.rounds)
        metrics = evaluate_head(base, head, [window], draft_steps, text=SELF_GENERATED)
        assert metrics.exact and metrics.data_matches_target == 1.0
    assert totals["decoder"] == totals["offline"]
    proposed, accepted, _ = totals["decoder"]
    assert checked >= 20
    assert 0 < accepted[0] < proposed[0], "the agreeable head should accept some drafts, not all"
    if draft_steps == 3:
        assert accepted[2] > 0, "the chain should reach step 3 sometimes"


# ----------------------------------------------------------------------------------
# Sampled serving: the decoder's counts against their expectation
# ----------------------------------------------------------------------------------

# |z| bound of a check that holds: the z-scores are means of 120 independent mean-0
# differences over their estimated standard error, nearly normal; beyond 4.5 a correct
# decoder lands with probability 7e-6.
Z_BOUND = 4.5
LOGIT_SCALE = 8  # sharpens the random base (and the head, which shares its lm_head) so that drafts are accepted


@pytest.fixture(scope="module")
def sharp_models():
    base, head = agreeable_models(seed=5)
    with torch.no_grad():
        base.lm_head.weight.mul_(LOGIT_SCALE)
    return base, head


@pytest.mark.parametrize("draft", ["greedy", "sampled"])
def test_sampled_decoding_converges_to_its_expected_counts(sharp_models, draft):
    """The engines' rejection sampling (seeded) against the library's exact expectation given each
    text it wrote; the same decodes against the expectation of another temperature fail."""
    from occamy_mtp.config import Serving
    from occamy_mtp.evaluation.decoder_check import sampled_decoder_check, sampled_decodes

    base, head = sharp_models
    serving = Serving(temperature=0.5, top_p=0.9, draft=draft)
    windows = [Window("prompt", 0, tuple(random_prompt(7, seed)), 7) for seed in (51, 52, 53)]
    decodes = sampled_decodes(base, head, windows, 3, 10, set(), serving, range(40))
    assert len({d.window.input_ids for d in decodes}) > 60  # the seeds draw different texts
    check = sampled_decoder_check(base, head, decodes, 3, 10, serving)
    measured, expected = check["measured"], check["expected"]
    assert 0.05 < measured["acceptance"][0] < 0.95 and measured["accepted"][1] > 0  # drafts accepted and rejected, step 2 reached
    assert all(abs(z) < Z_BOUND for z in check["z"].values()), check["z"]
    if draft == "greedy":  # given the text, the walk of greedy drafts is certain
        assert check["largest_passes_difference"] < 1e-9
    wrong = sampled_decoder_check(base, head, decodes, 3, 10, Serving(temperature=1.0, top_p=0.9, draft=draft))
    assert abs(wrong["z"]["accepted"]) > Z_BOUND, (wrong["z"], expected["acceptance"], wrong["expected"]["acceptance"])


def test_sampled_decodes_draw_a_stream_per_prompt_and_head():
    """The same prompt under two conversations, or under two streams (heads), is decoded from other draws;
    the same window, seed and stream, from the same ones. Shared draws across prompts would make the texts'
    differences from their expectation dependent, which sampled_decoder_check's z-score takes as independent."""
    from occamy_mtp.config import Serving
    from occamy_mtp.evaluation.decoder_check import sampled_decodes

    base, head = agreeable_models(seed=6)
    serving = Serving(temperature=1.0)
    prompt = tuple(random_prompt(5, 62))
    windows = [Window("first", 0, prompt, 5), Window("second", 0, prompt, 5)]

    def texts(stream, pick=windows):
        return [d.window.input_ids for d in sampled_decodes(base, head, pick, 2, 12, set(), serving, range(6), stream=stream)]

    donor = texts("donor")
    assert donor == texts("donor")
    assert donor[:6] != donor[6:]  # one prompt, two conversations: their own draws
    assert donor != texts("trained")
    assert texts("donor", windows[:1]) == donor[:6]  # a window's draws do not depend on the windows beside it


def test_sampled_decoding_is_seeded():
    from occamy_mtp.config import Serving

    base, head = agreeable_models(seed=6)
    serving = Serving(temperature=0.9, draft="sampled")
    prompt = random_prompt(5, 61)
    first = speculative_decode(base, head, prompt, 8, 2, serving=serving, seed=3)
    assert speculative_decode(base, head, prompt, 8, 2, serving=serving, seed=3) == first
    others = {speculative_decode(base, head, prompt, 8, 2, serving=serving, seed=s).output_ids for s in range(4, 12)}
    assert len(others | {first.output_ids}) > 1


def test_the_reference_server_decodes_every_request_through_one_runner_pair(models):
    """The server answers one request at a time through one pair of runners (made anew only for a
    request that needs more positions): each answer is what a decode of its own gives."""
    from occamy_mtp.serve.reference_server import SPECULATIVE, ReferenceModel

    base, head = models
    server = ReferenceModel(base, head, None, SPECULATIVE, 3, set(), "m")
    requests = [(random_prompt(5, 1), 6), (random_prompt(11, 2), 12), (random_prompt(4, 3), 5), (random_prompt(9, 4), 9)]
    pairs = []
    for prompt, max_tokens in requests:
        answer = server.generate(prompt, max_tokens)
        alone = speculative_decode(base, head, prompt, max_tokens, 3)
        assert answer.output_ids == list(alone.output_ids) and answer.rounds == [(len(r.drafted), r.accepted) for r in alone.rounds]
        pairs.append(server._runners)
    assert pairs[0] is not pairs[1] and pairs[1] is pairs[2] is pairs[3]  # anew for the longer request only
