"""Self-distilled data (occamy_mtp.selfgen.regenerate): batched greedy decoding against a plain
one-prompt-at-a-time full-forward oracle, the regenerated JSONL, resume, refusals, CLI.

Two tiny bases: a random one (real dynamics, for the oracle and resume), and a
"scripted" one whose layers write nothing into the residual stream and whose lm_head
maps each token to a chosen successor, so that it answers every prompt with one fixed,
canonically tokenized sentence. The scripted base makes the round trip through the chat
template checkable end to end.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.base.frozen import BaseFacts, BaseIdentity
from occamy_mtp.config import ModelSettings
from occamy_mtp.base.generate import plain_decode
from occamy_mtp.selfgen import regenerate as G
from occamy_mtp.selfgen import store
from occamy_mtp.data.reader import DataError, Message
from occamy_mtp.data.prepare import prepare_windows
from occamy_mtp.testing.checkpoints import (
    build_tiny_checkpoint,
    random_models,
    tiny_text_config,
    write_checkpoint,
)
from occamy_mtp.commands import generate as generate_command

SCRIPTED_ANSWER = "Yes: call open() with a path."  # its tokens are distinct: a successor map can spell it

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "How do I read a file?"}, {"role": "assistant", "content": "Use open()."}]},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a list?"}, {"role": "assistant", "content": "A sequence."}]},
    {"conversations": [{"from": "human", "value": "Name a loop."}, {"from": "gpt", "value": "for"}]},
    {"messages": [{"role": "user", "content": "Call a tool."}, {"role": "tool", "content": "{}"}, {"role": "assistant", "content": "Done."}]},
    {"messages": [{"role": "user", "content": "How do I read a file?"}, {"role": "assistant", "content": "Use open()."}]},  # duplicate
    {
        "messages": [
            {"role": "user", "content": "What is a dict?"},
            {"role": "assistant", "content": "A mapping."},
            {"role": "user", "content": "And a set?"},
            {"role": "assistant", "content": "Unordered unique items."},
        ]
    },
    {"messages": [{"role": "user", "content": "Define a tuple in Python, with an example of packing and unpacking."}, {"role": "assistant", "content": "An immutable sequence."}]},
    {"messages": [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."}]},
]
KEPT = 6  # the tool-call conversation and the duplicate are excluded
EXCLUDED = {"tool_call_roles": 1, "duplicate_conversation": 1}


pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONS), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def random_base(tmp_path_factory, sample_tokenizer_dir):
    """(directory, fp32 model loaded from it) of a random tiny Qwen3.5-MoE base."""
    written = build_tiny_checkpoint(tmp_path_factory.mktemp("random_base"), tokenizer_dir=sample_tokenizer_dir, with_head=False)
    return written.path, ckpt_io.load_base(written.path, dtype=torch.float32)


def scripted_model(tokenizer, text: str, seed: int = 0):
    """A real-architecture base that answers every prompt with `text` and `<|im_end|>`.

    Every residual write (attention/DeltaNet out projections, expert and shared-expert
    down projections) is zero, so the post-norm hidden state at a position is a function
    of its token alone, h(t). lm_head row succ(t) is h(t)/|h(t)| for each token t of the
    chain "last prompt token -> text's tokens -> <|im_end|>", every other row zero: the
    greedy successor of t is then succ(t) (Cauchy-Schwarz, margin |h(t)|(1 - cos)).
    """
    answer = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    last_prompt_token = tokenizer(prompt, add_special_tokens=False)["input_ids"][-1]
    chain = [last_prompt_token] + answer + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert len(set(chain)) == len(chain), "the scripted answer needs distinct tokens"
    text_config = tiny_text_config(vocab_size=len(tokenizer))
    base, _ = random_models(text_config, seed)
    base = base.float()
    with torch.no_grad():
        for name, param in base.named_parameters():
            if name.endswith(("out_proj.weight", "o_proj.weight", "experts.down_proj", "shared_expert.down_proj.weight")):
                param.zero_()
        hidden = base.model(input_ids=torch.tensor([chain[:-1]]), use_cache=False).last_hidden_state[0]  # (T, D)
        base.lm_head.weight.zero_()
        for h, successor in zip(hidden, chain[1:]):
            base.lm_head.weight[successor] = h / h.norm()
    return text_config, base, answer


@pytest.fixture(scope="module")
def scripted_base(tmp_path_factory, sample_tokenizer, sample_tokenizer_dir):
    """(directory, fp32 model loaded from it, the answer's token ids)."""
    text_config, base, answer = scripted_model(sample_tokenizer, SCRIPTED_ANSWER)
    path = tmp_path_factory.mktemp("scripted_base")
    write_checkpoint(path, text_config, base, None, tokenizer_dir=sample_tokenizer_dir)
    return path, ckpt_io.load_base(path, dtype=torch.float32), answer


def reference_greedy(base, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """The oracle: one prompt, no padding, no cache, a full forward per generated token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(base(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
            if ids[-1] in eos:
                break
    return ids[len(prompt) :]


def sidecar_base(base_dir, **model) -> dict:
    """The sidecar's base record of the base at `base_dir` read in float32 (as the fixtures read it)."""
    settings = ModelSettings(base=str(base_dir), **{"dtype": "float32", **model})
    return G.base_record(BaseIdentity.of(settings, BaseFacts(base_dir)), base_dir)


def regenerate(chats, tokenizer, base_dir, base, out, **settings):
    settings = {"max_new_tokens": 5, "batch_size": 2, **settings}
    return G.regenerate_answers([chats], tokenizer, base, out, base_identity=sidecar_base(base_dir), **settings)


# ---------------------------------------------------------------------------- greedy decoding


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_next"])
def test_batched_greedy_equals_one_by_one_full_forward(family):
    # Full attention before a DeltaNet layer too: padded rows of full attention must not
    # leak into the recurrent state of the layer after it.
    text_config = tiny_text_config(family, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    base, _ = random_models(text_config, seed=3)
    base = base.float().eval()
    base.model.rotary_emb = type(base.model.rotary_emb)(base.config)
    generator = torch.Generator().manual_seed(0)
    # Shorter than the conv kernel (1, 2), a DeltaNet chunk boundary crossed (70).
    lengths = [1, 9, 70, 3, 2, 12]
    prompts = [torch.randint(0, text_config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    max_new_tokens = 6
    # An eos that the first prompt reaches at its third token: that row stops early while others go on.
    eos = {reference_greedy(base, prompts[0], 3, set())[2]}

    expected = [reference_greedy(base, p, max_new_tokens, eos) for p in prompts]
    got = plain_decode(base, prompts, max_new_tokens=max_new_tokens, eos_token_ids=eos, batch_size=4)

    assert got == expected
    assert len(got[0]) == 3 and got[0][-1] in eos
    assert any(len(g) == max_new_tokens and g[-1] not in eos for g in got)


def reference_sampled(base, prompt: list[int], uniforms: torch.Tensor, sampling, eos: set[int]) -> list[int]:
    """The oracle of sampled decoding: a full forward per token, the j-th drawn from the processed
    distribution with the j-th uniform by walking the cumulative mass in id order."""
    ids = list(prompt)
    with torch.no_grad():
        for u in uniforms.tolist():
            p = sampling.probs(base(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]).double()
            total, running = float(p.sum()), 0.0
            ids.append(next(x for x in range(len(p)) if p[x] > 0 and (running := running + float(p[x])) > u * total))
            if ids[-1] in eos:
                break
    return ids[len(prompt) :]


def test_sampled_generation_is_the_one_by_one_draws_and_batch_free():
    """Each continuation is drawn from its own uniform stream: the same tokens as the oracle, in a
    batch of any size."""
    from occamy_mtp.sampling import TextSampling

    text_config = tiny_text_config("qwen3_5_moe_text")
    base, _ = random_models(text_config, seed=4)
    base = base.float().eval()
    with torch.no_grad():
        base.lm_head.weight.mul_(6)  # sharper than a random base, so top-p cuts tokens out
    sampling = TextSampling(temperature=0.8, top_p=0.9, seed=7)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, text_config.vocab_size, (n,), generator=generator).tolist() for n in (3, 11, 1, 6)]
    uniforms = [sampling.uniforms(f"context-{i}", 7) for i in range(len(prompts))]
    expected = [reference_sampled(base, p, u, sampling, set()) for p, u in zip(prompts, uniforms)]
    greedy = plain_decode(base, prompts, max_new_tokens=7, eos_token_ids=set(), batch_size=4)
    assert expected != greedy  # sampling changed the text
    for batch_size in (1, 4):
        got = plain_decode(base, prompts, max_new_tokens=7, eos_token_ids=set(), batch_size=batch_size,
                                sampling=sampling, uniforms=uniforms)
        assert got == expected, batch_size
    with pytest.raises(ValueError, match="one uniform stream per prompt"):
        plain_decode(base, prompts, max_new_tokens=7, eos_token_ids=set(), batch_size=4, sampling=sampling)
    with pytest.raises(ValueError, match="fewer than max_new_tokens=9"):
        plain_decode(base, prompts, max_new_tokens=9, eos_token_ids=set(), batch_size=4, sampling=sampling,
                          uniforms=uniforms)


def test_plain_decode_rejects_bad_arguments(random_base):
    _, base = random_base
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        plain_decode(base, [[1], []], max_new_tokens=2, eos_token_ids={0}, batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        plain_decode(base, [[1]], max_new_tokens=2, eos_token_ids={0}, batch_size=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        plain_decode(base, [[1]], max_new_tokens=0, eos_token_ids={0}, batch_size=1)


# ---------------------------------------------------------------------------- records


def test_scripted_output_round_trips_through_prepare_windows(chats, sample_tokenizer, scripted_base, tmp_path):
    base_dir, base, answer = scripted_base
    out = tmp_path / "selfgen.jsonl"
    report = regenerate(chats, sample_tokenizer, base_dir, base, out, max_new_tokens=len(answer) + 3)

    assert report.excluded == EXCLUDED and report.records_in_file == KEPT and report.complete
    assert report.finished == KEPT and report.roundtrip == {G.ROUNDTRIP_EXACT: KEPT}
    records = [json.loads(line) for line in out.read_text().splitlines()]
    im_end = sample_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for record, source in zip(records, [c for i, c in enumerate(CONVERSATIONS) if i not in (3, 4)]):
        meta = record["meta"]
        assert meta["generated_token_ids"] == answer + [im_end] and meta["generated_tokens"] == len(answer) + 1
        assert record["messages"][-1] == {"role": "assistant", "content": SCRIPTED_ANSWER}
        original = source.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}[m["from"]], "content": m["value"]} for m in source["conversations"]]
        assert record["messages"][:-1] == original[:-1]  # the prompt messages, normalised; later turns dropped
    assert records[2]["meta"]["source"] == f"{chats}:3"

    windows = prepare_windows([out], sample_tokenizer, turns="last")
    assert windows.conversations_kept == KEPT and windows.excluded == {}
    for window in windows.train + windows.heldout:
        assert list(window.input_ids[window.answer_start :]) == answer + [im_end]  # exactly the base's tokens
    sidecar = json.loads(G.sidecar_path(out).read_text())
    assert sidecar["status"] == "complete" and sidecar["counts"]["roundtrip"] == {"exact": KEPT}
    assert sidecar["data"]["excluded"] == EXCLUDED and sidecar["settings"]["max_new_tokens"] == len(answer) + 3


def test_every_turn_gives_one_record_per_assistant_turn(chats, sample_tokenizer, scripted_base, tmp_path):
    base_dir, base, answer = scripted_base
    out = tmp_path / "every.jsonl"
    report = regenerate(chats, sample_tokenizer, base_dir, base, out, turns="every", max_new_tokens=len(answer) + 1)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert report.records_in_file == KEPT + 1  # the dict conversation has two assistant turns
    two_turns = [r for r in records if r["messages"][0]["content"] == "What is a dict?"]
    assert [r["meta"]["turn_index"] for r in two_turns] == [1, 3]
    assert [len(r["messages"]) for r in two_turns] == [2, 4]
    assert two_turns[1]["messages"][1]["content"] == "A mapping."  # earlier answers stay original


def test_roundtrip_outcomes(sample_tokenizer):
    im_end = sample_tokenizer.convert_tokens_to_ids("<|im_end|>")
    endoftext = sample_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_start = sample_tokenizer.convert_tokens_to_ids("<|im_start|>")

    def encode(text):
        return sample_tokenizer(text, add_special_tokens=False)["input_ids"]

    def outcome(ids, finished):
        text = sample_tokenizer.decode(ids[:-1] if finished else ids, skip_special_tokens=False)
        messages = [Message("user", "Hi"), Message("assistant", text)]
        return G.roundtrip_outcome(sample_tokenizer, messages, ids, finished, im_end)

    hello = encode("Hello world.")
    assert outcome(hello + [im_end], True) == G.ROUNDTRIP_EXACT
    assert outcome(hello, False) == G.ROUNDTRIP_EXACT
    assert outcome(hello + [endoftext], True) == G.DIFFERENT_END_TOKEN
    # One byte of the two-byte "é": not UTF-8 on its own (max_new_tokens cut the character).
    assert outcome(hello + sample_tokenizer.convert_tokens_to_ids(["Ã"]), False) == G.LOSSY_DECODE
    assert outcome(encode("\ufffd ok") + [im_end], True) == G.ROUNDTRIP_EXACT  # a U+FFFD the base really wrote
    assert outcome(hello + [im_start] + hello, False) == G.SPECIAL_TOKEN_IN_TEXT
    assert outcome(hello + encode("  "), False) == G.TEMPLATE_REWROTE_TEXT  # the template trims
    letters = [t for ch in "Hello" for t in encode(ch)]  # "H" "e" "l" "l" "o": not how BPE tokenizes "Hello"
    assert letters != encode("Hello")
    assert outcome(letters + [im_end], True) == G.RETOKENIZED


# ---------------------------------------------------------------------------- resume


def test_resume_after_a_kill_gives_the_uninterrupted_file(chats, sample_tokenizer, random_base, tmp_path, monkeypatch):
    base_dir, base = random_base
    whole = tmp_path / "whole.jsonl"
    whole_report = regenerate(chats, sample_tokenizer, base_dir, base, whole)
    lines = whole.read_bytes().splitlines(keepends=True)
    assert len(lines) == KEPT and whole_report.generated_now == KEPT

    # A run killed while writing its second batch: the first batch (2 lines) and one line
    # of the second are complete, the next line is cut mid-write.
    killed = tmp_path / "killed.jsonl"
    calls = {"n": 0}
    real_greedy = store.plain_decode

    def killed_after_first_batch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_greedy(*args, **kwargs)

    monkeypatch.setattr(store, "plain_decode", killed_after_first_batch)
    with pytest.raises(KeyboardInterrupt):
        regenerate(chats, sample_tokenizer, base_dir, base, killed)
    monkeypatch.undo()
    assert killed.read_bytes() == b"".join(lines[:2])
    assert json.loads(G.sidecar_path(killed).read_text())["status"] == "running"
    with killed.open("ab") as stream:
        stream.write(lines[2] + lines[3][: len(lines[3]) // 2])

    report = regenerate(chats, sample_tokenizer, base_dir, base, killed)
    assert killed.read_bytes() == whole.read_bytes()
    assert report.torn_lines_dropped == 1 and report.skipped_done == 3 and report.generated_now == 3
    assert report.regenerated_for_batching == 1  # line 3 recomputed so its batch stayed whole, not rewritten
    sidecar = json.loads(G.sidecar_path(killed).read_text())
    assert sidecar["status"] == "complete" and len(sidecar["runs"]) == 2
    for count in ("records_in_file", "finished", "unfinished", "generated_tokens", "roundtrip"):
        assert sidecar["counts"][count] == getattr(whole_report, count)

    again = regenerate(chats, sample_tokenizer, base_dir, base, killed)  # nothing left to do
    assert again.generated_now == 0 and killed.read_bytes() == whole.read_bytes()


def test_limit_then_continue(chats, sample_tokenizer, scripted_base, tmp_path):
    base_dir, base, _ = scripted_base
    out = tmp_path / "limited.jsonl"
    first = regenerate(chats, sample_tokenizer, base_dir, base, out, limit=3)
    assert first.records_in_file == 3 and not first.complete
    assert json.loads(G.sidecar_path(out).read_text())["status"] == "partial"
    rest = regenerate(chats, sample_tokenizer, base_dir, base, out)
    assert rest.skipped_done == 3 and rest.generated_now == KEPT - 3 and rest.complete


def test_resume_refuses_other_settings_base_or_files(chats, sample_tokenizer, random_base, tmp_path, sample_tokenizer_dir):
    base_dir, base = random_base
    out = tmp_path / "out.jsonl"
    regenerate(chats, sample_tokenizer, base_dir, base, out, limit=2)
    before = out.read_bytes()

    with pytest.raises(G.GenerateError, match=r"settings\.max_new_tokens: 5 in the existing output, 4 now"):
        regenerate(chats, sample_tokenizer, base_dir, base, out, max_new_tokens=4)
    with pytest.raises(G.GenerateError, match=r"settings\.turns"):
        regenerate(chats, sample_tokenizer, base_dir, base, out, turns="first")
    other = build_tiny_checkpoint(tmp_path / "other_base", seed=1, tokenizer_dir=sample_tokenizer_dir, with_head=False).path
    with pytest.raises(G.GenerateError, match=r"base\.weights_sample_sha256"):
        G.regenerate_answers([chats], sample_tokenizer, base, out, base_identity=sidecar_base(other), max_new_tokens=5, batch_size=2)
    with pytest.raises(G.GenerateError, match="resume is off"):
        regenerate(chats, sample_tokenizer, base_dir, base, out, resume=False)
    assert out.read_bytes() == before

    orphan = tmp_path / "orphan.jsonl"
    shutil.copy(out, orphan)  # records without a sidecar: settings unknown
    with pytest.raises(G.GenerateError, match="no orphan.jsonl.meta.json"):
        regenerate(chats, sample_tokenizer, base_dir, base, orphan)
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_bytes(b"not json\n" + before)
    shutil.copy(G.sidecar_path(out), G.sidecar_path(corrupt))
    with pytest.raises(G.GenerateError, match=r"corrupt\.jsonl:1: not a record"):
        regenerate(chats, sample_tokenizer, base_dir, base, corrupt)
    assert corrupt.read_bytes() == b"not json\n" + before


# ---------------------------------------------------------------------------- CLI


def test_cli_writes_readable_output_and_reports_errors(chats, sample_tokenizer, scripted_base, tmp_path, capsys):
    base_dir, _, answer = scripted_base
    out = tmp_path / "cli.jsonl"
    common = [f"model.base={base_dir}", "--out", str(out), "--device", "cpu", "model.dtype=float32", "--no-progress"]
    assert generate_command.main(common + [f"data.files=[{chats}]", f"data.answer_tokens={len(answer) + 1}", "data.self_generate_batch_size=4"]) == 0
    printed = capsys.readouterr().out
    assert f"{KEPT} records ({KEPT} finished" in printed and "exact 6" in printed and "tool_call_roles 1" in printed
    assert len(out.read_text().splitlines()) == KEPT

    assert generate_command.main([f"model.base={tmp_path / 'nowhere'}", f"data.files=[{chats}]", "--out", str(out)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert generate_command.main(common + [f"data.files=[{tmp_path / 'missing.jsonl'}]"]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(CONVERSATIONS[0]) + "\n{broken\n")
    assert generate_command.main([common[0], "--out", str(tmp_path / "bad-out.jsonl"), f"data.files=[{bad}]", "model.dtype=float32", "--no-progress"]) == 2
    assert f"{bad}:2: malformed JSON" in capsys.readouterr().err
    assert not (tmp_path / "bad-out.jsonl").exists()  # nothing written before the data is known to be good
    with pytest.raises(DataError):  # the API raises what the CLI prints
        G.read_prompts([bad], sample_tokenizer)
