"""`python -m occamy_mtp.inspect PATH`: the documented name of `python -m occamy_mtp.checkpoint_report`."""

from occamy_mtp.checkpoint_report import main

if __name__ == "__main__":
    raise SystemExit(main())
