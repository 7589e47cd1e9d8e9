"""`python -m occamy_mtp.evaluate`: the documented name of `python -m occamy_mtp.evaluation.evaluate`."""

from occamy_mtp.evaluation.evaluate import main

if __name__ == "__main__":
    raise SystemExit(main())
