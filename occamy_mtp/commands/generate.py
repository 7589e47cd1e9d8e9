"""python -m occamy_mtp generate --config RUN.yaml --out FILE.jsonl [section.key=value ...]

A chat file's answers rewritten by the base, resumable (`occamy_mtp.selfgen.regenerate`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from occamy_mtp.cli import command, parse, parser as command_line
from occamy_mtp.config import ConfigError
from occamy_mtp.data import reader, windows
from occamy_mtp.files import inside_any
from occamy_mtp.base.frozen import FrozenBase
from occamy_mtp.selfgen.regenerate import base_record, GenerateReport, regenerate_answers, sidecar_path


def _format_report(report: GenerateReport) -> str:
    excluded = ", ".join(f"{reason} {n}" for reason, n in report.excluded.items()) or "none"
    roundtrip = ", ".join(f"{outcome} {n}" for outcome, n in report.roundtrip.items()) or "none"
    return "\n".join(
        [
            f"conversations: {report.conversations_read} read; excluded: {excluded}",
            f"prompts: {report.prompts_total} in the data, {report.prompts_selected} selected, "
            f"{report.skipped_done} already done, {report.generated_now} generated now"
            + ("; dropped a torn last line left by an interrupted run" if report.torn_lines_dropped else ""),
            f"output: {report.out_path}: {report.records_in_file} records ({report.finished} finished, "
            f"{report.unfinished} cut at max-new-tokens), {report.generated_tokens} generated tokens"
            + ("" if report.complete else "; not complete (run again without --limit to continue)"),
            f"round trip through the template: {roundtrip}",
        ]
    )


@command
def main(argv: list[str] | None = None) -> int:
    cli = command_line(
        "python -m occamy_mtp generate",
        "Regenerate the answers of data.files with the frozen base model.base (greedy, resumable): "
        "data.thinking renders the prompts with thinking on or off, data.turns chooses the turns, data.answer_tokens bounds each answer, data.self_generate_batch_size the batch.",
        config_required=False)
    cli.add_argument("--out", required=True, type=Path, help="output JSONL (appended to and resumed when it exists)")
    cli.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda (default: cuda when present)")
    cli.add_argument("--limit", type=int, help="regenerate only the first N prompts (a later run continues)")
    cli.add_argument("--no-resume", action="store_true", help="refuse an existing output instead of continuing it")
    cli.add_argument("--no-progress", action="store_true", help="no progress bar")
    args, config = parse(cli, argv)
    data = config.data
    if not data.files:
        raise ConfigError("data.files: no chat data files given (data.files=[a.jsonl,b.jsonl], or --config RUN.yaml)")
    missing = reader.missing_sources(data.files)
    if missing:  # before the slow imports and the model load: a typo fails at once
        raise ConfigError(f"data.files: {missing[0]}: no such file")
    if not (Path(config.model.base) / "config.json").is_file():
        raise ConfigError(f"model.base: {config.model.base}: no config.json (not a checkpoint directory)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: CUDA is not available on this machine")
    if args.limit is not None and args.limit < 0:
        raise ConfigError(f"--limit must be >= 0, got {args.limit}")
    refusal = inside_any([("--out", args.out), ("--out", sidecar_path(args.out))], [("model.base", Path(config.model.base))])
    if refusal:  # an output never lands in the base (an atomic rename could replace one of its files)
        raise ConfigError(refusal)
    tokenizer = windows.load_tokenizer(config.model)
    base = FrozenBase.open(config.model, args.device)  # every model.* setting, as train, export and the cache read it
    report = regenerate_answers(
        data.files,
        tokenizer,
        base,
        args.out,
        base_identity=base_record(base.identity, config.model.base),
        turns=data.turns,
        max_new_tokens=data.answer_tokens,
        batch_size=data.self_generate_batch_size,
        resume=not args.no_resume,
        eos_token_ids=windows.stop_token_ids(tokenizer, config.model.base),
        limit=args.limit,
        skip_bad_records=data.skip_bad_records,
        progress=not args.no_progress,
        max_record_bytes=data.max_record_bytes,
        thinking=data.thinking,
        log=lambda line: print(line, file=sys.stderr, flush=True),  # the batch chosen, and why
    )
    print(_format_report(report))
    return 0
