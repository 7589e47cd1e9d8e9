"""Chat data -> assistant-only training windows (docs/CONTRACT.md section 4), with counted exclusions.

docs/DATA.md sets out the details.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import tempfile
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2

from occamy_mtp.cli import command, parse
from occamy_mtp.cli import parser as command_line
from occamy_mtp.hub import dataset_identity, dataset_records, is_dataset, parse_dataset
from occamy_mtp.config import TURN_CHOICES, ConfigError, DataSettings, RunConfig, window_settings
from occamy_mtp.errors import OccamyError
from occamy_mtp.files import sha256_file

# ---------------------------------------------------------------------------- settings

# The defaults of the window settings are a run's (`config.DataSettings`, where defaults
# live), but for the validation side: the function splits two ways unless asked; runs and
# commands ask.
_DEFAULTS = DataSettings()
DEFAULT_CONTEXT_TOKENS = _DEFAULTS.context_tokens
DEFAULT_ANSWER_TOKENS = _DEFAULTS.answer_tokens
NO_VALIDATION = 0

# Where an error or an exclusion was found, kept per reason for the report.
EXAMPLE_LOCATIONS_KEPT = 5
# Bytes read at a time when hashing input files.
DEFAULT_MAX_RECORD_BYTES = _DEFAULTS.max_record_bytes
# Bounded tokenization (tokenize_window). A text cut at an arbitrary character may
# tokenize differently within a few tokens of the cut; no token that close to a cut is
# ever kept. The first cut allows this many characters per token wanted, and doubles.
CUT_MARGIN_TOKENS = 16
CUT_CHARS_PER_TOKEN = 16

# Exclusion reasons, in the order they are checked (a conversation counts under the first).
BAD_RECORD = "bad_record"  # only with skip_bad_records; otherwise a DataError
TOOL_CALL_ROLES = "tool_call_roles"  # tool/function roles or tool calls: no normalised form
NON_TEXT_CONTENT = "non_text_content"  # image, audio, video or file parts
RECORD_TOO_LARGE = "record_too_large"  # more text than max_record_bytes
DUPLICATE_CONVERSATION = "duplicate_conversation"  # same normalised content as an earlier record
NO_ASSISTANT_TURN = "no_assistant_turn"
EMPTY_ANSWER = "empty_answer"  # a selected assistant turn is empty or whitespace only
SPECIAL_TOKEN_IN_TEXT = "special_token_in_text"  # e.g. a literal "<|im_end|>" in a message
TEMPLATE_ERROR = "template_error"  # the chat template refused the conversation
TEMPLATE_PREFIX_MISMATCH = "template_prefix_mismatch"  # the turn does not extend the generation prompt
BEYOND_SPLIT_SIZE = "beyond_split_size"  # more conversations than train + validation + heldout asked for
EXCLUSION_REASONS = (
    BAD_RECORD,
    TOOL_CALL_ROLES,
    NON_TEXT_CONTENT,
    RECORD_TOO_LARGE,
    DUPLICATE_CONVERSATION,
    NO_ASSISTANT_TURN,
    EMPTY_ANSWER,
    SPECIAL_TOKEN_IN_TEXT,
    TEMPLATE_ERROR,
    TEMPLATE_PREFIX_MISMATCH,
    BEYOND_SPLIT_SIZE,
)
# The exclusions a caller may turn off. Without NON_TEXT_CONTENT the non-text parts are
# dropped and the text kept (the served base would have seen the images: use with care);
# without EMPTY_ANSWER an empty answer gives a one-token window (`<|im_end|>`).
OPTIONAL_EXCLUSIONS = frozenset({NON_TEXT_CONTENT, EMPTY_ANSWER})
DEFAULT_EXCLUSIONS = OPTIONAL_EXCLUSIONS

# Role spellings, case-insensitive. ShareGPT says human/gpt; OpenAI's newer APIs say developer.
ROLE_SPELLINGS = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
}
TOOL_ROLE_SPELLINGS = frozenset({"tool", "function", "ipython", "observation", "function_call", "tool_call", "tool_calls", "tool_response"})
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
# Record-level keys that attach images to a ShareGPT/LLaVA-style record.
MEDIA_RECORD_KEYS = ("image", "images", "video", "videos", "audio", "audios")

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


class DataError(OccamyError, ValueError):
    """Bad input: the message names the file and line (or record) and what is wrong."""


# ---------------------------------------------------------------------------- types


@dataclass(frozen=True)
class Message:
    role: str  # "system", "user" or "assistant"
    content: str


@dataclass(frozen=True)
class Conversation:
    """One normalised conversation and where it came from (for errors and the report)."""

    messages: tuple[Message, ...]
    location: str  # "path:line" for JSONL, "path: record N" for JSON arrays and parquet

    @cached_property
    def content_hash(self) -> str:
        """sha256 of the roles and contents only: the conversation's identity for the split."""
        canonical = json.dumps([[m.role, m.content] for m in self.messages], ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Excluded:
    """Why a record or conversation was left out (one of EXCLUSION_REASONS)."""

    reason: str
    detail: str = ""


@dataclass(frozen=True)
class Window:
    """One training/eval window: context tokens followed by the assistant span.

    `input_ids[answer_start:]` is the assistant span: the first <= answer_tokens tokens of
    the assistant turn as the template renders it, ending with the end-of-turn token
    (`<|im_end|>`) when it falls within the limit: the served base predicts it too. `input_ids[:answer_start]` is the <= context_tokens
    tokens just before it, ending with the template's assistant header (and, for Qwen
    with thinking disabled, the empty think block).
    """

    conversation_hash: str
    turn_index: int  # index of the assistant message in the normalised conversation's messages
    input_ids: tuple[int, ...]
    answer_start: int

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


@dataclass
class _Tally:
    """Exclusion counts by reason and their first few locations."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, location: str, detail: str = "") -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        examples = self.examples.setdefault(reason, [])
        if len(examples) < EXAMPLE_LOCATIONS_KEPT:
            examples.append(f"{location}: {detail}" if detail else location)


@dataclass(frozen=True)
class PreparedData:
    """Windows of the train, validation and heldout conversations, and how they were obtained.

    Heldout is what every reported metric is measured on; validation (empty unless asked
    for) is what training may choose among its checkpoints with, so that the choice
    never sees the heldout conversations.
    """

    train: list[Window]
    heldout: list[Window]
    files: list[dict[str, Any]]
    conversations_read: int
    excluded: dict[str, int]
    excluded_examples: dict[str, list[str]]
    train_hashes: list[str]
    heldout_hashes: list[str]
    boundary_retokenized: int
    settings: dict[str, Any]
    tokenizer_identity: dict[str, Any]
    validation: list[Window] = field(default_factory=list)
    validation_hashes: list[str] = field(default_factory=list)
    # Kept out of `settings` (which the target cache's identity compares): it decides
    # which conversations are kept, never what a window holds, and the cache compares
    # the windows themselves too.
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    kept_apart: dict[str, int] = field(default_factory=dict)
    """Windows dropped because another side holds their context or answer (`keep_apart`)."""

    @property
    def conversations_kept(self) -> int:
        return len(self.train_hashes) + len(self.validation_hashes) + len(self.heldout_hashes)

    def summary(self) -> dict[str, Any]:
        """The counts a user checks before training (what the CLI prints)."""
        return {
            "files": [f["path"] for f in self.files],
            "conversations_read": self.conversations_read,
            "conversations_kept": self.conversations_kept,
            "excluded": dict(self.excluded),
            "windows_built": len(self.train) + len(self.validation) + len(self.heldout),
            "assistant_tokens_scored": _span_tokens(self.train) + _span_tokens(self.validation) + _span_tokens(self.heldout),
            "train_conversations": len(self.train_hashes),
            "validation_conversations": len(self.validation_hashes),
            "heldout_conversations": len(self.heldout_hashes),
            "train_windows": len(self.train),
            "validation_windows": len(self.validation),
            "heldout_windows": len(self.heldout),
            "prompt_windows": self.prompt_windows(),
            "kept_apart": dict(self.kept_apart),
        }

    def prompt_windows(self) -> dict[str, int]:
        """Windows of prompts (no recorded answer) on each side: trained and measured on the base's text only."""
        return {side: sum(not w.has_answer for w in windows)
                for side, windows in ((TRAIN, self.train), (VALIDATION, self.validation), (HELDOUT, self.heldout))}

    def members(self) -> dict[str, Any]:
        """What a resumed run must find again: the files by content and each side's conversations."""
        return {
            "files": [{"path": f["path"], "sha256": f["sha256"]} for f in self.files],
            TRAIN: list(self.train_hashes),
            VALIDATION: list(self.validation_hashes),
            HELDOUT: list(self.heldout_hashes),
        }

    def members_changed(self, recorded: dict[str, Any]) -> list[str]:
        """How `members()` differs from `recorded` (an earlier `members()`), one phrase per difference."""
        now = self.members()
        changes = []
        before_files = {f["path"]: f["sha256"] for f in recorded.get("files", [])}
        now_files = {f["path"]: f["sha256"] for f in now["files"]}
        for path in sorted(before_files.keys() | now_files.keys()):
            if before_files.get(path) != now_files.get(path):
                was, is_ = before_files.get(path), now_files.get(path)
                changes.append(f"data.files {path}: " + ("not read then" if was is None else "not read now" if is_ is None
                                                          else f"sha256 {was[:12]}... then, {is_[:12]}... now"))
        for side in (TRAIN, VALIDATION, HELDOUT):
            before, after = set(recorded.get(side, [])), set(now[side])
            if before != after:
                changes.append(f"the {side} split: {len(before - after)} of its {len(before)} conversations are gone, "
                               f"{len(after - before)} are new")
        return changes

    def provenance(self) -> dict[str, Any]:
        """JSON-able record for TRAINING.json: inputs, counts, the split and the settings."""
        return {
            "files": [dict(f) for f in self.files],
            "conversations_read": self.conversations_read,
            "conversations_kept": self.conversations_kept,
            "excluded": dict(self.excluded),
            "excluded_examples": {reason: list(places) for reason, places in self.excluded_examples.items()},
            "windows": {
                "built": len(self.train) + len(self.validation) + len(self.heldout),
                "train": len(self.train),
                "validation": len(self.validation),
                "heldout": len(self.heldout),
                "assistant_tokens_scored": _span_tokens(self.train) + _span_tokens(self.validation) + _span_tokens(self.heldout),
                "train_assistant_tokens": _span_tokens(self.train),
                "validation_assistant_tokens": _span_tokens(self.validation),
                "heldout_assistant_tokens": _span_tokens(self.heldout),
                "boundary_retokenized": self.boundary_retokenized,
                "kept_apart": dict(self.kept_apart),
                "prompts": self.prompt_windows(),
            },
            "split": {
                "method": "sha256(f'{seed}:{conversation_hash}') as a fraction in [0, 1): heldout below "
                "heldout_fraction, validation below heldout_fraction + validation_fraction, train above; "
                "each side keeps its lowest keys up to its size",
                "seed": self.settings["split_seed"],
                "heldout_fraction": self.settings["heldout_fraction"],
                "validation_fraction": self.settings["validation_fraction"],
                "train_conversations": len(self.train_hashes),
                "validation_conversations": len(self.validation_hashes),
                "heldout_conversations": len(self.heldout_hashes),
                "train_hashes": list(self.train_hashes),
                "validation_hashes": list(self.validation_hashes),
                "heldout_hashes": list(self.heldout_hashes),
            },
            "settings": dict(self.settings),
            "max_record_bytes": self.max_record_bytes,
            "tokenizer": dict(self.tokenizer_identity),
        }


def _span_tokens(windows: Iterable[Window]) -> int:
    return sum(window.answer_length for window in windows)


# ---------------------------------------------------------------------------- reading


def read_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, record) pairs of one file; DataError for a malformed file or line.

    JSON and JSONL are parsed here rather than by `datasets`, whose errors for a bad
    line come from deep inside pyarrow without the line number.
    """
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path}: not a file (pass the data files themselves)")
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        yield from _read_json(path)
    elif suffix in PARQUET_SUFFIXES:
        yield from _read_parquet(path)
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r}; expected one of {', '.join(JSON_SUFFIXES + PARQUET_SUFFIXES)}")


@dataclass(frozen=True)
class _Malformed:
    """A line that is not JSON: a bad record, skippable like the others."""

    problem: str


def _read_json(path: Path) -> Iterator[tuple[str, Any]]:
    """A JSON array of records, or one record per line (JSONL; blank lines skipped)."""
    raw = path.read_bytes()
    bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0  # a byte-order mark some editors write: skipped
    try:
        text = raw[bom:].decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: bom + err.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text ({err.reason} at byte {bom + err.start} of the file)") from None
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: malformed JSON ({err.msg}, column {err.colno})") from None
        for number, record in enumerate(records, start=1):
            yield f"{path}: record {number}", record
        return
    # Lines end at "\n" only: str.splitlines would also split at U+2028, U+0085, \x0c and
    # other characters that JSON strings may hold raw, cutting a record in two.
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            yield f"{path}:{line_number}", _Malformed(f"malformed JSON ({err.msg}, column {err.colno})")
            continue
        yield f"{path}:{line_number}", record


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import datasets

    bars_were_enabled = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="occamy-mtp-data-") as cache_dir:
            try:
                table = datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=cache_dir, keep_in_memory=True)
            except Exception as err:  # pyarrow and datasets raise many types; name the file instead
                raise DataError(f"{path}: cannot read as parquet ({type(err).__name__}: {err})") from None
            rows = list(table)
    finally:
        if bars_were_enabled:
            datasets.enable_progress_bars()
    for number, row in enumerate(rows, start=1):
        yield f"{path}: record {number}", row


# ---------------------------------------------------------------------------- normalising


def normalise_record(
    record: Any, location: str, *, drop_non_text: bool = False, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> Conversation | Excluded:
    """One record -> a Conversation, or an Excluded reason; DataError if malformed.

    OpenAI style: {"messages": [{"role", "content"}]} with content a string, null or a
    list of parts ({"type": "text", "text": ...}, image/audio/file parts). ShareGPT
    style: {"conversations": [{"from", "value"}]} (a top-level "system" string becomes
    the system turn). A prompt set's record: {"prompt": str} (and "system"), the user's
    turn alone. Unknown keys are ignored; so is any per-message reasoning field:
    windows are built with thinking disabled. A conversation whose messages hold more
    than `max_record_bytes` of text (UTF-8) is RECORD_TOO_LARGE.
    """
    if isinstance(record, _Malformed):
        raise DataError(f"{location}: {record.problem}")
    if not isinstance(record, dict):
        raise DataError(f"{location}: a record must be a JSON object, got {type(record).__name__}")
    from_prompt = False
    if isinstance(record.get("messages"), list):
        raw_messages, role_key, content_key = record["messages"], "role", "content"
    elif isinstance(record.get("conversations"), list):
        raw_messages, role_key, content_key = record["conversations"], "from", "value"
    elif isinstance(record.get("prompt"), str):  # a prompt set: the user's turn alone
        raw_messages, role_key, content_key = [{"role": "user", "content": record["prompt"]}], "role", "content"
        from_prompt = True
    else:
        raise DataError(f"{location}: record has no 'messages' (OpenAI style) or 'conversations' (ShareGPT style) list, "
                        "and no 'prompt' string")

    messages: list[Message] = []
    if (role_key == "from" or from_prompt) and isinstance(record.get("system"), str) and record["system"].strip():
        messages.append(Message("system", record["system"]))
    has_non_text = any(record.get(key) for key in MEDIA_RECORD_KEYS)
    for index, raw in enumerate(raw_messages):
        where = f"{location}: message {index}"
        if not isinstance(raw, dict):
            raise DataError(f"{where}: a message must be an object, got {type(raw).__name__}")
        # ShareGPT files sometimes use role/content inside "conversations".
        this_role_key, this_content_key = (role_key, content_key) if role_key in raw else ("role", "content")
        role = raw.get(this_role_key)
        if not isinstance(role, str):
            raise DataError(f"{where}: missing or non-string {this_role_key!r}")
        spelled = role.strip().lower()
        if spelled in TOOL_ROLE_SPELLINGS or raw.get("tool_calls") or raw.get("function_call"):
            return Excluded(TOOL_CALL_ROLES, f"message {index} role {role!r}")
        if spelled not in ROLE_SPELLINGS:
            accepted = ", ".join(sorted(ROLE_SPELLINGS))
            raise DataError(f"{where}: unknown role {role!r}; expected one of {accepted} (tool roles are excluded and counted)")
        text, part_has_non_text = _content_text(raw.get(this_content_key), where)
        has_non_text = has_non_text or part_has_non_text
        messages.append(Message(ROLE_SPELLINGS[spelled], text))
    if has_non_text and not drop_non_text:
        return Excluded(NON_TEXT_CONTENT)
    text_bytes = sum(_utf8_length(message.content) for message in messages)
    if text_bytes > max_record_bytes:
        return Excluded(RECORD_TOO_LARGE, f"{text_bytes} bytes of text, over the limit of {max_record_bytes} (max_record_bytes)")
    return Conversation(tuple(messages), location)


def _utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", errors="surrogatepass"))


def _content_text(content: Any, where: str) -> tuple[str, bool]:
    """(text, whether non-text parts were present) of one message's content."""
    if content is None:
        return "", False
    if isinstance(content, str):
        return content, False
    if not isinstance(content, list):
        raise DataError(f"{where}: content must be a string or a list of parts, got {type(content).__name__}")
    texts: list[str] = []
    has_non_text = False
    for part_index, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise DataError(f"{where}: content part {part_index} must be a string or an object with a 'type'")
        if part["type"] in TEXT_PART_TYPES:
            if not isinstance(part.get("text"), str):
                raise DataError(f"{where}: content part {part_index} is a text part whose 'text' is not a string")
            texts.append(part["text"])
        else:
            has_non_text = True
    return "".join(texts), has_non_text  # OpenAI and Qwen's template concatenate text parts


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


def render_turn(tokenizer, messages: Sequence[Message], turn_index: int) -> tuple[str, str] | Excluded:
    """(prompt text, assistant span text) of messages[turn_index] as the template renders it."""
    if turn_index == 0:
        return Excluded(TEMPLATE_ERROR, "the conversation opens with an assistant turn: there is no prompt")
    as_dicts = [{"role": m.role, "content": m.content} for m in messages[: turn_index + 1]]
    try:
        prompt = tokenizer.apply_chat_template(as_dicts[:turn_index], tokenize=False, add_generation_prompt=True,
                                               enable_thinking=False)
        if turn_index == len(messages):  # the open turn of a prompt: nothing recorded after the generation prompt
            return prompt, ""
        turn = tokenizer.apply_chat_template(as_dicts, tokenize=False, add_generation_prompt=False, enable_thinking=False)
    except (jinja2.TemplateError, ValueError) as err:
        return Excluded(TEMPLATE_ERROR, str(err))
    if not turn.startswith(prompt):
        return Excluded(TEMPLATE_PREFIX_MISMATCH, f"message {turn_index} does not render as a continuation of the generation prompt")
    return prompt, turn[len(prompt) :]


def tokenize_turn(tokenizer, prompt: str, span: str) -> _TurnTokens:
    """Token ids of the whole prompt and of the whole assistant span, each tokenized on its own.

    The span ends with its first special token (the template's end of turn); what
    follows it (Qwen: a newline) is never generated, so it is dropped. Work and memory
    grow with the texts (a 50 MB message took minutes and gigabytes): windows use
    `tokenize_window`, of which this is the reference.
    """
    prompt_ids = _encode(tokenizer, prompt)
    rendered_span_ids = _encode(tokenizer, span)
    whole_ids = _encode(tokenizer, prompt + span)
    end = _through_first_special(rendered_span_ids, _special_token_ids(tokenizer))
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
    special_ids = _special_token_ids(tokenizer)
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
) -> tuple[list[Window], int] | Excluded:
    """The windows of one conversation and how many were retokenized at the boundary,
    or the reason it is excluded (checked in EXCLUSION_REASONS order). With `prompts`, a
    conversation ending with the user's message gives the window of its open turn: the
    rendered prompt as context and no answer (`Window.has_answer`), for the base to write."""
    turn_indices = selected_turns(conversation, turns, prompts)
    if not turn_indices:
        detail = ("a prompt without its answer: usable when the base writes the answers (data.answers: self_generated "
                  "or mixed)") if open_turn(conversation) else ""
        return Excluded(NO_ASSISTANT_TURN, detail)
    recorded = [k for k in turn_indices if k < len(conversation.messages)]
    if EMPTY_ANSWER in exclude and any(not conversation.messages[k].content.strip() for k in recorded):
        return Excluded(EMPTY_ANSWER)
    special = _special_token_texts(tokenizer)
    for index, message in enumerate(conversation.messages[: max(turn_indices) + 1]):
        found = [token for token in special if token in message.content]
        if found:
            return Excluded(SPECIAL_TOKEN_IN_TEXT, f"message {index} contains {found[0]!r}")

    content_hash = conversation.content_hash
    windows: list[Window] = []
    retokenized = 0
    for k in turn_indices:
        rendered = render_turn(tokenizer, conversation.messages, k)
        if isinstance(rendered, Excluded):
            return rendered
        tokens = tokenize_window(tokenizer, *rendered, context_tokens, answer_tokens)
        retokenized += tokens.boundary_retokenized
        context, answer = tokens.context_ids, tokens.answer_ids
        windows.append(Window(content_hash, k, tuple(context + answer), len(context)))
    return windows, retokenized


def _special_token_texts(tokenizer) -> list[str]:
    """The texts of the tokenizer's special added tokens (chat control tokens)."""
    return sorted(token.content for token in tokenizer.added_tokens_decoder.values() if token.special)


def _special_token_ids(tokenizer) -> frozenset[int]:
    return frozenset(token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special)


# ---------------------------------------------------------------------------- split

TRAIN = "train"
VALIDATION = "validation"
HELDOUT = "heldout"
HASH_KEY_BITS = 64


def split_key(conversation_hash: str, seed: int) -> float:
    """A uniform number in [0, 1) that depends only on the conversation and the seed."""
    digest = hashlib.sha256(f"{seed}:{conversation_hash}".encode("ascii")).digest()
    return int.from_bytes(digest[: HASH_KEY_BITS // 8], "big") / 2**HASH_KEY_BITS


def default_fractions(train_conversations: int, heldout_conversations: int, validation_conversations: int = 0) -> tuple[float, float]:
    """(heldout_fraction, validation_fraction): each side's share of the conversations asked for."""
    total = train_conversations + heldout_conversations + validation_conversations
    return heldout_conversations / total, validation_conversations / total


def assign_split(
    conversation_hashes: Iterable[str],
    *,
    train_conversations: int,
    heldout_conversations: int,
    seed: int,
    heldout_fraction: float | None = None,
    validation_conversations: int = 0,
    validation_fraction: float | None = None,
) -> dict[str, str]:
    """hash -> "train", "validation", "heldout" or BEYOND_SPLIT_SIZE.

    A conversation's side is heldout iff its split key is below `heldout_fraction`,
    validation iff it is below `heldout_fraction + validation_fraction`, train otherwise
    (default fractions: each side's share of the sizes asked for; without validation
    conversations the split is heldout / (train + heldout) as it always was); each side
    then keeps the conversations with the lowest keys, up to its size. Guarantee,
    exactly: a conversation's side depends on its own content, the seed and the
    fractions only, so adding conversations never moves another one between sides.
    Adding one conversation changes at most one other assignment: when the new one's
    side is full and its key is below that side's largest kept key, that largest one
    becomes BEYOND_SPLIT_SIZE. While a side has room, adding data changes nothing else
    at all. The input order never matters. The price: a side can come out smaller than
    asked for when the data is just big enough (the report shows the sizes reached).
    """
    default_heldout, default_validation = default_fractions(train_conversations, heldout_conversations, validation_conversations)
    heldout_fraction = default_heldout if heldout_fraction is None else heldout_fraction
    validation_fraction = default_validation if validation_fraction is None else validation_fraction
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    if not 0.0 <= validation_fraction <= 1.0 - heldout_fraction:
        raise ValueError(f"validation_fraction must be in [0, 1 - heldout_fraction], got {validation_fraction}")
    keyed = sorted((split_key(h, seed), h) for h in set(conversation_hashes))
    assignment: dict[str, str] = {}
    kept = {TRAIN: 0, VALIDATION: 0, HELDOUT: 0}
    capacity = {TRAIN: train_conversations, VALIDATION: validation_conversations, HELDOUT: heldout_conversations}
    for key, conversation_hash in keyed:
        if key < heldout_fraction:
            side = HELDOUT
        elif key < heldout_fraction + validation_fraction:
            side = VALIDATION
        else:
            side = TRAIN
        if kept[side] < capacity[side]:
            assignment[conversation_hash] = side
            kept[side] += 1
        else:
            assignment[conversation_hash] = BEYOND_SPLIT_SIZE
    return assignment


# ---------------------------------------------------------------------------- entry point


def prepare_windows(
    paths: Iterable[str | Path],
    tokenizer,
    *,
    context_tokens: int = _DEFAULTS.context_tokens,
    answer_tokens: int = _DEFAULTS.answer_tokens,
    turns: str = _DEFAULTS.turns,
    train_conversations: int = _DEFAULTS.train_conversations,
    heldout_conversations: int = _DEFAULTS.heldout_conversations,
    split_seed: int = _DEFAULTS.split_seed,
    heldout_fraction: float | None = None,
    skip_bad_records: bool = _DEFAULTS.skip_bad_records,
    exclude: Collection[str] = DEFAULT_EXCLUSIONS,
    validation_conversations: int = NO_VALIDATION,
    max_record_bytes: int = _DEFAULTS.max_record_bytes,
    prompts: bool = False,
) -> PreparedData:
    """Read chat files, build assistant-only windows, split them; see the module docstring.

    `tokenizer` is a transformers tokenizer with a chat template (the base's own).
    With `skip_bad_records`, malformed records are counted as BAD_RECORD (first few
    locations in the report) instead of raising DataError; a missing or unreadable file
    always raises. `exclude` lists which of OPTIONAL_EXCLUSIONS apply; the other reasons
    always do. A conversation with more than `max_record_bytes` of text is excluded
    (RECORD_TOO_LARGE) before it is rendered. With `prompts` (the base writes the answers),
    a conversation that ends with the user's message also gives its open turn's window, with
    no answer (`conversation_windows`); without, a record that is only a prompt is
    NO_ASSISTANT_TURN, the detail saying why. Windows are ordered by split key, then turn.
    """
    _check_settings(context_tokens, answer_tokens, turns, train_conversations, heldout_conversations, validation_conversations, exclude)
    if max_record_bytes < 1:
        raise ValueError(f"max_record_bytes must be >= 1, got {max_record_bytes!r}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template")
    tally = _Tally()
    files: list[dict[str, Any]] = []
    windows_by_hash: dict[str, list[Window]] = {}  # the conversations that produced windows
    first_location: dict[str, str] = {}  # content hash -> where it was first read
    conversations_read = 0
    boundary_retokenized = 0
    for source in paths:
        if is_dataset(str(source)):  # a Hub dataset: its snapshot's identity, then its rows
            spec = parse_dataset(str(source))
            identity = dataset_identity(spec)
            read, described = dataset_records(spec, Path(identity["directory"])), {
                "path": spec.text, "sha256": identity["sha256"], "bytes": identity["bytes"],
                "hub": {k: identity[k] for k in ("repo_id", "revision", "split", "subset", "column", "files")}}
        else:
            path = Path(source)
            read, described = read_records(path), None
        records = 0
        for location, record in read:
            records += 1
            conversations_read += 1
            try:
                conversation = normalise_record(
                    record, location, drop_non_text=NON_TEXT_CONTENT not in exclude, max_record_bytes=max_record_bytes
                )
            except DataError as err:
                if not skip_bad_records:
                    raise
                tally.add(BAD_RECORD, location, str(err).removeprefix(f"{location}: "))
                continue
            if isinstance(conversation, Excluded):
                tally.add(conversation.reason, location, conversation.detail)
                continue
            content_hash = conversation.content_hash
            if content_hash in first_location:
                tally.add(DUPLICATE_CONVERSATION, location, f"same as {first_location[content_hash]}")
                continue
            first_location[content_hash] = location
            built = conversation_windows(
                tokenizer, conversation, context_tokens=context_tokens, answer_tokens=answer_tokens, turns=turns, exclude=exclude,
                prompts=prompts,
            )
            if isinstance(built, Excluded):
                tally.add(built.reason, location, built.detail)
                continue
            windows, retokenized = built
            windows_by_hash[content_hash] = windows
            boundary_retokenized += retokenized
        if described is None:
            described = {"path": str(path), "sha256": sha256_file(path), "bytes": path.stat().st_size}
        files.append({**described, "records": records})

    default_heldout, validation_fraction = default_fractions(train_conversations, heldout_conversations, validation_conversations)
    fraction = default_heldout if heldout_fraction is None else heldout_fraction
    assignment = assign_split(
        windows_by_hash, train_conversations=train_conversations, heldout_conversations=heldout_conversations, seed=split_seed,
        heldout_fraction=fraction, validation_conversations=validation_conversations, validation_fraction=validation_fraction,
    )
    members: dict[str, list[str]] = {TRAIN: [], VALIDATION: [], HELDOUT: []}
    for content_hash in sorted(windows_by_hash, key=lambda h: split_key(h, split_seed)):
        side = assignment[content_hash]
        if side == BEYOND_SPLIT_SIZE:
            tally.add(BEYOND_SPLIT_SIZE, first_location[content_hash])
        else:
            members[side].append(content_hash)

    settings = {
        "context_tokens": context_tokens,
        "answer_tokens": answer_tokens,
        "turns": turns,
        "train_conversations": train_conversations,
        "heldout_conversations": heldout_conversations,
        "validation_conversations": validation_conversations,
        "split_seed": split_seed,
        "heldout_fraction": fraction,
        "validation_fraction": validation_fraction,
        "skip_bad_records": skip_bad_records,
        "exclude": sorted(exclude),
        "enable_thinking": False,
        "kept_apart_by": "context and answer",
        "prompts": prompts,
    }
    sides = {side: [w for h in members[side] for w in windows_by_hash[h]] for side in members}
    kept_apart = keep_apart(sides)
    return PreparedData(
        train=sides[TRAIN],
        heldout=sides[HELDOUT],
        files=files,
        conversations_read=conversations_read,
        excluded={reason: tally.counts[reason] for reason in EXCLUSION_REASONS if reason in tally.counts},
        excluded_examples={reason: tally.examples[reason] for reason in EXCLUSION_REASONS if reason in tally.examples},
        train_hashes=members[TRAIN],
        heldout_hashes=members[HELDOUT],
        validation=sides[VALIDATION],
        validation_hashes=members[VALIDATION],
        boundary_retokenized=boundary_retokenized,
        settings=settings,
        tokenizer_identity=tokenizer_identity(tokenizer),
        max_record_bytes=max_record_bytes,
        kept_apart=kept_apart,
    )


def keep_apart(sides: dict[str, list[Window]]) -> dict[str, int]:
    """Drop, in place, the validation windows that share a context or an answer with a heldout
    window, then the train windows that share one with a heldout or validation window.

    The split assigns whole conversations, but two conversations can share a prompt (the
    same question answered twice) or an answer span (answers that differ only past the
    window): with self-generated answers a window is its context and the base's
    continuation of it, so a shared context is a shared window, and the teacher-forced
    figures read the recorded answers in every recipe. Heldout is never changed (every
    reported figure is measured on it). Returns how many windows each side lost.
    """
    def keys(window: Window) -> tuple[tuple, ...]:
        context = ("context",) + window.input_ids[: window.answer_start]
        return (context, ("answer",) + window.input_ids[window.answer_start :]) if window.has_answer else (context,)

    taken = {key for w in sides[HELDOUT] for key in keys(w)}
    dropped = {}
    for side in (VALIDATION, TRAIN):
        kept = [w for w in sides[side] if not taken.intersection(keys(w))]
        dropped[f"{side}_windows_dropped"] = len(sides[side]) - len(kept)
        sides[side][:] = kept
        taken.update(key for w in kept for key in keys(w))
    return dropped


def _check_settings(
    context_tokens: int, answer_tokens: int, turns: str, train_conversations: int, heldout_conversations: int,
    validation_conversations: int, exclude: Collection[str],
) -> None:
    checks = (
        (context_tokens >= 1, "context_tokens", ">= 1", context_tokens),
        (answer_tokens >= 1, "answer_tokens", ">= 1", answer_tokens),
        (turns in TURN_CHOICES, "turns", " or ".join(TURN_CHOICES), turns),
        (train_conversations >= 0, "train_conversations", ">= 0", train_conversations),
        (heldout_conversations >= 0, "heldout_conversations", ">= 0", heldout_conversations),
        (validation_conversations >= 0, "validation_conversations", ">= 0", validation_conversations),
        (train_conversations + heldout_conversations + validation_conversations >= 1,
         "train_conversations + heldout_conversations + validation_conversations", ">= 1", None),
    )
    for ok, name, expected, value in checks:
        if not ok:
            raise ValueError(f"{name} must be {expected}" + ("" if value is None else f", got {value!r}"))
    unknown = set(exclude) - OPTIONAL_EXCLUSIONS
    if unknown:
        raise ValueError(f"exclude: {sorted(unknown)} cannot be switched; optional exclusions are {sorted(OPTIONAL_EXCLUSIONS)}")


def tokenizer_identity(tokenizer) -> dict[str, Any]:
    """What identifies the rendering: the tokenizer's name, size, eos and chat template."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(tokenizer.chat_template, sort_keys=True)
    return {
        "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
        "vocab_size": len(tokenizer),
        "eos_token": tokenizer.eos_token,
        "chat_template_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest(),
    }


# ---------------------------------------------------------------------------- CLI


def load_tokenizer(config: RunConfig):
    """The run's tokenizer (`model.tokenizer`, else the base's directory), from local files only."""
    from transformers import AutoTokenizer

    path = config.model.tokenizer or config.model.base
    if not Path(path).is_dir():
        raise ConfigError(f"model.tokenizer: {path} is not a directory (tokenizer files with a chat template expected)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"files: {', '.join(summary['files'])}",
        f"conversations: {summary['conversations_read']} read, {summary['conversations_kept']} kept",
    ]
    if summary["excluded"]:
        lines.append("excluded: " + ", ".join(f"{reason} {count}" for reason, count in summary["excluded"].items()))
    else:
        lines.append("excluded: none")
    lines.append(
        f"split: {summary['train_conversations']} train / {summary['validation_conversations']} validation / "
        f"{summary['heldout_conversations']} heldout conversations, "
        f"{summary['train_windows']} / {summary['validation_windows']} / {summary['heldout_windows']} windows"
    )
    lines.append(f"windows: {summary['windows_built']} built, {summary['assistant_tokens_scored']} assistant tokens scored")
    if any(summary["prompt_windows"].values()):
        lines.append("prompts (no recorded answer; the base writes it): " + " / ".join(
            str(summary["prompt_windows"][side]) for side in (TRAIN, VALIDATION, HELDOUT)) + " train / validation / heldout windows")
    dropped = {side.removesuffix("_windows_dropped"): n for side, n in summary["kept_apart"].items() if n}
    if dropped:
        lines.append("kept apart: " + ", ".join(f"{n} {side}" for side, n in dropped.items()) + " windows dropped, sharing "
                     "a context or an answer with a heldout (or validation) window")
    return "\n".join(lines)


@command
def main(argv: list[str] | None = None) -> int:
    cli = command_line("python -m occamy_mtp.data",
                       "Check chat data as training would see it: conversations read, kept, excluded per reason, windows, split.",
                       config_required=False)
    cli.add_argument("--keep-non-text", action="store_true", help="drop image/audio parts and keep the text instead of excluding")
    cli.add_argument("--keep-empty-answers", action="store_true", help="keep empty answers (a one-token window)")
    cli.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    args, config = parse(cli, argv)
    if not config.data.files:
        raise ConfigError("data.files: no chat data files given (data.files=[a.jsonl,b.jsonl], or --config RUN.yaml)")
    missing = [path for path in config.data.files if not Path(path).exists()]
    if missing:  # before the slow transformers import: a typo should fail at once
        raise ConfigError(f"data.files: {missing[0]}: no such file")
    tokenizer = load_tokenizer(config)
    exclude = set(DEFAULT_EXCLUSIONS)
    if args.keep_non_text:
        exclude.discard(NON_TEXT_CONTENT)
    if args.keep_empty_answers:
        exclude.discard(EMPTY_ANSWER)
    split = window_settings(config.data)
    try:
        data = prepare_windows(config.data.files, tokenizer, exclude=frozenset(exclude), **split)
    except ValueError as err:
        raise DataError(str(err)) from None
    summary = data.summary()
    if args.json:
        summary["excluded_examples"] = data.excluded_examples
        print(json.dumps(summary, indent=2))
    else:
        print(_format_summary(summary))
        sides = [(side, split[f"{side}_conversations"]) for side in ("train", "validation", "heldout")]
        for side, asked in sides:
            if summary[f"{side}_conversations"] < asked:
                fraction = data.settings["heldout_fraction"]
                print(
                    f"note: {side} has {summary[f'{side}_conversations']} of the {asked} conversations asked for: no more "
                    f"hash to that side (heldout iff split key < {fraction:.4g}); add conversations (see assign_split)"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
