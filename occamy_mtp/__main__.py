"""`python -m occamy_mtp <command> ...`: every command of the library, one convention.

A command that works on a run takes `--config RUN.yaml` and `section.key=value` overrides
(the config's own keys: `occamy_mtp.cli`), plus the few flags that are truly its own;
`python -m occamy_mtp <command> --help` lists them. Each command is the module of its name
in `occamy_mtp/commands/`. `train.py`, `export.py` and `assemble_head.py` at the top of the
repository are the same commands (`accelerate launch train.py` starts one process per GPU).
"""

from __future__ import annotations

import importlib
import sys

# name -> what it does, in the order of a run's life; each runs `occamy_mtp.commands.<name>.main`
# (`-` in a name is `_` in its module's)
COMMANDS: dict[str, str] = {
    "data": "chat data as training would see it: read, kept, excluded, windows, split",
    "inspect": "a checkpoint's or config's MTP head: layout, tensors, what serving will load",
    "generate": "a chat file's answers rewritten by the base (resumable JSONL)",
    "cache": "the offline target cache: the base's hidden states and greedy targets, once",
    "train": "train the head (accelerate launch for several GPUs; same as train.py)",
    "export": "the trained head, its metrics and TRAINING.json (same as export.py)",
    "evaluate": "served acceptance of a head on a run's heldout windows",
    "assemble": "a servable directory: the base with the trained head (same as assemble_head.py)",
    "serve-reference": "the library's own OpenAI-style server: plain or speculative decoding",
    "validate": "compare an engine serving the head with a reference engine",
    "compare": "is a run's head the reference's, byte for byte; if not, what explains it",
    "demo-models": "build the embedded default: the demo's base and donor from the sample chats",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m occamy_mtp <command> [--config RUN.yaml] [section.key=value ...] [flags]", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in COMMANDS.items()]
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
    module = importlib.import_module(f"occamy_mtp.commands.{name.replace('-', '_')}")  # imported only when run
    return module.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
