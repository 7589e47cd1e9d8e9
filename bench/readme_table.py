"""The README's results table from a run's metrics.json, with another run's accept length beside it.

    python bench/readme_table.py runs/demo/metrics.json --beside runs/demo-greedy/metrics.json

Per serving configuration and served step count: step-1 acceptance of the donor, the trained head and the
ceiling, then their accept lengths (one standard error over prompts), then the accept length of the head
of `--beside` (the greedy-text recipe, `configs/demo-greedy.yaml`) on the same texts. The selected
configuration's largest step count is marked as the card's default. Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _percent(value: float) -> str:
    return "100%" if value == 1.0 else f"{value:.2%}"


def rows(metrics: dict, beside: dict | None) -> list[str]:
    steps = [str(k) for k in metrics["served_steps"]]
    lines = ["| heldout, drafts | step-1 acceptance: donor | trained | ceiling | accept length: donor | trained | ceiling "
             "| greedy-text recipe |", "|---|---|---|---|---|---|---|---|"]
    for serving in metrics["serving"]:
        label = serving["label"]
        for k in steps:
            donor, trained = (metrics["heldout"][name]["serving"][label]["served"][k] for name in ("donor", "trained"))
            ceiling = metrics["ceiling"][label][k]
            default = label == metrics["selected_serving"] and k == steps[-1]
            name = f"**{label}, {k}-step** (the card's default)" if default else f"{label}, {k}-step"
            other = beside["heldout"]["trained"]["serving"][label]["served"][k]["mean_accept_length"] if beside else None
            lines.append(
                f"| {name} | {_percent(donor['acceptance'][0])} | {_percent(trained['acceptance'][0])} | "
                f"{_percent(ceiling['acceptance'][0])} | {donor['mean_accept_length']:.3f} ± {donor['mean_accept_length_se']:.3f} | "
                f"**{trained['mean_accept_length']:.3f}** ± {trained['mean_accept_length_se']:.3f} | "
                f"{ceiling['mean_accept_length']:.3f} | {'-' if other is None else format(other, '.3f')} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", type=Path, help="the run's metrics.json")
    parser.add_argument("--beside", type=Path, help="another run's metrics.json on the same texts")
    args = parser.parse_args(argv)
    metrics = json.loads(args.metrics.read_text())
    beside = json.loads(args.beside.read_text()) if args.beside else None
    print("\n".join(rows(metrics, beside)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
