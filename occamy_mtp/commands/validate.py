"""python -m occamy_mtp validate --reference URL --candidate URL --config RUN.yaml --out DIR [--serving PRESET]

MTP off against on at two endpoints, token for token, or under a sampled preset by distribution and
acceptance (`occamy_mtp.serve.validate`, `occamy_mtp.serve.sampled`, docs/guide/VALIDATE.md).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from occamy_mtp import files
from occamy_mtp.cli import command, parse, parser as command_line
from occamy_mtp.config import window_settings
from occamy_mtp.console import plural
from occamy_mtp.errors import OccamyError
from occamy_mtp.engines.openai import (
    CHAT, COMPLETIONS, DEFAULT_MAX_TOKENS, DEFAULT_TIMEOUT_SECONDS, DEFAULT_TOP_LOGPROBS, RequestSettings,
)
from occamy_mtp.serve.validate import (
    is_url, ACCEPTANCE_PASS_MODES, DEFAULT_COLD_WARM, DEFAULT_LOGPROB_TOLERANCE, DEFAULT_MAX_CONSECUTIVE_ERRORS, DEFAULT_PROMPTS,
    DEFAULT_SAMPLES, format_summary, heldout_prefixes, heldout_window_contexts, prompt_set, rendered_prompts,
    RESPONSES_FILE, validate, validate_sampled, ValidationError,
)


@command
def main(argv: list[str] | None = None) -> int:
    cli = command_line("python -m occamy_mtp validate",
                       "Compare two OpenAI-compatible servers (MTP off vs on) token for token, and read the MTP-on server's acceptance. "
                       "--config (the run's) gives data.files, whose heldout prefixes join the authored prompts, the tokenizer "
                       "and the split.", config_required=False)
    cli.add_argument("--reference", required=True, help="URL of the MTP-off server, or a responses-reference.json recorded earlier")
    cli.add_argument("--candidate", help="URL of the MTP-on server (or a recorded responses file); omit to record the reference only")
    cli.add_argument("--prompt-source", choices=("mixed", "windows"), default="mixed",
                     help="mixed: authored prompts + heldout prefixes (chat); windows: the heldout windows' contexts as "
                          "token ids, the prompts of `occamy_mtp.evaluation.evaluate --reference-decoder` (needs data.files, --endpoint completions)")
    cli.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help="size of the fixed prompt set")
    cli.add_argument("--cold-warm", type=int, default=DEFAULT_COLD_WARM, help="prompts sent twice (cold, then warm)")
    cli.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    cli.add_argument("--endpoint", choices=(CHAT, COMPLETIONS), default=None,
                     help=f"default {CHAT}; a sampled --serving asks {COMPLETIONS} with token ids")
    cli.add_argument("--model", help="the request's model field (default: the server's first /v1/models id)")
    cli.add_argument("--no-token-ids", action="store_true", help="do not ask for token ids (compare token strings)")
    cli.add_argument("--top-logprobs", type=int, default=DEFAULT_TOP_LOGPROBS, help="alternatives per token, to diagnose a divergence")
    cli.add_argument("--no-engine-fields", action="store_true", help="do not ask for SGLang's per-request speculative counts")
    cli.add_argument("--extra-body", default="{}", help="JSON object merged into every request body")
    cli.add_argument("--logprob-tolerance", type=float, default=DEFAULT_LOGPROB_TOLERANCE,
                     help="largest |logprob difference| still counted as exact (default: tokens decide, and the largest "
                          "difference is reported: a verify pass over 1 + K positions rounds otherwise than a one-token "
                          "step, so logprobs differ in their last bits even where every token is the same; 0: bit-equal)")
    cli.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS, help="wall-clock seconds for each whole request")
    cli.add_argument("--max-consecutive-errors", type=int, default=DEFAULT_MAX_CONSECUTIVE_ERRORS)
    cli.add_argument("--allow-no-drafts", action="store_true", help="the candidate need not speculate (two servers without MTP)")
    cli.add_argument("--acceptance-pass", choices=ACCEPTANCE_PASS_MODES, default="auto",
                     help="send the prompts once more without logprobs: auto (when the logprob run drafted nothing), always, never")
    cli.add_argument("--thinking", action="store_true",
                     help="render the prompts with thinking on (the card's thinking presets; chat: chat_template_kwargs)")
    cli.add_argument("--serving", help="a serving preset by name (thinking-general, thinking-coding, instruct-general, "
                     "instruct-reasoning): sample as it does, with its penalties and thinking mode, and validate the "
                     "distributions and the acceptance in place of token identity (docs/guide/VALIDATE.md, 'Sampled serving')")
    cli.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="sampled: draws a prompt")
    cli.add_argument("--seed", type=int, default=0, help="sampled: the requests' seeds derive from it, each prompt and draw")
    cli.add_argument("--head", help="sampled: the candidate's head (a file, or 'donor' for model.donor_head): its acceptance "
                                    "is checked against the library's expectation on the candidate's own text")
    cli.add_argument("--draft-steps", type=int, default=0, help="sampled: the candidate server's K (with --head)")
    cli.add_argument("--draft", choices=("greedy", "sampled"), default="greedy",
                     help="sampled: how the candidate drafts (vLLM's draft_sample_method; SGLang drafts greedy)")
    cli.add_argument("--out", required=True, type=Path, help="directory for validation.json and the responses files")
    cli.add_argument("--quiet", action="store_true")
    args, config = parse(cli, argv)
    try:
        extra = json.loads(args.extra_body)
        if not isinstance(extra, dict):
            raise ValueError
    except (ValueError, RecursionError):
        raise ValidationError(f"--extra-body must be a JSON object, got {args.extra_body!r}") from None
    if min(args.prompts, args.max_tokens, args.max_consecutive_errors) < 1 or min(args.cold_warm, args.top_logprobs) < 0 \
            or not args.timeout > 0 or not math.isfinite(args.timeout) or not args.logprob_tolerance >= 0:
        raise ValidationError("--prompts, --max-tokens, --max-consecutive-errors must be >= 1, --cold-warm and --top-logprobs >= 0, "
                              "--timeout a finite number > 0, --logprob-tolerance >= 0")
    for flag, value in (("--reference", args.reference), ("--candidate", args.candidate)):
        if value is not None and not is_url(value) and not Path(value).is_file():
            raise ValidationError(f"{flag} {value}: neither an http(s) URL nor a responses file")
    if args.serving:
        return _main_sampled(args, config)
    if args.endpoint is None:
        args.endpoint = CHAT
    files = list(config.data.files)
    if args.prompt_source == "windows" and (not files or args.endpoint != COMPLETIONS):
        raise ValidationError("--prompt-source windows needs data.files (or --config) and --endpoint completions")
    from occamy_mtp.data.windows import load_tokenizer

    tokenizer = load_tokenizer(config.model) if files or args.endpoint == COMPLETIONS else None
    if args.thinking and tokenizer is not None:
        from occamy_mtp.data.windows import require_thinking_switch

        require_thinking_switch(tokenizer, "--thinking")
    prompts = _prompts(args, config, tokenizer, args.thinking)
    settings = RequestSettings(args.endpoint, args.max_tokens, args.timeout, args.model, not args.no_token_ids,
                               True, args.top_logprobs, not args.no_engine_fields, extra, args.thinking)
    log = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        report = validate(args.reference, args.candidate, prompts, args.out, settings, min(args.cold_warm, len(prompts)),
                          args.logprob_tolerance, tokenizer, args.max_consecutive_errors, log,
                          require_drafts=not args.allow_no_drafts, acceptance_pass=args.acceptance_pass)
    except ValueError as err:
        if isinstance(err, OccamyError):
            raise
        raise ValidationError(str(err)) from None
    return _finished(report, format_summary, args, f"{len(prompts)} {plural(len(prompts), 'prompt')}")


def _prompts(args, config, tokenizer, thinking: bool) -> list:
    """--prompts of --prompt-source, from the run's data: the heldout windows' contexts (token ids,
    rendered with `thinking`), or authored prompts and heldout prefixes (chat messages)."""
    files, split = list(config.data.files), window_settings(config.data)
    try:
        if args.prompt_source == "windows":
            return heldout_window_contexts(files, tokenizer, thinking, **split)[: args.prompts]
        return prompt_set(args.prompts, heldout_prefixes(files, tokenizer, **split) if files else [])
    except ValueError as err:
        if isinstance(err, OccamyError):
            raise
        raise ValidationError(str(err)) from None


def _finished(report: dict | None, summary, args, recorded: str) -> int:
    """The exit status, having printed the report (`summary` of it) or what was recorded."""
    if report is None:
        print(f"recorded {recorded} from {args.reference} into {args.out / RESPONSES_FILE.format(role='reference')}")
        return 0
    print(summary(report))
    if not report["passed"]:
        print(f"validation failed: {'; '.join(report['failures'])}", file=sys.stderr)
    return 0 if report["passed"] else 1


def _main_sampled(args, config) -> int:
    """`main` under a sampled --serving preset (`validate_sampled`)."""
    import dataclasses

    from occamy_mtp.config import ConfigError, serving_preset
    from occamy_mtp.data.windows import load_tokenizer, require_thinking_switch
    from occamy_mtp.serve.sampled import format_sampled_summary

    try:
        serving = dataclasses.replace(serving_preset(args.serving, "--serving"), draft=args.draft)
    except ConfigError as err:
        raise ValidationError(str(err)) from None
    if serving.greedy:
        raise ValidationError(f"--serving {args.serving} is greedy: validate it without --serving (token for token)")
    if args.endpoint == CHAT:
        raise ValidationError("--serving asks /v1/completions with token ids (the library's expectation needs the prompt's "
                              "tokens as the server saw them): drop --endpoint chat")
    if args.thinking and not serving.thinking:
        raise ValidationError(f"--thinking and --serving {args.serving}, whose thinking is off: the preset sets the mode")
    if args.candidate is not None and args.head is not None and args.draft_steps < 1:
        raise ValidationError("--head needs --draft-steps, the candidate server's K (1 or more)")
    if args.samples < 1:  # the flags both protocols share were checked by `main`
        raise ValidationError(f"--samples must be >= 1, got {args.samples}")
    if not config.model.base:
        raise ValidationError("--serving needs model.base (--config): the library's expectation is computed with the base")
    tokenizer = load_tokenizer(config.model)
    if serving.thinking:
        require_thinking_switch(tokenizer, f"--serving {args.serving}")
    if args.prompt_source == "windows" and not config.data.files:
        raise ValidationError("--prompt-source windows needs data.files (or --config)")
    prompts = rendered_prompts(_prompts(args, config, tokenizer, serving.thinking), tokenizer, serving.thinking)
    log = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    report = validate_sampled(args.reference, args.candidate, prompts, args.out, config.model, serving, args.samples,
                              args.max_tokens, args.timeout, args.seed, args.head, args.draft_steps, tokenizer, log,
                              require_drafts=not args.allow_no_drafts, windows_per_batch=config.eval.windows_per_batch)
    return _finished(report, format_sampled_summary, args, f"{len(prompts)} {plural(len(prompts), 'prompt')} x {args.samples}")
