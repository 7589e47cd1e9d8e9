"""python -m occamy_mtp demo-models [--build]

The demo's base and donor: copied from data/demo-models, or built from the sample chats
(`occamy_mtp.testing.demo_models`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from occamy_mtp.cli import command
from occamy_mtp.testing.demo_models import build_demo_models, DemoSettings, SHIPPED_DIR
from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH


@command
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occamy_mtp demo-models", description="Build the demo's donor and fine-tuned base from the sample chats.")
    parser.add_argument("--out", default="runs/demo/models", help="output directory (tokenizer/, donor/, base/)")
    parser.add_argument("--data", default=str(SAMPLE_DATA_PATH), help="chat JSONL to train on")
    parser.add_argument("--linear-head-dim", type=int, default=DemoSettings.linear_head_dim,
                        help="Gated DeltaNet key/value head dim (64 or 128 can be served by vLLM's CPU build)")
    parser.add_argument("--build", action="store_true", help=f"build here even when the shipped build ({SHIPPED_DIR}) fits")
    args = parser.parse_args(argv)
    build_demo_models(Path(args.out), DemoSettings(linear_head_dim=args.linear_head_dim), data_path=Path(args.data),
                      use_shipped=not args.build)
    return 0
