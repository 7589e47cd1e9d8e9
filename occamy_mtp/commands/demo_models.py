"""python -m occamy_mtp demo-models [--build] [--seed N] [--quantized fp8|nvfp4]

The demo's base and donor: copied from data/demo-models, or built from the sample chats
(`occamy_mtp.testing.demo_models`); with --quantized, also a copy of the base in the family's
block-wise FP8 or ModelOpt's NVFP4 layout, `base-fp8/` or `base-nvfp4/` beside it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from occamy_mtp.cli import command
from occamy_mtp.testing.demo_models import build_demo_models, build_quantized_demo_base, DemoSettings, SHIPPED_DIR
from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH


@command
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occamy_mtp demo-models", description="Build the demo's donor and fine-tuned base from the sample chats.")
    parser.add_argument("--out", default="runs/demo/models", help="output directory (tokenizer/, donor/, base/)")
    parser.add_argument("--data", default=str(SAMPLE_DATA_PATH), help="chat JSONL to train on")
    parser.add_argument("--linear-head-dim", type=int, default=DemoSettings.linear_head_dim,
                        help="Gated DeltaNet key/value head dim (64 or 128 can be served by vLLM's CPU build)")
    parser.add_argument("--seed", type=int, default=DemoSettings.seed,
                        help="seed of the build (another seed: a second build of the same recipe, to check a result on; "
                             "only the default seed's build is shipped)")
    parser.add_argument("--build", action="store_true", help=f"build here even when the shipped build ({SHIPPED_DIR}) fits")
    parser.add_argument("--quantized", choices=("fp8", "nvfp4"), action="append", default=[],
                        help="also write the base quantized, into OUT/base-fp8 or OUT/base-nvfp4 (repeatable)")
    args = parser.parse_args(argv)
    build_demo_models(Path(args.out), DemoSettings(seed=args.seed, linear_head_dim=args.linear_head_dim), data_path=Path(args.data),
                      use_shipped=not args.build)
    for scheme in args.quantized:
        build_quantized_demo_base(Path(args.out), scheme, data_path=Path(args.data))
    return 0
