"""accelerate launch train.py --config configs/512step.yaml [section.key=value ...]
(the base sharded over the processes: accelerate launch --config_file configs/accelerate/fsdp2.yaml train.py ...)

Train the MTP head (`occamy_mtp.train.loop.train`); `python -m occamy_mtp train` is the same command.
"""

from __future__ import annotations

import os

from occamy_mtp.cli import command, parse, parser as command_line
from occamy_mtp.model.sharding import from_launch
from occamy_mtp.settings import plan_of
from occamy_mtp.train.loop import train


@command
def main(argv: list[str] | None = None, prog: str = "python -m occamy_mtp train") -> int:
    cli = command_line(prog, "Train the MTP head's fc and pre-fc norms against the frozen base (run with accelerate launch).")
    cli.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output.dir")
    args, config = parse(cli, argv)
    # The base's placement is the launch's (accelerate launch --config_file configs/accelerate/...).
    train(plan_of(config), resume=args.resume, sharding=from_launch(os.environ))
    return 0
