"""`python -m occamy_mtp <command> ...`: every command of the library, one convention.

A command that works on a run takes `--config RUN.yaml` and `section.key=value` overrides
(the config's own keys: `occamy_mtp.cli`), plus the few flags that are truly its own;
`python -m occamy_mtp <command> --help` lists them. `train.py`, `export.py` and
`assemble_head.py` at the top of the repository are the same commands (`accelerate launch
train.py` starts one process per GPU).
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def _train(argv: list[str]) -> int:
    from occamy_mtp.train.loop import main
    return main(argv)


def _export(argv: list[str]) -> int:
    from occamy_mtp.export.exporter import main
    return main(argv)


def _assemble(argv: list[str]) -> int:
    from occamy_mtp.export.assemble import main
    return main(argv)


def _cache(argv: list[str]) -> int:
    from occamy_mtp.cache import main
    return main(argv)


def _evaluate(argv: list[str]) -> int:
    from occamy_mtp.evaluation.evaluate import main
    return main(argv)


def _data(argv: list[str]) -> int:
    from occamy_mtp.data.report import main
    return main(argv)


def _generate(argv: list[str]) -> int:
    from occamy_mtp.selfgen.regenerate import main
    return main(argv)


def _inspect(argv: list[str]) -> int:
    from occamy_mtp.export.checkpoint_report import main
    return main(argv)


def _validate(argv: list[str]) -> int:
    from occamy_mtp.serve.validate import main
    return main(argv)


def _serve_reference(argv: list[str]) -> int:
    from occamy_mtp.serve.reference_server import main
    return main(argv)


def _compare(argv: list[str]) -> int:
    from occamy_mtp.record import main
    return main(argv)


def _demo_models(argv: list[str]) -> int:
    from occamy_mtp.testing.demo_models import main
    return main(argv)


# name -> (what runs it, what it does), in the order of a run's life
COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "data": (_data, "chat data as training would see it: read, kept, excluded, windows, split"),
    "inspect": (_inspect, "a checkpoint's or config's MTP head: layout, tensors, what serving will load"),
    "generate": (_generate, "a chat file's answers rewritten by the base (resumable JSONL)"),
    "cache": (_cache, "the offline target cache: the base's hidden states and greedy targets, once"),
    "train": (_train, "train the head (accelerate launch for several GPUs; same as train.py)"),
    "export": (_export, "the trained head, its metrics and TRAINING.json (same as export.py)"),
    "evaluate": (_evaluate, "served acceptance of a head on a run's heldout windows"),
    "assemble": (_assemble, "a servable directory: the base with the trained head (same as assemble_head.py)"),
    "serve-reference": (_serve_reference, "the library's own OpenAI-style server: plain or speculative decoding"),
    "validate": (_validate, "compare an engine serving the head with a reference engine"),
    "compare": (_compare, "is a run's head the reference's, byte for byte; if not, what explains it"),
    "demo-models": (_demo_models, "build the embedded default: the demo's base and donor from the sample chats"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m occamy_mtp <command> [--config RUN.yaml] [section.key=value ...] [flags]", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; expected one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    run, _ = COMMANDS[name]
    return run(rest)


if __name__ == "__main__":
    raise SystemExit(main())
