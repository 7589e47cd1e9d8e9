"""Train the MTP head: `accelerate launch train.py --config configs/512step.yaml [section.key=value ...]`."""

from occamy_mtp.commands.train import main

if __name__ == "__main__":
    raise SystemExit(main(prog="train.py"))
