"""Windows, exclusions, bad input, the split and the `data` command (occamy_mtp.data).

Exact ids are pinned with a 300-token tokenizer trained on the literal CORPUS below, so
that they do not move when data/sample.jsonl is rebuilt; the shipped sample set is
checked with the default 1024-token tokenizer (whose ids depend on that file).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from occamy_mtp.data import prepare, reader, split, windows
from occamy_mtp.data.reader import BEYOND_SPLIT_SIZE, DataError
from occamy_mtp.data.prepare import prepare_windows
from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH, build_tokenizer
from occamy_mtp.commands import data as data_command

CORPUS = (
    "Hello there. How are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer the question.",
    "What is the capital of France? The capital of France is Paris.",
)
SMALL_VOCAB = 300
# Ids of the small tokenizer's added tokens: the last five of its 300.
ENDOFTEXT, IM_START, IM_END, THINK, END_THINK = 295, 296, 297, 298, 299
NEWLINE = 198  # byte-level "Ċ"
USER_HEADER = [IM_START, 84, 82, 271, NEWLINE]  # "<|im_start|>user\n"
SYSTEM_HEADER = [IM_START, 82, 88, 82, 83, 68, 76, NEWLINE]  # "<|im_start|>system\n"
ASSISTANT_PROMPT = [IM_START, 64, 82, 82, 260, 83, 259, 83, NEWLINE, THINK, NEWLINE, NEWLINE, END_THINK, NEWLINE, NEWLINE]
TURN_END = [IM_END, NEWLINE]
HI = [39, 72]
HELLO_THERE = [289, 75, 75, 78, 261, 263, 13]  # "Hello there."


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    directory = build_tokenizer(tmp_path_factory.mktemp("small_tokenizer"), vocab_size=SMALL_VOCAB, corpus=CORPUS)
    return AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def sample_data(sample_tokenizer):
    return prepare_windows([SAMPLE_DATA_PATH], sample_tokenizer)


def conversation(*messages: tuple[str, str]) -> reader.Conversation:
    return reader.Conversation(tuple(reader.Message(role, content) for role, content in messages), "test:1")


def windows_of(tokenizer, conv: reader.Conversation, **settings) -> list[windows.Window]:
    built = windows.conversation_windows(tokenizer, conv, **settings)
    assert not isinstance(built, reader.Excluded), built
    return built[0]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def chat(*pairs: str, system: str | None = None) -> dict:
    """{"messages": ...} from alternating user/assistant texts."""
    messages = [{"role": "system", "content": system}] if system else []
    for index, text in enumerate(pairs):
        messages.append({"role": "user" if index % 2 == 0 else "assistant", "content": text})
    return {"messages": messages}


# ------------------------------------------------------------------ exact windows


def test_pinned_fragments_decode_to_what_they_claim(small_tokenizer):
    """The literal ids above mean what their names say (so a wrong pin cannot hide)."""
    decode = small_tokenizer.decode
    assert decode(USER_HEADER) == "<|im_start|>user\n"
    assert decode(SYSTEM_HEADER) == "<|im_start|>system\n"
    assert decode(ASSISTANT_PROMPT) == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert decode(HI) == "Hi" and decode(HELLO_THERE) == "Hello there."
    assert decode([ENDOFTEXT, IM_END]) == "<|endoftext|><|im_end|>"


def test_single_turn_window(small_tokenizer):
    [window] = windows_of(small_tokenizer, conversation(("user", "Hi"), ("assistant", "Hello there.")))
    # context = the whole prompt (shorter than 128), answer = content + <|im_end|>, no newline after it
    assert window.input_ids == tuple(USER_HEADER + HI + TURN_END + ASSISTANT_PROMPT + HELLO_THERE + [IM_END])
    assert window.input_ids == (
        296, 84, 82, 271, 198, 39, 72, 297, 198,
        296, 64, 82, 82, 260, 83, 259, 83, 198, 298, 198, 198, 299, 198, 198,
        289, 75, 75, 78, 261, 263, 13, 297,
    )  # fmt: skip
    assert window.answer_start == 24
    assert window.turn_index == 1
    assert window.answer_length == 8
    assert window.assistant_mask() == [False] * 24 + [True] * 8


def test_system_prompt_is_context(small_tokenizer):
    conv = conversation(("system", "You are a helpful assistant."), ("user", "Hi"), ("assistant", "Hello there."))
    [window] = windows_of(small_tokenizer, conv)
    system = encode(small_tokenizer, "You are a helpful assistant.")
    assert window.input_ids == tuple(SYSTEM_HEADER + system + TURN_END + USER_HEADER + HI + TURN_END + ASSISTANT_PROMPT + HELLO_THERE + [IM_END])
    assert window.answer_start == len(window.input_ids) - 8


def test_context_cut_keeps_the_tokens_just_before_the_answer(small_tokenizer):
    conv = conversation(("user", "What is the capital of France?"), ("assistant", "Paris."))
    [uncut] = windows_of(small_tokenizer, conv)
    [window] = windows_of(small_tokenizer, conv, context_tokens=18)
    # The last 18 prompt tokens: "?", the user turn's end, the assistant header and empty think block.
    assert window.input_ids[:18] == (30, 297, 198, 296, 64, 82, 82, 260, 83, 259, 83, 198, 298, 198, 198, 299, 198, 198)
    assert window.answer_start == 18
    assert window.input_ids == uncut.input_ids[uncut.answer_start - 18 :]
    assert window.input_ids[18:] == uncut.input_ids[uncut.answer_start :]


def test_answer_cut_and_end_of_turn_inclusion(small_tokenizer):
    conv = conversation(("user", "Hi"), ("assistant", "Hello there."))
    content = HELLO_THERE  # 7 tokens, then <|im_end|>
    for limit, expected in [(3, content[:3]), (7, content), (8, content + [IM_END]), (382, content + [IM_END])]:
        [window] = windows_of(small_tokenizer, conv, answer_tokens=limit)
        assert list(window.input_ids[window.answer_start :]) == expected, limit


def test_long_answer_is_cut_at_the_limit(small_tokenizer):
    answer = "The quick brown fox jumps over the lazy dog. " * 40
    [window] = windows_of(small_tokenizer, conversation(("user", "Hi"), ("assistant", answer)))
    span = list(window.input_ids[window.answer_start :])
    assert len(span) == windows.DEFAULT_ANSWER_TOKENS
    assert span == encode(small_tokenizer, answer.strip())[: windows.DEFAULT_ANSWER_TOKENS]
    assert IM_END not in span
    assert window.input_ids[: window.answer_start] == tuple(USER_HEADER + HI + TURN_END + ASSISTANT_PROMPT)


def test_multi_turn_windows_render_history_as_the_server_would(small_tokenizer):
    conv = conversation(("user", "Hi"), ("assistant", "Hello there."), ("user", "How are you?"), ("assistant", "I am fine."))
    how, fine = encode(small_tokenizer, "How are you?"), encode(small_tokenizer, "I am fine.")
    history_turn = [IM_START, 64, 82, 82, 260, 83, 259, 83, NEWLINE] + HELLO_THERE + TURN_END  # no think block in history
    [last] = windows_of(small_tokenizer, conv)
    assert last.turn_index == 3
    assert last.input_ids == tuple(USER_HEADER + HI + TURN_END + history_turn + USER_HEADER + how + TURN_END + ASSISTANT_PROMPT + fine + [IM_END])
    [first] = windows_of(small_tokenizer, conv, turns="first")
    assert first.turn_index == 1
    assert first.input_ids == tuple(USER_HEADER + HI + TURN_END + ASSISTANT_PROMPT + HELLO_THERE + [IM_END])
    every = windows_of(small_tokenizer, conv, turns="every")
    assert [w.turn_index for w in every] == [1, 3] and every == [first, last]


def test_unicode_round_trip(small_tokenizer):
    answer = "Grüße aus Köln: 日本語, emoji 😀."
    [window] = windows_of(small_tokenizer, conversation(("user", "Hi"), ("assistant", answer)))
    span = list(window.input_ids[window.answer_start :])
    assert small_tokenizer.decode(span) == answer + "<|im_end|>"
    assert span[:8] == [38, 81, 127, 120, 127, 253, 68, 258]  # G r, then "ü" and "ß" as two bytes each, e, " a"
    assert small_tokenizer.decode(span[:4]) == "Grü"


def test_content_whitespace_follows_the_template(small_tokenizer):
    """The span is what the template renders (this one trims), not the raw content."""
    [window] = windows_of(small_tokenizer, conversation(("user", "Hi"), ("assistant", "\n\n  Hello there.  \n")))
    assert list(window.input_ids[window.answer_start :]) == HELLO_THERE + [IM_END]


def test_every_assistant_token_maps_to_its_span_on_the_sample_data(sample_tokenizer, sample_data):
    """Round trip: prompt + span tokens == the one-piece tokenization of the rendered turn,
    the span decodes to the turn's content plus <|im_end|>, the context to the prompt's tail."""
    records = [json.loads(line) for line in SAMPLE_DATA_PATH.read_text(encoding="utf-8").splitlines()]
    by_hash = {}
    for number, record in enumerate(records, start=1):
        conv = reader.normalise_record(record, f"sample:{number}")
        by_hash[conv.content_hash] = conv
    assert sample_data.boundary_retokenized == 0
    for window in sample_data.train + sample_data.heldout:
        conv = by_hash[window.conversation_hash]
        prompt, span = windows.render_turn(sample_tokenizer, conv.messages, window.turn_index)
        whole = encode(sample_tokenizer, prompt + span)
        prompt_ids = encode(sample_tokenizer, prompt)
        assert whole[: len(prompt_ids)] == prompt_ids
        assert whole[len(prompt_ids) :] == encode(sample_tokenizer, span)
        assert list(window.input_ids[: window.answer_start]) == prompt_ids[-windows.DEFAULT_CONTEXT_TOKENS :]
        span_ids = list(window.input_ids[window.answer_start :])
        full_answer = conv.messages[window.turn_index].content.strip() + "<|im_end|>"
        assert span_ids == encode(sample_tokenizer, full_answer)[: windows.DEFAULT_ANSWER_TOKENS]
        if len(span_ids) < windows.DEFAULT_ANSWER_TOKENS:  # a cut span may end inside a UTF-8 character
            assert sample_tokenizer.decode(span_ids) == full_answer


# ------------------------------------------------------------------ formats


def test_sharegpt_parts_json_array_and_parquet_read_like_openai_jsonl(tmp_path, small_tokenizer):
    openai = [chat("Hi", "Hello there.", system="You are a helpful assistant.")]
    sharegpt = [{"system": "You are a helpful assistant.", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there."}]}]
    parts = [{"messages": [
        {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
        {"role": "User", "content": [{"type": "text", "text": "H"}, "i"]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello "}, {"type": "output_text", "text": "there."}]},
    ]}]  # fmt: skip
    reference = prepare_windows([write_jsonl(tmp_path / "a.jsonl", openai)], small_tokenizer, heldout_conversations=0, train_conversations=1)
    assert len(reference.train) == 1
    (tmp_path / "array.json").write_text(json.dumps(openai), encoding="utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(openai), tmp_path / "a.parquet")
    for path in [write_jsonl(tmp_path / "b.jsonl", sharegpt), write_jsonl(tmp_path / "c.jsonl", parts), tmp_path / "array.json", tmp_path / "a.parquet"]:
        other = prepare_windows([path], small_tokenizer, heldout_conversations=0, train_conversations=1)
        assert other.train == reference.train, path.name


# ------------------------------------------------------------------ exclusions


def prepared(tmp_path, tokenizer, records, **settings):
    return prepare_windows([write_jsonl(tmp_path / "data.jsonl", records)], tokenizer, **settings)


def test_each_exclusion_reason_is_counted(tmp_path, small_tokenizer):
    good = chat("Hi", "Hello there.")
    records = [
        good,
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "function_call", "value": "{}"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "What?"}]}, {"role": "assistant", "content": "A cat."}]},
        {"images": ["cat.png"], "conversations": [{"from": "human", "value": "<image>What?"}, {"from": "gpt", "value": "A cat."}]},
        good,  # duplicate
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "Hi"}]},
        {"messages": []},
        chat("Hi", "   \n"),
        chat("Hi", "Hello <|im_end|> there."),
        chat("Say <|im_start|>", "Hello there."),
        {"messages": [{"role": "assistant", "content": "I open."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "late"}, {"role": "assistant", "content": "Hello."}]},
        chat("Hi", "<think>\nreasoning\n</think>\n\nHello there."),  # an inline think block: a thinking turn, kept
        chat("How are you?", "I am fine."),
    ]
    result = prepared(tmp_path, small_tokenizer, records, turns="first", train_conversations=1, heldout_conversations=0, heldout_fraction=0.5)
    assert result.excluded == {
        "tool_call_roles": 3,
        "non_text_content": 2,
        "duplicate_conversation": 1,
        "no_assistant_turn": 2,
        "empty_answer": 1,
        "special_token_in_text": 2,
        "template_error": 2,
        "beyond_split_size": 2,
    }
    assert result.conversations_read == len(records)
    assert result.conversations_read == result.conversations_kept + sum(result.excluded.values())
    assert result.conversations_kept == 1
    examples = result.excluded_examples
    assert examples["duplicate_conversation"] == [f"{tmp_path / 'data.jsonl'}:7: same as {tmp_path / 'data.jsonl'}:1"]
    assert examples["template_error"][0].endswith(":13: the conversation opens with an assistant turn: there is no prompt")
    assert "System message must be at the beginning" in examples["template_error"][1]
    assert examples["special_token_in_text"][1].endswith(":12: message 0 contains '<|im_start|>'")


def test_optional_exclusions_can_be_switched_off(tmp_path, small_tokenizer):
    records = [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "Hi"}]}, {"role": "assistant", "content": "Hello there."}]},
        chat("How are you?", " "),
    ]
    result = prepared(tmp_path, small_tokenizer, records, exclude=frozenset(), heldout_fraction=0.5)
    assert result.excluded == {}
    windows = {w.answer_length: w for w in result.train + result.heldout}
    assert windows[8].input_ids == tuple(USER_HEADER + HI + TURN_END + ASSISTANT_PROMPT + HELLO_THERE + [IM_END])  # image dropped
    assert list(windows[1].input_ids[windows[1].answer_start :]) == [IM_END]  # the empty answer: just the end of turn
    with pytest.raises(ValueError, match="cannot be switched"):
        prepared(tmp_path, small_tokenizer, records, exclude={"tool_call_roles"})


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"messages": [', r"data.jsonl:2: malformed JSON"),
        ('{"text": "no messages here"}', r"data.jsonl:2: record has no 'messages' \(OpenAI style\) or 'conversations'"),
        ('["a", "list"]', r"data.jsonl:2: a record must be a JSON object, got list"),
        ('{"messages": [{"role": "asistant", "content": "x"}]}', r"data.jsonl:2: message 0: unknown role 'asistant'; expected one of"),
        ('{"messages": [{"content": "x"}]}', r"data.jsonl:2: message 0: missing or non-string 'role'"),
        ('{"messages": [{"role": "user", "content": [5]}]}', r"data.jsonl:2: message 0: content part 0 must be a string or an object"),
        ('{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', r"message 0: content part 0 is a text part whose 'text' is not a string"),
        ('{"messages": [{"role": "user", "content": {"text": "x"}}]}', r"message 0: content must be a string or a list of parts, got dict"),
        ('{"conversations": [{"from": "gpt", "value": 7}]}', r"data.jsonl:2: message 0: content must be a string"),
    ],
)
def test_bad_record_names_file_and_line(tmp_path, small_tokenizer, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(chat("Hi", "Hello there.")) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=message):
        prepare_windows([path], small_tokenizer)


def test_bad_records_can_be_skipped_and_counted(tmp_path, small_tokenizer):
    lines = [json.dumps(chat("Hi", "Hello there.")), "{oops", json.dumps({"x": 1}), "", json.dumps(chat("How are you?", "I am fine.")), "not json"]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = prepare_windows([path], small_tokenizer, skip_bad_records=True, heldout_fraction=0.5)
    assert result.excluded == {"bad_record": 3}
    assert [e.split(": ", 1)[0] for e in result.excluded_examples["bad_record"]] == [f"{path}:2", f"{path}:3", f"{path}:6"]
    assert result.conversations_read == 5 and result.conversations_kept == 2  # the blank line is not a record
    assert result.files == [{"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "bytes": path.stat().st_size, "records": 5}]


def test_bad_files(tmp_path, small_tokenizer):
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file"):
        prepare_windows([tmp_path / "missing.jsonl"], small_tokenizer, skip_bad_records=True)
    with pytest.raises(DataError, match=r"not a file"):
        prepare_windows([tmp_path], small_tokenizer)
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"data\.csv: unsupported file type '\.csv'"):
        prepare_windows([tmp_path / "data.csv"], small_tokenizer)
    (tmp_path / "array.json").write_text('[{"messages": []},\n {"messages": [}]')
    with pytest.raises(DataError, match=r"array\.json:2: malformed JSON"):
        prepare_windows([tmp_path / "array.json"], small_tokenizer)
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: cannot read as parquet"):
        prepare_windows([tmp_path / "bad.parquet"], small_tokenizer)
    (tmp_path / "latin1.jsonl").write_bytes('{"messages": "caf\xe9"}'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.jsonl:1: not UTF-8"):
        prepare_windows([tmp_path / "latin1.jsonl"], small_tokenizer)


def test_bad_settings(tmp_path, small_tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", [chat("Hi", "Hello there.")])
    with pytest.raises(ValueError, match="turns must be last or first or every, got 'all'"):
        prepare_windows([path], small_tokenizer, turns="all")
    with pytest.raises(ValueError, match="answer_tokens must be >= 1"):
        prepare_windows([path], small_tokenizer, answer_tokens=0)


# ------------------------------------------------------------------ split


def many_conversations(count: int, offset: int = 0) -> list[dict]:
    return [chat(f"Question number {offset + i}?", f"Answer number {offset + i}.") for i in range(count)]


def assignment(result: prepare.PreparedData) -> dict[str, str]:
    return {**dict.fromkeys(result.train_hashes, "train"), **dict.fromkeys(result.heldout_hashes, "heldout")}


def test_sample_data_gives_the_original_split(sample_data):
    summary = sample_data.summary()
    assert summary["conversations_read"] == 393
    assert (summary["train_conversations"], summary["heldout_conversations"]) == (256, 32)
    assert summary["excluded"] == {BEYOND_SPLIT_SIZE: 393 - 288}
    # Five train windows repeat a heldout window's answer (one reference text quoted to two
    # prompts) and are kept apart: 288 built, 283 kept.
    assert summary["kept_apart"] == {"validation_windows_dropped": 0, "train_windows_dropped": 5}
    assert summary["windows_built"] == 283
    assert summary["assistant_tokens_scored"] == 109920 - 5 * 382  # nearly every answer fills its 382 tokens
    assert not set(sample_data.train_hashes) & set(sample_data.heldout_hashes)
    assert {w.conversation_hash for w in sample_data.heldout} == set(sample_data.heldout_hashes)


def test_split_is_stable_when_a_conversation_is_added(tmp_path, small_tokenizer):
    base = many_conversations(40)
    settings = dict(train_conversations=100, heldout_conversations=10, turns="every")
    before = assignment(prepared(tmp_path, small_tokenizer, base, **settings))
    assert len(before) == 40 and 0 < sum(side == "heldout" for side in before.values()) < 40
    # Room on both sides: adding a conversation (anywhere in the files) changes nothing else.
    after_result = prepare_windows(
        [write_jsonl(tmp_path / "extra.jsonl", many_conversations(1, offset=1000)), write_jsonl(tmp_path / "base.jsonl", base)],
        small_tokenizer, **settings,
    )  # fmt: skip
    after = assignment(after_result)
    assert len(after) == 41 and {h: after[h] for h in before} == before
    # Full sides: nobody changes side; at most one conversation is pushed beyond the split size.
    full = dict(train_conversations=20, heldout_conversations=3, heldout_fraction=0.2)
    for offset in range(1000, 1010):
        small = prepared(tmp_path, small_tokenizer, base, **full)
        big = prepare_windows([write_jsonl(tmp_path / "base.jsonl", base), write_jsonl(tmp_path / "extra.jsonl", many_conversations(1, offset))], small_tokenizer, **full)
        old, new = assignment(small), assignment(big)
        changed = [h for h in old if new.get(h) != old[h]]
        assert len(changed) <= 1
        assert all(h not in new for h in changed)  # dropped to beyond_split_size, never moved across
        assert (len(big.train_hashes), len(big.heldout_hashes)) == (20, 3)


def test_split_ignores_order_and_depends_on_the_seed(tmp_path, small_tokenizer):
    records = many_conversations(30)
    forward = assignment(prepared(tmp_path, small_tokenizer, records, train_conversations=20, heldout_conversations=5))
    backward = assignment(prepared(tmp_path, small_tokenizer, records[::-1], train_conversations=20, heldout_conversations=5))
    assert forward == backward
    reseeded = assignment(prepared(tmp_path, small_tokenizer, records, train_conversations=20, heldout_conversations=5, split_seed=1))
    assert reseeded != forward


def test_assign_split_guarantee_directly():
    hashes = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(500)]
    base = split.assign_split(hashes[:-1], train_conversations=256, heldout_conversations=32, seed=0)
    grown = split.assign_split(hashes, train_conversations=256, heldout_conversations=32, seed=0)
    moved = [h for h in base if base[h] != grown[h]]
    assert len(moved) <= 1 and all(grown[h] == BEYOND_SPLIT_SIZE for h in moved)
    assert sorted(grown.values()).count("train") == 256 and sorted(grown.values()).count("heldout") == 32
    for h in hashes:  # the side is a function of the hash alone
        assert (split.split_key(h, 0) < 32 / 288) == (grown[h] == "heldout") or grown[h] == BEYOND_SPLIT_SIZE


def test_provenance_is_json_and_complete(sample_data):
    provenance = json.loads(json.dumps(sample_data.provenance()))
    [file] = provenance["files"]
    assert file["sha256"] == hashlib.sha256(SAMPLE_DATA_PATH.read_bytes()).hexdigest()
    assert file["records"] == 393
    assert provenance["windows"]["built"] == 283 and provenance["windows"]["assistant_tokens_scored"] == 109920 - 5 * 382
    assert provenance["windows"]["kept_apart"] == {"validation_windows_dropped": 0, "train_windows_dropped": 5}
    assert provenance["split"]["heldout_hashes"] == sample_data.heldout_hashes and len(provenance["split"]["train_hashes"]) == 256
    assert provenance["settings"]["context_tokens"] == 128 and provenance["settings"]["answer_tokens"] == 382
    assert provenance["tokenizer"]["vocab_size"] == 1024


# ------------------------------------------------------------------ CLI


def test_cli_json_report(sample_tokenizer_dir, capsys):
    assert data_command.main([f"data.files=[{SAMPLE_DATA_PATH}]", f"model.tokenizer={sample_tokenizer_dir}", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    # the training defaults' split: 256 train, 32 validation, 32 heldout
    assert printed["conversations_read"] == 393 and printed["conversations_kept"] == 320
    assert printed["excluded"] == {"beyond_split_size": 73}
    assert printed["kept_apart"] == {"validation_windows_dropped": 0, "train_windows_dropped": 8}
    assert printed["windows_built"] == 312 and printed["assistant_tokens_scored"] == 122144 - 8 * 382
    assert (printed["train_conversations"], printed["validation_conversations"], printed["heldout_conversations"]) == (256, 32, 32)


def test_cli_reads_the_files_tokenizer_and_split_of_a_run_config(tmp_path, sample_tokenizer_dir, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{base: {sample_tokenizer_dir}}}\ndata: {{files: [{SAMPLE_DATA_PATH}], train_conversations: 100, "
                      "validation_conversations: 0, heldout_conversations: 10}\ntrain: {select_every_steps: 0}\n")
    assert data_command.main(["--config", str(config), "data.heldout_conversations=20", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["train_conversations"], printed["validation_conversations"], printed["heldout_conversations"]) == (100, 0, 20)
    assert data_command.main(["--json"]) == 2 and "--config" in capsys.readouterr().err  # no data.files, no config


def test_cli_errors_are_one_line(tmp_path, sample_tokenizer_dir):
    result = subprocess.run(
        [sys.executable, "-m", "occamy_mtp", "data", f"data.files=[{tmp_path / 'missing.jsonl'}]", f"model.tokenizer={sample_tokenizer_dir}"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: data.files: {tmp_path / 'missing.jsonl'}: no such file"
    assert "Traceback" not in result.stderr


def test_the_reader_counts_one_pass_and_refuses_a_second(tmp_path):
    chats = tmp_path / "chats.jsonl"
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    chats.write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
    read = reader.ChatReader([chats])
    assert [c.messages[-1].content for c in read] == ["hello"]  # the second is the first again
    assert read.conversations_read == 2 and read.excluded() == {reader.DUPLICATE_CONVERSATION: 1}
    assert [f["records"] for f in read.files] == [2]
    with pytest.raises(RuntimeError, match="reads its sources once"):
        list(read)
