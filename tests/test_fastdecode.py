"""The static batch decoder (`occamy_mtp.base.fastdecode`) against the generator it replaces on a GPU
(`generate.plain_decode`) and against the base's full forward, on tiny float32 models."""

from __future__ import annotations

import pytest
import torch

from occamy_mtp.base.fastdecode import BatchDecoder, StaticHeadRunner, fast_plain_decode
from occamy_mtp.base.generate import plain_decode
from occamy_mtp.testing.checkpoints import random_models, tiny_text_config
from occamy_mtp.testing.interpreter import run_interpreted
from occamy_mtp.testing.numerics import assert_close, rounding_bound

pytestmark = pytest.mark.usefixtures("single_thread")

# Rounding bound of the hidden states (occamy_mtp.testing.numerics), float32: the tiny base's 4
# layers of about 12 reductions each, plus the Gated DeltaNet's running state over up to
# MAX_TOKENS positions, the widest reduction over 2 x hidden terms.
MAX_TOKENS = 40
REDUCTIONS = 4 * 12 + MAX_TOKENS


@pytest.fixture(scope="module")
def base():
    model, _ = random_models(tiny_text_config(), seed=3)
    return model.float().eval().requires_grad_(False)


def prompts_of(lengths, seed=0, vocab=1000):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def test_the_batch_decoder_writes_plain_decode_s_tokens(base):
    prompts = prompts_of((1, 9, 4, 17, 2))
    expected = plain_decode(base, prompts, max_new_tokens=12, eos_token_ids=set(), batch_size=5)
    got = fast_plain_decode(base, prompts, max_new_tokens=12, eos_token_ids=set(), batch_size=3)
    assert got == expected and all(len(c) == 12 for c in got)


def test_the_batch_decoder_samples_plain_decode_s_tokens(base):
    """Sampled: each row draws from its own stream at its own positions, as plain_decode does."""
    from occamy_mtp.sampling import TextSampling

    sharp = type(base)(base.config).float().eval().requires_grad_(False)
    sharp.load_state_dict(base.state_dict())
    with torch.no_grad():
        sharp.lm_head.weight.mul_(6)
    sampling = TextSampling(temperature=0.7, top_p=0.8, top_k=50, seed=1)
    prompts = prompts_of((1, 9, 4, 17, 2), seed=2)
    uniforms = [sampling.uniforms(f"row-{i}", 12) for i in range(len(prompts))]
    expected = plain_decode(sharp, prompts, max_new_tokens=12, eos_token_ids=set(), batch_size=5, sampling=sampling,
                               uniforms=uniforms)
    assert expected != plain_decode(sharp, prompts, max_new_tokens=12, eos_token_ids=set(), batch_size=5)
    got = fast_plain_decode(sharp, prompts, max_new_tokens=12, eos_token_ids=set(), batch_size=3, sampling=sampling,
                               uniforms=uniforms)
    assert got == expected


def test_the_batch_decoder_samples_under_penalties_as_plain_decode_does(base):
    """Penalized sampling (a preset's presence penalty, and the others): each row's answer so far and its
    prompt, read from the decoder's fixed buffers, penalize its logits as plain_decode's do."""
    from occamy_mtp.sampling import TextSampling

    sharp = type(base)(base.config).float().eval().requires_grad_(False)
    sharp.load_state_dict(base.state_dict())
    with torch.no_grad():
        sharp.lm_head.weight.mul_(6)
    penalized = TextSampling(temperature=0.7, top_p=0.9, top_k=50, seed=1, presence_penalty=1.5, frequency_penalty=0.5,
                             repetition_penalty=1.2)
    prompts = prompts_of((1, 9, 4, 17, 2), seed=2)
    uniforms = [penalized.uniforms(f"row-{i}", 12) for i in range(len(prompts))]
    kwargs = dict(max_new_tokens=12, eos_token_ids=set(), sampling=penalized, uniforms=uniforms)
    expected = plain_decode(sharp, prompts, batch_size=5, **kwargs)
    plain = TextSampling(temperature=0.7, top_p=0.9, top_k=50, seed=1)
    assert expected != plain_decode(sharp, prompts, batch_size=5, **{**kwargs, "sampling": plain})
    assert fast_plain_decode(sharp, prompts, batch_size=3, **kwargs) == expected


def test_it_stops_at_the_stop_tokens_as_plain_decode_does(base):
    prompts = prompts_of((5, 3, 11), seed=1)
    free = plain_decode(base, prompts, max_new_tokens=10, eos_token_ids=set(), batch_size=3)
    stop = {free[0][3], free[2][6]}  # tokens the base writes: rows stop there
    expected = plain_decode(base, prompts, max_new_tokens=10, eos_token_ids=stop, batch_size=3)
    assert any(len(c) < 10 for c in expected)
    assert fast_plain_decode(base, prompts, max_new_tokens=10, eos_token_ids=stop, batch_size=3) == expected


def test_every_step_s_logits_are_the_full_forward_s(base):
    """Position by position after the prefill (which ends where the shortest prompt does), the step's
    argmax over the logits is that of one full forward over the text, and its final hidden state
    equals the forward's to float32 rounding."""
    prompts = prompts_of((6, 3), seed=2)
    decoder = BatchDecoder(base, batch=2, positions=20, cuda_graph=False)
    texts = [p + c for p, c in zip(prompts, decoder.generate(prompts, max_new_tokens=10, eos_token_ids=set()))]
    stepped = min(len(p) for p in prompts) - 1  # the first position a step fed
    for row, text in enumerate(texts):
        with torch.no_grad():
            full = base(input_ids=torch.tensor([text])).logits[0]  # (T, V)
        steps = len(text) - 1
        assert decoder.chosen[row, stepped:steps].tolist() == full[stepped:steps].argmax(-1).tolist()

    # the hidden state itself, at the last step of a single row
    hidden = {}
    decoder = BatchDecoder(base, batch=1, positions=len(texts[0]), cuda_graph=False)
    handle = base.model.norm.register_forward_hook(lambda module, args, out: hidden.__setitem__("last", out))
    try:
        decoder.generate([texts[0]], max_new_tokens=1, eos_token_ids=set())
        step_hidden = hidden["last"][0, -1]
        with torch.no_grad():
            base.model(input_ids=torch.tensor([texts[0]]))
        full_hidden = hidden["last"][0, -1]
    finally:
        handle.remove()
    bound = rounding_bound(full_hidden, torch.float32, reductions=REDUCTIONS, width=2 * base.config.hidden_size)
    assert_close(step_hidden, full_hidden, bound, "hidden state of the last position")


@pytest.mark.parametrize("chunk, rows_a_pass", [(256, 5), (4, 2), (1, 1)])
def test_a_prefill_leaves_the_state_one_step_a_token_leaves(base, monkeypatch, chunk, rows_a_pass):
    """`prefill` (a few rows and up to PREFILL_CHUNK tokens a pass, each pass's attention over the
    keys written so far, the Gated DeltaNet's chunked rule from the last pass's state) against the
    step fed the same tokens one position at a time: the same keys and values, conv windows and
    recurrent states to float32 rounding; and the decoder that prefills writes plain_decode's tokens."""
    prefill_against_steps(base, monkeypatch, chunk, rows_a_pass)


@pytest.mark.gpu
def test_a_prefill_on_gpu_leaves_the_state_one_step_a_token_leaves(monkeypatch):
    """The same on CUDA, float32: the prefill's chunked rule is fla's kernel there, the step's
    `decode_kernels`'. fla's kernel multiplies float32 in TF32 (Triton's default for a float32 dot),
    whose 10-bit mantissa is float16's: the recurrent states it leaves are held to that unit over the
    rule's two chained products a chunk (its one run with a float32 bound missed it by 12x: 6.1e-6
    against 5e-7, bench/results/decode.md); the rest to float32."""
    model, _ = random_models(tiny_text_config(), seed=3)
    prefill_against_steps(model.to("cuda").float().eval().requires_grad_(False), monkeypatch, 4, 2,
                          recurrent_unit=torch.float16, recurrent_reductions=2)


def prefill_against_steps(base, monkeypatch, chunk: int, rows_a_pass: int, recurrent_unit: torch.dtype = torch.float32,
                          recurrent_reductions: int = REDUCTIONS) -> None:
    from occamy_mtp.base import fastdecode

    prompts = prompts_of((23, 19, 30, 21, 26), seed=4)
    length = min(len(p) for p in prompts) - 1
    stepped = BatchDecoder(base, batch=5, positions=40, cuda_graph=False)
    stepped._reset(prompts)
    for _ in range(length):
        stepped.step()
    monkeypatch.setattr(fastdecode, "PREFILL_CHUNK", chunk)
    prefilled = BatchDecoder(base, batch=5, positions=40, cuda_graph=False)
    per_row = chunk * BatchDecoder.prefill_token_bytes(base.config, 40, torch.float32)
    monkeypatch.setattr(fastdecode, "PREFILL_PASS_BYTES", rows_a_pass * per_row)
    passes = []
    original = prefilled.prefill_pass
    monkeypatch.setattr(prefilled, "prefill_pass", lambda ids, rows: (
        passes.append((rows.stop - rows.start, int(prefilled.kv.position), ids.shape[1])), original(ids, rows))[1])
    prefilled._reset(prompts)
    prefilled.prefill(len(prompts), length)
    for rows, start, tokens in passes:  # each pass within its bytes, one row of one token at least
        assert rows == 1 or rows * tokens * BatchDecoder.prefill_token_bytes(base.config, start + tokens, torch.float32) <= fastdecode.PREFILL_PASS_BYTES
    for start in {start for _, start, _ in passes}:  # every row fed once from each start
        assert sum(rows for rows, at, _ in passes if at == start) == len(prompts)
    assert max(rows for rows, _, _ in passes) >= rows_a_pass and max(t for _, _, t in passes) == min(chunk, length)
    assert int(prefilled.kv.position) == int(stepped.kv.position) == length
    assert prefilled.tokens.tolist() == stepped.tokens.tolist() == [p[length] for p in prompts]
    width = 2 * base.config.hidden_size
    states = [("keys", prefilled.kv.keys, stepped.kv.keys), ("values", prefilled.kv.values, stepped.kv.values),
              ("conv windows", {0: prefilled.conv_states}, {0: stepped.conv_states}),
              ("recurrent states", {0: prefilled.recurrent_states}, {0: stepped.recurrent_states})]
    for what, got, want in states:
        for layer in want:
            unit, reductions = (recurrent_unit, recurrent_reductions) if what == "recurrent states" else (torch.float32, REDUCTIONS)
            bound = rounding_bound(want[layer], unit, reductions=reductions, width=width)
            assert_close(got[layer], want[layer], bound, f"{what} of layer {layer} after a prefill of {length} positions")
    expected = plain_decode(base, prompts, max_new_tokens=8, eos_token_ids=set(), batch_size=5)
    assert prefilled.generate(prompts, max_new_tokens=8, eos_token_ids=set()) == expected


def test_a_runner_s_prefill_is_its_forward_with_the_last_logits(base, monkeypatch):
    """`StaticRunner.prefill` (passes of PREFILL_CHUNK tokens) gives `forward`'s hidden states and the
    last position's logits, and leaves the runner where `forward` does (the next pass agrees); the
    transformers runner's `prefill` likewise."""
    from occamy_mtp.base import fastdecode
    from occamy_mtp.base.fastdecode import StaticRunner
    from occamy_mtp.evaluation.decode import BaseRunner

    monkeypatch.setattr(fastdecode, "PREFILL_CHUNK", 5)
    prompt, following = prompts_of((17, 3), seed=6)
    width = 2 * base.config.hidden_size
    for make in (lambda: StaticRunner(base, positions=24, span=4), lambda: BaseRunner(base)):
        prefilled, forwarded = make(), make()
        hidden, last = prefilled.prefill(prompt)
        want_hidden, want_logits = forwarded.forward(prompt)
        assert last.shape == want_logits[-1].shape and last.dtype == torch.float32 and prefilled.seen == forwarded.seen
        assert_close(hidden, want_hidden, rounding_bound(want_hidden, torch.float32, reductions=REDUCTIONS, width=width), "hidden")
        assert_close(last, want_logits[-1], rounding_bound(want_logits[-1], torch.float32, reductions=REDUCTIONS + 1, width=width),
                     "the last logits")
        got, want = prefilled.forward(following)[1], forwarded.forward(following)[1]
        assert_close(got, want, rounding_bound(want, torch.float32, reductions=REDUCTIONS + 1, width=width), "the next pass's logits")


def decode_through_the_kernels() -> None:
    """Run in a process started with TRITON_INTERPRET=1: the decoder's Gated DeltaNet then runs
    `decode_kernels`' Triton kernels (interpreted) on the CPU, as it runs them on a GPU."""
    from occamy_mtp.base import decode_kernels
    from occamy_mtp.base.fastdecode import StaticRunner

    model, _ = random_models(tiny_text_config(), seed=3)
    model = model.float().eval().requires_grad_(False)
    decoder = BatchDecoder(model, batch=3, positions=24, cuda_graph=False)
    assert decode_kernels.available(decoder.recurrent_states)
    prompts = prompts_of((1, 9, 4), seed=5)
    expected = plain_decode(model, prompts, max_new_tokens=8, eos_token_ids=set(), batch_size=3)
    assert decoder.generate(prompts, max_new_tokens=8, eos_token_ids=set()) == expected
    text = prompts[1] + expected[1]
    runner = StaticRunner(model, positions=len(text), span=4)  # spans of 4 through the same kernels
    logits = runner.forward(text)[1]
    assert logits[len(prompts[1]) - 1 : -1].argmax(-1).tolist() == expected[1]


def test_the_decoder_through_its_triton_kernels_writes_plain_decode_s_tokens():
    pytest.importorskip("triton")
    run_interpreted(__file__, "decode_through_the_kernels()")


def test_grouped_attention_is_transformers_attention(base):
    """gqa_decode_attention against transformers' eager attention (key/value heads repeated)."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

    from occamy_mtp.base.fastdecode import gqa_decode_attention

    generator = torch.Generator().manual_seed(4)
    query, key, value = (torch.randn(2, heads, length, 8, generator=generator) for heads, length in ((4, 1), (2, 6), (2, 6)))
    mask = torch.zeros(1, 1, 1, 6).masked_fill(torch.arange(6) > 3, torch.finfo(torch.float32).min)
    module = base.model.layers[3].self_attn
    want, _ = qwen.eager_attention_forward(module, query, key, value, mask, scaling=0.3)
    got, _ = gqa_decode_attention(module, query, key, value, mask, scaling=0.3)
    # float32: the scores' reduction over the head dim, the softmax's over the 6 keys, the weighted sum
    assert_close(got, want, rounding_bound(want, torch.float32, reductions=3, width=8), "attention")
    masked = value.clone()
    masked[:, :, 4:] += 100.0  # keys past position 3 are masked: their values must not count
    assert_close(gqa_decode_attention(module, query, key, masked, mask, scaling=0.3)[0], want,
                 rounding_bound(want, torch.float32, reductions=3, width=8), "attention, masked values changed")


def test_bad_batches_are_refused(base):
    decoder = BatchDecoder(base, batch=2, positions=8, cuda_graph=False)
    with pytest.raises(ValueError, match="1 to 2 prompts"):
        decoder.generate([[1], [2], [3]], max_new_tokens=2, eos_token_ids=set())
    with pytest.raises(ValueError, match="need 10 positions; this decoder holds 8"):
        decoder.generate([[1] * 5], max_new_tokens=6, eos_token_ids=set())
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        decoder.generate([[1], []], max_new_tokens=2, eos_token_ids=set())


@pytest.mark.gpu
def test_the_captured_step_writes_the_eager_step_s_tokens_on_gpu():
    """bf16 on the GPU, as self-generation runs (the grouped expert GEMMs take bf16 only)."""
    model, _ = random_models(tiny_text_config(), seed=3)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval().requires_grad_(False)
    prompts = prompts_of((3, 12, 7, 1, 9, 4))
    eager = fast_plain_decode(model, prompts, max_new_tokens=20, eos_token_ids=set(), batch_size=6, cuda_graph=False)
    graphed = fast_plain_decode(model, prompts, max_new_tokens=20, eos_token_ids=set(), batch_size=6, cuda_graph=True)
    reference = plain_decode(model, prompts, max_new_tokens=20, eos_token_ids=set(), batch_size=6)
    assert graphed == eager  # the graph replays the very kernels of the eager step
    # bf16: another summation order than plain_decode's (recurrent against chunked prefill,
    # grouped against looped experts) may part a row at a near tie, not most of them
    assert sum(a == b for a, b in zip(graphed, reference)) >= len(prompts) // 2


@pytest.mark.gpu
def test_the_captured_penalized_step_writes_the_eager_step_s_tokens_on_gpu():
    """The penalties (the answer's counts, the prompt's mask) are captured in the step's graph too."""
    from occamy_mtp.sampling import TextSampling

    model, _ = random_models(tiny_text_config(), seed=3)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(6)
    sampling = TextSampling(temperature=1.0, top_p=0.95, top_k=20, seed=2, presence_penalty=1.5)
    prompts = prompts_of((3, 12, 7, 1, 9, 4))
    uniforms = [sampling.uniforms(f"row-{i}", 20) for i in range(len(prompts))]
    kwargs = dict(max_new_tokens=20, eos_token_ids=set(), batch_size=6, sampling=sampling, uniforms=uniforms)
    eager = fast_plain_decode(model, prompts, cuda_graph=False, **kwargs)
    assert fast_plain_decode(model, prompts, cuda_graph=True, **kwargs) == eager
    unpenalized = TextSampling(temperature=1.0, top_p=0.95, top_k=20, seed=2)
    assert eager != fast_plain_decode(model, prompts, cuda_graph=False, **{**kwargs, "sampling": unpenalized})


@pytest.mark.gpu
def test_the_captured_sampled_step_writes_the_eager_step_s_tokens_on_gpu():
    """Sampled self-generation on the GPU: the processing (sort, top-p cut) and the draw are captured
    in the step's graph; the graph replays the eager step's tokens."""
    from occamy_mtp.sampling import TextSampling

    model, _ = random_models(tiny_text_config(), seed=3)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(6)
    sampling = TextSampling(temperature=0.7, top_p=0.8, top_k=40, seed=2)
    prompts = prompts_of((3, 12, 7, 1, 9, 4))
    uniforms = [sampling.uniforms(f"row-{i}", 20) for i in range(len(prompts))]
    kwargs = dict(max_new_tokens=20, eos_token_ids=set(), batch_size=6, sampling=sampling, uniforms=uniforms)
    eager = fast_plain_decode(model, prompts, cuda_graph=False, **kwargs)
    graphed = fast_plain_decode(model, prompts, cuda_graph=True, **kwargs)
    assert graphed == eager
    assert graphed != fast_plain_decode(model, prompts, max_new_tokens=20, eos_token_ids=set(), batch_size=6)


@pytest.mark.parametrize("draft_steps", [1, 3])
def test_the_reference_decoder_on_the_static_runner_decodes_as_on_transformers_cache(monkeypatch, draft_steps):
    """decode.speculative_decode and greedy_decode with `StaticRunner` (one step a token, the
    state snapshotted and restored around each verify) against `BaseRunner`: the same text,
    the same rounds, logprobs equal to float32 rounding."""
    from occamy_mtp.evaluation import decode
    from test_decode import agreeable_models, random_prompt

    base, head = agreeable_models(seed=1)
    prompt = random_prompt(9, seed=3)
    reference = decode.speculative_decode(base, head, prompt, 14, draft_steps)
    greedy_reference = decode.greedy_decode(base, prompt, 14)
    monkeypatch.setattr(decode, "static_decoding", lambda model: True)
    static = decode.speculative_decode(base, head, prompt, 14, draft_steps)
    assert static.output_ids == reference.output_ids and static.rounds == reference.rounds
    assert any(r.accepted < len(r.drafted) for r in static.rounds)  # rollbacks were exercised
    logprobs, want = torch.tensor(static.logprobs), torch.tensor(reference.logprobs)
    assert_close(logprobs, want, rounding_bound(want, torch.float32, reductions=REDUCTIONS + 1, width=1024), "logprobs")
    greedy = decode.greedy_decode(base, prompt, 14)
    assert greedy.output_ids == greedy_reference.output_ids and greedy.base_passes == greedy_reference.base_passes


@pytest.mark.parametrize("draft_steps", [1, 3])
def test_the_reference_decoder_on_the_static_head_runner_decodes_as_on_the_head_runner(monkeypatch, draft_steps):
    """decode.speculative_decode with `StaticHeadRunner` against `HeadRunner`, greedy (its greedy
    chains), with drafts drawn from the head (its chains step by step) and with rejections
    forced: the same text, rounds and base logprobs."""
    from occamy_mtp.config import Serving
    from occamy_mtp.evaluation import decode
    from test_decode import agreeable_models, random_prompt

    base, head = agreeable_models(seed=1)
    prompt = random_prompt(9, seed=0)  # drafts accepted whole and rejected, greedy and sampled

    def override(anchor, step, token):
        return token if (anchor + step) % 3 else (token + 1) % 1000

    cases = [{}, {"serving": Serving(temperature=0.7, top_p=0.8, draft="sampled"), "seed": 4}, {"draft_override": override}]
    reference = [decode.speculative_decode(base, head, prompt, 14, draft_steps, **case) for case in cases]
    monkeypatch.setattr(decode, "static_head_decoding", lambda model: True)
    assert isinstance(decode.decodes_runners(base, head, [9], 14, draft_steps).head, StaticHeadRunner)
    static = [decode.speculative_decode(base, head, prompt, 14, draft_steps, **case) for case in cases]
    for got, want in zip(static, reference):
        assert got.output_ids == want.output_ids and got.rounds == want.rounds and got.logprobs == want.logprobs
    assert all(any(r.accepted < len(r.drafted) for r in result.rounds) for result in static)  # rollbacks in each
    assert all(any(r.accepted == len(r.drafted) for r in result.rounds) for result in static[:2])  # whole chains accepted


@pytest.mark.gpu
def test_the_captured_head_runner_decodes_as_its_eager_passes_on_gpu():
    """On the GPU (bf16), the head runner's captured extends and greedy chains against the same
    passes run eagerly: the same texts and rounds; and after a head tensor is replaced (as a
    bench swaps heads), the next decodes read the new one (the graphs are captured again)."""
    from occamy_mtp.evaluation import decode
    from test_decode import agreeable_models, random_prompt

    base, head = agreeable_models(seed=1)
    base, head = base.to(device="cuda", dtype=torch.bfloat16), head.to(device="cuda", dtype=torch.bfloat16)
    prompts = [random_prompt(n, seed=n) for n in (9, 4, 12)]

    def decodes(runners):
        return [decode.speculative_decode(base, head, p, 14, k, runners=runners) for k in (3, 1) for p in prompts]

    captured = decode.decodes_runners(base, head, [len(p) for p in prompts], 14, 3)
    eager = decode.decodes_runners(base, head, [len(p) for p in prompts], 14, 3)
    assert isinstance(captured.head, StaticHeadRunner) and captured.head.cuda_graph
    eager.head.cuda_graph = False
    before = decodes(captured)
    assert [(r.output_ids, r.rounds) for r in before] == [(r.output_ids, r.rounds) for r in decodes(eager)]
    assert any(r.accepted for result in before for r in result.rounds)  # the head drafts the base's tokens at times
    head.fc.weight.data = head.fc.weight.data.flip(0)  # a new tensor: the old graphs would read the old one
    after = decodes(captured)
    assert [(r.output_ids, r.rounds) for r in after] == [(r.output_ids, r.rounds) for r in decodes(eager)]
    assert [r.rounds for r in after] != [r.rounds for r in before]


def _one_runner_for_many_decodes(device, monkeypatch):
    """Decodes of three prompts at 3 and at 1 draft steps, greedy and sampled, through one runner
    (`decode.decodes_runners`, as export's checks share them) and through runners each."""
    from occamy_mtp.config import Serving
    from occamy_mtp.evaluation import decode
    from test_decode import agreeable_models, random_prompt

    base, head = agreeable_models(seed=1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base, head = base.to(device=device, dtype=dtype), head.to(device=device, dtype=dtype)
    monkeypatch.setattr(decode, "static_decoding", lambda model: True)  # StaticRunner on the CPU too (eager)
    monkeypatch.setattr(decode, "static_head_decoding", lambda model: True)  # and StaticHeadRunner
    prompts = [random_prompt(n, seed=n) for n in (9, 4, 12)]
    cases = [(prompt, steps, serving) for steps in (3, 1) for prompt in prompts
             for serving in (None, Serving(temperature=0.7, top_p=0.8), Serving(temperature=0.7, top_p=0.8, draft="sampled"))]
    runners = decode.decodes_runners(base, head, [len(p) for p in prompts], 14, 3)
    shared = [decode.speculative_decode(base, head, p, 14, k, serving=s, seed=5, runners=runners) for p, k, s in cases]
    own = [decode.speculative_decode(base, head, p, 14, k, serving=s, seed=5) for p, k, s in cases]
    return shared, own


def test_one_runner_decodes_many_prompts_as_a_runner_each(monkeypatch):
    """A reset runner is a new one: the same texts and rounds (a span of 4 feeds a 1-step
    verify pass as a span of 2 does), logprobs to float32 rounding."""
    shared, own = _one_runner_for_many_decodes("cpu", monkeypatch)
    for a, b in zip(shared, own):
        assert a.output_ids == b.output_ids and a.rounds == b.rounds
        want = torch.tensor(b.logprobs)
        assert_close(torch.tensor(a.logprobs), want, rounding_bound(want, torch.float32, reductions=REDUCTIONS + 1, width=1024), "logprobs")
    assert len({a.output_ids for a in shared}) > 3  # the decodes differ: a stale state would show


@pytest.mark.gpu
def test_one_runner_decodes_many_prompts_as_a_runner_each_on_gpu(monkeypatch):
    """On the GPU, where the runner's graphs are captured once and replayed by every decode:
    bf16, so a verify pass of 2 in a span-4 runner may sum in another order than a span-2
    runner and part a text at a near tie; most texts are the same."""
    shared, own = _one_runner_for_many_decodes("cuda", monkeypatch)
    assert sum(a.output_ids == b.output_ids for a, b in zip(shared, own)) >= len(own) * 3 // 4


def test_a_graph_is_captured_only_for_a_bfloat16_base_on_cuda(base):
    """torch's grouped GEMM copies to the host outside bf16, which a capture refuses: such a
    base decodes eagerly (the default), and asking for a graph is an error, not a crash mid-capture."""
    assert not BatchDecoder(base, batch=1, positions=4).cuda_graph
    with pytest.raises(ValueError, match="cuda_graph=True needs a bfloat16 base on CUDA"):
        BatchDecoder(base, batch=1, positions=4, cuda_graph=True)


@pytest.mark.parametrize("span, chunks", [(4, (5, 3, 1, 4, 4)), (3, (17,)), (1, (6, 2))])
def test_a_span_pass_is_one_step_a_token_and_the_full_forward(base, span, chunks):
    """`StaticRunner` feeding the text in spans (what a verify pass is) against feeding it one
    step a token and against one full forward: the same argmax, hidden states and logits to
    float32 rounding, and a rollback (snapshot, restore) inside the text changes nothing."""
    from occamy_mtp.base.fastdecode import StaticRunner

    text = prompts_of((sum(chunks),), seed=7)[0]
    with torch.no_grad():
        full = base(input_ids=torch.tensor([text]), output_hidden_states=True)
    full_logits, full_hidden = full.logits[0].float(), full.hidden_states[-1][0]
    stepped = StaticRunner(base, positions=len(text), span=1)
    one_hidden, one_logits = stepped.forward(text)
    spanned = StaticRunner(base, positions=len(text) + 4, span=span)
    hidden, logits, start = [], [], 0
    for n in chunks:
        if n > 1:  # a rejected pass first: fed, then rolled back
            saved = spanned.snapshot()
            spanned.forward(prompts_of((n,), seed=start)[0])
            spanned.restore(saved)
        h, lg = spanned.forward(text[start : start + n])
        hidden.append(h), logits.append(lg)
        start += n
    hidden, logits = torch.cat(hidden), torch.cat(logits)
    assert logits.argmax(-1).tolist() == one_logits.argmax(-1).tolist() == full_logits.argmax(-1).tolist()
    width = 2 * base.config.hidden_size
    for got, want, what in ((hidden, one_hidden, "hidden, spans against steps"), (hidden, full_hidden, "hidden, spans against the forward"),
                            (logits, full_logits, "logits, spans against the forward")):
        assert_close(got, want, rounding_bound(want, torch.float32, reductions=REDUCTIONS + 1, width=width), what)


@pytest.mark.parametrize("runner_kind", ["static", "transformers"])
def test_keeping_part_of_a_verify_pass_is_feeding_that_part_alone(base, runner_kind):
    """`keep(snapshot, j)` after a pass of 4 tokens (a verify pass whose j - 1 drafts were accepted)
    leaves the runner as one fed only the first j: the static runner from what its span kept (the
    recurrent states after each token, the conv's inputs), with no second pass; transformers'
    cache by restoring and feeding them again. The conv windows, recurrent states and position
    agree to float32 rounding, and so do the next pass's logits. A keep that does not follow its
    snapshot's forward is refused."""
    from occamy_mtp.base.fastdecode import StaticRunner
    from occamy_mtp.evaluation.decode import BaseRunner

    prompt, span, following = prompts_of((9, 4, 2), seed=5)

    def runner():
        return StaticRunner(base, positions=20, span=4) if runner_kind == "static" else BaseRunner(base)

    width = 2 * base.config.hidden_size
    for kept in range(1, 5):
        kept_runner, fed_runner = runner(), runner()
        kept_runner.forward(prompt)
        fed_runner.forward(prompt)
        saved = kept_runner.snapshot()
        kept_runner.forward(span)
        if runner_kind == "static":  # a second pass would show in the span's step count
            passes = []
            kept_runner.decoder.span_step = lambda tokens, original=kept_runner.decoder.span_step: (passes.append(tokens), original(tokens))
        kept_runner.keep(saved, kept)
        fed_runner.forward(span[:kept])
        assert kept_runner.seen == fed_runner.seen == len(prompt) + kept
        if runner_kind == "static":
            assert passes == []
            got, want = kept_runner.decoder, fed_runner.decoder
            assert int(got.kv.position) == int(want.kv.position) == len(prompt) + kept
            assert_close(got.conv_states, want.conv_states, rounding_bound(want.conv_states, torch.float32, reductions=REDUCTIONS, width=width),
                         f"conv windows, {kept} kept")
            assert_close(got.recurrent_states, want.recurrent_states,
                         rounding_bound(want.recurrent_states, torch.float32, reductions=REDUCTIONS, width=width), f"recurrent states, {kept} kept")
            assert not torch.equal(got.recurrent_states, got.span_states[:, -1]) or kept == 4
        _, got_logits = kept_runner.forward(following)
        _, want_logits = fed_runner.forward(following)
        assert_close(got_logits, want_logits, rounding_bound(want_logits, torch.float32, reductions=REDUCTIONS + 1, width=width),
                     f"the next pass's logits, {kept} kept")
    with pytest.raises(ValueError, match="keep: 2 tokens of a forward of 2"):
        kept_runner.keep(saved, 2)  # the last forward did not start at this snapshot


def test_a_span_runner_refuses_what_it_cannot_hold(base):
    from occamy_mtp.base.fastdecode import StaticRunner

    with pytest.raises(ValueError, match="span must be >= 1"):
        StaticRunner(base, positions=8, span=0)
    runner = StaticRunner(base, positions=6, span=4)
    runner.forward([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="7 positions asked of a runner that holds 6"):
        runner.forward([6, 7])


def _captured_and_eager_on_gpu(length: int, passes) -> list[torch.Tensor]:
    """`passes(runner, text)` (a list of logits) through a span-4 `StaticRunner` on the GPU (bf16), its
    spans captured, then eager: the two runs' logits."""
    from occamy_mtp.base.fastdecode import StaticRunner

    model, _ = random_models(tiny_text_config(), seed=3)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval().requires_grad_(False)
    text = prompts_of((length,), seed=4)[0]
    results = []
    for graphs in (True, False):
        runner = StaticRunner(model, positions=len(text) + 4, span=4)
        runner.decoder.cuda_graph = graphs
        results.append(torch.cat(passes(runner, text)))
    return results


@pytest.mark.gpu
def test_captured_spans_give_the_eager_spans_logits_on_gpu():
    """bf16 on the GPU, as export's decoder check runs: each span length captured once and
    replayed gives the eager span step's logits, across a rollback."""

    def passes(runner, text):
        out, start = [], 0
        for n in (7, 4, 2, 4, 2):
            saved = runner.snapshot()
            runner.forward(prompts_of((n,), seed=start)[0])  # a rejected pass, rolled back
            runner.restore(saved)
            out.append(runner.forward(text[start : start + n])[1])
            start += n
        return out

    results = _captured_and_eager_on_gpu(19, passes)
    assert torch.equal(results[0], results[1])  # the graphs replay the very kernels of the eager spans


@pytest.mark.gpu
def test_a_kept_part_of_a_captured_span_is_the_eager_span_s_on_gpu():
    """bf16 on the GPU: spans captured once and replayed keep the same per-token states as the
    eager spans (the rule kernel writes them), so keeping part of each pass and going on gives
    the very logits of the eager runner."""

    def passes(runner, text):
        out, start = [runner.forward(text[:5])[1]], 5
        for kept in (1, 3, 2, 4, 1, 2):
            saved = runner.snapshot()
            runner.forward(text[start : start + kept] + prompts_of((4 - kept,), seed=start)[0])  # drafts rejected after `kept`
            runner.keep(saved, kept)
            start += kept
            out.append(runner.forward(text[start : start + 1])[1])  # the next pass, on the kept state
            start += 1
        return out

    results = _captured_and_eager_on_gpu(30, passes)
    assert torch.equal(results[0], results[1])


@pytest.fixture
def stand_in_capture(monkeypatch):
    """CUDA graph capture on the CPU, stood in for: a "graph" whose capture runs its pass once (the
    warm-up a real capture runs) and whose replays run it again. Yields the passes captured."""
    from occamy_mtp.base import fastdecode

    captured = []

    class Replayed:
        def __init__(self, device, run):
            run()
            captured.append(run)
            self.run = run

        def replay(self):
            self.run()

    monkeypatch.setattr(fastdecode, "_graph_of", Replayed)
    return captured


def test_the_head_runner_captures_each_pass_once_and_again_after_a_tensor_is_replaced(stand_in_capture):
    """The head runner's graph bookkeeping, on the CPU with a stand-in for the capture (a graph that
    replays by running its pass): one capture for each extend size and chain length, kept across
    decodes; all captured again once a head tensor is replaced; the texts those replays write
    are the eager runner's."""
    from occamy_mtp.base import fastdecode
    from occamy_mtp.evaluation import decode
    from test_decode import agreeable_models, random_prompt

    captured = stand_in_capture
    base, head = agreeable_models(seed=1)
    prompts = [random_prompt(n, seed=n) for n in (9, 4, 12)]
    runners = decode.Runners(decode.BaseRunner(base), fastdecode.StaticHeadRunner(head, 40, span=4), 40, 4)
    runners.head.cuda_graph = True

    def decodes():
        return [decode.speculative_decode(base, head, p, 14, 3, runners=runners) for p in prompts]

    want = [(r.output_ids, r.rounds) for r in (decode.speculative_decode(base, head, p, 14, 3) for p in prompts)]
    assert [(r.output_ids, r.rounds) for r in decodes()] == want
    first = len(captured)
    assert set(runners.head._graphs) <= {("extend", m) for m in range(1, 5)} | {("chain", k) for k in range(1, 4)}
    assert first == len(runners.head._graphs) and ("chain", 3) in runners.head._graphs
    decodes()
    assert len(captured) == first  # kept across decodes
    head.fc.weight.data = head.fc.weight.data.clone()  # the same values in a new tensor
    assert [(r.output_ids, r.rounds) for r in decodes()] == want
    assert len(captured) > first and len(runners.head._graphs) <= first  # captured again, the old ones dropped


def test_captured_verify_passes_are_kept_as_eager_ones(stand_in_capture):
    """The base runner's spans through the capture path (a stand-in capture on the CPU: its warm-up
    runs the pass, the state is put back, each replay runs it again): decodes with rejections keep
    the verify passes' states as the eager spans do: the same texts, rounds and logprobs."""
    from occamy_mtp.base import fastdecode
    from occamy_mtp.evaluation import decode
    from test_decode import agreeable_models, random_prompt

    base, head = agreeable_models(seed=1)
    prompts = [random_prompt(n, seed=n) for n in (9, 4, 12)]
    results = []
    for graphs in (True, False):
        runners = decode.Runners(fastdecode.StaticRunner(base, 40, span=4), decode.HeadRunner(head), 40, 4)
        runners.base.decoder.cuda_graph = graphs
        results.append([decode.speculative_decode(base, head, p, 14, k, runners=runners) for k in (3, 1) for p in prompts])
        assert bool(runners.base._graphs) == graphs
    assert [(r.output_ids, r.rounds, r.logprobs) for r in results[0]] == [(r.output_ids, r.rounds, r.logprobs) for r in results[1]]
    assert any(r.accepted < len(r.drafted) for result in results[0] for r in result.rounds)
