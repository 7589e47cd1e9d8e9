"""accelerate launch train.py --config configs/512step.yaml [section.key=value ...]

Train the MTP head (`occamy_mtp.train.loop.train`); `python -m occamy_mtp train` is the same command.
"""

from __future__ import annotations

from occamy_mtp.cli import command, parse, parser as command_line
from occamy_mtp.settings import plan_of
from occamy_mtp.train.loop import train


@command
def main(argv: list[str] | None = None, prog: str = "python -m occamy_mtp train") -> int:
    cli = command_line(prog, "Train the MTP head's fc and pre-fc norms against the frozen base (run with accelerate launch).")
    cli.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output.dir")
    args, config = parse(cli, argv)
    train(plan_of(config), resume=args.resume)
    return 0
