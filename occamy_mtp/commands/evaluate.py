"""python -m occamy_mtp evaluate --config RUN.yaml [--head FILE] --out DIR [--served-base DIR ...] [section.key=value ...]

A head's served acceptance, agreement and NLL on the run's heldout windows (`occamy_mtp.evaluation.evaluate`);
with --served-base, the same on each base it is served on, beside the run's (`occamy_mtp.evaluation.served_base`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from occamy_mtp.cli import command, parse, parser as command_line
from occamy_mtp.config import ConfigError
from occamy_mtp.evaluation.evaluate import evaluate_run, EVALUATION_FILE, PLOT_FILE
from occamy_mtp.model.sharding import from_launch
from occamy_mtp.settings import plan_of


@command
def main(argv: list[str] | None = None) -> int:
    cli = command_line("python -m occamy_mtp evaluate",
                       "Served acceptance (exact, on the base's own text, per serving configuration), agreement and NLL of "
                       "MTP heads, side by side.",
                       config_required=False)
    cli.add_argument("--head", type=Path, help="trained head: safetensors file or checkpoint directory "
                                               "(default: the run's output.dir/mtp-trained.safetensors)")
    cli.add_argument("--out", required=True, type=Path, help="directory for evaluation.json and acceptance.png")
    cli.add_argument("--teacher-forced-only", action="store_true",
                     help="skip the base's own continuations: only the approximate figures on the recorded answers")
    cli.add_argument("--reference-decoder", action="store_true",
                     help="also decode every heldout prompt with the reference speculative decoder (batch 1, slow) at "
                          "each of eval.served_steps and check the served figures against it: equal counts under greedy "
                          "serving, a z-score of the counts against their expectation under sampled serving")
    cli.add_argument("--decoder-seeds", type=int, default=4,
                     help="sampled serving: decodes of each prompt by --reference-decoder (default 4), each from its own seeded stream: "
                          "no two prompts, heads or step counts share their draws")
    cli.add_argument("--max-windows", type=int,
                     help="evaluate the first N heldout windows only (default: all), in the split's order: the windows "
                          "`occamy_mtp.serve.validate --prompt-source windows --prompts N` sends to a server")
    cli.add_argument("--served-base", type=Path, action="append", default=[], metavar="DIR",
                     help="also score both heads on this base (e.g. the FP8 or NVFP4 copy the head is served on), "
                          "its own text written into --out; repeatable")
    cli.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args, config = parse(cli, argv)
    if args.max_windows is not None and args.max_windows < 1:
        raise ConfigError(f"--max-windows: expected 1 or more windows, got {args.max_windows}")
    if args.decoder_seeds < 2:
        raise ConfigError(f"--decoder-seeds: expected 2 or more (a z-score needs a spread), got {args.decoder_seeds}")
    plan = plan_of(config)
    head_path = args.head or plan.run_dir.head
    if not head_path.exists():
        raise ConfigError(f"--head {head_path}: no such file or directory (export the run first, or name a head)")
    for base in args.served_base:
        if not (base / "config.json").is_file():
            raise ConfigError(f"--served-base {base}: no config.json (a base checkpoint directory is expected)")
    options = dict(teacher_forced_only=args.teacher_forced_only, reference_decoder=args.reference_decoder,
                   max_windows=args.max_windows, decoder_seeds=args.decoder_seeds,
                   sharding=from_launch(os.environ, command="evaluate"))
    device = torch.device(args.device)
    if args.served_base:
        from occamy_mtp.evaluation.served_base import evaluate_on_bases

        report, printed = evaluate_on_bases(plan, head_path, args.out, device, args.served_base, **options)
    else:
        report, printed = evaluate_run(plan, head_path, args.out, device, **options)
    print(printed)
    print(f"wrote {args.out / EVALUATION_FILE} and {args.out / PLOT_FILE}")
    return 0
