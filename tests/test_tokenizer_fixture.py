"""The test tokenizer: deterministic, loadable offline, Qwen3.5-like chat rendering."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from occamy_mtp.testing.tokenizer import ADDED_TOKENS, DEFAULT_VOCAB_SIZE, added_token_ids, build_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EMPTY_THINK = "<think>\n\n</think>\n\n"


def test_two_builds_are_byte_identical(sample_tokenizer_dir, tmp_path):
    again = build_tokenizer(tmp_path / "again")
    for name in TOKENIZER_FILES:
        assert (again / name).read_bytes() == (sample_tokenizer_dir / name).read_bytes(), name


def test_loads_offline_with_the_full_vocab_and_qwen_tokens_at_the_end(sample_tokenizer, sample_tokenizer_dir):
    assert len(sample_tokenizer) == DEFAULT_VOCAB_SIZE
    ids = added_token_ids(sample_tokenizer_dir)
    assert ids == {"<|endoftext|>": 1019, "<|im_start|>": 1020, "<|im_end|>": 1021, "<think>": 1022, "</think>": 1023}
    assert sample_tokenizer.eos_token == "<|im_end|>" and sample_tokenizer.eos_token_id == 1021
    assert sample_tokenizer.pad_token == "<|endoftext|>" and sample_tokenizer.pad_token_id == 1019
    for token in ADDED_TOKENS:  # each is one token, also inside text
        assert sample_tokenizer(f"a{token}b", add_special_tokens=False)["input_ids"][1] == ids[token]
    special = {t.content for t in sample_tokenizer.added_tokens_decoder.values() if t.special}
    assert special == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}  # think tags are not special, as in Qwen


def test_encode_decode_round_trip(sample_tokenizer):
    texts = [
        "Hello, world!  Two spaces,\ttab, and\n\nnewlines.\n",
        "Unicode: Grüße, naïve café, 日本語, Ελληνικά, emoji 😀🚀, zero-width\u200bjoiner",
        "   leading and trailing   ",
        "def f(x):\n    return x ** 2  # comment\n",
        "".join(chr(c) for c in range(1, 128)),
    ]
    for text in texts:
        ids = sample_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert max(ids) < DEFAULT_VOCAB_SIZE
        assert sample_tokenizer.decode(ids) == text


def test_no_bos_or_eos_is_added(sample_tokenizer):
    assert sample_tokenizer("hi")["input_ids"] == sample_tokenizer("hi", add_special_tokens=False)["input_ids"]


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "  Blue.\n"},
]


def test_chat_template_renders_like_qwen3_5(sample_tokenizer):
    full = sample_tokenizer.apply_chat_template(CONVERSATION, tokenize=False, enable_thinking=False)
    # History assistant turns carry no think block; the turn after the last query does.
    assert full == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nName a colour.<|im_end|>\n"
        f"<|im_start|>assistant\n{EMPTY_THINK}Blue.<|im_end|>\n"
    )
    prompt = sample_tokenizer.apply_chat_template(CONVERSATION[:4], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert prompt == full[: full.rindex("<|im_start|>")] + f"<|im_start|>assistant\n{EMPTY_THINK}"
    thinking = sample_tokenizer.apply_chat_template(CONVERSATION[:4], tokenize=False, add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>assistant\n<think>\n") and not thinking.endswith(EMPTY_THINK)


def test_rendering_up_to_each_assistant_turn_extends_its_generation_prompt(sample_tokenizer):
    """The property window building relies on, for every assistant turn (not only the last)."""
    for k, message in enumerate(CONVERSATION):
        if message["role"] != "assistant":
            continue
        prompt = sample_tokenizer.apply_chat_template(CONVERSATION[:k], tokenize=False, add_generation_prompt=True, enable_thinking=False)
        turn = sample_tokenizer.apply_chat_template(CONVERSATION[: k + 1], tokenize=False, enable_thinking=False)
        assert turn == prompt + message["content"].strip() + "<|im_end|>\n"
    # ...while the whole conversation does NOT contain turn 2 as it was generated:
    full = sample_tokenizer.apply_chat_template(CONVERSATION, tokenize=False, enable_thinking=False)
    prompt_for_turn_2 = sample_tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert not full.startswith(prompt_for_turn_2)


def test_template_reasoning_and_errors(sample_tokenizer):
    with_reasoning = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA"}]
    assert sample_tokenizer.apply_chat_template(with_reasoning, tokenize=False).endswith("<|im_start|>assistant\n<think>\nhmm\n</think>\n\nA<|im_end|>\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    assert sample_tokenizer.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nHello<|im_end|>\n"
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="No user query"):
        sample_tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}], tokenize=False)
    with pytest.raises(jinja2.TemplateError, match="System message"):
        sample_tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], tokenize=False)


def test_small_vocab_and_custom_corpus(tmp_path):
    corpus = ["the cat sat on the mat", "the dog sat on the log"] * 3
    directory = build_tokenizer(tmp_path, vocab_size=270, corpus=corpus)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    assert len(tokenizer) <= 270
    ids = added_token_ids(directory)
    assert sorted(ids.values()) == list(range(len(tokenizer) - len(ADDED_TOKENS), len(tokenizer)))
    assert tokenizer.decode(tokenizer("the cat", add_special_tokens=False)["input_ids"]) == "the cat"
    with pytest.raises(ValueError, match="too small"):
        build_tokenizer(tmp_path / "tiny", vocab_size=200, corpus=corpus)
