"""python -m occamy_mtp inspect PATH

What a checkpoint, a head file or a config holds of the MTP head, and what serving will load
(`occamy_mtp.export.checkpoint_report`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from occamy_mtp.cli import command
from occamy_mtp.export.checkpoint_report import format_report, inspect_path


@command
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m occamy_mtp inspect",
        description="Report what a Qwen3.5-MoE / Qwen3-Next checkpoint (or config.json) holds, before a long run.",
    )
    parser.add_argument("path", type=Path, help="checkpoint directory or config.json")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = parser.parse_args(argv)
    report = inspect_path(args.path)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if report["problems"] else 0
