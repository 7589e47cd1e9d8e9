"""The benches' one ending: the result as JSON on the console, and in `--out` when given.

    from report import write_report   # the bench's own directory is first on sys.path
"""

from __future__ import annotations

import json


def write_report(result: dict, out, indent: int = 2, printed: bool = True) -> None:
    """Print `result` as JSON (unless `printed` is False: the bench printed its parts as it went) and
    write it to `out` (a path) when one is given."""
    text = json.dumps(result, indent=indent)
    if printed:
        print(text)
    if out:
        with open(out, "w") as handle:
            handle.write(text)
