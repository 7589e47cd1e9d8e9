"""python export.py --config configs/512step.yaml [section.key=value ...]
(or, the base in host memory: accelerate launch --config_file configs/accelerate/fsdp2-offload.yaml export.py ...)

The exported head, its metrics and TRAINING.json (`occamy_mtp.export.exporter.export`); `python -m occamy_mtp
export` is the same command.
"""

from __future__ import annotations

import os
import sys

from occamy_mtp.cli import command, parse, parser as command_line
from occamy_mtp.export.exporter import export, format_metrics
from occamy_mtp.model.sharding import from_launch
from occamy_mtp.settings import plan_of


@command
def main(argv: list[str] | None = None, prog: str = "python -m occamy_mtp export") -> int:
    cli = command_line(prog, "Export the trained MTP head, its metrics and TRAINING.json.")
    cli.add_argument("--allow-worse", action="store_true",
                     help="write the head even when it is worse than the donor on the headline figures (recorded in TRAINING.json)")
    args, config = parse(cli, argv)
    sharding = from_launch(os.environ, command="export")  # accelerate launch --config_file configs/accelerate/fsdp2-offload.yaml
    plan = plan_of(config)
    record = export(plan, allow_worse=args.allow_worse, sharding=sharding)
    print(format_metrics(record["metrics"]))
    if not record["metrics"]["comparison"]["trained_not_worse"]:
        print("warning: the trained head is worse than the donor; written because --allow-worse was given", file=sys.stderr)
    print(f"wrote {plan.run_dir.head} and {plan.run_dir.record.name}")
    return 0
