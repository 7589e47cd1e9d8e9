"""python -m occamy_mtp compare RUN/TRAINING.json TRAINING.json

Is a run's head the reference run's, byte for byte, and if not, what explains it (`occamy_mtp.record`).
"""

from __future__ import annotations

from pathlib import Path

from occamy_mtp.cli import command
from occamy_mtp.record import compare_heads, read_record, UNEXPLAINED


@command
def main(argv: list[str] | None = None) -> int:
    """`python -m occamy_mtp compare RUN/TRAINING.json REFERENCE/TRAINING.json`: exit 0 when the heads
    are the same bytes or the difference is explained, 1 when nothing explains it."""
    import argparse

    cli = argparse.ArgumentParser(prog="python -m occamy_mtp compare",
                                  description="Is a run's head the reference's, byte for byte? If not, say why.")
    cli.add_argument("record", type=Path, help="the run's TRAINING.json")
    cli.add_argument("reference", type=Path, help="the reference's TRAINING.json (e.g. the repository's own)")
    args = cli.parse_args(argv)
    status, report = compare_heads(read_record(args.record), read_record(args.reference))
    print(report)
    return 1 if status == UNEXPLAINED else 0
