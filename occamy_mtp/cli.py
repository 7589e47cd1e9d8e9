"""The one command-line convention: `--config RUN.yaml` plus `section.key=value` overrides.

Every command that works on a run takes the run's config and overrides (which go through
the config loader, so an unknown key fails with its dotted path), and only the few flags
that are truly its own. `@command` turns the library's errors into one `error:` line on
stderr and exit status 2, and keeps transformers' kernel fallback warnings to one note
(`console.quiet_kernel_fallbacks`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

from occamy_mtp.config import OneProcessOnly, RunConfig, load_config
from occamy_mtp.console import quiet_kernel_fallbacks
from occamy_mtp.errors import OccamyError
from occamy_mtp.hub import resolve


def parser(prog: str, description: str, *, config_required: bool = True) -> argparse.ArgumentParser:
    """An argument parser with `--config` and the overrides; the command adds its own flags."""
    out = argparse.ArgumentParser(prog=prog, description=description)
    out.add_argument("--config", type=Path, required=config_required,
                     help="the run's YAML config (e.g. configs/512step.yaml, or a run's config.resolved.yaml)"
                          + ("" if config_required else "; without it, the defaults"))
    out.add_argument("overrides", nargs="*", metavar="section.key=value", help="settings over the config's, e.g. train.lr=3e-4")
    return out


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, RunConfig]:
    """The parsed flags and the run config they name (flags and overrides in any order), its
    models named by Hub id resolved to their local snapshots (`hub.resolve`)."""
    args = parser.parse_intermixed_args(argv)
    config = load_config(args.config, args.overrides)
    return args, dataclasses.replace(config, model=resolve(config.model))


def command(main: Callable[..., int]) -> Callable[..., int]:
    """A command's `main(argv, **options)`: a library error becomes `error: ...` on stderr and exit
    status 2. `options` pass through (`prog`: the name a top-level script runs it under)."""

    @functools.wraps(main)
    def wrapped(argv: list[str] | None = None, **options) -> int:
        quiet_kernel_fallbacks()
        try:
            return main(argv, **options)
        except OccamyError as err:
            if not isinstance(err, OneProcessOnly) or os.environ.get("RANK", "0") == "0":  # said once, not once a process
                print(f"error: {err}", file=sys.stderr, flush=True)
            return 2

    return wrapped
