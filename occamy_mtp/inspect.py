"""`python -m occamy_mtp.inspect`: the documented name of `python -m occamy_mtp.export.checkpoint_report`."""

from occamy_mtp.export.checkpoint_report import main

if __name__ == "__main__":
    raise SystemExit(main())
