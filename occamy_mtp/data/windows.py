"""Conversations -> assistant-only windows (docs/reference/CONTRACT.md section 4): the turns chosen, the
template's rendering, the bounded tokenization of context and answer (docs/guide/DATA.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from occamy_mtp.config import ConfigError, DataSettings
from occamy_mtp.data.reader import (DEFAULT_EXCLUSIONS, EMPTY_ANSWER, NO_ASSISTANT_TURN, SPECIAL_TOKEN_IN_TEXT, TEMPLATE_ERROR,
                                    TEMPLATE_PREFIX_MISMATCH, THINK_CLOSE, THINK_OPEN, Conversation, DataError, Excluded, Message)

# The window sizes' defaults are a run's (`config.DataSettings`, where defaults live).
_DEFAULTS = DataSettings()
DEFAULT_CONTEXT_TOKENS = _DEFAULTS.context_tokens
DEFAULT_ANSWER_TOKENS = _DEFAULTS.answer_tokens
# Bounded tokenization (tokenize_window). A text cut at an arbitrary character may
# tokenize differently within a few tokens of the cut; no token that close to a cut is
# ever kept. The first cut allows this many characters per token wanted, and doubles.
CUT_MARGIN_TOKENS = 16
CUT_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class Window:
    """One training/eval window: context tokens followed by the assistant span.

    `input_ids[answer_start:]` is the assistant span: the first <= answer_tokens tokens of
    the assistant turn as the template renders it, ending with the end-of-turn token
    (`<|im_end|>`) when it falls within the limit: the served base predicts it too.
    `input_ids[:answer_start]` is the <= context_tokens tokens just before it, ending with the
    template's generation prompt: for Qwen the assistant header and, with thinking off, the
    empty think block, or with thinking on the opened one (`<think>\n`), so that the span
    starts with the reasoning.
    """

    conversation_hash: str
    turn_index: int  # index of the assistant message in the normalised conversation's messages
    input_ids: tuple[int, ...]
    answer_start: int
    thinking: bool = False
    """Rendered in thinking mode (the template's enable_thinking)."""

    def assistant_mask(self) -> list[bool]:
        """mask[p] is True iff position p holds an assistant-span token.

        The head anchored at i predicts token i+2; training scores anchor i iff
        mask[i+2]. Metrics and loss must use only those positions.
        """
        return [position >= self.answer_start for position in range(len(self.input_ids))]

    @property
    def answer_length(self) -> int:
        """Tokens in the assistant span (each is a scored prediction target)."""
        return len(self.input_ids) - self.answer_start

    @property
    def has_answer(self) -> bool:
        """False for a prompt's window (a record without the answer): only self-generation fills it."""
        return len(self.input_ids) > self.answer_start


def selected_turns(conversation: Conversation, turns: str, prompts: bool = False) -> list[int]:
    """Indices of the assistant messages that become windows ("last", "first" or "every").

    With `prompts`, a conversation that ends with the user's message has one more turn,
    open, at index len(messages): the answer the base is to write (`open_turn`).
    """
    assistant = [index for index, message in enumerate(conversation.messages) if message.role == "assistant"]
    if prompts and open_turn(conversation):
        assistant.append(len(conversation.messages))
    if not assistant or turns == "every":
        return assistant
    return [assistant[-1]] if turns == "last" else [assistant[0]]


def open_turn(conversation: Conversation) -> bool:
    """Whether the conversation ends with the user's message: a prompt whose answer is not recorded."""
    return bool(conversation.messages) and conversation.messages[-1].role == "user"


# ---------------------------------------------------------------------------- windows


@dataclass(frozen=True)
class _TurnTokens:
    prompt_ids: list[int]  # the whole rendered prompt, up to and including the generation prompt
    span_ids: list[int]  # the assistant span, ending with the end-of-turn token (untruncated)
    boundary_retokenized: bool


def think_close_ids(tokenizer) -> tuple[int, ...]:
    """The token ids `</think>` is written as (one added token in Qwen's tokenizers, several where the
    tokenizer knows no such token): where a thinking-mode answer's reasoning ends."""
    return tuple(tokenizer.encode(THINK_CLOSE, add_special_tokens=False))


def turn_thinking(messages: Sequence[Message], turn_index: int, mode: str) -> bool:
    """Whether messages[turn_index] renders in thinking mode under `data.thinking` = `mode`
    (auto: iff the turn records reasoning; an open turn records none)."""
    if mode != "auto":
        return mode == "on"
    return turn_index < len(messages) and bool(messages[turn_index].reasoning)


def _as_dicts(messages: Sequence[Message], turn_index: int, thinking: bool) -> list[dict]:
    """The template's input for messages[:turn_index + 1]. Earlier turns carry their reasoning (the
    template decides what to keep of it: Qwen's drops it before the last user query); the turn
    itself carries it in thinking mode only, as a non-thinking engine never writes one."""
    out = []
    for index, message in enumerate(messages[: turn_index + 1]):
        entry = {"role": message.role, "content": message.content}
        if message.reasoning and (index < turn_index or thinking):
            entry["reasoning_content"] = message.reasoning
        out.append(entry)
    return out


def render_turn(tokenizer, messages: Sequence[Message], turn_index: int, thinking: bool = False) -> tuple[str, str] | Excluded:
    """(prompt text, assistant span text) of messages[turn_index] as the template renders it,
    with the template's enable_thinking = `thinking`."""
    if turn_index == 0:
        return Excluded(TEMPLATE_ERROR, "the conversation opens with an assistant turn: there is no prompt")
    as_dicts = _as_dicts(messages, turn_index, thinking)
    try:
        prompt = tokenizer.apply_chat_template(as_dicts[:turn_index], tokenize=False, add_generation_prompt=True,
                                               enable_thinking=thinking)
        if turn_index == len(messages):  # the open turn of a prompt: nothing recorded after the generation prompt
            return prompt, ""
        turn = tokenizer.apply_chat_template(as_dicts, tokenize=False, add_generation_prompt=False, enable_thinking=thinking)
    except (jinja2.TemplateError, ValueError) as err:
        return Excluded(TEMPLATE_ERROR, str(err))
    if not turn.startswith(prompt):
        return Excluded(TEMPLATE_PREFIX_MISMATCH, f"message {turn_index} does not render as a continuation of the generation prompt")
    return prompt, turn[len(prompt) :]


def tokenize_turn(tokenizer, prompt: str, span: str) -> _TurnTokens:
    """Token ids of the whole prompt and of the whole assistant span, each tokenized on its own.

    The span ends with its first special token other than a reasoning marker (the template's end of
    turn: some tokenizers register `<think>` and `</think>` as special tokens, Qwen's do not); what
    follows it (Qwen: a newline) is never generated, so it is dropped. Work and memory
    grow with the texts (a 50 MB message took minutes and gigabytes): windows use
    `tokenize_window`, of which this is the reference.
    """
    prompt_ids = _encode(tokenizer, prompt)
    rendered_span_ids = _encode(tokenizer, span)
    whole_ids = _encode(tokenizer, prompt + span)
    end = _through_first_special(rendered_span_ids, _span_end_ids(tokenizer))
    return _TurnTokens(prompt_ids, rendered_span_ids[:end], whole_ids != prompt_ids + rendered_span_ids)


@dataclass(frozen=True)
class WindowTokens:
    context_ids: list[int]  # tokenize_turn(...).prompt_ids[-context_tokens:]
    answer_ids: list[int]  # tokenize_turn(...).span_ids[:answer_tokens]
    boundary_retokenized: bool  # as tokenize_turn's


def tokenize_window(tokenizer, prompt: str, span: str, context_tokens: int, answer_tokens: int) -> WindowTokens:
    """What `tokenize_turn` gives of a window, tokenizing only about the text the window keeps.

    The context is read from a tail of the prompt, the answer from a head of the span
    (`_last_tokens`, `_first_tokens`): the work is bounded by the window's token counts
    (times the characters a token spans), whatever the length of the conversation. The
    boundary check compares the same tail and head tokenized in one piece and apart;
    the tokens the pieces were cut from lie far from the boundary, on both sides alike.
    """
    special_ids = _span_end_ids(tokenizer)
    context_ids, tail, tail_ids = _last_tokens(tokenizer, prompt, context_tokens)
    answer_ids, head, head_ids = _first_tokens(tokenizer, span, answer_tokens, special_ids)
    retokenized = _encode(tokenizer, tail + head) != tail_ids + head_ids
    return WindowTokens(context_ids, answer_ids, retokenized)


def _last_tokens(tokenizer, text: str, count: int) -> tuple[list[int], str, list[int]]:
    """(tokens(text)[-count:], the tail of `text` tokenized, its tokens), tokenizing tails only.

    A tail starts at an arbitrary character, so its first tokens can differ from the
    whole text's: within a long pre-token (a run of one character, a long word) the
    tokens depend on where the cut falls all the way to the pre-token's end, and only
    on the cut's position modulo the lengths of the vocabulary's tokens for that run
    (a run of "=" tokenizes by its length modulo 16). So a tail is trusted only when it
    holds CUT_MARGIN_TOKENS more tokens than the `count` kept, and the kept tokens do
    not move when the cut moves one character further (another phase of any run) or
    twice as far; otherwise the tail doubles, up to the whole text, which is exact by
    definition.
    """
    encoded: dict[int, list[int]] = {}

    def tail_ids(length: int) -> list[int]:
        if length not in encoded:
            encoded[length] = _encode(tokenizer, text[-length:])
        return encoded[length]

    budget = (count + CUT_MARGIN_TOKENS) * CUT_CHARS_PER_TOKEN
    while budget < len(text):
        ids = tail_ids(budget)
        if len(ids) >= count + CUT_MARGIN_TOKENS and all(
            tail_ids(min(moved, len(text)))[-count:] == ids[-count:] for moved in (budget + 1, 2 * budget)
        ):
            return ids[-count:], text[-budget:], ids
        budget *= 2
    ids = tail_ids(len(text))
    return ids[-count:], text, ids


def _first_tokens(tokenizer, text: str, count: int, special_ids: frozenset[int]) -> tuple[list[int], str, list[int]]:
    """(tokens(text) through its first special token, first `count` of them; the head of
    `text` tokenized; its tokens), tokenizing heads only.

    As `_last_tokens`, from the other end, with one more way to be exact: a head that
    holds a special token tokenizes everything before it as the whole text does (the
    tokenizer splits its input at special tokens first), and nothing after it is kept.
    """
    encoded: dict[int, list[int]] = {}

    def head_ids(length: int) -> list[int]:
        if length not in encoded:
            encoded[length] = _encode(tokenizer, text[:length])
        return encoded[length]

    budget = (count + CUT_MARGIN_TOKENS) * CUT_CHARS_PER_TOKEN
    while budget < len(text):
        ids = head_ids(budget)
        if any(token_id in special_ids for token_id in ids):
            return ids[: _through_first_special(ids, special_ids)][:count], text[:budget], ids
        if len(ids) >= count + CUT_MARGIN_TOKENS and all(
            head_ids(min(moved, len(text)))[:count] == ids[:count] for moved in (budget + 1, 2 * budget)
        ):
            return ids[:count], text[:budget], ids
        budget *= 2
    ids = head_ids(len(text))
    return ids[: _through_first_special(ids, special_ids)][:count], text, ids


def _through_first_special(ids: Sequence[int], special_ids: Collection[int]) -> int:
    """The length of `ids` up to and including the first special token (all of them if none)."""
    return next((i + 1 for i, token_id in enumerate(ids) if token_id in special_ids), len(ids))


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def conversation_windows(
    tokenizer,
    conversation: Conversation,
    *,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    answer_tokens: int = DEFAULT_ANSWER_TOKENS,
    turns: str = _DEFAULTS.turns,
    exclude: Collection[str] = DEFAULT_EXCLUSIONS,
    prompts: bool = False,
    thinking: str = _DEFAULTS.thinking,
) -> tuple[list[Window], int] | Excluded:
    """The windows of one conversation and how many were retokenized at the boundary,
    or the reason it is excluded (checked in EXCLUSION_REASONS order). With `prompts`, a
    conversation ending with the user's message gives the window of its open turn: the
    rendered prompt as context and no answer (`Window.has_answer`), for the base to write.
    `thinking` (`data.thinking`: auto, on or off) chooses each turn's rendering (`turn_thinking`)."""
    turn_indices = selected_turns(conversation, turns, prompts)
    if not turn_indices:
        detail = ("a prompt without its answer: usable when the base writes the answers (data.answers: self_generated "
                  "or mixed)") if open_turn(conversation) else ""
        return Excluded(NO_ASSISTANT_TURN, detail)
    recorded = [k for k in turn_indices if k < len(conversation.messages)]
    if EMPTY_ANSWER in exclude and any(not _spoken(conversation.messages, k, thinking) for k in recorded):
        return Excluded(EMPTY_ANSWER)
    special = special_token_texts(tokenizer)
    for index, message in enumerate(conversation.messages[: max(turn_indices) + 1]):
        found = [token for token in special if token in message.content]
        if found:
            return Excluded(SPECIAL_TOKEN_IN_TEXT, f"message {index} contains {found[0]!r}")

    content_hash = conversation.content_hash
    windows: list[Window] = []
    retokenized = 0
    for k in turn_indices:
        in_thinking = turn_thinking(conversation.messages, k, thinking)
        rendered = render_turn(tokenizer, conversation.messages, k, in_thinking)
        if isinstance(rendered, Excluded):
            return rendered
        tokens = tokenize_window(tokenizer, *rendered, context_tokens, answer_tokens)
        retokenized += tokens.boundary_retokenized
        context, answer = tokens.context_ids, tokens.answer_ids
        windows.append(Window(content_hash, k, tuple(context + answer), len(context), in_thinking))
    return windows, retokenized


def _spoken(messages: Sequence[Message], turn_index: int, thinking: str) -> bool:
    """Whether the turn's window has text to score: its answer, or in thinking mode its reasoning (a turn
    whose budget ended inside the think block records reasoning alone)."""
    message = messages[turn_index]
    return bool(message.content.strip()) or (bool(message.reasoning.strip()) and turn_thinking(messages, turn_index, thinking))


def prompt_window(tokenizer, conversation: Conversation, turn_index: int, context_tokens: int, thinking: bool) -> Window:
    """The window of turn `turn_index`'s prompt alone, rendered with enable_thinking = `thinking`: what
    a serving configuration's base continues (`Window.has_answer` is False). The turn must render
    (`conversation_windows` kept it): DataError naming the conversation otherwise."""
    rendered = render_turn(tokenizer, conversation.messages[:turn_index], turn_index, thinking)
    if isinstance(rendered, Excluded):
        raise DataError(f"{conversation.location}: message {turn_index}'s prompt does not render with thinking "
                        f"{'on' if thinking else 'off'} ({rendered.reason}: {rendered.detail})")
    context, _, _ = _last_tokens(tokenizer, rendered[0], context_tokens)
    return Window(conversation.content_hash, turn_index, tuple(context), len(context), thinking)


def reasoning_left_out(conversation: Conversation, turn_indices: Sequence[int], thinking: str) -> int:
    """How many of the turns record reasoning that their windows leave out (thinking off)."""
    return sum(1 for k in turn_indices if k < len(conversation.messages) and conversation.messages[k].reasoning
               and not turn_thinking(conversation.messages, k, thinking))


def has_thinking_switch(tokenizer) -> bool:
    """Whether the chat template's generation prompt depends on enable_thinking."""
    probe = [{"role": "user", "content": "Hi"}]
    try:
        on, off = (tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, enable_thinking=flag)
                   for flag in (True, False))
    except (jinja2.TemplateError, ValueError):
        return False
    return on != off


def require_thinking_switch(tokenizer, asked_by: str, hint: str = "") -> None:
    """ConfigError naming the template when thinking is asked (by `asked_by`) of one without the switch."""
    if not has_thinking_switch(tokenizer):
        identity = tokenizer_identity(tokenizer)
        raise ConfigError(f"{asked_by}: thinking mode was asked, but the chat template of {identity['name_or_path']!r} "
                          f"(sha256 {identity['chat_template_sha256'][:12]}...) has no thinking switch: its generation "
                          f"prompt is the same with enable_thinking true and false{hint}")


REASONING_MARKERS = frozenset({THINK_OPEN, THINK_CLOSE})
"""Added tokens some tokenizers register as special and others (Qwen's) do not: text inside a span,
never a control token."""


def special_token_texts(tokenizer) -> list[str]:
    """The texts of the tokenizer's special added tokens, the chat's control tokens (the reasoning markers
    aside, special or not: they are a span's text)."""
    return sorted(token.content for token in tokenizer.added_tokens_decoder.values()
                  if token.special and token.content not in REASONING_MARKERS)


def _special_token_ids(tokenizer) -> frozenset[int]:
    return frozenset(token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special)


def _span_end_ids(tokenizer) -> frozenset[int]:
    """The special tokens an assistant span ends at: every special added token but the reasoning
    markers (`REASONING_MARKERS`), which open and close the think block inside a span whether or not
    the tokenizer marks them special."""
    return frozenset(token_id for token_id, token in tokenizer.added_tokens_decoder.items()
                     if token.special and token.content not in REASONING_MARKERS)


# ---------------------------------------------------------------------------- where a turn ends


def stop_token_ids(tokenizer, base_dir: str | Path | None = None) -> set[int]:
    """The tokenizer's eos, the template's end of turn, and the base's generation_config eos ids."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    end_of_turn = template_end_of_turn_id(tokenizer)
    if end_of_turn is not None:
        ids.add(end_of_turn)
    path = Path(base_dir) / "generation_config.json" if base_dir is not None else None
    if path is not None and path.is_file():
        configured = json.loads(path.read_text()).get("eos_token_id")
        ids.update(int(t) for t in (configured if isinstance(configured, list) else [configured]) if t is not None)
    return ids


def template_end_of_turn_id(tokenizer) -> int | None:
    """The special token that closes an assistant turn in the chat template (Qwen: <|im_end|>)."""
    messages = [Message("user", "Hi"), Message("assistant", "Hello")]
    rendered = render_turn(tokenizer, messages, 1)
    if isinstance(rendered, Excluded):
        return None
    span_ids = tokenize_turn(tokenizer, *rendered).span_ids
    return span_ids[-1] if span_ids and span_ids[-1] in _special_token_ids(tokenizer) else None


def require_chat_template(tokenizer) -> None:
    """Windows are rendered by the tokenizer's chat template: DataError without one."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template")


def tokenizer_identity(tokenizer) -> dict[str, Any]:
    """What identifies the rendering: the tokenizer's name, size, eos and chat template."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(tokenizer.chat_template, sort_keys=True)
    return {
        "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
        "vocab_size": len(tokenizer),
        "eos_token": tokenizer.eos_token,
        "chat_template_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest(),
    }


def load_tokenizer(model):
    """The run's tokenizer (`model.tokenizer`, else the base's directory; `model` the model settings),
    from local files only."""
    from transformers import AutoTokenizer

    path = model.tokenizer or model.base
    if not Path(path).is_dir():
        raise ConfigError(f"model.tokenizer: {path} is not a directory (tokenizer files with a chat template expected)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
