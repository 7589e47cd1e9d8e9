"""`python -m occamy_mtp.serve_reference`: the documented name of `python -m occamy_mtp.serve.reference_server`."""

from occamy_mtp.serve.reference_server import main

if __name__ == "__main__":
    raise SystemExit(main())
