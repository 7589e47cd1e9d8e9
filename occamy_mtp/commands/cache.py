"""python -m occamy_mtp cache --config RUN.yaml [--dir DIR] [section.key=value ...]
(or, the base in host memory: accelerate launch --config_file configs/accelerate/fsdp2-offload.yaml -m occamy_mtp cache ...)

The offline target cache, built ahead of training (`occamy_mtp.cache`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from occamy_mtp.cache import build_for_run, DEFAULT_FASTBASE_TOKENS
from occamy_mtp.cli import command, parse, parser as command_line
from occamy_mtp.config import ConfigError
from occamy_mtp.model.sharding import from_launch
from occamy_mtp.run import log_stderr
from occamy_mtp.settings import plan_of
from occamy_mtp.targets.cache import DEFAULT_MAX_SHARD_BYTES


def tokens_or_auto(text: str) -> int | None:
    """--fastbase-tokens: a number of tokens (0 or more), or auto (None: sized to the GPU)."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'auto', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more tokens, got {value}")
    return value


@command
def main(argv: list[str] | None = None) -> int:
    cli = command_line("python -m occamy_mtp cache",
                       "Run the frozen base once over a run's windows (train and heldout) and store its targets.")
    cli.add_argument("--dir", default="", help="cache directory (default: the config's data.target_cache)")
    cli.add_argument("--windows-per-batch", type=int, default=1, help="windows per plain base forward (1: the canonical per-window targets)")
    cli.add_argument(
        "--fastbase-tokens", type=tokens_or_auto, default=None, metavar="N|auto",
        help="tokens per forward of the packed fast pass (occamy_mtp.base.fastbase); 0: the plain pass, one window a forward "
        f"(the canonical targets); auto (default): as many as fit on the GPU, at most {DEFAULT_FASTBASE_TOKENS}, for a "
        "Qwen3.5-MoE base on CUDA with fla, else 0",
    )
    cli.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES, help="upper bound of one shard file")
    args, config = parse(cli, argv)
    sharding = from_launch(os.environ, command="cache")  # accelerate launch --config_file configs/accelerate/fsdp2-offload.yaml
    if args.max_shard_bytes < 1:
        raise ConfigError(f"--max-shard-bytes: expected a size of 1 byte or more, got {args.max_shard_bytes}")
    plan = plan_of(config)
    directory = args.dir or plan.cache.directory
    if not directory:
        raise ConfigError("data.target_cache: no cache directory configured; set it or pass --dir")
    cache = dataclasses.replace(plan.cache, directory=directory, windows_per_batch=args.windows_per_batch,
                                fastbase_tokens=args.fastbase_tokens, max_shard_bytes=args.max_shard_bytes)
    build_for_run(plan.setup, cache, log=log_stderr, sharding=sharding)
    return 0
