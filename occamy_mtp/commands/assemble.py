"""python assemble_head.py --base DIR --head FILE --out DIR

A servable directory: the base's shards beside the trained head (`occamy_mtp.export.assemble`);
`python -m occamy_mtp assemble` is the same command.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from occamy_mtp.cli import command
from occamy_mtp.export.assemble import assemble, AssemblyError, AUTO, format_report, WEIGHT_MODES


@command
def main(argv: list[str] | None = None, prog: str = "python -m occamy_mtp assemble") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="A servable directory: the base's weight shards (cloned, or linked where nothing can write "
        "through the link, else copied), copies of its other files, the trained MTP head, a rewritten index and "
        "config. The base directory is never modified.",
    )
    parser.add_argument("--base", required=True, type=Path, help="the base checkpoint directory")
    parser.add_argument("--head", required=True, type=Path, help="the head file (mtp-trained.safetensors)")
    parser.add_argument("--out", required=True, type=Path, help="the directory to create (outside --base)")
    parser.add_argument("--force", action="store_true", help="replace --out if an earlier assembly wrote it (nothing else)")
    parser.add_argument(
        "--weights", choices=WEIGHT_MODES, default=AUTO,
        help="how the base's unchanged weight shards are placed: auto (default) clones where the filesystem can, "
        "symlinks into a read-only base, copies otherwise; symlink links even into a writable base",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        report = assemble(args.base, args.head, args.out, force=args.force, weights=args.weights)
    except OSError as err:
        raise AssemblyError(str(err)) from None
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0
