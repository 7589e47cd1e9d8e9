"""Export the trained head, metrics and TRAINING.json: `python export.py --config configs/512step.yaml`."""

from occamy_mtp.commands.export import main

if __name__ == "__main__":
    raise SystemExit(main(prog="export.py"))
