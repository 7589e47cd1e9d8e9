"""Chat files -> distinct, normalised conversations, with what was left out counted (docs/guide/DATA.md).

`ChatReader` is the one reading loop of the library: training's windows
(`data.prepare.prepare_windows`), `generate`'s prompts and validate's heldout prompts all
read `data.files` through it. A source is a local JSON, JSONL or parquet file, or a Hub
dataset (`hf:org/name?split=...&column=...`, `hub.parse_dataset`).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from occamy_mtp.config import DataSettings
from occamy_mtp.errors import OccamyError
from occamy_mtp.files import sha256_file
from occamy_mtp.hub import dataset_identity, dataset_records, is_dataset, parse_dataset

# Where an error or an exclusion was found, kept per reason for the report.
EXAMPLE_LOCATIONS_KEPT = 5
# A conversation with more text than this (UTF-8 bytes) is RECORD_TOO_LARGE (a run's default).
DEFAULT_MAX_RECORD_BYTES = DataSettings().max_record_bytes

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


@dataclass(frozen=True)
class Message:
    role: str  # "system", "user" or "assistant"
    content: str
    reasoning: str = ""
    """An assistant turn's reasoning, as the record carries it: its `reasoning_content` (or
    `reasoning`) field, as vLLM's and SGLang's reasoning parsers return it, or the inline
    `<think>...</think>` block that opened its content. Empty when it records none."""


@dataclass(frozen=True)
class Conversation:
    """One normalised conversation and where it came from (for errors and the report)."""

    messages: tuple[Message, ...]
    location: str  # "path:line" for JSONL, "path: record N" for JSON arrays and parquet
    category: str = ""
    """The record's `category` string, if it has one (served figures are broken down by it)."""
    source: str = ""
    """The data file (or Hub dataset) it was read from, as `data.files` names it."""

    @cached_property
    def content_hash(self) -> str:
        """sha256 of the roles and contents only: the conversation's identity for the split."""
        canonical = json.dumps([[m.role, m.content] + ([m.reasoning] if m.reasoning else []) for m in self.messages],
                               ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Excluded:
    """Why a record or conversation was left out (one of EXCLUSION_REASONS)."""

    reason: str
    detail: str = ""


@dataclass
class Tally:
    """Exclusion counts by reason and their first few locations."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, location: str, detail: str = "") -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        examples = self.examples.setdefault(reason, [])
        if len(examples) < EXAMPLE_LOCATIONS_KEPT:
            examples.append(f"{location}: {detail}" if detail else location)


# ---------------------------------------------------------------------------- the reader


class ChatReader:
    """One pass over chat sources: the distinct conversations, in source order.

    Iterating yields each conversation that normalises and was not read before (same roles
    and contents); what is left out is counted in `tally` under its reason (BAD_RECORD with
    `skip_bad_records`, else a DataError stops the pass), as is what a later stage excludes
    (`exclude`). After the pass, `files` describes each source (path or Hub name, sha256,
    bytes, records) and `conversations_read` counts the records.
    """

    def __init__(self, sources: Iterable[str | Path], *, exclude: Collection[str] = DEFAULT_EXCLUSIONS,
                 skip_bad_records: bool = False, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES):
        if max_record_bytes < 1:
            raise ValueError(f"max_record_bytes must be >= 1, got {max_record_bytes!r}")
        self.sources = [str(source) for source in sources]
        self.drop_non_text = NON_TEXT_CONTENT not in exclude
        self.skip_bad_records = skip_bad_records
        self.max_record_bytes = max_record_bytes
        self.tally = Tally()
        self.files: list[dict[str, Any]] = []
        self.conversations_read = 0
        self._started = False

    def __iter__(self) -> Iterator[Conversation]:
        if self._started:  # the counts are of one pass
            raise RuntimeError("a ChatReader reads its sources once; make another to read them again")
        self._started = True
        first_location: dict[str, str] = {}  # content hash -> where it was first read
        for source in self.sources:
            records, described = open_source(source, self.max_record_bytes)
            count = 0
            for location, record in records:
                count += 1
                self.conversations_read += 1
                try:
                    conversation = normalise_record(record, location, drop_non_text=self.drop_non_text,
                                                    max_record_bytes=self.max_record_bytes)
                except DataError as err:
                    if not self.skip_bad_records:
                        raise
                    self.exclude(BAD_RECORD, location, str(err).removeprefix(f"{location}: "))
                    continue
                if isinstance(conversation, Excluded):
                    self.exclude(conversation.reason, location, conversation.detail)
                    continue
                conversation = replace(conversation, source=source)
                if conversation.content_hash in first_location:
                    self.exclude(DUPLICATE_CONVERSATION, location, f"same as {first_location[conversation.content_hash]}")
                    continue
                first_location[conversation.content_hash] = location
                yield conversation
            self.files.append({**described(), "records": count})

    def exclude(self, reason: str, location: str, detail: str = "") -> None:
        """Count one conversation left out (a later stage's reasons too: one report)."""
        self.tally.add(reason, location, detail)

    def excluded(self) -> dict[str, int]:
        """Counts per reason, in EXCLUSION_REASONS order."""
        return {reason: self.tally.counts[reason] for reason in EXCLUSION_REASONS if reason in self.tally.counts}

    def excluded_examples(self) -> dict[str, list[str]]:
        return {reason: self.tally.examples[reason] for reason in EXCLUSION_REASONS if reason in self.tally.examples}


def open_source(source: str, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
                ) -> tuple[Iterator[tuple[str, Any]], Callable[[], dict[str, Any]]]:
    """A source's (location, record) pairs, and what describes it once read: a local file by
    its path and sha256, a Hub dataset by its name, snapshot and files' sha256."""
    if is_dataset(source):
        spec = parse_dataset(source)
        identity = dataset_identity(spec)
        described = {"path": spec.text, "sha256": identity["sha256"], "bytes": identity["bytes"],
                     "hub": {k: identity[k] for k in ("repo_id", "revision", "split", "subset", "column", "files")}}
        return dataset_records(spec, Path(identity["directory"])), lambda: described
    path = Path(source)
    return read_records(path, max_record_bytes), lambda: {"path": str(path), "sha256": sha256_file(path), "bytes": path.stat().st_size}


def missing_sources(sources: Iterable[str]) -> list[str]:
    """The local files among `sources` that do not exist (Hub datasets are checked when read)."""
    return [source for source in sources if not is_dataset(str(source)) and not Path(source).exists()]


# ---------------------------------------------------------------------------- reading


def read_records(path: Path, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[tuple[str, Any]]:
    """(location, record) pairs of one file; DataError for a malformed file or line.

    JSON and JSONL are parsed here rather than by `datasets`, whose errors for a bad
    line come from deep inside pyarrow without the line number. A JSONL file is read a
    line at a time, and a line too long to hold a record of at most `max_record_bytes` of
    text is not parsed (`_Oversized`): a 100 MB line costs 100 MB, not ten times that.
    """
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path}: not a file (pass the data files themselves)")
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        yield from _read_json(path, max_record_bytes)
    elif suffix in PARQUET_SUFFIXES:
        yield from _read_parquet(path)
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r}; expected one of {', '.join(JSON_SUFFIXES + PARQUET_SUFFIXES)}")


@dataclass(frozen=True)
class _Malformed:
    """A line that is not JSON: a bad record, skippable like the others."""

    problem: str


@dataclass(frozen=True)
class _Oversized:
    """A JSONL line longer than a record of `max_record_bytes` of text can be: excluded unparsed."""

    line_bytes: int


# The most bytes of JSON one byte of text takes: a control character escaped as \u0001.
JSON_BYTES_PER_TEXT_BYTE = 6


def _read_json(path: Path, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[tuple[str, Any]]:
    """A JSON array of records, or one record per line (JSONL; blank lines skipped)."""
    with open(path, "rb") as handle:
        head = handle.read(4096)
    bom = len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0  # a byte-order mark some editors write: skipped
    if head[bom:].lstrip().startswith(b"["):
        raw = path.read_bytes()
        text = _utf8(path, raw, bom, 0, 1)
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: malformed JSON ({err.msg}, column {err.colno})") from None
        for number, record in enumerate(records, start=1):
            yield f"{path}: record {number}", record
        return
    # Lines end at "\n" only (a binary file's lines): str.splitlines would also split at U+2028,
    # U+0085, \x0c and other characters that JSON strings may hold raw, cutting a record in two.
    longest = JSON_BYTES_PER_TEXT_BYTE * max_record_bytes
    offset = 0
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            start, offset = offset, offset + len(raw)
            if line_number == 1:
                raw, start = raw[bom:], bom
            if len(raw) > longest:
                yield f"{path}:{line_number}", _Oversized(len(raw))
                continue
            line = _utf8(path, raw, 0, start, line_number)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                yield f"{path}:{line_number}", _Malformed(f"malformed JSON ({err.msg}, column {err.colno})")
                continue
            yield f"{path}:{line_number}", record


def _utf8(path: Path, raw: bytes, skip: int, file_offset: int, first_line: int) -> str:
    """`raw[skip:]` as text; DataError naming the line and the byte of the file where it is not UTF-8."""
    try:
        return raw[skip:].decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + raw[: skip + err.start].count(b"\n")
        raise DataError(f"{path}:{line}: not UTF-8 text ({err.reason} at byte {file_offset + skip + err.start} of the file)") from None


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
    turn alone. Unknown keys are ignored. An assistant message's reasoning is read from its
    `reasoning_content` or `reasoning` string, else from an inline `<think>...</think>` block that
    opens its content (`split_reasoning`). A conversation whose messages hold more than
    `max_record_bytes` of text (UTF-8), reasoning included, is RECORD_TOO_LARGE.
    """
    if isinstance(record, _Malformed):
        raise DataError(f"{location}: {record.problem}")
    if isinstance(record, _Oversized):
        return Excluded(RECORD_TOO_LARGE, f"a line of {record.line_bytes} bytes, more than {JSON_BYTES_PER_TEXT_BYTE} "
                                          f"bytes of JSON per byte of text over the limit of {max_record_bytes} "
                                          "(max_record_bytes); not parsed")
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
        role = ROLE_SPELLINGS[spelled]
        reasoning = ""
        if role == "assistant":
            reasoning, text = _reasoning(raw, text, where)
        messages.append(Message(role, text, reasoning))
    if has_non_text and not drop_non_text:
        return Excluded(NON_TEXT_CONTENT)
    text_bytes = sum(_utf8_length(message.content) + _utf8_length(message.reasoning) for message in messages)
    if text_bytes > max_record_bytes:
        return Excluded(RECORD_TOO_LARGE, f"{text_bytes} bytes of text, over the limit of {max_record_bytes} (max_record_bytes)")
    category = record.get("category")
    return Conversation(tuple(messages), location, category.strip() if isinstance(category, str) else "")


REASONING_KEYS = ("reasoning_content", "reasoning")  # vLLM's and SGLang's reasoning parsers; newer vLLM says reasoning
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_reasoning(content: str) -> tuple[str, str]:
    """(reasoning, answer) of an assistant text that holds an inline think block, as Qwen's
    chat template splits it: the reasoning is what lies between the last `<think>` before the
    first `</think>` and that `</think>`, the answer what follows it; ("", content) without a
    `</think>`. Both are trimmed, as the template trims them."""
    if THINK_CLOSE not in content:
        return "", content
    before, _, after = content.partition(THINK_CLOSE)
    return before.split(THINK_OPEN)[-1].strip(), after.strip()


def _reasoning(raw: dict, content: str, where: str) -> tuple[str, str]:
    """(reasoning, content) of one assistant message: a reasoning field, else an inline think block."""
    for key in REASONING_KEYS:
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise DataError(f"{where}: {key!r} must be a string (the turn's reasoning), got {type(value).__name__}")
        if value.strip():
            return value, content
    return split_reasoning(content)


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
