"""The `generate` command: a chat dataset's answers rewritten by the frozen base (greedy, in
`data.thinking`'s mode), as a resumable JSONL file of records, through the self-generated store's
writer. A turn written in thinking mode keeps the base's reasoning in `reasoning_content` and its
answer in `content`, as vLLM's and SGLang's reasoning parsers return them.

docs/guide/REGENERATE.md sets out the details.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


from occamy_mtp.console import Progress
from occamy_mtp.errors import OccamyError
from occamy_mtp import __version__
from occamy_mtp.base.frozen import BaseIdentity
from occamy_mtp.files import appended_lines, open_owned, space_errors, write_json
from occamy_mtp.data import reader, windows
from occamy_mtp.config import TURN_CHOICES
from occamy_mtp.selfgen.store import EmbeddedWriter

# ---------------------------------------------------------------------------- settings

DEFAULT_MAX_NEW_TOKENS = windows.DEFAULT_ANSWER_TOKENS  # a window scores at most this many answer tokens
SIDECAR_SUFFIX = ".meta.json"
SIDECAR_FORMAT = 1
# Settings that change what the generated text is: a resume must match them.
COMPARED_SETTINGS = ("turns", "max_new_tokens", "eos_token_ids", "thinking", "dtype", "exclude", "skip_bad_records")
# Tokenizer fields that change the rendering (its path may differ between runs).
COMPARED_TOKENIZER_FIELDS = ("vocab_size", "eos_token", "chat_template_sha256")
COMPARED_BASE_FIELDS = ("config_sha256", "weights_sample_sha256", "vocab_size", "dtype", "attn_implementation", "activations")
"""The base's whole identity (`base.frozen.BaseIdentity`): a resumed output was written by the same base
computing the same way. `activations` is recorded only where emulated (absent: None, as before it was)."""
OPTIONAL_BASE_FIELDS = ("activations",)

# meta.roundtrip values, in the order they are checked (see the module docstring).
ROUNDTRIP_EXACT = "exact"
DIFFERENT_END_TOKEN = "different_end_token"
LOSSY_DECODE = "lossy_decode"
SPECIAL_TOKEN_IN_TEXT = "special_token_in_text"
TEMPLATE_REWROTE_TEXT = "template_rewrote_text"
RETOKENIZED = "retokenized"
ROUNDTRIP_OUTCOMES = (ROUNDTRIP_EXACT, DIFFERENT_END_TOKEN, LOSSY_DECODE, SPECIAL_TOKEN_IN_TEXT, TEMPLATE_REWROTE_TEXT, RETOKENIZED)
REPLACEMENT_CHARACTER = "\ufffd"


class GenerateError(OccamyError, ValueError):
    """An output that cannot be resumed, or an argument that cannot work; says which and why."""


# ---------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompt:
    """One assistant turn to regenerate: the messages before it, rendered and tokenized."""

    conversation: reader.Conversation
    turn_index: int  # index of the regenerated assistant message in conversation.messages
    prompt_ids: tuple[int, ...]
    thinking: bool = False
    """Rendered in thinking mode: the base writes its reasoning, then `</think>` and the answer."""

    @property
    def key(self) -> tuple[str, int]:
        return self.conversation.content_hash, self.turn_index


@dataclass(frozen=True)
class Prompts:
    """The prompts of some chat files and the conversations left out, per reason."""

    prompts: list[Prompt]
    files: list[dict[str, Any]]
    conversations_read: int
    excluded: dict[str, int]
    excluded_examples: dict[str, list[str]]


def read_prompts(
    paths: Iterable[str | Path],
    tokenizer,
    *,
    turns: str = "last",
    exclude: Collection[str] = reader.DEFAULT_EXCLUSIONS,
    skip_bad_records: bool = False,
    max_record_bytes: int = reader.DEFAULT_MAX_RECORD_BYTES,
    thinking: str = "auto",
) -> Prompts:
    """The prompts of the selected assistant turns, in file order, with training's exclusions (`data.reader`, `data.windows`).

    A conversation is kept iff `prepare_windows` would build windows from it with the
    same `turns`, `exclude` and `thinking` (the same reasons, counted the same way, duplicates
    included); its prompt is the window's context before truncation.
    """
    if turns not in TURN_CHOICES:
        raise ValueError(f"turns must be {' or '.join(TURN_CHOICES)}, got {turns!r}")
    windows.require_chat_template(tokenizer)
    if thinking == "on":
        windows.require_thinking_switch(tokenizer, "data.thinking")
    read = reader.ChatReader(paths, exclude=exclude, skip_bad_records=skip_bad_records, max_record_bytes=max_record_bytes)
    prompts: list[Prompt] = []
    for conversation in read:
        # The window builder is the judge of what is kept, so both exclude alike.
        built = windows.conversation_windows(tokenizer, conversation, turns=turns, exclude=exclude, thinking=thinking)
        if isinstance(built, reader.Excluded):
            read.exclude(built.reason, conversation.location, built.detail)
            continue
        for turn_index in windows.selected_turns(conversation, turns):
            in_thinking = windows.turn_thinking(conversation.messages, turn_index, thinking)
            prompt_text, _ = windows.render_turn(tokenizer, conversation.messages, turn_index, in_thinking)
            prompt_ids = tuple(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
            prompts.append(Prompt(conversation, turn_index, prompt_ids, in_thinking))
    return Prompts(prompts=prompts, files=read.files, conversations_read=read.conversations_read,
                   excluded=read.excluded(), excluded_examples=read.excluded_examples())


# ---------------------------------------------------------------------------- records


def roundtrip_outcome(
    tokenizer, messages: Sequence[reader.Message], generated_ids: Sequence[int], finished: bool, end_of_turn_id: int | None,
    thinking: bool = False, text: str | None = None,
) -> str:
    """Whether chat template + tokenizer turn the record's text back into `generated_ids`.

    `messages` end with the generated assistant turn; `text` is what the base wrote, decoded
    (default: that turn's content; in thinking mode its reasoning, `</think>` and answer);
    `end_of_turn_id` is `data.windows.template_end_of_turn_id(tokenizer)`. See the module
    docstring for the outcomes, checked in ROUNDTRIP_OUTCOMES order.
    """
    text = messages[-1].content if text is None else text
    content_ids = list(generated_ids[:-1] if finished else generated_ids)
    if finished and generated_ids[-1] != end_of_turn_id:
        return DIFFERENT_END_TOKEN
    if not _spells_valid_utf8(tokenizer, content_ids, text):
        return LOSSY_DECODE
    if any(token in text for token in windows.special_token_texts(tokenizer)):
        return SPECIAL_TOKEN_IN_TEXT
    rendered = windows.render_turn(tokenizer, messages, len(messages) - 1, thinking)
    end_text = "" if end_of_turn_id is None else _decode(tokenizer, [end_of_turn_id])
    if isinstance(rendered, reader.Excluded) or not rendered[1].startswith(text + end_text):
        return TEMPLATE_REWROTE_TEXT
    expected = content_ids + ([] if end_of_turn_id is None else [end_of_turn_id])
    # Only the answer's first len(expected) tokens are compared: the prompt, however
    # long, is not tokenized for it (one context token is the least a window asks for).
    answer_ids = windows.tokenize_window(tokenizer, *rendered, 1, len(expected)).answer_ids
    return ROUNDTRIP_EXACT if answer_ids == expected else RETOKENIZED


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 / Qwen byte-level BPE: the printable character that stands for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _spells_valid_utf8(tokenizer, ids: Sequence[int], text: str) -> bool:
    """False iff the tokens' bytes are not valid UTF-8 (their decoding then holds U+FFFD).

    For byte-level BPE the bytes are read from the tokens themselves, so that a U+FFFD
    the base really wrote is not mistaken for a broken character; for other tokenizers
    any U+FFFD in the text counts as lossy.
    """
    if REPLACEMENT_CHARACTER not in text:
        return True
    alphabet = _byte_level_alphabet()
    added = {token.content for token in tokenizer.added_tokens_decoder.values()}
    raw = bytearray()
    for token in tokenizer.convert_ids_to_tokens(list(ids)):
        if token in added:
            raw.extend(token.encode("utf-8"))
        elif all(char in alphabet for char in token):
            raw.extend(alphabet[char] for char in token)
        else:  # not byte-level BPE
            return False
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def make_record(
    tokenizer, prompt: Prompt, generated_ids: Sequence[int], eos_token_ids: Collection[int], end_of_turn_id: int | None
) -> dict[str, Any]:
    """The JSONL record of one regenerated turn (see the module docstring)."""
    generated_ids = [int(t) for t in generated_ids]
    finished = bool(generated_ids) and generated_ids[-1] in eos_token_ids
    text = _decode(tokenizer, generated_ids[:-1] if finished else generated_ids)
    if prompt.thinking:  # the prompt opened the think block: the text is reasoning, `</think>`, answer
        reasoning, content = reader.split_reasoning(text) if reader.THINK_CLOSE in text else (text.strip(), "")
    else:
        reasoning, content = "", text
    messages = list(prompt.conversation.messages[: prompt.turn_index]) + [reader.Message("assistant", content, reasoning)]
    return {
        "messages": [{"role": m.role, "content": m.content, **({"reasoning_content": m.reasoning} if m.reasoning else {})}
                     for m in messages],
        "meta": {
            "source": prompt.conversation.location,
            "source_hash": prompt.conversation.content_hash,
            "turn_index": prompt.turn_index,
            "prompt_tokens": len(prompt.prompt_ids),
            "generated_tokens": len(generated_ids),
            "finished": finished,
            "thinking": prompt.thinking,
            "roundtrip": roundtrip_outcome(tokenizer, messages, generated_ids, finished, end_of_turn_id, prompt.thinking, text),
            "generated_token_ids": generated_ids,
        },
    }


def record_line(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"


# ---------------------------------------------------------------------------- output file


@dataclass(frozen=True)
class ExistingOutput:
    """What an earlier run left in the output file."""

    metas: list[dict[str, Any]]  # meta of every good record, in file order
    good_bytes: int  # length of the file up to the end of its last good line
    torn_bytes: int  # bytes after it (a line cut by a kill), 0 if none

    @property
    def keys(self) -> set[tuple[str, int]]:
        return {(m["source_hash"], m["turn_index"]) for m in self.metas}


# The meta fields a resume reads back, and their types.
_META_TYPES = {"source_hash": str, "turn_index": int, "finished": bool, "generated_tokens": int, "roundtrip": str}


def read_existing_output(path: Path) -> ExistingOutput:
    """Parse an output file; a last line without its newline is torn, any other bad line an error."""
    if not path.exists():
        return ExistingOutput([], 0, 0)
    raw = path.read_bytes()
    good_bytes = raw.rfind(b"\n") + 1  # 0 when there is no complete line
    metas: list[dict[str, Any]] = []
    for line_number, line in enumerate(raw[:good_bytes].splitlines(), start=1):
        try:
            record = json.loads(line)
            meta = record["meta"]
            ours = isinstance(record["messages"], list) and all(isinstance(meta[k], t) for k, t in _META_TYPES.items())
        except (ValueError, KeyError, TypeError):
            ours = False
        if not ours:
            raise GenerateError(
                f"{path}:{line_number}: not a record written by `python -m occamy_mtp generate`; "
                "only a torn LAST line is repaired on resume: fix the file or choose another --out"
            ) from None
        metas.append(meta)
    return ExistingOutput(metas, good_bytes, len(raw) - good_bytes)


def sidecar_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.name + SIDECAR_SUFFIX)


def base_record(identity: BaseIdentity, directory: str | Path) -> dict[str, Any]:
    """The base's part of the sidecar: its whole identity (`base.frozen.BaseIdentity`), with its path for the reader."""
    return {"path": str(Path(directory).resolve()), **identity.fingerprint, **identity.settings()}


def _differences(existing: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Where an existing output's sidecar disagrees with this run, as 'what: then vs now'."""
    differences = []
    for section, names in (("settings", COMPARED_SETTINGS), ("base", COMPARED_BASE_FIELDS), ("tokenizer", COMPARED_TOKENIZER_FIELDS)):
        recorded = existing.get(section, {})
        for name in names:
            then, now = recorded.get(name), current[section].get(name)
            if then == now:
                continue
            if name not in recorded and name not in OPTIONAL_BASE_FIELDS:
                differences.append(f"{section}.{name}: not recorded in the existing output (written before it was), {now!r} now")
            else:
                differences.append(f"{section}.{name}: {then!r} in the existing output, {now!r} now")
    return differences


# ---------------------------------------------------------------------------- entry point


@dataclass
class GenerateReport:
    """What a run did and what the whole output file now holds (the sidecar's counts)."""

    out_path: str
    conversations_read: int
    excluded: dict[str, int]
    excluded_examples: dict[str, list[str]]
    prompts_total: int  # regenerable turns in the data
    prompts_selected: int  # after `limit`
    skipped_done: int  # selected prompts already in the output
    generated_now: int  # records written by this run
    regenerated_for_batching: int  # records computed again to keep a batch whole (not written)
    torn_lines_dropped: int
    records_in_file: int
    finished: int
    unfinished: int  # stopped at max_new_tokens
    generated_tokens: int  # in the whole file
    roundtrip: dict[str, int] = field(default_factory=dict)  # meta.roundtrip outcome -> records
    complete: bool = False  # every selected prompt is in the file
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def regenerate_answers(
    files: Iterable[str | Path],
    tokenizer,
    base,
    out_path: str | Path,
    *,
    base_identity: dict[str, Any],
    turns: str = "last",
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    batch_size: int = 0,
    log: Callable[[str], None] | None = None,
    resume: bool = True,
    eos_token_ids: Collection[int] | None = None,
    limit: int | None = None,
    exclude: Collection[str] = reader.DEFAULT_EXCLUSIONS,
    skip_bad_records: bool = False,
    progress: bool = False,
    max_record_bytes: int = reader.DEFAULT_MAX_RECORD_BYTES,
    thinking: str = "auto",
) -> GenerateReport:
    """Regenerate the selected assistant turns of `files` with `base`; see the module docstring.

    `base_identity` is the base's `base_record` (compared whole on resume).
    `eos_token_ids` defaults to `data.windows.stop_token_ids(tokenizer)`. `limit` keeps the
    first N prompts (in file order); a later run without it continues the same file.
    With `resume=False` an existing non-empty output is an error, never overwritten.
    `batch_size` 0 sizes the batch to the GPU (`store.EmbeddedWriter.batch_for`), which says
    what it chose and why to `log`. Raises DataError for bad data and GenerateError for an
    output it must not touch.
    """
    started = time.perf_counter()
    out_path = Path(out_path)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if max_new_tokens < 1 or batch_size < 0:
        raise ValueError(f"max_new_tokens must be >= 1 and batch_size >= 0 (0: as many as fit), got {max_new_tokens} and {batch_size}")
    eos = frozenset(int(t) for t in (windows.stop_token_ids(tokenizer) if eos_token_ids is None else eos_token_ids))
    if not eos:
        raise ValueError("eos_token_ids is empty: every answer would run to max_new_tokens")
    parameter = next(base.parameters())
    settings = {
        "turns": turns,
        "max_new_tokens": max_new_tokens,
        "eos_token_ids": sorted(eos),
        "thinking": thinking,
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "exclude": sorted(exclude),
        "skip_bad_records": skip_bad_records,
        "max_record_bytes": max_record_bytes,  # recorded, not compared on resume: it only keeps prompts out
    }
    tokenizer_identity = windows.tokenizer_identity(tokenizer)
    sidecar = {"format": SIDECAR_FORMAT, "library_version": __version__, "settings": settings, "base": dict(base_identity), "tokenizer": tokenizer_identity}

    # 1. What is already there: refuse before touching anything.
    existing = read_existing_output(out_path)
    meta_path = sidecar_path(out_path)
    if existing.metas or existing.torn_bytes:
        if not resume:
            raise GenerateError(f"{out_path} exists and resume is off: choose another output or remove it (and {meta_path.name})")
        if not meta_path.is_file():
            raise GenerateError(f"{out_path} has records but no {meta_path.name}: its settings cannot be checked, so it is not resumed")
        try:
            previous = json.loads(meta_path.read_text())
        except json.JSONDecodeError as err:
            raise GenerateError(f"{meta_path}: not valid JSON ({err}); the output's settings cannot be checked") from None
        differences = _differences(previous, sidecar)
        if differences:
            raise GenerateError(f"{out_path} was made with other settings; not resuming onto it:\n  " + "\n  ".join(differences))
        runs = list(previous.get("runs", []))
    else:
        runs = []

    # 2. The prompts (a DataError stops here, before anything is written).
    read = read_prompts(
        files, tokenizer, turns=turns, exclude=exclude, skip_bad_records=skip_bad_records, max_record_bytes=max_record_bytes,
        thinking=thinking,
    )
    selected = read.prompts if limit is None else read.prompts[:limit]
    done = existing.keys
    missing = [p for p in selected if p.key not in done]

    # 3. Repair a torn last line, then append.
    if existing.torn_bytes:  # only the bytes after the last complete line: good lines are never touched
        with open_owned(out_path, "r+b") as handle:  # never through a link
            handle.truncate(existing.good_bytes)
    device = str(parameter.device)
    runs.append({"device": device, "batch_size": batch_size, "limit": limit, "started": time.strftime("%Y-%m-%dT%H:%M:%S")})
    sidecar.update(status="running", runs=runs, data=_data_section(read, limit))
    write_json(meta_path, sidecar)

    end_of_turn_id = windows.template_end_of_turn_id(tokenizer)
    metas = list(existing.metas)
    contexts = [list(p.prompt_ids) for p in selected]
    missing_flags = [p.key not in done for p in selected]
    bar = Progress(len(missing), "generate", "answer", enabled=progress)
    regenerated = 0
    quiet = lambda message: None  # noqa: E731
    log = log or quiet
    if missing:
        # The store's writer: the fast static decoder on CUDA, transformers' decoding elsewhere.
        writer = EmbeddedWriter(base, batch_size)
        size = writer.batch_for(contexts, max_new_tokens, log)
        writer = EmbeddedWriter(base, size)
        runs[-1]["batch_size"] = size
        # The writer decodes a batch with any record missing whole: the others are computed again, not written.
        batches = [range(start, min(start + size, len(selected))) for start in range(0, len(selected), size)]
        regenerated = sum(not missing_flags[i] for batch in batches if any(missing_flags[i] for i in batch) for i in batch)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        kept = "the records written before are kept, and the rerun writes only the rest"
        with appended_lines(out_path, kept=kept) as stream:
            for index, continuation in writer.answers(contexts, missing_flags, max_new_tokens, eos, quiet):  # the bar shows it
                prompt = selected[index]
                record = make_record(tokenizer, prompt, continuation.tokens, eos, end_of_turn_id)
                stream.write(record_line(record))
                stream.flush()
                os.fsync(stream.fileno())
                metas.append(record["meta"])
                done.add(prompt.key)
                bar.update(1)
    bar.close()

    report = GenerateReport(
        out_path=str(out_path),
        conversations_read=read.conversations_read,
        excluded=read.excluded,
        excluded_examples=read.excluded_examples,
        prompts_total=len(read.prompts),
        prompts_selected=len(selected),
        skipped_done=len(selected) - len(missing),
        generated_now=len(missing),
        regenerated_for_batching=regenerated,
        torn_lines_dropped=int(existing.torn_bytes > 0),
        records_in_file=len(metas),
        finished=sum(bool(m["finished"]) for m in metas),
        unfinished=sum(not m["finished"] for m in metas),
        generated_tokens=sum(int(m["generated_tokens"]) for m in metas),
        roundtrip={o: n for o in ROUNDTRIP_OUTCOMES if (n := sum(m["roundtrip"] == o for m in metas))},
        complete=all(p.key in done for p in read.prompts),
        seconds=time.perf_counter() - started,
    )
    runs[-1].update(generated=report.generated_now, torn_lines_dropped=report.torn_lines_dropped, seconds=round(report.seconds, 3))
    sidecar.update(status="complete" if report.complete else "partial", counts=report.to_dict())
    write_json(meta_path, sidecar)
    return report


def _data_section(read: Prompts, limit: int | None) -> dict[str, Any]:
    return {
        "files": read.files,
        "conversations_read": read.conversations_read,
        "excluded": read.excluded,
        "excluded_examples": read.excluded_examples,
        "prompts": len(read.prompts),
        "limit": limit,
    }
