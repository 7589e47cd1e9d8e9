"""`python -m occamy_mtp.validate`: the documented name of `python -m occamy_mtp.serve.validate`."""

from occamy_mtp.serve.validate import main

if __name__ == "__main__":
    raise SystemExit(main())
