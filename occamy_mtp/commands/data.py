"""python -m occamy_mtp data --config RUN.yaml [section.key=value ...]

Chat data as training would see it, before a long run: conversations read, kept and excluded per
reason, windows, the split (`occamy_mtp.data.prepare`).
"""

from __future__ import annotations

import json
from typing import Any

from occamy_mtp.cli import command, parse, parser as command_line
from occamy_mtp.config import ConfigError, window_settings
from occamy_mtp.data.prepare import prepare_windows
from occamy_mtp.data.reader import DataError, DEFAULT_EXCLUSIONS, EMPTY_ANSWER, missing_sources, NON_TEXT_CONTENT
from occamy_mtp.data.split import HELDOUT, TRAIN, VALIDATION
from occamy_mtp.data.windows import load_tokenizer


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
    thinking = summary["thinking_windows"]
    lines.append("thinking mode (data.thinking " + summary["settings_thinking"] + "): " + " / ".join(
        f"{thinking[side]['thinking']} of {thinking[side]['thinking'] + thinking[side]['non_thinking']}"
        for side in (TRAIN, VALIDATION, HELDOUT)) + " train / validation / heldout windows rendered with thinking on")
    if summary["reasoning_left_out"]:
        lines.append(f"reasoning left out: {summary['reasoning_left_out']} windows' turns record reasoning that "
                     "data.thinking off leaves out of them")
    dropped = {side.removesuffix("_windows_dropped"): n for side, n in summary["kept_apart"].items() if n}
    if dropped:
        lines.append("kept apart: " + ", ".join(f"{n} {side}" for side, n in dropped.items()) + " windows dropped, sharing "
                     "a context or an answer with a heldout (or validation) window")
    return "\n".join(lines)


@command
def main(argv: list[str] | None = None) -> int:
    cli = command_line("python -m occamy_mtp data",
                       "Check chat data as training would see it: conversations read, kept, excluded per reason, windows, split.",
                       config_required=False)
    cli.add_argument("--keep-non-text", action="store_true", help="drop image/audio parts and keep the text instead of excluding")
    cli.add_argument("--keep-empty-answers", action="store_true", help="keep empty answers (a one-token window)")
    cli.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    args, config = parse(cli, argv)
    if not config.data.files:
        raise ConfigError("data.files: no chat data files given (data.files=[a.jsonl,b.jsonl], or --config RUN.yaml)")
    missing = missing_sources(config.data.files)
    if missing:  # before the slow transformers import: a typo should fail at once
        raise ConfigError(f"data.files: {missing[0]}: no such file")
    tokenizer = load_tokenizer(config.model)
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
