"""Chat data -> the run's windows, split, with every exclusion counted: `prepare_windows` reads
the sources (`data.reader.ChatReader`), builds each conversation's windows (`data.windows`)
and splits them (`data.split`); `PreparedData` holds the result and its provenance.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from occamy_mtp.config import TURN_CHOICES, DataSettings
from occamy_mtp.data.reader import (BEYOND_SPLIT_SIZE, DEFAULT_EXCLUSIONS, DEFAULT_MAX_RECORD_BYTES, OPTIONAL_EXCLUSIONS,
                                    ChatReader, Excluded)
from occamy_mtp.data.split import HELDOUT, TRAIN, VALIDATION, assign_split, default_fractions, keep_apart, split_key
from occamy_mtp.data.windows import (Window, conversation_windows, prompt_window, reasoning_left_out, require_chat_template,
                                     require_thinking_switch, tokenizer_identity)

# The defaults of the window settings are a run's (`config.DataSettings`, where defaults
# live), but for the validation side: the function splits two ways unless asked; runs and
# commands ask.
_DEFAULTS = DataSettings()
NO_VALIDATION = 0


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
    served: dict[bool, dict[str, list[Window]]] = field(default_factory=dict)
    """The validation and heldout windows' prompts rendered in each thinking mode asked for
    (`served_windows`): what the base continues under a serving configuration."""
    reasoning_left_out: int = 0
    """Windows of turns whose recorded reasoning was left out (`data.thinking: off`)."""
    domains: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per heldout conversation (content hash): the file it was read from and its record's category
    ("" for none): what the served figures are broken down by."""

    def served_windows(self, side: str, thinking: bool) -> list[Window]:
        """The prompts of `side`'s windows (validation or heldout), rendered with thinking on or off."""
        if thinking not in self.served:
            raise ValueError(f"the {side} prompts were not rendered with thinking {'on' if thinking else 'off'} "
                             "(prepare_windows's served_thinking)")
        return self.served[thinking][side]

    def thinking_windows(self) -> dict[str, dict[str, int]]:
        """Windows rendered with thinking on and off, on each side."""
        return {side: {"thinking": sum(w.thinking for w in windows), "non_thinking": sum(not w.thinking for w in windows)}
                for side, windows in ((TRAIN, self.train), (VALIDATION, self.validation), (HELDOUT, self.heldout))}

    @property
    def conversations_kept(self) -> int:
        return len(self.train_hashes) + len(self.validation_hashes) + len(self.heldout_hashes)

    def summary(self) -> dict[str, Any]:
        """The counts a user checks before training (what the `data` command prints): the record's
        (`provenance`), flat."""
        record = self.provenance()
        windows = record["windows"]
        return {
            "files": [f["path"] for f in record["files"]],
            **{key: record[key] for key in ("conversations_read", "conversations_kept", "excluded")},
            "windows_built": windows["built"],
            "assistant_tokens_scored": windows["assistant_tokens_scored"],
            **{f"{side}_conversations": record["split"][f"{side}_conversations"] for side in (TRAIN, VALIDATION, HELDOUT)},
            **{f"{side}_windows": windows[side] for side in (TRAIN, VALIDATION, HELDOUT)},
            "prompt_windows": windows["prompts"],
            "settings_thinking": record["settings"]["thinking"],
            "thinking_windows": windows["thinking"],
            "reasoning_left_out": windows["reasoning_left_out"],
            "kept_apart": windows["kept_apart"],
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
                "thinking": self.thinking_windows(),
                "reasoning_left_out": self.reasoning_left_out,
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
    thinking: str = _DEFAULTS.thinking,
    served_thinking: Collection[bool] = (),
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
    `thinking` (`data.thinking`) chooses how each turn renders (`windows.turn_thinking`);
    `served_thinking` lists the thinking modes whose validation and heldout prompts are wanted
    (`PreparedData.served_windows`). Thinking asked of a template without the switch is a
    ConfigError naming it.
    """
    _check_settings(context_tokens, answer_tokens, turns, train_conversations, heldout_conversations, validation_conversations, exclude)
    require_chat_template(tokenizer)
    if thinking == "on":
        require_thinking_switch(tokenizer, "data.thinking")
    if True in served_thinking:
        require_thinking_switch(tokenizer, "eval.serving (a configuration with thinking: true)",
                                "; serve configurations without thinking, e.g. eval.serving=[{temperature: 0}, "
                                "instruct-general, instruct-reasoning]")
    default_heldout, validation_fraction = default_fractions(train_conversations, heldout_conversations, validation_conversations)
    fraction = default_heldout if heldout_fraction is None else heldout_fraction
    reader = ChatReader(paths, exclude=exclude, skip_bad_records=skip_bad_records, max_record_bytes=max_record_bytes)
    windows_by_hash: dict[str, list[Window]] = {}  # the conversations that produced windows
    served_by_hash: dict[bool, dict[str, list[Window]]] = {mode: {} for mode in sorted(set(served_thinking))}
    first_location: dict[str, str] = {}  # content hash -> where it was read
    boundary_retokenized = 0
    left_out: dict[str, int] = {}  # content hash -> its windows' turns whose reasoning is left out
    domains: dict[str, dict[str, str]] = {}
    for conversation in reader:
        built = conversation_windows(
            tokenizer, conversation, context_tokens=context_tokens, answer_tokens=answer_tokens, turns=turns, exclude=exclude,
            prompts=prompts, thinking=thinking,
        )
        if isinstance(built, Excluded):
            reader.exclude(built.reason, conversation.location, built.detail)
            continue
        windows, retokenized = built
        content_hash = conversation.content_hash
        windows_by_hash[content_hash] = windows
        first_location[content_hash] = conversation.location
        boundary_retokenized += retokenized
        left_out[content_hash] = reasoning_left_out(conversation, [w.turn_index for w in windows], thinking)
        key = split_key(content_hash, split_seed)
        if key < fraction:  # may land on the heldout side
            domains[content_hash] = {"file": conversation.source, "category": conversation.category}
        if key < fraction + validation_fraction:  # may land on a measured side
            for mode, built_served in served_by_hash.items():
                built_served[content_hash] = [prompt_window(tokenizer, conversation, w.turn_index, context_tokens, mode)
                                              for w in windows]

    assignment = assign_split(
        windows_by_hash, train_conversations=train_conversations, heldout_conversations=heldout_conversations, seed=split_seed,
        heldout_fraction=fraction, validation_conversations=validation_conversations, validation_fraction=validation_fraction,
    )
    members: dict[str, list[str]] = {TRAIN: [], VALIDATION: [], HELDOUT: []}
    for content_hash in sorted(windows_by_hash, key=lambda h: split_key(h, split_seed)):
        side = assignment[content_hash]
        if side == BEYOND_SPLIT_SIZE:
            reader.exclude(BEYOND_SPLIT_SIZE, first_location[content_hash])
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
        "thinking": thinking,
        "kept_apart_by": "context and answer",
        "prompts": prompts,
    }
    sides = {side: [w for h in members[side] for w in windows_by_hash[h]] for side in members}
    kept_apart = keep_apart(sides)
    served = {}
    for mode, built_served in served_by_hash.items():
        served[mode] = {}
        for side in (VALIDATION, HELDOUT):
            kept = {(w.conversation_hash, w.turn_index) for w in sides[side]}
            served[mode][side] = [w for h in members[side] for w in built_served[h] if (h, w.turn_index) in kept]
    return PreparedData(
        train=sides[TRAIN],
        heldout=sides[HELDOUT],
        files=reader.files,
        conversations_read=reader.conversations_read,
        excluded=reader.excluded(),
        excluded_examples=reader.excluded_examples(),
        train_hashes=members[TRAIN],
        heldout_hashes=members[HELDOUT],
        validation=sides[VALIDATION],
        validation_hashes=members[VALIDATION],
        boundary_retokenized=boundary_retokenized,
        settings=settings,
        tokenizer_identity=tokenizer_identity(tokenizer),
        max_record_bytes=max_record_bytes,
        kept_apart=kept_apart,
        served=served,
        reasoning_left_out=sum(left_out[h] for side in members.values() for h in side),
        domains={h: domains[h] for h in members[HELDOUT]},
    )


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
